"""The size goals: any `mode=predict` up to a million GPUs in under 10 s and 1 GiB, any plan up to
100,000 GPUs in under 30 s, and the corners past ledger/limits.py's bounds refused at once.

    .venv/bin/python benchmarks/size_goals.py [--only NAME]

Each case is the whole `launch.py` process (Hydra, imports, the ledger, the table, prediction.json or
the plan's files; W&B off) into a temporary job dir, timed by wall clock, its peak RSS read from the
kernel (wait4). Printed per case: seconds, MB, the output's size, the exit code, and the ratio to the
goal (<= 1 meets it). The corners are the ones a careless command reaches: a world of a million
GPUs on every framework (Megatron's distributed optimizer over 16,384 DP ranks, torchtitan's FSDP over
a million), ZeRO-3 and pipeline schedules at the micro-batch bound, a thousand layers, and the GPU
counts below the plan bound with the most divisors (110,880 has 144); last, how long a prediction takes to
exit after a SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREDICT_S, PREDICT_MB, PLAN_S, SIGTERM_S = 10.0, 1024.0, 30.0, 2.0
LLAMA = ["model=llama3_8b"]
CASES = {
    "megatron-1M-distopt": (["framework=megatron", *LLAMA, "layout.tp=8", "layout.pp=8", "layout.dp=16384",
                             "framework.use_distributed_optimizer=true"], PREDICT_S),
    "megatron-1M-ddp": (["framework=megatron", *LLAMA, "layout.tp=8", "layout.pp=8", "layout.dp=16384"], PREDICT_S),
    "megatron-dp1M-distopt": (["framework=megatron", *LLAMA, "layout.dp=1048576",
                               "framework.use_distributed_optimizer=true"], PREDICT_S),
    "titan-dp1M": (["framework=titan", *LLAMA, "layout.dp=1048576"], PREDICT_S),
    "titan-tp8-dp128k": (["framework=titan", *LLAMA, "layout.tp=8", "layout.dp=131072"], PREDICT_S),
    "deepspeed-z1-dp1M": (["framework=deepspeed", *LLAMA, "framework.zero_stage=1", "layout.dp=1048576"], PREDICT_S),
    "deepspeed-z3-dp1M": (["framework=deepspeed", *LLAMA, "framework.zero_stage=3", "layout.dp=1048576"], PREDICT_S),
    "deepspeed-z3-8k-micro": (["framework=deepspeed", *LLAMA, "framework.zero_stage=3", "layout.dp=1",
                                "layout.global_batch_size=8192"], PREDICT_S),
    "megatron-pp4vp2-8k-micro": (["framework=megatron", *LLAMA, "layout.pp=4", "layout.vp=2", "layout.dp=1",
                                   "layout.global_batch_size=8192"], PREDICT_S),
    "titan-pp4-8k-micro": (["framework=titan", *LLAMA, "layout.pp=4", "layout.dp=1",
                             "layout.global_batch_size=8192"], PREDICT_S),
    "megatron-1024-layers": (["framework=megatron", "model.layers=1024", "layout.pp=8", "layout.vp=4", "layout.dp=1",
                              "layout.global_batch_size=64"], PREDICT_S),
    "plan-98304-all": (["mode=plan", "model=llama3_70b", "plan.global_batch_tokens=16777216", "plan.gpus=98304",
                        "framework=all"], PLAN_S),
    "plan-110880-all": (["mode=plan", "model=llama3_70b", "plan.global_batch_tokens=16777216", "plan.gpus=110880",
                         "framework=all"], PLAN_S),
    "refused-world": (["framework=titan", "layout.dp=10000000"], 3.0),
    "refused-plan": (["mode=plan", "plan.gpus=10000000", "plan.global_batch_tokens=4096", "framework=all"], 3.0),
}


def run(name: str, overrides: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix=f"size-{name}-")
    argv = [sys.executable, "launch.py", *overrides, "wandb.mode=disabled", f"hydra.run.dir={out}"]
    if not any(o.startswith("mode=") for o in overrides):
        argv.insert(2, "mode=predict")
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    _, status, usage = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    return {"s": secs, "mb": usage.ru_maxrss / 1024, "out_mb": size / 1e6, "rc": os.waitstatus_to_exitcode(status)}


def sigterm_latency(overrides: list[str], after_s: float = 2.0) -> tuple[float, int]:
    """Seconds from a SIGTERM sent after_s into a prediction to the process's exit, and its exit code."""
    import signal

    out = tempfile.mkdtemp(prefix="size-sigterm-")
    p = subprocess.Popen([sys.executable, "launch.py", "mode=predict", *overrides, "wandb.mode=disabled",
                          f"hydra.run.dir={out}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(after_s)
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    rc = p.wait()
    return time.perf_counter() - t0, rc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="run the cases whose name contains this")
    args = ap.parse_args()
    print(f"{'case':28} {'s':>7} {'MB':>7} {'out MB':>8} {'rc':>3}  s/goal  MB/goal")
    worst = 0.0
    for name, (overrides, goal_s) in CASES.items():
        if args.only and args.only not in name:
            continue
        r = run(name, overrides)
        ratio_s, ratio_mb = r["s"] / goal_s, r["mb"] / PREDICT_MB
        worst = max(worst, ratio_s, ratio_mb)
        print(f"{name:28} {r['s']:7.2f} {r['mb']:7.0f} {r['out_mb']:8.2f} {r['rc']:3d}  {ratio_s:6.2f}  {ratio_mb:7.2f}",
              flush=True)
    if not args.only or "sigterm" in args.only:
        lat, rc = sigterm_latency(CASES["titan-dp1M"][0])
        print(f"{'sigterm 2 s into titan-dp1M':28} {lat:7.2f} s to exit (rc {rc}); goal {SIGTERM_S:g} s: {lat / SIGTERM_S:.2f}")
        worst = max(worst, lat / SIGTERM_S)
    print(f"worst ratio to its goal: {worst:.2f} (<= 1 meets every goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
