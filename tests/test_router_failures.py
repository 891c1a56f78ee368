"""Failure handling, exactly as the seed specifies (issue rule 5)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from narwhal.config import EngineTimeouts, FaultSpec, HandoffConfig
from narwhal.engines.stream import SILENCE_SLACK
from narwhal.errors import EngineUnavailable

from .routerkit import engine, fleet_doc, open_stack, scripted_decodes

BODY = {"prompt": "one two three four", "max_tokens": 6}
PREFILL_S = 0.010 + 1e-4 * 4
STEP_S = 0.005
# The shipped defaults, which these tests run under unless they are about a setting.
FIRST_TOKEN_S = EngineTimeouts().first_token_timeout_s
SILENCE_S = EngineTimeouts().decode_read_timeout_s
HANDOFF_S = HandoffConfig().max_age_s


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
    # The bound runs from the second token's read, and ends it a slack late at most.
    assert elapsed == pytest.approx(PREFILL_S + 2 * STEP_S + 0.5 * (1 + SILENCE_SLACK), abs=1e-6)
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
    # Under the shipped defaults: a slow producer (40 s of header delay) plus a slow
    # transfer (25 s) exceeds the handoff age (60 s) though neither leg alone does, and
    # the first-token budget (30 s) is not spent. The producer answered; the consumer
    # held the rest of the age without a token: the breaker counts it against the
    # consumer, and the journal names the deadline and the engine that held it.
    prefill_s, transfer_s = HANDOFF_S - 20, FIRST_TOKEN_S - 5
    async with open_stack(fleet_doc(recovery={"eject_after": 1})) as stack:
        stack.engine("p0").inject(FaultSpec(kind="delay_headers", on="prefill", delay_s=prefill_s))
        stack.engine("d0").inject(FaultSpec(kind="slow_transfer", on="decode", delay_s=transfer_s))
        t0 = trio.current_time()
        resp = await stack.complete(BODY)
        elapsed = trio.current_time() - t0
        breaker = stack.router.state.breaker
        assert breaker.states["d0"].streak == 1 and breaker.states["d0"].ejected
        assert breaker.states["p0"].streak == 0
    assert resp.status_code == 504
    assert "handoff.max_age_s" in resp.json()["error"]["message"]
    assert elapsed == pytest.approx(HANDOFF_S, abs=1e-6)
    [record] = stack.records
    assert record["terminal_class"] == "handoff_expired"
    [attempt] = record["attempts"]
    assert (attempt["deadline"], attempt["held_by"]) == ("handoff.max_age_s", "d0")


async def test_a_stuck_consumer_is_ejected_under_the_shipped_defaults(autojump_clock: trio.abc.Clock) -> None:
    # A consumer that accepts and never answers: its first-token deadline fires (not the
    # handoff's, which the defaults keep longer) and the breaker counts it.
    async with open_stack(fleet_doc(recovery={"eject_after": 1})) as stack:
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=100.0))
        t0 = trio.current_time()
        resp = await stack.complete(BODY)
        elapsed = trio.current_time() - t0
        st = stack.router.state.breaker.states["d0"]
        assert st.ejected and st.streak == 1 and st.failed_leg == "decode"
    assert resp.status_code == 504
    assert elapsed == pytest.approx(PREFILL_S + FIRST_TOKEN_S, abs=1e-6)
    [record] = stack.records
    assert record["terminal_class"] == "first_token_timeout"
    [attempt] = record["attempts"]
    assert (attempt["deadline"], attempt["held_by"]) == ("engine.first_token_timeout_s", "d0")


SAME_WORKER = {"engines": [engine("both", 8101, ["prefill", "decode"])]}


async def test_same_worker_decode_is_not_cut_by_a_handoff_age(autojump_clock: trio.abc.Clock) -> None:
    # A same-worker decode has no handoff: a slow prefill (40 s) followed by a slow first
    # token (25 s) passes the handoff age (60 s) and still succeeds.
    prefill_s, first_token_s = HANDOFF_S - 20, FIRST_TOKEN_S - 5
    async with open_stack(fleet_doc(**SAME_WORKER)) as stack:
        both = stack.engine("both")
        both.inject(FaultSpec(kind="delay_headers", on="any", delay_s=prefill_s, times=1))  # the prefill
        both.inject(FaultSpec(kind="delay_headers", on="decode", delay_s=first_token_s, times=1))
        resp = await stack.complete(BODY)
    assert resp.status_code == 200, resp.text
    [record] = stack.records
    assert record["terminal_class"] == "ok" and record["attempts"][0]["same_worker"] is True
    assert record["latency_s"] > HANDOFF_S


async def test_same_worker_timeout_names_the_deadline_that_fired(autojump_clock: trio.abc.Clock) -> None:
    prefill_s = HANDOFF_S - 20
    async with open_stack(fleet_doc(**SAME_WORKER)) as stack:
        both = stack.engine("both")
        both.inject(FaultSpec(kind="delay_headers", on="any", delay_s=prefill_s, times=1))  # the prefill
        both.inject(FaultSpec(kind="delay_headers", on="decode", delay_s=1000.0, times=1))
        t0 = trio.current_time()
        resp = await stack.complete(BODY)
        elapsed = trio.current_time() - t0
    assert resp.status_code == 504
    assert "engine.first_token_timeout_s" in resp.json()["error"]["message"]
    # The first-token deadline, from the start of the decode leg: past the handoff age.
    assert elapsed == pytest.approx(prefill_s + PREFILL_S + FIRST_TOKEN_S, abs=1e-6)
    [record] = stack.records
    assert record["terminal_class"] == "first_token_timeout"
    assert record["attempts"][0]["deadline"] == "engine.first_token_timeout_s"


_EVENT = (
    'data: {"id":"cmpl-k","object":"text_completion","created":1,"model":"sim-llama","choices":'
    '[{"index":0,"text":"t","logprobs":null,"finish_reason":%s,"token_ids":[%d]}]}\n\n'
)


def _token(token_id: int, finish: str | None = None) -> bytes:
    return (_EVENT % (json.dumps(finish), token_id)).encode()


@pytest.mark.parametrize(
    "gap",
    [
        # SSE comments (keep-alives) while the engine has no token for 3 x 20 s.
        [(20.0, b": keep-alive\n\n")] * 3,
        # One event arriving in pieces 20 s apart.
        [(20.0, _token(7)[:40]), (20.0, _token(7)[40:])],
    ],
    ids=["keep-alives", "partial-event"],
)
async def test_any_bytes_reset_the_silence_bound(autojump_clock: trio.abc.Clock, gap: list[tuple[float, bytes]]) -> None:
    # Seed: the silence bound (30 s) runs between transport chunks, not whole events.
    steps = [(0.0, _token(5)), *gap, (0.0, _token(6, "length")), (0.0, b"data: [DONE]\n\n")]
    assert sum(d for d, _ in gap) > SILENCE_S
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        status, events = await stack.stream(BODY)
    assert status == 200 and events[-1] == "[DONE]", events
    assert stack.records[0]["terminal_class"] == "ok"


async def test_silence_bound_still_fires_without_any_bytes(autojump_clock: trio.abc.Clock) -> None:
    steps = [(0.0, _token(5)), (SILENCE_S + 1, _token(6, "length")), (0.0, b"data: [DONE]\n\n")]
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        t0 = trio.current_time()
        status, events = await stack.stream(BODY)
        elapsed = trio.current_time() - t0
    assert status == 200 and events[-1]["error"]["type"] == "timeout_error"
    assert elapsed == pytest.approx(PREFILL_S + SILENCE_S, abs=1e-6)
    assert stack.records[0]["attempts"][0]["deadline"] == "engine.decode_read_timeout_s"


async def test_ttft_is_the_last_attempts(autojump_clock: trio.abc.Clock) -> None:
    # Attempt 1 prefills, then its decode fails; attempt 2's prefill fails: the request
    # never had a prefill completion that its answer came from.
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
                    engine("d1", 8103, ["decode"]), recovery={"max_attempts": 2})  # fmt: skip
    async with open_stack(doc) as stack:
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=503, times=1))
        client = stack.router.state.clients["p0"]
        original = client.prefill
        calls = 0

        async def prefill(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise EngineUnavailable("engine p0 unreachable", engine="p0", leg="prefill")
            return await original(*args, **kwargs)

        client.prefill = prefill  # type: ignore[method-assign]
        resp = await stack.complete(BODY)
    assert resp.status_code == 502
    [record] = stack.records
    assert [a["outcome"] for a in record["attempts"]] == ["decode_failed", "prefill_failed"]
    assert record["attempts"][0]["ttft_s"] == pytest.approx(PREFILL_S, abs=1e-6)
    assert record["attempts"][1]["ttft_s"] is None
    assert record["ttft_s"] is None


async def test_no_retry_without_time_for_a_first_token(autojump_clock: trio.abc.Clock) -> None:
    # The first attempt spends 30 s (its first-token deadline) of a 40 s request: the
    # 10 s left cannot reach a first token, so no second attempt is started.
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
                    engine("d1", 8103, ["decode"]), recovery={"max_attempts": 3},
                    engine={"request_timeout_s": FIRST_TOKEN_S + 10})  # fmt: skip
    async with open_stack(doc) as stack:
        for name in ("d0", "d1"):
            stack.engine(name).inject(FaultSpec(kind="delay_headers", on="decode", delay_s=1000.0))
        resp = await stack.complete(BODY)
    assert resp.status_code == 504
    [record] = stack.records
    assert record["terminal_class"] == "first_token_timeout"
    assert len(record["attempts"]) == 1


@pytest.mark.parametrize(("leg", "holder"), [("prefill", "p0"), ("decode", "d0")])
async def test_request_deadline(autojump_clock: trio.abc.Clock, leg: str, holder: str) -> None:
    doc = fleet_doc(engine={"request_timeout_s": 1.0})
    async with open_stack(doc) as stack:
        stack.engine(holder).inject(FaultSpec(kind="delay_headers", on=leg, delay_s=10.0))  # type: ignore[arg-type]
        t0 = trio.current_time()
        resp = await stack.complete(BODY)
        assert trio.current_time() - t0 == pytest.approx(1.0, abs=1e-6)
    assert resp.status_code == 504
    [record] = stack.records
    message = "request deadline exceeded (engine.request_timeout_s)"
    assert resp.json()["error"]["message"] == message
    assert (record["terminal_class"], record["error"]) == ("deadline_exceeded", message)
    # The attempt in flight when the request deadline fired, and the engine holding it.
    [attempt] = record["attempts"]
    assert attempt["outcome"] == "deadline_exceeded"
    assert (attempt["deadline"], attempt["held_by"]) == ("engine.request_timeout_s", holder)
