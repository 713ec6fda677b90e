"""Pipeline parallelism in torchtitan 0.3.0 (distributed/pipeline_parallel.py pipeline_llm, torch 2.13
torch/distributed/pipelining): its stages, their placement and their collectives.

What the ledger models: torchtitan's default schedule 1F1B (one stage per rank, vp=1) over FSDP on
dp_shard (layout.validate refuses tp, cp, dp_replicate and reshard_after_forward="always" with PP).
The rank's local batch (global_batch_size / dp) is split into num_microbatches pipeline
micro-batches of micro_batch_size (parallelism.pipeline_parallel_microbatch_size). Each stage holds the
modules pipeline_parallel.py gives it (pp_stages); its collectives are the schedule's P2P per
micro-batch, FSDP once per step (the last stage's [norm, lm_head] per micro-batch), the grad-norm over
pp, and in step 0 the schedule's vote and metadata inference (_pp_comm). Its peak is pp_peak.py's.
"""
from __future__ import annotations

from functools import lru_cache
from math import prod

from ledger.dtypes import BF16, FP32 as F32
from ledger.faithful.titan.comm import mesh_labels
from ledger.faithful.titan.fsdp import Sharded, sharded_part, unit_params
from ledger.faithful.titan.peak import notes as peak_notes
from ledger.faithful.titan.pp_peak import pp_peak
from ledger.faithful.titan.ranks import build_state, placement, state_parts
from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape
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


def _pp_meta_bytes(mbs: int, seq: int, hidden: int) -> tuple[int, int]:
    """Bytes of the pickled metadata a stage sends in the first step (pipelining/stage.py
    _send_meta -> dist.send_object_list, pickled by distributed_c10d._object_to_tensor):
    _StageForwardMeta of the stage output and _StageBackwardMeta of the input grad, both one
    [mbs, seq, hidden] bf16 tensor. Pickled from torch's own classes (imported only here, on the
    first read of a first-step list, cached)."""
    return _pp_meta_bytes_cached(mbs, seq, hidden)


@lru_cache(maxsize=64)
def _pp_meta_bytes_cached(mbs: int, seq: int, hidden: int) -> tuple[int, int]:
    import torch

    fwd, bwd = stage_metas((mbs, seq, hidden), torch.bfloat16)
    return pickled_bytes(fwd), pickled_bytes(bwd)


def stage_metas(shape: tuple, dtype) -> tuple:
    """The metadata a stage sends its neighbours in step 0 (pipelining/stage.py _send_meta):
    _StageForwardMeta of its output (one tensor of `shape` and `dtype`, its grad required) to the next
    stage, _StageBackwardMeta of its input's grad to the previous one."""
    import torch
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas

    out = torch.empty(*shape, dtype=dtype, device="meta", requires_grad=True)
    grad = torch.empty(*shape, dtype=dtype, device="meta")
    return (_StageForwardMeta(forward_metas=extract_tensor_metas((out,))),
            _StageBackwardMeta(backward_metas=extract_tensor_metas((grad,))))


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
    """states.place with pp > 1: each rank's state is its stage's modules' FSDP shards (_pp_parts), its
    collectives its stage's (_pp_comm), its peak pp_peak's (rules: the target's, target.py; None: cpu-gloo)."""
    if fw.reshard_after_forward == "always" or lay.tp > 1 or lay.cp > 1 or lay.dp_replicate > 1 or lay.vp > 1:
        raise ConfigError(f"titan: pp={lay.pp} is modelled with 1F1B over FSDP (dp_shard) only, "
                          "reshard_after_forward default/never (see ledger.layout.validate)")
    grid: Grid = lay.grid
    ds, P = lay.dp_shard, lay.pp
    stages = pp_stages(model.layers, P)
    views = lay.num_microbatches >= 2
    memo: dict = {}

    def comm_of(s: int, first: bool):
        if (s, first) not in memo:
            memo[s, first] = _pp_comm(model, lay, _stage_sharded(model, ds, P, s), stages[s], s, first, grid)
        return memo[s, first]

    def state(s: int, k: int) -> RankState:
        st = build_state(_pp_parts(model, ds, P, s, k, views), lambda: comm_of(s, False), lambda: comm_of(s, True))
        st.stage = s
        kept = st.params_bytes + st.optim_bytes + st.other_bytes
        grads = st.grads_bytes

        def peak():  # pp_peak.py
            emb, block, head = [sum([prod(p.shape) for p in u]) for u in unit_params(model, 1)]
            return pp_peak(model, lay, stages[s], s, _stage_sharded(model, ds, P, s), kept, grads,
                           emb, block, head, getattr(fw, "activation_checkpoint", "none"),
                           **({"rules": rules} if rules is not None else {}), optim=st.optim_bytes)

        st.peak = peak
        return st

    pl = placement(model, lay, grid, lambda s: _stage_sharded(model, ds, P, s), _heaviest_stage(model, ds, P, views),
                   state)
    pl.notes.extend(peak_notes(lay, fw))
    return pl


def _stage_sharded(model: ModelShape, ds: int, P: int, s: int) -> Sharded:
    """Sharded of stage s's modules (sharded_part of its kind: cached, once per kind)."""
    kinds, _, kind_of = _stage_kinds(model.layers, P)
    return sharded_part(model, 1, ds, *kinds[kind_of[s]])


def _pp_parts(model: ModelShape, ds: int, P: int, s: int, k: int, views_norm_rs: bool) -> list[tuple[str, str, int]]:
    """state_parts of stage s's shard rank k; views_norm_rs: num_microbatches >= 2."""
    stage = pp_stages(model.layers, P)[s]
    sh = _stage_sharded(model, ds, P, s)
    out = state_parts(model, sh, k, ds, layers=stage[2])
    if stage[3] and views_norm_rs:
        # trainer.py zero_grad(set_to_none=True) (disable_cuda_graphs, which PP needs): the
        # step's first reduce-scatter of a param makes its .grad a view of that output
        # (_fsdp_collectives.py foreach_reduce, storage_offset into the flat output), later
        # ones accumulate. The norm's first is micro-batch 1's [norm, lm_head] reduce-scatter
        # (_pp_comm), so its grad keeps that whole output alive: lm_head's padded shard twice
        out.append(("grads_bytes", "norm grad views micro-batch 1's [norm, lm_head] reduce-scatter output",
                    sh.lm_full // ds * F32))
    return out


@lru_cache(maxsize=256)
def _heaviest_stage(model: ModelShape, ds: int, P: int, views_norm_rs: bool) -> int:
    """The first stage of the most-loaded kind, summed from its shard rank 0's parts (max: the first
    stage on ties). Cached: the layouts of one (dp_shard, pp) share it, whatever their micro-batches."""
    load = {s: sum([b for _, _, b in _pp_parts(model, ds, P, s, 0, views_norm_rs)])
            for s in _stage_kinds(model.layers, P)[1]}
    return max(load, key=load.get)


def _pp_comm(model: ModelShape, lay: Layout, sh: Sharded, stage: tuple[bool, int, int, bool], s: int,
             first: bool, grid: Grid | None = None) -> list[Comm]:
    """One optimizer step of pipeline stage s under 1F1B (torch pipelining/schedules.py
    Schedule1F1B, stage.py), FSDP over dp_shard; first: step 0 (the schedule's one-time set-up)."""
    has_emb, _, L, has_head = stage
    ds, P, n = lay.dp_shard, lay.pp, lay.num_microbatches
    fsdp = mesh_labels(grid or lay.grid)[0]
    emb, layer, head = sh.emb_full, sh.layer_full, sh.norm_full + sh.lm_full
    acc = CommBuilder()
    # fsdp.py get_fsdp_reshard_after_forward_policy: with PP "default" (and "never") is False for
    # tok_embeddings and the blocks; [norm, lm_head] gets reshard_after_forward == "always" = False.
    # stage.py backward_maybe_with_nosync sets reshard_after_backward(False) and
    # requires_gradient_sync(False) on every micro-batch's backward; perform_reduce_grad (after the
    # last one) runs post_backward on every group: one reduce-scatter per unit, reshard. So each
    # unit gathers once per step, in its first forward. (full numel, calls, what)
    gathers = [(emb, has_emb, "forward unshard (once per step)"), (layer, L, "forward unshard (once per step)")]
    scatters = [(layer, L, "layer grads (perform_reduce_grad)"),
                (emb, has_emb, "tok_embeddings grad (perform_reduce_grad)")]
    if has_head:
        # the last stage runs F0 B0 F1 B1 ...; components/loss.py ChunkedLossWrapper (the stage's
        # loss_fn) leaves [norm, lm_head] with reshard_after_forward(True) and reshards it after
        # its chunks: F0's norm gathers it; every micro-batch's loss unshards it again (wrapper)
        # and its backward through the norm gathers it once more (left unsharded for the next
        # forward by reshard_after_backward(False))
        gathers += [(head, 1, "[norm, lm_head]: F0 norm forward"),
                    (head, n, "[norm, lm_head]: ChunkedLossWrapper unshard, per micro-batch"),
                    (head, n, "[norm, lm_head]: norm backward, per micro-batch")]
        # the wrapper's last chunk syncs lm_head (set_requires_gradient_sync(True, recurse=False)):
        # micro-batch 0 reduces lm_head's grad alone, later ones lm_head + the norm grad the previous
        # backward accumulated; perform_reduce_grad reduces the last norm grad
        scatters += [(sh.lm_full, 1, "lm_head grad (micro-batch 0, last chunk)"),
                     (head, n - 1, "lm_head + accumulated norm grad (later micro-batches, last chunk)"),
                     (sh.norm_full, 1, "norm grad (perform_reduce_grad)")]
    # P2P (stage.py get_fwd_send_ops / get_bwd_send_ops, dist.isend/irecv on the pp group): one
    # activation forward and one grad backward per micro-batch, each a [mbs, seq, hidden] bf16 tensor
    act = lay.micro_batch_size * model.seq_len * model.hidden * BF16
    after, before = s < P - 1, s > 0  # a next stage, a previous one
    acc.add_p2p("pp", act, act, "bf16", "activation send / grad recv, per micro-batch", n * after)
    acc.add_p2p("pp", act, act, "bf16", "activation recv / grad send, per micro-batch", n * before)
    if first:
        # schedules.py _initialize_pp_stages, step 0 only: _warmup_p2p's vote (stage.py
        # _warmup_forward_vote / _warmup_backward_result: one int32 forward, one back, per neighbour)
        acc.add_p2p("pp", 4, 4, "int32", "P2P warm-up vote", after + before)
        # ... metadata inference: _StageForwardMeta sent forward, _StageBackwardMeta back
        # (send_object_list: an int64 size, then the pickle as uint8)
        fwd, bwd = _pp_meta_bytes(lay.micro_batch_size, model.seq_len, model.hidden)
        acc.add_p2p("pp", 8, 8, "int64", "metadata sizes", after + before)
        acc.add_p2p("pp", fwd, bwd, "uint8", "forward / backward metadata", after)
        acc.add_p2p("pp", bwd, fwd, "uint8", "forward / backward metadata", before)
        # the inference runs the stage forward on real tensors: every unit gathers (then
        # _post_metadata_inference_cleanup reshards); the last stage's backward inference calls the
        # loss (the wrapper: lm_head's grad reduced at its last chunk, the group resharded) and
        # autograd.grad through the norm (gathers [norm, lm_head] again)
        gathers += [(emb, has_emb, "metadata inference forward"), (layer, L, "metadata inference forward")]
        if has_head:
            gathers += [(head, 1, "metadata inference forward"), (head, 1, "metadata inference: norm backward")]
            scatters.append((sh.lm_full, 1, "metadata inference: ChunkedLossWrapper lm_head grad"))
    acc.add_several(fsdp, "all_gather", "bf16", ds, [(f * BF16, c, w) for f, c, w in gathers])
    acc.add_several(fsdp, "reduce_scatter", "fp32", ds, [(f * F32, c, w) for f, c, w in scatters])
    # distributed/utils.py clip_grad_norm_: the stage's stacked per-param norms over fsdp, then the
    # total norm (** norm_type) all-reduced over pp
    acc.add(fsdp, "all_reduce", sh.n_params * F32, ds, "fp32", 1, "grad-norm (stacked per-param norms)")
    acc.add("pp", "all_reduce", F32, P, "fp32", 1, "grad-norm total over pp")
    # trainer.py train_step: valid tokens on the batch mesh, loss sum / max and ntokens_seen on
    # the loss mesh (both dp_shard here; pp is in neither)
    acc.add(fsdp, "all_reduce", 8, ds, "int64", 2, "valid tokens, ntokens_seen")
    acc.add(fsdp, "all_reduce", 4, ds, "fp32", 2, "loss sum, loss max")
    return acc.build()
