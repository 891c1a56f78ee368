"""``narwhal profile``, ``narwhal check`` and ``narwhal bench`` against the real pair.

In order (``conftest.py`` runs this module after the transfer tests and before the
faults, which kill engines):

1. ``narwhal profile`` sweeps both engines with a sweep sized for the tiny CPU model;
2. a fleet document naming that pair (``profiles.path``) with fit limits set from the
   measurement passes ``narwhal check``: Gate F binds both profiles to the running
   engine generations, and the KV transfer probe producer->consumer passes;
3. ``narwhal bench`` through ``narwhal serve`` on that fleet agrees with vLLM's own
   TTFT/TPOT histograms (tolerances in :func:`test_bench_agrees_with_vllm_histograms`);
4. after one engine is restarted, ``narwhal check`` exits 1 with a Gate F line naming
   that engine and asking to re-profile or refit.

Each step needs the one before it; a failed step makes the later ones skip. Steps 1
and 3 run once more when one of the machine-wide CPU stalls of a loaded two-core box
(docs/real-engines.md) spoils them; the output says when that happened.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from .kit import RealPair, RouterProcess, StallWatch

pytestmark = pytest.mark.real_engine

ENGINES = ("producer", "consumer")
OUTPUT_LEN = 16
#: Bench client lag (s) beyond which a run met a machine stall (docs/real-engines.md).
STALL_LAG_S = 0.25
#: The sweep: the tiny model's prompts stay short on two cores; three prefill lengths,
#: two decode input lengths and three concurrencies are the fewest the fits accept.
SWEEP = [
    "--prefill-lens", "64,128,256,512",
    "--decode-input-lens", "64,256",
    "--decode-concurrency", "1,2,4",
    "--repeats", "3",
    "--seed", "0",
]  # fmt: skip
#: Fit limits never go below the shipped defaults and never above this. A CPU engine
#: sharing two cores with its peer and the router is noisy: leave-one-cell-out errors of
#: 20-60% were measured on six cells. What this module checks is Gate F, the transfer
#: probe and the generation binding, not the quality of a CPU decode model; a model
#: more than 100% off would mean the sweep itself is broken.
FIT_LIMIT_CEILING = 1.0

_state: dict[str, Any] = {}


def _narwhal(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )


def _need(key: str) -> Any:
    if key not in _state:
        pytest.skip(f"an earlier step of this module did not produce {key!r}")
    return _state[key]


def _base_fleet(pair: RealPair, workdir: Path) -> dict[str, Any]:
    doc = copy.deepcopy(pair.fleet)
    doc["journal"] = {"path": str(workdir / "journal.jsonl"), "fsync": False}
    return doc


def _round_up(value: float) -> float:
    return math.ceil(value * 100) / 100


def _interval_width(engine: dict[str, Any]) -> float:
    """The mean relative half-width of the decode model's prediction intervals (what
    the check holds to ``profiles.max_decode_cv_mape``)."""
    return float(engine["decode"]["uncertainty"]["mean_half_width"])


def _worst_decode_error(profiles: dict[str, Any]) -> float:
    return max(
        max(e["decode"]["fit_mape"], e["decode"]["cv_mape"], _interval_width(e))
        for e in profiles["engines"].values()
    )


def test_profile_writes_an_accepted_pair(
    pair: RealPair, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Exit 0 and both engines profiled; or exit 1 (a fit rejected for noise) with the
    pair written and every sample kept in the sidecar, and the later steps skipped.

    A decode cell that hit one of the CPU stalls of a loaded two-core box (a 10 s window
    for 34 tokens) drives a fit past :data:`FIT_LIMIT_CEILING`; the sweep then runs
    again (about 45 s each, three sweeps at most) and the last pair is the one used; if
    every sweep was disturbed, the later steps skip, saying why.
    """
    work = tmp_path_factory.mktemp("profile")
    fleet_path = work / "fleet.json"
    fleet_path.write_text(json.dumps(_base_fleet(pair, work), indent=2))
    out = work / "profiles.json"
    sidecar = out.with_name("profiles.samples.json")
    for attempt in (1, 2, 3):
        done = _narwhal(
            "profile", "--fleet", str(fleet_path), *SWEEP, "--out", str(out), "--quiet",
            "--overwrite", cwd=work, timeout=900,
        )  # fmt: skip
        report = done.stdout + done.stderr
        assert done.returncode in (0, 1), report
        assert out.is_file() and sidecar.is_file(), report
        profiles = json.loads(out.read_text())
        samples = json.loads(sidecar.read_text())
        if done.returncode == 1:
            # A fit rejected for noise: the pair is still written and the sidecar keeps
            # every sample taken, so it can be refit or inspected. A rejected TTFT curve
            # stops that engine before its decode sweep (the seed's procedure).
            for name in ENGINES:
                engine = samples["engines"][name]
                assert engine["prefill"], f"{name}:\n{report}"
                if "rejection" not in engine["prefill"]:
                    assert engine["decode"]["cells"], f"{name}:\n{report}"
            print(
                f"profile attempt {attempt}: a fit was REJECTED (exit 1), raw data kept in "
                f"{sidecar}:\n{report}"
            )
            if attempt < 3:
                continue  # once more: a CPU stall on a loaded box is not the engine's curve
            return  # the later steps need accepted profiles: they skip, saying why
        assert set(profiles["engines"]) == set(ENGINES), report
        worst = _worst_decode_error(profiles)
        print(f"profile attempt {attempt}: accepted (exit 0), worst decode MAPE {worst:.3f}")
        print(report)
        if worst <= FIT_LIMIT_CEILING:
            break
    else:
        # Every sweep caught a stall of the CPU engines (a cell off by more than 100%):
        # the profile's shape was checked above; the later steps need a usable model.
        print(f"profile: decode model off by {worst:.0%} after 3 sweeps: later steps skip")
        return
    _state["profiles"] = out
    _state["profile_doc"] = profiles


def test_check_passes_gate_f_and_the_transfer_probe(
    pair: RealPair, tmp_path_factory: pytest.TempPathFactory
) -> None:
    out: Path = _need("profiles")
    profiles = _state["profile_doc"]
    fits = [profiles["engines"][n]["decode"]["fit_mape"] for n in ENGINES]
    cvs = [profiles["engines"][n]["decode"]["cv_mape"] for n in ENGINES]
    widths = [_interval_width(profiles["engines"][n]) for n in ENGINES]
    print(f"decode fit_mape {fits}, cv_mape {cvs}, mean TPOT interval half-width {widths}")
    assert max(fits + cvs + widths) <= FIT_LIMIT_CEILING, (fits, cvs, widths)
    # Limits from the measurement, with headroom for the next check's noise-free reread
    # (the fits do not change) and never tighter than the shipped defaults. The check
    # holds the decode prediction intervals' mean half-width to the CV limit too.
    # (The prefill bounds are the seed's and fixed: the profiler applies them itself,
    # so an accepted profile passes them in the check.)
    fit_limit = max(0.05, _round_up(1.5 * max(fits)))
    cv_limit = max(0.13, _round_up(1.5 * max(cvs + widths)))
    work = tmp_path_factory.mktemp("check")
    doc = _base_fleet(pair, work)
    doc["profiles"] = {
        "path": str(out),
        "max_decode_fit_mape": fit_limit,
        "max_decode_cv_mape": cv_limit,
    }
    doc.setdefault("controller", {}).setdefault("reactive", {})["movement_margin"] = max(
        0.10, fit_limit
    )
    fleet_path = work / "fleet.json"
    fleet_path.write_text(json.dumps(doc, indent=2))
    done = _narwhal("check", "--fleet", str(fleet_path), "--json", cwd=work, timeout=300)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    report = json.loads(done.stdout)
    results = report["results"]
    lines = "\n".join(
        f"{'ok' if r['ok'] else 'FAIL'} {r['name']} {r['engine']}: {r['message']}" for r in results
    )
    print(lines)
    gate = [r for r in results if r["name"].startswith("gate_f.")]
    for name in ENGINES:
        for check in ("gate_f.profile", "gate_f.generation"):
            found = [r for r in gate if r["name"] == check and r["engine"] == name]
            assert found and all(r["ok"] for r in found), f"{check} {name}:\n{lines}"
    assert all(r["ok"] for r in gate), lines
    probe = [r for r in results if r["name"] == "kv_transfer"]
    assert probe, lines
    assert any(r["engine"] == "producer->consumer" for r in probe), lines
    assert all(r["ok"] for r in probe), lines
    assert done.returncode == 0, lines
    _state["fleet"] = doc
    _state["fleet_path"] = fleet_path


def _histogram_delta(before: Any, after: Any, name: str) -> tuple[float, float]:
    s = after.total(f"{name}_sum") - before.total(f"{name}_sum")
    n = after.total(f"{name}_count") - before.total(f"{name}_count")
    return s, n


@attrs.frozen
class _BenchRun:
    summary: dict[str, Any]
    results: list[dict[str, Any]]
    journal: dict[str, dict[str, Any]]
    before: dict[str, Any]
    after: dict[str, Any]
    stall_s: float


def _bench(pair: RealPair, doc: dict[str, Any], work: Path) -> _BenchRun:
    """One bench run through a fresh router: its summary, results, journal and scrapes."""
    router = RouterProcess(doc, work / "router")
    router.start()
    try:
        before = {n: pair.metrics(n) for n in ENGINES}
        with StallWatch() as watch:
            done = _narwhal(
            "bench", "--url", router.url, "--out", str(work / "bench"),
                "--rate", "2", "--num-requests", "20", "--input-len", "100",
                "--output-len", f"{OUTPUT_LEN}", "--slo-ttft", "2s", "--slo-tpot", "200ms",
                "--no-progress",
                cwd=work, timeout=300,
            )  # fmt: skip
        after = {n: pair.metrics(n) for n in ENGINES}
    finally:
        status = router.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert status == 0, router.log()[-3000:]
    summary = json.loads((work / "bench" / "summary.json").read_text())
    results = [
        json.loads(line)
        for line in (work / "bench" / "results.jsonl").read_text().splitlines()
        if line.strip()
    ]
    journal = {
        rec["request_id"]: rec
        for rec in map(json.loads, router.journal_path.read_text().splitlines())
    }
    return _BenchRun(summary, results, journal, before, after, watch.worst_s)


def _stall_lag(run: _BenchRun) -> float:
    """The longest machine stall the run met: how late the bench client sent a request
    (its idle schedule is 2/s), or how late the test's own watch woke, whichever is more;
    the watch also covers the run's tail, after the last request was sent."""
    sent = max((r["lag_s"] for r in run.results if r["lag_s"] is not None), default=0.0)
    return max(sent, run.stall_s)


def _check_failures_are_journaled(run: _BenchRun) -> None:
    """Every scored request the client saw fail is accounted for in the journal.

    - A request answered with an HTTP status has a journal record with the same status,
      a failure class (never ``ok``, never ``internal_error``) and an error detail: a
      stall may fail a request, but never silently or unclassified.
    - A request whose connection never opened (``connect_error``: the router was frozen
      past the client's connect timeout) never reached the router, so it has no record.
    - A request the client gave up on before any response (``timeout``, or the
      connection lost) may not have been read by the router at all; if it was, its
      record carries a failure class and an error detail (``client_cancelled``, 499).
    """
    for r in run.results:
        if r["warmup"] or r["terminal_class"] == "ok":
            continue
        rec = run.journal.get(r["request_id"])
        if r["terminal_class"] == "connect_error":
            assert rec is None, f"a request that never connected was journaled: {r}, {rec}"
            continue
        if r["status"] is None and rec is None:
            continue
        assert rec is not None, f"no journal record for a failed request: {r}"
        if r["status"] is not None:
            assert rec["status"] == r["status"], (r, rec)
        assert rec["terminal_class"] not in ("ok", "internal_error"), (r, rec)
        assert rec["error"], (r, rec)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_bench_agrees_with_vllm_histograms(pair: RealPair, tmp_path: Path) -> None:
    """Client-side TTFT/TPOT of ``narwhal bench`` against vLLM's own histograms.

    Over the run, each engine's mean is the delta of ``_sum`` over the delta of
    ``_count`` of its ``vllm:*_seconds`` histograms; the router's journal (joined by
    ``x-request-id``) gives each request's placement wait, the time it queued in the
    router for a placement that meets the SLO, which no engine sees.

    - Accounting, exact: every request delivered the 16 tokens asked for, and the
      journal counted the same tokens as the client, request by request.
    - Causality: the client cannot see the last token before the producer's whole leg
      and the consumer's whole leg have run, one after the other: client latency minus
      placement wait is at least 90% of producer plus consumer end-to-end latency (10%
      slack: the legs are stamped by different processes).
    - TTFT: the client's TTFT spans the router's placement wait, the prefill leg on the
      producer (its TTFT: the one-token request), the handoff, and the consumer's TTFT
      (which includes the KV pull). Less the wait, it lies between 90% of producer +
      consumer TTFT and twice that plus 1 s: the router's hops and queueing on a loaded
      box (measured: client 718 ms, producer 210 + consumer 138 ms).
    - TPOT: vLLM stamps a request's tokens where its engine core makes them; the client
      sees them two hops later (router, bench client). A constant hop delay cancels
      between the first and the last token, but every hop costs CPU per token on a
      saturated two-core box (the NIXL progress threads spin a core each): measured +10
      ms on 43 ms (+24%). So the client's mean TPOT is at most 1.5x the consumer's plus
      5 ms. It is at least 0.8x, less what a late first token takes off: when the
      machine stalls the first token on its way out (the engine's API server, the
      router, the bench client) and the later ones catch up, the client's first-to-last
      span is shorter than the engine's by at most that lateness, which is the client's
      TTFT beyond the wait and the engines' TTFT, spread over ``n - 1`` intervals.

    A router that lost, duplicated or held back tokens, or a bench that mis-timed them,
    falls outside these bounds. The timing bounds need a run that no machine stall
    (docs/real-engines.md) touched: a run whose bench client sent a request, or whose
    test-side :class:`StallWatch` woke, more than :data:`STALL_LAG_S` late met one and
    runs again, up to three times; if all three did, the accounting and causality
    checks still apply (to the least-stalled run) and the test skips saying that the
    TTFT upper bound and the TPOT bounds were not checked. A stall can also fail
    requests (a health probe or a handoff's KV lease runs out while every process is
    frozen, or the client's connect timeout runs out before the frozen router accepts):
    a run with failures passes only when that lag shows a stall, and each failure must
    be accounted for in the journal (:func:`_check_failures_are_journaled`); when every
    run had them, the test skips saying so.
    """
    doc = _need("fleet")
    usable: list[_BenchRun] = []  # the runs whose 20 requests all delivered their tokens
    lag = 0.0
    for attempt in (1, 2, 3):
        run = _bench(pair, doc, tmp_path / f"attempt{attempt}")
        lag = _stall_lag(run)
        _check_failures_are_journaled(run)
        ok = run.summary["counts"]["ok"]
        # A failed request is the router's fault unless a machine stall explains it.
        assert ok == 20 or lag > STALL_LAG_S, (run.summary["counts"], lag)
        if ok == 20:
            usable.append(run)
            if lag <= STALL_LAG_S:
                break
        # The machine-wide stalls of docs/real-engines.md: health probes time out (the
        # router marks engines unreachable), a handoff outlives its KV lease, and every
        # process on the box, the bench client included, freezes for seconds, which
        # skews the timings of whatever was in flight. The bench client's own lag (how
        # late it sent requests on an idle 2/s schedule) shows such a stall. Not the
        # router's fault: run again.
        print(
            f"bench attempt {attempt}: {run.summary['counts']['by_class']}, bench client "
            f"or watch lag up to {lag:.2f} s (a machine stall when over {STALL_LAG_S} s); "
            "running again"
        )
    if not usable:
        pytest.skip(
            f"every bench run met a machine stall (lag up to {lag:.2f} s) that "
            "failed requests; each failure was accounted for in the journal, but "
            "accounting, causality and timing against vLLM's histograms were not checked"
        )
    run = min(usable, key=_stall_lag)
    lag = _stall_lag(run)
    scored = [r for r in run.results if not r["warmup"]]
    assert len(scored) == 20, [r["request_id"] for r in run.results]
    waits: list[float] = []
    for r in scored:
        rec = run.journal[r["request_id"]]
        assert r["output_len"] == OUTPUT_LEN and rec["output_len"] == OUTPUT_LEN, (r, rec)
        assert rec["terminal_class"] == "ok", rec
        waits.append(sum(a["placement_wait_s"] for a in rec["attempts"]))

    def engine_mean(name: str, role: str) -> float:
        total, n = _histogram_delta(run.before[role], run.after[role], name)
        assert n == 20, (role, name, total, n)
        return total / n

    producer_ttft = engine_mean("vllm:time_to_first_token_seconds", "producer")
    consumer_ttft = engine_mean("vllm:time_to_first_token_seconds", "consumer")
    producer_e2e = engine_mean("vllm:e2e_request_latency_seconds", "producer")
    consumer_e2e = engine_mean("vllm:e2e_request_latency_seconds", "consumer")
    vllm_tpot = engine_mean("vllm:request_time_per_output_token_seconds", "consumer")
    wait = _mean(waits)
    client_ttft = _mean([r["ttft_s"] for r in scored]) - wait
    client_e2e = _mean([r["latency_s"] for r in scored]) - wait
    client_tpot = _mean([r["tpot_s"] for r in scored])
    engines_ttft = producer_ttft + consumer_ttft
    first_token_lateness = max(0.0, client_ttft - engines_ttft)
    figures = {
        "placement_wait_mean_s": wait,
        "client_ttft_less_wait_mean_s": client_ttft,
        "producer_ttft_mean_s": producer_ttft,
        "consumer_ttft_mean_s": consumer_ttft,
        "client_e2e_less_wait_mean_s": client_e2e,
        "producer_e2e_mean_s": producer_e2e,
        "consumer_e2e_mean_s": consumer_e2e,
        "client_tpot_mean_s": client_tpot,
        "client_tpot_p50_s": run.summary["tpot_s"]["successes"]["p50"],
        "consumer_tpot_mean_s": vllm_tpot,
    }
    print(json.dumps(figures, indent=2))
    (tmp_path / "figures.json").write_text(json.dumps(figures, indent=2))
    assert client_e2e >= 0.9 * (producer_e2e + consumer_e2e), figures
    assert client_ttft >= 0.9 * engines_ttft, figures
    if lag > STALL_LAG_S:
        # Three runs in a row caught in machine stalls: the bounds below would measure
        # the machine. The accounting and causality checks above held; say so loudly.
        pytest.skip(
            f"accounting and causality held, but every bench run met a machine stall "
            f"(lag {lag:.2f} s): the TTFT upper bound and the TPOT bounds "
            "against vLLM's histograms were not checked"
        )
    assert client_ttft <= 2 * engines_ttft + 1.0, figures
    tpot_floor = 0.8 * vllm_tpot - first_token_lateness / (OUTPUT_LEN - 1)
    assert tpot_floor <= client_tpot <= 1.5 * vllm_tpot + 0.005, (tpot_floor, figures)


def test_check_fails_gate_f_after_a_restart(managed_pair: RealPair, tmp_path: Path) -> None:
    fleet_path: Path = _need("fleet_path")
    managed_pair.restart("consumer")
    assert managed_pair.healthy("consumer")
    done = _narwhal("check", "--fleet", str(fleet_path), cwd=tmp_path, timeout=300)
    print(done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    fails = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    gate = [line for line in fails if "gate_f.generation consumer" in line]
    assert gate, done.stdout
    assert "re-profile" in gate[0] and "refit" in gate[0], gate[0]
    assert not any("gate_f.generation producer" in line for line in fails), done.stdout
