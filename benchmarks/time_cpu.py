"""Step time on this machine: calibrate it (ledger/timing/calibrate.py), run a small CPU matrix of all
three frameworks (DP, TP, PP, ZeRO-3, FSDP) with the calibrated profile, and print predicted / measured
step time per job with the median and p90 of |error|. A benchmark, not a test: these machines are noisy.

    .venv/bin/python benchmarks/time_cpu.py [--profile PATH] [--keep DIR]

The jobs measure with the peak probe off and collectives recorded on step 0 and step COMM_STEP only (the
comm probe's dispatch mode slows the steps it records); steps 2.. but COMM_STEP are compared for the step
and its phases, and per dimension the collectives' time (issue to completion) and the part the rank
waited for on COMM_STEP (probes/comm_time.py) beside the prediction's comm_s / exposed_s
(analysis/timing.py)."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
COMM_STEP = 4
COMMON = ["model=tiny", "model.seq_len=128", "train.steps=6", "probe.peak=false", f"probe.comm_steps=[0,{COMM_STEP}]",
          "wandb.mode=disabled"]
SWEEPS = [
    ["framework=megatron", "cluster.ranks=2", "layout={},{tp:2},{pp:2}", "framework.use_distributed_optimizer=true"],
    ["framework=titan", "cluster.ranks=2", "layout={},{tp:2}"],
    ["framework=deepspeed", "cluster.ranks=2", "framework.zero_stage=1,3"],
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="a calibrated profile yaml (default: calibrate now)")
    ap.add_argument("--keep", help="run the sweeps here and keep them")
    a = ap.parse_args(argv)
    py = sys.executable
    root = a.keep or tempfile.mkdtemp(prefix="time_cpu_")
    os.makedirs(root, exist_ok=True)
    prof = a.profile or os.path.join(root, "cpu_profile.yaml")
    if not a.profile:
        subprocess.run([py, "-m", "ledger.timing.calibrate", "--out", prof], cwd=REPO, check=True)
    import records
    from analysis import timing

    out = []
    for i, sw in enumerate(SWEEPS):
        d = os.path.join(root, f"sweep{i}")
        subprocess.run([py, "launch.py", "-m", *COMMON, *sw, f"hardware.file={prof}", f"hydra.sweep.dir={d}"],
                       cwd=REPO, check=False, stdout=subprocess.DEVNULL)
        for rec in records.load(d):
            s = timing.job_summary(rec, skip_steps=2, comm_steps=(COMM_STEP,))
            if s:
                out.append(s)
    # per phase: predicted / measured seconds of the slowest rank (probes/phases.py); the rest of the
    # measured step is neither (the frameworks' bookkeeping, data, waits outside a model chunk)
    print(f"{'job':<32} {'predicted s':>12} {'measured s':>11} {'error':>8}   forward p/m       backward p/m      "
          f"optimizer p/m     other m")
    for s in out:
        ph = "  ".join(f"{s.get('predicted_' + q, 0):.4f}/{s.get('measured_' + q, 0):.4f}"
                       for q in timing.PHASES)
        other = s["measured_s"] - sum(s.get("measured_" + q, 0) for q in timing.PHASES)
        print(f"{s['framework'] + ' ' + s['layout']:<32} {s['predicted_s']:>12.4f} {s['measured_s']:>11.4f} "
              f"{100 * s['rel_err']:>7.1f}%   {ph}   {other:.4f}")
    print(f"\n{'job':<32} {'dim':<8} {'comm p/m s':>18} {'error':>8}   {'exposed p/m s':>18} {'error':>8}")
    comm_errs = []
    for s in out:
        for dim, c in sorted((s.get("comm") or {}).items()):
            cells = []
            for q in ("comm", "exposed"):
                p, m = c.get(f"predicted_{q}_s"), c.get(f"measured_{q}_s")
                err = (p - m) / m if p is not None and m else None
                if q == "comm" and err is not None:
                    comm_errs.append(abs(err))
                cells.append(f"{'-' if p is None else f'{p:.4f}':>8}/{'-' if m is None else f'{m:.4f}':<9} "
                             f"{'-' if err is None else f'{100 * err:.1f}%':>8}")
            print(f"{s['framework'] + ' ' + s['layout']:<32} {dim:<8} {cells[0]}   {cells[1]}")
    if comm_errs:
        comm_errs.sort()
        print(f"{len(comm_errs)} job dims: collectives' time median |error| {100 * statistics.median(comm_errs):.1f}%")
    if out:
        errs = sorted(abs(s["rel_err"]) for s in out)
        print(f"\n{len(out)} jobs: median |error| {100 * statistics.median(errs):.1f}%, "
              f"p90 {100 * errs[int(0.9 * (len(errs) - 1))]:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
