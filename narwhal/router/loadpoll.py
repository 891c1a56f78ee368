"""Engine load as the engines report it: how several routers share a fleet.

Each router process knows only its own reservations. Replicas behind a load balancer
and the workers of ``narwhal serve --workers N`` place on the same engines, so each
must count the load the others placed. The engines already know it: with
``server.engine_load_poll_s`` set (``--workers`` > 1 and ``--engine-load-poll`` set it),
every process reads each engine's ``/metrics`` (``vllm:num_requests_running`` and
``vllm:num_requests_waiting``) at that period, together with how many of its own legs
the engine was serving at that moment. Placement counts its own reservations at once
and adds the others' share, reported minus own (see :mod:`narwhal.router.placement`):
no shared store, no coordination between replicas, any number of them.

The cost is one ``GET /metrics`` per engine per period per router process: N
processes and E engines at period T make N*E/T requests a second fleet-wide, E/T per
process and N/T per engine (a vLLM exposition is about 60 KB; the poll parses only
the load gauges, about a sixteenth of parsing it all). What the others placed is
seen up to one period late.

An engine whose ``/metrics`` fails keeps its last report for
:data:`STALE_AFTER_PERIODS` periods; after that its others' share is unknown and
counted as none (placement then sees only this router's reservations there). One that
answers with metrics the router cannot use (a gauge that is no number: ``+Inf``
requests running, a NaN) loses its report at once: the client counts and logs the
fault, and the engine's others' share is counted as none until it reports sound ones.
"""

from __future__ import annotations

import logging

import trio

from narwhal.errors import EngineError, EngineProtocolError
from narwhal.router.state import RouterState

__all__ = ["STALE_AFTER_PERIODS", "poll_engine_load"]

log = logging.getLogger("narwhal.router.loadpoll")

#: Failed periods after which an engine's last load report is dropped.
STALE_AFTER_PERIODS = 3


async def poll_engine_load(
    state: RouterState, period_s: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Feed every engine's reported load to placement every ``period_s``, until cancelled."""
    placement = state.placement
    last_ok: dict[str, float] = {}

    async def one(name: str) -> None:
        client = state.clients.get(name)
        if client is None:
            return
        try:
            with trio.move_on_after(period_s):
                metrics = await client.load()
                # This router's legs on the engine as it answered: the part of its
                # report that is ours (our reservations count already).
                own = state.in_flight_by_engine.get(name, 0)
                placement.engine_reported(name, int(metrics.running), int(metrics.waiting), own)
                last_ok[name] = trio.current_time()
                return
        except EngineProtocolError as exc:
            log.debug("engine %s metrics unusable: %s", name, exc)
            if last_ok.pop(name, None) is not None:
                placement.engine_reported(name, 0, 0, 0)
            return
        except EngineError as exc:
            log.debug("engine %s metrics unavailable: %s", name, exc)
        since = last_ok.get(name)
        if since is not None and trio.current_time() - since >= STALE_AFTER_PERIODS * period_s:
            del last_ok[name]
            placement.engine_reported(name, 0, 0, 0)
            log.warning(
                "engine %s: no load report for %d periods; other routers' load on it is not counted",
                name, STALE_AFTER_PERIODS,
            )  # fmt: skip

    task_status.started()
    while True:
        async with trio.open_nursery() as nursery:
            for name in list(state.engines):
                nursery.start_soon(one, name)
        for gone in last_ok.keys() - state.engines.keys():  # engines that left the fleet
            del last_ok[gone]
        await trio.sleep(period_s)
