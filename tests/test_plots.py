"""Plots are written and non-empty (needs matplotlib: the [plot] extra)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from narwhal.plots import plot_bench, plot_profile

PNG = b"\x89PNG\r\n\x1a\n"


def test_profile_plots(tmp_path: Path) -> None:
    samples = {
        "engines": {
            "e0": {
                "prefill": {
                    "repeats": [{"length": n, "ttft_s": 0.01 + n * 1e-5} for n in (100, 100, 500, 500, 900)],
                    "medians": [{"length": n, "ttft_s": 0.01 + n * 1e-5} for n in (100, 500, 900)],
                    "fit": {"model": "a + b*L + c*L^2", "coefficients": {"a": 0.01, "b": 1e-5, "c": 0.0}},
                },
                "decode": {
                    "cell_medians": [
                        {"input_len": i, "concurrency": c, "active": c, "kv_tokens": c * i, "tpot_s": 0.004 + 2e-4 * c}
                        for i in (128, 512) for c in (1, 4, 8)
                    ],
                    "fit": {"coefficients": {"c0": 0.004, "c1": 2e-4, "c2": 0.0}},
                },
            }
        }
    }  # fmt: skip
    path = tmp_path / "profiles.samples.json"
    path.write_text(json.dumps(samples))
    written = plot_profile(path, tmp_path / "plots")
    assert [p.name for p in written] == ["e0.ttft.png", "e0.decode.png"]
    for p in written:
        assert p.read_bytes().startswith(PNG) and p.stat().st_size > 5000


def test_bench_plots(tmp_path: Path) -> None:
    rows = [{"scored": True, "terminal_class": "ok", "ttft_s": 0.1 + i / 1000, "tpot_s": 0.01 + i / 10000}
            for i in range(50)] + [{"scored": True, "terminal_class": "http_503", "ttft_s": None, "tpot_s": None}]  # fmt: skip
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    written = plot_bench(tmp_path, slo_ttft_s=0.12, slo_tpot_s=0.02)
    assert {p.name for p in written} == {"ttft-cdf.png", "tpot-cdf.png"}
    for p in written:
        assert p.read_bytes().startswith(PNG) and p.stat().st_size > 5000
