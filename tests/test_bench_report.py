"""narwhal.bench.report and .compare: attainment, percentiles with misses, comparability."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from narwhal.bench import (
    ACCOUNTING,
    SLO,
    RequestResult,
    compare_summaries,
    percentile,
    read_results,
    render_comparison,
    render_summary,
    summarize,
    write_results,
)


def _rec(i: int, cls: str = "ok", ttft: float | None = 0.1, tpot: float | None = 0.01, **kw: Any) -> RequestResult:
    fields: dict[str, Any] = {
        "status": 200 if cls in ("ok", "stream_error", "stream_closed") else 503 if cls == "refused" else None,
        "actual_s": float(i),
        "lag_s": 0.0,
        "cap_wait_s": 0.0,
        "output_len": 10 if cls == "ok" else 0,
        "requested_output_len": 10,
        "latency_s": 0.2,
    }
    fields.update(kw)
    return RequestResult(index=i, request_id=f"r{i}", route="completions", scheduled_s=float(i),
                         terminal_class=cls, ttft_s=ttft, tpot_s=tpot, **fields)


def _summary(records: list[RequestResult], slo: SLO | None = None, duration_s: float = 10.0) -> dict[str, Any]:
    return summarize(records, slo=slo or SLO(ttft_s=0.5, tpot_s=0.05), duration_s=duration_s,
                     run={"run_id": "x", "route": "completions", "model": "m"},
                     workload={"kind": "generated", "rate": 1.0, "seed": 0})


def test_percentile_interpolates_and_propagates_misses() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0], 99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, math.inf], 50) == 2.0
    assert percentile([1.0, 2.0, math.inf], 90) == math.inf
    assert percentile([1.0, math.inf, math.inf], 99) == math.inf


def test_attainment_counts_refused_and_failed_in_the_denominator() -> None:
    records = [_rec(i) for i in range(6)]
    records += [_rec(6, ttft=0.9), _rec(7, tpot=0.2)]  # successes that miss a target
    records += [_rec(8, "refused", None, None), _rec(9, "stream_error", 0.1, None)]
    records += [_rec(10, "ok", warmup=True), _rec(11, "client_cancelled", None, None)]
    s = _summary(records)
    assert s["counts"]["scheduled"] == 12 and s["counts"]["scored"] == 10
    assert s["counts"]["unscored"] == {"client_cancelled": 1, "warmup": 1}
    assert s["counts"]["by_class"] == {"ok": 8, "refused": 1, "stream_error": 1}
    att = s["attainment"]
    assert att["denominator"] == 10
    assert att["ttft"] == {"met": 7, "ratio": 0.7}
    assert att["tpot"] == {"met": 7, "ratio": 0.7}
    assert att["both"] == {"met": 6, "ratio": 0.6}
    assert s["slo_held"] is False
    assert s["goodput_rps"] == pytest.approx(0.6)
    assert s["throughput"]["requests_per_s"] == pytest.approx(0.8)
    assert s["ttft_s"]["successes"]["n"] == 8
    assert s["ttft_s"]["with_failures"]["n"] == 10 and s["ttft_s"]["with_failures"]["misses"] == 2
    assert s["ttft_s"]["with_failures"]["p50"] == pytest.approx(0.1)
    assert s["ttft_s"]["with_failures"]["p90"] == "miss"
    assert s["ttft_s"]["successes"]["p90"] != "miss"
    assert s["accounting"] == ACCOUNTING


def test_slo_held_and_no_slo() -> None:
    s = _summary([_rec(i) for i in range(100)], SLO(ttft_s=0.5, attainment=0.99))
    assert s["slo_held"] is True and s["attainment"]["tpot"] is None
    s = _summary([_rec(i) for i in range(3)], SLO())
    assert s["slo_held"] is None and s["goodput_rps"] == pytest.approx(0.3)
    assert "none given" in render_summary(s)


def test_table_reads_like_a_verdict() -> None:
    records = [_rec(i) for i in range(9)] + [_rec(9, "refused", None, None)]
    records[3].lag_s = 0.2
    text = render_summary(_summary(records))
    assert "10 scored (denominator), 9 ok, 1 failed" in text
    assert "both 90.0% (9/10)  ->  SLO NOT MET" in text
    assert "refused 1" in text
    assert "TTFT (failures=miss)" in text and "miss" in text
    assert "1 requests started more than 50.0 ms after their scheduled time" in text


def test_results_round_trip(tmp_path: Any) -> None:
    records = [_rec(0), _rec(1, "refused", None, None, error={"message": "full", "type": None, "code": 503})]
    write_results(tmp_path / "results.jsonl", records)
    back = read_results(tmp_path)
    assert back == records
    (tmp_path / "bad.jsonl").write_text('{"index": 0, "request_id": "a", "route": "c"}\n[1]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_results(tmp_path / "bad.jsonl")


def test_compare_same_denominator_prints_deltas() -> None:
    a = _summary([_rec(i, ttft=0.1) for i in range(10)])
    b = _summary([_rec(i, ttft=0.2) for i in range(9)] + [_rec(9, "refused", None, None)])
    cmp = compare_summaries(a, b)
    assert cmp.comparable and cmp.reasons == []
    rows = {m: (va, vb, d) for m, va, vb, d in cmp.rows}
    assert rows["attainment both"][2] == pytest.approx(-0.1)
    assert rows["TTFT p50 (ok)"][2] == pytest.approx(0.1)
    assert rows["class refused"] == (0, 1, 1)
    text = render_comparison(cmp, "runs/a", "runs/b")
    assert "TTFT p50 (ok)" in text and "+100.0 ms (+100.0%)" in text
    assert "note: the terminal outcomes differ" in text


def test_compare_refuses_mismatched_denominators() -> None:
    a = _summary([_rec(i) for i in range(10)])
    b = _summary([_rec(i) for i in range(9)] + [_rec(9, "client_cancelled", None, None)])
    cmp = compare_summaries(a, b)
    assert not cmp.comparable and cmp.rows == []
    assert cmp.reasons == [
        "denominators differ: A has 10 scored of 10 scheduled (not scored: none); "
        "B has 9 scored of 10 scheduled (not scored: client_cancelled 1)"
    ]
    text = render_comparison(cmp, "a", "b")
    assert "not comparable:" in text and "p50" not in text


def test_compare_refuses_other_accounting_classes_or_slo() -> None:
    a = _summary([_rec(i) for i in range(4)])
    b = copy.deepcopy(a)
    b["accounting"]["rule"] = "text-chunks/0"
    b["scored_classes"] = [c for c in b["scored_classes"] if c != "refused"]
    b["slo"]["ttft_s"] = 1.0
    reasons = compare_summaries(a, b).reasons
    assert reasons[0] == "stream-accounting rules differ: A uses narwhal-token-ids/1, B uses text-chunks/0"
    assert reasons[1] == "scored terminal classes differ: only in A: refused; only in B: none"
    assert reasons[2].startswith("SLO targets differ: A TTFT <= 0.5 s")
    c = copy.deepcopy(a)
    c["accounting"]["tpot"] = "something else"
    assert compare_summaries(a, c).reasons == [
        "stream-accounting rule narwhal-token-ids/1 is defined differently in A and B: tpot"
    ]


def test_compare_notes_differences_that_keep_sets_comparable() -> None:
    a = _summary([_rec(i) for i in range(4)])
    b = copy.deepcopy(a)
    b["workload"]["rate"] = 2.0
    b["run"]["options"] = {"concurrency": 8}
    a["run"]["options"] = {"concurrency": None}
    cmp = compare_summaries(a, b)
    assert cmp.comparable
    assert cmp.notes == ["workloads differ in rate (1.0 vs 2.0)", "run options differ in concurrency (None vs 8)"]


def test_progress_bar_draws_only_when_enabled() -> None:
    import io

    from narwhal.bench import Progress

    quiet = io.StringIO()
    bar = Progress(4, stream=quiet)  # not a terminal: silent
    bar.request_started(_rec(0))
    bar.close()
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    bar = Progress(4, stream=loud, enabled=True)
    for i in range(2):
        rec = _rec(i, lag_s=0.25 * i)
        bar.request_started(rec)
        bar.request_finished(rec)
    bar.request_started(_rec(3, "refused"))
    bar.request_finished(_rec(3, "refused"))
    bar.close()
    assert loud.getvalue().endswith("\n")
    assert "[##################------] 3/4 done, 0 in flight, 1 failed, max lag 250 ms" in bar.line()


def test_facade_exports_every_module_name() -> None:
    import narwhal.bench
    from narwhal.bench import client, compare, journal, progress, records, report, workload

    for module in (client, compare, journal, progress, records, report, workload):
        for name in module.__all__:
            assert getattr(narwhal.bench, name) is getattr(module, name), (module.__name__, name)
            assert name in narwhal.bench.__all__
