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

import pytest

from .kit import RealPair, RouterProcess

pytestmark = pytest.mark.real_engine

ENGINES = ("producer", "consumer")
#: The sweep: the tiny model's prompts stay short on two cores; three prefill lengths,
#: two decode input lengths and three concurrencies are the fewest the fits accept.
SWEEP = [
    "--prefill-lens", "64,256,512",
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


def _worst_decode_error(profiles: dict[str, Any]) -> float:
    return max(
        max(e["decode"]["fit_mape"], e["decode"]["cv_mape"]) for e in profiles["engines"].values()
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
            print(f"profile attempt {attempt}: a fit was REJECTED (exit 1), raw data kept in "
                  f"{sidecar}:\n{report}")
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
    print(f"decode fit_mape {fits}, cv_mape {cvs}")
    assert max(fits) <= FIT_LIMIT_CEILING and max(cvs) <= FIT_LIMIT_CEILING, (fits, cvs)
    # Limits from the measurement, with headroom for the next check's noise-free reread
    # (the fits do not change) and never tighter than the shipped defaults.
    fit_limit = max(0.05, _round_up(1.5 * max(fits)))
    cv_limit = max(0.13, _round_up(1.5 * max(cvs)))
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


def _bench(
    pair: RealPair, doc: dict[str, Any], work: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One bench run through a fresh router; its summary and the engines' scrapes."""
    router = RouterProcess(doc, work / "router")
    router.start()
    try:
        before = {n: pair.metrics(n) for n in ENGINES}
        done = _narwhal(
            "bench", "--url", router.url, "--out", str(work / "bench"),
            "--rate", "2", "--num-requests", "20", "--input-len", "100",
            "--output-len", "16", "--slo-ttft", "2s", "--slo-tpot", "200ms",
            "--no-progress",
            cwd=work, timeout=300,
        )  # fmt: skip
        after = {n: pair.metrics(n) for n in ENGINES}
    finally:
        status = router.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    assert status == 0, router.log()[-3000:]
    summary = json.loads((work / "bench" / "summary.json").read_text())
    return summary, before, after


def test_bench_agrees_with_vllm_histograms(pair: RealPair, tmp_path: Path) -> None:
    """Client-side TTFT/TPOT of ``narwhal bench`` against vLLM's own histograms.

    Over the run, each engine's mean is the delta of ``_sum`` over the delta of
    ``_count`` of ``vllm:time_to_first_token_seconds`` and
    ``vllm:request_time_per_output_token_seconds``.

    - TPOT: the consumer generates every output token (vLLM: last minus first token
      time at its API server over n - 1), and the client sees the same tokens after
      two more hops (router, bench client). A constant hop delay cancels between the
      first and the last token, but on a saturated two-core box (the NIXL progress
      threads spin a core each) every hop also costs CPU time per token, queued behind
      the engines: measured +10 ms on 43 ms (+24%). So the client mean TPOT must lie
      between 0.8x and 1.5x the consumer's mean plus 5 ms; a router that lost or
      duplicated tokens, or mis-timed the stream, would be well outside.
    - TTFT: the client's TTFT spans the router's tokenize, the whole prefill leg on the
      producer (its TTFT: the one-token request), the handoff, and the consumer's TTFT
      (which includes the KV pull); each engine's clock starts only when its API
      server has the request. So the client mean must be at least 90% of producer +
      consumer mean (10% slack: the legs' ends are stamped by different processes), and
      at most that sum times 2 plus 1 s: the router's hops and queueing on a loaded box
      (measured: client 718 ms, producer 210 + consumer 138 ms).
    """
    doc = _need("fleet")
    for attempt in (1, 2):
        summary, before, after = _bench(pair, doc, tmp_path / f"attempt{attempt}")
        if summary["counts"]["ok"] == 20:
            break
        # The machine-wide stalls of docs/real-engines.md (health probes time out, the
        # router marks engines unreachable): not the router's fault; one more run.
        print(f"bench attempt {attempt}: {summary['counts']['by_class']}; retrying once")
    assert summary["counts"]["ok"] == 20, summary["counts"]
    client_ttft = summary["ttft_s"]["successes"]["mean"]
    client_tpot = summary["tpot_s"]["successes"]["mean"]
    ttft = {
        n: _histogram_delta(before[n], after[n], "vllm:time_to_first_token_seconds")
        for n in ENGINES
    }
    tpot_sum, tpot_n = _histogram_delta(
        before["consumer"], after["consumer"], "vllm:request_time_per_output_token_seconds"
    )
    assert ttft["producer"][1] == 20 and ttft["consumer"][1] == 20, ttft
    assert tpot_n == 20, (tpot_sum, tpot_n)
    producer_ttft = ttft["producer"][0] / 20
    consumer_ttft = ttft["consumer"][0] / 20
    vllm_tpot = tpot_sum / tpot_n
    figures = {
        "client_ttft_mean_s": client_ttft,
        "client_ttft_p50_s": summary["ttft_s"]["successes"]["p50"],
        "producer_ttft_mean_s": producer_ttft,
        "consumer_ttft_mean_s": consumer_ttft,
        "client_tpot_mean_s": client_tpot,
        "client_tpot_p50_s": summary["tpot_s"]["successes"]["p50"],
        "consumer_tpot_mean_s": vllm_tpot,
    }
    print(json.dumps(figures, indent=2))
    (tmp_path / "figures.json").write_text(json.dumps(figures, indent=2))
    assert 0.8 * vllm_tpot <= client_tpot <= 1.5 * vllm_tpot + 0.005, figures
    engines_ttft = producer_ttft + consumer_ttft
    assert 0.9 * engines_ttft <= client_ttft <= 2 * engines_ttft + 1.0, figures


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
