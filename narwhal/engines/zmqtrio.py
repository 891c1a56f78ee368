"""ZeroMQ sockets driven from Trio, without a thread.

pyzmq has no Trio integration, but every ZeroMQ socket exposes a file descriptor
(``ZMQ_FD``) that Trio can wait on. That descriptor is *edge-triggered* and says only
that the socket's state may have changed: the truth is ``ZMQ_EVENTS``, and reading
``ZMQ_EVENTS`` re-arms the descriptor. So a receive tries a non-blocking read first,
then checks ``ZMQ_EVENTS`` (another operation on the socket may have consumed the
edge) and only then waits on the descriptor. Sends here never wait: the sockets used
(PUB, ROUTER, DEALER) queue or drop at their high-water mark.

One task at a time may receive on a socket (Trio allows one waiter per descriptor).
"""

from __future__ import annotations

import trio
import zmq

__all__ = ["close_socket", "recv_multipart", "send_multipart"]


def _int_option(sock: zmq.Socket[bytes], option: int) -> int:
    value = sock.getsockopt(option)
    assert isinstance(value, int)
    return value


async def recv_multipart(sock: zmq.Socket[bytes]) -> list[bytes]:
    """The next message of ``sock``, waiting on Trio for it to arrive."""
    fd = _int_option(sock, zmq.FD)
    while True:
        try:
            frames: list[bytes] = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        else:
            # Not cancellable: a message taken off the socket must reach the caller.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return frames
        if _int_option(sock, zmq.EVENTS) & zmq.POLLIN:
            continue
        await trio.lowlevel.wait_readable(fd)


def send_multipart(sock: zmq.Socket[bytes], frames: list[bytes]) -> bool:
    """Send ``frames`` without waiting; False when the socket would have blocked."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def close_socket(sock: zmq.Socket[bytes]) -> None:
    """Close ``sock``, first waking any Trio task waiting on its descriptor."""
    if sock.closed:
        return
    trio.lowlevel.notify_closing(_int_option(sock, zmq.FD))
    sock.close(linger=0)
