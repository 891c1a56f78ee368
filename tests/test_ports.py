"""Free ports for fleet documents: outside the kernel's ephemeral range, never twice."""

from __future__ import annotations

import socket

import pytest

from narwhal.testing import ports
from narwhal.testing.ports import free_port, free_port_run


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    got = [free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    low = ports._ephemeral_low()
    for port in got:
        assert ports._LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing held it


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = int(busy.getsockname()[1])
        monkeypatch.setattr(ports, "_LOWEST", taken)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1002)
        picks = {free_port() for _ in range(200)}
    assert taken not in picks


def test_a_run_is_consecutive_and_not_reused() -> None:
    first = free_port_run(3)
    later = {free_port_run(3) for _ in range(30)}
    assert all(abs(p - first) >= 3 for p in later)
    for port in range(first, first + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_run_must_hold_a_port() -> None:
    with pytest.raises(ValueError, match="count must be at least 1, not 0"):
        free_port_run(0)


def test_an_unusual_ephemeral_range_leaves_any_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1024)
    first = free_port_run(2)
    assert ports._LOWEST <= first < 65535
    for port in (first, first + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
