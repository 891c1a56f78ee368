"""Plots are written and non-empty (needs matplotlib: the [plot] extra); what the
cached-prefix plot draws is checked without it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from narwhal.plots import cached_prefill_series, plot_bench, plot_profile
from narwhal.profile.fit import cached_prefill_s

PNG = b"\x89PNG\r\n\x1a\n"
CACHED = {"a": 0.01, "b": 1e-4, "c": 1e-8, "d": 2e-6}


@pytest.fixture
def matplotlib() -> Any:
    return pytest.importorskip("matplotlib")


def prefix_engine() -> dict[str, Any]:
    """A sidecar entry with a cached-prefix sweep over L = 512 and 1024 (k = 0.25 L and 0.5 L)."""
    cells = [(512, 128), (512, 256), (1024, 256), (1024, 512)]
    return {
        "prefill": {"repeats": [{"length": n, "ttft_s": cached_prefill_s(**CACHED, length=n, cached=0)}
                                for n in (128, 512, 512, 1024)]},
        "prefix": {
            "block_size": 16,
            "repeats": [{"length": n, "cached": k, "ttft_s": cached_prefill_s(**CACHED, length=n, cached=k) + r * 1e-4,
                         "reported_cached": k} for n, k in cells for r in range(3)],
            "fit": {"model": "a + b*(L-k) + c*(L^2-k^2) + d*k", "coefficients": CACHED},
        },
    }  # fmt: skip


def test_the_cached_prefix_plot_draws_every_repeat_and_the_fit_per_prompt_length() -> None:
    series = cached_prefill_series(prefix_engine())
    assert [s.length for s in series] == [512, 1024]
    short = series[0]
    # the plain sweep's repeats at L = 512 are its k = 0 samples; L = 128 has no series
    assert [k for k, _ in short.samples] == [0, 0, 128, 128, 128, 256, 256, 256]
    assert short.samples[2][1] == pytest.approx(cached_prefill_s(**CACHED, length=512, cached=128))
    # the fitted curve: k over 0..L-1, the model's values
    assert short.fitted[0] == (0, pytest.approx(cached_prefill_s(**CACHED, length=512, cached=0)))
    assert short.fitted[-1][0] == 511
    assert all(t == pytest.approx(cached_prefill_s(**CACHED, length=512, cached=k)) for k, t in short.fitted)
    assert [k for k, _ in series[1].samples] == [0, 256, 256, 256, 512, 512, 512]


def test_the_cached_prefix_plot_without_a_fit_or_a_sweep() -> None:
    engine = prefix_engine()
    del engine["prefix"]["fit"]  # the fit was impossible: the samples alone
    series = cached_prefill_series(engine)
    assert [len(s.samples) for s in series] == [8, 7] and all(not s.fitted for s in series)
    assert cached_prefill_series({"prefill": engine["prefill"], "prefix": {"skipped": "no --prefix-fractions"}}) == []
    assert cached_prefill_series({}) == []


def test_profile_writes_the_cached_prefix_plot(tmp_path: Path, matplotlib: Any) -> None:
    path = tmp_path / "profiles.samples.json"
    path.write_text(json.dumps({"engines": {"e0": prefix_engine(), "e1": {"prefill": prefix_engine()["prefill"]}}}))
    written = plot_profile(path, tmp_path / "plots")
    assert [p.name for p in written] == ["e0.ttft.png", "e0.prefix.png", "e1.ttft.png"]
    assert written[1].read_bytes().startswith(PNG) and written[1].stat().st_size > 5000


def test_profile_plots(tmp_path: Path, matplotlib: Any) -> None:
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


def test_bench_plots(tmp_path: Path, matplotlib: Any) -> None:
    rows = [{"scored": True, "terminal_class": "ok", "ttft_s": 0.1 + i / 1000, "tpot_s": 0.01 + i / 10000}
            for i in range(50)] + [{"scored": True, "terminal_class": "http_503", "ttft_s": None, "tpot_s": None}]  # fmt: skip
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    written = plot_bench(tmp_path, slo_ttft_s=0.12, slo_tpot_s=0.02)
    assert {p.name for p in written} == {"ttft-cdf.png", "tpot-cdf.png"}
    for p in written:
        assert p.read_bytes().startswith(PNG) and p.stat().st_size > 5000
