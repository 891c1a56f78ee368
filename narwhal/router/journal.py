"""The router journal: one JSON line per request at its terminal outcome.

The request path never waits on the disk: :meth:`Journal.record` hands the record to a
bounded memory channel read by one writer task, which batches lines, writes them from
a worker thread, flushes and (``journal.fsync``) fsyncs each batch. When the channel is full the record goes to an overflow
list that the writer drains next (counted in ``overflowed``), so a burst neither blocks
a request nor loses a record. :meth:`Journal.aclose` drains everything and closes
the file; graceful shutdown calls it after in-flight requests are done.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import attrs
import trio

from narwhal.engines.sse import json_dumps

__all__ = ["TERMINAL_CLASSES", "AttemptRecord", "Journal", "RequestRecord"]

#: The closed set of terminal classes a journal record may carry.
TERMINAL_CLASSES = frozenset(
    {
        "ok",
        "refused",
        "rate_limited",
        "no_engine",
        "invalid_request",
        "client_cancelled",
        "prefill_failed",
        "decode_failed",
        "first_token_timeout",
        "silence_timeout",
        "handoff_expired",
        "invalid_descriptor",
        "deadline_exceeded",
        "shutdown",
        "router_overloaded",
        "internal_error",
    }
)


@attrs.define
class AttemptRecord:
    """One prefill/decode attempt of a request.

    Attributes:
        n: attempt number, from 1.
        producer: the engine that ran the prefill leg.
        consumer: the engine that ran the decode leg.
        same_worker: both legs on one engine (no KV transfer).
        prefill_request_id: backend request id of the prefill leg.
        decode_request_id: backend request id of the decode leg.
        outcome: ``ok`` or the terminal class this attempt would have had.
        error: the error detail, if any.
        ttft_s: arrival to producer HTTP completion, when the prefill leg completed.
        placement_wait_s: time spent waiting for a placement that meets the SLO.
        predicted_ttft_s: the producer's price (profile-priced placement only).
        predicted_tpot_s: the consumer's price (profile-priced placement only).
        deadline: the setting whose deadline ended the attempt, when one did
            (``engine.first_token_timeout_s``, ``handoff.max_age_s``, ...).
        held_by: the engine whose leg held the time when that deadline fired.
        predicted_cached_tokens: the producer's prefix-cache hit the router's prefix
            index predicted, in prompt tokens (None: no view of the producer's cache
            or the prompt's token ids unknown).
        cached_tokens: the producer's prefix-cache hit as its usage reported it
            (``prompt_tokens_details.cached_tokens``, which vLLM sends with
            ``--enable-prompt-tokens-details``; None when not reported).
        consumer_predicted_cached_tokens: the consumer's own prefix-cache hit the
            router's prefix index predicted: the prompt's leading tokens it holds and
            so need not pull from the producer (None: a same-worker attempt, no view of
            the consumer's cache, or the prompt's token ids unknown).
        consumer_cached_tokens: the consumer's ``prompt_tokens_details.cached_tokens``
            as its decode stream's usage reported it (None when not reported). vLLM
            counts the tokens the consumer pulled in it as well as its own hit, so
            after a whole handoff it is the prompt's length, not the hit alone.
        started_s: arrival to the start of this attempt (its placement).
        first_token_s: arrival to this attempt's first generated token, when it had one.
        output_tokens: identified tokens this attempt's decode delivered.
        resume: on a resume (``recovery.resume_streams``), what broke the stream it
            continues: the failed attempt's error class (``stream_closed``,
            ``silence_timeout``, ``engine_stream_error``, ...).
        resumed_at_s: on a resume, arrival to the failure it continues after.
        not_resumed: with ``recovery.resume_streams``, why this attempt's failure after
            output was not resumed (the stream then ended with the terminal event).
        placement: why the pair was chosen (:func:`narwhal.router.choice.explain`):
            the ``rule`` that chose the producer (``owner``, ``move``, ``spill``,
            ``price``, ``over_target``, ``headroom`` without a cache plan,
            ``least_loaded`` or ``fallback`` without prices), the request's ``group``
            and its ``owners``, the chosen producer's price and the runner-up's
            (``predicted_ttft_s``, ``queue_s``, ``own_s``, ``cached_tokens`` as priced,
            ``eviction_s``: what its new blocks cost later requests), why each other
            producer was not taken (``others``), and the consumer's and its runner-up's
            (``predicted_tpot_s``, ``cached_tokens``, ``handoff_s``). Set on a refused
            attempt too, when placement priced it. Placement may leave a function that
            writes it: the record's JSON has what it returns.
    """

    n: int
    producer: str | None = None
    consumer: str | None = None
    same_worker: bool = False
    prefill_request_id: str | None = None
    decode_request_id: str | None = None
    outcome: str = "pending"
    error: str | None = None
    ttft_s: float | None = None
    placement_wait_s: float = 0.0
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    deadline: str | None = None
    held_by: str | None = None
    predicted_cached_tokens: int | None = None
    cached_tokens: int | None = None
    consumer_predicted_cached_tokens: int | None = None
    consumer_cached_tokens: int | None = None
    started_s: float | None = None
    first_token_s: float | None = None
    output_tokens: int = 0
    resume: str | None = None
    resumed_at_s: float | None = None
    not_resumed: str | None = None
    placement: dict[str, Any] | Callable[[], dict[str, Any]] | None = None


# A new empty list per record.
_EMPTY_LIST: Any = attrs.Factory(list)


@attrs.define
class RequestRecord:
    """The journal line of one client request (the measurement contract's fields).

    Attributes:
        request_id: the client's ``x-request-id`` or one the router made.
        arrival: Unix time the request reached the router.
        route: ``completions`` or ``chat``.
        model: the requested model.
        stream: whether the client asked for a stream.
        prompt_tokens: prompt length in tokens (None when never counted).
        requested_output_len: the client's output limit.
        output_len: identified output tokens delivered.
        ttft_s: arrival to producer HTTP completion (successful attempt).
        first_byte_s: arrival to first generated decode output observed.
        tpot_s: prefill completion to final decode token over output_len - 1 (>= 2 tokens).
        latency_s: arrival to terminal outcome.
        status: HTTP status answered (200 once committed, even if the stream then failed).
        terminal_class: one of :data:`TERMINAL_CLASSES`.
        producer: producer of the final attempt.
        consumer: consumer of the final attempt.
        attempts: every attempt with its outcome.
        error: error detail for a failed request.
        trace_id: the OpenTelemetry trace id (32 hex digits) of a request whose trace is
            sampled; None when tracing is off or the sampler dropped it.
        tenant: the request's tenant (None: the fleet has no ``tenancy`` section, or the
            request ended before it was known).
        latency_class: the request's latency class (None likewise).
        queued_s: seconds it waited in the router's queue for capacity (0: none).
        queue_reason: why it was queued: the placement its class's targets missed when it
            came, or the requests queued ahead of it (None: it was never queued).
    """

    request_id: str
    arrival: float
    route: str
    model: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    requested_output_len: int | None = None
    output_len: int = 0
    ttft_s: float | None = None
    first_byte_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    status: int = 0
    terminal_class: str = "internal_error"
    producer: str | None = None
    consumer: str | None = None
    attempts: list[AttemptRecord] = _EMPTY_LIST
    error: str | None = None
    trace_id: str | None = None
    tenant: str | None = None
    latency_class: str | None = None
    queued_s: float = 0.0
    queue_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        # attrs.asdict, written out: it runs once per request on the router's hot path.
        out = {name: getattr(self, name) for name in _RECORD_FIELDS}
        out["attempts"] = attempts = [{name: getattr(a, name) for name in _ATTEMPT_FIELDS} for a in self.attempts]
        for a in attempts:
            placement = a["placement"]
            if placement is not None and not isinstance(placement, dict):
                a["placement"] = placement()  # worded now, after the response
        return out


_RECORD_FIELDS: tuple[str, ...] = tuple(f.name for f in attrs.fields(RequestRecord))
_ATTEMPT_FIELDS: tuple[str, ...] = tuple(f.name for f in attrs.fields(AttemptRecord))


class Journal:
    """Appends :class:`RequestRecord` lines to a file (or only to listeners when no path)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        queue_size: int = 10000,
        fsync: bool = True,
        batch_window_s: float = 0.05,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.batch_window_s = batch_window_s
        self.fsync = fsync
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](queue_size)
        self._overflow: collections.deque[dict[str, Any]] = collections.deque()
        self._closed = False  # pragma: no mutate (equivalent: None is as false)
        self._done = trio.Event()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.written = 0
        self.overflowed = 0
        self.records = 0

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(record_dict)`` for each record as it is journaled (no I/O allowed)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.remove(listener)

    def record(self, record: RequestRecord) -> None:
        """Journal ``record``; never blocks and never drops."""
        if record.terminal_class not in TERMINAL_CLASSES:
            raise ValueError(f"unknown terminal class {record.terminal_class!r}")
        if self._closed:
            raise RuntimeError("journal is closed")
        line = record.to_json()
        self.records += 1
        for listener in self._listeners:
            listener(line)
        try:
            self._send.send_nowait(line)
        except trio.WouldBlock:
            self.overflowed += 1
            self._overflow.append(line)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer task: runs until :meth:`aclose` and everything is on disk."""
        fh: IO[bytes] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "ab")  # noqa: ASYNC230 - opened once
        task_status.started()
        try:
            async with self._receive:
                while True:
                    batch: list[dict[str, Any]] = []
                    # Records that overflowed while the last batch was written are newer
                    # than those the channel holds: both are taken below, in order.
                    if not self._overflow:
                        try:
                            batch.append(await self._receive.receive())
                        except trio.EndOfChannel:  # closed, and everything written
                            break  # pragma: no mutate (equivalent: return, nothing follows the loop)
                    # Gather for a short window: one write (and one thread hop) per
                    # batch instead of per request, and one wake-up of this task per
                    # batch (it sleeps through the window, then takes what queued up);
                    # the request path never waits on it.
                    if not self._closed:
                        await trio.sleep(self.batch_window_s)
                    while True:
                        try:
                            batch.append(self._receive.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    batch.extend(self._take_overflow())
                    if fh is not None:
                        text = b"".join([json_dumps(r) + b"\n" for r in batch])
                        await trio.to_thread.run_sync(_write, fh, text, self.fsync)
                    self.written += len(batch)
        finally:
            if fh is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(fh.close)  # each batch is flushed (and synced) already
            self._done.set()

    def _take_overflow(self) -> list[dict[str, Any]]:
        items = list(self._overflow)
        self._overflow.clear()
        return items

    async def aclose(self) -> None:
        """Stop accepting records, let the writer drain, flush and fsync."""
        if not self._closed:
            self._closed = True
            await self._send.aclose()
        await self._done.wait()


def _write(fh: IO[bytes], text: bytes, fsync: bool) -> None:
    fh.write(text)
    fh.flush()
    if fsync:
        os.fsync(fh.fileno())
