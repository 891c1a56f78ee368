"""What each engine holds in its prefix cache, as far as the router can know.

A prefix-caching engine (vLLM's ``enable_prefix_caching``) serves a prompt's leading
whole blocks from its cache and computes only the rest, but never the whole prompt:
the last prompt token is always computed. :meth:`PrefixIndex.cached_tokens` answers,
per engine, how many leading tokens of a prompt would be a hit there.

Two kinds of view, chosen per engine (:mod:`narwhal.router.cacheviews`):

- :class:`EventView`, exact: built from the engine's KV events (the fleet document
  names its ``kv_events`` endpoint). A prompt is matched by walking the stored blocks'
  chain from the root, block by block, never recomputing the engine's hashes (vLLM
  seeds them per process). ``AllBlocksCleared``, a restarted publisher or an
  irreparable gap forgets everything. It never holds more than the engine reports it
  can (with a slack): past that it has lost removals, and evicts as the engine would.
- :class:`PlacementView`, approximate: vLLM's block pool replayed from the prompts the
  router placed on the engine, with the engine's capacity in blocks, the blocks held
  by the requests in flight (:meth:`PrefixIndex.placed` returns the request's
  :class:`Hold`, released when it ends there), and the free blocks evicted least
  recently used first, a chain's tail before its head. It cannot see other routers'
  traffic, so it may err towards hits that are gone; :mod:`narwhal.router.cachecal`
  compares its predictions with what the engines report.

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

from collections.abc import Sequence
from typing import Protocol

from narwhal.engines.kvevents import EventBatch
from narwhal.router.cacheviews import EventView, Hold, PlacementView
from narwhal.router.chains import Chains, count_held, hit_limit

__all__ = ["CacheView", "Chains", "EventView", "Hold", "PlacementView", "PrefixIndex", "PromptLookup", "count_held",
           "hit_limit"]  # fmt: skip


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


class PromptLookup:
    """One prompt's hits on every engine of an index, its chain looked up once.

    The prompt's blocks are looked up in the index's :class:`Chains` once per block
    size (on the first engine asked), then each engine's answer is a walk over those
    ids in a set, kept until the engine's view changes (pricing, the consumer's shared
    blocks and the journal's predictions ask again). When the index has made or
    forgotten a chain id since (a placement that waited for capacity asks again later),
    the chain is looked up again.
    """

    def __init__(self, index: PrefixIndex, ids: Sequence[int]) -> None:
        self._index = index
        self.ids = ids
        self._chains: dict[int, list[int]] = {}
        self._version = index.chains.version
        #: Per engine: its view and the view's version when counted, and the blocks held.
        self._held: dict[str, tuple[EventView | PlacementView, int, int]] = {}
        self.lookups = 0

    def cached_tokens(self, engine: str) -> int:
        """Leading tokens of the prompt that ``engine`` would serve from its cache."""
        held = self._held_blocks(engine)
        return 0 if held is None else held[1] * held[2]

    def held_chain(self, engine: str) -> tuple[Sequence[int], int]:
        """The chain ids of the prompt's leading blocks that ``engine``'s cache holds (as
        many as :meth:`cached_tokens` counts), and its block size (no ids and 0: its
        hits are not priced)."""
        held = self._held_blocks(engine)
        if held is None:
            return (), 0
        chain, n, bs = held
        return chain[:n], bs

    def _held_blocks(self, engine: str) -> tuple[list[int], int, int] | None:
        """The prompt's chain in ``engine``'s block size, how many of its leading blocks
        ``engine``'s cache holds, and the size; None when its hits are not priced."""
        index = self._index
        view = index.view(engine)
        if view is None or view.block_size is None or engine not in index.active:
            return None
        bs = view.block_size
        chain = self._chain(bs)
        known = self._held.get(engine)
        if known is not None and known[0] is view and known[1] == view.version:
            return chain, known[2], bs
        n = view.held_blocks(chain)
        self._held[engine] = (view, view.version, n)
        return chain, n, bs

    def chain(self, bs: int) -> list[int]:
        """The prompt's leading chain ids in blocks of ``bs`` that some view holds (up to
        its hit limit)."""
        return self._chain(bs)

    def _chain(self, bs: int) -> list[int]:
        """The prompt's leading chain ids in blocks of ``bs`` that some view holds."""
        chains = self._index.chains
        if chains.version != self._version:
            self._chains.clear()
            self._held.clear()
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

    An engine's capacity is in blocks: the pool's ``num_gpu_blocks`` less the one block
    vLLM keeps aside (its null block) when the engine reports it, else its
    ``kv_cache_size_tokens`` over its block size.
    """

    def __init__(self) -> None:
        self.views: dict[str, EventView | PlacementView] = {}
        self.active: set[str] = set()
        #: The chain ids every view's blocks are held under.
        self.chains = Chains()
        #: Engines whose KV events are stale (:meth:`stale`), and their approximate views.
        self.stale_engines: set[str] = set()
        self.fallbacks: dict[str, PlacementView] = {}
        #: Engines whose KV events are applied (:meth:`follow`).
        self.followed: set[str] = set()
        #: Per engine whose hits are priced: its capacity in blocks.
        self.capacity_blocks: dict[str, int] = {}

    def view(self, engine: str) -> EventView | PlacementView | None:
        """The view ``engine``'s hits are priced from (an approximate one while its events are stale)."""
        fallback = self.fallbacks.get(engine)
        return fallback if fallback is not None else self.views.get(engine)

    def follow(self, engine: str) -> None:
        """``engine``'s KV events will be applied: keep an event view from now on."""
        self.followed.add(engine)
        if not isinstance(self.views.get(engine), EventView):
            self._replace(engine, EventView(chains=self.chains))

    def unfollow(self, engine: str) -> None:
        """``engine``'s KV events are no longer applied: its view follows what it reports."""
        self.followed.discard(engine)

    def enable(self, engine: str, *, block_size: int, capacity_tokens: int, events: bool,
               capacity_blocks: int | None = None) -> None:  # fmt: skip
        """Prefix caching is on at ``engine``: price its hits from now on. Its capacity is
        ``capacity_blocks`` when known, else ``capacity_tokens`` over the block size."""
        blocks = capacity_blocks if capacity_blocks is not None else capacity_tokens // block_size
        view = self.views.get(engine)
        if events or engine in self.followed:
            if not isinstance(view, EventView) or view.block_size not in (None, block_size):
                view = EventView(block_size, chains=self.chains)
                self._replace(engine, view)
            elif view.block_size is None:
                view.block_size = block_size
            view.capacity_blocks = blocks
        elif isinstance(view, PlacementView) and view.block_size == block_size:
            view.capacity_blocks = blocks
        else:
            self._replace(engine, PlacementView(block_size, blocks, chains=self.chains))
        self.active.add(engine)
        self.capacity_blocks[engine] = blocks
        fallback = self.fallbacks.get(engine)
        if fallback is not None:
            fallback.capacity_blocks = blocks
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
        if not isinstance(view, EventView) or view.block_size is None or engine not in self.capacity_blocks:
            return  # made once the engine's block size and capacity are known (enable)
        fallback = PlacementView(view.block_size, self.capacity_blocks[engine], chains=self.chains)
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
        self.followed.discard(engine)
        self.capacity_blocks.pop(engine, None)
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
        """``engine`` computed prompt ``ids`` and is done with it (approximate views learn
        from it: a copy of a prefix, a request that held its blocks only for an instant)."""
        view = self.view(engine)
        if isinstance(view, PlacementView):
            view.record(ids)

    def hold(self, engine: str, ids: Sequence[int], extra_tokens: int = 0, chain: Sequence[int] = (),
             block_size: int = 0) -> Hold | None:  # fmt: skip
        """The router sent a request of prompt ``ids`` (and ``extra_tokens`` of output) to
        ``engine``, which caches its blocks when it schedules it and holds them while the
        request runs there: release the returned hold when it ends there (None: no
        approximate view learns from it). ``chain``: its leading blocks' chain ids in
        blocks of ``block_size``, when known."""
        view = self.view(engine)
        if isinstance(view, PlacementView):
            return view.hold(ids, extra_tokens, chain if block_size == view.block_size else ())
        return None

    def touch(self, engine: str, chain: Sequence[int]) -> None:
        """``engine`` serves ``chain`` (chain ids it holds) from its cache for a request
        placed there: an event view's least-recently-used order follows."""
        view = self.views.get(engine)
        if isinstance(view, EventView) and chain:
            view.touch(chain)

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
