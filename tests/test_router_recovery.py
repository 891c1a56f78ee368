"""Retries, quarantine, ejection and readmission (issue rule 6)."""

from __future__ import annotations

import pytest
import trio

from narwhal.config import FaultSpec

from .routerkit import engine, fleet_doc, open_stack

BODY = {"prompt": "one two three four", "max_tokens": 4}


def two_by_two(**sections: object) -> dict:
    return fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("p1", 8102, ["prefill"]),
        engine("d0", 8103, ["decode"]),
        engine("d1", 8104, ["decode"]),
        **sections,
    )


async def test_one_attempt_by_default(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(two_by_two()) as stack:
        for name in ("p0", "p1"):
            stack.engine(name).inject(FaultSpec(kind="http_error", on="prefill", status=503, times=1))
        resp = await stack.complete(BODY)
    assert resp.status_code == 502
    assert len(stack.records[0]["attempts"]) == 1


async def test_retry_before_visible_output_with_fresh_ids_and_new_producer(autojump_clock: trio.abc.Clock) -> None:
    doc = two_by_two(recovery={"max_attempts": 3})
    async with open_stack(doc) as stack:
        for name in ("p0", "p1"):
            stack.engine(name).inject(FaultSpec(kind="http_error", on="prefill", status=503, times=1))
        resp = await stack.complete(BODY)
        assert resp.status_code == 200
    [rec] = stack.records
    attempts = rec["attempts"]
    assert [a["outcome"] for a in attempts] == ["prefill_failed", "prefill_failed", "ok"]
    # The second attempt avoided the producer that failed the first.
    assert attempts[0]["producer"] != attempts[1]["producer"]
    ids = {a["prefill_request_id"] for a in attempts} | {a["decode_request_id"] for a in attempts}
    assert len(ids) == 6


async def test_no_retry_after_visible_output(autojump_clock: trio.abc.Clock) -> None:
    doc = two_by_two(recovery={"max_attempts": 3})
    async with open_stack(doc) as stack:
        for name in ("d0", "d1"):
            stack.engine(name).inject(FaultSpec(kind="close_before_done", on="decode", after_tokens=1, times=1))
        status, events = await stack.stream(BODY)
    assert status == 200 and "error" in events[-1]
    assert len(stack.records[0]["attempts"]) == 1


@pytest.mark.parametrize(("upstream", "status"), [(404, 502), (400, 400)])
async def test_no_retry_for_non_transient_engine_errors(
    autojump_clock: trio.abc.Clock, upstream: int, status: int
) -> None:
    # A 400 says the engine rejected the request's content: the client gets it as is.
    doc = two_by_two(recovery={"max_attempts": 3})
    async with open_stack(doc) as stack:
        for name in ("p0", "p1"):
            stack.engine(name).inject(FaultSpec(kind="http_error", on="prefill", status=upstream, times=1))
        resp = await stack.complete(BODY)
    assert resp.status_code == status
    assert len(stack.records[0]["attempts"]) == 1


async def test_no_retry_when_budget_is_spent(autojump_clock: trio.abc.Clock) -> None:
    doc = two_by_two(recovery={"max_attempts": 3, "retry_budget": {"ratio": 0.0, "min_retries_per_s": 0.0}})
    async with open_stack(doc) as stack:
        stack.engine("p0").inject(FaultSpec(kind="http_error", on="prefill", status=503))
        stack.engine("p1").inject(FaultSpec(kind="http_error", on="prefill", status=503))
        resp = await stack.complete(BODY)
    assert resp.status_code == 502
    assert len(stack.records[0]["attempts"]) == 1


async def test_budget_allows_a_bounded_number_of_retries(autojump_clock: trio.abc.Clock) -> None:
    doc = two_by_two(recovery={"max_attempts": 2, "eject_after": 100,
                               "retry_budget": {"ratio": 0.0, "min_retries_per_s": 0.2, "window_s": 10.0}})
    async with open_stack(doc) as stack:
        for name in ("p0", "p1"):
            stack.engine(name).inject(FaultSpec(kind="http_error", on="prefill", status=503))
        for _ in range(4):
            await stack.complete(BODY)
    # min_retries_per_s * window_s = 2 retries in the window, then none.
    assert [len(r["attempts"]) for r in stack.records] == [2, 2, 1, 1]


async def test_no_retry_past_the_deadline(autojump_clock: trio.abc.Clock) -> None:
    doc = two_by_two(
        recovery={"max_attempts": 3},
        engine={"request_timeout_s": 2.0, "first_token_timeout_s": 5.0},
        handoff={"max_age_s": 100.0},
    )
    async with open_stack(doc) as stack:
        for name in ("d0", "d1"):
            stack.engine(name).inject(FaultSpec(kind="delay_headers", on="decode", delay_s=30.0))
        resp = await stack.complete(BODY)
    assert resp.status_code == 504
    assert stack.records[0]["terminal_class"] == "deadline_exceeded"
    assert len(stack.records[0]["attempts"]) == 1


async def test_quarantine_excludes_a_failed_engine_for_a_while(autojump_clock: trio.abc.Clock) -> None:
    doc = two_by_two(recovery={"failure_quarantine_s": 10.0, "eject_after": 100})
    async with open_stack(doc) as stack:
        stack.engine("p0").inject(FaultSpec(kind="http_error", on="prefill", status=500, times=1))
        assert (await stack.complete(BODY)).status_code == 502  # ties go to p0 first
        failed = stack.records[-1]["producer"]
        assert failed == "p0"
        for _ in range(4):
            assert (await stack.complete(BODY)).status_code == 200
            assert stack.records[-1]["producer"] != failed
        await trio.sleep(10.0)
        producers = set()
        for _ in range(4):
            await stack.complete(BODY)
            producers.add(stack.records[-1]["producer"])
    assert failed in producers


async def test_eject_after_n_failures_and_readmit_by_probe(autojump_clock: trio.abc.Clock) -> None:
    doc = two_by_two(recovery={"eject_after": 2, "probe_interval_s": 5.0})
    async with open_stack(doc) as stack:
        breaker = stack.router.state.breaker
        stack.engine("d0").inject(FaultSpec(kind="silence_after", on="decode", after_tokens=1, times=2))
        stack.engine("d1").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=60.0, times=2))
        for _ in range(4):
            await stack.complete(BODY)
        assert breaker.states["d0"].ejected and breaker.states["d1"].ejected
        assert not stack.router.state.ready()
        assert (await stack.complete(BODY)).status_code == 503
        # Faults are spent: the next probes succeed and readmit both.
        await trio.sleep(5.5 + 5.0)
        assert not breaker.states["d0"].ejected and not breaker.states["d1"].ejected
        assert (await stack.complete(BODY)).status_code == 200
    classes = [r["terminal_class"] for r in stack.records]
    assert classes.count("silence_timeout") == 2 and classes.count("first_token_timeout") == 2
    assert classes[4] == "refused"
    events = [t.event for t in breaker.transitions]
    assert events.count("ejected") == 2 and events.count("readmitted") == 2


async def test_crossed_decode_probe_uses_fresh_handoff_from_original_producer(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"]),
        recovery={"eject_after": 1, "probe_interval_s": 5.0},
    )
    async with open_stack(doc) as stack:
        breaker = stack.router.state.breaker
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=2))
        assert (await stack.complete(BODY)).status_code == 502
        assert breaker.states["d0"].ejected
        assert breaker.states["d0"].origin_producer == "p0"
        prefills_before = len([b for b in stack.engine("p0").requests_seen if "prompt" in b])
        await trio.sleep(5.1)  # first probe: the decode fault is still armed once
        assert breaker.states["d0"].ejected
        await trio.sleep(5.1)  # second probe succeeds
        assert not breaker.states["d0"].ejected
        probe_prefills = [b for b in stack.engine("p0").requests_seen if "prompt" in b][prefills_before:]
        probe_decodes = [b for b in stack.engine("d0").requests_seen if "prompt" in b][1:]
    assert len(probe_prefills) == 2
    assert all(b["kv_transfer_params"]["do_remote_decode"] is True for b in probe_prefills)
    # Each probe decode carried a fresh descriptor from p0 (a new remote_request_id each time).
    assert len(probe_decodes) == 2
    remote_ids = [b["kv_transfer_params"]["remote_request_id"] for b in probe_decodes]
    assert len(set(remote_ids)) == 2
    assert all(b["kv_transfer_params"]["remote_host"] == "p0.kv.test" for b in probe_decodes)
    assert [t.event for t in breaker.transitions] == ["ejected", "probe_failed", "readmitted"]


async def test_inconclusive_probe_returns_to_normal_cadence(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"]),
        recovery={"eject_after": 1, "probe_interval_s": 5.0},
    )
    async with open_stack(doc) as stack:
        breaker = stack.router.state.breaker
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=1))
        await stack.complete(BODY)
        assert breaker.states["d0"].ejected
        # The original producer now fails: the probe cannot judge the consumer.
        stack.engine("p0").inject(FaultSpec(kind="http_error", on="prefill", status=500, times=1))
        await trio.sleep(5.1)
        assert breaker.states["d0"].ejected
        assert breaker.transitions[-1].event == "probe_inconclusive"
        assert breaker.states["d0"].next_probe_at > trio.current_time()
        await trio.sleep(5.0)
        assert not breaker.states["d0"].ejected


async def test_engine_contract_gates_readmission(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]),
        engine("d0", 8102, ["decode"], version="0.31.0"),
        recovery={"eject_after": 1, "probe_interval_s": 5.0},
        engine_contract={"version": "0.32.0", "model": "sim-llama"},
    )
    async with open_stack(doc) as stack:
        breaker = stack.router.state.breaker
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=1))
        await stack.complete(BODY)
        await trio.sleep(5.1)
        # The inference probe would pass, but the engine's identity breaks the contract.
        assert breaker.states["d0"].ejected
        assert "version" in (breaker.states["d0"].last_error or "")
