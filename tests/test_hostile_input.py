"""Hostile input through the whole router (in memory, virtual time).

The HTTP server's own fuzzing and limits are tested in test_http_server.py against a
bare handler; here the router's routes and request lifecycle sit behind them:

- any request body (property-based: JSON of any shape, known fields of any type,
  huge and negative numbers, NaN, unknown fields, raw bytes) gives 200 or a 4xx in
  the OpenAI error shape, never a 5xx, with exactly one journal record, and no
  engine's breaker ever counts it;
- the named cases: wrong types, missing prompt, ``n > 1``, unknown model (404),
  prompts the engine rejects, bodies nested too deeply, hostile ``x-request-id``;
- slow clients (408 at the header and body timeouts), oversized bodies (413) and
  heads (431), pipelined requests, ``Expect: 100-continue``;
- a client disconnect at every phase: nothing is left running on the router or on
  the engines, and a request that was admitted is journaled ``client_cancelled``.
"""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings

from narwhal.config import FaultSpec, ServerConfig

from .loadkit import Outcome, exchange, read_response, request_bytes
from .routerkit import ROUTER_HOST, ROUTER_PORT, Stack, engine, fleet_doc, open_stack

MAX_MODEL_LEN = 256
LIMITS = {
    "max_body_bytes": 4096,
    "max_header_bytes": 2048,
    "header_timeout_s": 3.0,
    "body_timeout_s": 4.0,
    "keepalive_timeout_s": 20.0,
}


def hostile_doc(**sections: Any) -> dict[str, Any]:
    server = {**LIMITS, **sections.pop("server", {})}
    return fleet_doc(
        engine("p0", 8101, ["prefill"], max_model_len=MAX_MODEL_LEN),
        engine("d0", 8102, ["decode"], max_model_len=MAX_MODEL_LEN),
        server=server,
        **sections,
    )


async def post(stack: Stack, body: dict[str, Any] | bytes, *, rid: str = "hostile",
               path: str = "/v1/completions", headers: tuple[tuple[str, str], ...] = ()) -> Outcome:
    conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
    return await exchange(conn, body, request_id=rid, path=path, headers=headers)


def assert_error_shape(out: Outcome) -> None:
    assert out.error is not None, out
    assert set(out.error) == {"message", "type", "code"}, out.error
    assert isinstance(out.error["message"], str) and out.error["message"]
    assert "Traceback" not in out.error["message"]


def assert_untouched_breaker(stack: Stack) -> None:
    breaker = stack.router.state.breaker
    assert breaker.transitions == []
    assert all(st.streak == 0 and not st.ejected for st in breaker.states.values())


# ------------------------------------------------------------------ request bodies

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_number = st.one_of(
    st.integers(-(10**30), 10**30), st.integers(-2, 300), st.floats(), st.sampled_from([0, 1, 2, -1, 10**400]),
)
_known = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(
            st.text(max_size=40), st.lists(st.integers(-3, 40_000), max_size=6),
            st.lists(st.text(max_size=4), max_size=3), _json,
        ),
        "messages": st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                            "content": st.one_of(st.text(max_size=20), _json)}), max_size=3),
            _json,
        ),
        "max_tokens": st.one_of(_number, _json),
        "max_completion_tokens": st.one_of(_number, _json),
        "n": st.one_of(_number, _json),
        "best_of": _number,
        "model": st.one_of(st.just("sim-llama"), st.text(max_size=10), _json),
        "stream": st.one_of(st.booleans(), _json),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": _json}), _json),
        "temperature": st.one_of(_number, _json),
        "return_token_ids": _json,
        "kv_transfer_params": _json,
        "vllm_xargs": _json,
        "unknown_field": _json,
    },
)
# Small enough to leave room for the output under MAX_MODEL_LEN, mostly.
_bodies = st.one_of(
    _known.map(lambda b: json.dumps(b).encode()),
    _json.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=64),
)
# Any header value the server accepts (and some it refuses).
_request_ids = st.binary(min_size=1, max_size=40).map(lambda b: b.decode("latin-1"))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(
        st.tuples(_bodies, st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                  st.one_of(st.none(), _request_ids)),
        min_size=1, max_size=8,
    )
)
async def test_any_body_gives_200_or_4xx(
    autojump_clock: trio.abc.Clock, requests: list[tuple[bytes, str, str | None]]
) -> None:
    async with open_stack(hostile_doc()) as stack:
        for i, (body, path, rid) in enumerate(requests):
            records = len(stack.records)
            conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
            outcome = Outcome(f"fuzz-{i}")
            headers = [] if rid is None else [("x-request-id", rid)]
            try:
                raw = request_bytes(body, path=path, headers=headers)
            except Exception:  # h11 (the client) refuses to send this value: send it anyway
                raw = (f"POST {path} HTTP/1.1\r\nhost: r\r\ncontent-length: {len(body)}\r\n").encode()
                raw += b"x-request-id: " + (rid or "").encode("latin-1") + b"\r\n\r\n" + body
            await conn.send_all(raw)
            await read_response(conn, outcome)
            await conn.aclose()
            assert outcome.complete, (body, outcome)
            assert outcome.status == 200 or 400 <= outcome.status < 500, (body, outcome)
            if outcome.status != 200:
                assert_error_shape(outcome)
            elif outcome.headers["content-type"] == "text/event-stream":
                assert outcome.done and outcome.error is None and outcome.tokens > 0
            else:
                assert json.loads(outcome.body)["choices"]
            new = stack.records[records:]
            refused = outcome.error is not None and outcome.error["message"].startswith(
                "malformed HTTP request"
            )
            if outcome.status in (413, 431) or refused:
                assert new == []  # refused by the HTTP layer, never admitted
            else:  # admitted: exactly one journal record, with the status answered
                [record] = new
                assert record["status"] == outcome.status
                assert record["terminal_class"] in ("ok", "invalid_request")
                assert record["request_id"] == outcome.headers["x-request-id"]
        assert_untouched_breaker(stack)


def _deep(depth: int) -> bytes:
    return b'{"prompt": "a", "max_tokens": 2, "x": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"prompt": "a", "max_tokens": -1}, 400, "'max_tokens' must be >= 1"),
        ({"prompt": "a", "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
        ({"prompt": "a", "max_tokens": 10**400}, 400, "'max_tokens' is too large"),
        ({"prompt": "a", "max_tokens": 10**30}, 400, "maximum context length"),
        ({"prompt": "a", "max_tokens": 1.5}, 400, "'max_tokens' must be an integer"),
        ({"prompt": "a", "max_tokens": "3"}, 400, "'max_tokens' must be an integer"),
        ({"prompt": "a", "max_tokens": True}, 400, "'max_tokens' must be an integer"),
        ({"max_tokens": 3}, 400, "'prompt' is required"),
        ({"prompt": None}, 400, "'prompt' is required"),
        ({"prompt": 5}, 400, "'prompt' must be"),
        ({"prompt": []}, 400, "'prompt' must be"),
        ({"prompt": [1, "a"]}, 400, "'prompt' must be"),
        ({"prompt": [-1]}, 400, "'prompt' must be"),
        ({"prompt": ["a", "b"]}, 400, "batched prompts"),
        # Prompts only the engine can judge: its 400 is the client's answer, not a 502.
        ({"prompt": [10**30], "max_tokens": 2}, 400, "token ids must be in"),
        ({"prompt": [40_000], "max_tokens": 2}, 400, "token ids must be in"),
        ({"prompt": "", "max_tokens": 2}, 400, "prompt cannot be empty"),
        ({"prompt": "a", "n": 2}, 400, "'n' > 1"),
        ({"prompt": "a", "n": 0}, 400, "'n' must be >= 1"),
        ({"prompt": "a", "n": "2"}, 400, "'n' must be an integer"),
        ({"prompt": "a", "best_of": 3}, 400, "'best_of' > 1"),
        ({"prompt": "a", "model": "nope"}, 404, "does not exist"),
        ({"prompt": "a", "model": 5}, 400, "'model' must be a string"),
        ({"prompt": "a", "stream": "yes"}, 400, "'stream' must be a boolean"),
        ({"prompt": "a", "stream_options": "x"}, 400, "'stream_options' must be an object"),
        ({"prompt": "a", "max_tokens": 2, "zzz": {"deep": [1, {"x": None}]}}, 200, None),
        ({"prompt": "a", "max_tokens": 2, "temperature": 1e308, "top_p": -5}, 200, None),
        ({"prompt": "a", "max_tokens": 2, "n": 1, "best_of": 1, "model": "sim-llama"}, 200, None),
        (b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}', 200, None),
        (b"not json", 400, "not valid JSON"),
        (b"\xff\xfe{}", 400, "not valid JSON"),
        (b"[]", 400, "JSON object"),
        (b"null", 400, "JSON object"),
        (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),
        (b"[" * 3000, 400, "nested more than 64 levels"),
        (_deep(64), 400, "nested more than 64 levels"),
        (_deep(950), 400, "nested more than 64 levels"),
        (_deep(60), 200, None),
    ],
    ids=lambda v: None if not isinstance(v, bytes | dict) else repr(v)[:40],
)
async def test_completions_bodies(
    autojump_clock: trio.abc.Clock, body: dict[str, Any] | bytes, status: int, fragment: str | None
) -> None:
    doc = hostile_doc(server={"max_body_bytes": 1 << 20})
    async with open_stack(doc) as stack:
        out = await post(stack, body)
        assert out.status == status, out
        if fragment is not None:
            assert_error_shape(out)
            assert fragment in out.error["message"], out.error  # type: ignore[index]
        [record] = stack.records
        assert record["terminal_class"] == ("ok" if status == 200 else "invalid_request")
        assert record["status"] == status
        assert_untouched_breaker(stack)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"max_tokens": 2}, 400, "'messages' must be a non-empty list"),
        ({"messages": []}, 400, "'messages' must be a non-empty list"),
        ({"messages": ["hi"]}, 400, "each item of 'messages' must be an object"),
        ({"messages": [{"role": "user", "content": 5}], "max_tokens": 2}, 400, None),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, 400, "must be >= 1"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, 200, None),
    ],
)
async def test_chat_bodies(
    autojump_clock: trio.abc.Clock, body: dict[str, Any], status: int, fragment: str | None
) -> None:
    async with open_stack(hostile_doc()) as stack:
        out = await post(stack, body, path="/v1/chat/completions")
        assert out.status == status, out
        if status != 200:
            assert_error_shape(out)
        if fragment is not None:
            assert fragment in out.error["message"]  # type: ignore[index]
        assert [r["status"] for r in stack.records] == [status]
        assert_untouched_breaker(stack)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "raw", "where"),
    [
        ("/v1/completions", rb'{"prompt": "ab\udc80cd", "max_tokens": 2', "'prompt'"),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "ab\udc80cd"}], "max_tokens": 2',
         "'messages[0].content'"),
    ],
)
async def test_a_lone_surrogate_is_a_400_not_a_500(
    autojump_clock: trio.abc.Clock, path: str, raw: bytes, where: str, stream: bool
) -> None:
    # Before: 500 "internal error" and a traceback in the log for every such request
    # (the engine leg could not encode the body).
    body = raw + (b', "stream": true}' if stream else b"}")
    async with open_stack(hostile_doc()) as stack:
        out = await post(stack, body, path=path)
        assert out.status == 400, out
        assert_error_shape(out)
        assert out.error["message"].startswith(f"{where} is not valid Unicode"), out.error  # type: ignore[index]
        assert out.error["code"] == "invalid_value"  # type: ignore[index]
        [record] = stack.records
        assert (record["terminal_class"], record["status"]) == ("invalid_request", 400)
        assert stack.engine("p0").requests_seen == [] and stack.engine("d0").requests_seen == []
        assert_untouched_breaker(stack)


async def test_engine_rejections_of_client_input_never_eject_engines(autojump_clock: trio.abc.Clock) -> None:
    # Before: the engine's 400 became a 502 counted by the breaker, so three bad
    # prompts ejected the only producer and every later client got 503.
    doc = hostile_doc(recovery={"eject_after": 3})
    async with open_stack(doc) as stack:
        for i in range(10):
            out = await post(stack, {"prompt": [99_999], "max_tokens": 2}, rid=f"bad-{i}")
            assert out.status == 400
        assert (await post(stack, {"prompt": "a b", "max_tokens": 2}, rid="good")).ok
    assert_untouched_breaker(stack)
    assert [r["terminal_class"] for r in stack.records] == ["invalid_request"] * 10 + ["ok"]


@pytest.mark.parametrize(
    ("header", "kept"),
    [
        (b"client-42", True),
        (b"caf\xe9", False),  # latin-1: not ASCII, cannot be sent on to the engines
        (b"a" * 201, False),
        (b"tab\there", False),
        (b"", False),
    ],
)
async def test_hostile_request_ids(autojump_clock: trio.abc.Clock, header: bytes, kept: bool) -> None:
    async with open_stack(hostile_doc()) as stack:
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        body = b'{"prompt": "a b", "max_tokens": 2}'
        await conn.send_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\nx-request-id: %s\r\n\r\n%s"
            % (len(body), header, body)
        )
        out = await read_response(conn, Outcome("x"))
        await conn.aclose()
        assert out.status == 200, out
        rid = out.headers["x-request-id"]
        assert (rid == header.decode("latin-1")) is kept
        assert rid.isascii() and rid.isprintable()
        assert [r["request_id"] for r in stack.records] == [rid]


# ------------------------------------------------------------------ the HTTP layer


async def test_slow_head_and_slow_body_get_408(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(hostile_doc()) as stack:
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        t0 = trio.current_time()
        await conn.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\n")  # never finished
        out = await read_response(conn, Outcome("slow-head"))
        assert out.status == 408 and trio.current_time() - t0 == pytest.approx(LIMITS["header_timeout_s"])
        await conn.aclose()

        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        t0 = trio.current_time()
        await conn.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 100\r\n\r\n{")
        out = await read_response(conn, Outcome("slow-body"))
        assert out.status == 408 and trio.current_time() - t0 == pytest.approx(LIMITS["body_timeout_s"])
        await conn.aclose()
        # Neither request was admitted: nothing to journal, nothing sent to an engine.
        assert stack.records == []
        assert stack.engine("p0").requests_seen == []


async def test_slow_reader_is_not_engine_silence(autojump_clock: trio.abc.Clock) -> None:
    # A client that stops reading for longer than decode_read_timeout_s holds the
    # stream back; the router must not call that engine silence.
    async with open_stack(hostile_doc()) as stack:
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        await conn.send_all(request_bytes({"prompt": "a b", "max_tokens": 200, "stream": True}, request_id="slow"))
        await trio.sleep(10.0)  # 5x the silence timeout without reading a byte
        out = await read_response(conn, Outcome("slow"))
        await conn.aclose()
    assert out.ok and out.tokens == 200
    assert stack.records[0]["terminal_class"] == "ok"


async def test_a_client_that_stops_reading_ends_its_request_after_the_send_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A stream the client stops reading (its connection open: the write waits for it)
    # ends server.send_timeout_s after the last write made progress, as a disconnect:
    # the decode leg cancelled, its engine connection closed, the request journaled.
    # Before: it waited until engine.request_timeout_s (600 s), holding the decode
    # engine's sequence and KV all along.
    send_timeout = ServerConfig().send_timeout_s  # the shipped default
    async with open_stack(hostile_doc(engine={"request_timeout_s": 10 * send_timeout})) as stack:
        journaled = trio.Event()
        stack.router.state.journal.add_listener(lambda _: journaled.set())
        client, server_end = trio.testing.lockstep_stream_pair()  # each write waits for its read
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stack.router.server.handle_connection, server_end)
            await client.send_all(request_bytes({"prompt": "a b", "max_tokens": 200, "stream": True}, request_id="stop"))
            head = await client.receive_some(1 << 20)  # the head and the first token
            assert head.startswith(b"HTTP/1.1 200 OK")
            stopped = trio.current_time()
            await journaled.wait()
            # The next token's write waited from the decode step after the last read.
            assert trio.current_time() - stopped == pytest.approx(send_timeout, abs=1.0)
            await trio.testing.wait_all_tasks_blocked()
            assert stack.router.state.in_flight == 0
            assert stack.engine("d0").stats.active == 0  # the decode leg ended with it
            await client.aclose()
    [record] = stack.records
    assert (record["terminal_class"], record["status"]) == ("client_cancelled", 200)
    assert record["error"] == f"client read nothing for {send_timeout:g} s (send timeout)"
    assert 0 < record["output_len"] < 200


@pytest.mark.parametrize("chunked", [False, True])
async def test_oversized_body_gets_413(autojump_clock: trio.abc.Clock, chunked: bool) -> None:
    async with open_stack(hostile_doc()) as stack:
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        body = json.dumps({"prompt": "x" * 5000}).encode()
        if chunked:
            head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
            payload = head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        else:
            payload = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        try:
            await conn.send_all(payload)
        except trio.BrokenResourceError:
            pass
        out = await read_response(conn, Outcome("big"))
        await conn.aclose()
        assert out.status == 413
        assert_error_shape(out)
        assert stack.records == []


async def test_oversized_head_gets_431(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(hostile_doc()) as stack:
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        try:
            await conn.send_all(
                request_bytes({"prompt": "a"}, headers=[("x-junk", "j" * LIMITS["max_header_bytes"])])  # type: ignore[list-item]
            )
        except trio.BrokenResourceError:
            pass
        out = await read_response(conn, Outcome("big-head"))
        await conn.aclose()
        assert out.status == 431
        assert stack.records == []


async def test_pipelined_requests_are_answered_in_order(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(hostile_doc()) as stack:
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        await conn.send_all(
            request_bytes({"prompt": "a b", "max_tokens": 30, "stream": True}, request_id="first")
            + request_bytes({"prompt": "c d", "max_tokens": 2}, request_id="second")
            + request_bytes(b"oops", request_id="third")
        )
        import h11

        h = h11.Connection(h11.CLIENT)
        outcomes = []
        for rid in ("first", "second", "third"):
            h.send(h11.Request(method="POST", target="/", headers=[("host", "r"), ("content-length", "0")]))
            h.send(h11.EndOfMessage())
            outcomes.append(await read_response(conn, Outcome(rid), h))
            if h.our_state is h11.DONE and h.their_state is h11.DONE:
                h.start_next_cycle()
        await conn.aclose()
    assert [o.headers["x-request-id"] for o in outcomes] == ["first", "second", "third"]
    assert outcomes[0].ok and outcomes[0].tokens == 30
    assert outcomes[1].ok
    assert outcomes[2].status == 400
    assert [r["request_id"] for r in stack.records] == ["first", "second", "third"]


async def test_expect_100_continue(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(hostile_doc()) as stack:
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        body = json.dumps({"prompt": "a b", "max_tokens": 3}).encode()
        await conn.send_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        interim = await conn.receive_some()
        assert interim.startswith(b"HTTP/1.1 100 ")
        await conn.send_all(body)
        out = await read_response(conn, Outcome("continue"))
        await conn.aclose()
        assert out.ok

        # Too large: refused at once, without a 100 and without reading the body.
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        await conn.send_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\ncontent-length: 999999\r\n\r\n"
        )
        out = await read_response(conn, Outcome("too-big"))
        await conn.aclose()
        assert out.status == 413
    assert [r["terminal_class"] for r in stack.records] == ["ok"]


# ------------------------------------------------------------------ disconnects

_STREAM = {"prompt": "one two three four", "max_tokens": 200, "stream": True}
_PLAIN = {"prompt": "one two three four", "max_tokens": 200}


@pytest.mark.parametrize(
    ("phase", "payload", "fault", "journaled"),
    [
        # Not admitted yet: nothing to journal.
        ("mid-head", b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-le", None, False),
        ("mid-body", b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 80\r\n\r\n{\"pro", None, False),
        # Admitted: the legs in flight are cancelled at once.
        ("prefill", request_bytes(_STREAM), FaultSpec(kind="delay_headers", on="prefill", delay_s=100.0), True),
        ("transfer", request_bytes(_STREAM), FaultSpec(kind="slow_transfer", on="decode", delay_s=3.0), True),
        ("before-first-token", request_bytes(_STREAM), FaultSpec(kind="delay_headers", on="decode", delay_s=3.0), True),
        ("mid-stream", request_bytes(_STREAM), None, True),
        ("mid-silence", request_bytes(_STREAM), FaultSpec(kind="silence_after", on="decode", after_tokens=2), True),
        ("plain-decoding", request_bytes(_PLAIN), None, True),
    ],
)
async def test_client_disconnect_at_every_phase(
    autojump_clock: trio.abc.Clock, phase: str, payload: bytes, fault: FaultSpec | None, journaled: bool
) -> None:
    async with open_stack(hostile_doc()) as stack:
        if fault is not None:
            stack.engine("p0" if fault.on == "prefill" else "d0").inject(fault)
        conn = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        await conn.send_all(payload)
        await trio.sleep(0.5)  # inside the phase: every fault above holds it for longer
        assert stack.router.state.in_flight == (1 if journaled else 0)
        await conn.aclose()
        t_closed = trio.current_time()
        await trio.testing.wait_all_tasks_blocked()
        # Everything the request started ended when the client left, not later.
        assert trio.current_time() == t_closed
        assert stack.router.state.in_flight == 0
        assert stack.router.server.in_flight == 0
        for sim in stack.fleet.engines.values():
            assert sim.stats.active == 0
        stack.assert_clean()
    if journaled:
        [record] = stack.records
        assert record["terminal_class"] == "client_cancelled"
        assert record["status"] == (200 if phase in ("mid-stream", "mid-silence") else 499)
    else:
        assert stack.records == []
