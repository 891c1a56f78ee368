"""Copying a busy prefix to another producer, in the background.

Priced placement decides when a prompt's cached prefix should also be held by another
producer (:meth:`narwhal.router.pricing.PricedPlacement.replication`); this module
does the copy: a one-token request of the prefix's token ids alone, sent to that
producer without any KV transfer (the same request as the prefill leg of a
same-worker decode, ``max_tokens: 1``), which makes the engine compute the prefix and
cache its blocks as it would for any prompt. The request is no client's: it is not
journaled, and its failure is logged. The producer's approximate view holds the
copy's blocks from its start, as the engine does from its scheduling (an exact view
learns them from the engine's KV events).

Each copy's predicted prefill stays reserved on the producer while it runs, so that
the requests placed behind it are priced with it, and is released when it ends, done
or failed. A copy is bounded by ``engine.first_token_timeout_s``. The copies run in
the router's nursery: when the router stops they are cancelled and nothing is left.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import trio

from narwhal.errors import EngineError
from narwhal.router.pricing import PricedPlacement
from narwhal.router.state import RouterState

__all__ = ["PrefixReplicator"]

log = logging.getLogger("narwhal.router.replicate")


class PrefixReplicator:
    """Runs the prefix copies that priced placement asks for (see the module docstring)."""

    def __init__(self, state: RouterState, placement: PricedPlacement) -> None:
        self.state = state
        self.placement = placement
        self._nursery: trio.Nursery | None = None
        self._ids = itertools.count(1)
        #: Copies started, completed and failed (for tests and logs).
        self.counts = {"started": 0, "done": 0, "failed": 0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take copies until cancelled (start it with ``nursery.start``)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.placement.replicate = self.submit
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.placement.replicate = None
                self._nursery = None
                nursery.cancel_scope.cancel()

    def submit(self, producer: str, ids: Sequence[int], model: str | None, work_s: float) -> bool:
        """Start copying prefix ``ids`` to ``producer``; False when it cannot start."""
        if self._nursery is None or producer not in self.state.clients or not ids:
            return False
        self.counts["started"] += 1
        self._nursery.start_soon(self._copy, producer, list(ids), model, work_s)
        return True

    async def _copy(self, producer: str, ids: list[int], model: str | None, work_s: float) -> None:
        state = self.state
        body: dict[str, object] = {"prompt": ids}
        if model is not None:
            body["model"] = model
        rid = f"narwhal-replicate-{next(self._ids)}"
        state.in_flight_by_engine[producer] = state.in_flight_by_engine.get(producer, 0) + 1
        # The engine takes the copy's blocks when it schedules it (evicting what they
        # displace) and caches them as it computes: the view holds them from now on.
        hold = state.prefix.hold(producer, ids, 1)
        try:
            with trio.move_on_after(self.state.config.engine.first_token_timeout_s) as scope:
                await state.clients[producer].prefill(body, request_id=rid, leg="replicate", transfer=False)
            if scope.cancelled_caught:
                self.counts["failed"] += 1
                log.warning("copying a %d-token prefix to %s timed out", len(ids), producer)
                return
            self.counts["done"] += 1
            log.info("copied a %d-token prefix to %s (%s)", len(ids), producer, rid)
        except EngineError as err:
            self.counts["failed"] += 1
            log.warning("copying a %d-token prefix to %s failed: %s", len(ids), producer, err.message)
        finally:
            if hold is not None:
                hold.release()
            if producer in state.in_flight_by_engine:
                state.in_flight_by_engine[producer] -= 1
            self.placement.copied(producer, work_s)
