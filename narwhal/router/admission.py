"""Admission: before placement, a request gets a ticket of its tenant and latency class,
passes its tenant's limits, and is placed against its class's targets or waits for
capacity in a bounded queue.

Per request (:class:`Admission`), with a ``tenancy`` section:

1. :meth:`~Admission.ticket` names the tenant and class (:mod:`narwhal.router.tenants`);
2. :meth:`~Admission.admit` takes the request from its tenant's limits (requests in
   flight, requests/s, tokens/s); past one it is answered 429 with ``Retry-After``. With a
   store (``tenancy.store``) the limits are the fleet's (:mod:`narwhal.router.store`);
   without one, or while the store is unreachable and ``on_outage`` is ``local``, each
   process enforces its share (the limits divided by ``tenancy.replicas``);
3. :meth:`~Admission.acquire` places it against its class's targets. A class that may
   not wait is refused (503) when no placement meets them now. A class that may wait is
   placed at once when nothing of its priority or more urgent is queued for its model and
   a placement meets its targets; else it joins the queue of its priority, under its
   tenant. Whenever capacity may have changed (a reservation ended, the fleet changed),
   the queue is released in order: the most urgent priority first; within a priority,
   the tenant that has been served the fewest tokens per unit of weight (its share)
   first, each tenant's requests in arrival order (weighted fair queueing by tokens
   served, as VTC: a tenant that becomes backlogged starts from the least-served
   backlogged tenant's count, so idle time banks nothing). A head that cannot be placed
   yet keeps its tenant waiting, and every less urgent request of its model behind it;
   other tenants of its priority go on. A request still queued at its class's deadline
   (``max_wait_s`` from arrival) is refused with 503; so is one that finds the queue
   full. Nothing placed is ever taken back: a stream already going is never cut;
4. :meth:`~Admission.release` ends the ticket: its in-flight count, and the tokens it
   was charged for and did not use.

A request is placed only where it leaves room for others
(:class:`~narwhal.router.placement.Room`): a lower class's where the classes above keep
room for theirs (:data:`narwhal.router.pricing.YIELD_SHARE`), and a class that may wait
only where its prefill starts within about one prefill. The engines' queues stay short;
what waits, waits in the router's queue, where a higher class's arrival goes ahead of
it and tenants take their turns.

Without a ``tenancy`` section the ticket is a constant and :meth:`~Admission.acquire` is
placement's own ``acquire``: one class, ``controller.slo``, ``controller.admission``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import trio

from narwhal.config import FleetConfig, TenantLimits
from narwhal.errors import NarwhalError, RateLimited, Refused
from narwhal.router.cacheplan import PlanTicket
from narwhal.router.placement import Placement, Reservation
from narwhal.router.pricing import NoCapacity
from narwhal.router.sharedkv import HeldChain
from narwhal.router.store import SharedLimits, StoreUnavailable
from narwhal.router.tenants import ClassSpec, Tenancy, TenantSpec

__all__ = ["Admission", "Ticket"]

log = logging.getLogger("narwhal.router.admission")

#: A store lease outlives its request's deadline by this much before it lapses.
LEASE_MARGIN_S: Final = 30.0
_lease_ids = itertools.count(1)
_LEASE_PREFIX: Final = secrets.token_hex(6)


@attrs.define(eq=False, slots=True)
class Ticket:
    """What admission knows of one request.

    Attributes:
        tenant: its tenant (None: the fleet has no ``tenancy``).
        latency_class: its class.
        queued_s: seconds it waited in the queue (all attempts).
        queue_reason: why it was queued (the first time).
        charged: tokens per unit of weight charged to its tenant's share, until the
            request ends (:meth:`Admission.release` settles it).
        lease: its in-flight lease in the store (None: counted locally, or not at all).
        counted: whether it holds one of its tenant's local in-flight places.
    """

    tenant: TenantSpec | None
    latency_class: ClassSpec
    queued_s: float = 0.0
    queue_reason: str | None = None
    charged: float = 0.0
    lease: str | None = None
    counted: bool = False


@attrs.define(eq=False, slots=True)
class _Waiter:
    ticket: Ticket
    model: str | None
    place: Callable[[float], Reservation]
    t0: float
    tokens: int
    since: float = 0.0
    done: trio.Event = attrs.Factory(trio.Event)
    reservation: Reservation | None = None
    error: NarwhalError | None = None
    miss: str = ""


class _Bucket:
    """A token bucket: ``rate`` per second, ``depth`` deep; a take larger than the depth
    is allowed from a full bucket (the level goes below zero: a debt)."""

    __slots__ = ("at", "depth", "level", "rate")

    def __init__(self, rate: float, depth: float, now: float) -> None:
        self.rate, self.depth, self.level, self.at = rate, depth, depth, now

    def wait_s(self, now: float, amount: float) -> float:
        """Seconds until ``amount`` may be taken (0: now)."""
        self.level = min(self.depth, self.level + (now - self.at) * self.rate)
        self.at = now
        need = min(amount, self.depth)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount


class _TenantState:
    """One tenant's local limits and queue counts."""

    __slots__ = ("in_flight", "requests", "tokens")

    def __init__(self) -> None:
        self.in_flight = 0
        self.requests: _Bucket | None = None
        self.tokens: _Bucket | None = None


def _share(limits: TenantLimits, processes: int) -> TenantLimits:
    """A process's share of ``limits`` among ``processes``."""
    if processes <= 1:
        return limits
    return attrs.evolve(
        limits,
        max_in_flight=None if limits.max_in_flight is None else max(1, limits.max_in_flight // processes),
        requests_per_s=None if limits.requests_per_s is None else limits.requests_per_s / processes,
        tokens_per_s=None if limits.tokens_per_s is None else limits.tokens_per_s / processes,
    )


class Admission:
    """Tickets, limits and the wait queue of one router (see the module docstring)."""

    def __init__(self, config: FleetConfig, placement: Placement, *, clock: Callable[[], float] = trio.current_time,
                 store: SharedLimits | None = None) -> None:  # fmt: skip
        self.placement = placement
        self.clock = clock
        self.store = store
        self._tenants: dict[str, _TenantState] = {}
        #: Tokens served per unit of weight, per tenant: the fleet's (with a store, as of
        #: the last exchange) plus this process's since.
        self.served: dict[str, float] = collections.defaultdict(float)
        self._unsynced: dict[str, float] = collections.defaultdict(float)
        #: priority -> tenant -> its queued requests, in arrival order (no empty deque).
        self._levels: dict[int, dict[str, collections.deque[_Waiter]]] = {}
        #: Requests queued per class, and per (class, tenant).
        self.queued: collections.Counter[str] = collections.Counter()
        self.queued_by: collections.Counter[tuple[str, str]] = collections.Counter()
        self._waiting = 0
        #: Requests queued per (priority, model).
        self._models: collections.Counter[tuple[int, str | None]] = collections.Counter()
        self._nonempty = trio.Event()
        #: Outcomes per (class, tenant): queued, released, expired, full, limited.
        self.counters: collections.Counter[tuple[str, str, str]] = collections.Counter()
        #: Whether the store answered its last exchange.
        self.store_ok = store is not None
        self.configure(config)

    # ------------------------------------------------------------------ the document

    def configure(self, config: FleetConfig) -> None:
        """Serve ``config``'s tenants and classes (at start and after a reload): tenants
        keep their share and their in-flight requests."""
        self.config = config
        self.tenancy = Tenancy(config)
        tenancy = config.tenancy
        self.processes = tenancy.replicas if tenancy is not None else 1
        self.request_timeout_s = config.engine.request_timeout_s
        self._default = Ticket(None, self.tenancy.default_class)
        tenants = self.tenancy.tenants
        now = self.clock() if tenants else 0.0  # (a router without tenants is built outside trio too)
        for name, spec in tenants.items():
            st = self._tenants.setdefault(name, _TenantState())
            lim = _share(spec.limits, self.processes)
            st.requests = _rebucket(st.requests, lim.requests_per_s, lim.burst_s, now)
            st.tokens = _rebucket(st.tokens, lim.tokens_per_s, lim.burst_s, now)

    def use_store(self, store: SharedLimits) -> None:
        """Keep the tenants' limits and shares in ``store`` (``tenancy.store``) from now on."""
        self.store = store
        self.store_ok = True

    @property
    def enabled(self) -> bool:
        return self.tenancy.enabled

    # ------------------------------------------------------------------ per request

    def ticket(self, header: Callable[[str], str | None], key_name: str | None, body: dict[str, Any]) -> Ticket:
        """The request's tenant and class; with ``tenancy.engine_priority`` its ``body``
        carries the class's priority to the engines (whatever priority the client sent).

        Raises:
            Forbidden: see :meth:`narwhal.router.tenants.Tenancy.identify`.
        """
        tenant, klass = self.tenancy.identify(header, key_name)
        if tenant is None:
            return self._default
        if self.tenancy.engine_priority:
            body["priority"] = klass.priority
        return Ticket(tenant, klass)

    async def admit(self, ticket: Ticket, prompt_tokens: int, max_tokens: int) -> None:
        """Take the request from its tenant's limits.

        Raises:
            RateLimited: a limit is reached (429; ``retry_after_s`` when it allows one).
            Refused: the store is unreachable and ``on_outage`` is ``refuse``.
        """
        tenant = ticket.tenant
        if tenant is None or not tenant.limited:
            return
        tokens = prompt_tokens + max_tokens
        store = self.store
        if store is not None:
            lease = f"{_LEASE_PREFIX}-{next(_lease_ids)}"
            try:
                wait, which = await store.admit(tenant.name, tenant.limits, tokens, lease,
                                                self.request_timeout_s + LEASE_MARGIN_S)  # fmt: skip
            except StoreUnavailable as exc:
                if self.store_ok:  # (once an outage: the next answer of the store ends it)
                    log.warning("limits store unreachable: tenants limited by %s: %s", "nobody: requests refused"
                                if store.config.on_outage == "refuse" else "this process's share", exc)  # fmt: skip
                self.store_ok = False
                if store.config.on_outage == "refuse":
                    raise Refused(f"the limits store is unreachable (tenancy.store.on_outage: refuse): {exc}",
                                  retry_after_s=1.0) from None  # fmt: skip
            else:
                self.store_ok = True
                if wait > 0:
                    self._limited(ticket, which, wait)
                if tenant.limits.max_in_flight is not None:
                    ticket.lease = lease
                return
        st = self._tenants[tenant.name]
        now = self.clock()
        lim = _share(tenant.limits, self.processes)
        waits = []
        if st.requests is not None:
            waits.append((st.requests.wait_s(now, 1), "requests_per_s"))
        if st.tokens is not None:
            waits.append((st.tokens.wait_s(now, tokens), "tokens_per_s"))
        if lim.max_in_flight is not None and st.in_flight >= lim.max_in_flight:
            waits.append((1.0, "max_in_flight"))
        wait, which = max(waits, default=(0.0, ""))
        if wait > 0:
            self._limited(ticket, which, wait)
        if st.requests is not None:
            st.requests.take(1)
        if st.tokens is not None:
            st.tokens.take(tokens)
        if lim.max_in_flight is not None:
            st.in_flight += 1
            ticket.counted = True

    def _limited(self, ticket: Ticket, which: str, wait: float) -> None:
        tenant = ticket.tenant
        assert tenant is not None
        self.counters[(str(ticket.latency_class.name), tenant.name, "limited")] += 1
        shared = "" if self.store is not None and self.store_ok else self._share_note()
        raise RateLimited(f"tenant {tenant.name} is over its {which} limit{shared}", retry_after_s=wait)

    def _share_note(self) -> str:
        return f" (this router's share: 1/{self.processes})" if self.processes > 1 else ""

    async def acquire(
        self,
        ticket: Ticket,
        prompt_tokens: int,
        max_tokens: int,
        *,
        arrival: float,
        deadline: float,
        avoid: frozenset[str] = frozenset(),
        elapsed_s: float = 0.0,
        cached: Callable[[str], int] | None = None,
        model: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        held: Callable[[str], HeldChain] | None = None,
        plan: PlanTicket | None = None,
    ) -> Reservation:
        """A placement for the request, against its class's targets (see the module
        docstring); ``deadline`` is the request's own (the caller bounds it by its
        class's TTFT target: a resumed stream's is not), ``plan`` its ticket of the cache
        plan.

        Raises:
            Refused: no placement meets the class's targets and it may not wait, its queue
                is full, or it waited past its class's deadline.
            NoEngine: no engine of a role is left.
        """
        klass = ticket.latency_class
        placement = self.placement
        if ticket.tenant is None:  # no tenancy: placement's own admission, as ever
            return await placement.acquire(
                prompt_tokens, max_tokens, avoid=avoid, deadline=deadline,
                elapsed_s=elapsed_s, cached=cached, model=model, prompt_ids=prompt_ids, held=held, plan=plan,
            )  # fmt: skip
        if not klass.wait:
            reservation = await placement.acquire(
                prompt_tokens, max_tokens, avoid=avoid, deadline=deadline,
                elapsed_s=elapsed_s, cached=cached, model=model, prompt_ids=prompt_ids, held=held, plan=plan,
                slo=klass.slo, room=klass.room, admission="refuse",
            )  # fmt: skip
            self._charge(ticket, prompt_tokens + max_tokens)
            return reservation
        t0 = self.clock() - elapsed_s

        def place(now: float) -> Reservation:
            return placement.choose_for(klass.slo, klass.room, prompt_tokens, max_tokens, avoid=avoid,
                                        elapsed_s=now - t0, cached=cached, model=model, prompt_ids=prompt_ids,
                                        held=held, plan=plan)  # fmt: skip

        waiter = _Waiter(ticket, model, place, t0, prompt_tokens + max_tokens)
        ahead = self._ahead(klass.priority, model)
        if not ahead:
            try:
                reservation = place(self.clock())
            except NoCapacity as miss:
                waiter.miss = _missed(klass, miss)
            else:
                self._charge(ticket, prompt_tokens + max_tokens)
                return reservation
        else:
            waiter.miss = f"{ahead} request(s) of its priority or above queued ahead of it"
        return await self._wait(waiter, min(deadline, arrival + (klass.max_wait_s or math.inf)))

    def _ahead(self, priority: int, model: str | None) -> int:
        """Requests queued for ``model`` at ``priority`` or more urgent."""
        if not self._waiting:
            return 0
        return sum(n for (p, m), n in self._models.items() if p <= priority and m == model)

    async def _wait(self, waiter: _Waiter, deadline: float) -> Reservation:
        ticket = waiter.ticket
        klass, tenant = ticket.latency_class, ticket.tenant
        assert tenant is not None and klass.name is not None
        labels = (klass.name, tenant.name)
        if self.queued[klass.name] >= klass.max_queued:
            self.counters[(*labels, "full")] += 1
            raise Refused(f"the {klass.name} queue is full ({klass.max_queued} requests, tenancy.classes[].max_queued): "
                          f"{waiter.miss}")  # fmt: skip
        if ticket.queue_reason is None:
            ticket.queue_reason = waiter.miss
        since = waiter.since = self.clock()
        self._enqueue(waiter)
        self.counters[(*labels, "queued")] += 1
        granted = False
        try:
            if self._ahead(klass.priority, waiter.model) > 1:
                self.dispatch()  # it may be placeable where the heads ahead of it are not
            with trio.move_on_at(deadline):
                await waiter.done.wait()
            granted = waiter.reservation is not None
        finally:
            ticket.queued_s += self.clock() - since
            if not waiter.done.is_set():
                head = self._is_head(waiter)
                self._dequeue(waiter)
                if head and self._waiting:  # what was behind it may be placeable
                    self.dispatch()
            elif not granted and waiter.reservation is not None:  # granted, but the request is gone
                waiter.reservation.release()
        if waiter.reservation is not None:  # (charged when the queue released it)
            self.counters[(*labels, "released")] += 1
            return waiter.reservation
        if waiter.error is not None:
            raise waiter.error
        self.counters[(*labels, "expired")] += 1
        raise Refused(f"waited {self.clock() - since:.3g} s in the {klass.name} queue until its deadline "
                      f"(tenancy.classes[].max_wait_s): {waiter.miss}")  # fmt: skip

    def _enqueue(self, waiter: _Waiter) -> None:
        ticket = waiter.ticket
        tenant, klass = ticket.tenant, ticket.latency_class
        assert tenant is not None and klass.name is not None
        tenants = self._levels.setdefault(klass.priority, {})
        queue = tenants.get(tenant.name)
        if queue is None:  # newly backlogged: no credit for the time it was idle (VTC)
            others = [self.served[t] for t in tenants]
            if others and self.served[tenant.name] < min(others):
                self._add_served(tenant.name, min(others) - self.served[tenant.name])
            queue = tenants[tenant.name] = collections.deque()
        queue.append(waiter)
        self._models[(klass.priority, waiter.model)] += 1
        self.queued[klass.name] += 1
        self.queued_by[(klass.name, tenant.name)] += 1
        self._waiting += 1
        if self._waiting == 1:
            self._nonempty.set()

    def _is_head(self, waiter: _Waiter) -> bool:
        ticket = waiter.ticket
        assert ticket.tenant is not None
        queue = self._levels[ticket.latency_class.priority][ticket.tenant.name]
        return queue[0] is waiter

    def _dequeue(self, waiter: _Waiter) -> None:
        ticket = waiter.ticket
        tenant, klass = ticket.tenant, ticket.latency_class
        assert tenant is not None and klass.name is not None
        tenants = self._levels[klass.priority]
        queue = tenants[tenant.name]
        queue.remove(waiter)
        if not queue:
            del tenants[tenant.name]
            if not tenants:
                del self._levels[klass.priority]
        self._models[(klass.priority, waiter.model)] -= 1
        self.queued[klass.name] -= 1
        self.queued_by[(klass.name, tenant.name)] -= 1
        self._waiting -= 1
        if not self._waiting:
            self._nonempty = trio.Event()

    def dispatch(self) -> None:
        """Release what the queue can place now, in order (see the module docstring)."""
        blocked: set[str | None] = set()  # models a more urgent head is waiting for
        for priority in sorted(self._levels):
            tenants = self._levels.get(priority)
            failed: set[str] = set()
            newly: set[str | None] = set()
            while tenants:
                heads = {t: q[0] for t, q in tenants.items() if t not in failed and q[0].model not in blocked}
                if not heads:
                    break
                # The least served per unit of weight; on a tie, the longest waiting.
                name = min(heads, key=lambda t: (self.served[t], heads[t].t0))
                waiter = heads[name]
                try:
                    reservation = waiter.place(self.clock())
                except NoCapacity as miss:
                    klass = waiter.ticket.latency_class
                    waiter.miss = _missed(klass, miss)
                    if _hopeless(klass, miss):  # refused now: the next of its tenant's may go
                        self.counters[(str(klass.name), name, "expired")] += 1
                        waiter.error = Refused(
                            f"can no longer meet the {klass.name} TTFT target after waiting "
                            f"{self.clock() - waiter.since:.3g} s in its queue: {waiter.miss}"
                        )
                    else:
                        failed.add(name)
                        newly.add(waiter.model)
                        continue
                except NarwhalError as err:  # NoEngine: refused as it would be on arrival
                    waiter.error = err
                else:
                    waiter.reservation = reservation
                    self._charge(waiter.ticket, waiter.tokens)  # now, not when its task runs: the next choice sees it
                self._dequeue(waiter)
                waiter.done.set()
                tenants = self._levels.get(priority)
            blocked |= newly

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Release the queue whenever capacity may have changed; with a store, exchange
        the tenants' served tokens every ``tenancy.store.sync_s``."""
        async with trio.open_nursery() as nursery:
            if self.store is not None:
                nursery.start_soon(self._sync)
            task_status.started()
            while True:
                await self._nonempty.wait()
                await self.placement.wait_capacity()
                self.dispatch()

    async def _sync(self) -> None:
        store = self.store
        assert store is not None
        while True:
            await trio.sleep(store.config.sync_s)
            pending = dict(self._unsynced)
            self._unsynced.clear()
            try:
                totals = await store.exchange_served(pending)
            except StoreUnavailable as exc:
                if self.store_ok:
                    log.warning("limits store unreachable: fair shares follow this process's traffic: %s", exc)
                self.store_ok = False
                for name, tokens in pending.items():
                    self._unsynced[name] += tokens
                continue
            self.store_ok = True
            for name, total in totals.items():
                self.served[name] = total + self._unsynced.get(name, 0.0)

    # ------------------------------------------------------------------ the end

    def _charge(self, ticket: Ticket, tokens: int) -> None:
        tenant = ticket.tenant
        if tenant is None:
            return
        share = tokens / tenant.weight
        ticket.charged += share
        self._add_served(tenant.name, share)

    def _add_served(self, name: str, amount: float) -> None:
        self.served[name] += amount
        if self.store is not None:
            self._unsynced[name] += amount

    async def release(self, ticket: Ticket, output_tokens: int, requested_tokens: int) -> None:
        """The request ended: give back its in-flight place, and the output tokens it was
        charged for and did not get (``requested_tokens`` asked, ``output_tokens`` got)."""
        tenant = ticket.tenant
        if tenant is None:
            return
        if ticket.charged and requested_tokens > output_tokens:
            self._add_served(tenant.name, -min(ticket.charged, (requested_tokens - output_tokens) / tenant.weight))
        ticket.charged = 0.0  # settled
        if ticket.counted:
            ticket.counted = False
            self._tenants[tenant.name].in_flight -= 1
        lease, ticket.lease = ticket.lease, None
        if lease is not None and self.store is not None:
            with trio.CancelScope(shield=True):
                try:
                    await self.store.release(tenant.name, lease)
                except StoreUnavailable as exc:  # it lapses by itself (the request's deadline and a margin)
                    log.warning("limits store unreachable: tenant %s's in-flight lease lapses by itself: %s",
                                tenant.name, exc)  # fmt: skip

    def view(self) -> dict[str, Any]:
        """The classes, the tenants (no keys) and the queue, for ``GET /fleet``."""
        classes = {
            name: {"priority": c.priority, "ttft_s": c.slo.ttft_s if c.slo else None,
                   "tpot_s": c.slo.tpot_s if c.slo else None, "wait": c.wait, "max_wait_s": c.max_wait_s,
                   "queued": self.queued[name]}
            for name, c in self.tenancy.classes.items()
        }  # fmt: skip
        tenants = {
            name: {"class": t.latency_class.name, "weight": t.weight, "served_tokens": self.served[name],
                   "queued": {c: n for (c, tn), n in self.queued_by.items() if tn == name and n}}
            for name, t in self.tenancy.tenants.items()
        }  # fmt: skip
        out: dict[str, Any] = {"classes": classes, "tenants": tenants, "processes": self.processes}
        if self.store is not None:
            out["store"] = "ok" if self.store_ok else "unreachable"
        return out


def _rebucket(bucket: _Bucket | None, rate: float | None, burst_s: float, now: float) -> _Bucket | None:
    if rate is None:
        return None
    if bucket is None:
        return _Bucket(rate, rate * burst_s, now)
    bucket.wait_s(now, 0)  # settle at the old rate
    bucket.rate, bucket.depth = rate, rate * burst_s
    bucket.level = min(bucket.level, bucket.depth)
    return bucket


def _hopeless(klass: ClassSpec, miss: NoCapacity) -> bool:
    """Whether the request can no longer meet its class's TTFT target, were the producer
    idle: the time it has spent and its own prefill are past it."""
    p, target = miss.producer, klass.ttft_s
    return target is not None and p.elapsed_s + p.own_s + miss.handoff_s > target


def _missed(klass: ClassSpec, miss: NoCapacity) -> str:
    """Why a request of ``klass`` was not placed, from the best pair's quotes."""
    p, c = miss.producer, miss.consumer
    if c.kv_over:
        return f"no KV room on {c.engine} (this request would pass its capacity by {c.kv_over} tokens)"
    ttft, slo = p.predicted_s + miss.handoff_s, klass.slo
    meets = (slo is None or slo.ttft_s is None or ttft <= slo.ttft_s) and (
        slo is None or slo.tpot_s is None or c.predicted_s <= slo.tpot_s)  # fmt: skip
    if meets:  # the targets hold, the room left for others does not
        return (f"{p.engine} is busy: placed now it would leave too little room for more urgent classes or "
                f"queue in the engine (predicted TTFT {ttft * 1000:.1f} ms, TPOT {c.predicted_s * 1000:.1f} ms "
                f"on {c.engine})")  # fmt: skip
    return (f"no placement meets the {klass.name} targets now (predicted TTFT {ttft * 1000:.1f} ms on "
            f"{p.engine}, TPOT {c.predicted_s * 1000:.1f} ms on {c.engine})")  # fmt: skip
