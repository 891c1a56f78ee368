"""``narwhal serve`` and ``narwhal sim`` as processes: start-up, signals, shutdown.

- Start-up: the fleet's simulated engines start in this process, except those whose
  port already serves that engine (a ``narwhal sim`` of the same document running: the
  same name, ``sim`` and ``connector`` at ``GET /narwhal/sim``): the router attaches to
  those, so that profiles taken against them stay bound; a port held by anything else
  is an error saying what answers there. Then
  the router (which probes every engine and names the unreachable ones) and its two
  listeners. A port that cannot be bound is a :class:`~narwhal.cmdline.CommandError`
  naming it and the flag that sets it.
- Signals: the first SIGINT/SIGTERM stops accepting and drains in-flight requests for
  ``server.shutdown_grace_s``; a second one ends the drain at once (requests still in
  flight end as ``shutdown``, and the journal is still flushed). A signal during
  start-up abandons it. SIGHUP re-reads the fleet document and applies it without a
  restart (:mod:`narwhal.router.fleet`); a document that fails changes nothing and the
  log says why. ``--workers``' supervisor forwards SIGHUP to every worker.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import trio

from narwhal import __version__
from narwhal.cmdline import INTERRUPTED, CommandError, leaves
from narwhal.config import EngineConfig, FleetConfig
from narwhal.http.server import ListenError
from narwhal.profile.store import Profiles

if TYPE_CHECKING:
    from narwhal.router.service import Prepare, Router

__all__ = ["Stop", "run_serve", "run_sim", "run_workers"]

log = logging.getLogger("narwhal")


@attrs.define
class Stop:
    """SIGINT/SIGTERM: the first stops gracefully, the second at once.

    ``startup`` and ``drain`` are cancel scopes the process runs its start-up and its
    drain in; a signal cancels whichever is under way.
    """

    first: trio.Event = attrs.field(factory=trio.Event)
    startup: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    drain: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    started: bool = False
    count: int = 0

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                self.count += 1
                name = signal.Signals(signum).name
                if self.count == 1:
                    if not self.started:
                        log.info("received %s during start-up: stopping", name)
                        self.startup.cancel()
                    else:
                        log.info("received %s: shutting down (again to stop at once)", name)
                    self.first.set()
                else:
                    log.warning("received %s again: stopping at once", name)
                    self.drain.cancel()


async def _with_stop(body: Callable[[Stop], Awaitable[None]]) -> None:
    stop = Stop()
    async with trio.open_nursery() as nursery:
        await nursery.start(stop.watch)
        try:
            with stop.startup:
                await body(stop)
        finally:
            nursery.cancel_scope.cancel()


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


async def _not_serving(engine: EngineConfig, timeout_s: float) -> str | None:
    """Why what answers at ``engine``'s URL is not that simulated engine (``GET /narwhal/sim``:
    its name, ``sim`` block and ``connector`` as the fleet document says); None when it is."""
    import httpx

    from narwhal.testing.app import SIM_IDENTITY_PATH, sim_identity

    try:
        with trio.fail_after(timeout_s):
            async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
                resp = await client.get(engine.url + SIM_IDENTITY_PATH)
        found = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, trio.TooSlowError, ValueError):
        found = None
    if not isinstance(found, dict):
        return f"something that is not a simulated engine answers there (GET {SIM_IDENTITY_PATH})"
    if found.get("name") != engine.name:
        return f"it is simulated engine {found.get('name')!r}, not {engine.name} (a narwhal sim of another fleet document?)"
    wanted = sim_identity(engine)
    differ = [key for key in ("sim", "connector") if found.get(key) != wanted[key]]
    if differ:
        return (f"it is {engine.name} with another {' and '.join(differ)} block than this fleet document's "
                "(a narwhal sim of an older version of the document?)")  # fmt: skip
    return None


async def _split_sims(sims: list[EngineConfig], timeout_s: float) -> list[EngineConfig]:
    """The simulated engines to start here; those already serving on their port are attached to."""
    start, attached = [], []
    for e in sims:
        if _port_free(e.host, e.port):
            start.append(e)
        elif (problem := await _not_serving(e, timeout_s)) is None:
            attached.append(e)
        else:
            raise CommandError(
                f"simulated engine {e.name}: cannot listen on {e.host}:{e.port}: address already in use, and "
                f"{problem}: stop it, or give {e.name} another url in the fleet document"
            )
    if attached:
        log.info(
            "attached to the simulated engines already running: %s", ", ".join(f"{e.name}@{e.url}" for e in attached)
        )
    return start


async def _listen(
    nursery: trio.Nursery, serve: Callable[..., Awaitable[None]], host: str | None, port: int | None, what: str, **kw: bool
) -> list[tuple[str, int]]:
    try:
        bound: list[tuple[str, int]] = await nursery.start(functools.partial(serve, host, port, **kw))
    except ListenError as exc:
        hint = " (another process holds it)" if exc.errno == errno.EADDRINUSE else ""
        raise CommandError(f"{what}: {exc}{hint}") from exc
    return bound


async def _open_sims(stack: contextlib.AsyncExitStack, sims: list[EngineConfig]) -> None:
    from narwhal.testing import open_sim_fleet

    try:
        await stack.enter_async_context(open_sim_fleet(sims, sockets=True))
    except BaseException as exc:
        failed = [e for e in leaves(exc) if isinstance(e, ListenError)]
        if not failed:
            raise
        by_port = {(e.host, e.port): e.name for e in sims}
        name = by_port.get((failed[0].host, failed[0].port), "?")
        raise CommandError(f"simulated engine {name}: {failed[0]}") from exc
    log.info("started %d simulated engines: %s", len(sims), ", ".join(f"{e.name}@{e.url}" for e in sims))


async def run_serve(
    config: FleetConfig,
    host: str | None,
    port: int | None,
    admin_port: int | None,
    *,
    reuse_port: bool = False,
    start_sims: bool = True,
    profiles: Profiles | None = None,
    metrics_on_api_port: bool = False,
    prepare: Prepare | None = None,
    worker: int | None = None,
) -> None:
    """``narwhal serve`` (one process, or worker ``worker`` of ``--workers``) until signalled.

    ``prepare`` turns the fleet document (re-read on SIGHUP, or sent to ``PUT /fleet``)
    into what to serve; see :data:`narwhal.router.service.Prepare`."""
    router_port, admin_where = "router port (--port, server.port)", "admin port (--admin-port, server.admin_port)"
    if worker is not None:  # its error names the worker, and the port it was given
        router_port = f"worker {worker}: {router_port}, shared by the workers"
        admin_where = f"worker {worker}: its own admin port" + (
            f" {admin_port} (server.admin_port + {worker + 1}: the workers' admin ports follow the combined one)"
            if admin_port else ""
        )

    async def body(stop: Stop) -> None:
        from narwhal.router.service import open_router

        sims = [e for e in config.engines if e.sim is not None] if start_sims else []
        async with contextlib.AsyncExitStack() as stack:
            if sims:
                sims = await _split_sims(sims, config.engine.connect_timeout_s)
            if sims:
                await _open_sims(stack, sims)
            router = await stack.enter_async_context(
                open_router(config, profiles=profiles, metrics_on_api_port=metrics_on_api_port, prepare=prepare)
            )
            nursery = await stack.enter_async_context(trio.open_nursery())
            bound = await _listen(nursery, router.serve_tcp, host, port, router_port, reuse_port=reuse_port)
            for h, p in bound:
                log.info("narwhal %s serving on http://%s:%d", __version__, h, p)
            admin = await _listen(nursery, router.serve_admin_tcp, None, admin_port, admin_where)
            log.info("admin endpoints (/metrics, /events, /fleet, /health) on http://%s:%d", admin[0][0], admin[0][1])
            journal = router.journal.path
            log.info("journal: %s", journal.resolve() if journal is not None else "off (journal.path is null)")
            stop.started = True
            unready = router.state.unready_reason()
            status = f" but NOT READY: {unready} (GET /health names the engines)" if unready else ""
            print(f"narwhal serving on http://{bound[0][0]}:{bound[0][1]}{status}", flush=True)
            # Everything built so far (modules, config, profiles, pools) lives as long as
            # the process: keep it out of the collector's full passes, which otherwise walk
            # it all and pause every request in flight (tens of ms each).
            gc.freeze()
            async with trio.open_nursery() as reloads:
                await reloads.start(_reload_on_sighup, router)
                await stop.first.wait()
                reloads.cancel_scope.cancel()
            with stop.drain:
                await router.shutdown()
            if stop.drain.cancelled_caught:
                abandoned = router.state.in_flight
                await router.shutdown(0)
                raise CommandError(
                    f"stopped at once on a second signal: {abandoned} request(s) in flight ended as shutdown",
                    status=INTERRUPTED,
                )

    await _with_stop(body)


async def _reload_on_sighup(router: Router, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Re-read and apply the fleet document on every SIGHUP, until cancelled."""
    from narwhal.errors import ConfigError

    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            log.info("received SIGHUP: reloading the fleet document")
            try:
                change = await router.reload(source="SIGHUP")
            except ConfigError as err:
                log.error("fleet reload (SIGHUP) refused, nothing changed: %s", err)
            else:
                log.info("fleet reloaded (SIGHUP): %s", change.describe())


def worker_admin_ports(admin_port: int, workers: int) -> list[int]:
    """The admin ports of ``--workers``' workers: the ``workers`` ports after
    ``admin_port`` (which serves them combined); 0 each when ``admin_port`` is 0."""
    return [admin_port + 1 + i if admin_port else 0 for i in range(workers)]


async def run_workers(
    config: FleetConfig, workers: int, worker_argv: Callable[[int], list[str]], admin_port: int
) -> None:
    """``--workers N``: N router processes on one port (SO_REUSEPORT); this process runs
    the simulated engines (if any), supervises the workers, forwards the signals and
    serves their admin surfaces combined on ``admin_port``.

    Raises:
        CommandError: a worker exited on its own (it could not start, or it failed): the
            others were stopped; the worker's own error line names the cause.
    """
    from narwhal.http.server import HTTPServer
    from narwhal.router.fanin import WorkersAdminApp

    async def body(stop: Stop) -> None:
        sims = [e for e in config.engines if e.sim is not None]
        async with contextlib.AsyncExitStack() as stack:
            if sims:
                sims = await _split_sims(sims, config.engine.connect_timeout_s)
            if sims:
                await _open_sims(stack, sims)
            nursery = await stack.enter_async_context(trio.open_nursery())
            admin_server: HTTPServer | None = None
            if admin_port:
                host = config.server.admin_host
                urls = [f"http://{_url_host(host)}:{p}" for p in worker_admin_ports(admin_port, workers)]
                server = config.server
                app = WorkersAdminApp(urls, keys=server.admin_api_keys, fleet_writes=server.admin_fleet_writes)
                admin_server = HTTPServer(app, server_name="narwhal-admin")
                where = "admin port (--admin-port, server.admin_port)"
                await _listen(nursery, admin_server.serve_tcp, host, admin_port, where)
                log.info("admin endpoints of the %d workers, combined, on http://%s:%d", workers, host, admin_port)
            else:
                log.warning("admin_port 0 with --workers: each worker has its own admin port, none combined")
            procs = []
            failed: list[str] = []
            try:
                for i in range(workers):
                    # Their own process group: a Ctrl-C at the terminal reaches this
                    # process only, which forwards it (a second one then stops them at
                    # once). This session, though: a session is a scheduler autogroup,
                    # and N sessions would take N shares of the CPU from whatever else
                    # runs on the machine (engines, a load generator) where one router
                    # process takes one.
                    cmd = [sys.executable, "-m", "narwhal", *worker_argv(i)]
                    procs.append(await trio.lowlevel.open_process(cmd, process_group=0))
                stop.started = True
                print(f"narwhal: {workers} workers started", flush=True)
                async with trio.open_nursery() as watch:
                    await watch.start(_forward_sighup, procs)
                    for i, proc in enumerate(procs):
                        watch.start_soon(_exited, proc, i, stop, failed)
                    await stop.first.wait()
                    watch.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await _stop_workers(procs, stop, config.server.shutdown_grace_s + 10)
                    if admin_server is not None:
                        await admin_server.shutdown(0)
            if failed:
                raise CommandError(f"{failed[0]} (its error is above): stopped the other workers")

    await _with_stop(body)


def _url_host(host: str) -> str:
    """A listen address as a URL host: the wildcard as loopback, IPv6 in brackets."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


async def _forward_sighup(
    procs: list[trio.Process], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Each worker reloads its fleet document on the supervisor's SIGHUP."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            log.info("received SIGHUP: forwarded to the %d workers", len(procs))
            for proc in procs:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGHUP)


async def _exited(proc: trio.Process, index: int, stop: Stop, failed: list[str]) -> None:
    """A worker that exits on its own (it could not start) stops the others; what
    happened goes into ``failed``."""
    await proc.wait()
    if not stop.first.is_set():
        what = f"worker {index} (pid {proc.pid}) exited with status {proc.returncode}"
        log.error("%s: stopping the others", what)
        failed.append(what)
        stop.first.set()


async def _stop_workers(procs: list[trio.Process], stop: Stop, grace_s: float) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace_s):
        with stop.drain:
            for proc in procs:
                await proc.wait()
    if stop.drain.cancelled_caught:  # a second signal: the workers stop at once too
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(5):
            for proc in procs:
                await proc.wait()
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def run_sim(config: FleetConfig) -> None:
    """``narwhal sim``: only the simulated engines, until signalled."""
    from narwhal.errors import ConfigError

    sims = [e for e in config.engines if e.sim is not None]
    if not sims:
        raise ConfigError("no engine of this fleet document has a 'sim' block", path="$.engines")

    async def body(stop: Stop) -> None:
        async with contextlib.AsyncExitStack() as stack:
            await _open_sims(stack, sims)
            stop.started = True
            for e in sims:
                print(f"simulated engine {e.name} on {e.url}", flush=True)
            await stop.first.wait()

    await _with_stop(body)
