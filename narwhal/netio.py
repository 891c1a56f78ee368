"""Socket I/O for the per-token path, without a scheduler pass per call.

Every ``await stream.send_all(...)`` or ``await stream.receive_some(...)`` on a
``trio.SocketStream`` yields to the scheduler even when the system call completes at
once: a full pass of trio's run loop (an ``epoll_wait`` included) that costs several
times the system call itself. A router forwards each token with one read from the
engine and one write to the client, so those passes were most of its per-token cost.

:class:`StreamIO` wraps a stream and, for a TCP (or Unix) socket stream, calls
``os.read``/``os.write`` on its descriptor first:

- a write that the kernel takes whole returns without yielding; a partial write or a
  full buffer finishes through trio's own ``send_all`` (which waits for writability),
  or, with a bound on how long the peer may read nothing (``wait_s``), by waiting for
  writability here, each wait bounded (:class:`trio.TooSlowError` when one expires);
- a read that finds data returns it without yielding; an empty buffer waits with
  :func:`trio.lowlevel.wait_readable`.

Cancellation is still honoured at every call (:func:`trio.lowlevel.checkpoint_if_cancelled`
raises ``Cancelled`` in a cancelled scope without yielding otherwise), and a stream
whose calls keep completing at once yields every :data:`YIELD_EVERY` calls, so a task
fed by a fast peer cannot starve the others. Errors are trio's:
:class:`trio.BrokenResourceError` for a reset or closed peer,
:class:`trio.ClosedResourceError` for a stream closed locally.

Any other stream (an in-memory stream in tests, TLS) is used through its own methods.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable
from typing import Final

import trio

__all__ = ["YIELD_EVERY", "StreamIO"]

#: Calls that complete without waiting before one yields to the scheduler anyway.
YIELD_EVERY: Final = 16
_CLOSED_ERRNOS: Final = frozenset({errno.EBADF, errno.ENOTSOCK})


class StreamIO:
    """Checkpoint-light ``send_all`` / ``receive_some`` over a trio stream.

    Args:
        stream: the stream; a :class:`trio.SocketStream` takes the fast path.

    Attributes:
        stream: the wrapped stream (closing it is the owner's business).
    """

    __slots__ = ("_drained", "_socket", "_unyielded", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._socket: trio.socket.SocketType | None = (
            stream.socket if type(stream) is trio.SocketStream else None
        )
        self._unyielded = 0
        # The last read took less than asked, so the kernel's buffer was empty then:
        # the next read waits for readability first instead of failing a system call.
        self._drained = False

    @property
    def socket(self) -> trio.socket.SocketType | None:
        """The socket of the fast path (None for any other stream)."""
        return self._socket

    def readable(self) -> None:
        """Note that the socket was just reported readable (the caller waited on it with
        :func:`trio.lowlevel.wait_readable`): the next read need not wait again."""
        self._drained = False

    async def send_all(
        self,
        data: bytes | bytearray | memoryview,
        *,
        on_wait: Callable[[], None] | None = None,
        wait_s: float = math.inf,
    ) -> None:
        """Write all of ``data`` (see the module docstring).

        Args:
            on_wait: called before the write waits for the peer to read (a full socket
                buffer, or any write on a stream without the fast path), so a caller can
                tell the peer's backpressure from its own deadlines.
            wait_s: the longest the write may wait with the peer reading nothing: on a
                socket, any bytes the kernel takes start the bound again; on any other
                stream it bounds the whole write.

        Raises:
            trio.TooSlowError: the peer read nothing for ``wait_s``; part of ``data``
                may have been sent, so the stream is unusable.
        """
        sock = self._socket
        if sock is None or sock.did_shutdown_SHUT_WR:
            if on_wait is not None:
                on_wait()
            if wait_s == math.inf:
                await self.stream.send_all(data)
                return
            with trio.move_on_after(wait_s) as scope:
                await self.stream.send_all(data)
            if scope.cancelled_caught:
                raise trio.TooSlowError(f"the peer read nothing for {wait_s:g} s")
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        sent = _write(sock, data) if data else 0
        if sent == len(data):
            await self._tick()
            return
        # The kernel's buffer is full: wait for it to drain.
        self._unyielded = 0
        if on_wait is not None:
            on_wait()
        if wait_s == math.inf:
            await self.stream.send_all(memoryview(data)[sent:])
        else:
            await self._send_rest(sock, memoryview(data)[sent:], wait_s)

    async def _send_rest(self, sock: trio.socket.SocketType, rest: memoryview, wait_s: float) -> None:
        """Write ``rest`` as the socket drains, each wait for writability bounded by ``wait_s``."""
        while rest:
            with trio.move_on_after(wait_s) as scope:
                try:
                    await trio.lowlevel.wait_writable(sock)
                except trio.ClosedResourceError:
                    raise trio.ClosedResourceError("the connection was closed while writing") from None
            if scope.cancelled_caught:
                raise trio.TooSlowError(f"the peer read nothing for {wait_s:g} s")
            rest = rest[_write(sock, rest) :]

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        """Up to ``max_bytes`` bytes; ``b""`` at end of stream."""
        sock = self._socket
        if sock is None:
            return bytes(await self.stream.receive_some(max_bytes))
        if self._drained:
            self._drained = False
            await self._wait_readable(sock)
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the connection was already closed")
            try:
                data = os.read(fd, max_bytes)
            except BlockingIOError:
                await self._wait_readable(sock)
                continue
            except OSError as exc:
                raise _translate(exc) from exc
            self._drained = 0 < len(data) < max_bytes
            await self._tick()
            return data

    async def _wait_readable(self, sock: trio.socket.SocketType) -> None:
        self._unyielded = 0
        try:
            await trio.lowlevel.wait_readable(sock)
        except trio.ClosedResourceError:
            raise trio.ClosedResourceError("the connection was closed while reading") from None

    async def _tick(self) -> None:
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:
            self._unyielded = 0
            await trio.lowlevel.cancel_shielded_checkpoint()


def _write(sock: trio.socket.SocketType, data: bytes | bytearray | memoryview) -> int:
    """One non-blocking write of ``data`` to ``sock``: the bytes the kernel took (0 when
    its buffer is full)."""
    fd = sock.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("the connection was already closed")
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise _translate(exc) from exc


def _translate(exc: OSError) -> trio.BrokenResourceError | trio.ClosedResourceError:
    if exc.errno in _CLOSED_ERRNOS:
        return trio.ClosedResourceError("the connection was already closed")
    return trio.BrokenResourceError(f"socket connection broken: {exc}")
