"""Pictures (optional extra ``[plot]``, matplotlib): profile fits and bench latencies.

- :func:`plot_profile`: per engine, the TTFT fit over every prefill repeat and the
  per-length medians, and the decode fit against the cell medians (TPOT against active
  requests, one series per input length, fitted values beside the measured ones).
- :func:`plot_bench`: CDFs of TTFT and TPOT over the scored requests, with the SLO
  line; failed requests count as misses (the curve tops out below 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["PlotUnavailable", "plot_bench", "plot_profile"]


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


def plot_profile(samples_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write ``<engine>.ttft.png`` and ``<engine>.decode.png`` for each profiled engine."""
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
