"""Whether the router's predicted prefix-cache hits materialize, per engine.

The prefix index predicts each producer's hit for every placement (the journal's
``predicted_cached_tokens``). What the engine then did is reported two ways: per
request, ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``; the journal's ``cached_tokens``), and in total, the
``vllm:prefix_cache_hits`` and ``vllm:prefix_cache_queries`` counters of its
``/metrics`` (read with the cache configuration, :mod:`narwhal.router.prefixwatch`).

:class:`CacheCalibration` keeps, per producer, the hit tokens reported over those
predicted, over the latest :data:`WINDOW` placements with a predicted hit; for an
engine that reports no per-request count, over the counters' growth between two
reads against the hits this router predicted there meanwhile, while this router's
placements are the engine's traffic (its queried tokens within :data:`OWN_SHARE` of
what this router sent). That ratio, the share of the predicted hits that
materialized, prices the engine's hits from then on (a predicted hit of k tokens is
priced as ``k`` times it: :meth:`CacheCalibration.factor`). When it falls under
:data:`LOW` (with :data:`MIN_SAMPLES` placements or more) the engine's view is
``overpredicting``: a warning names the engine, a ``prefix`` live event says so, and
``/fleet`` and ``narwhal_prefix_hit_materialized_ratio`` show it, until it is back over
:data:`OK`. This module does no I/O.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["LOW", "MIN_SAMPLES", "OK", "CacheCalibration"]

log = logging.getLogger("narwhal.router.prefix")

#: Placements with a predicted hit the ratio is taken over.
WINDOW: Final = 200
#: Placements with a predicted hit before the ratio says anything.
MIN_SAMPLES: Final = 20
#: Under this share of the predicted hits materializing, the view is overpredicting ...
LOW: Final = 0.8
#: ... until it is back over this one.
OK: Final = 0.9
#: The counters are compared only while the engine's queried tokens are within this
#: share of what this router sent there (other traffic would be counted as ours).
OWN_SHARE: Final = 0.15


class CacheCalibration:
    """Per engine, the predicted hits that materialized (see the module docstring)."""

    def __init__(self, *, publish: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.publish = publish
        self._samples: dict[str, collections.deque[tuple[int, int]]] = {}
        self._sums: dict[str, list[int]] = {}
        #: Per engine: the ratio the counters gave, and the predicted hit and sent tokens
        #: since the counters' last read.
        self._counted: dict[str, float] = {}
        self._since: dict[str, list[int]] = {}
        self._counters: dict[str, tuple[float, float]] = {}
        #: Engines whose view is taken for overpredicting.
        self.overpredicting: set[str] = set()
        #: Per engine: the ratio pricing uses (absent: 1).
        self.factors: dict[str, float] = {}

    def factor(self, engine: str) -> float:
        """The share of ``engine``'s predicted hits that materialize (1 until known)."""
        return self.factors.get(engine, 1.0)

    def ratio(self, engine: str) -> float | None:
        """Reported over predicted hit tokens, per request where reported, else from the
        counters; None until :data:`MIN_SAMPLES` placements with a predicted hit."""
        sums = self._sums.get(engine)
        if sums is not None and len(self._samples[engine]) >= MIN_SAMPLES and sums[0] > 0:
            return min(sums[1] / sums[0], 1.0)
        return self._counted.get(engine)

    def on_record(self, record: Mapping[str, Any]) -> None:
        """Journal listener: each attempt's predicted and reported producer hit."""
        for attempt in record.get("attempts") or ():
            producer, predicted = attempt.get("producer"), attempt.get("predicted_cached_tokens")
            if not isinstance(producer, str) or not isinstance(predicted, int):
                continue
            since = self._since.setdefault(producer, [0, 0])
            since[0] += predicted
            since[1] += record.get("prompt_tokens") or 0
            reported = attempt.get("cached_tokens")
            if predicted <= 0 or not isinstance(reported, int):
                continue
            samples = self._samples.setdefault(producer, collections.deque())
            sums = self._sums.setdefault(producer, [0, 0])
            got = min(reported, predicted)  # a hit the index did not predict is not its error
            samples.append((predicted, got))
            sums[0] += predicted
            sums[1] += got
            if len(samples) > WINDOW:
                old_p, old_g = samples.popleft()
                sums[0] -= old_p
                sums[1] -= old_g
            self._update(producer)

    def observe_counters(self, engine: str, hits: float | None, queries: float | None) -> None:
        """``engine``'s ``vllm:prefix_cache_hits`` and ``_queries`` as read now."""
        if hits is None or queries is None:
            return
        last = self._counters.get(engine)
        self._counters[engine] = (hits, queries)
        since = self._since.pop(engine, [0, 0])
        if last is None or engine in self._samples:
            return  # a first read, or an engine that reports its hits per request
        d_hits, d_queries = hits - last[0], queries - last[1]
        predicted, sent = since
        if d_hits < 0 or d_queries < 0 or sent <= 0 or predicted < MIN_SAMPLES * 16:
            return  # a restarted engine, or too little to say
        if abs(d_queries - sent) > OWN_SHARE * sent:
            return  # others' traffic: their hits would count as ours
        self._counted[engine] = min(d_hits / predicted, 1.0)
        self._update(engine)

    def _update(self, engine: str) -> None:
        ratio = self.ratio(engine)
        if ratio is None:
            return
        self.factors[engine] = ratio
        was = engine in self.overpredicting
        if not was and ratio < LOW:
            self.overpredicting.add(engine)
            log.warning("engine %s: only %.0f%% of the prefix-cache hits the router predicted there materialized; "
                        "its hits are priced at that share until they do again", engine, ratio * 100)  # fmt: skip
            self._event(engine, "overpredicting", ratio)
        elif was and ratio > OK:
            self.overpredicting.discard(engine)
            log.info("engine %s: the predicted prefix-cache hits materialize again (%.0f%%)", engine, ratio * 100)
            self._event(engine, "calibrated", ratio)

    def _event(self, engine: str, event: str, ratio: float) -> None:
        if self.publish is not None:
            self.publish({"type": "prefix", "engine": engine, "event": event, "at": time.time(),
                          "detail": f"{ratio * 100:.1f}% of the predicted hits materialized",
                          "materialized": round(ratio, 4)})  # fmt: skip

    def status(self, engine: str) -> dict[str, Any]:
        """What ``/fleet`` shows of ``engine``'s calibration."""
        ratio = self.ratio(engine)
        return {
            "materialized": None if ratio is None else round(ratio, 4),
            "state": "overpredicting" if engine in self.overpredicting else ("ok" if ratio is not None else "unknown"),
        }

    def forget(self, engine: str) -> None:
        for table in (self._samples, self._sums, self._counted, self._since, self._counters, self.factors):
            table.pop(engine, None)
        self.overpredicting.discard(engine)
