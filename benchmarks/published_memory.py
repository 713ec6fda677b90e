"""Predicted peak memory and fit verdicts against published runs: each row of a CSV in the format of
../shared/data/published_runs_open.csv (columns and sources in that folder's README) that the ledgers
cover, predicted for a GPU run (target cuda-nccl: ledger/target.py) on the row's layout.

    .venv/bin/python benchmarks/published_memory.py [RUNS.csv] [--json OUT]

For every covered row it prints the heaviest rank's predicted peak (the tensors, what the probe would
count), what a rank holds beside them (ledger/cuda.py), their sum against the GPU's memory, and
- where the row publishes a peak (memory_gib, torchtitan's "probably max reserved"): the error against
  it, with the reasons the two are not the same quantity or the same code;
- the verdict against what the row says happened: a row with a published throughput ran, so it fit; a
  row marked oom did not. A disagreement is a finding printed with its row, never a factor to fit.
Rows whose framework no ledger models (Meta's in-house 4D stack) are predicted with the closest ledger
(Megatron: TP, interleaved PP, DP) and the terms of its peak are printed, to say which of them Meta's run
does not pay.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
DEFAULT = os.path.join(REPO, "..", "shared", "data", "published_runs_open.csv")
GiB = 1 << 30

# why a row's published peak is not the quantity predicted (said per group; the data's README)
GROUP_REASONS = {
    "TC": "torchtitan of Dec 2024 (no ChunkedLossWrapper: the whole [B, S, V] logits and their fp32 loss; "
          "0.3.0's chunked loss is predicted); published = max over GPUs, probably max_reserved (the caching "
          "allocator's segments), predicted = allocated tensors + what lies beside them",
    "TA": "torchtitan of Apr 2024 (FSDP2 early, no chunked loss)",
    # a finding, with the terms of the prediction (_l3_terms: the heaviest rank's stage, computed)
    "L3": "Meta's 4D stack, not Megatron: the closest ledger (Megatron, TE spec, distributed optimizer, 1F1B "
          "at vp 1: the row states no vp) says OOM where Meta trained without recompute. Its terms at stage "
          "{stage}: {inflight} other micro-batches in flight x {mb:.1f} GiB (1F1B keeps pp - stage of them), "
          "{grads:.1f} GiB of fp32 grads (Megatron's DDP buffer is whole on each rank; Meta's FSDP shards "
          "grads), and {layer:.2f} GiB saved per layer per micro-batch at tp {tp} with SP (TE's LayerNormLinear "
          "and fused attention saves, from sources; of it {mlp:.2f} GiB the MLP's unfused SwiGLU, "
          "TransformerConfig's bias_activation_fusion=False: fused, {fused:.2f}). Meta tuned the micro-batches in "
          "flight of its interleaved schedule and deallocated stage inputs / outputs early (Llama 3 paper, "
          "3.3.2): the schedule's in-flight count is the term to model before this row can agree",
    "N1": "NeMo with fp8 (TransformerEngine keeps fp8 copies of linear inputs: not modelled)",
}


def _closest(r: dict) -> tuple[str, dict]:
    """The ledger a row is predicted with, and its framework config's overrides."""
    if r["framework"] == "titan":
        return "titan", {}
    # Meta's 4D stack and Megatron-LM: the Megatron ledger, TransformerEngine spec (a fused attention that
    # saves no s x s scores), the distributed optimizer
    return "megatron", {"transformer_impl": "transformer_engine", "use_distributed_optimizer": True}


def _pp_split(layers: int, pp: int) -> dict:
    """Megatron's uneven split when pp does not divide the layers: the first and the last stage short by
    the same count, as Llama 3 puts 126 layers on 16 stages (one layer fewer on the first and the last:
    the Llama 3 paper, section 3.3.2)."""
    if layers % pp == 0 or pp < 3:
        return {}
    base = -(-layers // pp)
    short, odd = divmod(base * pp - layers, 2)
    if odd or (layers - 2 * (base - short)) % (pp - 2):
        return {}
    return {"decoder_first_pipeline_num_layers": base - short, "decoder_last_pipeline_num_layers": base - short}


def predict_row(r: dict) -> dict:
    from omegaconf import OmegaConf

    from conf.schema import MegatronConfig, TitanConfig
    from ledger.errors import ConfigError
    from ledger.layout import resolve, validate
    from ledger.parallel import predict
    from ledger.report import heaviest_rank
    from ledger.target import CUDA_NCCL
    from ledger.units import PEAK_PARTS
    from published_runs import framework_of, layout_cfg, model_of

    ran = bool(r["value"]) and r["oom"] != "true"
    out = {"row": int(r["row"]), "group": r["group"], "framework": r["framework"], "model": r["model"],
           "gpus": int(r["gpus"]), "gpu_memory_gib": float(r["gpu_mem_gib"]),
           "published_gib": float(r["memory_gib"]) if r["memory_gib"] else None,
           "happened": "oom" if r["oom"] == "true" else "ran" if ran else "unknown"}
    if out["happened"] == "unknown" and out["published_gib"] is None:
        return {**out, "status": "no memory statement"}
    name, extra = _closest(r)
    opts = set(filter(None, r["options"].split(";")))
    marks = [m for m in ("fp8" if r["precision"] == "fp8" else "", "compile" if "compile" in opts else "") if m]
    model = model_of(r)
    lay_cfg = layout_cfg(r)
    tp, pp, cp, vp = (lay_cfg[k] for k in ("tp", "pp", "cp", "vp"))
    if name == "megatron":
        rc = r["recompute"] or "none"
        kn = {**extra, "precision": "bf16", **_pp_split(model.layers, pp)}
        if rc == "full":
            kn.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif rc.startswith("selective"):
            kn.update(recompute_granularity="selective")
        fw = OmegaConf.structured(MegatronConfig(**kn))
    else:
        fw = framework_of("titan", r)
    try:
        lay = resolve(lay_cfg, framework=name)
        validate(model, lay, name, fw)
        pl = predict(model, lay, fw, target=CUDA_NCCL)
        rank, st = heaviest_rank(pl)
        pk = st.peak
        if pk is None:
            raise ConfigError("the ledger predicts no peak for this layout")
        beside = sum(pl.outside_allocator.values())
    except (ConfigError, ValueError, KeyError) as e:
        return {**out, "status": "refused", "why": str(e)[:200], "ledger": name}
    need = pk.bytes + beside
    gpu = out["gpu_memory_gib"] * GiB
    verdict = "fits" if need <= gpu else "OOM"
    agrees = None if out["happened"] == "unknown" else (verdict == "fits") == (out["happened"] == "ran")
    res = {**out, "ledger": name + ("" if name == r["framework"] else " (closest)"),
           "layout": f"tp{tp} pp{pp} vp{vp} cp{cp} dp{lay.dp} mb{lay.micro_batch_size} ac:{r['recompute'] or 'none'}",
           "status": ("not modelled: " + "+".join(marks) if marks else "covered" if name == r["framework"]
                      else "closest ledger, not the framework"),
           "peak_gib": pk.bytes / GiB, "beside_gib": beside / GiB, "need_gib": need / GiB, "verdict": verdict,
           "agrees": agrees, "rank": rank, "stage": st.stage, "at": pk.what,
           "parts_gib": {p: pk.parts.get(p, 0) / GiB for p in PEAK_PARTS}}
    if out["published_gib"] is not None:
        res["error"] = (need / GiB - out["published_gib"]) / out["published_gib"]
    res["why"] = GROUP_REASONS.get(r["group"], "")
    if r["group"] == "L3":
        res["why"] = res["why"].format(**_l3_terms(model, lay, fw, st))
    return res


def _l3_terms(model, lay, fw, st) -> dict:
    """The Megatron ledger's terms of a Llama 3 405B row at its heaviest rank's stage (GiB): one micro-batch's
    saves there, the micro-batches 1F1B holds beside it, the grads, one layer's saves and its MLP's."""
    from ledger.faithful.megatron.activations import chunk_saved, chunk_units, layer_groups, recompute_of, shape_of
    from ledger.faithful.megatron.knobs import knobs
    from ledger.faithful.megatron.pipeline import stage_shape

    k = knobs(fw)
    rc = recompute_of(k)
    sh = shape_of(model, lay, k)
    n, first, last = stage_shape(model, lay.pp, st.stage, lay.vp, 0, k.pp_split)
    g = layer_groups(sh, rc)
    mb = chunk_saved(chunk_units(sh, rc, n, first, last, model))
    others = st.peak.detail.get("activations/other micro-batches in flight (saved for backward)", 0)
    return {"stage": st.stage, "inflight": round(others / mb), "tp": lay.tp, "mb": mb / GiB, "grads": st.grads_bytes / GiB,
            "layer": sum(g.values()) / GiB, "mlp": g["mlp"] / GiB, "fused": g["mlp"] * 3 / 5 / GiB}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?", default=DEFAULT)
    ap.add_argument("--json", help="write one object per row here")
    a = ap.parse_args(argv)
    with open(a.csv) as f:
        rows = [predict_row(r) for r in csv.DictReader(f)]
    rows = [r for r in rows if r["status"] != "no memory statement"]
    print("target cuda-nccl (from sources, no GPU run confirms it); GiB = 2^30 B; need = peak + beside the tensors")
    print(f"{'row':>4} {'ledger':<20} {'model':<15} {'gpus':>6} {'layout':<36} {'peak':>7} {'beside':>6} {'need':>7} "
          f"{'GPU':>5} {'verdict':<7} {'happened':<8} {'published':>9} {'error':>7}  status")
    for r in rows:
        if "need_gib" not in r:
            print(f"{r['row']:>4} {r.get('ledger', ''):<20} {r['model']:<15} {r['gpus']:>6} {'':<36} {'':>7} {'':>6} "
                  f"{'':>7} {r['gpu_memory_gib']:>5.0f} {'':<7} {r['happened']:<8} "
                  f"{'' if r['published_gib'] is None else format(r['published_gib'], '.1f'):>9} {'':>7}  "
                  f"{r['status']}: {r.get('why', '')}")
            continue
        err = f"{100 * r['error']:+.1f}%" if "error" in r else ""
        mark = "" if r["agrees"] in (None, True) else "  <- DISAGREES"
        print(f"{r['row']:>4} {r['ledger']:<20} {r['model']:<15} {r['gpus']:>6} {r['layout']:<36} {r['peak_gib']:>7.1f} "
              f"{r['beside_gib']:>6.2f} {r['need_gib']:>7.1f} {r['gpu_memory_gib']:>5.0f} {r['verdict']:<7} "
              f"{r['happened']:<8} {'' if r['published_gib'] is None else format(r['published_gib'], '.1f'):>9} "
              f"{err:>7}  {r['status']}{mark}")
    print("\nwhere each peak is (heaviest rank) and its parts (GiB):")
    for r in rows:
        if "parts_gib" in r:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["parts_gib"].items() if v >= 0.05)
            print(f"  row {r['row']}: rank {r['rank']} stage {r['stage']} at {r['at']}: {parts}")
    for g in sorted({r["group"] for r in rows} & set(GROUP_REASONS)):
        why = next((r["why"] for r in rows if r["group"] == g and r.get("why")), GROUP_REASONS[g])
        print(f"  {g}: {why}")
    judged = [r for r in rows if r.get("agrees") is not None and r["status"] == "covered"]
    print(f"\nverdicts judged (covered rows with a fit or OOM statement): {len(judged)}; agree: "
          f"{sum(r['agrees'] for r in judged)}; disagree: {[r['row'] for r in judged if not r['agrees']]}")
    other = [r["row"] for r in rows if r.get("agrees") is False and r["status"] != "covered"]
    if other:
        print(f"not judged, disagreeing (fp8 / compile not modelled, or the closest ledger): rows {other}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
