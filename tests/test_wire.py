"""WireTransport: framing, pooling, stale connections, errors (in memory and on loopback)."""

from __future__ import annotations

import itertools
import socket

import httpx
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.engines.wire import WireTransport

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"b\r\ndata: one\n\n\r\n"
    b"b\r\ndata: two\n\n\r\n"
    b"e\r\ndata: [DONE]\n\n\r\n"
    b"0\r\n\r\n"
)
BODY = b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"


class FakeServer:
    """Answers each request on a connection with scripted raw bytes, split as told."""

    def __init__(self, answers: list[bytes], *, split: list[int] | None = None, close_after: int | None = None) -> None:
        self.answers = answers
        self.split = split or []
        self.close_after = close_after
        self.requests: list[bytes] = []
        self.connections = 0

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        self.connections += 1
        self._nursery.start_soon(self._serve, server)
        return client

    async def _serve(self, stream: trio.abc.Stream) -> None:
        try:
            await self._answer(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away

    async def _answer(self, stream: trio.abc.Stream) -> None:
        served = 0
        buf = b""
        async with stream:
            while self.answers:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some()
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                while len(buf) < length:
                    buf += await stream.receive_some()
                self.requests.append(head + b"\r\n\r\n" + buf[:length])
                buf = buf[length:]
                answer = self.answers.pop(0)
                cuts = [0, *sorted(c for c in self.split if 0 < c < len(answer)), len(answer)]
                for a, b in itertools.pairwise(cuts):
                    await stream.send_all(answer[a:b])
                    await trio.sleep(0.001)
                served += 1
                if self.close_after is not None and served >= self.close_after:
                    return


async def test_chunk_extensions_and_bursts_of_whole_chunks(autojump_clock: trio.abc.Clock) -> None:
    body = b"2;ext=1\r\nab\r\n1\r\nc\r\n3\r\ndef\r\n0\r\n\r\n"
    server = FakeServer([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body])
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        assert await _get_stream(WireTransport(connect=server.connect)) == (200, b"abcdef")


async def _get_stream(transport: WireTransport, url: str = "http://engine.test:80/v1/completions") -> tuple[int, bytes]:
    async with httpx.AsyncClient(transport=transport) as client:
        async with client.stream("POST", url, content=b'{"a":1}') as resp:
            body = b"".join([part async for part in resp.aiter_raw()])
            return resp.status_code, body


async def test_chunked_stream_and_keep_alive_reuse(autojump_clock: trio.abc.Clock) -> None:
    server = FakeServer([CHUNKED, CHUNKED, b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"])
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        transport = WireTransport(connect=server.connect)
        client = httpx.AsyncClient(transport=transport)
        for _ in range(2):
            async with client.stream("POST", "http://engine.test/v1/x", content=b"{}") as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"] == "text/event-stream"
                assert b"".join([p async for p in resp.aiter_raw()]) == BODY
        resp2 = await client.post("http://engine.test/v1/y", content=b'{"k": 2}')
        assert resp2.content == b"hello"
        assert server.connections == 1
        assert server.requests[2].startswith(b"POST /v1/y HTTP/1.1\r\nHost: engine.test:80\r\n")
        assert b"Content-Length: 8\r\n" in server.requests[2]
        await client.aclose()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(CHUNKED) - 1), max_size=12))
async def test_chunked_body_split_anywhere(split: list[int]) -> None:
    server = FakeServer([CHUNKED], split=split)
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        status, body = await _get_stream(WireTransport(connect=server.connect))
    assert (status, body) == (200, BODY)


async def test_stale_pooled_connection_is_retried_once(autojump_clock: trio.abc.Clock) -> None:
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    server = FakeServer([ok, ok], close_after=1)
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        async with httpx.AsyncClient(transport=WireTransport(connect=server.connect)) as client:
            assert (await client.get("http://e.test/a")).content == b"ok"
            await trio.sleep(0.01)  # the server closed its side meanwhile
            assert (await client.get("http://e.test/b")).content == b"ok"
    assert server.connections == 2


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", httpx.RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nab", httpx.RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", httpx.RemoteProtocolError),
        # Whole chunks back to back, the second without its CRLF after the data.
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n2\r\ncdXX0\r\n\r\n",
         httpx.RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1_0\r\nab", httpx.RemoteProtocolError),
        (b"SPDY/9 200 OK\r\n\r\n", httpx.RemoteProtocolError),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", httpx.RemoteProtocolError),
    ],
)
async def test_malformed_or_cut_responses(autojump_clock: trio.abc.Clock, answer: bytes, error: type[Exception]) -> None:
    server = FakeServer([answer], close_after=1)
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        with pytest.raises(error):
            await _get_stream(WireTransport(connect=server.connect))


async def test_close_delimited_http10_body(autojump_clock: trio.abc.Clock) -> None:
    server = FakeServer([b"HTTP/1.0 200 OK\r\n\r\nuntil close"], close_after=1)
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        assert await _get_stream(WireTransport(connect=server.connect)) == (200, b"until close")


async def test_connect_errors_are_httpx_errors(autojump_clock: trio.abc.Clock) -> None:
    async def refuse(host: str, port: int) -> trio.abc.Stream:
        raise ConnectionRefusedError("refused")

    async def hang(host: str, port: int) -> trio.abc.Stream:
        await trio.sleep_forever()
        raise AssertionError

    with pytest.raises(httpx.ConnectError):
        await _get_stream(WireTransport(connect=refuse))
    t0 = trio.current_time()
    with pytest.raises(httpx.ConnectTimeout):
        await _get_stream(WireTransport(connect=hang, connect_timeout_s=1.5))
    assert trio.current_time() - t0 == pytest.approx(1.5)


async def test_abandoned_stream_closes_the_connection(autojump_clock: trio.abc.Clock) -> None:
    server = FakeServer([CHUNKED, CHUNKED], split=[CHUNKED.index(b"b\r\ndata: two")])
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        transport = WireTransport(connect=server.connect)
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("POST", "http://e.test/x", content=b"{}") as resp:
                it = resp.stream.__aiter__()  # type: ignore[union-attr]
                assert await it.__anext__() == b"data: one\n\n"
                await it.aclose()  # type: ignore[attr-defined]  # httpx's wrapper is a generator
            assert not transport._idle.get(("http", "e.test", 80))
            assert await _get_stream(transport, "http://e.test/x") == (200, BODY)
        assert server.connections == 2


async def test_loopback_sets_nodelay_and_streams() -> None:
    from narwhal.http.server import HTTPServer, Request, ResponseWriter

    async def handler(request: Request, response: ResponseWriter) -> None:
        await response.start(200, [("content-type", "text/event-stream")])
        for part in (b"data: a\n\n", b"data: [DONE]\n\n"):
            await response.send(part)
        await response.end()

    server = HTTPServer(handler)
    seen: list[int] = []
    transport = WireTransport()
    real_connect = transport._connect

    async def spy(host: str, port: int) -> trio.abc.Stream:
        stream = await real_connect(host, port)
        seen.append(stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))  # type: ignore[attr-defined]
        return stream

    transport._connect = spy
    async with trio.open_nursery() as nursery:
        [(_host, port), *_] = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
        with trio.fail_after(10):
            status, body = await _get_stream(transport, f"http://127.0.0.1:{port}/s")
        await server.shutdown(1)
    assert (status, body) == (200, b"data: a\n\ndata: [DONE]\n\n")
    assert seen and seen[0] != 0



async def test_a_malformed_rest_of_the_body_is_closed_not_raised() -> None:
    # After [DONE] the reader only asks whether the body is complete, on its way to
    # closing: whatever is buffered must close the connection, not raise past the close.
    from narwhal.engines.wire import WireResponse, _Body, _Conn

    client, _server = trio.testing.memory_stream_pair()
    transport = WireTransport()
    conn = _Conn(client, ("http", "engine.test", 80))
    body = _Body(transport, conn, length=None, chunked=True, keep_alive=True)
    conn.buf += b"z" * 2048  # a size line that never ends
    response = WireResponse(200, "OK", {}, body)
    assert response.body_complete() is False
    await response.aclose()
    assert not any(transport._idle.values())  # closed, not pooled
    conn.buf.clear()
    body = _Body(transport, _Conn(trio.testing.memory_stream_pair()[0], conn.origin),
                 length=None, chunked=True, keep_alive=True)
    body._conn.buf += b"0\r\n\r\n"  # type: ignore[union-attr]
    assert WireResponse(200, "OK", {}, body).body_complete() is True
