"""tools/cachebench.py: the cache plan's benchmark helpers (the multi-turn trace, the
best hits a partition allows, the fleet's ceiling from its latency model, the shares)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location("cachebench", TOOLS / "cachebench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_multi_turn_trace_repeats_each_conversation_and_keeps_it_short(tool: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    turns = tool.multi_turn_trace(path, rate=8.0, n=400, seed=1, tag="x")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(turns) == len(lines) == 400
    assert [t[0] for t in turns] == [line["prompt"] for line in lines]
    offsets = [line["offset_s"] for line in lines]
    assert offsets == sorted(offsets) and 400 / offsets[-1] == pytest.approx(8.0, rel=0.25)
    by: dict[int, list[str]] = {}
    for prompt, sid, _, out in turns:
        by.setdefault(sid, []).append(prompt)
        assert 20 <= out <= 60 and len(prompt.split()) <= 3000
    assert len({sid % 4 for sid in by}) == 4  # four system prompts
    for prompts in by.values():  # each turn repeats the one before it whole
        for a, b in itertools.pairwise(prompts):
            assert b.startswith(a) and len(b) > len(a)
    # 32 conversations at once: their turns interleave
    assert len({sid for _, sid, _, _ in turns[:64]}) >= 24


def test_the_ceiling_is_the_smaller_of_the_prefill_and_the_decode_rates(tool: ModuleType) -> None:
    fleet = {"p": ("prefill", {"a": 0.01, "b": 1e-4, "c": 0.0}, {}),
             "d": ("decode", {}, {"c0": 0.01, "c1": 0.001, "c2": 0.0})}  # fmt: skip
    head = " ".join(f"h{j}" for j in range(96))
    requests = [(f"{head} " + " ".join(f"r{i}w{j}" for j in range(4)), 0) for i in range(3)]
    assert tool.best_hits(requests, 16) == [0, 96, 96]
    c = tool.ceiling(fleet, requests, [10, 10, 10], block=16, capacity=100000, tpot_s=0.05)
    mean_prefill = (0.01 + 1e-4 * 100 + 2 * (0.01 + 1e-4 * 4)) / 3
    assert c["prefill_rps"] == pytest.approx(1 / mean_prefill)
    # 40 streams step in 50 ms, the target (41 would take 51): 40 streams of 10 tokens.
    assert c["decode_rps"] == pytest.approx(40 / (10 * 0.050))
    assert c["ceiling_rps"] == min(c["prefill_rps"], c["decode_rps"])
    assert c["best_hit_rate"] == pytest.approx(192 / 300)
    # A cache that holds 2 streams bounds the decode side.
    small = tool.ceiling(fleet, requests, [10, 10, 10], block=16, capacity=220, tpot_s=0.05)
    assert small["decode_rps"] == pytest.approx(2 / (10 * 0.012))


def test_shares_are_of_the_requests_finished_between_two_counts(tool: ModuleType) -> None:
    assert tool.shares({"a": 10.0, "b": 5.0}, {"a": 40.0, "b": 15.0}) == {"a": 0.75, "b": 0.25}
    assert tool.shares({}, {"a": 0.0}) == {"a": 0.0}


def test_the_issue_fleet_is_two_producers_at_speeds_1_and_half_and_two_consumers_at_1_and_0_4(tool: ModuleType) -> None:
    fleet = tool.ISSUE_FLEET
    fast, slow = fleet["p-fast"][1], fleet["p-slow"][1]
    assert all(slow[k] == pytest.approx(2 * fast[k]) for k in fast)
    fast_d, slow_d = fleet["d-fast"][2], fleet["d-slow"][2]
    assert all(slow_d[k] == pytest.approx(2.5 * fast_d[k]) for k in fast_d)
    assert tool.prefill_s(fast, 1174) == pytest.approx(0.198, abs=0.001)
    assert tool.prefill_s(fast, 1174, 1024) == pytest.approx(0.043, abs=0.001)
    assert tool.CAPACITY == {"shared-prefix": 16384, "multi-turn": 65536}


def test_one_run_prints_its_row_and_a_point_is_the_mean_of_its_seeds(
    tool: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    # --run-one is what --baseline runs in another tree's interpreter: one run in
    # virtual time, its row as the last line of its output.
    assert tool.main(["--run-one", json.dumps(["shared-prefix", False, "auto", 4.0, 24, 0.0, 0])]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["attainment"] == 1.0 and row["refused"] == 0
    assert set(row["shares"]) == {"p-fast", "p-slow"} and sum(row["shares"].values()) == pytest.approx(1.0)
    assert row["ceiling_rps"] == pytest.approx(min(row["prefill_rps"], row["decode_rps"]))
    runs = [{**row, "attainment": a, "hit_rate": h, "shares": {"p-fast": s, "p-slow": 1 - s}}
            for a, h, s in ((0.8, 0.5, 0.6), (1.0, 0.7, 0.8))]  # fmt: skip
    mean = tool._mean(runs)
    assert mean["attainment"] == pytest.approx(0.9) and mean["hit_rate"] == pytest.approx(0.6)
    assert mean["shares"] == pytest.approx({"p-fast": 0.7, "p-slow": 0.3})


def test_the_short_form_checks_attainment_hits_the_plan_against_none_and_the_slow_producer_s_share(
    tool: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    def point(attainment: float, hit: float, slow: float) -> dict[str, Any]:
        return {"rate": 20.0, "attainment": attainment, "hit_rate": hit, "best_hit_rate": 0.8,
                "shares": {"p-fast": 1 - slow, "p-slow": slow}}  # fmt: skip

    assert tool._checks("multi-turn", [point(0.95, 0.75, 0.3)], [point(0.96, 0.75, 0.1)])
    assert "NOT met" not in capsys.readouterr().out
    assert not tool._checks("multi-turn", [point(0.95, 0.75, 0.1)], [point(0.95, 0.75, 0.1)])  # sessions piled up
    assert "[NOT met] the slow producer takes >= 20% of the prefills at 20/s: 0.10" in capsys.readouterr().out
    assert tool._checks("shared-prefix", [point(0.95, 0.75, 0.1)], [point(0.95, 0.75, 0.1)])  # no share asked
    assert not tool._checks("shared-prefix", [point(0.89, 0.75, 0.3)], [point(0.85, 0.75, 0.3)])
    assert not tool._checks("shared-prefix", [point(0.95, 0.71, 0.3)], [point(0.95, 0.75, 0.3)])  # 0.71 < 0.72
    assert not tool._checks("shared-prefix", [point(0.92, 0.75, 0.3)], [point(0.95, 0.75, 0.3)])  # 3 points under
    capsys.readouterr()
