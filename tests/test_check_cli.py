"""``narwhal check``: exit codes, one line per result, ``--json``, ``--record``, ``--suggest-slo``."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.check import load_record
from narwhal.check.cli import amain, main
from narwhal.config import FaultSpec, parse_fleet
from narwhal.testing import SimFleet, open_sim_fleet
from narwhal.testing.ports import free_port
from tests.checkkit import engine, fleet_doc, identities, identity_of, sim_profile, write_pair


@asynccontextmanager
async def fleet_file(tmp_path: Path, doc: dict[str, Any]) -> AsyncIterator[tuple[SimFleet, Path]]:
    """``doc`` written to a file with a profile pair bound to its running engines."""
    config = parse_fleet(doc)
    async with open_sim_fleet(config) as sim:
        live = await identities(config, sim.transport)
        path = write_pair(tmp_path / "profiles.json", [sim_profile(n, i) for n, i in live.items()])
        file = tmp_path / "fleet.json"
        file.write_text(json.dumps(doc | {"profiles": {"path": str(path)}}))
        yield sim, file


async def run(argv: list[str], sim: SimFleet | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    transport = sim.transport if sim is not None else None
    with trio.fail_after(600):
        code = await amain(argv, transport=transport, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


async def test_a_passing_fleet_exits_0_with_one_line_per_check(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with fleet_file(tmp_path, fleet_doc()) as (sim, file):
        code, out, err = await run(["--fleet", str(file)], sim)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"narwhal check: fleet {file}"
    assert lines[-1].startswith("narwhal check: passed (") and "checks" in lines[-1]
    body = lines[1:-1]
    assert body and all(line.startswith("ok   ") for line in body)
    assert any(line.startswith("ok   kv_transfer e0->e1: ") for line in body)
    assert all("(measured " in line and "; limit " in line for line in body)


async def test_failures_exit_1_one_line_each_naming_engine_value_and_limit(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(engine_contract={"version": "0.40.0"})
    async with fleet_file(tmp_path, doc) as (sim, file):
        sim.engines["e1"].inject(
            FaultSpec(kind="malformed_descriptor", on="prefill", variant="wrong_endpoint")
        )
        code, out, _ = await run(["--fleet", str(file)], sim)
        _, data, _ = await run(["--fleet", str(file), "--json"], sim)
    assert code == 1
    failed = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert failed == [
        "FAIL contract.version e0: engine e0 reports version '0.32.0', engine_contract.version "
        "pins '0.40.0' (measured 0.32.0; limit 0.40.0)",
        "FAIL contract.version e1: engine e1 reports version '0.32.0', engine_contract.version "
        "pins '0.40.0' (measured 0.32.0; limit 0.40.0)",
        failed[2],
    ]
    assert failed[2].startswith(
        "FAIL kv_transfer e1->e0: KV transfer e1->e0 failed at descriptor: "
    )
    assert "endpoint mismatch" in failed[2] and failed[2].endswith(
        "(measured descriptor failed; limit each leg within 5 s)"
    )
    assert (
        out.splitlines()[-1]
        == f"narwhal check: FAILED: 3 of {len(out.splitlines()) - 2} checks failed"
    )
    report = json.loads(data)
    assert report["ok"] is False and report["failures"] == 3
    assert [(r["name"], r["engine"]) for r in report["results"] if not r["ok"]] == [
        ("contract.version", "e0"),
        ("contract.version", "e1"),
        ("kv_transfer", "e1->e0"),
    ]
    assert report["engines"]["e0"]["version"] == "0.32.0"


async def test_an_invalid_fleet_document_is_one_failure_line_with_its_path(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    file = tmp_path / "fleet.json"
    doc = fleet_doc()
    doc["engines"][1]["url"] = "e1.test:8102"
    file.write_text(json.dumps(doc))
    code, out, err = await run(["--fleet", str(file)])
    assert (code, err) == (1, "")
    (failure,) = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert failure.startswith("FAIL fleet fleet: the fleet document does not load: ")
    assert "@ $.engines[1].url" in failure and "(measured $.engines[1].url;" in failure


async def test_profiles_given_on_the_command_line_replace_the_documents(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with fleet_file(tmp_path, fleet_doc()) as (sim, file):
        doc = json.loads(file.read_text())
        pair = doc.pop("profiles")["path"]
        bare = tmp_path / "bare.json"
        bare.write_text(json.dumps(doc))
        code, out, _ = await run(["--fleet", str(bare)], sim)
        assert code == 1 and "FAIL gate_f.profiles fleet: profiles.path is not set" in out
        code, out, err = await run(["--fleet", str(bare), "--profiles", pair], sim)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"narwhal check: fleet {bare} with profiles.path {pair}"


def test_the_fleet_defaults_to_the_embedded_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--suggest-slo", "--workload", "w.json"]) == 2  # reads the fleet first
    assert "profiles.path is not set" in capsys.readouterr().err


async def test_record_is_written_for_a_pass_and_refused_for_a_failure(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with fleet_file(tmp_path, fleet_doc()) as (sim, file):
        code, out, _ = await run(["--fleet", str(file), "--record", str(tmp_path / "rec")], sim)
        assert code == 0 and out.splitlines()[-1].startswith("narwhal check: deployment record")
        assert load_record(tmp_path / "rec").fleet_source == str(file)
        # An existing record is never overwritten: exit 1, the check itself passed.
        code, _, err = await run(["--fleet", str(file), "--record", str(tmp_path / "rec")], sim)
        assert code == 1 and "not an empty directory" in err
        sim.engines["e0"].inject(FaultSpec(kind="http_error", on="prefill", status=500))
        code, out, err = await run(
            ["--fleet", str(file), "--json", "--record", str(tmp_path / "rec2")], sim
        )
    assert code == 1 and "no record written: the check failed" in err
    assert json.loads(out)["record"] == {
        "dir": str(tmp_path / "rec2"),
        "written": False,
        "error": err.split("written: ")[1].strip(),
    }
    assert not (tmp_path / "rec2").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fleet", "f.json", "--profiles", "p.json", "--record", "d"], "--record keeps the fleet document as it is"),
        (["--fleet", "f.json", "--suggest-slo"], "--suggest-slo needs --workload"),
        (["--fleet", "f.json", "--workload", "w.json"], "--workload goes with --suggest-slo"),
        (
            ["--fleet", "f.json", "--suggest-slo", "--workload", "w.json", "--record", "d"],
            "does not go with --suggest-slo",
        ),
        (["--fleet", "f.json", "--frobnicate"], "unrecognized arguments"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("narwhal check: error: ") and message in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--suggest-slo" in capsys.readouterr().out


def test_an_unreachable_fleet_fails_on_real_sockets(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there once the socket is closed
    doc = {
        "engines": [
            {
                "name": "e0",
                "url": f"http://127.0.0.1:{port}",
                "roles": ["prefill", "decode"],
                "connector": {"kv_host": "127.0.0.1", "kv_port": 10},
            },
        ],
        "engine": {"connect_timeout_s": 2.0, "first_token_timeout_s": 2.0},
    }
    file = tmp_path / "fleet.json"
    file.write_text(json.dumps(doc))
    out = io.StringIO()
    code = trio.run(lambda: amain(["--fleet", str(file)], stdout=out))
    assert code == 1
    assert any(
        line.startswith(f"FAIL reachable e0: engine e0 at http://127.0.0.1:{port} is unreachable")
        for line in out.getvalue().splitlines()
    )


def suggest_files(tmp_path: Path, rate: float) -> tuple[Path, Path]:
    names = ["e0", "e1", "e2", "e3"]
    path = write_pair(
        tmp_path / "profiles.json",
        [sim_profile(n, identity_of(n, 8101 + i)) for i, n in enumerate(names)],
    )
    doc = fleet_doc(
        *(engine(n, 8101 + i) for i, n in enumerate(names)),
        controller={"slo": {"ttft_s": 0.5, "tpot_s": 0.01}},
    )
    file, workload = tmp_path / "fleet.json", tmp_path / "workload.json"
    file.write_text(json.dumps(doc | {"profiles": {"path": str(path)}}))
    workload.write_text(
        json.dumps(
            {
                "rate": rate,
                "input_len": "uniform:1500:2500",
                "output_len": "fixed:16",
                "requests": 500,
            }
        )
    )
    return file, workload


async def test_suggest_slo_reports_the_split_and_the_targets(tmp_path: Path) -> None:
    file, workload = suggest_files(tmp_path, 15.0)
    code, out, err = await run(["--fleet", str(file), "--suggest-slo", "--workload", str(workload)])
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (
        "narwhal check --suggest-slo: 15 requests/s, input uniform:1500:2500, "
        "output fixed:16, poisson arrivals"
    )
    assert lines[1].startswith("split: prefill e0, e1, e2; decode e3 (best of 14 splits priced)")
    assert any(line.startswith("TTFT targets: p50 ") and ", p90 " in line for line in lines)
    assert any(line.startswith("TPOT targets: p50 ") for line in lines)
    assert any(line.startswith("controller.slo.ttft_s 0.5 s holds at p90") for line in lines)
    code, out, _ = await run(
        ["--fleet", str(file), "--suggest-slo", "--workload", str(workload), "--json"]
    )
    data = json.loads(out)
    assert code == 0 and data["holds"] is True
    assert data["split"]["producers"] == ["e0", "e1", "e2"] and data["split"]["consumers"] == ["e3"]
    assert 0 < data["targets"]["ttft_s"]["p50"] <= data["targets"]["ttft_s"]["p90"]


async def test_suggest_slo_says_when_the_workload_cannot_be_held(tmp_path: Path) -> None:
    file, workload = suggest_files(tmp_path, 80.0)
    code, out, _ = await run(["--fleet", str(file), "--suggest-slo", "--workload", str(workload)])
    assert code == 1
    assert out.splitlines()[-1].startswith(
        "narwhal check: CANNOT HOLD: the workload cannot be held at 80 requests/s"
    )
    workload.write_text(json.dumps({"rate": 1, "input_len": "uniform:9", "output_len": "1"}))
    code, _, err = await run(["--fleet", str(file), "--suggest-slo", "--workload", str(workload)])
    assert code == 2 and "@ $.input_len" in err
