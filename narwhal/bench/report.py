"""The summary of a result set: SLO attainment, goodput, percentiles, classes, lag.

Every scored request is in the denominator: a refused or failed request counts as a
request that missed the SLO. A request meets the SLO when it succeeded, its TTFT is
within ``--slo-ttft`` and its TPOT within ``--slo-tpot``; a success with one token has
no TPOT and cannot miss the TPOT target. Goodput is the number of scored requests
that met the SLO per second of run (run start to the last terminal outcome).

Percentiles (p50/p90/p99, linear interpolation) are given twice: over successes, and
over every scored request with each failure counted as a miss (an infinite value,
shown as ``"miss"``), so that a failing fleet cannot look fast.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from narwhal import __version__
from narwhal.bench.mix import Stream
from narwhal.bench.records import ACCOUNTING, SCORED_CLASSES, TERMINAL_CLASSES, RequestResult

__all__ = [
    "MISS",
    "SLO",
    "SUMMARY_SCHEMA",
    "distribution",
    "format_seconds",
    "percentile",
    "render_summary",
    "summarize",
]

SUMMARY_SCHEMA: Final = "narwhal.bench.summary/1"
#: How a percentile that falls on a failure is written.
MISS: Final = "miss"
_QUANTILES: Final = (50, 90, 99)


@attrs.frozen
class SLO:
    """Latency targets, in seconds (None: no target), and the attainment target."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    attainment: float = 0.99

    def meets_ttft(self, rec: RequestResult) -> bool:
        """Success within the TTFT target."""
        return rec.ok and (self.ttft_s is None or (rec.ttft_s is not None and rec.ttft_s <= self.ttft_s))

    def meets_tpot(self, rec: RequestResult) -> bool:
        """Success within the TPOT target (no TPOT: one token, nothing to miss)."""
        return rec.ok and (self.tpot_s is None or rec.tpot_s is None or rec.tpot_s <= self.tpot_s)

    def meets(self, rec: RequestResult) -> bool:
        """Success within both targets."""
        return self.meets_ttft(rec) and self.meets_tpot(rec)

    def to_json(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "attainment": self.attainment}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of sorted ``values`` (linear interpolation; inf allowed)."""
    if not values:
        return None
    rank = (len(values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(values) - 1)
    frac = rank - lo
    if frac == 0 or values[lo] == values[hi]:
        return values[lo]
    if math.isinf(values[hi]):
        return math.inf
    return values[lo] + (values[hi] - values[lo]) * frac


def _json_number(value: float | None) -> float | str | None:
    if value is None:
        return None
    return MISS if math.isinf(value) else value


def distribution(values: Sequence[float], *, misses: int | None = None) -> dict[str, Any]:
    """``n``, mean (or ``misses``), p50/p90/p99 and max of ``values`` (``misses`` add inf)."""
    ordered = sorted(values)
    if misses is not None:
        ordered += [math.inf] * misses
    out: dict[str, Any] = {"n": len(ordered)}
    if misses is None:
        out["mean"] = sum(ordered) / len(ordered) if ordered else None
    else:
        out["misses"] = misses
    for q in _QUANTILES:
        out[f"p{q}"] = _json_number(percentile(ordered, q))
    out["max"] = _json_number(ordered[-1]) if ordered else None
    return out


def _ratio(met: int, denominator: int) -> dict[str, Any]:
    return {"met": met, "ratio": met / denominator if denominator else None}


def summarize(
    records: Sequence[RequestResult],
    *,
    slo: SLO,
    duration_s: float,
    run: Mapping[str, Any],
    workload: Mapping[str, Any],
    late_after_s: float = 0.05,
    streams: Sequence[Stream] = (),
) -> dict[str, Any]:
    """The summary JSON of a result set (see the module docstring); with the ``streams``
    of a mix, each request is scored against its stream's targets, and ``groups`` gives
    the attainment of every stream, tenant and class."""
    scored = [r for r in records if r.scored]
    ok = [r for r in scored if r.ok]
    failed = len(scored) - len(ok)
    denominator = len(scored)
    by_class = Counter(r.terminal_class for r in scored)
    unscored = Counter(("warmup" if r.warmup else r.terminal_class) for r in records if not r.scored)

    attainment: dict[str, Any] = {"denominator": denominator}
    attainment["ttft"] = _ratio(sum(slo.meets_ttft(r) for r in scored), denominator) if slo.ttft_s is not None else None
    attainment["tpot"] = _ratio(sum(slo.meets_tpot(r) for r in scored), denominator) if slo.tpot_s is not None else None
    met_both = sum(slo.meets(r) for r in scored)
    attainment["both"] = _ratio(met_both, denominator)
    both_ratio = attainment["both"]["ratio"]
    held: bool | None = None
    if (slo.ttft_s is not None or slo.tpot_s is not None) and both_ratio is not None:
        held = both_ratio >= slo.attainment

    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    started = [r for r in records if r.actual_s is not None]
    lags = [r.lag_s for r in started if r.lag_s is not None]
    cap_waits = [r.cap_wait_s for r in started if r.cap_wait_s is not None]
    output_tokens = sum(r.output_len for r in scored)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)

    out: dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "narwhal_version": __version__,
        "run": dict(run),
        "workload": dict(workload),
        "accounting": dict(ACCOUNTING),
        "terminal_classes": list(TERMINAL_CLASSES),
        "scored_classes": list(SCORED_CLASSES),
        "slo": slo.to_json(),
        "counts": {
            "scheduled": len(records),
            "started": len(started),
            "scored": denominator,
            "ok": len(ok),
            "failed": failed,
            "by_class": dict(sorted(by_class.items())),
            "unscored": dict(sorted(unscored.items())),
        },
        "attainment": attainment,
        "slo_held": held,
        "duration_s": duration_s,
        "goodput_rps": per_s(met_both),
        "throughput": {"requests_per_s": per_s(len(ok)), "output_tokens_per_s": per_s(output_tokens)},
        "ttft_s": {"successes": distribution(ttfts), "with_failures": distribution(ttfts, misses=failed)},
        "tpot_s": {"successes": distribution(tpots), "with_failures": distribution(tpots, misses=failed)},
        "latency_s": {"successes": distribution([r.latency_s for r in ok if r.latency_s is not None])},
        "lag_s": {
            **distribution(lags),
            "late": sum(lag > late_after_s for lag in lags),
            "late_after_s": late_after_s,
            "cap_wait_s": distribution(cap_waits),
        },
        "tokens": {
            "requested_output": sum(r.requested_output_len for r in scored),
            "output": output_tokens,
            "short_outputs": sum(r.output_len < r.requested_output_len for r in ok),
            "prompt_tokens_reported": sum(r.prompt_tokens or 0 for r in scored),
            "empty_text_tokens": sum(r.empty_text_tokens for r in scored),
            "events_without_ids": sum(r.events_without_ids for r in scored),
        },
    }
    if streams:
        out["streams"] = [s.to_json() for s in streams]
        out["groups"] = _groups(scored, streams, slo.attainment)
    return out


def _groups(scored: Sequence[RequestResult], streams: Sequence[Stream], target: float) -> dict[str, Any]:
    """Attainment per stream, tenant and class, each request against its stream's targets."""
    slos = {s.name: SLO(ttft_s=s.slo_ttft_s, tpot_s=s.slo_tpot_s, attainment=target) for s in streams}
    out: dict[str, Any] = {}
    for key in ("stream", "tenant", "latency_class"):
        members: dict[str, list[RequestResult]] = {}
        for r in scored:
            label = getattr(r, key)
            if label is not None:
                members.setdefault(label, []).append(r)
        out[key] = {label: _group(rows, slos) for label, rows in members.items()}
    return out


def _group(rows: Sequence[RequestResult], slos: Mapping[str, SLO]) -> dict[str, Any]:
    none = SLO()
    met = sum(slos.get(r.stream or "", none).meets(r) for r in rows)
    ok = [r for r in rows if r.ok]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    tpots = sorted(r.tpot_s for r in ok if r.tpot_s is not None)
    return {
        "denominator": len(rows), "met": met, "attainment": met / len(rows) if rows else None, "ok": len(ok),
        "by_class": dict(sorted(Counter(r.terminal_class for r in rows).items())),
        "ttft_s": {"p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90)},
        "tpot_s": {"p50": percentile(tpots, 50), "p90": percentile(tpots, 90)},
    }  # fmt: skip


# --------------------------------------------------------------------------- the table


def format_seconds(value: Any) -> str:
    """A latency for the table: milliseconds below 10 s, ``miss``, or ``-``."""
    if value is None:
        return "-"
    if value == MISS:
        return MISS
    seconds = float(value)
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def _rate(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.2f} {unit}"


def _workload_line(w: Mapping[str, Any]) -> str:
    if w.get("kind") == "mix":
        return f"mix {w.get('path')} ({w.get('num_requests')} requests in {w.get('streams')} streams)"
    if w.get("kind") == "trace":
        return f"trace {w.get('path')} ({w.get('num_requests')} requests)"
    rate = w.get("rate")
    arrival = w.get("arrival")
    shape = f" burstiness {w.get('burstiness')}" if arrival == "gamma" else ""
    limits = []
    if w.get("num_requests") is not None:
        limits.append(f"{w['num_requests']} requests")
    if w.get("duration_s") is not None:
        limits.append(f"{w['duration_s']:g} s")
    return (
        f"{arrival}{shape} at {rate} req/s, {' or '.join(limits)}, input {w.get('input_len')}, "
        f"output {w.get('output_len')}, seed {w.get('seed')}"
    )


def _row(label: str, dist: Mapping[str, Any], *, mean: bool = True) -> str:
    cells = [format_seconds(dist.get("mean")) if mean else ""]
    cells += [format_seconds(dist.get(f"p{q}")) for q in _QUANTILES]
    cells.append(format_seconds(dist.get("max")))
    return f"  {label:<22}{dist.get('n', 0):>7}" + "".join(f"{c:>12}" for c in cells)


def render_summary(summary: Mapping[str, Any]) -> str:
    """The readable table printed at the end of a run."""
    run, counts, slo, att = summary["run"], summary["counts"], summary["slo"], summary["attainment"]
    lines = [
        f"narwhal bench {run.get('run_id', '')}: {run.get('url', '')} {run.get('route', '')} "
        f"model {run.get('model', '')}",
        f"  workload     {_workload_line(summary['workload'])}",
        f"  accounting   {summary['accounting']['rule']}: output counted by token id; "
        "refused and failed requests in the denominator",
    ]
    if run.get("interrupted"):
        lines.append("  INTERRUPTED  the run was stopped; unstarted and cut requests are client_cancelled")
    unscored = ", ".join(f"{k} {v}" for k, v in counts["unscored"].items())
    lines.append(
        f"  requests     {counts['scheduled']} scheduled, {counts['scored']} scored (denominator), "
        f"{counts['ok']} ok, {counts['failed']} failed" + (f"; not scored: {unscored}" if unscored else "")
    )
    classes = ", ".join(f"{k} {v}" for k, v in counts["by_class"].items()) or "-"
    lines.append(f"  classes      {classes}")
    targets = []
    if slo["ttft_s"] is not None:
        targets.append(f"TTFT <= {format_seconds(slo['ttft_s'])}")
    if slo["tpot_s"] is not None:
        targets.append(f"TPOT <= {format_seconds(slo['tpot_s'])}")
    if targets:
        parts = [f"{name} {_pct(att[name.lower()]['ratio'])}" for name in ("TTFT", "TPOT") if att[name.lower()]]
        verdict = "HELD" if summary["slo_held"] else "NOT MET"
        lines.append(f"  SLO          {' and '.join(targets)} for {_pct(slo['attainment'])} of scored requests")
        lines.append(
            f"  attainment   {', '.join(parts)}, both {_pct(att['both']['ratio'])} "
            f"({att['both']['met']}/{att['denominator']})  ->  SLO {verdict}"
        )
    else:
        lines.append("  SLO          none given (--slo-ttft, --slo-tpot): goodput counts every success")
    tp = summary["throughput"]
    lines.append(
        f"  goodput      {_rate(summary['goodput_rps'], 'req/s')}; throughput "
        f"{_rate(tp['requests_per_s'], 'req/s')}, {_rate(tp['output_tokens_per_s'], 'tok/s')}; "
        f"duration {summary['duration_s']:.2f} s"
    )
    header = f"  {'':<22}{'n':>7}" + "".join(f"{h:>12}" for h in ("mean", "p50", "p90", "p99", "max"))
    lines += ["", header]
    lines.append(_row("TTFT (successes)", summary["ttft_s"]["successes"]))
    lines.append(_row("TTFT (failures=miss)", summary["ttft_s"]["with_failures"], mean=False))
    lines.append(_row("TPOT (successes)", summary["tpot_s"]["successes"]))
    lines.append(_row("TPOT (failures=miss)", summary["tpot_s"]["with_failures"], mean=False))
    lines.append(_row("latency (successes)", summary["latency_s"]["successes"]))
    lag = summary["lag_s"]
    lines.append(_row("client lag", lag))
    if lag["cap_wait_s"]["n"] and (lag["cap_wait_s"]["max"] or 0) > 0:
        lines.append(_row("  of which cap wait", lag["cap_wait_s"]))
    if lag["late"]:
        lines.append(
            f"  WARNING      {lag['late']} requests started more than {format_seconds(lag['late_after_s'])} "
            "after their scheduled time: the client did not offer the scheduled load"
        )
    groups = summary.get("groups")
    if groups:
        lines += ["", f"  {'':<24}{'n':>7}{'met':>7}{'attainment':>12}{'ttft p50':>11}{'ttft p90':>11}  classes"]
        for key, title in (("stream", "stream"), ("tenant", "tenant"), ("latency_class", "class")):
            for label, g in groups[key].items():
                classes = ", ".join(f"{k} {v}" for k, v in g["by_class"].items())
                lines.append(
                    f"  {f'{title} {label}':<24}{g['denominator']:>7}{g['met']:>7}{_pct(g['attainment']):>12}"
                    f"{format_seconds(g['ttft_s']['p50']):>11}{format_seconds(g['ttft_s']['p90']):>11}  {classes}"
                )
    tokens = summary["tokens"]
    if tokens["events_without_ids"]:
        lines.append(
            f"  WARNING      {tokens['events_without_ids']} events carried output without token ids "
            "(counted one per choice): the server ignored return_token_ids"
        )
    if tokens["short_outputs"]:
        lines.append(f"  note         {tokens['short_outputs']} successes ended before the requested output length")
    return "\n".join(lines)
