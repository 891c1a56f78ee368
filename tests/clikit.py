"""Running ``narwhal`` commands over loopback in tests: free ports, temporary directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from narwhal.cli import default_fleet_path
from narwhal.testing.ports import free_port

#: The environment the commands run with (output unbuffered: tests read it line by line).
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def narwhal(*argv: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``narwhal ARGV`` in ``cwd`` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "narwhal", *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV
    )


def sim_fleet(directory: Path, *, sims: bool = True, admin_port: int = 0, source: Path | None = None) -> Path:
    """The embedded simulated fleet (or the one at ``source``) on free ports, its journal
    in ``directory`` (``sims=False``: no simulated engines, so nothing listens at the
    engines' URLs)."""
    doc = json.loads((source or default_fleet_path()).read_text())
    for engine in doc["engines"]:
        engine["url"] = f"http://127.0.0.1:{free_port()}"
        engine["connector"]["kv_port"] = free_port()
        if not sims:
            del engine["sim"]
    doc["server"]["admin_port"] = admin_port
    doc["journal"]["path"] = str(directory / "runs" / "journal.jsonl")
    path = directory / "fleet.json"
    path.write_text(json.dumps(doc))
    return path
