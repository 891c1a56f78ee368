"""A consumer's streams of one prefix hold its KV once: the router's KV room counts it once."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from narwhal.errors import Refused
from narwhal.router.sharedkv import SharedBlocks

from .routerkit import engine, fleet_doc, open_stack
from .test_prefix_placement import CACHING, PREFILL_FAST, prompt
from .test_pricing_rules import priced, profile, tpot


def test_a_block_that_several_streams_hit_is_counted_once() -> None:
    shared = SharedBlocks()
    shared.add([1, 2, 3], 16)
    assert shared.shared_tokens == 0 and len(shared) == 3
    assert shared.held_by_streams([1, 2, 3, 4], 16) == 48
    assert shared.held_by_streams([1, 5, 3], 16) == 16  # a leading run: the chain breaks at 5
    assert shared.held_by_streams([7], 16) == 0 and shared.held_by_streams([], 16) == 0
    shared.add([1, 2], 16)
    shared.add([1, 2, 3], 16)
    assert shared.shared_tokens == 5 * 16  # blocks 1 and 2 three times, 3 twice
    shared.remove([1, 2, 3], 16)  # the first stream ends: the others still hold all three
    assert shared.shared_tokens == 2 * 16 and shared.held_by_streams([1, 2, 3], 16) == 48
    shared.remove([1, 2], 16)
    assert shared.shared_tokens == 0 and shared.held_by_streams([1, 2, 3], 16) == 48
    shared.remove([1, 2, 3], 16)
    assert len(shared) == 0 and shared.held_by_streams([1], 16) == 0


#: A prompt of 1,100 tokens whose first 1,024 (64 blocks of 16) the consumer holds,
#: with 100 tokens of output: 1,200 tokens of KV counted in full, 176 beyond the prefix.
PREFIX_CHAIN = (list(range(1, 65)), 16)


def held_prefix(name: str) -> tuple[list[int], int]:
    return PREFIX_CHAIN


def test_a_physical_capacity_counts_the_prefix_its_streams_share_once() -> None:
    pl = priced(profiles={"p0": profile("p0"), "d0": profile("d0", capacity=5_000)}, ttft_s=None)
    # The first stream that hits the prefix shares it with no stream of this router.
    streams = [pl.choose(1100, 100, held=held_prefix)]
    assert pl.shared_kv["d0"].shared_tokens == 0
    # Each further one adds its own 176 tokens: 1,200 + 21 * 176 = 4,896 of 5,000.
    streams += [pl.choose(1100, 100, held=held_prefix) for _ in range(21)]
    assert pl.shared_kv["d0"].shared_tokens == 21 * 1024
    assert pl.quote_consumer("d0", 1100, 100, held=held_prefix("d0")) is None  # 176 more: 72 over
    # The TPOT fit still reads every stream's prompt in full (the decode steps do).
    q = pl.quote_consumer("d0", 100, 4, held=held_prefix("d0"))
    assert q is not None and q.predicted_s == pytest.approx(tpot(23, 22 * 1200 + 104))
    # Counted in full, the 23rd would pass the capacity by 4,896 + 1,200 - 5,000 tokens
    # less the prefix it shares: 72 tokens over.
    quotes = pl.price(1100, 100, frozenset(), held=held_prefix)
    assert quotes is not None and quotes[1].kv_over == 4896 + 176 - 5000
    # A prompt with nothing held (it pulls all of it) counts in full.
    assert pl.quote_consumer("d0", 60, 40) is not None and pl.quote_consumer("d0", 60, 45) is None
    # The streams end, the first one first: the others still hold the prefix once.
    streams[0].release()
    assert pl.shared_kv["d0"].shared_tokens == 20 * 1024
    for s in streams[1:]:
        s.release()
    assert pl.shared_kv["d0"].shared_tokens == 0 and len(pl.shared_kv["d0"]) == 0
    assert pl.loads["d0"].decode_kv_tokens == 0


def test_others_streams_take_the_room_this_routers_streams_take_on_the_mean() -> None:
    pl = priced(profiles={"p0": profile("p0"), "d0": profile("d0", capacity=2_728)}, ttft_s=None)
    pl.mean_kv_tokens = 1200.0
    pl.engine_reported("d0", 5, 0, 0)  # five streams that another router placed
    assert pl.mean_room_tokens is None  # nothing placed yet: they count in full
    assert pl.quote_consumer("d0", 1100, 100, held=held_prefix("d0")) is None
    pl.profiles["d0"] = profile("d0", capacity=20_000)
    streams = [pl.choose(1100, 100, held=held_prefix) for _ in range(3)]
    # The first took 1,200 tokens, the next two 176 each: a moving mean from the first.
    assert pl.mean_room_tokens == pytest.approx(1200 + 0.05 * (176 - 1200) + 0.05 * 0.95 * (176 - 1200))
    pl.profiles["d0"] = profile("d0", capacity=2_728)
    pl.mean_kv_tokens, pl.mean_room_tokens = 1200.0, 200.0
    pl.engine_reported("d0", 8, 0, 3)
    # Ours 3,600 - 2,048 shared, the others' 5 * 200, this one's 176: 2,728 of 2,728.
    q = pl.quote_consumer("d0", 1100, 100, held=held_prefix("d0"))
    assert q is not None and q.predicted_s == pytest.approx(tpot(9, 3600 + 5 * 1200 + 1200))
    assert pl.quote_consumer("d0", 1100, 101, held=held_prefix("d0")) is None
    # A tpot capacity counts the others' streams at the mean KV, in full.
    pl.profiles["d0"] = profile("d0", capacity=10_800, source="tpot")
    assert pl.quote_consumer("d0", 1100, 100, held=held_prefix("d0")) is not None
    assert pl.quote_consumer("d0", 1100, 101, held=held_prefix("d0")) is None
    for stream in streams:
        stream.release()


def test_a_prefix_in_the_cache_that_no_stream_holds_is_no_share() -> None:
    # The consumer holds both prefixes but no stream does: their blocks are free
    # (evictable) until a request hits them, so the first request of each counts in full.
    other = (list(range(101, 165)), 16)
    pl = priced(profiles={"p0": profile("p0"), "d0": profile("d0", capacity=2_000)}, ttft_s=None)
    assert pl.quote_consumer("d0", 1100, 901, held=held_prefix("d0")) is None
    first = pl.choose(1100, 100, held=held_prefix)
    assert pl.quote_consumer("d0", 1100, 100, held=other) is None  # 1,200 + 1,200 > 2,000
    assert pl.quote_consumer("d0", 1100, 100, held=held_prefix("d0")) is not None  # 1,200 + 176
    first.release()


def test_a_tpot_capacity_is_what_the_decode_steps_read_every_prompt_in_full() -> None:
    pl = priced(profiles={"p0": profile("p0"), "d0": profile("d0", capacity=5_000, source="tpot")}, ttft_s=None)
    streams = [pl.choose(1100, 100, held=held_prefix) for _ in range(4)]  # 4,800 of 5,000
    assert pl.quote_consumer("d0", 1100, 100, held=held_prefix("d0")) is None
    quotes = pl.price(1100, 100, frozenset(), held=held_prefix)
    assert quotes is not None and quotes[1].kv_over == 4800 + 1200 - 5000
    for s in streams:
        s.release()


async def test_a_refusal_for_kv_room_names_the_room_its_shared_prefix_leaves(
    autojump_clock: trio.abc.Clock,
) -> None:
    pl = priced(profiles={"p0": profile("p0"), "d0": profile("d0", capacity=2_500)}, clock=trio.current_time)
    streams = [pl.choose(1100, 100, held=held_prefix), pl.choose(1100, 100, held=held_prefix)]  # 1,376
    with pytest.raises(Refused, match=r"no KV room on d0 \(this request would pass its capacity by 252 tokens\)"):
        await pl.acquire(2300, 100, held=held_prefix)  # 1,376 + 2,400 - 1,024 held by the streams - 2,500
    for s in streams:
        s.release()


# ------------------------------------------------------------ end to end


def small_consumer() -> dict[str, Any]:
    """A producer and a consumer with room for 4,096 tokens of KV, both caching prefixes
    (no latency target, as shipped: KV room is what these tests are about)."""
    return fleet_doc(
        engine("p0", 8101, ["prefill"], prefill=PREFILL_FAST, **CACHING),
        engine("d0", 8102, ["decode"], kv_capacity_tokens=4096, **CACHING),
        controller={"admission": "refuse"},
    )


async def test_streams_of_a_prefix_the_consumer_holds_fit_where_their_prompts_in_full_would_not(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack(small_consumer(), priced=True) as stack:
        await stack.complete({"prompt": prompt("warm"), "max_tokens": 2})  # d0 now caches the prefix
        assert stack.router.state.prefix.cached_tokens(
            "d0", (await stack.router.state.tokenize({"prompt": prompt("x")}, "completions")).ids) == 1024
        waited = []

        async def one(tag: str) -> None:
            r = await stack.complete({"prompt": prompt(tag), "max_tokens": 200})
            assert r.status_code == 200, r.text

        async with trio.open_nursery() as nursery:
            # Eight streams of 1,124 prompt tokens and 200 of output: 10,592 tokens in
            # full, 1,024 + 8 * 300 held once (the consumer's 256 blocks hold them).
            for i in range(8):
                nursery.start_soon(one, f"s{i}")
            await trio.sleep(0.3)
            waited.append(stack.engine("d0").scheduler.waiting)
            assert stack.router.state.placement.loads["d0"].decode_requests == 8
            # The first of them shares the prefix with none; the seven others with it.
            metrics = stack.router.metrics.exposition().decode()
            assert 'narwhal_engine_reserved{engine="d0",kind="decode_kv_shared_tokens"} 7168.0' in metrics
            assert 'narwhal_engine_reserved{engine="d0",kind="decode_kv_tokens"} 10592.0' in metrics
        assert waited == [0]  # the consumer had room for every stream the router sent it
        assert [r["terminal_class"] for r in stack.records[1:]] == ["ok"] * 8
        assert all(r["attempts"][0]["consumer_predicted_cached_tokens"] == 1024 for r in stack.records[1:])
        assert stack.router.state.placement.shared_kv["d0"].shared_tokens == 0


async def test_streams_of_prompts_the_consumer_does_not_hold_count_in_full(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack(small_consumer(), priced=True) as stack:
        statuses: list[int] = []

        async def one(i: int) -> None:
            words = " ".join(f"u{i}w{j}" for j in range(1124))  # no prefix in common
            statuses.append((await stack.complete({"prompt": words, "max_tokens": 200})).status_code)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        # 1,324 tokens each: three fit in 4,096; the others find no room.
        assert sorted(statuses) == [200] * 3 + [503] * 5
        refusals = [r["error"] for r in stack.records if r["terminal_class"] == "refused"]
        assert all("no KV room on d0" in str(e) for e in refusals)
