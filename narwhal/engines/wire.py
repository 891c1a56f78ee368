"""WireTransport: a lean HTTP/1.1 keep-alive transport for talking to engines.

The router's hot path is three small requests per client request (tokenize,
prefill, decode) and one streamed body per decode; a general-purpose client stack
(httpx over httpcore over h11) spends most of the router's CPU on them. This
transport implements :class:`httpx.AsyncBaseTransport` with just what an engine
needs: one request written with one ``send_all``, a response head parsed by hand,
bodies framed by ``Content-Length``, chunked encoding or connection close, idle
connections pooled per origin with an expiry below the engines' own keep-alive
timeout, TCP_NODELAY on every socket. A streamed body yields everything that has
arrived in one piece, so a burst of SSE events costs one iteration.

Errors are httpx's (``ConnectError``, ``ConnectTimeout``, ``ReadError``,
``WriteError``, ``RemoteProtocolError``), so callers map them in one place, except
one: a connection that cannot be opened because the router itself ran out of
descriptors, buffers, memory or local ports is :class:`~narwhal.errors.RouterOverloaded`,
the router's fault and not the engine's. A pooled
connection that turns out to be closed before any byte of the response arrived is
retried once on a fresh connection (the engine never saw the request).

Two interfaces share one implementation: :meth:`WireTransport.request` (what
:class:`~narwhal.engines.client.EngineClient` calls: a pre-encoded head, a
:class:`WireResponse` back, no per-request objects beyond it) and httpx's
``handle_async_request`` (for ``httpx.AsyncClient`` users).

``connect`` is pluggable: ``narwhal.testing``'s in-memory network passes its own, so
tests exercise this transport in virtual time.
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Awaitable, Callable
from typing import Final

import httpx
import trio

from narwhal.errors import RouterOverloaded, resource_exhaustion
from narwhal.netio import StreamIO

__all__ = ["Connector", "WireResponse", "WireTransport", "tcp_connector"]

Connector = Callable[[str, int], Awaitable[trio.abc.Stream]]

_MAX_HEAD: Final = 64 * 1024
_RECV: Final = 65536
_NO_BODY_STATUSES: Final = frozenset({204, 304})
#: Idle longer than this, a pooled connection is checked for a close by the peer.
_CHECK_AFTER_IDLE_S: Final = 0.05


async def tcp_connector(host: str, port: int) -> trio.abc.Stream:
    """Open a TCP connection with TCP_NODELAY set."""
    stream = await trio.open_tcp_stream(host, port)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return stream


class _Conn:
    __slots__ = ("buf", "idle_since", "io", "origin", "reused", "stream")

    def __init__(self, stream: trio.abc.Stream, origin: tuple[str, str, int]) -> None:
        self.stream = stream
        self.io = StreamIO(stream)
        self.origin = origin
        self.buf = bytearray()
        self.idle_since = 0.0
        self.reused = False

    async def receive(self) -> bool:
        """Append what arrives; False on EOF.

        Raises:
            httpx.ReadError: the connection broke (reset, closed under us).
        """
        try:
            data = await self.io.receive_some(_RECV)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise httpx.ReadError(f"connection to the engine broke: {exc}") from exc
        if not data:
            return False
        self.buf += data
        return True

    def looks_closed(self) -> bool:
        """An idle connection with readable data is closed (or broken) by the peer."""
        sock = getattr(self.stream, "socket", None)
        is_readable = getattr(sock, "is_readable", None)
        return bool(is_readable is not None and is_readable())


class _Body(httpx.AsyncByteStream):
    """The body of one response; returns its connection to the pool when complete.

    It is its own async iterator (no generators: an abandoned generator is one trio
    has to finalize, and a class costs less per piece).
    """

    def __init__(
        self, transport: WireTransport, conn: _Conn, *, length: int | None, chunked: bool, keep_alive: bool
    ) -> None:
        self._transport = transport
        self._conn: _Conn | None = conn
        self._length = length  # remaining bytes for Content-Length framing
        self._chunked = chunked
        self._keep_alive = keep_alive and (chunked or length is not None)
        self._complete = length == 0 and not chunked
        self._state = "size"  # chunked: a "size" line, chunk "data", the "crlf" after it
        self._need = 0  # chunked: bytes left of the current chunk's data
        # What bytes read off the event loop (feed) met: raised by the next __anext__.
        self._error: httpx.HTTPError | None = None

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if conn is None or self._complete:
            raise StopAsyncIteration
        if self._chunked:
            return await self._next_chunked(conn)
        if self._length is not None:
            return await self._next_length(conn)
        return await self._next_until_close(conn)

    async def _next_length(self, conn: _Conn) -> bytes:
        buf = conn.buf
        if not buf and not await conn.receive():
            raise httpx.RemoteProtocolError("engine closed the connection mid-body")
        remaining = self._length or 0
        piece = bytes(buf[:remaining])
        del buf[: len(piece)]
        self._length = remaining - len(piece)
        if not self._length:
            self._complete = True
        return piece

    async def _next_until_close(self, conn: _Conn) -> bytes:
        if not conn.buf and not await conn.receive():
            self._complete = True
            raise StopAsyncIteration
        piece = bytes(conn.buf)
        conn.buf.clear()
        return piece

    async def _next_chunked(self, conn: _Conn) -> bytes:
        """Everything that has arrived, de-chunked, in one piece (waits for some)."""
        buf = conn.buf
        out = bytearray()
        while True:
            done = self._parse_chunks(buf, out)
            if done or out:
                if done:
                    self._complete = True
                    if not out:
                        raise StopAsyncIteration
                return bytes(out)
            if not await conn.receive():
                raise httpx.RemoteProtocolError("engine closed the connection mid-body")

    def _parse_chunks(self, buf: bytearray, out: bytearray) -> bool:
        """Move complete chunk data from ``buf`` to ``out``; True at the last chunk.

        One pass with an index over the buffer, and one deletion at the end: a burst
        of events arrives as many small chunks.
        """
        pos = 0
        try:
            if self._state == "size":
                # Whole chunks back to back (a burst of events): no state machine.
                n = len(buf)
                find = buf.find
                while True:
                    end = find(b"\r\n", pos)
                    if end < 0:
                        break
                    line = buf[pos:end]
                    if not line.isalnum():
                        break  # extensions, or malformed: the general path decides
                    try:
                        size = int(line, 16)
                    except ValueError:
                        break
                    start = end + 2
                    stop = start + size
                    if size == 0 or stop + 2 > n:
                        break  # the last chunk, or an incomplete one
                    if buf[stop : stop + 2] != b"\r\n":
                        raise httpx.RemoteProtocolError("malformed chunked body")
                    out += buf[start:stop]
                    pos = stop + 2
            while True:
                if self._state == "data":
                    take = min(self._need, len(buf) - pos)
                    out += buf[pos : pos + take]
                    pos += take
                    self._need -= take
                    if self._need:
                        return False
                    self._state = "crlf"
                if self._state == "crlf":
                    if len(buf) - pos < 2:
                        return False
                    if buf[pos : pos + 2] != b"\r\n":
                        raise httpx.RemoteProtocolError("malformed chunked body")
                    pos += 2
                    self._state = "size"
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > 1024:
                        raise httpx.RemoteProtocolError("malformed chunk size line")
                    return False
                line = buf[pos:end]
                semi = line.find(b";")
                try:
                    size = int(line if semi < 0 else line[:semi], 16)
                except ValueError:
                    raise httpx.RemoteProtocolError("malformed chunk size line") from None
                if size < 0:
                    raise httpx.RemoteProtocolError("malformed chunk size line")
                if size == 0:
                    if buf[end : end + 4] == b"\r\n\r\n":
                        pos = end + 4
                        return True
                    trailers_end = buf.find(b"\r\n\r\n", end)
                    if trailers_end < 0:
                        return False  # trailers (or the final CRLF) still to come
                    pos = trailers_end + 4
                    return True
                pos = end + 2
                self._need = size
                self._state = "data"
        finally:
            if pos:
                del buf[:pos]

    def relay_fd(self) -> int:
        """The descriptor of a chunked body's socket that a relay may read off the event
        loop (:meth:`feed` what it reads), or -1."""
        conn = self._conn
        if conn is None or self._complete or not self._chunked or self._error is not None:
            return -1
        sock = conn.io.socket
        return -1 if sock is None else sock.fileno()

    def feed(self, data: bytes) -> bytes:
        """The body bytes in ``data`` read from :meth:`relay_fd`'s socket: what has arrived
        de-chunked (b"" when no chunk is whole yet). Never raises: a malformed body is
        raised by the next ``__anext__``; :attr:`ended` says that one will not wait."""
        conn = self._conn
        assert conn is not None
        buf = conn.buf
        buf += data
        out = bytearray()
        try:
            if self._parse_chunks(buf, out):
                self._complete = True
        except httpx.RemoteProtocolError as exc:
            self._error = exc
            return b""
        return bytes(out)

    def fail(self, exc: OSError) -> None:
        """A read from :meth:`relay_fd`'s socket failed: the next ``__anext__`` raises it."""
        self._error = httpx.ReadError(f"connection to the engine broke: {exc}")

    @property
    def ended(self) -> bool:
        """Whether the next ``__anext__`` returns or raises without reading."""
        return self._complete or self._error is not None

    def finish_buffered(self) -> bool:
        """Consume what has already arrived; whether that completes the body (never waits).

        A malformed rest is not complete (never raised: this runs on the way to closing,
        and closing must happen); :meth:`aclose` then closes the connection.
        """
        conn = self._conn
        if conn is None or self._complete:
            return self._complete
        if self._chunked:
            try:
                done = self._parse_chunks(conn.buf, bytearray())
            except httpx.RemoteProtocolError:
                return False
            if done:
                self._complete = True
        elif self._length is not None and len(conn.buf) >= self._length:
            del conn.buf[: self._length]
            self._length = 0
            self._complete = True
        return self._complete

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._complete and self._keep_alive and not conn.buf:
            await self._transport._release(conn)
        else:
            await trio.aclose_forcefully(conn.stream)


class WireResponse:
    """A response head and its body, as :meth:`WireTransport.request` returns it.

    Attributes:
        status: the status code.
        reason: the reason phrase.
        headers: the header fields, names lower-cased (a repeated name keeps its last value).
        body: the body: an async iterator of the pieces that arrive; close it (or the
            response) when done, which returns the connection to the pool once the body
            is complete.
    """

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: dict[str, str], body: _Body) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body

    async def read(self) -> bytes:
        """The whole body (then the response is closed)."""
        try:
            parts = [piece async for piece in self.body]
        finally:
            await self.body.aclose()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def body_complete(self) -> bool:
        """Whether the whole body has arrived, reading only what is buffered (never waits)."""
        return self.body.finish_buffered()

    async def aclose(self) -> None:
        await self.body.aclose()


class WireTransport(httpx.AsyncBaseTransport):
    """A pooled HTTP/1.1 transport for engines (see the module docstring).

    Args:
        connect: opens a stream to ``(host, port)``; TCP with TCP_NODELAY by default.
        max_idle_per_origin: idle connections kept per engine.
        idle_expiry_s: an idle connection older than this is closed, not reused
            (below uvicorn's 5 s keep-alive timeout, which vLLM runs with).
        connect_timeout_s: bound on opening a connection (``httpx.ConnectTimeout``).
    """

    def __init__(
        self,
        *,
        connect: Connector | None = None,
        max_idle_per_origin: int = 256,
        idle_expiry_s: float = 4.0,
        connect_timeout_s: float | None = 5.0,
    ) -> None:
        self._connect = connect or tcp_connector
        self._max_idle = max_idle_per_origin
        self._idle_expiry = idle_expiry_s
        self._connect_timeout = connect_timeout_s
        self._idle: dict[tuple[str, str, int], collections.deque[_Conn]] = {}
        self._closed = False
        self.connections_opened = 0

    async def _release(self, conn: _Conn) -> None:
        pool = self._idle.setdefault(conn.origin, collections.deque())
        if self._closed or len(pool) >= self._max_idle:
            await trio.aclose_forcefully(conn.stream)
            return
        conn.idle_since = trio.current_time()
        conn.reused = True
        pool.append(conn)

    async def close_origin(self, host: str, port: int) -> None:
        """Close the idle connections to ``host:port`` (an engine that left the fleet);
        connections to other engines stay pooled."""
        for origin in [o for o in self._idle if o[1:] == (host, port)]:
            for conn in self._idle.pop(origin):
                await trio.aclose_forcefully(conn.stream)

    async def _acquire(self, origin: tuple[str, str, int]) -> _Conn:
        pool = self._idle.get(origin)
        now = trio.current_time()
        while pool:
            conn = pool.pop()  # most recently used first: likeliest to be alive
            idle = now - conn.idle_since
            # A connection idle for a moment is not worth a system call to check (a
            # closed one is retried once anyway, see the module docstring).
            if idle < self._idle_expiry and (idle < _CHECK_AFTER_IDLE_S or not conn.looks_closed()):
                return conn
            await trio.aclose_forcefully(conn.stream)
        return await self._open(origin)

    async def _open(self, origin: tuple[str, str, int]) -> _Conn:
        _, host, port = origin
        try:
            if self._connect_timeout is None:
                stream = await self._connect(host, port)
            else:
                with trio.fail_after(self._connect_timeout):
                    stream = await self._connect(host, port)
        except trio.TooSlowError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            lack = resource_exhaustion(exc)
            if lack is not None:
                raise RouterOverloaded.opening(f"{host}:{port}", lack) from exc
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        self.connections_opened += 1
        return _Conn(stream, origin)

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        target: str,
        fields: bytes = b"",
        body: bytes = b"",
    ) -> WireResponse:
        """Send one request and return its response once the head has arrived.

        Args:
            method: the request method.
            host, port: the engine's address.
            target: the request target (path and query).
            fields: header lines, each ending in CRLF, without ``Host``,
                ``Content-Length`` or framing headers (this adds them).
            body: the request body.

        Raises:
            httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteError, httpx.ReadError,
            httpx.RemoteProtocolError, RouterOverloaded: as the module docstring says.
        """
        if self._closed:
            raise httpx.ConnectError("transport is closed")
        head = b"%s %s HTTP/1.1\r\nHost: %s:%d\r\n%s" % (
            method.encode("ascii"), target.encode("ascii"), host.encode("ascii"), port, fields
        )
        if body or method in ("POST", "PUT", "PATCH"):
            head += b"Content-Length: %d\r\n" % len(body)
        head += b"\r\n"
        return await self._exchange(("http", host, port), method, head, body)

    async def _exchange(
        self, origin: tuple[str, str, int], method: str, head: bytes, body: bytes
    ) -> WireResponse:
        payload = head + body if len(body) < 65536 else None
        _, host, port = origin
        for attempt in (0, 1):
            conn = await self._acquire(origin)
            try:
                try:
                    if payload is not None:
                        await conn.io.send_all(payload)
                    else:
                        await conn.io.send_all(head)
                        await conn.io.send_all(body)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    if conn.reused and attempt == 0:
                        await trio.aclose_forcefully(conn.stream)
                        continue
                    raise httpx.WriteError(f"sending to {host}:{port} failed: {exc}") from exc
                try:
                    return await self._response(method, conn)
                except _StaleConnection:
                    if conn.reused and attempt == 0:
                        await trio.aclose_forcefully(conn.stream)
                        continue
                    raise httpx.RemoteProtocolError("engine closed the connection without a response") from None
            except BaseException:
                await trio.aclose_forcefully(conn.stream)
                raise
        raise AssertionError("unreachable")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport interface, over :meth:`request`'s machinery."""
        if self._closed:
            raise httpx.ConnectError("transport is closed")
        url = request.url
        scheme = url.scheme
        host = url.host
        port = url.port or (443 if scheme == "https" else 80)
        if scheme != "http":
            raise httpx.UnsupportedProtocol(f"WireTransport speaks plain HTTP, not {scheme}")
        body = await request.aread()
        head = self._head(request, host, port, len(body))
        response = await self._exchange((scheme, host, port), request.method, head, body)
        return httpx.Response(
            response.status,
            headers=list(response.headers.items()),
            stream=response.body,
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": response.reason.encode("latin-1")},
        )

    def _head(self, request: httpx.Request, host: str, port: int, length: int) -> bytes:
        target = request.url.raw_path.decode("ascii")
        lines = [f"{request.method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\n".encode("ascii")]
        for name, value in request.headers.raw:
            lname = name.lower()
            if lname in (b"host", b"content-length", b"transfer-encoding", b"connection"):
                continue
            lines.append(name + b": " + value + b"\r\n")
        if length or request.method in ("POST", "PUT", "PATCH"):
            lines.append(b"Content-Length: %d\r\n" % length)
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _response(self, method: str, conn: _Conn) -> WireResponse:
        buf = conn.buf
        received_any = bool(buf)
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > _MAX_HEAD:
                raise httpx.RemoteProtocolError("response head too large")
            try:
                got = await conn.receive()
            except httpx.ReadError:
                if not received_any:
                    raise _StaleConnection() from None
                raise
            if not got:
                if not received_any:
                    raise _StaleConnection
                raise httpx.RemoteProtocolError("engine closed the connection mid-head")
            received_any = True
        head = bytes(buf[:end]).decode("latin-1")
        del buf[: end + 4]
        status_line, _, rest = head.partition("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise httpx.RemoteProtocolError(f"malformed status line {status_line[:80]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise httpx.RemoteProtocolError(f"malformed status line {status_line[:80]!r}") from None
        if 100 <= status < 200:
            # Interim responses (100 Continue): skip and read the final one.
            return await self._response(method, conn)
        headers: dict[str, str] = {}
        length: int | None = None
        chunked = False
        keep_alive = parts[0] == "HTTP/1.1"
        for line in rest.split("\r\n") if rest else ():
            name, sep, value = line.partition(":")
            if not sep:
                raise httpx.RemoteProtocolError("malformed header line")
            value = value.strip()
            lname = name.strip().lower()
            headers[lname] = value
            if lname == "content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise httpx.RemoteProtocolError("malformed content-length") from None
            elif lname == "transfer-encoding":
                chunked = value.lower().endswith("chunked")
            elif lname == "connection":
                tokens = {t.strip() for t in value.lower().split(",")}
                if "close" in tokens:
                    keep_alive = False
                elif "keep-alive" in tokens:
                    keep_alive = True
        if method == "HEAD" or status in _NO_BODY_STATUSES:
            length, chunked = 0, False
        if chunked:
            length = None
        stream = _Body(self, conn, length=length, chunked=chunked, keep_alive=keep_alive)
        return WireResponse(status, parts[2] if len(parts) > 2 else "", headers, stream)

    async def aclose(self) -> None:
        self._closed = True
        pools, self._idle = self._idle, {}
        for pool in pools.values():
            for conn in pool:
                await trio.aclose_forcefully(conn.stream)


class _StaleConnection(Exception):
    """A pooled connection was closed before any byte of the response arrived."""
