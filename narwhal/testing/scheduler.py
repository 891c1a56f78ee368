"""Continuous batching of one simulated engine generation, on Trio time.

A FIFO waiting queue is admitted while the request's KV blocks (``prompt +
max_tokens`` tokens rounded up to whole blocks, reserved at admission so that no
preemption is ever needed) and ``max_num_seqs`` allow; otherwise requests wait. The
loop alternates one prefill (it produces the first token) with one decode step
(``c0 + c1*active + c2*resident_kv`` seconds, resident KV being prompt + generated
tokens of the batch; one token to every sequence), as vLLM does without chunked
prefill. With ``max_num_batched_tokens`` set, a prefill step is vLLM's chunked prefill:
the queued prompts in order, up to that many prompt tokens in all (a longer prompt in
chunks over several steps), for one fixed cost ``a`` and each chunk's own tokens; a
prompt's first token comes at the end of the step that computes its last chunk. ``noise`` multiplies every duration by a seeded lognormal factor. Blocks of
finished producer requests stay *held* for a consumer
(:class:`~narwhal.testing.kvfabric.Handoff`) until read or expired.

Prefix caching (``prefix_caching``) works as vLLM's (see
:mod:`narwhal.testing.blockpool`): at admission a request hits the longest run of
cached whole blocks of its prompt, short of the last prompt token (at least one token
is always computed); its prompt blocks are cached when it is admitted to the prefill
queue, before they are computed, as vLLM's ``allocate_slots`` caches the blocks a step
will compute when it schedules them (so a request admitted behind another that computes
the same prefix hits it), and generated tokens' blocks as they fill. A prefill of L prompt tokens of which k are cached costs
``a + b*(L-k) + c*(L**2 - k**2) + d*k`` seconds: the linear term pays the new tokens, the
quadratic term the attention pairs they add, each new token attending over the cached
prefix and the new tokens before it (``L**2 - k**2`` is the full prompt's pairs minus
the cached prefix's own), and ``d`` (0 by default) whatever a cached token still costs. A consumer pulls only the prompt blocks it does not hold.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import attrs
import trio

from narwhal.config import SimConfig
from narwhal.engines.kvevents import KVEvent
from narwhal.testing.blockpool import BlockPool, block_hashes, none_hash
from narwhal.testing.kvfabric import Handoff, TransferError
from narwhal.testing.metrics import EngineMetrics
from narwhal.testing.tokenizer import extend_key, generated_token, model_seed, prompt_key

__all__ = ["EngineRestarted", "GenerateParams", "Generation", "Scheduler", "SimStats", "TokenEvent"]


class EngineRestarted(Exception):
    """The engine generation a request ran on has gone (restart or shutdown)."""


@attrs.frozen(kw_only=True)
class GenerateParams:
    """One tokenised generation request.

    Attributes:
        prompt_ids: Prompt token ids.
        max_tokens: Tokens to generate (the engine always stops by length).
        request_id: The engine's internal request id (a descriptor's ``remote_request_id``).
        kv_transfer_params: The request's ``kv_transfer_params``, if any.
        extra_transfer_delay_s: Added to a consumer's KV transfer (``slow_transfer``).
        priority: The request's ``priority`` (lower first under the ``priority`` policy).
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    request_id: str
    kv_transfer_params: Mapping[str, Any] | None = None
    extra_transfer_delay_s: float = 0.0
    priority: int = 0


@attrs.frozen
class TokenEvent:
    """One generated token; ``finish_reason`` is set on the last one."""

    token_id: int
    index: int
    finish_reason: str | None
    at: float


@attrs.define
class SimStats:
    """Lifetime counters of one engine (kept across restarts) for tests to assert on."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    broken: int = 0
    prompt_tokens: dict[str, int] = attrs.field(
        factory=lambda: {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
    )
    generated_tokens: int = 0
    transfers: int = 0
    failed_transfers: int = 0
    invalid_descriptors: int = 0
    held_handoffs: int = 0
    expired_handoffs: int = 0
    active: int = 0
    waiting: int = 0
    max_concurrent: int = 0
    restarts: int = 0
    faults: dict[str, int] = attrs.field(factory=dict)
    #: Requests received per path (every route, not only generation).
    calls: dict[str, int] = attrs.field(factory=dict)


class _Broken:
    pass


_BROKEN: Final = _Broken()
State = Literal["waiting", "prefill", "fetching", "ready", "running", "finished", "aborted",
                "failed", "broken"]  # fmt: skip
_TERMINAL = frozenset({"finished", "aborted", "failed", "broken"})


@attrs.define(eq=False)
class Seq:
    """One request inside the scheduler."""

    params: GenerateParams
    #: When the scheduler got it (the engine core), and when the API server did: its
    #: TTFT and end-to-end latency count from there, as vLLM's count from the arrival
    #: its frontend stamps before the engine core sees the request.
    arrival: float
    received: float
    remote: bool
    want_descriptor: bool
    send: trio.MemorySendChannel[TokenEvent | _Broken]
    #: The key of the token context (the prompt, then each token generated): the next
    #: token is a function of it and the context's length (a greedy model's choice).
    key: int = 0
    state: State = "waiting"
    blocks: list[int] = attrs.field(factory=list)
    #: Prompt then generated token ids (generated ones only while prefix caching).
    token_ids: list[int] = attrs.field(factory=list)
    #: Hashes of the full blocks of ``token_ids`` computed so far.
    hashes: list[bytes] = attrs.field(factory=list)
    #: Leading blocks of ``blocks`` that are cached (hits, then blocks cached as they fill).
    num_cached_blocks: int = 0
    #: Prompt tokens served by this engine's prefix cache (whole blocks).
    cached_tokens: int = 0
    #: Prompt tokens whose KV exists: the cached ones, then each prefill chunk's.
    computed: int = 0
    generated: int = 0
    admitted: trio.Event = attrs.field(factory=trio.Event)
    #: When it was scheduled (admitted to the prefill queue, or to fetch its KV).
    scheduled_at: float | None = None
    first_at: float | None = None
    last_at: float | None = None
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.params.prompt_ids)

    @property
    def broken(self) -> bool:
        return self.state == "broken"


class Generation:
    """The output of one request: an async iterator of :class:`TokenEvent`.

    Iteration raises :class:`EngineRestarted` when the engine generation goes away.
    """

    def __init__(self, seq: Seq, recv: trio.MemoryReceiveChannel[TokenEvent | _Broken]) -> None:
        self._seq = seq
        self._recv = recv

    @property
    def request_id(self) -> str:
        return self._seq.params.request_id

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens this engine did not compute: its prefix-cache hit, plus the
        tokens a consumer pulled from a producer (vLLM's ``num_cached_tokens``)."""
        seq = self._seq
        return seq.prompt_len if seq.remote else seq.cached_tokens

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self._seq.params.prompt_ids

    @property
    def finish_reason(self) -> str | None:
        return self._seq.finish_reason

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """The producer's descriptor once finished (None unless one was made)."""
        return self._seq.kv_transfer_params

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenEvent:
        try:
            item = await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        if isinstance(item, _Broken):
            raise EngineRestarted("engine restarted")
        return item


def open_seq_channel() -> tuple[
    trio.MemorySendChannel[TokenEvent | _Broken], trio.MemoryReceiveChannel[TokenEvent | _Broken]
]:
    """The unbounded token channel of one request (the engine never blocks on a reader)."""
    return trio.open_memory_channel[TokenEvent | _Broken](math.inf)


class Scheduler:
    """Queues, KV blocks, held handoffs and the batching loop of one engine generation."""

    def __init__(
        self,
        sim: SimConfig,
        *,
        clock: Callable[[], float],
        noise_rng: random.Random,
        stats: SimStats,
        engine_id: str,
        describe: Callable[[Handoff], dict[str, Any]],
        publish: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        self.sim = sim
        #: Generated tokens follow the model, not the engine: its engines agree.
        self._model_seed = model_seed(sim.model)
        self.engine_id = engine_id
        self.clock = clock
        self.noise_rng = noise_rng
        self.stats = stats
        self.describe = describe
        self.metrics = EngineMetrics()
        self.num_blocks = sim.kv_capacity_tokens // sim.block_size
        self.held: dict[str, Handoff] = {}
        # vLLM's pool sets one block aside (its null block): the rest hold requests.
        self.pool = BlockPool(max(self.num_blocks - 1, 1), sim.block_size, caching=sim.prefix_caching)
        #: Receives the KV events of each step (vLLM's publisher); None drops them.
        self.publish = publish
        self._root = none_hash(sim.seed)
        self._live: set[Seq] = set()
        self._waiting: deque[Seq] = deque()
        self._prefill_q: deque[Seq] = deque()
        self._prefilling: list[Seq] = []
        self._fetching: set[Seq] = set()
        self._ready: list[Seq] = []
        self._running: list[Seq] = []
        self._wake = trio.Event()

    # ------------------------------------------------------------ gauges

    @property
    def running(self) -> int:
        """Requests in the batch (vLLM's ``num_requests_running``)."""
        return len(self._running) + len(self._ready) + len(self._prefilling)

    @property
    def waiting(self) -> int:
        """Requests not yet running, KV fetches included (``num_requests_waiting``)."""
        return len(self._waiting) + len(self._prefill_q) + len(self._fetching)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (held handoffs included)."""
        return self.pool.usage

    def refresh(self) -> None:
        s = self.stats
        s.active, s.waiting, s.held_handoffs = self.running, self.waiting, len(self.held)
        s.max_concurrent = max(s.max_concurrent, s.active)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.sim.block_size)

    # ------------------------------------------------------------ latency model

    def step_prefill_seconds(self, chunks: list[tuple[Seq, int, int]]) -> float:
        """Noise-free time of one prefill step computing prompt tokens ``start:end`` of
        each ``(seq, start, end)``: the fixed ``a`` once, each chunk its new tokens and the
        attention pairs they add, a prompt's cached tokens paid with its first chunk (one
        whole prompt of L tokens, k of them cached, costs the model's
        ``a + b*(L-k) + c*(L**2 - k**2) + d*k``)."""
        p = self.sim.prefill
        total = p.a
        for seq, start, end in chunks:
            total += p.b * (end - start) + p.c * (end * end - start * start)
            if start == seq.cached_tokens:
                total += p.d * start
        return total

    def step_seconds(self, active: int, resident_kv: int) -> float:
        """Noise-free decode step time."""
        d = self.sim.decode
        return d.c0 + d.c1 * active + d.c2 * resident_kv

    def _noisy(self, seconds: float) -> float:
        if self.sim.noise <= 0:
            return seconds
        return seconds * math.exp(self.noise_rng.gauss(0.0, self.sim.noise))

    # ------------------------------------------------------------ request lifecycle

    def submit(self, seq: Seq) -> None:
        """Queue ``seq`` for admission."""
        seq.key = prompt_key(seq.params.prompt_ids)
        if self.sim.prefix_caching:
            seq.token_ids = list(seq.params.prompt_ids)
            seq.hashes = block_hashes(seq.token_ids, self.sim.block_size, self._root)
        self._live.add(seq)
        waiting = self._waiting
        if self.sim.scheduling_policy == "priority" and waiting and waiting[-1].params.priority > seq.params.priority:
            # vLLM's priority queue: lower priority first, then arrival.
            at = next(i for i, other in enumerate(waiting) if other.params.priority > seq.params.priority)
            waiting.insert(at, seq)
        else:
            waiting.append(seq)
        self.refresh()
        self._wake.set()

    def join(self, seq: Seq) -> None:
        """A fetched (remote-prefilled) ``seq`` joins the batch at the next step."""
        self._fetching.discard(seq)
        self._cache_computed(seq, seq.prompt_len)
        seq.state = "ready"  # pragma: no mutate (equivalent: nothing reads "ready"; the loop's next pass runs it)
        self._ready.append(seq)
        self.refresh()
        self._wake.set()

    def release(self, seq: Seq, state: State) -> None:
        """Take a live ``seq`` out of every queue, free its blocks, close its channel."""
        for q in (self._waiting, self._prefill_q):
            if seq in q:
                q.remove(seq)
        self._fetching.discard(seq)
        for lst in (self._ready, self._running):
            if seq in lst:
                lst.remove(seq)
        self.pool.free(reversed(seq.blocks))  # tail first: a chain's tail is evicted first
        seq.blocks = []  # pragma: no mutate (equivalent: nothing reads a released sequence's blocks)
        seq.state = state
        self._live.discard(seq)
        seq.send.close()
        self.refresh()
        self._wake.set()

    def abort(self, seq: Seq) -> None:
        """The client went away: drop ``seq`` (no-op once it ended)."""
        if seq.state in _TERMINAL:
            return
        self.release(seq, "aborted")
        self.metrics.request_success["abort"] += 1
        self.stats.aborted += 1

    def break_all(self) -> None:
        """The generation ends: every live request sees :class:`EngineRestarted`."""
        for seq in list(self._live):
            with contextlib.suppress(trio.BrokenResourceError):  # its reader is gone
                seq.send.send_nowait(_BROKEN)
            self.release(seq, "broken")
            self.stats.broken += 1
            seq.admitted.set()
        self.held.clear()
        self.refresh()

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (vLLM's ``/reset_prefix_cache``); False while blocks are held.

        As in vLLM, the ``AllBlocksCleared`` event goes out with the next scheduler step:
        an idle engine publishes it when the next request arrives.
        """
        return self.pool.reset()

    # ------------------------------------------------------------ held handoffs

    def claim(self, request_id: str, block_ids: object) -> Handoff:
        """Reserve the held handoff of ``request_id`` for a reader."""
        self.expire(self.clock())
        h = self.held.get(request_id)
        if h is None:
            raise TransferError(f"request {request_id} holds no KV here (consumed or expired)")
        if h.claimed:
            raise TransferError(f"request {request_id} is already being read")
        if _flatten(block_ids) != list(h.block_ids):
            raise TransferError(f"block ids do not match those of request {request_id}")
        h.claimed = True
        return h

    def unclaim(self, handoff: Handoff) -> None:
        # (None is as false; True is killed by test_a_consumer_leaving_during_the_read_gives_the_blocks_back.)
        handoff.claimed = False  # pragma: no mutate (equivalent: None)
        self._wake.set()  # its expiry counts again

    def finish_read(self, handoff: Handoff) -> None:
        if self.held.get(handoff.request_id) is not handoff:
            raise TransferError("the producer restarted during the transfer")
        del self.held[handoff.request_id]
        self.pool.free(reversed(handoff.block_ids))
        self.refresh()
        self._wake.set()

    def expire(self, now: float) -> None:
        """Free held handoffs whose time is up."""
        for rid, h in list(self.held.items()):
            if not h.claimed and h.expires_at <= now:
                del self.held[rid]
                self.pool.free(reversed(h.block_ids))
                self.metrics.nixl_expired += 1
                self.stats.expired_handoffs += 1
        self.refresh()

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Schedule forever (cancel to stop)."""
        # (The first pass finds nothing running: either value starts the same.)
        prefill_turn = True  # pragma: no mutate (equivalent: see above)
        while True:
            now = self.clock()
            self.expire(now)
            self._admit(now)
            for seq in self._ready:
                seq.state = "running"
            self._running.extend(self._ready)
            self._ready.clear()
            self._publish()
            if self._prefill_q and (prefill_turn or not self._running):
                await self._run_prefill()
                # (None is as false; True, killed by test_prefill_and_decode_steps_take_turns.)
                prefill_turn = False  # pragma: no mutate (equivalent: None)
            elif self._running:
                await self._run_step()
                prefill_turn = True
            else:
                await self._idle()

    def _publish(self) -> None:
        """Hand the events of the step that ended to the publisher (one batch)."""
        events = self.pool.take_events()
        if events and self.publish is not None:
            self.publish(events)

    async def _idle(self) -> None:
        self._wake = trio.Event()
        expiries = [h.expires_at for h in self.held.values() if not h.claimed]
        timeout = min(expiries) - self.clock() if expiries else math.inf
        with trio.move_on_after(max(timeout, 0.0)):
            await self._wake.wait()

    def _admit(self, now: float) -> None:
        while self._waiting:
            seq = self._waiting[0]
            in_batch = len(self._live) - len(self._waiting)
            need = self.blocks_for(seq.prompt_len + seq.params.max_tokens)
            # At least one prompt token is computed: the hit stops short of the last one.
            hits = self.pool.lookup(seq.hashes[: (seq.prompt_len - 1) // self.sim.block_size])
            new = need - len(hits)
            if in_batch >= self.sim.max_num_seqs or new + self.pool.free_among(hits) > self.pool.num_free:
                break
            self._waiting.popleft()
            self.pool.touch(hits)
            seq.blocks = hits + self.pool.allocate(new)
            seq.num_cached_blocks = len(hits)
            seq.cached_tokens = seq.computed = len(hits) * self.sim.block_size
            if self.sim.prefix_caching:
                self.metrics.prefix_cache_queries += seq.prompt_len
                self.metrics.prefix_cache_hits += seq.cached_tokens
            self.metrics.queue_time.observe(now - seq.arrival)
            if seq.scheduled_at is None:  # vLLM keeps a preempted request's first scheduling
                seq.scheduled_at = now
            if seq.remote:
                seq.state = "fetching"
                self._fetching.add(seq)
            else:
                seq.state = "prefill"
                self._prefill_q.append(seq)
                # vLLM caches the full blocks a step will compute when it schedules them.
                self._cache_computed(seq, seq.prompt_len)
            seq.admitted.set()
        self.refresh()

    def _cache_computed(self, seq: Seq, computed: int) -> None:
        """Cache the blocks of ``seq`` now full of ``computed`` tokens."""
        if not self.sim.prefix_caching:
            return
        full = computed // self.sim.block_size
        if full > len(seq.hashes):
            seq.hashes = block_hashes(seq.token_ids[: full * self.sim.block_size],
                                      self.sim.block_size, self._root, start=seq.hashes)  # fmt: skip
        seq.num_cached_blocks = self.pool.cache(seq.blocks, seq.hashes, seq.token_ids,
                                                seq.num_cached_blocks, full)  # fmt: skip

    def _prefill_chunks(self) -> list[tuple[Seq, int, int]]:
        """Take the next prefill step's work off the queue: the head prompt whole, or with
        chunked prefill the queued prompts in order while the token budget lasts (the last
        one taken may be a chunk of its prompt)."""
        queue = self._prefill_q
        budget = self.sim.max_num_batched_tokens
        if budget is None:
            seq = queue.popleft()
            return [(seq, seq.computed, seq.prompt_len)]
        chunks = []
        while queue and budget > 0:
            seq = queue.popleft()
            end = min(seq.prompt_len, seq.computed + budget)
            chunks.append((seq, seq.computed, end))
            budget -= end - seq.computed
        return chunks

    async def _run_prefill(self) -> None:
        chunks = self._prefill_chunks()
        self._prefilling = [seq for seq, _, _ in chunks]
        self.refresh()
        try:
            await trio.sleep(self._noisy(self.step_prefill_seconds(chunks)))
        finally:
            self._prefilling = []
        now = self.clock()
        m, s = self.metrics, self.stats
        for seq, _, end in chunks:
            if seq.state != "prefill":  # aborted meanwhile
                continue
            seq.computed = end
            if end == seq.prompt_len:
                cached = seq.cached_tokens
                for source, n in (("local_compute", seq.prompt_len - cached), ("local_cache_hit", cached)):
                    m.prompt_tokens_by_source[source] += n
                    s.prompt_tokens[source] += n
                if self._emit(seq, now):
                    seq.state = "running"
                    self._running.append(seq)
            else:  # a chunk (the step's last): the rest of the prompt heads the next step
                self._prefill_q.appendleft(seq)
        self.refresh()

    async def _run_step(self) -> None:
        batch = list(self._running)
        resident = sum(s.prompt_len + s.generated for s in batch)
        await trio.sleep(self._noisy(self.step_seconds(len(batch), resident)))
        now = self.clock()
        for seq in batch:
            if seq.state == "running":
                self._emit(seq, now)
        self._running = [s for s in self._running if s.state == "running"]
        self.refresh()

    def _emit(self, seq: Seq, now: float) -> bool:
        """Send the next token of ``seq``; returns whether it continues."""
        index = seq.generated
        seq.generated += 1
        finish = "length" if seq.generated >= seq.params.max_tokens else None
        if seq.first_at is None:
            seq.first_at = now
            self.metrics.ttft.observe(now - seq.received)
            if seq.scheduled_at is not None:
                self.metrics.prefill_time.observe(now - seq.scheduled_at)
        elif seq.last_at is not None:
            self.metrics.itl.observe(now - seq.last_at)
        seq.last_at = now
        self.metrics.generation_tokens += 1
        self.stats.generated_tokens += 1
        token = generated_token(self._model_seed, seq.key, seq.prompt_len + index)
        seq.key = extend_key(seq.key, token)
        if self.sim.prefix_caching:
            # The token sampled last has no KV yet: computed are all tokens before it.
            seq.token_ids.append(token)
            self._cache_computed(seq, len(seq.token_ids) - 1)
        try:
            seq.send.send_nowait(TokenEvent(token, index, finish, now))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.abort(seq)
            return False
        if finish is None:
            return True
        self._finish(seq, finish, now)
        return False

    def _finish(self, seq: Seq, reason: str, now: float) -> None:
        seq.finish_reason = reason
        if seq.want_descriptor and reason == "length":
            keep = self.blocks_for(seq.prompt_len)
            h = Handoff(
                request_id=seq.params.request_id,
                engine_id=self.engine_id,
                block_ids=tuple(seq.blocks[:keep]),
                num_tokens=seq.prompt_len,
                expires_at=now + self.sim.handoff_ttl_s,
            )
            self.held[h.request_id] = h
            seq.blocks = seq.blocks[keep:]
            seq.kv_transfer_params = self.describe(h)
        m = self.metrics
        m.request_success[reason] += 1
        m.e2e.observe(now - seq.received)
        if seq.scheduled_at is not None:
            m.inference_time.observe(now - seq.scheduled_at)
        if seq.generated > 1 and seq.first_at is not None:
            m.tpot.observe((now - seq.first_at) / (seq.generated - 1))
        self.stats.completed += 1
        self.release(seq, "finished")


def _flatten(block_ids: object) -> list[object]:
    if isinstance(block_ids, list) and block_ids and all(isinstance(g, list) for g in block_ids):
        return [b for group in block_ids for b in group]
    return list(block_ids) if isinstance(block_ids, list) else [block_ids]
