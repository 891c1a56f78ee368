"""vLLM's KV-cache events: what an engine says it stored, evicted or cleared.

A prefix-caching vLLM engine started with ``--kv-events-config`` publishes, once per
scheduler step that changed its cache, an ``EventBatch`` of tagged events:

- :class:`BlockStored`: full blocks entered the cache. ``block_hashes`` chain from
  ``parent_block_hash`` (None for a prompt's first block); ``token_ids`` are the
  tokens of all of them, ``block_size`` per block.
- :class:`BlockRemoved`: blocks were evicted (reused for other tokens).
- :class:`AllBlocksCleared`: the whole prefix cache was reset.

Block hashes are opaque here (vLLM sends 32-byte sha256 digests, or 64-bit ints with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); a subscriber never recomputes them, it
follows the parent chain and the token ids.
"""

from __future__ import annotations

from typing import TypeAlias

import attrs

__all__ = ["AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "EventBatch", "KVEvent"]

#: An engine's block hash, as the engine sends it.
BlockHash: TypeAlias = bytes | int

#: The medium vLLM names for blocks in accelerator memory.
MEDIUM_GPU = "GPU"


@attrs.frozen(kw_only=True)
class BlockStored:
    """Full blocks entered an engine's prefix cache.

    Attributes:
        block_hashes: The new blocks' hashes, in chain order.
        parent_block_hash: Hash of the block before the first one; None at a prompt's start.
        token_ids: The tokens of all the new blocks (``block_size`` per block).
        block_size: Tokens per block.
        lora_id: The LoRA adapter's id, None for the base model.
        medium: Where the blocks live (``"GPU"``).
        lora_name: The LoRA adapter's name, None for the base model.
        extra_keys: Per block, the extra hash keys (LoRA, multimodal, cache salt) or None.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None

    @property
    def plain(self) -> bool:
        """Whether the blocks hash tokens alone (no LoRA, multimodal input or salt)."""
        extra = self.extra_keys is not None and any(k is not None for k in self.extra_keys)
        return self.lora_id is None and self.lora_name is None and not extra


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Blocks left an engine's prefix cache."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU


@attrs.frozen
class AllBlocksCleared:
    """An engine dropped its whole prefix cache."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@attrs.frozen
class EventBatch:
    """The events of one engine step.

    Attributes:
        ts: Unix time at which the engine published the batch.
        events: The events, in order.
        data_parallel_rank: The engine core's data-parallel rank, if it sent one.
    """

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None

