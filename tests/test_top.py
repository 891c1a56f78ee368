"""The terminal view's state and rendering."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_websocket

from narwhal.cmdline import CommandError
from narwhal.config import parse_fleet
from narwhal.router.service import open_router
from narwhal.top import TopView, _follow, run_top

FLEET = {
    "engines": [
        {"name": "p0", "roles": ["prefill"], "breaker": "ok", "in_flight": 2},
        {"name": "d0", "roles": ["decode"], "breaker": "ok", "in_flight": 1},
    ],
    "slo": {"ttft_s": 0.1, "tpot_s": 0.02},
}


def _record(ttft: float, tpot: float, klass: str = "ok") -> dict:
    return {"type": "request", "record": {"terminal_class": klass, "ttft_s": ttft, "tpot_s": tpot,
                                          "producer": "p0", "consumer": "d0"}}


def test_view_rolls_latency_against_the_slo() -> None:
    view = TopView(FLEET)
    for _ in range(9):
        view.apply(_record(0.05, 0.01))
    view.apply(_record(0.5, 0.01, "ok"))
    text = view.render()
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith(("p0", "d0"))}
    assert "50.0" in lines["p0"] and lines["p0"].rstrip().endswith("ok")
    assert "10.0" in lines["d0"]
    for _ in range(5):
        view.apply(_record(0.5, 0.05))
    text = view.render()
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith(("p0", "d0"))}
    assert lines["p0"].rstrip().endswith("miss ttft")
    assert lines["d0"].rstrip().endswith("miss tpot")
    assert "classes: ok 15" in text


def test_view_follows_breaker_events() -> None:
    view = TopView(FLEET)
    view.apply({"type": "breaker", "engine": "d0", "event": "ejected"})
    assert "ejected" in next(line for line in view.render().splitlines() if line.startswith("d0"))
    view.apply({"type": "breaker", "engine": "d0", "event": "readmitted"})
    assert "ejected" not in next(line for line in view.render().splitlines() if line.startswith("d0"))


@pytest.mark.parametrize("sent", [0, 1])
async def test_following_a_router_that_closes_first_leaves_no_socket_open(
    monkeypatch: pytest.MonkeyPatch, sent: int
) -> None:
    opened: list[trio.SocketStream] = []
    open_tcp_stream = trio.open_tcp_stream

    async def recorded(host: str, port: int, **kwargs: Any) -> trio.SocketStream:
        stream = await open_tcp_stream(host, port, **kwargs)
        opened.append(stream)
        return stream

    async def router_events(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        for _ in range(sent):
            await ws.send_message(json.dumps(_record(0.05, 0.01)))
        await ws.aclose()  # the router stops

    monkeypatch.setattr(trio, "open_tcp_stream", recorded)
    view = TopView(FLEET)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(trio_websocket.serve_websocket, router_events, "127.0.0.1", 0, None)
        with trio.fail_after(5), pytest.raises(trio_websocket.ConnectionClosed):
            await _follow(f"http://127.0.0.1:{server.port}", view, once_after_s=None, out=io.StringIO(), tty=False)
        nursery.cancel_scope.cancel()
    assert len(opened) == 1 and opened[0].socket.fileno() == -1  # trio-websocket alone leaves it open


async def test_top_presents_the_admin_key_and_names_a_missing_or_wrong_one(tmp_path: Path) -> None:
    # A router on real sockets whose engines nothing listens on (it tolerates them).
    engines = [
        {"name": "p0", "url": "http://127.0.0.1:1", "roles": ["prefill"],
         "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": 2}},
        {"name": "d0", "url": "http://127.0.0.1:3", "roles": ["decode"]},
    ]  # fmt: skip
    server = {"port": 0, "admin_port": 0, "admin_api_keys": ["admin-key-0123456789"]}
    config = parse_fleet({"engines": engines, "server": server, "journal": {"path": str(tmp_path / "j.jsonl")}})
    with trio.fail_after(60):
        async with open_router(config) as router, trio.open_nursery() as nursery:
            [(_, port)] = await nursery.start(router.serve_admin_tcp)
            base = f"http://127.0.0.1:{port}"
            refusals = []
            for key in (None, "wrong"):
                with pytest.raises(CommandError) as refused:
                    await run_top(base, once_after_s=0.1, out=io.StringIO(), key=key)
                refusals.append(str(refused.value))
            out = io.StringIO()
            await run_top(base, once_after_s=0.5, out=out, key="admin-key-0123456789")
            await router.shutdown(0)
            nursery.cancel_scope.cancel()
    assert refusals == [
        f"{base}/fleet answered HTTP 401: the router asks for an admin key (server.admin_api_keys): "
        "pass --admin-key or set NARWHAL_ADMIN_KEY",
        f"{base}/fleet answered HTTP 401: the router refused the admin key given (server.admin_api_keys): "
        "pass --admin-key or set NARWHAL_ADMIN_KEY",
    ]
    assert out.getvalue().startswith("narwhal top — 0 requests") and "\np0 " in out.getvalue()
TENANCY = {
    "classes": {"chat": {"priority": 0, "ttft_s": 0.5, "tpot_s": 0.05, "wait": False, "queued": 0},
                "batch": {"priority": 10, "ttft_s": 10.0, "tpot_s": None, "wait": True, "queued": 3}},
    "tenants": {"web": {"class": "chat", "weight": 1.0, "served_tokens": 10.0, "queued": {}},
                "etl": {"class": "batch", "weight": 1.0, "served_tokens": 20.0, "queued": {"batch": 3}}},
}  # fmt: skip


def _tenant_record(tenant: str, klass: str, first: float | None, *, status: int = 200,
                   terminal: str = "ok", queued: float = 0.0) -> dict:  # fmt: skip
    return {"type": "request", "record": {
        "terminal_class": terminal, "status": status, "tenant": tenant, "latency_class": klass,
        "ttft_s": first, "first_byte_s": first, "tpot_s": 0.01, "producer": "p0", "consumer": "d0", "queued_s": queued,
    }}  # fmt: skip


def test_view_shows_each_class_and_tenant_against_its_own_targets() -> None:
    view = TopView({**FLEET, "tenancy": TENANCY})
    for first in (0.1, 0.2, 0.6, 0.3):  # one over chat's 0.5 s
        view.apply(_tenant_record("web", "chat", first))
    view.apply(_tenant_record("web", "chat", None, status=429, terminal="rate_limited"))
    for first in (3.0, 9.0):  # within batch's 10 s, after waiting in the router's queue
        view.apply(_tenant_record("etl", "batch", first, queued=first - 0.1))
    view.apply(_tenant_record("etl", "batch", None, status=503, terminal="refused", queued=10.0))
    rows = {tuple(line.split()[:2]): line.split() for line in view.render().splitlines()
            if line.startswith(("chat", "batch"))}  # fmt: skip
    # class tenant n attain queued wait-p50 wait-p90 429 503 ...
    assert rows[("chat", "web")][2:9] == ["5", "60.0%", "0", "-", "-", "1", "0"]
    assert rows[("batch", "etl")][2:9] == ["3", "66.7%", "3", "8900.0", "10000.0", "0", "1"]
    assert list(rows) == [("chat", "web"), ("batch", "etl")]  # the most urgent class first
    view.update_fleet({**FLEET, "tenancy": {**TENANCY, "tenants": {**TENANCY["tenants"], "etl": {
        "class": "batch", "queued": {}}}}})  # fmt: skip
    assert next(line for line in view.render().splitlines() if line.startswith("batch")).split()[4] == "0"

