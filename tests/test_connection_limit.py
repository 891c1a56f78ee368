"""A router whose descriptors run out, over loopback (issue 38, item 8).

``narwhal serve`` runs with its open-file limit lowered (``RLIMIT_NOFILE`` soft 256),
in front of simulated engines in a process of their own (``narwhal sim``), and many
more clients connect at once than its descriptors allow:

- with the default ``server.max_connections`` (derived from that limit) the router
  stops accepting at the limit, the clients beyond it wait in the listen backlog, and
  every request is served;
- with a limit the descriptors cannot honour, the router runs out: no engine is
  blamed (no ``prefill_failed``/``decode_failed``, no breaker transition), requests
  that could not reach an engine are 503 ``router_overloaded``, accepting pauses
  without a log line per try, and the router serves again once the clients leave.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.testing.ports import free_port

from .clikit import sim_fleet

SOFT_LIMIT = 256
CLIENTS = 300
BODY = json.dumps({"model": "sim-llama", "prompt": "one two three", "max_tokens": 2}).encode()
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)

pytestmark = pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2 * CLIENTS, reason="the test's own clients need descriptors"
)


def _spawn(argv: list[str], log: Path, *, nofile: int | None = None) -> subprocess.Popen[bytes]:
    if nofile is not None:  # lowered in the child, before narwhal starts
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        setup = (
            "import os, resource, sys; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {hard})); "
            "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
        )
        argv = [sys.executable, "-c", setup, *argv[1:]]
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        trio.run(trio.sleep, 0.05)
    pytest.fail(f"no {text!r} from {proc.args!r}:\n{log.read_text(errors='replace')}")


@contextmanager
def router(tmp_path: Path, server: dict[str, Any]) -> Iterator[tuple[int, Path, Path]]:
    """The embedded fleet's engines in ``narwhal sim``, and ``narwhal serve`` in front of
    them with the open-file limit lowered; yields (port, router log, journal)."""
    path = sim_fleet(tmp_path)
    doc = json.loads(path.read_text())
    doc["server"].update(server)
    path.write_text(json.dumps(doc))
    sims = _spawn([sys.executable, "-m", "narwhal", "sim", "--fleet", str(path)], tmp_path / "sim.log")
    proc = None
    try:
        _wait_for(tmp_path / "sim.log", f"simulated engine {doc['engines'][-1]['name']}", sims)
        port = free_port()
        log = tmp_path / "router.log"
        proc = _spawn(
            [sys.executable, "-m", "narwhal", "serve", "--fleet", str(path), "--port", str(port)],
            log, nofile=SOFT_LIMIT,
        )  # fmt: skip
        _wait_for(log, "narwhal serving on", proc)
        yield port, log, Path(doc["journal"]["path"])
    finally:
        for p in (proc, sims):
            if p is not None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    assert proc is not None and proc.returncode == 0, (tmp_path / "router.log").read_text(errors="replace")


async def _crowd(port: int, n: int) -> list[int]:
    """``n`` clients connect at once, then each sends one request; their statuses
    (0: the connection ended without an answer)."""
    socks = []
    for _ in range(n):
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))  # completes in the backlog, accepted or not
        socks.append(sock)
    statuses = [0] * n

    async def one(i: int) -> None:
        sock = socks[i]
        data = b""
        try:
            await sock.send(REQUEST)
            while more := await sock.recv(65536):
                data += more
        except OSError:
            pass
        finally:
            sock.close()
        if data.startswith(b"HTTP/1.1 "):
            statuses[i] = int(data[9:12])

    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
    return statuses


def _journal(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_at_the_derived_limit_every_client_is_served_in_turn(tmp_path: Path) -> None:
    # Before: the router accepted connections until accept() failed with EMFILE, then
    # its engine legs failed with EMFILE too: 502s journaled prefill_failed, counted by
    # the engines' breakers.
    with router(tmp_path, {}) as (port, log, journal):
        statuses = trio.run(_crowd, port, CLIENTS)
    assert statuses == [200] * CLIENTS
    records = _journal(journal)
    assert len(records) == CLIENTS and {r["terminal_class"] for r in records} == {"ok"}
    text = log.read_text(errors="replace")
    assert "max_connections" in text  # the limit was reached (and said so)
    assert "Traceback" not in text and "ejected" not in text


def test_out_of_descriptors_the_router_blames_no_engine_and_recovers(tmp_path: Path) -> None:
    # Before: 502 prefill_failed / decode_failed blamed on the engines (breaker
    # transitions, engines ejected) and an ERROR with a traceback every 0.1 s while
    # accept() failed.
    with router(tmp_path, {"max_connections": 10_000}) as (port, log, journal):
        statuses = trio.run(_crowd, port, CLIENTS)
        after = trio.run(_crowd, port, 4)  # the clients left: descriptors are back
    assert set(statuses) <= {200, 503} and 503 in statuses
    assert after == [200] * 4
    records = _journal(journal)
    classes = [r["terminal_class"] for r in records]
    assert set(classes) <= {"ok", "router_overloaded"} and "router_overloaded" in classes
    assert all(r["status"] == 503 for r in records if r["terminal_class"] == "router_overloaded")
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "ejected" not in text and "breaker" not in text
    # accept() may fail too (when the engine legs left no descriptor): a line per 10 s at most.
    assert text.count("accept() failed") <= 3
