"""Dispatch cost on Slurm: N predict-only jobs through Hydra + submitit versus one `sbatch --array`.

    make slurm-up && .venv/bin/python benchmarks/dispatch.py [--jobs 100]

Both sides run the same work per job (`launch.py mode=predict` of one layout, one Slurm task):
  - train-ledger: `launch.py -m mode=predict layout.micro_batch_size=1,...` with
    hydra/launcher=submitit_slurm cluster=local_slurm cluster.ranks=1 (validation, a submitit array,
    results collected, records written);
  - baseline: one `sbatch --array=0-(N-1)` whose tasks run the same predict command, waited for with
    `squeue`.
Prints both wall times (submission to the last job finished) and their ratio.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import records  # noqa: E402

# one predict-only job: Llama-3-8B, Megatron TP8 (the same work on both sides)
JOB = ["framework=megatron", "model=llama3_8b", "layout.tp=8", "layout.dp=1", "layout.sequence_parallel=true"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=100)
    a = ap.parse_args()
    env = dict(os.environ, SLURM_CONF=os.path.join(REPO, ".slurm/etc/slurm.conf"), WANDB_MODE="disabled")
    values = ",".join(str(i) for i in range(1, a.jobs + 1))
    os.makedirs(os.path.join(REPO, "multirun"), exist_ok=True)
    # under the repo (git-ignored multirun/): Slurm tasks must see it, as on a cluster's shared filesystem
    with tempfile.TemporaryDirectory(dir=os.path.join(REPO, "multirun"), prefix="bench-dispatch-") as d:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "launch.py", "-m", "mode=predict", "wandb.mode=disabled",
                            *JOB,
                            f"train.seed={values}", "hydra/launcher=submitit_slurm", "cluster=local_slurm",
                            "cluster.ranks=1", "cluster.gpus_per_node=null", f"hydra.sweep.dir={d}/sweep"],
                           cwd=REPO, env=env, capture_output=True, text=True)
        ours = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(p.stderr[-3000:])
        recs = records.load(os.path.join(d, "sweep"))
        bad = [r["error"] for r in recs if r["status"] != "ok"]
        if len(recs) != a.jobs or bad:
            raise SystemExit(f"{len(recs)} records, not ok: {bad[:3]}")
        script = os.path.join(d, "array.sh")
        with open(script, "w") as f:
            f.write(f"#!/bin/bash\n#SBATCH --partition=gpu --ntasks=1 --cpus-per-task=1 --mem=1G "
                    f"--output={d}/arr_%a.out\ncd {REPO}\n{sys.executable} launch.py mode=predict "
                    f"wandb.mode=disabled {' '.join(JOB)} "
                    f"train.seed=$SLURM_ARRAY_TASK_ID hydra.run.dir={d}/arr/$SLURM_ARRAY_TASK_ID\n")
        t0 = time.perf_counter()
        out = subprocess.run(["sbatch", "--parsable", f"--array=0-{a.jobs - 1}", script], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
        job = out.split(";")[0]
        while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip():
            time.sleep(0.5)
        base = time.perf_counter() - t0
    print(f"{a.jobs} predict-only jobs: train-ledger (hydra + submitit) {ours:.1f} s, one sbatch --array "
          f"{base:.1f} s, ratio {ours / base:.2f}")


if __name__ == "__main__":
    main()
