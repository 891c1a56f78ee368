"""Admission per latency class, end to end over the simulated fleet in virtual time: a
flood from one tenant leaves the others their share; a queued request is released when
capacity frees and refused at its class's deadline; priority order; limits with 429 and
Retry-After; the class priority reaches the engines only when they schedule by it."""

from __future__ import annotations

import collections
from typing import Any

import httpx
import pytest
import trio

from .routerkit import Stack, engine, fleet_doc, open_stack

#: A prompt of 1,000 tokens: 0.11 s of prefill on p0 (a = 10 ms, b = 0.1 ms a token).
PROMPT = " ".join(["w"] * 1000)
KEYS = {"a": "sk-tenant-a-0001", "b": "sk-tenant-b-0002", "hi": "sk-hi-0003", "lo": "sk-lo-0004"}


def tenancy_doc(classes: list[dict[str, Any]], tenants: list[dict[str, Any]], **tenancy: Any) -> dict[str, Any]:
    """p0 and d0, priced; each tenant named by its key in :data:`KEYS`."""
    names = [t["name"] for t in tenants]
    return fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"]),
        server={"api_keys": [{"key": KEYS[n], "name": n} for n in names]},
        tenancy={"classes": classes, "tenants": tenants, **tenancy},
    )


async def send(stack: Stack, tenant: str, rid: str, *, delay: float = 0.0, prompt: str = PROMPT,
               headers: dict[str, str] | None = None, max_tokens: int = 4) -> tuple[httpx.Response, float]:  # fmt: skip
    """One request of ``tenant`` after ``delay``; its response and its latency."""
    await trio.sleep(delay)
    start = trio.current_time()
    response = await stack.complete(
        {"prompt": prompt, "max_tokens": max_tokens},
        headers={"authorization": f"Bearer {KEYS[tenant]}", "x-request-id": rid, **(headers or {})},
    )
    return response, trio.current_time() - start


async def run_all(stack: Stack, jobs: list[tuple[str, str, float]]) -> dict[str, tuple[httpx.Response, float]]:
    """Send ``(tenant, request id, delay)`` jobs concurrently; their outcomes by id."""
    out: dict[str, tuple[httpx.Response, float]] = {}

    async def one(tenant: str, rid: str, delay: float) -> None:
        out[rid] = await send(stack, tenant, rid, delay=delay)

    async with trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(one, *job)
    return out


def by_id(stack: Stack) -> dict[str, dict[str, Any]]:
    return {r["request_id"]: r for r in stack.records}


BATCH = {"name": "batch", "wait": True, "slo": {"ttft_s": 3.0}}


async def behind_a_long_prompt(stack: Stack, rid: str) -> tuple[httpx.Response, float]:
    """Tenant a's request ``rid``, sent 10 ms after a 3,000-token prompt of a's (0.31 s of
    prefill): its outcome and latency."""
    long = " ".join(["w"] * 3000)

    async def first() -> None:
        await send(stack, "a", "long", prompt=long)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.sleep(0.01)
        return await send(stack, "a", rid)


# ------------------------------------------------------------------ fair shares


async def test_a_flood_from_one_tenant_leaves_the_other_its_share(autojump_clock: trio.abc.Clock) -> None:
    doc = tenancy_doc([BATCH], [{"name": "a", "latency_class": "batch"}, {"name": "b", "latency_class": "batch"}])
    async with open_stack(doc, priced=True) as stack:
        # a sends 60 requests at once (6.6 s of prefill, more than its 3 s target lets it
        # wait); b one every 0.25 s, about half of what the producer carries.
        jobs = [("a", f"a{i}", 0.0) for i in range(60)] + [("b", f"b{i}", 0.25 * i) for i in range(20)]
        out = await run_all(stack, jobs)
        records = by_id(stack)
    b = [out[f"b{i}"] for i in range(20)]
    # Every one of b's requests is served, none waiting behind a's backlog: b takes
    # its turn each time the producer frees up.
    assert [r.status_code for r, _ in b] == [200] * 20
    assert max(latency for _, latency in b) < 0.6
    # a's backlog is served as the producer allows, and what cannot be served within its
    # class's 3 s is refused, once its own prefill would end past the target, not left to
    # time out.
    statuses = collections.Counter(out[f"a{i}"][0].status_code for i in range(60))
    assert set(statuses) == {200, 503} and 10 <= statuses[200] <= 30
    refused = [records[f"a{i}"] for i in range(60) if out[f"a{i}"][0].status_code == 503]
    assert all(r["terminal_class"] == "refused" and 2.85 < r["queued_s"] <= 3.0 for r in refused)
    assert all(r["error"].startswith(("can no longer meet the batch TTFT target after waiting",
                                      "waited 3 s in the batch queue until its deadline")) for r in refused)  # fmt: skip
    assert all(records[f"b{i}"]["tenant"] == "b" and records[f"b{i}"]["latency_class"] == "batch" for i in range(20))


async def test_weights_share_the_fleet_in_proportion(autojump_clock: trio.abc.Clock) -> None:
    batch = {**BATCH, "slo": {"ttft_s": 4.0}}
    doc = tenancy_doc([batch], [{"name": "a", "latency_class": "batch", "weight": 3.0},
                                {"name": "b", "latency_class": "batch"}])  # fmt: skip
    async with open_stack(doc, priced=True) as stack:
        out = await run_all(stack, [(t, f"{t}{i}", 0.0) for i in range(40) for t in ("a", "b")])
    served = collections.Counter(rid[0] for rid, (r, _) in out.items() if r.status_code == 200)
    # Both flood alike; a's weight is three times b's: it gets three quarters of what is served.
    assert served["a"] + served["b"] >= 25
    assert served["a"] / (served["a"] + served["b"]) == pytest.approx(0.75, abs=0.06)


# ------------------------------------------------------------------ the queue


async def test_a_queued_request_is_released_when_capacity_frees(autojump_clock: trio.abc.Clock) -> None:
    doc = tenancy_doc([BATCH], [{"name": "a", "latency_class": "batch"}])
    async with open_stack(doc, priced=True) as stack:
        response, latency = await behind_a_long_prompt(stack, "queued")
        record = by_id(stack)["queued"]
    assert response.status_code == 200
    # It waited for the long prompt's prefill (its own would have started 0.3 s late on the
    # producer), then was placed: the wait is in the router, not in the engine.
    assert record["queued_s"] == pytest.approx(0.3, abs=0.02)
    assert record["queue_reason"].startswith("p0 is busy")
    assert latency == pytest.approx(record["queued_s"] + 0.11 + 0.02, abs=0.03)
    assert record["attempts"][0]["placement_wait_s"] == pytest.approx(record["queued_s"])


async def test_a_queued_request_is_refused_at_its_class_deadline(autojump_clock: trio.abc.Clock) -> None:
    batch = {**BATCH, "max_wait_s": 0.2}
    doc = tenancy_doc([batch], [{"name": "a", "latency_class": "batch"}])
    async with open_stack(doc, priced=True) as stack:
        response, latency = await behind_a_long_prompt(stack, "late")
        record = by_id(stack)["late"]
    # 0.2 s from its arrival, exactly: a 503 with Retry-After, the wait and why in the journal.
    assert latency == pytest.approx(0.2)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["message"].startswith("waited 0.2 s in the batch queue until its deadline")
    assert record["terminal_class"] == "refused" and record["queued_s"] == pytest.approx(0.2)
    assert record["queue_reason"].startswith("p0 is busy")


async def test_a_request_that_can_no_longer_make_it_gives_way_to_the_next(autojump_clock: trio.abc.Clock) -> None:
    batch = {**BATCH, "slo": {"ttft_s": 1.0}}
    doc = tenancy_doc([batch], [{"name": "a", "latency_class": "batch"}])
    async with open_stack(doc, priced=True) as stack:
        out: dict[str, tuple[httpx.Response, float]] = {}

        async def one(rid: str, delay: float, words: int) -> None:
            out[rid] = await send(stack, "a", rid, delay=delay, prompt=" ".join(["w"] * words))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "long1", 0.0, 4000)  # 0.41 s of prefill each
            nursery.start_soon(one, "long2", 0.001, 4000)
            nursery.start_soon(one, "big", 0.01, 3000)  # 0.31 s
            nursery.start_soon(one, "small", 0.02, 100)  # 0.02 s
    # When the producer frees at 0.82 s, big has waited 0.81 s: with its own 0.31 s it is
    # past its 1 s target, refused then rather than at its deadline, and small, behind it,
    # goes in its place.
    big, latency = out["big"]
    assert big.status_code == 503 and latency == pytest.approx(0.81, abs=0.01)
    assert big.json()["error"]["message"].startswith("can no longer meet the batch TTFT target after waiting 0.8")
    assert out["small"][0].status_code == 200 and out["small"][1] < 1.0


async def test_a_full_queue_refuses_at_once(autojump_clock: trio.abc.Clock) -> None:
    batch = {**BATCH, "max_queued": 2}
    doc = tenancy_doc([batch], [{"name": "a", "latency_class": "batch"}])
    async with open_stack(doc, priced=True) as stack:
        out = await run_all(stack, [("a", f"a{i}", 0.0) for i in range(6)])
    latencies = sorted((r.status_code, latency) for r, latency in out.values())
    full = [latency for status, latency in latencies if status == 503]
    # Two in the engines (one computing, one next), two queued, the rest refused at once.
    assert len(full) == 2 and full == [0.0, 0.0]
    assert all("queue is full (2 requests" in r.json()["error"]["message"] for r, _ in out.values()
               if r.status_code == 503)  # fmt: skip


async def test_a_class_that_may_not_wait_is_refused_at_once(autojump_clock: trio.abc.Clock) -> None:
    chat = {"name": "chat", "slo": {"ttft_s": 0.3}}
    doc = tenancy_doc([chat], [{"name": "a", "latency_class": "chat"}])
    async with open_stack(doc, priced=True) as stack:
        out = await run_all(stack, [("a", f"a{i}", 0.0) for i in range(5)])
    codes = sorted(r.status_code for r, _ in out.values())
    # 0.11 s a prefill: two fit its 0.3 s target (with the handoff), the others are refused
    # at once rather than queued.
    assert codes == [200, 200, 503, 503, 503]
    assert all(latency == 0.0 for r, latency in out.values() if r.status_code == 503)


# ------------------------------------------------------------------ priorities


async def test_queued_requests_are_released_in_priority_order(autojump_clock: trio.abc.Clock) -> None:
    classes = [{"name": "high", "priority": 0, "wait": True, "slo": {"ttft_s": 10.0}},
               {"name": "low", "priority": 5, "wait": True, "slo": {"ttft_s": 10.0}}]  # fmt: skip
    doc = tenancy_doc(classes, [{"name": "hi", "latency_class": "high"}, {"name": "lo", "latency_class": "low"}])
    async with open_stack(doc, priced=True) as stack:
        jobs = [("lo", f"lo{i}", 0.001 * i) for i in range(8)] + [("hi", f"hi{i}", 0.05 + 0.001 * i) for i in range(3)]
        out = await run_all(stack, jobs)
        order = [rid.split("-")[0] for rid in stack.engine("p0").request_ids_seen if rid is not None]
    assert all(r.status_code == 200 for r, _ in out.values())
    # lo0 and lo1 went to the producer at once (the second to wait one prefill there); the
    # rest of lo queued. hi, arriving later, goes ahead of every queued lo request.
    assert order == ["lo0", "lo1", "hi0", "hi1", "hi2", "lo2", "lo3", "lo4", "lo5", "lo6", "lo7"]


async def test_a_lower_class_leaves_room_for_the_class_above(autojump_clock: trio.abc.Clock) -> None:
    classes = [{"name": "chat", "priority": 0, "slo": {"ttft_s": 0.5}},
               {"name": "bulk", "priority": 5, "slo": {"ttft_s": 5.0}}]  # fmt: skip
    doc = tenancy_doc(classes, [{"name": "hi", "latency_class": "chat"}, {"name": "lo", "latency_class": "bulk"}])
    async with open_stack(doc, priced=True) as stack:
        # bulk may not wait: what it cannot place now is refused; it is placed only while the
        # producer's queue stays within half of chat's 0.5 s target.
        out = await run_all(stack, [("lo", f"lo{i}", 0.0) for i in range(10)] + [("hi", "hi", 0.01)])
    bulk = collections.Counter(out[f"lo{i}"][0].status_code for i in range(10))
    assert bulk == {200: 2, 503: 8}
    response, latency = out["hi"]
    assert response.status_code == 200 and latency < 0.5


async def test_a_request_may_ask_for_a_class_its_tenant_allows(autojump_clock: trio.abc.Clock) -> None:
    classes = [{"name": "chat", "priority": 0, "slo": {"ttft_s": 0.5}},
               {"name": "batch", "priority": 5, "wait": True, "slo": {"ttft_s": 5.0}}]  # fmt: skip
    doc = tenancy_doc(classes, [{"name": "a", "latency_class": "batch", "classes": ["chat"]},
                                {"name": "b", "latency_class": "batch"}])  # fmt: skip
    async with open_stack(doc, priced=True) as stack:
        up, _ = await send(stack, "a", "a-chat", headers={"x-narwhal-class": "chat"})
        denied, _ = await send(stack, "b", "b-chat", headers={"x-narwhal-class": "chat"})
        unknown, _ = await send(stack, "b", "b-what", headers={"x-narwhal-class": "what"})
        records = by_id(stack)
    assert up.status_code == 200 and records["a-chat"]["latency_class"] == "chat"
    assert denied.status_code == 403 and unknown.status_code == 403
    assert denied.json()["error"] == {"message": "class 'chat' is not one tenant b may ask for",
                                      "type": "permission_error", "code": "class_not_allowed"}  # fmt: skip
    assert records["b-chat"]["terminal_class"] == "invalid_request" and records["b-chat"]["tenant"] is None


# ------------------------------------------------------------------ limits


async def test_requests_per_second_over_the_limit_get_429_with_retry_after(autojump_clock: trio.abc.Clock) -> None:
    limits = {"requests_per_s": 2.0}
    doc = tenancy_doc([BATCH], [{"name": "a", "latency_class": "batch", "limits": limits},
                                {"name": "b", "latency_class": "batch"}])  # fmt: skip
    async with open_stack(doc, priced=True) as stack:
        out = await run_all(stack, [("a", "a0", 0.0), ("a", "a1", 0.0), ("a", "a2", 0.0), ("b", "b0", 0.0)])
        later, _ = await send(stack, "a", "a3", delay=0.5)
        records = by_id(stack)
    limited = [rid for rid, (r, _) in out.items() if r.status_code == 429]
    assert len(limited) == 1 and limited[0].startswith("a")  # b has no limit
    response, latency = out[limited[0]]
    assert latency == 0.0 and response.headers["retry-after"] == "1"
    assert response.json()["error"] == {"message": "tenant a is over its requests_per_s limit",
                                        "type": "rate_limit_error", "code": "rate_limit_exceeded"}  # fmt: skip
    assert records[limited[0]]["terminal_class"] == "rate_limited"
    assert later.status_code == 200  # the bucket refilled


async def test_tokens_and_in_flight_limits(autojump_clock: trio.abc.Clock) -> None:
    tenants = [{"name": "a", "latency_class": "batch", "limits": {"tokens_per_s": 1500.0}},
               {"name": "b", "latency_class": "batch", "limits": {"max_in_flight": 1}}]  # fmt: skip
    async with open_stack(tenancy_doc([BATCH], tenants), priced=True) as stack:
        first, _ = await send(stack, "a", "a0")  # 1,004 tokens of the bucket's 1,500
        second, _ = await send(stack, "a", "a1")
        out = await run_all(stack, [("b", "b0", 0.0), ("b", "b1", 0.01)])
        third, _ = await send(stack, "b", "b2")
    assert first.status_code == 200 and second.status_code == 429
    # 1,004 tokens taken, ~170 refilled meanwhile: ~0.2 s until 1,004 are there again.
    assert second.headers["retry-after"] == "1"
    assert "tokens_per_s" in second.json()["error"]["message"]
    assert out["b0"][0].status_code == 200 and out["b1"][0].status_code == 429
    assert "max_in_flight" in out["b1"][0].json()["error"]["message"]
    assert third.status_code == 200  # b0 ended: its place is free again


async def test_each_replica_enforces_its_share_without_a_store(autojump_clock: trio.abc.Clock) -> None:
    limits = {"requests_per_s": 4.0, "max_in_flight": 20}
    doc = tenancy_doc([BATCH], [{"name": "a", "latency_class": "batch", "limits": limits}], replicas=2)
    async with open_stack(doc, priced=True) as stack:
        out = await run_all(stack, [("a", f"a{i}", 0.0) for i in range(4)])
    codes = collections.Counter(r.status_code for r, _ in out.values())
    # 4/s over two replicas: 2/s here, a bucket of 2.
    assert codes == {200: 2, 429: 2}
    message = next(r for r, _ in out.values() if r.status_code == 429).json()["error"]["message"]
    assert message == "tenant a is over its requests_per_s limit (this router's share: 1/2)"


# ------------------------------------------------------------------ the engines


@pytest.mark.parametrize("engine_priority", [False, True])
async def test_the_class_priority_reaches_the_engines_only_when_they_schedule_by_it(
    autojump_clock: trio.abc.Clock, engine_priority: bool
) -> None:
    classes = [{"name": "chat", "priority": -1, "slo": {"ttft_s": 1.0}},
               {"name": "batch", "priority": 3, "wait": True, "slo": {"ttft_s": 5.0}}]  # fmt: skip
    doc = tenancy_doc(classes, [{"name": "a", "latency_class": "chat"}, {"name": "b", "latency_class": "batch"}],
                      engine_priority=engine_priority)  # fmt: skip
    for e in doc["engines"]:  # engines that run fcfs answer a priority but 0 with 400, as vLLM's do
        e["sim"]["scheduling_policy"] = "priority" if engine_priority else "fcfs"
    async with open_stack(doc, priced=True) as stack:
        for tenant in ("a", "b"):
            body: dict[str, Any] = {"prompt": "hello", "max_tokens": 2}
            if engine_priority:
                body["priority"] = -99  # a client's own is never the engines'
            response = await stack.complete(body, headers={"authorization": f"Bearer {KEYS[tenant]}"})
            assert response.status_code == 200
        seen = [body.get("priority", "none") for name in ("p0", "d0") for body in stack.engine(name).requests_seen
                if isinstance(body, dict) and "prompt" in body]  # fmt: skip
    # Each request's prefill and decode legs carry its class's priority, or none at all.
    assert sorted(seen) == ([-1, -1, 3, 3] if engine_priority else ["none"] * 4)


async def test_a_simulated_engine_schedules_by_priority(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill", "decode"], scheduling_policy="priority", max_num_seqs=1))
    async with open_stack(doc) as stack:
        done: list[str] = []

        async with httpx.AsyncClient(transport=stack.fleet.transport, base_url="http://p0.test:8101") as client:

            async def one(rid: str, priority: int, delay: float) -> None:
                await trio.sleep(delay)
                r = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 20, "priority": priority})
                assert r.status_code == 200
                done.append(rid)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "first", 5, 0.0)
                for i, p in enumerate([5, 1, 3]):
                    nursery.start_soon(one, f"p{p}", p, 0.01 + 0.001 * i)
    # One sequence at a time: the waiting ones are admitted by priority, then arrival.
    assert done == ["first", "p1", "p3", "p5"]


# ------------------------------------------------------------------ defaults and the record


async def test_without_tenancy_requests_carry_no_tenant(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(priced=True) as stack:
        response = await stack.complete({"prompt": "hello", "max_tokens": 2})
        [record] = stack.records
        stack.net.listen("admin.test", 8001, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
            fleet = (await admin.get("/fleet")).json()
    assert response.status_code == 200
    assert (record["tenant"], record["latency_class"], record["queued_s"], record["queue_reason"]) == (None, None, 0.0, None)
    assert "tenancy" not in fleet


async def test_metrics_per_class_and_tenant(autojump_clock: trio.abc.Clock) -> None:
    batch = {**BATCH, "max_wait_s": 0.2}
    doc = tenancy_doc([batch], [{"name": "a", "latency_class": "batch", "limits": {"requests_per_s": 100.0}},
                                {"name": "b", "latency_class": "batch"}])  # fmt: skip
    async with open_stack(doc, priced=True) as stack:
        await run_all(stack, [("a", f"a{i}", 0.0) for i in range(6)] + [("b", "b0", 0.0)])
        text = stack.router.metrics.exposition().decode()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line and not line.startswith("#")}  # fmt: skip
    met = lines['narwhal_tenant_slo_total{latency_class="batch",outcome="met",tenant="a"}']
    missed = lines['narwhal_tenant_slo_total{latency_class="batch",outcome="missed",tenant="a"}']
    assert met + missed == 6 and missed >= 1
    assert lines['narwhal_slo_attainment_ratio{latency_class="batch",tenant="a"}'] == pytest.approx(met / 6)
    assert lines['narwhal_admission_queued{latency_class="batch",tenant="a"}'] == 0
    assert lines['narwhal_admission_total{latency_class="batch",outcome="expired",tenant="a"}'] == missed
    assert lines['narwhal_admission_wait_seconds_count{latency_class="batch",tenant="a"}'] >= missed
    assert sum(v for k, v in lines.items() if k.startswith('narwhal_tenant_requests_total{latency_class="batch",tenant="b"')) == 1
    assert lines['narwhal_tenant_served_tokens{tenant="a"}'] > 0


# ------------------------------------------------------------------ admission's own arithmetic


def _admission(limits: dict[str, Any], *, replicas: int = 1, weight: float = 1.0) -> Any:
    from narwhal.config import parse_fleet
    from narwhal.router.admission import Admission
    from narwhal.router.placement import Placement

    doc = tenancy_doc([BATCH], [{"name": "a", "latency_class": "batch", "limits": limits, "weight": weight}],
                      replicas=replicas)  # fmt: skip
    return Admission(parse_fleet(doc), Placement(["p0"], ["d0"]))


async def _limited(adm: Any, tokens: int = 1) -> float | None:
    """The Retry-After of a request of ``tokens`` tokens (None: admitted)."""
    from narwhal.errors import RateLimited

    try:
        await adm.admit(adm.ticket(lambda name: None, "a", {}), tokens, 0)
    except RateLimited as err:
        return err.retry_after_s
    return None


async def test_each_process_takes_its_share_of_every_limit(autojump_clock: trio.abc.Clock) -> None:
    adm = _admission({"max_in_flight": 2, "tokens_per_s": 300.0, "requests_per_s": 600.0}, replicas=3)
    # max_in_flight 2 over 3 processes: 1 here (never 0); tokens 300/s: 100/s, a bucket of 100.
    assert await _limited(adm, 150) is None  # from a full bucket, into debt
    assert await _limited(adm) == 1.0  # in flight: the one place is taken
    adm._tenants["a"].in_flight = 0
    assert await _limited(adm, 50) == pytest.approx(1.0)  # (50 - (-50)) / 100
    assert adm._tenants["a"].requests.rate == 200.0 and adm._tenants["a"].requests.depth == 200.0


async def test_a_reload_keeps_what_a_bucket_holds_at_its_new_rate(autojump_clock: trio.abc.Clock) -> None:
    adm = _admission({"requests_per_s": 2.0, "burst_s": 2.0})
    for _ in range(4):
        assert await _limited(adm) is None
    assert await _limited(adm) == pytest.approx(0.5)
    await trio.sleep(0.25)  # half a request refilled at the old rate
    faster = _admission({"requests_per_s": 4.0, "burst_s": 0.5}).config
    adm.configure(faster)
    bucket = adm._tenants["a"].requests
    assert (bucket.rate, bucket.depth, bucket.level) == (4.0, 2.0, pytest.approx(0.5))
    assert await _limited(adm) == pytest.approx(0.125)  # the other half at the new rate
    await trio.sleep(10)
    assert bucket.wait_s(trio.current_time(), 1) == 0 and bucket.level == 2.0  # never above the new depth


async def test_unused_output_is_given_back_to_the_share(autojump_clock: trio.abc.Clock) -> None:
    adm = _admission({}, weight=2.0)
    ticket = adm.ticket(lambda name: None, "a", {})
    adm._charge(ticket, 1000)  # 600 prompt tokens and an output limit of 400
    assert adm.served["a"] == 500.0
    await adm.release(ticket, 100, 400)  # 300 of the 400 never came
    assert adm.served["a"] == 350.0 and ticket.charged == 0.0
    await adm.release(ticket, 100, 400)  # (given back once)
    assert adm.served["a"] == 350.0
