"""``narwhal bench``: runs, usage errors, compare and join (virtual time, the router in memory)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import trio

from narwhal.bench.cli import main, run_async

from .routerkit import ROUTER_HOST, ROUTER_PORT, Stack, open_stack

URL = f"http://{ROUTER_HOST}:{ROUTER_PORT}"
WORKLOAD = ["--rate", "10", "--arrival", "constant", "--num-requests", "6", "--input-len", "100",
            "--output-len", "8", "--no-progress"]
PREFILL_S = 0.010 + 1e-4 * 100
STEP_S = 0.005


async def _bench(stack: Stack, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = await run_async(list(argv), transport=stack.net.transport(), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


async def test_run_writes_results_summary_and_table(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with open_stack() as stack:
        rc, out, err = await _bench(stack, "--url", URL, "--out", str(tmp_path / "a"), *WORKLOAD,
                                    "--slo-ttft", "30ms", "--slo-tpot", "10ms")
    assert rc == 0, err
    lines = (tmp_path / "a" / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 6
    assert all(r["terminal_class"] == "ok" and r["scored"] for r in records)
    assert [r["request_id"] for r in records] == [r["request_id"] for r in stack.records]
    assert records[0]["ttft_s"] == pytest.approx(PREFILL_S + STEP_S)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["accounting"]["rule"] == "narwhal-token-ids/1"
    assert summary["slo"] == {"ttft_s": 0.03, "tpot_s": 0.01, "attainment": 0.99}
    assert summary["slo_held"] is True
    assert summary["attainment"]["both"] == {"met": 6, "ratio": 1.0}
    assert summary["workload"]["input_len"] == "fixed:100"
    assert summary["run"]["model"] == "sim-llama"
    assert summary["ttft_s"]["successes"]["p99"] == pytest.approx(PREFILL_S + STEP_S)
    assert summary["goodput_rps"] == pytest.approx(6 / (0.5 + PREFILL_S + 8 * STEP_S))
    assert "->  SLO HELD" in out and "TTFT (successes)" in out and "25.0 ms" in out
    assert err == ""


async def test_compare_two_runs(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with open_stack() as stack:
        for name in ("a", "b"):
            rc, _, err = await _bench(stack, "--url", URL, "--out", str(tmp_path / name), *WORKLOAD, "--slo-ttft", "1s")
            assert rc == 0, err
        rc, _, _ = await _bench(stack, "--url", URL, "--out", str(tmp_path / "c"), *WORKLOAD, "--slo-ttft", "1s",
                                "--warmup", "1")
        assert rc == 0
        rc, _, _ = await _bench(stack, "--url", URL, "--out", str(tmp_path / "d"), *WORKLOAD, "--slo-ttft", "2s")
        assert rc == 0
    out = io.StringIO()
    assert await run_async(["compare", str(tmp_path / "a"), str(tmp_path / "b")], out=out) == 0
    assert "attainment both" in out.getvalue() and "+0.0 ms" in out.getvalue()

    out = io.StringIO()
    assert await run_async(["compare", str(tmp_path / "a"), str(tmp_path / "c")], out=out) == 1
    text = out.getvalue()
    assert "not comparable:" in text
    assert "denominators differ: A has 6 scored of 6 scheduled (not scored: none); " \
           "B has 5 scored of 6 scheduled (not scored: warmup 1)" in text
    assert "TTFT p50" not in text

    out = io.StringIO()
    assert await run_async(["compare", "--json", str(tmp_path / "a"), str(tmp_path / "d")], out=out) == 1
    cmp = json.loads(out.getvalue())
    assert cmp["comparable"] is False and cmp["reasons"][0].startswith("SLO targets differ")


async def test_join_command(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with open_stack() as stack:
        rc, _, _ = await _bench(stack, "--url", URL, "--out", str(tmp_path / "a"), *WORKLOAD)
        assert rc == 0
    journal = tmp_path / "journal.jsonl"
    journal.write_text("".join(json.dumps(r) + "\n" for r in stack.records) + '{"request_id": "other"}\n{trunc')
    out = io.StringIO()
    rc = await run_async(["join", "--results", str(tmp_path / "a"), "--journal", str(journal)], out=out)
    assert rc == 0
    text = out.getvalue()
    assert "joined 6 requests with the router journal; 0 not in the journal, 0 ambiguous, 1 malformed" in text
    assert "KV transfer + decode queue" in text and "5.0 ms" in text
    rows = [json.loads(line) for line in (tmp_path / "a" / "join.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["router_ttft_s"] == pytest.approx(PREFILL_S) for r in rows)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = io.StringIO()
    rc = await run_async(["join", "--results", str(tmp_path / "a"), "--journal", str(empty),
                          "--out", str(tmp_path / "j.jsonl")], out=io.StringIO(), err=err)
    assert rc == 1 and "no request of the results is in the journal" in err.getvalue()


async def test_trace_run(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"offset_s": 0.0, "prompt_len": 100, "output_len": 1}\n'
        '{"offset_s": 0.5, "prompt": "one two three", "output_len": 3}\n'
    )
    async with open_stack() as stack:
        rc, _, err = await _bench(stack, "--url", URL, "--out", str(tmp_path / "t"), "--trace", str(trace),
                                  "--no-progress")
    assert rc == 0, err
    records = [json.loads(line) for line in (tmp_path / "t" / "results.jsonl").read_text().splitlines()]
    assert [(r["scheduled_s"], r["prompt_len"], r["prompt_tokens"], r["output_len"]) for r in records] == [
        (0.0, 100, 100, 1),
        (0.5, None, 3, 3),
    ]
    assert records[0]["tpot_s"] is None
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["workload"]["kind"] == "trace" and len(summary["workload"]["sha256"]) == 64


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "the following arguments are required: --url, --out"),
        (["--url", URL, "--out", "{out}"], "give --rate (requests/s) or --trace"),
        (["--url", URL, "--out", "{out}", "--rate", "5"], "give a duration or a request count"),
        (["--url", URL, "--out", "{out}", "--rate", "0", "--num-requests", "3"], "the rate must be > 0"),
        (["--url", URL, "--out", "{out}", "--rate", "5", "--num-requests", "3", "--input-len", "zipf:2"],
         "expected N, fixed:N"),
        (["--url", URL, "--out", "{out}", "--rate", "5", "--num-requests", "3", "--burstiness", "0.5"],
         "--burstiness applies to --arrival gamma only"),
        (["--url", URL, "--out", "{out}", "--trace", "t.jsonl", "--rate", "5"], "--trace fixes the schedule; drop --rate"),
        (["--url", URL, "--out", "{out}", "--trace", "{out}/missing.jsonl"], "cannot read trace"),
        (["--url", URL, "--out", "{out}", "--rate", "5", "--num-requests", "3", "--slo-ttft", "fast"], "not a duration"),
        (["--url", URL, "--out", "{out}", "--rate", "5", "--num-requests", "3", "--api", "chat",
          "--prompt-format", "ids"], "token-id prompts work with completions only"),
        (["compare", "{out}/x", "{out}/y"], "No such file"),
        (["compare", "{out}"], "the following arguments are required: b"),
        (["join", "--results", "{out}"], "the following arguments are required: --journal"),
    ],
)
async def test_usage_errors_are_one_line(tmp_path: Path, argv: list[str], fragment: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    rc = await run_async([a.replace("{out}", str(tmp_path)) for a in argv], out=out, err=err)
    assert rc == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("narwhal bench: ") and fragment in lines[0], lines
    assert out.getvalue() == ""


async def test_existing_results_are_not_overwritten(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    (tmp_path / "results.jsonl").write_text("precious\n")
    async with open_stack() as stack:
        rc, _, err = await _bench(stack, "--url", URL, "--out", str(tmp_path), *WORKLOAD)
        assert rc == 2 and "already holds results.jsonl (use --overwrite" in err
        rc, _, err = await _bench(stack, "--url", URL, "--out", str(tmp_path), *WORKLOAD, "--overwrite")
        assert rc == 0, err
    assert "precious" not in (tmp_path / "results.jsonl").read_text()


async def test_unreachable_server_exits_1(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    async with open_stack() as stack:
        rc, _, err = await _bench(stack, "--url", "http://nowhere.test:1", "--out", str(tmp_path), *WORKLOAD)
    assert rc == 1 and err.startswith("narwhal bench: cannot reach http://nowhere.test:1")
    assert not (tmp_path / "results.jsonl").exists()


def test_main_help_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--slo-ttft" in capsys.readouterr().out
    assert main(["--rate", "x"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
