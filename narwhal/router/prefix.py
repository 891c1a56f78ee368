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

Blocks that hash more than tokens (a LoRA adapter, multimodal input, a cache salt)
never match a plain prompt. This module does no I/O.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from narwhal.engines.kvevents import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

__all__ = ["CacheView", "EventView", "PlacementView", "PrefixIndex", "hit_limit"]

#: A chain link: the parent block's key (None at the root) and the block's tokens.
_Link = tuple[object, tuple[int, ...]]


def hit_limit(prompt_len: int, block_size: int) -> int:
    """Most leading blocks of a ``prompt_len``-token prompt a cache can serve."""
    return max(prompt_len - 1, 0) // block_size


def _blocks(ids: Sequence[int], block_size: int, limit: int) -> Iterator[tuple[int, ...]]:
    for i in range(limit):
        yield tuple(ids[i * block_size : (i + 1) * block_size])


def _walk(children: Mapping[_Link, object], ids: Sequence[int], block_size: int, limit: int) -> int:
    """Leading blocks of ``ids`` found by following ``children`` from the root."""
    parent: object = None
    n = 0
    for block in _blocks(ids, block_size, limit):
        node = children.get((parent, block))
        if node is None:
            break
        parent = node
        n += 1
    return n


class CacheView(Protocol):
    """One engine's cache, as a prompt matcher."""

    block_size: int | None

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
    """

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size
        self._children: dict[_Link, BlockHash] = {}
        #: Per block hash: its link and how many copies the engine holds.
        self._nodes: dict[BlockHash, tuple[_Link | None, int]] = {}
        self.ignored = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def clear(self) -> None:
        self._children.clear()
        self._nodes.clear()

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
        plain = event.plain
        parent: object = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            link: _Link | None = (parent, tuple(event.token_ids[i * bs : (i + 1) * bs])) if plain else None
            old = self._nodes.get(h)
            self._nodes[h] = (link, (old[1] if old else 0) + 1)
            if link is not None:
                self._children[link] = h
            parent = h

    def _removed(self, h: BlockHash) -> None:
        node = self._nodes.get(h)
        if node is None:
            return
        link, copies = node
        if copies > 1:
            self._nodes[h] = (link, copies - 1)
            return
        del self._nodes[h]
        if link is not None and self._children.get(link) == h:
            del self._children[link]

    def cached_blocks(self, ids: Sequence[int], limit: int) -> int:
        if self.block_size is None:
            return 0
        return _walk(self._children, ids, self.block_size, limit)


class PlacementView:
    """An engine's cache from the prompts placed on it (approximate, see the module docstring).

    Blocks are chain links ``(parent block, tokens)`` numbered locally, kept in an LRU.

    Args:
        block_size: The engine's block size.
        capacity_blocks: Blocks the engine's cache holds.
    """

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(capacity_blocks, 0)
        self._children: dict[_Link, int] = {}
        self._lru: OrderedDict[int, _Link] = OrderedDict()
        self._next = itertools.count(1)

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        self._children.clear()
        self._lru.clear()

    def record(self, ids: Sequence[int]) -> None:
        """The engine computed (or hit) ``ids``: its full blocks are now the most recent."""
        nodes: list[int] = []
        parent: object = None
        for block in _blocks(ids, self.block_size, len(ids) // self.block_size):
            link = (parent, block)
            node = self._children.get(link)
            if node is None:
                node = self._children[link] = next(self._next)
                self._lru[node] = link
            nodes.append(node)
            parent = node
        # Tail first, so that the head ends most recent and is evicted last.
        for node in reversed(nodes):
            self._lru.move_to_end(node)
        while len(self._lru) > self.capacity_blocks:
            _, link = self._lru.popitem(last=False)
            del self._children[link]

    def cached_blocks(self, ids: Sequence[int], limit: int) -> int:
        return _walk(self._children, ids, self.block_size, limit)


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

    def follow(self, engine: str) -> None:
        """``engine``'s KV events will be applied: keep an event view from now on."""
        if not isinstance(self.views.get(engine), EventView):
            self.views[engine] = EventView()

    def enable(self, engine: str, *, block_size: int, capacity_tokens: int, events: bool) -> None:
        """Prefix caching is on at ``engine``: price its hits from now on."""
        view = self.views.get(engine)
        if events:
            if not isinstance(view, EventView) or view.block_size not in (None, block_size):
                self.views[engine] = EventView(block_size)
            elif view.block_size is None:
                view.block_size = block_size
        elif isinstance(view, PlacementView) and view.block_size == block_size:
            view.capacity_blocks = capacity_tokens // block_size
        else:
            self.views[engine] = PlacementView(block_size, capacity_tokens // block_size)
        self.active.add(engine)

    def disable(self, engine: str) -> None:
        """Prefix caching is off at ``engine`` (or unknown): price no hit there."""
        self.active.discard(engine)
        if isinstance(self.views.get(engine), PlacementView):
            del self.views[engine]

    def forget(self, engine: str) -> None:
        """``engine`` left the fleet: drop its view."""
        self.active.discard(engine)
        self.views.pop(engine, None)

    def enabled(self, engine: str) -> bool:
        """Whether ``engine``'s hits are priced."""
        return engine in self.active

    def exact(self, engine: str) -> bool:
        """Whether ``engine``'s view comes from its KV events."""
        return isinstance(self.views.get(engine), EventView)

    def cached_tokens(self, engine: str, ids: Sequence[int]) -> int:
        """Leading tokens of prompt ``ids`` that ``engine`` would serve from its cache."""
        view = self.views.get(engine)
        if view is None or engine not in self.active or view.block_size is None:
            return 0
        return view.cached_blocks(ids, hit_limit(len(ids), view.block_size)) * view.block_size

    def placed(self, engine: str, ids: Sequence[int]) -> None:
        """The router sent prompt ``ids`` to ``engine`` (approximate views learn from it)."""
        view = self.views.get(engine)
        if isinstance(view, PlacementView):
            view.record(ids)

    def apply(self, engine: str, batch: EventBatch) -> None:
        """A batch of ``engine``'s KV events, in sequence order."""
        view = self.views.get(engine)
        if isinstance(view, EventView):
            view.apply(batch)

    def reset(self, engine: str) -> None:
        """Forget what ``engine`` holds (a new generation, a lost event, a reset)."""
        view = self.views.get(engine)
        if view is not None:
            view.clear()
