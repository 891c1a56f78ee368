"""EngineClient: one engine's HTTP surface (prefill, decode stream, tokenize, metrics).

The client speaks the vLLM OpenAI-compatible surface. By default it talks to the
engine through :class:`~narwhal.engines.wire.WireTransport` (a lean keep-alive
HTTP/1.1 pool) with pre-encoded request heads; given another httpx transport or an
``httpx.AsyncClient`` it goes through httpx. It translates every library error at
this boundary into :mod:`narwhal.errors` (``engine`` and ``leg`` set), and takes no
timeout arguments: callers own deadlines with trio cancel scopes. The only timeout
configured on the transport is the connect timeout.

What an engine answers is not trusted: every answer is read up to a size limit
(:class:`~narwhal.config.EngineLimits`), and a value the client cannot use (an
answer past its limit, a gauge that is no number, a token count that contradicts its
ids) is that engine's :class:`~narwhal.errors.EngineProtocolError`, reported to the
client's :class:`~narwhal.engines.badinput.BadInput` (counted, logged sparingly).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, Self
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from narwhal.config import EngineLimits
from narwhal.engines.badinput import BadInput
from narwhal.engines.connector import (
    CONNECTOR_MISMATCH,
    MISSING_DESCRIPTOR,
    SUPPORTED_CONNECTORS,
    UNEXPECTED_FINISH_REASON,
    ConnectorLike,
    PrefillResult,
    RequestKind,
    connector_type,
    detached,
    prefill_request_params,
    strip_transfer_params,
    validate_descriptor,
)
from narwhal.engines.metrics import (
    LOAD_SAMPLES,
    EngineMetrics,
    MalformedMetrics,
    engine_metrics,
    parse_prometheus,
    start_time,
)
from narwhal.engines.sse import (
    json_dumps,
    json_loads,
)
from narwhal.engines.stream import (
    CLOSE_TIMEOUT_S,
    DecodeStream,
    EngineReply,
    HttpxReply,
    check_kind,
    error_message,
    error_object,
    new_request_id,
    status_of,
    stream_error,
    truncate,
    usage_cached_tokens,
)
from narwhal.engines.wire import WireTransport
from narwhal.errors import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
    InvalidDescriptor,
    StreamClosed,
)

__all__ = ["DecodeStream", "EngineClient", "EngineIdentity", "Tokenized", "start_date"]

#: Trace context headers for an engine request: ``(name, value)`` pairs (``traceparent``,
#: ``tracestate``), sent as they are.
TraceHeaders = Sequence[tuple[str, str]]

_PATHS: Final[Mapping[str, str]] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
#: How much of an error body is read (the rest is not: the connection is closed).
ERROR_BODY_LIMIT: Final = 64 * 1024
#: Tokens a chat template (or a tokenizer's special tokens) may add to a prompt beyond one
#: per byte of its text: a ``/tokenize`` count above that is no count of this prompt.
TEMPLATE_TOKENS: Final = 4096
#: The samples identity reads from ``/metrics``.
_IDENTITY_SAMPLES: Final = frozenset({"process_start_time_seconds"})
#: Idle keep-alive connections are dropped before the engine's server would close them
#: (uvicorn, which vLLM runs, closes idle connections after 5 s): reusing a connection
#: the server is closing fails the request.
_KEEPALIVE_EXPIRY_S: Final = 4.0
_MAX_KEEPALIVE: Final = 256


@attrs.frozen
class Tokenized:
    """The answer of ``POST /tokenize``."""

    count: int
    max_model_len: int | None
    ids: tuple[int, ...]


@attrs.frozen
class EngineIdentity:
    """One engine generation: a restarted engine compares unequal to its predecessor."""

    url: str
    model: str | None
    version: str | None
    max_model_len: int | None
    process_start_time: float | None


def start_date(ts: float | None) -> str:
    """An engine's process start time (epoch seconds) as a UTC date, as lines show it
    (a time that is no date, from a file or an engine, is shown as the number it is)."""
    if ts is None:
        return "unknown"
    try:
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, ValueError, OSError):  # inf, NaN, past year 9999
        return f"{ts!r} (not a date)"


class _DecodeOpener(AbstractAsyncContextManager[DecodeStream]):
    """``async with client.decode(...) as stream``: opens on enter, closes on exit."""

    def __init__(
        self,
        client: EngineClient,
        prefill: PrefillResult | None,
        body: Mapping[str, Any],
        kind: RequestKind,
        request_id: str,
        leg: str | None,
        lazy: bool = False,
        trace: TraceHeaders = (),
    ) -> None:
        self._client = client
        self._lazy = lazy
        self._trace = trace
        self._prefill = prefill
        self._body = body
        self._kind: RequestKind = kind
        self._request_id = request_id
        self._leg = leg
        self._stream: DecodeStream | None = None
        self._entered = False

    async def __aenter__(self) -> DecodeStream:
        if self._entered:
            raise RuntimeError("a decode context can be entered only once")
        self._entered = True
        self._stream = await self._client._open_decode(
            self._prefill, self._body, self._kind, self._request_id, self._leg, self._lazy, self._trace
        )
        return self._stream

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose(drain=exc_type is None)


class EngineClient:
    """A client for one engine's OpenAI-compatible HTTP surface.

    Args:
        url: the engine's base URL (``http://host:port``).
        name: the engine's name in errors and results (default: ``url``).
        model: the served model; sent when a body names none.
        connector: the engine's KV connector configuration (``type``, ``kv_host``,
            ``kv_port``); ``None`` means NixlConnector with no endpoint to check.
        api_key: sent as ``Authorization: Bearer``.
        transport: an httpx transport for the client this object builds (in-memory
            networks, ``httpx.MockTransport`` in tests).
        http_client: an existing ``httpx.AsyncClient`` to share; it is not closed by
            :meth:`aclose`.
        connect_timeout_s: the connect timeout; nothing else times out here.
        url_in_errors: the client's error bodies name the engine's URL after its name
            (``engine d0 at http://host:port unreachable``); otherwise the name alone.
        limits: how much of the engine's answers is read (sizes, counts); the
            defaults of :class:`~narwhal.config.EngineLimits` by default.
        bad_input: where the engine's unusable answers are counted and logged (a
            router shares one between its engines); a client of its own by default.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str | None = None,
        model: str | None = None,
        connector: ConnectorLike | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        connect_timeout_s: float = 5.0,
        url_in_errors: bool = False,
        limits: EngineLimits | None = None,
        bad_input: BadInput | None = None,
    ) -> None:
        if transport is not None and http_client is not None:
            raise ValueError("pass either transport or http_client, not both")
        self.url = url.rstrip("/")
        self.name = name if name is not None else self.url
        #: How the client's error bodies name this engine.
        self.public_name = f"{self.name} at {self.url}" if url_in_errors and self.name != self.url else self.name
        self.model = model
        self.connector = connector
        self.connect_timeout_s = connect_timeout_s
        self.limits = limits if limits is not None else EngineLimits()
        self.bad_input = bad_input if bad_input is not None else BadInput()
        self._api_key = api_key
        self._owns_client = http_client is None
        self._owns_transport = http_client is None and transport is None
        #: When this object builds its client, requests go straight to the transport:
        #: AsyncClient.send's auth, redirect, cookie and event-hook layers cost more
        #: than the request itself on the router's hot path, and none apply here.
        self._transport: httpx.AsyncBaseTransport | None = None
        self._urls: dict[str, httpx.URL] = {}
        self._extensions = {"timeout": {"connect": connect_timeout_s, "read": None, "write": None, "pool": None}}
        parts = urlsplit(self.url)
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path
        auth = b"authorization: Bearer %s\r\n" % api_key.encode("latin-1") if api_key else b""
        self._fields_json = b"accept: application/json\r\n" + auth
        self._fields_post = self._fields_json + b"content-type: application/json\r\n"
        self._fields_stream = (
            b"accept: text/event-stream\r\naccept-encoding: identity\r\n"
            b"content-type: application/json\r\n" + auth
        )
        #: The pre-encoded request path: this client's own WireTransport over plain HTTP.
        self._wire: WireTransport | None = None
        if http_client is None:
            if transport is None and parts.scheme == "https":
                transport = httpx.AsyncHTTPTransport()  # TLS engines: httpx's own transport
            if transport is None:
                transport = WireTransport(
                    max_idle_per_origin=_MAX_KEEPALIVE,
                    idle_expiry_s=_KEEPALIVE_EXPIRY_S,
                    connect_timeout_s=connect_timeout_s,
                )
            if isinstance(transport, WireTransport) and parts.scheme == "http":
                self._wire = transport
            self._transport = transport
            http_client = httpx.AsyncClient(
                transport=transport,
                timeout=httpx.Timeout(None, connect=connect_timeout_s),
                follow_redirects=False,
            )
        self._http = http_client

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r}, name={self.name!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pooled connections (only when this object built the client)."""
        if self._owns_client:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await self._http.aclose()

    async def close_connections(self) -> None:
        """Close this engine's connections: all of this client's own pool, or this
        engine's idle connections in a transport shared with other clients."""
        if self._owns_transport:
            await self.aclose()
        elif self._wire is not None:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await self._wire.close_origin(self._host, self._port)

    # ----------------------------------------------------------------- plumbing

    def _headers(
        self, request_id: str | None, *, stream: bool = False, trace: TraceHeaders = ()
    ) -> dict[str, str]:
        headers = {"accept": "text/event-stream" if stream else "application/json"}
        if stream:
            # Compression would hold tokens back in the encoder's buffer.
            headers["accept-encoding"] = "identity"
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        if request_id is not None:
            headers["x-request-id"] = request_id
        for name, value in trace:
            headers[name] = value
        return headers

    def map_error(self, exc: httpx.HTTPError, leg: str | None) -> EngineError:
        """Translate an httpx error into the narwhal error it means (most specific first).

        The message keeps the library's text for the journal and logs; the client's
        error body (``public_message``) does not, since it can name addresses.
        """
        name = self.name
        detail = truncate(str(exc), 200) or type(exc).__name__
        public_name = self.public_name

        def error(cls: type[EngineError], what: str) -> EngineError:
            public = what.replace(f"engine {name}", f"engine {public_name}", 1)
            return cls(f"{what}: {detail}", engine=name, leg=leg, public=public)

        # Timeout-shaped faults are 504s (connect and pool timeouts included); a
        # refused or reset connection is a 502.
        if isinstance(exc, httpx.ConnectTimeout):
            return error(EngineTimeout, f"engine {name} unreachable (connect timed out)")
        if isinstance(exc, httpx.PoolTimeout):
            return error(EngineTimeout, f"no connection to engine {name} available in time")
        if isinstance(exc, httpx.ConnectError):
            return error(EngineUnavailable, f"engine {name} unreachable")
        if isinstance(exc, httpx.TimeoutException):
            return error(EngineTimeout, f"engine {name} timed out")
        if isinstance(
            exc, httpx.ReadError | httpx.WriteError | httpx.CloseError | httpx.RemoteProtocolError
        ):
            return error(
                StreamClosed, f"engine {name} closed the connection before the response completed"
            )
        if isinstance(exc, httpx.ProtocolError | httpx.DecodingError):
            return error(EngineProtocolError, f"engine {name} protocol error")
        if isinstance(exc, httpx.TransportError):
            return error(EngineUnavailable, f"engine {name} unreachable")
        return error(EngineError, f"engine {name} request failed")

    async def _open(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None,
        *,
        leg: str | None,
        request_id: str | None = None,
        stream: bool = False,
        trace: TraceHeaders = (),
    ) -> EngineReply:
        """Send a request; the reply once its head has arrived (the caller closes it).

        ``trace``: the trace context headers (``traceparent``, ``tracestate``) to send.
        """
        content = json_dumps(payload) if payload is not None else None
        try:
            wire = self._wire
            if wire is not None:
                fields = (
                    self._fields_stream if stream else self._fields_post if content is not None else self._fields_json
                )
                if request_id is not None:
                    fields += b"x-request-id: %s\r\n" % _header_value(request_id)
                for name, value in trace:
                    fields += b"%s: %s\r\n" % (name.encode("ascii"), _header_value(value, name))
                return await wire.request(
                    method, self._host, self._port, self._prefix + path, fields, content or b""
                )
            headers = self._headers(request_id, stream=stream, trace=trace)
            if content is not None:
                headers["content-type"] = "application/json"
            transport = self._transport
            if transport is None:
                request = self._http.build_request(method, self.url + path, content=content, headers=headers)
                return HttpxReply(await self._http.send(request, stream=True))
            url = self._urls.get(path)
            if url is None:
                url = self._urls[path] = httpx.URL(self.url + path)
            request = httpx.Request(method, url, headers=headers, content=content, extensions=self._extensions)
            response = await transport.handle_async_request(request)
            response.request = request
            return HttpxReply(response)
        except httpx.HTTPError as exc:
            raise self.map_error(exc, leg) from exc

    async def _fetch(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None,
        *,
        leg: str | None,
        request_id: str | None = None,
        trace: TraceHeaders = (),
        metrics: bool = False,
    ) -> tuple[int, str, bytes]:
        """Send a request and read the answer: (status, reason, body).

        A 200's body is read whole up to ``engine_limits.max_response_bytes`` (with
        ``metrics``: ``max_metrics_bytes``), and one that declares or sends more is the
        engine's protocol error; another status's body is read up to
        :data:`ERROR_BODY_LIMIT` (what it says past that is not needed).
        """
        reply = await self._open(method, path, payload, leg=leg, request_id=request_id, trace=trace)
        if reply.status != 200:
            return reply.status, reply.reason, await self._read_limited(reply, ERROR_BODY_LIMIT)
        if metrics:
            limit, setting = self.limits.max_metrics_bytes, "engine_limits.max_metrics_bytes"
        else:
            limit, setting = self.limits.max_response_bytes, "engine_limits.max_response_bytes"
        parts: list[bytes] = []
        try:
            declared = reply.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise self.bad_answer(_source(path), f"{method} {path} declares a body of {declared} bytes, "
                                      f"over {limit} ({setting})", leg)  # fmt: skip
            size = 0
            iterator = reply.body
            while True:
                try:
                    part = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                size += len(part)
                if size > limit:
                    raise self.bad_answer(_source(path), f"the answer to {method} {path} runs over {limit} bytes "
                                          f"({setting})", leg)  # fmt: skip
                parts.append(part)
        except httpx.HTTPError as exc:
            raise self.map_error(exc, leg) from exc
        finally:
            # An answer cut short closes its connection (the rest is never read).
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await reply.aclose()
        return reply.status, reply.reason, parts[0] if len(parts) == 1 else b"".join(parts)

    def bad_answer(self, source: str, reason: str, leg: str | None) -> EngineProtocolError:
        """The engine's protocol error for an answer it cannot use, reported (counted and
        logged) as bad input from ``source`` (``metrics``, ``tokenize``, ...)."""
        self.bad_input.report(self.name, source, reason)
        return EngineProtocolError(
            f"engine {self.name} sent an unusable answer: {reason}",
            engine=self.name,
            leg=leg,
            public=f"engine {self.public_name} sent an unusable answer",
        )

    def report_bad_input(self, source: str, reason: str) -> None:
        """Count and log what the engine sent that could not be used (a decode stream's
        malformed event)."""
        self.bad_input.report(self.name, source, reason)

    def _http_error(
        self, status: int, body: bytes, reason: str, leg: str | None
    ) -> EngineHTTPError:
        message = error_message(body, reason or f"HTTP {status}")
        return EngineHTTPError(
            f"engine {self.name} answered HTTP {status}: {message}",
            upstream_status=status,
            engine=self.name,
            leg=leg,
            detail=message,
            public=f"engine {self.public_name} answered HTTP {status}",
        )

    def _json_body(self, body: bytes, path: str, leg: str | None) -> dict[str, Any]:
        """The JSON object of a complete 200 answer; an error object in it raises."""
        try:
            obj = json_loads(body)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            raise self.bad_answer(_source(path), f"the answer to {path} is not a JSON object", leg)
        error = error_object(obj)
        if error is not None:
            raise stream_error(error, status_of(error), engine=self.name, leg=leg)
        return obj

    async def _request_json(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None = None,
        *,
        leg: str | None,
        request_id: str | None = None,
        trace: TraceHeaders = (),
    ) -> dict[str, Any]:
        status, reason, body = await self._fetch(
            method, path, payload, leg=leg, request_id=request_id, trace=trace
        )
        if status != 200:
            raise self._http_error(status, body, reason, leg)
        return self._json_body(body, path, leg)

    async def _request_text(self, path: str, *, leg: str | None, metrics: bool = False) -> str:
        status, reason, body = await self._fetch("GET", path, None, leg=leg, metrics=metrics)
        if status != 200:
            raise self._http_error(status, body, reason, leg)
        return body.decode("utf-8", "replace")

    async def _read_limited(self, reply: EngineReply, limit: int) -> bytes:
        """Read at most ``limit`` bytes of a streamed body, then close it."""
        parts: list[bytes] = []
        size = 0
        iterator = reply.body
        try:
            while size < limit:
                try:
                    part = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                parts.append(part)
                size += len(part)
        except httpx.HTTPError:
            pass  # a truncated error body still says what it can
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await reply.aclose()
        return b"".join(parts)[:limit]

    # ----------------------------------------------------------------- inference

    def _with_model(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.model is not None and body.get("model") is None:
            body["model"] = self.model
        return body

    async def prefill(
        self,
        body: Mapping[str, Any],
        *,
        kind: RequestKind = "completions",
        request_id: str | None = None,
        leg: str | None = "prefill",
        transfer: bool = True,
        trace: TraceHeaders = (),
    ) -> PrefillResult:
        """Run the producer leg: a one-token, non-streaming request that yields a handoff.

        The body sent is the client's with ``max_tokens: 1`` (and
        ``max_completion_tokens: 1`` on chat), ``stream: false``, no
        ``stream_options`` or ``min_tokens``, ``return_token_ids: true`` and the
        connector's ``kv_transfer_params`` request block in place of any the client
        sent, with ``ignore_eos: true`` and no ``stop`` or ``stop_token_ids`` so that it
        ends by its length cap. The generated token is discarded.

        Args:
            body: the client's request body.
            kind: ``"completions"`` or ``"chat"``.
            request_id: the backend request id (``x-request-id``); fresh by default.
            leg: the leg errors are attributed to.
            transfer: ``False`` runs the same one-token request with every transfer
                parameter stripped and expects no handoff (the prefill leg of a
                same-worker decode); the result then has no descriptor.
            trace: trace context headers to send (``traceparent``, ``tracestate``), so
                that the engine's spans join the router's trace.

        Raises:
            EngineUnavailable, EngineHTTPError, EngineStreamError, EngineProtocolError,
            StreamClosed: the request failed.
            InvalidDescriptor: the producer finished other than by its length cap, sent
                no descriptor, or sent one that fails validation.
        """
        kind = check_kind(kind)
        ctype = connector_type(self.connector)
        if transfer and ctype not in SUPPORTED_CONNECTORS:
            raise InvalidDescriptor(
                f"{CONNECTOR_MISMATCH}: engine {self.name} is configured with connector "
                f"{ctype!r}, which narwhal does not drive",
                engine=self.name,
                leg=leg,
            )
        rid = request_id if request_id is not None else new_request_id()
        payload = strip_transfer_params(body)
        payload.pop("stream_options", None)
        payload.pop("min_tokens", None)
        payload["max_tokens"] = 1
        if kind == "chat":
            payload["max_completion_tokens"] = 1
        payload["stream"] = False
        payload["return_token_ids"] = True
        if transfer:
            payload["kv_transfer_params"] = prefill_request_params(self.connector)
            # The discarded token must end the request by its length cap: a producer
            # whose first token is end-of-sequence finishes with "stop" and hands off
            # nothing (nor may a stop string or stop token end it). The decode leg
            # generates (and may stop on) every visible token.
            payload["ignore_eos"] = True
            payload.pop("stop", None)
            payload.pop("stop_token_ids", None)
        self._with_model(payload)

        started_at = trio.current_time()
        obj = await self._request_json("POST", _PATHS[kind], payload, leg=leg, request_id=rid, trace=trace)
        completed_at = trio.current_time()

        choices = obj.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(first, dict):
            raise self.bad_answer("completions", "the prefill's answer has no choices", leg)
        if not transfer:
            return PrefillResult(
                descriptor={},
                producer=self.name,
                producer_url=self.url,
                endpoint=None,
                backend_request_id=rid,
                connector=ctype,
                kind=kind,
                request=body,
                started_at=started_at,
                completed_at=completed_at,
                prompt_tokens=_prompt_tokens(obj, first),
                cached_tokens=_cached_tokens(obj),
                transfer=False,
            )
        finish = first.get("finish_reason")
        if finish != "length":
            raise InvalidDescriptor(
                f"{UNEXPECTED_FINISH_REASON}: the producer finished with {finish!r}, not 'length', "
                "so it holds no KV blocks for a remote decode",
                engine=self.name,
                leg=leg,
            )
        raw_descriptor = obj.get("kv_transfer_params")
        if raw_descriptor is None:
            raise InvalidDescriptor(
                f"{MISSING_DESCRIPTOR}: the producer returned no kv_transfer_params "
                "(is its KV connector configured as a producer?)",
                engine=self.name,
                leg=leg,
            )
        descriptor = validate_descriptor(
            raw_descriptor, connector=self.connector, engine=self.name, leg=leg, detach=False
        )  # PrefillResult keeps a frozen (immutable) copy
        return PrefillResult(
            descriptor=descriptor,
            producer=self.name,
            producer_url=self.url,
            endpoint=(descriptor["remote_host"], descriptor["remote_port"]),
            backend_request_id=rid,
            connector=ctype,
            kind=kind,
            request=body,
            started_at=started_at,
            completed_at=completed_at,
            prompt_tokens=_prompt_tokens(obj, first),
            cached_tokens=_cached_tokens(obj),
            validated=True,
        )

    def decode(
        self,
        prefill: PrefillResult | None = None,
        body: Mapping[str, Any] | None = None,
        *,
        kind: RequestKind | None = None,
        request_id: str | None = None,
        leg: str | None = "decode",
        lazy: bool = False,
        trace: TraceHeaders = (),
    ) -> AbstractAsyncContextManager[DecodeStream]:
        """Open a streaming decode; use as ``async with client.decode(result) as stream``.

        With ``prefill`` (remote decode) the body carries the handoff descriptor as
        ``kv_transfer_params``; without it (same-worker decode) every transfer
        parameter is stripped, the client's included. Both always ask for
        ``stream: true``, ``return_token_ids: true`` and
        ``stream_options.include_usage: true``. Leaving the context closes the
        response, which the engine sees as the client going away.

        Args:
            prefill: the producer's handoff, or ``None`` for a same-worker decode.
            body: the client body; defaults to the one ``prefill`` was made from.
            kind: ``"completions"`` or ``"chat"``; defaults to ``prefill.kind``.
            request_id: the backend request id (``x-request-id``); fresh by default.
            leg: the leg errors are attributed to.
            lazy: count token events of the usual shape without parsing them (see
                :class:`DecodeStream`).
            trace: trace context headers to send (``traceparent``, ``tracestate``).

        Raises (on entering):
            EngineUnavailable, EngineHTTPError, EngineStreamError, StreamClosed: the
            request failed before the stream started.
            InvalidDescriptor: the handoff does not fit this engine's connector.
        """
        if prefill is not None and (not prefill.transfer or prefill.endpoint is None):
            raise ValueError(
                "this prefill ran without a KV transfer; decode it as same-worker (prefill=None)"
            )
        if body is None:
            if prefill is None:
                raise ValueError("decode needs a PrefillResult or a request body")
            body = prefill.request
        if kind is None:
            kind = prefill.kind if prefill is not None else "completions"
        rid = request_id if request_id is not None else new_request_id()
        return _DecodeOpener(self, prefill, body, check_kind(kind), rid, leg, lazy, trace)

    def _decode_body(
        self, prefill: PrefillResult | None, body: Mapping[str, Any], leg: str | None
    ) -> dict[str, Any]:
        payload = strip_transfer_params(body)
        if prefill is not None:
            if self.connector is not None and connector_type(self.connector) != prefill.connector:
                raise InvalidDescriptor(
                    f"{CONNECTOR_MISMATCH}: the handoff is a {prefill.connector} descriptor, engine "
                    f"{self.name} uses {connector_type(self.connector)}",
                    engine=self.name,
                    leg=leg,
                )
            if not prefill.validated:
                validate_descriptor(
                    prefill.descriptor,
                    connector=prefill.connector,
                    expected_endpoint=prefill.endpoint,
                    engine=prefill.producer,
                    leg=leg,
                    detach=False,
                )
            # The descriptor is frozen (read-only mappings, tuples): plain JSON shapes.
            payload["kv_transfer_params"] = detached(prefill.descriptor)
        options = body.get("stream_options")
        stream_options = dict(options) if isinstance(options, Mapping) else {}
        stream_options["include_usage"] = True
        payload["stream"] = True
        payload["stream_options"] = stream_options
        payload["return_token_ids"] = True
        return self._with_model(payload)

    async def _open_decode(
        self,
        prefill: PrefillResult | None,
        body: Mapping[str, Any],
        kind: RequestKind,
        request_id: str,
        leg: str | None,
        lazy: bool = False,
        trace: TraceHeaders = (),
    ) -> DecodeStream:
        payload = self._decode_body(prefill, body, leg)
        opened_at = trio.current_time()
        response = await self._open(
            "POST", _PATHS[kind], payload, leg=leg, request_id=request_id, stream=True, trace=trace
        )
        if response.status != 200:
            data = await self._read_limited(response, ERROR_BODY_LIMIT)
            raise self._http_error(response.status, data, response.reason, leg)
        content_type = response.headers.get("content-type", "")
        if content_type.startswith("application/json"):
            # Not a stream: an engine that answers a stream request with a JSON error.
            data = await self._read_limited(response, ERROR_BODY_LIMIT)
            try:
                obj = json_loads(data)
            except ValueError:
                obj = None
            error = error_object(obj)
            if error is not None:
                raise stream_error(error, status_of(error), engine=self.name, leg=leg)
            raise EngineProtocolError(
                f"engine {self.name} answered a stream request with a JSON body",
                engine=self.name,
                leg=leg,
            )
        return DecodeStream(
            response,
            owner=self,
            leg=leg,
            request_id=request_id,
            kind=kind,
            prefill=prefill,
            opened_at=opened_at,
            lazy=lazy,
            max_event_bytes=self.limits.max_stream_event_bytes,
        )

    # ----------------------------------------------------------------- introspection

    async def tokenize(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        model: str | None = None,
    ) -> Tokenized:
        """Tokenize a prompt, or chat messages with the engine's chat template.

        ``model`` names the model to tokenize for (default: the configured one).
        A prompt that is already a list of token ids is counted here without a
        request (vLLM's ``/tokenize`` accepts only a string prompt and answers a list
        with 400); its ``max_model_len`` is then ``None``.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("tokenize needs exactly one of prompt or messages")
        if prompt is not None and not isinstance(prompt, str):
            ids = tuple(prompt)
            return Tokenized(count=len(ids), max_model_len=None, ids=ids)
        payload: dict[str, Any] = (
            {"prompt": prompt}
            if prompt is not None
            else {"messages": [dict(m) for m in messages or ()]}
        )
        if model is not None:
            payload["model"] = model
        obj = await self._request_json(
            "POST", "/tokenize", self._with_model(payload), leg="tokenize"
        )
        return self._tokenized(obj, _tokens_bound(payload))

    def _tokenized(self, obj: Mapping[str, Any], bound: int | None) -> Tokenized:
        """A ``/tokenize`` answer checked: ``tokens`` (when given) are token ids and
        ``count`` is their number, ``count`` is possible for the prompt (at most one
        token a byte, plus :data:`TEMPLATE_TOKENS`; ``bound``), ``max_model_len`` a
        positive integer. A count the router cannot trust would answer the client's
        request with a context-length 400 that is the engine's fault."""
        count, tokens, max_len = obj.get("count"), obj.get("tokens"), obj.get("max_model_len")

        def bad(reason: str) -> EngineProtocolError:
            return self.bad_answer("tokenize", reason, "tokenize")

        if tokens is not None and not (
            isinstance(tokens, list) and all(type(t) is int and t >= 0 for t in tokens)
        ):
            raise bad("its tokens are not a list of token ids")
        if count is None and tokens is not None:
            count = len(tokens)
        if type(count) is not int or count < 0:
            raise bad("it has no token count" if count is None else f"its count {_shown(count)} is not a number of tokens")
        if tokens is not None and count != len(tokens):
            raise bad(f"its count {count} contradicts the {len(tokens)} token ids it returns")
        if bound is not None and count > bound:
            raise bad(f"its count {count} is more than the prompt can hold ({bound})")
        if max_len is not None and (type(max_len) is not int or max_len < 1):
            raise bad(f"its max_model_len {_shown(max_len)} is not a positive integer")
        return Tokenized(count=count, max_model_len=max_len, ids=tuple(tokens or ()))

    async def reset_prefix_cache(self) -> bool:
        """Ask the engine to drop its prefix cache (vLLM's ``POST /reset_prefix_cache``,
        offered in development mode only: ``VLLM_SERVER_DEV_MODE=1``).

        Returns whether the engine accepted it: any answer but 200 (404 where the route
        is not offered) is False. vLLM answers 200 even when it could not reset (blocks
        held by running requests) and only logs that.

        Raises:
            EngineUnavailable: the engine could not be reached.
        """
        status, _reason, _body = await self._fetch("POST", "/reset_prefix_cache", None, leg="reset")
        return status == 200

    async def detokenize(self, ids: Sequence[int], *, model: str | None = None) -> str:
        """The text of token ids (vLLM's ``POST /detokenize``, which answers ``{"prompt": text}``).

        Raises:
            EngineProtocolError: the answer carries no text.
        """
        payload: dict[str, Any] = {"tokens": list(ids)}
        if model is not None:
            payload["model"] = model
        obj = await self._request_json("POST", "/detokenize", self._with_model(payload), leg="detokenize")
        text = obj.get("prompt")
        if not isinstance(text, str):
            raise EngineProtocolError(
                f"engine {self.name} answered /detokenize without a text", engine=self.name, leg="detokenize"
            )
        return text

    async def metrics(self, names: frozenset[str] | None = None) -> EngineMetrics:
        """The engine's load from ``/metrics``, with every sample parsed, or only the
        samples ``names`` (and those the load reads)."""
        return await self._metrics(None if names is None else names | LOAD_SAMPLES)

    async def load(self) -> EngineMetrics:
        """As :meth:`metrics`, with only the samples its summary reads parsed
        (``LOAD_SAMPLES``: the load gauges, the cache configuration, the process start;
        a tenth of the parsing), for the router's periodic load poll and prefix watch."""
        return await self._metrics(LOAD_SAMPLES)

    async def _metrics(self, names: frozenset[str] | None) -> EngineMetrics:
        text = await self._request_text("/metrics", leg="metrics", metrics=True)
        try:
            return engine_metrics(parse_prometheus(text, names=names))
        except MalformedMetrics as exc:
            raise self.bad_answer("metrics", str(exc), "metrics") from None

    async def models(self) -> list[dict[str, Any]]:
        """The ``data`` list of ``GET /v1/models``: the entries that name a model (``id``).

        An entry's ``max_model_len`` that is not a positive integer is reported (bad
        input) and given as None: no limit known.

        Raises:
            EngineProtocolError: no data list, or more entries than
                ``engine_limits.max_listed_models``.
        """
        return await self._models("models")

    async def _models(self, leg: str) -> list[dict[str, Any]]:
        obj = await self._request_json("GET", "/v1/models", leg=leg)
        data = obj.get("data")
        if not isinstance(data, list):
            raise self.bad_answer("models", "the answer to /v1/models has no data list", leg)
        limit = self.limits.max_listed_models
        if len(data) > limit:
            raise self.bad_answer(
                "models", f"/v1/models lists {len(data)} models, over {limit} (engine_limits.max_listed_models)", leg
            )
        entries = [entry for entry in data if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
        for i, entry in enumerate(entries):
            max_len = entry.get("max_model_len")
            if max_len is not None and (type(max_len) is not int or max_len < 1):
                # No limit known, rather than one that refuses every request.
                self.bad_input.report(self.name, "models", f"model {entry['id'][:80]!r} has max_model_len "
                                      f"{_shown(max_len)}, not a positive integer")  # fmt: skip
                entries[i] = {**entry, "max_model_len": None}
        return entries

    async def identity(self) -> EngineIdentity:
        """The engine's generation: URL, model, version, max_model_len, process start time.

        The model is the configured one when the engine lists it, else the first
        listed (so a mismatch with the configuration shows).
        """
        version_obj = await self._request_json("GET", "/version", leg="identity")
        models = await self._models("identity")
        text = await self._request_text("/metrics", leg="identity", metrics=True)
        try:
            started = start_time(parse_prometheus(text, names=_IDENTITY_SAMPLES))
        except MalformedMetrics as exc:
            raise self.bad_answer("metrics", str(exc), "identity") from None
        entry: dict[str, Any] | None = None
        for candidate in models:
            if self.model is not None and candidate.get("id") == self.model:
                entry = candidate
                break
        if entry is None and models:
            entry = models[0]
        version = version_obj.get("version")
        model = entry.get("id") if entry is not None else None
        max_len = entry.get("max_model_len") if entry is not None else None
        return EngineIdentity(
            url=self.url,
            model=model if isinstance(model, str) else None,
            version=version if isinstance(version, str) else None,
            max_model_len=max_len if type(max_len) is int else None,
            process_start_time=started,
        )

    async def health(self) -> bool:
        """Whether ``GET /health`` answers 200 (connection failures count as unhealthy)."""
        return await self.unhealthy() is None

    async def unhealthy(self) -> str | None:
        """Why ``GET /health`` does not answer 200 (the connection error or the status);
        None when it does.

        Raises:
            RouterOverloaded: the router itself lacked the descriptors, buffers or memory
                to ask (which says nothing about the engine).
        """
        try:
            status, reason, _ = await self._fetch("GET", "/health", None, leg="health")
        except EngineError as exc:
            if exc.router_fault:
                raise
            return str(exc)
        return None if status == 200 else f"engine {self.name} /health answered HTTP {status} {reason}".rstrip()


def _source(path: str) -> str:
    """The bad-input source of an answer to ``path`` (``/v1/models`` -> ``models``)."""
    return path.rsplit("/", 1)[-1] or "answer"


def _shown(value: Any) -> str:
    """An engine's value in a message (cut short: the engine chose its length)."""
    return truncate(repr(value), 60)


def _tokens_bound(payload: Mapping[str, Any]) -> int | None:
    """The most tokens ``/tokenize`` can find in a text prompt, or in chat messages whose
    contents are all text (their JSON size bounds their bytes): one a byte, plus
    :data:`TEMPLATE_TOKENS`. None for other content (images, say, expand to tokens of
    their own)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "replace")) + TEMPLATE_TOKENS
    messages = payload.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content", ""), str | None) for m in messages
    ):
        return None
    return len(json_dumps(messages)) + TEMPLATE_TOKENS


def _prompt_tokens(obj: Mapping[str, Any], choice: Mapping[str, Any]) -> int | None:
    usage = obj.get("usage")
    if isinstance(usage, dict) and type(usage.get("prompt_tokens")) is int and usage["prompt_tokens"] >= 0:
        return int(usage["prompt_tokens"])
    for holder in (choice, obj):
        ids = holder.get("prompt_token_ids")
        if isinstance(ids, list):
            return len(ids)
    return None


def _cached_tokens(obj: Mapping[str, Any]) -> int | None:
    return usage_cached_tokens(obj.get("usage"))


def _header_value(value: str, name: str = "request id") -> bytes:
    """A header value as bytes; refuses what would break the head (CR, LF, non-ASCII)."""
    if not (value.isascii() and value.isprintable()):
        raise ValueError(f"{name} {value!r} is not printable ASCII")
    return value.encode("ascii")
