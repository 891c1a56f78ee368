"""Which producer takes a request, by the cache plan and the price; and why.

Priced placement quotes every candidate producer (:class:`~narwhal.router.quotes.Quote`:
predicted TTFT with its queue and its hit). Without a cache plan the producer with the
most headroom against the TTFT target wins. With one (:mod:`narwhal.router.cacheplan`),
:func:`choose_producer`:

1. for a young group (its first :data:`~narwhal.router.cachegroups.YOUNG` requests: a
   session's first turns, a prefix's first reuse), takes an owner when one meets the
   target within :data:`~narwhal.router.cacheplan.OWNER_WITHIN` of it, with the handoff
   (rule ``owner``; ``move`` when it holds less of the prompt than another producer: a
   group is placed where it should live while it is short and new);
2. for an established group living elsewhere, moves it to its owner at low load: the
   owner's queue under :data:`~narwhal.router.cacheplan.LOW_LOAD` of the target, its
   prefill busy under :data:`~narwhal.router.cacheplan.LOW_UTIL` of its time lately, and
   its TTFT with the miss within :data:`~narwhal.router.cacheplan.MOVE_WITHIN` of the
   target (a session only while turns are expected to follow; rule ``move``);
3. else the producer with the lowest price among those that meet the target: its
   predicted TTFT plus what its new blocks cost later requests
   (:meth:`~narwhal.router.cacheplan.CachePlan.future_s`; rule ``owner`` when that is an
   owner, ``spill`` when the group has another owner, ``price`` when none);
4. else, as without a plan, the one with the most headroom (admission then refuses or
   waits: rule ``over_target``).

:class:`ProducerChoice` keeps the chosen quote, the runner-up and why each other
producer was not taken, which :func:`explain` writes into the journal's attempt record
(and so into ``/events``). This module does no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from narwhal.router.cacheplan import (
    LOW_LOAD,
    MOVE_WITHIN,
    OWNER_WITHIN,
    SESSION_BEHIND,
    CachePlan,
    PlanTicket,
)
from narwhal.router.quotes import Quote, quote_fields

__all__ = ["ProducerChoice", "choose_producer", "explain"]


def _no_hits(engine: str) -> int:
    return 0


@attrs.define
class ProducerChoice:
    """The producer chosen for a request, the runner-up and why the others were not
    (:attr:`others`, worded only when asked: the journal writes it after the response)."""

    quote: Quote
    rule: str
    runner_up: Quote | None = None
    owners: list[str] = attrs.Factory(list)
    #: Per producer quoted: the prefill seconds its new blocks would cost later requests.
    future_s: dict[str, float] = attrs.Factory(dict)
    group: str | None = None
    #: Every producer quoted, and what the choice held them to.
    quotes: Sequence[Quote] = ()
    target_s: float | None = None
    handoff_s: float = 0.0
    bound: Callable[[Quote], float] | None = None
    #: Chosen by the cache plan's rules (else by headroom alone).
    planned: bool = False

    @property
    def others(self) -> dict[str, str]:
        """Per producer quoted and not chosen: why."""
        out = {}
        for q in self.quotes:
            if q is self.quote:
                continue
            why = _why_not(q, self.target_s, self.handoff_s, self.bound or (lambda q: q.low))
            if why is None:
                if not self.planned:
                    why = "less headroom"
                elif self.rule in ("owner", "move") and q.engine not in self.owners:
                    why = f"not an owner of {self.group}"
                else:
                    future = self.future_s[q.engine]
                    why = (f"price {(q.predicted_s + future) * 1000:.1f} ms "
                           f"(TTFT {q.predicted_s * 1000:.1f} + later {future * 1000:.1f})")  # fmt: skip
            out[q.engine] = why
        return out


def choose_producer(
    quotes: Sequence[Quote],
    *,
    target_s: float | None,
    handoff_s: float,
    bound: Callable[[Quote], float],
    plan: CachePlan | None = None,
    ticket: PlanTicket | None = None,
    cached: Callable[[str], int] | None = None,
    prompt_tokens: int = 0,
) -> ProducerChoice:
    """Choose among producer ``quotes`` (see the module docstring). ``bound``: the
    prediction admission holds against the target (the low end, or the point)."""

    def headroom_key(q: Quote) -> tuple[bool, float]:
        return not q.delays, q.headroom

    if plan is None or ticket is None or target_s is None:
        ranked = sorted(quotes, key=headroom_key, reverse=True)
        return ProducerChoice(ranked[0], "headroom", ranked[1] if len(ranked) > 1 else None, quotes=ranked,
                              target_s=target_s, handoff_s=handoff_s, bound=bound)  # fmt: skip
    target = target_s

    owners = plan.owners(ticket, [q.engine for q in quotes], cached or _no_hits, prompt_tokens, target)
    future = {q.engine: plan.future_s(ticket, q.engine, q.cached_tokens or 0) for q in quotes}

    def price(q: Quote) -> float:
        return q.predicted_s + future[q.engine]

    def feasible(q: Quote, within: float = 1.0) -> bool:
        return not q.delays and bound(q) + handoff_s <= target and q.predicted_s + handoff_s <= within * target

    group = ticket.group
    chosen: Quote | None = None
    rule = ""
    owner_quotes = [q for q in quotes if q.engine in owners] if owners else []
    if group is not None and owner_quotes:
        most = max([q.cached_tokens or 0 for q in quotes])
        if group.young() or ticket.new_session:  # placed where it should live while it is short and new
            taking = [q for q in owner_quotes if feasible(q, OWNER_WITHIN)]
            if taking:
                chosen = min(taking, key=price)
                rule = "owner" if (chosen.cached_tokens or 0) >= most else "move"
        elif group.kind == "session":
            # A turn placed elsewhere would move the session there (its next turn finds
            # its history there): its owner keeps it while it holds most of it in time.
            taking = [q for q in owner_quotes
                      if (q.cached_tokens or 0) >= SESSION_BEHIND * most and feasible(q, OWNER_WITHIN)]  # fmt: skip
            if taking:
                chosen, rule = min(taking, key=price), "owner"
        if chosen is None and max([q.cached_tokens or 0 for q in owner_quotes]) < most and plan.remaining_turns(
                group) >= 1.0:  # fmt: skip
            # It lives elsewhere: it moves home at low load, while a miss still meets the target.
            taking = [q for q in owner_quotes
                      if q.queue_s <= LOW_LOAD * target and plan.low_load(q.engine) and feasible(q, MOVE_WITHIN)]
            if taking:
                chosen, rule = min(taking, key=price), "move"
    feasible_quotes = [q for q in quotes if feasible(q)]
    if chosen is not None:
        rest = sorted((q for q in feasible_quotes if q is not chosen), key=price)
    elif feasible_quotes:
        ranked = sorted(feasible_quotes, key=price)
        chosen, rest = ranked[0], ranked[1:]
        rule = "owner" if chosen.engine in owners else ("spill" if owners else "price")
    else:
        ranked = sorted(quotes, key=headroom_key, reverse=True)
        chosen, rest = ranked[0], []
        rule = "over_target"
    runner_up = rest[0] if rest else next((q for q in sorted(quotes, key=headroom_key, reverse=True)
                                           if q is not chosen), None)  # fmt: skip
    return ProducerChoice(chosen, rule, runner_up, owners, future, group=group.label() if group else None,
                          quotes=quotes, target_s=target_s, handoff_s=handoff_s, bound=bound, planned=True)  # fmt: skip


def _why_not(q: Quote, target_s: float | None, handoff_s: float, bound: Callable[[Quote], float]) -> str | None:
    """Why ``q``'s producer cannot take the request within the target (None: it can)."""
    if q.delays:
        return f"would make {q.delays} request(s) queued there miss the TTFT target"
    if target_s is not None and bound(q) + handoff_s > target_s:
        return f"TTFT {(bound(q) + handoff_s) * 1000:.1f} ms over the target"
    return None


def explain(
    choice: ProducerChoice,
    consumer: Quote,
    consumer_runner_up: Quote | None,
    *,
    handoff_s: float,
    unpriced: Mapping[str, str],
    transfer_s_per_token: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The journal's account of one placement (an attempt's ``placement``)."""
    p = choice.quote
    future = choice.future_s
    out: dict[str, Any] = {
        "rule": choice.rule,
        "group": choice.group,
        "owners": choice.owners or None,
        "producer": quote_fields(p, producer=True, eviction_s=future.get(p.engine, 0.0)),
        "runner_up": None if choice.runner_up is None else quote_fields(
            choice.runner_up, producer=True, eviction_s=future.get(choice.runner_up.engine, 0.0)),
        "others": {**choice.others, **unpriced} or None,
    }

    def consumer_fields(q: Quote) -> dict[str, Any]:
        per_token = (transfer_s_per_token or {}).get(q.engine)
        extra: dict[str, Any] = {"handoff_s": handoff_s if q is consumer else None}
        if per_token is not None:
            extra["transfer_s_per_token"] = per_token
        return quote_fields(q, producer=False, **extra)

    out["consumer"] = consumer_fields(consumer)
    out["consumer_runner_up"] = consumer_fields(consumer_runner_up) if consumer_runner_up is not None else None
    if not math.isfinite(consumer.predicted_s):
        out["consumer"]["predicted_tpot_s"] = None
    return out
