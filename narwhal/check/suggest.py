"""``narwhal check --suggest-slo``: the TTFT and TPOT targets a fleet can hold for a workload.

The workload is a small JSON file: ``rate`` (requests/s), ``input_len`` and
``output_len`` as ``narwhal bench`` length specs (``uniform:100:500``, ``fixed:128``,
``normal:M:S``, ``lognormal:M:S``), and optionally ``arrival`` (``poisson``, ``gamma``,
``constant``), ``burstiness``, ``requests`` (simulated, default 4000) and ``seed``.

The model, from the profiles alone (no engine is contacted):

*Prefill* -- each producer is a single-server FCFS queue whose service time is its TTFT
curve at the request's prompt length, S = ttft(L). Load is spread so that every
producer has the same utilisation rho = lambda / sum_i(1 / E[S_i]): the prefill
pressure. The Pollaczek-Khinchine formula gives each producer's mean wait,
W_i = lambda_i E[S_i^2] / (2 (1 - rho)): the mean TTFT of independent queues under
Poisson arrivals (``ttft_pk_mean_s`` in ``--json``), an analytic cross-check of the
simulation, which dispatches better than at random and so waits less.

*Decode* -- each consumer's load follows Little's law as a fixed point with its decode
model. With lambda_j requests/s of mean output E[o], each holding on average
m = E[in] + E[o^2] / (2 E[o]) resident KV tokens (its prompt plus half its output,
weighted by how long it stays), the step time T solves
T = c0 + c1*a + c2*a*m with a = lambda_j E[o] T active requests, so
T = c0 / (1 - u) with u = lambda_j E[o] (c1 + c2 m). The consumer's pressure is the
larger of u (T grows without bound as u -> 1) and its resident KV a*m over its KV
capacity; past 1 there is no fixed point and the pressure is u, by how much the load
overruns. Load is spread so that every consumer has the same pressure: the decode
pressure. T is the time-average step; a request's own TPOT is about one request's
share (c1 + c2*m) more, which the simulation below accounts for. Moments are taken
over a seeded sample of the length distributions.

*Split* -- engines with both roles may take either; every assignment with at least
one producer and one consumer is priced (fleets with more than 12 such engines try
the assignments that order them by their prefill-to-decode speed) and the one with
the smallest worse pressure max(rho, decode pressure) is chosen. A pressure at or
above 1 means that tier's queue grows without bound: the workload cannot be held.

*Targets* -- for the chosen split, a seeded discrete-event simulation of the workload's
arrivals (:mod:`narwhal.check.simulate`: FCFS producers with earliest-finish dispatch,
consumers batching step by step with the decode model) gives the mean, p50 and p90 of
TTFT and TPOT, the first tenth of the requests left out as warm-up: the targets the
fleet can hold at that rate, on an idle-fleet profile. KV transfer time, the
router's own time and decode admission waits are not modelled.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import numpy as np

from narwhal.bench.workload import ARRIVALS, Arrival, LengthDist, arrival_offsets
from narwhal.check.simulate import simulate_split, ttft_of
from narwhal.config import EngineConfig, FleetConfig
from narwhal.errors import ConfigError
from narwhal.profile.store import EngineProfile, Profiles, read_json

__all__ = [
    "Pressures",
    "SLOSuggestion",
    "SuggestWorkload",
    "decode_tier",
    "load_workload",
    "prefill_tier",
    "suggest_slo",
]

_KEYS: Final = {"rate", "input_len", "output_len", "arrival", "burstiness", "requests", "seed"}
_MOMENT_SAMPLES: Final = 20000
_EXHAUSTIVE: Final = 12
# A consumer's rate is infinite at every positive pressure or at none (only a step that
# costs nothing, c0 = 0 and c1 + c2*m = 0, makes it so): any positive pressure asks whether.
_ANY_PRESSURE: Final = 1.0
# The decode tier's pressure bracket: widened by this factor until it holds the load, then
# halved; past about 60 halvings it holds two neighbouring floats, the least pressure that
# carries the load and the one below it, whatever the factor and the halvings.
_WIDEN: Final = 2.0
_HALVINGS: Final = 100


@attrs.frozen(kw_only=True)
class SuggestWorkload:
    """The workload to hold (the ``--workload`` file)."""

    rate: float
    input_len: LengthDist
    output_len: LengthDist
    arrival: Arrival = "poisson"
    burstiness: float = 1.0
    requests: int = 4000
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "input_len": self.input_len.spec,
            "output_len": self.output_len.spec,
            "arrival": self.arrival,
            "burstiness": self.burstiness,
            "requests": self.requests,
            "seed": self.seed,
        }


def load_workload(path: str | os.PathLike[str]) -> SuggestWorkload:
    """Read a workload file.

    Raises:
        ConfigError: Unreadable, not an object, an unknown key or an invalid value
            (the message names its JSON path).
    """
    source = os.fspath(path)
    obj = read_json(source, "workload file")
    if not isinstance(obj, dict):
        raise ConfigError("expected an object", source=source)
    for key in sorted(set(obj) - _KEYS):
        raise ConfigError(f"unknown key {key!r}", path=f"$.{key}", source=source)

    def number(key: str, default: float | None, ok: Any, what: str) -> float:
        value = obj.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
            raise ConfigError(f"expected {what}", path=f"$.{key}", source=source)
        return float(value)

    def length(key: str) -> LengthDist:
        spec = obj.get(key)
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = str(spec)
        if not isinstance(spec, str):
            raise ConfigError(
                "expected a length spec such as 'uniform:100:500'", path=f"$.{key}", source=source
            )
        try:
            return LengthDist.parse(spec)
        except ValueError as exc:
            raise ConfigError(str(exc), path=f"$.{key}", source=source) from None

    arrival = next((a for a in ARRIVALS if a == obj.get("arrival", "poisson")), None)
    if arrival is None:
        raise ConfigError(f"expected one of {', '.join(ARRIVALS)}", path="$.arrival", source=source)
    finite = math.isfinite
    return SuggestWorkload(
        rate=number("rate", None, lambda v: finite(v) and v > 0, "a finite number > 0"),
        input_len=length("input_len"),
        output_len=length("output_len"),
        arrival=arrival,
        burstiness=number("burstiness", 1.0, lambda v: finite(v) and v > 0, "a number > 0"),
        requests=int(
            number(
                "requests",
                4000,
                lambda v: v == int(v) and 100 <= v <= 10**6,
                "an integer between 100 and 1000000",
            )
        ),
        seed=int(number("seed", 0, lambda v: v == int(v), "an integer")),
    )


@attrs.frozen
class _Moments:
    inputs: np.ndarray
    outputs: np.ndarray

    @property
    def mean_out(self) -> float:
        return float(self.outputs.mean())

    @property
    def resident(self) -> float:
        """Time-weighted resident KV of one request: E[(in + o/2) o] / E[o]."""
        o = self.outputs.astype(float)
        return float(((self.inputs + o / 2) * o).mean() / o.mean())


def _moments(workload: SuggestWorkload) -> _Moments:
    rng_in = random.Random(f"narwhal-suggest/{workload.seed}/input_len")
    rng_out = random.Random(f"narwhal-suggest/{workload.seed}/output_len")
    n = 1 if workload.input_len.kind == workload.output_len.kind == "fixed" else _MOMENT_SAMPLES
    ins = np.array([workload.input_len.sample(rng_in) for _ in range(n)])
    outs = np.array([workload.output_len.sample(rng_out) for _ in range(n)])
    return _Moments(ins, outs)


@attrs.frozen(kw_only=True)
class Pressures:
    """One split priced by the analytic model.

    Attributes:
        producers / consumers: the split.
        prefill: utilisation rho of the prefill tier.
        decode: pressure of the decode tier (utilisation or KV fill, whichever is larger).
        prefill_rates / decode_rates: requests/s each engine takes.
        ttft_pk_mean_s: Pollaczek-Khinchine mean TTFT of independent per-producer queues
            (an analytic bound on the simulated mean; None when rho >= 1).
        step_s: each consumer's time-average step time at its load (None when it cannot
            hold it); a request's own TPOT is about one request's share (c1 + c2*m) more.
        active / kv_tokens: each consumer's mean active requests and resident KV.
    """

    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    prefill: float
    decode: float
    prefill_rates: dict[str, float]
    decode_rates: dict[str, float]
    ttft_pk_mean_s: float | None
    step_s: dict[str, float | None]
    active: dict[str, float]
    kv_tokens: dict[str, float]

    @property
    def worse(self) -> float:
        return max(self.prefill, self.decode)

    @property
    def holds(self) -> bool:
        return self.worse < 1.0


def prefill_tier(
    producers: Sequence[EngineProfile], rate: float, inputs: np.ndarray
) -> tuple[float, dict[str, float], float | None]:
    """``(rho, rates, mean TTFT)`` of a prefill tier (equal utilisation, P-K waits)."""
    service = {p.name: ttft_of(p, inputs) for p in producers}
    capacity = sum(1.0 / float(s.mean()) for s in service.values())
    rho = rate / capacity
    rates = {name: rho / float(s.mean()) for name, s in service.items()}
    if rho >= 1:
        return rho, rates, None
    mean = sum(
        rates[name] / rate * (rates[name] * float((s * s).mean()) / (2 * (1 - rho)) + float(s.mean()))
        for name, s in service.items()
    )
    return rho, rates, mean


def _decode_rate(p: EngineProfile, pressure: float, mean_out: float, resident: float) -> float:
    """The request rate at which consumer ``p`` reaches ``pressure``.

    Below 1 the pressure is the larger of the utilisation ``u`` and the KV fill; from 1
    on no steady state exists and it is ``u`` alone: by how much the load overruns.
    """
    d = p.decode_model
    k = d.c1 + d.c2 * resident
    by_step = pressure / (mean_out * k) if k > 0 else math.inf
    if pressure >= 1 and k > 0:
        return by_step
    allowed = pressure * p.kv_limit.tokens / resident  # active requests the KV allows
    denominator = mean_out * (d.c0 + allowed * k)
    by_kv = allowed / denominator if denominator > 0 else math.inf
    return min(by_step, by_kv)


def decode_tier(
    consumers: Sequence[EngineProfile], rate: float, mean_out: float, resident: float
) -> tuple[float, dict[str, float]]:
    """``(pressure, rates)`` of a decode tier: the equal pressure that carries ``rate``."""
    free = {p.name for p in consumers if math.isinf(_decode_rate(p, _ANY_PRESSURE, mean_out, resident))}
    if free:  # steps that cost nothing carry any load at no pressure: they take it all
        return 0.0, {p.name: rate / len(free) if p.name in free else 0.0 for p in consumers}

    def carried(pressure: float) -> float:  # every consumer's rate is finite from here on
        return sum(_decode_rate(p, pressure, mean_out, resident) for p in consumers)

    # Bracket the pressure, then halve the bracket. Where it starts, and whether a load
    # carried exactly at its top widens it once more, change only the bisection's path:
    # it ends at the same pressure.
    low, high = 0.0, 1.0  # pragma: no mutate (equivalent: see above)
    while carried(high) < rate:  # pragma: no mutate (equivalent: see above)
        high *= _WIDEN
        if high > 1e9:  # pragma: no mutate (equivalent: a power of two, never 1e9 nor 1e9 + 1)
            return math.inf, {p.name: rate / len(consumers) for p in consumers}
    for _ in range(_HALVINGS):
        mid = (low + high) / 2
        low, high = (mid, high) if carried(mid) < rate else (low, mid)
    rates = {p.name: _decode_rate(p, high, mean_out, resident) for p in consumers}
    total = sum(rates.values())
    return high, {n: r * rate / total for n, r in rates.items()}


def _price(
    producers: Sequence[EngineProfile],
    consumers: Sequence[EngineProfile],
    rate: float,
    m: _Moments,
) -> Pressures:
    rho, p_rates, ttft = prefill_tier(producers, rate, m.inputs)
    mean_out, resident = m.mean_out, m.resident
    pressure, d_rates = decode_tier(consumers, rate, mean_out, resident)
    steps: dict[str, float | None] = {}
    active: dict[str, float] = {}
    kv: dict[str, float] = {}
    for p in consumers:
        d, lam = p.decode_model, d_rates[p.name]
        u = lam * mean_out * (d.c1 + d.c2 * resident)
        step = d.c0 / (1 - u) if u < 1 else None
        steps[p.name] = step
        active[p.name] = lam * mean_out * step if step is not None else math.inf
        kv[p.name] = active[p.name] * resident
    return Pressures(
        producers=tuple(p.name for p in producers),
        consumers=tuple(p.name for p in consumers),
        prefill=rho,
        decode=pressure,
        prefill_rates=p_rates,
        decode_rates=d_rates,
        ttft_pk_mean_s=ttft,
        step_s=steps,
        active=active,
        kv_tokens=kv,
    )


def _splits(
    engines: Sequence[EngineConfig], speed: Callable[[str], float]
) -> list[tuple[list[str], list[str]]]:
    """Every assignment of the flexible engines; past a dozen, the cuts of their speed order."""
    fixed_p = [e.name for e in engines if e.can_prefill and not e.can_decode]
    fixed_d = [e.name for e in engines if e.can_decode and not e.can_prefill]
    both = [e.name for e in engines if e.can_prefill and e.can_decode]
    out = []
    if len(both) <= _EXHAUSTIVE:
        for choice in itertools.product((True, False), repeat=len(both)):
            p = fixed_p + list(itertools.compress(both, choice))
            d = fixed_d + list(itertools.compress(both, (not c for c in choice)))
            if p and d:
                out.append((p, d))
        return out
    both.sort(key=lambda name: -speed(name))  # relatively fastest at prefill first
    for cut in range(len(both) + 1):
        p, d = fixed_p + both[:cut], fixed_d + both[cut:]
        if p and d:
            out.append((p, d))
    return out


@attrs.frozen(kw_only=True)
class SLOSuggestion:
    """The suggestion: the split, its pressures, the targets, or why none holds."""

    workload: SuggestWorkload
    best: Pressures | None
    holds: bool
    reason: str | None = None
    ttft_s: dict[str, float] = attrs.field(factory=dict)
    tpot_s: dict[str, float] = attrs.field(factory=dict)
    warnings: tuple[str, ...] = ()
    candidates: int = 0
    simulated: int = 0

    def to_json(self) -> dict[str, Any]:
        best = None
        if self.best is not None:
            best = {
                k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in attrs.asdict(self.best).items()
            }
            best["active"] = {
                n: (v if math.isfinite(v) else "inf") for n, v in self.best.active.items()
            }
            best["kv_tokens"] = {
                n: (v if math.isfinite(v) else "inf") for n, v in self.best.kv_tokens.items()
            }
        return {
            "kind": "narwhal.slo-suggestion",
            "holds": self.holds,
            "reason": self.reason,
            "workload": self.workload.to_json(),
            "split": best,
            "targets": {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s},
            "warnings": list(self.warnings),
            "splits_priced": self.candidates,
            "requests_simulated": self.simulated,
        }


def _warnings(best: Pressures, profiles: Mapping[str, EngineProfile], m: _Moments) -> list[str]:
    out = []
    longest = float(m.inputs.max())
    for name in best.producers:
        if longest > profiles[name].ttft.max_length:
            out.append(
                f"{name}: prompts up to {longest:.0f} tokens extrapolate its TTFT curve "
                f"(measured up to {profiles[name].ttft.max_length})"
            )
    for name in best.consumers:
        dom = profiles[name].decode_model.domain
        if best.active[name] > dom.active.max or best.kv_tokens[name] > dom.kv_tokens.max:
            out.append(
                f"{name}: {best.active[name]:.1f} active requests holding "
                f"{best.kv_tokens[name]:.0f} KV tokens lie outside its measured decode "
                f"domain (active <= {dom.active.max:g}, KV <= {dom.kv_tokens.max:g}); "
                "extend the decode sweep"
            )
    return out


def _summary(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(np.mean(values)),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
    }


def suggest_slo(
    config: FleetConfig, profiles: Profiles, workload: SuggestWorkload
) -> SLOSuggestion:
    """Price every split, pick the one with the smallest worse pressure, simulate it.

    Raises:
        ConfigError: A configured engine has no accepted profile, or the engines declare
            several models (the workload is one model's).
    """
    if len(config.models) > 1:
        raise ConfigError(
            f"the engines serve several models ({', '.join(config.models)}) and the workload is one "
            "model's: run it against a fleet document of that model's engines",
            path="$.engines",
        )
    missing = [e.name for e in config.engines if e.name not in profiles.engines]
    if missing:
        raise ConfigError(
            f"no accepted profile for engine(s) {', '.join(missing)}; "
            "profile them first (narwhal profile)",
            path="$.engines",
        )
    m = _moments(workload)
    by_name = profiles.engines

    def speed(name: str) -> float:
        p = by_name[name]
        if p.decode is None:  # prefill-only: the fastest decoder is never this one
            return math.inf
        return p.decode.predict(1, m.resident) / max(p.ttft.predict(float(m.inputs.mean())), 1e-12)

    splits = _splits(config.engines, speed)
    if not splits:
        return SLOSuggestion(
            workload=workload,
            best=None,
            holds=False,
            reason="the fleet cannot be split into producers and consumers "
            "(it needs at least two engines)",
        )
    priced = [
        _price([by_name[n] for n in p], [by_name[n] for n in d], workload.rate, m)
        for p, d in splits
    ]
    best = min(priced, key=lambda s: (s.worse, min(s.prefill, s.decode)))
    if not best.holds:
        tier = "prefill utilisation" if best.prefill >= best.decode else "decode pressure"
        return SLOSuggestion(
            workload=workload,
            best=best,
            holds=False,
            candidates=len(priced),
            reason=f"the workload cannot be held at {workload.rate:g} requests/s: even the best "
            f"split has {tier} {best.worse:.2f} >= 1",
        )
    offsets = arrival_offsets(
        workload.rate,
        workload.arrival,
        burstiness=workload.burstiness,
        count=workload.requests,
        seed=workload.seed,
    )
    rng_in = random.Random(f"narwhal-suggest/{workload.seed}/sim/input_len")
    rng_out = random.Random(f"narwhal-suggest/{workload.seed}/sim/output_len")
    ins = [workload.input_len.sample(rng_in) for _ in offsets]
    outs = [workload.output_len.sample(rng_out) for _ in offsets]
    run = simulate_split(
        [by_name[n] for n in best.producers],
        [by_name[n] for n in best.consumers],
        offsets,
        ins,
        outs,
    )
    warnings = _warnings(best, by_name, m)
    for name, peak in run.peak_kv.items():
        if peak > by_name[name].kv_limit.tokens:
            warnings.append(
                f"{name}: resident KV peaked at {peak} tokens in the simulation, "
                f"above its capacity {by_name[name].kv_limit.tokens}"
            )
    ttft = _summary(run.ttft_s)
    tpot = _summary(run.tpot_s) if len(run.tpot_s) else {}
    return SLOSuggestion(
        workload=workload,
        best=best,
        holds=True,
        ttft_s=ttft,
        tpot_s=tpot,
        warnings=tuple(warnings),
        candidates=len(priced),
        simulated=run.requests,
    )
