"""A seeded discrete-event simulation of one prefill/decode split under a workload.

Prefill: every producer is a FCFS queue serving one prefill at a time for ``ttft(L)``
seconds (its profile's TTFT curve); an arriving request joins the producer that would
finish it first. Its TTFT is the time from arrival to the end of its prefill (the
router's TTFT). Decode: every consumer runs continuous batching as the profiled engine
does: one step of ``c0 + c1*active + c2*resident_kv`` seconds emits one token to each
sequence in the batch; a request whose prefill ended joins at the next step, on the
consumer whose next step it would slow least; resident KV is prompt plus tokens
generated. Its TPOT is (last token - first token) / (output - 1). KV transfer time is
not modelled (it adds to neither TTFT nor TPOT).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import attrs
import numpy as np

from narwhal.profile.store import EngineProfile

__all__ = ["SimulatedRun", "simulate_split", "ttft_of"]


@attrs.frozen
class SimulatedRun:
    """What the simulation measured (requests after the warm-up only).

    Attributes:
        ttft_s: Each request's TTFT.
        tpot_s: Each request's TPOT (requests with at least two output tokens).
        peak_kv: Peak resident KV tokens per consumer.
        peak_active: Peak batch size per consumer.
        requests: Requests simulated, warm-up included.
        warmup: Leading requests left out of the distributions.
    """

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    peak_kv: dict[str, int]
    peak_active: dict[str, int]
    requests: int
    warmup: int


@attrs.define
class _Consumer:
    profile: EngineProfile
    batch: list[int] = attrs.Factory(list)  # sequences in the running step
    pending: list[int] = attrs.Factory(list)  # joined during the step
    kv: int = 0  # resident KV of batch + pending
    busy: bool = False
    peak_kv: int = 0
    peak_active: int = 0

    @property
    def active(self) -> int:
        return len(self.batch) + len(self.pending)

    def step_s(self) -> float:
        d = self.profile.decode_model
        return d.c0 + d.c1 * len(self.batch) + d.c2 * self.kv

    def cost_of_joining(self, prompt: int) -> float:
        d = self.profile.decode_model
        return d.c0 + d.c1 * (self.active + 1) + d.c2 * (self.kv + prompt)


def ttft_of(profile: EngineProfile, lengths: np.ndarray) -> np.ndarray:
    """The TTFT curve of ``profile`` at every prompt length of ``lengths`` (seconds)."""
    t = profile.ttft
    x = np.asarray(lengths)  # the float coefficients make every term a float
    out: np.ndarray = t.a + t.b * x + t.c * x * x
    return out


def _prefill(
    producers: Sequence[EngineProfile], arrivals: np.ndarray, inputs: np.ndarray
) -> np.ndarray:
    """When each request's prefill ends (earliest-finish dispatch, FCFS per producer)."""
    service = np.stack([ttft_of(p, inputs) for p in producers], axis=1).tolist()
    free = [0.0] * len(producers)
    done = np.empty(len(arrivals))
    for k, t in enumerate(arrivals.tolist()):
        ends = [max(free[i], t) + service[k][i] for i in range(len(producers))]
        best = min(range(len(producers)), key=ends.__getitem__)
        free[best] = done[k] = ends[best]
    return done


def simulate_split(
    producers: Sequence[EngineProfile],
    consumers: Sequence[EngineProfile],
    arrivals: Sequence[float],
    inputs: Sequence[int],
    outputs: Sequence[int],
    *,
    warmup_fraction: float = 0.1,
) -> SimulatedRun:
    """Simulate the requests (arrival offsets, prompt and output lengths) on one split."""
    t_arr = np.asarray(arrivals, dtype=float)  # pragma: no mutate (equivalent: integer offsets give the same times)
    ins = [int(x) for x in inputs]
    outs = [int(x) for x in outputs]
    n = len(t_arr)
    done = _prefill(producers, t_arr, np.asarray(ins))  # ttft_of takes them as floats
    first = [math.nan] * n
    last = [math.nan] * n
    generated = [0] * n
    pool = [_Consumer(p) for p in consumers]
    steps: list[tuple[float, int]] = []  # (end of the running step, consumer)

    def start_step(j: int, now: float) -> None:
        c = pool[j]
        c.batch.extend(c.pending)
        c.pending.clear()
        c.busy = bool(c.batch)
        if c.busy:
            c.peak_kv, c.peak_active = max(c.peak_kv, c.kv), max(c.peak_active, len(c.batch))
            heapq.heappush(steps, (now + c.step_s(), j))

    done_at = done.tolist()
    order = sorted(range(n), key=done_at.__getitem__)  # stable: ties in arrival order
    next_arrival = 0
    while next_arrival < n or steps:
        arrival_at = done_at[order[next_arrival]] if next_arrival < n else math.inf
        if steps and steps[0][0] <= arrival_at:
            now, j = heapq.heappop(steps)
            c = pool[j]
            still: list[int] = []
            for k in c.batch:
                g = generated[k] = generated[k] + 1
                if g == 1:
                    first[k] = now
                last[k] = now
                if g >= outs[k]:
                    c.kv -= ins[k] + g - 1
                else:
                    c.kv += 1
                    still.append(k)
            c.batch = still
            start_step(j, now)
            continue
        k = order[next_arrival]
        next_arrival += 1
        j = min(range(len(pool)), key=lambda i: pool[i].cost_of_joining(ins[k]))
        c = pool[j]
        c.pending.append(k)
        c.kv += ins[k]
        if not c.busy:
            start_step(j, arrival_at)
    warmup = min(int(n * warmup_fraction), max(n - 1, 0))
    ttft = (done - t_arr)[warmup:]
    tpot = np.array(
        [(last[k] - first[k]) / (outs[k] - 1) for k in range(warmup, n) if outs[k] >= 2]
    )
    return SimulatedRun(
        ttft_s=ttft,
        tpot_s=tpot,
        requests=n,
        warmup=warmup,
        peak_kv={c.profile.name: c.peak_kv for c in pool},
        peak_active={c.profile.name: c.peak_active for c in pool},
    )
