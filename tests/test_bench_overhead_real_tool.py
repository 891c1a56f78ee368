"""``tools/bench_overhead_real.py``'s arithmetic: figures paired by round, per-token CPU,
the issue's targets. (The measurement itself needs the real pair: docs/benchmarks.md.)"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from .toolkit import load_tool


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return load_tool("bench_overhead_real.py")


def block(cpu: float | None, ttft: float, tpot: float, n: int = 10) -> dict[str, Any]:
    return {"requests": n, "errors": 0, "cpu_ms_per_request": cpu, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot,
            "kv_external": 400.0 * n, "kv_local_compute": 0.0, "kv_transfers": float(n)}  # fmt: skip


def test_added_latency_is_paired_round_by_round(tool: ModuleType) -> None:
    # The machine slows down in round 2: every target's TTFT rises; the paired difference does not.
    blocks = {
        "narwhal": [block(5.0, 21.0, 2.1), block(6.0, 41.0, 2.3), block(5.5, 22.0, 2.2)],
        "vllm-router-rr": [block(1.0, 20.5, 2.0), block(1.2, 40.5, 2.1), block(1.1, 21.5, 2.0)],
        "direct": [block(None, 20.0, 2.0), block(None, 40.0, 2.0), block(None, 21.0, 2.0)],
    }
    level = tool.summarize_level(blocks, 1, 32)
    assert level["narwhal"]["added_ttft_p50_ms"] == pytest.approx(1.0)
    assert level["narwhal"]["added_tpot_p50_ms"] == pytest.approx(0.2)
    assert level["vllm-router-rr"]["added_ttft_p50_ms"] == pytest.approx(0.5)
    assert level["narwhal"]["cpu_ms_per_request"] == 5.5 and level["narwhal"]["cpu_ms_per_request_range"] == [5.0, 6.0]
    assert level["vllm-router-rr"]["cpu_vs_first_paired"] == pytest.approx(1.1 / 5.5)
    assert level["direct"]["cpu_ms_per_request"] is None
    assert level["narwhal"]["kv_external_per_request"] == 400.0 and level["narwhal"]["kv_transfers_per_request"] == 1.0


def test_per_token_cpu_and_the_targets(tool: ModuleType) -> None:
    short = tool.summarize_level({"narwhal": [block(4.0, 21.0, 2.0)], "vllm-router-rr": [block(1.0, 20.0, 2.0)],
                                  "direct": [block(None, 20.0, 2.0)]}, 1, 32)  # fmt: skip
    long = tool.summarize_level({"narwhal": [block(26.4, 22.0, 2.0)], "vllm-router-rr": [block(8.0, 20.0, 2.0)],
                                 "direct": [block(None, 20.0, 2.0)]}, 1, 256)  # fmt: skip
    per_token = tool.per_token_us([short, long], 32, 256, 1)
    assert per_token["narwhal"] == pytest.approx(100.0) and per_token["vllm-router-rr"] == pytest.approx(31.25)
    checks = {c["target"].split(":")[1].split("(")[0].strip(): c
              for c in tool.verdicts([short], per_token, {"narwhal": 0.05}, ["narwhal"])}  # fmt: skip
    cpu = checks["router CPU/request at c=1, 32 tokens <= 1.5x vllm-router round_robin's"]
    assert cpu["value"] == pytest.approx(4.0) and not cpu["met"]
    ttft = checks["added TTFT p50 at c=1, 32 tokens <= vllm-router's + 1 ms"]
    assert ttft["value"] == pytest.approx(1.0) and ttft["met"]
    assert not checks["per-token relay CPU <= vllm-router's"]["met"]
    assert checks["idle CPU <= 0.1 ms per second per engine"]["met"]
