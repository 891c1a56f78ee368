"""Process helpers shared by the benchmark tools: free ports, start/stop, readiness."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from narwhal.testing.ports import free_port

__all__ = ["free_port", "start", "stop", "wait_http", "wait_port"]


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url`` answers below 500, or RuntimeError after ``timeout`` seconds, or as
    soon as ``proc`` (the process that is to serve it) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} did not come up: its process exited (rc {proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status < 500:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def wait_port(port: int, timeout: float = 60.0) -> None:
    """Until something listens on 127.0.0.1:``port``, or RuntimeError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port}")


def start(
    cmd: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    *,
    new_session: bool = True,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with its output in ``log`` (``env``, ``cwd``: its own), in a session of
    its own, or with ``new_session=False`` in a process group of its own in the caller's
    session.

    Beside engines pinned to the cores (the vLLM pair), a process in a session of its own
    is a scheduler autogroup of its own (``kernel.sched_autogroup_enabled``), which
    shares each core with the other sessions as a group, not per task: a router
    measured there waits behind the engines' group at each wake-up (docs/real-engines.md).
    """
    if new_session:
        return subprocess.Popen(
            cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=cwd
        )
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, process_group=0, env=env, cwd=cwd)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
