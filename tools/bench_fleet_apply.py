"""What a fleet change costs the router: apply time, and the requests served meanwhile.

A small live fleet (a producer and a consumer, simulated engines in memory) serves a
steady stream of requests while the router takes a change of N more engines, the way
an operator or DNS brings them:

- ``put``: a document that lists N more engines is applied (``Router.reload``, the path
  of ``PUT /fleet`` and SIGHUP: the document is validated in a worker thread, as
  ``narwhal serve`` does), then the previous document again (the N drain and go);
- ``dns``: an engine group whose name resolves to N addresses (a custom hostname
  resolver answers; no DNS server is asked), then to one of them (the others drain and
  go; one stays, as a group that resolves to nothing keeps its last engines).

The N engines are cheap fakes, not simulated engines: an httpx transport answers their
``GET /health`` and ``GET /v1/models`` at once, so that thousands of them pass their
readiness probes. They serve a model of their own, so that the requests keep going to
the live pair. Everything the router does with them is its real path: validation,
expansion, the engines' clients, breakers and load, readiness probes, placement's
roles, the fleet records, drains.

For each N it prints:

- ``apply_s``: until the reload returned (or DNS's change was applied), then ``ready_s``
  until every added engine was in placement, and ``gone_s`` until they had drained and
  left after the change back;
- ``per_engine_ms``: ``ready_s`` per engine, and its ratio to the smallest N's (1.0
  means linear; quadratic work grows with N);
- request latency during the change against the same requests before it (``p50``,
  ``max``, as ratios), and ``stall_ms``: the longest the event loop went without
  running a 5 ms ticker (what every request in flight waited at once).

Figures are wall-clock and follow the host; the ratios within one run are the figures
to read.

    python tools/bench_fleet_apply.py                    # N = 100, 1000, 5000, put and dns
    python tools/bench_fleet_apply.py --quick            # N = 100, 1000, put: seconds (CI)

Any form exits 1 when a request failed, or the N engines were not all in placement (or
had not all left) within ``--limit-s``; never on a time or a ratio (a loaded machine
moves them: how the work grows with N is counted in tests/test_fleet_scale.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from narwhal.config import EngineGroupConfig, FleetConfig, parse_fleet
from narwhal.profile.store import Profiles
from narwhal.router.journal import Journal
from narwhal.router.service import Router, open_router
from narwhal.testing import MemoryNetwork, open_memory_network, open_sim_fleet

ROUTER = ("router.bench", 8000)
FAKE_MODEL = "fake-model"
GROUP_HOST = "fakes.bench.svc"
SIM = {"model": "sim-llama", "prefill": {"a": 0.002, "b": 1e-6}, "decode": {"c0": 0.001, "c1": 0.0, "c2": 0.0},
       "transfer_s_per_token": 0.0}  # fmt: skip


def _live_pair() -> list[dict[str, Any]]:
    return [
        {"name": "p0", "url": "http://p0.bench:8101", "roles": ["prefill"], "model": "sim-llama",
         "connector": {"kv_host": "p0.kv", "kv_port": 5601}, "sim": copy.deepcopy(SIM)},
        {"name": "d0", "url": "http://d0.bench:8102", "roles": ["decode"], "model": "sim-llama",
         "connector": {"kv_host": "d0.kv", "kv_port": 5602}, "sim": copy.deepcopy(SIM)},
    ]  # fmt: skip


def _fake(i: int) -> dict[str, Any]:
    host = f"fake-{i}.bench"
    return {"name": f"fake-{i}", "url": f"http://{host}:8000", "roles": ["prefill", "decode"], "model": FAKE_MODEL,
            "connector": {"kv_host": host, "kv_port": 5600}}  # fmt: skip


def _document(n: int = 0, *, group: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "server": {"host": ROUTER[0], "port": ROUTER[1]},
        "engines": [*_live_pair(), *(_fake(i) for i in range(n))],
        "engine": {"connect_timeout_s": 5.0},
        "journal": {"path": "unused.jsonl", "fsync": False},
    }
    if group:
        doc["engine_groups"] = [
            {"name": "fakes", "host": GROUP_HOST, "port": 8000, "roles": ["prefill", "decode"], "model": FAKE_MODEL,
             "connector": {"kv_port": 5600}, "resolve_every_s": 0.5}
        ]  # fmt: skip
        if "max_engines" in attrs.fields_dict(EngineGroupConfig):  # (all of them; a router before it took all)
            doc["engine_groups"][0]["max_engines"] = 100_000
    return doc


class FakeEngines(httpx.AsyncBaseTransport):
    """Answers the fake engines' health and model listing at once; the rest goes on."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.asked = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host.startswith("fake-") or host.startswith("10."):
            self.asked += 1
            await trio.lowlevel.checkpoint()
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": FAKE_MODEL, "max_model_len": 4096}]})
            if request.url.path == "/health":
                return httpx.Response(200)
            return httpx.Response(503, json={"error": {"message": "a fake engine serves nothing"}})
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Resolver(trio.abc.HostnameResolver):
    """The group's name resolves to ``addresses`` (10.x.y.z); nothing else is asked."""

    def __init__(self) -> None:
        self.addresses: list[str] = []

    async def getaddrinfo(self, host: bytes | None, port: bytes | str | int | None, family: int = 0, type: int = 0,
                          proto: int = 0, flags: int = 0) -> list[Any]:  # fmt: skip
        await trio.lowlevel.checkpoint()
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name != GROUP_HOST:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if not self.addresses:
            raise socket.gaierror(socket.EAI_NODATA, "No address associated with hostname")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, int(port or 0))) for a in self.addresses]

    async def getnameinfo(self, sockaddr: Any, flags: int) -> tuple[str, str]:
        raise NotImplementedError


def _addresses(n: int) -> list[str]:
    return [f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}" for i in range(n)]


class Traffic:
    """Sequential requests from a few clients, and a ticker that measures event-loop stalls."""

    def __init__(self, net: MemoryNetwork, clients: int = 4) -> None:
        self.net = net
        self.clients = clients
        self.latencies: list[tuple[float, float]] = []  # (end, latency)
        self.failed = 0
        self.stalls: list[tuple[float, float]] = []  # (when, how late)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for i in range(self.clients):
                nursery.start_soon(self._client, i)
            nursery.start_soon(self._ticker)
            task_status.started()

    async def _client(self, i: int) -> None:
        body = {"model": "sim-llama", "prompt": f"client {i} asks", "max_tokens": 4, "stream": False}
        async with httpx.AsyncClient(transport=self.net.transport(), base_url=f"http://{ROUTER[0]}:{ROUTER[1]}",
                                     timeout=None) as client:  # fmt: skip
            while True:
                began = time.perf_counter()
                try:
                    answer = await client.post("/v1/completions", json=body)
                    ok = answer.status_code == 200
                except httpx.HTTPError:  # a router frozen past its own timeouts hangs up
                    ok = False
                ended = time.perf_counter()
                if not ok:
                    self.failed += 1
                self.latencies.append((ended, ended - began))
                await trio.sleep(0.005)

    async def _ticker(self) -> None:
        while True:
            began = time.perf_counter()
            await trio.sleep(0.005)
            now = time.perf_counter()
            self.stalls.append((now, now - began - 0.005))

    def window(self, start: float, end: float) -> dict[str, float]:
        lat = [x for t, x in self.latencies if start <= t <= end]
        late = [x for t, x in self.stalls if start <= t <= end]
        if not lat:  # none completed in the window: the whole window is the latency
            lat = [end - start]
        return {
            "p50": statistics.median(lat),
            "max": max(lat),
            "stall": max(late, default=end - start),
            "requests": len(lat),
        }


async def _until(condition: Any, limit_s: float) -> bool:
    deadline = time.perf_counter() + limit_s
    while not condition():
        if time.perf_counter() > deadline:
            return False
        await trio.sleep(0.01)
    return True


@asynccontextmanager
async def open_bench(group: bool) -> AsyncIterator[tuple[Router, Traffic, Resolver]]:
    resolver = Resolver()
    trio.socket.set_custom_hostname_resolver(resolver)
    first = parse_fleet(_document(group=group))
    async with open_memory_network() as net, open_sim_fleet(first, network=net) as sims:
        transport = FakeEngines(sims.transport)
        async with open_router(first, transport=transport, journal=Journal(None), prepare=_prepare) as router:
            net.listen(*ROUTER, router.server)
            traffic = Traffic(net)
            async with trio.open_nursery() as nursery:
                await nursery.start(traffic.run)
                await trio.sleep(0.5)  # warm: connections open, means learned
                yield router, traffic, resolver
                nursery.cancel_scope.cancel()
    trio.socket.set_custom_hostname_resolver(None)


def _prepare(document: Any) -> tuple[FleetConfig, Profiles | None]:
    """What ``narwhal serve`` does with a reloaded document (in a worker thread): validate it."""
    return parse_fleet(document), None


def _fakes_in(router: Router) -> int:
    return sum(1 for name in router.state.engines if name.startswith("fake"))


def _all_ready(router: Router, n: int) -> bool:
    state = router.state
    placed = set(state.placement.decode_engines)
    return sum(1 for name in placed if name.startswith("fake")) >= n and not state.phase


async def measure(n: int, how: str, limit_s: float, base_s: float) -> dict[str, Any]:
    async with open_bench(how == "dns") as (router, traffic, resolver):
        b0 = time.perf_counter()
        await trio.sleep(base_s)
        base = traffic.window(b0, time.perf_counter())
        t0 = time.perf_counter()
        if how == "put":
            await router.reload(_document(n), source="bench")
        else:
            resolver.addresses = _addresses(n)
            await _until(lambda: _fakes_in(router) >= n, limit_s)
        applied = time.perf_counter()
        ready = await _until(lambda: _all_ready(router, n), limit_s - (applied - t0))
        t_ready = time.perf_counter()
        during = traffic.window(t0, t_ready)
        await trio.sleep(base_s)  # steady state with the N in placement
        after = traffic.window(t_ready, time.perf_counter())
        g0 = time.perf_counter()
        if how == "put":
            await router.reload(_document(0), source="bench")
        else:
            resolver.addresses = _addresses(1)
        gone = await _until(lambda: _fakes_in(router) == (how == "dns"), limit_s)
        t_gone = time.perf_counter()
        leaving = traffic.window(g0, t_gone)
        failed = traffic.failed
    return {
        "how": how, "engines": n, "apply_s": applied - t0, "ready_s": t_ready - t0 if ready else math.inf,
        "gone_s": t_gone - g0 if gone else math.inf, "base": base, "during": during, "after": after,
        "leaving": leaving, "failed": failed,
    }  # fmt: skip


def _row(r: dict[str, Any], unit: float) -> str:
    base, during, leaving = r["base"], r["during"], r["leaving"]
    per = r["ready_s"] / r["engines"] * 1000
    ratio = f"{per / unit:5.2f}" if unit else "  inf"
    return (
        f"{r['how']:>4} {r['engines']:>6} {r['apply_s']:8.3f} {r['ready_s']:8.3f} {r['gone_s']:8.3f} "
        f"{per:9.3f} {ratio:>6} {during['p50'] / base['p50']:7.2f} {during['max'] / base['max']:7.2f} "
        f"{during['stall'] * 1000:9.1f} {leaving['stall'] * 1000:9.1f} {r['after']['p50'] / base['p50']:7.2f} "
        f"{base['p50'] * 1000:7.2f} {r['failed']:>6}"
    )


HEADER = (
    " how engines  apply_s  ready_s   gone_s per_eng_ms  x_min p50_x   max_x  stall_ms leave_stall after_x"
    " base_ms failed"
)


async def main(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.engines.split(",")]
    results: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    for how in args.how.split(","):
        unit = 0.0
        for n in sizes:
            r = await measure(n, how, args.limit_s, args.base_s)
            results.append(r)
            unit = unit or r["ready_s"] / n * 1000
            print(_row(r, unit), flush=True)
    if args.out:
        await trio.Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print("apply_s: the reload call (put) or until the group's engines were known (dns); ready_s: until all "
          "were in placement; gone_s: until the N drained and left after the change back. x_min: per-engine "
          "time against the smallest N (1.0: linear). p50_x/max_x: request latency during the change over "
          "before it; after_x: p50 with the N in placement over before. stall_ms: the event loop's longest "
          "pause while adding (leave_stall: while removing).")  # fmt: skip
    failed = [f"{r['how']} {r['engines']}: {r['failed']} requests failed" for r in results if r["failed"]]
    failed += [f"{r['how']} {r['engines']}: {what} not within {args.limit_s:g} s"
               for r in results for key, what in (("ready_s", "the engines in placement"),
                                                 ("gone_s", "the engines gone after the change back"))
               if math.isinf(r[key])]  # fmt: skip
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="100,1000,5000", help="sizes of the change (default: %(default)s)")
    parser.add_argument("--how", default="put,dns", help="put, dns or both (default: %(default)s)")
    parser.add_argument("--limit-s", type=float, default=300.0, help="give up on a size after this long")
    parser.add_argument("--base-s", type=float, default=1.0, help="seconds of traffic measured before and after")
    parser.add_argument("--quick", action="store_true", help="N = 100 and 1000, put only: seconds (CI)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.engines, args.how, args.base_s, args.limit_s = "100,1000", "put", 0.3, 60.0
    return args


if __name__ == "__main__":
    sys.exit(trio.run(main, parse_args()))
