"""The two targets (ledger/target.py): one layout of each framework predicted for the CPU harness
(cpu-gloo) and for a GPU run (cuda-nccl); their difference is exactly the lines the framework's target
rules (ledger/faithful/<name>/target.py) name, part by part, and nothing else moves."""
from __future__ import annotations

import math

from ledger.dtypes import BF16, FP32
from ledger.model import preset
from ledger.target import CPU_GLOO, CUDA_NCCL
from tests.conftest import megatron_fw, megatron_layout, titan_fw, titan_layout


def _diff(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}


def test_titan_block_moment_differs_by_its_rules():
    """At the last block's post-backward reduce-scatter (FSDP over 2 ranks): NCCL drops gloo's copy of the
    reduce-scatter input; without activation checkpointing the earlier blocks' saves lose CPU SDPA's dense
    mask and the composite RMSNorm's fp32 upcasts (the fused kernel keeps the bf16 input and rstd) and gain
    FlexAttention's max_scores; with selective AC the kept outputs gain flex_attention's; the data loader's
    sample, collated batch and int64 stay on the host (the CPU harness's share the device's memory)."""
    from ledger.faithful.titan import fsdp as F
    from ledger.faithful.titan import peak as P
    from ledger.faithful.titan.target import RULES

    m = preset("llama3_1b")
    lay = titan_layout(world=2)
    sh = F.sharded(m, 1, 2)
    emb, block, head = (sum(math.prod(p.shape) for p in u) for u in F.unit_params(m, 1, 0))
    B, S, L, h = 1, m.seq_len, m.layers, m.hidden
    T, heads, q = B * S, m.heads, m.heads * m.head_dim
    k = L - 1  # blocks 0..k-1 still hold their saves
    for ac in ("none", "selective"):
        fw = titan_fw(activation_checkpoint=ac)
        cpu, gpu = (P._at_block(m, lay, fw, sh, 0, block, emb, k, RULES[t]) for t in (CPU_GLOO, CUDA_NCCL))
        want = {"temporary/gloo reduce-scatter copy of the input": -sh.layer_full * FP32,
                "temporary/batch, document mask, scalars": -(3 * S * 8 + 2 * B * S * 8 + 8)}
        if ac == "none":
            per_block = (-B * S * S * BF16  # the dense mask
                         + 2 * (T * h * BF16 - 2 * T * h * FP32)  # two norms: bf16 input vs fp32 x and x*rsqrt
                         + B * heads * S * FP32)  # flex_attention's max_scores
            want[f"activations/{k} blocks saved (none)"] = k * per_block
        else:
            want["temporary/selective AC kept mm outputs"] = k * (T * q * BF16 + 2 * B * heads * S * FP32)
        assert _diff(cpu.detail, gpu.detail) == want, ac
        assert gpu.bytes - cpu.bytes == sum(want.values())
        assert "(gloo)" in cpu.what and "(NCCL)" in gpu.what


def test_titan_pipeline_moments_differ_by_their_rules():
    """pp2 over FSDP dp2: at perform_reduce_grad NCCL drops gloo's copy of each unit's reduce-scatter input;
    in a micro-batch's backward the attention_norm's saved input is the fused kernel's (bf16 and rstd)."""
    from ledger.faithful.titan import pp_peak as PK
    from ledger.faithful.titan import states as L
    from ledger.faithful.titan.target import RULES

    m = preset("llama3_1b")
    lay = titan_layout(world=4, pp=2, global_batch_size=8)
    cpu_pl, gpu_pl = (L.place(m, lay, titan_fw(activation_checkpoint="none"), t) for t in (CPU_GLOO, CUDA_NCCL))
    seen = []
    real = PK._moments

    def spy(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]
    PK._moments = spy
    try:
        cpu_pl.rank_state(0).peak, gpu_pl.rank_state(0).peak  # noqa: B018
    finally:
        PK._moments = real
    cpu, gpu = seen
    copy = "temporary/gloo copy or divided input (fp32)"
    for a, b in zip(cpu, gpu):
        assert a.what == b.what
        d = _diff(a.detail, b.detail)
        if a.what.startswith("perform_reduce_grad"):
            assert d == {copy: -a.detail[copy]} and a.detail[copy] > 0
        else:  # the saves differ (saved_per_layer's rules, the norm's input); nothing resident or gathered
            assert d and all(k.startswith("activations/") for k in d), (a.what, d)
            assert gpu[0] is not None and b.parts["resident"] == a.parts["resident"]


def test_titan_placement_carries_its_target():
    from ledger.faithful.titan import states as L

    m, lay = preset("llama3_1b"), titan_layout(world=2)
    for t in (CPU_GLOO, CUDA_NCCL):
        pl = L.place(m, lay, titan_fw(), t)
        assert pl.target == t and pl.to_dict()["target"] == t
        assert any("gloo" in n for n in pl.rank_state(0).peak.detail) == (t == CPU_GLOO)
    # the state and the collectives are the target's business of no rule: identical
    a, b = (L.place(m, lay, titan_fw(), t).rank_state(0) for t in (CPU_GLOO, CUDA_NCCL))
    assert a.resident_bytes == b.resident_bytes and [c.to_dict() for c in a.comm] == [c.to_dict() for c in b.comm]


def test_deepspeed_moments_differ_by_their_rules(monkeypatch):
    """ZeRO-1's optimizer step: torch AdamW's foreach update on CUDA holds one fp32 partition where the CPU's
    single-tensor loop holds two; ZeRO-3's IPG reduce-scatters lose gloo's copy of the flat input."""
    from omegaconf import OmegaConf

    from conf.schema import DeepSpeedConfig
    from ledger.faithful.deepspeed import peak as DP
    from ledger.faithful.deepspeed import zero

    inputs = []  # the PeakInputs each rank state's peak is computed from
    real = DP.peak
    monkeypatch.setattr(DP, "peak", lambda i: inputs.append(i) or real(i))
    m = preset("tiny")
    lay = megatron_layout(dp=2, micro_batch_size=2, global_batch_size=4)
    for z in (1, 3):
        fw = OmegaConf.structured(DeepSpeedConfig(zero_stage=z, reduce_bucket_size=200000))
        moments = {}
        for t in (CPU_GLOO, CUDA_NCCL):
            state = zero.place(m, lay, fw, t).rank_state(0)
            state.peak  # noqa: B018  (computes it, through the spy)
            st = DP._Step(inputs[-1])
            moments[t] = [DP.optimizer_step(st, False)] + (DP.ipg_reduce_scatter(st, False) if z == 3 else [])
        d = _diff(moments[CPU_GLOO][0].detail, moments[CUDA_NCCL][0].detail)
        k_cpu, k_gpu = ("temporary/AdamW exp_avg_sq.sqrt() and its / bias_correction2_sqrt",
                        "temporary/AdamW _foreach_sqrt(exp_avg_sq)")
        part = inputs[-1].part * FP32  # one fp32 partition
        assert d == {k_cpu: -2 * part, k_gpu: part}, d
        if z == 3:
            copy = "temporary/gloo's copy of the reduce-scatter input"
            for a, b in zip(moments[CPU_GLOO][1:], moments[CUDA_NCCL][1:]):
                assert _diff(a.detail, b.detail) == {copy: -a.detail[copy]} and a.detail[copy] > 0


def test_megatron_optimizer_moments_differ_by_their_rules():
    """The local spec on both targets: gloo's copy of a grad bucket and AdamW's single-tensor temporaries on
    the CPU; NCCL in place and FusedAdam on a GPU, neither."""
    from ledger.faithful.megatron import peak as MP
    from ledger.faithful.megatron.knobs import knobs

    m, lay = preset("tiny"), megatron_layout(dp=2)
    k = knobs(megatron_fw())
    (sync_c, adam_c), (sync_g, adam_g) = (MP.optimizer_moments(m, lay, k._replace(target=t), 0, 0)
                                          for t in (CPU_GLOO, CUDA_NCCL))
    assert sync_c[0] > 0 and "gloo copy" in sync_c[1] and adam_c[0] > 0 and "Adam" in adam_c[1]
    assert sync_g == (0, "") and adam_g == (0, "")


def test_megatron_te_spec_on_a_cpu_target_is_refused():
    import pytest

    from ledger.errors import ConfigError
    from ledger.faithful.megatron import states

    with pytest.raises(ConfigError, match="transformer_impl=transformer_engine needs CUDA"):
        states.place(preset("tiny"), megatron_layout(dp=2), megatron_fw(transformer_impl="transformer_engine"), CPU_GLOO)
    # unset, the target picks the spec its run builds
    fw = megatron_fw(transformer_impl=None)
    assert states.place(preset("tiny"), megatron_layout(dp=2), fw, CPU_GLOO).spec == "local"
    assert states.place(preset("tiny"), megatron_layout(dp=2), fw, CUDA_NCCL).spec == "transformer_engine"


def test_the_acceptance_command_for_a_gpu_and_for_this_cpu(tmp_path):
    """llama3_8b FSDP8 at seq 8192, micro-batch 2, selective AC: on cluster=local_gpu no gloo copy, no dense
    attention mask, and a line for what a rank holds beside its tensors; on cluster=local_cpu the CPU
    harness's peak with gloo's copy."""
    import json

    from tests.conftest import launch

    args = ("mode=predict", "model=llama3_8b", "model.seq_len=8192", "framework=titan", "layout.dp=8",
            "layout.micro_batch_size=2", "framework.activation_checkpoint=selective")
    out = {}
    for cluster in ("local_gpu", "local_cpu"):
        p = launch(*args, f"cluster={cluster}", f"hydra.run.dir={tmp_path}/{cluster}", timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        out[cluster] = (p.stdout, json.load(open(tmp_path / cluster / "prediction.json")))
    text, pred = out["local_gpu"]
    detail = pred["rank_classes"][0]["peak"]["detail"]
    assert not [k for k in detail if "gloo" in k or "sdpa mask" in k] and "(gloo)" not in pred["rank_classes"][0]["peak"]["what"]
    assert pred["outside_allocator"] and "beside the tensors, per rank (cuda-nccl" in text
    text, pred = out["local_cpu"]
    assert pred["target"] == CPU_GLOO and "gloo copy or divided input (fp32)" in str(pred["rank_classes"][0]["peak"])
    assert "outside_allocator" not in pred


# Llama-2-70B FSDP64 on A100-80GB at seq 4096 (torchtitan docs/performance.md, the published runs' rows
# 10-12): local batch 1 with selective AC and local batch 2 with full AC ran; local batch 2 with selective
# AC is published as out of memory
_RUNS = """row,group,framework,model,arch,layers,hidden,ffn_hidden,heads,kv_heads,vocab,tied_embeddings,gpus,gpu,gpu_mem_gib,gpus_per_node,network_gbps_per_gpu,seq_len,micro_batch,global_batch,tp,pp,vp,pp_schedule,dp,cp,ep,recompute,precision,options,metric,value,mfu,memory_gib,oom,src
10,TA,titan,Llama-2-70B,llama,80,8192,28672,64,8,32000,false,64,A100-SXM-80GB,80,8,,4096,1,64,1,1,,,64,1,1,selective-op,bf16,,tokens_per_s_per_gpu,355,,,,P
11,TA,titan,Llama-2-70B,llama,80,8192,28672,64,8,32000,false,64,A100-SXM-80GB,80,8,,4096,2,128,1,1,,,64,1,1,full,bf16,,tokens_per_s_per_gpu,353,,,,P
12,TA,titan,Llama-2-70B,llama,80,8192,28672,64,8,32000,false,64,A100-SXM-80GB,80,8,,4096,2,128,1,1,,,64,1,1,selective,bf16,,,,,,true,P
"""


def test_published_fit_and_oom_statements_agree_with_the_cuda_verdict():
    import csv
    import io
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, f"{REPO}/benchmarks")
    from published_memory import predict_row

    rows = {int(r["row"]): predict_row(r) for r in csv.DictReader(io.StringIO(_RUNS))}
    assert {k: (r["verdict"], r["happened"]) for k, r in rows.items()} == {
        10: ("fits", "ran"), 11: ("fits", "ran"), 12: ("OOM", "oom")}
    assert all(r["agrees"] and r["beside_gib"] > 0 for r in rows.values())


def test_titan_shard_to_shard_runs_as_an_all_gather_on_a_cpu_mesh():
    """DTensor's Shard(i) -> Shard(j) redistribution: an all-gather on gloo's cpu mesh (torch's
    shard_dim_alltoall), all_to_all on NCCL's; the same bytes, the same count."""
    from ledger.faithful.titan import states as L
    from ledger.model import ModelShape

    m = ModelShape(layers=2, hidden=1024, ffn_hidden=3584, heads=16, kv_heads=4, vocab=1024, seq_len=1024)
    lay = titan_layout(world=4, tp=4)
    rows = {t: [c for c in L.place(m, lay, titan_fw(activation_checkpoint="none"), t).rank_state(0).comm
                if c.what == "DTensor mm backward redistribution"] for t in (CPU_GLOO, CUDA_NCCL)}
    cpu = {c.kind: (c.count, c.buffer_bytes) for c in rows[CPU_GLOO]}
    gpu = {c.kind: (c.count, c.buffer_bytes) for c in rows[CUDA_NCCL]}
    assert "all_to_all" not in cpu and gpu["all_to_all"][0] > 0
    assert cpu["all_gather"][0] == gpu["all_gather"][0] + gpu["all_to_all"][0]
    assert cpu["reduce_scatter"] == gpu["reduce_scatter"]


def test_megatron_te_spec_keeps_its_cublas_workspace_beside_the_tensors():
    """TransformerEngine's GEMMs keep one cuBLAS workspace (module/base.py get_workspace: 32 MiB + 1 KiB on
    Hopper) in the allocator, beside what the probe sees: a cuda-nccl prediction of the TE spec names it
    among what a rank holds beside its tensors; the local spec (its GEMMs torch's) and a CPU target do not."""
    from ledger.faithful.megatron import target as MT
    from ledger.parallel import predict

    m, lay = preset("tiny"), megatron_layout(dp=2)
    te = predict(m, lay, megatron_fw(transformer_impl="transformer_engine"), target=CUDA_NCCL)
    local = predict(m, lay, megatron_fw(transformer_impl="local"), target=CUDA_NCCL)
    cpu = predict(m, lay, megatron_fw(transformer_impl="local"), target=CPU_GLOO)
    extra = {k: v for k, v in te.outside_allocator.items() if k not in local.outside_allocator}
    assert list(extra.values()) == [32 * 1024 * 1024 + 1024] and "TransformerEngine" in next(iter(extra))
    assert sum(te.outside_allocator.values()) - sum(local.outside_allocator.values()) == MT.TE_CUBLAS_WORKSPACE
    assert not cpu.outside_allocator and not cpu.workspaces
