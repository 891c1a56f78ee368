"""A router in front of simulated engines, all in memory (virtual-time safe)."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from narwhal.config import FleetConfig, parse_fleet
from narwhal.profile.store import Profiles
from narwhal.router.journal import Journal
from narwhal.router.service import Router, open_router
from narwhal.testing import MemoryNetwork, SimFleet, open_memory_network, open_sim_fleet
from narwhal.tracing import Tracing

ROUTER_HOST = "router.test"
ROUTER_PORT = 8000

SIM = {
    "seed": 1,
    "model": "sim-llama",
    "max_model_len": 4096,
    "prefill": {"a": 0.010, "b": 1e-4, "c": 0.0},
    "decode": {"c0": 0.005, "c1": 0.0, "c2": 0.0},
    "transfer_s_per_token": 0.0,
}


def engine(name: str, port: int, roles: list[str], **sim: Any) -> dict[str, Any]:
    block = copy.deepcopy(SIM)
    for key, value in sim.items():
        if isinstance(value, dict) and isinstance(block.get(key), dict):
            block[key].update(value)
        else:
            block[key] = value
    return {
        "name": name,
        "url": f"http://{name}.test:{port}",
        "roles": roles,
        "connector": {"type": "NixlConnector", "kv_host": f"{name}.kv.test", "kv_port": 15000 + port},
        "sim": block,
    }


def fleet_doc(*engines: dict[str, Any], **sections: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "server": {"host": ROUTER_HOST, "port": ROUTER_PORT},
        "engines": list(engines)
        or [engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"])],
    }  # every other section: the shipped defaults (a test overrides only what it is about)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc


def scripted_decodes(
    steps: list[tuple[float, bytes]], *, engine: str = "d0", hang: bool = False
) -> Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]:
    """A ``wrap`` for :func:`open_stack`: ``engine`` answers every decode (a streamed
    request) with ``steps`` (a wait in seconds, then the bytes), then ends the body (or
    hangs, with ``hang``); every other request goes to the simulated engines."""

    class Scripted(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for wait, data in steps:
                await trio.sleep(wait)
                yield data
            if hang:
                await trio.sleep_forever()

    class Wrapped(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.host == f"{engine}.test" and request.method == "POST" and json.loads(await request.aread()).get("stream"):
                return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Scripted())
            return await self.inner.handle_async_request(request)

    return Wrapped


@attrs.define
class Stack:
    config: FleetConfig
    net: MemoryNetwork
    fleet: SimFleet
    router: Router
    client: httpx.AsyncClient
    records: list[dict[str, Any]]

    def engine(self, name: str) -> Any:
        return self.fleet.engines[name]

    async def complete(self, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> httpx.Response:
        return await self.client.post("/v1/completions", json=body, headers=headers)

    async def stream(self, body: dict[str, Any], *, path: str = "/v1/completions") -> tuple[int, list[Any]]:
        """POST with stream=true; returns (status, events) where events are parsed data
        payloads (``"[DONE]"`` kept as a string)."""
        events: list[Any] = []
        async with self.client.stream("POST", path, json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return resp.status_code, [resp.json()]
            buf = b""
            async for data in resp.aiter_bytes():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    assert event.startswith(b"data: "), event
                    payload = event[len(b"data: "):].decode()
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
        return 200, events

    def assert_clean(self) -> None:
        state = self.router.state
        assert state.placement.open_reservations == 0
        assert all(
            load.prefill_requests == 0 and load.decode_requests == 0 and load.prefill_tokens == 0
            for load in state.placement.loads.values()
        )
        assert state.in_flight == 0
        assert all(v == 0 for v in state.in_flight_by_engine.values())


async def sim_profiles(config: FleetConfig, network: MemoryNetwork) -> Profiles:
    """Profiles that state each simulated engine's configured latency model exactly,
    bound to the generation running now (what a perfect profiler would write)."""
    from narwhal.engines.client import EngineClient
    from narwhal.profile import store

    from .checkkit import sim_profile

    engines = {}
    for e in config.engines:
        assert e.sim is not None
        async with EngineClient(e.url, name=e.name, transport=network.wire_transport()) as client:
            identity = await client.identity()
        capacity = e.sim.kv_capacity_tokens
        engines[e.name] = sim_profile(
            e.name,
            identity,
            prefill=attrs.asdict(e.sim.prefill),
            decode=attrs.asdict(e.sim.decode),
            active=(1.0, 256.0),
            kv_tokens=(0.0, float(capacity)),
            kv_capacity=capacity,
            max_length=e.sim.max_model_len,
        )
    return store.Profiles(
        schema_version=store.SCHEMA_VERSION, created_at="2026-01-01T00:00:00Z", software={"narwhal": "test"},
        samples=store.SamplesRef(path="profiles.samples.json", sha256="0" * 64), engines=engines,
    )  # fmt: skip


@asynccontextmanager
async def open_stack(
    doc: dict[str, Any] | None = None,
    *,
    priced: bool = False,
    wrap: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None,
    profile: Callable[[FleetConfig, SimFleet], Awaitable[Profiles]] | None = None,
    tracing: Tracing | None = None,
    journal_path: Path | None = None,
) -> AsyncIterator[Stack]:
    """A router in front of simulated engines, in memory; ``priced`` gives it profiles
    that state the simulated latency models exactly, ``profile`` those it returns for
    the running engines (a profiling run); ``wrap`` wraps the router's transport to the
    engines (to answer some requests otherwise); ``tracing`` is the router's tracer;
    ``journal_path`` the journal's file (None: records go to ``Stack.records`` only)."""
    config = parse_fleet(doc if doc is not None else fleet_doc())
    records: list[dict[str, Any]] = []
    journal = Journal(journal_path)
    journal.add_listener(records.append)
    async with open_memory_network() as net:
        async with open_sim_fleet(config, network=net) as fleet:
            profiles = await sim_profiles(config, net) if priced else None
            if profile is not None:
                profiles = await profile(config, fleet)
            transport = fleet.transport if wrap is None else wrap(fleet.transport)
            async with open_router(
                config, transport=transport, journal=journal, profiles=profiles, tracing=tracing
            ) as router:
                net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
                async with httpx.AsyncClient(
                    transport=net.transport(), base_url=f"http://{ROUTER_HOST}:{ROUTER_PORT}", timeout=None
                ) as client:
                    stack = Stack(config, net, fleet, router, client, records)
                    yield stack
                stack.assert_clean()
        # Every connection (client to router, router to engines) is closed.
        assert net.open_connections == 0
