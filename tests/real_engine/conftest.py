"""Fixtures of the real-engine suite: which pair to use, and routers in front of it.

The pair, in order of preference:

- ``NARWHAL_VLLM_PAIR``: the run directory of a pair ``tools/vllm-cpu/pair.py start``
  started (CI sets it). It must be up: a missing or unhealthy pair fails the session.
  Engines the fault tests kill are restarted at the end unless
  ``NARWHAL_VLLM_PAIR_RESTORE=0``.
- ``NARWHAL_VLLM_FLEET``: the fleet document of any running pair. Tests that kill
  engines are skipped (nothing here knows how to restart them).
- otherwise, when the venv of ``tools/vllm-cpu/install.sh`` exists, the session starts
  a pair of its own in a temporary directory and stops it at the end; without the
  venv the suite is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .kit import PAIR_SCRIPT, RealPair, RouterProcess

_ORDER = (
    "test_serving",
    "test_transfer",
    "test_profile_check_bench",
    "test_prefix_cache",
    "test_prefix_pair",
    "test_tracing",
    "test_resume",
    "test_cache_plan_pair",
    "test_faults",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Serving, transfer, profile/check/bench, the prefix view and placement, tracing, then the
    tests that kill engines: resumes (which restart the consumer they kill), the cache
    plan (which needs both engines up again), then the faults. A module not named here
    runs last, after the faults: name every module that needs both engines alive."""

    def rank(item: pytest.Item) -> int:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if item.path.parent != Path(__file__).parent:
            return -1
        return _ORDER.index(module) if module in _ORDER else len(_ORDER)

    items.sort(key=rank)  # stable: file order is kept within a module


def _venv() -> Path:
    default = (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "narwhal"
        / "vllm-cpu-venv"
    )
    return Path(os.environ.get("NARWHAL_VLLM_VENV") or default)


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealPair]:
    named = os.environ.get("NARWHAL_VLLM_PAIR")
    fleet = os.environ.get("NARWHAL_VLLM_FLEET")
    if named:
        run_dir = Path(named)
        if not (run_dir / "fleet.json").is_file():
            pytest.fail(f"NARWHAL_VLLM_PAIR={named} has no fleet.json: start the pair first")
        real = RealPair.from_run_dir(run_dir)
        down = [role for role in real.urls if not real.healthy(role)]
        if down:
            pytest.fail(f"engines of the pair in {named} not healthy: {', '.join(down)}")
        yield real
        if real.dirty and os.environ.get("NARWHAL_VLLM_PAIR_RESTORE", "1") != "0":
            for role in sorted(real.dirty):
                real.restart(role)
        return
    if fleet:
        yield RealPair(json.loads(Path(fleet).read_text()), None)
        return
    if not (_venv() / "bin" / "python").exists():
        pytest.skip(
            "no vLLM venv: run tools/vllm-cpu/install.sh, or name a pair with NARWHAL_VLLM_PAIR"
        )
    run_dir = tmp_path_factory.mktemp("vllm-pair")
    script = [sys.executable, str(PAIR_SCRIPT)]
    where = ["--run-dir", str(run_dir)]
    started = subprocess.run(
        [*script, "start", *where, "--venv", str(_venv()), "--otlp-traces-endpoint", "auto"],
        check=False,
        timeout=1200,
    )
    try:
        if started.returncode != 0:
            pytest.fail(f"the vLLM pair did not start (logs in {run_dir})")
        yield RealPair.from_run_dir(run_dir)
    finally:
        subprocess.run([*script, "stop", *where], check=False, timeout=120)


@pytest.fixture
def managed_pair(pair: RealPair) -> RealPair:
    """The pair, for tests that kill engines (they need to restart them)."""
    if not pair.managed:
        pytest.skip("the pair was named by NARWHAL_VLLM_FLEET: nothing can restart its engines")
    return pair


@pytest.fixture(scope="session")
def router(pair: RealPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """One ``narwhal serve`` on the pair's fleet document, shared by the non-destructive tests."""
    proc = RouterProcess(pair.fleet, tmp_path_factory.mktemp("router"))
    proc.start()
    try:
        yield proc
    finally:
        status = proc.stop()
    assert status == 0, proc.log()[-3000:]
    # Graceful shutdown left one whole journal line per request.
    assert all(r["terminal_class"] for r in proc.journal())
