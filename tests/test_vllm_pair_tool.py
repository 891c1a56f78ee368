"""``tools/vllm-cpu/pair.py``: the real pair's command lines and fleet document.

The script needs only the standard library and is loaded by its path. What it
writes must start engines that really publish (vLLM binds its KV-event PUB socket
only to a wildcard endpoint) and a fleet document narwhal loads.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from narwhal.config import parse_fleet

PAIR_PY = Path(__file__).resolve().parents[1] / "tools" / "vllm-cpu" / "pair.py"


@pytest.fixture(scope="module")
def pair_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_pair_py", PAIR_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _specs(pair_py: ModuleType, argv: list[str]) -> dict[str, dict[str, Any]]:
    args = pair_py.build_parser().parse_args(["start", *argv])
    events = {"pub": 5557, "replay": 5558} if args.kv_events else None
    return {
        "producer": pair_py.engine_spec(args, "producer", 8100, 5600, "0", events),
        "consumer": pair_py.engine_spec(
            args, "consumer", 8200, 5700, "1", events and {"pub": 5657, "replay": 5658}
        ),
    }


def _kv_events_config(argv: list[str]) -> dict[str, Any]:
    return dict(json.loads(argv[argv.index("--kv-events-config") + 1]))


def test_engines_cache_prefixes_and_publish_kv_events_by_default(pair_py: ModuleType) -> None:
    specs = _specs(pair_py, [])
    argv = specs["producer"]["argv"]
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    events = _kv_events_config(argv)
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # vLLM binds the PUB socket only when the endpoint has a wildcard; any other
    # address is connected to, and nothing would be published live.
    assert events["endpoint"] == "tcp://*:5557"
    assert events["replay_endpoint"] == "tcp://127.0.0.1:5558"
    assert _kv_events_config(specs["consumer"]["argv"])["endpoint"] == "tcp://*:5657"
    # POST /reset_prefix_cache is a development endpoint.
    assert specs["producer"]["env"]["VLLM_SERVER_DEV_MODE"] == "1"


def test_no_kv_events_leaves_the_engines_defaults(pair_py: ModuleType) -> None:
    argv = _specs(pair_py, ["--no-kv-events"])["producer"]["argv"]
    assert not {"--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-events-config"} & set(argv)  # fmt: skip


@pytest.mark.parametrize("kv_events", [True, False])
def test_the_fleet_document_names_each_engines_events(
    pair_py: ModuleType, tmp_path: Path, kv_events: bool
) -> None:
    pair = pair_py.Pair(tmp_path)
    pair.state = {"engines": _specs(pair_py, [] if kv_events else ["--no-kv-events"])}
    desc = {"remote_host": "127.0.0.1", "remote_port": 5600}
    path = pair_py.write_fleet(pair, desc, "0.32.0", 120)
    config = parse_fleet(json.loads(path.read_text()))
    engines = {e.name: e for e in config.engines}
    if not kv_events:
        assert all(e.kv_events is None for e in engines.values())
        return
    producer, consumer = engines["producer"].kv_events, engines["consumer"].kv_events
    assert producer is not None and consumer is not None
    assert (producer.endpoint, producer.replay_endpoint, producer.topic) == (
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv-events")  # fmt: skip
    assert (consumer.endpoint, consumer.replay_endpoint) == (
        "tcp://127.0.0.1:5657", "tcp://127.0.0.1:5658")  # fmt: skip


def test_engines_trace_only_when_asked(pair_py: ModuleType, tmp_path: Path) -> None:
    import os
    import sys

    specs = _specs(pair_py, [])
    assert "--otlp-traces-endpoint" not in specs["producer"]["argv"]
    assert specs["producer"]["otlp_traces_endpoint"] is None
    assert not any(k.startswith("OTEL_") for k in specs["producer"]["env"])
    # A venv whose python has OpenTelemetry (this one), and one whose python has none.
    with_otel, without = tmp_path / "with", tmp_path / "without"
    (with_otel / "bin").mkdir(parents=True)
    os.symlink(sys.executable, with_otel / "bin" / "python")
    (without / "bin").mkdir(parents=True)
    (without / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (without / "bin" / "python").chmod(0o755)

    def endpoint(venv: Path, value: str) -> str | None:
        args = pair_py.build_parser().parse_args(["start", "--venv", str(venv), "--otlp-traces-endpoint", value])
        return pair_py.traces_endpoint(args)  # type: ignore[no-any-return]

    assert endpoint(with_otel, "off") is None
    auto = endpoint(with_otel, "auto")
    assert auto is not None and auto.startswith("http://127.0.0.1:") and auto.endswith("/v1/traces")
    assert endpoint(with_otel, "http://collector:4318/v1/traces") == "http://collector:4318/v1/traces"
    assert endpoint(without, "auto") is None  # said on stderr; the pair starts untraced
    with pytest.raises(SystemExit, match="the venv has no OpenTelemetry"):
        endpoint(without, "http://collector:4318/v1/traces")
    args = pair_py.build_parser().parse_args(["start"])
    spec = pair_py.engine_spec(args, "consumer", 8200, 5700, "1", None, auto)
    argv = spec["argv"]
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == auto
    assert spec["otlp_traces_endpoint"] == auto
    # vLLM's exporter speaks gRPC unless told otherwise; the test's receiver is OTLP/HTTP.
    assert spec["env"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert spec["env"]["OTEL_SERVICE_NAME"] == "vllm-consumer"


def test_render_endpoints_only_when_asked(pair_py: ModuleType) -> None:
    # vllm-router's kv_aware calls /v1/completions/render, which answers 403 without it.
    assert "--enable-scale-out" not in _specs(pair_py, [])["producer"]["argv"]
    specs = _specs(pair_py, ["--enable-scale-out"])
    assert all("--enable-scale-out" in spec["argv"] for spec in specs.values())
