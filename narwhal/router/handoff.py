"""What a consumer's handoff costs per token it pulls, learned from the journal.

A request's handoff (its prefill's end to its first token out of the consumer: the KV
pull, the consumer's scheduling and its next decode step) is measured on every request
(the journal's ``first_byte_s - ttft_s``). The part that grows with the tokens pulled
(the prompt less what the consumer's own cache held, as the prefix index predicted it)
is the transfer: :class:`HandoffModel` fits ``handoff = a + b * pulled`` per consumer by
least squares over its recent requests (an exponential decay), and answers ``b``, the
seconds a pulled token costs, once it has seen enough spread in what was pulled. A
consumer that holds a session's history pulls only the turn's new tokens, and priced
placement prefers it by the seconds that saves (:func:`narwhal.router.quotes.best_consumer`).
This module does no I/O.
"""

from __future__ import annotations

from typing import Final

__all__ = ["HandoffModel"]

#: Weight of the newest request in the decayed sums.
WEIGHT: Final = 0.02
#: Requests seen before the slope is used, and the spread of pulled tokens it needs (tokens).
MIN_REQUESTS: Final = 20
MIN_SPREAD: Final = 64.0


class HandoffModel:
    """Per consumer, handoff seconds against pulled tokens (see the module docstring)."""

    def __init__(self) -> None:
        #: Per consumer: decayed n, sum x, sum y, sum xx, sum xy; and requests seen.
        self._sums: dict[str, list[float]] = {}
        self._seen: dict[str, int] = {}
        #: Per consumer: the fitted seconds per pulled token (once known).
        self.per_token: dict[str, float] = {}

    def observe(self, consumer: str, seconds: float, pulled: int) -> None:
        """One request's handoff on ``consumer``, which pulled ``pulled`` prompt tokens."""
        sums = self._sums.get(consumer)
        if sums is None:
            sums = self._sums[consumer] = [0.0] * 5
        keep = 1.0 - WEIGHT
        x, y = float(pulled), seconds
        for i, add in enumerate((1.0, x, y, x * x, x * y)):
            sums[i] = sums[i] * keep + add
        seen = self._seen[consumer] = self._seen.get(consumer, 0) + 1
        n, sx, sy, sxx, sxy = sums
        var = sxx / n - (sx / n) ** 2
        if seen >= MIN_REQUESTS and var >= MIN_SPREAD**2:
            slope = (sxy / n - (sx / n) * (sy / n)) / var
            self.per_token[consumer] = max(slope, 0.0)

    def forget(self, consumer: str) -> None:
        self._sums.pop(consumer, None)
        self._seen.pop(consumer, None)
        self.per_token.pop(consumer, None)
