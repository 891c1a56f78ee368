"""The router's cache views are true to the engine's capacity and eviction order.

The approximate view replays vLLM's block pool: checked here against the simulated
engine's pool (``narwhal.testing.blockpool``, vLLM's ``block_pool.py`` semantics) on the
same requests, with requests in flight holding their blocks and the cache under
eviction. The exact view never holds more than the engine can.
"""

from __future__ import annotations

import random

from narwhal.engines.kvevents import BlockRemoved, BlockStored, EventBatch
from narwhal.router.cacheviews import EventView, PlacementView
from narwhal.router.chains import Chains
from narwhal.testing.blockpool import BlockPool, block_hashes, none_hash

ROOT = none_hash(0)


class Engine:
    """Requests admitted to and finished on a vLLM block pool, as the scheduler does it."""

    def __init__(self, num_blocks: int, bs: int) -> None:
        self.pool = BlockPool(num_blocks, bs, caching=True)
        self.bs = bs

    def fits(self, ids: list[int], extra: int) -> bool:
        hashes = block_hashes(ids, self.bs, ROOT)
        hits = self.pool.lookup(hashes[: (len(ids) - 1) // self.bs])
        need = -(-(len(ids) + extra) // self.bs) - len(hits)
        return need + self.pool.free_among(hits) <= self.pool.num_free

    def admit(self, ids: list[int], extra: int) -> tuple[list[int], int]:
        """The request's blocks and how many of its leading blocks it hit."""
        hashes = block_hashes(ids, self.bs, ROOT)
        hits = self.pool.lookup(hashes[: (len(ids) - 1) // self.bs])
        self.pool.touch(hits)
        blocks = hits + self.pool.allocate(-(-(len(ids) + extra) // self.bs) - len(hits))
        self.pool.cache(blocks, hashes, ids, len(hits), len(ids) // self.bs)
        return blocks, len(hits)

    def finish(self, blocks: list[int]) -> None:
        self.pool.free(reversed(blocks))  # tail first, as vLLM's kv_cache_manager frees


def prompts(rng: random.Random, n: int, bs: int) -> list[list[int]]:
    """Prompts over a few shared prefixes and sessions that extend their last prompt."""
    heads = [[rng.randrange(1000, 9000) for _ in range(rng.randrange(2, 8) * bs)] for _ in range(4)]
    sessions: list[list[int]] = []
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5 or not sessions:
            p = rng.choice(heads)[: rng.randrange(1, 8 * bs)] + [rng.randrange(10000, 90000) for _ in range(rng.randrange(1, 3 * bs))]
            if rng.random() < 0.3:
                sessions.append(p)
        else:
            i = rng.randrange(len(sessions))
            p = sessions[i] + [rng.randrange(10000, 90000) for _ in range(rng.randrange(1, 2 * bs))]
            sessions[i] = p
        out.append(p)
    return out


def test_the_placement_view_predicts_a_vllm_pool_under_eviction_with_requests_in_flight() -> None:
    for seed in range(6):
        rng = random.Random(seed)
        bs, blocks = 4, 48
        engine = Engine(blocks, bs)
        view = PlacementView(bs, blocks)
        in_flight: list[tuple[list[int], object]] = []
        checked = hits = 0
        for ids in prompts(rng, 300, bs):
            extra = rng.choice((1, 1, 4, 9))  # a producer's one token, or a decode's output
            # Requests end in any order; a new one waits (as the engine makes it) while
            # the pool has no room for it.
            while in_flight and (rng.random() < 0.45 or not engine.fits(ids, extra)):
                done, hold = in_flight.pop(rng.randrange(len(in_flight)))
                engine.finish(done)
                view.release(hold)  # type: ignore[arg-type]
            if not engine.fits(ids, extra):
                continue  # too long for the pool at all
            predicted = view.cached_blocks(ids, (len(ids) - 1) // bs)
            got, hit = engine.admit(ids, extra)
            assert predicted == hit, (seed, checked)
            checked += 1
            hits += hit
            in_flight.append((got, view.hold(ids, extra)))
            assert len(view) <= blocks and view.held <= blocks
        evictions = sum(isinstance(e, BlockRemoved) for e in engine.pool.take_events())
        assert checked > 150 and hits > 100 and evictions > 100  # hits, under eviction


def test_a_request_in_flight_holds_its_blocks_so_a_shared_prefix_outlives_others() -> None:
    bs = 2
    view = PlacementView(bs, capacity_blocks=6)
    prefix = [1, 2, 3, 4]
    long = view.hold([*prefix, 5, 6, 7], extra_tokens=1)  # 3 full blocks and 1 partial: 4 held
    assert view.held == 4
    for tail in range(10, 40, 3):  # other prompts churn through the 2 free blocks
        view.record([tail, tail + 1, tail + 2])
    assert view.cached_blocks([*prefix, 5, 6, 0], 3) == 3  # held: never evicted
    long.release()
    long.release()  # idempotent
    assert view.held == 0
    # 4 blocks: the 2 free ones the churn left, then the long prompt's partial block,
    # then its tail (freed first); its head stays.
    view.record([90, 91, 92, 93, 94, 95, 96])
    assert view.cached_blocks([*prefix, 5, 6, 0], 3) == 2
    view.clear()
    assert len(view) == 0 and view.held == 0


def test_the_event_view_never_holds_more_than_the_engine_reports() -> None:
    bs = 2
    view = EventView(bs, capacity_blocks=40)
    assert view.bound == 56  # the capacity and its slack (16 blocks at least)
    hot = [1, 2, 3, 4, 5, 6]

    def store(hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        view.apply(EventBatch(0.0, (BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent,
                                                token_ids=tuple(tokens), block_size=bs),)))  # fmt: skip

    store([1, 2, 3], None, hot)
    chain = view.chains.lookup([*hot, 0], bs, 3)
    # The engine's BlockRemoved events are lost: only stores arrive. The router's own
    # placements keep hitting the hot prefix.
    for i in range(200):
        store([1000 + 2 * i, 1001 + 2 * i], None, [5000 + 4 * i, 5001 + 4 * i, 5002 + 4 * i, 5003 + 4 * i])
        view.touch(chain)
        assert len(view) <= 56
    assert view.overflow_evicted > 300
    assert view.cached_blocks([*hot, 0], 3) == 3  # used: kept while the unused went
    # A cold prompt's tail went before its head.
    store([7, 8], None, [70, 71, 72, 73])
    head, tail = view.chains.lookup([70, 71, 72, 73, 0], bs, 2)
    order = view.held_ids()  # least recent first
    assert order.index(tail) < order.index(head)
    for i in range(80):
        store([3000 + i], None, [9000 + 2 * i, 9001 + 2 * i])
        view.touch(chain)
    assert view.cached_blocks([70, 71, 72, 73, 0], 2) == 0 and view.cached_blocks([*hot, 0], 3) == 3
    assert len(view.chains) == len(view)


def test_a_group_root_is_where_a_prompt_leaves_what_it_shares() -> None:
    chains = Chains()
    bs = 2

    def intern(ids: list[int]) -> list[int]:
        out, parent = [], 0
        for i in range(0, len(ids) // bs * bs, bs):
            parent = chains.acquire(parent, tuple(ids[i : i + bs]))
            out.append(parent)
        return out

    header = [1, 1]  # a chat template's header, shared by everything
    doc_a, doc_b = [*header, 2, 2, 3, 3], [*header, 4, 4, 5, 5]
    a1 = intern([*doc_a, 10, 10])
    intern([*doc_a, 11, 11])
    intern([*doc_b, 12, 12])
    matched = chains.lookup([*doc_a, 13, 13, 0], bs, 4)  # a new request of document a
    assert matched == a1[:3]
    assert chains.group_root(matched) == a1[1]  # document a, below the shared header
    assert chains.group_root(chains.lookup([*doc_b, 0], bs, 3)) != a1[1]
    assert chains.group_root([]) == 0
    assert chains.children(0) == 1 and chains.children(a1[0]) == 2
    assert chains.parent(a1[1]) == a1[0] and chains.tokens(a1[1]) == (2, 2)
    # A block's content key is the same under a new id (the prefix evicted everywhere,
    # then computed again).
    other = Chains()
    again = [other.acquire(0, (9, 9)), 0]
    again[1] = other.acquire(again[0], (8, 8))
    fresh = other.acquire(other.acquire(0, (1, 1)), (2, 2))
    assert fresh != a1[1] or other is not chains
    assert other.content_key(fresh) == chains.content_key(a1[1]) != other.content_key(again[1])
