"""Reactive control: corrections from observations; role moves only past the margin."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from .routerkit import engine, fleet_doc, open_stack

SLO = {"ttft_s": 0.5, "tpot_s": 0.05}


def dual_fleet(margin: float) -> dict[str, Any]:
    return fleet_doc(
        engine("p0", 8101, ["prefill"], prefill={"a": 0.02, "b": 2e-4}),
        engine("d0", 8102, ["decode"], decode={"c0": 0.005, "c1": 0.001, "c2": 0.0}),
        # x permits both roles and starts decoding (its first listed role).
        engine("x", 8103, ["decode", "prefill"], prefill={"a": 0.02, "b": 2e-4},
               decode={"c0": 0.005, "c1": 0.001, "c2": 0.0}),
        controller={"slo": SLO, "admission": "refuse",
                    "reactive": {"enabled": True, "movement_margin": margin, "interval_s": 2.0}},
        server={"max_concurrent_requests": 10000},
    )  # fmt: skip


async def _load(stack: Any, *, rate: float, seconds: float, prompt_words: int, output: int) -> None:
    async with trio.open_nursery() as nursery:
        for i in range(int(rate * seconds)):
            prompt = " ".join(f"q{i}w{j}" for j in range(prompt_words))
            nursery.start_soon(stack.complete, {"prompt": prompt, "max_tokens": output})
            await trio.sleep(1 / rate)


async def test_moves_a_dual_role_engine_when_load_turns_prefill_heavy(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(dual_fleet(0.10), priced=True) as stack:
        controller = stack.router.controller
        assert controller is not None
        placement = stack.router.state.placement
        assert placement.prefill_engines == ["p0"] and placement.decode_engines == ["d0", "x"]
        # Decode-heavy: short prompts, long outputs. x stays a consumer.
        await _load(stack, rate=4.0, seconds=6.0, prompt_words=20, output=100)
        assert controller.role["x"] == "decode"
        assert all(not d["moved"] for d in controller.decisions)
        # Prefill-heavy: long prompts (0.02 + 2e-4 * 800 = 0.18 s each: one producer at
        # 5/s is 90% busy), one output token. The controller moves x to prefill once
        # its window holds mostly long prompts: about 5 s in, so the phase lasts 10 s
        # (at 6 s the move came at the phase's very end or just after it).
        await _load(stack, rate=5.0, seconds=10.0, prompt_words=800, output=2)
        assert controller.role["x"] == "prefill"
        assert placement.prefill_engines == ["p0", "x"] and placement.decode_engines == ["d0"]
    moves = [d for d in controller.decisions if d["moved"]]
    assert len(moves) == 1  # one move, no flapping
    move = moves[0]
    assert move["engine"] == "x" and move["from"] == "decode" and move["to"] == "prefill"
    assert move["gain"] > move["margin"]
    evidence = move["evidence"]
    assert evidence["mean_prompt_tokens"] > 300  # the window saw the long prompts
    assert evidence["proposed"]["pressure"] < evidence["current"]["pressure"] or evidence["current"]["pressure"] is None


async def test_does_not_move_when_the_gain_is_below_the_margin(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(dual_fleet(50.0), priced=True) as stack:
        controller = stack.router.controller
        assert controller is not None
        await _load(stack, rate=2.0, seconds=6.0, prompt_words=800, output=2)
        assert controller.role["x"] == "decode"
    assert controller.decisions
    assert all(not d["moved"] for d in controller.decisions)
    assert any(0 < d["gain"] < d["margin"] for d in controller.decisions)


async def test_corrections_follow_observed_latency(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(dual_fleet(0.10), priced=True) as stack:
        placement = stack.router.state.placement
        # The profile says p0 prefills 100 tokens in 40 ms; make every prefill 50 ms slower.
        from narwhal.config import FaultSpec

        stack.engine("p0").inject(FaultSpec(kind="delay_headers", on="prefill", delay_s=0.05))
        for i in range(20):
            await stack.complete({"prompt": " ".join(f"c{i}w{j}" for j in range(100)), "max_tokens": 2})
        assert placement.ttft_correction["p0"] > 1.5  # type: ignore[attr-defined]


async def test_decisions_go_beside_the_journal_in_use_not_into_the_working_directory(
    autojump_clock: trio.abc.Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    async with open_stack(dual_fleet(0.10), priced=True) as stack:  # a journal without a file
        controller = stack.router.controller
        assert controller is not None and controller.decisions_path is None
        await _load(stack, rate=4.0, seconds=5.0, prompt_words=20, output=20)
        assert controller.decisions
    assert os.listdir(tmp_path) == []
