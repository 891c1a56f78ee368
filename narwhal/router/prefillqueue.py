"""The prefills reserved on each producer, and the queue ahead of a new one.

Priced placement reserves every prefill it places on its producer, in placement order,
with its predicted seconds (:class:`Queued`); a prefill leaves when it ends, or fails,
or is given up. An engine computes its prefills in order, so the queue ahead of a
prompt placed now is read from what is reserved, by the producer's queue model
(:mod:`narwhal.router.batching`):

- serial: the reserved prefills one after the other, less what the oldest has done (it
  started when it was placed or when the prefill before it ended, whichever came last);
- batched: the reserved prefills placed before the step in progress began share that
  step, one fixed cost (the TTFT curve at no tokens) and each its part beyond it, less
  the step's time so far; those placed since wait for the next step, which this prompt
  joins: each adds its part beyond the fixed cost, which this prompt's own prefill pays.
  A prefill's part in a step is its predicted prefill less the fixed cost and less what
  it spends outside the engine's steps (HTTP, parsing, tokenization: each prompt pays
  its own beside the step, as the profile measured; :mod:`narwhal.profile.enginetime`).
  A prefill placed on an idle producer begins a step alone: the rest of a burst placed
  with it reaches the engine after that step began. The prompts expected to join the
  next step before it begins add their parts too: the producer's placement rate over
  its latest :data:`ARRIVALS` placements times the time left of the step in progress,
  each their mean part beyond the fixed cost.

Others' prefills (other routers' load on the engine) are priced by the caller, for the
serial model whole, for the batched model each its part in a step (they share steps);
the caller prices them from :meth:`PrefillQueues.mean_work_s`, the means of the
prefills this router placed there and of their parts. Every reserved prefill keeps
the durations both models predicted for it when it was placed, which the queue models
are scored on when it ends.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import attrs

from narwhal.router.batching import QueueModels
from narwhal.router.placement import MEAN_WEIGHT

__all__ = ["ARRIVALS", "PrefillQueues", "Queued"]

#: A producer's latest placements, over which the prompts expected to join its next
#: step are reckoned (their rate and their parts beyond a step's fixed cost).
ARRIVALS: Final = 16


@attrs.define
class Queued:
    """A prefill reserved on a producer."""

    #: Its predicted prefill seconds.
    work: float
    #: What it adds to a step it shares: its prefill less the step's fixed cost and its
    #: own time outside the engine's steps.
    part: float
    placed_at: float
    #: Seconds from placement to its end, as the serial and the batched queue model
    #: predicted them (:mod:`narwhal.router.batching`).
    serial_s: float
    batched_s: float
    #: When it must end for its request to meet the TTFT target (inf: no target).
    latest_done: float


class PrefillQueues:
    """Per producer, the prefills reserved there and the queue ahead of a new one.

    Args:
        names: the producers (more come with :meth:`add_engine`).
        clock: the current time.
        fixed_s: a producer's fixed cost of a prefill step (its TTFT curve at no
            tokens); asked only of producers whose prefills are priced.
        part_s: what a prefill of the given predicted seconds and prompt tokens adds to
            a step of the producer it shares with others (beyond the fixed cost).
        others_s: the predicted prefill seconds others queued on a producer, whole
            (``batched`` False) or each its part in a step (True).
    """

    def __init__(self, names: Iterable[str], *, clock: Callable[[], float],
                 fixed_s: Callable[[str], float], part_s: Callable[[str, float, int], float],
                 others_s: Callable[[str, bool], float]) -> None:  # fmt: skip
        self.clock = clock
        self._fixed = fixed_s
        self._part = part_s
        self._others = others_s
        #: Predicted prefill seconds reserved per producer.
        self.work_s: dict[str, float] = dict.fromkeys(names, 0.0)
        #: Per producer, its reserved prefills in the order they were placed; and when its
        #: last prefill ended.
        self.reserved: dict[str, dict[int, Queued]] = {n: {} for n in self.work_s}
        self._last_done: dict[str, float] = {}
        #: Which queue model prices each producer.
        self.models = QueueModels()
        #: Per producer, its latest placements: (when, part beyond a step's fixed cost).
        self._arrivals: dict[str, collections.deque[tuple[float, float]]] = {}
        #: Per producer, the moving means of the predicted prefill seconds placed there
        #: and of their parts in a step.
        self._mean_work: dict[str, float] = {}
        self._mean_part: dict[str, float] = {}
        self._keys = itertools.count()

    # ----------------------------------------------------------------- the queue

    def queue_s(self, name: str) -> float:
        """Predicted seconds before a prompt placed on ``name`` now is computed, beyond
        its own prefill, by the producer's queue model."""
        return self._batched_s(name) if name in self.models.batched else self._serial_s(name)

    def queues_s(self, name: str) -> tuple[float, float]:
        """The queue ahead of a prompt placed on ``name`` now, by the serial and the
        batched model (the module docstring)."""
        return self._serial_s(name), self._batched_s(name)

    def head_done_s(self, name: str) -> float:
        """Predicted seconds already done of the oldest prefill reserved on ``name``: it
        started when it was placed or when the prefill before it ended, whichever came
        last (an engine runs its prefills in order), and is never counted done."""
        queued = self.reserved.get(name)
        if not queued:
            return 0.0
        head = next(iter(queued.values()))
        return min(max(self.clock() - self._step_start(name, queued), 0.0), head.work)

    def delays(self, name: str, own_s: float, correction: float) -> int:
        """How many of the prefills waiting on ``name`` for its next step would end past
        their TTFT target if that step took a prompt of ``own_s`` seconds of prefill
        (they end with it; the prompts expected to join later are checked when they
        come); ``correction``: the producer's correction of its predictions."""
        queued = self.reserved.get(name)
        if not queued:
            return 0
        remaining, waiting, next_step = self._steps_s(name, queued)
        done = self.clock() + (remaining + waiting + self._others(name, True) + own_s) * correction
        return sum(1 for q in next_step if done > q.latest_done)

    def _step_start(self, name: str, queued: Mapping[int, Queued]) -> float:
        """When the oldest prefill reserved on ``name`` started: when it was placed or
        when the prefill before it ended, whichever came last."""
        placed_at = next(iter(queued.values())).placed_at
        return max(placed_at, self._last_done.get(name, placed_at))

    def _next_step(self, name: str) -> list[Queued]:
        """The prefills reserved on ``name`` that wait for its next step: placed since the
        step in progress began (the oldest prefill always in it, as in :meth:`head_done_s`;
        a prefill placed on an idle producer begins a step alone)."""
        queued = self.reserved.get(name)
        if not queued:
            return []
        started = self._step_start(name, queued)
        return [q for i, q in enumerate(queued.values()) if i and q.placed_at >= started]

    def _serial_s(self, name: str) -> float:
        return self.work_s[name] - self.head_done_s(name) + self._others(name, False)

    def _batched_s(self, name: str) -> float:
        queued = self.reserved.get(name)
        if not queued:
            return self._serial_s(name)
        remaining, waiting, _ = self._steps_s(name, queued)
        return remaining + waiting + remaining * self._join_rate_s(name) + self._others(name, True)

    def _join_rate_s(self, name: str) -> float:
        """Seconds of prefill (parts beyond the fixed cost) placed on ``name`` a second,
        over its latest :data:`ARRIVALS` placements."""
        recent = self._arrivals.get(name)
        if not recent:
            return 0.0
        span = self.clock() - recent[0][0]
        return sum(share for _, share in recent) / span if span > 0 else 0.0

    def _steps_s(self, name: str, queued: Mapping[int, Queued]) -> tuple[float, float, list[Queued]]:
        """The seconds left of ``name``'s step in progress, the parts in a step of the
        prefills waiting for its next step, and those prefills."""
        next_step = self._next_step(name)
        waiting = sum(q.part for q in next_step)
        in_step = self._fixed(name) + sum(q.part for q in queued.values()) - waiting
        return max(in_step - (self.clock() - self._step_start(name, queued)), 0.0), waiting, next_step

    # ----------------------------------------------------------------- reservations

    def add(self, producer: str, work: float, latest_done: float, *, priced: bool, prompt_tokens: int) -> int:
        """Reserve ``work`` predicted prefill seconds of a ``prompt_tokens``-token prompt
        on ``producer``, behind its queue; ``latest_done``: when it must end to meet the
        TTFT target (inf: no target). An unpriced producer's prefill (no profile bound)
        is reserved without the queue models' predictions. Returns the reservation's key
        for :meth:`release`."""
        key = next(self._keys)
        serial, batched, part = (0.0, 0.0, 0.0)
        if priced:
            serial, batched = self.queues_s(producer)
            part = self._part(producer, work, prompt_tokens)
            self._arrived(producer, work, part)
        self.work_s[producer] += work
        self.reserved.setdefault(producer, {})[key] = Queued(work, part, self.clock(), serial + work,
                                                             batched + work, latest_done)  # fmt: skip
        return key

    def _arrived(self, producer: str, work: float, part: float) -> None:
        """A prefill of ``work`` seconds, ``part`` of them in a step it shares, was
        placed on ``producer`` now (its part counts in the rate of prompts expected to
        join a step; both join the means of the prefills placed there)."""
        recent = self._arrivals.setdefault(producer, collections.deque(maxlen=ARRIVALS))
        recent.append((self.clock(), part))
        for means, value in ((self._mean_work, work), (self._mean_part, part)):
            mean = means.get(producer)
            means[producer] = value if mean is None else mean + MEAN_WEIGHT * (value - mean)

    def mean_work_s(self, name: str, *, part: bool = False) -> float | None:
        """The moving mean of the predicted prefill seconds (hits priced as hits) of the
        priced prefills placed on ``name``, or (``part``) of their parts in a step; None
        before the first."""
        return (self._mean_part if part else self._mean_work).get(name)

    def release(self, producer: str, key: int, *, done: bool) -> None:
        """The prefill reserved on ``producer`` under ``key`` ends: ``done``, it completed
        now (what the queue models are scored on), else it failed or was given up. A key
        released before, or one whose producer left the fleet since (and came back),
        releases nothing."""
        queued = self.reserved.get(producer)
        entry = queued.pop(key, None) if queued is not None else None
        if entry is None:
            return
        self.work_s[producer] = max(0.0, self.work_s[producer] - entry.work)
        now = self._last_done[producer] = self.clock()
        if done:
            self.models.observe(producer, now - entry.placed_at, entry.serial_s, entry.batched_s)

    # ----------------------------------------------------------------- the fleet

    def add_engine(self, name: str) -> None:
        self.work_s.setdefault(name, 0.0)

    def remove_engine(self, name: str) -> None:
        for table in (self.work_s, self.reserved, self._last_done, self._arrivals, self._mean_work,
                      self._mean_part):  # fmt: skip
            table.pop(name, None)
        self.models.forget(name)
