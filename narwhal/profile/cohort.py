"""One decode cell: a synchronized cohort of streams and the collector that windows them.

Every stream of the cohort asks for one identified token per SSE event and runs to its
length (``min_tokens``/``ignore_eos``). Each stream task validates token identity as
events arrive and sends what it sees (first token, inter-token intervals, completion,
final outcome) into one memory channel. A single :class:`CohortCollector` reads it and
decides the window: it opens when every stream has its first token and closes when the
first stream completes. Only intervals that start at or after the opening and arrive
while the window is open are kept: before it, intervals span other streams' prefills;
after it, fewer requests are active than the cell claims. Both would bias the fit.

Active requests and resident KV tokens at each kept interval are inferred from the
client's own observations (token arrivals); where the engine's ``/metrics`` answers,
its gauges are recorded beside the inferred values.

A kept cell's TPOT is the median over its streams of each stream's mean interval
inside the window, i.e. the measurement contract's ``(last - first) / (n - 1)``
restricted to the window. Not the median of single intervals: a client that reads a
burst of events late sees near-zero gaps and then a long one, and only the span is
robust to that. The cell's load is the mean of the inferred values over the window,
which is what a mean step time corresponds to in a model linear in both.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import trio

from narwhal.engines.client import EngineClient
from narwhal.engines.metrics import EngineMetrics
from narwhal.engines.sse import Chunk
from narwhal.errors import EngineError, EngineTimeout
from narwhal.profile.fit import cell_figures

__all__ = [
    "METRICS_TIMEOUT_S",
    "CellResult",
    "CohortCollector",
    "Completed",
    "FirstToken",
    "Interval",
    "Message",
    "StreamEnd",
    "StreamLimits",
    "infer_load",
    "read_metrics",
    "run_cell",
]

#: Seconds a probe waits for an engine's ``/metrics`` (the client sets no read timeout).
METRICS_TIMEOUT_S: Final = 10.0


@attrs.frozen
class StreamLimits:
    """Deadlines of one probe stream (seconds)."""

    first_token_s: float = 30.0
    between_tokens_s: float = 30.0


@attrs.frozen
class FirstToken:
    """A stream's first token arrived."""

    stream: int
    at: float


@attrs.frozen
class Interval:
    """The gap before token ``index`` (>= 1) of one stream."""

    stream: int
    index: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@attrs.frozen
class Completed:
    """A stream's final token (the one carrying ``finish_reason``) arrived."""

    stream: int
    at: float


@attrs.frozen(eq=False)
class StreamEnd:
    """How one stream ended: its counts, or the problem or error that ended it."""

    stream: int
    tokens: int
    done: bool
    finish_reason: str | None
    usage_tokens: int | None
    usage_prompt_tokens: int | None = None
    problem: str | None = None
    error: EngineError | None = None


Message = FirstToken | Interval | Completed | StreamEnd


class CohortCollector:
    """The single reader of a cohort's channel: the window and what it kept.

    Feed it messages in arrival order. ``on_open`` is called once when the window opens.
    """

    def __init__(self, size: int, *, on_open: Callable[[], None] | None = None) -> None:
        self.size = size
        self._on_open = on_open
        self.first_at: dict[int, float] = {}
        self.arrivals: dict[int, list[float]] = {i: [] for i in range(size)}
        self.completed_at: dict[int, float] = {}
        self.open_at: float | None = None
        self.close_at: float | None = None
        self.kept: list[Interval] = []
        self.ramp: list[Interval] = []
        self.tail: list[Interval] = []
        self.ends: dict[int, StreamEnd] = {}

    @property
    def is_open(self) -> bool:
        return self.open_at is not None and self.close_at is None

    @property
    def failure(self) -> StreamEnd | None:
        """The first stream that ended with an error or an identity problem."""
        for end in self.ends.values():
            if end.error is not None or end.problem is not None:
                return end
        return None

    @property
    def finished(self) -> bool:
        return len(self.ends) == self.size or self.failure is not None

    def feed(self, msg: Message) -> None:
        """Take one message."""
        if isinstance(msg, FirstToken):
            self.first_at[msg.stream] = msg.at
            self.arrivals[msg.stream].append(msg.at)
            if len(self.first_at) == self.size and self.open_at is None and self.close_at is None:
                self.open_at = msg.at
                if self._on_open is not None:
                    self._on_open()
        elif isinstance(msg, Interval):
            self.arrivals[msg.stream].append(msg.end)
            if self.is_open and self.open_at is not None and msg.start >= self.open_at:
                self.kept.append(msg)
            elif self.close_at is not None:
                self.tail.append(msg)
            else:
                self.ramp.append(msg)
        elif isinstance(msg, Completed):
            self.completed_at.setdefault(msg.stream, msg.at)
            if self.close_at is None:
                self.close_at = msg.at
        else:
            self.ends[msg.stream] = msg


def infer_load(collector: CohortCollector, input_len: int, at: float) -> tuple[int, int]:
    """Active requests and resident KV tokens at time ``at``, from client observations.

    A stream is resident from its first token until its final one; it holds its prompt
    plus the tokens it has received by ``at`` (evaluated at an interval's midpoint,
    those are the tokens generated before the step that ends the interval).
    """
    active = 0
    kv = 0
    for stream, times in collector.arrivals.items():
        if not times or times[0] > at:
            continue
        done = collector.completed_at.get(stream)
        if done is not None and done <= at:
            continue
        active += 1
        kv += input_len + bisect.bisect_right(times, at)
    return active, kv


@attrs.frozen
class CellResult:
    """The outcome of one decode cell (kept or rejected) and everything it measured."""

    input_len: int
    concurrency: int
    max_tokens: int
    kept: bool
    reason: str | None
    open_at: float | None
    close_at: float | None
    intervals: tuple[dict[str, Any], ...]
    outside: tuple[dict[str, Any], ...]
    streams: tuple[dict[str, Any], ...]
    tpot_s: float | None
    active: float | None
    kv_tokens: float | None
    kv_min: int | None
    kv_max: int | None
    engine_metrics: dict[str, Any]
    saturation: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form kept in the sidecar."""
        return attrs.asdict(self, recurse=False) | {  # pragma: no mutate (equivalent: recursing copies equal rows and dicts)
            "intervals": list(self.intervals),
            "outside": list(self.outside),
            "streams": list(self.streams),
        }


def _window_tpot(intervals: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Each stream's mean interval inside the window: (last - first) / (tokens - 1) there."""
    spans: dict[int, list[float]] = {}
    for iv in intervals:
        spans.setdefault(iv["stream"], []).append(iv["seconds"])
    return {stream: sum(gaps) / len(gaps) for stream, gaps in sorted(spans.items())}


def _identity_problem(chunk: Chunk) -> str | None:
    ids = chunk.token_ids
    if not ids:
        return "a token event carried no token id (the engine ignored return_token_ids)"
    if len(ids) != 1:
        return f"a token event carried {len(ids)} token ids; the profiler needs one per event"
    if type(ids[0]) is not int or ids[0] < 0:
        return f"a token event carried an invalid token id {ids[0]!r}"
    return None


async def _run_stream(
    client: EngineClient,
    stream: int,
    ids: Sequence[int],
    max_tokens: int,
    limits: StreamLimits,
    start: trio.Event,
    send: trio.MemorySendChannel[Message],
) -> None:
    body = {
        "prompt": list(ids),
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    # A plain ``with``: an async close is a checkpoint, and a checkpoint while an
    # exception unwinds can turn it into Cancelled, which the nursery would swallow.
    with send:
        await start.wait()
        tokens = 0
        previous: float | None = None
        completed = False  # pragma: no mutate (equivalent: falsy alike)
        problem: str | None = None
        error: EngineError | None = None
        done = False  # pragma: no mutate (equivalent: set from the stream after the loop; after an exception unread, as the cell raises the error)
        finish: str | None = None  # pragma: no mutate (equivalent: likewise)
        usage: Mapping[str, Any] | None = None
        with trio.CancelScope(deadline=trio.current_time() + limits.first_token_s) as scope:
            try:
                async with client.decode(None, body, leg="decode") as probe:
                    async for chunk in probe:
                        now = trio.current_time()
                        if chunk.kind == "token":
                            problem = _identity_problem(chunk)
                            if problem is not None:
                                break
                            if previous is None:
                                await send.send(FirstToken(stream, now))
                            else:
                                await send.send(Interval(stream, tokens, previous, now))
                            tokens += 1
                            previous = now
                            scope.deadline = now + limits.between_tokens_s
                        if chunk.finish_reason is not None and not completed:
                            completed = True  # pragma: no mutate (equivalent: a second Completed is ignored, the collector keeps a stream's first)
                            await send.send(Completed(stream, now))
                    done, finish, usage = probe.done, probe.finish_reason, probe.usage
            except EngineError as exc:
                error = exc
        if scope.cancelled_caught:
            wait = "its first token" if previous is None else "a token"
            error = EngineTimeout(
                f"engine {client.name} kept a profile stream waiting too long for {wait}",
                engine=client.name,
                leg="decode",
            )
        if not completed and error is None and problem is None:
            await send.send(Completed(stream, trio.current_time()))
        count = usage.get("completion_tokens") if usage is not None else None
        prompt = usage.get("prompt_tokens") if usage is not None else None
        await send.send(
            StreamEnd(
                stream,
                tokens,
                done,
                finish,
                count if type(count) is int else None,
                prompt if type(prompt) is int else None,
                problem=problem,
                error=error,
            )
        )


def _stream_problem(end: StreamEnd, input_len: int, max_tokens: int) -> str | None:
    if end.usage_prompt_tokens is not None and end.usage_prompt_tokens != input_len:
        return (
            f"stream {end.stream} sent an exact {input_len}-token prompt but the engine "
            f"processed {end.usage_prompt_tokens}"
        )
    if not end.done:
        return f"stream {end.stream} ended without data: [DONE]"
    if end.finish_reason != "length":
        return f"stream {end.stream} finished with {end.finish_reason!r}, not 'length'"
    if end.tokens != max_tokens:
        return f"stream {end.stream} produced {end.tokens} tokens; {max_tokens} were requested"
    if end.usage_tokens is not None and end.usage_tokens != end.tokens:
        return (
            f"stream {end.stream} counted {end.tokens} identified tokens but the engine "
            f"reported {end.usage_tokens}"
        )
    return None


async def read_metrics(client: EngineClient, names: frozenset[str] | None = None) -> EngineMetrics | str:
    """The engine's ``/metrics`` (only the samples ``names``, if given), or why not: the
    engine's error, or no answer within :data:`METRICS_TIMEOUT_S`."""
    with trio.move_on_after(METRICS_TIMEOUT_S):
        try:
            return await (client.metrics() if names is None else client.metrics(names=names))
        except EngineError as exc:
            return str(exc)
    return "the engine's /metrics did not answer in time"


async def _metrics_now(client: EngineClient) -> dict[str, Any]:
    at = trio.current_time()
    m = await read_metrics(client)
    if isinstance(m, str):
        return {"at": at, "error": m}
    kv_tokens = round(m.kv_usage * m.kv_cache_size_tokens) if m.kv_cache_size_tokens else None
    return {
        "at": at,
        "running": m.running,
        "waiting": m.waiting,
        "kv_usage": m.kv_usage,
        "kv_tokens": kv_tokens,
        "itl_sum_s": m.total("vllm:inter_token_latency_seconds_sum"),
        "itl_count": m.total("vllm:inter_token_latency_seconds_count"),
    }


def _itl_mean(before: Mapping[str, Any], after: Mapping[str, Any]) -> float | None:
    try:
        count = after["itl_count"] - before["itl_count"]
        total = after["itl_sum_s"] - before["itl_sum_s"]
    except (KeyError, TypeError):
        return None
    return total / count if count > 0 else None


async def run_cell(
    client: EngineClient,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    limits: StreamLimits,
    min_window_steps: int,
) -> CellResult:
    """Run one decode cell: one stream per prompt (exact token ids, all of one length).

    Raises:
        EngineError: a stream's request failed (the engine is unusable for profiling).
    """
    if not prompts or any(len(p) != len(prompts[0]) for p in prompts):
        raise ValueError("a cell needs prompts of one length")
    concurrency, input_len = len(prompts), len(prompts[0])
    send, recv = trio.open_memory_channel[Message](max(16, 4 * concurrency))  # pragma: no mutate (equivalent: the capacity only buffers; the collector reads each message when it is sent)
    window_opened = trio.Event()
    collector = CohortCollector(concurrency, on_open=window_opened.set)
    before = await _metrics_now(client)
    during: dict[str, Any] = {}

    async def sample_when_open() -> None:
        await window_opened.wait()
        during.update(await _metrics_now(client))

    # The cohort queues its own prefills: the last stream's first token waits for all.
    limits = attrs.evolve(limits, first_token_s=limits.first_token_s * concurrency)
    start = trio.Event()
    with recv:  # (plain ``with`` for the reason given in _run_stream)
        async with trio.open_nursery() as nursery:
            with send:
                for i, ids in enumerate(prompts):
                    nursery.start_soon(
                        _run_stream, client, i, ids, max_tokens, limits, start, send.clone()
                    )
            nursery.start_soon(sample_when_open)
            start.set()  # every stream task exists: release the cohort together
            async for msg in recv:
                collector.feed(msg)
                if collector.finished:
                    break
            # Streams still running after a failure, and a sampler whose window never
            # opened, are cancelled before the channel closes under them.
            nursery.cancel_scope.cancel()
    after = await _metrics_now(client)

    failure = collector.failure
    if failure is not None and failure.error is not None:
        raise failure.error
    reason = failure.problem if failure is not None else None
    if reason is None:
        # Without a failure the cohort ended with every stream's report.
        for i in range(concurrency):
            reason = _stream_problem(collector.ends[i], input_len, max_tokens)
            if reason is not None:
                break
    needed = concurrency * min_window_steps
    if reason is None and len(collector.kept) < needed:
        reason = (
            f"only {len(collector.kept)} intervals with the whole cohort resident; "
            f"{needed} needed ({min_window_steps} steps of {concurrency} streams)"
        )

    intervals: list[dict[str, Any]] = []
    for iv in collector.kept:
        active, kv = infer_load(collector, input_len, (iv.start + iv.end) / 2)
        intervals.append({"stream": iv.stream, "index": iv.index, "start": iv.start,
                          "end": iv.end, "seconds": iv.seconds, "active": active,
                          "kv_tokens": kv})  # fmt: skip
    outside = [
        {"stream": iv.stream, "index": iv.index, "start": iv.start, "end": iv.end,
         "seconds": iv.seconds, "phase": phase}
        for phase, ivs in (("ramp", collector.ramp), ("tail", collector.tail))
        for iv in ivs
    ]  # fmt: skip
    streams: list[dict[str, Any]] = [
        {"stream": e.stream, "prompt_tokens": input_len, "tokens": e.tokens, "done": e.done,
         "finish_reason": e.finish_reason, "usage_completion_tokens": e.usage_tokens,
         "first_token_at": collector.first_at.get(e.stream),
         "completed_at": collector.completed_at.get(e.stream), "problem": e.problem}
        for e in sorted(collector.ends.values(), key=lambda e: e.stream)
    ]  # fmt: skip
    metrics: dict[str, Any] = {"before": before, "after": after,
                               "itl_mean_s": _itl_mean(before, after)}  # fmt: skip
    if during:
        active_then, kv_then = infer_load(collector, input_len, during["at"])
        metrics["in_window"] = during | {"inferred_active": active_then,
                                         "inferred_kv_tokens": kv_then}  # fmt: skip

    saturation = _saturation(metrics.get("in_window"), concurrency)
    kept = reason is None and bool(intervals)
    kvs = [iv["kv_tokens"] for iv in intervals]
    figures = cell_figures(intervals) if kept else None
    per_stream = _window_tpot(intervals)
    for row in streams:
        row["window_tpot_s"] = per_stream.get(row["stream"])
    return CellResult(
        input_len=input_len,
        concurrency=concurrency,
        max_tokens=max_tokens,
        kept=kept,
        reason=reason,
        open_at=collector.open_at,
        close_at=collector.close_at,
        intervals=tuple(intervals),
        outside=tuple(outside),
        streams=tuple(streams),
        tpot_s=figures[0] if figures else None,
        active=figures[1] if figures else None,
        kv_tokens=figures[2] if figures else None,
        kv_min=min(kvs) if kept else None,
        kv_max=max(kvs) if kept else None,
        engine_metrics=metrics,
        saturation=saturation,
    )


def _saturation(in_window: Mapping[str, Any] | None, concurrency: int) -> str | None:
    """Whether the engine's own gauges, read inside the window, contradict the cohort.

    Near scheduler saturation (``max_num_seqs``, KV blocks) the engine queues streams
    the client believes resident; the inferred load is then wrong. ``None`` when the
    gauges agree or were not read.
    """
    if not in_window or "running" not in in_window:
        return None
    running, waiting = in_window["running"], in_window["waiting"]
    inferred = in_window["inferred_active"]
    if waiting > 0 or running < inferred:
        return (f"near saturation: the engine reported {running} running and {waiting} waiting "
                f"requests while the client inferred {inferred} active of {concurrency}")  # fmt: skip
    return None
