"""Running the router: state, background tasks, the HTTP server, graceful shutdown."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio

from narwhal.config import FleetConfig, parse_fleet, parse_fleet_json
from narwhal.errors import ConfigError
from narwhal.http.server import HTTPServer, ServerLimits
from narwhal.profile.store import Profiles
from narwhal.router.admin import AdminApp
from narwhal.router.app import RouterApp
from narwhal.router.controller import ReactiveController
from narwhal.router.discovery import Discovery
from narwhal.router.events import EventHub
from narwhal.router.fleet import FleetChange, LiveFleet
from narwhal.router.journal import Journal
from narwhal.router.keys import admin_listener_problem
from narwhal.router.loadpoll import poll_engine_load
from narwhal.router.metrics import RouterMetrics
from narwhal.router.prefixwatch import PrefixWatch
from narwhal.router.pricing import PricedPlacement
from narwhal.router.probe import probe_at_start, run_probes
from narwhal.router.replicate import PrefixReplicator
from narwhal.router.state import RouterState
from narwhal.router.store import SharedLimits
from narwhal.tracing import Tracing, open_tracing

__all__ = ["Prepare", "Router", "open_router"]

#: Turns a fleet document (parsed JSON, or None: re-read the file the router serves)
#: into the config and profiles to serve, running the same checks as at start;
#: raises :class:`~narwhal.errors.ConfigError`. Called in a worker thread.
Prepare = Callable[[Any], tuple[FleetConfig, Profiles | None]]

log = logging.getLogger("narwhal.router")


class Router:
    """A running router: ``server`` serves the OpenAI routes, ``admin`` metrics and events."""

    def __init__(
        self,
        state: RouterState,
        server: HTTPServer,
        admin: HTTPServer,
        metrics: RouterMetrics,
        events: EventHub,
        fleet: LiveFleet,
        prepare: Prepare | None = None,
        *,
        controller: ReactiveController | None,
    ) -> None:
        self.state = state
        self.server = server
        self.admin = admin
        self.metrics = metrics
        self.events = events
        self.fleet = fleet
        self.prepare = prepare
        self.controller = controller

    async def reload(self, document: Any = None, *, source: str) -> FleetChange:
        """Serve a new fleet document without a restart (see :mod:`narwhal.router.fleet`).

        Args:
            document: the document as parsed JSON, or its JSON text; None re-reads the
                file the router was started from.
            source: where the change comes from, for the records (``SIGHUP``, ``PUT /fleet``).

        Raises:
            ConfigError: the document is invalid or cannot be applied; nothing changed.
        """
        prepare = self.prepare
        try:
            if isinstance(document, bytes | bytearray | memoryview | str):
                # A body is a document: never None (re-read the file), never nested deeper than one.
                document = parse_fleet_json(document if isinstance(document, str) else bytes(document))
            if prepare is None:
                if document is None:
                    raise ConfigError("the router was not started from a fleet document file: nothing to re-read")
                config, profiles = parse_fleet(document), self.state.profiles
            else:
                config, profiles = await trio.to_thread.run_sync(prepare, document)
        except ConfigError as err:
            self.fleet.reject(err, source)
            raise
        return await self.fleet.apply(config, profiles=profiles, source=source)

    @property
    def journal(self) -> Journal:
        return self.state.journal

    async def serve_tcp(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        reuse_port: bool = False,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        cfg = self.state.config.server
        await self.server.serve_tcp(
            cfg.host if host is None else host,
            cfg.port if port is None else port,
            reuse_port=reuse_port,
            task_status=task_status,
        )

    async def serve_admin_tcp(
        self, host: str | None = None, port: int | None = None, *, task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve the admin surface (default: on ``server.admin_host:admin_port``).

        Raises:
            ConfigError: the address is not loopback and no admin key is set.
        """
        cfg = self.state.config.server
        host = cfg.admin_host if host is None else host
        problem = admin_listener_problem(cfg, host)
        if problem is not None:
            raise problem
        await self.admin.serve_tcp(host, cfg.admin_port if port is None else port, task_status=task_status)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting, drain in-flight requests up to the grace period."""
        grace = self.state.config.server.shutdown_grace_s if grace_s is None else grace_s
        await self.server.shutdown(grace)
        await self.admin.shutdown(0)


def server_limits(config: FleetConfig) -> ServerLimits:
    s = config.server
    return ServerLimits(
        max_header_bytes=s.max_header_bytes,
        max_body_bytes=s.max_body_bytes,
        header_timeout_s=s.header_timeout_s,
        body_timeout_s=s.body_timeout_s,
        keepalive_timeout_s=s.keepalive_timeout_s,
        send_timeout_s=s.send_timeout_s,
        max_connections=s.max_connections,
    )


@asynccontextmanager
async def open_router(
    config: FleetConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    journal: Journal | None = None,
    profiles: Profiles | None = None,
    metrics_on_api_port: bool = False,
    prepare: Prepare | None = None,
    tracing: Tracing | None = None,
) -> AsyncIterator[Router]:
    """Start a router's background tasks; on exit drain, flush the journal, close clients.

    Args:
        config: the fleet document.
        transport: an httpx transport for reaching the engines (tests pass the in-memory
            one of :mod:`narwhal.testing`); None for real sockets.
        journal: a journal to use instead of the one ``config.journal`` names.
        profiles: a profiles pair that passed Gate F: placement is priced by it for
            every engine whose profile binds to the generation running now.
        metrics_on_api_port: also answer ``GET /metrics`` on the OpenAI listener.
        prepare: how a reload turns a document into config and profiles (the command
            line's checks); None: a document sent to ``PUT /fleet`` is validated and
            served with the profiles the router has, and there is no file to re-read.
        tracing: the tracer to use (tests pass one over an in-memory exporter); None:
            the one ``config.tracing`` and the OpenTelemetry environment ask for, if any
            (made here, in the process that serves: each worker its own).

    Raises:
        ConfigError: tracing is asked for but cannot run (see :func:`narwhal.tracing.check_tracing`).
    """
    if tracing is None:
        tracing = open_tracing(config.tracing)
    state = RouterState(config, transport=transport, journal=journal, profiles=profiles)
    state.tracing = tracing
    if config.tenancy is not None and config.tenancy.store is not None:
        state.admission.use_store(SharedLimits(config.tenancy.store))
    limits = server_limits(config)
    app = RouterApp(state)
    server = HTTPServer(app, limits, server_name="narwhal")
    events = EventHub()
    metrics = RouterMetrics(state, events)
    if metrics_on_api_port:
        app.metrics = metrics.render
    state.journal.add_listener(events.on_record)
    state.breaker.add_listener(events.on_transition)
    admin_app = AdminApp(state, metrics, events)
    admin = HTTPServer(admin_app, limits, server_name="narwhal-admin")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(state.journal.run)
            await nursery.start(state.admission.run)
            await nursery.start(run_probes, state)
            await probe_at_start(state)
            if config.server.engine_load_poll_s > 0:
                await nursery.start(poll_engine_load, state, config.server.engine_load_poll_s)
            await state.refresh_models()
            prefix_watch = None
            if config.controller.prefix_cache == "auto":
                prefix_watch = PrefixWatch(state, publish=events.publish)
                await nursery.start(prefix_watch.run)
            await state.bind_profiles()
            if isinstance(state.placement, PricedPlacement):
                state.journal.add_listener(state.placement.on_record)
            if prefix_watch is not None and isinstance(state.placement, PricedPlacement):
                await nursery.start(PrefixReplicator(state, state.placement).run)
            state.cache_cal.publish = events.publish
            state.journal.add_listener(state.cache_cal.on_record)
            plan, placement = state.cache_plan, state.placement
            if plan is not None and isinstance(placement, PricedPlacement):

                def planned() -> list[str]:
                    return [n for n in placement.prefill_engines if n in placement.profiles and state.placeable(n)]

                await nursery.start(partial(plan.run, planned, lambda: placement.slo.ttft_s, publish=events.publish))
            controller = None
            if config.controller.reactive.enabled and isinstance(state.placement, PricedPlacement):
                controller = ReactiveController(
                    config, state.placement, publish=events.publish, clock=state.clock, journal_path=state.journal.path
                )
                state.journal.add_listener(controller.on_record)
                state.assign_roles = controller.assign
                await nursery.start(controller.run)
            fleet = LiveFleet(
                state, publish=events.publish, journal_path=state.journal.path,
                prefix_watch=prefix_watch, controller=controller,
            )  # fmt: skip
            await nursery.start(fleet.run)
            discovery = Discovery(fleet)
            await nursery.start(discovery.run)
            if config.engine_groups:  # their engines' first readiness probes
                await fleet.settle(config.engine.connect_timeout_s + 1.0)
            if not state.ready():
                log.warning("not ready: %s (GET /health answers 503 until it is)", state.unready_reason())
            admin_app.discovery = discovery
            router = Router(state, server, admin, metrics, events, fleet, prepare, controller=controller)
            admin_app.reload = router.reload
            try:
                yield router
            finally:
                with trio.CancelScope(shield=True):
                    await server.shutdown(config.server.shutdown_grace_s)
                    await admin.shutdown(0)
                    await state.journal.aclose()
                    await fleet.aclose()
                nursery.cancel_scope.cancel()
    finally:
        try:
            await state.aclose()
            if state.admission.store is not None:
                await state.admission.store.aclose()
        finally:
            if tracing is not None:
                await tracing.aclose()
