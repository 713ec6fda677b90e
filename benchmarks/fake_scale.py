"""cluster=fake at scale: wall time and peak RSS per materialised rank, and whether it reconciles.

    .venv/bin/python benchmarks/fake_scale.py [--shapes llama3_1b,llama3_8b,llama3_70b]
        [--frameworks megatron,deepspeed,titan,titan-pp,titan-interleaved] [--seq 8192] [--ranks default|0,...] [--out DIR]

One fake job per (shape, framework), each a `launch.py mode=run cluster=fake` run (W&B off), the
ranks run one after another on this machine; per rank it prints the process's wall time and peak
RSS (wait4's ru_maxrss, recorded by launchers/fake.py run_fake) and the reconcile result: the rows
compared, first and steady steps, and how many are off (analysis.compare.off: a state or collective row
not to the byte, a peak more than 1% away; a peak's parts are reported, not counted). Layouts:

    llama3_1b   the design article's three 8-GPU runs (sweeps/article.py)
    llama3_8b   world 64: Megatron TP4·PP2·DP8 (SP, distributed optimizer), DeepSpeed ZeRO-3 DP64,
                torchtitan FSDP8·TP8 (SP)
    llama3_70b  world 1,024: Megatron TP8·PP8·DP16, DeepSpeed ZeRO-3 DP1024, torchtitan FSDP128·TP8 and
                (titan-pp) FSDP128·PP8
    16k         world 16,384: Megatron Llama-3-405B TP8·PP16·DP128 interleaved (SP, vp 2, the embedding and
                the loss counted as layers: 126 + 2 over 32 virtual stages, 16 micro-batches), DeepSpeed
                ZeRO-3 of Llama-3-70B at DP 16,384, torchtitan Llama-3-405B FSDP128·TP8·PP16 (SP, 1F1B, 16
                micro-batches)
    llama3_405b world 512: torchtitan FSDP8·TP8·PP8 (SP, 8 micro-batches) under 1F1B and (titan-interleaved)
                Interleaved1F1B with two stages a rank

`--ranks default` materialises the ledger's choice (rank 0 and each stage's most-loaded rank);
`--ranks 0` one rank per job, for a quick figure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sweeps.article import RUNS as ARTICLE  # noqa: E402

LAYOUTS = {
    "llama3_1b": ARTICLE,
    "llama3_8b": {
        "megatron": ["framework=megatron", "layout.tp=4", "layout.pp=2", "layout.dp=8", "layout.sequence_parallel=true"],
        "deepspeed": ["framework=deepspeed", "framework.zero_stage=3", "layout.dp=64"],
        "titan": ["framework=titan", "layout.tp=8", "layout.dp=8", "layout.sequence_parallel=true"],
    },
    "llama3_70b": {
        "megatron": ["framework=megatron", "layout.tp=8", "layout.pp=8", "layout.dp=16", "layout.sequence_parallel=true"],
        "deepspeed": ["framework=deepspeed", "framework.zero_stage=3", "layout.dp=1024"],
        "titan": ["framework=titan", "layout.tp=8", "layout.dp=128", "layout.sequence_parallel=true"],
        # torchtitan's PP (1F1B over FSDP): 8 stages, 8 micro-batches a step
        "titan-pp": ["framework=titan", "layout.pp=8", "layout.dp=128", "layout.global_batch_size=1024"],
    },
    "16k": {
        # interleaved as Meta's run: 2 virtual stages a rank, the embedding and the loss counted as layers
        # (126 + 2 = 32 virtual stages of 4)
        "megatron": ["framework=megatron", "layout.tp=8", "layout.pp=16", "layout.vp=2", "layout.dp=128",
                     "layout.sequence_parallel=true", "layout.global_batch_size=2048",
                     "framework.account_for_embedding_in_pipeline_split=true",
                     "framework.account_for_loss_in_pipeline_split=true"],
        "deepspeed": ["framework=deepspeed", "framework.zero_stage=3", "layout.dp=16384"],
        # torchtitan's 405B layout (FSDP·TP8·PP16, SP, 1F1B with 16 micro-batches a step)
        "titan": ["framework=titan", "layout.tp=8", "layout.pp=16", "layout.dp=128", "layout.sequence_parallel=true",
                  "layout.global_batch_size=2048"],
    },
    "llama3_405b": {
        # torchtitan's own 405B config: FSDP8·TP8·PP8 with SP, 1F1B, 8 micro-batches a step
        "titan": ["framework=titan", "layout.tp=8", "layout.pp=8", "layout.dp=8", "layout.sequence_parallel=true",
                  "layout.global_batch_size=64"],
        # the same under Interleaved1F1B, two stages a rank (126 layers + 2 over 16 stages of 8)
        "titan-interleaved": ["framework=titan", "layout.tp=8", "layout.pp=8", "layout.vp=2", "layout.dp=8",
                              "layout.sequence_parallel=true", "layout.global_batch_size=64",
                              "framework.pipeline_parallel_schedule=Interleaved1F1B"],
    },
}
# a shape that is not a model's name: each framework's model
MODEL_OF = {"16k": {"megatron": "llama3_405b", "deepspeed": "llama3_70b", "titan": "llama3_405b"}}


def run_one(shape: str, fw: str, seq: int, ranks: str, out: str, timeout_s: int) -> dict:
    job_dir = os.path.join(out, f"{shape}_{fw}")
    # ZeRO-3 with one micro-batch per step completes its trace in step 1: three steps (first,
    # trace-completing, steady); the others two (first, steady)
    steps = 3 if fw == "deepspeed" and shape != "llama3_1b" else 2
    model = MODEL_OF.get(shape, {}).get(fw, shape)
    cmd = [sys.executable, "launch.py", "mode=run", "cluster=fake", f"model={model}", f"model.seq_len={seq}",
           *LAYOUTS[shape][fw], f"train.steps={steps}", "wandb.mode=disabled", f"cluster.timeout_s={timeout_s}",
           f"hydra.run.dir={job_dir}"]
    if ranks != "default":
        cmd.append(f"cluster.fake_ranks=[{ranks}]")
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    rec_path = os.path.join(job_dir, "record.json")
    if not os.path.exists(rec_path):
        return {"shape": shape, "framework": fw, "status": f"no record (exit {p.returncode})",
                "error": p.stderr[-500:], "wall_s": wall, "ranks": []}
    with open(rec_path) as f:
        rec = json.load(f)
    from analysis.compare import off, table

    df = table([rec])
    df = df[~df.quantity.str.startswith("peak/")]  # a peak's parts are reported, not judged
    out_ranks = []
    for r in (rec.get("measurement") or {}).get("ranks", []):
        d = df[df["rank"] == r["rank"]]
        pr = r.get("process") or {}
        out_ranks.append({"rank": r["rank"], "status": r.get("status"), "wall_s": pr.get("wall_s"),
                          "max_rss_gib": round(pr["max_rss_bytes"] / 2**30, 2) if pr.get("max_rss_bytes") else None,
                          "rows": len(d), "phases": sorted(set(d.phase)), "mismatches": int(off(d).sum())})
    return {"shape": shape, "framework": fw, "status": rec["status"], "error": (rec.get("error") or "")[:300],
            "wall_s": round(wall, 1), "layout": " ".join(LAYOUTS[shape][fw][1:]), "ranks": out_ranks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama3_1b,llama3_8b,llama3_70b")
    ap.add_argument("--frameworks", default="megatron,deepspeed,titan,titan-pp,titan-interleaved")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ranks", default="default", help="'default' (the ledger's choice) or a comma list")
    ap.add_argument("--timeout", type=int, default=3600, help="cluster.timeout_s of each job")
    ap.add_argument("--out", default=os.path.join(REPO, "outputs", "fake_scale", time.strftime("%Y%m%d-%H%M%S")))
    a = ap.parse_args(argv)
    if a.ranks != "default" and not all(x.strip().isdigit() for x in a.ranks.split(",")):
        ap.error(f"--ranks={a.ranks!r} must be 'default' or a comma list of ranks")
    print("| shape | framework | layout | status | rank | wall s | peak RSS GiB | rows (phases) | off |")
    print("|---|---|---|---|---:|---:|---:|---|---:|")
    rc = 0
    for shape in a.shapes.split(","):
        for fw in a.frameworks.split(","):
            if fw not in LAYOUTS[shape]:
                continue
            r = run_one(shape, fw, a.seq, a.ranks, a.out, a.timeout)
            if r["status"] != "ok" or any(x["mismatches"] for x in r["ranks"]):
                rc = 1
            if not r["ranks"]:
                print(f"| {shape} | {fw} | {r.get('layout', '')} | {r['status']}: {r['error']} | | {r['wall_s']} | | | |")
            for x in r["ranks"]:
                print(f"| {shape} | {fw} | {r['layout']} | {r['status']} | {x['rank']} | {x['wall_s']} | "
                      f"{x['max_rss_gib']} | {x['rows']} ({'/'.join(x['phases'])}) | {x['mismatches']} |", flush=True)
    print(f"job dirs under {a.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
