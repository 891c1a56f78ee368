"""A/B: two versions of ``narwhal serve`` side by side, on the same engines, in one run.

A change worth a few percent of router CPU is invisible between two runs of
``tools/bench_overhead.py`` on a shared machine, whose speed drifts by more than that.
This tool starts zero-latency simulated engines once and two routers in front of them:
A runs the checkout at ``--a`` (a ``git worktree`` of the base, say), B the one at
``--b`` (this one by default); ``--env-a`` / ``--env-b`` add environment variables.
At each concurrency it alternates load-generator runs between them (ABAB..., then
BABA...) for ``--rounds`` rounds and prints each side's median router CPU per request
and client TTFT p50, and B/A. Requests ask for ``--max-tokens`` output tokens (16; 256
weighs the per-token path). Given two values (``--max-tokens 16,256``), each
concurrency runs both, and each side's per-token CPU is the difference of its medians
divided by the extra tokens (as ``bench_overhead.py`` computes it).

    git worktree add /tmp/base HEAD~1
    python tools/bench_ab.py --a /tmp/base --concurrency 1,16 --rounds 21
    python tools/bench_ab.py --a /tmp/base --concurrency 16 --max-tokens 16,256

``--otlp-sink`` starts an OTLP/HTTP receiver that accepts every export and keeps
nothing, and puts its URL for ``{otlp_sink}`` in the ``--env-a`` / ``--env-b`` values:
the cost of tracing on against off, in one run (docs/benchmarks.md, "Tracing")::

    python tools/bench_ab.py --a . --otlp-sink --env-b OTEL_TRACES_EXPORTER=otlp \
        --env-b OTEL_EXPORTER_OTLP_ENDPOINT={otlp_sink}

``--quick`` is the CI form (concurrency 1 and 16, 16 and 64 tokens, two rounds of 40
requests; seconds). A request that fails makes the exit status 1, in any form (after the
figures are printed), and so does a sink named in ``--env-a`` / ``--env-b`` that received
no export; a figure never does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench_overhead import cpu_seconds, loadgen, pct, pd_engines, start_sims
from proctools import free_port, stop, wait_http

REPO = Path(__file__).resolve().parents[1]


def _env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--env-a/--env-b take NAME=VALUE, not {pair!r}")
        out[name] = value
    return out


class _Sink(BaseHTTPRequestHandler):
    """Accepts an OTLP/HTTP export and keeps nothing (an empty ExportTraceServiceResponse)."""

    exports = 0
    received = 0

    def do_POST(self) -> None:
        size = int(self.headers.get("content-length", "0"))
        self.rfile.read(size)
        type(self).exports += 1
        type(self).received += size
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def _start_sink() -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="checkout (repository root) router A runs")
    parser.add_argument("--b", default=str(REPO), help="checkout router B runs (default: this one)")
    parser.add_argument("--env-a", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--otlp-sink", action="store_true",
                        help="start an OTLP/HTTP receiver that drops what it gets; {otlp_sink} in an "
                             "--env-a/--env-b value is its URL")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, default=400, help="requests per load-generator run")
    parser.add_argument("--rounds", type=int, default=7, help="runs per side and concurrency")
    parser.add_argument("--max-tokens", default="16",
                        help="output tokens per request (256 weighs the per-token path); two values, "
                             "e.g. 16,256, also give per-token CPU")
    parser.add_argument("--quick", action="store_true",
                        help="the CI form: concurrency 1,16, 16 and 64 tokens, 2 rounds of 40 requests")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens, args.rounds, args.requests = "1,16", "16,64", 2, 40
    token_counts = [int(x) for x in args.max_tokens.split(",")]
    if len(token_counts) > 2:
        raise SystemExit("--max-tokens takes one or two values")
    checkouts = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    for side, path in checkouts.items():
        if not (path / "narwhal" / "__init__.py").is_file():
            raise SystemExit(f"--{side.lower()} {path}: not a narwhal checkout (no narwhal/__init__.py)")
    envs = {"A": _env(args.env_a), "B": _env(args.env_b)}
    sink = _start_sink() if args.otlp_sink else None
    if sink is not None:
        url = f"http://127.0.0.1:{sink.server_address[1]}"
        envs = {side: {k: v.replace("{otlp_sink}", url) for k, v in env.items()} for side, env in envs.items()}

    failed: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-ab-"))
    ports = {k: free_port() for k in ("p", "d", "pkv", "dkv", "A", "A-admin", "B", "B-admin")}
    engines = pd_engines(ports)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start_sims(engines, tmp))
        pids: dict[str, int] = {}
        for side in "AB":
            fleet = tmp / f"{side}.json"
            fleet.write_text(json.dumps({
                "server": {"host": "127.0.0.1", "port": ports[side], "admin_port": ports[f"{side}-admin"],
                           "max_concurrent_requests": 100000},
                "engines": engines,
                "journal": {"path": str(tmp / f"journal-{side}.jsonl"), "fsync": False},
            }))  # fmt: skip
            # Run from the checkout with it first on the path: `-m narwhal` imports that one.
            env = {**os.environ, **envs[side], "PYTHONPATH": str(checkouts[side])}
            proc = subprocess.Popen(
                [sys.executable, "-m", "narwhal", "--log-level", "WARNING", "serve", "--fleet", str(fleet)],
                stdout=(tmp / f"{side}.log").open("wb"), stderr=subprocess.STDOUT,
                start_new_session=True, env=env, cwd=checkouts[side],
            )  # fmt: skip
            procs.append(proc)
            pids[side] = proc.pid
            try:
                wait_http(f"http://127.0.0.1:{ports[side]}/health", proc=proc)
            except RuntimeError as exc:
                raise SystemExit(f"router {side}: {exc}; its log:\n{(tmp / f'{side}.log').read_text()[-3000:]}") from None
        print(f"A: {checkouts['A']} {envs['A'] or ''}\nB: {checkouts['B']} {envs['B'] or ''}")
        for c in (int(x) for x in args.concurrency.split(",")):
            medians: dict[str, list[float]] = {"A": [], "B": []}
            for tokens in token_counts:
                cpu: dict[str, list[float]] = {"A": [], "B": []}
                ttft: dict[str, list[float]] = {"A": [], "B": []}
                for side in "AB":  # warm connections and caches
                    loadgen(f"http://127.0.0.1:{ports[side]}", c, max(2 * c, 50), tokens)
                for r in range(args.rounds):
                    for side in "AB" if r % 2 == 0 else "BA":
                        before = cpu_seconds(pids[side])
                        out = loadgen(f"http://127.0.0.1:{ports[side]}", c, args.requests, tokens)
                        if out["errors"] or not out["requests"]:
                            failed.append(f"{side} at c={c}, {tokens} tokens, round {r + 1}: {out['errors']} of "
                                          f"{out['errors'] + out['requests']} requests failed")  # fmt: skip
                        cpu[side].append((cpu_seconds(pids[side]) - before) / max(out["requests"], 1) * 1e3)
                        ttft[side].append(pct(out["ttft_s"], 0.5) * 1e3)
                a, b = statistics.median(cpu["A"]), statistics.median(cpu["B"])
                medians["A"].append(a)
                medians["B"].append(b)
                label = f" tokens={tokens}" if len(token_counts) > 1 else ""
                print(
                    f"c={c:<3}{label} cpu ms/request A {a:.3f} B {b:.3f} B/A {b / a:.3f}; ttft p50 ms "
                    f"A {statistics.median(ttft['A']):.2f} B {statistics.median(ttft['B']):.2f}",
                    flush=True,
                )
            if len(token_counts) == 2:
                extra = token_counts[1] - token_counts[0]
                a, b = ((m[1] - m[0]) / extra * 1e3 for m in (medians["A"], medians["B"]))
                print(f"c={c:<3} cpu us/token A {a:.2f} B {b:.2f} B/A {b / a:.3f}", flush=True)
    finally:
        for proc in reversed(procs):
            stop(proc)
        if sink is not None:
            sink.shutdown()
            print(f"OTLP sink: {_Sink.exports} exports, {_Sink.received} bytes", flush=True)
            if not _Sink.exports and any("{otlp_sink}" in v for v in [*args.env_a, *args.env_b]):
                failed.append("a router was told to export to the OTLP sink, and it received nothing")
    for line in failed:
        print(f"FAILED: {line} (logs in {tmp})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
