"""The simulated engine's output: stop strings (vLLM's hold-back) and logprobs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from narwhal.config import EngineConfig, parse_as
from narwhal.testing import open_sim_fleet
from narwhal.testing.outputs import OutputText, logprob_entries, token_piece
from narwhal.testing.tokenizer import encode, greedy_tokens, token_text

PROMPT = "a b c d e f"
MODEL = "sim-llama"


def engine_config() -> EngineConfig:
    return parse_as(EngineConfig, {
        "name": "e0", "url": "http://e0.sim:8101", "roles": ["prefill", "decode"],
        "connector": {"type": "NixlConnector", "kv_host": "e0.kv", "kv_port": 15101},
        "sim": {"model": MODEL, "max_model_len": 2048},
    })  # fmt: skip


@asynccontextmanager
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with open_sim_fleet([engine_config()]) as fleet:
        async with fleet.client("e0", timeout=None) as c:
            yield c


async def events(c: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/completions") -> list[dict[str, Any]]:
    out = []
    async with c.stream("POST", path, json={**body, "stream": True, "return_token_ids": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def texts_of(n: int) -> list[str]:
    return [token_text(t) for t in greedy_tokens(MODEL, encode(PROMPT), n)]


def a_stop_across_tokens(texts: list[str], after: int) -> tuple[str, int]:
    """A 3-character stop string that begins in the text of token ``>= after`` and ends
    in a later token's; its index in the whole text."""
    whole = "".join(texts)
    start = len("".join(texts[:after]))
    for i in range(start, len(whole) - 3):
        ends = [len("".join(texts[: k + 1])) for k in range(len(texts))]
        if any(i < e < i + 3 for e in ends) and whole.find(whole[i : i + 3]) == i:
            return whole[i : i + 3], i
    raise AssertionError("no stop string found")


def test_output_text_holds_back_what_may_start_a_stop_string() -> None:
    tokens = greedy_tokens(MODEL, encode(PROMPT), 40)
    whole = "".join(token_text(t) for t in tokens)
    stop, at = a_stop_across_tokens([token_text(t) for t in tokens], 3)
    out = OutputText([stop, "zzzzzzz-never"])
    sent = []
    for token in tokens:
        out.add(token)
        sent.append(out.take(out.stop_reason is not None))
        # Until the end, the last 12 characters (the longest stop's, less one) wait.
        if out.stop_reason is None:
            assert "".join(sent) == out.text[: max(0, len(out.text) - 12)]
        else:
            break
    assert out.stop_reason == stop and "".join(sent) == whole[:at]
    keep = OutputText([stop], include_stop=True)
    for token in tokens:
        keep.add(token)
        if keep.stop_reason:
            break
    assert keep.text == whole[: at + 3] and keep.hold == 0


async def test_a_stream_stops_at_a_stop_string(autojump_clock: trio.abc.Clock) -> None:
    texts = texts_of(40)
    stop, at = a_stop_across_tokens(texts, 3)
    async with client() as c:
        got = await events(c, {"prompt": PROMPT, "max_tokens": 40, "stop": [stop]})
        tokens = [e for e in got if e["choices"]]
        assert "".join(e["choices"][0]["text"] for e in tokens) == "".join(texts)[:at]
        last = tokens[-1]["choices"][0]
        assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
        assert len(tokens) < 40
        plain = (await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "stop": stop,
                                                        "return_token_ids": True})).json()  # fmt: skip
        assert plain["choices"][0]["text"] == "".join(texts)[:at]
        assert plain["choices"][0]["token_ids"] == [t["choices"][0]["token_ids"][0] for t in tokens]
        assert plain["choices"][0]["stop_reason"] == stop


async def test_logprobs_of_completions_and_chat(autojump_clock: trio.abc.Clock) -> None:
    async with client() as c:
        got = [e for e in await events(c, {"prompt": PROMPT, "max_tokens": 6, "logprobs": 3}) if e["choices"]]
        offset = 0
        for e in got:
            choice = e["choices"][0]
            token = choice["token_ids"][0]
            lp = choice["logprobs"]
            assert lp["tokens"] == [token_piece(token)] and lp["text_offset"] == [offset]
            top = lp["top_logprobs"][0]
            assert list(top.values()) == [v for _, v in logprob_entries(token, 3)]
            assert next(iter(top)) == token_piece(token) and max(top.values()) == lp["token_logprobs"][0]
            offset += len(choice["text"])
        chat = await events(c, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                                "logprobs": True, "top_logprobs": 2}, "/v1/chat/completions")  # fmt: skip
        for e in chat[1:]:
            [entry] = e["choices"][0]["logprobs"]["content"]
            token = e["choices"][0]["token_ids"][0]
            assert entry["token"] == token_piece(token) and entry["bytes"] == list(entry["token"].encode())
            assert [t["logprob"] for t in entry["top_logprobs"]] == [v for _, v in logprob_entries(token, 2)]
        none = await events(c, {"prompt": PROMPT, "max_tokens": 2})
        assert all(e["choices"][0]["logprobs"] is None for e in none if e["choices"])
