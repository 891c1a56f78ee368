"""Reachability, the engine contract and the KV transfer probes, against simulated engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.check import CheckReport, role_pairs, run_check
from narwhal.config import FaultSpec, parse_fleet
from narwhal.testing import open_sim_fleet
from tests.checkkit import LIMIT_S, engine, fleet_doc, identities, sim_profile, write_pair


async def checked(
    doc: dict[str, Any],
    tmp_path: Path,
    *,
    faults: dict[str, FaultSpec] | None = None,
    profiled: bool = True,
) -> CheckReport:
    """Run the check against the simulated engines of ``doc``, profiled as they run."""
    config = parse_fleet(doc)
    async with open_sim_fleet(config) as sim:
        if profiled:
            live = await identities(config, sim.transport)
            path = write_pair(
                tmp_path / "profiles.json", [sim_profile(n, i) for n, i in live.items()]
            )
            doc = doc | {"profiles": {"path": str(path)}}
        for name, spec in (faults or {}).items():
            sim.engines[name].inject(spec)
        with trio.fail_after(LIMIT_S):
            return await run_check(doc, transport=sim.transport)


def pairs(report: CheckReport) -> dict[str, bool]:
    return {str(r.engine): r.ok for r in report.named("kv_transfer")}


async def test_every_role_permitted_pair_is_probed_with_its_time(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("e1", 8102), engine("d0", 8103, ["decode"])
    )
    assert [(p.name, c.name) for p, c in role_pairs(parse_fleet(doc))] == [
        ("p0", "e1"),
        ("p0", "d0"),
        ("e1", "d0"),
    ]
    report = await checked(doc, tmp_path)
    assert report.ok, [r.line() for r in report.failures]
    assert pairs(report) == {"p0->e1": True, "p0->d0": True, "e1->d0": True}
    for r in report.named("kv_transfer"):
        assert r.detail["stage"] == "done" and r.detail["prefill_s"] > 0
        assert r.detail["first_token_s"] > 0
        assert r.measured == pytest.approx(r.detail["prefill_s"] + r.detail["first_token_s"])
        connector = parse_fleet(doc).engine_named(r.detail["producer"]).connector
        assert connector is not None
        assert r.detail["endpoint"] == f"{connector.kv_host}:{connector.kv_port}"


@pytest.mark.parametrize("variant", ["bad_block_ids", "wrong_endpoint", "missing_engine_id"])
async def test_a_broken_handoff_fails_only_its_pair(
    autojump_clock: trio.abc.Clock, tmp_path: Path, variant: str
) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("p1", 8102, ["prefill"]),
        engine("d0", 8103, ["decode"]),
        engine("d1", 8104, ["decode"]),
    )
    fault = FaultSpec(kind="malformed_descriptor", on="prefill", variant=variant)  # type: ignore[arg-type]
    report = await checked(doc, tmp_path, faults={"p0": fault})
    assert pairs(report) == {"p0->d0": False, "p0->d1": False, "p1->d0": True, "p1->d1": True}
    assert {r.name for r in report.failures} == {"kv_transfer"}
    for r in report.failures:
        assert r.detail["stage"] == "descriptor" and r.measured == "descriptor failed"
        assert r.line().startswith(f"FAIL kv_transfer {r.engine}: KV transfer {r.engine} failed")


async def test_a_consumer_that_cannot_decode_fails_only_its_pairs(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"]),
        engine("d1", 8103, ["decode"]),
    )
    fault = FaultSpec(kind="http_error", on="decode", status=503, message="no KV for you")
    report = await checked(doc, tmp_path, faults={"d1": fault})
    assert pairs(report) == {"p0->d0": True, "p0->d1": False}
    (failure,) = report.failures
    assert failure.detail["stage"] == "decode" and "503" in failure.message


async def test_a_contract_mismatch_names_the_engine_the_value_and_the_pin(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(
        engine("e0", 8101),
        engine("e1", 8102, max_model_len=8192),
        engine_contract={
            "version": "0.32.0",
            "model": "sim-llama",
            "max_model_len": 4096,
            "connector": "NixlConnector",
        },
    )
    report = await checked(doc, tmp_path)
    (failure,) = report.failures
    assert (failure.name, failure.engine) == ("contract.max_model_len", "e1")
    assert (failure.measured, failure.limit) == (8192, 4096)
    assert failure.line() == (
        "FAIL contract.max_model_len e1: engine e1 reports max_model_len 8192, "
        "engine_contract.max_model_len pins 4096 (measured 8192; limit 4096)"
    )
    assert len(report.named("contract.version")) == 2

    pinned = doc | {"engine_contract": {"version": "0.33.0", "connector": "LMCacheConnectorV1"}}
    report = await checked(pinned, tmp_path / "again")
    got = {
        (r.name, r.engine): (r.measured, r.limit)
        for r in report.failures
        if r.name.startswith("contract")
    }
    assert got == {
        ("contract.version", "e0"): ("0.32.0", "0.33.0"),
        ("contract.version", "e1"): ("0.32.0", "0.33.0"),
        ("contract.connector", "e0"): ("NixlConnector", "LMCacheConnectorV1"),
        ("contract.connector", "e1"): ("NixlConnector", "LMCacheConnectorV1"),
    }


async def test_an_unreachable_engine_fails_and_the_others_are_still_probed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(engine("e0", 8101), engine("e1", 8102), engine("e2", 8103, no_sim=True))
    report = await checked(doc, tmp_path)
    reach = {r.engine: r for r in report.named("reachable")}
    assert reach["e0"].ok and reach["e1"].ok and not reach["e2"].ok
    assert "e2" in reach["e2"].message and "unreachable" in reach["e2"].message
    assert (
        reach["e2"]
        .line()
        .startswith("FAIL reachable e2: engine e2 at http://e2.test:8103 is unreachable")
    )
    assert pairs(report) == {
        "e0->e1": True,
        "e0->e2": False,
        "e1->e0": True,
        "e1->e2": False,
        "e2->e0": False,
        "e2->e1": False,
    }
    assert all(r.detail["stage"] == "skipped" for r in report.failures if r.name == "kv_transfer")
    assert report.identities["e2"] is None and report.identities["e0"] is not None
