"""The live fleet's rules on a document's settings, directly: which settings changed
(their dotted paths), which take a restart (refused naming the JSON path), what a
change says, and what a refusal records. (tests/test_fleet_reload.py applies documents
to a running router end to end.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import attrs
import pytest

from narwhal.config import parse_fleet
from narwhal.errors import ConfigError
from narwhal.router.fleet import FleetChange, LiveFleet
from narwhal.router.fleetdiff import _flatten, changed_settings
from narwhal.router.fleetdiff import restart_only as _restart_only
from narwhal.router.fleetdiff import same_connection as _same_connection

from .routerkit import engine, fleet_doc


def _config(*engines: dict[str, Any], **sections: Any) -> Any:
    return parse_fleet(fleet_doc(*engines, **sections))


def _live(config: Any, profiles: Any = None) -> tuple[LiveFleet, list[dict[str, Any]]]:
    published: list[dict[str, Any]] = []
    state = SimpleNamespace(config=config, profiles=profiles)
    return LiveFleet(state, publish=published.append), published  # type: ignore[arg-type]


def test_a_change_says_what_it_changed_in_one_line() -> None:
    assert FleetChange("SIGHUP").empty and FleetChange("SIGHUP").describe() == "no change"
    for field in ("added", "removed", "replaced", "roles", "settings"):
        assert not FleetChange("x", **{field: ("a",)}).empty
    change = FleetChange("PUT /fleet", added=("p2", "p3"), removed=("d0",), replaced=("p1",), roles=("d1",),
                         settings=("engine.request_timeout_s",))  # fmt: skip
    assert change.describe() == (
        "added p2, p3; removed d0; replaced p1; roles changed d1; settings changed engine.request_timeout_s"
    )
    assert FleetChange("dns:g", removed=("d0",)).describe() == "removed d0"
    assert change.as_dict() == {
        "source": "PUT /fleet", "added": ["p2", "p3"], "removed": ["d0"], "replaced": ["p1"], "roles": ["d1"],
        "settings": ["engine.request_timeout_s"],
    }  # fmt: skip


def test_roles_and_the_simulator_are_no_part_of_an_engines_connection() -> None:
    d0 = engine("d0", 8102, ["decode"])
    a = _config(engine("p0", 8101, ["prefill"]), d0).engines[0]
    b = _config(engine("p0", 8101, ["prefill", "decode"], seed=7), d0).engines[0]
    c = _config(engine("p0", 8109, ["prefill"]), d0).engines[0]
    assert a.roles != b.roles and a.sim != b.sim
    assert _same_connection(a, b) and _same_connection(b, a)
    assert not _same_connection(a, c)
    # Nor its name: a later incarnation (the router's d0#2) is reached as the document's d0.
    assert _same_connection(attrs.evolve(a, name="p0#2"), a) and _same_connection(a, attrs.evolve(b, name="p0#2"))
    other_kv = engine("p0", 8101, ["prefill"])
    other_kv["connector"]["kv_port"] = 16000
    assert not _same_connection(a, _config(other_kv, d0).engines[0])


def test_settings_flatten_to_dotted_paths() -> None:
    assert _flatten({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2], "f": {}}) == {
        "a.b": 1, "a.c.d": None, "e": [1, 2], "f": {},
    }  # fmt: skip
    assert _flatten({}) == {"": {}}
    assert _flatten(3, "x") == {"x": 3}
    assert _flatten({1: "one"}) == {"1": "one"}


def test_the_changed_settings_are_every_differing_path_but_the_engines() -> None:
    old = _config(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]))
    new = _config(
        engine("p0", 8101, ["prefill"]), engine("d9", 8109, ["decode"]),
        engine={"first_token_timeout_s": 7.0, "decode_read_timeout_s": 9.0}, server={"port": 9000},
    )  # fmt: skip
    changed = changed_settings(old, new)
    assert [path for path, _, _ in changed] == [
        "engine.decode_read_timeout_s", "engine.first_token_timeout_s", "server.port",
    ]  # fmt: skip
    assert changed[2] == ("server.port", 8000, 9000)
    assert changed[1][2] == 7.0 and changed[1][1] == old.engine.first_token_timeout_s
    assert changed_settings(old, old) == []
    # A section set where it was null: its fields' paths, each from null.
    contract = _config(engine_contract={"max_model_len": 4096})
    assert changed_settings(_config(), contract) == [("engine_contract.max_model_len", None, 4096)]
    assert changed_settings(contract, _config()) == [("engine_contract.max_model_len", 4096, None)]


@pytest.mark.parametrize(
    ("path", "restart"),
    [
        ("server", True), ("server.port", True), ("serverless", False), ("journal.path", True),
        ("controller.prompt_tokens", True), ("controller.prefix_cache", True),
        ("controller.reactive.enabled", True), ("controller.reactive.period_s", False),
        ("controller.slo.ttft_s", False), ("engine.request_timeout_s", False), ("x.server", False),
    ],
)  # fmt: skip
def test_which_settings_take_a_restart(path: str, restart: bool) -> None:
    assert _restart_only(path) is restart


def test_a_restart_only_change_is_refused_naming_its_path() -> None:
    old = _config()
    live, _ = _live(old)
    with pytest.raises(ConfigError) as err:
        live.check(parse_fleet(fleet_doc(server={"port": 9000})), None)
    assert err.value.path == "$.server.port"
    assert err.value.reason == "changes only with a restart (running with 8000, the document says 9000)"
    live.check(parse_fleet(fleet_doc(engine={"first_token_timeout_s": 7.0})), None)  # applies


@pytest.mark.parametrize(("running", "asked", "how"), [(object(), None, "by profiles"), (None, object(), "by load")])
def test_switching_between_profiles_and_load_is_refused(running: Any, asked: Any, how: str) -> None:
    config = _config()
    live, _ = _live(config, running)
    with pytest.raises(ConfigError) as err:
        live.check(config, asked)
    assert err.value.path == "$.profiles.path"
    assert err.value.reason == f"this router prices placement {how}; choosing between profiles and load takes a restart"
    live.check(config, running)  # the same choice applies


def test_a_refusal_is_recorded_and_published() -> None:
    live, published = _live(_config())
    live.reject(ConfigError("bad", path="$.engines[2].url"), "PUT /fleet")
    [rec] = published
    assert {k: v for k, v in rec.items() if k != "at"} == {
        "type": "fleet", "event": "rejected", "source": "PUT /fleet", "error": "bad", "path": "$.engines[2].url",
    }  # fmt: skip
    assert live.changes == [rec]


def test_the_fleet_keeps_its_last_thousand_records() -> None:
    live, published = _live(_config())
    for i in range(1005):
        live.record("noted", n=i)
    assert [r["n"] for r in live.changes] == list(range(5, 1005))
    assert len(published) == 1005  # every one is published
