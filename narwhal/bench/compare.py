"""``narwhal bench compare A B``: deltas between two result sets, only when comparable.

Two result sets are comparable when they count the same way and over the same
requests: the same stream-accounting rule, the same terminal-class vocabulary and
scored classes, the same denominator (number of scored requests) and the same SLO
targets. Anything else is reported, precisely, as the reason not to compare; no
deltas are printed then. Differences that do not change how the figures are counted
(the workload, the model, how many requests ended in each class) are noted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from narwhal.bench.records import SUMMARY_FILE
from narwhal.bench.report import MISS, SUMMARY_SCHEMA, format_seconds

__all__ = ["Comparison", "compare_summaries", "load_summary", "render_comparison"]


def load_summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a summary file, or the one inside a run directory.

    Raises:
        ValueError: the file is not a bench summary.
        OSError: the file cannot be read.
    """
    p = Path(path)
    if p.is_dir():
        p = p / SUMMARY_FILE
    with open(p, encoding="utf-8") as fh:
        try:
            obj = json.load(fh)
        except ValueError as exc:
            raise ValueError(f"{p}: not JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("schema") != SUMMARY_SCHEMA:
        raise ValueError(f"{p}: not a {SUMMARY_SCHEMA} summary")
    return obj


@attrs.frozen
class Comparison:
    """The outcome of comparing result set A with B.

    Attributes:
        comparable: whether deltas mean anything.
        reasons: why not, one precise sentence each.
        notes: differences that leave the sets comparable.
        rows: ``(metric, a, b, delta)`` with the delta as B - A (None when undefined).
        kinds: for each row, ``ratio``, ``seconds``, ``rate`` or ``count``.
    """

    comparable: bool
    reasons: list[str]
    notes: list[str]
    rows: list[tuple[str, Any, Any, float | None]]
    kinds: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "comparable": self.comparable,
            "reasons": self.reasons,
            "notes": self.notes,
            "rows": [
                {"metric": m, "a": a, "b": b, "delta": d, "kind": k}
                for (m, a, b, d), k in zip(self.rows, self.kinds, strict=True)
            ],
        }


def _slo_text(slo: Mapping[str, Any]) -> str:
    parts = [f"TTFT <= {slo.get('ttft_s')} s", f"TPOT <= {slo.get('tpot_s')} s", f"target {slo.get('attainment')}"]
    return ", ".join(parts)


def _denominator_text(s: Mapping[str, Any]) -> str:
    c = s["counts"]
    unscored = ", ".join(f"{k} {v}" for k, v in c["unscored"].items()) or "none"
    return f"{c['scored']} scored of {c['scheduled']} scheduled (not scored: {unscored})"


def _reasons(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    reasons: list[str] = []
    acc_a, acc_b = a["accounting"], b["accounting"]
    if acc_a.get("rule") != acc_b.get("rule"):
        reasons.append(f"stream-accounting rules differ: A uses {acc_a.get('rule')}, B uses {acc_b.get('rule')}")
    elif acc_a != acc_b:
        keys = sorted(k for k in set(acc_a) | set(acc_b) if acc_a.get(k) != acc_b.get(k))
        reasons.append(f"stream-accounting rule {acc_a.get('rule')} is defined differently in A and B: {', '.join(keys)}")
    for key, what in (("terminal_classes", "terminal classes"), ("scored_classes", "scored terminal classes")):
        set_a, set_b = set(a[key]), set(b[key])
        if set_a != set_b:
            only_a = ", ".join(sorted(set_a - set_b)) or "none"
            only_b = ", ".join(sorted(set_b - set_a)) or "none"
            reasons.append(f"{what} differ: only in A: {only_a}; only in B: {only_b}")
    if a["counts"]["scored"] != b["counts"]["scored"]:
        reasons.append(f"denominators differ: A has {_denominator_text(a)}; B has {_denominator_text(b)}")
    if a["slo"] != b["slo"]:
        reasons.append(f"SLO targets differ: A {_slo_text(a['slo'])}; B {_slo_text(b['slo'])}")
    return reasons


def _notes(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    notes: list[str] = []
    wa, wb = a.get("workload", {}), b.get("workload", {})
    changed = sorted(k for k in set(wa) | set(wb) if wa.get(k) != wb.get(k))
    if changed:
        notes.append("workloads differ in " + ", ".join(f"{k} ({wa.get(k)} vs {wb.get(k)})" for k in changed))
    for key in ("url", "urls", "route", "model"):
        if a["run"].get(key) != b["run"].get(key):
            notes.append(f"{key} differs: A {a['run'].get(key)}, B {b['run'].get(key)}")
    oa, ob = a["run"].get("options") or {}, b["run"].get("options") or {}
    changed = sorted(k for k in set(oa) | set(ob) if oa.get(k) != ob.get(k))
    if changed:
        notes.append("run options differ in " + ", ".join(f"{k} ({oa.get(k)} vs {ob.get(k)})" for k in changed))
    if a["run"].get("interrupted") or b["run"].get("interrupted"):
        notes.append("a run was interrupted: its unstarted requests are not scored")
    if a["counts"]["by_class"] != b["counts"]["by_class"]:
        notes.append("the terminal outcomes differ (see the class rows)")
    return notes


def _num(value: Any) -> float | None:
    if value is None or value == MISS or isinstance(value, bool):
        return None
    return float(value)


def compare_summaries(a: Mapping[str, Any], b: Mapping[str, Any]) -> Comparison:
    """Compare summary A with summary B (deltas are B - A)."""
    reasons = _reasons(a, b)
    rows: list[tuple[str, Any, Any, float | None]] = []
    kinds: list[str] = []

    def add(metric: str, va: Any, vb: Any, kind: str) -> None:
        na, nb = _num(va), _num(vb)
        rows.append((metric, va, vb, nb - na if na is not None and nb is not None else None))
        kinds.append(kind)

    if not reasons:
        for name in ("ttft", "tpot", "both"):
            ra, rb = a["attainment"].get(name), b["attainment"].get(name)
            if ra is not None and rb is not None:
                add(f"attainment {name}", ra["ratio"], rb["ratio"], "ratio")
        add("goodput", a["goodput_rps"], b["goodput_rps"], "rate")
        add("throughput", a["throughput"]["requests_per_s"], b["throughput"]["requests_per_s"], "rate")
        add("output tokens/s", a["throughput"]["output_tokens_per_s"], b["throughput"]["output_tokens_per_s"], "rate")
        for metric in ("ttft_s", "tpot_s"):
            label = metric[:4].upper()
            for variant, tag in (("successes", "ok"), ("with_failures", "all")):
                for q in ("p50", "p90", "p99"):
                    add(f"{label} {q} ({tag})", a[metric][variant][q], b[metric][variant][q], "seconds")
        add("client lag p99", a["lag_s"]["p99"], b["lag_s"]["p99"], "seconds")
        add("late starts", a["lag_s"]["late"], b["lag_s"]["late"], "count")
        add("ok", a["counts"]["ok"], b["counts"]["ok"], "count")
        for cls in sorted(set(a["counts"]["by_class"]) | set(b["counts"]["by_class"])):
            if cls != "ok":
                add(f"class {cls}", a["counts"]["by_class"].get(cls, 0), b["counts"]["by_class"].get(cls, 0), "count")
    return Comparison(not reasons, reasons, _notes(a, b), rows, kinds)


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if value == MISS:
        return MISS
    if kind == "ratio":
        return f"{float(value) * 100:.1f}%"
    if kind == "seconds":
        return format_seconds(value)
    if kind == "rate":
        return f"{float(value):.2f}/s"
    return str(value)


def _delta(a: Any, delta: float | None, kind: str) -> str:
    if delta is None:
        return "n/a"
    if kind == "ratio":
        return f"{delta * 100:+.1f} pt"
    if kind == "count":
        return f"{delta:+.0f}"
    text = f"{delta * 1000:+.1f} ms" if kind == "seconds" else f"{delta:+.2f}/s"
    base = _num(a)
    if base:
        text += f" ({delta / base * 100:+.1f}%)"
    return text


def render_comparison(cmp: Comparison, label_a: str, label_b: str) -> str:
    """The comparison as text: the reasons it is refused, or the deltas."""
    lines = [f"A: {label_a}", f"B: {label_b}"]
    if not cmp.comparable:
        lines.append("not comparable:")
        lines += [f"  - {reason}" for reason in cmp.reasons]
    lines += [f"note: {note}" for note in cmp.notes]
    if cmp.comparable:
        lines.append(f"  {'metric':<22}{'A':>14}{'B':>14}  {'B - A':<20}")
        for (metric, a, b, delta), kind in zip(cmp.rows, cmp.kinds, strict=True):
            lines.append(f"  {metric:<22}{_cell(a, kind):>14}{_cell(b, kind):>14}  {_delta(a, delta, kind):<20}")
    return "\n".join(lines)
