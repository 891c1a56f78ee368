"""Faults with real engines: a descriptor for the wrong producer, a dead producer, a
consumer killed in the middle of a stream.

These run last (``conftest.py`` orders them) and each starts its own router, so its
journal holds only its own requests. Engines killed here are restarted: the producer
at once (the next test needs it), the consumer at the end of the session.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.engines.connector import ENDPOINT_MISMATCH, validate_descriptor
from narwhal.errors import InvalidDescriptor

from .kit import (
    HTTP_TIMEOUT,
    MODEL,
    RealPair,
    RouterProcess,
    Streamed,
    free_port,
    new_request_id,
    stream,
    unique_prompt,
)

pytestmark = pytest.mark.real_engine


def _engine(fleet: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in fleet["engines"] if e["name"] == name)


@contextmanager
def _own_router(fleet: dict[str, Any], workdir: Path) -> Iterator[RouterProcess]:
    proc = RouterProcess(fleet, workdir)
    proc.start()
    try:
        yield proc
    finally:
        status = proc.stop()
    assert status == 0, proc.log()[-3000:]


@pytest.fixture
def own_router(pair: RealPair, tmp_path: Path) -> Iterator[RouterProcess]:
    with _own_router(pair.fleet, tmp_path / "router") as proc:
        yield proc


def test_real_descriptor_validates_only_against_its_own_endpoint(pair: RealPair) -> None:
    """The descriptor the producer really sent at startup, checked against the fleet."""
    if not pair.managed:
        pytest.skip("no descriptor recorded for a pair named by NARWHAL_VLLM_FLEET")
    desc = pair.state["descriptor"]
    connector = _engine(pair.fleet, "producer")["connector"]
    ok = validate_descriptor(
        desc,
        connector="NixlConnector",
        expected_endpoint=(connector["kv_host"], connector["kv_port"]),
    )
    assert ok == desc  # every field kept, the ones narwhal does not know included
    assert {"tp_size", "remote_num_tokens", "transfer_mode"} <= ok.keys()
    for host, port in [(connector["kv_host"], free_port()), ("10.255.255.1", connector["kv_port"])]:
        with pytest.raises(InvalidDescriptor) as info:
            validate_descriptor(desc, connector="NixlConnector", expected_endpoint=(host, port))
        assert info.value.reason.startswith(ENDPOINT_MISMATCH)


def test_descriptor_naming_another_endpoint_never_reaches_the_consumer(
    pair: RealPair, tmp_path: Path
) -> None:
    """The fleet says the producer's KV lives elsewhere: the real descriptor must be refused."""
    fleet = copy.deepcopy(pair.fleet)
    _engine(fleet, "producer")["connector"]["kv_port"] = free_port()  # nothing listens there
    before = pair.metrics("consumer")
    with _own_router(fleet, tmp_path / "router") as proc:
        rid = new_request_id("wrongkv")
        with httpx.Client(base_url=proc.url, timeout=HTTP_TIMEOUT) as client:
            out = stream(
                client,
                "/v1/completions",
                {"model": MODEL, "prompt": unique_prompt(40), "max_tokens": 8},
                request_id=rid,
            )
        assert out.status == 502, out.events
        assert "error" in out.events[0]
        record = proc.record(rid)
        assert record["terminal_class"] == "invalid_descriptor", record
        assert ENDPOINT_MISMATCH in record["error"]
        assert record["output_len"] == 0
    after = pair.metrics("consumer")
    assert after.completion_posts == before.completion_posts
    assert after.total("vllm:prompt_tokens_total") == before.total("vllm:prompt_tokens_total")
    assert after.total("vllm:nixl_num_failed_transfers_total") == before.total(
        "vllm:nixl_num_failed_transfers_total"
    )


def test_dead_producer_fails_the_request_and_the_consumer_sees_nothing(
    managed_pair: RealPair, own_router: RouterProcess
) -> None:
    pair = managed_pair
    body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=own_router.url, timeout=HTTP_TIMEOUT) as client:
        for _ in range(2):  # warm-up: a machine-wide stall of the CPU engines gets one more try
            warm = stream(client, "/v1/completions", {**body, "prompt": unique_prompt(20)})
            if warm.done:
                break
            print(f"warm-up request did not complete ({warm.events[-1:]}); once more")
        assert warm.done, warm.events
        generation = pair.metrics("producer").total("process_start_time_seconds")
        before = pair.metrics("consumer")
        pair.kill("producer")
        try:
            rid = new_request_id("deadp")
            out = stream(
                client, "/v1/completions", {**body, "prompt": unique_prompt(20)}, request_id=rid
            )
            assert out.status in (502, 503), out.events
            assert "error" in out.events[0]
            record = own_router.record(rid)
            assert record["terminal_class"] in ("prefill_failed", "no_engine"), record
            after = pair.metrics("consumer")
            assert after.completion_posts == before.completion_posts
            assert after.total("vllm:prompt_tokens_total") == before.total(
                "vllm:prompt_tokens_total"
            )
        finally:
            pair.restart("producer")
        # A new generation of the producer, and the same router serves through it again.
        assert pair.metrics("producer").total("process_start_time_seconds") > generation
        for _ in range(3):
            again = stream(client, "/v1/completions", {**body, "prompt": unique_prompt(20)})
            if again.done:
                break
            # The consumer's first NIXL handshake with a producer that just came up on a
            # loaded box can time out in vLLM itself (zmq "Resource temporarily
            # unavailable"); the router reports it and the next request goes through.
            print(f"request after the restart failed ({again.events[-1:]}); once more")
            time.sleep(2)
        assert again.done and len(again.token_ids) == 4, again.events


def test_consumer_killed_mid_stream_ends_with_an_error_event(
    managed_pair: RealPair, own_router: RouterProcess
) -> None:
    pair = managed_pair
    rid = new_request_id("deadc")
    max_tokens = 1500
    killed_after: list[int] = []

    def kill_after_some_tokens(out: Streamed) -> None:
        if not killed_after and len(out.token_ids) >= 10:
            killed_after.append(len(out.token_ids))
            pair.kill_now("consumer")

    body = {
        "model": MODEL,
        "prompt": unique_prompt(20),
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=own_router.url, timeout=HTTP_TIMEOUT) as client:
        out = stream(
            client, "/v1/completions", body, request_id=rid, on_event=kill_after_some_tokens
        )
    assert killed_after, "the stream ended before the consumer could be killed"
    assert out.status == 200
    assert not out.done, "a stream cut by a dead consumer must not end with [DONE]"
    last = out.events[-1]
    assert isinstance(last, dict) and set(last) == {"error"}, out.events[-3:]
    assert last["error"]["message"]
    delivered = len(out.token_ids)
    assert killed_after[0] <= delivered < max_tokens
    record = own_router.record(rid)
    assert record["status"] == 200  # committed before the failure
    assert record["terminal_class"] == "decode_failed", record
    assert record["consumer"] == "consumer"
    assert record["output_len"] == delivered
    assert record["error"]
