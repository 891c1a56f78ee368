"""The fault-injection harness: simulated vLLM engines and fleets for any Trio test suite.

A :class:`SimEngine` is a small engine with continuous batching and a latency model on
Trio's clock (virtual time under ``autojump_clock``), speaking vLLM's HTTP surface
through :class:`SimApp`. :func:`open_sim_fleet` starts every engine of a fleet document
that has a ``sim`` block, in memory on a :class:`MemoryNetwork` or on real sockets.
Faults are scripted with :class:`~narwhal.config.FaultSpec` (``engine.inject(spec)``).

Example::

    async with open_sim_fleet(fleet) as sim:
        async with httpx.AsyncClient(transport=sim.transport) as client:
            await client.post("http://p0.test:8101/v1/completions", json={...})
        sim.engines["p0"].inject(FaultSpec(kind="http_error", on="prefill"))
"""

from __future__ import annotations

from narwhal.config import FaultSpec
from narwhal.testing.app import SimApp
from narwhal.testing.engine import (
    EngineRestarted,
    GenerateParams,
    Generation,
    SimEngine,
    SimError,
    SimStats,
    TokenEvent,
)
from narwhal.testing.fleet import SimFleet, open_sim_fleet
from narwhal.testing.kvfabric import Handoff, KVFabric
from narwhal.testing.memnet import MemoryNetwork, open_memory_network

__all__ = [
    "EngineRestarted",
    "FaultSpec",
    "GenerateParams",
    "Generation",
    "Handoff",
    "KVFabric",
    "MemoryNetwork",
    "SimApp",
    "SimEngine",
    "SimError",
    "SimFleet",
    "SimStats",
    "TokenEvent",
    "open_memory_network",
    "open_sim_fleet",
]
