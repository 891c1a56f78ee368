"""What a router costs in front of a real engine: the vLLM CPU pair, side by side.

``tools/bench_overhead.py`` measures routers against zero-latency simulated engines;
this one puts them in front of the real vLLM NixlConnector pair that
``tools/vllm-cpu/pair.py`` runs (prefix caching and KV events on as pair.py starts
them), where the engines' own work fills the cores and a router's cost is what it adds
to theirs. Targets, each in front of the same two engines:

- ``narwhal``: ``narwhal serve`` with the pair's ``fleet.json`` as pair.py writes it (its
  ports and journal path aside): the prefix view on, KV events followed;
- ``narwhal-noprefix``: the same with ``controller.prefix_cache: "off"``;
- ``vllm-router-rr``: vllm-router ``--vllm-pd-disaggregation --policy round_robin``;
- ``vllm-router-kv``: vllm-router ``--policy kv_aware`` with the producer's KV events
  (``--pd-kv-events``); it calls the engines' render endpoint on every request, so only
  when the pair runs with ``--enable-scale-out``;
- ``direct``: no router: the load generator does the handoff itself (prefill on the
  producer, decode with its descriptor on the consumer), the least any router can add;
- ``floor`` (``--floor``): ``tools/floor_relay.py``, a prefill/decode relay in Python on
  trio that does nothing else: what any Python router on trio pays.

``--narwhal NAME=TREE`` (repeatable) replaces ``narwhal`` with one target per checkout
(the code before a change and after it, say), each with the pair's fleet document as
written; the last one also runs with the prefix view off (``NAME-noprefix``) unless
``--no-prefix-off`` (an A/B: ``--narwhal a=A --narwhal b=B --no-prefix-off
--no-vllm-router``).

Every request is a unique prompt of about ``--prompt-tokens`` tokens (a random nonce
first, so nothing is cached anywhere: every request moves its whole prompt over NIXL),
streamed with ``ignore_eos`` for exactly its output length. The targets alternate in
blocks of ``--block`` requests within each of ``--rounds`` rounds, the order reversed
every other round, so that a change in the machine's load touches them alike; every
figure is the median over the rounds. Per target and level:

- router CPU per request (every thread of the router's processes, from
  ``/proc/<pid>/task/*/schedstat``), and per output token: the difference between the
  runs of ``--tokens`` and ``--long-tokens`` output tokens over the extra tokens;
- added TTFT p50 and TPOT p50 over the direct handoff, each the median over the rounds
  of the difference between the target's block and the direct block of the same round;
- KV actually transferred: the consumer's ``vllm:prompt_tokens_by_source_total``
  (``external_kv_transfer`` against ``local_compute``) and NIXL transfers per request;
- idle CPU: after the load, ``--idle-s`` seconds with every router up and no request,
  in ms of CPU per second per engine.

It prints the table, the targets' verdicts, the machine's load average before and
after, and writes JSON (``--out``). Start the pair first::

    python3 tools/vllm-cpu/pair.py start --run-dir /tmp/pair --enable-scale-out
    python3 tools/bench_overhead_real.py --pair /tmp/pair \\
        --vllm-router ~/.venvs/vllm-router/bin/vllm-router --out runs/bench_overhead_real.json

``--short`` is the CI stage's form (concurrency 1, two rounds of small blocks, 32 and
128 tokens, 5 s idle; about half a minute): it fails only when a target's requests
fail or the KV did not move over NIXL, never on a figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import httpx
from bench_overhead import (
    cpu_between,
    parse_build,
    pct,
    start_narwhal,
    start_vllm_router,
    thread_cpu,
)
from loadgen import unique_prompt
from proctools import free_port, start, stop, wait_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_PAIR = os.environ.get("NARWHAL_VLLM_PAIR") or str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "narwhal" / "vllm-pair"
)


@attrs.frozen
class Target:
    """Where the load generator sends a target's requests.

    Attributes:
        name: The target's name in the table.
        url: Where requests go (the consumer itself for the direct handoff).
        pid: The router's process (None: no router).
        prefill_url: The producer, when the load generator does the handoff itself.
    """

    name: str
    url: str
    pid: int | None
    prefill_url: str | None = None


@attrs.frozen
class Pair:
    """The running pair: its engines' URLs, KV-event endpoints and fleet document."""

    producer: str
    consumer: str
    producer_events: str | None
    fleet: dict[str, Any]
    scale_out: bool
    model: str

    @classmethod
    def load(cls, run_dir: Path) -> Pair:
        try:
            state = json.loads((run_dir / "pair.json").read_text())
            fleet = json.loads((run_dir / "fleet.json").read_text())
        except OSError as exc:
            raise SystemExit(f"--pair {run_dir}: no running pair there ({exc}); start one with "
                             "python3 tools/vllm-cpu/pair.py start --enable-scale-out") from None  # fmt: skip
        engines = state["engines"]
        events = engines["producer"].get("kv_events")
        return cls(
            producer=f"http://127.0.0.1:{engines['producer']['port']}",
            consumer=f"http://127.0.0.1:{engines['consumer']['port']}",
            producer_events=f"tcp://127.0.0.1:{events['pub']}" if events else None,
            fleet=fleet,
            scale_out="--enable-scale-out" in engines["producer"]["argv"],
            model=state.get("served_model_name", "tiny-llama"),
        )


def _sibling(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: ``counters(client, url)``: an engine's prompt tokens by source and its NIXL transfers.
_measure = _sibling(HERE / "vllm-cpu" / "measure.py")


def kv_counters(url: str) -> dict[str, float]:
    """The engine's prompt tokens by source, NIXL transfers and their seconds so far."""
    with httpx.Client(timeout=30) as client:
        result: dict[str, float] = _measure.counters(client, url)
    return result


def words_for(pair: Pair, tokens: int) -> int:
    """Random words per prompt for about ``tokens`` prompt tokens (the producer's tokenizer)."""
    with httpx.Client(timeout=60) as client:
        counts = [client.post(f"{pair.producer}/tokenize", json={"model": pair.model, "prompt": unique_prompt(100)})
                  .json()["count"] for _ in range(3)]  # fmt: skip
    return max(1, round(tokens * 100 / statistics.median(counts)))


def loadgen(target: Target, pair: Pair, concurrency: int, requests: int, max_tokens: int, words: int) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "loadgen.py"), "--url", target.url, "--concurrency", str(concurrency),
           "--requests", str(requests), "--max-tokens", str(max_tokens), "--model", pair.model,
           "--unique-prompts", "--prompt-words", str(words)]  # fmt: skip
    if target.prefill_url is not None:
        cmd += ["--prefill-url", target.prefill_url]
    result: dict[str, Any] = json.loads(subprocess.run(cmd, capture_output=True, check=True, text=True).stdout)
    return result


def block(target: Target, pair: Pair, concurrency: int, requests: int, tokens: int, words: int) -> dict[str, Any]:
    """One block of ``requests`` through ``target``: its figures."""
    kv0 = kv_counters(pair.consumer)
    cpu0 = thread_cpu(target.pid) if target.pid else {}
    res = loadgen(target, pair, concurrency, requests, tokens, words)
    cpu = cpu_between(cpu0, thread_cpu(target.pid)) if target.pid else 0.0
    kv1 = kv_counters(pair.consumer)
    n = max(res["requests"], 1)
    return {
        "requests": res["requests"],
        "errors": res["errors"],
        "cpu_ms_per_request": cpu / n * 1e3 if target.pid else None,
        "ttft_p50_ms": pct(res["ttft_s"], 0.5) * 1e3,
        "tpot_p50_ms": pct(res["tpot_s"], 0.5) * 1e3,
        **{f"kv_{k}": kv1[k] - kv0[k] for k in kv0},
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_level(
    blocks: dict[str, list[dict[str, Any]]], concurrency: int, tokens: int
) -> dict[str, dict[str, Any]]:
    """Per target: medians over its blocks, and the paired differences to the direct handoff."""
    direct = blocks.get("direct")
    out: dict[str, dict[str, Any]] = {}
    for name, rows in blocks.items():
        requests = sum(r["requests"] for r in rows)
        level: dict[str, Any] = {
            "concurrency": concurrency, "tokens": tokens, "blocks": len(rows), "requests": requests,
            "errors": sum(r["errors"] for r in rows),
            "cpu_ms_per_request": _median([r["cpu_ms_per_request"] for r in rows]),
            "cpu_ms_per_request_range": [min(r["cpu_ms_per_request"] for r in rows),
                                         max(r["cpu_ms_per_request"] for r in rows)] if rows[0]["cpu_ms_per_request"] is not None else None,
            "ttft_p50_ms": _median([r["ttft_p50_ms"] for r in rows]),
            "tpot_p50_ms": _median([r["tpot_p50_ms"] for r in rows]),
            "kv_external_per_request": sum(r["kv_external"] for r in rows) / max(requests, 1),
            "kv_local_compute_per_request": sum(r["kv_local_compute"] for r in rows) / max(requests, 1),
            "kv_transfers_per_request": sum(r["kv_transfers"] for r in rows) / max(requests, 1),
            "kv_transfer_ms": sum(r.get("kv_xfer_s", 0.0) for r in rows) * 1e3 / max(sum(r["kv_transfers"] for r in rows), 1),
        }  # fmt: skip
        first = next(iter(blocks.values()))
        if name != next(iter(blocks)) and first[0]["cpu_ms_per_request"] and rows[0]["cpu_ms_per_request"]:
            # Against the first target, block by block within each round (an A/B's B/A).
            level["cpu_vs_first_paired"] = _median([r["cpu_ms_per_request"] / f["cpu_ms_per_request"]
                                                     for r, f in zip(rows, first, strict=True)])  # fmt: skip
        if direct is not None:
            level["added_ttft_p50_ms"] = _median([r["ttft_p50_ms"] - d["ttft_p50_ms"] for r, d in zip(rows, direct, strict=True)])
            level["added_tpot_p50_ms"] = _median([r["tpot_p50_ms"] - d["tpot_p50_ms"] for r, d in zip(rows, direct, strict=True)])
        out[name] = level
    return out


def per_token_us(levels: list[dict[str, dict[str, Any]]], short: int, long: int, concurrency: int) -> dict[str, float]:
    """Router CPU per extra output token: the long runs' CPU per request less the short runs', over the extra tokens."""
    by = {(lv["tokens"], name): lv for level in levels for name, lv in level.items() if lv["concurrency"] == concurrency}
    out: dict[str, float] = {}
    for (tokens, name), lv in by.items():
        other = by.get((long, name))
        if tokens == short and other is not None and lv["cpu_ms_per_request"] is not None:
            out[name] = (other["cpu_ms_per_request"] - lv["cpu_ms_per_request"]) * 1e3 / (long - short)
    return out


def verdicts(
    levels: list[dict[str, dict[str, Any]]], per_token: dict[str, float], idle: dict[str, float], narwhals: list[str]
) -> list[dict[str, Any]]:
    """The issue's targets, each with the figure measured and whether it is met."""
    checks: list[dict[str, Any]] = []
    for level in levels:
        base = level.get("vllm-router-rr")
        if base is None:
            continue
        c, tokens = base["concurrency"], base["tokens"]
        for name in narwhals:
            lv = level.get(name)
            if lv is None:
                continue
            if base["cpu_ms_per_request"]:
                ratio = lv["cpu_ms_per_request"] / base["cpu_ms_per_request"]
                checks.append({"target": f"{name}: router CPU/request at c={c}, {tokens} tokens <= 1.5x vllm-router round_robin's",
                               "value": ratio, "met": ratio <= 1.5})  # fmt: skip
            if c == 1 and lv.get("added_ttft_p50_ms") is not None:
                over = lv["added_ttft_p50_ms"] - base["added_ttft_p50_ms"]
                checks.append({"target": f"{name}: added TTFT p50 at c=1, {tokens} tokens <= vllm-router's + 1 ms (ms over it)",
                               "value": over, "met": over <= 1.0})  # fmt: skip
    for name in narwhals:
        if name in per_token and "vllm-router-rr" in per_token:
            us, vr = per_token[name], per_token["vllm-router-rr"]
            checks.append({"target": f"{name}: per-token relay CPU <= vllm-router's (us, vllm-router {vr:.1f})",
                           "value": us, "met": us <= vr})  # fmt: skip
        if name in idle:
            checks.append({"target": f"{name}: idle CPU <= 0.1 ms per second per engine", "value": idle[name],
                           "met": idle[name] <= 0.1})  # fmt: skip
    return checks


def loadavg() -> str:
    """The machine's load average over 1, 5 and 15 minutes."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=DEFAULT_PAIR, help="the running pair's run directory (default %(default)s)")
    parser.add_argument("--out", default="runs/bench_overhead_real.json")
    parser.add_argument("--vllm-router", help="path of the vllm-router executable (default: on PATH)")
    parser.add_argument("--narwhal", action="append", default=[], metavar="NAME=TREE",
                        help="a Narwhal target run with PYTHONPATH=TREE (repeatable; default: this checkout)")
    parser.add_argument("--no-prefix-off", action="store_true", help="leave out the target with the prefix view off")
    parser.add_argument("--no-kv-aware", action="store_true", help="leave out vllm-router-kv")
    parser.add_argument("--no-vllm-router", action="store_true", help="leave out vllm-router (an A/B of two trees)")
    parser.add_argument("--floor", action="store_true",
                        help="add the floor: tools/floor_relay.py, a Python/trio relay that does nothing else")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens of the main runs")
    parser.add_argument("--long-tokens", type=int, default=256, help="output tokens of the per-token runs")
    parser.add_argument("--per-token-concurrency", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=400, help="prompt length, about")
    parser.add_argument("--block", type=int, default=20, help="requests per block")
    parser.add_argument("--long-block", type=int, default=8, help="requests per block of the per-token runs")
    parser.add_argument("--rounds", type=int, default=7, help="blocks per target and level")
    parser.add_argument("--idle-s", type=float, default=30.0, help="seconds of the idle measurement")
    parser.add_argument("--idle-settle-s", type=float, default=12.0,
                        help="seconds from the last request to the idle measurement (trio keeps an idle "
                        "worker thread 10 s; one that ends within the measurement takes its time with it)")
    parser.add_argument("--short", action="store_true", help="the CI form: a quick check that every target works")
    args = parser.parse_args()
    if args.short:
        args.concurrency, args.long_tokens, args.block, args.long_block = "1", 128, 5, 3
        args.rounds, args.idle_s, args.idle_settle_s = 2, 5.0, 1.0
    levels_c = [int(c) for c in args.concurrency.split(",")]
    pair = Pair.load(Path(args.pair))
    vr = None if args.no_vllm_router else args.vllm_router or shutil.which("vllm-router")
    builds = [parse_build(spec) for spec in args.narwhal]
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-bench-real-"))
    load_before = loadavg()
    procs: list[subprocess.Popen[bytes]] = []
    targets: list[Target] = []
    narwhals: list[str] = []
    builds_of: dict[str, str] = {}
    try:
        docs: list[tuple[str, str | None, dict[str, Any]]] = [(n, t, pair.fleet) for n, t, _ in builds] or [
            ("narwhal", str(REPO), pair.fleet)
        ]
        if not args.no_prefix_off:  # the last tree with the prefix view off
            name, tree, _ = docs[-1]
            off = {**pair.fleet, "controller": {**pair.fleet.get("controller", {}), "prefix_cache": "off"}}
            docs.append((f"{name}-noprefix", tree, off))
        for name, tree, doc in docs:
            proc, url, builds_of[name] = start_narwhal(name, tree, 1, doc, tmp, new_session=False)
            procs.append(proc)
            targets.append(Target(name, url, proc.pid))
            narwhals.append(name)
        if vr:
            proc, url = start_vllm_router(vr, "round_robin", pair.producer, pair.consumer, tmp / "vllm-router-rr.log",
                                          new_session=False)
            procs.append(proc)
            targets.append(Target("vllm-router-rr", url, proc.pid))
            if args.no_kv_aware:
                pass
            elif not pair.scale_out or pair.producer_events is None:
                print("  vllm-router-kv left out: the pair runs without --enable-scale-out or KV events",
                      file=sys.stderr, flush=True)  # fmt: skip
            else:
                block_size = "128"  # the CPU backend's default block size (pair.py keeps it)
                proc, url = start_vllm_router(vr, "kv_aware", pair.producer, pair.consumer, tmp / "vllm-router-kv.log",
                                              ["--pd-kv-events", f"{pair.producer}={pair.producer_events}",
                                               "--kv-event-block-size", block_size], new_session=False)  # fmt: skip
                procs.append(proc)
                targets.append(Target("vllm-router-kv", url, proc.pid))
        elif not args.no_vllm_router:
            print("  vllm-router not found (--vllm-router PATH): measured without it", file=sys.stderr, flush=True)
        if args.floor:
            port = free_port()
            proc = start([sys.executable, str(HERE / "floor_relay.py"), "--port", str(port), "--prefill",
                          pair.producer, "--decode", pair.consumer], tmp / "floor.log",
                         env={**os.environ, "PYTHONPATH": str(REPO)}, new_session=False)  # fmt: skip
            procs.append(proc)
            wait_port(port)
            targets.append(Target("floor", f"http://127.0.0.1:{port}", proc.pid))
        targets.append(Target("direct", pair.consumer, None, prefill_url=pair.producer))
        words = words_for(pair, args.prompt_tokens)
        print(f"  {words} random words a prompt (about {args.prompt_tokens} tokens); load average {load_before}",
              file=sys.stderr, flush=True)  # fmt: skip

        plan = [(c, args.tokens, args.block) for c in levels_c]
        if args.long_tokens:
            plan.append((args.per_token_concurrency, args.long_tokens, args.long_block))
        levels: list[dict[str, dict[str, Any]]] = []
        for c, tokens, size in plan:
            for target in targets:  # warm connections, pools and caches
                loadgen(target, pair, c, 2 * c, tokens, words)
            blocks: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
            for r in range(args.rounds):
                for target in targets if r % 2 == 0 else reversed(targets):
                    blocks[target.name].append(block(target, pair, c, max(size, c), tokens, words))
            levels.append(summarize_level(blocks, c, tokens))
            print(f"  measured concurrency {c}, {tokens} tokens", file=sys.stderr, flush=True)

        # Idle: every router up, no request, once the threads a router started for the
        # load (trio's thread cache keeps an idle worker 10 s) have ended.
        time.sleep(args.idle_settle_s)
        idle_start = {t.name: thread_cpu(t.pid) for t in targets if t.pid}
        time.sleep(args.idle_s)
        engines = len(pair.fleet["engines"])
        idle = {t.name: cpu_between(idle_start[t.name], thread_cpu(t.pid)) / args.idle_s * 1e3 / engines
                for t in targets if t.pid}  # fmt: skip
    finally:
        for proc in reversed(procs):
            stop(proc)

    per_token = per_token_us(levels, args.tokens, args.long_tokens, args.per_token_concurrency) if args.long_tokens else {}
    checks = verdicts(levels, per_token, idle, narwhals)
    report = {"levels": levels, "per_token_cpu_us": per_token, "idle_cpu_ms_per_s_per_engine": idle,
              "targets": checks, "builds": builds_of, "load_average": {"before": load_before, "after": loadavg()},
              "args": vars(args), "machine": {"cpus": os.cpu_count()}}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"\nwritten to {args.out}")
    failed = [f"{name} at c={lv['concurrency']}, {lv['tokens']} tokens: {lv['errors']} errors"
              for level in levels for name, lv in level.items() if lv["errors"]]  # fmt: skip
    failed += [f"{name} at c={lv['concurrency']}, {lv['tokens']} tokens: {lv['kv_external_per_request']:.0f} prompt "
               "tokens a request came over NIXL" for level in levels for name, lv in level.items()
               if lv["kv_external_per_request"] < 0.5 * args.prompt_tokens]  # fmt: skip
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'target':<18}{'conc':>5}{'tokens':>7}{'cpu ms/req':>11}{'(range)':>14}{'ttft p50':>9}{'+ttft':>7}"
          f"{'tpot p50':>9}{'+tpot':>7}{'KV ext/req':>11}{'local/req':>10}{'xfers':>6}{'err':>4}")  # fmt: skip
    for level in report["levels"]:
        for name, lv in level.items():
            cpu = lv["cpu_ms_per_request"]
            rng = lv["cpu_ms_per_request_range"]
            add_t, add_p = lv.get("added_ttft_p50_ms"), lv.get("added_tpot_p50_ms")
            print(f"{name:<18}{lv['concurrency']:>5}{lv['tokens']:>7}{'-' if cpu is None else f'{cpu:.2f}':>11}"
                  f"{'' if rng is None else f'{rng[0]:.2f}-{rng[1]:.2f}':>14}{lv['ttft_p50_ms']:>9.1f}"
                  f"{'' if add_t is None else f'{add_t:+.1f}':>7}{lv['tpot_p50_ms']:>9.2f}"
                  f"{'' if add_p is None else f'{add_p:+.2f}':>7}{lv['kv_external_per_request']:>11.0f}"
                  f"{lv['kv_local_compute_per_request']:>10.0f}{lv['kv_transfers_per_request']:>6.2f}{lv['errors']:>4}")  # fmt: skip
    for level in report["levels"]:
        names = list(level)
        for name, lv in level.items():
            if lv.get("cpu_vs_first_paired") is not None:
                ratio = lv["cpu_ms_per_request"] / level[names[0]]["cpu_ms_per_request"]
                print(f"  c={lv['concurrency']}, {lv['tokens']} tokens: {name} / {names[0]} CPU per request "
                      f"x{ratio:.3f} (medians), x{lv['cpu_vs_first_paired']:.3f} (median of the rounds' ratios)")
    for name, us in report["per_token_cpu_us"].items():
        print(f"  per-token relay CPU, {name}: {us:.1f} us a token")
    for name, ms in report["idle_cpu_ms_per_s_per_engine"].items():
        print(f"  idle CPU, {name}: {ms:.3f} ms a second per engine")
    print(f"  load average before {report['load_average']['before']}, after {report['load_average']['after']}")
    if report.get("args", {}).get("short"):
        # Five idle seconds come before the idle back-off's first step (10 s), and two
        # rounds of small blocks say nothing about ratios: no verdict from the short form.
        print("\ntargets: not judged by the short form (it checks that every target served and moved its KV)")
        return
    print("\ntargets:")
    for check in report["targets"]:
        value = check["value"]
        print(f"  {'met    ' if check['met'] else 'NOT MET'}  {check['target']}: {'n/a' if value is None else f'{value:.2f}'}")


if __name__ == "__main__":
    sys.exit(main())
