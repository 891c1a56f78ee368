"""``narwhal check`` / ``narwhal-check``: the preflight, and SLO targets for a workload.

Usage::

    narwhal check [--fleet F] [--profiles P] [--json] [--record DIR]
    narwhal check [--fleet F] [--profiles P] --suggest-slo --workload W [--json]

Exit status: 0 when every check passes (``--suggest-slo``: the workload can be held),
1 when a check fails (or the workload cannot be held, or a record is refused), 2 on a
usage error (``--suggest-slo``: also an unusable fleet, profile pair or workload file).
Each result is one line, ``ok`` or ``FAIL``, naming the check, the engine (``fleet``
for the whole fleet, ``p->c`` for a transfer pair), what was found, the measured
value and the configured limit.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TextIO

import attrs
import httpx
import trio

from narwhal.check.checks import FleetInput, run_check
from narwhal.check.gate import load_pair
from narwhal.check.record import RecordError, write_record
from narwhal.check.results import CheckReport
from narwhal.check.suggest import SLOSuggestion, load_workload, suggest_slo
from narwhal.cmdline import default_fleet_path
from narwhal.config import FleetConfig, load_fleet
from narwhal.errors import ConfigError
from narwhal.profile.store import read_json

__all__ = ["PROG", "amain", "main"]

PROG = "narwhal check"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Preflight a fleet: its document, engines, engine "
        "contract, profiles (Gate F, fit limits) and KV transfers; or suggest the "
        "SLO targets it can hold for a workload.",
    )
    p.add_argument("--fleet", help="the fleet document (default: the embedded simulated fleet)")
    p.add_argument(
        "--profiles",
        metavar="P",
        help="check with this profiles.json instead of the document's profiles.path "
        "(to record a deployment, name the pair in the document)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--record",
        metavar="DIR",
        help="retain a passing check as a deployment record in DIR (new or empty)",
    )
    p.add_argument(
        "--suggest-slo",
        action="store_true",
        help="suggest TTFT/TPOT targets and a prefill/decode split for --workload "
        "from the profiles (no engine is contacted)",
    )
    p.add_argument(
        "--workload",
        metavar="W",
        help='workload file: {"rate": 4, "input_len": "uniform:100:500", '
        '"output_len": "fixed:128"}',
    )
    return p


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit:  # --help, argparse's only exit here (its errors raise _UsageError)
        raise _Exit(0) from None
    if args.suggest_slo and args.workload is None:
        raise _UsageError("--suggest-slo needs --workload")
    if args.workload is not None and not args.suggest_slo:
        raise _UsageError("--workload goes with --suggest-slo")
    if args.suggest_slo and args.record is not None:
        raise _UsageError("--record retains a preflight; it does not go with --suggest-slo")
    if args.profiles is not None and args.record is not None:
        raise _UsageError("--record keeps the fleet document as it is: set profiles.path in it instead of --profiles")
    if args.fleet is None:
        args.fleet = str(default_fleet_path())
    return args


def _fleet_input(args: argparse.Namespace) -> FleetInput:
    """The fleet document to check: its file, or (``--profiles``) its JSON with profiles.path set."""
    if args.profiles is None:
        return str(args.fleet)
    try:
        # The label names only an error dropped here (the check reads the file again).
        document = read_json(args.fleet, "fleet document")  # pragma: no mutate (equivalent: see above)
    except ConfigError:
        return str(args.fleet)  # the check reports why it does not load
    if not isinstance(document, dict) or not isinstance(document.get("profiles", {}), dict):
        return str(args.fleet)
    document["profiles"] = {**document.get("profiles", {}), "path": args.profiles}
    return document


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)  # pragma: no mutate (equivalent: the exit status is read from .code)
        self.code = code


def _render_check(report: CheckReport, out: TextIO) -> None:
    print(f"{PROG}: fleet {report.source or '(in memory)'}", file=out)
    for line in report.lines():
        print(line, file=out)
    total, failed = len(report.results), len(report.failures)
    if failed:
        print(f"{PROG}: FAILED: {failed} of {total} checks failed", file=out)
    else:
        print(f"{PROG}: passed ({total} checks, {report.duration_s:.2f} s)", file=out)


async def _check(
    args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None, out: TextIO, err: TextIO
) -> int:
    report = await run_check(_fleet_input(args), transport=transport)
    if args.profiles is not None and report.source is None:
        report = attrs.evolve(report, source=f"{args.fleet} with profiles.path {args.profiles}")
    record: dict[str, object] | None = None
    if args.record is not None:
        try:
            written = write_record(report, args.record)
            record = {"dir": str(written.directory), "written": True, "error": None}
        except (RecordError, ConfigError, OSError) as exc:
            record = {"dir": args.record, "written": False, "error": str(exc)}
    if args.json:
        data = report.to_json() | ({"record": record} if record is not None else {})
        print(json.dumps(data, indent=1), file=out)
    else:
        _render_check(report, out)
        if record is not None and record["written"]:
            print(f"{PROG}: deployment record written to {record['dir']}", file=out)
    if record is not None and not record["written"]:
        print(f"{PROG}: no record written: {record['error']}", file=err)
    return 0 if report.ok and (record is None or record["written"]) else 1


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g} s"


def _render_suggestion(s: SLOSuggestion, config: FleetConfig, out: TextIO) -> None:
    w = s.workload
    print(
        f"{PROG} --suggest-slo: {w.rate:g} requests/s, input {w.input_len.spec}, output "
        f"{w.output_len.spec}, {w.arrival} arrivals",
        file=out,
    )
    b = s.best
    if b is not None:
        print(
            f"split: prefill {', '.join(b.producers)}; decode {', '.join(b.consumers)} "
            f"(best of {s.candidates} splits priced)",
            file=out,
        )
        print(
            f"pressures: prefill {b.prefill:.3f} (utilisation), decode {b.decode:.3f} "
            f"(utilisation or KV fill); worse {b.worse:.3f}",
            file=out,
        )
        for name in b.producers:
            print(f"  {name}: prefill {b.prefill_rates[name]:.3g} requests/s", file=out)
        for name in b.consumers:
            print(
                f"  {name}: decode {b.decode_rates[name]:.3g} requests/s, mean step "
                f"{_seconds(b.step_s[name])}, {b.active[name]:.3g} active, "
                f"{b.kv_tokens[name]:.4g} KV tokens",
                file=out,
            )
    if not s.holds:
        print(f"{PROG}: CANNOT HOLD: {s.reason}", file=out)
        return
    ttft, tpot = s.ttft_s, s.tpot_s
    for what, values in (("TTFT", ttft), ("TPOT", tpot)):
        print(
            f"{what} targets: p50 {_seconds(values.get('p50'))}, p90 "
            f"{_seconds(values.get('p90'))} (mean {_seconds(values.get('mean'))})",
            file=out,
        )
    slo = config.controller.slo
    for what, target, got in (
        ("ttft_s", slo.ttft_s, ttft.get("p90")),
        ("tpot_s", slo.tpot_s, tpot.get("p90")),
    ):
        if target is not None and got is not None:
            verdict = "holds" if got <= target else "is missed"
            print(f"controller.slo.{what} {target:g} s {verdict} at p90 ({got:.4g} s)", file=out)
    for warning in s.warnings:
        print(f"warning: {warning}", file=out)
    print(
        f"({s.simulated} requests simulated, seed {w.seed}; targets hold on an idle-fleet profile)",
        file=out,
    )


def _suggest(args: argparse.Namespace, out: TextIO) -> int:
    config = load_fleet(args.fleet)
    if args.profiles is not None:
        config = attrs.evolve(config, profiles=attrs.evolve(config.profiles, path=args.profiles))
    if config.profiles.path is None:
        raise ConfigError(
            "profiles.path is not set; profile the fleet first (narwhal profile)",
            path="$.profiles.path",
            source=args.fleet,
        )
    profiles, _ = load_pair(Path(config.profiles.path))
    workload = load_workload(args.workload)
    suggestion = suggest_slo(config, profiles, workload)
    if args.json:
        print(json.dumps(suggestion.to_json(), indent=1), file=out)
    else:
        _render_suggestion(suggestion, config, out)
    return 0 if suggestion.holds else 1


async def amain(
    argv: Sequence[str],
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run ``narwhal check`` with ``argv`` inside a Trio run; returns the exit status.

    Args:
        argv: The arguments after ``check``.
        transport: An httpx transport to reach the engines (tests: in memory).
        stdout: Where results go (default ``sys.stdout``).
        stderr: Where errors go (default ``sys.stderr``).
    """
    out = stdout if stdout is not None else sys.stdout  # pragma: no mutate (equivalent: print(file=None) writes to sys.stdout too)
    err = stderr if stderr is not None else sys.stderr
    try:
        args = _parse(argv)
        if args.suggest_slo:
            return _suggest(args, out)
        return await _check(args, transport, out, err)
    except _Exit as exc:
        return exc.code
    except (_UsageError, ConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=err)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``narwhal check`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        return trio.run(functools.partial(amain, arguments))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
