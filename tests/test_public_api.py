"""The engines package's public surface is what the docs say it is."""

from __future__ import annotations

import inspect
import types

import attrs

import narwhal.engines
from narwhal.engines import client as client_module
from narwhal.engines import connector as connector_module
from narwhal.engines import metrics as metrics_module
from narwhal.engines import sse as sse_module


def test_documented_imports() -> None:
    from narwhal.engines.client import EngineClient
    from narwhal.engines.connector import PrefillResult

    assert EngineClient is narwhal.engines.EngineClient
    assert PrefillResult is narwhal.engines.PrefillResult


def public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"  # from __future__
    }


def test_facade_all_matches_its_exports() -> None:
    exported = set(narwhal.engines.__all__)
    assert len(exported) == len(narwhal.engines.__all__)
    assert exported == public_names(narwhal.engines)
    for name in exported:
        assert getattr(narwhal.engines, name) is not None


def test_facade_reexports_every_module_public_name() -> None:
    for module in (client_module, connector_module, metrics_module, sse_module):
        for name in module.__all__:
            assert getattr(module, name) is getattr(narwhal.engines, name), (module.__name__, name)


def test_module_all_lists_only_defined_names() -> None:
    for module in (client_module, connector_module, metrics_module, sse_module):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)


def test_prefill_result_fields() -> None:
    fields = [f.name for f in attrs.fields(narwhal.engines.PrefillResult)]
    assert fields == [
        "descriptor",
        "producer",
        "producer_url",
        "endpoint",
        "backend_request_id",
        "connector",
        "kind",
        "request",
        "started_at",
        "completed_at",
        "prompt_tokens",
        "cached_tokens",
        "transfer",
        "validated",
    ]
    assert callable(narwhal.engines.PrefillResult.parameters)


def test_engine_client_signatures() -> None:
    cls = narwhal.engines.EngineClient
    init = inspect.signature(cls.__init__).parameters
    assert list(init)[:2] == ["self", "url"]
    assert all(
        init[name].kind is inspect.Parameter.KEYWORD_ONLY
        for name in (
            "name",
            "model",
            "connector",
            "api_key",
            "transport",
            "http_client",
            "connect_timeout_s",
        )
    )
    decode = inspect.signature(cls.decode).parameters
    assert list(decode)[1:3] == ["prefill", "body"]
    prefill = inspect.signature(cls.prefill).parameters
    assert list(prefill)[1] == "body"
    for method in ("tokenize", "prefill", "metrics", "load", "identity", "health", "models", "aclose"):
        assert inspect.iscoroutinefunction(getattr(cls, method)), method
    # No timeout arguments: callers own deadlines with cancel scopes.
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if name != "__init__":
            assert not any("timeout" in p for p in inspect.signature(member).parameters), name


def test_value_types_fields() -> None:
    assert [f.name for f in attrs.fields(narwhal.engines.Tokenized)] == [
        "count",
        "max_model_len",
        "ids",
    ]
    assert [f.name for f in attrs.fields(narwhal.engines.EngineIdentity)] == [
        "url",
        "model",
        "version",
        "max_model_len",
        "process_start_time",
    ]
    assert [f.name for f in attrs.fields(narwhal.engines.EngineMetrics)][:5] == [
        "running",
        "waiting",
        "kv_usage",
        "kv_cache_size_tokens",
        "prefix_caching",
    ]
    chunk_fields = {f.name for f in attrs.fields(narwhal.engines.Chunk)}
    assert {
        "kind",
        "token_ids",
        "text",
        "finish_reason",
        "data",
        "raw",
        "error",
        "status",
    } <= chunk_fields
