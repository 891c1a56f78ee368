"""Security: KV transfers clients cannot steer, keys, secrets, internals, admin binding.

Already covered elsewhere and extended here rather than repeated:
test_router_basic.py (client ``kv_transfer_params`` on one completions request;
same-worker stripping), test_router_failures.py (``wrong_endpoint`` never reaches the
consumer), test_logs.py (the prompt in the INFO line of a success and a 400),
test_fault_matrix.py (no host names or exception text in any fault's error body).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
import trio_websocket

import narwhal.router.keys
import narwhal.router.placement
from narwhal.config import FaultSpec, parse_fleet
from narwhal.logs import JSONFormatter
from narwhal.router.admin import open_events
from narwhal.router.placement import Placement
from narwhal.router.service import open_router
from narwhal.testing import SimApp

from .loadkit import Outcome, exchange
from .routerkit import ROUTER_HOST, ROUTER_PORT, Stack, engine, fleet_doc, open_stack

BODY = {"prompt": "one two three four", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4}
ADMIN = ("127.0.0.1", 8001)


async def post(stack: Stack, body: dict[str, Any], *, path: str = "/v1/completions", rid: str = "sec",
               headers: tuple[tuple[str, str], ...] = ()) -> Outcome:
    conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
    return await exchange(conn, body, request_id=rid, path=path, headers=headers)


@pytest.fixture
def engine_headers(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[dict[str, str]]]]:
    """The headers of every request each simulated engine receives, by engine name."""
    seen: dict[str, list[dict[str, str]]] = defaultdict(list)
    original = SimApp.__call__

    async def recording(self: SimApp, request: Any, response: Any) -> None:
        seen[self.engine.name].append({n.lower(): v for n, v in request.headers} | {":path": request.path})
        await original(self, request, response)

    monkeypatch.setattr(SimApp, "__call__", recording)
    yield seen


# ------------------------------------------------------------------ KV transfers


EVIL = {"do_remote_prefill": True, "do_remote_decode": True, "remote_engine_id": "evil-engine",
        "remote_block_ids": [[1, 2]], "remote_request_id": "evil-req", "remote_host": "evil.example",
        "remote_port": 6666}  # fmt: skip
HOSTILE_TRANSFER = {
    "kv_transfer_params": EVIL,
    "disaggregated_params": EVIL,
    "bootstrap_host": "evil.example",
    "bootstrap_port": 6666,
    "vllm_xargs": {"kv_transfer_params": EVIL, "other": 1},
}


@pytest.mark.parametrize("topology", ["disaggregated", "same-worker"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_no_engine_ever_receives_client_transfer_params(
    autojump_clock: trio.abc.Clock, topology: str, stream: bool, path: str
) -> None:
    doc = fleet_doc() if topology == "disaggregated" else fleet_doc(engine("both", 8101, ["prefill", "decode"]))
    body = {**(BODY if path == "/v1/completions" else CHAT), **HOSTILE_TRANSFER, "stream": stream}
    async with open_stack(doc) as stack:
        out = await post(stack, body, path=path)
        assert out.ok, out
        bodies = [b for sim in stack.fleet.engines.values() for b in sim.requests_seen]
    assert bodies
    for sent in bodies:
        assert "evil" not in json.dumps(sent), sent
        assert "disaggregated_params" not in sent and "bootstrap_host" not in sent
        assert sent["vllm_xargs"] == {"other": 1}
    if topology == "disaggregated":
        [prefill, decode] = bodies
        assert prefill["kv_transfer_params"]["do_remote_decode"] is True
        assert decode["kv_transfer_params"]["remote_host"] == "p0.kv.test"
    else:
        assert all("kv_transfer_params" not in b for b in bodies)


@pytest.mark.parametrize(
    ("host", "port"),
    [
        ("p1.kv.test", 15102),  # another producer's real KV endpoint
        ("p1.kv.test", 15101),  # another host at this producer's port
        ("10.9.8.7", 15101),  # an address the fleet does not know
        ("p0.kv.test", 15102),  # this host, another port
    ],
)
async def test_descriptor_naming_another_endpoint_is_rejected_before_the_consumer(
    autojump_clock: trio.abc.Clock, host: str, port: int
) -> None:
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("p1", 8102, ["prefill"]), engine("d0", 8103, ["decode"]),
                    recovery={"eject_after": 100})
    async with open_stack(doc) as stack:
        # p0 (compromised or misconfigured) names another KV endpoint in its handoffs.
        scheduler = stack.engine("p0").scheduler
        honest = scheduler.describe
        scheduler.describe = lambda h: {**honest(h), "remote_host": host, "remote_port": port}
        outs = [await post(stack, BODY, rid=f"steer-{i}") for i in range(4)]
        # The consumer only ever saw honest handoffs, from p1's own endpoint.
        decode_bodies = stack.engine("d0").requests_seen
        assert {b["kv_transfer_params"]["remote_host"] for b in decode_bodies} == {"p1.kv.test"}
        assert stack.engine("d0").stats.failed_transfers == 0
    by_producer = defaultdict(set)
    for out, record in zip(outs, stack.records, strict=True):
        by_producer[record["producer"]].add(record["terminal_class"])
        if record["producer"] == "p0":
            assert out.status == 502 and out.error is not None
            assert out.error["message"] == "invalid KV handoff descriptor: endpoint mismatch"
            assert host not in out.error["message"] and str(port) not in out.error["message"]
        else:
            assert out.ok
    assert by_producer == {"p0": {"invalid_descriptor"}, "p1": {"ok"}}


# ------------------------------------------------------------------ client API keys


KEYS = ["key-one-0123456789", "key-two-abcdefghij"]


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (None, 401),
        ("Bearer wrong", 401),
        ("Bearer key-one-012345678", 401),  # a prefix
        ("Bearer key-one-0123456789x", 401),  # an extension
        ("Basic key-one-0123456789", 401),  # another scheme
        ("key-one-0123456789", 401),  # no scheme
        ("Bearer", 401),
        ("Bearer key-one-0123456789", 200),
        ("Bearer  key-one-0123456789", 200),  # the scheme ends at the first space
        ("bearer key-two-abcdefghij", 200),
    ],
)
async def test_api_keys(autojump_clock: trio.abc.Clock, authorization: str | None, status: int,
                        engine_headers: dict[str, list[dict[str, str]]]) -> None:
    async with open_stack(fleet_doc(server={"api_keys": KEYS})) as stack:
        headers = () if authorization is None else (("authorization", authorization),)
        out = await post(stack, BODY, headers=headers)
        assert out.status == status
        models = await stack.client.get("/v1/models", headers=dict(headers))
        assert models.status_code == status
        # Health stays open for load balancers.
        assert (await stack.client.get("/health")).status_code == 200
        if status == 401:
            assert out.error == {"message": "missing or invalid API key", "type": "authentication_error",
                                 "code": "invalid_api_key"}
            # Refused before admission: no journal record, no engine work.
            assert stack.records == []
            assert all(b == [] for b in (sim.requests_seen for sim in stack.fleet.engines.values()))
        else:
            assert out.ok and len(stack.records) == 1
    # The client's credentials are never passed on to an engine.
    for seen in engine_headers.values():
        assert all("authorization" not in h for h in seen)


async def test_every_key_is_compared_in_constant_time(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(narwhal.router.keys.hmac, "compare_digest", counting)
    keys = [f"key-{i}-secret" for i in range(4)]
    async with open_stack(fleet_doc(server={"api_keys": keys})) as stack:
        for presented, status in [(keys[0], 200), (keys[3], 200), ("nope", 401)]:
            calls.clear()
            out = await post(stack, BODY, headers=(("authorization", f"Bearer {presented}"),))
            assert out.status == status
            # A match on the first key still compares the others: the time taken does not
            # say which key (or how much of one) matched.
            assert [k for _, k in calls] == [hashlib.sha256(k.encode()).digest() for k in keys]


# ------------------------------------------------------------------ engine credentials


SECRETS = {"p0": "sk-engine-p0-TOPSECRET-1111", "d0": "sk-engine-d0-TOPSECRET-2222"}


async def test_engine_keys_are_sent_and_never_shown(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture,
    engine_headers: dict[str, list[dict[str, str]]],
) -> None:
    caplog.set_level(logging.DEBUG)
    doc = fleet_doc(
        {**engine("p0", 8101, ["prefill"]), "api_key": SECRETS["p0"]},
        {**engine("d0", 8102, ["decode"]), "api_key": SECRETS["d0"]},
        recovery={"eject_after": 1, "probe_interval_s": 5.0},
    )
    shown: list[str] = []
    async with open_stack(doc) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        # Successes, failures of every leg, an ejection and its readmission probe.
        for body in (BODY, {**BODY, "stream": True}, CHAT):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            out = await post(stack, body, path=path)
            assert out.ok, out
            shown.append(repr(out))
        for name, fault in [
            ("p0", FaultSpec(kind="http_error", on="prefill", status=401, message="bad key", times=1)),
            ("p0", FaultSpec(kind="malformed_descriptor", variant="wrong_endpoint", times=1)),
            ("d0", FaultSpec(kind="close_before_done", on="decode", after_tokens=1, times=1)),
            ("d0", FaultSpec(kind="refuse_connection", times=1)),
        ]:
            stack.engine(name).inject(fault)
            shown.append(repr(await post(stack, {**BODY, "stream": True})))
            await trio.sleep(6.0)  # the probe readmits the ejected engine
        assert not any(st.ejected for st in stack.router.state.breaker.states.values())
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            for route in ("/metrics", "/fleet", "/health"):
                shown.append((await admin.get(route)).text)
        for route in ("/health", "/v1/models"):
            shown.append((await stack.client.get(route)).text)
        shown.extend(repr(c) for c in stack.router.state.clients.values())
    shown.extend(json.dumps(r) for r in stack.records)
    shown.extend(JSONFormatter().format(r) for r in caplog.records)
    shown.extend(r.getMessage() for r in caplog.records)
    text = "\n".join(shown)
    assert "TOPSECRET" not in text
    # ... and yet every engine got its own key, and only its own, on its /v1 routes.
    for name, seen in engine_headers.items():
        v1 = [h for h in seen if h[":path"].startswith("/v1/")]
        assert v1 and all(h["authorization"] == f"Bearer {SECRETS[name]}" for h in v1)


# ------------------------------------------------------------------ internals


async def test_a_router_bug_is_a_bare_500(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(self: Placement, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internal detail at /srv/narwhal/placement.py")

    monkeypatch.setattr(Placement, "acquire", broken)
    async with open_stack() as stack:
        out = await post(stack, BODY)
    assert out.status == 500
    assert out.error == {"message": "internal error", "type": "internal_error", "code": None}
    [record] = stack.records
    assert record["terminal_class"] == "internal_error" and record["error"] == "RuntimeError"
    # The operator's log keeps the traceback.
    assert any("secret internal detail" in (r.exc_text or "") or r.exc_info for r in caplog.records)


async def test_engine_internals_stay_out_of_client_errors(autojump_clock: trio.abc.Clock) -> None:
    leak = "Traceback: File /opt/vllm/engine.py line 9 at 10.1.2.3:8000 password=hunter2"
    async with open_stack(fleet_doc(recovery={"eject_after": 100})) as stack:
        stack.engine("p0").inject(FaultSpec(kind="http_error", on="prefill", status=500, message=leak, times=1))
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=503, message=leak, times=1))
        outs = [await post(stack, BODY, rid=f"leak-{i}") for i in range(2)]
        # A refused connection's text names the address it tried.
        stack.engine("d0").inject(FaultSpec(kind="refuse_connection", times=1))
        outs.append(await post(stack, BODY, rid="leak-2"))
    assert [o.status for o in outs] == [502, 502, 502]
    assert [o.error["message"] for o in outs if o.error] == [
        "engine p0 answered HTTP 500", "engine d0 answered HTTP 503", "engine d0 unreachable",
    ]
    # The journal keeps the detail for the operator.
    assert "password=hunter2" in stack.records[0]["error"]
    assert "d0.test" in stack.records[2]["error"]


async def test_engine_urls_in_errors_names_the_url_when_asked(autojump_clock: trio.abc.Clock) -> None:
    # The operator's opt-in (a development router): each engine fault's 502 names the
    # engine's URL after its name; the engine's own error text still stays out.
    leak = "Traceback: File /opt/vllm/engine.py password=hunter2"
    doc = fleet_doc(recovery={"eject_after": 100}, server={"engine_urls_in_errors": True})
    async with open_stack(doc) as stack:
        urls = {e.name: e.url for e in stack.config.engines}
        stack.engine("p0").inject(FaultSpec(kind="http_error", on="prefill", status=500, message=leak, times=1))
        outs = [await post(stack, BODY, rid="url-0")]
        stack.engine("d0").inject(FaultSpec(kind="refuse_connection", times=1))
        outs.append(await post(stack, BODY, rid="url-1"))
    assert [o.status for o in outs] == [502, 502]
    messages = [o.error["message"] if o.error else "" for o in outs]
    assert messages == [
        f"engine p0 at {urls['p0']} answered HTTP 500", f"engine d0 at {urls['d0']} unreachable",
    ]
    assert not any("hunter2" in m for m in messages)


def test_embedded_default_names_engine_urls_and_the_example_does_not() -> None:
    from narwhal.config import load_default_fleet, load_fleet

    assert load_default_fleet().server.engine_urls_in_errors is True
    example = Path(__file__).resolve().parent.parent / "config" / "fleet.example.json"
    assert load_fleet(example).server.engine_urls_in_errors is False


async def test_prompt_text_never_logged_or_journaled(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "zebrasecretword"
    prompt = f"alpha {secret} beta"
    async with open_stack(fleet_doc(recovery={"eject_after": 100}, engine={"decode_read_timeout_s": 0.5})) as stack:
        bodies: list[dict[str, Any]] = [
            {"prompt": prompt, "max_tokens": 3},
            {"prompt": prompt, "max_tokens": 3, "stream": True},
            {"prompt": prompt, "max_tokens": "x"},
            {"prompt": prompt, "max_tokens": 10**6},
            {"prompt": prompt, "max_tokens": 3, "model": "nope"},
        ]
        for body in bodies:
            await post(stack, body)
        for name, fault in [
            ("p0", FaultSpec(kind="http_error", on="prefill", times=1)),
            ("p0", FaultSpec(kind="http_error", on="prefill", status=400, times=1)),
            ("p0", FaultSpec(kind="malformed_descriptor", times=1)),
            ("d0", FaultSpec(kind="silence_after", on="decode", after_tokens=1, times=1)),
            ("d0", FaultSpec(kind="close_before_done", on="decode", after_tokens=1, times=1)),
        ]:
            stack.engine(name).inject(fault)
            await post(stack, {"prompt": prompt, "max_tokens": 3, "stream": True})
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3}
        await post(stack, chat, path="/v1/chat/completions")
        with trio.move_on_after(0.015):  # a client that leaves mid-prefill
            await post(stack, {"prompt": prompt, "max_tokens": 3})
        await trio.sleep(1.0)
    assert len(stack.records) == len(bodies) + 5 + 2
    assert all(secret not in json.dumps(r) for r in stack.records)
    # Every router log line (the simulated engines' own logs are the engine's business).
    router_logs = [r for r in caplog.records if not r.name.startswith("narwhal.testing")]
    assert router_logs
    for record in router_logs:
        assert secret not in JSONFormatter().format(record)


# ------------------------------------------------------------------ the admin surface


async def test_admin_routes_are_not_on_the_client_listener(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        for route in ("/metrics", "/fleet", "/events"):
            assert (await stack.client.get(route)).status_code == 404


def test_admin_binds_loopback_by_default() -> None:
    config = parse_fleet({"engines": fleet_doc()["engines"]})
    assert config.server.admin_host == "127.0.0.1"
    assert config.server.host == "127.0.0.1"


#: Engines nothing listens on (the router tolerates them): a router on real sockets.
UNREACHABLE = [
    {"name": "p0", "url": "http://127.0.0.1:1", "roles": ["prefill"],
     "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": 2}},
    {"name": "d0", "url": "http://127.0.0.1:3", "roles": ["decode"]},
]  # fmt: skip


@pytest.mark.parametrize(("admin_host", "bound"), [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
async def test_admin_listener_binds_where_configured(tmp_path: Path, admin_host: str | None, bound: str) -> None:
    server: dict[str, Any] = {"admin_port": 0, "port": 0, "admin_api_keys": ADMIN_KEYS}
    if admin_host is not None:
        server["admin_host"] = admin_host
    config = parse_fleet({"engines": UNREACHABLE, "server": server, "journal": {"path": str(tmp_path / "j.jsonl")}})
    with trio.fail_after(30):
        async with open_router(config) as router, trio.open_nursery() as nursery:
            addresses = await nursery.start(router.serve_admin_tcp)
            assert {host for host, _ in addresses} == {bound}
            async with httpx.AsyncClient(trust_env=False) as client:
                url = f"http://127.0.0.1:{addresses[0][1]}/metrics"
                assert (await client.get(url)).status_code == 401
                resp = await client.get(url, headers={"authorization": f"Bearer {ADMIN_KEYS[1]}"})
                assert resp.status_code == 200 and "narwhal_in_flight_requests" in resp.text
            await router.shutdown(0)


# ------------------------------------------------------------------ admin keys


ADMIN_KEYS = ["admin-key-0123456789", "admin-key-abcdefghij"]
#: Every kind of admin request: each route, a route that is not there, a method refused.
ADMIN_REQUESTS = [("GET", "/metrics"), ("GET", "/fleet"), ("GET", "/health"), ("PUT", "/fleet"),
                  ("GET", "/nothing"), ("POST", "/metrics")]  # fmt: skip
ADMITTED = {("GET", "/metrics"): 200, ("GET", "/fleet"): 200, ("GET", "/health"): 200, ("PUT", "/fleet"): 200,
            ("GET", "/nothing"): 404, ("POST", "/metrics"): 405}  # fmt: skip


@asynccontextmanager
async def _fleet_records(stack: Stack) -> AsyncIterator[list[dict[str, Any]]]:
    """The fleet records the router publishes while the block runs (filled as it ends)."""
    records: list[dict[str, Any]] = []
    with stack.router.events.subscribe() as sub:
        yield records
        while True:
            try:
                event = sub.receive.receive_nowait()
            except trio.WouldBlock:
                break
            if event.get("type") == "fleet":
                records.append(event)


async def _handshake(stack: Stack, authorization: str | None, origin: str | None = None) -> int:
    """The ``/events`` WebSocket handshake's outcome: 101, or the status it was refused with."""
    stream = await stack.net.connect(*ADMIN)
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    status = 101
    try:
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/events", extra_headers=headers)  # type: ignore[arg-type]
            await ws.aclose()
    except* trio_websocket.ConnectionRejected as group:
        [refused] = group.exceptions
        assert isinstance(refused, trio_websocket.ConnectionRejected)
        status = refused.status_code
    await stream.aclose()
    return status


@pytest.mark.parametrize(
    ("authorization", "admitted"),
    [
        (None, False),
        ("Bearer wrong", False),
        (f"Bearer {KEYS[0]}", False),  # a client key is not an admin key
        (f"Bearer {ADMIN_KEYS[0][:-1]}", False),  # a prefix
        (f"Basic {ADMIN_KEYS[0]}", False),  # another scheme
        (ADMIN_KEYS[0], False),  # no scheme
        (f"Bearer {ADMIN_KEYS[0]}", True),
        (f"bearer {ADMIN_KEYS[1]}", True),
    ],
)
async def test_admin_keys_guard_every_admin_request(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture, authorization: str | None, admitted: bool
) -> None:
    doc = fleet_doc(server={"api_keys": KEYS, "admin_api_keys": ADMIN_KEYS})
    reload = fleet_doc(server={"api_keys": KEYS, "admin_api_keys": ADMIN_KEYS}, engine={"request_timeout_s": 300})
    async with open_stack(doc) as stack, _fleet_records(stack) as events:
        stack.net.listen(*ADMIN, stack.router.admin)
        headers = {} if authorization is None else {"authorization": authorization}
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            answers = {
                (method, path): await admin.request(
                    method, path, headers=headers, content=json.dumps(reload).encode() if method == "PUT" else None
                )
                for method, path in ADMIN_REQUESTS
            }
        handshake = await _handshake(stack, authorization)
        timeout = stack.router.state.config.engine.request_timeout_s
        # The client port takes client keys only.
        models = await stack.client.get("/v1/models", headers={"authorization": f"Bearer {ADMIN_KEYS[0]}"})
        assert models.status_code == 401
    if admitted:
        assert {k: r.status_code for k, r in answers.items()} == ADMITTED
        assert handshake == 101 and timeout == 300
        assert [e["event"] for e in events] == ["reload"]
        return
    for request, resp in answers.items():
        assert resp.status_code == 401, request
        assert resp.headers["www-authenticate"] == 'Bearer realm="narwhal-admin"'
        assert resp.json() == {"error": {"message": "missing or invalid admin key", "type": "authentication_error",
                                         "code": "invalid_admin_key"}}  # fmt: skip
    # Refused before anything was read or changed: no reload, no record, no subscription.
    assert handshake == 401 and timeout != 300 and events == []
    refusals = [r.getMessage() for r in caplog.records if r.name == "narwhal.router.admin"]
    assert refusals == [f"admin {m} {p} refused: missing or invalid admin key" for m, p in ADMIN_REQUESTS] + [
        "admin GET /events refused: missing or invalid admin key"
    ]


@pytest.mark.parametrize(
    ("host", "origin", "refused"),
    [
        ("127.0.0.1:8001", None, None),
        ("localhost:8001", None, None),
        ("[::1]:8001", None, None),
        ("app.localhost", None, None),
        ("localhost.:8001", None, None),  # the fully qualified form
        ("LocalHost:8001", None, None),
        ("10.0.0.5:8001", None, None),  # an address: no name to rebind
        (None, None, None),  # HTTP/1.0 without Host
        ("127.0.0.1:8001", "http://localhost:3000", None),  # a page served from this machine
        ("127.0.0.1:8001", "http://[::1]:8080", None),
        ("rebound.example:8001", None, "Host 'rebound.example:8001' is a name"),
        ("router.internal", None, "Host 'router.internal' is a name"),
        ("127.0.0.1:8001", "https://attacker.example", "Origin 'https://attacker.example'"),
        ("127.0.0.1:8001", "http://10.0.0.5", "Origin 'http://10.0.0.5'"),
        ("127.0.0.1:8001", "null", "Origin 'null'"),
        ("127.0.0.1:8001", "garbage", "Origin 'garbage'"),
    ],
)
def test_a_keyless_admin_port_answers_no_web_page(host: str | None, origin: str | None, refused: str | None) -> None:
    problem = narwhal.router.keys.browser_problem(host, origin)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem, problem
    if origin == "null":
        assert problem == ("a web page's request (Origin 'null'): without admin keys the admin port answers no "
                           "page that is not served from this machine")  # fmt: skip


async def test_a_keyless_admin_port_refuses_a_rebound_or_cross_site_request(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    reload = fleet_doc(engine={"request_timeout_s": 300})
    async with open_stack() as stack, _fleet_records(stack) as events:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            # A page on attacker.example that rebound its name to 127.0.0.1 reads /fleet
            # (same origin: no Origin header), or a page elsewhere PUTs a fleet.
            rebound = await admin.get("/fleet", headers={"host": "attacker.example:8001"})
            cross = await admin.put("/fleet", content=json.dumps(reload).encode(),
                                    headers={"origin": "https://attacker.example"})  # fmt: skip
            local = await admin.get("/fleet")
        handshake = await _handshake(stack, None, origin="https://attacker.example")
        timeout = stack.router.state.config.engine.request_timeout_s
    assert local.status_code == 200
    assert (rebound.status_code, cross.status_code, handshake) == (403, 403, 403)
    assert rebound.json()["error"] == {
        "message": "admin request refused: Host 'attacker.example:8001' is a name, not this machine's address: "
                   "without admin keys the admin port answers requests to 127.0.0.1, [::1] or localhost only",
        "type": "permission_error", "code": "admin_browser_request"}  # fmt: skip
    assert "Origin 'https://attacker.example'" in cross.json()["error"]["message"]
    assert timeout != 300 and events == []  # nothing was reloaded
    refusals = [r.getMessage() for r in caplog.records if r.name == "narwhal.router.admin"]
    assert [m.split(":")[0] for m in refusals] == ["admin GET /fleet refused", "admin PUT /fleet refused",
                                                   "admin GET /events refused"]  # fmt: skip


async def test_admin_keys_lift_the_web_page_checks(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(fleet_doc(server={"admin_api_keys": ADMIN_KEYS})) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            named = await admin.get("/fleet", headers={"host": "router.internal:8001", "origin": "https://ops.example",
                                                       "authorization": f"Bearer {ADMIN_KEYS[0]}"})  # fmt: skip
    assert named.status_code == 200


async def test_refused_admin_requests_are_logged_sparingly(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    from narwhal.router.admin import REFUSAL_LOG_INTERVAL_S

    async with open_stack(fleet_doc(server={"admin_api_keys": ADMIN_KEYS})) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            wrong = {"authorization": "Bearer guess"}
            # A client guessing keys in a loop: one warning, then the rest counted.
            statuses = [(await admin.get("/fleet", headers=wrong)).status_code for _ in range(50)]
            await admin.get("/metrics", headers=wrong)  # another route: a warning of its own
            await trio.sleep(REFUSAL_LOG_INTERVAL_S)
            statuses.append((await admin.get("/fleet", headers=wrong)).status_code)
    assert statuses == [401] * 51  # every one refused, logged or not
    logged = [r.getMessage() for r in caplog.records if r.name == "narwhal.router.admin"]
    assert logged == [
        "admin GET /fleet refused: missing or invalid admin key",
        "admin GET /metrics refused: missing or invalid admin key",
        "admin GET /fleet refused: missing or invalid admin key (49 more since the last warning)",
    ]


async def test_every_admin_key_is_compared_in_constant_time(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bytes] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return compare(a, b)

    monkeypatch.setattr(narwhal.router.keys.hmac, "compare_digest", counting)
    async with open_stack(fleet_doc(server={"admin_api_keys": ADMIN_KEYS})) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            for presented, status in [(ADMIN_KEYS[0], 200), (ADMIN_KEYS[1], 200), ("nope", 401)]:
                calls.clear()
                resp = await admin.get("/health", headers={"authorization": f"Bearer {presented}"})
                assert resp.status_code == status
                assert calls == [hashlib.sha256(k.encode()).digest() for k in ADMIN_KEYS]


def test_an_admin_key_is_never_a_client_key_and_no_key_is_in_a_repr() -> None:
    from narwhal.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_fleet(fleet_doc(server={"api_keys": KEYS, "admin_api_keys": ["other-admin-key", KEYS[1]]}))
    assert str(info.value) == ("an admin key must not also be a client key (server.api_keys): a client could "
                               "reload the fleet with it @ $.server.admin_api_keys[1]")  # fmt: skip
    config = parse_fleet(fleet_doc(server={"api_keys": KEYS, "admin_api_keys": ADMIN_KEYS}))
    shown = repr(config) + repr(config.server) + str(config)
    assert "admin_api_keys=<2 keys>" in shown
    assert not any(k in shown for k in [*KEYS, *ADMIN_KEYS])


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
     ("LOCALHOST", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("", False),
     ("10.1.2.3", False), ("192.168.0.7", False), ("fe80::1", False), ("admin.example", False),
     ("localhost.example", False)],
)  # fmt: skip
def test_only_loopback_admin_listeners_go_without_admin_keys(host: str, loopback: bool) -> None:
    from narwhal.router.keys import admin_listener_problem, is_loopback

    assert is_loopback(host) is loopback
    server = parse_fleet(fleet_doc(server={"admin_host": host or "0.0.0.0"})).server
    problem = admin_listener_problem(server, host)
    if loopback:
        assert problem is None
    else:
        assert problem is not None and problem.path == "$.server.admin_host"
        assert str(problem) == (
            f"admin_host {host!r} is not a loopback address and no admin key is set: anyone who reaches the "
            "admin port could read /events and reload the fleet with PUT /fleet; set server.admin_api_keys "
            "(or NARWHAL_ADMIN_KEY), or bind it to 127.0.0.1 @ $.server.admin_host"
        )
    assert (admin_listener_problem(server) is None) is loopback  # the server's own admin_host
    keyed = parse_fleet(fleet_doc(server={"admin_host": host or "0.0.0.0", "admin_api_keys": ADMIN_KEYS})).server
    assert admin_listener_problem(keyed, host) is None


def test_a_key_is_presented_as_a_bearer_token() -> None:
    from narwhal.router.keys import BearerKeys, bearer

    assert bearer(None) == {} and bearer("k-1") == {"authorization": "Bearer k-1"}
    keys = BearerKeys(["k-1"])
    assert keys.accepts(bearer("k-1")["authorization"]) and not keys.accepts(None)
    assert repr(keys) == "BearerKeys(<1 keys>)" and BearerKeys([]).accepts(None)


async def test_an_open_admin_listener_without_keys_does_not_start(tmp_path: Path) -> None:
    from narwhal.errors import ConfigError

    server = {"admin_port": 0, "port": 0, "admin_host": "0.0.0.0"}
    config = parse_fleet({"engines": UNREACHABLE, "server": server, "journal": {"path": str(tmp_path / "j.jsonl")}})
    with trio.fail_after(30):
        async with open_router(config) as router, trio.open_nursery() as nursery:
            with pytest.raises(ConfigError) as info:
                await nursery.start(router.serve_admin_tcp)
            assert info.value.path == "$.server.admin_host"
            await router.shutdown(0)


async def test_put_fleet_can_be_turned_off(autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    doc = fleet_doc(server={"admin_fleet_writes": False})
    async with open_stack(doc) as stack, _fleet_records(stack) as events:
        stack.net.listen(*ADMIN, stack.router.admin)
        config = stack.router.state.config
        changed = fleet_doc(server={"admin_fleet_writes": False}, engine={"request_timeout_s": 300})
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://127.0.0.1:8001") as admin:
            resp = await admin.put("/fleet", content=json.dumps(changed).encode())
            view = await admin.get("/fleet")
        assert stack.router.state.config is config
    assert resp.status_code == 403 and resp.json() == {"error": {
        "message": "PUT /fleet is turned off on this router (server.admin_fleet_writes is false): change the fleet "
                   "document and send SIGHUP",
        "type": "permission_error", "code": "fleet_writes_disabled"}}  # fmt: skip
    assert view.status_code == 200 and events == []
    assert "PUT /fleet refused: server.admin_fleet_writes is false" in [r.getMessage() for r in caplog.records]


async def test_admin_keys_are_never_shown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "ADMINSECRET-7d1f"
    keys = [f"{secret}-a", f"{secret}-b"]
    server = {"admin_port": 0, "port": 0, "admin_api_keys": keys}
    doc = {"engines": UNREACHABLE, "server": server, "journal": {"path": str(tmp_path / "j.jsonl")}}
    config = parse_fleet(doc)
    shown = [repr(config), str(config.server)]
    with trio.fail_after(60):
        async with open_router(config) as router, trio.open_nursery() as nursery:
            [(_, port)] = await nursery.start(router.serve_admin_tcp)
            base = f"http://127.0.0.1:{port}"
            good = {"authorization": f"Bearer {keys[0]}"}
            async with open_events(base, keys[1]) as ws, httpx.AsyncClient(base_url=base, trust_env=False) as client:
                for headers in ({}, {"authorization": f"Bearer {secret}-wrong"}, good):
                    for route in ("/metrics", "/fleet", "/health", "/nothing"):
                        shown.append((await client.get(route, headers=headers)).text)
                # Documents that would change the admin keys, or drop them: refused, naming the path.
                for changed in ([f"{secret}-c"], [], [keys[1], keys[0]]):
                    body = json.dumps({**doc, "server": {**server, "admin_api_keys": changed}})
                    resp = await client.put("/fleet", content=body, headers=good)
                    assert resp.status_code == 400 and resp.json()["error"]["path"] == "$.server.admin_api_keys"
                    shown.append(resp.text)
                rejected = 0
                while rejected < 3:
                    message = await ws.get_message()
                    shown.append(message)
                    rejected += json.loads(message).get("event") == "rejected"
            await router.shutdown(0)
            nursery.cancel_scope.cancel()
    shown.append((tmp_path / "j.fleet.jsonl").read_text())
    shown.extend(JSONFormatter().format(r) for r in caplog.records)
    text = "\n".join(shown)
    assert "$.server.admin_api_keys" in text and "admin key" in text
    assert secret not in text
