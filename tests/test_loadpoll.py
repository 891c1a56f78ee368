"""The engine-load poll (several routers sharing a fleet): what each period reports to
placement, how a failing or slow ``/metrics`` ages out, and what the operator reads."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from narwhal.errors import EngineError, EngineProtocolError
from narwhal.router.loadpoll import STALE_AFTER_PERIODS, poll_engine_load
from narwhal.router.placement import Placement


class _Engine:
    """An engine client whose /metrics answers ``answers`` times (after ``delay_s``), then
    fails (or hangs, with ``hang``; or answers with metrics it cannot use, with
    ``unusable``)."""

    def __init__(self, running: float, waiting: float = 0, answers: int = 10**6, *, delay_s: float = 0.0,
                 hang: bool = False, unusable: bool = False) -> None:  # fmt: skip
        self.running, self.waiting, self.answers = running, waiting, answers
        self.delay_s, self.hang, self.unusable = delay_s, hang, unusable
        self.calls = 0

    async def load(self) -> Any:
        self.calls += 1
        await trio.sleep(self.delay_s)
        if self.answers <= 0:
            if self.hang:
                await trio.sleep_forever()
            if self.unusable:
                raise EngineProtocolError("unusable metrics: vllm:num_requests_running is inf")
            raise EngineError("metrics: connection refused")
        self.answers -= 1
        return SimpleNamespace(running=self.running, waiting=self.waiting)


def _state(clients: dict[str, Any], **in_flight: int) -> Any:
    return SimpleNamespace(
        placement=Placement(["p0"], ["d0"]), engines=dict.fromkeys(["p0", "d0"]), clients=clients,
        in_flight_by_engine=in_flight,
    )  # fmt: skip


def _report(state: Any, name: str) -> tuple[int, int, int]:
    load = state.placement.loads[name]
    return load.engine_running, load.engine_waiting, load.engine_own


async def test_each_period_reports_running_waiting_and_this_routers_own_legs(autojump_clock: trio.abc.Clock) -> None:
    # p0 reports 3.0 running and 2.0 waiting (gauges are floats on the wire), one of them
    # this router's; d0 is not in the in-flight table: none of its legs are ours.
    p0, d0 = _Engine(3.0, 2.0), _Engine(4, 1)
    state = _state({"p0": p0, "d0": d0}, p0=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(poll_engine_load, state, 1.0)
        await trio.sleep(0.5)
        assert _report(state, "p0") == (3, 2, 1) and type(_report(state, "p0")[0]) is int
        assert _report(state, "d0") == (4, 1, 0)
        assert state.placement.loads["p0"].others == 4
        await trio.sleep(2.0)
        assert (p0.calls, d0.calls) == (3, 3)  # at 0, 1 and 2 s
        nursery.cancel_scope.cancel()


async def test_an_engine_without_a_client_is_skipped(autojump_clock: trio.abc.Clock) -> None:
    state = _state({"d0": _Engine(2)})  # p0 is known, its client not (yet)
    async with trio.open_nursery() as nursery:
        await nursery.start(poll_engine_load, state, 1.0)
        await trio.sleep(0.5)
        assert _report(state, "d0") == (2, 0, 0) and _report(state, "p0") == (0, 0, 0)
        nursery.cancel_scope.cancel()


async def test_a_report_that_stops_coming_is_dropped_after_three_periods(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # d0 answers at 0 and 1 s, then fails: its report stands until three periods after
    # the last one (4 s), then is dropped once, with one warning. p0 never answers: it
    # has no report to drop and no warning.
    state = _state({"p0": _Engine(0, answers=0), "d0": _Engine(4, answers=2)}, d0=1)
    with caplog.at_level(logging.DEBUG, logger="narwhal.router.loadpoll"):
        async with trio.open_nursery() as nursery:
            await nursery.start(poll_engine_load, state, 1.0)
            await trio.sleep(1.5)
            assert state.placement.loads["d0"].others == 3  # four running, one of them ours
            await trio.sleep(STALE_AFTER_PERIODS - 1)  # 3.5 s: the failures at 2 and 3 s
            assert state.placement.loads["d0"].others == 3
            await trio.sleep(1.0)  # 4.5 s
            assert _report(state, "d0") == (0, 0, 0)
            await trio.sleep(5.0)
            nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["engine d0: no load report for 3 periods; other routers' load on it is not counted"]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert debug[0] == "engine p0 metrics unavailable: metrics: connection refused"


async def test_a_metrics_answer_slower_than_the_period_counts_as_none(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # d0 answers once, then hangs: each poll gives up after a period, and its report is
    # dropped as a failing one's is.
    d0 = _Engine(5, answers=1, hang=True)
    state = _state({"p0": _Engine(0), "d0": d0})
    with caplog.at_level(logging.WARNING, logger="narwhal.router.loadpoll"):
        async with trio.open_nursery() as nursery:
            await nursery.start(poll_engine_load, state, 1.0)
            await trio.sleep(0.5)
            assert _report(state, "d0") == (5, 0, 0)
            await trio.sleep(6.0)
            assert _report(state, "d0") == (0, 0, 0)
            nursery.cancel_scope.cancel()
    assert len(caplog.records) == 1
    assert d0.calls == 4  # 0 s, then one each 2 s (a period waited out, then the sleep)


async def test_an_engine_that_left_the_fleet_is_forgotten(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # d0 reports, leaves the fleet for longer than the grace, and comes back with its
    # /metrics failing: its old report's age is not held against it on return.
    d0 = _Engine(2, answers=1)
    state = _state({"p0": _Engine(0), "d0": d0})
    with caplog.at_level(logging.WARNING, logger="narwhal.router.loadpoll"):
        async with trio.open_nursery() as nursery:
            await nursery.start(poll_engine_load, state, 1.0)
            await trio.sleep(0.5)
            del state.engines["d0"]
            await trio.sleep(5.0)
            state.engines["d0"] = None
            await trio.sleep(1.0)
            assert d0.calls == 2
            nursery.cancel_scope.cancel()
    assert caplog.records == []


async def test_the_grace_is_three_periods_of_the_configured_length(autojump_clock: trio.abc.Clock) -> None:
    # A half-second period: d0's last report (at 0.5 s) is dropped at 2 s, not later.
    state = _state({"p0": _Engine(0), "d0": _Engine(6, answers=2)})
    async with trio.open_nursery() as nursery:
        await nursery.start(poll_engine_load, state, 0.5)
        await trio.sleep(1.75)
        assert _report(state, "d0") == (6, 0, 0)
        await trio.sleep(0.5)  # 2.25 s
        assert _report(state, "d0") == (0, 0, 0)
        nursery.cancel_scope.cancel()


async def test_a_report_the_engine_cannot_back_with_usable_metrics_is_dropped_at_once(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # d0 reports at 0 s, then answers with metrics it cannot use (+Inf running): its report
    # is dropped at the first such answer (1 s), not three periods later, with no warning
    # of the poll's own (the client counted and logged the fault). Sound again at 3 s.
    # p0's are unusable from the first: there is no report to drop.
    d0 = _Engine(4, answers=1, unusable=True)
    state = _state({"p0": _Engine(3, answers=0, unusable=True), "d0": d0})
    with caplog.at_level(logging.DEBUG, logger="narwhal.router.loadpoll"):
        async with trio.open_nursery() as nursery:
            await nursery.start(poll_engine_load, state, 1.0)
            await trio.sleep(0.5)
            assert _report(state, "d0") == (4, 0, 0)
            await trio.sleep(1.0)
            assert _report(state, "d0") == (0, 0, 0)
            d0.answers = 10
            await trio.sleep(2.0)
            assert _report(state, "d0") == (4, 0, 0) and _report(state, "p0") == (0, 0, 0)
            nursery.cancel_scope.cancel()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG] * len(caplog.records)
    assert "engine d0 metrics unusable: unusable metrics: vllm:num_requests_running is inf" in [
        r.getMessage() for r in caplog.records
    ]
