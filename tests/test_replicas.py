"""Router replicas on one fleet: each counts the load the others placed, from the engines' reports."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.config import FleetConfig, parse_fleet
from narwhal.router.journal import Journal
from narwhal.router.placement import Placement
from narwhal.router.service import Router, open_router
from narwhal.testing import MemoryNetwork, SimFleet, open_memory_network, open_sim_fleet

from .routerkit import engine, fleet_doc, sim_profiles
from .test_priced_placement import OUTPUT, PROMPT_WORDS, attainment, hetero

# Long prefills (0.5 s at 4000 tokens), decode TPOT that grows with the batch.
FLEET = (
    engine("p0", 8101, ["prefill"], prefill={"b": 1.2e-4}),
    engine("p1", 8102, ["prefill"], prefill={"b": 1.2e-4}),
    engine("d0", 8103, ["decode"], decode={"c1": 0.002}),
    engine("d1", 8104, ["decode"], decode={"c1": 0.002}),
)
POLL_S = 0.1
RATE = 40.0


@attrs.define
class Replica:
    router: Router
    client: httpx.AsyncClient
    records: list[dict[str, Any]]

    async def complete(self, body: dict[str, Any]) -> httpx.Response:
        return await self.client.post("/v1/completions", json=body)

    @property
    def placement(self) -> Placement:
        return self.router.state.placement


@asynccontextmanager
async def open_replicas(
    n: int, *, poll_s: float = POLL_S, priced: bool = False, doc: dict[str, Any] | None = None
) -> AsyncIterator[tuple[SimFleet, list[Replica]]]:
    """``n`` routers in front of one simulated fleet (``doc``, by default ``FLEET``), in
    memory; each reads the engines' load every ``poll_s`` (0: never)."""
    doc = doc if doc is not None else fleet_doc(*FLEET)
    doc = {**doc, "server": {**doc.get("server", {}), "engine_load_poll_s": poll_s}}
    config: FleetConfig = parse_fleet(doc)
    async with open_memory_network() as net, open_sim_fleet(config, network=net) as fleet, AsyncExitStack() as stack:
        profiles = await sim_profiles(config, net) if priced else None
        replicas = []
        for i in range(n):
            records: list[dict[str, Any]] = []
            journal = Journal(None)
            journal.add_listener(records.append)
            router = await stack.enter_async_context(
                open_router(config, transport=net.wire_transport(), journal=journal, profiles=profiles)
            )
            host = f"router-{i}.test"
            net.listen(host, 8000, router.server)
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=net.transport(), base_url=f"http://{host}:8000", timeout=None)
            )
            replicas.append(Replica(router, client, records))
        yield fleet, replicas
    assert_released(net)


def assert_released(net: MemoryNetwork) -> None:
    assert net.open_connections == 0


async def _long_stream(replica: Replica, prompt_len: int, max_tokens: int, done: list[dict[str, Any]]) -> None:
    resp = await replica.complete({"prompt": [7] * prompt_len, "max_tokens": max_tokens})
    assert resp.status_code == 200, resp.text
    done.append(resp.json())


@pytest.mark.parametrize("priced", [False, True], ids=["least-loaded", "priced"])
async def test_a_replica_avoids_the_decode_engine_another_loaded(autojump_clock: trio.abc.Clock, priced: bool) -> None:
    async with open_replicas(2, priced=priced) as (fleet, (a, b)):
        done: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:
            for _ in range(3):  # A's long streams, all on d0 (p0/p1 spread their prefills)
                nursery.start_soon(_long_stream, a, 10, 300, done)
                await trio.sleep(0.02)
            await trio.sleep(3 * POLL_S)  # both replicas have polled since the streams started
            assert fleet.engines["d0"].running + fleet.engines["d1"].running == 3
            loaded = max(("d0", "d1"), key=lambda n: fleet.engines[n].running)
            assert fleet.engines[loaded].running >= 2
            for _ in range(2):
                resp = await b.complete({"prompt": [5] * 10, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
            quiet = "d1" if loaded == "d0" else "d0"
            assert [r["consumer"] for r in b.records] == [quiet, quiet]
            # A counts those streams as its own, B as others'.
            assert a.placement.loads[loaded].others == 0
            assert b.placement.loads[loaded].others == fleet.engines[loaded].running
            text = b.router.metrics.exposition().decode()
            assert f'narwhal_engine_others_requests{{engine="{loaded}"}} {float(fleet.engines[loaded].running)}' in text
        assert len(done) == 3


@pytest.mark.parametrize("priced", [False, True], ids=["least-loaded", "priced"])
async def test_a_replica_avoids_the_producer_another_is_prefilling_on(
    autojump_clock: trio.abc.Clock, priced: bool
) -> None:
    async with open_replicas(2, priced=priced) as (fleet, (a, b)):
        done: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_long_stream, a, 4000, 2, done)  # a 0.5 s prefill on p0
            await trio.sleep(2.5 * POLL_S)
            busy = next(n for n in ("p0", "p1") if fleet.engines[n].running + fleet.engines[n].waiting)
            resp = await b.complete({"prompt": [5] * 100, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert b.records[0]["producer"] != busy
            assert b.placement.others_prefill(busy) == 1 and a.placement.others_prefill(busy) == 0
        assert len(done) == 1


async def test_replicas_spread_streams_as_one_router_would(autojump_clock: trio.abc.Clock) -> None:
    """Three streams through A, then three through B: three on each consumer, as one
    router would place them (B alone would put two of its own on A's busier one)."""
    async with open_replicas(2) as (fleet, (a, b)):
        done: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:
            for replica in (a, b):
                for _ in range(3):
                    nursery.start_soon(_long_stream, replica, 10, 400, done)
                    await trio.sleep(0.01)
                await trio.sleep(2 * POLL_S)  # B has polled since A placed
            await trio.sleep(POLL_S)
            running = sorted(fleet.engines[n].running for n in ("d0", "d1"))
            assert running == [3, 3], running
        assert len(done) == 6


async def _offered_load(replicas: list[Replica], *, rate: float, n: int, seed: int = 7) -> None:
    """Poisson arrivals at ``rate`` requests/s, open loop, round robin over ``replicas``."""
    rng = random.Random(seed)

    async def one(i: int) -> None:
        prompt = " ".join(f"r{i}w{j}" for j in range(PROMPT_WORDS))
        await replicas[i % len(replicas)].complete({"prompt": prompt, "max_tokens": OUTPUT})

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
            await trio.sleep(rng.expovariate(rate))


async def test_two_priced_replicas_hold_the_slo_like_one_router(autojump_clock: trio.abc.Clock) -> None:
    """The same arrivals on the heterogeneous fleet of the priced-placement test: one
    router, two replicas behind a round-robin client that share the engines' load, and
    two that do not (each admits as if the fleet were its own)."""
    results: dict[str, float] = {}
    for label, n, poll_s in (("one", 1, 0.0), ("shared", 2, POLL_S), ("blind", 2, 0.0)):
        async with open_replicas(n, poll_s=poll_s, priced=True, doc=hetero(controller={"admission": "refuse"})) as (
            _, replicas,
        ):  # fmt: skip
            await _offered_load(replicas, rate=RATE, n=200)
        records = [r for replica in replicas for r in replica.records]
        assert len(records) == 200
        results[label] = attainment(records)
    print(f"attainment at {RATE:g}/s: one router {results['one']:.3f}, two replicas sharing load "
          f"{results['shared']:.3f}, two blind {results['blind']:.3f}")  # fmt: skip
    # What one replica places is unseen by the other for up to a period: sharing
    # closes most of the gap, not all of it (docs/operations.md has the figures).
    assert results["shared"] >= results["one"] - 0.15
    assert results["blind"] < results["shared"] - 0.2


def test_own_placements_count_at_once_on_top_of_the_others_reported_share() -> None:
    """Between two reports a router's own placements add to the others' share; taking
    the larger of its own load and the report would let it pile onto one engine."""
    p = Placement(["p0"], ["d0", "d1"])
    for _ in range(3):
        p.choose(10, 10, avoid=frozenset({"d1"}))  # three of ours on d0
    p.engine_reported("d0", 5, 0, 3)  # d0: ours and two of another router's
    p.engine_reported("d1", 4, 0, 0)  # d1: four of another router's
    assert (p.others_decode("d0"), p.others_decode("d1")) == (2, 4)
    consumers = [p.choose(10, 10).consumer for _ in range(3)]
    assert consumers.count("d1") < 3, consumers  # d0 holds 5, d1 4 + what we add


def test_an_engine_of_both_roles_splits_the_others_share_by_what_waits() -> None:
    p = Placement(["e0", "p1"], ["e0", "d1"])
    p.engine_reported("e0", 5, 2, 1)  # 6 of others': 2 waiting (prefills), 4 running
    assert (p.others_prefill("e0"), p.others_decode("e0")) == (2, 4)
    p.engine_reported("p1", 1, 3, 0)
    p.engine_reported("d1", 1, 3, 0)
    assert (p.others_prefill("p1"), p.others_decode("d1")) == (4, 4)
    p.engine_reported("d1", 1, 0, 3)  # more of ours than it reports: none of others'
    assert p.others_decode("d1") == 0
    p.engine_reported("gone", 9, 9, 0)  # an engine placement does not know: ignored
    assert "gone" not in p.loads


def test_serve_engine_load_poll_flag_sets_the_period_for_the_process_and_its_workers(tmp_path: Any) -> None:
    import json

    from narwhal import cli

    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(fleet_doc(*FLEET)))
    args = cli._parser().parse_args(["serve", "--fleet", str(fleet), "--engine-load-poll", "250ms", "--workers", "2"])
    assert cli._serve_config(args).server.engine_load_poll_s == 0.25
    argv = cli._worker_argv(args, cli._serve_config(args))(0)
    assert argv[argv.index("--engine-load-poll") + 1] == "0.25"
    plain = cli._parser().parse_args(["serve", "--fleet", str(fleet)])
    assert cli._serve_config(plain).server.engine_load_poll_s == 0.0  # off unless asked


async def test_bench_sends_round_robin_over_repeated_urls(autojump_clock: trio.abc.Clock, tmp_path: Any) -> None:
    import io
    import json

    from narwhal.bench.cli import run_async

    async with open_replicas(2) as (fleet, (a, b)):
        out, err = io.StringIO(), io.StringIO()
        argv = ["--url", "http://router-0.test:8000", "--url", "http://router-1.test:8000/", "--out", str(tmp_path),
                "--rate", "10", "--arrival", "constant", "--num-requests", "5", "--input-len", "20",
                "--output-len", "4", "--no-progress"]  # fmt: skip
        rc = await run_async(argv, transport=fleet.network.transport(), out=out, err=err)
        assert rc == 0, err.getvalue()
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["terminal_class"] for r in results] == ["ok"] * 5
    ids = [r["request_id"] for r in results]
    assert [r["request_id"] for r in a.records] == ids[0::2]
    assert [r["request_id"] for r in b.records] == ids[1::2]
    run = json.loads((tmp_path / "summary.json").read_text())["run"]
    assert run["url"] == "http://router-0.test:8000"
    assert run["urls"] == ["http://router-0.test:8000", "http://router-1.test:8000"]
