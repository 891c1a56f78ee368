"""One engine's prefix cache, as the router sees it: exact from KV events, or approximate.

Both views hold their blocks under the shared ids of :class:`~narwhal.router.chains.Chains`
and answer how many leading blocks of a prompt's chain they hold (``held_blocks``).

- :class:`EventView`, exact: built from the engine's KV events. A ``BlockStored`` batch
  links each new block to its parent under the block's own token ids; ``BlockRemoved``
  forgets a block; ``AllBlocksCleared`` forgets everything. It is bounded by the
  engine's reported capacity (:attr:`EventView.capacity_blocks`, with
  :data:`EVENT_SLACK`): a view that holds more blocks than the engine can has lost
  ``BlockRemoved`` events (a decoder that skipped some, a gap the replay could not
  fill), and it evicts as the engine would, least recently stored or used first and a
  chain's tail before its head (the router's placements on the engine mark what they
  hit as used, :meth:`EventView.touch`), counting what it evicted so.
- :class:`PlacementView`, approximate: vLLM's block pool replayed from the prompts the
  router places on the engine (``vllm/v1/core/block_pool.py``): ``capacity_blocks``
  blocks, of which those never used are taken first; a request holds its blocks (its
  prompt's full blocks, the hits among them shared with the requests that hold them,
  and its partial and output blocks) until it ends (:meth:`PlacementView.hold`,
  :meth:`PlacementView.release`), then frees them tail first to the back of the free
  queue, still cached; a new block is taken from the front of that queue, evicting the
  block cached there. Blocks held by requests in flight are not evictable, so a
  producer with a queue of long prompts holds fewer prefixes than its capacity says.
  It cannot see other routers' traffic, so it errs towards hits that are gone
  (:mod:`narwhal.router.cachecal` measures how far).

This module does no I/O.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from narwhal.engines.kvevents import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from narwhal.router.chains import Chains, count_held

__all__ = ["EVENT_SLACK", "EventView", "Hold", "PlacementView"]

#: An event view holds at most this share more blocks than the engine reports it can
#: (and at least :data:`EVENT_SLACK_BLOCKS` more) before it evicts on its own.
EVENT_SLACK: Final = 0.1
EVENT_SLACK_BLOCKS: Final = 16


class EventView:
    """An engine's cache from its KV events (exact, see the module docstring).

    Args:
        block_size: The engine's block size; None takes the first stored block's.
            Stored blocks of another size are ignored.
        chains: The chain ids shared with the index's other views (its own by default).
        capacity_blocks: Blocks the engine reports it holds (None: unbounded).
    """

    def __init__(self, block_size: int | None = None, chains: Chains | None = None,
                 capacity_blocks: int | None = None) -> None:  # fmt: skip
        self.block_size = block_size
        self.chains = chains if chains is not None else Chains()
        #: Per engine block hash: its chain id (None where a plain prompt cannot reach
        #: it) and how many copies the engine holds.
        self._nodes: dict[BlockHash, tuple[int | None, int]] = {}
        #: Chain ids held, with how many engine blocks stand for each.
        self._held: dict[int, int] = {}
        #: The engine hash of each chain id held (one engine holds a chain once).
        self._hash_of: dict[int, BlockHash] = {}
        #: Block hashes, least recently stored or used first.
        self._order: OrderedDict[BlockHash, None] = OrderedDict()
        self.capacity_blocks = capacity_blocks
        self.ignored = 0
        #: Blocks evicted because the view passed the engine's capacity (lost removals).
        self.overflow_evicted = 0
        #: Changes whenever the chain ids it holds may have (a counted hit is then stale).
        self.version = 0

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def bound(self) -> int | None:
        """Blocks the view holds at most (None: unbounded)."""
        cap = self.capacity_blocks
        if cap is None:
            return None
        return cap + max(EVENT_SLACK_BLOCKS, int(cap * EVENT_SLACK))

    def clear(self) -> None:
        self.version += 1
        for cid, count in self._held.items():
            for _ in range(count):
                self.chains.release(cid)
        self._nodes.clear()
        self._held.clear()
        self._hash_of.clear()
        self._order.clear()

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch of events, in order; then evict past the bound, if any."""
        self.version += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._removed(h)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
        bound = self.bound
        if bound is not None and len(self._nodes) > bound:
            self._evict_to(self.capacity_blocks or 0)

    def _evict_to(self, blocks: int) -> None:
        """Evict the least recently stored or used blocks until ``blocks`` are left."""
        order = self._order
        while len(self._nodes) > blocks and order:
            h = next(iter(order))
            self.overflow_evicted += 1
            self._removed(h, every_copy=True)

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
                    self._hash_of[cid] = h
                self._nodes[h] = (cid, 1)
            parent = cid
        order = self._order
        for h in reversed(event.block_hashes):  # tail first: the head ends most recent
            order[h] = None
            order.move_to_end(h)

    def _removed(self, h: BlockHash, every_copy: bool = False) -> None:
        node = self._nodes.get(h)
        if node is None:
            return
        cid, copies = node
        if copies > 1 and not every_copy:
            self._nodes[h] = (cid, copies - 1)
            return
        del self._nodes[h]
        self._order.pop(h, None)
        if cid is not None:
            left = self._held[cid] - 1
            if left:
                self._held[cid] = left
            else:
                del self._held[cid]
                self._hash_of.pop(cid, None)
            self.chains.release(cid)

    def touch(self, chain: Sequence[int]) -> None:
        """The engine served ``chain`` (chain ids it holds) from its cache: they are the
        most recently used now, the head last."""
        order, hash_of = self._order, self._hash_of
        for cid in reversed(chain):
            h = hash_of.get(cid)
            if h is not None:
                order.move_to_end(h)

    def held_ids(self) -> list[int]:
        """The chain ids of the blocks a plain prompt can reach, least recent first."""
        nodes = self._nodes
        return [cid for h in self._order if (cid := nodes[h][0]) is not None]

    def held_blocks(self, chain: Sequence[int]) -> int:
        return count_held(chain, self._held)

    def cached_blocks(self, ids: Sequence[int], limit: int) -> int:
        if self.block_size is None:
            return 0
        return self.held_blocks(self.chains.lookup(ids, self.block_size, limit))


class Hold:
    """The blocks one request holds in a :class:`PlacementView` until it ends."""

    __slots__ = ("anon", "blocks", "generation", "released", "view")

    def __init__(self, view: PlacementView, blocks: list[int], anon: int, generation: int) -> None:
        self.view = view
        #: The chain ids of the request's full prompt blocks, in prompt order.
        self.blocks = blocks
        #: Blocks it holds that no prompt can hit (its partial block and its output).
        self.anon = anon
        self.generation = generation
        self.released = False

    def release(self) -> None:
        """The request ended on the engine: its blocks go back, tail first (idempotent)."""
        if not self.released:
            self.released = True
            self.view.release(self)


class PlacementView:
    """An engine's cache replayed from the prompts placed on it (see the module docstring).

    Args:
        block_size: The engine's block size.
        capacity_blocks: Blocks the engine's cache holds.
        chains: The chain ids shared with the index's other views (its own by default).
    """

    def __init__(self, block_size: int, capacity_blocks: int, chains: Chains | None = None) -> None:
        self.block_size = block_size
        self.chains = chains if chains is not None else Chains()
        self._capacity = max(capacity_blocks, 0)
        #: Blocks never used since the last reset (taken before any cached one).
        self._blank = self._capacity
        #: Free blocks in eviction order: chain ids (cached) and negative keys (uncached).
        self._free: OrderedDict[int, None] = OrderedDict()
        #: Chain ids held by requests in flight, with how many hold each.
        self._held: dict[int, int] = {}
        #: Uncached blocks held by requests in flight.
        self._anon_held = 0
        #: Every chain id the view caches (held or free).
        self._cached: set[int] = set()
        self._anon_keys = itertools.count(-1, -1)
        self._generation = 0
        #: Blocks taken while none was free (the engine would have made the request wait).
        self.overcommitted = 0
        #: Changes whenever the chain ids it caches may have (a counted hit is then stale).
        self.version = 0

    def __len__(self) -> int:
        return len(self._cached)

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @capacity_blocks.setter
    def capacity_blocks(self, blocks: int) -> None:
        self._capacity = max(blocks, 0)
        self._blank = max(self._capacity - len(self._free) - len(self._held) - self._anon_held, 0)
        self._trim()

    @property
    def held(self) -> int:
        """Blocks held by the requests in flight (not evictable)."""
        return len(self._held) + self._anon_held

    def clear(self) -> None:
        self.version += 1
        for cid in self._cached:
            self.chains.release(cid)
        self._cached.clear()
        self._free.clear()
        self._held.clear()
        self._anon_held = 0
        self._blank = self._capacity
        self._generation += 1  # the holds of before release nothing now

    def _take(self) -> None:
        """Take one block for a request: a never-used one, else the free queue's front
        (evicting the block cached there)."""
        if self._blank:
            self._blank -= 1
        elif self._free:
            key, _ = self._free.popitem(last=False)
            if key > 0:
                self._cached.discard(key)
                self.chains.release(key)
        else:
            self.overcommitted += 1

    def _trim(self) -> None:
        """Evict from the free queue's front while the view holds more than its capacity."""
        self.version += 1
        free = self._free
        while free and self._blank + len(free) + len(self._held) + self._anon_held > self._capacity:
            key, _ = free.popitem(last=False)
            if key > 0:
                self._cached.discard(key)
                self.chains.release(key)

    def seed(self, cids: Sequence[int]) -> None:
        """Cache the blocks ``cids`` (ids of this view's :class:`Chains`), free, least
        recent first, within the capacity."""
        self.version += 1
        for cid in cids:
            if cid not in self._cached:
                self._take()
                self.chains.hold(cid)
                self._cached.add(cid)
                self._free[cid] = None
        self._trim()

    def hold(self, ids: Sequence[int], extra_tokens: int = 0, chain: Sequence[int] = ()) -> Hold:
        """A request of prompt ``ids`` (and ``extra_tokens`` more: its output) is scheduled:
        it hits the leading blocks cached here and takes new blocks for the rest; it
        holds them until :meth:`release`. ``chain``: the chain ids of its leading blocks,
        when known (their tokens are then not sliced again)."""
        self.version += 1
        bs = self.block_size
        chains, cached, held, free = self.chains, self._cached, self._held, self._free
        alive = chains.ids()
        take = self._take
        hits = max(len(ids) - 1, 0) // bs  # the last prompt token is always computed
        copies = 0
        full = len(ids) // bs
        known = min(len(chain), full)
        # The leading hits, from the chain (a block cached here is alive: nothing to check
        # but whether a request holds it already).
        blocks = list(chain[: count_held(chain[: min(known, hits)], cached)])
        for lead in blocks:
            n = held.get(lead)
            if n is None:
                del free[lead]
                held[lead] = 1
            else:
                held[lead] = n + 1
        parent = blocks[-1] if blocks else 0
        fresh = full  # where a block no view holds begins the prompt's own blocks
        for i in range(len(blocks), full):
            cid: int | None = None
            if i < known:
                cid = chain[i]  # looked up already: not sliced again
                if cid not in alive:
                    cid, known = None, i  # forgotten since: sliced from here
            if cid is None:
                block = tuple(ids[i * bs : (i + 1) * bs])
                cid = chains.find(parent, block)
                if cid is None:
                    fresh = i
                    break
            if cid in cached:
                if i >= hits:
                    # Computed again past a miss (or as the last token's block): vLLM
                    # caches a copy, which no prompt hits while this one is cached.
                    take()
                    copies += 1
                n = held.get(cid)
                if n is None:
                    del free[cid]
                    held[cid] = 1
                else:
                    held[cid] = n + 1
            else:
                hits = min(hits, i)  # a miss: every block after it is computed
                take()
                chains.hold(cid)
                cached.add(cid)
                held[cid] = 1
            blocks.append(cid)
            parent = cid
        # From a block no view holds on, every block is new (nothing is interned under a
        # new id): taken and interned without looking it up.
        for own in zip(*[iter(ids[fresh * bs : full * bs])] * bs, strict=False):  # (whole blocks: a multiple of bs)
            take()
            new = chains.acquire(parent, own)
            cached.add(new)
            held[new] = 1
            blocks.append(new)
            parent = new
        anon = -(-(len(ids) + extra_tokens) // bs) - full
        for _ in range(anon):
            self._take()
        anon += copies
        self._anon_held += anon
        return Hold(self, blocks, anon, self._generation)

    def release(self, hold: Hold) -> None:
        """The request of ``hold`` ended: its blocks go to the back of the free queue, its
        partial and output blocks first, then its prompt's tail to its head."""
        if hold.generation != self._generation:
            return  # the view was cleared since: those blocks are gone
        free, held = self._free, self._held
        self._anon_held -= hold.anon
        for _ in range(hold.anon):
            free[next(self._anon_keys)] = None
        for cid in reversed(hold.blocks):
            n = held.pop(cid) - 1
            if n:
                held[cid] = n
            else:
                free[cid] = None
        self._trim()

    def record(self, ids: Sequence[int]) -> None:
        """The engine computed (or hit) ``ids`` and is done with them (a request that held
        them only for an instant)."""
        self.release(self.hold(ids))

    def held_ids(self) -> list[int]:
        """The chain ids cached, least recent first (held ones last)."""
        return [*(k for k in self._free if k > 0), *self._held]

    def held_blocks(self, chain: Sequence[int]) -> int:
        return count_held(chain, self._cached)

    def cached_blocks(self, ids: Sequence[int], limit: int) -> int:
        return self.held_blocks(self.chains.lookup(ids, self.block_size, limit))
