"""Ownership: one nursery per request, client disconnects, shutdown, the journal file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.lowlevel
import trio.testing

from narwhal.config import parse_fleet
from narwhal.http import ServerLimits
from narwhal.router.journal import Journal
from narwhal.router.service import open_router
from narwhal.testing import open_memory_network, open_sim_fleet

from .routerkit import ROUTER_HOST, ROUTER_PORT, fleet_doc, open_stack

BODY = {"prompt": "one two three four", "max_tokens": 1000}


async def test_client_disconnect_mid_stream_cancels_the_decode_leg(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        consumer = stack.engine("d0")
        stream = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        body = json.dumps({**BODY, "stream": True}).encode()
        await stream.send_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        received = b""
        while received.count(b"data: ") < 3:
            received += await stream.receive_some()
        assert received.startswith(b"HTTP/1.1 200 ")
        assert consumer.stats.active == 1
        await stream.aclose()
        # The client closed its connection: the router cancels everything at once, or
        # (a request younger than the server's disconnect_check_s) once it has lasted that.
        await trio.sleep(ServerLimits().disconnect_check_s)
        await trio.testing.wait_all_tasks_blocked()
        assert stack.router.state.in_flight == 0
        assert stack.router.state.placement.open_reservations == 0
        assert consumer.stats.active == 0  # the decode engine saw its connection closed
        assert consumer.stats.aborted == 1
    [rec] = stack.records
    assert rec["terminal_class"] == "client_cancelled"
    assert 0 < rec["output_len"] < 1000


async def test_client_disconnect_during_prefill(autojump_clock: trio.abc.Clock) -> None:
    # A 1000-token prompt prefills for 0.11 s: the client gives up long before.
    async with open_stack() as stack:
        producer, consumer = stack.engine("p0"), stack.engine("d0")
        with trio.move_on_after(0.005):
            await stack.complete({"prompt": " ".join(["w"] * 1000), "max_tokens": 5})
        await trio.sleep(1.0)
        assert stack.router.state.in_flight == 0
        # The prefill reached the producer and was aborted there (its connection closed),
        # never completed; no decode was ever sent.
        assert producer.stats.requests == 1
        assert (producer.stats.aborted, producer.stats.completed, producer.stats.active) == (1, 0, 0)
        assert consumer.requests_seen == [] and consumer.stats.requests == 0
    [record] = stack.records
    assert record["terminal_class"] == "client_cancelled"
    assert record["ttft_s"] is None and record["attempts"][0]["decode_request_id"] is not None


async def test_graceful_shutdown_drains_and_flushes_the_journal(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    path = tmp_path / "journal.jsonl"
    doc = fleet_doc(journal={"path": str(path)}, server={"shutdown_grace_s": 30.0})
    config = parse_fleet(doc)
    results: list[int] = []
    async with open_memory_network() as net, open_sim_fleet(config, network=net) as fleet:
        async with open_router(config, transport=fleet.transport) as router:
            net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
            async with httpx.AsyncClient(transport=net.transport(), base_url=f"http://{ROUTER_HOST}:{ROUTER_PORT}", timeout=None) as client:

                async def one() -> None:
                    resp = await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 200})
                    results.append(resp.status_code)

                async with trio.open_nursery() as nursery:
                    for _ in range(20):
                        nursery.start_soon(one)
                    await trio.sleep(0.1)
                    assert router.state.in_flight == 20
                    await router.shutdown(30.0)
    assert results == [200] * 20
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 20
    assert {line["terminal_class"] for line in lines} == {"ok"}


async def test_shutdown_grace_expiry_journals_every_request(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    path = tmp_path / "journal.jsonl"
    doc = fleet_doc(journal={"path": str(path)})
    config = parse_fleet(doc)
    async with open_memory_network() as net, open_sim_fleet(config, network=net) as fleet:
        async with open_router(config, transport=fleet.transport) as router:
            net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
            async with httpx.AsyncClient(transport=net.transport(), base_url=f"http://{ROUTER_HOST}:{ROUTER_PORT}", timeout=None) as client:
                async with trio.open_nursery() as nursery:
                    for _ in range(5):
                        nursery.start_soon(_stream_quietly, client)
                    await trio.sleep(0.1)
                    await router.shutdown(1.0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 5
    assert {line["terminal_class"] for line in lines} == {"shutdown"}


async def _stream_quietly(client: httpx.AsyncClient) -> None:
    try:
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
            async for _ in resp.aiter_bytes():
                pass
    except httpx.HTTPError:
        pass


async def test_journal_never_blocks_and_never_drops() -> None:
    from narwhal.router.journal import RequestRecord

    journal = Journal(None, queue_size=2)
    got: list[dict] = []
    journal.add_listener(got.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        for i in range(50):
            journal.record(RequestRecord(request_id=str(i), arrival=0.0, route="completions", terminal_class="ok"))
        assert journal.overflowed > 0
        await journal.aclose()
    assert journal.written == 50
    assert len(got) == 50
    with pytest.raises(ValueError, match="unknown terminal class"):
        Journal(None).record(RequestRecord(request_id="x", arrival=0.0, route="c", terminal_class="weird"))


class _WholeStreams(httpx.AsyncBaseTransport):
    """The simulated engines, except that a decode stream arrives in one piece at its end
    (an engine that produced everything while the router was not reading)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            body = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers, content=body)
        return response


async def test_tpot_when_the_last_tokens_and_done_arrive_together(autojump_clock: trio.abc.Clock) -> None:
    config = parse_fleet(fleet_doc())
    records: list[dict[str, Any]] = []
    journal = Journal(None)
    journal.add_listener(records.append)
    async with open_memory_network() as net, open_sim_fleet(config, network=net) as fleet:
        async with open_router(config, transport=_WholeStreams(fleet.transport), journal=journal) as router:
            net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
            async with httpx.AsyncClient(
                transport=net.transport(), base_url=f"http://{ROUTER_HOST}:{ROUTER_PORT}"
            ) as client:
                async with client.stream(
                    "POST", "/v1/completions", json={"prompt": "a b c", "max_tokens": 6, "stream": True}
                ) as resp:
                    body = b"".join([part async for part in resp.aiter_bytes()])
    assert resp.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
    [record] = records
    assert record["terminal_class"] == "ok" and record["output_len"] == 6
    # Six tokens at the sim's 5 ms a step arrived after the prefill: not a zero TPOT.
    assert record["tpot_s"] == pytest.approx(0.030 / 5, rel=0.5)
