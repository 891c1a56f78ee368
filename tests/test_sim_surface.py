"""The simulated engine speaks the recorded vLLM HTTP surface (fixtures/)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import narwhal.testing
from narwhal.config import EngineConfig, parse_as
from narwhal.testing import open_sim_fleet
from narwhal.testing.tokenizer import encode, encode_chat, token_text

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def engine_config(**sim: Any) -> EngineConfig:
    return parse_as(EngineConfig, {
        "name": "e0", "url": "http://e0.sim:8101", "roles": ["prefill", "decode"],
        "connector": {"type": "NixlConnector", "kv_host": "e0.kv", "kv_port": 15101},
        "sim": {"max_model_len": 2048, **sim},
    })  # fmt: skip


@asynccontextmanager
async def client_for(**sim: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with open_sim_fleet([engine_config(**sim)]) as fleet:
        async with fleet.client("e0", timeout=None) as client:
            yield client


def split_events(raw: bytes) -> list[str]:
    """SSE payloads of a body, checking the exact framing: ``data: ...`` + blank line."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[len("data: "):] for e in events]


def test_public_surface() -> None:
    assert set(narwhal.testing.__all__) >= {
        "SimEngine", "SimFleet", "open_sim_fleet", "KVFabric", "MemoryNetwork",
        "open_memory_network", "FaultSpec",
    }  # fmt: skip
    for name in narwhal.testing.__all__:
        assert getattr(narwhal.testing, name) is not None


async def test_stream_matches_the_recording(autojump_clock: trio.abc.Clock) -> None:
    recorded = split_events((FIXTURES / "completions-stream-token-ids.sse").read_bytes())
    rec = [json.loads(e) for e in recorded[:-1]]
    async with client_for() as client:
        body = {"model": "sim-llama", "prompt": "a b c d e f g h i", "max_tokens": 20, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = await resp.aread()
    ours = split_events(raw)
    assert len(ours) == len(recorded) and ours[-1] == recorded[-1] == "[DONE]"
    got = [json.loads(e) for e in ours[:-1]]
    for mine, theirs in zip(got, rec, strict=True):
        assert list(mine) == list(theirs)  # same keys in the same order
        if theirs["choices"]:
            assert list(mine["choices"][0]) == list(theirs["choices"][0])
            assert len(mine["choices"][0]["token_ids"]) == 1
        else:
            assert list(mine["usage"]) == list(theirs["usage"])
    tokens = got[:-1]
    assert tokens[0]["choices"][0]["prompt_token_ids"] == encode("a b c d e f g h i")
    assert all(t["choices"][0]["prompt_token_ids"] is None for t in tokens[1:])
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * 19 + ["length"]
    assert got[-1]["usage"] == {"prompt_tokens": 9, "total_tokens": 29, "completion_tokens": 20}
    assert len({t["id"] for t in got}) == 1 and got[0]["id"].startswith("cmpl-")


async def test_non_streaming_completion(autojump_clock: trio.abc.Clock) -> None:
    async with client_for() as client:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "return_token_ids": True}
        obj = (await client.post("/v1/completions", json=body)).json()
    assert obj["object"] == "text_completion" and obj["kv_transfer_params"] is None
    choice = obj["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7] and len(choice["token_ids"]) == 4
    assert choice["text"] == "".join(token_text(t) for t in choice["token_ids"])
    assert choice["finish_reason"] == "length"
    assert obj["usage"]["completion_tokens"] == 4 and obj["usage"]["prompt_tokens"] == 3


async def test_chat_stream_and_completion(autojump_clock: trio.abc.Clock) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    async with client_for() as client:
        body = {"messages": messages, "max_completion_tokens": 3, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            events = split_events(await resp.aread())
        obj = (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["prompt_token_ids"] == encode_chat(messages)
    tokens = chunks[1:-1]
    assert [len(c["choices"][0]["token_ids"]) for c in tokens] == [1, 1, 1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert obj["object"] == "chat.completion" and obj["kv_transfer_params"] is None
    assert obj["choices"][0]["message"]["role"] == "assistant"
    assert obj["choices"][0]["token_ids"] == [c["choices"][0]["token_ids"][0] for c in tokens]


async def test_tokenize_models_and_small_routes(autojump_clock: trio.abc.Clock) -> None:
    async with client_for() as client:
        tok = (await client.post("/tokenize", json={"model": "sim-llama", "prompt": "hello world"})).json()
        assert tok == {"count": 2, "max_model_len": 2048, "tokens": encode("hello world"), "token_strs": None}
        # Like vLLM's, the simulator's /tokenize takes text only.
        ids = await client.post("/tokenize", json={"prompt": [1, 2, 3]})
        assert ids.status_code == 400 and "must be a string" in ids.json()["error"]["message"]
        chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x y"}]})).json()
        assert chat["tokens"] == encode_chat([{"role": "user", "content": "x y"}])
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        card = models["data"][0]
        assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"} <= set(card)
        assert (card["id"], card["object"], card["owned_by"], card["parent"], card["max_model_len"]) == (
            "sim-llama", "model", "vllm", None, 2048)  # fmt: skip
        health = await client.get("/health")
        assert health.status_code == 200 and health.content == b""
        assert (await client.get("/version")).json() == {"version": "0.32.0"}
        assert (await client.get("/load")).json() == {"server_load": 0}
        assert (await client.get("/nope")).status_code == 404
        assert (await client.get("/v1/completions")).status_code == 405


async def test_errors_have_the_openai_shape(autojump_clock: trio.abc.Clock) -> None:
    async with client_for() as client:
        long = {"prompt": " ".join(["w"] * 2000), "max_tokens": 100}
        r = await client.post("/v1/completions", json=long)
        assert r.status_code == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == 400 and "maximum context length" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        r = await client.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400


def parse_prom(text: str) -> tuple[dict[str, str], dict[str, set[frozenset[str]]]]:
    """(family -> type, sample name -> label-name sets) of a Prometheus text page."""
    types: dict[str, str] = {}
    samples: dict[str, set[frozenset[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})? (\S+)", line)
            assert m, line
            labels = frozenset(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(3) or ""))
            float(m.group(4).replace("+Inf", "inf"))
            samples.setdefault(m.group(1), set()).add(labels)
    return types, samples


async def test_metrics_use_the_recorded_names(autojump_clock: trio.abc.Clock) -> None:
    async with client_for() as client:
        await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 5})
        r = await client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    types, samples = parse_prom(r.text)
    rec_types: dict[str, str] = {}
    rec_samples: dict[str, set[frozenset[str]]] = {}
    for path in FIXTURES.glob("metrics-*.prom"):
        t, s = parse_prom(path.read_text())
        rec_types |= t
        for k, v in s.items():
            rec_samples.setdefault(k, set()).update(v)
    for family, kind in types.items():
        assert rec_types.get(family) == kind, family
    for name, label_sets in samples.items():
        assert name in rec_samples, name
        if name != "vllm:cache_config_info":
            assert label_sets <= rec_samples[name], name
    info = next(iter(samples["vllm:cache_config_info"]))
    assert {"block_size", "num_gpu_blocks", "kv_cache_size_tokens", "enable_prefix_caching"} <= info
    for needed in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:prompt_tokens_by_source_total", "vllm:nixl_num_failed_transfers_total",
                   "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:request_time_per_output_token_seconds_bucket", "process_start_time_seconds"):  # fmt: skip
        assert needed in samples, needed
    assert 'kv_cache_size_tokens="262144"' in r.text and 'block_size="16"' in r.text
    assert 'vllm:prompt_tokens_by_source_total{engine="0",model_name="sim-llama",source="local_compute"} 3.0' in r.text
    assert 'vllm:inter_token_latency_seconds_count{engine="0",model_name="sim-llama"} 4.0' in r.text


async def test_api_key_is_enforced(autojump_clock: trio.abc.Clock) -> None:
    cfg = parse_as(EngineConfig, {"name": "k0", "url": "http://k0.sim:8101", "roles": ["decode"],
                                  "api_key": "sekret", "sim": {}})  # fmt: skip
    async with open_sim_fleet([cfg]) as fleet, fleet.client("k0") as client:
        assert (await client.get("/v1/models")).status_code == 401
        ok = await client.get("/v1/models", headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize("bad", [{"prompt": ""}, {"prompt": [1, "x"]}, {"prompt": "x", "max_tokens": 0},
                                 {"prompt": "x", "n": 2}])  # fmt: skip
async def test_bad_requests_are_400(autojump_clock: trio.abc.Clock, bad: dict[str, Any]) -> None:
    async with client_for() as client:
        r = await client.post("/v1/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
