"""The open-loop runner: every scheduled request starts at its time, whatever came before.

A dispatcher sleeps until each request's scheduled start and starts one task for it in
the run's nursery; no request waits for an earlier response. With a concurrency cap a
request waits for a slot (``cap_wait_s``); with a saturated event loop the dispatcher
or the task runs late. Both show up as lag, ``actual_s - scheduled_s``, and both start
times are kept.

Each request is a streaming completion (or chat completion) with
``return_token_ids: true`` and ``stream_options.include_usage``; events are decoded
with :mod:`narwhal.engines.sse` and output is counted by token id, never by text.
Terminal classes: ``ok``; ``refused`` (503); ``http_<status>``; ``stream_error`` (an
error event after 200, an event that is not JSON, ``[DONE]`` before any token);
``stream_closed`` (the response ended before ``[DONE]``); ``connect_error``;
``timeout`` (``request_timeout_s`` from the request's start); ``client_cancelled``
(the run was stopped, or the request never started).

Times come from :func:`trio.current_time` (virtual under ``autojump_clock``); wall
clock Unix times are labels of the run only.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from typing import Any, Final, Literal, Protocol

import attrs
import httpx
import trio

from narwhal.bench.mix import Stream
from narwhal.bench.records import RequestResult
from narwhal.bench.workload import ScheduledRequest, prompt_ids, prompt_text
from narwhal.engines.sse import Chunk, MalformedEvent, SSEDecoder, SSEError, json_loads, parse_chunk
from narwhal.engines.stream import abandon

__all__ = ["BenchError", "BenchOptions", "BenchRun", "BenchRunner", "ProgressSink", "Route", "run_bench"]

Route = Literal["completions", "chat"]
_PATHS: Final[dict[str, str]] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_BODY_LIMIT: Final = 64 * 1024
_MESSAGE_LIMIT: Final = 500
_CLOSE_TIMEOUT_S: Final = 5.0
#: After ``[DONE]`` the end of the body is normally already in flight; reading it lets
#: the connection go back to the pool.
_DRAIN_AFTER_DONE_S: Final = 0.1


class BenchError(RuntimeError):
    """The run cannot start (the server is unreachable, no model is served, ...)."""


class ProgressSink(Protocol):
    """What the runner reports to while it runs."""

    def request_started(self, record: RequestResult) -> None: ...

    def request_finished(self, record: RequestResult) -> None: ...


@attrs.frozen(kw_only=True)
class BenchOptions:
    """How a run talks to the server.

    Attributes:
        url: the server's base URL.
        more_urls: base URLs of further replicas of the same service: scheduled request
            ``i`` goes to ``(url, *more_urls)[i % n]``, round robin, as a load balancer
            in front of them would send it (the model is asked of ``url``).
        route: ``completions`` or ``chat``.
        model: the model to ask for (None: the first of ``GET /v1/models``).
        concurrency: most requests in flight at once (None: no cap).
        request_timeout_s: per-request limit from its start (class ``timeout``).
        connect_timeout_s: the connect timeout of the HTTP client.
        warmup: the first ``warmup`` scheduled requests are not scored.
        seed: seed of the generated prompts.
        prompt_format: ``text`` (words) or ``ids`` (token ids; completions only).
        ignore_eos: ask the engine to generate the full requested length.
        api_key: sent as ``Authorization: Bearer``.
        run_id: prefix of the request ids (random when None).
        streams: the streams of a mix (a scheduled request's ``stream`` indexes them):
            each request carries its stream's headers (its key's included) and labels.
    """

    url: str
    more_urls: tuple[str, ...] = ()
    route: Route = "completions"
    model: str | None = None
    concurrency: int | None = None
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    warmup: int = 0
    seed: int = 0
    prompt_format: Literal["text", "ids"] = "text"
    ignore_eos: bool = True
    api_key: str | None = None
    run_id: str | None = None
    streams: tuple[Stream, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("the concurrency cap must be >= 1")
        if not self.request_timeout_s > 0:
            raise ValueError("the request timeout must be > 0")
        if self.prompt_format == "ids" and self.route == "chat":
            raise ValueError("token-id prompts work with completions only")
        if self.warmup < 0:
            raise ValueError("the warmup count must be >= 0")


@attrs.define
class BenchRun:
    """A finished (or stopped) run: its records and labels.

    Attributes:
        run_id: the prefix of every request id of the run.
        url: the server's base URL.
        route: ``completions`` or ``chat``.
        model: the model asked for.
        records: one record per scheduled request, in schedule order.
        started_unix: wall-clock label of the run's start.
        finished_unix: wall-clock label of the run's end.
        duration_s: run start to the last terminal outcome (run clock).
        interrupted: the run was stopped before every request ended.
    """

    run_id: str
    url: str
    route: str
    model: str
    records: list[RequestResult]
    started_unix: float
    finished_unix: float
    duration_s: float
    interrupted: bool = False


def _truncate(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 1] + "…"


def _error_info(error: Any, fallback: str) -> dict[str, Any]:
    """``{"message", "type", "code"}`` from an OpenAI-shaped error object or body."""
    if isinstance(error, dict) and isinstance(error.get("error"), dict | str):
        error = error["error"]
    if isinstance(error, str):
        return {"message": _truncate(error) or fallback, "type": None, "code": None}
    if isinstance(error, dict):
        message = error.get("message")
        if not isinstance(message, str) and error.get("detail") is not None:
            message = str(error["detail"])
        return {
            "message": _truncate(message) if isinstance(message, str) and message else fallback,
            "type": error.get("type") if isinstance(error.get("type"), str) else None,
            "code": error.get("code") if isinstance(error.get("code"), int | str) else None,
        }
    return {"message": fallback, "type": None, "code": None}


def _body_error(data: bytes, fallback: str) -> dict[str, Any]:
    try:
        obj = json_loads(data)
    except ValueError:
        obj = data.decode("utf-8", "replace")
    return _error_info(obj, fallback)


class BenchRunner:
    """Runs one schedule against one server (see the module docstring).

    Args:
        schedule: the requests, in order of their start offsets.
        options: how to talk to the server.
        transport: an httpx transport (tests: an in-memory network); None for sockets.
        progress: told when each request starts and ends.
    """

    def __init__(
        self,
        schedule: Sequence[ScheduledRequest],
        options: BenchOptions,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        progress: ProgressSink | None = None,
    ) -> None:
        self.schedule = list(schedule)
        self.options = options
        self.transport = transport
        self.progress = progress
        self.run_id = options.run_id or f"bench-{secrets.token_hex(4)}"
        self._scope = trio.CancelScope()
        self._limit = trio.Semaphore(options.concurrency) if options.concurrency else None
        self._t0 = 0.0
        self._model = options.model or ""
        self._last_end = 0.0

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._scope.cancel_called

    def stop(self) -> None:
        """Stop the run: requests in flight end as ``client_cancelled``."""
        self._scope.cancel()

    async def run(self) -> BenchRun:
        """Run the schedule; returns every record once all requests ended (or on stop)."""
        opts = self.options
        headers = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
        records = [
            RequestResult(
                index=req.index,
                request_id=f"{self.run_id}-{req.index:06d}",
                route=opts.route,
                warmup=req.index < opts.warmup,
                scheduled_s=req.offset_s,
                prompt_len=req.prompt_len,
                requested_output_len=req.output_len,
            )
            for req in self.schedule
        ]
        for req, rec in zip(self.schedule, records, strict=True):
            if req.stream is not None:
                stream = opts.streams[req.stream]
                rec.stream, rec.tenant, rec.latency_class = stream.name, stream.tenant, stream.latency_class
        started_unix = time.time()
        async with AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(
                        base_url=url,
                        transport=self.transport,
                        headers=headers,
                        timeout=httpx.Timeout(None, connect=opts.connect_timeout_s),
                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                    )
                )
                for url in (opts.url, *opts.more_urls)
            ]
            with self._scope:
                if not self._model:
                    self._model = await self._discover_model(clients[0])
                started_unix = time.time()
                self._t0 = self._last_end = trio.current_time()
                async with trio.open_nursery() as nursery:
                    for req, rec in zip(self.schedule, records, strict=True):
                        await trio.sleep_until(self._t0 + req.offset_s)
                        nursery.start_soon(self._one, clients[req.index % len(clients)], req, rec)
        if not self._model:
            raise BenchError("the run was stopped before it started")
        for rec in records:
            if rec.actual_s is None and rec.error is None:
                rec.error = {"message": "never started: the bench was stopped", "type": None, "code": None}
        return BenchRun(
            run_id=self.run_id,
            url=opts.url,
            route=opts.route,
            model=self._model,
            records=records,
            started_unix=started_unix,
            finished_unix=time.time(),
            duration_s=self._last_end - self._t0,
            interrupted=self._scope.cancelled_caught,
        )

    async def _discover_model(self, client: httpx.AsyncClient) -> str:
        streams = self.options.streams
        # A mix's keys are its streams': the first stream's asks (the client's key, if any, wins).
        headers = dict(streams[0].headers) if streams and not self.options.api_key else None
        try:
            with trio.fail_after(self.options.request_timeout_s):
                response = await client.get("/v1/models", headers=headers)
        except trio.TooSlowError:
            raise BenchError(f"{self.options.url}/v1/models did not answer in time") from None
        except httpx.HTTPError as exc:
            raise BenchError(f"cannot reach {self.options.url}: {exc or type(exc).__name__}") from None
        if response.status_code != 200:
            info = _body_error(response.content, response.reason_phrase)
            raise BenchError(f"GET /v1/models answered {response.status_code}: {info['message']}")
        try:
            data = response.json()["data"]
            return str(data[0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise BenchError("GET /v1/models lists no model; pass --model") from None

    def _body(self, req: ScheduledRequest) -> dict[str, Any]:
        opts = self.options
        prompt: str | list[int]
        if req.prompt is not None:
            prompt = req.prompt
        elif opts.prompt_format == "ids":
            prompt = prompt_ids(req.prompt_len or 1, seed=opts.seed, index=req.index)
        else:
            prompt = prompt_text(req.prompt_len or 1, seed=opts.seed, index=req.index)
        body: dict[str, Any] = {"model": self._model}
        if opts.route == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = req.output_len
        else:
            body["prompt"] = prompt
            body["max_tokens"] = req.output_len
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        body["return_token_ids"] = True
        if opts.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def _one(self, client: httpx.AsyncClient, req: ScheduledRequest, rec: RequestResult) -> None:
        body = self._body(req)
        extra = self.options.streams[req.stream].headers if req.stream is not None else ()
        clock = trio.current_time
        try:
            if self._limit is not None:
                waited_from = clock()
                async with self._limit:
                    rec.cap_wait_s = clock() - waited_from
                    await self._exchange(client, body, rec, extra)
            else:
                rec.cap_wait_s = 0.0
                await self._exchange(client, body, rec, extra)
        except trio.Cancelled:
            if not rec.done and rec.error is None:  # not already at its outcome
                rec.terminal_class = "client_cancelled"
                rec.error = {"message": "the bench was stopped", "type": None, "code": None}
            raise
        finally:
            self._last_end = max(self._last_end, clock())
            if self.progress is not None and rec.actual_s is not None:
                self.progress.request_finished(rec)

    async def _exchange(
        self, client: httpx.AsyncClient, body: dict[str, Any], rec: RequestResult,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        clock = trio.current_time
        start = clock()
        rec.actual_s = start - self._t0
        # Never negative: sleep_until does not wake early (the difference is rounding).
        rec.lag_s = max(0.0, rec.actual_s - rec.scheduled_s)
        if self.progress is not None:
            self.progress.request_started(rec)
        try:
            with trio.move_on_after(self.options.request_timeout_s) as deadline:
                await self._stream(client, body, rec, start, extra)
        finally:
            rec.latency_s = clock() - start
        if deadline.cancelled_caught and not rec.done and rec.error is None:
            rec.terminal_class = "timeout"
            rec.error = {
                "message": f"no complete response within {self.options.request_timeout_s:g} s "
                f"(after {rec.output_len} tokens)",
                "type": None,
                "code": None,
            }

    async def _stream(
        self, client: httpx.AsyncClient, body: dict[str, Any], rec: RequestResult, start: float,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        headers = {**dict(extra), "x-request-id": rec.request_id, "accept": "text/event-stream"}
        path = _PATHS[rec.route]
        try:
            async with client.stream("POST", path, json=body, headers=headers) as response:
                try:
                    rec.status = response.status_code
                    if response.status_code != 200:
                        data = await _read_limited(response.aiter_bytes(), _ERROR_BODY_LIMIT)
                        rec.error = _body_error(data, response.reason_phrase or f"HTTP {response.status_code}")
                        rec.terminal_class = "refused" if response.status_code == 503 else f"http_{response.status_code}"
                        return
                    await self._consume(response, rec, start)
                finally:
                    with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
                        await response.aclose()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            rec.terminal_class = "connect_error"
            rec.error = {"message": _truncate(str(exc)) or type(exc).__name__, "type": type(exc).__name__, "code": None}
        except httpx.TimeoutException as exc:
            rec.terminal_class = "timeout"
            rec.error = {"message": _truncate(str(exc)) or type(exc).__name__, "type": type(exc).__name__, "code": None}
        except httpx.HTTPError as exc:
            # The connection broke before the response was complete.
            rec.terminal_class = "stream_closed"
            where = "before the response" if rec.status is None else f"after {rec.output_len} tokens"
            rec.error = {
                "message": f"connection lost {where}: {_truncate(str(exc)) or type(exc).__name__}",
                "type": type(exc).__name__,
                "code": None,
            }

    async def _consume(self, response: httpx.Response, rec: RequestResult, start: float) -> None:
        """Read an SSE body to its terminal outcome, counting identified tokens."""
        decoder = SSEDecoder()
        iterator = response.aiter_bytes()
        finished = False
        try:
            while True:
                try:
                    data = await iterator.__anext__()
                except StopAsyncIteration:
                    finished = True
                    events = decoder.flush()
                else:
                    try:
                        events = decoder.feed(data)
                    except SSEError as exc:
                        self._fail(rec, "stream_error", f"unusable event stream: {exc}")
                        return
                for event in events:
                    try:
                        chunk = parse_chunk(event)
                    except MalformedEvent as exc:
                        self._fail(rec, "stream_error", str(exc))
                        return
                    if self._take(chunk, rec, start):
                        if rec.done and not finished:
                            finished = await _drain(iterator)
                        return
                if finished:
                    self._fail(rec, "stream_closed", f"the stream ended before data: [DONE] (after {rec.output_len} tokens)")
                    return
        finally:
            if not finished:
                await abandon(iterator)

    def _take(self, chunk: Chunk, rec: RequestResult, start: float) -> bool:
        """Account one event; returns whether it ended the stream."""
        if chunk.usage is not None:
            prompt = chunk.usage.get("prompt_tokens")
            completion = chunk.usage.get("completion_tokens")
            rec.prompt_tokens = prompt if isinstance(prompt, int) else rec.prompt_tokens
            rec.completion_tokens = completion if isinstance(completion, int) else rec.completion_tokens
        if chunk.finish_reason is not None:
            rec.finish_reason = chunk.finish_reason
        if chunk.kind == "token":
            now = trio.current_time() - start
            if rec.ttft_s is None:
                rec.ttft_s = now
            rec.output_len += chunk.count
            if not chunk.text:
                rec.empty_text_tokens += chunk.count
            if not chunk.token_ids:
                rec.events_without_ids += 1
            if rec.output_len >= 2:
                rec.tpot_s = (now - rec.ttft_s) / (rec.output_len - 1)
            return False
        if chunk.kind == "meta":
            return False
        if chunk.kind == "error":
            rec.terminal_class = "stream_error"
            rec.error = _error_info(chunk.error, "error event in the stream")
            return True
        rec.done = True
        if rec.output_len == 0:
            self._fail(rec, "stream_error", "data: [DONE] before any token")
        else:
            rec.terminal_class = "ok"
        return True

    @staticmethod
    def _fail(rec: RequestResult, terminal_class: str, message: str) -> None:
        rec.terminal_class = terminal_class
        rec.error = {"message": _truncate(message), "type": None, "code": None}


async def _read_limited(iterator: AsyncIterator[bytes], limit: int) -> bytes:
    """At most ``limit`` bytes of a body; the iterator is finished either way."""
    parts: list[bytes] = []
    size = 0
    finished = False
    try:
        while size < limit:
            try:
                part = await iterator.__anext__()
            except StopAsyncIteration:
                finished = True
                break
            parts.append(part)
            size += len(part)
    except httpx.HTTPError:
        finished = True  # a truncated error body still says what it can
    finally:
        if not finished:
            await abandon(iterator)
    return b"".join(parts)[:limit]


async def _drain(iterator: AsyncIterator[bytes]) -> bool:
    """Read what follows ``[DONE]`` for a moment; returns whether the body ended."""
    with trio.move_on_after(_DRAIN_AFTER_DONE_S):
        try:
            while True:
                await iterator.__anext__()
        except StopAsyncIteration:
            return True
        except httpx.HTTPError:
            return True
    return False


async def run_bench(
    schedule: Sequence[ScheduledRequest],
    options: BenchOptions,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: ProgressSink | None = None,
) -> BenchRun:
    """Run ``schedule`` open loop against ``options.url`` (see :class:`BenchRunner`)."""
    return await BenchRunner(schedule, options, transport=transport, progress=progress).run()
