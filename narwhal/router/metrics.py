"""Prometheus metrics of the router.

Counters and histograms are fed from the journal's record stream and the breaker's
transitions (listeners), so the request path does no extra work for them (plain
additions, exposed in prometheus_client's format when scraped); gauges of
live state (in-flight per engine, reservations, breaker state) are read at scrape
time by a custom collector. Each router has its own registry, so several routers in
one process (tests, ``--workers``) never share series.

With tracing on, the latency histograms keep an exemplar per bucket: the trace id of
the latest sampled request that fell in it. Only the OpenMetrics format carries them:
:meth:`RouterMetrics.render` answers in it when the scraper's ``Accept`` asks for
``application/openmetrics-text`` (Prometheus does with ``--enable-feature=exemplar-storage``),
and in the classic text format otherwise.
"""

from __future__ import annotations

import bisect
import collections
import math
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Exemplar, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from narwhal.router.breaker import Transition
from narwhal.router.events import EventHub
from narwhal.router.prefix import EventView
from narwhal.router.pricing import PricedPlacement
from narwhal.router.state import RouterState

__all__ = ["BREAKER_CODES", "CONTENT_TYPE", "EXPOSITION_HEADERS", "RouterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: The headers of a ``/metrics`` answer.
EXPOSITION_HEADERS: tuple[tuple[str, str]] = (("content-type", CONTENT_TYPE),)

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0,
)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
#: The ``narwhal_breaker_state`` gauge's value of each breaker state.
#: (3 is no longer used: the other codes keep the values dashboards know.)
BREAKER_CODES = {"ok": 0, "quarantined": 1, "ejected": 2, "trial": 4}
_ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
#: ``_created`` samples, unless switched off as prometheus_client switches them off.
_USE_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
#: ``narwhal_slo_attainment_ratio`` is over each (class, tenant)'s latest this many requests.
ATTAINMENT_WINDOW = 200


class _LiveState(Collector):
    def __init__(self, state: RouterState, events: EventHub | None) -> None:
        self.state = state
        self.events = events

    def collect(self) -> Iterator[Metric]:
        state = self.state
        if self.events is not None:
            subs = GaugeMetricFamily("narwhal_event_subscribers", "Live event subscribers.")
            subs.add_metric([], self.events.subscribers)
            yield subs
        in_flight = GaugeMetricFamily("narwhal_in_flight_requests", "Client requests being served.")
        in_flight.add_metric([], state.in_flight)
        yield in_flight
        per_engine = GaugeMetricFamily(
            "narwhal_engine_in_flight", "Engine legs in flight, by engine.", labels=["engine"]
        )
        for name, n in state.in_flight_by_engine.items():
            per_engine.add_metric([name], n)
        yield per_engine
        open_res = GaugeMetricFamily("narwhal_reservations_open", "Open phase reservations.")
        open_res.add_metric([], state.placement.open_reservations)
        yield open_res
        reserved = GaugeMetricFamily(
            "narwhal_engine_reserved", "Reserved load by engine and kind.", labels=["engine", "kind"]
        )
        # Priced placement counts the prompt blocks a consumer's streams share once.
        placement = state.placement
        shared_kv = placement.shared_kv if isinstance(placement, PricedPlacement) else {}
        for name, load in placement.loads.items():
            reserved.add_metric([name, "prefill_requests"], load.prefill_requests)
            reserved.add_metric([name, "prefill_tokens"], load.prefill_tokens)
            reserved.add_metric([name, "decode_requests"], load.decode_requests)
            reserved.add_metric([name, "decode_kv_tokens"], load.decode_kv_tokens)
            shared = shared_kv.get(name)
            reserved.add_metric([name, "decode_kv_shared_tokens"], shared.shared_tokens if shared is not None else 0)
        yield reserved
        others = GaugeMetricFamily(
            "narwhal_engine_others_requests",
            "Requests on the engine that other routers placed: its last /metrics report "
            "minus this router's legs on it then (0 without server.engine_load_poll_s).",
            labels=["engine"],
        )
        for name, load in state.placement.loads.items():
            others.add_metric([name], load.others)
        yield others
        breaker = GaugeMetricFamily(
            "narwhal_breaker_state",
            "Breaker state by engine: 0 in placement, 1 quarantined, 2 ejected, "
            "4 on trial (half-open).",
            labels=["engine"],
        )
        for name in state.breaker.states:
            breaker.add_metric([name], BREAKER_CODES[state.breaker.status(name)])
        yield breaker
        placement = state.placement
        if isinstance(placement, PricedPlacement):
            drift = GaugeMetricFamily(
                "narwhal_model_correction",
                "Observed over predicted latency per engine (model drift; 1 = the profile holds).",
                labels=["engine", "metric"],
            )
            for name, value in placement.ttft_correction.items():
                drift.add_metric([name, "ttft"], value)
            for name, value in placement.tpot_correction.items():
                drift.add_metric([name, "tpot"], value)
            yield drift
            priced = CounterMetricFamily(
                "narwhal_placement_pricing", "Priced placement outcomes.", labels=["outcome"]
            )
            for outcome, count in placement.counters.items():
                priced.add_metric([outcome], count)
            yield priced
            unbound = GaugeMetricFamily(
                "narwhal_profile_unbound", "1 for an engine placed by load only (its profile does not bind).",
                labels=["engine"],
            )
            for name in state.engines:
                unbound.add_metric([name], 1 if name in placement.unbound else 0)
            yield unbound
        views = GaugeMetricFamily(
            "narwhal_prefix_index_blocks",
            "Blocks in the router's view of each engine's prefix cache, by source (events or placements).",
            labels=["engine", "source"],
        )
        for name, view in state.prefix.views.items():
            views.add_metric([name, "events" if isinstance(view, EventView) else "placements"], len(view))
        for name, fallback in state.prefix.fallbacks.items():
            views.add_metric([name, "placements"], len(fallback))
        yield views
        yield from _cache_families(state)
        stale = GaugeMetricFamily(
            "narwhal_kv_events_stale",
            "1 while an engine's KV events are taken for stale (replay probes find batches that never "
            "arrived live, or its socket fails): its hits are priced from the prompts placed on it.",
            labels=["engine"],
        )
        batches = CounterMetricFamily(
            "narwhal_kv_events", "KV-event batches and replay probes per engine, by kind.", labels=["engine", "kind"]
        )
        for name, sub in state.kv_subscribers.items():
            stale.add_metric([name], 0 if sub.stale is None else 1)
            for kind, count in (("delivered", sub.delivered), ("live", sub.live), ("replays", sub.replays),
                                ("probes", sub.probes), ("probe_gaps", sub.probe_gaps), ("resets", sub.resets)):  # fmt: skip
                batches.add_metric([name, kind], count)
        yield stale
        yield batches
        bad = CounterMetricFamily(
            "narwhal_engine_bad_input",
            "What engines sent that the router could not use, by engine and source (metrics, kv_events, "
            "tokenize, models, version, completions, stream): a value that is no number or out of range, "
            "an answer over its size limit, a count that contradicts its ids, a malformed event or batch.",
            labels=["engine", "source"],
        )
        for (engine, source), count in list(state.bad_input.counts.items()):
            bad.add_metric([engine, source], count)
        yield bad
        admission = state.admission
        if admission.enabled:
            queued = GaugeMetricFamily(
                "narwhal_admission_queued", "Requests waiting in the router's queue for capacity, by class and tenant.",
                labels=["latency_class", "tenant"],
            )
            for (klass, tenant), n in admission.queued_by.items():
                queued.add_metric([klass, tenant], n)
            yield queued
            outcomes = CounterMetricFamily(
                "narwhal_admission", "Admission outcomes by class and tenant: queued, released (placed from the "
                "queue), expired (refused at the class's deadline), full (refused: queue full), limited (429).",
                labels=["latency_class", "tenant", "outcome"],
            )
            for (klass, tenant, outcome), n in admission.counters.items():
                outcomes.add_metric([klass, tenant, outcome], n)
            yield outcomes
            shares = GaugeMetricFamily(
                "narwhal_tenant_served_tokens", "Tokens served per unit of weight, by tenant (the fair share's count; "
                "the fleet's with tenancy.store).", labels=["tenant"],
            )
            for tenant in admission.tenancy.tenants:
                shares.add_metric([tenant], admission.served[tenant])
            yield shares
        ready = GaugeMetricFamily("narwhal_ready", "1 when an engine can prefill and one can decode.")
        ready.add_metric([], 1 if state.ready() else 0)
        yield ready
        serves = GaugeMetricFamily(
            "narwhal_engine_model", "1 for each model an engine serves (declared or listed).", labels=["engine", "model"]
        )
        for name, served in placement.models.items():
            for served_model in sorted(served):
                serves.add_metric([name, served_model], 1)
        yield serves
        model_ready = GaugeMetricFamily(
            "narwhal_model_ready", "1 when an engine of the model can prefill and one can decode.", labels=["model"]
        )
        for pool, reason in state.model_readiness().items():
            if pool is not None:
                model_ready.add_metric([pool], 1 if reason is None else 0)
        yield model_ready


def _cache_families(state: RouterState) -> Iterator[Metric]:
    """The prefix caches' calibration, the views' bounds and the cache plan."""
    held = GaugeMetricFamily(
        "narwhal_prefix_index_held_blocks",
        "Blocks of an approximate prefix view held by requests in flight (not evictable).", labels=["engine"],
    )
    overflow = CounterMetricFamily(
        "narwhal_prefix_index_overflow_evicted",
        "Blocks an engine's KV-event view evicted because it held more than the engine reports it can "
        "(its BlockRemoved events were lost).", labels=["engine"],
    )
    for name in state.prefix.views:
        view = state.prefix.view(name)
        if isinstance(view, EventView):
            overflow.add_metric([name], view.overflow_evicted)
        elif view is not None:
            held.add_metric([name], view.held)
    yield held
    yield overflow
    cal = state.cache_cal
    ratio = GaugeMetricFamily(
        "narwhal_prefix_hit_materialized_ratio",
        "Share of the prefix-cache hits the router predicted on an engine that its reports say "
        "materialized (recent placements); its hits are priced at it.", labels=["engine"],
    )
    over = GaugeMetricFamily(
        "narwhal_prefix_view_overpredicting",
        "1 while fewer than 80% of an engine's predicted prefix-cache hits materialize.", labels=["engine"],
    )
    for name in state.engines:
        value = cal.ratio(name)
        if value is not None:
            ratio.add_metric([name], value)
            over.add_metric([name], 1 if name in cal.overpredicting else 0)
    yield ratio
    yield over
    placement = state.placement
    plan = state.cache_plan
    if plan is None or not isinstance(placement, PricedPlacement):
        return
    rules = CounterMetricFamily(
        "narwhal_cache_plan_placements", "Priced placements by the rule that chose the producer.", labels=["rule"]
    )
    for rule, count in placement.rules.items():
        rules.add_metric([rule], count)
    yield rules
    groups = GaugeMetricFamily(
        "narwhal_cache_plan_groups", "Prefixes and sessions the cache plan gives each producer.", labels=["producer"]
    )
    price = GaugeMetricFamily(
        "narwhal_cache_plan_block_price_seconds",
        "Prefill seconds one more block on the producer costs later requests (the cache plan's price).",
        labels=["producer"],
    )
    for name in placement.prefill_engines:
        status = plan.status(name)
        groups.add_metric([name], float(status["owned_groups"]))  # type: ignore[arg-type]
        price.add_metric([name], plan.block_price.get(name, 0.0))
    yield groups
    yield price
    moves = CounterMetricFamily("narwhal_cache_plan_moves", "Groups the cache plan gave another owner.")
    moves.add_metric([], plan.moves)
    yield moves


class _Counter:
    """A counter family whose updates are plain float additions (no lock, no method
    chain); :meth:`samples` gives what ``prometheus_client.Counter`` exposes for the
    same updates (``_total``, then ``_created`` per child, in the order children appeared)."""

    __slots__ = ("cells", "doc", "labelnames", "name")

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = labelnames
        #: labels -> [value, created]
        self.cells: dict[tuple[str, ...], list[float]] = {}
        if not labelnames:
            self.cells[()] = [0.0, time.time()]

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        cell = self.cells.get(labels)
        if cell is None:
            cell = self.cells[labels] = [0.0, time.time()]
        cell[0] += amount

    def metric(self) -> Metric:
        metric = Metric(self.name, self.doc, "counter")
        names = self.labelnames
        for labels, (value, created) in list(self.cells.items()):
            # Its other mutants are killed (the exposition tests); strict only asserts.
            series = dict(zip(names, labels, strict=True))  # pragma: no mutate (equivalent: a cell's labels are as many as the family's names)
            metric.add_sample(self.name + "_total", series, value)
            if _USE_CREATED:
                metric.add_sample(self.name + "_created", series, created)
        return metric


class _Histogram:
    """A histogram family updated without locks; :meth:`metric` gives what
    ``prometheus_client.Histogram`` exposes for the same observations (cumulative
    ``_bucket`` samples with the same ``le`` labels, ``_count``, ``_sum`` summed in
    the same order, ``_created``)."""

    __slots__ = ("bounds", "cells", "doc", "exemplars", "labelnames", "le", "name")

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = labelnames
        bounds = [float(b) for b in buckets]
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        self.le = tuple(floatToGoString(b) for b in bounds)  # type: ignore[no-untyped-call]
        #: labels -> (counts per bucket, not cumulative; [sum, created])
        self.cells: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        #: labels -> per bucket, the latest exemplar (trace id, value, Unix time) or None
        #: (only once a traced observation came).
        self.exemplars: dict[tuple[str, ...], list[tuple[str, float, float] | None]] = {}

    def observe(self, labels: tuple[str, ...], amount: float, trace_id: str | None = None) -> None:
        cell = self.cells.get(labels)
        if cell is None:
            cell = self.cells[labels] = ([0] * len(self.bounds), [0.0, time.time()])
        cell[1][0] += amount
        if amount <= math.inf:  # (NaN falls in no bucket, as prometheus_client has it)
            bucket = bisect.bisect_left(self.bounds, amount)
            cell[0][bucket] += 1
            if trace_id is not None:
                kept = self.exemplars.get(labels)
                if kept is None:
                    kept = self.exemplars[labels] = [None] * len(self.bounds)
                kept[bucket] = (trace_id, amount, time.time())

    def metric(self) -> Metric:
        metric = Metric(self.name, self.doc, "histogram")
        names = self.labelnames
        for labels, (counts, (total, created)) in list(self.cells.items()):
            # Their other mutants are killed (the exposition tests); strict only asserts.
            series = dict(zip(names, labels, strict=True))  # pragma: no mutate (equivalent: a cell's labels are as many as the family's names)
            acc = 0.0
            kept = self.exemplars.get(labels)
            for i, (le, n) in enumerate(zip(self.le, counts, strict=True)):  # pragma: no mutate (equivalent: one count per bound)
                acc += n
                ex = kept[i] if kept is not None else None
                exemplar = None if ex is None else Exemplar({"trace_id": ex[0]}, ex[1], ex[2])
                metric.add_sample(self.name + "_bucket", {**series, "le": le}, acc, exemplar=exemplar)
            metric.add_sample(self.name + "_count", series, acc)
            if self.bounds[0] >= 0:
                metric.add_sample(self.name + "_sum", series, total)
            if _USE_CREATED:
                metric.add_sample(self.name + "_created", series, created)
        return metric


class _Families(Collector):
    """The counter and histogram families, in the order the registry lists them."""

    def __init__(self, families: list[_Counter | _Histogram]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.metric()


class _Attainment(Collector):
    """Each (class, tenant)'s share of its latest requests that met its class's targets."""

    def __init__(self, windows: dict[tuple[str, str], collections.deque[bool]]) -> None:
        self.windows = windows

    def collect(self) -> Iterator[Metric]:
        if not self.windows:
            return
        gauge = GaugeMetricFamily(
            "narwhal_slo_attainment_ratio",
            f"Share of each class and tenant's latest {ATTAINMENT_WINDOW} requests that met the class's targets "
            "(narwhal_tenant_slo_total counts them all).", labels=["latency_class", "tenant"],
        )
        for labels, window in self.windows.items():
            gauge.add_metric(list(labels), sum(window) / len(window))
        yield gauge


class RouterMetrics:
    """The router's metric families, fed by journal records and breaker transitions.

    A record updates plain counters (it runs once per request, on the event loop: no
    lock is needed); the families are built from them when scraped, with the samples,
    labels and order that ``prometheus_client``'s Counter and Histogram would give.
    """

    def __init__(self, state: RouterState, events: EventHub | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = _Counter(
            "narwhal_requests", "Client requests by route and terminal class.", ("route", "terminal_class")
        )
        self.model_requests = _Counter(
            "narwhal_model_requests", "Client requests by model and terminal class.", ("model", "terminal_class")
        )
        self.ttft = _Histogram(
            "narwhal_router_ttft_seconds", "Router TTFT: arrival to producer HTTP completion.",
            ("route",), _LATENCY_BUCKETS,
        )
        self.first_byte = _Histogram(
            "narwhal_router_first_byte_seconds", "Arrival to the first generated decode output.",
            ("route",), _LATENCY_BUCKETS,
        )
        self.tpot = _Histogram(
            "narwhal_router_tpot_seconds", "Prefill completion to final token over output_len - 1.",
            ("route",), _TPOT_BUCKETS,
        )
        self.duration = _Histogram(
            "narwhal_request_duration_seconds", "Arrival to terminal outcome.", ("route",), _LATENCY_BUCKETS
        )
        self.output_tokens = _Counter("narwhal_output_tokens", "Identified output tokens delivered.", ("route",))
        self.retries = _Counter("narwhal_retries", "Fresh attempts after a transient fault.")
        self.resumes = _Counter(
            "narwhal_resumes",
            "Streams continued on another attempt after a failure once output was sent "
            "(recovery.resume_streams), by what broke them.",
            ("cause",),
        )
        self.placements = _Counter(
            "narwhal_placement_decisions", "Attempts placed, by producer and consumer.", ("producer", "consumer")
        )
        self.refusals = _Counter("narwhal_placement_refusals", "Requests refused for lack of capacity.")
        self.attempt_outcomes = _Counter(
            "narwhal_attempts", "Attempts by engine role and outcome.", ("engine", "role", "outcome")
        )
        self.breaker_transitions = _Counter(
            "narwhal_breaker_transitions", "Breaker transitions by engine and event.", ("engine", "event")
        )
        self.ttft_error = _Histogram(
            "narwhal_ttft_prediction_error_ratio",
            "|predicted - observed| / observed router TTFT of priced attempts, by producer.",
            ("engine",), _ERROR_BUCKETS,
        )
        self.cached_tokens = _Counter(
            "narwhal_prefix_cached_tokens",
            "Prompt tokens served by producers' prefix caches: as the router predicted them and "
            "as the producers reported them (usage.prompt_tokens_details).",
            ("engine", "source"),
        )
        self.consumer_cached_tokens = _Counter(
            "narwhal_prefix_consumer_cached_tokens",
            "Prompt tokens consumers held in their prefix caches and so did not pull, as the router "
            "predicted them (compare the consumer's vllm:prompt_tokens_by_source{source=\"local_cache_hit\"}).",
            ("engine",),
        )
        self.tenant_requests = _Counter(
            "narwhal_tenant_requests", "Client requests by latency class, tenant and terminal class.",
            ("latency_class", "tenant", "terminal_class"),
        )
        self.tenant_slo = _Counter(
            "narwhal_tenant_slo", "Requests that met (ok, first byte within the class's TTFT target, TPOT within "
            "its TPOT target) or missed their class's targets, by class and tenant; refused and failed ones miss.",
            ("latency_class", "tenant", "outcome"),
        )
        self.queue_wait = _Histogram(
            "narwhal_admission_wait_seconds", "Time queued requests waited in the router for capacity, by class "
            "and tenant.", ("latency_class", "tenant"), _WAIT_BUCKETS,
        )
        #: (class, tenant) -> whether each of its latest requests met its targets.
        self.attainment: dict[tuple[str, str], collections.deque[bool]] = {}
        self.registry.register(_Families([
            self.requests, self.model_requests, self.ttft, self.first_byte, self.tpot, self.duration,
            self.output_tokens, self.retries, self.resumes, self.placements, self.refusals, self.attempt_outcomes,
            self.breaker_transitions, self.ttft_error, self.cached_tokens, self.consumer_cached_tokens,
            self.tenant_requests, self.tenant_slo, self.queue_wait,
        ]))  # fmt: skip
        self.registry.register(_Attainment(self.attainment))
        self.state = state
        self.registry.register(_LiveState(state, events))
        state.journal.add_listener(self.on_record)
        state.breaker.add_listener(self.on_transition)

    def on_record(self, record: dict[str, Any]) -> None:
        route = record["route"]
        klass = record["terminal_class"]
        tenant = record.get("tenant")
        if tenant is not None:
            self._on_tenant_record(record, tenant, klass)
        self.requests.inc((route, klass))
        model = record.get("model")
        if model:  # set once the model is known to be served (bounded labels)
            self.model_requests.inc((model, klass))
        if klass == "refused":
            self.refusals.inc(())
        key = (route,)
        trace_id = record.get("trace_id")  # an exemplar of each latency it observes
        latency = record.get("latency_s")
        if latency is not None:
            self.duration.observe(key, latency, trace_id)
        if klass == "ok":
            ttft, first_byte, tpot = record.get("ttft_s"), record.get("first_byte_s"), record.get("tpot_s")
            if ttft is not None:
                self.ttft.observe(key, ttft, trace_id)
            if first_byte is not None:
                self.first_byte.observe(key, first_byte, trace_id)
            if tpot is not None:
                self.tpot.observe(key, tpot, trace_id)
        output_len = record.get("output_len")
        if output_len:
            self.output_tokens.inc(key, output_len)
        attempts = record.get("attempts") or []
        if len(attempts) > 1:  # pragma: no mutate (equivalent: one attempt adds no retry; skipped so that most requests touch no counter)
            resumed = [a["resume"] for a in attempts if a.get("resume")]
            for cause in resumed:
                self.resumes.inc((cause,))
            if len(attempts) - 1 > len(resumed):
                self.retries.inc((), len(attempts) - 1 - len(resumed))
        for attempt in attempts:
            producer, consumer = attempt.get("producer"), attempt.get("consumer")
            if producer and consumer:
                outcome = attempt["outcome"]
                self.placements.inc((producer, consumer))
                self.attempt_outcomes.inc((producer, "prefill", outcome))
                self.attempt_outcomes.inc((consumer, "decode", outcome))
            if not producer or attempt.get("ttft_s") is None:
                continue  # the prefill did not complete: nothing to compare
            predicted, observed = attempt.get("predicted_ttft_s"), attempt["ttft_s"]
            if predicted is not None and observed > 0:
                self.ttft_error.observe((producer,), abs(predicted - observed) / observed)
            if attempt.get("predicted_cached_tokens") is not None:
                self.cached_tokens.inc((producer, "predicted"), attempt["predicted_cached_tokens"])
                self.cached_tokens.inc((producer, "reported"), attempt.get("cached_tokens") or 0)
            if consumer and attempt.get("consumer_predicted_cached_tokens") is not None:
                self.consumer_cached_tokens.inc((consumer,), attempt["consumer_predicted_cached_tokens"])

    def _on_tenant_record(self, record: dict[str, Any], tenant: str, terminal: str) -> None:
        latency_class = record.get("latency_class") or ""
        labels = (latency_class, tenant)
        self.tenant_requests.inc((*labels, terminal))
        if record.get("queued_s"):
            self.queue_wait.observe(labels, record["queued_s"])
        if terminal == "client_cancelled":
            return  # not the router's outcome: in no attainment
        spec = self.state.admission.tenancy.classes.get(latency_class)
        slo = spec.slo if spec is not None else None
        first, tpot = record.get("first_byte_s"), record.get("tpot_s")
        met = terminal == "ok" and (slo is None or (
            (slo.ttft_s is None or (first is not None and first <= slo.ttft_s))
            and (slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s)))  # fmt: skip
        self.tenant_slo.inc((*labels, "met" if met else "missed"))
        window = self.attainment.get(labels)
        if window is None:
            window = self.attainment[labels] = collections.deque(maxlen=ATTAINMENT_WINDOW)
        window.append(met)

    def on_transition(self, transition: Transition) -> None:
        self.breaker_transitions.inc((transition.engine, transition.event))

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every family."""
        return generate_latest(self.registry)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """Every family in the format ``accept`` (a scrape's ``Accept`` header) asks for:
        OpenMetrics, which carries the latency histograms' exemplars, or the classic
        text format; returns the body and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
