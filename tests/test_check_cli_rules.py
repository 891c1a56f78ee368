"""``narwhal check``'s command line on hand-made reports and suggestions (no engines):
every usage error, every line printed, every exit status."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import narwhal.check.cli as cli
from narwhal.bench.workload import LengthDist
from narwhal.check.cli import (
    _fleet_input,
    _parse,
    _render_check,
    _render_suggestion,
    _seconds,
    amain,
    main,
)
from narwhal.check.results import CheckReport, CheckResult, ProfilePair
from narwhal.check.suggest import Pressures, SLOSuggestion, SuggestWorkload
from narwhal.cmdline import default_fleet_path
from narwhal.config import parse_fleet
from tests.checkkit import fleet_doc, identity_of, sim_profile, write_pair

OK = CheckResult(name="reachable", engine="e0", ok=True, message="fine")
BAD = CheckResult(name="pool", engine=None, ok=False, measured=0, limit=1, message="no consumer")


async def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await amain(argv, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--suggest-slo"], "--suggest-slo needs --workload"),
        (["--workload", "w.json"], "--workload goes with --suggest-slo"),
        (["--suggest-slo", "--workload", "w", "--record", "d"],
         "--record retains a preflight; it does not go with --suggest-slo"),
        (["--profiles", "p.json", "--record", "d"],
         "--record keeps the fleet document as it is: set profiles.path in it instead of --profiles"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
async def test_usage_errors(argv: list[str], message: str) -> None:
    assert await run(argv) == (2, "", f"narwhal check: error: {message}\n")


def test_parse_fills_the_default_fleet() -> None:
    args = _parse([])
    assert args.fleet == str(default_fleet_path())
    assert (args.profiles, args.json, args.record, args.suggest_slo, args.workload) == (None, False, None, False, None)
    assert _parse(["--fleet", "f.json"]).fleet == "f.json"
    args = _parse(["--suggest-slo", "--workload", "w.json", "--json", "--profiles", "p.json"])
    assert (args.suggest_slo, args.workload, args.json, args.profiles) == (True, "w.json", True, "p.json")


async def test_help_exits_0_and_prints_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert await amain(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: narwhal check ") and "--record DIR" in out and "--workload W" in out


async def test_help_says_what_the_command_and_each_option_do(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no hyphen is wrapped
    assert await amain(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for said in (
        "Preflight a fleet: its document, engines, engine contract, profiles (Gate F, fit limits) "
        "and KV transfers; or suggest the SLO targets it can hold for a workload.",
        "--fleet FLEET the fleet document (default: the embedded simulated fleet)",
        "--profiles P check with this profiles.json instead of the document's profiles.path "
        "(to record a deployment, name the pair in the document)",
        "--json print the result as JSON",
        "--record DIR retain a passing check as a deployment record in DIR (new or empty)",
        "--suggest-slo suggest TTFT/TPOT targets and a prefill/decode split for --workload "
        "from the profiles (no engine is contacted)",
        '--workload W workload file: {"rate": 4, "input_len": "uniform:100:500", "output_len": "fixed:128"}',
    ):
        assert said in text, said


def test_the_fleet_input_with_profiles_given(tmp_path: Path) -> None:
    def args(fleet: Path, profiles: str | None = "p.json") -> Any:
        return _parse(["--fleet", str(fleet), *(["--profiles", profiles] if profiles else [])])

    f = tmp_path / "f.json"
    f.write_text(json.dumps({"engines": [], "profiles": {"path": "old.json", "max_decode_fit_mape": 0.1}}))
    assert _fleet_input(args(f, None)) == str(f)
    assert _fleet_input(args(f)) == {"engines": [], "profiles": {"path": "p.json", "max_decode_fit_mape": 0.1}}
    f.write_text(json.dumps({"engines": []}))
    assert _fleet_input(args(f)) == {"engines": [], "profiles": {"path": "p.json"}}
    # What does not load is left to the check to report.
    for text in ("[1]", "{nope", json.dumps({"profiles": "x"})):
        f.write_text(text)
        assert _fleet_input(args(f)) == str(f)
    assert _fleet_input(args(tmp_path / "missing.json")) == str(tmp_path / "missing.json")


def test_a_report_renders_one_line_per_result_and_a_verdict() -> None:
    out = io.StringIO()
    _render_check(CheckReport(results=(OK, BAD), source="f.json", duration_s=2.0), out)
    assert out.getvalue().splitlines() == [
        "narwhal check: fleet f.json",
        OK.line(),
        BAD.line(),
        "narwhal check: FAILED: 1 of 2 checks failed",
    ]
    out = io.StringIO()
    _render_check(CheckReport(results=(OK, OK), duration_s=1.23456), out)
    assert out.getvalue().splitlines() == [
        "narwhal check: fleet (in memory)",
        OK.line(),
        OK.line(),
        "narwhal check: passed (2 checks, 1.23 s)",
    ]


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """run_check replaced: it returns the report queued and records what it was given."""
    calls: list[Any] = []

    async def fake(fleet: Any, transport: Any = None) -> CheckReport:
        calls.append(fleet)
        report: CheckReport = calls[0]
        return report

    monkeypatch.setattr(cli, "run_check", fake)
    return calls


async def test_the_check_exits_by_its_verdict(checked: list[Any], tmp_path: Path) -> None:
    checked.append(CheckReport(results=(OK,), source="f.json"))
    code, out, err = await run(["--fleet", "f.json"])
    assert (code, err) == (0, "") and out.splitlines()[-1] == "narwhal check: passed (1 checks, 0.00 s)"
    assert checked[1] == "f.json"
    checked[0] = CheckReport(results=(OK, BAD), source="f.json")
    code, out, err = await run(["--fleet", "f.json", "--json"])
    assert (code, err) == (1, "")
    assert out == json.dumps(checked[0].to_json(), indent=1) + "\n"


async def test_profiles_given_name_the_source(checked: list[Any], tmp_path: Path) -> None:
    checked.append(CheckReport(results=(OK,)))
    f = tmp_path / "f.json"
    f.write_text(json.dumps({"engines": []}))
    code, out, _ = await run(["--fleet", str(f), "--profiles", "p.json"])
    assert code == 0 and out.splitlines()[0] == f"narwhal check: fleet {f} with profiles.path p.json"
    assert checked[1] == {"engines": [], "profiles": {"path": "p.json"}}
    checked[0] = CheckReport(results=(OK,), source="kept.json")
    code, out, _ = await run(["--fleet", str(f), "--profiles", "p.json"])
    assert out.splitlines()[0] == "narwhal check: fleet kept.json"
    checked[0] = CheckReport(results=(OK,))
    code, out, _ = await run(["--fleet", str(f)])
    assert out.splitlines()[0] == "narwhal check: fleet (in memory)"


def passing(tmp_path: Path) -> CheckReport:
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "p.json").write_text("{}")
    (runs / "p.samples.json").write_text("{}")
    return CheckReport(results=(OK,), document=fleet_doc(),
                       profiles=ProfilePair(profiles=str(runs / "p.json"), samples=str(runs / "p.samples.json")))  # fmt: skip


async def test_a_record_is_written_or_refused(checked: list[Any], tmp_path: Path) -> None:
    checked.append(passing(tmp_path))
    rec = tmp_path / "rec"
    code, out, err = await run(["--record", str(rec)])
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"narwhal check: deployment record written to {rec.resolve()}"
    code, out, err = await run(["--record", str(rec), "--json"])
    assert code == 1
    message = f"{rec} exists and is not an empty directory; a record is never written over another"
    assert err == f"narwhal check: no record written: {message}\n"
    assert json.loads(out)["record"] == {"dir": str(rec), "written": False, "error": message}
    code, out, err = await run(["--record", str(tmp_path / "rec2"), "--json"])
    assert code == 0 and err == ""
    assert json.loads(out)["record"] == {"dir": str((tmp_path / "rec2").resolve()), "written": True, "error": None}
    code, out, err = await run(["--record", str(rec)])
    assert code == 1 and "deployment record written" not in out
    # A failing check writes none, and exits 1 for the check.
    checked[0] = CheckReport(results=(BAD,))
    code, out, err = await run(["--record", str(tmp_path / "rec3")])
    assert code == 1 and err.startswith("narwhal check: no record written: the check failed (1 failed checks)")
    assert not (tmp_path / "rec3").exists()
    code, out, _ = await run(["--json"])
    assert "record" not in json.loads(out)


def test_seconds() -> None:
    assert (_seconds(None), _seconds(0.0123456), _seconds(12.0)) == ("-", "0.01235 s", "12 s")


def suggestion(**kw: Any) -> SLOSuggestion:
    best = Pressures(producers=("p0", "p1"), consumers=("d0",), prefill=0.5, decode=0.25,
                     prefill_rates={"p0": 1.5, "p1": 0.123456}, decode_rates={"d0": 2.0}, ttft_pk_mean_s=0.1,
                     step_s={"d0": 0.0123456}, active={"d0": 3.21}, kv_tokens={"d0": 12345.6})  # fmt: skip
    w = SuggestWorkload(rate=2.5, input_len=LengthDist.parse("uniform:10:20"), output_len=LengthDist.parse("8"), seed=7)
    base: dict[str, Any] = {
        "workload": w,
        "best": best,
        "holds": True,
        "ttft_s": {"mean": 0.2, "p50": 0.15, "p90": 0.3},
        "tpot_s": {"mean": 0.02, "p50": 0.015, "p90": 0.03},
        "candidates": 6,
        "simulated": 4000,
    }
    return SLOSuggestion(**(base | kw))


def rendered(s: SLOSuggestion, **slo: float) -> list[str]:
    out = io.StringIO()
    _render_suggestion(s, parse_fleet(fleet_doc(controller={"slo": slo})), out)
    return out.getvalue().splitlines()


HEAD = [
    "narwhal check --suggest-slo: 2.5 requests/s, input uniform:10:20, output fixed:8, poisson arrivals",
    "split: prefill p0, p1; decode d0 (best of 6 splits priced)",
    "pressures: prefill 0.500 (utilisation), decode 0.250 (utilisation or KV fill); worse 0.500",
    "  p0: prefill 1.5 requests/s",
    "  p1: prefill 0.123 requests/s",
    "  d0: decode 2 requests/s, mean step 0.01235 s, 3.21 active, 1.235e+04 KV tokens",
]


def test_a_suggestion_renders_the_split_the_targets_and_the_slo() -> None:
    assert rendered(suggestion(warnings=("w1", "w2"))) == [
        *HEAD,
        "TTFT targets: p50 0.15 s, p90 0.3 s (mean 0.2 s)",
        "TPOT targets: p50 0.015 s, p90 0.03 s (mean 0.02 s)",
        "warning: w1",
        "warning: w2",
        "(4000 requests simulated, seed 7; targets hold on an idle-fleet profile)",
    ]
    lines = rendered(suggestion(), ttft_s=0.3, tpot_s=0.025)
    assert lines[8:10] == [
        "controller.slo.ttft_s 0.3 s holds at p90 (0.3 s)",
        "controller.slo.tpot_s 0.025 s is missed at p90 (0.03 s)",
    ]
    assert rendered(suggestion(), tpot_s=0.05)[8] == "controller.slo.tpot_s 0.05 s holds at p90 (0.03 s)"
    # No TPOT (single-token outputs): no verdict on it.
    lines = rendered(suggestion(tpot_s={}), tpot_s=0.05)
    assert lines[7] == "TPOT targets: p50 -, p90 - (mean -)" and "controller.slo" not in " ".join(lines)


def test_a_split_names_every_engine_of_each_tier() -> None:
    s = suggestion()
    assert s.best is not None
    best = attrs.evolve(s.best, consumers=("d0", "d1"), decode_rates={"d0": 2.0, "d1": 0.5},
                        step_s={"d0": 0.0123456, "d1": None}, active={"d0": 3.21, "d1": 1.0},
                        kv_tokens={"d0": 12345.6, "d1": 10.0})  # fmt: skip
    lines = rendered(attrs.evolve(s, best=best))
    assert lines[1] == "split: prefill p0, p1; decode d0, d1 (best of 6 splits priced)"
    assert lines[6] == "  d1: decode 0.5 requests/s, mean step -, 1 active, 10 KV tokens"


def test_a_suggestion_that_cannot_hold_says_why() -> None:
    assert rendered(suggestion(holds=False, reason="too much", ttft_s={}, tpot_s={})) == [
        *HEAD, "narwhal check: CANNOT HOLD: too much",
    ]  # fmt: skip
    lines = rendered(suggestion(best=None, holds=False, reason="no split"))
    assert lines == [HEAD[0], "narwhal check: CANNOT HOLD: no split"]


async def test_suggest_slo_reads_the_pair_and_the_workload(tmp_path: Path) -> None:
    pair = write_pair(tmp_path / "profiles.json",
                      [sim_profile(n, identity_of(n, 8101 + i)) for i, n in enumerate(("e0", "e1"))])  # fmt: skip
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(fleet_doc()))
    w = tmp_path / "w.json"
    w.write_text(json.dumps({"rate": 1, "input_len": "fixed:100", "output_len": "fixed:4", "requests": 100}))
    argv = ["--fleet", str(fleet), "--suggest-slo", "--workload", str(w)]
    code, out, err = await run(argv)
    assert (code, out, err) == (2, "", f"narwhal check: error: {fleet}: profiles.path is not set; profile "
                                       "the fleet first (narwhal profile) @ $.profiles.path\n")  # fmt: skip
    code, out, err = await run([*argv, "--profiles", str(pair)])
    assert (code, err) == (0, "") and out.startswith("narwhal check --suggest-slo: 1 requests/s")
    code, out, err = await run([*argv, "--profiles", str(pair), "--json"])
    assert code == 0 and json.loads(out)["holds"] is True
    assert out == json.dumps(json.loads(out), indent=1) + "\n"
    fleet.write_text(json.dumps(fleet_doc() | {"profiles": {"path": str(pair)}}))
    w.write_text(json.dumps({"rate": 1000, "input_len": "fixed:100", "output_len": "fixed:4"}))
    code, out, err = await run(argv)
    assert code == 1 and "CANNOT HOLD" in out
    code, out, err = await run([*argv, "--json"])
    assert code == 1 and json.loads(out)["holds"] is False


def test_main_runs_amain_and_reports_an_interrupt(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    seen: list[Any] = []

    async def fake(argv: list[str]) -> int:
        seen.append(argv)
        await trio.lowlevel.checkpoint()
        return 3

    monkeypatch.setattr(cli, "amain", fake)
    assert main(["--json"]) == 3 and seen == [["--json"]]
    monkeypatch.setattr(cli.sys, "argv", ["narwhal-check", "--fleet", "x"])
    assert main() == 3 and seen[-1] == ["--fleet", "x"]

    async def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "amain", interrupted)
    assert main([]) == 130
    assert capsys.readouterr().err == "narwhal check: interrupted\n"


async def test_output_goes_to_the_standard_streams_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert await amain(["--suggest-slo"]) == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err == "narwhal check: error: --suggest-slo needs --workload\n"
