"""The sweeps' rules against a scripted engine, in virtual time: what the engine reports,
exact prompts, the prefill and cached-prefix sweeps, the decode plan, and what each
records (the samples, the dropped lengths and cells, the progress lines)."""

from __future__ import annotations

import io
import itertools
import math
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import trio

from narwhal.engines.client import EngineClient, Tokenized
from narwhal.engines.metrics import EngineMetrics, Sample
from narwhal.errors import EngineError, EngineTimeout
from narwhal.profile.cohort import StreamLimits
from narwhal.profile.progress import Progress
from narwhal.profile.sweep import (
    CODE_TOKENS,
    WORDS,
    EngineFacts,
    PromptFactory,
    SweepRejected,
    bounded,
    cell_summary,
    decode_sweep,
    plan_cells,
    plan_prefix_cells,
    prefill_sweep,
    prefix_sweep,
    probe_engine,
)
from narwhal.testing import open_sim_fleet
from tests.profilekit import engine, fleet


def cache_info(**labels: str) -> Sample:
    return Sample("vllm:cache_config_info", tuple(labels.items()), 1.0)


def engine_metrics(*infos: Sample, prefix: bool | None = True) -> EngineMetrics:
    return EngineMetrics(running=0, waiting=0, kv_usage=0.0, kv_cache_size_tokens=None,
                         prefix_caching=prefix, process_start_time=None,
                         samples={"vllm:cache_config_info": infos})  # fmt: skip


class Engine:
    """A scripted engine: a tokenizer of ``per_word`` tokens a word (ids from the word's
    place in WORDS), prefills that take ``0.001 + 1e-4 * uncached tokens`` seconds, and a
    prefix cache of every prompt it saw."""

    name = "f0"

    def __init__(self, *, max_model_len: int | None = 4096, per_word: int = 1,
                 metrics: Any = None, reset: bool = True) -> None:  # fmt: skip
        self.max_model_len, self.per_word = max_model_len, per_word
        self.answer = metrics if metrics is not None else engine_metrics(cache_info(block_size="16"))
        self.reset = reset
        self.texts: list[str] = []
        self.prefills: list[list[int]] = []
        self.resets = 0
        self.seen: list[list[int]] = []
        self.report_cached: Any = lambda cached: cached
        self.prompt_tokens: Any = len
        self.tokenize_delay = 0.0
        self.count_offset = 0
        self.extra_s = 0.0
        self.caps: list[int] = []  # the first tokenizations give at most these many ids
        self.reset_answers: list[bool] = []  # answers to the resets before ``reset``
        self.reset_delay = 0.0

    async def tokenize(self, text: str) -> Tokenized:
        await trio.sleep(self.tokenize_delay)
        self.texts.append(text)
        ids = tuple(WORDS.index(w) * 10 + j for w in text.split() for j in range(self.per_word))
        if self.caps:
            ids = ids[: self.caps.pop(0)]
        return Tokenized(len(ids) + self.count_offset, self.max_model_len, ids)

    async def metrics(self) -> EngineMetrics:
        if isinstance(self.answer, Exception):
            raise self.answer
        assert isinstance(self.answer, EngineMetrics)
        return self.answer

    async def reset_prefix_cache(self) -> bool:
        await trio.sleep(self.reset_delay)
        self.resets += 1
        answer = self.reset_answers.pop(0) if self.reset_answers else self.reset
        if answer:
            self.seen.clear()
        return answer

    async def prefill(self, body: dict[str, Any], *, transfer: bool) -> Any:
        assert transfer is False and body["temperature"] == 0.0 and set(body) == {"prompt", "temperature"}
        ids = list(body["prompt"])
        self.prefills.append(ids)
        cached = max((len(p) for p in self.seen if ids[: len(p)] == p and len(p) < len(ids)), default=0)
        self.seen.append(ids)
        started = trio.current_time()
        await trio.sleep(0.001 + 1e-4 * (len(ids) - cached) + self.extra_s)
        return SimpleNamespace(started_at=started, completed_at=trio.current_time(),
                               prompt_tokens=self.prompt_tokens(ids),
                               cached_tokens=self.report_cached(cached))  # fmt: skip


def plain() -> tuple[Progress, io.StringIO]:
    out = io.StringIO()
    return Progress(out, tty=False), out


class Statuses(Progress):
    """Records the transient status updates a terminal would show."""

    def __init__(self) -> None:
        super().__init__(io.StringIO(), tty=False)
        self.shown: list[str] = []

    def status(self, name: str, text: str) -> None:
        self.shown.append(f"{name}: {text}")


def facts(max_model_len: int = 4096, kv: int | None = None) -> EngineFacts:
    return EngineFacts(max_model_len, 1.0, True, kv, None, 16)


async def test_bounded_waits_up_to_its_limit(autojump_clock: trio.abc.Clock) -> None:
    e = Engine()

    async def answer(after: float, value: str) -> str:
        await trio.sleep(after)
        return value

    assert await bounded(e, 2.5, "x", answer, 2.4, "ok") == "ok"  # type: ignore[arg-type]
    with pytest.raises(EngineTimeout) as info:
        await bounded(e, 2.5, "/tokenize", answer, 2.6, "late")  # type: ignore[arg-type]
    assert str(info.value) == "engine f0 did not answer /tokenize within 2.5 s"
    assert (info.value.engine, info.value.leg) == ("f0", "profile")


@pytest.mark.parametrize(
    ("reported", "tokens"),
    [
        (("1000", "2500.9"), 3500),
        (("1",), 1),
        (("1000", "0"), None),
        (("1000", None), None),
        (("many",), None),
        (("0",), None),
        (("-5",), None),
        (("nan",), None),
        (("inf",), None),
        (("0.5",), None),  # rounds to nothing
        ((), None),
    ],
)
async def test_kv_capacity_is_the_sum_of_every_cores_report(
    reported: tuple[str | None, ...], tokens: int | None
) -> None:
    infos = [cache_info(block_size="32", **({} if r is None else {"kv_cache_size_tokens": r}))
             for r in reported]  # fmt: skip
    e = Engine(per_word=2, metrics=engine_metrics(*infos, prefix=False))
    got = await probe_engine(e)  # type: ignore[arg-type]
    assert got == EngineFacts(4096, 2.0, False, tokens, None, 32 if reported else None)
    assert e.texts == [" ".join(WORDS)]


async def test_an_engine_without_a_context_limit_or_ids_is_refused() -> None:
    with pytest.raises(SweepRejected) as info:
        await probe_engine(Engine(max_model_len=None))  # type: ignore[arg-type]
    assert str(info.value) == "engine f0 reports no max_model_len on /tokenize"
    e = Engine()
    e.count_offset = 1  # a count without as many ids
    with pytest.raises(SweepRejected) as info:
        await probe_engine(e)  # type: ignore[arg-type]
    assert str(info.value) == "engine f0's /tokenize returns no token ids"
    e = Engine(per_word=0)
    with pytest.raises(SweepRejected, match="returns no token ids"):
        await probe_engine(e)  # type: ignore[arg-type]


async def test_unreadable_metrics_leave_the_cache_unknown() -> None:
    e = Engine(metrics=EngineError("no /metrics here", engine="f0"))
    got = await probe_engine(e)  # type: ignore[arg-type]
    assert got == EngineFacts(4096, 1.0, None, None, "no /metrics here", None)
    assert got.as_dict() == {"max_model_len": 4096, "max_model_len_source": "/tokenize",
                             "tokens_per_word": 1.0, "prefix_caching": None,
                             "kv_cache_size_tokens": None, "metrics_error": "no /metrics here",
                             "block_size": None}  # fmt: skip


def _serial(ids: list[int]) -> int:
    digits = [ids[i] // 10 for i in range(CODE_TOKENS)]
    return sum(d * len(WORDS) ** i for i, d in enumerate(digits))


async def test_prompts_are_exact_and_numbered_from_a_seeded_start(
    autojump_clock: trio.abc.Clock,
) -> None:
    e = Engine()
    make = PromptFactory(e, seed=3)  # type: ignore[arg-type]
    first, second = await make(10), await make(CODE_TOKENS)
    assert len(first) == 10 and len(second) == CODE_TOKENS and make.made == 2
    space = len(WORDS) ** CODE_TOKENS
    assert _serial(second) == (_serial(first) + 1) % space
    # The serial starts at a seeded random place; the rest of a text is seeded too.
    again = PromptFactory(Engine(), seed=3)  # type: ignore[arg-type]
    assert await again(10) == first
    other = PromptFactory(Engine(), seed=4)  # type: ignore[arg-type]
    assert _serial(await other(10)) != _serial(first)
    # ceil(10 / density) + 2 words for the first try.
    assert len(e.texts[0].split()) == 12 and len(e.texts[1].split()) == CODE_TOKENS + 2
    with pytest.raises(ValueError, match=f"prompts need at least {CODE_TOKENS} tokens"):
        await make(CODE_TOKENS - 1)
    # The serial wraps around at the end of its space.
    make._serial = space - 1
    wrap = await make(8)
    assert _serial(wrap) == space - 1 and _serial(await make(8)) == 0


async def test_a_dense_tokenizer_gets_fewer_words(autojump_clock: trio.abc.Clock) -> None:
    e = Engine(per_word=2)
    make = PromptFactory(e, seed=1, tokens_per_word=2.0)  # type: ignore[arg-type]
    assert len(await make(100)) == 100
    assert len(e.texts[0].split()) == 52
    e = Engine(per_word=1)
    sparse = PromptFactory(e, seed=1, tokens_per_word=0.1)  # type: ignore[arg-type]
    assert len(await sparse(20)) == 20
    assert len(e.texts[0].split()) == 82  # density floored at 0.25 tokens a word


async def test_a_short_tokenization_is_retried_with_more_words_then_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    e = Engine(per_word=1)
    make = PromptFactory(e, seed=1, tokens_per_word=2.0)  # type: ignore[arg-type]
    assert len(await make(100)) == 100  # 52 words give 52 tokens: the second try is scaled
    assert [len(t.split()) for t in e.texts] == [52, 52 * 100 // 52 + 2]
    e = Engine()
    e.count_offset = 5  # counts that never match the ids
    make = PromptFactory(e, seed=1)  # type: ignore[arg-type]
    with pytest.raises(SweepRejected) as info:
        await make(10)
    assert str(info.value) == "engine f0's /tokenize did not give 10 token ids for a probe text"
    assert len(e.texts) == 4 and make.made == 0
    assert [len(t.split()) for t in e.texts] == [12, 13, 14, 15]


async def test_a_tokenization_of_exactly_the_length_is_taken(autojump_clock: trio.abc.Clock) -> None:
    e = Engine()
    assert len(await PromptFactory(e, seed=1, tokens_per_word=1.25)(10)) == 10  # type: ignore[arg-type]
    assert [len(t.split()) for t in e.texts] == [10]
    e = Engine()
    e.caps = [1]  # one token only: the next text is scaled by the whole shortfall
    assert len(await PromptFactory(e, seed=1)(10)) == 10  # type: ignore[arg-type]
    assert [len(t.split()) for t in e.texts] == [12, 12 * 10 + 2]


async def test_tokenizing_a_prompt_is_bounded(autojump_clock: trio.abc.Clock) -> None:
    e = Engine()
    e.tokenize_delay = 3.0
    with pytest.raises(EngineTimeout, match="did not answer /tokenize within 2 s"):
        await PromptFactory(e, seed=1, timeout_s=2.0)(8)  # type: ignore[arg-type]
    assert len(await PromptFactory(e, seed=1, timeout_s=3.5)(8)) == 8  # type: ignore[arg-type]
    e.tokenize_delay = 600.5  # the default limit is ten minutes
    with pytest.raises(EngineTimeout, match="did not answer /tokenize within 600 s"):
        await PromptFactory(e, seed=1)(8)  # type: ignore[arg-type]


async def test_the_prefill_sweep_records_lengths_warmups_repeats_and_medians(
    autojump_clock: trio.abc.Clock,
) -> None:
    e = Engine()
    progress, out = plain()
    record: dict[str, Any] = {}
    make = PromptFactory(e, seed=1)  # type: ignore[arg-type]
    medians = await prefill_sweep(e, facts(300), (200, 100, 299, 300, 100, 50), record,  # type: ignore[arg-type]
                                  repeats=3, warmup=2, prompt=make, timeout_s=10.0,
                                  progress=progress)  # fmt: skip
    assert record["requested_lens"] == [200, 100, 299, 300, 100, 50]
    assert record["effective_lens"] == [50, 100, 200, 299]
    assert record["dropped_lens"] == [
        {"length": 300, "reason": "300 prompt tokens + 1 output token exceed max_model_len 300"}]
    assert [w["length"] for w in record["warmup"]] == [50, 50, 100, 100, 200, 200, 299, 299]
    assert [(r["length"], r["repeat"]) for r in record["repeats"]] == [
        (n, r) for n in (50, 100, 200, 299) for r in range(3)]  # fmt: skip
    first = record["repeats"][0]
    assert set(first) == {"length", "ttft_s", "started_at", "prompt_tokens", "reported_cached",
                          "repeat"}  # fmt: skip
    assert first["ttft_s"] == pytest.approx(0.001 + 1e-4 * 50)
    assert first["prompt_tokens"] == 50 and first["reported_cached"] == 0
    assert medians == pytest.approx({n: 0.001 + 1e-4 * n for n in (50, 100, 200, 299)})
    assert record["medians"] == [{"length": n, "ttft_s": medians[n], "repeats": 3}
                                 for n in (50, 100, 200, 299)]  # fmt: skip
    assert [len(p) for p in e.prefills] == [50, 50, 100, 100, 200, 200, 299, 299] + [
        n for n in (50, 100, 200, 299) for _ in range(3)]  # fmt: skip
    assert out.getvalue().splitlines() == [
        "f0: prefill: dropped length 300: 300 prompt tokens + 1 output token exceed "
        "max_model_len 300",
        "f0: prefill: 50 tokens: median TTFT 6.00 ms over 3 repeats",
        "f0: prefill: 100 tokens: median TTFT 11.00 ms over 3 repeats",
        "f0: prefill: 200 tokens: median TTFT 21.00 ms over 3 repeats",
        "f0: prefill: 299 tokens: median TTFT 30.90 ms over 3 repeats",
    ]


async def test_the_median_is_of_the_repeats(autojump_clock: trio.abc.Clock) -> None:
    e = Engine()
    extra = itertools.cycle([0.0, 0.5, 0.1])
    original = e.prefill

    async def varying(body: dict[str, Any], *, transfer: bool) -> Any:
        e.extra_s = next(extra)
        return await original(body, transfer=transfer)

    e.prefill = varying  # type: ignore[method-assign]
    record: dict[str, Any] = {}
    statuses = Statuses()
    medians = await prefill_sweep(e, facts(), (10, 20, 30), record, repeats=3, warmup=0,  # type: ignore[arg-type]
                                  prompt=PromptFactory(e, seed=1), timeout_s=10.0,  # type: ignore[arg-type]
                                  progress=statuses)  # fmt: skip
    assert medians[10] == pytest.approx(0.001 + 1e-3 + 0.1) and record["warmup"] == []
    assert statuses.shown == [f"f0: prefill: {n} tokens, repeat {r}/3"
                              for n in (10, 20, 30) for r in (1, 2, 3)]  # fmt: skip
    statuses = Statuses()
    await prefill_sweep(e, facts(), (10, 20, 30), {}, repeats=1, warmup=2,  # type: ignore[arg-type]
                        prompt=PromptFactory(e, seed=1), timeout_s=10.0, progress=statuses)  # type: ignore[arg-type]  # fmt: skip
    assert statuses.shown[:6] == [f"f0: prefill: warming up at {n} tokens" for n in (10, 10, 20, 20, 30, 30)]


async def test_too_few_lengths_or_a_miscounted_prompt_reject_the_sweep(
    autojump_clock: trio.abc.Clock,
) -> None:
    e = Engine()
    record: dict[str, Any] = {}
    with pytest.raises(SweepRejected) as info:
        await prefill_sweep(e, facts(100), (50, 98, 100, 150), record, repeats=1, warmup=1,  # type: ignore[arg-type]
                            prompt=PromptFactory(e, seed=1), timeout_s=10.0,  # type: ignore[arg-type]
                            progress=plain()[0])  # fmt: skip
    assert str(info.value) == "only 2 prefill lengths fit max_model_len 100; at least 3 are needed"
    assert e.prefills == [] and record["effective_lens"] == [50, 98]
    e.prompt_tokens = lambda ids: len(ids) + 1
    with pytest.raises(SweepRejected) as info:
        await prefill_sweep(e, facts(), (10, 20, 30), {}, repeats=1, warmup=0,  # type: ignore[arg-type]
                            prompt=PromptFactory(e, seed=1), timeout_s=10.0,  # type: ignore[arg-type]
                            progress=plain()[0])  # fmt: skip
    assert str(info.value) == "engine f0 processed 11 prompt tokens for an exact 10-token prompt"
    e.prompt_tokens = lambda ids: None  # an engine that reports no usage is taken at its word
    assert await prefill_sweep(e, facts(), (10, 20, 30), {}, repeats=1, warmup=0,  # type: ignore[arg-type]
                               prompt=PromptFactory(e, seed=1), timeout_s=10.0,  # type: ignore[arg-type]
                               progress=plain()[0])  # fmt: skip


async def test_a_prefill_past_its_deadline_fails_the_engine(autojump_clock: trio.abc.Clock) -> None:
    e = Engine()
    e.extra_s = 2.0
    with pytest.raises(EngineTimeout) as info:
        await prefill_sweep(e, facts(), (10, 20, 30), {}, repeats=1, warmup=0,  # type: ignore[arg-type]
                            prompt=PromptFactory(e, seed=1), timeout_s=2.0,  # type: ignore[arg-type]
                            progress=plain()[0])  # fmt: skip
    assert str(info.value) == "engine f0 took over 2 s for a 10-token prefill"
    assert (info.value.engine, info.value.leg) == ("f0", "prefill")


def test_prefix_cells_hold_whole_blocks_short_of_the_last_token() -> None:
    cells = plan_prefix_cells((64, 40, 64, 4000, 33), (0.5, 0.25, 0.999), block_size=16,
                              max_model_len=4000)  # fmt: skip
    # 64: 32 and 16 and (63 // 16 * 16 =) 48; 40: 16 and 32; 33: 16 and 32; 4000 does not fit.
    assert cells == [(33, 16), (33, 32), (40, 16), (40, 32), (64, 16), (64, 32), (64, 48)]
    assert plan_prefix_cells((3999,), (0.5,), block_size=16, max_model_len=4000) == [(3999, 1984)]
    assert plan_prefix_cells((17,), (0.5, 0.99), block_size=16, max_model_len=4000) == [(17, 16)]
    assert plan_prefix_cells((16,), (0.99,), block_size=16, max_model_len=4000) == []
    # Even a whole-prompt share leaves the last token to compute (whole blocks before it).
    assert plan_prefix_cells((64, 63), (1.0,), block_size=16, max_model_len=4000) == [(63, 48), (64, 48)]


async def test_the_prefix_sweep_warms_each_prefix_then_measures_the_prompt(
    autojump_clock: trio.abc.Clock,
) -> None:
    e = Engine()
    progress, out = plain()
    record: dict[str, Any] = {}
    await prefix_sweep(e, [(64, 32), (64, 48)], record, repeats=2,  # type: ignore[arg-type]
                       prompt=PromptFactory(e, seed=1), timeout_s=10.0, progress=progress)  # type: ignore[arg-type]  # fmt: skip
    statuses, big = Statuses(), Engine()
    await prefix_sweep(big, [(640, 320), (640, 480)], {}, repeats=2,  # type: ignore[arg-type]
                       prompt=PromptFactory(big, seed=2), timeout_s=10.0, progress=statuses)  # type: ignore[arg-type]  # fmt: skip
    assert statuses.shown == [f"f0: prefix: cell {i}/2: 640 tokens, {k} cached, repeat {r}/2"
                              for i, k in ((1, 320), (2, 480)) for r in (1, 2)]  # fmt: skip
    assert statuses.warnings == [] and statuses.stream.getvalue().splitlines() == [  # type: ignore[attr-defined]
        "f0: prefix: 640 tokens, 320 cached: median TTFT 33.00 ms over 2 repeats",
        "f0: prefix: 640 tokens, 480 cached: median TTFT 17.00 ms over 2 repeats",
    ]
    assert record["cells"] == [{"length": 64, "cached": 32}, {"length": 64, "cached": 48}]
    assert record["reset"] == "POST /reset_prefix_cache before every cell" and e.resets == 2
    assert [len(w) for w in e.prefills] == [32, 64, 32, 64, 48, 64, 48, 64]
    assert [w["length"] for w in record["warm"]] == [32, 32, 48, 48]
    assert [(r["length"], r["cached"], r["repeat"], r["reported_cached"]) for r in record["repeats"]] == [
        (64, 32, 0, 32), (64, 32, 1, 32), (64, 48, 0, 48), (64, 48, 1, 48)]  # fmt: skip
    assert record["repeats"][0]["ttft_s"] == pytest.approx(0.001 + 1e-4 * 32)
    assert record["mismatched"] == []
    assert out.getvalue().splitlines() == [
        "f0: prefix: 64 tokens, 32 cached: median TTFT 4.20 ms over 2 repeats",
        "f0: prefix: 64 tokens, 48 cached: median TTFT 2.60 ms over 2 repeats",
    ]


async def test_without_the_reset_route_the_cache_is_asked_once(autojump_clock: trio.abc.Clock) -> None:
    e = Engine(reset=False)
    record: dict[str, Any] = {}
    await prefix_sweep(e, [(64, 32), (64, 48)], record, repeats=1,  # type: ignore[arg-type]
                       prompt=PromptFactory(e, seed=1), timeout_s=10.0, progress=plain()[0])  # type: ignore[arg-type]  # fmt: skip
    assert e.resets == 1
    assert record["reset"] == ("not offered (POST /reset_prefix_cache refused): unique prompts "
                               "only")  # fmt: skip
    # An engine that stops accepting it is not asked again, and the record says where.
    e = Engine()
    e.reset_answers = [True, True, False]
    record = {}
    await prefix_sweep(e, [(64, 16), (64, 32), (64, 48), (128, 64)], record, repeats=1,  # type: ignore[arg-type]
                       prompt=PromptFactory(e, seed=1), timeout_s=10.0, progress=plain()[0])  # type: ignore[arg-type]  # fmt: skip
    assert e.resets == 3
    assert record["reset"] == ("POST /reset_prefix_cache before cells 1-2, refused from cell 3 "
                               "on: unique prompts only there")  # fmt: skip
    e = Engine()
    e.reset_delay = 3.0
    with pytest.raises(EngineTimeout) as info:
        await prefix_sweep(e, [(64, 16)], {}, repeats=1, prompt=PromptFactory(e, seed=1),  # type: ignore[arg-type]
                           timeout_s=2.0, progress=plain()[0])  # fmt: skip
    assert str(info.value) == "engine f0 did not answer POST /reset_prefix_cache within 2 s"


async def test_an_evicted_prefix_is_measured_again_then_refused(autojump_clock: trio.abc.Clock) -> None:
    e = Engine()
    reports = iter([0, 32])  # the first try's prefix was evicted
    e.report_cached = lambda cached: next(reports) if cached else 0
    record: dict[str, Any] = {}
    await prefix_sweep(e, [(64, 32)], record, repeats=1, prompt=PromptFactory(e, seed=1),  # type: ignore[arg-type]
                       timeout_s=10.0, progress=plain()[0])  # fmt: skip
    assert [m["reported_cached"] for m in record["mismatched"]] == [0]
    assert [r["reported_cached"] for r in record["repeats"]] == [32]
    e.report_cached = lambda cached: None  # no count reported: taken as served
    record = {}
    await prefix_sweep(e, [(64, 32)], record, repeats=1, prompt=PromptFactory(e, seed=2),  # type: ignore[arg-type]
                       timeout_s=10.0, progress=plain()[0])  # fmt: skip
    assert record["mismatched"] == [] and len(record["repeats"]) == 1
    e.report_cached = lambda cached: 16
    record = {}
    with pytest.raises(SweepRejected) as info:
        await prefix_sweep(e, [(64, 32)], record, repeats=1, prompt=PromptFactory(e, seed=3),  # type: ignore[arg-type]
                           timeout_s=10.0, progress=plain()[0])  # fmt: skip
    assert str(info.value) == ("engine f0 served 16 cached tokens of a 64-token prompt whose first "
                               "32 were just prefilled, 3 times (is its cache under other load?)")  # fmt: skip
    assert len(record["mismatched"]) == 3 and record["repeats"] == []


def test_decode_cells_fit_the_context_and_the_kv_cache() -> None:
    cells, dropped = plan_cells((100, 50, 100), (2, 1), decode_tokens=10, max_model_len=112,
                                kv_cache_size_tokens=None, shared_prefix=0, block_size=16)  # fmt: skip
    assert cells == [(50, 1, 11), (50, 2, 12), (100, 1, 11), (100, 2, 12)]  # 100 + 12 fits 112
    assert dropped == []
    cells, dropped = plan_cells((100,), (1, 2), decode_tokens=10, max_model_len=111,
                                kv_cache_size_tokens=None, shared_prefix=0, block_size=16)  # fmt: skip
    assert cells == [(100, 1, 11)]
    assert dropped == [{"input_len": 100, "concurrency": 2, "max_tokens": 12,
                        "reason": "input 100 + requested output 12 = 112 tokens exceed the live "
                                  "context limit 111"}]  # fmt: skip
    cells, dropped = plan_cells((100,), (1, 2, 3), decode_tokens=10, max_model_len=4096,
                                kv_cache_size_tokens=224, shared_prefix=0, block_size=16)  # fmt: skip
    assert cells == [(100, 1, 11), (100, 2, 12)]  # 2 x 112 = 224 fits exactly
    assert plan_cells((100,), (3,), decode_tokens=10, max_model_len=4096,
                      kv_cache_size_tokens=300, shared_prefix=0, block_size=16)[0] == []  # 3 x 113 = 339  # fmt: skip
    assert dropped == [{"input_len": 100, "concurrency": 3, "max_tokens": 13,
                        "reason": "3 streams of 113 tokens need 339 KV tokens; the engine "
                                  "holds 224"}]  # fmt: skip


def test_the_cell_summary_is_one_row_per_kept_cell() -> None:
    kept = {"input_len": 64, "concurrency": 2, "active": 2.0, "kv_tokens": 150.0, "tpot_s": 0.01,
            "intervals": [{}, {}, {}], "kept": True, "reason": None}  # fmt: skip
    assert cell_summary([kept, kept | {"kept": False}]) == [
        {"input_len": 64, "concurrency": 2, "active": 2.0, "kv_tokens": 150.0, "tpot_s": 0.01,
         "intervals": 3}]  # fmt: skip


async def test_the_decode_sweep_runs_every_planned_cell_and_records_each(
    autojump_clock: trio.abc.Clock,
) -> None:
    decode = {"c0": 0.005, "c1": 0.002, "c2": 0.0}
    config = fleet(engine("e0", 8101, decode=decode, prefill={"a": 0.002, "b": 0.0, "c": 0.0}))
    async with open_sim_fleet(config) as sim:
        client = EngineClient(config.engines[0].url, name="e0", transport=sim.transport)
        got = await probe_engine(client)
        progress, out = plain()
        record: dict[str, Any] = {}
        with trio.fail_after(600):
            kept = await decode_sweep(client, got, (32, 4090), (1, 2), record, decode_tokens=8,
                                      min_window_steps=40, prompt=PromptFactory(client, seed=1),
                                      limits=StreamLimits(), progress=progress)  # fmt: skip
        assert kept == []  # 8 steps never give 40 with the whole cohort
        record = {}
        statuses = Statuses()
        with trio.fail_after(600):
            await decode_sweep(client, attrs.evolve(got, kv_cache_size_tokens=83), (32, 64), (1, 2),
                               record, decode_tokens=8, min_window_steps=40,
                               prompt=PromptFactory(client, seed=1), limits=StreamLimits(),
                               progress=statuses)  # fmt: skip
        assert [(d["input_len"], d["concurrency"]) for d in record["dropped_cells"]] == [
            (32, 2), (64, 2)]  # 2 x (32 + 10) = 84 > 83  # fmt: skip
        assert statuses.shown == ["e0: decode: cell 1/2: input 32 x 1 streams",
                                  "e0: decode: cell 2/2: input 64 x 1 streams"]  # fmt: skip
        record = {}
        with trio.fail_after(600):
            kept = await decode_sweep(client, got, (32, 4090), (1, 2), record, decode_tokens=8,
                                      min_window_steps=4, prompt=PromptFactory(client, seed=1),
                                      limits=StreamLimits(), progress=progress)  # fmt: skip
    assert record["requested_cells"] == [{"input_len": n, "concurrency": c}
                                         for n in (32, 4090) for c in (1, 2)]  # fmt: skip
    assert [(d["input_len"], d["concurrency"]) for d in record["dropped_cells"]] == [(4090, 1), (4090, 2)]
    assert [(c.input_len, c.concurrency, c.max_tokens) for c in kept] == [(32, 1, 9), (32, 2, 10)]
    assert [c["tpot_s"] for c in record["cells"]] == [c.tpot_s for c in kept]
    assert kept[1].tpot_s == pytest.approx(decode["c0"] + 2 * decode["c1"])
    lines = out.getvalue().splitlines()
    assert lines[0] == ("e0: decode: dropped cell input 4090 x 1 streams: input 4090 + requested "
                        "output 9 = 4099 tokens exceed the live context limit 4096")  # fmt: skip
    assert lines[2].startswith("e0: warning: decode: cell input 32 x 1 streams rejected: only ")
    assert lines[-1] == (f"e0: decode: cell input 32 x 2 streams: median TPOT "
                         f"{kept[1].tpot_s * 1e3:.3f} ms at {kept[1].kv_tokens:.0f} resident KV "
                         f"tokens ({len(kept[1].intervals)} intervals)")  # fmt: skip
    assert math.isfinite(kept[0].tpot_s or math.nan)
