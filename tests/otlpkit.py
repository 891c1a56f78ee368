"""Small OTLP trace receivers for tests: OTLP/HTTP (protobuf) and OTLP/gRPC.

Each decodes the ``ExportTraceServiceRequest`` it receives with opentelemetry-proto's
generated classes and keeps every span, flattened with its resource's attributes, so
a test can wait for the spans it expects from a process it started (``narwhal serve``,
a vLLM engine).
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@attrs.frozen
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: int  # the proto's SpanKind: 1 internal, 2 server, 3 client
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int  # the proto's StatusCode: 0 unset, 1 ok, 2 error


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, which) if which else None


def _spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(ReceivedSpan(
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(), name=span.name, kind=span.kind,
                    attributes={kv.key: _value(kv.value) for kv in span.attributes},
                    resource=resource, status=span.status.code,
                ))  # fmt: skip
    return out


class Collected:
    """The spans a receiver got, in arrival order (thread-safe)."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.requests = 0

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = _spans(request)
        with self._lock:
            self.requests += 1
            self._spans.extend(spans)

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans once ``predicate`` holds of them; AssertionError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver did not get the spans expected: {[s.name for s in spans]}")
            time.sleep(0.05)


@contextmanager
def open_http_receiver(port: int = 0) -> Iterator[tuple[str, Collected]]:
    """An OTLP/HTTP receiver on loopback: (its base URL, what it collects)."""
    collected = Collected()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            collected.add(request)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", collected
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextmanager
def open_grpc_receiver() -> Iterator[tuple[str, Collected]]:
    """An OTLP/gRPC receiver on loopback (insecure): (its endpoint URL, what it collects)."""
    import grpc

    collected = Collected()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # (the generated method name)
            collected.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", collected
    finally:
        server.stop(grace=None).wait(5)
