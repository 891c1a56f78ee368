"""Chain ids: the blocks of every engine's cache view under one shared name.

A block's chain id stands for its whole chain: its tokens under its parent block's
chain id (0 at a prompt's start), so two engines holding the same prefix hold the same
ids, and a prompt is looked up once per request (:meth:`Chains.lookup`) and then on
every engine by its ids alone. The ids form a tree (a trie of blocks); how many
children each id has (:meth:`Chains.children`) is what tells a shared prefix from the
prompts that continue it (:meth:`Chains.group_root`, :mod:`narwhal.router.cacheplan`).

This module does no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Sequence

__all__ = ["Chains", "count_held", "hit_limit", "tail_key"]

#: A chain link: the parent block's chain id (0 at the root) and the block's tokens.
_Link = tuple[int, tuple[int, ...]]


def hit_limit(prompt_len: int, block_size: int) -> int:
    """Most leading blocks of a ``prompt_len``-token prompt a cache can serve."""
    return max(prompt_len - 1, 0) // block_size


def tail_key(parent: tuple[int, ...], block: tuple[int, ...]) -> int:
    """A key for a block at the end of a prompt: its tokens and its parent block's
    (empty for a prompt's first block)."""
    return hash((parent, block))


def count_held(chain: Sequence[int], held: Container[int]) -> int:
    """How many leading ids of ``chain`` are in ``held`` (the walk runs in C: every
    engine's hit is one, on every placement)."""
    return len(list(itertools.takewhile(held.__contains__, chain)))


class Chains:
    """Chain ids of the blocks the views of one index hold, shared by those views.

    A prompt is looked up here once per request (:meth:`lookup`: one dict lookup per
    leading block, comparing tokens, stopping at the first block no view holds) and then
    on every engine by its ids alone (``held_blocks`` of a view).

    An id lives while a view holds its block or an id interned under it does (so the
    ids of a chain stay stable while any of its blocks is held); :meth:`release` frees
    what nothing holds any more. Ids are never reused.
    """

    def __init__(self) -> None:
        self._ids: dict[_Link, int] = {}
        self._links: dict[int, _Link] = {}
        self._refs: dict[int, int] = {}
        #: Per id (0: the root), how many ids are interned directly under it.
        self._children: dict[int, int] = {}
        #: The ids (0: the root) with two children or more: where prompts part.
        self._branches: set[int] = set()
        #: Per id, its :meth:`tail_key` once asked for.
        self._tail_keys: dict[int, int] = {}
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
            children = self._children[parent] = self._children.get(parent, 0) + 1
            if children == 2:
                self._branches.add(parent)
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
            self._tail_keys.pop(cid, None)
            self.version += 1
            link = self._links.pop(cid)
            del self._ids[link]
            parent = link[0]
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
                if left == 1:
                    self._branches.discard(parent)
            else:
                del self._children[parent]
            cid = parent

    def ids(self) -> Container[int]:
        """The ids held now (for ``in`` tests: an id not in it was forgotten)."""
        return self._links.keys()

    def parent(self, cid: int) -> int:
        """The id ``cid`` is interned under (0: a prompt's first block); 0 for an unknown id."""
        link = self._links.get(cid)
        return link[0] if link is not None else 0

    def tokens(self, cid: int) -> tuple[int, ...]:
        """The tokens of block ``cid`` (empty for an unknown id)."""
        link = self._links.get(cid)
        return link[1] if link is not None else ()

    def tail_key(self, cid: int) -> int:
        """:func:`tail_key` of block ``cid`` and its parent's tokens (kept: a prompt's
        chain is scanned for it on every request)."""
        key = self._tail_keys.get(cid)
        if key is None:
            link = self._links.get(cid)
            if link is None:
                return tail_key((), ())
            parent = self._links.get(link[0])
            key = self._tail_keys[cid] = tail_key(parent[1] if parent is not None else (), link[1])
        return key

    def children(self, cid: int) -> int:
        """How many ids are interned directly under ``cid`` (0: the root)."""
        return self._children.get(cid, 0)

    def group_root(self, chain: Sequence[int]) -> int:
        """The id where the prompt of ``chain`` (its leading ids some view holds) leaves
        the blocks it shares with other prompts: the deepest id of ``chain`` whose parent
        has two children or more, or the chain's first id (0 for an empty chain).

        Prompts of one shared prefix followed by their own tails all have the prefix's
        first block as their root (the tails branch below the chain a new prompt
        matches); a chat template's header that every prompt starts with is no root of
        its own (the prefixes branch under it).
        """
        if not chain:
            return 0
        branches = self._branches
        if not branches.isdisjoint(chain[:-1]):  # (a test in C: most chains part at the root only)
            for i in range(len(chain) - 2, -1, -1):
                if chain[i] in branches:
                    return chain[i + 1]
        return chain[0]

    def content_key(self, cid: int) -> int:
        """A key for block ``cid`` that stays the same when its id is made again (its
        tokens and its ancestors', hashed; the same in every process)."""
        parts = []
        while cid:
            link = self._links.get(cid)
            if link is None:
                break
            parts.append(link[1])
            cid = link[0]
        return hash(tuple(parts))

    def lookup(self, ids: Sequence[int], block_size: int, limit: int) -> list[int]:
        """The chain ids of the leading blocks of ``ids`` that some view holds, at most ``limit``."""
        out: list[int] = []
        parent = 0
        get = self._ids.get
        tokens = iter(ids[: limit * block_size])
        for block in zip(*[tokens] * block_size, strict=False):  # the blocks' tuples, made in C
            cid = get((parent, block))
            if cid is None:
                break
            out.append(cid)
            parent = cid
        return out
