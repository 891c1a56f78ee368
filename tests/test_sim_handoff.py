"""KV handoff between simulated producers and consumers (NixlConnector semantics)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import EngineConfig, parse_as
from narwhal.testing import SimFleet, open_sim_fleet
from narwhal.testing.ports import free_port

TPS = 1e-5  # transfer seconds per token
STEP = {"c0": 0.005, "c1": 0.0, "c2": 0.0}
PREFILL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def engine_config(name: str, port: int, *, host: str | None = None, **sim: Any) -> EngineConfig:
    host = host or f"{name}.sim"
    return parse_as(EngineConfig, {
        "name": name, "url": f"http://{host}:{port}", "roles": ["prefill", "decode"],
        "connector": {"type": "NixlConnector", "kv_host": f"{name}.kv", "kv_port": 15000 + port % 1000},
        "sim": {"seed": 3, "decode": STEP, "transfer_s_per_token": TPS, **sim},
    })  # fmt: skip


def prompt(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@asynccontextmanager
async def pair(**sim: Any) -> AsyncIterator[tuple[SimFleet, httpx.AsyncClient, httpx.AsyncClient]]:
    async with open_sim_fleet([engine_config("p0", 8101, **sim), engine_config("d0", 8102, **sim)]) as fleet:
        async with fleet.client("p0", timeout=None) as p, fleet.client("d0", timeout=None) as d:
            yield fleet, p, d


async def prefill(client: httpx.AsyncClient, text: str) -> dict[str, Any]:
    r = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "stream": False, "return_token_ids": True,
                                                    "kv_transfer_params": PREFILL_REQUEST})  # fmt: skip
    assert r.status_code == 200
    obj: dict[str, Any] = r.json()
    assert obj["choices"][0]["finish_reason"] == "length"
    return obj


async def decode(client: httpx.AsyncClient, text: str, kv: dict[str, Any] | None, n: int = 4) -> tuple[int, list[Any]]:
    body = {"prompt": text, "max_tokens": n, "stream": True, "return_token_ids": True,
            "kv_transfer_params": kv}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        raw = await resp.aread()
        if resp.status_code != 200:
            return resp.status_code, [json.loads(raw)]
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e]
    return 200, [e if e == "[DONE]" else json.loads(e) for e in events]


async def test_producer_to_consumer_handoff(autojump_clock: trio.abc.Clock) -> None:
    async with pair() as (fleet, p, d):
        producer, consumer = fleet.engines["p0"], fleet.engines["d0"]
        text = prompt(200)
        obj = await prefill(p, text)
        desc = obj["kv_transfer_params"]
        assert list(desc) == ["do_remote_prefill", "do_remote_decode", "remote_block_ids",
                              "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                              "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
                              "remote_blocks_expiry_time", "transfer_mode",
                              "remote_prefill_cached_tokens"]  # fmt: skip
        assert desc["do_remote_prefill"] is True and desc["do_remote_decode"] is False
        assert desc["remote_engine_id"] == producer.engine_id
        assert (desc["remote_host"], desc["remote_port"]) == ("p0.kv", 15101)
        assert len(desc["remote_block_ids"]) == 1 and len(desc["remote_block_ids"][0]) == 13  # ceil(200/16)
        assert desc["remote_num_tokens"] == 200 and desc["transfer_mode"] == "pull"
        assert desc["remote_request_id"].startswith(obj["id"] + "-0-")
        assert producer.stats.held_handoffs == 1 and producer.kv_usage > 0

        t0 = trio.current_time()
        status, events = await decode(d, text, desc)
        assert status == 200 and events[-1] == "[DONE]"
        done_at = trio.current_time()
        assert [len(e["choices"][0]["token_ids"]) for e in events[:-1]] == [1, 1, 1, 1]
        # greedy and deterministic: the consumer's first token is the producer's token
        assert events[0]["choices"][0]["token_ids"] == obj["choices"][0]["token_ids"]
        assert done_at - t0 == pytest.approx(200 * TPS + 4 * STEP["c0"], rel=0.01)
        assert consumer.stats.prompt_tokens == {"local_compute": 0, "local_cache_hit": 0,
                                                "external_kv_transfer": 200}  # fmt: skip
        assert consumer.stats.transfers == 1
        assert producer.stats.held_handoffs == 0 and producer.kv_usage == 0.0
        metrics = (await d.get("/metrics")).text
        assert 'source="external_kv_transfer"} 200.0' in metrics
        assert "vllm:nixl_xfer_time_seconds_count" in metrics


async def test_first_decode_token_after_transfer_and_one_step(autojump_clock: trio.abc.Clock) -> None:
    async with pair() as (_, p, d):
        text = prompt(1000)
        desc = (await prefill(p, text))["kv_transfer_params"]
        t0 = trio.current_time()
        body = {"prompt": text, "max_tokens": 3, "stream": True, "kv_transfer_params": desc}
        firsts = []
        async with d.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    firsts.append(trio.current_time() - t0)
        assert firsts[0] == pytest.approx(1000 * TPS + STEP["c0"], rel=0.01)
        assert firsts[1] - firsts[0] == pytest.approx(STEP["c0"], rel=0.01)


async def test_a_request_receiving_its_kv_counts_as_waiting(autojump_clock: trio.abc.Clock) -> None:
    # vLLM keeps a request whose KV is still arriving in its waiting queue
    # (num_requests_waiting); it runs once the transfer is done.
    async with pair() as (fleet, p, d):
        consumer = fleet.engines["d0"]
        text = prompt(1000)
        desc = (await prefill(p, text))["kv_transfer_params"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(decode, d, text, desc, 50)
            await trio.sleep(1000 * TPS / 2)
            assert (consumer.waiting, consumer.running) == (1, 0)
            await trio.sleep(1000 * TPS)
            assert (consumer.waiting, consumer.running) == (0, 1)
        assert (consumer.waiting, consumer.running) == (0, 0)


async def test_incomplete_descriptor_is_recomputed(autojump_clock: trio.abc.Clock) -> None:
    async with pair() as (fleet, p, d):
        text = prompt(100)
        desc = (await prefill(p, text))["kv_transfer_params"]
        del desc["remote_engine_id"]
        status, events = await decode(d, text, desc)
        assert status == 200 and events[-1] == "[DONE]"
        consumer = fleet.engines["d0"]
        assert consumer.stats.prompt_tokens["local_compute"] == 100
        assert consumer.stats.prompt_tokens["external_kv_transfer"] == 0
        assert consumer.stats.invalid_descriptors == 1
        assert fleet.engines["p0"].stats.held_handoffs == 1  # never read: held until it expires


@pytest.mark.parametrize(("breakage", "reason"), [
    ("unknown_endpoint", "no KV endpoint at p0.kv:1"),
    ("dead_generation", "engine {engine_id} is not running at this endpoint"),
    ("consumed", "request {request_id} holds no KV here (consumed or expired)"),
    ("bad_blocks", "block ids do not match those of request {request_id}"),
    ("scalar_blocks", "block ids do not match those of request {request_id}"),
])  # fmt: skip
async def test_unusable_descriptor_fails_after_five_seconds(
    autojump_clock: trio.abc.Clock, breakage: str, reason: str
) -> None:
    async with pair() as (fleet, p, d):
        text = prompt(64)
        desc = (await prefill(p, text))["kv_transfer_params"]
        if breakage == "unknown_endpoint":
            desc["remote_port"] = 1
        elif breakage == "dead_generation":
            await fleet.engines["p0"].restart()
        elif breakage == "consumed":
            assert (await decode(d, text, desc))[0] == 200
        elif breakage == "bad_blocks":
            desc["remote_block_ids"] = [[999]]
        else:
            desc["remote_block_ids"] = desc["remote_block_ids"][0][0]  # one id, not a list
        t0 = trio.current_time()
        status, [body] = await decode(d, text, desc)
        assert status == 500 and trio.current_time() - t0 == pytest.approx(5.0, rel=0.01)
        assert body["error"]["message"] == "KV transfer failed: " + reason.format(engine_id=desc["remote_engine_id"], request_id=desc["remote_request_id"])
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == 500
        consumer = fleet.engines["d0"]
        assert consumer.stats.failed_transfers == 1 and consumer.kv_usage == 0.0
        metrics = (await d.get("/metrics")).text
        assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="sim-llama"} 1.0' in metrics


async def test_held_blocks_expire_after_ttl(autojump_clock: trio.abc.Clock) -> None:
    async with pair(handoff_ttl_s=30.0) as (fleet, p, d):
        producer = fleet.engines["p0"]
        desc = (await prefill(p, prompt(64)))["kv_transfer_params"]
        await prefill(p, prompt(64, "v"))
        await trio.sleep(29.0)
        assert producer.stats.held_handoffs == 2 and producer.kv_usage > 0
        await trio.sleep(2.0)
        assert producer.stats.held_handoffs == 0 and producer.kv_usage == 0.0
        assert producer.stats.expired_handoffs == 2
        assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="sim-llama"} 2.0' in (await p.get("/metrics")).text
        assert (await decode(d, prompt(64), desc))[0] == 500


async def test_held_blocks_count_against_admission(autojump_clock: trio.abc.Clock) -> None:
    # 8 blocks; a held handoff of 100 tokens keeps 7, so a 60-token request waits for the TTL.
    async with pair(kv_capacity_tokens=128, max_model_len=128, handoff_ttl_s=10.0) as (fleet, p, _):
        await prefill(p, prompt(100))
        t0 = trio.current_time()
        r = await p.post("/v1/completions", json={"prompt": prompt(50, "x"), "max_tokens": 10})
        assert r.status_code == 200
        assert trio.current_time() - t0 >= 10.0 - 0.1
        assert fleet.engines["p0"].stats.expired_handoffs == 1


async def test_loopback_handoff_through_engine_client() -> None:
    from narwhal.engines.client import EngineClient

    configs = [engine_config(n, free_port(), host="127.0.0.1") for n in ("p0", "d0")]
    with trio.fail_after(10):
        async with open_sim_fleet(configs, sockets=True) as fleet:
            p0, d0 = configs
            async with EngineClient(p0.url, name="p0", connector=p0.connector) as producer, \
                    EngineClient(d0.url, name="d0", connector=d0.connector) as consumer:  # fmt: skip
                result = await producer.prefill({"model": "sim-llama", "prompt": prompt(50), "max_tokens": 6})
                assert result.descriptor["remote_engine_id"] == fleet.engines["p0"].engine_id
                tokens: list[int] = []
                async with consumer.decode(result) as stream:
                    async for chunk in stream:
                        tokens.extend(chunk.token_ids)
                assert len(tokens) == 6
                assert fleet.engines["d0"].stats.prompt_tokens["external_kv_transfer"] == 50
                assert fleet.engines["p0"].stats.held_handoffs == 0


async def test_a_handoff_being_read_is_not_read_twice(autojump_clock: trio.abc.Clock) -> None:
    async with pair() as (fleet, p, d):
        text = prompt(1000)
        desc = (await prefill(p, text))["kv_transfer_params"]
        results: list[tuple[int, list[Any]]] = []

        async def read(delay: float) -> None:
            await trio.sleep(delay)
            results.append(await decode(d, text, desc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, 0.0)
            nursery.start_soon(read, 1000 * TPS / 2)  # while the first pulls the blocks
        (first, _), (second, [body]) = sorted(results, key=lambda r: r[0])
        assert (first, second) == (200, 500)
        assert body["error"]["message"] == f"KV transfer failed: request {desc['remote_request_id']} is already being read"
        assert fleet.engines["p0"].stats.held_handoffs == 0  # the first read freed them


async def test_a_producer_restarted_during_the_read_fails_the_transfer(autojump_clock: trio.abc.Clock) -> None:
    async with pair() as (fleet, p, d):
        text = prompt(1000)
        desc = (await prefill(p, text))["kv_transfer_params"]
        async def restart_mid_read() -> None:
            await trio.sleep(1000 * TPS / 2)
            assert fleet.engines["d0"].waiting == 1  # pulling the blocks
            await fleet.engines["p0"].restart()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_mid_read)
            status, [body] = await decode(d, text, desc)
        assert status == 500
        assert body["error"]["message"] == "KV transfer failed: the producer restarted during the transfer"
        assert fleet.engines["d0"].stats.failed_transfers == 1 and fleet.engines["d0"].kv_usage == 0.0


async def test_a_consumer_leaving_during_the_read_gives_the_blocks_back(autojump_clock: trio.abc.Clock) -> None:
    # A pull of 1 s; the client leaves after 0.5 s and the engine notices (its server
    # watches a request's client once the request has lasted disconnect_check_s).
    async with pair(transfer_s_per_token=1e-3) as (fleet, p, d):
        producer, consumer = fleet.engines["p0"], fleet.engines["d0"]
        text = prompt(1000)
        desc = (await prefill(p, text))["kv_transfer_params"]
        with trio.move_on_after(0.5):
            await decode(d, text, desc)
        await trio.sleep(0.1)
        assert (consumer.waiting, consumer.running) == (0, 0) and consumer.kv_usage == 0.0
        assert producer.stats.held_handoffs == 1  # unread: another consumer may read them
        assert (await decode(d, text, desc))[0] == 200
        assert producer.stats.held_handoffs == 0


@pytest.mark.parametrize("uptime_s", [0.0, 100.0])
async def test_an_idle_producer_frees_its_handoffs_when_they_expire(autojump_clock: trio.abc.Clock, uptime_s: float) -> None:
    # Nothing else happens on the producer: its idle loop wakes for the expiry itself,
    # however long it has been up, and however soon the expiry is.
    async with pair(handoff_ttl_s=0.5) as (fleet, p, _):
        producer = fleet.engines["p0"]
        await trio.sleep(uptime_s)
        await prefill(p, prompt(64))
        assert producer.stats.held_handoffs == 1
        await trio.sleep(0.49)
        assert producer.stats.held_handoffs == 1
        await trio.sleep(0.02)
        assert producer.stats.held_handoffs == 0 and producer.kv_usage == 0.0


async def test_block_ids_as_one_flat_list_are_read_too(autojump_clock: trio.abc.Clock) -> None:
    # vLLM's descriptor groups block ids per KV-cache group; a single group may come flat.
    async with pair() as (fleet, p, d):
        text = prompt(100)
        desc = (await prefill(p, text))["kv_transfer_params"]
        desc["remote_block_ids"] = desc["remote_block_ids"][0]
        status, events = await decode(d, text, desc)
        assert status == 200 and events[-1] == "[DONE]"
        assert fleet.engines["d0"].stats.prompt_tokens["external_kv_transfer"] == 100
        assert fleet.engines["p0"].stats.held_handoffs == 0
