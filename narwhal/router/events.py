"""Live events: journal records, breaker transitions and controller decisions.

An :class:`EventHub` fans each event out to its subscribers through bounded memory
channels. Publishing never blocks: a subscriber that falls behind loses events (its
``dropped`` count says how many) rather than slowing the request path.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import trio

from narwhal.router.breaker import Transition

__all__ = ["EventHub", "Subscription"]


@attrs.define(eq=False)
class Subscription:
    """One subscriber's channel; ``dropped`` counts events it was too slow for."""

    receive: trio.MemoryReceiveChannel[dict[str, Any]]
    send: trio.MemorySendChannel[dict[str, Any]]
    dropped: int = 0


class EventHub:
    def __init__(self, *, buffer: int = 1024) -> None:
        self.buffer = buffer
        self._subs: set[Subscription] = set()
        self.published = 0

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def publish(self, event: dict[str, Any]) -> None:
        self.published += 1
        for sub in self._subs:
            try:
                sub.send.send_nowait(event)
            except trio.WouldBlock:
                sub.dropped += 1
            except trio.BrokenResourceError:
                pass

    def on_record(self, record: dict[str, Any]) -> None:
        self.publish({"type": "request", "record": record})

    def on_transition(self, transition: Transition) -> None:
        at = transition.at
        self.publish(
            {
                "type": "breaker",
                "engine": transition.engine,
                "event": transition.event,
                "at": at if math.isfinite(at) else None,
                "detail": transition.detail,
            }
        )

    @contextmanager
    def subscribe(self) -> Iterator[Subscription]:
        send, receive = trio.open_memory_channel[dict[str, Any]](self.buffer)
        sub = Subscription(receive, send)
        self._subs.add(sub)
        try:
            yield sub
        finally:
            self._subs.discard(sub)
            send.close()
            receive.close()
