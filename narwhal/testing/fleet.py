"""Simulated fleets: every engine with a ``sim`` block, served in memory or on TCP.

In memory (the default) each engine's :class:`~narwhal.http.server.HTTPServer` is
registered on a :class:`MemoryNetwork` at its url's ``host:port``, so httpx reaches it
through :attr:`SimFleet.transport` in virtual time. With ``sockets=True`` each engine
listens on real TCP at its url (``narwhal sim``, benchmarks), on the wall clock.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import httpx
import trio

from narwhal.config import EngineConfig, FleetConfig
from narwhal.http.server import HTTPServer
from narwhal.testing.app import SimApp
from narwhal.testing.engine import SimEngine
from narwhal.testing.kvfabric import KVFabric
from narwhal.testing.memnet import MemoryNetwork, open_memory_network

__all__ = ["SimFleet", "open_sim_fleet"]

_CLOSE_TIMEOUT_S = 5.0


@attrs.define(eq=False)
class SimFleet:
    """The running simulated engines of one fleet.

    Attributes:
        engines: The engines by name.
        apps: Their HTTP handlers by name.
        servers: Their HTTP servers by name.
        fabric: The KV fabric they share.
        network: The in-memory network they listen on (None with sockets).
        addresses: ``(host, port)`` each engine listens on, by name.
    """

    engines: dict[str, SimEngine] = attrs.field(factory=dict)
    apps: dict[str, SimApp] = attrs.field(factory=dict)
    servers: dict[str, HTTPServer] = attrs.field(factory=dict)
    fabric: KVFabric = attrs.field(factory=KVFabric)
    network: MemoryNetwork | None = None
    addresses: dict[str, tuple[str, int]] = attrs.field(factory=dict)
    _transport: httpx.AsyncBaseTransport | None = None

    @property
    def transport(self) -> httpx.AsyncBaseTransport:
        """The router's engine transport (:class:`~narwhal.engines.wire.WireTransport`)
        reaching every engine in memory."""
        if self.network is None:
            raise RuntimeError("a fleet on sockets has no in-memory transport; use its urls")
        if self._transport is None:
            self._transport = self.network.wire_transport()
        return self._transport

    def __getitem__(self, name: str) -> SimEngine:
        return self.engines[name]

    def url(self, name: str) -> str:
        """Base URL of engine ``name``."""
        return self.engines[name].config.url

    def client(self, name: str, **kwargs: object) -> httpx.AsyncClient:
        """An httpx client for engine ``name`` with its own connection pool (close it)."""
        if self.network is not None:
            kwargs.setdefault("transport", self.network.transport())
        return httpx.AsyncClient(base_url=self.url(name), **kwargs)  # type: ignore[arg-type]


class _SimServer(HTTPServer):
    """An engine's HTTP server that consults the engine before taking each connection.

    In memory the network asks :attr:`accepting` once per connection attempt, so a
    refusal is a real connect error; on sockets a refused connection is closed at once.
    """

    def __init__(self, engine: SimEngine, *, in_memory: bool) -> None:
        super().__init__(SimApp(engine), server_name="uvicorn")
        self.engine = engine
        self.in_memory = in_memory

    @property
    def accepting(self) -> bool:
        if not super().accepting:
            return False
        return not (self.in_memory and self.engine.take_connection_refusal())

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        if not self.in_memory and self.engine.take_connection_refusal():
            await trio.aclose_forcefully(stream)
            return
        await super().handle_connection(stream)


def _sim_engines(fleet: FleetConfig | Sequence[EngineConfig]) -> list[EngineConfig]:
    configs = fleet.engines if isinstance(fleet, FleetConfig) else fleet
    out = [c for c in configs if c.sim is not None]
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"engine names must be unique: {names}")
    return out


@asynccontextmanager
async def open_sim_fleet(
    fleet: FleetConfig | Sequence[EngineConfig],
    *,
    network: MemoryNetwork | None = None,
    sockets: bool = False,
) -> AsyncIterator[SimFleet]:
    """Start every engine of ``fleet`` that has a ``sim`` block; stop them all on exit.

    Args:
        fleet: A fleet document or a list of engine configs.
        network: The memory network to listen on (a new one when omitted).
        sockets: Listen on real TCP at each engine's url instead of in memory.
    """
    configs = _sim_engines(fleet)
    async with AsyncExitStack() as stack:
        if not sockets and network is None:
            network = await stack.enter_async_context(open_memory_network())
        sim = SimFleet(network=None if sockets else network)
        async with trio.open_nursery() as nursery:
            try:
                for cfg in configs:
                    await _start_engine(sim, cfg, nursery, network, sockets)
                yield sim
            finally:
                with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
                    for name, server in sim.servers.items():
                        if network is not None and not sockets:
                            host, port = sim.addresses[name]
                            network.unlisten(host, port)
                        await server.shutdown(0.0)
                    if sim._transport is not None:
                        await sim._transport.aclose()
                nursery.cancel_scope.cancel()


async def _start_engine(
    sim: SimFleet,
    cfg: EngineConfig,
    nursery: trio.Nursery,
    network: MemoryNetwork | None,
    sockets: bool,
) -> None:
    engine = SimEngine(cfg, fabric=sim.fabric)
    await nursery.start(engine.run)
    server = _SimServer(engine, in_memory=not sockets)
    assert isinstance(server.handler, SimApp)
    host, port = cfg.host, cfg.port
    sim.engines[cfg.name], sim.apps[cfg.name], sim.servers[cfg.name] = engine, server.handler, server
    sim.addresses[cfg.name] = (host, port)
    if sockets:
        await nursery.start(server.serve_tcp, host, port)
    else:
        assert network is not None
        network.listen(host, port, server)
        engine.attach(abort_connections=functools.partial(network.abort_all, host, port))
