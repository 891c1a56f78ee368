"""Reloading the fleet without a restart: engines added, drained, replaced; settings changed.

In memory, in virtual time, under load: no request is lost or failed by a change and each
is journaled once; a removed engine takes no new placement, finishes the streams it
serves and then has no connection left; an added engine takes traffic only once its
readiness probe passes; a document that fails changes nothing and says why with its
JSON path; every change is a fleet record, published on the live events.
"""

from __future__ import annotations

import collections
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.config import parse_fleet
from narwhal.errors import ConfigError
from narwhal.router.fleet import LiveFleet
from narwhal.router.journal import Journal
from narwhal.router.service import Prepare, Router, open_router
from narwhal.router.state import RouterState
from narwhal.testing import MemoryNetwork, SimFleet, open_memory_network, open_sim_fleet

from .loadkit import Outcome, exchange
from .routerkit import ROUTER_HOST, ROUTER_PORT, engine, fleet_doc, sim_profiles

STEP_S = 0.05
_SIM = {"decode": {"c0": STEP_S, "c1": 0.0, "c2": 0.0}, "max_num_seqs": 512}
ADMIN = ("127.0.0.1", 8001)


def _engines() -> dict[str, dict[str, Any]]:
    return {
        "p0": engine("p0", 8101, ["prefill"], **_SIM),
        "p1": engine("p1", 8102, ["prefill"], **_SIM),
        "d0": engine("d0", 8103, ["decode"], **_SIM),
        "d1": engine("d1", 8104, ["decode"], **_SIM),
        "d2": engine("d2", 8105, ["decode"], **_SIM),
    }


ENGINES = _engines()


def doc(*names: str, **sections: Any) -> dict[str, Any]:
    return fleet_doc(*(copy.deepcopy(ENGINES[n]) for n in names), **sections)


@attrs.define
class Live:
    net: MemoryNetwork
    sims: SimFleet
    router: Router
    records: list[dict[str, Any]]
    events: list[dict[str, Any]]

    async def request(self, rid: str, max_tokens: int = 20) -> Outcome:
        conn = await self.net.connect(ROUTER_HOST, ROUTER_PORT)
        body = {"prompt": f"request {rid}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        return await exchange(conn, body, request_id=rid)

    def fleet_events(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == "fleet" and e["event"] == event]


@asynccontextmanager
async def open_live(
    first: dict[str, Any], *, journal_path: Path | None = None, priced: bool = False, profile_names: tuple[str, ...] = (),
    prepare: Prepare | None = None,
) -> AsyncIterator[Live]:
    """Every engine of :data:`ENGINES` runs; the router serves ``first`` (``prepare``: how
    it turns a reloaded document into what to serve, as ``narwhal serve``'s)."""
    every = parse_fleet(fleet_doc(*ENGINES.values()))
    config = parse_fleet(first)
    records: list[dict[str, Any]] = []
    journal = Journal(journal_path)
    journal.add_listener(records.append)
    async with open_memory_network() as net, open_sim_fleet(every, network=net) as sims:
        profiles = None
        if priced:
            profiles = await sim_profiles(every, net)
            profiles = attrs.evolve(profiles, engines={n: p for n, p in profiles.engines.items() if n in profile_names})
        async with open_router(config, transport=sims.transport, journal=journal, profiles=profiles,
                               prepare=prepare) as router:  # fmt: skip
            net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
            net.listen(*ADMIN, router.admin)
            events: list[dict[str, Any]] = []
            async with trio.open_nursery() as nursery:

                async def follow() -> None:
                    with router.events.subscribe() as sub:
                        async for event in sub.receive:
                            events.append(event)

                nursery.start_soon(follow)
                await trio.lowlevel.checkpoint()
                yield Live(net, sims, router, records, events)
                nursery.cancel_scope.cancel()
    # Every connection (client to router, router to engines) is closed.
    assert net.open_connections == 0


async def until(condition: Callable[[], bool]) -> None:
    """Wait (in virtual time) until ``condition`` holds: the router's own state, which no event announces."""
    while not condition():  # noqa: ASYNC110
        await trio.sleep(0.1)


def _served(records: list[dict[str, Any]], rids: set[str]) -> collections.Counter[str]:
    """Engines of the successful attempts of ``rids`` (producers and consumers)."""
    used: collections.Counter[str] = collections.Counter()
    for r in records:
        if r["request_id"] in rids:
            used[r["producer"]] += 1
            used[r["consumer"]] += 1
    return used


async def test_reload_under_load_drains_the_engine_serving_streams_and_adds_two(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0", "d1")) as live:
        state = live.router.state
        outcomes: dict[str, Outcome] = {}
        before: set[str] = set()
        after: set[str] = set()

        async def one(rid: str) -> None:
            outcomes[rid] = await live.request(rid)

        async with trio.open_nursery() as nursery:
            for i in range(60):  # 20 tokens at 50 ms: each stream lasts a second
                before.add(f"a{i}")
                nursery.start_soon(one, f"a{i}")
                await trio.sleep(0.02)
            assert state.in_flight_by_engine["d0"] > 0  # d0 serves streams
            in_flight_on_d0 = state.in_flight_by_engine["d0"]
            change = await live.router.reload(doc("p0", "p1", "d1", "d2"), source="test")
            assert (change.added, change.removed) == (("p1", "d2"), ("d0",))
            assert state.engine_state("d0") == "draining" and state.engine_state("d2") == "starting"
            for i in range(120):
                after.add(f"b{i}")
                nursery.start_soon(one, f"b{i}")
                await trio.sleep(0.02)
        # No request lost or failed; each journaled once.
        assert len(outcomes) == 180 and all(o.ok and o.tokens == 20 for o in outcomes.values())
        ids = [r["request_id"] for r in live.records]
        assert len(ids) == len(set(ids)) == 180
        assert all(r["terminal_class"] == "ok" for r in live.records)
        # d0 took no request after the reload, and finished what it had.
        used_after = _served(live.records, after)
        assert used_after["d0"] == 0
        assert used_after["p1"] > 0 and used_after["d2"] > 0
        assert _served(live.records, before)["d0"] >= in_flight_on_d0
        # Then it left: no table holds it, no connection reaches it.
        assert "d0" not in state.engines and "d0" not in state.placement.loads
        assert "d0" not in state.breaker.states and "d0" not in state.in_flight_by_engine
        assert live.net.connections_to("d0.test", 8103) == 0
        assert sorted(state.engines) == ["d1", "d2", "p0", "p1"]
        assert all(state.engine_state(n) == "ok" for n in state.engines)
        # Every change is a record, published live, in order for each engine.
        fleet = [(e["event"], e.get("engine")) for e in live.events if e.get("type") == "fleet"]
        assert fleet[0] == ("reload", None)
        for name in ("p1", "d2"):
            assert [ev for ev, n in fleet if n == name] == ["starting", "ready"]
        assert [ev for ev, n in fleet if n == "d0"] == ["draining", "removed"]
        assert live.router.fleet.changes == [e for e in live.events if e.get("type") == "fleet"]
        [ready] = [e for e in live.fleet_events("ready") if e["engine"] == "d2"]
        assert ready["pricing"] == "load"


async def test_replacing_the_only_producer_under_load(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0", "d1")) as live:
        state = live.router.state
        outcomes: dict[str, Outcome] = {}
        without_p0: set[str] = set()
        with_p0: set[str] = set()

        async def one(rid: str) -> None:
            outcomes[rid] = await live.request(rid)

        async with trio.open_nursery() as nursery:
            for i in range(150):
                if i == 50:
                    await live.router.reload(doc("p1", "d0", "d1"), source="test")
                    # The only producer drains only once its replacement is ready.
                    assert state.engine_state("p0") == "draining" and "p0" in state.placement.prefill_engines
                rid = f"r{i}"
                (with_p0 if "p0" in state.placement.prefill_engines else without_p0).add(rid)
                nursery.start_soon(one, rid)
                await trio.sleep(0.02)
        assert len(outcomes) == 150 and all(o.ok for o in outcomes.values())
        ids = [r["request_id"] for r in live.records]
        assert len(ids) == len(set(ids)) == 150
        assert len(with_p0) > 50 and len(without_p0) > 80
        assert {r["producer"] for r in live.records if r["request_id"] in without_p0} == {"p1"}
        assert sorted(state.engines) == ["d0", "d1", "p1"]
        assert live.net.connections_to("p0.test", 8101) == 0


async def test_a_document_that_fails_changes_nothing_and_says_where(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0")) as live:
        state = live.router.state
        config, engines = state.config, dict(state.engines)
        bad_url = doc("p0", "d0", "d1")
        bad_url["engines"][2]["url"] = "d1.test:8104"
        no_json = b"{not json"
        restart = doc("p0", "d0", "d1", server={"port": 9000})
        async with httpx.AsyncClient(transport=live.net.transport(), base_url=f"http://{ADMIN[0]}:{ADMIN[1]}") as admin:
            answers = [
                await admin.put("/fleet", content=json.dumps(bad_url).encode()),
                await admin.put("/fleet", content=no_json),
                await admin.put("/fleet", content=json.dumps(restart).encode()),
            ]
            assert [a.status_code for a in answers] == [400, 400, 400]
            errors = [a.json()["error"] for a in answers]
            assert [e["path"] for e in errors] == ["$.engines[2].url", "$", "$.server.port"]
            assert errors[0]["message"] == "expected an http(s)://host:port URL"
            assert errors[1]["message"].startswith("the document is not JSON")
            assert errors[2]["message"] == "changes only with a restart (running with 8000, the document says 9000)"
            # Nothing changed, and each refusal is a record.
            assert state.config is config and state.engines == engines and not state.phase
            assert [(e["event"], e["path"], e["source"]) for e in live.fleet_events("rejected")] == [
                ("rejected", "$.engines[2].url", "PUT /fleet"), ("rejected", "$", "PUT /fleet"),
                ("rejected", "$.server.port", "PUT /fleet"),
            ]  # fmt: skip
            assert not live.fleet_events("reload")
            # The same document, fixed, applies.
            good = await admin.put("/fleet", content=json.dumps(doc("p0", "d0", "d1")).encode())
            assert good.status_code == 200 and good.json()["added"] == ["d1"]
            with pytest.raises(ConfigError, match="nothing to re-read"):
                await live.router.reload(source="SIGHUP")  # started without a file


def _fields(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("type", "at")}


def _changes(live: Live, event: str) -> list[dict[str, Any]]:
    """The fleet's records of ``event`` so far (as recorded: the published copies follow)."""
    return [c for c in live.router.fleet.changes if c["event"] == event]


def _logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "narwhal.router.fleet"]


async def test_an_added_engine_waits_for_its_readiness_probe(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router.fleet")
    async with open_live(doc("p0", "d0")) as live:
        state = live.router.state
        live.net.set_refusing("d1.test", 8104, True)
        t0 = trio.current_time()
        await live.router.reload(doc("p0", "d0", "d1"), source="test")
        [starting] = _changes(live, "starting")
        assert _fields(starting) == {"event": "starting", "engine": "d1", "url": "http://d1.test:8104", "roles": ["decode"]}
        for i in range(20):
            assert (await live.request(f"r{i}", 2)).ok
        assert _served(live.records, {f"r{i}" for i in range(20)})["d1"] == 0
        health = state.health(detail=True)["engines"]["d1"]
        assert health["state"] == "starting" and "connection refused" in health["error"]
        [not_ready] = _changes(live, "not_ready")
        assert _fields(not_ready) == {"event": "not_ready", "engine": "d1", "detail": health["error"]}
        warned = [(logging.WARNING, f"engine d1 is not ready yet: {health['error']} (probed again every 5 s)")]
        assert _logged(caplog) == warned
        await trio.sleep(5.0)  # its second probe fails too: said once
        assert _logged(caplog) == warned and len(_changes(live, "not_ready")) == 1
        live.net.set_refusing("d1.test", 8104, False)
        await until(lambda: state.engine_state("d1") == "ok")
        # Probed again every recovery.probe_interval_s (5 s by default).
        assert trio.current_time() - t0 == pytest.approx(10.0, abs=0.5)
        assert state.phase_errors == {} and len(_changes(live, "not_ready")) == 1
        [ready] = _changes(live, "ready")
        assert _fields(ready) == {"event": "ready", "engine": "d1", "url": "http://d1.test:8104", "pricing": "load",
                                  "detail": None}  # fmt: skip
        assert _logged(caplog)[1:] == [(logging.INFO, "engine d1 is ready: in placement (load)")]
        assert live.router.fleet._tasks == {}  # its probe's task is done
        for i in range(20):
            assert (await live.request(f"s{i}", 2)).ok
        assert _served(live.records, {f"s{i}" for i in range(20)})["d1"] > 0


async def test_a_role_is_never_left_empty_by_a_replacement(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0")) as live:
        state = live.router.state
        live.net.set_refusing("d1.test", 8104, True)  # the replacement is not up yet
        await live.router.reload(doc("p0", "d1"), source="test")
        assert state.engine_state("d0") == "draining"
        for i in range(10):
            assert (await live.request(f"r{i}", 2)).ok  # d0 keeps serving its role
        assert _served(live.records, {f"r{i}" for i in range(10)})["d0"] == 10
        assert state.ready()
        live.net.set_refusing("d1.test", 8104, False)
        await until(lambda: "d0" not in state.engines)
        for i in range(10):
            assert (await live.request(f"s{i}", 2)).ok
        assert _served(live.records, {f"s{i}" for i in range(10)})["d1"] == 10


async def test_changed_deadlines_apply_to_requests_that_arrive_after(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0")) as live:
        async with trio.open_nursery() as nursery:
            early: list[Outcome] = []

            async def first() -> None:
                early.append(await live.request("early", 100))  # 5 s of streaming

            nursery.start_soon(first)
            await trio.sleep(0.5)
            change = await live.router.reload(doc("p0", "d0", engine={"request_timeout_s": 2.0}), source="test")
            assert change.settings == ("engine.request_timeout_s",)
            late = await live.request("late", 100)
        assert early[0].ok  # under the deadline it arrived with (600 s)
        assert late.status == 200 and late.error is not None  # cut at 2 s
        by_id = {r["request_id"]: r for r in live.records}
        assert by_id["late"]["terminal_class"] == "deadline_exceeded"
        assert by_id["late"]["latency_s"] == pytest.approx(2.0, abs=0.01)


async def test_a_request_in_flight_keeps_the_deadlines_it_arrived_with(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0")) as live:
        async with trio.open_nursery() as nursery:
            early: list[Outcome] = []

            async def first() -> None:
                early.append(await live.request("early", 40))

            nursery.start_soon(first)
            await trio.sleep(0.001)  # in its prefill leg: its decode leg has not started
            assert live.router.state.in_flight_by_engine["p0"] == 1
            silent = doc("p0", "d0", engine={"decode_read_timeout_s": STEP_S / 2})
            await live.router.reload(silent, source="test")
            late = await live.request("late", 40)
        assert early[0].ok and early[0].tokens == 40
        assert late.status == 200 and late.tokens == 1 and late.error is not None
        by_id = {r["request_id"]: r for r in live.records}
        assert by_id["late"]["terminal_class"] == "silence_timeout"


async def test_roles_change_in_place_and_a_changed_url_replaces_the_engine(autojump_clock: trio.abc.Clock) -> None:
    both = {**ENGINES["d1"], "roles": ["prefill", "decode"]}
    async with open_live(fleet_doc(ENGINES["p0"], ENGINES["d0"], ENGINES["d1"])) as live:
        state = live.router.state
        change = await live.router.reload(fleet_doc(ENGINES["p0"], ENGINES["d0"], both), source="test")
        assert change.roles == ("d1",) and not change.added and not change.removed
        assert "d1" in state.placement.prefill_engines and state.engine_state("d1") == "ok"
        moved = {**ENGINES["d0"], "url": "http://d2.test:8105", "connector": ENGINES["d2"]["connector"]}
        change = await live.router.reload(fleet_doc(ENGINES["p0"], moved, both), source="test")
        assert change.replaced == ("d0",)
        # The new d0 starts beside the old one (its next incarnation, d0#2), which drains once it is ready.
        await until(lambda: "d0" not in state.engines and state.engine_state("d0#2") == "ok")
        assert state.engines["d0#2"].url == "http://d2.test:8105"
        assert [e.get("engine") for e in live.fleet_events("removed")] == ["d0"]
        assert [e.get("engine") for e in live.fleet_events("ready")] == ["d0#2"]
        [draining] = live.fleet_events("draining")
        assert (draining["engine"], draining["replaced_by"]) == ("d0", "d0#2")
        served = live.sims.engines["d2"].stats.requests
        for i in range(6):
            assert (await live.request(f"r{i}", 2)).ok
        assert live.sims.engines["d2"].stats.requests > served  # d0 is now the engine at d2's address


async def test_an_added_engine_is_priced_once_its_profile_exists(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router.fleet")
    async with open_live(doc("p0", "d0"), priced=True, profile_names=("p0", "d0")) as live:
        state = live.router.state
        first = state.profiles
        await live.router.fleet.apply(parse_fleet(doc("p0", "d0", "d1")), profiles=first, source="test")
        await until(lambda: state.engine_state("d1") == "ok")
        [ready] = live.fleet_events("ready")
        assert (ready["pricing"], ready["detail"]) == ("load", "no accepted profile")
        assert _logged(caplog)[-1] == (logging.INFO, "engine d1 is ready: in placement (load: no accepted profile)")
        assert state.health(detail=True)["engines"]["d1"]["pricing"] == "load (no accepted profile)"
        # Re-profiled: a pair with d1's profile prices it.
        assert first is not None
        every = await sim_profiles(parse_fleet(fleet_doc(*ENGINES.values())), live.net)
        await live.router.fleet.apply(parse_fleet(doc("p0", "d0", "d1")), profiles=every, source="test")
        await trio.sleep(1.0)
        assert state.health(detail=True)["engines"]["d1"]["pricing"] == "profile"
        assert "d1" in state.placement.profiles  # type: ignore[attr-defined]


async def test_a_reload_changes_the_admission_settings_in_place(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0"), priced=True, profile_names=("p0", "d0")) as live:
        placement = live.router.state.placement
        assert (placement.admission, placement.admission_bound, placement.pricing) == ("wait", "lower", "point")  # type: ignore[attr-defined]
        changed = parse_fleet(doc("p0", "d0", controller={
            "admission": "refuse", "admission_bound": "point", "pricing": "upper", "slo": {"ttft_s": 0.9, "tpot_s": 0.05},
        }))  # fmt: skip
        await live.router.fleet.apply(changed, profiles=live.router.state.profiles, source="test")
        assert live.router.state.placement is placement
        assert (placement.admission, placement.admission_bound, placement.pricing) == ("refuse", "point", "upper")  # type: ignore[attr-defined]
        assert placement.slo == changed.controller.slo  # type: ignore[attr-defined]


async def test_a_reload_changes_the_recovery_settings_in_place(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0")) as live:
        state = live.router.state
        recovery = {"eject_after": 5, "failure_quarantine_s": 2.5, "probe_interval_s": 7.0,
                    "retry_budget": {"ratio": 0.3, "min_retries_per_s": 2.0, "window_s": 12.0}}  # fmt: skip
        change = await live.router.reload(doc("p0", "d0", recovery=recovery), source="test")
        assert change.settings == tuple(sorted(
            ["recovery.eject_after", "recovery.failure_quarantine_s", "recovery.probe_interval_s"]
            + [f"recovery.retry_budget.{k}" for k in ("ratio", "min_retries_per_s", "window_s")]
        ))  # fmt: skip
        breaker, budget = state.breaker, state.retry_budget
        assert (breaker.eject_after, breaker.quarantine_s, breaker.probe_interval_s) == (5, 2.5, 7.0)
        assert (budget.ratio, budget.min_retries_per_s, budget.window_s) == (0.3, 2.0, 12.0)


async def test_fleet_records_go_beside_the_journal(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    async with open_live(doc("p0", "d0"), journal_path=journal) as live:
        assert (await live.request("r0", 2)).ok
        await live.router.reload(doc("p0", "d1"), source="test")
        await until(lambda: "d0" not in live.router.state.engines)
        # The router stops at once: the records still queued are written as it does.
    lines = [json.loads(x) for x in (tmp_path / "journal.fleet.jsonl").read_text().splitlines()]
    assert [(x["event"], x.get("engine")) for x in lines] == [
        ("reload", None), ("draining", "d0"), ("starting", "d1"), ("ready", "d1"), ("removed", "d0")
    ]
    # d0 stayed in placement until d1 was ready, then had nothing left to serve.
    assert _fields(lines[-1]) == {"event": "removed", "engine": "d0", "url": "http://d0.test:8103",
                                  "detail": "drained in no time"}  # fmt: skip
    assert lines[0]["source"] == "test" and lines[0]["added"] == ["d1"] and lines[0]["removed"] == ["d0"]
    # A reload's record comes first, stamped when the reload began.
    assert lines[0]["at"] <= lines[1]["at"] <= lines[2]["at"]
    # The request journal keeps its contract: one line per request.
    assert [json.loads(x)["request_id"] for x in journal.read_text().splitlines()] == ["r0"]



@asynccontextmanager
async def _serving_a_long_stream(live: Live) -> AsyncIterator[tuple[str, str, list[Outcome]]]:
    """A stream of 5 s on one of d0 and d1: (the engine serving it, the other, its outcome once over)."""
    state = live.router.state
    async with trio.open_nursery() as nursery:
        outcomes: list[Outcome] = []

        async def long() -> None:
            outcomes.append(await live.request("long", 100))  # 5 s of decoding

        nursery.start_soon(long)
        await until(lambda: state.in_flight_by_engine["d0"] + state.in_flight_by_engine["d1"] == 1)
        yield ("d0", "d1", outcomes) if state.in_flight_by_engine["d0"] else ("d1", "d0", outcomes)


@pytest.mark.parametrize("replaced", [False, True])
async def test_a_drain_that_outlasts_the_request_timeout_is_warned_once(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, replaced: bool
) -> None:
    """A stream that arrived under a longer deadline outlasts the one in force: the drain
    says so once, at that deadline, and the engine leaves when the stream ends (removed,
    or replaced: drained once its replacement is ready, which serves on)."""
    caplog.set_level(logging.INFO, logger="narwhal.router.fleet")
    async with open_live(doc("p0", "d0", "d1")) as live:
        state = live.router.state
        async with _serving_a_long_stream(live) as (busy, other, outcomes):
            await live.router.reload(doc("p0", "d0", "d1", engine={"request_timeout_s": 2.0}), source="test")
            began = trio.current_time()
            drop = doc("p0", other, engine={"request_timeout_s": 2.0})
            if replaced:  # another address, twice: it drains once, its replacement ready
                moved = {**ENGINES[busy], "url": "http://d2.test:8105", "connector": ENGINES["d2"]["connector"]}
                replace = fleet_doc(ENGINES["p0"], ENGINES[other], moved, engine={"request_timeout_s": 2.0})
                assert (await live.router.reload(replace, source="test")).replaced == (busy,)
                await until(lambda: state.engine_state(busy) == "draining")
                assert (await live.router.reload(replace, source="test")).empty
                assert trio.current_time() - began < 0.2
                assert _logged(caplog) == [(logging.INFO, f"engine {busy}#2 is ready: in placement (load)")]
                caplog.clear()
                why = {"replaced_by": f"{busy}#2"}
            else:
                assert (await live.router.reload(drop, source="test")).removed == (busy,)
                for _ in range(2):  # dropped while draining: nothing more to do
                    assert (await live.router.reload(drop, source="test")).empty
                why = {}
            [draining] = _changes(live, "draining")
            assert _fields(draining) == {"event": "draining", "engine": busy, "url": ENGINES[busy]["url"], "in_flight": 1,
                                         **why}  # fmt: skip
            await trio.sleep_until(began + 1.9)  # the drain began with the change (its replacement ready at once)
            assert _logged(caplog) == []
            await trio.sleep(0.2)
            warned = (logging.WARNING, f"engine {busy} still serves 1 request(s) 2 s into its drain")
            assert _logged(caplog) == [warned]
        ended = trio.current_time()
        assert outcomes[0].ok and outcomes[0].tokens == 100
        await until(lambda: busy not in state.engines)
        [removed] = _changes(live, "removed")
        detail = f"drained in {ended - began:.3g} s"
        assert _fields(removed) == {"event": "removed", "engine": busy, "url": ENGINES[busy]["url"], "detail": detail}
        assert _logged(caplog) == [warned, (logging.INFO, f"engine {busy} left the fleet: {detail}")]
        await trio.sleep(1.0)
        assert busy not in state.engines
        if replaced:
            assert [_fields(c)["engine"] for c in _changes(live, "starting")] == [f"{busy}#2"]
            assert state.engine_state(f"{busy}#2") == "ok"
        else:
            assert _changes(live, "starting") == []


async def test_an_engine_removed_before_it_was_ready_is_probed_no_more(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router.fleet")
    async with open_live(doc("p0", "d0")) as live:
        state = live.router.state
        live.net.set_refusing("d1.test", 8104, True)
        await live.router.reload(doc("p0", "d0", "d1"), source="test")
        await until(lambda: "d1" in state.phase_errors)
        change = await live.router.reload(doc("p0", "d0"), source="test")
        assert change.removed == ("d1",) and "d1" not in state.engines and state.phase_errors == {}
        [removed] = _changes(live, "removed")
        assert _fields(removed) == {"event": "removed", "engine": "d1", "url": "http://d1.test:8104",
                                    "detail": "removed before it was ready"}  # fmt: skip
        assert _logged(caplog)[-1] == (logging.INFO, "engine d1 left the fleet: removed before it was ready")
        await trio.sleep(12.0)  # its readiness probe was cancelled: nothing more of it
        assert state.phase_errors == {} and len(_changes(live, "not_ready")) == 1
        assert live.router.fleet._tasks == {}  # no task left behind
        # Replaced (another address) before it was ready: the new one is probed instead.
        await live.router.reload(doc("p0", "d0", "d1"), source="test")
        await until(lambda: "d1" in state.phase_errors)
        moved = {**ENGINES["d1"], "url": "http://d2.test:8105", "connector": ENGINES["d2"]["connector"]}
        change = await live.router.reload(fleet_doc(ENGINES["p0"], ENGINES["d0"], moved), source="test")
        assert change.replaced == ("d1",) and not change.added and not change.removed
        assert _fields(_changes(live, "removed")[-1]) == {
            "event": "removed", "engine": "d1", "url": "http://d1.test:8104", "detail": "replaced before it was ready"
        }
        assert _fields(_changes(live, "starting")[-1])["url"] == "http://d2.test:8105"
        await until(lambda: state.engine_state("d1") == "ok")
        assert state.engines["d1"].url == "http://d2.test:8105"


async def test_an_engine_wanted_again_while_draining_serves_on(autojump_clock: trio.abc.Clock) -> None:
    async with open_live(doc("p0", "d0", "d1")) as live:
        state = live.router.state
        async with _serving_a_long_stream(live) as (busy, other, outcomes):
            assert (await live.router.reload(doc("p0", other), source="test")).removed == (busy,)
            assert state.engine_state(busy) == "draining"
            change = await live.router.reload(doc("p0", "d0", "d1"), source="test")
            assert change.added == (busy,) and state.engine_state(busy) == "ok"
            assert _fields(_changes(live, "ready")[-1]) == {
                "event": "ready", "engine": busy, "url": ENGINES[busy]["url"], "detail": "wanted again while draining"
            }
        assert outcomes[0].ok
        await trio.sleep(10.0)  # its drain was called off: it serves on
        assert state.engine_state(busy) == "ok" and _changes(live, "removed") == []
        assert live.router.fleet._tasks == {}


async def test_an_added_engine_with_a_profile_is_priced_by_it(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router.fleet")
    async with open_live(doc("p0", "d0"), priced=True, profile_names=("p0", "d0", "d1")) as live:
        state = live.router.state
        await live.router.fleet.apply(parse_fleet(doc("p0", "d0", "d1")), profiles=state.profiles, source="test")
        await until(lambda: state.engine_state("d1") == "ok")
        [ready] = _changes(live, "ready")
        assert (ready["pricing"], ready["detail"]) == ("profile", None)
        assert _logged(caplog)[-1] == (logging.INFO, "engine d1 is ready: in placement (profile)")


async def test_a_live_fleet_that_is_not_running_adds_no_engine(autojump_clock: trio.abc.Clock) -> None:
    state = RouterState(parse_fleet(doc("p0", "d0")), journal=Journal(None))
    fleet = LiveFleet(state)
    # A change of settings needs no task: it applies (the document's own engines, nothing before or after).
    settings = parse_fleet(doc("p0", "d0", engine={"request_timeout_s": 300.0}))
    assert (await fleet.apply(settings, profiles=None, source="test")).settings == ("engine.request_timeout_s",)
    assert state.config is settings
    with pytest.raises(RuntimeError) as err:
        await fleet.apply(parse_fleet(doc("p0", "d0", "d1")), profiles=None, source="test")
    assert str(err.value) == "the live fleet is not running"
    await state.aclose()


async def test_fleet_records_make_their_directory(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    state = RouterState(parse_fleet(doc("p0", "d0")), journal=Journal(None))
    fleet = LiveFleet(state, journal_path=tmp_path / "a" / "b" / "journal.jsonl")
    async with trio.open_nursery() as nursery:
        await nursery.start(fleet.run)
        fleet.record("noted", detail="é")
        await fleet.aclose()
        nursery.cancel_scope.cancel()
    [line] = (tmp_path / "a" / "b" / "journal.fleet.jsonl").read_text().splitlines()
    assert line.startswith('{"type":"fleet","event":"noted","at":')  # compact, one line a record
    assert _fields(json.loads(line)) == {"event": "noted", "detail": "é"}
    await state.aclose()


async def test_closing_the_fleet_from_a_cancelled_task_still_writes_its_records(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A library user's router stopping by cancellation: ``aclose`` called where every
    wait is cancelled still returns only once the queued records are in the file."""
    state = RouterState(parse_fleet(doc("p0", "d0")), journal=Journal(None))
    fleet = LiveFleet(state, journal_path=tmp_path / "journal.jsonl")
    async with trio.open_nursery() as nursery:
        await nursery.start(fleet.run)
        fleet.record("noted", detail="before the stop")
        with trio.CancelScope() as cancelled:
            cancelled.cancel()
            await fleet.aclose()
        # No checkpoint since: what is in the file was written before aclose returned.
        lines = (tmp_path / "journal.fleet.jsonl").read_text().splitlines()
        nursery.cancel_scope.cancel()
    assert [_fields(json.loads(x)) for x in lines] == [{"event": "noted", "detail": "before the stop"}]
    await state.aclose()
