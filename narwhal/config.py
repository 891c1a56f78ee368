"""The fleet document: frozen attrs classes, one cattrs converter, errors that name a JSON path.

Every section but ``engines`` is optional and every field defaults as its class shows.
:func:`load_fleet` and :func:`parse_fleet` return a :class:`FleetConfig` or raise
:class:`~narwhal.errors.ConfigError` for the first bad value, e.g. ``expected a number > 0
@ $.engine.first_token_timeout_s``. Validators raise ``ConfigError`` with a path relative to
their own object and the structuring walk re-bases it, so a class built by hand fails alike.
"""

from __future__ import annotations

import collections
import difflib
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any, Literal, TypeVar, get_args, get_origin
from urllib.parse import SplitResult, urlsplit

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote as AttrNote
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.errors import IterableValidationNote as ItemNote
from cattrs.gen import make_dict_structure_fn

from narwhal.errors import ConfigError

__all__ = [
    "FAULT_KINDS", "INCARNATION", "MAX_DOCUMENT_BYTES", "REDACTED", "ROLES", "ApiKeyConfig", "ClassConfig",
    "ConnectorConfig", "ControllerConfig", "EngineConfig", "EngineContract", "EngineGroupConfig", "EngineLimits",
    "EngineTimeouts", "FaultSpec", "FleetConfig", "GroupConnectorConfig", "GroupKVEventsConfig", "HandoffConfig",
    "JournalConfig", "KVEventsConfig", "ProfilesConfig", "ReactiveConfig", "RecoveryConfig", "RetryBudgetConfig",
    "SLOConfig", "ServerConfig", "SimConfig", "SimDecodeModel", "SimPrefillModel", "StoreConfig", "TenancyConfig",
    "TenantConfig", "TenantLimits", "TracingConfig", "converter", "is_secret", "load_default_fleet", "load_fleet",
    "parse_as", "parse_fleet", "parse_fleet_json", "read_document", "redacted", "secret_setting", "unstructure_fleet",
]  # fmt: skip

T = TypeVar("T")
Role = Literal["prefill", "decode"]
FaultKind = Literal[
    "refuse_connection", "delay_headers", "http_error", "close_before_done",
    "done_before_token", "silence_after", "error_in_stream", "malformed_descriptor",
    "slow_transfer", "restart",
]  # fmt: skip
DescriptorVariant = Literal[
    "missing_engine_id", "bad_block_ids", "wrong_endpoint", "missing_request_id"
]
#: Every fault a simulated engine can be scripted with.
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)
#: The roles an engine may have.
ROLES: tuple[str, ...] = get_args(Role)
_ON = ("prefill", "decode", "any")
_VARIANTS: tuple[str, ...] = get_args(DescriptorVariant)
_ADMISSION = ("wait", "refuse")
_PROMPT_TOKENS = ("auto", "tokenize", "estimate")
#: The OTLP protocols the router exports with (OTEL_EXPORTER_OTLP_PROTOCOL's values but http/json).
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
_LITERAL: Any = Literal  # typed Any so that mypy accepts the identity test below

# ------------------------------------------------------------------ validators

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _rule(ok: Callable[[Any], bool], message: str) -> Validator:
    def validate(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not ok(value):
            raise ConfigError(message, path=f"$.{attribute.name}")

    return validate


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _host_port(url: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not host or not port or "@" in parts.netloc:
        return None
    return (host, port) if parts.path in ("", "/") and not parts.query + parts.fragment else None


_ZMQ_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):([0-9]{1,5})")


def _zmq_endpoint(v: Any) -> bool:
    m = _ZMQ_TCP.fullmatch(v) if isinstance(v, str) else None
    return m is not None and m.group(1) != "*" and 1 <= int(m.group(2)) <= 65535


def _zmq_bind_endpoint(v: Any) -> bool:
    m = _ZMQ_TCP.fullmatch(v) if isinstance(v, str) else None
    return m is not None and 1 <= int(m.group(2)) <= 65535


def _one_of(choices: Iterable[str]) -> str:
    return "expected one of " + ", ".join(repr(c) for c in choices)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: Between an engine's name and the number of a later incarnation of it (``d0#2``): the
#: router starts an engine whose URL or key a reload changes beside the one it replaces,
#: under that name. A document's names never have it.
INCARNATION = "#"
_INCARNATION = re.compile(rf"{_NAME.pattern}(?:{INCARNATION}[0-9]+)?")
_positive = _rule(lambda v: _num(v) and v > 0, "expected a number > 0")
_non_negative = _rule(lambda v: _num(v) and v >= 0, "expected a number >= 0")
_fraction = _rule(lambda v: _num(v) and 0 <= v <= 1, "expected a number between 0 and 1")
_positive_int = _rule(lambda v: _int(v) and v > 0, "expected an integer > 0")
_non_negative_int = _rule(lambda v: _int(v) and v >= 0, "expected an integer >= 0")
_port = _rule(lambda v: _int(v) and 1 <= v <= 65535, "expected a port number 1-65535")
_bind_port = _rule(lambda v: _int(v) and 0 <= v <= 65535, "expected a port number 0-65535")
_http_status = _rule(lambda v: _int(v) and 400 <= v <= 599, "expected an HTTP status 400-599")
_text = _rule(lambda v: isinstance(v, str) and v != "", "expected a non-empty string")
_url = _rule(lambda v: isinstance(v, str) and _host_port(v) is not None,
             "expected an http(s)://host:port URL")  # fmt: skip
_NAME_MESSAGE = "expected a name of letters, digits, '.', '_' and '-'"
_name = _rule(lambda v: isinstance(v, str) and _NAME.fullmatch(v) is not None, _NAME_MESSAGE)
# An engine's: a later incarnation's too (the document refuses those, FleetConfig below).
_engine_name = _rule(lambda v: isinstance(v, str) and _INCARNATION.fullmatch(v) is not None, _NAME_MESSAGE)
#: A Bearer token as it may go in a request head: visible ASCII, no space or control
#: character (RFC 9110 field values; a CR or LF would end the header). The message never
#: shows the value: it is a secret.
_header_token = _rule(
    lambda v: isinstance(v, str) and v != "" and all("!" <= c <= "~" for c in v),
    "expected a key of visible ASCII characters (no space, control or non-ASCII character: "
    "it is sent as an HTTP header)",
)
_zmq = _rule(_zmq_endpoint, "expected a tcp://host:port ZeroMQ endpoint (a host, not '*')")
_zmq_bind = _rule(_zmq_bind_endpoint, "expected a tcp://host:port ZeroMQ endpoint to bind ('*' for every interface)")
_opt = attrs.validators.optional


def _member(choices: tuple[str, ...]) -> Validator:
    return _rule(lambda v: v in choices, _one_of(choices))


def _items(ok: Callable[[Any, tuple[Any, ...]], str | None], empty: str | None = None) -> Validator:
    """Check each item of a list field; ``ok`` returns an error message or None."""

    def validate(_inst: Any, attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
        if not value and empty:
            raise ConfigError(empty, path=f"$.{attribute.name}")
        for i, item in enumerate(value):
            if (message := ok(item, value[:i])) is not None:
                raise ConfigError(message, path=f"$.{attribute.name}[{i}]")

    return validate


def _check_role(role: Any, before: tuple[Any, ...]) -> str | None:
    if role not in ROLES:
        return _one_of(ROLES)
    return f"duplicate role {role!r}" if role in before else None


_texts = _items(lambda v, _: None if isinstance(v, str) and v else "expected a non-empty string")
_roles = _items(_check_role, empty="expected at least one role")
_engines = _items(lambda v, _: None)


# Converters let code build the classes from any iterable; concrete types keep mypy precise.
def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _role_tuple(value: Iterable[Role]) -> tuple[Role, ...]:
    return tuple(value)


def _fault_tuple(value: Iterable[FaultSpec]) -> tuple[FaultSpec, ...]:
    return tuple(value)


def _engine_tuple(value: Iterable[EngineConfig]) -> tuple[EngineConfig, ...]:
    return tuple(value)


def _group_tuple(value: Iterable[EngineGroupConfig]) -> tuple[EngineGroupConfig, ...]:
    return tuple(value)


def _key_tuple(value: Iterable[str | ApiKeyConfig]) -> tuple[ApiKeyConfig, ...]:
    return tuple(ApiKeyConfig(key=k) if isinstance(k, str) else k for k in value)


def _strip_slash(url: str) -> str:
    return url.rstrip("/") if isinstance(url, str) else url


# ------------------------------------------------------------------ server and engines


def _hidden(keys: tuple[Any, ...]) -> str:
    """A key list's ``repr``: how many, never the keys."""
    return f"<{len(keys)} keys>"


def _admin_keys(inst: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    _texts(inst, attribute, value)
    for i, key in enumerate(value):
        if any(key == k.key for k in inst.api_keys):
            raise ConfigError("an admin key must not also be a client key (server.api_keys): "
                              "a client could reload the fleet with it", path=f"$.{attribute.name}[{i}]")  # fmt: skip

@attrs.frozen(kw_only=True)
class ApiKeyConfig:
    """A bearer key clients present (an item of ``server.api_keys``): the key as a string,
    or an object that also names who holds it.

    Attributes:
        key: The key itself. Secret: the router never logs, records or echoes it (a reload
            that would change it is refused without quoting it), and compares a presented
            key with every configured one in constant time.
        name: The tenant the key belongs to (a ``tenancy.tenants[].name``; several keys may
            name one tenant); null: an unnamed key, whose requests are
            ``tenancy.default_tenant``'s.
    """

    key: str = attrs.field(validator=_text, repr=False)
    name: str | None = attrs.field(default=None, validator=_opt(_name))



@attrs.frozen(kw_only=True)
class ServerConfig:
    """The router's HTTP listener (the ``server`` section).

    Attributes:
        host: Address the router binds.
        port: TCP port the router binds; 0 picks an ephemeral port.
        max_body_bytes: Largest request body accepted (413 above it).
        max_header_bytes: Largest request head accepted (431 above it).
        header_timeout_s: Seconds a client may take to send the request head (408 after).
        body_timeout_s: Seconds a client may take to send the request body (408 after).
        keepalive_timeout_s: Seconds an idle keep-alive connection stays open.
        max_concurrent_requests: Requests in flight at once; more are refused with 503.
        max_connections: Client connections open at once; at the limit the router stops
            accepting until one closes (further clients wait in the listen backlog), so
            that clients cannot take the file descriptors its engine connections need;
            null derives it from the process's open-file limit (``ulimit -n``) as
            (limit - 64) / 3, since each connection may hold two more descriptors (to
            engines), and at least 16, at most 65536.
        send_timeout_s: Seconds one write to a client may wait while the client reads
            nothing (nginx's ``send_timeout``; any bytes read start it again); then the
            client counts as gone: its request ends as ``client_cancelled``, its engine
            legs are cancelled and its connection is closed.
        shutdown_grace_s: Seconds in-flight requests get to finish on shutdown.
        api_keys: Bearer keys clients must present; empty means no authentication. Each is a
            string, or ``{"key": ..., "name": ...}`` naming the tenant it belongs to
            (``tenancy``).
        admin_host: Address the admin endpoints (metrics, events) bind; loopback by default.
            An address other than loopback needs ``admin_api_keys``: the router refuses
            to start without them.
        admin_port: TCP port of the admin endpoints; 0 picks an ephemeral port.
        admin_api_keys: Bearer keys every admin request must present on every admin route
            (``/metrics`` scrapes, the ``/events`` WebSocket handshake, ``/fleet``, ``/health``);
            401 otherwise. Empty means none, allowed on a loopback ``admin_host`` only.
            ``NARWHAL_ADMIN_KEY`` adds one (``narwhal serve``) and presents it (``narwhal
            top``). A client key (``api_keys``) is never an admin key. Never shown in a log,
            error or record.
        admin_fleet_writes: Whether ``PUT /fleet`` on the admin port may reload the fleet.
            On by default, so that a documented reload keeps working; the admin listener
            it needs is loopback or keyed. False answers 403 ``fleet_writes_disabled``
            (SIGHUP still reloads the document file).
        engine_load_poll_s: Seconds between reads of every engine's /metrics (running and
            waiting requests): placement adds what other routers placed (the report minus
            this router's own legs) to its own reservations, so that replicas and workers
            place as one. Set it on every replica behind a load balancer (or pass
            ``narwhal serve --engine-load-poll``); 0 turns it off (``--workers`` > 1 turns
            it on at 1 s). Costs one GET /metrics per engine per period per router.
        engine_urls_in_errors: Client error bodies about an engine name its URL as well as
            its name (``engine d0 at http://10.0.0.5:8000 unreachable``). Off by default: an
            engine's address is the operator's, not the client's; turn it on where the clients
            are the operators (a development router; the embedded simulated fleet does).
        token_relay: Where the tokens of a started streamed response are forwarded.
            ``thread``: a relay thread of the router reads each engine socket and writes
            the client's, and gives the stream back to the event loop for anything but
            plain token events (the end, usage, errors, a client that does not keep up,
            an engine gone silent). ``loop``: every token through the event loop, which
            costs more CPU per token (docs/benchmarks.md, "The token relay").
    """

    host: str = attrs.field(default="127.0.0.1", validator=_text)
    port: int = attrs.field(default=8000, validator=_bind_port)
    max_body_bytes: int = attrs.field(default=8 * 1024 * 1024, validator=_positive_int)
    max_header_bytes: int = attrs.field(default=16384, validator=_positive_int)
    header_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    body_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    keepalive_timeout_s: float = attrs.field(default=75.0, validator=_positive)
    max_concurrent_requests: int = attrs.field(default=4096, validator=_positive_int)
    max_connections: int | None = attrs.field(default=None, validator=_opt(_positive_int))
    send_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    shutdown_grace_s: float = attrs.field(default=30.0, validator=_non_negative)
    api_keys: tuple[ApiKeyConfig, ...] = attrs.field(default=(), converter=_key_tuple, repr=_hidden)
    admin_host: str = attrs.field(default="127.0.0.1", validator=_text)
    admin_port: int = attrs.field(default=8001, validator=_bind_port)
    admin_api_keys: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple, validator=_admin_keys, repr=_hidden)
    admin_fleet_writes: bool = True
    engine_load_poll_s: float = attrs.field(default=0.0, validator=_non_negative)
    engine_urls_in_errors: bool = False
    token_relay: Literal["thread", "loop"] = attrs.field(default="thread", validator=_member(("thread", "loop")))


@attrs.frozen(kw_only=True)
class ConnectorConfig:
    """An engine's KV connector: where its KV blocks are served from.

    Attributes:
        type: vLLM KV connector class name, e.g. ``NixlConnector``.
        kv_host: Host of the engine's KV side channel (the descriptor's ``remote_host``).
        kv_port: Port of the engine's KV side channel (the descriptor's ``remote_port``).
    """

    type: str = attrs.field(default="NixlConnector", validator=_text)
    kv_host: str = attrs.field(validator=_text)
    kv_port: int = attrs.field(validator=_port)


@attrs.frozen(kw_only=True)
class KVEventsConfig:
    """Where an engine publishes its KV-cache events (vLLM's ``--kv-events-config``).

    The router subscribes to know exactly which prompt blocks the engine holds; a
    simulated engine publishes there. Name exactly one of ``endpoint`` and ``bind``.

    Attributes:
        endpoint: The engine's ZeroMQ PUB endpoint the router connects to,
            ``tcp://host:port`` (vLLM's ``endpoint`` ``tcp://*:P``, which vLLM binds,
            with the engine's host in place of ``*``).
        bind: For an engine whose publisher connects outward (vLLM's ``endpoint`` is
            not a wildcard: ``tcp://<router host>:P``): the address the router binds
            its SUB socket on, ``tcp://*:P`` or ``tcp://<interface>:P``. One router
            process per address: the engine connects to one.
        replay_endpoint: The ROUTER endpoint that replays missed batches; null means a
            gap in the sequence numbers drops what is known of the engine's cache, and
            a silent stream cannot be told from an idle engine.
        topic: The topic the engine publishes under.
        probe_interval_s: Seconds between two replay probes: the router asks the
            replay endpoint for batches newer than the last it saw, replays any it
            missed, and falls back to the approximate view of the engine's cache when
            two probes in a row find batches and none came live. An engine that
            publishes nothing is probed ever less often (each wait twice the one before,
            up to eight intervals) until it publishes or the router sends it a request.
    """

    endpoint: str | None = attrs.field(default=None, validator=_opt(_zmq))
    bind: str | None = attrs.field(default=None, validator=_opt(_zmq_bind))
    replay_endpoint: str | None = attrs.field(default=None, validator=_opt(_zmq))
    topic: str = ""
    probe_interval_s: float = attrs.field(default=5.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.endpoint is None and self.bind is None:
            raise ConfigError("expected the engine's PUB endpoint (or bind, for a publisher that connects "
                              "to the router)", path="$.endpoint")  # fmt: skip
        if self.endpoint is not None and self.bind is not None:
            raise ConfigError("expected endpoint or bind, not both: the router either connects to the "
                              "engine's PUB socket or binds for the engine to connect", path="$.bind")  # fmt: skip

    @property
    def address(self) -> str:
        """Where the router's SUB socket connects (``endpoint``) or binds (``bind``)."""
        address = self.endpoint if self.endpoint is not None else self.bind
        assert address is not None  # the validator guarantees it
        return address


@attrs.frozen(kw_only=True)
class SimPrefillModel:
    """Prefill latency of a simulated engine: ``a + b*L + c*L**2`` seconds for L tokens;
    with the first k served from its prefix cache, ``a + b*(L-k) + c*(L**2 - k**2) + d*k``.

    Attributes:
        a: Fixed cost per prefill, seconds.
        b: Cost per prompt token, seconds.
        c: Cost per squared prompt token, seconds.
        d: Cost per prompt token served from the prefix cache, seconds.
    """

    a: float = attrs.field(default=0.005, validator=_non_negative)
    b: float = attrs.field(default=2e-05, validator=_non_negative)
    c: float = attrs.field(default=0.0, validator=_non_negative)
    d: float = attrs.field(default=0.0, validator=_non_negative)


@attrs.frozen(kw_only=True)
class SimDecodeModel:
    """Decode step latency of a simulated engine: ``c0 + c1*active + c2*resident_kv``.

    Attributes:
        c0: Fixed cost per decode step, seconds.
        c1: Cost per active sequence in the batch, seconds.
        c2: Cost per resident KV token, seconds.
    """

    c0: float = attrs.field(default=0.004, validator=_non_negative)
    c1: float = attrs.field(default=0.0002, validator=_non_negative)
    c2: float = attrs.field(default=2e-08, validator=_non_negative)


@attrs.frozen(kw_only=True)
class FaultSpec:
    """One scripted fault of a simulated engine.

    Attributes:
        kind: What goes wrong; one of ``FAULT_KINDS``.
        on: Which requests it hits: ``prefill``, ``decode`` or ``any``.
        probability: Chance that an eligible request is hit, 0 to 1.
        times: How many requests it hits before it is spent; null means unlimited.
        after_tokens: Tokens streamed before the fault strikes (stream faults).
        delay_s: Seconds of delay (``delay_headers``, ``slow_transfer``, ``silence_after``).
        status: HTTP status of ``http_error`` and of the ``error_in_stream`` object.
        message: Error message the engine sends.
        variant: How ``malformed_descriptor`` breaks the descriptor; null picks one.
    """

    kind: FaultKind = attrs.field(validator=_member(FAULT_KINDS))
    on: Literal["prefill", "decode", "any"] = attrs.field(default="any", validator=_member(_ON))
    probability: float = attrs.field(default=1.0, validator=_fraction)
    times: int | None = attrs.field(default=None, validator=_opt(_positive_int))
    after_tokens: int = attrs.field(default=0, validator=_non_negative_int)
    delay_s: float = attrs.field(default=0.0, validator=_non_negative)
    status: int = attrs.field(default=500, validator=_http_status)
    message: str = "injected fault"
    variant: DescriptorVariant | None = attrs.field(
        default=None, validator=_opt(_member(_VARIANTS))
    )


@attrs.frozen(kw_only=True)
class SimConfig:
    """A simulated engine (the ``sim`` block of an engine); it listens on the engine's url.

    Attributes:
        seed: Seed of the engine's random choices (noise, fault probabilities).
        model: Model name the engine serves (and lists on ``/v1/models``); it answers
            a request for another model with 404, as vLLM does.
        version: Version the engine reports on ``/version``.
        max_model_len: Context limit the engine reports and enforces.
        prefill: Prefill latency model.
        decode: Decode step latency model.
        kv_capacity_tokens: KV cache capacity in tokens; requests wait beyond it.
        block_size: KV block size in tokens.
        max_num_seqs: Most sequences in one decode batch.
        max_num_batched_tokens: Chunked prefill, as vLLM (V1) schedules prompts: one
            prefill step computes up to this many prompt tokens of the queued prompts, in
            arrival order, a prompt longer than what is left of it in chunks over the steps
            that follow; the step pays the prefill model's fixed ``a`` once, each chunk its
            own tokens. None: one whole prompt a step (vLLM without chunked prefill).
            Decode steps alternate with prefill steps either way.
        transfer_s_per_token: Seconds to pull one KV token from a producer.
        frontend_s_per_token: Seconds the API server spends per prompt token before the
            engine core sees a request (parsing, tokenization, hashing its blocks): each
            request its own, concurrently with the engine's steps, and not in the
            engine's own time histograms, as vLLM's frontend.
        handoff_ttl_s: Seconds a producer holds KV blocks for an unclaimed handoff.
        prefix_caching: Whether the engine reuses KV of a previously seen prompt prefix.
        prompt_tokens_details: Whether usage reports ``prompt_tokens_details.cached_tokens``
            (vLLM's ``--enable-prompt-tokens-details``).
        kv_events_connect: The engine's KV-event publisher connects to its
            ``kv_events.endpoint`` instead of binding it, as vLLM's does for an endpoint
            that is not a wildcard: a router connecting there gets no live batch while
            the replay endpoint answers (a misconfigured engine, to test against).
        scheduling_policy: vLLM's ``--scheduling-policy``: ``fcfs`` admits waiting requests
            in arrival order and answers a request whose ``priority`` is not 0 with 400, as
            vLLM does; ``priority`` admits them by ``priority`` (lower first), then arrival.
        noise: Relative gaussian jitter (standard deviation) on every prefill and step.
        faults: Faults scripted from the start.
    """

    seed: int = 0
    model: str = attrs.field(default="sim-llama", validator=_text)
    version: str = attrs.field(default="0.32.0", validator=_text)
    max_model_len: int = attrs.field(default=4096, validator=_positive_int)
    prefill: SimPrefillModel = attrs.field(factory=SimPrefillModel)
    decode: SimDecodeModel = attrs.field(factory=SimDecodeModel)
    kv_capacity_tokens: int = attrs.field(default=262144, validator=_positive_int)
    block_size: int = attrs.field(default=16, validator=_positive_int)
    max_num_seqs: int = attrs.field(default=256, validator=_positive_int)
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=_opt(_positive_int))
    transfer_s_per_token: float = attrs.field(default=2e-07, validator=_non_negative)
    frontend_s_per_token: float = attrs.field(default=0.0, validator=_non_negative)
    handoff_ttl_s: float = attrs.field(default=480.0, validator=_positive)
    prefix_caching: bool = False
    prompt_tokens_details: bool = False
    kv_events_connect: bool = False
    scheduling_policy: Literal["fcfs", "priority"] = attrs.field(default="fcfs", validator=_member(("fcfs", "priority")))
    noise: float = attrs.field(default=0.0, validator=_non_negative)
    faults: tuple[FaultSpec, ...] = attrs.field(default=(), converter=_fault_tuple)


class _Roles:
    """What an engine (or a group's engines) may do, from its ``roles``."""

    roles: tuple[Role, ...]

    @property
    def can_prefill(self) -> bool:
        """Whether the ``prefill`` role is among the roles."""
        return "prefill" in self.roles

    @property
    def can_decode(self) -> bool:
        """Whether the ``decode`` role is among the roles."""
        return "decode" in self.roles


@attrs.frozen(kw_only=True)
class EngineConfig(_Roles):
    """One engine of the fleet (an item of ``engines``).

    Attributes:
        name: Unique name used in journals, metrics and profiles.
        url: Base URL of the engine's OpenAI HTTP surface, ``http(s)://host:port``.
        roles: What the engine may do: ``prefill``, ``decode`` or both.
        model: The model the engine serves. The engines of one model are its pool: a
            request is placed only on producers and consumers of the model it names, and
            each model needs a producer and a consumer. A request that names no model is
            served by the fleet's only model (400 when it serves several). Null: the
            router learns the model from the engine's ``GET /v1/models`` (every model it
            lists; a simulated engine lists its ``sim.model``, which must equal ``model``
            when both are given), and until then places there only while the fleet serves
            one model.
        api_key: Bearer key sent to the engine (visible ASCII: it goes in a request
            header); null sends none. Never shown in a message.
        connector: KV connector of the engine; needed for remote handoff.
        kv_events: Where the engine publishes KV-cache events; null: none are read.
        sim: Run a simulated engine on ``url`` with these settings.
    """

    name: str = attrs.field(validator=_engine_name)
    url: str = attrs.field(converter=_strip_slash, validator=_url)
    roles: tuple[Role, ...] = attrs.field(converter=_role_tuple, validator=_roles)
    model: str | None = attrs.field(default=None, validator=_opt(_text))
    api_key: str | None = attrs.field(default=None, validator=_opt(_header_token))
    connector: ConnectorConfig | None = None
    kv_events: KVEventsConfig | None = None
    sim: SimConfig | None = None

    def __attrs_post_init__(self) -> None:
        if self.model is not None and self.sim is not None and self.sim.model != self.model:
            # The router would send one name and the simulated engine 404 it.
            raise ConfigError(f"expected the engine's model {self.model!r}", path="$.sim.model")

    @property
    def host(self) -> str:
        """Host part of ``url`` (IPv6 without brackets)."""
        hp = _host_port(self.url)
        assert hp is not None  # the validator guarantees it
        return hp[0]

    @property
    def port(self) -> int:
        """Port part of ``url``."""
        hp = _host_port(self.url)
        assert hp is not None
        return hp[1]


@attrs.frozen(kw_only=True)
class GroupConnectorConfig:
    """The KV connector of every engine of a group; its KV host is the engine's address.

    Attributes:
        type: vLLM KV connector class name, e.g. ``NixlConnector``.
        kv_port: Port of each engine's KV side channel (the descriptor's ``remote_port``).
    """

    type: str = attrs.field(default="NixlConnector", validator=_text)
    kv_port: int = attrs.field(validator=_port)


@attrs.frozen(kw_only=True)
class GroupKVEventsConfig:
    """Where every engine of a group publishes its KV-cache events, on its own address.

    Attributes:
        port: The ZeroMQ PUB port (vLLM's ``--kv-events-config`` ``endpoint``).
        replay_port: The ROUTER replay port; null means none.
        topic: The topic the engines publish under.
    """

    port: int = attrs.field(validator=_port)
    replay_port: int | None = attrs.field(default=None, validator=_opt(_port))
    topic: str = ""


@attrs.frozen(kw_only=True)
class EngineGroupConfig(_Roles):
    """Engines found in DNS, one per address ``host`` resolves to (an item of ``engine_groups``).

    As a Kubernetes headless Service publishes its ready pods: every address is one engine
    at ``http://<address>:<port>``, named ``<name>-<address>``. The router resolves
    ``host`` again every ``resolve_every_s`` and adds and drains engines as addresses
    appear and disappear, as a fleet reload would.

    Attributes:
        name: Unique group name; its engines are named ``<name>-<address>``.
        host: The DNS name to resolve (e.g. ``vllm-decode.llm.svc.cluster.local``).
        port: The port of each engine's OpenAI HTTP surface.
        roles: What the group's engines may do: ``prefill``, ``decode`` or both.
        model: Model name to request; null uses each engine's only model.
        api_key: Bearer key sent to the engines (visible ASCII: it goes in a request
            header); null sends none. Never shown in a message.
        connector: KV connector of the engines; needed for remote handoff.
        kv_events: Where the engines publish KV-cache events; null: none are read.
        resolve_every_s: Seconds between two resolutions of ``host``.
        max_engines: Most engines the group has: an answer with more addresses keeps the
            first this many in sorted order (the same ones at every lookup) and says so in
            the log and on ``GET /fleet``, so that a runaway answer cannot flood the fleet.
    """

    name: str = attrs.field(validator=_name)
    host: str = attrs.field(validator=_text)
    port: int = attrs.field(validator=_port)
    roles: tuple[Role, ...] = attrs.field(converter=_role_tuple, validator=_roles)
    model: str | None = attrs.field(default=None, validator=_opt(_text))
    api_key: str | None = attrs.field(default=None, validator=_opt(_header_token))
    connector: GroupConnectorConfig | None = None
    kv_events: GroupKVEventsConfig | None = None
    resolve_every_s: float = attrs.field(default=10.0, validator=_positive)
    max_engines: int = attrs.field(default=1024, validator=_positive_int)


# ------------------------------------------------------------------ policy sections


@attrs.frozen(kw_only=True)
class EngineTimeouts:
    """Deadlines of engine legs (the ``engine`` section).

    Attributes:
        first_token_timeout_s: From opening a decode stream to its first token.
        decode_read_timeout_s: Max silence after the first token (it ends a stream that
            long after its last chunk, at most 1/64 of it later); 0 leaves only request_timeout_s.
        request_timeout_s: Whole-request deadline from arrival.
        connect_timeout_s: TCP connect to an engine.
    """

    first_token_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    decode_read_timeout_s: float = attrs.field(default=30.0, validator=_non_negative)
    request_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    connect_timeout_s: float = attrs.field(default=5.0, validator=_positive)


_MIB = 1024 * 1024


@attrs.frozen(kw_only=True)
class EngineLimits:
    """What the router accepts from an engine (the ``engine_limits`` section).

    An engine is trusted no more than a client: each limit bounds what one engine's
    answer can hold in the router's memory, and an answer past it is that engine's
    fault (an engine protocol error, counted in ``narwhal_engine_bad_input_total``),
    never the router's. They take effect at start (a reload that changes them is
    refused).

    Attributes:
        max_response_bytes: Largest non-streaming answer read from an engine (a
            prefill's one-token completion, ``/tokenize``, ``/v1/models``, ``/version``);
            one that declares or sends more is the engine's protocol error.
        max_metrics_bytes: Largest ``/metrics`` answer read (a vLLM exposition is about
            60 KB per engine core).
        max_stream_event_bytes: Largest event (or line) of a decode stream (the first
            event carries the prompt's token ids: about 7 bytes a token).
        max_listed_models: Most models one ``/v1/models`` answer may list (base model,
            aliases and LoRA adapters).
        kv_max_message_bytes: Largest KV-event message (ZeroMQ ``MAXMSGSIZE``): ZeroMQ
            drops the connection of a peer that sends a larger one, and the router
            replays what it missed.
        kv_max_queued_messages: KV-event messages ZeroMQ queues for the router before it
            drops (``RCVHWM``); with ``kv_max_message_bytes`` it bounds what one engine's
            live events hold in memory.
        kv_replay_timeout_s: Total deadline of one replay from an engine's replay
            endpoint, however fast its messages come.
        kv_replay_max_batches: Most batches one replay may return (vLLM buffers 10,000
            steps by default); a longer one is abandoned and the engine's view dropped.
        kv_replay_max_bytes: Most payload bytes one replay may return.
    """

    max_response_bytes: int = attrs.field(default=64 * _MIB, validator=_positive_int)
    max_metrics_bytes: int = attrs.field(default=16 * _MIB, validator=_positive_int)
    max_stream_event_bytes: int = attrs.field(default=16 * _MIB, validator=_positive_int)
    max_listed_models: int = attrs.field(default=1024, validator=_positive_int)
    kv_max_message_bytes: int = attrs.field(default=16 * _MIB, validator=_positive_int)
    kv_max_queued_messages: int = attrs.field(default=1000, validator=_positive_int)
    kv_replay_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    kv_replay_max_batches: int = attrs.field(default=10_000, validator=_positive_int)
    kv_replay_max_bytes: int = attrs.field(default=256 * _MIB, validator=_positive_int)


@attrs.frozen(kw_only=True)
class HandoffConfig:
    """The KV handoff between producer and consumer (the ``handoff`` section).

    Attributes:
        max_age_s: Seconds from the start of the prefill leg until the handoff expires;
            more than engine.first_token_timeout_s, since the age includes the prefill.
    """

    max_age_s: float = attrs.field(default=60.0, validator=_positive)


@attrs.frozen(kw_only=True)
class RetryBudgetConfig:
    """How many retries the router may add to the load (``recovery.retry_budget``).

    Attributes:
        ratio: Retries allowed per first attempt over the window.
        min_retries_per_s: Retries always allowed per second, whatever the ratio.
        window_s: Sliding window the ratio is measured over, seconds.
    """

    ratio: float = attrs.field(default=0.2, validator=_non_negative)
    min_retries_per_s: float = attrs.field(default=1.0, validator=_non_negative)
    window_s: float = attrs.field(default=10.0, validator=_positive)


@attrs.frozen(kw_only=True)
class RecoveryConfig:
    """Failure handling (the ``recovery`` section).

    Attributes:
        eject_after: Consecutive stream failures that eject an engine from placement
            (even the last of its role: requests for that role are then refused at once).
        failure_quarantine_s: Seconds a failed engine is skipped by placement; 0 disables.
        max_attempts: Prefill/decode attempts per request, the first included.
        retry_budget: Limit on retries across all requests.
        probe_interval_s: Seconds between readmission probes of an ejected engine (and
            the ``Retry-After`` of a request that finds no engine of a role while a probe
            of one runs).
        resume_streams: Continue a decode that fails after output was sent on another
            engine (the prompt plus the tokens sent, as a token-id prompt); false ends
            the stream with the terminal error event.
        max_resumes: Resumes per request, when ``resume_streams`` is on.
    """

    eject_after: int = attrs.field(default=3, validator=_positive_int)
    failure_quarantine_s: float = attrs.field(default=0.0, validator=_non_negative)
    max_attempts: int = attrs.field(default=1, validator=_positive_int)
    retry_budget: RetryBudgetConfig = attrs.field(factory=RetryBudgetConfig)
    probe_interval_s: float = attrs.field(default=5.0, validator=_positive)
    resume_streams: bool = False
    max_resumes: int = attrs.field(default=2, validator=_positive_int)


@attrs.frozen(kw_only=True)
class EngineContract:
    """What every engine must report; checked by preflight and breaker readmission.

    Attributes:
        version: Engine version (``/version``); null accepts any.
        model: Served model name; null accepts any (keep it null when engines declare
            several models).
        connector: KV connector class; null accepts any.
        max_model_len: Context limit (``/tokenize``); null accepts any.
    """

    version: str | None = attrs.field(default=None, validator=_opt(_text))
    model: str | None = attrs.field(default=None, validator=_opt(_text))
    connector: str | None = attrs.field(default=None, validator=_opt(_text))
    max_model_len: int | None = attrs.field(default=None, validator=_opt(_positive_int))


@attrs.frozen(kw_only=True)
class ProfilesConfig:
    """Latency profiles and their acceptance limits (the ``profiles`` section).

    Attributes:
        path: profiles.json to price placement with; its samples sidecar lies beside it.
            A regular file of at most 64 MiB (a device, a FIFO or a larger file is refused
            before it is read).
        max_decode_fit_mape: Largest accepted decode fit error (mean absolute percentage).
        max_decode_cv_mape: Largest accepted leave-one-cell-out decode error.
    """

    path: str | None = attrs.field(default=None, validator=_opt(_text))
    max_decode_fit_mape: float = attrs.field(default=0.05, validator=_positive)
    max_decode_cv_mape: float = attrs.field(default=0.13, validator=_positive)


@attrs.frozen(kw_only=True)
class SLOConfig:
    """Latency targets (``controller.slo``).

    Attributes:
        ttft_s: Time-to-first-token target, seconds; null means none.
        tpot_s: Time-per-output-token target, seconds; null means none.
    """

    ttft_s: float | None = attrs.field(default=None, validator=_opt(_positive))
    tpot_s: float | None = attrs.field(default=None, validator=_opt(_positive))


@attrs.frozen(kw_only=True)
class ReactiveConfig:
    """Reactive role movement (``controller.reactive``).

    Attributes:
        enabled: Whether the controller moves engines between roles (a fleet of one
            model only: its demand model pools every engine).
        movement_margin: Predicted relative gain a move must exceed.
        interval_s: Seconds between controller decisions.
        deployment_record: Directory of the passing preflight (``narwhal check --record``)
            for this fleet; reactive control requires one that matches the fleet document.
    """

    enabled: bool = False
    movement_margin: float = attrs.field(default=0.10, validator=_positive)
    interval_s: float = attrs.field(default=10.0, validator=_positive)
    deployment_record: str | None = attrs.field(default=None, validator=_opt(_text))


@attrs.frozen(kw_only=True)
class ControllerConfig:
    """Placement control under the SLO (the ``controller`` section).

    Attributes:
        slo: Latency targets.
        admission: When no placement meets the SLO: ``wait`` for capacity or ``refuse`` (503;
            a request that would itself meet the targets but would make the prompts
            waiting for a producer's next step late waits for that step either way).
        admission_bound: What admission holds against the TTFT target: ``lower`` the low
            end of the producer's prediction (the prediction times the 10th percentile of
            observed / predicted TTFT over the producer's latest priced requests; before
            20 of them, the low end of its profile's bootstrap interval), so that only a
            request that cannot meet the target is refused or waits, while placement still
            ranks by the prediction; ``point`` the prediction itself (refuses requests
            predicted over the target by less than the prediction's own error).
        reactive: Reactive role movement.
        prompt_tokens: How a text prompt's length is known before placement: ``tokenize``
            asks a producer's /tokenize (exact, one more engine round trip per request, and
            the router refuses over-long prompts itself); ``estimate`` scales the prompt's
            UTF-8 size by a tokens-per-byte ratio learned from the producers' own counts
            (the engine refuses over-long prompts); ``auto`` tokenizes when placement is
            priced by profiles and estimates otherwise. Token-id prompts are always
            counted exactly, and the journal always records the producer's count.
        pricing: What a profile-priced placement prices with: ``point`` the fitted
            prediction, ``upper`` its bootstrap upper bound (the prediction times the
            profile's ``upper_factor``: conservative, fewer requests admitted per engine).
        prefix_cache: ``auto`` keeps a view of the prefix cache of every engine that
            reports ``enable_prefix_caching`` (exact from its ``kv_events``, else from
            the prompts placed on it) and prices each producer's hit; ``off`` prices
            every prefill as if nothing were cached and reads no KV events.
        cache_plan: ``auto`` (with ``prefix_cache: auto``, profiles and a TTFT target
            in ``slo.ttft_s``; without one each request is placed by headroom) plans where
            prefixes and sessions live: each reused prefix or session has an owner among
            the producers, by their speed and their caches' capacity, that takes its
            requests while it meets the TTFT target within 0.8 of it (a miss included),
            and a placement's price adds what its new blocks cost later requests;
            ``off`` places each request for its own predicted TTFT alone.
    """

    slo: SLOConfig = attrs.field(factory=SLOConfig)
    pricing: Literal["point", "upper"] = attrs.field(
        default="point", validator=_member(("point", "upper"))
    )
    admission: Literal["wait", "refuse"] = attrs.field(
        default="wait", validator=_member(_ADMISSION)
    )
    admission_bound: Literal["lower", "point"] = attrs.field(
        default="lower", validator=_member(("lower", "point"))
    )
    prompt_tokens: Literal["auto", "tokenize", "estimate"] = attrs.field(
        default="auto", validator=_member(_PROMPT_TOKENS)
    )
    reactive: ReactiveConfig = attrs.field(factory=ReactiveConfig)
    prefix_cache: Literal["auto", "off"] = attrs.field(default="auto", validator=_member(("auto", "off")))
    cache_plan: Literal["auto", "off"] = attrs.field(default="auto", validator=_member(("auto", "off")))


@attrs.frozen(kw_only=True)
class JournalConfig:
    """The router journal (the ``journal`` section).

    Attributes:
        path: JSON-lines file the router appends one record per request to.
        queue_size: Records the writer's channel holds; past it they wait in an overflow list (never dropped).
        fsync: Whether each write batch is fsynced.
    """

    path: str = attrs.field(default="runs/journal.jsonl", validator=_text)
    queue_size: int = attrs.field(default=10000, validator=_positive_int)
    fsync: bool = True


def _split_url(v: Any) -> tuple[SplitResult, int | None] | None:
    """``v``'s parts and port, or None when it is no URL (or its port is not a number)."""
    if not isinstance(v, str):
        return None
    try:
        parts = urlsplit(v)
        return parts, parts.port
    except ValueError:
        return None


def _collector_url(v: Any) -> bool:
    """An OTLP collector's base URL: http(s)://host:port, a path allowed (a collector behind a
    proxy), no query or fragment."""
    split = _split_url(v)
    if split is None:
        return False
    parts, port = split
    return (
        parts.scheme in ("http", "https") and bool(parts.hostname) and port is not None
        and "@" not in parts.netloc and not parts.query and not parts.fragment
    )  # fmt: skip


@attrs.frozen(kw_only=True)
class TracingConfig:
    """OpenTelemetry tracing of every request (the ``tracing`` section; docs/operations.md).

    Off unless this section names an ``endpoint`` or the standard OpenTelemetry environment
    turns it on (``OTEL_TRACES_EXPORTER=otlp``, or ``OTEL_EXPORTER_OTLP_ENDPOINT`` with no
    exporter named); ``OTEL_SDK_DISABLED=true`` keeps it off. What this section sets wins
    over the environment, which supplies the rest (headers, timeouts, TLS, batching). Needs
    the OpenTelemetry packages: ``pip install 'narwhal[tracing]'``.

    Attributes:
        endpoint: The OTLP collector's base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` gives it:
            ``http://collector:4318`` for http/protobuf (spans go to ``/v1/traces`` under it),
            ``http://collector:4317`` for grpc (``https`` for TLS); setting it turns tracing
            on. null: the environment decides.
        protocol: ``http/protobuf`` or ``grpc``; null: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
            or ``OTEL_EXPORTER_OTLP_PROTOCOL``, else http/protobuf.
        sampling_ratio: Fraction of the traces started here that are sampled (recorded and
            exported), 0 to 1. null: ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``
            decide (every trace, and a client's decision for its own, by default).
        parent_based: With sampling_ratio: a request whose client sent a ``traceparent``
            follows the client's sampling decision, and the ratio applies to traces that
            start at the router; false applies the ratio to every request.
        service_name: The ``service.name`` the spans carry; null: ``OTEL_SERVICE_NAME`` (or
            ``OTEL_RESOURCE_ATTRIBUTES``), else ``narwhal``.
    """

    endpoint: str | None = attrs.field(
        default=None,
        validator=_opt(_rule(_collector_url, "expected an http(s)://host:port URL (a path allowed)")),
    )
    protocol: Literal["http/protobuf", "grpc"] | None = attrs.field(
        default=None, validator=_opt(_member(OTLP_PROTOCOLS))
    )
    sampling_ratio: float | None = attrs.field(default=None, validator=_opt(_fraction))
    parent_based: bool = True
    service_name: str | None = attrs.field(default=None, validator=_opt(_text))


# ------------------------------------------------------------------ tenants and classes

_ON_OUTAGE = ("local", "refuse")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110)
_header = _rule(lambda v: isinstance(v, str) and _HEADER.fullmatch(v) is not None, "expected an HTTP header name")


def _class_tuple(value: Iterable[ClassConfig]) -> tuple[ClassConfig, ...]:
    return tuple(value)


def _tenant_tuple(value: Iterable[TenantConfig]) -> tuple[TenantConfig, ...]:
    return tuple(value)


def _redis_url(v: Any) -> bool:
    split = _split_url(v)
    if split is None:
        return False
    parts, port = split
    db = parts.path.lstrip("/")
    return (parts.scheme == "redis" and bool(parts.hostname) and "@" not in parts.netloc
            and (db == "" or db.isdigit()) and not parts.query and not parts.fragment
            and (port is None or 1 <= port <= 65535))  # fmt: skip


@attrs.frozen(kw_only=True)
class ClassConfig:
    """A latency class (an item of ``tenancy.classes``): its targets, its priority, and
    whether its requests may wait in the router for capacity.

    Attributes:
        name: Unique class name (journal, metrics, the ``x-narwhal-class`` header).
        priority: Lower is more urgent (vLLM's convention): queued requests are released in
            this order, and a class places requests only where the classes more urgent than
            it keep their targets (docs/operations.md). Passed to the engines as the request's
            ``priority`` with ``tenancy.engine_priority``.
        slo: The class's latency targets; placement prices its requests against them.
            null: ``controller.slo``.
        wait: Whether a request that no placement serves within the targets now waits in the
            router's queue (bounded, released in priority order and fairly between tenants)
            instead of an immediate 503.
        max_wait_s: How long a request may wait in the queue from its arrival before a 503;
            null: the class's TTFT target (waiting longer cannot meet it), else
            ``engine.request_timeout_s``.
        max_queued: Most requests of the class waiting at once (per router process); more
            are refused with 503 at once.
    """

    name: str = attrs.field(validator=_name)
    priority: int = 0
    slo: SLOConfig | None = None
    wait: bool = False
    max_wait_s: float | None = attrs.field(default=None, validator=_opt(_positive))
    max_queued: int = attrs.field(default=1000, validator=_positive_int)


@attrs.frozen(kw_only=True)
class TenantLimits:
    """What one tenant may ask of the fleet (``tenancy.tenants[].limits``); past a limit a
    request is answered 429 with ``Retry-After``. null: no limit. Without
    ``tenancy.store`` each router process enforces its share (``tenancy.replicas``).

    Attributes:
        max_in_flight: Requests of the tenant admitted and not yet ended.
        requests_per_s: Requests admitted per second (a token bucket ``burst_s`` deep).
        tokens_per_s: Tokens admitted per second, each request counted at admission as its
            prompt tokens plus its output limit (``max_tokens``).
        burst_s: Depth of the rate buckets in seconds of their rate: a tenant idle that long
            may send that many seconds' worth at once.
    """

    max_in_flight: int | None = attrs.field(default=None, validator=_opt(_positive_int))
    requests_per_s: float | None = attrs.field(default=None, validator=_opt(_positive))
    tokens_per_s: float | None = attrs.field(default=None, validator=_opt(_positive))
    burst_s: float = attrs.field(default=1.0, validator=_positive)


@attrs.frozen(kw_only=True)
class TenantConfig:
    """One tenant (an item of ``tenancy.tenants``): named by its API keys' ``name`` (or the
    gateway's ``tenancy.header``).

    Attributes:
        name: Unique tenant name.
        latency_class: The class its requests belong to (a ``tenancy.classes[].name``).
        classes: Other classes its requests may ask for with the ``x-narwhal-class`` header
            (``tenancy.class_header``) that are more urgent than its own; a class less
            urgent than its own may always be asked for.
        weight: Its share of the fleet against the other tenants of the same priority:
            queued requests are released to the tenant with the fewest tokens served per
            unit of weight.
        limits: Its limits.
    """

    name: str = attrs.field(validator=_name)
    latency_class: str = attrs.field(validator=_name)
    classes: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    weight: float = attrs.field(default=1.0, validator=_positive)
    limits: TenantLimits = attrs.field(factory=TenantLimits)


@attrs.frozen(kw_only=True)
class StoreConfig:
    """The shared store that makes tenants' limits and shares hold fleet-wide
    (``tenancy.store``): a Redis server every router process reaches.

    Attributes:
        url: ``redis://host:port/db`` (port 6379, db 0 when left out).
        password_env: The environment variable holding the server's password (``AUTH``);
            null: none.
        timeout_s: Longest the router waits for one answer of the store on a request's path;
            past it the store counts as unreachable for that request.
        sync_s: Seconds between two exchanges of the tenants' served tokens (the fair
            shares) with the store.
        key_prefix: Prefix of every key the router writes in the store.
        on_outage: What a request of a tenant with limits gets while the store is
            unreachable: ``local`` (fail open to this process's share, as without a
            store) or ``refuse`` (fail closed: 503 with ``Retry-After``).
    """

    url: str = attrs.field(validator=_rule(_redis_url, "expected a redis://host:port/db URL (no password in it: use password_env)"))
    password_env: str | None = attrs.field(default=None, validator=_opt(_text))
    timeout_s: float = attrs.field(default=0.05, validator=_positive)
    sync_s: float = attrs.field(default=0.5, validator=_positive)
    key_prefix: str = attrs.field(default="narwhal", validator=_text)
    on_outage: Literal["local", "refuse"] = attrs.field(default="local", validator=_member(_ON_OUTAGE))


@attrs.frozen(kw_only=True)
class TenancyConfig:
    """Tenants, latency classes, limits and the router's wait queue (the ``tenancy``
    section; docs/operations.md). Without it the fleet has one class: ``controller.slo``
    and ``controller.admission``.

    Attributes:
        classes: The latency classes; names unique.
        tenants: The tenants; names unique.
        default_tenant: The tenant of a request that names none (an unnamed key, no key,
            no gateway header); null: such a request is refused with 403.
        header: A header that names the request's tenant, set by a trusted gateway in front
            of the router (which must drop any the client sent); null: tenants are named
            by their API keys (``server.api_keys``).
        class_header: The header with which a request asks for another class of its tenant's
            (``tenancy.tenants[].classes``).
        engine_priority: Send each request's class priority to the engines (the request
            body's ``priority``). Only for engines that run ``--scheduling-policy priority``:
            vLLM refuses a non-zero priority with 400 otherwise.
        replicas: Router processes sharing the limits when there is no store: replicas
            behind the load balancer (``narwhal serve --workers N`` multiplies it by N);
            each enforces its share of every limit (rates divided by it, ``max_in_flight``
            divided and rounded down, at least 1).
        store: The shared store of limits and fair shares; null: each process keeps its own.
    """

    classes: tuple[ClassConfig, ...] = attrs.field(converter=_class_tuple)
    tenants: tuple[TenantConfig, ...] = attrs.field(converter=_tenant_tuple)
    default_tenant: str | None = attrs.field(default=None, validator=_opt(_name))
    header: str | None = attrs.field(default=None, validator=_opt(_header))
    class_header: str = attrs.field(default="x-narwhal-class", validator=_header)
    engine_priority: bool = False
    replicas: int = attrs.field(default=1, validator=_positive_int)
    store: StoreConfig | None = None

    def __attrs_post_init__(self) -> None:
        if not self.classes:
            raise ConfigError("expected at least one class", path="$.classes")
        if not self.tenants:
            raise ConfigError("expected at least one tenant", path="$.tenants")
        names: set[str] = set()
        for i, c in enumerate(self.classes):
            if c.name in names:
                raise ConfigError(f"duplicate class name {c.name!r}", path=f"$.classes[{i}].name")
            names.add(c.name)
        known = ", ".join(repr(c.name) for c in self.classes)
        tenants: set[str] = set()
        for i, t in enumerate(self.tenants):
            if t.name in tenants:
                raise ConfigError(f"duplicate tenant name {t.name!r}", path=f"$.tenants[{i}].name")
            tenants.add(t.name)
            if t.latency_class not in names:
                raise ConfigError(f"no class {t.latency_class!r} (classes: {known})", path=f"$.tenants[{i}].latency_class")
            for j, other in enumerate(t.classes):
                if other not in names:
                    raise ConfigError(f"no class {other!r} (classes: {known})", path=f"$.tenants[{i}].classes[{j}]")
        if self.default_tenant is not None and self.default_tenant not in tenants:
            raise ConfigError(f"no tenant {self.default_tenant!r}", path="$.default_tenant")
        if self.header is not None and self.header.lower() == self.class_header.lower():
            raise ConfigError("expected another header than class_header", path="$.header")

    def class_named(self, name: str) -> ClassConfig:
        """The class called ``name`` (the document guarantees tenants name known ones)."""
        return next(c for c in self.classes if c.name == name)


@attrs.frozen(kw_only=True)
class FleetConfig:
    """The whole fleet document.

    Attributes:
        server: The router's HTTP listener.
        engines: The engines; names and urls unique, at least one prefill and one decode
            (counting those of ``engine_groups``), and so for each model declared. An
            engine a reload or DNS adds takes requests once its readiness probe passes
            (at most 32 probed at once).
        engine: Deadlines of engine legs.
        engine_limits: What the router accepts from an engine (sizes, counts, deadlines).
        handoff: The KV handoff.
        recovery: Failure handling.
        engine_contract: What every engine must report; null skips contract checks.
        profiles: Latency profiles and their limits.
        controller: Placement control under the SLO.
        journal: The router journal.
        engine_groups: Engines found in DNS (a Kubernetes headless Service per role).
        tracing: OpenTelemetry tracing (off unless configured here or by the environment).
        tenancy: Tenants, latency classes, limits and the wait queue; null: one class
            (``controller.slo``, ``controller.admission``) for every request.
    """

    server: ServerConfig = attrs.field(factory=ServerConfig)
    engines: tuple[EngineConfig, ...] = attrs.field(converter=_engine_tuple, validator=_engines)
    engine: EngineTimeouts = attrs.field(factory=EngineTimeouts)
    engine_limits: EngineLimits = attrs.field(factory=EngineLimits)
    handoff: HandoffConfig = attrs.field(factory=HandoffConfig)
    recovery: RecoveryConfig = attrs.field(factory=RecoveryConfig)
    engine_contract: EngineContract | None = None
    profiles: ProfilesConfig = attrs.field(factory=ProfilesConfig)
    controller: ControllerConfig = attrs.field(factory=ControllerConfig)
    journal: JournalConfig = attrs.field(factory=JournalConfig)
    engine_groups: tuple[EngineGroupConfig, ...] = attrs.field(default=(), converter=_group_tuple)
    tracing: TracingConfig = attrs.field(factory=TracingConfig)
    tenancy: TenancyConfig | None = None

    def __attrs_post_init__(self) -> None:
        if not self.engines and not self.engine_groups:
            raise ConfigError("expected at least one engine (or an engine group)", path="$.engines")
        seen: dict[tuple[Any, ...], str] = {}  # name / url / KV endpoint -> engine name
        for i, e in enumerate(self.engines):
            if INCARNATION in e.name:  # the router's own names for later incarnations
                raise ConfigError(_NAME_MESSAGE, path=f"$.engines[{i}].name")
            checks = [
                (("name", e.name), f"duplicate engine name {e.name!r}", "name"),
                (("url", urlsplit(e.url).scheme, e.host.lower(), e.port), "url", "url"),
            ]
            if e.connector is not None:
                kv = ("kv", e.connector.kv_host.lower(), e.connector.kv_port)
                checks.append((kv, "KV endpoint", "connector.kv_port"))
            for key, what, field in checks:
                if key in seen:
                    owner = f" already used by engine {seen[key]!r}" if field != "name" else ""
                    raise ConfigError(what + owner, path=f"$.engines[{i}].{field}")
                seen[key] = e.name
        groups = self.engine_groups
        names = {e.name for e in self.engines}
        for i, g in enumerate(groups):
            if g.name in names:
                what = "engine group" if any(o.name == g.name for o in groups[:i]) else "engine"
                raise ConfigError(f"duplicate name {g.name!r} (an {what} has it)", path=f"$.engine_groups[{i}].name")
            names.add(g.name)
        for role in ROLES:
            if not any(role in e.roles for e in self.engines) and not any(role in g.roles for g in groups):
                raise ConfigError(f"no engine has the {role} role", path="$.engines")
        self._check_model_pools()
        # Counted once (a fleet of thousands of engines is checked in linear time): the
        # decoders of each declared model, and those that declare none (of every pool).
        members: tuple[EngineConfig | EngineGroupConfig, ...] = (*self.engines, *groups)
        decoders = collections.Counter(m.model for m in members if m.can_decode)
        every = sum(decoders.values())

        def other_decoders(m: EngineConfig | EngineGroupConfig, itself: int) -> int:
            pool = every if m.model is None else decoders[m.model] + decoders[None]
            return pool - itself

        for i, e in enumerate(self.engines):
            if e.can_prefill and e.connector is None and other_decoders(e, int(e.can_decode)) > 0:
                message = "a prefill engine needs a connector when another engine can decode"
                raise ConfigError(message, path=f"$.engines[{i}].connector")
        for i, g in enumerate(groups):
            if g.can_prefill and g.connector is None and other_decoders(g, 0) > 0:
                message = "a prefill engine group needs a connector when an engine can decode"
                raise ConfigError(message, path=f"$.engine_groups[{i}].connector")
        first_token = self.engine.first_token_timeout_s
        if self.handoff.max_age_s <= first_token:
            # The handoff's age starts with the prefill leg, before the first-token
            # deadline: at or below it, a stalled decode always ends as a handoff expiry
            # and the first-token deadline can never fire.
            message = (
                f"expected a number > $.engine.first_token_timeout_s ({first_token:g}): the handoff's "
                "age includes the prefill leg and the decode leg up to its first token"
            )
            raise ConfigError(message, path="$.handoff.max_age_s")
        margin = self.controller.reactive.movement_margin
        if self.profiles.max_decode_fit_mape > margin:
            message = f"expected a number <= controller.reactive.movement_margin ({margin:g})"
            raise ConfigError(message, path="$.profiles.max_decode_fit_mape")
        pinned = self.engine_contract.model if self.engine_contract is not None else None
        other = next((e for e in self.engines if pinned is not None and e.model not in (None, pinned)), None)
        if other is not None:
            message = (
                f"engine {other.name!r} declares model {other.model!r}: a contract that pins one model "
                "fails every engine of another (leave it null when the fleet serves several)"
            )
            raise ConfigError(message, path="$.engine_contract.model")
        if self.controller.reactive.enabled and len(self.models) > 1:
            # Role movement prices one pool's demand; pooling several models' would move
            # an engine of one model to relieve another's.
            message = f"reactive role movement supports a fleet of one model (this one serves {_names(self.models)})"
            raise ConfigError(message, path="$.controller.reactive.enabled")
        self._check_tenancy()

    def _check_tenancy(self) -> None:
        """Every key name is a tenant's, and some request can name a tenant."""
        tenancy = self.tenancy
        named = [(i, k.name) for i, k in enumerate(self.server.api_keys) if k.name is not None]
        if tenancy is None:
            if named:
                message = "a key names a tenant, but the document has no tenancy section"
                raise ConfigError(message, path=f"$.server.api_keys[{named[0][0]}].name")
            return
        tenants = {t.name for t in tenancy.tenants}
        for i, name in named:
            if name not in tenants:
                raise ConfigError(f"no tenant {name!r} in tenancy.tenants", path=f"$.server.api_keys[{i}].name")
        if tenancy.default_tenant is None and tenancy.header is None and not named:
            message = ("no request can name a tenant: give a key a tenant's name (server.api_keys), "
                       "a gateway header (tenancy.header) or a default_tenant")  # fmt: skip
            raise ConfigError(message, path="$.tenancy.default_tenant")

    def _check_model_pools(self) -> None:
        """Every declared model has a producer and a consumer (engines and engine groups
        alike), unless members that declare no model (their ``/v1/models`` tells) might
        fill the role; ``narwhal check`` then checks the live pools."""
        members: list[tuple[str, EngineConfig | EngineGroupConfig]] = [
            (f"$.engines[{i}]", e) for i, e in enumerate(self.engines)
        ]
        members += [(f"$.engine_groups[{i}]", g) for i, g in enumerate(self.engine_groups)]
        undeclared = [m for _, m in members if m.model is None]
        for model in self.models:
            pool = [(path, m) for path, m in members if m.model == model]
            for role in ROLES:
                if not any(role in m.roles for m in [*(m for _, m in pool), *undeclared]):
                    raise ConfigError(
                        f"model {model!r} has no engine with the {role} role "
                        f"(its engines: {_names(m.name for _, m in pool)})",
                        path=f"{pool[0][0]}.model",
                    )

    @property
    def models(self) -> tuple[str, ...]:
        """The models the engines and engine groups declare (their ``model``), in document order."""
        declared = [e.model for e in self.engines] + [g.model for g in self.engine_groups]
        return tuple(dict.fromkeys(m for m in declared if m is not None))

    def engine_named(self, name: str) -> EngineConfig:
        """The engine called ``name`` (``engine`` is the timeouts section).

        Raises:
            KeyError: No engine has that name; the message lists the names.
        """
        for e in self.engines:
            if e.name == name:
                return e
        known = ", ".join(e.name for e in self.engines)
        raise KeyError(f"no engine named {name!r} in the fleet (engines: {known})")

    @property
    def prefill_engines(self) -> tuple[EngineConfig, ...]:
        """Engines with the prefill role, in document order."""
        return tuple(e for e in self.engines if e.can_prefill)

    @property
    def decode_engines(self) -> tuple[EngineConfig, ...]:
        """Engines with the decode role, in document order."""
        return tuple(e for e in self.engines if e.can_decode)


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


# ------------------------------------------------------------------ the converter

converter = cattrs.Converter(forbid_extra_keys=True, unstruct_collection_overrides={tuple: list})


def _scalar(ok: Callable[[Any], bool], message: str) -> Callable[[Any, Any], Any]:
    def structure(obj: Any, cl: Any) -> Any:
        if not ok(obj):
            raise ConfigError(message)
        return cl(obj)

    return structure


def _structure_float(obj: Any, _: Any) -> float:
    if not _num(obj):
        raise ConfigError("expected a number")
    try:
        value = float(obj)
    except OverflowError:  # an integer beyond float range
        value = math.inf
    if not math.isfinite(value):
        raise ConfigError("expected a finite number")
    return value


def _structure_literal(obj: Any, cl: Any) -> Any:
    if not isinstance(obj, str) or obj not in get_args(cl):
        raise ConfigError(_one_of(get_args(cl)))
    return obj


def _is_list_type(cl: Any) -> bool:
    args = get_args(cl)
    return get_origin(cl) is tuple and len(args) == 2 and args[1] is Ellipsis


def _structure_list(obj: Any, cl: Any) -> tuple[Any, ...]:
    # cattrs would iterate a string or a mapping; a JSON list is the only list here.
    if not isinstance(obj, list | tuple):
        raise ConfigError("expected a list")
    item_type = get_args(cl)[0]
    hook = converter.get_structure_hook(item_type)
    items, errors = [], []
    for i, item in enumerate(obj):
        try:
            items.append(hook(item, item_type))
        except Exception as exc:  # collected, re-raised as one group below
            exc.add_note(ItemNote(f"Structuring {cl} @ index {i}", i, item_type))
            errors.append(exc)
    if errors:
        raise IterableValidationError(f"While structuring {cl}", errors, cl)
    return tuple(items)


def _attrs_hook(cl: type[Any]) -> Callable[[Any, Any], Any]:
    inner = make_dict_structure_fn(cl, converter)

    def structure(obj: Any, _: Any) -> Any:
        if not isinstance(obj, Mapping):
            raise ConfigError("expected an object")
        return inner(obj, cl)

    return structure


converter.register_structure_hook(float, _structure_float)
converter.register_structure_hook(int, _scalar(_int, "expected an integer"))
converter.register_structure_hook(str, _scalar(lambda v: isinstance(v, str), "expected a string"))
converter.register_structure_hook(
    bool, _scalar(lambda v: isinstance(v, bool), "expected a boolean")
)
converter.register_structure_hook_func(lambda t: get_origin(t) is _LITERAL, _structure_literal)
converter.register_structure_hook_func(_is_list_type, _structure_list)
converter.register_structure_hook_factory(attrs.has, _attrs_hook)
_api_key_object = make_dict_structure_fn(ApiKeyConfig, converter)


def _structure_api_key(obj: Any, _: Any) -> ApiKeyConfig:
    """A key as a string, or ``{"key", "name"}``."""
    if isinstance(obj, str):
        if not obj:
            raise ConfigError("expected a non-empty string")
        return ApiKeyConfig(key=obj)
    if not isinstance(obj, Mapping):
        raise ConfigError("expected a string or an object")
    return _api_key_object(obj, ApiKeyConfig)


def _unstructure_api_key(key: ApiKeyConfig) -> Any:
    return key.key if key.name is None else {"key": key.key, "name": key.name}


converter.register_structure_hook(ApiKeyConfig, _structure_api_key)
converter.register_unstructure_hook(ApiKeyConfig, _unstructure_api_key)


def _errors(exc: BaseException, path: str) -> list[tuple[str, str]]:
    """Flatten a structuring failure into ``(message, path)`` pairs, in document order."""
    if isinstance(exc, ClassValidationError | IterableValidationError):
        out: list[tuple[str, str]] = []
        for sub in exc.exceptions:
            notes = getattr(sub, "__notes__", [])
            attr = next((n for n in notes if isinstance(n, AttrNote)), None)
            item = next((n for n in notes if isinstance(n, ItemNote)), None)
            if attr is not None and isinstance(sub, KeyError):
                out.append((f"missing required key {attr.name!r}", path))
            elif attr is not None:
                out.extend(_errors(sub, f"{path}.{attr.name}"))
            elif item is not None:
                out.extend(_errors(sub, f"{path}[{item.index!r}]"))
            else:
                out.extend(_errors(sub, path))
        return out
    if isinstance(exc, ForbiddenExtraKeysError):
        keys = sorted(exc.extra_fields)
        noun = "unknown key" if len(keys) == 1 else "unknown keys"
        return [(f"{noun} " + ", ".join(_did_you_mean(k, exc.cl) for k in keys), path)]
    if isinstance(exc, ConfigError):
        return [(exc.reason, path + exc.path[1:])]
    return [(f"invalid value ({exc})", path)]


def _did_you_mean(key: str, cl: type) -> str:
    """``'key'``, with the closest known key of ``cl`` when one is close (a typo)."""
    known = [f.name for f in attrs.fields(cl)] if attrs.has(cl) else []
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def parse_as(cl: type[T], obj: Any, *, source: str | None = None) -> T:
    """Structure parsed JSON as the config class ``cl`` (a fleet, a fault, ...).

    Raises:
        ConfigError: For the first invalid value, with its JSON path.
    """
    try:
        return converter.structure(obj, cl)
    except (ClassValidationError, IterableValidationError, ConfigError) as exc:
        message, path = (_errors(exc, "$") or [("invalid document", "$")])[0]
        raise ConfigError(message, path=path, source=source) from None


def parse_fleet(obj: Any, source: str | None = None) -> FleetConfig:
    """Validate a fleet document as ``json.load`` returns it; ``source`` prefixes errors.

    Raises:
        ConfigError: For the first invalid value, with its JSON path.
    """
    return parse_as(FleetConfig, obj, source=source)


#: The largest document file read (a fleet document, a profiles file): larger ones are
#: refused before they are read.
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024

#: Deeper JSON than this is refused (the fleet document nests six levels).
_MAX_DEPTH_MESSAGE = "the document nests too deeply to be a fleet document"


def read_document(path: str | os.PathLike[str], what: str, *, limit: int = MAX_DOCUMENT_BYTES) -> bytes:
    """The bytes of the document file at ``path``: a regular file of at most ``limit`` bytes.

    A device (``/dev/zero``), a FIFO or a socket is refused without a read (and without
    waiting for a FIFO's writer); so is a larger file, by its size and by what is read.

    Raises:
        ConfigError: Not a regular file, larger than ``limit`` or unreadable (the
            message names ``what``).
    """
    source = os.fspath(path)
    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror}", source=source) from None
    with os.fdopen(fd, "rb") as f:
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"cannot read {what}: not a regular file", source=source)
            if info.st_size > limit:
                raise ConfigError(f"{what} is larger than {limit} bytes ({info.st_size})", source=source)
            data = f.read(limit + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read {what}: {exc.strerror}", source=source) from None
    if len(data) > limit:  # it grew since
        raise ConfigError(f"{what} is larger than {limit} bytes", source=source)
    return data


def parse_fleet_json(text: str | bytes, *, source: str | None = None) -> dict[str, Any]:
    """A fleet document's JSON text as an object (not yet validated as a fleet).

    Raises:
        ConfigError: Not JSON, nested too deeply (a 400, not a recursion error), or not
            an object (``null`` included: it is no document).
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise ConfigError(f"the document is not JSON: {exc.msg} at {where}", source=source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the document is not JSON: not UTF-8 text ({exc.reason})", source=source) from None
    except RecursionError:
        raise ConfigError(_MAX_DEPTH_MESSAGE, source=source) from None
    if not isinstance(obj, dict):
        raise ConfigError(f"expected a fleet document (a JSON object), not {_json_kind(obj)}", source=source)
    return obj


def _json_kind(obj: Any) -> str:
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "a boolean"
    if isinstance(obj, int | float):
        return "a number"
    return "a string" if isinstance(obj, str) else "a list"


def load_fleet(path: str | os.PathLike[str]) -> FleetConfig:
    """Read and validate the JSON fleet document at ``path``.

    Raises:
        ConfigError: The file is unreadable (or not a regular file of at most
            :data:`MAX_DOCUMENT_BYTES`), not JSON, or not a valid fleet.
    """
    source = os.fspath(path)
    data = read_document(source, "fleet document")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("fleet document is not UTF-8 text", source=source) from None
    return _load_text(text, source)


def load_default_fleet() -> FleetConfig:
    """The embedded default fleet (``narwhal/data/fleet.sim.json``): simulated engines."""
    text = resources.files("narwhal").joinpath("data/fleet.sim.json").read_text("utf-8")
    return _load_text(text, "narwhal/data/fleet.sim.json")


def _load_text(text: str, source: str) -> FleetConfig:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise ConfigError(f"invalid JSON: {exc.msg} at {where}", source=source) from None
    except RecursionError:
        raise ConfigError(_MAX_DEPTH_MESSAGE, source=source) from None
    return parse_fleet(obj, source=source)


# ------------------------------------------------------------------ secrets

#: A setting whose last key ends so holds a secret (``api_key``, ``api_keys``,
#: ``admin_api_keys``, ``*_token``, ``*_secret``, ``*_password``, ...): by rule, so that a
#: secret field added later is covered too.
_SECRET_KEY = re.compile(r"(?:^|_)(?:keys?|secrets?|tokens?|passwords?|passphrases?|credentials?)$", re.IGNORECASE)

#: What a secret value is shown as.
REDACTED = "<redacted>"


def is_secret(path: str) -> bool:
    """Whether the setting at ``path`` (dotted or JSON path: ``server.api_keys``,
    ``$.engines[0].api_key``) holds a secret."""
    last = re.split(r"[.\[\]$]+", path.strip(".[]$"))[-1] if path else ""
    return bool(_SECRET_KEY.search(last))


def redacted(path: str, value: Any) -> Any:
    """``value`` as it may be shown: the setting at ``path``'s secret redacted (each item
    of a list, so that their number shows; a mapping's secret keys at any depth); null
    and empty values as they are (absence is no secret)."""
    if isinstance(value, Mapping):
        return {k: redacted(f"{path}.{k}", v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not is_secret(path):
        return [redacted(path, v) for v in value]
    if not is_secret(path) or value is None or value == "" or value == [] or value == ():
        return value
    if isinstance(value, list | tuple):
        return [REDACTED for _ in value]
    return REDACTED


def secret_setting(path: str) -> bool:
    """Whether the setting at a dotted ``path`` (``server.admin_api_keys``) holds a secret,
    whose value no message, record or log line may show (:func:`is_secret`)."""
    return is_secret(path)


def unstructure_fleet(cfg: FleetConfig) -> dict[str, Any]:
    """The fleet as a JSON-able dict; ``parse_fleet(unstructure_fleet(cfg)) == cfg``."""
    out: dict[str, Any] = converter.unstructure(cfg)
    return out
