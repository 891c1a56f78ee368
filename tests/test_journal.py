"""The journal writer's rules: every record reaches the file (and the listeners) whole,
in order, batched, never blocking the request path, and is flushed and fsynced."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing

from narwhal.router.journal import TERMINAL_CLASSES, AttemptRecord, Journal, RequestRecord


def _record(i: int, terminal_class: str = "ok") -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", arrival=float(i), route="completions", terminal_class=terminal_class)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _written(journal: Journal, n: int) -> int:
    """``journal.written`` once it reaches ``n`` (or after a few real seconds), without
    letting virtual time pass: the writer's file I/O runs in a worker thread, which the
    virtual clock does not wait for."""
    give_up = time.monotonic() + 5.0
    while journal.written < n and time.monotonic() < give_up:
        await trio.lowlevel.checkpoint()
    return journal.written


def test_the_closed_set_of_terminal_classes() -> None:
    # The measurement contract's classes: a record carries one of these and nothing else.
    assert TERMINAL_CLASSES == {
        "ok", "refused", "rate_limited", "no_engine", "invalid_request", "client_cancelled", "prefill_failed", "decode_failed",
        "first_token_timeout", "silence_timeout", "handoff_expired", "invalid_descriptor",
        "deadline_exceeded", "shutdown", "router_overloaded", "internal_error",
    }  # fmt: skip


def test_a_record_line_carries_every_field_and_every_attempt() -> None:
    attempt = AttemptRecord(
        n=1, producer="p0", consumer="d0", prefill_request_id="a", decode_request_id="b", outcome="ok",
        ttft_s=0.1, placement_wait_s=0.2, predicted_ttft_s=0.3, predicted_tpot_s=0.01, deadline="x",
        held_by="d0", predicted_cached_tokens=4, cached_tokens=5, consumer_predicted_cached_tokens=6,
        consumer_cached_tokens=7, started_s=0.01, first_token_s=0.2, output_tokens=3, resume="stream_closed",
        resumed_at_s=0.15, not_resumed="x", placement={"rule": "owner"},
    )  # fmt: skip
    record = RequestRecord(
        request_id="r", arrival=1.5, route="chat", model="m", stream=True, prompt_tokens=9,
        requested_output_len=10, output_len=8, ttft_s=0.1, first_byte_s=0.15, tpot_s=0.01, latency_s=0.3,
        status=200, terminal_class="ok", producer="p0", consumer="d0",
        attempts=[attempt, AttemptRecord(n=2)], error="e", trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
    )  # fmt: skip
    line = record.to_json()
    assert line == {**attrs.asdict(record, recurse=False), "attempts": [attrs.asdict(attempt), attrs.asdict(AttemptRecord(n=2))]}
    assert list(line) == [f.name for f in attrs.fields(RequestRecord)]
    # The defaults of an attempt not yet run, and of a record nothing filled in.
    assert line["attempts"][1] == {
        "n": 2, "producer": None, "consumer": None, "same_worker": False, "prefill_request_id": None,
        "decode_request_id": None, "outcome": "pending", "error": None, "ttft_s": None, "placement_wait_s": 0.0,
        "predicted_ttft_s": None, "predicted_tpot_s": None, "deadline": None, "held_by": None,
        "predicted_cached_tokens": None, "cached_tokens": None, "consumer_predicted_cached_tokens": None,
        "consumer_cached_tokens": None, "started_s": None, "first_token_s": None, "output_tokens": 0,
        "resume": None, "resumed_at_s": None, "not_resumed": None, "placement": None,
    }  # fmt: skip
    bare = RequestRecord(request_id="r", arrival=0.0, route="completions")
    assert bare.to_json() == {
        "request_id": "r", "arrival": 0.0, "route": "completions", "model": None, "stream": False,
        "prompt_tokens": None, "requested_output_len": None, "output_len": 0, "ttft_s": None,
        "first_byte_s": None, "tpot_s": None, "latency_s": None, "status": 0, "terminal_class": "internal_error",
        "producer": None, "consumer": None, "attempts": [], "error": None, "trace_id": None,
        "tenant": None, "latency_class": None, "queued_s": 0.0, "queue_reason": None,
    }  # fmt: skip
    assert bare.attempts is not RequestRecord(request_id="s", arrival=0.0, route="completions").attempts


def test_a_placement_left_as_a_function_is_written_as_what_it_returns() -> None:
    # Priced placement words its explanation when the record is written, not on the
    # request's path: the line has the object, worded then.
    worded: list[int] = []

    def explanation() -> dict[str, Any]:
        worded.append(1)
        return {"rule": "owner", "others": {"p1": "TTFT 612.0 ms over the target"}}

    record = RequestRecord(request_id="r", arrival=0.0, route="completions",
                           attempts=[AttemptRecord(n=1, placement=explanation), AttemptRecord(n=2)])  # fmt: skip
    assert not worded
    line = record.to_json()
    assert line["attempts"][0]["placement"] == {"rule": "owner", "others": {"p1": "TTFT 612.0 ms over the target"}}
    assert line["attempts"][1]["placement"] is None and worded == [1]
    json.dumps(line)


def test_an_unknown_class_and_a_closed_journal_are_refused_and_not_counted() -> None:
    journal = Journal(None)
    with pytest.raises(ValueError, match=r"^unknown terminal class 'weird'$"):
        journal.record(_record(0, "weird"))
    assert journal.records == 0

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            await journal.aclose()
        with pytest.raises(RuntimeError, match=r"^journal is closed$"):
            journal.record(_record(1))
        assert journal.records == 0
        await journal.aclose()  # a second close returns at once

    trio.run(main)


async def test_listeners_see_each_record_as_it_is_journaled() -> None:
    journal = Journal(None)
    first: list[dict[str, Any]] = []
    second: list[dict[str, Any]] = []
    journal.add_listener(first.append)
    journal.add_listener(second.append)
    journal.record(_record(0))
    assert [r["request_id"] for r in first] == ["r0"] and first == second
    journal.remove_listener(first.append)
    journal.record(_record(1))
    assert [r["request_id"] for r in first] == ["r0"]
    assert [r["request_id"] for r in second] == ["r0", "r1"]
    assert journal.records == 2


async def test_lines_are_appended_in_order_and_batched(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    path = tmp_path / "runs" / "deep" / "journal.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"request_id": "earlier"}\n')  # a restarted router appends
    journal = Journal(path, batch_window_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.record(_record(0))
        await trio.sleep(0.5)
        journal.record(_record(1))
        # Within the batch window nothing is written yet; after it, both at once.
        await trio.sleep(0.4)
        assert journal.written == 0 and len(_lines(path)) == 1
        await trio.sleep(0.2)
        assert await _written(journal, 2) == 2
        assert [r["request_id"] for r in _lines(path)] == ["earlier", "r0", "r1"]  # flushed, not held in a buffer
        journal.record(_record(2))
        await trio.sleep(1.1)
        assert await _written(journal, 3) == 3 and len(_lines(path)) == 4
        await journal.aclose()
    assert [r["request_id"] for r in _lines(path)] == ["earlier", "r0", "r1", "r2"]
    assert _lines(path)[1] == _record(0).to_json()


async def test_the_writer_creates_the_journal_directory(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    path = tmp_path / "runs" / "deep" / "journal.jsonl"
    journal = Journal(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.record(_record(0))
        await journal.aclose()
    assert [r["request_id"] for r in _lines(path)] == ["r0"]
    assert journal.written == 1


async def test_the_default_batch_window_is_short(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.record(_record(0))
        await trio.sleep(0.049)
        assert journal.written == 0
        await trio.sleep(0.002)
        assert await _written(journal, 1) == 1 and len(_lines(path)) == 1
        await journal.aclose()


async def test_close_drains_without_waiting_a_batch_window(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, batch_window_s=100.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        await journal.aclose()
        # Closed while the writer waited for a record: nothing to wait for.
        assert trio.current_time() == t0
        assert journal.written == 0 and path.read_text() == ""


async def test_records_queued_at_close_are_written_at_once(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, batch_window_s=100.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.record(_record(0))
        await trio.sleep(1.0)  # the writer holds r0 for its window
        journal.record(_record(1))
        await journal.aclose()
    assert [r["request_id"] for r in _lines(path)] == ["r0", "r1"]
    assert journal.written == 2


async def test_a_burst_overflows_into_the_list_and_nothing_is_lost(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, queue_size=3, batch_window_s=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(10):
            journal.record(_record(i))
        # The waiting writer took the first, the channel holds three, six overflowed.
        assert (journal.records, journal.overflowed) == (10, 6)
        await trio.sleep(1.0)
        # The channel's, then the overflow, in the order they came.
        assert await _written(journal, 10) == 10
        assert [r["request_id"] for r in _lines(path)] == [f"r{i}" for i in range(10)]
        await journal.aclose()
    assert journal.overflowed == 6


async def test_records_that_overflow_during_a_write_keep_their_order(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, queue_size=1, batch_window_s=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await trio.testing.wait_all_tasks_blocked()
        journal.record(_record(0))  # to the waiting writer
        journal.record(_record(1))  # into the channel
        await trio.sleep(0.5)
        # The writer took the channel's record after its window and is writing the batch
        # (its file I/O in a worker thread): a burst now fills the channel and overflows.
        while journal._receive.statistics().current_buffer_used:
            await trio.lowlevel.checkpoint()
        assert journal.written == 0
        for i in range(2, 5):
            journal.record(_record(i))
        assert journal.overflowed == 2
        assert await _written(journal, 2) == 2
        await trio.sleep(1.0)
        assert await _written(journal, 5) == 5
        await journal.aclose()
    assert [r["request_id"] for r in _lines(path)] == [f"r{i}" for i in range(5)]


async def test_overflow_left_when_the_channel_closes_is_written(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, queue_size=1, batch_window_s=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await trio.testing.wait_all_tasks_blocked()
        journal.record(_record(0))
        journal.record(_record(1))  # overflows
        journal.record(_record(2))
        t0 = trio.current_time()
        await journal.aclose()
        assert trio.current_time() == t0  # closed: the writer takes what is left at once
    assert [r["request_id"] for r in _lines(path)] == ["r0", "r1", "r2"]
    assert journal.written == 3


async def test_no_path_writes_no_file_but_counts(
    autojump_clock: trio.abc.Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    journal = Journal(None)
    assert journal.path is None
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.record(_record(0))
        await journal.aclose()
    assert journal.written == 1 and os.listdir(tmp_path) == []


@pytest.mark.parametrize("fsync", [True, False])
async def test_fsync_is_each_batch_when_asked(
    autojump_clock: trio.abc.Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, fsync=fsync)
    assert Journal(path).fsync is True
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.record(_record(0))
        await trio.sleep(1.0)
        # The batch is on disk before the router closes the journal (a crash keeps it).
        assert await _written(journal, 1) == 1
        assert len(synced) == (1 if fsync else 0)
        await journal.aclose()
    assert len(synced) == (1 if fsync else 0)
    assert len(_lines(path)) == 1


async def test_the_default_channel_holds_ten_thousand_records() -> None:
    journal = Journal(None)
    for i in range(10001):
        journal.record(_record(i))
    assert journal.overflowed == 1


def _open_files(path: Path) -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
async def test_a_cancelled_writer_still_closes_its_file(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        assert _open_files(path) == 1
        journal.record(_record(0))
        assert await _written(journal, 0) == 0
        nursery.cancel_scope.cancel()  # the writer waits out its window: cancelled there
    assert _open_files(path) == 0
