"""Prometheus /metrics and the live events WebSocket on the admin surface."""

from __future__ import annotations

import collections
import json
import math

import attrs
import httpx
import pytest
import trio
import trio.testing
import trio_websocket
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from narwhal.config import FaultSpec, parse_fleet
from narwhal.router.journal import Journal
from narwhal.router.state import RouterState

from .routerkit import engine, fleet_doc, open_stack

ADMIN = ("admin.test", 8001)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_parse_and_counters_move(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(recovery={"eject_after": 1, "probe_interval_s": 1000.0})
    async with open_stack(doc) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
            before = _samples((await admin.get("/metrics")).text)
            assert before[("narwhal_in_flight_requests", ())] == 0
            for _ in range(3):
                assert (await stack.complete({"prompt": "a b c", "max_tokens": 4})).status_code == 200
            stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=1))
            assert (await stack.complete({"prompt": "a b c", "max_tokens": 4})).status_code == 502
            resp = await admin.get("/metrics")
            assert resp.headers["content-type"].startswith("text/plain")
            after = _samples(resp.text)
    ok = (("route", "completions"), ("terminal_class", "ok"))
    failed = (("route", "completions"), ("terminal_class", "decode_failed"))
    assert after[("narwhal_requests_total", ok)] == 3
    assert after[("narwhal_requests_total", failed)] == 1
    assert after[("narwhal_router_ttft_seconds_count", (("route", "completions"),))] == 3
    assert after[("narwhal_router_tpot_seconds_count", (("route", "completions"),))] == 3
    assert after[("narwhal_output_tokens_total", (("route", "completions"),))] == 12
    assert after[("narwhal_placement_decisions_total", (("consumer", "d0"), ("producer", "p0")))] == 4
    # d0 is the only decode engine: ejected all the same.
    assert after[("narwhal_breaker_state", (("engine", "d0"),))] == 2
    assert after[("narwhal_breaker_transitions_total", (("engine", "d0"), ("event", "ejected")))] == 1
    assert after[("narwhal_reservations_open", ())] == 0


async def test_events_deliver_a_record_and_a_breaker_transition(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(recovery={"eject_after": 1, "probe_interval_s": 1000.0})
    async with open_stack(doc) as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        stream = await stack.net.connect(*ADMIN)
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, "admin.test", "/events")
            await trio.testing.wait_all_tasks_blocked()
            assert stack.router.events.subscribers == 1
            resp = await stack.complete({"prompt": "a b", "max_tokens": 2}, headers={"x-request-id": "evt-1"})
            assert resp.status_code == 200
            event = json.loads(await ws.get_message())
            assert event["type"] == "request"
            assert event["record"]["request_id"] == "evt-1"
            assert event["record"]["terminal_class"] == "ok"
            stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=1))
            await stack.complete({"prompt": "a b", "max_tokens": 2})
            kinds = [json.loads(await ws.get_message()) for _ in range(2)]
            assert {"breaker", "request"} == {k["type"] for k in kinds}
            breaker = [(k["engine"], k["event"]) for k in kinds if k["type"] == "breaker"]
            assert breaker == [("d0", "ejected")]
            await ws.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert stack.router.events.subscribers == 0


async def test_events_requires_websocket(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        stack.net.listen(*ADMIN, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
            assert (await admin.get("/events")).status_code == 400
            assert (await admin.post("/metrics")).status_code == 405
            assert (await admin.get("/health")).status_code == 200


class _ReferenceMetrics:
    """The router's counters and histograms as prometheus_client's own Counter and
    Histogram keep them (how RouterMetrics fed them before it kept plain counters)."""

    def __init__(self, state: RouterState) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        from narwhal.router import metrics as m

        self.m = m
        self.registry = r = CollectorRegistry(auto_describe=True)
        lat, tpot, err = m._LATENCY_BUCKETS, m._TPOT_BUCKETS, m._ERROR_BUCKETS
        self.requests = Counter("narwhal_requests", "Client requests by route and terminal class.",
                                ["route", "terminal_class"], registry=r)
        self.model_requests = Counter("narwhal_model_requests", "Client requests by model and terminal class.",
                                      ["model", "terminal_class"], registry=r)
        self.ttft = Histogram("narwhal_router_ttft_seconds", "Router TTFT: arrival to producer HTTP completion.",
                              ["route"], buckets=lat, registry=r)
        self.first_byte = Histogram("narwhal_router_first_byte_seconds",
                                    "Arrival to the first generated decode output.", ["route"], buckets=lat, registry=r)
        self.tpot = Histogram("narwhal_router_tpot_seconds", "Prefill completion to final token over output_len - 1.",
                              ["route"], buckets=tpot, registry=r)
        self.duration = Histogram("narwhal_request_duration_seconds", "Arrival to terminal outcome.",
                                  ["route"], buckets=lat, registry=r)
        self.output_tokens = Counter("narwhal_output_tokens", "Identified output tokens delivered.", ["route"],
                                     registry=r)
        self.retries = Counter("narwhal_retries", "Fresh attempts after a transient fault.", registry=r)
        self.resumes = Counter("narwhal_resumes", "Streams continued on another attempt after a failure once "
                               "output was sent (recovery.resume_streams), by what broke them.", ["cause"], registry=r)
        self.placements = Counter("narwhal_placement_decisions", "Attempts placed, by producer and consumer.",
                                  ["producer", "consumer"], registry=r)
        self.refusals = Counter("narwhal_placement_refusals", "Requests refused for lack of capacity.", registry=r)
        self.attempt_outcomes = Counter("narwhal_attempts", "Attempts by engine role and outcome.",
                                        ["engine", "role", "outcome"], registry=r)
        self.breaker_transitions = Counter("narwhal_breaker_transitions", "Breaker transitions by engine and event.",
                                           ["engine", "event"], registry=r)
        self.ttft_error = Histogram(
            "narwhal_ttft_prediction_error_ratio",
            "|predicted - observed| / observed router TTFT of priced attempts, by producer.",
            ["engine"], buckets=err, registry=r)
        self.cached_tokens = Counter(
            "narwhal_prefix_cached_tokens",
            "Prompt tokens served by producers' prefix caches: as the router predicted them and "
            "as the producers reported them (usage.prompt_tokens_details).", ["engine", "source"], registry=r)
        self.consumer_cached_tokens = Counter(
            "narwhal_prefix_consumer_cached_tokens",
            "Prompt tokens consumers held in their prefix caches and so did not pull, as the router "
            "predicted them (compare the consumer's vllm:prompt_tokens_by_source{source=\"local_cache_hit\"}).",
            ["engine"], registry=r)
        self.tenant_requests = Counter("narwhal_tenant_requests",
                                       "Client requests by latency class, tenant and terminal class.",
                                       ["latency_class", "tenant", "terminal_class"], registry=r)
        self.tenant_slo = Counter(
            "narwhal_tenant_slo", "Requests that met (ok, first byte within the class's TTFT target, TPOT within "
            "its TPOT target) or missed their class's targets, by class and tenant; refused and failed ones miss.",
            ["latency_class", "tenant", "outcome"], registry=r)
        self.queue_wait = Histogram(
            "narwhal_admission_wait_seconds", "Time queued requests waited in the router for capacity, by class "
            "and tenant.", ["latency_class", "tenant"], buckets=m._WAIT_BUCKETS, registry=r)
        self.windows: dict[tuple[str, str], collections.deque[bool]] = {}
        r.register(m._Attainment(self.windows))
        r.register(m._LiveState(state, None))

    def on_record(self, record: dict) -> None:
        route, klass = record["route"], record["terminal_class"]
        if record.get("tenant") is not None:  # (a fleet without tenancy: each class meets it by succeeding)
            labels = (record["latency_class"], record["tenant"])
            self.tenant_requests.labels(*labels, klass).inc()
            if record.get("queued_s"):
                self.queue_wait.labels(*labels).observe(record["queued_s"])
            if klass != "client_cancelled":
                self.tenant_slo.labels(*labels, "met" if klass == "ok" else "missed").inc()
                self.windows.setdefault(labels, collections.deque(maxlen=self.m.ATTAINMENT_WINDOW)).append(klass == "ok")
        self.requests.labels(route, klass).inc()
        if record.get("model"):
            self.model_requests.labels(record["model"], klass).inc()
        if klass == "refused":
            self.refusals.inc()
        if record.get("latency_s") is not None:
            self.duration.labels(route).observe(record["latency_s"])
        if klass == "ok":
            for family, name in ((self.ttft, "ttft_s"), (self.first_byte, "first_byte_s"), (self.tpot, "tpot_s")):
                if record.get(name) is not None:
                    family.labels(route).observe(record[name])
        if record.get("output_len"):
            self.output_tokens.labels(route).inc(record["output_len"])
        attempts = record.get("attempts") or []
        resumed = [a["resume"] for a in attempts if a.get("resume")]
        for cause in resumed:
            self.resumes.labels(cause).inc()
        if len(attempts) - 1 > len(resumed):
            self.retries.inc(len(attempts) - 1 - len(resumed))
        for attempt in attempts:
            producer, consumer = attempt.get("producer"), attempt.get("consumer")
            if producer and consumer:
                self.placements.labels(producer, consumer).inc()
                self.attempt_outcomes.labels(producer, "prefill", attempt["outcome"]).inc()
                self.attempt_outcomes.labels(consumer, "decode", attempt["outcome"]).inc()
            if not producer or attempt.get("ttft_s") is None:
                continue
            predicted, observed = attempt.get("predicted_ttft_s"), attempt["ttft_s"]
            if predicted is not None and observed > 0:
                self.ttft_error.labels(producer).observe(abs(predicted - observed) / observed)
            if attempt.get("predicted_cached_tokens") is not None:
                self.cached_tokens.labels(producer, "predicted").inc(attempt["predicted_cached_tokens"])
                self.cached_tokens.labels(producer, "reported").inc(attempt.get("cached_tokens") or 0)
            if consumer and attempt.get("consumer_predicted_cached_tokens") is not None:
                self.consumer_cached_tokens.labels(consumer).inc(attempt["consumer_predicted_cached_tokens"])


def _attempt(**fields: object) -> dict:
    base = {"producer": "p0", "consumer": "d0", "outcome": "ok", "ttft_s": 0.02, "predicted_ttft_s": None,
            "predicted_cached_tokens": None, "cached_tokens": None, "consumer_predicted_cached_tokens": None}
    return {**base, **fields}


async def test_metrics_exposition_is_prometheus_clients(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RouterMetrics' counters and histograms expose exactly what prometheus_client's
    Counter and Histogram expose for the same records and transitions: every sample,
    label, bucket, float sum and family in the same order."""
    import time as time_module

    from narwhal.router.metrics import RouterMetrics

    # One instant for every _created stamp of both (children are created at different moments).
    monkeypatch.setattr(time_module, "time", lambda: 1_700_000_000.25)
    doc = fleet_doc(recovery={"eject_after": 1, "probe_interval_s": 1000.0})
    async with open_stack(doc) as stack:
        state = stack.router.state
        ours, reference = RouterMetrics(state), _ReferenceMetrics(state)
        state.journal.add_listener(reference.on_record)
        state.breaker.add_listener(lambda t: reference.breaker_transitions.labels(t.engine, t.event).inc())
        for _ in range(2):
            assert (await stack.complete({"prompt": "a b c", "max_tokens": 4})).status_code == 200
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=1))
        assert (await stack.complete({"prompt": "a b c", "max_tokens": 4})).status_code == 502
        records = [
            {"route": "chat", "terminal_class": "ok", "model": "m1", "latency_s": 0.0123456789, "ttft_s": 0.005,
             "first_byte_s": 0.1, "tpot_s": 0.001, "output_len": 7,
             "attempts": [_attempt(outcome="decode_failed", ttft_s=None), _attempt(predicted_ttft_s=0.03,
                          predicted_cached_tokens=16, cached_tokens=None, consumer_predicted_cached_tokens=8)]},
            {"route": "completions", "terminal_class": "refused", "latency_s": 1e-9, "attempts": []},
            {"route": "chat", "terminal_class": "ok", "model": "m1", "latency_s": 120.0, "ttft_s": 60.0,
             "first_byte_s": 61.0, "tpot_s": 5.0, "output_len": 1, "attempts": [_attempt(predicted_ttft_s=0.02)]},
            {"route": "completions", "terminal_class": "deadline_exceeded", "latency_s": None,
             "attempts": [_attempt(producer=None, consumer=None, outcome="deadline_exceeded")]},
            # Three attempts: one failed before a consumer was chosen, one whose router TTFT
            # was 0 (no error ratio), one with the producer's cached tokens reported.
            {"route": "completions", "terminal_class": "ok", "latency_s": 0.5, "ttft_s": 0.1, "output_len": 3,
             "attempts": [_attempt(consumer=None, outcome="prefill_failed", ttft_s=None),
                          _attempt(ttft_s=0.0, predicted_ttft_s=0.01),
                          _attempt(predicted_cached_tokens=32, cached_tokens=16)]},
            # Resumes (recovery.resume_streams) are counted by cause, not as retries.
            {"route": "completions", "terminal_class": "ok", "latency_s": 0.5, "ttft_s": 0.1, "output_len": 9,
             "attempts": [_attempt(outcome="prefill_failed", ttft_s=None), _attempt(outcome="decode_failed"),
                          _attempt(outcome="first_token_timeout", resume="stream_closed"),
                          _attempt(resume="first_token_timeout")]},
            {"route": "chat", "terminal_class": "decode_failed", "latency_s": 0.5, "ttft_s": 0.1, "output_len": 9,
             "attempts": [_attempt(outcome="decode_failed"), _attempt(outcome="decode_failed", resume="stream_closed")]},
            # No producer (an attempt cut before placement) has nothing to compare.
            {"route": "chat", "terminal_class": "deadline_exceeded", "latency_s": 2.0,
             "attempts": [_attempt(producer=None, predicted_ttft_s=0.03, predicted_cached_tokens=8)]},
            # Tenants and classes: a queued success, a refusal at the queue's deadline, one cancelled.
            {"route": "chat", "terminal_class": "ok", "latency_s": 0.3, "tenant": "t1", "latency_class": "c1",
             "queued_s": 0.25, "attempts": []},
            {"route": "chat", "terminal_class": "refused", "latency_s": 1.0, "tenant": "t1", "latency_class": "c1",
             "queued_s": 1.0, "attempts": []},
            {"route": "chat", "terminal_class": "client_cancelled", "latency_s": 0.1, "tenant": "t2",
             "latency_class": "c1", "queued_s": 0.0, "attempts": []},
        ]
        for record in records:
            ours.on_record(record)
            reference.on_record(record)
        for engine, event in (("d0", "ejected"), ("d0", "restored"), ("p0", "quarantined")):
            transition = type("T", (), {"engine": engine, "event": event})()
            ours.on_transition(transition)
            reference.breaker_transitions.labels(engine, event).inc()
        assert ours.exposition().decode() == generate_latest(reference.registry).decode()


def _families(text: str) -> dict[str, tuple[str, str, list[tuple[str, dict[str, str], float]]]]:
    """Each family of an exposition: its type, its help text and its samples in order."""
    return {
        f.name: (f.type, f.documentation, [(s.name, s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(text)
    }


def _live_doc() -> dict:
    """Model a: producer p0, consumer d0; model b: producer p1, consumer d1."""
    engines = [engine(name, port, [role], model=model) | {"model": model}
               for name, port, role, model in (("p0", 8101, "prefill", "a"), ("p1", 8102, "prefill", "b"),
                                               ("d0", 8103, "decode", "a"), ("d1", 8104, "decode", "b"))]  # fmt: skip
    return fleet_doc(*engines, recovery={"failure_quarantine_s": 5.0})


@attrs.define
class _Subscriber:
    stale: str | None
    delivered: int = 11
    live: int = 7
    replays: int = 3
    probes: int = 5
    probe_gaps: int = 2
    resets: int = 1


async def test_live_gauges_are_read_from_the_state_when_scraped(autojump_clock: trio.abc.Clock) -> None:
    """The gauges an operator reads of the router's live state: each family's name, type,
    help, labels and values, in the order scraped."""
    from narwhal.router.events import EventHub
    from narwhal.router.metrics import RouterMetrics
    from narwhal.router.placement import EngineLoad
    from narwhal.router.prefix import EventView, PlacementView

    state = RouterState(parse_fleet(_live_doc()), journal=Journal(None))
    hub = EventHub()
    metrics = RouterMetrics(state, hub)
    state.in_flight = 3
    state.in_flight_by_engine.update(p0=2, d0=1)
    placement = state.placement
    placement.open_reservations = 2
    placement.loads["p0"] = EngineLoad(prefill_requests=1, prefill_tokens=120, engine_running=4, engine_waiting=3,
                                       engine_own=2)  # fmt: skip
    placement.loads["d0"] = EngineLoad(decode_requests=2, decode_kv_tokens=300, engine_running=1, engine_own=2)
    placement.set_models("d0", ["b", "a"])
    state.breaker.eject("d1", "down")
    state.breaker.record_failure("p1", "refused")
    state.prefix.views["p0"] = EventView()
    placed = state.prefix.views["p1"] = PlacementView(16, 8)
    placed.record(list(range(32)))  # two blocks
    state.prefix.fallbacks["d0"] = PlacementView(16, 8)
    state.kv_subscribers["p0"] = _Subscriber(stale=None)  # type: ignore[assignment]
    state.kv_subscribers["p1"] = _Subscriber(stale="replay probes find batches", delivered=4)  # type: ignore[assignment]
    for name, source in (("p0", "metrics"), ("d0", "stream"), ("p0", "metrics")):
        state.bad_input.report(name, source, "no number")
    with hub.subscribe(), hub.subscribe():
        families = _families(metrics.exposition().decode())
    recorded = {family.name for family in vars(metrics).values() if hasattr(family, "cells")}
    live = {name: family for name, family in families.items() if name.removesuffix("_created") not in recorded}
    per_engine = {"p0": 2, "p1": 0, "d0": 1, "d1": 0}
    loads = {"p0": (1, 120, 0, 0, 0), "p1": (0, 0, 0, 0, 0), "d0": (0, 0, 2, 300, 0), "d1": (0, 0, 0, 0, 0)}
    kinds = ("prefill_requests", "prefill_tokens", "decode_requests", "decode_kv_tokens", "decode_kv_shared_tokens")
    assert live == {
        "narwhal_event_subscribers": ("gauge", "Live event subscribers.", [("narwhal_event_subscribers", {}, 2)]),
        "narwhal_in_flight_requests": (
            "gauge", "Client requests being served.", [("narwhal_in_flight_requests", {}, 3)]
        ),
        "narwhal_engine_in_flight": ("gauge", "Engine legs in flight, by engine.", [
            ("narwhal_engine_in_flight", {"engine": e}, n) for e, n in per_engine.items()
        ]),
        "narwhal_reservations_open": ("gauge", "Open phase reservations.", [("narwhal_reservations_open", {}, 2)]),
        "narwhal_engine_reserved": ("gauge", "Reserved load by engine and kind.", [
            ("narwhal_engine_reserved", {"engine": e, "kind": k}, n)
            for e, values in loads.items() for k, n in zip(kinds, values, strict=True)
        ]),
        "narwhal_engine_others_requests": (
            "gauge",
            "Requests on the engine that other routers placed: its last /metrics report "
            "minus this router's legs on it then (0 without server.engine_load_poll_s).",
            [("narwhal_engine_others_requests", {"engine": e}, n) for e, n in (("p0", 5), ("p1", 0), ("d0", 0),
                                                                              ("d1", 0))],
        ),
        "narwhal_breaker_state": (
            "gauge",
            "Breaker state by engine: 0 in placement, 1 quarantined, 2 ejected, "
            "4 on trial (half-open).",
            [("narwhal_breaker_state", {"engine": e}, n) for e, n in (("p0", 0), ("p1", 1), ("d0", 0), ("d1", 2))],
        ),
        "narwhal_prefix_index_blocks": (
            "gauge",
            "Blocks in the router's view of each engine's prefix cache, by source (events or placements).",
            [("narwhal_prefix_index_blocks", {"engine": "p0", "source": "events"}, 0),
             ("narwhal_prefix_index_blocks", {"engine": "p1", "source": "placements"}, 2),
             ("narwhal_prefix_index_blocks", {"engine": "d0", "source": "placements"}, 0)],
        ),
        "narwhal_prefix_index_held_blocks": (
            "gauge", "Blocks of an approximate prefix view held by requests in flight (not evictable).",
            [("narwhal_prefix_index_held_blocks", {"engine": "p1"}, 0)],
        ),
        "narwhal_prefix_index_overflow_evicted": (
            "counter",
            "Blocks an engine's KV-event view evicted because it held more than the engine reports it can "
            "(its BlockRemoved events were lost).",
            [("narwhal_prefix_index_overflow_evicted_total", {"engine": "p0"}, 0)],
        ),
        "narwhal_prefix_hit_materialized_ratio": (
            "gauge",
            "Share of the prefix-cache hits the router predicted on an engine that its reports say "
            "materialized (recent placements); its hits are priced at it.", [],
        ),
        "narwhal_prefix_view_overpredicting": (
            "gauge", "1 while fewer than 80% of an engine's predicted prefix-cache hits materialize.", [],
        ),
        "narwhal_kv_events_stale": (
            "gauge",
            "1 while an engine's KV events are taken for stale (replay probes find batches that never "
            "arrived live, or its socket fails): its hits are priced from the prompts placed on it.",
            [("narwhal_kv_events_stale", {"engine": "p0"}, 0), ("narwhal_kv_events_stale", {"engine": "p1"}, 1)],
        ),
        "narwhal_kv_events": ("counter", "KV-event batches and replay probes per engine, by kind.", [
            ("narwhal_kv_events_total", {"engine": e, "kind": k}, n)
            for e, delivered in (("p0", 11), ("p1", 4))
            for k, n in (("delivered", delivered), ("live", 7), ("replays", 3), ("probes", 5), ("probe_gaps", 2),
                         ("resets", 1))
        ]),
        "narwhal_engine_bad_input": (
            "counter",
            "What engines sent that the router could not use, by engine and source (metrics, kv_events, "
            "tokenize, models, version, completions, stream): a value that is no number or out of range, "
            "an answer over its size limit, a count that contradicts its ids, a malformed event or batch.",
            [("narwhal_engine_bad_input_total", {"engine": "p0", "source": "metrics"}, 2),
             ("narwhal_engine_bad_input_total", {"engine": "d0", "source": "stream"}, 1)],
        ),
        "narwhal_ready": ("gauge", "1 when an engine can prefill and one can decode.", [("narwhal_ready", {}, 1)]),
        "narwhal_engine_model": (
            "gauge", "1 for each model an engine serves (declared or listed).",
            [("narwhal_engine_model", {"engine": e, "model": m}, 1)
             for e, m in (("p0", "a"), ("p1", "b"), ("d0", "a"), ("d0", "b"), ("d1", "b"))],
        ),
        "narwhal_model_ready": (
            "gauge", "1 when an engine of the model can prefill and one can decode.",
            [("narwhal_model_ready", {"model": "a"}, 1), ("narwhal_model_ready", {"model": "b"}, 0)],
        ),
    }
    # Without an event hub there is no subscriber gauge; the router is not ready once
    # no engine can decode, and no model is.
    state.breaker.eject("d0", "down")
    families = _families(RouterMetrics(state).exposition().decode())
    assert "narwhal_event_subscribers" not in families
    assert families["narwhal_ready"][2] == [("narwhal_ready", {}, 0)]
    assert families["narwhal_model_ready"][2] == [("narwhal_model_ready", {"model": m}, 0) for m in "ab"]
    assert "narwhal_model_correction" not in families and "narwhal_profile_unbound" not in families
    await state.aclose()


async def test_priced_placement_gauges(autojump_clock: trio.abc.Clock) -> None:
    """Priced placement adds the model's drift per engine, its outcomes and the engines
    its profiles do not bind; a fleet whose model is not known yet has no model gauge."""
    from narwhal.profile.store import Profiles
    from narwhal.router.metrics import RouterMetrics
    from narwhal.router.pricing import PricedPlacement

    profiles = Profiles(schema_version=1, created_at="now", software={}, samples=None, engines={})  # type: ignore[arg-type]
    state = RouterState(parse_fleet(fleet_doc()), journal=Journal(None), profiles=profiles)
    placement = state.placement
    assert isinstance(placement, PricedPlacement)
    placement.ttft_correction.update(p0=1.5, d0=0.75)
    placement.tpot_correction.update(p0=1.0, d0=1.25)
    placement.counters.update(priced=4, fallback=1)
    placement.unbound["d0"] = "no profile"
    families = _families(RouterMetrics(state).exposition().decode())
    assert families["narwhal_model_correction"] == (
        "gauge", "Observed over predicted latency per engine (model drift; 1 = the profile holds).",
        [("narwhal_model_correction", {"engine": "p0", "metric": "ttft"}, 1.5),
         ("narwhal_model_correction", {"engine": "d0", "metric": "ttft"}, 0.75),
         ("narwhal_model_correction", {"engine": "p0", "metric": "tpot"}, 1.0),
         ("narwhal_model_correction", {"engine": "d0", "metric": "tpot"}, 1.25)],
    )
    assert families["narwhal_placement_pricing"] == (
        "counter", "Priced placement outcomes.",
        [("narwhal_placement_pricing_total", {"outcome": o}, n) for o, n in placement.counters.items()],
    )
    assert [n for o, n in placement.counters.items() if o in ("priced", "fallback")] == [4, 1]
    assert families["narwhal_profile_unbound"] == (
        "gauge", "1 for an engine placed by load only (its profile does not bind).",
        [("narwhal_profile_unbound", {"engine": "p0"}, 0), ("narwhal_profile_unbound", {"engine": "d0"}, 1)],
    )
    assert state.models == {} and families["narwhal_model_ready"][2] == []
    await state.aclose()


@pytest.mark.parametrize("buckets", [(0.25, 1.0), (0.0, 1.0), (-1.0, 0.5, 2.0), (0.25, 1.0, math.inf)])
def test_a_histogram_exposes_what_prometheus_clients_does_for_any_buckets(
    buckets: tuple[float, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sample, an infinite and a NaN observation included (NaN in no bucket), and no
    ``_sum`` when a bucket is negative, as prometheus_client has them."""
    import time as time_module

    from prometheus_client import CollectorRegistry, Histogram

    from narwhal.router import metrics as m

    monkeypatch.setattr(time_module, "time", lambda: 1_700_000_000.25)
    reference = CollectorRegistry(auto_describe=True)
    theirs = Histogram("h_seconds", "Doc.", ["k"], buckets=buckets, registry=reference)
    ours = m._Histogram("h_seconds", "Doc.", ("k",), buckets)
    for value in (-2.0, 0.0, 0.25, 0.3, 1.0, 5.0, math.inf, math.nan):
        theirs.labels("a").observe(value)
        ours.observe(("a",), value)
    theirs.labels("b").observe(0.5)
    ours.observe(("b",), 0.5)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(m._Families([ours]))
    assert generate_latest(registry).decode() == generate_latest(reference).decode()


async def test_a_family_of_a_name_the_router_exposes_cannot_be_registered_beside_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    from prometheus_client import Counter

    from narwhal.router.metrics import RouterMetrics

    state = RouterState(parse_fleet(fleet_doc()), journal=Journal(None))
    metrics = RouterMetrics(state)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("narwhal_requests", "Another.", registry=metrics.registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("narwhal_ready", "Another.", registry=metrics.registry)
    await state.aclose()
