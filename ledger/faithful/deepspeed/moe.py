"""Faithful ledger for DeepSpeed 0.19.8 ZeRO-1/2 with DeepSpeed-MoE (model.num_experts > 0), as a DeepSpeed
user writes it: deepspeed.moe.layer.MoE around each MoE layer's expert FeedForward (launchers/deepspeed.py
moe_layers), the parameters split by moe/utils.py split_params_into_different_moe_groups_for_optimizer.
Paths under deepspeed/ unless said otherwise. The dense ZeRO-1/2 rules (zero12.py: the IPG bucket fill,
allreduce_chunks, the step's collectives) are reused per parameter group.

Groups (utils/groups.py, made in deepspeed.initialize: engine._configure_distributed_model ->
MoE.set_deepspeed_parallelism): "ep_size_<ep>", expert parallel groups of ep consecutive ranks, expert
data parallel groups of the ranks holding the same experts (edp = world / ep).

Parameters: the dense group (named "parameters"), registration order: the embedding, each block's
norms and attention, an MoE layer's gate.wg [E, h] (moe/sharded_moe.py TopKGate: an nn.Linear, cast to
bf16 with the model), a dense layer's FeedForward, the final norm, the output. The MoE group(s): each MoE
layer's E/ep local experts (moe/experts.py Experts: a deepcopy of the expert per local expert, w1 w2 w3),
cut greedily into groups of at most MAX_GROUP_SIZE elements.

ZeRO-1/2 (runtime/zero/stage_1_and_2.py): per param group one flat buffer in the model dtype padded to
a multiple of 2 x its group's size (real_dp_process_group: the dense group over every rank, an MoE group
over its expert data parallel group: _configure_moe_settings), an fp32 partition and AdamW's moments of
this rank's share, and one AdamW `step` per group. One IPG bucket for every group, filled in
gradient-ready order (stage 2, or stage 1 with overlap_comm) or by walking the groups in registration
order (stage 1 without overlap_comm: reduce_gradients); average_tensor all-reduces each bucket once per
process group in it (use_multi_rank_bucket_allreduce: its slices keyed by group), the dense slices over
dp, the experts' over edp. step(): the bf16 overflow check (uint8, over dp), one fp32 grad-norm
all-reduce per group over dp and one per MoE group over edp (_average_expert_grad_norms), one all_gather
of each group's updated partitions over its group (utils.all_gather_dp_groups: none for a group of one).

The gate's dispatch (moe/sharded_moe.py MOELayer.forward, drop_tokens=True): the dispatched [E, C, h]
tokens all-to-all'ed over ep and the experts' output back, forward and backward (_AllToAll): 4 calls per
MoE layer per micro-batch of E x C x h in the model dtype, C = max(ceil(S/E x capacity_factor x k),
min_capacity) (_capacity, top1gating / top2gating / topkgating) for S tokens of a micro-batch: fixed.

Resident extras: each MOELayer keeps its last l_aux (fp32) and exp_counts (int64 [E]).
Activation checkpointing (deepspeed.checkpointing.checkpoint around each layer): a checkpointed MoE
layer's recompute in backward dispatches and combines again (6 all-to-alls a layer and micro-batch) and
leaves its l_aux graph on the block (activations.recomputed_aux).
The peak within a step: peak.py's moments over the param groups (_peak_inputs), the MoE layers' saves
(activations.moe_saves); top-k above 2 has none (peak_modelled).
Not modelled (refused): ZeRO-3 (DeepSpeed refuses native MoE at stage 3), fp32, drop_tokens=false (the capacity
follows the router: an all-reduce of it per layer), shared experts (use_residual).
"""
from __future__ import annotations

import copy
import dataclasses
from functools import lru_cache

import numpy as np

from ledger.dtypes import FP32, INT64
from ledger.faithful.deepspeed import backward as deepspeed_backward
from ledger.faithful.deepspeed import peak as deepspeed_peak
from ledger.faithful.deepspeed.activations import Dispatch, modelled
from ledger.faithful.deepspeed.backward import Hooks, Piece
from ledger.faithful.deepspeed.common import DTYPES
from ledger.faithful.deepspeed import rules
from ledger.faithful.deepspeed.target import RULES, Rules, rules_of
from ledger.faithful.deepspeed.zero12 import allreduce_chunks
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict, numel
from ledger.placement import CommBuilder, Placement, RankState
from ledger.target import CPU_GLOO
from ledger.units import round_up
from ledger.optim import add_adamw

# moe/utils.py split_params_into_different_moe_groups_for_optimizer: max_group_size's default
MAX_GROUP_SIZE = 178_956_971


def check(model: ModelShape, lay: Layout, fw) -> None:
    def no(what: str) -> None:
        raise ConfigError(f"deepspeed: model.num_experts={model.num_experts}: {what}")

    if fw.zero_stage not in (1, 2):
        no(f"framework.zero_stage={fw.zero_stage}: DeepSpeed-MoE is modelled at ZeRO-1 and 2 (runtime/engine.py: "
           "\"Native DeepSpeed MoE is not supported with ZeRO Stage 3\")")
    if not fw.drop_tokens:
        no("framework.drop_tokens=false: the capacity then follows the router (an all-reduce of it per layer), "
           "not modelled")
    if model.moe_shared_expert_hidden:
        no("model.moe_shared_expert_hidden: DeepSpeed's residual MoE (use_residual) is not modelled")
    if lay.etp > 1:
        no(f"layout.etp={lay.etp}: expert tensor parallelism is not modelled")
    if model.bias or model.qkv_bias:
        no("model.bias / model.qkv_bias: the plain Llama's MoE is modelled without biases")
    if fw.precision != "bf16":  # the runs here are bf16; fp32 MoE is not confirmed by one
        no(f"framework.precision={fw.precision!r}: DeepSpeed-MoE is modelled in bf16")
    if not fw.contiguous_gradients:
        no("framework.contiguous_gradients=false (stage_1_and_2.py _configure_moe_settings asserts it at stage 2)")


# -- parameters ------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def groups(model: ModelShape, ep: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The param groups as ZeRO sees them, each ((name, numel), ...) in registration order: the dense
    group first, then the MoE group's chunks (split_params_into_different_moe_groups_for_optimizer)."""
    h = model.hidden
    dense = [("tok_embeddings.weight", model.vocab * h)]
    expert = []
    for i in range(model.layers):
        lp = model.layer_params(i)
        if not model.is_moe_layer(i):
            dense += [(n, numel(s)) for n, s in lp]
            continue
        # the block up to ffn_norm, then the gate (MoE registers gate before experts)
        dense += [(n, numel(s)) for n, s in lp if not n.split(".")[2].startswith("moe")]
        p = f"layers.{i}.feed_forward.deepspeed_moe"
        dense.append((f"{p}.gate.wg.weight", model.num_experts * h))
        for j in range(model.num_experts // ep):
            for w, n in _expert(model):
                expert.append((f"{p}.experts.deepspeed_experts.{j}.{w}.weight", n))
    dense += [(n, numel(s)) for n, s in model.norm_params("norm")]
    if not model.tied_embeddings:
        dense.append(("output.weight", model.vocab * h))
    out, cur, size = [tuple(dense)], [], 0
    for name, n in expert:  # greedy chunks of at most MAX_GROUP_SIZE elements
        if size + n <= MAX_GROUP_SIZE:
            cur.append((name, n))
            size += n
        else:
            out.append(tuple(cur))
            cur, size = [(name, n)], n
    if cur:
        out.append(tuple(cur))
    return tuple(out)


def _expert(model: ModelShape) -> list[tuple[str, int]]:
    """One expert FeedForward's weights in registration order (launchers/llama.py FeedForward)."""
    h, f = model.hidden, model.expert_ffn
    out = [("w1", f * h), ("w2", h * f)]
    return out + ([("w3", f * h)] if model.swiglu else [])


# the gradient-ready order of an expert (w2, then w3 and w1: launchers/llama.py FeedForward's backward)
# and of a block (ledger.faithful.deepspeed._BLOCK_BACKWARD), measured through the IPG buckets
_EXPERT_BACKWARD = ("w2", "w3", "w1")
_BLOCK_BACKWARD = ("ffn_norm", "attention.wo", "attention.wv", "attention.wk", "attention.wq", "attention_norm")


@lru_cache(maxsize=64)
def order(model: ModelShape, ep: int, registration: bool) -> tuple[tuple[int, int, int], ...]:
    """(group index, offset in the group's flat buffer, numel) of every parameter in the order the IPG
    buckets see them: registration (stage 1 without overlap_comm walks the groups one after another) or
    gradient-ready: the output, the final norm, each block last to first (an MoE block: its local
    experts last to first, each w2 w3 w1, then the gate, then the dense ones), the embedding last."""
    return tuple(where for _, where in named_order(model, ep, registration))


@lru_cache(maxsize=64)
def named_order(model: ModelShape, ep: int, registration: bool) -> tuple[tuple[str, tuple[int, int, int]], ...]:
    """order with each parameter's name."""
    gs = groups(model, ep)
    where = {}
    for g, params in enumerate(gs):
        off = 0
        for name, n in params:
            where[name] = (g, off, n)
            off += n
    if registration:
        return tuple((name, where[name]) for params in gs for name, _ in params)
    names = ([] if model.tied_embeddings else ["output.weight"]) + [n for n, _ in model.norm_params("norm")]
    for i in reversed(range(model.layers)):
        p = f"layers.{i}"
        if model.is_moe_layer(i):
            m = f"{p}.feed_forward.deepspeed_moe"
            names += [f"{m}.experts.deepspeed_experts.{j}.{w}.weight" for j in reversed(range(model.num_experts // ep))
                      for w in _EXPERT_BACKWARD if w != "w3" or model.swiglu]
            names.append(f"{m}.gate.wg.weight")
        else:
            names += [f"{p}.feed_forward.{w}.weight" for w in _EXPERT_BACKWARD if w != "w3" or model.swiglu]
        lp = [n for n, _ in model.layer_params(i)]
        names += [n for mod in _BLOCK_BACKWARD for n in lp if n.startswith(f"{p}.{mod}.")]
    names.append("tok_embeddings.weight")
    return tuple((n, where[n]) for n in names)


def flat(model: ModelShape, lay: Layout, g: int) -> int:
    """Group g's flat buffer: padded to 2 x its process group's size (stage_1_and_2.py
    flatten_dense_tensors_aligned, alignment = nccl_start_alignment_factor x its dp world)."""
    return round_up(sum(n for _, n in groups(model, lay.ep)[g]), 2 * _size(lay, g))


def _size(lay: Layout, g: int) -> int:
    """The process group a param group is partitioned over: every rank (dense), edp (MoE)."""
    return lay.dp if g == 0 else lay.edp


# -- one rank ----------------------------------------------------------------------------------------
def rank_states(model: ModelShape, lay: Layout, fw, target_rules: Rules = RULES[CPU_GLOO]):
    """rank -> its state: the states and collectives every rank's, the peak its partitions' (where its
    grads_in_partition is made, its size): one state per distinct (flush, epilogue), sharing the rest."""
    s = rank_state(model, lay, fw)
    if peak_modelled(model, fw) is not None:
        return lambda r: s
    by_flush: dict = {}
    by_rank: dict[int, RankState] = {}
    shared: list = []  # the layout's PeakInputs but the rank's flush, made on first use

    def state(r: int) -> RankState:  # on first use: a search that reads the resident state builds no peak input
        if r not in by_rank:
            if not shared:
                shared.append(_peak_inputs(model, lay, fw, s, target_rules))
            inputs, walk, parts = shared[0]
            flush = deepspeed_backward.piece_flush(walk, parts, _mine(lay, len(parts), r), inputs.bucket) if walk \
                else None
            if flush not in by_flush:
                st = by_flush[flush] = copy.copy(s) if by_flush else s
                st.peak = (lambda inputs=dataclasses.replace(inputs, flush=flush): deepspeed_peak.peak(inputs))
            by_rank[r] = by_flush[flush]
        return by_rank[r]
    return state


def rank_state(model: ModelShape, lay: Layout, fw) -> RankState:
    w = DTYPES[fw.precision]
    s = RankState()
    for g in range(len(groups(model, lay.ep))):
        f, what = flat(model, lay, g), "" if g == 0 else f"expert group {g}: "
        s.add("params_bytes", f"{what}{fw.precision} flat group (bit16_groups_flat)", w * f)
        part = f // _size(lay, g)
        s.add("optim_bytes", f"{what}fp32 partition (single_partition_of_fp32_groups)", FP32 * part)
        add_adamw(s, part, 1, what)  # one flat fp32 partition per group: one `step`
    s.add("other_bytes", "_global_grad_norm (fp32 scalar)", FP32)
    s.add("other_bytes", "MOELayer l_aux (fp32) + exp_counts (int64 [E])", _moe_other(model))
    s.comm_fn = lambda: list(_comm(model, lay, fw.zero_stage, rules.overlap_comm(fw), int(fw.reduce_bucket_size),
                                   fw.precision, float(fw.capacity_factor), int(fw.min_capacity),
                                   bool(fw.get("activation_checkpointing", False))))
    return s


def capacity(model: ModelShape, lay: Layout, capacity_factor: float, min_capacity: int) -> int:
    """moe/sharded_moe.py _capacity: ceil(S / E x capacity_factor x k) in float32 (a Python float times a
    float32 tensor), at least min_capacity; S the tokens of one micro-batch on a rank."""
    s = lay.micro_batch_size * model.seq_len
    c = int(np.ceil(np.float32(s / model.num_experts) * np.float32(capacity_factor * model.moe_router_topk)))
    return max(c, min_capacity)


@lru_cache(maxsize=256)
def _comm(model: ModelShape, lay: Layout, stage: int, overlap: bool, bucket: int, precision: str,
          capacity_factor: float, min_capacity: int, checkpointing: bool = False):
    w = DTYPES[precision]
    cb = CommBuilder()
    dims = ("dp", "edp")  # a dense group's process group, an MoE group's
    ngroups = len(groups(model, lay.ep))
    parts = [flat(model, lay, g) // _size(lay, g) for g in range(ngroups)]
    # IPG buckets: one all-reduce per process group a bucket holds (dense over dp, experts over edp)
    rounds = lay.num_microbatches if stage == 2 else 1
    what = "IPG bucket (average_tensor)"
    cur: dict[int, int] = {}  # process group (0 dense, 1 experts) -> elements in the open bucket
    filled = 0

    def flush():
        for pg, n in cur.items():
            cb.add(dims[pg], "all_reduce", w * n, lay.dp if pg == 0 else lay.edp, precision, count=rounds, what=what)
        cur.clear()

    for g, off, n in order(model, lay.ep, stage == 1 and not overlap):
        pg = min(g, 1)
        if filled + n > bucket and filled > 0:  # ledger.faithful.deepspeed._fill12's rule
            flush()
            filled = 0
        if n > bucket:  # extra-large: alone, its slices per partition of its own group
            for c in allreduce_chunks(n, off, parts[g], bucket):
                cb.add(dims[pg], "all_reduce", w * c, lay.dp if pg == 0 else lay.edp, precision, count=rounds,
                       what=what)
        else:
            cur[pg] = cur.get(pg, 0) + n
            filled += n
    flush()
    # step(): overflow check, the grad norms, the updated partitions
    if precision == "bf16":
        cb.add("dp", "all_reduce", 1, lay.dp, "uint8", what="overflow check")
    cb.add("dp", "all_reduce", FP32, lay.dp, "fp32", count=ngroups, what="grad norm (get_grad_norm_direct)")
    cb.add("edp", "all_reduce", FP32, lay.edp, "fp32", count=ngroups - 1, what="_average_expert_grad_norms")
    for g in range(ngroups):
        cb.add(dims[min(g, 1)], "all_gather", w * flat(model, lay, g), _size(lay, g), precision,
               what=f"updated {precision} partitions (all_gather_dp_groups)")
    # the gate's dispatch and combine, forward and backward; a checkpointed layer's recompute in backward
    # (deepspeed.checkpointing.checkpoint) runs its forward's two again
    c = capacity(model, lay, capacity_factor, min_capacity)
    calls = 6 if checkpointing else 4
    cb.add("ep", "all_to_all", w * model.num_experts * c * model.hidden, lay.ep, precision,
           count=calls * model.moe_layers() * lay.num_microbatches, what="MoE dispatch / combine (sharded_moe.py _AllToAll)")
    return tuple(cb.build())


# -- the peak within a step ------------------------------------------------------------------------------
# module-level tensors sharded_moe.py makes on the first forward and keeps: top1gating's Random Token
# Selection sampler (exp_selection_uniform_map: Uniform(tensor(0.), tensor(1.))), top2gating's second-expert
# sampling (gumbel_map: Gumbel(tensor(0.), tensor(1.)) and its transforms' tensors), fp32 scalars,
# measured (the probe's `unnamed` of a steady step)
SAMPLERS = {1: 2 * FP32, 2: 6 * FP32}


def peak_modelled(model: ModelShape, fw) -> str | None:
    """None where the peak is predicted; else why not (the prediction's note)."""
    if model.moe_router_topk not in SAMPLERS:
        return f"model.moe_router_topk={model.moe_router_topk}: topkgating's saves are not derived (top-1 and top-2 are)"
    if fw.zero_stage == 1 and rules.overlap_comm(fw):
        return None  # an estimate, said in the peak's `what` (peak.py)
    return modelled(model)


def _mine(lay: Layout, ngroups: int, rank: int) -> tuple[int, ...]:
    """The rank's partition in each param group: its DP rank in the dense group (pure DP: the rank),
    its rank in its expert data parallel group (ranks r % ep + j*ep: utils/groups.py) in the others."""
    return (rank,) + (rank // lay.ep,) * (ngroups - 1)


def _hooks(model: ModelShape, ep: int) -> Hooks:
    at = {name: i for i, (name, _) in enumerate(named_order(model, ep, False))}
    def first(j: int) -> int:  # a block's first gradient: its w2 (dense), its last local expert's w2 (MoE)
        if not model.is_moe_layer(j):
            return at[f"layers.{j}.feed_forward.w2.weight"]
        return at[f"layers.{j}.feed_forward.deepspeed_moe.experts.deepspeed_experts.{model.num_experts // ep - 1}.w2.weight"]

    return Hooks(at["norm.weight"], tuple(first(j) for j in range(model.layers)),
                 tuple(at[f"layers.{j}.ffn_norm.weight"] for j in range(model.layers)), len(at))


def _peak_inputs(model: ModelShape, lay: Layout, fw, s: RankState,
                 target_rules: Rules) -> tuple[deepspeed_peak.PeakInputs, tuple[Piece, ...] | None, tuple[int, ...]]:
    """(the layout's PeakInputs but a rank's flush, the pieces in the order the bucket reduces them (None:
    stage 1 with overlap_comm, an estimate), each group's partition elements): the dense ledger's
    moments (peak.py) over the param groups (the IPG bucket's gradients as pieces of their group's flat
    buffer), the MoE layers' saves (Dispatch). A rank's flush: backward.piece_flush over its partitions."""
    ngroups = len(groups(model, lay.ep))
    parts = tuple(flat(model, lay, g) // _size(lay, g) for g in range(ngroups))
    pgs = (0,) + (1,) * (ngroups - 1)
    bucket, stage = int(fw.reduce_bucket_size), fw.zero_stage
    grad_order = tuple(Piece(*where) for where in order(model, lay.ep, False))
    walk = hooks = None
    touched, epilogue = True, ()
    if not (stage == 1 and rules.overlap_comm(fw)):  # stage 1 with overlap_comm: an estimate (peak.py)
        walk = grad_order if stage == 2 else tuple(Piece(*where) for where in order(model, lay.ep, True))
        hooks = _hooks(model, lay.ep)
        touched = deepspeed_backward.piece_ipg_touched(walk, parts, pgs, bucket)
        if stage == 2:
            epilogue = deepspeed_backward.epilogue_copies(grad_order, parts, pgs, bucket, ("dp", "edp"))
    cf, mc = float(fw.capacity_factor), int(fw.min_capacity)
    return deepspeed_peak.PeakInputs(
        model, lay.micro_batch_size, lay.num_microbatches, stage, DTYPES[fw.precision],
        bool(fw.get("activation_checkpointing", False)),
        part=parts[0], params_resident=s.params_bytes, optim=s.optim_bytes, grads_resident=0, persist=0,
        n=sum(n for g in groups(model, lay.ep) for _, n in g), bucket=bucket, hooks=hooks,
        ipg_touched=touched, grads_hooked=deepspeed_backward.piece_hooked(grad_order, parts, pgs, bucket),
        rules=target_rules, dispatch=Dispatch(lay.ep, capacity(model, lay, cf, mc)), group_parts=parts,
        other_extra=_moe_other(model), samplers=SAMPLERS[model.moe_router_topk], epilogue=epilogue), walk, parts


def _moe_other(model: ModelShape) -> int:
    """What each MOELayer keeps after its forward: l_aux (fp32) and exp_counts (int64 [E])."""
    return model.moe_layers() * (FP32 + INT64 * model.num_experts)


def place(model: ModelShape, lay: Layout, fw, target: str | None = None) -> Placement:
    check(model, lay, fw)
    rules_ = rules_of(target)
    pl = Placement(framework="deepspeed", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                   world=lay.world, rank_state=rank_states(model, lay, fw, rules_), representatives=[0],
                   target=rules_.target)
    pl.notes.append(f"DeepSpeed 0.19.8 ZeRO-{fw.zero_stage}, {fw.precision}, torch AdamW; DeepSpeed-MoE ep={lay.ep} "
                    f"over {lay.dp} ranks (expert data parallel {lay.edp}): deepspeed_moe.py")
    why = peak_modelled(model, fw)
    if why is not None:
        pl.notes.append(f"DeepSpeed-MoE: the peak within a step is not modelled (no peak row): {why}")
    else:
        pl.notes.append(MOE_PEAK_NOTE)
    return pl


MOE_PEAK_NOTE = ("DeepSpeed-MoE peak: the dense ledger's moments (peak.py) over the param groups, the MoE layers' "
                 "saves from sharded_moe.py (the gate in fp32, the capacity-padded dispatch, each expert's "
                 "rows, the combine): the capacity fixes every size whatever the router decides. Not a "
                 "candidate: an MoE layer's own backward")
