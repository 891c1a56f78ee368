"""How well `narwhal profile` recovers the embedded simulated fleet's latency models.

Runs the profiler in virtual time against the default fleet (config/fleet.sim.json) in
memory and prints each fitted coefficient's relative error against the configured one:
the TTFT curve of every engine, and the decode model of the engines that decode (the
profiler measures decode only there). A few seconds; CI runs it as it is. It exits 1
when an engine lacks the model its roles call for; the errors never decide it.

    python tools/profile_recovery.py
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

import trio
import trio.testing

from narwhal.cli import default_fleet_path
from narwhal.config import load_fleet
from narwhal.profile.progress import Progress
from narwhal.profile.runner import ProfileSettings, run_profile
from narwhal.testing import open_memory_network, open_sim_fleet


def rel(fitted: float, configured: float) -> float:
    return (fitted - configured) / configured if configured else float("nan")


async def main() -> int:
    config = load_fleet(default_fleet_path())
    out = Path(tempfile.mkdtemp()) / "profiles.json"
    settings = ProfileSettings(prefill_lens=(128, 512, 1024, 2048, 3072), decode_input_lens=(256, 1024, 2048),
                               decode_concurrency=(1, 4, 8, 16), out=str(out), seed=1)  # fmt: skip
    async with open_memory_network() as net, open_sim_fleet(config, network=net):
        await run_profile(config, settings, transport=net.wire_transport(), progress=Progress(stream=io.StringIO()))
    prof = json.loads(out.read_text())
    missing = []
    for e in config.engines:
        p = prof["engines"].get(e.name) or {}
        t, d = p.get("ttft"), p.get("decode")
        sim = e.sim
        line = f"{e.name}:"
        if sim is None:
            missing.append(f"{e.name}: not simulated, nothing to compare with")
            continue
        if t is None:
            missing.append(f"{e.name}: no TTFT curve")
        else:
            sp = sim.prefill
            line += (f" ttft a {rel(t['a'], sp.a):+.3f} b {rel(t['b'], sp.b):+.3f} c {rel(t['c'], sp.c):+.3f}"
                     f" (mean err {t['mean_error']:.4f})")  # fmt: skip
        if d is not None:
            sd = sim.decode
            line += (f"; decode c0 {rel(d['c0'], sd.c0):+.3f} c1 {rel(d['c1'], sd.c1):+.3f} c2 {rel(d['c2'], sd.c2):+.3f}"
                     f" fit_mape {d['fit_mape']:.4f} cv_mape {d['cv_mape']:.4f}")  # fmt: skip
        elif "decode" in e.roles:
            missing.append(f"{e.name}: decodes, and has no decode model")
        print(line)
    for why in missing:
        print(f"FAILED: {why}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)))
