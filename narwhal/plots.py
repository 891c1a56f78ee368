"""Pictures (optional extra ``[plot]``, matplotlib): profile fits and bench latencies.

- :func:`plot_profile`: per engine, the TTFT fit over every prefill repeat and the
  per-length medians, and the decode fit against the cell medians (TPOT against active
  requests, one series per input length, fitted values beside the measured ones).
- the cached-prefix model (``cached_prefill``, engines profiled with prefix caching):
  TTFT against the cached length k, one series per prompt length L, every measured
  repeat (k = 0 from the prefill sweep) beside the fitted curve
  ``a + b*(L-k) + c*(L**2 - k**2) + d*k`` over 0..L-1 (:func:`cached_prefill_series`
  is what it draws).
- :func:`plot_bench`: CDFs of TTFT and TPOT over the scored requests, with the SLO
  line; failed requests count as misses (the curve tops out below 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from narwhal.profile.fit import cached_prefill_s

__all__ = ["CachedSeries", "PlotUnavailable", "cached_prefill_series", "plot_bench", "plot_profile"]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("plots need matplotlib: pip install 'narwhal[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@attrs.frozen
class CachedSeries:
    """One prompt length's series of the cached-prefix plot.

    Attributes:
        length: The prompt length L.
        samples: ``(cached k, TTFT s)`` of every measured repeat (k = 0: the prefill sweep's).
        fitted: ``(k, TTFT s)`` of the fitted model, k over 0..L-1 (empty without a fit).
    """

    length: int
    samples: tuple[tuple[int, float], ...]
    fitted: tuple[tuple[float, float], ...]


#: Points of each fitted curve.
_CURVE_POINTS = 50


def cached_prefill_series(engine: dict[str, Any]) -> list[CachedSeries]:
    """The cached-prefix plot's data from one engine's sidecar entry, by prompt length;
    empty where the engine has no cached-prefix sweep."""
    prefix = engine.get("prefix") or {}
    repeats = [r for r in prefix.get("repeats") or () if r.get("ttft_s") is not None]
    if not repeats:
        return []
    plain = (engine.get("prefill") or {}).get("repeats") or ()
    coef = (prefix.get("fit") or {}).get("coefficients")
    out: list[CachedSeries] = []
    for length in sorted({int(r["length"]) for r in repeats}):
        samples = [(0, float(r["ttft_s"])) for r in plain if r.get("length") == length and r.get("ttft_s") is not None]
        samples += [(int(r["cached"]), float(r["ttft_s"])) for r in repeats if r["length"] == length]
        fitted: list[tuple[float, float]] = []
        if coef:
            top = length - 1  # a cache never serves the last prompt token
            for i in range(_CURVE_POINTS + 1):
                k = top * i / _CURVE_POINTS
                fitted.append((k, cached_prefill_s(coef["a"], coef["b"], coef["c"], coef["d"], length, k)))
        out.append(CachedSeries(length, tuple(sorted(samples)), tuple(fitted)))
    return out


def _plot_cached(plt: Any, name: str, engine: dict[str, Any], out: Path) -> Path | None:
    series = cached_prefill_series(engine)
    if not series:
        return None
    fit = (engine.get("prefix") or {}).get("fit") or {}
    rejected = (engine.get("prefix") or {}).get("rejection")
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, s in enumerate(series):
        colour = f"C{i % 10}"
        ax.scatter([k for k, _ in s.samples], [t * 1e3 for _, t in s.samples], s=8, alpha=0.5, color=colour,
                   label=f"L = {s.length}, measured")  # fmt: skip
        if s.fitted:
            ax.plot([k for k, _ in s.fitted], [t * 1e3 for _, t in s.fitted], color=colour, label=f"L = {s.length}, fit")
    ax.set_xlabel("cached prefix tokens k")
    ax.set_ylabel("TTFT (ms)")
    title = f"{name}: prefill with a cached prefix"
    if fit.get("model"):
        title += f"\n{fit['model']}"
    if rejected:
        title += " (rejected)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{name}.prefix.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_profile(samples_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write ``<engine>.ttft.png``, ``<engine>.decode.png`` and, for an engine with a
    cached-prefix sweep, ``<engine>.prefix.png`` for each profiled engine."""
    plt = _pyplot()
    samples = json.loads(Path(samples_path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, engine in samples.get("engines", {}).items():
        prefill = engine.get("prefill") or {}
        repeats = prefill.get("repeats") or []
        medians = prefill.get("medians") or []
        fit = prefill.get("fit") or {}
        if repeats:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.scatter([r["length"] for r in repeats], [r["ttft_s"] * 1e3 for r in repeats], s=8, alpha=0.4,
                       label="repeats")  # fmt: skip
            ax.scatter([m["length"] for m in medians], [m["ttft_s"] * 1e3 for m in medians], marker="D",
                       label="median per length")  # fmt: skip
            coef = fit.get("coefficients")
            if coef:
                top = max(r["length"] for r in repeats)
                xs = [top * i / 100 for i in range(101)]
                ys = [(coef["a"] + coef["b"] * x + coef["c"] * x * x) * 1e3 for x in xs]
                ax.plot(xs, ys, label=f"fit {fit.get('model', '')}")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("TTFT (ms)")
            ax.set_title(f"{name}: prefill")
            ax.legend()
            fig.tight_layout()
            path = out / f"{name}.ttft.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        decode = engine.get("decode") or {}
        cells = decode.get("cell_medians") or []
        dfit = (decode.get("fit") or {}).get("coefficients")
        if cells:
            fig, ax = plt.subplots(figsize=(6, 4))
            for length in sorted({c["input_len"] for c in cells}):
                series = sorted((c for c in cells if c["input_len"] == length), key=lambda c: c["active"])
                ax.plot([c["active"] for c in series], [c["tpot_s"] * 1e3 for c in series], marker="o",
                        linestyle="none", label=f"measured, input {length}")  # fmt: skip
                if dfit:
                    ax.plot(
                        [c["active"] for c in series],
                        [(dfit["c0"] + dfit["c1"] * c["active"] + dfit["c2"] * c["kv_tokens"]) * 1e3 for c in series],
                        linestyle="--", label=f"fit, input {length}",
                    )  # fmt: skip
            ax.set_xlabel("active requests")
            ax.set_ylabel("TPOT (ms)")
            ax.set_title(f"{name}: decode")
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out / f"{name}.decode.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        cached = _plot_cached(plt, name, engine, out)
        if cached is not None:
            written.append(cached)
    return written


def _cdf(ax: Any, values: list[float], misses: int, label: str) -> None:
    total = len(values) + misses
    if total == 0:
        return
    ordered = sorted(values)
    ax.step([v * 1e3 for v in ordered], [(i + 1) / total for i in range(len(ordered))], where="post", label=label)


def plot_bench(results_dir: str | Path, *, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> list[Path]:
    """Write ``ttft-cdf.png`` and ``tpot-cdf.png`` beside a result set's ``results.jsonl``."""
    plt = _pyplot()
    directory = Path(results_dir)
    records = [json.loads(line) for line in (directory / "results.jsonl").read_text().splitlines() if line.strip()]
    scored = [r for r in records if r.get("scored", True)]
    ok = [r for r in scored if r.get("terminal_class") == "ok"]
    failed = len(scored) - len(ok)
    written: list[Path] = []
    for key, slo, title in (("ttft_s", slo_ttft_s, "TTFT"), ("tpot_s", slo_tpot_s, "TPOT")):
        values = [r[key] for r in ok if r.get(key) is not None]
        fig, ax = plt.subplots(figsize=(6, 4))
        _cdf(ax, values, failed, f"{title} ({len(values)} successes, {failed} failed = misses)")
        if slo is not None:
            ax.axvline(slo * 1e3, color="red", linestyle="--", label=f"SLO {slo * 1e3:g} ms")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of scored requests")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
        ax.set_title(f"{title} CDF")
        fig.tight_layout()
        path = directory / f"{key.split('_')[0]}-cdf.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
