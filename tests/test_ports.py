"""Free ports for fleet documents: outside the kernel's ephemeral range, never twice."""

from __future__ import annotations

import random
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


def _force_draws(monkeypatch: pytest.MonkeyPatch, *forced: int) -> list[int]:
    """Make the picker's first random draws ``forced``, then draw as usual; returns the
    list of every draw made."""
    real = random.randrange
    queue = list(forced)
    draws: list[int] = []

    def randrange(start: int, stop: int) -> int:
        value = queue.pop(0) if queue else real(start, stop)
        draws.append(value)
        return value

    monkeypatch.setattr(ports.random, "randrange", randrange)
    return draws


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = int(busy.getsockname()[1])
        monkeypatch.setattr(ports, "_LOWEST", taken - 500)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 500)
        draws = _force_draws(monkeypatch, taken)
        port = free_port()
    assert draws[0] == taken and port != taken and len(draws) >= 2


def test_a_run_is_consecutive_and_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    first = free_port_run(3)
    for port in range(first, first + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    # The same run, and runs overlapping it, are drawn first: none is handed out again.
    draws = _force_draws(monkeypatch, first, first - 2, first + 2)
    again = free_port_run(3)
    assert draws[:3] == [first, first - 2, first + 2] and len(draws) >= 4
    assert abs(again - first) >= 3


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
