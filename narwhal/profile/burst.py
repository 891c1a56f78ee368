"""How a producer queues prompts: one whole prompt a step, or the waiting ones together.

An engine without chunked prefill computes one prompt a step: prompts that arrive
together are answered one prefill apart, each paying its own fixed cost. vLLM's V1
scheduler (chunked prefill) puts every waiting prompt into its next step, up to the
step's token budget: prompts that arrive together are answered together. A prompt
alone looks the same on both, so the prefill sweep cannot tell them apart; placement
must, to price a producer's queue (:mod:`narwhal.router.batching`).

The probe sends ``prompts`` new prompts of one length at once, ``bursts`` times, and
records when each answer came, from the burst's first send. Every answer of a serial
engine needs a prefill of its own after the one before it, so successive answers lie
about the TTFT curve's ``t(L)`` apart; a batching engine answers the prompts of one
step within moments of each other. :func:`queue_verdict`: ``batched`` when the median
gap between successive answers is under :data:`BATCHED_GAP` of ``t(L)``, else
``serial``. The verdict is derived from the recorded answers and the fitted curve, so
``narwhal check`` and a refit derive it again from the sidecar.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any, Final

import trio

from narwhal.engines.client import EngineClient
from narwhal.errors import EngineError
from narwhal.profile.progress import Progress
from narwhal.profile.store import QueueKind
from narwhal.profile.sweep import PromptFactory, SweepRejected, measure_prefill

__all__ = ["BATCHED_GAP", "burst_probe", "median_gap", "queue_verdict"]

#: A producer batches when the median gap between the answers of a burst is under this
#: share of one prompt's prefill (a serial engine's gaps are one prefill each).
BATCHED_GAP: Final = 0.5


async def burst_probe(
    client: EngineClient,
    length: int,
    record: dict[str, Any],
    *,
    prompts: int,
    bursts: int,
    prompt: PromptFactory,
    timeout_s: float,
    progress: Progress,
) -> None:
    """Send ``bursts`` bursts of ``prompts`` new ``length``-token prompts at once.

    ``record`` receives the length, the burst size and, per burst, the answers' times
    in seconds from its first send, in order, as they are measured.

    Raises:
        EngineError: a request failed (the first failure of the burst).
        SweepRejected: the engine did not process a prompt as sent.
    """
    record.update(length=length, prompts=prompts, bursts=[])
    for b in range(bursts):
        progress.status(client.name, f"prefill queue: burst {b + 1}/{bursts} of {prompts} "
                                     f"{length}-token prompts")  # fmt: skip
        # Tokenized first, so that the burst's requests leave together.
        ids = [await prompt(length) for _ in range(prompts)]
        record["bursts"].append(await _burst(client, ids, timeout_s))


async def _burst(client: EngineClient, prompts: list[list[int]], timeout_s: float) -> list[float]:
    """Prefill ``prompts`` at once; the answers' times from the first send, in order."""
    answers: list[dict[str, Any]] = []
    failures: list[EngineError | SweepRejected] = []

    async def one(sent: list[int]) -> None:
        try:
            answers.append(await measure_prefill(client, sent, timeout_s))
        except (EngineError, SweepRejected) as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        for sent in prompts:
            nursery.start_soon(one, sent)
    if failures:
        raise failures[0]
    first = min(a["started_at"] for a in answers)
    return sorted(a["started_at"] + a["ttft_s"] - first for a in answers)


def median_gap(bursts: Sequence[Sequence[float]]) -> float:
    """The median gap in seconds between successive answers of a burst.

    Raises:
        ValueError: no burst has two answers.
    """
    gaps = [later - earlier for times in bursts for earlier, later in itertools.pairwise(times)]
    if not gaps:
        raise ValueError("no burst has two answers")
    return float(statistics.median(gaps))


def queue_verdict(bursts: Sequence[Sequence[float]], prefill_s: float) -> QueueKind:
    """``batched`` or ``serial``, from the bursts' answers and one prompt's prefill
    (``t(L)`` of the TTFT curve at the bursts' length).

    Raises:
        ValueError: no burst has two answers.
    """
    return "batched" if median_gap(bursts) < BATCHED_GAP * prefill_s else "serial"
