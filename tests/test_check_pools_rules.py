"""The pool rules on given identities (no engines): which model each engine serves, each
pool's producers and consumers, and every word of the lines an operator reads."""

from __future__ import annotations

from typing import Any

import attrs

from narwhal.check.pools import check_pools, engine_models
from narwhal.config import FleetConfig, parse_fleet
from narwhal.engines.client import EngineIdentity
from tests.checkkit import engine, fleet_doc, identity_of


def eng(name: str, port: int, roles: list[str], model: str | None = None) -> dict[str, Any]:
    doc = engine(name, port, roles, no_sim=True)
    if model is not None:
        doc["model"] = model
    return doc


def serving(name: str, port: int, model: str) -> EngineIdentity:
    return attrs.evolve(identity_of(name, port), model=model)


def fleet(*engines: dict[str, Any]) -> FleetConfig:
    return parse_fleet(fleet_doc(*engines))


def test_an_engine_model_is_the_declared_one_else_the_reported_one() -> None:
    config = fleet(eng("a", 8101, ["prefill"], "m1"), eng("b", 8102, ["decode"]), eng("c", 8103, ["decode"]))
    ids = {"a": serving("a", 8101, "other"), "b": serving("b", 8102, "m2"), "c": None}
    assert engine_models(config, ids) == {"a": "m1", "b": "m2", "c": None}
    # An engine with no identity at all (not in the mapping) is unknown too; a declared
    # model is known without one.
    assert engine_models(config, {}) == {"a": "m1", "b": None, "c": None}


def test_a_declared_model_is_checked_against_the_reachable_engine_only() -> None:
    config = fleet(
        eng("p0", 8101, ["prefill"], "a"), eng("x", 8105, ["decode"]), eng("d0", 8102, ["decode"], "a"),
        eng("d1", 8103, ["decode"], "a"), eng("d2", 8104, ["decode"], "a"),
    )  # fmt: skip
    ids = {"p0": serving("p0", 8101, "a"), "x": serving("x", 8105, "a"), "d0": serving("d0", 8102, "b"),
           "d1": None, "d2": serving("d2", 8104, "a")}  # fmt: skip
    declared = [r for r in check_pools(config, ids) if r.name == "model.declared"]
    assert [r.line() for r in declared] == [
        "ok   model.declared p0: engine p0 serves its declared model 'a' (measured a; limit a)",
        "FAIL model.declared d0: engine d0 is declared to serve 'a' but does not list it "
        "(it serves 'b'); requests for 'a' placed there would fail (measured b; limit a)",
        "ok   model.declared d2: engine d2 serves its declared model 'a' (measured a; limit a)",
    ]


def test_each_model_has_one_pool_in_the_order_the_fleet_first_names_it() -> None:
    config = fleet(
        eng("pb", 8101, ["prefill"]), eng("pa", 8102, ["prefill"]), eng("db", 8103, ["decode"]),
        eng("da", 8104, ["decode"]), eng("xa", 8105, ["prefill", "decode"]), eng("gone", 8106, ["decode"]),
    )  # fmt: skip
    ids: dict[str, EngineIdentity | None] = {
        "pb": serving("pb", 8101, "b"), "pa": serving("pa", 8102, "a"), "db": serving("db", 8103, "b"),
        "da": serving("da", 8104, "a"), "xa": serving("xa", 8105, "a"), "gone": None,
    }  # fmt: skip
    pools = check_pools(config, ids)
    assert [r.name for r in pools] == ["pool", "pool"]
    assert [r.line() for r in pools] == [
        "ok   pool fleet: model 'b': producers pb; consumers db "
        '(measured {"consumers": 1, "producers": 1}; limit {"consumers": 1, "producers": 1})',
        "ok   pool fleet: model 'a': producers pa, xa; consumers da, xa "
        '(measured {"consumers": 2, "producers": 2}; limit {"consumers": 1, "producers": 1})',
    ]
    assert [r.detail for r in pools] == [
        {"model": "b", "producers": ["pb"], "consumers": ["db"], "unreachable": []},
        {"model": "a", "producers": ["pa", "xa"], "consumers": ["da", "xa"], "unreachable": []},
    ]
    assert all(r.ok and r.engine is None for r in pools)


def test_a_pool_without_a_reachable_role_fails_naming_its_engines_and_the_unreachable() -> None:
    config = fleet(
        eng("p0", 8101, ["prefill"], "a"), eng("d0", 8102, ["decode"], "a"),
        eng("d1", 8103, ["decode"], "a"), eng("q0", 8104, ["prefill"]),
        eng("q1", 8105, ["prefill", "decode"], "c"),
    )  # fmt: skip
    ids = {"p0": serving("p0", 8101, "a"), "d0": None, "d1": None, "q0": serving("q0", 8104, "b"),
           "q1": None}  # fmt: skip
    pools = [r for r in check_pools(config, ids) if r.name == "pool"]
    assert [(r.ok, r.message) for r in pools] == [
        (False, "model 'a' has no reachable engine with the decode role "
                "(its engines: p0, d0, d1; unreachable: d0, d1)"),
        (False, "model 'b' has no reachable engine with the decode role (its engines: q0)"),
        (False, "model 'c' has no reachable engine with the prefill or decode role "
                "(its engines: q1; unreachable: q1)"),
    ]  # fmt: skip
    assert [r.measured for r in pools] == [
        {"producers": 1, "consumers": 0},
        {"producers": 1, "consumers": 0},
        {"producers": 0, "consumers": 0},
    ]
    assert pools[0].detail == {"model": "a", "producers": ["p0"], "consumers": [], "unreachable": ["d0", "d1"]}
    assert pools[0].limit == {"producers": 1, "consumers": 1}


def test_a_pool_without_a_producer_says_prefill_and_an_unknown_model_has_no_pool() -> None:
    config = fleet(eng("d0", 8101, ["decode"]), eng("x", 8102, ["prefill"]))
    pools = check_pools(config, {"d0": serving("d0", 8101, "a"), "x": None})
    assert [(r.ok, r.message) for r in pools if r.name == "pool"] == [
        (False, "model 'a' has no reachable engine with the prefill role (its engines: d0)")
    ]
    # Nothing known about any engine's model: no pool, and no declaration to check.
    config = fleet(eng("x", 8101, ["prefill"]), eng("y", 8102, ["decode"]))
    assert check_pools(config, {"x": None, "y": None}) == []
