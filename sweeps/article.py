"""The design article's three 8-GPU runs (chapter 7), Llama-3.2-1B shape, s = 8192:

  megatron   TP2 x PP2 x DP2, distributed optimizer (ZeRO-1), SP, micro 1, global 16 (m = 8)
  deepspeed  ZeRO-3, DP8, micro 1, 2 accumulation steps (global 16)
  titan      FSDP4 x TP2 (+SP, torchtitan's default), local batch 2 (global 8), reshard after forward

    python -m sweeps.article [--mode predict|dry|run|fake] [--ledger faithful|textbook] [--out DIR] [OVERRIDE ...]

predict (default) prints each run's per-rank table and writes prediction.json; dry writes the
framework-native artifacts (run.sh, ds_config.json, the torchtitan module) for a GPU cluster; run
needs 8 GPUs (e.g. cluster=local_gpu, or a Slurm cluster config plus hydra/launcher=submitit_slurm);
fake runs the three on this machine at full shape (cluster=fake: a fake world of 8, the ranks of
each distinct predicted state materialised one after another under FakeTensorMode, two steps:
first and steady) and prints their reconcile table, every step. Extra overrides apply to all three
jobs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMON = ["model=llama3_1b", "model.seq_len=8192"]
RUNS = {
    "megatron": ["framework=megatron", "framework.overlap_grad_reduce=true", "layout.tp=2", "layout.pp=2",
                 "layout.dp=2", "layout.sequence_parallel=true", "layout.micro_batch_size=1",
                 "layout.global_batch_size=16"],
    # as the article's ds_config.json (prefetch bucket 5e7, smaller than the model: the faithful ledger
    # replays DeepSpeed's parameter coordinator for it; two accumulation steps)
    "deepspeed": ["framework=deepspeed", "framework.zero_stage=3", "framework.reduce_bucket_size=50000000",
                  "framework.stage3_prefetch_bucket_size=50000000", "framework.overlap_comm=true",
                  "layout.dp=8", "layout.micro_batch_size=1", "layout.global_batch_size=16"],
    # torchtitan's TP runs with sequence parallelism unless told otherwise (config/configs.py
    # ParallelismConfig.enable_sequence_parallel = True, layout.sequence_parallel's default for it too);
    # set here as the article's run says it
    "titan": ["framework=titan", "layout.tp=2", "layout.dp=4", "layout.sequence_parallel=true",
              "layout.micro_batch_size=2", "layout.global_batch_size=8"],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.article", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("predict", "dry", "run", "fake"), default="predict")
    ap.add_argument("--ledger", choices=("faithful", "textbook"), default="faithful")
    ap.add_argument("--out", default=os.path.join("multirun", "article", time.strftime("%Y-%m-%d_%H-%M-%S")))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    rc = 0
    for i, (name, ov) in enumerate(RUNS.items()):
        job_dir = os.path.join(a.out, f"{i}_{name}")
        # fake: a real run's mode on the fake cluster; two steps are the first and a steady one (the
        # DeepSpeed run's two micro-batches complete ZeRO-3's trace inside step 0)
        mode = ["mode=run", "cluster=fake", "train.steps=2"] if a.mode == "fake" else [f"mode={a.mode}"]
        cmd = [sys.executable, "launch.py", *mode, f"ledger.mode={a.ledger}", *COMMON, *ov,
               *a.overrides, f"hydra.run.dir={job_dir}"]
        print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
        rc |= subprocess.run(cmd, cwd=REPO).returncode
    print(f"records under {a.out}; table: python -m analysis.reconcile {a.out}")
    if a.mode == "fake":
        from analysis import reconcile

        reconcile.main([a.out, "--all-steps"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
