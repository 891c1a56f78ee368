"""The token relay (``server.token_relay: "thread"``, the default), over loopback.

The relay carries a started stream's token events from the engine socket to the client
socket off the event loop, and gives the stream back to its task for anything else.
Each test runs the same requests through a router with the relay and one without
(``"loop"``) and holds the relay to the loop's results: the bytes a client reads (but
the ids each router makes up), the journal's terminal class, status and output length,
under every stream fault the simulated engines script, a client that reads slowly and a
client that hangs up.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from narwhal.config import FaultSpec, parse_fleet
from narwhal.errors import ConfigError
from narwhal.router.journal import Journal
from narwhal.router.relay import TokenRelay
from narwhal.router.service import Router, open_router
from narwhal.testing import SimFleet, open_sim_fleet
from narwhal.testing.ports import free_port

from .routerkit import SIM

#: The relay's C loop (where it was built), its Python loop, and no relay.
MODES = ("thread", "python", "loop")


def _engine(name: str, roles: list[str]) -> dict[str, Any]:
    return {
        "name": name, "url": f"http://127.0.0.1:{free_port()}", "roles": roles,
        "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": free_port()},
        "sim": {**SIM, "max_model_len": 8192, "decode": {"c0": 0.001, "c1": 0.0, "c2": 0.0}},
    }  # fmt: skip


@asynccontextmanager
async def _router(mode: str, **engine: Any) -> AsyncIterator[tuple[Router, SimFleet, int, list[dict[str, Any]]]]:
    """Simulated engines and a router with ``server.token_relay: mode`` on loopback."""
    config = parse_fleet({
        "server": {
            "host": "127.0.0.1", "port": free_port(), "admin_port": 0,
            "token_relay": "loop" if mode == "loop" else "thread",
        },
        "engine": engine,
        "engines": [_engine("p0", ["prefill"]), _engine("d0", ["decode"])],
    })  # fmt: skip
    records: list[dict[str, Any]] = []
    journal = Journal(None)
    journal.add_listener(records.append)
    async with open_sim_fleet(config, sockets=True) as fleet, open_router(config, journal=journal) as router:
        if mode == "python":
            router.state.relay = TokenRelay(compiled=False)
        async with trio.open_nursery() as nursery:
            [(_, port)] = await nursery.start(router.serve_tcp)
            yield router, fleet, port, records
            nursery.cancel_scope.cancel()


async def _ask(port: int, body: dict[str, Any], *, rcvbuf: int = 0, read_pause_s: float = 0.0) -> bytes:
    """A streamed request's whole answer (head and body) over a socket of its own."""
    sock = trio.socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    path = b"/v1/chat/completions" if "messages" in body else b"/v1/completions"
    await sock.send(
        b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (path, len(data), data)
    )
    parts = []
    with sock:
        while piece := await sock.recv(1024 if rcvbuf else 65536):
            parts.append(piece)
            if read_pause_s:
                await trio.sleep(read_pause_s)
    return b"".join(parts)


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for ``condition`` (records are journaled after the answer's last byte)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await trio.sleep(0.01)
    raise AssertionError("timed out waiting")


def _events(answer: bytes) -> list[Any]:
    """The SSE events of a chunked answer, parsed, with the ids a router makes up removed."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    raw = bytearray()
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        raw += body[:size]
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]
    events: list[Any] = []
    for event in bytes(raw).split(b"\n\n"):
        if not event:
            continue
        assert event.startswith(b"data: "), event
        data = event[6:]
        if data == b"[DONE]":
            events.append("[DONE]")
            continue
        obj = json.loads(data)
        obj.pop("id", None)
        obj.pop("created", None)
        events.append(obj)
    return events


def _texts(events: list[Any]) -> str:
    out = []
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices", ()):
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


async def _both(body: dict[str, Any], *, faults: tuple[FaultSpec, ...] = (), **options: Any) -> dict[str, Any]:
    """The answers and records of ``body`` through a router with the relay and one without."""
    seen: dict[str, Any] = {}
    engine = options.pop("engine", {})
    for mode in MODES:
        async with _router(mode, **engine) as (router, fleet, port, records):
            for spec in faults:
                fleet.engines["d0"].inject(spec)
            answers = [await _ask(port, body, **options) for _ in range(3)]
            await _until(lambda: len(records) >= 3)
            relay = router.state.relay
            seen[mode] = {
                "events": [_events(a) for a in answers],
                # (The error names the tokens the stream had: those the relay carried too.)
                "records": [(r["terminal_class"], r["status"], r["output_len"], r["error"]) for r in records],
                "tpot": [r["tpot_s"] for r in records],
                "carried": None if relay is None else relay.carried,
                "in_flight": (router.state.in_flight, router.state.in_flight_by_engine["d0"]),
            }
            if relay is not None:
                assert not relay.active, "a stream was left with the relay"
    return seen


async def test_streams_through_the_relay_are_the_loops() -> None:
    seen = await _both({"prompt": "carried off the loop", "max_tokens": 300, "stream": True})
    loop = seen["loop"]
    assert loop["carried"] is None and loop["records"] == [("ok", 200, 300, None)] * 3
    for mode in ("thread", "python"):
        assert seen[mode]["carried"] >= 3
        assert seen[mode]["records"] == loop["records"]
        assert seen[mode]["events"] == loop["events"]
        assert seen[mode]["in_flight"] == (0, 0)
        # The engine steps a token a millisecond: TPOT on the event loop's clock, as without.
        assert all(0.0005 < tpot < 0.02 for tpot in seen[mode]["tpot"]), seen[mode]["tpot"]
    assert all(0.0005 < tpot < 0.02 for tpot in loop["tpot"])
    assert all(len(_texts(e)) > 0 and e[-1] == "[DONE]" for e in loop["events"])


async def test_chat_with_usage_through_the_relay_is_the_loops() -> None:
    body = {
        "messages": [{"role": "user", "content": "usage at the end"}], "max_tokens": 120, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    seen = await _both(body)
    assert seen["thread"]["events"] == seen["python"]["events"] == seen["loop"]["events"]
    assert seen["thread"]["records"] == seen["python"]["records"] == seen["loop"]["records"] == [("ok", 200, 120, None)] * 3
    [usage] = [e for e in seen["thread"]["events"][0] if isinstance(e, dict) and e.get("usage")]
    assert usage["usage"]["completion_tokens"] == 120


@pytest.mark.parametrize(
    "fault",
    [
        FaultSpec(kind="close_before_done", on="decode", after_tokens=60),
        FaultSpec(kind="error_in_stream", on="decode", after_tokens=60, status=500, message="boom"),
        FaultSpec(kind="silence_after", on="decode", after_tokens=60, delay_s=3.0),
    ],
    ids=lambda spec: spec.kind,
)
async def test_a_stream_fault_while_carried_ends_as_on_the_loop(fault: FaultSpec) -> None:
    seen = await _both(
        {"prompt": "a fault mid-stream", "max_tokens": 300, "stream": True},
        faults=(fault,),
        engine={"decode_read_timeout_s": 0.5},
    )
    loop = seen["loop"]
    assert {r[0] for r in loop["records"]} != {"ok"}
    assert loop["in_flight"] == (0, 0)
    for mode in ("thread", "python"):
        assert seen[mode]["carried"] >= 3
        assert seen[mode]["records"] == loop["records"]
        assert seen[mode]["events"] == loop["events"]
        assert seen[mode]["in_flight"] == (0, 0)


async def test_a_client_that_reads_slowly_gets_every_byte_in_order() -> None:
    # A 2 KiB receive buffer read a KiB at a time: the relay's writes fall short, and the
    # task writes the rest under its backpressure rules.
    seen = await _both(
        {"prompt": "a slow reader", "max_tokens": 400, "stream": True}, rcvbuf=2048, read_pause_s=0.002
    )
    assert seen["thread"]["events"] == seen["python"]["events"] == seen["loop"]["events"]
    assert seen["thread"]["records"] == seen["python"]["records"] == [("ok", 200, 400, None)] * 3


@pytest.mark.parametrize("mode", ["thread", "python"])
async def test_a_client_that_hangs_up_mid_stream_ends_its_request_at_once(mode: str) -> None:
    async with _router(mode) as (router, fleet, port, records):
        relay = router.state.relay
        assert relay is not None
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": "hang up", "max_tokens": 5000, "stream": True}).encode()
        await sock.send(
            b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        received = b""
        while len(received) < 20_000:  # well into the stream: carried by now
            received += await sock.recv(65536)
        assert relay.carried >= 1 and relay.active
        sock.close()
        seen = received.count(b'"finish_reason":null')  # the token events the client read
        await _until(lambda: bool(records))
        assert [(r["terminal_class"], r["status"]) for r in records] == [("client_cancelled", 200)]
        # Every token forwarded counts, those the relay carried too.
        assert seen > 50 and seen <= records[0]["output_len"] < 5000
        assert not relay.active
        assert router.state.in_flight == 0 and router.state.in_flight_by_engine["d0"] == 0
        # The engine saw its decode connection closed (no stream left running there).
        await _until(lambda: not fleet.engines["d0"].running)


@pytest.mark.parametrize("mode", ["thread", "python"])
async def test_the_relay_thread_stops_with_the_router(mode: str) -> None:
    async with _router(mode) as (router, _, port, _records):
        relay = router.state.relay
        assert relay is not None
        await _ask(port, {"prompt": "one", "max_tokens": 50, "stream": True})
        thread = relay._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()


async def test_the_relay_needs_the_system_clock(autojump_clock: trio.testing.MockClock) -> None:
    assert not TokenRelay().usable


def test_the_c_loop_is_the_default_where_it_was_built() -> None:
    pytest.importorskip("narwhal._crelay")
    assert TokenRelay().compiled and not TokenRelay(compiled=False).compiled


def test_token_relay_loop_turns_it_off() -> None:
    config = parse_fleet({"server": {"token_relay": "loop"}, "engines": [_engine("p0", ["prefill", "decode"])]})
    assert config.server.token_relay == "loop"
    with pytest.raises(ConfigError, match=r"\$\.server\.token_relay"):
        parse_fleet({"server": {"token_relay": "threads"}, "engines": [_engine("p0", ["prefill", "decode"])]})
