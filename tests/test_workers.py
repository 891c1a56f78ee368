"""Several router processes on one port, sharing engine load through the engines' metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import trio

from narwhal.testing.ports import free_port, free_port_run

from .routerkit import engine, fleet_doc, open_stack


async def test_placement_counts_load_the_engines_report(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"]),
        engine("d1", 8103, ["decode"]),
        server={"engine_load_poll_s": 0.5},
    )
    async with open_stack(doc) as stack:
        # Another router's traffic: long streams straight to d0.
        async with stack.fleet.client("d0") as other, trio.open_nursery() as nursery:

            async def stream() -> None:
                async with other.stream(
                    "POST", "/v1/completions", json={"prompt": "x y", "max_tokens": 400, "stream": True}
                ) as resp:
                    async for _ in resp.aiter_bytes():
                        pass

            for _ in range(3):
                nursery.start_soon(stream)
            await trio.sleep(1.0)  # the poller has seen them
            assert stack.router.state.placement.loads["d0"].engine_running == 3
            for _ in range(3):
                await stack.complete({"prompt": "a b", "max_tokens": 2})
            assert [r["consumer"] for r in stack.records] == ["d1", "d1", "d1"]


def test_workers_share_one_port(tmp_path: Path) -> None:
    admin = free_port_run(2)
    port, p_port, d_port = (free_port() for _ in range(3))
    doc = {
        "server": {"host": "127.0.0.1", "port": port, "admin_port": admin},
        "engines": [
            {"name": "p", "url": f"http://127.0.0.1:{p_port}", "roles": ["prefill"],
             "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": free_port()},
             "sim": {"prefill": {"a": 0.001, "b": 0.0}, "decode": {"c0": 0.001, "c1": 0.0, "c2": 0.0}}},
            {"name": "d", "url": f"http://127.0.0.1:{d_port}", "roles": ["decode"],
             "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": free_port()},
             "sim": {"prefill": {"a": 0.001, "b": 0.0}, "decode": {"c0": 0.001, "c1": 0.0, "c2": 0.0}}},
        ],
        "journal": {"path": str(tmp_path / "journal.jsonl")},
    }  # fmt: skip
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(doc))
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "serve", "--fleet", str(fleet), "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        ready = 0
        while ready < 2 and time.monotonic() < deadline:
            ready = 0
            for a in (admin, admin + 1):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{a}/health", timeout=2):
                        ready += 1
                except OSError:
                    pass
            time.sleep(0.1)
        assert ready == 2, "workers did not come up"
        body = json.dumps({"prompt": "a b c", "max_tokens": 3}).encode()
        for _ in range(40):  # a fresh connection each: the kernel spreads them
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json", "connection": "close"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
        served = []
        for a in (admin, admin + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{a}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            line = next(ln for ln in text.splitlines() if ln.startswith("narwhal_requests_total{"))
            served.append(float(line.rsplit(" ", 1)[1]))
        assert sum(served) == 40
        assert all(n > 0 for n in served)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    lines = (tmp_path / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 40
