"""The vLLM HTTP surface of a simulated engine, as a handler for ``HTTPServer``.

Routes and shapes follow a real vLLM 0.32 (OpenAI server): ``/v1/completions`` and
``/v1/chat/completions`` (JSON or SSE with ``return_token_ids``), ``/tokenize``,
``/v1/models``, ``/health``, ``/version``, ``/load`` and ``/metrics``. Scripted faults
are drawn once per generation request and applied here, around the engine.

One route is the simulator's own, not vLLM's: ``GET /narwhal/sim`` (:data:`SIM_IDENTITY_PATH`)
says which simulated engine answers (its name, ``sim`` block and ``connector``), so that
``narwhal serve`` attaches to a running ``narwhal sim`` only where it runs the engine the
fleet document names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NoReturn, Protocol

import attrs
import trio

from narwhal.config import EngineConfig, FaultSpec, converter
from narwhal.http.messages import JSON_HEADERS
from narwhal.testing.engine import EngineRestarted, GenerateParams, Generation, SimEngine, SimError
from narwhal.testing.faults import Faults, leg_of, malform_descriptor
from narwhal.testing.outputs import OutputText, chat_logprobs, completion_logprobs
from narwhal.testing.tokenizer import (
    VOCAB_SIZE,
    ChatTemplateError,
    decode,
    encode,
    encode_chat,
    token_text,
)

__all__ = ["SIM_IDENTITY_PATH", "ConnectionDropped", "SimApp", "sim_identity"]

Kind = Literal["completions", "chat"]
_SSE = [("content-type", "text/event-stream; charset=utf-8")]
_DEATH_GRACE_S = 1.0


class _Request(Protocol):
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None: ...


class _Response(Protocol):
    @property
    def started(self) -> bool: ...

    async def respond(self, status: int, headers: Sequence[tuple[str, str]] = (), body: bytes = b"") -> None: ...

    async def start(self, status: int, headers: Sequence[tuple[str, str]] = ()) -> None: ...

    async def send(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


#: The simulator's own route: which simulated engine answers (:func:`sim_identity`).
SIM_IDENTITY_PATH = "/narwhal/sim"


def sim_identity(config: EngineConfig) -> dict[str, Any]:
    """What identifies a simulated engine: its name, ``sim`` block and ``connector``, as JSON."""
    return {"name": config.name, "sim": converter.unstructure(config.sim),
            "connector": converter.unstructure(config.connector)}  # fmt: skip


class ConnectionDropped(Exception):
    """Raised by the handler to make the server drop the connection mid-response."""


async def _engine_died() -> NoReturn:
    """The engine generation died under this request: its connection must break.

    Where the transport resets the engine's connections (a memory network) the server
    notices and cancels this handler at once; otherwise the handler makes the server
    drop the connection itself.
    """
    with trio.move_on_after(_DEATH_GRACE_S):
        await trio.sleep_forever()
    raise ConnectionDropped("engine restarted")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


@attrs.frozen
class _Job:
    kind: Kind
    response_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    kv_transfer_params: Mapping[str, Any] | None
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    #: Logprobs asked for: completions' ``logprobs``, chat's ``top_logprobs`` (None: none).
    logprobs: int | None = None

    def output(self) -> OutputText:
        return OutputText(self.stop, include_stop=self.include_stop)
    priority: int = 0


class SimApp:
    """The request handler of one :class:`SimEngine`."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.in_flight = 0
        self._routes = {
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/version": ("GET", self._version),
            "/load": ("GET", self._load),
            "/metrics": ("GET", self._metrics),
            "/reset_prefix_cache": ("POST", self._reset_prefix_cache),
            SIM_IDENTITY_PATH: ("GET", self._identity),
        }

    async def __call__(self, request: _Request, response: _Response) -> None:
        route = self._routes.get(request.path)
        if route is None:
            await response.respond(404, JSON_HEADERS, _dumps({"detail": "Not Found"}))
            return
        method, handler = route
        calls = self.engine.stats.calls
        calls[request.path] = calls.get(request.path, 0) + 1
        if request.method != method:
            await response.respond(405, JSON_HEADERS, _dumps({"detail": "Method Not Allowed"}))
            return
        key = self.engine.config.api_key
        if key is not None and request.path.startswith("/v1"):
            if request.header("authorization") != f"Bearer {key}":
                await response.respond(401, JSON_HEADERS, _dumps({"error": "Unauthorized"}))
                return
        try:
            await handler(request, response)
        except SimError as exc:
            if response.started:
                raise ConnectionDropped(exc.message) from exc
            await response.respond(exc.status, JSON_HEADERS, _dumps(exc.body()))
        except EngineRestarted:
            await _engine_died()

    # ------------------------------------------------------------ small routes

    async def _health(self, request: _Request, response: _Response) -> None:
        await response.respond(200)

    async def _version(self, request: _Request, response: _Response) -> None:
        await response.respond(200, JSON_HEADERS, _dumps({"version": self.engine.sim.version}))

    async def _identity(self, request: _Request, response: _Response) -> None:
        await response.respond(200, JSON_HEADERS, _dumps(sim_identity(self.engine.config)))

    async def _load(self, request: _Request, response: _Response) -> None:
        await response.respond(200, JSON_HEADERS, _dumps({"server_load": self.in_flight}))

    async def _metrics(self, request: _Request, response: _Response) -> None:
        text = self.engine.metrics_text().encode()
        await response.respond(200, [("content-type", "text/plain; version=0.0.4; charset=utf-8")], text)

    async def _reset_prefix_cache(self, request: _Request, response: _Response) -> None:
        # vLLM (dev mode) answers 200 with an empty body; a refusal is only logged there.
        self.engine.reset_prefix_cache()
        await response.respond(200)

    async def _models(self, request: _Request, response: _Response) -> None:
        sim, created = self.engine.sim, int(self.engine.process_start_time)
        card = {
            "id": sim.model, "object": "model", "created": created, "owned_by": "vllm",
            "root": sim.model, "parent": None, "max_model_len": sim.max_model_len,
            "permission": [{
                "id": f"modelperm-{self.engine.random_hex(32)}", "object": "model_permission",
                "created": created, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False,
            }],
        }  # fmt: skip
        await response.respond(200, JSON_HEADERS, _dumps({"object": "list", "data": [card]}))

    async def _tokenize(self, request: _Request, response: _Response) -> None:
        body = self._body(request)
        self._check_model(body)
        if "messages" in body:
            ids = self._chat_ids(body.get("messages"))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                # vLLM's /tokenize takes text only: a list of token ids is a 400 there.
                raise SimError(400, "'prompt' must be a string")
            ids = self._prompt_ids(prompt, allow_empty=True)
        strs = [token_text(t) for t in ids] if body.get("return_token_strs") is True else None
        out = {"count": len(ids), "max_model_len": self.engine.sim.max_model_len,
               "tokens": ids, "token_strs": strs}  # fmt: skip
        await response.respond(200, JSON_HEADERS, _dumps(out))

    async def _detokenize(self, request: _Request, response: _Response) -> None:
        body = self._body(request)
        ids = self._prompt_ids(body.get("tokens"), allow_empty=True)
        await response.respond(200, JSON_HEADERS, _dumps({"prompt": decode(ids)}))

    # ------------------------------------------------------------ parsing

    def _body(self, request: _Request) -> dict[str, Any]:
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SimError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise SimError(400, "the request body must be a JSON object")
        return body

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.engine.sim.model:
            raise SimError(404, f"The model `{model}` does not exist.", param="model")

    def _prompt_ids(self, prompt: Any, *, allow_empty: bool = False) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = encode(prompt)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
            if any(not 0 <= t < VOCAB_SIZE for t in ids):
                raise SimError(400, f"token ids must be in [0, {VOCAB_SIZE})", param="prompt")
        else:
            raise SimError(400, "prompt must be a string or a list of token ids", param="prompt")
        if not ids and not allow_empty:
            raise SimError(400, "The prompt cannot be empty", param="prompt")
        return ids

    def _chat_ids(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise SimError(400, "messages must be a non-empty list", param="messages")
        try:
            return encode_chat(messages)
        except ChatTemplateError as exc:
            raise SimError(400, str(exc), param="messages") from None

    def _job(self, request: _Request, body: dict[str, Any], kind: Kind) -> _Job:
        self._check_model(body)
        if body.get("n") not in (None, 1):
            raise SimError(400, "n > 1 is not supported", param="n")
        if kind == "completions":
            ids = self._prompt_ids(body.get("prompt"))
            max_tokens = body.get("max_tokens", 16)
        else:
            ids = self._chat_ids(body.get("messages"))
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        limit = self.engine.sim.max_model_len
        if max_tokens is None:
            max_tokens = max(limit - len(ids), 1)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise SimError(400, "max_tokens must be an integer >= 1", param="max_tokens")
        if len(ids) + max_tokens > limit:
            raise SimError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                param="input_tokens",
            )
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise SimError(400, "priority must be an integer", param="priority")
        if priority != 0 and self.engine.sim.scheduling_policy != "priority":
            raise SimError(400, f"Got priority {priority} but Priority scheduling is not enabled.", param="priority")
        options = body.get("stream_options")
        kv = body.get("kv_transfer_params")
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str))
        logprobs = body.get("logprobs")
        if kind == "chat":
            top = body.get("top_logprobs")
            logprobs = (top if isinstance(top, int) else 0) if logprobs is True else None
        elif not isinstance(logprobs, int) or isinstance(logprobs, bool):
            logprobs = None
        base = request.header("x-request-id") or body.get("request_id")
        if not isinstance(base, str) or not base:
            base = self.engine.random_hex(16)
        return _Job(
            kind=kind,
            response_id=("cmpl-" if kind == "completions" else "chatcmpl-") + base,
            prompt_ids=tuple(ids),
            max_tokens=max_tokens,
            stream=body.get("stream") is True,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            return_token_ids=body.get("return_token_ids") is True,
            kv_transfer_params=kv if isinstance(kv, Mapping) else None,
            stop=stops,
            include_stop=body.get("include_stop_str_in_output") is True,
            logprobs=logprobs,
            priority=priority,
        )

    # ------------------------------------------------------------ generation

    async def _completions(self, request: _Request, response: _Response) -> None:
        await self._generate(request, response, "completions")

    async def _chat(self, request: _Request, response: _Response) -> None:
        await self._generate(request, response, "chat")

    async def _generate(self, request: _Request, response: _Response, kind: Kind) -> None:
        self.in_flight += 1
        try:
            await self._generate_counted(request, response, kind)
        finally:
            self.in_flight -= 1

    async def _generate_counted(self, request: _Request, response: _Response, kind: Kind) -> None:
        engine = self.engine
        body = self._body(request)
        engine.record_request(body, request.header("x-request-id"), request.headers)
        job = self._job(request, body, kind)
        faults = engine.draw_faults(leg_of(body))
        if (spec := faults.get("http_error")) is not None:
            raise SimError(spec.status, spec.message)
        if (spec := faults.get("delay_headers")) is not None:
            await trio.sleep(spec.delay_s)
        if (spec := faults.get("restart")) is not None and (not job.stream or spec.after_tokens == 0):
            engine.trigger_restart(spec.delay_s)
            await _engine_died()
        if job.stream and "done_before_token" in faults:
            await response.start(200, _SSE)
            await response.send(_DONE)
            await response.end()
            return
        slow = faults.get("slow_transfer")
        params = GenerateParams(
            prompt_ids=job.prompt_ids,
            max_tokens=job.max_tokens,
            request_id=f"{job.response_id}-0-{engine.random_hex(8)}",
            kv_transfer_params=job.kv_transfer_params,
            extra_transfer_delay_s=slow.delay_s if slow is not None else 0.0,
            priority=job.priority,
        )
        async with engine.generate(params) as gen:
            if not job.stream:
                await self._complete(job, gen, faults, response)
                return
            try:
                await self._stream(job, gen, faults, response)
            except _StreamEnded:
                pass

    def _envelope(self, job: _Job) -> dict[str, Any]:
        obj = "text_completion" if job.kind == "completions" else "chat.completion.chunk"
        return {"id": job.response_id, "object": obj, "created": int(self.engine.wall_time()),
                "model": self.engine.sim.model}  # fmt: skip

    def _usage(self, job: _Job, completion: int) -> dict[str, int]:
        prompt = len(job.prompt_ids)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}  # fmt: skip

    def _prompt_details(self, gen: Generation) -> dict[str, int | None] | None:
        """``prompt_tokens_details`` as vLLM 0.32 sends it when enabled (a miss included)."""
        if not self.engine.sim.prompt_tokens_details:
            return None
        return {"cached_tokens": gen.cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}

    def _token_chunk(
        self, job: _Job, token: int, text: str, finish: str | None, out: OutputText, first: bool, offset: int
    ) -> dict[str, Any]:
        ids = job.return_token_ids
        stop_reason = out.stop_reason if finish == "stop" else None
        if job.kind == "completions":
            lp = None if job.logprobs is None else completion_logprobs(token, job.logprobs, offset)
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": lp,
                                      "finish_reason": finish, "stop_reason": stop_reason}  # fmt: skip
            if ids:
                choice["prompt_token_ids"] = list(job.prompt_ids) if first else None
                choice["token_ids"] = [token]
        else:
            lp = None if job.logprobs is None else chat_logprobs(token, job.logprobs)
            choice = {"index": 0, "delta": {"content": text}, "logprobs": lp,
                      "finish_reason": finish}  # fmt: skip
            if stop_reason is not None:
                choice["stop_reason"] = stop_reason
            if ids:
                choice["token_ids"] = [token]
        return {**self._envelope(job), "choices": [choice]}

    async def _stream(self, job: _Job, gen: Generation, faults: Faults, response: _Response) -> None:
        await response.start(200, _SSE)
        if job.kind == "chat":
            role: dict[str, Any] = {**self._envelope(job), "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]}  # fmt: skip
            if job.return_token_ids:
                role["prompt_token_ids"] = list(job.prompt_ids)
            await response.send(_event(role))
        sent = 0
        silenced = False
        out = job.output()
        async for event in gen:
            silenced = await self._strike(job, faults, sent, silenced, response)
            offset = out.sent
            out.add(event.token_id)
            finish = "stop" if out.stop_reason is not None else event.finish_reason
            chunk = self._token_chunk(job, event.token_id, out.take(finish is not None), finish, out,
                                      sent == 0 and job.kind == "completions", offset)  # fmt: skip
            await response.send(_event(chunk))
            sent += 1
            if out.stop_reason is not None:
                break  # (leaving the generation aborts the rest, as vLLM's stop does)
        await self._strike(job, faults, sent, silenced, response)
        if job.include_usage:
            usage = {**self._envelope(job), "choices": [], "usage": self._usage(job, sent)}
            if (details := self._prompt_details(gen)) is not None:
                usage["usage"]["prompt_tokens_details"] = details
            if job.kind == "completions":
                usage["system_fingerprint"] = f"vllm-{self.engine.sim.version}-{self.engine.random_hex(8)}"
            await response.send(_event(usage))
        await response.send(_DONE)
        await response.end()

    async def _strike(
        self, job: _Job, faults: Faults, sent: int, silenced: bool, response: _Response
    ) -> bool:
        """Apply the stream faults due after ``sent`` tokens; returns ``silenced``."""

        def due(kind: str) -> FaultSpec | None:
            spec = faults.get(kind)
            return spec if spec is not None and sent >= spec.after_tokens else None

        if (spec := due("restart")) is not None:
            self.engine.trigger_restart(spec.delay_s)
            await _engine_died()
        if due("close_before_done") is not None:
            raise ConnectionDropped("injected close before [DONE]")
        if (spec := due("error_in_stream")) is not None:
            await response.send(_event(SimError(spec.status, spec.message).body()))
            await response.send(_DONE)
            await response.end()
            raise _StreamEnded
        if not silenced and (spec := due("silence_after")) is not None:
            if spec.delay_s > 0:
                await trio.sleep(spec.delay_s)
            else:
                await trio.sleep_forever()
            return True
        return silenced

    async def _complete(self, job: _Job, gen: Generation, faults: Faults, response: _Response) -> None:
        tokens: list[int] = []
        text_out = job.output()
        async for event in gen:
            tokens.append(event.token_id)
            text_out.add(event.token_id)
            if text_out.stop_reason is not None:
                break
        if (spec := faults.get("silence_after")) is not None:
            if spec.delay_s > 0:
                await trio.sleep(spec.delay_s)
            else:
                await trio.sleep_forever()
        if (spec := faults.get("error_in_stream")) is not None:
            raise SimError(spec.status, spec.message)
        finish: str | None = "stop" if text_out.stop_reason is not None else gen.finish_reason
        stop_reason = text_out.stop_reason
        kv = gen.kv_transfer_params
        if "done_before_token" in faults:
            tokens, finish, kv = [], "stop", None
        if kv is not None and (spec := faults.get("malformed_descriptor")) is not None:
            kv = malform_descriptor(kv, self.engine.faults.pick_variant(spec))
        text = text_out.take(True) if tokens else ""
        ids = job.return_token_ids
        prompt_ids = list(job.prompt_ids) if ids else None
        usage = {**self._usage(job, len(tokens)), "prompt_tokens_details": self._prompt_details(gen)}
        out: dict[str, Any] = {"id": job.response_id}
        if job.kind == "completions":
            out |= {"object": "text_completion", "created": int(self.engine.wall_time()),
                    "model": self.engine.sim.model, "choices": [{
                        "index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                        "stop_reason": stop_reason, "token_ids": tokens if ids else None,
                        "prompt_logprobs": None, "prompt_token_ids": prompt_ids}],
                    "service_tier": None, "system_fingerprint": None, "usage": usage}  # fmt: skip
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                       "audio": None, "function_call": None, "tool_calls": [],
                       "reasoning_content": None}  # fmt: skip
            out |= {"object": "chat.completion", "created": int(self.engine.wall_time()),
                    "model": self.engine.sim.model, "choices": [{
                        "index": 0, "message": message, "logprobs": None,
                        "finish_reason": finish, "stop_reason": stop_reason,
                        "token_ids": tokens if ids else None}],
                    "service_tier": None, "system_fingerprint": None, "usage": usage,
                    "prompt_logprobs": None, "prompt_token_ids": prompt_ids}  # fmt: skip
        out["kv_transfer_params"] = kv
        if "close_before_done" in faults:
            await response.start(200, JSON_HEADERS)
            await response.send(_dumps(out)[:20])
            raise ConnectionDropped("injected close before the body ended")
        await response.respond(200, JSON_HEADERS, _dumps(out))


class _StreamEnded(Exception):
    """Internal: a fault ended the stream properly; nothing more to send."""
