"""Start, inspect and stop a vLLM (CPU) NixlConnector producer/consumer pair on loopback.

Standard library only, so any ``python3`` runs it; the engines run with the venv that
``install.sh`` made. ``start_pair.sh`` and ``stop_pair.sh`` are thin wrappers::

    python3 tools/vllm-cpu/pair.py start     # build the model if needed, start, wait, write fleet.json
    python3 tools/vllm-cpu/pair.py status
    python3 tools/vllm-cpu/pair.py kill consumer      # SIGKILL one engine (fault tests)
    python3 tools/vllm-cpu/pair.py restart consumer   # start it again as it was
    python3 tools/vllm-cpu/pair.py stop      # TERM, then KILL after a grace period
    python3 tools/vllm-cpu/pair.py start --otlp-traces-endpoint auto  # engines export spans

Everything lives in the run directory (``--run-dir``, default
``${NARWHAL_VLLM_RUN:-$HOME/.cache/narwhal/vllm-pair}``): ``pair.json`` (ports, PIDs,
command lines, timings, the descriptor seen at startup), ``producer.log``,
``consumer.log`` and ``fleet.json``, a fleet document for ``narwhal serve --fleet``
whose producer connector names exactly the side channel the producer's handoff
descriptors name (checked with a real prefill at startup).

Each engine runs in its own session, so its process group holds the API server, its
engine core and its worker; stopping signals the members of that group, found by the
PID recorded at start, and nothing else.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: ``sitecustomize.py`` for the engines: NIXL's progress thread waits instead of spinning.
ENGINE_SITE = HERE / "engine_site"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "narwhal"
DEFAULT_VENV = os.environ.get("NARWHAL_VLLM_VENV") or str(CACHE / "vllm-cpu-venv")
DEFAULT_MODEL = os.environ.get("NARWHAL_VLLM_MODEL") or str(CACHE / "tiny-llama")
DEFAULT_RUN = os.environ.get("NARWHAL_VLLM_RUN") or str(CACHE / "vllm-pair")
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 2048
SIDE_HOST = "127.0.0.1"
ROLES = ("producer", "consumer")
_KV_ROLE = {"producer": "kv_producer", "consumer": "kv_consumer"}
_FLEET_ROLE = {"producer": ["prefill"], "consumer": ["decode"]}
_MARK = "vllm.entrypoints.openai.api_server"


def say(message: str) -> None:
    print(f"pair: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ small helpers


def _load_ports() -> Any:
    """``narwhal/testing/ports.py`` by its path: it needs only the standard library, and
    importing it as ``narwhal.testing.ports`` would import the package's dependencies."""
    spec = importlib.util.spec_from_file_location(
        "_narwhal_ports", HERE.parents[1] / "narwhal" / "testing" / "ports.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: A free port below the kernel's ephemeral range: the engines bind theirs at the end
#: of a start-up that opens many sockets (torch's rendezvous, ZMQ, the NIXL side
#: channel) on ports from that range.
free_port = _load_ports().free_port


def http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def healthy(port: int) -> bool:
    try:
        status, _ = http("GET", f"http://127.0.0.1:{port}/health", timeout=2.0)
    except OSError:
        return False
    return status == 200


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def group_members(pgid: int) -> list[int]:
    """PIDs of live processes in process group ``pgid`` (the engine and its children)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def is_our_engine(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return _MARK.encode() in cmdline


def signal_group(pid: int, sig: signal.Signals) -> int:
    """Send ``sig`` to every member of the engine's process group; return how many."""
    members = group_members(pid)
    # The group is ours only if its leader is our engine, or the leader is gone and
    # the remaining members are its children (a leader that died first).
    if not members or (pid in members and not is_our_engine(pid)):
        return 0
    for member in members:
        try:
            os.kill(member, sig)
        except ProcessLookupError:
            pass
    return len(members)


def parse_cpus(spec: str) -> set[int]:
    """``VLLM_CPU_OMP_THREADS_BIND`` syntax: ``0``, ``0,2`` or ``0-3``."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_workers(pgid: int, cpus: set[int]) -> int:
    """Bind every thread of the engine's worker process(es) to ``cpus``; return how many.

    vLLM binds the worker's OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND``, but on CPU
    its ``NixlConnector`` then calls ``sched_setaffinity(0, <last core of each NUMA
    node>)`` from the worker's main thread, meaning to reserve a core for the KV
    transfer: that moves the main thread, which runs the forward pass, so on a two-core
    machine both engines compute on the last core and the other stays idle. Binding
    the worker's threads again once the engine is up restores one core per engine.
    """
    pinned = 0
    for pid in group_members(pgid):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        if not comm.startswith("VLLM::Worker"):
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
                pinned += 1
            except OSError:
                pass  # a thread that ended meanwhile
    return pinned


def cpu_binding() -> tuple[str, str]:
    """One CPU each, from the CPUs this process may use (both share one if only one)."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[0]), str(cpus[1 % len(cpus)])


# ------------------------------------------------------------------ the run directory


class Pair:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.state_path = run_dir / "pair.json"
        self.state: dict[str, Any] = {}
        if self.state_path.is_file():
            self.state = json.loads(self.state_path.read_text())

    def save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        tmp.replace(self.state_path)

    def engine(self, role: str) -> dict[str, Any]:
        engines = self.state.get("engines", {})
        if role not in engines:
            raise SystemExit(f"pair: no {role} recorded in {self.state_path}")
        return engines[role]

    def alive(self, role: str) -> bool:
        pid = self.state.get("engines", {}).get(role, {}).get("pid")
        return bool(pid) and bool(group_members(pid))

    # ---------------------------------------------------------------- processes

    def launch(self, role: str) -> None:
        spec = self.engine(role)
        log = self.run_dir / spec["log"]
        env = {**os.environ, **spec["env"]}
        with open(log, "ab") as out:
            out.write(f"\n===== pair.py: starting {role} at {time.ctime()} =====\n".encode())
            out.flush()
            proc = subprocess.Popen(
                spec["argv"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.run_dir,
                # Its own process group (signalled as one), but the caller's session:
                # a new session is a new scheduler autogroup, and the kernel then shares
                # each CPU between the groups, not the tasks. An engine pinned to one core
                # in a group of its own starves the caller's processes that land on that
                # core (the bench client, the router, the tests' stall watch woke 0.3-1 s
                # late while the engines served; docs/real-engines.md).
                process_group=0,
            )
        spec["pid"] = proc.pid
        spec["launched_at"] = time.time()
        spec.pop("ready_s", None)
        self.save()

    def wait_healthy(self, roles: list[str], timeout: float) -> None:
        start = time.monotonic()
        pending = list(roles)
        last_note = start
        while pending:
            for role in list(pending):
                spec = self.engine(role)
                if healthy(spec["port"]):
                    spec["ready_s"] = round(time.time() - spec["launched_at"], 1)
                    say(f"{role} ready on :{spec['port']} after {spec['ready_s']} s")
                    pending.remove(role)
                elif not group_members(spec["pid"]):
                    self.save()
                    raise StartError(role, f"{role} exited during startup")
            self.save()
            if not pending:
                break
            now = time.monotonic()
            if now - start > timeout:
                raise StartError(
                    pending[0], f"{', '.join(pending)} not healthy after {timeout:g} s"
                )
            if now - last_note >= 15:
                say(f"waiting for {', '.join(pending)} ({now - start:.0f} s)")
                last_note = now
            time.sleep(1.0)

    def pin(self, role: str) -> None:
        """Bind the engine's worker threads to its CPUs again (see :func:`pin_workers`)."""
        spec = self.engine(role)
        n = pin_workers(spec["pid"], parse_cpus(spec["cpus"]))
        spec["pinned_threads"] = n
        self.save()
        if n:
            say(f"{role}: {n} worker threads bound to cpus {spec['cpus']}")
        else:
            say(f"{role}: no worker process found to bind to cpus {spec['cpus']}")

    def stop(self, roles: list[str], grace: float, sig: signal.Signals = signal.SIGTERM) -> None:
        for role in roles:
            spec = self.state.get("engines", {}).get(role)
            if not spec or not spec.get("pid"):
                continue
            n = signal_group(spec["pid"], sig)
            if n:
                say(f"sent {sig.name} to {role} (pid {spec['pid']}, {n} processes)")
        deadline = time.monotonic() + grace
        for role in roles:
            spec = self.state.get("engines", {}).get(role)
            if not spec or not spec.get("pid"):
                continue
            while group_members(spec["pid"]) and time.monotonic() < deadline:
                time.sleep(0.2)
            if signal_group(spec["pid"], signal.SIGKILL):
                say(f"{role} still running after {grace:g} s: sent SIGKILL")
                end = time.monotonic() + 10
                while group_members(spec["pid"]) and time.monotonic() < end:
                    time.sleep(0.2)
            spec["pid"] = None
        self.save()


class StartError(Exception):
    def __init__(self, role: str, message: str) -> None:
        super().__init__(message)
        self.role = role


# ------------------------------------------------------------------ commands


def kv_extra(args: argparse.Namespace) -> dict[str, Any]:
    """``--kv-extra KEY=JSON`` options: more of the connector's extra config."""
    extra: dict[str, Any] = {}
    for item in args.kv_extra or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"pair: --kv-extra wants KEY=JSON, not {item!r}")
        try:
            extra[key] = json.loads(value)
        except ValueError:
            extra[key] = value
    return extra


def progress_delay_env(delay_us: int) -> dict[str, str]:
    """The engines' environment for NIXL's progress-thread delay (none when 0).

    The engines' ``PYTHONPATH`` is the hook's directory alone: the venv needs nothing
    from the caller's path (a source checkout on it would only shadow packages).
    """
    if delay_us <= 0:
        return {}
    return {"PYTHONPATH": str(ENGINE_SITE), "NARWHAL_NIXL_PROGRESS_DELAY_US": str(delay_us)}


#: The topic the engines publish their KV-cache events under.
KV_EVENTS_TOPIC = "kv-events"


def kv_events_args(ports: dict[str, int] | None) -> list[str]:
    """Prefix caching, cached-token counts in usage and KV-cache events.

    ``ports`` names the ZeroMQ PUB port and the replay (ROUTER) port the engine binds;
    ``None`` adds nothing (vLLM's defaults: prefix caching on, no events, no
    ``prompt_tokens_details`` in usage). vLLM binds its PUB socket only to a wildcard
    endpoint and *connects* it to any other (``tcp://127.0.0.1:P`` would publish
    nothing live: only the replay would answer), so the PUB endpoint is ``tcp://*:P``;
    the replay socket is always bound, to loopback here.
    """
    if ports is None:
        return []
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports['pub']}",
        "replay_endpoint": f"tcp://127.0.0.1:{ports['replay']}",
        "topic": KV_EVENTS_TOPIC,
    }
    return ["--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events, separators=(",", ":"))]  # fmt: skip


#: What vLLM's tracing (``--otlp-traces-endpoint``) imports: the OpenTelemetry SDK and
#: the OTLP exporters (vllm-cpu depends on them; install.sh makes sure of it).
_OTEL_CHECK = "import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http.trace_exporter"


def traces_endpoint(args: argparse.Namespace) -> str | None:
    """Where the engines export their spans (``--otlp-traces-endpoint``): None for
    ``off``; for ``auto``, an OTLP/HTTP endpoint on a free loopback port when the venv
    has OpenTelemetry (the real-engine tracing test listens there), else None."""
    value = args.otlp_traces_endpoint
    if value == "off":
        return None
    python = str(Path(args.venv) / "bin" / "python")
    has_otel = subprocess.run([python, "-c", _OTEL_CHECK], capture_output=True, check=False).returncode == 0
    if not has_otel:
        if value == "auto":
            say("engine tracing off: the venv has no OpenTelemetry (run install.sh again)")
            return None
        raise SystemExit(f"pair: --otlp-traces-endpoint {value}: the venv has no OpenTelemetry; run install.sh")
    return f"http://{SIDE_HOST}:{free_port()}/v1/traces" if value == "auto" else value


def tracing_args(role: str, endpoint: str | None) -> tuple[list[str], dict[str, str]]:
    """The engine's tracing flags and environment: spans over OTLP/HTTP to ``endpoint``
    (vLLM's default protocol is gRPC), exported every 200 ms, named ``vllm-<role>``."""
    if endpoint is None:
        return [], {}
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": f"vllm-{role}",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    return ["--otlp-traces-endpoint", endpoint], env


def engine_spec(
    args: argparse.Namespace,
    role: str,
    port: int,
    kv_port: int,
    cpus: str,
    events: dict[str, int] | None = None,
    traces: str | None = None,
) -> dict[str, Any]:
    python = str(Path(args.venv) / "bin" / "python")
    kv_config = {
        "kv_connector": "NixlConnector",
        "kv_role": _KV_ROLE[role],
        "kv_buffer_device": "cpu",
        # How long the producer holds a prompt's KV blocks for a consumer that has not
        # pulled them yet (vLLM's default is 30 s). On a loaded two-core machine a
        # consumer can take that long to start its pull; one that pulls after the
        # lease read blocks that may have been reused (vLLM logs "Potentially invalid
        # KV blocks"). The fleet's handoff.max_age_s stays below it.
        "kv_connector_extra_config": {"kv_lease_duration": args.kv_lease_s, **kv_extra(args)},
    }
    argv = [
        python, "-m", _MARK,
        "--model", str(Path(args.model).resolve()),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--dtype", "float32",
        "--enforce-eager",
        "--kv-transfer-config", json.dumps(kv_config, separators=(",", ":")),
        *kv_events_args(events),
        *tracing_args(role, traces)[0],
        # vLLM's render endpoints (/v1/completions/render, ...): vllm-router's kv_aware
        # and cache_aware policies call them on every request.
        *(["--enable-scale-out"] if args.enable_scale_out else []),
    ]  # fmt: skip
    env = {
        # NIXL's UCX progress thread sleeps on its event descriptors instead of polling
        # with a zero timeout (engine_site/sitecustomize.py): an idle engine then uses no
        # CPU, where it kept a core busy; 0 keeps NIXL's own busy polling.
        **progress_delay_env(args.nixl_progress_delay_us),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": SIDE_HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(kv_port),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        # POST /reset_prefix_cache (and the other development endpoints) answer.
        "VLLM_SERVER_DEV_MODE": "1",
        **tracing_args(role, traces)[1],
    }
    for item in args.engine_env or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"pair: --engine-env wants KEY=VALUE, not {item!r}")
        env[key] = value
    return {"role": role, "port": port, "kv_port": kv_port, "cpus": cpus, "argv": argv,
            "env": env, "log": f"{role}.log", "pid": None, "kv_events": events,
            "otlp_traces_endpoint": traces}  # fmt: skip


def handoff_check(pair: Pair) -> dict[str, Any]:
    """One real prefill on the producer and its decode on the consumer.

    Returns the producer's descriptor, so the fleet document can name what the
    producer really puts in it.
    """
    p, c = pair.engine("producer"), pair.engine("consumer")
    body = {
        "model": MODEL_NAME,
        "prompt": f"pair startup check {time.time_ns()} " + "narwhal " * 40,
        "max_tokens": 1,
        "ignore_eos": True,  # a descriptor comes only with finish_reason "length"
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        },
    }  # fmt: skip
    try:
        status, raw = http("POST", f"http://127.0.0.1:{p['port']}/v1/completions", body, 120)
    except OSError as exc:
        raise StartError("producer", f"prefill check failed: {exc}") from None
    if status != 200:
        raise StartError("producer", f"prefill check answered HTTP {status}: {raw[:300]!r}")
    desc = json.loads(raw).get("kv_transfer_params")
    if not isinstance(desc, dict) or not desc.get("remote_port"):
        raise StartError("producer", f"prefill check returned no usable descriptor: {desc!r}")
    decode = {**body, "max_tokens": 2, "kv_transfer_params": desc}
    try:
        status, raw = http("POST", f"http://127.0.0.1:{c['port']}/v1/completions", decode, 120)
    except OSError as exc:
        raise StartError("consumer", f"decode check failed: {exc}") from None
    if status != 200:
        raise StartError("consumer", f"decode check answered HTTP {status}: {raw[:300]!r}")
    return desc


def write_fleet(pair: Pair, desc: dict[str, Any], version: str | None, lease_s: int) -> Path:
    engines = []
    for role in ROLES:
        spec = pair.engine(role)
        if role == "producer":
            connector = {
                "type": "NixlConnector",
                "kv_host": desc["remote_host"],
                "kv_port": desc["remote_port"],
            }
        else:
            connector = {"type": "NixlConnector", "kv_host": SIDE_HOST, "kv_port": spec["kv_port"]}
        engines.append({
            "name": role,
            "url": f"http://127.0.0.1:{spec['port']}",
            "roles": _FLEET_ROLE[role],
            "model": MODEL_NAME,
            "connector": connector,
        })  # fmt: skip
        if spec.get("kv_events"):
            engines[-1]["kv_events"] = {
                "endpoint": f"tcp://127.0.0.1:{spec['kv_events']['pub']}",
                "replay_endpoint": f"tcp://127.0.0.1:{spec['kv_events']['replay']}",
                "topic": KV_EVENTS_TOPIC,
            }
    max_age = float(max(lease_s // 2, 1))
    fleet = {
        "server": {"host": "127.0.0.1", "port": 8000},
        "engines": engines,
        "engine": {"first_token_timeout_s": max_age / 2, "decode_read_timeout_s": 30.0,
                   "request_timeout_s": 600.0, "connect_timeout_s": 5.0},
        # A handoff older than the producer's KV lease names blocks that may be gone.
        "handoff": {"max_age_s": max_age},
        "engine_contract": {"version": version, "model": MODEL_NAME, "connector": "NixlConnector",
                            "max_model_len": MAX_MODEL_LEN},
        "journal": {"path": "runs/journal.jsonl"},
    }  # fmt: skip
    path = pair.run_dir / "fleet.json"
    path.write_text(json.dumps(fleet, indent=2) + "\n")
    return path


def cmd_start(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    pair = Pair(run_dir)
    if pair.state and all(pair.alive(r) for r in ROLES):
        if (
            all(healthy(pair.engine(r)["port"]) for r in ROLES)
            and (run_dir / "fleet.json").is_file()
        ):
            say(f"pair already running in {run_dir}")
            print(f"NARWHAL_VLLM_PAIR={run_dir}")
            return 0
    if pair.state:
        pair.stop(list(ROLES), grace=args.grace)

    python = Path(args.venv) / "bin" / "python"
    if not python.exists():
        say(f"no venv at {args.venv}: run tools/vllm-cpu/install.sh first")
        return 1
    subprocess.run([str(python), str(HERE / "make_model.py"), args.model], check=True)

    producer_cpus, consumer_cpus = args.cpus.split("/") if args.cpus else cpu_binding()
    ports = [args.producer_port or free_port(), args.consumer_port or free_port()]
    kv_ports = [args.producer_kv_port or free_port(), args.consumer_kv_port or free_port()]
    events: list[dict[str, int] | None] = [None, None]
    if args.kv_events:
        events = [{"pub": free_port(), "replay": free_port()} for _ in ROLES]
    traces = traces_endpoint(args)
    for log in ("producer.log", "consumer.log"):
        (run_dir / log).unlink(missing_ok=True)
    pair.state = {
        "venv": str(Path(args.venv).resolve()),
        "model": str(Path(args.model).resolve()),
        "served_model_name": MODEL_NAME,
        "engines": {
            "producer": engine_spec(
                args, "producer", ports[0], kv_ports[0], producer_cpus, events[0], traces
            ),
            "consumer": engine_spec(
                args, "consumer", ports[1], kv_ports[1], consumer_cpus, events[1], traces
            ),
        },
    }
    started = time.time()
    for role in ROLES:
        pair.launch(role)
        say(f"started {role}: pid {pair.engine(role)['pid']}, http :{pair.engine(role)['port']}, "
            f"side channel :{pair.engine(role)['kv_port']}, cpus {pair.engine(role)['cpus']}")  # fmt: skip
    try:
        pair.wait_healthy(list(ROLES), args.timeout)
        for role in ROLES:
            pair.pin(role)
        pair.state["ready_s"] = round(time.time() - started, 1)
        check_start = time.time()
        desc = handoff_check(pair)
        pair.state["handoff_check_s"] = round(time.time() - check_start, 2)
    except StartError as err:
        say(f"startup failed: {err}")
        for role in ROLES:
            say(f"--- last lines of {role}.log ---")
            print(tail(run_dir / f"{role}.log"), file=sys.stderr)
        pair.stop(list(ROLES), grace=args.grace)
        return 1
    pair.state["descriptor"] = desc
    _, raw = http("GET", f"http://127.0.0.1:{pair.engine('producer')['port']}/version")
    version = json.loads(raw).get("version")
    pair.state["version"] = version
    fleet = write_fleet(pair, desc, version, args.kv_lease_s)
    pair.state["fleet"] = str(fleet)
    pair.save()
    say(f"pair ready in {pair.state['ready_s']} s (vLLM {version}); the producer's descriptor names "
        f"{desc['remote_host']}:{desc['remote_port']}; fleet document {fleet}")  # fmt: skip
    print(f"NARWHAL_VLLM_PAIR={run_dir}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    pair = Pair(Path(args.run_dir))
    if not pair.state:
        say(f"nothing recorded in {args.run_dir}")
        return 0
    pair.stop(list(args.roles or ROLES), grace=args.grace)
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    pair = Pair(Path(args.run_dir))
    pair.stop([args.role], grace=10.0, sig=signal.SIGKILL)
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    pair = Pair(Path(args.run_dir))
    pair.stop([args.role], grace=args.grace)
    pair.launch(args.role)
    say(f"restarted {args.role}: pid {pair.engine(args.role)['pid']}")
    try:
        pair.wait_healthy([args.role], args.timeout)
        pair.pin(args.role)
    except StartError as err:
        say(f"restart failed: {err}")
        print(tail(pair.run_dir / pair.engine(args.role)["log"]), file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    pair = Pair(Path(args.run_dir))
    if not pair.state:
        say(f"nothing recorded in {args.run_dir}")
        return 1
    ok = True
    for role in ROLES:
        spec = pair.engine(role)
        alive, up = pair.alive(role), healthy(spec["port"])
        ok &= up
        print(f"{role}: pid {spec.get('pid')} {'alive' if alive else 'dead'}, "
              f"http :{spec['port']} {'healthy' if up else 'not answering'}, side channel :{spec['kv_port']}")  # fmt: skip
    print(f"fleet: {pair.state.get('fleet')}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="A vLLM CPU NixlConnector pair on loopback.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--run-dir",
        default=DEFAULT_RUN,
        help="state, logs and fleet.json (default: $NARWHAL_VLLM_RUN or %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[common])

    start = command("start", "start the pair and write fleet.json")
    start.add_argument(
        "--venv", default=DEFAULT_VENV, help="venv made by install.sh (default %(default)s)"
    )
    start.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model directory, built if missing (default %(default)s)",
    )
    start.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
    start.add_argument(
        "--cpus", help="CPU binding 'P/C', e.g. '0/1' (default: the first two usable CPUs)"
    )
    start.add_argument(
        "--kv-lease-s",
        type=int,
        default=120,
        help="seconds the producer holds unclaimed KV blocks (default %(default)s; "
        "the fleet's handoff.max_age_s is half of it)",
    )
    start.add_argument(
        "--nixl-progress-delay-us",
        type=int,
        default=10_000,
        help="longest sleep of NIXL's UCX progress thread between polls, in microseconds "
        "(default %(default)s; it wakes earlier when UCX signals work); 0 keeps NIXL's "
        "busy polling, which keeps a core busy per engine",
    )
    start.add_argument(
        "--kv-extra",
        action="append",
        metavar="KEY=JSON",
        help="more kv_connector_extra_config for both engines (repeatable), e.g. num_threads=2",
    )
    start.add_argument(
        "--engine-env",
        action="append",
        metavar="KEY=VALUE",
        help="extra environment of both engines (repeatable), e.g. VLLM_LOGGING_LEVEL=DEBUG",
    )
    start.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefix caching with cached-token counts in usage, and KV-cache events on "
        "free loopback ports named in fleet.json's engines[].kv_events (default on; "
        "--no-kv-events leaves vLLM's defaults: prefix caching without events)",
    )
    start.add_argument(
        "--otlp-traces-endpoint",
        default="off",
        metavar="URL|auto|off",
        help="both engines export their OpenTelemetry spans (vLLM's --otlp-traces-endpoint) "
        "over OTLP/HTTP to URL (its full /v1/traces URL); auto: to a free loopback port, "
        "recorded in pair.json, when the venv has OpenTelemetry (the real-engine tracing "
        "test listens there); default off",
    )
    start.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="register vLLM's scale-out endpoints (/v1/completions/render and the others) "
        "on both engines: vllm-router's kv_aware and cache_aware policies call them "
        "(tools/bench_overhead_real.py compares against kv_aware)",
    )
    for role in ROLES:
        start.add_argument(
            f"--{role}-port", type=int, default=0, help="HTTP port (default: a free one)"
        )
        start.add_argument(
            f"--{role}-kv-port",
            type=int,
            default=0,
            help="NIXL side-channel port (default: a free one)",
        )
    stop = command("stop", "stop the pair (TERM, then KILL)")
    stop.add_argument("roles", nargs="*", help="producer and/or consumer (default both)")
    kill = command("kill", "SIGKILL one engine")
    kill.add_argument("role", choices=ROLES)
    restart = command("restart", "stop one engine if running and start it again")
    restart.add_argument("role", choices=ROLES)
    restart.add_argument("--timeout", type=float, default=600.0)
    command("status", "show PIDs and health")
    for p in (start, stop, restart):
        p.add_argument("--grace", type=float, default=20.0, help="seconds between TERM and KILL")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "stop" and any(r not in ROLES for r in args.roles):
        parser.error(f"roles are {', '.join(ROLES)}")
    return {"start": cmd_start, "stop": cmd_stop, "kill": cmd_kill, "restart": cmd_restart,
            "status": cmd_status}[args.command](args)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
