"""Probe overhead: step time with probes / without (outside recording windows: target <= 1.02), and
the peak probe's, which records every operator of every step (printed, no target yet).

    .venv/bin/python benchmarks/probe_overhead.py [--framework deepspeed] [--steps 30]

Runs the same real job four times on the local CPU cluster: with the probes off; with the memory
probe on and the comm probe recording step 0 only (its TorchDispatchMode is then inactive for the
steps that are timed), the peak probe off; with the peak probe on as well; and with the defaults (the
comm probe every step too, through the peak probe's dispatch mode). Compares the median step time of steps 5.. (warm) and prints the
ratio. Each step's time is taken inside ProbeSession.step, which both runs share.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def median_step(framework: str, steps: int, probes: bool, out: str, peak: bool = False,
                every_step_comm: bool = False) -> float:
    args = [sys.executable, "launch.py", f"framework={framework}", f"train.steps={steps}", f"hydra.run.dir={out}",
            "wandb.mode=disabled", f"probe.peak={str(peak).lower()}"]
    if not probes:
        args += ["probe.memory=false", "probe.comm=false"]
    elif not every_step_comm:
        args += ["probe.comm_steps=[0]"]
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="disabled"))
    if p.returncode != 0:
        raise SystemExit(f"run failed: {p.stderr[-2000:]}")
    rec = json.load(open(os.path.join(out, "record.json")))
    times = [s["time_s"] for r in rec["measurement"]["ranks"] for s in r["steps"] if s["step"] >= 5]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", default="deepspeed")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        off = median_step(a.framework, a.steps, False, os.path.join(d, "off"))
        on = median_step(a.framework, a.steps, True, os.path.join(d, "on"))
        peak = median_step(a.framework, a.steps, True, os.path.join(d, "peak"), peak=True)
        # the default (what the tests and a plain run record): both probes every step, through one
        # dispatch mode (probes/session.py)
        default = median_step(a.framework, a.steps, True, os.path.join(d, "default"), peak=True, every_step_comm=True)
    print(f"{a.framework}: median step {off * 1e3:.1f} ms without probes, {on * 1e3:.1f} ms with probes "
          f"(comm recording off after step 0, peak probe off): ratio {on / off:.3f} (target <= 1.02)")
    print(f"{a.framework}: with the peak probe too (every operator of every step): {peak * 1e3:.1f} ms, "
          f"ratio {peak / off:.3f}")
    print(f"{a.framework}: the default probes (comm and peak every step): {default * 1e3:.1f} ms, "
          f"ratio {default / off:.3f}")


if __name__ == "__main__":
    main()
