"""The router's per-engine prefix index, exact from KV events and approximate from placements."""

from __future__ import annotations

import random
from typing import Any

import trio

from narwhal.engines.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from narwhal.router.prefix import EventView, PlacementView, PrefixIndex, hit_limit
from tests.test_sim_engine import one_engine


def stored(hashes: list[int], parent: int | None, tokens: list[int], bs: int = 2, **kw: Any) -> EventBatch:
    return EventBatch(0.0, (BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent,
                                        token_ids=tuple(tokens), block_size=bs, **kw),))  # fmt: skip


def test_hit_limit_leaves_the_last_token_to_compute() -> None:
    assert [hit_limit(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


def test_event_view_follows_the_chain_by_tokens() -> None:
    view = EventView(2)
    view.apply(stored([11, 12], None, [1, 2, 3, 4]))
    view.apply(stored([13], 12, [5, 6]))
    assert view.cached_blocks([1, 2, 3, 4, 5, 6, 7], 3) == 3
    assert view.cached_blocks([1, 2, 3, 4, 5, 6, 7], 2) == 2  # the limit holds
    assert view.cached_blocks([1, 2, 9, 9, 5, 6, 7], 3) == 1  # a different middle block
    assert view.cached_blocks([3, 4, 5, 6, 7], 2) == 0  # the same tokens at another position
    view.apply(EventBatch(0.0, (BlockRemoved(block_hashes=(12,)),)))
    assert view.cached_blocks([1, 2, 3, 4, 5, 6, 7], 3) == 1  # the chain breaks at the gap
    view.apply(EventBatch(0.0, (AllBlocksCleared(),)))
    assert len(view) == 0 and view.cached_blocks([1, 2, 3], 1) == 0


def test_event_view_counts_copies_and_ignores_what_a_plain_prompt_cannot_hit() -> None:
    view = EventView(2)
    view.apply(stored([11], None, [1, 2]))
    view.apply(stored([11], None, [1, 2]))  # vLLM caches identical blocks twice
    view.apply(EventBatch(0.0, (BlockRemoved(block_hashes=(11,)),)))
    assert view.cached_blocks([1, 2, 3], 1) == 1  # one copy is left
    view.apply(stored([21], None, [7, 8], lora_name="adapter"))
    view.apply(stored([22], None, [5, 6], extra_keys=(("salt",),)))
    view.apply(stored([23], None, [9, 9, 9, 9], bs=4))  # another block size
    assert view.cached_blocks([7, 8, 0], 1) == 0 and view.cached_blocks([5, 6, 0], 1) == 0
    assert view.cached_blocks([9, 9, 0], 1) == 0 and view.ignored == 1
    view.apply(EventBatch(0.0, (BlockRemoved(block_hashes=(21, 99)),)))  # unknown hashes are fine


def test_a_block_stays_a_hit_until_its_last_copy_goes() -> None:
    view = EventView(2)
    for _ in range(3):
        view.apply(stored([11], None, [1, 2]))  # three copies under one hash
    view.apply(stored([21], None, [1, 2]))  # and the same block under another hash
    removals = []
    for h in (11, 11, 21, 11):
        view.apply(EventBatch(0.0, (BlockRemoved(block_hashes=(h,)),)))
        removals.append(view.cached_blocks([1, 2, 3], 1))
    assert removals == [1, 1, 1, 0]
    assert len(view) == 0 and len(view.chains) == 0


def test_an_event_view_that_knows_no_block_size_yet_holds_no_hit() -> None:
    view = EventView()
    assert view.cached_blocks([1, 2, 3], 1) == 0
    view.apply(stored([11], None, [1, 2]))  # the first block tells the size
    assert view.block_size == 2 and view.cached_blocks([1, 2, 3], 1) == 1


def test_placement_view_is_an_lru_of_chains() -> None:
    # Three blocks a prompt: two full ones and the partial one its last token is in.
    view = PlacementView(2, capacity_blocks=6)
    a, b, c = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0], [9, 10, 11, 12, 0]
    view.record(a)
    view.record(b)
    assert view.cached_blocks(a, 2) == 2 and view.cached_blocks(b, 2) == 2
    view.record(a)  # a is the most recent again
    view.record(c)  # evicts b, tail first
    assert view.cached_blocks(b, 2) == 0 and view.cached_blocks(a, 2) == 2
    view.record([1, 2, 13, 14])  # shares a's head: one new block (a's old partial one goes)
    assert view.cached_blocks(a, 2) == 2
    view.record([20, 21, 0])  # two new blocks: a's tail goes; the shared head stays
    assert view.cached_blocks(a, 2) == 1
    assert view.cached_blocks([1, 2, 13, 14, 0], 2) == 2


def test_index_enables_per_engine_and_prices_only_those() -> None:
    index = PrefixIndex()
    ids = list(range(10))
    index.placed("e0", ids)  # no view yet: nothing learnt
    index.enable("e0", block_size=4, capacity_tokens=64, events=False)
    index.enable("e1", block_size=2, capacity_tokens=64, events=True)
    assert index.cached_tokens("e0", ids) == 0
    index.placed("e0", ids)
    assert index.cached_tokens("e0", ids) == 8 and index.cached_tokens("e2", ids) == 0
    assert not index.exact("e0") and index.exact("e1")
    index.enable("e0", block_size=4, capacity_tokens=128, events=False)  # kept, capacity updated
    assert index.cached_tokens("e0", ids) == 8
    index.apply("e1", stored([1], None, [0, 1]))
    assert index.cached_tokens("e1", ids) == 2
    index.reset("e1")
    assert index.cached_tokens("e1", ids) == 0
    index.disable("e0")
    assert not index.enabled("e0") and index.cached_tokens("e0", ids) == 0
    index.disable("e1")  # an event view is kept (events keep coming) but not priced
    assert index.cached_tokens("e1", ids) == 0 and index.exact("e1")
    index.apply("e1", stored([1], None, [0, 1]))
    index.enable("e1", block_size=2, capacity_tokens=64, events=True)
    assert index.cached_tokens("e1", ids) == 2


def test_a_followed_engine_learns_its_block_size_from_events() -> None:
    index = PrefixIndex()
    index.follow("e0")
    index.apply("e0", stored([1, 2], None, [5, 6, 7, 8]))
    assert index.cached_tokens("e0", [5, 6, 7, 8, 9]) == 0  # not priced before it reports caching on
    index.enable("e0", block_size=2, capacity_tokens=64, events=True)
    assert index.cached_tokens("e0", [5, 6, 7, 8, 9]) == 4
    index.enable("e0", block_size=4, capacity_tokens=64, events=True)  # another size: a new view
    assert index.cached_tokens("e0", [5, 6, 7, 8, 9]) == 0


def workload(seed: int, n: int) -> list[list[int]]:
    """Prompts over a few shared prefixes, with unique tails, of varied lengths."""
    rng = random.Random(seed)
    heads = [[rng.randrange(300, 30000) for _ in range(rng.randrange(8, 120))] for _ in range(5)]
    return [rng.choice(heads)[: rng.randrange(1, 121)] + [rng.randrange(300, 30000) for _ in range(rng.randrange(1, 40))]
            for _ in range(n)]  # fmt: skip


async def test_event_view_predicts_the_engines_hits_exactly(autojump_clock: trio.abc.Clock) -> None:
    sim = {"prefix_caching": True, "prompt_tokens_details": True, "block_size": 8, "kv_capacity_tokens": 1024}
    async with one_engine(**sim) as (_, engine, client):
        index = PrefixIndex()
        index.enable("e0", block_size=8, capacity_tokens=1024, events=True)
        removed = []

        def publish(events: list[Any]) -> None:
            removed.extend(e for e in events if isinstance(e, BlockRemoved))
            index.apply("e0", EventBatch(0.0, tuple(events)))

        engine.scheduler.publish = publish
        for ids in workload(1, 150):
            predicted = index.cached_tokens("e0", ids)
            r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3})
            details = r.json()["usage"]["prompt_tokens_details"]
            assert predicted == (details["cached_tokens"] if details else 0)
        assert engine.stats.prompt_tokens["local_cache_hit"] > 1000  # the workload does hit
        assert engine.stats.requests == 150 and len(removed) > 100  # under eviction


async def test_placement_view_agrees_with_a_lone_engine_until_eviction(autojump_clock: trio.abc.Clock) -> None:
    sim = {"prefix_caching": True, "prompt_tokens_details": True, "block_size": 8}
    async with one_engine(**sim) as (_, _e, client):
        index = PrefixIndex()
        index.enable("e0", block_size=8, capacity_tokens=262144, events=False)
        for ids in workload(2, 100):
            predicted = index.cached_tokens("e0", ids)
            r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
            index.placed("e0", ids)
            details = r.json()["usage"]["prompt_tokens_details"]
            assert predicted == (details["cached_tokens"] if details else 0)


def test_engines_share_chain_ids_and_nothing_outlives_its_views() -> None:
    index = PrefixIndex()
    for name in ("p0", "p1"):
        index.enable(name, block_size=2, capacity_tokens=8, events=False)
    index.enable("e0", block_size=2, capacity_tokens=64, events=True)
    a = [1, 2, 3, 4, 5, 6, 0]
    index.placed("p0", a)
    index.placed("p1", a[:4])
    index.apply("e0", stored([11, 12, 13], None, a[:6]))
    assert len(index.chains) == 3  # one id per block of the shared chain, whoever holds it
    assert [index.cached_tokens(n, a) for n in ("p0", "p1", "e0")] == [6, 4, 6]
    # Capacity 4 blocks, a's 3 full ones and its partial one: 3 new blocks take a's
    # partial block, then its tail, then its middle.
    index.placed("p0", [7, 8, 9, 10, 0])
    assert index.cached_tokens("p0", a) == 2 and index.cached_tokens("e0", a) == 6
    index.apply("e0", EventBatch(0.0, (BlockRemoved(block_hashes=(12,)),)))
    # 12's id stays while 13 (its child) is held, so the chain does not change under 13.
    assert index.cached_tokens("e0", a) == 2 and len(index.chains) == 5
    index.apply("e0", stored([12], 11, [3, 4]))
    assert index.cached_tokens("e0", a) == 6
    index.reset("e0")
    index.disable("p0")
    index.enable("p1", block_size=4, capacity_tokens=64, events=False)  # another size: a new view
    assert len(index.chains) == 0  # every id went with the blocks that held it


def test_a_prompt_is_looked_up_once_for_every_engine_and_again_after_a_change() -> None:
    index = PrefixIndex()
    prefix = list(range(100, 164))
    for e in range(8):
        index.enable(f"p{e}", block_size=16, capacity_tokens=4096, events=False)
        index.placed(f"p{e}", prefix[: 16 * (e % 4 + 1)])
    ids = prefix + list(range(500, 530))  # five blocks may hit
    lookup = index.lookup(ids)
    assert [lookup.cached_tokens(f"p{e}") for e in range(8)] == [16, 32, 48, 64] * 2
    assert lookup.lookups == 1
    assert [lookup.cached_tokens(n) for n in ("p0", "nobody")] == [16, 0] and lookup.lookups == 1
    index.placed("p0", ids)  # a longer chain now exists: the lookup sees it
    assert lookup.cached_tokens("p0") == 80 and lookup.lookups == 2
    index.enable("q0", block_size=8, capacity_tokens=4096, events=False)
    index.placed("q0", ids)
    assert lookup.cached_tokens("q0") == 88 and lookup.lookups == 3  # its own block size


def test_a_lookup_names_the_blocks_each_engine_holds_by_their_chain_ids() -> None:
    index = PrefixIndex()
    index.enable("p0", block_size=2, capacity_tokens=64, events=False)
    index.enable("p1", block_size=2, capacity_tokens=64, events=False)
    index.enable("q0", block_size=4, capacity_tokens=64, events=False)
    a = [1, 2, 3, 4, 5, 6, 7]
    index.placed("p0", a)
    index.placed("p1", a[:4])
    index.placed("q0", a)
    lookup = index.lookup(a)
    chain, bs = lookup.held_chain("p0")
    assert bs == 2 and len(chain) == 3 == len(set(chain))  # three blocks short of the last token
    # The engine that holds the first two holds them under the same ids.
    assert lookup.held_chain("p1") == (chain[:2], 2)
    assert [lookup.cached_tokens(n) for n in ("p0", "p1")] == [6, 4]
    other, bs = lookup.held_chain("q0")
    assert bs == 4 and len(other) == 1 and other[0] not in chain  # its own block size, its own ids
    # An engine whose hits are not priced holds nothing the router counts.
    index.disable("p1")
    assert lookup.held_chain("p1") == ((), 0) and lookup.held_chain("nobody") == ((), 0)
    assert index.lookup([9, 9, 9]).held_chain("p0") == ([], 2)


def test_an_engine_that_leaves_the_fleet_leaves_nothing_in_the_index() -> None:
    index = PrefixIndex()
    index.enable("e0", block_size=2, capacity_tokens=8, events=True)
    index.apply("e0", stored([11, 12], None, [1, 2, 3, 4]))
    assert index.cached_tokens("e0", [1, 2, 3, 4, 5]) == 4
    index.forget("e0")
    assert not index.enabled("e0") and not index.exact("e0") and "e0" not in index.views
    assert len(index.chains) == 0  # its blocks' ids went with it
    index.forget("e0")  # twice, and engines it never knew, are no error
    index.forget("nobody")
    # Back under the same name, its former capacity is not assumed: stale before it
    # reports its configuration, it falls back only once it has.
    index.follow("e0")
    index.apply("e0", stored([11], None, [1, 2]))
    index.stale("e0")
    assert not index.fallbacks
    index.enable("e0", block_size=2, capacity_tokens=16, events=True)
    assert index.fallbacks["e0"].capacity_blocks == 8
