"""What each engine holds in its prefix cache, as far as the router can know.

A prefix-caching engine (vLLM's ``enable_prefix_caching``) serves a prompt's leading
whole blocks from its cache and computes only the rest, but never the whole prompt:
the last prompt token is always computed. :meth:`PrefixIndex.cached_tokens` answers,
per engine, how many leading tokens of a prompt would be a hit there.

Two kinds of view, chosen per engine:

- :class:`EventView`, exact: built from the engine's KV events (the fleet document
  names its ``kv_events`` endpoint). A ``BlockStored`` batch links each new block to
  its parent under the block's own token ids; a prompt is matched by walking that
  chain from the root, block by block, never recomputing the engine's hashes (vLLM
  seeds them per process). ``BlockRemoved`` forgets a block; ``AllBlocksCleared``, a
  restarted publisher or an irreparable gap forgets everything.
- :class:`PlacementView`, approximate: built from the prompts the router placed on
  the engine, as the engine would have cached them (every full prompt block), with
  the engine's capacity in blocks and least-recently-used eviction, a chain's tail
  before its head. It cannot see other routers' traffic nor the engine's own
  evictions under load, so it errs towards hits that are gone; the engine's reported
  ``cached_tokens`` corrects nothing here, it is journaled beside the prediction.

An engine whose KV events stop arriving live while its replay endpoint shows new
batches (:mod:`narwhal.router.prefixwatch`) is marked stale (:meth:`PrefixIndex.stale`):
its hits are priced from a :class:`PlacementView` seeded with the blocks its events
last held, which learns from placements as any approximate view, until live events
flow again (:meth:`PrefixIndex.live`); its event view keeps following the replays.

Blocks that hash more than tokens (a LoRA adapter, multimodal input, a cache salt)
never match a plain prompt, nor does a block whose parent the view never saw stored
(stored before the view followed the engine, or after a gap): a plain prompt reaches
a block only through its parent.

Cost: the views of an index hold their blocks under shared chain ids
(:class:`Chains`: a block's tokens under its parent's id), so a prompt's blocks are
sliced, hashed and compared once per request (:meth:`PrefixIndex.lookup`), and each
engine's hit is then a walk over integer ids in a set. On a 1,174-token prompt with a
1,024-token prefix held in blocks of 16 that made the lookup on eight engines about a
fifth of what looking the prompt up on each engine cost (``tools/bench_prefix_lookup.py``
prints the ratio). This module does no I/O.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Protocol

from narwhal.engines.kvevents import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

__all__ = ["CacheView", "Chains", "EventView", "PlacementView", "PrefixIndex", "PromptLookup", "count_held", "hit_limit"]

#: A chain link: the parent block's chain id (0 at the root) and the block's tokens.
_Link = tuple[int, tuple[int, ...]]


def hit_limit(prompt_len: int, block_size: int) -> int:
    """Most leading blocks of a ``prompt_len``-token prompt a cache can serve."""
    return max(prompt_len - 1, 0) // block_size


class Chains:
    """Chain ids of the blocks the views of one index hold, shared by those views.

    A block's chain id stands for its whole chain: its tokens under its parent block's
    chain id (0 at a prompt's start), so two engines holding the same prefix hold the
    same ids. A prompt is looked up here once per request (:meth:`lookup`: one dict
    lookup per leading block, comparing tokens, stopping at the first block no view
    holds) and then on every engine by its ids alone (:meth:`CacheView.held_blocks`).

    An id lives while a view holds its block or an id interned under it does (so the
    ids of a chain stay stable while any of its blocks is held); :meth:`release` frees
    what nothing holds any more.
    """

    def __init__(self) -> None:
        self._ids: dict[_Link, int] = {}
        self._links: dict[int, _Link] = {}
        self._refs: dict[int, int] = {}
        self._next = itertools.count(1)
        #: Changes whenever an id is made or forgotten (a looked-up chain is then stale).
        self.version = 0

    def __len__(self) -> int:
        return len(self._ids)

    def find(self, parent: int, block: tuple[int, ...]) -> int | None:
        """The id of ``block`` under ``parent``, if any view holds it (or a descendant)."""
        return self._ids.get((parent, block))

    def acquire(self, parent: int, block: tuple[int, ...]) -> int:
        """The id of ``block`` under ``parent``, held once more by the caller."""
        link = (parent, block)
        cid = self._ids.get(link)
        if cid is None:
            cid = self._ids[link] = next(self._next)
            self.version += 1
            self._links[cid] = link
            self._refs[cid] = 0
            if parent:
                self._refs[parent] += 1
        self._refs[cid] += 1
        return cid

    def hold(self, cid: int) -> None:
        """The caller holds the existing id ``cid`` once more."""
        self._refs[cid] += 1

    def release(self, cid: int) -> None:
        """The caller holds ``cid`` no more; ids nothing holds are forgotten, up the chain."""
        while cid:
            self._refs[cid] -= 1
            if self._refs[cid]:
                return
            del self._refs[cid]
            self.version += 1
            link = self._links.pop(cid)
            del self._ids[link]
            cid = link[0]

    def lookup(self, ids: Sequence[int], block_size: int, limit: int) -> list[int]:
        """The chain ids of the leading blocks of ``ids`` that some view holds, at most ``limit``."""
        out: list[int] = []
        parent = 0
        get = self._ids.get
        for i in range(0, limit * block_size, block_size):
            cid = get((parent, tuple(ids[i : i + block_size])))
            if cid is None:
                break
            out.append(cid)
            parent = cid
        return out


def count_held(chain: Sequence[int], held: Container[int]) -> int:
    """How many leading ids of ``chain`` are in ``held``."""
    n = 0
    for cid in chain:
        if cid not in held:
            break
        n += 1
    return n


class CacheView(Protocol):
    """One engine's cache, as a prompt matcher."""

    block_size: int | None

    def held_blocks(self, chain: Sequence[int]) -> int:
        """Leading blocks of a prompt's chain ids held (:meth:`Chains.lookup` stops the
        chain at the prompt's hit limit)."""
        ...

    def cached_blocks(self, ids: Sequence[int], limit: int) -> int:
        """Leading blocks of ``ids`` held, at most ``limit``."""
        ...

    def clear(self) -> None:
        """Forget everything."""
        ...

    def __len__(self) -> int: ...


class EventView:
    """An engine's cache from its KV events (exact, see the module docstring).

    Args:
        block_size: The engine's block size; None takes the first stored block's.
            Stored blocks of another size are ignored.
        chains: The chain ids shared with the index's other views (its own by default).
    """

    def __init__(self, block_size: int | None = None, chains: Chains | None = None) -> None:
        self.block_size = block_size
        self.chains = chains if chains is not None else Chains()
        #: Per engine block hash: its chain id (None where a plain prompt cannot reach
        #: it) and how many copies the engine holds.
        self._nodes: dict[BlockHash, tuple[int | None, int]] = {}
        #: Chain ids held, with how many engine blocks stand for each.
        self._held: dict[int, int] = {}
        self.ignored = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def clear(self) -> None:
        for cid, count in self._held.items():
            for _ in range(count):
                self.chains.release(cid)
        self._nodes.clear()
        self._held.clear()

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch of events, in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._removed(h)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def _stored(self, event: BlockStored) -> None:
        bs = event.block_size
        if self.block_size is None:
            self.block_size = bs
        if bs != self.block_size or len(event.token_ids) != bs * len(event.block_hashes):
            self.ignored += 1
            return
        # The parent's chain id: the root for a prompt's first block; unknown (None) for
        # a parent stored before this view knew the engine, or one that hashes more
        # than tokens: a plain prompt cannot reach what chains from it.
        parent: int | None
        if event.parent_block_hash is None:
            parent = 0
        else:
            known = self._nodes.get(event.parent_block_hash)
            parent = known[0] if known is not None else None
        if not event.plain:
            parent = None
        for i, h in enumerate(event.block_hashes):
            old = self._nodes.get(h)
            if old is not None:
                cid = old[0]
                self._nodes[h] = (cid, old[1] + 1)
            else:
                cid = None
                if parent is not None:
                    cid = self.chains.acquire(parent, tuple(event.token_ids[i * bs : (i + 1) * bs]))
                    self._held[cid] = self._held.get(cid, 0) + 1
                self._nodes[h] = (cid, 1)
            parent = cid

    def _removed(self, h: BlockHash) -> None:
        node = self._nodes.get(h)
        if node is None:
            return
        cid, copies = node
        if copies > 1:
            self._nodes[h] = (cid, copies - 1)
            return
        del self._nodes[h]
        if cid is not None:
            left = self._held[cid] - 1
            if left:
                self._held[cid] = left
            else:
                del self._held[cid]
            self.chains.release(cid)

    def held_ids(self) -> list[int]:
        """The chain ids of the blocks a plain prompt can reach."""
        return list(self._held)

    def held_blocks(self, chain: Sequence[int]) -> int:
        return count_held(chain, self._held)

    def cached_blocks(self, ids: Sequence[int], limit: int) -> int:
        if self.block_size is None:
            return 0
        return self.held_blocks(self.chains.lookup(ids, self.block_size, limit))


class PlacementView:
    """An engine's cache from the prompts placed on it (approximate, see the module docstring).

    Blocks are chain ids kept in an LRU.

    Args:
        block_size: The engine's block size.
        capacity_blocks: Blocks the engine's cache holds.
        chains: The chain ids shared with the index's other views (its own by default).
    """

    def __init__(self, block_size: int, capacity_blocks: int, chains: Chains | None = None) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(capacity_blocks, 0)
        self.chains = chains if chains is not None else Chains()
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        for cid in self._lru:
            self.chains.release(cid)
        self._lru.clear()

    def seed(self, cids: Sequence[int]) -> None:
        """Hold the blocks ``cids`` (ids of this view's :class:`Chains`), as if placed, least
        recent first, within the capacity."""
        for cid in cids:
            if cid not in self._lru:
                self.chains.hold(cid)
                self._lru[cid] = None
        self._evict()

    def _evict(self) -> None:
        while len(self._lru) > self.capacity_blocks:
            cid, _ = self._lru.popitem(last=False)
            self.chains.release(cid)

    def record(self, ids: Sequence[int]) -> None:
        """The engine computed (or hit) ``ids``: its full blocks are now the most recent."""
        nodes: list[int] = []
        parent = 0
        bs = self.block_size
        for i in range(0, len(ids) // bs * bs, bs):
            block = tuple(ids[i : i + bs])
            cid = self.chains.find(parent, block)
            if cid is None or cid not in self._lru:
                cid = self.chains.acquire(parent, block)
                self._lru[cid] = None
            nodes.append(cid)
            parent = cid
        # Tail first, so that the head ends most recent and is evicted last.
        for cid in reversed(nodes):
            self._lru.move_to_end(cid)
        self._evict()

    def held_blocks(self, chain: Sequence[int]) -> int:
        return count_held(chain, self._lru)

    def cached_blocks(self, ids: Sequence[int], limit: int) -> int:
        return self.held_blocks(self.chains.lookup(ids, self.block_size, limit))


class PromptLookup:
    """One prompt's hits on every engine of an index, its chain looked up once.

    The prompt's blocks are looked up in the index's :class:`Chains` once per block
    size (on the first engine asked), then each engine's answer is a walk over those
    ids in a set. When the index has made or forgotten a chain id since (a placement
    that waited for capacity asks again later), the chain is looked up again.
    """

    def __init__(self, index: PrefixIndex, ids: Sequence[int]) -> None:
        self._index = index
        self.ids = ids
        self._chains: dict[int, list[int]] = {}
        self._version = index.chains.version
        self.lookups = 0

    def cached_tokens(self, engine: str) -> int:
        """Leading tokens of the prompt that ``engine`` would serve from its cache."""
        priced = self._priced_view(engine)
        if priced is None:
            return 0
        view, bs = priced
        return view.held_blocks(self._chain(bs)) * bs

    def held_chain(self, engine: str) -> tuple[Sequence[int], int]:
        """The chain ids of the prompt's leading blocks that ``engine``'s cache holds (as
        many as :meth:`cached_tokens` counts), and its block size (no ids and 0: its
        hits are not priced)."""
        priced = self._priced_view(engine)
        if priced is None:
            return (), 0
        view, bs = priced
        chain = self._chain(bs)
        return chain[: view.held_blocks(chain)], bs

    def _priced_view(self, engine: str) -> tuple[EventView | PlacementView, int] | None:
        """``engine``'s view and block size, when its hits are priced and the size is known."""
        view = self._index.view(engine)
        if view is None or view.block_size is None or engine not in self._index.active:
            return None
        return view, view.block_size

    def _chain(self, bs: int) -> list[int]:
        """The prompt's leading chain ids in blocks of ``bs`` that some view holds."""
        chains = self._index.chains
        if chains.version != self._version:
            self._chains.clear()
            self._version = chains.version
        chain = self._chains.get(bs)
        if chain is None:
            self.lookups += 1
            chain = self._chains[bs] = chains.lookup(self.ids, bs, hit_limit(len(self.ids), bs))
        return chain


class PrefixIndex:
    """The per-engine cache views of a fleet.

    An engine's view answers only while prefix caching is known to be on there
    (:meth:`enable`); :meth:`cached_tokens` is 0 for any other. An engine whose KV
    events are followed (:meth:`follow`) keeps its event view whatever the engine
    reports, so that no event is missed while the report is pending.
    """

    def __init__(self) -> None:
        self.views: dict[str, EventView | PlacementView] = {}
        self.active: set[str] = set()
        #: The chain ids every view's blocks are held under.
        self.chains = Chains()
        #: Engines whose KV events are stale (:meth:`stale`), and their approximate views.
        self.stale_engines: set[str] = set()
        self.fallbacks: dict[str, PlacementView] = {}
        self._capacity: dict[str, int] = {}

    def view(self, engine: str) -> EventView | PlacementView | None:
        """The view ``engine``'s hits are priced from (an approximate one while its events are stale)."""
        fallback = self.fallbacks.get(engine)
        return fallback if fallback is not None else self.views.get(engine)

    def follow(self, engine: str) -> None:
        """``engine``'s KV events will be applied: keep an event view from now on."""
        if not isinstance(self.views.get(engine), EventView):
            self._replace(engine, EventView(chains=self.chains))

    def enable(self, engine: str, *, block_size: int, capacity_tokens: int, events: bool) -> None:
        """Prefix caching is on at ``engine``: price its hits from now on."""
        view = self.views.get(engine)
        if events:
            if not isinstance(view, EventView) or view.block_size not in (None, block_size):
                self._replace(engine, EventView(block_size, chains=self.chains))
            elif view.block_size is None:
                view.block_size = block_size
        elif isinstance(view, PlacementView) and view.block_size == block_size:
            view.capacity_blocks = capacity_tokens // block_size
        else:
            self._replace(engine, PlacementView(block_size, capacity_tokens // block_size, chains=self.chains))
        self.active.add(engine)
        self._capacity[engine] = capacity_tokens
        fallback = self.fallbacks.get(engine)
        if fallback is not None:
            fallback.capacity_blocks = capacity_tokens // block_size
        elif engine in self.stale_engines:
            self._fall_back(engine)

    def stale(self, engine: str) -> None:
        """``engine``'s KV events no longer arrive live: price its hits from an approximate
        view, seeded with what its events last said, until :meth:`live`."""
        self.stale_engines.add(engine)
        if engine not in self.fallbacks:
            self._fall_back(engine)

    def live(self, engine: str) -> None:
        """``engine``'s KV events arrive live again: its event view prices its hits."""
        self.stale_engines.discard(engine)
        fallback = self.fallbacks.pop(engine, None)
        if fallback is not None:
            fallback.clear()

    def _fall_back(self, engine: str) -> None:
        view = self.views.get(engine)
        if not isinstance(view, EventView) or view.block_size is None or engine not in self._capacity:
            return  # made once the engine's block size and capacity are known (enable)
        bs = view.block_size
        fallback = PlacementView(bs, self._capacity[engine] // bs, chains=self.chains)
        fallback.seed(view.held_ids())
        self.fallbacks[engine] = fallback

    def disable(self, engine: str) -> None:
        """Prefix caching is off at ``engine`` (or unknown): price no hit there."""
        self.active.discard(engine)
        if isinstance(self.views.get(engine), PlacementView):
            self._replace(engine, None)

    def forget(self, engine: str) -> None:
        """``engine`` left the fleet: drop its view."""
        self.active.discard(engine)
        self.live(engine)
        self._capacity.pop(engine, None)
        view = self.views.pop(engine, None)
        if view is not None:
            view.clear()  # its chain ids go back

    def enabled(self, engine: str) -> bool:
        """Whether ``engine``'s hits are priced."""
        return engine in self.active

    def exact(self, engine: str) -> bool:
        """Whether ``engine``'s hits are priced from its KV events (it has an event view
        and its events are not stale)."""
        return isinstance(self.views.get(engine), EventView) and engine not in self.stale_engines

    def _replace(self, engine: str, view: EventView | PlacementView | None) -> None:
        old = self.views.pop(engine, None)
        if old is not None:
            old.clear()  # its chain ids go back
        if not isinstance(view, EventView):
            self.live(engine)  # no events to be stale
        if view is not None:
            self.views[engine] = view

    def lookup(self, ids: Sequence[int]) -> PromptLookup:
        """Prompt ``ids``'s hits on every engine, for one placement decision."""
        return PromptLookup(self, ids)

    def cached_tokens(self, engine: str, ids: Sequence[int]) -> int:
        """Leading tokens of prompt ``ids`` that ``engine`` would serve from its cache
        (:meth:`lookup` answers several engines for the price of one chain lookup)."""
        return PromptLookup(self, ids).cached_tokens(engine)

    def placed(self, engine: str, ids: Sequence[int]) -> None:
        """The router sent prompt ``ids`` to ``engine`` (approximate views learn from it)."""
        view = self.view(engine)
        if isinstance(view, PlacementView):
            view.record(ids)

    def apply(self, engine: str, batch: EventBatch) -> None:
        """A batch of ``engine``'s KV events, in sequence order."""
        view = self.views.get(engine)
        if isinstance(view, EventView):
            view.apply(batch)

    def reset(self, engine: str, *, events_only: bool = False) -> None:
        """Forget what ``engine`` holds (a new generation, a lost event, a reset);
        ``events_only`` keeps the approximate view of an engine whose events are stale
        (what its event stream says it lost, the placements did not)."""
        view = self.views.get(engine)
        if view is not None:
            view.clear()
        fallback = self.fallbacks.get(engine)
        if fallback is not None and not events_only:
            fallback.clear()
