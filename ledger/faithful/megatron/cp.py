"""Megatron Core 0.18.0 context parallelism with TransformerEngine's attention, from sources: no CPU run
can confirm it (TE runs on CUDA only, and Megatron's local spec asserts context_parallel_size == 1:
transformer/dot_product_attention.py), so every row it adds says "from sources" (CP_BASIS) in the table,
prediction.json and the planner's rows.

What CP changes (megatron-core 0.18.0; TransformerEngine v2.8 transformer_engine/pytorch/attention/
dot_product_attention/context_parallel.py):
- nothing of the weights: each rank holds its TP / PP shard as without CP; the data-parallel group the
  grads are reduced over and the distributed optimizer shards over is dp x cp
  (distributed_data_parallel.py: intra_dp_cp_group, get_data_parallel_group(with_context_parallel=True);
  optimizer/__init__.py data_parallel_group=intra_dp_cp_group; scaling 1 / (dp * cp)); so a rank's
  states and grad collectives are those of the same layout at dp * cp without CP, the group labelled
  by both dims;
- each rank holds s / cp tokens of every sequence (the batch and RoPE sliced zigzag:
  rope_utils.py, utils.py get_batch_on_this_cp_rank): its activations, TP / SP collectives and
  pipeline p2p tensors are those of a sequence of s / cp tokens; the CP ranks share a micro-batch (the
  number of micro-batches is global / (micro x dp));
- TE's attention, cp_comm_type "p2p" (Megatron-LM's default, --cp-comm-type; TEDotProductAttention
  passes "p2p" when unset): AttnFuncWithCPAndKVP2P sends the local K and V as one flat buffer
  (2 x s/cp x b x kv_heads/tp x head_dim, bf16) around the ring: cp - 1 exchanges in forward, and in
  backward cp - 1 of K/V and cp - 1 of dK/dV (ping-pong buffers): 3 (cp - 1) exchanges (an isend and an
  irecv each) per attention layer per micro-batch; it saves q, the last K/V received, its output and
  one fp32 softmax_lse, about what a fused attention saves on s / cp tokens.
Not modelled (refused): cp_comm_type a2a / all_gather / a2a+p2p, CP with MoE, the forward's cp receive
buffers and fp32 output accumulator and the backward's ping-pong buffers in the peak (the peak is the s / cp
layout's: a stated under-estimate of those buffers).
"""
from __future__ import annotations

import dataclasses

from ledger.errors import ConfigError
from ledger.model import ModelShape, model_dict
from ledger.placement import Comm, CommBuilder, Placement, RankState, wire_bytes

CP_BASIS = ("megatron CP from sources (TransformerEngine's p2p context parallelism; no run here can confirm it): "
            "states and grad collectives of dp x cp, activations and TP / PP collectives of s / cp tokens, the "
            "ring's K/V exchanges; the ring's receive buffers are not in the peak")


def check(model: ModelShape, lay, k) -> None:
    if k.transformer_impl != "transformer_engine":
        raise ConfigError(f"megatron: cp={lay.cp} needs framework.transformer_impl=transformer_engine (the local "
                          "spec's DotProductAttention asserts context_parallel_size == 1: 'Context parallelism is "
                          "only supported by TEDotProductAttention!')")
    if model.seq_len % (2 * lay.cp):
        raise ConfigError(f"megatron: model.seq_len={model.seq_len} must be divisible by 2 x cp = {2 * lay.cp} "
                          "(Megatron-LM arguments.py: seq_length % (context_parallel_size * 2) == 0)")
    if model.is_moe:
        raise ConfigError(f"megatron: cp={lay.cp} with MoE is not modelled")


def flat(model: ModelShape, lay) -> tuple[ModelShape, object]:
    """The same ranks without CP: a sequence of s / cp tokens, dp x cp data-parallel ranks sharing the
    micro-batches the CP ranks share (the grid orders tp, cp, dp, pp: rank r's dp x cp index is its
    cp index + cp x its dp index, the flat layout's dp index of r)."""
    cp = lay.cp
    return (dataclasses.replace(model, seq_len=model.seq_len // cp),
            dataclasses.replace(lay, cp=1, dp=lay.dp * cp, global_batch_size=lay.global_batch_size * cp))


def ring_exchanges(model: ModelShape, lay, layers: int) -> Comm:
    """TE's p2p ring per optimizer step on a stage of `layers` attention layers: 3 (cp - 1) exchanges per
    layer and micro-batch, each an isend and an irecv of the local K/V (counted as the pipeline's p2p:
    two calls, the sent one on the wire)."""
    kv = 2 * (model.seq_len // lay.cp) * lay.micro_batch_size * (model.kv_heads // lay.tp) * model.head_dim * 2
    n = 3 * (lay.cp - 1) * layers * lay.num_microbatches
    return Comm("cp", "send_recv", 2 * n, 2 * n * kv, n * wire_bytes("send_recv", kv, lay.cp), "bf16",
                "TE p2p context parallelism: K/V ring (forward), K/V and dK/dV (backward)")


def place(model: ModelShape, lay, fw, target, place_flat, stage_layers) -> Placement:
    """The Placement of a CP layout: place_flat(model, layout) of the flat layout (states, its dp dims
    relabelled dp x cp), with each stage's ring exchanges added; stage_layers(stage) -> its layers."""
    m_flat, lay_flat = flat(model, lay)
    pl = place_flat(m_flat, lay_flat, fw, target)
    cache: dict[int, RankState] = {}

    def label(dim: str) -> str:
        # a flat group over dp is the real group over cp and dp (grid.label_of joins dims in DIMS order,
        # where cp comes right before dp)
        return "-".join(("cp-dp" if d == "dp" else d) for d in dim.split("-"))

    def relabel(comms):
        b = CommBuilder()
        for c in comms:
            b.add_calls(label(c.dim), c.kind, c.dtype, c.count, c.buffer_bytes, c.wire_bytes, c.what)
        return b.build()

    def state(r: int) -> RankState:
        s = pl.rank_state(r)
        out = cache.get(id(s))
        if out is None:
            ring = ring_exchanges(model, lay, stage_layers(s.stage))
            out = cache[id(s)] = RankState(
                s.stage, s.params_bytes, s.grads_bytes, s.optim_bytes, s.other_bytes,
                comm_fn=lambda s=s, ring=ring: relabel(s.comm) + [ring],
                comm_first=lambda s=s, ring=ring: None if s.comm_first is None else relabel(s.comm_first) + [ring],
                detail=s.detail, peak=lambda s=s: s.peak)
        return out

    return dataclasses.replace(pl, model=lambda: model_dict(model), layout=lay.to_dict, rank_state=state,
                               notes=[CP_BASIS, *pl.notes], basis=CP_BASIS, _per_gpu=None)
