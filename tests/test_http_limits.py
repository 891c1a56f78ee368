"""What a client cannot take from narwhal.http's server (issue 38, item 8): more
connections than ``max_connections``, an accept loop that spins or dies on EMFILE,
a write that waits forever on a client that stopped reading (``send_timeout_s``).

Accepting is tested with a listener of our own in virtual time, the send timeout
over lock-step in-memory streams (a write waits until the client reads it) in
virtual time and over loopback sockets (the socket path counts any progress).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
from collections import deque

import pytest
import trio
import trio.testing

from narwhal.http import HTTPServer, Request, ResponseWriter, ServerLimits
from narwhal.http.server import ACCEPT_PAUSE_S, default_max_connections

REQUEST = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"
CLOSE = b"GET /x HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"


async def hello(request: Request, writer: ResponseWriter) -> None:
    await writer.respond(200, [("content-type", "text/plain")], b"hello")


class Listener(trio.abc.Listener[trio.abc.Stream]):
    """Connections the test hands in (:meth:`connect`), and errors it makes ``accept`` raise."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[trio.abc.Stream](math.inf)
        self.errors: deque[OSError] = deque()
        self.accepts = 0  # accept() calls

    def connect(self) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        self._send.send_nowait(server)
        return client

    @property
    def backlog(self) -> int:
        """Connections not accepted yet."""
        return self._receive.statistics().current_buffer_used

    async def accept(self) -> trio.abc.Stream:
        self.accepts += 1
        await trio.lowlevel.checkpoint()
        if self.errors:
            raise self.errors.popleft()
        return await self._receive.receive()

    async def aclose(self) -> None:
        self._receive.close()
        await trio.lowlevel.checkpoint()


async def exchange(client: trio.abc.Stream, request: bytes = REQUEST) -> bytes:
    await client.send_all(request)
    data = b""
    while not data.endswith(b"hello"):
        more = await client.receive_some()
        assert more, data
        data += more
    return data


async def test_at_the_limit_the_server_stops_accepting_until_a_connection_closes(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: no limit (every connection was accepted while descriptors lasted).
    server = HTTPServer(hello, ServerLimits(max_connections=2))
    listener = Listener()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve_listeners, [listener])
        first, second, third = listener.connect(), listener.connect(), listener.connect()
        await trio.testing.wait_all_tasks_blocked()
        assert server.accepted_connections == 2 and listener.backlog == 1
        assert await exchange(first) and await exchange(second)  # idle keep-alive: still open
        await trio.sleep(5.0)
        assert listener.backlog == 1 and server.limit_reached == 1
        await first.aclose()  # a slot frees: the third is accepted at once
        await trio.testing.wait_all_tasks_blocked()
        assert listener.backlog == 0 and server.accepted_connections == 2
        assert await exchange(third, CLOSE)
        await trio.testing.wait_all_tasks_blocked()
        assert server.accepted_connections == 1
        await second.aclose()
        await server.shutdown(1.0)
    assert server.accepted_connections == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "2 connections open (the server's max_connections): new ones wait in the listen backlog "
        "until one closes (reached 1 times)"
    ]


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM])
async def test_accept_out_of_descriptors_pauses_without_spinning_or_dying(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    # Before (trio.serve_listeners): a retry every 0.1 s, each with an ERROR and its
    # traceback in the log.
    server = HTTPServer(hello, ServerLimits(max_connections=100))
    listener = Listener()
    listener.errors.extend(OSError(code, os.strerror(code)) for _ in range(1000))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve_listeners, [listener])
        await trio.sleep(20.0 - 1e-9)
        # One try per pause (nginx's 500 ms), one log line per 10 s.
        assert listener.accepts == 40 == server.accept_failures
        assert len(caplog.records) == 2
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records)
        assert "accept() failed: out of " in caplog.records[0].getMessage()
        listener.errors.clear()
        await trio.sleep(ACCEPT_PAUSE_S)
        assert await exchange(listener.connect(), CLOSE)  # still serving
        await server.shutdown(1.0)


async def test_a_closed_connection_ends_the_pause_at_once(autojump_clock: trio.abc.Clock) -> None:
    server = HTTPServer(hello, ServerLimits(max_connections=100))
    listener = Listener()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve_listeners, [listener])
        held = listener.connect()
        await exchange(held)
        listener.errors.append(OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
        waiting = listener.connect()
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        await held.aclose()  # its descriptor is free again
        assert await exchange(waiting, CLOSE)
        assert trio.current_time() - t0 < ACCEPT_PAUSE_S
        await server.shutdown(1.0)


async def test_any_other_accept_error_is_logged_and_retried(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: any accept error outside trio's short lists ended the server's task.
    server = HTTPServer(hello)
    listener = Listener()
    listener.errors.append(OSError(errno.EINVAL, "Invalid argument"))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve_listeners, [listener])
        assert await exchange(listener.connect(), CLOSE)
        assert trio.current_time() == pytest.approx(ACCEPT_PAUSE_S)
        assert [r.getMessage() for r in caplog.records] == [
            "accept() failed: [Errno 22] Invalid argument; retrying in 0.5 s (1 failed accepts so far)"
        ]
        await server.shutdown(1.0)


def test_the_default_limit_leaves_descriptors_for_the_engine_legs(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    for soft, limit in ((1024, 320), (256, 64), (70, 16), (1 << 20, 65536), (resource.RLIM_INFINITY, 65536)):
        monkeypatch.setattr(resource, "getrlimit", lambda _, soft=soft: (soft, resource.RLIM_INFINITY))
        assert default_max_connections() == limit
        assert HTTPServer(hello).max_connections == limit
    assert HTTPServer(hello, ServerLimits(max_connections=7)).max_connections == 7
    with pytest.raises(ValueError, match="max_connections must be > 0"):
        ServerLimits(max_connections=0)
    with pytest.raises(ValueError, match="send_timeout_s must be > 0"):
        ServerLimits(send_timeout_s=0)


# ------------------------------------------------------------------ send timeout


class Streamer:
    """A handler streaming chunks until cancelled; notes how it ended."""

    def __init__(self, size: int = 100) -> None:
        self.size = size
        self.request: Request | None = None
        self.ended_at: float | None = None
        self.ended = trio.Event()
        self.chunks = 0

    async def __call__(self, request: Request, writer: ResponseWriter) -> None:
        self.request = request
        try:
            await writer.start(200, [("content-type", "text/event-stream")], b"x" * self.size)
            while True:
                await writer.send(b"x" * self.size)
                self.chunks += 1
                await trio.sleep(0.01)
        finally:
            self.ended_at = trio.current_time()
            self.ended.set()


@pytest.mark.parametrize("limit", [2.0, 60.0])
async def test_a_client_that_stops_reading_is_gone_after_the_send_timeout(
    autojump_clock: trio.abc.Clock, limit: float
) -> None:
    # Before: the write waited for as long as the client kept the connection open.
    handler = Streamer()
    server = HTTPServer(handler, ServerLimits(send_timeout_s=limit))
    client, server_end = trio.testing.lockstep_stream_pair()  # a write waits for the read
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, server_end)
        await client.send_all(REQUEST)
        head = await client.receive_some(1 << 16)
        assert head.startswith(b"HTTP/1.1 200 OK")
        for _ in range(3):  # reading a little keeps it going
            await trio.sleep(limit * 0.9)
            assert await client.receive_some(1 << 16)
        stopped = trio.current_time()  # ... and then it reads no more
        await handler.ended.wait()
        assert handler.ended_at == pytest.approx(stopped + 0.01 + limit)
        assert handler.request is not None and handler.request.disconnected.is_set()
        assert handler.request.disconnect_reason == f"client read nothing for {limit:g} s (send timeout)"
    assert server.open_connections == 0 and server.in_flight == 0
    await client.aclose()


async def test_a_loopback_client_that_stops_reading_is_gone_after_the_send_timeout() -> None:
    # The socket path: the timeout bounds each wait for the client to read (a client
    # that reads slowly is not cut), and it closes the connection.
    handler = Streamer(16384)
    server = HTTPServer(handler, ServerLimits(send_timeout_s=0.5, max_connections=4))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            [(host, port)] = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            client = trio.socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await client.connect((host, port))
            await client.send(REQUEST)
            got = 0
            t0 = trio.current_time()
            while trio.current_time() - t0 < 1.5:  # slowly, for three times the timeout
                got += len(await client.recv(1 << 16))
                await trio.sleep(0.05)
            assert handler.ended_at is None  # never cut while the client reads
            stopped = trio.current_time()
            await handler.ended.wait()
            assert handler.ended_at is not None
            # 0.5 s after the write's last progress (at most the client's last read).
            assert 0 < handler.ended_at - stopped < 2.0
            assert handler.request is not None
            assert handler.request.disconnect_reason == "client read nothing for 0.5 s (send timeout)"
            # The server closed the connection: the client reads what was sent, then the end.
            try:
                while await client.recv(1 << 16):
                    pass
            except ConnectionResetError:
                pass  # closed with bytes unsent: a reset
            client.close()
            await server.shutdown(1.0)
