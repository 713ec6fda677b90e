"""The design article's three 8-GPU runs (chapter 7), Llama-3.2-1B shape, s = 8192:

  megatron   TP2 x PP2 x DP2, distributed optimizer (ZeRO-1), SP, micro 1, global 16 (m = 8)
  deepspeed  ZeRO-3, DP8, micro 1, 2 accumulation steps (global 16)
  titan      FSDP4 x TP2 (+SP, torchtitan's default), local batch 2 (global 8), reshard after forward

    python -m sweeps.article [--mode predict|dry|run|fake] [--ledger faithful|textbook] [--out DIR] [OVERRIDE ...]
    python -m sweeps.article --question [--measured-mfu 0.32] [--hardware h100]

predict (default) prints each run's per-rank table and writes prediction.json; dry writes the
framework-native artifacts (run.sh, ds_config.json, the torchtitan module) for a GPU cluster; run
needs 8 GPUs (e.g. cluster=local_gpu, or a Slurm cluster config plus hydra/launcher=submitit_slurm);
fake runs the three on this machine at full shape (cluster=fake: a fake world of 8, the ranks of
each distinct predicted state materialised one after another under FakeTensorMode, two steps:
first and steady) and prints their reconcile table, every step, then per measured rank the fake
world's peak (the CPU harness's code, cpu-gloo) beside the peak predicted for a GPU run (cuda-nccl) and
the parts that differ, and judges the rows (judge: states and collectives exact, every peak within 1%;
the exit status says). Extra overrides apply to all three jobs.

--question answers the article's closing question: "A 70B dense model, 1,024 H100, sequence 8192,
global batch 4M tokens. TP, PP, DP? micro-batch? recompute? Expected MFU? It ran at only 32% - where
did the missing 10 points go?" It plans Llama-3-70B on 1,024 GPUs of the hardware profile (every
layout, micro-batch and recompute of the three frameworks, Megatron with both overlaps on, as tuned
runs set them), prints each framework's best fitting layout with its predicted MFU and the step's
waterfall, and then, for a run measured at --measured-mfu, how much each term of the best layout's
step would have to grow, alone, to account for the missing time: the term a user should measure first.
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


QUESTION = {"model": "llama3_70b", "seq_len": 8192, "gpus": 1024, "tokens": 4 * 1024 * 1024}


def question(measured_mfu: float, hw_name: str) -> int:
    """The article's closing question (module docstring), answered by the planner and the step-time model."""
    from omegaconf import OmegaConf

    from conf.schema import FRAMEWORK_SCHEMAS
    from ledger.model import preset
    from ledger.plan import FRAMEWORK_NAMES, Hardware, Space, search
    from ledger.timing import hardware

    q = QUESTION
    model = preset(q["model"], seq_len=q["seq_len"])
    prof = hardware.profile(hw_name, gpus_per_node=8)
    hw = Hardware(q["gpus"], 8, int(prof.memory_gb * 1e9), 0.9, prof.peak("bf16") / 1e12, prof.gemm_efficiency,
                  8 * prof.intra.busbw_gbps, 8 * prof.inter.busbw_gbps,
                  profile=prof)
    gbs = q["tokens"] // q["seq_len"]
    # torchtitan's pipelines under its default 1F1B and its looped 1F1B only: the split-backward schedules do not
    # change its best layout at this scale (measured on docs/planning.md's 70B / 1,024-GPU plan: the same best
    # torchtitan row with all five, at about twice its search time)
    space = Space(gbs, (1, 2, 4), (1, 2, 5), 8, (1, 2, 3), (False, True), True, ("none", "selective", "full"),
                  (True,), pipeline_schedules=("1F1B", "Interleaved1F1B"))
    bases = {n: OmegaConf.to_container(OmegaConf.structured(FRAMEWORK_SCHEMAS[n])) for n in FRAMEWORK_NAMES}
    bases["megatron"].update(overlap_grad_reduce=True, overlap_param_gather=True)
    plan = search(model, hw, space, bases, "faithful", "time")
    timed = [r for r in plan.rows if r.fits and "mfu" in r.est]
    print(f"Llama-3-70B, {q['gpus']:,} x {prof.target}, seq {q['seq_len']}, {q['tokens']:,} tokens per step "
          f"(global batch {gbs}): {len(timed):,} fitting layouts timed of {len(plan.rows):,}")
    if not timed:
        print("no layout fits")
        return 1
    best = {}
    for r in timed:  # rows come fastest first
        best.setdefault(r.framework, r)
    from launchers.plan import _lay

    for fw, r in best.items():
        print(f"  {fw:<9} {_lay(r):<42} MFU {100 * r.est['mfu']:.1f}%  {r.est['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU  "
              f"step {r.est_step_s:.2f} s  peak {r.peak_bytes / 1e9:.1f} GB")
    top = timed[0]
    step, mfu = top.est_step_s, top.est["mfu"]
    print(f"\nbest: {top.framework} {_lay(top)}: predicted MFU {100 * mfu:.1f}%; the step ({step:.2f} s):")
    terms = [(k, v) for k, v in top.est["waterfall"] if v > 1e-12]
    for k, v in terms:
        print(f"  {k:<32} {v:8.3f} s  {100 * v / step:5.1f}%")
    if measured_mfu >= mfu:
        print(f"\na run at {100 * measured_mfu:.0f}% MFU is at or above the prediction: nothing is missing")
        return 0
    missing = step * (mfu / measured_mfu - 1)
    print(f"\nmeasured at {100 * measured_mfu:.0f}% MFU: the step took {step * mfu / measured_mfu:.2f} s, {missing:.2f} s "
          f"more than predicted. Each term of 1% or more of the step alone would have to grow by:")
    peak_s = dict(terms).get("model FLOPs at peak", 0.0)
    for k, v in terms:
        if k == "model FLOPs at peak" or v < 0.01 * step:  # a term under 1% of the step cannot be the cause
            continue
        if k == "GEMM / attention efficiency":
            eff_now = peak_s / (peak_s + v)
            eff_then = peak_s / (peak_s + v + missing)
            act = f"the GEMMs and attention at {100 * eff_then:.0f}% of peak, not {100 * eff_now:.0f}%: profile the " \
                  "kernels (calibrate on the device)"
        elif k.startswith("exposed "):
            act = f"{k[8:]} traffic exposed x{(v + missing) / v:.1f}: check its overlap and the link's busbw " \
                  "(nccl-tests) against the profile's"
        elif k == "pipeline bubble":
            act = f"bubble x{(v + missing) / v:.1f}: uneven stages or p2p waits; more micro-batches or vp"
        elif k == "recompute":
            act = f"recompute x{(v + missing) / v:.1f}: more layers recomputed than planned"
        elif k == "memory-bound ops":
            act = f"memory-bound ops x{(v + missing) / v:.1f}: unfused norms / casts (TE's fused kernels off?)"
        else:
            act = f"x{(v + missing) / v:.1f}"
        print(f"  {k:<32} {v:8.3f} s -> {v + missing:8.3f} s   {act}")
    print("\nfrom sources: no GPU run has confirmed these figures; a calibrated profile (hardware.file) replaces "
          "the preset's assumed efficiencies")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.article", description=__doc__.splitlines()[0])
    ap.add_argument("--question", action="store_true", help="answer the article's closing question (docstring)")
    ap.add_argument("--measured-mfu", type=float, default=0.32)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--mode", choices=("predict", "dry", "run", "fake"), default="predict")
    ap.add_argument("--ledger", choices=("faithful", "textbook"), default="faithful")
    ap.add_argument("--out", default=os.path.join("multirun", "article", time.strftime("%Y-%m-%d_%H-%M-%S")))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    if a.question:
        return question(a.measured_mfu, a.hardware)
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
        print(gpu_side_by_side(a.out))
        from analysis.compare import table

        verdict, bad = judge(table(a.out))
        print(verdict)
        rc |= bool(bad)
    return rc


def judge(df) -> tuple[str, int]:
    """The fake world's rows held to the CPU matrices' contract (analysis.compare.off): every state and
    collective row of every step exact, every peak_bytes row, first step and steady, within 1%. The
    fake group's collectives allocate what gloo's do (launchers/fake.py), so the cpu-gloo peak is the
    one to judge. df: analysis.compare.table's rows. Returns (the verdict's text, the rows off)."""
    from analysis.compare import off

    rows = df[~df.quantity.str.startswith("peak/")]  # a peak's parts are reported, not judged
    bad = rows[off(rows)]
    peaks = rows[rows.quantity == "peak_bytes"]
    if bad.empty:
        worst = peaks.rel_err.abs().max() if len(peaks) else 0.0
        return (f"judged: {len(rows) - len(peaks)} state and collective rows exact, {len(peaks)} peak rows "
                f"(first and steady) within 1% (worst {100 * worst:.4f}%)"), 0
    cols = ["job", "rank", "step", "quantity", "predicted", "measured", "rel_err"]
    return f"judged: {len(bad)} rows off\n{bad[cols].to_string(index=False)}", len(bad)


def gpu_side_by_side(out: str) -> str:
    """Per measured rank of each fake job, its steady peak as the fake world measured it (the CPU
    harness's code: cpu-gloo) beside the peak the ledger predicts for the same rank of a GPU run
    (cuda-nccl: ledger/target.py, from sources), and the parts in which the two predictions differ."""
    from omegaconf import OmegaConf

    import records as R
    from analysis.compare import table
    from launchers.job import check
    from ledger.parallel import predict
    from ledger.target import CPU_GLOO, CUDA_NCCL
    from ledger.units import PEAK_PARTS, fmt

    lines = ["the same ranks for a GPU run: cpu-gloo measured (the fake world; in brackets the CUDA caching "
             "allocator's reserved peak for the measured step's allocations, simulated: ledger/cuda_allocator.py) | "
             "cpu-gloo predicted | cuda-nccl predicted (from sources), and the parts that differ"]
    df = table(out)
    for rec in R.load(out):
        cfg = OmegaConf.create(rec["config"])
        cfg.mode = "predict"  # the job's layout as predict sees it, for both targets
        cfg.cluster = {**rec["config"]["cluster"], "kind": "local", "backend": "gloo", "device": "cpu",
                       "target": CPU_GLOO}
        model, lay, cpu_pl = check(cfg)
        pls = {CPU_GLOO: cpu_pl, CUDA_NCCL: predict(model, lay, cfg.framework, cfg.ledger.mode, target=CUDA_NCCL)}
        meas = df[(df.job == R.job_name(rec)) & (df.phase == "steady") & (df.quantity == "peak_bytes")]
        sim = {}  # rank -> the steady steps' simulated reserved peak
        for m_rank in (rec.get("measurement") or {}).get("ranks", []):
            for st in m_rank.get("steps", [])[1:]:
                r = ((st.get("peak") or {}).get("cuda_allocator_sim") or {}).get("peak_reserved_bytes")
                if r is not None:
                    sim[m_rank["rank"]] = max(sim.get(m_rank["rank"], 0), r)
        for rank in sorted(set(meas["rank"])):
            m = int(meas[meas["rank"] == rank].measured.max())
            cpu, gpu = (pls[t].rank_state(int(rank)).peak for t in (CPU_GLOO, CUDA_NCCL))
            if cpu is None or gpu is None:
                continue
            diff = ", ".join(f"{p} {'+' if gpu.parts.get(p, 0) >= cpu.parts.get(p, 0) else '-'}"
                             f"{fmt(abs(gpu.parts.get(p, 0) - cpu.parts.get(p, 0)))}"
                             for p in PEAK_PARTS if gpu.parts.get(p, 0) != cpu.parts.get(p, 0))
            reserved = f" [{fmt(sim[int(rank)])}]" if int(rank) in sim else ""
            lines.append(f"  {R.job_name(rec)} rank {rank}: {fmt(m)}{reserved} | {fmt(cpu.bytes)} | {fmt(gpu.bytes)} "
                         f"({gpu.what}); cuda-nccl - cpu-gloo: {diff or 'none'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
