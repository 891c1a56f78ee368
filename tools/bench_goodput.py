"""Goodput under an SLO on a heterogeneous simulated fleet: Narwhal against vllm-router.

Starts a heterogeneous simulated fleet on loopback (``narwhal sim``: a fast and a slow
producer, a fast and a slow consumer), profiles it with ``narwhal profile`` (a small
sweep), then for each offered request rate runs ``narwhal bench`` (Poisson arrivals,
open loop) against:

- Narwhal with profile-priced placement (``profiles.path`` set, admission ``refuse``),
- Narwhal least-loaded (no profiles),
- vllm-router in PD mode with ``--policy round_robin``, when a ``vllm-router``
  executable is found (``--vllm-router PATH`` or on PATH),

and reports SLO attainment per rate (refused and failed requests count as misses) and
goodput at 90% attainment (the highest offered rate whose attainment is at least 0.9,
times that attainment). Writes JSON, and a PNG of attainment against offered rate
when matplotlib is installed (``pip install 'narwhal[plot]'``).

    python tools/bench_goodput.py --rates 4,8,12,16 --requests 200 --out runs/goodput.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from proctools import free_port, start, stop, wait_http

SLO = {"ttft_ms": 150, "tpot_ms": 10}
PROMPT = "uniform:150:250"
OUTPUT = "uniform:20:60"










def narwhal(*args: str) -> list[str]:
    return [sys.executable, "-m", "narwhal", "--log-level", "WARNING", *args]


def fleet(ports: dict[str, int]) -> list[dict[str, Any]]:
    def eng(name: str, role: str, prefill: dict[str, float], decode: dict[str, float]) -> dict[str, Any]:
        return {
            "name": name, "url": f"http://127.0.0.1:{ports[name]}", "roles": [role], "model": "sim-llama",
            "connector": {"type": "NixlConnector", "kv_host": "127.0.0.1", "kv_port": ports[name + "-kv"]},
            "sim": {"model": "sim-llama", "prefill": prefill, "decode": decode, "noise": 0.01, "seed": len(name)},
        }  # fmt: skip

    fast_decode = {"c0": 0.004, "c1": 0.0002, "c2": 1e-7}
    return [
        eng("p-fast", "prefill", {"a": 0.010, "b": 1e-4, "c": 0.0}, fast_decode),
        eng("p-slow", "prefill", {"a": 0.030, "b": 3e-4, "c": 0.0}, fast_decode),
        eng("d-fast", "decode", {"a": 0.010, "b": 1e-4, "c": 0.0}, fast_decode),
        eng("d-slow", "decode", {"a": 0.010, "b": 1e-4, "c": 0.0}, {"c0": 0.012, "c1": 0.0006, "c2": 3e-7}),
    ]


def bench(url: str, rate: float, n: int, out: Path) -> dict[str, Any]:
    subprocess.run(
        narwhal("bench", "--url", url, "--out", str(out), "--overwrite", "--rate", str(rate), "--num-requests",
                str(n), "--input-len", PROMPT, "--output-len", OUTPUT, "--seed", "1", "--no-progress",
                "--slo-ttft", f"{SLO['ttft_ms']}ms", "--slo-tpot", f"{SLO['tpot_ms']}ms", "--model", "sim-llama"),
        check=True, capture_output=True,
    )  # fmt: skip
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="4,8,12,16,20")
    parser.add_argument("--requests", type=int, default=200, help="requests per rate and router")
    parser.add_argument("--out", default="runs/goodput.json")
    parser.add_argument("--vllm-router", help="path of the vllm-router executable")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    vr = args.vllm_router or shutil.which("vllm-router")
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-goodput-"))
    names = ["p-fast", "p-slow", "d-fast", "d-slow"]
    ports = {k: free_port() for k in [*names, *(n + "-kv" for n in names), "priced", "least", "vr", "a1", "a2"]}
    engines = fleet(ports)
    (tmp / "sim.json").write_text(json.dumps({"engines": engines}))
    plain = [{k: v for k, v in e.items() if k != "sim"} for e in engines]
    base = {"engines": plain, "engine": {"first_token_timeout_s": 30, "decode_read_timeout_s": 30}}

    def router_doc(port: int, admin: int, journal: str, **extra: Any) -> Path:
        doc = {**base, "server": {"host": "127.0.0.1", "port": port, "admin_port": admin,
                                  "max_concurrent_requests": 100000},
               "journal": {"path": str(tmp / journal), "fsync": False}, **extra}  # fmt: skip
        path = tmp / f"{journal}.fleet.json"
        path.write_text(json.dumps(doc))
        return path

    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        procs.append(start(narwhal("sim", "--fleet", str(tmp / "sim.json")), tmp / "sim.log"))
        for e in engines:
            wait_http(e["url"] + "/health")
        profiles = tmp / "profiles.json"
        print("profiling the fleet (narwhal profile) ...", file=sys.stderr, flush=True)
        subprocess.run(
            narwhal("profile", "--fleet", str(router_doc(ports["least"], ports["a2"], "profile")),
                    "--prefill-lens", "64,128,256,512", "--decode-input-lens", "128,512", "--decode-concurrency", "1,4,8",
                    "--repeats", "3", "--out", str(profiles), "--quiet"),
            check=True, capture_output=True,
        )  # fmt: skip
        slo = {"ttft_s": SLO["ttft_ms"] / 1000, "tpot_s": SLO["tpot_ms"] / 1000}
        priced_doc = router_doc(ports["priced"], ports["a1"], "priced", profiles={"path": str(profiles)},
                                controller={"slo": slo, "admission": "refuse"})  # fmt: skip
        least_doc = router_doc(ports["least"], ports["a2"], "least")
        targets = {
            "narwhal-priced": (priced_doc, ports["priced"]),
            "narwhal-least-loaded": (least_doc, ports["least"]),
        }
        for name, (doc, port) in targets.items():
            procs.append(start(narwhal("serve", "--fleet", str(doc)), tmp / f"{name}.log"))
            wait_http(f"http://127.0.0.1:{port}/health")
        urls = {name: f"http://127.0.0.1:{port}" for name, (_, port) in targets.items()}
        if vr:
            cmd = [vr, "--vllm-pd-disaggregation", "--policy", "round_robin", "--host", "127.0.0.1",
                   "--port", str(ports["vr"]), "--prometheus-port", str(free_port())]  # fmt: skip
            for p in engines[:2]:
                cmd += ["--prefill", p["url"]]
            for d in engines[2:]:
                cmd += ["--decode", d["url"]]
            procs.append(start(cmd, tmp / "vllm-router.log"))
            wait_http(f"http://127.0.0.1:{ports['vr']}/health")
            urls["vllm-router"] = f"http://127.0.0.1:{ports['vr']}"
        for rate in rates:
            for name, url in urls.items():
                summary = bench(url, rate, args.requests, tmp / f"{name}-{rate:g}")
                both = summary["attainment"]["both"]
                results.setdefault(name, []).append(
                    {"rate": rate, "attainment": both["ratio"], "goodput_rps": summary["goodput_rps"],
                     "by_class": summary["counts"]["by_class"]}
                )
                print(f"  {name:<22} rate {rate:>5g}/s  attainment {both['ratio']:.3f}", file=sys.stderr, flush=True)
    finally:
        for proc in reversed(procs):
            stop(proc)

    report: dict[str, Any] = {"slo": SLO, "prompt": PROMPT, "output": OUTPUT, "requests_per_point": args.requests,
                              "machine": {"cpus": os.cpu_count()}, "routers": {}}  # fmt: skip
    print(f"\nSLO: TTFT {SLO['ttft_ms']} ms, TPOT {SLO['tpot_ms']} ms; prompts {PROMPT}, outputs {OUTPUT}\n")
    print(f"{'router':<22}" + "".join(f"{r:>9g}/s" for r in rates) + "   goodput@90%")
    for name, points in results.items():
        ok = [p for p in points if p["attainment"] >= 0.9]
        goodput = max((p["rate"] * p["attainment"] for p in ok), default=0.0)
        report["routers"][name] = {"points": points, "goodput_at_90": goodput}
        print(f"{name:<22}" + "".join(f"{p['attainment']:>11.3f}" for p in points) + f"   {goodput:.2f} req/s")
    routers = report["routers"]
    if "narwhal-priced" in routers:
        g = routers["narwhal-priced"]["goodput_at_90"]
        for other in ("narwhal-least-loaded", "vllm-router"):
            if other in routers and routers[other]["goodput_at_90"] > 0:
                print(f"narwhal-priced / {other}: x{g / routers[other]['goodput_at_90']:.2f}")
            elif other in routers:
                print(f"narwhal-priced / {other}: {other} never reached 90% attainment")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, data in routers.items():
            ax.plot([p["rate"] for p in data["points"]], [p["attainment"] for p in data["points"]], marker="o", label=name)
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=1, label="90% attainment")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.05)
        ax.legend()
        ax.set_title("SLO attainment on a heterogeneous fleet")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        print(f"plot: {out.with_suffix('.png')}")
    except ImportError:
        pass
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
