"""Talking to inference engines: the HTTP client, KV handoffs and stream parsing.

Python callers import ``EngineClient`` from :mod:`narwhal.engines.client` and
``PrefillResult`` from :mod:`narwhal.engines.connector`; this package re-exports the
public names of its modules.
"""

from __future__ import annotations

from narwhal.engines.client import DecodeStream, EngineClient, EngineIdentity, Tokenized, start_date
from narwhal.engines.connector import (
    CONNECTOR_MISMATCH,
    ENDPOINT_MISMATCH,
    MALFORMED_BLOCK_IDS,
    MALFORMED_DESCRIPTOR,
    MISSING_DESCRIPTOR,
    MISSING_ENGINE_IDENTITY,
    NIXL_CONNECTOR,
    REJECTION_REASONS,
    SUPPORTED_CONNECTORS,
    TRANSFER_KEYS,
    UNEXPECTED_FINISH_REASON,
    ConnectorLike,
    PrefillResult,
    RequestKind,
    connector_type,
    hosts_equal,
    prefill_request_params,
    strip_transfer_params,
    validate_descriptor,
)
from narwhal.engines.metrics import (
    LOAD_SAMPLES,
    EngineMetrics,
    Sample,
    engine_metrics,
    parse_prometheus,
    sum_samples,
)
from narwhal.engines.sse import (
    Chunk,
    ChunkKind,
    MalformedEvent,
    SSEDecoder,
    SSEError,
    SSEEvent,
    json_dumps,
    json_loads,
    parse_chunk,
    parse_data,
    scan_token_event,
)

__all__ = [
    "CONNECTOR_MISMATCH",
    "ENDPOINT_MISMATCH",
    "LOAD_SAMPLES",
    "MALFORMED_BLOCK_IDS",
    "MALFORMED_DESCRIPTOR",
    "MISSING_DESCRIPTOR",
    "MISSING_ENGINE_IDENTITY",
    "NIXL_CONNECTOR",
    "REJECTION_REASONS",
    "SUPPORTED_CONNECTORS",
    "TRANSFER_KEYS",
    "UNEXPECTED_FINISH_REASON",
    "Chunk",
    "ChunkKind",
    "ConnectorLike",
    "DecodeStream",
    "EngineClient",
    "EngineIdentity",
    "EngineMetrics",
    "MalformedEvent",
    "PrefillResult",
    "RequestKind",
    "SSEDecoder",
    "SSEError",
    "SSEEvent",
    "Sample",
    "Tokenized",
    "connector_type",
    "engine_metrics",
    "hosts_equal",
    "json_dumps",
    "json_loads",
    "parse_chunk",
    "parse_data",
    "parse_prometheus",
    "prefill_request_params",
    "scan_token_event",
    "start_date",
    "strip_transfer_params",
    "sum_samples",
    "validate_descriptor",
]
