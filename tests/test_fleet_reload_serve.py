"""``narwhal serve`` reloads its fleet document on SIGHUP, over loopback, under load.

``narwhal sim`` runs three simulated engines; ``narwhal serve`` starts on two of them.
While 80 streams run, the document is rewritten (the decode engine serving streams is
replaced by another) and the router is sent SIGHUP: every stream completes, the journal
holds one line per request, and the fleet records beside it tell the change. A broken
document sent to the admin ``PUT /fleet`` changes nothing and names its JSON path.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

from narwhal.testing.ports import free_port

from .clikit import ENV
from .loadkit import Outcome, exchange

_SIM = {"model": "sim-llama", "decode": {"c0": 0.05, "c1": 0.0, "c2": 0.0}, "max_num_seqs": 512}


def _engine(name: str, role: str) -> dict[str, Any]:
    return {
        "name": name, "url": f"http://127.0.0.1:{free_port()}", "roles": [role],
        "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": free_port()}, "sim": _SIM,
    }  # fmt: skip


def _doc(tmp_path: Path, port: int, admin: int, *engines: dict[str, Any]) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port, "admin_port": admin},
        "engines": list(engines),
        "journal": {"path": str(tmp_path / "journal.jsonl")},
    }


def _narwhal(cwd: Path, *argv: str) -> subprocess.Popen[str]:
    """``narwhal ARGV``: its stdout piped, its log in ``<command>.log``."""
    with open(cwd / f"{argv[0]}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "narwhal", *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=log, text=True, env=ENV
        )


async def _stream(port: int, rid: str) -> Outcome:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    body = {"prompt": f"request {rid}", "max_tokens": 30, "stream": True, "ignore_eos": True}
    return await exchange(stream, body, request_id=rid)


async def test_sighup_replaces_an_engine_serving_streams(tmp_path: Path) -> None:
    p0, d0, d1 = _engine("p0", "prefill"), _engine("d0", "decode"), _engine("d1", "decode")
    port, admin = free_port(), free_port()
    (tmp_path / "engines.json").write_text(json.dumps(_doc(tmp_path, free_port(), free_port(), p0, d0, d1)))
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(_doc(tmp_path, port, admin, p0, d0)))
    sim = _narwhal(tmp_path, "sim", "--fleet", "engines.json")
    serve: subprocess.Popen[str] | None = None
    try:
        assert sim.stdout is not None
        for _ in range(3):
            assert "simulated engine" in await trio.to_thread.run_sync(sim.stdout.readline)
        serve = _narwhal(tmp_path, "serve", "--fleet", "fleet.json")
        assert serve.stdout is not None
        line = await trio.to_thread.run_sync(serve.stdout.readline)
        assert "narwhal serving on" in line and "NOT READY" not in line, line
        outcomes: dict[str, Outcome] = {}

        async def one(rid: str) -> None:
            outcomes[rid] = await _stream(port, rid)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, f"a{i}")
                await trio.sleep(0.5)
                fleet.write_text(json.dumps(_doc(tmp_path, port, admin, p0, d1)))
                serve.send_signal(signal.SIGHUP)
                for i in range(40):
                    nursery.start_soon(one, f"b{i}")
                    await trio.sleep(0.05)
        assert all(o.ok for o in outcomes.values()), [o for o in outcomes.values() if not o.ok]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin}") as client:
            with trio.fail_after(60):
                while "d0" in (await client.get("/health")).json()["engines"]:  # noqa: ASYNC110
                    await trio.sleep(0.2)  # its drain ended with its last stream
            health = (await client.get("/health")).json()
            assert health["status"] == "ready" and sorted(health["engines"]) == ["d1", "p0"]
            # A broken document changes nothing, and says where.
            bad = _doc(tmp_path, port, admin, p0, {**d1, "roles": ["decoder"]})
            answer = await client.put("/fleet", content=json.dumps(bad))
            assert answer.status_code == 400
            assert answer.json()["error"]["path"] == "$.engines[1].roles[0]"
            # And so does a broken file on SIGHUP (the log says why).
            fleet.write_text(json.dumps(bad))
            serve.send_signal(signal.SIGHUP)
            records = tmp_path / "journal.fleet.jsonl"
            with trio.fail_after(30):
                while records.read_text().count('"rejected"') < 2:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            assert sorted((await client.get("/health")).json()["engines"]) == ["d1", "p0"]
    finally:
        for proc in (serve, sim):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
        for proc in (serve, sim):
            if proc is not None:
                proc.communicate(timeout=60)
    err = (tmp_path / "serve.log").read_text()
    assert serve is not None and serve.returncode == 0, err
    assert "fleet reloaded (SIGHUP): added d1; removed d0" in err
    assert (
        "fleet reload (SIGHUP) refused, nothing changed: fleet.json: expected one of 'prefill', 'decode' "
        "@ $.engines[1].roles[0]"
    ) in err
    journal = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert sorted(r["request_id"] for r in journal) == sorted(outcomes) and len(journal) == 80
    assert all(r["terminal_class"] == "ok" for r in journal)
    assert {r["consumer"] for r in journal} == {"d0", "d1"}
    records = [json.loads(x) for x in (tmp_path / "journal.fleet.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("engine")) for r in records] == [
        ("reload", None), ("draining", "d0"), ("starting", "d1"), ("ready", "d1"), ("removed", "d0"),
        ("rejected", None), ("rejected", None),
    ]
    assert records[0]["source"] == "SIGHUP" and records[-1]["path"] == "$.engines[1].roles[0]"
