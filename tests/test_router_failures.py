"""Failure handling, exactly as the seed specifies (issue rule 5)."""

from __future__ import annotations

import pytest
import trio

from narwhal.config import FaultSpec

from .routerkit import fleet_doc, open_stack

BODY = {"prompt": "one two three four", "max_tokens": 6}
PREFILL_S = 0.010 + 1e-4 * 4
STEP_S = 0.005


async def _both_modes(doc: dict | None, fault: FaultSpec, engine_name: str) -> tuple[tuple[int, list], object, list]:
    async with open_stack(doc) as stack:
        stack.engine(engine_name).inject(fault)
        streamed = await stack.stream(BODY)
        plain = await stack.complete(BODY)
    return streamed, plain, stack.records


@pytest.mark.parametrize(
    ("fault", "status", "klass"),
    [
        (FaultSpec(kind="http_error", on="prefill", status=500), 502, "prefill_failed"),
        (FaultSpec(kind="http_error", on="prefill", status=503), 502, "prefill_failed"),
        (FaultSpec(kind="refuse_connection"), 502, "prefill_failed"),
        (FaultSpec(kind="malformed_descriptor", variant="missing_engine_id"), 502, "invalid_descriptor"),
        (FaultSpec(kind="malformed_descriptor", variant="bad_block_ids"), 502, "invalid_descriptor"),
        (FaultSpec(kind="malformed_descriptor", variant="wrong_endpoint"), 502, "invalid_descriptor"),
    ],
)
async def test_prefill_failures_are_ordinary_http_errors(
    autojump_clock: trio.abc.Clock, fault: FaultSpec, status: int, klass: str
) -> None:
    (s_status, s_events), plain, records = await _both_modes(None, fault, "p0")
    assert s_status == status
    assert plain.status_code == status  # type: ignore[attr-defined]
    assert "error" in s_events[0]
    assert [r["terminal_class"] for r in records] == [klass, klass]
    assert all(r["status"] == status for r in records)


async def test_invalid_descriptor_never_reaches_the_consumer(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        stack.engine("p0").inject(FaultSpec(kind="malformed_descriptor", variant="wrong_endpoint"))
        resp = await stack.complete(BODY)
        assert resp.status_code == 502
        assert "endpoint mismatch" in resp.json()["error"]["message"]
        assert [b for b in stack.engine("d0").requests_seen if "prompt" in b] == []


async def test_stream_closed_before_done_after_tokens_gives_terminal_event(autojump_clock: trio.abc.Clock) -> None:
    (status, events), plain, records = await _both_modes(
        None, FaultSpec(kind="close_before_done", on="decode", after_tokens=2), "d0"
    )
    assert status == 200
    assert "error" in events[-1] and "[DONE]" not in events
    assert len([e for e in events if "choices" in e]) == 2
    assert events[-1]["error"]["type"] == "engine_error" and events[-1]["error"]["code"] is None
    assert plain.status_code == 502  # type: ignore[attr-defined]
    assert [r["terminal_class"] for r in records] == ["decode_failed", "decode_failed"]
    assert records[0]["status"] == 200 and records[0]["output_len"] == 2


async def test_done_before_any_token_is_502_with_exact_detail(autojump_clock: trio.abc.Clock) -> None:
    (status, events), plain, records = await _both_modes(
        None, FaultSpec(kind="done_before_token", on="decode"), "d0"
    )
    assert status == 502
    assert events[0]["error"]["message"] == "stream ended with [DONE] before any token arrived"
    assert plain.status_code == 502  # type: ignore[attr-defined]
    assert plain.json()["error"]["message"] == "stream ended with [DONE] before any token arrived"  # type: ignore[attr-defined]
    assert [r["terminal_class"] for r in records] == ["decode_failed", "decode_failed"]


async def test_error_object_in_200_stream_keeps_its_status(autojump_clock: trio.abc.Clock) -> None:
    (status, events), plain, _records = await _both_modes(
        None, FaultSpec(kind="error_in_stream", on="decode", status=429, message="slow down"), "d0"
    )
    assert status == 429
    assert plain.status_code == 429  # type: ignore[attr-defined]
    assert "slow down" in events[0]["error"]["message"]
    async with open_stack() as stack:
        stack.engine("d0").inject(FaultSpec(kind="error_in_stream", on="decode", after_tokens=3, status=400))
        status, events = await stack.stream(BODY)
    assert status == 200
    assert events[-1]["error"]["type"] == "engine_error" and events[-1]["error"]["code"] is None


async def test_first_token_timeout_counts_connect_and_headers(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine={"first_token_timeout_s": 1.5})
    async with open_stack(doc) as stack:
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=10.0))
        t0 = trio.current_time()
        resp = await stack.complete(BODY)
        elapsed = trio.current_time() - t0
    assert resp.status_code == 504
    # The budget starts before the decode stream is opened, right after the prefill leg.
    assert elapsed == pytest.approx(PREFILL_S + 1.5, abs=1e-6)
    assert stack.records[0]["terminal_class"] == "first_token_timeout"


async def test_silence_between_tokens(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine={"decode_read_timeout_s": 0.5})
    async with open_stack(doc) as stack:
        stack.engine("d0").inject(FaultSpec(kind="silence_after", on="decode", after_tokens=2, times=1))
        status, events = await stack.stream(BODY)
        stack.engine("d0").inject(FaultSpec(kind="silence_after", on="decode", after_tokens=2, times=1))
        t0 = trio.current_time()
        resp = await stack.complete(BODY)
        elapsed = trio.current_time() - t0
    assert status == 200
    assert events[-1]["error"]["message"].startswith("engine went silent between tokens")
    assert events[-1]["error"]["type"] == "timeout_error" and events[-1]["error"]["code"] is None
    assert resp.status_code == 504
    assert resp.json()["error"]["message"].startswith("engine went silent between tokens")
    assert elapsed == pytest.approx(PREFILL_S + 2 * STEP_S + 0.5, abs=1e-6)
    assert [r["terminal_class"] for r in stack.records] == ["silence_timeout", "silence_timeout"]


async def test_zero_read_timeout_leaves_the_request_deadline(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine={"decode_read_timeout_s": 0.0, "request_timeout_s": 20.0})
    async with open_stack(doc) as stack:
        stack.engine("d0").inject(FaultSpec(kind="silence_after", on="decode", after_tokens=1))
        t0 = trio.current_time()
        status, events = await stack.stream(BODY)
        elapsed = trio.current_time() - t0
    assert status == 200
    assert elapsed == pytest.approx(20.0, abs=1e-6)
    assert events[-1]["error"]["type"] == "timeout_error" and events[-1]["error"]["code"] is None
    assert stack.records[0]["terminal_class"] == "deadline_exceeded"


async def test_handoff_age_starts_with_the_producer_leg(autojump_clock: trio.abc.Clock) -> None:
    # A slow producer (2 s of header delay) plus a slow transfer (2 s) exceeds a 3 s handoff
    # age even though neither leg alone does, and the first-token budget (5 s) is not spent.
    doc = fleet_doc(handoff={"max_age_s": 3.0})
    async with open_stack(doc) as stack:
        stack.engine("p0").inject(FaultSpec(kind="delay_headers", on="prefill", delay_s=2.0))
        stack.engine("d0").inject(FaultSpec(kind="slow_transfer", on="decode", delay_s=2.0))
        t0 = trio.current_time()
        resp = await stack.complete(BODY)
        elapsed = trio.current_time() - t0
    assert resp.status_code == 504
    assert elapsed == pytest.approx(3.0, abs=1e-6)
    assert stack.records[0]["terminal_class"] == "handoff_expired"


async def test_request_deadline(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine={"request_timeout_s": 1.0, "first_token_timeout_s": 5.0})
    async with open_stack(doc) as stack:
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=10.0))
        resp = await stack.complete(BODY)
    assert resp.status_code == 504
    assert stack.records[0]["terminal_class"] == "deadline_exceeded"
