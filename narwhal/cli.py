"""Command line: ``narwhal serve|sim|top|bench|profile|check`` (and ``narwhal-profile`` / ``narwhal-check``).

``narwhal serve`` with no ``--fleet`` serves the embedded default fleet document
(``narwhal/data/fleet.sim.json``, package data; a checkout's ``config/fleet.sim.json``
links to it): its simulated engines start in the same process, so a newcomer's first
command gives a working router. ``serve`` and ``sim`` log which document they read.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from narwhal import __version__
from narwhal.cmdline import (
    CommandError,
    default_fleet_path,
    duration,
    guarded,
    port_number,
    positive_int,
)
from narwhal.config import FleetConfig, load_fleet, parse_fleet
from narwhal.errors import ConfigError
from narwhal.logs import LEVELS, configure_logging
from narwhal.router.keys import ADMIN_KEY_ENV, admin_listener_problem

if TYPE_CHECKING:
    from narwhal.profile.store import Profiles

__all__ = ["check_main", "default_fleet_path", "fleet_source", "main", "profile_main"]

log = logging.getLogger("narwhal")


def _load(path: str | None) -> FleetConfig:
    return load_fleet(path if path is not None else default_fleet_path())


def fleet_source(path: str | None) -> str:
    """Which fleet document a command reads, for its log: ``--fleet``'s, or the embedded one."""
    if path is not None:
        return f"fleet document: {path}"
    return f"fleet document: the embedded default, {default_fleet_path()} (--fleet serves another)"


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
    from narwhal.tracing import check_tracing

    check_tracing(config.tracing)  # its packages, before any worker starts
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


def _log_level(text: str) -> str:
    if text.upper() not in LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level (one of {', '.join(LEVELS).lower()})")
    return text.upper()


def _logging_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``--log-level`` / ``--log-json``, before the subcommand (``top``) or after it."""
    parser.add_argument(
        "--log-level", type=_log_level, default="INFO" if top else argparse.SUPPRESS,
        help="logging level: debug, info, warning, error (default: info; debug adds the HTTP client's lines)",
    )  # fmt: skip
    parser.add_argument(
        "--log-json", action="store_true", default=False if top else argparse.SUPPRESS,
        help="log JSON lines instead of plain text",
    )  # fmt: skip


def _split_logging(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(logging options, the rest)``: the logging options may come anywhere before ``--``."""
    options: list[str] = []
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--":
            rest += [arg, *it]
        elif arg == "--log-json" or arg.startswith("--log-level="):
            options.append(arg)
        elif arg == "--log-level":
            options += [arg, next(it, "")]
        else:
            rest.append(arg)
    return options, rest


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help with each option's default (where it has one worth showing)."""


_SUBCOMMANDS = {
    "serve": "run the router (the embedded simulated fleet unless --fleet)",
    "sim": "run only the simulated engines a fleet document declares",
    "top": "a terminal view of a running router (its admin surface)",
    "bench": "the deployment client: run a workload, report SLO attainment (narwhal bench --help)",
    "profile": "profile engines: sweeps, fits, profiles pair (narwhal profile --help)",
    "check": "preflight a fleet: engines, Gate F, fit limits, KV probes (narwhal check --help)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="narwhal", description="A router for disaggregated LLM serving.", formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=f"narwhal {__version__}")
    _logging_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(_SUBCOMMANDS) + "}")

    def add(name: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=_SUBCOMMANDS[name], description=_SUBCOMMANDS[name], formatter_class=_Formatter)
        _logging_options(p, top=False)
        return p

    serve = add("serve")
    serve.add_argument("--fleet", metavar="F", help="fleet document (default: the embedded simulated fleet)")
    serve.add_argument(
        "--profiles", metavar="P", help="price placement by this profiles.json (overrides the document's profiles.path)"
    )
    serve.add_argument(
        "--api-key", action="append", metavar="KEY",
        help="a bearer key clients must present, added to server.api_keys (repeatable; also the "
        "NARWHAL_API_KEY environment variable, which other users cannot read in ps)",
    )  # fmt: skip
    serve.add_argument("--host", help="listen address (default: server.host)")
    serve.add_argument("--port", type=port_number, help="listen port, 0-65535 (default: server.port)")
    serve.add_argument("--admin-port", type=port_number, help="admin (metrics, events) port (default: server.admin_port)")
    serve.add_argument(
        "--metrics-on-api-port", action="store_true",
        help="also answer GET /metrics on the router port, as vLLM does (behind --api-key when keys are set)",
    )  # fmt: skip
    serve.add_argument("--workers", type=positive_int, default=1, help="router processes sharing the port (SO_REUSEPORT)")
    serve.add_argument(
        "--engine-load-poll", type=duration, metavar="SECONDS",
        help="read every engine's load from its /metrics at this period and count what other routers "
        "placed (replicas behind a load balancer; sets server.engine_load_poll_s)",
    )  # fmt: skip
    serve.add_argument("--worker-of", type=int, default=0, help=argparse.SUPPRESS)
    serve.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    sim = add("sim")
    sim.add_argument("--fleet", metavar="F", help="fleet document (default: the embedded simulated fleet)")
    top = add("top")
    top.add_argument("--admin", default="http://127.0.0.1:8001", help="the router's admin URL")
    top.add_argument(
        "--admin-key", metavar="KEY",
        help=f"the admin key to present (server.admin_api_keys; default: the {ADMIN_KEY_ENV} environment "
        "variable, which other users cannot read in ps)",
    )  # fmt: skip
    top.add_argument(
        "--once", type=duration, metavar="SECONDS", help="follow for SECONDS, print once, exit"
    )
    for name in ("bench", "profile", "check"):
        sub.add_parser(name, help=_SUBCOMMANDS[name], add_help=False)
    return parser


def _serve_config(args: argparse.Namespace, document: object = None) -> FleetConfig:
    """The fleet ``narwhal serve`` serves: the document (``--fleet``, re-read on each call,
    or one sent to the admin ``PUT /fleet``) with the command line's overrides."""
    config = _load(args.fleet) if document is None else parse_fleet(document, source="PUT /fleet")
    if args.profiles is not None:
        config = attrs.evolve(config, profiles=attrs.evolve(config.profiles, path=args.profiles))
    keys = [*(args.api_key or ()), *filter(None, [os.environ.get("NARWHAL_API_KEY")])]
    if keys:
        if any(not k.strip() for k in keys):
            raise CommandError("an API key is empty (--api-key, NARWHAL_API_KEY)", status=2)
        config = attrs.evolve(config, server=attrs.evolve(config.server, api_keys=(*config.server.api_keys, *keys)))
    admin_key = os.environ.get(ADMIN_KEY_ENV)
    if admin_key is not None:
        if not admin_key.strip():
            raise CommandError(f"the admin key is empty ({ADMIN_KEY_ENV})", status=2)
        server = config.server
        config = attrs.evolve(config, server=attrs.evolve(server, admin_api_keys=(*server.admin_api_keys, admin_key)))
    if args.engine_load_poll is not None:
        config = attrs.evolve(config, server=attrs.evolve(config.server, engine_load_poll_s=args.engine_load_poll))
    port = config.server.port if args.port is None else args.port
    admin = config.server.admin_port if args.admin_port is None else args.admin_port
    if port and port == admin and args.workers == 1:
        raise CommandError(
            f"the admin port {admin} is the router's own port: give --admin-port (or server.admin_port) another"
        )
    return config


def _as_worker(args: argparse.Namespace, config: FleetConfig) -> FleetConfig:
    """A worker of --workers (after the preflight): engine load read from the engines."""
    if not args.worker_of:
        return config
    server = attrs.evolve(config.server, engine_load_poll_s=config.server.engine_load_poll_s or 1.0)
    config = attrs.evolve(config, server=server)
    if config.tenancy is not None:  # each worker enforces its share of the tenants' limits (without a store)
        config = attrs.evolve(config, tenancy=attrs.evolve(config.tenancy, replicas=config.tenancy.replicas * args.worker_of))
    return config


def _admin_port(args: argparse.Namespace, config: FleetConfig) -> int:
    return config.server.admin_port if args.admin_port is None else int(args.admin_port)


def _worker_argv(args: argparse.Namespace, config: FleetConfig) -> Callable[[int], list[str]]:
    from narwhal import serving

    ports = serving.worker_admin_ports(_admin_port(args, config), args.workers)

    def argv(i: int) -> list[str]:
        cmd = ["--log-level", args.log_level, *(["--log-json"] if args.log_json else [])]
        cmd += ["serve", "--worker-of", str(args.workers), "--worker-index", str(i), "--admin-port", str(ports[i])]
        for flag, value in (("--fleet", args.fleet), ("--profiles", args.profiles), ("--host", args.host)):
            if value:
                cmd += [flag, value]
        for key in args.api_key or ():
            cmd += ["--api-key", key]
        if args.metrics_on_api_port:
            cmd.append("--metrics-on-api-port")
        if args.engine_load_poll is not None:
            cmd += ["--engine-load-poll", repr(args.engine_load_poll)]
        if args.port is not None:
            cmd += ["--port", str(args.port)]
        return cmd

    return argv


def _run(args: argparse.Namespace) -> int:
    from narwhal import serving

    if args.command in ("serve", "sim") and not getattr(args, "worker_of", 0):
        log.info("%s", fleet_source(args.fleet))
    if args.command == "serve":
        config = _serve_config(args)
        problem = admin_listener_problem(config.server)
        if problem is not None:
            raise problem
        profiles = _preflight(config)
        if args.workers > 1:
            trio.run(serving.run_workers, config, args.workers, _worker_argv(args, config), _admin_port(args, config))
        else:

            def prepare(document: object) -> tuple[FleetConfig, Profiles | None]:
                fresh = _serve_config(args, document)
                fresh_profiles = _preflight(fresh)
                return _as_worker(args, fresh), fresh_profiles

            run = functools.partial(
                serving.run_serve, _as_worker(args, config), args.host, args.port, args.admin_port,
                profiles=profiles, metrics_on_api_port=args.metrics_on_api_port, prepare=prepare,
                reuse_port=bool(args.worker_of), start_sims=not args.worker_of,
                worker=args.worker_index if args.worker_of else None,
            )  # fmt: skip
            trio.run(run)
    elif args.command == "sim":
        trio.run(serving.run_sim, _load(args.fleet))
    elif args.command == "top":
        from narwhal.top import run_top

        key = args.admin_key if args.admin_key is not None else os.environ.get(ADMIN_KEY_ENV)
        trio.run(functools.partial(run_top, args.admin, once_after_s=args.once, key=key or None))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging_argv, rest = _split_logging(argv)
    # Subcommands with their own parsers (and sub-subcommands) take the rest as is.
    delegated = {"bench": _bench_main, "profile": profile_main, "check": check_main}
    if rest[:1] and rest[0] in delegated:
        pre = argparse.ArgumentParser(prog=f"narwhal {rest[0]}")
        _logging_options(pre, top=True)
        known = pre.parse_args(logging_argv)
        configure_logging(known.log_level, json_lines=known.log_json)
        return guarded(f"narwhal {rest[0]}", functools.partial(delegated[rest[0]], rest[1:]))
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, json_lines=args.log_json)
    return guarded(f"narwhal {args.command}", functools.partial(_run, args))


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
