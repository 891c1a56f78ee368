"""The profile pair: sidecar contents, failures, overwrite, the loader and refit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from narwhal.config import FaultSpec
from narwhal.engines.client import EngineClient
from narwhal.errors import ConfigError
from narwhal.profile import load_profiles, refit_pair
from narwhal.profile.store import SAMPLES_KIND, SCHEMA_VERSION, pair_paths
from narwhal.testing import open_sim_fleet
from tests.profilekit import engine, fleet, profile, samples, settings, wait_for

SMALL = {"prefill_lens": (128, 256, 512, 1024), "decode_input_lens": (128, 512),
         "decode_concurrency": (1, 4), "decode_tokens": 16}  # fmt: skip


async def test_the_sidecar_holds_everything_measured(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, _ = await profile(config, sim.transport, settings(tmp_path, **SMALL))
        live = await EngineClient(
            config.engines[0].url, name="e0", transport=sim.transport
        ).identity()
    data = samples(run)
    assert data["schema_version"] == SCHEMA_VERSION and data["kind"] == SAMPLES_KIND
    assert set(data["software"]) >= {"narwhal", "python", "numpy", "scipy"}
    assert data["sweep"]["prefill_lens"] == [128, 256, 512, 1024] and data["sweep"]["seed"] == 7
    e0 = data["engines"]["e0"]
    assert e0["status"] == "ok" and e0["identity"] == attrs.asdict(live)
    assert len(e0["prefill"]["repeats"]) == 12 and len(e0["prefill"]["medians"]) == 4
    assert e0["prefill"]["fit"]["model"] == "a + b*L + c*L^2"
    cells = e0["decode"]["cells"]
    assert len(cells) == 4 and all(c["intervals"] for c in cells)
    assert len(e0["decode"]["cell_medians"]) == 4
    assert e0["decode"]["fit"]["coefficients"].keys() == {"c0", "c1", "c2"}
    assert e0["profile"]["identity"] == e0["identity"]
    # The profiles file binds the same generation and names this exact sidecar.
    profiles = load_profiles(run.profiles_path)
    assert profiles["e0"].identity == live
    assert profiles.samples.path == run.samples_path.name
    assert json.loads(run.profiles_path.read_text())["engines"]["e0"] == e0["profile"]


@pytest.mark.parametrize(
    ("bounds", "tripped"),
    [({"max_worst_error": 100.0}, "mean error"), ({"max_mean_error": 100.0}, "worst-point error")],
)
async def test_a_noisy_engine_trips_each_prefill_bound_and_keeps_its_raw_data(
    autojump_clock: trio.abc.Clock, tmp_path: Path, bounds: dict[str, float], tripped: str
) -> None:
    config = fleet(engine("e0", 8101, noise=1.0, seed=3))
    s = settings(tmp_path, prefill_lens=(64, 128, 256, 512, 1024, 2048), repeats=1, **bounds)
    async with open_sim_fleet(config) as sim:
        run, _ = await profile(config, sim.transport, s)
        streams = sum(1 for body in sim.engines["e0"].requests_seen if body.get("stream"))
    outcome = run.outcomes[0]
    assert outcome.status == "rejected" and tripped in (outcome.reason or "")
    other = "worst-point error" if tripped == "mean error" else "mean error"
    assert other not in (outcome.reason or "")
    e0 = samples(run)["engines"]["e0"]
    assert e0["status"] == "rejected" and tripped in e0["prefill"]["rejection"]
    assert len(e0["prefill"]["repeats"]) == 6 and len(e0["prefill"]["medians"]) == 6
    fit = e0["prefill"]["fit"]
    assert fit["mean_error"] > 0 and fit["worst_error"] > 0 and len(fit["points"]) == 6
    assert "decode" not in e0 and streams == 0  # rejected before any decode profiling
    assert "profile" not in e0
    assert not run.wrote_profiles and not run.profiles_path.exists()  # no profile: the samples only


async def test_an_engine_dying_mid_sweep_leaves_the_others_intact(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101), engine("e1", 8102), engine("e2", 8103))

    async with open_sim_fleet(config) as sim:

        async def kill_e1_during_its_decode_sweep() -> None:
            e1 = sim.engines["e1"]
            await wait_for(lambda: any(body.get("stream") for body in e1.requests_seen))
            e1.inject(FaultSpec(kind="refuse_connection"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_e1_during_its_decode_sweep)
            run, out = await profile(config, sim.transport, settings(tmp_path, **SMALL))
    assert [o.status for o in run.outcomes] == ["ok", "failed", "ok"]
    assert not run.ok
    data = samples(run)
    e1 = data["engines"]["e1"]
    assert e1["status"] == "failed" and "e1" in e1["reason"]
    assert len(e1["prefill"]["repeats"]) == 12 and "fit" in e1["prefill"]  # its samples stay
    for name in ("e0", "e2"):
        entry = data["engines"][name]
        assert entry["status"] == "ok" and len(entry["decode"]["cells"]) == 4
    profiles = load_profiles(run.profiles_path)
    assert set(profiles.engines) == {"e0", "e2"} and "failed" in profiles.excluded["e1"]
    assert "e1: warning: failed" in out


async def test_an_interrupted_run_keeps_the_completed_engines_on_disk(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101), engine("e1", 8102))
    async with open_sim_fleet(config) as sim:
        with trio.CancelScope() as scope:  # what Ctrl-C does to the run

            async def interrupt_during_e1() -> None:
                await wait_for(lambda: bool(sim.engines["e1"].requests_seen))
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(interrupt_during_e1)
                await profile(config, sim.transport, settings(tmp_path, **SMALL))
    assert scope.cancelled_caught
    profiles_path, samples_path = pair_paths(tmp_path / "profiles.json")
    assert not profiles_path.exists()
    data = json.loads(samples_path.read_text())
    assert (
        data["engines"]["e0"]["status"] == "ok"
        and len(data["engines"]["e0"]["decode"]["cells"]) == 4
    )
    assert data["engines"]["e1"]["status"] == "failed"
    assert data["engines"]["e1"]["reason"] == "interrupted"


async def test_an_engine_restarting_mid_sweep_is_failed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101))
    async with open_sim_fleet(config) as sim:

        async def restart_after_prefill() -> None:
            e0 = sim.engines["e0"]
            await wait_for(lambda: len(e0.requests_seen) >= 5)
            await e0.restart()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_after_prefill)
            run, _ = await profile(config, sim.transport, settings(tmp_path, **SMALL))
    assert run.outcomes[0].status == "failed"
    assert "changed generation during the sweep" in (run.outcomes[0].reason or "")
    assert not run.wrote_profiles and not run.profiles_path.exists()


async def _profiled_pair(tmp_path: Path, *names: str, **overrides: Any) -> Path:
    config = fleet(*(engine(n, 8101 + i) for i, n in enumerate(names)))
    async with open_sim_fleet(config) as sim:
        run, _ = await profile(config, sim.transport, settings(tmp_path, **(SMALL | overrides)))
    assert run.ok
    return run.profiles_path


async def test_an_existing_pair_is_kept_unless_overwrite(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101), engine("e1", 8102))
    async with open_sim_fleet(config) as sim:
        first, _ = await profile(config, sim.transport, settings(tmp_path, **SMALL))
        before = first.samples_path.read_bytes()
        with pytest.raises(ConfigError, match="already exist; pass --overwrite"):
            await profile(config, sim.transport, settings(tmp_path, **SMALL))
        assert first.samples_path.read_bytes() == before
        second, _ = await profile(config, sim.transport,
                                  settings(tmp_path, engines=("e1",), overwrite=True, **SMALL))  # fmt: skip
    assert set(load_profiles(second.profiles_path).engines) == {"e1"}
    assert set(samples(second)["engines"]) == {"e1"}


async def test_the_loader_validates_the_schema_and_the_pair(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    path = await _profiled_pair(tmp_path, "e0")
    p = load_profiles(path)["e0"]
    assert p.predict_ttft(1000) == pytest.approx(p.ttft.a + p.ttft.b * 1000 + p.ttft.c * 1e6)
    assert p.predict_tpot(4, 2000) == pytest.approx(
        p.decode.c0 + 4 * p.decode.c1 + 2000 * p.decode.c2
    )
    assert p.decode.domain.contains(4, p.decode.domain.kv_tokens.min)
    assert not p.decode.domain.contains(16, p.decode.domain.kv_tokens.min)
    doc = json.loads(path.read_text())

    def broken(edit: Any) -> Path:
        bad = json.loads(json.dumps(doc))
        edit(bad)
        target = tmp_path / "bad.json"
        target.write_text(json.dumps(bad))
        (tmp_path / "bad.samples.json").write_bytes(pair_paths(path)[1].read_bytes())
        return target

    with pytest.raises(
        ConfigError, match=r"expected a number >= 0 @ \$\.engines\['e0'\]\.decode\.c1"
    ):
        load_profiles(broken(lambda d: d["engines"]["e0"]["decode"].update(c1=-1.0)))
    with pytest.raises(ConfigError, match="schema_version 0"):
        load_profiles(broken(lambda d: d.update(schema_version=0)))
    with pytest.raises(ConfigError, match="missing required key 'identity'"):
        load_profiles(broken(lambda d: d["engines"]["e0"].pop("identity")))
    pair_paths(path)[1].write_text("{}")
    with pytest.raises(ConfigError, match="SHA-256 differs"):
        load_profiles(path)
    assert "e0" in load_profiles(path, verify_samples=False)


async def test_refit_writes_a_new_pair_and_preserves_the_original(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    path = await _profiled_pair(tmp_path, "e0", "e1")
    original = {p: p.read_bytes() for p in pair_paths(path)}
    config = fleet(engine("e0", 8101), engine("e1", 8102))
    run = refit_pair(config, pair_paths(path)[1], tmp_path / "profiles-refit.json")
    assert run.ok and run.profiles_path.name == "profiles-refit.json"
    assert run.samples_path.name == "profiles-refit.samples.json"
    assert {p: p.read_bytes() for p in pair_paths(path)} == original
    old, new = load_profiles(path), load_profiles(run.profiles_path)
    assert new.refit_of == str(pair_paths(path)[1])
    for name in ("e0", "e1"):
        assert new[name].decode == old[name].decode
        assert new[name].identity == old[name].identity
        assert new[name].kv_capacity == old[name].kv_capacity
        assert new[name].ttft.a == pytest.approx(old[name].ttft.a, rel=1e-9)
    data = samples(run)
    assert data["refit"]["from"] == str(pair_paths(path)[1])
    assert data["engines"]["e0"]["prefill"]["fit_before_refit"] is not None
    with pytest.raises(ConfigError, match="already exist"):
        refit_pair(config, pair_paths(path)[1], tmp_path / "profiles-refit.json")
    with pytest.raises(ConfigError, match="overwrite the original pair"):
        refit_pair(config, pair_paths(path)[1], path, overwrite=True)


async def test_refit_refuses_unbound_or_older_samples(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    path = await _profiled_pair(tmp_path, "e0")
    sidecar = pair_paths(path)[1]
    config = fleet(engine("e0", 8101))
    data = json.loads(sidecar.read_text())

    def refit_of(edit: Any) -> None:
        bad = json.loads(json.dumps(data))
        edit(bad)
        source = tmp_path / "old.samples.json"
        source.write_text(json.dumps(bad))
        refit_pair(config, source, tmp_path / "refit.json", overwrite=True)

    with pytest.raises(ConfigError, match=r"not bound to an engine generation.*run a fresh sweep"):
        refit_of(lambda d: d["engines"]["e0"].pop("identity"))
    with pytest.raises(ConfigError, match=r"schema_version 0 predates.*run a fresh sweep"):
        refit_of(lambda d: d.update(schema_version=0))
    with pytest.raises(ConfigError, match="no profile snapshot for engine 'e0'"):
        refit_of(lambda d: d["engines"]["e0"].pop("profile"))
    with pytest.raises(ConfigError, match="hold nothing for configured engine 'e9'"):
        refit_pair(fleet(engine("e0", 8101), engine("e9", 8109)), sidecar, tmp_path / "x.json")
    assert not (tmp_path / "refit.json").exists() and not (tmp_path / "x.json").exists()
