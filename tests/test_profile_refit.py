"""Refit of a saved sidecar, every rule of it on one profiled pair: the new pair's sidecar
document figure by figure, engine selection, a rejected curve among accepted ones, the
error bounds passed through, and every refusal with its message and JSON path."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from narwhal.config import FleetConfig, converter
from narwhal.errors import ConfigError
from narwhal.profile import load_profiles, refit_pair
from narwhal.profile.derive import derive_ttft, ttft_curve
from narwhal.profile.fit import median_by_length
from narwhal.profile.progress import Progress
from narwhal.profile.runner import EngineOutcome, software_identity
from narwhal.profile.store import EngineProfile, file_sha256, pair_paths
from narwhal.testing import open_sim_fleet
from tests import profilekit

SMALL = profilekit.SMALL
FRESH = "run a fresh sweep (narwhal profile) against the current engine processes"


def _config(**urls: str) -> FleetConfig:
    e0 = profilekit.engine("e0", 8101, noise=0.05, seed=3)
    e1 = profilekit.engine("e1", 8102, noise=0.02, seed=5)
    for e in (e0, e1):
        e["url"] = urls.get(e["name"], e["url"])
    return profilekit.fleet(e0, e1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sidecar of one profiling run of two engines (made once: refit reads it only)."""
    out = tmp_path_factory.mktemp("profiled")
    config = _config()

    async def main() -> Path:
        async with open_sim_fleet(config) as sim:
            run, _ = await profilekit.profile(config, sim.transport,
                                              profilekit.settings(out, **SMALL))  # fmt: skip
        assert run.ok
        return run.samples_path

    path = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _write(tmp_path: Path, doc: Any, name: str = "profiles.samples.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _repeats(doc: dict[str, Any], name: str) -> list[tuple[int, float]]:
    return [(r["length"], r["ttft_s"]) for r in doc["engines"][name]["prefill"]["repeats"]]


def test_the_new_sidecar_is_the_old_one_with_median_curves(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    old = copy.deepcopy(saved)
    # The saved curve is an earlier fitter's, as in a pair to repair; the fleet section
    # holds more than the engine list.
    old["engines"]["e0"]["profile"]["ttft"] |= {"a": 0.5, "b": 0.0, "c": 0.0}
    # Figures and a status from before are replaced, not kept.
    for name in ("e0", "e1"):
        old["engines"][name]["prefill"] |= {"medians": "stale", "intervals": "stale"}
        old["engines"][name] |= {"status": "stale", "reason": "stale"}
    old["fleet"] = {"engines": ["e0", "e1"], "note": "kept"}
    source = _write(tmp_path, old)
    stream = io.StringIO()
    run = refit_pair(_config(), source, tmp_path / "refit.json",
                     progress=Progress(stream, tty=False))  # fmt: skip
    assert (run.profiles_path, run.samples_path) == pair_paths(tmp_path / "refit.json")
    new = json.loads(run.samples_path.read_text())
    assert set(new) == set(old) | {"refit"}
    for key in set(old) - {"created_at", "software", "profiles", "engines", "fleet"}:
        assert new[key] == old[key], key
    assert new["created_at"] >= old["created_at"] and new["created_at"].endswith("+00:00")
    assert new["software"] == software_identity()
    assert new["profiles"] == "refit.json"
    assert new["refit"] == {
        "from": str(source), "sha256": file_sha256(source),
        "fitter": "TTFT curve fitted to the median of the repeats at each exact length; "
                  "decode model and KV capacity copied",
    }  # fmt: skip
    assert new["fleet"] == {"engines": ["e0", "e1"], "note": "kept"}
    assert list(new["engines"]) == ["e0", "e1"]
    outcomes = []
    for name in ("e0", "e1"):
        before, after = old["engines"][name], new["engines"][name]
        repeats = _repeats(old, name)
        derived = derive_ttft(repeats)
        assert after["prefill"]["fit_before_refit"] == before["prefill"]["fit"]
        assert set(after["prefill"]) == set(before["prefill"]) | {"fit_before_refit"}
        assert after["prefill"]["medians"] == [
            {"length": n, "ttft_s": m, "repeats": 3} for n, m in median_by_length(repeats).items()
        ]
        assert after["prefill"]["fit"] == derived.fit.as_dict()
        assert after["prefill"]["intervals"] == derived.intervals.as_dict()
        assert "rejection" not in after["prefill"]
        snapshot = converter.structure(before["profile"], EngineProfile)
        profile = attrs.evolve(snapshot, ttft=ttft_curve(derived))
        assert after["profile"] == converter.unstructure(profile)
        assert (after["status"], after["reason"]) == ("ok", None)
        rest = {"prefill", "profile", "status", "reason"}
        assert {k: v for k, v in after.items() if k not in rest} == {
            k: v for k, v in before.items() if k not in rest}
        outcomes.append(EngineOutcome(name, "ok", None, profile))
        fit = derived.fit
        assert (f"{name}: refitted TTFT = {fit.a:.4g} + {fit.b:.4g}*L + {fit.c:.4g}*L^2 s (mean "
                f"error {fit.mean_error:.1%}, worst {fit.worst_error:.1%}); decode model "
                "copied\n") in stream.getvalue()  # fmt: skip
    assert run.outcomes == tuple(outcomes)
    written = load_profiles(run.profiles_path)
    assert written.refit_of == str(source)
    assert written["e0"].ttft.a != 0.5 and written["e0"].decode == converter.structure(
        old["engines"]["e0"]["profile"], EngineProfile).decode
    # The source is read, never written.
    assert json.loads(source.read_text()) == old


def test_an_unreadable_sidecar_is_named_for_what_it_is(tmp_path: Path) -> None:
    broken = tmp_path / "broken.samples.json"
    broken.write_text("{")
    with pytest.raises(ConfigError, match=r"^.*broken\.samples\.json: samples file is not valid JSON"):
        refit_pair(_config(), broken, tmp_path / "refit.json")
    with pytest.raises(ConfigError, match=r"cannot read samples file: No such file"):
        refit_pair(_config(), tmp_path / "gone.samples.json", tmp_path / "refit.json")


def test_only_the_selected_engines_are_refitted(saved: dict[str, Any], tmp_path: Path) -> None:
    source = _write(tmp_path, saved)
    run = refit_pair(_config(), source, tmp_path / "refit.json", engines=["e1"],
                     progress=Progress(quiet=True))  # fmt: skip
    new = json.loads(run.samples_path.read_text())
    assert list(new["engines"]) == ["e1"] and new["fleet"]["engines"] == ["e1"]
    assert [o.name for o in run.outcomes] == ["e1"]
    # A sidecar without a fleet section gets one naming the refitted engines.
    bare = copy.deepcopy(saved)
    del bare["fleet"]
    run = refit_pair(_config(), _write(tmp_path, bare, "bare.samples.json"),
                     tmp_path / "bare-refit.json", engines=["e0"])  # fmt: skip
    assert json.loads(run.samples_path.read_text())["fleet"] == {"engines": ["e0"]}


def test_a_rejected_curve_is_recorded_and_the_next_engine_still_refitted(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    doc = copy.deepcopy(saved)
    for r in doc["engines"]["e0"]["prefill"]["repeats"]:  # a length that took 6 times as long
        if r["length"] == 256:
            r["ttft_s"] *= 6
    source = _write(tmp_path, doc)
    stream = io.StringIO()
    progress = Progress(stream, tty=False)
    run = refit_pair(_config(), source, tmp_path / "refit.json", progress=progress)
    derived = derive_ttft(_repeats(doc, "e0"))
    rejection = derived.rejection()
    assert rejection is not None
    entry = json.loads(run.samples_path.read_text())["engines"]["e0"]
    reason = f"refitted TTFT curve rejected: {rejection}"
    assert (entry["status"], entry["reason"]) == ("rejected", reason)
    assert entry["prefill"]["rejection"] == rejection and "profile" not in entry
    assert entry["prefill"]["fit"] == derived.fit.as_dict()
    assert run.outcomes[0] == EngineOutcome("e0", "rejected", reason)
    assert progress.warnings == [f"e0: {reason}"]
    assert [o.status for o in run.outcomes] == ["rejected", "ok"] and not run.ok
    assert "e1: refitted TTFT" in stream.getvalue() and "e0: refitted" not in stream.getvalue()
    profiles = load_profiles(run.profiles_path)
    assert list(profiles.engines) == ["e1"] and profiles.excluded == {"e0": f"rejected: {reason}"}
    # The bounds are the caller's: loose enough, the same curve is accepted.
    loose = refit_pair(_config(), source, tmp_path / "loose.json", max_mean_error=100.0,
                       max_worst_error=100.0)  # fmt: skip
    assert loose.ok
    assert derived.rejection(max_mean_error=100.0, max_worst_error=100.0) is None
    # A bound is applied on its own (the worst error alone rejects).
    worst_only = refit_pair(_config(), source, tmp_path / "worst.json", max_mean_error=100.0,
                            overwrite=True)  # fmt: skip
    assert worst_only.outcomes[0].status == "rejected"
    assert "50% bound" in (worst_only.outcomes[0].reason or "")


def _refused(config: FleetConfig, source: Path, out: Path, **kwargs: Any) -> ConfigError:
    before = [p.read_bytes() if p.exists() else None for p in pair_paths(out)]
    with pytest.raises(ConfigError) as info:
        refit_pair(config, source, out, **kwargs)
    assert [p.read_bytes() if p.exists() else None for p in pair_paths(out)] == before
    return info.value


def test_every_refusal_names_its_reason_and_json_path(saved: dict[str, Any], tmp_path: Path) -> None:
    config = _config()
    out = tmp_path / "refit.json"

    def edited(edit: Any) -> Path:
        doc = copy.deepcopy(saved)
        edit(doc)
        return _write(tmp_path, doc, "edited.samples.json")

    def refusal(source: Path, **kwargs: Any) -> tuple[str, str | None, str | None]:
        e = _refused(kwargs.pop("config", config), source, out, **kwargs)
        return e.reason, e.path, e.source

    def fresh(message: str, path: str, source: Path) -> tuple[str, str, str]:
        return f"{message}; {FRESH}", path, str(source)

    not_samples = _write(tmp_path, {"kind": "narwhal.profiles"}, "other.samples.json")
    assert refusal(not_samples) == fresh("not a narwhal profile samples file", "$.kind", not_samples)
    listed = _write(tmp_path, [saved], "list.samples.json")
    assert refusal(listed) == fresh("not a narwhal profile samples file", "$.kind", listed)
    old = edited(lambda d: d.update(schema_version=0))
    assert refusal(old) == fresh(
        "samples schema_version 0 predates generation-bound samples", "$.schema_version", old)
    none = edited(lambda d: d.update(engines=[]))
    assert refusal(none) == fresh("the samples hold no engines", "$.engines", none)
    missing = edited(lambda d: d["engines"].pop("e1"))
    assert refusal(missing) == fresh(
        "the samples hold nothing for configured engine 'e1'", "$.engines.e1", missing)
    listed_entry = edited(lambda d: d["engines"].update(e1=[]))
    assert refusal(listed_entry) == fresh(
        "the samples hold nothing for configured engine 'e1'", "$.engines.e1", listed_entry)
    unbound = edited(lambda d: d["engines"]["e1"].update(identity="e1"))
    assert refusal(unbound) == fresh("the samples of engine 'e1' are not bound to an engine "
                                     "generation", "$.engines.e1.identity", unbound)  # fmt: skip
    moved = _config(e1="http://e1.test:9102")
    source = _write(tmp_path, saved)
    assert refusal(source, config=moved) == fresh(
        "the samples of engine 'e1' were taken at http://e1.test:8102, the fleet has it at "
        "http://e1.test:9102", "$.engines.e1.identity.url", source)
    # Only the selected engines are looked at.
    assert refit_pair(moved, source, tmp_path / "e0.json", engines=["e0"]).ok
    # A malformed identity or snapshot is refused with its path in the sidecar.
    bad_url = edited(lambda d: d["engines"]["e1"]["identity"].update(url=5))
    assert refusal(bad_url) == fresh("expected a string", "$.engines.e1.identity.url", bad_url)
    no_model = edited(lambda d: d["engines"]["e1"]["identity"].pop("model"))
    assert refusal(no_model) == fresh("missing required key 'model'", "$.engines.e1.identity",
                                      no_model)  # fmt: skip
    bad_ttft = edited(lambda d: d["engines"]["e1"]["profile"]["ttft"].update(a=-1.0))
    assert refusal(bad_ttft) == fresh("expected a number >= 0", "$.engines.e1.profile.ttft.a",
                                      bad_ttft)  # fmt: skip
    no_profile = edited(lambda d: d["engines"]["e1"].update(profile=None))
    assert refusal(no_profile) == fresh("the samples hold no profile snapshot for engine 'e1' "
                                        "(status 'ok')", "$.engines.e1.profile", no_profile)  # fmt: skip
    other = edited(lambda d: d["engines"]["e1"]["profile"]["identity"].update(
        process_start_time=d["engines"]["e1"]["identity"]["process_start_time"] + 1))
    assert refusal(other) == fresh("the profile snapshot of engine 'e1' is bound to another "
                                   "generation than its samples", "$.engines.e1.profile.identity",
                                   other)  # fmt: skip
    no_repeats = edited(lambda d: d["engines"]["e1"]["prefill"].update(repeats=[]))
    assert refusal(no_repeats) == fresh("the samples hold no prefill repeats for engine 'e1'",
                                        "$.engines.e1.prefill.repeats", no_repeats)  # fmt: skip
    bad_repeat = edited(lambda d: d["engines"]["e1"]["prefill"]["repeats"][2].update(ttft_s=0))
    assert refusal(bad_repeat) == fresh(
        "expected {length: int, ttft_s: number > 0} for engine 'e1'",
        "$.engines.e1.prefill.repeats[2]", bad_repeat)
    # An unknown engine name is the selection's error, before any file is written.
    unknown = _refused(config, source, out, engines=["e7"])
    assert unknown.reason == "no engine named 'e7' in the fleet (engines: e0, e1)"


def test_the_original_pair_and_an_existing_pair_are_not_overwritten(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    config = _config()
    source = _write(tmp_path, saved)  # profiles.samples.json, naming profiles.json

    def overwrites(out: Path, sidecar: Path = source) -> str:
        e = _refused(config, sidecar, out, overwrite=True)
        assert e.path == "$" and e.source is None
        return e.reason

    for out in (tmp_path / "profiles.json", tmp_path / "profiles.samples.json"):
        assert overwrites(out) == (f"--out {out} would overwrite the original pair; a refit "
                                   "writes a new pair (e.g. runs/profiles-refit.json)")  # fmt: skip
    # A renamed sidecar still protects the profiles file it names, and its own name's pair.
    renamed = _write(tmp_path, saved, "copy.samples.json")
    assert "would overwrite the original pair" in overwrites(tmp_path / "profiles.json", renamed)
    assert "would overwrite the original pair" in overwrites(tmp_path / "copy.json", renamed)
    unnamed = copy.deepcopy(saved)
    unnamed["profiles"] = None  # names none: only its own pair is protected
    loose = _write(tmp_path, unnamed, "loose.samples.json")
    assert "original pair" in overwrites(tmp_path / "loose.json", loose)
    assert refit_pair(config, loose, tmp_path / "profiles-refit.json").ok
    # An existing pair is kept unless asked to overwrite it.
    exists = _refused(config, source, tmp_path / "profiles-refit.json")
    assert exists.reason.endswith("already exist; pass --overwrite to write a new pair")
    assert refit_pair(config, source, tmp_path / "profiles-refit.json", overwrite=True).ok
