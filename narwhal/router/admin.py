"""The admin surface: ``/metrics`` (Prometheus), ``/events`` (WebSocket), ``/fleet``, ``/health``.

It is served by its own listener, bound to ``server.admin_host`` (loopback by
default) so that metrics and live events are not exposed where clients connect.
``PUT /fleet`` with a fleet document as its body reloads the fleet without a restart
(:mod:`narwhal.router.fleet`): 200 with what changed, or 400 with why nothing did
(the message and the JSON path of the offending value); 403 when
``server.admin_fleet_writes`` is false.

With ``server.admin_api_keys`` set, every request on every route (a Prometheus scrape,
the ``/events`` WebSocket handshake, ``/health`` too) presents one as
``Authorization: Bearer <key>``, or is answered 401 before anything else is read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Final

import trio
import trio_websocket

from narwhal.errors import (
    BadRequest,
    ConfigError,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    Unauthorized,
)
from narwhal.http.server import JSON_HEADERS, Request, ResponseWriter
from narwhal.logs import SparseLog
from narwhal.router.discovery import Discovery
from narwhal.router.events import EventHub
from narwhal.router.fleet import FleetChange
from narwhal.router.keys import BearerKeys, bearer, browser_problem
from narwhal.router.metrics import RouterMetrics
from narwhal.router.pricing import PricedPlacement
from narwhal.router.state import RouterState

__all__ = ["CLOSE_TIMEOUT_S", "REFUSAL_LOG_INTERVAL_S", "AdminApp", "admitted", "open_events", "refusal_log", "refuse_fleet_writes"]

log = logging.getLogger("narwhal.router.admin")

#: How long the closing handshake with an ``/events`` client is waited for.
CLOSE_TIMEOUT_S = 1.0

_UNAUTHORIZED = Unauthorized("missing or invalid admin key", code="invalid_admin_key")
_CHALLENGE = (*JSON_HEADERS, ("www-authenticate", 'Bearer realm="narwhal-admin"'))


#: Seconds between two warnings of refused admin requests of one route and cause: a
#: client that retries a wrong key in a loop does not flood the log.
REFUSAL_LOG_INTERVAL_S: Final = 60.0


#: The admin routes (a refusal of any other path is logged as one route: the paths a
#: client makes up are not kept).
_ROUTES: Final = frozenset({"/metrics", "/events", "/fleet", "/health"})


def _route(request: Request) -> str:
    return f"{request.method} {request.path}" if request.path in _ROUTES else "other"


def refusal_log() -> SparseLog:
    """An admin listener's log of refused requests (:func:`admitted`)."""
    return SparseLog(log, REFUSAL_LOG_INTERVAL_S, trio.current_time)


async def admitted(keys: BearerKeys, request: Request, response: ResponseWriter, refusals: SparseLog) -> bool:
    """Whether ``request`` presents an admin key (or, without keys, comes from no web
    page: :func:`~narwhal.router.keys.browser_problem`); else answers 401 (403), and
    logs the refusal (the first of a route and cause at once, then one a minute with how
    many more)."""
    if not keys:
        problem = browser_problem(request.header("host"), request.header("origin"))
        if problem is None:
            return True
        refusals.warning((_route(request), "browser"), "admin %s %s refused: %s",
                          request.method, request.path, problem)  # fmt: skip
        refused = Forbidden(f"admin request refused: {problem}", code="admin_browser_request")
        await response.respond(403, JSON_HEADERS, json.dumps(refused.to_body()).encode())
        return False
    if keys.accepts(request.header("authorization")):
        return True
    refusals.warning((_route(request), "key"), "admin %s %s refused: missing or invalid admin key",
                      request.method, request.path)  # fmt: skip
    await response.respond(401, _CHALLENGE, json.dumps(_UNAUTHORIZED.to_body()).encode())
    return False


def refuse_fleet_writes() -> Forbidden:
    """The answer to ``PUT /fleet`` when ``server.admin_fleet_writes`` is false."""
    log.warning("PUT /fleet refused: server.admin_fleet_writes is false")
    return Forbidden(
        "PUT /fleet is turned off on this router (server.admin_fleet_writes is false): "
        "change the fleet document and send SIGHUP",
        code="fleet_writes_disabled",
    )


class AdminApp:
    def __init__(self, state: RouterState, metrics: RouterMetrics, events: EventHub) -> None:
        self.state = state
        self.metrics = metrics
        self.events = events
        #: Applies a fleet document (``PUT /fleet``); set by the router.
        self.reload: Callable[..., Awaitable[FleetChange]] | None = None
        #: The engine groups' DNS resolution, for ``/fleet``; set by the router.
        self.discovery: Discovery | None = None
        self.keys = BearerKeys(state.config.server.admin_api_keys)
        self.refusals = refusal_log()
        self.fleet_writes = state.config.server.admin_fleet_writes

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
            body, content_type = self.metrics.render(request.header("accept"))
            await response.respond(200, (("content-type", content_type),), body)
        elif request.path == "/events":
            await self._events(request, response)
        elif request.path == "/fleet":
            await response.respond(200, JSON_HEADERS, json.dumps(self.fleet()).encode())
        elif request.path == "/health":
            health = self.state.health(detail=True)
            body = json.dumps(health).encode()
            await response.respond(200 if health["status"] == "ready" else 503, JSON_HEADERS, body)
        else:
            raise NotFound(f"no route for GET {request.path}")

    async def _put_fleet(self, request: Request, response: ResponseWriter) -> None:
        if self.reload is None:
            raise NotFound("this router cannot reload its fleet")
        status, body = 200, {}
        try:
            change = await self.reload(request.body, source="PUT /fleet")
            body = {"status": "applied", **change.as_dict()}
            log.info("fleet reloaded (PUT /fleet): %s", change.describe())
        except ConfigError as err:
            log.error("fleet reload (PUT /fleet) refused, nothing changed: %s", err)
            status = 400
            body = {"status": "rejected", "error": {"message": err.reason, "path": err.path, "type": "invalid_fleet"}}
        await response.respond(status, JSON_HEADERS, json.dumps(body).encode())

    def fleet(self) -> dict[str, object]:
        """The fleet as the router sees it now (for ``narwhal top`` and operators)."""
        state = self.state
        engines = []
        for e in state.engines.values():
            st = state.breaker.states[e.name]
            load = state.placement.loads[e.name]
            engines.append(
                {
                    "name": e.name,
                    "url": e.url,
                    "roles": list(e.roles),
                    "models": sorted(state.placement.models.get(e.name, ())),
                    "breaker": state.engine_state(e.name),
                    "streak": st.streak,
                    "in_flight": state.in_flight_by_engine[e.name],
                    "reserved_prefill_tokens": load.prefill_tokens,
                    "reserved_decode_requests": load.decode_requests,
                }
            )
            kv = state.kv_events_status(e.name)
            if kv is not None:
                engines[-1]["kv_events"] = kv
            cache = state.prefix_cache_status(e.name)
            if cache is not None:
                engines[-1]["prefix_cache"] = cache
            placement = state.placement
            if isinstance(placement, PricedPlacement) and e.name in placement.prefill_engines and e.name in placement.profiles:
                engines[-1]["prefill_queue"] = "batched" if e.name in placement.queue_models.batched else "serial"
        slo = state.config.controller.slo
        body: dict[str, object] = {
            "engines": engines, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "in_flight": state.in_flight,
        }  # fmt: skip
        if state.admission.enabled:  # classes, tenants (never their keys) and the queue
            body["tenancy"] = state.admission.view()
        if state.config.engine_groups and self.discovery is not None:
            found = self.discovery
            body["engine_groups"] = {
                g.name: {"host": g.host, "addresses": list(found.addresses.get(g.name, ())), "error": found.errors.get(g.name)}
                for g in state.config.engine_groups
            }
        return body

    async def _events(self, request: Request, response: ResponseWriter) -> None:
        upgrade = request.header("upgrade") or ""  # pragma: no mutate (equivalent: header names match in any case; no header and any other text are refused alike; the statement's other mutants were killed in a run without this mark)
        if upgrade.lower() != "websocket":
            raise BadRequest("/events is a WebSocket endpoint (send Upgrade: websocket)")
        stream = await response.upgrade()
        with self.events.subscribe() as sub:
            async with trio.open_nursery() as nursery:
                ws_request = await trio_websocket.wrap_server_stream(nursery, stream)
                ws = await ws_request.accept()
                nursery.start_soon(_until_closed, ws, nursery.cancel_scope)
                try:
                    async for event in sub.receive:
                        await ws.send_message(json.dumps(event, separators=(",", ":")))
                except trio_websocket.ConnectionClosed:
                    pass
                finally:
                    nursery.cancel_scope.cancel()
                    with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                        await ws.aclose()


async def _until_closed(ws: trio_websocket.WebSocketConnection, scope: trio.CancelScope) -> None:
    """Read (and ignore) client messages; the client closing ends the subscription."""
    try:
        while True:
            await ws.get_message()
    except trio_websocket.ConnectionClosed:
        scope.cancel()


@asynccontextmanager
async def open_events(admin_url: str, key: str | None = None) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A client of the ``/events`` stream of the admin surface at ``admin_url`` (``http://host:port``),
    presenting the admin ``key`` when one is given.

    trio-websocket (0.12) leaves a client's socket open when the server closed the
    connection first (a router or worker gone): it would wait for the collector. Its
    stream is not public: a version without it leaves the socket to the collector again
    rather than failing the client.
    """
    tcp: trio.abc.AsyncResource | None = None
    try:
        url = "ws" + admin_url.removeprefix("http") + "/events"
        async with trio_websocket.open_websocket_url(url, extra_headers=[(n.encode(), v.encode()) for n, v in bearer(key).items()]) as ws:
            tcp = getattr(ws, "_stream", None)  # pragma: no mutate (equivalent with trio-websocket 0.12, which has it; the default is for a version without it)
            yield ws
    finally:
        if tcp is not None:
            await tcp.aclose()
