"""The resume ledger's rules, without engines: stop strings across a break, usage,
logprobs, the continuation's body, and what cannot be resumed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.engines.sse import Chunk
from narwhal.router.requests import parse_request
from narwhal.router.resume import (
    Continuation,
    StreamLedger,
    chat_logprobs,
    continuation_body,
    unresumable,
)
from narwhal.router.state import PromptCount
from narwhal.testing.outputs import OutputText
from narwhal.testing.tokenizer import FIRST_WORD_ID, token_text

PROMPT_IDS = [300, 301, 302]


def ledger(body: dict[str, Any], kind: str = "completions") -> StreamLedger:
    base = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "p"}
    parsed = parse_request(json.dumps({**base, **body}).encode(), kind)  # type: ignore[arg-type]
    return StreamLedger(parsed, "rid")


def event(token: int, text: str, finish: str | None, *, first: bool = False, **choice: Any) -> Chunk:
    """A completions token event as an engine streams it (one token)."""
    chosen = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
              "prompt_token_ids": PROMPT_IDS if first else None, "token_ids": [token], **choice}  # fmt: skip
    data = {"id": "cmpl-engine", "object": "text_completion", "created": 7, "model": "m", "choices": [chosen]}
    return Chunk("token", b"data: " + json.dumps(data).encode() + b"\n\n", data, (token,), 1, text, finish)


def resume(led: StreamLedger, held: str, sent: int = 0) -> None:
    led.begin(Continuation({}, PromptCount(3, None, exact=True), 10, "stream_closed", 1.0), held)


# ------------------------------------------------------------------ stop strings

TOKENS = st.lists(st.integers(FIRST_WORD_ID, FIRST_WORD_ID + 400), min_size=2, max_size=40)


@settings(max_examples=400, deadline=None)
@given(
    ids=TOKENS,
    stops=st.lists(st.text(alphabet="abcdefghij ", min_size=1, max_size=5), min_size=1, max_size=3),
    include=st.booleans(),
    at=st.integers(1, 39),
)
def test_a_resumed_stream_stops_where_the_whole_stream_stops(
    ids: list[int], stops: list[str], include: bool, at: int
) -> None:
    """The uninterrupted engine's output (the simulator's detokenizer, vLLM's rule) against
    a stream broken after ``at`` tokens and resumed: its engine sends the raw text of its
    tokens (it is not told the stop strings), the text held back at the break comes from
    a detokenization, and the router applies the stop strings. Same text, same tokens,
    same finish."""
    whole = OutputText(stops, include_stop=include)
    events: list[tuple[int, str, str | None]] = []
    for i, token in enumerate(ids):
        whole.add(token)
        finish = "stop" if whole.stop_reason is not None else "length" if i == len(ids) - 1 else None
        events.append((token, whole.take(finish is not None), finish))
        if finish is not None:
            break
    if at >= len(events):
        return  # the stream ended before the break
    led = ledger({"stop": stops, "include_stop_str_in_output": include, "max_tokens": len(ids)})
    out_text, out_ids = [], []
    for i, (token, text, _) in enumerate(events[:at]):
        relayed = led.relay(event(token, text, None, first=i == 0))
        out_text.append(relayed.text)
        out_ids += relayed.token_ids
    generated = "".join(token_text(t) for t in ids[:at])
    resume(led, generated[len("".join(out_text)) :])
    finish = None
    for i, token in enumerate(ids[at:], at):
        relayed = led.relay(event(token, token_text(token), "length" if i == len(ids) - 1 else None))
        out_text.append(relayed.text)
        out_ids += relayed.token_ids
        finish = relayed.finish_reason
        if finish is not None:
            assert relayed.data is not None
            stop_reason = relayed.data["choices"][0]["stop_reason"]
            break
    assert "".join(out_text) == whole.text
    assert out_ids == [t for t, _, _ in events]
    assert (finish, stop_reason) == (events[-1][2], whole.stop_reason)
    assert (led.stopped is not None) == (finish == "stop")


def test_text_held_back_waits_for_what_may_complete_a_stop_string() -> None:
    led = ledger({"stop": ["abcd"]})
    assert led.holds_text
    led.relay(event(400, "xy", None, first=True))
    resume(led, "zab")  # the engine held "zab" (3 = len("abcd") - 1 characters)
    first = led.relay(event(401, "c", None))
    assert first.text == "z"  # "abc" may still begin "abcd": the last 3 characters wait
    second = led.relay(event(402, "q", None))
    assert second.text == "a"
    last = led.relay(event(403, "r", "length"))  # the end: everything goes
    assert last.text == "bcqr" and last.finish_reason == "length" and led.stopped is None
    assert not ledger({"stop": ["abcd"], "include_stop_str_in_output": True}).holds_text
    assert not ledger({"stop": ["a"]}).holds_text


# ------------------------------------------------------------------ events, usage, logprobs


def test_a_continuation_event_is_the_clients() -> None:
    led = ledger({"logprobs": 1, "stream_options": {"include_usage": True}})
    led.relay(event(400, "ab", None, first=True))
    resume(led, "")
    lp = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": ["c"], "top_logprobs": [{"c": -0.5}]}
    out = led.relay(event(401, "c", None, first=True, logprobs=lp))
    assert out.data is not None
    choice = out.data["choices"][0]
    assert choice["prompt_token_ids"] is None  # the client had the original prompt's
    assert choice["logprobs"]["text_offset"] == [2]  # after "ab"
    assert out.token_ids == (401,) and out.raw == b"data: " + json.dumps(out.data, separators=(",", ":")).encode() + b"\n\n"
    usage = {"id": "cmpl-engine", "object": "text_completion", "created": 7, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}  # fmt: skip
    relayed = led.relay(Chunk("meta", b"", usage, usage=usage["usage"]))
    assert relayed.data is not None and relayed.data["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert relayed.usage == relayed.data["usage"]
    empty = Chunk("meta", b"data: {}\n\n", {"id": "x", "choices": []})
    assert led.relay(empty) is empty  # nothing of the client's in it


def test_chat_continuation_events_are_chat_chunks() -> None:
    led = ledger({"logprobs": True, "top_logprobs": 1}, "chat")
    role = {"id": "chatcmpl-e", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "prompt_token_ids": PROMPT_IDS, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}  # fmt: skip
    led.relay(Chunk("meta", b"", role))
    assert led.prompt_ids == PROMPT_IDS
    resume(led, "")
    lp = {"text_offset": [9], "token_logprobs": [-0.5], "tokens": ["é"], "top_logprobs": [{"é": -0.5, "x": -2.0}]}
    out = led.relay(event(401, "é", "stop", logprobs=lp, stop_reason="eos"))
    assert out.data == {
        "id": "chatcmpl-rid", "object": "chat.completion.chunk", "created": 5, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "é"}, "finish_reason": "stop", "stop_reason": "eos",
                     "token_ids": [401], "logprobs": {"content": [
                         {"token": "é", "logprob": -0.5, "bytes": [195, 169],
                          "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]}]}]}}],
    }  # fmt: skip
    assert json.loads(led.usage_event()[6:]) == {
        "id": "chatcmpl-rid", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": [],
        "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1},
    }  # fmt: skip


def test_usage_counts_the_original_prompt_and_every_token_once() -> None:
    led = ledger({})
    led.relay(event(400, "a", None, first=True))
    led.relay(event(401, "b", None))
    reported = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                "prompt_tokens_details": {"cached_tokens": 5, "other": 1}}  # fmt: skip
    assert led.usage(reported) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                   "prompt_tokens_details": {"cached_tokens": 3, "other": 1}}  # fmt: skip
    assert led.usage({"prompt_tokens_details": {"cached_tokens": 1}})["prompt_tokens_details"] == {"cached_tokens": 1}
    assert json.loads(ledger({}).usage_event()[6:])["object"] == "text_completion"


def test_chat_logprobs_from_completions_logprobs() -> None:
    lp = {"tokens": ["a", "b"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0, "z": -3.0}, None]}
    assert chat_logprobs(lp, 2) == {"content": [
        {"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": [
            {"token": "a", "logprob": -1.0, "bytes": [97]}, {"token": "z", "logprob": -3.0, "bytes": [122]}]},
        {"token": "b", "logprob": None, "bytes": [98], "top_logprobs": []},
    ]}  # fmt: skip
    assert chat_logprobs({"tokens": ["\udc80"]}, 0)["content"][0]["bytes"] == [63]  # (a lone surrogate)


def test_what_the_stream_shows_can_block_a_resume() -> None:
    led = ledger({}, "chat")
    reasoning = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}, "token_ids": [9]}]}
    led.relay(Chunk("token", b"", reasoning, (9,), 1))
    assert led.blocked is not None and "reasoning" in led.blocked
    led = ledger({})
    led.relay(Chunk("token", b"", {"choices": [{"text": "a"}]}, (), 1, "a"))
    assert led.blocked == "the engine sent output without its token ids"
    led = ledger({})
    led.relay(Chunk("token", b"", {"choices": [{"text": "a", "token_ids": [1], "prompt_token_ids": ["x"]}]}, (1,), 1))
    assert led.prompt_ids is None and led.blocked is None
    led.relay(event(2, "b", "length"))
    assert led.finished and led.ids == [1, 2] and led.delivered == ["b"]


# ------------------------------------------------------------------ the continuation's request


def test_the_continuation_body() -> None:
    body = {"messages": [], "max_completion_tokens": 9, "top_logprobs": 2, "logprobs": True, "stop": ["x"],
            "include_stop_str_in_output": True, "stream": True, "stream_options": {}, "return_token_ids": True,
            "temperature": 0, "min_tokens": 4, "echo": False, "model": "m", "seed": 3}  # fmt: skip
    assert continuation_body(body, [1, 2], 6, 3, 2, "chat") == {
        "prompt": [1, 2], "max_tokens": 6, "min_tokens": 1, "logprobs": 2, "temperature": 0, "model": "m", "seed": 3,
    }  # fmt: skip
    assert continuation_body({"prompt": "p", "logprobs": 1, "min_tokens": 2}, [5], 1, 7, None, "completions") == {
        "prompt": [5], "max_tokens": 1, "logprobs": 1, "min_tokens": 0,
    }  # fmt: skip
    assert "logprobs" not in continuation_body({"logprobs": False}, [5], 1, 0, None, "chat")


NOT_RESUMABLE = [
    {"echo": True}, {"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"bad_words": ["x"]},
    {"guided_json": {"type": "object"}}, {"guided_regex": "a"}, {"guided_choice": ["a"]}, {"guided_grammar": "g"},
    {"structured_outputs": {"regex": "a"}}, {"logits_processors": ["p"]}, {"prompt_embeds": "e"},
    {"response_format": {"type": "json_schema"}}, {"seed": 1}, {"seed": 1, "temperature": 0.5},
    {"stream_options": {"continuous_usage_stats": True}},
]  # fmt: skip
RESUMABLE = [
    {}, {"echo": False}, {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"bad_words": []},
    {"response_format": {"type": "text"}}, {"response_format": None}, {"seed": 1, "temperature": 0},
    {"stream_options": {"include_usage": True}}, {"logprobs": 3, "stop": ["a"], "min_tokens": 2},
]  # fmt: skip


@pytest.mark.parametrize("fields", NOT_RESUMABLE, ids=[json.dumps(f) for f in NOT_RESUMABLE])
def test_what_a_continuation_cannot_reproduce(fields: dict[str, Any]) -> None:
    parsed = parse_request(json.dumps({"prompt": "p", **fields}).encode(), "completions")
    assert unresumable(parsed)


@pytest.mark.parametrize("fields", RESUMABLE, ids=[json.dumps(f) for f in RESUMABLE])
def test_what_a_continuation_reproduces(fields: dict[str, Any]) -> None:
    parsed = parse_request(json.dumps({"prompt": "p", **fields}).encode(), "completions")
    assert unresumable(parsed) is None


def test_chat_tools_and_multimodal_content() -> None:
    def chat(**fields: Any) -> str | None:
        body = {"messages": [{"role": "user", "content": "hi"}], **fields}
        return unresumable(parse_request(json.dumps(body).encode(), "chat"))

    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=tools) == chat(tools=tools, tool_choice="auto") == "tool calls are parsed from the whole message"
    assert chat(tools=tools, tool_choice="none") is None and chat(tools=[]) is None
    image = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]
    assert chat(messages=[{"role": "user", "content": image}]) == "a multimodal prompt has no token ids to continue"
    assert chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}]) is None
