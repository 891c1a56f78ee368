"""Several router processes on one port, sharing engine load through the engines' metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio

from narwhal.testing.ports import free_port, free_port_run

from .clikit import narwhal, sim_fleet
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


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:
        data: bytes = resp.read()
        return data


def _requests_total(text: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("narwhal_requests_total{"))


def test_workers_share_one_port_and_one_admin_surface(tmp_path: Path) -> None:
    admin = free_port_run(3)  # the combined surface, then one per worker
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
    combined = f"http://127.0.0.1:{admin}"
    try:
        deadline = time.monotonic() + 60
        health: dict[str, object] = {}
        while time.monotonic() < deadline:
            try:
                health = json.loads(_get(f"{combined}/health"))
            except OSError:
                health = {}
            workers = health.get("workers")
            if isinstance(workers, list) and all(w.get("status") == "ready" for w in workers):
                break
            time.sleep(0.1)
        assert health.get("status") == "ready" and len(health["workers"]) == 2, health  # type: ignore[arg-type]
        body = json.dumps({"prompt": "a b c", "max_tokens": 3}).encode()
        for _ in range(40):  # a fresh connection each: the kernel spreads them
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json", "connection": "close"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
        served = [_requests_total(_get(f"http://127.0.0.1:{a}/metrics").decode()) for a in (admin + 1, admin + 2)]
        assert sum(served) == 40 and all(n > 0 for n in served)
        # The combined surface: the workers' counts summed, one fleet view.
        text = _get(f"{combined}/metrics").decode()
        assert _requests_total(text) == 40
        assert "narwhal_workers_up 2.0" in text
        view = json.loads(_get(f"{combined}/fleet"))
        assert view["workers"] == 2 and [e["name"] for e in view["engines"]] == ["p", "d"]
        # Each worker: a process group of its own (a terminal's Ctrl-C reaches the parent
        # only), in the parent's session (one scheduler autogroup, as one process is).
        workers = [
            int(p) for task in Path(f"/proc/{proc.pid}/task").iterdir()
            for p in (task / "children").read_text().split()
        ]
        assert len(workers) == 2
        for pid in workers:
            assert os.getsid(pid) == os.getsid(proc.pid) and os.getpgid(pid) == pid != os.getpgid(proc.pid)
        # A fleet reload reaches every worker: PUT /fleet on the combined surface, SIGHUP
        # to the supervisor.
        broken = json.dumps({**doc, "engine": {"request_timeout_s": -1}}).encode()
        put = urllib.request.Request(f"{combined}/fleet", data=broken, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(put, timeout=60)
        answer = json.loads(refused.value.read())
        assert refused.value.code == 400 and answer["error"]["path"] == "$.engine.request_timeout_s"
        assert [w["status"] for w in answer["workers"]] == ["rejected", "rejected"]
        fleet.write_text(json.dumps({**doc, "engine": {"request_timeout_s": 300}}))
        proc.send_signal(signal.SIGHUP)
        records = tmp_path / "journal.fleet.jsonl"  # both workers append their records
        deadline = time.monotonic() + 60
        while records.read_text().count('"source":"SIGHUP"') < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        # Each worker appends its own records, in its order, through its own writer: two
        # workers' lines interleave by when each wrote them, so order by when each happened.
        reloads = sorted((json.loads(x) for x in records.read_text().splitlines()), key=lambda r: r["at"])
        assert [(r["event"], r["source"]) for r in reloads] == [("rejected", "PUT /fleet")] * 2 + [("reload", "SIGHUP")] * 2
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    lines = (tmp_path / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 40
    assert out.count("fleet reloaded (SIGHUP): settings changed engine.request_timeout_s") == 2, out


def test_expositions_combine_by_sum_except_the_state_gauges() -> None:
    from narwhal.router.fanin import combine_expositions, combine_fleets

    def worker(requests: int, breaker: int, bucket: int) -> str:
        return (
            "# HELP narwhal_requests_total Requests.\n# TYPE narwhal_requests_total counter\n"
            f'narwhal_requests_total{{route="completions",terminal_class="ok"}} {requests}\n'
            "# HELP narwhal_breaker_state Breaker state.\n# TYPE narwhal_breaker_state gauge\n"
            f'narwhal_breaker_state{{engine="d0"}} {breaker}\n'
            "# HELP narwhal_ttft_seconds TTFT.\n# TYPE narwhal_ttft_seconds histogram\n"
            f'narwhal_ttft_seconds_bucket{{le="0.1"}} {bucket}\nnarwhal_ttft_seconds_bucket{{le="+Inf"}} {requests}\n'
            f"narwhal_ttft_seconds_count {requests}\nnarwhal_ttft_seconds_sum {requests * 0.05}\n"
        )

    text = combine_expositions([worker(3, 0, 1), worker(5, 2, 4)]).decode()
    assert 'narwhal_requests_total{route="completions",terminal_class="ok"} 8.0' in text
    assert 'narwhal_breaker_state{engine="d0"} 2.0' in text  # the worst worker's view
    assert 'narwhal_ttft_seconds_bucket{le="0.1"} 5.0' in text and "narwhal_ttft_seconds_count 8.0" in text
    assert "narwhal_workers_up 2.0" in text
    load = {"reserved_prefill_tokens": 0, "reserved_decode_requests": 0}
    fleets = [
        {"engines": [{"name": "d0", "breaker": "ok", "in_flight": 1, "streak": 0, **load}], "in_flight": 1, "slo": {}},
        {"engines": [{"name": "d0", "breaker": "quarantined", "in_flight": 2, "streak": 1, **load}], "in_flight": 2,
         "slo": {}},
    ]  # fmt: skip
    view = combine_fleets(fleets)
    assert view["in_flight"] == 3 and view["workers"] == 2
    assert view["engines"] == [{"name": "d0", "breaker": "quarantined", "in_flight": 3, "streak": 1, **load}]


def test_a_worker_that_cannot_start_fails_the_command_naming_its_port(tmp_path: Path) -> None:
    admin = free_port_run(3)
    fleet = sim_fleet(tmp_path, sims=False, admin_port=admin)
    with socket.socket() as held:  # another process holds worker 0's admin port (admin_port + 1)
        held.bind(("127.0.0.1", admin + 1))
        held.listen()
        done = narwhal("serve", "--fleet", str(fleet), "--port", str(free_port()), "--workers", "2", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("narwhal serve: ")]
    assert errors[0] == (
        f"narwhal serve: worker 0: its own admin port {admin + 1} (server.admin_port + 1: the workers' admin "
        f"ports follow the combined one): cannot listen on 127.0.0.1:{admin + 1}: address already in use "
        "(another process holds it)"
    )
    assert re.fullmatch(
        r"narwhal serve: worker 0 \(pid \d+\) exited with status 1 \(its error is above\): stopped the other workers",
        errors[-1],
    ), errors
    assert "Traceback" not in done.stderr
