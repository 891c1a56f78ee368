"""Logging setup: plain lines, or JSON lines with ``--log-json``.

The router logs one INFO line per request with its terminal class (never the prompt);
with JSON lines every record carries its structured fields (``extra=``) as keys.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LEVELS", "MAX_KEYS", "JSONFormatter", "SparseLog", "configure_logging"]

#: The levels ``--log-level`` accepts.
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_CHATTY = ("httpx", "httpcore", "trio-websocket")
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "INFO", *, json_lines: bool = False) -> None:
    handler = logging.StreamHandler()
    if json_lines:
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r} (one of {', '.join(s.lower() for s in LEVELS)})")
    root.setLevel(numeric)
    # The HTTP client libraries log one INFO line per request (bench sends thousands,
    # top and the router poll engines): only at DEBUG do they speak below WARNING.
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if numeric <= logging.DEBUG else logging.WARNING)


#: Keys a :class:`SparseLog` remembers at most.
MAX_KEYS = 1024


class SparseLog:
    """Warnings of one kind per key, the first at once and the next at most once per
    ``interval_s``, each saying how many went unlogged since the one before: a source
    that misbehaves on every poll, or a client that fails on every request, does not
    flood the log.

    Args:
        logger: where the warnings go.
        interval_s: at most one warning per key in this many seconds.
        clock: the clock the interval is measured on.
    """

    def __init__(self, logger: logging.Logger, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._quiet_until: dict[Hashable, float] = {}
        self._unlogged: dict[Hashable, int] = {}

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` for ``key`` unless one was logged less than ``interval_s``
        ago (then count it); returns whether it was logged."""
        now = self._clock()
        quiet_until = self._quiet_until.get(key)
        if quiet_until is not None and now < quiet_until:
            self._unlogged[key] = self._unlogged.get(key, 0) + 1
            return False
        if len(self._quiet_until) >= MAX_KEYS:  # keys a peer can vary: forget the oldest
            oldest = next(iter(self._quiet_until))
            del self._quiet_until[oldest]
            self._unlogged.pop(oldest, None)
        self._quiet_until.pop(key, None)
        self._quiet_until[key] = now + self.interval_s  # (insertion order: the oldest first)
        unlogged = self._unlogged.pop(key, None)
        more = f" ({unlogged} more since the last warning)" if unlogged is not None else ""
        self.logger.warning(msg + "%s", *args, more)
        return True
