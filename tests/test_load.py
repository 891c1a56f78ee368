"""Load: thousands of concurrent streaming clients against the simulated fleet.

In memory and in virtual time: every client opens its own connection at once and
streams for about three (virtual) seconds, so that all of them are in flight
together; a few percent of the requests meet an injected fault. Every client must
end with a complete stream or with the error its fault calls for, every request
with exactly one journal record of the matching class, and the router must be
clean afterwards. The 2,000-client run is marked ``slow``; the default suite runs
the same check with 500 clients.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import trio

from narwhal.config import FaultSpec

from .loadkit import Outcome, exchange
from .routerkit import ROUTER_HOST, ROUTER_PORT, engine, fleet_doc, open_stack

TOKENS = 10
STEP_S = 0.3
_SIM = {
    "prefill": {"a": 0.0005, "b": 1e-5, "c": 0.0},
    "decode": {"c0": STEP_S, "c1": 0.0, "c2": 0.0},
    "max_num_seqs": 4096,
    "kv_capacity_tokens": 10_000_000,
}


def load_doc() -> dict[str, Any]:
    return fleet_doc(
        engine("p0", 8101, ["prefill"], **_SIM),
        engine("p1", 8102, ["prefill"], **_SIM),
        engine("d0", 8103, ["decode"], **_SIM),
        engine("d1", 8104, ["decode"], **_SIM),
        # The breaker is exercised elsewhere; here every injected fault must show up
        # as exactly one failed client request, so nothing is ejected or probed.
        recovery={"eject_after": 1_000_000},
    )


async def run_load(clients: int) -> None:
    async with open_stack(load_doc()) as stack:
        # About 2 % of requests meet a fault: a decode stream cut after 5 tokens, or
        # a producer answering 503.
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=5, probability=0.04))
        stack.engine("p1").inject(FaultSpec(kind="http_error", on="prefill", status=503, probability=0.04))
        state = stack.router.state
        outcomes: list[Outcome] = []
        peak = 0

        async def client(i: int) -> None:
            conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
            body = {"prompt": f"client {i} says hello", "max_tokens": TOKENS, "stream": True}
            outcomes.append(await exchange(conn, body, request_id=f"load-{i:05d}"))

        async def watch(scope: trio.CancelScope) -> None:
            nonlocal peak
            with scope:
                while True:
                    peak = max(peak, state.in_flight)
                    await trio.sleep(0.01)

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            watcher = trio.CancelScope()
            nursery.start_soon(watch, watcher)
            async with trio.open_nursery() as clients_nursery:
                for i in range(clients):
                    clients_nursery.start_soon(client, i)
            watcher.cancel()
        held = trio.current_time() - t0

        injected = sum(sum(sim.stats.faults.values()) for sim in stack.fleet.engines.values())
        # Every client was in flight at once, but for those a fault had already ended.
        assert peak >= clients - injected, "the clients were never all in flight together"
        assert TOKENS * STEP_S <= held < 2 * TOKENS * STEP_S + 5.0
        assert len(outcomes) == clients
        by_id = {r["request_id"]: r for r in stack.records}
        assert len(by_id) == len(stack.records) == clients  # one record per request
        seen: Counter[str] = Counter()
        for out in outcomes:
            record = by_id[out.request_id]
            if out.ok:
                assert out.tokens == TOKENS and record["terminal_class"] == "ok"
            elif out.status == 200:  # the stream was cut: its terminal event
                assert out.error is not None and out.error["type"] == "engine_error" and not out.done
                assert out.tokens == 5 and record["terminal_class"] == "decode_failed"
                assert record["consumer"] == "d0"
            else:  # the producer's 503 before any output
                assert out.status == 502 and record["terminal_class"] == "prefill_failed"
                assert record["producer"] == "p1"
            seen[record["terminal_class"]] += 1
        # No errors beyond those injected, and every injected fault is one failure.
        assert seen["decode_failed"] + seen["prefill_failed"] == injected
        assert set(seen) <= {"ok", "decode_failed", "prefill_failed"}
        assert 0 < injected < clients * 0.1
        for sim in stack.fleet.engines.values():
            assert sim.stats.active == 0


async def test_500_concurrent_streaming_clients(autojump_clock: trio.abc.Clock) -> None:
    await run_load(500)


@pytest.mark.slow
async def test_2000_concurrent_streaming_clients(autojump_clock: trio.abc.Clock) -> None:
    await run_load(2000)
