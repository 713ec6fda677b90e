"""How fast the planner plans: every layout of llama3_405b on 16,384 GPUs for all three frameworks.

    .venv/bin/python benchmarks/plan_speed.py [--repeat 3] [--files]

The search is ledger/plan.py's (what `mode=plan framework=all` runs): plan.* at its defaults
(tp inside 8-GPU nodes, pp up to the layers, cp up to 8, vp 1 and 2, Megatron's uneven splits,
torchtitan's dp_replicate, DeepSpeed's ZeRO stages 1-3, sequence parallel on and off) with
micro-batch sizes 1-4, global batch 16M tokens (2,048 sequences of 8,192), 80 GB GPUs, recompute none,
selective and full (plan.recompute's default). Printed: layouts evaluated
(predicted or refused with the ledger's reason), layouts per second and the total, best of
--repeat runs from cold ledger caches; --files adds the whole job (per-stage detail of the top
rows, plan.json, plan.csv, the plot) into a temporary directory; --workers N spreads the search over N forked
processes (plan.workers). Target: under 10 s on one core.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core: numpy's BLAS threads off
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.ledger_speed import _clear_caches  # noqa: E402

TARGET_S = 10.0
OVERRIDES = ["mode=plan", "model=llama3_405b", "plan.gpus=16384", "plan.gpus_per_node=8", "plan.gpu_memory_gb=80",
             "plan.global_batch_tokens=16777216", "framework=all", "plan.micro_batch_sizes=[1,2,3,4]",
             "wandb.mode=disabled"]


def compose(extra=()):
    from hydra import compose as _compose, initialize_config_dir

    from conf.schema import register

    register()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with initialize_config_dir(config_dir=os.path.join(repo, "conf"), version_base="1.3"):
        return _compose(config_name="config", overrides=[*OVERRIDES, *extra])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--files", action="store_true", help="also time the whole job with its files")
    ap.add_argument("--workers", type=int, default=1, help="processes the search spreads over (plan.workers)")
    args = ap.parse_args()
    from launchers.plan import framework_bases, hardware, space
    from ledger.model import ModelShape
    from ledger.plan import search

    cfg = compose()
    model, hw, sp, bases = ModelShape.from_config(cfg.model), hardware(cfg.plan, cfg.hardware), space(cfg), framework_bases(cfg)
    runs = []
    for _ in range(args.repeat):
        _clear_caches()
        t0 = time.perf_counter()
        plan = search(model, hw, sp, bases, workers=args.workers)
        runs.append((time.perf_counter() - t0, plan))
    dt, plan = min(runs, key=lambda r: r[0])
    n = sum(c["layouts"] for c in plan.counts.values())
    print(f"llama3_405b on 16,384 GPUs, all three frameworks, micro-batch 1-4 (best of {args.repeat}, cold caches, "
          f"{args.workers} process{'es' if args.workers > 1 else ''}):")
    for fw, c in plan.counts.items():
        print(f"  {fw:9s} {c['layouts']:6,} layouts: {c['fits']:4,} fit, {c['too_big']:4,} too big, "
              f"{c['refused']:6,} refused")
    print(f"  {n:,} layouts in {dt:.2f} s: {n / dt:,.0f} layouts/s; target {TARGET_S:.0f} s: ratio {dt / TARGET_S:.3f}")
    if args.files:
        from launchers.job import run_job

        with tempfile.TemporaryDirectory() as d:
            job = compose([f"plan.sweep_dir={os.path.join(d, 'sweeps')}", f"plan.workers={args.workers}"])
            _clear_caches()
            t0 = time.perf_counter()
            import contextlib
            import io

            with contextlib.redirect_stdout(io.StringIO()):
                rec = run_job(job, os.path.join(d, "job"))
            print(f"  the whole job (search + per-stage detail + plan.json {os.path.getsize(os.path.join(d, 'job', 'plan.json')) / 1e6:.1f} MB "
                  f"+ plan.csv + plot + sweep): {time.perf_counter() - t0:.2f} s ({rec['status']})")


if __name__ == "__main__":
    main()
