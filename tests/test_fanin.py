"""The combined admin surface of ``narwhal serve --workers N``: its combining rules, and
its routes over loopback against stand-in workers (each answers as a worker's admin
surface would, or fails as a worker can)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trio
import trio_websocket

from narwhal.http import HTTPServer
from narwhal.http.server import Request, ResponseWriter
from narwhal.router.fanin import WorkersAdminApp, combine_expositions, combine_fleets
from narwhal.router.metrics import BREAKER_CODES, CONTENT_TYPE
from narwhal.testing.ports import free_port

from .test_admin import REFUSALS

Handler = Callable[[Request, ResponseWriter], Awaitable[None]]
JSON = (("content-type", "application/json"),)


def _family(name: str, kind: str, samples: str, doc: str = "Doc.") -> str:
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n{samples}"


def _samples(text: bytes) -> dict[str, float]:
    return {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in text.decode().splitlines()
        if line and not line.startswith("#")
    }


# ----------------------------------------------------------------- /metrics combined


def test_an_exposition_keeps_each_familys_help_and_type() -> None:
    text = combine_expositions([_family("narwhal_in_flight", "gauge", "narwhal_in_flight 2\n", "Requests now.")])
    assert text.decode() == (
        "# HELP narwhal_in_flight Requests now.\n# TYPE narwhal_in_flight gauge\nnarwhal_in_flight 2.0\n"
        "# HELP narwhal_workers_up Router workers that answered this scrape.\n"
        "# TYPE narwhal_workers_up gauge\nnarwhal_workers_up 1.0\n"
    )
    # No worker answered: the scrape still says so.
    assert _samples(combine_expositions([])) == {"narwhal_workers_up": 0.0}


def test_openmetrics_expositions_combine_with_the_latest_exemplar_of_each_bucket() -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    def worker(count: int, trace: str, at: float) -> str:
        return (
            "# TYPE narwhal_request_duration_seconds histogram\n"
            f'narwhal_request_duration_seconds_bucket{{route="chat",le="0.5"}} {count} # {{trace_id="{trace}"}} 0.2 {at}\n'
            f'narwhal_request_duration_seconds_bucket{{route="chat",le="+Inf"}} {count}\n'
            f'narwhal_request_duration_seconds_count{{route="chat"}} {count}\n'
            f'narwhal_request_duration_seconds_sum{{route="chat"}} {0.2 * count}\n'
            "# EOF\n"
        )

    text = combine_expositions([worker(2, "a" * 32, 1000.0), worker(3, "b" * 32, 2000.0), worker(1, "c" * 32, 1500.0)],
                               openmetrics=True).decode()  # fmt: skip
    assert text.endswith("# EOF\n")
    samples = {(s.name, s.labels.get("le")): s for f in text_string_to_metric_families(text) for s in f.samples}
    bucket = samples[("narwhal_request_duration_seconds_bucket", "0.5")]
    assert bucket.value == 6.0
    assert bucket.exemplar is not None and bucket.exemplar.labels == {"trace_id": "b" * 32}
    assert samples[("narwhal_request_duration_seconds_bucket", "+Inf")].exemplar is None
    assert samples[("narwhal_workers_up", None)].value == 3.0


def test_gauges_and_counters_add_up_and_a_counter_was_created_when_its_first_worker_started() -> None:
    def worker(n: int, created: float) -> str:
        return _family("narwhal_in_flight", "gauge", f"narwhal_in_flight {n}\n") + _family(
            "narwhal_retries", "counter", f"narwhal_retries_total {n}\nnarwhal_retries_created {created}\n"
        )

    got = _samples(combine_expositions([worker(1, 200.0), worker(2, 100.0), worker(4, 300.0)]))
    assert got == {
        "narwhal_in_flight": 7.0, "narwhal_retries_total": 7.0, "narwhal_retries_created": 100.0,
        "narwhal_workers_up": 3.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("states", "worst"),
    [
        (["ok", "trial"], "trial"),
        (["trial", "quarantined"], "quarantined"),
        (["quarantined", "trial"], "quarantined"),
        (["ejected", "trial"], "ejected"),
        (["quarantined", "ejected", "ok"], "ejected"),
        (["ok", "ok"], "ok"),
    ],
)
def test_the_breaker_gauge_shows_the_worst_workers_state(states: list[str], worst: str) -> None:
    # The gauge's codes (4 = trial) are not ordered by severity: an engine one worker has
    # ejected is not shown on trial because another worker tries it.
    texts = [
        _family("narwhal_breaker_state", "gauge", f'narwhal_breaker_state{{engine="d0"}} {BREAKER_CODES[s]}\n')
        for s in states
    ]
    assert _samples(combine_expositions(texts))['narwhal_breaker_state{engine="d0"}'] == BREAKER_CODES[worst]


@pytest.mark.parametrize(
    "name", ["narwhal_ready", "narwhal_kv_events_stale", "narwhal_engine_others_requests", "narwhal_model_ready"]
)
def test_state_gauges_take_the_largest_workers_value(name: str) -> None:
    texts = [_family(name, "gauge", f'{name}{{engine="p0"}} {v}\n') for v in (1, 3, 2)]
    assert _samples(combine_expositions(texts))[f'{name}{{engine="p0"}}'] == 3.0


# ------------------------------------------------------------------- /fleet combined


def _engine(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name, "breaker": "ok", "streak": 0, "in_flight": 0, "reserved_prefill_tokens": 0,
        "reserved_decode_requests": 0, **fields,
    }  # fmt: skip


def test_fleets_combine_per_engine() -> None:
    a = {"engines": [_engine("p0", in_flight=1, reserved_prefill_tokens=100, reserved_decode_requests=0, streak=2),
                     _engine("d0", in_flight=1, reserved_decode_requests=1)],
         "slo": {"ttft_s": 1.0, "tpot_s": 0.1}, "in_flight": 1}  # fmt: skip
    b = {"engines": [_engine("d0", in_flight=2, reserved_decode_requests=2, streak=1),
                     _engine("p0", in_flight=3, reserved_prefill_tokens=50, streak=1),
                     _engine("p1", breaker="starting")],
         "slo": {"ttft_s": 1.0, "tpot_s": 0.1}, "in_flight": 2}  # fmt: skip
    view = combine_fleets([a, b])
    assert view == {
        "engines": [
            _engine("p0", in_flight=4, reserved_prefill_tokens=150, streak=2),
            _engine("d0", in_flight=3, reserved_decode_requests=3, streak=1),
            _engine("p1", breaker="starting"),  # a worker that knows of it already
        ],
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
        "in_flight": 3,
        "workers": 2,
    }
    # The first worker's view is not changed.
    assert a["engines"][0]["in_flight"] == 1
    # One worker's view is its own, counted as one.
    assert combine_fleets([b]) == {**b, "workers": 1}


@pytest.mark.parametrize(
    ("states", "worst"),
    [
        (["ok", "trial"], "trial"),
        (["trial", "ok"], "trial"),
        (["trial", "starting"], "starting"),
        (["quarantined", "draining", "starting"], "quarantined"),
        (["ok", "quarantined", "trial"], "quarantined"),
        (["draining", "ejected", "quarantined"], "ejected"),
        (["ejected", "quarantined"], "ejected"),
    ],
)
def test_the_fleet_view_shows_the_worst_breaker_state(states: list[str], worst: str) -> None:
    fleets = [{"engines": [_engine("d0", breaker=s)], "slo": {}, "in_flight": 0} for s in states]
    assert combine_fleets(fleets)["engines"][0]["breaker"] == worst


def test_a_workers_stale_kv_events_show_over_a_live_one() -> None:
    live = {"state": "live", "detail": None}

    def stale(detail: str) -> dict[str, Any]:
        return {"state": "stale", "detail": detail}

    def view(*kvs: dict[str, Any] | None) -> Any:
        fleets = [
            {"engines": [_engine("p0", **({} if kv is None else {"kv_events": kv}))], "slo": {}, "in_flight": 0}
            for kv in kvs
        ]
        return combine_fleets(fleets)["engines"][0].get("kv_events")

    assert view(live, stale("a"), stale("b"), live) == stale("a")  # the first stale one's reason
    assert view(stale("a"), live) == stale("a")
    assert view(live, live) == live
    assert view(None, None) is None  # no KV events configured for the engine


# ---------------------------------------------------------- the routes over loopback


class _Worker:
    """A stand-in worker admin surface: fixed answers per path, or none."""

    def __init__(self, answers: dict[str, tuple[int, Any]], *, delay_s: float = 0.0) -> None:
        self.answers = answers
        self.delay_s = delay_s
        self.received: list[tuple[str, str, bytes]] = []
        self.authorizations: list[str | None] = []

    async def __call__(self, request: Request, response: ResponseWriter) -> None:
        self.received.append((request.method, request.path, bytes(request.body)))
        self.authorizations.append(request.header("authorization"))
        await trio.sleep(self.delay_s)
        status, body = self.answers[request.path]
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        await response.respond(status, JSON, data)


@asynccontextmanager
async def _serve(handler: Handler) -> AsyncIterator[str]:
    server = HTTPServer(handler)
    async with trio.open_nursery() as nursery:
        [(host, port)] = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
        yield f"http://{host}:{port}"
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _combined(
    workers: list[_Worker | None], *, timeout_s: float = 5.0, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, WorkersAdminApp]]:
    """The combined surface over ``workers`` (None: a worker whose port nobody listens on)."""
    async with trio.open_nursery() as nursery:
        urls = []
        for worker in workers:
            if worker is None:
                urls.append(f"http://127.0.0.1:{free_port()}")
            else:
                server = HTTPServer(worker)
                [(host, port)] = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
                urls.append(f"http://{host}:{port}")
        app = WorkersAdminApp(urls, timeout_s=timeout_s, **settings)
        async with _serve(app) as url, httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:
            yield client, app
        nursery.cancel_scope.cancel()


def _metrics(n: int) -> str:
    return _family("narwhal_in_flight", "gauge", f"narwhal_in_flight {n}\n")


async def test_metrics_combine_the_workers_that_answer(caplog: pytest.LogCaptureFixture) -> None:
    workers: list[_Worker | None] = [
        _Worker({"/metrics": (200, _metrics(1))}),
        _Worker({"/metrics": (500, "broken")}),
        None,
        _Worker({"/metrics": (200, _metrics(2))}),
    ]
    with caplog.at_level(logging.WARNING, logger="narwhal.router.fanin"):
        async with _combined(workers) as (client, app):
            resp = await client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"] == CONTENT_TYPE
    assert _samples(resp.content) == {"narwhal_in_flight": 3.0, "narwhal_workers_up": 2.0}
    assert [w.received for w in workers if w is not None] == [[("GET", "/metrics", b"")]] * 3
    [warning] = [r for r in caplog.records if r.name == "narwhal.router.fanin"]
    assert warning.levelno == logging.WARNING
    prefix = f"worker admin {app.urls[2]}/metrics did not answer: "
    assert warning.getMessage().startswith(prefix)
    assert isinstance(warning.args, tuple)
    assert warning.getMessage().removeprefix(prefix) == str(warning.args[-1]) != "None"  # the client's error


async def test_workers_are_reached_directly_whatever_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The workers listen on loopback: a proxy set for the supervisor's own traffic is not theirs.
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    async with _combined([_Worker({"/metrics": (200, _metrics(1))})]) as (client, _):
        resp = await client.get("/metrics")
    assert _samples(resp.content) == {"narwhal_in_flight": 1.0, "narwhal_workers_up": 1.0}


async def test_a_worker_slower_than_the_scrape_timeout_is_left_out() -> None:
    workers: list[_Worker | None] = [
        _Worker({"/metrics": (200, _metrics(1))}),
        # Slower than the surface's timeout, quicker than an HTTP client's default one (5 s).
        _Worker({"/metrics": (200, _metrics(2))}, delay_s=4.0),
    ]
    async with _combined(workers, timeout_s=3.0) as (client, _):
        resp = await client.get("/metrics")
    assert _samples(resp.content) == {"narwhal_in_flight": 1.0, "narwhal_workers_up": 1.0}


async def test_fleet_combines_the_workers_views_or_says_none_answered() -> None:
    def fleet(in_flight: int) -> tuple[int, Any]:
        return 200, {"engines": [_engine("d0", in_flight=in_flight)], "slo": {"ttft_s": 1.0}, "in_flight": in_flight}

    workers: list[_Worker | None] = [_Worker({"/fleet": fleet(1)}), _Worker({"/fleet": (500, {})}),
                                     _Worker({"/fleet": fleet(2)})]  # fmt: skip
    async with _combined(workers) as (client, _):
        resp = await client.get("/fleet")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {"engines": [_engine("d0", in_flight=3)], "slo": {"ttft_s": 1.0}, "in_flight": 3, "workers": 2}
    async with _combined([None, _Worker({"/fleet": (500, {})})]) as (client, _):
        resp = await client.get("/fleet")
    assert resp.status_code == 503 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {"error": "no worker answered"}


async def test_health_is_ready_when_a_worker_is() -> None:
    ready = {"status": "ready", "engines": {}}
    unavailable = {"status": "unavailable", "reason": "no decode engine"}
    workers: list[_Worker | None] = [_Worker({"/health": (503, unavailable)}), None, _Worker({"/health": (200, ready)})]
    async with _combined(workers) as (client, _):
        resp = await client.get("/health")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {"status": "ready", "workers": [unavailable, {"status": "unreachable"}, ready]}
    async with _combined([_Worker({"/health": (503, unavailable)}), None]) as (client, _):
        resp = await client.get("/health")
    assert resp.status_code == 503
    assert resp.json() == {"status": "unavailable", "workers": [unavailable, {"status": "unreachable"}]}


async def test_put_fleet_reaches_every_worker() -> None:
    applied = (200, {"status": "applied", "changed": ["engine.request_timeout_s"]})
    workers: list[_Worker | None] = [_Worker({"/fleet": applied}), _Worker({"/fleet": applied})]
    async with _combined(workers) as (client, _):
        resp = await client.put("/fleet", content=b'{"engines": []}')
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {"status": "applied", "workers": [applied[1], applied[1]]}
    assert [w.received for w in workers if w is not None] == [[("PUT", "/fleet", b'{"engines": []}')]] * 2


async def test_put_fleet_refused_by_a_worker_is_400_with_its_error() -> None:
    error = {"message": "must be positive", "path": "$.engine.request_timeout_s", "type": "invalid_fleet"}
    other = {"message": "other", "path": "$.x", "type": "invalid_fleet"}
    answers = [(200, {"status": "applied"}), (400, {"status": "rejected", "error": error}),
               (400, {"status": "rejected", "error": other})]  # fmt: skip
    async with _combined([_Worker({"/fleet": a}) for a in answers]) as (client, _):
        resp = await client.put("/fleet", content=b"{}")
    assert resp.status_code == 400
    assert resp.json() == {"status": "rejected", "error": error, "workers": [a[1] for a in answers]}


async def test_put_fleet_a_worker_did_not_apply_is_502_partial() -> None:
    applied = {"status": "applied"}
    workers: list[_Worker | None] = [_Worker({"/fleet": (200, applied)}), None,
                                     _Worker({"/fleet": (502, "<html>bad gateway</html>")})]  # fmt: skip
    async with _combined(workers) as (client, _):
        resp = await client.put("/fleet", content=b"{}")
    assert resp.status_code == 502
    assert resp.json() == {
        "status": "partial", "workers": [applied, {"status": "unreachable"}, {"status": "unreachable"}],
    }  # fmt: skip


async def test_put_fleet_waits_for_a_reload_longer_than_a_scrape() -> None:
    # Reading profiles and resolving engine groups can outlast the scrape timeout.
    applied = (200, {"status": "applied"})
    async with _combined([_Worker({"/fleet": applied}, delay_s=1.0)], timeout_s=0.2) as (client, _):
        resp = await client.put("/fleet", content=b"{}")
    assert resp.status_code == 200 and resp.json() == {"status": "applied", "workers": [applied[1]]}


@pytest.mark.parametrize(("method", "path", "status", "message"), REFUSALS)
async def test_other_requests_are_refused_with_a_clear_error(method: str, path: str, status: int, message: str) -> None:
    worker = _Worker({})
    async with _combined([worker]) as (client, _):
        resp = await client.request(method, path)
    assert resp.status_code == status
    assert resp.json()["error"]["message"] == message
    assert worker.received == []


# ------------------------------------------------------------------------- admin keys


ADMIN_KEYS = ("admin-key-0123456789", "admin-key-abcdefghij")


async def test_the_combined_surface_asks_for_an_admin_key_and_presents_one_to_the_workers() -> None:
    health = (200, {"status": "ready", "engines": {}})
    applied = (200, {"status": "applied"})
    workers: list[_Worker | None] = [_Worker({"/health": health, "/fleet": applied}) for _ in range(2)]
    async with _combined(workers, keys=ADMIN_KEYS) as (client, _):
        refused = [await client.get("/health"), await client.put("/fleet", content=b"{}"),
                   await client.get("/health", headers={"authorization": "Bearer wrong"})]  # fmt: skip
        assert [w.received for w in workers if w is not None] == [[], []]  # nothing reached a worker
        good = {"authorization": f"Bearer {ADMIN_KEYS[1]}"}
        admitted = [await client.get("/health", headers=good), await client.put("/fleet", content=b"{}", headers=good)]
    assert [r.status_code for r in refused] == [401, 401, 401]
    assert refused[0].headers["www-authenticate"] == 'Bearer realm="narwhal-admin"'
    assert refused[0].json()["error"]["code"] == "invalid_admin_key"
    assert [r.status_code for r in admitted] == [200, 200]
    # The workers read the same keys: the supervisor presents the first.
    assert [w.authorizations for w in workers if w is not None] == [[f"Bearer {ADMIN_KEYS[0]}"] * 2] * 2


async def test_put_fleet_turned_off_reaches_no_worker() -> None:
    worker = _Worker({"/fleet": (200, {"status": "applied"})})
    async with _combined([worker], fleet_writes=False) as (client, _):
        resp = await client.put("/fleet", content=b"{}")
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "fleet_writes_disabled"
    assert worker.received == []


# ------------------------------------------------------------------------- /events


class _EventsWorker:
    """A stand-in worker's ``/events``: sends ``messages``, then closes when ``gate`` is
    set, or sees the surface close first (``closed_by_surface``)."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = messages
        self.gate = trio.Event()
        self.paths: list[str] = []
        self.authorizations: list[bytes | None] = []
        self.closed_by_surface = trio.Event()

    async def __call__(self, request: trio_websocket.WebSocketRequest) -> None:
        self.paths.append(request.path)
        self.authorizations.append(dict(request.headers).get(b"authorization"))
        ws = await request.accept()
        for m in self.messages:
            await ws.send_message(m)
        async with trio.open_nursery() as nursery:

            async def closed_by_surface() -> None:
                with pytest.raises(trio_websocket.ConnectionClosed):
                    await ws.get_message()
                self.closed_by_surface.set()
                nursery.cancel_scope.cancel()

            nursery.start_soon(closed_by_surface)
            await self.gate.wait()
            nursery.cancel_scope.cancel()
        await ws.aclose()


@asynccontextmanager
async def _events_surface(
    workers: list[_EventsWorker], keys: tuple[str, ...] = ()
) -> AsyncIterator[tuple[list[str], str]]:
    """The workers' ``/events`` on loopback, and the combined surface's URL over them."""
    async with trio.open_nursery() as nursery:
        urls = []
        for worker in workers:
            server = await nursery.start(trio_websocket.serve_websocket, worker, "127.0.0.1", 0, None)
            urls.append(f"http://127.0.0.1:{server.port}")
        async with _serve(WorkersAdminApp(urls, keys=keys)) as url:
            yield urls, "ws" + url[len("http"):] + "/events"
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _events_client(events: str, key: str | None = None) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A client of the surface's ``/events``, its socket closed however the connection ends
    (trio-websocket leaves a client's socket open when the server closes first)."""
    where = urlsplit(events)
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    async with await trio.open_tcp_stream(str(where.hostname), int(where.port or 0)) as stream:
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, where.netloc, where.path, extra_headers=headers)
            yield ws
            await ws.aclose()
            nursery.cancel_scope.cancel()


async def test_events_interleave_the_workers_streams_and_end_with_one(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[tuple[int, trio.SocketStream]] = []
    open_tcp_stream = trio.open_tcp_stream

    async def recorded(host: str, port: int, **kwargs: Any) -> trio.SocketStream:
        stream = await open_tcp_stream(host, port, **kwargs)
        opened.append((port, stream))
        return stream

    monkeypatch.setattr(trio, "open_tcp_stream", recorded)
    workers = [_EventsWorker(['{"w":0,"n":1}', '{"w":0,"n":2}']), _EventsWorker(['{"w":1,"n":1}'])]
    with caplog.at_level(logging.INFO, logger="narwhal.router.fanin"):
        async with _events_surface(workers) as (urls, events):
            async with _events_client(events) as ws:
                got = [await ws.get_message() for _ in range(3)]
                assert sorted(got) == sorted(['{"w":0,"n":1}', '{"w":0,"n":2}', '{"w":1,"n":1}'])
                assert got.index('{"w":0,"n":1}') < got.index('{"w":0,"n":2}')
                workers[1].gate.set()  # a worker goes away: the client is told to reconnect
                with trio.fail_after(5):
                    with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                        await ws.get_message()
                with trio.fail_after(5):
                    await workers[0].closed_by_surface.wait()  # the other relay ends
    reason = closed.value.reason
    assert reason is not None and reason.code == 1000  # an orderly close, not a dropped one
    assert [w.paths for w in workers] == [["/events"], ["/events"]]
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "narwhal.router.fanin"] == [(
        logging.INFO,
        f"event relay from {urls[1]} ended: ConnectionClosed<CloseReason<code=1000, name=NORMAL_CLOSURE, reason=None>>",
    )]  # fmt: skip
    # The relays' sockets are closed, the one whose worker closed first too (trio-websocket
    # leaves a client's socket open then).
    ports = sorted(int(urlsplit(url).port or 0) for url in urls)
    assert sorted(port for port, _ in opened if port in ports) == ports
    assert [port for port, stream in opened if stream.socket.fileno() != -1] == []


async def test_the_event_relays_present_the_admin_key() -> None:
    workers = [_EventsWorker(['{"w":0}']), _EventsWorker(['{"w":1}'])]
    async with _events_surface(workers, ADMIN_KEYS) as (_, events):
        async with _events_client(events, ADMIN_KEYS[1]) as ws:
            assert sorted([await ws.get_message() for _ in range(2)]) == ['{"w":0}', '{"w":1}']
    assert [w.authorizations for w in workers] == [[f"Bearer {ADMIN_KEYS[0]}".encode()]] * 2


async def test_a_client_leaving_ends_the_relays() -> None:
    workers = [_EventsWorker(['{"w":0}']), _EventsWorker(['{"w":1}'])]
    async with _events_surface(workers) as (_, events):
        async with _events_client(events) as ws:
            assert sorted([await ws.get_message() for _ in range(2)]) == ['{"w":0}', '{"w":1}']
        with trio.fail_after(5):
            for worker in workers:
                await worker.closed_by_surface.wait()


async def test_a_worker_not_listening_ends_the_events_in_order(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    server = HTTPServer(WorkersAdminApp([url]))
    with caplog.at_level(logging.INFO):
        async with trio.open_nursery() as nursery:
            [(host, port)] = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
            async with _events_client(f"ws://{host}:{port}/events") as ws:
                with trio.fail_after(5), pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await ws.get_message()
            await server.shutdown(5.0)  # the surface's side of it ends too, on its own
            nursery.cancel_scope.cancel()
    assert closed.value.reason is not None and closed.value.reason.code == 1000
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO] == [
        ("narwhal.router.fanin", logging.INFO, f"event relay from {url} ended: HandshakeError()")
    ]  # and nothing went wrong on the way
