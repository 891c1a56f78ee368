"""Command-line failure reporting: an operational error is one line, not a traceback.

What a user can fix (a port another process holds, a router or engine that does not
answer, a file that cannot be read, an invalid document) prints as one line naming the
port, URL or file, and the command exits non-zero: 2 for a bad document or flag, 1 for
anything else. A bug still raises with its traceback. Trio wraps errors in exception
groups; they are flattened here, and a group that holds anything but operational
errors and interrupts is a bug.

An interrupt (Ctrl-C) exits with status 130 and no traceback.
"""

from __future__ import annotations

import argparse
import importlib.resources
import math
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import trio

from narwhal.errors import ConfigError
from narwhal.http.server import ListenError

__all__ = ["CommandError", "default_fleet_path", "describe", "duration", "guarded", "leaves", "port_number", "positive_int"]

INTERRUPTED = 130


class CommandError(Exception):
    """An operational error, already worded for the user as one line."""

    def __init__(self, message: str, *, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def default_fleet_path() -> Path:
    """The embedded default fleet document (simulated engines), what ``--fleet`` defaults to."""
    return Path(str(importlib.resources.files("narwhal").joinpath("data/fleet.sim.json")))


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, exception groups flattened."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def _transport_message(exc: httpx.TransportError) -> str:
    try:
        url = str(exc.request.url)
    except RuntimeError:  # no request attached
        url = None
    reason = str(exc) or type(exc).__name__
    return f"cannot reach {url}: {reason}" if url else reason


def describe(exc: BaseException) -> tuple[str, int] | None:
    """``(one line, exit status)`` for an operational error, None for anything else."""
    if isinstance(exc, CommandError):
        return str(exc), exc.status
    if isinstance(exc, ConfigError):
        return str(exc), 2
    if isinstance(exc, ListenError):
        return str(exc), 1
    if isinstance(exc, httpx.TransportError):
        return _transport_message(exc), 1
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {(exc.strerror or str(exc)).lower()}", 1
    return None


def _interrupt(exc: BaseException) -> bool:
    return isinstance(exc, KeyboardInterrupt | trio.Cancelled)


def guarded(prog: str, body: Callable[[], int]) -> int:
    """Run a command's ``body``; operational errors print as ``prog: message``, one line.

    Returns the body's exit status, the error's, or 130 when interrupted.
    """
    try:
        return body()
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        found = leaves(exc)
        described = [d for d in map(describe, found) if d is not None]
        if any(describe(e) is None and not _interrupt(e) for e in found):
            raise
        if described:
            message, status = described[0]
            print(f"{prog}: {message}", file=sys.stderr, flush=True)
            return status
        return INTERRUPTED


def _whole(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0-65535 (0: the kernel picks one)."""
    value = _whole(text, "a port number (0-65535)")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535)")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number, at least 1."""
    value = _whole(text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def duration(text: str) -> float:
    """An argparse type: ``0.5``, ``0.5s`` or ``500ms``, in seconds (positive)."""
    raw = text.strip().lower()
    scale = 1.0
    if raw.endswith("ms"):
        raw, scale = raw[:-2], 1e-3
    elif raw.endswith("s"):
        raw = raw[:-1]
    try:
        value = float(raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (0.5, 0.5s or 500ms)") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive duration")
    return value
