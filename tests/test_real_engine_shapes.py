"""Regressions for shapes a real vLLM (0.32, CPU) answers that narwhal mishandled.

Found by running the router against real engines (tests/real_engine). Each test
reproduces the real engine's answer with ``httpx.MockTransport`` (or wraps the
simulated engines' transport), so it runs in the default suite.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from narwhal.config import parse_fleet
from narwhal.engines.client import EngineClient
from narwhal.router.journal import Journal
from narwhal.router.service import open_router
from narwhal.testing import open_memory_network, open_sim_fleet

from .routerkit import ROUTER_HOST, ROUTER_PORT, engine, fleet_doc

# What vLLM 0.32 answers to POST /tokenize {"prompt": [ids...]}: only a string prompt
# (or chat messages) validates.
_VLLM_TOKENIZE_LIST_ERROR = {
    "error": {
        "message": "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.prompt', "
        "'msg': 'Input should be a valid string', 'input': '<list of 3 items>'}\n  "
        "{'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', "
        "'input': '<dict of 2 items>'}",
        "type": "Bad Request",
        "param": "body.prompt",
        "code": 400,
    }
}


def _is_list_tokenize(request: httpx.Request) -> bool:
    if request.method != "POST" or request.url.path != "/tokenize":
        return False
    return isinstance(json.loads(request.content).get("prompt"), list)


async def test_tokenize_counts_a_token_id_prompt_without_asking_the_engine() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if _is_list_tokenize(request):
            return httpx.Response(400, json=_VLLM_TOKENIZE_LIST_ERROR)
        return httpx.Response(200, json={"count": 2, "max_model_len": 2048, "tokens": [5, 6]})

    async with EngineClient(
        "http://engine.test:8000", transport=httpx.MockTransport(handler)
    ) as client:
        tokenized = await client.tokenize([77, 327, 1372])
        assert (tokenized.count, tokenized.ids, tokenized.max_model_len) == (
            3,
            (77, 327, 1372),
            None,
        )
        assert seen == []
        # A string prompt still goes to the engine.
        assert (await client.tokenize("hi")).count == 2
        assert len(seen) == 1


class _VLLMTokenize(httpx.AsyncBaseTransport):
    """The simulated engines, except that /tokenize refuses a token-id prompt as vLLM does."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.refused = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            await request.aread()
            if _is_list_tokenize(request):
                self.refused += 1
                return httpx.Response(400, json=_VLLM_TOKENIZE_LIST_ERROR)
        return await self.inner.handle_async_request(request)


async def test_router_serves_a_token_id_prompt() -> None:
    doc: dict[str, Any] = fleet_doc(
        engine("p0", 8101, ["prefill"], model="tiny-llama", max_model_len=64),
        engine("d0", 8102, ["decode"], model="tiny-llama", max_model_len=64),
    )
    config = parse_fleet(doc)
    records: list[dict[str, Any]] = []
    journal = Journal(None)
    journal.add_listener(records.append)
    with trio.fail_after(30):
        async with open_memory_network() as net, open_sim_fleet(config, network=net) as fleet:
            transport = _VLLMTokenize(fleet.transport)
            async with open_router(config, transport=transport, journal=journal) as router:
                net.listen(ROUTER_HOST, ROUTER_PORT, router.server)
                async with httpx.AsyncClient(
                    transport=net.transport(), base_url=f"http://{ROUTER_HOST}:{ROUTER_PORT}"
                ) as client:
                    ok = await client.post(
                        "/v1/completions",
                        json={"model": "tiny-llama", "prompt": [7, 8, 9], "max_tokens": 3},
                    )
                    # The context limit still holds, from the engines' /v1/models.
                    too_long = await client.post(
                        "/v1/completions",
                        json={"model": "tiny-llama", "prompt": list(range(60)), "max_tokens": 8},
                    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3
    assert too_long.status_code == 400, too_long.text
    assert "maximum context length" in too_long.json()["error"]["message"]
    assert transport.refused == 0
    assert [r["terminal_class"] for r in records] == ["ok", "invalid_request"]
    assert records[0]["prompt_tokens"] == 3
