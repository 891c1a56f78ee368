"""End to end over loopback: ``narwhal serve`` on the embedded default fleet (on free ports)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from narwhal.testing.ports import free_port

from .clikit import sim_fleet


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    workdir = tmp_path_factory.mktemp("serve")
    port = free_port()
    admin_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "serve", "--fleet", str(sim_fleet(workdir)),
         "--port", str(port), "--admin-port", str(admin_port)],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
        yield f"http://127.0.0.1:{port}", workdir, f"http://127.0.0.1:{admin_port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    assert proc.returncode == 0, "".join(lines) + rest
    # Graceful shutdown flushed one journal line per request this module sent.
    journal = [json.loads(line) for line in (workdir / "runs" / "journal.jsonl").read_text().splitlines()]
    assert journal, "the journal is empty"
    assert all(r["terminal_class"] in ("ok", "invalid_request") for r in journal)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_tokens_and_done(served: tuple[str, Path, str]) -> None:
    url, _, _ = served
    body = json.dumps(
        {"model": "sim-llama", "prompt": "hello narwhal", "max_tokens": 8, "stream": True, "return_token_ids": True}
    )
    out = subprocess.run(
        ["curl", "-sS", "-N", "--max-time", "30", f"{url}/v1/completions",
         "-H", "content-type: application/json", "-d", body],
        capture_output=True, text=True, check=True,
    ).stdout
    events = [e[len("data: "):] for e in out.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c.get("token_ids") or []]
    assert len(ids) == 8


def test_openai_client_streams(served: tuple[str, Path, str]) -> None:
    openai = pytest.importorskip("openai")
    url, _, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    models = [m.id for m in client.models.list()]
    assert models == ["sim-llama"]
    chunks = list(client.completions.create(model="sim-llama", prompt="a b c", max_tokens=5, stream=True))
    assert sum(len(c.choices) for c in chunks) == 5
    chat = list(
        client.chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": "hi there"}], max_tokens=4, stream=True
        )
    )
    assert chat and chat[0].choices[0].delta.role == "assistant"
    full = client.chat.completions.create(
        model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert full.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="a", max_tokens=1)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_narwhal_sim_serves_engines_curl_can_stream(tmp_path: Path) -> None:
    port = free_port()
    kv_port = free_port()
    fleet = {
        "engines": [
            {"name": "both", "url": f"http://127.0.0.1:{port}", "roles": ["prefill", "decode"],
             "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": kv_port},
             "sim": {"model": "sim-llama"}}
        ]
    }
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet))
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "sim", "--fleet", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if "simulated engine both" in line:
                break
        body = json.dumps({"model": "sim-llama", "prompt": "a b c", "max_tokens": 4, "stream": True,
                           "return_token_ids": True})
        out = subprocess.run(
            ["curl", "-sS", "-N", "--max-time", "30", f"http://127.0.0.1:{port}/v1/completions",
             "-H", "content-type: application/json", "-d", body],
            capture_output=True, text=True, check=True,
        ).stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    events = [e[len("data: "):] for e in out.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c.get("token_ids") or []]
    assert len(ids) == 4
    assert proc.returncode == 0


def test_narwhal_top_follows_the_router(served: tuple[str, Path, str]) -> None:
    url, _, admin = served
    top = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "top", "--admin", admin, "--once", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    import time
    import urllib.request

    for _ in range(200):  # until top has subscribed to the live events
        with urllib.request.urlopen(f"{admin}/metrics", timeout=10) as resp:
            if "narwhal_event_subscribers 1.0" in resp.read().decode():
                break
        time.sleep(0.02)
    else:
        top.kill()
        pytest.fail("narwhal top never subscribed")
    body = json.dumps({"model": "sim-llama", "prompt": "a b c d", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    out, err = top.communicate(timeout=30)
    assert top.returncode == 0, err
    assert "prefill-0" in out and "decode-1" in out
    assert "classes: ok 1" in out


def test_admin_metrics_on_loopback(served: tuple[str, Path, str]) -> None:
    _, _, admin = served
    import urllib.request

    with urllib.request.urlopen(f"{admin}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "narwhal_requests_total" in text
