"""HTTP/1.1 server over trio streams (requests parsed by narwhal.http.parser), shared by the router and the
simulated engines.

One :class:`HTTPServer` serves any number of connections; each connection is a
keep-alive loop run by :class:`narwhal.http.connection.Connection` (limits, timeouts,
the handler and its disconnect watcher, error responses: see that module). The
request and response objects live in :mod:`narwhal.http.messages` and are
re-exported here.
"""

from __future__ import annotations

import logging
import socket

import trio

from narwhal.http.connection import Connection
from narwhal.http.delayed import DelayedCalls
from narwhal.http.messages import JSON_HEADERS, Handler, Request, ResponseWriter, ServerLimits
from narwhal.http.sockwatch import SocketWatch, available

__all__ = ["JSON_HEADERS", "HTTPServer", "Handler", "ListenError", "Request", "ResponseWriter", "ServerLimits"]

logger = logging.getLogger("narwhal.http")


class ListenError(OSError):
    """A server cannot listen on its address; the message names it (``host:port``)."""

    def __init__(self, host: str, port: int, cause: OSError) -> None:
        reason = (cause.strerror or str(cause)).lower()
        super().__init__(cause.errno, f"cannot listen on {host}:{port}: {reason}")
        self.host = host
        self.port = port

    def __str__(self) -> str:
        return str(self.strerror)


class HTTPServer:
    """An HTTP/1.1 server calling ``handler`` for every request.

    Serve sockets with :meth:`serve_tcp`, or any trio stream with
    :meth:`handle_connection` (in-memory networks do this). :meth:`shutdown` stops
    the server gracefully.
    """

    def __init__(
        self,
        handler: Handler,
        limits: ServerLimits = ServerLimits(),
        *,
        server_name: str = "narwhal",
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.server_name = server_name
        self.server_header = server_name.encode("latin-1")
        self._connections: set[Connection] = set()
        self._accept_scopes: set[trio.CancelScope] = set()
        self._closing = False
        self._in_flight = 0
        self._closed_lot = trio.lowlevel.ParkingLot()
        #: Starts the disconnect watchers of requests that outlast ``disconnect_check_s``
        #: (those due within half of it at one wake-up, not one wake-up per request).
        self.watch_starts = DelayedCalls(limits.disconnect_check_s, slack_s=limits.disconnect_check_s / 2)
        #: Watches the sockets of those requests, all from one task (where epoll exists).
        self.socket_watch: SocketWatch | None = SocketWatch() if available() else None

    @property
    def in_flight(self) -> int:
        """Requests read and not yet answered."""
        return self._in_flight

    @property
    def open_connections(self) -> int:
        """Connections being served (all of them, however they were accepted)."""
        return len(self._connections)

    @property
    def closing(self) -> bool:
        """True once :meth:`shutdown` has been called."""
        return self._closing

    @property
    def accepting(self) -> bool:
        """Whether new connections are served (False once shutdown began)."""
        return not self._closing

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one connection until it closes; always closes ``stream``. Never raises
        (except Cancelled from an enclosing scope)."""
        conn = Connection(self, stream)
        self._connections.add(conn)
        clean = False
        try:
            with conn.scope:
                if not self._closing:
                    await conn.run()
            clean = not conn.scope.cancelled_caught
        except Exception:
            logger.exception("error serving an HTTP connection")
        finally:
            try:
                await conn.close(forceful=not clean)
            finally:
                self._connections.discard(conn)
                self._closed_lot.unpark_all()

    async def serve_tcp(
        self,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (port 0 picks one) until :meth:`shutdown` completes.

        Reports the bound ``[(host, port), ...]`` through ``task_status.started``.
        With ``reuse_port`` several processes listen on the same port (SO_REUSEPORT)
        and the kernel spreads connections among them.
        """
        try:
            if reuse_port:
                listeners = [await _reuse_port_listener(host, port)]
            else:
                listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise ListenError(host, port, exc) from exc
        addresses = []
        for listener in listeners:
            name = listener.socket.getsockname()
            addresses.append((str(name[0]), int(name[1])))
        accept_scope = trio.CancelScope()
        self._accept_scopes.add(accept_scope)
        if self._closing:
            accept_scope.cancel("server shutdown")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._accept, listeners, nursery, accept_scope)
                task_status.started(addresses)
        finally:
            self._accept_scopes.discard(accept_scope)
            for listener in listeners:
                await trio.aclose_forcefully(listener)

    async def _accept(
        self,
        listeners: list[trio.SocketListener],
        nursery: trio.Nursery,
        scope: trio.CancelScope,
    ) -> None:
        with scope:
            await trio.serve_listeners(self._serve_socket, listeners, handler_nursery=nursery)

    async def _serve_socket(self, stream: trio.SocketStream) -> None:
        try:
            # Tokens are small writes that must leave at once: no Nagle delay.
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        except OSError:
            pass  # the peer is already gone; handle_connection will notice
        await self.handle_connection(stream)

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, close idle connections, let in-flight requests finish for up
        to ``grace_s`` (their responses say ``Connection: close``), then cancel them.

        Returns when every connection is closed.
        """
        self._closing = True
        for scope in list(self._accept_scopes):
            scope.cancel("server shutdown")
        for conn in list(self._connections):
            if conn.idle_scope is not None:
                conn.idle_scope.cancel("server shutdown")
        with trio.move_on_after(grace_s):
            await self._wait_closed()
        for conn in list(self._connections):
            conn.scope.cancel("server shutdown: grace period over")
        await self._wait_closed()
        # No connection left to watch: their tasks end too, and the watch's epoll set is
        # closed (a server shut down in a process that goes on leaves no descriptor).
        await self.watch_starts.aclose()
        if self.socket_watch is not None:
            await self.socket_watch.aclose()

    async def _wait_closed(self) -> None:
        while self._connections:
            await self._closed_lot.park()


async def _reuse_port_listener(host: str, port: int) -> trio.SocketListener:
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
        await sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
