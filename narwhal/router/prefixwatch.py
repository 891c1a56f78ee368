"""Keeping the router's prefix index (:mod:`narwhal.router.prefix`) in step with the engines.

For every engine, every ``PREFIX_REFRESH_S`` seconds while the router sends it requests
(an engine it sent none since the last read is read twice as long after, up to
``PREFIX_REFRESH_MAX_S``; a request brings it back within ``PREFIX_REFRESH_S``), the
engine's ``/metrics`` says whether prefix caching is on (``cache_config_info``'s
``enable_prefix_caching``), its block size and its capacity (``num_gpu_blocks`` less
vLLM's null block, else ``kv_cache_size_tokens`` over the block size), its
``process_start_time_seconds``, and its ``vllm:prefix_cache_hits`` and ``_queries``
counters (what the router's predicted hits are checked against,
:mod:`narwhal.router.cachecal`):

- prefix caching on: the engine gets a view, exact when the fleet document names its
  ``kv_events`` endpoint, else approximate (from the prompts placed on it). No flag is
  needed; an engine that does not report the label gets no view.
- prefix caching off: its view is dropped.
- a new process start time: a new engine generation with an empty cache: its view is
  cleared;
- metrics it cannot use (a gauge that is no number, a capacity label that is no
  integer): its hits are priced no more until it reports usable ones (the client
  counts and logs the fault).

An engine with a ``kv_events`` endpoint has a :class:`KVEventSubscriber` for the
router's lifetime, whose batches and resets go to the index. Unreachable engines keep
their view as it was until they answer again.

When the subscriber takes an engine's live stream for stale (its replay probes find
batches that never arrive live, or its socket fails), the engine's hits are priced
from an approximate view until live batches flow again: a warning names the engine
and the likely cause, a ``prefix`` event (``stale`` / ``live``) goes to the live
events, and ``/health`` and ``/fleet`` show it (``kv_events`` per engine).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Final

import trio

from narwhal.engines.kvevents import KVEventSubscriber
from narwhal.engines.metrics import EngineMetrics
from narwhal.errors import EngineError, EngineProtocolError
from narwhal.router.state import RouterState

__all__ = ["PREFIX_COUNTERS", "PREFIX_REFRESH_MAX_S", "PREFIX_REFRESH_S", "PrefixWatch", "capacity_blocks"]

log = logging.getLogger("narwhal.router.prefix")

#: Seconds between two reads of an engine's cache configuration while the router sends
#: it requests.
PREFIX_REFRESH_S: Final = 10.0
#: The longest wait between two reads of an engine the router sends nothing (an idle
#: router reads each engine's ~60 KB page once in this long, not every 10 s).
PREFIX_REFRESH_MAX_S: Final = 80.0

#: The counters of an engine's prefix cache, read with its configuration.
PREFIX_COUNTERS: Final = frozenset({"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"})


def capacity_blocks(metrics: EngineMetrics, block_size: int) -> int:
    """The blocks an engine's cache holds: its pool's ``num_gpu_blocks`` less the one vLLM
    sets aside (its null block), summed over its cores, else its capacity in tokens
    over ``block_size``."""
    total = 0
    for info in metrics.get("vllm:cache_config_info"):
        raw = info.label("num_gpu_blocks")
        try:
            blocks = int(float(raw)) if raw is not None else 0
        except ValueError:
            blocks = 0  # "None" when the engine does not know
        if blocks <= 1:
            return (metrics.kv_cache_size_tokens or 0) // block_size
        total += blocks - 1
    return total if total else (metrics.kv_cache_size_tokens or 0) // block_size


class PrefixWatch:
    """The engines' event subscribers and the periodic refresh of the index's views.

    Engines added to the fleet at run time are followed with :meth:`add`; engines that
    left it are let go with :meth:`remove`.
    """

    def __init__(
        self,
        state: RouterState,
        *,
        refresh_s: float = PREFIX_REFRESH_S,
        max_refresh_s: float = PREFIX_REFRESH_MAX_S,
        publish: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.state = state
        self.refresh_s = refresh_s
        self.max_refresh_s = max(max_refresh_s, refresh_s)
        self.publish = publish
        self._starts: dict[str, float | None] = {}
        self._scopes: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None
        #: Per engine: when its next read is due, and the wait before it.
        self._due: dict[str, float] = {}
        self._wait: dict[str, float] = {}
        #: Engines a request went to since their last read.
        self._used: set[str] = set()
        self._wake = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; reports started once every engine has been asked once."""
        journal = self.state.journal
        journal.add_listener(self._on_record)
        try:
            async with trio.open_nursery() as nursery:
                for name in list(self.state.engines):
                    await self._subscribe(nursery, name)
                await self._read_all(list(self.state.engines))
                self._nursery = nursery
                task_status.started()
                while True:
                    with trio.move_on_at(min(self._due.values(), default=math.inf)):
                        await self._wake.wait()
                    self._wake = trio.Event()
                    now = trio.current_time()
                    for name in self.state.engines:  # (one that joined without add(): read now)
                        self._due.setdefault(name, now)
                    await self._read_all([name for name, due in self._due.items() if due <= now])
        finally:
            journal.remove_listener(self._on_record)
            # The subscribers' tasks and sockets ended with the nursery; so does their listing.
            self._nursery = None
            self._scopes.clear()
            self.state.kv_subscribers.clear()

    async def add(self, name: str) -> None:
        """Follow engine ``name`` (new in the fleet): its events, and its cache configuration now."""
        if self._nursery is None or name in self._scopes:
            return
        await self._subscribe(self._nursery, name)
        await self._read(name)

    def remove(self, name: str) -> None:
        """Stop following engine ``name`` (it left the fleet)."""
        scope = self._scopes.pop(name, None)
        if scope is not None:
            scope.cancel()
        self.state.kv_subscribers.pop(name, None)
        self.state.prefix.unfollow(name)
        self._starts.pop(name, None)
        self._due.pop(name, None)
        self._wait.pop(name, None)
        self._used.discard(name)

    def _on_record(self, record: dict[str, Any]) -> None:
        """A request went to its producer and consumer: read them (and probe their KV
        events) at the usual interval again."""
        for name in (record.get("producer"), record.get("consumer")):
            if name is None or name not in self._due:
                continue
            self._used.add(name)
            due = trio.current_time() + self.refresh_s
            if self._due[name] > due:
                self._due[name] = due
                self._wake.set()
            sub = self.state.kv_subscribers.get(name)
            if sub is not None:
                sub.nudge()

    async def _subscribe(self, nursery: trio.Nursery, name: str) -> None:
        state, index = self.state, self.state.prefix
        engine = state.engines.get(name)
        kv = engine.kv_events if engine is not None else None
        if kv is None:
            return
        sub = KVEventSubscriber(
            kv.address,
            bind=kv.bind is not None,
            replay_endpoint=kv.replay_endpoint,
            topic=kv.topic,
            probe_interval_s=kv.probe_interval_s,
            on_batch=lambda _seq, batch: index.apply(name, batch),
            on_reset=lambda _why: index.reset(name, events_only=True),
            on_stale=lambda why: self._stale(name, why),
            name=name,
            limits=state.config.engine_limits,
            bad_input=state.bad_input,
        )
        index.follow(name)
        state.kv_subscribers[name] = sub
        scope = self._scopes[name] = trio.CancelScope()

        async def follow(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await sub.run(task_status=task_status)

        await nursery.start(follow)

    def _stale(self, name: str, why: str | None) -> None:
        index = self.state.prefix
        if why is None:
            log.info("engine %s: its KV events arrive live again; its exact prefix view prices its hits", name)
            index.live(name)
        else:
            log.warning("engine %s: its KV-event stream is stale, so its hits are priced from the "
                        "prompts placed on it until live events arrive: %s", name, why)  # fmt: skip
            index.stale(name)
        if self.publish is not None:
            self.publish({"type": "prefix", "engine": name, "event": "live" if why is None else "stale",
                          "at": time.time(), "detail": why})  # fmt: skip

    async def _refresh(self, name: str) -> None:
        state, index, starts = self.state, self.state.prefix, self._starts
        client = state.clients.get(name)
        if client is None:
            return
        try:
            with trio.move_on_after(state.config.engine.connect_timeout_s):
                # Only the samples the summary reads and the cache's counters (a tenth of
                # parsing the whole page).
                metrics = await client.metrics(PREFIX_COUNTERS)
                engine = state.engines.get(name)
                if engine is None:  # it left the fleet meanwhile
                    return
                block_size = metrics.block_size
                if metrics.prefix_caching is not True or block_size is None:
                    if index.enabled(name):
                        log.info("engine %s: prefix caching off; its prefix view is dropped", name)
                    index.disable(name)
                    return
                capacity = metrics.kv_cache_size_tokens or 0
                index.enable(name, block_size=block_size, capacity_tokens=capacity,
                             events=engine.kv_events is not None,
                             capacity_blocks=capacity_blocks(metrics, block_size))  # fmt: skip
                start = metrics.process_start_time
                if name in starts and start != starts[name]:
                    log.info("engine %s: a new generation; its prefix view is cleared", name)
                    index.reset(name)
                    state.cache_cal.forget(name)
                starts[name] = start
                state.cache_cal.observe_counters(name, metrics.total("vllm:prefix_cache_hits_total"),
                                                 metrics.total("vllm:prefix_cache_queries_total"))  # fmt: skip
        except EngineProtocolError as exc:
            # It answers, with nothing usable: what it said before is no longer to be trusted.
            log.debug("engine %s: cache configuration unusable: %s", name, exc)
            index.disable(name)
        except EngineError as exc:
            log.debug("engine %s: cache configuration unavailable: %s", name, exc)

    async def _read(self, name: str) -> None:
        """Refresh ``name`` and set when it is read next: after ``refresh_s`` if a request
        went to it since the last read, else after twice the last wait (up to
        ``max_refresh_s``)."""
        used = name in self._used or name not in self._wait
        self._used.discard(name)
        await self._refresh(name)
        if name not in self.state.engines:  # it left the fleet meanwhile
            self._due.pop(name, None)
            self._wait.pop(name, None)
            return
        wait = self.refresh_s if used else min(2 * self._wait[name], self.max_refresh_s)
        self._wait[name] = wait
        self._due[name] = trio.current_time() + wait

    async def _read_all(self, names: list[str]) -> None:
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(self._read, name)

