"""``narwhal bench --mix``: several tenants and classes, each its own rate, lengths and
SLO, and attainment reported per stream, tenant and class."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.bench.cli import run_async
from narwhal.bench.mix import load_mix, mix_schedule
from narwhal.errors import ConfigError

from .routerkit import ROUTER_HOST, ROUTER_PORT, engine, fleet_doc, open_stack

URL = f"http://{ROUTER_HOST}:{ROUTER_PORT}"
KEYS = {"web": "sk-web-TOPSECRET-1", "etl": "sk-etl-TOPSECRET-2"}


def write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(doc))
    return path


def test_each_stream_has_its_own_arrivals_and_the_schedule_merges_them(tmp_path: Path) -> None:
    path = write(tmp_path, {"duration_s": 10, "streams": [
        {"name": "chat", "tenant": "web", "rate": 4, "arrival": "constant", "input_len": "100", "output_len": "8",
         "slo_ttft_s": 0.5, "api_key": "k1"},
        {"name": "bulk", "tenant": "etl", "rate": 1, "arrival": "constant", "num_requests": 3, "input_len": "900",
         "headers": {"X-Narwhal-Class": "batch"}},
    ]})  # fmt: skip
    streams = load_mix(path)
    schedule = mix_schedule(streams)
    assert [r.stream for r in schedule].count(0) == 40 and [r.stream for r in schedule].count(1) == 3
    assert [r.offset_s for r in schedule] == sorted(r.offset_s for r in schedule)
    assert [r.index for r in schedule] == list(range(43))
    assert {r.prompt_len for r in schedule if r.stream == 1} == {900}
    assert dict(streams[1].headers) == {"x-narwhal-class": "batch"}
    assert dict(streams[0].headers) == {"authorization": "Bearer k1"}
    # What the summary records of a stream: never a key, never a header's value.
    assert "k1" not in json.dumps([s.to_json() for s in streams]) and "k1" not in repr(streams)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"streams": []}, "expected an object with a non-empty list of streams @ $.streams"),
        ({"streams": [{"name": "a"}]}, "expected the stream's rate (requests/s) @ $.streams[0].rate"),
        ({"streams": [{"rate": 1, "num_requests": 1, "input_len": "x"}]}, "@ $.streams[0].input_len"),
        ({"streams": [{"rate": 1, "num_requests": 1, "slo_ttft_s": -1}]}, "expected a number > 0 @ $.streams[0].slo_ttft_s"),
        ({"streams": [{"rate": 1, "num_requests": 1, "api_key_env": "NO_SUCH_VAR_FOR_NARWHAL"}]},
         "the environment variable NO_SUCH_VAR_FOR_NARWHAL (the stream's key) is not set @ $.streams[0].api_key_env"),
        ({"streams": [{"rate": 1}]}, "give a duration or a request count @ $.streams[0]"),
        ({"streams": [{"rate": 1, "num_requests": 1, "tennant": "x"}]}, "unknown key 'tennant' @ $.streams[0].tennant"),
        ({"streams": [{"name": "a", "rate": 1, "num_requests": 1}, {"name": "a", "rate": 1, "num_requests": 1}]},
         "duplicate stream name 'a'"),
    ],
)
def test_a_bad_mix_says_where(tmp_path: Path, doc: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_mix(write(tmp_path, doc))
    assert expected in str(info.value)


async def test_a_mixed_run_reports_each_tenant_and_class(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]),
        server={"api_keys": [{"key": k, "name": n} for n, k in KEYS.items()]},
        tenancy={"classes": [{"name": "chat", "priority": 0, "slo": {"ttft_s": 0.3}},
                             {"name": "batch", "priority": 5, "wait": True, "slo": {"ttft_s": 2.0}}],
                 "tenants": [{"name": "web", "latency_class": "chat"}, {"name": "etl", "latency_class": "batch"}]},
    )  # fmt: skip
    mix = write(tmp_path, {"streams": [
        {"name": "chat", "tenant": "web", "latency_class": "chat", "api_key_env": "WEB_KEY", "rate": 4,
         "arrival": "constant", "num_requests": 8, "input_len": "200", "output_len": "4", "slo_ttft_s": 0.3},
        {"name": "bulk", "tenant": "etl", "latency_class": "batch", "api_key": KEYS["etl"], "rate": 100,
         "arrival": "constant", "num_requests": 30, "input_len": "1000", "output_len": "4", "slo_ttft_s": 2.0},
    ]})  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEB_KEY", KEYS["web"])
        async with open_stack(doc, priced=True) as stack:
            rc = await run_async(["--url", URL, "--out", str(tmp_path / "run"), "--mix", str(mix), "--no-progress"],
                                 transport=stack.net.transport(), out=out, err=err)  # fmt: skip
            journal = {r["request_id"]: r for r in stack.records}
    assert rc == 0, err.getvalue()
    results = [json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # The router saw each stream's requests as its tenant's, by its key.
    assert all(journal[r["request_id"]]["tenant"] == r["tenant"] for r in results)
    groups = summary["groups"]
    assert set(groups["stream"]) == {"chat", "bulk"} and set(groups["tenant"]) == {"web", "etl"}
    chat, bulk = groups["latency_class"]["chat"], groups["latency_class"]["batch"]
    assert chat["denominator"] == 8 and chat["met"] == 8 and chat["attainment"] == 1.0
    # A burst of 30 bulk requests (3.3 s of prefill) against a 2 s target: the ones the
    # producer cannot carry in time are refused at the class's deadline.
    assert bulk["denominator"] == 30 and 10 <= bulk["met"] < 30
    assert bulk["by_class"]["refused"] == 30 - bulk["ok"] and bulk["met"] <= bulk["ok"]
    assert summary["workload"] == {"kind": "mix", "path": str(mix), "num_requests": 38, "streams": 2}
    assert [s["headers"] for s in summary["streams"]] == [["authorization"], ["authorization"]]
    text = out.getvalue()
    assert "stream chat" in text and "tenant etl" in text and "class batch" in text
    written = "\n".join(p.read_text() for p in (tmp_path / "run").iterdir()) + text
    assert "TOPSECRET" not in written
