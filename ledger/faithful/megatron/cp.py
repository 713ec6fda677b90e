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
- the other attentions (framework.cp_comm_type, TE context_parallel.py attn_forward_func_with_cp):
  "all_gather" (AttnFuncWithCPAndKVAllGather, Llama 3's): forward all-gathers K and V over cp
  (gather_along_first_dim, two calls of the local [s/cp, b, kv_heads/tp, head_dim]), the backward
  gathers them again (the gathered K/V are not saved) and reduce-scatters dK and dV (two calls of the
  gathered size); "a2a" (AttnFuncWithCPAndQKVOA2A, DeepSpeed-Ulysses'): flash_attn_a2a_communicate
  all-to-alls Q, K and V before attention (sequence gathered, heads scattered: heads / tp and kv_heads
  / tp divisible by cp) and the output after, the backward dout before and dQ, dK, dV after: 8
  all_to_all_single calls per layer per micro-batch, each of the local tensor; "a2a+p2p"
  (AttnFuncWithCPAndKVP2P with cp_group = [a2a group, p2p group], parallel_state.py
  create_hierarchical_groups: the a2a groups consecutive inside the cp group, of the first of
  hierarchical_context_parallel_sizes): the same 8 all-to-alls inside each a2a group, then the p2p ring
  over the p2p group on heads / a2a of the whole a2a group's sequence: 3 (p2p - 1) exchanges of K/V of
  s / p2p tokens. TE collapses a2a+p2p to p2p or a2a where one size is 1.
Not modelled (refused): CP with MoE. Not in the peak: the ring's receive buffers and fp32 output
accumulator, the backward's ping-pong buffers, all_gather's gathered K/V and a2a's send / receive
buffers (transient; the peak is the s / cp layout's: a stated under-estimate of those buffers). The
a2a groups of a2a+p2p are labelled "cp" like the whole group (a sub-group of it).
"""
from __future__ import annotations

import dataclasses
from math import prod

from ledger.errors import ConfigError
from ledger.model import ModelShape, model_dict
from ledger.placement import Comm, CommBuilder, Placement, RankState, wire_bytes

# TransformerConfig.cp_comm_type's values (transformer_config.py; TE attn_forward_func_with_cp)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
_WHAT = {"p2p": "the ring's K/V exchanges", "all_gather": "K/V all-gathers and dK/dV reduce-scatters",
         "a2a": "Q/K/V/O all-to-alls", "a2a+p2p": "Q/K/V/O all-to-alls inside the a2a groups, the ring's K/V exchanges"}


def basis(comm_type: str = "p2p") -> str:
    return (f"megatron CP from sources (TransformerEngine's {comm_type} context parallelism; no run here can confirm "
            "it): states and grad collectives of dp x cp, activations and TP / PP collectives of s / cp tokens, "
            f"{_WHAT[comm_type]}; their transient buffers are not in the peak")


CP_BASIS = basis()


def comm_type(fw) -> tuple[str, int, int]:
    """(TE's comm type, a2a group size, p2p group size) as TE runs it: a2a+p2p with a size of 1 is
    the other one (attn_forward_func_with_cp); p2p and all_gather use the whole cp group."""
    t = getattr(fw, "cp_comm_type", None) or "p2p"
    cp_sizes = getattr(fw, "hierarchical_context_parallel_sizes", None)
    if t != "a2a+p2p":
        return t, 1, 1
    a2a, p2p = (int(x) for x in cp_sizes)
    if a2a == 1:
        return "p2p", 1, p2p
    if p2p == 1:
        return "a2a", a2a, 1
    return t, a2a, p2p


def check(model: ModelShape, lay, k, fw=None) -> None:
    if k.transformer_impl != "transformer_engine":
        raise ConfigError(f"megatron: cp={lay.cp} needs framework.transformer_impl=transformer_engine (the local "
                          "spec's DotProductAttention asserts context_parallel_size == 1: 'Context parallelism is "
                          "only supported by TEDotProductAttention!')")
    if model.seq_len % (2 * lay.cp):
        raise ConfigError(f"megatron: model.seq_len={model.seq_len} must be divisible by 2 x cp = {2 * lay.cp} "
                          "(Megatron-LM arguments.py: seq_length % (context_parallel_size * 2) == 0)")
    if model.is_moe:
        raise ConfigError(f"megatron: cp={lay.cp} with MoE is not modelled")
    t = getattr(fw, "cp_comm_type", None) or "p2p"
    sizes = getattr(fw, "hierarchical_context_parallel_sizes", None)
    if t == "a2a+p2p" and (sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != lay.cp):
        raise ConfigError(f"megatron: framework.cp_comm_type=a2a+p2p needs framework."
                          f"hierarchical_context_parallel_sizes=[a2a, p2p] with a2a x p2p = cp={lay.cp} (got {sizes}; "
                          "TE attn_forward_func_with_cp: 'CP implementation a2a+p2p requires cp_group = "
                          "[a2a_cp_group, p2p_cp_group]', parallel_state.py: prod(sizes) == context_parallel_size)")
    if sizes is not None and len(sizes) and prod(int(x) for x in sizes) != lay.cp:
        raise ConfigError(f"megatron: framework.hierarchical_context_parallel_sizes={list(sizes)} must multiply to "
                          f"cp={lay.cp} (parallel_state.py initialize_model_parallel: "
                          "np.prod(hierarchical_context_parallel_sizes) == context_parallel_size)")
    t, a2a, _ = comm_type(fw)
    split = lay.cp if t == "a2a" else a2a
    if t in ("a2a", "a2a+p2p"):
        for what, heads in (("heads", model.heads), ("kv_heads", model.kv_heads)):
            if (heads // lay.tp) % split:
                raise ConfigError(f"megatron: cp_comm_type={t}: model.{what}={heads} / tp={lay.tp} must be divisible "
                                  f"by the a2a size {split} (TE context_parallel.py: \"cp_comm_type='a2a' requires "
                                  "num_heads % cp_size == 0 for Q, K, V\")")



def flat(model: ModelShape, lay) -> tuple[ModelShape, object]:
    """The same ranks without CP: a sequence of s / cp tokens, dp x cp data-parallel ranks sharing the
    micro-batches the CP ranks share (the grid orders tp, cp, dp, pp: rank r's dp x cp index is its
    cp index + cp x its dp index, the flat layout's dp index of r)."""
    cp = lay.cp
    return (dataclasses.replace(model, seq_len=model.seq_len // cp),
            dataclasses.replace(lay, cp=1, dp=lay.dp * cp, global_batch_size=lay.global_batch_size * cp))


def ring_exchanges(model: ModelShape, lay, layers: int, ring: int | None = None, heads_split: int = 1) -> Comm:
    """TE's p2p ring per optimizer step on a stage of `layers` attention layers: 3 (ring - 1) exchanges
    per layer and micro-batch, each an isend and an irecv of the local K/V (counted as the pipeline's
    p2p: two calls, the sent one on the wire). ring: the p2p group (cp; a2a+p2p's second size), each
    rank's K/V s / ring tokens over kv_heads / tp / heads_split heads (a2a+p2p's a2a size)."""
    ring = ring or lay.cp
    kv = (2 * (model.seq_len // ring) * lay.micro_batch_size * (model.kv_heads // lay.tp // heads_split)
          * model.head_dim * 2)
    n = 3 * (ring - 1) * layers * lay.num_microbatches
    return Comm("cp", "send_recv", 2 * n, 2 * n * kv, n * wire_bytes("send_recv", kv, ring), "bf16",
                "TE p2p context parallelism: K/V ring (forward), K/V and dK/dV (backward)")


def _local(model: ModelShape, lay, heads: int) -> int:
    """Bytes of one local bf16 [s / cp, b, heads / tp, head_dim] tensor."""
    return (model.seq_len // lay.cp) * lay.micro_batch_size * (heads // lay.tp) * model.head_dim * 2


def kv_gathers(model: ModelShape, lay, layers: int) -> list[Comm]:
    """all_gather per optimizer step: per layer and micro-batch K and V gathered in forward and again in
    backward (4 all_gather calls of the gathered cp x local size), dK and dV reduce-scattered (2 calls
    of the gathered size): nccl-tests' sizes, the output's and the input's."""
    full = lay.cp * _local(model, lay, model.kv_heads)
    n = layers * lay.num_microbatches
    return [Comm("cp", "all_gather", 4 * n, 4 * n * full, 4 * n * wire_bytes("all_gather", full, lay.cp), "bf16",
                 "TE all_gather context parallelism: K and V (forward; backward again)"),
            Comm("cp", "reduce_scatter", 2 * n, 2 * n * full, 2 * n * wire_bytes("reduce_scatter", full, lay.cp),
                 "bf16", "TE all_gather context parallelism: dK and dV (backward)")]


def qkvo_all_to_alls(model: ModelShape, lay, layers: int, group: int) -> Comm:
    """a2a per optimizer step: per layer and micro-batch Q, K, V and the output in forward, dout, dQ,
    dK, dV in backward, each an all_to_all_single of the local tensor over `group` ranks (the cp
    group, or a2a+p2p's a2a group, whose local tensors hold s / cp tokens of the gathered heads)."""
    q, kv = _local(model, lay, model.heads), _local(model, lay, model.kv_heads)
    per = 4 * q + 4 * kv  # Q, O, dO, dQ; K, V, dK, dV
    n = layers * lay.num_microbatches
    return Comm("cp", "all_to_all", 8 * n, n * per, n * (4 * wire_bytes("all_to_all", q, group)
                                                           + 4 * wire_bytes("all_to_all", kv, group)), "bf16",
                "TE a2a context parallelism: Q, K, V, O (forward), dO, dQ, dK, dV (backward)")


def cp_comms(model: ModelShape, lay, fw, layers: int) -> list[Comm]:
    """The attention's CP collectives per optimizer step on a stage of `layers` layers, by comm type."""
    t, a2a, p2p = comm_type(fw)
    if t == "p2p":
        return [ring_exchanges(model, lay, layers)]
    if t == "all_gather":
        return kv_gathers(model, lay, layers)
    if t == "a2a":
        return [qkvo_all_to_alls(model, lay, layers, lay.cp)]
    return [qkvo_all_to_alls(model, lay, layers, a2a), ring_exchanges(model, lay, layers, p2p, a2a)]


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
            ring = cp_comms(model, lay, fw, stage_layers(s.stage))
            out = cache[id(s)] = RankState(
                s.stage, s.params_bytes, s.grads_bytes, s.optim_bytes, s.other_bytes,
                comm_fn=lambda s=s, ring=ring: relabel(s.comm) + ring,
                comm_first=lambda s=s, ring=ring: None if s.comm_first is None else relabel(s.comm_first) + ring,
                detail=s.detail, peak=lambda s=s: s.peak)
        return out

    why = basis(comm_type(fw)[0])
    return dataclasses.replace(pl, model=lambda: model_dict(model), layout=lay.to_dict, rank_state=state,
                               notes=[why, *pl.notes], basis=why, _per_gpu=None)
