"""Gate F and the fit limits: is the profile pair usable for the engines running now?

Gate F (the measurement contract's section 2) passes when the pair named by
``profiles.path`` exists, both files have the current schema (the sidecar's SHA-256
is the one the profiles file names), every configured engine has an accepted profile,
and every profile is bound to the engine generation running now: its
:class:`~narwhal.engines.client.EngineIdentity` (url, model, version, max_model_len,
process start time) equals the live one. A restarted engine fails the gate.

The fit limits (section 4) accept a decode sweep when it measured at least two points
on each decode axis (active requests, resident KV tokens: distinct values among the
sidecar's kept cells, or the profile's domain when the sidecar has none), its fit MAPE
is at most ``profiles.max_decode_fit_mape`` and its leave-one-cell-out MAPE at most
``profiles.max_decode_cv_mape``; the TTFT curve must stay within the profiler's own
bounds (mean error 20 %, worst point 50 %); and the fit limit itself must not exceed
``controller.reactive.movement_margin``. A profile's cached-prefix model (engines with
prefix caching) is held to the prefill bounds as well: in sample over its cells,
leave-one-cell-out over the cells with a cached prefix, and its intervals.

A relative ``profiles.path`` is taken from the working directory, as ``narwhal
profile --out`` writes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from narwhal.check.results import CheckResult, ProfilePair
from narwhal.config import FleetConfig
from narwhal.engines.client import EngineIdentity, start_date
from narwhal.errors import ConfigError
from narwhal.profile.derive import derive_profile, profile_differences
from narwhal.profile.fit import (
    DEFAULT_MAX_MEAN_ERROR,
    DEFAULT_MAX_WORST_ERROR,
    MIN_INTERVAL_REPEATS,
)
from narwhal.profile.store import (
    SAMPLES_KIND,
    SCHEMA_VERSION,
    CachedPrefill,
    DecodeModel,
    EngineProfile,
    Profiles,
    TTFTCurve,
    Uncertainty,
    file_sha256,
    load_profiles,
    read_json,
)

__all__ = [
    "MIN_AXIS_POINTS",
    "GateOutcome",
    "axis_points",
    "check_fit_limits",
    "check_margin",
    "find_refit_original",
    "gate_f",
    "load_pair",
    "reprofile_hint",
    "verify_samples",
]

#: Distinct measured points each decode axis needs.
MIN_AXIS_POINTS = 2


@attrs.frozen(kw_only=True)
class GateOutcome:
    """Gate F's results and the pair it read.

    Attributes:
        results: One result per check, in order.
        profiles: The profiles document, when it loaded.
        samples: The samples sidecar as parsed JSON, when it loaded.
        pair: The pair's files.
    """

    results: tuple[CheckResult, ...]
    profiles: Profiles | None = None
    samples: Mapping[str, Any] | None = None
    pair: ProfilePair | None = None


def load_pair(path: str | os.PathLike[str]) -> tuple[Profiles, dict[str, Any]]:
    """Read a profile pair: the profiles file (checked against its sidecar) and the sidecar.

    Raises:
        ConfigError: A file is missing, unreadable, of another schema, or the pair is mixed up.
    """
    profiles = load_profiles(path)
    sidecar = Path(path).with_name(profiles.samples.path)
    samples = read_json(sidecar, "samples file")
    source = os.fspath(sidecar)
    if not isinstance(samples, dict) or samples.get("kind") != SAMPLES_KIND:
        raise ConfigError("not a narwhal profile samples file", path="$.kind", source=source)
    if samples.get("schema_version") != SCHEMA_VERSION:
        raise ConfigError(
            f"samples schema_version {samples.get('schema_version')!r} is not {SCHEMA_VERSION}; "
            "profile again with this narwhal",
            path="$.schema_version",
            source=source,
        )
    return profiles, samples


def _pair_result(ok: bool, message: str, measured: Any, limit: Any, **detail: Any) -> CheckResult:
    return CheckResult(
        name="gate_f.profiles",
        engine=None,
        ok=ok,
        measured=measured,
        limit=limit,
        message=message,
        detail=detail,
    )


def _differences(live: EngineIdentity, profiled: EngineIdentity) -> dict[str, tuple[Any, Any]]:
    """The fields that differ, live / profiled; process start times as dates."""
    a, b = attrs.asdict(live), attrs.asdict(profiled)
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    if "process_start_time" in diff:
        diff["process_start_time"] = (start_date(live.process_start_time), start_date(profiled.process_start_time))
    return diff


def reprofile_hint(
    name: str, fleet_source: str | None, profiles_path: str | None, sweep: Mapping[str, Any] | None
) -> str:
    """The command that re-profiles one engine into the existing pair (it merges)."""
    parts = [f"narwhal profile --fleet {fleet_source or 'FLEET'} --engines {name}"]
    if profiles_path is not None:
        parts.append(f"--out {profiles_path}")
    options = (("prefill_lens", "--prefill-lens"), ("decode_input_lens", "--decode-input-lens"),
               ("decode_concurrency", "--decode-concurrency"))  # fmt: skip
    for key, flag in options:
        values = sweep.get(key) if sweep is not None else None
        if isinstance(values, list | tuple) and values:
            parts.append(f"{flag} {','.join(str(v) for v in values)}")
        else:
            parts.append(f"{flag} ...")
    return " ".join(parts)


def _sweep_of(samples: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    engines = samples.get("engines")
    entry = engines.get(name) if isinstance(engines, Mapping) else None
    sweep = entry.get("sweep") if isinstance(entry, Mapping) else None
    if not isinstance(sweep, Mapping):
        sweep = samples.get("sweep")
    return sweep if isinstance(sweep, Mapping) else None


def _generation(
    name: str,
    live: EngineIdentity | None,
    profile: EngineProfile,
    hint: str,
) -> CheckResult:
    if live is None:
        return CheckResult(
            name="gate_f.generation",
            engine=name,
            ok=False,
            measured=None,  # pragma: no mutate (equivalent: None is CheckResult's default)
            limit=attrs.asdict(profile.identity),
            message=f"engine {name} is unreachable; its generation cannot be "
            "compared with its profile's",
        )
    unknown = [
        who for who, ident in (("the running engine", live), ("its profile", profile.identity))
        if ident.process_start_time is None
    ]  # fmt: skip
    if unknown:
        # Two unknown start times are not equal generations: any restart would pass.
        return CheckResult(
            name="gate_f.generation",
            engine=name,
            ok=False,
            measured=live.process_start_time,
            limit=profile.identity.process_start_time,
            message=f"engine {name}'s generation is unknown: {' and '.join(unknown)} "
            f"{'report' if len(unknown) > 1 else 'reports'} no process_start_time_seconds "
            "(Prometheus multiprocess mode, e.g. more "
            "than one API server process, drops process_* metrics, and vLLM offers no other "
            "per-boot identity over HTTP), so the profile cannot be bound to the process "
            "running now; run the engine with a single API server process so that /metrics "
            f"exports process_start_time_seconds, then re-profile it ({hint})",
            detail={"live": attrs.asdict(live), "profiled": attrs.asdict(profile.identity)},
        )
    diff = _differences(live, profile.identity)
    if not diff:
        return CheckResult(
            name="gate_f.generation",
            engine=name,
            ok=True,
            measured=start_date(live.process_start_time),
            limit=start_date(profile.identity.process_start_time),
            message=f"engine {name} runs the generation its profile was measured on",
        )
    changes = ", ".join(f"{k} {v[1]!r} -> {v[0]!r}" for k, v in diff.items())
    message = (
        f"engine {name} is not the process its profile was measured on ({changes}); "
        f"re-profile it ({hint}: the new sweep is merged into the pair, the other engines "
        "kept) or, with generation-bound samples of the running process, refit "
        "(narwhal profile --refit-samples ... --out ...)"
    )
    return CheckResult(
        name="gate_f.generation",
        engine=name,
        ok=False,
        measured={k: v[0] for k, v in diff.items()},
        limit={k: v[1] for k, v in diff.items()},
        message=message,
        detail={"live": attrs.asdict(live), "profiled": attrs.asdict(profile.identity)},
    )


#: Seconds a sweep may appear to start before its engine's process start (clock skew
#: between the profiler's host and the engine's).
CLOCK_SKEW_S = 60.0


def verify_samples(
    profiles: Profiles, samples: Mapping[str, Any], names: Sequence[str]
) -> list[CheckResult]:
    """Derive every named engine's profile again from the sidecar's raw samples and
    compare it with ``profiles.json`` (coefficients, errors, intervals, domain,
    capacity, identity); also that the sweep ran after the engine process started.
    """
    results: list[CheckResult] = []
    engines = samples.get("engines")
    for name in names:
        profile = profiles.engines.get(name)
        if profile is None:
            continue
        entry = engines.get(name) if isinstance(engines, Mapping) else None
        problem: str | None  # every branch below sets it
        detail: dict[str, Any] = {}
        if not isinstance(entry, Mapping):
            problem = "the samples sidecar holds no entry for it"
        elif entry.get("status") != "ok":
            problem = f"its samples entry has status {entry.get('status')!r}, not 'ok'"
        else:
            try:
                derived = derive_profile(entry, name)
            except ConfigError as exc:
                problem = f"its samples give no profile: {exc.reason} (at {exc.path} in the sidecar)"
                detail["path"] = exc.path
            else:
                diffs = profile_differences(profile, derived)
                if diffs:
                    shown = "; ".join(f"{p} is {c!r} in profiles.json, the samples give {d!r}"
                                      for p, c, d in diffs[:3])  # fmt: skip
                    more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
                    problem = f"profiles.json does not match its samples: {shown}{more}"
                    detail["differences"] = [{"path": p, "profiles": c, "samples": d}
                                             for p, c, d in diffs]  # fmt: skip
                else:
                    problem = _sweep_before_start(entry, profile)
        results.append(
            CheckResult(
                name="gate_f.samples",
                engine=name,
                ok=problem is None,
                measured="recomputed" if problem is None else "differs",
                limit="profiles.json as its raw samples give it",
                message=f"engine {name}'s profile is what its raw samples give"
                if problem is None
                else f"engine {name}: {problem}; re-profile it",
                detail=detail,
            )
        )
    return results


def _sweep_before_start(entry: Mapping[str, Any], profile: EngineProfile) -> str | None:
    clock = entry.get("wall_clock")
    started = clock.get("started_at") if isinstance(clock, Mapping) else None
    finished = clock.get("finished_at") if isinstance(clock, Mapping) else None
    if not isinstance(started, int | float) or not isinstance(finished, int | float):
        return "its samples do not record when the sweep ran (wall_clock)"
    born = profile.identity.process_start_time
    if born is not None and started < born - CLOCK_SKEW_S:
        return (f"the sweep started at {started:.0f} (Unix time), before the engine process "
                f"it claims to measure started ({born:.0f}): the identity is not the one "
                "measured")  # fmt: skip
    return None


def gate_f(
    config: FleetConfig,
    identities: Mapping[str, EngineIdentity | None],
    *,
    fleet_source: str | None = None,
) -> GateOutcome:
    """Run Gate F against the live ``identities`` (``None`` for an unreachable engine).

    Args:
        config: The fleet document.
        identities: Each configured engine's generation, as read just now.
        fleet_source: The fleet document's file, quoted in the re-profile hint.
    """
    if config.profiles.path is None:
        result = _pair_result(
            False,
            "profiles.path is not set; profile the fleet (narwhal "
            "profile) and name the pair in the fleet document",
            None,
            "a profile pair",
        )
        return GateOutcome(results=(result,))
    path = Path(config.profiles.path)
    try:
        profiles, samples = load_pair(path)
        sidecar = path.with_name(profiles.samples.path)
        pair = ProfilePair(
            profiles=os.fspath(path),
            samples=os.fspath(sidecar),
            profiles_sha256=file_sha256(path),
            samples_sha256=file_sha256(sidecar),
        )
    except (ConfigError, OSError) as exc:
        where = exc.path if isinstance(exc, ConfigError) else "$"
        result = _pair_result(
            False,
            f"profile pair unusable: {exc}",
            str(path),
            f"schema_version {SCHEMA_VERSION} pair",
            path=where,
        )
        return GateOutcome(results=(result,))
    results = [
        _pair_result(
            True,
            f"profile pair {path} with sidecar {sidecar.name} (schema_version {SCHEMA_VERSION})",
            str(path),
            f"schema_version {SCHEMA_VERSION} pair",
        )
    ]
    for e in config.engines:
        profile = profiles.engines.get(e.name)
        if profile is None:
            why = profiles.excluded.get(e.name, "it was not profiled")
            results.append(
                CheckResult(
                    name="gate_f.profile",
                    engine=e.name,
                    ok=False,
                    measured="none",
                    limit="an accepted profile",
                    message=f"engine {e.name} has no accepted profile in {path} ({why})",
                )
            )
            continue
        results.append(
            CheckResult(
                name="gate_f.profile",
                engine=e.name,
                ok=True,
                measured="accepted",
                limit="an accepted profile",
                message=f"engine {e.name} has an accepted profile",
            )
        )
        hint = reprofile_hint(e.name, fleet_source, os.fspath(path), _sweep_of(samples, e.name))
        results.append(_generation(e.name, identities.get(e.name), profile, hint))
    results += verify_samples(profiles, samples, [e.name for e in config.engines])
    return GateOutcome(results=tuple(results), profiles=profiles, samples=samples, pair=pair)


def axis_points(
    profile: EngineProfile, samples: Mapping[str, Any] | None
) -> tuple[dict[str, int], str]:
    """Distinct measured points on each decode axis, and where they were counted.

    The sidecar's kept cells (``decode.cell_medians``) when it has them, else the
    profile's domain (two points when its minimum and maximum differ).
    """
    engines = samples.get("engines") if samples is not None else None
    entry = engines.get(profile.name) if isinstance(engines, Mapping) else None
    decode = entry.get("decode") if isinstance(entry, Mapping) else None
    cells = decode.get("cell_medians") if isinstance(decode, Mapping) else None
    if isinstance(cells, list) and cells and all(isinstance(c, Mapping) for c in cells):
        return {
            axis: len({c.get(axis) for c in cells if isinstance(c.get(axis), int | float)})
            for axis in ("active", "kv_tokens")
        }, "samples"
    domain = profile.decode_model.domain
    return {
        "active": 1 if domain.active.min == domain.active.max else 2,
        "kv_tokens": 1 if domain.kv_tokens.min == domain.kv_tokens.max else 2,
    }, "domain"


def _limit(
    name: str, engine: str, what: str, setting: str, value: float, limit: float, **detail: Any
) -> CheckResult:
    ok = value <= limit
    verb = "within" if ok else "exceeds"
    return CheckResult(
        name=name,
        engine=engine,
        ok=ok,
        measured=value,
        limit=limit,
        message=f"engine {engine}'s {what} {value:.2%} {verb} {setting} {limit:.2%}",
        detail=detail,
    )


def _missing(name: str, engine: str, what: str) -> CheckResult:
    return CheckResult(
        name=name,
        engine=engine,
        ok=False,
        measured=None,  # pragma: no mutate (equivalent: None is CheckResult's default)
        limit="measured",
        message=f"engine {engine}'s profile has no {what} (written by an earlier profiler); "
        "re-profile it",
    )


def _bands(u: Uncertainty) -> str:
    return ", ".join(f"{k} {b.value:.4g} [{b.low:.4g}, {b.high:.4g}]"
                     for k, b in u.coefficients.items())  # fmt: skip


def _prefill_limits(engine: str, t: TTFTCurve) -> list[CheckResult]:
    loo = (
        None
        if t.loo_mean_error is None or t.loo_worst_error is None
        else (t.loo_mean_error, t.loo_worst_error)
    )
    results = _error_limits("prefill", engine, "TTFT fit", "leave-one-length-out TTFT",
                            "point", t.mean_error, t.worst_error, loo)  # fmt: skip
    if loo is None:
        results.append(_missing("prefill.loo_error", engine, "leave-one-length-out error"))
    return results + _prefill_intervals(engine, t.uncertainty)


def _cached_limits(engine: str, m: CachedPrefill) -> list[CheckResult]:
    """The prefill bounds on the cached-prefix model: in sample over every cell,
    leave-one-cell-out over the cells with a cached prefix, and its intervals."""
    return _error_limits(
        "prefix", engine, "cached-prefix fit", "leave-one-cell-out cached-prefix", "cell",
        m.mean_error, m.worst_error, (m.loo_mean_error, m.loo_worst_error),
    ) + _prefill_intervals(engine, m.uncertainty, key="prefix", what="cached-prefix TTFT",
                           unit="cell")  # fmt: skip


def _error_limits(key: str, engine: str, what: str, loo_what: str, unit: str, mean: float,
                  worst: float, loo: tuple[float, float] | None) -> list[CheckResult]:  # fmt: skip
    bound = "the prefill bound"
    results = [
        _limit(f"{key}.mean_error", engine, f"{what} mean error", bound, mean,
               DEFAULT_MAX_MEAN_ERROR),
        _limit(f"{key}.worst_error", engine, f"{what} worst-{unit} error", bound, worst,
               DEFAULT_MAX_WORST_ERROR),
    ]  # fmt: skip
    if loo is not None:
        results += [
            _limit(f"{key}.loo_mean_error", engine, f"{loo_what} mean error", bound, loo[0],
                   DEFAULT_MAX_MEAN_ERROR),
            _limit(f"{key}.loo_worst_error", engine, f"{loo_what} worst error", bound, loo[1],
                   DEFAULT_MAX_WORST_ERROR),
        ]  # fmt: skip
    return results


def _prefill_intervals(engine: str, u: Uncertainty | None, *, key: str = "prefill",
                       what: str = "TTFT", unit: str = "length") -> list[CheckResult]:  # fmt: skip
    """The prefill bounds applied to a prefill fit's prediction intervals at its operating
    points (the mean and the widest relative half-width), and enough repeats at every
    point for those intervals to mean something."""
    if u is None or u.mean_half_width is None or u.min_samples is None:
        return [_missing(f"{key}.interval", engine, f"{what} intervals")]
    enough = u.min_samples >= MIN_INTERVAL_REPEATS
    samples = CheckResult(
        name=f"{key}.interval_samples", engine=engine, ok=enough, measured=u.min_samples,
        limit=MIN_INTERVAL_REPEATS,
        message=f"engine {engine}'s {what} {'curve' if key == 'prefill' else 'model'} rests on "
                f"at least {u.min_samples} repeat(s) per {unit}" + ("" if enough else f", fewer than the {MIN_INTERVAL_REPEATS} an "
                             "interval needs; re-profile it with more --repeats"),
    )  # fmt: skip
    return [
        samples,
        _interval(f"{key}.interval", engine, f"mean {what}", u, u.mean_half_width,
                  "the prefill mean-error bound", DEFAULT_MAX_MEAN_ERROR),
        _interval(f"{key}.interval_worst", engine, f"widest {what}", u, u.worst_half_width,
                  "the prefill worst-point bound", DEFAULT_MAX_WORST_ERROR),
    ]  # fmt: skip


def _interval(
    name: str, engine: str, what: str, u: Uncertainty, width: float, setting: str, limit: float
) -> CheckResult:
    """A prediction-interval width of a fit against ``limit``, its coefficients' bands shown."""
    return _limit(
        name, engine,
        f"{what} prediction interval ({u.level:.0%}, relative half-width; coefficients "
        f"{_bands(u)})",
        setting, width, limit,
        coefficients={k: attrs.asdict(b) for k, b in u.coefficients.items()},
        upper_factor=u.upper_factor,
    )  # fmt: skip


def _decode_limits(config: FleetConfig, engine: str, d: DecodeModel) -> list[CheckResult]:
    limits = config.profiles
    results = [
        _limit("decode.fit_mape", engine, "decode fit MAPE", "profiles.max_decode_fit_mape",
               d.fit_mape, limits.max_decode_fit_mape),
        _limit("decode.cv_mape", engine, "leave-one-cell-out decode MAPE",
               "profiles.max_decode_cv_mape", d.cv_mape, limits.max_decode_cv_mape),
    ]  # fmt: skip
    u = d.uncertainty
    if u is None:
        results.append(_missing("decode.interval", engine, "TPOT intervals"))
    else:
        # A MAPE is a mean over the cells: so is the interval figure held to its limit.
        results.append(_interval("decode.interval", engine, "mean TPOT", u,
                                 u.mean_half_width if u.mean_half_width is not None
                                 else u.worst_half_width,
                                 "profiles.max_decode_cv_mape", limits.max_decode_cv_mape))  # fmt: skip
    return results


def check_fit_limits(
    config: FleetConfig, profiles: Profiles, samples: Mapping[str, Any] | None
) -> list[CheckResult]:
    """The fit limits for every configured engine that has a profile.

    Prefill figures for every engine; decode figures for engines with the decode role
    (a prefill-only engine has no decode sweep, and one that the fleet now lets decode
    must be re-profiled with it).
    """
    results: list[CheckResult] = []
    for e in config.engines:
        profile = profiles.engines.get(e.name)
        if profile is None:
            continue  # Gate F already failed it
        results += _prefill_limits(e.name, profile.ttft)
        if profile.cached_prefill is not None:
            results += _cached_limits(e.name, profile.cached_prefill)
        if not e.can_decode:
            continue
        if profile.decode is None:
            results.append(CheckResult(
                name="decode.profile", engine=e.name, ok=False, measured="prefill only",
                limit="a decode model",
                message=f"engine {e.name} may decode in this fleet but was profiled for prefill "
                        "only; re-profile it with its decode role",
            ))  # fmt: skip
            continue
        points, where = axis_points(profile, samples)
        for axis, count in points.items():
            ok = count >= MIN_AXIS_POINTS
            results.append(
                CheckResult(
                    name=f"decode.points.{axis}",
                    engine=e.name,
                    ok=ok,
                    measured=count,
                    limit=MIN_AXIS_POINTS,
                    detail={"counted_from": where},
                    message=f"engine {e.name}'s decode sweep measured {count} distinct {axis} "
                    f"value(s) ({where}); at least {MIN_AXIS_POINTS} are needed"
                    + ("" if ok else "; extend --decode-concurrency / --decode-input-lens"),
                )
            )
        results += _decode_limits(config, e.name, profile.decode)
    return results


def check_margin(config: FleetConfig) -> CheckResult:
    """``profiles.max_decode_fit_mape`` must not exceed ``controller.reactive.movement_margin``.

    The fleet loader refuses such a document already; a document built in code can
    still carry one, so the preflight checks it again.
    """
    fit, margin = config.profiles.max_decode_fit_mape, config.controller.reactive.movement_margin
    ok = fit <= margin
    return CheckResult(
        name="fit_limit",
        engine=None,
        ok=ok,
        measured=fit,
        limit=margin,
        message=f"profiles.max_decode_fit_mape {fit:g} "
        + ("is within" if ok else "exceeds")
        + f" controller.reactive.movement_margin {margin:g}"
        + ("" if ok else "; a move could be priced on fit error alone"),
    )


def find_refit_original(profiles: Profiles, pair: ProfilePair) -> ProfilePair | None:
    """The original pair a refit was made from (``refit_of``), or ``None`` if not a refit.

    ``refit_of`` names the original sidecar as the refit was given it: taken as is, then
    beside the refit pair. The original profiles file is the one that sidecar names.

    Raises:
        ConfigError: The original pair is not found, or its sidecar is not the one the
            refit was made from (SHA-256 recorded in the refit's sidecar).
    """
    if profiles.refit_of is None:
        return None
    given = Path(profiles.refit_of)
    candidates = [given, Path(pair.profiles).with_name(given.name)]
    sidecar = next((p for p in candidates if p.is_file()), None)
    if sidecar is None:
        raise ConfigError(
            f"the refit's original samples {profiles.refit_of} are not found "
            f"(looked at {', '.join(map(str, dict.fromkeys(candidates)))})",
            path="$.refit_of",
            source=pair.profiles,
        )
    refit = read_json(pair.samples, "samples file")
    made_from = refit.get("refit") if isinstance(refit, dict) else None
    expected = made_from.get("sha256") if isinstance(made_from, dict) else None
    if expected is not None and file_sha256(sidecar) != expected:
        raise ConfigError(
            f"{sidecar} is not the sidecar the refit was made from (SHA-256 differs)",
            path="$.refit.sha256",
            source=pair.samples,
        )
    original = read_json(sidecar, "samples file")
    named = original.get("profiles") if isinstance(original, dict) else None
    default = sidecar.name.removesuffix(".samples.json") + ".json"
    profiles_file = sidecar.with_name(named if isinstance(named, str) else default)
    if not profiles_file.is_file():
        raise ConfigError(
            f"the refit's original profiles file {profiles_file} is not found",
            path="$.refit_of",
            source=pair.profiles,
        )
    return ProfilePair(
        profiles=os.fspath(profiles_file),
        samples=os.fspath(sidecar),
        profiles_sha256=file_sha256(profiles_file),
        samples_sha256=file_sha256(sidecar),
    )
