"""Engine load as the engines report it: how several router processes share a fleet.

Each router process knows only its own reservations. With ``server.engine_load_poll_s``
set (``narwhal serve --workers N`` sets it), every process reads each engine's
``/metrics`` (``vllm:num_requests_running`` and ``vllm:num_requests_waiting``) at that
period, and placement ranks engines by the larger of its own reservations and what the
engine reports, so the processes agree on engine load without shared memory.
"""

from __future__ import annotations

import logging

import trio

from narwhal.errors import EngineError
from narwhal.router.state import RouterState

__all__ = ["poll_engine_load"]

log = logging.getLogger("narwhal.router.loadpoll")


async def poll_engine_load(
    state: RouterState, period_s: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Refresh ``placement.loads[*].engine_running/waiting`` every ``period_s``, until cancelled."""
    loads = state.placement.loads

    async def one(name: str) -> None:
        try:
            with trio.move_on_after(period_s):
                metrics = await state.clients[name].metrics()
                load = loads.get(name)
                if load is None:  # it left the fleet meanwhile
                    return
                load.engine_running = int(metrics.running)
                load.engine_waiting = int(metrics.waiting)
        except EngineError as exc:
            log.debug("engine %s metrics unavailable: %s", name, exc)

    task_status.started()
    while True:
        async with trio.open_nursery() as nursery:
            for name in list(state.engines):
                nursery.start_soon(one, name)
        await trio.sleep(period_s)
