"""Readmission probes one by one (``probe_engine``): what each sends and what it concludes.

The probe matrix (tests/test_fault_matrix.py) meets every scripted fault during a probe;
these pin down the probe's requests, the lifecycle check and the verdict's details.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import FaultSpec
from narwhal.router.probe import PROBE_TOKENS, probe_engine

from .routerkit import Stack, engine, fleet_doc, open_stack

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
    """Wrap the engines' transport: d0 answers decodes with ``tokens`` tokens, then [DONE]."""
    event = (
        'data: {"id":"cmpl-s","object":"text_completion","created":1,"model":"sim-llama","choices":'
        '[{"index":0,"text":"t","logprobs":null,"finish_reason":null,"token_ids":[%d]}]}\n\n'
    )

    class Short(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for i in range(tokens):
                yield (event % i).encode()
            yield b"data: [DONE]\n\n"

    class Wrapped(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.host == "d0.test" and request.method == "POST" and json.loads(await request.aread()).get("stream"):
                return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Short())
            return await self.inner.handle_async_request(request)

    return Wrapped


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
