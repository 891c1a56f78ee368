"""Refit: new TTFT curves from a saved sidecar, written as a new pair.

The TTFT curve of each engine is refitted with the median-based fitter (the median of
the saved repeats at each exact length), the measured decode model and KV capacity are
copied unchanged, and the result is a new pair at ``--out``; the original pair is never
written. Refit needs samples bound to engine generations and a profile snapshot for
every configured engine; sidecars without them (earlier profilers) are refused with a
request to sweep the current engine processes afresh.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from narwhal.config import FleetConfig, converter, parse_as
from narwhal.engines.client import EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile.derive import derive_ttft, prefill_queue, prefill_repeats, ttft_curve
from narwhal.profile.fit import (
    DEFAULT_MAX_MEAN_ERROR,
    DEFAULT_MAX_WORST_ERROR,
    median_by_length,
)
from narwhal.profile.progress import Progress
from narwhal.profile.runner import (
    EngineOutcome,
    ProfileRun,
    check_output,
    now_iso,
    select_engines,
    software_identity,
    write_pair,
)
from narwhal.profile.store import (
    SAMPLES_KIND,
    SCHEMA_VERSION,
    EngineProfile,
    file_sha256,
    pair_paths,
    read_json,
)

__all__ = ["refit_pair"]

T = TypeVar("T")

_FRESH = "run a fresh sweep (narwhal profile) against the current engine processes"


def _refuse(message: str, source: str, path: str) -> ConfigError:
    return ConfigError(f"{message}; {_FRESH}", path=path, source=source)


def _read(read: Callable[[Mapping[str, Any], str], T], entry: Mapping[str, Any], name: str, source: str) -> T:
    """What ``read`` finds in engine ``name``'s sidecar entry; a malformed record is
    refused with the sidecar's JSON path."""
    try:
        return read(entry, f"$.engines.{name}")
    except ConfigError as exc:
        raise _refuse(f"{exc.reason} for engine {name!r}", source, exc.path) from None


def _parse(cl: type[T], obj: Any, source: str, where: str) -> T:
    """``obj`` (found at ``where`` in the sidecar) as ``cl``; a malformed one is refused
    with the sidecar's JSON path of its first invalid value."""
    try:
        return parse_as(cl, obj)
    except ConfigError as exc:  # its reason, at its path in the sidecar
        raise _refuse(exc.reason, source, where + exc.path.removeprefix("$")) from None


def _bound_snapshot(entry: Any, engine_url: str, name: str, source: str) -> EngineProfile:
    """The engine's profile snapshot, checked against its generation binding."""
    where = f"$.engines.{name}"
    if not isinstance(entry, Mapping):
        raise _refuse(f"the samples hold nothing for configured engine {name!r}", source, where)
    raw_identity = entry.get("identity")
    if not isinstance(raw_identity, Mapping):
        raise _refuse(f"the samples of engine {name!r} are not bound to an engine generation",
                      source, f"{where}.identity")  # fmt: skip
    identity = _parse(EngineIdentity, raw_identity, source, f"{where}.identity")
    if identity.url != engine_url:
        raise _refuse(f"the samples of engine {name!r} were taken at {identity.url}, the fleet "
                      f"has it at {engine_url}", source, f"{where}.identity.url")  # fmt: skip
    snapshot = entry.get("profile")
    if not isinstance(snapshot, Mapping):
        status = entry.get("status")
        raise _refuse(f"the samples hold no profile snapshot for engine {name!r} "
                      f"(status {status!r})", source, f"{where}.profile")  # fmt: skip
    profile = _parse(EngineProfile, snapshot, source, f"{where}.profile")
    if profile.identity != identity:
        raise _refuse(f"the profile snapshot of engine {name!r} is bound to another generation "
                      "than its samples", source, f"{where}.profile.identity")  # fmt: skip
    return profile


def refit_pair(
    config: FleetConfig,
    samples_file: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    engines: Sequence[str] | None = None,
    max_mean_error: float = DEFAULT_MAX_MEAN_ERROR,
    max_worst_error: float = DEFAULT_MAX_WORST_ERROR,
    progress: Progress | None = None,
) -> ProfileRun:
    """Refit the TTFT curves of a saved sidecar and write a new pair at ``out``.

    Raises:
        ConfigError: the sidecar is unreadable, from an earlier profiler, unbound, lacks
            an engine's profile snapshot, or ``out`` names the original pair or an
            existing pair without ``overwrite``.
    """
    progress = progress if progress is not None else Progress()
    source = os.fspath(samples_file)
    profiles_path, samples_path = pair_paths(out)
    obj = read_json(source, "samples file")
    if not isinstance(obj, dict) or obj.get("kind") != SAMPLES_KIND:
        raise _refuse("not a narwhal profile samples file", source, "$.kind")
    # The original sidecar, and the profiles file it names: an --out whose pair holds
    # either. (Its own name's profiles file, x.json beside x.samples.json, needs no entry:
    # an --out of x.json or x pairs it with x.samples.json, the original.)
    original = Path(source).resolve()
    protected = {original}
    if isinstance(obj.get("profiles"), str):
        protected.add(original.with_name(obj["profiles"]))
    if {profiles_path.resolve(), samples_path.resolve()} & protected:
        raise ConfigError(f"--out {os.fspath(out)} would overwrite the original pair; a refit "
                          "writes a new pair (e.g. runs/profiles-refit.json)")  # fmt: skip
    if obj.get("schema_version") != SCHEMA_VERSION:
        raise _refuse(f"samples schema_version {obj.get('schema_version')!r} predates "
                      "generation-bound samples", source, "$.schema_version")  # fmt: skip
    entries = obj.get("engines")
    if not isinstance(entries, Mapping):
        raise _refuse("the samples hold no engines", source, "$.engines")
    selected = select_engines(config, engines)
    snapshots = {e.name: _bound_snapshot(entries.get(e.name), e.url, e.name, source)
                 for e in selected}  # fmt: skip
    repeats = {e.name: _read(prefill_repeats, entries[e.name], e.name, source) for e in selected}
    check_output(out, overwrite=overwrite)

    # The sidecar as read (this refit's own parse of the file, read by nothing else) is
    # edited into the new one; the file itself is never written.
    new = obj
    new["created_at"] = now_iso()
    new["software"] = software_identity()
    new["profiles"] = profiles_path.name
    new["refit"] = {"from": source, "sha256": file_sha256(source),
                    "fitter": "TTFT curve fitted to the median of the repeats at each exact "
                              "length; decode model and KV capacity copied"}  # fmt: skip
    new["engines"] = {e.name: entries[e.name] for e in selected}
    new["fleet"] = dict(obj.get("fleet") or {}) | {"engines": [e.name for e in selected]}
    outcomes: list[EngineOutcome] = []
    for e in selected:
        entry = new["engines"][e.name]
        medians = median_by_length(repeats[e.name])
        derived = derive_ttft(repeats[e.name])
        fit = derived.fit
        prefill = entry["prefill"]
        prefill["fit_before_refit"] = prefill.get("fit")
        prefill["medians"] = [
            {"length": n, "ttft_s": m, "repeats": sum(1 for length, _ in repeats[e.name]
                                                       if length == n)}
            for n, m in medians.items()
        ]  # fmt: skip
        prefill["fit"] = fit.as_dict()
        prefill["intervals"] = derived.intervals.as_dict()
        rejection = derived.rejection(max_mean_error=max_mean_error,
                                      max_worst_error=max_worst_error)  # fmt: skip
        if rejection is not None:
            prefill["rejection"] = rejection
            entry.update(status="rejected", reason=f"refitted TTFT curve rejected: {rejection}")
            del entry["profile"]  # the snapshot checked above: the curve it held is refused
            outcomes.append(EngineOutcome(e.name, "rejected", entry["reason"]))
            progress.warn(e.name, entry["reason"])
            continue
        # The burst probe's verdict is read against the curve: derived again with it.
        curve = ttft_curve(derived)
        queue = _read(functools.partial(prefill_queue, curve=curve), entry, e.name, source)
        profile = attrs.evolve(snapshots[e.name], ttft=curve, prefill_queue=queue)
        entry.update(status="ok", reason=None, profile=converter.unstructure(profile))
        outcomes.append(EngineOutcome(e.name, "ok", None, profile))
        progress.line(e.name, f"refitted TTFT = {fit.a:.4g} + {fit.b:.4g}*L + {fit.c:.4g}*L^2 s "
                              f"(mean error {fit.mean_error:.1%}, worst {fit.worst_error:.1%}); "
                              "decode model copied")  # fmt: skip
    wrote = write_pair(profiles_path, samples_path, new, outcomes, refit_of=source)
    return ProfileRun(profiles_path, samples_path, tuple(outcomes), wrote)
