"""Peak and resident memory per rank: measured, train-ledger's prediction, the frameworks' own estimators.

    .venv/bin/python benchmarks/peak_vs_estimators.py [JOB_OR_SWEEP_DIR ...]

With no directory, runs three small DeepSpeed jobs (ZeRO-1/2/3, tiny model, 2 CPU ranks, 2 steps) into a
temporary directory. Each job directory's record.json (a sweep directory: every job below it) gives the
measured steady resident state and peak (probes) and the ledger's prediction.

DeepSpeed part: DeepSpeed's estimators of model-state memory per GPU, called as installed
(deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs for ZeRO-1 and 2, DeepSpeed
has none for stage 1; deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs), no offload,
num_gpus_per_node = the job's DP ranks, largest_layer_params as estimate_zero3_model_states_mem_needs_all_live
computes it (the module with the most parameters of its own). They estimate states only: no activations,
no temporaries; their rel_err is printed against the measured resident state and against the peak.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def largest_layer_params(model) -> int:
    """estimate_zero3_model_states_mem_needs_all_live: max over modules of their own parameters' numel."""
    from ledger.model import numel

    own: dict[str, int] = {}
    for name, shape in model.params():
        mod = name.rsplit(".", 1)[0]
        own[mod] = own.get(mod, 0) + numel(shape)
    return max(own.values())


def deepspeed_estimate(model, zero: int, dp: int) -> int:
    """Per-GPU bytes DeepSpeed's estimator gives for the model states (no offload)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    n = model.num_params()
    if zero == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _cpu, gpu, _ = estimate_zero3_model_states_mem_needs(n, largest_layer_params(model), num_gpus_per_node=dp,
                                                             num_nodes=1, cpu_offload=False, cpu_offload_params=False)
        return int(gpu)
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _cpu, gpu = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=dp, num_nodes=1, cpu_offload=False)
    return int(gpu)


def _steady(ranks: list[dict]):
    """(rank, step record) of each rank's last step."""
    for r in ranks:
        if r.get("status") == "ok" and r.get("steps"):
            yield r["rank"], r["steps"][-1]


def deepspeed_rows(recs: list[dict]) -> list[dict]:
    from omegaconf import OmegaConf

    import records as R
    from ledger.model import ModelShape

    out = []
    for rec in recs:
        if rec.get("config", {}).get("framework", {}).get("name") != "deepspeed" or not rec.get("measurement"):
            continue
        c = rec["config"]
        model = ModelShape.from_config(OmegaConf.create(c["model"]))
        zero, dp = c["framework"]["zero_stage"], rec["prediction"]["layout"]["dp"]
        est = deepspeed_estimate(model, zero, dp)
        pred = {p["rank"]: p for p in rec["prediction"]["per_rank"]}
        prec = c["framework"]["precision"]
        for rank, st in _steady(rec["measurement"]["ranks"]):
            p = pred[rank]
            res, peak = st["state"]["resident_bytes"], st["peak"]["peak_bytes"]
            d = rec.get("job_dir") or ""  # sweep/job: job names repeat across sweeps
            name = f"{os.path.basename(os.path.dirname(d))}/{R.job_name(rec)}" if d else R.job_name(rec)
            out.append({"job": name, "zero": zero, "dp": dp, "rank": rank,
                        "prec": prec, "m": rec["prediction"]["layout"]["num_microbatches"],
                        "mbs": rec["prediction"]["layout"]["micro_batch_size"],
                        "ckpt": bool(c["framework"].get("activation_checkpointing", False)),
                        "measured_resident": res, "measured_peak": peak,
                        "ledger_resident_err": (res - p["resident_bytes"]) / p["resident_bytes"],
                        "ledger_peak_err": (peak - p["peak"]["bytes"]) / p["peak"]["bytes"] if p.get("peak") else None,
                        "ds_estimate": est, "ds_vs_resident": (res - est) / est, "ds_vs_peak": (peak - est) / est})
    return out


def _run_default(out: str) -> list[str]:
    dirs = []
    for z in (1, 2, 3):
        d = os.path.join(out, f"z{z}")
        args = [sys.executable, "launch.py", "framework=deepspeed", f"framework.zero_stage={z}", "cluster.ranks=2",
                "framework.reduce_bucket_size=65536", "train.steps=2", "wandb.mode=disabled", f"hydra.run.dir={d}"]
        p = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"run failed: {p.stderr[-2000:]}")
        dirs.append(d)
    return dirs


def main() -> None:
    import pandas as pd

    import records as R

    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="*", help="job or sweep directories (default: run three small DeepSpeed jobs)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = a.dirs or _run_default(tmp)
        recs = [r for d in dirs for r in R.load(d)]
    rows = deepspeed_rows(recs)
    if not rows:
        raise SystemExit("no DeepSpeed job with a measurement in " + " ".join(dirs))
    df = pd.DataFrame(rows)
    # one row per job: every rank of a DeepSpeed job holds the same bytes (pure DP)
    df = df.groupby("job", sort=True).first().reset_index()
    pct = ["ledger_resident_err", "ledger_peak_err", "ds_vs_resident", "ds_vs_peak"]
    for k in pct:
        df[k] = df[k].map(lambda v: "" if v is None else f"{100 * v:+.2f}%")
    print("DeepSpeed: measured per rank (last step) vs train-ledger vs DeepSpeed's estimate_zero{2,3}_model_states_mem_needs")
    print(df.to_markdown(index=False))


if __name__ == "__main__":
    main()
