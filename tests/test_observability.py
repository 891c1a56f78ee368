"""Prometheus /metrics and the live events WebSocket on the admin surface."""

from __future__ import annotations

import json

import httpx
import trio
import trio.testing
import trio_websocket
from prometheus_client.parser import text_string_to_metric_families

from narwhal.config import FaultSpec

from .routerkit import fleet_doc, open_stack

ADMIN = ("admin.test", 8001)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_parse_and_counters_move(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(recovery={"eject_after": 1, "probe_interval_s": 1000.0})
    async with open_stack(doc) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
            before = _samples((await admin.get("/metrics")).text)
            assert before[("narwhal_in_flight_requests", ())] == 0
            for _ in range(3):
                assert (await stack.complete({"prompt": "a b c", "max_tokens": 4})).status_code == 200
            stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=1))
            assert (await stack.complete({"prompt": "a b c", "max_tokens": 4})).status_code == 502
            resp = await admin.get("/metrics")
            assert resp.headers["content-type"].startswith("text/plain")
            after = _samples(resp.text)
    ok = (("route", "completions"), ("terminal_class", "ok"))
    failed = (("route", "completions"), ("terminal_class", "decode_failed"))
    assert after[("narwhal_requests_total", ok)] == 3
    assert after[("narwhal_requests_total", failed)] == 1
    assert after[("narwhal_router_ttft_seconds_count", (("route", "completions"),))] == 3
    assert after[("narwhal_router_tpot_seconds_count", (("route", "completions"),))] == 3
    assert after[("narwhal_output_tokens_total", (("route", "completions"),))] == 12
    assert after[("narwhal_placement_decisions_total", (("consumer", "d0"), ("producer", "p0")))] == 4
    # d0 is the only decode engine: ejected but held in placement (a whole wave).
    assert after[("narwhal_breaker_state", (("engine", "d0"),))] == 3
    assert after[("narwhal_breaker_transitions_total", (("engine", "d0"), ("event", "ejected")))] == 1
    assert after[("narwhal_reservations_open", ())] == 0


async def test_events_deliver_a_record_and_a_breaker_transition(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(recovery={"eject_after": 1, "probe_interval_s": 1000.0})
    async with open_stack(doc) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        stream = await stack.net.connect(*ADMIN)
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, "admin.test", "/events")
            await trio.testing.wait_all_tasks_blocked()
            assert stack.router.events.subscribers == 1
            resp = await stack.complete({"prompt": "a b", "max_tokens": 2}, headers={"x-request-id": "evt-1"})
            assert resp.status_code == 200
            event = json.loads(await ws.get_message())
            assert event["type"] == "request"
            assert event["record"]["request_id"] == "evt-1"
            assert event["record"]["terminal_class"] == "ok"
            stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=1))
            await stack.complete({"prompt": "a b", "max_tokens": 2})
            kinds = [json.loads(await ws.get_message()) for _ in range(3)]
            assert {"breaker", "request"} == {k["type"] for k in kinds}
            breaker = [(k["engine"], k["event"]) for k in kinds if k["type"] == "breaker"]
            # d0 is the only decode engine: ejected, and held in placement (a whole wave).
            assert breaker == [("d0", "ejected"), ("d0", "held")]
            await ws.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert stack.router.events.subscribers == 0


async def test_events_requires_websocket(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
            assert (await admin.get("/events")).status_code == 400
            assert (await admin.post("/metrics")).status_code == 405
            assert (await admin.get("/health")).status_code == 200
