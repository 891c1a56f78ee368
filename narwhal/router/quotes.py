"""A candidate engine's price for one request, and the choice of a consumer among them.

A producer's quote is its predicted router TTFT (time spent, its queue, its own
prefill with the hit it has), a consumer's its predicted TPOT with the request added;
:func:`quote_fields` writes one into a placement's explanation
(:mod:`narwhal.router.explain`). This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

__all__ = ["CONSUMER_TIE", "Quote", "best_consumer", "quote_fields"]


@attrs.define
class Quote:
    """A candidate's price for one request.

    ``cached_tokens`` is the engine's predicted prefix-cache hit (None when no prefix
    index was asked): on a producer quote what it need not compute, on a consumer quote
    what it need not pull. ``own_s`` (a producer's own prefill time) is set on producer
    quotes.

    A value, never changed once made; not frozen only because every placement makes one
    per candidate, and a frozen class's ``__init__`` costs several times as much.
    """

    engine: str
    predicted_s: float
    headroom: float
    out_of_domain: bool = False
    cached_tokens: int | None = None
    own_s: float = 0.0
    low_s: float | None = None
    #: Time the request had spent in the router when it was quoted (a producer quote's).
    elapsed_s: float = 0.0
    #: Requests queued on the producer that this one would make miss the TTFT target
    #: (a producer computing its queued prompts together: they share its next step).
    delays: int = 0
    #: Tokens by which this request's KV would pass the consumer's capacity (a consumer
    #: quote when no priced consumer has room: no TPOT is predicted then).
    kv_over: int = 0
    #: The producer's queue ahead of the request, in predicted seconds (corrected).
    queue_s: float = 0.0

    @property
    def low(self) -> float:
        """The low end of the prediction (a producer quote's), else the prediction."""
        return self.predicted_s if self.low_s is None else self.low_s


def quote_fields(q: Quote, *, producer: bool, **extra: Any) -> dict[str, Any]:
    """A quote as an explanation's JSON object."""
    out: dict[str, Any] = {"engine": q.engine}
    if producer:
        out["predicted_ttft_s"] = round(q.predicted_s, 6)
        out["queue_s"] = round(q.queue_s, 6)
        out["own_s"] = round(q.own_s, 6)
    else:
        out["predicted_tpot_s"] = round(q.predicted_s, 6) if q.kv_over <= 0 else None
        if q.kv_over:
            out["kv_over_tokens"] = q.kv_over
    out["cached_tokens"] = q.cached_tokens
    for key, value in extra.items():
        out[key] = round(value, 6) if isinstance(value, float) else value
    return out


#: Consumers whose predicted TPOT lies within this share of the best one's are equal
#: for the choice: the decode fits are held to a few percent of error, so a smaller
#: difference says nothing about which decodes faster.
CONSUMER_TIE: Final = 0.01


def best_consumer(quotes: Sequence[Quote], transfer_s_per_token: Mapping[str, float] | None = None,
                  ttft_target_s: float | None = None) -> Quote:  # fmt: skip
    """The consumer to decode on: the most TPOT headroom; among consumers predicted
    equal (within :data:`CONSUMER_TIE` of the best TPOT, and on the same side of the
    target), the one whose own prefix cache holds most of the prompt, which pulls the
    fewest blocks from the producer; then the most headroom.

    Where the router has measured what a pulled token costs a consumer's handoff
    (``transfer_s_per_token``, :class:`narwhal.router.handoff.HandoffModel`) and the TTFT
    target is set, what a consumer's cache saves is priced too: among the consumers on
    the best one's side of the TPOT target, each gains the handoff seconds it saves
    against the one that holds the least of the prompt, as a share of the TTFT target
    (the client's first token comes after the handoff), on top of its TPOT headroom.
    Without that measure the pull is not priced (a transfer's time belongs to a
    (producer, consumer) pair and the network between them, which no profile measures
    per block) and a consumer's cached blocks only break a tie.
    """
    best = max(quotes, key=lambda q: q.headroom)
    side = [q for q in quotes if (q.headroom >= 0) == (best.headroom >= 0)]
    if transfer_s_per_token and ttft_target_s and len(side) > 1:
        least = min(q.cached_tokens or 0 for q in side)

        def score(q: Quote) -> float:
            saved = transfer_s_per_token.get(q.engine, 0.0) * ((q.cached_tokens or 0) - least)
            return q.headroom + saved / ttft_target_s

        return max(side, key=lambda q: (score(q), q.cached_tokens or 0))
    equal = [q for q in side if q.predicted_s <= best.predicted_s * (1.0 + CONSUMER_TIE)]
    return max(equal, key=lambda q: (q.cached_tokens or 0, q.headroom))
