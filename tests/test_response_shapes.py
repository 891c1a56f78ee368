"""OpenAI/vLLM-exact answers: the non-streamed body relays what the engine sent
(logprobs, prompt ids when asked, the system fingerprint); chat roles are validated."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal import errors
from narwhal.errors import BadRequest, EngineHTTPError, NarwhalError
from narwhal.http import connection
from narwhal.router.requests import (
    CHAT_ROLES,
    ParsedRequest,
    ResponseAccumulator,
    StreamShaper,
    _cut,
    context_length_exceeded,
    engine_context_length,
    error_event,
    parse_request,
)

from .routerkit import open_stack


def _chunk(text: str, logprobs: Any, **extra: Any) -> dict[str, Any]:
    return {"id": "cmpl-x", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": extra.pop("finish", None),
         "stop_reason": None, "token_ids": extra.pop("ids", [1]), **extra}]}  # fmt: skip


def test_completion_logprobs_are_merged_over_the_chunks() -> None:
    parsed = parse_request(json.dumps({"prompt": "hi", "max_tokens": 2, "logprobs": 1}).encode(), "completions")
    acc = ResponseAccumulator(parsed, "r1", "m")
    first = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [0]}
    second = {"tokens": ["bc"], "token_logprobs": [-1.25], "top_logprobs": [{"bc": -1.25}], "text_offset": [1]}
    acc.add(_chunk("a", first, prompt_token_ids=[7, 8]))
    acc.add(_chunk("bc", second, finish="length"))
    [choice] = acc.body(2)["choices"]
    assert choice["logprobs"] == {
        "tokens": ["a", "bc"], "token_logprobs": [-0.5, -1.25],
        "top_logprobs": [{"a": -0.5}, {"bc": -1.25}], "text_offset": [0, 1],
    }  # fmt: skip
    assert choice["text"] == "abc"
    assert "token_ids" not in choice and "prompt_token_ids" not in choice  # not asked


def test_chat_logprobs_and_prompt_ids_in_vllm_places() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "return_token_ids": True}
    acc = ResponseAccumulator(parse_request(json.dumps(body).encode(), "chat"), "r2", "m")
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    acc.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}],
             "prompt_token_ids": [5, 6, 7], "system_fingerprint": "vllm-0.32.0"})  # fmt: skip
    acc.add({"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry]}, "token_ids": [97]}]})
    acc.add({"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry]},
                          "token_ids": [97], "finish_reason": "length"}]})  # fmt: skip
    out = acc.body(3)
    [choice] = out["choices"]
    assert choice["logprobs"] == {"content": [entry, entry]}
    assert choice["message"]["content"] == "aa" and choice["token_ids"] == [97, 97]
    assert out["prompt_token_ids"] == [5, 6, 7] and "prompt_token_ids" not in choice
    assert out["system_fingerprint"] == "vllm-0.32.0"


def test_without_logprobs_the_answer_says_null() -> None:
    acc = ResponseAccumulator(parse_request(b'{"prompt": "hi"}', "completions"), "r3", "m")
    acc.add(_chunk("a", None, finish="length"))
    assert acc.body(1)["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("role", CHAT_ROLES)
def test_every_openai_role_is_accepted(role: str) -> None:
    parse_request(json.dumps({"messages": [{"role": role, "content": "x"}]}).encode(), "chat")


@pytest.mark.parametrize(
    ("message", "code", "text"),
    [
        ({"role": "wizard", "content": "x"}, "invalid_value", "invalid value for 'messages[1].role': \"wizard\""),
        ({"role": 3, "content": "x"}, "invalid_value", "invalid value for 'messages[1].role': 3"),
        ({"content": "x"}, "missing_field", "'messages[1].role' is required"),
    ],
)
def test_a_bad_role_is_refused_naming_the_message(message: dict[str, Any], code: str, text: str) -> None:
    body = {"messages": [{"role": "user", "content": "ok"}, message]}
    with pytest.raises(BadRequest) as err:
        parse_request(json.dumps(body).encode(), "chat")
    assert err.value.code == code and str(err.value).startswith(text)


async def test_prompt_token_ids_only_when_the_client_asks(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        plain = (await stack.complete({"prompt": "a b c", "max_tokens": 3})).json()
        asked = (await stack.complete({"prompt": "a b c", "max_tokens": 3, "return_token_ids": True})).json()
        chat = await stack.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 3, "return_token_ids": True})  # fmt: skip
    assert "prompt_token_ids" not in plain["choices"][0] and "token_ids" not in plain["choices"][0]
    choice = asked["choices"][0]
    assert len(choice["token_ids"]) == 3
    assert isinstance(choice["prompt_token_ids"], list) and choice["prompt_token_ids"]
    assert isinstance(chat.json()["prompt_token_ids"], list) and chat.json()["prompt_token_ids"]


async def test_one_response_id_and_token_ids_only_when_asked_in_a_stream(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        plain_status, plain = await stack.stream({"prompt": "a b c", "max_tokens": 4})
        async with stack.client.stream(
            "POST", "/v1/completions", headers={"x-request-id": "client-rid-7"},
            json={"prompt": "a b c", "max_tokens": 4, "stream": True, "return_token_ids": True},
        ) as resp:  # fmt: skip
            assert resp.headers["x-request-id"] == "client-rid-7"
            asked = [json.loads(line[6:]) for line in [x async for x in resp.aiter_lines()]
                     if line.startswith("data: {")]  # fmt: skip
        chat_status, chat = await stack.stream(
            {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}, path="/v1/chat/completions"
        )
        whole = await stack.complete({"prompt": "a b c", "max_tokens": 2}, headers={"x-request-id": "client-rid-8"})
    assert plain_status == chat_status == 200
    chunks = [e for e in plain if isinstance(e, dict)]
    assert chunks and all("token_ids" not in c and "prompt_token_ids" not in c for e in chunks for c in e["choices"])
    assert len({e["id"] for e in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert not chunks[0]["id"].endswith("-d")  # not the decode leg's id (``<rid>-<n>-<x>-d``)
    assert {e["id"] for e in asked} == {"cmpl-client-rid-7"}
    assert sum(len(c["token_ids"]) for e in asked for c in e["choices"]) == 4
    assert isinstance(asked[0]["choices"][0]["prompt_token_ids"], list)
    chat_chunks = [e for e in chat if isinstance(e, dict)]
    assert len({e["id"] for e in chat_chunks}) == 1 and chat_chunks[0]["id"].startswith("chatcmpl-")
    assert all("prompt_token_ids" not in e for e in chat_chunks)
    assert whole.json()["id"] == "cmpl-client-rid-8" and whole.headers["x-request-id"] == "client-rid-8"


def test_shaping_real_vllm_events_keeps_them_valid_json() -> None:
    from pathlib import Path

    from narwhal.router.requests import StreamShaper

    recorded = (Path(__file__).parent.parent / "fixtures" / "completions-stream-token-ids.sse").read_bytes()
    events = [e + b"\n\n" for e in recorded.split(b"\n\n") if e.startswith(b"data: {")]
    parsed = parse_request(b'{"prompt": "x", "stream": true}', "completions")
    shaped = [json.loads(StreamShaper(parsed, "rid-1")(e)[6:]) for e in events]
    assert {s["id"] for s in shaped} == {"cmpl-rid-1"}
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
               for s in shaped for c in s["choices"])  # fmt: skip
    assert shaped[-1]["usage"]["completion_tokens"] == 20
    asked = parse_request(b'{"prompt": "x", "stream": true, "return_token_ids": true}', "completions")
    kept = [json.loads(StreamShaper(asked, "rid-2")(e)[6:]) for e in events]
    assert kept[0]["choices"][0]["prompt_token_ids"] == [86, 516, 692, 1415, 1336, 369, 80, 644, 90]
    assert sum(len(c["token_ids"]) for k in kept for c in k["choices"]) == 20


def test_shaping_a_burst_of_real_vllm_events_shapes_each() -> None:
    # A lazy stream relays token events that arrived together as one piece: every
    # event of it gets the router's id and loses the token ids, as one by one.
    from pathlib import Path

    from narwhal.router.requests import StreamShaper

    recorded = (Path(__file__).parent.parent / "fixtures" / "completions-stream-token-ids.sse").read_bytes()
    events = [e + b"\n\n" for e in recorded.split(b"\n\n") if e.startswith(b"data: {")][1:6]
    parsed = parse_request(b'{"prompt": "x", "stream": true}', "completions")
    shape = StreamShaper(parsed, "rid-1")
    assert shape(b"".join(events)) == b"".join(shape(e) for e in events)
    shaped = [json.loads(e) for e in shape(b"".join(events))[6:-2].split(b"\n\ndata: ")]
    assert len(shaped) == 5 and {s["id"] for s in shaped} == {"cmpl-rid-1"}
    assert not any("token_ids" in c for s in shaped for c in s["choices"])


def _error_classes(base: type[NarwhalError] = NarwhalError) -> list[type[NarwhalError]]:
    found = [base]
    for sub in base.__subclasses__():
        found += _error_classes(sub)
    return found


def _instance(cls: type[NarwhalError]) -> NarwhalError:
    """One of each error, built from its own signature (a new class needs no entry here)."""
    params = inspect.signature(cls.__init__).parameters.values()
    args = ["boom" for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self" and p.default is p.empty]
    kwargs = {p.name: 500 for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    return cls(*args, **kwargs)


def test_every_error_body_has_openais_code_a_string_or_null() -> None:
    # OpenAI's error objects carry ``code`` as a string ("context_length_exceeded",
    # "model_not_found", "invalid_api_key") or null; the status is the status line's.
    classes = _error_classes()
    exported = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert {c.__name__ for c in classes} >= exported
    bodies = [_instance(cls).to_body() for cls in classes]
    for status in (400, 404, 422, 500, 503):
        for detail in ("bad token id", "This model's maximum context length is 64 tokens. However, ..."):
            bodies.append(EngineHTTPError("x", upstream_status=status, detail=detail).to_body())
    bodies += [json.loads(error_event(_instance(cls)).removeprefix(b"data: ")) for cls in classes]
    protocol = [connection._error_body(f"{m}: detail", t) for m, t in connection._PROTOCOL_ERRORS.values()]
    bodies += [json.loads(b) for b in (connection._INTERNAL_ERROR_BODY, *protocol)]
    for body in bodies:
        assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
        assert body["error"]["code"] is None or isinstance(body["error"]["code"], str), body
    assert EngineHTTPError("x", upstream_status=400, detail="maximum context length").to_body()["error"]["code"] == (
        "context_length_exceeded"
    )


@pytest.mark.parametrize(
    ("detail", "status", "known", "message"),
    [
        # vLLM's wordings (older and newer) for the prefill leg's one-token request.
        ("This model's maximum context length is 4096 tokens. However, you requested 5001 tokens "
         "(5000 in the messages, 1 in the completion). Please reduce the length of the messages or "
         "completion.", 400, None, "has 5000 prompt tokens and asks for 7 output tokens"),
        ("This model's maximum context length is 4096 tokens. However, your request has 4100 input "
         "tokens. Please reduce the length of the input messages.", 400, None, "has 4100 prompt tokens"),
        # No count in the message: the router's exact count, else the engine's own words.
        ("This model's maximum context length is 4096 tokens.", 400, 4096, "has 4096 prompt tokens"),
        ("This model's maximum context length is 4096 tokens.", 400, None, None),
        ("token id 99999 is out of vocabulary", 400, 10, None),
        ("This model's maximum context length is 4096 tokens.", 503, 4096, None),  # not the client's fault
    ],
)  # fmt: skip
def test_an_engines_context_400_reads_as_the_routers(detail: str, status: int, known: int | None, message: str | None) -> None:
    parsed = parse_request(json.dumps({"prompt": "hi", "max_tokens": 7}).encode(), "completions")
    over = engine_context_length(EngineHTTPError("x", upstream_status=status, detail=detail), parsed, known)
    if message is None:
        assert over is None
    else:
        assert over is not None and over.code == "context_length_exceeded"
        assert str(over).startswith("this model's maximum context length is 4096 tokens; the request ")
        assert message in str(over) and str(over).endswith("asks for 7 output tokens")


# --------------------------------------------------- the non-streamed answer, directly


def _parsed(kind: str, *, return_token_ids: bool = False, max_tokens: int | None = None) -> ParsedRequest:
    return ParsedRequest(kind=kind, body={}, model=None, stream=False, include_usage=False,  # type: ignore[arg-type]
                         return_token_ids=return_token_ids, max_tokens=max_tokens)  # fmt: skip


def _recorded_events() -> list[dict[str, Any]]:
    """vLLM's streamed completion with token ids (20 tokens, then a usage event)."""
    recorded = (Path(__file__).parent.parent / "fixtures" / "completions-stream-token-ids.sse").read_text()
    return [json.loads(e[len("data: "):]) for e in recorded.split("\n\n") if e.startswith("data: {")]


def test_a_completion_from_vllms_stream_is_vllms_answer() -> None:
    events = _recorded_events()
    acc = ResponseAccumulator(_parsed("completions", return_token_ids=True), "rid-1", "tiny-llama")
    for event in events:
        acc.add(event)
    before = int(time.time())
    answer = acc.body(999)  # the usage event's count wins
    tokens = [c for e in events for c in e["choices"]]
    assert answer == {
        "id": "cmpl-rid-1", "object": "text_completion", "created": answer["created"], "model": "tiny-llama",
        "choices": [{
            "index": 0, "text": "".join(c["text"] for c in tokens), "logprobs": None, "finish_reason": "length",
            "stop_reason": None, "token_ids": [i for c in tokens for i in c["token_ids"]],
            "prompt_token_ids": [86, 516, 692, 1415, 1336, 369, 80, 644, 90],
        }],
        "usage": events[-1]["usage"], "system_fingerprint": "vllm-0.32.0-6700d25d",
    }  # fmt: skip
    assert len(answer["choices"][0]["token_ids"]) == 20 and answer["usage"]["completion_tokens"] == 20
    assert isinstance(answer["created"], int) and before <= answer["created"] <= time.time() + 1
    assert list(answer) == ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]


def test_without_a_usage_event_the_answer_counts_its_tokens() -> None:
    acc = ResponseAccumulator(_parsed("completions"), "r", "m")
    acc.add(_chunk("a", None, ids=[5, 6]))
    acc.add(_chunk("", None, ids=[7], finish="stop", stop_reason="###"))
    answer = acc.body(4)
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert answer["choices"] == [
        {"index": 0, "text": "a", "logprobs": None, "finish_reason": "stop", "stop_reason": "###"}
    ]
    assert "system_fingerprint" not in answer and "prompt_logprobs" not in answer["choices"][0]


def test_a_chat_answer_joins_content_and_reasoning_in_vllms_places() -> None:
    acc = ResponseAccumulator(_parsed("chat"), "rid-2", "m")
    acc.add(None)
    acc.add({})
    acc.add({"choices": None, "system_fingerprint": 7})  # not a fingerprint
    acc.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}],
             "prompt_logprobs": [None, {"5": {"logprob": -1.0}}], "system_fingerprint": "fp-1"})  # fmt: skip
    acc.add({"choices": [{"index": 0, "delta": {"reasoning_content": "think "}, "token_ids": [1]}]})
    acc.add({"choices": [{"index": 0, "delta": {"reasoning": "more"}, "token_ids": [2]}]})  # newer vLLM's key
    acc.add({"choices": [{"index": 0, "delta": {"content": "an"}, "token_ids": [3]}], "prompt_logprobs": ["later"]})
    acc.add({"choices": [{"index": 0, "delta": None, "token_ids": None, "finish_reason": None}]})
    acc.add({"choices": [{"index": 0, "delta": {"content": "swer"}, "token_ids": [4], "finish_reason": "stop",
                          "stop_reason": 128001}], "usage": None})  # fmt: skip
    answer = acc.body(3)
    assert answer == {
        "id": "chatcmpl-rid-2", "object": "chat.completion", "created": answer["created"], "model": "m",
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "answer", "reasoning_content": "think more"},
            "logprobs": None, "finish_reason": "stop", "stop_reason": 128001,
        }],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        "prompt_logprobs": [None, {"5": {"logprob": -1.0}}],  # the first one sent, on the response
        "system_fingerprint": "fp-1",
    }  # fmt: skip
    plain = ResponseAccumulator(_parsed("chat"), "r", "m")
    plain.add({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length"}]})
    assert plain.body(1)["choices"][0]["message"] == {"role": "assistant", "content": "x"}  # no reasoning key


def test_prompt_ids_and_logprobs_are_the_first_sent_on_the_choice_for_completions() -> None:
    acc = ResponseAccumulator(_parsed("completions", return_token_ids=True), "r", "m")
    acc.add(_chunk("a", None, prompt_token_ids=None, prompt_logprobs=None))
    acc.add(_chunk("b", None, prompt_token_ids=[1, 2], prompt_logprobs=[None, {"2": -0.5}]))
    acc.add(_chunk("c", None, prompt_token_ids=[9], prompt_logprobs=[{"9": -9.0}], finish="length"))
    answer = acc.body(2)
    [choice] = answer["choices"]
    assert (choice["prompt_token_ids"], choice["prompt_logprobs"]) == ([1, 2], [None, {"2": -0.5}])
    assert choice["token_ids"] == [1, 1, 1] and choice["text"] == "abc"
    assert "prompt_token_ids" not in answer and "prompt_logprobs" not in answer
    # Asked for, never sent: null, as vLLM says it.
    none = ResponseAccumulator(_parsed("completions", return_token_ids=True), "r", "m")
    none.add(_chunk("a", None, ids=[], finish="length"))
    assert none.body(1)["choices"][0]["prompt_token_ids"] is None
    assert none.body(1)["choices"][0]["token_ids"] == []


def test_logprobs_that_are_not_an_object_are_ignored_and_a_null_list_merges_as_empty() -> None:
    acc = ResponseAccumulator(_parsed("chat"), "r", "m")
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    acc.add({"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": [entry]}]})  # not vLLM's shape
    assert acc.logprobs is None
    acc.add({"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry], "refusal": None}}]})
    acc.add({"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry], "refusal": None},
                          "finish_reason": "length"}]})  # fmt: skip
    assert acc.body(1)["choices"][0]["logprobs"] == {"content": [entry, entry], "refusal": []}


@pytest.mark.parametrize(
    ("kind", "max_tokens", "max_model_len", "limit"),
    [
        ("completions", 5, 100, 5), ("chat", 5, 100, 5),
        ("completions", None, 100, 16),  # vLLM's default for completions
        ("chat", None, None, 16),  # no known context length
        ("chat", None, 100, 90),  # the rest of the context
        ("chat", None, 10, 1), ("chat", None, 11, 1), ("chat", None, 12, 2),
    ],
)  # fmt: skip
def test_the_output_limit_is_the_engines(kind: str, max_tokens: int | None, max_model_len: int | None, limit: int) -> None:
    assert _parsed(kind, max_tokens=max_tokens).output_limit(10, max_model_len) == limit


def test_an_error_after_the_status_is_one_compact_sse_event() -> None:
    err = EngineHTTPError("x", upstream_status=400, detail="This model's maximum context length is 64 tokens.")
    assert error_event(err) == b"data: " + json.dumps(err.to_body(), separators=(",", ":")).encode() + b"\n\n"
    assert error_event(BadRequest("'n' must be an integer", code="invalid_type")) == (
        b'data: {"error":{"message":"\'n\' must be an integer","type":"invalid_request_error",'
        b'"code":"invalid_type"}}\n\n'
    )


def test_the_context_length_message_names_the_limit_prompt_and_output() -> None:
    err = context_length_exceeded(4096, 4000, 200)
    assert str(err) == (
        "this model's maximum context length is 4096 tokens; the request has 4000 prompt tokens "
        "and asks for 200 output tokens"
    )
    assert err.code == "context_length_exceeded"


# ------------------------------------------------------- the streamed events, directly

_ASKED = _parsed("completions", return_token_ids=True)


@pytest.mark.parametrize(
    ("event", "shaped"),
    [
        # vLLM's compact form: the id replaced, the token ids cut.
        (b'data: {"id":"cmpl-d-1","object":"text_completion","choices":[{"index":0,"text":"a",'
         b'"prompt_token_ids":[1,2],"token_ids":[3]}]}\n\n',
         b'data: {"id":"cmpl-r","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'),
        (b'data: {"id":"x","choices":[{"text":"a","prompt_token_ids":null,"token_ids":[3, 4]}]}\n\n',
         b'data: {"id":"cmpl-r","choices":[{"text":"a"}]}\n\n'),
        # An escaped quote in the id: the pattern finds its end.
        (b'data: {"id":"a\\"b","choices":[]}\n\n', b'data: {"id":"cmpl-r","choices":[]}\n\n'),
        # Any other spacing.
        (b'data: { "id" : "x", "choices": [{"text": "a", "prompt_token_ids": null, "token_ids": [3, 4]}]}\n\n',
         b'data: {"id":"cmpl-r", "choices": [{"text": "a"}]}\n\n'),
        # A member that is neither null nor a list of ids is left as it is.
        (b'data: {"id":"x","choices":[{"text":"a","token_ids":"?"}]}\n\n',
         b'data: {"id":"cmpl-r","choices":[{"text":"a","token_ids":"?"}]}\n\n'),
        (b'data: {"id":"x","token_ids":[1,2\n\n', b'data: {"id":"cmpl-r","token_ids":[1,2\n\n'),
        # Not a chunk: as it is.
        (b"data: [DONE]\n\n", b"data: [DONE]\n\n"),
        (b'data: {"error":{"message":"x"}}\n\n', b'data: {"error":{"message":"x"}}\n\n'),
    ],
)  # fmt: skip
def test_a_streamed_event_gets_the_routers_id_and_loses_the_token_ids(event: bytes, shaped: bytes) -> None:
    assert StreamShaper(_parsed("completions"), "r")(event) == shaped
    kept = StreamShaper(_ASKED, "r")(event)
    assert kept.count(b"token_ids") == event.count(b"token_ids")  # asked for: kept
    assert kept.startswith(shaped[: shaped.find(b'"cmpl-r"') + 8]) if b'"cmpl-r"' in shaped else kept == event


def test_a_chat_stream_gets_the_chat_id() -> None:
    event = b'data: {"id":"chatcmpl-d","object":"chat.completion.chunk","choices":[]}\n\n'
    assert StreamShaper(_parsed("chat"), "r7")(event) == (
        b'data: {"id":"chatcmpl-r7","object":"chat.completion.chunk","choices":[]}\n\n'
    )


def test_a_burst_of_two_events_shapes_both() -> None:
    one = b'data: {"id":"x","choices":[{"text":"a","token_ids":[1]}]}\n\n'
    assert StreamShaper(_parsed("completions"), "r")(one + one) == (
        b'data: {"id":"cmpl-r","choices":[{"text":"a"}]}\n\n' * 2
    )


def test_an_event_whose_id_does_not_end_is_left_as_it_is() -> None:
    event = b'data: {"id":"abc\n\n'
    assert StreamShaper(_parsed("completions"), "r")(event) == event


@pytest.mark.parametrize(
    ("raw", "cut"),
    [
        (b'{"a":[1],"token_ids":[2, 3],"b":1}', b'{"a":[1],"b":1}'),  # the list after the key, not an earlier one
        (b'{"a":1,"token_ids":null,"b":[2]}', b'{"a":1,"b":[2]}'),
        (b',"token_ids":[1]}', b"}"),  # the member first
        (b'{"a":1,"token_ids":null,"token_ids":[2]}', b'{"a":1,"token_ids":[2]}'),  # the first one
        (b'{"a":1,"token_ids":[1,2', b'{"a":1,"token_ids":[1,2'),  # cut short: as it is
        (b'{"a":1,"token_ids":"x"}', b'{"a":1,"token_ids":"x"}'),
        (b'{"a":1}', b'{"a":1}'),
    ],
)  # fmt: skip
def test_a_compact_member_is_cut_with_its_value(raw: bytes, cut: bytes) -> None:
    assert _cut(raw, b',"token_ids":') == cut


def test_an_empty_answer_says_null_for_its_finish() -> None:
    answer = ResponseAccumulator(_parsed("chat"), "r", "m").body(2)
    assert answer["choices"] == [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None, "stop_reason": None}]  # fmt: skip
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


def test_an_engines_context_400_for_a_chat_without_max_tokens_asks_for_the_rest_of_the_context() -> None:
    detail = "This model's maximum context length is 4096 tokens. However, your request has 4000 input tokens."
    parsed = parse_request(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), "chat")
    over = engine_context_length(EngineHTTPError("x", upstream_status=400, detail=detail), parsed, None)
    assert str(over).endswith("the request has 4000 prompt tokens and asks for 96 output tokens")
