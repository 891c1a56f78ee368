"""DelayedCalls: one task runs each callback its fixed delay after it was queued."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from narwhal.http.delayed import DelayedCalls


async def test_calls_run_in_order_at_their_due_times(autojump_clock: trio.abc.Clock) -> None:
    calls = DelayedCalls(0.5)
    ran: list[tuple[str, float]] = []

    def note(name: str) -> None:
        ran.append((name, trio.current_time()))

    start = trio.current_time()
    calls.call_later(note, "a")
    await trio.sleep(0.2)
    calls.call_later(note, "b")
    calls.call_later(note, "c")
    assert len(calls) == 3
    await trio.sleep(1.0)
    assert ran == [("a", start + 0.5), ("b", start + 0.7), ("c", start + 0.7)]
    assert len(calls) == 0


async def test_the_task_ends_when_idle_and_starts_again(autojump_clock: trio.abc.Clock) -> None:
    calls = DelayedCalls(0.1)
    ran: list[int] = []
    calls.call_later(ran.append, 1)
    await trio.sleep(0.2)
    await trio.testing.wait_all_tasks_blocked()
    assert not calls._running  # nothing queued: no task left sleeping
    calls.call_later(ran.append, 2)
    assert calls._running
    await trio.sleep(0.2)
    assert ran == [1, 2]


async def test_a_failing_call_is_logged_and_the_rest_still_run(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    calls = DelayedCalls(0.1)
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("boom")

    calls.call_later(boom)
    calls.call_later(ran.append, "after")
    with caplog.at_level(logging.ERROR, logger="narwhal.http"):
        await trio.sleep(0.2)
    assert ran == ["after"]
    assert "a delayed call failed" in caplog.text
    assert "boom" in caplog.text


async def test_with_slack_calls_due_within_it_run_at_one_wake_up(autojump_clock: trio.abc.Clock) -> None:
    """Each call runs no sooner than its delay and no later than its delay plus the
    slack; the calls due by then run together, so a wake-up serves many requests."""
    calls = DelayedCalls(0.5, slack_s=0.25)
    ran: list[tuple[str, float]] = []

    def note(name: str) -> None:
        ran.append((name, trio.current_time()))

    start = trio.current_time()
    calls.call_later(note, "a")  # due at 0.5: the task wakes at 0.75
    await trio.sleep(0.2)
    calls.call_later(note, "b")  # due at 0.7: by then
    await trio.sleep(0.1)
    calls.call_later(note, "c")  # due at 0.8: not yet at 0.75; the next wake-up is at 1.05
    await trio.sleep(0.5)
    assert ran == [("a", start + 0.75), ("b", start + 0.75)]
    await trio.sleep(0.5)
    assert ran[2:] == [("c", start + 1.05)]
    assert len(calls) == 0


def test_a_negative_slack_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        DelayedCalls(0.5, slack_s=-0.1)
    assert str(err.value) == "slack_s must not be negative, got -0.1"


async def test_closing_drops_the_queued_calls_and_ends_the_task(autojump_clock: trio.abc.Clock) -> None:
    calls = DelayedCalls(0.5, slack_s=0.25)
    ran: list[int] = []
    calls.call_later(ran.append, 1)
    await calls.aclose()
    assert not calls._running and len(calls) == 0
    await trio.sleep(1.0)
    assert ran == []
    await calls.aclose()  # again, with nothing running: returns at once
    calls.call_later(ran.append, 2)  # usable again
    await trio.sleep(1.0)
    assert ran == [2]
