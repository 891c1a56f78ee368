"""What a probe prefill spends in the engine's steps, and what it spends outside them.

A TTFT measured at the client on an idle engine is the engine's own time (waiting to
be scheduled, then prefill up to the first token) plus what is spent outside its
steps: the HTTP round trip, the API server's parsing, tokenization, hashing of the
prompt's blocks, the answer's rendering. On a producer whose queued prompts share a
step (chunked prefill), only the first is paid once for every prompt in the step; the
rest each pays for itself, beside the step. Priced as part of the step, a step's
queue is over-predicted by every other prompt's outside time, by more the shorter
its computed part is (a cache hit: 1,024 cached tokens still cross HTTP, are parsed,
tokenized and hashed).

vLLM reports its own time per request in two histograms, and the profiler reads
their sums and counts around each measured prefill (:func:`engine_seconds`):
``vllm:request_queue_time_seconds`` (WAITING: from its arrival at the engine core to
its scheduling) and ``vllm:request_prefill_time_seconds`` (PREFILL: from its
scheduling to its first token). A prefill whose reading counted another request, or
none (an engine that does not report them), has no engine time. The outside time of
the prefills that have one is fitted as ``base_s + per_token_s * L`` over their prompt
lengths (:func:`fit_outside`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, cast

import attrs
import numpy as np
import trio

from narwhal.engines.client import EngineClient
from narwhal.profile.cohort import read_metrics

__all__ = ["MIN_LENGTHS", "EngineClock", "engine_seconds", "fit_outside", "read_clock"]

QUEUE: Final = "vllm:request_queue_time_seconds"
PREFILL: Final = "vllm:request_prefill_time_seconds"
_NAMES: Final = frozenset(f"{h}_{part}" for h in (QUEUE, PREFILL) for part in ("sum", "count"))
#: An engine records a request's histograms as its answer leaves; a reading that does
#: not count it yet is taken again, this many times, this far apart.
_POLLS: Final = 5
_POLL_S: Final = 0.02
#: The outside time is fitted only over this many distinct prompt lengths or more.
MIN_LENGTHS: Final = 3


@attrs.frozen
class EngineClock:
    """The engine's histograms at one moment: requests counted in each, and the seconds
    both hold together."""

    queued: float
    prefilled: float
    seconds: float


async def read_clock(client: EngineClient) -> EngineClock | None:
    """The engine's histograms now; None when it does not report both, or ``/metrics``
    did not answer (within :data:`~narwhal.profile.cohort.METRICS_TIMEOUT_S`)."""
    metrics = await read_metrics(client, _NAMES)
    if isinstance(metrics, str):
        return None
    values = [metrics.total(f"{h}_{part}") for h in (QUEUE, PREFILL) for part in ("sum", "count")]
    if None in values:
        return None
    queue_sum, queue_count, prefill_sum, prefill_count = cast(list[float], values)  # pragma: no mutate (equivalent: cast does nothing at run time)
    return EngineClock(queue_count, prefill_count, queue_sum + prefill_sum)


async def engine_seconds(client: EngineClient, before: EngineClock) -> float | None:
    """The engine's own seconds of the one request answered since ``before``: its
    waiting and its prefill; None when the histograms counted another request too, or
    did not count it within :data:`_POLLS` readings."""
    for poll in range(_POLLS):
        if poll:
            await trio.sleep(_POLL_S)
        after = await read_clock(client)
        if after is None:
            return None
        counted = (after.queued - before.queued, after.prefilled - before.prefilled)
        if counted == (1, 1):
            return max(after.seconds - before.seconds, 0.0)
        if max(counted) > 1:
            return None
    return None


def fit_outside(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float] | None:
    """``(base_s, per_token_s)`` of the outside time ``ttft_s - engine_s`` of the
    prefills ``(length, ttft_s, engine_s)``, least squares over their lengths, both
    non-negative (with no growth in the length, the mean); None over fewer than
    :data:`MIN_LENGTHS` distinct lengths."""
    if len({n for n, _, _ in samples}) < MIN_LENGTHS:
        return None
    lengths = np.array([float(n) for n, _, _ in samples])
    outside = np.array([t - e for _, t, e in samples])
    slope, base = np.polyfit(lengths, outside, 1)
    if slope <= 0:  # pragma: no mutate (equivalent at 0: the fit's base is then the mean)
        return max(float(outside.mean()), 0.0), 0.0
    if base < 0:  # pragma: no mutate (equivalent at 0: the line already runs through the origin)
        return 0.0, max(float(lengths @ outside / (lengths @ lengths)), 0.0)
    return float(base), float(slope)
