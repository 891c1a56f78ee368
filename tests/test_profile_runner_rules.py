"""One profiling run's rules, with the smallest sweeps a simulated engine allows (about a
second each): the settings' validation, engine selection, the output paths, the pair
and the sidecar's layout, each warning, rejection and failure, and merging a
re-profiled engine into an existing pair."""

from __future__ import annotations

import io
import json
import re
import socket
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from narwhal import __version__
from narwhal.config import ProfilesConfig, converter
from narwhal.engines.client import EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile import ProfileSettings, Progress, load_profiles, run_profile
from narwhal.profile.derive import (
    decode_cells,
    derive_cached,
    derive_decode,
    derive_ttft,
    prefill_repeats,
    prefix_repeats,
)
from narwhal.profile.runner import (
    SWEEP_CLOCK,
    EngineOutcome,
    ProfileRun,
    _clients,
    _excluded,
    calibration_problem,
    check_output,
    decode_fit_warnings,
    select_engines,
    software_identity,
    sweep_clock,
    sweep_settings,
    write_pair,
)
from narwhal.profile.store import SAMPLES_KIND, SCHEMA_VERSION, file_sha256, pair_paths
from narwhal.testing import open_sim_fleet
from tests.checkkit import sim_profile
from tests.profilekit import MetricsRewrite, RewriteStreams, Wrapper, engine, fleet

TINY: dict[str, Any] = {"prefill_lens": (16, 32, 64, 128), "decode_input_lens": (16, 32),
                        "decode_concurrency": (1, 2, 3), "repeats": 3, "warmup": 0,
                        "decode_tokens": 4, "min_window_steps": 2, "seed": 11,
                        "prefix_fractions": ()}  # fmt: skip


def tiny(out: Path, **changes: Any) -> ProfileSettings:
    return ProfileSettings(**(TINY | {"out": str(out / "profiles.json")} | changes))


async def profile(config: Any, s: ProfileSettings,
                  wrap: Any = None) -> tuple[ProfileRun, dict[str, Any], list[str]]:  # fmt: skip
    out = io.StringIO()
    async with open_sim_fleet(config) as sim:
        transport = wrap(sim.transport) if wrap is not None else sim.transport
        with trio.fail_after(3600):
            run = await run_profile(config, s, transport=transport,
                                    progress=Progress(out, tty=False), config_source="f.json")  # fmt: skip
    return run, json.loads(run.samples_path.read_text()), out.getvalue().splitlines()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prefill_lens": (16, 32, 64, 64)}, "prefill-lens needs at least 4 distinct values"),
        ({"prefill_lens": (3, 32, 64, 128)}, "prefill-lens values must be at least 4"),
        ({"decode_input_lens": (16, 16)}, "decode-input-lens needs at least 2 distinct values"),
        ({"decode_input_lens": (3, 16)}, "decode-input-lens values must be at least 4"),
        ({"decode_concurrency": (2,)}, "decode-concurrency needs at least 2 distinct values"),
        ({"decode_concurrency": (0, 2)}, "decode-concurrency values must be at least 1"),
        ({"repeats": 0}, "repeats must be at least 1"),
        ({"warmup": -1}, "warmup must be at least 0"),
        ({"decode_tokens": 1}, "decode-tokens must be at least 2"),
        ({"min_window_steps": 0}, "min-window-steps must be at least 1"),
        ({"prefix_fractions": (0.5, 1.0)}, "prefix-fractions values must lie strictly between 0 and 1"),
        ({"prefix_fractions": (0.0,)}, "prefix-fractions values must lie strictly between 0 and 1"),
    ],
)
def test_settings_refuse_what_cannot_be_swept(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        ProfileSettings(**(TINY | changes))
    assert str(info.value) == message


def test_the_least_settings_are_accepted() -> None:
    s = ProfileSettings(**(TINY | {"prefill_lens": [4, 5, 6, 7], "decode_input_lens": [4, 5],
                                   "decode_concurrency": [1, 2], "repeats": 1, "warmup": 0,
                                   "decode_tokens": 2, "min_window_steps": 1,
                                   "prefix_fractions": [0.001, 0.999]}))  # fmt: skip
    assert s.prefill_lens == (4, 5, 6, 7) and s.decode_concurrency == (1, 2)
    assert s.prefix_fractions == (0.001, 0.999)
    assert ProfileSettings(prefill_lens=(4, 5, 6, 7), decode_input_lens=(4, 5),
                           decode_concurrency=(1, 2)).prefix_fractions == (0.25, 0.5, 0.875)  # fmt: skip


def test_an_outcome_succeeds_when_ok_or_accepted() -> None:
    assert EngineOutcome("e0", "ok").success
    assert not EngineOutcome("e0", "rejected").success
    assert not EngineOutcome("e0", "ok", accepted=False).success
    assert EngineOutcome("e0", "rejected", accepted=True).success
    ok, bad = EngineOutcome("e0", "ok"), EngineOutcome("e1", "failed")
    assert ProfileRun(Path("p"), Path("s"), (ok, ok)).ok
    assert not ProfileRun(Path("p"), Path("s"), (ok, bad)).ok
    assert ProfileRun(Path("p"), Path("s"), ()).ok


def test_the_software_identity_names_the_numbers_libraries() -> None:
    ident = software_identity()
    assert list(ident) == ["narwhal", "python", "numpy", "scipy", "trio", "httpx"]
    assert ident["narwhal"] == __version__ and ident["trio"] == trio.__version__
    assert ident["httpx"] == httpx.__version__


def test_engines_are_selected_in_fleet_order() -> None:
    config = fleet(engine("e0", 8101), engine("e1", 8102), engine("e2", 8103))
    assert [e.name for e in select_engines(config, None)] == ["e0", "e1", "e2"]
    assert [e.name for e in select_engines(config, ["e2", "e0"])] == ["e0", "e2"]
    with pytest.raises(ConfigError) as info:
        select_engines(config, ["e1", "x9"])
    assert (info.value.reason, info.value.path) == (
        "no engine named 'x9' in the fleet (engines: e0, e1, e2)", "$.engines")  # fmt: skip


def test_an_existing_pair_is_refused_unless_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    assert check_output(out, overwrite=False) == (out, tmp_path / "p.samples.json")
    (tmp_path / "p.samples.json").write_text("{}")
    with pytest.raises(ConfigError) as info:
        check_output(out, overwrite=False)
    assert info.value.reason == (f"{tmp_path / 'p.samples.json'} already exist; pass --overwrite "
                                 "to write a new pair")  # fmt: skip
    out.write_text("{}")
    with pytest.raises(ConfigError, match=f"^{out} and {tmp_path / 'p.samples.json'} already exist"):
        check_output(out, overwrite=False)
    assert check_output(out, overwrite=True) == (out, tmp_path / "p.samples.json")


async def test_the_sweep_clock_is_the_wall_clock_advanced_by_the_runs_clock(
    autojump_clock: trio.abc.Clock,
) -> None:
    await trio.sleep(500)  # the run's clock is not at 0 when the wall clock is first read
    first = sweep_clock()
    assert abs(first - time.time()) < 60
    await trio.sleep(1000)
    assert sweep_clock() == pytest.approx(first + 1000)


async def test_clients_share_a_given_transport_or_own_their_connections() -> None:
    e0_doc = engine("e0", 8101) | {"model": "m0", "api_key": "k0"}
    e0_doc["sim"]["model"] = "m0"
    config = fleet(e0_doc, engine("e1", 8102),
                   engine={"connect_timeout_s": 2.5})  # fmt: skip
    given = httpx.MockTransport(lambda request: httpx.Response(599))
    async with AsyncExitStack() as stack:
        shared = _clients(stack, config, config.engines, given)
        own = _clients(stack, config, config.engines[1:], None)
        assert list(shared) == ["e0", "e1"] and list(own) == ["e1"]
        e0 = shared["e0"]
        assert (e0.name, e0.url, e0.model, e0._api_key) == ("e0", "http://e0.test:8101", "m0", "k0")
        assert e0.connector == config.engines[0].connector and e0.connect_timeout_s == 2.5
        assert e0._http is shared["e1"]._http and not e0._owns_client
        assert e0._http.timeout == httpx.Timeout(None, connect=2.5)
        assert own["e1"]._owns_client and own["e1"].connect_timeout_s == 2.5
    assert own["e1"]._http.is_closed  # the run closes the clients it built
    assert not e0._http.is_closed  # and leaves the caller's transport to the caller


def test_the_recorded_sweep_settings_leave_out_where_it_was_written() -> None:
    s = ProfileSettings(**(TINY | {"engines": ("e0",), "out": "x.json", "overwrite": True}))
    got = sweep_settings(s, 99)
    where = ("out", "overwrite", "engines")
    assert got == {k: v for k, v in attrs.asdict(s).items() if k not in where} | {"seed": 99}


def test_the_pair_names_its_sidecar_and_its_excluded_engines(tmp_path: Path) -> None:
    profiles, samples = pair_paths(tmp_path / "p.json")
    doc = {"created_at": "2026-01-01T00:00:00+00:00", "engines": {}}
    e2 = sim_profile("e2", EngineIdentity(url="http://e2.test:8103", model="m", version="v",
                                          max_model_len=4096, process_start_time=1.0))  # fmt: skip
    wrote = write_pair(profiles, samples, doc, [EngineOutcome("e0", "rejected", "TTFT fit rejected"),
                                                EngineOutcome("e1", "failed", "died"),
                                                EngineOutcome("e2", "ok", None, e2)],
                       refit_of="old.samples.json")  # fmt: skip
    data = json.loads(profiles.read_text())
    assert wrote and json.loads(samples.read_text()) == doc
    assert data["samples"] == {"path": "p.samples.json", "sha256": file_sha256(samples)}
    assert data["created_at"] == doc["created_at"] and data["software"] == software_identity()
    assert data["excluded"] == {"e0": "rejected: TTFT fit rejected", "e1": "failed: died"}
    assert list(data["engines"]) == ["e2"] and data["refit_of"] == "old.samples.json"
    assert data["schema_version"] == SCHEMA_VERSION and data["kind"] == "narwhal.profiles"
    assert load_profiles(profiles).excluded == data["excluded"]


def test_a_pair_without_a_profile_is_only_its_samples(tmp_path: Path) -> None:
    # Nothing for serve or check to use: the samples say why; a profiles file is not
    # written, and one the samples were written over (an overwrite) is removed.
    profiles, samples = pair_paths(tmp_path / "p.json")
    profiles.write_text("{}")
    doc = {"created_at": "2026-01-01T00:00:00+00:00", "engines": {}}
    outcomes = [EngineOutcome("e0", "rejected", "TTFT fit rejected"), EngineOutcome("e1", "failed", "died")]
    assert write_pair(profiles, samples, doc, outcomes) is False
    assert json.loads(samples.read_text()) == doc and not profiles.exists()


async def test_a_run_records_every_step_and_writes_the_pair(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101, kv_capacity_tokens=50_000))
    run, doc, lines = await profile(config, tiny(tmp_path))
    assert run.ok and [o.status for o in run.outcomes] == ["ok"]
    assert run.profiles_path == tmp_path / "profiles.json"
    assert run.samples_path == tmp_path / "profiles.samples.json"
    assert doc["schema_version"] == SCHEMA_VERSION and doc["kind"] == SAMPLES_KIND
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", doc["created_at"])
    assert doc["fleet"] == {"source": "f.json", "engines": ["e0"]}
    assert doc["profiles"] == "profiles.json" and doc["software"] == software_identity()
    assert doc["sweep"] == json.loads(json.dumps(sweep_settings(tiny(tmp_path), 11) | {
        "clock": "seconds on the profiler's monotonic clock"}))  # fmt: skip
    assert "merged" not in doc
    e0 = doc["engines"]["e0"]
    assert list(e0)[:7] == ["name", "url", "roles", "status", "reason", "warnings", "sweep"]
    assert (e0["name"], e0["url"], e0["roles"]) == ("e0", "http://e0.test:8101", ["prefill", "decode"])
    assert (e0["status"], e0["reason"], e0["warnings"], e0["rejected_cells"]) == ("ok", None, [], [])
    # The run's seed plus the engine's place.
    assert e0["sweep"] == json.loads(json.dumps(sweep_settings(tiny(tmp_path), 12)))
    clock = e0["wall_clock"]
    assert clock["clock"] == SWEEP_CLOCK and clock["started_at"] < clock["finished_at"]
    assert e0["identity"] == e0["identity_after"] and e0["identity"]["model"] == "sim-llama"
    assert e0["engine"]["max_model_len"] == 4096 and e0["engine"]["kv_cache_size_tokens"] == 50_000
    assert e0["prefill"]["fit"]["model"] == "a + b*L + c*L^2" and "intervals" in e0["prefill"]
    assert "rejection" not in e0["prefill"]
    assert e0["prefix"] == {"skipped": "the engine does not report prefix caching enabled"}
    decode = e0["decode"]
    assert len(decode["cells"]) == 6 and len(decode["cell_medians"]) == 6
    assert decode["cell_medians"][0]["concurrency"] == 1 and "fit" in decode and "intervals" in decode
    assert e0["kv_capacity_inputs"] == {"tpot_target_s": config.controller.slo.tpot_s}
    assert e0["kv_capacity"]["source"] == "physical" and e0["kv_capacity"]["tokens"] == 50_000
    p = load_profiles(run.profiles_path)["e0"]
    assert converter.unstructure(p) == e0["profile"] == json.loads(
        run.profiles_path.read_text())["engines"]["e0"]  # fmt: skip
    assert p.decode is not None and p.decode.cells == 6
    assert run.outcomes[0].profile == p
    fit = e0["prefill"]["fit"] | e0["prefill"]["fit"]["coefficients"]
    assert lines[0] == "e0: engine 1/1 at http://e0.test:8101"
    assert lines[5] == (f"e0: prefill fit: TTFT = {fit['a']:.4g} + {fit['b']:.4g}*L + "
                        f"{fit['c']:.4g}*L^2 s (mean error {fit['mean_error']:.1%}, worst "
                        f"{fit['worst_error']:.1%}; leave-one-length-out mean "
                        f"{fit['loo_mean_error']:.1%}, worst {fit['loo_worst_error']:.1%})")  # fmt: skip
    dfit = decode["fit"]
    c = dfit["coefficients"]
    assert lines[-2] == (f"e0: decode fit: TPOT = {c['c0']:.4g} + {c['c1']:.4g}*active + "
                         f"{c['c2']:.4g}*kv s (fit MAPE {dfit['fit_mape']:.1%}, "
                         f"leave-one-cell-out {dfit['cv_mape']:.1%})")  # fmt: skip
    assert lines[-1] == "e0: profiled"


class _NoStartTime(MetricsRewrite):
    def line(self, text: str) -> str | None:
        return None if text.startswith("process_start_time_seconds") else text


class _NoKVSize(MetricsRewrite):
    def line(self, text: str) -> str | None:
        return text.replace('kv_cache_size_tokens="', 'other="')


async def test_each_warning_of_a_run_is_recorded_and_printed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101, prefix_caching=True),
                   controller={"slo": {"tpot_s": None}})  # fmt: skip
    s = tiny(tmp_path, decode_concurrency=(2, 3))
    _, doc, lines = await profile(config, s, lambda t: _NoKVSize(_NoStartTime(t)))
    e0 = doc["engines"]["e0"]
    assert e0["status"] == "ok" and e0["identity"]["process_start_time"] is None
    warnings = [
        "the engine exports no process_start_time_seconds (Prometheus multiprocess mode drops "
        "process_* metrics): its generation is unknown, and narwhal check will refuse to bind "
        "this profile to it",
        "the engine reports prefix caching enabled but its cached-prefix sweep was skipped (no "
        "--prefix-fractions): placement prices its hits from the TTFT curve alone",
        "decode concurrency 2,3: production calibration needs at least three concurrency points "
        "including 1 (the seed's rule)",
    ]
    assert e0["warnings"][:3] == warnings
    capacity = e0["kv_capacity"]
    assert capacity["source"] == "measured"
    assert e0["warnings"][3:] == [
        f"KV capacity unknown: the engine reports no kv_cache_size_tokens and no TPOT target "
        f"bounds it; {capacity['tokens']} tokens is only the largest resident KV measured "
        "(placement prices beyond it conservatively)"]  # fmt: skip
    assert [line for line in lines if ": warning: " in line] == [
        f"e0: warning: {w}" for w in e0["warnings"]]  # fmt: skip
    assert e0["prefix"] == {"skipped": "no --prefix-fractions"}


async def test_metrics_that_cannot_be_read_are_a_warning(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    class NoMetrics(Wrapper):
        """/metrics answers the identity read, then (the probe's read) 503."""

        calls = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/metrics":
                NoMetrics.calls += 1
                if NoMetrics.calls == 2:
                    return httpx.Response(503, text="no")
            return await self.inner.handle_async_request(request)

    config = fleet(engine("e0", 8101))
    _, doc, _ = await profile(config, tiny(tmp_path), NoMetrics)
    e0 = doc["engines"]["e0"]
    assert e0["engine"]["metrics_error"] is not None and e0["engine"]["prefix_caching"] is None
    assert e0["warnings"][0] == (f"/metrics unreadable ({e0['engine']['metrics_error']}); KV "
                                 "capacity and prefix caching unknown")  # fmt: skip


async def test_a_prefill_only_engine_gets_its_prefix_sweep_and_no_decode(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    p0 = engine("p0", 8102, prefix_caching=True) | {"roles": ["prefill"]}
    run, doc, lines = await profile(fleet(engine("e0", 8101), p0),
                                    tiny(tmp_path, prefix_fractions=(0.5,), engines=("p0",)))  # fmt: skip
    assert run.ok
    entry = doc["engines"]["p0"]
    assert entry["decode"] == {"skipped": "the engine's roles do not include decode"}
    assert "kv_capacity" not in entry and entry["warnings"] == []
    prefix = entry["prefix"]
    assert prefix["block_size"] == 16 and prefix["fractions"] == [0.5]
    assert prefix["cells"] == [{"length": 32, "cached": 16}, {"length": 64, "cached": 32},
                               {"length": 128, "cached": 64}]  # fmt: skip
    assert "fit" in prefix and "intervals" in prefix and "rejection" not in prefix
    p = load_profiles(run.profiles_path)["p0"]
    assert p.decode is None and p.cached_prefill is not None and p.roles == ("prefill",)
    assert "p0: decode: skipped (prefill-only engine)" in lines
    fit = prefix["fit"] | prefix["fit"]["coefficients"]
    assert (f"p0: prefix fit: TTFT = {fit['a']:.4g} + {fit['b']:.4g}*(L-k) + {fit['c']:.4g}*(L^2-k^2) "
            f"+ {fit['d']:.4g}*k s (mean error {fit['mean_error']:.1%}, worst "
            f"{fit['worst_error']:.1%}; leave-one-cell-out mean {fit['loo_mean_error']:.1%}, "
            f"worst {fit['loo_worst_error']:.1%})") in lines  # fmt: skip


async def test_a_rejected_ttft_curve_stops_the_engine_before_decode(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    run, doc, lines = await profile(fleet(engine("e0", 8101)), tiny(tmp_path, repeats=1))
    outcome = run.outcomes[0]
    assert (outcome.status, outcome.profile, outcome.success) == ("rejected", None, False)
    e0 = doc["engines"]["e0"]
    assert outcome.reason == e0["reason"] == ("TTFT fit rejected before decode profiling: "
                                              + e0["prefill"]["rejection"])  # fmt: skip
    assert e0["status"] == "rejected" and "decode" not in e0 and "prefix" not in e0
    assert lines[-1] == f"e0: warning: rejected: {outcome.reason}"
    assert not run.wrote_profiles and not run.profiles_path.exists()  # nothing to price by


async def test_rejected_cells_are_listed_and_fail_the_run_unless_accepted(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101))
    s = tiny(tmp_path)
    # The first cell's stream loses a token: that cell is rejected, the others fitted.
    drop = lambda t: RewriteStreams(t, lambda i, obj: [] if i == 2 else [obj], which=0)  # noqa: E731
    run, doc, lines = await profile(config, s, drop)
    e0, outcome = doc["engines"]["e0"], run.outcomes[0]
    rejected = [c for c in e0["decode"]["cells"] if not c["kept"]]
    assert rejected and outcome.status == "ok" and not run.ok
    assert e0["rejected_cells"] == list(outcome.rejected_cells) == [
        f"input {c['input_len']} x {c['concurrency']} streams: {c['reason']}" for c in rejected]
    assert lines[-1] == (f"e0: warning: profiled without {len(rejected)} rejected decode cell(s); "
                         "pass --accept-rejected-cells to accept it")  # fmt: skip
    run, _, lines = await profile(config, attrs.evolve(s, out=str(tmp_path / "b.json"),
                                                       accept_rejected_cells=True), drop)  # fmt: skip
    assert len(rejected) == 1 and "produced 4 tokens; 5 were requested" in rejected[0]["reason"]
    assert run.ok and lines[-1] == f"e0: warning: profiled without {len(rejected)} rejected decode cell(s)"


async def test_re_profiling_an_engine_merges_it_into_the_pair(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101), engine("p0", 8102) | {"roles": ["prefill"]})
    first, before, _ = await profile(config, tiny(tmp_path))
    assert first.ok
    old_profiles = first.profiles_path.read_bytes()
    run, after, _ = await profile(config, tiny(tmp_path, engines=("e0",), repeats=1))
    assert [o.name for o in run.outcomes] == ["e0"] and run.outcomes[0].status == "rejected"
    merged = after["merged"]
    assert merged["previous"] == {"profiles_sha256": __import__("hashlib").sha256(old_profiles).hexdigest(),
                                  "samples_sha256": json.loads(old_profiles)["samples"]["sha256"],
                                  "created_at": before["created_at"]}  # fmt: skip
    assert (merged["replaced"], merged["kept"]) == (["e0"], ["p0"])
    assert list(merged) == ["previous", "replaced", "kept", "at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", merged["at"])
    assert after["engines"]["p0"] == before["engines"]["p0"]
    assert after["engines"]["e0"]["status"] == "rejected"
    pair = load_profiles(run.profiles_path)
    assert list(pair.engines) == ["p0"] and pair["p0"] == first.outcomes[1].profile
    assert pair.excluded == {"e0": f"rejected: {run.outcomes[0].reason}"}
    # The kept engine that had no profile stays excluded with its reason.
    again, last, _ = await profile(config, tiny(tmp_path, engines=("p0",)))
    assert again.ok and last["merged"]["kept"] == ["e0"]
    pair = load_profiles(again.profiles_path)
    assert list(pair.engines) == ["p0"] and pair.excluded == {"e0": f"rejected: {run.outcomes[0].reason}"}
    # A fleet order different from the pair's: the pair follows the fleet.
    assert list(json.loads(again.profiles_path.read_text())["excluded"]) == ["e0"]
    # Every engine selected anew, or --overwrite: no merge.
    fresh, doc, _ = await profile(config, tiny(tmp_path, overwrite=True))
    assert "merged" not in doc and fresh.ok


def test_an_excluded_engines_status_and_reason_survive_a_merge() -> None:
    assert _excluded("e0", "failed: engine e0 died") == EngineOutcome("e0", "failed", "engine e0 died")
    assert _excluded("e0", "rejected: a: b") == EngineOutcome("e0", "rejected", "a: b")
    assert _excluded("e0", "odd") == EngineOutcome("e0", "rejected", "odd")
    assert _excluded("e0", None) == EngineOutcome("e0", "rejected", None)


async def test_a_mixed_up_pair_is_not_merged_into(tmp_path: Path) -> None:
    config = fleet(engine("e0", 8101), engine("e1", 8102))
    unused = httpx.MockTransport(lambda request: httpx.Response(599))  # refused before any request
    profiles, samples = pair_paths(tmp_path / "profiles.json")
    e9 = sim_profile("e9", EngineIdentity(url="http://e9.test:8109", model="m", version="v",
                                          max_model_len=4096, process_start_time=1.0))  # fmt: skip
    write_pair(profiles, samples, {"created_at": "x", "engines": []}, [EngineOutcome("e9", "ok", None, e9)])

    async def attempt(s: ProfileSettings) -> None:
        await run_profile(config, s, transport=unused, progress=Progress(io.StringIO()))

    with pytest.raises(ConfigError) as info:
        await attempt(tiny(tmp_path, engines=("e0",)))
    assert (info.value.reason, info.value.path, info.value.source) == (
        "the existing samples hold no engines; pass --overwrite to replace the pair",
        "$.engines", str(samples))  # fmt: skip
    for text, reason in (("[]", "the existing samples hold no engines; pass --overwrite to replace "
                                 "the pair"),
                         ("{", "samples file is not valid JSON: ")):  # fmt: skip
        samples.write_text(text)
        data = json.loads(profiles.read_text())
        data["samples"]["sha256"] = file_sha256(samples)
        profiles.write_text(json.dumps(data))
        with pytest.raises(ConfigError) as info:
            await attempt(tiny(tmp_path, engines=("e0",)))
        assert info.value.reason.startswith(reason) and info.value.source == str(samples)
    samples.write_text("{}")
    with pytest.raises(ConfigError, match="SHA-256 differs"):
        await attempt(tiny(tmp_path, engines=("e0",)))
    with pytest.raises(ConfigError, match="already exist; pass --overwrite"):
        await attempt(tiny(tmp_path))


class _NoBlockSize(MetricsRewrite):
    def line(self, text: str) -> str | None:
        return text.replace('block_size="', 'other_size="')


@pytest.mark.parametrize(
    ("roles", "changes", "wrap", "skipped"),
    [
        (["prefill", "decode"], {}, _NoBlockSize,
         "the engine reports no block_size in vllm:cache_config_info"),
        (["decode"], {}, None, "the engine's roles do not include prefill"),
        (["prefill", "decode"], {"prefix_fractions": (0.01,)}, None,
         "no prefill length holds a cached prefix of whole 16-token blocks"),
    ],
)
async def test_each_reason_to_skip_the_cached_prefix_sweep_is_recorded_and_warned(
    autojump_clock: trio.abc.Clock, tmp_path: Path, roles: list[str], changes: dict[str, Any],
    wrap: Any, skipped: str,
) -> None:  # fmt: skip
    e0 = engine("e0", 8101, prefix_caching=True) | {"roles": roles}
    config = fleet(e0, engine("p1", 8102) | {"roles": ["prefill"]})
    _, doc, _ = await profile(config, tiny(tmp_path, engines=("e0",),
                                           **({"prefix_fractions": (0.5,)} | changes)), wrap)  # fmt: skip
    entry = doc["engines"]["e0"]
    assert entry["status"] == "ok" and entry["prefix"] == {"skipped": skipped}
    assert (f"the engine reports prefix caching enabled but its cached-prefix sweep was skipped "
            f"({skipped}): placement prices its hits from the TTFT curve alone") in entry["warnings"]  # fmt: skip


async def test_an_engine_restarted_mid_sweep_is_failed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    class Restarting(MetricsRewrite):
        """Each /metrics answer gives a later process start time (a new generation)."""

        starts = 0

        def line(self, text: str) -> str | None:
            if text.startswith("process_start_time_seconds "):
                Restarting.starts += 1
                return f"process_start_time_seconds {1_700_000_000 + Restarting.starts}"
            return text

    run, doc, lines = await profile(fleet(engine("e0", 8101)), tiny(tmp_path), Restarting)
    outcome, e0 = run.outcomes[0], doc["engines"]["e0"]
    assert outcome.status == "failed" and outcome.profile is None
    assert outcome.reason is not None and outcome.reason.startswith(
        "engine e0 changed generation during the sweep (EngineIdentity(")  # fmt: skip
    assert outcome.reason.endswith("); its samples span two processes")
    assert e0["identity"] != e0["identity_after"] and "profile" not in e0
    assert e0["wall_clock"]["finished_at"] > e0["wall_clock"]["started_at"]
    assert lines[-1] == f"e0: warning: failed: {outcome.reason}"


async def test_no_usable_decode_cell_rejects_the_engine(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    run, doc, _ = await profile(fleet(engine("e0", 8101)), tiny(tmp_path, min_window_steps=40))
    outcome, e0 = run.outcomes[0], doc["engines"]["e0"]
    problem = e0["decode"]["rejection"]
    assert problem.startswith("0 usable decode cells; the fit needs at least ")
    assert outcome.status == "rejected" and outcome.reason == (
        f"decode fit impossible: {problem}; select shorter --decode-input-lens or fewer streams")
    assert len(e0["rejected_cells"]) == 6 and e0["decode"]["cell_medians"] == []


async def test_a_poor_decode_fit_is_warned(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    config = fleet(engine("e0", 8101, noise=0.05, seed=4),
                   profiles={"max_decode_fit_mape": 1e-6, "max_decode_cv_mape": 1e-6})  # fmt: skip
    _, doc, _ = await profile(config, tiny(tmp_path, decode_input_lens=(16, 64), decode_tokens=6))
    e0 = doc["engines"]["e0"]
    fit = e0["decode"]["fit"]
    assert e0["status"] == "ok" and e0["warnings"] == [
        f"decode fit MAPE {fit['fit_mape']:.1%} exceeds profiles.max_decode_fit_mape 0.0%; "
        "narwhal check will refuse it",
        f"leave-one-cell-out MAPE {fit['cv_mape']:.1%} exceeds profiles.max_decode_cv_mape "
        "0.0%; narwhal check will refuse it",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("timeouts", "waited_for"),
    [({"first_token_timeout_s": 0.001}, "its first token"),
     ({"decode_read_timeout_s": 0.001}, "a token")],
)
async def test_the_fleets_stream_deadlines_bound_the_decode_streams(
    autojump_clock: trio.abc.Clock, tmp_path: Path, timeouts: dict[str, float], waited_for: str
) -> None:
    run, doc, lines = await profile(fleet(engine("e0", 8101), engine=timeouts), tiny(tmp_path))
    outcome, e0 = run.outcomes[0], doc["engines"]["e0"]
    reason = f"engine e0 kept a profile stream waiting too long for {waited_for}"
    assert (outcome.status, outcome.reason, e0["status"], e0["reason"]) == (
        "failed", reason, "failed", reason)  # fmt: skip
    assert "fit" in e0["prefill"] and "profile" not in e0
    assert lines[-1] == f"e0: warning: failed: {reason}"


async def test_no_silence_deadline_leaves_the_decode_streams_the_request_deadline(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    # decode_read_timeout_s 0 means no silence deadline (as for the router), not a zero one.
    run, doc, _ = await profile(fleet(engine("e0", 8101), engine={"decode_read_timeout_s": 0}),
                                tiny(tmp_path))  # fmt: skip
    assert run.ok and all(c["kept"] for c in doc["engines"]["e0"]["decode"]["cells"])


@pytest.mark.parametrize(
    ("concurrency", "shown"),
    [((1, 2), "1,2"), ((2, 4, 8), "2,4,8"), ((4, 2, 2), "2,4"), ((1, 4, 8), None),
     ((8, 4, 1, 4), None)],
)
def test_the_seeds_calibration_rule_needs_three_concurrency_points_including_1(
    concurrency: tuple[int, ...], shown: str | None
) -> None:
    expected = None if shown is None else (
        f"decode concurrency {shown}: production calibration needs at least three concurrency "
        "points including 1 (the seed's rule)")  # fmt: skip
    assert calibration_problem(concurrency) == expected


class _Waiting(MetricsRewrite):
    """The engine's gauges report a request waiting at every read."""

    def line(self, text: str) -> str | None:
        return "vllm:num_requests_waiting 1.0" if text.startswith("vllm:num_requests_waiting") else text


async def test_a_cell_measured_near_saturation_is_warned(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    _, doc, lines = await profile(fleet(engine("e0", 8101, kv_capacity_tokens=50_000)),
                                  tiny(tmp_path, decode_input_lens=(16, 32)), _Waiting)  # fmt: skip
    e0 = doc["engines"]["e0"]
    cells = e0["decode"]["cells"]
    assert e0["status"] == "ok" and all(c["saturation"] for c in cells)
    assert e0["warnings"] == [f"decode cell input {c['input_len']} x {c['concurrency']} streams: "
                              f"{c['saturation']}" for c in cells]  # fmt: skip
    assert e0["warnings"][0].startswith("decode cell input 16 x 1 streams: near saturation: the "
                                        "engine reported ")  # fmt: skip
    assert f"e0: warning: {e0['warnings'][-1]}" in lines


@pytest.mark.parametrize(
    ("sim", "slo", "source"),
    [({"kv_capacity_tokens": 50_000}, {}, "physical"),
     ({}, {"tpot_s": 0.02}, "tpot"),
     ({}, {"tpot_s": None}, "measured")],
)
async def test_the_recorded_fits_and_kv_capacity_are_the_profiles(
    autojump_clock: trio.abc.Clock, tmp_path: Path, sim: dict[str, Any], slo: dict[str, Any],
    source: str,
) -> None:  # fmt: skip
    config = fleet(engine("e0", 8101, **sim), controller={"slo": slo})
    wrap = _NoKVSize if source != "physical" else None
    _, doc, _ = await profile(config, tiny(tmp_path), wrap)
    e0 = doc["engines"]["e0"]
    capacity = e0["kv_capacity"]
    assert capacity["source"] == source and capacity == e0["profile"]["kv_capacity"]
    assert e0["kv_capacity_inputs"] == {"tpot_target_s": config.controller.slo.tpot_s}
    # The intervals recorded are those the recorded samples give (narwhal check's derivation).
    decode = derive_decode(decode_cells(e0, "$"))
    assert e0["decode"]["intervals"] == json.loads(json.dumps(decode.intervals.as_dict()))
    assert e0["decode"]["fit"] == json.loads(json.dumps(decode.fit.as_dict()))
    ttft = derive_ttft(prefill_repeats(e0, "$"))
    assert e0["prefill"]["intervals"] == json.loads(json.dumps(ttft.intervals.as_dict()))
    if source == "measured":
        assert capacity["tokens"] == decode.kv_max


def test_a_decode_fit_at_its_limits_passes_them() -> None:
    limits = ProfilesConfig(max_decode_fit_mape=0.04, max_decode_cv_mape=0.1)
    assert decode_fit_warnings(0.04, 0.1, limits) == []
    assert decode_fit_warnings(0.0401, 0.1, limits) == [
        "decode fit MAPE 4.0% exceeds profiles.max_decode_fit_mape 4.0%; narwhal check will "
        "refuse it"]  # fmt: skip
    assert decode_fit_warnings(0.04, 0.1001, limits) == [
        "leave-one-cell-out MAPE 10.0% exceeds profiles.max_decode_cv_mape 10.0%; narwhal check "
        "will refuse it"]  # fmt: skip


class _SlowCachedCells(Wrapper):
    """Delays the answers of the cached-prefix sweep (the completions after the prefill
    sweep's twelve) by a varying amount: its cells no longer follow one model."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        super().__init__(inner)
        self.completions = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            self.completions += 1
            if self.completions > 12:
                await trio.sleep(0.05 * (self.completions % 4))
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize(
    ("fractions", "wrap", "outcome"),
    [((0.25,), None, "impossible"), ((0.5,), _SlowCachedCells, "rejected")],
)
async def test_a_cached_prefix_fit_that_fails_leaves_the_engine_without_it(
    autojump_clock: trio.abc.Clock, tmp_path: Path, fractions: tuple[float, ...], wrap: Any,
    outcome: str,
) -> None:  # fmt: skip
    p0 = engine("p0", 8102, prefix_caching=True) | {"roles": ["prefill"]}
    run, doc, lines = await profile(fleet(engine("e0", 8101), p0),
                                    tiny(tmp_path, prefix_fractions=fractions, engines=("p0",)), wrap)  # fmt: skip
    entry = doc["engines"]["p0"]
    prefix = entry["prefix"]
    assert run.ok and entry["status"] == "ok"
    assert load_profiles(run.profiles_path)["p0"].cached_prefill is None
    if outcome == "impossible":
        assert prefix["rejection"] == "2 cells with a cached prefix; the fit needs at least 3"
        assert "fit" not in prefix and "intervals" not in prefix
        assert entry["warnings"] == [
            "cached-prefix fit impossible: 2 cells with a cached prefix; the fit needs at least 3; "
            "placement prices hits from the TTFT curve"]  # fmt: skip
    else:
        derived = derive_cached(prefill_repeats(entry, "$"), cached_repeats(entry), 16)
        assert prefix["rejection"] == derived.rejection() is not None
        assert prefix["intervals"] == json.loads(json.dumps(derived.intervals.as_dict()))
        assert entry["warnings"] == [
            f"cached-prefix fit rejected ({prefix['rejection']}); placement prices hits from the "
            "TTFT curve"]  # fmt: skip
    assert f"p0: warning: {entry['warnings'][0]}" in lines


def cached_repeats(entry: dict[str, Any]) -> list[tuple[int, int, float]]:
    recorded = prefix_repeats(entry, "$")
    assert recorded is not None
    return recorded[1]


class _Hang(Wrapper):
    """Never answers the ``n``-th request to ``path`` (1-based): it waits past any deadline."""

    def __init__(self, inner: httpx.AsyncBaseTransport, path: str, n: int) -> None:
        super().__init__(inner)
        self.path, self.n, self.seen = path, n, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == self.path:
            self.seen += 1
            if self.seen == self.n:
                await trio.sleep_forever()
        return await self.inner.handle_async_request(request)


@pytest.mark.parametrize(
    ("path", "n", "what"),
    [("/metrics", 1, "its identity"), ("/tokenize", 1, "/tokenize and /metrics"),
     ("/tokenize", 2, "/tokenize")],
)
async def test_an_engine_that_does_not_answer_its_probes_in_time_fails(
    autojump_clock: trio.abc.Clock, tmp_path: Path, path: str, n: int, what: str
) -> None:
    config = fleet(engine("e0", 8101), engine={"request_timeout_s": 7.5})
    run, doc, _ = await profile(config, tiny(tmp_path), lambda t: _Hang(t, path, n))
    reason = f"engine e0 did not answer {what} within 7.5 s"
    assert (run.outcomes[0].status, run.outcomes[0].reason) == ("failed", reason)
    assert doc["engines"]["e0"]["reason"] == reason


class _Prompts(Wrapper):
    """Records the prompts of the completions requests."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        super().__init__(inner)
        self.prompts: list[Any] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            self.prompts.append(json.loads(request.content)["prompt"])
        return await self.inner.handle_async_request(request)


async def test_a_seed_gives_the_same_prompts(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    config = fleet(engine("e0", 8101))
    made: list[_Prompts] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> _Prompts:
        made.append(_Prompts(inner))
        return made[-1]

    for out in ("a", "b"):
        await profile(config, tiny(tmp_path / out), wrap)
    # The same prompts (a cohort's streams start together, in no set order).
    first, second = (sorted(map(json.dumps, p.prompts)) for p in made)
    assert first == second and len(first) == 12 + 3 * 4 + 12  # prefills, bursts, streams


class _PromptsByEngine(Wrapper):
    """Records the prompts of the completions requests, per engine host."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        super().__init__(inner)
        self.prompts: dict[str, list[str]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            prompt = json.dumps(json.loads(request.content)["prompt"])
            self.prompts.setdefault(request.url.host, []).append(prompt)
        return await self.inner.handle_async_request(request)


async def test_an_engines_prompts_are_those_of_its_recorded_seed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    # The second engine of a run seeded 11 records seed 13; so does the only engine of a
    # run seeded 12: the sidecar's seed reproduces the prompts an engine was sent.
    made: list[_PromptsByEngine] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> _PromptsByEngine:
        made.append(_PromptsByEngine(inner))
        return made[-1]

    _, two, _ = await profile(fleet(engine("e0", 8101), engine("e1", 8102)),
                              tiny(tmp_path / "two"), wrap)  # fmt: skip
    _, one, _ = await profile(fleet(engine("e1", 8102)), tiny(tmp_path / "one", seed=12), wrap)
    assert two["engines"]["e1"]["sweep"]["seed"] == one["engines"]["e1"]["sweep"]["seed"] == 13
    first, second = (sorted(m.prompts["e1.test"]) for m in made)
    assert first == second and len(first) == 12 + 3 * 4 + 12  # prefills, bursts, streams
    assert sorted(made[0].prompts["e0.test"]) != first


async def test_an_interrupted_run_leaves_the_engines_so_far_in_the_sidecar(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101), engine("e1", 8102))
    out = io.StringIO()
    async with open_sim_fleet(config) as sim:
        first = await run_profile(config, tiny(tmp_path / "timed"), transport=sim.transport,
                                  progress=Progress(out, tty=False))  # fmt: skip
        started = [float(e["wall_clock"]["started_at"])
                   for e in json.loads(first.samples_path.read_text())["engines"].values()]  # fmt: skip
        # Cancelled halfway through the second engine's sweep (a Ctrl-C, a deadline).
        with trio.move_on_after((started[1] - started[0]) * 1.5) as scope:
            await run_profile(config, tiny(tmp_path), transport=sim.transport,
                              progress=Progress(out, tty=False))  # fmt: skip
    assert scope.cancelled_caught
    profiles, samples = pair_paths(tmp_path / "profiles.json")
    doc = json.loads(samples.read_text())
    assert not profiles.exists()
    e0, e1 = doc["engines"]["e0"], doc["engines"]["e1"]
    assert (e0["status"], e0["reason"]) == ("ok", None) and "profile" in e0
    assert (e1["status"], e1["reason"]) == ("failed", "interrupted") and "prefill" in e1
    assert "profile" not in e1 and e1["rejected_cells"] == []


async def test_an_engine_the_fleet_no_longer_names_stays_in_a_merged_pair(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    both = fleet(engine("e0", 8101), engine("e1", 8102))
    first, _, _ = await profile(both, tiny(tmp_path))
    assert first.ok
    # The fleet document now names e0 alone; re-profiling it keeps e1, after the fleet's engines.
    run, doc, _ = await profile(fleet(engine("e0", 8101)), tiny(tmp_path, engines=("e0",)))
    assert run.ok and doc["merged"]["kept"] == ["e1"] and list(doc["engines"]) == ["e1", "e0"]
    pair = load_profiles(run.profiles_path)
    assert list(pair.engines) == ["e0", "e1"] and pair["e1"] == first.outcomes[1].profile


async def test_a_run_over_its_own_connections_fails_an_unreachable_engine(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    e0 = engine("e0", 8101) | {"url": f"http://127.0.0.1:{port}"}
    config = fleet(e0,
                   engine={"connect_timeout_s": 1.0, "request_timeout_s": 5.0})  # fmt: skip
    with trio.fail_after(60):
        run = await run_profile(config, tiny(tmp_path), progress=Progress(io.StringIO()))
    (outcome,) = run.outcomes
    assert outcome.status == "failed" and outcome.profile is None and not run.ok
    # No profile: the samples say why, and no profiles file is left for serve or check.
    assert not run.wrote_profiles and not run.profiles_path.exists()
    assert json.loads(run.samples_path.read_text())["engines"]["e0"]["reason"] == outcome.reason


@pytest.mark.parametrize(("mean", "worst"), [(1e-9, 0.5), (0.2, 1e-9)])
async def test_the_settings_ttft_bounds_decide_the_curve(
    autojump_clock: trio.abc.Clock, tmp_path: Path, mean: float, worst: float
) -> None:
    config = fleet(engine("e0", 8101, noise=0.05, seed=4))
    run, doc, _ = await profile(config, tiny(tmp_path, max_mean_error=mean, max_worst_error=worst))
    e0 = doc["engines"]["e0"]
    expected = derive_ttft(prefill_repeats(e0, "$")).rejection(max_mean_error=mean,
                                                              max_worst_error=worst)  # fmt: skip
    assert expected is not None and e0["prefill"]["rejection"] == expected
    assert run.outcomes[0].status == "rejected"


class _TwoWordsAToken(Wrapper):
    """The engine's tokenizer makes one token of every two words; counts /tokenize calls."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        super().__init__(inner)
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/tokenize":
            return response
        self.calls += 1
        body = json.loads(await response.aread())
        body["tokens"] = body["tokens"][::2]
        body["count"] = len(body["tokens"])
        return httpx.Response(response.status_code, json=body)


async def test_prompts_are_sized_by_the_engines_tokens_per_word(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    made: list[_TwoWordsAToken] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> _TwoWordsAToken:
        made.append(_TwoWordsAToken(inner))
        return made[-1]

    _, doc, _ = await profile(fleet(engine("e0", 8101)), tiny(tmp_path), wrap)
    e0 = doc["engines"]["e0"]
    assert e0["engine"]["tokens_per_word"] == pytest.approx(0.5, abs=0.01)
    # One /tokenize for the probe, then one per prompt (12 prefills, 3 bursts of 4, 12
    # decode streams): none sized wrong and tried again.
    assert made[0].calls == 1 + 12 + 3 * 4 + 12


class _HangLastIdentity(Wrapper):
    """Never answers /metrics once every completion of the sweep was sent (the identity
    read after the sweep; the cohort's own gauge reads give up on their own)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        super().__init__(inner)
        self.completions = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.completions += request.url.path == "/v1/completions"
        if request.url.path == "/metrics" and self.completions >= 24:
            await trio.sleep_forever()
        return await self.inner.handle_async_request(request)


async def test_an_engine_silent_at_the_identity_read_after_the_sweep_fails(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101), engine={"request_timeout_s": 7.5})
    run, doc, _ = await profile(config, tiny(tmp_path), _HangLastIdentity)
    reason = "engine e0 did not answer its identity within 7.5 s"
    assert (run.outcomes[0].status, run.outcomes[0].reason) == ("failed", reason)
    e0 = doc["engines"]["e0"]
    assert "fit" in e0["decode"] and "identity_after" not in e0


async def test_samples_that_give_no_profile_reject_the_engine_and_the_run_goes_on(
    autojump_clock: trio.abc.Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from narwhal.profile import runner

    def refuse(entry: dict[str, Any], name: str) -> Any:
        if name == "e0":
            raise ConfigError("no profile here", path="$.engines.e0.decode")
        return derive(entry, name)

    derive = runner.derive_profile
    monkeypatch.setattr(runner, "derive_profile", refuse)
    run, doc, _ = await profile(fleet(engine("e0", 8101), engine("e1", 8102)), tiny(tmp_path))
    reason = f"the samples give no profile: {ConfigError('no profile here', path='$.engines.e0.decode')}"
    assert [(o.name, o.status, o.reason) for o in run.outcomes] == [
        ("e0", "rejected", reason), ("e1", "ok", None)]  # fmt: skip
    assert doc["engines"]["e0"]["status"] == "rejected" and "profile" not in doc["engines"]["e0"]


async def test_half_a_pair_is_merged_into_and_refused_for_the_half_missing(tmp_path: Path) -> None:
    config = fleet(engine("e0", 8101), engine("e1", 8102))
    unused = httpx.MockTransport(lambda request: httpx.Response(599))  # refused before any request
    profiles, samples = pair_paths(tmp_path / "profiles.json")
    samples.write_text("{}")
    with pytest.raises(ConfigError) as info:
        await run_profile(config, tiny(tmp_path, engines=("e0",)), transport=unused,
                          progress=Progress(io.StringIO()))  # fmt: skip
    assert info.value.reason.startswith("cannot read profiles file: ")
    assert info.value.source == str(profiles)


async def test_progress_goes_to_stderr_by_default(
    autojump_clock: trio.abc.Clock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = fleet(engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run = await run_profile(config, tiny(tmp_path), transport=sim.transport)
    assert run.ok
    err = capsys.readouterr().err
    assert err.startswith("e0: engine 1/1 at http://e0.test:8101\n") and "e0: profiled\n" in err


async def test_a_run_without_a_seed_records_the_random_one_it_drew(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    _, doc, _ = await profile(fleet(engine("e0", 8101)), tiny(tmp_path, seed=None))
    seed = doc["sweep"]["seed"]
    assert type(seed) is int and 0 <= seed < 2**32
    assert doc["engines"]["e0"]["sweep"]["seed"] == seed + 1
