"""Readiness tells the truth: engines are probed at start, the unreachable ones are
named by URL, ejected and reported in ``/health`` until a readmission probe finds them."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
import trio

from .routerkit import engine, fleet_doc, open_stack


async def test_an_engine_down_at_start_is_named_and_health_says_unavailable(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="narwhal.router")
    doc = fleet_doc()
    del doc["engines"][1]["sim"]  # d0: nothing listens at its URL
    async with open_stack(doc) as stack:
        resp = await stack.client.get("/health")
        assert resp.status_code == 503
        assert resp.json() == {
            "status": "unavailable", "reason": "no engine can decode now", "engines": {"p0": "ok", "d0": "ejected"},
        }  # fmt: skip
        admin = stack.router.state.health(detail=True)
        assert admin["engines"]["d0"]["url"] == "http://d0.test:8102"
        assert "unreachable" in admin["engines"]["d0"]["error"]
        assert admin["engines"]["p0"] == {"state": "ok", "url": "http://p0.test:8101", "error": None}
        refused = await stack.complete({"prompt": "hello", "max_tokens": 2})
        assert refused.status_code == 503
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    line = r"engine d0 at http://d0\.test:8102 is unreachable \(.*unreachable.*\): out of placement until a readmission probe finds it serving \(every [\d.]+ s\)"
    assert any(re.fullmatch(line, m) for m in warnings), warnings
    assert any(m.startswith("not ready: no engine can decode now") for m in warnings), warnings


class _SilentHealth(httpx.AsyncBaseTransport):
    """d0 takes the connection and never answers ``GET /health``."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "d0.test" and request.url.path == "/health":
            await trio.sleep_forever()
        return await self.inner.handle_async_request(request)


async def test_an_engine_that_never_answers_health_is_ejected_with_the_wait_named(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The probe waits engine.connect_timeout_s for an answer (5 s by default), then
    # gives its own reason: the engine's client has none to give.
    async with open_stack(wrap=_SilentHealth) as stack:
        assert trio.current_time() == pytest.approx(5.0, abs=1e-9)
        assert (await stack.client.get("/health")).json()["engines"] == {"p0": "ok", "d0": "ejected"}
        assert stack.router.state.health(detail=True)["engines"]["d0"]["error"] == (
            "no answer to GET /health within 5 s (engine.connect_timeout_s)"
        )


async def test_an_engine_that_comes_up_later_is_readmitted(autojump_clock: trio.abc.Clock) -> None:
    # d0 refuses its first connection (the start-up probe), then serves.
    late = engine("d0", 8102, ["decode"], faults=[{"kind": "refuse_connection", "times": 1}])
    async with open_stack(fleet_doc(engine("p0", 8101, ["prefill"]), late, recovery={"probe_interval_s": 2.0})) as stack:
        assert (await stack.client.get("/health")).json()["engines"] == {"p0": "ok", "d0": "ejected"}
        await trio.sleep(3)
        resp = await stack.client.get("/health")
        assert resp.status_code == 200
        # Readmitted half-open: on trial until a live request succeeds, then full weight.
        assert resp.json() == {"status": "ready", "engines": {"p0": "ok", "d0": "trial"}}
        done = await stack.complete({"prompt": "hello", "max_tokens": 2})
        assert done.status_code == 200
        assert (await stack.client.get("/health")).json()["engines"] == {"p0": "ok", "d0": "ok"}


async def test_all_engines_up_at_start_is_ready(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        resp = await stack.client.get("/health")
        assert resp.status_code == 200
        assert resp.json() == {"status": "ready", "engines": {"p0": "ok", "d0": "ok"}}
