"""The router's shared state: engine clients, placement, breaker, retry budget, journal."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import httpx
import trio

from narwhal.config import INCARNATION, EngineConfig, FleetConfig
from narwhal.engines.badinput import BadInput
from narwhal.engines.client import EngineClient, EngineIdentity, Tokenized, start_date
from narwhal.engines.connector import RequestKind
from narwhal.engines.kvevents import KVEventSubscriber
from narwhal.errors import BadRequest, EngineError, NotFound
from narwhal.profile.store import Profiles
from narwhal.router.admission import Admission
from narwhal.router.breaker import Breaker
from narwhal.router.cachecal import CacheCalibration
from narwhal.router.cacheplan import CachePlan
from narwhal.router.cacheviews import EventView
from narwhal.router.journal import Journal
from narwhal.router.placement import Placement
from narwhal.router.prefix import PrefixIndex
from narwhal.router.pricing import PricedPlacement
from narwhal.router.promptlen import PromptLengths, prompt_size
from narwhal.router.relay import TokenRelay
from narwhal.router.retry import RetryBudget
from narwhal.tracing import Tracing

__all__ = ["PromptCount", "RouterState", "document_name"]

log = logging.getLogger("narwhal.router")


def document_name(name: str) -> str:
    """The fleet document's name of engine ``name`` (``d0`` of ``d0#2``, a later
    incarnation: an engine replaced at run time is started beside the one it replaces,
    under a name of its own, so that both serve until the new one is ready)."""
    return name.partition(INCARNATION)[0]


@attrs.frozen
class PromptCount:
    """A prompt's length in tokens, and how it was found.

    Attributes:
        count: tokens (exact, or estimated from ``size``).
        max_model_len: the engine's context limit when a /tokenize answer gave it.
        exact: counted by token ids or /tokenize, not estimated.
        size: the prompt's UTF-8 size behind an estimate (0 when exact).
        ids: the prompt's token ids, when known (token-id prompts, /tokenize).
    """

    count: int
    max_model_len: int | None
    exact: bool
    size: int = 0
    ids: tuple[int, ...] | None = None


class RouterState:
    """Everything the request lifecycles share; built once per router."""

    def __init__(
        self,
        config: FleetConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        journal: Journal | None = None,
        profiles: Profiles | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.config = config
        self.clock = clock
        self._transport = transport
        self.engines: dict[str, EngineConfig] = {e.name: e for e in config.engines}
        #: What engines sent that could not be used, per engine and source (every client's
        #: and KV-event subscriber's; ``narwhal_engine_bad_input_total``).
        self.bad_input = BadInput()
        self.clients: dict[str, EngineClient] = {e.name: self._client(e) for e in config.engines}
        #: Engines that are not (or no longer) plainly serving: ``starting`` (added at run
        #: time, waiting for its readiness probe) or ``draining`` (removed: no new
        #: placements, its requests finish). Engines absent here serve.
        self.phase: dict[str, str] = {}
        #: Assigns the placement roles of the engines in placement (reactive control
        #: replaces it); by default every engine takes every role it permits.
        self.assign_roles: Callable[[list[EngineConfig]], tuple[list[str], list[str]]] = _permitted_roles
        rec = config.recovery
        prefill = [e.name for e in config.engines if e.can_prefill]
        decode = [e.name for e in config.engines if e.can_decode]
        roles = {"prefill": prefill, "decode": decode}  # pragma: no mutate (equivalent: the breaker reads each role's engines, never its name)
        self.breaker = Breaker(
            list(self.engines),
            eject_after=rec.eject_after,
            quarantine_s=rec.failure_quarantine_s,
            probe_interval_s=rec.probe_interval_s,
            roles=roles,
            clock=clock,
        )
        self.profiles = profiles
        self.placement: Placement
        # What the document declares; engines that declare nothing are learned (refresh_models).
        declared = {e.name: [e.model] for e in config.engines if e.model is not None}
        if profiles is not None:
            ctl = config.controller
            self.placement = PricedPlacement(
                prefill, decode, profiles={}, slo=ctl.slo, admission=ctl.admission,
                available=self.placeable, clock=clock, pricing=ctl.pricing, models=declared,
                admission_bound=ctl.admission_bound, retry_after_s=self.breaker.retry_after_s,
            )  # fmt: skip
        else:
            self.placement = Placement(
                prefill, decode, available=self.placeable, models=declared, retry_after_s=self.breaker.retry_after_s
            )
        budget = rec.retry_budget
        self.retry_budget = RetryBudget(
            ratio=budget.ratio,
            min_retries_per_s=budget.min_retries_per_s,
            window_s=budget.window_s,
            clock=clock,
        )
        self.journal = journal if journal is not None else Journal(
            config.journal.path, queue_size=config.journal.queue_size, fsync=config.journal.fsync
        )
        #: model name -> max_model_len (the smallest its engines report; None until one
        #: does): the models ``/v1/models`` lists, the document's first.
        self.models: dict[str, int | None] = dict.fromkeys(self.placement.model_names())
        #: engine name -> {model: max_model_len} from the engine's last /v1/models answer.
        self._reported: dict[str, dict[str, int | None]] = {}
        #: model -> how many engines reported each max_model_len for it (the smallest is
        #: the model's), and what each engine's report counts there: kept per engine, so
        #: that an engine joining or leaving costs its own models, not a walk of the fleet.
        self._limits: dict[str, collections.Counter[int]] = {}
        self._counted: dict[str, dict[str, int]] = {}
        #: Carries streamed tokens off the event loop (None: ``server.token_relay: "loop"``).
        self.relay = TokenRelay() if config.server.token_relay == "thread" else None
        self.in_flight = 0
        self.in_flight_by_engine: dict[str, int] = dict.fromkeys(self.engines, 0)
        mode = config.controller.prompt_tokens
        #: Whether text prompts are counted by a producer's /tokenize (else estimated).
        self.exact_prompt_counts = mode == "tokenize" or (
            mode == "auto" and isinstance(self.placement, PricedPlacement)
        )
        self.prompt_lengths = PromptLengths()
        #: Per model when the fleet serves several: each has its own tokenizer.
        self._prompt_lengths: dict[str, PromptLengths] = {}
        #: What each engine's prefix cache holds (kept by ``PrefixWatch``).
        self.prefix = PrefixIndex()
        #: Whether the predicted hits materialize, per engine (:mod:`narwhal.router.cachecal`).
        self.cache_cal = CacheCalibration()
        #: Where prefixes and sessions live (:mod:`narwhal.router.cacheplan`); with priced
        #: placement and the prefix index only.
        self.cache_plan: CachePlan | None = None
        if isinstance(self.placement, PricedPlacement) and config.controller.prefix_cache == "auto":
            self.cache_plan = self.placement.cache_plan = CachePlan(self.prefix, self.placement.prefill_s, clock)
        self.kv_subscribers: dict[str, KVEventSubscriber] = {}
        #: Why an engine is still ``starting`` (its last readiness probe), for /health.
        self.phase_errors: dict[str, str] = {}
        #: Spans of requests and probes (None: tracing is off); set by the router.
        self.tracing: Tracing | None = None
        #: Tenants, classes, limits and the wait queue (the router sets its store).
        self.admission = Admission(config, self.placement, clock=clock)

    def _client(self, e: EngineConfig) -> EngineClient:
        return EngineClient(
            e.url,
            name=e.name,
            model=e.model,
            connector=e.connector,
            api_key=e.api_key,
            transport=self._transport,
            connect_timeout_s=self.config.engine.connect_timeout_s,
            url_in_errors=self.config.server.engine_urls_in_errors,
            limits=self.config.engine_limits,
            bad_input=self.bad_input,
        )

    # ------------------------------------------------------------ a changing fleet

    def members(self) -> list[EngineConfig]:
        """The engines placement may use: those serving, and a draining engine while a
        role of it would be left empty: no serving engine has the role, or none of a
        model it serves that the fleet still serves (the document declares it, or an
        engine not draining serves it). Linear in the engines."""
        phases = self.phase
        if "draining" not in phases.values():  # (most of the time: nothing to hold)
            return [e for e in self.engines.values() if e.name not in phases]
        models = self.placement.models
        covered: set[tuple[str, str]] = set()  # (role, model) some serving engine takes
        roles: set[str] = set()  # roles some serving engine takes
        unknown: set[str] = set()  # roles of serving engines whose model is not known yet
        wanted = set(self.config.models)  # models the fleet still serves
        for e in self.engines.values():
            phase = self.phase.get(e.name)
            served = models.get(e.name)
            if phase != "draining" and served is not None:
                wanted.update(served)
            if phase is None:
                roles.update(e.roles)
                for role in e.roles:
                    if served is None:
                        unknown.add(role)
                    else:
                        covered.update((role, m) for m in served)
        # An engine of an unknown model takes requests while the fleet serves one model.
        anyone = set() if self.placement.several_models else unknown

        def held(e: EngineConfig) -> bool:
            if any(role not in roles for role in e.roles):
                return True
            served = models.get(e.name, ())
            return any(
                role not in anyone and (role, m) not in covered for role in e.roles for m in served if m in wanted
            )

        out = []
        for e in self.engines.values():
            phase = self.phase.get(e.name)
            if phase is None or (phase == "draining" and held(e)):
                out.append(e)
        return out

    def refresh_roles(self) -> None:
        """Recompute placement's engines of each role (and the breaker's) after a change."""
        members = self.members()
        permitted_prefill, permitted_decode = permitted = _permitted_roles(members)
        prefill, decode = permitted if self.assign_roles is _permitted_roles else self.assign_roles(members)
        self.placement.set_roles(prefill, decode)
        roles = {"prefill": permitted_prefill, "decode": permitted_decode}  # pragma: no mutate (equivalent: as in __init__)
        self.breaker.set_roles(roles)
        self.placement.notify_released()

    def new_client(self, engine: EngineConfig) -> EngineClient:
        """A client for ``engine`` (made before a change applies: what can fail, fails
        before anything changed)."""
        return self._client(engine)

    def add_engine(
        self, engine: EngineConfig, *, phase: str | None = "starting", client: EngineClient | None = None
    ) -> None:
        """Know ``engine`` (its client, breaker state, load); ``phase`` ``starting`` keeps
        it out of placement until :meth:`refresh_roles` follows a readiness probe.

        Args:
            engine: the engine, under its name in the router.
            phase: ``starting``, or None (it serves at once).
            client: its client, made beforehand by :meth:`new_client` (default: made here,
                before anything else changes).
        """
        name = engine.name
        if name in self.engines:
            raise ValueError(f"engine {name} is already in the fleet")
        client = client if client is not None else self._client(engine)
        self.engines[name] = engine
        self.clients[name] = client
        self.breaker.add(name)
        self.placement.add_engine(name)
        self.in_flight_by_engine[name] = 0
        if phase is not None:
            self.phase[name] = phase
        self._recompute_models([name])

    def busy(self, name: str) -> bool:
        """Whether a request (reservation, leg, token count) still uses ``name``."""
        return not self.placement.idle(name) or self.in_flight_by_engine[name] > 0

    async def forget_engine(self, name: str) -> None:
        """Drop a drained engine from every table (at once, before any checkpoint) and
        close its connections."""
        self.phase.pop(name, None)
        self.engines.pop(name, None)
        client = self.clients.pop(name, None)
        self.breaker.remove(name)
        self.placement.remove_engine(name)
        self.in_flight_by_engine.pop(name, None)
        self._reported.pop(name, None)
        self._recompute_models([name])
        self.prefix.forget(name)
        if client is not None:
            await client.close_connections()

    def placeable(self, name: str) -> bool:
        """Whether placement may use ``name`` now: the breaker lets it, and an engine on
        trial (readmitted half-open) has no other live request."""
        breaker = self.breaker
        if not breaker.available(name):
            return False
        return not breaker.on_trial(name) or self.placement.idle(name)

    @property
    def default_model(self) -> str | None:
        """The model of a request that names none: the fleet's only one (None with several)."""
        return next(iter(self.models)) if len(self.models) == 1 else None

    def model_of(self, requested: str | None) -> str | None:
        """The model a request is served by: its own, or the fleet's only one.

        Raises:
            NotFound: The fleet does not serve the model it names (the message lists them).
            BadRequest: It names none and the fleet serves several.
        """
        models = self.models
        if requested is None:
            if len(models) > 1:
                raise BadRequest(
                    f"'model' is required: this router serves several models ({_listing(models)})",
                    code="model_required",
                )
            return self.default_model
        if models and requested not in models:
            raise NotFound(
                f"model '{requested}' does not exist (served: {_listing(models)})", code="model_not_found"
            )
        return requested

    def ready(self) -> bool:
        """At least one engine can prefill and one can decode."""
        return self.unready_reason() is None

    def engine_state(self, name: str) -> str:
        """The breaker's word for the engine: ``ok``, ``trial``, ``quarantined`` or
        ``ejected`` (out until a readmission probe succeeds); or the fleet's: ``starting``
        (added, waiting for its readiness probe) or ``draining`` (removed, finishing its
        requests)."""
        return self.phase.get(name) or self.breaker.status(name)

    def health(self, *, detail: bool) -> dict[str, Any]:
        """The ``/health`` body: ready or not (and why), each engine's state; with
        ``detail`` (the admin surface) each engine's URL and last error too."""
        reason = self.unready_reason()
        engines: dict[str, Any] = {}
        for name, engine in self.engines.items():
            st = self.engine_state(name)
            if detail:
                last = self.phase_errors.get(name) or self.breaker.states[name].last_error
                engines[name] = {"state": st, "url": engine.url, "error": last if st != "ok" else None}
                placement = self.placement
                if isinstance(placement, PricedPlacement):
                    why = placement.unbound.get(name, "its profile is not bound yet")
                    engines[name]["pricing"] = "profile" if name in placement.profiles else f"load ({why})"
                kv = self.kv_events_status(name)
                if kv is not None:
                    engines[name]["kv_events"] = kv
            else:
                engines[name] = st
        body: dict[str, Any] = {"status": "ready" if reason is None else "unavailable"}
        if reason is not None:
            body["reason"] = reason
        body["engines"] = engines
        if len(self.models) > 1:  # the router is ready while any model is: say which are not
            body["models"] = {m: "ready" if r is None else r for m, r in self.model_readiness().items()}
        return body

    def prefix_cache_status(self, name: str) -> dict[str, Any] | None:
        """What the router knows of engine ``name``'s prefix cache (None: no view): its
        view, blocks and capacity, whether its predicted hits materialize, and what the
        cache plan gives it (``/fleet``)."""
        index = self.prefix
        view = index.view(name)
        if view is None or not index.enabled(name):
            return None
        out: dict[str, Any] = {
            "view": "events" if isinstance(view, EventView) else "placements",
            "blocks": len(view),
            "capacity_blocks": index.capacity_blocks.get(name),
        }
        if isinstance(view, EventView):
            out["overflow_evicted"] = view.overflow_evicted
        else:
            out["held_blocks"] = view.held
        out.update(self.cache_cal.status(name))
        if self.cache_plan is not None and name in self.placement.prefill_engines:
            out["plan"] = self.cache_plan.status(name)
        return out

    def kv_events_status(self, name: str) -> dict[str, Any] | None:
        """How engine ``name``'s KV events arrive (None: they are not followed): ``live``,
        or ``stale`` with the likely cause (its hits are then priced approximately)."""
        sub = self.kv_subscribers.get(name)
        if sub is None:
            return None
        return {"state": "live" if sub.stale is None else "stale", "detail": sub.stale,
                "delivered": sub.delivered, "probe_gaps": sub.probe_gaps}  # fmt: skip

    def unready_reason(self) -> str | None:
        """Why the router cannot serve now (None: it can serve at least one model)."""
        reasons = self.model_readiness()
        if any(r is None for r in reasons.values()):
            return None
        if len(reasons) == 1:
            return next(iter(reasons.values()))
        return "; ".join(f"model {m!r}: {r}" for m, r in reasons.items())

    def model_readiness(self) -> dict[str | None, str | None]:
        """Per model, why it cannot be served now (None: it can); one ``None`` key when the
        fleet's model is not known yet."""
        avail = self.breaker.available
        placement = self.placement
        out: dict[str | None, str | None] = {}
        models: list[str | None] = [*self.models] or [None]
        for model in models:
            missing = [
                role for role, names in (("prefill", placement.prefill_engines), ("decode", placement.decode_engines))
                if not any(avail(n) and placement.serves(n, model) for n in names)
            ]  # fmt: skip
            out[model] = f"no engine can {' or '.join(missing)} now" if missing else None
        return out

    async def count_prompt(self, parsed_body: dict[str, Any], kind: RequestKind) -> PromptCount:
        """The prompt's length for placement: exact, or estimated (``controller.prompt_tokens``)."""
        prompt = parsed_body.get("prompt") if kind == "completions" else None
        if isinstance(prompt, list):  # token ids: counted here, exactly
            ids = tuple(prompt) if all(type(t) is int for t in prompt) else None
            return PromptCount(len(prompt), None, exact=True, ids=ids)
        if self.exact_prompt_counts:
            tok = await self.tokenize(parsed_body, kind)
            return PromptCount(tok.count, tok.max_model_len, exact=True, ids=tok.ids)
        size = prompt_size(parsed_body, kind)
        estimate = self.prompt_lengths_for(parsed_body.get("model")).estimate(kind, size)
        return PromptCount(estimate, None, exact=False, size=size)

    def prompt_lengths_for(self, model: str | None) -> PromptLengths:
        """The tokens-per-byte estimator of ``model``'s tokenizer (one per served model)."""
        if model is None or len(self.models) <= 1:
            return self.prompt_lengths
        return self._prompt_lengths.setdefault(model, PromptLengths())

    async def tokenize(self, parsed_body: dict[str, Any], kind: RequestKind) -> Tokenized:
        """Count the prompt's tokens with a producer's ``/tokenize``.

        The least-loaded available producer answers; when it fails with a transient
        engine fault the next one is asked (the failure counts towards its breaker).
        """
        placement = self.placement
        loads = placement.loads
        model = parsed_body.get("model")
        candidates = sorted(
            (n for n in placement.prefill_engines if self.breaker.available(n) and placement.serves(n, model)),
            key=lambda n: loads[n].prefill_tokens,
        )
        if not candidates:
            raise placement.no_engine("prefill", model)
        for i, name in enumerate(candidates):
            client = self.clients[name]
            self.in_flight_by_engine[name] += 1
            try:
                if kind == "chat":
                    return await client.tokenize(messages=parsed_body["messages"], model=model)
                return await client.tokenize(parsed_body["prompt"], model=model)
            except EngineError as err:
                err.engine = name
                err.leg = "prefill"
                if err.engine_fault:  # a prompt the engine rejects is the client's fault
                    self.breaker.record_failure(name, f"tokenize: {err.message}")
                if not err.transient or i == len(candidates) - 1:
                    raise
            finally:
                self.in_flight_by_engine[name] -= 1
                self.placement.notify_released()
        raise AssertionError("unreachable")  # pragma: no mutate (equivalent: never reached, the last candidate's failure is raised)

    async def refresh_models(self, names: Iterable[str] | None = None) -> None:
        """Ask engines (default: every one) which models they serve, with each model's
        ``max_model_len`` (best effort: an engine that does not answer keeps what is known).

        An engine serves its declared model and whatever it lists (served-model aliases,
        adapters); one that declares none is placed by what it lists from now on.
        """

        async def one(name: str) -> None:
            try:
                with trio.move_on_after(self.config.engine.connect_timeout_s):
                    listed = await self.clients[name].models()
                    if name not in self.clients:  # it left the fleet meanwhile: its listing is no limit
                        return
                    self._reported[name] = {
                        m["id"]: m.get("max_model_len") if type(m.get("max_model_len")) is int else None
                        for m in listed
                        if isinstance(m, dict) and isinstance(m.get("id"), str)
                    }
            except Exception:
                return

        async with trio.open_nursery() as nursery:
            for name in self.engines if names is None else names:
                if name in self.clients:
                    nursery.start_soon(one, name)
        asked = list(self.engines) if names is None else list(names)
        for name in asked:
            declared = self.engines[name].model if name in self.engines else None
            listed = self._reported.get(name)
            if declared is not None and listed and declared not in listed:
                log.warning(
                    "engine %s is declared to serve model %r but lists %s", name, declared, _listing(listed)
                )
        self._recompute_models(None if names is None else asked)

    def _recompute_models(self, names: Iterable[str] | None = None) -> None:
        """Placement's engine-to-models index and ``models`` (with each one's smallest
        ``max_model_len``) from the declared models and the engines' last listings: of
        every engine, or of ``names`` only (an engine added, asked or gone), in time
        proportional to their models, and ``models`` rebuilt only when a model came or
        went or its limit changed."""
        if names is None:
            self._limits.clear()
            self._counted.clear()
            names = [*self.engines, *self._reported]
        changed = False
        for name in names:
            changed |= self._index_models(name)
        if changed or self.placement.served_models != self.models.keys():
            self.models = {
                m: min(self._limits[m]) if m in self._limits else None for m in self.placement.model_names()
            }

    def _index_models(self, name: str) -> bool:
        """Index engine ``name``'s models (declared and listed) and limits (none when it
        left the fleet); whether a model's limit changed."""
        engine = self.engines.get(name)
        listed = self._reported.get(name, {}) if engine is not None else {}
        declared = [engine.model] if engine is not None and engine.model else []
        self.placement.set_models(name, [*declared, *listed])
        before = self._counted.pop(name, {})
        # A request may land on any engine of its model: the smallest limit holds.
        counted = {model: mml for model, mml in listed.items() if mml is not None}
        if counted == before:
            if counted:
                self._counted[name] = counted
            return False
        touched = before.keys() | counted.keys()
        was = {m: min(self._limits[m]) for m in touched if m in self._limits}
        for model, mml in before.items():
            limits = self._limits[model]
            limits[mml] -= 1
            if not limits[mml]:
                del limits[mml]
            if not limits:
                del self._limits[model]
        for model, mml in counted.items():
            self._limits.setdefault(model, collections.Counter())[mml] += 1
        if counted:
            self._counted[name] = counted
        return any(was.get(m) != (min(self._limits[m]) if m in self._limits else None) for m in touched)

    async def bind_profiles(self, names: list[str] | None = None) -> dict[str, str]:
        """Price an engine only while its profile binds to the generation running now.

        A later incarnation of an engine (``d0#2``, a replacement) is priced by its
        document name's profile (``d0``) when that binds to the generation running there.

        Returns the engines asked that were left unpriced, with the reason (also logged).
        """
        placement = self.placement
        if self.profiles is None or not isinstance(placement, PricedPlacement):
            return {}
        profiles = self.profiles

        async def one(name: str) -> None:
            if name not in self.clients:  # it left the fleet meanwhile
                return
            profile = profiles.engines.get(document_name(name))
            if profile is None:
                placement.profiles.pop(name, None)
                placement.unbound[name] = "no accepted profile"
                return
            try:
                with trio.fail_after(self.config.engine.first_token_timeout_s):
                    live = await self.clients[name].identity()
            except (EngineError, trio.TooSlowError) as exc:
                placement.profiles.pop(name, None)
                placement.unbound[name] = f"identity unavailable: {exc}"
                return
            if name not in self.clients:
                return
            if live != profile.identity:
                placement.profiles.pop(name, None)
                placement.unbound[name] = (
                    f"profile bound to another engine generation ({_generation_change(profile.identity, live)}): "
                    "re-profile or refit"
                )
                return
            placement.bind(name, profile)

        asked = names if names is not None else list(self.engines)
        async with trio.open_nursery() as nursery:
            for name in asked:
                nursery.start_soon(one, name)
        unbound = {name: placement.unbound[name] for name in asked if name in placement.unbound}
        for name, reason in unbound.items():
            log.warning("engine %s is placed by load only: %s", name, reason)
        return unbound

    async def aclose(self) -> None:
        if self.relay is not None:
            await self.relay.aclose()
        for client in self.clients.values():
            with trio.move_on_after(5, shield=True):
                await client.aclose()


def _listing(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _permitted_roles(engines: list[EngineConfig]) -> tuple[list[str], list[str]]:
    return [e.name for e in engines if e.can_prefill], [e.name for e in engines if e.can_decode]


def _generation_change(profiled: EngineIdentity, live: EngineIdentity) -> str:
    """What differs between the profiled engine and the one running now."""
    changes = [
        f"{field} {getattr(profiled, field)!r} -> {getattr(live, field)!r}"
        for field in ("url", "model", "version", "max_model_len")
        if getattr(profiled, field) != getattr(live, field)
    ]
    if profiled.process_start_time != live.process_start_time:
        started, running = start_date(profiled.process_start_time), start_date(live.process_start_time)
        changes.append(f"started {started}, running since {running}")
    return "; ".join(changes)
