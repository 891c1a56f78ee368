"""A streaming client that stops reading, then hangs up (issue 38, item 12), over loopback.

The client has a 4 KiB receive buffer and stops reading a 1,500-token stream, so the
router's write to it waits on a full socket; then it hangs up. The seeds' scope rule:
the disconnect cancels the decode leg with everything else, at once.

A write waiting on a full socket is not woken by the client's FIN (only a reset wakes
it), so the disconnect watch must see it. The watch puts the socket in the server's
shared epoll set; when the set cannot take it (the process out of descriptors, the
kernel out of memory or of ``max_user_watches``) the request used to go unwatched, with
a logged traceback per request: the hang-up was then noticed only when a write failed,
never while the write waited. Now a task of its own watches such a request.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from narwhal.config import parse_fleet
from narwhal.http import HTTPServer, Request, ResponseWriter
from narwhal.http.sockwatch import SocketWatch
from narwhal.router.journal import Journal
from narwhal.router.service import Router, open_router
from narwhal.testing import SimFleet, open_sim_fleet
from narwhal.testing.ports import free_port

from .routerkit import SIM


def _engine(name: str, roles: list[str]) -> dict[str, Any]:
    port = free_port()
    return {
        "name": name, "url": f"http://127.0.0.1:{port}", "roles": roles,
        "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": free_port()},
        "sim": {**SIM, "max_model_len": 8192, "decode": {"c0": 0.001, "c1": 0.0, "c2": 0.0}},
    }  # fmt: skip


class StarvedWatch(SocketWatch):
    """A socket watch that cannot make its epoll set: the process is out of descriptors."""

    __slots__ = ()

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def _starve(server: HTTPServer) -> None:
    server.socket_watch = StarvedWatch()


@asynccontextmanager
async def loopback_router() -> AsyncIterator[
    tuple[Router, SimFleet, int, list[dict[str, Any]], dict[str, float], dict[str, trio.Event], dict[str, trio.Event]]
]:
    """Simulated engines and a router on loopback; yields the router, the fleet, the
    router's port, the journal records, by backend request id when each request ended
    on engine d0 (its connection from the router closed, or its answer done), and by
    client request id an event set when the request is journaled and one set when its
    decode leg ended on d0."""
    config = parse_fleet({
        "server": {"host": "127.0.0.1", "port": free_port(), "admin_port": 0},
        "engines": [_engine("p0", ["prefill"]), _engine("d0", ["decode"])],
    })  # fmt: skip
    records: list[dict[str, Any]] = []
    journal = Journal(None)
    journal.add_listener(records.append)
    journaled: dict[str, trio.Event] = collections.defaultdict(trio.Event)
    journal.add_listener(lambda record: journaled[record["request_id"]].set())
    ended: dict[str, float] = {}
    decoded: dict[str, trio.Event] = collections.defaultdict(trio.Event)
    async with open_sim_fleet(config, sockets=True) as fleet, open_router(config, journal=journal) as router:
        d0 = fleet.servers["d0"]
        inner = d0.handler

        async def spy(request: Request, response: ResponseWriter) -> None:
            try:
                await inner(request, response)
            finally:
                rid = request.header("x-request-id") or ""
                ended[rid] = trio.current_time()
                if rid.endswith("-d"):  # a decode leg: "<client's id>-<attempt>-<n>-d"
                    decoded[rid.rsplit("-", 3)[0]].set()

        d0.handler = spy
        async with trio.open_nursery() as nursery:
            [(_, port)] = await nursery.start(router.serve_tcp)
            yield router, fleet, port, records, ended, journaled, decoded
            nursery.cancel_scope.cancel()


async def _stop_reading(port: int, rid: str) -> trio.socket.SocketType:
    """A client with a 4 KiB receive buffer that asks for 1,500 tokens and reads only
    the start of the answer."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": "the client stops reading", "max_tokens": 1500, "stream": True}).encode()
    await sock.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (rid.encode(), len(body), body)
    )
    assert (await sock.recv(1024)).startswith(b"HTTP/1.1 200 OK")
    return sock


async def test_a_hang_up_ends_the_decode_leg_at_once_when_the_socket_watch_is_starved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: the request went unwatched (an ERROR and a traceback for it), and its
    # decode leg stayed open to the engine as long as the client's half of the
    # connection did not reset it (here: to the end of the test's 5 s).
    with trio.fail_after(60):
        async with loopback_router() as (router, _, port, records, ended, journaled, decoded):
            _starve(router.server)
            clients = [await _stop_reading(port, f"victim-{i}") for i in range(3)]
            await trio.sleep(1.0)  # the stream fills the buffers; the router's write waits
            assert router.state.in_flight == 3 and router.server.watch_failures == 3
            for i, sock in enumerate(clients):
                hung_up = trio.current_time()
                sock.shutdown(socket.SHUT_WR)  # the hang-up: a FIN, no reset
                with trio.move_on_after(5.0):
                    await journaled[f"victim-{i}"].wait()
                    await decoded[f"victim-{i}"].wait()
                assert decoded[f"victim-{i}"].is_set(), "the decode leg outlived the hang-up by 5 s"
                [decode] = [rid for rid in ended if rid.startswith(f"victim-{i}-") and rid.endswith("-d")]
                assert ended[decode] - hung_up < 1.0, "the decode leg outlived the hang-up"
                sock.close()
            assert router.state.in_flight == 0 and router.state.in_flight_by_engine["d0"] == 0
    assert [(r["terminal_class"], r["status"]) for r in records] == [("client_cancelled", 200)] * 3
    assert all(0 < r["output_len"] < 1500 for r in records)
    # One warning for the lot, no traceback per request.
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in problems] == [
        "cannot watch a client socket with the others ([Errno 24] Too many open files): a task per request "
        "watches instead (1 so far)"
    ]


async def test_a_starved_socket_watch_still_notices_a_client_that_leaves_mid_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The same at the HTTP server alone: a handler waiting for something else (not
    # writing) is cancelled when the client goes away.
    cancelled = trio.Event()

    async def wait(request: Request, writer: ResponseWriter) -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    server = HTTPServer(wait)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            [(host, port)] = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            _starve(server)
            client = trio.socket.socket()
            await client.connect((host, port))
            await client.send(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
            await trio.sleep(0.2)  # past disconnect_check_s: the watch (a task) is on
            client.shutdown(socket.SHUT_WR)
            with trio.move_on_after(3.0):
                await cancelled.wait()
            assert cancelled.is_set(), "the handler outlived the client"
            client.close()
            await server.shutdown(1.0)
    assert server.watch_failures == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
