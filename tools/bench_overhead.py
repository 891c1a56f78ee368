"""What a router adds: Narwhal and vllm-router against the engines themselves, in one run.

Starts zero-latency simulated engines (a producer and a consumer, ``narwhal sim``),
then measures with a load generator in its own process (``tools/loadgen.py``):

(a) the consumer engine directly (the limit: a router that adds nothing),
(b) ``narwhal serve`` in front of the pair,
(c) vllm-router in PD mode (``--vllm-pd-disaggregation --policy round_robin``) on the
    same engines, when a ``vllm-router`` executable is found (``--vllm-router PATH``, or
    on PATH; install it into its own venv: ``python3 -m venv ~/.venvs/vllm-router &&
    ~/.venvs/vllm-router/bin/pip install vllm-router``),
(d) the floor (``tools/floor_relay.py``): the least a prefill/decode router in Python on
    trio does per request (parse the body, the two engine legs over pooled keep-alive
    connections, relay the stream bytes as they come; nothing else), so that the CPU a
    Python router cannot avoid is a figure of the same run (``--no-floor`` leaves it out),

at concurrency 1, 16 and 64. ``--narwhal NAME=TREE[:WORKERS]`` (repeatable) runs (b) once
per Narwhal tree (a checkout whose ``narwhal`` package ``python -m narwhal`` imports with
``PYTHONPATH=TREE``: a pure-Python one and one compiled in place, README "Install"), each
as its own target, side by side in the same run; WORKERS is its ``--workers``. Measured: requests/s, added p50/p99 latency to the first token
and to the last token (against (a) at the same concurrency), router CPU seconds per
request (from /proc), and per-token forwarding cost (router CPU per extra output
token, from a short-output and a long-output run). The targets alternate within each
of ``--rounds`` rounds and every figure is the median over them, so a change in the
machine's load touches all targets alike. It prints ratios against (a) and (c), Narwhal's
and vllm-router's CPU against the floor's, a verdict for each of the performance targets, and writes everything as JSON.

    python tools/bench_overhead.py --out runs/bench_overhead.json

``--quick`` is the CI form (concurrency 1 and 16, one round of 40 requests, 64 tokens for
the per-token run; seconds): every target and the floor on the same path, and the exit
status 1 when a target's requests fail, never on a figure. Outside ``--quick`` too a
request that fails makes the exit status 1 (the figures are written first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from proctools import free_port, start, stop, wait_http, wait_port

HERE = Path(__file__).resolve().parent
CLK_TCK = os.sysconf("SC_CLK_TCK")

ZERO_SIM = {
    "model": "sim-llama",
    "prefill": {"a": 0.0, "b": 0.0, "c": 0.0},
    "decode": {"c0": 0.0, "c1": 0.0, "c2": 0.0},
    "transfer_s_per_token": 0.0,
    "max_num_seqs": 1024,
}




def pd_engines(ports: dict[str, int]) -> list[dict[str, Any]]:
    """The producer and the consumer of the fleet documents, on ``ports`` p, d, pkv and dkv."""
    return [
        {"name": "producer", "url": f"http://127.0.0.1:{ports['p']}", "roles": ["prefill"],
         "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": ports["pkv"]}},
        {"name": "consumer", "url": f"http://127.0.0.1:{ports['d']}", "roles": ["decode"],
         "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": ports["dkv"]}},
    ]  # fmt: skip


def start_sims(engines: list[dict[str, Any]], tmp: Path) -> subprocess.Popen[bytes]:
    """``narwhal sim`` serving ``engines`` with zero latency, once both answer /health."""
    (tmp / "sim.json").write_text(json.dumps({"engines": [{**e, "sim": ZERO_SIM} for e in engines]}))
    sims = start([sys.executable, "-m", "narwhal", "--log-level", "WARNING", "sim", "--fleet", str(tmp / "sim.json")],
                 tmp / "sim.log")  # fmt: skip
    for engine in engines:
        wait_http(f"{engine['url']}/health", proc=sims)
    return sims


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (``narwhal serve --workers N``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue  # gone meanwhile
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants, in clock ticks (exited threads included)."""
    total = 0.0
    for p in process_tree(pid):
        try:
            fields = _stat(p)
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    return total


def thread_cpu(pid: int) -> dict[int, int]:
    """CPU nanoseconds of every live thread of ``pid`` and its descendants, by thread id
    (``/proc/<pid>/task/<tid>/schedstat``): fine enough for a block of a few requests."""
    out: dict[int, int] = {}
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                out[int(tid)] = int(Path(f"/proc/{p}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return out


def cpu_between(before: dict[int, int], after: dict[int, int]) -> float:
    """CPU seconds the threads of ``after`` used since ``before`` (a thread new since then
    counts from its start; one that ended meanwhile took its time with it)."""
    return sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9


def loadgen(url: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(HERE / "loadgen.py"), "--url", url, "--concurrency", str(concurrency),
         "--requests", str(requests), "--max-tokens", str(max_tokens)],
        capture_output=True, check=True, text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (errors summed)."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float):
            values = sorted(r[key] for r in rows if r[key] is not None)
            out[key] = statistics.median(values) if values else None
    out["errors"] = sum(r["errors"] for r in rows)
    out["requests"] = sum(r["requests"] for r in rows)
    out["rounds"] = len(rows)
    return out


def measure(name: str, url: str, pid: int | None, concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    loadgen(url, concurrency, max(concurrency * 2, 20), max_tokens)  # warm connections and caches
    cpu0 = cpu_seconds(pid) if pid else 0.0
    res = loadgen(url, concurrency, requests, max_tokens)
    cpu1 = cpu_seconds(pid) if pid else 0.0
    n = max(res["requests"], 1)
    return {
        "target": name,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "requests": res["requests"],
        "errors": res["errors"],
        "rps": res["requests"] / res["elapsed_s"],
        "ttft_p50_ms": pct(res["ttft_s"], 0.5) * 1e3,
        "ttft_p99_ms": pct(res["ttft_s"], 0.99) * 1e3,
        "total_p50_ms": pct(res["total_s"], 0.5) * 1e3,
        "total_p99_ms": pct(res["total_s"], 0.99) * 1e3,
        "router_cpu_ms_per_request": (cpu1 - cpu0) / n * 1e3 if pid else None,
    }


def start_narwhal(
    name: str, tree: str | None, workers: int, doc: dict[str, Any], tmp: Path, *, new_session: bool = True
) -> tuple[subprocess.Popen[bytes], str, str]:
    """``narwhal serve`` of the fleet document ``doc`` from checkout ``tree`` (None: the
    package this interpreter imports), once it answers /health: (process, URL, build).

    ``doc``'s server ports and journal path are set here (free ports, a journal in
    ``tmp``); the build is "compiled" when the tree's hot path loads from ``.so`` files,
    and names the token relay's loop where the tree has one (C where it was built).
    ``new_session``: as :func:`proctools.start`.
    """
    port = free_port()
    server = {**doc.get("server", {}), "host": "127.0.0.1", "port": port, "admin_port": free_port()}
    journal = {**doc.get("journal", {}), "path": str(tmp / f"{name}.journal.jsonl")}
    (tmp / f"{name}.json").write_text(json.dumps({**doc, "server": server, "journal": journal}))
    serve_cmd = [sys.executable, "-m", "narwhal", "--log-level", "WARNING", "serve", "--fleet", str(tmp / f"{name}.json")]
    if workers > 1:
        serve_cmd += ["--workers", str(workers)]
    env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
    # Run from tmp: `python -m` puts the working directory ahead of PYTHONPATH,
    # and a checkout there would be imported instead of TREE.
    cwd = None if tree is None else tmp
    probe = ("import importlib.util as u, narwhal.engines.wire as m; print(m.__file__); "
             "print(u.find_spec('narwhal.router.relay') is not None, u.find_spec('narwhal._crelay') is not None)")
    loaded, relay = subprocess.run([sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True, text=True,
                                   check=True).stdout.split("\n")[:2]  # fmt: skip
    if tree is not None and not loaded.startswith(tree):
        raise SystemExit(f"--narwhal {name}: imports {loaded}, not from {tree}")
    build = "compiled" if loaded.endswith(".so") else "pure Python"
    build += {"True True": ", token relay in C", "True False": ", token relay in Python"}.get(relay, "")
    print(f"  {name}: {build} ({loaded}), {workers} worker(s)", file=sys.stderr, flush=True)
    proc = start(serve_cmd, tmp / f"{name}.log", env=env, cwd=cwd, new_session=new_session)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
    except RuntimeError:
        stop(proc)
        raise SystemExit(f"{name} did not come up; its log:\n{(tmp / f'{name}.log').read_text()[-3000:]}") from None
    return proc, f"http://127.0.0.1:{port}", build


def start_vllm_router(
    path: str, policy: str, prefill: str, decode: str, log: Path, extra: list[str] | None = None,
    *, new_session: bool = True,
) -> tuple[subprocess.Popen[bytes], str]:
    """vllm-router in PD mode with ``policy`` in front of ``prefill`` and ``decode``, once it
    answers /health: (process, URL). ``extra``: more of its options; ``new_session``: as
    :func:`proctools.start`."""
    port = free_port()
    proc = start([path, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                  "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
                  # its metrics listener defaults to a fixed port: one of our own
                  "--prometheus-port", str(free_port()), *(extra or [])], log, new_session=new_session)  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
    except RuntimeError:
        stop(proc)
        raise SystemExit(f"vllm-router ({policy}) did not come up; its log:\n{log.read_text()[-3000:]}") from None
    return proc, f"http://127.0.0.1:{port}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_overhead.json")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--requests", type=int, default=400, help="requests per measurement")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=256, help="output length of the per-token run")
    parser.add_argument("--vllm-router", help="path of the vllm-router executable")
    parser.add_argument("--workers", type=int, default=1, help="narwhal serve --workers")
    parser.add_argument("--narwhal", action="append", default=[], metavar="NAME=TREE[:WORKERS]",
                        help="a Narwhal target run with PYTHONPATH=TREE (repeatable; default: one "
                        "target 'narwhal', the package this interpreter imports, with --workers)")
    parser.add_argument("--no-floor", action="store_true",
                        help="leave out (d), the floor: tools/floor_relay.py")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measurements per target and level, interleaved; figures are their medians")
    parser.add_argument("--quick", action="store_true",
                        help="the CI form: concurrency 1,16, one round of 40 requests, 64-token per-token run")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.requests, args.rounds, args.long_tokens = "1,16", 40, 1, 64
    levels = [int(c) for c in args.concurrency.split(",")]
    vr = args.vllm_router or shutil.which("vllm-router")

    tmp = Path(tempfile.mkdtemp(prefix="narwhal-bench-"))
    ports = {k: free_port() for k in ("p", "d", "pkv", "dkv", "floor")}
    engines = pd_engines(ports)
    builds = [parse_build(spec) for spec in args.narwhal] or [("narwhal", None, args.workers)]
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    token_rows: list[dict[str, Any]] = []  # the per-token runs' (not in the table)
    build_of: dict[str, str] = {}
    try:
        procs.append(start_sims(engines, tmp))
        targets: list[tuple[str, str, int | None]] = [("engines", f"http://127.0.0.1:{ports['d']}", None)]
        for name, tree, workers in builds:
            router_doc = {
                "server": {"host": "127.0.0.1", "max_concurrent_requests": 100000},
                "engines": engines,
                "journal": {"fsync": False},
            }
            narwhal, url, build_of[name] = start_narwhal(name, tree, workers, router_doc, tmp)
            procs.append(narwhal)
            targets.append((name, url, narwhal.pid))
        if vr:
            vrp, url = start_vllm_router(vr, "round_robin", f"http://127.0.0.1:{ports['p']}",
                                         f"http://127.0.0.1:{ports['d']}", tmp / "vllm-router.log")
            procs.append(vrp)
            targets.append(("vllm-router", url, vrp.pid))
        if not args.no_floor:
            floor = start([sys.executable, str(HERE / "floor_relay.py"), "--port", str(ports["floor"]),
                           "--prefill", f"http://127.0.0.1:{ports['p']}",
                           "--decode", f"http://127.0.0.1:{ports['d']}"], tmp / "floor.log")
            procs.append(floor)
            wait_port(ports["floor"])
            targets.append(("floor", f"http://127.0.0.1:{ports['floor']}", floor.pid))
        # Targets alternate within each round, so a change in the machine's load
        # touches all of them alike; each figure is the median over the rounds.
        for c in levels:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in targets}
            for _ in range(args.rounds):
                for name, url, pid in targets:
                    runs[name].append(measure(name, url, pid, c, args.requests, args.max_tokens))
            for name, _, _ in targets:
                rows.append(median_row(runs[name]))
                print(f"  measured {name} at concurrency {c}", file=sys.stderr, flush=True)
        per_token: dict[str, float] = {}
        samples: dict[str, list[float]] = {name: [] for name, _, pid in targets if pid is not None}
        for _ in range(args.rounds):
            for name, url, pid in targets:
                if pid is None:
                    continue
                short = measure(name, url, pid, 16, args.requests // 2, args.max_tokens)
                long = measure(name, url, pid, 16, args.requests // 2, args.long_tokens)
                token_rows += [short, long]
                samples[name].append((long["router_cpu_ms_per_request"] - short["router_cpu_ms_per_request"])
                                     * 1e3 / (args.long_tokens - args.max_tokens))
        per_token = {name: statistics.median(values) for name, values in samples.items()}
    finally:
        for proc in reversed(procs):
            stop(proc)

    report = summarize(rows, per_token, levels)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "per_token_cpu_us": per_token, "summary": report,
                                          "machine": {"cpus": os.cpu_count()},
                                          "builds": {name: {"tree": tree, "workers": workers, "build": build_of[name]}
                                                     for name, tree, workers in builds}}, indent=2))
    print_table(rows, per_token, report)
    print(f"\nwritten to {args.out}")
    failed = [f"{r['target']} at c={r['concurrency']}: {r['errors']} of {r['errors'] + r['requests']} requests failed"
              for r in rows if r["errors"] or not r["requests"]]  # fmt: skip
    failed += [f"{r['target']} per-token run: {r['errors']} requests failed" for r in token_rows if r["errors"]]
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


def parse_build(spec: str) -> tuple[str, str | None, int]:
    """``NAME=TREE[:WORKERS]`` -> (name, tree, workers)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"--narwhal {spec!r}: expected NAME=TREE[:WORKERS]")
    tree, _, workers = rest.partition(":")
    if not (Path(tree) / "narwhal" / "__init__.py").is_file():
        raise SystemExit(f"--narwhal {spec!r}: {tree} has no narwhal package")
    return name, str(Path(tree).resolve()), int(workers or 1)


def summarize(rows: list[dict[str, Any]], per_token: dict[str, float], levels: list[int]) -> dict[str, Any]:
    by = {(r["target"], r["concurrency"]): r for r in rows}
    out: dict[str, Any] = {}
    for c in levels:
        base = by[("engines", c)]
        level: dict[str, Any] = {}
        names = [t for t, lc in by if lc == c and t != "engines"]
        for name in names:
            r = by[(name, c)]
            level[name] = {
                "added_ttft_p50_ms": r["ttft_p50_ms"] - base["ttft_p50_ms"],
                "added_ttft_p99_ms": r["ttft_p99_ms"] - base["ttft_p99_ms"],
                "added_total_p50_ms": r["total_p50_ms"] - base["total_p50_ms"],
                "added_total_p99_ms": r["total_p99_ms"] - base["total_p99_ms"],
                "rps_vs_engines": r["rps"] / base["rps"],
                "cpu_ms_per_request": r["router_cpu_ms_per_request"],
            }
        narwhals = [n for n in names if n not in ("vllm-router", "floor")]
        if "vllm-router" in level:
            v = level["vllm-router"]
            level["vs_vllm_router"] = {
                name: {
                    "added_ttft_p50_ratio": level[name]["added_ttft_p50_ms"] / v["added_ttft_p50_ms"] if v["added_ttft_p50_ms"] > 0 else None,
                    "cpu_per_request_ratio": level[name]["cpu_ms_per_request"] / v["cpu_ms_per_request"] if v["cpu_ms_per_request"] else None,
                    "rps_ratio": by[(name, c)]["rps"] / by[("vllm-router", c)]["rps"],
                }
                for name in narwhals
            }
        if "floor" in level and level["floor"]["cpu_ms_per_request"]:
            floor_cpu = level["floor"]["cpu_ms_per_request"]
            level["cpu_vs_floor"] = {
                name: level[name]["cpu_ms_per_request"] / floor_cpu
                for name in [*narwhals, "vllm-router"] if name in level
            }
        out[str(c)] = level
    out["per_token_cpu_us"] = per_token
    out["targets"] = verdicts(out, per_token, levels)
    return out


def verdicts(report: dict[str, Any], per_token: dict[str, float], levels: list[int]) -> list[dict[str, Any]]:
    """The performance targets, each with the figure measured and whether it is met."""
    checks: list[dict[str, Any]] = []
    for c in levels:
        for name, ratios in report[str(c)].get("vs_vllm_router", {}).items():
            limit = 1.0 if c <= 16 else 1.5
            ttft = ratios["added_ttft_p50_ratio"]
            checks.append({"target": f"{name}: added ttft p50 at c={c} <= {limit:g}x vllm-router's",
                           "value": ttft, "met": ttft is not None and ttft <= limit})
            cpu = ratios["cpu_per_request_ratio"]
            checks.append({"target": f"{name}: router cpu/request at c={c} <= 1.5x vllm-router's",
                           "value": cpu, "met": cpu is not None and cpu <= 1.5})
            if c >= 64:
                rps = ratios["rps_ratio"]
                checks.append({"target": f"{name}: req/s at c={c} >= vllm-router's", "value": rps,
                               "met": rps >= 1.0})
    vr_token = per_token.get("vllm-router")
    for name, us in per_token.items():
        if name in ("vllm-router", "floor"):
            continue
        checks.append({"target": f"{name}: per-token forwarding cost <= 20 us", "value": us, "met": us <= 20.0})
        if vr_token:
            checks.append({"target": f"{name}: per-token forwarding cost <= vllm-router's",
                           "value": us / vr_token, "met": us <= vr_token})
    return checks


def print_table(rows: list[dict[str, Any]], per_token: dict[str, float], report: dict[str, Any]) -> None:
    print(f"\n{'target':<13}{'conc':>5}{'rps':>9}{'ttft p50':>10}{'ttft p99':>10}{'last p50':>10}{'last p99':>10}{'cpu ms/req':>12}{'errors':>8}")
    for r in rows:
        cpu = r["router_cpu_ms_per_request"]
        print(f"{r['target']:<13}{r['concurrency']:>5}{r['rps']:>9.0f}{r['ttft_p50_ms']:>10.2f}{r['ttft_p99_ms']:>10.2f}"
              f"{r['total_p50_ms']:>10.2f}{r['total_p99_ms']:>10.2f}{'-' if cpu is None else f'{cpu:.3f}':>12}{r['errors']:>8}")
    print("\nadded latency against the engines themselves (ms), and ratios:")
    for c, level in report.items():
        if c in ("per_token_cpu_us", "targets"):
            continue
        for name, v in level.items():
            if name == "cpu_vs_floor":
                print(f"  c={c:<3} cpu/request against the floor's (a Python/trio relay that does "
                      "nothing else): " + ", ".join(f"{k} x{r:.2f}" for k, r in v.items()))
            elif name == "vs_vllm_router":
                for target, ratios in v.items():
                    print(f"  c={c:<3} {target} / vllm-router: added ttft p50 x{ratios['added_ttft_p50_ratio'] or float('nan'):.2f}, "
                          f"cpu/request x{ratios['cpu_per_request_ratio'] or float('nan'):.2f}, req/s x{ratios['rps_ratio']:.2f}")
            else:
                print(f"  c={c:<3} {name:<12} ttft +{v['added_ttft_p50_ms']:.2f} p50 / +{v['added_ttft_p99_ms']:.2f} p99, "
                      f"last token +{v['added_total_p50_ms']:.2f} p50 / +{v['added_total_p99_ms']:.2f} p99, "
                      f"rps x{v['rps_vs_engines']:.2f} of the engines")
    for name, us in per_token.items():
        print(f"  per-token forwarding cost, {name}: {us:.1f} us of router CPU per token")
    print("\ntargets:")
    for check in report["targets"]:
        value = check["value"]
        shown = "n/a" if value is None else f"{value:.2f}"
        print(f"  {'met    ' if check['met'] else 'NOT MET'}  {check['target']}: {shown}")


if __name__ == "__main__":
    sys.exit(main())
