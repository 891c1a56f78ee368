"""Several models behind one router: each request is placed only on engines of its model.

Two models, each with its own producers and consumer(s), run as simulated engines in
memory; a simulated engine answers a request for a model it does not serve with 404
(as vLLM does), so a placement that crossed models would fail the request.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from narwhal.config import FaultSpec
from narwhal.router.probe import probe_engine
from tests.routerkit import Stack, engine, fleet_doc, open_stack

A, B = "llama-a", "llama-b"
POOLS = {A: {"pa0", "pa1", "da0"}, B: {"pb0", "db0", "db1"}}


def model_engine(name: str, port: int, roles: list[str], model: str, *, declare: bool = True, **sim: Any) -> dict[str, Any]:
    doc = engine(name, port, roles, model=model, **sim)
    if declare:
        doc["model"] = model
    return doc


def two_models(*, declare: bool = True, **sections: Any) -> dict[str, Any]:
    """Model A: producers pa0, pa1 and consumer da0; model B: producer pb0, consumers db0,
    db1 (B's engines list their model with a longer context)."""
    return fleet_doc(
        model_engine("pa0", 8101, ["prefill"], A, declare=declare),
        model_engine("pb0", 8102, ["prefill"], B, declare=declare, max_model_len=8192),
        model_engine("pa1", 8103, ["prefill"], A, declare=declare),
        model_engine("db0", 8104, ["decode"], B, declare=declare, max_model_len=8192),
        model_engine("da0", 8105, ["decode"], A, declare=declare),
        model_engine("db1", 8106, ["decode"], B, declare=declare, max_model_len=8192),
        **sections,
    )


def assert_in_pool(record: dict[str, Any]) -> None:
    pool = POOLS[record["model"]]
    for attempt in record["attempts"]:
        placed = {attempt["producer"], attempt["consumer"]} - {None}  # None: refused before placement
        assert placed <= pool, record


async def one_request(stack: Stack, i: int, results: list[tuple[str, int, Any]]) -> None:
    model = (A, B)[i % 2]
    body = {"model": model, "prompt": f"request {i} " + "word " * (i % 7), "max_tokens": 3 + i % 4}
    if i % 3 == 0:
        status, events = await stack.stream(body)
        results.append((model, status, events))
    else:
        resp = await stack.complete(body)
        results.append((model, resp.status_code, resp.json()))


@pytest.mark.parametrize("priced", [False, True], ids=["least-loaded", "priced"])
async def test_concurrent_load_never_crosses_models(autojump_clock: trio.abc.Clock, priced: bool) -> None:
    async with open_stack(two_models(), priced=priced) as stack:
        results: list[tuple[str, int, Any]] = []
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(120):
                    nursery.start_soon(one_request, stack, i, results)
        assert [status for _, status, _ in results] == [200] * 120, results
        for model, _, body in results:
            answers = [e for e in body if isinstance(e, dict)] if isinstance(body, list) else [body]
            assert answers and all(a["model"] == model for a in answers)
        records = stack.records
        assert len(records) == 120 and {r["model"] for r in records} == {A, B}
        for record in records:
            assert record["terminal_class"] == "ok"
            assert_in_pool(record)
        used = {r["producer"] for r in records} | {r["consumer"] for r in records}
        if not priced:  # least reserved load spreads inside each pool: every engine took part
            assert used == POOLS[A] | POOLS[B]
        else:
            pricing = stack.router.state.placement.counters  # type: ignore[attr-defined]
            assert pricing["priced"] == 120 and pricing["fallback"] == 0


async def test_models_are_listed_and_learned_from_the_engines(autojump_clock: trio.abc.Clock) -> None:
    """No engine declares its model: the router learns each from the engine's /v1/models,
    lists both with their context limits, and places by them."""
    async with open_stack(two_models(declare=False)) as stack:
        resp = await stack.client.get("/v1/models")
        assert resp.status_code == 200
        listed = {m["id"]: m["max_model_len"] for m in resp.json()["data"]}
        assert listed == {A: 4096, B: 8192}
        placement = stack.router.state.placement
        assert placement.models == {name: frozenset({m}) for m, pool in POOLS.items() for name in pool}
        for i in range(12):
            assert (await stack.complete({"model": (A, B)[i % 2], "prompt": "x y z", "max_tokens": 2})).status_code == 200
        for record in stack.records:
            assert_in_pool(record)
        # Each model's own limit bounds its requests: 5000 tokens fit B's 8192, not A's 4096.
        big = {"prompt": list(range(5000)), "max_tokens": 10}
        assert (await stack.complete({**big, "model": B})).status_code == 200
        over = await stack.complete({**big, "model": A})
        assert over.status_code == 400 and "maximum context length is 4096" in over.json()["error"]["message"]


async def test_a_model_is_listed_with_the_smallest_limit_of_its_engines(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        model_engine("p0", 8101, ["prefill"], A, max_model_len=2048),
        model_engine("d0", 8102, ["decode"], A, max_model_len=4096),
    )
    async with open_stack(doc) as stack:
        data = (await stack.client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in data] == [(A, 2048)]


async def test_an_unknown_or_missing_model_names_the_served_ones(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(two_models()) as stack:
        unknown = await stack.complete({"model": "llama-c", "prompt": "hi", "max_tokens": 2})
        assert unknown.status_code == 404
        assert unknown.json()["error"] == {
            "message": "model 'llama-c' does not exist (served: 'llama-a', 'llama-b')",
            "type": "not_found_error",
            "code": "model_not_found",
        }
        missing = await stack.complete({"prompt": "hi", "max_tokens": 2})
        assert missing.status_code == 400
        assert missing.json()["error"] == {
            "message": "'model' is required: this router serves several models ('llama-a', 'llama-b')",
            "type": "invalid_request_error",
            "code": "model_required",
        }
        chat = await stack.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_required"
        assert [r["terminal_class"] for r in stack.records] == ["invalid_request"] * 3
        assert all(r["attempts"] == [] for r in stack.records)


async def test_one_model_needs_no_model_field(autojump_clock: trio.abc.Clock) -> None:
    """A fleet of one model serves requests that name none, as before."""
    async with open_stack() as stack:
        resp = await stack.complete({"prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200 and resp.json()["model"] == "sim-llama"


async def test_ejecting_one_models_only_consumer_leaves_the_other_model_serving(
    autojump_clock: trio.abc.Clock,
) -> None:
    doc = two_models(recovery={"eject_after": 2, "probe_interval_s": 3600.0})
    async with open_stack(doc) as stack:
        state = stack.router.state
        stack.engine("da0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=2))
        for _ in range(2):
            failed = await stack.complete({"model": A, "prompt": "hi", "max_tokens": 2})
            assert failed.status_code == 502
        assert state.breaker.status("da0") == "ejected"
        assert {n: state.breaker.status(n) for n in POOLS[B]} == dict.fromkeys(POOLS[B], "ok")

        # Model A has no consumer left: refused, never decoded on model B's consumers.
        refused = await stack.complete({"model": A, "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == "no engine of model 'llama-a' available for decode"
        # Model B serves on, under concurrent load.
        results: list[tuple[str, int, Any]] = []
        async with trio.open_nursery() as nursery:
            for i in range(1, 40, 2):  # odd: model B
                nursery.start_soon(one_request, stack, i, results)
        assert [s for _, s, _ in results] == [200] * 20
        for record in stack.records:
            for attempt in record["attempts"]:
                assert attempt["consumer"] != "da0" or record["model"] == A
                assert_in_pool(record)

        health = await stack.client.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ready" and body["engines"]["da0"] == "ejected"
        assert body["models"] == {A: "no engine can decode now", B: "ready"}
        metrics = stack.router.metrics.exposition().decode()
        assert f'narwhal_model_ready{{model="{A}"}} 0.0' in metrics
        assert f'narwhal_model_ready{{model="{B}"}} 1.0' in metrics
        assert 'narwhal_engine_model{engine="da0",model="llama-a"} 1.0' in metrics
        assert f'narwhal_model_requests_total{{model="{B}",terminal_class="ok"}} 20.0' in metrics

        # The router is unready only when no model can be served.
        for name in POOLS[B]:
            state.breaker.eject(name, "test")
        body = state.health(detail=False)
        assert body["status"] == "unavailable"
        assert body["reason"] == (
            f"model {A!r}: no engine can decode now; model {B!r}: no engine can prefill or decode now"
        )


async def test_a_consumer_is_probed_through_a_producer_of_its_own_model(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(two_models()) as stack:
        state = stack.router.state
        state.breaker.eject("db0", "unreachable at start")
        assert await probe_engine(state, "db0") is True
        assert state.breaker.status("db0") == "trial"
        # The handoff came from model B's producer; model A's saw nothing.
        assert stack.engine("pb0").stats.requests > 0
        assert stack.engine("pa0").stats.requests == 0 and stack.engine("pa1").stats.requests == 0


async def test_the_admin_surface_shows_each_models_state_and_each_engines_model(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(two_models()) as stack:
        stack.net.listen("127.0.0.1", 8001, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            body = (await admin.get("/health")).json()
            fleet = (await admin.get("/fleet")).json()
        assert body["models"] == {A: "ready", B: "ready"}
        assert {e["name"]: e["models"] for e in fleet["engines"]} == {
            name: [model] for model, pool in POOLS.items() for name in pool
        }


def test_workers_combine_the_model_gauges_as_states_not_sums() -> None:
    from narwhal.router.fanin import combine_expositions

    def worker(ready: int) -> str:
        return (
            "# HELP narwhal_model_ready Ready.\n# TYPE narwhal_model_ready gauge\n"
            f'narwhal_model_ready{{model="{A}"}} {ready}\n'
            "# HELP narwhal_engine_model Served.\n# TYPE narwhal_engine_model gauge\n"
            f'narwhal_engine_model{{engine="da0",model="{A}"}} 1\n'
        )

    text = combine_expositions([worker(1), worker(0), worker(1)]).decode()
    assert f'narwhal_model_ready{{model="{A}"}} 1.0' in text
    assert f'narwhal_engine_model{{engine="da0",model="{A}"}} 1.0' in text


async def test_an_engine_unreachable_at_start_is_learned_when_readmitted(autojump_clock: trio.abc.Clock) -> None:
    """db1 declares no model and refuses connections at start: it is left out (among
    several models its model could only be guessed) until a readmission probe finds it
    serving and it tells its model."""
    doc = two_models(recovery={"probe_interval_s": 5.0})
    db1 = doc["engines"][5]
    del db1["model"]
    db1["sim"]["faults"] = [{"kind": "refuse_connection"}]
    async with open_stack(doc) as stack:
        state = stack.router.state
        assert state.breaker.status("db1") == "ejected" and "db1" not in state.placement.models
        assert not state.placement.serves("db1", B) and not state.placement.serves("db1", A)
        stack.engine("db1").clear_faults()
        await trio.sleep(6.0)  # a probe is due
        assert state.breaker.status("db1") == "trial"
        assert state.placement.models["db1"] == {B}
        results: list[tuple[str, int, Any]] = []
        async with trio.open_nursery() as nursery:
            for i in range(1, 24, 2):
                nursery.start_soon(one_request, stack, i, results)
        assert [s for _, s, _ in results] == [200] * 12
        assert "db1" in {r["consumer"] for r in stack.records}
        for record in stack.records:
            assert_in_pool(record)


async def test_each_model_learns_its_own_prompt_lengths(autojump_clock: trio.abc.Clock) -> None:
    # Each model has its own tokenizer: a producer's exact count teaches the estimator
    # of the request's model only.
    async with open_stack(two_models()) as stack:
        state = stack.router.state
        assert not state.exact_prompt_counts
        resp = await stack.client.post("/v1/completions", json={"model": B, "prompt": "one two three", "max_tokens": 2})
        assert resp.status_code == 200
        learned = {m: state.prompt_lengths_for(m).observations.get("completions", 0) for m in (A, B)}
    assert learned == {A: 0, B: 1}
