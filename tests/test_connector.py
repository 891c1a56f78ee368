"""KV handoff descriptors (narwhal.engines.connector)."""

from __future__ import annotations

import copy
from typing import Any

import attrs
import pytest

from narwhal.engines.connector import (
    CONNECTOR_MISMATCH,
    ENDPOINT_MISMATCH,
    MALFORMED_BLOCK_IDS,
    MALFORMED_DESCRIPTOR,
    MISSING_DESCRIPTOR,
    MISSING_ENGINE_IDENTITY,
    REJECTION_REASONS,
    TRANSFER_KEYS,
    PrefillResult,
    detached,
    hosts_equal,
    prefill_request_params,
    strip_transfer_params,
    validate_descriptor,
)
from narwhal.errors import InvalidDescriptor


@attrs.frozen
class Connector:
    """Stands in for the fleet document's ConnectorConfig (same fields)."""

    type: str = "NixlConnector"
    kv_host: str = "127.0.0.1"
    kv_port: int = 15600


NIXL = Connector()

# The descriptor a vLLM 0.32 NixlConnector producer returned (VLLM-SURFACE.md), with the
# engine id completed and a field no build has yet.
OBSERVED: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3, 4, 5]],
    "remote_engine_id": "170b2847-5d0e-4d7c-9b51-3f0f6a1c2e11",
    "remote_request_id": "cmpl-8fa70bf330c08a6d-0-bb540027",
    "remote_host": "localhost",
    "remote_port": 15600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 513,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
    "future_field": {"nested": [1, 2]},
}


def make_result(descriptor: dict[str, Any] | None = None, **overrides: Any) -> PrefillResult:
    desc = validate_descriptor(descriptor or OBSERVED, connector=NIXL)
    fields: dict[str, Any] = {
        "descriptor": desc,
        "producer": "p0",
        "producer_url": "http://127.0.0.1:8101",
        "endpoint": (desc["remote_host"], desc["remote_port"]),
        "backend_request_id": "narwhal-1",
        "connector": "NixlConnector",
        "kind": "completions",
        "request": {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8},
        "started_at": 1.0,
        "completed_at": 1.5,
        "prompt_tokens": 513,
    }
    fields.update(overrides)
    return PrefillResult(**fields)


# --------------------------------------------------------------------------- accepted


def test_observed_descriptor_is_accepted_with_unknown_fields() -> None:
    accepted = validate_descriptor(OBSERVED, connector=NIXL)
    assert accepted == OBSERVED
    assert accepted is not OBSERVED
    assert accepted["future_field"] is not OBSERVED["future_field"]


def test_unknown_fields_survive_parameters() -> None:
    result = make_result()
    params = result.parameters()
    assert params == OBSERVED
    for key in (
        "dcp_size",
        "pp_size",
        "transfer_mode",
        "remote_prefill_cached_tokens",
        "future_field",
    ):
        assert params[key] == OBSERVED[key]


def test_parameters_are_detached() -> None:
    original = copy.deepcopy(OBSERVED)
    result = make_result(original)
    # Mutating the dict the result was built from changes nothing.
    original["remote_block_ids"][0].append(99)
    original["remote_port"] = 1
    params = result.parameters()
    params["remote_block_ids"][0].append(42)
    params["future_field"]["nested"].clear()
    del params["remote_engine_id"]
    again = result.parameters()
    assert again == OBSERVED
    assert detached(result.descriptor) == OBSERVED


def test_descriptor_is_immutable_all_the_way_down() -> None:
    result = make_result(copy.deepcopy(OBSERVED))
    desc = result.descriptor
    with pytest.raises(TypeError):
        desc["remote_port"] = 1  # type: ignore[index]
    # Nested values too: the block ids and any opaque nested field.
    with pytest.raises(AttributeError):
        desc["remote_block_ids"][0].append(99)
    with pytest.raises(TypeError):
        desc["remote_block_ids"][0][0] = 99
    with pytest.raises((TypeError, AttributeError)):
        desc["future_field"]["nested"].clear()
    with pytest.raises(TypeError):
        desc["future_field"]["added"] = 1
    assert result.parameters() == OBSERVED
    # A frozen descriptor still validates and still serializes to the same JSON.
    assert validate_descriptor(desc, connector="NixlConnector") == OBSERVED


def test_prefill_result_is_frozen_and_keeps_a_copy_of_the_request() -> None:
    request = {"model": "tiny-llama", "prompt": "hello"}
    result = make_result(request=request)
    request["prompt"] = "changed"
    assert result.request["prompt"] == "hello"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        result.producer = "p1"  # type: ignore[misc]
    assert result.remote_engine_id == OBSERVED["remote_engine_id"]
    assert result.remote_request_id == OBSERVED["remote_request_id"]


def test_flat_block_ids_and_connector_by_name() -> None:
    desc = {**OBSERVED, "remote_block_ids": [0, 7, 9]}
    assert validate_descriptor(desc, connector="NixlConnector")["remote_block_ids"] == [0, 7, 9]
    # No configured endpoint (connector None / a bare name): only the shape is checked.
    assert validate_descriptor({**OBSERVED, "remote_host": "10.1.2.3"}, connector=None)
    assert validate_descriptor(
        {**OBSERVED, "remote_host": "10.1.2.3"},
        connector=None,
        expected_endpoint=("10.1.2.3", 15600),
    )


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1", "[::1]", "LOCALHOST"])
def test_loopback_aliases_match(host: str) -> None:
    assert validate_descriptor({**OBSERVED, "remote_host": host}, connector=NIXL)
    assert hosts_equal(host, "127.0.0.1")


def test_hosts_equal() -> None:
    assert hosts_equal("Engine-1.local", "engine-1.LOCAL")
    assert not hosts_equal("10.0.0.1", "127.0.0.1")


# --------------------------------------------------------------------------- rejected


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in OBSERVED.items() if k != key}


REJECTIONS: list[tuple[str, object, Any, str]] = [
    ("none", None, NIXL, MISSING_DESCRIPTOR),
    ("list", [OBSERVED], NIXL, MALFORMED_DESCRIPTOR),
    ("no engine id", without("remote_engine_id"), NIXL, MISSING_ENGINE_IDENTITY),
    ("empty engine id", {**OBSERVED, "remote_engine_id": ""}, NIXL, MISSING_ENGINE_IDENTITY),
    ("numeric engine id", {**OBSERVED, "remote_engine_id": 7}, NIXL, MISSING_ENGINE_IDENTITY),
    ("no request id", without("remote_request_id"), NIXL, MISSING_ENGINE_IDENTITY),
    ("no block ids", without("remote_block_ids"), NIXL, MALFORMED_BLOCK_IDS),
    ("empty block ids", {**OBSERVED, "remote_block_ids": []}, NIXL, MALFORMED_BLOCK_IDS),
    ("empty groups", {**OBSERVED, "remote_block_ids": [[], []]}, NIXL, MALFORMED_BLOCK_IDS),
    ("string block ids", {**OBSERVED, "remote_block_ids": "1,2"}, NIXL, MALFORMED_BLOCK_IDS),
    ("mixed block ids", {**OBSERVED, "remote_block_ids": [[1], 2]}, NIXL, MALFORMED_BLOCK_IDS),
    ("float block id", {**OBSERVED, "remote_block_ids": [[1, 2.0]]}, NIXL, MALFORMED_BLOCK_IDS),
    ("bool block id", {**OBSERVED, "remote_block_ids": [True]}, NIXL, MALFORMED_BLOCK_IDS),
    ("negative block id", {**OBSERVED, "remote_block_ids": [-1]}, NIXL, MALFORMED_BLOCK_IDS),
    (
        "other connector configured",
        OBSERVED,
        Connector(type="MooncakeConnector"),
        CONNECTOR_MISMATCH,
    ),
    ("bootstrap handoff", {**OBSERVED, "bootstrap_room": 12}, NIXL, CONNECTOR_MISMATCH),
    ("p2p role block", {**OBSERVED, "prefill": {"remote_host": "x"}}, NIXL, CONNECTOR_MISMATCH),
    (
        "named other connector",
        {**OBSERVED, "kv_connector": "P2pNcclConnector"},
        NIXL,
        CONNECTOR_MISMATCH,
    ),
    ("not a remote prefill", {**OBSERVED, "do_remote_prefill": False}, NIXL, CONNECTOR_MISMATCH),
    ("request block echoed", prefill_request_params(), NIXL, CONNECTOR_MISMATCH),
    ("other port", {**OBSERVED, "remote_port": 15601}, NIXL, ENDPOINT_MISMATCH),
    ("other host", {**OBSERVED, "remote_host": "10.0.0.7"}, NIXL, ENDPOINT_MISMATCH),
    ("no host", without("remote_host"), NIXL, ENDPOINT_MISMATCH),
    ("no port", without("remote_port"), NIXL, ENDPOINT_MISMATCH),
    ("string port", {**OBSERVED, "remote_port": "15600"}, NIXL, ENDPOINT_MISMATCH),
    ("port out of range", {**OBSERVED, "remote_port": 70000}, NIXL, ENDPOINT_MISMATCH),
]


@pytest.mark.parametrize(
    ("desc", "connector", "reason"),
    [pytest.param(d, c, r, id=i) for i, d, c, r in REJECTIONS],
)
def test_rejections_name_their_reason(desc: object, connector: Any, reason: str) -> None:
    with pytest.raises(InvalidDescriptor) as info:
        validate_descriptor(desc, connector=connector, engine="p0")
    err = info.value
    assert err.reason.startswith(reason + ": ")
    assert reason in str(err)
    assert err.engine == "p0"
    assert err.leg == "prefill"
    # No other reason name appears: each rejection is distinct.
    others = [r for r in REJECTION_REASONS if r != reason]
    assert not any(err.reason.startswith(o) for o in others)


def test_explicit_expected_endpoint_overrides_the_connector() -> None:
    with pytest.raises(InvalidDescriptor, match=ENDPOINT_MISMATCH):
        validate_descriptor(OBSERVED, connector=NIXL, expected_endpoint=("10.0.0.2", 15600))


def test_rejection_reasons_are_distinct() -> None:
    assert len(set(REJECTION_REASONS)) == len(REJECTION_REASONS)
    for a in REJECTION_REASONS:
        for b in REJECTION_REASONS:
            assert a == b or not a.startswith(b)


# --------------------------------------------------------------------------- request side


def test_prefill_request_params() -> None:
    params = prefill_request_params(NIXL)
    assert params == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    params["remote_host"] = "x"
    assert prefill_request_params(NIXL)["remote_host"] is None
    assert prefill_request_params() == prefill_request_params("NixlConnector")
    with pytest.raises(ValueError, match="MooncakeConnector"):
        prefill_request_params(Connector(type="MooncakeConnector"))


def test_strip_transfer_params() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 5,
        "kv_transfer_params": {"remote_host": "evil", "remote_port": 1},
        "disaggregated_params": {"x": 1},
        "remote_host": "evil",
        "do_remote_prefill": True,
        "bootstrap_host": "evil",
        "vllm_xargs": {"kv_transfer_params": "x", "keep": 1},
    }
    before = copy.deepcopy(body)
    stripped = strip_transfer_params(body)
    assert body == before  # the input is untouched
    assert not TRANSFER_KEYS & stripped.keys()
    assert stripped == {"model": "m", "prompt": "p", "max_tokens": 5, "vllm_xargs": {"keep": 1}}
    assert "kv_transfer_params" in TRANSFER_KEYS


def test_frozen_and_detached_round_trip() -> None:
    from types import MappingProxyType

    from narwhal.engines.connector import frozen

    value = {"a": [1, {"b": [2, 3]}], "c": None, "d": 1.5, "e": True, "f": "s", "g": ((4,),)}
    cold = frozen(value)
    assert isinstance(cold, MappingProxyType)
    assert cold["a"] == (1, MappingProxyType({"b": (2, 3)})) and isinstance(
        cold["a"][1], MappingProxyType
    )
    assert cold["g"] == ((4,),)
    assert (cold["c"], cold["d"], cold["e"], cold["f"]) == (None, 1.5, True, "s")
    thawed = detached(cold)
    assert thawed == {**value, "g": [[4]]}
    assert type(thawed) is dict and type(thawed["a"]) is list and type(thawed["a"][1]) is dict
    # Neither shares anything mutable with its source.
    value["a"][1]["b"].append(9)
    assert cold["a"][1]["b"] == (2, 3)
    thawed["a"][1]["b"].append(8)
    assert cold["a"][1]["b"] == (2, 3)
    # Anything that is not JSON-shaped is copied, not shared.
    odd = {"s": {1, 2}}
    assert frozen(odd)["s"] == {1, 2} and frozen(odd)["s"] is not odd["s"]
    assert detached(odd)["s"] == {1, 2} and detached(odd)["s"] is not odd["s"]


def test_frozen_block_ids_still_validate() -> None:
    from narwhal.engines.connector import frozen

    for ids in ([[1, 2]], [1, 2]):
        desc = frozen({**OBSERVED, "remote_block_ids": ids})
        assert validate_descriptor(desc, connector="NixlConnector")["remote_block_ids"] == ids
    with pytest.raises(InvalidDescriptor, match="must be a list of integers or a list of lists"):
        validate_descriptor(
            frozen({**OBSERVED, "remote_block_ids": [[1], 2]}), connector="NixlConnector"
        )


# --------------------------------------------------------------------------- in full
# Each rejection's whole reason: the journal and the operator's log show it, so a
# changed or lost detail is a changed contract (see tools/mutation.py).

FULL_REASONS: list[tuple[str, object, Any, str]] = [
    ("none", None, NIXL, "missing descriptor: the producer returned no kv_transfer_params"),
    ("list", [OBSERVED], NIXL, "malformed descriptor: kv_transfer_params is a list, not an object"),
    (
        "other connector configured", OBSERVED, Connector(type="MooncakeConnector"),
        "connector mismatch: configured connector 'MooncakeConnector' is not one narwhal drives",
    ),
    (
        "named other connector", {**OBSERVED, "connector": "P2pNcclConnector"}, NIXL,
        "connector mismatch: descriptor is for 'P2pNcclConnector', configured connector is 'NixlConnector'",
    ),
    (
        "two foreign fields", {**OBSERVED, "bootstrap_host": "h", "bootstrap_room": 1}, NIXL,
        "connector mismatch: descriptor carries bootstrap_host, bootstrap_room, which NixlConnector does not produce",
    ),
    (
        "not a remote prefill", {**OBSERVED, "do_remote_prefill": 1}, NIXL,
        "connector mismatch: do_remote_prefill is not true, so a NixlConnector consumer would ignore the handoff",
    ),
    ("no engine id", without("remote_engine_id"), NIXL, "missing engine identity: remote_engine_id is missing"),
    (
        "empty request id", {**OBSERVED, "remote_request_id": ""}, NIXL,
        "missing engine identity: remote_request_id is not a non-empty string ('')",
    ),
    ("no block ids", without("remote_block_ids"), NIXL, "malformed block ids: remote_block_ids is missing"),
    (
        "string block ids", {**OBSERVED, "remote_block_ids": "1,2"}, NIXL,
        "malformed block ids: remote_block_ids must be a list, not str",
    ),
    ("empty block ids", {**OBSERVED, "remote_block_ids": []}, NIXL, "malformed block ids: remote_block_ids is empty"),
    (
        "float in a group", {**OBSERVED, "remote_block_ids": [[1, 2.0]]}, NIXL,
        "malformed block ids: remote_block_ids groups must hold only integers",
    ),
    (
        "mixed block ids", {**OBSERVED, "remote_block_ids": [[1], 2]}, NIXL,
        "malformed block ids: remote_block_ids must be a list of integers or a list of lists of integers",
    ),
    (
        "negative block id", {**OBSERVED, "remote_block_ids": [[3, -1]]}, NIXL,
        "malformed block ids: remote_block_ids holds a negative block id",
    ),
    ("empty groups", {**OBSERVED, "remote_block_ids": [[], []]}, NIXL, "malformed block ids: remote_block_ids names no block"),
    ("no host", without("remote_host"), NIXL, "endpoint mismatch: remote_host is missing"),
    ("blank host", {**OBSERVED, "remote_host": "  "}, NIXL, "endpoint mismatch: remote_host is '  '"),
    ("no port", without("remote_port"), NIXL, "endpoint mismatch: remote_port is missing"),
    ("port 0", {**OBSERVED, "remote_port": 0}, NIXL, "endpoint mismatch: remote_port is 0"),
    ("port 65536", {**OBSERVED, "remote_port": 65536}, NIXL, "endpoint mismatch: remote_port is 65536"),
    ("string port", {**OBSERVED, "remote_port": "15600"}, NIXL, "endpoint mismatch: remote_port is '15600'"),
    (
        "other host", {**OBSERVED, "remote_host": "10.0.0.7"}, NIXL,
        "endpoint mismatch: descriptor names 10.0.0.7:15600, the producer's KV endpoint is 127.0.0.1:15600",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("desc", "connector", "reason"), [pytest.param(d, c, r, id=i) for i, d, c, r in FULL_REASONS]
)
def test_rejection_reasons_in_full(desc: object, connector: Any, reason: str) -> None:
    with pytest.raises(InvalidDescriptor) as info:
        validate_descriptor(desc, connector=connector, engine="p0", leg="probe")
    err = info.value
    assert err.reason == reason
    assert (err.engine, err.leg) == ("p0", "probe")


@pytest.mark.parametrize("port", [1, 65535])
def test_the_whole_port_range_is_accepted(port: int) -> None:
    desc = {**OBSERVED, "remote_port": port}
    assert validate_descriptor(desc, connector=None)["remote_port"] == port


def test_an_endpoint_needs_both_host_and_port_configured() -> None:
    # A connector block without kv_port (or kv_host) names no endpoint: only the shape
    # of the descriptor's endpoint is checked.
    desc = {**OBSERVED, "remote_host": "10.0.0.7", "remote_port": 15601}
    for connector in (
        Connector(kv_port=None),  # type: ignore[arg-type]
        Connector(kv_host=None),  # type: ignore[arg-type]
    ):
        assert validate_descriptor(desc, connector=connector) == desc


def test_a_shallow_copy_on_request() -> None:
    shallow = validate_descriptor(OBSERVED, connector=NIXL, detach=False)
    assert shallow == OBSERVED and shallow is not OBSERVED
    assert shallow["remote_block_ids"] is OBSERVED["remote_block_ids"]  # only serialized
    deep = validate_descriptor(OBSERVED, connector=NIXL)
    assert deep["remote_block_ids"] is not OBSERVED["remote_block_ids"]


def test_unbalanced_brackets_are_part_of_the_host() -> None:
    assert hosts_equal("[10.0.0.1]", "10.0.0.1")
    assert not hosts_equal("[10.0.0.12", "10.0.0.1")
    assert not hosts_equal("10.0.0.12]", "0.0.0.1")
    assert not hosts_equal("localhost", "10.0.0.1") and not hosts_equal("10.0.0.1", "::1")


def test_non_json_values_are_deep_copied() -> None:
    from collections import deque

    from narwhal.engines.connector import frozen

    inner = [1]
    value = {"q": deque([inner])}
    for copied in (detached(value), frozen(value)):
        assert copied["q"] == deque([[1]]) and copied["q"][0] is not inner


def test_the_unsupported_connector_message() -> None:
    with pytest.raises(
        ValueError,
        match=r"^unsupported KV connector 'MooncakeConnector' \(supported: NixlConnector\)$",
    ):
        prefill_request_params("MooncakeConnector")
