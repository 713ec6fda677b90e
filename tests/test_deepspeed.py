"""DeepSpeed ZeRO-1/2/3: real runs on local gloo ranks reconciled to the byte, the model/ledger name
agreement, the faithful ledger's rules, and the dry artifacts checked by DeepSpeed's own parser.

The real matrix (one fixture of 45 jobs; among its sweeps):

    # bf16, reduce_bucket_size below the embedding: extra-large parameters reduced on their own
    python launch.py -m framework=deepspeed framework.zero_stage=1,2,3 cluster.ranks=2,4 \\
        framework.reduce_bucket_size=65536 train.steps=3
    # ZeRO-3 per-module fetch (3N): 2 ranks with 2 micro-batches, 4 ranks with 1; tied and untied
    python launch.py -m framework=deepspeed framework.zero_stage=3 cluster.ranks=2,4 \\
        framework.reduce_bucket_size=500000 framework.stage3_prefetch_bucket_size=0 \\
        framework.stage3_max_reuse_distance=0 layout.global_batch_size=4 model.tied_embeddings=false,true \\
        train.steps=3
    # 2 micro-batches per step (gradient accumulation), ZeRO-2 and ZeRO-3 (default prefetch: 2N), tied and untied
    python launch.py -m framework=deepspeed framework.zero_stage=2,3 cluster.ranks=2 \\
        framework.reduce_bucket_size=65536 layout.global_batch_size=4 model.tied_embeddings=false,true \\
        train.steps=3
    # fp32 (no bf16 section), 4 ranks, 2 micro-batches
    python launch.py -m framework=deepspeed framework.zero_stage=1,2,3 cluster.ranks=4 framework.precision=fp32 \\
        framework.reduce_bucket_size=100000 layout.global_batch_size=8 train.steps=3
    # ZeRO-3 budgets between per-module fetch and one coalesced fetch (the coordinator replay):
    # prefetch bucket above a layer's largest param, below the model; max live params that binds;
    # a reuse distance that keeps the output and final norm from forward to backward
    python launch.py -m framework=deepspeed framework.zero_stage=3 cluster.ranks=2,4 \\
        framework.reduce_bucket_size=500000 framework.stage3_prefetch_bucket_size=300000 \\
        framework.stage3_max_live_parameters=600000 framework.stage3_max_reuse_distance=400000 \\
        layout.global_batch_size=4 train.steps=3
    python launch.py -m framework=deepspeed framework.zero_stage=3 cluster.ranks=2 \\
        framework.reduce_bucket_size=500000 framework.stage3_prefetch_bucket_size=100000 \\
        framework.stage3_max_live_parameters=250000 framework.stage3_max_reuse_distance=150000 \\
        layout.global_batch_size=4 model.tied_embeddings=false,true train.steps=3
    # fp32 at one micro-batch: ZeRO-1's reduce_gradients and ZeRO-2's backward past the output layer
    python launch.py -m framework=deepspeed framework.zero_stage=1,2 cluster.ranks=4 framework.precision=fp32 \
        framework.reduce_bucket_size=100000 layout.global_batch_size=4 train.steps=3
    # 4 samples per micro-batch: without checkpointing the activations make the peak (the start of
    # backward); with deepspeed.checkpointing.checkpoint around each layer it is the optimizer step's again
    python launch.py -m framework=deepspeed framework.zero_stage=2 cluster.ranks=2 \
        framework.activation_checkpointing=false,true framework.reduce_bucket_size=65536 \
        layout.micro_batch_size=4 layout.global_batch_size=8 train.steps=3

(The commands as a user would type them; the fixture runs the ZeRO-1/2 jobs of each at two steps, the
first and a steady one, and ZeRO-3's at three: by_steps.) Every job also reconciles its per-rank peak
within a step (ledger/faithful/deepspeed/peak.py):
peak_bytes and its parts; and the most live activations against the last step's timeline.

The tiny model's embedding and output have 262,144 elements, w1/w2/w3 196,608, wq/wo 65,536.
reduce_bucket_size=500000 fits every parameter and splits the gradients into several IPG buckets;
65536 is below the embedding and w1/w2/w3, which DeepSpeed then reduces outside the IPG buffer, and at
4 ranks (ZeRO-1/2 partitions of 885,312 elements) layer 0's w1 straddles a partition boundary with a
first slice of 65,600 > 65,536 elements: two all-reduces for it. At 100000 the same w1 is one
all-reduce (65,600 fits, the sum of both slices does not). Small buckets also keep ZeRO-3's
always-allocated IPG buffer small (the default's 5e8 elements is 1 GB).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from collections import Counter

import pytest

import records

from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, numel, preset
from tests.conftest import assert_every_row_reconciles, launch_many

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_BUCKET = 500_000
BELOW_EMBEDDING = 65_536
FP32_BUCKET = 100_000
# ZeRO-3 completes its trace in the second step (its prediction's one warm-up step), so its third is the
# first steady one; ZeRO-1/2's second is. The steady checks read each job's last step. A sweep over stages
# runs as two multiruns (by_steps), ZeRO-1/2 at two steps and ZeRO-3 at three
STEPS = 3
STEPS_OF = {1: 2, 2: 2, 3: STEPS}


def by_steps(sweep: list[str]) -> list[list[str]]:
    """A sweep's arguments as one multirun per step count (STEPS_OF) of its zero stages, each with its
    train.steps."""
    stage_arg = next(a for a in sweep if a.startswith("framework.zero_stage="))
    stages = [int(x) for x in stage_arg.split("=", 1)[1].split(",")]
    rest = [a for a in sweep if a != stage_arg and not a.startswith("train.steps=")]
    out = []
    for n in sorted({STEPS_OF[z] for z in stages}):
        picked = ",".join(str(z) for z in stages if STEPS_OF[z] == n)
        out.append([*rest, f"framework.zero_stage={picked}", f"train.steps={n}"])
    return out
MATRIX = ["framework=deepspeed", "framework.zero_stage=1,2,3", "cluster.ranks=2,4",
          f"framework.reduce_bucket_size={BELOW_EMBEDDING}"]
GAS2 = ["framework=deepspeed", "framework.zero_stage=2,3", "cluster.ranks=2", f"framework.reduce_bucket_size={BELOW_EMBEDDING}",
        "layout.global_batch_size=4", "model.tied_embeddings=false,true"]
KNOBS0 = ["framework=deepspeed", "framework.zero_stage=3", "cluster.ranks=2,4",
          f"framework.reduce_bucket_size={SMALL_BUCKET}", "framework.stage3_prefetch_bucket_size=0",
          "framework.stage3_max_reuse_distance=0", "layout.global_batch_size=4", "model.tied_embeddings=false,true"]
_Z3 = ["framework=deepspeed", "framework.zero_stage=3", f"framework.reduce_bucket_size={SMALL_BUCKET}",
       "layout.global_batch_size=4"]
BUDGETS = _Z3 + ["cluster.ranks=2,4", "framework.stage3_prefetch_bucket_size=300000",
                 "framework.stage3_max_live_parameters=600000", "framework.stage3_max_reuse_distance=400000"]
BUDGETS_SMALL = _Z3 + ["cluster.ranks=2", "framework.stage3_prefetch_bucket_size=100000",
                       "framework.stage3_max_live_parameters=250000", "framework.stage3_max_reuse_distance=150000",
                       "model.tied_embeddings=false,true"]
AC = ["framework=deepspeed", "framework.zero_stage=2", "cluster.ranks=2", "framework.activation_checkpointing=false,true",
      f"framework.reduce_bucket_size={BELOW_EMBEDDING}", "layout.micro_batch_size=4", "layout.global_batch_size=8"]
# the long-sequence jobs' narrow Llama: at s = 512 hidden 128 (vocab 320) peaks at the same backward moments as
# the tiny model's hidden 256, at a fraction of the bf16 FLOPs
NARROW = ["model.seq_len=512", "model.hidden=128", "model.ffn_hidden=384", "model.vocab=320"]
# checkpointed layers at s = 512: the peak is in a layer's backward after its recompute (its SwiGLU mul), the
# blocks below holding their inputs, the recomputed block its output
AC_LONG = ["framework=deepspeed", "framework.zero_stage=2", "cluster.ranks=2", "framework.activation_checkpointing=true",
           *NARROW, f"framework.reduce_bucket_size={BELOW_EMBEDDING}", "layout.micro_batch_size=2",
           "layout.global_batch_size=4"]
# ZeRO-3 with checkpointing: the recompute fetches each block's modules again inside the backward (the trace
# and the replay with its budgets: every all-gather and the trace checks' broadcasts); at s = 512 the peak is in
# block 3's SwiGLU backward after its recompute, with the coordinator's gathered params there
Z3_AC = _Z3 + ["cluster.ranks=2", "framework.activation_checkpointing=true", "framework.stage3_prefetch_bucket_size=300000",
               "framework.stage3_max_live_parameters=600000", "framework.stage3_max_reuse_distance=400000"]
Z3_AC_LONG = ["framework=deepspeed", "framework.zero_stage=3", "cluster.ranks=2", "framework.activation_checkpointing=true",
              *NARROW, f"framework.reduce_bucket_size={BELOW_EMBEDDING}", "layout.micro_batch_size=2",
              "layout.global_batch_size=4"]
FP32 = ["framework=deepspeed", "framework.zero_stage=1,2,3", "cluster.ranks=4", "framework.precision=fp32",
        f"framework.reduce_bucket_size={FP32_BUCKET}", "layout.global_batch_size=8"]
# one micro-batch, fp32, 4 ranks: ZeRO-1 peaks in reduce_gradients at the boundary (its first copy into
# grads_in_partition, every gradient still live), ZeRO-2 deep in backward (deepspeed_backward)
FP32_ONE = ["framework=deepspeed", "framework.zero_stage=1,2", "cluster.ranks=4", "framework.precision=fp32",
            f"framework.reduce_bucket_size={FP32_BUCKET}", "layout.global_batch_size=4"]
# DeepSpeed's default bucket (1 GB of bf16): ZeRO-2 peaks at the IPG buffer's allocation at the backward's
# first hook, ZeRO-1 (its hooks keep every gradient) in block 3's ffn_norm backward
DEFAULT_BUCKET = ["framework=deepspeed", "framework.zero_stage=1,2", "cluster.ranks=2"]
# ZeRO-3 at 3 ranks: dp divides no norm weight, so every persistent param's storage is its padded all-gather
# buffer, and a bucket of one wq + one norm fills by ds_numel (27 reduce-scatters; padded sizes: 35)
ODD_BUCKET = 65_536 + 256
ODD = ["framework=deepspeed", "framework.zero_stage=3", "cluster.ranks=3", f"framework.reduce_bucket_size={ODD_BUCKET}",
       "layout.global_batch_size=3"]
# ZeRO-3 with DeepSpeed's default bucket (every gradient in one) and short sequences: the peak is the
# backward epilogue's reduce-scatter (the whole model's padded gradients cat'ed and gloo's copy of them);
# with a bucket of every gradient but the embedding's, the reduce-scatter at the embedding's hook (untied,
# and tied in EMB_TIED: there both uses' gradients are one)
EPILOGUE = ["framework=deepspeed", "framework.zero_stage=3", "cluster.ranks=4", "model.seq_len=32",
            "framework.reduce_bucket_size=500000000,3279104"]
EMB_TIED = ["framework=deepspeed", "framework.zero_stage=3", "cluster.ranks=4", "model.seq_len=32",
            "model.tied_embeddings=true", "framework.reduce_bucket_size=3016960"]
# DeepSpeed-Ulysses (layout.cp): ZeRO over the sequence-data-parallel group, DistributedAttention's
# all-to-alls over each sequence group; ZeRO-3 at cp2 dp2 with DeepSpeed's default fp32 reductions (its
# IPG bucket in fp32), ZeRO-1 / ZeRO-2 at cp2 with bf16 ones (their bucket all-reduces in fp32 anyway) and
# activation checkpointing (the recompute's all-to-alls)
ULYSSES_Z3 = ["framework=deepspeed", "framework.zero_stage=3", "cluster.ranks=4", "layout.cp=2",
              f"framework.reduce_bucket_size={SMALL_BUCKET}", "layout.global_batch_size=4"]
ULYSSES_Z12 = ["framework=deepspeed", "framework.zero_stage=1,2", "cluster.ranks=2", "layout.cp=2",
               "framework.seq_parallel_communication_data_type=bf16", f"framework.reduce_bucket_size={BELOW_EMBEDDING}",
               "framework.activation_checkpointing=true",
               "layout.global_batch_size=2"]
# ZeRO-1 / ZeRO-2 at cp2 with one bucket for every gradient (reduce_bucket_size above the 3.5M of them):
# their one reduction's fp32 cast (allreduce_bucket) is the step's peak (peak.py cast_copies)
ULYSSES_CAST = ["framework=deepspeed", "framework.zero_stage=1,2", "cluster.ranks=2", "layout.cp=2",
                "framework.reduce_bucket_size=4000000", "layout.global_batch_size=2"]
ULYSSES = ("ulysses_z3", "ulysses_z12", "ulysses_cast")
# ZeRO-Offload (offload_optimizer.device=cpu, pinned) at 4 ranks, 2 micro-batches, extra-large output and
# embedding gradients: the host buffers (ZeRO-2's accumulated_grads_in_cpu among them), host_bytes; ZeRO-1's
# peak at the backward's start, ZeRO-2's last rank's at its first reduction's copy into the host partition
# (inside the peak's bound: the fp64 norm of the output weight and its clone); ZeRO-3 with its parameters
# offloaded too, its peak at the final norm's forward
OFFLOAD = ["framework=deepspeed", "framework.zero_stage=1,2", "cluster.ranks=4", "framework.offload_optimizer=cpu",
           "framework.offload_optimizer_pin_memory=true", f"framework.reduce_bucket_size={BELOW_EMBEDDING}",
           "layout.global_batch_size=8"]
OFFLOAD_Z3 = [*OFFLOAD[:1], "framework.zero_stage=3", *OFFLOAD[2:], "framework.offload_param=cpu",
              "framework.offload_param_pin_memory=true"]
# buckets of every gradient up to block 0's ffn_norm (its first hook), wv (one between) and attention_norm (its
# last): the reduce-scatter at that hook peaks (nothing prefetched or kept, so no forward moment above it). The
# block's other hooks (a bucket up to wo: 3,115,008; wk: 3,196,928; wq: 3,213,312) peak the same way
HOOK_BUCKETS = {"ffn_norm": 3_114_752, "wv": 3_180_544, "attention_norm": 3_278_848}
HOOKS = ["framework=deepspeed", "framework.zero_stage=3", "cluster.ranks=4", "model.seq_len=32",
         "framework.stage3_prefetch_bucket_size=0", "framework.stage3_max_reuse_distance=0",
         "framework.reduce_bucket_size=" + ",".join(map(str, HOOK_BUCKETS.values()))]


def _fw(**kw):
    from omegaconf import OmegaConf

    from conf.schema import DeepSpeedConfig

    c = OmegaConf.structured(DeepSpeedConfig)
    for k, v in kw.items():
        c[k] = v
    return c


def _lay(dp: int, mbs: int = 1, gbs: int | None = None) -> Layout:
    return Layout(tp=1, pp=1, dp=dp, dp_replicate=1, cp=1, ep=1, vp=1, sequence_parallel=False,
                  micro_batch_size=mbs, global_batch_size=gbs or mbs * dp)


@pytest.mark.parametrize("z", [1, 2, 3])
def test_rank_stage_is_the_pipeline_stage(z):
    """RankState.stage is the pipeline stage (tables group ranks by it), not the ZeRO stage."""
    from ledger.faithful.deepspeed import zero as L

    pl = L.place(preset("tiny"), _lay(2), _fw(zero_stage=z))
    assert {pl.rank_state(r).stage for r in range(2)} == {0} and records.predicted_ranks(pl.to_dict())(1)["stage"] == 0


# -- model and ledger agree ----------------------------------------------------------------------

@pytest.mark.parametrize("over", [{}, {"bias": True, "norm": "layernorm"}, {"swiglu": False}, {"tied_embeddings": True}])
def test_llama_parameters_are_the_ledgers(over):
    from launchers.llama import Llama

    shape = preset("tiny", **over)
    model = Llama(shape)
    got = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert got == shape.params()
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()


def test_llama_trains_a_step():
    import torch

    from launchers.data import batch
    from launchers.llama import Llama

    shape = preset("tiny", layers=1)
    torch.manual_seed(0)
    model = Llama(shape)
    x, y = batch(shape.vocab, shape.seq_len, 2, 0, 0, 0, 0, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the next tokens
    loss = model(x, y)
    assert abs(loss.item() - math.log(shape.vocab)) < 0.5  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_batches_are_seeded():
    import torch

    from launchers.data import batch

    a = batch(1024, 16, 2, 7, 3, 1, 0, 2)
    assert torch.equal(a[0], batch(1024, 16, 2, 7, 3, 1, 0, 2)[0])
    assert not torch.equal(a[0], batch(1024, 16, 2, 7, 3, 1, 1, 2)[0])  # other DP rank, other tokens


# -- faithful ledger rules -----------------------------------------------------------------------

def test_ipg_bucket_rule():
    from ledger.faithful.deepspeed.common import ipg_buckets

    assert ipg_buckets([3, 3, 3], 6) == [6, 3]  # fits exactly: no flush
    assert ipg_buckets([4, 3, 1], 6) == [4, 4]  # would overflow: flush first
    assert ipg_buckets([5], 6) == [5]


def test_extra_large_gradient_all_reduce_chunks():
    """average_tensor cuts an extra-large gradient at partition boundaries; allreduce_and_scatter adds
    slices until their sum exceeds reduce_bucket_size and all-reduces them."""
    from ledger.faithful.deepspeed.zero12 import allreduce_chunks

    # tiny, 4 ranks: layer 0's w1 at flat offset 819,712 straddles the first boundary (885,312)
    assert allreduce_chunks(196_608, 819_712, 885_312, 65_536) == [65_600, 131_008]
    assert allreduce_chunks(196_608, 819_712, 885_312, 100_000) == [196_608]  # 65,600 fits; the sum does not
    assert allreduce_chunks(262_144, 0, 885_312, 65_536) == [262_144]  # inside one partition: one call
    # llama3_70b's embedding (1,050,673,152 elements, first in the flat group) at dp 1024, default bucket:
    # slices of one partition each, calls of 8 slices (8 x 68.9M > 5e8)
    n, flat = 1_050_673_152, 70_553_706_496
    part = flat // 1024
    chunks = allreduce_chunks(n, 0, part, 500_000_000)
    assert sum(chunks) == n and chunks[:-1] == [8 * part] * (len(chunks) - 1) and 0 < chunks[-1] <= 8 * part


def test_flat_offsets_follow_registration():
    """Each parameter's offset in the flat group (registration order), found from either order."""
    from ledger.faithful.deepspeed.common import backward_order
    from ledger.faithful.deepspeed.zero12 import _flat_offset

    for over in ({}, {"bias": True, "norm": "layernorm"}, {"tied_embeddings": True}, {"swiglu": False}):
        shape = preset("tiny", **over)
        params = shape.params()
        sizes = [numel(sh) for _, sh in params]
        at = {name: sum(sizes[:i]) for i, (name, _) in enumerate(params)}
        assert [_flat_offset(shape, True, i) for i in range(len(params))] == [at[nm] for nm, _ in params]
        assert [_flat_offset(shape, False, i) for i in range(len(params))] == [at[nm] for nm, _ in backward_order(shape)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_larger_than_the_bucket(stage):
    """Each extra-large gradient is reduced on its own (ZeRO-1/2: one more all-reduce at 4 ranks where
    w1 straddles a partition boundary); bytes unchanged; ZeRO-3 keeps its IPG buffer allocated."""
    from ledger.faithful.deepspeed.common import grad_sizes as _grad_sizes, ipg_buckets
    from ledger.faithful.deepspeed.zero import place
    from ledger.faithful.deepspeed.zero12 import _buckets12

    shape = preset("tiny")
    n = shape.num_params()
    for dp in (2, 4):
        s = place(shape, _lay(dp), _fw(zero_stage=stage, reduce_bucket_size=BELOW_EMBEDDING)).rank_state(0)
        c = {(x.kind, x.dtype): (x.count, x.buffer_bytes) for x in s.comm}
        if stage == 3:
            assert c[("reduce_scatter", "bf16")][0] == len(ipg_buckets(_grad_sizes(shape), BELOW_EMBEDDING))
            assert s.detail["grads/IPG bucket (reduce_bucket_size)"] == 2 * BELOW_EMBEDDING
        else:
            buckets = _buckets12(shape, BELOW_EMBEDDING, stage == 1)
            assert sum(b for b, off in buckets if off >= 0) == 2 * 262_144 + 3 * 4 * 196_608
            assert c[("all_reduce", "bf16")] == (len(buckets) + (dp == 4), 2 * n)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_prediction(stage):
    """fp32: the flat params / partitions, gradients and collectives in fp32, still an fp32 master
    copy; ZeRO-1/2 skip the overflow all-reduce."""
    from ledger.faithful.deepspeed.zero import place

    shape = preset("tiny")
    n = shape.num_params()
    b, p = (place(shape, _lay(4), _fw(zero_stage=stage, reduce_bucket_size=FP32_BUCKET, precision=x)).rank_state(0)
            for x in ("bf16", "fp32"))
    assert p.params_bytes == 2 * b.params_bytes and p.optim_bytes == b.optim_bytes
    assert p.grads_bytes == 2 * b.grads_bytes
    kinds = {(c.kind, c.dtype) for c in p.comm}
    if stage == 3:
        assert kinds == {("all_gather", "fp32"), ("reduce_scatter", "fp32"), ("all_reduce", "fp64")}
        assert p.grads_bytes == 4 * n // 4 + 4 * FP32_BUCKET
    else:
        assert kinds == {("all_gather", "fp32"), ("all_reduce", "fp32")} and p.params_bytes == 4 * n
        assert ("all_reduce", "uint8") in {(c.kind, c.dtype) for c in b.comm}
    cb = {(c.kind, c.dtype): (c.count, c.buffer_bytes) for c in b.comm}
    cp = {(c.kind, c.dtype): (c.count, c.buffer_bytes) for c in p.comm}
    norm = (1, 4) if stage < 3 else (0, 0)  # ZeRO-1/2's fp32 grad norm all-reduce joins the fp32 IPG ones
    for kind in ("all_gather", "all_reduce", "reduce_scatter"):
        if (kind, "bf16") in cb:
            count, nbytes = cb[(kind, "bf16")]
            extra = norm if kind == "all_reduce" else (0, 0)
            assert cp[(kind, "fp32")] == (count + extra[0], 2 * nbytes + extra[1])


def test_llama3_70b_with_default_knobs():
    """The 70B embedding (1.05e9 elements) exceeds the default reduce_bucket_size (5e8): predicted, not refused;
    ZeRO-3 at DeepSpeed's default budgets (a 5e7 prefetch bucket is smaller than one w1): the coordinator
    replay gathers nearly every param twice per micro-batch (forward and backward)."""
    from ledger.faithful.deepspeed.zero import place

    shape = preset("llama3_70b")
    n = shape.num_params()
    for stage in (1, 2, 3):
        for dp in (8, 1024):
            s = place(shape, _lay(dp), _fw(zero_stage=stage)).rank_state(0)
            red = [c for c in s.comm if c.kind in ("all_reduce", "reduce_scatter") and c.dtype == "bf16"]
            assert len(red) == 1 and red[0].buffer_bytes >= 2 * n
            if stage == 3:
                ag = next(c for c in s.comm if c.kind == "all_gather")
                assert 2 * 2 * n * 0.95 < ag.buffer_bytes < 2 * 2 * n * 1.05


def test_backward_order_covers_every_parameter_once():
    from ledger.faithful.deepspeed.common import backward_order, grad_sizes as _grad_sizes
    from ledger.faithful.deepspeed.common import registration_sizes as _registration_sizes

    for over in ({}, {"bias": True, "norm": "layernorm"}, {"swiglu": False}, {"tied_embeddings": True}):
        shape = preset("tiny", **over)
        order = backward_order(shape)
        assert sorted(order) == sorted(shape.params())
        first = "norm.weight" if shape.tied_embeddings else "output.weight"
        assert order[0][0] == first and order[-1][0] == "tok_embeddings.weight"
        # the per-block size lists the hot path uses are these orders' sizes
        assert list(_grad_sizes(shape)) == [numel(s) for _, s in order]
        assert list(_registration_sizes(shape)) == [numel(s) for _, s in shape.params()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_is_sharded_as_zero_says(stage):
    """Resident bytes follow the stage: optimizer state / N_d always, params / N_d at stage 3."""
    from ledger.faithful.deepspeed.zero import place

    shape = preset("tiny")
    n = shape.num_params()
    s2, s4 = (place(shape, _lay(d), _fw(zero_stage=stage, reduce_bucket_size=SMALL_BUCKET)).rank_state(0)
              for d in (2, 4))
    assert s2.optim_bytes - 4 == 12 * n // 2 and s4.optim_bytes - 4 == 12 * n // 4
    if stage == 3:
        assert s2.detail["params/bf16 partitions (ds_tensor, fp16_partitioned_groups_flat)"] == 2 * n // 2
        assert s2.detail["grads/IPG bucket (reduce_bucket_size)"] == 2 * SMALL_BUCKET
    else:
        assert s2.params_bytes == s4.params_bytes == 2 * n and s2.grads_bytes == 0
        assert not any(c.kind == "reduce_scatter" for c in s2.comm)


def test_ledger_refuses_what_it_does_not_model():
    from ledger.faithful.deepspeed.zero import place

    shape = preset("tiny")
    with pytest.raises(ConfigError, match="precision"):
        place(shape, _lay(2), _fw(precision="fp16"))
    with pytest.raises(ConfigError, match="contiguous_gradients"):
        place(shape, _lay(2), _fw(contiguous_gradients=False))
    # ZeRO-3 budgets of any size are predicted (the coordinator replay), DeepSpeed's defaults included
    for kw in ({}, dict(stage3_prefetch_bucket_size=1000), dict(stage3_max_live_parameters=1),
               dict(stage3_prefetch_bucket_size=300_000, stage3_max_reuse_distance=10**6)):
        for gbs in (2, 4):
            place(shape, _lay(2, gbs=gbs), _fw(zero_stage=3, reduce_bucket_size=SMALL_BUCKET, **kw)).rank_state(0).comm


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ulysses_is_the_flat_layout_plus_the_all_to_alls(stage):
    """DeepSpeed-Ulysses at cp 2 x dp 2 (ulysses.py): the states of ZeRO at dp 4 on s / 2 tokens but ZeRO-3's IPG
    bucket in DeepSpeed's default fp32 reductions; the flat layout's collectives over the cp-dp group, ZeRO-1/2's
    bucket all-reduces in fp32 (twice the bf16 bytes), ZeRO-3's reduce-scatters in the comm dtype; per layer and
    micro-batch 8 all-to-alls over cp; the flat layout's peak with Ulysses' saves."""
    import dataclasses

    from ledger.faithful.deepspeed.activations import batch_bytes, layer_activations
    from ledger.faithful.deepspeed.zero import place

    shape = preset("tiny")
    lay = dataclasses.replace(_lay(2, gbs=4), cp=2)
    flat_shape = dataclasses.replace(shape, seq_len=shape.seq_len // 2)
    for comm_dtype in ("fp32", "bf16"):
        fw = _fw(zero_stage=stage, reduce_bucket_size=SMALL_BUCKET, seq_parallel_communication_data_type=comm_dtype)
        u, f = place(shape, lay, fw).rank_state(0), place(flat_shape, _lay(4, gbs=8), fw).rank_state(0)
        extra = 2 * SMALL_BUCKET if stage == 3 and comm_dtype == "fp32" else 0
        assert (u.params_bytes, u.grads_bytes, u.optim_bytes) == (f.params_bytes, f.grads_bytes + extra, f.optim_bytes)
        # the peak: the flat layout's with Ulysses' own saves (a layer's wo input, an all-to-all output of its
        # own; the whole sequence's batch); the matrix's Ulysses jobs measure it (test_peak_rows)
        b, s, hd = 1, flat_shape.seq_len, flat_shape.heads * flat_shape.head_dim
        assert (layer_activations(flat_shape, b, 2, sp=2)["attention"] - layer_activations(flat_shape, b, 2)["attention"]
                == 2 * b * s * hd)
        assert batch_bytes(flat_shape, b, 2) == 8 * (shape.seq_len + 1) and batch_bytes(flat_shape, 2, 2) == 16 * 2 * (s + 2 * s)
        assert u.peak is not None and u.peak.bytes > f.peak.bytes
        rows = {(c.dim, c.kind, c.dtype): c for c in u.comm}
        flat_rows = {(c.dim, c.kind, c.dtype): c for c in f.comm}
        local = shape.seq_len // 2 * shape.head_dim * 2
        a2a = rows.pop(("cp", "all_to_all", "bf16"))
        assert (a2a.count, a2a.buffer_bytes) == (8 * shape.layers * 2, 2 * shape.layers * 4 * local * (shape.heads + shape.kv_heads))
        red = ("all_reduce", "bf16") if stage < 3 else ("reduce_scatter", "bf16")
        want = "fp32" if stage < 3 else comm_dtype
        got = rows[("cp-dp", red[0], want)]
        flat_red = flat_rows[("dp", *red)]
        assert got.count == flat_red.count + (1 if stage < 3 and want == "fp32" else 0)  # + the fp32 grad norm
        assert got.buffer_bytes == (2 if want == "fp32" else 1) * flat_red.buffer_bytes + (4 if stage < 3 else 0)
        assert {k[0] for k in rows} == {"cp-dp"}


def test_dry_hands_train_ds_the_ulysses_setup(tmp_path):
    """mode=dry with layout.cp: ds_config.json carries sequence_parallel_size and the reductions' dtype, and
    train_ds.py sets Ulysses up as the run does (launchers/deepspeed.py ulysses: the mpu, DistributedAttention,
    each rank's slice)."""
    import ast

    from tests.conftest import launch

    p = launch("mode=dry", "framework=deepspeed", "cluster=local_gpu", "model=llama3_1b", "layout.cp=4",
               f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    conf = json.load(open(tmp_path / "ds_config.json"))
    assert conf["sequence_parallel_size"] == 4 and conf["seq_parallel_communication_data_type"] == "fp32"
    assert conf["train_batch_size"] == 2  # dp = 8 GPUs / cp 4
    src = (tmp_path / "train_ds.py").read_text()
    ast.parse(src)
    assert "ulysses(sp, shape)" in src and "mpu=mpu" in src and "x[:, piece]" in src


def test_ulysses_refusals_name_the_rule():
    import dataclasses

    from ledger.faithful.deepspeed.zero import place
    from ledger.faithful.deepspeed.rules import validate_layout

    lay = dataclasses.replace(_lay(1, gbs=1), cp=4)
    with pytest.raises(ConfigError, match="kv_heads=2 must be divisible by cp"):
        validate_layout(preset("tiny"), lay, _fw())
    with pytest.raises(ConfigError, match="seq_parallel_communication_data_type=fp16"):
        place(preset("tiny"), dataclasses.replace(_lay(1, gbs=1), cp=2), _fw(seq_parallel_communication_data_type="fp16"))
    with pytest.raises(ConfigError, match="tp=2 pp=1"):
        validate_layout(preset("tiny"), dataclasses.replace(_lay(1), tp=2), _fw())
    # a value DeepSpeed does not know, refused by name whatever cp (before any rank starts)
    from ledger.faithful.deepspeed.rules import validate_knobs

    with pytest.raises(ConfigError, match=r"framework.seq_parallel_communication_data_type='int8' must be one of fp32"):
        validate_knobs(_fw(seq_parallel_communication_data_type="int8"))


def test_zero3_3n_versus_2n_prediction():
    from ledger.faithful.deepspeed.zero import place

    shape = preset("tiny")
    n = shape.num_params()
    persist = sum(numel(s) for _, s in shape.params() if numel(s) <= 100_000)

    def ag(**kw):
        s = place(shape, _lay(2), _fw(zero_stage=3, reduce_bucket_size=SMALL_BUCKET, **kw)).rank_state(0)
        return sum(c.buffer_bytes for c in s.comm if c.kind == "all_gather")

    assert ag() == 2 * n  # every param gathered once per step (2N pattern)
    # knobs 0: non-persistent params gathered again for backward (3N pattern)
    assert ag(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0) == 2 * n + 2 * (n - persist)


@pytest.mark.parametrize("knobs0", [False, True])
def test_zero3_accumulation_prediction(knobs0):
    """Two micro-batches: the trace completes inside step 0 (no warm-up step after it); every
    micro-batch fetches and reduce-scatters, persistent params are gathered once per step."""
    from ledger.faithful.deepspeed.zero import place

    shape = preset("tiny")
    n = shape.num_params()
    persist = sum(numel(s) for _, s in shape.params() if numel(s) <= 100_000)
    kw = dict(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0) if knobs0 else {}
    fw = _fw(zero_stage=3, reduce_bucket_size=SMALL_BUCKET, **kw)
    one, two = (place(shape, _lay(2, gbs=g), fw).rank_state(0) for g in (2, 4))
    assert (one.params_bytes, one.grads_bytes, one.optim_bytes) == (two.params_bytes, two.grads_bytes, two.optim_bytes)
    assert len(one.comm_warmup) == 1 and two.comm_warmup is None

    def tot(cs, kind):
        return sum(c.count for c in cs if c.kind == kind), sum(c.buffer_bytes for c in cs if c.kind == kind)

    rs1 = tot(one.comm, "reduce_scatter")
    assert tot(two.comm, "reduce_scatter") == tot(two.comm_first, "reduce_scatter") == (2 * rs1[0], 2 * rs1[1])
    per_micro = 2 * (2 * (n - persist)) if knobs0 else 2 * (n - persist)
    assert tot(two.comm, "all_gather")[1] == 2 * per_micro + 2 * persist
    assert tot(two.comm, "broadcast") == (0, 0) and tot(two.comm_first, "broadcast")[0] == 2 + 6
    # step 0: recording pass (every module fwd + bwd), then the first traced micro-batch (persistent
    # params fetched again: the recording pass released them), then _post_step's persistent gathers
    first_traced = 2 * n + 2 * (n - persist) if knobs0 else 2 * n
    assert tot(two.comm_first, "all_gather")[1] == 2 * 2 * n + first_traced + 2 * persist


def test_zero3_hook_order():
    """The coordinator's fetch / release order (dumped from fetch_sub_module / release_sub_module on a real
    run): forward in pre-order (releases in post-order); backward root, output, norm, blocks last to first,
    each module fetched when its output's gradient arrives and released once its inputs' gradients are
    computed; the root's and the embedding's releases left to release_backward_leftovers."""
    from ledger.faithful.deepspeed.trace import z3_trace as _z3_trace

    shape = preset("tiny", layers=1)
    tr = _z3_trace(shape, 100_000)
    names = {}
    for mo, ps in enumerate(tr.mod_params):
        names.setdefault(mo, ps)
    got = [(k, mo) for k, mo in tr.events]
    assert got[0] == ("F", 0) and got[-1] == ("L", -1)
    fwd = [k for k, _ in got[:got.index(("B", 0))]]
    assert fwd.count("F") == fwd.count("f") == 16 and len(tr.order) == 2 * 16
    # backward of the block: w2, w3, w1 (each fetched then released), feed_forward released, ffn_norm,
    # attention: wo, wv, wk, wq, attention released, attention_norm, block released; then the embedding
    blk = [shape.params().index((f"layers.0.{n}.weight", s)) for n, s in
           (("feed_forward.w2", (256, 768)), ("feed_forward.w3", (768, 256)), ("feed_forward.w1", (768, 256)),
            ("ffn_norm", (256,)), ("attention.wo", (256, 256)), ("attention.wv", (64, 256)),
            ("attention.wk", (64, 256)), ("attention.wq", (256, 256)), ("attention_norm", (256,)))]
    bwd = [tr.mod_params[mo][0] for k, mo in got if k == "B" and tr.mod_params[mo]]
    assert bwd == [len(shape.params()) - 1, len(shape.params()) - 2] + blk + [0]
    assert [k for k, _ in got[-4:]] == ["b", "b", "B", "L"]  # attention_norm, block, embedding, leftovers


def test_zero3_coordinator_replay():
    """Intermediate budgets (tiny, 2 micro-batches; prefetch 300,000, max live 600,000, reuse 400,000):
    the first traced pass's all-gathers as dumped from the coordinator: the root's prefetch takes the
    embedding, attention_norm and wq (the numel reaches 300,000), the embedding's the rest of layer 0's
    attention and ffn_norm and w1 (up to max live minus what is gathered), the block's w2 and w3; in
    steady state the reuse distance keeps output and final norm from forward into backward."""
    from collections import Counter

    from ledger.faithful.deepspeed.coordinator import z3_fetches as _z3_fetches

    shape = preset("tiny")
    record, rest0, steady = _z3_fetches(shape, 2, 100_000, 300_000, 600_000, 400_000)
    assert rest0[(256, 65_536, 262_144)] == 1  # root prefetch (persistent attention_norm too: released by recording)
    assert rest0[(256, 16_384, 16_384, 65_536, 196_608)] == 2  # layers 0 and 1 alike
    assert rest0[(196_608, 196_608)] >= 1
    # recording pass: every module with params, forward and backward, all its params
    mods = Counter((numel(s),) for n, s in shape.params())
    assert record == Counter({k: 2 * v for k, v in mods.items()})
    # steady, 2 micro-batches: more than one gather of every non-persistent param per micro-batch (2N),
    # less than two (3N): the reuse distance keeps some from forward into backward
    np_ = sum(numel(s) for _, s in shape.params() if numel(s) > 100_000)
    got = sum(sum(c) * k for c, k in steady.items())
    assert 2 * np_ < got < 2 * 2 * np_


def test_zero3_persistent_embedding_kept_by_leftovers():
    """Every param persistent (threshold above the embedding), 2 micro-batches: the recording pass
    releases every param after each use, but the embedding's last fetch (its backward) is released by
    release_backward_leftovers, which keeps persistent params: micro-batch 1 does not gather it again
    (dumped from the coordinator)."""
    from ledger.faithful.deepspeed.coordinator import z3_fetches as _z3_fetches

    shape = preset("tiny")
    e = shape.vocab * shape.hidden
    for kw in ((50_000_000, 10**9, 10**9), (0, 10**9, 0)):
        record, rest0, steady = _z3_fetches(shape, 2, 10**9, *kw)
        assert not steady and sum(n for c, k in rest0.items() for n in c * k) == shape.num_params() - e


def test_zero3_trace_param_starts_are_the_bisect():
    """The trace's per-step start in __param_order (qstart, tiled per block) is the bisect of the
    params' fetch steps it replaces (the reuse-distance walk's bounds), for every step and the two
    past the last, over models (tied, biases, no SwiGLU, llama3_70b) and thresholds."""
    import dataclasses
    from bisect import bisect_left

    from ledger.faithful.deepspeed.trace import z3_trace as _z3_trace

    tiny = preset("tiny", layers=5)
    for shape in (tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, norm="layernorm", bias=True),
                  dataclasses.replace(tiny, swiglu=False), preset("llama3_70b")):
        for th in (0, 100_000, 10**9):
            tr = _z3_trace(shape, th)
            assert list(tr.qstart) == [bisect_left(tr.qs, s) for s in range(tr.steps + 2)], (shape, th)


def test_zero3_recording_pass_end_without_replay():
    """What the recording pass leaves gathered (_z3_after_record, the start of step 0's micro-batch 1)
    is its event replay's end, over models (tied too) and thresholds below and above the embedding."""
    import dataclasses

    from ledger.faithful.deepspeed.coordinator import _z3_after_record, _z3_record
    from ledger.faithful.deepspeed.trace import z3_trace as _z3_trace

    tiny = preset("tiny", layers=3)
    ends = set()
    for shape in (tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, norm="layernorm", bias=True)):
        for th in (0, 20_000, 100_000, 10**9):
            got = _z3_after_record(_z3_trace(shape, th))
            assert got == _z3_record(shape, th, False)[1], (shape, th)
            ends.add(got)
    assert ends == {frozenset(), frozenset([0])}


def test_zero3_block_skipping_is_the_event_replay(monkeypatch):
    """The coordinator replay's fast path (whole decoder blocks skipped once the replay repeats itself;
    a pass's backward taken from the first complete pass's when their states agree where it starts)
    against the event-by-event replay, over models (tied, layernorm with biases, no SwiGLU), persistence
    thresholds, prefetch / max live / reuse-distance budgets (per-module fetch, budgets that bind, the
    defaults' scale; (100_000, 200_000, 10**6) at threshold 20_000 fails if the backward is taken
    whatever n_avail's drift does to the caps) and micro-batches: every pass's all-gathers and end state
    equal; the fast path does skip blocks and take backwards."""
    import dataclasses

    from ledger.faithful.deepspeed import coordinator as deepspeed_coordinator
    from ledger.faithful.deepspeed.coordinator import _z3_sim, z3_fetches as _z3_fetches

    taken = []
    same = deepspeed_coordinator._Caps.same
    monkeypatch.setattr(deepspeed_coordinator._Caps, "same", lambda *a: taken.append(same(*a)) or taken[-1])

    tiny = preset("tiny", layers=12)
    models = [tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, norm="layernorm", bias=True),
              dataclasses.replace(tiny, swiglu=False)]
    budgets = [(0, 10**9, 0), (1000, 10**9, 0), (300_000, 600_000, 400_000), (100_000, 250_000, 150_000),
               (50_000, 20_000, 10**7), (200_000, 10**9, 300_000), (5 * 10**7, 10**9, 10**9), (400_000, 500_000, 10**6),
               (100_000, 200_000, 10**6)]
    n = 0
    for shape, th, (pf, ml, rd), m in itertools.product(models, (0, 20_000, 100_000), budgets, (1, 2, 3)):
        fast = _z3_fetches(shape, m, th, pf, ml, rd, True)
        assert fast == _z3_fetches(shape, m, th, pf, ml, rd, False), (shape, th, pf, ml, rd, m)
        n += bool(_z3_sim(shape, th, pf, ml, rd, m > 1, True).rules)
    assert n > 100  # most configurations skip
    assert sum(taken) > 20 and not all(taken), (sum(taken), len(taken))  # backwards taken, some refused (caps)
    big = preset("llama3_70b")
    for m in (1, 2, 8):
        assert _z3_fetches(big, m, 100_000, 5 * 10**7, 10**9, 10**9, True) == \
            _z3_fetches(big, m, 100_000, 5 * 10**7, 10**9, 10**9, False)


def test_zero3_one_param_shortcuts_are_the_general_loops():
    """A module with one param (most) takes shortcuts in the replay (its fetch without the per-call
    lists; _unmarked returning its own tuple): against the same replays over the same trace whose
    modules never look like one-param ones (the general loops), fast path and event replay, over
    models (biases: two-param modules too), thresholds and budgets: every pass's all-gathers, end
    state and first-pass verdict equal."""
    import dataclasses

    from ledger.faithful.deepspeed.coordinator import _z3_after_record, _z3_persistent, _Z3Sim
    from ledger.faithful.deepspeed.trace import z3_trace as _z3_trace

    class General(tuple):  # a module's params that never take a one-param shortcut (len(own) == 1)
        def __len__(self):
            return 2

    tiny = preset("tiny", layers=6)
    models = [tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, norm="layernorm", bias=True)]
    budgets = [(0, 10**9, 0), (300_000, 600_000, 400_000), (100_000, 250_000, 150_000), (50_000, 20_000, 10**7),
               (5 * 10**7, 10**9, 10**9), (100_000, 200_000, 10**6)]
    for shape, th, (pf, ml, rd), periodic in itertools.product(models, (0, 100_000), budgets, (True, False)):
        tr = _z3_trace(shape, th)
        general = tr._replace(mod_params=[General(ps) if len(ps) == 1 else ps for ps in tr.mod_params])
        assert any(len(ps) == 1 for ps in tr.mod_params)
        got = []
        for t in (tr, general):
            sim = _Z3Sim(t, pf, ml, rd, periodic)
            first = sim.run(_z3_after_record(tr))
            steady = sim.run(_z3_persistent(tr))
            got.append((first, steady, sim.run(steady[1]), sim.as_first))
        assert got[0] == got[1], (shape, th, pf, ml, rd, periodic)


def test_zero3_fetch_on_use_is_the_event_replay():
    """Without prefetch and reuse distance (any max live), a steady step's all-gathers are known
    without a replay (_z3_fetch_on_use: every module's non-persistent params at each of its two fetches):
    the event replay's, over models (tied, biases, no SwiGLU, llama3_70b), thresholds below, between and
    above the params' sizes and micro-batches."""
    import dataclasses

    from ledger.faithful.deepspeed.coordinator import z3_steady as _z3_steady

    tiny = preset("tiny", layers=5)
    models = [tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, norm="layernorm", bias=True),
              dataclasses.replace(tiny, swiglu=False), preset("llama3_70b")]
    for shape, th, ml, m in itertools.product(models, (0, 20_000, 100_000, 10**9), (0, 10**6, 10**9), (1, 2, 3)):
        assert _z3_steady(shape, m, th, 0, ml, 0, True) == _z3_steady(shape, m, th, 0, ml, 0, False), \
            (shape, th, ml, m)


def test_zero3_checkpointed_replay_fast_path_is_the_event_replay():
    """With activation checkpointing (each backward block's events: its recompute's forward fetches and
    releases, then its backward's; trace.z3_trace ac) the coordinator replay's fast path against the
    event-by-event replay, and the fetch-on-use shortcut (a block's modules fetched three times) against
    the replay, over models, thresholds, budgets and micro-batches: every step's all-gathers equal."""
    import dataclasses

    from ledger.faithful.deepspeed.coordinator import z3_fetches as _z3_fetches, z3_steady as _z3_steady
    from ledger.faithful.deepspeed.trace import z3_trace as _z3_trace

    tiny = preset("tiny", layers=12)
    models = [tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, swiglu=False)]
    budgets = [(1000, 10**9, 0), (300_000, 600_000, 400_000), (100_000, 250_000, 150_000), (50_000, 20_000, 10**7),
               (5 * 10**7, 10**9, 10**9), (100_000, 200_000, 10**6)]
    for shape, th, (pf, ml, rd), m in itertools.product(models, (0, 100_000), budgets, (1, 2)):
        assert _z3_fetches(shape, m, th, pf, ml, rd, True, ac=True) == _z3_fetches(shape, m, th, pf, ml, rd, False, ac=True), \
            (shape, th, pf, ml, rd, m)
    for shape, th, m in itertools.product(models, (0, 100_000, 10**9), (1, 2)):
        assert _z3_steady(shape, m, th, 0, 10**9, 0, True, ac=True) == _z3_steady(shape, m, th, 0, 10**9, 0, False, ac=True)
    # the trace: one more forward's fetches per block in the backward
    assert _z3_trace(tiny, 0, True).steps - _z3_trace(tiny, 0).steps == 12 * 12


def test_zero3_watched_replay_makes_the_same_pass():
    """Watching a pass (the memory walk's events) changes nothing the replay decides: the same calls and
    end, and the watched fetches are those calls (as numel tuples), over budgets that keep everything,
    nothing and some of it."""
    import dataclasses

    from ledger.faithful.deepspeed.coordinator import _z3_persistent, _z3_sim
    from ledger.faithful.deepspeed.trace import z3_trace as _z3_trace

    tiny = preset("tiny", layers=3)
    for shape in (tiny, dataclasses.replace(tiny, tied_embeddings=True)):
        for pf, ml, rd in ((5 * 10**7, 10**9, 10**9), (0, 10**9, 0), (300_000, 600_000, 400_000), (100_000, 250_000, 150_000)):
            tr = _z3_trace(shape, 100_000)
            for acc in (False, True):
                sim = _z3_sim(shape, 100_000, pf, ml, rd, acc, periodic=False)
                start = _z3_persistent(tr)
                calls, end = sim.run(start)
                log: list = []
                assert sim.run(start, watch=log) == (calls, end)
                seen = Counter()
                for ev in log:
                    if ev[0] in "FB":
                        for ps in ev[2:]:
                            if ps:
                                seen[tuple(sorted(tr.numel[p] for p in ps))] += 1
                assert seen == calls, (shape, pf, ml, rd)
    with pytest.raises(ValueError, match="periodic=False"):
        _z3_sim(tiny, 100_000, 0, 10**9, 0, False, periodic=True).run(frozenset(), watch=[])


def test_zero3_moments_by_hand():
    """deepspeed_coordinator.z3_moments against what partition_parameters.py makes, counted by hand:
    default budgets (one prefetch of every non-persistent param at the root: one flat buffer of the
    padded partitions, live until the output's fetch pops its last param; each param cat'ed at the
    embedding's wait: the Linear weights saved by mm, the embedding's copy not) and no prefetch or
    reuse distance (each module's params gathered at its fetch, released after: nothing at the final
    norm; the output's own single-param buffer at its backward)."""
    from ledger.faithful.deepspeed.gathered import Z3Live, z3_moments

    tiny = preset("tiny")
    th, dp, w = 100_000, 3, 2  # dp 3: every partition padded
    big = [(n, sh) for n, sh in tiny.params() if numel(sh) > th]
    assert {n.split(".")[-2] for n, _ in big} == {"tok_embeddings", "w1", "w2", "w3", "output"}
    flat = w * dp * sum(-(-numel(sh) // dp) for _, sh in big)
    emb = w * tiny.vocab * tiny.hidden
    linear = sum(w * numel(sh) for n, sh in big) - emb
    (fwd, start, out), = z3_moments(tiny, 1, th, 5 * 10**7, 10**9, 10**9, dp, w)
    assert fwd == Z3Live(saved=linear, gathered=flat, temporary=emb)
    # the backward's start: the flat buffer was freed at the output's fetch; nothing new to prefetch
    assert start == out == Z3Live(saved=linear, gathered=0, temporary=emb)
    # step 0's second micro-batch: the coordinator's first complete pass, from nothing persistent gathered:
    # its root prefetch gathers every param, the persistent ones too; the norms' weights saved by the mul
    from ledger.faithful.deepspeed.gathered import z3_first_moments

    every = w * dp * sum(-(-numel(sh) // dp) for _, sh in tiny.params())
    saves = sum(w * numel(sh) for n, sh in tiny.params() if len(sh) == 2 or n.endswith("norm.weight")) - emb
    (first,) = z3_first_moments(tiny, 2, th, 5 * 10**7, 10**9, 10**9, dp, w)
    assert first[0] == Z3Live(saves, every, emb)
    # one micro-batch: step 0 is the recording pass, every module's params gathered at its fetch (one
    # param: its own padded buffer) and released after it: at the final norm only its weight, which the
    # mul saves; at the output's backward only its weight, gathered again
    (rec,) = z3_first_moments(tiny, 1, th, 5 * 10**7, 10**9, 10**9, dp, w)
    pad = w * dp * -(-tiny.hidden // dp)
    assert rec == (Z3Live(pad, 0, 0), Z3Live(0, 0, 0), Z3Live(0, w * dp * -(-tiny.vocab * tiny.hidden // dp), 0))
    (fwd, start, out), (fwd2, _, _) = z3_moments(tiny, 2, th, 0, 10**9, 0, dp, w)
    assert fwd == fwd2 == start == Z3Live(0, 0, 0)
    assert out == Z3Live(saved=0, gathered=w * dp * -(-tiny.vocab * tiny.hidden // dp), temporary=0)


def test_zero3_first_pass_asks_no_skipped_block(monkeypatch):
    """The first complete pass computes each release entry it asks for without looking at the rules of
    the blocks it skipped (_to_release(skipped=False)): it never asks for one of those (_cached finds
    nothing for any key it asks), over the models, thresholds and budgets of the block-skipping test."""
    import dataclasses

    from ledger.faithful.deepspeed import coordinator as deepspeed_coordinator
    from ledger.faithful.deepspeed.coordinator import z3_fetches as _z3_fetches

    found = []
    ask = deepspeed_coordinator._Z3Sim._to_release

    def spy(self, mo, step, recent, skipped=True):
        if not skipped and (mo, step) not in self.release_cache:
            found.append((bool(self.rules), bool(self.rules) and self._cached((mo, step)) is not None))
        return ask(self, mo, step, recent, skipped)

    monkeypatch.setattr(deepspeed_coordinator._Z3Sim, "_to_release", spy)
    tiny = preset("tiny", layers=12)
    models = [tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, swiglu=False)]
    budgets = [(0, 10**9, 0), (300_000, 600_000, 400_000), (100_000, 250_000, 150_000), (50_000, 20_000, 10**7),
               (5 * 10**7, 10**9, 10**9), (100_000, 200_000, 10**6)]
    for shape, th, (pf, ml, rd), m in itertools.product(models, (0, 100_000), budgets, (1, 2)):
        _z3_fetches(shape, m, th, pf, ml, rd, True)
    assert sum(after_skip for after_skip, _ in found) > 1000 and not any(hit for _, hit in found)


def test_block_counted_buckets_are_the_walk():
    """IPG buckets counted a block at a time (_split12 through _by_blocks) against the walk over every
    gradient (_buckets12), over models, bucket sizes around the params' sizes and both orders."""
    import dataclasses

    from ledger.faithful.deepspeed.common import registration_sizes as _registration_sizes
    from ledger.faithful.deepspeed.zero12 import _buckets12, _split12

    tiny = preset("tiny", layers=12)
    models = [tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, norm="layernorm", bias=True),
              dataclasses.replace(tiny, swiglu=False), preset("llama3_1b"), preset("llama3_70b")]
    for shape in models:
        sizes = sorted(set(_registration_sizes(shape)))
        buckets = {1, 1000, 65_536, 100_000, 300_000, 10**6, 3 * 10**6, 5 * 10**8, 10**12} | \
            {n + d for n in sizes for d in (-1, 0, 1)} | {2 * n + 7 for n in sizes}
        for bucket in sorted(buckets):
            for registration in (True, False):
                bk = _buckets12(shape, bucket, registration)
                normal, large = _split12(shape, bucket, registration)
                assert Counter(dict(normal)) == Counter(b for b, off in bk if off < 0), (shape, bucket, registration)
                assert sorted(large) == sorted(x for x in bk if x[1] >= 0)

def test_place_is_lazy_and_shares_cached_lists():
    """place() computes steady collectives on first use; model-derived lists are computed once per
    (model, dp, knobs), whatever the micro-batch size."""
    from ledger.faithful.deepspeed.zero import place

    shape = preset("tiny")
    for stage in (1, 2, 3):
        fw = _fw(zero_stage=stage, reduce_bucket_size=SMALL_BUCKET)
        a, b = (place(shape, _lay(2, mbs=k), fw).rank_state(0) for k in (1, 2))
        assert a._comm is None and a.comm_fn is not None
        assert a.comm == b.comm and a.comm is not b.comm and all(x is y for x, y in zip(a.comm, b.comm))
        assert a.detail == b.detail and a.detail is not b.detail


# -- dry: DeepSpeed's own parser -----------------------------------------------------------------

_PARSE = r"""
import json, os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
import deepspeed
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no JIT build
deepspeed.init_distributed("gloo")  # the parser asks deepspeed.comm for the rank
from deepspeed.runtime.config import DeepSpeedConfig
class Mpu:  # the job's DP size (the parser reads it from an mpu when one is given)
    def get_data_parallel_world_size(self): return int(sys.argv[2])
c = DeepSpeedConfig(json.load(open(sys.argv[1])), mpu=Mpu())
print(json.dumps({"stage": c.zero_optimization_stage, "train_batch_size": c.train_batch_size,
                  "micro": c.train_micro_batch_size_per_gpu, "gas": c.gradient_accumulation_steps,
                  "bf16": c.bfloat16_config.enabled, "optimizer": c.optimizer_name,
                  "reduce_bucket_size": c.zero_config.reduce_bucket_size,
                  "prefetch": c.zero_config.prefetch_bucket_size, "clip": c.gradient_clipping}))
"""


@pytest.mark.real  # runs the framework's own code (its argument parser, or torch.distributed in a process)
def test_dry_writes_a_config_deepspeed_accepts(tmp_path):
    from launchers.local import free_port

    job = tmp_path / "dry"
    r = subprocess.run([sys.executable, "launch.py", "mode=dry", "framework=deepspeed", "framework.zero_stage=3",
                        "cluster=local_gpu", "layout.micro_batch_size=2", "framework.stage3_prefetch_bucket_size=0",
                        "framework.stage3_max_reuse_distance=0", f"hydra.run.dir={job}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.load(open(job / "record.json"))
    assert rec["status"] == "ok"
    assert {os.path.basename(p) for p in rec["artifacts"]} == {"ds_config.json", "train_ds.py", "run.sh"}
    assert "deepspeed --num_nodes 1 --num_gpus 8 " in (job / "run.sh").read_text()
    p = subprocess.run([sys.executable, "-c", _PARSE, str(job / "ds_config.json"), "8", str(free_port())],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    c = json.loads(p.stdout.strip().splitlines()[-1])
    assert c == {"stage": 3, "train_batch_size": 16, "micro": 2, "gas": 1, "bf16": True, "optimizer": "adamw",
                 "reduce_bucket_size": 500_000_000, "prefetch": 0, "clip": 1.0}


# -- the real matrix -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import records as R
    from analysis.reconcile import table

    root = tmp_path_factory.mktemp("ds")
    sweeps = {"matrix": MATRIX, "knobs0": KNOBS0, "gas2": GAS2, "fp32": FP32, "budgets": BUDGETS,
              "budgets_small": BUDGETS_SMALL, "ac": AC, "ac_long": AC_LONG, "z3_ac": Z3_AC, "z3_ac_long": Z3_AC_LONG,
              "fp32_one": FP32_ONE, "odd": ODD,
              "epilogue": EPILOGUE,
              "emb_tied": EMB_TIED, "hooks": HOOKS, "default_bucket": DEFAULT_BUCKET,
              "ulysses_z3": ULYSSES_Z3, "ulysses_z12": ULYSSES_Z12, "ulysses_cast": ULYSSES_CAST, "offload": OFFLOAD,
              "offload_z3": OFFLOAD_Z3}
    # wandb.mode=disabled: as conftest.run_sweeps (W&B is test_wandb's); a sweep's multiruns each into a
    # folder of its own under the sweep's, which records.load reads together
    launch_many([["-m", *part, "wandb.mode=disabled", f"hydra.sweep.dir={root / name / str(i)}"]
                 for name, args in sweeps.items() for i, part in enumerate(by_steps(args))],
                timeout=900 * len(sweeps))
    recs = {name: R.load(str(root / name)) for name in sweeps}
    return recs, {k: table(v) for k, v in recs.items()}


def _key(rec):
    c = rec["config"]
    return c["framework"]["zero_stage"], c["cluster"]["ranks"]


def _tied(rec) -> bool:
    return bool(rec["config"]["model"]["tied_embeddings"])


def _ckpt(rec) -> bool:
    return bool(rec["config"]["framework"].get("activation_checkpointing", False))


def _job(recs, stage, ranks, tied=False):
    return next(r for r in recs if _key(r) == (stage, ranks) and _tied(r) == tied)


def _steady_comm(rank_rec, step=None):
    """The rank's collectives in `step` (its last by default), (kind, dtype) -> (count, buffer bytes)."""
    out = {}
    st = rank_rec["steps"][-1] if step is None else next(s for s in rank_rec["steps"] if s["step"] == step)
    for c in st["comm"]:
        out[(c["kind"], c["dtype"])] = (c["count"], c["buffer_bytes"])
    return out


@pytest.mark.real
def test_matrix_ran_every_rank(runs):
    recs, _ = runs
    assert sorted(_key(r) for r in recs["matrix"]) == [(1, 2), (1, 4), (2, 2), (2, 4), (3, 2), (3, 4)]
    assert sorted((*_key(r), _tied(r)) for r in recs["knobs0"]) == [(3, 2, False), (3, 2, True), (3, 4, False),
                                                                    (3, 4, True)]
    assert sorted((*_key(r), _tied(r)) for r in recs["gas2"]) == [(2, 2, False), (2, 2, True), (3, 2, False),
                                                                  (3, 2, True)]
    assert sorted(_key(r) for r in recs["fp32"]) == [(1, 4), (2, 4), (3, 4)]
    assert sorted(_key(r) for r in recs["budgets"]) == [(3, 2), (3, 4)]
    assert sorted((*_key(r), _tied(r)) for r in recs["budgets_small"]) == [(3, 2, False), (3, 2, True)]
    assert sorted((*_key(r), _ckpt(r)) for r in recs["ac"]) == [(2, 2, False), (2, 2, True)]
    assert [_key(r) for r in recs["odd"]] == [(3, 3)]
    assert sorted(r["config"]["framework"]["reduce_bucket_size"] for r in recs["epilogue"]) == [3279104, 500000000]
    assert [(*_key(r), _tied(r)) for r in recs["emb_tied"]] == [(3, 4, True)]
    assert sorted(r["config"]["framework"]["reduce_bucket_size"] for r in recs["hooks"]) == sorted(HOOK_BUCKETS.values())
    assert sorted((_key(r), r["config"]["framework"]["reduce_bucket_size"]) for r in recs["default_bucket"]) == \
        [((1, 2), 500_000_000), ((2, 2), 500_000_000)]
    assert all(r["prediction"]["layout"]["micro_batch_size"] == 4 for r in recs["ac"])
    for rec in recs["knobs0"] + recs["gas2"] + recs["budgets"] + recs["budgets_small"]:
        assert rec["prediction"]["layout"]["num_microbatches"] == 4 // _key(rec)[1]
    for rec in recs["fp32"]:
        assert rec["prediction"]["layout"]["num_microbatches"] == 2
        assert rec["config"]["framework"]["precision"] == "fp32"
    for rec in [r for k in recs for r in recs[k]]:
        assert rec["status"] == "ok", rec["error"]
        ranks = rec["measurement"]["ranks"]
        assert [r["rank"] for r in ranks] == list(range(_key(rec)[1]))
        for r in ranks:
            assert r["status"] == "ok" and r["errors"] == [], r.get("errors")
            assert [s["step"] for s in r["steps"]] == list(range(STEPS_OF[_key(rec)[0]]))
            assert all(math.isfinite(s["loss"]) for s in r["steps"])


@pytest.mark.real
def test_every_row_reconciles_to_the_byte(runs):
    recs, tables = runs
    for name, df in tables.items():
        assert_every_row_reconciles(df, recs[name])  # peaks: test_peak_rows
        steady = df[(df.phase == "steady") & ~df.quantity.str.startswith("peak")]
        dp = ("comm/cp-dp/", "comm/cp/") if name in ULYSSES else ("comm/dp/",)  # Ulysses: sequence-data-parallel
        for (job, rank), g in steady.groupby(["job", "rank"]):  # and its data-parallel collectives
            assert any(q.startswith(dp) for q in g.quantity), (name, job, rank)


@pytest.mark.real
def test_first_step_is_reported_separately(runs):
    _, tables = runs
    df = tables["matrix"]
    first = df[df.phase == "first"]
    assert set(first.step) == {0, 1}  # ZeRO-3 completes its trace in the second forward
    z3 = first[first.framework == "deepspeed-z3"]
    assert set(z3.step) == {0, 1} and set(first[first.framework != "deepspeed-z3"].step) == {0}
    assert (z3[z3.quantity == "comm/dp/broadcast/count"].measured > 0).all()
    steady = df[df.phase == "steady"]
    assert not (steady.quantity.str.contains("broadcast")).any()


@pytest.mark.real
def test_zero12_all_reduce_buckets_no_reduce_scatter(runs):
    recs, _ = runs
    n = ModelShape.from_config(recs["matrix"][0]["config"]["model"]).num_params()
    for rec in recs["matrix"]:
        stage, world = _key(rec)
        if stage == 3:
            continue
        for r in rec["measurement"]["ranks"]:
            c = _steady_comm(r)
            assert not any(k == "reduce_scatter" for k, _ in c)
            count, nbytes = c[("all_reduce", "bf16")]
            assert count > 1 and nbytes == 2 * n  # several buckets covering every gradient once
            assert c[("all_gather", "bf16")] == (1, 2 * n)


@pytest.mark.real
def test_zero3_2n_default_and_3n_with_knobs_zero(runs):
    recs, _ = runs
    shape = ModelShape.from_config(recs["matrix"][0]["config"]["model"])
    n = shape.num_params()
    persist = [numel(s) for _, s in shape.params() if numel(s) <= 100_000]
    big_modules = {name.rsplit(".", 1)[0] for name, s in shape.params() if numel(s) > 100_000}
    default = _job(recs["matrix"], 3, 4)
    knobs = _job(recs["knobs0"], 3, 4)
    for r_d, r_k in zip(default["measurement"]["ranks"], knobs["measurement"]["ranks"]):
        d, k = _steady_comm(r_d), _steady_comm(r_k)
        # 2N: one coalesced gather of all non-persistent params + the persistent ones after step
        assert d[("all_gather", "bf16")] == (1 + len(persist), 2 * n)
        # 3N: per-module gathers in forward and again in backward
        assert k[("all_gather", "bf16")] == (2 * len(big_modules) + len(persist), 2 * n + 2 * (n - sum(persist)))
        assert d[("reduce_scatter", "bf16")][1] == k[("reduce_scatter", "bf16")][1] == 2 * n
        assert d[("reduce_scatter", "bf16")][0] > 1


@pytest.mark.real
def test_zero2_reduces_every_micro_batch(runs):
    """Stage 2 reduces gradients in the backward hooks of every micro-batch, not once per step."""
    recs, _ = runs
    one = _job(recs["matrix"], 2, 2)
    two = _job(recs["gas2"], 2, 2)
    assert two["prediction"]["layout"]["num_microbatches"] == 2
    for r1, r2 in zip(one["measurement"]["ranks"], two["measurement"]["ranks"]):
        c1, c2 = _steady_comm(r1), _steady_comm(r2)
        assert c2[("all_reduce", "bf16")] == tuple(2 * x for x in c1[("all_reduce", "bf16")])
        assert c2[("all_gather", "bf16")] == c1[("all_gather", "bf16")]


@pytest.mark.real
def test_zero3_accumulation(runs):
    """ZeRO-3, 2 micro-batches: every micro-batch fetches its params and reduce-scatters all gradients;
    persistent params are gathered once, after the step; the trace is recorded in micro-batch 0 of
    step 0 and completed at the start of micro-batch 1 (all trace broadcasts in step 0)."""
    recs, tables = runs
    shape = ModelShape.from_config(recs["matrix"][0]["config"]["model"])
    n = shape.num_params()
    persist = [numel(s) for _, s in shape.params() if numel(s) <= 100_000]
    np_ = n - sum(persist)
    big_modules = {name.rsplit(".", 1)[0] for name, s in shape.params() if numel(s) > 100_000}
    one, two, knobs = _job(recs["matrix"], 3, 2), _job(recs["gas2"], 3, 2), _job(recs["knobs0"], 3, 2)
    for r1, r2, rk in zip(*(j["measurement"]["ranks"] for j in (one, two, knobs))):
        c1, c2, ck = _steady_comm(r1), _steady_comm(r2), _steady_comm(rk)
        rs = ("reduce_scatter", "bf16")
        assert c2[rs] == (2 * c1[rs][0], 2 * c1[rs][1])  # matrix and gas2: the same bucket size
        assert ck[rs][1] == c2[rs][1]  # knobs0 buckets differently (500000), the same bytes
        assert c1[("all_reduce", "fp64")] == c2[("all_reduce", "fp64")] == (1, 8)  # grad norm at the boundary
        ag = ("all_gather", "bf16")
        # 2N: one coalesced gather of the non-persistent params per micro-batch
        assert c2[ag] == (2 + len(persist), 2 * 2 * np_ + 2 * sum(persist))
        # 3N: per-module gathers in forward and backward, per micro-batch
        assert ck[ag] == (2 * 2 * len(big_modules) + len(persist), 2 * 2 * 2 * np_ + 2 * sum(persist))
        s0, s1 = _steady_comm(r2, 0), _steady_comm(r2, 1)
        assert s0[("broadcast", "int64")][0] == 2 + 6 and ("broadcast", "int64") not in s1
        # step 0: the recording pass gathers every module forward and backward, micro-batch 1 every
        # param in one call (the recording pass released the persistent ones too)
        assert s0[ag] == (2 * (len(big_modules) + len(persist)) + 1 + len(persist), 2 * 2 * n + 2 * n + 2 * sum(persist))
    for name in ("gas2", "knobs0"):
        df = tables[name]
        z3m2 = df[(df.framework == "deepspeed-z3") & (df.layout == "dp2")]
        assert set(z3m2[z3m2.phase == "first"].step) == {0}  # no warm-up step after step 0


@pytest.mark.real
def test_zero3_tied_embeddings(runs):
    """Tied: one Parameter in two modules. ZeRO-3 fetches it for each (3N: the output's fetch is the
    embedding's size, as untied); it is reduced and stored once."""
    recs, _ = runs
    shape = ModelShape.from_config(recs["matrix"][0]["config"]["model"])
    e = shape.vocab * shape.hidden
    for ranks in (2, 4):
        u, t = _job(recs["knobs0"], 3, ranks), _job(recs["knobs0"], 3, ranks, tied=True)
        assert u["prediction"]["per_gpu"]["params_bytes"] - t["prediction"]["per_gpu"]["params_bytes"] == 2 * e // ranks
        for ru, rt in zip(u["measurement"]["ranks"], t["measurement"]["ranks"]):
            cu, ct = _steady_comm(ru), _steady_comm(rt)
            m = 4 // ranks
            assert ct[("all_gather", "bf16")] == cu[("all_gather", "bf16")]
            assert ct[("reduce_scatter", "bf16")][1] == cu[("reduce_scatter", "bf16")][1] - m * 2 * e
    u, t = _job(recs["gas2"], 3, 2), _job(recs["gas2"], 3, 2, tied=True)
    for ru, rt in zip(u["measurement"]["ranks"], t["measurement"]["ranks"]):
        cu, ct = _steady_comm(ru), _steady_comm(rt)
        # 2N: the coalesced gather holds the embedding once, each micro-batch
        assert ct[("all_gather", "bf16")] == (cu[("all_gather", "bf16")][0], cu[("all_gather", "bf16")][1] - 2 * 2 * e)


@pytest.mark.real
def test_extra_large_params_reduced_on_their_own(runs):
    """reduce_bucket_size below the embedding: ZeRO-1/2 all-reduce each extra-large gradient outside the
    IPG buffer, cut where it straddles a partition boundary (4 ranks: layer 0's w1, first slice 65,600 >
    65,536 elements: one more call than buckets; at 100000 it stays one call); ZeRO-3 reduce-scatters it
    alone and keeps its IPG buffer of reduce_bucket_size elements."""
    from ledger.faithful.deepspeed.common import grad_sizes as _grad_sizes, ipg_buckets
    from ledger.faithful.deepspeed.zero12 import _buckets12

    recs, _ = runs
    shape = ModelShape.from_config(recs["matrix"][0]["config"]["model"])
    n = shape.num_params()
    assert max(numel(s) for _, s in shape.params()) > BELOW_EMBEDDING
    for name, bucket, dtype, w in (("matrix", BELOW_EMBEDDING, "bf16", 2), ("fp32", FP32_BUCKET, "fp32", 4)):
        for rec in recs[name]:
            stage, dp = _key(rec)
            m = rec["prediction"]["layout"]["num_microbatches"]
            for r in rec["measurement"]["ranks"]:
                c = _steady_comm(r)
                if stage == 3:
                    pad = [-(-k // dp) * dp for k in _grad_sizes(shape)]
                    assert c[("reduce_scatter", dtype)][0] == m * len(ipg_buckets(pad, bucket))
                    continue
                calls = len(_buckets12(shape, bucket, stage == 1)) + (dp == 4 and bucket == BELOW_EMBEDDING)
                times = m if stage == 2 else 1
                ipg = c[("all_reduce", dtype)]
                if dtype == "fp32":  # the fp32 grad norm joins them
                    ipg = (ipg[0] - 1, ipg[1] - 4)
                assert ipg == (times * calls, times * w * n)
        if name == "matrix":
            z3 = _job(recs[name], 3, 4)
            assert records.predicted_ranks(z3["prediction"])(0)["detail"]["grads/IPG bucket (reduce_bucket_size)"] == w * bucket


@pytest.mark.real
def test_fp32_runs(runs):
    """fp32 (no bf16 section): fp32 flat params and collectives, no overflow all-reduce at ZeRO-1/2, an
    fp32 master partition copied anyway (ZeRO-1/2 clone; ZeRO-3's no-copy branch compares a torch.device
    with a str)."""
    recs, _ = runs
    shape = ModelShape.from_config(recs["fp32"][0]["config"]["model"])
    n = shape.num_params()
    for rec in recs["fp32"]:
        stage, dp = _key(rec)
        for r in rec["measurement"]["ranks"]:
            st = r["steps"][-1]
            kinds = set(_steady_comm(r))
            part = -(-n // (2 * dp)) * 2 if stage < 3 else None
            if stage < 3:
                assert kinds == {("all_gather", "fp32"), ("all_reduce", "fp32")}
                assert st["state"]["params_bytes"] == 4 * part * dp
                assert st["state"]["optim_bytes"] == 12 * part + 4
            else:
                assert kinds == {("all_gather", "fp32"), ("reduce_scatter", "fp32"), ("all_reduce", "fp64")}
                # fp32 ds_tensor partitions + fp32 master copy + Adam moments
                assert st["state"]["optim_bytes"] == 3 * (st["state"]["grads_bytes"] - 4 * FP32_BUCKET) + 4


@pytest.mark.real
def test_zero3_intermediate_budgets(runs):
    """Budgets between the two extremes: every micro-batch gathers more than the 2N pattern's one
    coalesced fetch and fewer bytes than the 3N pattern (some params kept from forward to backward by the
    reuse distance or the prefetcher's marks), in more calls than 2N (prefetch bucket and max live
    parameters split the fetches). Every row reconciles (test_every_row_reconciles_to_the_byte)."""
    recs, tables = runs
    shape = ModelShape.from_config(recs["matrix"][0]["config"]["model"])
    n = shape.num_params()
    persist = [numel(s) for _, s in shape.params() if numel(s) <= 100_000]
    np_ = n - sum(persist)
    for rec in recs["budgets"] + recs["budgets_small"]:
        m = rec["prediction"]["layout"]["num_microbatches"]
        for r in rec["measurement"]["ranks"]:
            count, nbytes = _steady_comm(r)[("all_gather", "bf16")]
            per_micro = nbytes - 2 * sum(persist)
            assert m * 2 * np_ < per_micro < m * 2 * 2 * np_, (rec["job"], per_micro)
            assert count > m + len(persist)
    for name in ("budgets", "budgets_small"):
        df = tables[name]
        df = df[~df.quantity.str.startswith("peak")]  # the peak rows: test_peak_rows (ZeRO-3 at 4 ranks: a finding)
        assert not df[df.phase == "first"].empty and (df.abs_err == 0).all()


def test_zero3_step1_pass_from_the_accumulation_coordinator():
    """With one micro-batch, step 1's pass is taken from the gradient-accumulation coordinator's pass
    from the same start when that pass read only cache entries a fresh coordinator's first pass would
    compute (_Z3Sim.as_first): against the event-by-event replay of a fresh coordinator, over the
    models, thresholds and budgets of the block-skipping test, the accumulation coordinator built
    first (m = 2) as a search does; the shortcut is taken in most of them."""
    import dataclasses

    from ledger.faithful.deepspeed.coordinator import _z3_persistent, _z3_sim, z3_fetches as _z3_fetches
    from ledger.faithful.deepspeed.trace import z3_trace as _z3_trace

    tiny = preset("tiny", layers=12)
    models = [tiny, dataclasses.replace(tiny, tied_embeddings=True), dataclasses.replace(tiny, norm="layernorm", bias=True),
              dataclasses.replace(tiny, swiglu=False)]
    budgets = [(0, 10**9, 0), (1000, 10**9, 0), (300_000, 600_000, 400_000), (100_000, 250_000, 150_000),
               (50_000, 20_000, 10**7), (200_000, 10**9, 300_000), (5 * 10**7, 10**9, 10**9), (400_000, 500_000, 10**6),
               (20_000, 10**9, 50_000), (0, 10**9, 10**9)]
    taken = refused = 0
    for shape, th, (pf, ml, rd) in itertools.product(models + [preset("llama3_70b")], (0, 20_000, 100_000), budgets):
        for m in (2, 1):
            assert _z3_fetches(shape, m, th, pf, ml, rd, True) == _z3_fetches(shape, m, th, pf, ml, rd, False), \
                (shape, th, pf, ml, rd, m)
        if pf == rd == 0:
            continue  # no coordinator pass taken (_z3_fetch_on_use)
        first = _z3_sim(shape, th, pf, ml, rd, True, True).as_first[_z3_persistent(_z3_trace(shape, th))]
        taken += first
        refused += not first
    assert taken > 100 and refused > 0, (taken, refused)


# Peak findings: jobs whose peak is at a moment the ledger does not model exactly. Each is
# checked to stay what it is (a fix shows up here), never covered by a wider tolerance.
# name -> (which jobs: f(zero, dp, precision, micro-batches, tied, reuse distance), "over 1%" | "within 1%")
PEAK_FINDINGS: dict = {
    # none now: ZeRO-3's IPG reduce-scatter moments (4 ranks, a partial reuse distance: 1.5% under; tied,
    # nothing kept: 0.63%) and ZeRO-1's held gradients a boundary collective reduces (`gathered` for the
    # probe; total exact, parts not) are modelled
}


def _exact(g) -> bool:
    """Every peak row of a job to the byte: a total inside the probe's thread-timing range
    (compare.peak_gap: a gloo worker thread may free a storage late, measured: 4 bytes of ZeRO-2 at 4
    ranks, 1 run in 2), each part off by at most those bytes (the late storage's category)."""
    from analysis.compare import peak_gap

    tot = g[g.quantity == "peak_bytes"]
    if not (peak_gap(tot) == 0).all():
        return False
    race = {(r.rank, r.step): r.race_bytes for r in tot.itertuples()}
    parts = g[g.quantity != "peak_bytes"]
    return all(abs(r.abs_err) <= race[(r.rank, r.step)] for r in parts.itertuples())


def _peak_finding(rec):
    c = rec["config"]["framework"]
    lay = rec["prediction"]["layout"]
    key = (c["zero_stage"], lay["dp"], c["precision"], lay["num_microbatches"], _tied(rec),
           c["stage3_max_reuse_distance"])
    return [(k, kind) for k, (f, kind) in PEAK_FINDINGS.items() if f(*key)]


@pytest.mark.real
def test_peak_rows(runs):
    """Every rank and step has a peak_bytes row and the five parts; every steady row within 1%
    and exact, a deterministic order of allocations (ledger/faithful/deepspeed/peak.py): the peak is in
    torch AdamW's update, at the start of backward (4 samples a micro-batch without checkpointing), or
    deeper in ZeRO-2's backward (fp32, 4 ranks, 2 micro-batches), at ZeRO-3's IPG reduce-scatter in
    backward (4 ranks, a partial reuse distance or tied), but for the named findings."""
    from analysis.compare import off, peak_gap

    recs, tables = runs
    jobs = {(name, R_name(rec)): rec for name in recs for rec in recs[name]}
    seen = {k: 0 for k in PEAK_FINDINGS}
    exact = 0
    for name, df in tables.items():
        pk = df[df.quantity.str.startswith("peak")]
        steps = sum(len(r["steps"]) for rec in recs[name] for r in rec["measurement"]["ranks"])
        assert (pk.quantity == "peak_bytes").sum() == steps, name
        assert set(pk.quantity) == {"peak_bytes", *(f"peak/{p}_bytes" for p in
                                                    ("resident", "activations", "gathered", "temporary", "unnamed"))}
        for job, g in pk.groupby("job"):
            found = _peak_finding(jobs[(name, job)])
            steady = g[(g.phase == "steady") & (g.quantity == "peak_bytes")]
            bounded = steady.bound_low.notna() if "bound_low" in steady else steady.step < 0
            # a bounded peak (ZeRO-Offload: the reductions' copies into the host partition not placed) is
            # judged inside its bound (compare.off); a rank whose peak is a placed moment stays exact
            assert not off(steady[bounded]).any(), f"{name}/{job}:\n{steady[bounded].to_string()}"
            if bounded.any() and (peak_gap(steady[bounded]) != 0).any():
                continue
            for k, _ in found:
                seen[k] += 1
            # off by more than the probe's thread-timing range (compare.peak_gap: 0 inside it)
            gap = peak_gap(steady).abs()
            if any(kind == "over 1%" for _, kind in found):
                assert (gap > 0.01).any(), f"{name}/{job} {found}: now within 1%, no finding"
                continue
            assert (gap <= 0.01).all(), f"{name}/{job}:\n{steady.to_string()}"
            if found:
                assert (g.abs_err != 0).any(), f"{name}/{job} {found}: now exact, no finding"
                continue
            assert _exact(g), f"{name}/{job}:\n{g[g.abs_err != 0].to_string()}"
            exact += 1
    assert all(seen.values()), seen
    assert exact == 44, exact


@pytest.mark.real
def test_offload_keeps_the_optimizer_on_the_host(runs):
    """ZeRO-Offload (zero12.py offload_buffers, zero3.py): DeepSpeed builds the fp32 partition, its gradient and the
    optimizer state on the host; at ZeRO-1/2 two staging buffers on the host, one gradient buffer on the device
    and, at ZeRO-2 with several micro-batches, a host copy of each gradient of the partition
    (accumulated_grads_in_cpu); ZeRO-3 computes its grad norm in fp32 (its all-reduce 4 bytes). host_bytes (read
    from where DeepSpeed places each container: on the CPU accelerator host and device are one memory) reconciles
    to the byte on every rank (test_every_row_reconciles_to_the_byte). The peaks: ZeRO-1's and ZeRO-3's exact,
    ZeRO-2's inside their bound, its last rank's above the placed moments (the output weight's fp64 norm and
    clone at its reduction)."""
    from ledger.faithful.deepspeed.zero3 import _zero3_memory
    from ledger.faithful.deepspeed.zero12 import _zero12_memory

    import pandas as pd

    recs, tables = runs
    offload = recs["offload"] + recs["offload_z3"]
    assert sorted(_key(r) for r in offload) == [(1, 4), (2, 4), (3, 4)]
    df = pd.concat([tables["offload"], tables["offload_z3"]])
    for rec in offload:
        m, z = ModelShape.from_config(rec["config"]["model"]), _key(rec)[0]
        # (the two sweeps' jobs share their names: told apart by the stage)
        job = df[(df.job == R_name(rec)) & (df.framework == f"deepspeed-z{z}") & (df.phase == "steady")]
        host = job[job.quantity == "host_bytes"]
        assert len(host) == 4 * job.step.nunique() and (host.abs_err == 0).all()
        optim = job[job.quantity == "optim_bytes"].set_index("rank").measured
        grads = job[job.quantity == "grads_bytes"].set_index("rank").measured
        assert (host.set_index("rank").measured > optim).all()
        fw = rec["config"]["framework"]
        plain = (_zero3_memory(m, 4, fw["stage3_param_persistence_threshold"], fw["reduce_bucket_size"], "bf16") if z == 3
                 else _zero12_memory(m, 4, z, "bf16"))
        assert (optim == plain.optim_bytes).all()
        part = plain.optim_bytes // 12  # the fp32 partition's elements (12 bytes of state each, AdamW's step aside)
        # the fp32 gradient partition stays on the host; ZeRO-2 also keeps a model-dtype copy of each gradient of
        # the partition, whole (a straddling one in both ranks); ZeRO-3 beside its device partitions and IPG bucket
        want = {1: grads == 4 * part, 2: grads > 4 * part, 3: grads == plain.grads_bytes + 4 * part}[z]
        assert want.all(), grads
        comm = _steady_comm(rec["measurement"]["ranks"][0])
        if z == 3:  # complete_grad_norm_calculation_for_cpu_offload: the norm all-reduced in fp32
            assert comm[("all_reduce", "fp32")] == (1, 4) and ("all_reduce", "fp64") not in comm
            # offload_param: the model-dtype partitions are the host's too
            params = job[job.quantity == "params_bytes"].set_index("rank").measured
            host_want = optim + 4 * part + 2 * part
            assert (host.set_index("rank").measured == host_want).all() and (params > 2 * part).all()
        for r in rec["measurement"]["ranks"]:
            zc = r["ds_config"]["zero_optimization"]
            assert zc["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
            assert zc.get("offload_param") == ({"device": "cpu", "pin_memory": True} if z == 3 else None)
    peaks = df[(df.phase == "steady") & (df.quantity == "peak_bytes")]
    z1, z2, z3 = (peaks[peaks.framework == f"deepspeed-z{z}"] for z in (1, 2, 3))
    assert (z1.abs_err == 0).all() and (z3.abs_err == 0).all() and z1.bound_low.notna().all()
    assert (z2.measured > z2.predicted).any() and (z2.measured <= z2.bound_high).all()


@pytest.mark.real
def test_ulysses_sends_each_layer_s_eight_all_to_alls_and_reduces_over_dp_x_cp(runs):
    """DeepSpeed-Ulysses (ulysses.py): per layer and micro-batch 8 all_to_all over the cp group of the
    local [b, s / cp, heads or kv_heads, head_dim] (Q, K, V, O and their grads; 12 with checkpointing, the
    recompute's forward again); ZeRO over every rank (cp
    x dp), its states those of the flat layout at dp x cp on s / cp tokens; ZeRO-1/2's bucket
    all-reduces in fp32 (bf16 comm dtype set), ZeRO-3's reduce-scatters in DeepSpeed's default fp32;
    each rank's peak where ulysses.py puts it: ZeRO-3's forward at the final norm (wo's input an
    all-to-all output of its own per layer, the whole sequence's batch), ZeRO-1/2's fp32 cast of their one
    bucket (test_peak_rows judges the bytes)."""
    from ledger.faithful.deepspeed import ulysses

    recs, tables = runs
    assert sorted(_key(r) for r in recs["ulysses_z3"] + recs["ulysses_z12"]) == [(1, 2), (2, 2), (3, 4)]
    wheres = {(name, _key(rec)[0]): records.predicted_ranks(rec["prediction"])(0)["peak"]["what"]
              for name in ULYSSES for rec in recs[name]}
    assert "forward at the final norm" in wheres["ulysses_z3", 3]
    assert "the all-reduce of dp slices" in wheres["ulysses_cast", 1] and "epilogue" in wheres["ulysses_cast", 2]
    for name in ULYSSES:
        df = tables[name]
        for rec in recs[name]:
            m = ModelShape.from_config(rec["config"]["model"])
            lay = rec["prediction"]["layout"]
            local = (m.seq_len // 2) * lay["micro_batch_size"] * m.head_dim * 2
            n = m.layers * lay["num_microbatches"]
            job = df[(df.job == R_name(rec)) & (df.phase == "steady")]
            a2a = job[job.quantity == "comm/cp/all_to_all/buffer_bytes"]
            assert len(a2a) == rec["measurement"]["world"] * job.step.nunique() > 0
            passes = 3 if _ckpt(rec) else 2
            assert _ckpt(rec) == (name == "ulysses_z12")  # (ulysses_cast: fp32 reductions, no checkpointing)
            assert (a2a.measured == n * passes * 2 * local * (m.heads + m.kv_heads)).all()
            assert (job[job.quantity == "comm/cp/all_to_all/count"].measured == 4 * passes * n).all()
            reduce = "all_reduce/buffer" if _key(rec)[0] < 3 else "reduce_scatter/buffer"
            group = "cp" if rec["measurement"]["world"] == 2 else "cp-dp"
            assert not job[job.quantity.str.startswith(f"comm/{group}/{reduce}")].empty
            assert all(s.get("peak") for r in rec["measurement"]["ranks"] for s in r["steps"])
            assert any(ulysses.NOTE == n for n in rec["prediction"]["notes"])
    z3 = recs["ulysses_z3"][0]
    assert any(c["dtype"] == "fp32" and c["kind"] == "reduce_scatter"
               for c in z3["measurement"]["ranks"][0]["steps"][-1]["comm"])


@pytest.mark.real
def test_zero12_peak_is_where_each_partition_says(runs):
    """fp32 ZeRO-2 at 4 ranks, 1 and 2 micro-batches (deepspeed_peak.deep, deepspeed_backward): the ranks
    whose partitions the first hooks reduce into (the output layer's, the last block's) hold a second
    grads_in_partition from then on and peak in a block's SwiGLU backward; the others peak at the
    final norm's backward. fp32 ZeRO-1 at one micro-batch (deepspeed_peak.boundary) peaks in
    reduce_gradients, at the allocation of grads_in_partition. With DeepSpeed's default bucket bf16
    ZeRO-2 peaks at the backward's first hook, where setup_buckets allocates the 1 GB IPG buffer, and
    ZeRO-1 in block 3's ffn_norm backward (PowBackward, every gradient kept). The
    measured peak's phase, operator and micro-batch on every rank and step are the predicted moment's,
    and every kind is reached."""
    from analysis.compare import measured_peak_where

    recs, _ = runs
    ops = {"SwiGLU mul": "aten.mul.Tensor", "final norm's weight gradient (sum)": "aten.sum.dim_IntList",
           "first copy into grads_in_partition": "aten.empty.memory_format",
           "the first hook (setup_buckets allocates the IPG buffer)": "aten.empty.memory_format",
           "ffn_norm backward (pow)": "aten.mul.Tensor"}
    kinds = set()
    for rec in (r for name in recs for r in recs[name]):
        c = rec["config"]["framework"]
        # fp32 at 4 ranks, and ZeRO-2 with DeepSpeed's default bucket (its IPG buffer's allocation)
        if not (c["zero_stage"] in (1, 2) and (c["precision"] == "fp32" or c["reduce_bucket_size"] == 500_000_000)):
            continue
        pred_of = records.predicted_ranks(rec["prediction"])
        pred = {r["rank"]: pred_of(r["rank"])["peak"] for r in rec["measurement"]["ranks"]}
        for r in rec["measurement"]["ranks"]:
            for st in r["steps"]:
                # step 0 (no AdamW state yet) has its own prediction where it differs
                want = (pred[r["rank"]].get("first") or pred[r["rank"]]) if st["step"] == 0 else pred[r["rank"]]
                kind = next((k for k in ops if k in want["what"]), None)
                if kind is None:  # the optimizer step or the backward's start: test_peak_rows
                    continue
                kinds.add(kind)
                where = measured_peak_where(st["peak"])
                last = rec["prediction"]["layout"]["num_microbatches"] - 1
                assert (where["phase"], where["micro_batch"], where["op"]) == (want["phase"], last, ops[kind]), \
                    (r["rank"], st["step"], where, want["what"])
    assert kinds == set(ops), kinds


@pytest.mark.real
def test_zero3_peak_at_the_ipg_reduce_scatter(runs):
    """ZeRO-3 at 4 ranks with a partial reuse distance (budgets) and tied with nothing kept (knobs0)
    peak in backward at an IPG bucket's reduce-scatter (deepspeed_peak.z3_flush: the cat of the
    padded gradients and gloo's copy of it, at a SwiGLU Linear's weight hook); with short sequences at
    the backward epilogue's (the default bucket), the embedding's hook (a bucket of all but the
    embedding, untied and tied) or three of block 0's hooks, its first, one between and its last (hooks). The measured peak's phase,
    micro-batch and operator (reduce_scatter_fn's torch.chunk, just before the collective) are the
    predicted moment's on every rank of the steady steps, and every job reaches its own."""
    from analysis.compare import measured_peak_where

    recs, _ = runs
    jobs = set()
    for name, rec in ((name, r) for name in ("budgets", "knobs0", "epilogue", "emb_tied", "hooks") for r in recs[name]):
        pred = [records.predicted_ranks(rec["prediction"])(0)]
        if "IPG reduce-scatter" not in pred[0]["peak"]["what"]:
            continue
        jobs.add((name, pred[0]["peak"]["what"].split(": ")[-1]))
        mb = int(pred[0]["peak"]["what"].split()[1][:-2])
        for r in rec["measurement"]["ranks"]:
            for st in r["steps"][1:]:
                where = measured_peak_where(st["peak"])
                assert (where["phase"], where["micro_batch"], where["op"]) == \
                    (pred[0]["peak"]["phase"], mb, "aten.split.Tensor"), (R_name(rec), r["rank"], st["step"], where)
    assert jobs == {("budgets", "the IPG reduce-scatter at block 3's w3 weight hook"),
                    ("knobs0", "the IPG reduce-scatter at block 3's w1 weight hook"),
                    ("epilogue", "the last IPG reduce-scatter"),
                    ("epilogue", "the IPG reduce-scatter at the embedding's weight hook"),
                    ("emb_tied", "the IPG reduce-scatter at the embedding's weight hook"),
                    *(("hooks", f"the IPG reduce-scatter at block 0's {k} weight hook") for k in HOOK_BUCKETS)}, jobs


def test_zero3_ipg_flushes_follow_ds_numel():
    """deepspeed_backward.z3_flushes: the buckets fill by each gradient's ds_numel (the ipg_buckets rule
    on the unpadded sizes), each reduce-scatter's input the padded sizes of its bucket; a torch.cat
    unless one gradient whose numel dp divides; an extra-large gradient alone and in its own storage.
    At 3 ranks a bucket of one wq and one norm closes 27 buckets, not the 35 of the padded sizes (the
    odd job measures 27: test_every_row_reconciles_to_the_byte)."""
    from ledger.faithful.deepspeed.common import backward_order, grad_sizes as _grad_sizes, ipg_buckets
    from ledger.faithful.deepspeed.backward import z3_flushes

    for shape in (preset("tiny"), preset("tiny", tied_embeddings=True), preset("llama3_1b")):
        sizes = _grad_sizes(shape)
        for dp, bucket in itertools.product((1, 3, 4, 8), (1, 65_536, ODD_BUCKET, 300_000, 5 * 10**8)):
            fl = z3_flushes(dp, bucket, backward_order(shape))
            assert [sum(x) for x in _members(sizes, fl)] == ipg_buckets(sizes, bucket), (shape, dp, bucket)
            for f, members in zip(fl, _members(sizes, fl)):
                assert f.flat == sum(-(-k // dp) * dp for k in members)
                assert f.cat == (len(members) > 1 or members[0] % dp != 0)
                assert f.own == (members[0] if members[0] > bucket else 0)
                assert f.own == 0 or len(members) == 1
    tiny = preset("tiny")
    assert len(z3_flushes(3, ODD_BUCKET, backward_order(tiny))) == 27
    assert len(ipg_buckets([-(-k // 3) * 3 for k in _grad_sizes(tiny)], ODD_BUCKET)) == 35


def _members(sizes, flushes):
    """The gradients (numel) each flush reduces: those from the previous flush's hook to its own."""
    out, lo = [], 0
    for f in flushes:
        out.append(sizes[lo:f.hook])
        lo = f.hook
    return out


@pytest.mark.real
def test_most_live_activations_are_the_ledgers(runs):
    """The activations derived op by op from launchers/llama.py (deepspeed_peak.saved_activations): the
    most live at once in the last step's timeline is the ledger's, with and without checkpointing
    (checkpointing: one layer's recompute in backward), ZeRO-3's saved gathered weights included (with
    checkpointing: those a block's recompute saved, from the coordinator replay)."""
    recs, _ = runs
    seen, budgets = set(), 0
    for name, rec in [(k, r) for k in recs if k not in ULYSSES for r in recs[k]]:
        pred = records.predicted_ranks(rec["prediction"])(0)["peak"]["detail"]["candidate/activations most live"]
        fw = rec["config"]["framework"]
        # a ZeRO-3 reuse distance between 0 and "everything" releases some gathered weights mm saved
        # before the forward ends (free_param frees the storage under the saved leaf): which ones, the
        # coordinator replay (deepspeed_coordinator.z3_moments)
        budget = fw["zero_stage"] == 3 and fw["stage3_max_reuse_distance"] not in (0, 1_000_000_000)
        for r in rec["measurement"]["ranks"]:
            most = max(p.get("activations", 0) for p in r["steps"][-1]["timeline"])
            # the thread-timing range (probes/peak.py prompt_most): a gathered weight mm saved can be
            # freed late by gloo's worker thread (measured: ZeRO-3 tied, reuse 0, 2 ranks, 1 run in 4
            # +524,288 B on one rank at the loss); had it freed promptly the most is the ledger's
            prompt = r["steps"][-1]["peak"]["prompt_most"].get("activations", 0)
            if name == "hooks":
                # a finding (this candidate only, not the peak): at 32-token sequences with nothing
                # prefetched or kept, a gathered weight mm saved (393,216 B, a w1/w2/w3) is still live at
                # the loss's forward and released before the backward starts, whose saved weights the
                # ledger adds (z3_moments' second moment); checked to stay so until modelled
                assert prompt > pred, (R_name(rec), r["rank"], prompt, pred)
                continue
            assert prompt == pred <= most, (R_name(rec), r["rank"], prompt, most)
        budgets += budget
        seen.add((fw["zero_stage"], _ckpt(rec), fw["stage3_max_reuse_distance"] == 0))
    assert seen >= {(1, False, False), (2, False, False), (3, False, False), (3, False, True), (2, True, False),
                    (3, True, False)}
    assert budgets == 5


def R_name(rec):
    import records as R

    return R.job_name(rec)


# -- the peak, predicted (cheap) --------------------------------------------------------------------

def test_activation_checkpointing_config():
    from omegaconf import OmegaConf

    from conf.validate import validate_framework
    from launchers.deepspeed import ds_config
    from ledger.faithful.deepspeed.zero import place

    validate_framework(_fw(activation_checkpointing=True))
    bad = OmegaConf.create({**OmegaConf.to_container(_fw()), "activation_checkpointing": "yes"})
    with pytest.raises(ConfigError, match="framework.activation_checkpointing='yes' must be true or false"):
        validate_framework(bad)
    cfg = OmegaConf.create({"framework": OmegaConf.to_container(_fw(activation_checkpointing=True)), "train": {"lr": 1e-3}})
    conf = ds_config(cfg, _lay(2))
    assert conf["activation_checkpointing"]["partition_activations"] is False
    assert "activation_checkpointing" not in ds_config(OmegaConf.create({**cfg, "framework": OmegaConf.to_container(_fw())}), _lay(2))
    # ZeRO-3: the checkpoint's recompute fetches each block module a third time (no prefetch, no reuse)
    s = place(preset("tiny"), _lay(2), _fw(zero_stage=3, activation_checkpointing=True, stage3_prefetch_bucket_size=0,
                                          stage3_max_reuse_distance=0, stage3_param_persistence_threshold=0)).rank_state(0)
    plain = place(preset("tiny"), _lay(2), _fw(zero_stage=3, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0,
                                              stage3_param_persistence_threshold=0)).rank_state(0)
    gathers = {c.kind: c.buffer_bytes for c in s.comm}["all_gather"], {c.kind: c.buffer_bytes for c in plain.comm}["all_gather"]
    blocks = 2 * 4 * sum(numel(sh) for _, sh in preset("tiny").layer_params(0))  # bf16, the 4 blocks once
    assert gathers[0] - gathers[1] == blocks


def test_llama_checkpointed_layers_train_the_same():
    """Llama(checkpoint=...) wraps each layer; the same loss and gradients as plain autograd."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from launchers.data import batch
    from launchers.llama import Llama

    shape = preset("tiny", layers=2)
    torch.manual_seed(0)
    a = Llama(shape)
    b = Llama(shape, checkpoint=lambda f, h: checkpoint(f, h, use_reentrant=True))
    b.load_state_dict(a.state_dict())
    x, y = batch(shape.vocab, shape.seq_len, 1, 0, 0, 0, 0, 1)
    la, lb = a(x, y), b(x, y)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    assert all(torch.allclose(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


def test_peak_prediction_tiny():
    """The optimizer-step peak by hand for the tiny model at 2 ranks (reduce_bucket_size 65,536) (3,541,248 params, partition
    1,770,624): resident (bf16 flat 2n + fp32 partition, exp_avg, exp_avg_sq 12p + step 4 + two grad
    norms 8) + fp32 gradient partition and AdamW's two temporaries (12p) + loss and norm scalars (8) +
    the batch (129 int64)."""
    from ledger.faithful.deepspeed.zero import place

    n, p = 3_541_248, 1_770_624
    for z in (1, 2):
        # a reduce bucket smaller than the model (as the matrix runs): the optimizer step is the peak
        pk = place(preset("tiny"), _lay(2), _fw(zero_stage=z, reduce_bucket_size=65536)).rank_state(0).peak
        assert pk.parts == {"resident": 2 * n + 12 * p + 4 + 8, "activations": 1032, "gathered": 0,
                            "temporary": 12 * p + 8, "unnamed": 0}
        assert pk.bytes == 49_578_524 and pk.phase == "optimizer" and pk.first.bytes == pk.bytes - 4
        # DeepSpeed's default reduce_bucket_size (5e8 elements): the IPG buffer the first gradient hook
        # allocates (bf16, 1 GB) puts the peak in backward; one bucket spanning both partitions is
        # all-reduced as a flattened copy, so the buffer is `temporary`. ZeRO-2 peaks at that
        # allocation (the output Linear's gradients beside it, every save but the final norm's output:
        # measured 1,035,560,992 B, `python launch.py framework=deepspeed framework.zero_stage=2
        # cluster.ranks=2 train.steps=2`, step 1, exact, step 0 1,021,395,992 exact); ZeRO-1, whose
        # hooks keep every gradient, deeper, in block 3's ffn_norm backward
        pk = place(preset("tiny"), _lay(2), _fw(zero_stage=z)).rank_state(0).peak
        assert pk.phase == "backward" and ("ffn_norm" if z == 1 else "the first hook") in pk.what, pk.what
        assert pk.detail["temporary/IPG buffer (reduce_bucket_size elements)"] == 2 * 500_000_000
        if z == 2:
            assert (pk.bytes, pk.first.bytes) == (1_035_560_992, 1_021_395_992)
        if z == 1:
            # the default config (ZeRO-1) of the Slurm, report and W&B sweeps: measured 1,036,281,888 B in
            # block 3's ffn_norm backward (its fp32 pow backward), exact (131,072 B short before that
            # moment, 393,216 B before the backward's moments)
            assert pk.bytes == 1_036_281_888
    pk = place(preset("tiny"), _lay(2), _fw(zero_stage=3, reduce_bucket_size=BELOW_EMBEDDING)).rank_state(1).peak
    # ZeRO-3: partitions 2p (the persistent params released in step()), grad partitions 2p + IPG bucket,
    # fp64 norms (two resident, two temporaries) and inf_or_nan_tracker
    assert pk.parts["resident"] == 2 * p + 2 * p + 2 * BELOW_EMBEDDING + 12 * p + 4 + 17
    assert pk.parts["temporary"] == 12 * p + 4 + 16 and pk.bytes == 49_709_617
    # 4 samples a micro-batch: the start of backward (measured 61,059,096 in the matrix's ac job); step 0
    # peaks in the optimizer step (no AdamW state before it: its backward start is 14,164,996 lower)
    # (the matrix's ac jobs: reduce_bucket_size 65,536)
    pk = place(preset("tiny"), _lay(2, mbs=4), _fw(zero_stage=2, reduce_bucket_size=65536)).rank_state(0).peak
    assert (pk.phase, pk.bytes, pk.first.phase, pk.first.bytes) == ("backward", 61_059_096, "optimizer", 49_585_680)
    assert pk.parts["temporary"] == 2 * 4 * 4 * 128 * 1024 + 16  # cross-entropy gradients in fp32, loss scalars
    ck = place(preset("tiny"), _lay(2, mbs=4), _fw(zero_stage=2, reduce_bucket_size=65536,
                                                   activation_checkpointing=True)).rank_state(0).peak
    assert ck.phase == "optimizer" and ck.detail["candidate/activations most live"] < \
        pk.detail["candidate/activations most live"] / 4


def test_activations_derivation():
    """Per layer (bf16, b=1): norms 2 x (fp32 copy 4bsh + rsqrt 4bs + 2 x 2bsh), rope angles 4 x 4s(d/2),
    q/k/v/out 4 x 2bsHd, logsumexp 4bHs, SwiGLU 4 x 2bsf; checkpointing keeps no layer's saves."""
    from ledger.faithful.deepspeed import activations as P

    m = preset("tiny")
    per = P.layer_activations(m, 1, 2)
    assert per == {"attention_norm": 262_656, "attention": 299_008, "ffn_norm": 262_656, "feed_forward": 786_432}
    assert P.layer_activations(m, 2, 2)["feed_forward"] == 2 * 786_432
    full = P.most_live_activations(m, 1, 2, False)
    assert full == 4 * sum(per.values()) + 262_656 + 524_288 + 4 + 1032
    assert P.most_live_activations(m, 1, 2, True) == sum(per.values()) + 1032
    # fp32: x.float() and type_as are the tensors themselves, the norm saves its input instead
    assert P.layer_activations(m, 1, 4)["attention_norm"] == 12 * 128 * 256 + 4 * 128
    assert P.modelled(preset("tiny", norm="layernorm")) and P.modelled(preset("tiny", swiglu=False))


@pytest.mark.parametrize("shape", [dict(), dict(tied_embeddings=True), dict(layers=3, vocab=1000)])
def test_piece_rules_are_the_one_group_rules(shape):
    """backward.py's rules over param-group pieces (DeepSpeed-MoE's several groups) are, for one flat
    group, the dense ledger's fast per-group ones: each rank's grads_in_partition and the hook that
    makes it (partition_flushes), the gradients made and reduced in place per hook (hooked), whether a
    collective reduces the IPG buffer itself (ipg_touched), over both walk orders, several dp and
    buckets (one below the embedding, one below a block's largest weight, one above the model)."""
    from ledger.faithful.deepspeed import backward as B
    from ledger.faithful.deepspeed.common import backward_order

    m = preset("tiny", **shape)
    for dp, bucket in itertools.product((2, 3, 4), (BELOW_EMBEDDING, 150_000, 500_000_000)):
        part, at = B._flat(m, dp)
        for order in (backward_order(m), tuple(m.params())):
            pieces = tuple(B.Piece(0, *at[name]) for name, _ in order)
            assert tuple(B.piece_flush(pieces, (part,), (r,), bucket) for r in range(dp)) == \
                B.partition_flushes(m, dp, bucket, order), (dp, bucket)
            assert B.piece_hooked(pieces, (part,), (0,), bucket) == B.hooked(m, dp, bucket, order)
            assert B.piece_ipg_touched(pieces, (part,), (0,), bucket) == B.ipg_touched(m, dp, bucket, order)


def test_reduction_calls_merge_slices_as_average_tensor_does():
    """stage_1_and_2.py average_tensor by hand: a gradient's slice per partition of its group it lies
    in, merged with the previous slice only when both go to the same partition of the same process
    group; each process group's slices one all-reduce (a torch.cat of several) while their sum stays
    within reduce_bucket_size."""
    from ledger.faithful.deepspeed.backward import Piece, reduction_calls

    parts, pgs = (100, 50), (0, 1)  # a dense group over dp (partitions of 100), an expert group over edp (50)
    # dense [0, 60) and [60, 130): partitions 0, then 0 and 1; an expert piece between breaks the merge
    content = (Piece(0, 0, 60), Piece(1, 0, 40), Piece(0, 60, 70))
    assert reduction_calls(content, parts, pgs, 1000) == [(0, 130, 3), (1, 40, 1)]
    # consecutive dense pieces of one partition merge: one slice, a view of the bucket
    assert reduction_calls((Piece(0, 0, 30), Piece(0, 30, 20)), parts, pgs, 1000) == [(0, 50, 1)]
    # a bucket limit of 60 cuts the dense slices into calls once their sum passes it
    assert reduction_calls(content, parts, pgs, 60) == [(0, 100, 2), (0, 30, 1), (1, 40, 1)]


def test_offload_by_hand():
    """ZeRO-Offload at 2 ranks of the tiny model with DeepSpeed's default bucket (one micro-batch): the state of
    the plain layout plus the host fp32 gradient partition (4p), the model-dtype staging partition (2p) and two
    gradient buffers of the largest param (2 x 2 x 262,144: one the host's, one the device's), the first three
    and the optimizer state on the host; the peak where the plain layout's is (the IPG buffer's allocation at
    the first hook, before any copy to the host) by those buffers more: measured 1,047,233,312 B on both ranks
    (`python launch.py framework=deepspeed framework.zero_stage=2 cluster.ranks=2
    framework.offload_optimizer=cpu`, step 1); for a GPU run (cuda-nccl) the device's part only."""
    from ledger.faithful.deepspeed.zero import place
    from ledger.target import CUDA_NCCL

    n, p, big = 3_541_248, 1_770_624, 262_144
    plain = place(preset("tiny"), _lay(2), _fw(zero_stage=2)).rank_state(0)
    off = place(preset("tiny"), _lay(2), _fw(zero_stage=2, offload_optimizer="cpu")).rank_state(0)
    assert off.grads_bytes == 4 * p and off.other_bytes == plain.other_bytes + 2 * p + 2 * 2 * big
    assert off.host_bytes == plain.optim_bytes + 4 * p + 2 * p + 2 * big
    assert off.resident_bytes - off.host_bytes == 2 * n + 4 + 2 * big
    assert off.peak.bytes == plain.peak.bytes + 11_672_320 == 1_047_233_312 and "the first hook" in off.peak.what
    assert off.peak.bound[1] > off.peak.bytes
    gpu = place(preset("tiny"), _lay(2), _fw(zero_stage=2, offload_optimizer="cpu"), CUDA_NCCL).rank_state(0).peak
    assert gpu.parts["resident"] == 2 * n + 2 * big + 4  # the params, the device's buffer, the grad norm
    # ZeRO-3: the host fp32 gradient partition beside the device's partitions, the grad norm in fp32
    plain = place(preset("tiny"), _lay(2), _fw(zero_stage=3)).rank_state(0)
    off = place(preset("tiny"), _lay(2), _fw(zero_stage=3, offload_optimizer="cpu")).rank_state(0)
    part = plain.optim_bytes // 12
    assert off.grads_bytes == plain.grads_bytes + 4 * part and off.other_bytes == plain.other_bytes - 4
    assert off.host_bytes == plain.optim_bytes + 4 * part
    assert [(c.kind, c.dtype, c.buffer_bytes) for c in off.comm if c.what == "grad norm"] == [("all_reduce", "fp32", 4)]
    # ZeRO-3's offload_param alone: the model-dtype partitions on the host, the rest as without offload; on a GPU
    # the device's peak holds the params less those partitions, bounded by a gather's copy of them to the device
    par = place(preset("tiny"), _lay(2), _fw(zero_stage=3, offload_param="cpu")).rank_state(0)
    assert (par.resident_bytes, par.comm) == (plain.resident_bytes, plain.comm) and par.host_bytes == 2 * part
    assert par.peak.bytes == plain.peak.bytes and par.peak.bound is None
    gpu_par = place(preset("tiny"), _lay(2), _fw(zero_stage=3, offload_param="cpu"), CUDA_NCCL).rank_state(0).peak
    gpu_plain = place(preset("tiny"), _lay(2), _fw(zero_stage=3), CUDA_NCCL).rank_state(0).peak
    assert gpu_par.detail["resident/params"] == gpu_plain.detail["resident/params"] - 2 * part
    assert gpu_par.bound[1] > gpu_par.bytes


def test_offload_refusals_name_the_field():
    """What the ledger does not model of ZeRO-Offload is refused naming framework.offload_optimizer and why; the
    planner tries offload only where it is modelled."""
    from ledger.faithful.deepspeed import rules
    from ledger.plan import Space

    tiny, moe = preset("tiny"), preset("tiny_moe")
    for model, lay, fw, why in ((tiny, _lay(2), _fw(zero_stage=2, offload_optimizer="nvme"), "NVMe"),
                                (tiny, _lay(2), _fw(zero_stage=1, offload_optimizer="cpu", precision="fp32"), "fp32"),
                                (tiny, _lay(2), _fw(zero_stage=1, offload_optimizer="cpu", overlap_comm=True),
                                 "overlap_comm"),
                                (moe, _lay(2), _fw(zero_stage=2, offload_optimizer="cpu"), "MoE"),
                                (tiny, _lay(2), _fw(zero_stage=2, offload_param="cpu"), "zero_stage=3")):
        with pytest.raises(ConfigError, match="offload_optimizer|offload_param") as e:
            rules.validate_layout(model, lay, fw)
        assert why in str(e.value)
    with pytest.raises(ConfigError, match="framework.offload_optimizer='gpu' must be one of none, cpu, nvme"):
        rules.validate_knobs(_fw(offload_optimizer="gpu"))
    sets = rules.plan_knob_sets(Space(8, offload_optimizer=("none", "cpu")), tiny, 8)
    assert {(k["zero_stage"], k["offload_optimizer"]) for k in sets} == {(z, o) for z in (1, 2, 3) for o in ("none", "cpu")}
    assert all(k["offload_optimizer"] == "none" for k in rules.plan_knob_sets(Space(8, offload_optimizer=("none", "cpu")),
                                                                                tiny, 4, cp=2))


def test_offload_copies_and_link_bytes():
    """The per-rank transient of a reduction's copy into the host partition (backward.offload_copies): the
    largest slice's fp64 norm, plus its whole gradient's clone where extra-large; the host link's bytes per
    partition element (steptime.offload_link_bytes): the fp32 gradients out and the params back, and ZeRO-2's
    accumulation through the host every micro-batch."""
    from ledger.faithful.deepspeed import backward
    from ledger.faithful.deepspeed.steptime import offload_link_bytes

    m = preset("tiny")
    big = m.vocab * m.hidden
    # 4 ranks: the output weight (the last param, whole in rank 3's partition) extra-large under 65,536
    assert backward.offload_copies(m, 4, 65_536, 2)[3] == 8 * big + 2 * big
    assert backward.offload_copies(m, 4, 10**9, 2)[3] == 8 * big
    counts = backward.partition_params(m, 4)
    assert sum(e for _, e in counts) >= m.num_params() and all(c > 0 for c, _ in counts)
    assert offload_link_bytes(1, 4) == offload_link_bytes(2, 1) == 6 and offload_link_bytes(2, 2) == 4 + 4 + 2 + 2
