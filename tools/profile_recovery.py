"""How well `narwhal profile` recovers the embedded simulated fleet's latency models.

Runs the profiler in virtual time against the default fleet (config/fleet.sim.json) in
memory and prints each fitted coefficient's relative error against the configured one.

    python tools/profile_recovery.py
"""
import io
import json
import tempfile
from pathlib import Path

import trio
import trio.testing

from narwhal.cli import default_fleet_path
from narwhal.config import load_fleet
from narwhal.profile.progress import Progress
from narwhal.profile.runner import ProfileSettings, run_profile
from narwhal.testing import open_memory_network, open_sim_fleet


async def main():
    config = load_fleet(default_fleet_path())
    out = Path(tempfile.mkdtemp()) / "profiles.json"
    settings = ProfileSettings(prefill_lens=(128, 512, 1024, 2048, 3072), decode_input_lens=(256, 1024, 2048),
                               decode_concurrency=(1, 4, 8, 16), out=str(out), seed=1)
    async with open_memory_network() as net, open_sim_fleet(config, network=net):
        await run_profile(config, settings, transport=net.wire_transport(), progress=Progress(stream=io.StringIO()))
    prof = json.loads(out.read_text())
    for e in config.engines:
        p = prof["engines"][e.name]
        t, d = p["ttft"], p["decode"]
        sp, sd = e.sim.prefill, e.sim.decode
        def rel(a, b): return (a - b) / b if b else float("nan")
        print(f"{e.name}: ttft a {rel(t['a'], sp.a):+.3f} b {rel(t['b'], sp.b):+.3f} c {rel(t['c'], sp.c):+.3f} "
              f"(mean err {t['mean_error']:.4f}); decode c0 {rel(d['c0'], sd.c0):+.3f} c1 {rel(d['c1'], sd.c1):+.3f} "
              f"c2 {rel(d['c2'], sd.c2):+.3f} fit_mape {d['fit_mape']:.4f} cv_mape {d['cv_mape']:.4f}")
trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
