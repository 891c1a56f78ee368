"""One decode cell against a scripted engine, in virtual time: the window, the figures the
cell keeps, every reason a cell is rejected, and the engine's gauges beside them."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

from narwhal.engines.metrics import EngineMetrics, Sample
from narwhal.engines.sse import Chunk
from narwhal.errors import EngineError, EngineTimeout
from narwhal.profile.cohort import (
    CellResult,
    CohortCollector,
    Completed,
    FirstToken,
    Interval,
    StreamEnd,
    StreamLimits,
    infer_load,
    run_cell,
)

INPUT = 8


@attrs.define
class Script:
    """One stream: its tokens' arrival times, then how it ends."""

    times: list[float]
    finish: str | None = "length"
    done: bool = True
    usage: dict[str, Any] | None = None
    ids: Callable[[int], tuple[Any, ...]] = lambda i: (i + 7,)
    raise_at_end: EngineError | None = None
    tail_s: float = 0.0  # the body's end (usage, [DONE]) after the last token


def tokens(first: float, step: float, n: int, **kw: Any) -> Script:
    return Script([first + step * i for i in range(n)], **kw)


class _Stream:
    """A scripted response body (an iterator class: nothing to finalise when the
    profiler stops reading early)."""

    def __init__(self, script: Script, started: float) -> None:
        self.script, self.started = script, started
        self.done, self.finish_reason, self.usage = False, None, None
        self._next = 0

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Chunk:
        s, i = self.script, self._next
        if i == len(s.times):
            await trio.sleep(s.tail_s)
            if s.raise_at_end is not None:
                raise s.raise_at_end
            self.done, self.finish_reason, self.usage = s.done, s.finish, s.usage
            raise StopAsyncIteration
        self._next += 1
        await trio.sleep_until(self.started + s.times[i])
        last = i == len(s.times) - 1
        return Chunk("token", b"", token_ids=s.ids(i), count=1,
                     finish_reason=s.finish if last else None)  # fmt: skip


def metrics(running: int = 2, waiting: int = 0, itl: tuple[float, float] = (1.0, 10),
            kv_size: int | None = 1000, kv_usage: float = 0.5) -> EngineMetrics:  # fmt: skip
    samples = {
        "vllm:inter_token_latency_seconds_sum": (Sample("vllm:inter_token_latency_seconds_sum", (), itl[0]),),
        "vllm:inter_token_latency_seconds_count": (Sample("vllm:inter_token_latency_seconds_count", (), itl[1]),),
    }  # fmt: skip
    return EngineMetrics(running=running, waiting=waiting, kv_usage=kv_usage,
                         kv_cache_size_tokens=kv_size, prefix_caching=None,
                         process_start_time=None, samples=samples)  # fmt: skip


class FakeClient:
    """Serves stream ``i`` (the prompt starting with token ``100 + i``) from ``scripts[i]``;
    ``/metrics`` answers from ``answers`` in turn (an exception is raised, a number of
    seconds is waited first)."""

    name = "f0"

    def __init__(self, scripts: list[Script], answers: list[Any] | None = None) -> None:
        self.scripts = scripts
        self.answers = list(answers) if answers is not None else [metrics()] * 3
        self.bodies: dict[int, dict[str, Any]] = {}
        self.legs: list[Any] = []
        self.metrics_at: list[float] = []

    @asynccontextmanager
    async def decode(self, prefill: Any, body: dict[str, Any], *, leg: str) -> AsyncIterator[_Stream]:
        assert prefill is None
        stream = body["prompt"][0] - 100
        self.bodies[stream] = body
        self.legs.append(leg)
        yield _Stream(self.scripts[stream], trio.current_time())

    async def metrics(self) -> EngineMetrics:
        self.metrics_at.append(trio.current_time())
        answer = self.answers.pop(0)
        if isinstance(answer, tuple):
            await trio.sleep(answer[0])
            answer = answer[1]
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, EngineMetrics)
        return answer


def prompts(n: int) -> list[list[int]]:
    return [[100 + i] * INPUT for i in range(n)]


async def cell(client: FakeClient, n: int, max_tokens: int = 6, *, steps: int = 2,
               limits: StreamLimits | None = None) -> CellResult:  # fmt: skip
    with trio.fail_after(1000):
        return await run_cell(client, prompts(n), max_tokens=max_tokens,  # type: ignore[arg-type]
                              limits=limits or StreamLimits(), min_window_steps=steps)  # fmt: skip


def usage(n: int = 6, prompt: int = INPUT) -> dict[str, Any]:
    return {"completion_tokens": n, "prompt_tokens": prompt}


def two_streams(**second: Any) -> list[Script]:
    # Stream 0: tokens at 0.5 .. 1.75; stream 1 at 1.125 .. 2.375 (steps of 0.25): the
    # window opens at 1.125 (stream 1's first token) and closes at 1.75 (stream 0 done).
    return [tokens(0.5, 0.25, 6, usage=usage()),
            tokens(1.125, 0.25, 6, **({"usage": usage()} | second))]  # fmt: skip


async def test_a_cell_keeps_the_whole_cohort_window_and_its_load(
    autojump_clock: trio.abc.Clock,
) -> None:
    client = FakeClient(two_streams(), [metrics(itl=(1.0, 10)), metrics(running=2),
                                        metrics(itl=(3.0, 18))])  # fmt: skip
    result = await cell(client, 2)
    assert result.kept and result.reason is None
    assert (result.input_len, result.concurrency, result.max_tokens) == (INPUT, 2, 6)
    assert (result.open_at, result.close_at) == (1.125, 1.75)
    # Resident KV at each interval's midpoint: both prompts plus the tokens received by then.
    assert list(result.intervals) == [
        {"stream": 1, "index": 1, "start": 1.125, "end": 1.375, "seconds": 0.25, "active": 2,
         "kv_tokens": 8 + 4 + 8 + 1},
        {"stream": 0, "index": 4, "start": 1.25, "end": 1.5, "seconds": 0.25, "active": 2,
         "kv_tokens": 8 + 4 + 8 + 2},
        {"stream": 1, "index": 2, "start": 1.375, "end": 1.625, "seconds": 0.25, "active": 2,
         "kv_tokens": 8 + 5 + 8 + 2},
        {"stream": 0, "index": 5, "start": 1.5, "end": 1.75, "seconds": 0.25, "active": 2,
         "kv_tokens": 8 + 5 + 8 + 3},
    ]  # fmt: skip
    assert [(o["stream"], o["index"], o["start"], o["end"], o["seconds"], o["phase"])
            for o in result.outside] == [
        (0, 1, 0.5, 0.75, 0.25, "ramp"), (0, 2, 0.75, 1.0, 0.25, "ramp"),
        (0, 3, 1.0, 1.25, 0.25, "ramp"), (1, 3, 1.625, 1.875, 0.25, "tail"),
        (1, 4, 1.875, 2.125, 0.25, "tail"), (1, 5, 2.125, 2.375, 0.25, "tail"),
    ]  # fmt: skip
    assert (result.tpot_s, result.active, result.kv_tokens) == (0.25, 2.0, 22.5)
    assert (result.kv_min, result.kv_max) == (21, 24)
    assert list(result.streams) == [
        {"stream": 0, "prompt_tokens": INPUT, "tokens": 6, "done": True,
         "finish_reason": "length", "usage_completion_tokens": 6, "first_token_at": 0.5,
         "completed_at": 1.75, "problem": None, "window_tpot_s": 0.25},
        {"stream": 1, "prompt_tokens": INPUT, "tokens": 6, "done": True,
         "finish_reason": "length", "usage_completion_tokens": 6, "first_token_at": 1.125,
         "completed_at": 2.375, "problem": None, "window_tpot_s": 0.25},
    ]  # fmt: skip
    m = result.engine_metrics
    assert client.metrics_at == [0.0, 1.125, 2.375]  # before, when the window opens, after
    assert m["before"] == {"at": 0.0, "running": 2, "waiting": 0, "kv_usage": 0.5,
                           "kv_tokens": 500, "itl_sum_s": 1.0, "itl_count": 10}  # fmt: skip
    assert m["after"]["at"] == 2.375 and m["itl_mean_s"] == (3.0 - 1.0) / (18 - 10)
    assert m["in_window"]["at"] == 1.125
    assert (m["in_window"]["inferred_active"], m["in_window"]["inferred_kv_tokens"]) == (2, 11 + 9)
    assert result.saturation is None
    # Every stream asked for exactly its length, greedily, one token per event.
    for i, body in client.bodies.items():
        assert body == {"prompt": prompts(2)[i], "max_tokens": 6, "min_tokens": 6,
                        "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    assert sorted(client.bodies) == [0, 1] and client.legs == ["decode", "decode"]
    data = result.as_dict()
    assert data["intervals"] == list(result.intervals) and data["outside"] == list(result.outside)
    assert data["streams"] == list(result.streams) and data["tpot_s"] == 0.25
    assert isinstance(data["intervals"], list) and data["saturation"] is None


async def test_a_cell_needs_its_steps_with_the_whole_cohort(autojump_clock: trio.abc.Clock) -> None:
    result = await cell(FakeClient(two_streams()), 2, steps=3)
    assert not result.kept
    assert result.reason == ("only 4 intervals with the whole cohort resident; 6 needed "
                             "(3 steps of 2 streams)")  # fmt: skip
    assert result.tpot_s is result.active is result.kv_tokens is None
    assert result.kv_min is None and result.kv_max is None
    assert len(result.intervals) == 4  # still recorded
    assert [s["window_tpot_s"] for s in result.streams] == [0.25, 0.25]


@pytest.mark.parametrize(
    ("second", "reason"),
    [
        ({"usage": usage(prompt=9)},
         "stream 1 sent an exact 8-token prompt but the engine processed 9"),
        ({"done": False}, "stream 1 ended without data: [DONE]"),
        ({"finish": "stop"}, "stream 1 finished with 'stop', not 'length'"),
        ({"finish": None}, "stream 1 finished with None, not 'length'"),
        ({"usage": usage(7)}, "stream 1 counted 6 identified tokens but the engine reported 7"),
    ],
)
async def test_a_stream_that_does_not_check_out_rejects_the_cell(
    autojump_clock: trio.abc.Clock, second: dict[str, Any], reason: str
) -> None:
    result = await cell(FakeClient(two_streams(**second)), 2)
    assert not result.kept and result.reason == reason and result.tpot_s is None


async def test_a_stream_short_of_its_length_rejects_the_cell(autojump_clock: trio.abc.Clock) -> None:
    scripts = [tokens(0.5, 0.25, 6, usage=usage()), tokens(1.125, 0.25, 5, usage=usage(5))]
    result = await cell(FakeClient(scripts), 2)
    assert result.reason == "stream 1 produced 5 tokens; 6 were requested"
    scripts = [tokens(0.5, 0.25, 6, usage=usage()), Script([], usage=usage(0))]
    result = await cell(FakeClient(scripts), 2)
    assert result.reason == "stream 1 produced 0 tokens; 6 were requested"
    started = result.engine_metrics["before"]["at"]
    assert result.open_at is None and result.streams[1]["completed_at"] == started
    # Usage without counts (or with other types) is not a contradiction; an engine that
    # reports no usage at all is taken by its identified tokens.
    for u in (None, {"completion_tokens": "6", "prompt_tokens": "9"}, {}):
        ok = await cell(FakeClient([tokens(0.5, 0.25, 6, usage=u), tokens(1.125, 0.25, 6, usage=u)]), 2)
        assert ok.kept, ok.reason
        assert [s["usage_completion_tokens"] for s in ok.streams] == [None, None]


@pytest.mark.parametrize(
    ("ids", "problem"),
    [
        ((), "a token event carried no token id (the engine ignored return_token_ids)"),
        ((1, 2), "a token event carried 2 token ids; the profiler needs one per event"),
        ((-1,), "a token event carried an invalid token id -1"),
        ((True,), "a token event carried an invalid token id True"),
        ((1.0,), "a token event carried an invalid token id 1.0"),
    ],
)
async def test_a_token_event_without_one_valid_id_rejects_the_cell(
    autojump_clock: trio.abc.Clock, ids: tuple[Any, ...], problem: str
) -> None:
    bad = tokens(1.125, 0.25, 6, usage=usage(), ids=lambda i: ids if i == 2 else (5,))
    result = await cell(FakeClient([tokens(0.5, 0.25, 6, usage=usage()), bad]), 2)
    assert not result.kept and result.reason == problem
    # The cohort stops at the first failing stream: stream 0 never reported.
    [row] = result.streams
    assert result.close_at is None  # the failing stream did not complete
    assert (row["stream"], row["problem"], row["tokens"], row["done"]) == (1, problem, 2, False)
    assert (await cell(FakeClient([tokens(0.5, 0.25, 6, usage=usage(), ids=lambda i: (0,))]), 1,
                       steps=1)).kept  # fmt: skip


async def test_an_engine_error_in_a_stream_is_raised(autojump_clock: trio.abc.Clock) -> None:
    error = EngineError("engine f0 broke", engine="f0", leg="decode")
    client = FakeClient(two_streams(raise_at_end=error))
    with pytest.raises(EngineError) as info:
        await cell(client, 2)
    assert info.value is error


async def test_a_stream_waits_for_its_first_token_in_proportion_to_the_cohort(
    autojump_clock: trio.abc.Clock,
) -> None:
    limits = StreamLimits(first_token_s=1.0, between_tokens_s=0.3)
    late = [tokens(1.5, 0.25, 6, usage=usage())]
    with pytest.raises(EngineTimeout) as info:
        await cell(FakeClient(late), 1, limits=limits, steps=1)
    assert str(info.value).startswith(
        "engine f0 kept a profile stream waiting too long for its first token")
    assert (info.value.engine, info.value.leg) == ("f0", "decode")
    # Two streams share the first-token wait (each queues behind the other's prefill).
    both = [tokens(0.5, 0.25, 10, usage=usage(10)), tokens(1.875, 0.25, 10, usage=usage(10))]
    assert (await cell(FakeClient(both), 2, 10, limits=limits)).kept
    both = [tokens(0.5, 0.25, 10, usage=usage(10)), tokens(2.125, 0.25, 10, usage=usage(10))]
    with pytest.raises(EngineTimeout, match="for its first token"):
        await cell(FakeClient(both), 2, 10, limits=limits)


async def test_a_stream_that_stalls_between_tokens_times_out(autojump_clock: trio.abc.Clock) -> None:
    limits = StreamLimits(first_token_s=1.0, between_tokens_s=0.3)
    stalled = Script([0.5, 0.75, 1.0, 1.375, 1.625, 1.875], usage=usage())
    with pytest.raises(EngineTimeout) as info:
        await cell(FakeClient([stalled]), 1, limits=limits, steps=1)
    assert str(info.value).startswith("engine f0 kept a profile stream waiting too long for a token")
    assert (await cell(FakeClient([tokens(0.5, 0.25, 6, usage=usage())]), 1, limits=limits,
                       steps=1)).kept  # fmt: skip


async def test_a_stream_ending_without_a_finish_reason_still_closes_the_window(
    autojump_clock: trio.abc.Clock,
) -> None:
    # No event carries a finish_reason: the window closes when the stream's body ends.
    scripts = two_streams()
    scripts[0].finish = None
    result = await cell(FakeClient(scripts), 2)
    assert result.close_at == 1.75 and result.streams[0]["completed_at"] == 1.75
    assert result.reason == "stream 0 finished with None, not 'length'"
    # With one, the window closes at the event that carries it, not at the body's end.
    scripts = two_streams(tail_s=0.5)
    scripts[0].tail_s = 0.5
    result = await cell(FakeClient(scripts), 2)
    started = result.engine_metrics["before"]["at"]
    assert result.close_at == pytest.approx(started + 1.75) and result.kept
    assert [s["completed_at"] - started for s in result.streams] == pytest.approx([1.75, 2.375])


async def test_the_engines_gauges_are_recorded_however_metrics_answer(
    autojump_clock: trio.abc.Clock,
) -> None:
    broken = EngineError("metrics refused", engine="f0", leg="metrics")
    client = FakeClient(two_streams(), [broken, metrics(kv_size=None), (11.0, metrics())])
    result = await cell(client, 2)
    m = result.engine_metrics
    assert m["before"] == {"at": 0.0, "error": "metrics refused"}
    assert m["in_window"]["kv_tokens"] is None and m["in_window"]["at"] == 1.125
    assert m["after"] == {"at": 2.375, "error": "the engine's /metrics did not answer in time"}
    assert m["itl_mean_s"] is None and result.kept


async def test_gauges_answered_within_ten_seconds_count(autojump_clock: trio.abc.Clock) -> None:
    # An answer within ten seconds counts (stamped when asked); a zero count gives no mean.
    client = FakeClient([tokens(0.5, 0.25, 6, usage=usage())],
                        [(9.0, metrics(itl=(1.0, 10))), metrics(kv_size=0),
                         metrics(itl=(1.0, 10))])  # fmt: skip
    result = await cell(client, 1, steps=1)
    m = result.engine_metrics
    assert m["before"]["at"] == 0.0 and m["before"]["running"] == 2
    assert m["in_window"]["at"] == 9.5 and m["in_window"]["kv_tokens"] is None
    assert m["itl_mean_s"] is None


async def test_the_engines_mean_itl_spans_the_cell(autojump_clock: trio.abc.Clock) -> None:
    client = FakeClient([tokens(0.5, 0.25, 6, usage=usage())],
                        [metrics(itl=(1.0, 10)), metrics(), metrics(itl=(1.25, 11))])  # fmt: skip
    assert (await cell(client, 1, steps=1)).engine_metrics["itl_mean_s"] == 0.25


@pytest.mark.parametrize(
    ("running", "waiting", "flag"),
    [
        (2, 0, None),
        (3, 0, None),
        (1, 0, "near saturation: the engine reported 1 running and 0 waiting requests while "
               "the client inferred 2 active of 2"),
        (2, 1, "near saturation: the engine reported 2 running and 1 waiting requests while "
               "the client inferred 2 active of 2"),
    ],
)
async def test_gauges_that_contradict_the_cohort_flag_saturation(
    autojump_clock: trio.abc.Clock, running: int, waiting: int, flag: str | None
) -> None:
    client = FakeClient(two_streams(), [metrics(), metrics(running, waiting), metrics()])
    result = await cell(client, 2)
    assert result.saturation == flag and result.kept
    assert result.as_dict()["saturation"] == flag


async def test_unreadable_gauges_flag_nothing(autojump_clock: trio.abc.Clock) -> None:
    broken = EngineError("metrics refused", engine="f0", leg="metrics")
    result = await cell(FakeClient(two_streams(), [metrics(), broken, metrics()]), 2)
    assert result.saturation is None and "error" in result.engine_metrics["in_window"]


async def test_prompts_must_share_one_length() -> None:
    with pytest.raises(ValueError) as info:
        await run_cell(FakeClient([]), [[1, 2], [1, 2, 3]], max_tokens=4,  # type: ignore[arg-type]
                       limits=StreamLimits(), min_window_steps=1)  # fmt: skip
    assert str(info.value) == "a cell needs prompts of one length"
    with pytest.raises(ValueError, match="a cell needs prompts of one length"):
        await run_cell(FakeClient([]), [], max_tokens=4,  # type: ignore[arg-type]
                       limits=StreamLimits(), min_window_steps=1)  # fmt: skip


def test_the_window_opens_once_and_keeps_only_whole_cohort_intervals() -> None:
    opened = []
    c = CohortCollector(2, on_open=lambda: opened.append(True))
    assert not c.is_open and not c.finished and c.failure is None
    c.feed(FirstToken(0, 1.0))
    assert c.open_at is None
    c.feed(FirstToken(1, 2.0))
    assert c.open_at == 2.0 and c.is_open and opened == [True]
    c.feed(Interval(0, 1, 1.5, 2.5))  # began before the window: ramp
    c.feed(Interval(1, 1, 2.0, 2.5))  # began at the opening: kept
    c.feed(FirstToken(1, 2.6))  # a repeated first token neither reopens nor calls back
    assert c.open_at == 2.0 and opened == [True]
    c.feed(Completed(0, 3.0))
    c.feed(Completed(0, 3.5))  # only the first completion counts
    c.feed(Completed(1, 4.0))
    assert c.close_at == 3.0 and not c.is_open and c.completed_at == {0: 3.0, 1: 4.0}
    c.feed(Interval(1, 2, 2.5, 3.2))
    assert [(iv.stream, iv.index) for iv in c.kept] == [(1, 1)]
    assert [(iv.stream, iv.index) for iv in c.ramp] == [(0, 1)]
    assert [(iv.stream, iv.index) for iv in c.tail] == [(1, 2)]
    assert c.arrivals == {0: [1.0, 2.5], 1: [2.0, 2.5, 2.6, 3.2]}


def test_a_window_never_opens_after_a_stream_completed() -> None:
    c = CohortCollector(2)
    c.feed(FirstToken(0, 1.0))
    c.feed(Completed(0, 2.0))
    c.feed(FirstToken(1, 3.0))
    assert c.open_at is None and not c.is_open
    c.feed(Interval(1, 1, 3.0, 3.5))
    assert c.tail and not c.kept and not c.ramp


def test_the_first_failing_stream_is_the_failure() -> None:
    c = CohortCollector(3)
    c.feed(StreamEnd(0, 5, True, "length", 5))
    assert c.failure is None and not c.finished
    c.feed(StreamEnd(2, 1, False, None, None, problem="bad id"))
    assert c.failure is not None and c.failure.stream == 2 and c.finished
    c.feed(StreamEnd(1, 1, False, None, None, error=EngineError("x", engine="f0")))
    assert c.failure.stream == 2  # in the order they ended
    d = CohortCollector(2)
    d.feed(StreamEnd(0, 1, False, None, None, error=EngineError("x", engine="f0")))
    assert d.failure is not None and d.failure.stream == 0 and d.finished


def test_load_counts_streams_from_their_first_token_until_their_last() -> None:
    c = CohortCollector(3)
    for msg in (FirstToken(0, 1.0), FirstToken(1, 2.0), Interval(0, 1, 1.0, 2.0),
                Interval(0, 2, 2.0, 3.0), Completed(0, 3.0)):  # fmt: skip
        c.feed(msg)
    assert infer_load(c, 10, 0.5) == (0, 0)
    assert infer_load(c, 10, 1.0) == (1, 11)  # resident from its first token on
    assert infer_load(c, 10, 2.0) == (2, 12 + 11)  # a token at ``at`` is counted
    assert infer_load(c, 10, 2.5) == (2, 12 + 11)
    assert infer_load(c, 10, 3.0) == (1, 11)  # stream 0 is gone at its completion
    assert math.isclose(infer_load(c, 10, 2.999)[1], 23)
    # A stream not yet started, or gone, before others in the cohort's order.
    late = CohortCollector(3)
    for msg in (FirstToken(1, 1.0), FirstToken(2, 1.0), Completed(1, 2.0), FirstToken(0, 5.0)):
        late.feed(msg)
    assert infer_load(late, 10, 1.5) == (2, 22)
    assert infer_load(late, 10, 3.0) == (1, 11)
