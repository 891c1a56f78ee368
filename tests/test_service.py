"""Running a router: what ``open_router`` starts, the reload entry point's handling of a
document in every form it arrives in, the listeners' defaults, and shutdown."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing
import trio_websocket

from narwhal.config import FleetConfig, parse_fleet
from narwhal.errors import ConfigError
from narwhal.http import ServerLimits
from narwhal.http.server import ListenError
from narwhal.profile.store import Profiles
from narwhal.router.controller import ReactiveController
from narwhal.router.journal import Journal
from narwhal.router.service import Prepare, Router, open_router, server_limits
from narwhal.testing import MemoryNetwork, open_memory_network, open_sim_fleet
from narwhal.testing.ports import free_port

from .routerkit import ROUTER_HOST, ROUTER_PORT, engine, fleet_doc, open_stack

BASE = fleet_doc()
MORE = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
EVERY = parse_fleet(MORE)


@asynccontextmanager
async def _router(
    doc: dict[str, Any] = BASE, *, prepare: Prepare | None = None, metrics_on_api_port: bool = False
) -> AsyncIterator[tuple[Router, MemoryNetwork]]:
    async with open_memory_network() as net, open_sim_fleet(EVERY, network=net) as sims:
        async with open_router(
            parse_fleet(doc), transport=sims.transport, prepare=prepare, metrics_on_api_port=metrics_on_api_port,
            journal=Journal(None),
        ) as router:
            net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
            yield router, net


def _fleet_events(router: Router) -> list[tuple[str, str, str | None]]:
    """The router's fleet records of reloads and refusals: (event, source, path)."""
    return [(e["event"], e["source"], e.get("path")) for e in router.fleet.changes if e["event"] in ("reload", "rejected")]


@pytest.mark.parametrize("form", ["dict", "str", "bytes", "bytearray", "memoryview"])
async def test_a_reload_takes_the_document_in_any_form(autojump_clock: trio.abc.Clock, form: str) -> None:
    import json

    text = json.dumps(MORE)
    document: Any = {
        "dict": MORE, "str": text, "bytes": text.encode(), "bytearray": bytearray(text.encode()),
        "memoryview": memoryview(text.encode()),
    }[form]  # fmt: skip
    async with _router() as (router, _):
        change = await router.reload(document, source="test")
        assert change.added == ("d1",)
        assert sorted(router.state.engines) == ["d0", "d1", "p0"]
        assert _fleet_events(router)[0] == ("reload", "test", None)


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe{}", "{not json", memoryview(b"[1,")])
async def test_a_document_that_is_not_json_is_refused_and_recorded(
    autojump_clock: trio.abc.Clock, body: Any
) -> None:
    async with _router() as (router, _):
        config = router.state.config
        with pytest.raises(ConfigError) as caught:
            await router.reload(body, source="PUT /fleet")
        assert caught.value.reason.startswith("the document is not JSON: ")
        assert caught.value.path == "$"
        assert caught.value.__cause__ is None and caught.value.__suppress_context__
        assert router.state.config is config
        assert _fleet_events(router) == [("rejected", "PUT /fleet", "$")]


async def test_without_a_file_there_is_nothing_to_re_read(autojump_clock: trio.abc.Clock) -> None:
    async with _router() as (router, _):
        with pytest.raises(ConfigError) as caught:
            await router.reload(source="SIGHUP")
        assert caught.value.reason == "the router was not started from a fleet document file: nothing to re-read"
        assert _fleet_events(router) == [("rejected", "SIGHUP", "$")]


async def test_a_reload_keeps_the_profiles_the_router_has_without_prepare(autojump_clock: trio.abc.Clock) -> None:
    async with _router() as (router, _):
        profiles = router.state.profiles
        await router.reload(MORE, source="test")
        assert router.state.profiles is profiles


async def test_prepare_turns_every_document_into_config(autojump_clock: trio.abc.Clock) -> None:
    seen: list[Any] = []

    def prepare(document: Any) -> tuple[FleetConfig, Profiles | None]:
        seen.append(document)
        if document is None:  # re-read "the file"
            return parse_fleet(MORE), None
        if document == {"bad": True}:
            raise ConfigError("refused by the checks", path="$.bad")
        return parse_fleet(document), None

    async with _router(prepare=prepare) as (router, _):
        change = await router.reload(source="SIGHUP")
        assert change.added == ("d1",)
        with pytest.raises(ConfigError, match="refused by the checks"):
            await router.reload(b'{"bad": true}', source="PUT /fleet")
        await router.reload(BASE, source="test")
        assert [(e, s) for e, s, _ in _fleet_events(router) if e in ("reload", "rejected")] == [
            ("reload", "SIGHUP"), ("rejected", "PUT /fleet"), ("reload", "test"),
        ]  # fmt: skip
    assert seen == [None, {"bad": True}, BASE]


async def test_the_listeners_default_to_the_documents_addresses() -> None:
    doc = fleet_doc(server={"host": "127.0.0.1", "port": 0, "admin_host": "127.0.0.1", "admin_port": 0})
    async with open_memory_network() as net, open_sim_fleet(EVERY, network=net) as sims:
        async with open_router(parse_fleet(doc), transport=sims.transport, journal=Journal(None)) as router:
            assert router.journal is router.state.journal and router.controller is None
            assert b"narwhal_requests_total" in router.metrics.exposition()
            async with trio.open_nursery() as nursery:
                [(host, port)] = await nursery.start(router.serve_tcp)
                [(admin_host, admin_port)] = await nursery.start(router.serve_admin_tcp)
                assert host == admin_host == "127.0.0.1" and port != admin_port != 0
                async with httpx.AsyncClient(trust_env=False) as client:
                    assert (await client.get(f"http://{host}:{port}/v1/models")).status_code == 200
                    health = await client.get(f"http://{admin_host}:{admin_port}/health")
                    assert health.status_code == 200 and "engines" in health.json()
                # Given explicitly, the arguments win.
                wanted, wanted_admin = free_port(), free_port()
                assert [("127.0.0.2", wanted)] == await nursery.start(router.serve_tcp, "127.0.0.2", wanted)
                assert [("127.0.0.2", wanted_admin)] == await nursery.start(
                    router.serve_admin_tcp, "127.0.0.2", wanted_admin
                )
                # A port already served is refused, unless every listener shares it.
                with pytest.raises(ListenError):
                    await nursery.start(router.serve_tcp, "127.0.0.2", wanted)
                shared = free_port()
                await nursery.start(functools.partial(router.serve_tcp, "127.0.0.3", shared, reuse_port=True))
                await nursery.start(functools.partial(router.serve_tcp, "127.0.0.3", shared, reuse_port=True))
                await router.shutdown()


def test_the_servers_limits_are_the_documents() -> None:
    config = parse_fleet(fleet_doc(server={
        "max_header_bytes": 1000, "max_body_bytes": 2000, "header_timeout_s": 3.0, "body_timeout_s": 4.0,
        "keepalive_timeout_s": 5.0,
    }))  # fmt: skip
    assert server_limits(config) == ServerLimits(
        max_header_bytes=1000, max_body_bytes=2000, header_timeout_s=3.0, body_timeout_s=4.0, keepalive_timeout_s=5.0
    )


@pytest.mark.parametrize("on_api_port", [True, False])
async def test_metrics_on_the_api_port_only_when_asked(autojump_clock: trio.abc.Clock, on_api_port: bool) -> None:
    async with _router(metrics_on_api_port=on_api_port) as (_, net):
        async with httpx.AsyncClient(transport=net.transport(), base_url=f"http://{ROUTER_HOST}:{ROUTER_PORT}") as c:
            resp = await c.get("/metrics")
    assert resp.status_code == (200 if on_api_port else 404)
    if on_api_port:
        assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert "narwhal_requests_total" in resp.text
    else:
        assert resp.json()["error"]["message"] == "no route for GET /metrics"


async def test_metrics_on_the_api_port_take_the_api_key(autojump_clock: trio.abc.Clock) -> None:
    doc = {**BASE, "server": {**BASE["server"], "api_keys": ["sk-router-key"]}}
    async with _router(doc, metrics_on_api_port=True) as (_, net):
        async with httpx.AsyncClient(transport=net.transport(), base_url=f"http://{ROUTER_HOST}:{ROUTER_PORT}") as c:
            refused = await c.get("/metrics")
            served = await c.get("/metrics", headers={"authorization": "Bearer sk-router-key"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert served.status_code == 200 and "narwhal_requests_total" in served.text


async def test_shutdown_drains_for_the_documents_grace(autojump_clock: trio.abc.Clock) -> None:
    doc = {**BASE, "server": {**BASE["server"], "shutdown_grace_s": 2.0}}
    async with _router(doc) as (router, net):
        async with httpx.AsyncClient(
            transport=net.transport(), base_url=f"http://{ROUTER_HOST}:{ROUTER_PORT}", timeout=None
        ) as client:

            async def stream() -> None:
                try:
                    async with client.stream(
                        "POST", "/v1/completions", json={"prompt": "a b", "max_tokens": 3000, "stream": True}
                    ) as resp:
                        async for _ in resp.aiter_bytes():
                            pass
                except httpx.HTTPError:
                    pass

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream)
                await trio.sleep(0.5)
                assert router.state.in_flight == 1
                t0 = trio.current_time()
                await router.shutdown()
                assert trio.current_time() - t0 == pytest.approx(2.0, abs=0.1)
                assert router.state.in_flight == 0


async def test_a_reload_without_prepare_keeps_the_profiles_it_prices_by(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(priced=True) as stack:
        profiles = stack.router.state.profiles
        assert profiles is not None
        change = await stack.router.reload(fleet_doc(engine={"request_timeout_s": 30.0}), source="test")
        assert change.settings == ("engine.request_timeout_s",) and stack.router.state.profiles is profiles


async def test_shutdown_closes_the_admin_surfaces_connections_at_once(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        stack.net.listen("127.0.0.1", 8001, stack.router.admin)
        stream = await stack.net.connect("127.0.0.1", 8001)
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/events")  # type: ignore[arg-type]
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            await stack.router.shutdown()  # no request in flight: nothing to drain
            # No grace for the admin surface's connections: a live events client is closed at
            # once, its close frame waiting at most a second for an answer.
            assert trio.current_time() - t0 <= 1.0
            with pytest.raises(trio_websocket.ConnectionClosed):
                await ws.get_message()
        await stream.aclose()


async def test_a_reactive_router_names_the_controller_its_fleet_reconfigures(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(controller={"reactive": {"enabled": True}})
    async with open_stack(doc, priced=True) as stack:
        controller = stack.router.controller
        assert isinstance(controller, ReactiveController) and controller is stack.router.fleet.controller
        assert stack.router.state.assign_roles == controller.assign
