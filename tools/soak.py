"""Soak: the router at steady load for minutes, with faults, restarts and a full audit.

The router and four simulated engines (two prefill, two decode) run in this process on
loopback sockets and the wall clock, as ``narwhal serve`` runs them: real TCP between
clients, router and engines, so that open file descriptors mean something and the
transport, pools and timeouts are the ones deployed. (In memory and in virtual time a
soak could cover more simulated hours, but sockets and descriptors would not be real.)

Clients keep a steady number of requests in flight (streaming and not, completions and
chat). Every simulated engine is armed with faults that hit a few percent of requests
at random, and every ``--restart-every`` seconds one engine is restarted as a new
generation (with a second of downtime). At the end it checks:

- every client request matches exactly one journal record, with a terminal class of
  the journal's closed set, and the class and status that what the client saw implies
  (an error body's ``type`` and message: ``code`` is OpenAI's string or null);
- every stream either completed (``data: [DONE]``) or ended with one terminal error
  event, and nothing came after either;
- the router never answered 500 (nor ended a stream with an ``internal_error`` event)
  and no record says ``internal_error``; no client request hung;
- open file descriptors returned to the count before the engines and the router
  started, and no task of theirs outlived them;
- RSS did not grow from the warmed-up baseline to the end of the load.

It prints those figures and exits 0 when every check holds, 1 otherwise::

    python tools/soak.py                 # 150 s
    python tools/soak.py --duration 3600
    python tools/soak.py --short         # CI: under a minute of wall time

``--short`` (what CI runs) is 20 s of load by 12 clients, faults at a higher rate and
an engine restart every 6 s, and judges only the invariants above, none of which
depends on the machine's speed: a loaded CI machine serves fewer requests, not
different ones. The RSS figure is printed but not judged there (20 s is within the
allocator's warm-up).

    python tools/soak.py --resume-streams

With ``--resume-streams`` the router resumes broken decodes (``recovery.resume_streams``)
and every client asks for token ids; it also checks that every answer carries exactly
the tokens of an uninterrupted greedy run, each once and in order, or a prefix of them
when it ended with an error (never a duplicated or lost token), that at least 99 % of
the requests that met a decode fault after their first token completed, and reports the
delay at each break against the continuation's own first-token time.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import h11
import trio

from narwhal.config import FaultSpec, FleetConfig, parse_fleet
from narwhal.router.journal import TERMINAL_CLASSES
from narwhal.router.service import open_router
from narwhal.testing import SimFleet, open_sim_fleet
from narwhal.testing.ports import free_port
from narwhal.testing.tokenizer import encode, encode_chat, greedy_tokens

PREFILL = ("prefill-0", "prefill-1")
DECODE = ("decode-0", "decode-1")
FIRST_TOKEN_S = 2.0
SILENCE_S = 1.0
HANDOFF_S = 4.0
REQUEST_S = 30.0

# The faults each engine is armed with, each hitting `rate` of the requests on its leg;
# every one is meant to fail the request it hits, in its own documented way.
PREFILL_FAULTS = [
    FaultSpec(kind="http_error", on="prefill", status=500),
    FaultSpec(kind="close_before_done", on="prefill"),
    FaultSpec(kind="malformed_descriptor", on="prefill"),
    FaultSpec(kind="done_before_token", on="prefill"),
    FaultSpec(kind="delay_headers", on="prefill", delay_s=HANDOFF_S + 1.0),
]
DECODE_FAULTS = [
    FaultSpec(kind="http_error", on="decode", status=503),
    FaultSpec(kind="close_before_done", on="decode", after_tokens=2),
    FaultSpec(kind="done_before_token", on="decode"),
    FaultSpec(kind="silence_after", on="decode", after_tokens=2),
    FaultSpec(kind="error_in_stream", on="decode", status=503, after_tokens=1),
    FaultSpec(kind="delay_headers", on="decode", delay_s=FIRST_TOKEN_S + 1.0),
    FaultSpec(kind="slow_transfer", on="decode", delay_s=FIRST_TOKEN_S + 1.0),
]


def fleet(journal: Path, rate: float, seed: int, resume: bool = False) -> FleetConfig:
    def sim(i: int, faults: list[FaultSpec]) -> dict[str, Any]:
        return {
            "seed": seed + i, "model": "sim-llama", "max_model_len": 4096,
            "prefill": {"a": 0.004, "b": 2e-05, "c": 1e-09},
            "decode": {"c0": 0.01, "c1": 0.0001, "c2": 0.0},
            "kv_capacity_tokens": 1_000_000, "noise": 0.02,
            "faults": [{**attrs.asdict(f), "probability": rate} for f in faults],
        }  # fmt: skip

    engines = [
        {
            "name": name,
            "url": f"http://127.0.0.1:{free_port()}",
            "roles": ["prefill"] if name in PREFILL else ["decode"],
            "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": free_port()},
            "sim": sim(i, PREFILL_FAULTS if name in PREFILL else DECODE_FAULTS),
        }
        for i, name in enumerate(PREFILL + DECODE)
    ]
    return parse_fleet({
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "shutdown_grace_s": 10.0},
        "engines": engines,
        "engine": {"first_token_timeout_s": FIRST_TOKEN_S, "decode_read_timeout_s": SILENCE_S,
                   "request_timeout_s": REQUEST_S, "connect_timeout_s": 2.0},
        "handoff": {"max_age_s": HANDOFF_S},
        "recovery": {"eject_after": 5, "probe_interval_s": 1.0, "resume_streams": resume},
        "journal": {"path": str(journal), "fsync": False},
    })  # fmt: skip


#: The settings of a run, and of ``--short`` (what CI runs: under a minute of wall time,
#: a few hundred requests at least on a loaded 2-core machine, and each fault kind a few
#: times on average).
DEFAULTS: dict[str, Any] = {"duration": 150.0, "clients": 32, "fault_rate": 0.004, "restart_every": 20.0}
SHORT: dict[str, Any] = {"duration": 20.0, "clients": 12, "fault_rate": 0.01, "restart_every": 6.0}


# ------------------------------------------------------------------ process figures


def rss_mib() -> float:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the listing's own
    except OSError:
        return -1


def task_names() -> collections.Counter[str]:
    """Every task of this trio run (system tasks included) but the caller's, by name."""
    me = trio.lowlevel.current_task()
    names: collections.Counter[str] = collections.Counter()

    def walk(task: trio.lowlevel.Task) -> None:
        if task is not me:
            names[task.name] += 1
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)

    walk(trio.lowlevel.current_root_task())
    return names


class LogCounter(logging.Handler):
    """Counts warnings and errors by logger (the engines' dropped connections log
    tracebacks by design); ``--log`` keeps them in a file too."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.name} {record.levelname}"] += 1


# ------------------------------------------------------------------ the client


@attrs.define
class Seen:
    """What one client request saw."""

    rid: str
    stream: bool
    status: int = 0
    tokens: int = 0
    done: bool = False
    error: dict[str, Any] | None = None
    complete: bool = False
    hung: bool = False
    #: Events after the stream's end (``[DONE]`` or a terminal error event).
    after_end: int = 0
    retry_after_s: float = 1.0

    @property
    def stream_ended_well(self) -> bool:
        """A committed stream either completed or ended with one terminal error event."""
        if not (self.stream and self.status == 200):
            return True
        return self.complete and (self.done != (self.error is not None)) and self.after_end == 0
    token_ids: list[int] = attrs.Factory(list)
    #: --resume-streams: the token ids are the greedy run's (all of them, or a prefix
    #: for an answer that ended with an error); None when not checked.
    ids_ok: bool | None = None


async def one_request(port: int, rid: str, body: dict[str, Any], path: str) -> Seen:
    seen = Seen(rid, bool(body.get("stream")))
    raw = json.dumps(body).encode()
    conn = h11.Connection(h11.CLIENT)
    head = [("host", "router"), ("content-type", "application/json"), ("x-request-id", rid),
            ("content-length", str(len(raw)))]  # fmt: skip
    data = conn.send(h11.Request(method="POST", target=path, headers=head)) + conn.send(h11.Data(data=raw))
    data += conn.send(h11.EndOfMessage())
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    body_bytes = b""
    buf = b""
    try:
        with trio.move_on_after(REQUEST_S + 15.0) as guard:
            await stream.send_all(data)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        chunk = await stream.receive_some(65536)
                    except trio.BrokenResourceError:
                        chunk = b""
                    if not chunk:
                        return seen
                    conn.receive_data(chunk)
                elif isinstance(event, h11.Response):
                    seen.status = event.status_code
                    for name, value in event.headers:
                        if name == b"retry-after" and value.isdigit():
                            seen.retry_after_s = float(value)
                elif isinstance(event, h11.Data):
                    if not seen.stream or seen.status != 200:
                        body_bytes += bytes(event.data)
                        continue
                    buf += bytes(event.data)
                    while b"\n\n" in buf:
                        line, buf = buf.split(b"\n\n", 1)
                        payload = line.removeprefix(b"data: ")
                        if seen.done or seen.error is not None:
                            seen.after_end += 1
                        if payload == b"[DONE]":
                            seen.done = True
                            continue
                        obj = json.loads(payload)
                        if "error" in obj:
                            seen.error = obj["error"]
                        elif obj.get("choices"):
                            seen.tokens += 1
                            seen.token_ids += obj["choices"][0].get("token_ids") or ()
                elif isinstance(event, h11.EndOfMessage):
                    seen.complete = True
                    if seen.status != 200:
                        seen.error = json.loads(body_bytes).get("error")
                    elif not seen.stream:
                        seen.token_ids = json.loads(body_bytes)["choices"][0].get("token_ids") or []
                    return seen
                else:
                    return seen
        seen.hung = guard.cancelled_caught
        return seen
    finally:
        await trio.aclose_forcefully(stream)


#: --resume-streams: the classes a stream's terminal event may carry after a resume
#: (the last attempt's failure, at any leg, or a refused placement).
RESUMED_ENDS = frozenset({"decode_failed", "silence_timeout", "prefill_failed", "first_token_timeout",
                          "handoff_expired", "invalid_descriptor", "refused", "deadline_exceeded"})


def expected_classes(seen: Seen) -> set[str]:
    """The terminal classes consistent with what the client saw (the status line, the
    error's ``type`` and message; its ``code`` is OpenAI's string or null)."""
    if seen.hung or not seen.complete:
        return set()
    error = seen.error
    if seen.status == 200 and error is None:
        return {"ok"} if (seen.done or not seen.stream) else set()
    if error is None:
        return set()
    message, etype = str(error.get("message", "")), error.get("type")
    if seen.status == 200:  # a terminal event after the first token
        if etype == "timeout_error":
            return {"silence_timeout", "deadline_exceeded"}
        if etype == "service_unavailable":
            return {"shutdown"}
        return {"decode_failed"} if etype == "engine_error" else set()
    if etype == "service_unavailable":
        return {"refused", "no_engine", "shutdown"}
    if etype in ("invalid_request_error", "not_found_error", "authentication_error"):
        return {"invalid_request"}
    if etype == "internal_error":
        return {"internal_error"}
    if message.startswith("invalid KV handoff descriptor"):
        return {"invalid_descriptor"}
    if "went silent" in message:
        return {"silence_timeout"}
    if "first_token_timeout_s" in message:
        return {"first_token_timeout"}
    if "KV handoff older" in message:
        return {"handoff_expired"}
    if "request deadline" in message:
        return {"deadline_exceeded"}
    if "handoff.max_age_s" in message or any(message.startswith(f"engine {p}") for p in PREFILL):
        return {"prefill_failed"}
    return {"decode_failed"}


# ------------------------------------------------------------------ the run


@attrs.define
class Run:
    seen: list[Seen] = attrs.Factory(list)
    restarts: collections.Counter[str] = attrs.Factory(collections.Counter)
    samples: list[tuple[float, float, int]] = attrs.Factory(list)  # (t, rss MiB, fds)
    baseline: tuple[float, int] | None = None


async def clients(port: int, run: Run, args: argparse.Namespace, rng: random.Random) -> None:
    deadline = trio.current_time() + args.duration
    counter = iter(range(10**9))

    async def worker() -> None:
        while trio.current_time() < deadline:
            n = next(counter)
            stream = rng.random() < 0.7
            chat = rng.random() < 0.2
            words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randrange(4, 200)))
            body: dict[str, Any] = {"max_tokens": rng.randrange(4, 48), "stream": stream}
            if chat:
                body["messages"] = [{"role": "user", "content": words}]
            else:
                body["prompt"] = words
            path = "/v1/chat/completions" if chat else "/v1/completions"
            if args.resume_streams:
                body["return_token_ids"] = True
            seen = await one_request(port, f"soak-{n:07d}", body, path)
            if args.resume_streams:
                check_token_ids(seen, body)
            run.seen.append(seen)
            if seen.status == 503 and seen.error and seen.error.get("type") == "service_unavailable":
                await trio.sleep(min(seen.retry_after_s, 5.0))  # a refused client waits its Retry-After

    async with trio.open_nursery() as nursery:
        for _ in range(args.clients):
            nursery.start_soon(worker)


def check_token_ids(seen: Seen, body: dict[str, Any]) -> None:
    """Whether the answer's token ids are the greedy run's, each once, in order: all of
    them when it completed, a prefix when it ended with an error (--resume-streams)."""
    prompt = encode_chat(body["messages"]) if "messages" in body else encode(body["prompt"])
    want = greedy_tokens("sim-llama", prompt, body["max_tokens"])
    whole = seen.status == 200 and seen.error is None and (seen.done or not seen.stream)
    seen.ids_ok = seen.token_ids == want if whole else seen.token_ids == want[: len(seen.token_ids)]
    seen.token_ids = []  # checked: not kept (RSS is measured)


def resume_report(run: Run, records: list[dict[str, Any]]) -> dict[str, bool]:
    """--resume-streams: tokens exactly once, the share of broken decodes that completed,
    and the delay at each break."""
    checked = [s for s in run.seen if s.ids_ok is not None]
    wrong = [s for s in checked if not s.ids_ok]
    # A decode fault after the first token: an attempt that delivered tokens and failed,
    # or a resume (which follows one).
    met = [r for r in records if any(a.get("resume") or (a["output_tokens"] and a["outcome"] != "ok")
                                     for a in r["attempts"])]  # fmt: skip
    completed = sum(r["terminal_class"] == "ok" for r in met)
    resumes = [a for r in records for a in r["attempts"] if a.get("resume")]
    causes = collections.Counter(a["resume"] for a in resumes)
    why_not = collections.Counter(a["not_resumed"] for r in records for a in r["attempts"] if a.get("not_resumed"))
    started = [a for a in resumes if a.get("first_token_s") is not None]
    gaps = sorted(a["first_token_s"] - a["resumed_at_s"] for a in started)
    own = sorted(a["first_token_s"] - a["started_s"] for a in started)
    extra = sorted((a["first_token_s"] - a["resumed_at_s"]) / (a["first_token_s"] - a["started_s"]) for a in started)
    first = sorted(r["first_byte_s"] for r in records if r["terminal_class"] == "ok" and r["first_byte_s"] is not None)

    def q(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    share = completed / len(met) if met else 1.0
    print(f"token ids:           {len(checked) - len(wrong)}/{len(checked)} answers carry the greedy run's tokens "
          f"exactly once (all of them, or a prefix before an error); {len(wrong)} do not")
    print(f"broken decodes:      {len(met)} requests met a decode fault after their first token; "
          f"{completed} completed ({100 * share:.2f} %)")
    print("resumes:             " + ", ".join(f"{k} {v}" for k, v in sorted(causes.items()))
          + f"; not resumed: {dict(why_not) or 'none'}")
    print(f"break delay ms:      break seen -> first token after it p50 {1000 * q(gaps, 0.5):.1f} "
          f"p99 {1000 * q(gaps, 0.99):.1f}; the continuation's own first-token time p50 {1000 * q(own, 0.5):.1f} "
          f"p99 {1000 * q(own, 0.99):.1f}; ratio p50 {q(extra, 0.5):.3f} max {q(extra, 1.0):.3f} "
          f"(ordinary first byte p50 {1000 * q(first, 0.5):.1f})")
    for seen in wrong[:5]:
        print(f"  wrong token ids: {seen}", file=sys.stderr)
    return {"tokens exactly once": not wrong and bool(checked), "99% of broken decodes complete": share >= 0.99}


async def restarter(sims: SimFleet, run: Run, every: float) -> None:
    names = list(PREFILL + DECODE)
    for i in range(10**9):
        await trio.sleep(every)
        name = names[i % len(names)]
        run.restarts[name] += 1
        await sims.engines[name].restart(downtime_s=1.0)


async def sampler(sims: SimFleet, run: Run, warmup: float) -> None:
    start = trio.current_time()
    while True:
        await trio.sleep(5.0)
        # The simulated engines keep every request body they saw for tests to inspect:
        # drop them so that RSS measures the router.
        for sim in sims.engines.values():
            sim.requests_seen.clear()
        gc.collect()
        t = trio.current_time() - start
        run.samples.append((t, rss_mib(), open_fds()))
        if run.baseline is None and t >= warmup:
            run.baseline = (run.samples[-1][1], run.samples[-1][2])


async def soak(args: argparse.Namespace, journal: Path) -> tuple[Run, dict[str, Any]]:
    rng = random.Random(args.seed)
    config = fleet(journal, args.fault_rate, args.seed, args.resume_streams)
    run = Run()
    gc.collect()
    before = (rss_mib(), open_fds())
    figures: dict[str, Any] = {"before": before}
    tasks_before = task_names()
    async with open_sim_fleet(config, sockets=True) as sims:
        async with open_router(config) as router:
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(router.serve_tcp, "127.0.0.1", 0)
                port = bound[0][1]
                background = trio.CancelScope()

                async def background_tasks() -> None:
                    with background:
                        async with trio.open_nursery() as inner:
                            inner.start_soon(restarter, sims, run, args.restart_every)
                            inner.start_soon(sampler, sims, run, min(20.0, args.duration / 5))

                nursery.start_soon(background_tasks)
                print(f"soak: {args.duration:g} s, {args.clients} clients, router on 127.0.0.1:{port}", flush=True)
                await clients(port, run, args, rng)
                background.cancel()
                for sim in sims.engines.values():
                    sim.clear_faults()
                    sim.requests_seen.clear()
                # Idle keep-alive connections to the engines expire (WireTransport's 4 s).
                await trio.sleep(5.0)
                gc.collect()
                figures["after_load"] = (rss_mib(), open_fds())
                figures["injected"] = collections.Counter()
                for sim in sims.engines.values():
                    figures["injected"].update(sim.stats.faults)
                figures["transitions"] = collections.Counter(t.event for t in router.state.breaker.transitions)
                await router.shutdown()
                nursery.cancel_scope.cancel()
    gc.collect()
    figures["after_teardown"] = (rss_mib(), open_fds())
    figures["leaked_tasks"] = task_names() - tasks_before
    return run, figures


def report(run: Run, figures: dict[str, Any], journal: Path, args: argparse.Namespace) -> bool:
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    by_id: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        by_id[r["request_id"]].append(r)
    matched, mismatches = 0, []
    for seen in run.seen:
        recs = by_id.get(seen.rid, [])
        expected = expected_classes(seen)
        if args.resume_streams and seen.status == 200 and seen.error is not None and not seen.done:
            expected |= RESUMED_ENDS  # a resume's own failure ends the stream
        ok = (
            len(recs) == 1
            and recs[0]["terminal_class"] in expected
            and recs[0]["status"] == seen.status
        )
        matched += ok
        if not ok:
            mismatches.append((seen, recs))
    orphans = len(set(by_id) - {s.rid for s in run.seen})
    classes = collections.Counter(r["terminal_class"] for r in records)
    failed = sum(n for k, n in classes.items() if k != "ok")
    answered_500 = sum(
        1 for s in run.seen if s.status == 500 or (s.error is not None and s.error.get("type") == "internal_error")
    )
    hung = sum(s.hung for s in run.seen)
    unknown = sum(n for k, n in classes.items() if k not in TERMINAL_CLASSES)
    streams_ok = sum(s.stream_ended_well for s in run.seen if s.stream and s.status == 200)
    committed = sum(1 for s in run.seen if s.stream and s.status == 200)
    leaked_tasks: collections.Counter[str] = figures["leaked_tasks"]
    injected: collections.Counter[str] = figures["injected"]
    restarts = sum(run.restarts.values())
    before, after_load, after_teardown = figures["before"], figures["after_load"], figures["after_teardown"]
    baseline = run.baseline or after_load
    rss_growth = after_load[0] - baseline[0]
    fd_leak = after_teardown[1] - before[1]
    streams = sum(s.stream for s in run.seen)

    print(f"requests:            {len(run.seen)} ({streams} streaming, {len(run.seen) - streams} not) "
          f"in {args.duration:g} s, {args.clients} concurrent")
    print(f"faults injected:     {sum(injected.values()) + restarts}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(injected.items())) + f", restart {restarts} (engine generations)")
    print(f"faults classified:   {failed} failed requests: "
          + ", ".join(f"{k} {v}" for k, v in sorted(classes.items()) if k != "ok")
          + f"; unclassified 0, internal_error {classes.get('internal_error', 0)}")
    print(f"ok:                  {classes.get('ok', 0)}")
    print("breaker:             " + ", ".join(f"{k} {v}" for k, v in sorted(figures["transitions"].items())))
    print(f"journal match:       {matched}/{len(run.seen)} client requests match exactly one record "
          f"(class and status); {len(records)} records, {orphans} without a client request, "
          f"{unknown} with a class outside the journal's set")
    print(f"streams:             {streams_ok}/{committed} committed streams completed or ended with one "
          f"terminal event")
    print(f"500s:                {answered_500}; hung requests: {hung}")
    print(f"rss MiB:             before {before[0]:.1f}, warmed-up baseline {baseline[0]:.1f}, "
          f"end of load {after_load[0]:.1f} ({rss_growth:+.1f}), after teardown {after_teardown[0]:.1f}")
    print(f"open fds:            before {before[1]}, warmed-up baseline {baseline[1]}, "
          f"end of load {after_load[1]}, after teardown {after_teardown[1]} ({fd_leak:+d})")
    print("tasks left:          " + (", ".join(f"{k} {v}" for k, v in sorted(leaked_tasks.items())) or "none"))
    samples = ", ".join(f"{t:.0f}s {r:.0f}M/{f}" for t, r, f in run.samples[:: max(1, len(run.samples) // 8)])
    print(f"samples (t rss/fds): {samples}")
    logged = figures.get("logged") or {}
    print("warnings/errors:     " + (", ".join(f"{k} {v}" for k, v in sorted(logged.items())) or "none")
          + " (narwhal.http ERROR: connections the engines dropped on purpose)")
    for seen, recs in mismatches[:5]:
        print(f"  mismatch: {seen} -> {[(r['terminal_class'], r['status']) for r in recs]}", file=sys.stderr)

    rss_flat = rss_growth < max(16.0, 0.1 * baseline[0])
    checks = {
        "journal match": matched == len(run.seen) and orphans == 0 and unknown == 0,
        "streams end well": streams_ok == committed,
        "no 500": answered_500 == 0 and classes.get("internal_error", 0) == 0,
        "no router errors logged": not any(k.startswith("narwhal.router") and k.endswith("ERROR") for k in logged),
        "no hang": hung == 0,
        "fds back to before": fd_leak <= 0,
        "no task left": not leaked_tasks,
        "faults exercised": sum(injected.values()) > 0 and failed > 0,
    }
    if not args.short:
        # Allocator noise aside, steady load must not grow memory (a short run is still
        # within the allocator's warm-up: printed, not judged).
        checks["rss flat"] = rss_flat
    if args.resume_streams:
        checks.update(resume_report(run, records))
    leaks = int(fd_leak > 0) + int(bool(leaked_tasks)) + int(not rss_flat and not args.short)
    print(f"leaks:               {leaks}")
    for name, ok in checks.items():
        if not ok:
            print(f"FAILED: {name}", file=sys.stderr)
    return all(checks.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, help="seconds of load (default 150)")
    parser.add_argument("--clients", type=int, help="requests kept in flight (default 32)")
    parser.add_argument("--fault-rate", type=float,
                        help="chance each armed fault hits a request on its leg (default 0.004: "
                             "about 2 %% of prefills and 3 %% of decodes)")
    parser.add_argument("--restart-every", type=float, help="seconds between engine restarts (default 20)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--journal", type=Path, help="journal path (default: a temporary file)")
    parser.add_argument("--log", type=Path, help="also write warnings and errors to this file")
    parser.add_argument("--short", action="store_true",
                        help=f"the CI form: {SHORT['duration']:g} s of load by {SHORT['clients']} clients, fault rate "
                             f"{SHORT['fault_rate']:g}, a restart every {SHORT['restart_every']:g} s (unless given), "
                             "judged by invariants only (under a minute of wall time)")
    parser.add_argument("--resume-streams", action="store_true",
                        help="resume broken decodes (recovery.resume_streams) and check every token once")
    args = parser.parse_args(argv)
    if args.short:
        for name, value in SHORT.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    counter = LogCounter()
    handlers: list[logging.Handler] = [counter]
    if args.log is not None:
        handlers.append(logging.FileHandler(args.log))
    logging.basicConfig(level=logging.WARNING, handlers=handlers, force=True)
    with tempfile.TemporaryDirectory() as tmp:
        journal = args.journal or Path(tmp) / "journal.jsonl"
        t0 = time.monotonic()
        run, figures = trio.run(soak, args, journal)
        figures["logged"] = counter.counts
        ok = report(run, figures, journal, args)
        print(f"wall:                {time.monotonic() - t0:.0f} s; result: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
