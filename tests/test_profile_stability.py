"""``profile --repeat N``: each run's paths, the figures compared across runs, their
summary statistics, the stability document and its lines, and the repeated sweep itself
(a short one on a simulated engine)."""

from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from narwhal.engines.client import EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile.progress import Progress
from narwhal.profile.stability import (
    STABILITY_KIND,
    engine_figures,
    profile_repeatedly,
    run_paths,
    stability,
    stability_lines,
)
from narwhal.profile.store import (
    CachedPrefill,
    DecodeAxis,
    DecodeDomain,
    DecodeModel,
    EngineProfile,
    KVCapacity,
    TTFTCurve,
    Uncertainty,
    load_profiles,
    pair_paths,
)
from narwhal.testing import open_sim_fleet
from tests import profilekit


def approx_each(expected: dict[str, Any]) -> dict[str, Any]:
    """Each value approximately (pytest.approx refuses a mapping of lists since 9.2)."""
    return {key: pytest.approx(value) for key, value in expected.items()}


def _profile(scale: float = 1.0, *, decode: bool = True, kv: bool = True, cached: bool = True,
             loo: float | None = 0.04) -> EngineProfile:  # fmt: skip
    """A profile whose every figure differs from every other (times ``scale``)."""
    s = scale
    band = Uncertainty(level=0.95, resamples=200, coefficients={}, upper_factor=1.1,
                       worst_half_width=0.1)  # fmt: skip
    return EngineProfile(
        name="e0",
        identity=EngineIdentity("http://e0.test:8101", "m", "0.32.0", 4096, 1000.0),
        ttft=TTFTCurve(a=0.02 * s, b=5e-5 * s, c=2e-8 * s, min_length=128, max_length=2048,
                       mean_error=0.011 * s, worst_error=0.03, loo_mean_error=loo and loo * s),
        decode=DecodeModel(c0=0.005 * s, c1=0.0008 * s, c2=2e-7 * s, fit_mape=0.012 * s,
                           cv_mape=0.021 * s, cells=4,
                           domain=DecodeDomain(active=DecodeAxis(min=1, max=4),
                                               kv_tokens=DecodeAxis(min=100, max=9000)))
        if decode else None,
        kv_capacity=KVCapacity(source="physical", tokens=int(50_000 * s), basis="engine")
        if kv else None,
        cached_prefill=CachedPrefill(a=0.021 * s, b=4e-5 * s, c=3e-8 * s, d=1e-5 * s, cells=12,
                                     min_length=128, max_length=2048, max_cached=1792,
                                     block_size=16, mean_error=0.013 * s, worst_error=0.05,
                                     loo_mean_error=0.017 * s, loo_worst_error=0.06,
                                     uncertainty=band)
        if cached else None,
    )  # fmt: skip


def test_each_run_has_its_own_pair_beside_the_first() -> None:
    assert run_paths("runs/p.json", 3) == [Path("runs/p.json"), Path("runs/p.run2.json"),
                                           Path("runs/p.run3.json")]  # fmt: skip
    assert run_paths("runs/p", 2) == [Path("runs/p"), Path("runs/p.run2.json")]
    assert run_paths("p.json", 1) == [Path("p.json")]


def test_the_figures_of_a_profile_are_its_coefficients_errors_and_predictions() -> None:
    p = _profile()
    t, d, m = p.ttft, p.decode, p.cached_prefill
    assert d is not None and m is not None
    figures = engine_figures(p, [20.0, 100.0, 1024.0], [(1.0, 100.0), (4.0, 8999.6)])
    assert list(figures.items()) == [
        ("ttft.a", t.a), ("ttft.b", t.b), ("ttft.c", t.c), ("ttft.mean_error", t.mean_error),
        ("ttft.loo_mean_error", 0.04),
        ("ttft_at.20", t.predict(20)), ("ttft_at.100", t.predict(100)),
        ("ttft_at.1024", t.predict(1024)),
        ("decode.c0", d.c0), ("decode.c1", d.c1), ("decode.c2", d.c2),
        ("decode.fit_mape", d.fit_mape), ("decode.cv_mape", d.cv_mape),
        ("tpot_at.1x100", d.predict(1, 100)), ("tpot_at.4x9000", d.predict(4, 8999.6)),
        ("kv_capacity.tokens", 50_000.0),
        ("prefix.a", m.a), ("prefix.b", m.b), ("prefix.c", m.c), ("prefix.d", m.d),
        ("prefix.mean_error", m.mean_error), ("prefix.loo_mean_error", m.loo_mean_error),
        # Half of each length cached in whole blocks of 16: none for 20 tokens (a block is
        # 16, half is 10), 48 of 100, 512 of 1024.
        ("prefix_at.100x48", m.predict(100, 48)), ("prefix_at.1024x512", m.predict(1024, 512)),
    ]  # fmt: skip
    assert type(figures["kv_capacity.tokens"]) is float
    # 31 tokens: half is 15, no whole block; 32 tokens: one block of 16; 63: one block.
    assert [k for k in engine_figures(p, [31.0, 32.0, 63.0], []) if k.startswith("prefix_at")] == [
        "prefix_at.32x16", "prefix_at.63x16"]
    # Blocks of one token: half of 3 is one cached token.
    ones = attrs.evolve(p, cached_prefill=attrs.evolve(m, block_size=1))
    assert [k for k in engine_figures(ones, [1.0, 3.0], []) if k.startswith("prefix_at")] == [
        "prefix_at.3x1"]
    bare = _profile(decode=False, kv=False, cached=False, loo=None)
    assert list(engine_figures(bare, [512.0], [(1.0, 100.0)])) == [
        "ttft.a", "ttft.b", "ttft.c", "ttft.mean_error", "ttft_at.512"]
    # A leave-one-length-out error of zero is a figure, not an absent one.
    assert engine_figures(_profile(loo=0.0), [], [])["ttft.loo_mean_error"] == 0.0


def test_runs_are_summarised_per_figure_over_the_runs_that_profiled_the_engine(
    tmp_path: Path,
) -> None:
    runs: list[dict[str, EngineProfile | None]] = [
        {"e0": _profile(1.0, loo=None), "e1": _profile(2.0)},
        {"e0": _profile(1.5), "e1": None},
        {"e0": _profile(2.5), "e1": _profile(3.0)},
    ]
    operating = {"e0": ([1024.0], [(4.0, 2000.0)])}  # e1: none recorded
    files = [tmp_path / "p.json", tmp_path / "p.run2.json", tmp_path / "p.run3.json"]
    out = str(tmp_path / "p.json")
    doc = stability(runs, operating, ["e1", "e0"], files, out)
    assert json.loads((tmp_path / "p.stability.json").read_text()) == doc
    assert doc["kind"] == STABILITY_KIND == "narwhal.profile-stability"
    assert doc["runs"] == ["p.json", "p.run2.json", "p.run3.json"]
    assert doc["statistic"] == (
        "cv = sample standard deviation / mean over the runs; spread = (max - min) / mean")
    assert list(doc["engines"]) == ["e1", "e0"]
    e0, e1 = doc["engines"]["e0"], doc["engines"]["e1"]
    assert (e0["runs_ok"], e0["runs"], e1["runs_ok"], e1["runs"]) == (3, 3, 2, 3)
    assert e1["figures"]["ttft.a"]["values"] == [0.04, 0.06]
    assert "ttft_at.1024" not in e1["figures"] and "tpot_at.4x2000" not in e1["figures"]
    # A figure of the first run is listed first; one some runs lack is over the others.
    assert list(e0["figures"])[:5] == ["ttft.a", "ttft.b", "ttft.c", "ttft.mean_error",
                                       "ttft_at.1024"]  # fmt: skip
    assert e0["figures"]["ttft.loo_mean_error"]["values"] == pytest.approx([0.06, 0.1])
    values = [0.02, 0.03, 0.05]
    assert e0["figures"]["ttft.a"] == approx_each({
        "values": values, "mean": statistics.fmean(values), "sd": statistics.stdev(values),
        "cv": statistics.stdev(values) / statistics.fmean(values),
        "spread": 0.03 / statistics.fmean(values)})  # fmt: skip
    t = _profile(2.5).ttft
    assert e0["figures"]["ttft_at.1024"]["values"][2] == t.predict(1024)
    assert "tpot_at.4x2000" in e0["figures"]
    # An --out without the .json suffix: the document is <out>.stability.json beside it.
    stability(runs, operating, ["e0"], files, str(tmp_path / "bare"))
    assert (tmp_path / "bare.stability.json").is_file()


def test_the_summary_of_one_figure() -> None:
    from narwhal.profile.stability import _summary

    assert _summary([0.2]) == {"values": [0.2], "mean": 0.2, "sd": 0.0, "cv": 0.0, "spread": 0.0}
    assert _summary([0.1, 0.3]) == approx_each({"values": [0.1, 0.3], "mean": 0.2,
                                                "sd": math.sqrt(0.02), "cv": math.sqrt(0.02) / 0.2,
                                                "spread": 1.0})  # fmt: skip
    # Relative to the size of the mean, whatever its sign.
    negative = _summary([-2.0, -4.0])
    assert negative["cv"] == pytest.approx(math.sqrt(2) / 3)
    assert negative["spread"] == pytest.approx(2 / 3)
    # A zero mean: a spread-out zero has no finite cv; all zeros vary by nothing.
    assert _summary([-1.0, 1.0]) == {"values": [-1.0, 1.0], "mean": 0.0, "sd": math.sqrt(2),
                                     "cv": math.inf, "spread": 0.0}  # fmt: skip
    assert _summary([0.0, 0.0]) == {"values": [0.0, 0.0], "mean": 0.0, "sd": 0.0, "cv": 0.0,
                                    "spread": 0.0}  # fmt: skip


def test_the_stability_lines() -> None:
    doc = {"engines": {
        "e0": {"runs_ok": 2, "runs": 3, "figures": {
            "ttft.a": {"mean": 0.0201234567, "sd": 0.000123456, "cv": 0.006134, "spread": 0.0123},
            "ttft.b": {"mean": 5e-5, "sd": 1e-6, "cv": 0.02, "spread": 0.04}}},
        "e1": {"runs_ok": 0, "runs": 3, "figures": {}},
    }}  # fmt: skip
    assert stability_lines(doc) == [
        "  e0: 2 of 3 runs profiled",
        "    e0 ttft.a: mean 0.0201235 sd 0.000123 cv 0.61% spread 1.23%",
        "    e0 ttft.b: mean 5e-05 sd 1e-06 cv 2.00% spread 4.00%",
        "  e1: 0 of 3 runs profiled",
    ]


SMALL = profilekit.SMALL


async def test_the_sweep_is_repeated_each_run_its_own_pair_and_seed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101, noise=0.02))
    # A later run's pair left from before is overwritten when asked.
    await trio.Path(tmp_path / "profiles.run2.json").write_text("{}")
    s = profilekit.settings(tmp_path, overwrite=True, **SMALL)
    async with open_sim_fleet(config) as sim:
        with trio.fail_after(2 * profilekit.RUN_LIMIT_S):
            runs, doc = await profile_repeatedly(config, s, 2, transport=sim.transport,
                                                 progress=Progress(quiet=True),
                                                 config_source="fleet.json")  # fmt: skip
    assert [(r.profiles_path, r.samples_path) for r in runs] == [
        pair_paths(tmp_path / "profiles.json"), pair_paths(tmp_path / "profiles.run2.json")]
    sidecars = [json.loads(r.samples_path.read_text()) for r in runs]
    assert [d["sweep"]["seed"] for d in sidecars] == [7, 8]
    assert [d["fleet"]["source"] for d in sidecars] == ["fleet.json", "fleet.json"]
    assert json.loads((tmp_path / "profiles.stability.json").read_text()) == doc
    assert doc["runs"] == ["profiles.json", "profiles.run2.json"]
    profiles = [load_profiles(r.profiles_path)["e0"] for r in runs]
    lengths = [float(n) for n in sidecars[0]["engines"]["e0"]["prefill"]["effective_lens"]]
    cells = [(float(c["active"]), float(c["kv_tokens"]))
             for c in sidecars[0]["engines"]["e0"]["decode"]["cell_medians"]]  # fmt: skip
    assert lengths == [128.0, 256.0, 512.0, 1024.0] and len(cells) == 4
    expected = [engine_figures(p, lengths, cells) for p in profiles]
    figures = doc["engines"]["e0"]["figures"]
    assert list(figures) == list(expected[0])
    for key, summary in figures.items():
        assert summary["values"] == [f[key] for f in expected]


async def test_an_existing_later_run_is_refused_before_any_sweep(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101))
    await trio.Path(tmp_path / "profiles.run2.json").write_text("{}")
    s = profilekit.settings(tmp_path, seed=None, **SMALL)
    async with open_sim_fleet(config) as sim:
        with pytest.raises(ConfigError, match=r"profiles\.run2\.json already exist; pass --overwrite"):
            await profile_repeatedly(config, s, 2, transport=sim.transport,
                                     progress=Progress(quiet=True))  # fmt: skip
    assert sorted(p.name for p in await trio.Path(tmp_path).iterdir()) == ["profiles.run2.json"]


async def test_the_runs_are_made_in_order_and_compared_at_run_ones_operating_points(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The orchestration alone, the sweep replaced by a stand-in that records how it was
    called and writes a sidecar per run: run k gets its own pair, the given seed plus
    k - 1 (none without one), the caller's transport, progress and fleet source; the
    operating points are run 1's, missing parts of an entry count as none."""
    from narwhal.profile import stability as module
    from narwhal.profile.runner import EngineOutcome, ProfileRun

    calls: list[dict[str, Any]] = []
    entries = [
        {"e0": {"prefill": {"effective_lens": [128, 512]},
                "decode": {"cell_medians": [{"active": 1, "kv_tokens": 300}]}},
         "e1": {"prefill": {}}},
        {"e0": {"prefill": {"effective_lens": [999]}, "decode": {"cell_medians": []}}},
    ]

    async def stand_in(config: Any, settings: Any, **kwargs: Any) -> ProfileRun:
        calls.append({"out": settings.out, "seed": settings.seed} | kwargs)
        profiles, samples = pair_paths(settings.out)
        samples.write_text(json.dumps({"engines": entries[len(calls) - 1]}))
        outcomes = (EngineOutcome("e0", "ok", None, _profile(len(calls))),
                    EngineOutcome("e1", "ok", None, _profile(2.0 * len(calls))),
                    EngineOutcome("e2", "failed", "unreachable"))  # fmt: skip
        return ProfileRun(profiles, samples, outcomes)

    monkeypatch.setattr(module, "run_profile", stand_in)
    config = profilekit.fleet(profilekit.engine("e0", 8101))
    transport, progress = object(), Progress(io.StringIO(), tty=False)
    s = profilekit.settings(tmp_path, seed=None)
    runs, doc = await profile_repeatedly(config, s, 2, transport=transport,  # type: ignore[arg-type]
                                         progress=progress, config_source="f.json")  # fmt: skip
    assert calls == [
        {"out": str(tmp_path / "profiles.json"), "seed": None, "transport": transport,
         "progress": progress, "config_source": "f.json"},
        {"out": str(tmp_path / "profiles.run2.json"), "seed": None, "transport": transport,
         "progress": progress, "config_source": "f.json"},
    ]  # fmt: skip
    assert [r.samples_path.name for r in runs] == ["profiles.samples.json",
                                                   "profiles.run2.samples.json"]  # fmt: skip
    assert list(doc["engines"]) == ["e0", "e1", "e2"]
    e0 = doc["engines"]["e0"]["figures"]
    assert [k for k in e0 if "_at." in k] == ["ttft_at.128", "ttft_at.512", "tpot_at.1x300",
                                              "prefix_at.128x64", "prefix_at.512x256"]  # fmt: skip
    e1 = doc["engines"]["e1"]["figures"]  # no lengths recorded, no decode record: none
    assert not [k for k in e1 if "_at." in k] and e1["ttft.a"]["values"] == [0.04, 0.08]
    assert doc["engines"]["e2"] == {"runs_ok": 0, "runs": 2, "figures": {}}
    # A run's sidecar that cannot be read is named for what it is.
    entries[0] = {}
    calls.clear()
    monkeypatch.setattr(module, "read_json", lambda path, what: (_ for _ in ()).throw(
        ConfigError(f"cannot read {what}")))
    with pytest.raises(ConfigError, match=r"^cannot read samples file"):
        await profile_repeatedly(config, attrs.evolve(s, seed=5, overwrite=True), 2,
                                 progress=progress)  # fmt: skip
    assert [c["seed"] for c in calls] == [5, 6]
