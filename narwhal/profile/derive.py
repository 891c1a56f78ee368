"""A profile from its raw samples: the one derivation the profiler and the preflight share.

The profiler records every raw measurement of an engine into its sidecar entry and
then derives the engine's profile from that entry with :func:`derive_profile`; the
preflight (``narwhal check``) derives it again from the sidecar and compares it with
what ``profiles.json`` says (:func:`profile_differences`). A coefficient, error figure,
interval, domain or identity that the samples do not give is a difference, so a
hand-edited figure, a copied process start time or a stub sidecar is refused instead
of believed.

What is derived from what (every path below is inside ``engines.<name>`` of the
sidecar):

- the TTFT curve, its in-sample and leave-one-length-out errors and its intervals from
  ``prefill.repeats`` (``length``, ``ttft_s``);
- the decode model, its errors, domain and intervals from the window intervals of the
  kept cells in ``decode.cells`` (``stream``, ``seconds``, ``active``, ``kv_tokens``),
  for engines with the decode role;
- the KV capacity from ``engine.kv_cache_size_tokens``, the TPOT target recorded in
  ``kv_capacity_inputs`` and the decode fit;
- the cached-prefix model from ``prefix.repeats`` (``length``, ``cached``, ``ttft_s``)
  with ``prefill.repeats`` as its cells without a cached prefix, kept only when it
  passes the prefill bounds (in sample, leave-one-cell-out, intervals);
- the identity from ``identity``, which must equal ``identity_after``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from narwhal.config import converter, parse_as
from narwhal.engines.client import EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile.burst import queue_verdict
from narwhal.profile.enginetime import fit_outside
from narwhal.profile.fit import (
    DEFAULT_MAX_MEAN_ERROR,
    DEFAULT_MAX_WORST_ERROR,
    MIN_INTERVAL_REPEATS,
    CachedFit,
    DecodeFit,
    DecodePoint,
    Intervals,
    TTFTFit,
    bootstrap_cached,
    bootstrap_decode,
    bootstrap_ttft,
    cached_rejection,
    cell_figures,
    fit_cached,
    fit_decode,
    fit_ttft,
    interval_rejection,
    median_by_length,
    tpot_kv_limit,
    ttft_rejection,
)
from narwhal.profile.store import (
    CachedPrefill,
    CoefficientBand,
    DecodeAxis,
    DecodeDomain,
    DecodeModel,
    EngineProfile,
    KVCapacity,
    PrefillOutside,
    QueueKind,
    TTFTCurve,
    Uncertainty,
)

__all__ = [
    "DerivedCached",
    "DerivedDecode",
    "DerivedTTFT",
    "cached_prefill",
    "decode_cells",
    "decode_model",
    "derive_cached",
    "derive_decode",
    "derive_profile",
    "derive_ttft",
    "kv_capacity",
    "prefill_outside",
    "prefill_queue",
    "prefill_repeats",
    "prefix_repeats",
    "profile_differences",
    "ttft_curve",
    "uncertainty",
]

#: Relative tolerance of a recomputed figure (JSON round trips floats exactly; the
#: tolerance only absorbs a different BLAS summation order on another machine).
REL_TOLERANCE = 1e-6
ABS_TOLERANCE = 1e-12


def _bad(message: str, path: str) -> ConfigError:
    return ConfigError(message, path=path)


def prefill_repeats(entry: Mapping[str, Any], where: str) -> list[tuple[int, float]]:
    """The measured prefill repeats ``(length, ttft_s)`` of a sidecar entry.

    Raises:
        ConfigError: none, or a malformed one (the message names its JSON path).
    """
    prefill = entry.get("prefill")
    repeats = prefill.get("repeats") if isinstance(prefill, Mapping) else None
    path = f"{where}.prefill.repeats"
    if not isinstance(repeats, list) or not repeats:
        raise _bad("the samples hold no prefill repeats", path)
    out: list[tuple[int, float]] = []
    for i, r in enumerate(repeats):
        length = r.get("length") if isinstance(r, Mapping) else None
        seconds = r.get("ttft_s") if isinstance(r, Mapping) else None
        if (type(length) is not int or not isinstance(seconds, int | float)
                or isinstance(seconds, bool) or not math.isfinite(seconds) or seconds <= 0):  # fmt: skip
            raise _bad("expected {length: int, ttft_s: number > 0}", f"{path}[{i}]")
        out.append((length, float(seconds)))
    return out


def prefill_queue(entry: Mapping[str, Any], where: str, curve: TTFTCurve) -> QueueKind | None:
    """How the engine queues prompts, from its recorded bursts (``prefill_queue``) and
    its TTFT curve (:mod:`narwhal.profile.burst`); None when no burst probe ran (the
    record absent or skipped).

    Raises:
        ConfigError: a malformed record (the message names its JSON path).
    """
    record = entry.get("prefill_queue")
    path = f"{where}.prefill_queue"
    if record is None or (isinstance(record, Mapping) and "skipped" in record):
        return None
    if not isinstance(record, Mapping):
        raise _bad("expected the burst probe's record", path)
    length = record.get("length")
    if type(length) is not int or length <= 0:
        raise _bad("expected an integer > 0", f"{path}.length")
    bursts = record.get("bursts")
    if not isinstance(bursts, list):
        raise _bad("expected a list of bursts", f"{path}.bursts")
    for i, times in enumerate(bursts):
        if (not isinstance(times, list) or any(_number(t) is None or not t >= 0 for t in times)
                or times != sorted(times)):  # fmt: skip
            raise _bad("expected the answers' times in seconds (numbers >= 0, in order)",
                       f"{path}.bursts[{i}]")  # fmt: skip
    try:
        return queue_verdict(bursts, curve.predict(length))
    except ValueError as exc:
        raise _bad(str(exc), f"{path}.bursts") from None


def prefix_repeats(entry: Mapping[str, Any], where: str) -> tuple[int, list[tuple[int, int, float]]] | None:
    """The engine's block size and its cached-prefix repeats ``(length, cached,
    ttft_s)``, or None when no cached-prefix sweep ran (``prefix`` absent or skipped).

    Raises:
        ConfigError: a malformed record (the message names its JSON path).
    """
    prefix = entry.get("prefix")
    if not isinstance(prefix, Mapping) or "skipped" in prefix:
        return None
    block = prefix.get("block_size")
    if type(block) is not int or block <= 0:
        raise _bad("expected the engine's block size (an integer > 0)", f"{where}.prefix.block_size")
    repeats = prefix.get("repeats")
    path = f"{where}.prefix.repeats"
    if not isinstance(repeats, list):
        raise _bad("expected a list of cached-prefix repeats", path)
    out: list[tuple[int, int, float]] = []
    for i, r in enumerate(repeats):
        length = r.get("length") if isinstance(r, Mapping) else None
        cached = r.get("cached") if isinstance(r, Mapping) else None
        seconds = r.get("ttft_s") if isinstance(r, Mapping) else None
        if (type(length) is not int or type(cached) is not int or not 0 < cached < length
                or not isinstance(seconds, int | float) or isinstance(seconds, bool)
                or not math.isfinite(seconds) or seconds <= 0):  # fmt: skip
            raise _bad("expected {length: int, cached: int in (0, length), ttft_s: number > 0}",
                       f"{path}[{i}]")  # fmt: skip
        out.append((length, cached, float(seconds)))
    return block, out


def prefill_outside(entry: Mapping[str, Any], where: str) -> PrefillOutside | None:
    """What a prefill spends outside the engine's steps, fitted over the plain and
    cached-prefix repeats that carry the engine's own seconds (``engine_s``); None over
    too few lengths (:func:`narwhal.profile.enginetime.fit_outside`).

    Raises:
        ConfigError: a malformed ``engine_s`` (the message names its JSON path).
    """
    samples: list[tuple[int, float, float]] = []
    for sweep in ("prefill", "prefix"):
        record = entry.get(sweep)
        repeats = record.get("repeats") if isinstance(record, Mapping) else None
        for i, r in enumerate(repeats if isinstance(repeats, list) else ()):
            if not isinstance(r, Mapping) or r.get("engine_s") is None:
                continue
            seconds, ttft = _number(r["engine_s"]), _number(r.get("ttft_s"))
            if seconds is None or not 0 <= seconds < math.inf:
                raise _bad("expected the engine's seconds (a number >= 0, or null)",
                           f"{where}.{sweep}.repeats[{i}].engine_s")  # fmt: skip
            if type(r.get("length")) is int and ttft is not None:  # the repeat's own checks name the rest
                samples.append((r["length"], ttft, seconds))
    fit = fit_outside(samples)
    if fit is None:
        return None
    return PrefillOutside(base_s=fit[0], per_token_s=fit[1], samples=len(samples))


def decode_cells(entry: Mapping[str, Any], where: str) -> list[list[dict[str, float]]]:
    """The window intervals of every kept decode cell of a sidecar entry.

    Raises:
        ConfigError: no decode record, or a malformed interval.
    """
    decode = entry.get("decode")
    cells = decode.get("cells") if isinstance(decode, Mapping) else None
    path = f"{where}.decode.cells"
    if not isinstance(cells, list):
        raise _bad("the samples hold no decode cells", path)
    out: list[list[dict[str, float]]] = []
    for i, cell in enumerate(cells):
        if not isinstance(cell, Mapping) or cell.get("kept") is not True:
            continue
        intervals = cell.get("intervals")
        if not isinstance(intervals, list) or not intervals:
            raise _bad("a kept cell holds no intervals", f"{path}[{i}].intervals")
        rows: list[dict[str, float]] = []
        for j, iv in enumerate(intervals):
            try:
                row = {k: float(iv[k]) for k in ("stream", "seconds", "active", "kv_tokens")}
            except (KeyError, TypeError, ValueError):
                raise _bad("expected {stream, seconds, active, kv_tokens} numbers",
                           f"{path}[{i}].intervals[{j}]") from None  # fmt: skip
            if not all(math.isfinite(v) for v in row.values()) or row["seconds"] <= 0:
                raise _bad("expected finite numbers and seconds > 0",
                           f"{path}[{i}].intervals[{j}]")  # fmt: skip
            rows.append(row)
        out.append(rows)
    return out


def uncertainty(intervals: Intervals) -> Uncertainty:
    """The stored form of a fit's intervals."""
    return Uncertainty(
        level=intervals.level,
        resamples=intervals.resamples,
        coefficients={k: CoefficientBand(value=b.value, low=b.low, high=b.high)
                      for k, b in intervals.coefficients.items()},
        upper_factor=intervals.upper_factor,
        worst_half_width=intervals.worst_half_width,
        mean_half_width=intervals.mean_half_width,
        min_samples=intervals.min_samples,
    )


@attrs.frozen
class DerivedTTFT:
    fit: TTFTFit
    intervals: Intervals

    def rejection(self, *, max_mean_error: float = DEFAULT_MAX_MEAN_ERROR,
                  max_worst_error: float = DEFAULT_MAX_WORST_ERROR) -> str | None:  # fmt: skip
        """Why the curve must be rejected (its errors in and out of sample, the width of
        its intervals, against the prefill bounds), or None if it is accepted."""
        reasons = [ttft_rejection(self.fit, max_mean_error=max_mean_error,
                                  max_worst_error=max_worst_error),
                   interval_rejection(self.intervals, max_mean_width=max_mean_error,
                                      max_worst_width=max_worst_error)]  # fmt: skip
        return "; ".join(r for r in reasons if r is not None) or None


@attrs.frozen
class DerivedCached:
    fit: CachedFit
    intervals: Intervals
    block_size: int

    def rejection(self) -> str | None:
        """Why the cached-prefix model is not used (the prefill bounds on its errors in
        and out of sample and on its intervals), or None if it is accepted. The bounds
        are the profiler's defaults, so that the preflight decides as the profiler did."""
        reasons = [cached_rejection(self.fit),
                   interval_rejection(self.intervals, min_samples=MIN_INTERVAL_REPEATS)]  # fmt: skip
        return "; ".join(r for r in reasons if r is not None) or None


def derive_cached(
    plain: Sequence[tuple[int, float]], cached: Sequence[tuple[int, int, float]], block_size: int
) -> DerivedCached:
    """The cached-prefix fit of the plain prefill repeats (cells with k = 0) and the
    cached-prefix repeats, with its intervals.

    Raises:
        ValueError: the cells cannot support a fit.
    """
    samples = [(n, 0, s) for n, s in plain] + list(cached)
    fit = fit_cached(samples)
    return DerivedCached(fit, bootstrap_cached(samples, fit), block_size)


def cached_prefill(derived: DerivedCached) -> CachedPrefill:
    """The stored form of a cached-prefix fit."""
    fit = derived.fit
    return CachedPrefill(a=fit.a, b=fit.b, c=fit.c, d=fit.d, cells=len(fit.cells),
                         min_length=min(n for n, _ in fit.cells),
                         max_length=max(n for n, _ in fit.cells),
                         max_cached=max(k for _, k in fit.cells), block_size=derived.block_size,
                         mean_error=fit.mean_error, worst_error=fit.worst_error,
                         loo_mean_error=fit.loo_mean_error, loo_worst_error=fit.loo_worst_error,
                         uncertainty=uncertainty(derived.intervals))  # fmt: skip


def _accepted_cached(
    entry: Mapping[str, Any], where: str, plain: Sequence[tuple[int, float]]
) -> CachedPrefill | None:
    """The cached-prefix model the entry's samples give, when they give an accepted one."""
    recorded = prefix_repeats(entry, where)
    if recorded is None:
        return None
    block_size, cached = recorded
    try:
        derived = derive_cached(plain, cached, block_size)
    except ValueError:
        return None
    return cached_prefill(derived) if derived.rejection() is None else None


@attrs.frozen
class DerivedDecode:
    fit: DecodeFit
    intervals: Intervals
    kv_max: int


def derive_ttft(repeats: Sequence[tuple[int, float]]) -> DerivedTTFT:
    """The TTFT fit of raw repeats (medians per exact length) and its intervals.

    Raises:
        ValueError: too few lengths.
    """
    fit = fit_ttft(median_by_length(repeats))
    return DerivedTTFT(fit, bootstrap_ttft(repeats, fit))


def derive_decode(cells: Sequence[Sequence[Mapping[str, float]]]) -> DerivedDecode:
    """The decode fit of the kept cells' intervals and its intervals.

    Raises:
        ValueError: the cells cannot support a fit.
    """
    points = []
    for cell in cells:
        tpot, active, kv = cell_figures(cell)
        points.append(DecodePoint(active=active, kv_tokens=kv, tpot_s=tpot))
    fit = fit_decode(points)  # raises ValueError with decode_fit_problem's reason
    kv_max = int(max(iv["kv_tokens"] for c in cells for iv in c))
    return DerivedDecode(fit, bootstrap_decode(cells, fit), kv_max)


def ttft_curve(derived: DerivedTTFT) -> TTFTCurve:
    """The stored form of a TTFT fit."""
    fit = derived.fit
    return TTFTCurve(a=fit.a, b=fit.b, c=fit.c, min_length=fit.lengths[0],
                     max_length=fit.lengths[-1], mean_error=fit.mean_error,
                     worst_error=fit.worst_error, loo_mean_error=fit.loo_mean_error,
                     loo_worst_error=fit.loo_worst_error,
                     uncertainty=uncertainty(derived.intervals))  # fmt: skip


def decode_model(derived: DerivedDecode) -> DecodeModel:
    """The stored form of a decode fit."""
    fit = derived.fit
    domain = DecodeDomain(active=DecodeAxis(min=fit.active_min, max=fit.active_max),
                          kv_tokens=DecodeAxis(min=fit.kv_min, max=fit.kv_max))  # fmt: skip
    return DecodeModel(c0=fit.c0, c1=fit.c1, c2=fit.c2, fit_mape=fit.fit_mape,
                       cv_mape=fit.cv_mape, cells=len(fit.points), domain=domain,
                       uncertainty=uncertainty(derived.intervals))  # fmt: skip


def kv_capacity(
    physical_tokens: int | None, fit: DecodeFit, *, measured_kv_max: int, tpot_target_s: float | None
) -> KVCapacity:
    """The engine's KV constraint: physical when reported, else derived from the TPOT
    target, else only the largest KV measured (labelled ``measured``: not a limit)."""
    if physical_tokens is not None:
        return KVCapacity(source="physical", tokens=physical_tokens,
                          basis="vllm:cache_config_info kv_cache_size_tokens")  # fmt: skip
    if tpot_target_s is not None:
        limit = tpot_kv_limit(fit.c0, fit.c1, fit.c2, tpot_s=tpot_target_s, active=fit.active_max)
        if limit is not None:
            return KVCapacity(source="tpot", tokens=int(limit), tpot_s=tpot_target_s,
                              active=fit.active_max,
                              basis="resident KV at which the decode fit reaches the TPOT "
                                    "target with the most active requests measured")  # fmt: skip
    return KVCapacity(source="measured", tokens=measured_kv_max,
                      basis="no capacity known: the engine reports no kv_cache_size_tokens and "
                            "no TPOT target bounds it; this is the largest resident KV measured, "
                            "the edge of the decode domain, priced beyond conservatively")  # fmt: skip


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def derive_profile(entry: Mapping[str, Any], name: str) -> EngineProfile:
    """The profile the sidecar entry of engine ``name`` gives.

    Raises:
        ConfigError: the entry lacks raw data or a binding, or its data cannot give an
            accepted profile (the message names the JSON path in the sidecar).
    """
    where = f"$.engines.{name}"
    raw_identity = entry.get("identity")
    if not isinstance(raw_identity, Mapping):
        raise _bad("the samples are not bound to an engine generation", f"{where}.identity")
    identity = parse_as(EngineIdentity, raw_identity)
    after = entry.get("identity_after")
    if not isinstance(after, Mapping) or parse_as(EngineIdentity, after) != identity:
        raise _bad("the engine's generation after the sweep is missing or differs from the "
                   "one before it", f"{where}.identity_after")  # fmt: skip
    roles = entry.get("roles")
    if not isinstance(roles, list) or not roles or not all(isinstance(r, str) for r in roles):
        raise _bad("expected the engine's roles", f"{where}.roles")
    plain = prefill_repeats(entry, where)
    try:
        ttft = derive_ttft(plain)
    except ValueError as exc:
        raise _bad(str(exc), f"{where}.prefill.repeats") from None
    cached = _accepted_cached(entry, where, plain)
    curve = ttft_curve(ttft)
    queue = prefill_queue(entry, where, curve)
    outside = prefill_outside(entry, where)
    if "decode" not in roles:
        return EngineProfile(name=name, identity=identity, ttft=curve, roles=tuple(roles),
                             cached_prefill=cached, prefill_queue=queue, prefill_outside=outside)  # fmt: skip
    try:
        decode = derive_decode(decode_cells(entry, where))
    except ValueError as exc:
        raise _bad(str(exc), f"{where}.decode.cells") from None
    engine = entry.get("engine")
    physical = engine.get("kv_cache_size_tokens") if isinstance(engine, Mapping) else None
    inputs = entry.get("kv_capacity_inputs")
    target = _number(inputs.get("tpot_target_s")) if isinstance(inputs, Mapping) else None
    capacity = kv_capacity(physical if type(physical) is int else None, decode.fit,
                           measured_kv_max=decode.kv_max, tpot_target_s=target)  # fmt: skip
    return EngineProfile(name=name, identity=identity, ttft=curve,
                         decode=decode_model(decode), kv_capacity=capacity,
                         roles=tuple(roles), cached_prefill=cached, prefill_queue=queue,
                         prefill_outside=outside)  # fmt: skip


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=REL_TOLERANCE, abs_tol=ABS_TOLERANCE)
    return bool(a == b)


def _walk(claimed: Any, derived: Any, path: str, out: list[tuple[str, Any, Any]]) -> None:
    if isinstance(claimed, Mapping) and isinstance(derived, Mapping):
        for key in dict.fromkeys([*claimed, *derived]):
            _walk(claimed.get(key), derived.get(key), f"{path}.{key}", out)
    elif isinstance(claimed, list | tuple) and isinstance(derived, list | tuple):
        if len(claimed) != len(derived):
            out.append((path, claimed, derived))
            return
        for i, (c, d) in enumerate(zip(claimed, derived, strict=True)):  # pragma: no mutate (equivalent: lengths equal)
            _walk(c, d, f"{path}[{i}]", out)
    elif not _close(claimed, derived):
        out.append((path, claimed, derived))


def profile_differences(claimed: EngineProfile, derived: EngineProfile) -> list[tuple[str, Any, Any]]:
    """Every figure where ``claimed`` (profiles.json) differs from ``derived`` (the
    samples): ``(JSON path under the profile, claimed, derived)``."""
    out: list[tuple[str, Any, Any]] = []
    _walk(converter.unstructure(claimed), converter.unstructure(derived), "$", out)
    return out
