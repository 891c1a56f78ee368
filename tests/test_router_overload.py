"""The router's own resource limits (issue 38, item 8), in memory and virtual time.

- connecting to an engine fails because the router itself is out of descriptors
  (EMFILE, ENFILE), buffers, memory or local ports: that is the router's fault, a 503
  with ``Retry-After`` journaled ``router_overloaded``, never counted by a breaker and
  never retried on another engine as if the engine had failed.

The failure is injected at the socket-open seam (the engine transport's connector),
in the shape ``trio.open_tcp_stream`` raises it: one ``OSError`` caused by the group
of its attempts' errors. The real thing (a lowered ``RLIMIT_NOFILE``) runs over
loopback in test_connection_limit.py.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from narwhal.engines.wire import WireTransport

from .routerkit import Stack, engine, fleet_doc, open_stack

BODY = {"prompt": "one two three four", "max_tokens": 6}


class Starved:
    """A connector that fails as a process out of ``errno``'s resource would, for the
    hosts in ``hosts`` while ``on`` is set; any other connection goes through."""

    def __init__(self, inner: Any, code: int = errno.EMFILE) -> None:
        self.inner = inner
        self.code = code
        self.hosts: set[str] = set()
        self.attempts: list[str] = []

    async def __call__(self, host: str, port: int) -> trio.abc.Stream:
        if host in self.hosts:
            self.attempts.append(host)
            await trio.lowlevel.checkpoint()
            cause = OSError(self.code, os.strerror(self.code))
            msg = f"all attempts to connect to {host}:{port} failed"
            raise OSError(msg) from ExceptionGroup(msg, [cause])
        stream: trio.abc.Stream = await self.inner(host, port)
        return stream


def starving(code: int = errno.EMFILE) -> Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]:
    """A ``wrap`` for :func:`open_stack`: the router's engine transport over a
    :class:`Starved` connector (the router's engine clients share it)."""

    def wrap(inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        assert isinstance(inner, WireTransport)
        # No pooling: every leg opens its connection (the memory network's connector).
        return WireTransport(connect=Starved(inner._connect, code), max_idle_per_origin=0)

    return wrap


def starved_of(stack: Stack) -> Starved:
    wire = stack.router.state.clients["p0"]._wire
    assert wire is not None and isinstance(wire._connect, Starved)
    return wire._connect


def two_of_each(**sections: Any) -> dict[str, Any]:
    return fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("p1", 8103, ["prefill"]),
        engine("d0", 8102, ["decode"]), engine("d1", 8104, ["decode"]),
        recovery={"eject_after": 1, "max_attempts": 3},  # a failure counted would eject at once
        **sections,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("code", "what"),
    [
        (errno.EMFILE, "file descriptors (EMFILE)"),
        (errno.ENFILE, "file descriptors (system-wide) (ENFILE)"),
        (errno.ENOBUFS, "socket buffers (ENOBUFS)"),
        (errno.ENOMEM, "memory (ENOMEM)"),
        (errno.EADDRNOTAVAIL, "local ports (EADDRNOTAVAIL)"),
    ],
)
@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_routers_own_resource_errors_are_not_the_engines(
    autojump_clock: trio.abc.Clock, code: int, what: str, leg: str, stream: bool
) -> None:
    # Before: journaled prefill_failed / decode_failed (a 502 naming the engine
    # "unreachable"), counted by the engine's breaker (here: ejected at once), and
    # retried on the other engine of the role, which needs the same descriptors.
    async with open_stack(two_of_each(), wrap=starving(code)) as stack:
        starved = starved_of(stack)
        starved.hosts = {"p0.test", "p1.test"} if leg == "prefill" else {"d0.test", "d1.test"}
        body = {**BODY, "stream": stream}
        resp = await stack.client.post("/v1/completions", json=body)
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"] == {
            "message": f"router overloaded: out of {what}; retry later",
            "type": "service_unavailable",
            "code": None,
        }
        [record] = stack.records
        assert (record["terminal_class"], record["status"]) == ("router_overloaded", 503)
        assert len(record["attempts"]) == 1 and record["attempts"][0]["outcome"] == "router_overloaded"
        host = "p[01]" if leg == "prefill" else "d[01]"
        assert re.fullmatch(
            rf"router out of {re.escape(what)} connecting to {host}\.test:810\d: {os.strerror(code)}", record["error"]
        ), record["error"]
        assert len(starved.attempts) == 1  # no second engine tried for the router's fault
        breaker = stack.router.state.breaker
        assert breaker.transitions == []
        assert all(s.streak == 0 and not s.ejected for s in breaker.states.values())
        # The descriptors come back: the same engines serve at once.
        starved.hosts = set()
        assert (await stack.complete(BODY)).status_code == 200


async def test_counting_a_prompt_is_not_an_engines_fault_either(autojump_clock: trio.abc.Clock) -> None:
    # Exact prompt counts ask a producer's /tokenize before placement: the same rule.
    doc = two_of_each(controller={"prompt_tokens": "tokenize"})
    async with open_stack(doc, wrap=starving()) as stack:
        starved = starved_of(stack)
        starved.hosts = {"p0.test", "p1.test"}
        resp = await stack.complete(BODY)
        assert resp.status_code == 503
        [record] = stack.records
        assert record["terminal_class"] == "router_overloaded"
        assert len(starved.attempts) == 1
        assert stack.router.state.breaker.transitions == []


async def test_a_probe_that_meets_the_routers_own_resource_error_is_inconclusive(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Before: the probe counted as failed (the engine's probe streak grew, its readmission
    # waited) for descriptors the router itself lacked.
    from narwhal.router.probe import probe_engine

    async with open_stack(two_of_each(), wrap=starving()) as stack:
        state = stack.router.state
        state.breaker.record_failure("p0", "down", leg="prefill")
        assert state.breaker.states["p0"].ejected
        starved = starved_of(stack)
        starved.hosts = {"p0.test"}
        verdict = await probe_engine(state, "p0")
        last = state.breaker.transitions[-1]
        assert verdict is None, last
        assert (last.engine, last.event) == ("p0", "probe_inconclusive")
        assert (last.detail or "").startswith("router out of file descriptors (EMFILE) connecting to p0.test")
        assert state.breaker.states["p0"].ejected
        starved.hosts = set()
        assert await probe_engine(state, "p0") is True
        assert not state.breaker.states["p0"].ejected
