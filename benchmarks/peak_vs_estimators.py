"""Peak memory per rank: the measured peak against ours and against the estimators users compare with.

    python benchmarks/peak_vs_estimators.py [SWEEP_DIR]      # default: runs the small sweep below first

For each job, the rank with the highest measured peak on the last step (probes/peak.py), then:
  ours        the ledger's predicted peak for that rank (where the framework's ledger predicts one)
  megatron    Megatron-LM's megatron/training/theoretical_memory_usage.py report_theoretical_memory
              (weights + optimizer + activations; imported from the installed package)
  ds_zero     DeepSpeed's estimate_zero2/3_model_states_mem_needs (model states only, no activations;
              zero/stage_1_and_2.py, zero/stage3.py; cpu_offload=False; largest_layer_params as
              estimate_zero3_model_states_mem_needs_all_live computes it), also against the measured
              resident state
  fsdp_mem_tracker
              torch's FSDPMemTracker (torch/distributed/_tools/fsdp2_mem_tracker.py, the tracker
              torchtitan's memory estimation runs): its peak over the same step of the same run, for
              torchtitan jobs run with probe.fsdp_mem_tracker=true. A finding, not in the default
              sweep: it cannot track torchtitan 0.3.0's Llama step. Every llama3 config there trains
              with ChunkedLossWrapper (components/loss.py), which calls the [norm, lm_head] FSDP unit
              once per sequence chunk, and FSDPMemTracker raises NotImplementedError ("does not
              support memory tracking for multiple iterative calls") at the second chunk, so the job
              fails with that error in its record:
                  python launch.py -m framework=titan cluster.ranks=2 probe.fsdp_mem_tracker=true
and each one's error against the measured peak.

The estimators are called with the job's own shape and layout; they assume a GPU run (bf16 weights,
fp32 master and Adam, their activation formulas), so on the CPU harness their error says how far that
assumption is from what this job did, which is the point of printing it next to ours.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import records as R  # noqa: E402

SWEEPS = [
    ["framework=megatron", "cluster.ranks=4", "layout={tp:2,sequence_parallel:true},{pp:2},{dp:4}"],
    ["framework=deepspeed", "cluster.ranks=2", "framework.zero_stage=2,3"],
    ["framework=titan", "cluster.ranks=2"],
]


def run_default(out: str) -> None:
    for i, ov in enumerate(SWEEPS):
        cmd = [sys.executable, "launch.py", "-m", *ov, "train.steps=3", "wandb.mode=disabled",
               f"hydra.sweep.dir={out}/{i}"]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def heaviest(rec: dict):
    """(rank, its last step) with the highest measured peak."""
    best = None
    for m in (rec.get("measurement") or {}).get("ranks", []):
        steps = [s for s in m.get("steps", []) if s.get("peak")]
        if m.get("status") == "ok" and steps and (best is None or steps[-1]["peak"]["peak_bytes"] >
                                                   best[1]["peak"]["peak_bytes"]):
            best = (m["rank"], steps[-1])
    return best


def megatron_theoretical(rec: dict) -> int | None:
    """report_theoretical_memory(args) in bytes (it reports MiB), args from the job's config."""
    from megatron.training import theoretical_memory_usage as T

    cfg, pred = rec["config"], rec["prediction"]
    m, lay = cfg["model"], pred["layout"]
    fw = cfg["framework"]
    from ledger.faithful.megatron.pipeline import padded_shape
    from ledger.model import ModelShape

    shape = ModelShape.from_config(m)
    padded = padded_shape(shape, lay["tp"], fw.get("make_vocab_size_divisible_by", 128)).vocab
    args = SimpleNamespace(
        hidden_size=m["hidden"], ffn_hidden_size=m["ffn_hidden"], num_attention_heads=m["heads"],
        kv_channels=m["hidden"] // m["heads"], num_query_groups=m["kv_heads"],
        group_query_attention=m["kv_heads"] != m["heads"], swiglu=m.get("swiglu", True),
        normalization="RMSNorm" if m.get("norm", "rmsnorm") == "rmsnorm" else "LayerNorm",
        padded_vocab_size=padded, untie_embeddings_and_output_weights=not m.get("tied_embeddings", False),
        num_layers=m["layers"], seq_length=m["seq_len"], micro_batch_size=lay["micro_batch_size"],
        tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"],
        virtual_pipeline_model_parallel_size=lay["vp"] if lay.get("vp", 1) > 1 else None,
        data_parallel_size=lay["dp"], world_size=pred["world"], sequence_parallel=lay["sequence_parallel"],
        recompute_granularity=fw.get("recompute_granularity"), use_distributed_optimizer=fw.get("use_distributed_optimizer", False),
        num_experts=None, moe_layer_freq=1, moe_ffn_hidden_size=None, moe_router_topk=1,
        moe_shared_expert_intermediate_size=None, mtp_num_layers=None, multi_latent_attention=False,
        add_bias_linear=m.get("bias", False), expert_model_parallel_size=1, expert_tensor_parallel_size=lay["tp"],
        hybrid_layer_pattern=None)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        got = T.report_theoretical_memory(args, num_microbatches=lay.get("num_microbatches"))
    return None if got is None else int(got[2] * T.NUM_BYTES_IN_MEGABYTE)


def largest_layer_params(model) -> int:
    """estimate_zero3_model_states_mem_needs_all_live: max over modules of their own parameters' numel."""
    from ledger.model import numel

    own: dict[str, int] = {}
    for name, shape in model.params():
        mod = name.rsplit(".", 1)[0]
        own[mod] = own.get(mod, 0) + numel(shape)
    return max(own.values())


def deepspeed_states(rec: dict) -> int | None:
    """Per-GPU bytes DeepSpeed's estimator gives for the model states (no offload; ZeRO-1 and 2 share
    estimate_zero2_model_states_mem_needs, DeepSpeed has none for stage 1), num_gpus_per_node = the
    job's DP ranks."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ledger.model import ModelShape

    cfg = rec["config"]
    model = ModelShape.from_config(cfg["model"])
    n, dp = model.num_params(), rec["prediction"]["world"]
    if cfg["framework"].get("zero_stage") == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _cpu, gpu, _ = estimate_zero3_model_states_mem_needs(n, largest_layer_params(model), num_gpus_per_node=dp,
                                                             num_nodes=1, cpu_offload=False, cpu_offload_params=False)
        return int(gpu)
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _cpu, gpu = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=dp, num_nodes=1, cpu_offload=False)
    return int(gpu)


def table(recs: list[dict]):
    import pandas as pd

    rows = []
    for rec in recs:
        got = heaviest(rec)
        if got is None:
            continue
        rank, st = got
        meas = st["peak"]["peak_bytes"]
        pr = R.predicted_ranks(rec["prediction"])(rank)
        row = {"job": R.job_name(rec), "framework": R.framework_variant(rec), "layout": R.layout_name(rec),
               "rank": rank, "measured_peak": meas, "ours": (pr.get("peak") or {}).get("bytes")}
        fam = R.framework_variant(rec).split("-")[0]
        row["megatron_theoretical"] = _safe(megatron_theoretical, rec) if fam == "megatron" else None
        row["ds_zero_states"] = _safe(deepspeed_states, rec) if fam == "deepspeed" else None
        row["fsdp_mem_tracker"] = (st.get("fsdp_mem_tracker") or {}).get("peak_bytes")
        for k in ("ours", "megatron_theoretical", "ds_zero_states", "fsdp_mem_tracker"):
            row[f"{k}_err"] = None if row[k] is None else f"{(row[k] - meas) / meas:+.1%}"
        # DeepSpeed's estimators are of the model states: against the measured resident state too
        res = (st.get("state") or {}).get("resident_bytes")
        row["measured_resident"] = res
        row["ds_zero_states_vs_resident"] = (None if row["ds_zero_states"] is None or not res
                                             else f"{(row['ds_zero_states'] - res) / res:+.1%}")
        rows.append(row)
    df = pd.DataFrame(rows)
    for k in ("measured_peak", "measured_resident", "ours", "megatron_theoretical", "ds_zero_states", "fsdp_mem_tracker"):
        if k in df:
            df[k] = df[k].astype("Int64")
    return df


def _safe(fn, rec):
    try:
        return fn(rec)
    except Exception as e:  # an estimator that cannot take this job says so in the table
        print(f"{fn.__name__} on {R.job_name(rec)}: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", nargs="?")
    a = ap.parse_args(argv)
    path = a.sweep_dir
    if path is None:
        path = os.path.join(REPO, "outputs", "bench_peak")
        run_default(path)
    recs = R.load(path)
    print(table(recs).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
