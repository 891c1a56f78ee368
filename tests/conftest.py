"""Test-suite settings shared by every module."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# Shared 2-core machines make per-example wall-clock deadlines flaky; the tests
# bound their own time in virtual time instead.
settings.register_profile("narwhal", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("narwhal")
