"""Run-to-run stability: the same sweep repeated, each fitted figure compared across runs.

``narwhal profile --repeat N`` profiles the selected engines N times in a row. Run 1
is the pair at ``--out``; run k (k >= 2) is a full pair beside it,
``<stem>.run<k>.json`` with its sidecar, each verifiable by ``narwhal check`` on its
own. Then :func:`stability` compares every fitted figure of each engine across the
runs and writes ``<stem>.stability.json``::

    {"kind": "narwhal.profile-stability", "runs": ["profiles.json", ...],
     "engines": {"e0": {"runs_ok": 3, "figures": {
         "ttft.a": {"values": [...], "mean": m, "sd": s, "cv": s/|m|, "spread": (max-min)/|m|},
         "ttft_at.1024": {...}, "tpot_at.8x40000": {...}, ...}}}}

Figures: the coefficients (``ttft.a|b|c``, ``decode.c0|c1|c2``), the error figures
(``ttft.mean_error``, ``ttft.loo_mean_error``, ``decode.fit_mape``, ``decode.cv_mape``),
the predictions at the operating points of run 1 (``ttft_at.<L>`` for every swept
length, ``tpot_at.<active>x<kv>`` for every decode cell), and the KV capacity; for an
engine with a cached-prefix model, its coefficients (``prefix.a|b|c|d``), errors
(``prefix.mean_error``, ``prefix.loo_mean_error``) and predictions with half of every
swept length cached, in whole blocks (``prefix_at.<L>x<k>``). The
predictions are the figures to judge stability by: coefficients of a quadratic trade
against one another, so they scatter more than the curve does. ``cv`` is the sample
standard deviation over the mean (``sd`` with N-1; zero with one run).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import httpx

from narwhal.config import FleetConfig
from narwhal.profile.progress import Progress
from narwhal.profile.runner import ProfileRun, ProfileSettings, check_output, run_profile
from narwhal.profile.store import EngineProfile, pair_paths, read_json, write_json

__all__ = [
    "STABILITY_KIND",
    "engine_figures",
    "profile_repeatedly",
    "run_paths",
    "stability",
    "stability_lines",
]

STABILITY_KIND: Final = "narwhal.profile-stability"


def run_paths(out: str, runs: int) -> list[Path]:
    """The profiles file of each run: ``out`` first, then ``<stem>.run<k>.json``."""
    path = Path(out)
    stem = path.name[: -len(".json")] if path.name.endswith(".json") else path.name
    return [path] + [path.with_name(f"{stem}.run{k}.json") for k in range(2, runs + 1)]


def stability_path(out: str) -> Path:
    path, _ = pair_paths(out)
    stem = path.name[: -len(".json")] if path.name.endswith(".json") else path.name
    return path.with_name(f"{stem}.stability.json")


def engine_figures(
    profile: EngineProfile,
    lengths: Sequence[float],
    cells: Sequence[tuple[float, float]],
) -> dict[str, float]:
    """The figures of one profile compared across runs (see the module docstring)."""
    t = profile.ttft
    out = {"ttft.a": t.a, "ttft.b": t.b, "ttft.c": t.c, "ttft.mean_error": t.mean_error}
    if t.loo_mean_error is not None:
        out["ttft.loo_mean_error"] = t.loo_mean_error
    for n in lengths:
        out[f"ttft_at.{n:g}"] = t.predict(n)
    d = profile.decode
    if d is not None:
        out |= {"decode.c0": d.c0, "decode.c1": d.c1, "decode.c2": d.c2,
                "decode.fit_mape": d.fit_mape, "decode.cv_mape": d.cv_mape}  # fmt: skip
        for a, k in cells:
            out[f"tpot_at.{a:g}x{k:.0f}"] = d.predict(a, k)
    if profile.kv_capacity is not None:
        out["kv_capacity.tokens"] = float(profile.kv_capacity.tokens)
    m = profile.cached_prefill
    if m is not None:
        out |= {"prefix.a": m.a, "prefix.b": m.b, "prefix.c": m.c, "prefix.d": m.d,
                "prefix.mean_error": m.mean_error, "prefix.loo_mean_error": m.loo_mean_error}  # fmt: skip
        for n in lengths:
            k = n // (2 * m.block_size) * m.block_size  # at most half: a token is left to compute
            if k > 0:
                out[f"prefix_at.{n:g}x{k:g}"] = m.predict(n, k)
    return out


def _summary(values: list[float]) -> dict[str, Any]:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    scale = abs(mean)
    return {
        "values": values,
        "mean": mean,
        "sd": sd,
        "cv": sd / scale if scale > 0 else (0.0 if sd == 0 else math.inf),
        "spread": (max(values) - min(values)) / scale if scale > 0 else 0.0,
    }


def stability(
    runs: Sequence[dict[str, EngineProfile | None]],
    operating: dict[str, tuple[list[float], list[tuple[float, float]]]],
    names: Sequence[str],
    files: Sequence[Path],
    out: str,
) -> dict[str, Any]:
    """Compare each engine's figures across ``runs`` (one ``{engine: profile or None}``
    per run) and write ``<stem>.stability.json``; returns the document.

    ``operating`` gives each engine's swept lengths and decode cells (from run 1).
    """
    engines: dict[str, Any] = {}
    for name in names:
        profiles = [r.get(name) for r in runs]
        ok = [p for p in profiles if p is not None]
        lengths, cells = operating.get(name, ([], []))
        per_run = [engine_figures(p, lengths, cells) for p in ok]
        keys = list(dict.fromkeys(k for f in per_run for k in f))
        engines[name] = {
            "runs_ok": len(ok),
            "runs": len(profiles),
            "figures": {k: _summary([f[k] for f in per_run if k in f]) for k in keys},
        }
    doc = {
        "kind": STABILITY_KIND,
        "runs": [p.name for p in files],
        "statistic": "cv = sample standard deviation / mean over the runs; spread = "
        "(max - min) / mean",
        "engines": engines,
    }
    write_json(stability_path(out), doc)
    return doc


async def profile_repeatedly(
    config: FleetConfig,
    settings: ProfileSettings,
    repeat: int,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: Progress | None = None,
    config_source: str | None = None,
) -> tuple[list[ProfileRun], dict[str, Any]]:
    """``--repeat N``: the sweep ``repeat`` times, each run its own pair (run k with
    seed ``settings.seed + k - 1`` when a seed is given), then :func:`stability`.

    Raises:
        ConfigError: a run's pair exists already and ``settings.overwrite`` is not set.
    """
    files = run_paths(settings.out, repeat)
    for path in files[1:]:
        check_output(path, overwrite=settings.overwrite)
    runs: list[ProfileRun] = []
    for k, path in enumerate(files, 1):
        seed = settings.seed + k - 1 if settings.seed is not None else None
        one = attrs.evolve(settings, out=str(path), seed=seed)
        runs.append(await run_profile(config, one, transport=transport, progress=progress,
                                      config_source=config_source))  # fmt: skip
    by_run = [{o.name: o.profile for o in r.outcomes} for r in runs]
    names = [o.name for o in runs[0].outcomes]  # pragma: no mutate (equivalent: every run profiles the same engines in the same order)
    first = read_json(runs[0].samples_path, "samples file")
    operating: dict[str, tuple[list[float], list[tuple[float, float]]]] = {}
    for name in names:
        entry = first["engines"].get(name, {})
        lengths = [float(n) for n in entry.get("prefill", {}).get("effective_lens", [])]
        cells = [(float(c["active"]), float(c["kv_tokens"]))
                 for c in entry.get("decode", {}).get("cell_medians", [])]  # fmt: skip
        operating[name] = (lengths, cells)
    return runs, stability(by_run, operating, names, files, settings.out)


def stability_lines(doc: dict[str, Any]) -> list[str]:
    """One line per engine and figure: ``<engine> <figure> mean .. sd .. cv ..% spread ..%``."""
    lines = []
    for name, entry in doc["engines"].items():
        lines.append(f"  {name}: {entry['runs_ok']} of {entry['runs']} runs profiled")
        for key, s in entry["figures"].items():
            lines.append(f"    {name} {key}: mean {s['mean']:.6g} sd {s['sd']:.3g} "
                         f"cv {s['cv']:.2%} spread {s['spread']:.2%}")  # fmt: skip
    return lines
