"""The cache plan's groups: the requests that reuse each other's blocks.

A group (:class:`Group`) is the requests of one shared prefix, the turns of one
session, or the requests that name one session:

- a prompt's **prefix group** is found by its chain (:meth:`Chains.group_root`): the
  prompt's blocks down to where it leaves what other prompts share, keyed by that
  block's content (:meth:`Chains.content_key`), so that a prefix evicted everywhere and
  computed again is the same group;
- a prompt that extends an earlier prompt entirely is the earlier one's **session**:
  the earlier prompt's last full block (remembered by its position and its tokens and
  its parent's, :func:`~narwhal.router.chains.tail_key`) is on the new prompt's chain.
  The turns of a session repeat each other whole, while the requests of a shared
  prefix part at the prefix's end, each with a tail of its own. A prefix whose requests
  started :data:`SESSION_ROOT` sessions starts sessions: each of its requests is a new
  session's first turn;
- a request that names a session (its ``user`` field or its ``x-session-id`` header)
  is that **named session**'s, whatever its prompt.

:meth:`Groups.classify` gives each request attempt its :class:`PlanTicket` (its group
and its prompt's chain). Memory is bounded: :data:`MAX_GROUPS` groups and :data:`TAILS`
prompts' last blocks, the least recent forgotten first, and both forgotten after
:data:`GROUP_TTL_S` and :data:`TAIL_TTL_S` idle (:meth:`Groups.expire`). This module
does no I/O.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

from narwhal.router.chains import Chains, tail_key
from narwhal.router.prefix import PromptLookup

__all__ = ["MAX_GROUPS", "SESSION_ROOT", "YOUNG", "Group", "GroupKey", "Groups", "PlanTicket", "decayed_rate"]

#: Seconds over which a group's request rate is averaged (an exponential decay).
RATE_S: Final = 30.0
#: The least time a rate is taken over.
MIN_COVER_S: Final = 10.0
#: A group idle this long is forgotten.
GROUP_TTL_S: Final = 600.0
#: A group is young for its first requests: its owner takes them while its predicted
#: client TTFT is within ``OWNER_WITHIN`` of the target, a miss included (placing
#: a session or a prefix where it should live costs least while it is short and new).
YOUNG: Final = 2
#: A prefix whose requests started this many sessions starts sessions: each of its
#: requests is placed as a new session's first turn.
SESSION_ROOT: Final = 2
#: How far back from the end of a prompt's chain an earlier prompt's last block is
#: looked for (blocks of output that a later turn repeats, when it does).
TAIL_WINDOW: Final = 32
#: Earlier prompts' last blocks remembered, to find the turns that continue them, and
#: for how long.
TAILS: Final = 65536
TAIL_TTL_S: Final = 300.0
#: Groups (prefixes and sessions) remembered at most: past it, the one used least
#: recently is forgotten.
MAX_GROUPS: Final = 20_000

#: A group's key: a prefix's root chain id, a detected session ``("s", n)`` or a named
#: one ``("h", name)``.
GroupKey = int | tuple[str, int] | tuple[str, str]


class Group:
    """One prefix or session: its requests, where they went and who owns it."""

    __slots__ = ("blocks", "born", "chain", "count", "key", "kind", "last", "owners", "placed_on", "sessions", "tokens",
                 "turns")

    def __init__(self, key: GroupKey, kind: str, now: float) -> None:
        self.key = key
        #: ``prefix`` or ``session``.
        self.kind = kind
        #: Producers that own it (empty: not planned yet).
        self.owners: list[str] = []
        #: Decayed count of its requests (:meth:`rate`).
        self.count = 0.0
        self.last = now
        self.born = now
        #: Decayed counts of its requests per producer.
        self.placed_on: dict[str, float] = {}
        #: Blocks its requests share (a prefix's depth, a session's history).
        self.blocks = 0
        #: Its requests' mean prompt tokens (moving).
        self.tokens = 0.0
        self.turns = 0
        #: Sessions its requests started (a system prompt's first turns).
        self.sessions = 0
        #: The chain its latest request matched (what a producer may hold of it).
        self.chain: Sequence[int] = ()

    def rate(self, now: float) -> float:
        """Requests per second, as of ``now`` (the decayed count over the time it covers)."""
        return decayed_rate(self.count, self.last, self.born, now)

    def young(self) -> bool:
        """Whether its owner takes its requests even with a miss (:data:`YOUNG`)."""
        return self.turns < YOUNG

    def label(self) -> str:
        key = self.key
        return f"prefix:{key}" if isinstance(key, int) else f"session:{key[1]}"


class PlanTicket:
    """What the plan knows of one request attempt: its group and its prompt's chain."""

    __slots__ = ("block_size", "chain", "continues", "group", "new_session")

    def __init__(self, group: Group | None, chain: Sequence[int], block_size: int, continues: object,
                 new_session: bool = False) -> None:  # fmt: skip
        self.group = group
        self.chain = chain
        self.block_size = block_size
        #: The request is a session's first turn (its group's requests start sessions, or
        #: it names a session not seen yet): it is placed as the session's owner says.
        self.new_session = new_session
        #: What a prompt that continues this one belongs to: this group (a session), or a
        #: new session under it (a prefix's request: a first turn).
        self.continues = continues


class _NewSession:
    """A session not seen yet: the turn that continues the prompt it was registered for starts it."""

    __slots__ = ("parent", "started")

    def __init__(self, parent: Group | None) -> None:
        self.parent = parent
        #: The session, once a turn continued the prompt.
        self.started: Group | None = None


class Groups:
    """The groups of the requests seen lately (see the module docstring).

    Args:
        chains: The prefix index's chain ids.
        clock: Seconds, monotonic.
    """

    def __init__(self, chains: Chains, clock: Callable[[], float]) -> None:
        self.chains = chains
        self.clock = clock
        self.groups: OrderedDict[GroupKey, Group] = OrderedDict()
        #: Prefix groups by the chain id of their root block now.
        self._roots: dict[int, Group] = {}
        #: The last full block of each recent prompt (its position and a hash of its
        #: tokens and its parent's), with what a prompt passing through it continues, and
        #: when it was seen.
        self._tails: OrderedDict[tuple[int, int], tuple[Group | _NewSession, float]] = OrderedDict()
        #: How many of them end at each block position (a chain is scanned only there).
        self._tail_at: collections.Counter[int] = collections.Counter()
        self._sessions = itertools.count(1)

    def classify(self, lookup: PromptLookup | None, hint: str | None, block_size: int,
                 ids: Sequence[int] | None = None) -> PlanTicket:  # fmt: skip
        """The group of a request: named by ``hint``, else found from its prompt's chain
        (``lookup``, in blocks of ``block_size``); no group for a prompt nothing shares.

        A prompt continues an earlier one (the next turn of its session) when its chain
        passes through the earlier prompt's last full block (remembered here under its
        chain id, from ``ids``): the turns of a session repeat each other whole, while
        the requests of a shared prefix part at the prefix's end, each with a tail of its
        own.
        """
        now = self.clock()
        chain: Sequence[int] = lookup.chain(block_size) if lookup is not None and block_size else ()
        group: Group | None
        if hint is not None:
            key: GroupKey = ("h", hint)
            group = self.groups.get(key)
            if group is None:
                group = self._new_group(key, "session", now)
            return PlanTicket(group, chain, block_size, group, new_session=not group.owners)
        if lookup is None or not block_size:
            return PlanTicket(None, (), 0, None)
        tails = self._tails
        found: Group | _NewSession | None = None
        key_of = self.chains.tail_key
        window = range(len(chain) - 1, max(len(chain) - TAIL_WINDOW, 0) - 1, -1)
        for j in filter(self._tail_at.__contains__, window):  # only where an earlier prompt ended
            entry = tails.get((j, key_of(chain[j])))
            if entry is not None:
                found = entry[0]
                break
        if isinstance(found, _NewSession) and found.started is None:  # a session's second turn: it starts now
            session = self._new_group(("s", next(self._sessions)), "session", now)
            found.started = session
            if found.parent is not None:
                found.parent.sessions += 1
        if isinstance(found, _NewSession):
            found = found.started
        if isinstance(found, Group) and found.key in self.groups:
            group = found
            continues: Group | _NewSession = group
        elif chain:
            root = self.chains.group_root(chain)
            group = self._roots.get(root)
            if group is None:  # a root not seen under this id: its content may have been (evicted, computed again)
                key = self.chains.content_key(root)
                group = self.groups.get(key)
                if group is None:
                    group = self._new_group(key, "prefix", now)
                self._roots[root] = group
            continues = _NewSession(group)
        else:
            group, continues = None, _NewSession(None)
        if ids is not None:
            self._tail(chain, ids, block_size, continues)
        return PlanTicket(group, chain, block_size, continues,
                          new_session=group is not None and group.kind == "prefix" and group.sessions >= SESSION_ROOT)

    def _new_group(self, key: GroupKey, kind: str, now: float) -> Group:
        """A group not seen yet; the one used least recently goes past :data:`MAX_GROUPS`."""
        group = self.groups[key] = Group(key, kind, now)
        if len(self.groups) > MAX_GROUPS:
            self.groups.popitem(last=False)
        return group

    def _tail(self, chain: Sequence[int], ids: Sequence[int], bs: int, continues: Group | _NewSession) -> None:
        """Remember the last full block of prompt ``ids`` (by its position and its tokens
        and its parent's), with what a prompt that passes through it continues, when the
        prompt adds a block of its own to ``chain`` (what it shares)."""
        full = len(ids) // bs
        if full <= len(chain):
            return  # its last block is what it shares
        j = full - 1
        key = (j, tail_key(tuple(ids[(j - 1) * bs : j * bs]) if j else (), tuple(ids[j * bs : full * bs])))
        tails = self._tails
        if key not in tails:
            self._tail_at[j] += 1
        tails[key] = (continues, self.clock())
        tails.move_to_end(key)
        if len(tails) > TAILS:
            self._drop_tail()

    def _drop_tail(self) -> None:
        """Forget the least recent prompt's last block."""
        (j, _), _ = self._tails.popitem(last=False)
        left = self._tail_at[j] - 1
        if left:
            self._tail_at[j] = left
        else:
            del self._tail_at[j]

    def expire(self, now: float) -> list[Group]:
        """Forget the groups idle past :data:`GROUP_TTL_S` (returned), the prompts' last
        blocks past :data:`TAIL_TTL_S`, and the roots whose ids or groups are gone."""
        gone = [self.groups.pop(k) for k, g in list(self.groups.items()) if now - g.last > GROUP_TTL_S]
        tails = self._tails
        while tails and now - next(iter(tails.values()))[1] > TAIL_TTL_S:
            self._drop_tail()
        links = self.chains
        for cid in [c for c, g in self._roots.items()
                    if g.key not in self.groups or (not links.parent(c) and not links.tokens(c))]:  # fmt: skip
            del self._roots[cid]  # its id is gone (the block left every view) or its group is
        return gone

    def touch(self, group: Group) -> None:
        """``group`` was used now (the least recent goes first past :data:`MAX_GROUPS`)."""
        if group.key in self.groups:
            self.groups.move_to_end(group.key)


def decayed_rate(count: float, last: float, born: float, now: float) -> float:
    """Events per second of a count decayed with :data:`RATE_S` since ``born``, last
    counted at ``last``: the count over the (decayed) time it covers (at least
    :data:`MIN_COVER_S`, so that a first event is no rate of its own)."""
    covered = RATE_S * -math.expm1(-max(now - born, MIN_COVER_S) / RATE_S)
    return count * math.exp(-(now - last) / RATE_S) / covered
