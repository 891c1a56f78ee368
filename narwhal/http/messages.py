"""The request and response objects of :mod:`narwhal.http`: :class:`ServerLimits`,
:class:`Request`, :class:`ResponseWriter` and the :data:`Handler` signature.

A :class:`ResponseWriter` writes through the connection that read its request
(:class:`narwhal.http.connection.Connection`), which owns the request parser and the stream.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from narwhal.errors import BadRequest

if TYPE_CHECKING:
    from narwhal.http.connection import Connection

__all__ = ["JSON_HEADERS", "Handler", "Request", "ResponseWriter", "ServerLimits"]

#: The headers of a JSON response body.
JSON_HEADERS: tuple[tuple[str, str]] = (("content-type", "application/json"),)

#: Statuses whose responses never have a body (nor a ``Content-Length``).
BODYLESS_STATUSES = frozenset({204, 304})


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _not_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


@attrs.frozen
class ServerLimits:
    """Per-connection limits and timeouts (seconds) of an :class:`~narwhal.http.server.HTTPServer`.

    ``disconnect_check_s``: a request that lasts this long (up to half as long again:
    the watches due within that half start together) gets its connection watched,
    which cancels the handler (and sets ``Request.disconnected``) the moment the client
    goes away; a request that ends sooner never needs it. ``0`` watches every request
    from its start. Until the watch starts, a client that went away is noticed when a
    write to it fails.

    ``send_timeout_s`` (nginx's ``send_timeout``): the longest one write to the client
    may wait without the client reading anything (a full socket buffer; any progress
    restarts it); then the client counts as gone: the handler is cancelled as for a
    disconnect and the connection is closed.

    ``max_connections``: the most connections accepted from listeners open at once
    (the server stops accepting at the limit); None: what the process's open-file
    limit allows (:func:`narwhal.http.server.default_max_connections`).
    """

    max_header_bytes: int = 16384
    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    disconnect_check_s: float = 0.05
    send_timeout_s: float = 60.0
    max_connections: int | None = None

    def __attrs_post_init__(self) -> None:
        _positive("max_header_bytes", self.max_header_bytes)
        _positive("max_body_bytes", self.max_body_bytes)
        _positive("header_timeout_s", self.header_timeout_s)
        _positive("body_timeout_s", self.body_timeout_s)
        _positive("keepalive_timeout_s", self.keepalive_timeout_s)
        _not_negative("disconnect_check_s", self.disconnect_check_s)
        _positive("send_timeout_s", self.send_timeout_s)
        if self.max_connections is not None:
            _positive("max_connections", self.max_connections)


@attrs.define(eq=False)
class Request:
    """One request, with its whole body read.

    ``path`` and ``query`` are the raw (not percent-decoded) parts of ``target``;
    header names are lower-cased. ``disconnected`` is set when the client goes away
    while the handler runs (the handler is cancelled at the same moment), or stops
    reading for ``ServerLimits.send_timeout_s``; ``disconnect_reason`` says which.
    """

    method: str
    target: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    client: tuple[str, int] | None = None
    disconnected: trio.Event = attrs.field(factory=trio.Event, repr=False)
    disconnect_reason: str = ""

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def json(self) -> Any:
        """The body parsed as JSON.

        Raises:
            BadRequest: the body is empty or not a JSON document.
        """
        if not self.body:
            raise BadRequest("request body is empty; expected a JSON document")
        try:
            return json.loads(self.body)
        except json.JSONDecodeError as exc:
            raise BadRequest(
                f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
            ) from exc
        except UnicodeDecodeError as exc:
            raise BadRequest("request body is not valid UTF-8") from exc
        except RecursionError as exc:
            raise BadRequest("request body is nested too deeply") from exc


class ResponseWriter:
    """Writes the response to one request: either :meth:`respond` once, or
    :meth:`start`, any number of :meth:`send`, then :meth:`end` (chunked for HTTP/1.1
    clients, close-delimited for HTTP/1.0 ones).

    If the client disconnects while a write is pending, the handler is cancelled.
    """

    __slots__ = ("_chunked", "_conn", "_head_only", "finished", "started", "status")

    def __init__(self, conn: Connection, *, head_only: bool) -> None:
        self._conn = conn
        self._head_only = head_only
        self._chunked = False  # a streamed body in HTTP/1.1 chunked framing
        self.started = False
        self.finished = False
        self.status: int | None = None

    async def respond(
        self, status: int, headers: Sequence[tuple[str, str]] = (), body: bytes = b""
    ) -> None:
        """Send a complete response with a ``Content-Length`` body."""
        self._check_unstarted(status)
        if body and status in BODYLESS_STATUSES:
            raise ValueError(f"a {status} response cannot have a body")
        conn = self._conn
        head = conn.response_head(status, headers, len(body))
        self.started = self.finished = True
        self.status = status
        await conn.write(head if self._head_only or not body else head + body)

    async def start(
        self, status: int, headers: Sequence[tuple[str, str]] = (), data: bytes = b""
    ) -> None:
        """Send the status and headers of a streamed response (and its first ``data``,
        in the same write)."""
        self._check_unstarted(status)
        conn = self._conn
        head = conn.response_head(status, headers, None)
        self.started = True
        self.status = status
        self._chunked = conn.http11 and status not in BODYLESS_STATUSES
        if data and not self._head_only:
            head += self.frame(data)
        await conn.write(head)

    def frame(self, data: bytes) -> bytes:
        """``data`` framed as one piece of the streamed body (a chunk for HTTP/1.1)."""
        return b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data

    def relay_fd(self) -> int:
        """The client socket's descriptor when a relay may write this streamed response
        off the event loop (each piece :meth:`frame` d, what the socket does not take
        then :meth:`send_framed`), or -1."""
        conn = self._conn
        sock = conn.io.socket
        if not self.started or self.finished or self._head_only or conn.gone or sock is None:
            return -1
        return -1 if sock.did_shutdown_SHUT_WR else sock.fileno()

    @property
    def chunked(self) -> bool:
        """Whether the streamed body is framed in chunks (an HTTP/1.1 client)."""
        return self._chunked

    async def send_framed(self, data: bytes, *, on_wait: Callable[[], None] | None = None) -> None:
        """Send bytes :meth:`frame` made (as :meth:`send`; the rest of a piece a relay
        wrote in part)."""
        if not self.started or self.finished:
            raise RuntimeError("send_framed() needs a started, unfinished streamed response")
        if data:
            await self._conn.write(data, on_wait)

    async def send(self, data: bytes, *, on_wait: Callable[[], None] | None = None) -> None:
        """Send one chunk of a streamed response (one write; empty data is skipped).

        ``on_wait`` is called if the write has to wait for the client to read (a full
        socket buffer): a forwarder uses it to stop timing its upstream meanwhile.
        """
        if not self.started or self.finished:
            raise RuntimeError("send() needs a started, unfinished streamed response")
        if data and not self._head_only:
            await self._conn.write(self.frame(data), on_wait)

    async def end(self, data: bytes = b"") -> None:
        """Finish a streamed response: ``data`` (if any) and the terminating chunk, in
        one write."""
        if not self.started:
            raise RuntimeError("end() before start()")
        if self.finished:
            return
        self.finished = True
        if self._head_only:
            return
        tail = self.frame(data) if data else b""
        if self._chunked:
            tail += b"0\r\n\r\n"
        if tail:
            await self._conn.write(tail)

    async def upgrade(self) -> trio.abc.Stream:
        """Take the raw connection for a protocol upgrade (e.g. a WebSocket handshake).

        The returned stream replays the request head first, so the new protocol's
        library performs its own handshake; the server sends nothing more and closes
        the connection when the handler returns.
        """
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = 101
        return await self._conn.detach()

    def _check_unstarted(self, status: int) -> None:
        if self.started:
            raise RuntimeError("response already started")
        if not 200 <= status <= 999:
            raise ValueError(f"invalid response status {status!r}")


Handler = Callable[[Request, ResponseWriter], Awaitable[None]]
"""An async function answering one request through its :class:`ResponseWriter`."""
