"""Progress of a profiling run: a live status line on a terminal, plain lines otherwise.

A sweep takes minutes on real engines. On a TTY, :meth:`Progress.status` rewrites one
line in place (which repeat, which cell) and :meth:`Progress.line` prints a lasting
line above it (an engine starting, a length's median, a cell's result). When the
stream is not a TTY (a log file, CI), status updates are dropped and every lasting
line is printed plainly, so logs stay short and greppable.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["Progress"]

_CLEAR = "\r\x1b[K"


class Progress:
    """Reports a profiling run's progress per engine and cell.

    Args:
        stream: where to write (default ``sys.stderr``).
        tty: force terminal behaviour on or off (default: ``stream.isatty()``).
        quiet: write nothing.
    """

    def __init__(
        self, stream: TextIO | None = None, *, tty: bool | None = None, quiet: bool = False
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self.quiet = quiet
        self._status_shown = False  # pragma: no mutate (equivalent: falsy alike)
        self.warnings: list[str] = []

    def _write(self, text: str) -> None:
        if self.quiet:
            return
        self.stream.write(text)
        self.stream.flush()

    def _clear_status(self) -> None:
        if self._status_shown:
            self._write(_CLEAR)
            self._status_shown = False  # pragma: no mutate (equivalent: falsy alike)

    def engine(self, name: str, index: int, total: int, url: str) -> None:
        """An engine's sweep starts."""
        self.line(name, f"engine {index}/{total} at {url}")

    def status(self, name: str, text: str) -> None:
        """A transient update (terminal only)."""
        if not self.tty:
            return
        self._write(f"{_CLEAR}{name}: {text}")
        self._status_shown = True

    def line(self, name: str, text: str) -> None:
        """A lasting line."""
        self._clear_status()
        self._write(f"{name}: {text}\n")

    def warn(self, name: str, text: str) -> None:
        """A lasting warning line (also kept in :attr:`warnings`)."""
        self.warnings.append(f"{name}: {text}")
        self.line(name, f"warning: {text}")

    def close(self) -> None:
        """Clear a status line left on the terminal."""
        self._clear_status()
