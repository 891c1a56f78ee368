"""ZeroMQ sockets driven from Trio, without a thread.

pyzmq has no Trio integration, but every ZeroMQ socket exposes a file descriptor
(``ZMQ_FD``) that Trio can wait on. That descriptor is *edge-triggered* and says only
that the socket's state may have changed: the truth is ``ZMQ_EVENTS``, and reading
``ZMQ_EVENTS`` re-arms the descriptor. So a receive asks ``ZMQ_EVENTS`` first (cheaper
than a non-blocking read that fails: pyzmq raises ``zmq.Again`` for it), reads when
a message is there and otherwise waits on the descriptor. Sends here never wait: the
sockets used (PUB, ROUTER, DEALER) queue or drop at their high-water mark.

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
    """The next message of ``sock``, waiting on Trio for it to arrive.

    A checkpoint either way: the wait for a message that had not arrived is one (and
    the cancellation point), and a message that was already there is taken, then the
    task yields without being cancellable (a message taken off the socket must reach
    the caller).
    """
    waited = False
    while True:
        if _int_option(sock, zmq.EVENTS) & zmq.POLLIN:
            try:
                frames: list[bytes] = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # (another reader took it: wait like anyone)
                pass
            else:
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return frames
        await trio.lowlevel.wait_readable(_int_option(sock, zmq.FD))
        waited = True


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
