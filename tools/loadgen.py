"""A minimal closed-loop streaming load generator, run in its own process.

It keeps one keep-alive HTTP/1.1 connection per worker and speaks just enough HTTP
to stream a completion (hand-written request, chunked body scanned for the first
token event, the last one (its ``finish_reason``) and ``data: [DONE]``), so that the
load generator costs far less than what it measures. It prints one JSON object on
stdout: ``{"requests", "errors", "elapsed_s", "ttft_s": [...], "total_s": [...],
"tpot_s": [...]}`` (TPOT: first to last token event over ``max_tokens`` - 1, from
streams whose last event came apart from the first).

``--unique-prompts`` starts every prompt with a random nonce and fills it with random
words (no two prompts share a prefix an engine could have cached); ``--model`` names
the served model. ``--prefill-url`` makes the generator its own router, the direct
handoff a disaggregating client would do: each request's prefill goes to that engine
(``max_tokens: 1``, ``stream: false``, the NixlConnector request block), and its
decode, carrying the producer's descriptor, streams from ``--url``.

    python tools/loadgen.py --url http://127.0.0.1:8000 --concurrency 16 --requests 800
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import sys
import time
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import trio


def _request(host: str, port: int, path: str, body: bytes, extra_headers: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra_headers}\r\n"
    ).encode() + body


#: What marks a stream's last token event (its finish_reason is set), with or without a space.
_FINISHED = (b'"finish_reason":"', b'"finish_reason": "')

#: The prefill's request block for vLLM's NixlConnector (what vLLM's own proxies send).
_PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


class Timing:
    """When one response's first and last token events and its end arrived."""

    __slots__ = ("body", "first", "last", "status", "total")

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.status = 0
        self.total = 0.0
        self.body = b""


def _scan(data: bytes | bytearray, timing: Timing, now: float) -> None:
    if timing.first is None and (b"token_ids" in data or b'"text"' in data):
        timing.first = now
    if timing.last is None and any(mark in data for mark in _FINISHED):
        timing.last = now


async def _read_response(stream: trio.SocketStream, buf: bytearray, t0: float) -> Timing:
    """Read one response (a chunked SSE stream, or a body of ``content-length``);
    raises on protocol errors."""
    timing = Timing()
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("closed before the response head")
        buf += data
    head_end = buf.index(b"\r\n\r\n") + 4
    timing.status = int(bytes(buf[9:12]))
    head = bytes(buf[:head_end]).lower()
    del buf[:head_end]
    if b"content-length:" in head:
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        while len(buf) < length:
            data = await stream.receive_some(65536)
            if not data:
                raise ConnectionError("closed mid-body")
            buf += data
        timing.body = bytes(buf[:length])
        del buf[:length]
        timing.total = time.perf_counter() - t0
        return timing
    # Scan the raw chunked stream: the first and last token events, then the terminating chunk.
    _scan(buf, timing, time.perf_counter())
    while True:
        end = buf.find(b"\r\n0\r\n\r\n")
        if end >= 0 and b"[DONE]" in buf[:end]:
            del buf[: end + 7]
            timing.total = time.perf_counter() - t0
            return timing
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("closed mid-stream")
        _scan(data, timing, time.perf_counter())
        buf += data
        if len(buf) > 1 << 20 and b"[DONE]" not in buf:
            # Keep only the tail: the body is only scanned for its end.
            del buf[: len(buf) - 4096]


class _Conn:
    """One keep-alive connection to ``url``, opened on first use and again after an error."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.stream: trio.SocketStream | None = None
        self.buf = bytearray()

    async def post(self, path: str, body: bytes, t0: float) -> Timing:
        if self.stream is None:
            self.stream = await trio.open_tcp_stream(self.host, self.port)
            self.stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.buf.clear()
        try:
            await self.stream.send_all(_request(self.host, self.port, path, body, ""))
            return await _read_response(self.stream, self.buf, t0)
        except BaseException:
            await self.aclose(forcefully=True)
            raise

    async def aclose(self, *, forcefully: bool = False) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            if forcefully:
                await trio.aclose_forcefully(stream)
            else:
                await stream.aclose()


def unique_prompt(words: int) -> str:
    """A prompt no other shares a prefix with: a random nonce, then ``words`` random words."""
    return secrets.token_hex(8) + " " + " ".join(f"w{secrets.randbelow(100_000)}" for _ in range(words))


async def run(
    url: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    path: str,
    prompt_words: int,
    *,
    model: str = "sim-llama",
    unique: bool = False,
    prefill_url: str | None = None,
) -> dict[str, Any]:
    ttfts: list[float] = []
    totals: list[float] = []
    tpots: list[float] = []
    errors = 0
    remaining = requests
    prompt = " ".join(f"w{i}" for i in range(prompt_words))

    async def worker(wid: int) -> None:
        nonlocal remaining, errors
        conn = _Conn(url)
        prefill = _Conn(prefill_url) if prefill_url is not None else None
        n = 0
        while remaining > 0:
            remaining -= 1
            n += 1
            request: dict[str, Any] = {
                "model": model, "prompt": unique_prompt(prompt_words) if unique else f"{prompt} {wid} {n}",
                "max_tokens": max_tokens, "stream": True, "return_token_ids": True, "ignore_eos": True,
            }  # fmt: skip
            try:
                t0 = time.perf_counter()
                if prefill is not None:  # the direct handoff: prefill here, decode with its descriptor
                    answer = await prefill.post(path, json.dumps({
                        **request, "max_tokens": 1, "stream": False, "kv_transfer_params": _PREFILL_KV,
                    }).encode(), t0)  # fmt: skip
                    desc = json.loads(answer.body).get("kv_transfer_params") if answer.status == 200 else None
                    if not isinstance(desc, dict):
                        errors += 1
                        continue
                    request["kv_transfer_params"] = desc
                timing = await conn.post(path, json.dumps(request).encode(), t0)
                if timing.status != 200 or timing.first is None:
                    errors += 1
                    continue
                ttfts.append(timing.first - t0)
                totals.append(timing.total)
                if timing.last is not None and timing.last > timing.first and max_tokens > 1:
                    tpots.append((timing.last - timing.first) / (max_tokens - 1))
            except (OSError, ConnectionError, trio.BrokenResourceError, ValueError):
                errors += 1
        await conn.aclose()
        if prefill is not None:
            await prefill.aclose()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for wid in range(concurrency):
            nursery.start_soon(worker, wid)
    elapsed = time.perf_counter() - start
    return {"requests": len(totals), "errors": errors, "elapsed_s": elapsed, "ttft_s": ttfts, "total_s": totals,
            "tpot_s": tpots}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--model", default="sim-llama")
    parser.add_argument("--unique-prompts", action="store_true",
                        help="a random nonce and random words in every prompt (no shared prefixes)")
    parser.add_argument("--prefill-url", help="do the handoff here: prefill on this engine, decode from --url")
    args = parser.parse_args()
    result = trio.run(partial(run, args.url, args.concurrency, args.requests, args.max_tokens, args.path,
                              args.prompt_words, model=args.model, unique=args.unique_prompts,
                              prefill_url=args.prefill_url))  # fmt: skip
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
