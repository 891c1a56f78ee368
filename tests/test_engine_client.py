"""EngineClient against scripted engines (httpx.MockTransport with async byte streams)."""

from __future__ import annotations

import functools
import gc
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.engines.client import DecodeStream, EngineClient, EngineIdentity
from narwhal.engines.connector import (
    CONNECTOR_MISMATCH,
    ENDPOINT_MISMATCH,
    MISSING_DESCRIPTOR,
    TRANSFER_KEYS,
    UNEXPECTED_FINISH_REASON,
    PrefillResult,
    prefill_request_params,
)
from narwhal.engines.sse import Chunk, json_dumps
from narwhal.engines.stream import SILENCE_SLACK
from narwhal.errors import (
    EmptyStream,
    EngineHTTPError,
    EngineProtocolError,
    EngineStreamError,
    EngineTimeout,
    EngineUnavailable,
    InvalidDescriptor,
    StreamClosed,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RECORDING = (FIXTURES / "completions-stream-token-ids.sse").read_bytes()
RECORDED_EVENTS = RECORDING.split(b"\n\n")[:-1]  # each without its blank line
METRICS_IDLE = (FIXTURES / "metrics-idle.prom").read_text()
METRICS_AFTER = (FIXTURES / "metrics-decode-after-nixl.prom").read_text()

URL = "http://127.0.0.1:8101"


@attrs.frozen
class Connector:
    type: str = "NixlConnector"
    kv_host: str = "127.0.0.1"
    kv_port: int = 15600


DESCRIPTOR: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3, 4, 5]],
    "remote_engine_id": "170b2847-5d0e-4d7c-9b51-3f0f6a1c2e11",
    "remote_request_id": "cmpl-8fa70bf330c08a6d-0-bb540027",
    "remote_host": "localhost",
    "remote_port": 15600,
    "tp_size": 1,
    "dcp_size": 1,
    "transfer_mode": "pull",
}


class ScriptedStream(httpx.AsyncByteStream):
    """A response body: parts with virtual-time gaps, then an end, an error or a hang."""

    def __init__(
        self,
        parts: list[bytes],
        *,
        gap_s: float = 0.0,
        then: BaseException | None = None,
        hang: bool = False,
    ) -> None:
        self.parts = parts
        self.gap_s = gap_s
        self.then = then
        self.hang = hang
        self.sent = 0
        self.closed = False
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            for part in self.parts:
                if self.gap_s:
                    await trio.sleep(self.gap_s)
                self.sent += 1
                yield part
            if self.then is not None:
                raise self.then
            if self.hang:
                await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled = True
            raise

    async def aclose(self) -> None:
        self.closed = True


@attrs.define
class Engine:
    """Routes requests to scripted answers and records what it was sent."""

    routes: dict[tuple[str, str], Callable[[httpx.Request], Awaitable[httpx.Response]]] = (
        attrs.Factory(dict)
    )
    requests: list[httpx.Request] = attrs.Factory(list)

    def on(
        self, method: str, path: str, answer: Callable[[httpx.Request], Awaitable[httpx.Response]]
    ) -> None:
        self.routes[(method, path)] = answer

    def reply(self, method: str, path: str, response: Callable[[], httpx.Response]) -> None:
        async def answer(request: httpx.Request) -> httpx.Response:
            return response()

        self.on(method, path, answer)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.routes.get((request.method, request.url.path))
        if answer is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        return await answer(request)

    def body(self, index: int = -1) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.requests[index].content)
        return result

    def client(self, **kwargs: Any) -> EngineClient:
        kwargs.setdefault("name", "e0")
        kwargs.setdefault("connector", Connector())
        return EngineClient(URL, transport=httpx.MockTransport(self.handle), **kwargs)


def sse(parts: list[bytes], **kwargs: Any) -> Callable[[], httpx.Response]:
    def make() -> httpx.Response:
        stream = ScriptedStream(parts, **kwargs)
        LAST_STREAMS.append(stream)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)

    return make


LAST_STREAMS: list[ScriptedStream] = []


@pytest.fixture(autouse=True)
def _reset_streams() -> None:
    LAST_STREAMS.clear()


def event(obj: Any) -> bytes:
    return b"data: " + json_dumps(obj) + b"\n\n"


def completion_event(ids: list[int], text: str = "x", finish: str | None = None) -> bytes:
    return event(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "tiny-llama",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "token_ids": ids}],
        }
    )


DONE = b"data: [DONE]\n\n"


def prefill_answer(
    *, descriptor: Any = DESCRIPTOR, finish: str = "length", status: int = 200
) -> Callable[[], httpx.Response]:
    def make() -> httpx.Response:
        return httpx.Response(
            status,
            json={
                "id": "cmpl-p",
                "object": "text_completion",
                "model": "tiny-llama",
                "choices": [
                    {
                        "index": 0,
                        "text": "q",
                        "finish_reason": finish,
                        "token_ids": [77],
                        "prompt_token_ids": [1, 2, 3],
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                "kv_transfer_params": descriptor,
            },
        )

    return make


CLIENT_BODY: dict[str, Any] = {
    "model": "tiny-llama",
    "prompt": "hello world",
    "max_tokens": 64,
    "temperature": 0.5,
    "stream": True,
    "stream_options": {"include_usage": False, "continuous_usage_stats": True},
    "min_tokens": 4,
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "attacker", "remote_port": 1},
}


async def run_prefill(
    engine: Engine, body: dict[str, Any] | None = None, **kwargs: Any
) -> PrefillResult:
    async with engine.client() as client:
        return await client.prefill(body or CLIENT_BODY, **kwargs)


async def collect(stream: DecodeStream) -> list[Chunk]:
    return [chunk async for chunk in stream]


# --------------------------------------------------------------------------- prefill


async def test_prefill_sends_the_vllm_proxy_body(autojump_clock: trio.testing.MockClock) -> None:
    engine = Engine()

    async def slow(request: httpx.Request) -> httpx.Response:
        await trio.sleep(0.25)
        return prefill_answer()()

    engine.on("POST", "/v1/completions", slow)
    start = trio.current_time()
    async with engine.client(api_key="sk-test") as client:
        # Stop strings and stop token ids go to the decode leg only: the discarded token
        # completing one would end the prefill with "stop", which hands off nothing.
        body = {**CLIENT_BODY, "stop": ["\n"], "stop_token_ids": [13]}
        result = await client.prefill(body, request_id="rid-1")

    assert engine.body() == {
        "model": "tiny-llama",
        "prompt": "hello world",
        "max_tokens": 1,
        "temperature": 0.5,
        "stream": False,
        "return_token_ids": True,
        "kv_transfer_params": prefill_request_params(),
        "ignore_eos": True,  # the one token must end by the length cap: a handoff follows
    }
    request = engine.requests[0]
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.headers["x-request-id"] == "rid-1"
    assert request.headers["content-type"] == "application/json"

    assert result.parameters() == DESCRIPTOR
    assert result.producer == "e0"
    assert result.producer_url == URL
    assert result.endpoint == ("localhost", 15600)
    assert result.backend_request_id == "rid-1"
    assert result.connector == "NixlConnector"
    assert result.kind == "completions"
    assert dict(result.request) == body
    assert result.prompt_tokens == 3
    assert result.started_at == start
    assert result.completed_at == start + 0.25


async def test_prefill_chat_caps_both_limits() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/chat/completions", prefill_answer())
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50,
    }
    result = await run_prefill(engine, body, kind="chat")
    sent = engine.body()
    assert sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    assert sent["messages"] == body["messages"]
    assert sent["stream"] is False
    assert result.kind == "chat"
    # A fresh backend request id when none is given.
    assert result.backend_request_id == engine.requests[0].headers["x-request-id"]


async def test_prefill_fills_in_the_configured_model() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", prefill_answer())
    async with engine.client(model="served") as client:
        await client.prefill({"prompt": "p", "max_tokens": 3})
    assert engine.body()["model"] == "served"


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (prefill_answer(descriptor=None), MISSING_DESCRIPTOR),
        (prefill_answer(finish="stop", descriptor=None), UNEXPECTED_FINISH_REASON),
        (prefill_answer(finish="stop"), UNEXPECTED_FINISH_REASON),
        (prefill_answer(descriptor={**DESCRIPTOR, "remote_port": 9}), ENDPOINT_MISMATCH),
    ],
)
async def test_prefill_descriptor_failures(
    answer: Callable[[], httpx.Response], reason: str
) -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", answer)
    with pytest.raises(InvalidDescriptor) as info:
        await run_prefill(engine)
    assert info.value.reason.startswith(reason)
    assert info.value.engine == "e0" and info.value.leg == "prefill"


async def test_prefill_without_transfer() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", prefill_answer(descriptor=None, finish="stop"))
    async with engine.client(connector=None) as client:
        result = await client.prefill(CLIENT_BODY, transfer=False)
        with pytest.raises(ValueError, match="same-worker"):
            client.decode(result)
    sent = engine.body()
    assert not TRANSFER_KEYS & sent.keys()
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert "stream_options" not in sent and "min_tokens" not in sent
    assert result.transfer is False
    assert result.parameters() == {} and result.endpoint is None
    assert result.prompt_tokens == 3


async def test_prefill_refuses_an_unsupported_connector_before_sending() -> None:
    engine = Engine()
    with pytest.raises(InvalidDescriptor, match=CONNECTOR_MISMATCH):
        async with engine.client(connector=Connector(type="MooncakeConnector")) as client:
            await client.prefill(CLIENT_BODY)
    assert engine.requests == []


async def test_prefill_http_error_keeps_status_and_message() -> None:
    engine = Engine()
    message = "This model's maximum context length is 2048 tokens. " * 40
    engine.reply(
        "POST",
        "/v1/completions",
        lambda: httpx.Response(
            400,
            json={
                "error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            },
        ),
    )
    with pytest.raises(EngineHTTPError) as info:
        await run_prefill(engine)
    err = info.value
    assert err.upstream_status == 400
    assert not err.transient
    assert "maximum context length is 2048 tokens" in str(err)
    assert len(str(err)) < 600  # truncated
    assert err.engine == "e0" and err.leg == "prefill"


async def test_prefill_error_object_in_a_200() -> None:
    engine = Engine()
    engine.reply(
        "POST",
        "/v1/completions",
        lambda: httpx.Response(
            200, json={"object": "error", "message": "bad", "type": "x", "code": 422}
        ),
    )
    with pytest.raises(EngineStreamError) as info:
        await run_prefill(engine)
    assert info.value.http_status == 422


async def test_prefill_non_json_answer() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", lambda: httpx.Response(200, text="<html>"))
    with pytest.raises(EngineProtocolError):
        await run_prefill(engine)


def raising(exc: Exception) -> Callable[[httpx.Request], Awaitable[httpx.Response]]:
    async def answer(request: httpx.Request) -> httpx.Response:
        raise exc

    return answer


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (httpx.ConnectError("connection refused"), EngineUnavailable),
        (httpx.ConnectTimeout("connect timed out"), EngineTimeout),
        (httpx.PoolTimeout("pool"), EngineTimeout),
        (httpx.ReadError("connection reset"), StreamClosed),
        (httpx.RemoteProtocolError("server disconnected without sending a response"), StreamClosed),
        (httpx.WriteError("broken pipe"), StreamClosed),
        (httpx.ReadTimeout("read timed out"), EngineTimeout),
        (httpx.UnsupportedProtocol("ftp"), EngineUnavailable),
    ],
)
async def test_prefill_transport_errors(exc: Exception, expected: type[Exception]) -> None:
    engine = Engine()
    engine.on("POST", "/v1/completions", raising(exc))
    with pytest.raises(expected) as info:
        await run_prefill(engine)
    assert type(info.value) is expected
    assert info.value.__cause__ is exc
    # Timeout-shaped faults are 504s, every other engine fault a 502.
    assert info.value.http_status == (504 if isinstance(exc, httpx.TimeoutException) else 502)


# --------------------------------------------------------------------------- decode


async def prefill_result(engine: Engine) -> PrefillResult:
    engine.reply("POST", "/v1/completions", prefill_answer())
    result = await run_prefill(engine)
    engine.requests.clear()
    return result


async def test_remote_decode_carries_the_descriptor(autojump_clock: trio.testing.MockClock) -> None:
    engine = Engine()
    result = await prefill_result(engine)
    engine.reply("POST", "/v1/completions", sse([RECORDING]))
    async with engine.client() as client:
        async with client.decode(result, request_id="rid-d") as stream:
            chunks = await collect(stream)

    sent = engine.body()
    assert sent["kv_transfer_params"] == DESCRIPTOR
    assert sent["stream"] is True
    assert sent["return_token_ids"] is True
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent["max_tokens"] == 64  # the client's own limit, not the prefill's
    assert sent["min_tokens"] == 4
    assert engine.requests[0].headers["x-request-id"] == "rid-d"
    assert engine.requests[0].headers["accept"] == "text/event-stream"

    assert [c.kind for c in chunks] == ["token"] * 20 + ["meta"]
    assert stream.tokens == 20
    assert stream.done and stream.closed
    assert stream.first_token_at is not None
    assert stream.finish_reason in ("length", "stop")
    assert stream.usage is not None and stream.usage["completion_tokens"] == 20
    assert stream.prefill is result and stream.request_id == "rid-d"
    assert b"".join(c.raw for c in chunks) + DONE == RECORDING
    assert LAST_STREAMS[0].closed


async def test_same_worker_decode_strips_all_transfer_params() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse([RECORDING]))
    body = {**CLIENT_BODY, "remote_host": "attacker", "disaggregated_params": {"x": 1}}
    async with engine.client() as client:
        async with client.decode(None, body) as stream:
            await collect(stream)
    sent = engine.body()
    assert not TRANSFER_KEYS & sent.keys()
    assert sent["prompt"] == "hello world" and sent["stream"] is True
    assert stream.prefill is None


async def test_chat_decode_counts_reasoning_tokens() -> None:
    engine = Engine()
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"}
    parts = [
        event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        event(
            {
                **base,
                "choices": [{"index": 0, "delta": {"reasoning": "let me"}, "token_ids": [5, 6]}],
            }
        ),
        event({**base, "choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [7]}]}),
        event(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "ok"},
                        "token_ids": [8],
                        "finish_reason": "stop",
                    }
                ],
            }
        ),
        event({**base, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}),
        DONE,
    ]
    engine.reply("POST", "/v1/chat/completions", sse(parts))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with engine.client() as client:
        async with client.decode(None, body, kind="chat") as stream:
            chunks = await collect(stream)
    assert [c.kind for c in chunks] == ["meta", "token", "token", "token", "meta"]
    assert stream.tokens == 4
    assert stream.finish_reason == "stop"


async def test_decode_with_bytes_split_oddly(autojump_clock: trio.testing.MockClock) -> None:
    engine = Engine()
    data = RECORDING.replace(b"\n", b"\r\n")
    parts = [data[i : i + 7] for i in range(0, len(data), 7)]
    engine.reply("POST", "/v1/completions", sse(parts, gap_s=0.001))
    async with engine.client() as client:
        async with client.decode(None, CLIENT_BODY) as stream:
            chunks = await collect(stream)
    assert sum(c.count for c in chunks) == 20


async def test_decode_timestamps(autojump_clock: trio.testing.MockClock) -> None:
    engine = Engine()

    async def delayed(request: httpx.Request) -> httpx.Response:
        await trio.sleep(1.0)  # response headers after 1 s
        return sse([completion_event([1]), completion_event([2]), DONE], gap_s=0.5)()

    engine.on("POST", "/v1/completions", delayed)
    start = trio.current_time()
    async with engine.client() as client:
        async with client.decode(None, CLIENT_BODY) as stream:
            assert stream.opened_at == start
            assert stream.headers_at == start + 1.0
            await collect(stream)
    assert stream.first_token_at == start + 1.5
    assert stream.last_token_at == start + 2.0


# ------------------------------------------------------------------ decode failures


async def decode_error(engine: Engine) -> tuple[BaseException, DecodeStream | None]:
    stream: DecodeStream | None = None
    with trio.fail_after(60):
        try:
            async with engine.client() as client:
                async with client.decode(None, CLIENT_BODY) as stream:
                    await collect(stream)
        except Exception as exc:
            return exc, stream
    raise AssertionError("decode did not fail")


async def test_stream_cut_between_events() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse([e + b"\n\n" for e in RECORDED_EVENTS[:5]]))
    exc, stream = await decode_error(engine)
    assert isinstance(exc, StreamClosed)
    assert exc.leg == "decode" and exc.engine == "e0"
    assert stream is not None and stream.tokens == 5 and stream.closed
    assert LAST_STREAMS[0].closed


async def test_stream_cut_mid_event() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse([RECORDING[:1000]]))
    exc, _ = await decode_error(engine)
    assert isinstance(exc, StreamClosed)


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ReadError("connection reset by peer"),
        httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
    ],
)
async def test_connection_breaks_mid_stream(exc: Exception) -> None:
    engine = Engine()
    engine.reply(
        "POST", "/v1/completions", sse([completion_event([1]), completion_event([2])], then=exc)
    )
    err, stream = await decode_error(engine)
    assert isinstance(err, StreamClosed)
    assert err.__cause__ is exc
    assert stream is not None and stream.tokens == 2


async def test_done_before_any_token() -> None:
    engine = Engine()
    role_only = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    engine.reply("POST", "/v1/chat/completions", sse([role_only, DONE]))
    with pytest.raises(EmptyStream, match=r"stream ended with \[DONE\] before any token arrived"):
        async with engine.client() as client:
            async with client.decode(None, {"messages": []}, kind="chat") as stream:
                await collect(stream)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (
            {
                "error": {
                    "message": "kv transfer failed",
                    "type": "InternalServerError",
                    "code": 500,
                }
            },
            500,
        ),
        ({"error": {"message": "bad input", "type": "BadRequestError", "code": 400}}, 400),
        ({"error": {"message": "no code"}}, 500),
    ],
)
async def test_error_object_inside_a_200_stream(error: dict[str, Any], status: int) -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse([completion_event([1]), event(error), DONE]))
    exc, stream = await decode_error(engine)
    assert isinstance(exc, EngineStreamError)
    assert exc.upstream_status == status and exc.http_status == status
    assert exc.error == error["error"]
    assert error["error"]["message"] in str(exc)
    assert stream is not None and stream.tokens == 1


async def test_http_error_on_open() -> None:
    engine = Engine()
    engine.reply(
        "POST",
        "/v1/completions",
        lambda: httpx.Response(
            503,
            headers={"content-type": "application/json"},
            stream=ScriptedStream(
                [b'{"error": {"message": "engine ', b'overloaded", "code": 503}}']
            ),
        ),
    )
    exc, stream = await decode_error(engine)
    assert isinstance(exc, EngineHTTPError)
    assert exc.upstream_status == 503 and exc.transient
    assert "engine overloaded" in str(exc)
    assert stream is None


@pytest.mark.parametrize(
    ("upstream", "status", "error_type"),
    [(408, 504, "timeout_error"), (504, 504, "timeout_error"), (500, 502, "engine_error"),
     (503, 502, "engine_error"), (429, 502, "engine_error"), (422, 422, "invalid_request_error")],
)
async def test_engine_status_maps_timeouts_to_504(upstream: int, status: int, error_type: str) -> None:
    # The engine's own timeout (408, 504) is timeout-shaped: 504; other faults 502.
    engine = Engine()
    engine.reply("POST", "/v1/completions", lambda: httpx.Response(upstream, text="nope"))
    exc, _ = await decode_error(engine)
    assert isinstance(exc, EngineHTTPError) and exc.upstream_status == upstream
    assert exc.http_status == status
    assert exc.to_body()["error"]["type"] == error_type


async def test_http_error_with_text_body() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", lambda: httpx.Response(502, text="Bad Gateway\n"))
    exc, _ = await decode_error(engine)
    assert isinstance(exc, EngineHTTPError) and "Bad Gateway" in str(exc)


async def test_connect_error_on_open() -> None:
    engine = Engine()
    engine.on(
        "POST", "/v1/completions", raising(httpx.ConnectError("All connection attempts failed"))
    )
    exc, _ = await decode_error(engine)
    assert isinstance(exc, EngineUnavailable) and exc.leg == "decode"


async def test_json_error_answer_to_a_stream_request() -> None:
    engine = Engine()
    engine.reply(
        "POST",
        "/v1/completions",
        lambda: httpx.Response(200, json={"error": {"message": "nope", "code": 400}}),
    )
    exc, _ = await decode_error(engine)
    assert isinstance(exc, EngineStreamError) and exc.upstream_status == 400


async def test_malformed_event() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse([completion_event([1]), b"data: {oops\n\n", DONE]))
    exc, _ = await decode_error(engine)
    assert isinstance(exc, EngineProtocolError) and not isinstance(exc, StreamClosed)


async def test_connector_mismatch_between_producer_and_consumer() -> None:
    engine = Engine()
    result = await prefill_result(engine)
    with pytest.raises(InvalidDescriptor, match=CONNECTOR_MISMATCH):
        async with engine.client(connector=Connector(type="MooncakeConnector")) as client:
            async with client.decode(result):
                pass
    assert engine.requests == []


# ------------------------------------------------------------------ closing


async def test_leaving_the_context_closes_the_upstream_response(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine()
    parts = [completion_event([i]) for i in range(3)]
    engine.reply("POST", "/v1/completions", sse(parts, gap_s=0.1, hang=True))
    with trio.fail_after(60):
        async with engine.client() as client:
            async with client.decode(None, CLIENT_BODY) as stream:
                first = await stream.__anext__()
                assert first.token_ids == (0,)
    upstream = LAST_STREAMS[0]
    assert upstream.closed and upstream.cancelled
    assert stream.closed
    assert upstream.sent == 1  # nothing more was read
    # No generator of the httpx chain was left suspended (trio would warn on collection).
    gc.collect()


async def test_caller_deadline_cancels_and_closes(autojump_clock: trio.testing.MockClock) -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse([completion_event([1])], hang=True))
    start = trio.current_time()
    async with engine.client() as client:
        with trio.move_on_after(3.0) as scope:
            async with client.decode(None, CLIENT_BODY) as stream:
                await collect(stream)
    assert scope.cancelled_caught
    assert trio.current_time() == start + 3.0
    assert stream.tokens == 1 and stream.closed
    assert LAST_STREAMS[0].closed and LAST_STREAMS[0].cancelled
    gc.collect()


async def test_a_cancelled_read_cannot_resume(autojump_clock: trio.testing.MockClock) -> None:
    engine = Engine()
    engine.reply(
        "POST", "/v1/completions", sse([completion_event([1]), completion_event([2])], gap_s=5)
    )
    async with engine.client() as client:
        async with client.decode(None, CLIENT_BODY) as stream:
            with trio.move_on_after(1.0) as scope:
                await stream.__anext__()
            assert scope.cancelled_caught
            with pytest.raises(StreamClosed, match="cancelled"):
                await stream.__anext__()
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
    assert LAST_STREAMS[0].closed


async def test_trailing_bytes_after_done_are_drained(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine()
    engine.reply(
        "POST", "/v1/completions", sse([completion_event([1]), DONE, b": trailing\n\n"], gap_s=0.01)
    )
    async with engine.client() as client:
        async with client.decode(None, CLIENT_BODY) as stream:
            await collect(stream)
    # The body was read to its end (so a real connection can be reused), not cut.
    assert LAST_STREAMS[0].sent == 3
    assert not LAST_STREAMS[0].cancelled
    assert LAST_STREAMS[0].closed


async def test_decode_context_is_single_use() -> None:
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse([completion_event([1]), DONE]))
    async with engine.client() as client:
        opener = client.decode(None, CLIENT_BODY)
        async with opener as stream:
            await collect(stream)
        with pytest.raises(RuntimeError):
            async with opener:
                pass


async def test_decode_needs_a_body() -> None:
    async with Engine().client() as client:
        with pytest.raises(ValueError):
            client.decode()


# --------------------------------------------------------------------------- introspection


def text_answer(text: str) -> Callable[[], httpx.Response]:
    return lambda: httpx.Response(200, text=text, headers={"content-type": "text/plain"})


async def test_metrics_parse_the_recordings() -> None:
    for text in (METRICS_IDLE, METRICS_AFTER):
        engine = Engine()
        engine.reply("GET", "/metrics", text_answer(text))
        async with engine.client() as client:
            metrics = await client.metrics()
        assert metrics.running == 0
        assert metrics.waiting == 0
        assert metrics.kv_usage == 0.0
        assert metrics.kv_cache_size_tokens == 524288
        assert metrics.prefix_caching is True
        assert metrics.process_start_time is not None
    assert metrics.total("vllm:nixl_num_failed_transfers_total") == 0.0
    assert (
        metrics.total("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        is not None
    )


async def test_metrics_sum_over_engine_cores() -> None:
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
            'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25',
            'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",kv_cache_size_tokens="1000"} 1.0',
            'vllm:cache_config_info{block_size="16",enable_prefix_caching="False",engine="1",kv_cache_size_tokens="3000"} 1.0',
        ]
    )
    engine = Engine()
    engine.reply("GET", "/metrics", text_answer(text))
    async with engine.client() as client:
        metrics = await client.metrics()
    assert (metrics.running, metrics.waiting) == (7, 3)
    assert metrics.kv_cache_size_tokens == 4000
    assert metrics.kv_usage == pytest.approx((0.5 * 1000 + 0.25 * 3000) / 4000)
    assert metrics.prefix_caching is False
    assert metrics.process_start_time is None


async def test_load_parses_only_the_load_gauges_and_agrees_with_metrics() -> None:
    text = METRICS_AFTER.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0',
    ).replace(  # a longer name that starts with a wanted one is not it
        'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 2.0',
    )
    assert 'vllm:num_requests_waiting_by_reason{' in text
    engine = Engine()
    engine.reply("GET", "/metrics", text_answer(text))
    async with engine.client() as client:
        full, load = await client.metrics(), await client.load()
    assert (load.running, load.waiting) == (full.running, full.waiting) == (3, 2)
    assert (load.kv_usage, load.kv_cache_size_tokens, load.prefix_caching, load.process_start_time) == (
        full.kv_usage, full.kv_cache_size_tokens, full.prefix_caching, full.process_start_time
    )
    assert set(load.samples) == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info", "process_start_time_seconds",
    }  # fmt: skip
    assert len(full.samples) > 50


async def test_metrics_without_vllm_gauges() -> None:
    engine = Engine()
    engine.reply("GET", "/metrics", text_answer("process_start_time_seconds 1.0\n"))
    with pytest.raises(EngineProtocolError, match="vllm:num_requests_running"):
        async with engine.client() as client:
            await client.metrics()


def identity_engine(metrics: str) -> Engine:
    engine = Engine()
    engine.reply("GET", "/version", lambda: httpx.Response(200, json={"version": "0.32.0"}))
    engine.reply(
        "GET",
        "/v1/models",
        lambda: httpx.Response(
            200,
            json={
                "object": "list",
                "data": [
                    {
                        "id": "tiny-llama",
                        "object": "model",
                        "owned_by": "vllm",
                        "max_model_len": 2048,
                    }
                ],
            },
        ),
    )
    engine.reply("GET", "/metrics", text_answer(metrics))
    return engine


async def test_identity() -> None:
    async with identity_engine(METRICS_IDLE).client(model="tiny-llama") as client:
        first = await client.identity()
        again = await client.identity()
    assert first == again
    assert first == EngineIdentity(
        url=URL,
        model="tiny-llama",
        version="0.32.0",
        max_model_len=2048,
        process_start_time=1.79620882233e09,
    )
    # A restarted engine (new process start time) is a different generation.
    async with identity_engine(METRICS_AFTER).client() as client:
        restarted = await client.identity()
    assert restarted != first
    assert len({first, again, restarted}) == 2


async def test_models_and_health() -> None:
    engine = identity_engine(METRICS_IDLE)
    engine.reply("GET", "/health", lambda: httpx.Response(200))
    async with engine.client() as client:
        assert [m["id"] for m in await client.models()] == ["tiny-llama"]
        assert await client.health() is True

    sick = Engine()
    sick.reply("GET", "/health", lambda: httpx.Response(503))
    async with sick.client() as client:
        assert await client.health() is False

    gone = Engine()
    gone.on("GET", "/health", raising(httpx.ConnectError("refused")))
    async with gone.client() as client:
        assert await client.health() is False


async def test_tokenize() -> None:
    engine = Engine()
    engine.reply(
        "POST",
        "/tokenize",
        lambda: httpx.Response(
            200,
            json={
                "count": 6,
                "max_model_len": 2048,
                "tokens": [516, 328, 81, 283, 569, 477],
                "token_strs": None,
            },
        ),
    )
    async with engine.client(model="tiny-llama") as client:
        tokenized = await client.tokenize("hello world")
        assert engine.body() == {"prompt": "hello world", "model": "tiny-llama"}
        await client.tokenize(messages=[{"role": "user", "content": "hi"}], model="other")
        assert engine.body() == {
            "messages": [{"role": "user", "content": "hi"}],
            "model": "other",
        }
        with pytest.raises(ValueError):
            await client.tokenize()
    assert tokenized.count == 6
    assert tokenized.max_model_len == 2048
    assert tokenized.ids == (516, 328, 81, 283, 569, 477)


# --------------------------------------------------------------------------- construction


async def test_builds_a_pooled_wire_transport() -> None:
    from narwhal.engines.wire import WireTransport

    async with EngineClient(URL, connect_timeout_s=2.5) as client:
        assert client._http.timeout == httpx.Timeout(None, connect=2.5)
        transport = client._http._transport
        assert isinstance(transport, WireTransport)
        assert transport._connect_timeout == 2.5
        assert transport._idle_expiry < 5.0  # below uvicorn's keep-alive timeout


async def test_shared_http_client_is_not_closed() -> None:
    engine = Engine()
    engine.reply("GET", "/health", lambda: httpx.Response(200))
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine.handle)) as shared:
        async with EngineClient(URL, http_client=shared) as client:
            assert await client.health()
        assert not shared.is_closed
    with pytest.raises(ValueError):
        EngineClient(URL, http_client=shared, transport=httpx.MockTransport(engine.handle))


# --------------------------------------------------------------------------- loopback


@attrs.define
class LoopbackEngine:
    """A raw HTTP/1.1 engine on a loopback socket: chunked SSE, keep-alive."""

    events: list[bytes]
    hang: bool = False
    connections: int = 0
    requests: int = 0
    eof_seen: trio.Event = attrs.Factory(trio.Event)

    async def serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        self.eof_seen.set()
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                buffer = buffer[length:]
                self.requests += 1
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for part in self.events:
                    await stream.send_all(b"%x\r\n%s\r\n" % (len(part), part))
                if self.hang:
                    data = await stream.receive_some(65536)
                    if not data:
                        self.eof_seen.set()
                    return
                await stream.send_all(b"0\r\n\r\n")
        except trio.BrokenResourceError:
            self.eof_seen.set()


async def test_loopback_closing_the_context_closes_the_connection() -> None:
    engine = LoopbackEngine([completion_event([1]), completion_event([2])], hang=True)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, engine.serve, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            async with EngineClient(f"http://127.0.0.1:{port}", name="real") as client:
                async with client.decode(None, CLIENT_BODY) as stream:
                    chunk = await stream.__anext__()
                    assert chunk.token_ids == (1,)
                # The engine sees the client go away (and would abort the request).
                await engine.eof_seen.wait()
            nursery.cancel_scope.cancel()
    gc.collect()


async def test_loopback_connection_is_reused_after_done() -> None:
    engine = LoopbackEngine([completion_event([1]), completion_event([2]), DONE])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, engine.serve, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            async with EngineClient(f"http://127.0.0.1:{port}", name="real") as client:
                for _ in range(3):
                    async with client.decode(None, CLIENT_BODY) as stream:
                        assert sum(c.count for c in await collect(stream)) == 2
            nursery.cancel_scope.cancel()
    assert engine.requests == 3
    assert engine.connections == 1


async def test_watch_silence_moves_a_deadline_on_every_transport_chunk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A token, then a keep-alive comment and an event in two pieces, 2 s apart each
    # (farther apart than the slack): every chunk, whole event or not, moves the
    # watched scope's deadline, to the bound and its slack after it.
    token = completion_event([2])
    parts = [completion_event([1]), b": keep-alive\n\n", token[:20], token[20:], DONE]
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse(parts, gap_s=2.0))
    deadlines: list[float] = []
    async with engine.client() as client:
        async with client.decode(None, CLIENT_BODY) as stream:
            with trio.CancelScope() as scope:
                first = await stream.__anext__()
                assert first.kind == "token" and scope.deadline == math.inf  # not armed yet
                stream.watch_silence(scope, 3.0)
                start = trio.current_time()
                async for _ in stream:
                    deadlines.append(scope.deadline)
    assert not scope.cancelled_caught
    # The second token was read after the comment and both halves: three more chunks.
    assert deadlines == [start + 6.0 + 3.0 * (1 + SILENCE_SLACK)]
    assert stream.last_activity_at == start + 8.0


async def test_watch_silence_moves_a_deadline_once_a_slack_not_once_a_chunk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 30 tokens 10 ms apart under a 7.04 s bound (a slack of 0.11 s): after every chunk
    # the deadline is at least the bound and at most the bound and its slack away, and
    # it moved only when it would have fallen short, not at every chunk. A deadline
    # lifted meanwhile (a write that waits for the client) is set again by the next
    # chunk; one set inside the window is kept until it falls short; one beyond it is
    # brought back by the next chunk.
    bound = 7.04
    slack = bound * SILENCE_SLACK
    assert slack == pytest.approx(0.11)
    engine = Engine()
    engine.reply("POST", "/v1/completions", sse([completion_event([i]) for i in range(30)] + [DONE], gap_s=0.01))
    seen: list[tuple[float, float]] = []
    async with engine.client() as client:
        async with client.decode(None, CLIENT_BODY) as stream:
            with trio.CancelScope() as scope:
                await stream.__anext__()
                stream.watch_silence(scope, bound)
                async for chunk in stream:
                    assert chunk.count == 1
                    now = trio.current_time()
                    seen.append((now, scope.deadline))
                    if len(seen) == 15:
                        scope.deadline = math.inf
                    if len(seen) == 20:
                        kept = scope.deadline = now + bound + 0.045
                    if len(seen) == 26:
                        scope.deadline = now + 3 * bound
    assert not scope.cancelled_caught
    assert len(seen) == 29
    for now, deadline in seen:
        assert now + bound <= deadline <= now + bound + slack, (now, deadline)
    moves = [i for i in range(1, len(seen)) if seen[i][1] != seen[i - 1][1]]
    # Due after 0.11 s (chunk 12), at the first chunk after the lift (15), the test's
    # own deadline (20), kept until it fell short (24: 50 ms after it was set), and at
    # the first chunk after one set beyond the window (26: the bound still holds).
    assert moves == [12, 15, 20, 24, 26], moves
    assert seen[20][1] == seen[23][1] == kept
    assert seen[24][1] == seen[24][0] + bound + slack
    assert seen[26][1] == seen[26][0] + bound + slack
