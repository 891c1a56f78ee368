"""``narwhal bench``: run a workload, compare two runs, join a run with the router journal.

::

    narwhal bench --url http://127.0.0.1:8000 --out runs/a --rate 20 --num-requests 500 \\
        --input-len uniform:100:500 --output-len 128 --slo-ttft 500ms --slo-tpot 50ms
    narwhal bench --url ... --out runs/t --trace trace.jsonl
    narwhal bench --url ... --out runs/m --mix tenants.json --duration 60
    narwhal bench compare runs/a runs/b
    narwhal bench join --results runs/a --journal runs/journal.jsonl

Exit status: 0 after a completed run (whether or not the SLO held: read the table or
``summary.json``), 1 when the run could not start or ``compare`` finds the sets not
comparable (or ``join`` matches nothing), 2 for a usage error (one line on stderr),
130 when the run was interrupted (its partial results are written).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import httpx
import trio

from narwhal.bench.client import BenchError, BenchOptions, BenchRun, BenchRunner
from narwhal.bench.compare import compare_summaries, load_summary, render_comparison
from narwhal.bench.journal import join_journal, render_join
from narwhal.bench.mix import Stream, load_mix, mix_schedule
from narwhal.bench.progress import Progress
from narwhal.bench.records import RESULTS_FILE, SUMMARY_FILE, read_results, write_results
from narwhal.bench.report import SLO, render_summary, summarize
from narwhal.bench.workload import (
    ARRIVALS,
    LengthDist,
    ScheduledRequest,
    Workload,
    build_schedule,
    load_trace,
)
from narwhal.cmdline import duration, positive_int
from narwhal.errors import ConfigError

__all__ = ["UsageError", "main", "run_async"]


class UsageError(Exception):
    """A usage error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate (requests/s, or inf)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("the rate must be > 0")
    return value


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction (0.99 or 99%)") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def run_parser() -> argparse.ArgumentParser:
    """The parser of ``narwhal bench [run]``."""
    p = _Parser(prog="narwhal bench", description="Run an open-loop workload against an OpenAI-compatible server "
                "and report SLO attainment. Subcommands: compare A B; join --results R --journal J.")
    p.add_argument("--url", required=True, action="append",
                   help="server base URL, e.g. http://127.0.0.1:8000; repeat it for replicas of one service: "
                   "requests go to them round robin")  # fmt: skip
    p.add_argument("--out", required=True, help="directory for results.jsonl and summary.json")
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    w = p.add_argument_group("workload (generated)")
    w.add_argument("--rate", type=_rate, help="requests per second (inf: all at once)")
    w.add_argument("--arrival", choices=ARRIVALS, help="arrival process (default poisson)")
    w.add_argument("--burstiness", type=float, help="gamma shape: 1 is Poisson, < 1 burstier (gamma only)")
    w.add_argument("--duration", type=duration, help="schedule requests starting within this time")
    w.add_argument("--num-requests", type=positive_int, help="number of requests (with --trace: the first N)")
    w.add_argument("--input-len", type=_length, help="prompt tokens: N, uniform:LO:HI, normal:M:S, lognormal:M:S (default 128)")
    w.add_argument("--output-len", type=_length, help="output tokens, same forms (default 128)")
    w.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and prompts (default 0)")
    w.add_argument("--trace", help="JSON-lines schedule: offset_s, prompt_len or prompt, output_len")
    w.add_argument("--mix", help="JSON streams of requests, each its tenant, class, rate, lengths and SLO "
                   "(docs/bench.md); --duration overrides the file's")  # fmt: skip
    r = p.add_argument_group("requests")
    r.add_argument("--api", choices=("completions", "chat"), default="completions", help="endpoint (default completions)")
    r.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    r.add_argument("--concurrency", type=positive_int, help="most requests in flight; later ones wait (lag)")
    r.add_argument("--request-timeout", type=duration, default=600.0, help="per-request limit (default 600s)")
    r.add_argument("--warmup", type=int, default=0, help="first N requests are not scored")
    r.add_argument("--prompt-format", choices=("text", "ids"), default="text",
                   help="text: words (exact on the simulator); ids: token ids (exact anywhere, completions only)")
    r.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may end before the requested length)")
    r.add_argument("--api-key", help="sent as Authorization: Bearer")
    s = p.add_argument_group("report")
    s.add_argument("--slo-ttft", type=duration, help="TTFT target, e.g. 500ms")
    s.add_argument("--slo-tpot", type=duration, help="TPOT target, e.g. 50ms")
    s.add_argument("--slo-attainment", type=_fraction, default=0.99,
                   help="share of scored requests that must meet the targets (default 0.99)")
    s.add_argument("--late-after", type=duration, default=0.05,
                   help="a start later than this after schedule is a late start (default 50ms)")
    s.add_argument("--quiet", "--no-progress", dest="progress", action="store_false", help="no progress output")
    s.add_argument("--plot", action="store_true", help="also write TTFT/TPOT CDF PNGs (needs the [plot] extra)")
    return p


def _compare_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="narwhal bench compare", description="Compare two result sets (B - A).")
    p.add_argument("a", help="run directory or summary.json of A")
    p.add_argument("b", help="run directory or summary.json of B")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    return p


def _join_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="narwhal bench join", description="Break client TTFT into router parts by request id.")
    p.add_argument("--results", required=True, help="run directory or results.jsonl")
    p.add_argument("--journal", required=True, help="the router journal (JSON lines)")
    p.add_argument("--out", help="joined rows, JSON lines (default: join.jsonl beside the results)")
    p.add_argument("--json", action="store_true", help="print the join summary as JSON")
    return p


def _schedule(args: argparse.Namespace) -> tuple[list[ScheduledRequest], dict[str, Any], tuple[Stream, ...]]:
    generated = ("rate", "arrival", "burstiness", "duration", "input_len", "output_len")
    if args.mix is not None:
        given = [f"--{name.replace('_', '-')}" for name in ("rate", "arrival", "burstiness", "input_len", "output_len")
                 if getattr(args, name) is not None]  # fmt: skip
        if args.trace is not None:
            given.append("--trace")
        if given:
            raise UsageError(f"--mix sets each stream's workload; drop {', '.join(given)}")
        try:
            streams = tuple(load_mix(args.mix, seed=args.seed, duration_s=args.duration))
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        schedule = mix_schedule(streams)
        if args.num_requests is not None:
            schedule = schedule[: args.num_requests]
        return schedule, {"kind": "mix", "path": args.mix, "num_requests": len(schedule), "streams": len(streams)}, streams
    if args.trace is not None:
        given = [f"--{name.replace('_', '-')}" for name in generated if getattr(args, name) is not None]
        if given:
            raise UsageError(f"--trace fixes the schedule; drop {', '.join(given)}")
        try:
            schedule = load_trace(args.trace)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if args.num_requests is not None:
            schedule = schedule[: args.num_requests]
        digest = hashlib.sha256(Path(args.trace).read_bytes()).hexdigest()
        return schedule, {"kind": "trace", "path": args.trace, "sha256": digest, "num_requests": len(schedule)}, ()
    if args.rate is None:
        raise UsageError("give --rate (requests/s) or --trace")
    if args.burstiness is not None and args.arrival != "gamma":
        raise UsageError("--burstiness applies to --arrival gamma only")
    try:
        workload = Workload(
            rate=args.rate,
            arrival=args.arrival or "poisson",
            burstiness=args.burstiness if args.burstiness is not None else 1.0,
            num_requests=args.num_requests,
            duration_s=args.duration,
            input_len=args.input_len or LengthDist("fixed", 128),
            output_len=args.output_len or LengthDist("fixed", 128),
            seed=args.seed,
        )
    except ValueError as exc:
        msg = str(exc)
        if "request count" in msg or "duration" in msg:
            msg += " (--duration, --num-requests)"
        raise UsageError(msg) from None
    return build_schedule(workload), workload.to_json(), ()


def _options(args: argparse.Namespace, streams: tuple[Stream, ...] = ()) -> BenchOptions:
    try:
        return BenchOptions(
            url=args.url[0].rstrip("/"),
            more_urls=tuple(u.rstrip("/") for u in args.url[1:]),
            route=args.api,
            model=args.model,
            concurrency=args.concurrency,
            request_timeout_s=args.request_timeout,
            warmup=args.warmup,
            seed=args.seed,
            prompt_format=args.prompt_format,
            ignore_eos=args.ignore_eos,
            api_key=args.api_key,
            streams=streams,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _out_dir(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is not a directory")
    if (out / RESULTS_FILE).exists() and not args.overwrite:
        raise UsageError(f"{out} already holds {RESULTS_FILE} (use --overwrite or another --out)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {out}: {exc.strerror}") from None
    return out


async def _watch_signals(runner: BenchRunner, err: TextIO, abort: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if runner.stopping:
                abort.cancel()
                return
            print("\nnarwhal bench: stopping; writing partial results (again to abort)", file=err)
            runner.stop()


async def _bench(
    args: argparse.Namespace,
    *,
    transport: httpx.AsyncBaseTransport | None,
    out: TextIO,
    err: TextIO,
    signals: bool,
) -> int:
    schedule, workload, streams = _schedule(args)
    options = _options(args, streams)
    directory = _out_dir(args)
    slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, attainment=args.slo_attainment)
    progress = Progress(len(schedule), stream=err, enabled=None if args.progress else False)
    runner = BenchRunner(schedule, options, transport=transport, progress=progress)
    run: BenchRun | None = None
    failure: BenchError | None = None
    try:
        async with trio.open_nursery() as nursery:
            if signals:
                nursery.start_soon(_watch_signals, runner, err, nursery.cancel_scope)
            if progress.enabled:
                nursery.start_soon(progress.tick)
            try:
                run = await runner.run()
            except BenchError as exc:
                failure = exc
            finally:
                nursery.cancel_scope.cancel()
    finally:
        progress.close()
    if failure is not None:
        print(f"narwhal bench: {failure}", file=err)
        return 1
    if run is None:
        print("narwhal bench: aborted; no results written", file=err)
        return 130
    run_info = {
        "run_id": run.run_id,
        "url": run.url,
        **({"urls": [options.url, *options.more_urls]} if options.more_urls else {}),
        "route": run.route,
        "model": run.model,
        "started_unix": run.started_unix,
        "finished_unix": run.finished_unix,
        "interrupted": run.interrupted,
        "options": {
            "concurrency": options.concurrency,
            "request_timeout_s": options.request_timeout_s,
            "warmup": options.warmup,
            "prompt_format": options.prompt_format,
            "ignore_eos": options.ignore_eos,
        },
    }
    summary = summarize(
        run.records, slo=slo, duration_s=run.duration_s, run=run_info, workload=workload, late_after_s=args.late_after,
        streams=streams,
    )
    write_results(directory / RESULTS_FILE, run.records)
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(render_summary(summary), file=out)
    print(f"\nresults: {directory / RESULTS_FILE}\nsummary: {directory / SUMMARY_FILE}", file=out)
    if args.plot:
        from narwhal.plots import PlotUnavailable, plot_bench

        try:
            for path in plot_bench(directory, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot):
                print(f"plot: {path}", file=out)
        except PlotUnavailable as exc:
            print(f"narwhal bench: {exc}", file=out)
    return 130 if run.interrupted else 0


def _compare(argv: Sequence[str], out: TextIO) -> int:
    args = _compare_parser().parse_args(argv)
    try:
        a, b = load_summary(args.a), load_summary(args.b)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    cmp = compare_summaries(a, b)
    if args.json:
        print(json.dumps(cmp.to_json(), indent=2), file=out)
    else:
        print(render_comparison(cmp, args.a, args.b), file=out)
    return 0 if cmp.comparable else 1


def _join(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    args = _join_parser().parse_args(argv)
    try:
        records = read_results(args.results)
        result = join_journal(records, args.journal)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    results = Path(args.results)
    target = Path(args.out) if args.out else (results if results.is_dir() else results.parent) / "join.jsonl"
    with open(target, "w", encoding="utf-8") as fh:
        for row in result.rows:
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
    summary = result.summary()
    print(json.dumps(summary, indent=2) if args.json else render_join(summary), file=out)
    if not args.json:
        print(f"\njoined rows: {target}", file=out)
    if not result.rows:
        print("narwhal bench join: no request of the results is in the journal", file=err)
        return 1
    return 0


async def run_async(
    argv: Sequence[str],
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    signals: bool = False,
) -> int:
    """``narwhal bench ...`` inside a running trio loop (tests pass an in-memory transport)."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    argv = list(argv)
    try:
        if argv[:1] == ["compare"]:
            return _compare(argv[1:], out)
        if argv[:1] == ["join"]:
            return _join(argv[1:], out, err)
        if argv[:1] == ["run"]:
            argv = argv[1:]
        args = run_parser().parse_args(argv)
        return await _bench(args, transport=transport, out=out, err=err, signals=signals)
    except UsageError as exc:
        print(f"narwhal bench: {exc} (see narwhal bench --help)", file=err)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, BaseExceptionGroup) and exc.split(KeyboardInterrupt)[0] is not None


def main(argv: Sequence[str] | None = None) -> int:
    """``narwhal bench ...``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return trio.run(lambda: run_async(args, signals=True))
    except BaseException as exc:
        if _interrupted(exc):
            return 130
        raise
