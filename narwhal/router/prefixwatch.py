"""Keeping the router's prefix index (:mod:`narwhal.router.prefix`) in step with the engines.

For every engine, every ``PREFIX_REFRESH_S`` seconds, the engine's ``/metrics`` says
whether prefix caching is on (``cache_config_info``'s ``enable_prefix_caching``), its
block size and its capacity, and its ``process_start_time_seconds``:

- prefix caching on: the engine gets a view, exact when the fleet document names its
  ``kv_events`` endpoint, else approximate (from the prompts placed on it). No flag is
  needed; an engine that does not report the label gets no view.
- prefix caching off: its view is dropped.
- a new process start time: a new engine generation with an empty cache: its view is
  cleared.

An engine with a ``kv_events`` endpoint has a :class:`KVEventSubscriber` for the
router's lifetime, whose batches and resets go to the index. Unreachable engines keep
their view as it was until they answer again. Everything runs in one nursery: when the
router stops, the subscribers' tasks end, each closes its sockets (the SUB socket and
any replay DEALER) on the way out, and ``state.kv_subscribers`` is emptied.
"""

from __future__ import annotations

import logging
from typing import Final

import trio

from narwhal.engines.kvevents import KVEventSubscriber
from narwhal.errors import EngineError
from narwhal.router.state import RouterState

__all__ = ["PREFIX_REFRESH_S", "watch_prefix_caches"]

log = logging.getLogger("narwhal.router.prefix")

#: Seconds between two reads of an engine's cache configuration.
PREFIX_REFRESH_S: Final = 10.0


async def watch_prefix_caches(
    state: RouterState,
    *,
    refresh_s: float = PREFIX_REFRESH_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the engines' event subscribers and refresh the index's views, until cancelled.

    Reports started once every engine has been asked once.
    """
    index = state.prefix
    starts: dict[str, float | None] = {}

    async def refresh(name: str) -> None:
        try:
            with trio.move_on_after(state.config.engine.connect_timeout_s):
                metrics = await state.clients[name].metrics()
                block_size = metrics.block_size
                if metrics.prefix_caching is not True or block_size is None:
                    if index.enabled(name):
                        log.info("engine %s: prefix caching off; its prefix view is dropped", name)
                    index.disable(name)
                    return
                capacity = metrics.kv_cache_size_tokens or 0
                index.enable(name, block_size=block_size, capacity_tokens=capacity,
                             events=state.engines[name].kv_events is not None)  # fmt: skip
                start = metrics.process_start_time
                if name in starts and start != starts[name]:
                    log.info("engine %s: a new generation; its prefix view is cleared", name)
                    index.reset(name)
                starts[name] = start
        except EngineError as exc:
            log.debug("engine %s: cache configuration unavailable: %s", name, exc)

    async def refresh_all() -> None:
        async with trio.open_nursery() as nursery:
            for name in state.engines:
                nursery.start_soon(refresh, name)

    try:
        async with trio.open_nursery() as nursery:
            for name, engine in state.engines.items():
                kv = engine.kv_events
                if kv is None:
                    continue
                sub = KVEventSubscriber(
                    kv.endpoint,
                    replay_endpoint=kv.replay_endpoint,
                    topic=kv.topic,
                    on_batch=lambda _seq, batch, name=name: index.apply(name, batch),  # type: ignore[misc]
                    on_reset=lambda _why, name=name: index.reset(name),  # type: ignore[misc]
                )
                index.follow(name)
                state.kv_subscribers[name] = sub
                await nursery.start(sub.run)
            await refresh_all()
            task_status.started()
            while True:
                await trio.sleep(refresh_s)
                await refresh_all()
    finally:
        # The subscribers' tasks and sockets ended with the nursery; so does their listing.
        state.kv_subscribers.clear()
