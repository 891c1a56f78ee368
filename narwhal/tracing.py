"""OpenTelemetry tracing: one span tree per client request, its context into the engines.

A thin layer: the lifecycle, its legs, placement and the probes call it with what they
already know, and it turns that into spans. It is off unless the fleet document's
``tracing`` section or the standard OpenTelemetry environment turns it on
(:func:`open_tracing`); off, the router holds no :class:`Tracing` and the request path
does nothing for it. OpenTelemetry is an optional dependency (``narwhal[tracing]``):
nothing here imports it until tracing is asked for.

The span tree of one request (docs/operations.md, "Tracing")::

    POST /v1/completions            SERVER; a child of the client's traceparent, if any
    ├── narwhal.attempt             one per attempt (a retry is the next one)
    │   ├── narwhal.placement       candidates, the chosen pair and its predictions
    │   ├── narwhal.prefill         CLIENT; the producer's spans are its children
    │   ├── narwhal.handoff         the descriptor, validated; its age at the first token
    │   └── narwhal.decode          CLIENT; the consumer's spans are its children
    └── ...

Readmission probes are traces of their own (``narwhal.probe``). The engines get a
``traceparent`` (and the client's ``tracestate``) naming the leg's span, so vLLM's
request spans (``--otlp-traces-endpoint``) join the trace; nothing else the client sent
is forwarded. A client's malformed ``traceparent`` is ignored (the request starts a
trace of its own), never an error.

Spans are passed explicitly, never through the ambient OpenTelemetry context: trio
tasks each carry their own context, and the lifecycle's tasks should not depend on it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio

from narwhal import __version__
from narwhal.config import OTLP_PROTOCOLS, TracingConfig
from narwhal.errors import ConfigError, EngineError, HandoffExpired, InvalidDescriptor

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from narwhal.engines.connector import PrefillResult
    from narwhal.router.journal import AttemptRecord, RequestRecord

__all__ = [
    "INSTALL_HINT",
    "ProbeTrace",
    "RequestTrace",
    "Tracing",
    "check_tracing",
    "open_tracing",
    "tracing_wanted",
]

log = logging.getLogger("narwhal.tracing")

INSTALL_HINT = "pip install 'narwhal[tracing]'"
#: The headers of W3C Trace Context: all the router takes from a client, and all it sends on.
TRACE_HEADERS = ("traceparent", "tracestate")
#: How long closing waits for the last spans to leave (the exporter's own timeout bounds
#: each attempt; this bounds the whole).
_CLOSE_TIMEOUT_S = 5.0
#: Terminal classes that are no failure of the router's (HTTP semantic conventions: a
#: server span is an error for a 5xx, not for the client's own fault or departure).
_NOT_ERRORS = frozenset({"ok", "client_cancelled", "invalid_request"})


class HeaderSource(Protocol):
    def header(self, name: str) -> str | None: ...


class PlacementView(Protocol):
    """What the placement span reads of :class:`narwhal.router.placement.Placement`."""

    prefill_engines: list[str]
    decode_engines: list[str]

    def available(self, name: str) -> bool: ...

    def serves(self, name: str, model: str | None) -> bool: ...


# --------------------------------------------------------------------- configuration


def tracing_wanted(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters tracing should run with (``otlp``, ``console``); empty when off.

    Raises:
        ConfigError: the environment names an exporter narwhal does not ship.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    if config.endpoint is not None:
        return ["otlp"]
    named = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if named:
        unknown = [e for e in named if e not in ("otlp", "console", "none")]
        if unknown:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER names {', '.join(unknown)}: narwhal exports traces with "
                "otlp or console (or none)",
                path="$.tracing",
            )
        return [e for e in dict.fromkeys(named) if e != "none"]
    # The specification's default exporter is otlp: an endpoint alone asks for it.
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def _protocol(config: TracingConfig, environ: Mapping[str, str]) -> str:
    if config.protocol is not None:
        return config.protocol
    named = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (named or "http/protobuf").strip()
    if protocol not in OTLP_PROTOCOLS:
        raise ConfigError(
            f"OTLP protocol {protocol!r} (OTEL_EXPORTER_OTLP_PROTOCOL): narwhal exports with "
            + " or ".join(OTLP_PROTOCOLS),
            path="$.tracing.protocol",
        )
    return protocol


def _missing(why: str, exc: ImportError) -> ConfigError:
    return ConfigError(
        f"tracing is on ({why}) but the OpenTelemetry packages are not installed "
        f"({exc}): {INSTALL_HINT}",
        path="$.tracing",
    )


def _why(config: TracingConfig, environ: Mapping[str, str]) -> str:
    if config.endpoint is not None:
        return f"tracing.endpoint {config.endpoint}"
    if environ.get("OTEL_TRACES_EXPORTER"):
        return f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']}"
    return "OTEL_EXPORTER_OTLP_ENDPOINT"


def _exporters(config: TracingConfig, environ: Mapping[str, str], names: Sequence[str]) -> list[SpanExporter]:
    """The span exporters ``names`` asks for (raises ConfigError as :func:`check_tracing`)."""
    why = _why(config, environ)
    out: list[SpanExporter] = []
    try:
        for name in names:
            if name == "console":
                from opentelemetry.sdk.trace.export import ConsoleSpanExporter

                out.append(ConsoleSpanExporter())
            elif _protocol(config, environ) == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )

                out.append(GrpcExporter(endpoint=config.endpoint) if config.endpoint else GrpcExporter())
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as HttpExporter,
                )

                # The document's endpoint is a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT is.
                endpoint = config.endpoint.rstrip("/") + "/v1/traces" if config.endpoint else None
                out.append(HttpExporter(endpoint=endpoint))
    except ImportError as exc:
        raise _missing(why, exc) from None
    return out


def check_tracing(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether tracing is on; checks, before serving, what :func:`open_tracing` will need.

    Raises:
        ConfigError: tracing is on but its packages are missing, or the environment asks
            for what narwhal does not ship (an exporter, a protocol).
    """
    names = tracing_wanted(config, environ)
    if not names:
        return False
    why = _why(config, environ)
    try:
        import opentelemetry.sdk.trace

        if "otlp" in names:
            if _protocol(config, environ) == "grpc":
                import opentelemetry.exporter.otlp.proto.grpc.trace_exporter
            else:
                import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError as exc:
        raise _missing(why, exc) from None
    return True


def _resource(config: TracingConfig) -> Any:
    from opentelemetry.sdk.resources import Resource

    # What the environment says (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), over
    # narwhal's defaults; the document's service name over both.
    detected = dict(Resource.create().attributes)
    if str(detected.get("service.name", "")).startswith("unknown_service"):
        del detected["service.name"]
    attributes: dict[str, Any] = {
        "service.name": "narwhal",
        "service.version": __version__,
        # One per process: each worker of --workers is an instance of its own (the SDK's
        # own, a random one, wins where it makes one).
        "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
        **detected,
    }
    if config.service_name is not None:
        attributes["service.name"] = config.service_name
    return Resource(attributes)


def _sampler(config: TracingConfig) -> Any:
    if config.sampling_ratio is None:
        return None  # the SDK's: OTEL_TRACES_SAMPLER / _ARG, parentbased_always_on by default
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    ratio = TraceIdRatioBased(config.sampling_ratio)
    return ParentBased(ratio) if config.parent_based else ratio


def open_tracing(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """The router's tracing as ``config`` and the environment say; None when off.

    The provider and its batch span processor (a thread) are made here, in the process
    that serves: each worker of ``--workers`` calls this for itself.

    Raises:
        ConfigError: as :func:`check_tracing`.
    """
    names = tracing_wanted(config, environ)
    if not names:
        return None
    check_tracing(config, environ)
    exporters = _exporters(config, environ, names)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Not the global provider: several routers may share a process (tests), each its own.
    provider = TracerProvider(sampler=_sampler(config), resource=_resource(config), shutdown_on_exit=False)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on (%s): exporting with %s", _why(config, environ), ", ".join(
        n if n != "otlp" else f"otlp {_protocol(config, environ)}" for n in names
    ))  # fmt: skip
    return Tracing(provider)


# --------------------------------------------------------------------- the tracer


class Tracing:
    """The router's tracer over ``provider`` (its processors export the spans).

    Args:
        provider: an OpenTelemetry SDK tracer provider (tests give one with an in-memory
            exporter); :meth:`aclose` shuts it down.
    """

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("narwhal", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def request(self, request: HeaderSource, route: str, path: str, request_id: str) -> RequestTrace:
        """The spans of one client request, under the client's trace context if it sent one."""
        carrier = {}
        for name in TRACE_HEADERS:
            value = request.header(name)
            if value is not None:
                carrier[name] = value
        # A malformed traceparent extracts to no parent: the request starts its own trace.
        parent = self.propagator.extract(carrier) if carrier else None
        return RequestTrace(self, parent, route, path, request_id)

    def probe(self, engine: str, path: str) -> ProbeTrace:
        """The span of one readmission probe of ``engine`` (``path``: what it replays)."""
        return ProbeTrace(self, engine, path)

    def headers(self, span: Span) -> tuple[tuple[str, str], ...]:
        """``traceparent`` (and ``tracestate``) naming ``span``, for an engine request:
        what the W3C propagator's ``inject`` writes, formatted here (once per leg)."""
        ctx = span.get_span_context()
        parent = ("traceparent", f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}")
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        return (parent, ("tracestate", state)) if state else (parent,)

    async def aclose(self) -> None:
        """Export what is left and stop the exporters' threads (bounded)."""
        with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
            await trio.to_thread.run_sync(self.provider.shutdown, abandon_on_cancel=True)


def _child(tracing: Tracing, name: str, parent: Span, attributes: Mapping[str, Any], kind: Any = None) -> Span:
    """A span under ``parent`` with those of ``attributes`` that have a value."""
    from opentelemetry.trace import SpanKind, set_span_in_context

    return tracing.tracer.start_span(
        name,
        context=set_span_in_context(parent),
        kind=SpanKind.INTERNAL if kind is None else kind,
        attributes={k: v for k, v in attributes.items() if v is not None},
    )


def _set(span: Span, values: Iterable[tuple[str, Any]]) -> None:
    """Set the attributes that have a value (OpenTelemetry takes no None), at once (one
    lock and one pass of the SDK's checks, not one per attribute)."""
    span.set_attributes({key: value for key, value in values if value is not None})


def _error(span: Span, err: BaseException | None, message: str | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    if err is not None:
        span.record_exception(err)
    span.set_status(Status(StatusCode.ERROR, message))


def _engine_error(span: Span, err: EngineError) -> None:
    _set(span, (
        ("narwhal.error.class", type(err).__name__),
        ("narwhal.deadline", err.deadline),
        ("narwhal.engine", err.engine),
    ))  # fmt: skip
    _error(span, err, err.message)


class RequestTrace:
    """The spans of one client request (see the module docstring for the tree).

    The lifecycle calls the hooks in order; :meth:`finish` ends whatever is still open
    with the request's terminal class, so every path (an error, a deadline, a client
    that left, a shutdown) ends every span. A request the sampler drops records nothing:
    its hooks return at once, and the engines get its (unsampled) context.
    """

    def __init__(self, tracing: Tracing, parent: Context | None, route: str, path: str, request_id: str) -> None:
        from opentelemetry.trace import SpanKind

        self._tracing = tracing
        self.span = tracing.tracer.start_span(
            f"POST {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "http.route": path,
                "narwhal.route": route,
                "narwhal.request_id": request_id,
            },
        )
        context = self.span.get_span_context()
        self.recording = self.span.is_recording()
        #: The trace's id (hex) when it is sampled: the journal record carries it.
        self.trace_id = format(context.trace_id, "032x") if context.trace_flags.sampled else None
        self._unsampled_headers = () if self.recording else tracing.headers(self.span)
        self._attempt: Span | None = None
        self._attempt_record: AttemptRecord | None = None
        self._placement: Span | None = None
        self._leg: Span | None = None
        self._handoff: Span | None = None
        self._handoff_started_at = 0.0

    def admitted(self, tenant: str, latency_class: str | None) -> None:
        """The request's tenant and latency class are known."""
        if self.recording:
            _set(self.span, (("narwhal.tenant", tenant), ("narwhal.latency_class", latency_class)))

    # ---------------------------------------------------------------- attempts

    def attempt(self, record: AttemptRecord) -> None:
        """Attempt ``record.n`` begins (the previous one has ended, as its record says)."""
        if not self.recording:
            return
        self._end_attempt(None)
        if record.n > 1:
            self.span.add_event("retry", {"narwhal.attempt": record.n})
        self._attempt_record = record
        self._attempt = _child(self._tracing, "narwhal.attempt", self.span,
                               {"narwhal.attempt": record.n, "narwhal.retry": record.n > 1})  # fmt: skip

    def _end_attempt(self, terminal_class: str | None) -> None:
        span, record = self._attempt, self._attempt_record
        if span is None or record is None:
            return
        self._attempt = self._attempt_record = None
        outcome = record.outcome if record.outcome != "pending" else terminal_class
        _set(span, (
            ("narwhal.outcome", outcome),
            ("narwhal.producer", record.producer),
            ("narwhal.consumer", record.consumer),
            ("narwhal.same_worker", record.same_worker),
            ("narwhal.ttft_s", record.ttft_s),
            ("narwhal.placement_wait_s", record.placement_wait_s),
            ("narwhal.deadline", record.deadline),
            ("narwhal.held_by", record.held_by),
        ))  # fmt: skip
        if outcome is not None and outcome not in _NOT_ERRORS:
            _error(span, None, record.error or outcome)
        span.end()

    # ---------------------------------------------------------------- placement

    def placing(self, placement: PlacementView, model: str | None, avoid: Iterable[str]) -> None:
        """Placement of the current attempt begins: the engines it may choose from."""
        if not self.recording or self._attempt is None:
            return
        avoided = sorted(avoid)
        self._placement = _child(self._tracing, "narwhal.placement", self._attempt, {
            "narwhal.candidates.prefill": _candidates(placement, placement.prefill_engines, model),
            "narwhal.candidates.decode": _candidates(placement, placement.decode_engines, model),
            "narwhal.avoid": avoided or None,
        })  # fmt: skip

    def placed(self, record: AttemptRecord) -> None:
        """Placement chose the pair ``record`` names, with its predictions."""
        span, self._placement = self._placement, None
        if span is None:
            return
        _set(span, (
            ("narwhal.producer", record.producer),
            ("narwhal.consumer", record.consumer),
            ("narwhal.same_worker", record.same_worker),
            ("narwhal.predicted.ttft_s", record.predicted_ttft_s),
            ("narwhal.predicted.tpot_s", record.predicted_tpot_s),
            ("narwhal.predicted.cached_tokens", record.predicted_cached_tokens),
            ("narwhal.predicted.consumer_cached_tokens", record.consumer_predicted_cached_tokens),
            ("narwhal.placement_wait_s", record.placement_wait_s),
        ))  # fmt: skip
        span.end()

    # ---------------------------------------------------------------- the legs

    def _open_leg(self, name: str, engine: str, request_id: str | None) -> tuple[tuple[str, str], ...]:
        if not self.recording:
            return self._unsampled_headers
        from opentelemetry.trace import SpanKind

        parent = self._attempt if self._attempt is not None else self.span
        self._leg = _child(self._tracing, name, parent,
                           {"narwhal.engine": engine, "narwhal.backend_request_id": request_id},
                           SpanKind.CLIENT)  # fmt: skip
        return self._tracing.headers(self._leg)

    def prefill(self, engine: str, request_id: str | None) -> tuple[tuple[str, str], ...]:
        """The prefill leg on ``engine`` begins; returns the trace headers to send it."""
        return self._open_leg("narwhal.prefill", engine, request_id)

    def prefilled(self, result: PrefillResult, max_age_s: float) -> None:
        """The producer answered; with a descriptor (validated), the handoff begins."""
        span, self._leg = self._leg, None
        if span is None:
            return
        _set(span, (
            ("gen_ai.usage.input_tokens", result.prompt_tokens),
            ("narwhal.cached_tokens", result.cached_tokens),
        ))  # fmt: skip
        span.end()
        if not result.transfer or self._attempt is None:
            return
        descriptor = result.descriptor
        blocks = descriptor.get("remote_block_ids")
        self._handoff_started_at = result.started_at
        self._handoff = _child(self._tracing, "narwhal.handoff", self._attempt, {
            "narwhal.connector": result.connector,
            "narwhal.handoff.validated": result.validated,
            "narwhal.handoff.producer": result.producer,
            "narwhal.handoff.remote_engine_id": _text(descriptor.get("remote_engine_id")),
            "narwhal.handoff.endpoint": f"{result.endpoint[0]}:{result.endpoint[1]}" if result.endpoint else None,
            "narwhal.handoff.blocks": len(blocks) if isinstance(blocks, Sequence) else None,
            "narwhal.handoff.max_age_s": max_age_s,
            "narwhal.handoff.prefill_s": result.completed_at - result.started_at,
        })  # fmt: skip

    def decode(self, engine: str, request_id: str | None) -> tuple[tuple[str, str], ...]:
        """The decode leg on ``engine`` begins; returns the trace headers to send it."""
        return self._open_leg("narwhal.decode", engine, request_id)

    def first_token(self) -> None:
        """The decode leg's first token: the handoff is complete."""
        if self._leg is not None:
            self._leg.add_event("first_token")
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            handoff.set_attribute("narwhal.handoff.age_s", trio.current_time() - self._handoff_started_at)
            handoff.end()

    def decoded(self, tokens: int, cached_tokens: int | None) -> None:
        """The decode stream reached its end after ``tokens`` tokens."""
        span, self._leg = self._leg, None
        if span is None:
            return
        _set(span, (
            ("gen_ai.usage.output_tokens", tokens),
            ("narwhal.consumer_cached_tokens", cached_tokens),
            ("narwhal.ended_by", "done"),
        ))  # fmt: skip
        span.end()

    def failed(self, err: EngineError, tokens: int) -> None:
        """The attempt's leg failed with ``err``: recorded on the span that failed (the
        handoff for a descriptor that failed validation or a handoff that expired)."""
        if not self.recording:
            return
        leg, self._leg = self._leg, None
        handoff, self._handoff = self._handoff, None
        if isinstance(err, InvalidDescriptor | HandoffExpired):
            if handoff is None and self._attempt is not None:
                handoff = _child(self._tracing, "narwhal.handoff", self._attempt,
                                 {"narwhal.handoff.validated": False})  # fmt: skip
            if handoff is not None:
                _engine_error(handoff, err)
                handoff.end()
                handoff = None
            if isinstance(err, InvalidDescriptor) and err.leg == "prefill" and leg is not None:
                leg.end()  # the producer answered; its answer was what failed
                leg = None
        if handoff is not None:  # the decode leg failed before the first token
            handoff.set_attribute("narwhal.handoff.age_s", trio.current_time() - self._handoff_started_at)
            handoff.end()
        if leg is None:
            return
        if err.leg == "decode":
            _set(leg, (
                ("gen_ai.usage.output_tokens", tokens),
                ("narwhal.ended_by", err.deadline or err.terminal_class),
            ))  # fmt: skip
        _engine_error(leg, err)
        leg.end()

    # ---------------------------------------------------------------- the end

    def finish(self, record: RequestRecord) -> None:
        """The request ended as ``record`` says: end every span still open with its
        terminal class, and the request's span with the journal's key figures."""
        if not self.recording:
            return
        klass = record.terminal_class
        is_error = klass not in _NOT_ERRORS
        for span in (self._leg, self._handoff, self._placement):
            if span is not None:
                span.set_attribute("narwhal.ended_by", klass)
                if is_error:
                    _error(span, None, record.error or klass)
                span.end()
        self._leg = self._handoff = self._placement = None
        self._end_attempt(klass)
        span = self.span
        _set(span, (
            ("http.response.status_code", record.status),
            ("narwhal.terminal_class", klass),
            ("gen_ai.request.model", record.model),
            ("narwhal.stream", record.stream),
            ("gen_ai.usage.input_tokens", record.prompt_tokens),
            ("gen_ai.request.max_tokens", record.requested_output_len),
            ("gen_ai.usage.output_tokens", record.output_len),
            ("narwhal.ttft_s", record.ttft_s),
            ("narwhal.first_byte_s", record.first_byte_s),
            ("narwhal.tpot_s", record.tpot_s),
            ("narwhal.latency_s", record.latency_s),
            ("narwhal.producer", record.producer),
            ("narwhal.consumer", record.consumer),
            ("narwhal.attempts", len(record.attempts)),
            ("narwhal.queued_s", record.queued_s or None),
        ))  # fmt: skip
        if is_error:
            _error(span, None, record.error or klass)
        span.end()


class ProbeTrace:
    """The span of one readmission probe: a trace of its own, its legs' engines its children."""

    def __init__(self, tracing: Tracing, engine: str, path: str) -> None:
        self._tracing = tracing
        self.span = tracing.tracer.start_span(
            "narwhal.probe", attributes={"narwhal.engine": engine, "narwhal.probe.path": path}
        )
        #: The trace headers every leg of the probe sends.
        self.headers = tracing.headers(self.span)

    def finish(self, outcome: str, detail: str | None, err: BaseException | None = None) -> None:
        """The probe's verdict: ``ok``, ``failed`` or ``inconclusive``."""
        self.span.set_attribute("narwhal.probe.outcome", outcome)
        if outcome == "failed":
            _error(self.span, err, detail)
        elif detail is not None:
            self.span.set_attribute("narwhal.probe.detail", detail)
        self.span.end()


def _candidates(placement: PlacementView, names: Sequence[str], model: str | None) -> list[str]:
    return [n for n in names if placement.available(n) and placement.serves(n, model)]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None

