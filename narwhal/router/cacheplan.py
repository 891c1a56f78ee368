"""Cache placement as a plan: which producer owns which prefix or session, and what a
placement costs later.

Pricing each request for its own TTFT now puts every request where its prefix is
cached, or on the fastest producer: the fast producer ends up holding more prefixes and
sessions than its cache can, and thrashes, while the slow one idles. What a request
puts in a producer's cache is an investment that later requests of the same prefix or
session either use or lose. So the router keeps a plan:

- **Groups.** Requests that reuse each other's blocks form a group
  (:meth:`CachePlan.classify`): the requests of one shared prefix (the prompt's blocks
  down to where it leaves what other prompts share, :meth:`Chains.group_root`), or the
  turns of one session (a prompt that extends an earlier prompt entirely: the earlier
  prompt's last full block is on the new prompt's chain), or the requests that name one
  session (the request's ``user`` field or its ``x-session-id`` header).
- **Owners.** Each group that has been reused has an owner among the producers: the one
  it lives on when it can take it, else the one that leaves the fleet's load most even
  (its predicted prefill work per second against each producer's time, least loaded
  first, a group's own producer kept unless another is
  :data:`STICKY` less loaded), within each producer's cache (the groups it owns span at
  most :data:`CACHE_SHARE` of its blocks). Every :data:`PLAN_S` the plan is made again
  from the groups' observed rates (:meth:`CachePlan.replan`, off the request path): a
  group busier than :data:`SPLIT_AT` of a producer gets a second owner; one whose owner
  cannot take a miss of it within the target while it lives elsewhere stays where it
  lives.
- **Future cost.** A placement that computes new blocks on a producer evicts what its
  cache holds: each block it adds displaces, for the cache's characteristic time ``T``
  (how long a block stays after its last use), a block that later requests could have
  hit. Per producer the plan solves Che's approximation of an LRU cache over the groups
  placed there (their blocks, their request rates, and the blocks used once):
  ``sum_g F_g (1 - exp(-rate_g T)) + U T = C`` for ``T``, and prices a new block at the
  prefill seconds per second that one block less of cache would cost (the hits lost),
  times ``T`` (:meth:`CachePlan.eviction_s`). A cache with room prices it at zero.

Priced placement (:mod:`narwhal.router.pricing`) takes the owner when the owner meets
the TTFT target within :data:`OWNER_WITHIN` of it (a miss included: that is how a group
moves to where it should live while the fleet has the time to pay for it), else the
producer with the best price (predicted TTFT plus future cost) among those that meet
the target. This module does no I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import trio

from narwhal.router.cachegroups import RATE_S, Group, GroupKey, Groups, PlanTicket, decayed_rate
from narwhal.router.prefix import PrefixIndex, PromptLookup

__all__ = [
    "CACHE_SHARE",
    "LOW_LOAD",
    "LOW_UTIL",
    "MOVE_WITHIN",
    "OWNER_WITHIN",
    "PLAN_S",
    "SESSION_BEHIND",
    "CachePlan",
    "Group",
    "PlanTicket",
    "che_time",
]

#: Seconds between two plans.
PLAN_S: Final = 1.0
#: The groups a producer owns span at most this share of its cache's blocks (the rest
#: holds the requests in flight and the blocks used once).
CACHE_SHARE: Final = 0.7
#: A group stays with its owner unless another producer would be this much less loaded.
STICKY: Final = 0.15
#: A group whose predicted prefill work passes this share of a producer's time gets a
#: second owner.
SPLIT_AT: Final = 0.6
#: A young group's owner (:data:`~narwhal.router.cachegroups.YOUNG`) takes its
#: requests while its predicted client TTFT is within this share of the target, a miss
#: included (placing a session or a prefix where it should live costs least while it is
#: short and new).
OWNER_WITHIN: Final = 0.8
#: An established session's owner takes its turns while it holds this share of what the
#: producer holding most of it does (a turn or so behind, after one went elsewhere).
SESSION_BEHIND: Final = 0.7
#: An established group living elsewhere moves to its owner at low load: the owner's
#: queue under :data:`LOW_LOAD` of the target and its prefill busy under
#: :data:`LOW_UTIL` of its time lately; and while it would still meet
#: :data:`MOVE_WITHIN` of the target with the miss.
LOW_LOAD: Final = 0.1
LOW_UTIL: Final = 0.5
MOVE_WITHIN: Final = 0.5
#: A group with fewer requests a second takes no room in the plan.
IDLE_RATE: Final = 0.01
#: ... and by this share of its time (differences smaller than that are noise).
STICKY_SLACK: Final = 0.02
#: A producer busy more than this share of its time is taken to serve a request in
#: 1 / (1 - this) of its work (the queue of a producer near saturation, bounded).
BUSY_FLOOR: Final = 0.05

#: Predicted prefill seconds of a prompt of ``tokens`` with ``cached`` of them cached on a producer.
PrefillS = Callable[[str, int, int], float]




class CachePlan:
    """The groups, their owners and each producer's price of a new block (see the module docstring).

    Args:
        index: The prefix index (its chain ids and capacities).
        prefill_s: Predicted prefill seconds on a producer (priced placement's).
        clock: Seconds, monotonic.
    """

    def __init__(self, index: PrefixIndex, prefill_s: PrefillS, clock: Callable[[], float]) -> None:
        self.index = index
        self.prefill_s = prefill_s
        self.clock = clock
        #: The groups of the requests seen lately.
        self.grouping = Groups(index.chains, clock)
        self.groups = self.grouping.groups
        #: Per producer: the prefill seconds one new block costs later (:meth:`eviction_s`).
        self.block_price: dict[str, float] = {}
        #: Per producer: the cache's characteristic time and its blocks used once per second.
        self.cache_time: dict[str, float] = {}
        #: Per producer: the decayed count of blocks placed there that no group shares,
        #: when last counted and since when.
        self._unique: dict[str, tuple[float, float, float]] = {}
        #: Per producer: the decayed predicted prefill seconds placed there (likewise).
        self._busy: dict[str, tuple[float, float, float]] = {}
        #: Per producer: the blocks and the predicted work per second of the groups it owns.
        self.owned_blocks: dict[str, int] = {}
        self.owned_load: dict[str, float] = {}
        #: Per producer: the predicted work a second of the groups given it since the last plan.
        self._fresh: dict[str, float] = {}
        #: Owner changes made by the plans (not counting a new group's first owner).
        self.moves = 0
        self.mean_turns = 0.0

    # ------------------------------------------------------------------ the request path

    def classify(self, lookup: PromptLookup | None, hint: str | None, block_size: int,
                 ids: Sequence[int] | None = None) -> PlanTicket:  # fmt: skip
        """The request's group (:meth:`narwhal.router.cachegroups.Groups.classify`)."""
        return self.grouping.classify(lookup, hint, block_size, ids)


    def owners(self, ticket: PlanTicket, producers: Sequence[str], cached: Callable[[str], int],
               prompt_tokens: int, target_s: float | None) -> list[str]:  # fmt: skip
        """The owners of the ticket's group among ``producers``, made now for a group
        reused for the first time (none for a request no other shares)."""
        group = ticket.group
        if group is None:
            return []
        if ticket.new_session:  # a first turn: the session it starts is placed now
            held = {p: cached(p) for p in producers}
            owner = self._assign(group, producers, held, prompt_tokens, target_s, new_session=True)
            owners = [owner] if owner is not None else []
            if group.kind == "session":  # named: it is that session's owner from now on
                group.owners = owners
            return owners
        if group.owners:  # an owner kept out of this attempt (a failure, its breaker) stays the owner
            return [p for p in group.owners if p in producers]
        held = {p: cached(p) for p in producers}
        owner = self._assign(group, producers, held, prompt_tokens, target_s)
        group.owners = [owner] if owner is not None else []
        return group.owners

    def eviction_s(self, producer: str, new_blocks: int) -> float:
        """Prefill seconds that ``new_blocks`` new blocks on ``producer`` cost later requests."""
        return self.block_price.get(producer, 0.0) * new_blocks

    def future_s(self, ticket: PlanTicket, producer: str, cached_tokens: int) -> float:
        """What placing the ticket's request on ``producer`` costs later requests: the
        blocks it would compute again there that another cache holds already (a second
        copy of a prefix or a history, which takes the room of blocks later requests
        would hit), at the producer's price of a block. The blocks no cache holds yet
        (the prompt's own tail) are computed wherever it goes, and cost the same."""
        bs = ticket.block_size
        if not bs:
            return 0.0
        copies = len(ticket.chain) - cached_tokens // bs
        return self.block_price.get(producer, 0.0) * copies if copies > 0 else 0.0

    def utilization(self, producer: str) -> float:
        """The predicted prefill seconds a second placed on ``producer`` lately."""
        count, last, born = self._busy.get(producer, (0.0, 0.0, 0.0))
        return decayed_rate(count, last, born, self.clock()) if count else 0.0

    def low_load(self, producer: str) -> bool:
        """Whether ``producer`` has been busy under :data:`LOW_UTIL` of its time lately."""
        return self.utilization(producer) < LOW_UTIL

    def placed(self, ticket: PlanTicket, producer: str, prompt_tokens: int, work_s: float = 0.0) -> None:
        """A request of the ticket's group was placed on ``producer`` (``work_s``: its
        predicted prefill seconds there)."""
        group = ticket.group
        bs = ticket.block_size
        now = self.clock()
        count, last, born = self._busy.get(producer, (0.0, now, now))
        self._busy[producer] = (count * math.exp(-(now - last) / RATE_S) + work_s, now, born)
        if group is not None:
            self.grouping.touch(group)
            decay = math.exp(-(now - group.last) / RATE_S)
            group.count = group.count * decay + 1.0
            placed_on = group.placed_on
            for p in placed_on:
                placed_on[p] *= decay
            placed_on[producer] = placed_on.get(producer, 0.0) + 1.0
            group.last = now
            group.turns += 1
            group.tokens = prompt_tokens if group.count <= 1.0 else group.tokens + 0.2 * (prompt_tokens - group.tokens)
            if bs:
                group.blocks = prompt_tokens // bs if group.kind == "session" else max(len(ticket.chain), group.blocks)
                if len(ticket.chain) >= len(group.chain):
                    group.chain = ticket.chain
        if bs:
            shared = group.blocks if group is not None else 0
            unique = max(-(-prompt_tokens // bs) - shared, 0)
            count, last, born = self._unique.get(producer, (0.0, now, now))
            self._unique[producer] = (count * math.exp(-(now - last) / RATE_S) + unique, now, born)

    # ------------------------------------------------------------------ the plan

    def _work(self, group: Group, producer: str) -> float:
        """Predicted prefill seconds of one request of ``group`` on ``producer``, a hit."""
        bs = self._block_size()
        tokens = max(int(group.tokens), 1)
        return self.prefill_s(producer, tokens, min(group.blocks * bs, tokens - 1))

    def _block_size(self) -> int:
        for view in self.index.views.values():
            if view.block_size:
                return view.block_size
        return 16

    def _fits(self, producer: str, blocks: int) -> bool:
        capacity = self.index.capacity_blocks.get(producer)
        return capacity is None or self.owned_blocks.get(producer, 0) + blocks <= CACHE_SHARE * capacity

    def _assign(self, group: Group, producers: Sequence[str], held: Mapping[str, int], prompt_tokens: int,
                target_s: float | None, *, new_session: bool = False) -> str | None:  # fmt: skip
        """An owner for ``group`` (or, ``new_session``, for the session a request of it
        starts): the producer whose planned load (the predicted prefill work a second of
        the groups it owns, their requests hits) is least once the group's is added,
        within its cache: groups are shared out by the producers' speed whatever the
        load now, so that a slower producer has its part before the load needs it. The
        one that holds most of it is kept unless another would be :data:`STICKY` less
        loaded (and by :data:`STICKY_SLACK` of its time). Among the producers that could
        compute the request whole within :data:`OWNER_WITHIN` of the target, idle (it is
        placed there while it is young)."""
        if not producers:
            return None
        now = self.clock()
        rate = self._mean_rate(now, sessions=True) if new_session else max(group.rate(now), self._mean_rate(now))
        if group.tokens <= 0:
            group.tokens = float(prompt_tokens)
        blocks = 0 if new_session else max(group.blocks, max(held.values(), default=0) // self._block_size())
        holder = max(producers, key=lambda p: (held[p], -self._planned(p)))
        can_miss = [p for p in producers
                    if target_s is None or held[p] or self.prefill_s(p, prompt_tokens, 0) <= OWNER_WITHIN * target_s]
        candidates = [p for p in can_miss if self._fits(p, blocks)] or can_miss or [holder]
        tokens = max(int(group.tokens), 1)
        cached = min(group.blocks * self._block_size(), tokens - 1)  # its requests, hits
        after = {p: self._planned(p) + rate * self.prefill_s(p, tokens, cached) for p in candidates}
        owner = min(candidates, key=lambda p: (after[p], p))
        if not new_session and held[holder] and holder in candidates and (
                after[holder] <= after[owner] * (1 + STICKY) + STICKY_SLACK):  # fmt: skip
            owner = holder
        self._fresh[owner] = after[owner] - self.owned_load.get(owner, 0.0)
        self.owned_blocks[owner] = self.owned_blocks.get(owner, 0) + blocks
        return owner

    def _planned(self, producer: str) -> float:
        """``producer``'s planned load: the groups it owned at the last plan and those given it since."""
        return self.owned_load.get(producer, 0.0) + self._fresh.get(producer, 0.0)

    @staticmethod
    def _response_s(work_s: float, busy: float) -> float:
        """What a request of ``work_s`` seconds takes, waiting included, on a producer busy
        ``busy`` of its time (the share left serves it: ``work / (1 - busy)``)."""
        return work_s / max(1.0 - busy, BUSY_FLOOR)

    def _own(self, group: Group, owner: str, now: float) -> None:
        """Count ``group``'s blocks and predicted work against ``owner`` in the plan."""
        self.owned_blocks[owner] = self.owned_blocks.get(owner, 0) + group.blocks
        self.owned_load[owner] = self.owned_load.get(owner, 0.0) + group.rate(now) * self._work(group, owner)

    def _can_miss(self, producer: str, group: Group, target_s: float | None) -> bool:
        """Whether ``producer`` computes the whole of one of ``group``'s requests within
        :data:`MOVE_WITHIN` of the target, idle."""
        if target_s is None:
            return True
        return self.prefill_s(producer, max(int(group.tokens), 1), 0) <= MOVE_WITHIN * target_s

    def _balance(self, active: Sequence[Group], producers: Sequence[str], lives: Mapping[GroupKey, str],
                 target_s: float | None, now: float) -> int:  # fmt: skip
        """Give one group of the busiest producer (over :data:`LOW_UTIL` of its time) to
        the least busy one, when its requests would take :data:`STICKY` less there,
        waiting included (:meth:`_response_s`): the smallest such group the other can
        compute whole in time, within its cache (it moves there at low load). Returns
        the groups given (0 or 1)."""
        if len(producers) < 2:
            return 0
        busy = {p: self.utilization(p) for p in producers}
        hot = max(producers, key=lambda p: busy[p])
        cold = min(producers, key=lambda p: busy[p])
        if busy[hot] < LOW_UTIL:
            return 0

        def quicker(g: Group) -> bool:
            here, there = self._work(g, hot), self._work(g, cold)
            after = busy[cold] + g.rate(now) * there
            return self._response_s(there, after) < (1 - STICKY) * self._response_s(here, busy[hot])

        movable = [g for g in active if g.owners and g.owners[0] == hot and lives.get(g.key) == hot
                   and self._can_miss(cold, g, target_s) and self._fits(cold, g.blocks) and quicker(g)]  # fmt: skip
        if not movable:
            return 0
        group = min(movable, key=lambda g: (g.blocks, -g.rate(now)))
        group.owners = [cold]
        self._own(group, cold, now)
        return 1

    def _mean_rate(self, now: float, sessions: bool = False) -> float:
        """The mean request rate of the planned groups (of the sessions only)."""
        groups = [g for g in self.groups.values()
                  if g.owners and now - g.born >= 1.0 and (not sessions or g.kind == "session")]  # fmt: skip
        if not groups:
            return 1.0 / RATE_S
        return sum(g.rate(now) for g in groups) / len(groups)

    def held(self, producer: str, group: Group) -> int:
        """Blocks of ``group`` that ``producer``'s cache holds, as its view says now."""
        view = self.index.view(producer)
        if view is None or producer not in self.index.active or not group.chain:
            return 0
        return view.held_blocks(group.chain)

    def remaining_turns(self, group: Group) -> float:
        """Turns a session is expected to have still (sessions that ended had
        :attr:`mean_turns` on average; infinite before any ended, and for a prefix)."""
        if group.kind != "session" or self.mean_turns <= 0:
            return math.inf
        return max(self.mean_turns - group.turns, 0.0)

    def replan(self, producers: Sequence[str], target_s: float | None) -> int:
        """Make the plan again from the groups' observed rates; return how many groups
        changed owner."""
        now = self.clock()
        for group in self.grouping.expire(now):
            if group.kind == "session" and group.turns:
                self.mean_turns += 0.1 * (group.turns - self.mean_turns)
        self._fresh = {}
        self.owned_blocks = dict.fromkeys(producers, 0)
        self.owned_load = dict.fromkeys(producers, 0.0)
        moved = 0
        active = [g for g in self.groups.values() if g.owners and g.rate(now) >= IDLE_RATE]
        lives: dict[GroupKey, str] = {}
        for group in active:
            where = {p: self.held(p, group) for p in producers}
            home = max(producers, key=lambda p: (where[p], group.placed_on.get(p, 0.0)), default=None)
            current = [p for p in group.owners if p in producers]
            owner = current[0] if current else home
            if owner is None:
                continue
            if home is not None and where[home] and not where[owner] and not self._can_miss(owner, group, target_s):
                owner = home  # it lives elsewhere and cannot move in time: the plan follows
            if home is not None:
                lives[group.key] = home
            if not current or owner != current[0]:
                moved += bool(current)
                group.owners = [owner]
            self._own(group, owner, now)
        moved += self._balance(active, producers, lives, target_s, now)
        self.moves += moved
        self._price_blocks(producers, now)
        return moved

    def _price_blocks(self, producers: Iterable[str], now: float) -> None:
        """Each producer's price of a new block, from Che's approximation of its LRU cache."""
        bs = self._block_size()
        for p in producers:
            capacity = self.index.capacity_blocks.get(p)
            if not capacity:
                self.block_price[p] = 0.0
                continue
            count, last, born = self._unique.get(p, (0.0, now, now))
            unique = decayed_rate(count, last, born, now)
            items = []
            for g in self.groups.values():
                n = g.placed_on.get(p, 0.0)
                if n <= 0 or g.blocks <= 0:
                    continue
                rate = decayed_rate(n, g.last, g.born, now)
                tokens = max(int(g.tokens), 1)
                cached = min(g.blocks * bs, tokens - 1)
                saving = self.prefill_s(p, tokens, 0) - self.prefill_s(p, tokens, cached)
                items.append((g.blocks, rate, max(saving, 0.0)))
            held = self._held_blocks(p)
            room = max(capacity - held, 1)
            t = che_time(items, unique, room)
            self.cache_time[p] = t
            if not math.isfinite(t) or not items:
                self.block_price[p] = 0.0
                continue
            step = max(1.0, 0.02 * room)
            less = che_time(items, unique, max(room - step, 1.0))
            value = (saved(items, t) - saved(items, less)) / step  # prefill s/s per block
            self.block_price[p] = max(value, 0.0) * t

    async def run(
        self,
        producers: Callable[[], Sequence[str]],
        target_s: Callable[[], float | None],
        *,
        publish: Callable[[dict[str, Any]], None] | None = None,
        period_s: float = PLAN_S,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Make the plan every ``period_s`` until cancelled; a plan that moved groups is
        published as a ``cache_plan`` live event."""
        task_status.started()
        while True:
            await trio.sleep(period_s)
            names = producers()
            moved = self.replan(names, target_s())
            if moved and publish is not None:
                publish({"type": "cache_plan", "event": "replanned", "at": time.time(), "moved": moved,
                         "producers": {p: self.status(p) for p in names}})  # fmt: skip

    def block_size(self) -> int:
        """The block size the plan reads prompts in (the index's views')."""
        return self._block_size()

    def _held_blocks(self, producer: str) -> int:
        view = self.index.view(producer)
        return getattr(view, "held", 0)

    def status(self, producer: str) -> dict[str, object]:
        """What the plan says of ``producer`` (``/fleet``)."""
        t = self.cache_time.get(producer)
        return {
            "owned_groups": sum(1 for g in self.groups.values() if g.owners and g.owners[0] == producer),
            "owned_blocks": self.owned_blocks.get(producer, 0),
            "owned_load": round(self.owned_load.get(producer, 0.0), 4),
            "cache_time_s": round(t, 3) if t is not None and math.isfinite(t) else None,
            "eviction_s_per_block": round(self.block_price.get(producer, 0.0), 6),
        }




def che_time(items: Sequence[tuple[int, float, float]], unique_rate: float, capacity: float) -> float:
    """The characteristic time of an LRU cache of ``capacity`` blocks (Che's
    approximation): groups of ``(blocks, request rate, saving)`` and ``unique_rate``
    blocks a second used once; infinite when everything fits for ever."""
    total = sum(b for b, _, _ in items)
    if unique_rate <= 0 and total <= capacity:
        return math.inf

    def filled(t: float) -> float:
        return sum(b * -math.expm1(-r * t) for b, r, _ in items) + unique_rate * t

    lo, hi = 0.0, 1.0
    while filled(hi) < capacity:
        hi *= 2
        if hi > 1e7:
            return math.inf
    for _ in range(40):
        mid = (lo + hi) / 2
        if filled(mid) < capacity:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def saved(items: Sequence[tuple[int, float, float]], t: float) -> float:
    """Prefill seconds a second that the hits of a cache of characteristic time ``t`` save."""
    if not math.isfinite(t):
        return sum(r * s for _, r, s in items)
    return sum(r * s * -math.expm1(-r * t) for _, r, s in items)
