"""The simulated engine: identity, lifecycle, KV handoffs and faults around a scheduler.

Batching and the latency model live in :mod:`narwhal.testing.scheduler`; one
:class:`~narwhal.testing.scheduler.Scheduler` serves each engine *generation*.
:meth:`SimEngine.restart` starts a new generation (new engine id and process start
time, fresh metrics); held handoffs and open streams of the old one are dropped.

Producer: a request with ``kv_transfer_params.do_remote_decode`` finishes by length and
answers with a NixlConnector descriptor naming this generation; its prompt's blocks stay
held until a consumer reads them or ``handoff_ttl_s`` passes. Consumer: a complete
descriptor (``remote_block_ids`` and all of ``remote_engine_id``, ``remote_request_id``,
``remote_host``, ``remote_port``) is fetched through the :class:`KVFabric` in the
request's own task (``transfer_s_per_token * L``), after which the request joins the
decode batch. An incomplete descriptor is ignored (logged, prompt recomputed), as vLLM
does; one naming an unknown endpoint, a gone generation or an unheld request fails like
vLLM: a 500 after 5 s, and ``vllm:nixl_num_failed_transfers_total`` goes up.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import trio

from narwhal.config import EngineConfig, FaultSpec, SimConfig
from narwhal.engines.kvevents import KVEvent
from narwhal.testing.faults import FaultPlan, Faults, Leg
from narwhal.testing.kvfabric import Handoff, KVFabric, TransferError
from narwhal.testing.kvpublisher import SimKVPublisher
from narwhal.testing.metrics import MetricsSnapshot, render_metrics
from narwhal.testing.scheduler import (
    EngineRestarted,
    GenerateParams,
    Generation,
    Scheduler,
    Seq,
    SimStats,
    TokenEvent,
    open_seq_channel,
)

__all__ = [
    "NIXL_FAILURE_DELAY_S",
    "EngineRestarted",
    "GenerateParams",
    "Generation",
    "SimEngine",
    "SimError",
    "SimStats",
    "TokenEvent",
]

log = logging.getLogger(__name__)

#: How long a consumer takes to give up on a transfer from a producer it cannot reach.
NIXL_FAILURE_DELAY_S: Final = 5.0
#: Most request bodies ``SimEngine.requests_seen`` keeps.
REQUESTS_SEEN_LIMIT: Final = 100_000

_ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError"}
_DESCRIPTOR_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                    "remote_port")  # fmt: skip


class SimError(Exception):
    """An error the engine answers with an HTTP status and vLLM's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        default = "InternalServerError" if self.status >= 500 else "BadRequestError"
        kind = _ERROR_TYPES.get(self.status, default)
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.status}}  # fmt: skip


class SimEngine:
    """A simulated vLLM engine (see the module docstring).

    Args:
        config: The engine's config; its ``sim`` block must be set.
        clock: Engine time in seconds (durations are slept on Trio's clock).
        fabric: The KV fabric shared with the engine's peers.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        clock: Callable[[], float] = trio.current_time,
        fabric: KVFabric | None = None,
    ) -> None:
        if config.sim is None:
            raise ValueError(f"engine {config.name!r} has no sim block")
        self.config = config
        self.sim: SimConfig = config.sim
        self.name = config.name
        self.fabric = fabric if fabric is not None else KVFabric()
        self._clock = clock
        base = f"{self.sim.seed}/{self.name}"
        self._noise_rng = random.Random(f"{base}/noise")
        self._id_rng = random.Random(f"{base}/ids")
        self.faults = FaultPlan(self.sim.faults, rng=random.Random(f"{base}/faults"))
        self.stats = SimStats()
        #: Bodies of the generation requests received, oldest first (the oldest half is
        #: dropped past ``REQUESTS_SEEN_LIMIT`` so a long simulation stays bounded).
        self.requests_seen: list[Any] = []
        #: The ``x-request-id`` of each of those requests (None when it had none), alike.
        self.request_ids_seen: list[str | None] = []
        #: The header fields (names lower-cased) of each of those requests, alike.
        self.headers_seen: list[list[tuple[str, str]]] = []
        self.generation = 0
        self.engine_id = ""
        self.process_start_time = 0.0
        self._epoch: float | None = None
        self._nursery: trio.Nursery | None = None
        self._sched_scope: trio.CancelScope | None = None
        self._down = 0
        self._abort_connections: Callable[[], None] | None = None
        #: The KV-event publisher while the engine runs with ``kv_events`` configured.
        self.kv_publisher: SimKVPublisher | None = None
        self.scheduler = self._new_generation()

    # ------------------------------------------------------------ identity and time

    def now(self) -> float:
        """Engine time."""
        return self._clock()

    def wall_time(self) -> float:
        """Unix time that advances with engine time (virtual in tests)."""
        if self._epoch is None:
            try:
                self._epoch = time.time() - self._clock()
            except RuntimeError:  # outside a Trio run
                return time.time()
        return self._epoch + self._clock()

    def random_hex(self, n: int) -> str:
        """``n`` hex digits from the engine's seeded id stream."""
        return f"{self._id_rng.getrandbits(4 * n):0{n}x}"

    @property
    def kv_endpoint(self) -> tuple[str, int] | None:
        """``(kv_host, kv_port)`` of the engine's connector, if it has one."""
        c = self.config.connector
        return (c.kv_host, c.kv_port) if c is not None else None

    @property
    def num_blocks(self) -> int:
        """KV blocks of the engine."""
        return self.scheduler.num_blocks

    def _new_generation(self) -> Scheduler:
        self.generation += 1
        self.engine_id = str(uuid.UUID(int=self._id_rng.getrandbits(128), version=4))
        start = round(self.wall_time(), 2)
        self.process_start_time = max(start, self.process_start_time + 0.01)
        if self.kv_publisher is not None:
            self.kv_publisher.restart()
        return Scheduler(self.sim, clock=self._clock, noise_rng=self._noise_rng, stats=self.stats,
                         engine_id=self.engine_id, describe=self._descriptor,
                         publish=self._publish_kv_events)  # fmt: skip

    def _publish_kv_events(self, events: list[KVEvent]) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.publish(events)

    def attach(self, *, abort_connections: Callable[[], None] | None = None) -> None:
        """Hook into the transport: how to drop every open connection (engine death)."""
        self._abort_connections = abort_connections

    # ------------------------------------------------------------ gauges and metrics

    @property
    def running(self) -> int:
        """Requests in the batch (vLLM's ``num_requests_running``)."""
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        """Requests not yet running, KV fetches included (``num_requests_waiting``)."""
        return self.scheduler.waiting

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (held handoffs included)."""
        return self.scheduler.kv_usage

    @property
    def held_handoffs(self) -> dict[str, Handoff]:
        """The handoffs this producer holds, by request id."""
        return dict(self.scheduler.held)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache, as vLLM's ``/reset_prefix_cache`` does.

        Returns:
            False (and nothing dropped) while a request or a held handoff holds blocks.
        """
        return self.scheduler.reset_prefix_cache()

    def metrics_text(self) -> str:
        """The engine's ``/metrics`` page."""
        sched = self.scheduler
        sched.expire(self.now())
        snap = MetricsSnapshot(
            model_name=self.sim.model,
            process_start_time=self.process_start_time,
            running=sched.running,
            waiting=sched.waiting,
            kv_usage=sched.kv_usage,
            block_size=self.sim.block_size,
            num_gpu_blocks=sched.num_blocks,
            kv_cache_size_tokens=sched.num_blocks * self.sim.block_size,
            max_model_len=self.sim.max_model_len,
            prefix_caching=self.sim.prefix_caching,
            has_connector=self.config.connector is not None,
        )
        return render_metrics(snap, sched.metrics)

    # ------------------------------------------------------------ faults

    def inject(self, spec: FaultSpec) -> None:
        """Arm one more fault.

        Arming ``refuse_connection`` also drops the open connections, so that clients
        holding keep-alive connections have to connect again.
        """
        self.faults.add(spec)
        if spec.kind == "refuse_connection" and self._abort_connections is not None:
            self._abort_connections()

    def clear_faults(self) -> None:
        """Disarm every fault."""
        self.faults.clear()

    def draw_faults(self, leg: Leg) -> Faults:
        """Roll the faults of one request on ``leg`` (counted in ``stats.faults``)."""
        faults = self.faults.draw(leg)
        for spec in faults:
            self.stats.faults[spec.kind] = self.stats.faults.get(spec.kind, 0) + 1
        return faults

    def take_connection_refusal(self) -> bool:
        """Whether to refuse one connection attempt now (spends ``refuse_connection``)."""
        if self._down:
            return True
        refused = self.faults.take_refusal()
        if refused:
            self.stats.faults["refuse_connection"] = self.stats.faults.get("refuse_connection", 0) + 1
        return refused

    @property
    def down(self) -> bool:
        """Whether the engine is down between generations (refusing every connection)."""
        return self._down > 0

    def record_request(
        self, body: Any, request_id: str | None = None, headers: list[tuple[str, str]] | None = None
    ) -> None:
        """Log a received request body (``requests_seen``), its id (``request_ids_seen``)
        and its header fields (``headers_seen``)."""
        self.requests_seen.append(body)
        self.request_ids_seen.append(request_id)
        self.headers_seen.append(headers if headers is not None else [])
        if len(self.requests_seen) > REQUESTS_SEEN_LIMIT:
            del self.requests_seen[: REQUESTS_SEEN_LIMIT // 2]
            del self.request_ids_seen[: REQUESTS_SEEN_LIMIT // 2]
            del self.headers_seen[: REQUESTS_SEEN_LIMIT // 2]

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the scheduler (and serve KV handoffs) until cancelled."""
        if self._nursery is not None:
            raise RuntimeError(f"engine {self.name!r} is already running")
        self.process_start_time = round(self.wall_time(), 2)
        kv = self.kv_endpoint
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if kv is not None:
                self.fabric.register(kv[0], kv[1], self)
            try:
                if self.config.kv_events is not None:
                    self.kv_publisher = SimKVPublisher(self.config.kv_events, wall_time=self.wall_time,
                                                       connect=self.sim.kv_events_connect)  # fmt: skip
                    self.kv_publisher.bind()
                    nursery.start_soon(self.kv_publisher.serve_replay)
                task_status.started()
                while True:
                    with trio.CancelScope() as scope:
                        self._sched_scope = scope
                        await self.scheduler.run()
            finally:
                if kv is not None:
                    self.fabric.unregister(kv[0], kv[1], self)
                self.scheduler.break_all()
                if self.kv_publisher is not None:
                    self.kv_publisher.close()
                    self.kv_publisher = None
                self._nursery = self._sched_scope = None

    def trigger_restart(self, downtime_s: float = 0.0) -> None:
        """Restart now; the downtime (refusing connections) runs in the background."""
        if downtime_s > 0 and self._nursery is not None:
            self._down += 1
            self._nursery.start_soon(self._come_back_after, downtime_s)
        self._restart_now()

    async def restart(self, *, downtime_s: float = 0.0) -> None:
        """A new generation: new engine id and start time; handoffs and streams dropped.

        With ``downtime_s`` the engine refuses connections that long first (returning
        when it is back).
        """
        if downtime_s > 0:
            self._down += 1
        self._restart_now()
        if downtime_s > 0:
            await self._come_back_after(downtime_s)

    async def _come_back_after(self, seconds: float) -> None:
        try:
            await trio.sleep(seconds)
        finally:
            self._down -= 1

    def _restart_now(self) -> None:
        self.scheduler.break_all()
        self.scheduler = self._new_generation()
        self.stats.restarts += 1
        if self._sched_scope is not None:
            self._sched_scope.cancel()
        if self._abort_connections is not None:
            self._abort_connections()

    # ------------------------------------------------------------ requests

    def _is_remote(self, kv: Mapping[str, Any] | None) -> bool:
        if self.config.connector is None or not isinstance(kv, Mapping):
            return False
        if kv.get("do_remote_prefill") is not True:
            return False
        if any(kv.get(k) is None for k in _DESCRIPTOR_KEYS):
            log.warning("Got invalid KVTransferParams: %r; recomputing the prompt", dict(kv))
            self.stats.invalid_descriptors += 1
            return False
        return True

    @asynccontextmanager
    async def generate(self, params: GenerateParams) -> AsyncIterator[Generation]:
        """Submit one request; yields its :class:`Generation` once it is accepted.

        Leaving the block before the last token aborts the request and frees its KV.

        Raises:
            SimError: the request can never fit the KV cache (400), or a KV transfer
                from the named producer failed (500, after 5 s).
            EngineRestarted: the engine restarted while the request waited.
        """
        received = self.now()
        if self.sim.frontend_s_per_token > 0:  # the API server's own work, beside the steps
            await trio.sleep(len(params.prompt_ids) * self.sim.frontend_s_per_token)
        sched = self.scheduler
        need = sched.blocks_for(len(params.prompt_ids) + params.max_tokens)
        if need > sched.pool.num_blocks:
            raise SimError(400, f"request needs {need} KV blocks; the cache has {sched.pool.num_blocks}")
        kv = params.kv_transfer_params
        send, recv = open_seq_channel()
        seq = Seq(
            params=params,
            arrival=self.now(),
            received=received,
            send=send,
            remote=self._is_remote(kv),
            want_descriptor=self.config.connector is not None
            and isinstance(kv, Mapping)
            and kv.get("do_remote_decode") is True,
        )
        self.stats.requests += 1
        sched.submit(seq)
        try:
            with recv:
                if seq.remote:
                    await self._fetch(sched, seq)
                yield Generation(seq, recv)
        finally:
            sched.abort(seq)

    async def _fetch(self, sched: Scheduler, seq: Seq) -> None:
        kv = seq.params.kv_transfer_params
        assert kv is not None
        await seq.admitted.wait()
        if seq.broken:
            raise EngineRestarted("engine restarted")
        start = self.now()
        try:
            producer = self.fabric.lookup(str(kv["remote_host"]), _as_port(kv["remote_port"]))
            if producer is None:
                raise TransferError(f"no KV endpoint at {kv['remote_host']}:{kv['remote_port']}")
            handoff = producer.claim_handoff(
                str(kv["remote_engine_id"]), str(kv["remote_request_id"]), kv["remote_block_ids"]
            )
            try:
                # Only the blocks this engine does not hold itself are pulled.
                delay = (seq.prompt_len - seq.cached_tokens) * self.sim.transfer_s_per_token
                await trio.sleep(delay + seq.params.extra_transfer_delay_s)
                if seq.broken:
                    raise EngineRestarted("engine restarted")
            except BaseException:
                producer.unclaim_handoff(handoff)
                raise
            producer.finish_handoff(handoff)
        except TransferError as exc:
            sched.release(seq, "failed")
            log.warning("KV transfer for %s failed: %s", seq.params.request_id, exc)
            await trio.sleep(NIXL_FAILURE_DELAY_S)
            sched.metrics.nixl_failed_transfers += 1
            self.stats.failed_transfers += 1
            raise SimError(500, f"KV transfer failed: {exc}") from None
        pulled = seq.prompt_len - seq.cached_tokens
        for source, n in (("external_kv_transfer", pulled), ("local_cache_hit", seq.cached_tokens)):
            sched.metrics.prompt_tokens_by_source[source] += n
            self.stats.prompt_tokens[source] += n
        sched.metrics.xfer_time.observe(self.now() - start)
        self.stats.transfers += 1
        sched.join(seq)

    # ------------------------------------------------------------ producer side (KVProducer)

    def _descriptor(self, h: Handoff) -> dict[str, Any]:
        kv = self.kv_endpoint
        assert kv is not None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(h.block_ids)],
            "remote_engine_id": h.engine_id,
            "remote_request_id": h.request_id,
            "remote_host": kv[0],
            "remote_port": kv[1],
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": h.num_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }

    def claim_handoff(self, engine_id: str, request_id: str, block_ids: Sequence[object]) -> Handoff:
        """Reserve a held handoff for a consumer; raises :class:`TransferError`."""
        if engine_id != self.engine_id:
            raise TransferError(f"engine {engine_id} is not running at this endpoint")
        return self.scheduler.claim(request_id, block_ids)

    def unclaim_handoff(self, handoff: Handoff) -> None:
        """Give a claimed handoff back unread."""
        self.scheduler.unclaim(handoff)

    def finish_handoff(self, handoff: Handoff) -> None:
        """The consumer read the blocks: free them; raises :class:`TransferError`."""
        self.scheduler.finish_read(handoff)


def _as_port(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return -1
