"""`narwhal check` with several models: each model's pool, and KV probes within a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from narwhal.check import CheckReport, run_check
from narwhal.config import parse_fleet
from narwhal.testing import open_sim_fleet
from tests.checkkit import LIMIT_S, engine, fleet_doc, identities, sim_profile, write_pair


def modelled(name: str, port: int, roles: list[str], model: str, *, declare: bool = True) -> dict[str, Any]:
    doc = engine(name, port, roles, model=model)
    if declare:
        doc["model"] = model
    return doc


async def checked(doc: dict[str, Any], tmp_path: Path, *, engines_doc: dict[str, Any] | None = None) -> CheckReport:
    """Check ``doc`` against simulated engines started from ``engines_doc`` (default: ``doc``)."""
    live_config = parse_fleet(engines_doc or doc)
    async with open_sim_fleet(live_config) as sim:
        live = await identities(live_config, sim.transport)
        path = write_pair(tmp_path / "profiles.json", [sim_profile(n, i) for n, i in live.items()])
        with trio.fail_after(LIMIT_S):
            return await run_check(doc | {"profiles": {"path": str(path)}}, transport=sim.transport)


async def test_two_models_pass_with_one_pool_each_and_probes_inside_each(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(
        modelled("pa", 8101, ["prefill"], "a"), modelled("pb", 8102, ["prefill"], "b"),
        modelled("da", 8103, ["decode"], "a"), modelled("db", 8104, ["decode"], "b"),
    )  # fmt: skip
    report = await checked(doc, tmp_path)
    assert report.ok, [r.line() for r in report.failures]
    assert [r.message for r in report.named("pool")] == [
        "model 'a': producers pa; consumers da",
        "model 'b': producers pb; consumers db",
    ]
    assert {r.engine: r.ok for r in report.named("model.declared")} == dict.fromkeys(["pa", "pb", "da", "db"], True)
    # A request is never placed across models: only pairs of one model are probed.
    assert [r.engine for r in report.named("kv_transfer")] == ["pa->da", "pb->db"]


async def test_a_model_without_a_consumer_fails_its_pool_by_name(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """No engine declares its model, so the document is valid; the live engines tell
    that model 'b' has no consumer."""
    doc = fleet_doc(
        modelled("pa", 8101, ["prefill"], "a", declare=False), modelled("pb", 8102, ["prefill"], "b", declare=False),
        modelled("da", 8103, ["decode"], "a", declare=False),
    )  # fmt: skip
    report = await checked(doc, tmp_path)
    assert not report.ok
    failed = [r for r in report.failures if r.name == "pool"]
    assert [r.line() for r in failed] == [
        "FAIL pool fleet: model 'b' has no reachable engine with the decode role (its engines: pb) "
        '(measured {"consumers": 0, "producers": 1}; limit {"consumers": 1, "producers": 1})'
    ]
    assert failed[0].detail["model"] == "b"
    assert [r.engine for r in report.named("kv_transfer")] == ["pa->da"]


async def test_an_engine_that_does_not_serve_its_declared_model_fails(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    engines = fleet_doc(modelled("p0", 8101, ["prefill"], "a"), modelled("d0", 8102, ["decode"], "other", declare=False))
    doc = fleet_doc(modelled("p0", 8101, ["prefill"], "a"), modelled("d0", 8102, ["decode"], "a"))
    del doc["engines"][1]["sim"]  # the document says 'a'; the engine serves 'other'
    report = await checked(doc, tmp_path, engines_doc=engines)
    declared = {r.engine: r for r in report.named("model.declared")}
    assert declared["p0"].ok and not declared["d0"].ok
    assert declared["d0"].message == (
        "engine d0 is declared to serve 'a' but does not list it (it serves 'other'); "
        "requests for 'a' placed there would fail"
    )
