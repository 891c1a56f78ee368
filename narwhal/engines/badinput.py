"""What engines sent that the router could not use: counted per engine and source, logged sparingly.

Every parser of engine data (``/metrics``, KV events, ``/tokenize``, ``/v1/models``,
``/version``, a completion, the decode stream) treats what it reads as untrusted: a
value it cannot use (not a number, infinite, negative, a count that contradicts the ids
beside it, an answer past its size limit) is that engine's fault, raised as the
engine's error or dropped with the engine's view, never the router's. Each such fault
is reported here once: :class:`BadInput` counts it per ``(engine, source)`` (the router
exposes the counts as ``narwhal_engine_bad_input_total``) and logs it as a warning,
the first of each engine and source at once and the next ones at most once per
``interval_s`` with how many went unlogged, so that an engine answering nonsense on
every poll or every message does not flood the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from narwhal.logs import SparseLog

__all__ = ["LOG_INTERVAL_S", "BadInput"]

#: Seconds between two warnings about one engine's bad input from one source.
LOG_INTERVAL_S: Final = 60.0

_log = logging.getLogger("narwhal.engines")


class BadInput:
    """Counts (and logs, rate-limited) what engines sent that could not be used.

    Args:
        interval_s: at most one warning per engine and source in this many seconds.
        logger: where the warnings go.
        clock: the clock the interval is measured on.
    """

    def __init__(
        self,
        *,
        interval_s: float = LOG_INTERVAL_S,
        logger: logging.Logger = _log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        #: ``(engine, source)`` -> faults reported (never reset: a counter).
        self.counts: dict[tuple[str, str], int] = {}
        self._log = SparseLog(logger, interval_s, clock)

    def report(self, engine: str, source: str, reason: str) -> None:
        """Count one fault of ``engine``'s ``source`` (``metrics``, ``kv_events``, ...) and
        log it unless one was logged less than ``interval_s`` ago."""
        key = (engine, source)
        self.counts[key] = self.counts.get(key, 0) + 1
        self._log.warning(key, "engine %s: unusable %s: %s", engine, source, reason)

    def total(self, engine: str | None = None, source: str | None = None) -> int:
        """Faults reported, of one engine and/or source (all by default)."""
        return sum(
            n for (e, s), n in self.counts.items() if engine in (None, e) and source in (None, s)
        )
