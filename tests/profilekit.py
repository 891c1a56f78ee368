"""Helpers for the profiler tests: simulated fleets with known latency models, transports
that record or rewrite what passes between the profiler and the engines."""

from __future__ import annotations

import copy
import io
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from narwhal.config import FleetConfig, parse_fleet
from narwhal.profile import ProfileRun, ProfileSettings, Progress, run_profile

PREFILL = {"a": 0.02, "b": 5e-5, "c": 2e-8}
DECODE = {"c0": 0.005, "c1": 0.0008, "c2": 2e-7}
#: The smallest sweep a profile passes its gates with: four prefill lengths, 2 x 2 decode cells.
SMALL: dict[str, Any] = {
    "prefill_lens": (128, 256, 512, 1024),
    "decode_input_lens": (128, 512),
    "decode_concurrency": (1, 4),
    "decode_tokens": 16,
}
#: Virtual seconds a whole profiling run may take in a test (a hang guard).
RUN_LIMIT_S = 3600.0


def engine(name: str, port: int, **sim: Any) -> dict[str, Any]:
    block: dict[str, Any] = {"seed": 1, "prefill": dict(PREFILL), "decode": dict(DECODE)}
    for key, value in sim.items():
        if isinstance(value, dict) and isinstance(block.get(key), dict):
            block[key] = {**block[key], **value}
        else:
            block[key] = copy.deepcopy(value)
    return {
        "name": name,
        "url": f"http://{name}.test:{port}",
        "roles": ["prefill", "decode"],
        "connector": {
            "type": "NixlConnector",
            "kv_host": f"{name}.kv.test",
            "kv_port": 15000 + port,
        },
        "sim": block,
    }


def fleet(*engines: dict[str, Any], **sections: Any) -> FleetConfig:
    return parse_fleet({"engines": list(engines) or [engine("e0", 8101)], **sections})


def settings(out: Path, **overrides: Any) -> ProfileSettings:
    base: dict[str, Any] = {
        "prefill_lens": (128, 512, 1024, 2048),
        "decode_input_lens": (256, 1024),
        "decode_concurrency": (1, 4, 8),
        "repeats": 3,
        "decode_tokens": 24,
        "seed": 7,
        "out": str(out / "profiles.json"),
    }
    return ProfileSettings(**(base | overrides))


async def profile(
    config: FleetConfig,
    transport: httpx.AsyncBaseTransport,
    s: ProfileSettings,
) -> tuple[ProfileRun, str]:
    """Run the profiler in memory; returns the run and its (plain) progress output."""
    out = io.StringIO()
    with trio.fail_after(RUN_LIMIT_S):
        run = await run_profile(config, s, transport=transport, progress=Progress(out, tty=False))
    return run, out.getvalue()


async def wait_for(predicate: Callable[[], bool], step_s: float = 0.001) -> None:
    """Poll ``predicate`` in virtual time (the engines' counters offer no event)."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(step_s)


def samples(run: ProfileRun) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(run.samples_path.read_text())
    return data


class Wrapper(httpx.AsyncBaseTransport):
    """Delegates to another transport, which it does not close (the fleet owns it)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        pass


@attrs.define
class Seen:
    host: str
    path: str
    body: Any


class Recording(Wrapper):
    """Records every request's host, path and JSON body, in order."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        super().__init__(inner)
        self.seen: list[Seen] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.seen.append(Seen(request.url.host, request.url.path, body))
        return await self.inner.handle_async_request(request)


Rewrite = Callable[[int, dict[str, Any]], list[dict[str, Any]]]


class _RewrittenStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, rewrite: Rewrite) -> None:
        self.inner = inner
        self.rewrite = rewrite

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = b""
        index = 0
        async for part in self.inner:
            buffer += part
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event[len(b"data: ") :]
                if not data.startswith(b"{"):
                    yield event + b"\n\n"
                    continue
                obj = json.loads(data)
                if obj.get("choices"):
                    outs = self.rewrite(index, obj)
                    index += 1
                else:
                    outs = [obj]
                for o in outs:
                    yield b"data: " + json.dumps(o).encode() + b"\n\n"
        if buffer:
            yield buffer

    async def aclose(self) -> None:
        await self.inner.aclose()


class RewriteStreams(Wrapper):
    """Rewrites the token events of the ``which``-th streamed completion (0-based)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, rewrite: Rewrite, *, which: int) -> None:
        super().__init__(inner)
        self.rewrite = rewrite
        self.which = which
        self.streams = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/v1/completions" or not response.headers.get(
            "content-type", ""
        ).startswith("text/event-stream"):
            return response
        n, self.streams = self.streams, self.streams + 1
        if n != self.which:
            return response
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_RewrittenStream(response.stream, self.rewrite),
            extensions=response.extensions,
        )


class MetricsRewrite(Wrapper):
    """Answers /metrics with each line passed through :meth:`line` (None drops it)."""

    def line(self, text: str) -> str | None:
        return text

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/metrics":
            return response
        text = (await response.aread()).decode()
        await response.aclose()
        lines = [out for line in text.splitlines() if (out := self.line(line)) is not None]
        return httpx.Response(response.status_code, headers={"content-type": "text/plain"},
                              content="\n".join(lines).encode())  # fmt: skip


class StripKVSize(MetricsRewrite):
    """Answers /metrics without cache_config_info's kv_cache_size_tokens label."""

    def line(self, text: str) -> str | None:
        if not text.startswith("vllm:cache_config_info{"):
            return text
        head, rest = text.split("{", 1)
        labels, value = rest.rsplit("}", 1)
        kept = [p for p in labels.split(",") if not p.startswith("kv_cache_size_tokens=")]
        return f"{head}{{{','.join(kept)}}}{value}"
