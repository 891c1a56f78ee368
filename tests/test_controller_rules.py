"""Reactive control's rules, one at a time, on :class:`ReactiveController` itself: the
corrections it keeps from journaled records, the demand window, the pressure model, the
choice of a move and the decision it records (no engines; a hand-set clock, or trio's
virtual one for the decision loop)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from narwhal.config import EngineConfig, FleetConfig, parse_fleet
from narwhal.profile.store import EngineProfile
from narwhal.router.controller import ReactiveController
from narwhal.router.pricing import PricedPlacement

from .checkkit import identity_of, sim_profile
from .routerkit import engine, fleet_doc

SLO = {"ttft_s": 0.5, "tpot_s": 0.05}
#: TTFT 0.02 + 2e-4 * L: 0.18 s for an 800-token prompt.
PREFILL = {"a": 0.02, "b": 2e-4, "c": 0.0}
#: TPOT 0.005 + 0.001 * active + 1e-6 * KV tokens.
DECODE = {"c0": 0.005, "c1": 0.001, "c2": 1e-6}


class Clock:
    """A clock the test sets."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(*engines: dict[str, Any], margin: float = 0.10, interval_s: float = 2.0,
          slo: dict[str, Any] | None = None) -> FleetConfig:  # fmt: skip
    reactive = {"enabled": True, "movement_margin": margin, "interval_s": interval_s}
    return parse_fleet(fleet_doc(*engines, controller={"slo": SLO if slo is None else slo, "reactive": reactive}))


def p0() -> dict[str, Any]:
    return engine("p0", 8101, ["prefill"])


def d0() -> dict[str, Any]:
    return engine("d0", 8102, ["decode"])


def dual(name: str, port: int, first: str = "decode") -> dict[str, Any]:
    return engine(name, port, [first, "prefill" if first == "decode" else "decode"])


def profile(name: str, *, prefill: dict[str, float] = PREFILL, decode: dict[str, float] | None = DECODE) -> EngineProfile:
    p = sim_profile(name, identity_of(name, 8100), prefill=prefill, decode=decode or DECODE)
    if decode is None:
        return attrs.evolve(p, decode=None, kv_capacity=None, roles=("prefill",))
    return p


def make(
    config: FleetConfig,
    profiles: dict[str, EngineProfile] | None = None,
    *,
    clock: Callable[[], float] | None = None,
    models: dict[str, list[str]] | None = None,
    **kwargs: Any,
) -> ReactiveController:
    """A controller over a priced placement of ``config``'s engines (every engine in
    every role it permits; the controller applies its own)."""
    if profiles is None:
        profiles = {e.name: profile(e.name, decode=DECODE if e.can_decode else None) for e in config.engines}
    clock = clock or Clock()
    placement = PricedPlacement(
        [e.name for e in config.engines if e.can_prefill], [e.name for e in config.engines if e.can_decode],
        profiles=profiles, slo=config.controller.slo, admission="refuse", clock=clock, models=models,
    )  # fmt: skip
    return ReactiveController(config, placement, clock=clock, **kwargs)


def arrive(controller: ReactiveController, clock: Clock, times: list[float], prompt: int, output: int) -> None:
    for t in times:
        clock.now = t
        controller.on_record({"prompt_tokens": prompt, "requested_output_len": output})


# ------------------------------------------------------------------ construction


def test_dual_role_engines_start_in_their_first_listed_role_and_placement_gets_them() -> None:
    controller = make(fleet(p0(), d0(), dual("x", 8103, "decode"), dual("y", 8104, "prefill")))
    assert controller.dual == ["x", "y"]
    assert controller.role == {"x": "decode", "y": "prefill"}
    assert controller.placement.prefill_engines == ["p0", "y"]
    assert controller.placement.decode_engines == ["d0", "x"]
    assert controller.margin == 0.10 and controller.interval_s == 2.0
    assert controller.window_s == 6.0  # three intervals unless given
    assert controller.slo.ttft_s == 0.5 and controller.slo.tpot_s == 0.05
    assert controller.decisions == [] and controller.decisions_path is None


def test_the_decisions_file_lies_beside_the_journal(tmp_path: Path) -> None:
    controller = make(fleet(p0(), d0()), journal_path=tmp_path / "logs" / "run.jsonl", window_s=1.5)
    assert controller.decisions_path == tmp_path / "logs" / "run.controller.jsonl"
    assert controller.window_s == 1.5


# ------------------------------------------------------------------ observations


def ok_record(*attempts: dict[str, Any], ttft_s: float | None = 0.2, tpot_s: float | None = 0.03) -> dict[str, Any]:
    return {"terminal_class": "ok", "ttft_s": ttft_s, "tpot_s": tpot_s, "attempts": list(attempts)}


def attempt(outcome: str = "ok", producer: str = "p0", consumer: str = "d0",
            ttft: float | None = 0.1, tpot: float | None = 0.02) -> dict[str, Any]:  # fmt: skip
    return {"outcome": outcome, "producer": producer, "consumer": consumer,
            "predicted_ttft_s": ttft, "predicted_tpot_s": tpot}  # fmt: skip


def corrections(controller: ReactiveController) -> tuple[dict[str, float], dict[str, float]]:
    return controller.placement.ttft_correction, controller.placement.tpot_correction


def test_a_successful_attempt_corrects_its_producer_and_consumer() -> None:
    controller = make(fleet(p0(), d0(), dual("x", 8103)))
    # The failed attempt before it is skipped, not the end of the record.
    controller.on_record(ok_record(attempt("error", "x", "x", 0.05, 0.01), attempt()))
    ttft, tpot = corrections(controller)
    # TTFT observed 0.2 / predicted 0.1: ratio 2, weighted 0.8 * 1 + 0.2 * 2.
    assert ttft == pytest.approx({"p0": 1.2, "d0": 1.0, "x": 1.0}, rel=1e-12)
    # TPOT observed 0.03 / predicted 0.02: ratio 1.5.
    assert tpot == pytest.approx({"p0": 1.0, "d0": 1.1, "x": 1.0}, rel=1e-12)


def test_a_prediction_already_corrected_is_compared_as_the_raw_model() -> None:
    controller = make(fleet(p0(), d0()))
    ttft, tpot = corrections(controller)
    ttft["p0"] = 2.0
    # Predicted 0.2 with the correction 2: the raw model said 0.1; observed 0.3 is 3x that.
    controller.on_record(ok_record(attempt(ttft=0.2, tpot=None), ttft_s=0.3))
    assert ttft["p0"] == pytest.approx(0.8 * 2.0 + 0.2 * 3.0, rel=1e-12)
    assert tpot == {"p0": 1.0, "d0": 1.0}


def test_an_engine_without_a_correction_yet_starts_from_one() -> None:
    controller = make(fleet(p0(), d0()))
    ttft, tpot = corrections(controller)
    del ttft["p0"], tpot["d0"]
    controller.on_record(ok_record(attempt()))
    assert ttft["p0"] == pytest.approx(1.2, rel=1e-12)
    assert tpot["d0"] == pytest.approx(1.1, rel=1e-12)


def test_corrections_stay_within_their_bounds() -> None:
    controller = make(fleet(p0(), d0()))
    ttft, tpot = corrections(controller)
    for _ in range(40):
        controller.on_record(ok_record(attempt(ttft=0.1, tpot=0.02), ttft_s=100.0, tpot_s=1e-6))
    assert ttft["p0"] == 8.0
    assert tpot["d0"] == 0.25


@pytest.mark.parametrize(
    ("record", "ttft_p0", "tpot_d0"),
    [
        ({**ok_record(attempt()), "terminal_class": "error"}, 1.0, 1.0),  # a failed request
        (ok_record(attempt("error")), 1.0, 1.0),  # its only attempt failed
        (ok_record(attempt(), ttft_s=None), 1.0, 1.1),  # no TTFT observed
        (ok_record(attempt(), tpot_s=None), 1.2, 1.0),  # no TPOT observed (one output token)
        (ok_record(attempt(ttft=None, tpot=0.0)), 1.0, 1.0),  # not priced
        (ok_record(attempt(ttft=0.0, tpot=None)), 1.0, 1.0),
        ({"terminal_class": "ok", "ttft_s": 0.2, "tpot_s": 0.03}, 1.0, 1.0),  # no attempts
        ({**ok_record(), "attempts": None}, 1.0, 1.0),
    ],
)
def test_only_observed_and_predicted_latencies_of_successes_correct(
    record: dict[str, Any], ttft_p0: float, tpot_d0: float
) -> None:
    controller = make(fleet(p0(), d0()))
    controller.on_record(record)
    ttft, tpot = corrections(controller)
    assert ttft == pytest.approx({"p0": ttft_p0, "d0": 1.0}, rel=1e-12)
    assert tpot == pytest.approx({"p0": 1.0, "d0": tpot_d0}, rel=1e-12)


# ------------------------------------------------------------------ demand


def test_demand_is_the_window_s_arrivals_rate_and_mean_lengths() -> None:
    clock = Clock()
    controller = make(fleet(p0(), d0(), interval_s=2.0), clock=clock)  # a 6 s window
    assert controller.demand() == (0.0, 0.0, 0.0)
    clock.now = 100.0
    controller.on_record({"prompt_tokens": 100, "requested_output_len": 10, "terminal_class": "error"})
    clock.now = 104.0
    controller.on_record({"prompt_tokens": 300, "requested_output_len": 30})
    # Records without both lengths are no arrivals.
    controller.on_record({"prompt_tokens": 500, "requested_output_len": None})
    controller.on_record({"prompt_tokens": None, "requested_output_len": 50})
    clock.now = 106.0  # the first arrival is exactly one window old: still in it
    assert controller.demand() == pytest.approx((2 / 6, 200.0, 20.0), rel=1e-12)
    clock.now = 106.5  # now it is out; the span is the 2.5 s since the one left
    assert controller.demand() == pytest.approx((1 / 2.5, 300.0, 30.0), rel=1e-12)
    clock.now = 105.0  # (dropped for good) a span shorter than the interval counts as one interval
    assert controller.demand() == pytest.approx((1 / 2.0, 300.0, 30.0), rel=1e-12)
    clock.now = 110.5
    assert controller.demand() == (0.0, 0.0, 0.0)


def test_a_window_given_replaces_three_intervals() -> None:
    clock = Clock()
    controller = make(fleet(p0(), d0(), interval_s=2.0), clock=clock, window_s=1.0)
    arrive(controller, clock, [100.0], 100, 10)
    clock.now = 101.0
    assert controller.demand() == pytest.approx((0.5, 100.0, 10.0))
    clock.now = 101.5
    assert controller.demand() == (0.0, 0.0, 0.0)


# ------------------------------------------------------------------ the model


def test_prefill_is_one_md1_queue_over_the_pooled_producers() -> None:
    profiles = {"p0": profile("p0", decode=None), "x": profile("x", prefill={"a": 0.04, "b": 4e-4, "c": 0.0}),
                "d0": profile("d0")}  # fmt: skip
    controller = make(fleet(p0(), d0(), dual("x", 8103)), profiles)
    # 400 tokens: p0 0.1 s, x 0.2 s: 15 prefills/s together, a mean service of 2/15 s;
    # 5/s loads them to 1/3, and M/D/1 waits service * rho / (2 (1 - rho)).
    got = controller.predict(["p0", "x"], ["d0"], 5.0, 400.0, 10.0)
    assert got["ttft_s"] == pytest.approx(2 / 15 * (1 + (1 / 3) / (2 * (2 / 3))), rel=1e-9)
    # A correction scales its producer's service time: x at 0.4 s, 12.5/s together.
    controller.placement.ttft_correction["x"] = 2.0
    got = controller.predict(["p0", "x"], ["d0"], 5.0, 400.0, 10.0)
    assert got["ttft_s"] == pytest.approx(2 / 12.5 * (1 + 0.4 / (2 * 0.6)), rel=1e-9)
    # An engine without a correction counts as uncorrected; one without a profile is no producer.
    del controller.placement.ttft_correction["x"]
    got = controller.predict(["p0", "x", "unknown"], ["d0"], 5.0, 400.0, 10.0)
    assert got["ttft_s"] == pytest.approx(2 / 15 * (1 + (1 / 3) / (2 * (2 / 3))), rel=1e-9)


def test_prefill_at_or_past_capacity_or_without_producers_never_finishes() -> None:
    controller = make(fleet(p0(), d0()))
    # 0.1 s a prefill: 10/s is all one producer does.
    assert controller.predict(["p0"], ["d0"], 10.0, 400.0, 10.0)["ttft_s"] == math.inf
    assert controller.predict(["p0"], ["d0"], 9.0, 400.0, 10.0)["ttft_s"] == pytest.approx(
        0.1 * (1 + 0.9 / (2 * 0.1)), rel=1e-9
    )
    assert controller.predict([], ["d0"], 1.0, 400.0, 10.0)["ttft_s"] == math.inf
    assert controller.predict(["nobody"], ["d0"], 1.0, 400.0, 10.0)["ttft_s"] == math.inf


def test_a_producer_predicted_instant_adds_no_capacity_and_no_wait() -> None:
    instant = {"a": 0.0, "b": 0.0, "c": 0.0}
    profiles = {"p0": profile("p0", decode=None), "z": profile("z", prefill=instant), "d0": profile("d0")}
    controller = make(fleet(p0(), d0(), dual("z", 8105)), profiles)
    # The instant one is left out of the pooled rate (1/0); the mean service halves.
    got = controller.predict(["p0", "z"], ["d0"], 5.0, 400.0, 10.0)
    assert got["ttft_s"] == pytest.approx(2 / 10 * (1 + 0.5 / (2 * 0.5)), rel=1e-9)
    # Only instant producers: no wait at all.
    assert controller.predict(["z"], ["d0"], 5.0, 400.0, 10.0)["ttft_s"] == 0.0


def test_decode_is_littles_law_solved_as_a_fixed_point_over_the_consumers() -> None:
    slow = {"c0": 0.007, "c1": 0.002, "c2": 2e-6}
    profiles = {"p0": profile("p0", decode=None), "d0": profile("d0"), "x": profile("x", decode=slow)}
    controller = make(fleet(p0(), d0(), dual("x", 8103)), profiles)
    # TPOT = mean c0 + (mean c1 + mean c2 * (prompt + output / 2)) * active, with
    # active = rate * output * TPOT / consumers: TPOT = c0 / (1 - k).
    k = (0.0015 + 1.5e-6 * (400 + 50 / 2)) * 5.0 * 50 / 2
    got = controller.predict(["p0"], ["d0", "x"], 5.0, 400.0, 50.0)
    assert got["tpot_s"] == pytest.approx(0.006 / (1 - k), rel=1e-7)
    # A correction scales its consumer's predictions.
    controller.placement.tpot_correction["x"] = 2.0
    k2 = (0.0025 + 2.5e-6 * 425) * 5.0 * 50 / 2
    got = controller.predict(["p0"], ["d0", "x"], 5.0, 400.0, 50.0)
    assert got["tpot_s"] == pytest.approx(0.0095 / (1 - k2), rel=1e-7)
    # Without one, uncorrected; prefill-only and unprofiled engines decode nothing.
    del controller.placement.tpot_correction["x"]
    got = controller.predict(["p0"], ["d0", "x", "p0", "unknown"], 5.0, 400.0, 50.0)
    assert got["tpot_s"] == pytest.approx(0.006 / (1 - k), rel=1e-7)


def test_without_consumers_decode_never_finishes() -> None:
    controller = make(fleet(p0(), d0()))
    assert controller.predict(["p0"], [], 1.0, 400.0, 10.0)["tpot_s"] == math.inf
    assert controller.predict(["p0"], ["p0"], 1.0, 400.0, 10.0)["tpot_s"] == math.inf


def test_pressure_is_the_worse_of_ttft_and_tpot_against_their_targets() -> None:
    controller = make(fleet(p0(), d0()))
    prefill_bound = controller.predict(["p0"], ["d0"], 9.0, 400.0, 2.0)
    assert prefill_bound["pressure"] == pytest.approx(prefill_bound["ttft_s"] / 0.5, rel=1e-12)
    assert prefill_bound["ttft_s"] / 0.5 > prefill_bound["tpot_s"] / 0.05
    decode_bound = controller.predict(["p0"], ["d0"], 1.0, 16.0, 500.0)
    assert decode_bound["pressure"] == pytest.approx(decode_bound["tpot_s"] / 0.05, rel=1e-12)
    assert decode_bound["tpot_s"] / 0.05 > decode_bound["ttft_s"] / 0.5


@pytest.mark.parametrize(("slo", "ttft_target", "tpot_target", "decode"), [
    ({"ttft_s": None, "tpot_s": 0.05}, 1.0, 0.05, DECODE),
    # A consumer slow enough that its TPOT against one second outweighs the TTFT once.
    ({"ttft_s": 0.5, "tpot_s": None}, 0.5, 1.0, {"c0": 0.3, "c1": 0.001, "c2": 1e-6}),
])  # fmt: skip
def test_a_missing_target_counts_as_one_second(
    slo: dict[str, Any], ttft_target: float, tpot_target: float, decode: dict[str, float]
) -> None:
    profiles = {"p0": profile("p0", decode=None), "d0": profile("d0", decode=decode)}
    controller = make(fleet(p0(), d0(), slo=slo), profiles)
    ratios = []
    for rate, prompt, output in ((9.0, 400.0, 2.0), (1.0, 16.0, 500.0)):
        got = controller.predict(["p0"], ["d0"], rate, prompt, output)
        ratios.append((got["ttft_s"] / ttft_target, got["tpot_s"] / tpot_target))
        assert got["pressure"] == pytest.approx(max(ratios[-1]))
    assert ratios[0][0] > ratios[0][1] and ratios[1][1] > ratios[1][0]  # each side outweighs once


# ------------------------------------------------------------------ fleet changes


def test_a_reloaded_document_sets_the_margin_interval_and_slo() -> None:
    controller = make(fleet(p0(), d0()))
    new = fleet(p0(), d0(), margin=0.3, interval_s=5.0, slo={"ttft_s": 2.0, "tpot_s": 0.1})
    controller.reconfigure(new)
    assert controller.margin == 0.3 and controller.interval_s == 5.0
    assert controller.slo.ttft_s == 2.0 and controller.slo.tpot_s == 0.1


def test_a_reloaded_interval_moves_the_demand_window_with_it() -> None:
    clock = Clock()
    controller = make(fleet(p0(), d0(), interval_s=2.0), clock=clock)
    controller.reconfigure(fleet(p0(), d0(), interval_s=10.0))
    assert controller.window_s == 30.0
    # One arrival a second for 30 s: the rate is one a second (a window left at three
    # old intervals, 6 s, held 7 arrivals and spread them over one new interval).
    arrive(controller, clock, [100.0 + i for i in range(31)], 100, 10)
    assert controller.demand() == pytest.approx((31 / 30, 100.0, 10.0))
    # A window given stays as it is.
    given = make(fleet(p0(), d0(), interval_s=2.0), window_s=1.5)
    given.reconfigure(fleet(p0(), d0(), interval_s=10.0))
    assert given.window_s == 1.5


def members(*engines: dict[str, Any]) -> list[EngineConfig]:
    return list(fleet(*engines).engines)


def test_a_changed_fleet_keeps_the_roles_of_engines_that_stay() -> None:
    controller = make(fleet(p0(), d0(), dual("x", 8103, "decode"), dual("y", 8104, "decode")))
    controller.role["x"] = "prefill"
    got = controller.assign(members(dual("z", 8105, "decode"), p0(), dual("x", 8103, "decode"), d0()))
    assert controller.dual == ["z", "x"]
    assert controller.role == {"z": "decode", "x": "prefill"}  # y left; z starts in its first role
    assert got == (["p0", "x"], ["z", "d0"])


# ------------------------------------------------------------------ deciding


def prefill_heavy(controller: ReactiveController, clock: Clock) -> None:
    """Five 800-token prompts a second for 4 s, two output tokens each."""
    arrive(controller, clock, [100.0 + i / 5 for i in range(21)], 800, 2)


def test_no_decision_without_demand_dual_engines_or_with_several_models() -> None:
    clock = Clock()
    published: list[dict[str, Any]] = []
    idle = make(fleet(p0(), d0(), dual("x", 8103)), clock=clock, publish=published.append)
    assert idle.step() is None
    fixed = make(fleet(p0(), d0()), clock=clock, publish=published.append)
    prefill_heavy(fixed, clock)
    assert fixed.step() is None
    several = make(fleet(p0(), d0(), dual("x", 8103)), clock=clock, publish=published.append,
                   models={"p0": ["a"], "d0": ["b"], "x": ["a"]})  # fmt: skip
    prefill_heavy(several, clock)
    assert several.step() is None
    one = make(fleet(p0(), d0(), dual("x", 8103)), clock=clock, publish=published.append,
               models={"p0": ["a"], "d0": ["a"], "x": ["a"]})  # fmt: skip
    prefill_heavy(one, clock)
    assert one.step() is not None
    assert idle.decisions == fixed.decisions == several.decisions == []
    assert published == one.decisions


def test_a_move_past_the_margin_is_made_and_recorded_with_its_evidence(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    published: list[dict[str, Any]] = []
    controller = make(fleet(p0(), d0(), dual("x", 8103)), clock=clock, publish=published.append)
    controller.placement.ttft_correction["p0"] = 1.1
    controller.placement.tpot_correction["d0"] = 0.9
    prefill_heavy(controller, clock)
    clock.now = 104.5
    rate, prompt, output = controller.demand()
    current = controller.predict(["p0"], ["d0", "x"], rate, prompt, output)
    proposed = controller.predict(["p0", "x"], ["d0"], rate, prompt, output)
    gain = (current["pressure"] - proposed["pressure"]) / current["pressure"]
    assert gain > 0.10
    with caplog.at_level(logging.INFO, logger="narwhal.router.controller"):
        decision = controller.step()
    assert decision == {
        "type": "controller", "at": 104.5, "engine": "x", "from": "decode", "to": "prefill",
        "moved": True, "gain": gain, "margin": 0.10,
        "evidence": {
            "rate_per_s": rate, "mean_prompt_tokens": 800.0, "mean_output_tokens": 2.0,
            "current": current, "proposed": proposed,
            "ttft_correction": {"p0": 1.1, "d0": 1.0, "x": 1.0},
            "tpot_correction": {"p0": 1.0, "d0": 0.9, "x": 1.0},
        },
    }  # fmt: skip
    assert controller.role == {"x": "prefill"}
    assert controller.placement.prefill_engines == ["p0", "x"] and controller.placement.decode_engines == ["d0"]
    assert controller.decisions == [decision]
    assert published == [decision]
    # The evidence is the tables as they were, not the live ones.
    controller.placement.ttft_correction["p0"] = 3.0
    assert decision["evidence"]["ttft_correction"]["p0"] == 1.1
    assert [r.getMessage() for r in caplog.records] == [
        f"moved x to prefill (predicted gain {gain * 100:.1f}% > margin 10.0%)"
    ]


def test_a_gain_not_above_the_margin_moves_nothing(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    controller = make(fleet(p0(), d0(), dual("x", 8103)), clock=clock)
    prefill_heavy(controller, clock)
    controller.margin = 1e9
    first = controller.step()
    assert first is not None and first["moved"] is False
    controller.margin = first["gain"]  # equal: not above it
    with caplog.at_level(logging.INFO, logger="narwhal.router.controller"):
        second = controller.step()
    assert second is not None and second["moved"] is False and second["gain"] == first["gain"]
    assert second["engine"] == "x" and second["from"] == "decode" and second["to"] == "prefill"
    assert controller.role == {"x": "decode"}
    assert controller.placement.prefill_engines == ["p0"] and controller.placement.decode_engines == ["d0", "x"]
    assert caplog.records == []
    assert controller.decisions == [first, second]


def test_a_dual_engine_in_prefill_moves_to_decode_when_decode_is_the_bottleneck() -> None:
    clock = Clock()
    controller = make(fleet(p0(), d0(), dual("x", 8103, "prefill")), clock=clock)
    # Short prompts, long outputs: one consumer carries every stream.
    arrive(controller, clock, [100.0 + i / 4 for i in range(17)], 20, 400)
    decision = controller.step()
    assert decision is not None
    assert (decision["engine"], decision["from"], decision["to"], decision["moved"]) == ("x", "prefill", "decode", True)
    assert controller.role == {"x": "decode"}
    assert controller.placement.prefill_engines == ["p0"] and controller.placement.decode_engines == ["d0", "x"]


def test_the_move_proposed_is_the_one_predicted_best_the_first_listed_among_equals() -> None:
    slow = {"a": 0.2, "b": 2e-3, "c": 0.0}
    clock = Clock()
    config = fleet(p0(), d0(), dual("s", 8105), dual("x", 8103), dual("y", 8104))
    profiles = {"p0": profile("p0", decode=None), "d0": profile("d0"), "s": profile("s", prefill=slow),
                "x": profile("x"), "y": profile("y")}  # fmt: skip
    controller = make(config, profiles, clock=clock)
    prefill_heavy(controller, clock)
    decision = controller.step()
    # s prefills ten times slower: moving it helps less than x or y, which tie.
    assert decision is not None and decision["engine"] == "x" and decision["to"] == "prefill"


def test_a_fleet_that_cannot_serve_moves_when_a_move_makes_it_serve() -> None:
    clock = Clock()
    # No producer in the current assignment: TTFT never ends; x as producer fixes it.
    controller = make(fleet(d0(), dual("x", 8103)), clock=clock)
    prefill_heavy(controller, clock)
    decision = controller.step()
    assert decision is not None
    assert decision["moved"] is True and decision["gain"] == 1.0
    assert decision["evidence"]["current"]["ttft_s"] is None and decision["evidence"]["current"]["pressure"] is None
    assert decision["evidence"]["proposed"]["pressure"] is not None
    assert controller.role == {"x": "prefill"}


def test_no_move_when_every_assignment_cannot_serve() -> None:
    clock = Clock()
    controller = make(fleet(dual("x", 8103)), clock=clock)
    prefill_heavy(controller, clock)
    decision = controller.step()
    assert decision is not None
    assert decision["moved"] is False and decision["gain"] == 0.0
    assert decision["evidence"]["current"] == {"ttft_s": None, "tpot_s": decision["evidence"]["current"]["tpot_s"],
                                               "pressure": None}  # fmt: skip
    assert decision["evidence"]["proposed"]["tpot_s"] is None
    assert controller.role == {"x": "decode"}


def test_the_last_thousand_decisions_are_kept() -> None:
    clock = Clock()
    controller = make(fleet(p0(), d0(), dual("x", 8103), margin=1e9), clock=clock)
    prefill_heavy(controller, clock)
    made = [controller.step() for _ in range(1001)]
    assert len(controller.decisions) == 1000
    assert controller.decisions[0] is made[1] and controller.decisions[-1] is made[-1]


# ------------------------------------------------------------------ the decision loop


async def test_each_interval_decides_and_appends_the_decision_to_its_file(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(p0(), d0(), dual("x", 8103), margin=1e9, interval_s=2.0)
    journal = tmp_path / "new" / "dir" / "run.jsonl"
    three = trio.Event()

    def publish(decision: dict[str, Any]) -> None:
        if len(controller.decisions) == 3:
            three.set()

    controller = make(config, clock=trio.current_time, journal_path=journal, window_s=1000.0, publish=publish)
    path = tmp_path / "new" / "dir" / "run.controller.jsonl"
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        await nursery.start(controller.run)
        await trio.sleep(1.0)
        for _ in range(8):
            controller.on_record({"prompt_tokens": 800, "requested_output_len": 2})
        await trio.sleep(0.9)
        assert controller.decisions == []  # the first decision is one interval in
        await trio.sleep(0.2)
        assert [d["at"] - start for d in controller.decisions] == [2.0]
        await three.wait()  # (the file is written in a thread: virtual time runs on meanwhile)
        nursery.cancel_scope.cancel()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == controller.decisions


async def test_no_demand_writes_no_decision(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    controller = make(fleet(p0(), d0(), dual("x", 8103)), clock=trio.current_time,
                      journal_path=tmp_path / "run.jsonl")  # fmt: skip
    async with trio.open_nursery() as nursery:
        await nursery.start(controller.run)
        await trio.sleep(5.0)
        nursery.cancel_scope.cancel()
    assert controller.decisions == []
    assert os.listdir(tmp_path) == []


async def test_without_a_journal_file_decisions_are_only_kept(autojump_clock: trio.abc.Clock) -> None:
    controller = make(fleet(p0(), d0(), dual("x", 8103)), clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        await nursery.start(controller.run)
        for _ in range(8):
            controller.on_record({"prompt_tokens": 800, "requested_output_len": 2})
        await trio.sleep(2.5)
        nursery.cancel_scope.cancel()
    assert len(controller.decisions) == 1
