"""The cache plan's benchmark: the fleet and workloads of its issue, the fleet's ceiling
from its latency model, each producer's share, and a short form in virtual time.

Used by ``tools/bench_goodput.py`` (``--prefix-fleet issue``, ``--workload multi-turn``,
``--kv-events``) and run alone as the short form:

    python tools/cachebench.py --quick

which runs the three cached workloads of the issue's table (shared prefixes without
and with KV events, multi-turn sessions with KV events) in virtual time, in memory,
against Narwhal with its cache plan and with it off (``controller.cache_plan``), each
with profiles that state the simulated engines' latency models exactly, and prints
each one's SLO attainment per rate, goodput at 90% and its share of the fleet's
ceiling, hit rate against the best the workload allows and the slow producer's share.
``--baseline TREE`` adds a row for another source tree (an export of the code before
the plan, say: its ``narwhal`` package, run in a fresh interpreter without the
``cache_plan`` key), ``--seeds N`` averages each point over N arrival sequences (the
attainment of one run near the fleet's ceiling turns on a few requests). With the
defaults (one rate a workload, 400 requests) it takes a few minutes of CPU.

``--ci`` is the short form for continuous integration (200 requests a workload at
20 req/s, about 70% of the fleet's ceiling, the first 2 s unscored; about 20 s of CPU,
and the same figures on every run): it checks the issue's targets that such a run can
see and exits 1 when one is missed, or a run fails. With the cache plan, on every
workload: SLO attainment at least 0.9 (goodput of 70% of the ceiling or more), the hit
rate within 10% of the best a static partition allows, and attainment no more than 2
points under the router without the plan; on multi-turn sessions, the slow producer
takes at least 20% of the prefills (no producer idle while another is loaded)::

    python tools/cachebench.py --ci
    python tools/cachebench.py --quick --requests 600 --prefix-rates 20,24,28 --turn-rates 20,24,28 \
        --seeds 3 --baseline ../before
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["CAPACITY", "CONSUMER_CAPACITY", "ISSUE_FLEET", "ceiling", "issue_targets", "multi_turn_trace",
           "request_counts", "shares"]

#: The heterogeneous fleet of the issue: producers at speeds 1.0 and 0.5, consumers at
#: 1.0 and 0.4 (the slower ones' latency models the faster ones' scaled by 2 and 2.5).
#: The fast producer prefills a cold 1,174-token prompt in 0.198 s and the same with
#: 1,024 tokens cached in 0.043 s (the slow one 0.397 s and 0.086 s); the fast consumer
#: steps in 15 ms plus 0.2 ms a stream plus 0.1 us a resident KV token.
FAST_PREFILL = {"a": 0.020, "b": 1.5e-4, "c": 1.5e-9}
FAST_DECODE = {"c0": 0.015, "c1": 2e-4, "c2": 1e-7}
ISSUE_FLEET = {
    "p-fast": ("prefill", FAST_PREFILL, FAST_DECODE),
    "p-slow": ("prefill", {k: 2 * v for k, v in FAST_PREFILL.items()}, FAST_DECODE),
    "d-fast": ("decode", FAST_PREFILL, FAST_DECODE),
    "d-slow": ("decode", FAST_PREFILL, {k: 2.5 * v for k, v in FAST_DECODE.items()}),
}
#: Each producer's cache per workload: no larger than the working set (16 prefixes of
#: 1,024 tokens; 32 sessions of up to 3,000 tokens are ~56,000 on average, with the
#: system prompts). The consumers hold 65,536 tokens in both, so that the fleet is
#: bound by its producers (with 16,384 tokens each, 13 streams of a 1,200-token prompt
#: fill a consumer, and the two carry about 24 requests a second).
CAPACITY = {"shared-prefix": 16384, "multi-turn": 65536}
CONSUMER_CAPACITY = 65536


def multi_turn_trace(path: Path | None, *, rate: float, n: int, sessions: int = 32, systems: int = 4,
                     system_len: int = 512, max_history: int = 3000, seed: int,
                     tag: str) -> list[tuple[str, int, float, int]]:  # fmt: skip
    """``sessions`` conversations at once over ``systems`` system prompts of ``system_len``
    tokens: each turn adds 50-200 tokens of the user's and the next turn repeats it with
    a stand-in for the answer (20-60 tokens); a conversation ends when its history would
    pass ``max_history`` tokens and a new one takes its place; each conversation's turns
    follow each other after exponential think times of mean ``sessions / rate`` (open
    loop), so that the fleet receives about ``rate`` requests a second.

    Writes a JSON-lines trace at ``path`` (when given) and returns each request's
    prompt, conversation, offset and output length, in order.
    """
    rng = random.Random(seed)
    heads = [" ".join(f"{tag}sys{k}w{j}" for j in range(system_len)) for k in range(systems)]
    lines: list[tuple[float, str, int, int]] = []
    next_id = 0
    for _slot in range(sessions):
        t = rng.uniform(0, sessions / rate)
        while len(lines) < 4 * n:
            sid, next_id = next_id, next_id + 1
            history, turn = heads[sid % systems], 0
            while True:
                user = " ".join(f"{tag}s{sid}t{turn}u{j}" for j in range(rng.randint(50, 200)))
                out = rng.randint(20, 60)
                history = f"{history} {user}"
                if len(history.split()) > max_history:
                    break
                lines.append((t, history, sid, out))
                history += " " + " ".join(f"{tag}s{sid}t{turn}a{j}" for j in range(out))
                turn += 1
                t += rng.expovariate(rate / sessions)
            if t > 4 * n / rate:
                break
    lines.sort(key=lambda x: x[0])
    lines = lines[:n]
    if path is not None:
        with path.open("w") as fh:
            for offset, prompt, _, out in lines:
                fh.write(json.dumps({"offset_s": offset, "prompt": prompt, "output_len": out}) + "\n")
    return [(prompt, sid, offset, out) for offset, prompt, sid, out in lines]


def prefill_s(model: dict[str, float], tokens: int, cached: int = 0) -> float:
    """The simulated engines' prefill time of ``tokens`` with ``cached`` of them cached."""
    return model["a"] + model["b"] * (tokens - cached) + model["c"] * (tokens**2 - cached**2)


def best_hits(requests: Sequence[tuple[str, int]], block: int) -> list[int]:
    """Per request, the prompt tokens a cache could serve with every earlier request of
    its group (prefix or conversation) on one producer and nothing evicted: the leading
    whole blocks it shares with the longest earlier prompt of its group, short of its
    last token."""
    seen: dict[int, list[list[str]]] = {}
    out = []
    for prompt, group in requests:
        words = prompt.split()
        best = 0
        for earlier in seen.get(group, ())[-8:]:
            k = 0
            limit = min(len(words) - 1, len(earlier))
            while k < limit and words[k] == earlier[k]:
                k += 1
            best = max(best, k)
        out.append(best // block * block)
        seen.setdefault(group, []).append(words)
    return out


def ceiling(fleet: dict[str, tuple[str, dict[str, float], dict[str, float]]], requests: Sequence[tuple[str, int]],
            outputs: Sequence[int], *, block: int, capacity: int, tpot_s: float) -> dict[str, float]:  # fmt: skip
    """The fleet's ceiling in requests a second from its latency model, on these requests.

    Prefill: every producer computing one prompt at a time, each prompt hit as far as
    its group's earlier prompts allow (:func:`best_hits`), their mean prefill there the
    time a request takes it; the producers' rates add. Decode: on each consumer the most
    streams whose step meets the TPOT target and whose KV (prompt and output, each in
    full) fits its cache; each stream lasts its mean output at that step time; the
    consumers' rates add. The ceiling is the smaller of the two.
    """
    hits = best_hits(requests, block)
    lengths = [len(p.split()) for p, _ in requests]
    mean_out = sum(outputs) / len(outputs)
    mean_len = sum(lengths) / len(lengths)
    prefill = 0.0
    decode = 0.0
    for role, pre, dec in fleet.values():
        if role == "prefill":
            mean_s = sum(prefill_s(pre, n, k) for n, k in zip(lengths, hits, strict=True)) / len(lengths)
            prefill += 1.0 / mean_s
        else:
            kv = mean_len + mean_out / 2  # a stream's resident KV, on average over its life
            streams = 0
            while True:
                n = streams + 1
                step = dec["c0"] + dec["c1"] * n + dec["c2"] * n * kv
                if step > tpot_s or n * (mean_len + mean_out) > capacity:
                    break
                streams = n
            if streams:
                step = dec["c0"] + dec["c1"] * streams + dec["c2"] * streams * kv
                decode += streams / (mean_out * step)
    return {"prefill_rps": prefill, "decode_rps": decode, "ceiling_rps": min(prefill, decode),
            "best_hit_rate": sum(hits) / sum(lengths)}  # fmt: skip


def request_counts(urls: dict[str, str]) -> dict[str, float]:
    """Requests each engine finished (``vllm:request_success``, every reason)."""
    out = {}
    for name, url in urls.items():
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        out[name] = sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))
    return out


def shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each engine's share of the requests finished between two counts."""
    done = {n: after[n] - before.get(n, 0.0) for n in after}
    total = sum(done.values())
    return {n: round(d / total, 3) if total else 0.0 for n, d in done.items()}


def issue_targets(routers: dict[str, Any], lead: str, ceilings: dict[float, dict[str, float]],
                  ratios: Sequence[float], oracle: dict[float, float], *, workload: str,
                  kv_events: bool) -> dict[str, Any]:  # fmt: skip
    """Print and return the targets of the cache plan's issue for this workload, each
    met or not, with its figures."""
    out: dict[str, Any] = {}
    lead_points = routers[lead]["points"]
    g = routers[lead]["goodput_at_90"]
    ceil = min((c["ceiling_rps"] for c in ceilings.values()), default=0.0)

    def show(key: str, met: bool, text: str) -> None:
        out[key] = {"met": met, "detail": text}
        print(f"  [{'met' if met else 'NOT met'}] {key}: {text}")

    def versus(names: Sequence[str], factor: float) -> None:
        present = [n for n in names if n in routers]
        if not present:
            return
        base = max(routers[n]["goodput_at_90"] for n in present)
        label = " and ".join(n.removeprefix("vllm-router-") for n in present)
        show(f"goodput >= {factor:g}x the better of {label}", (base > 0 and g >= factor * base) or (base == 0 and g > 0),
             f"{g:.2f} vs {base:.2f} req/s" + (f" (x{g / base:.2f})" if base else " (never reached 90%)"))  # fmt: skip

    def of_ceiling(share: float) -> None:
        if ceil:
            show(f"goodput >= {share:.0%} of the fleet's ceiling", g >= share * ceil,
                 f"{g:.2f} of {ceil:.1f} req/s ({g / ceil:.0%})")

    print("cache plan targets:")
    if workload == "shared-prefix" and not kv_events:
        versus(["vllm-router-cache-aware"], 2.5)
        of_ceiling(0.70)
        measured = [p["prefix_hit_rate"] for p in lead_points if p["prefix_hit_rate"] is not None]
        best = [oracle[p["rate"]] for p in lead_points if p["rate"] in oracle]
        if measured and best:
            m, b = sum(measured) / len(measured), sum(best) / len(best)
            show("hit rate within 10% of the best partition", m >= 0.9 * b, f"{m:.3f} vs {b:.3f} (x{m / b:.3f})")
        if ratios:
            p90 = sorted(ratios)[int(0.9 * (len(ratios) - 1))]
            show("TTFT observed / predicted at the 90th percentile <= 1.3", p90 <= 1.3, f"{p90:.2f}")
    elif workload == "shared-prefix":
        of_ceiling(0.80)
    elif workload == "multi-turn":
        versus(["vllm-router-cache-aware", "vllm-router-kv-aware"], 1.5)
        of_ceiling(0.70)
        idle = [(p["rate"], s) for p in lead_points if p["by_class"].get("refused", 0)
                for s in (p.get("producer_shares") or {}).values() if s < 0.2]  # fmt: skip
        show("no producer under 20% of the prefills while another refuses", not idle,
             ", ".join(f"{s:.0%} at {r:g}/s" for r, s in idle) or "none")
    return out


# ------------------------------------------------------------------ the short form


def _sim_doc(workload: str, kv_events: bool, plan: str) -> dict[str, Any]:
    engines = []
    for i, (name, (role, pre, dec)) in enumerate(ISSUE_FLEET.items()):
        capacity = CAPACITY[workload] if role == "prefill" else CONSUMER_CAPACITY
        engines.append({
            "name": name, "url": f"http://{name}.test:{8101 + i}", "roles": [role], "model": "sim-llama",
            "connector": {"type": "NixlConnector", "kv_host": f"{name}.kv.test", "kv_port": 15101 + i},
            "sim": {"model": "sim-llama", "seed": i + 1, "prefill": pre, "decode": dec, "transfer_s_per_token": 1e-5,
                    "kv_capacity_tokens": capacity, "max_model_len": 8192, "prefix_caching": True,
                    "prompt_tokens_details": True, "block_size": 16},
        })  # fmt: skip
    return {"server": {"host": "router.test", "port": 8000, "max_concurrent_requests": 100000},
            "engines": engines,
            "engine": {"first_token_timeout_s": 30.0, "decode_read_timeout_s": 10.0, "request_timeout_s": 120.0},
            "controller": {"slo": {"ttft_s": 0.5, "tpot_s": 0.05}, "admission": "refuse",
                           **({"cache_plan": plan} if plan != "baseline" else {})}}  # fmt: skip


async def _profiles(config: Any, network: Any) -> Any:
    """Profiles that state the simulated engines' latency models exactly, bound to them."""
    from narwhal.engines.client import EngineClient
    from narwhal.profile import store

    engines = {}
    for e in config.engines:
        async with EngineClient(e.url, name=e.name, transport=network.wire_transport()) as client:
            identity = await client.identity()
        capacity = e.sim.kv_capacity_tokens
        domain = store.DecodeDomain(active=store.DecodeAxis(min=1.0, max=256.0),
                                    kv_tokens=store.DecodeAxis(min=0.0, max=float(capacity)))  # fmt: skip
        p, d = e.sim.prefill, e.sim.decode
        engines[e.name] = store.EngineProfile(
            name=e.name, identity=identity,
            ttft=store.TTFTCurve(a=p.a, b=p.b, c=p.c, min_length=16, max_length=e.sim.max_model_len,
                                 mean_error=0.01, worst_error=0.02),
            decode=store.DecodeModel(c0=d.c0, c1=d.c1, c2=d.c2, fit_mape=0.01, cv_mape=0.02, cells=4, domain=domain),
            kv_capacity=store.KVCapacity(source="physical", tokens=capacity, basis="simulator"),
        )  # fmt: skip
    return store.Profiles(schema_version=store.SCHEMA_VERSION, created_at="2026-01-01T00:00:00Z",
                          software={"narwhal": "cachebench"},
                          samples=store.SamplesRef(path="profiles.samples.json", sha256="0" * 64), engines=engines)  # fmt: skip


async def _run_one(workload: str, kv_events: bool, plan: str, rate: float, n: int,
                   warmup_s: float = 0.0, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    import httpx
    import trio

    from narwhal.config import parse_fleet
    from narwhal.engines.kvevents import EventBatch
    from narwhal.router.journal import Journal
    from narwhal.router.service import open_router
    from narwhal.testing import open_memory_network, open_sim_fleet

    config = parse_fleet(_sim_doc(workload, kv_events, plan))
    records: list[dict[str, Any]] = []
    journal = Journal(None)
    journal.add_listener(records.append)
    if workload == "shared-prefix":
        rng = random.Random(int(rate * 1000) + seed)
        heads = [" ".join(f"h{k}w{j}" for j in range(1024)) for k in range(16)]
        trace, t = [], 0.0
        for i in range(n):
            k = rng.randrange(16)
            trace.append((f"{heads[k]} " + " ".join(f"r{i}w{j}" for j in range(rng.randint(50, 250))), k, t,
                          rng.randint(20, 60)))  # fmt: skip
            t += rng.expovariate(rate)
    else:
        trace = multi_turn_trace(None, rate=rate, n=n, seed=int(rate * 1000) + seed, tag="q")
    async with open_memory_network() as net, open_sim_fleet(config, network=net) as fleet:
        profiles = await _profiles(config, net)
        async with open_router(config, transport=fleet.transport, journal=journal, profiles=profiles) as router:
            if kv_events:  # each step's batch straight to the router's index, as the engines publish it
                index = router.state.prefix
                for e in config.engines:
                    index.follow(e.name)

                    def publish(events: list[Any], name: str = e.name) -> None:
                        index.apply(name, EventBatch(0.0, tuple(events)))

                    fleet.engines[e.name].scheduler.publish = publish
            net.listen("router.test", 8000, router.server)
            async with httpx.AsyncClient(transport=net.transport(), base_url="http://router.test:8000",
                                         timeout=None) as client:  # fmt: skip
                start = trio.current_time()

                async def one(i: int, prompt: str, out: int, at: float) -> None:
                    await trio.sleep_until(start + at)
                    await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": out},
                                      headers={"x-request-id": f"r{i}"})  # fmt: skip

                async with trio.open_nursery() as nursery:
                    for i, (prompt, _, at, out) in enumerate(trace):
                        nursery.start_soon(one, i, prompt, out, at)
            stats = {name: fleet.engines[name].scheduler.metrics for name in ("p-fast", "p-slow")}
            hits = sum(m.prefix_cache_hits for m in stats.values())
            queries = sum(m.prefix_cache_queries for m in stats.values())
    scored = [r for r in records if trace[int(r["request_id"][1:])][2] >= warmup_s]
    if not scored:
        raise SystemExit(f"cachebench: no request scored: {n} requests at {rate:g}/s last about "
                         f"{trace[-1][2]:.1f} s, all in the {warmup_s:g} s warm-up (more --requests or less --warmup-s)")
    ok = [r for r in scored if r["terminal_class"] == "ok" and (r["first_byte_s"] or 9) <= 0.5
          and (r["tpot_s"] or 0) <= 0.05]  # fmt: skip
    served = {p: sum(r["producer"] == p for r in scored if r["terminal_class"] == "ok") for p in ("p-fast", "p-slow")}
    total = sum(served.values()) or 1
    requests = [(prompt, group) for prompt, group, _, _ in trace]
    ceil = ceiling(ISSUE_FLEET, requests, [out for *_, out in trace], block=16, capacity=CONSUMER_CAPACITY,
                   tpot_s=0.05)  # fmt: skip
    return {"attainment": len(ok) / len(scored), "refused": sum(r["terminal_class"] == "refused" for r in scored),
            "hit_rate": hits / queries if queries else 0.0, "shares": {p: s / total for p, s in served.items()},
            **ceil}  # fmt: skip


def quick(rates: dict[str, list[float]], n: int, check: bool, warmup_s: float = 0.0, *, seeds: int = 1,
          baseline: Path | None = None) -> int:  # fmt: skip
    """The short form: each workload at each rate, with the cache plan and without (and
    ``baseline``'s code, when given); attainment per rate (the mean of ``seeds`` arrival
    sequences), goodput at 90% and its share of the fleet's ceiling."""
    cases = [("shared prefixes, no KV events", "shared-prefix", False),
             ("shared prefixes, KV events", "shared-prefix", True),
             ("multi-turn sessions, KV events", "multi-turn", True)]  # fmt: skip
    routers = {"auto": "cache plan", "off": "no plan", **({"baseline": "baseline"} if baseline is not None else {})}
    failed = False
    for label, workload, events in cases:
        print(f"\n{label} ({n} requests a rate" + (f", mean of {seeds} seeds" if seeds > 1 else "")
              + ", virtual time" + (f"; the first {warmup_s:g} s unscored" if warmup_s else "") + ")")
        print(f"  {'router':<12}" + "".join(f"{r:>9g}/s" for r in rates[workload])
              + "   goodput@90%   of ceiling   hit rate (best)   p-slow share")  # fmt: skip
        rows: dict[str, list[dict[str, Any]]] = {}
        for plan, name in routers.items():
            points = rows[plan] = []
            for rate in rates[workload]:
                runs = [_run_in(baseline if plan == "baseline" else None, workload, events, plan, rate, n, warmup_s,
                                seed) for seed in range(seeds)]  # fmt: skip
                points.append({"rate": rate, **_mean(runs)})
            held = [p for p in points if p["attainment"] >= 0.9]
            goodput = max((p["rate"] * p["attainment"] for p in held), default=0.0)
            ceil = min(p["ceiling_rps"] for p in points)
            hit = sum(p["hit_rate"] for p in points) / len(points)
            best = sum(p["best_hit_rate"] for p in points) / len(points)
            slow = sum(p["shares"]["p-slow"] for p in points) / len(points)
            print(f"  {name:<12}" + "".join(f"{p['attainment']:>11.3f}" for p in points)
                  + f"   {goodput:>7.2f} req/s   {goodput / ceil:>9.0%}   {hit:.3f} ({best:.3f})   {slow:>12.2f}",
                  flush=True)  # fmt: skip
        print(f"  (ceiling {ceil:.1f} req/s: prefill {min(p['prefill_rps'] for p in points):.1f}, "
              f"decode {min(p['decode_rps'] for p in points):.1f})")  # fmt: skip
        if check:
            failed |= not _checks(workload, rows["auto"], rows["off"])
    return 1 if check and failed else 0


def _checks(workload: str, plan: Sequence[dict[str, Any]], off: Sequence[dict[str, Any]]) -> bool:
    """The short form's checks (see the module docstring), printed; whether all hold."""
    checks = []
    for p, o in zip(plan, off, strict=True):
        at = f"at {p['rate']:g}/s"
        checks += [
            (f"attainment >= 0.9 {at}", p["attainment"] >= 0.9, f"{p['attainment']:.3f}"),
            (f"hit rate within 10% of the best partition {at}", p["hit_rate"] >= 0.9 * p["best_hit_rate"],
             f"{p['hit_rate']:.3f} vs {p['best_hit_rate']:.3f}"),
            (f"attainment no more than 2 points under no plan's {at}", p["attainment"] >= o["attainment"] - 0.02,
             f"{p['attainment']:.3f} vs {o['attainment']:.3f}"),
        ]  # fmt: skip
        if workload == "multi-turn":
            slow = p["shares"]["p-slow"]
            checks.append((f"the slow producer takes >= 20% of the prefills {at}", slow >= 0.2, f"{slow:.2f}"))
    for label, ok, detail in checks:
        print(f"  [{'met' if ok else 'NOT met'}] {label}: {detail}")
    return all(ok for _, ok, _ in checks)


def _run_in(tree: Path | None, workload: str, events: bool, plan: str, rate: float, n: int, warmup_s: float,
            seed: int) -> dict[str, Any]:  # fmt: skip
    """One run in virtual time: here, or in a fresh interpreter on ``tree``'s code."""
    if tree is None:
        import trio
        import trio.testing

        return trio.run(_run_one, workload, events, plan, rate, n, warmup_s, seed,
                        clock=trio.testing.MockClock(autojump_threshold=0))  # fmt: skip
    import subprocess

    args = json.dumps([workload, events, plan, rate, n, warmup_s, seed])
    done = subprocess.run([sys.executable, __file__, "--run-one", args, "--tree", str(tree)], check=True,
                          capture_output=True, text=True)  # fmt: skip
    row: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return row


def _mean(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mean of runs of one point (their numbers; the first's ceiling, the same arrivals' model)."""
    out = dict(runs[0])
    for key in ("attainment", "hit_rate", "best_hit_rate", "refused"):
        out[key] = sum(r[key] for r in runs) / len(runs)
    out["shares"] = {p: sum(r["shares"][p] for r in runs) / len(runs) for p in runs[0]["shares"]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the short form, in virtual time")
    parser.add_argument("--requests", type=int, default=400, help="requests a run (short form)")
    parser.add_argument("--prefix-rates", default="24", help="req/s of the shared-prefix runs (comma-separated)")
    parser.add_argument("--turn-rates", default="26", help="req/s of the multi-turn runs (comma-separated)")
    parser.add_argument("--warmup-s", type=float, default=5.0,
                        help="requests scheduled in each run's first S seconds are sent but not scored")
    parser.add_argument("--check", action="store_true",
                        help="check the issue's targets a short run can see (see --ci); exit 1 when one is missed")
    parser.add_argument("--ci", action="store_true",
                        help="the short form for CI: --quick --check --requests 200 --warmup-s 2 at 20 req/s")
    parser.add_argument("--seeds", type=int, default=1, help="arrival sequences a point (their mean)")
    parser.add_argument("--baseline", metavar="TREE", type=Path,
                        help="another source tree to run too (its narwhal package, without controller.cache_plan)")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:  # one run of --baseline, in this interpreter on --tree's code
        import trio
        import trio.testing

        if args.tree is not None:
            sys.path.insert(0, str(args.tree.resolve()))
        workload, events, plan, rate, n, warmup_s, seed = json.loads(args.run_one)
        row = trio.run(_run_one, workload, events, plan, rate, n, warmup_s, seed,
                       clock=trio.testing.MockClock(autojump_threshold=0))  # fmt: skip
        print(json.dumps(row))
        return 0
    if args.ci:
        args.quick = args.check = True
        args.requests, args.warmup_s, args.prefix_rates, args.turn_rates = 200, 2.0, "20", "20"
    if not args.quick:
        parser.error("nothing to do: --quick runs the short form (tools/bench_goodput.py runs the full one)")
    rates = {"shared-prefix": [float(r) for r in args.prefix_rates.split(",")],
             "multi-turn": [float(r) for r in args.turn_rates.split(",")]}  # fmt: skip
    return quick(rates, args.requests, args.check, args.warmup_s, seeds=args.seeds, baseline=args.baseline)


if __name__ == "__main__":
    raise SystemExit(main())


