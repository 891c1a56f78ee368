"""Gate F and the fit limits, called directly: every verdict, figure and limit, word for word.

These are the preflight's rules without a running fleet (identities are built, pairs are
written by tests/checkkit.py), so that each rule is pinned by a fast test: a limit
compared the wrong way, a bound moved, a message that no longer names its figure or its
limit, a generation compared on the wrong fields, each fails one of these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from narwhal.check import check_contract, check_margin, check_stable
from narwhal.check.gate import check_fit_limits, find_refit_original, gate_f, verify_samples
from narwhal.check.results import CheckResult, ProfilePair
from narwhal.config import FleetConfig, parse_fleet
from narwhal.engines.client import EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile.store import (
    SAMPLES_KIND,
    SCHEMA_VERSION,
    CachedPrefill,
    CoefficientBand,
    EngineProfile,
    Profiles,
    SamplesRef,
    Uncertainty,
    file_sha256,
)
from tests.checkkit import engine, fleet_doc, identity_of, rewrite_pair, sim_profile, write_pair

#: 2024-06-10 06:13:20 UTC.
BORN = 1718000000.0
SWEEP = {"prefill_lens": [16, 512], "decode_input_lens": [128], "decode_concurrency": [1, 4]}


def ident(name: str, port: int, **changes: Any) -> EngineIdentity:
    return attrs.evolve(identity_of(name, port), **({"process_start_time": BORN} | changes))


LIVE = {"e0": ident("e0", 8101), "e1": ident("e1", 8102)}


def pair(tmp_path: Path, *profiles: EngineProfile, **kwargs: Any) -> Path:
    chosen = profiles or (sim_profile("e0", LIVE["e0"]), sim_profile("e1", LIVE["e1"]))
    return write_pair(tmp_path / "profiles.json", chosen, **kwargs)


def config_for(path: Path | None, *engines: dict[str, Any], **profiles: Any) -> FleetConfig:
    doc = fleet_doc(*engines)
    if path is not None:
        doc["profiles"] = {"path": str(path), **profiles}
    elif profiles:
        doc["profiles"] = profiles
    return parse_fleet(doc)


def lines(results: Any) -> list[str]:
    # A verdict is true or false in the JSON report, never null.
    assert all(type(r.ok) is bool for r in results), [r.ok for r in results]
    return [r.line() for r in results]


def named(results: Any, name: str, engine_name: str | None = None) -> CheckResult:
    found = [
        r for r in results if r.name == name and (engine_name is None or r.engine == engine_name)
    ]
    assert len(found) == 1, lines(results)
    assert type(found[0].ok) is bool
    return found[0]


# ---------------------------------------------------------------------------- Gate F


def test_a_bound_pair_passes_gate_f_check_by_check(tmp_path: Path) -> None:
    path = pair(tmp_path)
    sidecar = path.with_name("profiles.samples.json")
    outcome = gate_f(config_for(path), LIVE)
    assert lines(outcome.results) == [
        f"ok   gate_f.profiles fleet: profile pair {path} with sidecar profiles.samples.json "
        f"(schema_version {SCHEMA_VERSION}) (measured {path}; limit schema_version {SCHEMA_VERSION} pair)",
        "ok   gate_f.profile e0: engine e0 has an accepted profile (measured accepted; limit an accepted profile)",
        "ok   gate_f.generation e0: engine e0 runs the generation its profile was measured on "
        "(measured 2024-06-10 06:13:20 UTC; limit 2024-06-10 06:13:20 UTC)",
        "ok   gate_f.profile e1: engine e1 has an accepted profile (measured accepted; limit an accepted profile)",
        "ok   gate_f.generation e1: engine e1 runs the generation its profile was measured on "
        "(measured 2024-06-10 06:13:20 UTC; limit 2024-06-10 06:13:20 UTC)",
        "ok   gate_f.samples e0: engine e0's profile is what its raw samples give "
        "(measured recomputed; limit profiles.json as its raw samples give it)",
        "ok   gate_f.samples e1: engine e1's profile is what its raw samples give "
        "(measured recomputed; limit profiles.json as its raw samples give it)",
    ]
    assert all(r.detail == {} for r in outcome.results)
    assert outcome.pair == ProfilePair(
        profiles=str(path),
        samples=str(sidecar),
        profiles_sha256=file_sha256(path),
        samples_sha256=file_sha256(sidecar),
    )
    assert outcome.profiles is not None and sorted(outcome.profiles.engines) == ["e0", "e1"]
    assert outcome.samples is not None and outcome.samples["kind"] == SAMPLES_KIND


def test_gate_f_without_a_pair_says_what_to_do() -> None:
    outcome = gate_f(config_for(None), LIVE)
    assert lines(outcome.results) == [
        "FAIL gate_f.profiles fleet: profiles.path is not set; profile the fleet (narwhal profile) "
        "and name the pair in the fleet document (measured null; limit a profile pair)"
    ]
    assert (outcome.profiles, outcome.samples, outcome.pair) == (None, None, None)


def test_an_unusable_pair_names_the_file_and_the_json_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.json"
    outcome = gate_f(config_for(missing), LIVE)
    (result,) = outcome.results
    assert (result.name, result.engine, result.ok) == ("gate_f.profiles", None, False)
    assert result.message.startswith(f"profile pair unusable: {missing}")
    assert (result.measured, result.limit) == (
        str(missing),
        f"schema_version {SCHEMA_VERSION} pair",
    )
    assert result.detail == {"path": "$"}
    assert (outcome.profiles, outcome.pair) == (None, None)

    path = pair(tmp_path)
    for key, value, where, said in [
        ("kind", "something else", "$.kind", "not a narwhal profile samples file"),
        ("schema_version", 0, "$.schema_version",
         f"samples schema_version 0 is not {SCHEMA_VERSION}; profile again with this narwhal"),
    ]:  # fmt: skip
        good = json.loads(path.with_name("profiles.samples.json").read_text())[key]
        rewrite_pair(path, edit_samples=lambda s, k=key, v=value: s.update({k: v}))
        (result,) = gate_f(config_for(path), LIVE).results
        assert result.detail == {"path": where}, result.line()
        sidecar = path.with_name("profiles.samples.json")
        assert result.message == f"profile pair unusable: {sidecar}: {said} @ {where}"
        rewrite_pair(path, edit_samples=lambda s, k=key, v=good: s.update({k: v}))
    assert gate_f(config_for(path), LIVE).results[0].ok
    # A sidecar whose hash was re-recorded but whose content is no samples document.
    sidecar = path.with_name("profiles.samples.json")
    for content, said, where in [
        (b"[]", "not a narwhal profile samples file", "$.kind"),
        (b"{not json", "samples file is not valid JSON: ", "$"),
    ]:
        sidecar.write_bytes(content)
        rewrite_profiles = json.loads(path.read_text())
        rewrite_profiles["samples"]["sha256"] = file_sha256(sidecar)
        path.write_text(json.dumps(rewrite_profiles))
        (result,) = gate_f(config_for(path), LIVE).results
        assert result.message.startswith(f"profile pair unusable: {sidecar}: {said}"), (
            result.message
        )
        assert result.detail == {"path": where}


def test_a_pair_that_vanishes_while_read_is_unusable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = pair(tmp_path)

    def gone(_path: Any) -> str:
        raise FileNotFoundError(2, "No such file or directory", str(_path))

    monkeypatch.setattr("narwhal.check.gate.file_sha256", gone)
    (result,) = gate_f(config_for(path), LIVE).results
    assert not result.ok and result.detail == {"path": "$"}
    assert result.message == f"profile pair unusable: [Errno 2] No such file or directory: '{path}'"


def test_each_engine_without_an_accepted_profile_fails_with_the_reason(tmp_path: Path) -> None:
    # The engine without a profile comes first: the engines after it are still gated.
    path = pair(tmp_path, sim_profile("e1", LIVE["e1"]))
    results = gate_f(config_for(path), LIVE).results
    assert [(r.name, r.engine, r.ok) for r in results] == [
        ("gate_f.profiles", None, True),
        ("gate_f.profile", "e0", False),
        ("gate_f.profile", "e1", True),
        ("gate_f.generation", "e1", True),
        ("gate_f.samples", "e1", True),
    ]
    assert named(results, "gate_f.profile", "e0").line() == (
        f"FAIL gate_f.profile e0: engine e0 has no accepted profile in {path} (it was not profiled) "
        "(measured none; limit an accepted profile)"
    )
    rewrite_pair(path, edit_profiles=lambda p: p.update(excluded={"e0": "its decode fit failed"}))
    results = gate_f(config_for(path), LIVE).results
    assert named(results, "gate_f.profile", "e0").message == (
        f"engine e0 has no accepted profile in {path} (its decode fit failed)"
    )


def hint(
    path: Path, name: str = "e0", fleet: str = "fleet.json", sweep: dict[str, Any] = SWEEP
) -> str:
    flags = " ".join(f"--{k.replace('_', '-')} {','.join(map(str, v))}" for k, v in sweep.items())
    return f"narwhal profile --fleet {fleet} --engines {name} --out {path} {flags}"


def test_another_generation_is_refused_field_by_field_with_the_command_that_fixes_it(
    tmp_path: Path,
) -> None:
    path = pair(tmp_path, extra_samples={"sweep": SWEEP})
    config = config_for(path)
    live = {
        "e0": ident("e0", 8101, version="0.33.0"),
        "e1": ident("e1", 8102, process_start_time=BORN + 3600),
    }
    results = gate_f(config, live, fleet_source="fleet.json").results
    version = named(results, "gate_f.generation", "e0")
    assert not version.ok
    assert version.message == (
        "engine e0 is not the process its profile was measured on (version '0.32.0' -> '0.33.0'); "
        f"re-profile it ({hint(path)}: the new sweep is merged into the pair, the other engines "
        "kept) or, with generation-bound samples of the running process, refit "
        "(narwhal profile --refit-samples ... --out ...)"
    )
    assert (version.measured, version.limit) == ({"version": "0.33.0"}, {"version": "0.32.0"})
    assert version.detail == {
        "live": attrs.asdict(live["e0"]),
        "profiled": attrs.asdict(LIVE["e0"]),
    }
    restarted = named(results, "gate_f.generation", "e1")
    assert not restarted.ok
    assert restarted.message.startswith(
        "engine e1 is not the process its profile was measured on (process_start_time "
        "'2024-06-10 06:13:20 UTC' -> '2024-06-10 07:13:20 UTC'); re-profile it "
        f"({hint(path, 'e1')}: "
    )
    assert restarted.measured == {"process_start_time": "2024-06-10 07:13:20 UTC"}
    assert restarted.limit == {"process_start_time": "2024-06-10 06:13:20 UTC"}
    # Every field of the identity counts, and several changes are all named.
    for field, value in [("url", "http://other:1"), ("model", "other"), ("max_model_len", 8192)]:
        (changed,) = [r for r in gate_f(config, LIVE | {"e0": attrs.evolve(LIVE["e0"], **{field: value})}).results
                      if r.name == "gate_f.generation" and not r.ok]  # fmt: skip
        assert changed.measured == {field: value} and f"({field} " in changed.message
    both = gate_f(config, LIVE | {"e0": attrs.evolve(live["e0"], max_model_len=8192)}).results
    assert (
        "(version '0.32.0' -> '0.33.0', max_model_len 4096 -> 8192); "
        in named(both, "gate_f.generation", "e0").message
    )


def test_the_hint_prefers_the_engines_own_sweep_and_says_what_it_does_not_know(
    tmp_path: Path,
) -> None:
    path = pair(tmp_path, extra_samples={"sweep": SWEEP})
    own = {"prefill_lens": [64], "decode_input_lens": [256, 1024], "decode_concurrency": [2]}
    rewrite_pair(path, edit_samples=lambda s: s["engines"]["e1"].update(sweep=own))
    live = {"e0": ident("e0", 8101, version="0.33.0"), "e1": ident("e1", 8102, version="0.33.0")}
    results = gate_f(config_for(path), live).results
    assert (
        f"re-profile it ({hint(path, 'e1', 'FLEET', own)}: "
        in named(results, "gate_f.generation", "e1").message
    )
    assert (
        f"re-profile it ({hint(path, 'e0', 'FLEET')}: "
        in named(results, "gate_f.generation", "e0").message
    )
    bare = pair(tmp_path)
    rewrite_pair(bare, edit_samples=lambda s: s["engines"]["e1"].update(sweep={"prefill_lens": []}))
    results = gate_f(config_for(bare), live).results
    unknown = (f"narwhal profile --fleet FLEET --engines e1 --out {bare} --prefill-lens ... "
               "--decode-input-lens ... --decode-concurrency ...: ")  # fmt: skip
    assert f"re-profile it ({unknown}" in named(results, "gate_f.generation", "e1").message


def test_a_malformed_sidecar_gives_a_hint_without_its_sweep_not_a_crash(tmp_path: Path) -> None:
    path = pair(tmp_path)
    live = {"e0": ident("e0", 8101, version="0.33.0"), "e1": ident("e1", 8102, version="0.33.0")}
    unknown = "--prefill-lens ... --decode-input-lens ... --decode-concurrency ...: "
    entries = json.loads(path.with_name("profiles.samples.json").read_text())["engines"]
    for engines, sweep in [
        (list(entries.values()), SWEEP),  # engines not keyed by name: the fleet-wide sweep
        ({"e0": "junk", "e1": entries["e1"]}, SWEEP),  # an entry that is no object: likewise
        (entries, [1, 2]),  # a sweep that is no object: unknown
    ]:
        rewrite_pair(path, edit_samples=lambda s, e=engines, w=sweep: s.update(engines=e, sweep=w))
        results = gate_f(config_for(path), live).results
        message = named(results, "gate_f.generation", "e0").message
        if isinstance(sweep, dict):
            assert f"re-profile it ({hint(path, 'e0', 'FLEET')}: " in message
        else:
            assert f"--out {path} {unknown}" in message
        # The recomputation says what is wrong with the entry (the third is well formed).
        assert named(results, "gate_f.samples", "e0").ok is (engines is entries)


def test_an_unreachable_engine_fails_its_generation(tmp_path: Path) -> None:
    path = pair(tmp_path)
    results = gate_f(config_for(path), {"e0": LIVE["e0"]}).results
    assert named(results, "gate_f.generation", "e1").line() == (
        "FAIL gate_f.generation e1: engine e1 is unreachable; its generation cannot be compared "
        'with its profile\'s (measured null; limit {"max_model_len": 4096, "model": "sim-llama", '
        f'"process_start_time": {BORN}, "url": "http://e1.test:8102", "version": "0.32.0"}})'
    )
    assert named(results, "gate_f.generation", "e0").ok


UNKNOWN = (
    "no process_start_time_seconds (Prometheus multiprocess mode, e.g. more than one API server "
    "process, drops process_* metrics, and vLLM offers no other per-boot identity over HTTP), so "
    "the profile cannot be bound to the process running now; run the engine with a single API "
    "server process so that /metrics exports process_start_time_seconds, then re-profile it ("
)


def test_an_unknown_generation_is_not_equal_to_another_unknown(tmp_path: Path) -> None:
    unknown_profile = ident("e1", 8102, process_start_time=None)
    path = pair(tmp_path, sim_profile("e0", LIVE["e0"]), sim_profile("e1", unknown_profile))
    live = {"e0": ident("e0", 8101, process_start_time=None), "e1": unknown_profile}
    results = gate_f(config_for(path), live).results
    e0, e1 = named(results, "gate_f.generation", "e0"), named(results, "gate_f.generation", "e1")
    assert not e0.ok and not e1.ok
    assert e0.message.startswith(
        f"engine e0's generation is unknown: the running engine reports {UNKNOWN}"
    )
    assert e0.message.endswith(
        f"re-profile it (narwhal profile --fleet FLEET --engines e0 --out {path} --prefill-lens ... "
        "--decode-input-lens ... --decode-concurrency ...)"
    )
    assert (e0.measured, e0.limit) == (None, BORN)
    assert e0.detail == {"live": attrs.asdict(live["e0"]), "profiled": attrs.asdict(LIVE["e0"])}
    assert e1.message.startswith(
        f"engine e1's generation is unknown: the running engine and its profile report {UNKNOWN}"
    )
    assert (e1.measured, e1.limit) == (None, None)
    # A sweep cannot be placed before an unknown start: the samples check still passes.
    assert named(results, "gate_f.samples", "e1").ok
    # The profile alone unknown: the live start time is shown against the missing one.
    results = gate_f(config_for(path), LIVE).results
    e1 = named(results, "gate_f.generation", "e1")
    assert e1.message.startswith(
        f"engine e1's generation is unknown: its profile reports {UNKNOWN}"
    )
    assert (e1.ok, e1.measured, e1.limit) == (False, BORN, None)


# ------------------------------------------------------------------ the recomputation


def test_samples_that_give_another_profile_are_named_difference_by_difference(
    tmp_path: Path,
) -> None:
    path = pair(tmp_path)
    profiles = gate_f(config_for(path), LIVE).profiles
    assert profiles is not None
    samples = json.loads(path.with_name("profiles.samples.json").read_text())

    def verdict(engines: dict[str, EngineProfile] | None = None, edit: Any = None) -> CheckResult:
        doc = json.loads(json.dumps(samples))
        if edit is not None:
            edit(doc)
        chosen = attrs.evolve(profiles, engines=engines) if engines is not None else profiles
        # No profile: Gate F's failure, not this check's; the engines after it are still checked.
        results = verify_samples(chosen, doc, ["absent", "e0"])
        assert [r.engine for r in results] == ["e0"]
        return results[0]

    ok = verdict()
    assert ok.ok and ok.detail == {}
    assert [r.engine for r in verify_samples(profiles, samples, ["e1", "e0"])] == ["e1", "e0"]
    e0 = profiles.engines["e0"]
    one = verdict(
        {**profiles.engines, "e0": attrs.evolve(e0, ttft=attrs.evolve(e0.ttft, mean_error=0.05))}
    )
    assert one.line() == (
        "FAIL gate_f.samples e0: engine e0: profiles.json does not match its samples: $.ttft.mean_error "
        f"is 0.05 in profiles.json, the samples give {e0.ttft.mean_error!r}; re-profile it "
        "(measured differs; limit profiles.json as its raw samples give it)"
    )
    assert one.detail == {
        "differences": [
            {"path": "$.ttft.mean_error", "profiles": 0.05, "samples": e0.ttft.mean_error}
        ]
    }
    ttft = attrs.evolve(e0.ttft, a=1.0, b=1.0, c=1.0, mean_error=0.05)
    four = verdict({**profiles.engines, "e0": attrs.evolve(e0, ttft=ttft)})
    assert four.message.endswith(" (and 1 more); re-profile it")
    assert four.message.count(" in profiles.json, the samples give ") == 3
    assert four.message.count("; $.ttft.") == 2  # the differences shown, one after another
    assert [d["path"] for d in four.detail["differences"]] == [
        "$.ttft.a",
        "$.ttft.b",
        "$.ttft.c",
        "$.ttft.mean_error",
    ]
    three = verdict(
        {
            **profiles.engines,
            "e0": attrs.evolve(e0, ttft=attrs.evolve(ttft, mean_error=e0.ttft.mean_error)),
        }
    )
    assert (
        three.message.count(" in profiles.json, the samples give ") == 3
        and "more)" not in three.message
    )

    absent = verdict(edit=lambda doc: doc["engines"].pop("e0"))
    assert absent.message == "engine e0: the samples sidecar holds no entry for it; re-profile it"
    assert (absent.ok, absent.measured, absent.detail) == (False, "differs", {})
    not_a_mapping = verify_samples(
        profiles, samples | {"engines": [samples["engines"]["e0"]]}, ["e0"]
    )
    assert not_a_mapping[0].message == absent.message
    failed = verdict(edit=lambda doc: doc["engines"]["e0"].update(status="failed"))
    assert (
        failed.message
        == "engine e0: its samples entry has status 'failed', not 'ok'; re-profile it"
    )
    unmarked = verdict(edit=lambda doc: doc["engines"]["e0"].pop("status"))
    assert (
        unmarked.message == "engine e0: its samples entry has status None, not 'ok'; re-profile it"
    )
    empty = verdict(edit=lambda doc: doc["engines"]["e0"]["prefill"].update(repeats=[]))
    assert empty.message.startswith("engine e0: its samples give no profile: ")
    assert empty.message.endswith(f" (at {empty.detail['path']} in the sidecar); re-profile it")
    assert empty.detail["path"].startswith("$.engines.e0.prefill")


def test_a_sweep_must_have_run_on_the_process_it_claims(tmp_path: Path) -> None:
    path = pair(tmp_path)
    profiles = gate_f(config_for(path), LIVE).profiles
    assert profiles is not None
    samples = json.loads(path.with_name("profiles.samples.json").read_text())

    def message(clock: Any) -> str:
        doc = json.loads(json.dumps(samples))
        doc["engines"]["e0"]["wall_clock"] = clock
        return verify_samples(profiles, doc, ["e0"])[0].message

    ok = "engine e0's profile is what its raw samples give"
    # Up to a minute of clock skew between hosts is allowed, not more.
    assert message({"started_at": BORN - 60, "finished_at": BORN}) == ok
    assert message({"started_at": BORN - 61, "finished_at": BORN}) == (
        "engine e0: the sweep started at 1717999939 (Unix time), before the engine process it "
        "claims to measure started (1718000000): the identity is not the one measured; re-profile it"
    )
    unrecorded = (
        "engine e0: its samples do not record when the sweep ran (wall_clock); re-profile it"
    )
    assert message(None) == unrecorded
    assert message({"started_at": BORN}) == unrecorded
    assert message({"finished_at": BORN}) == unrecorded
    assert message({"started_at": "yesterday", "finished_at": BORN}) == unrecorded


# ------------------------------------------------------------------------ fit limits


def band(value: float) -> CoefficientBand:
    return CoefficientBand(value=value, low=value * 0.5, high=value * 1.5)


def uncertainty(**changes: Any) -> Uncertainty:
    fields: dict[str, Any] = {
        "level": 0.9, "resamples": 100, "coefficients": {"a": band(0.02), "b": band(5e-5)},
        "upper_factor": 1.25, "worst_half_width": 0.1, "mean_half_width": 0.05, "min_samples": 3,
    }  # fmt: skip
    return Uncertainty(**(fields | changes))


def profiled(
    name: str = "e0", *, ttft: dict[str, Any] | None = None, decode: dict[str, Any] | None = None,
    no_decode: bool = False, **kwargs: Any
) -> EngineProfile:  # fmt: skip
    p = sim_profile(name, LIVE.get(name, LIVE["e0"]), **kwargs)
    t = attrs.evolve(p.ttft, **({"loo_mean_error": 0.02, "loo_worst_error": 0.04,
                                 "uncertainty": uncertainty()} | (ttft or {})))  # fmt: skip
    assert p.decode is not None
    d = attrs.evolve(p.decode, **({"uncertainty": uncertainty(coefficients={"c0": band(0.005)})}
                                  | (decode or {})))  # fmt: skip
    return attrs.evolve(p, ttft=t, decode=None if no_decode else d)


def limits_of(*profiles: EngineProfile, config: FleetConfig | None = None,
              samples: Any = None) -> list[CheckResult]:  # fmt: skip
    doc = Profiles(
        schema_version=SCHEMA_VERSION, created_at="now", software={},
        samples=SamplesRef(path="profiles.samples.json", sha256="0"),
        engines={p.name: p for p in profiles},
    )  # fmt: skip
    return check_fit_limits(config or config_for(None), doc, samples)


def test_every_fit_limit_is_shown_with_its_figure_and_limit() -> None:
    results = limits_of(profiled())
    assert [r.engine for r in results] == ["e0"] * len(results)
    assert lines(results) == [
        "ok   prefill.mean_error e0: engine e0's TTFT fit mean error 1.00% within the prefill bound "
        "20.00% (measured 0.01; limit 0.2)",
        "ok   prefill.worst_error e0: engine e0's TTFT fit worst-point error 2.00% within the prefill "
        "bound 50.00% (measured 0.02; limit 0.5)",
        "ok   prefill.loo_mean_error e0: engine e0's leave-one-length-out TTFT mean error 2.00% within "
        "the prefill bound 20.00% (measured 0.02; limit 0.2)",
        "ok   prefill.loo_worst_error e0: engine e0's leave-one-length-out TTFT worst error 4.00% "
        "within the prefill bound 50.00% (measured 0.04; limit 0.5)",
        "ok   prefill.interval_samples e0: engine e0's TTFT curve rests on at least 3 repeat(s) per "
        "length (measured 3; limit 3)",
        "ok   prefill.interval e0: engine e0's mean TTFT prediction interval (90%, relative "
        "half-width; coefficients a 0.02 [0.01, 0.03], b 5e-05 [2.5e-05, 7.5e-05]) 5.00% within "
        "the prefill mean-error bound 20.00% (measured 0.05; limit 0.2)",
        "ok   prefill.interval_worst e0: engine e0's widest TTFT prediction interval (90%, relative "
        "half-width; coefficients a 0.02 [0.01, 0.03], b 5e-05 [2.5e-05, 7.5e-05]) 10.00% within "
        "the prefill worst-point bound 50.00% (measured 0.1; limit 0.5)",
        "ok   decode.points.active e0: engine e0's decode sweep measured 2 distinct active value(s) "
        "(domain); at least 2 are needed (measured 2; limit 2)",
        "ok   decode.points.kv_tokens e0: engine e0's decode sweep measured 2 distinct kv_tokens "
        "value(s) (domain); at least 2 are needed (measured 2; limit 2)",
        "ok   decode.fit_mape e0: engine e0's decode fit MAPE 1.00% within "
        "profiles.max_decode_fit_mape 5.00% (measured 0.01; limit 0.05)",
        "ok   decode.cv_mape e0: engine e0's leave-one-cell-out decode MAPE 2.00% within "
        "profiles.max_decode_cv_mape 13.00% (measured 0.02; limit 0.13)",
        "ok   decode.interval e0: engine e0's mean TPOT prediction interval (90%, relative "
        "half-width; coefficients c0 0.005 [0.0025, 0.0075]) 5.00% within "
        "profiles.max_decode_cv_mape 13.00% (measured 0.05; limit 0.13)",
    ]
    interval = named(results, "prefill.interval")
    assert interval.detail == {
        "coefficients": {"a": attrs.asdict(band(0.02)), "b": attrs.asdict(band(5e-5))},
        "upper_factor": 1.25,
    }  # fmt: skip
    assert named(results, "decode.points.active").detail == {"counted_from": "domain"}
    assert all(r.detail == {} for r in results if r.name.endswith(("_error", "_mape", "samples")))


def test_a_cached_prefix_model_is_held_to_the_prefill_bounds() -> None:
    cached = CachedPrefill(
        a=0.02, b=5e-5, c=0.0, d=1e-6, cells=6, min_length=128, max_length=1024, max_cached=512,
        block_size=16, mean_error=0.03, worst_error=0.06, loo_mean_error=0.07, loo_worst_error=0.11,
        uncertainty=uncertainty(coefficients={"d": band(1e-6)}, mean_half_width=0.08,
                                worst_half_width=0.12, min_samples=4),
    )  # fmt: skip
    results = limits_of(attrs.evolve(profiled(no_decode=True), cached_prefill=cached),
                        config=config_for(None, engine("e0", 8101, roles=["prefill"]),
                                          engine("e1", 8102, roles=["decode"])))  # fmt: skip
    assert [r.name for r in results][:7] == [
        "prefill.mean_error", "prefill.worst_error", "prefill.loo_mean_error",
        "prefill.loo_worst_error", "prefill.interval_samples", "prefill.interval",
        "prefill.interval_worst",
    ]  # fmt: skip
    assert lines(results[7:]) == [
        "ok   prefix.mean_error e0: engine e0's cached-prefix fit mean error 3.00% within the "
        "prefill bound 20.00% (measured 0.03; limit 0.2)",
        "ok   prefix.worst_error e0: engine e0's cached-prefix fit worst-cell error 6.00% within "
        "the prefill bound 50.00% (measured 0.06; limit 0.5)",
        "ok   prefix.loo_mean_error e0: engine e0's leave-one-cell-out cached-prefix mean error "
        "7.00% within the prefill bound 20.00% (measured 0.07; limit 0.2)",
        "ok   prefix.loo_worst_error e0: engine e0's leave-one-cell-out cached-prefix worst error "
        "11.00% within the prefill bound 50.00% (measured 0.11; limit 0.5)",
        "ok   prefix.interval_samples e0: engine e0's cached-prefix TTFT model rests on at least 4 "
        "repeat(s) per cell (measured 4; limit 3)",
        "ok   prefix.interval e0: engine e0's mean cached-prefix TTFT prediction interval (90%, "
        "relative half-width; coefficients d 1e-06 [5e-07, 1.5e-06]) 8.00% within the prefill "
        "mean-error bound 20.00% (measured 0.08; limit 0.2)",
        "ok   prefix.interval_worst e0: engine e0's widest cached-prefix TTFT prediction interval "
        "(90%, relative half-width; coefficients d 1e-06 [5e-07, 1.5e-06]) 12.00% within the "
        "prefill worst-point bound 50.00% (measured 0.12; limit 0.5)",
    ]


@pytest.mark.parametrize(
    ("ttft", "decode", "limits", "name", "measured", "limit"),
    [
        ({"mean_error": 0.2001}, {}, {}, "prefill.mean_error", 0.2001, 0.2),
        ({"worst_error": 0.5001}, {}, {}, "prefill.worst_error", 0.5001, 0.5),
        ({"loo_mean_error": 0.2001}, {}, {}, "prefill.loo_mean_error", 0.2001, 0.2),
        ({"loo_worst_error": 0.5001}, {}, {}, "prefill.loo_worst_error", 0.5001, 0.5),
        ({"uncertainty": uncertainty(mean_half_width=0.2001)}, {}, {}, "prefill.interval", 0.2001, 0.2),
        ({"uncertainty": uncertainty(worst_half_width=0.5001)}, {}, {}, "prefill.interval_worst", 0.5001, 0.5),
        ({}, {"fit_mape": 0.0501}, {}, "decode.fit_mape", 0.0501, 0.05),
        ({}, {"fit_mape": 0.0301}, {"max_decode_fit_mape": 0.03}, "decode.fit_mape", 0.0301, 0.03),
        ({}, {"cv_mape": 0.1301}, {}, "decode.cv_mape", 0.1301, 0.13),
        ({}, {"cv_mape": 0.0801}, {"max_decode_cv_mape": 0.08}, "decode.cv_mape", 0.0801, 0.08),
        ({}, {"uncertainty": uncertainty(mean_half_width=0.1301)}, {}, "decode.interval", 0.1301, 0.13),
        # Without a mean, the widest interval stands for it.
        ({}, {"uncertainty": uncertainty(mean_half_width=None, worst_half_width=0.1301)}, {},
         "decode.interval", 0.1301, 0.13),
    ],
)  # fmt: skip
def test_each_limit_holds_at_its_value_and_fails_just_above_it(
    ttft: dict[str, Any], decode: dict[str, Any], limits: dict[str, float], name: str,
    measured: float, limit: float,
) -> None:  # fmt: skip
    config = config_for(None, **limits)
    results = limits_of(profiled(ttft=ttft, decode=decode), config=config)
    assert [r.name for r in results if not r.ok] == [name], lines(results)
    failure = named(results, name)
    assert (failure.measured, failure.limit) == (measured, limit)
    assert f" {measured:.2%} exceeds " in failure.message and failure.message.endswith(
        f" {limit:.2%}"
    )
    # At the limit itself, the figure passes.
    at = {k: (v if not isinstance(v, float) else limit) for k, v in (ttft | decode).items()}
    for key, value in (ttft | decode).items():
        if isinstance(value, Uncertainty):
            edge = {f: limit for f in ("mean_half_width", "worst_half_width")
                    if getattr(value, f) is not None and getattr(value, f) > limit}  # fmt: skip
            at[key] = attrs.evolve(value, **edge)
    ttft_at = {k: v for k, v in at.items() if k in ttft}
    decode_at = {k: v for k, v in at.items() if k in decode}
    passed = limits_of(profiled(ttft=ttft_at, decode=decode_at), config=config)
    assert all(r.ok for r in passed), lines(passed)
    assert " within " in named(passed, name).message


def test_figures_an_earlier_profiler_did_not_write_are_missing_not_passed() -> None:
    missing = "profile has no {} (written by an earlier profiler); re-profile it (measured null; limit measured)"
    for ttft in ({"loo_mean_error": None}, {"loo_worst_error": None}):
        results = limits_of(profiled(ttft=ttft))
        assert [r.line() for r in results if not r.ok] == [
            "FAIL prefill.loo_error e0: engine e0's " + missing.format("leave-one-length-out error")
        ]
        # The in-sample bounds still apply, word for word.
        assert lines(results)[:3] == [
            "ok   prefill.mean_error e0: engine e0's TTFT fit mean error 1.00% within the prefill "
            "bound 20.00% (measured 0.01; limit 0.2)",
            "ok   prefill.worst_error e0: engine e0's TTFT fit worst-point error 2.00% within the "
            "prefill bound 50.00% (measured 0.02; limit 0.5)",
            "FAIL prefill.loo_error e0: engine e0's " + missing.format("leave-one-length-out error"),
        ]
        assert not [
            r
            for r in results
            if r.name.startswith("prefill.loo_") and r.name != "prefill.loo_error"
        ]
    for u in (None, uncertainty(mean_half_width=None), uncertainty(min_samples=None)):
        results = limits_of(profiled(ttft={"uncertainty": u}))
        assert [r.line() for r in results if not r.ok] == [
            "FAIL prefill.interval e0: engine e0's " + missing.format("TTFT intervals")
        ]
        assert all(r.ok is False for r in results if not r.ok)  # false in the JSON, not null
        assert [r.name for r in results if r.name.startswith("prefill.interval")] == [
            "prefill.interval"
        ]
    results = limits_of(profiled(decode={"uncertainty": None}))
    assert [r.line() for r in results if not r.ok] == [
        "FAIL decode.interval e0: engine e0's " + missing.format("TPOT intervals")
    ]


def test_too_few_repeats_per_length_fail_the_interval_samples() -> None:
    results = limits_of(profiled(ttft={"uncertainty": uncertainty(min_samples=2)}))
    assert [r.line() for r in results if not r.ok] == [
        "FAIL prefill.interval_samples e0: engine e0's TTFT curve rests on at least 2 repeat(s) per "
        "length, fewer than the 3 an interval needs; re-profile it with more --repeats (measured 2; limit 3)"
    ]


def test_decode_figures_apply_to_engines_that_may_decode() -> None:
    # The prefill-only engine first: the engines after it are still checked.
    config = config_for(None, engine("p0", 8103, roles=("prefill",)), engine("e0", 8101))
    results = limits_of(
        profiled("e0", no_decode=True), profiled("p0", no_decode=True), config=config
    )
    assert [r.line() for r in results if not r.ok] == [
        "FAIL decode.profile e0: engine e0 may decode in this fleet but was profiled for prefill "
        "only; re-profile it with its decode role (measured prefill only; limit a decode model)"
    ]
    assert [r.name for r in results if r.engine == "e0"][-1] == "decode.profile"
    assert named(results, "decode.profile").ok is False
    assert not [r for r in results if r.engine == "p0" and r.name.startswith("decode.")]
    assert len([r for r in results if r.engine == "p0"]) == 7  # the prefill figures alone
    # An engine the pair has no profile for is Gate F's failure, not the fit limits'.
    assert {r.engine for r in limits_of(profiled("e0"), config=config)} == {"e0"}
    # After an engine profiled for prefill only, the next decoding engine's figures follow.
    config = config_for(None, engine("e0", 8101), engine("e1", 8102))
    results = limits_of(profiled("e0", no_decode=True), profiled("e1"), config=config)
    assert [r.name for r in results if r.engine == "e1"][-1] == "decode.interval"
    assert [r.engine for r in results if not r.ok] == ["e0"]


def test_decode_axes_are_counted_from_the_samples_else_from_the_domain() -> None:
    flat = profiled(active=(8.0, 8.0), kv_tokens=(100.0, 200_000.0))
    results = limits_of(flat)
    assert [r.line() for r in results if not r.ok] == [
        "FAIL decode.points.active e0: engine e0's decode sweep measured 1 distinct active value(s) "
        "(domain); at least 2 are needed; extend --decode-concurrency / --decode-input-lens "
        "(measured 1; limit 2)"
    ]
    flat_kv = limits_of(profiled(active=(1.0, 8.0), kv_tokens=(500.0, 500.0)))
    assert [(r.name, r.measured) for r in flat_kv if not r.ok] == [("decode.points.kv_tokens", 1)]
    cells = [{"active": 1, "kv_tokens": 100}, {"active": 4, "kv_tokens": 100},
             {"active": 16.0, "kv_tokens": 100}, {"active": "many", "kv_tokens": None}]  # fmt: skip
    samples = {"engines": {"e0": {"decode": {"cell_medians": cells}}}}
    counted = limits_of(flat, samples=samples)
    active, kv = named(counted, "decode.points.active"), named(counted, "decode.points.kv_tokens")
    assert (active.ok, active.measured, active.detail) == (True, 3, {"counted_from": "samples"})
    assert (kv.ok, kv.measured) == (False, 1)
    assert kv.message == ("engine e0's decode sweep measured 1 distinct kv_tokens value(s) (samples); at "
                          "least 2 are needed; extend --decode-concurrency / --decode-input-lens")  # fmt: skip
    # Samples without kept cells fall back to the domain.
    for decode in ({"cell_medians": []}, {"cell_medians": [1, 2]}, {}, None):
        fallback = limits_of(flat, samples={"engines": {"e0": {"decode": decode}}})
        assert named(fallback, "decode.points.active").detail == {"counted_from": "domain"}


def test_the_fit_limit_may_not_exceed_the_movement_margin() -> None:
    at = parse_fleet(fleet_doc(controller={"reactive": {"movement_margin": 0.05}},
                               profiles={"max_decode_fit_mape": 0.05}))  # fmt: skip
    result = check_margin(at)
    assert result.line() == (
        "ok   fit_limit fleet: profiles.max_decode_fit_mape 0.05 is within "
        "controller.reactive.movement_margin 0.05 (measured 0.05; limit 0.05)"
    )
    object.__setattr__(at, "profiles", attrs.evolve(at.profiles, max_decode_fit_mape=0.0501))
    assert check_margin(at).line() == (
        "FAIL fit_limit fleet: profiles.max_decode_fit_mape 0.0501 exceeds "
        "controller.reactive.movement_margin 0.05; a move could be priced on fit error alone "
        "(measured 0.0501; limit 0.05)"
    )


# ----------------------------------------------------------- contract and generations


def test_the_engine_contract_pins_each_field_it_names() -> None:
    contract = {"version": "0.32.0", "model": "other-model", "max_model_len": 4096,
                "connector": "LMCacheConnectorV1"}  # fmt: skip
    config = parse_fleet(fleet_doc(engine_contract=contract))
    results = check_contract(config, {"e0": LIVE["e0"], "e1": None})
    assert lines(results) == [
        "ok   contract.version e0: engine e0 reports version '0.32.0' (measured 0.32.0; limit 0.32.0)",
        "FAIL contract.model e0: engine e0 reports model 'sim-llama', engine_contract.model pins "
        "'other-model' (measured sim-llama; limit other-model)",
        "ok   contract.max_model_len e0: engine e0 reports max_model_len 4096 (measured 4096; limit 4096)",
        "FAIL contract.connector e0: engine e0 configures connector 'NixlConnector', "
        "engine_contract.connector pins 'LMCacheConnectorV1' (measured NixlConnector; limit LMCacheConnectorV1)",
        "FAIL contract.version e1: engine e1 is unreachable; its version is unknown (measured null; limit 0.32.0)",
        "FAIL contract.model e1: engine e1 is unreachable; its model is unknown (measured null; limit other-model)",
        "FAIL contract.max_model_len e1: engine e1 is unreachable; its max_model_len is unknown "
        "(measured null; limit 4096)",
        # The connector is the fleet document's, known without the engine.
        "FAIL contract.connector e1: engine e1 configures connector 'NixlConnector', "
        "engine_contract.connector pins 'LMCacheConnectorV1' (measured NixlConnector; limit LMCacheConnectorV1)",
    ]
    only_version = parse_fleet(fleet_doc(engine_contract={"version": "0.33.0"}))
    assert [(r.name, r.engine, r.ok) for r in check_contract(only_version, LIVE)] == [
        ("contract.version", "e0", False), ("contract.version", "e1", False)
    ]  # fmt: skip
    assert check_contract(parse_fleet(fleet_doc()), LIVE) == []
    # A lone engine decodes its own prefills: no connector, which a pinned one fails.
    lone = engine("e0", 8101)
    del lone["connector"]
    results = check_contract(
        parse_fleet(fleet_doc(lone, engine_contract={"connector": "NixlConnector"})), LIVE
    )
    assert [(r.engine, r.ok, r.measured) for r in results] == [("e0", False, None)]
    assert results[0].message == (
        "engine e0 configures connector None, engine_contract.connector pins 'NixlConnector'"
    )


def test_a_generation_is_stable_only_when_every_field_is_unchanged() -> None:
    moved = attrs.evolve(LIVE["e1"], version="0.33.0")
    results = check_stable(
        {"gone": None, "e0": LIVE["e0"], "e1": LIVE["e1"]}, {"e0": LIVE["e0"], "e1": moved}
    )
    assert [(r.engine, r.ok) for r in results] == [("e0", True), ("e1", False)]
    # Same start time, other version: still another process image, reported with its start.
    assert results[1].message == (
        "engine e1 restarted or went away during the check "
        "(started 2024-06-10 06:13:20 UTC -> 2024-06-10 06:13:20 UTC)"
    )
    assert results[1].detail == {"process_start_time": [BORN, BORN]}
    assert (results[0].measured, results[0].limit) == (
        "2024-06-10 06:13:20 UTC",
        "2024-06-10 06:13:20 UTC",
    )
    vanished = check_stable({"e0": LIVE["e0"]}, {})
    assert (vanished[0].ok, vanished[0].measured, vanished[0].detail) == (
        False, None, {"process_start_time": [BORN, None]}
    )  # fmt: skip


# ------------------------------------------------------------ a refit's original pair


def refit_profiles(refit_of: str | None) -> Profiles:
    return Profiles(schema_version=SCHEMA_VERSION, created_at="2024-06-10T06:13:20+00:00",
                    software={}, samples=SamplesRef(path="refit.samples.json", sha256="0" * 64),
                    engines={}, refit_of=refit_of)  # fmt: skip


def test_a_refit_is_traced_to_the_original_pair_it_was_made_from(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    original = old / "run1.samples.json"
    original.write_text(json.dumps({"profiles": "fleet-profiles.json"}))
    (old / "fleet-profiles.json").write_text("{}")
    refit_samples = new / "refit.samples.json"

    def refit_pair(made_from: Any) -> ProfilePair:
        refit_samples.write_text(json.dumps(made_from))
        return ProfilePair(profiles=str(new / "refit.json"), samples=str(refit_samples))

    def refused(refit_of: str, made_from: Any) -> Any:
        with pytest.raises(ConfigError) as info:
            find_refit_original(refit_profiles(refit_of), refit_pair(made_from))
        return info.value

    made_from = {"refit": {"sha256": file_sha256(original)}}
    assert find_refit_original(refit_profiles(None), refit_pair(made_from)) is None
    found = find_refit_original(refit_profiles(str(original)), refit_pair(made_from))
    assert found == ProfilePair(
        profiles=str(old / "fleet-profiles.json"),
        samples=str(original),
        profiles_sha256=file_sha256(old / "fleet-profiles.json"),
        samples_sha256=file_sha256(original),
    )
    # Not where the refit was given it, but beside the refit pair (a moved deployment).
    beside = new / "run1.samples.json"
    beside.write_bytes(original.read_bytes())
    (new / "fleet-profiles.json").write_text("{}")
    moved = find_refit_original(refit_profiles("gone/run1.samples.json"), refit_pair(made_from))
    assert moved is not None and (moved.samples, moved.profiles) == (
        str(beside),
        str(new / "fleet-profiles.json"),
    )
    # The path as given comes first.
    given_first = find_refit_original(refit_profiles(str(original)), refit_pair(made_from))
    assert given_first is not None and given_first.samples == str(original)
    # A refit that recorded no SHA-256 (an earlier profiler) takes the sidecar found.
    assert find_refit_original(refit_profiles(str(original)), refit_pair({})) == found
    assert find_refit_original(refit_profiles(str(original)), refit_pair([])) == found
    assert find_refit_original(refit_profiles(str(original)), refit_pair({"refit": "x"})) == found

    missing = refused("gone/lost.samples.json", made_from)
    assert (missing.reason, missing.path, missing.source) == (
        "the refit's original samples gone/lost.samples.json are not found "
        f"(looked at gone/lost.samples.json, {new / 'lost.samples.json'})",
        "$.refit_of",
        str(new / "refit.json"),
    )
    once = refused(str(new / "lost.samples.json"), made_from)
    assert once.reason.endswith(f"(looked at {new / 'lost.samples.json'})")

    other = refused(str(original), {"refit": {"sha256": "f" * 64}})
    assert (other.reason, other.path, other.source) == (
        f"{original} is not the sidecar the refit was made from (SHA-256 differs)",
        "$.refit.sha256",
        str(refit_samples),
    )

    refit_samples.write_text("{")
    with pytest.raises(ConfigError) as info:
        find_refit_original(
            refit_profiles(str(original)),
            ProfilePair(profiles=str(new / "refit.json"), samples=str(refit_samples)),
        )
    unreadable = info.value
    assert unreadable.reason.startswith("samples file is not valid JSON: ")
    assert unreadable.source == str(refit_samples)
    broken = old / "broken.samples.json"
    broken.write_text("{")
    bad = refused(str(broken), {})
    assert bad.reason.startswith("samples file is not valid JSON: ") and bad.source == str(broken)

    # A sidecar that does not name its profiles file: the one of its own name.
    unnamed = old / "run2.samples.json"
    unnamed.write_text(json.dumps({"profiles": 7}))
    (old / "run2.json").write_text("{}")
    assert find_refit_original(refit_profiles(str(unnamed)), refit_pair({})) == ProfilePair(
        profiles=str(old / "run2.json"),
        samples=str(unnamed),
        profiles_sha256=file_sha256(old / "run2.json"),
        samples_sha256=file_sha256(unnamed),
    )
    listed = old / "run3.samples.json"
    listed.write_text(json.dumps([{"profiles": "fleet-profiles.json"}]))
    (old / "run3.json").write_text("{}")
    assert find_refit_original(refit_profiles(str(listed)), refit_pair({})).profiles == str(
        old / "run3.json"
    )
    (old / "run3.json").unlink()
    gone = refused(str(listed), {})
    assert (gone.reason, gone.path, gone.source) == (
        f"the refit's original profiles file {old / 'run3.json'} is not found",
        "$.refit_of",
        str(new / "refit.json"),
    )
