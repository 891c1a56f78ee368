"""One trace from the client through the router into both real vLLM engines.

The pair must run with its tracing on (``tools/vllm-cpu/pair.py start
--otlp-traces-endpoint auto``, as CI and a session-started pair do): each engine then
exports its ``llm_request`` spans over OTLP/HTTP to the endpoint recorded in
``pair.json``. This test listens there with a small receiver, runs ``narwhal serve``
exporting to the same receiver, sends one request under a client trace, and checks
that each engine's span is a child of the router's span of its leg: vLLM joined the
trace from the ``traceparent`` the router sent.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from ..otlpkit import ReceivedSpan, open_http_receiver
from .kit import HTTP_TIMEOUT, MODEL, RealPair, RouterProcess, unique_prompt

pytestmark = pytest.mark.real_engine

START = "python3 tools/vllm-cpu/pair.py start --otlp-traces-endpoint auto"


def _endpoint(pair: RealPair) -> str:
    if not pair.managed:
        pytest.skip("the pair was named by NARWHAL_VLLM_FLEET: its tracing endpoint is not known")
    endpoints = {pair.state["engines"][role].get("otlp_traces_endpoint") for role in ("producer", "consumer")}
    if endpoints == {None}:
        pytest.skip(f"the pair runs without tracing: start it with `{START}`")
    [endpoint] = endpoints
    assert isinstance(endpoint, str)
    return endpoint


def test_the_engines_spans_carry_the_routers_trace(pair: RealPair, tmp_path: Path) -> None:
    endpoint = _endpoint(pair)
    parts = urlsplit(endpoint)
    assert parts.hostname == "127.0.0.1" and parts.path == "/v1/traces" and parts.port
    client_trace = secrets.token_hex(16)
    client_span = secrets.token_hex(8)
    with open_http_receiver(parts.port) as (url, collected):
        fleet = {**pair.fleet, "tracing": {"endpoint": url, "protocol": "http/protobuf"}}
        router = RouterProcess(fleet, tmp_path / "router")
        router.start()
        try:
            body = {"model": MODEL, "prompt": unique_prompt(40), "max_tokens": 8, "ignore_eos": True}
            with httpx.Client(base_url=router.url, timeout=HTTP_TIMEOUT) as client:
                resp = client.post("/v1/completions", json={**body, "stream": True},
                                   headers={"traceparent": f"00-{client_trace}-{client_span}-01"})  # fmt: skip
            assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n"), resp.text[-500:]
        finally:
            status = router.stop()  # flushes the router's spans
        assert status == 0, router.log()[-3000:]

        def engines_in(spans: list[ReceivedSpan]) -> bool:
            ours = [s for s in spans if s.trace_id == client_trace and s.name == "llm_request"]
            return len(ours) >= 2 and any(s.kind == 2 and s.name.startswith("POST") for s in spans)

        spans = collected.wait_for(engines_in, timeout=120)
    trace = [s for s in spans if s.trace_id == client_trace]
    [root] = [s for s in trace if s.name == "POST /v1/completions"]
    assert root.parent_span_id == client_span and root.resource["service.name"] == "narwhal"
    [prefill] = [s for s in trace if s.name == "narwhal.prefill"]
    [decode] = [s for s in trace if s.name == "narwhal.decode"]
    by_service = {str(s.resource.get("service.name")): s for s in trace if s.name == "llm_request"}
    assert set(by_service) == {"vllm-producer", "vllm-consumer"}, [s.resource for s in trace]
    # Each engine's request span is the child of the router's span of the leg it served.
    assert by_service["vllm-producer"].parent_span_id == prefill.span_id
    assert by_service["vllm-consumer"].parent_span_id == decode.span_id
    [record] = router.journal()
    assert record["trace_id"] == client_trace
