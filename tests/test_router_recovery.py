"""Retries, quarantine, ejection and readmission (issue rule 6)."""

from __future__ import annotations

import pytest
import trio

from narwhal.config import EngineTimeouts, FaultSpec, RecoveryConfig
from narwhal.router.breaker import BreakerState
from narwhal.router.probe import PROBE_TOKENS, probe_engine

from .routerkit import Stack, engine, fleet_doc, open_stack

BODY = {"prompt": "one two three four", "max_tokens": 4}
FIRST_TOKEN_S = EngineTimeouts().first_token_timeout_s
SILENCE_S = EngineTimeouts().decode_read_timeout_s


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
        for _ in range(4):  # ties alternate: d0, d1, d0, d1
            await stack.complete(BODY)
        assert breaker.states["d0"].ejected and not breaker.states["d1"].ejected
        assert breaker.status("d0") == "ejected"
        # Out of placement: every request goes to d1 until a probe succeeds.
        for _ in range(3):
            assert (await stack.complete(BODY)).status_code == 200
            assert stack.records[-1]["consumer"] == "d1"
        # The fault is spent: the next probe succeeds and readmits d0 (half-open).
        await trio.sleep(5.0)
        assert not breaker.states["d0"].ejected and breaker.status("d0") == "trial"
    classes = [r["terminal_class"] for r in stack.records]
    assert classes == ["silence_timeout", "ok", "silence_timeout", "ok", "ok", "ok", "ok"]
    assert [(t.engine, t.event) for t in breaker.transitions] == [("d0", "ejected"), ("d0", "readmitted")]


def two_decoders(**recovery: object) -> dict:
    return fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]),
        recovery={"eject_after": 1, "probe_interval_s": 5.0, **recovery},
    )


def decodes(stack: Stack, name: str) -> int:
    """Decode requests engine ``name`` has seen (live and probes)."""
    return len([b for b in stack.engine(name).requests_seen if "prompt" in b and "kv_transfer_params" in b])


async def test_the_last_consumer_hanging_is_ejected_and_then_refused_at_once(autojump_clock: trio.abc.Clock) -> None:
    # Seed 001: after recovery.eject_after consecutive stream failures the engine leaves
    # placement until an inference probe succeeds, even the last of its role. A hanging
    # consumer costs eject_after clients the first-token timeout, not every client.
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]))  # the shipped recovery
    eject_after, interval = RecoveryConfig().eject_after, RecoveryConfig().probe_interval_s
    async with open_stack(doc) as stack:
        state = stack.router.state
        breaker = state.breaker
        # d0 hangs before its first token: eject_after live requests, then the first probe.
        stack.engine("d0").inject(FaultSpec(kind="delay_headers", on="decode", delay_s=10 * FIRST_TOKEN_S,
                                            times=eject_after + 1))  # fmt: skip
        for _ in range(eject_after):
            t0 = trio.current_time()
            assert (await stack.complete(BODY)).status_code == 504
            assert trio.current_time() - t0 == pytest.approx(FIRST_TOKEN_S, abs=0.1)
        ejected_at = trio.current_time()
        assert breaker.status("d0") == "ejected"
        assert [(t.engine, t.event) for t in breaker.transitions] == [("d0", "ejected")]
        seen = decodes(stack, "d0")

        # Out of placement: requests are refused at once, no first-token timeout paid,
        # told to come back when the probe is due.
        async def refused(retry_after: str) -> None:
            t0 = trio.current_time()
            resp = await stack.complete(BODY)
            assert trio.current_time() == t0
            assert resp.status_code == 503 and resp.headers["retry-after"] == retry_after
            assert resp.json() == {"error": {"message": "no engine available for decode",
                                             "type": "service_unavailable", "code": None}}  # fmt: skip
            record = stack.records[-1]
            assert (record["terminal_class"], record["status"]) == ("no_engine", 503)
            assert record["error"] == "no engine available for decode" and record["consumer"] is None
            assert [a["outcome"] for a in record["attempts"]] == ["no_engine"]

        async with trio.open_nursery() as nursery:  # a burst: none of them waits
            for _ in range(8):
                nursery.start_soon(refused, f"{interval:g}")
        assert trio.current_time() == ejected_at
        health = await stack.client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable", "reason": "no engine can decode now",
                                 "engines": {"p0": "ok", "d0": "ejected"}}  # fmt: skip
        await trio.sleep(interval - 1.5)
        await refused("2")  # 1.5 s to the probe, in whole seconds rounded up
        # The probe runs (and hangs: d0 is not back yet): the cadence, until its verdict.
        await trio.sleep(1.5 + 1.0)
        await refused(f"{interval:g}")
        probed = trio.Event()
        breaker.add_listener(lambda t: probed.set() if t.event == "probe_failed" else None)
        await probed.wait()
        failed_at = trio.current_time()
        assert failed_at == pytest.approx(ejected_at + interval + FIRST_TOKEN_S, abs=0.1)
        await trio.sleep(1.5)
        await refused(f"{interval - 1.0:g}")  # 3.5 s to the next probe
        assert decodes(stack, "d0") == seen + 1  # the probe's; no client request reached it
        # d0 is back: the next probe readmits it, and requests are served there again.
        await trio.sleep(interval)
        assert [(t.engine, t.event) for t in breaker.transitions] == [
            ("d0", "ejected"), ("d0", "probe_failed"), ("d0", "readmitted")
        ]
        assert state.ready()
        t0 = trio.current_time()
        assert (await stack.complete(BODY)).status_code == 200
        assert trio.current_time() - t0 < 1.0
        assert stack.records[-1]["consumer"] == "d0" and breaker.status("d0") == "ok"
    classes = [r["terminal_class"] for r in stack.records]
    assert classes == ["first_token_timeout"] * eject_after + ["no_engine"] * 11 + ["ok"]


async def test_whole_wave_the_probes_bring_the_role_back(autojump_clock: trio.abc.Clock) -> None:
    # Every decode engine fails at once (a whole-wave restart, a shared dependency down):
    # the role is empty until a probe readmits one of them.
    async with open_stack(two_decoders()) as stack:
        state = stack.router.state
        breaker = state.breaker
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=503, times=1))
        stack.engine("d1").inject(FaultSpec(kind="http_error", on="decode", status=503))
        start = trio.current_time()
        assert (await stack.complete(BODY)).status_code == 502  # d0: ejected
        await trio.sleep(2.0)
        assert (await stack.complete(BODY)).status_code == 502  # d1, the last one: ejected too
        assert breaker.status("d0") == breaker.status("d1") == "ejected"
        assert [(t.engine, t.event) for t in breaker.transitions] == [("d0", "ejected"), ("d1", "ejected")]
        assert not state.ready()
        resp = await stack.complete(BODY)
        # d0's probe is due first (3 s from now).
        assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
        assert stack.records[-1]["terminal_class"] == "no_engine"
        # d0's probe readmits it (its fault is spent); d1, still failing, stays out.
        await trio.sleep(start + 5.5 - trio.current_time())
        assert breaker.status("d0") == "trial" and breaker.status("d1") == "ejected"
        assert state.ready()
        for _ in range(3):
            assert (await stack.complete(BODY)).status_code == 200
            assert stack.records[-1]["consumer"] == "d0"
        assert breaker.status("d1") == "ejected"
    assert [r["terminal_class"] for r in stack.records] == ["decode_failed"] * 2 + ["no_engine"] + ["ok"] * 3


async def test_no_producer_left_refuses_the_prompt_count_too(autojump_clock: trio.abc.Clock) -> None:
    # With exact prompt counts the producer's /tokenize comes first: it is refused alike.
    doc = fleet_doc(engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
                    controller={"prompt_tokens": "tokenize"}, recovery={"eject_after": 1, "probe_interval_s": 5.0})  # fmt: skip
    async with open_stack(doc) as stack:
        breaker = stack.router.state.breaker
        stack.engine("p0").inject(FaultSpec(kind="http_error", on="prefill", status=500, times=1))
        assert (await stack.complete(BODY)).status_code == 502
        assert breaker.status("p0") == "ejected"
        seen = len(stack.engine("p0").requests_seen)
        await trio.sleep(1.2)
        t0 = trio.current_time()
        resp = await stack.complete(BODY)
        assert trio.current_time() == t0
        assert resp.status_code == 503 and resp.headers["retry-after"] == "4"
        assert resp.json()["error"]["message"] == "no engine available for prefill"
        assert stack.records[-1]["terminal_class"] == "no_engine" and stack.records[-1]["attempts"] == []
        assert len(stack.engine("p0").requests_seen) == seen  # not even a /tokenize
        await trio.sleep(5.0)
        assert breaker.status("p0") == "trial"
        assert (await stack.complete(BODY)).status_code == 200


async def eject_and_readmit(stack: Stack, name: str) -> BreakerState:
    """Fail ``name`` until it is ejected; wait for the probe that readmits it (on trial)."""
    st = stack.router.state.breaker.states[name]
    stack.engine(name).inject(FaultSpec(kind="http_error", on="decode", status=503, times=3))
    while not st.ejected:
        await stack.complete(BODY)
    await trio.sleep(5.5)
    assert st.trial and not st.ejected
    return st


async def test_readmission_is_half_open(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(two_decoders(eject_after=3)) as stack:
        breaker = stack.router.state.breaker
        st = await eject_and_readmit(stack, "d0")
        # On trial: one live request at a time. Two concurrent slow requests: only one
        # goes to d0.
        consumers: list[str] = []

        async def one() -> None:
            await stack.complete({**BODY, "max_tokens": 50})
            consumers.append(stack.records[-1]["consumer"])

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        assert sorted(consumers) == ["d0", "d1", "d1"]
        # That success closed the trial: full weight again.
        assert not st.trial and breaker.status("d0") == "ok"
        assert ("d0", "closed") in [(t.engine, t.event) for t in breaker.transitions]


async def test_a_failure_on_trial_ejects_at_once(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(two_decoders(eject_after=3)) as stack:
        st = await eject_and_readmit(stack, "d0")
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=503, times=1))
        await stack.complete(BODY)
        while stack.records[-1]["consumer"] != "d0":
            await stack.complete(BODY)
        assert stack.records[-1]["terminal_class"] == "decode_failed"
        # One failure, not eject_after (3): the probe's verdict did not hold.
        assert st.ejected and st.streak == 1 and not st.trial


async def test_consumer_probe_streams_a_decode_not_a_prefill(autojump_clock: trio.abc.Clock) -> None:
    # An engine that prefills and decodes, ejected for a decode-stream failure, is probed
    # with a same-worker streaming decode of several tokens: a one-token prefill would
    # readmit an engine whose streams still fail.
    doc = fleet_doc(
        engine("both", 8101, ["prefill", "decode"]), engine("p1", 8102, ["prefill"]),
        engine("d1", 8103, ["decode"]), recovery={"eject_after": 1, "probe_interval_s": 5.0},
    )
    async with open_stack(doc) as stack:
        breaker = stack.router.state.breaker
        both = stack.engine("both")
        both.inject(FaultSpec(kind="silence_after", on="decode", after_tokens=1, times=2))
        await stack.complete(BODY)  # ties go to the first engines: same-worker on "both"
        assert stack.records[-1]["attempts"][0]["same_worker"] is True
        st = breaker.states["both"]
        assert st.ejected and st.failed_leg == "decode" and st.origin_producer is None
        seen = len(both.requests_seen)
        await trio.sleep(5.0 + SILENCE_S + 1)  # the first probe meets the second silence
        assert breaker.transitions[-1].event == "probe_failed"
        await trio.sleep(5.0)
        assert breaker.status("both") == "trial"
        probes = [b for b in both.requests_seen[seen:] if "prompt" in b]
    assert len(probes) == 2
    for body in probes:
        assert body["stream"] is True and body["max_tokens"] == PROBE_TOKENS
        assert "kv_transfer_params" not in body  # same-worker


async def test_decode_only_probe_without_origin_takes_a_handoff_from_a_producer_in_placement(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_stack(two_decoders()) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "a decode failed", leg="decode")
        assert state.breaker.states["d0"].origin_producer is None
        assert await probe_engine(state, "d0") is True
        [prefill] = [b for b in stack.engine("p0").requests_seen if "prompt" in b]
        [decode] = [b for b in stack.engine("d0").requests_seen if "prompt" in b]
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert decode["kv_transfer_params"]["remote_host"] == "p0.kv.test"
    assert decode["max_tokens"] == PROBE_TOKENS and decode["stream"] is True


async def test_decode_only_probe_with_no_producer_in_placement_is_inconclusive(
    autojump_clock: trio.abc.Clock,
) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("p1", 8102, ["prefill"]), engine("d0", 8103, ["decode"]),
        engine("d1", 8104, ["decode"]), recovery={"eject_after": 1, "probe_interval_s": 1000.0},
    )
    async with open_stack(doc) as stack:
        state = stack.router.state
        state.breaker.record_failure("p0", "down", leg="prefill")
        state.breaker.record_failure("d0", "a decode failed", leg="decode")
        assert await probe_engine(state, "d0") is True  # p1 is in placement
        state.breaker.record_failure("p1", "down", leg="prefill")  # the last producer, out too
        state.breaker.record_failure("d0", "a decode failed", leg="decode")
        assert await probe_engine(state, "d0") is None
        assert state.breaker.transitions[-1].event == "probe_inconclusive"


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
