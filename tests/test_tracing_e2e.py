"""End to end: ``narwhal serve`` exports its spans to a real OTLP receiver.

The router runs as a subprocess on the simulated fleet (over loopback), configured the
two ways an operator does it: the standard OTEL_* environment (OTLP/HTTP) and the fleet
document's ``tracing`` section (OTLP/gRPC, with ``--workers 2``: each worker exports).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from narwhal.testing.ports import free_port, free_port_run

from .clikit import ENV, sim_fleet
from .otlpkit import ReceivedSpan, open_grpc_receiver, open_http_receiver

CLIENT_TRACE = "5bf92f3577b34da6a3ce929d0e0e4737"
CLIENT_SPAN = "10f067aa0ba902b7"
LEGS = {"narwhal.attempt", "narwhal.placement", "narwhal.prefill", "narwhal.handoff", "narwhal.decode"}

#: No OTEL_* setting of the machine's leaks into the router these tests start.
_BASE_ENV = {k: v for k, v in ENV.items() if not k.startswith("OTEL_")}


def _serve(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", "serve", *argv], cwd=cwd, env={**_BASE_ENV, **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "narwhal serving on" in line or "workers started" in line:
            return proc
    proc.wait(30)
    pytest.fail("narwhal serve exited early:\n" + "".join(lines))


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode == 0, out
    return out


def _wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became ready")


def _by_trace(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        out.setdefault(span.trace_id, []).append(span)
    return out


def _assert_tree(spans: list[ReceivedSpan]) -> ReceivedSpan:
    """One request's spans: a server span over an attempt over the legs; returns the root."""
    [root] = [s for s in spans if s.kind == 2]
    assert {s.name for s in spans} == {root.name, *LEGS}
    ids = {s.span_id: s for s in spans}
    [attempt] = [s for s in spans if s.name == "narwhal.attempt"]
    assert attempt.parent_span_id == root.span_id
    for span in spans:
        if span.name in LEGS - {"narwhal.attempt"}:
            assert ids[span.parent_span_id] is attempt, span.name
    return root


def test_serve_exports_over_otlp_http_from_the_environment(tmp_path: Path) -> None:
    port, admin = free_port(), free_port()
    with open_http_receiver() as (endpoint, collected):
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": "narwhal-e2e",
            # Nothing is exported while serving: the spans arrive because shutdown flushes.
            "OTEL_BSP_SCHEDULE_DELAY": "600000",
        }
        proc = _serve(["--fleet", str(sim_fleet(tmp_path)), "--port", str(port), "--admin-port", str(admin)],
                      env, tmp_path)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            body = {"model": "sim-llama", "prompt": "hello narwhal", "max_tokens": 4}
            traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            with httpx.Client(base_url=url, timeout=30) as client:
                streamed = client.post("/v1/completions", json={**body, "stream": True},
                                       headers={"traceparent": traceparent})  # fmt: skip
                assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
                assert client.post("/v1/completions", json=body).status_code == 200
            om = httpx.get(f"http://127.0.0.1:{admin}/metrics",
                           headers={"accept": "application/openmetrics-text"}, timeout=30)  # fmt: skip
            assert collected.spans == []
        finally:
            _stop(proc)
        spans = collected.spans
    traces = _by_trace(spans)
    assert len(traces) == 2 and CLIENT_TRACE in traces
    root = _assert_tree(traces[CLIENT_TRACE])
    assert root.parent_span_id == CLIENT_SPAN and root.name == "POST /v1/completions"
    assert root.attributes["narwhal.terminal_class"] == "ok"
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.resource["service.name"] == "narwhal-e2e"
    [other] = [t for t in traces if t != CLIENT_TRACE]
    assert _assert_tree(traces[other]).parent_span_id == ""
    # The journal and the exemplars name the same traces.
    journal = [json.loads(line) for line in (tmp_path / "runs" / "journal.jsonl").read_text().splitlines()]
    assert sorted(r["trace_id"] for r in journal) == sorted(traces)
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    # One exemplar a series (bucket): the later request's replaces the earlier's where
    # both fall in one, so each shown is one of the two, and at least one is shown.
    shown = set(re.findall(r'trace_id="([0-9a-f]{32})"', om.text))
    assert shown and shown <= set(traces), (shown, sorted(traces))


def test_each_worker_exports_over_otlp_grpc_from_the_fleet_document(tmp_path: Path) -> None:
    admin = free_port_run(3)  # the combined surface, then one per worker
    port = free_port()
    with open_grpc_receiver() as (endpoint, collected):
        doc = json.loads(sim_fleet(tmp_path, admin_port=admin).read_text())
        doc["server"]["port"] = port
        doc["tracing"] = {"endpoint": endpoint, "protocol": "grpc", "service_name": "narwhal-workers"}
        fleet = tmp_path / "traced.json"
        fleet.write_text(json.dumps(doc))
        # The environment asks for http: the document's protocol wins.
        env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}
        proc = _serve(["--fleet", str(fleet), "--workers", "2"], env, tmp_path)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(f"http://127.0.0.1:{admin}")
            n = 24
            for _ in range(n):  # a fresh connection each: the kernel spreads them over the workers
                with httpx.Client(base_url=url, timeout=30) as client:
                    resp = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3})
                    assert resp.status_code == 200
            spans = collected.wait_for(lambda got: sum(s.kind == 2 for s in got) >= n and len(got) >= 6 * n, 60)
            # The combined admin surface: the workers' exemplars, in OpenMetrics.
            om = httpx.get(f"http://127.0.0.1:{admin}/metrics", headers={"accept": "application/openmetrics-text"},
                           timeout=30)  # fmt: skip
            plain = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=30)
        finally:
            _stop(proc)
    roots = [s for s in spans if s.kind == 2]
    assert len(roots) == n
    for trace in _by_trace(spans).values():
        _assert_tree(trace)
    # Each worker exported its own requests' spans, as an instance of its own.
    instances = Counter(str(s.resource["service.instance.id"]) for s in roots)
    assert len(instances) == 2, instances
    assert {s.resource["service.name"] for s in spans} == {"narwhal-workers"}
    assert om.headers["content-type"].startswith("application/openmetrics-text") and "narwhal_workers_up 2.0" in om.text
    shown = {line.split('trace_id="')[1][:32] for line in om.text.splitlines() if 'trace_id="' in line}
    assert shown and shown <= {s.trace_id for s in roots}
    assert plain.headers["content-type"].startswith("text/plain") and "trace_id" not in plain.text

