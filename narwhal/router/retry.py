"""The retry budget: retries may add at most ``ratio`` of the recent request rate.

Like Finagle's and Envoy's retry budgets: over a sliding window of ``window_s`` the
router allows ``max(min_retries_per_s * window_s, ratio * requests_in_window)``
retries, so that a failing fleet is not hit with a retry storm while a quiet one can
still retry an occasional transient fault.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import trio

__all__ = ["RetryBudget"]


class RetryBudget:
    def __init__(
        self,
        *,
        ratio: float,
        min_retries_per_s: float,
        window_s: float,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.ratio = ratio
        self.min_retries_per_s = min_retries_per_s
        self.window_s = window_s
        self._clock = clock
        self._requests: collections.deque[float] = collections.deque()
        self._retries: collections.deque[float] = collections.deque()

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        for q in (self._requests, self._retries):
            while q and q[0] < horizon:
                q.popleft()

    def note_request(self) -> None:
        now = self._clock()
        self._requests.append(now)
        if len(self._requests) > 4096:
            self._trim(now)

    def try_acquire(self) -> bool:
        """Take one retry from the budget; False when it is spent."""
        now = self._clock()
        self._trim(now)
        allowed = max(self.min_retries_per_s * self.window_s, self.ratio * len(self._requests))
        if len(self._retries) + 1 > allowed:
            return False
        self._retries.append(now)
        return True
