"""Command line: ``narwhal serve|sim`` (and the ``narwhal-profile`` / ``narwhal-check`` names).

``narwhal serve`` with no ``--fleet`` serves the embedded default fleet document
(``config/fleet.sim.json``): its simulated engines start in the same process, so a
newcomer's first command gives a working router.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.resources
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import trio

from narwhal import __version__
from narwhal.config import FleetConfig, load_fleet
from narwhal.errors import ConfigError
from narwhal.logs import configure_logging

if TYPE_CHECKING:
    from narwhal.profile.store import Profiles

__all__ = ["check_main", "main", "profile_main"]

log = logging.getLogger("narwhal")


def default_fleet_path() -> Path:
    """The embedded default fleet document (simulated engines)."""
    return Path(str(importlib.resources.files("narwhal").joinpath("data/fleet.sim.json")))


def _load(path: str | None) -> FleetConfig:
    return load_fleet(path if path is not None else default_fleet_path())


async def _until_signalled() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            return


async def _serve(
    config: FleetConfig,
    host: str | None,
    port: int | None,
    admin_port: int | None,
    *,
    reuse_port: bool = False,
    start_sims: bool = True,
    profiles: Profiles | None = None,
) -> None:
    from narwhal.router.service import open_router

    sims = [e for e in config.engines if e.sim is not None] if start_sims else []
    async with contextlib.AsyncExitStack() as stack:
        if sims:
            from narwhal.testing import open_sim_fleet

            await stack.enter_async_context(open_sim_fleet(sims, sockets=True))
            log.info("started %d simulated engines: %s", len(sims), ", ".join(f"{e.name}@{e.url}" for e in sims))
        router = await stack.enter_async_context(open_router(config, profiles=profiles))
        nursery = await stack.enter_async_context(trio.open_nursery())
        bound = await nursery.start(functools.partial(router.serve_tcp, host, port, reuse_port=reuse_port))
        for h, p in bound:
            log.info("narwhal %s serving on http://%s:%d", __version__, h, p)
        admin = await nursery.start(router.serve_admin_tcp, None, admin_port)
        log.info("admin endpoints (/metrics, /events) on http://%s:%d", admin[0][0], admin[0][1])
        print(f"narwhal serving on http://{bound[0][0]}:{bound[0][1]}", flush=True)
        # Everything built so far (modules, config, profiles, pools) lives as long as
        # the process: keep it out of the collector's full passes, which otherwise walk
        # it all and pause every request in flight (tens of ms each).
        gc.freeze()
        await _until_signalled()
        await router.shutdown()


def _serving_profiles(config: FleetConfig) -> Profiles | None:
    """The profiles pair placement is priced by (None: least-loaded placement)."""
    if not config.profiles.path:
        return None
    from narwhal.profile.store import load_profiles

    profiles = load_profiles(config.profiles.path)
    log.info("placement priced by %s (%d engine profiles)", config.profiles.path, len(profiles.engines))
    return profiles


def _preflight(config: FleetConfig) -> Profiles | None:
    """What must hold before serving starts (errors are ConfigErrors naming the path);
    returns the profiles placement is priced by."""
    if config.controller.reactive.enabled:
        _require_record(config)
    return _serving_profiles(config)


def _require_record(config: FleetConfig) -> None:
    """Reactive control runs only on a fleet with a passing preflight on record."""
    from narwhal.check.record import load_record, record_matches

    path = config.controller.reactive.deployment_record
    where = "$.controller.reactive.deployment_record"
    if not path:
        raise ConfigError(
            "reactive control needs the deployment record of a passing preflight "
            "(narwhal check --fleet F --record DIR)",
            path=where,
        )
    if not record_matches(load_record(path), config):
        raise ConfigError(
            f"the deployment record in {path} was made for another fleet document or profiles pair; "
            "run narwhal check --record again",
            path=where,
        )


async def _serve_workers(args: argparse.Namespace, config: FleetConfig) -> None:
    """``--workers N``: N router processes on one port (SO_REUSEPORT); this process runs
    the simulated engines (if any), supervises the workers and forwards shutdown."""
    sims = [e for e in config.engines if e.sim is not None]
    async with contextlib.AsyncExitStack() as stack:
        if sims:
            from narwhal.testing import open_sim_fleet

            await stack.enter_async_context(open_sim_fleet(sims, sockets=True))
        admin_base = config.server.admin_port if args.admin_port is None else args.admin_port
        procs = []
        for i in range(args.workers):
            cmd = [sys.executable, "-m", "narwhal", "--log-level", args.log_level]
            if args.log_json:
                cmd.append("--log-json")
            cmd += ["serve", "--worker-of", str(args.workers), "--admin-port", str(admin_base + i if admin_base else 0)]
            if args.fleet:
                cmd += ["--fleet", args.fleet]
            if args.host:
                cmd += ["--host", args.host]
            if args.port is not None:
                cmd += ["--port", str(args.port)]
            procs.append(await trio.lowlevel.open_process(cmd))
        print(f"narwhal: {args.workers} workers started", flush=True)
        try:
            await _until_signalled()
        finally:
            with trio.CancelScope(shield=True):
                for proc in procs:
                    proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(config.server.shutdown_grace_s + 10):
                    for proc in procs:
                        await proc.wait()
                for proc in procs:
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()


async def _sim(config: FleetConfig) -> None:
    from narwhal.testing import open_sim_fleet

    sims = [e for e in config.engines if e.sim is not None]
    if not sims:
        raise ConfigError("no engine of this fleet document has a 'sim' block", path="$.engines")
    async with open_sim_fleet(sims, sockets=True):
        for e in sims:
            print(f"simulated engine {e.name} on {e.url}", flush=True)
        await _until_signalled()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="narwhal", description="A router for disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"narwhal {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of plain text")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the router")
    serve.add_argument("--fleet", help="fleet document (default: the embedded simulated fleet)")
    serve.add_argument("--host", help="listen address (default: server.host)")
    serve.add_argument("--port", type=int, help="listen port (default: server.port)")
    serve.add_argument("--admin-port", type=int, help="admin (metrics, events) port (default: server.admin_port)")
    serve.add_argument("--workers", type=int, default=1, help="router processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--worker-of", type=int, default=0, help=argparse.SUPPRESS)
    sim = sub.add_parser("sim", help="run the simulated engines a fleet document declares")
    sim.add_argument("--fleet", help="fleet document (default: the embedded simulated fleet)")
    top = sub.add_parser("top", help="a terminal view of a running router (its admin surface)")
    top.add_argument("--admin", default="http://127.0.0.1:8001", help="the router's admin URL")
    top.add_argument("--once", type=float, metavar="SECONDS", help="follow for SECONDS, print once, exit")
    sub.add_parser("bench", help="the deployment client: run a workload, report SLO attainment (narwhal bench --help)")
    sub.add_parser("profile", help="profile engines: sweeps, fits, profiles pair (narwhal profile --help)")
    sub.add_parser("check", help="preflight a fleet: engines, Gate F, fit limits, KV probes (narwhal check --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Subcommands with their own parsers (and sub-subcommands) take the rest as is,
    # after the global logging options.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level", default="INFO")
    pre.add_argument("--log-json", action="store_true")
    known, rest = pre.parse_known_args(argv)
    delegated = {"bench": _bench_main, "profile": profile_main, "check": check_main}
    if rest[:1] and rest[0] in delegated:
        configure_logging(known.log_level, json_lines=known.log_json)
        return delegated[rest[0]](rest[1:])
    args = _parser().parse_args(argv)
    configure_logging(str(args.log_level), json_lines=args.log_json)
    try:
        if args.command == "serve":
            config = _load(args.fleet)
            profiles = _preflight(config)
            if args.workers > 1:
                trio.run(_serve_workers, args, config)
            elif args.worker_of:
                # A worker of --workers: shared port, engine load read from the engines.
                server = attrs.evolve(
                    config.server, engine_load_poll_s=config.server.engine_load_poll_s or 1.0
                )
                config = attrs.evolve(config, server=server)
                trio.run(
                    functools.partial(
                        _serve, config, args.host, args.port, args.admin_port,
                        reuse_port=True, start_sims=False, profiles=profiles,
                    )
                )
            else:
                trio.run(functools.partial(_serve, config, args.host, args.port, args.admin_port, profiles=profiles))
        elif args.command == "sim":
            trio.run(_sim, _load(args.fleet))
        elif args.command == "top":
            from narwhal.top import run_top

            trio.run(functools.partial(run_top, args.admin, once_after_s=args.once))
        elif args.command == "profile":
            return profile_main([])
        elif args.command == "check":
            return check_main([])
    except ConfigError as err:
        print(f"narwhal: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _bench_main(argv: Sequence[str] | None = None) -> int:
    from narwhal.bench.cli import main as run

    return run(argv)


def profile_main(argv: Sequence[str] | None = None) -> int:
    """``narwhal profile`` / ``narwhal-profile``: sweep engines, fit and write profiles."""
    from narwhal.profile.cli import main as run

    return run(argv)


def check_main(argv: Sequence[str] | None = None) -> int:
    """``narwhal check`` / ``narwhal-check``: the preflight a deployment passes first."""
    from narwhal.check.cli import main as run

    return run(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
