"""DeepSpeed-Ulysses (DeepSpeed 0.19.8 sequence parallelism; layout.cp is its sequence_parallel_size) as
train-ledger drives it (launchers/deepspeed.py ulysses): the sequence groups of
runtime/sequence_parallel/parallel_state_sp.py (cp consecutive ranks; the sequence-data-parallel group
every rank), passed to deepspeed.initialize as its mpu, each layer's attention wrapped in
deepspeed.sequence.layer.DistributedAttention, every rank a slice of s / cp tokens.

What it changes:
- nothing of the weights: ZeRO partitions and reduces over the sequence-data-parallel group (engine.py
  seq_data_parallel_group; zero/stage_1_and_2.py, stage3.py dp_process_group), dp x cp ranks, and
  sums the cp ranks' gradients (its reductions divide by dp x cp / cp): a rank's states and grad
  collectives are those of the same model at dp x cp without Ulysses on s / cp tokens, the group
  labelled by its dims;
- DistributedAttention per layer and micro-batch: forward an all_to_all_single of Q, K and V (sequence
  gathered, heads scattered: _SeqAllToAll, single_all_to_all) and of the output back, backward the
  same four on the gradients: 8 calls (12 with activation checkpointing: the recompute's forward), each
  of the local [b, s / cp, heads (kv_heads), head_dim] tensor in the compute dtype;
- the gradient reductions' dtype: engine.py sets communication_data_type (ZeRO's IPG buckets' dtype,
  ZeRO-3's reduction dtype) to seq_parallel_communication_data_type when sequence_parallel_size > 1
  (runtime/constants.py: fp32 by default; ZeRO-3's IPG bucket is kept in it, twice the bf16 one);
  the ledger models fp32 and the compute dtype (check); ZeRO-1/2's allreduce_bucket all-reduces in
  fp32 whatever it is when sequence_parallel_size > 1 (zero/stage_1_and_2.py: "if pg_correctness_test or
  self.sequence_parallel_size > 1: communication_data_type = torch.float32"), a cast copy of each
  bucket.
- the peak within a step: the flat layout's, with what Ulysses adds at its moments (measured, the
  probe's census): DistributedAttention's output all-to-all makes wo's input, a [b, s / cp, heads, d]
  of its own beside SDPA's saved output, per layer (activations.layer_activations); the batch is the
  whole sequence's, each rank's slice a view of it (activations.batch_bytes); the backward's caller
  holds loss / cp, one more scalar (peak._Step.loss_scalars); the reductions in their dtype (peak.py:
  ZeRO-3's reduce-scatter input and gloo's copy of it in fp32, ZeRO-1/2's allreduce_bucket casts:
  cast_copies; those of the reductions before a backward's or boundary's last are not candidates,
  which the peak's `what` says).
Not modelled: the uneven K/V head split, MoE.
"""
from __future__ import annotations

import dataclasses

from ledger.dtypes import nbytes
from ledger.errors import ConfigError
from ledger.model import ModelShape, model_dict
from ledger.placement import Comm, CommBuilder, Placement, RankState, wire_bytes

NOTE = ("DeepSpeed-Ulysses (layout.cp = sequence_parallel_size): states, grad collectives and peak of ZeRO over "
        "dp x cp on s / cp tokens, DistributedAttention's all-to-alls and its saves added, the reductions in their "
        "dtype")


def check(lay, fw) -> None:
    """The gradient reductions' dtypes the ledger models: fp32 (DeepSpeed's default) or the compute dtype."""
    allowed = ("fp32", "bf16") if fw.precision == "bf16" else ("fp32",)
    got = getattr(fw, "seq_parallel_communication_data_type", "fp32")
    if got not in allowed:
        raise ConfigError(f"deepspeed: cp={lay.cp} (Ulysses): framework.seq_parallel_communication_data_type={got}: the "
                          f"ledger models {' or '.join(allowed)} (the gradient reductions' dtype: engine.py "
                          "communication_data_type)")


def flat(model: ModelShape, lay):
    """The same ranks without Ulysses: s / cp tokens, dp x cp data-parallel ranks sharing the
    micro-batches the cp ranks share."""
    cp = lay.cp
    return (dataclasses.replace(model, seq_len=model.seq_len // cp),
            dataclasses.replace(lay, cp=1, dp=lay.dp * cp, global_batch_size=lay.global_batch_size * cp))


def all_to_alls(model: ModelShape, lay, fw) -> Comm:
    """DistributedAttention per optimizer step: per layer and micro-batch 8 all_to_all_single calls over
    the cp group, Q, O, dQ, dO of the local [b, s / cp, heads, head_dim] and K, V, dK, dV of kv_heads;
    with activation checkpointing the recompute's forward runs Q, K, V, O's again (12)."""
    dt = "bf16" if fw.precision == "bf16" else "fp32"
    local = (model.seq_len // lay.cp) * lay.micro_batch_size * model.head_dim * nbytes(dt)
    q, kv = local * model.heads, local * model.kv_heads
    n = model.layers * lay.num_microbatches
    each = 3 if getattr(fw, "activation_checkpointing", False) else 2  # passes: forward, (recompute,) backward
    return Comm("cp", "all_to_all", 4 * each * n, n * each * (2 * q + 2 * kv),
                n * each * (2 * wire_bytes("all_to_all", q, lay.cp) + 2 * wire_bytes("all_to_all", kv, lay.cp)), dt,
                "DeepSpeed-Ulysses DistributedAttention: Q, K, V, O (forward" +
                (", recompute" if each == 3 else "") + "), dO, dQ, dK, dV (backward)")


def place(model: ModelShape, lay, fw, target, place_flat) -> Placement:
    """The Placement of an Ulysses layout: place_flat(model, layout, fw, target) of the flat layout
    (its dp collectives over the sequence-data-parallel group, labelled by the grid), the all-to-alls
    added, its peak with Ulysses' terms (the module docstring)."""
    check(lay, fw)
    m_flat, lay_flat = flat(model, lay)
    if fw.zero_stage in (1, 2):
        pl = place_flat(m_flat, lay_flat, fw, target, ipg_reduce_dtype="fp32", sp=lay.cp)
    else:
        pl = place_flat(m_flat, lay_flat, fw, target,
                        reduce_precision=getattr(fw, "seq_parallel_communication_data_type", "fp32"), sp=lay.cp)
    seq_dp = lay.grid.label_of(("cp", "dp"))
    a2a = all_to_alls(model, lay, fw)
    cache: dict[int, RankState] = {}

    def relabel(comms):
        b = CommBuilder()
        for c in comms:
            b.add_calls(seq_dp if c.dim == "dp" else c.dim, c.kind, c.dtype, c.count, c.buffer_bytes, c.wire_bytes,
                        c.what)
        return b.build()

    def state(r: int) -> RankState:
        s = pl.rank_state(r)
        out = cache.get(id(s))
        if out is None:
            out = cache[id(s)] = RankState(
                s.stage, s.params_bytes, s.grads_bytes, s.optim_bytes, s.other_bytes,
                comm_fn=lambda s=s: relabel(s.comm) + [a2a],
                comm_first=lambda s=s: None if s.comm_first is None else relabel(s.comm_first) + [a2a],
                detail=s.detail, peak=s.peak)
        return out

    notes = [n.replace(f"pure DP over {lay_flat.dp} ranks", f"DP over {lay.dp} x Ulysses cp {lay.cp} ranks")
             for n in pl.notes]
    return dataclasses.replace(pl, model=lambda: model_dict(model), layout=lay.to_dict, rank_state=state,
                               notes=[*notes, NOTE], _per_gpu=None)
