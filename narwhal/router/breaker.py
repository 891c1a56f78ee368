"""Failure streaks, quarantine, ejection and readmission state per engine.

The breaker holds state only; the probes that readmit an engine are run by
:mod:`narwhal.router.probe`, which reports back through :meth:`Breaker.readmit` and
:meth:`Breaker.probe_inconclusive`.

- Every engine fault counts towards the engine's streak (first-token timeouts, a
  handoff that expired while the consumer held it, and mid-stream silence included); a
  success resets it.
- With ``recovery.failure_quarantine_s > 0`` a failed engine leaves placement for that
  long after each failure, while its streak builds.
- After ``recovery.eject_after`` consecutive failures the engine is *ejected*: out of
  placement until a readmission probe succeeds. The failure that ejected it keeps the
  leg that failed (``failed_leg``) and the producer of that request
  (``origin_producer``), so that the probe replays the failing path: a consumer ejected
  after a crossed decode is probed with a fresh handoff from that producer.
- A probe readmits the engine *half-open* (``trial``): placement gives it one live
  request at a time until one succeeds, then full weight; a failure on trial ejects it
  again at once.
- Whole wave: an ejection takes the engine out even when it is the last of its role
  (prefill, decode) in placement. When every engine of a role is out at once (a
  whole-wave restart, a shared dependency down), requests for that role are refused at
  once (:meth:`Breaker.retry_after_s` says when to come back) rather than sent to an
  engine that failed its streak, and the probes bring the role back: each ejected
  engine is probed at its cadence, and the first that succeeds serves again. A
  quarantine, which is not a verdict on the engine, never takes a role's last engine
  in placement out, and a role's last engine in placement is never limited to one
  request at a time on trial.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping

import attrs
import trio

__all__ = ["Breaker", "BreakerState", "Transition"]


@attrs.define
class BreakerState:
    """One engine's breaker state.

    Attributes:
        streak: consecutive failures since the last success.
        quarantined_until: trio time until which placement skips the engine.
        ejected: tripped: out of placement until a readmission probe succeeds.
        trial: readmitted by a probe, not yet proven by live traffic (half-open).
        ejected_at: trio time of the ejection.
        origin_producer: producer of the request whose failure ejected a consumer.
        failed_leg: the leg of the failure that ejected the engine (``"prefill"``,
            ``"decode"``, or ``None`` when unknown).
        next_probe_at: trio time of the next readmission probe.
        probes: probes run since the ejection.
        last_error: detail of the last failure.
    """

    streak: int = 0
    quarantined_until: float = -math.inf
    ejected: bool = False
    trial: bool = False
    ejected_at: float | None = None
    origin_producer: str | None = None
    failed_leg: str | None = None
    next_probe_at: float = math.inf
    probes: int = 0
    last_error: str | None = None


@attrs.frozen
class Transition:
    """A breaker transition, for events and metrics."""

    engine: str
    # "ejected" | "readmitted" | "closed" | "quarantined" | "probe_inconclusive"
    # | "probe_failed"
    event: str
    at: float
    detail: str | None = None


class Breaker:
    """Breaker state for every engine of a fleet.

    Args:
        engines: every engine's name.
        roles: role -> the engines that have it; a quarantine never leaves a role
            without an engine in placement (see the module docstring). Without it every
            engine is a role of its own.
    """

    def __init__(
        self,
        engines: list[str],
        *,
        eject_after: int,
        quarantine_s: float,
        probe_interval_s: float,
        roles: Mapping[str, Collection[str]] | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.eject_after = eject_after
        self.quarantine_s = quarantine_s
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self.states: dict[str, BreakerState] = {name: BreakerState() for name in engines}
        #: engine -> the engine lists of its roles (set by set_roles).
        self._peers: dict[str, list[list[str]]]
        self.set_roles(roles or {})
        self._listeners: list[Callable[[Transition], None]] = []
        self.transitions: list[Transition] = []
        self._wakeup = trio.Event()

    def set_roles(self, roles: Mapping[str, Collection[str]]) -> None:
        """The engines of each role now (the fleet changed); an engine in no role has no peers."""
        self._peers = {name: [] for name in self.states}
        for members in roles.values():
            group = [name for name in members if name in self.states]
            for name in group:
                self._peers[name].append(group)

    def add(self, engine: str) -> None:
        """A new engine (a fleet reload or discovery added it): a clean state, in no role
        until :meth:`set_roles` names it."""
        self.states.setdefault(engine, BreakerState())
        self._peers.setdefault(engine, [])

    def remove(self, engine: str) -> None:
        """The engine left the fleet: its state is forgotten, and later reports about it
        (a probe or a request that outlived it) are ignored."""
        self.states.pop(engine, None)
        for group in self._peers.pop(engine, ()):  # the role groups it was in (shared by their members)
            group.remove(engine)

    def add_listener(self, listener: Callable[[Transition], None]) -> None:
        self._listeners.append(listener)

    def _emit(self, engine: str, event: str, detail: str | None = None) -> None:
        tr = Transition(engine, event, self._clock(), detail)
        self.transitions.append(tr)
        del self.transitions[:-1000]
        for listener in self._listeners:
            listener(tr)

    # ------------------------------------------------------------------ placement

    def _in_placement(self, engine: str, now: float) -> bool:
        """Placeable on the engine's own state (ejection, quarantine)."""
        st = self.states[engine]
        return not st.ejected and now >= st.quarantined_until

    def _last_of_a_role(self, engine: str, now: float) -> bool:
        """No other engine of one of ``engine``'s roles is in placement."""
        return any(
            not any(o != engine and self._in_placement(o, now) for o in group)
            for group in self._peers[engine]
        )

    def available(self, engine: str) -> bool:
        """Whether placement may use ``engine`` now."""
        st = self.states[engine]
        if st.ejected:
            return False
        now = self._clock()
        if now >= st.quarantined_until:
            return True
        # A quarantine never empties a role: the engine stays while it is the last one.
        return self._last_of_a_role(engine, now)

    def on_trial(self, engine: str) -> bool:
        """Half-open: placement gives it one live request at a time (unless the role has
        no other engine in placement)."""
        return self.states[engine].trial and not self._last_of_a_role(engine, self._clock())

    def status(self, engine: str) -> str:
        """``ok``, ``trial``, ``quarantined`` or ``ejected``, for operators."""
        st = self.states[engine]
        if st.ejected:
            return "ejected"
        if not self.available(engine):
            return "quarantined"
        return "trial" if st.trial else "ok"

    # ------------------------------------------------------------------ outcomes

    def record_success(self, engine: str) -> None:
        st = self.states.get(engine)
        if st is None or st.ejected:  # it left the fleet; only a probe readmits it
            return
        st.streak = 0
        if st.trial:
            st.trial = False
            self._emit(engine, "closed", "a live request succeeded on trial: full weight")

    def record_failure(
        self, engine: str, detail: str, *, origin_producer: str | None = None, leg: str | None = None
    ) -> None:
        """Count one failure of ``engine``.

        Args:
            engine: the engine blamed.
            detail: the failure, for operators.
            origin_producer: the failed request's producer (a consumer's probe replays it).
            leg: the leg that failed (``"prefill"`` or ``"decode"``).
        """
        st = self.states.get(engine)
        if st is None:  # it left the fleet
            return
        st.last_error = detail
        if st.ejected:
            return
        st.streak += 1
        now = self._clock()
        if self.quarantine_s > 0:
            st.quarantined_until = now + self.quarantine_s
            self._emit(engine, "quarantined", detail)
        if st.streak >= self.eject_after or st.trial:
            # On trial one failure is enough: the probe did not tell the truth.
            self._eject(engine, detail, origin_producer if origin_producer != engine else None, leg=leg)

    def eject(self, engine: str, detail: str) -> None:
        """Take ``engine`` out of placement now (it failed the start-up probe); a
        readmission probe brings it back."""
        st = self.states.get(engine)
        if st is None:
            return
        st.last_error = detail
        if not st.ejected:
            self._eject(engine, detail, None, leg=None)

    def _eject(self, engine: str, detail: str, origin_producer: str | None, *, leg: str | None) -> None:
        st = self.states[engine]
        now = self._clock()
        st.ejected = True
        st.trial = False
        st.ejected_at = now
        st.probes = 0
        st.origin_producer = origin_producer
        st.failed_leg = leg
        st.next_probe_at = now + self.probe_interval_s
        self._emit(engine, "ejected", detail)
        self._wakeup.set()

    # ------------------------------------------------------------------ probes

    def due_probes(self) -> list[str]:
        now = self._clock()
        return [n for n, st in self.states.items() if st.ejected and st.next_probe_at <= now]

    def next_probe_at(self) -> float:
        return min((st.next_probe_at for st in self.states.values() if st.ejected), default=math.inf)

    def retry_after_s(self, engines: Iterable[str]) -> float:
        """When a request refused for want of one of ``engines`` (every one out of
        placement) may come back: the seconds until the soonest probe of an ejected one
        is due; ``recovery.probe_interval_s`` while that probe runs (its verdict readmits
        the engine or sets the next probe an interval later), and when none of them is
        ejected (the role has no engine: only a fleet change brings one)."""
        now = self._clock()
        waits = [
            st.next_probe_at - now if st.next_probe_at > now else self.probe_interval_s
            for st in (self.states.get(name) for name in engines)
            if st is not None and st.ejected
        ]  # fmt: skip
        return min(waits, default=self.probe_interval_s)

    async def wait_for_change(self) -> None:
        """Wait until an engine is ejected (the probe loop's wakeup)."""
        await self._wakeup.wait()
        self._wakeup = trio.Event()

    def poke(self) -> None:
        """Wake the probe loop (a probe finished)."""
        self._wakeup.set()

    def readmit(self, engine: str) -> None:
        """Back in placement, half-open (a probe succeeded)."""
        st = self.states.get(engine)
        if st is None:
            return
        st.ejected = False
        st.trial = True
        st.streak = 0
        st.quarantined_until = -math.inf
        st.next_probe_at = math.inf
        st.origin_producer = None
        st.failed_leg = None
        self._emit(engine, "readmitted")

    def probe_failed(self, engine: str, detail: str) -> None:
        st = self.states.get(engine)
        if st is None:
            return
        st.probes += 1
        st.last_error = detail
        st.next_probe_at = self._clock() + self.probe_interval_s
        self._emit(engine, "probe_failed", detail)

    def probe_inconclusive(self, engine: str, detail: str) -> None:
        """The probe could not decide (e.g. the origin producer failed): normal cadence."""
        st = self.states.get(engine)
        if st is None:
            return
        st.probes += 1
        st.next_probe_at = self._clock() + self.probe_interval_s
        self._emit(engine, "probe_inconclusive", detail)
