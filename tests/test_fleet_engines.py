"""The live fleet's engine steps, directly: what an added engine's readiness, an engine
leaving and a change of settings ask of the router's other parts (its prefix-cache
watch, its reactive controller, the state's model listing and profile binding), over
simulated engines in memory (virtual time). tests/test_fleet_reload.py applies whole
documents to a running router."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from narwhal.config import FleetConfig, parse_fleet
from narwhal.router.fleet import LiveFleet
from narwhal.router.journal import Journal
from narwhal.router.state import RouterState
from narwhal.testing import open_memory_network, open_sim_fleet

from .routerkit import engine, fleet_doc
from .test_fleet_reload import until


@attrs.define
class Parts:
    """Stand-ins for the prefix-cache watch and the reactive controller, and what the
    live fleet asked of the state; each call kept in order."""

    calls: list[tuple[str, Any]] = attrs.field(factory=list)

    async def add(self, name: str) -> None:
        self.calls.append(("watch.add", name))

    def remove(self, name: str) -> None:
        self.calls.append(("watch.remove", name))

    def reconfigure(self, config: FleetConfig) -> None:
        self.calls.append(("controller.reconfigure", config))

    def spy(self, state: RouterState) -> None:
        refresh, bind = state.refresh_models, state.bind_profiles

        async def refresh_models(names: Any = None) -> None:
            self.calls.append(("state.refresh_models", names))
            await refresh(names)

        async def bind_profiles(names: Any = None) -> dict[str, str]:
            self.calls.append(("state.bind_profiles", names))
            return await bind(names)

        state.refresh_models = refresh_models  # type: ignore[method-assign]
        state.bind_profiles = bind_profiles  # type: ignore[method-assign]


THREE = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))


@asynccontextmanager
async def running(doc: dict[str, Any], *, spy: bool = True) -> AsyncIterator[tuple[LiveFleet, RouterState, Parts]]:
    """A running live fleet whose router has ``doc``'s first two engines (every engine
    of ``doc`` runs, simulated)."""
    async with open_memory_network() as net, open_sim_fleet(parse_fleet(doc), network=net) as sim:
        state = RouterState(parse_fleet(fleet_doc(*doc["engines"][:2])), transport=sim.transport,
                            journal=Journal(None))  # fmt: skip
        parts = Parts()
        if spy:
            parts.spy(state)
        fleet = LiveFleet(state, prefix_watch=parts, controller=parts)  # type: ignore[arg-type]
        try:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    await nursery.start(fleet.run)
                    yield fleet, state, parts
                    nursery.cancel_scope.cancel()
        finally:
            await state.aclose()


async def test_an_added_engine_is_listed_bound_and_watched_alone_once_ready(autojump_clock: trio.abc.Clock) -> None:
    async with running(THREE) as (fleet, state, parts):
        fleet._add(parse_fleet(THREE).engines[2])
        await until(lambda: state.engine_state("d1") == "ok")
    assert parts.calls == [("state.refresh_models", ["d1"]), ("state.bind_profiles", ["d1"]), ("watch.add", "d1")]


async def test_an_engine_leaving_leaves_the_prefix_watch(autojump_clock: trio.abc.Clock) -> None:
    async with running(THREE) as (fleet, state, parts):
        fleet._add(parse_fleet(THREE).engines[2])
        await until(lambda: state.engine_state("d1") == "ok")
        parts.calls.clear()
        state.phase["d0"] = "draining"
        state.refresh_roles()
        await fleet._forget("d0", "drained")
        assert "d0" not in state.engines
    assert parts.calls == [("watch.remove", "d0")]


async def test_new_settings_reach_the_controller_and_new_profiles_bind_the_engines_serving(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with running(THREE) as (fleet, state, parts):
        config = parse_fleet(fleet_doc(*THREE["engines"][:2], engine={"request_timeout_s": 300.0}))
        fleet._apply_settings(config, state.profiles)  # the same profiles: nothing to bind
        assert parts.calls == [("controller.reconfigure", config)] and state.config is config
        parts.calls.clear()
        state.phase["d0"] = "starting"  # not serving yet: bound once ready
        fleet._apply_settings(config, profiles=object())  # type: ignore[arg-type]
        await trio.testing.wait_all_tasks_blocked()  # the binding runs in the live fleet's nursery
    assert parts.calls == [("controller.reconfigure", config), ("state.bind_profiles", ["p0"])]


async def test_a_replacement_dropped_when_the_engine_is_wanted_again_never_comes_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    """d1 is replaced while busy (its replacement starts beside it, at an address where
    nothing answers yet, and d1 serves on), then wanted again as it was (the replacement
    is called off), then removed: once drained it is gone, and so is the replacement
    nobody wants any more."""
    moved = {**THREE["engines"][2], "url": "http://d1.test:9999"}
    without_d1 = parse_fleet(fleet_doc(*THREE["engines"][:2]))
    async with running(THREE, spy=False) as (fleet, state, _parts):
        await fleet.apply(parse_fleet(THREE), profiles=None, source="test")
        await until(lambda: state.engine_state("d1") == "ok")
        state.in_flight_by_engine["d1"] += 1  # a request still streams from it
        change = await fleet.apply(parse_fleet(fleet_doc(*THREE["engines"][:2], moved)), profiles=None, source="test")
        assert change.replaced == ("d1",) and "d1" not in state.phase and state.phase["d1#2"] == "starting"
        assert state.engines["d1#2"].url == "http://d1.test:9999"
        change = await fleet.apply(parse_fleet(THREE), profiles=None, source="test")
        assert change.replaced == ("d1",) and "d1" not in state.phase and "d1#2" not in state.engines
        assert (await fleet.apply(without_d1, profiles=None, source="test")).removed == ("d1",)
        state.in_flight_by_engine["d1"] -= 1
        state.placement.notify_released()
        await until(lambda: "d1" not in state.engines)
        await trio.sleep(state.config.recovery.probe_interval_s * 3)
        assert sorted(state.engines) == ["d0", "p0"] and fleet._tasks == {}
    assert [c["event"] for c in fleet.changes if c.get("engine") == "d1"][-1] == "removed"
    assert [c["event"] for c in fleet.changes if c.get("engine") == "d1#2"] == ["starting", "removed"]
