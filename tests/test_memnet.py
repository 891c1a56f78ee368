"""narwhal.testing.memnet: httpx reaching HTTPServers in memory, in virtual time."""

from __future__ import annotations

import httpcore
import httpx
import pytest
import trio

from narwhal.http import HTTPServer, Request, ResponseWriter, ServerLimits
from narwhal.testing.memnet import MemoryNetwork, open_memory_network

LIMITS = ServerLimits(keepalive_timeout_s=30.0)


class CountingServer(HTTPServer):
    """Counts the connections it was handed."""

    accepted = 0

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        self.accepted += 1
        await super().handle_connection(stream)


async def hello(request: Request, writer: ResponseWriter) -> None:
    await writer.respond(200, [("content-type", "text/plain")], b"hello " + request.path.encode())


async def test_httpx_reaches_server_and_reuses_one_connection(autojump_clock: object) -> None:
    server = CountingServer(hello, LIMITS)
    async with open_memory_network() as net:
        net.listen("engine.test", 8100, server)
        async with httpx.AsyncClient(transport=net.transport()) as client:
            for i in range(4):
                response = await client.get(f"http://engine.test:8100/r{i}")
                assert response.status_code == 200
                assert response.text == f"hello /r{i}"
                assert response.headers["server"] == "narwhal"
            assert server.accepted == 1
            assert net.open_connections == 1
        await trio.testing.wait_all_tasks_blocked()
        assert net.open_connections == 0
        assert server.open_connections == 0


async def test_streamed_response_arrives_chunk_by_chunk(autojump_clock: object) -> None:
    async def tokens(request: Request, writer: ResponseWriter) -> None:
        await writer.start(200, [("content-type", "text/event-stream")])
        for i in range(3):
            await trio.sleep(0.5)
            await writer.send(b"data: %d\n\n" % i)
        await writer.end()

    async with open_memory_network() as net:
        net.listen("127.0.0.1", 9000, HTTPServer(tokens, LIMITS))
        async with httpx.AsyncClient(transport=net.transport()) as client:
            t0 = trio.current_time()
            arrivals = []
            async with client.stream(
                "POST", "http://localhost:9000/v1/completions", json={}
            ) as response:
                assert response.headers["transfer-encoding"] == "chunked"
                async for chunk in response.aiter_raw():
                    arrivals.append((trio.current_time() - t0, chunk))
        assert arrivals == [(0.5, b"data: 0\n\n"), (1.0, b"data: 1\n\n"), (1.5, b"data: 2\n\n")]
        await trio.testing.wait_all_tasks_blocked()
        assert net.open_connections == 0


async def test_refused_addresses_raise_connect_error(autojump_clock: object) -> None:
    server = HTTPServer(hello, LIMITS)
    async with open_memory_network() as net:
        net.listen("10.0.0.1", 80, server)
        async with httpx.AsyncClient(transport=net.transport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get("http://10.0.0.2:80/")  # nobody there
            with pytest.raises(httpx.ConnectError):
                await client.get("http://10.0.0.1:81/")  # wrong port
            net.set_refusing("10.0.0.1", 80, True)
            with pytest.raises(httpx.ConnectError):
                await client.get("http://10.0.0.1/")
            net.set_refusing("10.0.0.1", 80, False)
            assert (await client.get("http://10.0.0.1/")).status_code == 200
            net.unlisten("10.0.0.1", 80)
            # the pooled connection outlives the listener, as over TCP
            assert (await client.get("http://10.0.0.1/")).status_code == 200
        async with httpx.AsyncClient(transport=net.transport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get("http://10.0.0.1/")
        with pytest.raises(httpcore.ConnectError):
            await net.connect("10.0.0.1", 80)
        await trio.testing.wait_all_tasks_blocked()
        assert net.open_connections == 0


async def test_shut_down_server_refuses_connections(autojump_clock: object) -> None:
    server = HTTPServer(hello, LIMITS)
    async with open_memory_network() as net:
        net.listen("a.test", 1, server)
        await server.shutdown(1.0)
        with pytest.raises(httpcore.ConnectError):
            await net.connect("a.test", 1)


async def test_listen_twice_is_address_in_use(autojump_clock: object) -> None:
    async with open_memory_network() as net:
        net.listen("a.test", 1, HTTPServer(hello))
        with pytest.raises(OSError):
            net.listen("A.test", 1, HTTPServer(hello))
        assert net.server_at("a.test", 1) is not None
        assert net.server_at("a.test", 2) is None


async def test_abort_all_breaks_a_stream_mid_body(autojump_clock: object) -> None:
    handler_saw: dict[str, object] = {}

    async def endless(request: Request, writer: ResponseWriter) -> None:
        await writer.start(200)
        await writer.send(b"first")
        try:
            await trio.sleep_forever()
        finally:
            handler_saw["disconnected"] = request.disconnected.is_set()
            handler_saw["at"] = trio.current_time()

    server = HTTPServer(endless, LIMITS)
    async with open_memory_network() as net:
        net.listen("engine.test", 8200, server)
        async with httpx.AsyncClient(transport=net.transport()) as client:
            async with client.stream("GET", "http://engine.test:8200/") as response:
                chunks = response.aiter_raw()
                assert await chunks.__anext__() == b"first"
                await trio.sleep(1)
                aborted_at = trio.current_time()
                net.abort_all("engine.test", 8200)
                with pytest.raises(httpx.ReadError):
                    await chunks.__anext__()
        await trio.testing.wait_all_tasks_blocked()
        assert handler_saw == {"disconnected": True, "at": aborted_at}
        assert net.open_connections == 0
        assert server.open_connections == 0


async def test_server_closing_idle_connection_is_noticed_by_pool(autojump_clock: object) -> None:
    server = CountingServer(hello, LIMITS)
    async with open_memory_network() as net:
        net.listen("engine.test", 8300, server)
        async with httpx.AsyncClient(transport=net.transport()) as client:
            assert (await client.get("http://engine.test:8300/a")).status_code == 200
            await trio.sleep(
                LIMITS.keepalive_timeout_s + 1
            )  # the server closes the idle connection
            # the pool sees the connection readable (EOF) and dials a new one
            assert (await client.get("http://engine.test:8300/b")).status_code == 200
            assert server.accepted == 2
        await trio.testing.wait_all_tasks_blocked()
        assert net.open_connections == 0


async def test_raw_connect_speaks_http(autojump_clock: object) -> None:
    async with open_memory_network() as net:
        net.listen("engine.test", 1, HTTPServer(hello, LIMITS))
        stream = await net.connect("engine.test", 1)
        await stream.send_all(b"GET /raw HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = bytearray()
        while data := await stream.receive_some():
            raw += data
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        assert raw.endswith(b"hello /raw")
        assert net.open_connections == 1  # our end is still open
        await stream.aclose()
        assert net.open_connections == 0
        with pytest.raises(trio.ClosedResourceError):
            await stream.send_all(b"x")


async def test_writes_after_abort_fail_like_a_reset(autojump_clock: object) -> None:
    async with open_memory_network() as net:
        net.listen("engine.test", 1, HTTPServer(hello, LIMITS))
        stream = await net.connect("engine.test", 1)
        net.abort_all("engine.test", 1)
        with pytest.raises(trio.BrokenResourceError):
            await stream.send_all(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(trio.BrokenResourceError):
            await stream.receive_some()
        await stream.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert net.open_connections == 0


async def test_network_constructed_on_a_caller_nursery(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        net = MemoryNetwork(nursery)
        net.listen("x.test", 5, HTTPServer(hello, LIMITS))
        async with httpx.AsyncClient(transport=net.transport()) as client:
            assert (await client.get("http://x.test:5/")).text == "hello /"
    assert net.open_connections == 0
