"""Deployment records: written only for a passing check, complete, verified, matched to a fleet."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.check import (
    INDEX,
    CheckReport,
    RecordError,
    fleet_sha256,
    load_record,
    record_matches,
    run_check,
    write_record,
)
from narwhal.config import FaultSpec, parse_fleet
from narwhal.errors import ConfigError
from narwhal.profile.store import file_sha256, pair_paths
from narwhal.testing import SimFleet, open_sim_fleet
from tests.checkkit import LIMIT_S, fleet_doc, identities, sim_profile, write_pair


@asynccontextmanager
async def profiled_fleet(
    tmp_path: Path, *, refit: bool = False
) -> AsyncIterator[tuple[SimFleet, Path, Path]]:
    """A fleet file with its profile pair (a refit of an original pair when ``refit``) and
    its simulated engines running: ``(sim, fleet file, profiles file)``."""
    doc = fleet_doc()
    config = parse_fleet(doc)
    async with open_sim_fleet(config) as sim:
        live = await identities(config, sim.transport)
        profiles = [sim_profile(n, i) for n, i in live.items()]
        path = write_pair(tmp_path / "runs" / "profiles.json", profiles)
        if refit:
            original = pair_paths(path)[1]
            path = write_pair(
                tmp_path / "runs" / "profiles-refit.json",
                profiles,
                refit_of=str(original),
                extra_samples={"refit": {"from": str(original), "sha256": file_sha256(original)}},
            )
        fleet_file = tmp_path / "fleet.json"
        fleet_file.write_text(json.dumps(doc | {"profiles": {"path": str(path)}}, indent=2))
        yield sim, fleet_file, path


async def profiled_check(
    tmp_path: Path, *, refit: bool = False, fault: FaultSpec | None = None
) -> tuple[CheckReport, Path, Path]:
    """:func:`profiled_fleet` checked once: ``(report, fleet file, profiles file)``."""
    async with profiled_fleet(tmp_path, refit=refit) as (sim, fleet_file, path):
        if fault is not None:
            sim.engines["e1"].inject(fault)
        with trio.fail_after(LIMIT_S):
            report = await run_check(fleet_file, transport=sim.transport)
    return report, fleet_file, path


async def test_a_passing_check_is_retained_completely(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    report, fleet_file, profiles = await profiled_check(tmp_path)
    assert report.ok, report.lines()
    record = write_record(report, tmp_path / "record")
    base = tmp_path / "record"
    assert sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) == [
        "check.json",
        "fleet.json",
        "profiles/profiles.json",
        "profiles/profiles.samples.json",
        INDEX,
    ]
    assert (base / "fleet.json").read_bytes() == fleet_file.read_bytes()
    for name in ("profiles.json", "profiles.samples.json"):
        assert (base / "profiles" / name).read_bytes() == (profiles.parent / name).read_bytes()
    index = json.loads((base / INDEX).read_text())
    assert set(index["files"]) == {
        "check.json",
        "fleet.json",
        "profiles/profiles.json",
        "profiles/profiles.samples.json",
    }
    for name, digest in index["files"].items():
        assert file_sha256(base / name) == digest
    assert index["fleet"]["sha256"] == fleet_sha256(fleet_file) == record.fleet_sha256
    assert index["fleet"]["source"] == str(fleet_file)
    e0 = report.identities["e0"]
    assert e0 is not None and index["engines"]["e0"]["process_start_time"] == e0.process_start_time
    assert index["created_at"] and index["check"]["ok"] is True
    check = json.loads((base / "check.json").read_text())
    assert check == record.check() and check["ok"] is True and check["failures"] == 0
    assert len(check["results"]) == len(report.results)
    assert record.refit_original is None and record.engines == dict(report.identities)
    # The retained pair loads as a pair on its own.
    from narwhal.check import load_pair

    load_pair(base / record.profiles.profiles)


async def test_a_refit_is_retained_with_its_original_pair(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with profiled_fleet(tmp_path, refit=True) as (sim, fleet_file, profiles):
        report = await run_check(fleet_file, transport=sim.transport)
        assert report.ok, report.lines()
        assert [r.ok for r in report.named("gate_f.refit_original")] == [True]
        record = write_record(report, tmp_path / "record")
        assert record.profiles.profiles == "profiles/profiles-refit.json"
        assert record.refit_original is not None
        assert record.refit_original.profiles == "profiles-original/profiles.json"
        assert record.refit_original.samples == "profiles-original/profiles.samples.json"
        original = profiles.parent / "profiles.samples.json"
        retained = record.directory / record.refit_original.samples
        assert retained.read_bytes() == original.read_bytes()
        assert len(record.files) == 6

        # Without its original the refit cannot be retained, and the check says so.
        original.unlink()
        report = await run_check(fleet_file, transport=sim.transport)
    (failure,) = report.failures
    assert failure.name == "gate_f.refit_original" and "not found" in failure.message
    assert failure.measured == str(original)


async def test_a_failing_check_writes_no_record(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    fault = FaultSpec(kind="malformed_descriptor", on="prefill", variant="bad_block_ids")
    report, _, _ = await profiled_check(tmp_path, fault=fault)
    assert not report.ok
    with pytest.raises(RecordError, match="the check failed"):
        write_record(report, tmp_path / "record")
    assert not (tmp_path / "record").exists()


async def test_a_record_is_never_written_over_another(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    report, _, _ = await profiled_check(tmp_path)
    write_record(report, tmp_path / "record")
    before = (tmp_path / "record" / INDEX).read_bytes()
    with pytest.raises(RecordError, match="not an empty directory"):
        write_record(report, tmp_path / "record")
    assert (tmp_path / "record" / INDEX).read_bytes() == before


async def test_load_record_verifies_every_file(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    report, _, _ = await profiled_check(tmp_path)
    write_record(report, tmp_path / "record")
    load_record(tmp_path / "record")
    samples = tmp_path / "record" / "profiles" / "profiles.samples.json"
    samples.write_text(samples.read_text().replace('"ok"', '"OK"'))
    with pytest.raises(ConfigError, match=r"profiles/profiles\.samples\.json differs"):
        load_record(tmp_path / "record")
    samples.unlink()
    with pytest.raises(ConfigError, match="is missing"):
        load_record(tmp_path / "record")
    with pytest.raises(ConfigError, match="cannot read deployment record"):
        load_record(tmp_path / "nowhere")


async def test_record_matches_the_fleet_it_was_made_for(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    report, fleet_file, profiles = await profiled_check(tmp_path)
    record = load_record(write_record(report, tmp_path / "record").directory)
    doc: dict[str, Any] = json.loads(fleet_file.read_text())
    assert record_matches(record, fleet_file)
    assert record_matches(record, doc) and record_matches(record, parse_fleet(doc))
    # Formatting and spelled-out defaults are the same fleet.
    assert record_matches(record, doc | {"handoff": {"max_age_s": 60.0}})
    assert not record_matches(record, doc | {"handoff": {"max_age_s": 61.0}})
    assert not record_matches(
        record,
        doc
        | {"engines": [*doc["engines"][:1], doc["engines"][1] | {"url": "http://e1.test:9999"}]},
    )
    # The same fleet re-profiled in place no longer matches its old record.
    sidecar = pair_paths(profiles)[1]
    sidecar.write_text(sidecar.read_text() + " ")
    assert not record_matches(record, fleet_file)
    assert record_matches(record, fleet_file, check_profiles=False)
    with pytest.raises(ConfigError):
        record_matches(record, {"engines": []})
