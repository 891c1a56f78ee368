"""The prompt blocks a consumer's streams share in its prefix cache.

vLLM's block pool keeps one copy of a cached block and references it from every
request that hits it: streams of one shared prefix on a prefix-caching consumer hold
that prefix's KV once, not once a stream. A router that counts each stream's prompt
in full finds a consumer full that has room, and refuses requests it could serve.

:class:`SharedBlocks` keeps, per consumer, the prompt blocks that the streams this
router placed there hit in its cache when they were placed (the chain ids of
:class:`narwhal.router.prefix.Chains`, as the consumer's view held them), each with
how many of those streams hold it. A block two streams hit is resident once:
:attr:`SharedBlocks.shared_tokens` is what the streams' prompts counted in full
count twice. A new request that hits blocks some stream here holds adds only the rest
(:meth:`SharedBlocks.held_by_streams`).

Only hits count: a stream that pulled its prefix from the producer holds its own copy
(vLLM caches a block a request loads only once it has arrived, so requests of one
prefix pulled at the same time each keep a copy); the streams that hit that copy
later share it with the puller, which stays counted in full (an estimate that errs by
at most one copy of a prefix a stream that pulled it, towards no room). When the last
stream holding a block ends, the block goes back to the consumer's free blocks
(still cached, but evictable: no capacity is held). This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from narwhal.router.prefix import count_held

__all__ = ["HeldChain", "SharedBlocks"]

#: The chain ids of a prompt's leading blocks an engine's cache holds, and its block
#: size (:meth:`narwhal.router.prefix.PromptLookup.held_chain`).
HeldChain = tuple[Sequence[int], int]


class SharedBlocks:
    """The cached prompt blocks the streams on one consumer hit when placed."""

    __slots__ = ("_refs", "shared_tokens")

    def __init__(self) -> None:
        #: Per chain id: how many streams here hit that block.
        self._refs: dict[int, int] = {}
        #: Tokens of the hit blocks beyond one copy each: what counting every stream's
        #: prompt in full counts more than the consumer holds.
        self.shared_tokens = 0

    def __len__(self) -> int:
        return len(self._refs)

    def held_by_streams(self, chain: Sequence[int], block_size: int) -> int:
        """Tokens of the leading blocks of ``chain`` (a prompt's chain ids the consumer
        holds) that a stream here holds too: a request hitting them adds no copy."""
        return count_held(chain, self._refs) * block_size

    def add(self, chain: Sequence[int], block_size: int) -> None:
        """A stream placed here hits ``chain`` (chain ids of blocks of ``block_size``
        tokens) in the consumer's cache."""
        refs = self._refs
        for cid in chain:
            n = refs.get(cid, 0)
            if n:
                self.shared_tokens += block_size
            refs[cid] = n + 1

    def remove(self, chain: Sequence[int], block_size: int) -> None:
        """The stream that :meth:`add` ``chain`` ended."""
        refs = self._refs
        for cid in chain:
            n = refs[cid] - 1
            if n:
                refs[cid] = n
                self.shared_tokens -= block_size
            else:
                del refs[cid]
