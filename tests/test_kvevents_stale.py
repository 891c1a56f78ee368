"""A KV-event stream that goes silent: replay probes, stale detection, bind-mode subscription.

The probe's decisions are tested against a scripted replay endpoint (no socket; the
probe schedule in virtual time); the socket paths (a publisher that connects outward
as vLLM's does for a non-wildcard endpoint, a wrong topic, the router binding for a
publisher that connects) over loopback ZeroMQ on the real clock, each bounded by a
``fail_after`` guard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import httpx
import pytest
import trio
import zmq

from narwhal.config import EngineConfig, parse_as
from narwhal.engines.kvevents import BlockStored, EventBatch, KVEventSubscriber, encode_batch
from narwhal.engines.zmqtrio import recv_multipart
from narwhal.errors import ConfigError
from narwhal.router.fanin import combine_expositions, combine_fleets
from narwhal.router.prefix import PrefixIndex
from narwhal.testing import open_sim_fleet
from narwhal.testing.ports import free_port

from .routerkit import engine, fleet_doc, open_stack
from .test_kvevents import (
    GUARD_S,
    Collected,
    RecordingContext,
    complete,
    kv_engine,
    live_tasks,
    until,
)
from .test_prefix_placement import CACHING, PREFILL_FAST, prompt


def payload(i: int) -> bytes:
    stored = BlockStored(block_hashes=(1000 + i,), parent_block_hash=None, token_ids=(i, i), block_size=2)
    return encode_batch(EventBatch(float(i), (stored,), 0))


@attrs.define
class ScriptedReplay:
    """The engine's replay buffer, as a subscriber's probe sees it."""

    buffer: list[tuple[int, bytes]] = attrs.field(factory=list)
    topic: bytes | None = None
    asked: list[int] = attrs.field(factory=list)

    def publish(self, n: int = 1) -> None:
        start = self.buffer[-1][0] + 1 if self.buffer else 0
        self.buffer += [(s, payload(s)) for s in range(start, start + n)]


class ScriptedSubscriber(KVEventSubscriber):
    """A subscriber whose replay requests go to a :class:`ScriptedReplay`."""

    def __init__(self, replay: ScriptedReplay, got: Collected, stale: list[str | None], **kw: Any) -> None:
        super().__init__("tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2", topic="kv",
                         on_batch=got.batch, on_reset=got.reset, on_stale=stale.append, **kw)  # fmt: skip
        self.script = replay

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        await trio.lowlevel.checkpoint()
        self.script.asked.append(start)
        if self.script.topic is not None:
            self.engine_topic = self.script.topic
        return [(s, p) for s, p in self.script.buffer if s >= start]


def scripted(**kw: Any) -> tuple[ScriptedReplay, Collected, list[str | None], ScriptedSubscriber]:
    replay, got, stale = ScriptedReplay(), Collected(), []
    return replay, got, stale, ScriptedSubscriber(replay, got, stale, **kw)


async def live(sub: KVEventSubscriber, replay: ScriptedReplay, n: int = 1) -> None:
    """``n`` batches published and received live."""
    replay.publish(n)
    for seq, data in replay.buffer[-n:]:
        await sub._receive(seq, data)


async def test_an_idle_engine_is_not_stale_and_a_probe_replays_what_live_missed() -> None:
    replay, got, stale, sub = scripted()
    await sub._catch_up(0, "subscribed")
    await live(sub, replay, 2)
    await sub._probe()  # nothing new: the last batch as delivered, nothing after it
    assert replay.asked[-1] == 1 and sub.probe_gaps == 0 and got.seqs == [0, 1]
    replay.publish(2)  # two batches the live stream lost
    await live(sub, replay)
    assert got.seqs == [0, 1, 2, 3, 4]  # the live gap was replayed at once
    replay.publish(1)  # published, never received live, and live had arrived before
    await sub._probe()
    assert got.seqs == [0, 1, 2, 3, 4, 5] and sub.probe_gaps == 1 and sub.silent_probes == 0
    assert not stale and sub.stale is None


async def test_probes_that_find_batches_never_received_live_make_the_stream_stale() -> None:
    replay, got, stale, sub = scripted()
    await sub._catch_up(0, "subscribed")
    await live(sub, replay)
    replay.publish(3)
    await sub._probe()
    assert sub.silent_probes == 0 and not stale  # live arrived since the last probe
    replay.publish(2)
    await sub._probe()
    assert sub.silent_probes == 1 and not stale
    await sub._probe()  # an idle interval neither counts nor clears
    assert sub.silent_probes == 1 and not stale
    replay.publish(1)
    await sub._probe()
    assert sub.silent_probes == 2 and len(stale) == 1 and stale[0] == sub.stale
    assert got.seqs == list(range(7))  # every batch delivered, in order, by the probes
    assert stale[0] is not None and "likely connects outward instead of binding" in stale[0]
    assert "tcp://*:PORT" in stale[0] and "kv_events.bind" in stale[0]
    replay.publish(1)
    await sub._probe()
    assert len(stale) == 1  # said once
    # The first live batch: the stream is live again.
    await live(sub, replay)
    assert stale == [stale[0], None] and sub.stale is None and sub.silent_probes == 0
    assert got.seqs == list(range(9)) and len(got.resets) == 1


async def test_the_likely_cause_names_a_topic_mismatch_or_the_bound_address() -> None:
    for kw, topic, expected in (
        ({}, b"cache", "publishes under topic 'cache' and the subscription is to 'kv'"),
        ({"bind": True}, None, "on tcp://127.0.0.1:1 (bound by the router): the engine's publisher is not connected"),
        ({}, b"kv-events", "likely connects outward"),  # a topic the subscription (a prefix) matches
    ):
        replay, _, stale, sub = scripted(**kw)
        replay.topic = topic
        await sub._catch_up(0, "subscribed")
        for _ in range(2):
            replay.publish()
            await sub._probe()
        assert stale and stale[0] is not None and expected in stale[0], stale


async def test_a_probe_sees_a_restarted_engine_whose_live_stream_is_silent() -> None:
    replay, got, _, sub = scripted()
    await sub._catch_up(0, "subscribed")
    await live(sub, replay, 3)
    # A new process: numbering from 0, fewer batches than were seen.
    replay.buffer.clear()
    replay.publish(2)
    await sub._probe()
    assert replay.asked[-2:] == [2, 0]  # from the last one seen; then everything again
    assert len(got.resets) == 2 and "no longer holds batch 2" in got.resets[1]
    assert got.seqs == [0, 1, 2, 0, 1] and sub.expected == 2
    # A new process that already numbers past the last seen: its batch 1 differs.
    replay.buffer = [(s, payload(s + 100)) for s in range(4)]
    await sub._probe()
    assert len(got.resets) == 3 and got.seqs[-4:] == [0, 1, 2, 3]


def probed(sub: ScriptedSubscriber, before: Callable[[], None] = lambda: None) -> tuple[list[float], RecordingContext]:
    """Subscribe ``sub`` where nobody publishes (batches come by its probes only); the
    times of its probes (relative to now; ``before`` runs first at each) and its context."""
    sub.endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = RecordingContext()
    sub._ctx = ctx
    times: list[float] = []
    probe = sub._probe
    start = trio.current_time()

    async def timed() -> bool:
        times.append(trio.current_time() - start)
        before()
        return await probe()

    sub._probe = timed  # type: ignore[method-assign]
    return times, ctx


async def test_probes_run_every_interval_in_virtual_time(autojump_clock: trio.abc.Clock) -> None:
    replay, got, stale, sub = scripted(probe_interval_s=5.0)
    times, ctx = probed(sub, replay.publish)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.run)
        await trio.sleep(12.5)
        assert times == [5.0, 10.0]
        assert stale and stale[0] is not None and sub.probes == 2
        nursery.cancel_scope.cancel()
    assert got.seqs == [0, 1] and not ctx.open()
    ctx.term()


async def test_an_idle_engine_is_probed_ever_less_often_until_it_is_active(autojump_clock: trio.abc.Clock) -> None:
    replay, got, _stale, sub = scripted(probe_interval_s=5.0)
    times, ctx = probed(sub)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.run)
        await trio.sleep(160.0)
        # Nothing published: each wait twice the one before, up to eight intervals.
        assert times == [5.0, 15.0, 35.0, 75.0, 115.0, 155.0]
        replay.publish()  # the next probe finds it: the interval again, then twice, ...
        await trio.sleep(52.0)
        assert times[6:] == [195.0, 200.0, 210.0] and got.seqs == [0]
        sub.nudge()  # the router sends the engine requests: within an interval
        await trio.sleep(6.0)
        assert times[9:] == [217.0]
        nursery.cancel_scope.cancel()
    assert not ctx.open()
    ctx.term()


async def test_an_address_in_use_makes_the_stream_stale_and_is_warned_once(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = RecordingContext()
    holder = ctx.socket(zmq.SUB)
    holder.setsockopt(zmq.LINGER, 0)
    port = free_port()
    holder.bind(f"tcp://127.0.0.1:{port}")  # another router process holds the address
    got, stale = Collected(), []
    try:
        order: list[str] = []

        def reset(why: str) -> None:
            order.append("reset")
            got.reset(why)

        def on_stale(why: str | None) -> None:
            order.append("stale")
            stale.append(why)

        sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", bind=True, on_batch=got.batch, on_reset=reset,
                                on_stale=on_stale, context=ctx)  # fmt: skip
        with caplog.at_level(logging.DEBUG, logger="narwhal.engines.kvevents"):
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                await trio.sleep(3.5)
                nursery.cancel_scope.cancel()
    finally:
        holder.close()
    assert len(got.resets) == 4 and len(stale) == 1
    # Stale before the first reset: the approximate view starts from what the events said.
    assert order == ["stale", "reset", "reset", "reset", "reset"]
    assert stale[0] is not None and stale[0].startswith(f"ZeroMQ error binding tcp://127.0.0.1:{port}")
    assert "Address already in use" in stale[0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "binding" in warnings[0].getMessage()
    assert not ctx.open()
    ctx.term()


# ------------------------------------------------------------ the index falls back


def test_a_stale_engine_is_priced_from_an_approximate_view_seeded_by_its_events() -> None:
    index = PrefixIndex()
    index.follow("e0")
    index.enable("e0", block_size=2, capacity_tokens=8, events=True)
    index.apply("e0", EventBatch(0.0, (BlockStored(block_hashes=(11, 12), parent_block_hash=None,
                                                   token_ids=(1, 2, 3, 4), block_size=2),)))  # fmt: skip
    assert index.exact("e0") and index.cached_tokens("e0", [1, 2, 3, 4, 5]) == 4
    index.placed("e0", [7, 8, 9, 10, 11])  # an exact view does not learn from placements
    assert index.cached_tokens("e0", [7, 8, 9, 10, 11]) == 0

    index.stale("e0")
    assert not index.exact("e0") and "e0" in index.fallbacks
    assert index.cached_tokens("e0", [1, 2, 3, 4, 5]) == 4  # what the events last said
    index.placed("e0", [7, 8, 9, 10, 11])  # now the placements count
    assert index.cached_tokens("e0", [7, 8, 9, 10, 11]) == 4
    # The event view still follows the replays, and a lost event resets it alone.
    index.reset("e0", events_only=True)
    assert index.cached_tokens("e0", [7, 8, 9, 10, 11]) == 4
    index.apply("e0", EventBatch(0.0, (BlockStored(block_hashes=(21,), parent_block_hash=None,
                                                   token_ids=(5, 6), block_size=2),)))  # fmt: skip

    index.live("e0")
    assert index.exact("e0") and not index.fallbacks
    assert index.cached_tokens("e0", [7, 8, 9, 10, 11]) == 0 and index.cached_tokens("e0", [5, 6, 7]) == 2
    # Chain ids the fallback held were given back: only the event view's remain.
    assert len(index.chains) == 1


def test_an_engine_stale_before_its_configuration_is_known_falls_back_once_it_is() -> None:
    index = PrefixIndex()
    index.follow("e0")
    index.stale("e0")
    assert not index.fallbacks and not index.exact("e0")
    index.enable("e0", block_size=2, capacity_tokens=8, events=True)
    assert "e0" in index.fallbacks and index.fallbacks["e0"].capacity_blocks == 4
    index.placed("e0", [1, 2, 3])
    assert index.cached_tokens("e0", [1, 2, 3]) == 2
    index.reset("e0")  # a new generation: both views are cleared
    assert index.cached_tokens("e0", [1, 2, 3]) == 0
    index.forget("e0")
    assert not index.fallbacks and not index.stale_engines and len(index.chains) == 0


# ------------------------------------------------------------ configuration


def kv_doc(kv: dict[str, Any]) -> dict[str, Any]:
    return {"name": "e0", "url": "http://e0:8000", "roles": ["prefill"], "kv_events": kv}


@pytest.mark.parametrize(("kv", "path", "message"), [
    ({"replay_endpoint": "tcp://h:5558"}, r"\$\.kv_events\.endpoint", "expected the engine's PUB endpoint"),
    ({"endpoint": "tcp://h:5557", "bind": "tcp://*:5557"}, r"\$\.kv_events\.bind", "not both"),
    ({"bind": "ipc:///tmp/x"}, r"\$\.kv_events\.bind", "to bind"),
    ({"bind": "tcp://*:0"}, r"\$\.kv_events\.bind", "to bind"),
    ({"endpoint": "tcp://h:5557", "probe_interval_s": 0}, r"\$\.kv_events\.probe_interval_s", "> 0"),
])  # fmt: skip
def test_kv_events_config_errors_name_the_path(kv: dict[str, Any], path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"{message}.*{path}"):
        parse_as(EngineConfig, kv_doc(kv))


def test_kv_events_bind_accepts_a_wildcard_or_an_interface() -> None:
    for bind in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.0.0.2:5557", "tcp://[::]:5557"):
        kv = parse_as(EngineConfig, kv_doc({"bind": bind, "replay_endpoint": "tcp://e0:5558"})).kv_events
        assert kv is not None and kv.bind == kv.address == bind and kv.endpoint is None
        assert kv.probe_interval_s == 5.0


# ------------------------------------------------------------ over loopback


async def subscribe(config: EngineConfig, got: Collected, stale: list[str | None], **kw: Any) -> KVEventSubscriber:
    kv = config.kv_events
    assert kv is not None
    options: dict[str, Any] = {"replay_endpoint": kv.replay_endpoint, "topic": kv.topic,
                               "bind": kv.bind is not None, "probe_interval_s": 0.1, "replay_timeout_s": 2.0}  # fmt: skip
    options.update(kw)
    return KVEventSubscriber(kv.address, on_batch=got.batch, on_reset=got.reset, on_stale=stale.append, **options)


async def until_stale(stale: Sequence[str | None], client: Any, base: int) -> int:
    """Requests until the subscriber says stale (each probe needs a new batch); returns the next base."""
    while not stale:
        await complete(client, list(range(base, base + 10)))
        base += 20
        await trio.sleep(0.15)
    return base


@pytest.mark.parametrize(("sim", "topic", "cause"), [
    # vLLM with a non-wildcard endpoint connects its PUB socket; so does the router's SUB.
    ({"kv_events_connect": True}, "kv-events", "connects outward instead of binding"),
    ({}, "other", "publishes under topic 'kv-events' and the subscription is to 'other'"),
])  # fmt: skip
async def test_a_stream_that_delivers_nothing_live_is_found_stale_with_its_cause(
    sim: dict[str, Any], topic: str, cause: str
) -> None:
    """Nothing arrives live, the replay endpoint still answers: every batch is
    delivered by the probes, in order, and the stream is stale with its likely cause."""
    config = kv_engine(**sim)
    got, stale = Collected(), []
    sub = await subscribe(config, got, stale, topic=topic)
    with trio.fail_after(GUARD_S):
        async with open_sim_fleet([config]) as fleet, fleet.client("e0", timeout=None) as client:
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                await until_stale(stale, client, 10)
                nursery.cancel_scope.cancel()
    assert sub.live == 0 and sub.delivered >= 2 and got.seqs == list(range(len(got.seqs)))
    assert stale[0] is not None and cause in stale[0]


async def test_a_silent_stream_is_stale_until_live_batches_flow_again() -> None:
    config = kv_engine()
    got, stale = Collected(), []
    sub = await subscribe(config, got, stale)
    with trio.fail_after(GUARD_S):
        async with open_sim_fleet([config]) as fleet, fleet.client("e0", timeout=None) as client:
            publisher = fleet.engines["e0"].kv_publisher
            assert publisher is not None
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                # The SUB socket joins on ZeroMQ's time (a batch published before it has
                # joined is delivered by a probe): requests until one batch arrives live.
                base = 10
                while not sub.live:
                    await complete(client, list(range(base, base + 10)))
                    base += 20
                    await trio.sleep(0.05)
                # Everything published so far delivered, and its live copies landed.
                await until(lambda: sub.expected == publisher.published)
                await trio.sleep(0.2)
                live = sub.live
                publisher.drop_next = 10**6  # nothing more goes out live
                base = await until_stale(stale, client, base)
                assert stale == [sub.stale] and sub.live == live
                publisher.drop_next = 0
                await complete(client, list(range(base, base + 10)))
                await until(lambda: len(stale) == 2)
                nursery.cancel_scope.cancel()
    assert stale[1] is None and sub.stale is None and sub.live == live + 1
    assert got.seqs == list(range(len(got.seqs))) and len(got.resets) == 1  # nothing lost on the way


async def test_bind_mode_the_router_binds_and_the_engine_connects() -> None:
    port = free_port()
    config = kv_engine()
    assert config.kv_events is not None
    config = attrs.evolve(config, kv_events=attrs.evolve(config.kv_events, endpoint=None, bind=f"tcp://*:{port}"))
    got, stale = Collected(), []
    ctx = RecordingContext()
    sub = await subscribe(config, got, stale, context=ctx)
    with trio.fail_after(GUARD_S):
        async with open_sim_fleet([config]) as fleet, fleet.client("e0", timeout=None) as client:
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                assert live_tasks("KVEventSubscriber")
                # The engine's publisher connects (and reconnects) on its own: wait for a batch to arrive live.
                base = 10
                while not sub.live:
                    await complete(client, list(range(base, base + 10)))
                    base += 20
                    await trio.sleep(0.05)
                await trio.sleep(0.35)  # probes run meanwhile, finding nothing missed
                # (Stale at most while the engine's publisher was still connecting, on a loaded host.)
                assert sub.probes >= 2 and sub.stale is None and (not stale or stale[-1] is None)
                assert [s.type for s in ctx.open() if s.type != zmq.DEALER] == [zmq.SUB]  # (a probe's DEALER may be open)
                nursery.cancel_scope.cancel()
            assert not live_tasks("KVEventSubscriber")
    assert got.seqs == list(range(len(got.seqs))) and got.stored()
    assert not ctx.open()
    ctx.term()


# ------------------------------------------------------------ through the router


def prefix_fleet(kv: dict[str, Any]) -> dict[str, Any]:
    return fleet_doc(
        {**engine("p0", 8101, ["prefill"], prefill=PREFILL_FAST, **CACHING), "kv_events": kv},
        engine("d0", 8102, ["decode"]),
        controller={"slo": {"ttft_s": 0.5, "tpot_s": 0.05}},
    )


async def test_the_router_prices_a_stale_engine_approximately_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    kv = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
          "probe_interval_s": 0.1}  # fmt: skip
    with trio.fail_after(GUARD_S), caplog.at_level(logging.INFO, logger="narwhal.router.prefix"):
        async with open_stack(prefix_fleet(kv), priced=True) as stack:
            state = stack.router.state
            stack.net.listen("admin.test", 8001, stack.router.admin)
            sub = state.kv_subscribers["p0"]
            publisher = stack.engine("p0").kv_publisher
            n = 0
            while not sub.live:  # the SUB socket joins on ZeroMQ's time (a probe brings what it missed)
                n += 1
                await stack.complete({"prompt": prompt(f"a{n}"), "max_tokens": 2})
                await trio.sleep(0.05)
            await until(lambda: sub.expected == publisher.published)
            await trio.sleep(0.2)  # live copies of what a probe delivered first land before the drop
            with stack.router.events.subscribe() as events:
                assert state.prefix.exact("p0") and not state.prefix.fallbacks
                publisher.drop_next = 10**6  # the engine goes on publishing, nothing arrives live
                n = 0
                while sub.stale is None:
                    n += 1
                    await stack.complete({"prompt": prompt(f"b{n}"), "max_tokens": 2})
                    await trio.sleep(0.15)
                assert not state.prefix.exact("p0") and "p0" in state.prefix.fallbacks
                # Seeded with what the replayed events said: the shared prefix is held.
                ids = (await state.tokenize({"prompt": prompt("c")}, "completions")).ids
                assert state.prefix.cached_tokens("p0", ids) == 1024
                resp = await stack.complete({"prompt": prompt("c"), "max_tokens": 2})
                assert resp.status_code == 200
                attempt = stack.records[-1]["attempts"][0]
                assert attempt["predicted_cached_tokens"] == attempt["cached_tokens"] == 1024

                async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
                    health = (await admin.get("/health")).json()["engines"]
                    fleet = {e["name"]: e for e in (await admin.get("/fleet")).json()["engines"]}
                    metrics = (await admin.get("/metrics")).text
                for kv_state in (health["p0"]["kv_events"], fleet["p0"]["kv_events"]):
                    assert kv_state["state"] == "stale" and "connects outward" in kv_state["detail"]
                assert "kv_events" not in health["d0"] and "kv_events" not in fleet["d0"]
                assert 'narwhal_kv_events_stale{engine="p0"} 1.0' in metrics
                assert 'narwhal_prefix_index_blocks{engine="p0",source="placements"}' in metrics
                assert 'narwhal_prefix_index_blocks{engine="p0",source="events"}' in metrics
                warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert any(m.startswith("engine p0: its KV-event stream is stale") and "tcp://*:PORT" in m
                           for m in warnings), warnings  # fmt: skip

                # Live batches again: the exact view prices the engine's hits.
                publisher.drop_next = 0
                await stack.complete({"prompt": prompt("d"), "max_tokens": 2})
                await until(lambda: sub.stale is None)
                assert state.prefix.exact("p0") and not state.prefix.fallbacks
                assert state.kv_events_status("p0") == {"state": "live", "detail": None, "delivered": sub.delivered,
                                                        "probe_gaps": sub.probe_gaps}  # fmt: skip
                seen = []
                while True:
                    try:
                        seen.append(events.receive.receive_nowait())
                    except trio.WouldBlock:
                        break
            prefix_events = [(e["engine"], e["event"]) for e in seen if e["type"] == "prefix"]
            assert prefix_events == [("p0", "stale"), ("p0", "live")]


async def test_the_router_binds_for_an_engine_whose_publisher_connects() -> None:
    kv = {"bind": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
          "probe_interval_s": 0.1}  # fmt: skip
    with trio.fail_after(GUARD_S):
        async with open_stack(prefix_fleet(kv), priced=True) as stack:
            state = stack.router.state
            sub = state.kv_subscribers["p0"]
            assert sub.bind and state.prefix.exact("p0")
            ids = (await state.tokenize({"prompt": prompt("b")}, "completions")).ids
            n = 0
            while not sub.live:  # the engine's publisher connects on its own time
                n += 1
                await stack.complete({"prompt": prompt(f"a{n}"), "max_tokens": 2})
                await trio.sleep(0.05)
            await until(lambda: state.prefix.cached_tokens("p0", ids) == 1024)
            assert sub.stale is None and state.prefix.exact("p0")


@pytest.mark.parametrize("bind", [False, True])
async def test_a_subscriber_cancelled_mid_probe_closes_every_socket(bind: bool) -> None:
    """The replay endpoint never answers: the probe's DEALER is open when the
    subscriber is cancelled, beside its SUB socket (bound or connected)."""
    ctx = RecordingContext()
    got, stale = Collected(), []
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = KVEventSubscriber(endpoint, bind=bind, replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
                            on_batch=got.batch, on_reset=got.reset, on_stale=stale.append,
                            probe_interval_s=0.05, replay_timeout_s=0.2, context=ctx)  # fmt: skip
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sub.run)
            # Connected, the SUB socket's connection has a monitor (a PAIR socket).
            kinds = [zmq.SUB, zmq.DEALER] if bind else [zmq.SUB, zmq.PAIR, zmq.DEALER]
            await until(lambda: sub.probes and len(ctx.open()) == len(kinds))
            assert sorted(s.type for s in ctx.open()) == sorted(kinds)
            nursery.cancel_scope.cancel()
        assert not live_tasks("KVEventSubscriber")
    assert not ctx.open() and not stale and sub.probes >= 1
    ctx.term()


async def test_a_message_received_as_the_wait_is_cancelled_is_not_lost() -> None:
    """The subscriber waits for live batches under the probe's deadline: a message taken
    off the socket when that deadline fires must still be returned, not dropped."""
    ctx = RecordingContext()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        pub.bind("inproc://kv-test")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect("inproc://kv-test")
        while not sub.poll(10):  # the subscription reaches the publisher asynchronously
            pub.send_multipart([b"kv", b"\0" * 8, b"x"])
        frames = None
        with trio.CancelScope() as scope:
            scope.cancel()  # the deadline has passed while the message was waiting
            frames = await recv_multipart(sub)
        assert frames == [b"kv", b"\0" * 8, b"x"]
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
    ctx.term()


def test_workers_combine_a_stale_stream_as_stale() -> None:
    def exposition(stale: int) -> str:
        return ("# HELP narwhal_kv_events_stale Stale.\n# TYPE narwhal_kv_events_stale gauge\n"
                f'narwhal_kv_events_stale{{engine="p0"}} {stale}\n')  # fmt: skip

    assert 'narwhal_kv_events_stale{engine="p0"} 1.0' in combine_expositions([exposition(0), exposition(1)]).decode()
    live = {"state": "live", "detail": None, "delivered": 3, "probe_gaps": 0}
    stale = {"state": "stale", "detail": "why", "delivered": 2, "probe_gaps": 2}
    load = {"breaker": "ok", "streak": 0, "in_flight": 0, "reserved_prefill_tokens": 0, "reserved_decode_requests": 0}
    fleets = [{"engines": [{"name": "p0", **load, "kv_events": kv}], "in_flight": 0, "slo": {}} for kv in (live, stale, live)]
    assert combine_fleets(fleets)["engines"][0]["kv_events"] == stale
