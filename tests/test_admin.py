"""The admin surface's answers: status, content type and body of each route, the
reload's answers and log lines, and the refusals' messages."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, cast

import attrs
import httpx
import pytest
import trio
import trio.testing
import trio_websocket

from narwhal.config import EngineGroupConfig
from narwhal.router.admin import AdminApp
from narwhal.router.metrics import CONTENT_TYPE

from .routerkit import Stack, engine, fleet_doc, open_stack

ADMIN = ("127.0.0.1", 8001)
BARE = ("127.0.0.2", 8002)  # (a second admin surface: another loopback address)


@asynccontextmanager
async def _admin(stack: Stack, address: tuple[str, int] = ADMIN) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=stack.net.transport(), base_url=f"http://{address[0]}:{address[1]}") as c:
        yield c


async def test_fleet_describes_every_engine_and_the_slo(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(controller={"slo": {"ttft_s": 1.5, "tpot_s": 0.05}})
    async with open_stack(doc) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with _admin(stack) as admin:
            resp = await admin.get("/fleet")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {
        "engines": [
            {"name": "p0", "url": "http://p0.test:8101", "roles": ["prefill"], "models": ["sim-llama"],
             "breaker": "ok", "streak": 0, "in_flight": 0, "reserved_prefill_tokens": 0,
             "reserved_decode_requests": 0},
            {"name": "d0", "url": "http://d0.test:8102", "roles": ["decode"], "models": ["sim-llama"],
             "breaker": "ok", "streak": 0, "in_flight": 0, "reserved_prefill_tokens": 0,
             "reserved_decode_requests": 0},
        ],
        "slo": {"ttft_s": 1.5, "tpot_s": 0.05},
        "in_flight": 0,
    }  # fmt: skip


async def test_fleet_counts_a_request_in_flight(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with _admin(stack) as admin, trio.open_nursery() as nursery:
            nursery.start_soon(stack.complete, {"prompt": "a b", "max_tokens": 500})
            await trio.sleep(0.5)  # decoding on d0
            view = (await admin.get("/fleet")).json()
            engines = {e["name"]: e for e in view["engines"]}
            assert view["in_flight"] == 1
            assert (engines["d0"]["in_flight"], engines["d0"]["reserved_decode_requests"]) == (1, 1)
            assert engines["p0"]["in_flight"] == 0


async def test_metrics_and_health(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with _admin(stack) as admin:
            metrics = await admin.get("/metrics")
            health = await admin.get("/health")
            stack.router.state.breaker.states["d0"].ejected = True  # no decode engine left
            unready = await admin.get("/health")
    assert metrics.status_code == 200 and metrics.headers["content-type"] == CONTENT_TYPE
    assert "narwhal_requests_total" in metrics.text
    assert health.status_code == 200 and health.headers["content-type"] == "application/json"
    assert health.json()["status"] == "ready" and health.json()["engines"]["d0"]["url"] == "http://d0.test:8102"
    assert unready.status_code == 503 and unready.json()["status"] != "ready"


#: What the admin surface refuses, and how: a worker's and the workers' combined
#: surface (tests/test_fanin.py) alike.
REFUSALS = [
    ("POST", "/metrics", 405, "POST is not allowed on /metrics"),
    ("DELETE", "/fleet", 405, "DELETE is not allowed on /fleet"),
    ("PUT", "/health", 405, "PUT is not allowed on /health"),
    ("GET", "/nothing", 404, "no route for GET /nothing"),
    ("GET", "/events", 400, "/events is a WebSocket endpoint (send Upgrade: websocket)"),
]


@pytest.mark.parametrize(("method", "path", "status", "message"), REFUSALS)
async def test_other_requests_are_refused_with_a_clear_error(
    autojump_clock: trio.abc.Clock, method: str, path: str, status: int, message: str
) -> None:
    async with open_stack() as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with _admin(stack) as admin:
            resp = await admin.request(method, path)
    assert resp.status_code == status and resp.json()["error"]["message"] == message


async def test_put_fleet_applies_and_logs_what_changed(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    more = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
    async with open_stack(more) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with _admin(stack) as admin:
            with caplog.at_level(logging.INFO, logger="narwhal.router.admin"):
                resp = await admin.put("/fleet", content=json.dumps(fleet_doc()).encode())
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {
        "status": "applied", "source": "PUT /fleet", "added": [], "removed": ["d1"], "replaced": [], "roles": [],
        "settings": [],
    }  # fmt: skip
    [line] = [r for r in caplog.records if r.name == "narwhal.router.admin"]
    assert (line.levelno, line.getMessage()) == (logging.INFO, "fleet reloaded (PUT /fleet): removed d1")


async def test_put_fleet_refused_names_the_path_and_logs_it(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_stack() as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        config = stack.router.state.config
        async with _admin(stack) as admin:
            with caplog.at_level(logging.INFO, logger="narwhal.router.admin"):
                resp = await admin.put("/fleet", content=json.dumps(fleet_doc(engine={"request_timeout_s": -1})).encode())
        assert stack.router.state.config is config
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert body["status"] == "rejected" and set(body) == {"status", "error"}
    assert body["error"]["path"] == "$.engine.request_timeout_s" and body["error"]["type"] == "invalid_fleet"
    [line] = [r for r in caplog.records if r.name == "narwhal.router.admin"]
    assert line.levelno == logging.ERROR
    assert line.getMessage() == (
        f"fleet reload (PUT /fleet) refused, nothing changed: {body['error']['message']} @ $.engine.request_timeout_s"
    )


async def test_a_surface_without_a_reload_says_so(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        router = stack.router
        bare = AdminApp(router.state, router.metrics, router.events)
        assert bare.reload is None and bare.discovery is None
        from narwhal.http import HTTPServer

        stack.net.listen(*BARE, HTTPServer(bare))
        async with _admin(stack, BARE) as admin:
            resp = await admin.put("/fleet", content=b"{}")
    assert resp.status_code == 404 and resp.json()["error"]["message"] == "this router cannot reload its fleet"


async def test_fleet_shows_each_engine_groups_last_resolution(autojump_clock: trio.abc.Clock) -> None:
    # What /fleet says of DNS-found engines, directly (tests/test_discovery.py resolves them).
    async with open_stack() as stack:
        state = stack.router.state
        bare = AdminApp(state, stack.router.metrics, stack.router.events)
        groups = (
            EngineGroupConfig(name="decode", host="decode.svc", port=8000, roles=("decode",)),
            EngineGroupConfig(name="more", host="more.svc", port=8000, roles=("decode",)),
        )
        found = SimpleNamespace(addresses={"decode": ("10.0.0.2", "10.0.0.3")}, errors={"more": "no such name"})
        assert "engine_groups" not in bare.fleet()  # neither groups nor a resolver
        bare.discovery = found  # type: ignore[assignment]
        assert "engine_groups" not in bare.fleet()  # a resolver, but no group configured
        state.config = attrs.evolve(state.config, engine_groups=groups)
        view = bare.fleet()
        bare.discovery = None
        assert "engine_groups" not in bare.fleet()  # groups, but nothing resolves them here
    assert view["engine_groups"] == {
        "decode": {"host": "decode.svc", "addresses": ["10.0.0.2", "10.0.0.3"], "error": None},
        "more": {"host": "more.svc", "addresses": [], "error": "no such name"},
    }
    assert [e["name"] for e in view["engines"]] == ["p0", "d0"]  # type: ignore[attr-defined]


async def test_fleet_shows_kv_events_and_unknown_models_on_their_engine(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        state = stack.router.state
        state.kv_subscribers["p0"] = SimpleNamespace(stale="no event for 30 s", delivered=12, probe_gaps=1)  # type: ignore[assignment]
        state.placement.set_models("d0", ())  # its models not known (yet)
        engines = AdminApp(state, stack.router.metrics, stack.router.events).fleet()["engines"]
        del state.kv_subscribers["p0"]
    p0, d0 = cast(list[dict[str, Any]], engines)
    assert p0["kv_events"] == {"state": "stale", "detail": "no event for 30 s", "delivered": 12, "probe_gaps": 1}
    assert "kv_events" not in d0 and d0["models"] == [] and p0["models"] == ["sim-llama"]


async def test_events_are_compact_json_and_a_client_leaving_ends_its_subscription(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_stack() as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        stream = await stack.net.connect(*ADMIN)
        with caplog.at_level(logging.WARNING):
            async with trio.open_nursery() as nursery:
                ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/events")  # type: ignore[arg-type]
                await trio.testing.wait_all_tasks_blocked()
                stack.router.events.publish({"type": "x", "n": [1, 2]})
                assert await ws.get_message() == '{"type":"x","n":[1,2]}'
                await ws.aclose()
            await trio.testing.wait_all_tasks_blocked()
        assert stack.router.events.subscribers == 0
    assert [r.getMessage() for r in caplog.records] == []  # ended quietly


async def test_a_surface_stopping_closes_its_events_clients_in_order(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        stream = await stack.net.connect(*ADMIN)
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/events")  # type: ignore[arg-type]
            await trio.testing.wait_all_tasks_blocked()
            assert stack.router.events.subscribers == 1
            await stack.router.admin.shutdown(0)
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()
        await stream.aclose()  # trio-websocket leaves a client's stream open when the server closes first
        assert stack.router.events.subscribers == 0
    assert closed.value.reason is not None and closed.value.reason.code == 1000  # a close frame, not a dropped stream
