"""``--suggest-slo``: targets that a simulation run of the engines bears out, and the split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from narwhal.bench.workload import LengthDist, Workload, build_schedule, prompt_ids
from narwhal.check import SuggestWorkload, load_pair, load_workload, suggest_slo
from narwhal.config import parse_fleet
from narwhal.engines.client import EngineClient
from narwhal.errors import ConfigError
from narwhal.profile.store import Profiles
from narwhal.testing import open_sim_fleet
from tests.checkkit import (
    DECODE,
    PREFILL,
    engine,
    fleet_doc,
    identities,
    identity_of,
    sim_profile,
    with_profiles,
    write_pair,
)

#: The consumers' decode model: steps that grow quickly with the batch.
STEEP = {"c0": 0.005, "c1": 0.0023, "c2": 2e-7}
RATE, INPUT, OUTPUT, REQUESTS = 18.0, "uniform:200:1000", "uniform:10:30", 400


def workload(rate: float, inputs: str, outputs: str, **kw: Any) -> SuggestWorkload:
    return SuggestWorkload(
        rate=rate, input_len=LengthDist.parse(inputs), output_len=LengthDist.parse(outputs), **kw
    )


class _Borrowed(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)


async def test_targets_agree_with_a_run_of_the_simulated_engines(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("p1", 8102, ["prefill"]),
        engine("d0", 8103, ["decode"], decode=STEEP),
        engine("d1", 8104, ["decode"], decode=STEEP),
    )
    config = parse_fleet(doc)
    async with open_sim_fleet(config) as sim:
        live = await identities(config, sim.transport)
        path = write_pair(
            tmp_path / "profiles.json",
            [
                sim_profile(n, i, decode=STEEP if n.startswith("d") else DECODE)
                for n, i in live.items()
            ],
        )
        profiles, _ = load_pair(path)
        s = suggest_slo(with_profiles(doc, path), profiles, workload(RATE, INPUT, OUTPUT))
        assert s.holds and s.best is not None
        assert 0.4 < s.best.prefill < 0.5 and 0.4 < s.best.decode < 0.5
        ttft, tpot = await _run(sim.transport, config, profiles)
    # The engines' own run, on an independent draw of the same workload.
    for name, model, run in (("TTFT", s.ttft_s, ttft), ("TPOT", s.tpot_s, tpot)):
        for q in (50, 90):
            measured = float(np.percentile(run, q))
            assert model[f"p{q}"] == pytest.approx(measured, rel=0.2), (name, q, measured)


async def _run(
    transport: httpx.AsyncBaseTransport, config: Any, profiles: Profiles
) -> tuple[list[float], list[float]]:
    """Drive the engines leg by leg as the model dispatches: each prefill to the producer
    that finishes it first, each decode to the consumer with the fewest streams."""
    schedule = build_schedule(
        Workload(
            rate=RATE,
            num_requests=REQUESTS,
            seed=5,
            input_len=LengthDist.parse(INPUT),
            output_len=LengthDist.parse(OUTPUT),
        )
    )
    free = {"p0": 0.0, "p1": 0.0}
    streams = {"d0": 0, "d1": 0}
    ttft: list[float] = []
    tpot: list[float] = []
    async with httpx.AsyncClient(transport=_Borrowed(transport)) as http:
        clients = {
            e.name: EngineClient(e.url, name=e.name, connector=e.connector, http_client=http)
            for e in config.engines
        }
        start = trio.current_time()

        async def one(index: int, offset: float, prompt_len: int, output_len: int) -> None:
            await trio.sleep_until(start + offset)
            now = trio.current_time() - start
            producer = min(
                free, key=lambda n: max(free[n], now) + profiles[n].predict_ttft(prompt_len)
            )
            free[producer] = max(free[producer], now) + profiles[producer].predict_ttft(prompt_len)
            body = {"prompt": prompt_ids(prompt_len, seed=5, index=index), "max_tokens": output_len}
            handoff = await clients[producer].prefill(body)
            if index >= REQUESTS // 10:  # the model's warm-up is left out here too
                ttft.append(handoff.completed_at - start - offset)
            consumer = min(streams, key=streams.__getitem__)
            streams[consumer] += 1
            times: list[float] = []
            try:
                async with clients[consumer].decode(handoff, body) as stream:
                    async for chunk in stream:
                        times += [trio.current_time()] * chunk.count
            finally:
                streams[consumer] -= 1
            if index >= REQUESTS // 10 and len(times) >= 2:
                tpot.append((times[-1] - times[0]) / (len(times) - 1))

        with trio.fail_after(3600):
            async with trio.open_nursery() as nursery:
                for r in schedule:
                    assert r.prompt_len is not None
                    nursery.start_soon(one, r.index, r.offset_s, r.prompt_len, r.output_len)
    return ttft, tpot


def four_flexible(tmp_path: Path) -> tuple[Any, Profiles]:
    names = ["e0", "e1", "e2", "e3"]
    path = write_pair(
        tmp_path / "profiles.json",
        [sim_profile(n, identity_of(n, 8101 + i)) for i, n in enumerate(names)],
    )
    config = with_profiles(fleet_doc(*(engine(n, 8101 + i) for i, n in enumerate(names))), path)
    return config, load_pair(path)[0]


@pytest.mark.parametrize(
    ("shape", "inputs", "outputs", "rate", "producers"),
    [
        ("prefill-heavy", "uniform:1500:2500", "fixed:16", 15.0, 3),
        ("decode-heavy", "fixed:64", "uniform:300:500", 6.0, 1),
        ("balanced", "fixed:1000", "fixed:100", 5.0, 2),
    ],
)
def test_the_split_follows_the_workload(
    tmp_path: Path, shape: str, inputs: str, outputs: str, rate: float, producers: int
) -> None:
    config, profiles = four_flexible(tmp_path)
    s = suggest_slo(config, profiles, workload(rate, inputs, outputs, requests=500))
    assert s.holds and s.best is not None, shape
    assert len(s.best.producers) == producers and len(s.best.consumers) == 4 - producers
    assert s.candidates == 14  # every assignment with at least one of each role
    assert s.best.worse < 1 and s.ttft_s["p50"] <= s.ttft_s["p90"]
    assert s.tpot_s["p50"] <= s.tpot_s["p90"]


def test_prefill_pressure_is_utilisation_and_decode_pressure_solves_littles_law(
    tmp_path: Path,
) -> None:
    config, profiles = four_flexible(tmp_path)
    s = suggest_slo(config, profiles, workload(6.0, "fixed:1000", "fixed:100", requests=200))
    assert s.best is not None
    service = PREFILL["a"] + PREFILL["b"] * 1000
    assert s.best.prefill == pytest.approx(6.0 * service / len(s.best.producers))
    resident = 1000 + 100 / 2
    k = DECODE["c1"] + DECODE["c2"] * resident
    rate = 6.0 / len(s.best.consumers)
    u = rate * 100 * k
    for name in s.best.consumers:
        step = s.best.step_s[name]
        assert step is not None and step == pytest.approx(DECODE["c0"] / (1 - u))
        assert s.best.active[name] == pytest.approx(rate * 100 * step)  # Little's law
        assert step == pytest.approx(
            DECODE["c0"]
            + DECODE["c1"] * s.best.active[name]
            + DECODE["c2"] * s.best.kv_tokens[name]
        )
    assert s.best.decode == pytest.approx(u)


def test_a_workload_beyond_the_fleet_cannot_be_held(tmp_path: Path) -> None:
    config, profiles = four_flexible(tmp_path)
    s = suggest_slo(config, profiles, workload(40.0, "fixed:64", "uniform:300:500"))
    assert not s.holds and s.best is not None and s.best.worse >= 1
    assert "cannot be held" in (s.reason or "") and "decode pressure" in (s.reason or "")
    assert s.ttft_s == {} and s.tpot_s == {}
    s = suggest_slo(config, profiles, workload(40.0, "fixed:4000", "fixed:2"))
    assert not s.holds and "prefill utilisation" in (s.reason or "")
    data = s.to_json()
    assert data["holds"] is False and json.dumps(data)


def test_kv_capacity_bounds_the_decode_tier(tmp_path: Path) -> None:
    small = [
        sim_profile("p0", identity_of("p0", 8101)),
        sim_profile("d0", identity_of("d0", 8102), kv_capacity=20_000),
    ]
    path = write_pair(tmp_path / "profiles.json", small)
    config = with_profiles(
        fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"])), path
    )
    profiles = load_pair(path)[0]
    s = suggest_slo(config, profiles, workload(2.0, "fixed:3000", "fixed:200", requests=200))
    assert s.best is not None and (s.best.producers, s.best.consumers) == (("p0",), ("d0",))
    utilisation = 2.0 * 200 * (DECODE["c1"] + DECODE["c2"] * 3100)
    kv_fill = s.best.kv_tokens["d0"] / 20_000
    # The KV fill, not the utilisation, is the tighter bound here: it is the pressure.
    assert s.best.decode == pytest.approx(kv_fill) and kv_fill > utilisation


def test_every_engine_needs_a_profile(tmp_path: Path) -> None:
    path = write_pair(tmp_path / "profiles.json", [sim_profile("e0", identity_of("e0", 8101))])
    config = with_profiles(fleet_doc(), path)
    with pytest.raises(ConfigError, match="no accepted profile for engine"):
        suggest_slo(config, load_pair(path)[0], workload(1.0, "10", "10"))


def test_a_fleet_of_several_models_is_refused(tmp_path: Path) -> None:
    """The workload is one model's: pricing every engine as one pool would mix models."""
    names = ("pa", "da", "pb", "db")
    path = write_pair(
        tmp_path / "profiles.json", [sim_profile(n, identity_of(n, 8101 + i)) for i, n in enumerate(names)]
    )
    engines = [
        engine(n, 8101 + i, ["prefill" if n[0] == "p" else "decode"], model=n[1]) | {"model": n[1]}
        for i, n in enumerate(names)
    ]
    config = with_profiles(fleet_doc(*engines), path)
    with pytest.raises(ConfigError, match=r"the engines serve several models \(a, b\) and the workload is one model's"):
        suggest_slo(config, load_pair(path)[0], workload(1.0, "10", "10"))


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"input_len": "10", "output_len": "10"}, r"\$\.rate"),
        ({"rate": 0, "input_len": "10", "output_len": "10"}, r"\$\.rate"),
        ({"rate": 1, "input_len": "uniform:5", "output_len": "10"}, r"\$\.input_len"),
        ({"rate": 1, "input_len": "10", "output_len": "10", "arrival": "bursty"}, r"\$\.arrival"),
        ({"rate": 1, "input_len": "10", "output_len": "10", "duration": 5}, r"\$\.duration"),
        ({"rate": 1, "input_len": "10", "output_len": "10", "requests": 5}, r"\$\.requests"),
    ],
)
def test_workload_files_are_validated(tmp_path: Path, data: dict[str, Any], path: str) -> None:
    file = tmp_path / "w.json"
    file.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=path):
        load_workload(file)


def test_a_workload_file_loads(tmp_path: Path) -> None:
    file = tmp_path / "w.json"
    file.write_text(
        json.dumps(
            {
                "rate": 4,
                "input_len": "uniform:100:500",
                "output_len": 128,
                "arrival": "gamma",
                "burstiness": 0.5,
                "seed": 3,
            }
        )
    )
    w = load_workload(file)
    assert (w.rate, w.input_len.spec, w.output_len.spec) == (4.0, "uniform:100:500", "fixed:128")
    assert (w.arrival, w.burstiness, w.requests, w.seed) == ("gamma", 0.5, 4000, 3)
