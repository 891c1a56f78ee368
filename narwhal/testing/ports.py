"""Free TCP ports for tests and tools that must name a port before a server binds it.

Port 0 lets the kernel choose at bind time, but a fleet document has to name each
engine's port before the engine starts. The usual trick (bind port 0, read the port,
close) hands out a port from the kernel's ephemeral range, which any outgoing
connection may take as its local port before the server binds it: the router's health
probes to the engines that started first, for one. :func:`free_port` instead picks
ports below that range, which the kernel never gives to outgoing connections, checks
that each binds now, and never hands out the same port twice in one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_port_run"]

#: The lowest port handed out: above the well-known and most registered service ports.
_LOWEST = 15000
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # the Linux default, and below the IANA range others use


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports that are free now, none handed out before.

    Raises RuntimeError when 1,000 random tries find no such run.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    high = _ephemeral_low()
    if high - _LOWEST < 1000:
        high = 65536  # an unusual ephemeral range leaves no room below it: any port
    for _ in range(1000):
        first = random.randrange(_LOWEST, high - count + 1)
        run = range(first, first + count)
        if any(p in _given for p in run) or not all(_bindable(host, p) for p in run):
            continue
        _given.update(run)
        return first
    raise RuntimeError(f"no {count} consecutive free ports in {_LOWEST}-{high - 1} on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port below the ephemeral range that is free now and not handed out before."""
    return free_port_run(1, host)
