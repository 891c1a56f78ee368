"""Turning tracing on: the fleet document's ``tracing`` section and the OTEL_* environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from narwhal.config import TracingConfig, parse_fleet
from narwhal.errors import ConfigError
from narwhal.tracing import INSTALL_HINT, Tracing, check_tracing, open_tracing, tracing_wanted

from .clikit import ENV, sim_fleet

OFF = TracingConfig()
ON = TracingConfig(endpoint="http://collector:4318")


@pytest.mark.parametrize(
    ("config", "environ", "wanted"),
    [
        (OFF, {}, []),  # off by default
        # (the specification's default exporter is otlp, but nothing asked for tracing)
        (OFF, {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, []),
        (ON, {}, ["otlp"]),
        (OFF, {"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        (OFF, {"OTEL_TRACES_EXPORTER": " OTLP , console,otlp"}, ["otlp", "console"]),
        (OFF, {"OTEL_TRACES_EXPORTER": "none"}, []),
        (OFF, {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
        # An endpoint with no exporter named: otlp, the specification's default.
        (OFF, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp"]),
        (OFF, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
        # The document's endpoint turns it on whatever the environment says, but the SDK off switch.
        (ON, {"OTEL_TRACES_EXPORTER": "none"}, ["otlp"]),
        (ON, {"OTEL_SDK_DISABLED": "true"}, []),
        (OFF, {"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"}, []),
        (OFF, {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ],
)
def test_when_tracing_is_on(config: TracingConfig, environ: dict[str, str], wanted: list[str]) -> None:
    assert tracing_wanted(config, environ) == wanted
    assert (open_tracing(config, environ) is not None) is bool(wanted)


def test_an_exporter_narwhal_does_not_ship_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"OTEL_TRACES_EXPORTER names zipkin: narwhal exports traces with otlp"):
        tracing_wanted(OFF, {"OTEL_TRACES_EXPORTER": "otlp,zipkin"})
    with pytest.raises(ConfigError, match=r"OTLP protocol 'http/json' .*http/protobuf or grpc @ \$.tracing.protocol"):
        check_tracing(OFF, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def _exporters(tracing: Tracing) -> list[Any]:
    processors = tracing.provider._active_span_processor._span_processors
    assert all(isinstance(p, BatchSpanProcessor) for p in processors)
    return [p.span_exporter if hasattr(p, "span_exporter") else p._batch_processor._exporter for p in processors]


async def _built(config: TracingConfig, environ: dict[str, str]) -> tuple[Tracing, list[Any]]:
    tracing = open_tracing(config, environ)
    assert tracing is not None
    exporters = _exporters(tracing)
    await tracing.aclose()
    return tracing, exporters


async def test_the_exporter_follows_the_protocol_and_the_documents_endpoint_is_a_base_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, [http] = await _built(ON, {})
    assert isinstance(http, HttpExporter) and http._endpoint == "http://collector:4318/v1/traces"
    # The environment's protocol, and the document's over it.
    _, [grpc] = await _built(TracingConfig(endpoint="http://collector:4317"), {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert isinstance(grpc, GrpcExporter)
    doc = TracingConfig(endpoint="http://collector:4318/", protocol="http/protobuf")
    _, [http] = await _built(doc, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert isinstance(http, HttpExporter) and http._endpoint == "http://collector:4318/v1/traces"
    # The environment's endpoint, as the SDK reads it (from the process environment).
    env = {"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _, [http, console] = await _built(OFF, env)
    assert isinstance(console, ConsoleSpanExporter)
    assert isinstance(http, HttpExporter) and http._endpoint == "http://env:4318/v1/traces"


@pytest.mark.parametrize(
    ("config", "environ", "name"),
    [
        (ON, {}, "narwhal"),
        (ON, {"OTEL_SERVICE_NAME": "router-east"}, "router-east"),
        (ON, {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,deployment.environment=prod"}, "from-attrs"),
        (TracingConfig(endpoint="http://c:4318", service_name="doc-name"), {"OTEL_SERVICE_NAME": "env"}, "doc-name"),
    ],
)
async def test_the_service_name(
    monkeypatch: pytest.MonkeyPatch, config: TracingConfig, environ: dict[str, str], name: str
) -> None:
    # The SDK's resource detector reads the process environment.
    for key in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    tracing, _ = await _built(config, environ)
    attributes = tracing.provider.resource.attributes
    assert attributes["service.name"] == name
    assert attributes["service.version"]
    assert attributes["service.instance.id"]  # one per process: each worker is an instance
    if "deployment.environment" in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert attributes["deployment.environment"] == "prod"


async def test_the_sampler() -> None:
    tracing, _ = await _built(TracingConfig(endpoint="http://c:4318", sampling_ratio=0.25), {})
    assert tracing.provider.sampler.get_description().startswith("ParentBased{root:TraceIdRatioBased{0.25}")
    tracing, _ = await _built(TracingConfig(endpoint="http://c:4318", sampling_ratio=0.5, parent_based=False), {})
    assert tracing.provider.sampler.get_description() == "TraceIdRatioBased{0.5}"


def test_missing_packages_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if the tracing extra were not installed (a None entry makes the import fail).
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    environ = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with pytest.raises(ConfigError) as info:
        check_tracing(OFF, environ)
    message = str(info.value)
    assert message.startswith("tracing is on (OTEL_TRACES_EXPORTER=otlp) but the OpenTelemetry packages are not installed")
    assert message.endswith(f"{INSTALL_HINT} @ $.tracing")
    with pytest.raises(ConfigError, match="not installed"):
        open_tracing(OFF, environ)
    # Nothing is imported, or needed, while tracing is off.
    assert check_tracing(OFF, {}) is False


def test_the_router_imports_no_opentelemetry_while_tracing_is_off() -> None:
    code = (
        "import sys, narwhal.router.service, narwhal.router.lifecycle, narwhal.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=ENV)
    assert out.stdout.strip() == "[]"


def test_serve_refuses_to_start_without_the_packages(tmp_path: Path) -> None:
    # A stand-in for a missing extra: a module of that name that fails to import.
    fake = tmp_path / "fake"
    (fake / "opentelemetry").mkdir(parents=True)
    (fake / "opentelemetry" / "__init__.py").write_text("raise ImportError('no module named opentelemetry')\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(fake), ENV.get("PYTHONPATH", "")]),
           "OTEL_TRACES_EXPORTER": "otlp"}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "narwhal", "serve", "--fleet", str(sim_fleet(tmp_path)), "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode != 0
    assert "narwhal serve: tracing is on (OTEL_TRACES_EXPORTER=otlp) but the OpenTelemetry packages are not installed" in out.stderr
    assert INSTALL_HINT in out.stderr


def test_a_reload_cannot_change_tracing() -> None:
    from narwhal.router.fleet import RESTART_ONLY

    assert "tracing" in RESTART_ONLY
    doc = {"engines": [{"name": "a", "url": "http://a:1", "roles": ["prefill", "decode"]}],
           "tracing": {"endpoint": "http://c:4317", "protocol": "grpc", "sampling_ratio": 0.1}}  # fmt: skip
    assert parse_fleet(doc).tracing == TracingConfig(endpoint="http://c:4317", protocol="grpc", sampling_ratio=0.1)
