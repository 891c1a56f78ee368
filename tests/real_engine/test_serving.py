"""``narwhal serve`` in front of a real vLLM pair: completions and chat, streamed or not.

Output is counted by token id: with ``ignore_eos`` the random-weight model cannot stop
early, so every answer must carry exactly ``max_tokens`` ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from .kit import HTTP_TIMEOUT, MODEL, RealPair, RouterProcess, new_request_id, stream, unique_prompt

pytestmark = pytest.mark.real_engine


@pytest.fixture
def client(router: RouterProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.url, timeout=HTTP_TIMEOUT) as c:
        yield c


def _check_ok_record(
    record: dict[str, Any], *, stream: bool, max_tokens: int, prompt_tokens: int | None
) -> None:
    assert record["terminal_class"] == "ok", record
    assert record["status"] == 200
    assert record["stream"] is stream
    assert record["output_len"] == max_tokens
    assert record["requested_output_len"] == max_tokens
    assert (record["producer"], record["consumer"]) == ("producer", "consumer")
    assert [a["outcome"] for a in record["attempts"]] == ["ok"]
    assert record["attempts"][0]["same_worker"] is False
    if prompt_tokens is not None:
        assert record["prompt_tokens"] == prompt_tokens
    assert 0 < record["ttft_s"] <= record["first_byte_s"] <= record["latency_s"]
    assert record["tpot_s"] is not None and record["tpot_s"] > 0


def test_models_lists_the_served_model(client: httpx.Client) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == [MODEL]


def test_streamed_completion(client: httpx.Client, router: RouterProcess) -> None:
    rid = new_request_id("stream")
    body = {
        "model": MODEL,
        "prompt": unique_prompt(60),
        "max_tokens": 48,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    out = stream(client, "/v1/completions", body, request_id=rid)
    assert out.status == 200, out.events
    assert out.headers["content-type"].startswith("text/event-stream")
    assert out.headers["x-request-id"] == rid
    assert out.done, out.events[-3:]
    assert len(out.token_ids) == 48
    finishes = [c.get("finish_reason") for e in out.data for c in e.get("choices") or ()]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert out.usage is not None and out.usage["completion_tokens"] == 48
    _check_ok_record(
        router.record(rid), stream=True, max_tokens=48, prompt_tokens=out.usage["prompt_tokens"]
    )


def test_streamed_completion_without_usage_has_no_usage_event(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": unique_prompt(20), "max_tokens": 5, "ignore_eos": True}
    out = stream(client, "/v1/completions", body)
    assert out.done and len(out.token_ids) == 5
    assert out.usage is None  # the router asked the engine for usage, the client did not


def test_streamed_chat(client: httpx.Client, router: RouterProcess) -> None:
    rid = new_request_id("chat")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": unique_prompt(30)}],
        "max_tokens": 24,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    out = stream(client, "/v1/chat/completions", body, request_id=rid)
    assert out.status == 200 and out.done, out.events[-3:]
    assert out.data[0]["object"] == "chat.completion.chunk"
    assert out.data[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(out.token_ids) == 24
    assert out.usage is not None and out.usage["completion_tokens"] == 24
    _check_ok_record(
        router.record(rid), stream=True, max_tokens=24, prompt_tokens=out.usage["prompt_tokens"]
    )


def test_non_streaming_completion(client: httpx.Client, router: RouterProcess) -> None:
    rid = new_request_id("full")
    body = {
        "model": MODEL,
        "prompt": unique_prompt(40),
        "max_tokens": 16,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = client.post("/v1/completions", json=body, headers={"x-request-id": rid})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "text_completion"
    choice = answer["choices"][0]
    assert len(choice["token_ids"]) == 16
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 16
    _check_ok_record(
        router.record(rid),
        stream=False,
        max_tokens=16,
        prompt_tokens=answer["usage"]["prompt_tokens"],
    )


def test_non_streaming_chat(client: httpx.Client, router: RouterProcess) -> None:
    rid = new_request_id("fullchat")
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": unique_prompt(25)},
        ],
        "max_tokens": 12,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = client.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion"
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["token_ids"]) == 12
    assert answer["usage"]["completion_tokens"] == 12
    _check_ok_record(
        router.record(rid),
        stream=False,
        max_tokens=12,
        prompt_tokens=answer["usage"]["prompt_tokens"],
    )


def test_prompt_token_ids_as_prompt(client: httpx.Client, pair: RealPair) -> None:
    tokens = httpx.post(
        f"{pair.urls['producer']}/tokenize",
        json={"model": MODEL, "prompt": unique_prompt(30)},
        timeout=30,
    ).json()["tokens"]
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 6, "ignore_eos": True}
    out = stream(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert out.done and len(out.token_ids) == 6
    assert out.usage is not None and out.usage["prompt_tokens"] == len(tokens)


def test_prompt_over_max_model_len_is_refused_before_the_decode_leg(
    client: httpx.Client, router: RouterProcess, pair: RealPair
) -> None:
    # The router estimates prompt lengths here (controller.prompt_tokens "auto" without
    # profiles): the producer's exact check refuses the prompt with vLLM's own message,
    # and the consumer never sees it.
    before = pair.metrics("consumer").completion_posts
    rid = new_request_id("toolong")
    body = {"model": MODEL, "prompt": unique_prompt(2100), "max_tokens": 4}
    response = client.post("/v1/completions", json=body, headers={"x-request-id": rid})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "maximum context length" in error["message"]
    assert error["code"] == "context_length_exceeded"
    record = router.record(rid)
    assert record["terminal_class"] == "invalid_request"
    assert record["status"] == 400
    assert pair.metrics("consumer").completion_posts == before


async def test_concurrent_streams(router: RouterProcess) -> None:
    """Four streams at once through one router, each with exactly its own tokens."""
    counts: dict[int, int] = {}

    async def one(i: int, client: httpx.AsyncClient) -> None:
        body = {
            "model": MODEL,
            "prompt": unique_prompt(50 + 10 * i),
            "max_tokens": 20 + i,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        ids = 0
        done = False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    ids += sum(len(c.get("token_ids") or ()) for c in event["choices"])
        assert done
        counts[i] = ids

    with trio.fail_after(180):
        async with httpx.AsyncClient(base_url=router.url, timeout=HTTP_TIMEOUT) as client:
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i, client)
    assert counts == {i: 20 + i for i in range(4)}
