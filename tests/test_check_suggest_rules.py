"""The ``--suggest-slo`` model's parts on hand-computed cases: the workload file, the
moments, each tier's pressure, the splits, the warnings and the suggestion's JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from narwhal.bench.workload import LengthDist
from narwhal.check.gate import load_pair
from narwhal.check.suggest import (
    Pressures,
    SLOSuggestion,
    SuggestWorkload,
    _decode_rate,
    _moments,
    _splits,
    _summary,
    _warnings,
    decode_tier,
    load_workload,
    prefill_tier,
    suggest_slo,
)
from narwhal.config import FleetConfig, parse_fleet
from narwhal.errors import ConfigError
from narwhal.profile.store import EngineProfile
from tests.checkkit import engine, fleet_doc, identity_of, sim_profile, with_profiles, write_pair

ZERO = {"a": 0.0, "b": 0.0, "c": 0.0}


def prof(name: str, *, prefill: dict[str, float] | None = None, decode: dict[str, float] | None = None,
         kv: int = 262_144, **kw: Any) -> EngineProfile:  # fmt: skip
    return sim_profile(name, identity_of(name, 8100), prefill=prefill or {"a": 0.25, "b": 0.0, "c": 0.0},
                       decode=decode or {"c0": 0.0, "c1": 0.001, "c2": 0.0}, kv_capacity=kv, **kw)  # fmt: skip


def workload(rate: float, inputs: str, outputs: str, **kw: Any) -> SuggestWorkload:
    return SuggestWorkload(rate=rate, input_len=LengthDist.parse(inputs), output_len=LengthDist.parse(outputs), **kw)


# -- the workload file ---------------------------------------------------------------------


def load(tmp_path: Path, data: Any) -> SuggestWorkload:
    file = tmp_path / "w.json"
    file.write_text(json.dumps(data))
    return load_workload(file)


BASE = {"rate": 1, "input_len": "10", "output_len": "10"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1], "expected an object @ $"),
        (BASE | {"zeta": 1, "duration": 5}, "unknown key 'duration' @ $.duration"),
        ({"input_len": "10", "output_len": "10"}, "expected a finite number > 0 @ $.rate"),
        (BASE | {"rate": True}, "expected a finite number > 0 @ $.rate"),
        (BASE | {"rate": "1"}, "expected a finite number > 0 @ $.rate"),
        (BASE | {"rate": -1}, "expected a finite number > 0 @ $.rate"),
        (BASE | {"rate": 0}, "expected a finite number > 0 @ $.rate"),
        (BASE | {"rate": 1e400}, "expected a finite number > 0 @ $.rate"),
        (BASE | {"burstiness": 0}, "expected a number > 0 @ $.burstiness"),
        (BASE | {"burstiness": 1e400}, "expected a number > 0 @ $.burstiness"),
        (BASE | {"requests": 99}, "expected an integer between 100 and 1000000 @ $.requests"),
        (BASE | {"requests": 1_000_001}, "expected an integer between 100 and 1000000 @ $.requests"),
        (BASE | {"requests": 150.5}, "expected an integer between 100 and 1000000 @ $.requests"),
        (BASE | {"seed": 1.5}, "expected an integer @ $.seed"),
        (BASE | {"input_len": True}, "expected a length spec such as 'uniform:100:500' @ $.input_len"),
        ({"rate": 1, "input_len": "10"}, "expected a length spec such as 'uniform:100:500' @ $.output_len"),
        (BASE | {"output_len": "uniform:5"}, "length spec 'uniform:5': uniform takes 2 number(s) @ $.output_len"),
        (BASE | {"arrival": "bursty"}, "expected one of poisson, gamma, constant @ $.arrival"),
    ],
)
def test_a_bad_workload_file_is_refused_naming_the_key(tmp_path: Path, data: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, data)
    assert str(info.value) == f"{tmp_path / 'w.json'}: {message}"


def test_an_unreadable_workload_file_says_what_it_is(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r": cannot read workload file: "):
        load_workload(tmp_path / "nowhere.json")


def test_a_workload_file_takes_defaults_and_bounds(tmp_path: Path) -> None:
    w = load(tmp_path, {"rate": 2.5, "input_len": 7, "output_len": "uniform:1:3"})
    assert w == workload(2.5, "fixed:7", "uniform:1:3")
    assert (w.arrival, w.burstiness, w.requests, w.seed) == ("poisson", 1.0, 4000, 0)
    assert isinstance(w.requests, int) and isinstance(w.seed, int)
    for requests in (100, 1_000_000):
        assert load(tmp_path, BASE | {"requests": requests}).requests == requests
    w = load(tmp_path, BASE | {"arrival": "constant", "seed": -3, "requests": 200.0})
    assert (w.arrival, w.seed, w.requests) == ("constant", -3, 200)
    assert w.to_json() == {
        "rate": 1.0, "input_len": "fixed:10", "output_len": "fixed:10", "arrival": "constant",
        "burstiness": 1.0, "requests": 200, "seed": -3,
    }  # fmt: skip


# -- the moments ----------------------------------------------------------------------------


def test_fixed_lengths_need_one_sample_and_the_resident_kv_is_time_weighted() -> None:
    m = _moments(workload(1.0, "fixed:100", "fixed:10"))
    assert len(m.inputs) == len(m.outputs) == 1
    assert m.mean_out == 10.0 and m.resident == 105.0
    m = _moments(workload(1.0, "fixed:100", "uniform:1:3", seed=4))
    assert len(m.inputs) == len(m.outputs) == 20_000
    o = m.outputs
    assert m.resident == pytest.approx(float(((100 + o / 2) * o).mean() / o.mean()))
    assert m.resident > 100 + m.mean_out / 2  # weighted by how long each request stays
    again = _moments(workload(1.0, "fixed:100", "uniform:1:3", seed=4))
    assert np.array_equal(m.outputs, again.outputs)
    other = _moments(workload(1.0, "fixed:100", "uniform:1:3", seed=5))
    assert not np.array_equal(m.outputs, other.outputs)
    # Inputs and outputs are drawn from streams of their own.
    both = _moments(workload(1.0, "uniform:1:3", "uniform:1:3", seed=4))
    assert not np.array_equal(both.inputs, both.outputs)
    assert np.array_equal(both.outputs, m.outputs)
    assert np.array_equal(both.inputs, _moments(workload(1.0, "uniform:1:3", "fixed:10", seed=4)).inputs)


# -- the prefill tier -----------------------------------------------------------------------


def test_prefill_spreads_load_for_equal_utilisation_with_pk_waits() -> None:
    fast = prof("fast", prefill={"a": 0.5, "b": 0.0, "c": 0.0})
    slow = prof("slow", prefill={"a": 1.0, "b": 0.0, "c": 0.0})
    rho, rates, mean = prefill_tier([fast, slow], 1.5, np.array([100.0]))
    # Capacity 2 + 1 requests/s; rho 0.5; rates rho/E[S].
    assert rho == 0.5 and rates == {"fast": 1.0, "slow": 0.5}
    # (1/1.5)(1*0.25/1 + 0.5) + (0.5/1.5)(0.5*1/1 + 1)
    assert mean == pytest.approx(1.0)


def test_prefill_waits_use_the_second_moment() -> None:
    p = prof("p", prefill={"a": 0.0, "b": 0.001, "c": 0.0})
    rho, rates, mean = prefill_tier([p], 2.5, np.array([100.0, 300.0]))
    assert rho == pytest.approx(0.5) and rates["p"] == pytest.approx(2.5)
    assert mean == pytest.approx(2.5 * 0.05 / (2 * 0.5) + 0.2)
    # The wait's denominator 2 (1 - rho) at a utilisation other than one half.
    rho, rates, mean = prefill_tier([p], 2.0, np.array([100.0, 300.0]))
    assert rho == pytest.approx(0.4) and rates["p"] == pytest.approx(2.0)
    assert mean == pytest.approx(2.0 * 0.05 / (2 * 0.6) + 0.2)


def test_a_saturated_prefill_tier_has_no_mean() -> None:
    p = prof("p")
    assert prefill_tier([p], 4.0, np.array([10.0])) == (1.0, {"p": 4.0}, None)
    rho, rates, mean = prefill_tier([p], 6.0, np.array([10.0]))
    assert (rho, rates, mean) == (1.5, {"p": 6.0}, None)


# -- the decode tier ------------------------------------------------------------------------


def test_a_consumer_rate_is_bounded_by_its_step_and_its_kv() -> None:
    d = prof("d", decode={"c0": 0.01, "c1": 0.001, "c2": 0.0}, kv=1000)
    # by step: p / (10 * 0.001); by KV: allowed = p*1000/100 active over 10*(0.01 + allowed*0.001).
    assert _decode_rate(d, 0.5, 10.0, 100.0) == pytest.approx(5 / 0.15)
    assert _decode_rate(d, 0.1, 10.0, 100.0) == pytest.approx(min(10.0, 1 / (10 * 0.011)))
    # From pressure 1 on, only the step (the overrun) counts.
    assert _decode_rate(d, 1.0, 10.0, 100.0) == pytest.approx(100.0)
    assert _decode_rate(d, 2.0, 10.0, 100.0) == pytest.approx(200.0)
    # c2 prices the resident KV.
    d2 = prof("d", decode={"c0": 0.01, "c1": 0.0, "c2": 0.00001}, kv=10**9)
    assert _decode_rate(d2, 1.0, 10.0, 100.0) == pytest.approx(1.0 / (10 * 0.001))
    flat = prof("f", decode={"c0": 0.01, "c1": 0.0, "c2": 0.0}, kv=1000)
    # No per-request cost: the KV alone bounds it, at any pressure.
    assert _decode_rate(flat, 1.0, 10.0, 100.0) == pytest.approx(10 / (10 * 0.01))
    assert _decode_rate(flat, 2.0, 10.0, 100.0) == pytest.approx(20 / (10 * 0.01))
    free = prof("f", decode={"c0": 0.0, "c1": 0.0, "c2": 0.0}, kv=1000)
    assert math.isinf(_decode_rate(free, 1.0, 10.0, 100.0))


def test_the_decode_tier_finds_the_equal_pressure() -> None:
    d1 = prof("d1", decode={"c0": 0.0, "c1": 0.001, "c2": 0.0})
    d2 = prof("d2", decode={"c0": 0.0, "c1": 0.002, "c2": 0.0})
    pressure, rates = decode_tier([d1, d2], 75.0, 10.0, 100.0)
    assert pressure == pytest.approx(0.5)
    assert rates == pytest.approx({"d1": 50.0, "d2": 25.0})
    assert sum(rates.values()) == pytest.approx(75.0)
    # Overloaded: the pressure is how much the load overruns.
    pressure, rates = decode_tier([d1], 300.0, 10.0, 100.0)
    assert pressure == pytest.approx(3.0) and rates == pytest.approx({"d1": 300.0})
    pressure, rates = decode_tier([d1], 1000.0, 10.0, 100.0)
    assert pressure == pytest.approx(10.0)


def test_a_load_carried_exactly_at_a_pressure_gets_that_pressure() -> None:
    """The least pressure that carries the load, not the float above it (binary fractions:
    4 requests/s a unit of pressure, exactly)."""
    d = prof("d", decode={"c0": 0.0, "c1": 0.125, "c2": 0.0})
    for rate, pressure in ((2.0, 0.5), (3.0, 0.75), (6.0, 1.5)):
        assert decode_tier([d], rate, 2.0, 100.0) == (pressure, {"d": rate})


def test_a_free_or_hopeless_decode_tier() -> None:
    free = [prof(n, decode={"c0": 0.0, "c1": 0.0, "c2": 0.0}) for n in ("a", "b")]
    assert decode_tier(free, 3.0, 10.0, 100.0) == (0.0, {"a": 1.5, "b": 1.5})
    # A free consumer beside a costly one takes the whole load, at no pressure.
    costly = prof("c", decode={"c0": 0.01, "c1": 0.001, "c2": 0.0})
    assert decode_tier([costly, free[0]], 3.0, 10.0, 100.0) == (0.0, {"c": 0.0, "a": 3.0})
    full = [prof(n, decode={"c0": 0.01, "c1": 0.0, "c2": 0.0}, kv=0) for n in ("a", "b")]
    assert decode_tier(full, 3.0, 10.0, 100.0) == (math.inf, {"a": 1.5, "b": 1.5})


# -- the splits -----------------------------------------------------------------------------


def names(splits: list[tuple[list[str], list[str]]]) -> list[tuple[str, str]]:
    return [(",".join(p), ",".join(d)) for p, d in splits]


def fleet(*engines: dict[str, Any]) -> FleetConfig:
    return parse_fleet(fleet_doc(*engines))


def test_every_assignment_of_the_flexible_engines_with_both_roles_filled() -> None:
    config = fleet(engine("p0", 8101, ["prefill"], no_sim=True), engine("x", 8102, no_sim=True),
                   engine("d0", 8103, ["decode"], no_sim=True))  # fmt: skip
    assert names(_splits(config.engines, lambda n: 0.0)) == [("p0,x", "d0"), ("p0", "d0,x")]
    config = fleet(engine("x", 8101, no_sim=True), engine("y", 8102, no_sim=True))
    assert names(_splits(config.engines, lambda n: 0.0)) == [("x", "y"), ("y", "x")]
    assert _splits(fleet(engine("x", 8101, no_sim=True)).engines, lambda n: 0.0) == []


def test_past_a_dozen_flexible_engines_the_cuts_of_their_speed_order() -> None:
    config = fleet(*[engine(f"e{i:02d}", 8101 + i, no_sim=True) for i in range(13)])
    splits = _splits(config.engines, lambda n: float(n[1:]))  # e12 the fastest at prefill
    order = [f"e{i:02d}" for i in range(12, -1, -1)]
    assert [(p, d) for p, d in splits] == [(order[:cut], order[cut:]) for cut in range(1, 13)]
    twelve = fleet(*[engine(f"e{i:02d}", 8101 + i, no_sim=True) for i in range(12)])
    assert len(_splits(twelve.engines, lambda n: 0.0)) == 2**12 - 2
    fixed = fleet(engine("p", 8100, ["prefill"], no_sim=True), engine("d", 8200, ["decode"], no_sim=True),
                  *[engine(f"e{i:02d}", 8101 + i, no_sim=True) for i in range(13)])  # fmt: skip
    splits = _splits(fixed.engines, lambda n: float(n[1:]) if n[0] == "e" else 0.0)
    assert [(p, d) for p, d in splits] == [(["p", *order[:cut]], ["d", *order[cut:]]) for cut in range(14)]


# -- warnings, summaries, JSON ----------------------------------------------------------------


def pressures(**kw: Any) -> Pressures:
    base: dict[str, Any] = dict(producers=("p",), consumers=("d",), prefill=0.5, decode=0.25,
                                prefill_rates={"p": 1.0}, decode_rates={"d": 1.0}, ttft_pk_mean_s=0.1,
                                step_s={"d": 0.01}, active={"d": 64.0}, kv_tokens={"d": 200_000.0})  # fmt: skip
    return Pressures(**(base | kw))


def test_warnings_name_extrapolated_prompts_and_decode_loads_outside_the_domain() -> None:
    profiles = {"p": prof("p", max_length=1000), "d": prof("d")}
    m = _moments(workload(1.0, "fixed:1000", "fixed:10"))
    assert _warnings(pressures(), profiles, m) == []
    m = _moments(workload(1.0, "fixed:1001", "fixed:10"))
    assert _warnings(pressures(active={"d": 64.5}, kv_tokens={"d": 200_001.0}), profiles, m) == [
        "p: prompts up to 1001 tokens extrapolate its TTFT curve (measured up to 1000)",
        "d: 64.5 active requests holding 200001 KV tokens lie outside its measured decode "
        "domain (active <= 64, KV <= 200000); extend the decode sweep",
    ]
    m = _moments(workload(1.0, "fixed:10", "fixed:10"))
    assert len(_warnings(pressures(active={"d": 64.5}), profiles, m)) == 1
    assert len(_warnings(pressures(kv_tokens={"d": 200_001.0}), profiles, m)) == 1


def test_pressures_hold_below_one() -> None:
    assert pressures(prefill=0.5, decode=0.75).worse == 0.75
    assert pressures(prefill=0.75, decode=0.5).worse == 0.75
    assert pressures(prefill=0.5, decode=0.999).holds
    assert not pressures(prefill=1.0, decode=0.5).holds


def test_summary() -> None:
    assert _summary(np.arange(11.0)) == {"mean": 5.0, "p50": 5.0, "p90": 9.0}


def test_a_suggestion_as_json_spells_out_infinities() -> None:
    best = pressures(decode=math.inf, step_s={"d": None}, active={"d": math.inf}, kv_tokens={"d": math.inf})
    s = SLOSuggestion(workload=workload(1.0, "10", "10"), best=best, holds=False, reason="r",
                      candidates=3)  # fmt: skip
    data = s.to_json()
    assert data == {
        "kind": "narwhal.slo-suggestion",
        "holds": False,
        "reason": "r",
        "workload": workload(1.0, "10", "10").to_json(),
        "split": {
            "producers": ("p",), "consumers": ("d",), "prefill": 0.5, "decode": "inf",
            "prefill_rates": {"p": 1.0}, "decode_rates": {"d": 1.0}, "ttft_pk_mean_s": 0.1,
            "step_s": {"d": None}, "active": {"d": "inf"}, "kv_tokens": {"d": "inf"},
        },
        "targets": {"ttft_s": {}, "tpot_s": {}},
        "warnings": [],
        "splits_priced": 3,
        "requests_simulated": 0,
    }  # fmt: skip
    json.dumps(data, allow_nan=False)
    finite = SLOSuggestion(workload=workload(1.0, "10", "10"), best=pressures(), holds=True,
                           warnings=("w",), ttft_s={"p50": 1.0}, simulated=5).to_json()  # fmt: skip
    assert finite["split"]["active"] == {"d": 64.0} and finite["split"]["kv_tokens"] == {"d": 200_000.0}
    assert finite["warnings"] == ["w"] and finite["requests_simulated"] == 5 and finite["reason"] is None
    assert finite["targets"] == {"ttft_s": {"p50": 1.0}, "tpot_s": {}}
    none = SLOSuggestion(workload=workload(1.0, "10", "10"), best=None, holds=False).to_json()
    assert none["split"] is None


# -- the suggestion ---------------------------------------------------------------------------


def suggest(tmp_path: Path, profiles: list[EngineProfile], engines: list[dict[str, Any]],
            w: SuggestWorkload) -> SLOSuggestion:  # fmt: skip
    path = write_pair(tmp_path / "profiles.json", profiles)
    config = with_profiles(fleet_doc(*engines), path)
    return suggest_slo(config, load_pair(path)[0], w)


def test_one_flexible_engine_cannot_be_split(tmp_path: Path) -> None:
    w = workload(1.0, "10", "10")
    s = suggest(tmp_path, [prof("x"), prof("d")], [engine("x", 8101, no_sim=True)], w)
    assert (s.holds, s.best, s.candidates, s.workload) == (False, None, 0, w)
    assert s.reason == "the fleet cannot be split into producers and consumers (it needs at least two engines)"


def test_the_reason_names_the_tier_that_cannot_hold(tmp_path: Path) -> None:
    engines = [engine("p", 8101, ["prefill"], no_sim=True), engine("d", 8102, ["decode"], no_sim=True)]
    profiles = [prof("p", prefill={"a": 0.5, "b": 0.0, "c": 0.0}), prof("d")]
    s = suggest(tmp_path, profiles, engines, workload(3.0, "10", "10"))
    assert s.reason == ("the workload cannot be held at 3 requests/s: even the best split has "
                        "prefill utilisation 1.50 >= 1")  # fmt: skip
    assert (s.holds, s.candidates, s.ttft_s, s.simulated) == (False, 1, {}, 0)
    profiles = [prof("p", prefill={"a": 0.001, "b": 0.0, "c": 0.0}), prof("d")]
    s = suggest(tmp_path / "2", profiles, engines, workload(150.0, "10", "10"))
    # decode: 150 requests/s of 10 tokens at 0.001 s per request-step: 1.5.
    assert s.reason == ("the workload cannot be held at 150 requests/s: even the best split has "
                        "decode pressure 1.50 >= 1")  # fmt: skip
    # Both tiers at 1.5 (binary fractions, so exactly; the profiles as written, not as
    # refitted from their samples): the reason names the prefill.
    profiles = [prof("p", prefill={"a": 0.5, "b": 0.0, "c": 0.0}), prof("d", decode={"c0": 0.0, "c1": 0.125, "c2": 0.0})]
    path = write_pair(tmp_path / "3.json", profiles)
    exact = attrs.evolve(load_pair(path)[0], engines={p.name: p for p in profiles})
    s = suggest_slo(with_profiles(fleet_doc(*engines), path), exact, workload(3.0, "10", "fixed:4"))
    assert s.best is not None and s.best.prefill == s.best.decode == 1.5
    assert s.reason == ("the workload cannot be held at 3 requests/s: even the best split has "
                        "prefill utilisation 1.50 >= 1")  # fmt: skip


def test_the_best_split_has_the_smallest_worse_then_lesser_pressure(tmp_path: Path) -> None:
    # x and y are the same: either split has the same worse pressure; the tie goes to the
    # split whose lesser pressure is smaller, which is the same here, so to the first.
    engines = [engine("x", 8101, no_sim=True), engine("y", 8102, no_sim=True)]
    w = workload(1.0, "10", "fixed:2", requests=100)
    s = suggest(tmp_path, [prof("x"), prof("y")], engines, w)
    assert s.best is not None and (s.best.producers, s.best.consumers) == (("x",), ("y",))
    assert s.candidates == 2 and s.holds and s.simulated == 100 and s.workload == w
    # y prefills faster and decodes slower: it takes the prefill.
    slow_decode = prof("y", prefill={"a": 0.05, "b": 0.0, "c": 0.0}, decode={"c0": 0.0, "c1": 0.01, "c2": 0.0})
    s = suggest(tmp_path / "2", [prof("x"), slow_decode], engines, workload(1.0, "10", "fixed:2", requests=100))
    assert s.best is not None and (s.best.producers, s.best.consumers) == (("y",), ("x",))
    assert s.ttft_s["p50"] == pytest.approx(0.05) and s.ttft_s["mean"] >= 0.05
    assert s.tpot_s["p50"] == pytest.approx(0.001)


def test_single_token_outputs_have_no_tpot_and_an_overfull_kv_is_warned(tmp_path: Path) -> None:
    engines = [engine("p", 8101, ["prefill"], no_sim=True), engine("d", 8102, ["decode"], no_sim=True)]
    s = suggest(tmp_path, [prof("p"), prof("d")], engines, workload(1.0, "10", "fixed:1", requests=100))
    assert s.holds and s.tpot_s == {} and s.warnings == ()
    w = workload(3.0, "1000", "fixed:20", requests=100)
    fast = prof("p", prefill={"a": 0.01, "b": 0.0, "c": 0.0})
    small = prof("d", decode={"c0": 0.05, "c1": 0.0, "c2": 0.0}, kv=4000)
    s = suggest(tmp_path / "2", [fast, small], engines, w)
    assert s.holds and s.best is not None and s.best.decode == pytest.approx(0.7575)
    assert s.warnings == ("d: resident KV peaked at 8098 tokens in the simulation, above its capacity 4000",)
    exact = prof("d", decode={"c0": 0.05, "c1": 0.0, "c2": 0.0}, kv=8098)
    assert suggest(tmp_path / "3", [fast, exact], engines, w).warnings == ()


def test_past_a_dozen_flexible_engines_the_relatively_fastest_prefill_first(tmp_path: Path) -> None:
    """e04, e07 and e09 prefill 20 times faster and decode 10 times slower than the
    rest: the cuts put them first (ties in fleet order)."""
    fast = (4, 7, 9)
    engines = [engine(f"e{i:02d}", 8101 + i, no_sim=True) for i in range(13)]
    profiles = [
        prof(f"e{i:02d}", prefill={"a": 0.01 if i in fast else 0.2, "b": 0.0, "c": 0.0},
             decode={"c0": 0.0, "c1": 0.01 if i in fast else 0.001, "c2": 0.0})
        for i in range(13)
    ]  # fmt: skip
    s = suggest(tmp_path, profiles, engines, workload(20.0, "100", "fixed:4", requests=100))
    assert s.candidates == 12 and s.best is not None
    assert s.best.producers == ("e04", "e07", "e09", "e00", "e01", "e02", "e03", "e05", "e06", "e08", "e10")
    assert s.best.consumers == ("e11", "e12")


def test_a_consumer_at_full_utilisation_has_no_steady_step(tmp_path: Path) -> None:
    """4 requests/s of 2 tokens at 0.125 s per request-step: utilisation exactly 1 (binary
    fractions, so exactly in floating point too), where T = c0 / (1 - u) has no value;
    and beyond it."""
    engines = [engine("p", 8101, ["prefill"], no_sim=True), engine("d", 8102, ["decode"], no_sim=True)]
    profiles = [prof("p", prefill={"a": 0.001, "b": 0.0, "c": 0.0}),
                prof("d", decode={"c0": 0.001, "c1": 0.125, "c2": 0.0})]  # fmt: skip
    for rate, pressure in ((4.0, 1.0), (6.0, 1.5)):
        s = suggest(tmp_path / str(rate), profiles, engines, workload(rate, "10", "fixed:2"))
        assert s.best is not None and not s.holds
        assert s.best.decode == pytest.approx(pressure) and s.best.prefill == pytest.approx(rate * 0.001)
        assert s.best.prefill_rates == {"p": pytest.approx(rate)}
        assert s.best.decode_rates == {"d": pytest.approx(rate)}
        assert s.best.step_s == {"d": None}
        assert s.best.active == {"d": math.inf} and s.best.kv_tokens == {"d": math.inf}
        assert s.best.ttft_pk_mean_s is not None and s.best.ttft_pk_mean_s > 0.001


def test_the_speed_order_is_the_step_of_one_request_over_the_ttft(tmp_path: Path) -> None:
    """Prompts of 100 tokens that e04, e07 and e09 prefill in 0.01 s and the rest in 0.2 s
    (TTFTs below a second count as they are); e05's and e08's steps cost 0.011 s whatever
    the batch, the others' 0.01 s for one request and 0.02 s for two: by one request's
    step over the TTFT, e04, e07 and e09 come first, then e05 and e08, then the rest."""

    def decode(i: int) -> dict[str, float]:
        return {"c0": 0.011, "c1": 0.0, "c2": 0.0} if i in (5, 8) else {"c0": 0.0, "c1": 0.01, "c2": 0.0}

    profiles = [prof(f"e{i:02d}", prefill={"a": 0.01 if i in (4, 7, 9) else 0.2, "b": 0.0, "c": 0.0},
                     decode=decode(i)) for i in range(13)]  # fmt: skip
    engines = [engine(p.name, 8101 + i, no_sim=True) for i, p in enumerate(profiles)]
    s = suggest(tmp_path, profiles, engines, workload(20.0, "100", "fixed:4", requests=100))
    assert s.candidates == 12 and s.best is not None
    assert s.best.producers == ("e04", "e07", "e09", "e05")
    assert s.best.consumers == ("e08", "e00", "e01", "e02", "e03", "e06", "e10", "e11", "e12")


def test_a_fleet_of_one_model_is_priced(tmp_path: Path) -> None:
    engines = [engine("p", 8101, ["prefill"], no_sim=True) | {"model": "m"},
               engine("d", 8102, ["decode"], no_sim=True) | {"model": "m"}]  # fmt: skip
    s = suggest(tmp_path, [prof("p"), prof("d")], engines, workload(1.0, "10", "fixed:2", requests=100))
    assert s.holds and s.simulated == 100


def test_refusals_name_the_engines_key(tmp_path: Path) -> None:
    engines = [engine("p", 8101, ["prefill"], no_sim=True), engine("d1", 8102, ["decode"], no_sim=True),
               engine("d2", 8103, ["decode"], no_sim=True)]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        suggest(tmp_path, [prof("p")], engines, workload(1.0, "10", "10"))
    assert info.value.path == "$.engines"
    assert info.value.reason == "no accepted profile for engine(s) d1, d2; profile them first (narwhal profile)"
    engines = [engine(n, 8101 + i, ["prefill" if n[0] == "p" else "decode"], no_sim=True) | {"model": n[1]}
               for i, n in enumerate(("pa", "da", "pb", "db"))]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        suggest(tmp_path / "2", [prof(n) for n in ("pa", "da", "pb", "db")], engines, workload(1.0, "10", "10"))
    assert info.value.path == "$.engines"


# -- the simulated run follows the workload ---------------------------------------------------


def targets(tmp_path: Path, w: SuggestWorkload) -> SLOSuggestion:
    """One producer at utilisation 0.5 (0.1 s a prompt of 5 requests/s); one consumer whose
    step grows with its batch."""
    engines = [engine("p", 8101, ["prefill"], no_sim=True), engine("d", 8102, ["decode"], no_sim=True)]
    profiles = [prof("p", prefill={"a": 0.0, "b": 0.001, "c": 0.0}),
                prof("d", decode={"c0": 0.01, "c1": 0.001, "c2": 0.0})]  # fmt: skip
    s = suggest(tmp_path, profiles, engines, w)
    assert s.holds and s.simulated == w.requests and s.workload == w
    return s


def test_the_simulated_run_draws_the_workloads_arrivals(tmp_path: Path) -> None:
    def run(name: str, **kw: Any) -> dict[str, float]:
        return targets(tmp_path / name, workload(5.0, "100", "fixed:10", requests=200, **kw)).ttft_s

    # Evenly spaced arrivals at utilisation 0.5 never wait: every TTFT is the prefill's.
    assert run("constant", arrival="constant") == pytest.approx({"mean": 0.1, "p50": 0.1, "p90": 0.1})
    poisson = run("poisson")
    assert poisson["p90"] > 0.1 and poisson == run("again")
    assert run("seed", seed=1) != poisson  # the arrivals follow the workload's seed
    # Burstier gamma arrivals (a shape below 1) wait longer than nearly even ones.
    assert run("bursty", arrival="gamma", burstiness=0.2)["p90"] > run("even", arrival="gamma", burstiness=5.0)["p90"]


def test_the_simulated_run_draws_the_workloads_lengths_reproducibly(tmp_path: Path) -> None:
    w = workload(5.0, "uniform:50:150", "uniform:5:15", requests=200, seed=2)
    first = targets(tmp_path / "1", w).to_json()
    assert targets(tmp_path / "2", w).to_json() == first
    prompts = targets(tmp_path / "3", workload(5.0, "uniform:50:150", "fixed:10", requests=200, seed=2))
    assert prompts.ttft_s == first["targets"]["ttft_s"]  # the prompts are a stream of their own
