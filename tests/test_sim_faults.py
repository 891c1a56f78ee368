"""Every scripted fault of a simulated engine behaves as named."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import EngineConfig, FaultSpec, parse_as
from narwhal.testing import SimEngine, SimFleet, open_sim_fleet

STEP_S = 0.01
PREFILL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def engine_config(name: str, port: int, **sim: Any) -> EngineConfig:
    return parse_as(EngineConfig, {
        "name": name, "url": f"http://{name}.sim:{port}", "roles": ["prefill", "decode"],
        "connector": {"type": "NixlConnector", "kv_host": f"{name}.kv", "kv_port": 15000 + port % 1000},
        "sim": {"seed": 11, "prefill": {"a": 0.01, "b": 0.0, "c": 0.0},
                "decode": {"c0": STEP_S, "c1": 0.0, "c2": 0.0}, "transfer_s_per_token": 0.0, **sim},
    })  # fmt: skip


@asynccontextmanager
async def fleet_of_two(**sim: Any) -> AsyncIterator[tuple[SimFleet, httpx.AsyncClient, httpx.AsyncClient]]:
    async with open_sim_fleet([engine_config("p0", 8101, **sim), engine_config("d0", 8102, **sim)]) as fleet:
        async with fleet.client("p0", timeout=None) as p, fleet.client("d0", timeout=None) as d:
            yield fleet, p, d


BODY = {"prompt": "one two three four", "max_tokens": 6, "return_token_ids": True}


async def read_stream(client: httpx.AsyncClient, body: dict[str, Any] = BODY) -> tuple[int, list[Any], str | None]:
    """(status, events, error) of a streamed completion; ``error`` names a broken stream."""
    events: list[Any] = []
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                return resp.status_code, [json.loads(await resp.aread())], None
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    except httpx.HTTPError as exc:
        return 200, events, type(exc).__name__
    return 200, events, None


async def prefill(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/v1/completions", json={**BODY, "max_tokens": 1,
                                                      "kv_transfer_params": PREFILL_REQUEST})  # fmt: skip


def engine(fleet: SimFleet, name: str = "d0") -> SimEngine:
    return fleet.engines[name]


async def test_refuse_connection(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, _, d):
        assert (await d.get("/health")).status_code == 200  # a pooled keep-alive connection
        engine(fleet).inject(FaultSpec(kind="refuse_connection", times=2))
        for _ in range(2):
            with pytest.raises(httpx.ConnectError):
                await d.get("/health")
        assert (await d.get("/health")).status_code == 200
        assert engine(fleet).stats.faults == {"refuse_connection": 2}


async def test_delay_headers(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, _, d):
        engine(fleet).inject(FaultSpec(kind="delay_headers", on="decode", delay_s=7.0))
        t0 = trio.current_time()
        async with d.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
            assert trio.current_time() - t0 == pytest.approx(7.0, abs=1e-9)
            await resp.aread()
        assert resp.status_code == 200


@pytest.mark.parametrize("status", [400, 429, 500, 503])
async def test_http_error(autojump_clock: trio.abc.Clock, status: int) -> None:
    async with fleet_of_two() as (fleet, p, _):
        engine(fleet, "p0").inject(FaultSpec(kind="http_error", on="prefill", status=status, message="boom"))
        r = await prefill(p)
        assert r.status_code == status
        assert r.json()["error"]["message"] == "boom" and r.json()["error"]["code"] == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert (await p.post("/v1/completions", json=BODY)).status_code == 200  # not the prefill leg


async def test_close_before_done(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, _, d):
        engine(fleet).inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=2))
        status, events, error = await read_stream(d)
        assert status == 200 and len(events) == 2 and "[DONE]" not in events
        assert error == "RemoteProtocolError"
        await trio.sleep(1)
        assert engine(fleet).running == 0 and engine(fleet).kv_usage == 0.0


async def test_close_before_done_non_streaming(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, p, _):
        engine(fleet, "p0").inject(FaultSpec(kind="close_before_done", on="prefill"))
        with pytest.raises(httpx.RemoteProtocolError):
            await prefill(p)


async def test_done_before_token(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, _, d):
        engine(fleet).inject(FaultSpec(kind="done_before_token", on="decode"))
        assert await read_stream(d) == (200, ["[DONE]"], None)


async def test_silence_after_forever(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, _, d):
        engine(fleet).inject(FaultSpec(kind="silence_after", on="decode", after_tokens=2))
        events: list[str] = []
        with trio.move_on_after(600) as scope:
            async with d.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line:
                        events.append(line)
        assert scope.cancelled_caught and len(events) == 2
        await trio.sleep(1)
        assert engine(fleet).running == 0 and engine(fleet).kv_usage == 0.0


async def test_silence_after_with_delay_then_continues(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, _, d):
        engine(fleet).inject(FaultSpec(kind="silence_after", on="decode", after_tokens=3, delay_s=4.0))
        times = []
        async with d.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    times.append(trio.current_time())
        # silent for 4 s between the 3rd and the 4th token (the engine kept generating)
        assert len(times) == 6 and times[3] - times[2] == pytest.approx(4.0 + STEP_S, abs=1e-6)
        assert times[5] == times[3]


async def test_error_in_stream(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, _, d):
        engine(fleet).inject(FaultSpec(kind="error_in_stream", on="decode", after_tokens=3, status=429,
                                       message="slow down"))  # fmt: skip
        status, events, error = await read_stream(d)
        assert status == 200 and error is None
        assert [len(e["choices"]) for e in events[:3]] == [1, 1, 1]
        assert events[3] == {"error": {"message": "slow down", "type": "BadRequestError", "param": None,
                                       "code": 429}}  # fmt: skip
        assert events[4:] == ["[DONE]"]


@pytest.mark.parametrize("variant", ["missing_engine_id", "bad_block_ids", "wrong_endpoint", "missing_request_id"])
async def test_malformed_descriptor(autojump_clock: trio.abc.Clock, variant: str) -> None:
    async with fleet_of_two() as (fleet, p, _):
        good = (await prefill(p)).json()["kv_transfer_params"]
        engine(fleet, "p0").inject(FaultSpec(kind="malformed_descriptor", variant=variant))  # type: ignore[arg-type]
        bad = (await prefill(p)).json()["kv_transfer_params"]
        changed = {k for k in set(good) | set(bad) if good.get(k) != bad.get(k)}
        expected = {
            "missing_engine_id": {"remote_engine_id", "remote_request_id", "remote_block_ids"},
            "missing_request_id": {"remote_request_id", "remote_block_ids"},
            "bad_block_ids": {"remote_request_id", "remote_block_ids"},
            "wrong_endpoint": {"remote_port", "remote_request_id", "remote_block_ids"},
        }[variant]
        assert changed <= expected
        if variant == "missing_engine_id":
            assert "remote_engine_id" not in bad
        elif variant == "missing_request_id":
            assert "remote_request_id" not in bad
        elif variant == "wrong_endpoint":
            assert bad["remote_port"] != good["remote_port"]
        else:
            assert bad["remote_block_ids"] == ["not-a-block"]


async def test_slow_transfer(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, p, d):
        engine(fleet).inject(FaultSpec(kind="slow_transfer", on="decode", delay_s=3.0))
        desc = (await prefill(p)).json()["kv_transfer_params"]
        t0 = trio.current_time()
        status, events, _ = await read_stream(d, {**BODY, "kv_transfer_params": desc})
        assert status == 200 and events[-1] == "[DONE]"
        assert trio.current_time() - t0 == pytest.approx(3.0 + 6 * STEP_S, rel=0.01)
        assert engine(fleet).stats.prompt_tokens["external_kv_transfer"] == 4


async def test_restart_fault(autojump_clock: trio.abc.Clock) -> None:
    async with fleet_of_two() as (fleet, _, d):
        before = engine(fleet).engine_id
        engine(fleet).inject(FaultSpec(kind="restart", on="decode", after_tokens=2, delay_s=5.0, times=1))
        status, events, error = await read_stream(d)
        assert status == 200 and len(events) == 2 and error is not None
        assert engine(fleet).engine_id != before and engine(fleet).generation == 2
        with pytest.raises(httpx.ConnectError):
            await d.get("/health")  # down for delay_s
        await trio.sleep(5.0)
        assert (await read_stream(d))[1][-1] == "[DONE]"


async def test_on_times_and_probability(autojump_clock: trio.abc.Clock) -> None:
    async def hits(seed: int) -> list[int]:
        async with open_sim_fleet([engine_config("d0", 8102, seed=seed)]) as fleet, \
                fleet.client("d0", timeout=None) as d:  # fmt: skip
            fleet.engines["d0"].inject(FaultSpec(kind="http_error", on="decode", probability=0.5))
            fleet.engines["d0"].inject(FaultSpec(kind="http_error", on="prefill", status=418, times=2))
            out = [(await read_stream(d))[0] for _ in range(20)]
            assert (await d.post("/v1/completions", json=BODY)).status_code == 200  # leg "other"
            prefills = [(await prefill(d)).status_code for _ in range(3)]
            assert prefills == [418, 418, 200]
            return out

    first, second = await hits(1), await hits(1)
    assert first == second  # seeded
    assert 0 < first.count(500) < 20 and first.count(500) + first.count(200) == 20


async def test_faults_from_config(autojump_clock: trio.abc.Clock) -> None:
    faults = [{"kind": "http_error", "on": "any", "status": 503, "times": 1}]
    cfg = engine_config("d0", 8102, faults=faults)
    async with open_sim_fleet([cfg]) as fleet, fleet.client("d0") as d:
        assert (await d.post("/v1/completions", json=BODY)).status_code == 503
        assert (await d.post("/v1/completions", json=BODY)).status_code == 200
        fleet.engines["d0"].inject(FaultSpec(kind="http_error"))
        fleet.engines["d0"].clear_faults()
        assert (await d.post("/v1/completions", json=BODY)).status_code == 200
