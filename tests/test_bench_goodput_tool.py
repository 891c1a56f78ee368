"""``tools/bench_goodput.py``'s steady-state scoring (``--warmup-s``): which requests are
warm-up, every request's attainment beside the scored ones', and goodput at 90%.

The script is loaded by its path (it imports ``proctools`` from ``tools/``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .toolkit import load_tool


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("bench_goodput.py")


def test_warmup_counts_the_requests_scheduled_before_the_cutoff(tool: ModuleType, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    tool.shared_prefix_trace(trace, rate=10.0, n=200, prefixes=4, prefix_len=32, zipf_s=1.1, seed=1, tag="x")
    offsets = [json.loads(line)["offset_s"] for line in trace.read_text().splitlines()]
    n = tool.warmup_count(trace, 5.0)
    assert 0 < n < 200
    assert all(o < 5.0 for o in offsets[:n]) and all(o >= 5.0 for o in offsets[n:])
    assert tool.warmup_count(trace, 0.0) == 0


def row(**fields: Any) -> dict[str, Any]:
    base = {"index": 0, "request_id": "r", "route": "completions", "warmup": False, "terminal_class": "ok",
            "ttft_s": 0.1, "tpot_s": 0.01, "output_len": 10, "scored": True}  # fmt: skip
    return {**base, **fields}


def test_every_request_is_scored_warmup_included_as_narwhal_bench_scores(tool: ModuleType, tmp_path: Path) -> None:
    rows = [
        row(warmup=True, terminal_class="refused", ttft_s=None, tpot_s=None, scored=False),
        row(warmup=True),
        row(warmup=True),
        row(ttft_s=0.6),  # late: a miss
        row(tpot_s=0.06),  # slow stream: a miss
        row(),
        row(tpot_s=None),  # one token: nothing to miss
        row(terminal_class="client_cancelled", ttft_s=None, tpot_s=None, scored=False),  # the bench stopped it
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    attainment, refused = tool.all_requests(tmp_path, {"ttft_ms": 500, "tpot_ms": 50})
    assert (attainment, refused) == (4 / 7, 1)  # the scored ones alone: 2 / 4


def test_goodput_at_90_takes_the_highest_rate_held(tool: ModuleType) -> None:
    points = [{"rate": 10.0, "attainment": 1.0, "all": 0.95}, {"rate": 20.0, "attainment": 0.95, "all": 0.85},
              {"rate": 30.0, "attainment": 0.5, "all": None}]  # fmt: skip
    assert tool.goodput_at_90(points) == pytest.approx(19.0)
    assert tool.goodput_at_90(points, "all") == pytest.approx(9.5)
    assert tool.goodput_at_90([{"rate": 5.0, "attainment": 0.8}]) == 0.0


def test_the_slow_prefix_fleet_matches_the_figures_it_is_derived_from(tool: ModuleType) -> None:
    names = list(tool.SLOW_PREFIX_FLEET)
    ports = {k: 9000 + i for i, k in enumerate([*names, *(n + "-kv" for n in names)])}
    engines = {e["name"]: e for e in tool.fleet(ports, caching=True, kind="slow")}
    assert engines.keys() == set(names) and all(e["sim"]["prefix_caching"] for e in engines.values())

    def cost(name: str, length: int, cached: int = 0) -> float:
        p = engines[name]["sim"]["prefill"]
        return float(p["a"] + p["b"] * (length - cached) + p["c"] * (length**2 - cached**2))

    # A cold 1,174-token prompt ~1.05 s on the fast producer, over the 0.5 s target on
    # every producer; with 1,024 tokens cached, 60 ms (50 of its own) to 150 ms (150).
    assert cost("p-fast", 1174) == pytest.approx(1.05, rel=0.01)
    assert min(cost(n, 1174) for n in ("p-fast", "p-slow")) > 0.5
    assert cost("p-fast", 1074, 1024) == pytest.approx(0.060, rel=0.02)
    assert cost("p-fast", 1174, 1024) == pytest.approx(0.150, rel=0.02)
    # The default fleet is unchanged.
    default = {e["name"]: e["sim"]["prefill"] for e in tool.fleet(ports, caching=True)}
    assert default == {n: p for n, (_, p) in tool.PREFIX_FLEET.items()}


def test_an_engine_whose_fit_was_rejected_is_profiled_again_alone(tool: ModuleType, tmp_path: Path) -> None:
    profiles = tmp_path / "profiles.json"
    calls: list[list[str]] = []
    # The first sweep writes p0 and d0 and rejects d1 for noise (exit 1); the second, of
    # d1 alone, merges it.
    written = [{"p0": {}, "d0": {}}, {"p0": {}, "d0": {}, "d1": {}}]

    def run(argv: list[str]) -> Any:
        calls.append(argv)
        profiles.write_text(json.dumps({"engines": written[len(calls) - 1]}))
        return tool.subprocess.CompletedProcess(argv, 1 if len(calls) == 1 else 0, "d1: rejected\n", "")

    assert tool.profile_fleet(["profile", "--out", str(profiles)], profiles, ["p0", "d0", "d1"], run) is None
    assert [argv[-2:] for argv in calls] == [[str(profiles), "--overwrite"], ["--engines", "d1"]]


def test_profiling_gives_up_after_its_attempts_and_says_why(tool: ModuleType, tmp_path: Path) -> None:
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"engines": {"p0": {}}}))
    calls: list[list[str]] = []

    def run(argv: list[str]) -> Any:
        calls.append(argv)
        return tool.subprocess.CompletedProcess(argv, 1, "d0: rejected: noisy samples\n", "")

    failure = tool.profile_fleet(["profile"], profiles, ["p0", "d0"], run)
    assert failure is not None and "d0: rejected: noisy samples" in failure
    assert len(calls) == tool.PROFILE_ATTEMPTS
    # A usage error (exit 2) is not retried.
    calls.clear()
    failure = tool.profile_fleet(["profile"], profiles, ["p0", "d0"],
                                 lambda argv: calls.append(argv) or tool.subprocess.CompletedProcess(argv, 2, "", "bad"))  # fmt: skip
    assert failure is not None and len(calls) == 1
