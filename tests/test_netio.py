"""StreamIO: direct socket reads and writes, their waits, errors and fairness."""

from __future__ import annotations

import socket
from functools import partial

import pytest
import trio
import trio.testing

from narwhal.netio import YIELD_EVERY, StreamIO


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with listener:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listener.accept()
    assert isinstance(server, trio.SocketStream)
    return client, server


async def test_round_trip_and_end_of_stream() -> None:
    a, b = await _tcp_pair()
    io_a, io_b = StreamIO(a), StreamIO(b)
    await io_a.send_all(b"hello")
    assert await io_b.receive_some() == b"hello"
    # After a short read the next one waits for data instead of failing a read first.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(io_a.send_all, b"later")
        assert await io_b.receive_some() == b"later"
    await a.aclose()
    assert await io_b.receive_some() == b""
    await b.aclose()


async def test_a_full_buffer_waits_and_tells_the_caller() -> None:
    a, b = await _tcp_pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    io_a, io_b = StreamIO(a), StreamIO(b)
    payload = b"x" * (8 << 20)  # far more than the socket buffers hold
    waited: list[bool] = []
    received = 0

    async def read_all() -> None:
        nonlocal received
        await trio.sleep(0.05)  # let the writer fill the buffers first
        while received < len(payload):
            received += len(await io_b.receive_some())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await io_a.send_all(payload, on_wait=lambda: waited.append(True))
    assert received == len(payload)
    assert waited == [True]
    await a.aclose()
    await b.aclose()


async def test_errors_are_trios() -> None:
    a, b = await _tcp_pair()
    io_a = StreamIO(a)
    await a.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await io_a.send_all(b"x")
    with pytest.raises(trio.ClosedResourceError):
        await io_a.receive_some()
    # The peer resets the connection: a write (soon) fails as broken.
    c, d = await _tcp_pair()
    d.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    await d.aclose()
    await b.aclose()
    io_c = StreamIO(c)
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(100):
            await io_c.send_all(b"x" * 1024)
            await trio.sleep(0.01)
    await c.aclose()


async def test_closing_while_waiting_to_read_raises_closed() -> None:
    a, b = await _tcp_pair()
    io_a = StreamIO(a)
    async with trio.open_nursery() as nursery:

        async def close_soon() -> None:
            await trio.sleep(0.05)
            await a.aclose()

        nursery.start_soon(close_soon)
        with pytest.raises(trio.ClosedResourceError):
            await io_a.receive_some()
    await b.aclose()


async def test_cancellation_is_honoured_without_waiting() -> None:
    a, b = await _tcp_pair()
    io_a, io_b = StreamIO(a), StreamIO(b)
    await io_a.send_all(b"ready")
    with trio.CancelScope() as scope:
        scope.cancel()
        await io_b.receive_some()  # data is there, but the scope is cancelled
    assert scope.cancelled_caught
    with trio.CancelScope() as scope:
        scope.cancel()
        await io_a.send_all(b"x")
    assert scope.cancelled_caught
    await a.aclose()
    await b.aclose()


async def test_a_busy_stream_still_lets_other_tasks_run() -> None:
    a, b = await _tcp_pair()
    io_a, io_b = StreamIO(a), StreamIO(b)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()
        before = ticks
        for _ in range(YIELD_EVERY * 4):
            await io_a.send_all(b"x")  # each completes at once: no wait
        assert ticks > before  # yet the writer yielded along the way
        nursery.cancel_scope.cancel()
    received = b""
    while len(received) < YIELD_EVERY * 4:
        received += await io_b.receive_some()
    assert received == b"x" * YIELD_EVERY * 4
    await a.aclose()
    await b.aclose()


async def test_other_streams_use_their_own_methods() -> None:
    left, right = trio.testing.memory_stream_pair()
    io_left, io_right = StreamIO(left), StreamIO(right)
    waited: list[bool] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(io_left.send_all, b"memory", on_wait=lambda: waited.append(True)))
        assert await io_right.receive_some() == b"memory"
    assert waited == [True]  # no fast path: the caller hears of every write as a wait
