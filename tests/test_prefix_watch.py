"""The router's prefix watch on its own: engines the fleet gains at run time are
followed (their KV events and cache configuration), engines it loses are let go."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from narwhal.config import parse_fleet
from narwhal.router.prefixwatch import PrefixWatch
from narwhal.testing.ports import free_port

from .routerkit import engine, fleet_doc, open_stack
from .test_kvevents import live_tasks, until
from .test_router_state import open_state

CACHING = {"prefix_caching": True, "block_size": 16}


def followers() -> list[trio.lowlevel.Task]:
    """The tasks that run an engine's KV-event subscriber."""
    return [t for t in live_tasks("PrefixWatch") if t.name.endswith(".<locals>.follow")]


async def test_an_engine_added_at_run_time_is_followed_and_one_removed_is_let_go(caplog: pytest.LogCaptureFixture) -> None:
    # Real clock: KV events arrive over loopback ZeroMQ.
    def kv() -> dict[str, str]:
        return {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}

    doc = fleet_doc(
        {**engine("p0", 8101, ["prefill"], **CACHING), "kv_events": kv()},
        {**engine("p1", 8102, ["prefill"], **CACHING), "kv_events": kv()},
        engine("d0", 8103, ["decode"]),
    )
    p1 = next(e for e in parse_fleet(doc).engines if e.name == "p1")
    caplog.set_level(logging.INFO, logger="narwhal.router.prefix")
    with trio.fail_after(30):
        async with open_state(doc) as (state, fleet, _):
            state.placement.set_roles(["p0"], ["d0"])
            await state.forget_engine("p1")  # p1 joins later
            watch = PrefixWatch(state)
            index = state.prefix
            await watch.add("p1")  # before the watch runs: nothing to follow with
            assert not state.kv_subscribers and not index.views
            async with trio.open_nursery() as nursery:
                await nursery.start(watch.run)
                assert set(state.kv_subscribers) == {"p0"} and len(followers()) == 1
                assert index.exact("p0") and not index.enabled("p1")

                state.add_engine(p1)
                await watch.add("p1")
                assert set(state.kv_subscribers) == {"p0", "p1"} and len(followers()) == 2
                assert index.exact("p1") and index.enabled("p1")
                assert index.view("p1").block_size == 16  # type: ignore[union-attr]
                subscriber = state.kv_subscribers["p1"]
                await watch.add("p1")  # already followed: the same subscriber
                assert state.kv_subscribers["p1"] is subscriber and len(followers()) == 2

                watch.remove("p1")
                await state.forget_engine("p1")
                assert set(state.kv_subscribers) == {"p0"} and not index.enabled("p1")
                await until(lambda: len(followers()) == 1)  # its subscriber's task ended
                watch.remove("p1")  # twice, or an engine never followed: no error
                watch.remove("nobody")

                # Back, restarted meanwhile: a new engine to the watch, not a new generation.
                await fleet["p1"].restart()
                caplog.clear()
                state.add_engine(p1)
                await watch.add("p1")
                assert index.exact("p1") and len(followers()) == 2
                assert not [r for r in caplog.records if "new generation" in r.getMessage()]
                nursery.cancel_scope.cancel()
        assert not state.kv_subscribers and not followers()


async def test_an_idle_engine_is_read_ever_less_often_and_a_request_brings_it_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    reads: dict[str, list[float]] = {"p0": [], "d0": []}

    def counting(inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        class Counting(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                if request.url.path == "/metrics":
                    reads[request.url.host.removesuffix(".test")].append(trio.current_time())
                return await inner.handle_async_request(request)

        return Counting()

    doc = fleet_doc(engine("p0", 8101, ["prefill"], **CACHING), engine("d0", 8102, ["decode"], **CACHING))
    async with open_stack(doc, wrap=counting) as stack:
        start = reads["p0"][0]
        await trio.sleep(240.0)
        # No request: 10 s after the first read, then each wait twice the one before, up to 80 s.
        for name in ("p0", "d0"):
            assert [t - start for t in reads[name]] == [0.0, 10.0, 30.0, 70.0, 150.0, 230.0]
        assert (await stack.complete({"prompt": "a request", "max_tokens": 2})).status_code == 200
        sent = trio.current_time()
        await trio.sleep(45.0)
        # Both engines served it: read again within 10 s, 10 s after that (it had served a
        # request since the read before), then after twice as long.
        for name in ("p0", "d0"):
            assert [t - sent for t in reads[name] if t > sent] == [10.0, 20.0, 40.0]
