"""The bench's stream accounting, against scripted SSE bodies (httpx.MockTransport).

Each scripted body is a list of ``(delay_s, bytes)``: the stream sleeps (virtual time)
before sending each piece, so TTFT and TPOT are known exactly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
import trio

from narwhal.bench import BenchOptions, RequestResult, Route, ScheduledRequest, run_bench

Script = Sequence[tuple[float, bytes]]


class _Body(httpx.AsyncByteStream):
    def __init__(self, script: Script) -> None:
        self.script = script

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for delay, data in self.script:
            await trio.sleep(delay)
            yield data


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chat(delta: dict[str, Any], ids: list[int] | None = None, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return _event({"object": "chat.completion.chunk", "choices": [choice]})


def _text(text: str, ids: list[int] | None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    return _event({"object": "text_completion", "choices": [choice]})


DONE = b"data: [DONE]\n\n"


async def _run(
    script: Script | None = None,
    *,
    status: int = 200,
    body: bytes = b"",
    route: Route = "completions",
    timeout_s: float = 600.0,
) -> tuple[RequestResult, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if status != 200:
            return httpx.Response(status, content=body, headers={"content-type": "application/json"})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body(script or ()))

    opts = BenchOptions(url="http://server.test", model="m", route=route, request_timeout_s=timeout_s)
    run = await run_bench([ScheduledRequest(0, 0.0, 4, 5)], opts, transport=httpx.MockTransport(handler))
    return run.records[0], seen


async def test_request_body_and_headers(autojump_clock: trio.abc.Clock) -> None:
    rec, [request] = await _run([(0.0, _text("a", [1])), (0.0, DONE)])
    body = json.loads(request.content)
    assert request.url.path == "/v1/completions"
    assert request.headers["x-request-id"] == rec.request_id
    assert body["stream"] is True and body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["model"] == "m" and body["ignore_eos"] is True
    assert len(body["prompt"].split()) == 5
    rec, [request] = await _run([(0.0, _chat({"content": "a"}, [1])), (0.0, DONE)], route="chat")
    body = json.loads(request.content)
    assert request.url.path == "/v1/chat/completions"
    assert body["max_completion_tokens"] == 4 and body["messages"][0]["role"] == "user"


async def test_empty_text_and_reasoning_only_tokens_count(autojump_clock: trio.abc.Clock) -> None:
    script = [
        (0.1, _chat({"role": "assistant", "content": ""})),  # role only: no token
        (0.2, _chat({"reasoning": "hmm"}, [11])),  # reasoning only
        (0.1, _chat({"content": ""}, [12, 13])),  # an incomplete UTF-8 sequence: two ids, no text
        (0.1, _chat({"content": "ok"}, [14], finish="length")),
        (0.0, _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})),
        (0.0, DONE),
    ]
    rec, _ = await _run(script, route="chat")
    assert rec.terminal_class == "ok" and rec.done
    assert rec.output_len == 4 == rec.completion_tokens
    assert rec.empty_text_tokens == 3
    assert rec.prompt_tokens == 7 and rec.finish_reason == "length"
    assert rec.ttft_s == pytest.approx(0.3)  # the reasoning token is the first token
    assert rec.tpot_s == pytest.approx(0.2 / 3)  # first -> last over output_len - 1
    assert rec.latency_s == pytest.approx(0.5)


async def test_events_without_ids_are_flagged(autojump_clock: trio.abc.Clock) -> None:
    rec, _ = await _run([(0.1, _text("a", None)), (0.1, _text("b", None)), (0.0, DONE)])
    assert rec.terminal_class == "ok" and rec.output_len == 2 and rec.events_without_ids == 2


async def test_one_token_has_no_tpot(autojump_clock: trio.abc.Clock) -> None:
    rec, _ = await _run([(0.25, _text("a", [5])), (0.0, DONE)])
    assert rec.terminal_class == "ok" and rec.ttft_s == pytest.approx(0.25) and rec.tpot_s is None


async def test_error_event_after_200_is_a_stream_error(autojump_clock: trio.abc.Clock) -> None:
    error = {"error": {"message": "engine went silent", "type": "timeout_error", "code": 504}}
    rec, _ = await _run([(0.1, _text("a", [1])), (0.1, _event(error)), (0.0, DONE)])
    assert rec.terminal_class == "stream_error" and rec.status == 200 and not rec.done
    assert rec.error == {"message": "engine went silent", "type": "timeout_error", "code": 504}
    assert rec.output_len == 1


async def test_stream_closed_before_done(autojump_clock: trio.abc.Clock) -> None:
    rec, _ = await _run([(0.1, _text("a", [1])), (0.1, _text("b", [2]))])
    assert rec.terminal_class == "stream_closed" and rec.output_len == 2
    assert rec.error is not None and "before data: [DONE]" in rec.error["message"]


async def test_done_without_a_blank_line_still_ends_the_stream(autojump_clock: trio.abc.Clock) -> None:
    rec, _ = await _run([(0.1, _text("a", [1])), (0.0, b"data: [DONE]")])
    assert rec.terminal_class == "ok"


async def test_done_before_any_token(autojump_clock: trio.abc.Clock) -> None:
    rec, _ = await _run([(0.1, DONE)])
    assert rec.terminal_class == "stream_error" and rec.done and rec.output_len == 0
    assert rec.ttft_s is None


async def test_malformed_event(autojump_clock: trio.abc.Clock) -> None:
    rec, _ = await _run([(0.1, b"data: {oops\n\n"), (0.0, DONE)])
    assert rec.terminal_class == "stream_error"


@pytest.mark.parametrize(("status", "expected"), [(503, "refused"), (500, "http_500"), (400, "http_400")])
async def test_http_errors(autojump_clock: trio.abc.Clock, status: int, expected: str) -> None:
    body = json.dumps({"error": {"message": "no capacity", "type": "service_unavailable", "code": status}}).encode()
    rec, _ = await _run(status=status, body=body)
    assert rec.terminal_class == expected and rec.status == status
    assert rec.error == {"message": "no capacity", "type": "service_unavailable", "code": status}


async def test_non_json_error_body(autojump_clock: trio.abc.Clock) -> None:
    rec, _ = await _run(status=502, body=b"<html>bad gateway</html>")
    assert rec.terminal_class == "http_502"
    assert rec.error is not None and rec.error["message"] == "<html>bad gateway</html>"


async def test_timeout_mid_stream_abandons_the_body_cleanly(autojump_clock: trio.abc.Clock) -> None:
    rec, _ = await _run([(0.1, _text("a", [1])), (1000.0, DONE)], timeout_s=2.0)
    assert rec.terminal_class == "timeout" and rec.output_len == 1
    assert rec.latency_s == pytest.approx(2.0)
