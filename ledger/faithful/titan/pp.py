"""Pipeline parallelism in torchtitan 0.3.0 (distributed/pipeline_parallel.py pipeline_llm, torch 2.13
torch/distributed/pipelining): its stages, their placement and their collectives.

What the ledger models: framework.pipeline_parallel_schedule's stages a rank (schedules.py: 1F1B and GPipe
one, Interleaved1F1B and LoopedBFS layout.vp of them, InterleavedZeroBubble 2 to 3, ZBVZeroBubble and DualPipeV
two in a V) over FSDP on dp_shard x cp, with HSDP, TP (with and without SP) and CP (the split backward's schedules
without CP: rules.py); reshard_after_forward default / never. The rank's local batch (global_batch_size / dp) is
split into num_microbatches pipeline micro-batches of micro_batch_size
(parallelism.pipeline_parallel_microbatch_size). Each stage holds the modules pipeline_parallel.py gives
it (pp_stages over pp * vp stages); a rank's state is its stages' (_pp_parts), its collectives each
stage's (_stage_comm: P2P per micro-batch with the stages on other ranks, FSDP once per step and the last
stage's [norm, lm_head] per micro-batch, TP and CP per micro-batch, step 0's vote and metadata inference)
and the step's grad-norm and loss all-reduces once (_pp_comm). Its peak is pp_peak.py's with one stage a rank
(1F1B, GPipe) and pp_looped.py's with several (the walk over the rank's actions, the split backward's I and W
among them); pp_peak_unmodelled and looped_unmodelled name what they do not derive.
"""
from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import NamedTuple

from ledger.dtypes import BF16, FP32 as F32
from ledger.faithful.titan.comm import recomputed, mesh_labels
from ledger.faithful.titan.dtensor import INPUT, PARAM, layer_backward_moves
from ledger.faithful.titan.fsdp import (Sharded, chunk_rows, fuses_qkv, rows_of, sharded_part, unit_params,
                                        vocab_split_note)
from ledger.faithful.titan.peak import LOSS_CHUNKS, PP_MASKS, notes as peak_notes, pp_batch_lines
from ledger.faithful.titan.pp_looped import looped_peak, looped_unmodelled
from ledger.faithful.titan.pp_peak import pp_peak, pp_peak_unmodelled
from ledger.faithful.titan.target import RULES
from ledger.faithful.titan.ranks import build_state, placement, state_parts
from ledger.faithful.titan.schedules import (block_param_groups, final_norm_gets_grad, local_stages,
                                             losses_after_a_backward, schedule_of, split_backwards, unshards)
from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape
from ledger.target import CPU_GLOO
from ledger.placement import Comm, CommBuilder, Placement, RankState


@lru_cache(maxsize=256)
def pp_stages(layers: int, pp: int, input_weight: int = 1, output_weight: int = 1
              ) -> tuple[tuple[bool, int, int, bool], ...]:
    """pipeline_parallel.py _generate_llm_fqn_per_model_part(pp, layers, 1, 1) (the default
    pipeline_parallel_first/last_stage_less_layers = 1): per stage (has tok_embeddings, first
    layer, number of layers, has [norm, lm_head]). The same ValueErrors, as ConfigErrors."""
    eff = layers + input_weight + output_weight
    if pp > eff:
        raise ConfigError(f"titan: pp={pp}: more stages than effective layers {eff} (layers + 2; "
                          "pipeline_parallel.py _generate_llm_fqn_per_model_part)")
    per, extra = divmod(eff, pp)
    if per == 0 or input_weight > per or output_weight > per:
        raise ConfigError(f"titan: pp={pp}: layers={layers} give {per} effective layers per stage; "
                          "tok_embeddings and [norm, lm_head] count as one each and need at least one per stage")
    out, cur = [], 0
    for i in range(pp):
        n = per + (i < extra)
        if i == 0:
            n -= input_weight
        elif i == pp - 1:
            n -= output_weight
        n = max(0, min(n, layers - cur))
        out.append((i == 0, cur, n, i == pp - 1))
        cur += n
    return tuple(out)


class Boundary(NamedTuple):
    """The tensor a stage sends its neighbour per micro-batch (p2p_shape: the rank's [mbs, S, hidden]
    bf16 slice of the residual stream) and, with TP, the DTensor it is a local shard of: its global
    shape on the 1-D tp mesh and whether sequence parallelism shards it (Shard(1))."""
    shape: tuple[int, int, int]
    tp: int = 1
    sp: bool = False

    @property
    def global_shape(self) -> tuple[int, int, int]:
        mbs, S, h = self.shape
        return mbs, S * (self.tp if self.sp else 1), h


def boundary(model: ModelShape, lay: Layout) -> Boundary:
    """The layout's Boundary (model: its seq_len and hidden are read, a ModelShape or the job's config)."""
    return Boundary(p2p_shape(model, lay), lay.tp, bool(lay.sequence_parallel) and lay.tp > 1)


def _pp_meta_bytes(b: Boundary) -> tuple[int, int]:
    """Bytes of the pickled metadata a stage sends in the first step (pipelining/stage.py
    _send_meta -> dist.send_object_list, pickled by distributed_c10d._object_to_tensor):
    _StageForwardMeta of the stage output and _StageBackwardMeta of the input grad (stage_metas).
    Pickled from torch's own classes (imported only here, on the first read of a first-step list,
    cached)."""
    return _pp_meta_bytes_cached(b)


@lru_cache(maxsize=64)
def _pp_meta_bytes_cached(b: Boundary) -> tuple[int, int]:
    import torch

    fwd, bwd = stage_metas(b, torch.bfloat16)
    return pickled_bytes(fwd), pickled_bytes(bwd)


def stage_metas(b: Boundary, dtype) -> tuple:
    """The metadata a stage sends its neighbours in step 0 (pipelining/stage.py _send_meta):
    _StageForwardMeta of its output (grad required) to the next stage, _StageBackwardMeta of its
    input's grad to the previous one, each one tensor of the boundary's local shape and `dtype`. With TP
    both are DTensors on the tp mesh (pipelining/_utils.py _DTensorMeta: local and global shape,
    placements, the mesh's names and layout; tp is the innermost mesh dim, stride 1): the output
    Replicate (the rowwise outputs' all-reduce) and its grad Partial (the residual grad stays Partial
    down to tok_embeddings: dtensor.py), both Shard(1) with sequence parallelism."""
    import torch
    from torch.distributed.pipelining._utils import (_StageBackwardMeta, _StageForwardMeta, _DTensorMeta,
                                                     extract_tensor_metas)

    if b.tp == 1:
        out = torch.empty(*b.shape, dtype=dtype, device="meta", requires_grad=True)
        grad = torch.empty(*b.shape, dtype=dtype, device="meta")
        return (_StageForwardMeta(forward_metas=extract_tensor_metas((out,))),
                _StageBackwardMeta(backward_metas=extract_tensor_metas((grad,))))
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.tensor import Partial, Replicate, Shard

    def meta(placement, requires_grad: bool):
        return _DTensorMeta(shape=torch.Size(b.shape), stride=_contiguous(b.shape), dtype=dtype,
                            requires_grad=requires_grad, global_shape=torch.Size(b.global_shape),
                            global_stride=_contiguous(b.global_shape), placements=(placement,),
                            mesh_dim_names=("tp",), mesh_layout=_MeshLayout.from_sizes_strides((b.tp,), (1,)))
    fwd, bwd = (Shard(1), Shard(1)) if b.sp else (Replicate(), Partial())
    return _StageForwardMeta(forward_metas=(meta(fwd, True),)), _StageBackwardMeta(backward_metas=(meta(bwd, False),))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def pickled_bytes(obj) -> int:
    """Bytes send_object_list sends of an object (distributed_c10d._object_to_tensor's pickle)."""
    import io

    from torch.distributed import distributed_c10d as c10d

    f = io.BytesIO()
    c10d._pickler(f).dump(obj)
    return len(f.getvalue())


@lru_cache(maxsize=256)
def _stage_kinds(layers: int, pp: int) -> tuple[tuple[tuple[bool, int, bool], ...], tuple[int, ...], tuple[int, ...]]:
    """pp_stages' stages by the modules they hold, (has tok_embeddings, layers, has [norm,
    lm_head]): stages of one kind (most middle stages) hold the same bytes. The kinds in stage
    order, the first stage of each (it stands for them), each stage's kind (an index)."""
    index: dict = {}
    firsts = []
    kind_of = []
    for s, (e, _, n, h) in enumerate(pp_stages(layers, pp)):
        if (e, n, h) not in index:
            index[e, n, h] = len(firsts)
            firsts.append(s)
        kind_of.append(index[e, n, h])
    return tuple(index), tuple(firsts), tuple(kind_of)


def place_pp(model: ModelShape, lay: Layout, fw, rules=None) -> Placement:
    """states.place with pp > 1: each rank's state is its stages' modules' FSDP shards (_pp_parts; the
    schedule's stages a rank: schedules.local_stages), its collectives theirs (_pp_comm), its peak pp_peak's
    (rules: the target's, target.py; None: cpu-gloo). A vocab tp does not divide gives each TP rank its own
    rows of tok_embeddings and lm_head (states.py _place_uneven_vocab): a placement per TP rank, each rank
    asking its own."""
    if fw.reshard_after_forward == "always":
        raise ConfigError(f"titan: pp={lay.pp} is modelled with reshard_after_forward default/never "
                          "(see ledger.layout.validate)")
    if lay.tp == 1 or model.vocab % lay.tp == 0:
        return _place_pp_tp_rank(model, lay, fw, rules, 0)
    pls = [_place_pp_tp_rank(model, lay, fw, rules, t) for t in range(lay.tp)]
    states = [p.rank_state for p in pls]
    grid = lay.grid
    pls[0].rank_state = lambda r: states[grid.coords(r)["tp"]](r)
    pls[0].notes.append(vocab_split_note(model.vocab, lay.tp))
    return pls[0]


class _Uneven(NamedTuple):
    """The dim-0 lengths a rank's stages split unevenly over the shard group (placement's keys)."""
    uneven: tuple


def _place_pp_tp_rank(model: ModelShape, lay: Layout, fw, rules, t: int) -> Placement:
    """place_pp for the ranks of TP rank t. A PP rank r holds the stages local_stages(r) of S = pp * vp."""
    grid: Grid = lay.grid
    ds, S = lay.dp_shard * lay.cp, lay.pp * lay.vp  # FSDP shards over "fsdp" = dp_shard x cp (states.py)
    sched = schedule_of(fw)
    stages = pp_stages(model.layers, S)
    locals_of = [local_stages(r, lay.pp, lay.vp, sched) for r in range(lay.pp)]
    # the norm's grad: none under the zero-bubble schedules (schedules.final_norm_gets_grad); else it views a
    # [norm, lm_head] reduce-scatter output where a loss follows a backward (_pp_parts)
    norm_grad = final_norm_gets_grad(sched)
    views = norm_grad and losses_after_a_backward(sched, lay.pp, lay.vp, lay.num_microbatches) >= 1
    cpu_mesh = True if rules is None else rules.cpu_mesh
    # pp_peak derives 1F1B's and GPipe's one stage a rank over FSDP2 (HSDP too: its replicas' all-reduce runs in
    # place on the reduce-scatter output, which with PP's set_to_none grads is the new grad itself; measured at
    # pp2·rep2 and pp2·dp2·rep2, tests/test_titan.py and docs/ledger-titan.md), with CP and TP
    # (pp_peak_unmodelled names what it does not derive)
    # (several stages a rank: the looped schedules' walk, pp_looped.py, over the same per-stage byte counts)
    unmodelled = (looped_unmodelled(sched, getattr(fw, "activation_checkpoint", "none")) if lay.vp > 1
                  else None) or \
        pp_peak_unmodelled(lay, sched)
    peak_modelled = unmodelled is None
    memo: dict = {}

    def comm_of(r: int, first: bool):
        if (r, first) not in memo:
            memo[r, first] = _pp_comm(model, lay, fw, [(s, stages[s], _stage_sharded(model, lay.tp, ds, S, s, t))
                                                        for s in locals_of[r]], first, grid, cpu_mesh)
        return memo[r, first]

    def state(r: int, k: int) -> RankState:
        parts = [p for s in locals_of[r] for p in _pp_parts(model, lay.tp, ds, S, s, k, views, t, norm_grad)]
        st = build_state(parts, lambda: comm_of(r, False), lambda: comm_of(r, True))
        st.stage = r
        kept = st.params_bytes + st.optim_bytes + st.other_bytes
        grads = st.grads_bytes

        def peak():  # pp_peak.py, pp_looped.py
            emb, block, head = [sum([prod(p.shape) for p in u]) for u in unit_params(model, lay.tp, t)]
            ac = getattr(fw, "activation_checkpoint", "none")
            if lay.vp > 1:
                local = [(s, stages[s], _stage_sharded(model, lay.tp, ds, S, s, t)) for s in locals_of[r]]
                pk = looped_peak(model, lay, r, local, kept, grads, emb, block, head, ac,
                                 rules if rules is not None else RULES[CPU_GLOO], st.optim_bytes, sched)
            else:
                pk = pp_peak(model, lay, stages[r], r, _stage_sharded(model, lay.tp, ds, S, r, t), kept, grads,
                             emb, block, head, ac, **({"rules": rules} if rules is not None else {}),
                             optim=st.optim_bytes, sched=sched)
            # the step's batch and masks, live at every moment of the rank's step (peak.pp_batch_lines)
            mine = [stages[s] for s in locals_of[r]]
            return _with_batch(pk, pp_batch_lines(model, lay, any(g[0] for g in mine), any(g[3] for g in mine),
                                                  rules is None or rules.loader_on_device))

        # where pp_peak_unmodelled names a reason it is not modelled
        st.peak = peak if peak_modelled else None
        return st

    def uneven_of(r: int):
        if lay.vp == 1:
            return _stage_sharded(model, lay.tp, ds, S, r, t)
        return _Uneven(tuple(sorted({u for s in locals_of[r] for u in _stage_sharded(model, lay.tp, ds, S, s, t).uneven})))

    heaviest = _heaviest_stage(model, lay.tp, ds, S, views, t, norm_grad) if lay.vp == 1 else \
        _heaviest_rank(model, lay.tp, ds, lay.pp, lay.vp, sched, views, t, norm_grad)
    pl = placement(model, lay, grid, uneven_of, heaviest, state)
    if peak_modelled:
        pl.notes.extend(peak_notes(lay, fw))
    else:
        pl.notes.append(f"titan PP ({sched}, {lay.vp} stage{'s' * (lay.vp > 1)} a rank) with tp={lay.tp} cp={lay.cp} "
                        f"dp_replicate={lay.dp_replicate}: states and collectives predicted; the peak within a step "
                        f"is not modelled ({unmodelled}): no peak row")
    return pl


def _with_batch(pk, lines: dict[str, int]):
    """The peak (and its first step's) with the step's batch lines (peak.pp_batch_lines), live at every moment of
    the step but its optimizer step, where the masks are gone (Peak.plus)."""
    out = pk.plus(lines)
    if pk.first is not None:
        out.first = pk.first.plus(lines if pk.first.phase != "optimizer" else
                                  {k: v for k, v in lines.items() if k != PP_MASKS})
    return out


def _stage_sharded(model: ModelShape, tp: int, ds: int, P: int, s: int, t: int = 0) -> Sharded:
    """Sharded of stage s's modules on TP rank t (sharded_part of its kind: cached, once per kind)."""
    kinds, _, kind_of = _stage_kinds(model.layers, P)
    return sharded_part(model, tp, ds, *kinds[kind_of[s]], t)


def _pp_parts(model: ModelShape, tp: int, ds: int, P: int, s: int, k: int, views_norm_rs: bool, t: int = 0,
              norm_grad: bool = True) -> list[tuple[str, str, int]]:
    """state_parts of stage s's shard rank k on TP rank t; views_norm_rs: a loss of the last stage follows one
    of its backwards (schedules.losses_after_a_backward); norm_grad: the final norm weight gets a gradient
    (schedules.final_norm_gets_grad; without one it has no grad shard and no AdamW state)."""
    stage = pp_stages(model.layers, P)[s]
    sh = _stage_sharded(model, tp, ds, P, s, t)
    h = model.hidden
    gradless = (chunk_rows(h, ds), rows_of(h, ds, k), 1) if stage[3] and not norm_grad else None
    out = state_parts(model, sh, k, ds, layers=stage[2], gradless=gradless)
    if stage[3] and views_norm_rs:
        # trainer.py zero_grad(set_to_none=True) (disable_cuda_graphs, which PP needs): the
        # step's first reduce-scatter of a param makes its .grad a view of that output
        # (_fsdp_collectives.py foreach_reduce, storage_offset into the flat output), later
        # ones accumulate. The norm's first is micro-batch 1's [norm, lm_head] reduce-scatter
        # (_stage_comm), so its grad keeps that whole output alive: lm_head's padded shard twice
        out.append(("grads_bytes", "norm grad views micro-batch 1's [norm, lm_head] reduce-scatter output",
                    sh.lm_full // ds * F32))
    return out


@lru_cache(maxsize=256)
def _heaviest_rank(model: ModelShape, tp: int, ds: int, pp: int, vp: int, sched: str, views_norm_rs: bool,
                   t: int = 0, norm_grad: bool = True) -> int:
    """The first PP rank whose stages (local_stages) load its shard rank 0 the most."""
    S = pp * vp
    load = [sum([b for s in local_stages(r, pp, vp, sched)
                 for _, _, b in _pp_parts(model, tp, ds, S, s, 0, views_norm_rs, t, norm_grad)])
            for r in range(pp)]
    return load.index(max(load))


@lru_cache(maxsize=256)
def _heaviest_stage(model: ModelShape, tp: int, ds: int, P: int, views_norm_rs: bool, t: int = 0,
                    norm_grad: bool = True) -> int:
    """The first stage of the most-loaded kind, summed from its shard rank 0's parts (max: the first
    stage on ties). Cached: the layouts of one (tp, shard degree, pp) share it, whatever their micro-batches."""
    load = {s: sum([b for _, _, b in _pp_parts(model, tp, ds, P, s, 0, views_norm_rs, t, norm_grad)])
            for s in _stage_kinds(model.layers, P)[1]}
    return max(load, key=load.get)


def _pp_comm(model: ModelShape, lay: Layout, fw, local: list[tuple[int, tuple[bool, int, int, bool], Sharded]],
             first: bool, grid: Grid | None = None, cpu_mesh: bool = True) -> list[Comm]:
    """One optimizer step of a PP rank holding the stages `local` ((index, pp_stages entry, Sharded) each):
    each stage's own collectives (_stage_comm), then the step's grad-norm and loss all-reduces once over
    them all (distributed/utils.py clip_grad_norm_ takes every model part's params; trainer.py train_step);
    first: step 0 (the schedule's one-time set-up)."""
    ds, P, rep = lay.dp_shard * lay.cp, lay.pp, lay.dp_replicate
    fsdp, batch_dim, loss_dim = mesh_labels(grid or lay.grid)
    acc = CommBuilder()
    mine = {s for s, _, _ in local}
    for s, stage, sh in local:
        _stage_comm(acc, model, lay, fw, sh, stage, s, first, fsdp, cpu_mesh, mine)
    # the params with a gradient (the zero-bubble schedules' last stage: not the final norm weight,
    # schedules.final_norm_gets_grad)
    gradless_norm = not final_norm_gets_grad(schedule_of(fw))
    n_params = sum([sh.n_params - (stage[3] and gradless_norm) for _, stage, sh in local])
    # distributed/utils.py clip_grad_norm_: the rank's stacked per-param norms over fsdp (and tp, where
    # DTensor shards them: comm.py), then the total norm (** norm_type) all-reduced over pp
    acc.add(fsdp, "all_reduce", n_params * F32, ds, "fp32", 1, "grad-norm (stacked per-param norms)")
    acc.add("tp", "all_reduce", n_params * F32, lay.tp, "fp32", 1, "grad-norm (stacked per-param norms)")
    acc.add("pp", "all_reduce", F32, P, "fp32", 1, "grad-norm total over pp")
    # trainer.py train_step: valid tokens on the batch mesh (dp_replicate x dp_shard), loss sum / max
    # and ntokens_seen on the loss mesh (batch x cp); pp is in neither (comm.py step_comm)
    bsize = lay.dp_shard * rep
    acc.add(batch_dim, "all_reduce", 8, bsize, "int64", 1, "valid tokens")
    acc.add(loss_dim, "all_reduce", 8, bsize * lay.cp, "int64", 1, "ntokens_seen")
    acc.add(loss_dim, "all_reduce", 4, bsize * lay.cp, "fp32", 2, "loss sum, loss max")
    return acc.build()


def _stage_comm(acc: CommBuilder, model: ModelShape, lay: Layout, fw, sh: Sharded, stage: tuple[bool, int, int, bool],
                s: int, first: bool, fsdp: str, cpu_mesh: bool, mine: set[int]) -> None:
    """Pipeline stage s's collectives in one step (torch pipelining/schedules.py, stage.py): FSDP over
    dp_shard x cp (HSDP's all-reduces over dp_replicate), P2P with the neighbour stages another rank holds
    (mine: this rank's stages; the runtime schedules pass an output to a stage on the same rank without
    P2P), TP and CP per micro-batch (_pp_tp_comm, _pp_cp_comm). The same under every schedule the ledger
    accepts: a runtime schedule's UNSHARD of a stage gathers each unit as the single-stage schedules' first
    forward does, once per step up to schedules.MAX_ACTIVE_STAGES stages a rank and as often as torch's
    lowering unshards the stage beyond (schedules.unshards, measured at pp2 with four stages a rank), its
    REDUCE_GRAD is perform_reduce_grad."""
    has_emb, _, L, has_head = stage
    ds, S, n, rep = lay.dp_shard * lay.cp, lay.pp * lay.vp, lay.num_microbatches, lay.dp_replicate
    emb, layer, head = sh.emb_full, sh.layer_full, sh.norm_full + sh.lm_full
    # fsdp.py get_fsdp_reshard_after_forward_policy: with PP "default" (and "never") is False for
    # tok_embeddings and the blocks; [norm, lm_head] gets reshard_after_forward == "always" = False.
    # stage.py backward_maybe_with_nosync sets reshard_after_backward(False) and
    # requires_gradient_sync(False) on every micro-batch's backward; perform_reduce_grad (after the
    # last one) runs post_backward on every group: one reduce-scatter per unit, reshard. So each
    # unit gathers once per step, in its first forward. (full numel, calls, what)
    # a runtime schedule with more than MAX_ACTIVE_STAGES stages a rank reshards some mid-step and gathers them
    # again (schedules.unshards)
    u = unshards(schedule_of(fw), lay.pp, lay.vp, n, s)
    # (each call's pass where one: a runtime's mid-step UNSHARDs come before forwards and backwards alike)
    gathers = [(emb, has_emb * u, "forward unshard (once per step)" if u == 1 else f"UNSHARD ({u} per step)",
                True if u == 1 else None),
               (layer, L * u, "forward unshard (once per step)" if u == 1 else f"UNSHARD ({u} per step)",
                True if u == 1 else None)]
    scatters = [(layer, L, "layer grads (perform_reduce_grad)"),
                (emb, has_emb, "tok_embeddings grad (perform_reduce_grad)")]
    if has_head:
        # the last stage runs F0 B0 F1 B1 ...; components/loss.py ChunkedLossWrapper (the stage's
        # loss_fn) leaves [norm, lm_head] with reshard_after_forward(True) and reshards it after
        # its chunks: F0's norm gathers it; every micro-batch's loss unshards it again (wrapper)
        # and its backward through the norm gathers it once more (left unsharded for the next
        # forward by reshard_after_backward(False))
        gathers += [(head, u, "[norm, lm_head]: F0 norm forward" if u == 1 else f"[norm, lm_head]: UNSHARD ({u} per step)",
                     True if u == 1 else None),
                    (head, n, "[norm, lm_head]: ChunkedLossWrapper unshard, per micro-batch", True),
                    (head, n, "[norm, lm_head]: norm backward, per micro-batch", False)]
        # the wrapper's last chunk syncs lm_head (set_requires_gradient_sync(True, recurse=False)): a loss
        # before any of the stage's backwards reduces lm_head's grad alone (1F1B: micro-batch 0's), a later
        # one lm_head + the norm grad the backwards before it accumulated (schedules.losses_after_a_backward);
        # perform_reduce_grad reduces the last norm grad
        # (the zero-bubble schedules: the norm never has a gradient, schedules.final_norm_gets_grad)
        if final_norm_gets_grad(schedule_of(fw)):
            k = losses_after_a_backward(schedule_of(fw), lay.pp, lay.vp, n)
            scatters += [(sh.lm_full, n - k, "lm_head grad (a loss before any backward, last chunk)"),
                         (head, k, "lm_head + accumulated norm grad (a loss after a backward, last chunk)"),
                         (sh.norm_full, 1, "norm grad (perform_reduce_grad)")]
        else:
            scatters.append((sh.lm_full, n, "lm_head grad (last chunk; no norm grad under a zero-bubble schedule)"))
    # P2P (stage.py get_fwd_send_ops / get_bwd_send_ops, dist.isend/irecv on the pp group): one
    # activation forward and one grad backward per micro-batch, each the rank's [mbs, S, hidden] bf16
    # slice of the residual stream (p2p_shape)
    act = prod(p2p_shape(model, lay)) * BF16
    after, before = s < S - 1 and s + 1 not in mine, s > 0 and s - 1 not in mine  # a next / previous stage elsewhere
    acc.add_p2p("pp", act, act, "bf16", "activation send / grad recv, per micro-batch", n * after)
    acc.add_p2p("pp", act, act, "bf16", "activation recv / grad send, per micro-batch", n * before)
    if first:
        # schedules.py _initialize_pp_stages, step 0 only: _warmup_p2p's vote (stage.py
        # _warmup_forward_vote / _warmup_backward_result: one int32 forward, one back, per neighbour)
        acc.add_p2p("pp", 4, 4, "int32", "P2P warm-up vote", after + before)
        # ... metadata inference: _StageForwardMeta sent forward, _StageBackwardMeta back
        # (send_object_list: an int64 size, then the pickle as uint8)
        fwd, bwd = _pp_meta_bytes(boundary(model, lay))
        acc.add_p2p("pp", 8, 8, "int64", "metadata sizes", after + before)
        acc.add_p2p("pp", fwd, bwd, "uint8", "forward / backward metadata", after)
        acc.add_p2p("pp", bwd, fwd, "uint8", "forward / backward metadata", before)
        # the inference runs the stage forward on real tensors: every unit gathers (then
        # _post_metadata_inference_cleanup reshards); the last stage's backward inference calls the
        # loss (the wrapper: lm_head's grad reduced at its last chunk, the group resharded) and
        # autograd.grad through the norm (gathers [norm, lm_head] again)
        gathers += [(emb, has_emb, "metadata inference forward", True), (layer, L, "metadata inference forward", True)]
        if has_head:
            gathers += [(head, 1, "metadata inference forward", True),
                        (head, 1, "metadata inference: norm backward", False)]
            scatters.append((sh.lm_full, 1, "metadata inference: ChunkedLossWrapper lm_head grad"))
    acc.add_several(fsdp, "all_gather", "bf16", ds, [(f * BF16, c, w, fwd) for f, c, w, fwd in gathers])
    acc.add_several(fsdp, "reduce_scatter", "fp32", ds, [(f * F32, c, w) for f, c, w in scatters])
    if rep > 1:  # HSDP: each reduced shard all-reduced over dp_replicate (_fsdp_collectives.py foreach_reduce)
        acc.add_several("dp_replicate", "all_reduce", "fp32", rep,
                        [(f * F32 // ds, c, f"HSDP {w}") for f, c, w in scatters])
    if lay.tp > 1:
        _pp_tp_comm(acc, model, lay, fw, sh, stage, s, first, cpu_mesh)
    if lay.cp > 1:
        _pp_cp_comm(acc, model, lay, fw, stage, first)


def p2p_shape(model: ModelShape, lay: Layout) -> tuple[int, int, int]:
    """The [mbs, S, hidden] tensor a stage sends its neighbour per micro-batch: the residual stream as
    the rank holds it, S = seq / cp (CP shards the sequence) and / tp with sequence parallelism."""
    S = model.seq_len // lay.cp // (lay.tp if lay.sequence_parallel else 1)
    return lay.micro_batch_size, S, model.hidden


def _pp_tp_comm(acc: CommBuilder, model: ModelShape, lay: Layout, fw, sh: Sharded, stage: tuple[bool, int, int, bool],
                s: int, first: bool, cpu_mesh: bool) -> None:
    """A stage's TP collectives (comm.py _tp_comm's, per micro-batch and for the stage's own modules),
    with what PP's no-sync backward changes: FSDP's post-backward redistributions of the TP grads
    (norm weights Partial -> Replicate, dtensor.py's PARAM moves) run once per step, in perform_reduce_grad,
    on the fp32 accumulated grads (_fsdp_param.py keeps the unsharded grad in reduce_dtype under no-sync);
    the last stage's [norm, lm_head] group also posts its backward at each later micro-batch's last loss
    chunk (the accumulated norm grad: _pp_comm). Step 0's metadata inference runs the stage's forward
    once more and, on the last stage, autograd.grad of the stage input (INPUT moves alone)."""
    has_emb, _, L, has_head = stage
    tp, n, h = lay.tp, lay.num_microbatches, model.hidden
    T = lay.micro_batch_size * model.seq_len // lay.cp  # the rank's tokens: CP splits the sequence
    act = T * h * BF16
    forwards = n + first  # the micro-batches' forwards, and step 0's metadata inference
    inference_bwd = _infers_backward(stage, first)
    # a checkpointed block recomputes its forward in every backward through it, the inference's too: once a graph
    # task (torch/utils/checkpoint.py: a recompute per graph task id, the whole forward, torchtitan's early_stop=False),
    # so a split backward's W once more per param group of the block (stage_backward_weight: one autograd.grad a group,
    # schedules.block_param_groups), beside its I's
    sched = schedule_of(fw)
    w_recomputes = split_backwards(sched, lay.pp, lay.vp, n, s) * block_param_groups(fuses_qkv(fw))
    recomputes = (n + inference_bwd + w_recomputes) * (getattr(fw, "activation_checkpoint", "none") != "none")
    if lay.sequence_parallel:
        # SP (comm.py): forward Partial -> Shard(1) at the embedding and rowwise outputs (reduce-scatter),
        # Shard(1) -> Replicate at the attention / ffn inputs and the root norm's output (all-gather);
        # backward the reverse of each. Both backward kinds run on the input grad's path
        rs_fwd, ag_fwd = 2 * L + has_emb, 2 * L + has_head
        acc.add_several("tp", "reduce_scatter", "bf16", tp,
                        ((act, forwards * rs_fwd, "SP: embedding + rowwise outputs Partial -> Shard(1)"),
                         (act, (n + inference_bwd) * ag_fwd, "SP backward: Partial grads of the gathered inputs"),
                         (act, recomputes * 2 * L * recomputed(fw, "reduce_scatter"), "SP: rowwise outputs, recompute")))
        acc.add_several("tp", "all_gather", "bf16", tp,
                        ((act, forwards * ag_fwd, "SP: attention/ffn inputs + root norm output Shard(1) -> Replicate"),
                         (act, n * rs_fwd + inference_bwd * 2 * L, "SP backward: grads of the Partial -> Shard(1) outputs"),
                         (act, recomputes * 2 * L * recomputed(fw, "all_gather"), "SP: attention/ffn inputs, recompute")))
    else:
        # the rowwise outputs' and the embedding's all-reduces; the residual grad stays Partial across
        # the stages (each TP rank sends its partial sum on) down to tok_embeddings' output
        acc.add_several("tp", "all_reduce", "bf16", tp,
                        ((act, forwards * (2 * L + has_emb), "embedding + rowwise outputs"),
                         (act, n * has_emb, "residual-stream grad at tok_embeddings"),
                         (act, recomputes * 2 * L * recomputed(fw, "all_reduce"), "rowwise outputs, recompute")))
    # norm weight grads, Partial on tp: FSDP's post-backward all-reduces each, in fp32 (above)
    acc.add("tp", "all_reduce", h * F32, tp, "fp32", 2 * L, "norm weight grads (perform_reduce_grad)")
    k = losses_after_a_backward(sched, lay.pp, lay.vp, n) if has_head else 0
    # (perform_reduce_grad's only where the norm has a grad: none under the zero-bubble schedules,
    # schedules.final_norm_gets_grad)
    acc.add("tp", "all_reduce", h * F32, tp, "fp32", (k + final_norm_gets_grad(sched)) * has_head,
            "final norm weight grad (last chunk / perform_reduce_grad)")
    if has_head:  # components/loss.py loss-parallel cross-entropy: 3 all-reduces per chunk (comm.py)
        acc.add("tp", "all_reduce", T // LOSS_CHUNKS * F32, tp, "fp32", 3 * LOSS_CHUNKS * forwards, "loss-parallel CE")
    moves = layer_backward_moves(model, T, tp, bool(lay.sequence_parallel), cpu_mesh)[0]
    for kind, full, role in moves:
        if role == PARAM:
            acc.add("tp", kind, full * F32, tp, "fp32", L, "DTensor weight grad to its param's placement (perform_reduce_grad)")
        else:
            acc.add("tp", kind, full * BF16, tp, "bf16", L * (n + (inference_bwd and role == INPUT)),
                    "DTensor mm backward redistribution")


def _pp_cp_comm(acc: CommBuilder, model: ModelShape, lay: Layout, fw, stage: tuple[bool, int, int, bool],
                first: bool) -> None:
    """A stage's CP K/V all-gathers (comm.py step_comm's) per micro-batch forward (and step 0's metadata
    inference), their grads' reduce-scatters per backward (and the last stage's input-grad inference), a
    checkpointed block's recompute gathering again."""
    L, n = stage[2], lay.num_microbatches
    kv = lay.micro_batch_size * model.seq_len * model.kv_heads // lay.tp * model.head_dim * BF16
    backwards = n + _infers_backward(stage, first)
    acc.add("cp", "all_gather", kv, lay.cp, "bf16", 2 * L * (n + first), "CP K/V all-gather")
    acc.add("cp", "reduce_scatter", kv, lay.cp, "bf16", 2 * L * backwards, "CP K/V grads")
    acc.add("cp", "all_gather", kv, lay.cp, "bf16", 2 * L * backwards * recomputed(fw, "all_gather"),
            "CP K/V all-gather, recompute")


def _infers_backward(stage: tuple[bool, int, int, bool], first: bool) -> bool:
    """Whether the stage runs a backward in step 0's metadata inference (pipelining/stage.py
    _backward_metadata_inference: autograd.grad of its inputs, the last stage's from its loss, the others'
    from ones of their output's metadata); the first stage's input, token ids, has no grad."""
    return first and not stage[0]
