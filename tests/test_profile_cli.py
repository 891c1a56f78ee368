"""``narwhal-profile``: usage errors, progress output and a run against ``narwhal sim`` over loopback."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from narwhal.profile import load_profiles
from narwhal.profile.cli import main
from narwhal.profile.progress import Progress
from narwhal.profile.store import (
    SAMPLES_KIND,
    SCHEMA_VERSION,
    Profiles,
    SamplesRef,
    file_sha256,
    pair_paths,
    write_json,
)
from narwhal.testing.ports import free_port

SWEEP = ["--prefill-lens", "16,64,128,512", "--decode-input-lens", "32,128",
         "--decode-concurrency", "1,2"]  # fmt: skip
MODEL = {
    "prefill": {"a": 0.02, "b": 5e-5, "c": 0.0},
    "decode": {"c0": 0.01, "c1": 0.003, "c2": 0.0},
}


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    port, kv_port = free_port(), free_port()
    doc = {"engines": [{
        "name": "sim-0", "url": f"http://127.0.0.1:{port}", "roles": ["prefill", "decode"],
        "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": kv_port},
        "sim": {"seed": 5, "max_model_len": 2048, **MODEL},
    }]}  # fmt: skip
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def sim_engines(fleet_file: Path) -> Iterator[Path]:
    """``narwhal sim`` serving the fleet's engines on loopback (wall clock)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "sim", "--fleet", str(fleet_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "simulated engine sim-0" in line:
                break
        else:
            pytest.fail("narwhal sim exited early:\n" + "".join(lines))
        yield fleet_file
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_profile_against_narwhal_sim_writes_a_pair(
    sim_engines: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs" / "profiles.json"
    argv = ["--fleet", str(sim_engines), *SWEEP, "--repeats", "3", "--decode-tokens", "12",
            "--min-window-steps", "4", "--out", str(out)]  # fmt: skip
    rc = main(argv)
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out
    assert "sim-0: engine 1/1 at http://127.0.0.1:" in captured.err
    assert "sim-0: prefill: 512 tokens: median TTFT" in captured.err
    assert "\r" not in captured.err  # plain lines when not a TTY
    profiles = load_profiles(out)
    if rc != 0:
        # Wall-clock timing on a badly overloaded machine can fail a fit; then the pair
        # says so and keeps the samples (the fits themselves are tested in virtual time).
        assert rc == 1 and "sim-0: rejected" in captured.out and "sim-0" in profiles.excluded
        pytest.skip(f"the machine was too loaded for wall-clock fits: {captured.out}")
    assert "sim-0: ok" in captured.out
    assert "sim-0: decode: cell input 128 x 2 streams: median TPOT" in captured.err
    p = profiles["sim-0"]
    assert p.identity.model == "sim-llama" and p.decode.cells == 4
    # Wall clock on a shared machine: a loaded scheduler only ever stretches the
    # simulated latencies, so the curves must sit at or above the models, within reason.
    kv = p.decode.domain.kv_tokens
    for predicted, truth in ((p.predict_ttft(512), 0.02 + 5e-5 * 512),
                             (p.predict_tpot(1, kv.min), 0.01 + 0.003),
                             (p.predict_tpot(2, kv.max), 0.01 + 0.006)):  # fmt: skip
        assert 0.7 * truth < predicted < 5 * truth

    # The same pair again is refused; a refit writes a new pair beside it.
    assert main(argv) == 2
    assert "already exist; pass --overwrite" in capsys.readouterr().err
    original = {q: q.read_bytes() for q in pair_paths(out)}
    refit = tmp_path / "runs" / "profiles-refit.json"
    samples = str(pair_paths(out)[1])
    assert main(["--fleet", str(sim_engines), "--refit-samples", samples, "--out", str(refit)]) == 0
    assert {q: q.read_bytes() for q in pair_paths(out)} == original
    assert load_profiles(refit)["sim-0"].decode == p.decode


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-lens", "1,2,3"], "--decode-input-lens, --decode-concurrency required"),
        (
            [
                "--prefill-lens",
                "100,200",
                "--decode-input-lens",
                "64,128",
                "--decode-concurrency",
                "1,2",
            ],
            "prefill-lens needs at least 4 distinct values",
        ),
        (["--prefill-lens", "a,b"], "expected comma-separated integers"),
        ([*SWEEP, "--repeats", "0"], "repeats must be at least 1"),
        ([*SWEEP, "--engines", "nope"], "no engine named 'nope'"),
        (
            ["--refit-samples", "s.json", *SWEEP, "--out", "x.json"],
            "do not apply to --refit-samples",
        ),
        (["--refit-samples", "s.json"], "needs --out"),
        (["--fleet", "/nonexistent/fleet.json", *SWEEP], "cannot read fleet document"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert not (tmp_path / "runs").exists()
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("narwhal profile: error: ")


def test_an_unbound_sample_file_is_refused(
    fleet_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old.samples.json"
    old.write_text(json.dumps({"schema_version": 1, "kind": "narwhal.profile-samples", "profiles": "old.json",
                               "engines": {"sim-0": {"prefill": {"repeats": []}}}}))  # fmt: skip
    rc = main(
        ["--fleet", str(fleet_file), "--refit-samples", str(old), "--out", str(tmp_path / "r.json")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "not bound to an engine generation" in err and "run a fresh sweep" in err
    assert not (tmp_path / "r.json").exists()


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--prefill-lens" in capsys.readouterr().out


def test_progress_rewrites_a_status_line_on_a_terminal_and_prints_lines_otherwise() -> None:
    tty, plain = io.StringIO(), io.StringIO()
    for stream, is_tty in ((tty, True), (plain, False)):
        p = Progress(stream, tty=is_tty)
        p.engine("e0", 1, 2, "http://e0:1")
        p.status("e0", "prefill: 128 tokens, repeat 1/3")
        p.status("e0", "prefill: 128 tokens, repeat 2/3")
        p.line("e0", "prefill: 128 tokens: median TTFT 1.00 ms over 3 repeats")
        p.warn("e0", "decode: cell rejected")
        p.close()
    assert plain.getvalue() == (
        "e0: engine 1/2 at http://e0:1\n"
        "e0: prefill: 128 tokens: median TTFT 1.00 ms over 3 repeats\n"
        "e0: warning: decode: cell rejected\n"
    )
    text = tty.getvalue()
    assert "\r\x1b[Ke0: prefill: 128 tokens, repeat 2/3" in text
    assert text.index("repeat 2/3") < text.index("median TTFT")
    assert "\r\x1b[Ke0: prefill: 128 tokens: median TTFT" in text


def test_no_engine_profiled_writes_no_profiles_file(
    fleet_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nothing listens at the engine's URL (no narwhal sim): every engine fails.
    out = tmp_path / "p.json"
    assert main(["--fleet", str(fleet_file), *SWEEP, "--out", str(out), "--quiet"]) == 1
    captured = capsys.readouterr()
    profiles, samples = pair_paths(out)
    assert not profiles.exists()  # nothing that serve or check could take
    assert json.loads(samples.read_text())["engines"]["sim-0"]["status"] == "failed"  # what failed, kept
    assert captured.out.splitlines()[0] == f"wrote {samples} only (what each engine's sweep measured, and why it failed)"
    assert captured.out.splitlines()[1].startswith("  sim-0: failed: engine sim-0 unreachable")
    assert captured.err.splitlines()[-1] == (
        f"narwhal profile: error: no engine was profiled, so no profiles file was written at {profiles} (serve "
        "and check would have nothing to price by): see each engine's reason above"
    )


def test_serve_and_check_refuse_a_pair_with_no_engine_profile(fleet_file: Path, tmp_path: Path) -> None:
    # An empty pair as an earlier narwhal wrote it when no engine could be profiled.
    profiles, samples = pair_paths(tmp_path / "p.json")
    write_json(samples, {"schema_version": SCHEMA_VERSION, "kind": SAMPLES_KIND, "engines": {}})
    empty = Profiles(schema_version=SCHEMA_VERSION, created_at="2026-01-01T00:00:00+00:00", software={},
                     samples=SamplesRef(path=samples.name, sha256=file_sha256(samples)), engines={},
                     excluded={"sim-0": "failed: engine sim-0 unreachable"})  # fmt: skip
    write_json(profiles, empty.to_json())
    reason = (f"{profiles}: the pair holds no engine profile (excluded: sim-0: failed: engine sim-0 unreachable): "
              "nothing to price placement by; profile the engines again @ $.engines")  # fmt: skip
    run = functools.partial(subprocess.run, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    serve = run([sys.executable, "-m", "narwhal", "serve", "--fleet", str(fleet_file), "--profiles", str(profiles)])
    assert serve.returncode == 2 and serve.stderr.splitlines()[-1] == f"narwhal serve: {reason}"
    assert "started" not in serve.stderr  # refused before any engine or listener started
    check = run([sys.executable, "-m", "narwhal", "check", "--fleet", str(fleet_file), "--profiles", str(profiles)])
    assert check.returncode == 1
    assert any(line.startswith("FAIL gate_f.profiles fleet: ") and reason in line for line in check.stdout.splitlines())
