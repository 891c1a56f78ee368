"""Resuming a broken decode on another engine (``recovery.resume_streams``).

A fleet of one producer ``p0`` and two consumers ``d0`` and ``d1``, in memory and in
virtual time; the first attempt decodes on ``d0`` (ties go to the first engine), which
is scripted to fail after a few tokens. The simulated engines decode greedily: every
engine of the model generates the same tokens for the same token context, so a stream
that survives its consumer must deliver exactly the tokens of an uninterrupted run,
each once, in order.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.config import EngineTimeouts, FaultSpec
from narwhal.engines.client import EngineClient
from narwhal.errors import EngineUnavailable
from narwhal.testing.outputs import completion_logprobs
from narwhal.testing.tokenizer import encode, encode_chat, greedy_tokens, token_text

from .routerkit import Stack, engine, fleet_doc, open_stack, scripted_decodes

MODEL = "sim-llama"
PROMPT = "one two three four five six"
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX_TOKENS = 10
SILENCE_S = EngineTimeouts().decode_read_timeout_s
ADMIN = ("127.0.0.1", 8001)


def doc(*engines: dict[str, Any], **recovery: Any) -> dict[str, Any]:
    fleet = engines or (engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]))
    return fleet_doc(*fleet, recovery={"resume_streams": True, **recovery})


def prompt_ids(route: str) -> list[int]:
    return encode_chat(MESSAGES) if route == "chat" else encode(PROMPT)


def expected(route: str, n: int = MAX_TOKENS) -> list[int]:
    return greedy_tokens(MODEL, prompt_ids(route), n)


def text_of(ids: list[int]) -> str:
    return "".join(token_text(t) for t in ids)


@attrs.frozen
class Answer:
    """What a client got: the events of a stream (or the body of a plain answer)."""

    status: int
    events: list[Any]
    body: dict[str, Any] | None = None

    @property
    def data(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict)]

    @property
    def token_ids(self) -> list[int]:
        if self.body is not None:
            return list(self.body["choices"][0]["token_ids"])
        return [t for e in self.data for c in e.get("choices") or () for t in c.get("token_ids") or ()]

    @property
    def text(self) -> str:
        if self.body is not None:
            choice = self.body["choices"][0]
            return str(choice["message"]["content"] if "message" in choice else choice["text"])
        parts = []
        for e in self.data:
            for c in e.get("choices") or ():
                parts.append(c["delta"].get("content") or "" if "delta" in c else c["text"])
        return "".join(parts)

    @property
    def finish(self) -> tuple[Any, Any]:
        if self.body is not None:
            choice = self.body["choices"][0]
            return choice["finish_reason"], choice["stop_reason"]
        last = [c for e in self.data for c in e.get("choices") or () if c.get("finish_reason")]
        assert len(last) == 1, self.events  # one finish, on the last token
        return last[0]["finish_reason"], last[0].get("stop_reason")

    @property
    def usage(self) -> dict[str, Any]:
        if self.body is not None:
            return dict(self.body["usage"])
        [usage] = [e["usage"] for e in self.data if e.get("usage")]
        return dict(usage)


async def ask(stack: Stack, route: str, mode: str, **fields: Any) -> Answer:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "return_token_ids": True, **fields}
    body.update({"messages": MESSAGES} if route == "chat" else {"prompt": PROMPT})
    if mode == "plain":
        resp = await stack.client.post(path, json=body)
        return Answer(resp.status_code, [], resp.json())
    body["stream_options"] = {"include_usage": True}
    status, events = await stack.stream(body, path=path)
    return Answer(status, events)


def assert_whole(answer: Answer, route: str, mode: str, n: int = MAX_TOKENS) -> None:
    """Every token of an uninterrupted greedy run, each once, in one well-formed answer."""
    assert answer.status == 200, answer.events or answer.body
    assert answer.token_ids == expected(route, n)
    assert answer.text == text_of(expected(route, n))
    assert answer.usage["prompt_tokens"] == len(prompt_ids(route))
    assert answer.usage["completion_tokens"] == n and answer.usage["total_tokens"] == n + len(prompt_ids(route))
    assert answer.finish == ("length", None)
    if mode == "stream":
        assert answer.events[-1] == "[DONE]" and not any("error" in e for e in answer.data)
        # One response id and one object type throughout, as one engine's stream.
        assert len({e["id"] for e in answer.data}) == 1
        kind = "chat.completion.chunk" if route == "chat" else "text_completion"
        assert {e["object"] for e in answer.data} == {kind}
        if route == "chat":
            roles = [e for e in answer.data if e["choices"] and "role" in e["choices"][0]["delta"]]
            assert roles == answer.data[:1]  # the role once, first
        # The prompt's ids once, on the first event that carries them.
        carried = [e for e in answer.data if e.get("prompt_token_ids") or
                   any(c.get("prompt_token_ids") for c in e.get("choices") or ())]  # fmt: skip
        assert carried == answer.data[:1]


# ---------------------------------------------------------------- every decode fault


@attrs.frozen
class Fault:
    kind: str
    cause: str  # the resume's cause (what broke the stream)
    outcome: str  # the broken attempt's outcome


FAULTS = [
    Fault("close_before_done", "stream_closed", "decode_failed"),
    Fault("silence_after", "silence_timeout", "silence_timeout"),
    Fault("error_in_stream", "engine_stream_error", "decode_failed"),
    Fault("restart", "stream_closed", "decode_failed"),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("mode", ["stream", "plain"])
@pytest.mark.parametrize("fault", FAULTS, ids=[f.kind for f in FAULTS])
async def test_a_decode_that_breaks_after_tokens_continues_on_another_engine(
    autojump_clock: trio.abc.Clock, fault: Fault, mode: str, route: str
) -> None:
    async with open_stack(doc()) as stack:
        await trio.sleep(100.0)  # (times count from the request's arrival, not the clock's zero)
        stack.engine("d0").inject(FaultSpec(kind=fault.kind, on="decode", after_tokens=3, status=503, times=1))  # type: ignore[arg-type]
        answer = await ask(stack, route, mode)
        assert_whole(answer, route, mode)
        [record] = stack.records
        broken, resumed = record["attempts"]
        assert record["terminal_class"] == "ok" and record["status"] == 200 and record["output_len"] == MAX_TOKENS
        assert (broken["consumer"], broken["outcome"], broken["output_tokens"]) == ("d0", fault.outcome, 3)
        assert broken["resume"] is None and broken["not_resumed"] is None
        assert (resumed["consumer"], resumed["outcome"], resumed["output_tokens"]) == ("d1", "ok", MAX_TOKENS - 3)
        assert resumed["resume"] == fault.cause
        assert broken["first_token_s"] < resumed["resumed_at_s"] <= resumed["started_s"] < resumed["first_token_s"]
        if fault.kind == "silence_after":  # the break is seen when the silence bound passes
            assert resumed["resumed_at_s"] >= broken["first_token_s"] + SILENCE_S
        # The request's first token and TTFT are the original attempt's.
        assert record["first_byte_s"] == broken["first_token_s"] and record["ttft_s"] == broken["ttft_s"]
        # The continuation: the prompt's ids and the 3 tokens sent, as a token-id prompt.
        [sent] = [b for b in stack.engine("d1").requests_seen if b.get("stream")]
        assert sent["prompt"] == prompt_ids(route) + expected(route)[:3]
        assert sent["max_tokens"] == MAX_TOKENS - 3 and "messages" not in sent
        # The breaker counts the failure against the engine that failed, and only it.
        states = stack.router.state.breaker.states
        assert (states["d0"].streak, states["d1"].streak, states["p0"].streak) == (1, 0, 0)


async def test_resumes_are_off_by_default(autojump_clock: trio.abc.Clock) -> None:
    # Seed 001's rule: the stream ends with the terminal event.
    async with open_stack(fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
                                    engine("d1", 8103, ["decode"]))) as stack:  # fmt: skip
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        answer = await ask(stack, "completions", "stream")
        assert answer.status == 200 and "error" in answer.events[-1]
        assert answer.token_ids == expected("completions")[:3]
        [record] = stack.records
        [attempt] = record["attempts"]
        assert record["terminal_class"] == "decode_failed" and attempt["output_tokens"] == 3
        assert attempt["not_resumed"] is None  # nothing was considered


async def test_a_same_worker_resume_on_a_producer_that_also_decodes(autojump_clock: trio.abc.Clock) -> None:
    # The consumer dies; the producer, which may decode, continues the stream itself.
    fleet = (engine("d0", 8102, ["decode"]), engine("b0", 8101, ["prefill", "decode"]))
    async with open_stack(doc(*fleet)) as stack:
        stack.engine("d0").inject(FaultSpec(kind="restart", on="decode", after_tokens=4, times=1))
        assert_whole(await ask(stack, "completions", "stream"), "completions", "stream")
        broken, resumed = stack.records[0]["attempts"]
        assert (broken["producer"], broken["consumer"], broken["same_worker"]) == ("b0", "d0", False)
        assert (resumed["producer"], resumed["consumer"], resumed["same_worker"]) == ("b0", "b0", True)
        assert resumed["outcome"] == "ok"


# ---------------------------------------------------------------- resumes that fail in turn


async def test_resumes_that_fail_in_turn(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
                              engine("d1", 8103, ["decode"]), engine("d2", 8104, ["decode"]),
                              max_resumes=3)) as stack:  # fmt: skip
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        # The first resume fails before its first token, the second after two of its own.
        stack.engine("d2").inject(FaultSpec(kind="http_error", on="decode", status=503, times=1))
        stack.engine("d1").inject(FaultSpec(kind="silence_after", on="decode", after_tokens=2, times=1))
        answer = await ask(stack, "completions", "stream")
        assert_whole(answer, "completions", "stream")
        attempts = stack.records[0]["attempts"]
        assert [(a["consumer"], a["outcome"], a["output_tokens"], a["resume"]) for a in attempts] == [
            ("d0", "decode_failed", 3, None),
            ("d2", "decode_failed", 0, "stream_closed"),
            ("d1", "silence_timeout", 2, "engine_http_error"),
            # Every consumer failed this request: the least loaded again (its fault spent).
            ("d0", "ok", MAX_TOKENS - 5, "silence_timeout"),
        ]
        # The last resume's prompt holds all 5 tokens delivered before it.
        last = [b for b in stack.engine("d0").requests_seen if b.get("stream")][-1]
        assert last["prompt"] == prompt_ids("completions") + expected("completions")[:5]


@pytest.mark.parametrize("mode", ["stream", "plain"])
async def test_the_limit_on_resumes_ends_the_stream_as_before(autojump_clock: trio.abc.Clock, mode: str) -> None:
    async with open_stack(doc(max_resumes=1)) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        stack.engine("d1").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=2, times=1))
        answer = await ask(stack, "completions", mode)
        [record] = stack.records
        if mode == "stream":
            assert answer.status == 200 and set(answer.events[-1]) == {"error"}
            # Every token once, in order, up to the break that was not resumed.
            assert answer.token_ids == expected("completions")[:5]
        else:
            assert answer.status == 502 and "error" in answer.body  # type: ignore[operator]
        assert record["terminal_class"] == "decode_failed" and record["output_len"] == 5
        assert record["attempts"][-1]["not_resumed"] == "recovery.max_resumes (1) reached"
        assert len(record["attempts"]) == 2


async def test_no_resume_the_request_deadline_leaves_no_time_for(autojump_clock: trio.abc.Clock) -> None:
    sections = {"engine": {"request_timeout_s": 10.0, "first_token_timeout_s": 5.0, "decode_read_timeout_s": 6.0}}
    async with open_stack(doc(**{}) | sections) as stack:
        stack.engine("d0").inject(FaultSpec(kind="silence_after", on="decode", after_tokens=2, times=1))
        answer = await ask(stack, "completions", "stream")
        assert answer.status == 200 and answer.events[-1]["error"]["type"] == "timeout_error"
        [attempt] = stack.records[0]["attempts"]
        assert attempt["not_resumed"].startswith("the request deadline leaves no time for a first token")


async def test_a_stream_whose_last_token_arrived_is_not_resumed(autojump_clock: trio.abc.Clock) -> None:
    # The engine sent its finish, then closed before [DONE]: nothing is left to generate.
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=MAX_TOKENS, times=1))
        answer = await ask(stack, "completions", "stream")
        assert answer.token_ids == expected("completions") and "error" in answer.events[-1]
        [attempt] = stack.records[0]["attempts"]
        assert attempt["not_resumed"] == "the engine had sent its last token"


async def test_a_break_before_the_last_token_resumes_for_one_token(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=MAX_TOKENS - 1, times=1))
        assert_whole(await ask(stack, "completions", "stream"), "completions", "stream")
        [sent] = [b for b in stack.engine("d1").requests_seen if b.get("stream")]
        assert sent["max_tokens"] == 1


def scripted(events: list[dict[str, Any]]) -> Any:
    """d0 answers every decode with these events, then ends the body (no [DONE])."""
    return scripted_decodes([(0.001, b"data: " + json.dumps(e).encode() + b"\n\n") for e in events])


def completion_event(token: int, **choice: Any) -> dict[str, Any]:
    return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": token_text(token), "finish_reason": None, "token_ids": [token], **choice}]}  # fmt: skip


async def test_without_the_prompts_token_ids_a_stream_is_not_resumed(autojump_clock: trio.abc.Clock) -> None:
    # The engine did not say the prompt's token ids: a string prompt cannot be continued;
    # a prompt given as token ids can.
    events = [completion_event(t) for t in expected("completions")[:2]]
    async with open_stack(doc(), wrap=scripted(events)) as stack:
        answer = await ask(stack, "completions", "stream")
        assert "error" in answer.events[-1] and answer.token_ids == expected("completions")[:2]
        [attempt] = stack.records[0]["attempts"]
        assert attempt["not_resumed"] == "the prompt's token ids are unknown (the engine did not report them)"
    async with open_stack(doc(), wrap=scripted(events)) as stack:
        status, got = await stack.stream({"prompt": encode(PROMPT), "max_tokens": MAX_TOKENS, "return_token_ids": True})
        assert status == 200 and got[-1] == "[DONE]"
        assert Answer(status, got).token_ids == expected("completions")
        assert [a["outcome"] for a in stack.records[0]["attempts"]] == ["decode_failed", "ok"]


async def test_a_message_with_reasoning_is_not_resumed(autojump_clock: trio.abc.Clock) -> None:
    token = expected("chat")[0]
    event = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
             "prompt_token_ids": prompt_ids("chat"),
             "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}, "finish_reason": None, "token_ids": [token]}]}  # fmt: skip
    async with open_stack(doc(), wrap=scripted([event])) as stack:
        answer = await ask(stack, "chat", "stream")
        assert "error" in answer.events[-1]
        [attempt] = stack.records[0]["attempts"]
        assert attempt["not_resumed"].startswith("the message carries reasoning or tool calls")


async def test_an_engine_that_rejects_the_continuation_ends_the_stream(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        stack.engine("d1").inject(FaultSpec(kind="http_error", on="decode", status=400, message="no", times=1))
        answer = await ask(stack, "completions", "stream")
        assert answer.events[-1]["error"]["type"] == "invalid_request_error"
        assert answer.token_ids == expected("completions")[:3]
        attempts = stack.records[0]["attempts"]
        assert [a["outcome"] for a in attempts] == ["decode_failed", "invalid_request"]
        assert attempts[1]["not_resumed"] == "the engine rejected the request itself"
        assert stack.router.state.breaker.states["d1"].streak == 0  # the client's fault, not d1's


async def test_text_held_back_that_no_engine_can_detokenize_ends_the_stream(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable(self: EngineClient, ids: Any, *, model: str | None = None) -> str:
        raise EngineUnavailable(f"engine {self.name} unreachable", engine=self.name)

    monkeypatch.setattr(EngineClient, "detokenize", unreachable)
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        answer = await ask(stack, "completions", "stream", stop=["zzzz-never"])
        assert "error" in answer.events[-1]
        [attempt] = stack.records[0]["attempts"]
        assert attempt["not_resumed"].startswith("the text held back at the break is unknown: engine ")


UNRESUMABLE = [
    ({"echo": True}, "echo repeats the prompt"),
    ({"frequency_penalty": 0.5}, "frequency_penalty weighs the output so far"),
    ({"presence_penalty": -1.0}, "presence_penalty weighs the output so far"),
    ({"seed": 7, "temperature": 0.8}, "a seeded sampler's random stream starts over"),
    ({"response_format": {"type": "json_object"}}, "a response_format grammar starts over"),
    ({"guided_regex": "[a-z]+"}, "a guided decoding grammar starts over"),
]


@pytest.mark.parametrize(("fields", "why"), UNRESUMABLE, ids=[next(iter(f)) for f, _ in UNRESUMABLE])
async def test_what_a_continuation_cannot_reproduce_ends_as_before(
    autojump_clock: trio.abc.Clock, fields: dict[str, Any], why: str
) -> None:
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        answer = await ask(stack, "completions", "stream", **fields)
        assert answer.status == 200 and "error" in answer.events[-1]
        [attempt] = stack.records[0]["attempts"]
        assert attempt["not_resumed"].startswith(why)


async def test_a_chat_with_tools_is_not_resumed(autojump_clock: trio.abc.Clock) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        answer = await ask(stack, "chat", "stream", tools=tools)
        assert "error" in answer.events[-1]
        assert stack.records[0]["attempts"][0]["not_resumed"] == "tool calls are parsed from the whole message"


# ---------------------------------------------------------------- logprobs, stop strings, sampling


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_logprobs_continue(autojump_clock: trio.abc.Clock, route: str) -> None:
    fields = {"logprobs": True, "top_logprobs": 2} if route == "chat" else {"logprobs": 2}

    def logprobs(answer: Answer) -> list[Any]:
        return [c["logprobs"] for e in answer.data for c in e.get("choices") or () if c.get("token_ids")]

    async with open_stack(doc()) as stack:
        whole = await ask(stack, route, "stream", **fields)
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=4, times=1))
        resumed = await ask(stack, route, "stream", **fields)
        assert len(stack.records[0]["attempts"]) == 2
    assert_whole(resumed, route, "stream")
    assert logprobs(resumed) == logprobs(whole) and len(logprobs(whole)) == MAX_TOKENS
    if route == "completions":  # text offsets count from the start of the client's text
        ids = expected(route)
        offsets = [len(text_of(ids[:i])) for i in range(MAX_TOKENS)]
        assert [lp["text_offset"][0] for lp in logprobs(resumed)] == offsets
        assert logprobs(resumed)[5] == completion_logprobs(ids[5], 2, offsets[5])


def stop_across(route: str, at: int, size: int) -> tuple[str, int]:
    """A stop string of ``size`` characters that begins in the text of the tokens before
    token ``at`` and ends in a later token's (it spans a break after ``at`` tokens); its
    first index in the whole text, which it first occurs at."""
    ids = expected(route, 40)
    whole = text_of(ids)
    boundary = len(text_of(ids[:at]))
    for start in range(boundary - size + 1, boundary):
        stop = whole[start : start + size]
        if start >= 0 and whole.find(stop) == start and stop.strip() == stop and len(stop) == size:
            return stop, start
    raise AssertionError("no stop string spans the break")


@pytest.mark.parametrize("mode", ["stream", "plain"])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_a_stop_string_across_the_break(autojump_clock: trio.abc.Clock, route: str, include: bool, mode: str) -> None:
    # The break comes after 6 tokens; the stop string begins before it and ends after
    # it, where neither engine can see it whole: the router finds it. The engine held
    # back the stop's first characters when the stream broke (they could begin a stop
    # string): the router recovers them with /detokenize.
    stop, at = stop_across(route, 6, 4)
    fields = {"max_tokens": 40, "stop": ["zzzzzz-never", stop], "include_stop_str_in_output": include}
    async with open_stack(doc()) as stack:
        whole = await ask(stack, route, mode, **fields)
    end = at + len(stop) if include else at
    assert whole.text == text_of(expected(route, 40))[:end] and whole.finish == ("stop", stop)
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=6, times=1))
        resumed = await ask(stack, route, mode, **fields)
        attempts = stack.records[0]["attempts"]
        assert [a["outcome"] for a in attempts] == ["decode_failed", "ok"]
        detokenized = sum(e.stats.calls.get("/detokenize", 0) for e in stack.fleet.engines.values())
        assert detokenized == (0 if include else 2)  # only text an engine may have held back
    assert resumed.text == whole.text and resumed.token_ids == whole.token_ids
    assert resumed.finish == ("stop", stop)
    n = len(whole.token_ids)
    assert resumed.usage["completion_tokens"] == n == stack.records[0]["output_len"]
    if mode == "stream":
        assert resumed.events[-1] == "[DONE]"
        kind = "chat.completion.chunk" if route == "chat" else "text_completion"
        assert {e["object"] for e in resumed.data} == {kind} and len({e["id"] for e in resumed.data}) == 1


@pytest.mark.parametrize("mode", ["stream", "plain"])
async def test_stop_strings_that_do_not_span_the_break(autojump_clock: trio.abc.Clock, mode: str) -> None:
    # One ends the continuation (its engine finds it); text held back at the break and
    # by the router while it looked across the break all reaches the client.
    ids = expected("completions", 40)
    whole_text = text_of(ids)
    late = len(text_of(ids[:12]))
    stop = next(whole_text[i : i + 3] for i in range(late, len(whole_text)) if whole_text.find(whole_text[i : i + 3]) == i)
    fields = {"max_tokens": 40, "stop": [stop, "qqqqqqq-never"]}
    async with open_stack(doc()) as stack:
        whole = await ask(stack, "completions", mode, **fields)
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=5, times=1))
        resumed = await ask(stack, "completions", mode, **fields)
    assert whole.finish == resumed.finish == ("stop", stop)
    assert resumed.text == whole.text == whole_text[: whole_text.find(stop)]
    assert resumed.token_ids == whole.token_ids


async def test_min_tokens_and_sampling_settings_carry_over(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        await ask(stack, "chat", "stream", min_tokens=8, temperature=0, top_p=0.9, max_completion_tokens=MAX_TOKENS,
                  logprobs=True, top_logprobs=3, seed=11)  # fmt: skip
        [sent] = [b for b in stack.engine("d1").requests_seen if b.get("stream")]
    assert sent["min_tokens"] == 5 and sent["max_tokens"] == MAX_TOKENS - 3
    assert (sent["temperature"], sent["top_p"], sent["seed"], sent["logprobs"]) == (0, 0.9, 11, 3)
    assert not {"messages", "max_completion_tokens", "top_logprobs"} & set(sent)


# ---------------------------------------------------------------- cleanup and metrics


async def test_a_client_that_leaves_during_a_resume_leaves_nothing_behind(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(doc()) as stack:
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        stack.engine("d1").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=20.0, times=1))
        with trio.move_on_after(5.0):
            await ask(stack, "completions", "stream")
        await trio.testing.wait_all_tasks_blocked()
        [record] = stack.records
        assert record["terminal_class"] == "client_cancelled"
        assert [a["outcome"] for a in record["attempts"]] == ["decode_failed", "client_cancelled"]
    # open_stack checked: no reservation, in-flight count or connection left.


async def test_metrics_count_resumes_by_cause(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(doc()) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        stack.engine("d0").inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=3, times=1))
        await ask(stack, "completions", "stream")
        stack.engine("d0").inject(FaultSpec(kind="error_in_stream", on="decode", after_tokens=1, times=1))
        stack.engine("d1").inject(FaultSpec(kind="error_in_stream", on="decode", after_tokens=1, times=1))
        await ask(stack, "completions", "stream")
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            text = (await admin.get("/metrics")).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("narwhal_resumes_total", "narwhal_retries_total"))}  # fmt: skip
    assert samples == {'narwhal_resumes_total{cause="stream_closed"}': 1.0,
                       # (the first resume broke too, and was resumed in turn)
                       'narwhal_resumes_total{cause="engine_stream_error"}': 2.0,
                       "narwhal_retries_total": 0.0}  # fmt: skip
    assert json.dumps(stack.records)  # (the records serialise)
