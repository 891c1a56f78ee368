"""What placing one request costs the router's CPU, against another source tree, in one run.

The request path of a priced placement with the prefix index, as the lifecycle runs it:
the prompt's lookup in the index, the cache plan's ticket (where the tree has one),
priced placement's choice of a pair (its quotes of every producer and consumer, the
plan's rule and the placement's explanation), the producer's and the consumer's
blocks recorded in their approximate views (held, then released, where the tree holds
them), the reservation released. The fleet is the shared-prefix fleet of the cache
plan (a fast and a slow producer, two consumers, caches of 16,384 tokens) and the
prompts are the shared-prefix workload's (16 prefixes of 1,024 tokens, 50-250 tokens
of each request's own); the plan is made again every 100 requests, off the request path
(its cost is reported apart, per plan).

Each tree runs in a fresh interpreter (``--baseline TREE`` adds one: an export of the
code before the change, say), one round at a time, the trees alternating round after
round so that a change in the machine's load touches them alike; the figure is the
median per tree of the thread's CPU time (not the wall clock: time the thread waits for
a core is not its cost), and the ratio to the baseline is the one to read.

    git archive <commit> | tar -x -C ../before
    nice -n 19 python tools/bench_placement.py --baseline ../before --rounds 9

``--quick`` is the CI form (two rounds of 200 requests: two plans a round; seconds). Any
form exits 1 when a round fails, or when this tree's rounds with the plan made no plan.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FAST = {"a": 0.020, "b": 1.5e-4, "c": 1.5e-9}
SLOW = {k: v * 2 for k, v in FAST.items()}
DECODE = {"c0": 0.015, "c1": 2e-4, "c2": 1e-7}


def _profile(name: str, prefill: dict[str, float], decode: dict[str, float]) -> Any:
    from narwhal.engines.client import EngineIdentity
    from narwhal.profile.store import (
        DecodeAxis,
        DecodeDomain,
        DecodeModel,
        EngineProfile,
        KVCapacity,
        TTFTCurve,
    )

    identity = EngineIdentity(url=f"http://{name}.test", model="m", version="0", max_model_len=8192,
                              process_start_time=1.0)  # fmt: skip
    domain = DecodeDomain(active=DecodeAxis(min=1.0, max=256.0), kv_tokens=DecodeAxis(min=0.0, max=16384.0))
    return EngineProfile(
        name=name, identity=identity,
        ttft=TTFTCurve(a=prefill["a"], b=prefill["b"], c=prefill["c"], min_length=16, max_length=8192,
                       mean_error=0.01, worst_error=0.02),
        decode=DecodeModel(c0=decode["c0"], c1=decode["c1"], c2=decode["c2"], fit_mape=0.01, cv_mape=0.02,
                           cells=4, domain=domain),
        kv_capacity=KVCapacity(source="physical", tokens=16384, basis="bench"),
    )  # fmt: skip


def one_round(requests: int, plan_on: bool, seed: int) -> dict[str, float]:
    """One round in this interpreter's tree: microseconds a request, and a plan."""
    from narwhal.config import SLOConfig
    from narwhal.router.prefix import PrefixIndex
    from narwhal.router.pricing import PricedPlacement

    producers, consumers = ["p-fast", "p-slow"], ["d-fast", "d-slow"]
    profiles = {"p-fast": _profile("p-fast", FAST, DECODE), "p-slow": _profile("p-slow", SLOW, DECODE),
                "d-fast": _profile("d-fast", FAST, DECODE), "d-slow": _profile("d-slow", FAST, DECODE)}  # fmt: skip
    clock = time.monotonic
    placement = PricedPlacement(producers, consumers, profiles=profiles, slo=SLOConfig(ttft_s=0.5, tpot_s=0.05),
                                admission="refuse", clock=clock)  # fmt: skip
    index = PrefixIndex()
    for name in (*producers, *consumers):
        index.enable(name, block_size=16, capacity_tokens=16384, events=False)
    holds = hasattr(index, "hold")
    plan = None
    if plan_on and "plan" in inspect.signature(placement.choose).parameters:
        from narwhal.router.cacheplan import CachePlan

        plan = placement.cache_plan = CachePlan(index, placement.prefill_s, clock)
    rng = random.Random(seed)
    heads = [[rng.randrange(1000, 30000) for _ in range(1024)] for _ in range(16)]
    prompts = [[*rng.choice(heads), *(rng.randrange(30000, 60000) for _ in range(rng.randint(50, 250)))]
               for _ in range(requests)]  # fmt: skip
    spent = planned = 0.0
    plans = 0
    for i, ids in enumerate(prompts):
        if plan is not None and i % 100 == 99:
            t = time.thread_time()
            plan.replan(producers, 0.5)
            planned += time.thread_time() - t
            plans += 1
        t = time.thread_time()
        lookup = index.lookup(ids)
        kwargs: dict[str, Any] = {}
        ticket = None
        if plan is not None:
            ticket = kwargs["plan"] = plan.classify(lookup, None, 16, ids)
        reservation = placement.choose(len(ids), 40, cached=lookup.cached_tokens, prompt_ids=ids,
                                       held=lookup.held_chain, **kwargs)  # fmt: skip
        lookup.cached_tokens(reservation.producer)  # the journal's predictions
        lookup.cached_tokens(reservation.consumer)
        if ticket is not None and plan is not None:
            plan.placed(ticket, reservation.producer, len(ids), 0.05)
        if holds:
            chain = ticket.chain if ticket is not None else ()
            produced = index.hold(reservation.producer, ids, 1, chain, 16)
            decoding = index.hold(reservation.consumer, ids, 40, chain, 16)
            reservation.release_prefill(done=True)
            if produced is not None:
                produced.release()
            reservation.release()
            if decoding is not None:
                decoding.release()
        else:
            index.placed(reservation.producer, ids)
            reservation.release_prefill(done=True)
            index.placed(reservation.consumer, ids)
            reservation.release()
        spent += time.thread_time() - t
    return {"us_per_request": spent / requests * 1e6, "ms_per_plan": planned / plans * 1e3 if plans else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", metavar="TREE", help="another source tree to run against (its narwhal package)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000, help="requests a round")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--one", choices=("plan", "noplan"), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the CI form: 2 rounds of 200 requests")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 2, 200
    if args.one:
        print(json.dumps(one_round(args.requests, args.one == "plan", args.seed)))
        return 0
    here = Path(__file__).resolve().parent.parent
    trees = {"this tree, cache plan": (here, "plan"), "this tree, no plan": (here, "noplan")}
    if args.baseline:
        trees["baseline"] = (Path(args.baseline).resolve(), "plan")
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, (tree, mode) in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--requests", str(args.requests),
                                  "--seed", str(args.seed)], env=env, check=False, capture_output=True, text=True)  # fmt: skip
            if out.returncode != 0:
                print(f"FAILED: a round of {name} ({tree}) exited {out.returncode}:\n{out.stderr[-3000:]}", file=sys.stderr)
                return 1
            figures[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"placement CPU per request (median of {args.rounds} rounds of {args.requests} requests; "
          f"load average {os.getloadavg()[0]:.2f}):")
    medians = {name: statistics.median(f["us_per_request"] for f in rows) for name, rows in figures.items()}
    base = medians.get("baseline")
    for name, rows in figures.items():
        plan_ms = statistics.median(f["ms_per_plan"] for f in rows)
        ratio = f"   x{medians[name] / base:.3f} of the baseline" if base else ""
        print(f"  {name:<24} {medians[name]:8.1f} us{ratio}" + (f"   a plan {plan_ms:.2f} ms" if plan_ms else ""))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"kind": "narwhal.bench-placement", "settings": vars(args),
                                              "rounds": figures, "medians_us": medians}, indent=2) + "\n")  # fmt: skip
    # This tree has a cache plan: a round that made none measured the request path without it.
    if args.requests >= 100 and not all(f["ms_per_plan"] for f in figures["this tree, cache plan"]):
        print("FAILED: this tree's rounds with the cache plan made no plan", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
