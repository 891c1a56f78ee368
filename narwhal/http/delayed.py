"""DelayedCalls: run callbacks a fixed delay after they were asked for, from one task.

:class:`~narwhal.http.server.HTTPServer` uses it to start a request's disconnect
watcher only once the request has lasted ``ServerLimits.disconnect_check_s``: most
requests end sooner, and a watcher (a task parked on the client's socket) costs a task
spawn, two ``epoll`` registrations and two task steps per request, about a tenth of a
short request's CPU. A request that ends first costs an append to a queue.

The delay is the same for every call, so the queue is in due order and one task, a
trio system task started when the first call is queued and ending when the queue is
empty, sleeps until the earliest. Callbacks run synchronously in that task and must
not block; one that raises is logged and the others still run.

With ``slack_s``, a call runs between ``delay_s`` and ``delay_s + slack_s`` after it
was queued, and one wake-up of the task runs every call due by then: a wake-up is a
timer expiring in trio (its deadline bookkeeping and a ``Cancelled`` raised through
the sleep, about 30 µs of CPU), and without slack there is one per call, so one per
request at any load.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["DelayedCalls"]

logger = logging.getLogger("narwhal.http")


class DelayedCalls:
    """Calls each queued callback ``delay_s`` seconds (trio's clock) after :meth:`call_later`,
    or up to ``slack_s`` later, together with the others due by then."""

    __slots__ = ("_done", "_queue", "_running", "_scope", "delay_s", "slack_s")

    def __init__(self, delay_s: float, slack_s: float = 0.0) -> None:
        if slack_s < 0:
            raise ValueError(f"slack_s must not be negative, got {slack_s!r}")
        self.delay_s = delay_s
        self.slack_s = slack_s
        self._queue: collections.deque[tuple[float, Callable[..., object], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._running = False
        self._scope = trio.CancelScope()
        self._done = trio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def call_later(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue ``fn(*args)`` to run ``delay_s`` from now (must be called in a trio run)."""
        self._queue.append((trio.current_time() + self.delay_s, fn, args))
        if not self._running:
            self._running = True
            self._scope = trio.CancelScope()
            self._done = trio.Event()
            trio.lowlevel.spawn_system_task(self._run, name="narwhal.http.delayed-calls")

    async def aclose(self) -> None:
        """Drop the calls still queued and return once the task has ended (the server
        that owns them has closed every connection: nothing is left to watch)."""
        self._queue.clear()
        if self._running:
            self._scope.cancel()
            await self._done.wait()

    async def _run(self) -> None:
        try:
            with self._scope:
                await self._drain()
        finally:  # also when the run ends and cancels its system tasks
            self._running = False
            self._done.set()

    async def _drain(self) -> None:
        queue = self._queue
        while queue:
            await trio.sleep_until(queue[0][0] + self.slack_s)
            now = trio.current_time()
            while queue and queue[0][0] <= now:
                _, fn, args = queue.popleft()
                try:
                    fn(*args)
                except Exception:
                    logger.exception("a delayed call failed")
