"""Test-suite settings shared by every module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Shared 2-core machines make per-example wall-clock deadlines flaky; the tests
# bound their own time in virtual time instead.
settings.register_profile("narwhal", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("narwhal")

_CACHES = {".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "__pycache__"}


@pytest.fixture(scope="session", autouse=True)
def _nothing_written_into_the_checkout(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests write only into temporary directories (a journal or a profile pair left in
    the checkout would mix with the user's own)."""
    root = Path(request.config.rootpath)
    before = {p.name for p in root.iterdir()}
    yield
    added = sorted({p.name for p in root.iterdir()} - before - _CACHES)
    assert not added, f"the tests wrote {added} into {root}; use tmp_path"


@pytest.fixture(autouse=True)
def _zeromq_contexts_closed() -> Iterator[None]:
    """A ZeroMQ context a failed test left open is destroyed when that test ends (its
    sockets too): the failure is reported there, not as a later test's ResourceWarning."""
    yield
    kvevents = sys.modules.get(f"{__package__}.test_kvevents")
    if kvevents is not None:
        kvevents.RecordingContext.destroy_left_open()
