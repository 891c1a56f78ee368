"""The live fleet: engines join, drain and leave while the router serves.

A fleet reload (``SIGHUP``, the admin ``PUT /fleet``) and DNS discovery
(:mod:`narwhal.router.discovery`) both hand :meth:`LiveFleet.apply` a whole fleet
document; it compares the engines that document asks for with the engines the router
knows and changes only the difference:

- an **added** engine is ``starting``: known (client, breaker state, load) but out of
  placement until its readiness probe passes (``GET /health`` answers 200, or with
  ``engine_contract`` its identity matches the contract), retried every
  ``recovery.probe_interval_s``, :data:`PROBES_AT_ONCE` at a time. Those found ready
  together enter placement together. Then it is priced by its profile when one binds
  to the generation running there, else placed by load (``/health`` on the admin port
  says which);
- a **removed** engine is ``draining``: no new placements; the requests it serves
  finish under their own deadlines; then its connections are closed and it is
  forgotten. A role is never left empty by a change, per model: a draining engine
  keeps taking placements while no serving engine of a model it serves (one the fleet
  still serves) has one of its roles (until an added one is ready);
- an engine whose roles change keeps serving with its new roles; one whose address or
  any other connection setting (``url``, ``model``, ``api_key``, ``connector``,
  ``kv_events``) changes is **replaced**, make before break: the new engine starts
  beside it under its next incarnation's name (``d0#2``: :data:`~narwhal.config.INCARNATION`),
  and the old one drains once the new one is ready (it serves on while the new one is
  not; a document that goes back to the old settings calls the replacement off);
- settings (deadlines, SLO, recovery, the engine contract, profiles) apply to the
  requests that arrive after the change; requests in flight keep the document they
  arrived under. ``server``, ``journal``, ``engine_limits`` and some controller settings take a restart
  (:data:`RESTART_ONLY`): a document that changes them is refused, as is any document
  that fails validation, and nothing changes.

A change applies whole or not at all: what can fail (the checks, the groups' lookups,
the clients of the engines it adds) is done before anything changes, and the change is
then made shielded from its caller's cancellation, in time linear in the engines, with
a checkpoint every :data:`_BATCH` engines so that requests keep flowing.

Every change is one record (``"type": "fleet"``), published on the admin ``/events``
stream and appended to ``<journal>.fleet.jsonl`` beside the request journal (whose
contract is one line per request): ``reload`` (what a document changed, and from
where), ``rejected`` (why, with the JSON path; a secret's values redacted), and per
engine ``starting``, ``ready``, ``not_ready`` (its first failed readiness probe),
``draining`` and ``removed``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from narwhal.config import INCARNATION, EngineConfig, FleetConfig
from narwhal.engines.client import EngineClient
from narwhal.errors import ConfigError
from narwhal.profile.store import Profiles
from narwhal.router.controller import ReactiveController
from narwhal.router.fleetdiff import (
    RESTART_ONLY,
    FleetChange,
    changed_settings,
    restart_only,
    same_connection,
)
from narwhal.router.prefixwatch import PrefixWatch
from narwhal.router.pricing import PricedPlacement
from narwhal.router.probe import readiness_problem
from narwhal.router.state import RouterState, document_name

__all__ = ["RESTART_ONLY", "FleetChange", "LiveFleet"]

log = logging.getLogger("narwhal.router.fleet")

#: Engines handled between two checkpoints while a change applies: requests keep
#: flowing (and a signal is seen) while thousands of engines come or go.
_BATCH: Final = 64

#: Readiness probes (and the model listing, profile binding and cache configuration of
#: an engine found ready) that run at once: a change of thousands of engines probes them
#: a bounded number at a time, so that their answers do not all land in one scheduler
#: pass and stall the requests in flight.
PROBES_AT_ONCE: Final = 32


def _named(engine: EngineConfig, name: str) -> EngineConfig:
    """``engine`` under its name in the router (a later incarnation's, ``d0#2``)."""
    return engine if engine.name == name else attrs.evolve(engine, name=name)


class LiveFleet:
    """Applies fleet documents to a running router (see the module docstring).

    Args:
        state: the router's state.
        publish: the admin ``/events`` hub's ``publish``.
        journal_path: the request journal; records go to ``<journal>.fleet.jsonl``
            (None: kept in :attr:`changes` only).
        prefix_watch: follows added engines' prefix caches, when the router keeps views.
        controller: reactive control, whose settings follow the document.

    :attr:`expand` gives the engines of a document: its ``engines``, and with DNS
    discovery (:mod:`narwhal.router.discovery`) those its engine groups resolve to.
    """

    def __init__(
        self,
        state: RouterState,
        *,
        publish: Callable[[dict[str, Any]], None] | None = None,
        journal_path: str | Path | None = None,
        prefix_watch: PrefixWatch | None = None,
        controller: ReactiveController | None = None,
    ) -> None:
        self.state = state
        self.controller = controller
        self.publish = publish
        self.prefix_watch = prefix_watch
        self.path = Path(journal_path).with_suffix(".fleet.jsonl") if journal_path else None
        self.expand: Callable[[FleetConfig], list[EngineConfig]] = lambda config: list(config.engines)
        #: Runs before a document is applied (DNS discovery resolves its new groups);
        #: may refuse it with a ConfigError.
        self.before_apply: Callable[[FleetConfig], Awaitable[None]] | None = None
        #: Runs after a document was applied.
        self.after_apply: Callable[[FleetConfig], None] | None = None
        #: The most recent records (the file has them all).
        self.changes: list[dict[str, Any]] = []
        #: A document name -> the engine serving it (or starting to): the name itself, or
        #: a later incarnation (``d0#2``) after a replacement. (Made from the router's
        #: engines when the first document is applied: until then only this changes them.)
        self._primary: dict[str, str] = {}
        self._indexed = False
        #: A document name -> every engine of it the router knows (draining ones too).
        self._incarnations: dict[str, list[str]] = {}
        #: A replacement -> the engine it replaces, which serves until it is ready.
        self._replaces: dict[str, str] = {}
        #: Engines whose readiness probe passed, waiting to enter placement together.
        self._admitting: dict[str, str | None] = {}
        self._tasks: dict[str, trio.CancelScope] = {}
        self._probes = trio.CapacityLimiter(PROBES_AT_ONCE)
        self._lock = trio.Lock()
        self._held: list[dict[str, Any]] | None = None
        self._recorded = trio.Event()
        self._written = trio.Event()
        self._nursery: trio.Nursery | None = None
        send, receive = trio.open_memory_channel[str](math.inf)
        self._lines_in, self._lines_out = send, receive

    # ------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run readiness probes, drains and the record writer until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.path is not None:
                nursery.start_soon(self._write, self.path)
            task_status.started()
            await trio.sleep_forever()

    async def _write(self, path: Path) -> None:
        try:
            async for line in self._lines_out:
                lines = [line]
                while True:  # pragma: no mutate (equivalent: without it each line is written by itself)
                    try:
                        lines.append(self._lines_out.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await trio.to_thread.run_sync(_append, path, "".join(lines))
        finally:
            self._written.set()

    async def aclose(self) -> None:
        """Write the records still queued (the router stops); later ones are published only.

        Waits for the writer to drain, as the request journal's ``aclose`` does: a bound
        here lost the last records whenever a write took longer than it (in virtual time,
        any write to a file).
        """
        path, self.path = self.path, None
        self._lines_in.close()
        if path is not None and self._nursery is not None:
            with trio.CancelScope(shield=True):
                await self._written.wait()

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Journal and publish one fleet record."""
        rec: dict[str, Any] = {"type": "fleet", "event": event, "at": time.time(), **fields}
        if self._held is not None:  # a document being applied: its summary goes first
            self._held.append(rec)
            return rec
        self._emit(rec)
        return rec

    def _emit(self, rec: dict[str, Any]) -> None:
        self._recorded.set()
        self._recorded = trio.Event()
        self.changes.append(rec)
        del self.changes[:-1000]
        if self.publish is not None:
            self.publish(rec)
        if self.path is not None:
            self._lines_in.send_nowait(json.dumps(rec, separators=(",", ":")) + "\n")

    async def settle(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every starting engine's first readiness probe."""
        with trio.move_on_after(timeout_s):
            state = self.state
            while any(p == "starting" and n not in state.phase_errors for n, p in state.phase.items()):
                await self._recorded.wait()

    # ------------------------------------------------------------ applying a document

    def reject(self, err: ConfigError, source: str) -> None:
        """Record a document that was refused (nothing changed)."""
        self.record("rejected", source=source, error=err.reason, path=err.path)

    def check(self, config: FleetConfig, profiles: Profiles | None) -> None:
        """Refuse a document this router cannot apply without a restart.

        Raises:
            ConfigError: naming the first such setting's JSON path (a secret's values
                redacted).
        """
        state = self.state
        for path, old, new in changed_settings(state.config, config):
            if restart_only(path):
                raise ConfigError(
                    f"changes only with a restart (running with {old!r}, the document says {new!r})", path=f"$.{path}"
                )
        if (profiles is None) != (state.profiles is None):
            how = "by profiles" if state.profiles is not None else "by load"
            raise ConfigError(
                f"this router prices placement {how}; choosing between profiles and load takes a restart",
                path="$.profiles.path",
            )

    async def apply(self, config: FleetConfig, *, profiles: Profiles | None, source: str) -> FleetChange:
        """Make the router serve ``config`` (see the module docstring): all of it, or
        nothing when it is refused.

        Raises:
            ConfigError: the document cannot be applied; nothing changed.
            RuntimeError: it adds or drains engines and the fleet is not running
                (:meth:`run`); nothing changed.
        """
        async with self._lock:
            return await self._apply_document(config, profiles, source)

    async def refresh(self, source: str) -> FleetChange:
        """Apply the document served now again, with its profiles (what its engine groups
        resolve to changed): read once no other document is being applied, so that one a
        reload applied meanwhile is kept, not undone."""
        async with self._lock:
            return await self._apply_document(self.state.config, self.state.profiles, source)

    async def _apply_document(self, config: FleetConfig, profiles: Profiles | None, source: str) -> FleetChange:
        if not self._indexed:
            self._indexed = True
            for name in self.state.engines:
                self._primary.setdefault(document_name(name), name)
                known = self._incarnations.setdefault(document_name(name), [])
                if name not in known:
                    known.append(name)
        # Everything that can fail, before anything changes: the checks, the groups'
        # resolution, and the clients of the engines it may add.
        try:
            self.check(config, profiles)
            if self.before_apply is not None:
                await self.before_apply(config)
            desired = await self._desired(config)
        except ConfigError as err:
            self.reject(err, source)
            raise
        clients = await self._prepare_clients(desired)
        if self._nursery is None and (clients or any(name not in desired for name in self._primary)):
            await _close_all(c for _, c in clients.values())
            raise RuntimeError("the live fleet is not running")
        began = time.time()
        # Applied whole once begun: a caller that goes away (a PUT whose client hung up)
        # does not cut it short. Linear in the engines, with checkpoints.
        with trio.CancelScope(shield=True):
            self._held = []
            try:
                change = await self._apply(config, profiles, desired, clients, source)
                if not change.empty:
                    self._emit({"type": "fleet", "event": "reload", "at": began, **change.as_dict()})
                held = self._held
                for i, rec in enumerate(held):  # records made meanwhile join the end
                    self._emit(rec)
                    if i % _BATCH == _BATCH - 1:
                        await trio.lowlevel.checkpoint()
            finally:
                self._held = None
                await _close_all(c for _, c in clients.values())  # those not used
        if self.after_apply is not None:
            self.after_apply(config)
        return change

    async def _desired(self, config: FleetConfig) -> dict[str, EngineConfig]:
        # A role this leaves without an engine (a group that resolves to nothing) keeps
        # its draining engines in placement until one is ready again (RouterState.members).
        desired: dict[str, EngineConfig] = {}
        for i, e in enumerate(self.expand(config)):
            desired.setdefault(e.name, e)
            if i % _BATCH == _BATCH - 1:
                await trio.lowlevel.checkpoint()
        return desired

    async def _prepare_clients(self, desired: dict[str, EngineConfig]) -> dict[str, tuple[str, EngineClient]]:
        """The clients of the engines the document may add (new, or a replacement),
        under the names they would have: made before anything changes."""
        state = self.state
        clients: dict[str, tuple[str, EngineClient]] = {}
        try:
            for i, (name, new) in enumerate(desired.items()):
                key = self._primary.get(name)
                if key is not None and same_connection(state.engines[key], new):
                    continue
                if key is None or state.phase.get(key) != "starting":
                    key = self._free_name(name)
                clients[name] = (key, state.new_client(_named(new, key)))
                if i % _BATCH == _BATCH - 1:
                    await trio.lowlevel.checkpoint()
        except BaseException:
            await _close_all(c for _, c in clients.values())
            raise
        return clients

    def _free_name(self, name: str) -> str:
        """``name``, or its next incarnation's (``name#2``, ...) while an engine has it."""
        engines = self.state.engines
        if name not in engines:
            return name
        serial = 2
        while f"{name}{INCARNATION}{serial}" in engines:
            serial += 1
        return f"{name}{INCARNATION}{serial}"

    async def _apply(
        self,
        config: FleetConfig,
        profiles: Profiles | None,
        desired: dict[str, EngineConfig],
        clients: dict[str, tuple[str, EngineClient]],
        source: str,
    ) -> FleetChange:
        state = self.state
        settings = [path for path, _, _ in changed_settings(state.config, config)]
        old_timeout = state.config.engine.request_timeout_s
        self._apply_settings(config, profiles)
        changed: dict[str, list[str]] = {"added": [], "removed": [], "replaced": [], "roles": []}
        for i, name in enumerate(dict.fromkeys([*self._primary, *desired])):
            for what in await self._apply_engine(name, desired.get(name), clients, old_timeout):
                changed[what].append(name)
            if i % _BATCH == _BATCH - 1:
                await trio.lowlevel.checkpoint()
        state.refresh_roles()
        return FleetChange(
            source, added=tuple(changed["added"]), removed=tuple(changed["removed"]),
            replaced=tuple(changed["replaced"]), roles=tuple(changed["roles"]), settings=tuple(settings),
        )  # fmt: skip

    async def _apply_engine(
        self, name: str, new: EngineConfig | None, clients: dict[str, tuple[str, EngineClient]], old_timeout: float
    ) -> list[str]:
        """Make document name ``name`` what ``new`` says (None: gone); what changed."""
        state = self.state
        key = self._primary.get(name)
        if new is None:
            if key is None:
                return []
            del self._primary[name]
            replaced = self._replaces.pop(key, None)
            if state.phase.get(key) == "starting":
                await self._forget_starting(key, "removed before it was ready")
            else:
                self._drain(key, old_timeout)
            if replaced is not None and replaced in state.engines and replaced not in state.phase:
                self._drain(replaced, old_timeout)  # it served until its replacement was ready
            return ["removed"]
        if key is None:
            for old in self._incarnations.get(name, ()):
                if state.phase.get(old) == "draining" and same_connection(state.engines[old], new):
                    # Wanted again as it is: it serves on.
                    self._cancel_task(old)
                    del state.phase[old]
                    roles = state.engines[old].roles != new.roles
                    state.engines[old] = _named(new, old)
                    self._primary[name] = old
                    self.record("ready", engine=old, url=new.url, detail="wanted again while draining")
                    return ["added", "roles"] if roles else ["added"]
            key = self._free_name(name)
            self._add(_named(new, key), self._client(name, key, new, clients))
            self._primary[name] = key
            return ["added"]
        replaced = self._replaces.get(key)
        if replaced is not None and same_connection(state.engines[replaced], new):
            # Back to what the engine being replaced is: its replacement is called off.
            del self._replaces[key]
            self._primary[name] = replaced
            await self._forget_starting(key, "its replacement was called off")
            state.engines[replaced] = _named(new, replaced)
            return ["replaced"]
        current = state.engines[key]
        if same_connection(current, new):
            state.engines[key] = _named(new, key)
            return ["roles"] if current.roles != new.roles else []
        if state.phase.get(key) == "starting":  # not serving yet: replaced at once
            await self._forget_starting(key, "replaced before it was ready")
            self._add(_named(new, key), self._client(name, key, new, clients), replaces=replaced)
            return ["replaced"]
        # Make before break: the new engine starts beside the one it replaces, which
        # serves until the new one is ready and then drains.
        successor = self._free_name(name)
        self._replaces[successor] = key
        self._primary[name] = successor
        self._add(_named(new, successor), self._client(name, successor, new, clients), replaces=key)
        return ["replaced"]

    def _client(self, name: str, key: str, new: EngineConfig, clients: dict[str, tuple[str, EngineClient]]) -> EngineClient:
        """The client made for ``name`` beforehand, when made under ``key`` (else made now:
        the same settings, so it cannot fail where that one did not)."""
        prepared = clients.get(name)
        if prepared is not None and prepared[0] == key:
            del clients[name]
            return prepared[1]
        return self.state.new_client(_named(new, key))

    def _apply_settings(self, config: FleetConfig, profiles: Profiles | None) -> None:
        state = self.state
        state.config = config
        rec = config.recovery
        breaker = state.breaker
        breaker.eject_after, breaker.quarantine_s, breaker.probe_interval_s = (
            rec.eject_after, rec.failure_quarantine_s, rec.probe_interval_s
        )  # fmt: skip
        budget = state.retry_budget
        budget.ratio = rec.retry_budget.ratio
        budget.min_retries_per_s = rec.retry_budget.min_retries_per_s
        budget.window_s = rec.retry_budget.window_s
        state.admission.configure(config)
        ctl = config.controller
        placement = state.placement
        if isinstance(placement, PricedPlacement):
            placement.slo, placement.admission, placement.pricing = ctl.slo, ctl.admission, ctl.pricing
            placement.admission_bound = ctl.admission_bound
        if self.controller is not None:
            self.controller.reconfigure(config)
        if profiles is not state.profiles:
            state.profiles = profiles
            if self._nursery is not None:
                serving = [n for n in state.engines if n not in state.phase]
                self._nursery.start_soon(state.bind_profiles, serving)

    # ------------------------------------------------------------ engines

    def _add(self, engine: EngineConfig, client: EngineClient | None = None, *, replaces: str | None = None) -> None:
        name = engine.name
        self.state.add_engine(engine, client=client)  # starting: placed once its readiness probe passes
        self._incarnations.setdefault(document_name(name), []).append(name)
        extra = {"replaces": replaces} if replaces is not None else {}
        self.record("starting", engine=name, url=engine.url, roles=list(engine.roles), **extra)
        self._spawn(name, self._ready)

    def _drain(self, name: str, timeout_s: float, **detail: str) -> None:
        state = self.state
        state.phase[name] = "draining"
        self.record("draining", engine=name, url=state.engines[name].url, in_flight=state.in_flight_by_engine[name],
                    **detail)  # fmt: skip
        self._spawn(name, lambda n: self._drained(n, timeout_s))

    def _spawn(self, name: str, body: Callable[[str], Any]) -> None:
        # The only task a name has here is its readiness probe, which ends now.
        self._cancel_task(name)  # pragma: no mutate (equivalent: see above)
        scope = self._tasks[name] = trio.CancelScope()

        async def task() -> None:
            with scope:
                await body(name)
            if self._tasks.get(name) is scope:
                del self._tasks[name]

        if self._nursery is None:
            raise RuntimeError("the live fleet is not running")
        self._nursery.start_soon(task)

    def _cancel_task(self, name: str) -> None:
        scope = self._tasks.pop(name, None)
        if scope is not None:
            scope.cancel()

    async def _ready(self, name: str) -> None:
        """Probe an added engine until it is ready, then have it enter placement."""
        state = self.state
        failed = False  # pragma: no mutate (equivalent: None is as false)
        while True:
            async with self._probes:
                problem = await readiness_problem(state, name)
                if problem is None:
                    await self._prepare_ready(name)
                    break
            if state.phase.get(name) != "starting":  # forgotten meanwhile (its probe's cancellation is on its way)
                return
            state.phase_errors[name] = problem
            if not failed:
                failed = True
                log.warning("engine %s is not ready yet: %s (probed again every %g s)",
                            name, problem, state.config.recovery.probe_interval_s)  # fmt: skip
                self.record("not_ready", engine=name, detail=problem)
            await trio.sleep(state.config.recovery.probe_interval_s)

    async def _prepare_ready(self, name: str) -> None:
        """An engine found ready: its models, profile and cache, then placement."""
        state = self.state
        if state.phase.get(name) != "starting":  # forgotten meanwhile
            return
        state.phase_errors.pop(name, None)
        await state.refresh_models([name])
        unbound = await state.bind_profiles([name])
        if self.prefix_watch is not None:
            await self.prefix_watch.add(name)
        if state.phase.get(name) != "starting":
            return
        self._admitting[name] = unbound.get(name)
        if len(self._admitting) == 1 and self._nursery is not None:
            self._nursery.start_soon(self._admit)

    async def _admit(self) -> None:
        """Put the engines whose readiness probes passed in placement, together: one
        change of placement's roles for all those of a tick (thousands of engines
        probed at once enter in one step, not one walk of the fleet each), then drain
        the engines they replace."""
        await trio.lowlevel.checkpoint()  # the probes that pass in this tick join
        batch, self._admitting = self._admitting, {}
        state = self.state
        timeout = state.config.engine.request_timeout_s
        replaced: list[tuple[str, str]] = []
        for name, detail in batch.items():
            if state.phase.get(name) != "starting":  # pragma: no mutate (equivalent: a forgotten engine's entry is dropped with it)
                continue
            del state.phase[name]
            pricing = "profile" if isinstance(state.placement, PricedPlacement) and detail is None else "load"
            log.info("engine %s is ready: in placement (%s)", name, pricing if detail is None else f"{pricing}: {detail}")
            self.record("ready", engine=name, url=state.engines[name].url, pricing=pricing, detail=detail)
            old = self._replaces.pop(name, None)
            if old is not None:
                replaced.append((name, old))
        for name, old in replaced:
            if old in state.engines and old not in state.phase:
                self._drain(old, timeout, replaced_by=name)
        state.refresh_roles()

    async def _drained(self, name: str, timeout_s: float) -> None:
        """Wait until a draining engine is out of placement and idle, then forget it."""
        state = self.state
        placement = state.placement
        began: float | None = None  # when it left placement (it may be held for a role)
        warned = False  # pragma: no mutate (equivalent: None is as false)
        while True:
            if name in placement.prefill_engines or name in placement.decode_engines:
                began = None
                await placement.wait_released()  # role changes wake it too
                continue
            if not state.busy(name):
                break
            if began is None:
                began = state.clock()
            with trio.move_on_at(began + timeout_s if not warned else math.inf) as scope:
                await placement.wait_released()
            if scope.cancelled_caught:
                warned = True
                log.warning("engine %s still serves %d request(s) %g s into its drain", name,
                            state.in_flight_by_engine[name], timeout_s)  # fmt: skip
        since = f"{state.clock() - began:.3g} s" if began is not None else "no time"
        await self._forget(name, f"drained in {since}")

    async def _forget_starting(self, name: str, detail: str) -> None:
        """Forget an engine not ready yet: its readiness probe ends first (it would
        probe on, or put the engine in placement, while the engine is forgotten)."""
        self._cancel_task(name)
        await self._forget(name, detail)

    async def _forget(self, name: str, detail: str) -> None:
        state = self.state
        url = state.engines[name].url
        if self.prefix_watch is not None:
            self.prefix_watch.remove(name)
        state.phase_errors.pop(name, None)
        self._admitting.pop(name, None)
        incarnations = self._incarnations.get(document_name(name), [])
        if name in incarnations:
            incarnations.remove(name)
            if not incarnations:
                del self._incarnations[document_name(name)]
        log.info("engine %s left the fleet: %s", name, detail)
        self.record("removed", engine=name, url=url, detail=detail)
        # Out of every table before the first checkpoint; out of placement's roles
        # already (it drained, or never entered).
        await state.forget_engine(name)
        state.placement.notify_released()


async def _close_all(clients: Iterable[EngineClient]) -> None:
    for client in list(clients):
        await client.aclose()


def _append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:  # pragma: no mutate (equivalent: the records are ASCII JSON)
        fh.write(text)
