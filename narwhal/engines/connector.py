"""KV handoff descriptors: the prefill request block, validation and :class:`PrefillResult`.

A producer engine answers its one-token prefill request with ``kv_transfer_params``:
a descriptor naming the engine, request, KV blocks and side-channel endpoint that a
consumer engine needs to pull the prompt's KV cache. The descriptor belongs to the
engine's KV connector and may grow fields in any build, so it is treated as opaque
apart from the fields validation needs; every other field is kept and passed on.

Validation happens before the decode request is sent because a consumer given an
unusable descriptor does not fail: it logs and silently recomputes the whole prompt.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, Literal, Protocol, TypeGuard

import attrs

from narwhal.errors import InvalidDescriptor

__all__ = [
    "CONNECTOR_MISMATCH",
    "ENDPOINT_MISMATCH",
    "MALFORMED_BLOCK_IDS",
    "MALFORMED_DESCRIPTOR",
    "MISSING_DESCRIPTOR",
    "MISSING_ENGINE_IDENTITY",
    "NIXL_CONNECTOR",
    "REJECTION_REASONS",
    "SUPPORTED_CONNECTORS",
    "TRANSFER_KEYS",
    "UNEXPECTED_FINISH_REASON",
    "ConnectorLike",
    "PrefillResult",
    "RequestKind",
    "connector_type",
    "hosts_equal",
    "prefill_request_params",
    "strip_transfer_params",
    "validate_descriptor",
]

RequestKind = Literal["completions", "chat"]

NIXL_CONNECTOR: Final = "NixlConnector"
#: Connectors whose handoff descriptors narwhal knows how to drive and validate.
SUPPORTED_CONNECTORS: Final = frozenset({NIXL_CONNECTOR})

# Rejection reasons: every InvalidDescriptor's ``reason`` starts with one of these.
MALFORMED_DESCRIPTOR: Final = "malformed descriptor"
MISSING_DESCRIPTOR: Final = "missing descriptor"
UNEXPECTED_FINISH_REASON: Final = "unexpected finish_reason"
MISSING_ENGINE_IDENTITY: Final = "missing engine identity"
MALFORMED_BLOCK_IDS: Final = "malformed block ids"
CONNECTOR_MISMATCH: Final = "connector mismatch"
ENDPOINT_MISMATCH: Final = "endpoint mismatch"
REJECTION_REASONS: Final = (
    MALFORMED_DESCRIPTOR,
    MISSING_DESCRIPTOR,
    UNEXPECTED_FINISH_REASON,
    MISSING_ENGINE_IDENTITY,
    MALFORMED_BLOCK_IDS,
    CONNECTOR_MISMATCH,
    ENDPOINT_MISMATCH,
)

#: Request-body keys that steer a KV transfer. A same-worker decode strips all of them
#: (a client must never be able to point an engine at a KV endpoint), and the router
#: replaces them with its own on prefill and remote decode. Besides vLLM's
#: ``kv_transfer_params`` this covers handoff fields other serving stacks accept at the
#: top level and the NixlConnector fields flattened out of their block.
TRANSFER_KEYS: Final = frozenset(
    {
        "kv_transfer_params",
        "disaggregated_params",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_request_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
    }
)

# Descriptor fields NixlConnector never produces but other connectors' handoffs carry:
# bootstrap-server handoffs (host/port/room) and the per-role blocks of P2P connectors.
_FOREIGN_FIELDS: Final = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "prefill", "decode")
# Explicit connector names some descriptors carry.
_NAME_FIELDS: Final = ("kv_connector", "connector")

_LOOPBACK: Final = frozenset({"localhost", "127.0.0.1", "::1", "0:0:0:0:0:0:0:1"})


class ConnectorLike(Protocol):
    """The shape of a fleet document's ``connector`` block (``ConnectorConfig``)."""

    @property
    def type(self) -> str: ...

    @property
    def kv_host(self) -> str | None: ...

    @property
    def kv_port(self) -> int | None: ...


def connector_type(connector: ConnectorLike | str | None) -> str:
    """The connector's type name; ``None`` means the default, NixlConnector."""
    if connector is None:
        return NIXL_CONNECTOR
    if isinstance(connector, str):
        return connector
    return connector.type


def _configured_endpoint(connector: ConnectorLike | str | None) -> tuple[str, int] | None:
    if connector is None or isinstance(connector, str):
        return None
    host, port = connector.kv_host, connector.kv_port
    if host is None or port is None:
        return None
    return (host, port)


def prefill_request_params(connector: ConnectorLike | str | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill request carries (a fresh dict each call).

    It asks the producer to keep the prompt's KV blocks for a remote decode and to
    answer with a descriptor, exactly as vLLM's own disaggregation proxies do.

    Raises:
        ValueError: the connector is not one narwhal drives.
    """
    kind = connector_type(connector)
    if kind not in SUPPORTED_CONNECTORS:
        supported = ", ".join(sorted(SUPPORTED_CONNECTORS))  # pragma: no mutate (equivalent: one name)
        raise ValueError(f"unsupported KV connector {kind!r} (supported: {supported})")
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def strip_transfer_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a request body without any KV-transfer parameter (:data:`TRANSFER_KEYS`).

    The copy is shallow: top-level keys may be changed freely, nested values are
    shared with ``body`` and must not be mutated.
    """
    out = {k: v for k, v in body.items() if k not in TRANSFER_KEYS}
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, Mapping) and "kv_transfer_params" in xargs:
        # vLLM merges vllm_xargs into the sampling extra args, where older builds
        # looked for kv_transfer_params.
        out["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
    return out


def _normalize_host(host: str) -> str:
    h = host.strip().lower()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    return h


def hosts_equal(a: str, b: str) -> bool:
    """Host names compare case-insensitively; loopback aliases are all equal."""
    a, b = _normalize_host(a), _normalize_host(b)
    return a == b or (a in _LOOPBACK and b in _LOOPBACK)


def _is_int(value: object) -> TypeGuard[int]:
    return type(value) is int  # bool is not a block id or a port


def _block_ids_problem(ids: object) -> str | None:
    if ids is None:
        return "remote_block_ids is missing"
    if not isinstance(ids, list | tuple):  # a tuple: a frozen descriptor's
        return f"remote_block_ids must be a list, not {type(ids).__name__}"
    if not ids:
        return "remote_block_ids is empty"
    if all(_is_int(x) for x in ids):
        groups: Sequence[Sequence[Any]] = [ids]
    elif all(isinstance(g, list | tuple) for g in ids):
        groups = ids
        if not all(_is_int(x) for g in groups for x in g):
            return "remote_block_ids groups must hold only integers"
    else:
        return "remote_block_ids must be a list of integers or a list of lists of integers"
    if any(x < 0 for g in groups for x in g):
        return "remote_block_ids holds a negative block id"
    if not any(groups):
        return "remote_block_ids names no block"
    return None


def validate_descriptor(
    desc: object,
    *,
    connector: ConnectorLike | str | None,
    expected_endpoint: tuple[str, int] | None = None,
    engine: str | None = None,
    leg: str | None = "prefill",
    detach: bool = True,
) -> dict[str, Any]:
    """Check a producer's handoff descriptor; return a detached copy of it.

    Args:
        desc: the producer's ``kv_transfer_params``.
        connector: the producer's connector configuration (or its type name);
            ``None`` means NixlConnector with no configured endpoint.
        expected_endpoint: the KV side-channel endpoint the descriptor must name;
            defaults to the connector's ``(kv_host, kv_port)`` when both are set.
        engine: the producer's name, for the error.
        leg: the leg to blame in the error.
        detach: return a deep copy (the default); ``False`` returns a shallow one, for a
            caller that only serializes it.

    Returns:
        A deep copy of the descriptor with every field kept, unknown ones included.

    Raises:
        InvalidDescriptor: ``reason`` starts with the rejection's name
            (:data:`REJECTION_REASONS`) and says what is wrong.
    """

    def reject(name: str, detail: str) -> InvalidDescriptor:
        return InvalidDescriptor(f"{name}: {detail}", engine=engine, leg=leg)

    if desc is None:
        raise reject(MISSING_DESCRIPTOR, "the producer returned no kv_transfer_params")
    if not isinstance(desc, Mapping):
        raise reject(
            MALFORMED_DESCRIPTOR, f"kv_transfer_params is a {type(desc).__name__}, not an object"
        )

    kind = connector_type(connector)
    if kind not in SUPPORTED_CONNECTORS:
        raise reject(CONNECTOR_MISMATCH, f"configured connector {kind!r} is not one narwhal drives")
    for field in _NAME_FIELDS:
        named = desc.get(field)
        if isinstance(named, str) and named != kind:
            raise reject(
                CONNECTOR_MISMATCH, f"descriptor is for {named!r}, configured connector is {kind!r}"
            )
    foreign = [f for f in _FOREIGN_FIELDS if f in desc]
    if foreign:
        raise reject(
            CONNECTOR_MISMATCH,
            f"descriptor carries {', '.join(foreign)}, which {kind} does not produce",
        )
    if desc.get("do_remote_prefill") is not True:
        raise reject(
            CONNECTOR_MISMATCH,
            f"do_remote_prefill is not true, so a {kind} consumer would ignore the handoff",
        )

    for field in ("remote_engine_id", "remote_request_id"):
        value = desc.get(field)
        if not isinstance(value, str) or not value:
            what = "missing" if value is None else f"not a non-empty string ({value!r})"
            raise reject(MISSING_ENGINE_IDENTITY, f"{field} is {what}")

    problem = _block_ids_problem(desc.get("remote_block_ids"))
    if problem is not None:
        raise reject(MALFORMED_BLOCK_IDS, problem)

    host, port = desc.get("remote_host"), desc.get("remote_port")
    if not isinstance(host, str) or not host.strip():
        raise reject(
            ENDPOINT_MISMATCH, f"remote_host is {'missing' if host is None else repr(host)}"
        )
    if not _is_int(port) or not 0 < port <= 65535:
        raise reject(
            ENDPOINT_MISMATCH, f"remote_port is {'missing' if port is None else repr(port)}"
        )
    expected = (
        expected_endpoint if expected_endpoint is not None else _configured_endpoint(connector)
    )
    if expected is not None:
        exp_host, exp_port = expected
        if port != exp_port or not hosts_equal(host, exp_host):
            raise reject(
                ENDPOINT_MISMATCH,
                f"descriptor names {host}:{port}, the producer's KV endpoint is {exp_host}:{exp_port}",
            )
    copied: dict[str, Any] = detached(desc) if detach else dict(desc)
    return copied


_SCALARS: Final = (str, int, float, bool, type(None))


def detached(value: Any) -> Any:
    """A mutable deep copy of a JSON-shaped value (mappings to dicts, lists and tuples to
    lists, scalars as they are; anything else deep-copied).

    Much cheaper than :func:`copy.deepcopy` on the descriptors' long block-id lists; it
    also thaws a :func:`frozen` value.
    """
    kind = type(value)
    if kind is dict or isinstance(value, Mapping):
        # (The scalar test is a fast path: detached() returns a scalar as it is. The
        # pragmas hide these lines' other mutants too; tests/test_connector.py killed
        # every one of them in a run without the pragmas.)
        return {k: v if type(v) in _SCALARS else detached(v) for k, v in value.items()}  # pragma: no mutate (equivalent: fast path)
    if kind is list or kind is tuple:
        return [v if type(v) in _SCALARS else detached(v) for v in value]  # pragma: no mutate (equivalent: fast path)
    if kind in _SCALARS:
        return value
    return copy.deepcopy(value)


def frozen(value: Any) -> Any:
    """An immutable deep copy of a JSON-shaped value: read-only mappings, tuples, scalars."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, Mapping):
        # (The scalar test is a fast path: frozen() returns a scalar as it is; see detached.)
        return MappingProxyType({k: v if type(v) in _SCALARS else frozen(v) for k, v in value.items()})  # pragma: no mutate (equivalent: fast path)
    if kind is list or kind is tuple:
        return tuple(v if type(v) in _SCALARS else frozen(v) for v in value)  # pragma: no mutate (equivalent: fast path)
    return copy.deepcopy(value)


def _readonly_copy(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    out: Mapping[str, Any] = frozen(value)
    return out


@attrs.frozen(eq=False)
class PrefillResult:
    """A validated KV handoff: what a consumer needs to decode without recomputing.

    Pass it to ``EngineClient.decode()`` as is; :meth:`parameters` gives a detached
    copy of the descriptor for inspection.

    Attributes:
        descriptor: the producer's descriptor, unknown fields included, immutable all the
            way down (read-only mappings, lists as tuples).
        producer: the producer engine's name.
        producer_url: the producer engine's base URL.
        endpoint: the KV side-channel ``(host, port)`` the descriptor names
            (``None`` for a prefill run without a transfer).
        backend_request_id: the request id narwhal gave the producer leg.
        connector: the connector type (``"NixlConnector"``).
        kind: ``"completions"`` or ``"chat"``.
        request: the original client body (read-only), so that ``decode(result)``
            alone can run the decode leg.
        started_at: ``trio.current_time()`` when the producer HTTP leg started (the
            handoff's age counts from here).
        completed_at: ``trio.current_time()`` when the producer's answer arrived.
        prompt_tokens: the prompt length the producer reported, when it did.
        cached_tokens: prompt tokens the producer served from its prefix cache, when
            its usage reported them (vLLM's ``--enable-prompt-tokens-details``; None
            without it).
        transfer: whether the prefill asked for a KV handoff. A prefill run without
            one (``EngineClient.prefill(..., transfer=False)``, for a same-worker
            decode that relies on prefix caching) has an empty descriptor and no
            endpoint, and cannot be passed to ``decode``.
        validated: the descriptor was validated against the producer's connector when
            this was made (``EngineClient.prefill`` does); a consumer then checks only
            that it drives the same connector. A result made by hand is validated in full
            when decoded.
    """

    descriptor: Mapping[str, Any] = attrs.field(converter=_frozen_mapping)
    producer: str
    producer_url: str
    endpoint: tuple[str, int] | None
    backend_request_id: str
    connector: str
    kind: RequestKind
    request: Mapping[str, Any] = attrs.field(converter=_readonly_copy)
    started_at: float
    completed_at: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    transfer: bool = True
    validated: bool = False

    def parameters(self) -> dict[str, Any]:
        """A detached deep copy of the descriptor (the decode request's ``kv_transfer_params``)."""
        copied: dict[str, Any] = detached(self.descriptor)
        return copied

    @property
    def remote_engine_id(self) -> str:
        """The producer engine instance the descriptor names."""
        return str(self.descriptor["remote_engine_id"])

    @property
    def remote_request_id(self) -> str:
        """The producer's internal id of the request holding the KV blocks."""
        return str(self.descriptor["remote_request_id"])
