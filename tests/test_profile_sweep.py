"""The sweeps against simulated engines with known latency models, in virtual time."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import FaultSpec
from narwhal.engines.client import EngineClient
from narwhal.profile.cohort import (
    CohortCollector,
    Completed,
    FirstToken,
    Interval,
    StreamEnd,
    StreamLimits,
    run_cell,
)
from narwhal.profile.sweep import CODE_TOKENS, PromptFactory, probe_engine
from narwhal.testing import open_sim_fleet
from narwhal.testing.tokenizer import encode
from tests.profilekit import (
    DECODE,
    PREFILL,
    Recording,
    RewriteStreams,
    StripKVSize,
    engine,
    fleet,
    profile,
    samples,
    settings,
)


async def test_fits_recover_the_simulated_models(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, _ = await profile(config, sim.transport, settings(tmp_path))
    assert run.ok
    p = run.outcomes[0].profile
    assert p is not None
    assert (p.ttft.a, p.ttft.b, p.ttft.c) == pytest.approx(
        (PREFILL["a"], PREFILL["b"], PREFILL["c"]), rel=0.05
    )
    for n in (128, 700, 2048):
        truth = PREFILL["a"] + PREFILL["b"] * n + PREFILL["c"] * n * n
        assert p.predict_ttft(n) == pytest.approx(truth, rel=0.05)
    assert (p.decode.c0, p.decode.c1, p.decode.c2) == pytest.approx(
        (DECODE["c0"], DECODE["c1"], DECODE["c2"]), rel=0.05
    )
    assert p.decode.fit_mape < 0.01 and p.decode.cv_mape < 0.01
    assert p.decode.domain.active.min == 1 and p.decode.domain.active.max == 8


async def test_noisy_engines_still_give_curves_within_five_percent(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101, noise=0.02))
    async with open_sim_fleet(config) as sim:
        run, _ = await profile(config, sim.transport, settings(tmp_path, repeats=5))
    p = run.outcomes[0].profile
    assert p is not None
    for n in (128, 512, 1024, 2048):
        truth = PREFILL["a"] + PREFILL["b"] * n + PREFILL["c"] * n * n
        assert p.predict_ttft(n) == pytest.approx(truth, rel=0.05)
    for active, kv in ((1, 300), (4, 4000), (8, 8000)):
        truth = DECODE["c0"] + DECODE["c1"] * active + DECODE["c2"] * kv
        assert p.predict_tpot(active, kv) == pytest.approx(truth, rel=0.05)
    # The medians are those of the recorded repeats, per exact length.
    prefill = samples(run)["engines"]["e0"]["prefill"]
    for row in prefill["medians"]:
        times = [r["ttft_s"] for r in prefill["repeats"] if r["length"] == row["length"]]
        assert len(times) == 5 and row["ttft_s"] == statistics.median(times)


async def test_prompts_are_exact_unique_and_tokenized_first(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101, prefix_caching=True))
    async with open_sim_fleet(config) as sim:
        recording = Recording(sim.transport)
        s = settings(  # the plain sweeps only (the cached-prefix sweep and the burst probe
            # have their own tests)
            tmp_path, warmup=2, decode_concurrency=(1, 2), decode_input_lens=(64, 256, 512),
            prefix_fractions=(), queue_burst=0,
        )
        run, out = await profile(config, recording, s)
        engine_stats = sim.engines["e0"].stats
    assert run.ok
    seen = recording.seen
    completions = [(i, r) for i, r in enumerate(seen) if r.path == "/v1/completions"]
    prefills = [(i, r) for i, r in completions if not r.body.get("stream")]
    for i, r in completions:  # the engine tokenised every probe prompt before it was sent
        ids = r.body["prompt"]
        assert any(s.path == "/tokenize" and encode(s.body["prompt"])[: len(ids)] == ids
                   for s in seen[:i])  # fmt: skip
    for i, r in prefills:  # tokenised, then (a measured repeat) the engine's clock read
        before = [s.path for s in seen[:i] if s.path != "/metrics"]
        assert before[-1] == "/tokenize" and r.body["max_tokens"] == 1
    heads = [tuple(r.body["prompt"][:CODE_TOKENS]) for _, r in completions]
    assert len(set(heads)) == len(heads)  # no two prompts share their first block
    assert engine_stats.prompt_tokens["local_cache_hit"] == 0
    record = samples(run)["engines"]["e0"]
    assert record["engine"]["prefix_caching"] is True
    assert any("prefix caching" in w for w in record["warnings"]) and "prefix caching" in out
    # Warm-up first (two per length, unrecorded as samples), then every repeat recorded.
    assert len(prefills) == 4 * 2 + 4 * 3
    assert [w["length"] for w in record["prefill"]["warmup"]] == [
        128,
        128,
        512,
        512,
        1024,
        1024,
        2048,
        2048,
    ]
    assert len(record["prefill"]["repeats"]) == 12
    first_measured = prefills[8][1].body["prompt"]
    assert len(first_measured) == 128 and record["prefill"]["repeats"][0]["length"] == 128
    streams = [r.body for _, r in completions if r.body.get("stream")]
    assert all(b["return_token_ids"] and b["ignore_eos"] and b["min_tokens"] == b["max_tokens"]
               for b in streams)  # fmt: skip


async def test_a_small_context_limit_drops_lengths_and_cells_and_says_so(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101, max_model_len=1100))
    s = settings(tmp_path, prefill_lens=(128, 256, 512, 1099, 1100, 2048),
                 decode_input_lens=(128, 256, 1090), decode_concurrency=(1, 2, 4),
                 decode_tokens=16)  # fmt: skip
    async with open_sim_fleet(config) as sim:
        run, out = await profile(config, sim.transport, s)
    assert run.ok
    record = samples(run)["engines"]["e0"]
    assert record["engine"]["max_model_len"] == 1100
    assert record["prefill"]["effective_lens"] == [128, 256, 512, 1099]
    assert [d["length"] for d in record["prefill"]["dropped_lens"]] == [1100, 2048]
    dropped = record["decode"]["dropped_cells"]
    assert [(d["input_len"], d["concurrency"]) for d in dropped] == [
        (1090, 1),
        (1090, 2),
        (1090, 4),
    ]
    assert all("live context limit 1100" in d["reason"] for d in dropped)
    assert "dropped length 2048" in out and "dropped cell input 1090 x 4 streams" in out
    assert len(record["decode"]["cells"]) == 6
    assert {c["input_len"] for c in record["decode"]["cells"]} == {128, 256}


async def test_cells_that_cannot_fit_the_kv_cache_are_dropped(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101, kv_capacity_tokens=4096))
    s = settings(tmp_path, decode_input_lens=(128, 256, 1024), decode_concurrency=(1, 2, 8))
    async with open_sim_fleet(config) as sim:
        run, _ = await profile(config, sim.transport, s)
    assert run.ok
    dropped = samples(run)["engines"]["e0"]["decode"]["dropped_cells"]
    assert [(d["input_len"], d["concurrency"]) for d in dropped] == [(1024, 8)]
    assert "KV tokens" in dropped[0]["reason"]


def _collector_with(messages: list[Any]) -> CohortCollector:
    c = CohortCollector(2)
    for m in messages:
        c.feed(m)
    return c


def test_cohort_window_spans_last_first_token_to_first_completion() -> None:
    # Stream 0 starts alone; its gaps before t=1.0 span stream 1's prefill (slow, 0.5 s).
    # Both are resident from 1.0 until stream 0 completes at 1.4 (steps of 0.1 s); after
    # that stream 1 decodes alone (steps of 0.05 s). Only the middle describes 2 streams.
    msgs: list[Any] = [FirstToken(0, 0.0), Interval(0, 1, 0.0, 0.6), FirstToken(1, 1.0),
                       Interval(0, 2, 0.6, 1.1), Interval(1, 1, 1.0, 1.1)]  # fmt: skip
    t = 1.1
    for k in range(3):
        msgs += [Interval(0, 3 + k, t, t + 0.1), Interval(1, 2 + k, t, t + 0.1)]
        t += 0.1
    msgs += [Completed(0, t), Interval(1, 5, t, t + 0.05), Interval(1, 6, t + 0.05, t + 0.1),
             Completed(1, t + 0.1)]  # fmt: skip
    c = _collector_with(msgs)
    assert c.open_at == 1.0 and c.close_at == pytest.approx(1.4)
    assert all(iv.start >= 1.0 and iv.end <= 1.4 + 1e-9 for iv in c.kept)
    assert [iv.seconds for iv in c.kept] == pytest.approx([0.1] * 7)
    assert [(iv.stream, iv.index) for iv in c.ramp] == [(0, 1), (0, 2)]
    assert len(c.tail) == 2
    everything = [iv.seconds for iv in c.kept + c.ramp + c.tail]
    assert statistics.mean(everything) > 0.11  # what a windowless profiler would see
    c.feed(StreamEnd(0, 5, True, "length", 5))
    assert not c.finished
    c.feed(StreamEnd(1, 7, True, "length", 7))
    assert c.finished


async def test_cohort_window_keeps_a_staggered_start_out_of_the_fit(
    autojump_clock: trio.abc.Clock,
) -> None:
    # One stream of four starts 0.4 s late: before it joins, three streams decode (shorter
    # steps); after the others finish it decodes alone. Those intervals are the majority
    # here and would pull the cell's TPOT well below the four-stream value.
    decode = {"c0": 0.005, "c1": 0.002, "c2": 0.0}
    config = fleet(engine("e0", 8101, decode=decode, prefill={"a": 0.002, "b": 0.0, "c": 0.0}))
    async with open_sim_fleet(config) as sim:
        sim.engines["e0"].inject(FaultSpec(kind="delay_headers", on="decode", times=1, delay_s=0.4))
        async with httpx.AsyncClient(transport=sim.transport) as http:
            client = EngineClient(config.engines[0].url, name="e0", http_client=http)
            facts = await probe_engine(client)
            factory = PromptFactory(client, seed=1, tokens_per_word=facts.tokens_per_word)
            prompts = [await factory(64) for _ in range(4)]
            with trio.fail_after(60):
                cell = await run_cell(client, prompts, max_tokens=60, limits=StreamLimits(),
                                      min_window_steps=8)  # fmt: skip
    assert cell.kept, cell.reason
    four = decode["c0"] + 4 * decode["c1"]
    assert all(iv["active"] == 4 for iv in cell.intervals)
    assert [iv["seconds"] for iv in cell.intervals] == pytest.approx([four] * len(cell.intervals))
    assert cell.tpot_s == pytest.approx(four)
    everything = [iv["seconds"] for iv in cell.intervals + cell.outside]
    assert len(cell.outside) > len(cell.intervals)
    assert statistics.median(everything) < 0.9 * four  # what a windowless profiler would fit
    assert cell.open_at is not None and cell.close_at is not None
    assert all(cell.open_at <= iv["start"] and iv["end"] <= cell.close_at for iv in cell.intervals)


async def test_engine_metrics_are_recorded_beside_inferred_load(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, _ = await profile(config, sim.transport, settings(tmp_path))
    cells = samples(run)["engines"]["e0"]["decode"]["cells"]
    for cell in cells:
        window = cell["engine_metrics"]["in_window"]
        assert window["running"] == window["inferred_active"] == cell["concurrency"]
        assert window["inferred_kv_tokens"] >= cell["concurrency"] * cell["input_len"]
        assert window["kv_tokens"] >= window["inferred_kv_tokens"]  # the engine reserves ahead
        assert cell["engine_metrics"]["itl_mean_s"] > 0
        kvs = [iv["kv_tokens"] for iv in cell["intervals"]]
        assert cell["kv_min"] == min(kvs) and cell["kv_max"] == max(kvs)


def _two_ids(index: int, obj: dict[str, Any]) -> list[dict[str, Any]]:
    if index == 5:
        choice = obj["choices"][0]
        choice["token_ids"] = choice["token_ids"] * 2
    return [obj]


def _drop_one(index: int, obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [] if index == 5 else [obj]


@pytest.mark.parametrize(
    ("rewrite", "reason"),
    [(_two_ids, "carried 2 token ids"), (_drop_one, "produced 24 tokens; 25 were requested")],
)
async def test_a_stream_failing_identity_or_count_checks_rejects_its_cell(
    autojump_clock: trio.abc.Clock, tmp_path: Path, rewrite: Any, reason: str
) -> None:
    config = fleet(engine("e0", 8101))
    for accept in (False, True):
        async with open_sim_fleet(config) as sim:
            transport = RewriteStreams(sim.transport, rewrite, which=0)  # the first cell's stream
            s = settings(tmp_path / str(accept), accept_rejected_cells=accept)
            run, out = await profile(config, transport, s)
        # Five cells remain for the fit, but a profile made without a cell says so and is
        # not a success unless the operator accepts it.
        outcome = run.outcomes[0]
        assert outcome.status == "ok" and run.ok is accept
        assert len(outcome.rejected_cells) == 1 and reason in outcome.rejected_cells[0]
        assert ("--accept-rejected-cells" in out) is not accept
        cells = samples(run)["engines"]["e0"]["decode"]["cells"]
        assert (cells[0]["input_len"], cells[0]["concurrency"], cells[0]["kept"]) == (256, 1, False)
        assert reason in cells[0]["reason"] and "rejected" in out
        assert all(c["kept"] for c in cells[1:])
        assert outcome.profile is not None and outcome.profile.decode_model.cells == 5


async def test_a_cell_needs_enough_whole_cohort_intervals(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101))
    async with open_sim_fleet(config) as sim:
        run, _ = await profile(config, sim.transport,
                               settings(tmp_path, decode_tokens=6, min_window_steps=12))  # fmt: skip
    record = samples(run)["engines"]["e0"]
    assert run.outcomes[0].status == "rejected"
    assert all(not c["kept"] and "intervals with the whole cohort resident" in c["reason"]
               for c in record["decode"]["cells"])  # fmt: skip
    assert "0 usable decode cells" in record["decode"]["rejection"]


async def test_kv_capacity_is_physical_when_reported_else_tpot_derived(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    config = fleet(engine("e0", 8101, kv_capacity_tokens=100_000),
                   controller={"slo": {"tpot_s": 0.02}})  # fmt: skip
    async with open_sim_fleet(config) as sim:
        physical, _ = await profile(config, sim.transport, settings(tmp_path / "a"))
        derived, _ = await profile(config, StripKVSize(sim.transport), settings(tmp_path / "b"))
    p = physical.outcomes[0].profile
    assert p is not None and p.kv_capacity.source == "physical" and p.kv_capacity.tokens == 100_000
    d = derived.outcomes[0].profile
    assert d is not None and d.kv_capacity.source == "tpot"
    expected = (0.02 - DECODE["c0"] - DECODE["c1"] * 8) / DECODE["c2"]
    assert d.kv_capacity.tokens == pytest.approx(expected, rel=0.05)
    assert d.kv_capacity.tpot_s == 0.02 and d.kv_capacity.active == 8
    assert samples(derived)["engines"]["e0"]["engine"]["kv_cache_size_tokens"] is None
