"""Router memory per open stream: Narwhal (and vllm-router) holding N streams at once.

Starts a producer and a consumer simulated engine (``narwhal sim``) whose decode step
takes ``--token-interval`` seconds, so a stream emits one token per interval and stays
open for the whole measurement, then for each router in turn (``narwhal serve``, and
vllm-router in PD mode when an executable is given with ``--vllm-router PATH`` or found
on PATH):

1. warm it up (a few complete requests, a few streams opened and closed), then read its
   idle RSS (VmRSS from /proc, summed over the router's process tree);
2. open ``--streams`` concurrent streaming completions from a lean client in its own
   process (this file with ``--client-of``: one keep-alive TCP connection per stream,
   hand-written HTTP), wait until every stream has its first token, sample the RSS a
   few times (the max is reported) and count the streams still open;
3. close every stream, wait until the consumer is idle and read the RSS again.

It prints idle and open RSS, (open - idle) / open streams in KiB against the target
(64 KiB per stream), the ratio against vllm-router, and writes everything as JSON.
A figure is only called met/missed when every requested stream was open while sampling.

    python tools/bench_memory.py --streams 2000 --out runs/bench_memory.json
    python tools/bench_memory.py --vllm-router ~/.venvs/vllm-router/bin/vllm-router

``--quick`` is the CI form (200 streams, a token every 0.2 s, two samples after a second;
seconds): the same
path, and the exit status 1 when a stream did not open or stay open, or a router could
not be measured; the figure itself never decides it (200 streams are too few for it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proctools import free_port, start, stop, wait_http

TARGET_KIB = 64.0
LOG = "--log-level=warning"  # one word: `pkill -f "narwhal --log-level WARNING ..."` elsewhere misses it
PROMPT = "the quick brown fox jumps over the lazy dog while the router keeps every stream open"


def raise_nofile(want: int) -> int:
    """Raise the soft open-file limit towards ``want`` (at most the hard limit); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return int(soft)


# ------------------------------------------------------------------ the client (own process)


def run_client(url: str, n: int, max_tokens: int, open_limit: int, open_timeout: float) -> None:
    """Open ``n`` streams; print {"event": "opened"} once each has its first token or failed,
    keep draining them until a line arrives on stdin, then print {"event": "closed"}."""
    import trio

    raise_nofile(n + 256)
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    st: dict[str, Any] = {"opened": 0, "live": 0, "ended_early": 0, "errors": {}, "error_samples": []}
    settled, all_settled = [0], trio.Event()

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def settle(error: str | None = None, detail: str = "") -> None:
        if error is not None:
            st["errors"][error] = st["errors"].get(error, 0) + 1
            if len(st["error_samples"]) < 5:
                st["error_samples"].append(f"{error}: {detail[:300]}")
        settled[0] += 1
        if settled[0] == n:
            all_settled.set()

    async def first_token(stream: trio.SocketStream, request: bytes) -> str | None:
        """Send the request, read to the first token event; None, or why not."""
        await stream.send_all(request)
        buf = b""
        while True:
            data = await stream.receive_some(65536)
            if not data:
                raise ConnectionError(f"closed before the first token: {buf[:200]!r}")
            buf += data
            if b"\r\n\r\n" in buf:
                if buf[9:12] != b"200":
                    return f"http {buf[9:12].decode(errors='replace')}"
                if b'"text"' in buf.split(b"\r\n\r\n", 1)[1]:
                    return None

    async def one(i: int, limiter: trio.CapacityLimiter) -> None:
        body = json.dumps({"model": "sim-llama", "prompt": f"{PROMPT} {i}", "max_tokens": max_tokens,
                           "stream": True, "ignore_eos": True}).encode()
        request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                   f"content-length: {len(body)}\r\n\r\n").encode() + body
        stream: trio.SocketStream | None = None
        try:
            async with limiter:
                try:
                    with trio.fail_after(open_timeout):
                        stream = await trio.open_tcp_stream(host, port)
                        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        error = await first_token(stream, request)
                except trio.TooSlowError:
                    return settle("no first token in time", f"stream {i}")
                except (OSError, ConnectionError, trio.BrokenResourceError, ValueError) as exc:
                    return settle(type(exc).__name__, str(exc))
                if error is not None:
                    return settle(error, f"stream {i}")
            st["opened"] += 1
            st["live"] += 1
            settle()
            with contextlib.suppress(OSError, trio.BrokenResourceError):
                while True:  # drain: the router must not buffer for a slow reader
                    data = await stream.receive_some(65536)
                    if not data or b"[DONE]" in data:
                        break
            st["live"] -= 1
            st["ended_early"] += 1
        finally:
            if stream is not None:
                await trio.aclose_forcefully(stream)

    async def main() -> None:
        limiter = trio.CapacityLimiter(open_limit)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i, limiter)
            while not all_settled.is_set() and trio.current_time() - t0 < open_timeout + n / 5:
                with trio.move_on_after(5):
                    await all_settled.wait()
                print(f"    client: {st['opened']}/{n} open, {sum(st['errors'].values())} errors",
                      file=sys.stderr, flush=True)
            emit({"event": "opened", "elapsed_s": trio.current_time() - t0, **st})
            await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            emit({"event": "closed", "live": st["live"], "ended_early": st["ended_early"]})
            nursery.cancel_scope.cancel()

    trio.run(main)


# ------------------------------------------------------------------ the measuring side


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` and all its descendants, KiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (OSError, AttributeError):
            continue
    return total


class Engines:
    """The ``narwhal sim`` process; :meth:`wait_idle` until its consumer runs nothing."""

    def __init__(self, proc: subprocess.Popen[bytes], consumer: str, log: Path) -> None:
        self.proc, self.consumer, self.log = proc, consumer, log

    def wait_idle(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the simulated engines exited (rc {self.proc.returncode}) during the "
                                   f"measurement; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.consumer}/metrics", timeout=5) as resp:
                    m = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)", resp.read().decode(), re.M)
                if m is None or float(m.group(1)) == 0:
                    return
            except OSError:
                pass  # the exit check above reports a dead engine process
            time.sleep(0.5)


def read_event(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the client exited (rc {proc.wait()}) without a report")
            event: dict[str, Any] = json.loads(line)
            return event
    raise RuntimeError(f"no report from the client within {timeout:.0f} s")


def hold_streams(url: str, n: int, args: argparse.Namespace, pid: int | None = None) -> dict[str, Any]:
    """Open ``n`` streams; while they are open sample ``pid``'s RSS; close them."""
    cmd = [sys.executable, __file__, "--client-of", url, "--streams", str(n), "--max-tokens", str(args.max_tokens),
           "--open-concurrency", str(args.open_concurrency), "--open-timeout", str(args.open_timeout)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        opened = read_event(proc, args.open_timeout + n / 5 + 60)
        samples: list[int] = []
        fds = -1
        if pid is not None and opened["opened"]:
            time.sleep(args.settle)
            for _ in range(args.samples):
                samples.append(rss_kib(pid))
                time.sleep(1.0)
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        assert proc.stdin is not None
        proc.stdin.write(b"close\n")
        proc.stdin.flush()
        closed = read_event(proc, 60)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"requested": n, "opened": opened["opened"], "open_s": opened["elapsed_s"],
            "live_after_sampling": closed["live"], "ended_early": closed["ended_early"],
            "errors": opened["errors"], "error_samples": opened["error_samples"],
            "rss_samples_kib": samples, "router_fds": fds}


def measure(name: str, url: str, pid: int, engines: Engines, args: argparse.Namespace) -> dict[str, Any]:
    subprocess.run([sys.executable, str(Path(__file__).parent / "loadgen.py"), "--url", url, "--concurrency", "8",
                    "--requests", "32", "--max-tokens", "2"], check=True, capture_output=True)
    hold_streams(url, 64, args)  # the open/abort path once at small scale
    engines.wait_idle()
    time.sleep(2.0)
    idle = int(statistics.median(rss_kib(pid) for _ in range(3)))
    print(f"  {name}: idle RSS {idle / 1024:.1f} MiB; opening {args.streams} streams", file=sys.stderr, flush=True)
    held = hold_streams(url, args.streams, args, pid)
    engines.wait_idle()
    time.sleep(2.0)
    after = rss_kib(pid)
    peak = max(held["rss_samples_kib"], default=0)
    n_open = held["live_after_sampling"]  # streams can only end, so at least this many were open
    per = (peak - idle) / n_open if n_open and peak else None
    complete = n_open == args.streams and held["opened"] == args.streams
    return {"target": name, **held, "idle_rss_kib": idle, "open_rss_kib": peak, "after_close_rss_kib": after,
            "kib_per_stream": per, "complete": complete,
            "meets_target": (per is not None and per <= TARGET_KIB) if complete else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=2000, help="concurrent open streams")
    parser.add_argument("--out", default="runs/bench_memory.json")
    parser.add_argument("--vllm-router", help="vllm-router executable, e.g. ~/.venvs/vllm-router/bin/vllm-router (default: on PATH)")
    parser.add_argument("--no-vllm-router", action="store_true", help="measure Narwhal only")
    parser.add_argument("--token-interval", type=float, default=1.0, help="seconds per decode step (per token)")
    parser.add_argument("--max-tokens", type=int, default=1200, help="output limit; streams are closed long before it")
    parser.add_argument("--open-concurrency", type=int, default=200, help="streams being opened at once")
    parser.add_argument("--open-timeout", type=float, default=120.0, help="seconds a stream may take to its first token")
    parser.add_argument("--samples", type=int, default=5, help="RSS samples, 1 s apart, while streams are open")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds to wait before sampling")
    parser.add_argument("--quick", action="store_true", help="the CI form: 200 streams, 0.2 s a token, 2 samples, 1 s settle")
    parser.add_argument("--client-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.streams, args.samples, args.settle, args.open_timeout = 200, 2, 1.0, 60.0
        args.token_interval = 0.2  # streams still last minutes (--max-tokens), the warm-up less
    if args.client_of:
        run_client(args.client_of, args.streams, args.max_tokens, args.open_concurrency, args.open_timeout)
        return 0

    nofile = raise_nofile(4 * args.streams + 1024)
    if nofile < 3 * args.streams + 512:
        sys.exit(f"open-file limit {nofile} is too low for {args.streams} streams (raise the hard limit, ulimit -Hn)")
    vr = None if args.no_vllm_router else (args.vllm_router or shutil.which("vllm-router"))
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-bench-memory-"))
    ports = {k: free_port() for k in ("p", "d", "pkv", "dkv", "router", "admin", "vr")}
    p_url, d_url = f"http://127.0.0.1:{ports['p']}", f"http://127.0.0.1:{ports['d']}"
    engines = [{"name": name, "url": url, "roles": [role],
                "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": ports[kv]}}
               for name, url, role, kv in (("producer", p_url, "prefill", "pkv"), ("consumer", d_url, "decode", "dkv"))]
    seqs = args.streams + 256
    sim = {"model": "sim-llama", "prefill": {"a": 0.0, "b": 0.0, "c": 0.0}, "transfer_s_per_token": 0.0,
           "decode": {"c0": args.token_interval, "c1": 0.0, "c2": 0.0}, "max_num_seqs": max(4096, seqs),
           "kv_capacity_tokens": seqs * (args.max_tokens + 128), "max_model_len": args.max_tokens + 1024}
    timeout = args.open_timeout + 60
    router_doc = {
        "server": {"host": "127.0.0.1", "port": ports["router"], "admin_port": ports["admin"],
                   "max_concurrent_requests": 100000, "keepalive_timeout_s": 3600.0},
        "engines": engines,
        "engine": {"first_token_timeout_s": timeout, "decode_read_timeout_s": timeout, "request_timeout_s": 36000.0},
        # A handoff's age takes in the prefill and the decode up to its first token.
        "handoff": {"max_age_s": timeout + 60},
        "journal": {"path": str(tmp / "journal.jsonl"), "fsync": False},
    }
    (tmp / "sim.json").write_text(json.dumps({"engines": [{**e, "sim": sim} for e in engines]}))
    (tmp / "router.json").write_text(json.dumps(router_doc))
    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start([sys.executable, "-m", "narwhal", LOG, "sim", "--fleet",
                            str(tmp / "sim.json")], tmp / "sim.log"))
        sims = Engines(procs[0], d_url, tmp / "sim.log")
        wait_http(f"{p_url}/health", proc=procs[0])
        wait_http(f"{d_url}/health", proc=procs[0])
        targets = [("narwhal", [sys.executable, "-m", "narwhal", LOG, "serve", "--fleet",
                                str(tmp / "router.json")], f"http://127.0.0.1:{ports['router']}")]
        if vr:
            targets.append(("vllm-router", [vr, "--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url,
                                            "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(ports["vr"]),
                                            "--prometheus-port", str(free_port())],
                            f"http://127.0.0.1:{ports['vr']}"))
        for name, cmd, url in targets:
            router = start(cmd, tmp / f"{name}.log")
            procs.append(router)
            try:
                wait_http(f"{url}/health", timeout=120, proc=router)
                rows.append(measure(name, url, router.pid, sims, args))
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                failures[name] = f"{type(exc).__name__}: {exc} (logs in {tmp})"
            finally:
                stop(router)
    finally:
        for proc in reversed(procs):
            stop(proc)
    print_table(rows, args.streams)
    for name, why in failures.items():
        print(f"{name}: NOT MEASURED: {why}")
    per = {r["target"]: r["kib_per_stream"] for r in rows}
    ratio = None
    if per.get("narwhal") and per.get("vllm-router"):
        ratio = per["narwhal"] / per["vllm-router"]
        print(f"\nnarwhal / vllm-router, KiB per stream: x{ratio:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"streams": args.streams, "target_kib_per_stream": TARGET_KIB,
                                          "token_interval_s": args.token_interval, "rows": rows,
                                          "narwhal_vs_vllm_router": ratio, "failures": failures, "logs": str(tmp),
                                          "machine": {"cpus": os.cpu_count(), "nofile": nofile}}, indent=2))
    print(f"written to {args.out} (logs in {tmp})")
    return 0 if all(r["complete"] for r in rows) and not failures else 1


def print_table(rows: list[dict[str, Any]], n: int) -> None:
    print(f"\n{'router':<13}{'open':>11}{'idle MiB':>10}{'open MiB':>10}{'after MiB':>11}{'KiB/stream':>12}"
          f"{'target':>8}{'met':>6}{'fds':>7}{'errors':>8}")
    for r in rows:
        per, met = r["kib_per_stream"], r["meets_target"]
        print(f"{r['target']:<13}{r['live_after_sampling']:>6}/{n:<4}{r['idle_rss_kib'] / 1024:>10.1f}"
              f"{r['open_rss_kib'] / 1024:>10.1f}{r['after_close_rss_kib'] / 1024:>11.1f}"
              f"{'-' if per is None else f'{per:.1f}':>12}{TARGET_KIB:>8.0f}"
              f"{'-' if met is None else ('yes' if met else 'NO'):>6}{r['router_fds']:>7}{sum(r['errors'].values()):>8}")
        if r["errors"] or r["ended_early"] or not r["complete"]:
            print(f"  {r['target']}: {r['opened']} of {r['requested']} opened, {r['ended_early']} ended before "
                  f"sampling finished, errors {r['errors']}; the figure is NOT for {n} streams")
            for s in r["error_samples"]:
                print(f"    {s}")


if __name__ == "__main__":
    sys.exit(main())
