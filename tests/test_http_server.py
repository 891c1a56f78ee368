"""narwhal.http.server: the HTTP/1.1 server, over in-memory streams in virtual time."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import h11
import httpx
import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings

from narwhal.errors import BadRequest, NotFound, Refused
from narwhal.http import Handler, HTTPServer, Request, ResponseWriter, ServerLimits, sockwatch

MemoryPair = trio.StapledStream[trio.testing.MemorySendStream, trio.testing.MemoryReceiveStream]

LIMITS = ServerLimits(
    max_header_bytes=1024,
    max_body_bytes=100,
    header_timeout_s=5.0,
    body_timeout_s=7.0,
    keepalive_timeout_s=11.0,
)
INTERNAL_ERROR = {"error": {"message": "internal error", "type": "internal_error", "code": None}}


# ----------------------------------------------------------------------------- helpers


async def echo(request: Request, writer: ResponseWriter) -> None:
    await writer.respond(
        200,
        [("content-type", "text/plain"), ("x-path", request.path)],
        request.method.encode() + b" " + request.target.encode() + b" " + request.body,
    )


@asynccontextmanager
async def serving(
    handler: Handler = echo, limits: ServerLimits = LIMITS
) -> AsyncIterator[tuple[HTTPServer, MemoryPair]]:
    """A server handling one in-memory connection; yields (server, client stream)."""
    server = HTTPServer(handler, limits)
    client, server_end = trio.testing.memory_stream_pair()
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, server_end)
            try:
                yield server, client
            finally:
                await client.aclose()
    assert server.open_connections == 0
    assert server.in_flight == 0


async def read_all(stream: trio.abc.ReceiveStream) -> bytes:
    """Everything until the server closes."""
    out = bytearray()
    while data := await stream.receive_some():
        out += data
    return bytes(out)


async def go_away_after(server: HTTPServer, seconds: float) -> None:
    """Serve one in-memory connection whose client sends a request and leaves ``seconds``
    later; returns when the server is done with the connection."""
    client_stream, server_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, server_stream)
        await Client(client_stream).send()
        await trio.sleep(seconds)
        await client_stream.aclose()


def statuses(raw: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"^HTTP/1\.[01] (\d{3}) ", raw, flags=re.MULTILINE)]


@attrs.define
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    chunks: list[tuple[float, bytes]]


class Client:
    """A tiny h11 client over a trio stream."""

    def __init__(self, stream: trio.abc.Stream, http_version: str = "1.1") -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)
        self.http_version = http_version

    async def send(
        self,
        method: str = "GET",
        target: str = "/",
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> None:
        await self.stream.send_all(self.encode(method, target, headers, body))

    def encode(
        self,
        method: str = "GET",
        target: str = "/",
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> bytes:
        all_headers = [("host", "test"), *headers]
        if body or method == "POST":
            all_headers.append(("content-length", str(len(body))))
        request = h11.Request(
            method=method, target=target, headers=all_headers, http_version=self.http_version
        )
        data = self.conn.send(request)
        if body:
            data += self.conn.send(h11.Data(data=body))
        data += self.conn.send(h11.EndOfMessage())
        return data

    async def event(self) -> object:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(bytes(await self.stream.receive_some()))

    async def reply(self) -> Reply:
        event = await self.event()
        while isinstance(event, h11.InformationalResponse):
            event = await self.event()
        assert isinstance(event, h11.Response), event
        status = event.status_code
        headers = {k.decode(): v.decode() for k, v in event.headers}
        chunks = []
        while True:
            event = await self.event()
            if isinstance(event, h11.EndOfMessage):
                break
            assert isinstance(event, h11.Data), event
            chunks.append((trio.current_time(), bytes(event.data)))
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return Reply(status, headers, b"".join(c for _, c in chunks), chunks)

    async def request(
        self,
        method: str = "GET",
        target: str = "/",
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> Reply:
        await self.send(method, target, headers, body)
        return await self.reply()


# -------------------------------------------------------------------- keep-alive, streaming


async def test_keepalive_serves_several_requests_on_one_connection(autojump_clock: object) -> None:
    async with serving() as (server, stream):
        client = Client(stream)
        for i in range(3):
            reply = await client.request("POST", f"/echo/{i}?q={i}", body=b"hello %d" % i)
            assert reply.status == 200
            assert reply.body == b"POST /echo/%d?q=%d hello %d" % (i, i, i)
            assert reply.headers["x-path"] == f"/echo/{i}"
            assert reply.headers["content-length"] == str(len(reply.body))
            assert reply.headers["server"] == "narwhal"
            assert reply.headers["date"].endswith(" GMT")
            assert "connection" not in reply.headers
            assert server.open_connections == 1
        await trio.testing.wait_all_tasks_blocked()
        assert server.in_flight == 0


async def test_chunked_streaming_arrives_chunk_by_chunk(autojump_clock: object) -> None:
    async def stream_three(request: Request, writer: ResponseWriter) -> None:
        await writer.start(200, [("content-type", "text/event-stream")])
        for i in range(3):
            await writer.send(b"data: %d\n\n" % i)
            await trio.sleep(1)
        await writer.end()
        assert writer.finished

    async with serving(stream_three) as (_, stream):
        t0 = trio.current_time()
        client = Client(stream)
        reply = await client.request()
        assert reply.status == 200
        assert reply.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in reply.headers
        assert [(t - t0, data) for t, data in reply.chunks] == [
            (0.0, b"data: 0\n\n"),
            (1.0, b"data: 1\n\n"),
            (2.0, b"data: 2\n\n"),
        ]
        # and the connection is still good for another request
        assert (await client.request()).status == 200


async def test_http10_client_gets_close_delimited_stream(autojump_clock: object) -> None:
    async def stream_two(request: Request, writer: ResponseWriter) -> None:
        await writer.start(200)
        await writer.send(b"one ")
        await writer.send(b"two")
        # returning without end() finishes the response

    async with serving(stream_two) as (_, stream):
        await stream.send_all(b"GET / HTTP/1.0\r\n\r\n")
        raw = await read_all(stream)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == b"one two"


async def test_head_request_gets_headers_only(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        client = Client(stream)
        reply = await client.request("HEAD", "/x")
        assert reply.status == 200
        assert reply.body == b""
        assert reply.headers["content-length"] == str(len(b"HEAD /x "))
        assert (await client.request("GET", "/y")).body == b"GET /y "


async def test_user_framing_headers_are_ignored_and_server_header_overridable(
    autojump_clock: object,
) -> None:
    async def handler(request: Request, writer: ResponseWriter) -> None:
        await writer.respond(200, [("Content-Length", "999"), ("Server", "uvicorn")], b"abc")

    async with serving(handler) as (_, stream):
        reply = await Client(stream).request()
    assert reply.headers["content-length"] == "3"
    assert reply.headers["server"] == "uvicorn"
    assert reply.body == b"abc"


# ------------------------------------------------------------------------- timeouts


async def test_slow_headers_get_408(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        t0 = trio.current_time()
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        raw = await read_all(stream)
        assert trio.current_time() - t0 == LIMITS.header_timeout_s
    assert statuses(raw) == [408]
    assert b"connection: close" in raw.lower()
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"] == {"message": "request timed out", "type": "invalid_request_error", "code": None}


async def test_slow_headers_after_idle_keepalive_get_408(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        client = Client(stream)
        assert (await client.request()).status == 200
        await trio.sleep(LIMITS.keepalive_timeout_s - 1)  # idle, but not too long
        t0 = trio.current_time()
        await stream.send_all(b"GET /slow HTTP/1.1\r\n")
        raw = await read_all(stream)
        # the header deadline starts at the first byte of the request
        assert trio.current_time() - t0 == LIMITS.header_timeout_s
    assert statuses(raw) == [408]


async def test_slow_body_gets_408(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        t0 = trio.current_time()
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
        raw = await read_all(stream)
        assert trio.current_time() - t0 == LIMITS.body_timeout_s
    assert statuses(raw) == [408]
    assert b"connection: close" in raw.lower()


async def test_idle_keepalive_connection_closes_quietly(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        client = Client(stream)
        assert (await client.request()).status == 200
        t0 = trio.current_time()
        assert await read_all(stream) == b""
        assert trio.current_time() - t0 == LIMITS.keepalive_timeout_s


# --------------------------------------------------------------------------- limits


async def test_content_length_over_limit_gets_413_at_once(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        t0 = trio.current_time()
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n")
        raw = await read_all(stream)
        assert trio.current_time() == t0
    assert statuses(raw) == [413]
    assert b"connection: close" in raw.lower()


async def test_chunked_body_over_limit_gets_413(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        await stream.send_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"32\r\n"
            + b"x" * 50
            + b"\r\n"
            + b"33\r\n"
            + b"y" * 51
            + b"\r\n"
        )
        raw = await read_all(stream)
    assert statuses(raw) == [413]


async def test_body_at_limit_is_accepted(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        reply = await Client(stream).request("POST", "/", body=b"z" * LIMITS.max_body_bytes)
    assert reply.status == 200


@pytest.mark.parametrize("split", [False, True])
async def test_oversized_head_gets_431(autojump_clock: object, split: bool) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2000 + b"\r\n\r\n"
    async with serving() as (_, stream):
        if split:
            for i in range(0, len(head), 100):
                await stream.send_all(head[i : i + 100])
        else:
            await stream.send_all(head)
        raw = await read_all(stream)
    assert statuses(raw) == [431]
    assert b"connection: close" in raw.lower()


@pytest.mark.parametrize(
    ("garbage", "problem"),
    [
        (b"\x00\x01\x02 hello\r\n\r\n", "malformed request line"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n", "malformed header field"),
        (b"GET / HTTP/1.1\r\n\r\n", "missing Host field"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", "more than one Host field"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", "invalid Content-Length"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", "invalid Content-Length"),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            "conflicting Content-Length",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "both Content-Length and Transfer-Encoding",
        ),
        (b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", "malformed header field"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n", "malformed header field"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX : y\r\n\r\n", "malformed header field"),
        (b"GET / HTTP/1.1\nHost: x\r\n\r\n", "malformed request line"),
        (b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", "malformed request line"),
        (b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n", "malformed request line"),
        (b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n", "malformed request line"),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "malformed chunk-size line",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
            "chunk data not followed by CRLF",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"1\r\na\r\n0\r\nbad trailer\r\n\r\n",
            "malformed trailer field",
        ),
    ],
)
async def test_garbage_gets_400_naming_the_problem(
    autojump_clock: object, garbage: bytes, problem: str
) -> None:
    async with serving() as (_, stream):
        await stream.send_all(garbage)
        raw = await read_all(stream)
    assert statuses(raw) == [400]
    assert b"connection: close" in raw.lower()
    error = json.loads(raw.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["message"].startswith(f"malformed HTTP request: {problem}"), error


@pytest.mark.parametrize("version", [b"2.0", b"1.2", b"0.9"])
async def test_other_http_versions_get_505(autojump_clock: object, version: bytes) -> None:
    async with serving() as (_, stream):
        await stream.send_all(b"GET / HTTP/" + version + b"\r\nHost: x\r\n\r\n")
        raw = await read_all(stream)
    assert statuses(raw) == [505]
    assert b"connection: close" in raw.lower()


async def test_repeated_transfer_encoding_gets_501(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        await stream.send_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        raw = await read_all(stream)
    assert statuses(raw) == [501]


async def test_oversized_trailers_get_431(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        await stream.send_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"
            + b"X-T: " + b"a" * 2000 + b"\r\n\r\n"
        )
        raw = await read_all(stream)
    assert statuses(raw) == [431]


async def test_chunked_body_with_extensions_and_trailers_is_read_whole(
    autojump_clock: object,
) -> None:
    """Chunk extensions and trailers are dropped; the chunks are the body, however the
    bytes are split across reads; the next request on the connection is served."""
    request = (
        b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n"
        b"3;name=value\r\nabc\r\nA \r\n0123456789\r\n0\r\nX-Checksum: 1\r\n\r\n"
        b"GET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    for size in (len(request), 1, 7):
        async with serving() as (_, stream):
            for i in range(0, len(request), size):
                await stream.send_all(request[i : i + size])
            raw = await read_all(stream)
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", raw) == [b"200", b"200"], (size, raw)
        assert b"POST /c abc0123456789" in raw and b"GET /next " in raw


async def test_header_fields_are_lowercased_and_stripped(autojump_clock: object) -> None:
    seen: list[list[tuple[str, str]]] = []

    async def record(request: Request, writer: ResponseWriter) -> None:
        seen.append(request.headers)
        await writer.respond(200, body=b"ok")

    async with serving(record) as (_, stream):
        await stream.send_all(
            b"GET / HTTP/1.1\r\nHost: x\r\nX-Mixed-Case:  \t spaced value\t \r\n"
            b"X-Empty:\r\nX-Latin: caf\xe9\r\nConnection: close\r\n\r\n"
        )
        raw = await read_all(stream)
    assert statuses(raw) == [200]
    assert seen == [
        [("host", "x"), ("x-mixed-case", "spaced value"), ("x-empty", ""), ("x-latin", "caf\xe9"),
         ("connection", "close")]
    ]


async def test_unknown_transfer_encoding_gets_501(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n")
        raw = await read_all(stream)
    assert statuses(raw) == [501]
    assert b"connection: close" in raw.lower()


# ------------------------------------------------------------ 100-continue, pipelining


async def test_expect_100_continue(autojump_clock: object) -> None:
    async with serving() as (_, stream):
        await stream.send_all(
            b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await stream.receive_some()
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        await stream.send_all(b"hello")
        data = bytearray()
        while not data.endswith(b"POST /up hello"):
            data += await stream.receive_some()
    assert statuses(bytes(data)) == [200]


async def test_expect_100_continue_with_oversized_body_gets_413_without_100(
    autojump_clock: object,
) -> None:
    async with serving() as (_, stream):
        await stream.send_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n\r\n"
        )
        raw = await read_all(stream)
    assert statuses(raw) == [413]


async def test_pipelined_requests_are_served_in_order(autojump_clock: object) -> None:
    async def slow_first(request: Request, writer: ResponseWriter) -> None:
        await trio.sleep({"/a": 3, "/b": 1, "/c": 0}[request.path])
        await echo(request, writer)

    async with serving(slow_first) as (_, stream):
        await pipeline_three(stream, pause=3.5)


async def pipeline_three(stream: trio.abc.Stream, *, pause: float) -> None:
    """/a and /b in one write, /c ``pause`` later (while /b's handler runs, so it is
    kept for later); all three answered 200, in order, then the connection closes."""
    await stream.send_all(
        b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nB"
    )
    await trio.sleep(pause)
    await stream.send_all(b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await read_all(stream)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", raw) == [b"200", b"200", b"200"]
    assert raw.index(b"GET /a ") < raw.index(b"POST /b B") < raw.index(b"GET /c ")


# ------------------------------------------------------------------- disconnects, errors


async def test_client_disconnect_mid_stream_cancels_handler(autojump_clock: object) -> None:
    seen: dict[str, object] = {}

    async def streamer(request: Request, writer: ResponseWriter) -> None:
        seen["request"] = request
        await writer.start(200)
        await writer.send(b"first")
        try:
            await trio.sleep_forever()
        finally:
            seen["cancelled_at"] = trio.current_time()
            seen["disconnected"] = request.disconnected.is_set()

    server = HTTPServer(streamer, LIMITS)
    client_stream, server_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, server_stream)
        client = Client(client_stream)
        await client.send()
        assert isinstance(await client.event(), h11.Response)
        assert isinstance(await client.event(), h11.Data)
        await trio.sleep(2)
        closed_at = trio.current_time()
        await client_stream.aclose()
    assert seen["cancelled_at"] == closed_at
    assert seen["disconnected"] is True
    assert server.open_connections == 0
    assert server.in_flight == 0


async def test_client_disconnect_before_response_sets_disconnected(autojump_clock: object) -> None:
    cancelled = trio.Event()

    async def waiter(request: Request, writer: ResponseWriter) -> None:
        try:
            await request.disconnected.wait()
            await trio.sleep_forever()  # cancelled together with the event
        finally:
            cancelled.set()

    server = HTTPServer(waiter, LIMITS)
    await go_away_after(server, 1)
    assert cancelled.is_set()
    assert server.open_connections == 0


class _WatchSpawns(trio.abc.Instrument):
    """Counts the disconnect watchers started (tasks running ``Connection.watch``)."""

    def __init__(self) -> None:
        self.count = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        if "Connection.watch" in task.name:
            self.count += 1


async def test_a_watcher_starts_only_for_a_request_that_lasts(autojump_clock: object) -> None:
    """Requests shorter than ``disconnect_check_s`` never get a watcher task."""

    async def handler(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/slow":
            await trio.sleep(LIMITS.disconnect_check_s * 4)
        await echo(request, writer)

    spawns = _WatchSpawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        async with serving(handler) as (_, stream):
            client = Client(stream)
            for _ in range(10):
                assert (await client.request(target="/quick")).status == 200
            await trio.sleep(LIMITS.disconnect_check_s * 2)  # every delayed start is due
            assert spawns.count == 0
            assert (await client.request(target="/slow")).status == 200
            assert spawns.count == 1
    finally:
        trio.lowlevel.remove_instrument(spawns)


@pytest.mark.parametrize("check_s", [0.0, 0.05])
async def test_an_early_disconnect_is_noticed_once_the_watch_starts(
    autojump_clock: object, check_s: float
) -> None:
    """A client gone before ``disconnect_check_s`` cancels the handler when the watch
    starts (at once with ``0``; a lone request's at the end of the half of it that the
    server's watch starts wait for others); one gone later, the moment it goes."""
    seen: dict[str, float] = {}

    async def waiter(request: Request, writer: ResponseWriter) -> None:
        seen["started_at"] = trio.current_time()
        try:
            await trio.sleep_forever()
        finally:
            seen["cancelled_at"] = trio.current_time()

    limits = attrs.evolve(LIMITS, disconnect_check_s=check_s)
    for gone_after in (0.01, 1.0):
        seen.clear()
        server = HTTPServer(waiter, limits)
        await go_away_after(server, gone_after)
        noticed = seen["started_at"] + max(gone_after, check_s * 1.5)
        assert seen["cancelled_at"] == pytest.approx(noticed, abs=1e-9), (check_s, gone_after)
        assert server.open_connections == 0


async def test_handler_exception_gives_generic_500_and_is_logged(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/boom":
            raise RuntimeError("secret database password hunter2")
        await echo(request, writer)

    caplog.set_level(logging.ERROR, logger="narwhal.http")
    async with serving(broken) as (_, stream):
        client = Client(stream)
        reply = await client.request("GET", "/boom")
        assert reply.status == 500
        assert json.loads(reply.body) == INTERNAL_ERROR
        assert b"hunter2" not in reply.body
        # the connection stays usable
        assert (await client.request("GET", "/ok")).status == 200
    records = [r for r in caplog.records if r.name == "narwhal.http"]
    assert len(records) == 1
    assert records[0].exc_info is not None
    assert "hunter2" in str(records[0].exc_info[1])


async def test_handler_returning_without_response_gives_500(autojump_clock: object) -> None:
    async def lazy(request: Request, writer: ResponseWriter) -> None:
        pass

    async with serving(lazy) as (_, stream):
        reply = await Client(stream).request()
    assert reply.status == 500
    assert json.loads(reply.body) == INTERNAL_ERROR


async def test_narwhal_error_gives_its_status_and_body(autojump_clock: object) -> None:
    async def picky(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/json":
            request.json()
        if request.path == "/busy":
            raise Refused("no capacity", retry_after_s=2.5)
        raise NotFound(f"no route {request.path}")

    async with serving(picky) as (_, stream):
        client = Client(stream)
        reply = await client.request("GET", "/nope")
        assert reply.status == 404
        assert json.loads(reply.body) == NotFound("no route /nope").to_body()
        reply = await client.request("POST", "/json", body=b"{not json")
        assert reply.status == 400
        assert json.loads(reply.body)["error"]["message"].startswith(
            "request body is not valid JSON"
        )
        reply = await client.request("GET", "/busy")
        assert reply.status == 503
        assert reply.headers["retry-after"] == "3"
        assert json.loads(reply.body)["error"]["type"] == "service_unavailable"


async def test_handler_misuse_of_the_writer_gives_500(autojump_clock: object) -> None:
    async def misuse(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/bad-header":
            await writer.respond(200, [("x-evil", "a\r\nset-cookie: x")], b"")
        elif request.path == "/send-first":
            await writer.send(b"x")
        elif request.path == "/twice":
            await writer.respond(200, body=b"once")
            await writer.respond(200, body=b"twice")

    async with serving(misuse) as (_, stream):
        client = Client(stream)
        for path in ("/bad-header", "/send-first"):
            reply = await client.request("GET", path)
            assert reply.status == 500
            assert json.loads(reply.body) == INTERNAL_ERROR
            assert "x-evil" not in reply.headers
        # a complete response stands; the later error is only logged
        reply = await client.request("GET", "/twice")
        assert (reply.status, reply.body) == (200, b"once")
        assert (await client.request("GET", "/send-first")).status == 500


def test_request_helpers() -> None:
    request = Request(
        "POST", "/a?b=1", "/a", "b=1", [("content-type", "application/json")], b'{"x": 1}'
    )
    assert request.header("Content-Type") == "application/json"
    assert request.header("x-missing") is None
    assert request.json() == {"x": 1}
    for body, message in [
        (b"", "request body is empty"),
        (b"\xff\xfe\x00", "not valid"),
        (b"[" * 100_000, "nested too deeply"),
    ]:
        with pytest.raises(BadRequest, match=message):
            attrs.evolve(request, body=body).json()


def test_server_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServerLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="disconnect_check_s"):
        ServerLimits(disconnect_check_s=-0.1)
    assert ServerLimits(disconnect_check_s=0).disconnect_check_s == 0


async def test_exception_group_with_one_narwhal_error_is_unwrapped(autojump_clock: object) -> None:
    async def grouped(request: Request, writer: ResponseWriter) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_raise_not_found)

    async with serving(grouped) as (_, stream):
        reply = await Client(stream).request()
    assert reply.status == 404


async def _raise_not_found() -> None:
    raise NotFound("gone")


async def test_exception_after_start_aborts_chunked_body(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    async def half(request: Request, writer: ResponseWriter) -> None:
        await writer.start(200)
        await writer.send(b"partial")
        raise RuntimeError("upstream exploded")

    caplog.set_level(logging.ERROR, logger="narwhal.http")
    async with serving(half) as (_, stream):
        client = Client(stream)
        await client.send()
        response = await client.event()
        assert isinstance(response, h11.Response) and response.status_code == 200
        data = await client.event()
        assert isinstance(data, h11.Data) and data.data == b"partial"
        raw_tail = await read_all(stream)
        assert raw_tail == b""  # no terminating 0-chunk: the body is incomplete
        client.conn.receive_data(b"")
        with pytest.raises(h11.RemoteProtocolError):
            client.conn.next_event()
    assert any("mid-response" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- shutdown


async def test_shutdown_lets_in_flight_request_finish_within_grace(autojump_clock: object) -> None:
    async def slow(request: Request, writer: ResponseWriter) -> None:
        await trio.sleep(5)
        await writer.respond(200, body=b"done")

    server = HTTPServer(slow, LIMITS)
    busy_client, busy_server = trio.testing.memory_stream_pair()
    idle_client, idle_server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, busy_server)
        nursery.start_soon(server.handle_connection, idle_server)
        client = Client(busy_client)
        await client.send()
        await trio.sleep(1)
        assert server.open_connections == 2
        assert server.in_flight == 1
        t0 = trio.current_time()
        async with trio.open_nursery() as inner:
            inner.start_soon(server.shutdown, 10.0)
            # the idle connection closes at once, quietly
            assert await read_all(idle_client) == b""
            assert trio.current_time() == t0
            reply = await client.reply()
            assert trio.current_time() - t0 == 4
            assert reply.status == 200 and reply.body == b"done"
            assert reply.headers["connection"] == "close"
            assert await read_all(busy_client) == b""
        assert trio.current_time() - t0 == 4  # shutdown returned once all were closed
        assert not server.accepting
    assert server.open_connections == 0


async def test_shutdown_cancels_stuck_request_at_grace(autojump_clock: object) -> None:
    cancelled_at: list[float] = []

    async def stuck(request: Request, writer: ResponseWriter) -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled_at.append(trio.current_time())

    server = HTTPServer(stuck, LIMITS)
    client_stream, server_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, server_stream)
        await Client(client_stream).send()
        await trio.sleep(1)
        t0 = trio.current_time()
        await server.shutdown(3.0)
        assert trio.current_time() - t0 == 3.0
        assert cancelled_at == [t0 + 3.0]
        assert await read_all(client_stream) == b""
    assert server.open_connections == 0
    assert server.in_flight == 0


async def test_connection_after_shutdown_is_closed_at_once(autojump_clock: object) -> None:
    server = HTTPServer(echo, LIMITS)
    await server.shutdown(1.0)
    client_stream, server_stream = trio.testing.memory_stream_pair()
    await server.handle_connection(server_stream)
    assert await read_all(client_stream) == b""
    assert server.open_connections == 0


# ------------------------------------------------------------------------ properties

_VALID_PREFIXES = [
    b"",
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET / HTTP/1.0\r\n",
    b"GET /",
]
_FRAGMENTS = [
    b"\r\n",
    b"\r\n\r\n",
    b"\n",
    b": ",
    b" ",
    b"Content-Length: 5\r\n",
    b"Content-Length: 99999999999\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip\r\n",
    b"Expect: 100-continue\r\n",
    b"Connection: close\r\n",
    b"5\r\nhello\r\n",
    b"0\r\n\r\n",
    b"GET / HTTP/1.1\r\n",
    b"Host: x\r\n",
    b"X-Big: " + b"a" * 1100 + b"\r\n",
]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prefix=st.sampled_from(_VALID_PREFIXES),
    tail=st.lists(st.one_of(st.binary(max_size=40), st.sampled_from(_FRAGMENTS)), max_size=12).map(
        b"".join
    ),
    splits=st.lists(st.integers(min_value=1, max_value=64), max_size=5),
)
async def test_any_bytes_parse_or_get_4xx_and_close(
    autojump_clock: object, prefix: bytes, tail: bytes, splits: list[int]
) -> None:
    data = prefix + tail

    async def fixed(request: Request, writer: ResponseWriter) -> None:
        await writer.respond(200, body=b"ok\n")

    server = HTTPServer(fixed, LIMITS)
    client_stream, server_stream = trio.testing.memory_stream_pair()
    with trio.fail_after(LIMITS.keepalive_timeout_s * 10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handle_connection, server_stream)
            packets, pos = [], 0
            for size in splits:  # arbitrary packet boundaries
                packets.append(data[pos : pos + size])
                pos += size
            packets.append(data[pos:])
            try:
                for packet in packets:
                    if packet:
                        await client_stream.send_all(packet)
            except trio.BrokenResourceError:
                pass  # the server already answered and closed
            raw = await read_all(client_stream)  # the server closes, whatever it got
            await client_stream.aclose()
    # 4xx, or 501 (a transfer-coding not implemented) or 505 (another HTTP version);
    # never a 500
    assert all(status < 500 or status in (501, 505) for status in statuses(raw)), raw
    assert server.open_connections == 0


# ---------------------------------------------------------------------- real sockets


async def test_real_socket_sets_nodelay_and_streams() -> None:
    nodelay: list[int] = []

    class ProbingServer(HTTPServer):
        async def handle_connection(self, stream: trio.abc.Stream) -> None:
            assert isinstance(stream, trio.SocketStream)
            nodelay.append(stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            await super().handle_connection(stream)

    async def tokens(request: Request, writer: ResponseWriter) -> None:
        await writer.start(200, [("content-type", "text/event-stream")])
        for i in range(3):
            await writer.send(b"data: %d\n\n" % i)
        await writer.end()

    server = ProbingServer(tokens)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            addresses = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            host, port = addresses[0]
            assert host == "127.0.0.1" and port > 0
            async with httpx.AsyncClient(trust_env=False) as client:
                async with client.stream("GET", f"http://{host}:{port}/stream") as response:
                    assert response.status_code == 200
                    assert response.headers["transfer-encoding"] == "chunked"
                    body = b"".join([chunk async for chunk in response.aiter_raw()])
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert nodelay and all(nodelay)
            await server.shutdown(5.0)
        # serve_tcp returned after shutdown (the nursery exited)
    assert server.open_connections == 0
    with pytest.raises(OSError):
        with trio.fail_after(5):
            await trio.open_tcp_stream(host, port)


async def test_real_socket_keepalive_pipelining_and_disconnect() -> None:
    """Over TCP a request's disconnect watcher parks on the socket and is released by
    its cancellation alone: the next request on the connection, pipelined or not, is
    read whole and in order, and a client that goes away still cancels its handler."""
    cancelled = trio.Event()

    async def handler(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/hang":
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()
        await trio.sleep({"/a": 0.2, "/b": 0.1}.get(request.path, 0))
        await echo(request, writer)

    server = HTTPServer(handler, LIMITS)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            (host, port), *_ = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                # Plain keep-alive: each request after the previous answer.
                for i in range(20):
                    await stream.send_all(b"GET /k%d HTTP/1.1\r\nHost: x\r\n\r\n" % i)
                    raw = b""
                    while not raw.endswith(b"GET /k%d " % i):
                        raw += await stream.receive_some()
                # Pipelined: /b arrives with /a, /c while /b's handler runs.
                await pipeline_three(stream, pause=0.25)
            # A client that goes away while its handler waits cancels the handler.
            stream = await trio.open_tcp_stream(host, port)
            await stream.send_all(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
            await trio.sleep(0.1)
            await stream.aclose()
            await cancelled.wait()
            await server.shutdown(5.0)
    assert server.open_connections == 0


async def test_real_socket_watch_is_one_task_for_every_request() -> None:
    """Over TCP the requests that outlast ``disconnect_check_s`` are watched from the
    server's one socket-watch task, not a task each: their sockets are in its set while
    they run and out of it once answered; a client that goes away cancels its handler."""
    if not sockwatch.available():
        pytest.skip("no epoll: a task per watch")
    started = trio.Semaphore(0)
    release = trio.Event()
    cancelled = trio.Event()

    async def handler(request: Request, writer: ResponseWriter) -> None:
        started.release()
        if request.path == "/hang":
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()
        await release.wait()
        await echo(request, writer)

    spawns = _WatchSpawns()
    server = HTTPServer(handler, LIMITS)
    assert server.socket_watch is not None
    trio.lowlevel.add_instrument(spawns)
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                (host, port), *_ = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
                streams = [await trio.open_tcp_stream(host, port) for _ in range(3)]
                for i, stream in enumerate(streams):
                    await stream.send_all(b"GET /s%d HTTP/1.1\r\nHost: x\r\n\r\n" % i)
                for _ in streams:
                    await started.acquire()
                await trio.sleep(LIMITS.disconnect_check_s * 4)  # every watch has started
                assert len(server.socket_watch) == 3
                release.set()
                for i, stream in enumerate(streams):
                    raw = b""
                    while not raw.endswith(b"GET /s%d " % i):
                        raw += await stream.receive_some()
                    await stream.aclose()
                assert len(server.socket_watch) == 0
                stream = await trio.open_tcp_stream(host, port)
                await stream.send_all(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
                await started.acquire()
                await trio.sleep(LIMITS.disconnect_check_s * 4)
                assert len(server.socket_watch) == 1
                await stream.aclose()
                await cancelled.wait()
                assert len(server.socket_watch) == 0
                await server.shutdown(5.0)
    finally:
        trio.lowlevel.remove_instrument(spawns)
    assert spawns.count == 0
    assert server.open_connections == 0


def _epoll_fds() -> int:
    """The process's open epoll sets (Linux: where the socket watch exists)."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd) == "anon_inode:[eventpoll]"
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return count


def _system_tasks(name: str) -> int:
    root = trio.lowlevel.current_root_task()
    return sum(t.name == name for n in root.child_nurseries for t in n.child_tasks)


async def test_shutdown_closes_the_socket_watch() -> None:
    """A server that is shut down leaves no epoll set open and no watch task running,
    in a process that goes on (one that runs servers one after another: tests, a soak)."""
    if not sockwatch.available():
        pytest.skip("no epoll: a task per watch")
    started = trio.Event()
    release = trio.Event()

    async def handler(request: Request, writer: ResponseWriter) -> None:
        started.set()
        await release.wait()
        await echo(request, writer)

    before = _epoll_fds()
    for _ in range(2):  # a second server in the same run, after the first one closed
        server = HTTPServer(handler, LIMITS)
        assert server.socket_watch is not None
        started, release = trio.Event(), trio.Event()
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                (host, port), *_ = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
                async with await trio.open_tcp_stream(host, port) as stream:
                    await stream.send_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
                    await started.wait()
                    await trio.sleep(LIMITS.disconnect_check_s * 4)
                    assert len(server.socket_watch) == 1
                    assert _epoll_fds() == before + 1
                    assert _system_tasks("narwhal.http.socket-watch") == 1
                    release.set()
                    raw = b""
                    while not raw.endswith(b"GET /slow "):
                        raw += await stream.receive_some()
                await server.shutdown(5.0)
        assert _epoll_fds() == before
        assert _system_tasks("narwhal.http.socket-watch") == 0


async def test_real_socket_watch_stops_reading_ahead_at_the_limit() -> None:
    """Pipelined bytes the watch reads while a request runs are kept for the next
    request, up to the read-ahead bound; then the socket leaves the watch (TCP pushes
    back) and the request still completes."""
    if not sockwatch.available():
        pytest.skip("no epoll: a task per watch")
    started = trio.Event()
    release = trio.Event()

    async def handler(request: Request, writer: ResponseWriter) -> None:
        if request.path == "/slow":
            started.set()
            await release.wait()
        await echo(request, writer)

    server = HTTPServer(handler, LIMITS)
    assert server.socket_watch is not None
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            (host, port), *_ = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
                await started.wait()
                await trio.sleep(LIMITS.disconnect_check_s * 4)
                assert len(server.socket_watch) == 1
                # A pipelined request, then more than the watch may read ahead.
                await stream.send_all(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
                await trio.sleep(0.1)
                assert len(server.socket_watch) == 1  # read ahead, still watching
                await stream.send_all(b"X" * (2 * 65536))
                for _ in range(200):
                    if len(server.socket_watch) == 0:
                        break
                    await trio.sleep(0.01)
                assert len(server.socket_watch) == 0
                release.set()
                raw = b""
                while b"GET /next " not in raw:
                    raw += await stream.receive_some()
                assert raw.count(b"HTTP/1.1 200 ") == 2  # /slow, then the pipelined /next
            await server.shutdown(5.0)
    assert server.open_connections == 0
