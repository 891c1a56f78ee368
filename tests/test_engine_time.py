"""What a probe prefill spends in the engine's steps and outside them: the simulator's
histograms of its own time (as vLLM's), the profiler's reading of them around each
prefill, the fit of the rest, its place in the profile and the preflight's recomputation
of it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.check import run_check
from narwhal.config import FleetConfig, unstructure_fleet
from narwhal.engines.client import EngineClient
from narwhal.engines.metrics import parse_prometheus, sum_samples
from narwhal.errors import ConfigError
from narwhal.profile.cohort import METRICS_TIMEOUT_S
from narwhal.profile.derive import prefill_outside
from narwhal.profile.enginetime import EngineClock, engine_seconds, fit_outside, read_clock
from narwhal.profile.store import Profiles, load_profiles
from narwhal.testing import SimFleet, open_sim_fleet
from tests import profilekit, routerkit
from tests.checkkit import LIMIT_S, rewrite_pair

#: The simulated API server's seconds per prompt token, before the engine core sees it.
FRONTEND = 2e-5
SMALL = profilekit.SMALL | {"prefix_fractions": (0.5,), "queue_burst": 0}


def model(length: int, cached: int = 0) -> float:
    p = profilekit.PREFILL
    return p["a"] + p["b"] * (length - cached) + p["c"] * (length**2 - cached**2)


def _histogram(text: str, name: str) -> tuple[float | None, float | None]:
    samples = parse_prometheus(text)
    return sum_samples(samples.get(f"{name}_sum", ())), sum_samples(samples.get(f"{name}_count", ()))


async def test_the_simulator_reports_its_own_waiting_and_prefill_time_without_the_frontends(
    autojump_clock: trio.abc.Clock,
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101, frontend_s_per_token=FRONTEND))
    async with open_sim_fleet(config) as sim, EngineClient(
        config.engines[0].url, name="e0", transport=sim.transport
    ) as client:
        await trio.sleep(100.0)  # not at the clock's zero: a time counted from 0 shows
        start = trio.current_time()
        result = await client.prefill({"prompt": list(range(1000)), "temperature": 0.0}, transfer=False)
        took = trio.current_time() - start
        text = (await httpx.AsyncClient(transport=sim.transport).get(f"{config.engines[0].url}/metrics")).text
    assert result.prompt_tokens == 1000
    assert took == pytest.approx(1000 * FRONTEND + model(1000))
    assert _histogram(text, "vllm:request_queue_time_seconds") == (0.0, 1.0)
    assert _histogram(text, "vllm:request_prefill_time_seconds") == pytest.approx((model(1000), 1.0))
    assert _histogram(text, "vllm:request_inference_time_seconds") == pytest.approx((model(1000), 1.0))
    # TTFT and latency as vLLM counts them: from the API server's receipt of the request.
    assert _histogram(text, "vllm:time_to_first_token_seconds") == pytest.approx((took, 1.0))
    assert _histogram(text, "vllm:e2e_request_latency_seconds") == pytest.approx((took, 1.0))


async def test_the_profile_measures_the_time_outside_the_engines_steps(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(
        profilekit.engine("e0", 8101, frontend_s_per_token=FRONTEND, prefix_caching=True,
                          prompt_tokens_details=True),
        profilekit.engine("e1", 8102),
    )  # fmt: skip
    async with open_sim_fleet(config) as sim:
        run, out = await profilekit.profile(config, sim.transport, profilekit.settings(tmp_path, **SMALL))
        assert run.ok, out
        doc = unstructure_fleet(config) | {"profiles": {"path": str(run.profiles_path)}}
        with trio.fail_after(LIMIT_S):
            report = await run_check(doc, transport=sim.transport)
        assert report.ok, [r.message for r in report.failures]
        profiles = load_profiles(run.profiles_path)

        # The preflight recomputes it from the samples: a hand-edited figure is refused.
        def halve(profiles: dict[str, Any]) -> None:
            profiles["engines"]["e0"]["prefill_outside"]["per_token_s"] /= 2

        rewrite_pair(run.profiles_path, edit_profiles=halve)
        with trio.fail_after(LIMIT_S):
            report = await run_check(doc, transport=sim.transport)
        failures = [r for r in report.failures if r.name == "gate_f.samples"]
        assert failures and "prefill_outside.per_token_s" in failures[0].message
    engines = profilekit.samples(run)["engines"]
    record = engines["e0"]
    measured = record["prefill"]["repeats"] + record["prefix"]["repeats"]
    assert len(measured) == 4 * 3 + 4 * 3
    for r in measured:  # each the engine's own time: its prefill, none of the frontend's
        assert r["engine_s"] == pytest.approx(model(r["length"], r.get("cached", 0)), rel=1e-6)
        assert r["ttft_s"] - r["engine_s"] == pytest.approx(FRONTEND * r["length"], rel=1e-6)
    assert all("engine_s" not in w for w in record["prefill"]["warmup"] + record["prefix"]["warm"])
    outside = profiles.engines["e0"].prefill_outside
    assert outside is not None and outside.samples == 24
    assert outside.per_token_s == pytest.approx(FRONTEND, rel=1e-6)
    assert outside.base_s == pytest.approx(0.0, abs=1e-9)
    # The TTFT curve is still what a client sees: the frontend's time included.
    assert profiles.engines["e0"].predict_ttft(1000) == pytest.approx(model(1000) + 1000 * FRONTEND, rel=1e-3)
    # An engine with no frontend time has none outside its steps.
    plain = profiles.engines["e1"].prefill_outside
    assert plain is not None and plain.per_token_s == 0.0 and plain.base_s == pytest.approx(0.0, abs=1e-9)


async def test_an_engine_without_the_histograms_has_no_time_outside_its_steps(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101, frontend_s_per_token=FRONTEND))
    async with open_sim_fleet(config) as sim:
        inner = sim.transport

        class NoEngineTime(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                response = await inner.handle_async_request(request)
                if request.url.path != "/metrics":
                    return response
                await response.aread()
                kept = [line for line in response.text.splitlines()
                        if "request_prefill_time" not in line]  # fmt: skip
                return httpx.Response(200, text="\n".join(kept) + "\n")

        run, out = await profilekit.profile(config, NoEngineTime(),
                                            profilekit.settings(tmp_path, **SMALL))  # fmt: skip
    assert run.ok, out
    record = profilekit.samples(run)["engines"]["e0"]
    assert [r["engine_s"] for r in record["prefill"]["repeats"]] == [None] * 12
    assert load_profiles(run.profiles_path).engines["e0"].prefill_outside is None


class _Scripted:
    """A client whose ``/metrics`` answers, in turn, the requests each histogram counted
    and the seconds both hold (a quarter waiting); None: neither histogram, or a name:
    that one's samples missing."""

    def __init__(self, *readings: tuple[int, int, float] | str | None) -> None:
        self.readings = list(readings)
        self.asked = 0

    async def metrics(self, names: frozenset[str] | None = None) -> Any:
        from narwhal.engines.metrics import engine_metrics, parse_prometheus

        # Only the histograms' sums and counts parsed (a vLLM exposition is mostly buckets).
        assert names is not None and {f"vllm:request_{h}_time_seconds_{p}" for h in ("queue", "prefill")
                                      for p in ("sum", "count")} <= names  # fmt: skip
        self.asked += 1
        reading = self.readings.pop(0)
        load = "".join(f"vllm:{g} 0\n" for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
        if not isinstance(reading, tuple):
            queued, prefilled, seconds = 7, 7, 2.0
        else:
            queued, prefilled, seconds = reading
        lines = [f'vllm:request_{h}_time_seconds_{part}{{engine="0"}} {value}'
                 for h, count, share in (("queue", queued, 0.25), ("prefill", prefilled, 0.75))
                 for part, value in (("count", count), ("sum", seconds * share))]  # fmt: skip
        if reading is None:
            lines = []
        elif isinstance(reading, str):
            lines = [line for line in lines if reading not in line]
        return engine_metrics(parse_prometheus(load + "".join(f"{line}\n" for line in lines)))


async def test_a_reading_that_counts_another_request_or_none_gives_no_engine_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    before = EngineClock(queued=3, prefilled=3, seconds=1.0)
    # Counted as waiting first, then as prefilled on the third reading: its time.
    client = _Scripted((3, 3, 1.0), (4, 3, 1.1), (4, 4, 1.5))
    assert await engine_seconds(client, before) == pytest.approx(0.5)  # type: ignore[arg-type]
    assert client.asked == 3
    client = _Scripted((3, 4, 1.1), (4, 4, 1.5))
    assert await engine_seconds(client, before) == pytest.approx(0.5)  # type: ignore[arg-type]
    # Another request counted too (another client's), in either histogram: no time.
    for reading in ((5, 5, 1.9), (5, 4, 1.9), (4, 5, 1.9), (3, 5, 1.9), (5, 3, 1.9)):
        assert await engine_seconds(_Scripted(reading), before) is None  # type: ignore[arg-type]
    # Never counted within the polls: none.
    client = _Scripted(*[(3, 3, 1.0)] * 5)
    assert await engine_seconds(client, before) is None  # type: ignore[arg-type]
    assert client.asked == 5
    # The histograms gone (a restart into a build without them): none.
    assert await engine_seconds(_Scripted(None), before) is None  # type: ignore[arg-type]
    assert await read_clock(_Scripted((7, 6, 2.0))) == EngineClock(7, 6, 2.0)  # type: ignore[arg-type]
    # A /metrics that never answers: none, after the probes' wait for it.
    class Silent:
        async def metrics(self, names: frozenset[str] | None = None) -> Any:
            await trio.sleep_forever()

    start = trio.current_time()
    assert await read_clock(Silent()) is None  # type: ignore[arg-type]
    assert trio.current_time() - start == METRICS_TIMEOUT_S
    for missing in ("queue_time_seconds_sum", "queue_time_seconds_count", "prefill_time_seconds_sum",
                    "prefill_time_seconds_count"):  # fmt: skip
        assert await read_clock(_Scripted(missing)) is None  # type: ignore[arg-type]


def test_the_outside_time_is_a_line_over_the_prompt_lengths() -> None:
    def samples(base: float, slope: float, lengths: tuple[int, ...] = (100, 400, 1600)) -> list[tuple[int, float, float]]:
        return [(n, 0.05 + base + slope * n, 0.05) for n in lengths for _ in range(2)]

    assert fit_outside(samples(0.002, 3e-6)) == pytest.approx((0.002, 3e-6))
    assert fit_outside(samples(0.002, 3e-6, (100, 400))) is None  # two lengths: no line
    # Shrinking with the length (noise): no growth, the mean.
    noisy = [(100, 0.053, 0.05), (400, 0.0525, 0.05), (1600, 0.052, 0.05)]
    assert fit_outside(noisy) == pytest.approx((0.0025, 0.0))
    # A line below zero at no tokens: through the origin instead.
    through = [(100, 0.05 + 1e-6 * 100 - 0.0005, 0.05), (400, 0.05 + 4e-4 - 0.0005, 0.05),
               (1600, 0.05 + 1.6e-3 - 0.0005, 0.05)]  # fmt: skip
    base, slope = fit_outside(through) or (None, None)
    n = (100, 400, 1600)
    y = [t - e for _, t, e in through]
    assert base == 0.0 and slope == pytest.approx(sum(a * b for a, b in zip(n, y, strict=True)) / sum(a * a for a in n))
    # An engine answering faster than its own time says (clocks apart): none below zero.
    assert fit_outside([(n, 0.04, 0.05) for n in (100, 400, 1600)]) == (0.0, 0.0)


def test_a_malformed_engine_time_is_named_by_its_path() -> None:
    entry = {"prefill": {"repeats": [{"length": 100, "ttft_s": 0.05, "engine_s": 0.04},
                                     {"length": 200, "ttft_s": 0.06, "engine_s": "fast"}]}}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        prefill_outside(entry, "$.engines.e0")
    assert info.value.path == "$.engines.e0.prefill.repeats[1].engine_s"
    assert str(info.value) == "expected the engine's seconds (a number >= 0, or null) @ $.engines.e0.prefill.repeats[1].engine_s"
    for bad in (-0.01, math.inf, math.nan, True):
        entry["prefill"]["repeats"][1]["engine_s"] = bad
        with pytest.raises(ConfigError, match="expected the engine's seconds"):
            prefill_outside(entry, "$.engines.e0")
    # Repeats without it (a build that does not report it) are left out; too few: none.
    entry["prefill"]["repeats"][1]["engine_s"] = None
    assert prefill_outside(entry, "$.engines.e0") is None
    entry["prefill"]["repeats"].append({"length": 200, "ttft_s": 0.06, "engine_s": 0.05})
    # ... and those after it still count, over both sweeps; an engine time of 0 is one;
    # a repeat without its TTFT (malformed: its own check names it) is left out here.
    entry["prefix"] = {"repeats": [{"length": 300, "cached": 16, "ttft_s": 0.05, "engine_s": 0.0},
                                   {"length": 300, "cached": 16, "engine_s": 0.02},
                                   {"length": 400, "cached": 16, "ttft_s": 0.07, "engine_s": 0.06}]}  # fmt: skip
    outside = prefill_outside(entry, "$.engines.e0")
    assert outside is not None and outside.samples == 4


async def _burst_of_hits(tmp_path: Path, *, outside: bool) -> list[dict[str, Any]]:
    """A producer whose API server takes 50 us a prompt token (a prompt of 1,124 tokens
    spends 56 ms there, its hit's step part is 5 ms), profiled as ``narwhal profile``
    measures it; one request caches a 1,024-token prefix, then six of it arrive at once.
    ``outside``: priced with the time outside the steps the profile measured, else
    without it. The journal records of the six."""
    producer = routerkit.engine("p0", 8101, ["prefill"], prefill=profilekit.PREFILL, max_num_batched_tokens=8192,
                                prefix_caching=True, prompt_tokens_details=True, frontend_s_per_token=5e-5)  # fmt: skip
    consumer = routerkit.engine("d0", 8102, ["decode"], prefill=profilekit.PREFILL, decode=profilekit.DECODE)
    doc = routerkit.fleet_doc(producer, consumer, controller={"slo": {"ttft_s": 0.3}, "admission": "refuse"})

    async def measured(config: FleetConfig, fleet: SimFleet) -> Profiles:
        settings = profilekit.settings(tmp_path, **(profilekit.SMALL | {"prefix_fractions": (0.5, 0.875)}))
        run, out = await profilekit.profile(config, fleet.transport, settings)
        assert run.ok, out
        profiles = load_profiles(run.profiles_path)
        assert profiles.engines["p0"].prefill_queue == "batched"
        if outside:
            return profiles
        return attrs.evolve(profiles, engines={n: attrs.evolve(p, prefill_outside=None)
                                               for n, p in profiles.engines.items()})  # fmt: skip

    head = " ".join(f"h{j}" for j in range(1024))
    async with routerkit.open_stack(doc, profile=measured) as stack:
        first = await stack.complete({"prompt": f"{head} " + " ".join(f"w{j}" for j in range(100)), "max_tokens": 4})
        assert first.status_code == 200
        await trio.sleep(1.0)

        async def one(i: int) -> None:
            tail = " ".join(f"r{i}w{j}" for j in range(100))
            await stack.complete({"prompt": f"{head} {tail}", "max_tokens": 4})

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
        return stack.records[1:]


async def test_a_burst_of_hits_is_priced_with_each_prompts_outside_time_beside_the_step(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Six hits reach the engine core together, after their API server's 56 ms each, and
    share one step: 132 ms each. Priced with their outside time beside the step, all six
    are served, predicted within a quarter of that (the first placed is priced as a step
    of its own); priced as if each one's 56 ms were in the step, the queue looks six
    times that deep and half of them are refused under a 300 ms target."""

    def ratios(records: list[dict[str, Any]]) -> list[float]:
        return [r["attempts"][-1]["predicted_ttft_s"] / r["ttft_s"] for r in records if r["terminal_class"] == "ok"]

    priced = await _burst_of_hits(tmp_path / "outside", outside=True)
    assert [r["terminal_class"] for r in priced] == ["ok"] * 6
    assert [r["ttft_s"] for r in priced] == [pytest.approx(0.132, abs=1e-3)] * 6
    errors = sorted(abs(x - 1) for x in ratios(priced))
    assert max(ratios(priced)) < 1.25 and errors[2] < 0.15
    in_step = await _burst_of_hits(tmp_path / "in-step", outside=False)
    assert sum(r["terminal_class"] == "refused" for r in in_step) >= 2
    assert max(ratios(in_step)) > 2.0
