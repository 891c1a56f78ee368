"""Resuming a broken decode stream on another engine (``recovery.resume_streams``).

When a decode leg fails after output reached the router (the engine closed the stream
or restarted, went silent past ``engine.decode_read_timeout_s``, sent an error object
or an unusable event), the lifecycle asks :func:`resume_after` whether to go on. A
resume is a new attempt of the same request, never a second lifecycle: its prompt is
the original prompt's token ids followed by every token id delivered so far, sent as a
token-id prompt to ``/v1/completions`` (a chat request's prompt ids are its messages
with the chat template applied, as the engine reported them, so the continuation goes
on with the assistant message exactly where it broke), ``max_tokens`` (and
``min_tokens``) less what was delivered, and the same sampling settings. It is placed
and priced like any attempt: its prompt is mostly cached where the original prefill
ran. Under greedy decoding it produces what the broken stream would have.

:class:`StreamLedger` keeps what a resumable request's stream delivered (token ids,
text, the prompt's token ids from the stream's first event) and rewrites a
continuation's events into the client's stream:

- a chat client gets ``chat.completion.chunk`` events (and chat logprobs);
- stop strings are applied by the router to the whole output: the continuation's engine
  sees only its own output, so it could not find a stop string that spans the break. A
  streaming engine holds back the last ``len(longest stop) - 1`` characters of its text
  while a stop string may still complete (vLLM's detokenizer), so text it never sent is
  lost with a broken stream: the resume recovers it with the engine's ``/detokenize`` of
  the generated ids, and holds text back itself as the engine would have;
- completions logprobs' ``text_offset`` count from the start of the client's text;
- usage counts the original prompt and every generated token once.

A request that asks for what a continuation cannot reproduce exactly (:func:`unresumable`)
is never resumed: its stream ends with the terminal event, as without resumes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from narwhal.engines.sse import Chunk, json_dumps
from narwhal.errors import EngineError
from narwhal.router.journal import AttemptRecord
from narwhal.router.requests import ParsedRequest, ResponseAccumulator, response_id
from narwhal.router.state import PromptCount

if TYPE_CHECKING:
    from narwhal.router.lifecycle import RequestLifecycle

__all__ = ["Continuation", "StreamLedger", "open_ledger", "resume_after", "unresumable"]

#: Keys of the client's body a continuation does not send: chat's own, what the decode
#: leg sets itself, what a token-id prompt replaces or must not reapply (a truncation of
#: the prompt), prompt logprobs (the client had the original's), and stop strings (the
#: router applies them to the whole output: see StreamLedger).
_NOT_CARRIED: Final = frozenset({
    "messages", "prompt", "max_completion_tokens", "top_logprobs", "echo", "prompt_logprobs",
    "truncate_prompt_tokens", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call", "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "documents", "mm_processor_kwargs", "add_special_tokens", "suffix",
    "n", "best_of", "stream", "stream_options", "return_token_ids", "reasoning_effort",
    "include_reasoning", "stop", "include_stop_str_in_output",
})  # fmt: skip
#: Fields whose effect a continuation cannot reproduce, when set to anything but their
#: neutral value, and why.
_UNRESUMABLE_FIELDS: Final = (
    ("echo", "echo repeats the prompt, and a continuation's prompt holds the output sent"),
    ("presence_penalty", "presence_penalty weighs the output so far, which a continuation reads as prompt"),
    ("frequency_penalty", "frequency_penalty weighs the output so far, which a continuation reads as prompt"),
    ("bad_words", "bad_words are matched against the output so far"),
    ("guided_json", "a guided decoding grammar starts over with a continuation"),
    ("guided_regex", "a guided decoding grammar starts over with a continuation"),
    ("guided_choice", "a guided decoding grammar starts over with a continuation"),
    ("guided_grammar", "a guided decoding grammar starts over with a continuation"),
    ("structured_outputs", "a guided decoding grammar starts over with a continuation"),
    ("logits_processors", "custom logits processors keep state a continuation does not have"),
    ("prompt_embeds", "a prompt given as embeddings has no token ids to continue"),
)
#: Chat deltas that carry output the engine parsed from the whole message so far.
_PARSED_DELTA_KEYS: Final = ("reasoning", "reasoning_content", "tool_calls", "refusal", "function_call")


def _neutral(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {} or value == ""


def unresumable(parsed: ParsedRequest) -> str | None:
    """Why a continuation could not reproduce what this request asks for; None when it can.

    Such a request keeps seed 001's rule: a failure after output ends its stream with
    the terminal event.
    """
    body = parsed.body
    for key, why in _UNRESUMABLE_FIELDS:
        if not _neutral(body.get(key)):
            return why
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        return "a response_format grammar starts over with a continuation"
    if body.get("seed") is not None and body.get("temperature") != 0:
        return "a seeded sampler's random stream starts over with a continuation"
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("continuous_usage_stats"):
        return "stream_options.continuous_usage_stats would count each event from the continuation"
    if parsed.kind == "chat":
        if body.get("tools") and body.get("tool_choice") != "none":
            return "tool calls are parsed from the whole message"
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, list) and any(
                not (isinstance(p, Mapping) and p.get("type") == "text") for p in content
            ):
                return "a multimodal prompt has no token ids to continue"
    return None


@attrs.define
class Continuation:
    """The request a resume sends.

    Attributes:
        body: the ``/v1/completions`` body (a token-id prompt).
        prompt: its prompt: the original prompt's ids and the tokens delivered.
        max_tokens: the output limit left.
        cause: what broke the stream it continues (the failed attempt's error class).
        at: the request's arrival to the failure it continues after, seconds.
    """

    body: dict[str, Any]
    prompt: PromptCount
    max_tokens: int
    cause: str
    at: float


def _stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list):
        return tuple(s for s in stop if isinstance(s, str) and s)
    return ()


class StreamLedger:
    """What one resumable request's stream delivered, and its continuations' rewriting.

    While no resume runs, :meth:`relay` notes each event of the stream (as relayed to
    the client); once one runs (:attr:`current`), it rewrites each continuation event
    into the client's stream and notes that.
    """

    def __init__(self, parsed: ParsedRequest, request_id: str) -> None:
        self.kind = parsed.kind
        self.response_id = response_id(parsed, request_id)
        body = parsed.body
        self.stops = _stop_strings(body)
        self.include_stop = body.get("include_stop_str_in_output") is True
        self._longest = max((len(s) for s in self.stops), default=0)
        #: Chat asks for ``top_logprobs`` alternatives per token (completions for
        #: ``logprobs``); None: no logprobs.
        self.top_logprobs: int | None = None
        if self.kind == "chat" and body.get("logprobs") is True:
            top = body.get("top_logprobs")
            self.top_logprobs = top if isinstance(top, int) and not isinstance(top, bool) else 0
        #: Generated token ids delivered, in order.
        self.ids: list[int] = []
        #: The prompt's token ids as the engine reported them (its first event).
        self.prompt_ids: list[int] | None = None
        #: The text delivered, in pieces.
        self.delivered: list[str] = []
        #: The engine sent its last token (a finish reason).
        self.finished = False
        #: Why the stream so far cannot be continued exactly (None: it can).
        self.blocked: str | None = None
        self.resumes = 0
        #: The continuation running now (None before the first resume).
        self.current: Continuation | None = None
        #: A non-streaming answer's accumulator, kept across the attempts.
        self.acc: ResponseAccumulator | None = None
        #: When the first attempt's prefill completed (the request's TPOT counts from it).
        self.prefill_done: float | None = None
        #: A stop string the router found across a break (the stream ends there).
        self.stopped: str | None = None
        self._created: Any = None
        self._model: Any = None
        #: Characters of text held back while a stop string may still complete.
        self._hold = self._longest - 1 if self._longest and not self.include_stop else 0
        # The current continuation's text, after the tail of the text before it, and
        # how much of it the client had (see begin).
        self._text = ""
        self._emitted = 0
        self._offset = 0

    # ------------------------------------------------------------ the events

    def relay(self, chunk: Chunk) -> Chunk:
        """The event to relay for ``chunk`` (a parsed one), noted in the ledger."""
        if self.current is None:
            self._note(chunk)
            return chunk
        return self._rewrite(chunk)

    def _note(self, chunk: Chunk) -> None:
        data = chunk.data
        if data is None:
            return
        choices = data.get("choices")
        choice = choices[0] if type(choices) is list and choices and type(choices[0]) is dict else None
        if self._created is None:
            self._created, self._model = data.get("created"), data.get("model")
        if self.prompt_ids is None:
            ids = data.get("prompt_token_ids")  # chat: on the response
            if ids is None and choice is not None:
                ids = choice.get("prompt_token_ids")  # completions: on the choice
            if type(ids) is list and ids and all(type(t) is int for t in ids):
                self.prompt_ids = ids
        if chunk.kind == "token":
            if len(chunk.token_ids) != chunk.count:
                self.blocked = "the engine sent output without its token ids"
            self.ids.extend(chunk.token_ids)
            if chunk.text:
                self.delivered.append(chunk.text)
            delta = choice.get("delta") if choice is not None else None
            if type(delta) is dict and any(delta.get(k) for k in _PARSED_DELTA_KEYS):
                self.blocked = "the message carries reasoning or tool calls, which the engine parses from the whole message"
        if chunk.finish_reason is not None:
            self.finished = True

    def _rewrite(self, chunk: Chunk) -> Chunk:
        data = chunk.data
        if data is None:
            return chunk
        reported = data.get("usage")
        choices = data.get("choices")
        choice = choices[0] if type(choices) is list and choices and type(choices[0]) is dict else None
        if choice is None:
            if type(reported) is not dict:
                return chunk  # nothing of the client's in it
            total = self.usage(reported)
            obj = self._usage_event(data, total)
            return Chunk(chunk.kind, _encode(obj), obj, usage=total)
        text = choice.get("text")
        finish = choice.get("finish_reason")
        text, finish, stop_reason = self._across(text if type(text) is str else "", finish, choice.get("stop_reason"))
        ids = chunk.token_ids
        self.ids.extend(ids)
        if text:
            self.delivered.append(text)
        if finish is not None:
            self.finished = True
        usage = self.usage(reported) if type(reported) is dict else None
        logprobs = choice.get("logprobs")
        if self.kind == "chat":
            chosen: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None if type(logprobs) is not dict else chat_logprobs(logprobs, self.top_logprobs or 0),
                "finish_reason": finish,
            }
            if stop_reason is not None:
                chosen["stop_reason"] = stop_reason
            chosen["token_ids"] = list(ids)
            obj = {**self._chat_head(data), "choices": [chosen]}
        else:
            chosen = {**choice, "text": text, "finish_reason": finish, "stop_reason": stop_reason}
            if "prompt_token_ids" in chosen:
                chosen["prompt_token_ids"] = None  # the client had the original prompt's
            if type(logprobs) is dict:
                chosen["logprobs"] = _shifted(logprobs, self._offset)
            obj = {**data, "choices": [chosen]}
        if usage is not None:
            obj["usage"] = usage
        return Chunk(chunk.kind, _encode(obj), obj, ids, chunk.count, text, finish, usage)

    def _across(self, text: str, finish: Any, stop_reason: Any) -> tuple[str, Any, Any]:
        """A continuation event's text with the client's stop strings applied as the
        engine would have applied them to the whole output (the continuation's engine
        is not told them: it could not see one that spans the break, and would hold its
        text back): checked where the new characters may complete one, the text cut at
        the first found (after it with ``include_stop_str_in_output``), and, until the
        end, the last ``len(longest stop) - 1`` characters held back."""
        if not self.stops:
            return text, finish, stop_reason
        seen = len(self._text)
        self._text += text
        whole = self._text
        for stop in self.stops:
            at = whole.find(stop, max(0, seen - len(stop) + 1))
            if at >= 0:
                self.stopped = stop
                end = min(len(whole), at + len(stop)) if self.include_stop else at
                return whole[self._emitted : end], "stop", stop
        end = len(whole) if finish is not None else len(whole) - self._hold
        if end <= self._emitted:
            return "", finish, stop_reason
        out, self._emitted = whole[self._emitted : end], end
        return out, finish, stop_reason

    # ------------------------------------------------------------ usage

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids) if self.prompt_ids is not None else 0

    def usage(self, reported: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The client's usage: the original prompt, and every generated token once."""
        out = dict(reported) if reported is not None else {}
        prompt, completion = self.prompt_tokens, len(self.ids)
        out["prompt_tokens"] = prompt
        out["total_tokens"] = prompt + completion
        out["completion_tokens"] = completion
        details = out.get("prompt_tokens_details")
        if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
            out["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], prompt)}
        return out

    def _usage_event(self, data: Mapping[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            return {**self._chat_head(data), "choices": [], "usage": usage}
        return {**data, "choices": [], "usage": usage}

    def _chat_head(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """A chat chunk's fields before its choices: the original stream's id and time."""
        created = self._created if self._created is not None else data.get("created")
        return {"id": self.response_id, "object": "chat.completion.chunk", "created": created,
                "model": data.get("model", self._model)}  # fmt: skip

    def usage_event(self) -> bytes:
        """The usage event of a stream the router ended (at a stop string)."""
        obj = {"id": self.response_id, "object": "text_completion", "created": self._created, "model": self._model}
        return _encode(self._usage_event(obj, self.usage()))

    # ------------------------------------------------------------ a resume

    def begin(self, continuation: Continuation, held: str) -> None:
        """Start rewriting ``continuation``'s events; ``held``: text generated before the
        break that the client has not had (held back by the engine or the router)."""
        self.current = continuation
        self.resumes += 1
        delivered = "".join(self.delivered)
        self._offset = len(delivered) + len(held)
        # The text before the break a stop string may begin in, and the text held back.
        tail = delivered[len(delivered) - self._longest + 1 :] if self._longest > 1 else ""
        self._text = tail + held
        self._emitted = len(tail)

    @property
    def holds_text(self) -> bool:
        """Whether text generated before a break may not have reached the client (an
        engine holds back text while a stop string may complete; so does the router)."""
        return self._hold > 0


def _encode(obj: Any) -> bytes:
    return b"data: " + json_dumps(obj) + b"\n\n"


def _shifted(logprobs: dict[str, Any], offset: int) -> dict[str, Any]:
    """Completions logprobs with ``text_offset`` counted ``offset`` characters later."""
    offsets = logprobs.get("text_offset")
    if not offset or type(offsets) is not list:
        return logprobs
    return {**logprobs, "text_offset": [o + offset if type(o) is int else o for o in offsets]}


def chat_logprobs(logprobs: Mapping[str, Any], top: int) -> dict[str, Any]:
    """Completions logprobs (parallel lists) as a chat chunk's ``content`` entries, with
    the first ``top`` entries of each token's top map (vLLM builds both from one map)."""
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    content = []
    for i, token in enumerate(tokens):
        alternatives = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append({
            "token": token,
            "logprob": values[i] if i < len(values) else None,
            "bytes": list(str(token).encode("utf-8", errors="replace")),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(str(t).encode("utf-8", errors="replace"))}
                for t, lp in list(alternatives.items())[:top]
            ],
        })  # fmt: skip
    return {"content": content}


# ---------------------------------------------------------------- the decision


def open_ledger(parsed: ParsedRequest, request_id: str) -> StreamLedger | None:
    """A ledger for a request that may be resumed (None: :func:`unresumable`)."""
    return StreamLedger(parsed, request_id) if unresumable(parsed) is None else None


def continuation_body(body: Mapping[str, Any], prompt: Sequence[int], max_tokens: int, sent: int,
                      top_logprobs: int | None, kind: str) -> dict[str, Any]:  # fmt: skip
    """The ``/v1/completions`` body of a continuation of ``body`` after ``sent`` tokens."""
    out = {k: v for k, v in body.items() if k not in _NOT_CARRIED}
    out["prompt"] = list(prompt)
    out["max_tokens"] = max_tokens
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int:
        out["min_tokens"] = max(0, min_tokens - sent)
    if kind == "chat":
        out.pop("logprobs", None)
        if top_logprobs is not None:
            out["logprobs"] = top_logprobs
    return out


#: Prompt tokens before the generated ones a detokenization reads (vLLM's detokenizer
#: starts from the prompt's last few).
_DETOKENIZE_CONTEXT: Final = 5


async def _held_text(lc: RequestLifecycle, ledger: StreamLedger, prompt: Sequence[int], avoid: str | None) -> str:
    """The text generated before the break that the client has not had: the engine's
    ``/detokenize`` of the generated ids (after the prompt's last tokens, as the engine's
    own detokenizer reads them), less the text delivered.

    Raises:
        EngineError: no engine could detokenize, or the text does not extend what was
            delivered.
    """
    state = lc.state
    placement = state.placement
    model = lc.record.model
    names = [*placement.prefill_engines, *placement.decode_engines]
    candidates = [n for n in dict.fromkeys(names) if n != avoid and state.breaker.available(n) and placement.serves(n, model)]
    context = list(prompt[-_DETOKENIZE_CONTEXT:])
    failure: EngineError | None = None
    for name in candidates:
        client = state.clients[name]
        try:
            before = await client.detokenize(context, model=model)
            whole = await client.detokenize([*context, *ledger.ids], model=model)
        except EngineError as err:
            failure = err
            continue
        generated = whole[len(before) :] if whole.startswith(before) else whole
        delivered = "".join(ledger.delivered)
        if not generated.startswith(delivered):
            raise EngineError(f"engine {name}'s text of the generated tokens does not extend the text delivered")
        return generated[len(delivered) :]
    raise failure or EngineError("no engine available to detokenize the generated tokens")



async def resume_after(lc: RequestLifecycle, err: EngineError, attempt: AttemptRecord) -> bool:
    """Prepare the continuation of ``lc``'s stream after ``err`` ended ``attempt``.

    Returns True with the ledger's :attr:`StreamLedger.current` set to the continuation
    to run as the next attempt; False when the stream ends as without resumes
    (``attempt.not_resumed`` says why).
    """
    cfg = lc.config
    if not cfg.recovery.resume_streams:
        return False
    why = await _prepare(lc, err)
    if why is not None:
        attempt.not_resumed = why
        return False
    return True


async def _prepare(lc: RequestLifecycle, err: EngineError) -> str | None:
    cfg = lc.config
    ledger = lc.ledger
    parsed = lc.parsed
    assert parsed is not None  # parsed before any attempt
    at = lc.state.clock() - lc.arrival
    if ledger is None:
        return unresumable(parsed) or "not resumable"
    if not err.transient or err.client_fault:
        return "the engine rejected the request itself"
    if ledger.blocked is not None:
        return ledger.blocked
    if ledger.finished or ledger.stopped is not None:
        return "the engine had sent its last token"
    if ledger.resumes >= cfg.recovery.max_resumes:
        return f"recovery.max_resumes ({cfg.recovery.max_resumes}) reached"
    left = lc.max_tokens - len(ledger.ids)
    if left <= 0:
        return "no output left to generate"
    timeouts = cfg.engine
    if lc.arrival + timeouts.request_timeout_s - lc.state.clock() < timeouts.first_token_timeout_s:
        return "the request deadline leaves no time for a first token (engine.first_token_timeout_s)"
    prompt = ledger.prompt_ids
    if prompt is None and lc.kind == "completions" and lc.prompt is not None and lc.prompt.ids is not None:
        prompt = list(lc.prompt.ids)
    if prompt is None:
        return "the prompt's token ids are unknown (the engine did not report them)"
    if ledger.prompt_ids is None:
        ledger.prompt_ids = prompt
    held = ""
    if ledger.holds_text:
        with trio.move_on_after(timeouts.first_token_timeout_s) as scope:
            try:
                held = await _held_text(lc, ledger, prompt, err.engine)
            except EngineError as failure:
                return f"the text held back at the break is unknown: {failure.message}"
        if scope.cancelled_caught:
            return "the text held back at the break is unknown: detokenizing took engine.first_token_timeout_s"
    ids = [*prompt, *ledger.ids]
    body = continuation_body(parsed.body, ids, left, len(ledger.ids), ledger.top_logprobs, lc.kind)
    cont = Continuation(body, PromptCount(len(ids), None, exact=True, ids=tuple(ids)), left, err.terminal_class, at)
    ledger.begin(cont, held)
    return None
