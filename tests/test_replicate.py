"""PrefixReplicator: the background copies of a busy prefix, against stand-ins for the
router's state and priced placement (the end-to-end case is in test_prefix_replication)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from narwhal.errors import EngineError
from narwhal.router.replicate import PrefixReplicator


class _Producer:
    """A producer client: its prefill takes ``delay_s``, then answers or fails."""

    def __init__(self, delay_s: float = 0.1, fail: str | None = None) -> None:
        self.delay_s, self.fail = delay_s, fail
        self.calls: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def prefill(self, body: dict[str, Any], **kwargs: Any) -> None:
        self.calls.append((body, kwargs))
        await trio.sleep(self.delay_s)
        if self.fail is not None:
            raise EngineError(self.fail)


class _Placement:
    def __init__(self) -> None:
        self.replicate: Any = None
        self.released: list[tuple[str, float]] = []

    def copied(self, producer: str, work_s: float) -> None:
        self.released.append((producer, work_s))


class _Hold:
    def __init__(self, prefix: _Prefix, engine: str, ids: list[int]) -> None:
        self.prefix, self.engine, self.ids = prefix, engine, ids

    def release(self) -> None:
        self.prefix.released.append((self.engine, self.ids))


class _Prefix:
    """The index: a copy's blocks are held while it runs (the engine takes them when it
    schedules the copy), then released, cached."""

    def __init__(self) -> None:
        self.held: list[tuple[str, list[int], int]] = []
        self.released: list[tuple[str, list[int]]] = []

    def hold(self, engine: str, ids: list[int], extra_tokens: int) -> _Hold:
        self.held.append((engine, ids, extra_tokens))
        return _Hold(self, engine, ids)


def _setup(**clients: _Producer) -> tuple[PrefixReplicator, Any, _Placement]:
    state = SimpleNamespace(
        clients=clients, prefix=_Prefix(), in_flight_by_engine={"p0": 2},
        config=SimpleNamespace(engine=SimpleNamespace(first_token_timeout_s=5.0)),
    )  # fmt: skip
    placement = _Placement()
    return PrefixReplicator(state, placement), state, placement  # type: ignore[arg-type]


async def test_a_copy_prefills_the_ids_once_and_the_producer_learns_them(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    p0, p1 = _Producer(), _Producer()
    rep, state, placement = _setup(p0=p0, p1=p1)
    assert rep.counts == {"started": 0, "done": 0, "failed": 0}
    with caplog.at_level(logging.INFO, logger="narwhal.router.replicate"):
        async with trio.open_nursery() as nursery:
            await nursery.start(rep.run)
            assert placement.replicate == rep.submit
            assert rep.submit("p0", (1, 2, 3), "m", 0.25) is True
            await trio.sleep(0.05)
            assert state.in_flight_by_engine == {"p0": 3}  # the copy is one of our legs there
            assert state.prefix.held == [("p0", [1, 2, 3], 1)] and state.prefix.released == []
            assert rep.submit("p1", [4, 5], None, 0.5) is True  # p1 is not in the table yet
            await trio.sleep(0.01)
            assert state.in_flight_by_engine == {"p0": 3, "p1": 1}
            await trio.sleep(1.0)
            nursery.cancel_scope.cancel()
    assert placement.replicate is None  # stopped: placement asks for no more copies
    assert p0.calls == [({"prompt": [1, 2, 3], "model": "m"},
                         {"request_id": "narwhal-replicate-1", "leg": "replicate", "transfer": False})]  # fmt: skip
    assert p1.calls == [({"prompt": [4, 5]}, {"request_id": "narwhal-replicate-2", "leg": "replicate", "transfer": False})]
    assert state.prefix.released == [("p0", [1, 2, 3]), ("p1", [4, 5])]
    assert placement.released == [("p0", 0.25), ("p1", 0.5)]
    assert state.in_flight_by_engine == {"p0": 2, "p1": 0}
    assert rep.counts == {"started": 2, "done": 2, "failed": 0}
    assert [r.getMessage() for r in caplog.records] == [
        "copied a 3-token prefix to p0 (narwhal-replicate-1)",
        "copied a 2-token prefix to p1 (narwhal-replicate-2)",
    ]


async def test_no_copy_starts_when_stopped_for_an_unknown_producer_or_no_ids(autojump_clock: trio.abc.Clock) -> None:
    p0 = _Producer()
    rep, _, placement = _setup(p0=p0)
    assert rep.submit("p0", [1], None, 0.1) is False  # not running
    async with trio.open_nursery() as nursery:
        await nursery.start(rep.run)
        assert rep.submit("gone", [1], None, 0.1) is False
        assert rep.submit("p0", [], None, 0.1) is False
        nursery.cancel_scope.cancel()
    assert rep.submit("p0", [1], None, 0.1) is False  # stopped again
    assert p0.calls == [] and rep.counts["started"] == 0 and placement.released == []


@pytest.mark.parametrize(
    ("producer", "message"),
    [
        (_Producer(fail="HTTP 500 from p0"), "copying a 2-token prefix to p0 failed: HTTP 500 from p0"),
        (_Producer(delay_s=60.0), "copying a 2-token prefix to p0 timed out"),
    ],
)
async def test_a_failed_or_timed_out_copy_releases_its_work_and_its_blocks(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, producer: _Producer, message: str
) -> None:
    rep, state, placement = _setup(p0=producer)
    with caplog.at_level(logging.INFO, logger="narwhal.router.replicate"):
        async with trio.open_nursery() as nursery:
            await nursery.start(rep.run)
            rep.submit("p0", [7, 8], None, 0.3)
            rep.submit("p0", [9, 10], None, 0.2)
            await trio.sleep(4.9)
            assert placement.released == [] or producer.fail is not None  # bounded by the first-token timeout (5 s)
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
    assert sorted(state.prefix.released) == [("p0", [7, 8]), ("p0", [9, 10])]  # scheduled, then let go
    assert sorted(placement.released) == [("p0", 0.2), ("p0", 0.3)] and state.in_flight_by_engine == {"p0": 2}
    assert rep.counts == {"started": 2, "done": 0, "failed": 2}
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, message)] * 2


async def test_a_producer_that_left_the_in_flight_table_is_not_counted_back(autojump_clock: trio.abc.Clock) -> None:
    rep, state, placement = _setup(p0=_Producer())
    async with trio.open_nursery() as nursery:
        await nursery.start(rep.run)
        rep.submit("p0", [1, 2], None, 0.1)
        await trio.sleep(0.05)
        del state.in_flight_by_engine["p0"]  # the engine left the fleet meanwhile
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert state.in_flight_by_engine == {} and placement.released == [("p0", 0.1)]


async def test_stopping_cancels_the_copies_in_flight(autojump_clock: trio.abc.Clock) -> None:
    rep, state, placement = _setup(p0=_Producer(delay_s=3.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(rep.run)
        rep.submit("p0", [1, 2], None, 0.1)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert placement.released == [("p0", 0.1)] and state.in_flight_by_engine == {"p0": 2}
    assert rep.counts == {"started": 1, "done": 0, "failed": 0} and state.prefix.released == [("p0", [1, 2])]
