"""SocketWatch: many client sockets watched for readability from one task.

A request that outlasts ``ServerLimits.disconnect_check_s`` has its client socket
watched, so that a client that goes away cancels the handler (and the engine work it
holds). A task per watched request, parked on the socket with
:func:`trio.lowlevel.wait_readable`, costs a task spawn, a cancellation (which trio
delivers by raising ``Cancelled`` through the task) and two ``epoll`` registrations
per request. Under load, when most requests outlast the check, that was the largest
per-request cost left that is not a system call of the relay itself.

A :class:`SocketWatch` keeps an ``epoll`` set of its own (Linux) holding the watched
descriptors; one trio system task waits for that set's descriptor to become readable
and calls each ready socket's callback. Watching is one ``epoll_ctl`` call, unwatching
another; nothing is spawned or cancelled per request. Callbacks run synchronously in
the watch task, so they never overlap the owner's own code between two checkpoints;
they must not block (a non-blocking read, a cancel). The set is level-triggered: a
callback that leaves its socket readable is called again, so it either reads or
unwatches. The set and its task last until :meth:`SocketWatch.aclose` (the owning
server closed its last connection) or the end of the run.

Where ``select.epoll`` does not exist, :func:`available` is False and the owner keeps
a task per watch; it does too for a socket the set cannot take (:meth:`SocketWatch.watch`
raises ``OSError``).
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable

import trio

__all__ = ["SocketWatch", "available"]

logger = logging.getLogger("narwhal.http")

_EPOLL = getattr(select, "epoll", None)
#: Readable, hung up by the peer (EPOLLRDHUP), or in error (always reported).
_EVENTS = (
    getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLPRI", 0)
)


def available() -> bool:
    """Whether this platform has ``epoll`` (else watch with a task per socket)."""
    return _EPOLL is not None


class SocketWatch:
    """Calls ``callback()`` whenever a watched descriptor is readable (see the module docstring)."""

    __slots__ = ("_callbacks", "_done", "_epoll", "_running", "_scope")

    def __init__(self) -> None:
        self._epoll: select.epoll | None = None
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._running = False
        self._scope = trio.CancelScope()
        self._done = trio.Event()

    def __len__(self) -> int:
        """Descriptors watched now."""
        return len(self._callbacks)

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` while ``fd`` is readable, until :meth:`unwatch`.

        Must be called in a trio run; ``fd`` must not be watched already.

        Raises:
            OSError: the set cannot take it (its ``epoll`` descriptor cannot be made when
                the process is out of descriptors, ``epoll_ctl`` can run out of memory or
                of ``max_user_watches``): nothing is watched, and the caller watches
                ``fd`` another way.
        """
        ep = self._epoll
        if ep is None:
            if _EPOLL is None:
                raise RuntimeError("SocketWatch needs select.epoll")
            ep = self._epoll = _EPOLL()
        ep.register(fd, _EVENTS)
        self._callbacks[fd] = callback
        if not self._running:
            self._running = True
            self._scope = trio.CancelScope()
            self._done = trio.Event()
            trio.lowlevel.spawn_system_task(self._run, name="narwhal.http.socket-watch")

    async def aclose(self) -> None:
        """Stop watching everything, close the ``epoll`` set and return once the task has
        ended (the server that owns the watch has closed every connection). A later
        :meth:`watch` starts afresh."""
        if self._running:
            self._scope.cancel()
            await self._done.wait()

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (no callback for it runs after this returns)."""
        if self._callbacks.pop(fd, None) is None:
            return
        ep = self._epoll
        if ep is not None:
            try:
                ep.unregister(fd)
            except OSError:
                pass  # closed already: the kernel dropped it from the set

    async def _run(self) -> None:
        ep = self._epoll
        assert ep is not None
        callbacks = self._callbacks
        try:
            # Parked on the set's descriptor at no cost while nothing is ready; aclose()
            # or the run's end cancels this system task.
            with self._scope:
                await self._watch(ep, callbacks)
        finally:
            self._running = False
            self._epoll = None
            callbacks.clear()
            ep.close()
            self._done.set()

    async def _watch(self, ep: select.epoll, callbacks: dict[int, Callable[[], None]]) -> None:
        while True:
            await trio.lowlevel.wait_readable(ep.fileno())
            for fd, _ in ep.poll(0, max(1, len(callbacks))):
                callback = callbacks.get(fd)
                if callback is None:
                    continue  # unwatched by an earlier callback of this batch
                try:
                    callback()
                except Exception:
                    logger.exception("a socket watch callback failed")
                    self.unwatch(fd)
