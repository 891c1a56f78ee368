"""The deployment client: open-loop schedules, per-request records, SLO report, comparison.

``narwhal bench`` (:mod:`narwhal.bench.cli`) runs a workload against a router (or any
OpenAI-compatible server) and writes ``results.jsonl`` (one record per scheduled
request) and ``summary.json`` (attainment, goodput, percentiles, classes, lag). From
Python::

    schedule = build_schedule(Workload(rate=10, num_requests=100))
    run = await run_bench(schedule, BenchOptions(url="http://127.0.0.1:8000"))
    summary = summarize(run.records, slo=SLO(ttft_s=0.5), duration_s=run.duration_s,
                        run={"run_id": run.run_id}, workload={})

This package re-exports the public names of its modules.
"""

from __future__ import annotations

from narwhal.bench.client import (
    BenchError,
    BenchOptions,
    BenchRun,
    BenchRunner,
    ProgressSink,
    Route,
    run_bench,
)
from narwhal.bench.compare import Comparison, compare_summaries, load_summary, render_comparison
from narwhal.bench.journal import (
    JOIN_SCHEMA,
    JoinResult,
    join_journal,
    join_row,
    read_journal,
    render_join,
)
from narwhal.bench.progress import Progress
from narwhal.bench.records import (
    ACCOUNTING,
    RESULTS_FILE,
    SCORED_CLASSES,
    SUMMARY_FILE,
    TERMINAL_CLASSES,
    RequestResult,
    is_scored_class,
    read_results,
    write_results,
)
from narwhal.bench.report import (
    MISS,
    SLO,
    SUMMARY_SCHEMA,
    distribution,
    format_seconds,
    percentile,
    render_summary,
    summarize,
)
from narwhal.bench.workload import (
    ARRIVALS,
    Arrival,
    LengthDist,
    ScheduledRequest,
    Workload,
    arrival_offsets,
    build_schedule,
    load_trace,
    prompt_ids,
    prompt_text,
)

__all__ = [
    "ACCOUNTING",
    "ARRIVALS",
    "JOIN_SCHEMA",
    "MISS",
    "RESULTS_FILE",
    "SCORED_CLASSES",
    "SLO",
    "SUMMARY_FILE",
    "SUMMARY_SCHEMA",
    "TERMINAL_CLASSES",
    "Arrival",
    "BenchError",
    "BenchOptions",
    "BenchRun",
    "BenchRunner",
    "Comparison",
    "JoinResult",
    "LengthDist",
    "Progress",
    "ProgressSink",
    "RequestResult",
    "Route",
    "ScheduledRequest",
    "Workload",
    "arrival_offsets",
    "build_schedule",
    "compare_summaries",
    "distribution",
    "format_seconds",
    "is_scored_class",
    "join_journal",
    "join_row",
    "load_summary",
    "load_trace",
    "percentile",
    "prompt_ids",
    "prompt_text",
    "read_journal",
    "read_results",
    "render_comparison",
    "render_join",
    "render_summary",
    "run_bench",
    "summarize",
    "write_results",
]
