"""End to end over loopback: ``narwhal serve`` on the shipped two-model simulated fleet
(``config/fleet.two-models.sim.json``, on free ports), under concurrent load."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from .clikit import ENV, sim_fleet

ROOT = Path(__file__).resolve().parents[1]
POOLS = {
    "sim-llama": {"llama-prefill-0", "llama-decode-0"},
    "sim-qwen": {"qwen-prefill-0", "qwen-decode-0"},
}


class Served:
    """``narwhal serve`` running on the two-model fleet; :meth:`stop` ends it gracefully."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        fleet = sim_fleet(workdir, source=ROOT / "config" / "fleet.two-models.sim.json")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "narwhal", "serve", "--fleet", str(fleet), "--port", "0", "--admin-port", "0"],
            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
        )  # fmt: skip
        self.lines: list[str] = []
        self.url = self._serving_url()

    def _serving_url(self) -> str:
        """Read the router's output until it says where it serves."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "narwhal serving on" in line:
                return line.split("narwhal serving on", 1)[1].split()[0]
        raise AssertionError("narwhal serve exited early:\n" + "".join(self.lines))

    def stop(self) -> int:
        """SIGTERM, wait for the graceful shutdown; the exit status."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rest, _ = self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rest, _ = self.proc.communicate()
            self.lines.append(rest)
        return self.proc.returncode


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    server = Served(tmp_path)
    try:
        yield server
    finally:
        server.stop()


async def test_two_models_served_over_loopback_never_cross(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        models = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("sim-llama", 4096), ("sim-qwen", 8192)]
        missing = await client.post("/v1/completions", json={"model": "sim-mistral", "prompt": "a", "max_tokens": 1})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        answers: list[tuple[str, int, Any]] = []

        async def one(i: int) -> None:
            model = ("sim-llama", "sim-qwen")[i % 2]
            body = {"model": model, "prompt": f"loopback request {i}", "max_tokens": 4 + i % 5}
            resp = await client.post("/v1/completions", json=body)
            answers.append((model, resp.status_code, resp.json()))

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(one, i)
    assert [status for _, status, _ in answers] == [200] * 64, answers
    assert all(body["model"] == model for model, _, body in answers)
    assert await trio.to_thread.run_sync(served.stop) == 0, "".join(served.lines)
    journal = [json.loads(line) for line in (served.workdir / "runs" / "journal.jsonl").read_text().splitlines()]
    ok = [r for r in journal if r["terminal_class"] == "ok"]
    assert len(ok) == 64 and {r["model"] for r in ok} == set(POOLS)
    for record in ok:
        assert {record["producer"], record["consumer"]} == POOLS[record["model"]], record
