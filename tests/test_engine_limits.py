"""Bounded memory for everything an engine sends (``engine_limits``).

A ``/metrics`` answer, any other non-streaming answer, a decode stream's event, a
KV-event message and a replay each have a limit: past it the engine's answer is cut off
(its connection closed, nothing more read) and is that engine's fault, counted per
engine and source. The HTTP cases run in virtual time against scripted bodies; the
ZeroMQ cases over inproc (virtual time) or loopback (real clock, bounded by a guard).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import trio
import zmq

from narwhal.config import EngineLimits, parse_fleet
from narwhal.engines.client import EngineClient
from narwhal.engines.kvevents import (
    END_SEQ,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
    encode_batch,
    seq_bytes,
)
from narwhal.engines.zmqtrio import recv_multipart
from narwhal.errors import ConfigError, EngineProtocolError
from narwhal.router.fleet import LiveFleet
from narwhal.router.journal import Journal
from narwhal.router.state import RouterState
from narwhal.testing.ports import free_port

from .routerkit import engine, fleet_doc, open_stack
from .test_engine_client import DONE, URL, Connector, completion_event
from .test_kvevents import GUARD_S, Collected, RecordingContext

KIB = 1024
MIB = 1024 * KIB


class Endless(httpx.AsyncByteStream):
    """A body that never ends: ``piece`` every ``gap_s`` (an engine sending 1 MiB chunks
    for as long as it is read)."""

    def __init__(self, piece: bytes, *, gap_s: float = 0.01, head: bytes = b"") -> None:
        self.piece = piece
        self.gap_s = gap_s
        self.head = head
        self.sent = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.head:
            yield self.head
        while True:
            await trio.sleep(self.gap_s)
            self.sent += 1
            yield self.piece

    async def aclose(self) -> None:
        self.closed = True


def client_with(answer: Callable[[httpx.Request], httpx.Response], **limits: Any) -> EngineClient:
    async def handle(request: httpx.Request) -> httpx.Response:
        return answer(request)

    return EngineClient(URL, name="e0", connector=Connector(), transport=httpx.MockTransport(handle),
                        limits=EngineLimits(**limits))  # fmt: skip


# ------------------------------------------------------------------ non-streaming answers


async def test_a_metrics_answer_past_its_limit_is_cut_off(autojump_clock: trio.abc.Clock) -> None:
    """Before: an engine sending 1 MiB chunks for as long as it was read was held whole
    (2.7 GB after one 10 s refresh): no limit on the bytes read."""
    body = Endless(b"# " + b"x" * (64 * KIB - 3) + b"\n")
    client = client_with(lambda _: httpx.Response(200, stream=body), max_metrics_bytes=MIB)
    with trio.fail_after(60):
        with pytest.raises(EngineProtocolError, match=r"the answer to GET /metrics runs over 1048576 bytes "
                                                      r"\(engine_limits.max_metrics_bytes\)"):  # fmt: skip
            await client.load()
    assert body.sent == 17 and body.closed  # 16 pieces fit; the 17th is over and ends it
    assert client.bad_input.counts == {("e0", "metrics"): 1}
    assert trio.current_time() == pytest.approx(0.17)
    await client.aclose()


async def test_an_answer_that_declares_more_than_its_limit_is_not_read(autojump_clock: trio.abc.Clock) -> None:
    body = Endless(b"x" * KIB)
    client = client_with(lambda _: httpx.Response(200, headers={"content-length": str(2 * MIB)}, stream=body),
                         max_metrics_bytes=MIB, max_response_bytes=MIB + 1)  # fmt: skip
    with pytest.raises(EngineProtocolError, match=r"GET /metrics declares a body of 2097152 bytes, over 1048576"):
        await client.metrics()
    assert body.sent == 0
    with pytest.raises(EngineProtocolError, match=r"GET /v1/models declares a body of 2097152 bytes, over 1048577"):
        await client.models()
    assert body.sent == 0 and trio.current_time() == 0
    await client.aclose()


async def test_every_non_streaming_answer_is_bounded(autojump_clock: trio.abc.Clock) -> None:
    """The prefill's completion, /tokenize, /v1/models and /version: max_response_bytes."""
    bodies: list[Endless] = []

    def answer(_: httpx.Request) -> httpx.Response:
        bodies.append(Endless(b"[" * KIB))
        return httpx.Response(200, stream=bodies[-1])

    client = client_with(answer, max_response_bytes=8 * KIB)
    calls = [client.prefill({"prompt": "a b", "max_tokens": 4}), client.tokenize("a b"), client.models(),
             client.identity()]  # fmt: skip
    for call in calls:
        with pytest.raises(EngineProtocolError, match=r"runs over 8192 bytes \(engine_limits.max_response_bytes\)"):
            await call
        assert bodies[-1].sent == 9 and bodies[-1].closed
    assert client.bad_input.counts == {("e0", "completions"): 1, ("e0", "tokenize"): 1, ("e0", "models"): 1,
                                       ("e0", "version"): 1}  # fmt: skip
    await client.aclose()


async def test_an_error_answer_is_read_up_to_its_limit_and_keeps_its_message(autojump_clock: trio.abc.Clock) -> None:
    body = Endless(b" " * KIB, head=b'{"error": {"message": "overloaded"}}')
    client = client_with(lambda _: httpx.Response(503, stream=body))
    with pytest.raises(Exception, match="overloaded") as err:
        await client.prefill({"prompt": "a b", "max_tokens": 4})
    assert type(err.value).__name__ == "EngineHTTPError" and body.sent == 64 and body.closed
    await client.aclose()


async def test_a_slow_endless_metrics_answer_through_the_router_holds_no_more_than_its_limit(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The load poll and the prefix watch read p0's /metrics, which sends 64 KiB pieces
    forever: each read stops at the limit (and within its deadline), the engine's fault
    is counted, and the router serves."""
    bodies: list[Endless] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        class Wrapped(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                if request.url.host == "p0.test" and request.url.path == "/metrics":
                    bodies.append(Endless(b"#" * (64 * KIB)))
                    return httpx.Response(200, stream=bodies[-1])
                return await inner.handle_async_request(request)

        return Wrapped()

    doc = fleet_doc(server={"engine_load_poll_s": 1.0}, engine_limits={"max_metrics_bytes": MIB})
    async with open_stack(doc, wrap=wrap) as stack:
        await trio.sleep(30.0)
        resp = await stack.complete({"prompt": "a b c", "max_tokens": 2})
        assert resp.status_code == 200
        state = stack.router.state
        assert len(bodies) >= 25 and all(b.sent <= 17 and b.closed for b in bodies)
        assert state.bad_input.counts[("p0", "metrics")] == len(bodies)


# ------------------------------------------------------------------ the decode stream


def stream_client(body: httpx.AsyncByteStream, **limits: Any) -> EngineClient:
    return client_with(lambda _: httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body),
                       **limits)  # fmt: skip


ENDLESS_EVENTS = {
    # A line that never ends.
    "endless line": Endless(b"x" * KIB, head=b"data: {"),
    # Data lines that never end their event with a blank line.
    "endless event": Endless(b"data: " + b"1," * 500 + b"\n", head=b"data: [\n"),
    # One whole JSON event, too large to hold.
    "huge event": Endless(b"", head=b'data: {"choices": [{"text": "' + b"9" * (200 * KIB) + b'"}]}\n\n'),
}


@pytest.mark.parametrize("name", list(ENDLESS_EVENTS))
async def test_a_stream_event_past_its_limit_ends_the_stream(autojump_clock: trio.abc.Clock, name: str) -> None:
    body = ENDLESS_EVENTS[name]
    client = stream_client(body, max_stream_event_bytes=64 * KIB)
    with trio.fail_after(60), pytest.raises(EngineProtocolError, match="an unusable event stream"):
        async with client.decode(None, {"prompt": "a", "max_tokens": 4}) as stream:
            async for _ in stream:
                pass
    assert body.sent <= 66 and body.closed
    assert client.bad_input.counts == {("e0", "stream"): 1}
    await client.aclose()


async def test_keepalive_comments_hold_nothing(autojump_clock: trio.abc.Clock) -> None:
    """An engine that sends only comments is ended by the caller's deadline, holding no
    more than one line at a time."""
    body = Endless(b": keep-alive\n" * 100)
    client = stream_client(body, max_stream_event_bytes=64 * KIB)
    with trio.move_on_after(30):
        async with client.decode(None, {"prompt": "a", "max_tokens": 4}) as stream:
            async for _ in stream:
                pass
    assert body.sent > 2000 and body.closed and client.bad_input.counts == {}
    await client.aclose()


async def test_events_within_the_limit_stream_as_before(autojump_clock: trio.abc.Clock) -> None:
    parts = [completion_event([i]) for i in range(5)] + [DONE]
    client = stream_client(Endless(b"", head=b"".join(parts)), max_stream_event_bytes=KIB)
    async with client.decode(None, {"prompt": "a", "max_tokens": 5}) as stream:
        assert len([c async for c in stream]) == 5
    await client.aclose()


# ------------------------------------------------------------------ KV events


def big_batch(tokens: int) -> bytes:
    stored = BlockStored(block_hashes=tuple(range(tokens // 16)), parent_block_hash=None,
                         token_ids=tuple(range(tokens)), block_size=16)  # fmt: skip
    return encode_batch(EventBatch(1.0, (stored,), 0))


async def test_a_kv_message_past_its_limit_never_reaches_the_router() -> None:
    """Before: no MAXMSGSIZE, so one 400 MiB frame was received whole. Now ZeroMQ drops
    the connection that sent it (and, as it does for a protocol error, does not
    reconnect): the subscriber subscribes again, and the batches after it arrive."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = RecordingContext()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    got = Collected()
    sub = KVEventSubscriber(endpoint, on_batch=got.batch, on_reset=got.reset, context=ctx, name="e0",
                            limits=EngineLimits(kv_max_message_bytes=64 * KIB))  # fmt: skip
    small = big_batch(16)
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                seq = 0
                while not sub.live:  # the subscription reaches the publisher on ZeroMQ's time
                    pub.send_multipart([b"", seq_bytes(seq), small])
                    seq += 1
                    await trio.sleep(0.01)
                pub.send_multipart([b"", seq_bytes(seq), big_batch(64 * 1024)])  # about 200 KiB
                seq += 1
                first = sub.live
                while sub.live == first:  # after the reconnection
                    pub.send_multipart([b"", seq_bytes(seq), small])
                    seq += 1
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
    finally:
        pub.close(linger=0)
    assert all(len(e.token_ids) == 16 for e in got.stored())  # the large one never arrived
    assert sub.malformed == 0 and sub.bad_input.counts == {("e0", "kv_events"): 1}  # the dropped connection
    ctx.term()


class FloodingReplay:
    """A replay endpoint that answers a replay request with ``n`` batches (without its
    END), as fast as ZeroMQ takes them; ``forever``: until cancelled."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, n: int = 0, *, forever: bool = False,
                 end: bool = False) -> None:  # fmt: skip
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(address)
        self.n = n
        self.forever = forever
        self.end = end
        self.sent = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        ident, _empty, _start = await recv_multipart(self.sock)
        payload = big_batch(16)
        while self.forever or self.sent < self.n:
            self.sock.send_multipart([ident, b"", b"kv", seq_bytes(self.sent), payload])
            self.sent += 1
            if self.forever and self.sent % 2 == 0:
                await trio.lowlevel.checkpoint()  # the subscriber reads one message a turn: its queue never empties
        if self.end:
            self.sock.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.mark.parametrize(("limits", "why"), [({"kv_replay_max_batches": 100}, 100),
                                             ({"kv_replay_max_bytes": 64 * KIB}, 64 * KIB)])  # fmt: skip
async def test_a_replay_past_its_caps_is_abandoned_at_once(
    autojump_clock: trio.abc.Clock, limits: dict[str, int], why: int
) -> None:
    """Before: a replay endpoint that never sends END had everything it sent held (3 GB,
    then MemoryError); the replay's deadline never fired while messages kept coming."""
    ctx = zmq.Context()
    replay = FloodingReplay(ctx, "inproc://replay", 5000)
    sub = KVEventSubscriber("inproc://live", replay_endpoint="inproc://replay", context=ctx, name="e0",
                            on_batch=Collected().batch, on_reset=Collected().reset, limits=EngineLimits(**limits))  # fmt: skip
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(replay.serve)
            assert await sub._replay(0) is None
            assert trio.current_time() == 0  # abandoned at the cap, not at the deadline
    finally:
        replay.close()
        sub._close_dealer()
    assert sub.bad_input.counts == {("e0", "kv_events"): 1}
    ctx.term()


async def test_a_replay_that_never_ends_is_bounded_by_its_total_deadline() -> None:
    """Messages arrive faster than they are read, for ever: the replay still ends at
    kv_replay_timeout_s (a receive that finds a message waiting is no cancellation point)."""
    ctx = zmq.Context()
    replay = FloodingReplay(ctx, "inproc://replay-forever", forever=True)
    sub = KVEventSubscriber("inproc://live", replay_endpoint="inproc://replay-forever", context=ctx, name="e0",
                            on_batch=Collected().batch, on_reset=Collected().reset,
                            limits=EngineLimits(kv_replay_timeout_s=0.2, kv_replay_max_batches=10**9,
                                                kv_replay_max_bytes=10**12))  # fmt: skip
    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(replay.serve)
                started = trio.current_time()
                assert await sub._replay(0) is None
                assert trio.current_time() - started < 2.5
                nursery.cancel_scope.cancel()
    finally:
        replay.close()
        sub._close_dealer()
    [(key, count)] = sub.bad_input.counts.items()
    assert key == ("e0", "kv_events") and count == 1
    ctx.term()


async def test_a_replay_within_its_caps_completes(autojump_clock: trio.abc.Clock) -> None:
    ctx = zmq.Context()
    replay = FloodingReplay(ctx, "inproc://replay-ok", 100, end=True)
    sub = KVEventSubscriber("inproc://live", replay_endpoint="inproc://replay-ok", context=ctx,
                            on_batch=Collected().batch, on_reset=Collected().reset,
                            limits=EngineLimits(kv_replay_max_batches=100))  # fmt: skip
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(replay.serve)
            got = await sub._replay(0)
    finally:
        replay.close()
        sub._close_dealer()
    assert got is not None and [seq for seq, _ in got] == list(range(100))
    assert sub.bad_input.counts == {}
    ctx.term()


# ------------------------------------------------------------------ the settings


@pytest.mark.parametrize(
    ("limits", "path", "message"),
    [
        ({"max_metrics_bytes": 0}, "$.engine_limits.max_metrics_bytes", "expected an integer > 0"),
        ({"kv_replay_timeout_s": -1}, "$.engine_limits.kv_replay_timeout_s", "expected a number > 0"),
        ({"max_response_bytes": "64M"}, "$.engine_limits.max_response_bytes", "expected an integer"),
        ({"max_body": 1}, "$.engine_limits", "max_body"),
    ],
)
def test_engine_limits_errors_name_the_path(limits: dict[str, Any], path: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_fleet(fleet_doc(engine_limits=limits))
    assert err.value.path == path and message in err.value.reason


def test_engine_limits_take_a_restart() -> None:
    config = parse_fleet(fleet_doc())
    live = LiveFleet(type("State", (), {"config": config, "profiles": None})())  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as err:
        live.check(parse_fleet(fleet_doc(engine_limits={"max_metrics_bytes": MIB})), None)
    assert err.value.path == "$.engine_limits.max_metrics_bytes"
    assert "changes only with a restart" in err.value.reason


def test_the_router_gives_every_engine_its_limits() -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
                    engine_limits={"max_response_bytes": 3 * MIB, "max_stream_event_bytes": 5 * KIB})  # fmt: skip

    state = RouterState(parse_fleet(doc), journal=Journal(None))
    assert {c.limits.max_response_bytes for c in state.clients.values()} == {3 * MIB}
    assert all(c.bad_input is state.bad_input for c in state.clients.values())
