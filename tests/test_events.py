"""The live event hub: every subscriber gets every event in order, a slow one loses
events (counted) instead of slowing the publisher, and a subscription ends cleanly."""

from __future__ import annotations

import math

import pytest
import trio

from narwhal.router.breaker import Transition
from narwhal.router.events import EventHub


def _drain(receive: trio.MemoryReceiveChannel[dict[str, object]]) -> list[dict[str, object]]:
    out = []
    while True:
        try:
            out.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


async def test_every_subscriber_gets_every_event_in_order() -> None:
    hub = EventHub()
    hub.publish({"n": 0})  # nobody listens: counted, delivered to no one
    assert hub.published == 1 and hub.subscribers == 0
    with hub.subscribe() as a, hub.subscribe() as b:
        assert hub.subscribers == 2
        for n in range(1, 4):
            hub.publish({"n": n})
        assert hub.published == 4
        assert _drain(a.receive) == _drain(b.receive) == [{"n": 1}, {"n": 2}, {"n": 3}]
        assert a.dropped == b.dropped == 0
    assert hub.subscribers == 0


async def test_a_slow_subscriber_loses_events_and_says_how_many() -> None:
    hub = EventHub(buffer=2)
    with hub.subscribe() as slow, hub.subscribe() as fast:
        for n in range(3):
            hub.publish({"n": n})
            assert _drain(fast.receive) == [{"n": n}]
        assert (slow.dropped, fast.dropped) == (1, 0)
        hub.publish({"n": 3})
        assert slow.dropped == 2
        assert _drain(slow.receive) == [{"n": 0}, {"n": 1}]


async def test_the_default_buffer_holds_1024_events() -> None:
    hub = EventHub()
    with hub.subscribe() as sub:
        for n in range(1025):
            hub.publish({"n": n})
        assert sub.dropped == 1
        assert len(_drain(sub.receive)) == 1024


async def test_a_subscriber_that_closed_its_end_does_not_stop_the_others() -> None:
    hub = EventHub()
    with hub.subscribe() as gone, hub.subscribe() as live:
        gone.receive.close()
        hub.publish({"n": 1})
        assert gone.dropped == 0
        assert _drain(live.receive) == [{"n": 1}]


async def test_leaving_a_subscription_closes_its_channel() -> None:
    hub = EventHub()
    with hub.subscribe() as sub:
        hub.publish({"n": 1})
    assert hub.subscribers == 0
    with pytest.raises(trio.ClosedResourceError):
        sub.receive.receive_nowait()
    with pytest.raises(trio.ClosedResourceError):
        sub.send.send_nowait({"n": 2})
    hub.publish({"n": 2})  # no longer delivered there
    assert sub.dropped == 0


async def test_a_journal_record_and_a_breaker_transition_as_events() -> None:
    hub = EventHub()
    with hub.subscribe() as sub:
        hub.on_record({"request_id": "r1", "terminal_class": "ok"})
        hub.on_transition(Transition(engine="d0", event="ejected", at=12.5, detail="3 failures"))
        hub.on_transition(Transition(engine="d0", event="held", at=math.inf))
        assert _drain(sub.receive) == [
            {"type": "request", "record": {"request_id": "r1", "terminal_class": "ok"}},
            {"type": "breaker", "engine": "d0", "event": "ejected", "at": 12.5, "detail": "3 failures"},
            # A time that is not finite is not valid JSON: null.
            {"type": "breaker", "engine": "d0", "event": "held", "at": None, "detail": None},
        ]
