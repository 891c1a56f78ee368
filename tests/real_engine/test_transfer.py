"""Proof that the KV cache really moved from the producer to the consumer.

For every request the consumer's ``vllm:prompt_tokens_by_source_total`` must grow by
the whole prompt under ``external_kv_transfer`` and not at all under ``local_compute``
or ``local_cache_hit``, while the producer computed exactly that prompt; the NIXL
counters must show one successful transfer of the prompt's KV blocks. Prompts start
with a random head, so neither engine's prefix cache can serve them: a consumer that
silently recomputed the prompt (what vLLM does with an unusable descriptor) would show
up as ``local_compute``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .kit import (
    HTTP_TIMEOUT,
    MODEL,
    Metrics,
    RealPair,
    RouterProcess,
    new_request_id,
    stream,
    unique_prompt,
    wait_for,
)

pytestmark = pytest.mark.real_engine

_COUNTERS = {
    "external": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "local_compute": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "local_cache_hit": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "transfers": ("vllm:nixl_xfer_time_seconds_count", {}),
    "failed_transfers": ("vllm:nixl_num_failed_transfers_total", {}),
    "bytes": ("vllm:nixl_bytes_transferred_sum", {}),
}


def _counters(m: Metrics) -> dict[str, float]:
    return {key: m.total(name, **labels) for key, (name, labels) in _COUNTERS.items()}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _block_size(m: Metrics) -> int:
    (info,) = m.samples["vllm:cache_config_info"]
    return int(info.label("block_size"))


@pytest.fixture
def client(router: RouterProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.url, timeout=HTTP_TIMEOUT) as c:
        yield c


@pytest.mark.parametrize(
    ("kind", "words"),
    [("completions", 30), ("completions", 160), ("chat", 100), ("completions", 480)],
)
def test_consumer_receives_the_whole_prompt_over_nixl(
    kind: str, words: int, client: httpx.Client, router: RouterProcess, pair: RealPair
) -> None:
    p_before = _counters(pair.metrics("producer"))
    c_metrics = pair.metrics("consumer")
    c_before = _counters(c_metrics)
    rid = new_request_id(f"kv{words}")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": unique_prompt(words)}]
        out = stream(client, "/v1/chat/completions", body, request_id=rid)
    else:
        body["prompt"] = unique_prompt(words)
        out = stream(client, "/v1/completions", body, request_id=rid)
    assert out.done and len(out.token_ids) == 4, out.events[-3:]
    assert out.usage is not None
    prompt = out.usage["prompt_tokens"]

    # Engines publish their counters when a request finishes; give them a moment.
    def settled() -> bool:
        p = _delta(_counters(pair.metrics("producer")), p_before)
        c = _delta(_counters(pair.metrics("consumer")), c_before)
        return p["prompt_tokens"] >= prompt and c["prompt_tokens"] >= prompt and c["transfers"] >= 1

    assert wait_for(settled, timeout=15), "the engines' counters did not move"
    p = _delta(_counters(pair.metrics("producer")), p_before)
    c = _delta(_counters(pair.metrics("consumer")), c_before)
    record = router.record(rid)

    # The producer computed the prompt, all of it, and reported its length.
    assert p["prompt_tokens"] == prompt
    assert p["local_compute"] == prompt
    assert p["external"] == 0
    assert record["prompt_tokens"] == prompt  # the router's /tokenize count agrees
    # The consumer received all of it over NIXL and computed none of it.
    assert c["prompt_tokens"] == prompt
    assert c["external"] == prompt
    assert c["local_compute"] == 0
    assert c["local_cache_hit"] == 0
    assert c["transfers"] == 1
    assert c["failed_transfers"] == 0
    # Whole KV blocks moved: K and V of every layer, float32.
    config = pair.model_config()
    if config is not None:
        block = _block_size(c_metrics)
        per_token = (
            config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
        )
        assert c["bytes"] == math.ceil(prompt / block) * block * per_token
    assert record["terminal_class"] == "ok"
