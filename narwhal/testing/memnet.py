"""An in-memory network: httpx reaches :class:`~narwhal.http.HTTPServer` s without sockets.

Servers register under an address with :meth:`MemoryNetwork.listen`; a connection is
a :func:`trio.testing.memory_stream_pair` whose server end is handed to
``server.handle_connection`` and whose client end is either returned by
:meth:`MemoryNetwork.connect` or wrapped for httpcore by the transport of
:meth:`MemoryNetwork.transport`. Both sides speak real HTTP/1.1 through h11, the
client pool keeps connections alive as it would over TCP, and everything runs on
trio's clock, so tests can use virtual time (``autojump_clock``)::

    async with open_memory_network() as net:
        net.listen("10.0.0.1", 8000, HTTPServer(handler))
        async with httpx.AsyncClient(transport=net.transport()) as client:
            response = await client.get("http://10.0.0.1:8000/health")

Failure modes: connecting to an address nobody listens on, or one set refusing,
raises :class:`httpcore.ConnectError` (``httpx.ConnectError`` through httpx);
:meth:`MemoryNetwork.abort_all` resets every open connection of a server, so reads
and writes on both ends fail as after a TCP reset. ``https`` URLs work but are not
encrypted (TLS is skipped).
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import httpcore
import httpx
import trio
import trio.testing

from narwhal.engines.wire import WireTransport
from narwhal.http.server import HTTPServer

__all__ = ["MemoryNetwork", "MemoryTransport", "open_memory_network"]

_Memory = trio.StapledStream[trio.testing.MemorySendStream, trio.testing.MemoryReceiveStream]
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_LOOPBACK_ALIASES = {"localhost": ("127.0.0.1", "::1")}


def _pump(send: trio.testing.MemorySendStream, receive: trio.testing.MemoryReceiveStream) -> int:
    """Move what ``send`` holds to ``receive``; returns bytes moved (-1 for EOF)."""
    try:
        data = send.get_data_nowait()
    except trio.WouldBlock:
        return 0
    try:
        if data:
            receive.put_data(data)
            return len(data)
        receive.put_eof()
        return -1
    except trio.ClosedResourceError:
        # The peer closed its end: to the writer that is a reset, not its own close.
        raise trio.BrokenResourceError("connection reset by peer") from None


class _Link:
    """One in-memory connection: its two ends and whether it was reset."""

    def __init__(self, network: MemoryNetwork, address: tuple[str, int], number: int) -> None:
        client, server = trio.testing.memory_stream_pair()
        self.network = network
        self.address = address
        self.number = number
        self.aborted = False
        self.client_pending = 0  # bytes the client end has not read yet
        self.client_eof = False
        self.client = _ClientEnd(self, client)
        self.server = _ServerEnd(self, server)
        self._wire(server, client, to_client=True)
        self._wire(client, server, to_client=False)

    def _wire(self, src: _Memory, dst: _Memory, *, to_client: bool) -> None:
        send = src.send_stream
        receive = dst.receive_stream

        def pump() -> None:
            moved = _pump(send, receive)
            if to_client:
                if moved > 0:
                    self.client_pending += moved
                elif moved < 0:
                    self.client_eof = True

        async def async_pump() -> None:
            pump()

        send.send_all_hook = async_pump
        send.close_hook = pump

    def abort(self) -> None:
        self.aborted = True
        self.client.interrupt()
        self.server.interrupt()

    def end_closed(self) -> None:
        if self.client.closed and self.server.closed:
            self.network._links.discard(self)


class _End(trio.abc.HalfCloseableStream):
    """One end of a link: delegates to the memory stream, fails like a reset once aborted."""

    def __init__(self, link: _Link, stream: _Memory) -> None:
        self._link = link
        self._stream = stream
        self._receive_scope: trio.CancelScope | None = None
        self._send_scope: trio.CancelScope | None = None
        self.closed = False

    def _check(self) -> None:
        if self.closed:
            raise trio.ClosedResourceError("connection closed")
        if self._link.aborted:
            raise trio.BrokenResourceError("connection reset by peer")

    def interrupt(self) -> None:
        for scope in (self._receive_scope, self._send_scope):
            if scope is not None:
                scope.cancel("connection reset")

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        self._check()
        with trio.CancelScope() as scope:
            self._receive_scope = scope
            try:
                data = await self._stream.receive_some(max_bytes)
            finally:
                self._receive_scope = None
            self._received(len(data))
            return data
        self._check()  # interrupted by our own close, or by a reset:
        raise trio.BrokenResourceError("connection reset by peer")

    def _received(self, count: int) -> None:
        pass

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check()
        with trio.CancelScope() as scope:
            self._send_scope = scope
            try:
                await self._stream.send_all(data)
            finally:
                self._send_scope = None
            return
        self._check()
        raise trio.BrokenResourceError("connection reset by peer")

    async def wait_send_all_might_not_block(self) -> None:
        self._check()
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        self._check()
        await self._stream.send_eof()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.interrupt()
            self._close_now()
            self._link.end_closed()
        await trio.lowlevel.checkpoint()

    def _close_now(self) -> None:
        self._stream.send_stream.close()
        self._stream.receive_stream.close()


class _ServerEnd(_End):
    pass


class _ClientEnd(_End):
    def _received(self, count: int) -> None:
        self._link.client_pending -= count

    def is_readable(self) -> bool:
        """Whether a read would return at once (data, EOF or a reset is pending)."""
        link = self._link
        return link.aborted or link.client_pending > 0 or link.client_eof


class _HttpcoreStream(httpcore.AsyncNetworkStream):
    """httpcore's view of a client end, with httpcore's exception mapping."""

    def __init__(self, end: _ClientEnd) -> None:
        self._end = end

    # httpcore's interface passes timeouts as arguments (hence the ASYNC109 waivers).
    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        try:
            with trio.fail_after(float("inf") if timeout is None else timeout):
                return bytes(await self._end.receive_some(max_bytes))
        except trio.TooSlowError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        try:
            with trio.fail_after(float("inf") if timeout is None else timeout):
                await self._end.send_all(buffer)
        except trio.TooSlowError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        await self._end.aclose()

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        return self  # in memory: nobody to eavesdrop

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return self._end.is_readable()
        if info == "server_addr":
            return self._end._link.address
        if info == "client_addr":
            return ("memory", self._end._link.number)
        return None


class _MemoryBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, network: MemoryNetwork) -> None:
        self._network = network

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _HttpcoreStream(await self._network._open(host, port))

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError(f"no unix sockets on the memory network: {path}")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


class MemoryTransport(httpx.AsyncHTTPTransport):
    """An httpx transport whose connection pool dials the memory network."""

    def __init__(
        self,
        network: MemoryNetwork,
        *,
        limits: httpx.Limits = httpx.Limits(max_connections=100, max_keepalive_connections=20),
        retries: int = 0,
    ) -> None:
        super().__init__(verify=False, limits=limits, retries=retries)
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            retries=retries,
            network_backend=_MemoryBackend(network),
        )


class MemoryNetwork:
    """Addresses mapped to :class:`HTTPServer` s; connection tasks run in ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._servers: dict[tuple[str, int], HTTPServer] = {}
        self._refusing: set[tuple[str, int]] = set()
        self._links: set[_Link] = set()
        self._numbers = itertools.count(1)

    @property
    def open_connections(self) -> int:
        """Connections not yet closed at both ends (for leak checks)."""
        return len(self._links)

    def connections_to(self, host: str, port: int) -> int:
        """Connections to ``host:port`` not yet closed at both ends."""
        key = (host.lower(), port)
        return sum(1 for link in self._links if link.address == key)

    def listen(self, host: str, port: int, server: HTTPServer) -> None:
        """Serve connections to ``host:port`` with ``server``."""
        key = (host.lower(), port)
        if key in self._servers:
            raise OSError(errno.EADDRINUSE, f"address already in use: {host}:{port}")
        self._servers[key] = server

    def unlisten(self, host: str, port: int) -> None:
        """Stop accepting at ``host:port`` (open connections stay open)."""
        self._servers.pop((host.lower(), port), None)

    def set_refusing(self, host: str, port: int, refusing: bool) -> None:
        """Refuse (or accept again) connections to ``host:port``, keeping its server."""
        key = (host.lower(), port)
        if refusing:
            self._refusing.add(key)
        else:
            self._refusing.discard(key)

    def server_at(self, host: str, port: int) -> HTTPServer | None:
        """The server a connection to ``host:port`` would reach, if any."""
        key = self._resolve(host, port)
        return None if key is None else self._servers[key]

    async def connect(self, host: str, port: int) -> trio.abc.HalfCloseableStream:
        """Open a connection; the server handles it in the network's nursery.

        Raises:
            httpcore.ConnectError: nobody listens there, it refuses, or its server is
                shutting down.
        """
        return await self._open(host, port)

    def transport(
        self,
        *,
        limits: httpx.Limits = httpx.Limits(max_connections=100, max_keepalive_connections=20),
        retries: int = 0,
    ) -> MemoryTransport:
        """A fresh httpx transport (its own connection pool) reaching this network."""
        return MemoryTransport(self, limits=limits, retries=retries)

    def wire_transport(self, *, connect_timeout_s: float | None = 5.0) -> WireTransport:
        """The router's own engine transport (:class:`WireTransport`) over this network."""
        return WireTransport(connect=self._wire_connect, connect_timeout_s=connect_timeout_s)

    async def _wire_connect(self, host: str, port: int) -> trio.abc.Stream:
        try:
            return await self._open(host, port)
        except httpcore.ConnectError as exc:
            raise ConnectionRefusedError(str(exc)) from None

    def abort_all(self, host: str, port: int) -> None:
        """Reset every open connection to the server at ``host:port`` (engine death)."""
        key = self._resolve(host, port) or (host.lower(), port)
        for link in list(self._links):
            if link.address == key:
                link.abort()

    def _resolve(self, host: str, port: int) -> tuple[str, int] | None:
        host = host.lower()
        candidates = [host, *_LOOPBACK_ALIASES.get(host, ()), *_WILDCARD_HOSTS]
        for candidate in candidates:
            if (candidate, port) in self._servers:
                return (candidate, port)
        return None

    async def _open(self, host: str, port: int) -> _ClientEnd:
        await trio.lowlevel.checkpoint()
        key = self._resolve(host, port)
        server = None if key is None else self._servers[key]
        if (
            server is None
            or key in self._refusing
            or (host.lower(), port) in self._refusing
            or not server.accepting
        ):
            raise httpcore.ConnectError(f"connection refused: {host}:{port}")
        assert key is not None
        link = _Link(self, key, next(self._numbers))
        self._links.add(link)
        self._nursery.start_soon(self._serve, server, link)
        return link.client

    async def _serve(self, server: HTTPServer, link: _Link) -> None:
        try:
            await server.handle_connection(link.server)
        finally:
            if not link.server.closed:  # handle_connection always closes; be sure anyway
                link.server.closed = True
                link.server._close_now()
                link.end_closed()


@asynccontextmanager
async def open_memory_network() -> AsyncIterator[MemoryNetwork]:
    """A :class:`MemoryNetwork` whose server-side tasks end with the block."""
    async with trio.open_nursery() as nursery:
        network = MemoryNetwork(nursery)
        try:
            yield network
        finally:
            nursery.cancel_scope.cancel("memory network closed")
