"""Whether a producer computes its queued prompts one at a time or together.

An engine without chunked prefill computes one whole prompt a step: a prompt placed
behind others waits for each of them, fixed cost included. vLLM's V1 scheduler (chunked
prefill) computes every waiting prompt in the next step, up to its token budget, for one
fixed cost: a prompt placed behind others waits for the step in progress, then shares
the next one with those that arrived while it ran. Priced the first way, a batching
engine's queue is over-predicted by a fixed cost for every prompt ahead, and admission
refuses requests that would have met the target; priced the second way, a serial
engine's queue is under-predicted, and admission lets through requests that will be late.

A prompt alone looks alike on both, so the profile measures which of the two an engine
does with bursts of prompts sent at once (:mod:`narwhal.profile.burst`), and a producer
is priced as its bound profile says from its first request (:meth:`QueueModels.prior`).
The router also learns it from its own requests, which decides for a profile without
the probe and corrects a profile the engine no longer matches: each reserved prefill
carries the duration both queue models predicted for it when it was placed, and when
its prefill ends the :class:`QueueModels` of its producer scores the two against the
duration observed. Only placements where the two predictions differ (by :data:`DIFFER`
or more of the larger) tell them apart; once a producer has :data:`MIN_EVIDENCE` of
those among its latest :data:`WINDOW`, it is priced by the model whose relative errors
sum lower there. Until then it is priced as its profile says, and serially where the
profile does not say, the conservative reading (it never under-predicts a serial
engine's queue).
"""

from __future__ import annotations

import collections
import logging
from typing import Final

__all__ = ["DIFFER", "MIN_EVIDENCE", "WINDOW", "QueueModels"]

log = logging.getLogger("narwhal.router.placement")

#: Two predictions tell the models apart when they differ by this share of the larger.
DIFFER: Final = 0.1
#: Placements that told them apart, kept per producer (the latest).
WINDOW: Final = 100
#: ... and how many of them a producer needs before its model is chosen from them.
MIN_EVIDENCE: Final = 10


class QueueModels:
    """Per producer, which queue model predicts its prefills (see the module docstring)."""

    def __init__(self) -> None:
        #: Producers priced as batching their queued prompts.
        self.batched: set[str] = set()
        #: Per producer: relative error of the batched prediction less the serial one's,
        #: for its latest placements that told the models apart.
        self._evidence: dict[str, collections.deque[float]] = {}

    def observe(self, producer: str, observed_s: float, serial_s: float, batched_s: float) -> None:
        """A prefill placed on ``producer`` ended ``observed_s`` after it was placed; the
        models had predicted ``serial_s`` and ``batched_s``."""
        if observed_s <= 0 or abs(serial_s - batched_s) < DIFFER * max(serial_s, batched_s):
            return
        evidence = self._evidence.setdefault(producer, collections.deque(maxlen=WINDOW))
        evidence.append((abs(observed_s - batched_s) - abs(observed_s - serial_s)) / observed_s)
        if len(evidence) < MIN_EVIDENCE:
            return
        batched = sum(evidence) < 0
        if batched != (producer in self.batched):
            if batched:
                self.batched.add(producer)
                log.info("producer %s computes its queued prompts together (chunked prefill): "
                         "its queue is priced as one step", producer)  # fmt: skip
            else:
                self.batched.discard(producer)
                log.info("producer %s computes its queued prompts one at a time: its queue is "
                         "priced prompt by prompt", producer)  # fmt: skip

    def prior(self, producer: str, queue: str | None) -> None:
        """A profile newly bound to ``producer`` says how it queues (``batched``,
        ``serial``, or None where its profile does not say): priced so until its own
        requests say otherwise. What the requests said of the engine before is dropped
        (a new profile is a new engine generation, or a new measurement of it)."""
        self._evidence.pop(producer, None)
        if queue == "batched":
            self.batched.add(producer)
        else:
            self.batched.discard(producer)

    def forget(self, producer: str) -> None:
        """``producer`` left the fleet (or restarted as something else)."""
        self.batched.discard(producer)
        self._evidence.pop(producer, None)
