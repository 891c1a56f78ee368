"""Each code change that once left the profiler's and the preflight's tests green is a
test here: a refit that keeps the old curve or fits means, a generation check that is
always ok, Gate F blind to a version change, optimistic pricing beyond the measured
decode domain; and ``--repeat N`` end to end with its stability figures."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.check import run_check
from narwhal.check.checks import check_stable
from narwhal.config import SLOConfig, parse_fleet, unstructure_fleet
from narwhal.engines.client import EngineIdentity
from narwhal.profile import load_profiles, refit_pair
from narwhal.profile.fit import fit_ttft, median_by_length
from narwhal.profile.stability import profile_repeatedly
from narwhal.profile.store import pair_paths
from narwhal.router.pricing import PricedPlacement
from narwhal.testing import open_sim_fleet
from tests import profilekit
from tests.checkkit import LIMIT_S

SMALL = profilekit.SMALL


async def test_refit_fits_the_medians_of_noisy_repeats_not_the_old_curve_or_the_means(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101, noise=0.3, seed=9))
    loose = {"max_mean_error": 10.0, "max_worst_error": 10.0, "repeats": 5}
    async with open_sim_fleet(config) as sim:
        run, _ = await profilekit.profile(config, sim.transport,
                                          profilekit.settings(tmp_path, **SMALL, **loose))  # fmt: skip
    assert run.ok
    sidecar = pair_paths(run.profiles_path)[1]
    doc = json.loads(sidecar.read_text())
    repeats = [(r["length"], r["ttft_s"]) for r in doc["engines"]["e0"]["prefill"]["repeats"]]
    medians = fit_ttft(median_by_length(repeats))
    by_length: dict[int, list[float]] = {}
    for n, s in repeats:
        by_length.setdefault(n, []).append(s)
    means = fit_ttft({n: statistics.fmean(v) for n, v in by_length.items()})
    # The saved curve is an earlier fitter's (here: of the means), as in a pair to repair.
    doc["engines"]["e0"]["profile"]["ttft"] |= {"a": means.a, "b": means.b, "c": means.c}
    sidecar.write_text(json.dumps(doc))
    refit = refit_pair(config, sidecar, tmp_path / "refit.json", max_mean_error=10.0,
                       max_worst_error=10.0)  # fmt: skip
    assert refit.ok
    curve = load_profiles(refit.profiles_path)["e0"].ttft
    assert (curve.a, curve.b, curve.c) == pytest.approx((medians.a, medians.b, medians.c), rel=1e-9)
    # The noisy repeats make the means' curve a different one: 5 % apart at least.
    assert abs(means.predict(1024) - medians.predict(1024)) > 0.05 * medians.predict(1024)


def _identity(**changes: Any) -> EngineIdentity:
    base = EngineIdentity(url="http://e0.test:8101", model="sim-llama", version="0.32.0",
                          max_model_len=4096, process_start_time=1000.0)  # fmt: skip
    return attrs.evolve(base, **changes)


def test_generation_stable_fails_for_an_engine_that_changed_or_went_away() -> None:
    before = {"e0": _identity(), "e1": _identity(url="http://e1.test:8102"), "e2": None}
    after = {"e0": _identity(process_start_time=1500.0), "e1": None, "e2": None}
    results = {r.engine: r for r in check_stable(before, after)}
    assert set(results) == {"e0", "e1"}  # an engine unreachable from the start is not judged
    assert not results["e0"].ok and results["e0"].detail["process_start_time"] == [1000.0, 1500.0]
    assert "1970-01-01 00:16:40 UTC -> 1970-01-01 00:25:00 UTC" in results["e0"].message
    assert not results["e1"].ok and "unreachable" in results["e1"].message
    same = check_stable(before, {"e0": _identity(), "e1": _identity(url="http://e1.test:8102")})
    assert [r.ok for r in same] == [True, True]


class _Upgraded(profilekit.Wrapper):
    """The engine reports another vLLM version (same process start time)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/version":
            return response
        await response.aread()
        await response.aclose()
        return httpx.Response(200, json={"version": "0.33.0"})


async def test_gate_f_fails_on_a_version_change_alone(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, _ = await profilekit.profile(config, sim.transport,
                                          profilekit.settings(tmp_path, **SMALL))  # fmt: skip
        doc = unstructure_fleet(config) | {"profiles": {"path": str(run.profiles_path)}}
        with trio.fail_after(LIMIT_S):
            same = await run_check(doc, transport=sim.transport)
            upgraded = await run_check(doc, transport=_Upgraded(sim.transport))
    assert same.ok, same.lines()
    bad = {(r.name, r.engine) for r in upgraded.failures}
    assert ("gate_f.generation", "e0") in bad, upgraded.lines()
    failure = upgraded.named("gate_f.generation")[0]
    assert "version '0.32.0' -> '0.33.0'" in failure.message
    assert "process_start_time" not in failure.message


async def test_placement_prices_beyond_the_profiled_decode_domain_conservatively(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A profiler run feeding placement: beyond the measured domain the consumer's
    price is never below the simulator's true TPOT there, nor the fit's own
    extrapolation, and the quote says it is out of the domain."""
    config = profilekit.fleet(profilekit.engine("d0", 8101, noise=0.0))
    async with open_sim_fleet(config) as sim:
        run, _ = await profilekit.profile(config, sim.transport,
                                          profilekit.settings(tmp_path, **SMALL))  # fmt: skip
    profile = load_profiles(run.profiles_path)["d0"]
    decode = profile.decode
    assert decode is not None
    slo = SLOConfig(ttft_s=1.0, tpot_s=0.05)
    placement = PricedPlacement(["d0"], ["d0"], profiles={"d0": profile}, slo=slo,
                                admission="wait")  # fmt: skip
    truth = profilekit.DECODE
    active_max, kv_max = decode.domain.active.max, decode.domain.kv_tokens.max
    prompt = int((decode.domain.kv_tokens.min + kv_max) / 2)
    inside = placement.quote_consumer("d0", prompt, 16)
    assert inside is not None and not inside.out_of_domain
    load = placement.loads["d0"]
    load.decode_requests = int(3 * active_max)  # three times the most streams measured
    load.decode_kv_tokens = int(2 * kv_max)
    beyond = placement.quote_consumer("d0", prompt, 16)
    assert beyond is not None and beyond.out_of_domain
    active = load.decode_requests + 1
    kv = load.decode_kv_tokens + prompt + 16
    true_tpot = truth["c0"] + truth["c1"] * active + truth["c2"] * kv
    assert beyond.predicted_s >= true_tpot
    assert beyond.predicted_s >= decode.predict(active, kv)
    edge = decode.predict(active_max, kv_max)
    assert beyond.predicted_s >= edge * (active / active_max) * (kv / kv_max) * 0.999
    assert placement.counters["out_of_domain"] == 0  # counted when chosen, not when quoted


async def test_repeat_profiles_n_times_and_reports_the_stability_of_each_figure(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101, noise=0.02))
    s = profilekit.settings(tmp_path, **SMALL)
    async with open_sim_fleet(config) as sim:
        with trio.fail_after(3 * profilekit.RUN_LIMIT_S):
            runs, doc = await profile_repeatedly(config, s, 3, transport=sim.transport,
                                                 progress=profilekit.Progress(quiet=True))  # fmt: skip
    assert [r.profiles_path.name for r in runs] == ["profiles.json", "profiles.run2.json",
                                                    "profiles.run3.json"]  # fmt: skip
    assert all(r.ok for r in runs)
    written = json.loads((tmp_path / "profiles.stability.json").read_text())
    assert written == doc and doc["runs"] == [r.profiles_path.name for r in runs]
    entry = doc["engines"]["e0"]
    assert entry["runs_ok"] == 3 == entry["runs"]
    profiles = [load_profiles(r.profiles_path)["e0"] for r in runs]
    seeds = [json.loads(pair_paths(r.profiles_path)[1].read_text())["sweep"]["seed"] for r in runs]
    assert seeds == [7, 8, 9]
    for key, values in (
        ("ttft.a", [p.ttft.a for p in profiles]),
        ("ttft_at.1024", [p.ttft.predict(1024) for p in profiles]),
        ("decode.c1", [p.decode_model.c1 for p in profiles]),
    ):
        figure = entry["figures"][key]
        assert figure["values"] == pytest.approx(values, rel=1e-12)
        mean = statistics.fmean(values)
        assert figure["mean"] == pytest.approx(mean)
        assert figure["sd"] == pytest.approx(statistics.stdev(values))
        assert figure["cv"] == pytest.approx(statistics.stdev(values) / mean)
        assert figure["spread"] == pytest.approx((max(values) - min(values)) / mean)
    # Three runs of a 2 %-noise engine agree: the curve within a few per cent.
    assert 0 < entry["figures"]["ttft_at.1024"]["cv"] < 0.05
    assert len([k for k in entry["figures"] if k.startswith("tpot_at.")]) == 4


def test_the_reprofile_hint_is_the_whole_merging_command() -> None:
    from narwhal.check.gate import reprofile_hint

    sweep = {"prefill_lens": [128, 512, 1024, 2048], "decode_input_lens": [256, 1024],
             "decode_concurrency": [1, 4, 8]}  # fmt: skip
    assert reprofile_hint("d0", "fleet.json", "runs/p.json", sweep) == (
        "narwhal profile --fleet fleet.json --engines d0 --out runs/p.json --prefill-lens "
        "128,512,1024,2048 --decode-input-lens 256,1024 --decode-concurrency 1,4,8"
    )
    assert reprofile_hint("p0", None, None, {"prefill_lens": []}) == (
        "narwhal profile --fleet FLEET --engines p0 --prefill-lens ... --decode-input-lens ... "
        "--decode-concurrency ..."
    )


async def test_the_hint_names_each_engines_own_sweep_and_an_unreachable_engine_fails(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    from narwhal.check import gate

    config = profilekit.fleet(profilekit.engine("e0", 8101), profilekit.engine("d0", 8102))
    async with open_sim_fleet(config) as sim:
        s = profilekit.settings(tmp_path, **SMALL)
        assert (await profilekit.profile(config, sim.transport, s))[0].ok
        # d0 re-profiled with another sweep: the pair's run-level sweep is now d0's.
        other = profilekit.settings(tmp_path, **(SMALL | {"prefill_lens": (64, 256, 512, 2048)}),
                                    engines=("d0",))  # fmt: skip
        assert (await profilekit.profile(config, sim.transport, other))[0].ok
        await sim.engines["e0"].restart()
        await trio.sleep(5)
        doc = unstructure_fleet(config) | {"profiles": {"path": str(tmp_path / "profiles.json")}}
        with trio.fail_after(LIMIT_S):
            report = await run_check(doc, transport=sim.transport)
    hint = report.named("gate_f.generation")[0].message
    assert "--engines e0" in hint and "--prefill-lens 128,256,512,1024 " in hint, hint
    profiles, samples = gate.load_pair(tmp_path / "profiles.json")
    outcome = gate.gate_f(parse_fleet(doc), {"e0": None, "d0": report.identities["d0"]})
    generation = [r for r in outcome.results if r.name == "gate_f.generation"]
    assert [(r.engine, r.ok) for r in generation] == [("e0", False), ("d0", True)]
    e0 = generation[0]
    assert e0.measured is None and e0.limit == attrs.asdict(profiles.engines["e0"].identity)
    assert e0.message == ("engine e0 is unreachable; its generation cannot be compared with "
                          "its profile's")  # fmt: skip
    assert samples["sweep"]["prefill_lens"] == [64, 256, 512, 2048]
