"""The fleet document: every rule names its JSON path; shipped documents load and round-trip."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import pytest

from narwhal import config as config_module
from narwhal.config import (
    FAULT_KINDS,
    ConnectorConfig,
    EngineConfig,
    FaultSpec,
    FleetConfig,
    ServerConfig,
    load_default_fleet,
    load_fleet,
    parse_as,
    parse_fleet,
    unstructure_fleet,
)
from narwhal.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DROP = object()  # a field value meaning "leave the key out"
KV3 = {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": 15603}


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not DROP}


def prefill(**fields: Any) -> dict[str, Any]:
    base = {
        "name": "p0",
        "url": "http://127.0.0.1:8101",
        "roles": ["prefill"],
        "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": 15601},
    }
    return _clean({**base, **fields})


def decode(**fields: Any) -> dict[str, Any]:
    base = {
        "name": "d0",
        "url": "http://127.0.0.1:8102",
        "roles": ["decode"],
        "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": 15602},
    }
    return _clean({**base, **fields})


def fleet(*engines: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return _clean({"engines": list(engines) or [prefill(), decode()], **sections})


def with_faults(*faults: dict[str, Any]) -> dict[str, Any]:
    return fleet(prefill(), decode(sim={"faults": list(faults)}))


ALL_FAULT_KINDS = (
    "'refuse_connection', 'delay_headers', 'http_error', 'close_before_done', "
    "'done_before_token', 'silence_after', 'error_in_stream', 'malformed_descriptor', "
    "'slow_transfer', 'restart'"
)

BAD_DOCUMENTS: list[tuple[str, Any, str]] = [
    # --- shapes and types
    ("not-an-object", [], "expected an object @ $"),
    ("section-not-object", fleet(engine=[]), "expected an object @ $.engine"),
    ("missing-engines", {"server": {}}, "missing required key 'engines' @ $"),
    ("engines-not-list", {"engines": {}}, "expected a list @ $.engines"),
    ("string-for-number", fleet(engine={"first_token_timeout_s": "30"}),
     "expected a number @ $.engine.first_token_timeout_s"),
    ("bool-is-not-number", fleet(engine={"first_token_timeout_s": True}),
     "expected a number @ $.engine.first_token_timeout_s"),
    ("nan", fleet(engine={"request_timeout_s": float("nan")}),
     "expected a finite number @ $.engine.request_timeout_s"),
    ("float-for-integer", fleet(recovery={"eject_after": 2.5}),
     "expected an integer @ $.recovery.eject_after"),
    ("string-for-integer", fleet(engine_contract={"max_model_len": "2048"}),
     "expected an integer @ $.engine_contract.max_model_len"),
    ("number-for-string", fleet(prefill(name=7), decode()),
     "expected a string @ $.engines[0].name"),
    ("int-for-boolean", fleet(controller={"reactive": {"enabled": 1}}),
     "expected a boolean @ $.controller.reactive.enabled"),
    ("string-for-boolean", fleet(journal={"fsync": "yes"}), "expected a boolean @ $.journal.fsync"),
    ("list-item-type", fleet(server={"api_keys": ["k", 3]}),
     "expected a string or an object @ $.server.api_keys[1]"),
    ("nested-object-type", fleet(recovery={"retry_budget": []}),
     "expected an object @ $.recovery.retry_budget"),
    # --- unknown and missing keys
    ("unknown-top-level", fleet(foo=1), "unknown key 'foo' @ $"),
    ("unknown-keys", fleet(foo=1, bar=2), "unknown keys 'bar', 'foo' @ $"),
    ("unknown-in-section", fleet(engine={"foo": 1}), "unknown key 'foo' @ $.engine"),
    ("typo-in-section", fleet(engine={"first_token_timout_s": 1}),
     "unknown key 'first_token_timout_s' (did you mean 'first_token_timeout_s'?) @ $.engine"),
    ("unknown-in-engine", fleet(prefill(colour="red"), decode()),
     "unknown key 'colour' @ $.engines[0]"),
    ("unknown-deep", fleet(prefill(), decode(sim={"prefill": {"e": 1.0}})),
     "unknown key 'e' @ $.engines[1].sim.prefill"),
    ("missing-url", fleet(prefill(url=DROP), decode()), "missing required key 'url' @ $.engines[0]"),
    ("missing-kv-port", fleet(prefill(connector={"kv_host": "127.0.0.1"}), decode()),
     "missing required key 'kv_port' @ $.engines[0].connector"),
    # --- field validators
    ("timeout-zero", fleet(engine={"first_token_timeout_s": 0}),
     "expected a number > 0 @ $.engine.first_token_timeout_s"),
    ("read-timeout-negative", fleet(engine={"decode_read_timeout_s": -1}),
     "expected a number >= 0 @ $.engine.decode_read_timeout_s"),
    ("handoff-age-zero", fleet(handoff={"max_age_s": 0.0}),
     "expected a number > 0 @ $.handoff.max_age_s"),
    # The handoff's age includes the prefill: at or below the first-token deadline a
    # stalled decode would always end as a handoff expiry.
    ("handoff-age-at-first-token", fleet(handoff={"max_age_s": 30.0}),
     "expected a number > $.engine.first_token_timeout_s (30): the handoff's age includes the "
     "prefill leg and the decode leg up to its first token @ $.handoff.max_age_s"),
    ("handoff-age-below-first-token", fleet(engine={"first_token_timeout_s": 90.0}),
     "expected a number > $.engine.first_token_timeout_s (90): the handoff's age includes the "
     "prefill leg and the decode leg up to its first token @ $.handoff.max_age_s"),
    ("quarantine-negative", fleet(recovery={"failure_quarantine_s": -0.5}),
     "expected a number >= 0 @ $.recovery.failure_quarantine_s"),
    ("attempts-zero", fleet(recovery={"max_attempts": 0}),
     "expected an integer > 0 @ $.recovery.max_attempts"),
    ("resumes-zero", fleet(recovery={"max_resumes": 0}),
     "expected an integer > 0 @ $.recovery.max_resumes"),
    ("resume-not-bool", fleet(recovery={"resume_streams": "yes"}),
     "expected a boolean @ $.recovery.resume_streams"),
    ("budget-ratio-negative", fleet(recovery={"retry_budget": {"ratio": -0.1}}),
     "expected a number >= 0 @ $.recovery.retry_budget.ratio"),
    ("slo-zero", fleet(controller={"slo": {"ttft_s": 0}}),
     "expected a number > 0 @ $.controller.slo.ttft_s"),
    ("contract-len-zero", fleet(engine_contract={"max_model_len": 0}),
     "expected an integer > 0 @ $.engine_contract.max_model_len"),
    ("server-port-range", fleet(server={"port": 65536}),
     "expected a port number 0-65535 @ $.server.port"),
    ("kv-port-zero", fleet(prefill(connector={"kv_host": "127.0.0.1", "kv_port": 0}), decode()),
     "expected a port number 1-65535 @ $.engines[0].connector.kv_port"),
    ("empty-api-key", fleet(server={"api_keys": [""]}),
     "expected a non-empty string @ $.server.api_keys[0]"),
    ("admission", fleet(controller={"admission": "drop"}),
     "expected one of 'wait', 'refuse' @ $.controller.admission"),
    ("admission_bound", fleet(controller={"admission_bound": "upper"}),
     "expected one of 'lower', 'point' @ $.controller.admission_bound"),
    ("prompt_tokens", fleet(controller={"prompt_tokens": "guess"}),
     "expected one of 'auto', 'tokenize', 'estimate' @ $.controller.prompt_tokens"),
    ("bad-name", fleet(prefill(name="prefill 0"), decode()),
     "expected a name of letters, digits, '.', '_' and '-' @ $.engines[0].name"),
    ("url-no-port", fleet(prefill(url="http://127.0.0.1"), decode()),
     "expected an http(s)://host:port URL @ $.engines[0].url"),
    ("url-scheme", fleet(prefill(), decode(url="ftp://127.0.0.1:21")),
     "expected an http(s)://host:port URL @ $.engines[1].url"),
    ("url-path", fleet(prefill(), decode(url="http://127.0.0.1:8102/v1")),
     "expected an http(s)://host:port URL @ $.engines[1].url"),
    ("role-unknown", fleet(prefill(), decode(), decode(name="d1", url="http://h:1", roles=["embed"])),
     "expected one of 'prefill', 'decode' @ $.engines[2].roles[0]"),
    ("roles-empty", fleet(prefill(), decode(roles=[])),
     "expected at least one role @ $.engines[1].roles"),
    ("roles-duplicate", fleet(prefill(), decode(roles=["decode", "decode"])),
     "duplicate role 'decode' @ $.engines[1].roles[1]"),
    ("roles-string", fleet(prefill(), decode(roles="decode")), "expected a list @ $.engines[1].roles"),
    ("fault-kind", with_faults({"kind": "explode"}),
     f"expected one of {ALL_FAULT_KINDS} @ $.engines[1].sim.faults[0].kind"),
    ("fault-probability", with_faults({"kind": "restart"}, {"kind": "restart", "probability": 1.5}),
     "expected a number between 0 and 1 @ $.engines[1].sim.faults[1].probability"),
    ("fault-missing-kind", with_faults({"on": "decode"}),
     "missing required key 'kind' @ $.engines[1].sim.faults[0]"),
    ("fault-on", with_faults({"kind": "http_error", "on": "both"}),
     "expected one of 'prefill', 'decode', 'any' @ $.engines[1].sim.faults[0].on"),
    ("fault-status", with_faults({"kind": "http_error", "status": 200}),
     "expected an HTTP status 400-599 @ $.engines[1].sim.faults[0].status"),
    ("fault-variant", with_faults({"kind": "malformed_descriptor", "variant": "garbled"}),
     "expected one of 'missing_engine_id', 'bad_block_ids', 'wrong_endpoint', "
     "'missing_request_id' @ $.engines[1].sim.faults[0].variant"),
    ("sim-noise", fleet(prefill(), decode(sim={"noise": -0.1})),
     "expected a number >= 0 @ $.engines[1].sim.noise"),
    ("sim-batched-tokens", fleet(prefill(), decode(sim={"max_num_batched_tokens": 0})),
     "expected an integer > 0 @ $.engines[1].sim.max_num_batched_tokens"),
    # --- cross-field rules
    ("duplicate-name", fleet(prefill(), decode(name="p0")),
     "duplicate engine name 'p0' @ $.engines[1].name"),
    ("duplicate-url", fleet(prefill(), decode(url="HTTP://127.0.0.1:8101/")),
     "url already used by engine 'p0' @ $.engines[1].url"),
    ("duplicate-kv-endpoint", fleet(prefill(), decode(connector=prefill()["connector"])),
     "KV endpoint already used by engine 'p0' @ $.engines[1].connector.kv_port"),
    ("no-engines", {"engines": []}, "expected at least one engine (or an engine group) @ $.engines"),
    ("no-decode", fleet(prefill(), prefill(name="p1", url="http://127.0.0.1:8103", connector=KV3)),
     "no engine has the decode role @ $.engines"),
    ("no-prefill", fleet(decode()), "no engine has the prefill role @ $.engines"),
    ("prefill-needs-connector", fleet(prefill(connector=DROP), decode()),
     "a prefill engine needs a connector when another engine can decode @ $.engines[0].connector"),
    ("both-roles-need-connector", fleet(decode(), prefill(roles=["prefill", "decode"], connector=None)),
     "a prefill engine needs a connector when another engine can decode @ $.engines[1].connector"),
    # --- several models: each declared model is a pool with a producer and a consumer
    ("model-without-decode",
     fleet(prefill(model="a"), decode(model="a"),
           prefill(name="p1", url="http://127.0.0.1:8103", connector=KV3, model="b")),
     "model 'b' has no engine with the decode role (its engines: 'p1') @ $.engines[2].model"),
    ("model-without-prefill",
     fleet(prefill(model="a"), decode(model="b"), decode(name="d1", url="http://127.0.0.1:8103", connector=KV3, model="a")),
     "model 'b' has no engine with the prefill role (its engines: 'd0') @ $.engines[1].model"),
    ("sim-serves-another-model", fleet(prefill(), decode(model="a", sim={"model": "b"})),
     "expected the engine's model 'a' @ $.engines[1].sim.model"),
    ("contract-pins-one-of-several-models",
     fleet(prefill(model="a"), decode(model="a"), prefill(name="p1", url="http://127.0.0.1:8103", connector=KV3,
           roles=["prefill", "decode"], model="b"), engine_contract={"model": "a"}),
     "engine 'p1' declares model 'b': a contract that pins one model fails every engine of another "
     "(leave it null when the fleet serves several) @ $.engine_contract.model"),
    ("reactive-with-several-models",
     fleet(prefill(model="a"), decode(model="a"), prefill(name="p1", url="http://127.0.0.1:8103", connector=KV3,
           roles=["prefill", "decode"], model="b"), controller={"reactive": {"enabled": True}}),
     "reactive role movement supports a fleet of one model (this one serves 'a', 'b') "
     "@ $.controller.reactive.enabled"),
    ("fit-limit-above-margin", fleet(profiles={"max_decode_fit_mape": 0.2}),
     "expected a number <= controller.reactive.movement_margin (0.1) "
     "@ $.profiles.max_decode_fit_mape"),
    ("fit-limit-vs-own-margin",
     fleet(profiles={"max_decode_fit_mape": 0.06}, controller={"reactive": {"movement_margin": 0.05}}),
     "expected a number <= controller.reactive.movement_margin (0.05) "
     "@ $.profiles.max_decode_fit_mape"),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "expected"), [c[1:] for c in BAD_DOCUMENTS],
                         ids=[c[0] for c in BAD_DOCUMENTS])  # fmt: skip
def test_bad_document_names_its_path(doc: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_fleet(copy.deepcopy(doc))
    assert str(info.value) == expected
    assert f"{info.value.reason} @ {info.value.path}" == expected


def test_table_covers_enough_rules() -> None:
    assert len(BAD_DOCUMENTS) >= 25
    assert len({c[0] for c in BAD_DOCUMENTS}) == len(BAD_DOCUMENTS)


@pytest.mark.parametrize(
    "doc",
    [
        fleet(server={"port": 0}),  # ephemeral port
        fleet(prefill(roles=["prefill", "decode"], connector=None)),  # one colocated engine
        # the colocated engine has no other decoder, so it needs no connector
        fleet(prefill(roles=["decode", "prefill"], connector=None), decode(roles=["prefill"])),
        fleet(prefill(url="https://[::1]:8443/"), decode(url="http://LOCALHOST:8102")),
        fleet(profiles={"max_decode_fit_mape": 0.1}),  # equal to the margin is fine
        fleet(engine={"decode_read_timeout_s": 0, "first_token_timeout_s": 1}),
        fleet(handoff={"max_age_s": 30.5}),  # just above the first-token deadline
        with_faults(*({"kind": k} for k in FAULT_KINDS)),
    ],
)  # fmt: skip
def test_edge_documents_are_valid(doc: dict[str, Any]) -> None:
    cfg = parse_fleet(doc)
    assert parse_fleet(unstructure_fleet(cfg)) == cfg


def test_source_prefixes_the_message() -> None:
    with pytest.raises(ConfigError) as info:
        parse_fleet(fleet(foo=1), source="fleet.json")
    assert str(info.value) == "fleet.json: unknown key 'foo' @ $"
    assert info.value.path == "$"
    assert info.value.source == "fleet.json"


def test_load_fleet_reports_json_syntax_errors(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text('{\n  "engines": [\n    ,\n  ]\n}\n')
    with pytest.raises(ConfigError) as info:
        load_fleet(path)
    assert str(info.value) == f"{path}: invalid JSON: Expecting value at line 3, column 5 @ $"


def test_load_fleet_reports_invalid_values_with_source(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(engine={"first_token_timeout_s": -1})))
    with pytest.raises(ConfigError) as info:
        load_fleet(str(path))
    assert str(info.value) == f"{path}: expected a number > 0 @ $.engine.first_token_timeout_s"


def test_load_fleet_reports_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError) as info:
        load_fleet(path)
    assert str(info.value) == f"{path}: cannot read fleet document: No such file or directory @ $"


# ------------------------------------------------------------------ shipped documents


def test_sim_fleet_is_package_data_and_config_links_to_it() -> None:
    link = ROOT / "config" / "fleet.sim.json"
    assert link.is_symlink()
    assert os.readlink(link) == "../narwhal/data/fleet.sim.json"
    packaged = resources.files("narwhal").joinpath("data/fleet.sim.json")
    assert link.resolve() == Path(str(packaged)).resolve()
    assert load_fleet(link) == load_default_fleet()


def test_the_readme_names_the_embedded_fleet_where_it_is() -> None:
    # The README said the embedded fleet was config/fleet.sim.json; an installed narwhal
    # reads its package data, which a checkout's config/fleet.sim.json only links to.
    from narwhal.cli import default_fleet_path, fleet_source

    readme = (ROOT / "README.md").read_text()
    packaged = default_fleet_path()
    assert packaged.relative_to(ROOT) == Path("narwhal/data/fleet.sim.json")
    assert "the embedded simulated fleet (`narwhal/data/fleet.sim.json`" in readme
    assert "embedded default is package data, `narwhal/data/fleet.sim.json`, the one copy" in readme
    assert "embedded simulated fleet (`config/" not in readme
    # Every fleet document the README names is there, and loads.
    for name in ("config/fleet.sim.json", "config/fleet.example.json", "narwhal/data/fleet.sim.json"):
        assert f"`{name}`" in readme and load_fleet(ROOT / name) is not None
    # serve and sim say which document they read.
    assert fleet_source(None) == f"fleet document: the embedded default, {packaged} (--fleet serves another)"
    assert fleet_source("f.json") == "fleet document: f.json"


def test_sim_fleet_shape() -> None:
    cfg = load_default_fleet()
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)
    assert [e.name for e in cfg.prefill_engines] == ["prefill-0", "prefill-1"]
    assert [e.name for e in cfg.decode_engines] == ["decode-0", "decode-1"]
    assert [(e.host, e.port) for e in cfg.engines] == [("127.0.0.1", p) for p in range(8101, 8105)]
    connectors = [e.connector for e in cfg.engines]
    assert connectors == [
        ConnectorConfig(kv_host="127.0.0.1", kv_port=p) for p in range(15601, 15605)
    ]
    assert all(e.sim is not None and e.sim.model == "sim-llama" for e in cfg.engines)
    assert cfg.journal.path == "runs/journal.jsonl"
    fast, slow = (cfg.engine_named(n).sim for n in ("prefill-0", "prefill-1"))
    assert fast is not None and slow is not None
    assert slow.prefill.a == pytest.approx(2 * fast.prefill.a)
    assert slow.prefill.b == pytest.approx(2 * fast.prefill.b)
    assert slow.prefill.c == pytest.approx(2 * fast.prefill.c)


def test_example_fleet_is_a_real_vllm_pair() -> None:
    cfg = load_fleet(ROOT / "config" / "fleet.example.json")
    producer, consumer = cfg.engines
    assert (producer.url, producer.roles, producer.sim) == (
        "http://127.0.0.1:8100",
        ("prefill",),
        None,
    )
    assert (consumer.url, consumer.roles, consumer.sim) == (
        "http://127.0.0.1:8200",
        ("decode",),
        None,
    )
    assert producer.connector == ConnectorConfig(
        type="NixlConnector", kv_host="127.0.0.1", kv_port=5600
    )
    assert consumer.connector == ConnectorConfig(
        type="NixlConnector", kv_host="127.0.0.1", kv_port=5601
    )
    assert {producer.model, consumer.model} == {"tiny-llama"}
    contract = cfg.engine_contract
    assert contract is not None
    assert (contract.version, contract.model, contract.connector, contract.max_model_len) == (
        "0.32.0", "tiny-llama", "NixlConnector", 2048,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["fleet.sim.json", "fleet.example.json", "fleet.two-models.sim.json"])
def test_shipped_documents_round_trip(name: str) -> None:
    cfg = load_fleet(ROOT / "config" / name)
    data = unstructure_fleet(cfg)
    assert json.loads(json.dumps(data)) == data  # plain JSON types: lists, not tuples
    assert parse_fleet(data) == cfg


# ------------------------------------------------------------------ the converter


def _full_document() -> dict[str, Any]:
    """A document in which every section and every nested object is present."""
    faults = [{"kind": "malformed_descriptor", "variant": "wrong_endpoint", "times": 2}]
    doc = fleet(
        prefill(model="m", api_key="secret", sim={"faults": faults, "model": "m"},
                kv_events={"endpoint": "tcp://127.0.0.1:5557"}),
        decode(),
        server={"api_keys": ["k", {"key": "k2", "name": "chat"}]},
        engine_contract={"version": "0.32.0"},
        controller={"slo": {"ttft_s": 0.5, "tpot_s": 0.05}},
        engine_groups=[{"name": "g", "host": "decode.svc", "port": 8000, "roles": ["decode"],
                        "connector": {"kv_port": 15000}, "kv_events": {"port": 5557}}],
        tenancy={"classes": [{"name": "chat"}], "store": {"url": "redis://127.0.0.1:6379/0"},
                 "tenants": [{"name": "chat", "latency_class": "chat", "limits": {"max_in_flight": 2}}]},
    )  # fmt: skip
    return unstructure_fleet(parse_fleet(doc))


def _objects(node: Any, path: str = "$") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _objects(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _objects(value, f"{path}[{i}]")


def _config_classes(cl: type, seen: set[type]) -> set[type]:
    if cl not in seen and attrs.has(cl):
        seen.add(cl)
        for field in attrs.fields(cl):
            for sub in config_module.__dict__.values():
                if isinstance(sub, type) and attrs.has(sub) and sub.__name__ in str(field.type):
                    _config_classes(sub, seen)
    return seen


def test_unknown_keys_are_forbidden_at_every_level() -> None:
    doc = _full_document()
    paths = [path for path, _ in _objects(doc)]
    # one object per config class: the walk below really reaches every level
    assert len(paths) == len(_config_classes(FleetConfig, set())) + 2  # + 2nd engine, connector
    for path, obj in _objects(doc):
        obj["surprise"] = True
        with pytest.raises(ConfigError) as info:
            parse_fleet(doc)
        assert str(info.value) == f"unknown key 'surprise' @ {path}"
        del obj["surprise"]
    assert parse_fleet(doc) == parse_fleet(_full_document())


def test_round_trip_of_a_full_document() -> None:
    cfg = parse_fleet(_full_document())
    assert parse_fleet(unstructure_fleet(cfg)) == cfg
    assert cfg.engines[0].sim is not None
    assert cfg.engines[0].sim.faults == (
        FaultSpec(kind="malformed_descriptor", variant="wrong_endpoint", times=2),
    )


def test_one_module_level_converter_forbids_extra_keys() -> None:
    assert config_module.converter.forbid_extra_keys
    with pytest.raises(ConfigError) as info:
        parse_as(FaultSpec, {"kind": "restart", "when": "now"})
    assert str(info.value) == "unknown key 'when' @ $"
    assert parse_as(FaultSpec, {"kind": "restart"}) == FaultSpec(kind="restart")


# ------------------------------------------------------------------ helpers and direct use


def test_engine_helpers() -> None:
    cfg = parse_fleet(fleet(prefill(url="http://[::1]:8101/"), decode(roles=["prefill", "decode"])))
    p0, d0 = cfg.engines
    assert (p0.url, p0.host, p0.port) == ("http://[::1]:8101", "::1", 8101)
    assert (p0.can_prefill, p0.can_decode) == (True, False)
    assert (d0.can_prefill, d0.can_decode) == (True, True)
    assert cfg.prefill_engines == (p0, d0)
    assert cfg.decode_engines == (d0,)
    assert cfg.engine_named("d0") is d0
    assert cfg.engine.first_token_timeout_s == 30.0  # `engine` stays the timeouts section


def test_unknown_engine_name_is_a_clear_key_error() -> None:
    cfg = parse_fleet(fleet())
    with pytest.raises(KeyError, match=r"no engine named 'x' in the fleet \(engines: p0, d0\)"):
        cfg.engine_named("x")


def test_defaults_match_the_plan() -> None:
    cfg = parse_fleet(fleet())
    assert cfg.server == ServerConfig()
    assert unstructure_fleet(cfg)["server"] == {
        "host": "127.0.0.1", "port": 8000, "max_body_bytes": 8388608,
        "max_header_bytes": 16384, "header_timeout_s": 10.0, "body_timeout_s": 30.0,
        "keepalive_timeout_s": 75.0, "max_concurrent_requests": 4096,
        "max_connections": None, "send_timeout_s": 60.0,
        "shutdown_grace_s": 30.0, "api_keys": [], "admin_host": "127.0.0.1", "admin_port": 8001,
        "admin_api_keys": [], "admin_fleet_writes": True, "engine_load_poll_s": 0.0, "engine_urls_in_errors": False,
            "token_relay": "thread",
    }  # fmt: skip
    data = unstructure_fleet(cfg)
    assert data["engine"] == {"first_token_timeout_s": 30.0, "decode_read_timeout_s": 30.0,
                              "request_timeout_s": 600.0, "connect_timeout_s": 5.0}  # fmt: skip
    assert data["handoff"] == {"max_age_s": 60.0}
    assert data["recovery"] == {
        "eject_after": 3, "failure_quarantine_s": 0.0, "max_attempts": 1,
        "retry_budget": {"ratio": 0.2, "min_retries_per_s": 1.0, "window_s": 10.0},
        "probe_interval_s": 5.0, "resume_streams": False, "max_resumes": 2,
    }  # fmt: skip
    assert data["engine_contract"] is None
    assert data["profiles"] == {
        "path": None,
        "max_decode_fit_mape": 0.05,
        "max_decode_cv_mape": 0.13,
    }
    assert data["controller"] == {"slo": {"ttft_s": None, "tpot_s": None}, "admission": "wait",
                                  "admission_bound": "lower", "pricing": "point",
                                  "reactive": {"enabled": False, "movement_margin": 0.10,
                                               "interval_s": 10.0, "deployment_record": None},
                                  "prompt_tokens": "auto", "prefix_cache": "auto", "cache_plan": "auto"}  # fmt: skip
    assert data["journal"] == {"path": "runs/journal.jsonl", "queue_size": 10000, "fsync": True}
    sim = unstructure_fleet(parse_fleet(fleet(prefill(), decode(sim={}))))["engines"][1]["sim"]
    assert sim == {
        "seed": 0, "model": "sim-llama", "version": "0.32.0", "max_model_len": 4096,
        "prefill": {"a": 0.005, "b": 2e-05, "c": 0.0, "d": 0.0},
        "decode": {"c0": 0.004, "c1": 0.0002, "c2": 2e-08},
        "kv_capacity_tokens": 262144, "block_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": None,
        "transfer_s_per_token": 2e-07, "frontend_s_per_token": 0.0, "handoff_ttl_s": 480.0,
        "prefix_caching": False,
        "prompt_tokens_details": False, "kv_events_connect": False, "scheduling_policy": "fcfs", "noise": 0.0, "faults": [],
    }  # fmt: skip
    assert unstructure_fleet(parse_fleet(with_faults({"kind": "restart"})))["engines"][1]["sim"][
        "faults"
    ] == [{"kind": "restart", "on": "any", "probability": 1.0, "times": None, "after_tokens": 0,
           "delay_s": 0.0, "status": 500, "message": "injected fault", "variant": None}]  # fmt: skip


def test_fault_kinds() -> None:
    assert FAULT_KINDS == (
        "refuse_connection", "delay_headers", "http_error", "close_before_done",
        "done_before_token", "silence_after", "error_in_stream", "malformed_descriptor",
        "slow_transfer", "restart",
    )  # fmt: skip


def test_classes_built_by_hand_validate_too() -> None:
    engine = EngineConfig(name="d0", url="http://127.0.0.1:8102/", roles=["decode"])
    assert engine.roles == ("decode",)
    assert engine.url == "http://127.0.0.1:8102"
    with pytest.raises(ConfigError) as info:
        EngineConfig(name="d0", url="127.0.0.1:8102", roles=("decode",))
    assert str(info.value) == "expected an http(s)://host:port URL @ $.url"
    with pytest.raises(ConfigError) as info:
        FleetConfig(engines=[engine])
    assert str(info.value) == "no engine has the prefill role @ $.engines"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        engine.name = "other"  # type: ignore[misc]


def test_docstrings_document_every_field() -> None:
    for cl in _config_classes(FleetConfig, set()):
        doc = cl.__doc__ or ""
        assert "Attributes:" in doc, cl.__name__
        for field in attrs.fields(cl):
            assert f"\n        {field.name}: " in doc, f"{cl.__name__}.{field.name}"


def test_each_model_is_a_pool_of_its_own() -> None:
    """Engines that declare no model may fill either model's roles (their /v1/models
    tells, and ``narwhal check`` checks the live pools); a prefill engine without a
    connector is fine when every other consumer serves another model."""
    kv4 = {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": 15604}
    cfg = parse_fleet(fleet(prefill(model="a"), decode(model="a"),
                            prefill(name="p1", url="http://127.0.0.1:8103", connector=KV3, model="b"),
                            decode(name="d1", url="http://127.0.0.1:8104", connector=kv4)))  # fmt: skip
    assert cfg.models == ("a", "b")
    alone = parse_fleet(fleet(prefill(model="a"), decode(model="a"),
                              prefill(name="b", url="http://127.0.0.1:8103", connector=DROP,
                                      roles=["prefill", "decode"], model="b")))  # fmt: skip
    assert [e.model for e in alone.engines] == ["a", "a", "b"]
    with pytest.raises(ConfigError, match=r"needs a connector when another engine can decode @ \$.engines\[2\]"):
        parse_fleet(fleet(prefill(model="a"), decode(model="a"),
                          prefill(name="b", url="http://127.0.0.1:8103", connector=DROP,
                                  roles=["prefill", "decode"])))  # fmt: skip
