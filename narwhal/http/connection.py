"""The per-connection state machine of :class:`~narwhal.http.server.HTTPServer`.

Each connection is a keep-alive loop that reads a request head (``header_timeout_s``,
or ``keepalive_timeout_s`` while idle between requests), reads the whole body
(``body_timeout_s``, ``max_body_bytes``), then calls the handler inside a cancel
scope while the connection is watched (from the moment the request has lasted
``disconnect_check_s``; most requests end sooner and never need it): if the client
goes away the request's ``disconnected`` event is set and the handler is cancelled.
Bytes read meanwhile are pipelined requests and are kept for the next cycle. A
socket is watched by the server's :class:`~narwhal.http.sockwatch.SocketWatch` (one
task for every watched socket, where ``epoll`` exists); any other stream by a reader
task of its own.

Protocol errors (:class:`~narwhal.http.parser.ProtocolError`) are answered with their
status (400/431/501/505), a body that names the problem, and ``Connection: close``; a
slow client gets 408. A handler that raises before it starts its response produces a
500 with a generic body (a
:class:`~narwhal.errors.NarwhalError` produces its own status and body); once the
response has started, an exception aborts the connection so the client sees an
incomplete body rather than a truncated one that looks complete.

:class:`~narwhal.http.parser.RequestParser` parses requests; responses are framed here
(:meth:`Connection.response_head`, chunked bodies in
:class:`~narwhal.http.messages.ResponseWriter`). HTTP/1.0 and ``Connection: close`` end
the connection after the response; bytes read ahead of the next request stay in the
parser for the next cycle.
"""

from __future__ import annotations

import email.utils
import http
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from narwhal.errors import NarwhalError, Refused
from narwhal.http.messages import BODYLESS_STATUSES, JSON_HEADERS, Request, ResponseWriter
from narwhal.http.parser import ProtocolError, RequestHead, RequestParser
from narwhal.netio import StreamIO

if TYPE_CHECKING:
    from narwhal.http.server import HTTPServer

__all__ = ["Connection"]

logger = logging.getLogger("narwhal.http")

_RECV_SIZE = 65536
#: Bound on a graceful close (including lingering after an error response).
_CLOSE_TIMEOUT_S = 5.0
#: After an error response with request bytes unread, keep reading (and dropping) them
#: briefly so that closing does not reset the connection before the client reads the
#: response.
_LINGER_S = 1.0
_LINGER_BYTES = 1 << 20
_ERROR_SEND_TIMEOUT_S = 5.0
_OWN_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
_UNSAFE = re.compile(r"[\r\n\x00]")


def _error_body(message: str, error_type: str) -> bytes:
    """An OpenAI error body: its ``code`` is null here (the status line says the rest)."""
    doc = {"error": {"message": message, "type": error_type, "code": None}}
    return json.dumps(doc, separators=(",", ":")).encode()


_INTERNAL_ERROR_BODY = _error_body("internal error", "internal_error")
#: The message and type of a protocol error's body, by status (the parser's
#: explanation, when there is one, follows the message).
_PROTOCOL_ERRORS = {
    400: ("malformed HTTP request", "invalid_request_error"),
    408: ("request timed out", "invalid_request_error"),
    413: ("request body too large", "invalid_request_error"),
    431: ("request header fields too large", "invalid_request_error"),
    501: ("not implemented", "not_implemented_error"),
    505: ("HTTP version not supported", "invalid_request_error"),
}
_REASONS = {status.value: status.phrase.encode("ascii") for status in http.HTTPStatus}


class _DateCache:
    """The ``Date`` header value, formatted at most once per second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._value = email.utils.formatdate(now, usegmt=True).encode("ascii")
            self._second = now
        return self._value


_DATE = _DateCache()


class _Reject(Exception):
    """Internal: answer the current request with ``status`` and close."""

    def __init__(self, status: int, detail: str = "") -> None:
        super().__init__(status)
        self.status = status
        self.detail = detail

    @classmethod
    def of(cls, error: ProtocolError) -> _Reject:
        return cls(error.status, error.message)


def _sole_exception(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _peer_address(stream: trio.abc.Stream) -> tuple[str, int] | None:
    if isinstance(stream, trio.SocketStream):
        try:
            name = stream.socket.getpeername()
        except OSError:
            return None
        if isinstance(name, tuple):
            return (str(name[0]), int(name[1]))
    return None


class _Watcher:
    """One request's disconnect watcher: its scope, whether it is parked on the socket
    (so that cancelling it frees the socket at once), and when it is done."""

    __slots__ = ("done", "parked", "scope")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.parked = False
        self.done = trio.Event()

    async def stop(self) -> None:
        """Cancel it and return once it will not read again.

        A watcher parked on the socket is taken off it by the cancel itself (trio
        aborts the wait at once); one whose wait has just ended meets the cancellation
        at the read's first checkpoint, before reading. Only a watcher caught
        elsewhere is waited for.
        """
        self.scope.cancel()
        if not self.parked:
            await self.done.wait()


class Connection:
    """State of one client connection (see the module docstring)."""

    def __init__(self, server: HTTPServer, stream: trio.abc.Stream) -> None:
        self.server = server
        self.limits = server.limits
        self.stream = stream
        self.io = StreamIO(stream)
        self.parser = RequestParser(server.limits.max_header_bytes)
        self.client = _peer_address(stream)
        self.scope = trio.CancelScope()
        #: Set while waiting for the first byte of a request: shutdown cancels it.
        self.idle_scope: trio.CancelScope | None = None
        self.handler_scope: trio.CancelScope | None = None
        self.request: Request | None = None
        self.head_only = False
        self.eof = False  # the peer closed (or reset) its side
        self.gone = False  # the client went away while a request was being handled
        self.abort = False  # close without ceremony (response incomplete or stream broken)
        self.linger = False  # request bytes may be unread: drain before closing
        self.carry = False  # bytes of the next request were read ahead
        self.nursery: trio.Nursery | None = None
        self.watcher: _Watcher | None = None  # the current request's disconnect watcher
        # Or, for a socket, the descriptor the server's socket watch polls for this
        # request (-1: none), and the bytes it read ahead.
        self.polled_fd = -1
        self.read_ahead = 0
        self.detached = False  # the handler took the raw stream (protocol upgrade)
        # The response side: see response_head().
        self.http11 = True  # the request was HTTP/1.1 (else 1.0: no chunking, no keep-alive)
        self.must_close = False  # close after this response
        self.responded = False  # the current request's response has started

    # ------------------------------------------------------------------ I/O

    async def receive(self) -> bytes:
        """One read; b"" (and ``eof``) when the peer closed or reset the connection."""
        try:
            data = await self.io.receive_some(_RECV_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.eof = True
        return data

    async def write(self, data: bytes, on_wait: Callable[[], None] | None = None) -> None:
        """One ``send_all``; a failed write means the client is gone (cancels the handler).

        ``on_wait`` is called if the write has to wait for the client to read. A client
        that reads nothing for ``send_timeout_s`` while the write waits counts as gone
        too (:class:`trio.BrokenResourceError` where no handler is cancelled).
        """
        try:
            await self.io.send_all(data, on_wait=on_wait, wait_s=self.limits.send_timeout_s)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.client_gone()
            await trio.lowlevel.checkpoint()  # raises Cancelled inside the handler's scope
            raise
        except trio.TooSlowError as exc:
            reason = f"client read nothing for {self.limits.send_timeout_s:g} s (send timeout)"
            self.client_gone(reason)
            await trio.lowlevel.checkpoint()
            raise trio.BrokenResourceError(reason) from exc

    def client_gone(self, reason: str = "client disconnected") -> None:
        """The client went away (or stopped reading: ``reason``): cancel its request."""
        self.gone = True
        if self.request is not None:
            if not self.request.disconnected.is_set():
                self.request.disconnect_reason = reason
            self.request.disconnected.set()
        if self.handler_scope is not None:
            self.handler_scope.cancel(reason)

    def response_head(
        self, status: int, headers: Sequence[tuple[str, str]], content_length: int | None
    ) -> bytes:
        """The status line and headers of the current request's response.

        Framing is ours: ``Content-Length`` when ``content_length`` is given, else
        chunked for an HTTP/1.1 client and close-delimited for an HTTP/1.0 one. It adds
        ``Date`` and ``Server`` unless given, and ``Connection: close`` when the
        connection ends after this response.

        Raises:
            ValueError: a header name or value would break the head (CR, LF, NUL).
        """
        server = self.server
        out = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        have_date = have_server = False
        for name, value in headers:
            lname = name.lower()
            if lname in _OWN_HEADERS:
                continue  # framing and persistence are ours
            if _UNSAFE.search(name) or _UNSAFE.search(value):
                raise ValueError(f"header {name!r} has a character a response head cannot carry")
            have_date = have_date or lname == "date"
            have_server = have_server or lname == "server"
            out.append(f"{name}: {value}\r\n".encode("latin-1"))
        if not have_date:
            out.insert(1, b"date: %s\r\n" % _DATE.get())
        if not have_server:
            out.insert(1, b"server: %s\r\n" % server.server_header)
        if status in BODYLESS_STATUSES or status < 200:
            pass
        elif content_length is not None:
            out.append(b"content-length: %d\r\n" % content_length)
        elif self.http11:
            out.append(b"transfer-encoding: chunked\r\n")
        else:
            self.must_close = True  # an HTTP/1.0 stream ends when the connection does
        if server.closing:
            self.must_close = True
        if self.must_close:
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        self.responded = True
        return b"".join(out)

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        # One nursery for the connection's life: each request's disconnect watcher runs
        # in it (opening a nursery per request cost more than the watcher itself).
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await self._serve_requests()

    async def _serve_requests(self) -> None:
        first = True
        while True:
            try:
                head = await self.read_head(first)
            except _Reject as reject:
                await self.reject(reject.status, reject.detail)
                return
            if head is None:
                return
            first = False
            self.server._in_flight += 1
            try:
                keep_alive = await self.serve(head)
            finally:
                self.server._in_flight -= 1
            if not keep_alive or self.server.closing or self.must_close:
                return
            if not self.parser.done:
                return
            self.next_cycle()

    def next_cycle(self) -> None:
        """The next request: the parser keeps what was read ahead of it."""
        self.parser.next_request()
        self.responded = False

    async def read_head(self, first: bool) -> RequestHead | None:
        """The next request head, or None to close quietly (EOF, idle timeout, shutdown)."""
        limits = self.limits
        self.head_only = False
        waiting = not self.carry  # no byte of this request seen yet (idle)
        self.carry = False
        quiet = waiting and not first  # a keep-alive wait ends silently
        timeout = limits.keepalive_timeout_s if quiet else limits.header_timeout_s
        deadline = trio.current_time() + timeout
        parser = self.parser
        while True:
            try:
                head = parser.head()
            except ProtocolError as exc:
                raise _Reject.of(exc) from exc
            if head is not None:
                return head
            if parser.closed:
                return None  # closed between requests
            with trio.CancelScope(deadline=deadline) as scope:
                if waiting:
                    self.idle_scope = scope
                    if self.server.closing:
                        scope.cancel("server shutdown")
                data = await self.receive()
            self.idle_scope = None
            if scope.cancelled_caught:
                if waiting and (quiet or self.server.closing):
                    return None
                raise _Reject(408)
            if waiting and data:
                waiting = False
                if quiet:
                    deadline = trio.current_time() + limits.header_timeout_s
            parser.feed(data)

    async def read_body(self, head: RequestHead) -> bytes | None:
        """The whole body, or None if the client went away."""
        limit = self.limits.max_body_bytes
        if head.content_length > limit:
            raise _Reject(413)
        parser = self.parser
        if parser.done:
            return b""
        parts: list[bytes] = []
        size = 0
        deadline: float | None = None  # set when the body is not all here yet
        # An HTTP/1.1 "Expect: 100-continue" client waits for a 100 before it sends a
        # body; one that sends it anyway needs none.
        expecting = head.expect_continue
        while True:
            try:
                chunk = parser.body()
            except ProtocolError as exc:
                raise _Reject.of(exc) from exc
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise _Reject(413)
                parts.append(chunk)
            if parser.done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if parser.closed:
                return None
            if deadline is None:
                deadline = trio.current_time() + self.limits.body_timeout_s
            if expecting:
                expecting = False
                if size == 0 and not parser.buf:
                    await self.send_quietly(b"HTTP/1.1 100 Continue\r\n\r\n")
            with trio.CancelScope(deadline=deadline) as scope:
                data = await self.receive()
            if scope.cancelled_caught:
                raise _Reject(408)
            parser.feed(data)

    async def serve(self, head: RequestHead) -> bool:
        """Read the body, run the handler, finish the response; True to keep alive."""
        try:
            body = await self.read_body(head)
        except _Reject as reject:
            await self.reject(reject.status, reject.detail)
            return False
        if body is None:
            return False
        target = head.target.decode("latin-1")
        path, _, query = target.partition("?")
        request = Request(
            method=head.method.decode("ascii"),
            target=target,
            path=path,
            query=query,
            headers=[(n.decode("latin-1"), v.decode("latin-1")) for n, v in head.headers],
            body=body,
            client=self.client,
        )
        self.head_only = head.method == b"HEAD"
        self.http11 = head.http11
        self.must_close = head.close  # HTTP/1.0, or "Connection: close"
        writer = ResponseWriter(self, head_only=self.head_only)
        self.request = request
        self.handler_scope = trio.CancelScope()
        self._forget_watcher()
        if self.limits.disconnect_check_s > 0:
            self.server.watch_starts.call_later(self.start_watcher, request)
        else:
            self.start_watcher(request)
        try:
            failure = await self.call_handler(request, writer, self.handler_scope)
        finally:
            self.request = None
            self.handler_scope = None
            if self.polled_fd >= 0:
                self.unpoll()
            watcher: _Watcher | None = self.watcher
            if watcher is not None:
                watcher.scope.cancel()
        if watcher is not None:
            await watcher.stop()  # it feeds the parser: it must be done reading before the next read
        return await self.finish(request, writer, failure)

    def _forget_watcher(self) -> None:
        # A method, not `self.watcher = None` inline: mypy would narrow the attribute
        # to None for the rest of `serve` (start_watcher sets it meanwhile).
        self.watcher = None

    def start_watcher(self, request: Request) -> None:
        """Start ``request``'s disconnect watcher, if the request is still being handled:
        its socket in the server's socket watch, else a task (any other stream, or a
        socket the socket watch cannot take)."""
        if self.request is not request or self.watcher is not None or self.polled_fd >= 0 or self.detached:
            return
        sock = self.io.socket
        socket_watch = self.server.socket_watch
        if sock is not None and socket_watch is not None:
            fd = sock.fileno()
            if fd >= 0:
                try:
                    socket_watch.watch(fd, self.on_readable)
                except OSError as exc:
                    # Out of descriptors or memory: a task of its own watches instead (a
                    # request left unwatched would notice a client's FIN only when a write
                    # failed, never while a write waits on a client that stopped reading).
                    self.server.watch_failed(exc)
                else:
                    self.read_ahead = 0
                    self.polled_fd = fd
                    return
        assert self.nursery is not None
        self.watcher = watcher = _Watcher()
        self.nursery.start_soon(self.watch, watcher)

    def unpoll(self) -> None:
        """Take the request's socket out of the server's socket watch."""
        socket_watch = self.server.socket_watch
        if socket_watch is not None and self.polled_fd >= 0:
            socket_watch.unwatch(self.polled_fd)
        self.polled_fd = -1

    def on_readable(self) -> None:
        """The polled socket is readable (called by the socket watch's task): what
        :meth:`watch` does after each wait, without blocking."""
        try:
            data = os.read(self.polled_fd, _RECV_SIZE)
        except BlockingIOError:
            return  # readable no more (an event that was already stale)
        except OSError:
            data = b""  # reset: gone, as for a read of the stream
        if not data:
            self.eof = True
            self.unpoll()
            self.client_gone()
            return
        self.parser.feed(data)
        self.carry = True
        self.read_ahead += len(data)
        if self.read_ahead >= max(self.limits.max_header_bytes, _RECV_SIZE):
            self.unpoll()  # enough read ahead: let TCP push back

    async def call_handler(
        self, request: Request, writer: ResponseWriter, scope: trio.CancelScope
    ) -> Exception | None:
        with scope:
            try:
                await self.server.handler(request, writer)
            except Exception as exc:  # Cancelled is a BaseException and passes through
                return exc
        return None

    async def watch(self, watcher: _Watcher) -> None:
        """Notice the client going away while the handler runs; keep pipelined bytes."""
        sock = self.io.socket
        try:
            with watcher.scope:
                read_ahead = 0
                while read_ahead < max(self.limits.max_header_bytes, _RECV_SIZE):
                    if sock is not None:
                        # Parked here, the watcher gives the socket up the moment it is
                        # cancelled (see _Watcher.stop()).
                        watcher.parked = True
                        try:
                            await trio.lowlevel.wait_readable(sock)
                        except trio.ClosedResourceError:
                            self.client_gone()
                            return
                        watcher.parked = False
                        self.io.readable()
                    data = await self.receive()
                    if not data:
                        self.client_gone()
                        return
                    self.parser.feed(data)
                    self.carry = True
                    read_ahead += len(data)
                await trio.sleep_forever()  # enough read ahead: let TCP push back
        finally:
            watcher.done.set()

    async def detach(self) -> trio.abc.Stream:
        """Hand the raw stream to the handler for a protocol upgrade (WebSocket).

        The watcher stops reading; the request head and any bytes read after it are
        replayed to the new owner, so a library that performs its own handshake (such
        as trio-websocket) sees the connection from its first byte. The connection is
        closed when the handler returns.
        """
        request = self.request
        if request is None:
            raise RuntimeError("detach() outside a request")
        self.detached = True  # no watcher starts from now on
        if self.polled_fd >= 0:
            self.unpoll()
        if self.watcher is not None:
            await self.watcher.stop()
        head = [f"{request.method} {request.target} HTTP/1.1\r\n".encode("latin-1")]
        head.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in request.headers)
        head.append(b"\r\n")
        return ReplayStream(b"".join(head) + request.body + self.parser.trailing, self.stream)

    async def finish(
        self, request: Request, writer: ResponseWriter, failure: Exception | None
    ) -> bool:
        if self.detached:
            if failure is not None:
                logger.error(
                    "handler for upgraded %s %s raised", request.method, request.path, exc_info=failure
                )
            self.abort = failure is not None
            return False
        if self.gone:
            self.abort = True
            return False
        if failure is not None:
            if writer.finished:
                logger.error(
                    "handler for %s %s raised after its response was complete",
                    request.method,
                    request.path,
                    exc_info=failure,
                )
                return True
            if writer.started:
                logger.error(
                    "handler for %s %s raised mid-response; aborting the connection",
                    request.method,
                    request.path,
                    exc_info=failure,
                )
                self.abort = True
                return False
            return await self.send_failure(request, failure)
        if not writer.started:
            logger.error(
                "handler for %s %s returned without responding", request.method, request.path
            )
            return await self.send_error(500, _INTERNAL_ERROR_BODY, close=False)
        if not writer.finished:
            try:
                await writer.end()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.abort = True
                return False
        return True

    async def send_failure(self, request: Request, failure: Exception) -> bool:
        exc = _sole_exception(failure)
        if isinstance(exc, NarwhalError):
            status = exc.http_status if 400 <= exc.http_status <= 599 else 500
            body = json.dumps(exc.to_body(), separators=(",", ":"), default=str).encode()
            extra: list[tuple[str, str]] = []
            if isinstance(exc, Refused):
                extra.append(("retry-after", str(max(1, math.ceil(exc.retry_after_s)))))
            logger.debug("handler for %s %s: %s %s", request.method, request.path, status, exc)
            return await self.send_error(status, body, extra=extra, close=False)
        logger.error(
            "unhandled exception in handler for %s %s",
            request.method,
            request.path,
            exc_info=failure,
        )
        return await self.send_error(500, _INTERNAL_ERROR_BODY, close=False)

    async def reject(self, status: int, detail: str = "") -> None:
        self.linger = True
        known = _PROTOCOL_ERRORS.get(status)
        if known is None:
            status = status if 400 <= status <= 599 else 400
            known = (_REASONS.get(status, b"error").decode().lower(), "invalid_request_error")
        message, error_type = known
        if detail:
            message = f"{message}: {detail}"
        await self.send_error(status, _error_body(message, error_type))

    async def send_error(
        self,
        status: int,
        body: bytes,
        *,
        extra: Sequence[tuple[str, str]] = (),
        close: bool = True,
    ) -> bool:
        """A JSON error response outside the handler; True if it was sent (and keep-alive)."""
        if self.eof or self.gone or self.responded:
            return False
        if close:
            self.must_close = True
        headers = [*JSON_HEADERS, *extra]
        head = self.response_head(status, headers, len(body))
        data = head if self.head_only else head + body
        return await self.send_quietly(data) and not self.must_close

    async def send_quietly(self, data: bytes) -> bool:
        """Write outside any handler (bounded); False if the client is gone or too slow."""
        with trio.move_on_after(_ERROR_SEND_TIMEOUT_S):
            try:
                await self.io.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.eof = True
            else:
                return True
        self.abort = True
        return False

    async def close(self, *, forceful: bool) -> None:
        """Close the stream: bounded and shielded, forcefully on error paths."""
        if forceful or self.abort:
            await trio.aclose_forcefully(self.stream)
            return
        with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True) as scope:
            if self.linger and not self.eof:
                await self._linger()
            await self.stream.aclose()
        if scope.cancelled_caught:
            await trio.aclose_forcefully(self.stream)

    async def _linger(self) -> None:
        stream = self.stream
        if not isinstance(stream, trio.abc.HalfCloseableStream):
            return
        with trio.move_on_after(_LINGER_S):
            try:
                await stream.send_eof()
                drained = 0
                while drained < _LINGER_BYTES:
                    data = await stream.receive_some(_RECV_SIZE)
                    if not data:
                        return
                    drained += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


class ReplayStream(trio.abc.Stream):
    """A stream whose first bytes received are ``prefix``, then those of ``stream``."""

    def __init__(self, prefix: bytes, stream: trio.abc.Stream) -> None:
        self._prefix = prefix
        self._stream = stream

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._prefix:
            await trio.lowlevel.checkpoint()
            n = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:n], self._prefix[n:]
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()
