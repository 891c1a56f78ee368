r"""DecodeStream: one engine's decode SSE stream as identified-token chunks.

A :class:`DecodeStream` reads an upstream ``text/event-stream`` response, feeds its
bytes to :class:`~narwhal.engines.sse.SSEDecoder` and yields token and metadata
:class:`~narwhal.engines.sse.Chunk`\ s. It enforces the seed's stream termination
rules at this boundary: a body that ends before ``data: [DONE]`` is
:class:`~narwhal.errors.StreamClosed`, ``[DONE]`` before any token is
:class:`~narwhal.errors.EmptyStream`, an error object inside the 200 stream is
:class:`~narwhal.errors.EngineStreamError` with the object's own status.

A response reaches it as an :class:`EngineReply`: the engine transport's own
:class:`~narwhal.engines.wire.WireResponse`, or :class:`HttpxReply` around an
``httpx.Response`` from any other httpx transport. httpx iterates a response through a
chain of async generators, and trio warns about (and later finalizes) any such
generator left suspended: :func:`abandon` finishes the chain by resuming it once
inside an already cancelled scope, which closes the upstream connection as a side
effect (the engine sees the client go away and aborts the request).
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final, Protocol, Self

import httpx
import trio

from narwhal.config import EngineLimits
from narwhal.engines.connector import PrefillResult, RequestKind
from narwhal.engines.sse import (
    Chunk,
    MalformedEvent,
    SSEDecoder,
    SSEError,
    SSEEvent,
    json_loads,
    parse_chunk,
)
from narwhal.engines.wire import WireResponse
from narwhal.errors import (
    EmptyStream,
    EngineError,
    EngineProtocolError,
    EngineStreamError,
    StreamClosed,
)

__all__ = [
    "SILENCE_SLACK",
    "DecodeStream",
    "EngineReply",
    "HttpxReply",
    "StreamOwner",
    "abandon",
    "usage_cached_tokens",
]

#: How much later than its bound a watched silence may end a stream, as a share of
#: the bound (:meth:`DecodeStream.watch_silence`): never earlier, at most this later.
SILENCE_SLACK: Final = 1 / 64


def usage_cached_tokens(usage: Any) -> int | None:
    """The ``prompt_tokens_details.cached_tokens`` of a usage object, if it has one."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and type(details.get("cached_tokens")) is int and details["cached_tokens"] >= 0:
        return int(details["cached_tokens"])
    return None


class EngineReply(Protocol):
    """A response whose head has arrived: what engine requests return.

    ``headers`` has lower-case names; ``body`` yields the body's pieces as they arrive.
    """

    status: int
    reason: str

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def body(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes:
        """The whole body; the reply is closed afterwards."""
        ...

    async def aclose(self) -> None:
        """Close the response (the connection returns to its pool only after a complete body).

        Never blocks for long and completes under cancellation.
        """
        ...

    def body_complete(self) -> bool:
        """Whether the whole body has arrived, reading only what is buffered (never waits)."""
        ...


class HttpxReply:
    """:class:`EngineReply` over an ``httpx.Response`` (any httpx transport or client)."""

    __slots__ = ("_response", "body", "headers", "reason", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.reason = response.reason_phrase
        self.headers: Mapping[str, str] = response.headers
        self.body: AsyncIterator[bytes] = response.aiter_bytes()

    async def read(self) -> bytes:
        try:
            parts = [piece async for piece in self.body]
        finally:
            await self.aclose()
        return b"".join(parts)

    async def aclose(self) -> None:
        # Shielded: this often runs because an enclosing scope was cancelled.
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            await abandon(self.body)
            await self._response.aclose()

    def body_complete(self) -> bool:
        return False  # httpx's iterators cannot be asked without awaiting


class StreamOwner(Protocol):
    """What a stream needs from the client that opened it."""

    @property
    def name(self) -> str: ...

    @property
    def public_name(self) -> str:
        """How client error bodies name the engine (the name, or the name and URL)."""
        ...

    def map_error(self, exc: httpx.HTTPError, leg: str | None) -> EngineError: ...

    def report_bad_input(self, source: str, reason: str) -> None:
        """Count (and log) what the engine sent that could not be used."""
        ...

#: The default bound on one event (or line) of a decode stream
#: (``engine_limits.max_stream_event_bytes``).
MAX_EVENT_BYTES: Final[int] = EngineLimits().max_stream_event_bytes
#: Bound on shielded cleanup (closing a response).
CLOSE_TIMEOUT_S: Final = 5.0
#: After ``[DONE]`` the end of the HTTP body is normally already in flight; waiting this
#: long for it lets the connection go back to the pool instead of being closed.
_DRAIN_AFTER_DONE_S: Final = 0.1
#: What a stream whose bytes are no event stream is reported as.
_UNUSABLE: Final = "an unusable event stream"
_DRAIN_LIMIT_BYTES: Final = 64 * 1024
#: How much of an error message is kept.
ERROR_MESSAGE_LIMIT: Final = 500
_ABANDON_STEPS: Final = 64

def truncate(text: str, limit: int = ERROR_MESSAGE_LIMIT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def error_message(body: bytes, fallback: str) -> str:
    """The human message of an engine's error body (OpenAI, vLLM or FastAPI shape)."""
    message: str | None = None
    try:
        obj = json_loads(body)
    except ValueError:
        obj = None  # pragma: no mutate (equivalent: any value but a dict means "no JSON object")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            message = err["message"]
        elif isinstance(err, str):
            message = err
        elif isinstance(obj.get("message"), str):
            message = obj["message"]
        elif obj.get("detail") is not None:
            message = str(obj["detail"])
    if message is None:
        message = body.decode(errors="replace")
    message = truncate(message)
    return message or fallback


def error_object(obj: Any) -> dict[str, Any] | None:
    """The error object of a 200 answer that carries one (``{"error": ...}`` or vLLM's old shape)."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return err
    if isinstance(err, str):
        return {"message": err}
    if obj.get("object") == "error":
        return {k: v for k, v in obj.items() if k != "object"}
    return None


def stream_error(
    error: Mapping[str, Any], status: int, *, engine: str, leg: str | None
) -> EngineStreamError:
    message = error.get("message")
    text = (
        truncate(message) if isinstance(message, str) and message else "error object in the stream"
    )
    return EngineStreamError(
        f"engine {engine} reported an error: {text}",
        upstream_status=status,
        error=dict(error),
        engine=engine,
        leg=leg,
    )


def status_of(error: Mapping[str, Any]) -> int:
    code = error.get("code")
    return code if type(code) is int and 400 <= code <= 599 else 500


def new_request_id() -> str:
    return f"narwhal-{uuid.uuid4().hex}"


def check_kind(kind: str) -> RequestKind:
    if kind == "completions":
        return "completions"
    if kind == "chat":
        return "chat"
    raise ValueError(f"kind must be 'completions' or 'chat', not {kind!r}")


async def abandon(iterator: AsyncIterator[bytes] | None) -> None:
    """Finish a partly consumed httpx byte iterator so no generator is left suspended.

    Resuming the chain inside a cancelled scope makes its first checkpoint raise
    ``Cancelled``, which unwinds (and so finishes) every generator layer; httpcore
    closes the connection on the way out.
    """
    if iterator is None:
        return
    for _ in range(_ABANDON_STEPS):
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                await iterator.__anext__()
            except StopAsyncIteration:
                return
            # The chain ended with an error: it is finished, which is all we want.
            # (Cancelled is a BaseException and is not caught here.)
            except Exception:
                return
        if scope.cancelled_caught:
            return


class DecodeStream:
    """An open decode stream: an async iterator of token and metadata :class:`Chunk` s.

    Iteration ends normally at ``data: [DONE]``. It raises :class:`StreamClosed` when
    the body ends or the connection breaks before ``[DONE]``, :class:`EmptyStream` on
    ``[DONE]`` before any token, :class:`EngineStreamError` on an error object in the
    stream and :class:`EngineProtocolError` on an event that is not JSON.

    Attributes:
        engine: the engine's name.
        leg: the leg errors are attributed to (``"decode"`` unless told otherwise).
        request_id: the backend request id sent as ``x-request-id``.
        kind: ``"completions"`` or ``"chat"``.
        prefill: the handoff decoded from, or ``None`` for a same-worker decode.
        status: the HTTP status (200).
        headers: the response headers.
        opened_at: ``trio.current_time()`` before the request was sent.
        headers_at: when the response headers arrived.
        tokens: output tokens so far (counted by token id).
        first_token_at / last_token_at: when the bytes of the first / latest token event
            arrived.
        last_activity_at: when bytes last arrived (token, metadata or keep-alive).
        finish_reason: the finish reason the engine reported, once it did.
        usage: the usage object the engine reported, once it did.
        done: whether ``[DONE]`` arrived.
        closed: whether the stream was closed.

    An event (or a line) longer than ``max_event_bytes`` ends the stream with
    :class:`EngineProtocolError` before more of it is held.

    A ``lazy`` stream counts token events of the usual shape without parsing them
    (:func:`~narwhal.engines.sse.scan_token_event`): their chunks carry ``count`` and
    ``raw`` only, and token events that arrived together (at the start of a read) come
    as one chunk whose ``count`` is their total and ``raw`` their bytes; the events after
    them in that read (a finishing event, usage, ``[DONE]``) come one by one. A
    forwarder that relays bytes and accounts tokens needs no more.
    """

    def __init__(
        self,
        response: EngineReply,
        *,
        owner: StreamOwner,
        leg: str | None,
        request_id: str,
        kind: RequestKind,
        prefill: PrefillResult | None,
        opened_at: float,
        lazy: bool = False,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self._owner = owner
        self._lazy = lazy
        self._response = response
        self._bytes = response.body
        self._decoder = SSEDecoder(max_event_bytes=max_event_bytes)
        self._events: deque[SSEEvent | Chunk] = deque()
        # (Flags read only for their truth: a mutant None is the same as False.)
        self._eof = False  # pragma: no mutate (equivalent: falsy alike)
        self._finished = False  # pragma: no mutate (equivalent: falsy alike)
        self._interrupted = False  # pragma: no mutate (equivalent: falsy alike)
        self.engine = owner.name
        self.leg = leg
        self.request_id = request_id
        self.kind: RequestKind = kind
        self.prefill = prefill
        self.status = response.status
        self.headers = response.headers
        self.opened_at = opened_at
        self.headers_at = trio.current_time()
        self.tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.last_activity_at = self.headers_at
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.closed = False
        # An unusable event stream met by bytes read off the event loop (:meth:`take`).
        self._deferred: SSEError | None = None
        self._silence_scope: trio.CancelScope | None = None
        self._silence_s = 0.0  # pragma: no mutate (equivalent: set before use)
        self._silence_slack_s = 0.0  # pragma: no mutate (equivalent: set before use)

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the engine reports it did not compute (its usage's
        ``prompt_tokens_details.cached_tokens``), once it reported them."""
        return usage_cached_tokens(self.usage)

    def watch_silence(self, scope: trio.CancelScope, seconds: float) -> None:
        """Keep ``scope``'s deadline at least ``seconds`` after every piece of the body
        that arrives, and at most :data:`SILENCE_SLACK` of ``seconds`` more.

        The silence bound runs between transport chunks: any bytes from the engine (a
        token, a metadata event, an SSE comment or keep-alive, part of an event) reset
        it, not only whole events. A read moves the deadline only when it is outside that
        window (short of the bound, or lifted), to the window's far end: a deadline
        change is one of the costliest things a read did (trio re-files the scope in its
        deadline heap), and so a stream moves it about once a slack's time, not once a
        token.
        """
        self._silence_scope = scope
        self._silence_s = seconds
        self._silence_slack_s = seconds * SILENCE_SLACK

    def __aiter__(self) -> Self:
        return self

    @property
    def buffered(self) -> bool:
        """Whether more events have already arrived (the next step will not wait).

        A forwarder uses it to coalesce a burst of events into one write.
        """
        return bool(self._events)

    async def __anext__(self) -> Chunk:
        if self._finished:
            raise StopAsyncIteration
        if self._interrupted:
            self._finished = True
            raise StreamClosed(
                f"the read from engine {self.engine} was cancelled; the stream cannot resume",
                engine=self.engine,
                leg=self.leg,
            )
        if self._deferred is not None:
            self._finished = True
            raise self._protocol_error(_UNUSABLE, self._deferred)
        events = self._events
        while True:
            while events:
                event = events.popleft()
                try:
                    chunk = event if isinstance(event, Chunk) else parse_chunk(event, lazy=self._lazy)
                except MalformedEvent as exc:
                    self._finished = True
                    if self._eof:
                        # The body ended in the middle of an event.
                        raise self._closed_error() from None
                    raise self._protocol_error("a malformed stream event", exc) from None
                kind = chunk.kind
                if kind == "token":
                    now = self.last_activity_at  # when its bytes arrived
                    self.tokens += chunk.count
                    if self.first_token_at is None:
                        self.first_token_at = now
                    self.last_token_at = now
                    if chunk.finish_reason is not None:
                        self.finish_reason = chunk.finish_reason
                    if chunk.usage is not None:
                        self.usage = chunk.usage
                    return chunk
                if kind == "meta":
                    if chunk.finish_reason is not None:
                        self.finish_reason = chunk.finish_reason
                    if chunk.usage is not None:
                        self.usage = chunk.usage
                    return chunk
                self._finished = True
                if kind == "done":
                    self.done = True
                    if self.tokens == 0:
                        raise EmptyStream(engine=self.engine, leg=self.leg)
                    raise StopAsyncIteration
                # An "error" chunk always carries its error object and status (sse's parse).
                error = chunk.error or {}  # pragma: no mutate (equivalent: see above)
                status = chunk.status or 500  # pragma: no mutate (equivalent: see above)
                raise stream_error(error, status, engine=self.engine, leg=self.leg)
            if self._eof:
                self._finished = True
                raise self._closed_error()
            await self._read()

    async def _read(self) -> None:
        try:
            data = await self._bytes.__anext__()
        except StopAsyncIteration:
            self._eof = True
            self._events.extend(self._decoder.flush())
            return
        except httpx.HTTPError as exc:
            self._finished = True
            raise self._owner.map_error(exc, self.leg) from exc
        except BaseException:
            # A read the caller cancels unwinds httpx's body iterator, which cannot
            # resume; remember that so the next call reports it instead of a clean end.
            self._interrupted = True
            raise
        now = self.last_activity_at = trio.current_time()
        scope = self._silence_scope
        if scope is not None:
            due = now + self._silence_s
            latest = due + self._silence_slack_s
            if not due <= scope.deadline <= latest:
                scope.deadline = latest
        try:
            self._queue(*self._split(data))
        except SSEError as exc:
            self._finished = True
            raise self._protocol_error(_UNUSABLE, exc) from None

    def _split(self, data: bytes) -> tuple[int, bytes, list[SSEEvent]]:
        """What ``data`` completes: a lazy stream's opening run of token events of the usual
        shape (their count and bytes), and the events after it.

        Raises:
            SSEError: the bytes are no event stream.
        """
        if self._lazy:
            count, run, rest = self._decoder.feed_tokens(data)
            if count:
                return count, run, rest
        return 0, b"", self._decoder.feed(data)

    def _queue(self, count: int, run: bytes, rest: list[SSEEvent]) -> None:
        # A burst of token events: one chunk, relayed as it came; what follows them in
        # the burst (the finishing event, usage, [DONE]) is classified event by event.
        if count:
            self._events.append(Chunk("token", run, None, (), count))
        self._events.extend(rest)

    def relay_fd(self) -> int:
        """The engine socket's descriptor when a relay may read this stream off the event
        loop (:meth:`take` what it reads), or -1: a lazy stream over the router's own
        transport, chunked, with nothing read and not yet taken."""
        response = self._response
        if not self._lazy or self._events or self._finished or self._eof or not isinstance(response, WireResponse):
            return -1
        return response.body.relay_fd()

    def take(self, data: bytes, at: float) -> tuple[int, bytes]:
        """Account bytes a relay read from :meth:`relay_fd`'s socket at ``at`` (the event
        loop's clock): ``(count, run)`` when they end a run of ``count`` token events of the
        usual shape (``run`` their bytes, to forward), ``(0, b"")`` when nothing is whole
        yet, and ``(-1, b"")`` when the stream needs iterating (events other than tokens,
        the body's end or an error: the next ``__anext__`` has them).

        Only a relay that owns the stream calls it (no ``__anext__`` meanwhile).
        """
        response = self._response
        assert isinstance(response, WireResponse)
        body = response.body
        self.last_activity_at = at
        piece = body.feed(data)
        if piece:
            try:
                count, run, rest = self._split(piece)
            except SSEError as exc:
                self._deferred = exc
                return -1, b""
            if count and not rest:
                self.tokens += count
                self.last_token_at = at
                return count, run
            self._queue(count, run, rest)
        if self._events or body.ended:
            return -1, b""
        return 0, b""

    @property
    def max_event_bytes(self) -> int:
        """The longest event the stream takes (longer ones end it)."""
        return self._decoder.max_event_bytes

    def carried(self, tokens: int, last_token_at: float, last_activity_at: float) -> None:
        """Account token events a relay forwarded without :meth:`take` (it read them from
        :meth:`relay_fd`'s socket: whole events, nothing left over)."""
        if tokens:
            self.tokens += tokens
            self.last_token_at = last_token_at
        self.last_activity_at = max(self.last_activity_at, last_activity_at)

    def read_failed(self, exc: OSError) -> None:
        """A relay's read of :meth:`relay_fd`'s socket failed: the next ``__anext__``
        raises it as the engine's error."""
        response = self._response
        assert isinstance(response, WireResponse)
        response.body.fail(exc)

    def _protocol_error(self, what: str, exc: Exception) -> EngineProtocolError:
        """The engine sent ``what`` (its detail for the log; the client sees no detail)."""
        self._owner.report_bad_input("stream", f"{what}: {truncate(str(exc), 200)}")
        return EngineProtocolError(
            f"engine {self.engine} sent {what}: {exc}",
            engine=self.engine,
            leg=self.leg,
            public=f"engine {self._owner.public_name} sent {what}",
        )

    def _closed_error(self) -> StreamClosed:
        return StreamClosed(
            f"engine {self.engine} closed the stream before data: [DONE] "
            f"(after {self.tokens} tokens)",
            engine=self.engine,
            leg=self.leg,
        )

    async def aclose(self, *, drain: bool = False) -> None:
        """Close the upstream response (the engine sees its connection closed).

        Args:
            drain: after ``[DONE]``, briefly read the end of the body first so the
                connection can return to the pool.
        """
        if self.closed:
            return
        self.closed = True
        self._finished = True
        try:
            if drain and self.done and not self._eof and not self._response.body_complete():
                await self._drain()  # under a cancelled scope: Cancelled at once
        finally:
            # This often runs because an enclosing scope was cancelled (a deadline, a client
            # disconnect): a reply's aclose completes under cancellation, so the engine does
            # not keep streaming into a connection nobody reads (and the connection is not
            # left open when the drain was cancelled).
            await self._response.aclose()

    async def _drain(self) -> None:
        received = 0
        with trio.move_on_after(_DRAIN_AFTER_DONE_S):
            while received <= _DRAIN_LIMIT_BYTES:
                try:
                    received += len(await self._bytes.__anext__())
                except (StopAsyncIteration, httpx.HTTPError):
                    return
