"""narwhal bench against the router on simulated engines, in virtual time.

The router in memory (``tests/routerkit.py``) is what ``narwhal serve`` runs; the
simulated engines' latency model makes every expected figure exact: a prompt of L
tokens prefills in ``a + b*L`` seconds and each decode step takes ``c0``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.bench import (
    SLO,
    BenchError,
    BenchOptions,
    BenchRunner,
    LengthDist,
    RequestResult,
    ScheduledRequest,
    Workload,
    build_schedule,
    join_journal,
    join_row,
    run_bench,
    summarize,
)
from narwhal.config import FaultSpec

from .routerkit import ROUTER_HOST, ROUTER_PORT, fleet_doc, open_stack

URL = f"http://{ROUTER_HOST}:{ROUTER_PORT}"
PREFILL_S = 0.010 + 1e-4 * 100  # routerkit's SIM model for a 100-token prompt
STEP_S = 0.005


def _constant(n: int, *, rate: float = 10, output: int = 8, prompt: int = 100) -> list[ScheduledRequest]:
    return build_schedule(
        Workload(
            rate=rate,
            arrival="constant",
            num_requests=n,
            input_len=LengthDist("fixed", prompt),
            output_len=LengthDist("fixed", output),
        )
    )


def _summary(records: list[RequestResult], slo: SLO, duration_s: float = 1.0) -> dict[str, Any]:
    return summarize(records, slo=slo, duration_s=duration_s, run={}, workload={})


async def test_ttft_and_tpot_match_the_latency_model_and_the_journal(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with open_stack() as stack:
        run = await run_bench(_constant(5), BenchOptions(url=URL), transport=stack.net.transport())
    assert run.model == "sim-llama"
    for i, rec in enumerate(run.records):
        assert rec.terminal_class == "ok" and rec.status == 200 and rec.done
        assert rec.scheduled_s == pytest.approx(i * 0.1) and rec.actual_s == pytest.approx(i * 0.1)
        assert rec.lag_s == pytest.approx(0, abs=1e-9)
        assert rec.output_len == rec.requested_output_len == rec.completion_tokens == 8
        assert rec.prompt_len == rec.prompt_tokens == 100
        # Client TTFT: request start -> first identified token = prefill + one decode step.
        assert rec.ttft_s == pytest.approx(PREFILL_S + STEP_S, abs=1e-9)
        # Client TPOT: first -> last token over output_len - 1 = one decode step.
        assert rec.tpot_s == pytest.approx(STEP_S, abs=1e-9)
        assert rec.latency_s == pytest.approx(PREFILL_S + 8 * STEP_S, abs=1e-9)
        assert rec.events_without_ids == 0
    assert run.duration_s == pytest.approx(0.4 + PREFILL_S + 8 * STEP_S, abs=1e-9)

    journal = tmp_path / "journal.jsonl"
    journal.write_text("".join(json.dumps(r) + "\n" for r in stack.records))
    joined = join_journal(run.records, journal)
    assert len(joined.rows) == 5 and joined.unmatched == [] and joined.ambiguous == []
    for row, rec in zip(joined.rows, run.records, strict=True):
        assert row["request_id"] == rec.request_id  # the x-request-id the router journaled
        assert row["router_class"] == "ok" and row["classes_agree"] and row["output_len_agrees"]
        assert row["router_ttft_s"] == pytest.approx(PREFILL_S, abs=1e-9)
        assert row["transfer_queue_s"] == pytest.approx(STEP_S, abs=1e-9)  # first_byte_s - ttft_s
        assert row["router_first_byte_s"] == pytest.approx(rec.ttft_s, abs=1e-9)
        assert row["outside_router_s"] == pytest.approx(0, abs=1e-9)  # an in-memory network
        # The router's TPOT starts at prefill completion; the client's at the first token.
        assert row["router_tpot_s"] == pytest.approx(8 * STEP_S / 7, abs=1e-9)
        assert row["client_tpot_s"] == pytest.approx(STEP_S, abs=1e-9)
    parts = joined.summary()["parts_over_successes"]
    assert parts["router_ttft_s"]["p50"] == pytest.approx(PREFILL_S, abs=1e-9)


async def test_refused_and_failed_requests_stay_in_the_denominator(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(server={"max_concurrent_requests": 1})
    schedule = [
        ScheduledRequest(0, 0.0, 8, 100),  # the decode engine breaks this one after 3 tokens
        ScheduledRequest(1, 1.0, 8, 100),  # a burst of three: one admitted, two refused
        ScheduledRequest(2, 1.0, 8, 100),
        ScheduledRequest(3, 1.0, 8, 100),
        ScheduledRequest(4, 2.0, 8, 100),
    ]
    async with open_stack(doc) as stack:
        stack.engine("d0").inject(FaultSpec(kind="error_in_stream", on="decode", times=1, after_tokens=3,
                                            message="injected decode failure"))
        run = await run_bench(schedule, BenchOptions(url=URL), transport=stack.net.transport())
    classes = [r.terminal_class for r in run.records]
    assert classes[0] == "stream_error" and classes[4] == "ok"
    assert sorted(classes[1:4]) == ["ok", "refused", "refused"]
    failed = run.records[0]
    assert failed.status == 200 and failed.output_len == 3 and not failed.done
    assert failed.error is not None and failed.error["type"] == "engine_error" and "d0" in failed.error["message"]
    refused = [r for r in run.records if r.terminal_class == "refused"]
    assert all(r.status == 503 and r.error and r.error["message"] for r in refused)
    assert all(r.scored for r in run.records)

    summary = _summary(run.records, SLO(ttft_s=1.0, tpot_s=1.0))
    assert summary["counts"]["scored"] == 5
    assert summary["counts"]["by_class"] == {"ok": 2, "refused": 2, "stream_error": 1}
    assert summary["attainment"]["denominator"] == 5
    assert summary["attainment"]["both"] == {"met": 2, "ratio": 0.4}
    assert summary["attainment"]["ttft"]["ratio"] == 0.4
    assert summary["slo_held"] is False
    assert summary["ttft_s"]["successes"]["n"] == 2
    assert summary["ttft_s"]["with_failures"] == {
        "n": 5, "misses": 3, "p50": "miss", "p90": "miss", "p99": "miss", "max": "miss",
    }
    assert summary["ttft_s"]["successes"]["p99"] == pytest.approx(PREFILL_S + STEP_S, abs=1e-9)
    # The router journal has the same outcomes under the same ids.
    by_id = {r["request_id"]: r for r in stack.records}
    assert [by_id[r.request_id]["terminal_class"] for r in run.records] == [
        "decode_failed" if c == "stream_error" else c for c in classes
    ]


async def test_empty_text_tokens_count(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        run = await run_bench(_constant(4, output=64), BenchOptions(url=URL, route="chat"),
                              transport=stack.net.transport())
    # The simulator detokenizes about one id in eight to "" (a partial character).
    assert sum(r.empty_text_tokens for r in run.records) > 0
    for rec in run.records:
        assert rec.terminal_class == "ok"
        assert rec.output_len == rec.completion_tokens == 64
        assert rec.prompt_tokens == 100 + 2  # the chat template adds two tokens
        assert rec.tpot_s == pytest.approx(STEP_S, abs=1e-9)


async def test_one_token_has_no_tpot(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        run = await run_bench(_constant(3, output=1), BenchOptions(url=URL), transport=stack.net.transport())
    for rec in run.records:
        assert rec.terminal_class == "ok" and rec.output_len == 1
        assert rec.ttft_s == pytest.approx(PREFILL_S + STEP_S, abs=1e-9)
        assert rec.tpot_s is None
    summary = _summary(run.records, SLO(ttft_s=1.0, tpot_s=1e-9))
    assert summary["tpot_s"]["successes"]["n"] == 0
    assert summary["attainment"]["tpot"]["ratio"] == 1.0  # nothing to miss


async def test_saturated_client_keeps_scheduled_and_actual_start(autojump_clock: trio.abc.Clock) -> None:
    # One slot, a request every 10 ms, each taking 60 ms: the client falls behind.
    async with open_stack() as stack:
        run = await run_bench(_constant(4, rate=100), BenchOptions(url=URL, concurrency=1),
                              transport=stack.net.transport())
    service = PREFILL_S + 8 * STEP_S
    for i, rec in enumerate(run.records):
        assert rec.terminal_class == "ok"
        assert rec.scheduled_s == pytest.approx(i * 0.01)
        assert rec.actual_s == pytest.approx(i * service)
        assert rec.lag_s == pytest.approx(i * (service - 0.01))
        assert rec.cap_wait_s == pytest.approx(i * (service - 0.01))
        assert rec.ttft_s == pytest.approx(PREFILL_S + STEP_S, abs=1e-9)  # from the actual start
    summary = summarize(run.records, slo=SLO(), duration_s=run.duration_s, run={}, workload={}, late_after_s=0.01)
    assert summary["lag_s"]["late"] == 3
    assert summary["lag_s"]["max"] == pytest.approx(3 * (service - 0.01))
    assert summary["lag_s"]["cap_wait_s"]["max"] == pytest.approx(3 * (service - 0.01))


async def test_client_timeout_is_a_scored_failure(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        stack.engine("d0").inject(FaultSpec(kind="silence_after", on="decode", times=1, after_tokens=2))
        t0 = trio.current_time()
        run = await run_bench(_constant(1), BenchOptions(url=URL, request_timeout_s=1.0),
                              transport=stack.net.transport())
        assert trio.current_time() - t0 == pytest.approx(1.0)
        await trio.sleep(1.0)  # the router notices the client went away
    [rec] = run.records
    assert rec.terminal_class == "timeout" and rec.scored
    assert rec.status == 200 and rec.output_len == 2 and rec.latency_s == pytest.approx(1.0)
    assert rec.error is not None and "1 s" in rec.error["message"]
    assert stack.records[0]["terminal_class"] == "client_cancelled"  # the router saw the client go


async def test_connect_errors(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        nowhere = "http://nowhere.test:9"
        with pytest.raises(BenchError, match="cannot reach"):
            await run_bench(_constant(1), BenchOptions(url=nowhere), transport=stack.net.transport())
        run = await run_bench(_constant(2), BenchOptions(url=nowhere, model="sim-llama"),
                              transport=stack.net.transport())
    assert [r.terminal_class for r in run.records] == ["connect_error", "connect_error"]
    assert all(r.status is None and r.scored for r in run.records)


async def test_stop_cancels_in_flight_and_unstarted_requests(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        runner = BenchRunner(_constant(10, output=20), BenchOptions(url=URL, warmup=1), transport=stack.net.transport())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_later, runner)
            run = await runner.run()
        await trio.sleep(1.0)  # the router notices the client went away
    assert run.interrupted
    classes = [r.terminal_class for r in run.records]
    assert classes[:3] == ["ok", "ok", "ok"]
    assert classes[3:] == ["client_cancelled"] * 7
    assert run.records[3].actual_s is not None and run.records[4].actual_s is None
    assert run.records[4].error == {"message": "never started: the bench was stopped", "type": None, "code": None}
    summary = _summary(run.records, SLO())
    # Warmup and client_cancelled are not scored; the summary says so.
    assert summary["counts"]["scored"] == 2
    assert summary["counts"]["unscored"] == {"client_cancelled": 7, "warmup": 1}
    assert [r["terminal_class"] for r in stack.records] == ["ok", "ok", "ok", "client_cancelled"]


async def _stop_later(runner: BenchRunner) -> None:
    # Requests start every 100 ms and take 0.120 s: at 0.35 s three have ended, one runs.
    await trio.sleep(0.35)
    runner.stop()


@pytest.mark.parametrize(
    ("client", "router", "agree"),
    [
        ("refused", "refused", True),  # no capacity (under the SLO, or the concurrency cap)
        ("refused", "no_engine", True),  # no engine of a role in placement: a 503 alike
        ("refused", "decode_failed", False),
        ("http_502", "no_engine", False),
        ("ok", "no_engine", False),
        ("refused", "ok", False),
        ("http_504", "first_token_timeout", True),  # both failed: the names differ by design
    ],
)
def test_the_join_reads_both_router_refusals_as_the_clients_503(client: str, router: str, agree: bool) -> None:
    rec = RequestResult(index=0, request_id="r", route="completions", terminal_class=client)
    assert join_row(rec, {"request_id": "r", "terminal_class": router})["classes_agree"] is agree
