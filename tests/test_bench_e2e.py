"""A newcomer's session over loopback: ``narwhal serve``, then ``narwhal bench`` and ``join``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from narwhal.testing.ports import free_port

from .clikit import sim_fleet


def _bench(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal.bench", *argv],
        cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_serve_then_bench_then_join(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "serve", "--fleet", str(sim_fleet(tmp_path)), "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "narwhal serving on" in line:
                break
        else:
            pytest.fail("narwhal serve exited early:\n" + "".join(lines))
        url = f"http://127.0.0.1:{port}"
        done = _bench("--url", url, "--out", "runs/a", "--rate", "40", "--num-requests", "20",
                      "--input-len", "uniform:32:64", "--output-len", "12", "--slo-ttft", "2s",
                      "--slo-tpot", "500ms", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "20 scheduled, 20 scored (denominator), 20 ok, 0 failed" in done.stdout
        # Wall-clock latencies depend on the machine: the verdict is printed, whichever it is.
        assert "->  SLO HELD" in done.stdout or "->  SLO NOT MET" in done.stdout
        summary = json.loads((tmp_path / "runs/a/summary.json").read_text())
        assert summary["counts"]["by_class"] == {"ok": 20}
        records = [json.loads(x) for x in (tmp_path / "runs/a/results.jsonl").read_text().splitlines()]
        assert all(r["output_len"] == r["completion_tokens"] == 12 for r in records)
        assert all(r["prompt_tokens"] == r["prompt_len"] for r in records)  # one word, one token

        journal = tmp_path / "runs/journal.jsonl"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if journal.exists() and len(journal.read_text().splitlines()) >= 20:
                break
            time.sleep(0.1)
        joined = _bench("join", "--results", "runs/a", "--journal", str(journal), cwd=tmp_path)
        assert joined.returncode == 0, joined.stderr
        assert "joined 20 requests" in joined.stdout
        rows = [json.loads(x) for x in (tmp_path / "runs/a/join.jsonl").read_text().splitlines()]
        for row in rows:
            assert row["classes_agree"] and row["output_len_agrees"]
            # The client's TTFT contains the router's view of it.
            assert row["client_ttft_s"] >= row["router_first_byte_s"] >= row["router_ttft_s"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
