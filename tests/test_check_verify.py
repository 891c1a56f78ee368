"""The preflight recomputes the profile pair from its raw samples and binds it to known
generations: each attack of a tampered or unverifiable pair is refused, and the
suggested fixes (re-profile one engine, merged into the pair) pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from narwhal.check import CheckReport, gate, run_check
from narwhal.config import unstructure_fleet
from narwhal.profile import run_profile
from narwhal.profile.store import file_sha256
from narwhal.testing import open_sim_fleet
from tests import profilekit
from tests.checkkit import LIMIT_S, rewrite_pair

SMALL = {
    "prefill_lens": (128, 256, 512, 1024),
    "decode_input_lens": (128, 512),
    "decode_concurrency": (1, 4),
    "decode_tokens": 16,
}


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def failed(report: CheckReport) -> set[tuple[str, str | None]]:
    return {(r.name, r.engine) for r in report.failures}


async def _profiled(tmp_path: Path, config: Any, sim: Any, **overrides: Any) -> dict[str, Any]:
    run, _ = await profilekit.profile(config, sim.transport,
                                      profilekit.settings(tmp_path, **(SMALL | overrides)))  # fmt: skip
    assert run.ok
    return unstructure_fleet(config) | {"profiles": {"path": str(run.profiles_path)}}


async def _check(doc: dict[str, Any], transport: httpx.AsyncBaseTransport) -> CheckReport:
    with trio.fail_after(LIMIT_S):
        return await run_check(doc, transport=transport)


async def test_hand_edited_figures_and_stub_sidecars_are_refused(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101), profilekit.engine("e1", 8102))
    async with open_sim_fleet(config) as sim:
        doc = await _profiled(tmp_path, config, sim)
        path = Path(doc["profiles"]["path"])
        assert (await _check(doc, sim.transport)).ok
        pristine = _read(path), _read(path.with_name("profiles.samples.json"))

        # 1. A better error figure typed into profiles.json (the sidecar is untouched).
        def lower_mape(p: dict[str, Any]) -> None:
            p["engines"]["e1"]["decode"]["fit_mape"] = 0.0001

        rewrite_pair(path, edit_profiles=lower_mape)
        report = await _check(doc, sim.transport)
        assert failed(report) == {("gate_f.samples", "e1")}
        message = report.failures[0].message
        assert "$.decode.fit_mape" in message and "0.0001" in message and "re-profile" in message

        # 2. A coefficient edited in both files, the sidecar re-hashed: the raw samples
        # still give the measured value.
        _write(path, pristine[0])
        _write(path.with_name("profiles.samples.json"), pristine[1])

        def halve_a(p: dict[str, Any]) -> None:
            p["engines"]["e0"]["ttft"]["a"] /= 2

        def halve_a_samples(s: dict[str, Any]) -> None:
            s["engines"]["e0"]["profile"]["ttft"]["a"] /= 2

        rewrite_pair(path, edit_profiles=halve_a, edit_samples=halve_a_samples)
        assert failed(await _check(doc, sim.transport)) == {("gate_f.samples", "e0")}

        # 3. A stub sidecar (no raw data) whose hash is pasted into profiles.json.
        def stub(s: dict[str, Any]) -> None:
            for entry in s["engines"].values():
                for key in ("prefill", "decode"):
                    entry.pop(key, None)

        rewrite_pair(path, edit_samples=stub)
        report = await _check(doc, sim.transport)
    assert failed(report) == {("gate_f.samples", "e0"), ("gate_f.samples", "e1")}
    assert all("no prefill repeats" in r.message for r in report.failures)


async def test_a_copied_process_start_time_is_refused(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        doc = await _profiled(tmp_path, config, sim)
        path = Path(doc["profiles"]["path"])
        await trio.sleep(3600)  # the engine restarts an hour after it was profiled
        await sim.engines["e0"].restart()
        await trio.sleep(5)
        after = await _check(doc, sim.transport)
        assert failed(after) == {("gate_f.generation", "e0")}
        live = after.identities["e0"]
        assert live is not None

        def copy_start(obj: dict[str, Any]) -> None:
            obj["process_start_time"] = live.process_start_time

        # Into profiles.json only: the sidecar's bound identity differs.
        rewrite_pair(path, edit_profiles=lambda p: copy_start(p["engines"]["e0"]["identity"]))
        report = await _check(doc, sim.transport)
        assert failed(report) == {("gate_f.samples", "e0")}
        assert "$.identity.process_start_time" in report.failures[0].message

        # Into every copy in both files: the sweep ran before that process started.
        def everywhere(s: dict[str, Any]) -> None:
            entry = s["engines"]["e0"]
            for key in ("identity", "identity_after"):
                copy_start(entry[key])
            copy_start(entry["profile"]["identity"])

        rewrite_pair(path, edit_samples=everywhere)
        report = await _check(doc, sim.transport)
    assert failed(report) == {("gate_f.samples", "e0")}
    assert "before the engine process" in report.failures[0].message


class _NoProcessMetrics(profilekit.MetricsRewrite):
    """An engine in Prometheus multiprocess mode: /metrics without process_* samples."""

    def line(self, text: str) -> str | None:
        return None if "process_start_time_seconds" in text else text


async def test_an_unknown_generation_fails_closed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        transport = _NoProcessMetrics(sim.transport)
        run, out = await profilekit.profile(config, transport, profilekit.settings(tmp_path, **SMALL))
        assert run.ok and "generation is unknown" in out
        doc = unstructure_fleet(config) | {"profiles": {"path": str(run.profiles_path)}}
        report = await _check(doc, transport)
        # A restart between the profile and the check is invisible: both are unknown.
        await sim.engines["e0"].restart()
        await trio.sleep(5)
        restarted = await _check(doc, transport)
    for r in (report, restarted):
        assert failed(r) == {("gate_f.generation", "e0")}
        message = r.failures[0].message
        assert "generation is unknown" in message and "multiprocess" in message
        assert message.startswith("engine e0's generation is unknown: the running engine and "
                                  "its profile report no process_start_time_seconds")  # fmt: skip


async def test_a_running_engine_that_stops_exporting_its_start_time_fails_closed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Profiled with a known start time, checked against an engine now in multiprocess
    mode (no process_* metrics): unknown, not equal."""
    config = profilekit.fleet(profilekit.engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        doc = await _profiled(tmp_path, config, sim)
        report = await _check(doc, _NoProcessMetrics(sim.transport))
    assert failed(report) == {("gate_f.generation", "e0")}
    r = report.failures[0]
    profiled = json.loads(_read(Path(doc["profiles"]["path"])))["engines"]["e0"]["identity"]
    assert r.measured is None and r.limit == profiled["process_start_time"] is not None
    assert r.message.startswith("engine e0's generation is unknown: the running engine reports "
                                "no process_start_time_seconds (Prometheus multiprocess mode")  # fmt: skip
    assert "--engines e0" in r.message
    assert r.detail["live"]["process_start_time"] is None
    assert r.detail["profiled"] == profiled


async def test_reprofiling_one_engine_merges_into_the_pair_and_passes(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101), profilekit.engine("d0", 8102))
    async with open_sim_fleet(config) as sim:
        doc = await _profiled(tmp_path, config, sim)
        path = Path(doc["profiles"]["path"])
        before = json.loads(_read(path.with_name("profiles.samples.json")))
        await sim.engines["d0"].restart()
        await trio.sleep(5)
        report = await _check(doc, sim.transport)
        assert failed(report) == {("gate_f.generation", "d0")}
        hint = report.failures[0].message
        assert f"--engines d0 --out {path}" in hint and "--prefill-lens 128,256,512,1024" in hint

        # The suggested fix: re-profile d0 into the same pair, without --overwrite.
        s = profilekit.settings(tmp_path, **SMALL, engines=("d0",))
        with trio.fail_after(profilekit.RUN_LIMIT_S):
            run = await run_profile(config, s, transport=sim.transport,
                                    progress=profilekit.Progress(quiet=True))  # fmt: skip
        assert run.ok and [o.name for o in run.outcomes] == ["d0"]
        fixed = await _check(doc, sim.transport)
    assert fixed.ok, [r.line() for r in fixed.failures]
    after = json.loads(_read(path.with_name("profiles.samples.json")))
    assert after["engines"]["e0"] == before["engines"]["e0"]  # kept, samples and all
    assert after["engines"]["d0"]["identity"] != before["engines"]["d0"]["identity"]
    assert after["merged"]["replaced"] == ["d0"] and after["merged"]["kept"] == ["e0"]
    profiles = json.loads(_read(path))
    assert set(profiles["engines"]) == {"e0", "d0"}
    assert profiles["samples"]["sha256"] == file_sha256(path.with_name("profiles.samples.json"))


async def test_a_prefill_only_engine_gets_no_decode_sweep_and_passes(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    p0 = profilekit.engine("p0", 8101) | {"roles": ["prefill"]}
    config = profilekit.fleet(p0, profilekit.engine("d0", 8102) | {"roles": ["decode"]})
    async with open_sim_fleet(config) as sim:
        recording = profilekit.Recording(sim.transport)
        run, _ = await profilekit.profile(config, recording, profilekit.settings(tmp_path, **SMALL))
        assert run.ok
        p = run.outcomes[0].profile
        assert p is not None and p.decode is None and p.kv_capacity is None
        streamed = {s.host for s in recording.seen
                    if s.path == "/v1/completions" and s.body and s.body.get("stream")}  # fmt: skip
        assert streamed == {"d0.test"}
        doc = unstructure_fleet(config) | {"profiles": {"path": str(run.profiles_path)}}
        report = await _check(doc, sim.transport)
        assert report.ok, [r.line() for r in report.failures]
        assert not [r for r in report.results if r.engine == "p0" and r.name.startswith("decode.")]
        # The same profile for a fleet that now lets p0 decode: it must be re-profiled.
        doc["engines"][0]["roles"] = ["prefill", "decode"]
        report = await _check(doc, sim.transport)
    assert ("decode.profile", "p0") in failed(report)


async def test_intervals_of_a_simulated_engine_contain_its_true_coefficients(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101, noise=0.02))
    async with open_sim_fleet(config) as sim:
        # The CLI's default five repeats per length.
        s = profilekit.settings(tmp_path, repeats=5)
        run, _ = await profilekit.profile(config, sim.transport, s)
    p = run.outcomes[0].profile
    assert p is not None and p.ttft.uncertainty is not None and p.decode is not None
    assert p.decode.uncertainty is not None
    truth = profilekit.PREFILL | profilekit.DECODE
    bands = p.ttft.uncertainty.coefficients | p.decode.uncertainty.coefficients
    for band in bands.values():
        assert band.low <= band.value <= band.high
        assert band.high > band.low  # noisy samples: a real interval, not a point
    # Every coefficient, the decode slopes included: the decode resampling draws the
    # same steps for every stream of a cell (their noise is shared), not each stream's
    # intervals on its own, which gave bands too narrow to hold c1 and c2.
    for key in ("a", "b", "c", "c0", "c1", "c2"):
        assert bands[key].low <= truth[key] <= bands[key].high, (key, bands[key], truth[key])
    assert p.ttft.uncertainty.upper_factor > 1 and p.decode.uncertainty.upper_factor > 1


async def test_an_honest_profile_passes_the_interval_gates(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    # The shipped simulated fleet's noise (1 %), the CLI's five repeats.
    config = profilekit.fleet(profilekit.engine("e0", 8101, noise=0.01))
    async with open_sim_fleet(config) as sim:
        doc = await _profiled(tmp_path, config, sim, repeats=5)
        report = await _check(doc, sim.transport)
    assert report.ok, [r.line() for r in report.failures]
    mean, worst = report.named("prefill.interval")[0], report.named("prefill.interval_worst")[0]
    assert 0 < mean.measured <= worst.measured < 0.1
    assert mean.limit == 0.20 and worst.limit == 0.50
    assert "coefficients a " in mean.message and "[" in mean.message
    assert report.named("prefill.interval_samples")[0].measured == 5


async def test_too_noisy_samples_fail_the_prefill_gates_of_the_check(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    # A profiler told to accept anything (bounds of 1000 %) writes a pair the samples
    # back: the check still applies the seed's prefill bounds to what they give.
    config = profilekit.fleet(profilekit.engine("e0", 8101, noise=0.7, seed=4))
    loose = {"max_mean_error": 10.0, "max_worst_error": 10.0, "repeats": 3,
             "prefill_lens": (64, 128, 256, 512, 1024, 2048)}  # fmt: skip
    async with open_sim_fleet(config) as sim:
        doc = await _profiled(tmp_path, config, sim, **loose)
        report = await _check(doc, sim.transport)
    tripped = {name for name, engine in failed(report) if engine == "e0"}
    assert {"prefill.mean_error", "prefill.worst_error", "prefill.loo_mean_error",
            "prefill.interval", "prefill.interval_worst"} <= tripped, report.lines()  # fmt: skip
    assert not [r for r in report.failures if not r.name.startswith(("prefill.", "decode."))]
    interval = report.named("prefill.interval")[0]
    assert interval.measured > 0.20 and "exceeds the prefill mean-error bound" in interval.message


async def test_too_few_repeats_are_refused_by_the_profiler_and_the_check(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = profilekit.fleet(profilekit.engine("e0", 8101, noise=0.01))
    async with open_sim_fleet(config) as sim:
        few, _ = await profilekit.profile(config, sim.transport,
                                          profilekit.settings(tmp_path / "few", repeats=2))  # fmt: skip
        doc = await _profiled(tmp_path, config, sim)
    assert few.outcomes[0].status == "rejected"
    assert "2 repeat(s) at a length cannot bound its median" in (few.outcomes[0].reason or "")
    # The same rule in the check, for a profile whose intervals rest on two repeats.
    profiles, samples = gate.load_pair(doc["profiles"]["path"])
    p = profiles.engines["e0"]
    assert p.ttft.uncertainty is not None
    two = attrs.evolve(p, ttft=attrs.evolve(
        p.ttft, uncertainty=attrs.evolve(p.ttft.uncertainty, min_samples=2)))  # fmt: skip
    results = gate.check_fit_limits(config, attrs.evolve(profiles, engines={"e0": two}), samples)
    bad = [r for r in results if not r.ok]
    assert [(r.name, r.measured, r.limit) for r in bad] == [("prefill.interval_samples", 2, 3)]
    assert "re-profile it with more --repeats" in bad[0].message
    ok = gate.check_fit_limits(config, profiles, samples)
    assert all(r.ok for r in ok), [r.line() for r in ok if not r.ok]


async def test_the_merge_flow_passes_after_a_restart_long_after_the_profile(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """restart -> the check says re-profile -> ``--engines d0`` -> the check passes, with
    the restart an hour after the profile: the sweep's timestamps and the engine's
    process start time are read on the same clock (virtual here)."""
    config = profilekit.fleet(profilekit.engine("e0", 8101), profilekit.engine("d0", 8102))
    async with open_sim_fleet(config) as sim:
        doc = await _profiled(tmp_path, config, sim)
        await trio.sleep(3600)
        await sim.engines["d0"].restart()
        await trio.sleep(5)
        report = await _check(doc, sim.transport)
        assert failed(report) == {("gate_f.generation", "d0")}
        assert "--engines d0" in report.failures[0].message
        s = profilekit.settings(tmp_path, **SMALL, engines=("d0",))
        run, _ = await profilekit.profile(config, sim.transport, s)
        assert run.ok
        fixed = await _check(doc, sim.transport)
    assert fixed.ok, [r.line() for r in fixed.failures]
    entry = json.loads(_read(Path(doc["profiles"]["path"]).with_name("profiles.samples.json")))
    clock = entry["engines"]["d0"]["wall_clock"]
    born = entry["engines"]["d0"]["identity"]["process_start_time"]
    assert born <= clock["started_at"] <= clock["finished_at"]
