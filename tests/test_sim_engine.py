"""The simulated engine's scheduler and latency model, through HTTP over a memory network."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import EngineConfig, parse_as
from narwhal.engines.metrics import parse_prometheus
from narwhal.testing import SimEngine, SimFleet, open_memory_network, open_sim_fleet
from narwhal.testing.metrics import format_value
from narwhal.testing.scheduler import (
    EngineRestarted,
    GenerateParams,
    Generation,
    Seq,
    open_seq_channel,
)

PREFILL = {"a": 0.010, "b": 1e-4, "c": 2e-7}
DECODE = {"c0": 0.005, "c1": 0.001, "c2": 1e-6}


def engine_config(name: str = "e0", port: int = 8101, **sim: Any) -> EngineConfig:
    block = {"seed": 7, "prefill": PREFILL, "decode": DECODE, **sim}
    return parse_as(EngineConfig, {
        "name": name, "url": f"http://{name}.sim:{port}", "roles": ["prefill", "decode"],
        "connector": {"type": "NixlConnector", "kv_host": f"{name}.kv", "kv_port": 15000 + port % 1000},
        "sim": block,
    })  # fmt: skip


def prompt(n: int, tag: str = "w") -> str:
    """A prompt of exactly ``n`` tokens."""
    return " ".join(f"{tag}{i}" for i in range(n))


@asynccontextmanager
async def one_engine(**sim: Any) -> AsyncIterator[tuple[SimFleet, SimEngine, httpx.AsyncClient]]:
    async with open_sim_fleet([engine_config(**sim)]) as fleet:
        async with fleet.client("e0", timeout=None) as client:
            yield fleet, fleet.engines["e0"], client


async def stream_times(client: httpx.AsyncClient, body: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """(arrival time, event) of every token event of a streamed completion."""
    out: list[tuple[float, dict[str, Any]]] = []
    body = {**body, "stream": True, "return_token_ids": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["choices"]:
                    out.append((trio.current_time(), event))
    return out


async def test_prefill_latency_follows_the_model(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine() as (_, engine, client):
        for n in (10, 100, 1000, 3000):
            t0 = trio.current_time()
            r = await client.post("/v1/completions", json={"prompt": prompt(n, f"p{n}-"), "max_tokens": 1})
            elapsed = trio.current_time() - t0
            assert r.status_code == 200
            assert r.json()["usage"]["prompt_tokens"] == n
            expected = PREFILL["a"] + PREFILL["b"] * n + PREFILL["c"] * n * n
            assert elapsed == pytest.approx(expected, rel=0.01)
        assert engine.stats.prompt_tokens["local_compute"] == 4110


async def test_decode_step_grows_with_batch_and_resident_kv(autojump_clock: trio.abc.Clock) -> None:
    L = 500
    means = {}
    for n in (1, 4):
        async with one_engine() as (_, _engine, client):
            events: dict[int, list[tuple[float, dict[str, Any]]]] = {}

            async def run(i: int, c: httpx.AsyncClient = client, ev: dict[int, Any] = events) -> None:
                ev[i] = await stream_times(c, {"prompt": prompt(L, f"s{i}-"), "max_tokens": 12})

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(run, i)
            # Global timeline: time -> {stream: token index emitted then}.
            steps: dict[float, dict[int, int]] = {}
            for i, evs in events.items():
                for k, (t, _) in enumerate(evs):
                    steps.setdefault(t, {})[i] = k
            times = sorted(steps)
            intervals = []
            for prev, cur in itertools.pairwise(times):
                # a full decode step after a full decode step: every stream emitted at both
                if len(steps[prev]) == n and len(steps[cur]) == n and min(steps[prev].values()) >= 1:
                    resident = sum(L + k for k in steps[cur].values())
                    expected = DECODE["c0"] + DECODE["c1"] * n + DECODE["c2"] * resident
                    assert cur - prev == pytest.approx(expected, rel=1e-6)  # exact: noise off, virtual time
                    intervals.append(cur - prev)
            assert len(intervals) >= 5
            means[n] = sum(intervals) / len(intervals)
    assert means[4] > means[1]


async def test_requests_wait_past_kv_capacity(autojump_clock: trio.abc.Clock) -> None:
    # 256 tokens of KV = 16 blocks; each request reserves ceil((100 + 50) / 16) = 10.
    async with one_engine(kv_capacity_tokens=256, block_size=16, max_model_len=256) as (_, engine, client):
        results: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        seen: list[tuple[int, int]] = []
        pages: list[str] = []

        async def run(name: str, delay: float) -> None:
            await trio.sleep(delay)
            results[name] = await stream_times(client, {"prompt": prompt(100, name), "max_tokens": 50})

        async def watch() -> None:
            await trio.sleep(0.1)
            seen.append((engine.running, engine.waiting))
            pages.append((await client.get("/metrics")).text)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", 0.0)
            nursery.start_soon(run, "b", 0.001)
            nursery.start_soon(watch)
        a_last = results["a"][-1][0]
        b_first = results["b"][0][0]
        assert b_first >= a_last  # b was admitted only when a freed its blocks
        prefill_b = PREFILL["a"] + PREFILL["b"] * 100 + PREFILL["c"] * 100 * 100
        assert b_first - a_last == pytest.approx(prefill_b, rel=0.01)
        assert seen == [(1, 1)]
        assert 'vllm:num_requests_waiting{engine="0",model_name="sim-llama"} 1.0' in pages[0]
        assert engine.stats.max_concurrent == 1
        assert engine.kv_usage == 0.0


async def test_max_num_seqs_bounds_the_batch(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(max_num_seqs=2) as (_, engine, client):
        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(stream_times, client, {"prompt": prompt(20, f"m{i}-"), "max_tokens": 5})
        assert engine.stats.max_concurrent == 2
        assert engine.stats.completed == 5


def prefill_s(start: int, end: int) -> float:
    """The model's cost of computing prompt tokens ``start:end`` in one step, less its fixed ``a``."""
    return PREFILL["b"] * (end - start) + PREFILL["c"] * (end * end - start * start)


async def first_token_at(client: httpx.AsyncClient, n: int, tag: str, delay: float, out: dict[str, float]) -> None:
    await trio.sleep(delay)
    r = await client.post("/v1/completions", json={"prompt": prompt(n, tag), "max_tokens": 1})
    assert r.status_code == 200
    out[tag] = trio.current_time()


async def first_tokens(client: httpx.AsyncClient, *arrivals: tuple[int, str, float]) -> dict[str, float]:
    """When each prompt of (tokens, tag, delay) got its first token, in seconds from now."""
    done: dict[str, float] = {}
    t0 = trio.current_time()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for n, tag, delay in arrivals:
                nursery.start_soon(first_token_at, client, n, tag, delay, done)
    return {tag: at - t0 for tag, at in done.items()}


@pytest.mark.parametrize("budget", [None, 2048])
async def test_chunked_prefill_computes_the_queued_prompts_in_one_step(
    autojump_clock: trio.abc.Clock, budget: int | None
) -> None:
    async with one_engine(max_num_batched_tokens=budget) as (_, engine, client):
        done: dict[str, float] = {}
        seen: list[int] = []

        async def watch() -> None:
            await trio.sleep(0.05)  # during the second step
            seen.append(engine.running)

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first_token_at, client, 100, "a", 0.0, done)
            for tag in "bcd":  # all three arrive while a's step runs
                nursery.start_soon(first_token_at, client, 200, tag, 0.001, done)
            nursery.start_soon(watch)
        a = PREFILL["a"]
        first = a + prefill_s(0, 100)
        assert done["a"] - t0 == pytest.approx(first, rel=0.01)
        if budget is None:  # one prompt a step, each paying the fixed cost
            assert sorted(done[t] - t0 for t in "bcd") == pytest.approx(
                [first + k * (a + prefill_s(0, 200)) for k in (1, 2, 3)], rel=0.01)  # fmt: skip
            assert seen == [1]
        else:  # one step for the three, one fixed cost
            for tag in "bcd":
                assert done[tag] - t0 == pytest.approx(first + a + 3 * prefill_s(0, 200), rel=0.01)
            assert seen == [3]
        assert engine.stats.prompt_tokens["local_compute"] == 700
        assert engine.kv_usage == 0.0


async def test_a_prompt_longer_than_the_budget_is_computed_in_chunks(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(max_num_batched_tokens=256) as (_, engine, client):
        # The short one arrives during the first chunk; the second takes the whole budget,
        # so it shares the third with the long prompt's last 88 tokens.
        done = await first_tokens(client, (600, "long", 0.0), (50, "short", 0.001))
        a = PREFILL["a"]
        steps = [a + prefill_s(0, 256), a + prefill_s(256, 512), a + prefill_s(512, 600) + prefill_s(0, 50)]
        assert done["long"] == pytest.approx(sum(steps), rel=0.01)
        assert done["short"] == done["long"]
        assert engine.stats.prompt_tokens["local_compute"] == 650


async def test_after_a_chunk_that_used_the_whole_budget_its_prompt_goes_first(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(max_num_batched_tokens=256) as (_, _engine, client):
        done = await first_tokens(client, (600, "long", 0.0), (300, "next", 0.001))
        a = PREFILL["a"]
        # The long prompt's second chunk takes the budget whole; its last 88 tokens head
        # the third step, which the next prompt's first 168 fill; its rest is a fourth.
        steps = [a + prefill_s(0, 256), a + prefill_s(256, 512), a + prefill_s(512, 600) + prefill_s(0, 168),
                 a + prefill_s(168, 300)]  # fmt: skip
        assert done["long"] == pytest.approx(sum(steps[:3]), rel=1e-6)
        assert done["next"] == pytest.approx(sum(steps), rel=1e-6)


async def test_a_budget_with_one_token_left_takes_one_token_of_the_next_prompt(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(max_num_batched_tokens=256) as (_, _engine, client):
        done = await first_tokens(client, (100, "first", 0.0), (255, "most", 0.001), (50, "rest", 0.002))
        a = PREFILL["a"]
        steps = [a + prefill_s(0, 100), a + prefill_s(0, 255) + prefill_s(0, 1), a + prefill_s(1, 50)]
        assert done["most"] == pytest.approx(sum(steps[:2]), rel=1e-6)
        assert done["rest"] == pytest.approx(sum(steps), rel=1e-6)


async def test_a_prompt_aborted_in_a_shared_step_leaves_the_others_their_tokens(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(max_num_batched_tokens=2048) as (_, engine, client):
        done: dict[str, float] = {}
        t0 = trio.current_time()
        first = PREFILL["a"] + prefill_s(0, 100)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first_token_at, client, 100, "first", 0.0, done)
                with trio.move_on_at(t0 + first + 0.01):  # gone during the second step, which it heads
                    await trio.sleep(0.001)
                    nursery.start_soon(first_token_at, client, 200, "stays", 0.001, done)
                    await client.post("/v1/completions", json={"prompt": prompt(400, "gone"), "max_tokens": 1})
        assert done["stays"] - t0 == pytest.approx(first + PREFILL["a"] + prefill_s(0, 400) + prefill_s(0, 200), rel=1e-6)
        await trio.sleep(1.0)
        assert engine.stats.aborted == 1 and engine.kv_usage == 0.0


async def test_a_chunked_prompt_pays_its_cached_prefix_once(autojump_clock: trio.abc.Clock) -> None:
    d = 5e-5
    async with one_engine(max_num_batched_tokens=256, prefix_caching=True, block_size=16,
                          prefill={**PREFILL, "d": d}) as (_, _engine, client):  # fmt: skip
        head = prompt(512, "h")
        r = await client.post("/v1/completions", json={"prompt": head, "max_tokens": 1})
        assert r.status_code == 200
        t0 = trio.current_time()
        r = await client.post("/v1/completions", json={"prompt": f"{head} {prompt(400, 't')}", "max_tokens": 1})
        assert r.status_code == 200
        a = PREFILL["a"]
        # 512 cached (32 blocks), 400 computed in chunks of 256 and 144.
        steps = [a + prefill_s(512, 768) + d * 512, a + prefill_s(768, 912)]
        assert trio.current_time() - t0 == pytest.approx(sum(steps), rel=1e-6)
        metrics = (await client.get("/metrics")).text
        assert 'source="local_compute"} 912.0' in metrics and 'source="local_cache_hit"} 512.0' in metrics


async def test_a_chunked_prompt_aborted_between_its_chunks_frees_its_blocks(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(max_num_batched_tokens=256) as (_, engine, client):
        done: dict[str, float] = {}
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(PREFILL["a"] + prefill_s(0, 256) + 0.001):  # gone after its first chunk
                await client.post("/v1/completions", json={"prompt": prompt(600, "gone"), "max_tokens": 1})
            nursery.start_soon(first_token_at, client, 50, "next", 0.0, done)
        await trio.sleep(1.0)
        assert engine.stats.aborted == 1 and engine.running == 0 and engine.kv_usage == 0.0
        # The aborted prompt's second chunk was under way: the next prompt's step follows it.
        first_two = 2 * PREFILL["a"] + prefill_s(0, 512)
        assert done["next"] - t0 == pytest.approx(first_two + PREFILL["a"] + prefill_s(0, 50), rel=0.01)
        assert engine.stats.prompt_tokens["local_compute"] == 50


async def test_noise_is_seeded(autojump_clock: trio.abc.Clock) -> None:
    async def durations() -> list[float]:
        out = []
        async with one_engine(noise=0.2) as (_, _engine, client):
            for n in (50, 60, 70):
                t0 = trio.current_time()
                await client.post("/v1/completions", json={"prompt": prompt(n), "max_tokens": 1})
                out.append(trio.current_time() - t0)
        return out

    first, second = await durations(), await durations()
    assert first == pytest.approx(second, rel=1e-9)
    plain = [PREFILL["a"] + PREFILL["b"] * n + PREFILL["c"] * n * n for n in (50, 60, 70)]
    assert first != pytest.approx(plain, rel=1e-6)


async def test_noise_is_lognormal_around_the_model(autojump_clock: trio.abc.Clock) -> None:
    # Each step's time is the model's times exp(N(0, noise)): the log of observed over
    # modelled has mean 0 and standard deviation ``noise``.
    sigma, n = 0.2, 400
    async with one_engine(noise=sigma) as (_, _engine, client):
        logs = []
        for _ in range(n):
            t0 = trio.current_time()
            await client.post("/v1/completions", json={"prompt": prompt(50), "max_tokens": 1})
            logs.append(math.log((trio.current_time() - t0) / (PREFILL["a"] + prefill_s(0, 50))))
    assert statistics.fmean(logs) == pytest.approx(0.0, abs=4 * sigma / math.sqrt(n))
    assert statistics.stdev(logs) == pytest.approx(sigma, rel=0.15)


async def test_outputs_are_deterministic_and_count_by_id(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine() as (_, _engine, client):
        body = {"prompt": prompt(30), "max_tokens": 64}
        one = [e["choices"][0]["token_ids"][0] for _, e in await stream_times(client, body)]
        two = [e["choices"][0]["token_ids"][0] for _, e in await stream_times(client, body)]
        assert one == two and len(one) == 64
        texts = [e["choices"][0]["text"] for _, e in await stream_times(client, body)]
        assert "" in texts  # some ids have no text of their own; they still count


async def test_tokens_follow_the_model_and_the_token_context(autojump_clock: trio.abc.Clock) -> None:
    # Two engines of one model with different seeds, as a greedy model on two hosts: the
    # same tokens for the same context, and a prompt that is another's prompt plus its
    # first generated tokens continues it token for token.
    configs = [engine_config("e0", 8101, seed=1), engine_config("e1", 8102, seed=2)]
    async with open_sim_fleet(configs) as fleet:
        async with fleet.client("e0", timeout=None) as c0, fleet.client("e1", timeout=None) as c1:
            body = {"prompt": prompt(12), "max_tokens": 10}
            whole = [e["choices"][0]["token_ids"][0] for _, e in await stream_times(c0, body)]
            assert [e["choices"][0]["token_ids"][0] for _, e in await stream_times(c1, body)] == whole
            first = (await stream_times(c0, body))[0][1]
            ids = first["choices"][0]["prompt_token_ids"]
            for k in (1, 4, 9):
                rest = await stream_times(c1, {"prompt": [*ids, *whole[:k]], "max_tokens": 10 - k})
                assert [e["choices"][0]["token_ids"][0] for _, e in rest] == whole[k:]


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the engine's ``/metrics`` (its engine and model labels aside)."""
    got = [s.value for s in parse_prometheus(text).get(name, ())
           if all(dict(s.labels).get(k) == v for k, v in labels.items())]  # fmt: skip
    assert len(got) == 1, (name, labels, got)
    return got[0]


async def test_the_engine_counts_tokens_requests_and_intervals_as_vllm_does(autojump_clock: trio.abc.Clock) -> None:
    # One request at a time, so that every interval is one request's own; 1, 2 and 8
    # tokens: a one-token request has no time per output token, a two-token one has one.
    async with one_engine() as (_, engine, client):
        await trio.sleep(100.0)  # not at the clock's zero: a time counted from 0 shows
        arrivals = [[t for t, _ in await stream_times(client, {"prompt": prompt(30), "max_tokens": n})]
                    for n in (1, 2, 8)]  # fmt: skip
        text = (await client.get("/metrics")).text
    assert [len(a) for a in arrivals] == [1, 2, 8]
    gaps = [b - a for times in arrivals for a, b in itertools.pairwise(times)]
    assert all(g > 0 for g in gaps)
    assert _sample(text, "vllm:generation_tokens_total") == 11
    assert engine.stats.generated_tokens == 11
    assert _sample(text, "vllm:request_success_total", finished_reason="length") == 3
    assert _sample(text, "vllm:request_success_total", finished_reason="abort") == 0
    assert _sample(text, "vllm:time_to_first_token_seconds_count") == 3
    assert _sample(text, "vllm:inter_token_latency_seconds_count") == len(gaps) == 8
    assert _sample(text, "vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(gaps))
    assert _sample(text, "vllm:request_time_per_output_token_seconds_count") == 2
    per_token = [(t[-1] - t[0]) / (len(t) - 1) for t in arrivals if len(t) > 1]
    assert _sample(text, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(sum(per_token))


async def test_token_events_carry_their_index_and_time(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine() as (_, engine, _client):
        await trio.sleep(100.0)
        params = GenerateParams(prompt_ids=tuple(range(30)), max_tokens=5, request_id="r-1")
        async with engine.generate(params) as gen:
            events = [(event, trio.current_time()) async for event in gen]
    assert [e.index for e, _ in events] == [0, 1, 2, 3, 4]
    assert [e.at for e, _ in events] == [at for _, at in events]
    assert [e.finish_reason for e, _ in events] == [None, None, None, None, "length"]


def hand_built(engine: SimEngine, ids: range, max_tokens: int, request_id: str) -> tuple[Seq, trio.MemoryReceiveChannel[Any]]:
    """A sequence built as ``SimEngine.generate`` builds one, for the scheduler alone, and its reader."""
    send, recv = open_seq_channel()
    seq = Seq(params=GenerateParams(prompt_ids=tuple(ids), max_tokens=max_tokens, request_id=request_id),
              arrival=engine.now(), received=engine.now(), remote=False, want_descriptor=False, send=send)  # fmt: skip
    return seq, recv


async def test_a_sequence_whose_reader_is_gone_is_aborted_at_its_next_token(autojump_clock: trio.abc.Clock) -> None:
    # The engine's own requests abort as their reader leaves; the scheduler still ends a
    # sequence whose channel closed first, at the token it could not deliver.
    async with one_engine() as (_, engine, _client):
        sched = engine.scheduler
        seq, recv = hand_built(engine, range(30), 50, "r-1")
        recv.close()
        sched.submit(seq)
        await trio.sleep(1.0)
        assert seq.state == "aborted" and seq.generated == 1  # its first token, after the prefill
        assert sched.running == 0 and sched.kv_usage == 0.0
        assert engine.stats.aborted == 1 and engine.stats.generated_tokens == 1
        assert sched.metrics.request_success["abort"] == 1


async def test_client_disconnect_aborts_and_frees_kv(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine() as (_, engine, client):
        body = {"prompt": prompt(64), "max_tokens": 1000, "stream": True}
        seen = 0
        with trio.CancelScope() as scope:  # leaving by cancellation unwinds httpx's generators
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        assert engine.running == 1 and engine.kv_usage > 0
                        scope.cancel()
        assert seen == 3
        await trio.sleep(1.0)
        assert engine.running == 0 and engine.kv_usage == 0.0
        assert engine.stats.aborted == 1
        metrics = (await client.get("/metrics")).text
        assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="sim-llama"} 1.0' in metrics


async def test_restart_makes_a_new_generation(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine() as (_, engine, client):
        before = (engine.engine_id, engine.process_start_time, engine.generation)
        await trio.sleep(3.0)
        body = {"prompt": prompt(64), "max_tokens": 1000, "stream": True}
        with pytest.raises(httpx.HTTPError):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        await engine.restart()
        after = (engine.engine_id, engine.process_start_time, engine.generation)
        assert after[0] != before[0] and after[1] > before[1] and after[2] == before[2] + 1
        assert engine.stats.broken == 1 and engine.running == 0 and engine.kv_usage == 0.0
        metrics = (await client.get("/metrics")).text
        assert f"\nprocess_start_time_seconds {format_value(after[1])}\n" in metrics
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["created"] == int(after[1])
        # the new generation serves normally
        r = await client.post("/v1/completions", json={"prompt": prompt(5), "max_tokens": 2})
        assert r.status_code == 200


async def test_restart_downtime_refuses_connections(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine() as (_, engine, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: engine.restart(downtime_s=2.0))
            await trio.sleep(1.0)
            with pytest.raises(httpx.ConnectError):
                await client.get("/health")
        assert (await client.get("/health")).status_code == 200


async def test_prefix_cache_serves_repeated_prompts(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(prefix_caching=True, block_size=16) as (_, engine, client):
        text = prompt(100)
        durations = []
        for _ in range(2):
            t0 = trio.current_time()
            await client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
            durations.append(trio.current_time() - t0)
        cached = 96  # six whole blocks; the last (partial) block is recomputed
        # the 4 new tokens attend over the 96 cached ones: 100**2 - 96**2 attention pairs
        expected = PREFILL["a"] + PREFILL["b"] * 4 + PREFILL["c"] * (100**2 - 96**2)
        assert durations[1] == pytest.approx(expected, rel=0.01)
        assert engine.stats.prompt_tokens == {"local_compute": 104, "local_cache_hit": cached,
                                              "external_kv_transfer": 0}  # fmt: skip
        metrics = (await client.get("/metrics")).text
        assert 'enable_prefix_caching="True"' in metrics
        assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-llama"} 96.0' in metrics


async def test_closing_the_fleet_leaves_nothing_open(autojump_clock: trio.abc.Clock) -> None:
    streaming = trio.Event()

    async def hold_a_stream(client: httpx.AsyncClient) -> None:
        body = {"prompt": prompt(10), "max_tokens": 4000, "stream": True}
        with pytest.raises(httpx.HTTPError):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for _ in resp.aiter_lines():
                    streaming.set()

    async with open_memory_network() as net:
        async with trio.open_nursery() as nursery:
            async with open_sim_fleet([engine_config()], network=net) as fleet:
                client = fleet.client("e0", timeout=None)
                nursery.start_soon(hold_a_stream, client)
                await streaming.wait()
                assert net.open_connections == 1
                engine = fleet.engines["e0"]
        assert net.open_connections == 0
        assert engine.running == 0 and engine.kv_usage == 0.0
        await client.aclose()


async def test_prefill_and_decode_steps_take_turns(autojump_clock: trio.abc.Clock) -> None:
    # Prompts queued behind a running decode each wait for one decode step: the decode
    # gets a token between any two prefills, and no prefill waits for the decode to end.
    async with one_engine() as (_, _engine, client):
        times: dict[str, list[float]] = {}

        async def run(name: str, n: int, max_tokens: int, delay: float) -> None:
            await trio.sleep(delay)
            times[name] = [t for t, _ in await stream_times(client, {"prompt": prompt(n, name), "max_tokens": max_tokens})]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "d", 10, 30, 0.0)
            for i in range(3):
                nursery.start_soon(run, f"p{i}-", 1000, 1, 0.05)
        prefill_1000 = PREFILL["a"] + prefill_s(0, 1000)  # 0.31 s a prompt
        gaps = [b - a for a, b in itertools.pairwise(times["d"])]
        assert max(gaps) < prefill_1000 + 2 * DECODE["c0"]  # one prefill between two tokens, never two
        assert sum(g > prefill_1000 for g in gaps) == 3  # one for each prompt
        firsts = sorted(times[f"p{i}-"][0] for i in range(3))
        assert firsts[2] - firsts[0] < 3 * prefill_1000  # the prompts wait on decode steps, not on the decode


async def test_a_restart_breaks_every_live_request(autojump_clock: trio.abc.Clock) -> None:
    async with one_engine(max_num_seqs=2) as (_, engine, _client):
        sched = engine.scheduler
        gens = []
        seqs = []
        for i in range(3):
            seq, recv = hand_built(engine, range(i, i + 30), 50, f"r-{i}")
            seqs.append(seq)
            if i == 2:
                recv.close()  # its reader is gone and the engine has not noticed yet
            else:
                gens.append(Generation(seq, recv))
            sched.submit(seq)
        await trio.sleep(0.2)
        assert (sched.running, sched.waiting) == (2, 1)
        sched.break_all()
        assert [s.state for s in seqs] == ["broken"] * 3 and all(s.broken for s in seqs)
        assert engine.stats.broken == 3 and sched.running == sched.waiting == 0 and sched.kv_usage == 0.0
        for gen in gens:
            with pytest.raises(EngineRestarted, match=r"^engine restarted$"):
                async for _ in gen:
                    pass


async def test_aborted_requests_leave_every_queue_and_are_counted(autojump_clock: trio.abc.Clock) -> None:
    # 256 tokens of KV: the first request holds it, the next two wait; both leave waiting.
    async with one_engine(kv_capacity_tokens=256, max_model_len=256) as (_, engine, _client):
        sched = engine.scheduler
        built = [hand_built(engine, range(i, i + 100), 50, f"r-{i}") for i in range(3)]  # readers kept open
        seqs = [seq for seq, _ in built]
        for seq in seqs:
            sched.submit(seq)
        await trio.sleep(0.1)
        assert (sched.running, sched.waiting) == (1, 2)
        for seq in seqs[1:]:
            sched.abort(seq)
        assert (sched.running, sched.waiting) == (1, 0) and [s.state for s in seqs[1:]] == ["aborted"] * 2
        assert engine.stats.aborted == 2 and sched.metrics.request_success["abort"] == 2
        sched.abort(seqs[1])  # once ended, an abort is a no-op
        assert engine.stats.aborted == 2
