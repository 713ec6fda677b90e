"""Faithful ledger for Megatron Core 0.18.0 Mixture-of-Experts models (model.num_experts > 0): what DDP
and the chained distributed optimizer keep per rank, and which collectives one optimizer step calls,
with expert parallelism (layout.ep). The dense ledger's rules for the dense part are reused (the
parameters of ledger.faithful.megatron.pipeline, the buffers' padding and buckets and the optimizer's
per-byte-range shards of buffers, RoPE and the "mpu" scratch of states, the TP / PP traffic of comm);
what MoE changes is here. Paths under megatron/core/ unless said otherwise.

Parameters (models/gpt/gpt_layer_specs.py get_gpt_decoder_block_spec: an MoE layer every
moe_layer_freq layers, transformer/moe/moe_layer.py MoELayer: router, then experts):
  dense   everything but the routed experts: embedding, attention, norms, the router weight
          [num_experts, hidden] (router.py Router.__init__; Float16Module casts it to bf16), dense
          layers' MLPs; split by tp as for a dense model
  expert  each EP rank's num_experts / ep experts (moe_layer.py BaseMoELayer), each a local-spec MLP
          split over the expert tensor parallel group (experts.py SequentialMLP: linear_fc1
          [2*ffn/etp, h] with SwiGLU, linear_fc2 [h, ffn/etp]; their linears make no TP call of their
          own, explicit_expert_comm: the dispatcher moves the tokens over etp*ep ranks)
          marked allreduce=False when ep > 1 (tensor_parallel/layers.py) and so kept by DDP in
          expert_parallel_buffers (distributed/distributed_data_parallel.py): padded and bucketed as the
          dense buffer, over the expert data parallel group (lcm(edp, 128); the same bucket size,
          max(40M, 1M * dp) of the dense dp), sharded by a second DistributedOptimizer over edp
          (optimizer/__init__.py get_megatron_optimizer: ChainedOptimizer([dense, expert]))

Collectives of one step, beside the dense ones:
  dp / edp  each buffer's buckets reduce-scattered over its group; the param all-gathers run TWICE
            per step for every bucket group, dense and expert: each of the ChainedOptimizer's two
            DistributedOptimizers' step_with_ready_grads calls start_param_sync_for_bucket_group_subset
            over all model chunks' bucket_groups + expert_parallel_bucket_groups
            (optimizer/distrib_optimizer.py, optimizer/optimizer.py ChainedOptimizer._step)
  tp        with SP, finalize_model_grads.py _allreduce_non_tensor_model_parallel_grads adds the router
            weights (marked sequence_parallel, router.py) to the norms' coalesced all-reduce; q/k norms
            (qk_layernorm) join it with or without SP. An MoE layer's MLP makes no TP call of its own
            (the experts' linears skip SP communication: explicit_expert_comm) but attention's
  ep / etp-ep  the token dispatcher's, per MoE layer per micro-batch (moe_token_dispatcher_type):
            allgather (token_dispatcher.py MoEAllGatherTokenDispatcher, the default): over the
            expert tensor-and-model-parallel group (N = etp*ep ranks) the routing map (bool), the probs
            and the hidden states [T, h] all-gathered in forward (the hidden states into the "mpu"
            GlobalMemoryBuffer), the expert output reduce-scattered; backward reduce-scatters the
            hidden and probs grads and all-gathers the output grad: every size fixed (T*N rows).
            alltoall (MoEAlltoAllTokenDispatcher): without capacity padding, the tokens per expert
            all-gathered (int64 [E] per rank, forward), then over ep the permuted tokens and their
            probs all-to-all'ed to the experts and the expert output back; backward the same three
            with the splits swapped. What a rank sends is fixed on the side of its own tokens (T*k rows:
            the dispatch forward, the combine backward) and follows the routing on the side of its
            experts (the combine forward, the dispatch backward: the rows routed to them). The ledger
            predicts the balanced case (T*k rows) and carries the bound [0, ep*T*min(k, E/ep)] rows on
            that side (Comm.buffer_range); over an EP group the received rows sum to the sent ones, so
            the group's total is exact. With a capacity factor and moe_pad_expert_input_to_capacity
            every expert gets capacity = ceil(T*k/E * factor) rows (moe_utils.py get_capacity) from
            every rank: fixed, and no count all-gather
  fp32      the grad norm: one all-reduce over the world (ChainedOptimizer.get_grad_norm: one group)

Resident extras: the second optimizer's unity loss scale (_scale_one), MoEAuxLossAutoScaler's loss scale
(moe_utils.py set_loss_scale, called from schedules.py forward_step for every micro-batch of an MoE
model: one fp32 element kept as a class attribute), the allgather dispatcher's "mpu" rows (T*N*h).

Shared experts (moe_shared_expert_hidden): a dense, TP-split MLP after the experts in each MoE layer,
with the dense MLP's TP calls (shared_experts.py SharedExpertMLP; moe_shared_expert_overlap off).

At ep = 1 the experts are dense parameters (allreduce=True): in the dense buffer, reduced over the
data parallel group alone. Their etp shards then hold TP's ranks' tokens only when etp = tp (the
allgather dispatcher gathers the TP ranks' tokens over the tp_ep group, which is TP's ranks); with
etp < tp every TP rank trains a replica of the same expert shard on its own tokens and no collective
ever sums those grads: the replicas drift apart. Megatron-LM's --expert-tensor-parallel-size defaults
to tp for this reason (training/arguments.py); the ledger predicts ep = 1 with etp = tp and refuses
to run (or write a run.sh for) any other etp there.

The peak within a step: the dense rules (ledger.faithful.megatron.peak) with the MoE layers' saves of
ledger.faithful.megatron.moe_activations at balanced routing and its bound (moe_stage_peak), the two
optimizers' transients (moe_optimizer_moments); not with capacity padding, the router in fp32 or the
sequence aux loss (peak_modelled: no peak row).

Selective recompute (core_attn) is the dense layers' rule for the attention (activations.layer_groups):
the MoE layers' saves do not change, nor does a collective. Full recompute: a checkpoint's recompute
runs its MoE layers' forward again, their dispatcher's forward collectives with it (_dispatcher_comm
forward_only; the MLP's SP calls an MoE layer does not make, micro_batch_comm's, taken off), and its
dispatchers then hold the checkpoint's input and the input's grad until their next forward
(activations.recompute_holding, in the backward's later moments, the optimizer's and the forward's).
Not modelled (refused, naming the knob): etp > 1 with the alltoall dispatcher, interleaving (vp > 1),
fp32, overlap_param_gather, tied embeddings, grouped GEMM (TransformerEngine).
T: a micro-batch's tokens on a rank, seq_len * micro_batch_size / tp with sequence parallelism.
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import numpy as np

from ledger.faithful.megatron import target as megatron_target
from ledger.faithful.megatron.activations import recompute_of, recomputed_layers
from ledger.faithful.megatron.buffers import (buffer_bytes, buffer_layout, build_buffer, effective_bucket_size, owned_sizes,
                                              shard_ranges)
from ledger.faithful.megatron.comm import micro_batch_comm
from ledger.faithful.megatron.knobs import dtypes, knobs
from ledger.faithful.megatron.pipeline import layer_range, padded_shape, pieces
from ledger.faithful.megatron.moe_activations import held, moe_shape, rows_range, tokens
from ledger.faithful.megatron.peak import adam_denominators, bucket_copy, stage_peak
from ledger.faithful.megatron.states import check_framework, check_interleaving, mpu_numel as dense_mpu_numel, NOTES
from ledger.faithful.megatron.target import fused_optimizer_in_place
from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict
from ledger.placement import CommBuilder, Placement, RankState
from ledger.optim import add_adamw, adamw_bytes

# the expert groups' labels, as launchers/megatron.py expert_group_labels names them to the comm probe
# (parallel_state's expert grid "tp-ep-dp-pp" with tp = etp): EP, expert TP, the two together (what the
# dispatchers call tp_ep), expert data parallel
EXPERT_DIMS = ("ep", "etp", "etp-ep", "etp-ep-pp", "edp")

MOE_NOTE = ("MoE (ledger/faithful/megatron/moe.py): routed experts in DDP's expert_parallel_buffers over the expert "
            "data parallel group, a second optimizer over them (ChainedOptimizer; distributed optimizers all-gather "
            "every param twice per step)")
MOE_PEAK_NOTE = ("MoE peak (moe_activations.py): the MoE layers' saves at balanced routing (every expert T*topk/E rows), "
                 "bounded from the fewest to the most rows routed to this rank's experts (Peak.bound); the dispatchers' "
                 "routing kept between forwards is temporary; the experts' backward moments are from sources (no CPU job "
                 "peaks there); measured on the CPU (s = 512) inside the bound and within 0.01% at the rows the run routed")
NO_PEAK_NOTE = ("MoE: the peak within a step is not modelled with capacity padding, the router in fp32 or the sequence "
                "aux loss (no peak row; moe_activations.py)")
ROUTED_NOTE = ("alltoall without capacity padding: the all-to-all bytes on the experts' side follow the router; "
               "predicted balanced (T*topk rows), bounded by buffer_range; exact over an EP group")


def check_moe(model: ModelShape, lay: Layout, k) -> None:
    """What this ledger does not model, refused naming the knob, and Megatron's own MoE rules."""
    def no(what: str) -> None:
        raise ConfigError(f"megatron: model.num_experts={model.num_experts}: {what} (the faithful MoE ledger does "
                          "not model it; ledger.mode=textbook predicts it)")

    if lay.etp > 1 and k.moe_token_dispatcher_type != "allgather":
        # token_dispatcher.py MoEAlltoAllTokenDispatcher with tp > 1: an all-gather over etp after the
        # all-to-all and a reduce-scatter before the return, whose sizes follow the router
        no(f"layout.etp={lay.etp} with framework.moe_token_dispatcher_type={k.moe_token_dispatcher_type}")
    # what no real MoE run here has confirmed: fp32 training (no Float16Module: the router and its
    # probs in fp32)
    if k.precision != "bf16":
        no(f"framework.precision={k.precision}")
    if lay.vp > 1:
        no(f"layout.vp={lay.vp}: the interleaved schedule")
    if k.overlap_param_gather:
        no("framework.overlap_param_gather")
    if model.tied_embeddings:
        no("model.tied_embeddings")
    if lay.cp > 1:
        no(f"layout.cp={lay.cp}")


def sp_error(model: ModelShape, lay: Layout) -> str | None:
    """transformer/moe/moe_layer.py MoELayer.forward raises ValueError in training with TP and no SP."""
    if model.is_moe and lay.tp > 1 and not lay.sequence_parallel:
        return (f"megatron: model.num_experts={model.num_experts} with tp={lay.tp} needs layout.sequence_parallel=true: "
                "transformer/moe/moe_layer.py MoELayer.forward raises ValueError in training (\"During training, "
                "performance may degrade if MoE and tensor parallelism are enabled without also enabling sequence "
                "parallelism.\")")
    return None


def etp_error(model: ModelShape, lay: Layout) -> str | None:
    """At ep = 1 with etp != tp, the experts' grads are never summed over the TP ranks that train
    replicas of one shard (the module docstring): Megatron runs it, the replicas drift apart."""
    if model.is_moe and lay.ep == 1 and lay.etp != lay.tp:
        return (f"megatron: model.num_experts={model.num_experts}: layout.ep=1 with tp={lay.tp} needs layout.etp={lay.tp} "
                f"(is {lay.etp}): at ep=1 the experts are dense parameters (tensor_parallel/layers.py allreduce), their "
                f"grads reduced over the data parallel group alone, so with etp < tp the TP ranks' replicas of an expert "
                "shard drift apart; Megatron-LM's --expert-tensor-parallel-size defaults to tp (training/arguments.py)")
    return None


def plan_expert_tp(tp: int, ep: int) -> int:
    """The etp the planner gives an MoE layout: tp at ep = 1 (the only one whose experts stay in step,
    etp_error), 1 beside expert parallelism (experts whole on their EP ranks, no etp all-gathers)."""
    return tp if ep == 1 else 1


def dispatch_error(model: ModelShape, lay: Layout) -> str | None:
    """What a run or run.sh of an MoE layout is refused for (launchers/job.py), the first that applies."""
    return sp_error(model, lay) or etp_error(model, lay)


def check_moe_knobs(fw) -> None:
    """The MoE framework knobs' values (conf/validate.py for the schema's sets)."""
    if fw.moe_grouped_gemm:
        raise ConfigError("framework.moe_grouped_gemm=true needs TransformerEngine's TEGroupedMLP (or the grouped_gemm "
                          "package): the local spec's experts are a SequentialMLP (models/backends.py "
                          "LocalSpecProvider); the faithful MoE ledger models SequentialMLP")
    if fw.moe_pad_expert_input_to_capacity and fw.moe_expert_capacity_factor is None:
        raise ConfigError("framework.moe_pad_expert_input_to_capacity=true needs framework.moe_expert_capacity_factor "
                          "(token_dispatcher.py MoEAlltoAllTokenDispatcher asserts it)")
    if fw.moe_expert_capacity_factor is not None and not fw.moe_pad_expert_input_to_capacity:
        raise ConfigError("framework.moe_expert_capacity_factor without moe_pad_expert_input_to_capacity: dropped "
                          "tokens make every size follow the router; the faithful MoE ledger models drop-less "
                          "routing and capacity with padding")
    if fw.moe_expert_capacity_factor is not None and fw.moe_token_dispatcher_type != "alltoall":
        raise ConfigError("framework.moe_expert_capacity_factor: token dropping with padding is modelled for "
                          "framework.moe_token_dispatcher_type=alltoall only")


# -- parameters ------------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _moe_layer(model: ModelShape, tp: int, ep: int, etp: int) -> tuple[tuple, tuple, tuple]:
    """(dense params before the experts, expert params, dense params after them) of one MoE decoder
    layer as (name, local numel) in named_parameters() order: the dense layer's attention and norms
    (pieces), the router weight [E, h] after pre_mlp_layernorm (moe_layer.py registers router, experts,
    shared_experts in that order), each local expert's linear_fc1 and linear_fc2 split over etp
    (experts.py SequentialMLP.local_experts), then the shared expert."""
    _, layer, _ = pieces(model, tp)
    dense = tuple(p for p in layer if not p[0].startswith("mlp."))
    dense += (("mlp.router.weight", model.num_experts * model.hidden),)
    if model.bias:
        dense += (("mlp.router.bias", model.num_experts),)
    h, f = model.hidden, model.expert_ffn // etp
    fc1 = (2 if model.swiglu else 1) * f
    expert = []
    for j in range(model.num_experts // ep):
        p = f"mlp.experts.local_experts.{j}"
        expert += [(f"{p}.linear_fc1.weight", fc1 * h)] + ([(f"{p}.linear_fc1.bias", fc1)] if model.bias else [])
        expert += [(f"{p}.linear_fc2.weight", h * f)] + ([(f"{p}.linear_fc2.bias", h)] if model.bias else [])
    fs = model.moe_shared_expert_hidden
    after = ()
    if fs:
        # shared_experts.py SharedExpertMLP (registered after the experts, moe_layer.py): a dense MLP of
        # width moe_shared_expert_intermediate_size, split by tp like the dense layers' (no gate: 
        # moe_shared_expert_gate is off)
        s1 = (2 if model.swiglu else 1) * fs // tp
        after += (("mlp.shared_experts.linear_fc1.weight", s1 * h),) + (
            (("mlp.shared_experts.linear_fc1.bias", s1),) if model.bias else ())
        after += (("mlp.shared_experts.linear_fc2.weight", h * fs // tp),) + (
            (("mlp.shared_experts.linear_fc2.bias", h),) if model.bias else ())
    return dense, tuple(expert), after


def stage_params(model: ModelShape, tp: int, pp: int, ep: int, etp: int, stage: int, split: tuple) -> tuple[list, list]:
    """(dense, expert) (name, local numel) lists of one pipeline stage, GPTModel order, its layers
    global index offset by the stages before it (the MoE pattern is over global layers)."""
    emb, layer, head = pieces(model, tp)
    layers = layer_range(model, pp, stage, split)
    first = layers.start
    dense = list(emb) if stage == 0 else []
    expert = []
    before, moe_expert, after = _moe_layer(model, tp, ep, etp)
    for i in layers:
        if model.is_moe_layer(i):
            dense += [(f"decoder.layers.{i - first}.{name}", k) for name, k in before + after]
            expert += [(f"decoder.layers.{i - first}.{name}", k) for name, k in moe_expert]
        else:
            dense += [(f"decoder.layers.{i - first}.{name}", k) for name, k in layer]
    if stage == pp - 1:
        dense += list(head)
    return dense, expert


@lru_cache(maxsize=1024)
def _stage_buffers(model: ModelShape, lay: Layout, k, stage: int):
    """(dense buffer, expert buffer or None) of a stage (one model chunk: vp is refused). With ep = 1
    the experts are dense parameters (tensor_parallel/layers.py allreduce = not (is_expert and ep > 1))."""
    dense, expert = _dense_and_expert(model, lay, k, stage)
    bucket = effective_bucket_size(k, lay.dp, stage)
    dist = k.use_distributed_optimizer
    d = build_buffer(np.array([n for _, n in dense], np.int64), bucket, lay.dp, dist)
    e = build_buffer(np.array([n for _, n in expert], np.int64), bucket, lay.edp, dist) if expert else None
    return d, e


def _dense_and_expert(model: ModelShape, lay: Layout, k, stage: int) -> tuple[list, list]:
    """A stage's (dense, expert) parameters as DDP buffers them: with ep = 1 every parameter is dense,
    in named_parameters() order (the experts inside their layers)."""
    if lay.ep == 1:
        return _ordered(model, lay, k, stage), []
    return stage_params(model, lay.tp, lay.pp, lay.ep, lay.etp, stage, k.pp_split)


def _ordered(model: ModelShape, lay: Layout, k, stage: int) -> list:
    """A stage's parameters in named_parameters() order, experts inside their layers (ep = 1)."""
    emb, layer, head = pieces(model, lay.tp)
    moe_layer = sum(_moe_layer(model, lay.tp, 1, lay.etp), ())
    out = list(emb) if stage == 0 else []
    for i in layer_range(model, lay.pp, stage, k.pp_split):
        out += list(moe_layer) if model.is_moe_layer(i) else list(layer)
    return out + (list(head) if stage == lay.pp - 1 else [])


# -- one rank ----------------------------------------------------------------------------------------
def _moe_layers_of(model: ModelShape, lay: Layout, k, stage: int) -> int:
    return sum(model.is_moe_layer(i) for i in layer_range(model, lay.pp, stage, k.pp_split))


def _recomputed_moe_layers(model: ModelShape, lay: Layout, k, stage: int) -> int:
    """The stage's MoE layers whose forward full recompute runs again in backward (recomputed_layers:
    every layer with uniform, the chunk's first recompute_num_layers with block)."""
    layers = layer_range(model, lay.pp, stage, k.pp_split)
    again = recomputed_layers(recompute_of(k), len(layers))
    return sum(model.is_moe_layer(i) for i in list(layers)[:again])


def mpu_numel(model: ModelShape, lay: Layout, k, stage: int) -> int:
    """utils.py GlobalMemoryBuffer "mpu" (activation dtype): the local spec's attention scores, the SP
    all-gathers, and the allgather dispatcher's gathered hidden states [T*N, h] (mappings.py
    gather_from_sequence_parallel_region(use_global_buffer=True)) on a stage with an MoE layer."""
    base = dense_mpu_numel(model, lay, k.transformer_impl, stage)
    if k.moe_token_dispatcher_type == "allgather" and lay.etp * lay.ep > 1 and _moe_layers_of(model, lay, k, stage):
        base = max(base, tokens(model, lay) * lay.etp * lay.ep * model.hidden)
    return base


def rank_state(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int, edp_rank: int) -> RankState:
    pdt, gdt, pb, gb = dtypes(k)
    bf16 = k.precision == "bf16"
    dist = k.use_distributed_optimizer
    dense, expert = _stage_buffers(model, lay, k, stage)
    s = RankState(stage=stage)
    owned = {}
    for what, buf, group, rank in (("", dense, lay.dp, dp_rank), ("expert ", expert, lay.edp, edp_rank)):
        if buf is None:
            continue
        p_bytes, g_bytes = buffer_bytes(buf.numel, int(buf.prefix[-1]), dist, pb, gb)
        s.add("params_bytes", f"{what}{pdt} param buffer (param_data)" if dist else f"{what}{pdt} module parameters",
              p_bytes)
        s.add("grads_bytes", f"{what}{gdt} grad buffer (grad_data)", g_bytes)
        owned[what] = (owned_sizes([buf], group, rank) if dist
                       else (int(buf.prefix[-1]), len(buf.starts)))
    for what, (numel, n_pieces) in owned.items():
        if bf16:
            s.add("optim_bytes", f"{what}fp32 master params", 4 * numel)
        add_adamw(s, numel, n_pieces, what)
    if bf16:
        # optimizer.py MixedPrecisionOptimizer.__init__: one _scale_one per DistributedOptimizer
        s.add("other_bytes", "unity loss scale (_scale_one)", 4 * len(owned))
    half = -(-model.head_dim // 2)
    s.add("other_bytes", "rope inv_freq", 4 * half)
    s.add("other_bytes", "rope emb (lru_cache)", 4 * model.seq_len * 2 * half)
    # moe_utils.py MoEAuxLossAutoScaler.set_loss_scale: the first micro-batch's scale (fp32 [1]) is kept
    s.add("other_bytes", "MoE aux-loss scale (MoEAuxLossAutoScaler)", 4)
    mpu = mpu_numel(model, lay, k, stage)
    if mpu:
        s.add("other_bytes", "global memory buffer (mpu)", (2 if bf16 else 4) * mpu)
    s.comm_fn = lambda: _comm(model, lay, k, stage)
    if peak_modelled(model, k):
        adam = adamw_bytes(s.detail)
        s.peak = lambda: moe_stage_peak(model, lay, k, stage, dp_rank, edp_rank, s.totals(), adam)
    return s


# -- the peak --------------------------------------------------------------------------------------
def peak_modelled(model: ModelShape, k) -> bool:
    """Where moe_activations models the MoE layer's saves (its docstring): drop-less routing, the router
    in the activation dtype, the aux loss of aux_loss (or none)."""
    return (model.moe_router_dtype is None and k.moe_expert_capacity_factor is None
            and (k.moe_aux_loss_coeff == 0 or k.moe_router_load_balancing_type == "aux_loss"))


def moe_stage_peak(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int, edp_rank: int, resident: dict,
                   adam_state: int):
    """The rank's peak (peak.stage_peak) with its MoE layers' saves at the balanced rows, bounded by the
    same at no rows and at the most rows to this rank's experts (moe_activations.rows_range; Peak.bound),
    with the two optimizers' moments (moe_optimizer_moments)."""
    opt = moe_optimizer_moments(model, lay, k, stage, dp_rank, edp_rank)
    n_moe = _moe_layers_of(model, lay, k, stage)

    def at(rows: str):
        mo = moe_shape(model, lay, k, rows)
        return stage_peak(model, lay, k, stage, dp_rank, resident, adam_state, rows, opt, n_moe * held(mo))

    pk = at("balanced")
    # with every choice local (ep 1) the rows cannot move: the bound is the peak itself
    fixed = len(set(rows_range(moe_shape(model, lay, k)))) == 1
    low, high = (pk, pk) if fixed else (at("low"), at("high"))
    pk.bound = (low.bytes, high.bytes)
    if pk.first is not None:
        pk.first.bound = ((low.first or low).bytes, (high.first or high).bytes)
    return pk


@lru_cache(maxsize=256)
def moe_optimizer_moments(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int, edp_rank: int) -> tuple:
    """peak.optimizer_moments for the ChainedOptimizer of an MoE model (optimizer/__init__.py: one
    optimizer over the dense buffer's params, one over the experts'): the grad sync's gloo copy of the
    largest bucket of either buffer (distributed optimizer), and the largest single-tensor AdamW
    transient of either optimizer (peak.adam_denominators over each one's param groups)."""
    if fused_optimizer_in_place(k):
        return (0, ""), (0, "")
    dist = k.use_distributed_optimizer
    _pdt, _gdt, _pb, gb = dtypes(k)
    bucket = effective_bucket_size(k, lay.dp, stage)
    dense, expert = _dense_and_expert(model, lay, k, stage)
    sync, adam = (0, ""), (0, "")
    for params, group, rank in ((dense, lay.dp, dp_rank), (expert, lay.edp, edp_rank)):
        if not params:
            continue
        buckets = buffer_layout(params, bucket, group, dist)
        if dist:
            sync = max(sync, bucket_copy(buckets, gb))
            shards = shard_ranges(buckets, group, rank)
        else:
            shards = params
        adam = max(adam, adam_denominators(shards))
    return sync, adam


def _comm(model: ModelShape, lay: Layout, k, stage: int):
    pdt, gdt, pb, gb = dtypes(k)
    dense, expert = _stage_buffers(model, lay, k, stage)
    cb = CommBuilder()
    grid = Grid(tp=lay.tp, dp=lay.dp, pp=lay.pp)
    gathers = 2 if expert is not None else 1  # ChainedOptimizer: each DistributedOptimizer gathers all
    for dim, buf, group in (("dp", dense, lay.dp), ("edp", expert, lay.edp)):
        if buf is None:
            continue
        numels = (buf.bend - buf.bstart).tolist()
        if k.use_distributed_optimizer:
            cb.add_each(dim, "reduce_scatter", [gb * n for n in numels], group, gdt, "grad bucket (start_grad_sync)")
            for _ in range(gathers):
                cb.add_each(dim, "all_gather", [pb * n for n in numels], group, pdt,
                            "param bucket (start_param_sync, once per DistributedOptimizer of the ChainedOptimizer)")
        else:
            cb.add_each(dim, "all_reduce", [gb * n for n in numels], group, gdt, "grad bucket (start_grad_sync)")
    dims = ("tp", "dp", "pp") if k.use_distributed_optimizer else ("tp", "pp")
    if k.clip_grad > 0:
        cb.add(grid.label_of(dims), "all_reduce", 4, grid.size_of(dims), "fp32", what="grad norm (clip_grads.py)")
        if expert is not None and not k.use_distributed_optimizer:
            # optimizer/__init__.py: plain DDP's expert optimizer keeps its grad stats over tp_ep_pp, the
            # dense one over mp (tp*pp): not one group, so ChainedOptimizer.get_grad_norm asks each
            # (grads_states_parallel_group_is_shared() is False); the distributed optimizers share
            # intra_dist_opt_group and make one all-reduce
            cb.add("etp-ep-pp", "all_reduce", 4, lay.etp * lay.ep * lay.pp, "fp32",
                   what="expert grad norm (clip_grads.py, the expert optimizer's own group tp_ep_pp)")
    # finalize_model_grads.py _allreduce_non_tensor_model_parallel_grads: SP norms and routers, q/k norms
    tp_sum = sum(size for n, size in _dense_and_expert(model, lay, k, stage)[0]
                 if (lay.sequence_parallel and ("layernorm" in n or "router" in n))
                 or (model.qk_layernorm and ("q_layernorm" in n or "k_layernorm" in n)))
    if tp_sum:
        cb.add("tp", "all_reduce", gb * tp_sum, lay.tp, gdt, what="SP norm / router grads (finalize_model_grads)")
    # per micro-batch: TP (attention everywhere, the MLP in dense layers), PP, the cross-entropy
    m = lay.num_microbatches
    moe = _moe_layers_of(model, lay, k, stage)

    # an MoE layer's MLP makes no TP call (its experts' linears: explicit_expert_comm; SP is required
    # with tp): of the SP calls micro_batch_comm counts per layer (6 all-gathers, 4 reduce-scatters:
    # attention's 3 and 2, the MLP's 3 and 2) an MoE layer makes attention's alone
    # A shared expert is an ordinary TP MLP (moe_layer.py runs it beside the routed ones, without
    # moe_shared_expert_overlap): its calls are the dense MLP's
    # (and a recomputed one's forward again, the MLP's all-gather and reduce-scatter, micro_batch_comm's
    # two of each a recomputed layer)
    again = _recomputed_moe_layers(model, lay, k, stage)
    mlp_calls = {} if model.moe_shared_expert_hidden else {("tp", "all_gather"): 3 * moe + again,
                                                           ("tp", "reduce_scatter"): 2 * moe + again}

    def per_mb(dim, kind, dtype, what, calls, unit, div, group, wires):
        calls -= mlp_calls.get((dim, kind), 0) if what.startswith("SP ") else 0
        if calls > 0 and group > 1:
            x = lay.micro_batch_size * unit // div
            cb.add(dim, kind, x, group, dtype, count=calls * m, what=what)

    micro_batch_comm(per_mb, model, lay.tp, lay.pp, 1, k, stage, lay.sequence_parallel)
    if moe and lay.etp * lay.ep > 1:
        _dispatcher_comm(cb, model, lay, k, moe * m)
        if again:  # a recomputed MoE layer's forward dispatches and combines again in its backward
            _dispatcher_comm(cb, model, lay, k, again * m, forward_only=True)
    if moe and k.moe_aux_loss_coeff > 0 and k.moe_router_load_balancing_type in AUX_LOSS_TOKENS:
        # router.py TopKRouter._apply_aux_loss / _apply_seq_aux_loss -> moe_utils.py
        # get_tokens_per_expert_and_token_count: the routing map's tokens per expert (int64; per
        # sequence and expert for seq_aux_loss) all-reduced over the tp x cp group, every MoE layer's forward
        n = model.num_experts * AUX_LOSS_TOKENS[k.moe_router_load_balancing_type](lay.micro_batch_size)
        cb.add("tp", "all_reduce", 8 * n, lay.tp, "int64", count=moe * m,
               what="tokens per expert for the aux loss (moe_utils.py get_tokens_per_expert_and_token_count)")
    return cb.build()


# the aux losses that all-reduce the tokens per expert, and how many counts per expert each reduces
AUX_LOSS_TOKENS = {"aux_loss": lambda b: 1, "seq_aux_loss": lambda b: b}


def _dispatcher_comm(cb: CommBuilder, model: ModelShape, lay: Layout, k, calls: int, forward_only: bool = False) -> None:
    """The token dispatcher's collectives over `calls` = MoE layers x micro-batches (module docstring);
    forward_only: the forward's alone (full recompute runs a checkpointed MoE layer's forward again)."""
    pdt, _, ab, _ = dtypes(k)
    prob_dt = {"fp32": "fp32", "fp64": "fp64"}.get(model.moe_router_dtype, pdt)
    prob_b = {"fp32": 4, "fp64": 8}.get(prob_dt, ab)
    T, kk, E, h, ep = tokens(model, lay), model.moe_router_topk, model.num_experts, model.hidden, lay.ep
    n = lay.etp * ep  # the tp_ep group
    if k.moe_token_dispatcher_type == "allgather":
        rows = T * n
        what = "allgather token dispatcher (token_dispatcher.py)"
        bwd = 0 if forward_only else calls
        cb.add("etp-ep", "all_gather", rows * E, n, "bool", count=calls, what=what)  # routing map
        cb.add("etp-ep", "all_gather", rows * E * prob_b, n, prob_dt, count=calls, what=what)  # probs
        cb.add("etp-ep", "reduce_scatter", rows * E * prob_b, n, prob_dt, count=bwd, what=what)  # probs grad
        cb.add("etp-ep", "all_gather", rows * h * ab, n, pdt, count=calls, what=what)  # hidden states
        cb.add("etp-ep", "reduce_scatter", rows * h * ab, n, pdt, count=bwd, what=what)  # their grad
        cb.add("etp-ep", "reduce_scatter", rows * h * prob_b, n, prob_dt, count=calls, what=what)  # combine
        cb.add("etp-ep", "all_gather", rows * h * prob_b, n, prob_dt, count=bwd, what=what)  # combine grad
        return
    what = "alltoall token dispatcher (token_dispatcher.py)"
    if k.moe_pad_expert_input_to_capacity:
        # every rank sends each expert `capacity` rows and receives as many for each local expert
        rows = _capacity(T * kk, E, k.moe_expert_capacity_factor) * E
        per = 1 if forward_only else 2  # forward, and backward
        cb.add("ep", "all_to_all", rows * h * ab, ep, pdt, count=2 * per * calls, what=what)
        cb.add("ep", "all_to_all", rows * prob_b, ep, prob_dt, count=per * calls, what=what)
        return
    # the count all-gather: each rank's tokens per expert (int64 [E]) over tp_ep, forward only
    cb.add("etp-ep", "all_gather", E * 8 * n, n, "int64", count=calls, what="tokens per expert (preprocess)")
    own, most = T * kk, ep * T * min(kk, E // ep)  # rows of this rank's tokens, the most its experts get
    if forward_only:
        # the dispatch (its own tokens, fixed) and the combine (its experts' rows, routed); the probs' dispatch
        cb.add_token_all_to_all("ep", pdt, ep, what, own, most, h * ab, calls)
        cb.add_routed("ep", "all_to_all", prob_dt, ep, what, [(own * prob_b, calls, 0, 0)])
        return
    cb.add_token_all_to_all("ep", pdt, ep, what, own, most, h * ab, 2 * calls)  # tokens, expert outputs
    cb.add_token_all_to_all("ep", prob_dt, ep, what, own, most, prob_b, calls)  # their probs


def _capacity(num_tokens: int, num_experts: int, factor: float) -> int:
    """transformer/moe/moe_utils.py get_capacity: ceil(num_tokens / num_experts * capacity_factor)."""
    return math.ceil((num_tokens / num_experts) * factor)


# -- the layout ------------------------------------------------------------------------------------
def place(model: ModelShape, lay: Layout, fw, target: str | None = None) -> Placement:
    k = megatron_target.with_target(knobs(fw), fw, target)
    megatron_target.check(k)
    check_framework(k)
    check_interleaving(lay)
    check_moe(model, lay, k)
    check_moe_knobs(k)
    notes = list(NOTES[k.transformer_impl]) + [MOE_NOTE, MOE_PEAK_NOTE if peak_modelled(model, k) else NO_PEAK_NOTE]
    if etp_error(model, lay):
        # as for SP below: the layout Megatron-LM trains by default (etp = tp), said so
        notes.insert(0, f"layout.etp={lay.etp} at ep=1 with tp={lay.tp}: the TP ranks' expert replicas would drift apart "
                        f"(no collective sums their grads); predicted with etp={lay.tp}, Megatron-LM's default (a run or "
                        "run.sh of this layout is refused)")
        lay = dataclasses.replace(lay, etp=lay.tp)
    if sp_error(model, lay):
        # a run or a run.sh of this layout is refused (launchers/job.py check); a prediction describes the
        # one layout Megatron trains, the same with sequence parallelism, and says so
        lay = dataclasses.replace(lay, sequence_parallel=True)
        notes.insert(0, "layout.sequence_parallel=false: Megatron's MoELayer.forward raises in training with tp > 1 "
                        "and no SP; predicted with sequence_parallel=true (a run or run.sh of this layout is refused)")
    if k.moe_token_dispatcher_type == "alltoall" and not k.moe_pad_expert_input_to_capacity and lay.ep > 1:
        notes.append(ROUTED_NOTE)
    trained = padded_shape(model, lay.tp, k.make_vocab_size_divisible_by)
    if trained.vocab != model.vocab:  # (an equal shape from the cache may be another object)
        notes.append(f"vocab {model.vocab} padded to {trained.vocab} rows (make_vocab_size_divisible_by="
                     f"{k.make_vocab_size_divisible_by} x tp={lay.tp})")
    cache: dict[tuple, RankState] = {}
    tp, dp, ep, edp = lay.tp, lay.dp, lay.ep, lay.edp

    def key(rank: int) -> tuple[int, int, int]:
        # dense grid tp, dp, pp (cp = 1); expert grid etp, ep, edp, pp
        return rank // (tp * dp), rank // tp % dp, rank // (lay.etp * ep) % edp

    def state(rank: int) -> RankState:
        kk = key(rank)
        s = cache.get(kk)
        if s is None:
            s = cache[kk] = rank_state(trained, lay, k, *kk)
        return s

    return Placement(framework="megatron", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                     world=lay.world, rank_state=state, notes=notes, spec=k.transformer_impl,
                     target=megatron_target.of(k), workspaces=megatron_target.workspaces(k))
