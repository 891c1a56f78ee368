"""The request lifecycle's rules, field by field: what the journal records of each
attempt, whom the breaker blames, which deadline an error names, when a retry is
allowed, what a burst of events becomes on the wire, and the answer's headers.

The other router tests run whole scenarios; these pin down the values they leave
unchecked (see tools/mutation.py). Every test starts its requests at a virtual time
far from zero, so that a time measured from the wrong origin shows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal.config import FaultSpec
from narwhal.errors import (
    BadRequest,
    DeadlineExceeded,
    EngineUnavailable,
    NarwhalError,
    NoEngine,
    Refused,
)
from narwhal.router.lifecycle import terminal_class_for
from narwhal.router.placement import Placement, Reservation

from .loadkit import Outcome, read_response, request_bytes
from .routerkit import Stack, engine, fleet_doc, open_stack, scripted_decodes

BODY = {"prompt": "one two three four", "max_tokens": 6}
PREFILL_S = 0.010 + 1e-4 * 4  # routerkit's simulated latency model, 4 prompt tokens
STEP_S = 0.005
START = 1000.0  # the virtual time requests start at


async def _at_start() -> None:
    await trio.sleep(START - trio.current_time())


def two_consumers(**sections: Any) -> dict[str, Any]:
    return fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"]),
        engine("d1", 8103, ["decode"]),
        **sections,
    )


# ------------------------------------------------------------------ terminal classes


def test_terminal_classes_of_router_errors() -> None:
    assert terminal_class_for(Refused("no capacity")) == "refused"
    assert terminal_class_for(NoEngine("no engine available for decode")) == "no_engine"
    assert terminal_class_for(BadRequest("bad")) == "invalid_request"
    assert terminal_class_for(DeadlineExceeded("late")) == "deadline_exceeded"
    assert terminal_class_for(NarwhalError("bug")) == "internal_error"
    assert terminal_class_for(EngineUnavailable("down", leg="prefill")) == "prefill_failed"
    assert terminal_class_for(EngineUnavailable("down", leg="decode")) == "decode_failed"


# ------------------------------------------------------------------ a success, recorded


async def test_a_success_is_journaled_with_its_times(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        await _at_start()
        resp = await stack.complete({**BODY, "max_tokens": 2})
    assert resp.status_code == 200
    [rec] = stack.records
    [attempt] = rec["attempts"]
    assert (attempt["producer"], attempt["consumer"], attempt["same_worker"]) == ("p0", "d0", False)
    assert attempt["placement_wait_s"] == 0.0  # least-loaded placement never waits
    assert attempt["ttft_s"] == pytest.approx(PREFILL_S, abs=1e-9)
    assert rec["ttft_s"] == pytest.approx(PREFILL_S, abs=1e-9)
    assert rec["first_byte_s"] == pytest.approx(PREFILL_S + STEP_S, abs=1e-9)
    # Two tokens are enough for a time per output token.
    assert rec["tpot_s"] == pytest.approx(2 * STEP_S, abs=1e-9)
    assert rec["latency_s"] == pytest.approx(PREFILL_S + 2 * STEP_S, abs=1e-9)


async def test_a_priced_attempt_records_its_predictions(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(priced=True) as stack:
        await _at_start()
        resp = await stack.complete(BODY)
    assert resp.status_code == 200
    [attempt] = stack.records[0]["attempts"]
    assert attempt["predicted_ttft_s"] == pytest.approx(PREFILL_S, rel=0.5)
    assert attempt["predicted_tpot_s"] == pytest.approx(STEP_S, rel=0.5)


async def test_a_retrys_predicted_ttft_counts_the_time_already_spent(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Attempt 1 fails on d0 once its prefill is done: attempt 2's predicted TTFT (from
    # arrival) is that time plus its own prefill, which is what it then measures.
    async with open_stack(two_consumers(recovery={"max_attempts": 2}), priced=True) as stack:
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=503, times=1))
        with Reservation(stack.router.state.placement, "p0", "d1", 10, 10):
            resp = await stack.complete(BODY)
    assert resp.status_code == 200
    first, second = stack.records[0]["attempts"]
    assert (first["consumer"], second["consumer"]) == ("d0", "d1")
    assert first["predicted_ttft_s"] == pytest.approx(PREFILL_S, abs=1e-6)
    assert second["predicted_ttft_s"] == pytest.approx(2 * PREFILL_S, abs=1e-6)
    assert second["ttft_s"] == pytest.approx(2 * PREFILL_S, abs=1e-6)


async def test_in_flight_counts_concurrent_requests(autojump_clock: trio.abc.Clock) -> None:
    # Two requests on the same pair at once: each leg counts itself in and out (the
    # stack checks every count is back at zero).
    async with open_stack() as stack:
        await _at_start()
        state = stack.router.state
        stack.engine("p0").inject(FaultSpec(kind="delay_headers", on="prefill", delay_s=1.0))
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=1.0))
        seen: list[tuple[int, int]] = []
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(stack.complete, BODY)
            await trio.sleep(0.5)
            seen.append((state.in_flight_by_engine["p0"], state.in_flight_by_engine["d0"]))
            await trio.sleep(1.0)
            seen.append((state.in_flight_by_engine["p0"], state.in_flight_by_engine["d0"]))
        assert seen == [(2, 0), (0, 2)]
        assert [r["terminal_class"] for r in stack.records] == ["ok", "ok"]


# ------------------------------------------------------------------ the wire


async def _stream_raw(
    stack: Stack, body: dict[str, Any], **headers: str
) -> tuple[httpx.Headers, bytes]:
    async with stack.client.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
    ) as resp:
        assert resp.status_code == 200
        return resp.headers, await resp.aread()


async def test_answers_carry_the_request_id_and_content_type(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack() as stack:
        headers, _ = await _stream_raw(stack, BODY, **{"x-request-id": "client-7"})
        resp = await stack.complete(BODY, headers={"x-request-id": "client-8"})
    assert headers["x-request-id"] == "client-7" and headers["content-type"] == "text/event-stream"
    assert (
        resp.headers["x-request-id"] == "client-8"
        and resp.headers["content-type"] == "application/json"
    )
    body = resp.json()
    assert "client-8" in body["id"] and body["model"] == "sim-llama"


_EVENT = (
    '{"id":"cmpl-k","object":"text_completion","created":1,"model":"sim-llama","choices":'
    '[{"index":0,"text":"t%d","logprobs":null,"finish_reason":%s,"token_ids":[%d]}]}'
)


def _token(token_id: int, finish: str | None = None) -> bytes:
    return b"data: " + (_EVENT % (token_id, json.dumps(finish), token_id)).encode() + b"\n\n"


def _usage(prompt: int, completion: int) -> bytes:
    usage = {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    return (
        b"data: "
        + json.dumps(
            {"id": "cmpl-k", "object": "text_completion", "choices": [], "usage": usage}
        ).encode()
        + b"\n\n"
    )


_DONE = b"data: [DONE]\n\n"


def _events(raw: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e]


async def test_a_burst_of_events_is_relayed_whole(autojump_clock: trio.abc.Clock) -> None:
    # Three tokens, the usage and [DONE] in one transport chunk: every event comes out,
    # each as an event of its own.
    burst = _token(1) + _token(2) + _token(3, "length") + _usage(4, 3) + _DONE
    async with open_stack(wrap=scripted_decodes([(0.0, burst)])) as stack:
        _, raw = await _stream_raw(stack, {**BODY, "max_tokens": 3})
        _, with_usage = await _stream_raw(
            stack, {**BODY, "max_tokens": 3, "stream_options": {"include_usage": True}}
        )
    events = _events(raw)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t1", "t2", "t3"]
    assert events[-1] == b"[DONE]"
    # Each event carries the router's response id, not the decode leg's, and no token
    # ids (the client did not ask for them).
    ids = {json.loads(e)["id"] for e in events[:-1]}
    assert len(ids) == 1 and "cmpl-k" not in ids
    assert not any("token_ids" in json.loads(e)["choices"][0] for e in events[:-1])
    # The usage event goes only to a client that asked for it.
    events = _events(with_usage)
    assert len(events) == 5 and json.loads(events[3])["usage"]["completion_tokens"] == 3
    assert events[-1] == b"[DONE]"
    assert [r["output_len"] for r in stack.records] == [3, 3]


async def test_every_event_of_a_token_burst_gets_the_routers_id(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Token events that arrive together, nothing else with them: relayed as they came,
    # each with the router's response id.
    steps = [(0.0, _token(1) + _token(2)), (0.0, _token(3, "length")), (0.0, _DONE)]
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        _, raw = await _stream_raw(stack, {**BODY, "max_tokens": 3})
    events = [json.loads(e) for e in _events(raw)[:-1]]
    assert [e["choices"][0]["text"] for e in events] == ["t1", "t2", "t3"]
    assert len({e["id"] for e in events}) == 1 and events[0]["id"] != "cmpl-k"
    assert not any("token_ids" in e["choices"][0] for e in events)


async def test_events_parsed_from_one_chunk_are_written_together(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Mid-stream, two token events with a comment between them in one transport chunk:
    # parsed one by one, written as one write, each still an event of its own.
    steps = [
        (0.0, _token(1)),
        (1.0, _token(2) + b": keep-alive\n\n" + _token(3)),
        (1.0, _token(4, "length") + _DONE),
    ]
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        _, raw = await _stream_raw(stack, {**BODY, "max_tokens": 4})
    events = _events(raw)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t1", "t2", "t3", "t4"]
    assert events[-1] == b"[DONE]"


async def test_chats_role_delta_comes_first(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        messages = [{"role": "user", "content": "hello"}]
        async with stack.client.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 3, "stream": True},
        ) as resp:
            raw = await resp.aread()
    assert resp.status_code == 200
    events = [json.loads(e) for e in _events(raw)[:-1]]
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[1:])
    assert stack.records[0]["terminal_class"] == "ok" and stack.records[0]["output_len"] == 3


async def test_a_non_streaming_answer_keeps_the_engines_usage(
    autojump_clock: trio.abc.Clock,
) -> None:
    steps = [(0.0, _token(1)), (0.0, _token(2, "length")), (0.0, _usage(4, 2)), (0.0, _DONE)]
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        resp = await stack.complete({**BODY, "max_tokens": 2})
    assert resp.json()["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}
    }  # fmt: skip


async def test_a_non_streaming_answer_without_usage_counts_its_own(
    autojump_clock: trio.abc.Clock,
) -> None:
    steps = [(0.0, _token(1)), (0.0, _token(2, "length")), (0.0, _DONE)]
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        resp = await stack.complete({**BODY, "max_tokens": 2})
    assert resp.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


@pytest.mark.parametrize("stream", [True, False])
async def test_tpot_ends_at_the_last_token_not_the_last_event(
    autojump_clock: trio.abc.Clock, stream: bool
) -> None:
    # Tokens 1 s apart, then the usage 10 s later: output time is up to the last token,
    # whether the events are relayed (each burst written) or collected into one answer.
    steps = [
        (1.0, _token(1)),
        (1.0, _token(2)),
        (1.0, _token(3, "length")),
        (10.0, _usage(4, 3)),
        (0.0, _DONE),
    ]
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        await _at_start()
        if stream:
            _, raw = await _stream_raw(stack, {**BODY, "max_tokens": 3})
            assert raw.endswith(_DONE)
        else:
            assert (await stack.complete({**BODY, "max_tokens": 3})).status_code == 200
    [rec] = stack.records
    assert rec["tpot_s"] == pytest.approx(3.0 / 2, abs=1e-9)
    assert rec["first_byte_s"] == pytest.approx(PREFILL_S + 1.0, abs=1e-9)


@pytest.mark.parametrize("read_timeout_s", [10.0, 100.0])
async def test_an_event_before_the_first_token_leaves_the_first_token_deadline(
    autojump_clock: trio.abc.Clock, read_timeout_s: float
) -> None:
    # The consumer sends a metadata event, then nothing: the first-token deadline (30 s
    # after the decode leg started) fires, not a silence bound counted from that event.
    steps = [(0.0, _usage(4, 0))]
    doc = fleet_doc(engine={"decode_read_timeout_s": read_timeout_s})
    async with open_stack(doc, wrap=scripted_decodes(steps, hang=True)) as stack:
        await _at_start()
        resp = await stack.complete(BODY)
    assert resp.status_code == 504
    assert resp.json()["error"]["message"] == "no token within engine.first_token_timeout_s (30 s)"
    [rec] = stack.records
    assert rec["latency_s"] == pytest.approx(PREFILL_S + 30.0, abs=1e-9)


async def test_a_stream_that_stops_after_a_relayed_metadata_event_is_silence(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The usage event is relayed (the client asked for it), then the consumer sends
    # nothing: the silence bound runs from that event's write, as from any other.
    steps = [(0.0, _token(1)), (1.0, _usage(4, 1))]
    doc = fleet_doc(engine={"decode_read_timeout_s": 5.0})
    async with open_stack(doc, wrap=scripted_decodes(steps, hang=True)) as stack:
        await _at_start()
        _, raw = await _stream_raw(stack, {**BODY, "stream_options": {"include_usage": True}})
    events = _events(raw)
    assert json.loads(events[-1])["error"]["message"] == (
        "engine went silent between tokens (no chunk for 5 s after 1 tokens)"
    )
    [rec] = stack.records
    assert rec["terminal_class"] == "silence_timeout"
    assert rec["latency_s"] == pytest.approx(PREFILL_S + 1.0 + 5.0, abs=1e-9)


# ------------------------------------------------------------------ failures: blame and names


async def test_a_prefill_past_the_handoff_age_blames_the_producer(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack(fleet_doc(recovery={"eject_after": 1})) as stack:
        await _at_start()
        stack.engine("p0").inject(FaultSpec(kind="delay_headers", on="prefill", delay_s=1000.0))
        resp = await stack.complete(BODY)
        st = stack.router.state.breaker.states["p0"]
        assert st.ejected and st.failed_leg == "prefill"
        assert st.last_error == "prefill did not complete within handoff.max_age_s (60 s)"
    assert resp.status_code == 504
    assert (
        resp.json()["error"]["message"]
        == "prefill did not complete within handoff.max_age_s (60 s)"
    )
    [rec] = stack.records
    assert rec["terminal_class"] == "prefill_failed" and rec["latency_s"] == pytest.approx(
        60.0, abs=1e-9
    )
    [attempt] = rec["attempts"]
    assert (attempt["deadline"], attempt["held_by"], attempt["ttft_s"]) == (
        "handoff.max_age_s",
        "p0",
        None,
    )


async def test_an_expired_handoff_names_the_consumer_and_the_time_it_held(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack(fleet_doc(recovery={"eject_after": 1})) as stack:
        await _at_start()
        stack.engine("p0").inject(FaultSpec(kind="delay_headers", on="prefill", delay_s=40.0))
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=1000.0))
        resp = await stack.complete(BODY)
        st = stack.router.state.breaker.states["d0"]
        assert st.ejected and st.failed_leg == "decode" and st.origin_producer == "p0"
    message = (
        "KV handoff older than handoff.max_age_s (60 s) before the first token: consumer d0 produced "
        "none in the 20 s left after the producer answered"
    )
    assert resp.status_code == 504 and resp.json()["error"]["message"] == message
    assert st.last_error == message
    [attempt] = stack.records[0]["attempts"]
    assert (attempt["outcome"], attempt["deadline"], attempt["held_by"]) == (
        "handoff_expired",
        "handoff.max_age_s",
        "d0",
    )


@pytest.mark.parametrize(
    ("fault", "klass", "deadline"),
    [
        (
            FaultSpec(kind="delay_headers", on="decode", delay_s=1000.0),
            "first_token_timeout",
            "engine.first_token_timeout_s",
        ),
        (
            FaultSpec(kind="silence_after", on="decode", after_tokens=2),
            "silence_timeout",
            "engine.decode_read_timeout_s",
        ),
    ],
    ids=["first-token", "silence"],
)
async def test_a_consumer_timeout_blames_the_consumer(
    autojump_clock: trio.abc.Clock, fault: FaultSpec, klass: str, deadline: str
) -> None:
    async with open_stack(fleet_doc(recovery={"eject_after": 1})) as stack:
        await _at_start()
        stack.engine("d0").inject(fault)
        resp = await stack.complete(BODY)
        breaker = stack.router.state.breaker
        st = breaker.states["d0"]
        assert st.ejected and st.failed_leg == "decode" and st.origin_producer == "p0"
        assert st.last_error == resp.json()["error"]["message"]
        assert breaker.states["p0"].streak == 0
    assert resp.status_code == 504
    [rec] = stack.records
    [attempt] = rec["attempts"]
    assert (attempt["outcome"], attempt["deadline"], attempt["held_by"]) == (klass, deadline, "d0")
    assert attempt["error"] == rec["error"] == resp.json()["error"]["message"]


@pytest.mark.parametrize(("leg", "culprit"), [("prefill", "p0"), ("decode", "d0")])
async def test_an_error_naming_no_engine_blames_its_legs_engine(
    autojump_clock: trio.abc.Clock, leg: str, culprit: str
) -> None:
    async with open_stack(fleet_doc(recovery={"eject_after": 1})) as stack:
        state = stack.router.state
        client = state.clients[culprit]

        async def fail(*args: Any, **kwargs: Any) -> Any:
            raise EngineUnavailable("connection refused", leg=leg)

        if leg == "prefill":
            client.prefill = fail  # type: ignore[method-assign]
        else:
            client.decode = lambda *a, **k: _Failing()  # type: ignore[method-assign,assignment,return-value]
        resp = await stack.complete(BODY)
        st = state.breaker.states[culprit]
        assert st.ejected and st.failed_leg == leg and st.last_error == "connection refused"
        others = [n for n in ("p0", "d0") if n != culprit]
        assert all(state.breaker.states[n].streak == 0 for n in others)
    assert resp.status_code == 502
    [attempt] = stack.records[0]["attempts"]
    assert attempt["outcome"] == f"{leg}_failed"


class _Failing:
    async def __aenter__(self) -> Any:
        raise EngineUnavailable("connection refused", leg="decode")

    async def __aexit__(self, *exc: object) -> None:
        return None


# ------------------------------------------------------------------ retries


async def test_a_retry_avoids_the_engine_that_failed(autojump_clock: trio.abc.Clock) -> None:
    # d1 is busier (a held reservation), so least-loaded placement prefers d0 both times:
    # only the retry's avoidance of the engine that failed sends it to d1.
    async with open_stack(two_consumers(recovery={"max_attempts": 2})) as stack:
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=503, times=2))
        with Reservation(stack.router.state.placement, "p0", "d1", 10, 10):
            resp = await stack.complete(BODY)
    assert resp.status_code == 200
    attempts = stack.records[0]["attempts"]
    assert [(a["n"], a["consumer"], a["outcome"]) for a in attempts] == [
        (1, "d0", "decode_failed"),
        (2, "d1", "ok"),
    ]


async def test_a_client_fault_is_not_retried(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(two_consumers(recovery={"max_attempts": 2})) as stack:
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=400, times=1))
        resp = await stack.complete(BODY)
    assert resp.status_code == 400
    assert len(stack.records[0]["attempts"]) == 1


async def test_no_retry_once_tokens_were_produced(autojump_clock: trio.abc.Clock) -> None:
    # A non-streaming answer is not committed until its end, but its tokens were
    # generated: a fresh attempt would not be the same answer.
    doc = two_consumers(recovery={"max_attempts": 2}, engine={"decode_read_timeout_s": 1.0})
    async with open_stack(doc) as stack:
        stack.engine("d0").inject(
            FaultSpec(kind="silence_after", on="decode", after_tokens=2, times=1)
        )
        resp = await stack.complete(BODY)
    assert resp.status_code == 504
    assert [a["outcome"] for a in stack.records[0]["attempts"]] == ["silence_timeout"]


@pytest.mark.parametrize(("spare_s", "attempts"), [(0.0, 2), (-0.5, 1)])
async def test_a_retry_needs_a_first_token_timeout_left(
    autojump_clock: trio.abc.Clock, spare_s: float, attempts: int
) -> None:
    # Instant prefills: attempt 1 fails exactly at its first-token deadline (30 s), and
    # the request has 30 s + spare_s left: exactly a first-token timeout is enough.
    instant = {"prefill": {"a": 0.0, "b": 0.0, "c": 0.0}}
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"], **instant), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]),
        recovery={"max_attempts": 2}, engine={"request_timeout_s": 60.0 + spare_s},
    )  # fmt: skip
    async with open_stack(doc) as stack:
        await _at_start()
        for name in ("d0", "d1"):
            stack.engine(name).inject(FaultSpec(kind="delay_headers", on="decode", delay_s=1000.0))
        await stack.complete(BODY)
    assert len(stack.records[0]["attempts"]) == attempts


# ------------------------------------------------------------------ placement's deadline


@pytest.mark.parametrize("slo_ttft", [0.5, None])
async def test_placement_waits_until_the_ttft_target_then_refuses(
    autojump_clock: trio.abc.Clock, slo_ttft: float | None
) -> None:
    # A TPOT target that one stream on d0 meets (4.2 ms) and two do not (4.4 ms): the
    # second request waits for capacity until its TTFT target (from its arrival) and is
    # refused there; without a TTFT target it waits for the first stream to end.
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"], decode={"c0": 0.004, "c1": 0.0002, "c2": 0.0}),
        controller={"admission": "wait", "slo": {"ttft_s": slo_ttft, "tpot_s": 0.0043}},
    )  # fmt: skip
    async with open_stack(doc, priced=True) as stack:
        await _at_start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stack.complete, {**BODY, "max_tokens": 200})
            await trio.sleep(0.1)
            nursery.start_soon(stack.complete, {**BODY, "max_tokens": 4})
    first, second = sorted(stack.records, key=lambda r: r["arrival"])
    print(
        [
            (r["terminal_class"], r["latency_s"], r["attempts"], r["output_len"])
            for r in stack.records
        ]
    )
    assert first["terminal_class"] == "ok" and first["attempts"][0]["placement_wait_s"] == 0.0
    wait = second["attempts"][0]["placement_wait_s"]
    if slo_ttft is not None:
        assert second["terminal_class"] == "refused" and second["status"] == 503
        assert wait == pytest.approx(0.5, abs=1e-9)
    else:
        assert second["terminal_class"] == "ok"
        assert wait == pytest.approx(PREFILL_S + 200 * 0.0042 - 0.1, abs=0.01)


# ------------------------------------------------------------------ estimated prompt lengths


def small_model(**controller: str) -> dict[str, Any]:
    engines = (
        engine("p0", 8101, ["prefill"], max_model_len=64),
        engine("d0", 8102, ["decode"], max_model_len=64),
    )
    return fleet_doc(*engines, controller=controller) if controller else fleet_doc(*engines)


async def test_a_token_id_prompt_over_the_context_is_refused_before_engine_work(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Token ids are counted exactly with no /tokenize: the limit is the one the engines
    # reported. 60 ids and 4 output tokens fit in 64; 61 do not, and no engine is asked.
    async with open_stack(small_model()) as stack:
        fits = await stack.complete({"prompt": list(range(1, 61)), "max_tokens": 4})
        over = await stack.complete({"prompt": list(range(1, 62)), "max_tokens": 4})
        prefills = [b for b in stack.engine("p0").requests_seen if "prompt" in b]
    assert fits.status_code == 200 and over.status_code == 400
    assert over.json()["error"]["message"] == (
        "this model's maximum context length is 64 tokens; the request has 61 prompt tokens "
        "and asks for 4 output tokens"
    )
    assert len(prefills) == 1 and stack.engine("p0").stats.calls.get("/tokenize", 0) == 0


@pytest.mark.parametrize("counter", [64, 128])
async def test_a_counted_prompt_must_fit_the_smallest_context_of_its_model(
    autojump_clock: trio.abc.Clock, counter: int
) -> None:
    # The producer that counts the prompt (/tokenize) reports its own limit; the request
    # may decode on an engine with a smaller one. Whichever is smaller holds, refused
    # before any prefill: 30 prompt tokens and 40 output tokens fit 128, not 64.
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"], max_model_len=counter),
        engine("d0", 8102, ["decode"], max_model_len=192 - counter),
        controller={"prompt_tokens": "tokenize"},
    )
    await _refused_before_any_prefill(doc)


async def _refused_before_any_prefill(
    doc: dict[str, Any], wrap: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None
) -> None:
    """30 counted prompt tokens and 40 output tokens do not fit 64: refused after one
    /tokenize, before any prefill."""
    async with open_stack(doc, wrap=wrap) as stack:
        resp = await stack.complete({"prompt": " ".join(["x"] * 30), "max_tokens": 40})
        prefills = [b for b in stack.engine("p0").requests_seen if "prompt" in b]
        tokenized = stack.engine("p0").stats.calls.get("/tokenize", 0)
        listed = stack.router.state.models
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == (
        "this model's maximum context length is 64 tokens; the request has 30 prompt tokens "
        "and asks for 40 output tokens"
    )
    assert tokenized == 1 and prefills == []
    assert listed == ({} if wrap is _NoModels else {"sim-llama": 64})


class _ShortProducer(httpx.AsyncBaseTransport):
    """A ``wrap``: p0 refuses every prefill as over its context, naming its limit only."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "p0.test" and request.url.path == "/v1/completions":
            message = "This model's maximum context length is 8 tokens. Please reduce the length of the prompt."
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return httpx.Response(400, json={"error": error})
        return await self.inner.handle_async_request(request)


async def test_an_engines_context_400_without_a_prompt_count_takes_the_routers_count(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The engine's 400 names its limit but not the prompt's length: the token ids'
    # exact count fills it in, and the client reads the router's one message.
    async with open_stack(wrap=_ShortProducer) as stack:
        resp = await stack.complete({"prompt": list(range(1, 11)), "max_tokens": 4})
    assert resp.status_code == 400
    message = (
        "this model's maximum context length is 8 tokens; the request has 10 prompt tokens "
        "and asks for 4 output tokens"
    )
    assert resp.json()["error"]["message"] == message
    [rec] = stack.records
    assert (rec["terminal_class"], rec["error"]) == ("invalid_request", message)


async def test_an_estimated_prompt_that_exactly_fits_is_served(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack(small_model()) as stack:
        assert not stack.router.state.exact_prompt_counts
        resp = await stack.complete({"prompt": " ".join(["x"] * 60), "max_tokens": 4})
        one = await stack.complete({"prompt": "x", "max_tokens": 4})
    assert resp.status_code == 200 and one.status_code == 200
    # The journal has the producer's exact counts, a one-token prompt's too.
    assert [(r["prompt_tokens"], r["requested_output_len"]) for r in stack.records] == [
        (60, 4),
        (1, 4),
    ]


@pytest.mark.parametrize("mode", ["estimate", "tokenize"])
async def test_an_output_limit_follows_the_exact_count(
    autojump_clock: trio.abc.Clock, mode: str
) -> None:
    # Chat without max_tokens: the output limit is what the model's length leaves after
    # the exact count, whichever way the prompt was counted; only estimates are learned.
    messages = [{"role": "user", "content": " ".join(["x"] * 30)}]
    async with open_stack(small_model(prompt_tokens=mode)) as stack:
        resp = await stack.client.post("/v1/chat/completions", json={"messages": messages})
        lengths = stack.router.state.prompt_lengths
    assert resp.status_code == 200, resp.text
    [rec] = stack.records
    assert rec["prompt_tokens"] > 30 and rec["requested_output_len"] == 64 - rec["prompt_tokens"]
    assert rec["output_len"] == rec["requested_output_len"]
    assert lengths.observations.get("chat", 0) == (1 if mode == "estimate" else 0)


class _NoModels(httpx.AsyncBaseTransport):
    """A ``wrap``: every engine's ``/v1/models`` lists no model."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": []})
        return await self.inner.handle_async_request(request)


async def test_a_counted_prompt_fits_the_limit_its_count_named_when_no_listing_names_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The engines list no model (so no context length): the /tokenize answer's own
    # max_model_len is the limit, and the request that cannot fit is refused before
    # any prefill rather than sent to fail on the engines.
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"], max_model_len=64),
        engine("d0", 8102, ["decode"], max_model_len=64),
        controller={"prompt_tokens": "tokenize"},
    )
    await _refused_before_any_prefill(doc, wrap=_NoModels)


async def test_engines_that_list_no_model_still_serve(autojump_clock: trio.abc.Clock) -> None:
    # No model is known (the document names none, the engines list none): requests are
    # served all the same, and the answer names no model rather than a guess.
    async with open_stack(wrap=_NoModels) as stack:
        assert stack.router.state.models == {}
        resp = await stack.complete({**BODY, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "" and resp.json()["usage"]["completion_tokens"] == 2
    [rec] = stack.records
    assert (rec["terminal_class"], rec["model"]) == ("ok", None)


def _producer_usage(usage: dict[str, Any] | None) -> Any:
    """A ``wrap`` for :func:`open_stack`: p0's prefill answers carry ``usage`` in place of
    their own (None: no usage at all), and no prompt token ids."""

    class Wrapped(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            resp = await self.inner.handle_async_request(request)
            if request.url.host != "p0.test" or request.url.path != "/v1/completions":
                return resp
            body = json.loads(await resp.aread())
            await resp.aclose()
            for holder in (body, *body["choices"]):  # the other place a count is read from
                holder.pop("prompt_token_ids", None)
            body.pop("usage", None)
            if usage is not None:
                body["usage"] = usage
            return httpx.Response(resp.status_code, json=body)

    return Wrapped


@pytest.mark.parametrize(
    "usage", [None, {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}], ids=["none", "zero"]
)
async def test_a_producer_that_reports_no_prompt_count_leaves_the_estimate(
    autojump_clock: trio.abc.Clock, usage: dict[str, Any] | None
) -> None:
    # A prefill answer without a prompt count, or with a count of zero, is no count: the
    # request is served on its estimate, the journal has no count, nothing is learned.
    async with open_stack(wrap=_producer_usage(usage)) as stack:
        resp = await stack.complete(BODY)
        lengths = stack.router.state.prompt_lengths
    assert resp.status_code == 200, resp.text
    [rec] = stack.records
    assert (rec["terminal_class"], rec["prompt_tokens"], rec["output_len"]) == ("ok", None, 6)
    assert lengths.observations.get("completions", 0) == 0


# ------------------------------------------------------------------ every attempt ends


def _busy_d0(**sections: Any) -> dict[str, Any]:
    # A TPOT target that d0 meets with no stream and misses with one (4.2 ms, 4.4 ms).
    return fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"], decode={"c0": 0.004, "c1": 0.0002, "c2": 0.0}),
        **sections,
    )


@pytest.mark.parametrize("admission", ["refuse", "wait"])
async def test_an_attempt_refused_in_placement_ends_refused(
    autojump_clock: trio.abc.Clock, admission: str
) -> None:
    # d0 holds a stream, so no placement meets the TPOT target: refused at once, or at
    # the TTFT target after waiting. The attempt ends as its request did, not "pending".
    doc = _busy_d0(controller={"admission": admission, "slo": {"ttft_s": 0.5, "tpot_s": 0.0043}})
    async with open_stack(doc, priced=True) as stack:
        await _at_start()
        with Reservation(stack.router.state.placement, "p0", "d0", 10, 10):
            resp = await stack.complete(BODY)
    assert resp.status_code == 503
    [rec] = stack.records
    [attempt] = rec["attempts"]
    assert rec["terminal_class"] == "refused"
    assert (attempt["outcome"], attempt["producer"], attempt["deadline"], attempt["held_by"]) == (
        "refused", None, None, None,
    )  # fmt: skip


async def test_an_attempt_cut_in_placement_by_the_request_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The TTFT target is unset: placement waits for capacity up to the request deadline.
    doc = _busy_d0(
        controller={"admission": "wait", "slo": {"ttft_s": None, "tpot_s": 0.0043}},
        engine={"request_timeout_s": 2.0},
    )
    async with open_stack(doc, priced=True) as stack:
        await _at_start()
        with Reservation(stack.router.state.placement, "p0", "d0", 10, 10):
            resp = await stack.complete(BODY)
    assert resp.status_code == 504
    [attempt] = stack.records[0]["attempts"]
    # No engine held the time: the deadline is named, no engine is blamed.
    assert (attempt["outcome"], attempt["deadline"], attempt["held_by"], attempt["producer"]) == (
        "deadline_exceeded", "engine.request_timeout_s", None, None,
    )  # fmt: skip
    assert attempt["placement_wait_s"] == pytest.approx(2.0, abs=1e-9)


async def test_a_retry_cut_in_placement_blames_no_earlier_engine(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Attempt 1 fails on d0 at once (d0 ejected); attempt 2 waits for d1, which a held
    # stream keeps over the TPOT target, until the request deadline. d0 held none of
    # that time: the attempt names the deadline and no engine.
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"], decode={"c0": 0.004, "c1": 0.0002, "c2": 0.0}),
        engine("d1", 8103, ["decode"], decode={"c0": 0.004, "c1": 0.0002, "c2": 0.0}),
        controller={"admission": "wait", "slo": {"ttft_s": None, "tpot_s": 0.0043}},
        recovery={"max_attempts": 2, "eject_after": 1},
        engine={"request_timeout_s": 40.0},
    )  # fmt: skip
    async with open_stack(doc, priced=True) as stack:
        await _at_start()
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=503, times=1))
        with Reservation(stack.router.state.placement, "p0", "d1", 10, 10):
            resp = await stack.complete(BODY)
    assert resp.status_code == 504
    first, second = stack.records[0]["attempts"]
    assert (first["consumer"], first["outcome"]) == ("d0", "decode_failed")
    assert (second["outcome"], second["deadline"], second["held_by"], second["consumer"]) == (
        "deadline_exceeded", "engine.request_timeout_s", None, None,
    )  # fmt: skip


@pytest.mark.parametrize(("mode", "journaled"), [("tokenize", 4), ("estimate", None)])
async def test_a_prompt_count_is_journaled_only_when_exact(
    autojump_clock: trio.abc.Clock, mode: str, journaled: int | None
) -> None:
    # The prefill fails, so the producer never counted the prompt: the journal has the
    # router's own count when it is exact, and no estimate.
    async with open_stack(fleet_doc(controller={"prompt_tokens": mode})) as stack:
        stack.engine("p0").inject(FaultSpec(kind="http_error", on="prefill", status=500, times=1))
        resp = await stack.complete(BODY)
    assert resp.status_code == 502
    [rec] = stack.records
    assert (rec["terminal_class"], rec["prompt_tokens"]) == ("prefill_failed", journaled)


async def test_an_attempt_refused_after_the_exact_count_ends_invalid(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The estimate let 61 words and 4 tokens through; the producer's exact count does
    # not fit them in 64: refused before the decode leg, and the attempt says so.
    async with open_stack(small_model()) as stack:
        resp = await stack.complete({"prompt": " ".join(["x"] * 61), "max_tokens": 4})
    assert resp.status_code == 400
    [rec] = stack.records
    [attempt] = rec["attempts"]
    assert (rec["terminal_class"], rec["prompt_tokens"]) == ("invalid_request", 61)
    message = (
        "this model's maximum context length is 64 tokens; the request has 61 prompt tokens "
        "and asks for 4 output tokens"
    )
    assert resp.json()["error"]["message"] == message and rec["error"] == message
    # No deadline fired: the attempt names none and no engine held one.
    assert (attempt["outcome"], attempt["producer"], attempt["deadline"], attempt["held_by"]) == (
        "invalid_request", "p0", None, None,
    )  # fmt: skip


# ------------------------------------------------------------------ how a request ends


async def test_shutdown_before_the_first_token_is_a_503_to_retry(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack() as stack:
        await _at_start()
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=100.0))
        answers: list[httpx.Response] = []

        async def one() -> None:
            answers.append(await stack.complete(BODY))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await trio.sleep(1.0)
            await stack.router.shutdown(2.0)
    [resp] = answers
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["message"] == "router shutting down"
    [rec] = stack.records
    assert (rec["terminal_class"], rec["status"], rec["error"]) == ("shutdown", 503, "router shutting down")
    assert rec["latency_s"] == pytest.approx(3.0, abs=1e-9)
    assert [a["outcome"] for a in rec["attempts"]] == ["shutdown"]


async def test_shutdown_after_the_first_token_ends_the_stream_with_an_event(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack(wrap=scripted_decodes([(0.0, _token(1))], hang=True)) as stack:
        await _at_start()
        raws: list[bytes] = []

        async def one() -> None:
            raws.append((await _stream_raw(stack, BODY))[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await trio.sleep(1.0)
            await stack.router.shutdown(2.0)
    [raw] = raws
    events = _events(raw)
    assert json.loads(events[0])["choices"][0]["text"] == "t1"
    assert json.loads(events[-1]) == {
        "error": {"message": "router shutting down", "type": "service_unavailable", "code": None}
    }
    [rec] = stack.records
    assert (rec["terminal_class"], rec["status"], rec["output_len"]) == ("shutdown", 200, 1)


async def test_a_client_that_leaves_before_the_first_token_is_499(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack() as stack:
        await _at_start()
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=100.0))
        with trio.move_on_after(1.0):
            await stack.complete(BODY)
        await trio.sleep(5.0)
    [rec] = stack.records
    assert (rec["terminal_class"], rec["status"], rec["error"]) == ("client_cancelled", 499, "client disconnected")
    assert [a["outcome"] for a in rec["attempts"]] == ["client_cancelled"]


async def test_a_client_that_leaves_after_the_first_token_got_a_200(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack(wrap=scripted_decodes([(0.0, _token(1))], hang=True)) as stack:
        with trio.move_on_after(1.0):
            await _stream_raw(stack, BODY)
        await trio.sleep(5.0)
    [rec] = stack.records
    assert (rec["terminal_class"], rec["status"], rec["output_len"]) == ("client_cancelled", 200, 1)


async def test_a_router_bug_is_a_500_journaled_by_its_type(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: Placement, *args: Any, **kwargs: Any) -> Any:
        raise KeyError("secret detail")

    monkeypatch.setattr(Placement, "acquire", broken)
    async with open_stack() as stack:
        resp = await stack.complete(BODY, headers={"x-request-id": "bug-1"})
    assert resp.status_code == 500
    assert resp.json() == {"error": {"message": "internal error", "type": "internal_error", "code": None}}
    [rec] = stack.records
    assert (rec["terminal_class"], rec["status"], rec["error"]) == ("internal_error", 500, "KeyError")
    [logged] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert logged.getMessage() == "request bug-1 failed with an internal error" and logged.exc_info


async def test_each_request_is_logged_once_with_its_outcome(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router")
    async with open_stack() as stack:
        await _at_start()
        await stack.complete(BODY, headers={"x-request-id": "log-1"})
    [line] = [r for r in caplog.records if r.getMessage().startswith("request log-1")]
    assert line.getMessage() == "request log-1 completions status=200 class=ok tokens=6"
    fields = {k: getattr(line, k) for k in ("request_id", "route", "status", "terminal_class", "output_len", "producer", "consumer")}
    assert fields == {
        "request_id": "log-1", "route": "completions", "status": 200, "terminal_class": "ok",
        "output_len": 6, "producer": "p0", "consumer": "d0",
    }  # fmt: skip
    assert line.latency_s == pytest.approx(PREFILL_S + 6 * STEP_S, abs=1e-9)  # type: ignore[attr-defined]


async def test_requests_over_the_concurrency_limit_are_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A limit of 2: two requests in flight are served, a third is refused at once.
    async with open_stack(fleet_doc(server={"max_concurrent_requests": 2})) as stack:
        await _at_start()
        answers: list[httpx.Response] = []

        async def one() -> None:
            answers.append(await stack.complete(BODY))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
                await trio.sleep(0.001)
    refused = [r for r in answers if r.status_code != 200]
    assert len(answers) == 3 and len(refused) == 1
    [resp] = refused
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["message"] == "too many concurrent requests (server.max_concurrent_requests)"
    [rec] = [r for r in stack.records if r["terminal_class"] != "ok"]
    assert (rec["terminal_class"], rec["attempts"], rec["output_len"]) == ("refused", [], 0)



# ------------------------------------------------------------------ a deadline and a chunk in one tick


class _LateFirstChunk:
    """A decode stream whose first chunk is read as its first-token deadline expires:
    the clock jumps past it with no checkpoint between (an engine's token and the
    deadline in one scheduler tick)."""

    def __init__(self, opener: Any, clock: Any) -> None:
        self.opener, self.clock = opener, clock

    async def __aenter__(self) -> Any:
        self.stream = await self.opener.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.opener.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def __aiter__(self) -> Any:
        self.chunks = self.stream.__aiter__()
        self.first = True
        return self

    async def __anext__(self) -> Any:
        chunk = await self.chunks.__anext__()
        if self.first:
            self.clock.jump(31.0)  # past engine.first_token_timeout_s (30 s)
            self.first = False
        return chunk


@pytest.mark.parametrize("stream", [False, True])
async def test_a_first_token_read_as_its_deadline_expires_is_too_late(
    autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    async with open_stack() as stack:
        client = stack.router.state.clients["d0"]
        decode = client.decode
        client.decode = lambda *a, **k: _LateFirstChunk(decode(*a, **k), autojump_clock)  # type: ignore[method-assign,assignment,return-value]
        resp = await stack.client.post("/v1/completions", json={**BODY, "stream": stream})
    assert resp.status_code == 504
    assert resp.json()["error"]["message"] == "no token within engine.first_token_timeout_s (30 s)"
    [rec] = stack.records
    assert (rec["terminal_class"], rec["first_byte_s"]) == ("first_token_timeout", None)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stream_that_ended_as_its_silence_deadline_expired_is_complete(
    autojump_clock: trio.abc.Clock, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's end ([DONE]) is read in the scheduler tick in which the silence
    deadline expires (here: the end is held under a shield past the deadline, which
    cancels the decode scope with nothing there to raise it): every token arrived and
    the stream ended, so the answer is whole, not a silence timeout."""
    from narwhal.engines.stream import DecodeStream

    original = DecodeStream.__anext__

    async def late_end(self: DecodeStream) -> Any:
        try:
            return await original(self)
        except StopAsyncIteration:
            with trio.CancelScope(shield=True):
                await trio.sleep(31.0)  # past engine.decode_read_timeout_s (30 s)
            raise

    monkeypatch.setattr(DecodeStream, "__anext__", late_end)
    async with open_stack() as stack:
        resp = await stack.client.post("/v1/completions", json={**BODY, "stream": stream})
    assert resp.status_code == 200, resp.text
    if stream:
        events = _events(resp.content)
        assert events[-1] == b"[DONE]" and not any(b'"error"' in e for e in events)
        assert sum(len(json.loads(e)["choices"]) for e in events[:-1]) == BODY["max_tokens"]
    else:
        assert resp.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    [rec] = stack.records
    assert (rec["terminal_class"], rec["output_len"]) == ("ok", BODY["max_tokens"])


async def test_only_a_bare_usage_event_is_held_back(autojump_clock: trio.abc.Clock) -> None:
    # A client that did not ask for usage: the bare usage event (no choices) is not
    # relayed; an event with a choice is, usage or not, and so is one with neither.
    finish = (
        b'data: {"id":"cmpl-k","object":"text_completion","created":1,"model":"sim-llama","choices":'
        b'[{"index":0,"text":"","logprobs":null,"finish_reason":"length","token_ids":[]}],'
        b'"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}\n\n'
    )
    empty = b'data: {"id":"cmpl-k","object":"text_completion","created":1,"model":"sim-llama","choices":[]}\n\n'
    steps = [(0.0, _token(1)), (0.0, finish), (0.0, empty), (0.0, _usage(4, 1)), (0.0, _DONE)]
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        _, raw = await _stream_raw(stack, {**BODY, "max_tokens": 1})
    events = [json.loads(e) for e in _events(raw)[:-1]]
    assert [e["choices"][0]["finish_reason"] if e["choices"] else None for e in events] == [None, "length", None]
    assert [("usage" in e) for e in events] == [False, True, False]


@pytest.mark.parametrize(("stream", "lazy"), [(True, True), (False, False)])
async def test_the_decode_leg_asks_for_the_requests_kind_and_lazy_counting_when_relayed(
    autojump_clock: trio.abc.Clock, stream: bool, lazy: bool
) -> None:
    # A relayed stream needs token counts only (lazy); an answer built by the router
    # needs the token objects. The kind is the request's (a same-worker decode has no
    # handoff to take it from).
    doc = fleet_doc(engine("w0", 8101, ["prefill", "decode"]))
    async with open_stack(doc) as stack:
        client = stack.router.state.clients["w0"]
        decode = client.decode
        calls: list[dict[str, Any]] = []

        def spy(*args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs)
            return decode(*args, **kwargs)

        client.decode = spy  # type: ignore[method-assign]
        messages = [{"role": "user", "content": "hello"}]
        resp = await stack.client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "stream": stream}
        )
    assert resp.status_code == 200
    [call] = calls
    assert (call["kind"], call["lazy"]) == ("chat", lazy)


@pytest.mark.parametrize("mode", ["tokenize", "estimate"])
async def test_least_loaded_placement_records_the_predicted_prefix_hit(
    autojump_clock: trio.abc.Clock, mode: str
) -> None:
    # The producer caches prompts (blocks of 16 tokens): the same 40-token prompt again
    # is predicted to hit its first two blocks, which the producer then reports. An
    # estimated prompt has no token ids: no prediction.
    caching = {"prefix_caching": True, "prompt_tokens_details": True, "block_size": 16}
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"], **caching), engine("d0", 8102, ["decode"], **caching),
        controller={"prompt_tokens": mode},
    )  # fmt: skip
    prompt = " ".join(f"w{j}" for j in range(40))
    async with open_stack(doc) as stack:
        for _ in range(2):
            assert (await stack.complete({"prompt": prompt, "max_tokens": 2})).status_code == 200
    first, second = (r["attempts"][0] for r in stack.records)
    predicted = (0, 32) if mode == "tokenize" else (None, None)
    assert (first["predicted_cached_tokens"], second["predicted_cached_tokens"]) == predicted
    assert (first["cached_tokens"], second["cached_tokens"]) == (0, 32)


async def test_a_failure_mid_burst_sends_the_burst_then_the_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Token 2 and a broken event arrive in one chunk after the 200: token 2 is still
    # sent, then the terminal error event, each an event of its own.
    steps = [(0.0, _token(1)), (1.0, _token(2) + b"data: {not json\n\n")]
    async with open_stack(wrap=scripted_decodes(steps)) as stack:
        _, raw = await _stream_raw(stack, BODY)
    events = _events(raw)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t1", "t2"]
    assert len(events) == 3 and set(json.loads(events[2])) == {"error"}
    [rec] = stack.records
    assert (rec["status"], rec["output_len"]) == (200, 2)


@pytest.mark.parametrize(
    ("rid", "kept"),
    [("a", True), ("r" * 200, True), ("", False), ("r" * 201, False), ("caf\u00e9", False), ("tab\there", False)],
    ids=["one-char", "200-chars", "empty", "201-chars", "non-ascii", "unprintable"],
)
async def test_a_clients_request_id_is_kept_when_short_printable_ascii(
    autojump_clock: trio.abc.Clock, rid: str, kept: bool
) -> None:
    async with open_stack() as stack:
        resp = await stack.client.post("/v1/completions", json=BODY, headers={"x-request-id": rid.encode()})
    assert resp.status_code == 200
    assert (stack.records[0]["request_id"] == rid) is kept
    assert (resp.headers["x-request-id"] == rid) is kept


@pytest.mark.parametrize(("engine_name", "leg"), [("p0", "prefill"), ("d0", "decode")])
async def test_a_success_clears_both_engines_failure_streaks(
    autojump_clock: trio.abc.Clock, engine_name: str, leg: str
) -> None:
    async with open_stack(fleet_doc(recovery={"eject_after": 3})) as stack:
        stack.engine(engine_name).inject(FaultSpec(kind="http_error", on=leg, status=500, times=1))  # type: ignore[arg-type]
        assert (await stack.complete(BODY)).status_code == 502
        states = stack.router.state.breaker.states
        assert states[engine_name].streak == 1
        assert (await stack.complete(BODY)).status_code == 200
        assert (states["p0"].streak, states["d0"].streak) == (0, 0)


# ------------------------------------------------------------------ a client that stops reading


class _Pausing(trio.abc.ReceiveStream):
    """A client's end that reads the answer's head and first event, then reads nothing
    for ``pause_s`` (``math.inf``: never again)."""

    def __init__(self, stream: trio.abc.ReceiveStream, pause_s: float) -> None:
        self.stream, self.pause_s = stream, pause_s
        self.seen_event = self.paused = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self.seen_event and not self.paused:
            self.paused = True
            await trio.sleep(self.pause_s)
        data = await self.stream.receive_some(max_bytes)
        self.seen_event = self.seen_event or b"data: " in data
        return data

    async def aclose(self) -> None:
        await self.stream.aclose()


async def test_a_write_that_waits_for_the_client_is_not_engine_silence(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Over a lockstep stream every write waits until the client reads it (true
    # backpressure, which the in-memory network does not have). After the first token
    # the client stops reading for 5 silence bounds: the engine kept sending, the
    # router's write waited, and the stream still ends whole.
    async with open_stack(fleet_doc(engine={"decode_read_timeout_s": 2.0})) as stack:
        client, server = trio.testing.lockstep_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stack.router.server.handle_connection, server)
            await client.send_all(request_bytes({**BODY, "max_tokens": 20, "stream": True}, request_id="slow"))
            out = await read_response(_Pausing(client, 10.0), Outcome("slow"))
            await trio.sleep(1.0)  # the router's last write returns once the client read it
            await client.aclose()
    assert out.ok and out.tokens == 20
    [rec] = stack.records
    assert (rec["terminal_class"], rec["output_len"]) == ("ok", 20)


@pytest.mark.parametrize("stream", [True, False])
async def test_shutdown_while_the_answers_write_waits_for_the_client(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    # The client never reads: the answer's first write (a stream's head and first token,
    # or the whole answer) waits when the shutdown's grace period ends. A response
    # already started cannot become a 503: the request ends quietly, journaled as shut down.
    async with open_stack() as stack:
        client, server = trio.testing.lockstep_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stack.router.server.handle_connection, server)
            await client.send_all(request_bytes({**BODY, "stream": stream}, request_id="stuck"))
            await trio.sleep(1.0)
            await stack.router.shutdown(2.0)
            await client.aclose()
    [rec] = stack.records
    assert (rec["terminal_class"], rec["status"]) == ("shutdown", 503)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
