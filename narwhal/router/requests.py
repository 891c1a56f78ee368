"""Validating an OpenAI request body and shaping what the client gets back.

The router forwards the client's body to the engines (sampling settings untouched,
transfer parameters removed); this module only checks what the router itself relies
on, with a message that names the field, and builds the non-streaming answer from
the decode stream's chunks.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any

import attrs

from narwhal.engines.connector import RequestKind
from narwhal.errors import (
    BadRequest,
    ContextLengthExceeded,
    EngineError,
    EngineHTTPError,
    NarwhalError,
    Unsupported,
)

__all__ = [
    "CHAT_ROLES",
    "ParsedRequest",
    "ResponseAccumulator",
    "StreamShaper",
    "context_length_exceeded",
    "engine_context_length",
    "error_event",
    "parse_request",
]

_DEFAULT_COMPLETION_TOKENS = 16
#: The message roles the OpenAI chat API accepts.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: Deepest nesting of a body accepted: the stdlib's JSON codec recurses, so a deeper
#: body would raise RecursionError on parsing or when forwarded to an engine.
MAX_BODY_DEPTH = 64


@attrs.define
class ParsedRequest:
    """What the router needs from a client body.

    Attributes:
        kind: ``completions`` or ``chat``.
        body: the client's body (the engines see a copy without transfer parameters).
        model: requested model, or None for the fleet's default.
        stream: the client wants SSE.
        include_usage: the client asked for the usage event (stream_options.include_usage).
        return_token_ids: the client asked for token ids in the answer.
        max_tokens: the client's output limit, or None when it set none.
    """

    kind: RequestKind
    body: dict[str, Any]
    model: str | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    max_tokens: int | None

    def output_limit(self, prompt_tokens: int, max_model_len: int | None) -> int:
        """The output limit the engines will apply (vLLM's defaults when unset)."""
        if self.max_tokens is not None:
            return self.max_tokens
        if self.kind == "completions" or max_model_len is None:
            return _DEFAULT_COMPLETION_TOKENS
        return max(max_model_len - prompt_tokens, 1)


#: Above this an integer field cannot be converted to a float, which placement and
#: pricing compute with (any smaller excess is a context-length error where it is due).
_INT_MAX = int(sys.float_info.max)


def _int_field(body: dict[str, Any], name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", code="invalid_type")
    if value < minimum:
        raise BadRequest(f"'{name}' must be >= {minimum}", code="invalid_value")
    if value > _INT_MAX:
        raise BadRequest(f"'{name}' is too large", code="invalid_value")
    return value


def _deeper_than(body: dict[str, Any], limit: int) -> bool:
    """Whether ``body`` nests containers more than ``limit`` levels deep (iteratively)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > limit:
            return True
        for child in obj.values() if isinstance(obj, dict) else obj:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def _too_deep() -> BadRequest:
    return BadRequest(f"request body is nested more than {MAX_BODY_DEPTH} levels deep", code="invalid_json")


#: A JSON escape of a UTF-16 surrogate (``\ud800``-``\udfff``): the only way a body in
#: valid UTF-8 can carry one (a pair is one character once parsed; a lone one stays).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _lone_surrogate(body: dict[str, Any]) -> str | None:
    """Which string of ``body`` (a value or a key) holds a lone surrogate, first in
    document order: ``'messages[0].content'`` or ``a key of 'stream_options'``; None
    when none does."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, dict):
            items = []
            for key, value in obj.items():
                where = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return f"a key of '{path}'" if path else "a key of the body"
                items.append((value, where))
        elif isinstance(obj, list):
            items = [(value, f"{path}[{i}]") for i, value in enumerate(obj)]
        else:
            if isinstance(obj, str) and _SURROGATE.search(obj):
                return f"'{path}'"
            continue
        stack.extend(reversed(items))  # depth first, in document order
    return None


def parse_request(raw: bytes, kind: RequestKind) -> ParsedRequest:
    """Parse and check a completions or chat body; raises :class:`BadRequest`."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    if _deeper_than(body, MAX_BODY_DEPTH):
        raise _too_deep()
    # The stdlib's parser keeps a lone surrogate escape ("\udc80") as a character that
    # no UTF-8 encoder takes (orjson refuses the escape as it parses), so forwarding the
    # body to an engine would fail: the client's error, said as such.
    if _SURROGATE_ESCAPE.search(raw) is not None:
        where = _lone_surrogate(body)
        if where is not None:
            raise BadRequest(
                f"{where} is not valid Unicode: it holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                "without its pair)",
                code="invalid_value",
            )
    if kind == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("'prompt' is required", code="missing_field")
        if isinstance(prompt, list):
            if prompt and all(isinstance(p, str) for p in prompt):
                raise Unsupported("batched prompts (a list of strings) are not supported")
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                raise BadRequest("'prompt' must be a string or a non-empty list of token ids", code="invalid_type")
        elif not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string or a list of token ids", code="invalid_type")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", code="missing_field")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("each item of 'messages' must be an object", code="invalid_type")
        for i, m in enumerate(messages):
            role = m.get("role")
            if role is None:
                raise BadRequest(f"'messages[{i}].role' is required", code="missing_field")
            if role not in CHAT_ROLES:
                raise BadRequest(
                    f"invalid value for 'messages[{i}].role': {json.dumps(role)[:80]}; "
                    f"supported values are {', '.join(repr(r) for r in CHAT_ROLES)}",
                    code="invalid_value",
                )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", code="invalid_type")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", code="invalid_type")
    n = _int_field(body, "n", minimum=1)
    if n is not None and n > 1:
        raise Unsupported("'n' > 1 is not supported")
    best_of = _int_field(body, "best_of", minimum=1)
    if best_of is not None and best_of > 1:
        raise Unsupported("'best_of' > 1 is not supported")
    max_tokens = _int_field(body, "max_tokens", minimum=1)
    if kind == "chat":
        mct = _int_field(body, "max_completion_tokens", minimum=1)
        if mct is not None:
            max_tokens = mct
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", code="invalid_type")
    include_usage = bool(options and options.get("include_usage"))
    return ParsedRequest(
        kind=kind,
        body=body,
        model=model,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=bool(body.get("return_token_ids")),
        max_tokens=max_tokens,
    )


#: vLLM's 400 for a prompt (plus output) over max_model_len: the limit, and the prompt's
#: length in either of its wordings ("... (P in the messages, M in the completion)",
#: "... your request has P input tokens ...").
_ENGINE_LIMIT = re.compile(r"maximum context length is (\d+) tokens")
_ENGINE_PROMPT = re.compile(r"(\d+) in the messages|has (\d+) input tokens")


def context_length_exceeded(max_model_len: int, prompt_tokens: int, max_tokens: int) -> ContextLengthExceeded:
    """The one message for a prompt plus the client's output over ``max_model_len``,
    whichever check finds it (the router's own count or an engine's 400)."""
    return ContextLengthExceeded(
        f"this model's maximum context length is {max_model_len} tokens; the request has "
        f"{prompt_tokens} prompt tokens and asks for {max_tokens} output tokens"
    )


def engine_context_length(
    err: EngineError, parsed: ParsedRequest, prompt_tokens: int | None
) -> ContextLengthExceeded | None:
    """An engine's 400 for an over-long prompt, as :func:`context_length_exceeded` says it.

    The prefill leg asks the producer for one token, so its 400 counts one output token;
    the client asked for its own ``max_tokens`` (or the engines' default). The prompt's
    length is the engine's when its message gives it, else ``prompt_tokens`` (an exact
    count, or None). None when ``err`` is no such 400.
    """
    detail = err.detail if isinstance(err, EngineHTTPError) and err.client_fault else None
    limit = _ENGINE_LIMIT.search(detail) if detail else None
    if detail is None or limit is None:
        return None
    found = _ENGINE_PROMPT.search(detail)
    count = int(found.group(1) or found.group(2)) if found else prompt_tokens
    if count is None:
        return None
    max_model_len = int(limit.group(1))
    return context_length_exceeded(max_model_len, count, parsed.output_limit(count, max_model_len))


def error_event(err: NarwhalError) -> bytes:
    """The terminal SSE event for a failure after HTTP 200 was committed."""
    return b"data: " + json.dumps(err.to_body(), separators=(",", ":")).encode() + b"\n\n"


class ResponseAccumulator:
    """Builds a non-streaming answer (vLLM's shape) from the decode stream's events."""

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str) -> None:
        self.parsed = parsed
        self.request_id = request_id
        self.model = model
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: Any = None
        #: The engine's logprobs merged over the chunks (None: the client asked for none).
        self.logprobs: dict[str, list[Any]] | None = None
        self.system_fingerprint: str | None = None

    def _add_prompt(self, holder: dict[str, Any]) -> None:
        if self.prompt_token_ids is None and isinstance(holder.get("prompt_token_ids"), list):
            self.prompt_token_ids = holder["prompt_token_ids"]
        if self.prompt_logprobs is None and holder.get("prompt_logprobs") is not None:
            self.prompt_logprobs = holder["prompt_logprobs"]

    def _add_logprobs(self, part: Any) -> None:
        """Merge one chunk's ``logprobs``: chat's ``content`` (and ``refusal``) lists, or
        completions' parallel ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
        ``text_offset`` lists (vLLM's offsets count from the start of the text)."""
        if not isinstance(part, dict):
            return
        merged = self.logprobs if self.logprobs is not None else {}
        for key, value in part.items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            else:
                merged.setdefault(key, [])
        self.logprobs = merged

    def add(self, data: dict[str, Any] | None) -> None:
        if not data:
            return
        usage = data.get("usage")
        if usage:
            self.usage = usage
        fingerprint = data.get("system_fingerprint")
        if isinstance(fingerprint, str):
            self.system_fingerprint = fingerprint
        self._add_prompt(data)  # chat: on the response
        for choice in data.get("choices") or ():
            ids = choice.get("token_ids")
            if ids:
                self.token_ids.extend(ids)
            self._add_prompt(choice)  # completions: on the choice
            if choice.get("logprobs") is not None:
                self._add_logprobs(choice["logprobs"])
            if self.parsed.kind == "chat":
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self.text.append(delta["content"])
                rc = delta.get("reasoning_content") or delta.get("reasoning")
                if rc:
                    self.reasoning.append(rc)
            elif choice.get("text"):
                self.text.append(choice["text"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")

    def body(self, prompt_tokens: int) -> dict[str, Any]:
        usage = self.usage if self.usage is not None else {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "total_tokens": prompt_tokens + len(self.token_ids),
        }
        created = int(time.time())
        choice: dict[str, Any]
        if self.parsed.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            choice = {
                "index": 0,
                "message": message,
                "logprobs": self.logprobs,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": "".join(self.text),
                "logprobs": self.logprobs,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }
            obj = "text_completion"
        answer: dict[str, Any] = {
            "id": response_id(self.parsed, self.request_id),
            "object": obj,
            "created": created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }
        # vLLM's places: on the choice for completions, on the response for chat.
        prompt_holder = answer if self.parsed.kind == "chat" else choice
        if self.prompt_logprobs is not None:
            prompt_holder["prompt_logprobs"] = self.prompt_logprobs
        if self.parsed.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
            prompt_holder["prompt_token_ids"] = self.prompt_token_ids
        if self.system_fingerprint is not None:
            answer["system_fingerprint"] = self.system_fingerprint
        return answer


#: An event's response id: vLLM serialises it as the first key of every chunk (the
#: pattern matches at the start only).
_EVENT_ID = re.compile(rb'^data: \{\s*"id"\s*:\s*"(?:[^"\\]|\\.)*"')
_COMPACT_ID = b'data: {"id":"'
_COMPACT_IDS = (b',"prompt_token_ids":', b',"token_ids":')
#: The token ids the router asks the consumer for (to count output), and the prompt's.
_TOKEN_IDS = re.compile(rb'\s*,\s*"(?:prompt_)?token_ids"\s*:\s*(?:null|\[[\d,\s]*\])')


def response_id(parsed: ParsedRequest, request_id: str) -> str:
    """The id of the answer to ``request_id``: the same in every stream chunk and in a
    non-streamed body (the ``x-request-id`` header carries ``request_id``), as vLLM."""
    return ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + request_id


class StreamShaper:
    """The consumer's SSE events as the client's: each chunk carries the router's
    response id (not the decode leg's), and the token ids the router asked the engine
    for go only to a client that asked for them (``return_token_ids``)."""

    def __init__(self, parsed: ParsedRequest, request_id: str) -> None:
        self._id = b'data: {"id":' + json.dumps(response_id(parsed, request_id)).encode()
        self._strip_ids = not parsed.return_token_ids

    @property
    def id_prefix(self) -> bytes:
        """What an event's opening ``data: {"id":"..."`` becomes."""
        return self._id

    @property
    def strip_ids(self) -> bool:
        """Whether token ids are cut from the events (the client did not ask for them)."""
        return self._strip_ids

    def _replace_id(self, _: re.Match[bytes]) -> bytes:
        return self._id

    def __call__(self, raw: bytes) -> bytes:
        """One event as the client's, or each of a burst of events relayed together (a
        lazy stream's chunk: single-line ``data: ...\\n\\n`` events)."""
        if raw.count(b"\n\n") > 1:  # pragma: no mutate (equivalent: one event split is itself; the count 2 is killed by the burst-of-two test)
            return b"".join(self._event(e + b"\n\n") for e in raw[:-2].split(b"\n\n"))
        return self._event(raw)

    def _event(self, raw: bytes) -> bytes:
        # Per token, so the compact form vLLM writes is cut by hand; the patterns
        # handle any other spacing.
        if raw.startswith(_COMPACT_ID):
            end = raw.find(b'"', len(_COMPACT_ID))  # pragma: no mutate (equivalent: not finding the end falls back to the pattern, which gives the same bytes; the statement's other mutants were killed in a run without this mark)
            if end != -1 and raw[end - 1] != 0x5C:  # no escaped quote inside the id
                raw = self._id + raw[end + 1 :]
            else:
                raw = _EVENT_ID.sub(self._replace_id, raw)
        else:
            raw = _EVENT_ID.sub(self._replace_id, raw)
        if self._strip_ids and b"token_ids" in raw:
            for key in _COMPACT_IDS:
                raw = _cut(raw, key)
            if b"token_ids" in raw:
                raw = _TOKEN_IDS.sub(b"", raw)
        return raw


def _cut(raw: bytes, key: bytes) -> bytes:
    """``raw`` without the compact member ``key`` (``,"token_ids":``) and its value
    (null or a list of ints); as is when the value is anything else."""
    i = raw.find(key)
    if i < 0:
        return raw
    j = i + len(key)
    if raw.startswith(b"null", j):
        return raw[:i] + raw[j + 4 :]
    if raw.startswith(b"[", j):
        _, closed, rest = raw[j:].partition(b"]")
        if closed:
            return raw[:i] + rest
    return raw
