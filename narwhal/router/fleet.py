"""The live fleet: engines join, drain and leave while the router serves.

A fleet reload (``SIGHUP``, the admin ``PUT /fleet``) and DNS discovery
(:mod:`narwhal.router.discovery`) both hand :meth:`LiveFleet.apply` a whole fleet
document; it compares the engines that document asks for with the engines the router
knows and changes only the difference:

- an **added** engine is ``starting``: known (client, breaker state, load) but out of
  placement until its readiness probe passes (``GET /health`` answers 200, or with
  ``engine_contract`` its identity matches the contract), retried every
  ``recovery.probe_interval_s``. Then it is priced by its profile when one binds to the
  generation running there, else placed by load (``/health`` on the admin port says
  which);
- a **removed** engine is ``draining``: no new placements; the requests it serves
  finish under their own deadlines; then its connections are closed and it is
  forgotten. A role is never left empty by a change: a draining engine keeps taking
  placements while no serving engine has one of its roles (until an added one is
  ready);
- an engine whose roles change keeps serving with its new roles; one whose address or
  any other connection setting (``url``, ``model``, ``api_key``, ``connector``,
  ``kv_events``) changes is **replaced**: drained, then added again under its name;
- settings (deadlines, SLO, recovery, the engine contract, profiles) apply to the
  requests that arrive after the change; requests in flight keep the document they
  arrived under. ``server``, ``journal`` and some controller settings take a restart
  (:data:`RESTART_ONLY`): a document that changes them is refused, as is any document
  that fails validation, and nothing changes.

Every change is one record (``"type": "fleet"``), published on the admin ``/events``
stream and appended to ``<journal>.fleet.jsonl`` beside the request journal (whose
contract is one line per request): ``reload`` (what a document changed, and from
where), ``rejected`` (why, with the JSON path), and per engine ``starting``, ``ready``,
``not_ready`` (its first failed readiness probe), ``draining`` and ``removed``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from narwhal.config import EngineConfig, FleetConfig, redact_setting, unstructure_fleet
from narwhal.errors import ConfigError
from narwhal.profile.store import Profiles
from narwhal.router.controller import ReactiveController
from narwhal.router.prefixwatch import PrefixWatch
from narwhal.router.pricing import PricedPlacement
from narwhal.router.probe import readiness_problem
from narwhal.router.state import RouterState

__all__ = ["RESTART_ONLY", "FleetChange", "LiveFleet"]

log = logging.getLogger("narwhal.router.fleet")

#: Settings that change only with a restart (dotted paths; a prefix covers its fields).
RESTART_ONLY: Final = (
    "server",
    "journal",
    "tracing",  # the exporter and its batch thread are built once, at start
    "controller.prompt_tokens",
    "controller.prefix_cache",
    "controller.reactive.enabled",
    "tenancy.store",  # the connections to it are made once, at start
)

#: Sections that are the fleet's engines, not settings.
_ENGINE_SECTIONS: Final = ("engines", "engine_groups")


@attrs.frozen
class FleetChange:
    """What one applied document changed.

    Attributes:
        source: where the document came from (``SIGHUP``, ``PUT /fleet``, ``dns:<group>``).
        added: engines added (starting until their readiness probe passes).
        removed: engines draining out of the fleet.
        replaced: engines drained and then added again (a connection setting changed).
        roles: engines whose roles changed in place.
        settings: the dotted paths of the settings that changed.
    """

    source: str
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.replaced or self.roles or self.settings)

    def describe(self) -> str:
        """One line: ``added p2; removed d0`` (or ``no change``)."""
        fields = (("added", self.added), ("removed", self.removed), ("replaced", self.replaced),
                  ("roles changed", self.roles), ("settings changed", self.settings))  # fmt: skip
        return "; ".join(f"{what} {', '.join(names)}" for what, names in fields if names) or "no change"

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "added": list(self.added),
            "removed": list(self.removed),
            "replaced": list(self.replaced),
            "roles": list(self.roles),
            "settings": list(self.settings),
        }


def _same_connection(a: EngineConfig, b: EngineConfig) -> bool:
    """Whether ``a`` and ``b`` reach the same engine the same way (roles and the
    simulator block aside)."""
    return attrs.evolve(a, roles=b.roles, sim=b.sim) == b


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out or {prefix: {}}
    return {prefix: obj}


def changed_settings(old: FleetConfig, new: FleetConfig) -> list[tuple[str, Any, Any]]:
    """``(dotted path, old value, new value)`` of every setting that differs (the engines aside)."""
    a, b = unstructure_fleet(old), unstructure_fleet(new)
    for section in _ENGINE_SECTIONS:  # (fields of every document: always there)
        del a[section], b[section]
    fa, fb = _flatten(a), _flatten(b)
    return [(k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]


def _restart_only(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in RESTART_ONLY)


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
        #: Engines draining to be added again with a new configuration (replaced).
        self._readd: dict[str, EngineConfig] = {}
        self._tasks: dict[str, trio.CancelScope] = {}
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
            ConfigError: naming the first such setting's JSON path.
        """
        state = self.state
        for path, old, new in changed_settings(state.config, config):
            if _restart_only(path):
                old, new = redact_setting(path, old), redact_setting(path, new)  # (a key is never quoted)
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
        """Make the router serve ``config`` (see the module docstring).

        Raises:
            ConfigError: the document cannot be applied; nothing changed.
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
        try:
            self.check(config, profiles)
            if self.before_apply is not None:
                await self.before_apply(config)
            desired = self._desired(config)
        except ConfigError as err:
            self.reject(err, source)
            raise
        self._held = []
        began = time.time()
        try:
            change = await self._apply(config, profiles, desired, source)
        finally:
            held, self._held = self._held, None
        if not change.empty:
            self.record("reload", at=began, **change.as_dict())
        for rec in held:
            self._emit(rec)
        if self.after_apply is not None:
            self.after_apply(config)
        return change

    def _desired(self, config: FleetConfig) -> dict[str, EngineConfig]:
        # A role this leaves without an engine (a group that resolves to nothing) keeps
        # its draining engines in placement until one is ready again (RouterState.members).
        desired: dict[str, EngineConfig] = {}
        for e in self.expand(config):
            desired.setdefault(e.name, e)
        return desired

    async def _apply(
        self, config: FleetConfig, profiles: Profiles | None, desired: dict[str, EngineConfig], source: str
    ) -> FleetChange:
        state = self.state
        settings = [path for path, _, _ in changed_settings(state.config, config)]
        old_timeout = state.config.engine.request_timeout_s
        self._apply_settings(config, profiles)
        added: list[str] = []
        removed: list[str] = []
        replaced: list[str] = []
        roles: list[str] = []
        for name in list(state.engines):
            phase = state.phase.get(name)
            new = desired.get(name)
            current = state.engines[name]
            if new is None:
                self._readd.pop(name, None)
                if phase == "starting":
                    await self._forget_starting(name, "removed before it was ready")
                    removed.append(name)
                elif phase != "draining":
                    self._drain(name, old_timeout)
                    removed.append(name)
            elif _same_connection(current, new):
                if phase == "draining":
                    # Wanted again as it is: it serves on (a pending replacement is dropped).
                    self._readd.pop(name, None)  # pragma: no mutate (equivalent: a later drain of it pops or overwrites the entry first; dropped here to keep the table true)
                    self._cancel_task(name)
                    del state.phase[name]
                    self.record("ready", engine=name, url=new.url, detail="wanted again while draining")
                    added.append(name)
                if current.roles != new.roles:
                    roles.append(name)
                state.engines[name] = new
            elif phase == "starting":
                await self._forget_starting(name, "replaced before it was ready")
                self._add(new)
                replaced.append(name)
            else:
                if phase != "draining":
                    self._drain(name, old_timeout)
                self._readd[name] = new
                replaced.append(name)
        for name, new in desired.items():
            if name not in state.engines:
                self._add(new)
                added.append(name)
        state.refresh_roles()
        return FleetChange(source, tuple(added), tuple(removed), tuple(replaced), tuple(roles), tuple(settings))

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

    def _add(self, engine: EngineConfig) -> None:
        self.state.add_engine(engine)  # starting: placed once its readiness probe passes
        self.record("starting", engine=engine.name, url=engine.url, roles=list(engine.roles))
        self._spawn(engine.name, self._ready)

    def _drain(self, name: str, timeout_s: float) -> None:
        state = self.state
        state.phase[name] = "draining"
        self.record("draining", engine=name, url=state.engines[name].url, in_flight=state.in_flight_by_engine[name])
        self._spawn(name, lambda n: self._drained(n, timeout_s))

    def _spawn(self, name: str, body: Callable[[str], Any]) -> None:
        # The only task a name has here is the drain re-adding it, which ends now.
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
        """Probe an added engine until it is ready, then put it in placement."""
        state = self.state
        failed = False  # pragma: no mutate (equivalent: None is as false)
        while True:
            problem = await readiness_problem(state, name)
            if problem is None:
                break
            state.phase_errors[name] = problem
            if not failed:
                failed = True
                log.warning("engine %s is not ready yet: %s (probed again every %g s)",
                            name, problem, state.config.recovery.probe_interval_s)  # fmt: skip
                self.record("not_ready", engine=name, detail=problem)
            await trio.sleep(state.config.recovery.probe_interval_s)
        state.phase_errors.pop(name, None)
        await state.refresh_models([name])
        unbound = await state.bind_profiles([name])
        if self.prefix_watch is not None:
            await self.prefix_watch.add(name)
        if state.phase.get(name) != "starting":
            return
        del state.phase[name]
        state.refresh_roles()
        pricing = "profile" if isinstance(state.placement, PricedPlacement) and name not in unbound else "load"
        detail = unbound.get(name)
        log.info("engine %s is ready: in placement (%s)", name, pricing if detail is None else f"{pricing}: {detail}")
        self.record("ready", engine=name, url=state.engines[name].url, pricing=pricing, detail=detail)

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
        readd = self._readd.pop(name, None)
        if readd is not None:
            self._add(readd)

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
        await state.forget_engine(name)
        state.refresh_roles()
        log.info("engine %s left the fleet: %s", name, detail)
        self.record("removed", engine=name, url=url, detail=detail)


def _append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:  # pragma: no mutate (equivalent: the records are ASCII JSON)
        fh.write(text)
