"""The preflight: every check in order, as one :func:`run_check` returning a :class:`CheckReport`.

Order: the fleet document loads (a :class:`~narwhal.errors.ConfigError` is one result
naming its JSON path, and nothing else runs); the fit limit is at most the movement
margin; every engine answers its identity (concurrently, each within
``engine.first_token_timeout_s``); with ``engine_contract``, each identity matches it
(version, model, max_model_len, and the connector type the fleet document gives the
engine); every model's pool has a reachable producer and consumer
(:mod:`narwhal.check.pools`); Gate F and the fit limits (:mod:`narwhal.check.gate`);
the KV transfer probes (:mod:`narwhal.check.probes`); and last, every engine still runs the generation
it ran at the start (a restart during the check fails it).

Every check is a function returning :class:`CheckResult`\\ s; none raises for what it
finds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from typing import Any

import attrs
import httpx
import trio

from narwhal.check.gate import check_fit_limits, check_margin, find_refit_original, gate_f
from narwhal.check.pools import check_pools
from narwhal.check.probes import probe_transfers
from narwhal.check.results import CheckReport, CheckResult, ProfilePair
from narwhal.config import FleetConfig, parse_fleet, unstructure_fleet
from narwhal.engines.client import EngineClient, EngineIdentity, start_date
from narwhal.errors import ConfigError, EngineError
from narwhal.profile.store import Profiles, read_json

__all__ = [
    "CheckReport",
    "CheckResult",
    "FleetInput",
    "check_contract",
    "check_stable",
    "load_fleet_input",
    "open_clients",
    "read_identities",
    "run_check",
]

#: Identity reads per engine: a transient failure (a connection the engine dropped) is retried.
_IDENTITY_ATTEMPTS = 2

#: What :func:`run_check` accepts as the fleet: a loaded document, its file, or its JSON.
FleetInput = FleetConfig | str | os.PathLike[str] | Mapping[str, Any]


def load_fleet_input(
    fleet: FleetInput,
) -> tuple[FleetConfig | None, Mapping[str, Any] | None, str | None, CheckResult]:
    """Load the fleet document: ``(config, document, source, result)``.

    ``config`` is ``None`` when it does not load; ``result`` says so with the JSON
    path of the first bad value.
    """
    source: str | None = None
    document: Any = None  # pragma: no mutate (equivalent: a start value that is not a mapping reports as None)
    try:
        if isinstance(fleet, FleetConfig):
            config, document = fleet, unstructure_fleet(fleet)
        elif isinstance(fleet, Mapping):
            document = fleet
            config = parse_fleet(dict(fleet))
        else:
            source = os.fspath(fleet)
            document = read_json(source, "fleet document")
            config = parse_fleet(document, source=source)
    except ConfigError as exc:
        return (
            None,
            document if isinstance(document, Mapping) else None,
            source,
            CheckResult(
                name="fleet",
                engine=None,
                ok=False,
                measured=exc.path,
                limit="a valid fleet document",
                message=f"the fleet document does not load: {exc}",
                detail={"path": exc.path},
            ),
        )
    names = ", ".join(e.name for e in config.engines)
    return (
        config,
        document,
        source,
        CheckResult(
            name="fleet",
            engine=None,
            ok=True,
            measured=len(config.engines),
            limit="a valid fleet document",
            message=f"the fleet document loads (engines: {names})",
        ),
    )


def open_clients(
    stack: AsyncExitStack, config: FleetConfig, transport: httpx.AsyncBaseTransport | None
) -> dict[str, EngineClient]:
    """One client per engine; closed with ``stack`` (a given transport is the caller's)."""
    connect = config.engine.connect_timeout_s
    shared: httpx.AsyncClient | None = None
    if transport is not None:
        # The caller owns the transport: one client over it, never closed here.
        shared = httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(None, connect=connect)
        )
    clients: dict[str, EngineClient] = {}
    for e in config.engines:
        client = EngineClient(
            e.url,
            name=e.name,
            model=e.model,
            connector=e.connector,
            api_key=e.api_key,
            http_client=shared,
            connect_timeout_s=connect,
        )
        if shared is None:
            stack.push_async_callback(client.aclose)
        clients[e.name] = client
    return clients


async def read_identities(
    clients: Mapping[str, EngineClient], timeout_s: float
) -> tuple[dict[str, EngineIdentity | None], dict[str, str]]:
    """Every engine's identity, concurrently: ``(identities, errors)``; ``None`` when unreachable."""
    identities: dict[str, EngineIdentity | None] = {name: None for name in clients}
    errors: dict[str, str] = {}

    async def one(name: str, client: EngineClient) -> None:
        with trio.move_on_after(timeout_s) as scope:
            for _ in range(_IDENTITY_ATTEMPTS):
                try:
                    identities[name] = await client.identity()
                    errors.pop(name, None)
                    return
                except EngineError as exc:
                    errors[name] = str(exc)
                    # A pooled connection to a restarted engine fails once; a fresh one tells.
                    if not exc.transient:
                        return
        if scope.cancelled_caught:
            errors[name] = f"engine {name} did not answer its identity within {timeout_s:g} s"

    async with trio.open_nursery() as nursery:
        for name, client in clients.items():
            nursery.start_soon(one, name, client)
    return identities, errors


def _reachable(
    config: FleetConfig, identities: Mapping[str, EngineIdentity | None], errors: Mapping[str, str]
) -> list[CheckResult]:
    limit = f"identity within {config.engine.first_token_timeout_s:g} s"
    results = []
    for e in config.engines:
        ident = identities.get(e.name)
        if ident is None:
            why = errors.get(e.name, "no answer")
            results.append(
                CheckResult(
                    name="reachable",
                    engine=e.name,
                    ok=False,
                    measured="unreachable",
                    limit=limit,
                    message=f"engine {e.name} at {e.url} is unreachable: {why}",
                )
            )
            continue
        results.append(
            CheckResult(
                name="reachable",
                engine=e.name,
                ok=True,
                measured="reachable",
                limit=limit,
                detail=attrs.asdict(ident),
                message=f"engine {e.name} at {e.url}: version {ident.version}, model {ident.model}, "
                f"max_model_len {ident.max_model_len}",
            )
        )
    return results


def check_contract(
    config: FleetConfig, identities: Mapping[str, EngineIdentity | None]
) -> list[CheckResult]:
    """One result per engine and pinned field of ``engine_contract`` (none without a contract).

    The connector is the one the fleet document configures for the engine (engines do
    not report theirs); the other fields are what the engine reports.
    """
    contract = config.engine_contract
    if contract is None:
        return []
    results: list[CheckResult] = []
    for e in config.engines:
        ident = identities.get(e.name)
        fields: list[tuple[str, Any, Any]] = [
            ("version", contract.version, ident.version if ident else None),
            ("model", contract.model, ident.model if ident else None),
            ("max_model_len", contract.max_model_len, ident.max_model_len if ident else None),
            ("connector", contract.connector, e.connector.type if e.connector else None),
        ]
        for field, pinned, actual in fields:
            if pinned is None:
                continue
            name = f"contract.{field}"
            if ident is None and field != "connector":
                results.append(
                    CheckResult(
                        name=name,
                        engine=e.name,
                        ok=False,
                        measured=None,  # pragma: no mutate (equivalent: None is CheckResult's default)
                        limit=pinned,
                        message=f"engine {e.name} is unreachable; its {field} is unknown",
                    )
                )
                continue
            ok = actual == pinned
            where = "configures" if field == "connector" else "reports"
            message = f"engine {e.name} {where} {field} {actual!r}" + (
                "" if ok else f", engine_contract.{field} pins {pinned!r}"
            )
            results.append(
                CheckResult(
                    name=name, engine=e.name, ok=ok, measured=actual, limit=pinned, message=message
                )
            )
    return results


def check_stable(
    before: Mapping[str, EngineIdentity | None], after: Mapping[str, EngineIdentity | None]
) -> list[CheckResult]:
    """Every engine reachable at the start still runs the same generation at the end."""
    results = []
    for name, first in before.items():
        if first is None:
            continue
        last = after.get(name)
        ok = last == first
        started = start_date(first.process_start_time)
        now = start_date(last.process_start_time) if last else None
        message = (
            f"engine {name} ran one generation throughout the check"
            if ok
            else f"engine {name} restarted or went away during the check "
            f"(started {started} -> {now or 'unreachable'})"
        )
        results.append(
            CheckResult(
                name="generation.stable",
                engine=name,
                ok=ok,
                measured=now,
                limit=started,
                message=message,
                detail={"process_start_time": [first.process_start_time, last.process_start_time if last else None]},
            )
        )
    return results


def _refit_original(
    profiles: Profiles, pair: ProfilePair
) -> tuple[ProfilePair | None, list[CheckResult]]:
    if profiles.refit_of is None:
        return None, []
    try:
        original = find_refit_original(profiles, pair)
    except (ConfigError, OSError) as exc:
        return None, [
            CheckResult(
                name="gate_f.refit_original",
                engine=None,
                ok=False,
                measured=profiles.refit_of,
                limit="the original pair on disk",
                message=f"the refit's original pair cannot be retained: {exc}",
            )
        ]
    assert original is not None
    return original, [
        CheckResult(
            name="gate_f.refit_original",
            engine=None,
            ok=True,
            measured=original.samples,
            limit="the original pair on disk",
            message=f"the profiles are a refit of {original.profiles}",
        )
    ]


async def run_check(
    fleet: FleetInput,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> CheckReport:
    """Run the whole preflight against the fleet's engines.

    Args:
        fleet: The fleet document: loaded, its file, or its parsed JSON.
        transport: An httpx transport to reach the engines (tests: a simulated fleet's
            in-memory transport); real sockets when omitted.

    Returns:
        The report; ``report.ok`` says whether the fleet passed.
    """
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    start = trio.current_time()
    config, document, source, loaded = load_fleet_input(fleet)
    if config is None:
        return CheckReport(
            results=(loaded,), source=source, document=document, started_at=started_at
        )
    results = [loaded, check_margin(config)]
    async with AsyncExitStack() as stack:
        clients = open_clients(stack, config, transport)
        timeout_s = config.engine.first_token_timeout_s
        identities, errors = await read_identities(clients, timeout_s)
        results += _reachable(config, identities, errors)
        results += check_contract(config, identities)
        results += check_pools(config, identities)
        gate = gate_f(config, identities, fleet_source=source)
        results += gate.results
        original: ProfilePair | None = None
        if gate.profiles is not None and gate.pair is not None:  # pragma: no mutate (equivalent: gate_f sets both or neither; 'or' reads the same)
            results += check_fit_limits(config, gate.profiles, gate.samples)
            original, found = _refit_original(gate.profiles, gate.pair)
            results += found
        results += await probe_transfers(config, clients, identities)
        after, _ = await read_identities(clients, timeout_s)
        results += check_stable(identities, after)
    return CheckReport(
        results=tuple(results),
        source=source,
        document=document,
        identities=identities,
        identities_after=after,
        profiles=gate.pair,
        refit_original=original,
        started_at=started_at,
        duration_s=trio.current_time() - start,
    )
