"""One admin surface for ``narwhal serve --workers N``: the workers' own, combined.

Each worker is a whole router with its own admin listener (on loopback); the
supervisor serves this app on ``server.admin_port`` so that an operator, a Prometheus
scrape and ``narwhal top`` see one router:

- ``/metrics``: every worker's exposition, samples with the same name and labels
  summed (counters, histogram buckets, sums and counts, in-flight and reservation
  gauges all add up); ``narwhal_breaker_state`` takes the worst worker's state (ejected,
  quarantined, on trial, ok: the gauge's codes are not in that order) and
  ``narwhal_ready`` the best worker's, and ``narwhal_workers_up`` counts the workers
  that answered. A worker that does not answer is left out (and not counted up). A
  scrape that asks for OpenMetrics gets it, the workers asked for it too, and each
  histogram bucket keeps the latest of the workers' exemplars (trace ids, with tracing on).
- ``/fleet``: engines merged by name (load summed, the worst breaker state, a worker's
  stale ``kv_events`` before a live one).
- ``/health``: ready when a worker is ready; each worker's own answer alongside.
- ``/events``: the workers' live events, interleaved on one WebSocket.
- ``PUT /fleet``: the document goes to every worker; 200 when each applied it (each
  worker's answer alongside), 400 with the first refusal's error when one refused it,
  502 when a worker did not answer; 403 here, sent to none, when
  ``server.admin_fleet_writes`` is false.

With admin keys (``server.admin_api_keys``) the supervisor asks for one as a worker does,
and presents the first to the workers (they read the same document and environment).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from http import HTTPMethod
from typing import Any

import httpx
import trio
import trio_websocket
from prometheus_client import generate_latest
from prometheus_client.core import Exemplar, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from narwhal.errors import BadRequest, MethodNotAllowed, NotFound
from narwhal.http.server import JSON_HEADERS, Request, ResponseWriter
from narwhal.router.admin import (
    CLOSE_TIMEOUT_S,
    admitted,
    open_events,
    refusal_log,
    refuse_fleet_writes,
)
from narwhal.router.keys import BearerKeys, bearer
from narwhal.router.metrics import BREAKER_CODES, EXPOSITION_HEADERS

__all__ = ["WorkersAdminApp", "combine_expositions", "combine_fleets"]

log = logging.getLogger("narwhal.router.fanin")

#: How long a worker's answer is waited for (a scrape, /fleet, /health).
SCRAPE_TIMEOUT_S = 5.0
#: How long a worker's ``PUT /fleet`` is waited for: a reload may read profiles and
#: resolve engine groups, more than a scrape's time.
RELOAD_TIMEOUT_S = 60.0
#: An engine's states, least to most severe: each worker's breaker judges the engine
#: on its own traffic, and the combined view shows the worst of their judgements.
_SEVERITY = {state: rank for rank, state in enumerate(
    ("ok", "trial", "starting", "draining", "quarantined", "ejected")
)}  # fmt: skip
#: The same order of the ``narwhal_breaker_state`` gauge's codes (not their numeric one).
_CODE_SEVERITY = {float(code): _SEVERITY[state] for state, code in BREAKER_CODES.items()}


def _worse_breaker(a: float, b: float) -> float:
    return max(a, b, key=_CODE_SEVERITY.__getitem__)


#: Gauges whose workers' values do not add up: how they combine instead.
_COMBINE: dict[str, Callable[[float, float], float]] = {"narwhal_breaker_state": _worse_breaker, "narwhal_ready": max, "narwhal_model_ready": max,
            "narwhal_engine_model": max,
            # 1 where any worker prices the engine approximately for stale events.
            "narwhal_kv_events_stale": max,
            # Each worker's others include the other workers: the largest view, not a sum.
            "narwhal_engine_others_requests": max}  # fmt: skip


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics


def _when(exemplar: Exemplar) -> float:
    """An exemplar's time (the parser gives a float or its own Timestamp), 0 when none."""
    ts: Any = exemplar.timestamp
    return float(ts) if isinstance(ts, int | float) else float(str(ts)) if ts is not None else 0.0


#: What an OpenMetrics scrape asks the workers for.
OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0"


def combine_expositions(texts: Sequence[str], *, openmetrics: bool = False) -> bytes:
    """Prometheus text expositions of several routers as one (see the module docstring);
    ``openmetrics``: the texts and the answer are OpenMetrics, exemplars kept."""
    families: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    exemplars: dict[tuple[str, str, tuple[tuple[str, str], ...]], Exemplar] = {}
    parse = parse_openmetrics if openmetrics else text_string_to_metric_families
    for text in texts:
        for family in parse(text):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            combine = _COMBINE.get(family.name)
            for sample in family.samples:
                key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                ex = sample.exemplar
                if ex is not None and (key not in exemplars or _when(ex) >= _when(exemplars[key])):
                    exemplars[key] = ex  # the latest of the workers'
                if key not in values:
                    values[key] = sample.value
                elif sample.name.endswith("_created"):
                    values[key] = min(values[key], sample.value)
                elif combine is not None:
                    values[key] = combine(values[key], sample.value)
                else:
                    values[key] += sample.value
    for key, value in values.items():
        family_name, sample_name, labels = key
        families[family_name].add_sample(sample_name, dict(labels), value, exemplar=exemplars.get(key))
    up = GaugeMetricFamily("narwhal_workers_up", "Router workers that answered this scrape.", value=len(texts))
    registry = CollectorRegistry()
    registry.register(_Fixed([*families.values(), up]))
    return generate_openmetrics(registry) if openmetrics else generate_latest(registry)  # type: ignore[no-untyped-call]


def combine_fleets(fleets: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The workers' ``/fleet`` views (one at least) as one: per engine, load summed, the
    worst breaker."""
    engines: dict[str, dict[str, Any]] = {}
    for fleet in fleets:
        for e in fleet["engines"]:
            seen = engines.get(e["name"])
            if seen is None:
                engines[e["name"]] = dict(e)
                continue
            # The workers run this supervisor's code: each engine carries every field.
            for key in ("in_flight", "reserved_prefill_tokens", "reserved_decode_requests"):
                seen[key] += e[key]
            seen["streak"] = max(seen["streak"], e["streak"])
            seen["breaker"] = max(seen["breaker"], e["breaker"], key=_SEVERITY.__getitem__)
            if (e.get("kv_events") or {}).get("state") == "stale" != (seen.get("kv_events") or {}).get("state"):
                seen["kv_events"] = e["kv_events"]  # a worker whose KV events are stale says so
    return {
        "engines": list(engines.values()),
        "slo": fleets[0]["slo"],
        "in_flight": sum(f["in_flight"] for f in fleets),
        "workers": len(fleets),
    }


class WorkersAdminApp:
    """The supervisor's admin handler: the workers' admin surfaces at ``urls``, combined."""

    def __init__(
        self, urls: Sequence[str], *, timeout_s: float = SCRAPE_TIMEOUT_S, keys: Sequence[str] = (),
        fleet_writes: bool = True,
    ) -> None:  # fmt: skip
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.keys = BearerKeys(keys)
        self.refusals = refusal_log()
        #: The admin key presented to the workers.
        self.key = keys[0] if keys else None
        self.fleet_writes = fleet_writes

    async def _gather(
        self, path: str, *, method: str = HTTPMethod.GET, content: bytes | None = None, timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[httpx.Response | None]:
        answers: list[httpx.Response | None] = [None] * len(self.urls)

        async def one(i: int, client: httpx.AsyncClient) -> None:
            try:
                answers[i] = await client.request(method, f"{self.urls[i]}{path}", content=content, headers=headers)
            except httpx.HTTPError as exc:
                log.warning("worker admin %s%s did not answer: %s", self.urls[i], path, exc)

        timeout = self.timeout_s if timeout_s is None else timeout_s
        async with httpx.AsyncClient(
            timeout=timeout,
            headers=bearer(self.key),
            trust_env=False,  # pragma: no mutate (equivalent: httpx reads it as a truth value, None as False; True is killed by the proxy test)
        ) as client:
            async with trio.open_nursery() as nursery:
                for i in range(len(self.urls)):
                    nursery.start_soon(one, i, client)
        return answers

    async def __call__(self, request: Request, response: ResponseWriter) -> None:
        if not await admitted(self.keys, request, response, self.refusals):
            return
        if request.method == "PUT" and request.path == "/fleet":
            if not self.fleet_writes:
                raise refuse_fleet_writes()
            await self._put_fleet(request, response)
            return
        if request.method != "GET":
            raise MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
        if request.path == "/metrics":
            _, content_type = choose_encoder(request.header("accept") or "")
            om = content_type.startswith("application/openmetrics-text")
            asked = {"accept": OPENMETRICS_ACCEPT} if om else None
            answers = await self._gather("/metrics", headers=asked)
            texts = [a.text for a in answers if a is not None and a.status_code == 200]
            headers = (("content-type", content_type),) if om else EXPOSITION_HEADERS
            await response.respond(200, headers, combine_expositions(texts, openmetrics=om))
        elif request.path == "/fleet":
            fleets = [a.json() for a in await self._gather("/fleet") if a is not None and a.status_code == 200]
            if not fleets:
                await response.respond(503, JSON_HEADERS, json.dumps({"error": "no worker answered"}).encode())
                return
            await response.respond(200, JSON_HEADERS, json.dumps(combine_fleets(fleets)).encode())
        elif request.path == "/health":
            health = await self._gather("/health")
            workers = [a.json() if a is not None else {"status": "unreachable"} for a in health]
            ready = any(w.get("status") == "ready" for w in workers)
            body = {"status": "ready" if ready else "unavailable", "workers": workers}
            await response.respond(200 if ready else 503, JSON_HEADERS, json.dumps(body).encode())
        elif request.path == "/events":
            await self._events(request, response)
        else:
            raise NotFound(f"no route for GET {request.path}")

    async def _put_fleet(self, request: Request, response: ResponseWriter) -> None:
        answers = await self._gather(
            "/fleet", method=HTTPMethod.PUT, content=bytes(request.body), timeout_s=RELOAD_TIMEOUT_S
        )
        workers: list[dict[str, Any]] = []
        for answer in answers:
            try:
                workers.append(answer.json() if answer is not None else {"status": "unreachable"})
            except ValueError:
                workers.append({"status": "unreachable"})
        refused = [w for w in workers if w.get("status") == "rejected"]
        if refused:
            status, body = 400, {"status": "rejected", "error": refused[0].get("error"), "workers": workers}
        elif all(w.get("status") == "applied" for w in workers):
            status, body = 200, {"status": "applied", "workers": workers}
        else:
            status, body = 502, {"status": "partial", "workers": workers}
        await response.respond(status, JSON_HEADERS, json.dumps(body).encode())

    async def _events(self, request: Request, response: ResponseWriter) -> None:
        upgrade = request.header("upgrade") or ""  # pragma: no mutate (equivalent: header names match in any case; no header and any other text are refused alike; the statement's other mutants were killed in a run without this mark)
        if upgrade.lower() != "websocket":
            raise BadRequest("/events is a WebSocket endpoint (send Upgrade: websocket)")
        stream = await response.upgrade()
        async with trio.open_nursery() as nursery:
            ws_request = await trio_websocket.wrap_server_stream(nursery, stream)
            ws = await ws_request.accept()
            send_lock = trio.Lock()

            async def relay(url: str) -> None:
                try:
                    async with open_events(url, self.key) as worker:
                        while True:
                            message = await worker.get_message()
                            async with send_lock:
                                await ws.send_message(message)
                except (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed) as exc:
                    log.info("event relay from %s ended: %r", url, exc)
                nursery.cancel_scope.cancel()  # a worker gone: the client reconnects

            async def until_closed() -> None:
                try:
                    while True:
                        await ws.get_message()
                except trio_websocket.ConnectionClosed:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(until_closed)
            for url in self.urls:
                nursery.start_soon(relay, url)
            try:
                await trio.sleep_forever()
            finally:
                with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                    await ws.aclose()
