"""A one-line progress bar on the terminal while a run goes.

It shows requests done out of scheduled, in flight, failures and the worst client
lag so far, so that a client falling behind its schedule is visible while it runs.
It redraws at most ten times a second, and only when its stream is a terminal
(unless forced), so logs and tests stay clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import trio

from narwhal.bench.records import RequestResult

__all__ = ["Progress"]

_WIDTH = 24
_MIN_REDRAW_S = 0.1


class Progress:
    """A progress bar for ``total`` scheduled requests.

    Args:
        total: scheduled requests.
        stream: where to draw (default: standard error).
        enabled: draw even when the stream is not a terminal (None: only on a terminal).
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.started = 0
        self.done = 0
        self.failed = 0
        self.max_lag_s = 0.0
        self._began = time.monotonic()
        self._drawn_at = 0.0

    def request_started(self, record: RequestResult) -> None:
        """A request was sent."""
        self.started += 1
        if record.lag_s is not None:
            self.max_lag_s = max(self.max_lag_s, record.lag_s)
        self._maybe_draw()

    def request_finished(self, record: RequestResult) -> None:
        """A request reached its terminal outcome."""
        self.done += 1
        if not record.ok:
            self.failed += 1
        self._maybe_draw()

    def line(self) -> str:
        """The bar's current text."""
        filled = int(_WIDTH * self.done / self.total) if self.total else _WIDTH
        bar = "#" * filled + "-" * (_WIDTH - filled)
        elapsed = time.monotonic() - self._began
        return (
            f"[{bar}] {self.done}/{self.total} done, {self.started - self.done} in flight, "
            f"{self.failed} failed, max lag {self.max_lag_s * 1000:.0f} ms, {elapsed:.0f} s"
        )

    def _maybe_draw(self, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn_at < _MIN_REDRAW_S:
            return
        self._drawn_at = now
        self.stream.write("\r" + self.line() + "\x1b[K")
        self.stream.flush()

    async def tick(self, interval_s: float = 0.5) -> None:
        """Redraw every ``interval_s`` until cancelled (the clock keeps moving)."""
        while True:
            await trio.sleep(interval_s)
            self._maybe_draw(force=True)

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.enabled:
            self._maybe_draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
