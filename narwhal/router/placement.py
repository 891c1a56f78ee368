"""Choosing a (producer, consumer) pair and holding phase reservations.

Placement here is least reserved load: the producer with the fewest prompt tokens
reserved for prefill, the consumer with the fewest decode reservations (then resident
KV tokens). Only engines that serve the request's model are candidates, producer and
consumer alike (:meth:`Placement.serves`; :attr:`Placement.models` is the one index of
which engine serves which model). Engines the breaker keeps out (ejected, quarantined,
on trial with a request already in flight) are skipped; engines
that failed an earlier attempt of the same request are avoided while others remain.
When one engine is best for both roles, the request decodes on the same worker. When
no engine of a role is left (every one ejected), the request is refused at once with
:class:`~narwhal.errors.NoEngine`, its ``Retry-After`` the time until one may be back
(the breaker's :meth:`~narwhal.router.breaker.Breaker.retry_after_s`).

Load placed by others (replicas, workers of ``--workers``, clients that bypass the
router) is known only from what the engines report (:mod:`narwhal.router.loadpoll`).
The combined view of an engine is this router's own reservations, counted the moment
they are made, plus the others' share: the requests the engine last reported running
and waiting minus this router's legs it was serving then (:meth:`Placement.engine_reported`).
vLLM reports requests, not queued prompt tokens, so the others' requests are weighed
in tokens by the mean size of this router's own requests (replicas behind one load
balancer see the same traffic mix). On an engine that both prefills and decodes, the
others' waiting requests count as prefills and the rest as decodes.

A :class:`Reservation` is owned by one request attempt; the prefill part is released
when the prefill leg completes, the decode part when the stream ends, and
:meth:`Reservation.release` (idempotent) releases whatever is left.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

import attrs
import trio

from narwhal.errors import NoEngine
from narwhal.router.cacheplan import PlanTicket
from narwhal.router.sharedkv import HeldChain

if TYPE_CHECKING:
    from narwhal.config import SLOConfig

__all__ = ["MEAN_WEIGHT", "EngineLoad", "Placement", "Reservation", "Room"]

#: Weight of the newest request in the moving means of request sizes.
MEAN_WEIGHT = 0.05


@attrs.frozen
class Room:
    """What placing a request must leave for others: its latency class's rule (priced
    placement keeps it, :meth:`narwhal.router.pricing.PricedPlacement.choose_for`).

    Attributes:
        ttft_s: the strictest TTFT target of the classes more urgent than its own: the
            producer's queue with it stays within
            :data:`~narwhal.router.pricing.YIELD_SHARE` of it (None: no class is).
        tpot_s: their strictest TPOT target: the consumer's TPOT with it stays within it.
        hold: the request may wait in the router: it is placed only where its prefill
            starts within about one prefill (the producer's queue ahead of it no longer
            than its own prefill), so that the engines' queues stay short and the router's
            queue, in priority and fair order, holds the rest.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    hold: bool = False


@attrs.define
class EngineLoad:
    """Reserved load on one engine.

    Attributes:
        prefill_requests: prefill legs reserved and not yet complete.
        prefill_tokens: prompt tokens of those legs.
        decode_requests: decode streams reserved.
        decode_kv_tokens: KV tokens those streams will hold (prompt + output limit).
        engine_running: requests the engine itself last reported running (all routers').
        engine_waiting: requests the engine itself last reported waiting.
        engine_own: this router's legs on the engine when it reported (part of the above).
    """

    prefill_requests: int = 0
    prefill_tokens: int = 0
    decode_requests: int = 0
    decode_kv_tokens: int = 0
    engine_running: int = 0
    engine_waiting: int = 0
    engine_own: int = 0

    @property
    def others(self) -> int:
        """Requests on the engine that others placed, as of its last report."""
        return max(0, self.engine_running + self.engine_waiting - self.engine_own)


#: Why a pair was chosen, for the journal: its JSON object, or a function that writes
#: it (priced placement words it when the journal writes the record, after the response).
Explanation = dict[str, Any] | Callable[[], dict[str, Any]]


class Reservation:
    """The phase reservations of one attempt."""

    __slots__ = (
        "_open",
        "_placement",
        "consumer",
        "decode_held",
        "explain",
        "kv_tokens",
        "on_release_decode",
        "on_release_prefill",
        "predicted_tpot_s",
        "predicted_ttft_s",
        "predicted_work_s",
        "prefill_held",
        "producer",
        "prompt_tokens",
    )

    def __init__(self, placement: Placement, producer: str, consumer: str, prompt_tokens: int, kv_tokens: int) -> None:
        self._placement = placement
        self.producer = producer
        self.consumer = consumer
        self.prompt_tokens = prompt_tokens
        self.kv_tokens = kv_tokens
        self.prefill_held = True
        self.decode_held = True
        self._open = True
        #: Called once when the prefill's hold ends, with whether its prefill completed.
        self.on_release_prefill: Callable[[bool], None] | None = None
        self.on_release_decode: Callable[[], None] | None = None
        self.predicted_ttft_s: float | None = None
        self.predicted_tpot_s: float | None = None
        #: Why the pair was chosen (priced placement's account, for the journal).
        self.explain: Explanation | None = None
        #: The producer's predicted prefill seconds for the request (priced placement).
        self.predicted_work_s: float | None = None
        p = placement.loads[producer]
        p.prefill_requests += 1
        p.prefill_tokens += prompt_tokens
        c = placement.loads[consumer]
        c.decode_requests += 1
        c.decode_kv_tokens += kv_tokens
        placement.open_reservations += 1
        placement.observe(prompt_tokens, kv_tokens)

    @property
    def same_worker(self) -> bool:
        return self.producer == self.consumer

    def release_prefill(self, done: bool = False) -> None:
        """The prefill's hold ends: ``done``, its prefill completed (else it failed or
        was given up)."""
        if self.prefill_held:
            self.prefill_held = False
            placement = self._placement
            p = placement.loads[self.producer]
            p.prefill_requests -= 1
            p.prefill_tokens -= self.prompt_tokens
            if self.on_release_prefill is not None:
                self.on_release_prefill(done)
            if placement._released is not None:
                placement.notify_released()

    def release_decode(self) -> None:
        if self.decode_held:
            self.decode_held = False
            placement = self._placement
            c = placement.loads[self.consumer]
            c.decode_requests -= 1
            c.decode_kv_tokens -= self.kv_tokens
            if self.on_release_decode is not None:
                self.on_release_decode()
            if placement._released is not None:
                placement.notify_released()

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()
        if self._open:
            self._open = False
            self._placement.open_reservations -= 1

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Placement:
    """Least-reserved-load placement over the fleet's engines."""

    def __init__(
        self,
        prefill_engines: Sequence[str],
        decode_engines: Sequence[str],
        *,
        available: Callable[[str], bool] = lambda name: True,
        models: Mapping[str, Iterable[str]] | None = None,
        retry_after_s: Callable[[Sequence[str]], float] = lambda names: 1.0,
    ) -> None:
        self.prefill_engines = list(prefill_engines)
        self.decode_engines = list(decode_engines)
        self.available = available
        #: Seconds until one of the engines named (a role's, all out) may be back.
        self.retry_after_s = retry_after_s
        self.loads: dict[str, EngineLoad] = {
            name: EngineLoad() for name in dict.fromkeys([*prefill_engines, *decode_engines])
        }
        self.open_reservations = 0
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        #: The models each engine serves (declared, or learned from its /v1/models);
        #: an engine absent here is not known yet (see :meth:`serves`).
        self.models: dict[str, frozenset[str]] = {}
        #: How many engines serve each model (kept as engines come and go: a fleet change
        #: of N engines costs N small updates, not N walks over the fleet).
        self._serving: dict[str, int] = {}
        self._several = False
        for name, served in (models or {}).items():
            self.set_models(name, served)

        #: Set when a reservation is released, for whoever waits (draining engines).
        self._released: trio.Event | None = None

        #: Moving means of this router's own requests: prompt tokens, and KV tokens a
        #: decode reserves (prompt + output limit); they weigh the others' requests.
        self.mean_prompt_tokens = 0.0
        self.mean_kv_tokens = 0.0

    def set_models(self, name: str, served: Iterable[str]) -> None:
        """Record the models engine ``name`` serves (an empty set: not known)."""
        served = frozenset(served)
        before = self.models.get(name, frozenset())
        if served:
            self.models[name] = served
        else:
            self.models.pop(name, None)
        counts = self._serving
        for model in before - served:
            counts[model] -= 1
            if not counts[model]:
                del counts[model]
        for model in served - before:
            counts[model] = counts.get(model, 0) + 1
        self._several = len(counts) > 1

    @property
    def served_models(self) -> Set[str]:
        """The models some engine serves (unordered; :meth:`model_names` orders them)."""
        return self._serving.keys()

    @property
    def several_models(self) -> bool:
        """Whether engines serve more than one model."""
        return self._several

    def model_names(self) -> list[str]:
        """Every model some engine serves, in the order the engines were recorded."""
        return list(dict.fromkeys(m for served in self.models.values() for m in sorted(served)))

    def serves(self, name: str, model: str | None) -> bool:
        """Whether ``name`` may take a request for ``model`` (None: the fleet's only one).

        An engine whose model is not known yet takes requests only while the fleet
        serves one model at most; among several it could only be guessed.
        """
        served = self.models.get(name)
        if served is None:
            return not self._several
        return model is None or model in served

    def of_model(self, model: str | None) -> str:
        """`` of model 'x'`` in a refusal, when the fleet serves several."""
        return f" of model {model!r}" if self._several and model is not None else ""

    def no_engine(self, role: str, model: str | None) -> NoEngine:
        """The refusal of a request that finds no engine for ``role`` (``prefill`` or
        ``decode``) serving ``model`` in placement; its ``Retry-After`` is when one of the
        role's engines may be back."""
        names = self.prefill_engines if role == "prefill" else self.decode_engines
        out = [n for n in names if self.serves(n, model)]
        return NoEngine(
            f"no engine{self.of_model(model)} available for {role}", retry_after_s=self.retry_after_s(out)
        )

    def set_roles(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        """The engines placement may choose for each role, from now on (a fleet change or
        reactive control's role move)."""
        loads = self.loads
        for name in (*prefill, *decode):
            if name not in loads:  # (a method call per engine of a large fleet costs)
                self.add_engine(name)
        self.prefill_engines = list(prefill)
        self.decode_engines = list(decode)

    def add_engine(self, name: str) -> None:
        """Keep load for ``name`` (no role yet: :meth:`set_roles` gives it one)."""
        self.loads.setdefault(name, EngineLoad())

    def remove_engine(self, name: str) -> None:
        """Forget ``name``; it has no role and no reservation left (it drained)."""
        if name in self.prefill_engines or name in self.decode_engines:
            raise ValueError(f"engine {name} still has a role in placement")
        self.loads.pop(name, None)
        self.set_models(name, ())

    def notify_released(self) -> None:
        """A reservation (or another use of an engine) ended: wake :meth:`wait_released`."""
        if self._released is not None:
            self._released.set()
            self._released = None

    async def wait_released(self) -> None:
        """Wait until the next reservation is released."""
        if self._released is None:
            self._released = trio.Event()
        await self._released.wait()

    def observe(self, prompt_tokens: int, kv_tokens: int) -> None:
        """Fold one placed request into the moving means."""
        if self.mean_kv_tokens == 0.0:
            self.mean_prompt_tokens, self.mean_kv_tokens = float(prompt_tokens), float(kv_tokens)
            return
        self.mean_prompt_tokens += MEAN_WEIGHT * (prompt_tokens - self.mean_prompt_tokens)
        self.mean_kv_tokens += MEAN_WEIGHT * (kv_tokens - self.mean_kv_tokens)

    def engine_reported(self, name: str, running: int, waiting: int, own: int) -> None:
        """What the engine reports it runs and queues, and this router's legs on it then."""
        load = self.loads.get(name)
        if load is None:  # not (or no longer) an engine of this placement
            return
        load.engine_running, load.engine_waiting, load.engine_own = running, waiting, own

    def others_prefill(self, name: str) -> int:
        """Prefills others placed on ``name`` (as of its last report)."""
        load = self.loads[name]
        if name in self.decode_engines:  # both roles: what waits is prefill work
            return min(load.others, load.engine_waiting)
        return load.others

    def others_decode(self, name: str) -> int:
        """Decode streams others placed on ``name`` (as of its last report)."""
        load = self.loads[name]
        if name in self.prefill_engines:
            return load.others - min(load.others, load.engine_waiting)
        return load.others

    def idle(self, name: str) -> bool:
        """No reservation of this router holds the engine."""
        load = self.loads[name]
        return load.prefill_requests == 0 and load.decode_requests == 0

    def _pick(
        self,
        role: str,
        names: Iterable[str],
        avoid: frozenset[str],
        key: Callable[[str], tuple[float, ...]],
        model: str | None = None,
    ) -> str | None:
        live = [n for n in names if self.available(n) and self.serves(n, model)]
        preferred = [n for n in live if n not in avoid] or live
        if not preferred:
            return None
        # Rotate before the stable sort so that ties spread across engines.
        k = next(self._rr[role]) % len(preferred)
        rotated = preferred[k:] + preferred[:k]
        return min(rotated, key=key)

    def choose(
        self, prompt_tokens: int, max_tokens: int, *, avoid: frozenset[str] = frozenset(), model: str | None = None
    ) -> Reservation:
        """Reserve the best (producer, consumer) pair serving ``model`` or raise :class:`NoEngine`."""
        loads = self.loads

        def prefill_load(n: str) -> tuple[float, ...]:
            others = self.others_prefill(n)
            return loads[n].prefill_tokens + others * self.mean_prompt_tokens, loads[n].prefill_requests + others

        def decode_load(n: str) -> tuple[float, ...]:
            others = self.others_decode(n)
            return loads[n].decode_requests + others, loads[n].decode_kv_tokens + others * self.mean_kv_tokens

        producer = self._pick("prefill", self.prefill_engines, avoid, prefill_load, model)
        if producer is None:
            raise self.no_engine("prefill", model)
        consumer = self._pick("decode", self.decode_engines, avoid, decode_load, model)
        if consumer is None:
            raise self.no_engine("decode", model)
        return Reservation(self, producer, consumer, prompt_tokens, prompt_tokens + max_tokens)

    async def acquire(
        self,
        prompt_tokens: int,
        max_tokens: int,
        *,
        avoid: frozenset[str] = frozenset(),
        deadline: float = math.inf,
        elapsed_s: float = 0.0,
        cached: Callable[[str], int] | None = None,
        model: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        held: Callable[[str], HeldChain] | None = None,
        plan: PlanTicket | None = None,
        slo: SLOConfig | None = None,
        room: Room | None = None,
        admission: str | None = None,
    ) -> Reservation:
        """Reserve a pair serving ``model`` (least-loaded placement never waits; it ignores
        ``cached``, ``prompt_ids``, ``held`` and ``plan``, and prices no latency class:
        ``slo``, ``room`` and ``admission``).

        Cancellation is honoured here, but it does not yield to the scheduler: the
        request's next step is engine I/O, which does (a pass of the run loop per
        request saved).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        return self._least_loaded(prompt_tokens, max_tokens, avoid=avoid, model=model)

    def _least_loaded(
        self, prompt_tokens: int, max_tokens: int, *, avoid: frozenset[str], model: str | None
    ) -> Reservation:
        reservation = self.choose(prompt_tokens, max_tokens, avoid=avoid, model=model)
        reservation.explain = {"rule": "least_loaded"}
        return reservation

    def choose_for(
        self, slo: SLOConfig | None, room: Room | None, prompt_tokens: int, max_tokens: int, **kwargs: Any
    ) -> Reservation:
        """:meth:`choose` for a latency class; least-loaded placement prices none (see
        :meth:`narwhal.router.pricing.PricedPlacement.choose_for`)."""
        return self._least_loaded(prompt_tokens, max_tokens, avoid=kwargs.get("avoid", frozenset()),
                                  model=kwargs.get("model"))  # fmt: skip

    async def wait_capacity(self) -> None:
        """Wait until capacity may have changed (here: a reservation ended)."""
        await self.wait_released()
