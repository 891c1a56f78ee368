"""Readmission probes one by one (``probe_engine``): what each sends and what it concludes.

The probe matrix (tests/test_fault_matrix.py) meets every scripted fault during a probe;
these pin down the probe's requests, the lifecycle check and the verdict's details.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
import trio

from narwhal.config import FaultSpec
from narwhal.router.placement import Reservation
from narwhal.router.probe import PROBE_TOKENS, probe_engine

from .routerkit import Stack, engine, fleet_doc, open_stack, scripted_decodes

RECOVERY = {"eject_after": 1, "probe_interval_s": 1000.0}


def pair(**sections: Any) -> dict[str, Any]:
    return fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), recovery=RECOVERY, **sections
    )


def generation(stack: Stack, name: str) -> list[dict[str, Any]]:
    return [b for b in stack.engine(name).requests_seen if "prompt" in b]


async def test_a_producer_probe_is_a_one_token_prefill_with_a_descriptor(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(pair()) as stack:
        state = stack.router.state
        state.breaker.record_failure("p0", "down", leg="prefill")
        assert await probe_engine(state, "p0") is True
        [body] = generation(stack, "p0")
        assert generation(stack, "d0") == []
    assert body["prompt"].startswith("narwhal readmission probe ")
    assert body["max_tokens"] == 1 and body["temperature"] == 0 and body["model"] == "sim-llama"
    assert body["stream"] is False and "ignore_eos" in body  # the prefill leg's own
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    # Every probe has a prompt of its own (no prefix-cache hit can hide a fault).
    async with open_stack(pair()) as stack:
        state = stack.router.state
        for _ in range(2):
            state.breaker.record_failure("p0", "down", leg="prefill")
            assert await probe_engine(state, "p0") is True
        prompts = [b["prompt"] for b in generation(stack, "p0")]
    assert len(set(prompts)) == 2


async def test_a_consumer_probe_streams_every_token_through_a_fresh_handoff(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(pair()) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        assert await probe_engine(state, "d0") is True
        [prefill] = generation(stack, "p0")
        [decode] = generation(stack, "d0")
        assert stack.engine("d0").stats.generated_tokens == PROBE_TOKENS
    assert decode["max_tokens"] == PROBE_TOKENS and decode["ignore_eos"] is True
    assert decode["temperature"] == 0 and decode["stream"] is True
    assert decode["prompt"] == prefill["prompt"]
    assert decode["kv_transfer_params"]["remote_host"] == "p0.kv.test"


def _short_decodes(tokens: int) -> Any:
    """d0 answers decodes with ``tokens`` tokens, then [DONE]."""
    event = (
        'data: {"id":"cmpl-s","object":"text_completion","created":1,"model":"sim-llama","choices":'
        '[{"index":0,"text":"t","logprobs":null,"finish_reason":null,"token_ids":[%d]}]}\n\n'
    )
    return scripted_decodes([*[(0.0, (event % i).encode()) for i in range(tokens)], (0.0, b"data: [DONE]\n\n")])


@pytest.mark.parametrize(("tokens", "verdict"), [(PROBE_TOKENS - 1, False), (PROBE_TOKENS, True)])
async def test_a_consumer_probe_needs_every_token(autojump_clock: trio.abc.Clock, tokens: int, verdict: bool) -> None:
    async with open_stack(pair(), wrap=_short_decodes(tokens)) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        assert await probe_engine(state, "d0") is verdict
        st = state.breaker.states["d0"]
        if not verdict:
            assert st.ejected and st.probes == 1
            assert st.last_error == f"probe stream ended after {tokens} of {PROBE_TOKENS} tokens"


async def test_a_silent_consumer_fails_its_probe_by_the_read_timeout(autojump_clock: trio.abc.Clock) -> None:
    doc = pair(engine={"decode_read_timeout_s": 3.0})
    async with open_stack(doc) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        stack.engine("d0").inject(FaultSpec(kind="silence_after", on="decode", after_tokens=2, times=1))
        t0 = trio.current_time()
        assert await probe_engine(state, "d0") is False
        elapsed = trio.current_time() - t0
        assert "probe decode timed out" in (state.breaker.states["d0"].last_error or "")
    # The prefill, two tokens, then the read timeout (not the first-token one).
    assert 3.0 < elapsed < 3.5


async def test_a_zero_read_timeout_bounds_probe_silence_by_the_first_token_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    doc = pair(engine={"decode_read_timeout_s": 0.0, "first_token_timeout_s": 7.0})
    async with open_stack(doc) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        stack.engine("d0").inject(FaultSpec(kind="silence_after", on="decode", after_tokens=2, times=1))
        t0 = trio.current_time()
        assert await probe_engine(state, "d0") is False
        assert 7.0 < trio.current_time() - t0 < 7.5


@pytest.mark.parametrize(
    ("contract", "engine_sim", "expected"),
    [
        ({"version": "0.32.0"}, {"version": "0.31.0"}, "engine contract mismatch: version '0.31.0' != '0.32.0'"),
        ({"model": "sim-llama"}, {"model": "other"}, "engine contract mismatch: model 'other' != 'sim-llama'"),
        ({"max_model_len": 4096}, {"max_model_len": 2048}, "engine contract mismatch: max_model_len 2048 != 4096"),
        ({"connector": "OtherConnector"}, {}, "engine contract mismatch: connector 'NixlConnector' != 'OtherConnector'"),
        ({"version": "0.32.0", "model": "sim-llama", "max_model_len": 4096}, {}, None),
    ],
    ids=["version", "model", "max_model_len", "connector", "matches"],
)
async def test_the_engine_contract_gates_readmission(
    autojump_clock: trio.abc.Clock, contract: dict[str, Any], engine_sim: dict[str, Any], expected: str | None
) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"], **engine_sim),
        recovery=RECOVERY, engine_contract=contract,
    )
    async with open_stack(doc) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        verdict = await probe_engine(state, "d0")
        st = state.breaker.states["d0"]
        if expected is None:
            assert verdict is True and not st.ejected
        else:
            assert verdict is False and st.last_error == expected
            # The lifecycle check fails before any inference.
            assert generation(stack, "d0") == [] and generation(stack, "p0") == []


async def test_without_a_contract_the_health_check_gates_readmission(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(pair()) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        client = state.clients["d0"]

        async def unhealthy() -> bool:
            return False

        client.health = unhealthy  # type: ignore[method-assign]
        assert await probe_engine(state, "d0") is False
        assert state.breaker.states["d0"].last_error == "health check failed"
        assert generation(stack, "d0") == []


async def test_a_producer_probe_rejects_a_bad_descriptor(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(pair()) as stack:
        state = stack.router.state
        state.breaker.record_failure("p0", "down", leg="prefill")
        stack.engine("p0").inject(FaultSpec(kind="malformed_descriptor", variant="wrong_endpoint", times=1))
        assert await probe_engine(state, "p0") is False
        assert "endpoint mismatch" in (state.breaker.states["p0"].last_error or "")


async def test_a_producer_without_a_connector_is_probed_without_a_transfer(autojump_clock: trio.abc.Clock) -> None:
    both = {**engine("both", 8101, ["prefill", "decode"]), "connector": None}
    async with open_stack(fleet_doc(both, recovery=RECOVERY)) as stack:
        state = stack.router.state
        state.breaker.record_failure("both", "down", leg="prefill")
        assert await probe_engine(state, "both") is True
        [body] = generation(stack, "both")
    assert body["max_tokens"] == 1 and "kv_transfer_params" not in body


async def test_a_readmitted_engine_is_priced_only_if_its_profile_binds(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(pair(), priced=True) as stack:
        state = stack.router.state
        placement = state.placement
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        stack.engine("d0").trigger_restart()  # a new generation: the profile no longer binds
        await trio.sleep(1.0)
        assert await probe_engine(state, "d0") is True
        assert "d0" in placement.unbound  # type: ignore[attr-defined]


# ------------------------------------------------------------------ what each probe names
# (Pinned so that a changed request id, prompt, bound or verdict detail fails a test; see
# tools/mutation.py.)


def _token(i: int) -> bytes:
    choice = {"index": 0, "text": "t", "logprobs": None, "finish_reason": None, "token_ids": [i]}
    event = {"id": "cmpl-s", "object": "text_completion", "created": 1, "model": "sim-llama", "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


_META = b'data: {"id":"cmpl-s","object":"text_completion","created":1,"model":"sim-llama","choices":[]}\n\n'
_DONE = b"data: [DONE]\n\n"
_TIMED_OUT = "probe decode timed out (engine.first_token_timeout_s, then engine.decode_read_timeout_s)"


async def test_probe_requests_carry_probe_ids_and_prompts(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(pair()) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        assert await probe_engine(state, "d0") is True
        state.breaker.record_failure("p0", "down", leg="prefill")
        assert await probe_engine(state, "p0") is True
        p0_ids = stack.engine("p0").request_ids_seen
        d0_ids = stack.engine("d0").request_ids_seen
        prompts = [b["prompt"] for b in generation(stack, "p0")]
    assert len(p0_ids) == 2 and all(re.fullmatch(r"probe-[0-9a-f]{12}-p", i) for i in p0_ids)
    assert len(d0_ids) == 1 and re.fullmatch(r"probe-[0-9a-f]{12}-d", d0_ids[0])
    assert all(re.fullmatch(r"narwhal readmission probe [0-9a-f]{16}", p) for p in prompts)


async def test_a_consumer_probe_through_a_bad_handoff_is_inconclusive(autojump_clock: trio.abc.Clock) -> None:
    # The producer's descriptor names another KV endpoint: no verdict on the consumer.
    async with open_stack(pair()) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        stack.engine("p0").inject(FaultSpec(kind="malformed_descriptor", variant="wrong_endpoint", times=1))
        assert await probe_engine(state, "d0") is None
        last = state.breaker.transitions[-1]
        assert generation(stack, "d0") == []
        st = state.breaker.states["d0"]
        assert st.ejected and st.probes == 1 and st.last_error == "down"
    assert (last.engine, last.event) == ("d0", "probe_inconclusive")
    assert (last.detail or "").startswith(
        "producer p0 failed the probe handoff: invalid KV handoff descriptor: endpoint mismatch: descriptor names "
    )


async def test_a_crossed_decode_probe_replays_its_own_producer(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("p1", 8103, ["prefill"]), engine("d0", 8102, ["decode"]),
        recovery=RECOVERY,
    )  # fmt: skip
    async with open_stack(doc) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p1", leg="decode")
        assert await probe_engine(state, "d0") is True
        assert generation(stack, "p0") == [] and len(generation(stack, "p1")) == 1


async def test_a_decode_only_probe_takes_the_least_loaded_producer(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("p1", 8103, ["prefill"]), engine("d0", 8102, ["decode"]),
        engine("d1", 8104, ["decode"]), recovery=RECOVERY,
    )  # fmt: skip
    async with open_stack(doc) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", leg="decode")  # no producer to replay
        with Reservation(state.placement, "p0", "d1", 1000, 1000):
            assert await probe_engine(state, "d0") is True
        assert generation(stack, "p0") == [] and len(generation(stack, "p1")) == 1
        # With every producer out of placement (down at start: never held) the probe
        # cannot decide.
        for p in ("p0", "p1"):
            state.breaker.eject(p, "down at start")
        state.breaker.record_failure("d0", "down", leg="decode")
        assert await probe_engine(state, "d0") is None
        last = state.breaker.transitions[-1]
    assert (last.engine, last.event, last.detail) == ("d0", "probe_inconclusive", "no producer in placement for the probe handoff")


async def test_a_stalled_prefill_probe_fails_by_the_first_token_timeout(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(pair(engine={"first_token_timeout_s": 5.0})) as stack:
        state = stack.router.state
        state.breaker.record_failure("p0", "down", leg="prefill")
        stack.engine("p0").inject(FaultSpec(kind="delay_headers", on="prefill", delay_s=60.0, times=1))
        t0 = trio.current_time()
        assert await probe_engine(state, "p0") is False
        assert trio.current_time() - t0 == pytest.approx(5.0, abs=0.1)
        assert state.breaker.states["p0"].last_error == "probe timed out (engine.first_token_timeout_s)"


@pytest.mark.parametrize(
    ("script", "verdict"),
    [
        # Before the first token only the first-token bound runs, metadata or not.
        ([(0.0, _META), (5.0, _token(1)), *[(0.0, _token(i)) for i in range(2, 5)], (0.0, _DONE)], True),
        # After it, the silence bound: 5 s between the first two tokens is too long...
        ([(0.0, _token(1)), (5.0, _token(2)), *[(0.0, _token(i)) for i in range(3, 5)], (0.0, _DONE)], False),
        # ...but it runs between chunks, not over the whole stream.
        ([*[(2.0, _token(i)) for i in range(1, 5)], (2.0, _DONE)], True),
    ],
    ids=["meta-then-late-token", "silence-after-first-token", "steady-slow-stream"],
)
async def test_probe_decode_bounds(
    autojump_clock: trio.abc.Clock, script: list[tuple[float, bytes]], verdict: bool
) -> None:
    doc = pair(engine={"decode_read_timeout_s": 3.0, "first_token_timeout_s": 20.0})
    async with open_stack(doc, wrap=scripted_decodes(script, hang=True)) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        assert await probe_engine(state, "d0") is verdict
        if not verdict:
            assert state.breaker.states["d0"].last_error == _TIMED_OUT


async def test_a_sub_second_read_timeout_bounds_probe_silence(autojump_clock: trio.abc.Clock) -> None:
    doc = pair(engine={"decode_read_timeout_s": 0.5, "first_token_timeout_s": 20.0})
    async with open_stack(doc, wrap=scripted_decodes([(0.0, _token(1)), (0.0, _token(2))], hang=True)) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        t0 = trio.current_time()
        assert await probe_engine(state, "d0") is False
        assert trio.current_time() - t0 < 1.0
        assert state.breaker.states["d0"].last_error == _TIMED_OUT


async def test_contract_mismatches_are_all_named(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"], version="0.31.0", model="other"),
        recovery=RECOVERY, engine_contract={"version": "0.32.0", "model": "sim-llama"},
    )  # fmt: skip
    async with open_stack(doc) as stack:
        state = stack.router.state
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        assert await probe_engine(state, "d0") is False
        assert state.breaker.states["d0"].last_error == (
            "engine contract mismatch: version '0.31.0' != '0.32.0'; model 'other' != 'sim-llama'"
        )


async def test_a_contract_connector_needs_the_engine_to_have_one(autojump_clock: trio.abc.Clock) -> None:
    both = {**engine("both", 8101, ["prefill", "decode"]), "connector": None}
    doc = fleet_doc(both, recovery=RECOVERY, engine_contract={"connector": "NixlConnector"})
    async with open_stack(doc) as stack:
        state = stack.router.state
        state.breaker.record_failure("both", "down", leg="prefill")
        assert await probe_engine(state, "both") is False
        assert state.breaker.states["both"].last_error == "engine contract mismatch: connector None != 'NixlConnector'"


async def test_readmission_rebinds_only_the_readmitted_engines_profile(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(pair(), priced=True) as stack:
        state = stack.router.state
        placement = state.placement
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        stack.engine("p0").trigger_restart()  # p0's new generation is not the probe's business
        await trio.sleep(1.0)
        assert await probe_engine(state, "d0") is True
        assert "p0" not in placement.unbound  # type: ignore[attr-defined]
        assert "d0" not in placement.unbound  # type: ignore[attr-defined]


async def test_every_probe_verdict_is_logged(autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router.probe")
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
        recovery={**RECOVERY, "probe_interval_s": 5.0},
    )  # fmt: skip
    async with open_stack(doc) as stack:
        state = stack.router.state
        # The first probe's handoff fails (inconclusive), the second's decode (failed).
        stack.engine("p0").inject(FaultSpec(kind="http_error", on="prefill", status=500, times=1))
        stack.engine("d0").inject(FaultSpec(kind="http_error", on="decode", status=500, times=1))
        state.breaker.record_failure("d0", "down", origin_producer="p0", leg="decode")
        await trio.sleep(3 * 5.0 + 1.0)  # three probes, one every probe_interval_s
        assert not state.breaker.states["d0"].ejected
    lines = [r.getMessage() for r in caplog.records if r.name == "narwhal.router.probe"]
    assert lines == [
        "readmission probe of d0: inconclusive",
        "readmission probe of d0: failed",
        "readmission probe of d0: ok",
    ]


@pytest.mark.parametrize(
    ("model", "learned", "default", "expected"),
    [("served", "other", "dflt", "served"), (None, "learned", "dflt", "learned"), (None, None, "dflt", "dflt"), (None, None, None, None)],
)
def test_a_probe_names_the_engines_model(model: str | None, learned: str | None, default: str | None, expected: str | None) -> None:
    # The engine's configured model, else the one learned from its /v1/models, else the
    # fleet's default; none at all: the engine's only model (no "model" field).
    from types import SimpleNamespace

    from narwhal.router.probe import _probe_body

    placement = SimpleNamespace(models={"e": frozenset({learned})} if learned else {})
    state: Any = SimpleNamespace(engines={"e": SimpleNamespace(model=model)}, default_model=default, placement=placement)
    for decode in (True, False):
        body = _probe_body(state, "e", decode=decode)
        assert body.get("model") == expected
        assert body["max_tokens"] == (PROBE_TOKENS if decode else 1) and body["temperature"] == 0
        assert body.get("ignore_eos") is (True if decode else None)
