"""Profile-priced placement: put each request where its latency targets hold.

When the fleet names a profiles pair whose fits bind to the engines running now
(Gate F), each candidate is priced from its profile:

- producer: predicted TTFT = the predicted prefill time of the prompts already
  reserved on it (they run before this one, in order), less the part of the oldest
  one's already done (it started when it was sent or when the prefill before it
  ended, whichever came last; a producer that computes its waiting prompts together
  is priced as steps instead, :mod:`narwhal.router.prefillqueue`), + this prompt's
  own prefill, times the engine's
  correction factor (reactive control keeps it). The own prefill is the
  fitted TTFT curve at the prompt's length L; where the router's prefix index says
  the producer holds the prompt's first k tokens, it is the curve's price of the
  uncached part: the profile's cached-prefix model ``a + b*(L-k) + c*(L**2 - k**2) +
  d*k`` where the profiler measured one (``narwhal profile``'s cached-prefix sweep),
  else ``ttft(L) - ttft(k) + ttft(0)`` of the TTFT curve (for the fitted ``a + b*L +
  c*L**2`` that is the same form with ``d = 0``: the new tokens and the attention pairs
  they add over the cached prefix); never above the price of a miss (the reserved work
  of a request is its hit-aware price too);
- consumer: predicted TPOT with this request added (active + 1, resident KV + its
  prompt and output tokens), times its correction factor. Inside the profiled decode
  domain the fit is used as is; outside it the price is taken at the domain's edge and
  scaled up by how far the point lies beyond it (conservative), and counted;
- the KV constraint: a consumer whose resident KV would pass its capacity is not a
  candidate, when that capacity is a limit (``physical`` or ``tpot``; against a
  ``physical`` one the prompt blocks its streams share in its prefix cache count once,
  :mod:`narwhal.router.sharedkv`); when no priced
  consumer has room, admission refuses or waits as for a missed target (the refusal
  names the consumer closest to room and by how many tokens), and the request is never
  placed by the fallback below, which is for engines without a bound profile; a ``measured``
  capacity is only the largest KV the sweep saw, the edge of the decode domain, and
  beyond it the consumer is priced conservatively like any point outside the domain;
- the handoff: the client's first token comes out of the consumer after the prefill,
  the KV pull and the consumer's next decode step, none of which the profile measures
  per pair; the router measures it on every request (the journal's ``first_byte_s -
  ttft_s``, a moving mean per consumer) and admission adds the chosen consumer's to
  the producer's prediction before comparing it with the TTFT target;
- ``controller.pricing: upper`` prices every prediction at its bootstrap upper bound
  (the profile's ``upper_factor``) instead of the point estimate;
- an engine profiled for prefill only is never priced as a consumer.

A prefix held only where a request of it queues is copied to another producer (see
:meth:`PricedPlacement.replication`): when the producers holding most of a prompt are
predicted to spend at least half the TTFT target on it (:data:`REPLICATE_AT`) and
another producer would serve the prompt within that half once it held the prefix, the
router has that producer compute the prefix in the background (a one-token request of
the prefix alone, :mod:`narwhal.router.replicate`), priced into its queue like any
prefill. Without it a producer whose miss cannot meet the TTFT target (a slow one, a
long shared prefix) would never be given a request of a prefix it lacks, and would
stay idle while the producers holding the prefixes saturate. A refused prompt that no
producer could serve within the target even idle is computed in the background in
the same way (:meth:`PricedPlacement.warming`): a refused request computes nothing,
and without it every request of a prefix whose miss is over the target everywhere
would be refused forever.

Among consumers predicted equal (TPOT within 1 %), the one whose own prefix cache holds
most of the prompt wins: it pulls fewer blocks from the producer (see
:func:`best_consumer` for why that pull is not priced).

Load that other routers placed (replicas, workers; :mod:`narwhal.router.loadpoll`) is
priced from the same combined view as least-loaded placement: a producer's queue adds
the others' prefills, each at the mean predicted prefill of this router's placements
on that producer (hits priced as hits; before the first, the prefill of this router's
mean prompt), and on a producer priced as steps each at its part beyond the step's
fixed cost; a consumer's active streams and resident KV add the others' streams, each
with this router's mean KV reservation (against a ``physical`` capacity, the mean room
its streams take, :attr:`PricedPlacement.mean_room_tokens`).

The pair with the most headroom against both SLOs wins (headroom = the smaller of
``1 - predicted/target`` over TTFT and TPOT). Admission asks whether the chosen pair
*can* meet the TTFT target: with ``controller.admission_bound: lower`` (the default) it
compares the low end of the producer's prediction with the target, the prediction
scaled by the 10th percentile of observed / predicted router TTFT over that producer's
latest priced requests (:data:`LOW_QUANTILE`, :data:`ERROR_WINDOW`; until
:data:`ERROR_MIN` of them, the low end of the profile's bootstrap prediction interval),
so that a request predicted over the target by less than the producer's own prediction
error is served, not refused; with ``point`` it compares the point prediction. When no
pair can meet them, ``controller.admission`` decides: ``refuse`` answers 503 with ``Retry-After`` at once
(except a request that would itself meet the targets but would make the prompts
waiting for a producer's next step late: it waits for that step, :meth:`acquire`);
``wait`` waits for capacity (a reservation released) until the TTFT target or the
request deadline has passed, then refuses. The wait is part of the router TTFT.

Candidates are the engines that serve the request's model (see :mod:`.placement`);
pricing, waiting and the fallback below happen within that model's pool.

An engine whose profile does not bind (a new generation, or no profile) is not
priced: while any priced pair exists only priced engines are used; when none does,
placement falls back to least reserved load over every available engine, and the
fallback is counted and reported.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import trio

from narwhal.config import SLOConfig
from narwhal.errors import Refused
from narwhal.profile.store import EngineProfile
from narwhal.router.cacheplan import CachePlan, PlanTicket
from narwhal.router.choice import ProducerChoice, choose_producer, explain
from narwhal.router.handoff import HandoffModel
from narwhal.router.placement import MEAN_WEIGHT, Explanation, Placement, Reservation, Room
from narwhal.router.prefillqueue import PrefillQueues
from narwhal.router.quotes import CONSUMER_TIE, Quote, best_consumer
from narwhal.router.sharedkv import HeldChain, SharedBlocks

__all__ = ["CONSUMER_TIE", "REPLICATE_AT", "YIELD_SHARE", "NoCapacity", "PricedPlacement", "Quote", "Replicate", "best_consumer"]

log = logging.getLogger("narwhal.router.placement")

#: A prefix is copied to another producer when the best producer holding it is predicted
#: to take at least this share of the TTFT target (queue and prefill) for a request of
#: it, and the other producer would take less than this share once it held the prefix.
REPLICATE_AT: Final = 0.5

#: ... and the producer it is copied to would predict the prompt within this share of
#: the target once it held the prefix (its queue now, its prefill with the hit).
COPY_SERVES_WITHIN: Final = 0.5

#: Weight of the newest request in the moving mean of a consumer's handoff time.
HANDOFF_WEIGHT: Final = 0.1

#: Admission's low end of a producer's TTFT prediction: this quantile of observed /
#: predicted router TTFT over its latest :data:`ERROR_WINDOW` priced requests that got a
#: first token (a request refused at the low end had about this chance of meeting the
#: target), once there are :data:`ERROR_MIN` of them ...
LOW_QUANTILE: Final = 0.1
ERROR_WINDOW: Final = 200
ERROR_MIN: Final = 20

#: ... and never below this share of the prediction (predictions that far off are a
#: profile that no longer describes the engine, not noise to admit on).
LOW_FLOOR: Final = 0.5

#: Starts copying a prefix to a producer: (producer, prefix token ids, model, predicted
#: seconds of the copy's prefill); returns whether it started.
Replicate = Callable[[str, Sequence[int], "str | None", float], bool]


class PricedPlacement(Placement):
    """Least-loaded placement with profile pricing on top (see the module docstring)."""

    def __init__(
        self,
        prefill_engines: Sequence[str],
        decode_engines: Sequence[str],
        *,
        profiles: dict[str, EngineProfile],
        slo: SLOConfig,
        admission: str,
        available: Callable[[str], bool] = lambda name: True,
        clock: Callable[[], float] = trio.current_time,
        pricing: str = "point",  # pragma: no mutate (equivalent: any word but "upper" prices the point estimate)
        models: Mapping[str, Iterable[str]] | None = None,
        admission_bound: str = "lower",
        retry_after_s: Callable[[Sequence[str]], float] = lambda names: 1.0,
    ) -> None:
        super().__init__(prefill_engines, decode_engines, available=available, models=models,
                         retry_after_s=retry_after_s)  # fmt: skip
        self.profiles = dict(profiles)
        self.pricing = pricing
        self.admission_bound = admission_bound
        #: Per producer, observed / predicted router TTFT of its latest priced requests.
        self.ttft_ratios: dict[str, collections.deque[float]] = {}
        #: Per producer, the :data:`LOW_QUANTILE` of its ratios once it has
        #: :data:`ERROR_MIN`: set where a ratio comes in (once a request), not per quote.
        self._observed_low: dict[str, float] = {}
        self.slo = slo
        #: What the request being priced must leave for others (None: nothing;
        #: :meth:`choose_for`).
        self.room: Room | None = None
        self.admission = admission
        self.clock = clock
        #: Multiplicative corrections of the predictions, kept by reactive control.
        self.ttft_correction: dict[str, float] = dict.fromkeys(self.loads, 1.0)
        self.tpot_correction: dict[str, float] = dict.fromkeys(self.loads, 1.0)
        #: The prefills reserved per producer, and the queue ahead of a new one.
        self.queues = PrefillQueues(self.loads, clock=clock, fixed_s=self._fixed_s, part_s=self._part_s,
                                    others_s=self.others_prefill_s)  # fmt: skip
        #: Which queue model prices each producer (:mod:`narwhal.router.batching`).
        self.queue_models = self.queues.models
        for name, profile in self.profiles.items():
            self.queue_models.prior(name, profile.prefill_queue)
        self.unbound: dict[str, str] = {}
        self.counters = {"priced": 0, "fallback": 0, "out_of_domain": 0, "refused": 0, "waited": 0,
                         "deferred": 0, "replicated": 0, "warmed": 0}  # fmt: skip
        self._capacity = trio.Event()
        #: Copies prefixes to producers (set while the router runs); None: never.
        self.replicate: Replicate | None = None
        #: Per consumer, the moving mean of the handoff: a prefill's end to the first
        #: token out of the consumer (the KV pull, the consumer's next decode step).
        self.handoff_s: dict[str, float] = {}
        #: Producers computing a copied prefix now (one copy per producer at a time).
        self.replicating: set[str] = set()
        self._copies: dict[str, int] = {}
        #: The refused prompts being computed (:meth:`warming`), by producer.
        self._warming: dict[str, Sequence[int]] = {}
        #: Per consumer, the cached prompt blocks its streams hit when placed.
        self.shared_kv: dict[str, SharedBlocks] = {}
        #: The cache plan (set while the router runs with ``controller.cache_plan: auto``
        #: and a prefix index): owners of prefixes and sessions, and the later cost of
        #: a placement's new blocks (:mod:`narwhal.router.choice`).
        self.cache_plan: CachePlan | None = None
        #: Placements by the rule that chose their producer (:mod:`narwhal.router.choice`).
        self.rules: dict[str, int] = {}
        #: What a pulled token costs each consumer's handoff (learned from the journal).
        self.handoffs = HandoffModel()
        #: The choice the latest :meth:`price` made (read by :meth:`choose` at once).
        self.last_choice: ProducerChoice | None = None
        self._last_consumer_runner_up: Quote | None = None
        #: The moving mean of the KV a placed stream takes of its consumer's capacity:
        #: its prompt and output less the blocks it hits that a stream there holds (None
        #: until a priced placement). Others' streams are counted at it against a
        #: ``physical`` capacity: they hit the same prefixes.
        self.mean_room_tokens: float | None = None

    # ----------------------------------------------------------------- prices

    def _headroom(self, predicted: float, target: float | None) -> float:
        if target is None:
            return -predicted  # no target: prefer the fastest
        return 1.0 - predicted / target

    def prefill_s(self, name: str, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted prefill of a prompt whose first ``cached_tokens`` are cached there:
        the profile's measured cached-prefix model where it has one, else the TTFT
        curve's price of the uncached part; never above the price of a miss."""
        profile = self.profiles[name]
        full = self._ttft(profile, prompt_tokens)
        if cached_tokens <= 0:
            return full
        k = min(cached_tokens, prompt_tokens)
        model = profile.cached_prefill
        if model is not None:
            hit = (model.predict_upper(prompt_tokens, k) if self.pricing == "upper"
                   else model.predict(prompt_tokens, k))  # fmt: skip
        else:
            hit = full - self._ttft(profile, k) + self._ttft(profile, 0)
        return min(max(hit, 0.0), full)

    def quote_producer(
        self, name: str, prompt_tokens: int, elapsed_s: float = 0.0, cached_tokens: int | None = None
    ) -> Quote:
        """Predicted router TTFT from arrival: time already spent + queue + own prefill."""
        own = self.prefill_s(name, prompt_tokens, cached_tokens or 0)
        correction = self.ttft_correction[name]
        queue = self.queues.queue_s(name) * correction
        ahead = queue + own * correction
        predicted = elapsed_s + ahead
        # The prompts waiting for the step are held to its point prediction under either
        # admission bound: the low end is for the newcomer's own TTFT (held to it, they
        # were made late: docs/prefix-cache.md).
        delays = self.queues.delays(name, own, self.ttft_correction[name]) if name in self.queue_models.batched else 0
        return Quote(name, predicted, self._headroom(predicted, self.slo.ttft_s), cached_tokens=cached_tokens,
                     own_s=own, low_s=elapsed_s + ahead * self.low_factor(name), elapsed_s=elapsed_s,
                     delays=delays, queue_s=queue)  # fmt: skip

    def low_factor(self, name: str) -> float:
        """The low end of ``name``'s TTFT predictions as a share of them: the
        :data:`LOW_QUANTILE` of its observed / predicted ratios once it has
        :data:`ERROR_MIN`, else the low end of its profile's bootstrap prediction interval
        (1 - its worst relative half-width; under ``pricing: upper`` a prediction is that
        interval's upper end, so the low end is that much further); within
        [:data:`LOW_FLOOR`, 1]."""
        low = self._observed_low.get(name)
        if low is None:
            uncertainty = self.profiles[name].ttft.uncertainty
            half = uncertainty.worst_half_width if uncertainty is not None else 0.0
            upper = uncertainty.upper_factor if uncertainty is not None and self.pricing == "upper" else 1.0
            low = (1.0 - half) / max(upper, 1.0)
        return min(max(low, LOW_FLOOR), 1.0)

    def observe_ttft(self, producer: str, observed_s: float, predicted_s: float) -> None:
        """One priced request's router TTFT on ``producer`` against its prediction."""
        if predicted_s > 0 and producer in self.loads:
            ratios = self.ttft_ratios.setdefault(producer, collections.deque(maxlen=ERROR_WINDOW))
            ratios.append(observed_s / predicted_s)
            if len(ratios) >= ERROR_MIN:
                self._observed_low[producer] = sorted(ratios)[int(LOW_QUANTILE * (len(ratios) - 1))]

    def _fixed_s(self, name: str) -> float:
        """What a prefill step of ``name`` costs whatever it computes: its TTFT curve at no tokens."""
        return max(self._ttft(self.profiles[name], 0), 0.0)

    def _part_s(self, name: str, work: float, prompt_tokens: int) -> float:
        """What a prefill of ``work`` predicted seconds for a ``prompt_tokens``-token
        prompt adds to a step of ``name`` it shares: beyond the step's fixed cost, less
        what the prompt spends outside the engine's steps where the profile measured it
        (:class:`~narwhal.profile.store.PrefillOutside`)."""
        outside = self.profiles[name].prefill_outside
        own = outside.per_token_s * prompt_tokens if outside is not None else 0.0
        return max(work - self._fixed_s(name) - own, 0.0)

    def others_prefill_s(self, name: str, batched: bool = False) -> float:
        """Predicted prefill seconds of the prompts others queued on ``name``: each the
        mean prefill this router placed there (its hits priced as hits: the others'
        traffic is the same mix), or before the first the prefill of this router's mean
        prompt; ``batched``, each the mean part in a step of those (:meth:`_part_s`)."""
        others = self.others_prefill(name)
        if not others:
            return 0.0
        mean = self.queues.mean_work_s(name, part=batched)
        if mean is None:
            tokens = round(self.mean_prompt_tokens)
            mean = self._ttft(self.profiles[name], tokens)
            if batched:
                mean = self._part_s(name, mean, tokens)
        return others * mean

    def _ttft(self, profile: EngineProfile, prompt_tokens: int) -> float:
        if self.pricing == "upper":
            return profile.ttft.predict_upper(prompt_tokens)
        return profile.predict_ttft(prompt_tokens)

    def quote_consumer(
        self, name: str, prompt_tokens: int, max_tokens: int, cached_tokens: int | None = None,
        held: HeldChain = ((), 0),
    ) -> Quote | None:
        """Predicted TPOT with this request added; ``cached_tokens`` (the consumer's own
        prefix-cache hit, which it need not pull) rides on the quote for the choice;
        ``held``: the chain ids of that hit (streams that share them hold them once)."""
        profile = self.profiles[name]
        decode, capacity = profile.decode, profile.kv_capacity
        if decode is None or capacity is None:
            return None  # profiled for prefill only
        others = self.others_decode(name)
        active = self.loads[name].decode_requests + others + 1
        kv = self._consumer_kv(name, prompt_tokens, max_tokens)
        if capacity.is_limit and self._room_kv(name, kv, held) > capacity.tokens:
            return None
        domain = decode.domain
        inside = domain.contains(active, kv)
        if inside:
            predicted = decode.predict(active, kv)
        else:
            a = min(max(active, domain.active.min), domain.active.max)
            k = min(max(kv, domain.kv_tokens.min), domain.kv_tokens.max)
            edge = decode.predict(a, k)
            # Conservative beyond the measured domain: scale by the relative overshoot
            # on each axis (never below the linear extrapolation).
            over = max(active / max(domain.active.max, 1e-9), 1.0) * max(kv / max(domain.kv_tokens.max, 1e-9), 1.0)
            predicted = max(decode.predict(active, kv), edge * over)
        if self.pricing == "upper":
            predicted *= decode.upper_factor
        predicted *= self.tpot_correction[name]
        return Quote(name, predicted, self._headroom(predicted, self.slo.tpot_s), out_of_domain=not inside,
                     cached_tokens=cached_tokens)  # fmt: skip

    def _consumer_kv(self, name: str, prompt_tokens: int, max_tokens: int) -> int:
        """The KV tokens resident on consumer ``name`` with this request added (the
        others' streams each with this router's mean reservation), every stream's
        prompt counted in full: what its decode steps read (the TPOT fit's resident KV)."""
        load = self.loads[name]
        return load.decode_kv_tokens + round(self.others_decode(name) * self.mean_kv_tokens) + prompt_tokens + max_tokens

    def _room_kv(self, name: str, kv: int, held: HeldChain) -> int:
        """The KV tokens ``kv`` (:meth:`_consumer_kv`) takes of consumer ``name``'s
        capacity: against its ``physical`` capacity the prompt blocks its streams share
        in its prefix cache count once (:mod:`narwhal.router.sharedkv`), this
        request's hit on blocks a stream there holds included; a ``tpot`` capacity is
        a limit of what the decode steps read, every stream's prompt in full."""
        capacity = self.profiles[name].kv_capacity
        if capacity is None or capacity.source != "physical":
            return kv
        room = self.mean_room_tokens
        if room is not None:  # the others' streams, each at the mean room rather than the mean KV
            kv -= round(self.others_decode(name) * (self.mean_kv_tokens - room))
        shared = self.shared_kv.get(name)
        return kv if shared is None else kv - shared.shared_tokens - shared.held_by_streams(*held)

    # ----------------------------------------------------------------- choosing

    def _priced_candidates(self, names: Sequence[str], avoid: frozenset[str], model: str | None) -> list[str]:
        live = [n for n in names if self.available(n) and n in self.profiles and self.serves(n, model)]
        return [n for n in live if n not in avoid] or live

    def price(
        self,
        prompt_tokens: int,
        max_tokens: int,
        avoid: frozenset[str],
        elapsed_s: float = 0.0,
        cached: Callable[[str], int] | None = None,
        model: str | None = None,
        held: Callable[[str], HeldChain] | None = None,
        plan: PlanTicket | None = None,
    ) -> tuple[Quote, Quote] | None:
        """The best (producer, consumer) quotes among engines serving ``model``, or None
        when no priced pair exists.

        ``cached`` says how many leading prompt tokens an engine holds (the prefix index),
        ``held`` which blocks (:meth:`narwhal.router.prefix.PromptLookup.held_chain`).
        The producer is chosen by :func:`narwhal.router.choice.choose_producer`, with the
        cache plan when ``plan`` (the request's ticket) is given and the plan is on; the
        choice stays in :attr:`last_choice`.
        When every priced consumer's KV capacity is a limit this request would pass, the
        consumer quote is the one it would pass by least, with ``kv_over`` set (a pair
        that cannot be placed: no room is not no price).
        """
        producers = self._priced_candidates(self.prefill_engines, avoid, model)
        consumers = self._priced_candidates(self.decode_engines, avoid, model)
        if not producers or not consumers:
            return None
        handoff = min((self.handoff_s.get(n, 0.0) for n in consumers), default=0.0)
        choice = choose_producer(
            [self.quote_producer(n, prompt_tokens, elapsed_s, cached(n) if cached else None) for n in producers],
            target_s=self.slo.ttft_s, handoff_s=handoff, bound=self._bound,
            plan=self.cache_plan if plan is not None else None, ticket=plan, cached=cached,
            prompt_tokens=prompt_tokens,
        )  # fmt: skip
        self.last_choice = choice
        self._last_consumer_runner_up = None
        p = choice.quote
        chains = {n: held(n) for n in consumers} if held is not None else {}
        quotes = [
            q for n in consumers
            if (q := self.quote_consumer(n, prompt_tokens, max_tokens, cached(n) if cached else None,
                                         chains.get(n, ((), 0)))) is not None
        ]  # fmt: skip
        if not quotes:
            limited = [
                (self._room_kv(n, self._consumer_kv(n, prompt_tokens, max_tokens), chains.get(n, ((), 0)))
                 - capacity.tokens, n)
                for n in consumers
                if (capacity := self.profiles[n].kv_capacity) is not None and self.profiles[n].decode is not None
            ]  # fmt: skip
            if not limited:
                return None  # profiled for prefill only: no consumer is priced
            over, name = min(limited)
            return p, Quote(name, math.inf, -math.inf, cached_tokens=cached(name) if cached else None, kv_over=over)
        c = best_consumer(quotes, self.handoffs.per_token, self.slo.ttft_s)
        if len(quotes) > 1:
            self._last_consumer_runner_up = max((q for q in quotes if q is not c), key=lambda q: q.headroom)
        return p, c

    def _bound(self, q: Quote) -> float:
        """The prediction admission holds against the TTFT target."""
        return q.predicted_s if self.admission_bound == "point" else q.low

    def _unpriced(self, names: Sequence[str], quoted: Sequence[str], avoid: frozenset[str], model: str | None,
                  role: str) -> dict[str, str]:  # fmt: skip
        """Why each of ``names`` was not quoted for ``role``."""
        out = {}
        for n in names:
            if n in quoted:
                continue
            if not self.available(n):
                out[n] = "unavailable (breaker or fleet phase)"
            elif not self.serves(n, model):
                out[n] = "does not serve the model"
            elif n not in self.profiles:
                out[n] = f"not priced ({self.unbound.get(n, 'no bound profile')})"
            elif n in avoid:
                out[n] = "failed this request before"
            else:
                out[n] = f"not a {role} candidate"
        return out

    def choose(
        self,
        prompt_tokens: int,
        max_tokens: int,
        *,
        avoid: frozenset[str] = frozenset(),
        elapsed_s: float = 0.0,
        cached: Callable[[str], int] | None = None,
        model: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        held: Callable[[str], HeldChain] | None = None,
        plan: PlanTicket | None = None,
    ) -> Reservation:
        """Reserve the best pair serving ``model`` now; raise ``_NoCapacity`` when none meets the SLO.

        ``elapsed_s`` is the time the request has spent in the router already (token
        counting, earlier placement waits): it counts against the TTFT target.
        ``cached`` says how many leading prompt tokens an engine's cache holds;
        ``prompt_ids`` (the prompt's token ids) lets a busy prefix be copied to another
        producer (:meth:`replication`); ``plan``: the request's ticket of the cache plan.
        The reservation carries the placement's explanation (``explain``).
        """
        quotes = self.price(prompt_tokens, max_tokens, avoid, elapsed_s, cached, model, held, plan)
        if quotes is None:
            self.counters["fallback"] += 1
            reservation = super().choose(prompt_tokens, max_tokens, avoid=avoid, model=model)
            reservation.explain = {"rule": "fallback", "detail": "no priced pair: least reserved load"}
            return self._reserve(reservation, prompt_tokens, None, None)
        p, c = quotes
        choice = self.last_choice
        assert choice is not None  # set by price
        owners = choice.owners if plan is not None else None
        if prompt_ids is not None and cached is not None and self.replicate is not None:
            copy = self.replication(prompt_tokens, cached, model, owners)
            if copy is not None:
                self._start_copy(copy[0], prompt_ids[: copy[1]], copy[2], model)
        # A miss is a predicted miss of a target that is set (without a target, a
        # quote's headroom only ranks: it is always negative). The client's first token
        # comes after the prefill: the handoff to the consumer counts against the target.
        handoff = self.handoff_s.get(c.engine, 0.0)
        bound = p.predicted_s if self.admission_bound == "point" else p.low
        own_late = self.slo.ttft_s is not None and bound + handoff > self.slo.ttft_s
        delays = self.slo.ttft_s is not None and p.delays > 0
        decode_miss = c.kv_over > 0 or (self.slo.tpot_s is not None and c.headroom < 0)
        # The explanation is written out when the journal writes the record (after the
        # response): what it needs of now is taken now.
        runner_up = self._last_consumer_runner_up
        per_token = self.handoffs.per_token
        account = functools.partial(
            explain, choice, c, runner_up, handoff_s=handoff,
            unpriced=self._unpriced(self.prefill_engines, [q.engine for q in choice.quotes], avoid, model, "prefill"),
            transfer_s_per_token={q.engine: per_token[q.engine] for q in (c, runner_up)
                                  if q is not None and q.engine in per_token} if per_token else None,
        )  # fmt: skip
        if self.room is not None and self._crowds(self.room, p, c, handoff):
            decode_miss = True  # (not deferrable: it is the room left for others that is missing)
        if own_late or delays or decode_miss:
            self.counters["refused"] += 1
            if own_late and prompt_ids is not None and cached is not None and self.replicate is not None:
                warm = self.warming(prompt_tokens, prompt_ids, cached, model, handoff, owners)
                if warm is not None:
                    self._start_copy(warm[0], prompt_ids, warm[1], model, warm=True)
            raise _NoCapacity(p, c, handoff, deferrable=not (own_late or decode_miss), account=account)
        self.counters["priced"] += 1
        self.rules[choice.rule] = self.rules.get(choice.rule, 0) + 1
        if c.out_of_domain:
            self.counters["out_of_domain"] += 1
        reservation = Reservation(self, p.engine, c.engine, prompt_tokens, prompt_tokens + max_tokens)
        reservation.explain = account
        self._reserve(reservation, prompt_tokens, p, c)
        self._share(reservation, held(c.engine) if held is not None else ((), 0))
        return reservation

    def _share(self, reservation: Reservation, held: HeldChain) -> None:
        """The stream of ``reservation`` hits ``held`` in its consumer's cache: those
        blocks are counted once with the other streams there until its decode ends; the
        KV it takes of the consumer's capacity joins :attr:`mean_room_tokens`."""
        chain, block_size = held
        consumer = reservation.consumer
        shared = self.shared_kv.get(consumer)
        room = reservation.kv_tokens - (shared.held_by_streams(chain, block_size) if shared is not None else 0)
        mean = self.mean_room_tokens
        self.mean_room_tokens = room if mean is None else mean + MEAN_WEIGHT * (room - mean)
        if not chain:
            return
        if shared is None:
            shared = self.shared_kv[consumer] = SharedBlocks()
        shared.add(chain, block_size)

        def release() -> None:
            shared.remove(chain, block_size)
            self._capacity_changed()

        reservation.on_release_decode = release

    def replication(
        self, prompt_tokens: int, cached: Callable[[str], int], model: str | None = None,
        owners: Sequence[str] | None = None,
    ) -> tuple[str, int, int] | None:
        """The producer to copy this prompt's cached prefix to, the prefix's length in
        tokens and how much of it that producer holds already; None when no copy is due.

        Due when the prompt's longest cached prefix (k tokens, at least half the prompt)
        is held only by producers whose best predicted TTFT for the prompt is at least
        :data:`REPLICATE_AT` of the target, and another producer that lacks it, copies
        nothing now, and would then predict the prompt (its queue now, plus its prefill
        with k cached) within that share. The copy itself is not in that prediction: it
        runs behind the producer's queued prefills and before the ones placed after it,
        which are priced with it (:meth:`_start_copy` reserves it).

        With a cache plan whose group of the prompt has ``owners``, an owner that
        qualifies is taken first (the plan gives a group busier than one producer a
        second owner).
        """
        target = self.slo.ttft_s
        if target is None:
            return None
        names = self._priced_candidates(self.prefill_engines, frozenset(), model)
        held = {n: cached(n) for n in names}
        k = max(held.values(), default=0)
        if k <= 0 or 2 * k < prompt_tokens:
            return None
        holders = [n for n in names if held[n] >= k]
        if any(n in self.replicating for n in holders):
            return None  # a holder may be computing it still (a copy's blocks are held from its start)
        busy = min(self.quote_producer(n, prompt_tokens, 0.0, k).predicted_s for n in holders)
        if busy < REPLICATE_AT * target:
            return None
        best: tuple[tuple[bool, float], str] | None = None
        for n in names:
            if held[n] >= k or n in self.replicating:
                continue
            after = self.quote_producer(n, prompt_tokens, 0.0, k).predicted_s
            rank = (not (owners and n in owners), after)
            if after < COPY_SERVES_WITHIN * target and (best is None or rank < best[0]):
                best = (rank, n)
        return None if best is None else (best[1], k, held[best[1]])

    def warming(
        self, prompt_tokens: int, prompt_ids: Sequence[int], cached: Callable[[str], int], model: str | None,
        handoff_s: float = 0.0, owners: Sequence[str] | None = None,
    ) -> tuple[str, int] | None:
        """The producer to compute a refused prompt on in the background, and how much of
        it that producer holds already; None when none is due.

        Due when no producer could meet the TTFT target with this prompt even with
        nothing queued ahead of it (its own prefill, with the hit it has there, at the
        low end of the prediction, plus the handoff, is over the target): refusing it
        sheds no load, and while no producer holds its prefix, every request of that
        prefix would be refused in the same way, forever (a refused request computes
        nothing). The prompt is computed (a copy, :meth:`_start_copy`) on the producer
        that would finish it first among those not busy (their queue under
        :data:`REPLICATE_AT` of the target) and copying nothing now, unless a prompt
        sharing at least half of it is being computed already; later requests of its
        prefix are then priced with the hit there. With a cache plan, an owner of the
        prompt's group that qualifies is taken first.
        """
        target = self.slo.ttft_s
        if target is None:
            return None
        names = self._priced_candidates(self.prefill_engines, frozenset(), model)
        held = {n: cached(n) for n in names}
        idle = min((self.prefill_s(n, prompt_tokens, held[n]) * self.ttft_correction[n] * self.low_factor(n)
                    for n in names), default=0.0)  # fmt: skip
        if idle + handoff_s <= target:
            return None  # servable once the queues drain
        half = prompt_tokens // 2
        if any(list(ids[:half]) == list(prompt_ids[:half]) for ids in self._warming.values()):
            return None
        best: tuple[tuple[bool, float], str] | None = None
        for n in names:
            if n in self.replicating:
                continue
            queue = self.queues.queue_s(n) * self.ttft_correction[n]
            if queue >= REPLICATE_AT * target:
                continue
            done = queue + self.prefill_s(n, prompt_tokens, held[n]) * self.ttft_correction[n]
            rank = (not (owners and n in owners), done)
            if best is None or rank < best[0]:
                best = (rank, n)
        return None if best is None else (best[1], held[best[1]])

    def _start_copy(self, producer: str, ids: Sequence[int], held: int, model: str | None, warm: bool = False) -> None:
        """Copy prefix ``ids`` (``held`` of its tokens cached there) to ``producer``; its
        prefill is reserved there until :meth:`copied`. ``warm``: a refused prompt that
        no producer could serve in time (:meth:`warming`)."""
        assert self.replicate is not None
        work = self.prefill_s(producer, len(ids), held)
        if self.replicate(producer, ids, model, work):
            self.replicating.add(producer)
            self.counters["warmed" if warm else "replicated"] += 1
            self._copies[producer] = self._add_work(producer, work, len(ids))
            if warm:
                self._warming[producer] = ids

    def copied(self, producer: str, work_s: float) -> None:
        """The copy of a prefix to ``producer`` ended (done or failed): release its work
        (``work_s``, as :attr:`replicate` was given it, is reserved under the copy's key)."""
        self.replicating.discard(producer)
        self._warming.pop(producer, None)
        key = self._copies.pop(producer, None)
        if key is not None:
            self._release_work(producer, key)

    def _reserve(self, reservation: Reservation, prompt_tokens: int, p: Quote | None, c: Quote | None) -> Reservation:
        producer = reservation.producer
        if p is not None:
            work = p.own_s
        else:
            work = self._ttft(self.profiles[producer], prompt_tokens) if producer in self.profiles else 0.0
        target = self.slo.ttft_s
        latest_done = math.inf
        if target is not None and p is not None and c is not None:
            latest_done = self.clock() + target - p.elapsed_s - self.handoff_s.get(c.engine, 0.0)
        key = self._add_work(producer, work, prompt_tokens, latest_done)
        reservation.on_release_prefill = lambda done: self._release_work(producer, key, done)
        reservation.on_release_decode = self._capacity_changed
        reservation.predicted_ttft_s = p.predicted_s if p is not None else None
        reservation.predicted_work_s = work
        reservation.predicted_tpot_s = c.predicted_s if c is not None else None
        return reservation

    def observe_handoff(self, consumer: str, seconds: float) -> None:
        """One request's handoff: prefill done to its first token out of ``consumer``."""
        h = self.handoff_s.get(consumer)
        self.handoff_s[consumer] = seconds if h is None else h + HANDOFF_WEIGHT * (seconds - h)

    def on_record(self, record: Mapping[str, Any]) -> None:
        """Journal listener: the handoff of every request that got a first token, and
        its router TTFT against the prediction of the attempt that produced it."""
        consumer, ttft, first = record.get("consumer"), record.get("ttft_s"), record.get("first_byte_s")
        attempts = record.get("attempts") or ()
        last = attempts[-1] if attempts else None
        if isinstance(consumer, str) and isinstance(ttft, float) and isinstance(first, float) and first >= ttft:
            self.observe_handoff(consumer, first - ttft)
            # What it pulled: the prompt less what its own cache held (where predicted).
            held, prompt = last.get("consumer_predicted_cached_tokens") if last else None, record.get("prompt_tokens")
            if isinstance(held, int) and isinstance(prompt, int):
                self.handoffs.observe(consumer, first - ttft, max(prompt - held, 0))
        if isinstance(ttft, float) and isinstance(last, Mapping) and last.get("outcome") == "ok":
            producer, predicted = last.get("producer"), last.get("predicted_ttft_s")
            if isinstance(producer, str) and isinstance(predicted, float):
                self.observe_ttft(producer, ttft, predicted)

    def engine_reported(self, name: str, running: int, waiting: int, own: int) -> None:
        """As :meth:`Placement.engine_reported`; requests waiting for capacity re-price
        when the others' share of an engine shrank."""
        load = self.loads.get(name)
        if load is None:  # not (or no longer) an engine of this placement
            return
        before = load.others
        super().engine_reported(name, running, waiting, own)
        if load.others < before:
            self._capacity_changed()

    def _add_work(self, producer: str, work: float, prompt_tokens: int, latest_done: float = math.inf) -> int:
        """Reserve ``work`` predicted prefill seconds of a ``prompt_tokens``-token prompt
        on ``producer``, behind its queue; ``latest_done``: when it must end to meet the
        TTFT target."""
        return self.queues.add(producer, work, latest_done, priced=producer in self.profiles,
                               prompt_tokens=prompt_tokens)  # fmt: skip

    def _release_work(self, producer: str, key: int, done: bool = False) -> None:
        """The prefill reserved on ``producer`` under ``key`` ends: ``done``, it completed
        now, else it failed or was given up."""
        self.queues.release(producer, key, done=done)
        self._capacity_changed()

    def _capacity_changed(self) -> None:
        self._capacity.set()
        self._capacity = trio.Event()

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
        """Reserve a pair serving ``model`` predicted to meet the SLO, waiting for capacity
        (admission ``wait``). Under ``refuse``, a request that would itself meet the
        targets but would make the prompts waiting for a producer's next step late is not
        refused: it waits for the next reservation to end (that step under way, the
        prompts no longer waiting) and is priced again, its wait counted against its own
        TTFT target, until it is placed or would itself miss.

        ``slo`` and ``room`` price the request for its latency class (:meth:`choose_for`);
        ``admission`` overrides ``controller.admission`` for it."""
        slo = slo if slo is not None else self.slo
        mode = admission if admission is not None else self.admission
        waited = False  # pragma: no mutate (equivalent: falsy alike)
        start = self.clock()
        while True:
            try:
                return self.choose_for(slo, room, prompt_tokens, max_tokens, avoid=avoid,
                                       elapsed_s=elapsed_s + self.clock() - start, cached=cached, model=model,
                                       prompt_ids=prompt_ids, held=held, plan=plan)  # fmt: skip
            except _NoCapacity as miss:
                slo_deadline = deadline
                deferred = mode == "refuse" and miss.deferrable
                if deferred:  # no later than its own target (it has one: it delays others')
                    assert slo.ttft_s is not None
                    slo_deadline = min(deadline, start - elapsed_s + slo.ttft_s)
                if (mode == "refuse" and not deferred) or self.clock() >= slo_deadline:
                    hit = miss.producer.cached_tokens
                    handoff = miss.handoff_s
                    low = miss.producer.low
                    raise Refused(
                        f"no placement meets the SLO: predicted TTFT "
                        f"{(miss.producer.predicted_s + handoff) * 1000:.1f} ms "
                        f"on {miss.producer.engine}{f' ({hit} prompt tokens cached there)' if hit else ''}, "
                        f"{f'no KV room on {miss.consumer.engine} (this request would pass its capacity by {miss.consumer.kv_over} tokens)' if miss.consumer.kv_over else f'TPOT {miss.consumer.predicted_s * 1000:.1f} ms on {miss.consumer.engine}'}"
                        f"{f' (TTFT with {handoff * 1000:.1f} ms of handoff to it)' if handoff else ''}"
                        f"{f'; TTFT {(low + handoff) * 1000:.1f} ms at the low end of its prediction error' if self.admission_bound != 'point' and low < miss.producer.predicted_s else ''}"
                        f"{f'; it would make {miss.producer.delays} request(s) queued there miss the TTFT target (they share its next step)' if miss.producer.delays else ''}",
                        placement=miss.account,
                    ) from None  # (retry in Refused's default second)
                if not waited:
                    waited = True
                    self.counters["deferred" if deferred else "waited"] += 1
                with trio.move_on_at(slo_deadline):
                    await self._capacity.wait()

    def choose_for(
        self, slo: SLOConfig | None, room: Room | None, prompt_tokens: int, max_tokens: int, **kwargs: Any
    ) -> Reservation:
        """:meth:`choose`, priced against ``slo`` (None: ``controller.slo``), and placed only
        where it leaves ``room`` (:class:`~narwhal.router.placement.Room`; None: anywhere).

        Raises:
            NoCapacity: no pair meets the targets (or leaves that room).
            NoEngine: no engine of a role is left.
        """
        if slo is None and room is None:
            return self.choose(prompt_tokens, max_tokens, **kwargs)
        saved = self.slo
        self.slo = slo if slo is not None else saved
        self.room = room
        try:  # (synchronous: no other request is priced meanwhile)
            return self.choose(prompt_tokens, max_tokens, **kwargs)
        finally:
            self.slo = saved
            self.room = None

    def _crowds(self, room: Room, producer: Quote, consumer: Quote, handoff_s: float) -> bool:
        """Whether placing the request on this pair would not leave ``room``: the producer's
        queue with it past :data:`YIELD_SHARE` of the TTFT target of the classes above, or
        (``hold``) more than its own prefill queued ahead of it; the consumer's TPOT with it
        past their TPOT target."""
        own = producer.own_s * self.ttft_correction[producer.engine]
        queued = producer.predicted_s - producer.elapsed_s  # its queue and its own prefill
        if room.ttft_s is not None and queued + handoff_s > YIELD_SHARE * room.ttft_s:
            return True
        if room.hold and queued - own > own:
            return True
        return room.tpot_s is not None and consumer.predicted_s > room.tpot_s

    async def wait_capacity(self) -> None:
        """Wait until capacity may have changed (a reservation ended, the fleet or the
        others' load changed)."""
        await self._capacity.wait()

    def bind(self, name: str, profile: EngineProfile) -> None:
        """Price engine ``name`` by ``profile`` (bound to the generation running now).
        A profile other than the one bound before says anew how the engine queues."""
        if self.profiles.get(name) != profile:
            self.queue_models.prior(name, profile.prefill_queue)
        self.profiles[name] = profile
        self.unbound.pop(name, None)

    def set_roles(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        """Reactive control assigns the active roles of engines that permit both; a fleet
        change adds and removes engines. Requests waiting for capacity look again."""
        super().set_roles(prefill, decode)
        self._capacity_changed()

    def add_engine(self, name: str) -> None:
        super().add_engine(name)
        self.ttft_correction.setdefault(name, 1.0)
        self.tpot_correction.setdefault(name, 1.0)
        self.queues.add_engine(name)

    def remove_engine(self, name: str) -> None:
        super().remove_engine(name)
        for table in (self.ttft_correction, self.tpot_correction, self.profiles, self.unbound, self.ttft_ratios,
                      self._observed_low, self.shared_kv):  # fmt: skip
            table.pop(name, None)
        self.handoffs.forget(name)
        self.queues.remove_engine(name)


#: The share of the TTFT target of the classes above that a request of a lower class may
#: leave queued on a producer (:meth:`PricedPlacement._crowds`): an arrival of those
#: classes still finds room for its own prefill within its target.
YIELD_SHARE: Final = 0.5


class _NoCapacity(Exception):
    """No pair meets the SLO; ``deferrable``: the request itself would, but would make
    the prompts waiting for the producer's next step late (it can wait for that step)."""

    def __init__(self, producer: Quote, consumer: Quote, handoff_s: float = 0.0, *, deferrable: bool = False,
                 account: Explanation | None = None) -> None:  # fmt: skip
        super().__init__("no placement meets the SLO")
        self.producer = producer
        self.consumer = consumer
        self.handoff_s = handoff_s
        self.deferrable = deferrable
        #: The placement's explanation (:func:`narwhal.router.choice.explain`, when called).
        self.account = account


#: No pair meets a request's targets now (raised by :meth:`PricedPlacement.choose_for`).
NoCapacity = _NoCapacity
