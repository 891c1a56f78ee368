"""Gate F and the fit limits: profile pairs bound to engine generations, each limit tripped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import pytest
import trio

from narwhal.check import CheckReport, CheckResult, check_margin, check_stable, run_check
from narwhal.config import parse_fleet, unstructure_fleet
from narwhal.engines import EngineIdentity
from narwhal.testing import open_sim_fleet
from tests import profilekit
from tests.checkkit import LIMIT_S, fleet_doc, identities, sim_profile, write_pair

SMALL = {
    "prefill_lens": (128, 256, 512, 1024),
    "decode_input_lens": (128, 512),
    "decode_concurrency": (1, 4),
    "decode_tokens": 16,
}


def failures(report: CheckReport, name: str) -> list[CheckResult]:
    return [r for r in report.failures if r.name == name]


def only_failure(report: CheckReport) -> CheckResult:
    assert len(report.failures) == 1, report.lines()
    return report.failures[0]


async def test_gate_f_passes_on_a_fresh_profile_and_fails_after_a_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101), profilekit.engine("e1", 8102))
    async with open_sim_fleet(config) as sim:
        run, _ = await profilekit.profile(
            config, sim.transport, profilekit.settings(tmp_path, **SMALL)
        )
        assert run.ok
        doc = unstructure_fleet(config) | {"profiles": {"path": str(run.profiles_path)}}
        with trio.fail_after(LIMIT_S):
            fresh = await run_check(doc, transport=sim.transport)
        assert fresh.ok, fresh.lines()
        assert {r.engine for r in fresh.named("gate_f.generation")} == {"e0", "e1"}
        # The sidecar's kept cells are what the axes are counted from.
        assert all(
            r.detail["counted_from"] == "samples" for r in fresh.named("decode.points.active")
        )

        await sim.engines["e0"].restart()
        await trio.sleep(5)  # pooled connections to the old process expire
        with trio.fail_after(LIMIT_S):
            after = await run_check(doc, transport=sim.transport)
    assert not after.ok
    failure = only_failure(after)
    assert (failure.name, failure.engine) == ("gate_f.generation", "e0")
    assert "re-profile" in failure.message and "narwhal profile" in failure.message
    assert "refit" in failure.message and "--refit-samples" in failure.message
    assert set(failure.measured) == {"process_start_time"}
    assert failure.measured["process_start_time"] != failure.limit["process_start_time"]
    line = failure.line()
    assert line.startswith("FAIL gate_f.generation e0: ") and "measured" in line and "limit" in line
    # Start times read as dates, in the message and the measured / limit values alike.
    assert len(re.findall(r"process_start_time '\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC'", line)) == 1
    assert len(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", line)) == 4, line
    assert not re.search(r"\d{6,}\.\d", line), line
    raw = failure.detail["live"]["process_start_time"], failure.detail["profiled"]["process_start_time"]
    assert all(isinstance(t, float) for t in raw)  # the JSON keeps the numbers


def test_generation_stable_prints_start_times_as_dates() -> None:
    def identity(start: float) -> EngineIdentity:
        return EngineIdentity(url="http://e0:8000", model="m", version="1", max_model_len=64, process_start_time=start)

    same, restarted, gone = check_stable(
        {"a": identity(1718000000.12), "b": identity(1718000000.12), "c": identity(1718000000.12)},
        {"a": identity(1718000000.12), "b": identity(1718003600.54), "c": None},
    )
    assert same.ok and same.line() == (
        "ok   generation.stable a: engine a ran one generation throughout the check "
        "(measured 2024-06-10 06:13:20 UTC; limit 2024-06-10 06:13:20 UTC)"
    )
    assert not restarted.ok and restarted.line() == (
        "FAIL generation.stable b: engine b restarted or went away during the check "
        "(started 2024-06-10 06:13:20 UTC -> 2024-06-10 07:13:20 UTC) "
        "(measured 2024-06-10 07:13:20 UTC; limit 2024-06-10 06:13:20 UTC)"
    )
    assert restarted.detail == {"process_start_time": [1718000000.12, 1718003600.54]}
    assert gone.line() == (
        "FAIL generation.stable c: engine c restarted or went away during the check "
        "(started 2024-06-10 06:13:20 UTC -> unreachable) (measured null; limit 2024-06-10 06:13:20 UTC)"
    )


@pytest.mark.parametrize(
    ("limits", "noise", "name", "limit"),
    [
        ({}, 0.08, "decode.fit_mape", 0.05),
        ({"max_decode_fit_mape": 0.02}, 0.03, "decode.fit_mape", 0.02),
        ({"max_decode_cv_mape": 0.025}, 0.02, "decode.cv_mape", 0.025),
    ],
)
async def test_each_fit_limit_names_the_engine_the_value_and_the_limit(
    autojump_clock: trio.abc.Clock,
    tmp_path: Path,
    limits: dict[str, float],
    noise: float,
    name: str,
    limit: float,
) -> None:
    # e1's cells scatter +/- noise around its model: the errors the check recomputes
    # from those samples trip the limit (a figure typed into profiles.json would not count).
    doc = fleet_doc()
    async with open_sim_fleet(parse_fleet(doc)) as sim:
        live = await identities(parse_fleet(doc), sim.transport)
        grid = [(a, k) for a in (1.0, 8.0, 64.0) for k in (100.0, 50_000.0, 200_000.0)]
        path = write_pair(
            tmp_path / "profiles.json",
            [sim_profile("e0", live["e0"]), sim_profile("e1", live["e1"])],
            cells={"e0": grid, "e1": grid},
            decode_noise={"e1": noise},
        )
        doc["profiles"] = {"path": str(path), **limits}
        report = await run_check(doc, transport=sim.transport)
    tripped = [r for r in report.failures if r.name == name]
    assert [r.engine for r in tripped] == ["e1"], report.lines()
    failure = tripped[0]
    stored = json.loads(path.read_text())["engines"]["e1"]["decode"][name.split(".")[1]]
    assert failure.measured == pytest.approx(stored) and stored > limit
    assert failure.limit == pytest.approx(limit)
    line = failure.line()
    assert line.startswith(f"FAIL {name} e1: ")
    assert f"measured {stored:.4g}" in line and f"limit {limit:g}" in line
    assert "e0" not in line
    assert not [r for r in report.failures if r.engine == "e0"]


async def test_a_fit_limit_above_the_movement_margin_fails(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(controller={"reactive": {"movement_margin": 0.04}})
    # The loader refuses the document; the check reports that as one line with its path.
    report = await run_check(doc | {"profiles": {"max_decode_fit_mape": 0.05}})
    failure = only_failure(report)
    assert failure.name == "fleet" and "$.profiles.max_decode_fit_mape" in failure.message
    assert failure.line().startswith("FAIL fleet fleet: ")
    # A document built in code skips the loader's validation; the check still catches it.
    config = parse_fleet(doc | {"profiles": {"max_decode_fit_mape": 0.03}})
    object.__setattr__(config, "profiles", attrs.evolve(config.profiles, max_decode_fit_mape=0.2))
    result = check_margin(config)
    assert not result.ok and (result.measured, result.limit) == (0.2, 0.04)
    assert "movement_margin" in result.line() and "measured 0.2; limit 0.04" in result.line()
    async with open_sim_fleet(config) as sim:
        report = await run_check(config, transport=sim.transport)
    assert [(r.name, r.measured, r.limit) for r in failures(report, "fit_limit")] == [
        ("fit_limit", 0.2, 0.04)
    ]


async def test_every_engine_needs_an_accepted_profile_of_the_current_schema(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc()
    async with open_sim_fleet(parse_fleet(doc)) as sim:
        live = await identities(parse_fleet(doc), sim.transport)
        path = write_pair(tmp_path / "profiles.json", [sim_profile("e0", live["e0"])])
        report = await run_check(doc | {"profiles": {"path": str(path)}}, transport=sim.transport)
        failure = only_failure(report)
        assert (failure.name, failure.engine) == ("gate_f.profile", "e1")
        assert "no accepted profile" in failure.message

        unset = await run_check(doc, transport=sim.transport)
        assert [(r.name, r.engine) for r in unset.failures] == [("gate_f.profiles", None)]
        assert "profiles.path is not set" in unset.failures[0].message

        data = json.loads(path.read_text())
        data["schema_version"] = 0
        old = tmp_path / "old.json"
        old.write_text(json.dumps(data))
        (tmp_path / "old.samples.json").write_bytes(
            (tmp_path / "profiles.samples.json").read_bytes()
        )
        report = await run_check(doc | {"profiles": {"path": str(old)}}, transport=sim.transport)
    failure = only_failure(report)
    assert failure.name == "gate_f.profiles" and "schema_version 0" in failure.message
    assert failure.detail["path"] == "$.schema_version"
