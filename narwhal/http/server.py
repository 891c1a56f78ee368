"""HTTP/1.1 server over trio streams (requests parsed by narwhal.http.parser), shared by the router and the
simulated engines.

One :class:`HTTPServer` serves any number of connections; each connection is a
keep-alive loop run by :class:`narwhal.http.connection.Connection` (limits, timeouts,
the handler and its disconnect watcher, error responses: see that module). The
request and response objects live in :mod:`narwhal.http.messages` and are
re-exported here.

Accepting (as nginx does): at ``ServerLimits.max_connections`` open connections the
server stops accepting until one closes, so further clients wait in the kernel's
listen backlog instead of taking the descriptors the open ones need (each request
opens connections to engines too). An ``accept()`` that fails because the process or
the system is out of descriptors, buffers or memory (``EMFILE``, ``ENFILE``,
``ENOBUFS``, ``ENOMEM``) pauses accepting until a connection closes or
:data:`ACCEPT_PAUSE_S` passes, without a log line per try; any other failure is
logged and retried after the same pause. Neither ends the server.
"""

from __future__ import annotations

import logging
import math
import resource
import socket
from collections.abc import Sequence
from typing import Final

import trio

from narwhal.errors import RESOURCE_ERRNOS
from narwhal.http.connection import Connection
from narwhal.http.delayed import DelayedCalls
from narwhal.http.messages import JSON_HEADERS, Handler, Request, ResponseWriter, ServerLimits
from narwhal.http.sockwatch import SocketWatch, available

__all__ = [
    "ACCEPT_PAUSE_S",
    "JSON_HEADERS",
    "HTTPServer",
    "Handler",
    "ListenError",
    "Request",
    "ResponseWriter",
    "ServerLimits",
    "default_max_connections",
]

logger = logging.getLogger("narwhal.http")

#: How long accepting pauses after ``accept()`` failed (nginx's 500 ms), unless a
#: connection closes first.
ACCEPT_PAUSE_S: Final = 0.5
#: At most one log line per this many seconds about each of: the connection limit,
#: failing accepts, sockets the socket watch cannot take (each line says how many so far).
_WARN_EVERY_S: Final = 10.0
#: Descriptors kept back from the served connections by the default limit: listeners,
#: the journal, engine metrics and KV-event sockets, the event loop's own.
_RESERVED_FDS: Final = 64
#: Descriptors one served connection may hold: its own, and a prefill and a decode
#: connection to engines while a request of it runs.
_FDS_PER_CONNECTION: Final = 3
#: The default limit where the process may open any number of descriptors.
_UNLIMITED_DEFAULT: Final = 65536


def default_max_connections() -> int:
    """The connection limit of a server whose ``ServerLimits.max_connections`` is None:
    what the process's open-file limit (the soft ``RLIMIT_NOFILE``) leaves for
    connections that each may hold three descriptors, after a reserve of 64; at least 16."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return _UNLIMITED_DEFAULT
    if soft == resource.RLIM_INFINITY or soft < 0:
        return _UNLIMITED_DEFAULT
    return min(_UNLIMITED_DEFAULT, max(16, (soft - _RESERVED_FDS) // _FDS_PER_CONNECTION))


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
        #: The most connections accepted from listeners open at once (see the module docstring).
        self.max_connections = (
            limits.max_connections if limits.max_connections is not None else default_max_connections()
        )
        self._accepted = 0  # connections accepted from listeners and not yet closed
        self._slot_freed = trio.lowlevel.ParkingLot()
        #: Times accepting paused at the connection limit, and accepts that failed.
        self.limit_reached = 0
        self.accept_failures = 0
        self.watch_failures = 0  # requests watched by a task because the socket watch failed
        self._warned: dict[str, float] = {}  # what -> when last logged
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
    def accepted_connections(self) -> int:
        """Connections accepted from listeners and not yet closed (what ``max_connections`` bounds)."""
        return self._accepted

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
        await self.serve_listeners(listeners, task_status=task_status, started=addresses)

    async def serve_listeners(
        self,
        listeners: Sequence[trio.abc.Listener[trio.abc.Stream]],
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
        started: list[tuple[str, int]] | None = None,
    ) -> None:
        """Accept connections from ``listeners`` (see the module docstring) and serve
        them until :meth:`shutdown` completes; the listeners are closed once shutdown
        stops accepting (clients still in their backlog are refused, not left waiting).

        Reports ``started`` (the bound addresses; empty by default) through ``task_status``.
        """
        accept_scope = trio.CancelScope()
        self._accept_scopes.add(accept_scope)
        if self._closing:
            accept_scope.cancel("server shutdown")
        try:
            async with trio.open_nursery() as nursery:  # the connections
                try:
                    with accept_scope:
                        async with trio.open_nursery() as accepting:
                            for listener in listeners:
                                accepting.start_soon(self._accept, listener, nursery)
                            task_status.started(started or [])
                finally:
                    for listener in listeners:
                        await trio.aclose_forcefully(listener)
        finally:
            self._accept_scopes.discard(accept_scope)

    async def _accept(self, listener: trio.abc.Listener[trio.abc.Stream], nursery: trio.Nursery) -> None:
        """Accept from ``listener`` while under the connection limit; each connection is
        served in ``nursery``."""
        while True:
            if self._accepted >= self.max_connections:
                self.limit_reached += 1
                self._warn(
                    "limit",
                    "%d connections open (the server's max_connections): new ones wait in the listen "
                    "backlog until one closes (reached %d times)",
                    self.max_connections,
                    self.limit_reached,
                )
                while self._accepted >= self.max_connections:
                    await self._slot_freed.park()
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                await self._accept_failed(exc)
                continue
            self._accepted += 1
            nursery.start_soon(self._serve_accepted, stream)

    async def _accept_failed(self, exc: OSError) -> None:
        self.accept_failures += 1
        lack = RESOURCE_ERRNOS.get(exc.errno) if exc.errno is not None else None
        if lack is not None:
            self._warn(
                "accept",
                "accept() failed: out of %s (%s); not accepting for %g s or until a connection closes "
                "(%d failed accepts so far)",
                lack,
                exc.strerror,
                ACCEPT_PAUSE_S,
                self.accept_failures,
            )
        else:
            self._warn(
                "accept", "accept() failed: %s; retrying in %g s (%d failed accepts so far)",
                exc, ACCEPT_PAUSE_S, self.accept_failures,
            )  # fmt: skip
        with trio.move_on_after(ACCEPT_PAUSE_S):
            if lack is not None:
                await self._slot_freed.park()  # a closed connection gave a descriptor back
            else:
                await trio.sleep_forever()

    def watch_failed(self, exc: OSError) -> None:
        """A request's socket could not join the socket watch (a task watches it instead)."""
        self.watch_failures += 1
        self._warn(
            "watch", "cannot watch a client socket with the others (%s): a task per request watches "
            "instead (%d so far)", exc, self.watch_failures,
        )  # fmt: skip

    def _warn(self, what: str, message: str, *args: object) -> None:
        """Log ``message`` at most once per :data:`_WARN_EVERY_S` for ``what``."""
        now = trio.current_time()
        if now - self._warned.get(what, -math.inf) >= _WARN_EVERY_S:
            self._warned[what] = now
            logger.warning(message, *args)

    async def _serve_accepted(self, stream: trio.abc.Stream) -> None:
        try:
            if isinstance(stream, trio.SocketStream):
                try:
                    # Tokens are small writes that must leave at once: no Nagle delay.
                    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
                except OSError:
                    pass  # the peer is already gone; handle_connection will notice
            await self.handle_connection(stream)
        finally:
            self._accepted -= 1
            self._slot_freed.unpark_all()

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
