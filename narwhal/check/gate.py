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
``controller.reactive.movement_margin``.

A relative ``profiles.path`` is taken from the working directory, as ``narwhal
profile --out`` writes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from narwhal.check.results import CheckResult, ProfilePair
from narwhal.config import FleetConfig
from narwhal.engines.client import EngineIdentity, start_date
from narwhal.errors import ConfigError
from narwhal.profile.fit import DEFAULT_MAX_MEAN_ERROR, DEFAULT_MAX_WORST_ERROR
from narwhal.profile.store import (
    SAMPLES_KIND,
    SCHEMA_VERSION,
    EngineProfile,
    Profiles,
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


def _generation(
    name: str, live: EngineIdentity | None, profile: EngineProfile, fleet_source: str | None
) -> CheckResult:
    fleet = fleet_source or "FLEET"
    if live is None:
        return CheckResult(
            name="gate_f.generation",
            engine=name,
            ok=False,
            measured=None,
            limit=attrs.asdict(profile.identity),
            message=f"engine {name} is unreachable; its generation cannot be "
            "compared with its profile's",
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
        f"re-profile it (narwhal profile --fleet {fleet} --engines {name} ...) or, with "
        "generation-bound samples of the running process, refit "
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
        results.append(_generation(e.name, identities.get(e.name), profile, fleet_source))
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
    domain = profile.decode.domain
    return {
        "active": 1 if domain.active.min == domain.active.max else 2,
        "kv_tokens": 1 if domain.kv_tokens.min == domain.kv_tokens.max else 2,
    }, "domain"


def _limit(
    name: str, engine: str, what: str, setting: str, value: float, limit: float
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
    )


def check_fit_limits(
    config: FleetConfig, profiles: Profiles, samples: Mapping[str, Any] | None
) -> list[CheckResult]:
    """The fit limits for every configured engine that has a profile."""
    limits = config.profiles
    results: list[CheckResult] = []
    for e in config.engines:
        profile = profiles.engines.get(e.name)
        if profile is None:
            continue  # Gate F already failed it
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
        d, t = profile.decode, profile.ttft
        results += [
            _limit(
                "decode.fit_mape",
                e.name,
                "decode fit MAPE",
                "profiles.max_decode_fit_mape",
                d.fit_mape,
                limits.max_decode_fit_mape,
            ),
            _limit(
                "decode.cv_mape",
                e.name,
                "leave-one-cell-out decode MAPE",
                "profiles.max_decode_cv_mape",
                d.cv_mape,
                limits.max_decode_cv_mape,
            ),
            _limit(
                "prefill.mean_error",
                e.name,
                "TTFT fit mean error",
                "the prefill bound",
                t.mean_error,
                DEFAULT_MAX_MEAN_ERROR,
            ),
            _limit(
                "prefill.worst_error",
                e.name,
                "TTFT fit worst-point error",
                "the prefill bound",
                t.worst_error,
                DEFAULT_MAX_WORST_ERROR,
            ),
        ]
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
