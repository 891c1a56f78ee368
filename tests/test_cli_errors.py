"""Operational errors at the command line: one line naming the port, URL or file, a
non-zero exit, no traceback; a second Ctrl-C stops ``narwhal serve`` at once.

Over loopback, on free ports, in temporary directories.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from narwhal.testing.ports import free_port

from .clikit import ENV, narwhal, sim_fleet


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The error line of a failed command (and that it is the only line on stderr besides logs)."""
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("narwhal ")]
    assert len(errors) == 1, done.stderr
    return errors[0]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process (here: this one) is listening on."""
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield port


def test_a_busy_router_port_is_one_line_naming_it(tmp_path: Path, held_port: int) -> None:
    fleet = sim_fleet(tmp_path, sims=False)
    done = narwhal("serve", "--fleet", str(fleet), "--port", str(held_port), "--admin-port", "0", cwd=tmp_path)
    assert done.returncode == 1
    line = one_line(done)
    assert f"127.0.0.1:{held_port}" in line and "already in use" in line and "--port" in line
    assert f"INFO narwhal: fleet document: {fleet}" in done.stderr  # which document it read


def test_a_busy_admin_port_is_one_line_naming_it(tmp_path: Path, held_port: int) -> None:
    fleet = sim_fleet(tmp_path, sims=False)
    done = narwhal("serve", "--fleet", str(fleet), "--port", "0", "--admin-port", str(held_port), cwd=tmp_path)
    assert done.returncode == 1
    line = one_line(done)
    assert f"127.0.0.1:{held_port}" in line and "--admin-port" in line


def test_the_admin_port_equal_to_the_router_port_is_refused(tmp_path: Path) -> None:
    port = free_port()
    fleet = sim_fleet(tmp_path, sims=False)
    done = narwhal("serve", "--fleet", str(fleet), "--port", str(port), "--admin-port", str(port), cwd=tmp_path)
    assert done.returncode != 0
    assert f"admin port {port} is the router's own port" in one_line(done)


def test_a_simulated_engine_port_held_by_something_else_is_named(tmp_path: Path, held_port: int) -> None:
    doc = json.loads(sim_fleet(tmp_path).read_text())
    doc["engines"][2]["url"] = f"http://127.0.0.1:{held_port}"
    (tmp_path / "fleet.json").write_text(json.dumps(doc))
    done = narwhal("serve", "--fleet", "fleet.json", "--port", "0", "--admin-port", "0", cwd=tmp_path)
    assert done.returncode == 1
    line = one_line(done)
    assert "decode-0" in line and f"127.0.0.1:{held_port}" in line


def test_top_of_a_router_that_is_not_running_names_the_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = narwhal("top", "--admin", url, "--once", "1", cwd=tmp_path)
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith("narwhal top: ") and url in line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "argument --port: 70000 is not a port number (0-65535)"),
        (["--admin-port", "-1"], "argument --admin-port: -1 is not a port number (0-65535)"),
        (["--workers", "0"], "argument --workers: '0' must be >= 1"),
        (["--log-level", "loud"], "argument --log-level: 'loud' is not a log level"),
    ],
)
def test_flags_are_validated_like_the_document(tmp_path: Path, flags: list[str], message: str) -> None:
    done = narwhal("serve", *flags, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_an_unreadable_fleet_document_is_one_line_naming_it(tmp_path: Path) -> None:
    for command in ("serve", "sim"):
        done = narwhal(command, "--fleet", "missing.json", cwd=tmp_path)
        assert done.returncode == 2
        line = one_line(done)
        assert line.startswith(f"narwhal {command}: missing.json: cannot read fleet document")


def test_log_options_are_accepted_after_the_subcommand(tmp_path: Path) -> None:
    done = narwhal("top", "--log-level", "debug", "--admin", f"http://127.0.0.1:{free_port()}", cwd=tmp_path)
    assert done.returncode == 1 and "DEBUG" in done.stderr
    done = narwhal("check", "--fleet", "missing.json", "--log-level", "warning", cwd=tmp_path)
    assert done.returncode == 1 and "missing.json" in done.stdout and "unrecognized" not in done.stderr


def test_a_second_interrupt_stops_at_once_and_journals_the_request(tmp_path: Path) -> None:
    port = free_port()
    fleet = sim_fleet(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "serve", "--fleet", str(fleet), "--port", str(port), "--admin-port", "0"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=ENV,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        assert "narwhal serving on" in proc.stdout.readline()
        body = {"model": "sim-llama", "prompt": "hello", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")  # the request is streaming
            proc.send_signal(signal.SIGINT)  # drains for server.shutdown_grace_s (30 s)
            time.sleep(0.5)
            assert proc.poll() is None
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert "Traceback" not in err, err
    assert "narwhal serve: stopped at once on a second signal: 1 request(s) in flight ended as shutdown" in err
    [record] = [json.loads(x) for x in (tmp_path / "runs" / "journal.jsonl").read_text().splitlines()]
    assert record["terminal_class"] == "shutdown"


def test_sim_names_the_engine_whose_port_is_held(tmp_path: Path, held_port: int) -> None:
    doc = json.loads(sim_fleet(tmp_path).read_text())
    doc["engines"][1]["url"] = f"http://127.0.0.1:{held_port}"
    (tmp_path / "fleet.json").write_text(json.dumps(doc))
    done = narwhal("sim", "--fleet", "fleet.json", cwd=tmp_path)
    assert done.returncode == 1
    assert one_line(done) == f"narwhal sim: simulated engine prefill-1: cannot listen on 127.0.0.1:{held_port}: address already in use"


def test_serve_api_key_and_metrics_on_the_api_port(tmp_path: Path) -> None:
    port = free_port()
    fleet = sim_fleet(tmp_path, sims=False)
    argv = ["serve", "--fleet", str(fleet), "--port", str(port), "--api-key", "k-1", "--metrics-on-api-port"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", *argv],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        assert "narwhal serving on" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"authorization": "Bearer k-1"}, timeout=10).status_code == 200
        metrics = f"http://127.0.0.1:{port}/metrics"
        assert httpx.get(metrics, timeout=10).status_code == 401
        scraped = httpx.get(metrics, headers={"authorization": "Bearer k-1"}, timeout=10)
        assert scraped.status_code == 200 and "narwhal_ready 0.0" in scraped.text  # no engine is up
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_serve_attaches_to_the_engines_narwhal_sim_runs(tmp_path: Path) -> None:
    fleet = sim_fleet(tmp_path)
    sim = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "sim", "--fleet", str(fleet)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )  # fmt: skip
    port = free_port()
    serve = None
    try:
        assert sim.stdout is not None
        assert all(sim.stdout.readline().startswith("simulated engine ") for _ in range(4))
        serve = subprocess.Popen(
            [sys.executable, "-m", "narwhal", "serve", "--fleet", str(fleet), "--port", str(port)],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
        )  # fmt: skip
        assert serve.stdout is not None
        lines = []
        for line in serve.stdout:
            lines.append(line)
            if line.startswith("narwhal serving on"):
                break
        assert any("attached to the simulated engines already running" in x for x in lines), lines
        assert not any("started 4 simulated engines" in x for x in lines)
        assert "NOT READY" not in lines[-1]
        done = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "a b", "max_tokens": 2}, timeout=30)
        assert done.status_code == 200
    finally:
        for proc in (serve, sim):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.communicate(timeout=30)
    assert serve is not None and serve.returncode == 0 and sim.returncode == 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_admin_port_others_can_reach_needs_admin_keys(tmp_path: Path, workers: str) -> None:
    doc = json.loads(sim_fleet(tmp_path).read_text())
    doc["server"]["admin_host"] = "0.0.0.0"
    (tmp_path / "fleet.json").write_text(json.dumps(doc))
    done = narwhal("serve", "--fleet", "fleet.json", "--port", "0", "--workers", workers, cwd=tmp_path)
    assert done.returncode == 2
    assert one_line(done) == (
        "narwhal serve: admin_host '0.0.0.0' is not a loopback address and no admin key is set: anyone who "
        "reaches the admin port could read /events and reload the fleet with PUT /fleet; set "
        "server.admin_api_keys (or NARWHAL_ADMIN_KEY), or bind it to 127.0.0.1 @ $.server.admin_host"
    )
    assert "started" not in done.stdout + done.stderr  # refused before anything started


def test_serve_and_top_take_the_admin_key_from_the_environment(tmp_path: Path) -> None:
    admin = free_port()
    fleet = sim_fleet(tmp_path, sims=False, admin_port=admin)
    keyless = {k: v for k, v in ENV.items() if k != "NARWHAL_ADMIN_KEY"}
    keyed = {**keyless, "NARWHAL_ADMIN_KEY": "admin-key-from-env"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "serve", "--fleet", str(fleet), "--port", "0"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=keyed,
    )  # fmt: skip
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{admin}"
    top = [sys.executable, "-m", "narwhal", "top", "--admin", url, "--once", "0.5"]
    try:
        assert "narwhal serving on" in proc.stdout.readline()
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
        scraped = httpx.get(f"{url}/metrics", headers={"authorization": "Bearer admin-key-from-env"}, timeout=10)
        assert scraped.status_code == 200 and "narwhal_ready" in scraped.text
        refused = subprocess.run(top, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=keyless)
        from_env = subprocess.run(top, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=keyed)
        from_flag = subprocess.run([*top, "--admin-key", "admin-key-from-env"], cwd=tmp_path, capture_output=True,
                                   text=True, timeout=60, env=keyless)  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert refused.returncode == 1 and one_line(refused) == (
        f"narwhal top: {url}/fleet answered HTTP 401: the router asks for an admin key (server.admin_api_keys): "
        "pass --admin-key or set NARWHAL_ADMIN_KEY"
    )
    for done in (from_env, from_flag):
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("narwhal top — 0 requests")
    assert proc.returncode == 0


@pytest.mark.parametrize("other", ["names swapped", "settings changed"])
def test_serve_attaches_only_to_the_engines_the_document_names(tmp_path: Path, other: str) -> None:
    fleet = sim_fleet(tmp_path)
    doc = json.loads(fleet.read_text())
    running = json.loads(fleet.read_text())  # what the running narwhal sim was given
    p0, p1 = running["engines"][0], running["engines"][1]
    if other == "names swapped":  # prefill-1 answers at prefill-0's URL, and the other way round
        p0["url"], p1["url"] = p1["url"], p0["url"]
        p0["connector"], p1["connector"] = p1["connector"], p0["connector"]
        problem = "it is simulated engine 'prefill-1', not prefill-0 (a narwhal sim of another fleet document?)"
    else:
        p0["sim"]["seed"] = 99
        p0["connector"]["kv_port"] = free_port()
        problem = ("it is prefill-0 with another sim and connector block than this fleet document's "
                   "(a narwhal sim of an older version of the document?)")  # fmt: skip
    (tmp_path / "running.json").write_text(json.dumps(running))
    sim = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "sim", "--fleet", "running.json"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )  # fmt: skip
    try:
        assert sim.stdout is not None
        assert all(sim.stdout.readline().startswith("simulated engine ") for _ in range(4))
        done = narwhal("serve", "--fleet", str(fleet), "--port", "0", "--admin-port", "0", cwd=tmp_path)
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.communicate(timeout=30)
    url = doc["engines"][0]["url"].removeprefix("http://")
    assert done.returncode == 1
    assert one_line(done) == (
        f"narwhal serve: simulated engine prefill-0: cannot listen on {url}: address already in use, and "
        f"{problem}: stop it, or give prefill-0 another url in the fleet document"
    )
