"""Replacing an engine is make-before-break, and a change never leaves a model's role empty.

A reload that changes an engine's URL or key starts the new engine beside the old one
(its next incarnation, ``d0#2``), waits until it is ready, then drains the old one; a
replacement that never becomes ready leaves the old one serving. In a fleet of several
models the "never leave a role empty" rule holds per model: a model's last consumer is
kept in placement until another consumer of that model is ready. In memory, in virtual
time, under load: no request fails.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from narwhal.config import parse_fleet
from narwhal.router.journal import Journal
from narwhal.router.service import Router, open_router
from narwhal.testing import MemoryNetwork, open_memory_network, open_sim_fleet

from .loadkit import Outcome, exchange
from .routerkit import ROUTER_HOST, ROUTER_PORT, fleet_doc
from .test_fleet_reload import ENGINES, Live, _fields, doc, open_live, until

TWO_MODELS = Path(__file__).resolve().parent.parent / "config" / "fleet.two-models.sim.json"


async def _load(live: Live, prefix: str, count: int, outcomes: dict[str, Outcome]) -> None:
    async def one(rid: str) -> None:
        outcomes[rid] = await live.request(rid, 10)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, f"{prefix}{i}")
            await trio.sleep(0.05)


@pytest.mark.parametrize("change", ["url", "api_key"])
async def test_replacing_the_only_consumer_starts_the_new_one_then_drains_the_old(
    autojump_clock: trio.abc.Clock, change: str
) -> None:
    async with open_live(doc("p0", "d0")) as live:
        state = live.router.state
        if change == "url":
            new = {**ENGINES["d0"], "url": "http://d1.test:8104", "connector": ENGINES["d1"]["connector"]}
        else:
            new = {**ENGINES["d0"], "api_key": "rotated-key"}
        outcomes: dict[str, Outcome] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_load, live, "r", 200, outcomes)
            await trio.sleep(2.0)
            change_made = await live.router.reload(fleet_doc(ENGINES["p0"], new), source="test")
            assert change_made.replaced == ("d0",)
            # Both known: the new one under its next incarnation's name, the old one serving until it is ready.
            assert state.engine_state("d0") == "ok" and state.engine_state("d0#2") == "starting"
            await until(lambda: "d0" not in state.engines)
        assert len(outcomes) == 200 and all(o.ok for o in outcomes.values())
        assert state.engine_state("d0#2") == "ok" and state.engines["d0#2"].url == new["url"]
        assert state.engines["d0#2"].api_key == new.get("api_key")
        fleet = [(e["event"], e.get("engine")) for e in live.events if e.get("type") == "fleet"]
        assert fleet == [("reload", None), ("starting", "d0#2"), ("ready", "d0#2"), ("draining", "d0"), ("removed", "d0")]
        [starting] = live.fleet_events("starting")
        assert starting["replaces"] == "d0"
        [draining] = live.fleet_events("draining")
        assert draining["replaced_by"] == "d0#2"
        consumers = {r["consumer"] for r in live.records}
        assert consumers == {"d0", "d0#2"}  # the old one served until the new one took over
        late = await live.request("late", 2)
        assert late.ok and live.records[-1]["consumer"] == "d0#2"
        if change == "url":
            assert live.net.connections_to("d0.test", 8103) == 0  # the old one holds no connection


async def test_a_replacement_that_never_becomes_ready_leaves_the_old_engine_serving(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_live(doc("p0", "d0")) as live:
        state = live.router.state
        live.net.set_refusing("d1.test", 8104, True)  # the new address never answers
        moved = {**ENGINES["d0"], "url": "http://d1.test:8104", "connector": ENGINES["d1"]["connector"]}
        assert (await live.router.reload(fleet_doc(ENGINES["p0"], moved), source="test")).replaced == ("d0",)
        await trio.sleep(60.0)
        assert state.engine_state("d0") == "ok" and state.engine_state("d0#2") == "starting"
        health = state.health(detail=True)
        assert health["status"] == "ready" and "connection refused" in health["engines"]["d0#2"]["error"]
        assert [_fields(e) for e in live.fleet_events("not_ready")] == [
            {"event": "not_ready", "engine": "d0#2", "detail": health["engines"]["d0#2"]["error"]}
        ]  # said once, probed on
        for i in range(5):
            assert (await live.request(f"r{i}", 2)).ok
        assert {r["consumer"] for r in live.records} == {"d0"}
        # The document goes back to the old address: the replacement is called off.
        change = await live.router.reload(doc("p0", "d0"), source="test")
        assert change.replaced == ("d0",) and sorted(state.engines) == ["d0", "p0"] and not state.phase
        assert _fields(live.fleet_events("removed")[-1]) == {
            "event": "removed", "engine": "d0#2", "url": "http://d1.test:8104", "detail": "its replacement was called off",
        }  # fmt: skip
        await trio.sleep(30.0)
        assert live.router.fleet._tasks == {} and state.engine_state("d0") == "ok"


# ----------------------------------------------------------------- several models


def _two_models() -> dict[str, Any]:
    """config/fleet.two-models.sim.json, its engines in memory (``<name>.test:80``), and
    a second consumer of sim-qwen that is not in it."""
    document = json.loads(TWO_MODELS.read_text())
    for e in document["engines"]:
        e["url"] = f"http://{e['name']}.test:80"
        e["connector"]["kv_host"] = f"{e['name']}.kv.test"
    spare = copy.deepcopy(document["engines"][3])
    spare.update(name="qwen-decode-1", url="http://qwen-decode-1.test:80")
    spare["connector"]["kv_host"] = "qwen-decode-1.kv.test"
    document["server"] = {"host": ROUTER_HOST, "port": ROUTER_PORT}
    document["spare"] = spare
    return document


@attrs.define
class TwoModels:
    net: MemoryNetwork
    router: Router
    records: list[dict[str, Any]]

    async def request(self, rid: str, model: str) -> Outcome:
        conn = await self.net.connect(ROUTER_HOST, ROUTER_PORT)
        return await exchange(conn, {"model": model, "prompt": f"request {rid}", "max_tokens": 4, "stream": True},
                              request_id=rid)  # fmt: skip


@asynccontextmanager
async def open_two_models(document: dict[str, Any]) -> AsyncIterator[TwoModels]:
    every = parse_fleet({**{k: v for k, v in document.items() if k != "spare"},
                         "engines": [*document["engines"], document["spare"]]})  # fmt: skip
    first = parse_fleet({k: v for k, v in document.items() if k != "spare"})
    records: list[dict[str, Any]] = []
    journal = Journal(None)
    journal.add_listener(records.append)
    async with open_memory_network() as net, open_sim_fleet(every, network=net) as sims:
        async with open_router(first, transport=sims.transport, journal=journal) as router:
            net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
            yield TwoModels(net, router, records)


@pytest.mark.parametrize("how", ["renamed", "url"])
async def test_a_models_only_consumer_is_kept_until_its_replacement_is_ready(
    autojump_clock: trio.abc.Clock, how: str
) -> None:
    """qwen-decode-0 is sim-qwen's only consumer; sim-llama has its own. The document
    replaces it (by another engine, or at another address) that is not up yet: sim-qwen
    is served by it meanwhile, never refused."""
    document = _two_models()
    spare = document.pop("spare")
    async with open_two_models({**document, "spare": spare}) as live:
        state = live.router.state
        live.net.set_refusing("qwen-decode-1.test", 80, True)
        new = copy.deepcopy(document)
        if how == "renamed":
            new["engines"][3] = spare
        else:
            new["engines"][3] = {**document["engines"][3], "url": spare["url"], "connector": spare["connector"]}
        successor = "qwen-decode-1" if how == "renamed" else "qwen-decode-0#2"
        await live.router.reload(new, source="test")
        assert state.engine_state(successor) == "starting"
        for i in range(6):
            assert (await live.request(f"q{i}", "sim-qwen")).status == 200
            assert (await live.request(f"l{i}", "sim-llama")).status == 200
        assert {r["consumer"] for r in live.records if r["model"] == "sim-qwen"} == {"qwen-decode-0"}
        assert state.health(detail=False)["models"] == {"sim-llama": "ready", "sim-qwen": "ready"}
        live.net.set_refusing("qwen-decode-1.test", 80, False)
        await until(lambda: "qwen-decode-0" not in state.engines)
        assert (await live.request("after", "sim-qwen")).status == 200
        assert live.records[-1]["consumer"] == successor
        # A model the document no longer has is not held: its engines drain and go.
        llama = {**document, "engines": document["engines"][:2]}
        removed = ("qwen-prefill-0", "qwen-decode-1" if how == "renamed" else "qwen-decode-0")  # document names
        assert (await live.router.reload(llama, source="test")).removed == removed
        await until(lambda: sorted(state.engines) == ["llama-decode-0", "llama-prefill-0"])
        assert (await live.request("l-last", "sim-llama")).status == 200
        assert (await live.request("q-last", "sim-qwen")).status == 404
