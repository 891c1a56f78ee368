"""A fleet change of thousands of engines costs the router linear work, in small steps.

Counted, not timed (tools/bench_fleet_apply.py measures the time): the work per engine
stays the same however many engines a change adds (no walk over the whole fleet per
engine), the engines found ready together enter placement together, and a change
yields to the requests in flight between batches of engines. A DNS answer larger than
its group's ``max_engines`` adds the first ``max_engines`` addresses only.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import parse_fleet
from narwhal.router.journal import Journal
from narwhal.router.placement import Placement
from narwhal.router.service import Router, open_router
from narwhal.testing import open_memory_network, open_sim_fleet

from .routerkit import ROUTER_HOST, ROUTER_PORT, engine, fleet_doc
from .test_discovery import NAME, Resolver, group
from .test_fleet_reload import until

PAIR = [engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"])]


def _many(n: int) -> list[dict[str, Any]]:
    """``n`` engines of a model of their own, answered by :class:`Fakes`."""
    return [
        {"name": f"x{i}", "url": f"http://x{i}.fake:8000", "roles": ["prefill", "decode"], "model": "fake",
         "connector": {"kv_host": f"x{i}.fake", "kv_port": 5600}}
        for i in range(n)
    ]  # fmt: skip


class Fakes(httpx.AsyncBaseTransport):
    """Engines at ``*.fake`` (and 10.x addresses) answer health and their model at once."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host.endswith(".fake") or host.startswith("10."):
            await trio.lowlevel.checkpoint()
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": "fake", "max_model_len": 4096}]})
            return httpx.Response(200 if request.url.path == "/health" else 404)
        return await self.inner.handle_async_request(request)


@asynccontextmanager
async def open_router_with(first: dict[str, Any]) -> AsyncIterator[Router]:
    async with open_memory_network() as net, open_sim_fleet(parse_fleet(fleet_doc(*PAIR)), network=net) as sims:
        async with open_router(parse_fleet(first), transport=Fakes(sims.transport), journal=Journal(None)) as router:
            net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
            yield router


def _count(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> list[int]:
    calls = [0]
    original: Callable[..., Any] = getattr(cls, method)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, counted)
    return calls


@pytest.mark.parametrize("n", [100, 400])
async def test_the_work_of_a_change_grows_with_its_engines_not_their_square(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    async with open_router_with(fleet_doc(*copy.deepcopy(PAIR))) as router:
        state = router.state
        model_index = _count(monkeypatch, Placement, "set_models")
        listings = _count(monkeypatch, Placement, "model_names")
        roles = _count(monkeypatch, Placement, "set_roles")  # (once per RouterState.refresh_roles)
        await router.reload(fleet_doc(*copy.deepcopy(PAIR), *_many(n)), source="test")
        # Adding: each engine indexed once (and once more when found ready: probes run
        # while the change applies); the models listed once or twice, the roles set
        # once and per batch of engines found ready.
        assert n <= model_index[0] <= 2 * n and listings[0] <= 2 and roles[0] <= 2 + n // 16
        await until(lambda: not state.phase)
        assert sum(1 for name in state.placement.decode_engines if name.startswith("x")) == n
        # Found ready together, they entered placement together (a batch per pass of probes);
        # the models listed again once: when the model's limit was first learned.
        assert model_index[0] == 2 * n and roles[0] <= 2 + n // 16 and listings[0] <= 2
        assert state.models == {"sim-llama": 4096, "fake": 4096}
        model_index[0] = roles[0] = 0
        await router.reload(fleet_doc(*copy.deepcopy(PAIR)), source="test")
        await until(lambda: sorted(state.engines) == ["d0", "p0"])
        assert model_index[0] <= 2 * n and roles[0] <= 2 + n // 16  # drained together, forgotten one by one
        assert state.models == {"sim-llama": 4096}


async def test_a_change_of_thousands_of_engines_yields_to_the_requests_in_flight(autojump_clock: trio.abc.Clock) -> None:
    async with open_router_with(fleet_doc(*copy.deepcopy(PAIR))) as router:
        turns = 0
        applying = True

        async def other_work() -> None:
            nonlocal turns
            while applying:
                turns += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_work)
            await trio.lowlevel.checkpoint()
            began = turns
            await router.reload(fleet_doc(*copy.deepcopy(PAIR), *_many(2000)), source="test")
            applying = False
        # It yielded between batches of engines (made ready, applied, recorded): requests
        # in flight and a signal get their turn.
        assert turns - began >= 30


async def test_an_answer_larger_than_max_engines_adds_its_first_addresses(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="narwhal.router.discovery")
    answer = [f"10.0.0.{i}" for i in range(1, 51)]
    resolver = Resolver({NAME: answer})
    trio.socket.set_custom_hostname_resolver(resolver)
    try:
        doc = fleet_doc(copy.deepcopy(PAIR[0]), engine_groups=[group(max_engines=8, model="fake",
                                                                     roles=["prefill", "decode"])])  # fmt: skip
        async with open_router_with(doc) as router:
            state = router.state
            kept = sorted(answer)[:8]
            assert sorted(n for n in state.engines if n.startswith("decode-")) == sorted(f"decode-{a}" for a in kept)
            note = f"{NAME} answered 50 addresses: the first 8 kept (max_engines)"
            fleet = router.admin.handler.fleet  # type: ignore[attr-defined]
            assert fleet()["engine_groups"]["decode"]["error"] == note
            await trio.sleep(12.0)  # resolved twice more, the same answer: said once
            assert [r.getMessage() for r in caplog.records] == [f"engine group decode: {note}"]
            resolver.names[NAME] = answer[:3]
            await until(lambda: len([n for n in state.engines if n.startswith("decode-")]) == 3)
            assert fleet()["engine_groups"]["decode"]["error"] is None
    finally:
        trio.socket.set_custom_hostname_resolver(None)
