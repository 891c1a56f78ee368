"""``narwhal profile``'s wiring without a sweep (the sweep, refit and repeated runs are
stood in for): the settings each option gives, the report and its exit status, every
usage error as one line; and the progress output on a terminal and in a log."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

from narwhal.config import load_default_fleet
from narwhal.profile import cli
from narwhal.profile.cli import main
from narwhal.profile.progress import Progress
from narwhal.profile.runner import EngineOutcome, ProfileRun, ProfileSettings

FLEET = ('{"engines": [{"name": "p0", "url": "http://p0.test:1", "roles": ["prefill", "decode"],'
         ' "connector": {"type": "NixlConnector", "kv_host": "h", "kv_port": 2}}]}')  # fmt: skip
SWEEP = ["--prefill-lens", "16,64,128,512", "--decode-input-lens", "32,128",
         "--decode-concurrency", "1,2"]  # fmt: skip


def a_run(*outcomes: EngineOutcome, out: str = "runs/profiles.json") -> ProfileRun:
    return ProfileRun(Path(out), Path(out).with_suffix(".samples.json"), outcomes)


class Calls:
    """Stands in for the sweep, refit and repeated runs, recording their arguments."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *outcomes: EngineOutcome) -> None:
        self.outcomes = outcomes or (EngineOutcome("sim-0", "ok"),)
        self.profile: list[tuple[Any, ProfileSettings, dict[str, Any]]] = []
        self.refit: list[tuple[Any, ...]] = []
        self.repeated: list[tuple[Any, ...]] = []
        monkeypatch.setattr(cli, "run_profile", self.run_profile)
        monkeypatch.setattr(cli, "refit_pair", self.refit_pair)
        monkeypatch.setattr(cli, "profile_repeatedly", self.profile_repeatedly)

    async def run_profile(self, config: Any, settings: ProfileSettings, **kw: Any) -> ProfileRun:
        self.profile.append((config, settings, kw))
        return a_run(*self.outcomes, out=settings.out)

    def refit_pair(self, config: Any, samples: str, out: str, **kw: Any) -> ProfileRun:
        self.refit.append((config, samples, out, kw))
        return a_run(*self.outcomes, out=out)

    async def profile_repeatedly(self, config: Any, settings: ProfileSettings, repeat: int,
                                 **kw: Any) -> tuple[list[ProfileRun], dict[str, Any]]:  # fmt: skip
        self.repeated.append((config, settings, repeat, kw))
        runs = [a_run(*self.outcomes, out=f"runs/profiles.run{k}.json") for k in range(1, repeat + 1)]
        doc = {"engines": {"sim-0": {"runs_ok": repeat, "runs": repeat, "figures": {
            "ttft.a": {"mean": 0.02, "sd": 0.001, "cv": 0.05, "spread": 0.1}}}}}  # fmt: skip
        return runs, doc


def test_the_options_become_the_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = Calls(monkeypatch)
    assert main(SWEEP) == 0
    config, settings, kw = calls.profile[0]
    assert config == load_default_fleet()
    assert settings == ProfileSettings(prefill_lens=(16, 64, 128, 512), decode_input_lens=(32, 128),
                                       decode_concurrency=(1, 2), repeats=5, warmup=1,
                                       decode_tokens=32, min_window_steps=8, engines=None,
                                       out="runs/profiles.json", overwrite=False, seed=None,
                                       accept_rejected_cells=False,
                                       prefix_fractions=(0.25, 0.5, 0.875), queue_burst=4)  # fmt: skip
    assert kw["config_source"] is None and isinstance(kw["progress"], Progress)
    assert not kw["progress"].quiet
    assert capsys.readouterr().out == (
        "wrote runs/profiles.json and runs/profiles.samples.json\n  sim-0: ok\n")

    argv = [*SWEEP, "--repeats", "3", "--warmup", "0", "--decode-tokens", "12",
            "--min-window-steps", "4", "--engines", " e0 , e1,", "--out", "x/p.json",
            "--overwrite", "--seed", "9", "--accept-rejected-cells", "--prefix-fractions",
            "0.5, 0.75", "--queue-burst", "0", "--decode-shared-prefix", "28", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    _, settings, kw = calls.profile[1]
    assert (settings.repeats, settings.warmup, settings.decode_tokens,
            settings.min_window_steps) == (3, 0, 12, 4)  # fmt: skip
    assert settings.engines == ("e0", "e1") and settings.out == "x/p.json"
    assert settings.overwrite and settings.seed == 9 and settings.accept_rejected_cells
    assert settings.prefix_fractions == (0.5, 0.75) and kw["progress"].quiet
    assert settings.queue_burst == 0 and settings.decode_shared_prefix == 28
    assert main([*SWEEP, "--prefix-fractions", " None "]) == 0
    assert calls.profile[2][1].prefix_fractions == ()


def test_a_fleet_file_is_loaded_and_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = Calls(monkeypatch)
    fleet = tmp_path / "fleet.json"
    fleet.write_text(FLEET)
    assert main(["--fleet", str(fleet), *SWEEP]) == 0
    config, _, kw = calls.profile[0]
    assert [e.name for e in config.engines] == ["p0"] and kw["config_source"] == str(fleet)


@pytest.mark.parametrize(
    ("outcome", "status", "line"),
    [
        (EngineOutcome("e0", "rejected", "TTFT fit rejected"), 1, "  e0: rejected: TTFT fit rejected"),
        (EngineOutcome("e0", "failed", "engine e0 died"), 1, "  e0: failed: engine e0 died"),
        (EngineOutcome("e0", "ok", None, None, ("cell a", "cell b"), False), 1,
         "  e0: ok (2 decode cell(s) rejected: cell a; cell b); pass --accept-rejected-cells "
         "to accept the profile"),
        (EngineOutcome("e0", "ok", None, None, ("cell a",), True), 0,
         "  e0: ok (1 decode cell(s) rejected: cell a)"),
    ],
)
def test_the_report_names_each_outcome_and_sets_the_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    outcome: EngineOutcome, status: int, line: str,
) -> None:  # fmt: skip
    Calls(monkeypatch, EngineOutcome("ok0", "ok"), outcome)
    assert main(SWEEP) == status
    assert capsys.readouterr().out.splitlines()[1:] == ["  ok0: ok", line]


def test_a_refit_takes_the_samples_out_and_engines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = Calls(monkeypatch)
    argv = ["--refit-samples", "old.samples.json", "--out", "new.json", "--overwrite",
            "--engines", "e1", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    config, samples, out, kw = calls.refit[0]
    assert config == load_default_fleet() and (samples, out) == ("old.samples.json", "new.json")
    assert kw["overwrite"] is True and kw["engines"] == ("e1",) and kw["progress"].quiet
    assert calls.profile == []
    assert capsys.readouterr().out.startswith("wrote new.json and new.samples.json\n")
    Calls(monkeypatch, EngineOutcome("e1", "rejected", "no"))
    assert main(argv) == 1


def test_repeated_runs_report_each_run_and_the_stability(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    calls = Calls(monkeypatch)
    fleet = tmp_path / "fleet.json"
    fleet.write_text(FLEET)
    assert main(["--fleet", str(fleet), *SWEEP, "--repeat", "2", "--seed", "4", "--out", "r/p.json"]) == 0
    config, settings, repeat, kw = calls.repeated[0]
    assert [e.name for e in config.engines] == ["p0"]
    assert repeat == 2 and settings.out == "r/p.json" and settings.seed == 4
    assert kw["config_source"] == str(fleet) and isinstance(kw["progress"], Progress)
    assert calls.profile == []
    assert capsys.readouterr().out.splitlines() == [
        "run 1 of 2",
        "wrote runs/profiles.run1.json and runs/profiles.run1.samples.json",
        "  sim-0: ok",
        "run 2 of 2",
        "wrote runs/profiles.run2.json and runs/profiles.run2.samples.json",
        "  sim-0: ok",
        "run-to-run stability over 2 runs (wrote r/p.stability.json):",
        "  sim-0: 2 of 2 runs profiled",
        "    sim-0 ttft.a: mean 0.02 sd 0.001 cv 5.00% spread 10.00%",
    ]
    # The worst run's status is the command's.
    Calls(monkeypatch, EngineOutcome("sim-0", "failed", "x"))
    assert main([*SWEEP, "--repeat", "2"]) == 1


def test_plots_are_asked_for_the_first_pair_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import narwhal.plots

    plotted: list[tuple[Path, Path]] = []

    def plot(samples: Path, folder: Path) -> list[Path]:
        plotted.append((Path(samples), Path(folder)))
        return [Path(folder) / "sim-0.ttft.png"]

    monkeypatch.setattr(narwhal.plots, "plot_profile", plot)
    Calls(monkeypatch)
    assert main([*SWEEP, "--plot"]) == 0
    assert plotted == [(Path("runs/profiles.samples.json"), Path("runs/plots"))]
    assert "  plot: runs/plots/sim-0.ttft.png\n" in capsys.readouterr().out
    assert main([*SWEEP, "--repeat", "3", "--plot"]) == 0
    assert [p[0] for p in plotted[1:]] == [Path("runs/profiles.run1.samples.json")]
    assert main(SWEEP) == 0 and len(plotted) == 2  # no --plot, no plots
    assert main(["--refit-samples", "s.json", "--out", "refit/p.json", "--plot"]) == 0
    assert plotted[2:] == [(Path("refit/p.samples.json"), Path("refit/plots"))]
    assert main(["--refit-samples", "s.json", "--out", "refit/p.json"]) == 0 and len(plotted) == 3

    def unavailable(samples: Path, folder: Path) -> list[Path]:
        raise narwhal.plots.PlotUnavailable("plots need matplotlib")

    monkeypatch.setattr(narwhal.plots, "plot_profile", unavailable)
    assert main([*SWEEP, "--plot"]) == 0
    assert capsys.readouterr().err == "narwhal profile: plots need matplotlib\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--prefill-lens, --decode-input-lens, --decode-concurrency required (or --refit-samples)"),
        (["--prefill-lens", ","], "argument --prefill-lens: expected at least one integer"),
        (["--prefill-lens", "8,x"],
         "argument --prefill-lens: expected comma-separated integers, got '8,x'"),
        (["--engines", " , "], "argument --engines: expected comma-separated engine names"),
        (["--prefix-fractions", "0.5,x"],
         "argument --prefix-fractions: expected comma-separated fractions or 'none', got '0.5,x'"),
        (["--prefix-fractions", "0.5,1"],
         "argument --prefix-fractions: expected fractions strictly between 0 and 1, got '0.5,1'"),
        (["--prefix-fractions", "0"],
         "argument --prefix-fractions: expected fractions strictly between 0 and 1, got '0'"),
        (["--prefix-fractions", ","],
         "argument --prefix-fractions: expected fractions strictly between 0 and 1, got ','"),
        ([*SWEEP, "--repeat", "0"], "--repeat must be at least 1"),
        ([*SWEEP, "--decode-tokens", "1"], "decode-tokens must be at least 2"),
        ([*SWEEP, "--queue-burst", "1"], "queue-burst must be 0 (no burst probe) or at least 2"),
        ([*SWEEP, "--queue-burst", "-2"], "queue-burst must be 0 (no burst probe) or at least 2"),
        ([*SWEEP, "--decode-shared-prefix", "29"],
         "decode-shared-prefix 29 leaves the shortest decode input (32 tokens) fewer than 4 tokens of its own"),
        (["--refit-samples", "s.json", "--prefill-lens", "1,2,3,4", "--decode-concurrency", "1,2",
          "--out", "x.json"], "--prefill-lens, --decode-concurrency do not apply to --refit-samples"),
        (["--refit-samples", "s.json"],
         "--refit-samples needs --out for the new pair (e.g. runs/profiles-refit.json)"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
    message: str,
) -> None:  # fmt: skip
    calls = Calls(monkeypatch)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"narwhal profile: error: {message}\n"
    assert calls.profile == calls.refit == calls.repeated == []


def test_a_configuration_error_of_the_run_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from narwhal.errors import ConfigError

    async def refuse(*_a: Any, **_k: Any) -> ProfileRun:
        raise ConfigError("runs/profiles.json already exist; pass --overwrite to write a new pair")

    monkeypatch.setattr(cli, "run_profile", refuse)
    assert main(SWEEP) == 2
    assert capsys.readouterr().err == ("narwhal profile: error: runs/profiles.json already exist; "
                                       "pass --overwrite to write a new pair @ $\n")  # fmt: skip


def test_an_interrupted_run_says_what_is_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def interrupted(*_a: Any, **_k: Any) -> ProfileRun:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_profile", interrupted)
    assert main(SWEEP) == 130
    assert capsys.readouterr().err == (
        "narwhal profile: interrupted; engines completed so far are in the sidecar\n")


def test_help_and_argv_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The help is the command's reference: every option, its argument and what it does.
    # After changing an option, write the new text with
    #   COLUMNS=100 python3 -c "from narwhal.profile.cli import _parser; print(_parser().format_help(), end='')" > tests/golden/narwhal-profile-help.txt
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text == (Path(__file__).parent / "golden" / "narwhal-profile-help.txt").read_text()
    calls = Calls(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["narwhal-profile", *SWEEP, "--seed", "5"])
    assert main() == 0 and calls.profile[0][1].seed == 5


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_status_line_on_a_terminal() -> None:
    out = _Terminal()
    p = Progress(out)
    assert p.tty and not p.quiet
    p.status("e0", "a")
    p.status("e0", "b")
    p.line("e0", "done")
    p.line("e0", "again")
    p.status("e0", "c")
    p.warn("e1", "careful")
    p.status("e1", "d")
    p.close()
    p.close()
    assert out.getvalue() == ("\r\x1b[Ke0: a\r\x1b[Ke0: b\r\x1b[Ke0: done\ne0: again\n"
                              "\r\x1b[Ke0: c\r\x1b[Ke1: warning: careful\n\r\x1b[Ke1: d\r\x1b[K")  # fmt: skip
    assert p.warnings == ["e1: careful"]


def test_progress_in_a_log_is_plain_lines_and_quiet_is_silent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = io.StringIO()
    p = Progress(log)
    assert not p.tty
    p.engine("e0", 2, 3, "http://e0:1")
    p.status("e0", "transient")
    p.warn("e0", "w")
    p.close()
    assert log.getvalue() == "e0: engine 2/3 at http://e0:1\ne0: warning: w\n"
    assert not Progress(object()).tty  # type: ignore[arg-type]  # a stream without isatty
    quiet = Progress(_Terminal(), quiet=True)
    quiet.status("e0", "x")
    quiet.warn("e0", "kept")
    quiet.close()
    assert quiet.stream.getvalue() == "" and quiet.warnings == ["e0: kept"]  # type: ignore[attr-defined]
    forced = Progress(_Terminal(), tty=False)
    forced.status("e0", "x")
    assert forced.stream.getvalue() == ""  # type: ignore[attr-defined]
    Progress().line("e0", "to stderr")
    assert capsys.readouterr().err == "e0: to stderr\n"
