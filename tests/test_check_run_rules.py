"""The preflight's driver (narwhal.check.checks), called directly: the fleet document from
each form it comes in, identities read concurrently with a retry and a deadline, each
engine's reachability, who owns and closes the engine clients, the refit's original pair,
and one whole run's report. Fast: fake clients or a simulated fleet in memory, virtual time.
"""

from __future__ import annotations

import json
import socket
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from narwhal.check import load_fleet_input, open_clients, read_identities, run_check
from narwhal.check.checks import _reachable, _refit_original
from narwhal.check.results import ProfilePair
from narwhal.config import parse_fleet, unstructure_fleet
from narwhal.engines.client import EngineIdentity
from narwhal.errors import EngineError
from narwhal.profile.store import SCHEMA_VERSION, Profiles, SamplesRef, file_sha256
from narwhal.testing import open_sim_fleet
from tests.checkkit import engine, fleet_doc, identities, identity_of, sim_profile, write_pair

LOADS = "the fleet document loads (engines: e0, e1)"


# ------------------------------------------------------------------ the fleet document


def test_the_fleet_document_loads_from_each_form_it_comes_in(tmp_path: Path) -> None:
    doc = fleet_doc()
    config = parse_fleet(doc)
    ok_line = f"ok   fleet fleet: {LOADS} (measured 2; limit a valid fleet document)"

    loaded, document, source, result = load_fleet_input(config)
    assert (loaded, document, source, result.line()) == (
        config,
        unstructure_fleet(config),
        None,
        ok_line,
    )
    loaded, document, source, result = load_fleet_input(doc)
    assert (loaded, document, source, result.line()) == (config, doc, None, ok_line)

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(doc))
    for given in (path, str(path)):
        loaded, document, source, result = load_fleet_input(given)
        assert (loaded, document, source, result.line()) == (config, doc, str(path), ok_line)
    assert result.detail == {}


def test_a_fleet_document_that_does_not_load_says_where(tmp_path: Path) -> None:
    bad = fleet_doc(engine={"first_token_timeout_s": -1})
    where = "$.engine.first_token_timeout_s"
    loaded, document, source, result = load_fleet_input(bad)
    assert (loaded, document, source) == (None, bad, None)
    assert result.line() == (
        "FAIL fleet fleet: the fleet document does not load: expected a number > 0 "
        f"@ {where} (measured {where}; limit a valid fleet document)"
    )
    assert result.detail == {"path": where}

    # From a file: the document as read is kept (it is what the report shows).
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(bad))
    loaded, document, source, result = load_fleet_input(path)
    assert (loaded, document, source) == (None, bad, str(path))
    assert result.message == (
        f"the fleet document does not load: {path}: expected a number > 0 @ {where}"
    )

    def unloadable(text: str | None) -> tuple[Any, Any, Any, Any]:
        target = tmp_path / "other.json"
        target.unlink(missing_ok=True)
        if text is not None:
            target.write_text(text)
        loaded, document, source, result = load_fleet_input(target)
        assert (loaded, source, result.ok, result.measured) == (None, str(target), False, "$")
        return document, result.message, result.detail, target

    document, message, detail, target = unloadable(None)
    assert (document, detail) == (None, {"path": "$"})
    assert message == (
        f"the fleet document does not load: {target}: cannot read fleet document: "
        "No such file or directory @ $"
    )
    document, message, _, target = unloadable("{")
    assert document is None
    assert message.startswith(
        f"the fleet document does not load: {target}: fleet document is not valid JSON: "
    )
    document, message, _, target = unloadable("[1]")  # JSON, but not a document
    assert document is None and message.startswith("the fleet document does not load: ")
    tmp = tmp_path / "bytes.json"
    tmp.write_bytes(b'{"engines": "\xff"}')
    assert "fleet document is not valid JSON: " in load_fleet_input(tmp)[3].message


# ------------------------------------------------------------------------ identities


class FakeClient:
    """An engine client whose identity answers are scripted: an identity, an
    exception to raise, or "hang"."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def identity(self) -> EngineIdentity:
        self.calls += 1
        answer = self.answers.pop(0)
        if answer == "hang":
            await trio.sleep_forever()
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, EngineIdentity)
        return answer


def refused(text: str) -> EngineError:
    error = EngineError(text)
    error.transient = False  # e.g. an HTTP error status: asking again tells nothing new
    return error


async def test_identities_are_read_at_once_with_one_retry_and_a_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    ident = identity_of("e0", 8101)
    clients = {
        "ok": FakeClient(ident, ident),
        "dropped": FakeClient(EngineError("dropped"), ident, ident),
        "down": FakeClient(EngineError("first"), EngineError("second"), ident),
        "refused": FakeClient(refused("401"), ident),
        "silent": FakeClient("hang"),
        "slow": FakeClient(EngineError("dropped"), "hang"),
    }
    start = trio.current_time()
    found, errors = await read_identities(clients, 2.5)  # type: ignore[arg-type]
    # Concurrently: the two that never answer take the deadline once, not twice.
    assert trio.current_time() - start == 2.5
    assert found == {
        "ok": ident,
        "dropped": ident,
        "down": None,
        "refused": None,
        "silent": None,
        "slow": None,
    }
    assert list(found) == list(clients)
    assert errors == {
        "down": "second",
        "refused": "401",
        "silent": "engine silent did not answer its identity within 2.5 s",
        "slow": "engine slow did not answer its identity within 2.5 s",
    }
    assert {n: c.calls for n, c in clients.items()} == {
        "ok": 1,
        "dropped": 2,
        "down": 2,
        "refused": 1,
        "silent": 1,
        "slow": 2,
    }


def test_each_engine_is_reachable_or_says_why_not() -> None:
    doc = fleet_doc(engine("e0", 8101), engine("e1", 8102), engine("e2", 8103))
    config = parse_fleet(doc | {"engine": {"first_token_timeout_s": 2.5}})
    ident = identity_of("e0", 8101)
    results = _reachable(config, {"e0": ident, "e1": None}, {"e1": "connection refused"})
    assert [r.line() for r in results] == [
        "ok   reachable e0: engine e0 at http://e0.test:8101: version "
        f"{ident.version}, model {ident.model}, max_model_len {ident.max_model_len} "
        "(measured reachable; limit identity within 2.5 s)",
        "FAIL reachable e1: engine e1 at http://e1.test:8102 is unreachable: connection refused "
        "(measured unreachable; limit identity within 2.5 s)",
        "FAIL reachable e2: engine e2 at http://e2.test:8103 is unreachable: no answer "
        "(measured unreachable; limit identity within 2.5 s)",
    ]
    assert [r.ok for r in results] == [True, False, False]
    assert [r.detail for r in results] == [attrs.asdict(ident), {}, {}]


# --------------------------------------------------------------------------- clients


async def test_engine_clients_are_closed_only_when_the_check_made_them() -> None:
    doc = fleet_doc(engine("e0", 8101, no_sim=True), engine("e1", 8102, no_sim=True))
    doc["engines"][1]["api_key"] = "sk-e1"
    doc["engines"][0]["model"] = "m0"
    config = parse_fleet(doc | {"engine": {"connect_timeout_s": 1.5}})

    async with AsyncExitStack() as stack:
        own = open_clients(stack, config, None)
        assert list(own) == ["e0", "e1"]
        for e, client in zip(config.engines, own.values(), strict=True):
            assert (client.url, client.name, client.model, client.connector) == (
                e.url,
                e.name,
                e.model,
                e.connector,
            )
            assert client.connect_timeout_s == 1.5
        assert (own["e0"]._api_key, own["e1"]._api_key) == (None, "sk-e1")
        assert (own["e0"].model, own["e1"].model) == ("m0", None)
        assert own["e0"]._http is not own["e1"]._http
        assert not any(c._http.is_closed for c in own.values())
    assert all(c._http.is_closed for c in own.values())

    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    async with AsyncExitStack() as stack:
        shared = open_clients(stack, config, transport)
        http = shared["e0"]._http
        assert shared["e1"]._http is http
        assert http.timeout == httpx.Timeout(None, connect=1.5)
        assert [c.connect_timeout_s for c in shared.values()] == [1.5, 1.5]
    assert not http.is_closed  # the caller's transport: not closed here
    await http.aclose()


# --------------------------------------------------------------------- refit original


def test_a_refit_names_its_original_pair_or_fails_to(tmp_path: Path) -> None:
    def profiles(refit_of: str | None) -> Profiles:
        return Profiles(schema_version=SCHEMA_VERSION, created_at="2024-06-10T06:13:20+00:00",
                        software={}, samples=SamplesRef(path="r.samples.json", sha256="0" * 64),
                        engines={}, refit_of=refit_of)  # fmt: skip

    refit_samples = tmp_path / "r.samples.json"
    refit_samples.write_text("{}")
    pair = ProfilePair(profiles=str(tmp_path / "r.json"), samples=str(refit_samples))
    assert _refit_original(profiles(None), pair) == (None, [])

    original, results = _refit_original(profiles("lost.samples.json"), pair)
    assert original is None
    assert [r.line() for r in results] == [
        "FAIL gate_f.refit_original fleet: the refit's original pair cannot be retained: "
        f"{pair.profiles}: the refit's original samples lost.samples.json are not found "
        f"(looked at lost.samples.json, {tmp_path / 'lost.samples.json'}) @ $.refit_of "
        "(measured lost.samples.json; limit the original pair on disk)"
    ]
    sidecar = tmp_path / "o.samples.json"
    sidecar.write_text("{}")
    (tmp_path / "o.json").write_text("{}")
    original, results = _refit_original(profiles(str(sidecar)), pair)
    assert original == ProfilePair(profiles=str(tmp_path / "o.json"), samples=str(sidecar),
                                   profiles_sha256=file_sha256(tmp_path / "o.json"),
                                   samples_sha256=file_sha256(sidecar))  # fmt: skip
    assert [r.line() for r in results] == [
        f"ok   gate_f.refit_original fleet: the profiles are a refit of {tmp_path / 'o.json'} "
        f"(measured {sidecar}; limit the original pair on disk)"
    ]
    refit_samples.unlink()  # unreadable: a failed result, not an exception
    original, results = _refit_original(profiles(str(sidecar)), pair)
    assert original is None and [r.ok for r in results] == [False]
    assert "cannot read samples file" in results[0].message


# ---------------------------------------------------------------------- a whole run


async def test_a_whole_run_reports_every_check_in_order(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    doc = fleet_doc(engine_contract={"connector": "NixlConnector"})
    config = parse_fleet(doc)
    (tmp_path / "orig").mkdir()
    async with open_sim_fleet(config) as sim:
        live = await identities(config, sim.transport)
        bound = [sim_profile(n, i) for n, i in live.items()]
        write_pair(tmp_path / "orig" / "profiles.json", bound)
        refit_of = str(tmp_path / "orig" / "profiles.samples.json")
        path = write_pair(tmp_path / "profiles.json", bound, refit_of=refit_of)
        fleet = tmp_path / "fleet.json"
        fleet.write_text(json.dumps(doc | {"profiles": {"path": str(path)}}))
        await trio.sleep(1)  # the run's clock does not start at zero
        start = trio.current_time()
        report = await run_check(fleet, transport=sim.transport)
        elapsed = trio.current_time() - start

        # A profile of another generation: the hint names the fleet file the check read.
        stale = [bound[0], sim_profile("e1", attrs.evolve(live["e1"], version="0.0.1"))]
        (tmp_path / "stale").mkdir()
        stale_path = write_pair(tmp_path / "stale" / "profiles.json", stale)
        stale_fleet = tmp_path / "stale" / "fleet.json"
        stale_fleet.write_text(json.dumps(doc | {"profiles": {"path": str(stale_path)}}))
        restarted = await run_check(stale_fleet, transport=sim.transport)

        invalid = tmp_path / "invalid.json"
        invalid.write_text(json.dumps({"engines": []}))
        broken = await run_check(invalid, transport=sim.transport)
    assert report.ok, report.lines()
    limits = [
        f"{axis}.{figure}"
        for axis, figures in (
            ("prefill", ("mean_error", "worst_error", "loo_mean_error", "loo_worst_error",
                         "interval_samples", "interval", "interval_worst")),
            ("decode", ("points.active", "points.kv_tokens", "fit_mape", "cv_mape", "interval")),
        )
        for figure in figures
    ]  # fmt: skip
    assert [(r.name, r.engine) for r in report.results] == [
        ("fleet", None),
        ("fit_limit", None),
        ("reachable", "e0"),
        ("reachable", "e1"),
        ("contract.connector", "e0"),
        ("contract.connector", "e1"),
        ("pool", None),
        ("gate_f.profiles", None),
        ("gate_f.profile", "e0"),
        ("gate_f.generation", "e0"),
        ("gate_f.profile", "e1"),
        ("gate_f.generation", "e1"),
        ("gate_f.samples", "e0"),
        ("gate_f.samples", "e1"),
        *[(name, "e0") for name in limits],
        *[(name, "e1") for name in limits],
        ("gate_f.refit_original", None),
        ("kv_transfer", "e0->e1"),
        ("kv_transfer", "e1->e0"),
        ("generation.stable", "e0"),
        ("generation.stable", "e1"),
    ]
    assert report.source == str(fleet) and report.document == json.loads(fleet.read_text())
    assert report.identities == live and report.identities_after == live
    samples = tmp_path / "profiles.samples.json"
    assert report.profiles == ProfilePair(profiles=str(path), samples=str(samples),
                                          profiles_sha256=file_sha256(path),
                                          samples_sha256=file_sha256(samples))  # fmt: skip
    original = tmp_path / "orig" / "profiles.json"
    assert report.refit_original == ProfilePair(profiles=str(original), samples=refit_of,
                                                profiles_sha256=file_sha256(original),
                                                samples_sha256=file_sha256(refit_of))  # fmt: skip
    assert report.duration_s == elapsed > 0
    assert len(report.started_at) == 25 and report.started_at.endswith("+00:00")

    assert [(r.name, r.engine) for r in restarted.failures] == [("gate_f.generation", "e1")]
    assert f"narwhal profile --fleet {stale_fleet} --engines e1 " in restarted.failures[0].message
    assert restarted.refit_original is None

    # A document that does not load: that one result, and the document as read.
    assert [(r.name, r.ok) for r in broken.results] == [("fleet", False)]
    assert (broken.source, broken.document) == (str(invalid), {"engines": []})
    assert len(broken.started_at) == 25 and broken.started_at.endswith("+00:00")
    assert broken.identities == {} and broken.profiles is None and broken.refit_original is None


async def test_a_run_over_real_sockets_closes_its_clients_and_names_each_failure(
    autojump_clock: trio.abc.Clock,
) -> None:
    # No transport given: the check makes (and closes) its own clients; nothing listens.
    doc = fleet_doc(engine("e0", 8101, no_sim=True), engine("e1", 8102, no_sim=True))
    with socket.socket() as a, socket.socket() as b:  # bound, not listening: refused
        for e, sock in zip(doc["engines"], (a, b), strict=True):
            sock.bind(("127.0.0.1", 0))
            e["url"] = f"http://127.0.0.1:{sock.getsockname()[1]}"
        report = await run_check(doc)
    reachable = report.named("reachable")
    assert [r.ok for r in reachable] == [False, False]
    assert all(
        r.message.startswith(f"engine {r.engine} at http://127.0.0.1:")
        and " is unreachable: " in r.message
        and not r.message.endswith(": no answer")
        for r in reachable
    ), [r.message for r in reachable]
    assert report.identities == {"e0": None, "e1": None}
    assert report.profiles is None and report.refit_original is None
