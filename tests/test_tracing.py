"""OpenTelemetry spans of the router, in memory and in virtual time.

Each test runs the router in front of simulated engines with a tracer over the SDK's
in-memory exporter (a simple span processor: a span is exported when it ends), and
checks the span tree (names, parents, kinds, attributes, the span an error is
recorded on), the context the engines received, and the journal's trace id.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import SpanKind, StatusCode

from narwhal.config import FaultSpec
from narwhal.http.server import ServerLimits
from narwhal.tracing import Tracing

from .routerkit import ROUTER_HOST, ROUTER_PORT, Stack, engine, fleet_doc, open_stack
from .test_fault_matrix import CASES, Case, doc_for

BODY = {"prompt": "one two three four", "max_tokens": 6}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


class Spans:
    """A tracer over an in-memory exporter, and what it exported."""

    def __init__(self, sampler: Any = None) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider(sampler=sampler)
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracing = Tracing(provider)

    @property
    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        [span] = self.named(name)
        return span

    def root(self) -> ReadableSpan:
        [span] = [s for s in self.all if s.kind == SpanKind.SERVER]
        return span

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        ctx = parent.get_span_context()
        kids = [s for s in self.all if s.parent is not None and s.parent.span_id == ctx.span_id]
        return sorted(kids, key=lambda s: s.start_time or 0)

    def tree(self, span: ReadableSpan | None = None) -> tuple[str, list[Any]]:
        """(name, [children's trees]) from the request's span."""
        span = span or self.root()
        return span.name, [self.tree(child) for child in self.children(span)]

    def assert_whole(self) -> None:
        """Every span ended (a span left open would not be exported, and its children
        would name a parent that never came), all in one trace."""
        ids = {s.get_span_context().span_id for s in self.all}
        for span in self.all:
            if span.kind != SpanKind.SERVER and span.name != "narwhal.probe":
                assert span.parent is not None and span.parent.span_id in ids, span.name
        assert len({s.get_span_context().trace_id for s in self.all if s.name != "narwhal.probe"}) <= 1


def errors(spans: Spans) -> list[str]:
    return [s.name for s in spans.all if s.status.status_code == StatusCode.ERROR]


def attr(span: ReadableSpan, key: str) -> Any:
    assert span.attributes is not None
    return span.attributes.get(key)


def trace_headers(stack: Stack, name: str) -> list[dict[str, str]]:
    """The trace headers (and any other header the router should not send) each
    generation request to engine ``name`` carried."""
    keep = ("traceparent", "tracestate", "baggage", "x-client-secret")
    return [{k: v for k, v in headers if k in keep} for headers in stack.engine(name).headers_seen]


def span_id(span: ReadableSpan) -> str:
    return format(span.get_span_context().span_id, "016x")


@pytest.fixture
def spans() -> Iterator[Spans]:
    yield Spans()


# ---------------------------------------------------------------- a success


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_is_one_span_tree_under_the_clients_trace(
    autojump_clock: trio.abc.Clock, spans: Spans, stream: bool
) -> None:
    headers = {
        "traceparent": TRACEPARENT,
        "tracestate": "vendor=opaque",
        "baggage": "user=alice",
        "x-client-secret": "s3cret",
        "x-request-id": "req-1",
    }
    async with open_stack(tracing=spans.tracing) as stack:
        resp = await stack.client.post("/v1/completions", json={**BODY, "stream": stream}, headers=headers)
        assert resp.status_code == 200
        prefill_seen, decode_seen = trace_headers(stack, "p0"), trace_headers(stack, "d0")
    spans.assert_whole()
    assert spans.tree() == (
        "POST /v1/completions",
        [("narwhal.attempt", [("narwhal.placement", []), ("narwhal.prefill", []), ("narwhal.handoff", []),
                              ("narwhal.decode", [])])],
    )  # fmt: skip
    root = spans.root()
    # The router's span is the child of the client's.
    assert format(root.get_span_context().trace_id, "032x") == CLIENT_TRACE
    assert root.parent is not None and format(root.parent.span_id, "016x") == CLIENT_SPAN
    assert root.parent.is_remote
    assert attr(root, "narwhal.request_id") == "req-1"
    assert attr(root, "narwhal.terminal_class") == "ok"
    assert attr(root, "http.response.status_code") == 200
    assert attr(root, "http.route") == "/v1/completions"
    assert attr(root, "gen_ai.request.model") == "sim-llama"
    assert attr(root, "gen_ai.usage.input_tokens") == 4
    assert attr(root, "gen_ai.usage.output_tokens") == 6
    assert attr(root, "narwhal.stream") is stream
    assert attr(root, "narwhal.attempts") == 1
    assert (attr(root, "narwhal.producer"), attr(root, "narwhal.consumer")) == ("p0", "d0")
    [record] = stack.records
    for key in ("ttft_s", "first_byte_s", "tpot_s", "latency_s"):
        assert attr(root, f"narwhal.{key}") == record[key]
    assert root.status.status_code == StatusCode.UNSET
    # The journal and the trace meet.
    assert record["trace_id"] == CLIENT_TRACE
    # Placement: what it could choose from, and what it chose.
    placement = spans.one("narwhal.placement")
    assert attr(placement, "narwhal.candidates.prefill") == ("p0",)
    assert attr(placement, "narwhal.candidates.decode") == ("d0",)
    assert (attr(placement, "narwhal.producer"), attr(placement, "narwhal.consumer")) == ("p0", "d0")
    attempt = spans.one("narwhal.attempt")
    assert (attr(attempt, "narwhal.attempt"), attr(attempt, "narwhal.outcome")) == (1, "ok")
    # The legs: client spans, and each engine got the context of its own leg's span
    # (the client's tracestate with it) and nothing else the client sent.
    prefill, decode = spans.one("narwhal.prefill"), spans.one("narwhal.decode")
    assert prefill.kind == decode.kind == SpanKind.CLIENT
    assert attr(prefill, "narwhal.engine") == "p0"
    assert attr(prefill, "narwhal.backend_request_id") == record["attempts"][0]["prefill_request_id"]
    assert attr(decode, "narwhal.engine") == "d0"
    assert attr(decode, "gen_ai.usage.output_tokens") == 6
    assert attr(decode, "narwhal.ended_by") == "done"
    assert [e.name for e in decode.events] == ["first_token"]
    assert prefill_seen == [{"traceparent": f"00-{CLIENT_TRACE}-{span_id(prefill)}-01", "tracestate": "vendor=opaque"}]
    assert decode_seen == [{"traceparent": f"00-{CLIENT_TRACE}-{span_id(decode)}-01", "tracestate": "vendor=opaque"}]
    # The handoff: the producer's descriptor, validated, and its age at the first token.
    handoff = spans.one("narwhal.handoff")
    assert attr(handoff, "narwhal.handoff.validated") is True
    assert attr(handoff, "narwhal.handoff.producer") == "p0"
    assert attr(handoff, "narwhal.connector") == "NixlConnector"
    assert attr(handoff, "narwhal.handoff.endpoint") == "p0.kv.test:23101"
    assert attr(handoff, "narwhal.handoff.blocks") == 1
    assert 0 < attr(handoff, "narwhal.handoff.age_s") < 1
    assert attr(handoff, "narwhal.handoff.max_age_s") == 60.0


async def test_a_request_without_trace_context_starts_a_trace(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    async with open_stack(tracing=spans.tracing) as stack:
        # A malformed traceparent is ignored, never an error.
        for value in ("00-zz-yy-01", f"00-{'0' * 32}-{CLIENT_SPAN}-01", "garbage"):
            resp = await stack.complete(BODY, headers={"traceparent": value, "tracestate": "a=b"})
            assert resp.status_code == 200
        seen = trace_headers(stack, "d0")
    roots = [s for s in spans.all if s.kind == SpanKind.SERVER]
    assert len(roots) == 3
    trace_ids = [format(r.get_span_context().trace_id, "032x") for r in roots]
    for root in roots:
        assert root.parent is None
    assert len(set(trace_ids)) == 3 and CLIENT_TRACE not in trace_ids and "0" * 32 not in trace_ids
    assert sorted(r["trace_id"] for r in stack.records) == sorted(trace_ids)
    # The engines get the router's own trace (no tracestate: the client's had no parent).
    assert sorted(h["traceparent"].split("-")[1] for h in seen) == sorted(trace_ids)
    assert all(set(h) == {"traceparent"} for h in seen)


async def test_a_same_worker_request_has_no_handoff(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    async with open_stack(fleet_doc(engine("w0", 8101, ["prefill", "decode"])), tracing=spans.tracing) as stack:
        assert (await stack.complete(BODY)).status_code == 200
        seen = trace_headers(stack, "w0")
    spans.assert_whole()
    assert spans.tree() == (
        "POST /v1/completions",
        [("narwhal.attempt", [("narwhal.placement", []), ("narwhal.prefill", []), ("narwhal.decode", [])])],
    )
    assert attr(spans.one("narwhal.attempt"), "narwhal.same_worker") is True
    prefill, decode = spans.one("narwhal.prefill"), spans.one("narwhal.decode")
    assert [h["traceparent"].split("-")[2] for h in seen] == [span_id(prefill), span_id(decode)]


async def test_chat_route_names_its_span(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    async with open_stack(tracing=spans.tracing) as stack:
        resp = await stack.client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        )
        assert resp.status_code == 200
    root = spans.root()
    assert root.name == "POST /v1/chat/completions"
    assert attr(root, "narwhal.route") == "chat"


# ---------------------------------------------------------------- retries and faults


async def test_a_retry_is_a_second_attempt_span(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    async with open_stack(fleet_doc(recovery={"max_attempts": 2}), tracing=spans.tracing) as stack:
        # A transient fault, once: the second attempt (on the only consumer) succeeds.
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=503, times=1))
        resp = await stack.complete(BODY, headers={"traceparent": TRACEPARENT})
        assert resp.status_code == 200
    spans.assert_whole()
    assert spans.tree() == (
        "POST /v1/completions",
        [
            ("narwhal.attempt", [("narwhal.placement", []), ("narwhal.prefill", []), ("narwhal.handoff", []),
                                 ("narwhal.decode", [])]),
            ("narwhal.attempt", [("narwhal.placement", []), ("narwhal.prefill", []), ("narwhal.handoff", []),
                                 ("narwhal.decode", [])]),
        ],
    )  # fmt: skip
    first, second = spans.children(spans.root())
    assert (attr(first, "narwhal.attempt"), attr(first, "narwhal.retry")) == (1, False)
    assert (attr(second, "narwhal.attempt"), attr(second, "narwhal.retry")) == (2, True)
    assert attr(first, "narwhal.outcome") == "decode_failed"
    assert first.status.status_code == StatusCode.ERROR
    assert attr(second, "narwhal.outcome") == "ok"
    failed_decode = spans.children(first)[-1]
    assert failed_decode.status.status_code == StatusCode.ERROR
    assert "HTTP 503" in (failed_decode.status.description or "")
    assert [e.name for e in failed_decode.events] == ["exception"]
    # The second attempt's placement was told to avoid the consumer that failed.
    assert attr(failed_decode, "narwhal.engine") == "d0"
    assert attr(spans.children(second)[0], "narwhal.avoid") == ("d0",)
    root = spans.root()
    assert [e.name for e in root.events] == ["retry"]
    assert root.status.status_code == StatusCode.UNSET
    assert errors(spans) == ["narwhal.decode", "narwhal.attempt"]


#: The span each terminal class records its error on.
_FAILED_SPAN = {
    "prefill_failed": ["narwhal.prefill"],
    "invalid_descriptor": ["narwhal.handoff"],
    "decode_failed": ["narwhal.decode"],
    "first_token_timeout": ["narwhal.decode"],
    "silence_timeout": ["narwhal.decode"],
    # The handoff expired while the consumer held it: both failed.
    "handoff_expired": ["narwhal.handoff", "narwhal.decode"],
}


def _fault_cases() -> list[Case]:
    return [c for c in CASES if c.restart_producer_at is None]


@pytest.mark.parametrize("case", _fault_cases(), ids=[c.id for c in _fault_cases()])
async def test_each_fault_is_recorded_on_the_span_that_failed(
    autojump_clock: trio.abc.Clock, spans: Spans, case: Case
) -> None:
    async with open_stack(doc_for(**case.sections), tracing=spans.tracing) as stack:
        stack.engine(case.engine).inject(case.fault)
        for name, fault in case.also:
            stack.engine(name).inject(fault)
        async with stack.client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
            await resp.aread()
        await trio.testing.wait_all_tasks_blocked()
    spans.assert_whole()
    [record] = stack.records
    assert record["terminal_class"] == case.klass
    root = spans.root()
    assert attr(root, "narwhal.terminal_class") == case.klass
    assert record["trace_id"] == format(root.get_span_context().trace_id, "032x")
    [attempt] = spans.children(root)
    names = [name for name, _ in spans.tree(attempt)[1]]
    assert names[:2] == ["narwhal.placement", "narwhal.prefill"]
    if case.klass == "invalid_request":
        # The engine refused the client's request: recorded on its leg, no server error.
        leg = "narwhal.prefill" if case.engine == "p0" else "narwhal.decode"
        assert errors(spans) == [leg]
        assert root.status.status_code == StatusCode.UNSET
        return
    expected = _FAILED_SPAN[case.klass]
    assert sorted(errors(spans)) == sorted([*expected, "narwhal.attempt", "POST /v1/completions"])
    for name in expected:
        failed = spans.one(name)
        assert any(e.name == "exception" for e in failed.events), name
    assert attempt.status.status_code == StatusCode.ERROR
    assert attr(attempt, "narwhal.outcome") == case.klass
    if record["attempts"][0]["deadline"] is not None:
        assert attr(attempt, "narwhal.deadline") == record["attempts"][0]["deadline"]
    if case.klass == "silence_timeout":
        decode = spans.one("narwhal.decode")
        assert attr(decode, "gen_ai.usage.output_tokens") == 2
        assert attr(decode, "narwhal.ended_by") == "engine.decode_read_timeout_s"
    if case.klass == "invalid_descriptor":
        assert attr(spans.one("narwhal.handoff"), "narwhal.handoff.validated") is False
        assert "narwhal.decode" not in names


async def test_a_refused_placement_fails_the_placement_span(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    doc = fleet_doc(controller={"slo": {"ttft_s": 0.001}, "admission": "refuse"})
    async with open_stack(doc, priced=True, tracing=spans.tracing) as stack:
        resp = await stack.complete(BODY)
        assert resp.status_code == 503
    spans.assert_whole()
    assert spans.tree() == ("POST /v1/completions", [("narwhal.attempt", [("narwhal.placement", [])])])
    placement = spans.one("narwhal.placement")
    assert placement.status.status_code == StatusCode.ERROR
    assert "no placement meets the SLO" in (placement.status.description or "")
    assert attr(placement, "narwhal.ended_by") == "refused"
    assert attr(spans.root(), "http.response.status_code") == 503


async def test_the_request_deadline_ends_the_leg_that_held_it(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    doc = fleet_doc(engine={"request_timeout_s": 2.0})
    async with open_stack(doc, tracing=spans.tracing) as stack:
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=10.0))
        resp = await stack.complete(BODY)
        assert resp.status_code == 504
    spans.assert_whole()
    decode = spans.one("narwhal.decode")
    assert attr(decode, "narwhal.ended_by") == "deadline_exceeded"
    assert decode.status.status_code == StatusCode.ERROR
    assert attr(spans.one("narwhal.attempt"), "narwhal.deadline") == "engine.request_timeout_s"
    assert attr(spans.root(), "narwhal.terminal_class") == "deadline_exceeded"


async def test_a_client_that_leaves_ends_every_span(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    async with open_stack(tracing=spans.tracing) as stack:
        stream = await stack.net.connect(ROUTER_HOST, ROUTER_PORT)
        body = json.dumps({**BODY, "max_tokens": 1000, "stream": True}).encode()
        await stream.send_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
            b"traceparent: %s\r\ncontent-length: %d\r\n\r\n%s" % (TRACEPARENT.encode(), len(body), body)
        )
        received = b""
        while received.count(b"data: ") < 3:
            received += await stream.receive_some()
        await stream.aclose()
        await trio.sleep(ServerLimits().disconnect_check_s)
        await trio.testing.wait_all_tasks_blocked()
    spans.assert_whole()
    [record] = stack.records
    assert record["terminal_class"] == "client_cancelled"
    root = spans.root()
    assert attr(root, "narwhal.terminal_class") == "client_cancelled"
    decode = spans.one("narwhal.decode")
    assert attr(decode, "narwhal.ended_by") == "client_cancelled"
    assert [e.name for e in decode.events] == ["first_token"]
    # The client left: nothing failed.
    assert errors(spans) == []


# ---------------------------------------------------------------- sampling


async def test_an_unsampled_request_records_nothing_and_passes_its_decision_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    spans = Spans(sampler=ParentBased(ALWAYS_OFF))
    async with open_stack(tracing=spans.tracing) as stack:
        assert (await stack.complete(BODY)).status_code == 200
        # A client's sampled trace is followed (parent-based).
        assert (await stack.complete(BODY, headers={"traceparent": TRACEPARENT})).status_code == 200
        unsampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
        assert (await stack.complete(BODY, headers={"traceparent": unsampled})).status_code == 200
        seen = trace_headers(stack, "p0")
    assert [r["trace_id"] for r in stack.records] == [None, CLIENT_TRACE, None]
    assert [s.name for s in spans.all if s.kind == SpanKind.SERVER] == ["POST /v1/completions"]
    # The engines learn the decision: the sampled flag (bit 0 of the flags).
    assert [int(h["traceparent"][-2:], 16) & 1 for h in seen] == [0, 1, 0]
    assert seen[2]["traceparent"].split("-")[1] == CLIENT_TRACE


# ---------------------------------------------------------------- off, and probes


async def test_off_nothing_is_sent_to_the_engines(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        assert stack.router.state.tracing is None
        resp = await stack.complete(BODY, headers={"traceparent": TRACEPARENT, "baggage": "a=b"})
        assert resp.status_code == 200
        assert trace_headers(stack, "p0") == trace_headers(stack, "d0") == [{}]
    assert stack.records[0]["trace_id"] is None


async def test_a_probe_is_a_trace_of_its_own(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]),
        recovery={"eject_after": 1, "probe_interval_s": 1.0},
    )  # fmt: skip
    async with open_stack(doc, tracing=spans.tracing) as stack:
        for name in ("d0", "d1"):
            stack.engine(name).inject(FaultSpec(kind="http_error", on="decode", status=500, times=2))
        assert (await stack.complete(BODY)).status_code == 502
        breaker = stack.router.state.breaker
        ejected = next(n for n in ("d0", "d1") if breaker.states[n].ejected)
        await trio.sleep(1.5)  # the first probe meets the second fault
        await trio.sleep(1.5)  # the second probe succeeds
        await trio.testing.wait_all_tasks_blocked()
        assert not breaker.states[ejected].ejected
        seen = trace_headers(stack, ejected)[1:]  # the probes' decodes
        producer_seen = trace_headers(stack, "p0")[1:]
    probes = spans.named("narwhal.probe")
    assert [attr(p, "narwhal.probe.outcome") for p in probes] == ["failed", "ok"]
    assert all(p.parent is None and attr(p, "narwhal.engine") == ejected for p in probes)
    assert attr(probes[0], "narwhal.probe.path") == "decode (after a decode failure)"
    assert probes[0].status.status_code == StatusCode.ERROR
    assert probes[1].status.status_code == StatusCode.UNSET
    # Each leg of a probe (the fresh handoff from p0, the decode) names the probe's span.
    expected = [f"00-{format(p.get_span_context().trace_id, '032x')}-{span_id(p)}" for p in probes]
    assert [h["traceparent"][:-3] for h in seen] == expected
    assert [h["traceparent"][:-3] for h in producer_seen] == expected


# ---------------------------------------------------------------- exemplars


def _exemplars(text: str) -> dict[str, list[str]]:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    out: dict[str, list[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.exemplar is not None:
                out.setdefault(sample.name, []).append(sample.exemplar.labels["trace_id"])
    return out


async def test_latency_histograms_carry_trace_ids_in_openmetrics(autojump_clock: trio.abc.Clock, spans: Spans) -> None:
    import httpx

    async with open_stack(tracing=spans.tracing) as stack:
        stack.net.listen("admin.test", 8001, stack.router.admin)
        assert (await stack.complete(BODY, headers={"traceparent": TRACEPARENT})).status_code == 200
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
            plain = await admin.get("/metrics")
            om = await admin.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert plain.headers["content-type"].startswith("text/plain")
    assert "trace_id" not in plain.text  # the classic format has no exemplars
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    found = _exemplars(om.text)
    for name in ("narwhal_router_ttft_seconds_bucket", "narwhal_router_first_byte_seconds_bucket",
                 "narwhal_router_tpot_seconds_bucket", "narwhal_request_duration_seconds_bucket"):  # fmt: skip
        assert found[name] == [CLIENT_TRACE], name
    assert om.text.rstrip().endswith("# EOF")




async def test_the_request_span_names_its_tenant_and_class(autojump_clock: trio.abc.Clock) -> None:
    spans = Spans()
    doc = fleet_doc(
        server={"api_keys": [{"key": "sk-etl", "name": "etl"}]},
        tenancy={"classes": [{"name": "batch", "wait": True, "slo": {"ttft_s": 5.0}}],
                 "tenants": [{"name": "etl", "latency_class": "batch"}]},
    )  # fmt: skip
    async with open_stack(doc, priced=True, tracing=spans.tracing) as stack:
        long = {"prompt": " ".join(["w"] * 3000), "max_tokens": 2}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(stack.complete, long, headers={"authorization": "Bearer sk-etl"}))
            await trio.sleep(0.01)
            out = await stack.complete(BODY, headers={"authorization": "Bearer sk-etl"})
        queued = next(r for r in stack.records if r["queued_s"])
    assert out.status_code == 200
    roots = [s for s in spans.all if s.kind == SpanKind.SERVER]
    assert {attr(s, "narwhal.tenant") for s in roots} == {"etl"}
    assert {attr(s, "narwhal.latency_class") for s in roots} == {"batch"}
    [waited] = [s for s in roots if attr(s, "narwhal.queued_s")]
    assert attr(waited, "narwhal.queued_s") == queued["queued_s"] and attr(waited, "narwhal.request_id") == queued["request_id"]
