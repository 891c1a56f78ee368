"""Helpers of the real-engine suite: the vLLM pair, ``narwhal serve`` as a subprocess, SSE.

The pair is the one ``tools/vllm-cpu/pair.py`` starts; :class:`RealPair` reads its run
directory and drives it through the same script (kill, restart), so a test never
signals a process it did not find recorded there.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx

from narwhal.engines.metrics import parse_prometheus, sum_samples
from narwhal.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PAIR_SCRIPT = REPO / "tools" / "vllm-cpu" / "pair.py"
#: In an engine's command line (``pair.py`` starts it with ``python -m`` this module).
ENGINE_MARK = b"vllm.entrypoints.openai.api_server"
MODEL = "tiny-llama"
#: Generous: two vLLM servers and the router share two cores in CI, and the machine
#: stalls for up to half a minute (a connect to a frozen router waits that long).
HTTP_TIMEOUT = httpx.Timeout(120.0, connect=60.0)


def unique_prompt(words: int) -> str:
    """A prompt no engine has seen: a random head defeats every prefix cache."""
    rng = secrets.token_hex(8)
    body = " ".join(f"w{(i * 7919) % 1000}" for i in range(words))
    return f"{rng} {body}"


# --------------------------------------------------------------------------- the pair


class RealPair:
    """A running producer/consumer pair.

    Args:
        fleet: the pair's fleet document (parsed JSON).
        run_dir: the ``pair.py`` run directory, when the pair was started by it; only
            then can tests kill and restart engines.
    """

    def __init__(self, fleet: dict[str, Any], run_dir: Path | None) -> None:
        self.fleet = fleet
        self.run_dir = run_dir
        self.urls = {e["name"]: e["url"] for e in fleet["engines"]}
        self.dirty: set[str] = set()

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> RealPair:
        return cls(json.loads((run_dir / "fleet.json").read_text()), run_dir)

    @property
    def managed(self) -> bool:
        return self.run_dir is not None

    @property
    def state(self) -> dict[str, Any]:
        assert self.run_dir is not None
        return dict(json.loads((self.run_dir / "pair.json").read_text()))

    def model_config(self) -> dict[str, Any] | None:
        """The served model's ``config.json``, when the model directory is known."""
        if self.run_dir is None:
            return None
        return dict(json.loads((Path(self.state["model"]) / "config.json").read_text()))

    def healthy(self, role: str) -> bool:
        try:
            return httpx.get(f"{self.urls[role]}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self, role: str) -> Metrics:
        response = httpx.get(f"{self.urls[role]}/metrics", timeout=30)
        response.raise_for_status()
        return Metrics(parse_prometheus(response.text))

    def _pair(self, *args: str, timeout: float) -> None:
        assert self.run_dir is not None, (
            "only a pair started by tools/vllm-cpu/pair.py can be driven"
        )
        subprocess.run(
            [sys.executable, str(PAIR_SCRIPT), *args, "--run-dir", str(self.run_dir)],
            check=True,
            timeout=timeout,
        )

    def kill(self, role: str) -> None:
        """SIGKILL one engine (its API server and engine core)."""
        self.dirty.add(role)
        self._pair("kill", role, timeout=300)

    def kill_now(self, role: str) -> None:
        """SIGKILL one engine's process group from this process, then :meth:`kill`.

        :meth:`kill` runs ``pair.py``, whose start-up takes a second or more on a loaded
        box; an engine on its own core streams hundreds of tokens meanwhile. The group
        is the one ``pair.py`` recorded (each engine runs in its own session) and is
        signalled only while its leader is still that engine's API server.
        """
        pid = self.state["engines"][role]["pid"]
        try:
            ours = ENGINE_MARK in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            ours = False
        if ours:
            os.killpg(pid, signal.SIGKILL)
        self.kill(role)

    def restart(self, role: str) -> float:
        """Start a stopped engine again as it was; returns the seconds until healthy."""
        start = time.monotonic()
        self._pair("restart", role, timeout=900)
        self.dirty.discard(role)
        return time.monotonic() - start


@attrs.frozen
class Metrics:
    """One scrape of an engine's ``/metrics``."""

    samples: dict[str, Any]

    def total(self, name: str, **labels: str) -> float:
        return sum_samples(self.samples.get(name, ()), **labels) or 0.0

    def by_source(self, source: str) -> float:
        return self.total("vllm:prompt_tokens_by_source_total", source=source)

    @property
    def completion_posts(self) -> float:
        """Every ``POST /v1/completions`` and ``/v1/chat/completions`` answered, any status."""
        return self.total(
            "http_requests_total", handler="/v1/completions", method="POST"
        ) + self.total("http_requests_total", handler="/v1/chat/completions", method="POST")


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False).

    A machine stall (docs/real-engines.md: every process on the box frozen for seconds)
    does not count against the timeout: a poll that wakes more than a second late moves
    the deadline by its lateness, so the awaited process gets its share of the time.
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        now = time.monotonic()
        if now > deadline:
            return False
        time.sleep(interval)
        late = time.monotonic() - now - interval
        if late > 1.0:
            deadline += late


class StallWatch:
    """The longest machine stall seen while it runs: how late a 50 ms sleep woke, at most.

    The machine-wide stalls of docs/real-engines.md freeze every process on the box,
    this one included; a thread of an otherwise idle test process that oversleeps by a
    quarter of a second met one. Used as a context manager around what it watches.
    """

    TICK_S = 0.05

    def __init__(self) -> None:
        self.worst_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.TICK_S):
            now = time.monotonic()
            self.worst_s = max(self.worst_s, now - last - self.TICK_S)
            last = now

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------- the router


class RouterProcess:
    """``narwhal serve --fleet F`` on a free port, with its own journal.

    With ``admin=True`` the admin surface listens on a free port too, at
    :attr:`admin_url` (else on an ephemeral port nobody reads).
    """

    def __init__(self, fleet: dict[str, Any], workdir: Path, *, admin: bool = False) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        admin_port = free_port() if admin else 0
        self.admin_url = f"http://127.0.0.1:{admin_port}" if admin else None
        self.journal_path = workdir / "journal.jsonl"
        self.log_path = workdir / "serve.log"
        doc = copy.deepcopy(fleet)
        doc.setdefault("server", {})["port"] = self.port
        doc["server"]["admin_port"] = admin_port
        doc["journal"] = {"path": str(self.journal_path), "fsync": False}
        self.fleet_path = workdir / "fleet.json"
        self.fleet_path.write_text(json.dumps(doc, indent=2))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> None:
        """Start and wait for "narwhal serving on" (imports alone take seconds on a busy box)."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "narwhal", "serve", "--fleet", str(self.fleet_path)],
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        if not wait_for(
            lambda: "narwhal serving on" in self.log() or self.proc.poll() is not None, timeout
        ):
            self.stop()
            raise AssertionError(f"narwhal serve did not start in {timeout:g} s:\n{self.log()}")
        if self.proc.poll() is not None:
            raise AssertionError(f"narwhal serve exited with {self.proc.returncode}:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM (graceful: drains and flushes the journal); returns the exit status."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=120)  # grace period (30 s) plus a loaded machine
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"narwhal serve ignored SIGTERM:\n{self.log()}") from None

    def admin_metrics(self) -> Metrics:
        """One scrape of the router's admin ``/metrics`` (needs ``admin=True``)."""
        assert self.admin_url is not None, "RouterProcess(..., admin=True) serves the admin surface"
        response = httpx.get(f"{self.admin_url}/metrics", timeout=30)
        response.raise_for_status()
        return Metrics(parse_prometheus(response.text))

    def journal(self) -> list[dict[str, Any]]:
        try:
            text = self.journal_path.read_text()
        except FileNotFoundError:
            return []
        # The writer appends whole batches; a partly written last line is not a record yet.
        records = []
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                break
        return records

    def record(self, request_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The journal line of ``request_id`` (the writer is asynchronous: wait for it)."""
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [r for r in self.journal() if r["request_id"] == request_id]
            return bool(found)

        assert wait_for(seen, timeout), f"no journal record for {request_id}:\n{self.log()[-3000:]}"
        return found[0]


# --------------------------------------------------------------------------- SSE


@attrs.define
class Streamed:
    """What a streaming answer delivered."""

    status: int
    headers: httpx.Headers
    events: list[Any] = attrs.Factory(list)  # parsed JSON objects, and "[DONE]"
    token_times: list[float] = attrs.Factory(list)  # monotonic time of each token event
    started: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        return [
            t for e in self.data for c in e.get("choices") or () for t in c.get("token_ids") or ()
        ]

    @property
    def data(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict)]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def usage(self) -> dict[str, Any] | None:
        usages = [e["usage"] for e in self.data if e.get("usage")]
        return usages[-1] if usages else None


def iter_events(response: httpx.Response) -> Iterator[Any]:
    """The ``data:`` payloads of an event stream: JSON objects, or the string ``[DONE]``."""
    data: list[str] = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            payload, data = "\n".join(data), []
            yield payload if payload == "[DONE]" else json.loads(payload)
    if data:
        payload = "\n".join(data)
        yield payload if payload == "[DONE]" else json.loads(payload)


def stream(
    client: httpx.Client,
    path: str,
    body: dict[str, Any],
    *,
    request_id: str | None = None,
    on_event: Callable[[Streamed], None] | None = None,
) -> Streamed:
    """POST a streaming request (asking for token ids) and read it to its end."""
    headers = {"x-request-id": request_id} if request_id else {}
    started = time.monotonic()
    # Token ids are relayed only to a client that asks for them (as vLLM does), and
    # every stream here is read by identified tokens.
    payload = {"return_token_ids": True, **body, "stream": True}
    with client.stream("POST", path, json=payload, headers=headers) as response:
        out = Streamed(status=response.status_code, headers=response.headers, started=started)
        if response.status_code != 200:
            response.read()
            out.events.append(response.json())
            return out
        for event in iter_events(response):
            out.events.append(event)
            if isinstance(event, dict) and any(
                c.get("token_ids") for c in event.get("choices") or ()
            ):
                out.token_times.append(time.monotonic())
            if on_event is not None:
                on_event(out)
    return out


def new_request_id(tag: str) -> str:
    return f"real-{tag}-{secrets.token_hex(6)}"
