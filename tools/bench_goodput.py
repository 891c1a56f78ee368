"""Goodput under an SLO on a heterogeneous simulated fleet: Narwhal against vllm-router.

Starts a heterogeneous simulated fleet on loopback (``narwhal sim``: a fast and a slow
producer, a fast and a slow consumer), profiles it with ``narwhal profile`` (a small
sweep), then for each offered request rate runs ``narwhal bench`` (Poisson arrivals,
open loop) against:

- Narwhal with profile-priced placement (``profiles.path`` set, admission ``refuse``),
- Narwhal least-loaded (no profiles),
- vllm-router in PD mode with ``--policy round_robin``, when a ``vllm-router``
  executable is found (``--vllm-router PATH`` or on PATH),

and reports SLO attainment per rate (refused and failed requests count as misses) and
goodput at 90% attainment (the highest offered rate whose attainment is at least 0.9,
times that attainment). Writes JSON, and a PNG of attainment against offered rate
when matplotlib is installed (``pip install 'narwhal[plot]'``).

    python tools/bench_goodput.py --rates 4,8,12,16 --requests 200 --out runs/goodput.json

``--workload shared-prefix`` runs a prefill-bound fleet with prefix caching on
(:data:`PREFIX_FLEET`: a fast and a slow producer whose costs are those of a
32B-class model on an H100-class and an A100-class GPU, two consumers of the fast
kind) and prompts that share prefixes: K prefixes (``--prefixes``) of P tokens (``--prefix-len``), chosen
with Zipf (``--zipf-s``) or uniform popularity, each followed by 50-250 tokens of its
own, against Narwhal hit-aware (the default), Narwhal hit-blind
(``controller.prefix_cache: "off"``), Narwhal least-loaded and, when found,
vllm-router ``round_robin`` and ``cache_aware``; the SLO is TTFT 500 ms / TPOT 50 ms.
``--workload sessions`` sends multi-turn sessions instead: each turn repeats the
session's history (a shared system prompt, the earlier turns and stand-ins for their
answers) and adds 50-150 tokens; sessions start at the offered rate and a turn follows
the previous one after an exponential think time of 1 s mean (open loop). Both report
the producers' prefix-cache hit rate per router (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``) beside the oracle's (:func:`oracle_hit_rate`: every
prefix always on one producer, given the arrivals and the caches' capacity), the 503
count, and, from each priced router's journal (``narwhal bench join``), the median
TTFT prediction error per producer; then the issue's targets, each met or not.
``--baseline TREE`` adds ``narwhal-today``: the priced router of another source tree
(e.g. an export of the last release) on the same fleet and arrivals, for "no loss
against today" on the uniform workload. ``--routers a,b`` runs a subset.

``--warmup-s S`` (shared-prefix and sessions workloads) leaves the requests scheduled in
each run's first S seconds unscored, for every router alike (``narwhal bench --warmup``:
they are sent, they load the fleet and fill its caches, but are not in the attainment's
denominator). Each run starts with caches cold for its prefixes, and until the prefixes
are cached where they are needed every router loses requests that it would not lose
later; a run of a few hundred requests lasts seconds, so that start weighs on its
figure more than it does on a fleet serving the same prefixes for hours. With it the
tool reports the steady state (the attainment and goodput of the scored requests) and,
beside it, every request's (``all requests``), so that the start-up is not hidden.

    python tools/bench_goodput.py --workload shared-prefix --rates 12,16,20,24 --requests 600 --warmup-s 10

    python tools/bench_goodput.py --workload shared-prefix --rates 2,4,6,8 --requests 200

``--prefix-fleet slow`` (shared-prefix and sessions workloads) runs them on
:data:`SLOW_PREFIX_FLEET` instead: a slower fleet whose coefficients are derived from
the figures measured black box on one (not tuned to any router's result): a cold
1,174-token prompt ~1.05 s on the fast producer, so that a miss never meets the 500 ms
TTFT target on any producer, and a prompt with its 1,024-token prefix cached 60 ms
(50 tokens of its own) to 150 ms (150 of its own). On such a fleet a prefix that no
producer holds must be computed once, late, before any of its requests can meet the
target.

    python tools/bench_goodput.py --workload shared-prefix --prefix-fleet slow --rates 2,4,6,8 --requests 300

``--chunked-prefill N`` has every simulated engine schedule its prompts as vLLM V1 does
(``sim.max_num_batched_tokens`` N): one prefill step computes the queued prompts
together, up to N prompt tokens, for one fixed cost. Without it an engine computes one
prompt a step.

    python tools/bench_goodput.py --workload shared-prefix --chunked-prefill 2048 --rates 16,24,32,40

``--replicas N`` measures router replicas instead: the same fleet and the same arrivals
(uniform workload) against one priced router, and against N priced ``narwhal serve``
processes behind a round-robin client (``narwhal bench --url A --url B``), once with
each replica reading the engines' load every ``--poll`` seconds (``--engine-load-poll``:
each counts what the others placed) and once without (each blind to the others). It
prints attainment per rate and goodput at 90% side by side, and the ratio of the
replicas' to the one router's.

    python tools/bench_goodput.py --replicas 2 --poll 0.25 --rates 8,12,16,20 --requests 200

``--workers N`` adds the priced (hit-aware) router served by ``narwhal serve --workers
N`` (one port; the workers share engine load by reading the engines' load every
``--poll`` seconds), beside the same router with one worker, so that placement quality
with workers is measured against it on the same arrivals.

    python tools/bench_goodput.py --workers 2 --rates 4,8,12,16 --requests 120
    python tools/bench_goodput.py --workers 2 --workload shared-prefix --chunked-prefill 2048 \
        --rates 24,32,40 --requests 600 --warmup-s 10 --routers narwhal-hit-aware,narwhal-priced-2-workers

``--quick`` is the CI form of any of these: one rate (4 requests/s unless ``--rates`` names
others: the first of them), 30 requests a router; seconds. It exits 1 when a request
fails (anything but a success or a refusal), a router serves no request, or a journal
cannot be joined; never on a figure.

    python tools/bench_goodput.py --quick
    python tools/bench_goodput.py --quick --workload shared-prefix
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachebench import (
    CAPACITY,
    CONSUMER_CAPACITY,
    ISSUE_FLEET,
    ceiling,
    issue_targets,
    multi_turn_trace,
    request_counts,
    shares,
)
from proctools import free_port, start, stop, wait_http

from narwhal.bench.journal import prediction_by_producer
from narwhal.bench.records import RequestResult
from narwhal.bench.report import SLO as Targets

#: Sweeps of `narwhal profile` before the run gives up on an engine whose fit was rejected.
PROFILE_ATTEMPTS = 3
SLO = {"ttft_ms": 150, "tpot_ms": 10}
SHARED_SLO = {"ttft_ms": 500, "tpot_ms": 50}
PROMPT = "uniform:150:250"
OUTPUT = "uniform:20:60"


def shared_prefix_trace(path: Path, *, rate: float, n: int, prefixes: int, prefix_len: int,
                        zipf_s: float | None, seed: int, tag: str) -> list[tuple[str, int]]:  # fmt: skip
    """A JSON-lines trace: Poisson arrivals, a popular prefix and a tail of its own each.

    ``tag`` names the prefixes: another tag gives prefixes no engine has cached yet.
    Returns each request's prompt and prefix number, in order.
    """
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf_s if zipf_s else 1.0 for k in range(prefixes)]
    heads = [" ".join(f"{tag}h{k}w{j}" for j in range(prefix_len)) for k in range(prefixes)]
    t = 0.0
    out: list[tuple[str, int]] = []
    with path.open("w") as fh:
        for i in range(n):
            k = rng.choices(range(prefixes), weights)[0]
            tail = " ".join(f"r{i}w{j}" for j in range(rng.randint(50, 250)))
            out.append((f"{heads[k]} {tail}", k))
            fh.write(json.dumps({"offset_s": t, "prompt": out[-1][0], "output_len": rng.randint(20, 60)}) + "\n")
            t += rng.expovariate(rate)
    return out


def sessions_trace(path: Path, *, rate: float, n: int, prefixes: int, prefix_len: int, turns: int,
                   seed: int, tag: str) -> list[tuple[str, int]]:  # fmt: skip
    """Multi-turn sessions: each turn repeats the session's history and adds to it.

    Returns each request's prompt and its session's prefix number, in order.
    """
    rng = random.Random(seed)
    heads = [" ".join(f"{tag}h{k}w{j}" for j in range(prefix_len)) for k in range(prefixes)]
    lines: list[tuple[float, str, int, int]] = []
    start, s = 0.0, 0
    while len(lines) < n:
        history, t = heads[s % prefixes], start
        for turn in range(turns):
            user = " ".join(f"s{s}t{turn}u{j}" for j in range(rng.randint(50, 150)))
            out = rng.randint(20, 60)
            history = f"{history} {user}"
            lines.append((t, history, out, s % prefixes))
            history += " " + " ".join(f"s{s}t{turn}a{j}" for j in range(out))  # a stand-in answer
            t += rng.expovariate(1.0)
        s += 1
        start += rng.expovariate(rate)
    lines.sort(key=lambda x: x[0])
    with path.open("w") as fh:
        for offset, prompt, out, _ in lines[:n]:
            fh.write(json.dumps({"offset_s": offset, "prompt": prompt, "output_len": out}) + "\n")
    return [(prompt, group) for _, prompt, _, group in lines[:n]]


def oracle_hit_rate(requests: list[tuple[str, int]], capacity_tokens: dict[str, int], block: int) -> float:
    """The producers' prefix-cache hit rate (hit over queried prompt tokens) of the best
    partition of prefixes over producers, given the arrivals and the caches' capacity.

    The oracle sends every request of a prefix (a shared-prefix workload's head; every
    turn of a session, by its system prompt) to the one producer that prefix is given:
    prefixes in decreasing popularity, each to the producer with the fewest requests
    per block of capacity given so far. Each producer caches as vLLM does (whole
    blocks of the prompt, a request hits the longest run of its leading blocks held,
    short of its last token; least recently used blocks go first when it is full), but
    holds no block for a request in flight, so it keeps at least what an engine keeps:
    no router placing on these producers can hit more than this, short of luck in the
    engines' eviction order. Tokens are words, as on the simulated engines.
    """
    counts: dict[int, int] = {}
    for _, group in requests:
        counts[group] = counts.get(group, 0) + 1
    given: dict[str, int] = dict.fromkeys(capacity_tokens, 0)
    owner: dict[int, str] = {}
    for group in sorted(counts, key=lambda g: (-counts[g], g)):
        name = min(given, key=lambda n: (given[n] / capacity_tokens[n], n))
        owner[group] = name
        given[name] += counts[group]
    caches: dict[str, dict[int, None]] = {name: {} for name in capacity_tokens}
    hits = queries = 0
    for prompt, group in requests:
        words = prompt.split()
        cache = caches[owner[group]]
        keys: list[int] = []  # chained block keys, as the engines hash blocks
        for i in range(len(words) // block):
            keys.append(hash((keys[-1] if keys else 0, tuple(words[i * block:(i + 1) * block]))))
        hit = 0
        for key in keys[: (len(words) - 1) // block]:
            if key not in cache:
                break
            hit += 1
        hits += hit * block
        queries += len(words)
        for key in keys:  # most recently used last
            cache.pop(key, None)
            cache[key] = None
        while len(cache) > capacity_tokens[owner[group]] // block:
            del cache[next(iter(cache))]
    return hits / queries if queries else 0.0


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """Summed ``vllm:prefix_cache_hits`` and ``_queries`` of the engines at ``urls``."""
    hits = queries = 0.0
    for url in urls:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        for name, value in re.findall(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} (\S+)$", text, re.M):
            if name == "hits":
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries










def profile_fleet(
    sweep: list[str], profiles: Path, names: list[str],
    run: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None,
) -> str | None:
    """Run ``narwhal profile`` (its arguments ``sweep``, writing ``profiles``) until every
    engine of ``names`` has a profile: an engine whose fit a sweep rejected for noise (a
    busy machine) is measured again alone (``--engines``) and merged into the same file,
    up to :data:`PROFILE_ATTEMPTS` sweeps. Returns why it failed (None: every engine)."""
    if run is None:
        def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(argv, check=False, capture_output=True, text=True)
    missing: list[str] = []
    reports: list[str] = []
    for _ in range(PROFILE_ATTEMPTS):
        which = ["--engines", ",".join(missing)] if missing else ["--overwrite"]
        done = run(narwhal(*sweep, *which))
        reports.append(f"({done.returncode}):\n{done.stdout}{done.stderr}")
        if done.returncode not in (0, 1) or not profiles.is_file():
            break
        held = json.loads(profiles.read_text()).get("engines", {})
        missing = [n for n in names if n not in held]
        if not missing:
            return None
    return "narwhal profile failed " + "\nthen ".join(reports)


def narwhal(*args: str) -> list[str]:
    return [sys.executable, "-m", "narwhal", "--log-level", "WARNING", *args]


def fleet(ports: dict[str, int], *, caching: bool = False, kind: str = "default") -> list[dict[str, Any]]:
    """The simulated fleet: the uniform workload's (``caching`` off), or the
    prefill-bound fleet of the shared-prefix and sessions workloads (``caching`` on;
    ``kind`` one of :data:`PREFIX_FLEETS`)."""

    def eng(name: str, role: str, prefill: dict[str, float], decode: dict[str, float],
            **sim: Any) -> dict[str, Any]:  # fmt: skip
        return {
            "name": name, "url": f"http://127.0.0.1:{ports[name]}", "roles": [role], "model": "sim-llama",
            "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": ports[name + "-kv"]},
            "sim": {"model": "sim-llama", "prefill": prefill, "decode": decode, "noise": 0.01, "seed": len(name),
                    "prefix_caching": caching, "prompt_tokens_details": caching, **sim},
        }  # fmt: skip

    if caching and kind.startswith("issue:"):  # the cache plan's fleet; its producers' cache per workload
        capacity = CAPACITY[kind.split(":", 1)[1]]
        return [eng(name, role, pre, dec, transfer_s_per_token=1e-5, max_model_len=8192,
                    kv_capacity_tokens=capacity if role == "prefill" else CONSUMER_CAPACITY)
                for name, (role, pre, dec) in ISSUE_FLEET.items()]  # fmt: skip
    if caching:
        return prefix_fleet(eng, kind)
    fast_decode = {"c0": 0.004, "c1": 0.0002, "c2": 1e-7}
    return [
        eng("p-fast", "prefill", {"a": 0.010, "b": 1e-4, "c": 0.0}, fast_decode),
        eng("p-slow", "prefill", {"a": 0.030, "b": 3e-4, "c": 0.0}, fast_decode),
        eng("d-fast", "decode", {"a": 0.010, "b": 1e-4, "c": 0.0}, fast_decode),
        eng("d-slow", "decode", {"a": 0.010, "b": 1e-4, "c": 0.0}, {"c0": 0.012, "c1": 0.0006, "c2": 3e-7}),
    ]


#: The prefill-bound fleet of the shared-prefix workloads, priced from the hardware: a
#: 32B-class dense model (64 layers, hidden 5,120, 8 KV heads of 128: 64 GFLOP a
#: prompt token, 6.6e5*L**2 FLOP of attention for L tokens, 256 KiB of bf16 KV a
#: token), one engine a GPU of 80 GB: the weights leave about 8 GiB of KV, 32,768
#: tokens. Prefill is compute-bound: the fast producer an H100-class GPU at ~35% of its
#: 989 TFLOP/s dense bf16 (b = 64e9 / 346e12 = 1.85e-4 s a token), the slow one an
#: A100-class at ~40% of 312 (b = 5.1e-4), c the attention at the same rates, a the
#: fixed cost of a step (scheduling, launch, sampling). A 1,174-token prompt costs
#: 245 ms on the fast producer and 640 ms on the slow one (above the 500 ms TTFT
#: target: the slow producer meets it only with a cached prefix); with 1,024 tokens
#: cached, 53 ms and 113 ms. Decode is memory-bound: both consumers H100-class
#: (3.35 TB/s at ~75%: 64 GB of weights in 25 ms a step, 1e-7 s a resident KV token),
#: so that TPOT stays well under 50 ms at the rates the producers carry (the fleet is
#: prefill-bound). KV moves at 1e-5 s a token (256 KiB over ~25 GB/s).
PREFIX_FLEET = {
    "p-fast": ("prefill", {"a": 0.025, "b": 1.85e-4, "c": 1.9e-9}),
    "p-slow": ("prefill", {"a": 0.035, "b": 5.1e-4, "c": 5.3e-9}),
    "d-0": ("decode", {"a": 0.025, "b": 1.85e-4, "c": 1.9e-9}),
    "d-1": ("decode", {"a": 0.025, "b": 1.85e-4, "c": 1.9e-9}),
}
PREFIX_DECODE = {"c0": 0.025, "c1": 1.5e-4, "c2": 1e-7}


#: A slower prefix-caching fleet, derived from figures measured black box on one (a
#: cold 1,174-token prompt predicted ~1.05 s, cached-prefix prompts served in 60-150
#: ms): the fast producer's coefficients solve a + 1,174 b + 1,174**2 c = 1.05 s and
#: a + 50 b + (1,074**2 - 1,024**2) c = 60 ms (1,024 tokens cached, 50 of its own),
#: with c / b kept at the 32B model's attention share above (c = 1.03e-5 b); then a
#: prompt with 150 tokens of its own costs 149 ms with the prefix cached, 250 tokens 238
#: ms. The figures say nothing of the slow producer: it keeps PREFIX_FLEET's slow/fast
#: ratios (a x1.4, b and c x2.76): a miss 2.9 s, a hit 0.16-0.64 s. The consumers decode
#: as PREFIX_FLEET's (the figures say nothing of decode; TPOT is not what binds).
SLOW_PREFIX_FLEET = {
    "p-fast": ("prefill", {"a": 0.015, "b": 8.7e-4, "c": 9.0e-9}),
    "p-slow": ("prefill", {"a": 0.021, "b": 2.4e-3, "c": 2.5e-8}),
    "d-0": ("decode", {"a": 0.015, "b": 8.7e-4, "c": 9.0e-9}),
    "d-1": ("decode", {"a": 0.015, "b": 8.7e-4, "c": 9.0e-9}),
}
PREFIX_FLEETS = {"default": PREFIX_FLEET, "slow": SLOW_PREFIX_FLEET,
                 "issue": {name: (role, pre) for name, (role, pre, _) in ISSUE_FLEET.items()}}  # fmt: skip


def prefix_fleet(eng: Any, kind: str = "default") -> list[dict[str, Any]]:
    return [eng(name, role, prefill, PREFIX_DECODE, kv_capacity_tokens=32768, transfer_s_per_token=1e-5)
            for name, (role, prefill) in PREFIX_FLEETS[kind].items()]  # fmt: skip


def warmup_count(trace: Path, seconds: float) -> int:
    """The requests of ``trace`` scheduled in its first ``seconds``."""
    return sum(json.loads(line)["offset_s"] < seconds for line in trace.read_text().splitlines())


def all_requests(results: Path, slo_ms: dict[str, int]) -> tuple[float | None, int]:
    """SLO attainment over every request of a run, warm-up ones included (the same rule
    as ``narwhal bench``'s: refused and failed requests are misses), and its 503s."""
    slo = Targets(ttft_s=slo_ms["ttft_ms"] / 1000, tpot_s=slo_ms["tpot_ms"] / 1000)
    names = {f.name for f in RequestResult.__attrs_attrs__}
    rows = [RequestResult(**{k: v for k, v in json.loads(line).items() if k in names})
            for line in (results / "results.jsonl").read_text().splitlines()]  # fmt: skip
    rows = [r for r in rows if r.terminal_class != "client_cancelled"]
    refused = sum(r.terminal_class == "refused" for r in rows)
    return (sum(map(slo.meets, rows)) / len(rows) if rows else None), refused


def goodput_at_90(points: list[dict[str, Any]], key: str = "attainment") -> float:
    """The highest offered rate whose attainment (``key``) is at least 0.9, times it."""
    return max((p["rate"] * p[key] for p in points if p[key] is not None and p[key] >= 0.9), default=0.0)


def bench(urls: list[str], rate: float, n: int, out: Path, *, slo: dict[str, int],
          trace: Path | None = None, warmup: int = 0) -> dict[str, Any]:  # fmt: skip
    """``narwhal bench`` against ``urls`` (several: round robin, as a load balancer would);
    the first ``warmup`` requests are not scored."""
    workload = (["--trace", str(trace)] if trace is not None else
                ["--rate", str(rate), "--input-len", PROMPT, "--output-len", OUTPUT])  # fmt: skip
    workload += ["--warmup", str(warmup)] if warmup else []
    targets = [arg for url in urls for arg in ("--url", url)]
    subprocess.run(
        narwhal("bench", *targets, "--out", str(out), "--overwrite", *workload, "--num-requests",
                str(n), "--seed", "1", "--no-progress",
                "--slo-ttft", f"{slo['ttft_ms']}ms", "--slo-tpot", f"{slo['tpot_ms']}ms", "--model", "sim-llama"),
        check=True, capture_output=True,
    )  # fmt: skip
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def refusals(results: Path, errors: dict[str, dict[str, Any]], slo_ms: dict[str, int]) -> list[dict[str, Any]]:
    """The refused requests of one run (scored ones): the prediction each names, how far over its
    target it was (``margin``, a share of the target) and the router's median TTFT
    prediction error on that producer (``error``)."""
    out = []
    for line in (results / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("terminal_class") != "refused" or rec.get("warmup"):
            continue
        message = (rec.get("error") or {}).get("message") or ""
        m = re.search(r"predicted TTFT ([\d.]+) ms on (\S+?)[ ,].*TPOT ([\d.]+) ms", message)
        if m is None:
            out.append({"message": message, "margin": 0.0, "error": 0.0})
            continue
        ttft, producer, tpot = float(m[1]), m[2], float(m[3])
        margin = max(ttft / slo_ms["ttft_ms"], tpot / slo_ms["tpot_ms"]) - 1.0
        err = (errors.get(producer) or {}).get("ttft_error", {}).get("p50") or 0.0
        out.append({"message": message, "margin": margin, "error": err})
    return out


def targets_met(routers: dict[str, Any], errors: dict[str, dict[str, dict[str, Any]]], rates: list[float], *,
                shared: bool, oracle: dict[float, float], lead: str, slo_ms: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    """Print and return the issue's targets, each with its figures and whether it is met."""
    out: dict[str, Any] = {}
    print("\ntargets:")
    if lead not in routers:
        return out
    points = routers[lead]["points"]
    g = routers[lead]["goodput_at_90"]

    def show(key: str, met: bool | None, text: str) -> None:
        out[key] = {"met": met, "detail": text}
        print(f"  [{'met' if met else 'NOT met' if met is not None else 'n/a'}] {key}: {text}")

    if shared:
        ca = routers.get("vllm-router-cache-aware")
        if ca is not None:
            base = ca["goodput_at_90"]
            show("goodput >= 2x vllm-router cache_aware", (base > 0 and g >= 2 * base) or (base == 0 and g > 0),
                 f"{g:.2f} vs {base:.2f} req/s" + (f" (x{g / base:.2f})" if base else ""))
        measured = [p["prefix_hit_rate"] for p in points if p["prefix_hit_rate"] is not None]
        best = [oracle[p["rate"]] for p in points if p["prefix_hit_rate"] is not None and p["rate"] in oracle]
        if measured and best:
            m, b = sum(measured) / len(measured), sum(best) / len(best)
            show("hit rate within 10% of the best partition", m >= 0.9 * b,
                 f"{m:.3f} vs oracle {b:.3f} (x{m / b:.3f}), mean over rates")
        limit = next((p["rate"] for p in points if p["attainment"] < 0.9), None)
        early = [p for p in points if limit is None or p["rate"] < limit]
        refused = sum(p["by_class"].get("refused", 0) for p in early)
        # A refusal names its predicted TTFT: one predicted over the target by less than
        # the router's median prediction error on that producer may have been a success.
        doubtful = [r for p in early for r in refusals(Path(p["results"]), errors.get(lead, {}), slo_ms)
                    if r["margin"] <= r["error"]]  # fmt: skip
        show("no 503 below the rate where the SLO is really exceeded", not doubtful,
             f"{refused} refused below {f'{limit:g}/s' if limit is not None else 'the highest rate run'} "
             "(the lowest rate where the hit-aware router's attainment fell below 0.9), "
             f"{len(doubtful)} of them predicted over the target by no more than the median prediction error")
    else:
        for other in ("narwhal-today", "narwhal-hit-blind"):
            if other in routers:
                o = routers[other]["goodput_at_90"]
                show(f"no loss against {other}", g >= 0.9 * o, f"{g:.2f} vs {o:.2f} req/s goodput at 90% "
                     "(met: within 10%, the run-to-run noise of one point)")
    worst = [(e["ttft_error"]["p50"], producer) for producer, e in errors.get(lead, {}).items()
             if e["ttft_error"].get("n")]  # fmt: skip
    if worst:
        err = max(worst)[0]
        show("median TTFT prediction error <= 15% per engine", err <= 0.15,
             ", ".join(f"{p} {e:.3f}" for e, p in sorted(worst, key=lambda x: x[1])))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", help="offered request rates, comma-separated (default 4,8,12,16,20)")
    parser.add_argument("--requests", type=int, default=200, help="requests per rate and router")
    parser.add_argument("--out", default="runs/goodput.json")
    parser.add_argument("--vllm-router", help="path of the vllm-router executable")
    parser.add_argument("--workload", choices=("uniform", "shared-prefix", "sessions", "multi-turn"), default="uniform",
                        help="multi-turn: 32 conversations at once over 4 system prompts of 512 tokens, 50-200 "
                             "tokens a turn, up to 3,000 of history (tools/cachebench.py)")
    parser.add_argument("--prefixes", type=int, default=8, help="shared prefixes (shared-prefix, sessions)")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens per shared prefix")
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of prefix popularity; 0: uniform")
    parser.add_argument("--prefix-fleet", choices=tuple(PREFIX_FLEETS), default="default",
                        help="the fleet of the shared-prefix and sessions workloads: default (a 32B-class model on "
                             "an H100- and an A100-class producer) or slow (derived from figures measured black box "
                             "on a slower fleet: a cold 1,174-token prompt ~1.05 s on the fast producer, a cached "
                             "1,024-token prefix 60-150 ms; see SLOW_PREFIX_FLEET)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session (sessions)")
    parser.add_argument("--kv-events", action="store_true",
                        help="every simulated engine publishes its KV events (ZeroMQ, as vLLM's --kv-events-config): "
                             "Narwhal follows them, and vllm-router kv_aware runs on its producers' (--pd-kv-events)")
    parser.add_argument("--replicas", type=int, default=0,
                        help="N >= 2: N router replicas behind a round-robin client against one router")
    parser.add_argument("--poll", type=float, default=0.25,
                        help="the replicas' or workers' engine load poll period, seconds (--replicas, --workers)")
    parser.add_argument("--workers", type=int, default=1,
                        help="N >= 2: also the priced router with narwhal serve --workers N")
    parser.add_argument("--profile-repeats", type=int, default=3,
                        help="narwhal profile --repeats (more on a noisy machine)")
    parser.add_argument("--baseline", metavar="TREE",
                        help="also run the priced router of another source tree (e.g. a checkout of the last "
                             "release) as narwhal-today, same fleet and arrivals")
    parser.add_argument("--routers", help="comma-separated subset of the routers to run (default: all)")
    parser.add_argument("--chunked-prefill", type=int, metavar="N",
                        help="every simulated engine computes its queued prompts together, N prompt tokens a step "
                             "at most (vLLM V1's chunked prefill, sim.max_num_batched_tokens)")
    parser.add_argument("--warmup-s", type=float, default=0.0,
                        help="leave the requests of each run's first S seconds unscored, every router alike "
                             "(shared-prefix, sessions); both figures are reported")
    parser.add_argument("--quick", action="store_true",
                        help="the CI form: one rate (4/s, or the first of --rates), 30 requests")
    args = parser.parse_args()
    if args.quick:
        args.rates, args.requests = (args.rates or "4").split(",")[0], 30
    args.rates = args.rates or "4,8,12,16,20"
    if args.warmup_s < 0 or (args.warmup_s and args.workload == "uniform"):
        parser.error("--warmup-s takes S >= 0 seconds, with the shared-prefix or sessions workload")
    if args.chunked_prefill is not None and args.chunked_prefill < 1:
        parser.error("--chunked-prefill takes N >= 1 prompt tokens a step")
    if args.prefix_fleet != "default" and args.workload == "uniform":
        parser.error("--prefix-fleet goes with the shared-prefix or sessions workload")
    if args.workload == "multi-turn" and args.prefix_fleet != "issue":
        parser.error("--workload multi-turn goes with --prefix-fleet issue")
    if args.kv_events and args.workload == "uniform":
        parser.error("--kv-events goes with a cached workload")
    if args.replicas == 1 or args.replicas < 0 or (args.replicas and args.workload != "uniform"):
        parser.error("--replicas takes N >= 2, with the uniform workload")
    if args.workers < 1 or (args.workers > 1 and args.replicas):
        parser.error("--workers takes N >= 1; N >= 2 without --replicas")
    rates = [float(r) for r in args.rates.split(",")]
    shared = args.workload != "uniform"
    slo_ms = SHARED_SLO if shared else SLO
    vr = args.vllm_router or shutil.which("vllm-router")
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-goodput-"))
    names = list(PREFIX_FLEETS[args.prefix_fleet]) if shared else ["p-fast", "p-slow", "d-fast", "d-slow"]
    ports = {k: free_port() for k in [*names, *(n + "-kv" for n in names), *(n + "-pub" for n in names),
                                      *(n + "-replay" for n in names), "priced", "least", "vr", "a1", "a2",
                                      "blind", "a3", "vrc", "workers", "a4", "greedy", "a5", "vrk"]}  # fmt: skip
    kind = f"issue:{'multi-turn' if args.workload == 'multi-turn' else 'shared-prefix'}" if (
        args.prefix_fleet == "issue") else args.prefix_fleet  # fmt: skip
    engines = fleet(ports, caching=shared, kind=kind)
    if args.kv_events:  # each engine binds its PUB and replay endpoints, as vLLM's tcp://*:P does
        for e in engines:
            e["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{ports[e['name'] + '-pub']}",
                              "replay_endpoint": f"tcp://127.0.0.1:{ports[e['name'] + '-replay']}"}  # fmt: skip
    if args.chunked_prefill is not None:
        for e in engines:
            e["sim"]["max_num_batched_tokens"] = args.chunked_prefill
    producer_engines = [e for e in engines if e["roles"] == ["prefill"]]
    consumer_engines = [e for e in engines if e["roles"] == ["decode"]]
    (tmp / "sim.json").write_text(json.dumps({"engines": engines}))
    plain = [{k: v for k, v in e.items() if k != "sim"} for e in engines]
    base = {"engines": plain, "engine": {"first_token_timeout_s": 30, "decode_read_timeout_s": 30}}

    def router_doc(port: int, admin: int, journal: str, **extra: Any) -> Path:
        doc = {**base, "server": {"host": "127.0.0.1", "port": port, "admin_port": admin,
                                  "max_concurrent_requests": 100000},
               "journal": {"path": str(tmp / journal), "fsync": False}, **extra}  # fmt: skip
        path = tmp / f"{journal}.fleet.json"
        path.write_text(json.dumps(doc))
        return path

    load_before = os.getloadavg()[0]
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        procs.append(start(narwhal("sim", "--fleet", str(tmp / "sim.json")), tmp / "sim.log"))
        for e in engines:
            wait_http(e["url"] + "/health", proc=procs[0])
        profiles = tmp / "profiles.json"
        print("profiling the fleet (narwhal profile) ...", file=sys.stderr, flush=True)
        sweep = [
            "profile", "--fleet", str(router_doc(ports["least"], ports["a2"], "profile")),
            "--prefill-lens", "128,512,1024,1536" if shared else "64,128,256,512",
            # The consumers' streams share 1,024-token prefixes: the decode cells
            # do too, to reach the KV those streams read (beyond what a consumer holds).
            *(["--decode-input-lens", "1100,1300", "--decode-concurrency", "1,8,24,40",
               "--decode-shared-prefix", "1024"] if shared else
              ["--decode-input-lens", "128,512", "--decode-concurrency", "1,4,8"]),
            "--repeats", str(args.profile_repeats), "--out", str(profiles), "--quiet",
        ]  # fmt: skip
        failure = profile_fleet(sweep, profiles, [e["name"] for e in engines])
        if failure is not None:
            sys.exit(failure)
        slo = {"ttft_s": slo_ms["ttft_ms"] / 1000, "tpot_s": slo_ms["tpot_ms"] / 1000}
        priced_doc = router_doc(ports["priced"], ports["a1"], "priced", profiles={"path": str(profiles)},
                                controller={"slo": slo, "admission": "refuse"})  # fmt: skip
        least_doc = router_doc(ports["least"], ports["a2"], "least")
        targets: dict[str, list[tuple[Path, int]]] = {
            "narwhal-priced": [(priced_doc, ports["priced"])],
            "narwhal-least-loaded": [(least_doc, ports["least"])],
        }
        workers: dict[str, int] = {}
        if args.workers > 1:
            name = f"narwhal-priced-{args.workers}-workers"
            doc = router_doc(ports["workers"], ports["a4"], "workers", profiles={"path": str(profiles)},
                             controller={"slo": slo, "admission": "refuse"})  # fmt: skip
            data = json.loads(doc.read_text())
            data["server"]["engine_load_poll_s"] = args.poll
            doc.write_text(json.dumps(data))
            targets[name] = [(doc, ports["workers"])]
            workers[name] = args.workers
        if args.replicas:
            targets = {"one-router": targets["narwhal-priced"]}
            for label, poll in (("shared", args.poll), ("blind", 0.0)):
                replicas = []
                for i in range(args.replicas):
                    port = free_port()
                    doc = router_doc(port, free_port(), f"{label}{i}", profiles={"path": str(profiles)},
                                     controller={"slo": slo, "admission": "refuse"})  # fmt: skip
                    data = json.loads(doc.read_text())
                    data["server"]["engine_load_poll_s"] = poll
                    doc.write_text(json.dumps(data))
                    replicas.append((doc, port))
                targets[f"{args.replicas}-replicas-{label}"] = replicas
        if shared:
            blind_doc = router_doc(ports["blind"], ports["a3"], "blind", profiles={"path": str(profiles)},
                                   controller={"slo": slo, "admission": "refuse", "prefix_cache": "off"})  # fmt: skip
            # Hit-aware, each request priced for its own TTFT alone (the cache plan off).
            greedy_doc = router_doc(ports["greedy"], ports["a5"], "greedy", profiles={"path": str(profiles)},
                                    controller={"slo": slo, "admission": "refuse", "cache_plan": "off"})  # fmt: skip
            targets = {"narwhal-hit-aware": targets.pop("narwhal-priced"),
                       "narwhal-no-plan": [(greedy_doc, ports["greedy"])],
                       "narwhal-hit-blind": [(blind_doc, ports["blind"])], **targets}  # fmt: skip
        if args.baseline and not args.replicas:
            port = free_port()
            targets["narwhal-today"] = [(router_doc(port, free_port(), "today", profiles={"path": str(profiles)},
                                                   controller={"slo": slo, "admission": "refuse"}), port)]  # fmt: skip
        journals = {"narwhal-hit-aware": tmp / "priced", "narwhal-priced": tmp / "priced",
                    "narwhal-hit-blind": tmp / "blind", "narwhal-today": tmp / "today",
                    "narwhal-no-plan": tmp / "greedy"}  # fmt: skip
        chosen = set(args.routers.split(",")) if args.routers else None
        if chosen is not None:
            targets = {k: v for k, v in targets.items() if k in chosen}
        for name, processes in targets.items():
            for i, (doc, port) in enumerate(processes):
                extra = ["--workers", str(workers[name])] if name in workers else []
                serve = narwhal("serve", "--fleet", str(doc), *extra)
                if name == "narwhal-today":  # the other tree's narwhal, in a fresh interpreter
                    serve = ["env", f"PYTHONPATH={Path(args.baseline).resolve()}", *serve]
                procs.append(start(serve, tmp / f"{name}-{i}.log"))
                wait_http(f"http://127.0.0.1:{port}/health", proc=procs[-1])
        urls = {name: [f"http://127.0.0.1:{port}" for _, port in processes] for name, processes in targets.items()}
        policies = {"vllm-router": ("round_robin", "vr")}
        if shared:
            policies = {"vllm-router-rr": ("round_robin", "vr"), "vllm-router-cache-aware": ("cache_aware", "vrc")}
            if args.kv_events:  # kv_aware follows the producers' KV events (P/D mode: --pd-kv-events)
                policies["vllm-router-kv-aware"] = ("kv_aware", "vrk")
        if chosen is not None:
            policies = {k: v for k, v in policies.items() if k in chosen}
        for label, (policy, key) in policies.items() if vr and not args.replicas else ():
            cmd = [vr, "--vllm-pd-disaggregation", "--policy", policy, "--host", "127.0.0.1",
                   "--port", str(ports[key]), "--prometheus-port", str(free_port())]  # fmt: skip
            for p in producer_engines:
                cmd += ["--prefill", p["url"]]
                if policy == "kv_aware":
                    cmd += ["--pd-kv-events", f"{p['url']}={p['kv_events']['endpoint']}"]
            for d in consumer_engines:
                cmd += ["--decode", d["url"]]
            procs.append(start(cmd, tmp / f"{label}.log"))
            wait_http(f"http://127.0.0.1:{ports[key]}/health", proc=procs[-1])
            urls[label] = [f"http://127.0.0.1:{ports[key]}"]
        producers = [e["url"] for e in producer_engines]
        capacity = {e["name"]: e["sim"].get("kv_capacity_tokens", 262144) for e in producer_engines}
        block = 16
        oracle: dict[float, float] = {}
        ceilings: dict[float, dict[str, float]] = {}
        producer_urls = {e["name"]: e["url"] for e in producer_engines}
        for rate in rates:
            for name, url in urls.items():  # url: one, or the replicas (round robin)
                trace = None
                if shared:
                    # The same arrivals and prompts for every router; fresh prefixes per rate
                    # and router, so that no run starts with another's cache.
                    trace = tmp / f"{name}-{rate:g}.trace.jsonl"
                    tag = f"{len(results.get(name, []))}{name.replace('-', '')}"
                    if args.workload == "multi-turn":
                        turns = multi_turn_trace(trace, rate=rate, n=args.requests, seed=int(rate * 1000), tag=tag)
                        requests = [(prompt, group) for prompt, group, _, _ in turns]
                        outputs = [out for *_, out in turns]
                    else:
                        make = shared_prefix_trace if args.workload == "shared-prefix" else sessions_trace
                        extra = {"zipf_s": args.zipf_s or None} if make is shared_prefix_trace else {"turns": args.turns}
                        requests = make(trace, rate=rate, n=args.requests, prefixes=args.prefixes,
                                        prefix_len=args.prefix_len, seed=int(rate * 1000), tag=tag, **extra)  # fmt: skip
                        outputs = [json.loads(line)["output_len"] for line in trace.read_text().splitlines()]
                    oracle.setdefault(rate, oracle_hit_rate(requests, capacity, block))
                    if args.prefix_fleet == "issue" and rate not in ceilings:
                        ceilings[rate] = ceiling(ISSUE_FLEET, requests, outputs, block=block,
                                                 capacity=CONSUMER_CAPACITY, tpot_s=slo_ms["tpot_ms"] / 1000)  # fmt: skip
                before = prefix_counters(producers) if shared else (0.0, 0.0)
                counted = request_counts(producer_urls) if shared else {}
                warmup = warmup_count(trace, args.warmup_s) if trace is not None and args.warmup_s else 0
                summary = bench(url, rate, args.requests, tmp / f"{name}-{rate:g}", slo=slo_ms, trace=trace,
                                warmup=warmup)  # fmt: skip
                after = prefix_counters(producers) if shared else (0.0, 0.0)
                share = shares(counted, request_counts(producer_urls)) if shared else {}
                queries = after[1] - before[1]
                hit_rate = (after[0] - before[0]) / queries if queries else None
                both = summary["attainment"]["both"]
                by_class = summary["counts"]["by_class"]
                every, refused_all = all_requests(tmp / f"{name}-{rate:g}", slo_ms)
                results.setdefault(name, []).append(
                    {"rate": rate, "attainment": both["ratio"], "goodput_rps": summary["goodput_rps"],
                     "by_class": by_class, "prefix_hit_rate": hit_rate, "oracle_hit_rate": oracle.get(rate),
                     "warmup_requests": warmup, "attainment_all": every, "refused_all": refused_all,
                     "producer_shares": share, "ceiling": ceilings.get(rate),
                     "results": str(tmp / f"{name}-{rate:g}")}
                )  # fmt: skip
                hits = f"  hit rate {hit_rate:.3f}" if hit_rate is not None else ""
                also = f" (all requests {every:.3f}, {warmup} warm-up)" if warmup and every is not None else ""
                print(f"  {name:<24} rate {rate:>5g}/s  attainment {both['ratio']:.3f}{also}{hits}  "
                      f"refused {by_class.get('refused', 0)}  shares {share}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for proc in reversed(procs):
            stop(proc)

    # TTFT prediction error per producer, from each priced router's journal (the
    # journals are complete once the routers stopped).
    errors: dict[str, dict[str, dict[str, Any]]] = {}
    ratios: dict[str, list[float]] = {}
    unjoined: list[str] = []
    for name, points in results.items():
        journal = journals.get(name)
        if journal is None or not journal.exists():
            continue
        rows: list[dict[str, Any]] = []
        for point in points:
            joined = subprocess.run(narwhal("bench", "join", "--results", point["results"], "--journal", str(journal)),
                                    check=False, capture_output=True)  # fmt: skip
            path = Path(point["results"]) / "join.jsonl"
            if joined.returncode == 0 and path.exists():
                lines = path.read_text().splitlines()
                rows += [r for r in map(json.loads, lines) if r["client_class"] == "ok" and r["router_class"] == "ok"]
            else:
                unjoined.append(f"{name} at {point['rate']:g}/s: narwhal bench join failed ({joined.returncode}): "
                                f"{joined.stderr.decode(errors='replace')[-500:]}")  # fmt: skip
        errors[name] = prediction_by_producer(rows)
        ratios[name] = [r["router_ttft_s"] / r["predicted_ttft_s"] for r in rows
                        if r.get("predicted_ttft_s") and r.get("router_ttft_s")]  # fmt: skip

    prompt = PROMPT if not shared else (
        "multi-turn: 32 conversations over 4 system prompts of 512 tokens, 50-200 new tokens a turn, "
        "history up to 3,000 tokens") if args.workload == "multi-turn" else (
        f"{args.workload}: {args.prefixes} prefixes of {args.prefix_len} tokens"
        + (f", zipf s={args.zipf_s}" if args.workload == "shared-prefix" and args.zipf_s else "")
        + (f", {args.turns} turns" if args.workload == "sessions" else ", tails uniform:50:250")
    )
    report: dict[str, Any] = {"slo": slo_ms, "fleet": {e["name"]: e["sim"] for e in engines}, "workload": args.workload,
                              "prefix_fleet": args.prefix_fleet if shared else None,
                              "chunked_prefill": args.chunked_prefill, "prompt": prompt, "output": OUTPUT,
                              "requests_per_point": args.requests, "warmup_s": args.warmup_s,
                              "machine": {"cpus": os.cpu_count(), "load_average_1m": [load_before, os.getloadavg()[0]]},
                              "routers": {}}  # fmt: skip
    print(f"\nSLO: TTFT {slo_ms['ttft_ms']} ms, TPOT {slo_ms['tpot_ms']} ms; prompts {prompt}, outputs {OUTPUT}; "
          f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")
    if args.warmup_s:
        print(f"steady state: the requests of each run's first {args.warmup_s:g} s are not scored (every router "
              "alike); 'all requests' rows score every request")
    print()
    print(f"{'router':<26}" + "".join(f"{r:>9g}/s" for r in rates) + "   goodput@90%" + ("   hit rate   503s" if shared else ""))
    if shared:
        print(f"{'(oracle hit rate)':<26}" + "".join(f"{oracle.get(r, 0):>11.3f}" for r in rates))
    if ceilings:
        print(f"{'(fleet ceiling, req/s)':<26}" + "".join(f"{ceilings[r]['ceiling_rps']:>11.1f}" for r in rates)
              + "   (prefill " + ", ".join(f"{ceilings[r]['prefill_rps']:.1f}" for r in rates)
              + "; decode " + ", ".join(f"{ceilings[r]['decode_rps']:.1f}" for r in rates) + ")")  # fmt: skip
        report["ceilings"] = {f"{r:g}": c for r, c in ceilings.items()}
    for name, points in results.items():
        goodput = goodput_at_90(points)
        report["routers"][name] = {"points": points, "goodput_at_90": goodput, "ttft_error_by_producer": errors.get(name)}
        if args.warmup_s:
            report["routers"][name]["goodput_at_90_all"] = goodput_at_90(points, "attainment_all")
        line = f"{name:<26}" + "".join(f"{p['attainment']:>11.3f}" for p in points) + f"   {goodput:.2f} req/s"
        if shared:
            rates_hit = [p["prefix_hit_rate"] for p in points if p["prefix_hit_rate"] is not None]
            refused = sum(p["by_class"].get("refused", 0) for p in points)
            line += f"   {sum(rates_hit) / len(rates_hit) if rates_hit else 0:.3f}   {refused}"
        print(line)
        if shared:
            print(f"{'  hit rate':<26}" + "".join(f"{p['prefix_hit_rate'] or 0:>11.3f}" for p in points))
            for producer in producer_urls:
                print(f"{'  share ' + producer:<26}"
                      + "".join(f"{(p['producer_shares'] or {}).get(producer, 0.0):>11.2f}" for p in points))
        print(f"{'  503s':<26}" + "".join(f"{p['by_class'].get('refused', 0):>11d}" for p in points))
        if args.warmup_s:
            print(f"{'  all requests':<26}" + "".join(f"{p['attainment_all'] or 0:>11.3f}" for p in points)
                  + f"   {report['routers'][name]['goodput_at_90_all']:.2f} req/s"
                  + f"{'':10}{sum(p['refused_all'] for p in points)}")  # fmt: skip
            print(f"{'  503s, all requests':<26}" + "".join(f"{p['refused_all']:>11d}" for p in points))
    print("\nTTFT prediction error per producer (|predicted - observed| / observed, router TTFT, successes):")
    for name, by_producer in errors.items():
        for producer, e in by_producer.items():
            err = e["ttft_error"]
            if err.get("n"):
                print(f"  {name:<24} {producer:<8} n {err['n']:>5}  median {err['p50']:.3f}  p90 {err['p90']:.3f}"
                      f"  cached tokens predicted {e['cached_tokens_predicted']} reported {e['cached_tokens_reported']}")
    routers = report["routers"]
    if args.replicas:
        report["replicas"] = {"n": args.replicas, "poll_s": args.poll}
        one = routers["one-router"]
        print("\nreplicas / one router (attainment per rate, goodput at 90%):")
        for name in (n for n in routers if n != "one-router"):
            ratios = [f"{p['attainment'] / q['attainment']:>11.3f}" if q["attainment"] else f"{'-':>11}"
                      for p, q in zip(routers[name]["points"], one["points"], strict=True)]  # fmt: skip
            g = one["goodput_at_90"]
            ratio = f"x{routers[name]['goodput_at_90'] / g:.2f}" if g else "one router never reached 90%"
            print(f"{name:<26}" + "".join(ratios) + f"   {ratio}")
    lead = "narwhal-hit-aware" if shared else "narwhal-priced"
    if lead in routers:
        g = routers[lead]["goodput_at_90"]
        others = ("narwhal-no-plan", "narwhal-hit-blind", "narwhal-least-loaded", "vllm-router-rr",
                  "vllm-router-cache-aware", "vllm-router-kv-aware", "vllm-router")  # fmt: skip
        for other in others:
            if other in routers and routers[other]["goodput_at_90"] > 0:
                every = ""
                if args.warmup_s and routers[other]["goodput_at_90_all"] > 0:
                    every = f" (all requests x{routers[lead]['goodput_at_90_all'] / routers[other]['goodput_at_90_all']:.2f})"
                print(f"{lead} / {other}: x{g / routers[other]['goodput_at_90']:.2f}{every}")
            elif other in routers:
                print(f"{lead} / {other}: {other} never reached 90% attainment")
    report["targets"] = targets_met(routers, errors, rates, shared=shared, oracle=oracle, lead=lead, slo_ms=slo_ms)
    if args.prefix_fleet == "issue" and lead in routers:
        report["targets"].update(issue_targets(routers, lead, ceilings, ratios.get(lead, []), oracle,
                                               workload=args.workload, kv_events=args.kv_events))  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, data in routers.items():
            ax.plot([p["rate"] for p in data["points"]], [p["attainment"] for p in data["points"]], marker="o", label=name)
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=1, label="90% attainment")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.05)
        ax.legend()
        ax.set_title("SLO attainment on a heterogeneous fleet")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        print(f"plot: {out.with_suffix('.png')}")
    except ImportError:
        pass
    print(f"written to {out}")
    if not args.quick:
        return 0
    # The CI form: at its low rate every request succeeds or is refused by the policy.
    failed = [f"{name} at {p['rate']:g}/s: " + ", ".join(f"{k} {v}" for k, v in p["by_class"].items())
              for name, data in routers.items() for p in data["points"]
              if set(p["by_class"]) - {"ok", "refused"} or not p["by_class"].get("ok")]  # fmt: skip
    for line in failed + unjoined:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed or unjoined else 0


if __name__ == "__main__":
    sys.exit(main())
