"""parse_request, directly: every refusal's exact message, code and class, and what a
valid body gives the router (the router-level tests check the same bodies end to end,
by a fragment of the message)."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from narwhal.errors import BadRequest, Unsupported
from narwhal.router.requests import MAX_BODY_DEPTH, ParsedRequest, parse_request

USER = [{"role": "user", "content": "hi"}]


def _refusal(body: dict[str, Any] | bytes, kind: str = "completions") -> BadRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(BadRequest) as err:
        parse_request(raw, kind)  # type: ignore[arg-type]
    return err.value


def _nested(depth: int) -> bytes:
    """A body whose containers nest ``depth`` levels (the body itself is the first)."""
    return b'{"prompt": "a", "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize(
    ("body", "kind", "cls", "code", "message"),
    [
        (b"not json", "completions", BadRequest, "invalid_json", "request body is not valid JSON"),
        (b"\xff\xfe{}", "completions", BadRequest, "invalid_json", "request body is not valid JSON"),
        (b"[" * 100_000, "completions", BadRequest, "invalid_json", "request body is nested more than 64 levels deep"),
        (b"[1]", "chat", BadRequest, "invalid_json", "request body must be a JSON object"),
        ({"max_tokens": 3}, "completions", BadRequest, "missing_field", "'prompt' is required"),
        ({"prompt": ["a", "b"]}, "completions", Unsupported, None, "batched prompts (a list of strings) are not supported"),
        ({"prompt": []}, "completions", BadRequest, "invalid_type", "'prompt' must be a string or a non-empty list of token ids"),
        ({"prompt": [1, True]}, "completions", BadRequest, "invalid_type", "'prompt' must be a string or a non-empty list of token ids"),
        ({"prompt": [1, -1]}, "completions", BadRequest, "invalid_type", "'prompt' must be a string or a non-empty list of token ids"),
        ({"prompt": [1, "a"]}, "completions", BadRequest, "invalid_type", "'prompt' must be a string or a non-empty list of token ids"),
        ({"prompt": {"a": 1}}, "completions", BadRequest, "invalid_type", "'prompt' must be a string or a list of token ids"),
        ({"prompt": "a"}, "chat", BadRequest, "missing_field", "'messages' must be a non-empty list"),
        ({"messages": []}, "chat", BadRequest, "missing_field", "'messages' must be a non-empty list"),
        ({"messages": "hi"}, "chat", BadRequest, "missing_field", "'messages' must be a non-empty list"),
        ({"messages": [*USER, "hi"]}, "chat", BadRequest, "invalid_type", "each item of 'messages' must be an object"),
        ({"messages": [{"role": "user"}, {"role": None}]}, "chat", BadRequest, "missing_field", "'messages[1].role' is required"),
        ({"prompt": "a", "model": 5}, "completions", BadRequest, "invalid_type", "'model' must be a string"),
        ({"prompt": "a", "stream": 1}, "completions", BadRequest, "invalid_type", "'stream' must be a boolean"),
        ({"prompt": "a", "n": 2}, "completions", Unsupported, None, "'n' > 1 is not supported"),
        ({"prompt": "a", "n": 0}, "completions", BadRequest, "invalid_value", "'n' must be >= 1"),
        ({"prompt": "a", "n": 1.0}, "completions", BadRequest, "invalid_type", "'n' must be an integer"),
        ({"prompt": "a", "best_of": 2}, "completions", Unsupported, None, "'best_of' > 1 is not supported"),
        ({"prompt": "a", "best_of": 0}, "completions", BadRequest, "invalid_value", "'best_of' must be >= 1"),
        ({"prompt": "a", "max_tokens": 0}, "completions", BadRequest, "invalid_value", "'max_tokens' must be >= 1"),
        ({"prompt": "a", "max_tokens": False}, "completions", BadRequest, "invalid_type", "'max_tokens' must be an integer"),
        ({"messages": USER, "max_completion_tokens": 0}, "chat", BadRequest, "invalid_value",
         "'max_completion_tokens' must be >= 1"),
        ({"prompt": "a", "stream_options": []}, "completions", BadRequest, "invalid_type", "'stream_options' must be an object"),
    ],
)  # fmt: skip
def test_a_refusal_says_what_is_wrong(
    body: dict[str, Any] | bytes, kind: str, cls: type[BadRequest], code: str | None, message: str
) -> None:
    err = _refusal(body, kind)
    assert type(err) is cls and err.code == code and err.message == message
    # The JSON parser's own error is no part of the answer (nor of a traceback).
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)


def test_the_depth_limit_is_inclusive() -> None:
    assert parse_request(_nested(MAX_BODY_DEPTH), "completions").body["prompt"] == "a"
    err = _refusal(_nested(MAX_BODY_DEPTH + 1))
    assert (err.code, err.message) == ("invalid_json", "request body is nested more than 64 levels deep")
    # Depth counts containers in objects and in lists alike.
    deep_dicts = {"prompt": "a"}
    node: dict[str, Any] = deep_dicts
    for _ in range(MAX_BODY_DEPTH):
        node["x"] = {}
        node = node["x"]
    assert _refusal(deep_dicts).code == "invalid_json"
    mixed = b'{"prompt": "a", "x": [1, {"y": ' + b"[" * (MAX_BODY_DEPTH - 2) + b"]" * (MAX_BODY_DEPTH - 2) + b"}]}"
    assert _refusal(mixed).code == "invalid_json"


_LONE = " is not valid Unicode: it holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair)"


@pytest.mark.parametrize(
    ("raw", "kind", "where"),
    [
        (rb'{"prompt": "ab\udc80cd"}', "completions", "'prompt'"),
        (rb'{"prompt": "ab\uD83Dcd"}', "completions", "'prompt'"),  # a high half, no low one after it
        (rb'{"prompt": "ab\ude00\ud83d"}', "completions", "'prompt'"),  # both halves, in the wrong order
        (rb'{"prompt": "a", "stop": ["x", "\udfff"]}', "completions", "'stop[1]'"),
        (rb'{"prompt": "a", "\ud800": 1}', "completions", "a key of the body"),
        (rb'{"prompt": "a", "stream_options": {"\ud800": 1}}', "completions", "a key of 'stream_options'"),
        (rb'{"messages": [{"role": "user", "content": "ab\udc80cd"}]}', "chat", "'messages[0].content'"),
        (rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc80"}]}]}', "chat",
         "'messages[0].content[0].text'"),
        (rb'{"messages": [{"role": "user", "content": "hi", "name": "\udc80"}]}', "chat", "'messages[0].name'"),
        (rb'{"messages": [{"role": "user", "content": "hi"}], "model": "\udc80"}', "chat", "'model'"),
    ],
)
def test_a_lone_surrogate_is_refused_where_it_is(raw: bytes, kind: str, where: str) -> None:
    # Before: the stdlib parser kept it, and forwarding the body to an engine raised
    # UnicodeEncodeError: a 500 and a logged traceback per request.
    err = _refusal(raw, kind)
    assert (err.code, err.message) == ("invalid_value", where + _LONE)


def test_only_a_lone_surrogate_is_refused() -> None:
    # What only looks like one is text like any other: a pair is one character, an
    # escaped backslash is the text \udc80, and the code points on either side of the
    # surrogates are characters.
    for raw in (rb'{"prompt": "ab\ud83d\ude00cd"}', rb'{"prompt": "ab\\udc80cd"}', rb'{"prompt": "\ud7ff\ue000"}'):
        assert parse_request(raw, "completions").body["prompt"] == json.loads(raw)["prompt"]
    assert _refusal(rb'{"prompt": "\ud7ff\ud800\ue000"}').message == "'prompt'" + _LONE


def test_a_role_outside_the_list_is_refused_with_the_list() -> None:
    err = _refusal({"messages": [*USER, {"role": "x" * 100}]}, "chat")
    assert err.code == "invalid_value"
    assert err.message == (
        f"invalid value for 'messages[1].role': {json.dumps('x' * 100)[:80]}; supported values are "
        "'system', 'developer', 'user', 'assistant', 'tool', 'function'"
    )


def test_a_completion_body_gives_the_router_its_fields() -> None:
    raw = json.dumps({"prompt": [0, 5], "model": "m", "stream": True, "n": 1, "best_of": 1, "max_tokens": 7,
                      "max_completion_tokens": 99, "stream_options": {"include_usage": True},
                      "return_token_ids": 1}).encode()  # fmt: skip
    parsed = parse_request(raw, "completions")
    assert parsed == ParsedRequest(
        kind="completions", body=json.loads(raw), model="m", stream=True, include_usage=True,
        return_token_ids=True, max_tokens=7,  # a completion's max_completion_tokens is not its limit
    )  # fmt: skip


def test_a_chat_body_gives_the_router_its_fields() -> None:
    parsed = parse_request(json.dumps({"messages": USER, "max_tokens": 7, "max_completion_tokens": 9}).encode(), "chat")
    assert parsed == ParsedRequest(
        kind="chat", body={"messages": USER, "max_tokens": 7, "max_completion_tokens": 9}, model=None, stream=False,
        include_usage=False, return_token_ids=False, max_tokens=9,
    )  # fmt: skip
    only_max = parse_request(json.dumps({"messages": USER, "max_tokens": 7}).encode(), "chat")
    assert only_max.max_tokens == 7
    plain = parse_request(json.dumps({"messages": USER, "stream_options": {}}).encode(), "chat")
    assert (plain.max_tokens, plain.include_usage, plain.stream) == (None, False, False)
    assert parse_request(b'{"prompt": "a", "stream_options": null}', "completions").include_usage is False


@pytest.mark.parametrize(
    ("kind", "max_tokens", "max_model_len", "prompt", "limit"),
    [
        ("completions", 5, 100, 10, 5),
        ("completions", None, 100, 10, 16),  # vLLM's default for a completion
        ("chat", None, 100, 10, 90),  # what the context leaves
        ("chat", None, 100, 100, 1),
        ("chat", None, None, 10, 16),
        ("chat", 3, 100, 10, 3),
    ],
)
def test_the_output_limit_the_engines_will_apply(
    kind: str, max_tokens: int | None, max_model_len: int | None, prompt: int, limit: int
) -> None:
    parsed = ParsedRequest(kind=kind, body={}, model=None, stream=False, include_usage=False,  # type: ignore[arg-type]
                           return_token_ids=False, max_tokens=max_tokens)  # fmt: skip
    assert parsed.output_limit(prompt, max_model_len) == limit


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens", "n", "best_of"])
def test_an_integer_too_large_for_a_float_is_refused(name: str) -> None:
    # Placement and pricing compute with floats: the largest int a float holds is the bound.
    body = {"messages": [{"role": "user", "content": "x"}], name: int(sys.float_info.max) + 1}
    with pytest.raises(BadRequest) as err:
        parse_request(json.dumps(body).encode(), "chat")
    assert (str(err.value), err.value.code) == (f"'{name}' is too large", "invalid_value")


def test_the_largest_integer_a_float_holds_is_accepted() -> None:
    largest = int(sys.float_info.max)
    assert parse_request(json.dumps({"prompt": "x", "max_tokens": largest}).encode(), "completions").max_tokens == largest
