"""A minimal closed-loop streaming load generator, run in its own process.

It keeps one keep-alive HTTP/1.1 connection per worker and speaks just enough HTTP
to stream a completion (hand-written request, chunked body scanned for the first
token event and ``data: [DONE]``), so that the load generator costs far less than
what it measures. It prints one JSON object on stdout:
``{"requests", "errors", "elapsed_s", "ttft_s": [...], "total_s": [...]}``.

    python tools/loadgen.py --url http://127.0.0.1:8000 --concurrency 16 --requests 800
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from urllib.parse import urlsplit

import trio


def _request(host: str, port: int, path: str, body: bytes, extra_headers: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra_headers}\r\n"
    ).encode() + body


async def _read_response(stream: trio.SocketStream, buf: bytearray, t0: float) -> tuple[float | None, float, int]:
    """Read one chunked SSE response; (ttft, total, status). Raises on protocol errors."""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("closed before the response head")
        buf += data
    head_end = buf.index(b"\r\n\r\n") + 4
    status = int(bytes(buf[9:12]))
    head = bytes(buf[:head_end]).lower()
    del buf[:head_end]
    if b"content-length:" in head:
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        while len(buf) < length:
            data = await stream.receive_some(65536)
            if not data:
                raise ConnectionError("closed mid-body")
            buf += data
        del buf[:length]
        return None, time.perf_counter() - t0, status
    ttft: float | None = None
    # Scan the raw chunked stream: the first token event, then the terminating chunk.
    while True:
        if (ttft is None and b"token_ids" in buf) or (ttft is None and b'"text"' in buf):
            ttft = time.perf_counter() - t0
        end = buf.find(b"\r\n0\r\n\r\n")
        if end >= 0 and b"[DONE]" in buf[:end]:
            del buf[: end + 7]
            return ttft, time.perf_counter() - t0, status
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("closed mid-stream")
        if ttft is None and (b"token_ids" in data or b'"text"' in data):
            ttft = time.perf_counter() - t0
        buf += data
        if len(buf) > 1 << 20 and b"[DONE]" not in buf:
            # Keep only the tail: the body is only scanned for its end.
            del buf[: len(buf) - 4096]


async def run(url: str, concurrency: int, requests: int, max_tokens: int, path: str, prompt_words: int) -> dict[str, object]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    ttfts: list[float] = []
    totals: list[float] = []
    errors = 0
    remaining = requests
    prompt = " ".join(f"w{i}" for i in range(prompt_words))

    async def worker(wid: int) -> None:
        nonlocal remaining, errors
        stream: trio.SocketStream | None = None
        buf = bytearray()
        n = 0
        while remaining > 0:
            remaining -= 1
            n += 1
            body = json.dumps(
                {"model": "sim-llama", "prompt": f"{prompt} {wid} {n}", "max_tokens": max_tokens,
                 "stream": True, "return_token_ids": True, "ignore_eos": True}
            ).encode()
            try:
                if stream is None:
                    stream = await trio.open_tcp_stream(host, port)
                    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    buf.clear()
                t0 = time.perf_counter()
                await stream.send_all(_request(host, port, path, body, ""))
                ttft, total, status = await _read_response(stream, buf, t0)
                if status != 200 or ttft is None:
                    errors += 1
                    continue
                ttfts.append(ttft)
                totals.append(total)
            except (OSError, ConnectionError, trio.BrokenResourceError, ValueError):
                errors += 1
                if stream is not None:
                    await trio.aclose_forcefully(stream)
                stream = None
        if stream is not None:
            await stream.aclose()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for wid in range(concurrency):
            nursery.start_soon(worker, wid)
    elapsed = time.perf_counter() - start
    return {"requests": len(totals), "errors": errors, "elapsed_s": elapsed, "ttft_s": ttfts, "total_s": totals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=32)
    args = parser.parse_args()
    result = trio.run(run, args.url, args.concurrency, args.requests, args.max_tokens, args.path, args.prompt_words)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
