"""The heterogeneous fleet of the cache plan's tests, its workloads, and KV events in memory.

Producers at speeds 1.0 and 0.5, consumers at 1.0 and 0.4 (the slower ones' latency
models scaled by 2 and 2.5), every engine caching prefixes; SLO TTFT 500 ms, TPOT 50 ms.
A cold 1,174-token prompt costs the fast producer 0.198 s and the slow one 0.397 s;
with 1,024 tokens cached, 0.043 s and 0.086 s.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from narwhal.engines.kvevents import EventBatch

from .routerkit import Stack, engine, fleet_doc

CACHING = {"prefix_caching": True, "prompt_tokens_details": True, "block_size": 16}
FAST = {"a": 0.020, "b": 1.5e-4, "c": 1.5e-9}
SLOW = {k: v * 2 for k, v in FAST.items()}
DECODE_FAST = {"c0": 0.015, "c1": 2e-4, "c2": 1e-7}
DECODE_SLOW = {k: v * 2.5 for k, v in DECODE_FAST.items()}
SLO = {"ttft_s": 0.5, "tpot_s": 0.05}


def issue_fleet(capacity: int = 65536, **controller: Any) -> dict[str, Any]:
    """The fleet, each engine's cache ``capacity`` tokens."""
    common = {"kv_capacity_tokens": capacity, "transfer_s_per_token": 1e-5, **CACHING}
    return fleet_doc(
        engine("p-fast", 8101, ["prefill"], prefill=FAST, **common),
        engine("p-slow", 8102, ["prefill"], prefill=SLOW, **common),
        engine("d-fast", 8103, ["decode"], decode=DECODE_FAST, **common),
        engine("d-slow", 8104, ["decode"], decode=DECODE_SLOW, **common),
        controller={"slo": SLO, "admission": "refuse", **controller},
        engine={"first_token_timeout_s": 30.0, "decode_read_timeout_s": 10.0, "request_timeout_s": 120.0},
        server={"max_concurrent_requests": 10000},
    )


def kv_events_in_memory(stack: Stack, names: tuple[str, ...] = ("p-fast", "p-slow", "d-fast", "d-slow")) -> None:
    """The engines' KV events go straight to the router's prefix index (exact views),
    each step's batch as the engine's publisher would send it."""
    index = stack.router.state.prefix
    for name in names:
        index.follow(name)
        view = index.views[name]
        view.capacity_blocks = index.capacity_blocks.get(name)  # type: ignore[union-attr]

        def publish(events: list[Any], n: str = name) -> None:
            index.apply(n, EventBatch(0.0, tuple(events)))

        stack.engine(name).scheduler.publish = publish


async def sessions(
    stack: Stack,
    rate: Callable[[], float],
    n: int,
    *,
    count: int = 32,
    systems: int = 4,
    seed: int = 5,
    max_history: int = 3000,
    named: bool = False,
) -> None:
    """``count`` multi-turn sessions over ``systems`` system prompts of 512 tokens, 50-200
    new tokens a turn, 20-60 tokens of output (its stand-in repeated by the next turn),
    a session ending when its history would pass ``max_history`` tokens (a new one
    starts); each session sends its next turn an exponential think time after the one
    before (open loop, as ``tools/bench_goodput.py``'s traces: the fleet receives about
    ``rate()`` requests a second however it answers); ``named``: each request names its
    session (``x-session-id``)."""
    rng = random.Random(seed)
    heads = [" ".join(f"sys{k}w{j}" for j in range(512)) for k in range(systems)]
    sent = 0
    next_id = 0

    async def one(nursery: trio.Nursery, first: float) -> None:
        nonlocal sent, next_id
        await trio.sleep(first)
        while sent < n:
            sid, next_id = next_id, next_id + 1
            history, turn = heads[sid % systems], 0
            while sent < n:
                user = " ".join(f"s{sid}t{turn}u{j}" for j in range(rng.randint(50, 200)))
                out = rng.randint(20, 60)
                history = f"{history} {user}"
                if len(history.split()) > max_history:
                    break
                sent += 1
                headers = {"x-session-id": f"session-{sid}"} if named else None
                nursery.start_soon(partial(stack.complete, headers=headers), {"prompt": history, "max_tokens": out})
                history += " " + " ".join(f"s{sid}t{turn}a{j}" for j in range(out))
                turn += 1
                await trio.sleep(rng.expovariate(rate() / count))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one, nursery, rng.uniform(0, count / rate()))


async def shared_prefixes(stack: Stack, rate: float, n: int, *, prefixes: int = 16, seed: int = 3) -> None:
    """Poisson arrivals; ``prefixes`` prefixes of 1,024 tokens, uniform popularity, 50-250
    tokens of each request's own, 20-60 of output."""
    rng = random.Random(seed)
    heads = [" ".join(f"h{k}w{j}" for j in range(1024)) for k in range(prefixes)]

    async def one(i: int, head: str, tail: int, out: int) -> None:
        await stack.complete({"prompt": f"{head} " + " ".join(f"r{i}w{j}" for j in range(tail)), "max_tokens": out})

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i, rng.choice(heads), rng.randint(50, 250), rng.randint(20, 60))
            await trio.sleep(rng.expovariate(rate))


def met(record: dict[str, Any]) -> bool:
    """Whether a journal record met the SLO (client TTFT: the first token out)."""
    first, tpot = record.get("first_byte_s"), record.get("tpot_s") or 0.0
    return record["terminal_class"] == "ok" and first is not None and first <= SLO["ttft_s"] and tpot <= SLO["tpot_s"]
