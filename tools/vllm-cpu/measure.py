"""Latency through a router in front of the real pair: TTFT and TPOT per prompt length.

A stopgap for docs/real-engines.md until ``narwhal bench`` is wired to the real pair
(issue 7). Run it with narwhal's interpreter against a running ``narwhal serve``::

    python3 tools/vllm-cpu/measure.py --router http://127.0.0.1:8000 \\
        --fleet "$NARWHAL_VLLM_PAIR/fleet.json" [--lengths 100,500,1000,1900] [--repeat 5]

For each prompt length it sends ``--repeat`` rounds of ``--concurrency`` streaming
completions (``max_tokens`` tokens, ``ignore_eos``) with a fresh random prompt each,
and reports client-side medians: TTFT (request sent to first token event) and TPOT
(first to last token over tokens - 1), plus, from the consumer's ``/metrics``, how
many prompt tokens arrived over NIXL and how many it computed itself. Prompts are
built to the length with the producer's ``/tokenize``. Writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from narwhal.engines.metrics import parse_prometheus, sum_samples

MODEL = "tiny-llama"


def prompt_of(client: httpx.Client, producer: str, tokens: int) -> str:
    """A random prompt of exactly ``tokens`` tokens (by the producer's tokenizer)."""
    words = [f"w{secrets.randbelow(1000)}" for _ in range(tokens)]
    text = secrets.token_hex(8) + " " + " ".join(words)
    ids = client.post(f"{producer}/tokenize", json={"model": MODEL, "prompt": text}).json()[
        "tokens"
    ][:tokens]
    return str(
        client.post(f"{producer}/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    )


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    samples = parse_prometheus(client.get(f"{url}/metrics").text)

    def total(name: str, **labels: str) -> float:
        return sum_samples(samples.get(name, ()), **labels) or 0.0

    return {
        "external": total("vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        "local_compute": total("vllm:prompt_tokens_by_source_total", source="local_compute"),
        "transfers": total("vllm:nixl_xfer_time_seconds_count"),
        "xfer_s": total("vllm:nixl_xfer_time_seconds_sum"),
    }


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict[str, Any]:
    # The token ids of each event count its tokens (vLLM sends them when asked).
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    sent = time.perf_counter()
    times: list[float] = []
    prompt_tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            n = sum(len(c.get("token_ids") or ()) for c in event.get("choices") or ())
            if n:
                times.extend([time.perf_counter()] * n)
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
    if not times:
        raise RuntimeError(f"a stream of {max_tokens} tokens carried no token ids")
    return {
        "prompt_tokens": prompt_tokens,
        "tokens": len(times),
        "ttft_s": times[0] - sent,
        "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
    }


async def round_of(router: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    timeout = httpx.Timeout(300.0, connect=10.0)
    async with httpx.AsyncClient(base_url=router, timeout=timeout) as client:

        async def run(prompt: str) -> None:
            results.append(await one(client, prompt, max_tokens))

        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(run, prompt)
    return results


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--router", required=True, help="the router's URL")
    parser.add_argument("--fleet", required=True, type=Path, help="the pair's fleet.json")
    parser.add_argument("--lengths", default="100,500,1000,1900", help="prompt lengths in tokens")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per length")
    parser.add_argument("--concurrency", type=int, default=1, help="streams per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    fleet = json.loads(args.fleet.read_text())
    urls = {e["name"]: e["url"] for e in fleet["engines"]}
    producer = next(e["url"] for e in fleet["engines"] if "prefill" in e["roles"])
    consumer = next(e["url"] for e in fleet["engines"] if "decode" in e["roles"])
    report: dict[str, Any] = {"engines": urls, "concurrency": args.concurrency,
                              "max_tokens": args.max_tokens, "rows": []}  # fmt: skip
    print(f"{'prompt':>6} {'n':>3} {'TTFT p50':>9} {'TTFT max':>9} {'TPOT p50':>9} "
          f"{'external':>9} {'local':>6}")  # fmt: skip
    with httpx.Client(timeout=60) as client:
        for length in (int(x) for x in args.lengths.split(",")):
            before = counters(client, consumer)
            results: list[dict[str, Any]] = []
            for _ in range(args.repeat):
                prompts = [prompt_of(client, producer, length) for _ in range(args.concurrency)]
                results += trio.run(round_of, args.router, prompts, args.max_tokens)
            after = counters(client, consumer)
            delta = {k: after[k] - before[k] for k in before}
            ttfts = [r["ttft_s"] for r in results]
            tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
            actual = int(median([r["prompt_tokens"] for r in results if r["prompt_tokens"]]))
            row = {
                "prompt_tokens": actual,
                "requests": len(results),
                "ttft_p50_s": median(ttfts),
                "ttft_max_s": max(ttfts),
                "tpot_p50_s": median(tpots),
                "consumer_external_tokens": delta["external"],
                "consumer_local_compute_tokens": delta["local_compute"],
                "transfers": delta["transfers"],
                "xfer_mean_s": delta["xfer_s"] / delta["transfers"] if delta["transfers"] else None,
                "results": results,
            }
            report["rows"].append(row)
            print(f"{actual:>6} {len(results):>3} {row['ttft_p50_s'] * 1e3:>7.0f}ms "
                  f"{row['ttft_max_s'] * 1e3:>7.0f}ms {row['tpot_p50_s'] * 1e3:>7.1f}ms "
                  f"{delta['external']:>9.0f} {delta['local_compute']:>6.0f}", flush=True)  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
