"""The cached-prefix sweep: measured on simulated prefix-caching engines in virtual time,
fitted, validated, stored with its samples, and recomputed (and refused when edited) by
the preflight."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal.check import CheckReport, run_check
from narwhal.config import FleetConfig, SLOConfig, unstructure_fleet
from narwhal.profile import ProfileRun
from narwhal.profile.fit import cached_rejection, fit_cached
from narwhal.profile.stability import engine_figures
from narwhal.profile.store import load_profiles
from narwhal.profile.sweep import plan_cells, plan_prefix_cells
from narwhal.router.pricing import PricedPlacement
from narwhal.testing import open_sim_fleet
from tests import profilekit
from tests.checkkit import LIMIT_S, rewrite_pair

SMALL = {
    "prefill_lens": (256, 512, 1024, 2048),
    "decode_input_lens": (128, 512),
    "decode_concurrency": (1, 4),
    "decode_tokens": 16,
}
#: A prefill whose attention term shows in the cells, and whose cached tokens still cost a
#: fifth of a computed one (which the TTFT curve alone cannot know).
PREFILL = {"a": 0.02, "b": 5e-5, "c": 4e-8, "d": 1e-5}


def truth(length: int, cached: int) -> float:
    p = PREFILL
    return p["a"] + p["b"] * (length - cached) + p["c"] * (length**2 - cached**2) + p["d"] * cached


def _engine(name: str, port: int, **sim: Any) -> dict[str, Any]:
    return profilekit.engine(name, port, prefix_caching=True, prompt_tokens_details=True,
                             prefill=PREFILL, **sim)  # fmt: skip


async def _profile(tmp_path: Path, config: FleetConfig, transport: httpx.AsyncBaseTransport,
                   **overrides: Any) -> tuple[ProfileRun, str]:  # fmt: skip
    run, out = await profilekit.profile(config, transport,
                                        profilekit.settings(tmp_path, **(SMALL | overrides)))  # fmt: skip
    assert run.ok, out
    return run, out


async def _check(doc: dict[str, Any], transport: httpx.AsyncBaseTransport) -> CheckReport:
    with trio.fail_after(LIMIT_S):
        return await run_check(doc, transport=transport)


def test_cells_are_whole_blocks_short_of_the_last_token() -> None:
    cells = plan_prefix_cells((100, 256, 4096), (0.25, 0.5, 0.875, 0.999), block_size=16,
                              max_model_len=4096)  # fmt: skip
    # 100 tokens: 25 -> 16, 50 -> 48, 87 -> 80, 99 -> 96; 256: 64, 128, 224, 240 (255 -> 240);
    # 4096 does not fit a one-token output under max_model_len 4096.
    assert cells == [(100, 16), (100, 48), (100, 80), (100, 96),
                     (256, 64), (256, 128), (256, 224), (256, 240)]  # fmt: skip
    assert plan_prefix_cells((20,), (0.25,), block_size=16, max_model_len=4096) == []


def test_the_fit_recovers_a_known_model_and_rejects_a_wrong_one() -> None:
    a, b, c, d = 0.01, 4e-5, 3e-8, 2e-6

    def t(n: int, k: int) -> float:
        return a + b * (n - k) + c * (n * n - k * k) + d * k

    cells = [(n, 0) for n in (256, 512, 1024, 2048)] + [(512, 256), (1024, 512), (2048, 1792)]
    fit = fit_cached([(n, k, t(n, k)) for n, k in cells for _ in range(3)])
    assert fit.a == pytest.approx(a, rel=1e-6) and fit.b == pytest.approx(b, rel=1e-6)
    assert fit.c == pytest.approx(c, rel=1e-6) and fit.d == pytest.approx(d, rel=1e-6)
    assert fit.worst_error < 1e-9 and fit.loo_worst_error < 1e-6
    assert cached_rejection(fit) is None
    # A cached prefix that costs as much as computing it: the model cannot say so with a
    # hit cheaper than a miss everywhere else, and leave-one-cell-out shows it.
    odd = [(n, k, t(n, 0) if (n, k) == (2048, 1792) else t(n, k)) for n, k in cells]
    assert cached_rejection(fit_cached(odd)) is not None
    with pytest.raises(ValueError, match="cells with a cached prefix"):
        fit_cached([(n, k, t(n, k)) for n, k in cells[:5]])


async def test_the_sweep_recovers_the_simulators_coefficients(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(_engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, out = await _profile(tmp_path, config, sim.transport)
        stats = sim.engines["e0"].stats
    record = profilekit.samples(run)["engines"]["e0"]["prefix"]
    assert record["block_size"] == 16
    assert record["reset"].startswith("POST /reset_prefix_cache")
    cells = {(c["length"], c["cached"]) for c in record["cells"]}
    assert (2048, 1792) in cells and (256, 64) in cells and len(cells) == 12
    assert len(record["repeats"]) == 12 * 3 and len(record["warm"]) == 12 * 3
    # The engine served exactly the warmed prefix every time.
    assert all(r["reported_cached"] == r["cached"] for r in record["repeats"])
    assert stats.prompt_tokens["local_cache_hit"] == sum(r["cached"] for r in record["repeats"])
    model = load_profiles(run.profiles_path).engines["e0"].cached_prefill
    assert model is not None
    assert model.a == pytest.approx(PREFILL["a"], rel=1e-3)
    assert model.b == pytest.approx(PREFILL["b"], rel=1e-3)
    assert model.c == pytest.approx(PREFILL["c"], rel=1e-3)
    assert model.d == pytest.approx(PREFILL["d"], rel=1e-3)
    assert model.predict(2048, 1792) == pytest.approx(truth(2048, 1792), rel=1e-3)
    assert model.max_cached == 1792 and model.block_size == 16 and model.cells == 16
    assert model.loo_worst_error < 0.01
    assert "prefix fit: TTFT" in out


async def test_without_prefix_caching_or_fractions_the_sweep_is_skipped(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101), _engine("e1", 8102))
    async with open_sim_fleet(config) as sim:
        run, _ = await profilekit.profile(
            config, sim.transport, profilekit.settings(tmp_path, **SMALL, prefix_fractions=()))
    assert run.ok
    engines = profilekit.samples(run)["engines"]
    assert engines["e0"]["prefix"] == {"skipped": "the engine does not report prefix caching enabled"}
    assert engines["e1"]["prefix"] == {"skipped": "no --prefix-fractions"}
    assert any("cached-prefix sweep was skipped" in w for w in engines["e1"]["warnings"])
    profiles = load_profiles(run.profiles_path)
    assert profiles.engines["e0"].cached_prefill is None
    assert profiles.engines["e1"].cached_prefill is None


async def test_an_engine_without_the_reset_route_is_swept_with_unique_prompts(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(_engine("e0", 8101))

    async with open_sim_fleet(config) as sim:
        inner = sim.transport

        class NoReset(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                if request.url.path == "/reset_prefix_cache":
                    return httpx.Response(404, json={"detail": "Not Found"})
                return await inner.handle_async_request(request)

        run, _ = await _profile(tmp_path, config, NoReset())
    record = profilekit.samples(run)["engines"]["e0"]["prefix"]
    assert record["reset"].startswith("not offered")
    assert load_profiles(run.profiles_path).engines["e0"].cached_prefill is not None


async def test_check_recomputes_the_cached_model_and_refuses_an_edited_coefficient(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(_engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, _ = await _profile(tmp_path, config, sim.transport)
        doc = unstructure_fleet(config) | {"profiles": {"path": str(run.profiles_path)}}
        report = await _check(doc, sim.transport)
        assert report.ok, [r.message for r in report.failures]
        shown = {r.name for r in report.results if r.engine == "e0"}
        assert {"prefix.mean_error", "prefix.loo_worst_error", "prefix.interval"} <= shown

        def halve_c(profiles: dict[str, Any]) -> None:
            model = profiles["engines"]["e0"]["cached_prefill"]
            model["c"] = model["c"] / 2

        rewrite_pair(run.profiles_path, edit_profiles=halve_c)
        report = await _check(doc, sim.transport)
        failures = [r for r in report.failures if r.name == "gate_f.samples"]
        assert failures and "cached_prefill.c" in failures[0].message

        # A sidecar whose cached-prefix repeats were edited gives another model: refused too.
        def slower(samples: dict[str, Any]) -> None:
            for r in samples["engines"]["e0"]["prefix"]["repeats"]:
                r["ttft_s"] *= 1.3

        rewrite_pair(run.profiles_path, edit_samples=slower)
        report = await _check(doc, sim.transport)
        assert any(r.name == "gate_f.samples" for r in report.failures)


async def test_pricing_uses_the_cached_fit_and_the_formula_without_one(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(_engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, _ = await _profile(tmp_path, config, sim.transport)
    profile = load_profiles(run.profiles_path)["e0"]
    assert profile.cached_prefill is not None
    slo = SLOConfig(ttft_s=1.0, tpot_s=0.05)
    measured = PricedPlacement(["e0"], ["e0"], profiles={"e0": profile}, slo=slo, admission="refuse")
    blind = PricedPlacement(["e0"], ["e0"], profiles={"e0": attrs.evolve(profile, cached_prefill=None)},
                            slo=slo, admission="refuse")  # fmt: skip
    for n, k in ((1124, 1024), (2000, 1600), (600, 64)):
        assert measured.prefill_s("e0", n, k) == pytest.approx(truth(n, k), rel=0.01)
        assert measured.quote_producer("e0", n, cached_tokens=k).own_s == measured.prefill_s("e0", n, k)
        # The TTFT curve alone prices cached tokens as free: d*k too cheap.
        curve = profile.ttft
        formula = curve.predict(n) - curve.predict(k) + curve.predict(0)
        assert blind.prefill_s("e0", n, k) == pytest.approx(formula)
        assert truth(n, k) - formula == pytest.approx(PREFILL["d"] * k, rel=0.05)
    # Upper pricing takes the cached model's bound; a hit never prices above a miss.
    upper = PricedPlacement(["e0"], ["e0"], profiles={"e0": profile}, slo=slo, admission="refuse",
                            pricing="upper")  # fmt: skip
    assert upper.prefill_s("e0", 1124, 1024) == pytest.approx(
        profile.cached_prefill.predict_upper(1124, 1024))
    # `narwhal profile --repeat N` compares the model across runs too.
    figures = engine_figures(profile, [256, 1024], [])
    assert figures["prefix.d"] == profile.cached_prefill.d
    assert figures["prefix_at.1024x512"] == profile.cached_prefill.predict(1024, 512)
    assert "prefix.d" not in engine_figures(attrs.evolve(profile, cached_prefill=None), [256], [])
    costly = attrs.evolve(profile.cached_prefill, d=1.0)
    odd = PricedPlacement(["e0"], ["e0"], profiles={"e0": attrs.evolve(profile, cached_prefill=costly)},
                          slo=slo, admission="refuse")  # fmt: skip
    assert odd.prefill_s("e0", 1124, 1024) == pytest.approx(profile.predict_ttft(1124))


# ------------------------------------------------------------ decode cells of one prefix


def test_a_cohort_that_shares_a_prefix_needs_it_once() -> None:
    args = {"decode_tokens": 16, "max_model_len": 4096, "kv_cache_size_tokens": 4096}
    cells, dropped = plan_cells((600,), (8,), shared_prefix=0, block_size=16, **args)  # 8 x 624 = 4,992 tokens
    assert cells == [] and dropped[0]["reason"] == "8 streams of 624 tokens need 4992 KV tokens; the engine holds 4096"
    cells, dropped = plan_cells((600,), (8,), shared_prefix=512, block_size=16, **args)  # 512 + 8 x 112
    assert cells == [(600, 8, 24)] and dropped == []
    # Whole blocks are held once: 520 tokens are 32 blocks and 8 tokens of each stream's own.
    cells, dropped = plan_cells((4000,), (2,), shared_prefix=520, block_size=16, **args)  # 512 + 2 x 3,506
    assert dropped[0]["reason"] == (
        "2 streams of 4018 tokens need 7524 KV tokens (512 of each a prefix held once); the engine holds 4096"
    )
    # An engine that reports no block size: nothing is known to be held once.
    cells, dropped = plan_cells((600,), (8,), shared_prefix=512, block_size=None, **args)
    assert cells == [] and dropped[0]["reason"].startswith("8 streams of 624 tokens need 4992 KV tokens;")


def test_a_shared_prefix_must_leave_each_decode_prompt_tokens_of_its_own(tmp_path: Path) -> None:
    assert profilekit.settings(tmp_path, decode_input_lens=(600, 1000), decode_shared_prefix=596)
    for bad, message in ((597, "decode-shared-prefix 597 leaves the shortest decode input (600 tokens) fewer than 4"),
                         (-1, "decode-shared-prefix must be 0")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            profilekit.settings(tmp_path, decode_input_lens=(600, 1000), decode_shared_prefix=bad)


async def test_decode_cells_of_one_prefix_reach_more_kv_than_the_engine_holds(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    # 4,096 tokens of KV: six streams of 1,000-token prompts need 6,132 counted in full,
    # 512 + 6 x 510 when they share their first 512 tokens (32 blocks of 16).
    config = profilekit.fleet(_engine("e0", 8101, kv_capacity_tokens=4096))
    async with open_sim_fleet(config) as sim:
        run, _ = await _profile(tmp_path, config, sim.transport, decode_input_lens=(600, 1000),
                                  decode_concurrency=(1, 6), decode_shared_prefix=512)  # fmt: skip
        hits = sim.engines["e0"].stats.prompt_tokens["local_cache_hit"]
        doc = unstructure_fleet(config) | {"profiles": {"path": str(run.profiles_path)}}
        report = await _check(doc, sim.transport)
    assert report.ok, [r.message for r in report.failures]
    decode = profilekit.samples(run)["engines"]["e0"]["decode"]
    assert decode["shared_prefix"] == 512 and decode["dropped_cells"] == []
    assert [(c["input_len"], c["concurrency"], c["kept"]) for c in decode["cells"]] == [
        (600, 1, True), (600, 6, True), (1000, 1, True), (1000, 6, True)]  # fmt: skip
    # Every stream hit the prefix its cell computed first (14 streams, 512 tokens each),
    # beside the cached-prefix sweep's own hits.
    assert hits >= 14 * 512
    profile = load_profiles(run.profiles_path).engines["e0"]
    assert profile.decode is not None and profile.kv_capacity is not None
    assert profile.decode.domain.kv_tokens.max > 4096 == profile.kv_capacity.tokens
    # The simulator's decode step reads every sequence's whole context: the fit finds it.
    assert profile.decode.c2 == pytest.approx(profilekit.DECODE["c2"], rel=0.05)
    assert profile.decode.c1 == pytest.approx(profilekit.DECODE["c1"], rel=0.05)


async def test_an_engine_without_prefix_caching_gets_decode_prompts_unique_from_their_start(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, out = await _profile(tmp_path, config, sim.transport, decode_shared_prefix=64)
        assert sim.engines["e0"].stats.prompt_tokens["local_cache_hit"] == 0
    assert "--decode-shared-prefix 64: the engine does not report prefix caching" in out
    assert profilekit.samples(run)["engines"]["e0"]["decode"]["shared_prefix"] == 0
