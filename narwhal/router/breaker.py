"""Failure streaks, quarantine, ejection and readmission state per engine.

The breaker holds state only; the probes that readmit an engine are run by
:mod:`narwhal.router.probe`, which reports back through :meth:`Breaker.readmit` and
:meth:`Breaker.probe_inconclusive`.

- Every engine fault counts towards the engine's streak (first-token timeouts and
  mid-stream silence included); a success resets it.
- With ``recovery.failure_quarantine_s > 0`` a failed engine leaves placement for that
  long after each failure, while its streak builds.
- After ``recovery.eject_after`` consecutive failures the engine is *ejected*: out of
  placement until a readmission probe succeeds. The failure that ejected it keeps the
  producer of that request (``origin_producer``) so that a consumer ejected after a
  crossed decode is probed with a fresh handoff from that producer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import trio

__all__ = ["Breaker", "BreakerState", "Transition"]


@attrs.define
class BreakerState:
    """One engine's breaker state.

    Attributes:
        streak: consecutive failures since the last success.
        quarantined_until: trio time until which placement skips the engine.
        ejected: out of placement until a probe readmits it.
        ejected_at: trio time of the ejection.
        origin_producer: producer of the request whose failure ejected a consumer.
        next_probe_at: trio time of the next readmission probe.
        probes: probes run since the ejection.
        last_error: detail of the last failure.
    """

    streak: int = 0
    quarantined_until: float = -math.inf
    ejected: bool = False
    ejected_at: float | None = None
    origin_producer: str | None = None
    next_probe_at: float = math.inf
    probes: int = 0
    last_error: str | None = None


@attrs.frozen
class Transition:
    """A breaker transition, for events and metrics."""

    engine: str
    event: str  # "ejected" | "readmitted" | "quarantined" | "probe_inconclusive" | "probe_failed"
    at: float
    detail: str | None = None


class Breaker:
    """Breaker state for every engine of a fleet."""

    def __init__(
        self,
        engines: list[str],
        *,
        eject_after: int,
        quarantine_s: float,
        probe_interval_s: float,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.eject_after = eject_after
        self.quarantine_s = quarantine_s
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self.states: dict[str, BreakerState] = {name: BreakerState() for name in engines}
        self._listeners: list[Callable[[Transition], None]] = []
        self.transitions: list[Transition] = []
        self._wakeup = trio.Event()

    def add_listener(self, listener: Callable[[Transition], None]) -> None:
        self._listeners.append(listener)

    def _emit(self, engine: str, event: str, detail: str | None = None) -> None:
        tr = Transition(engine, event, self._clock(), detail)
        self.transitions.append(tr)
        del self.transitions[:-1000]
        for listener in self._listeners:
            listener(tr)

    def available(self, engine: str) -> bool:
        """Whether placement may use ``engine`` now."""
        st = self.states[engine]
        return not st.ejected and self._clock() >= st.quarantined_until

    def record_success(self, engine: str) -> None:
        st = self.states[engine]
        if not st.ejected:
            st.streak = 0

    def record_failure(self, engine: str, detail: str, *, origin_producer: str | None = None) -> None:
        """Count one failure of ``engine`` (``origin_producer``: the request's producer)."""
        st = self.states[engine]
        st.last_error = detail
        if st.ejected:
            return
        st.streak += 1
        now = self._clock()
        if self.quarantine_s > 0:
            st.quarantined_until = now + self.quarantine_s
            self._emit(engine, "quarantined", detail)
        if st.streak >= self.eject_after:
            self._eject(engine, detail, origin_producer if origin_producer != engine else None)

    def eject(self, engine: str, detail: str) -> None:
        """Take ``engine`` out of placement now (it failed the start-up probe); a
        readmission probe brings it back."""
        st = self.states[engine]
        st.last_error = detail
        if not st.ejected:
            self._eject(engine, detail, None)

    def _eject(self, engine: str, detail: str, origin_producer: str | None) -> None:
        st = self.states[engine]
        now = self._clock()
        st.ejected = True
        st.ejected_at = now
        st.probes = 0
        st.origin_producer = origin_producer
        st.next_probe_at = now + self.probe_interval_s
        self._emit(engine, "ejected", detail)
        self._wakeup.set()

    def due_probes(self) -> list[str]:
        now = self._clock()
        return [n for n, st in self.states.items() if st.ejected and st.next_probe_at <= now]

    def next_probe_at(self) -> float:
        return min((st.next_probe_at for st in self.states.values() if st.ejected), default=math.inf)

    async def wait_for_change(self) -> None:
        """Wait until an engine is ejected (the probe loop's wakeup)."""
        await self._wakeup.wait()
        self._wakeup = trio.Event()

    def poke(self) -> None:
        """Wake the probe loop (a probe finished)."""
        self._wakeup.set()

    def readmit(self, engine: str) -> None:
        st = self.states[engine]
        st.ejected = False
        st.streak = 0
        st.quarantined_until = -math.inf
        st.next_probe_at = math.inf
        st.origin_producer = None
        self._emit(engine, "readmitted")

    def probe_failed(self, engine: str, detail: str) -> None:
        st = self.states[engine]
        st.probes += 1
        st.last_error = detail
        st.next_probe_at = self._clock() + self.probe_interval_s
        self._emit(engine, "probe_failed", detail)

    def probe_inconclusive(self, engine: str, detail: str) -> None:
        """The probe could not decide (e.g. the origin producer failed): normal cadence."""
        st = self.states[engine]
        st.probes += 1
        st.next_probe_at = self._clock() + self.probe_interval_s
        self._emit(engine, "probe_inconclusive", detail)
