"""Faithful torchtitan 0.3.0 ledger for its MoE model (model.num_experts > 0): torchtitan's qwen3 MoE
(models/qwen3: GQA with q/k norms, every layer MoE: models/common/moe.py MoE) under FSDP2 with expert
parallelism over dp_shard (tp = pp = cp = dp_replicate = 1), the partial_dtensor backend, driven through
its Trainer as the dense jobs are (launchers/titan.py). The dense ledger's rules (fsdp.py: FSDP2's
dim-0 padded shards; comm.py: the unit order of the all-gathers and reduce-scatters, the step's loss
and token all-reduces) hold for the dense part; what MoE changes is here. Paths under torchtitan/ unless said.

Meshes (distributed/parallel_dims.py build_mesh): the dense fsdp mesh is dp_shard; the sparse mesh
("pp", "dp_replicate", "efsdp", "ep") puts ep innermost (EP groups of ep consecutive ranks) and efsdp =
dp_shard / ep (the ranks holding the same experts).

Parameters per block: attention (wq wk wv, or one wqkv with framework.fuse_qkv, and wo), q_norm / k_norm [head_dim], attention_norm, ffn_norm,
the router's gate [E, D] (dense: FSDP over fsdp, Shard(0) rows padded as torch.chunk), and
GroupedExperts w1 / w3 [E, F, D], w2 [E, D, F]: Shard(0) over ep (E / ep local experts: Module.parallelize),
then FSDP over efsdp with Shard(0) (distributed/fsdp.py apply_fsdp_to_decoder's shard_placement_fn:
Shard(1) when efsdp x ep > E, refused here). Buffers: the rope cache (CosSinRoPE: [seq, 2 x head_dim]
fp32 per layer), expert_bias_E and tokens_per_expert_E (fp32 [E] per layer, moe.py).

Collectives, beside the dense ledger's: per block an FSDP param group per mesh (the per-param mesh
gives `_fsdp_param_groups`), so the experts' all-gathers (forward, and backward where blocks reshard)
and reduce-scatter run over efsdp; the token dispatcher (models/common/token_dispatcher.py
AllToAllTokenDispatcher) all-to-alls the tokens per expert (int64 [ep, E/ep], forward) and the tokens
and expert outputs over ep, forward and backward. What a rank sends is fixed on its own tokens' side
(T x k rows: the dispatch, the combine's backward) and follows the router on its experts' side (the
combine, the dispatch's backward): predicted balanced with the range [0, ep x T x min(k, E/ep)] rows
(Comm.buffer_range), exact over an EP group. distributed/utils.py _clip_grad_norm_with_ep: the
experts' stacked norms reduced once over their (efsdp, ep) mesh, the rest over fsdp.
components/optimizer/optimizer.py register_moe_load_balancing_hook: the [layers, E] fp32 token
counts all-reduced over the loss mesh before every optimizer step.
The peak within a step: moe_activations.py (a block's saves), moe_peak.py (EP's moments).
Not modelled: TP / PP / CP / HSDP with MoE, Shard(1) experts. Activation checkpointing: full's recompute runs
the all-to-alls again (here); SelectiveAC keeps their outputs (no more collectives); the kept outputs and the
recompute's moments: moe_activations.py, moe_peak.py and peak.py.
"""
from __future__ import annotations

from math import prod

from ledger.dtypes import BF16, FP32 as F32
from ledger.faithful.titan.comm import fsdp_gathers, lm_head_regathers
from ledger.faithful.titan import moe_peak
from ledger.faithful.titan import peak as titan_peak
from ledger.faithful.titan.fsdp import as_built, block_params, chunk_rows, rows_of, sharded, unit_params
from ledger.faithful.titan.target import rules_of
from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict
from ledger.target import CPU_GLOO
from ledger.placement import Comm, CommBuilder, Placement, RankState
from ledger.optim import MOMENT_BYTES, MOMENTS, STEP, STEP_BYTES


def check(model: ModelShape, lay: Layout, fw) -> None:
    efsdp = lay.dp_shard // lay.ep
    if efsdp * lay.ep > model.num_experts:
        raise ConfigError(f"titan: dp_shard={lay.dp_shard} > num_experts={model.num_experts}: FSDP then shards the "
                          "experts on dim 1 (distributed/fsdp.py), not modelled")
    for field, want in (("dtype", "float32"), ("mixed_precision_param", "bfloat16"),
                        ("mixed_precision_reduce", "float32"), ("spmd_backend", "partial_dtensor")):
        if getattr(fw, field) != want:
            raise ConfigError(f"titan: model.num_experts={model.num_experts}: framework.{field}={getattr(fw, field)!r}: "
                              f"the faithful MoE ledger models {want!r}")
    if model.seq_len % 8:
        raise ConfigError(f"titan: seq_len={model.seq_len} must be divisible by ChunkedLossWrapper.num_chunks=8")


def rank_state(model: ModelShape, lay: Layout, k: int, e: int, comm_fn, comm_first) -> RankState:
    """Shard rank k on the fsdp mesh, e on efsdp."""
    ds, ep, L = lay.dp_shard, lay.ep, model.layers
    efsdp = ds // ep
    dense, expert = block_params(model)
    top = [(model.vocab, model.hidden), (model.hidden,), (model.vocab, model.hidden)]  # tok_embeddings, norm, lm_head
    padded = held = 0
    for shape, times in [(s, L) for s in dense] + [(s, 1) for s in top]:
        rest = prod(shape[1:])
        padded += times * chunk_rows(shape[0], ds) * rest
        held += times * rows_of(shape[0], ds, k) * rest
    e_padded = e_held = 0
    for shape in expert:  # [E/ep, ...] local to the EP rank, then dim 0 over efsdp
        local, rest = shape[0] // ep, prod(shape[1:])
        e_padded += L * chunk_rows(local, efsdp) * rest
        e_held += L * rows_of(local, efsdp, e) * rest
    n_params = 3 + L * (len(dense) + len(expert))
    s = RankState(comm_fn=comm_fn, comm_first=comm_first)
    s.add("params_bytes", "fp32 shards (dim-0 padded)", padded * F32)
    s.add("params_bytes", "expert fp32 shards (ep, then efsdp dim-0 padded)", e_padded * F32)
    s.add("grads_bytes", "fp32 grad shards (dim-0 padded)", padded * F32)
    s.add("grads_bytes", "expert fp32 grad shards", e_padded * F32)
    s.add("optim_bytes", MOMENTS, MOMENT_BYTES * held)
    s.add("optim_bytes", "expert " + MOMENTS, MOMENT_BYTES * e_held)
    s.add("optim_bytes", STEP, STEP_BYTES * n_params)
    s.add("other_bytes", "rope cache buffers (CosSinRoPE)", L * model.seq_len * 2 * model.head_dim * F32)
    s.add("other_bytes", "expert_bias_E + tokens_per_expert_E", L * 2 * model.num_experts * F32)
    return s


def _full(shapes, ds: int, times: int = 1) -> int:
    """Elements of the padded full tensors FSDP all-gathers / reduce-scatters for these params."""
    return times * sum(chunk_rows(s[0], ds) * ds * prod(s[1:]) for s in shapes)


def expert_dims(lay: Layout) -> tuple[str, str]:
    """The labels of the ep and efsdp groups' collectives: a mesh dim spanning the world is the default
    process group (torch device_mesh.py _init_one_process_group), the dense fsdp dim's too, so EP over
    every rank is recorded under the grid's "dp" (launchers/titan.py expert_group_labels)."""
    return ("dp" if lay.ep == lay.world else "ep"), "edp"


def _comm(model: ModelShape, lay: Layout, fw, steady: bool) -> list[Comm]:
    ds, ep, L = lay.dp_shard, lay.ep, model.layers
    efsdp = ds // ep
    ep_dim, edp_dim = expert_dims(lay)
    dense, expert = block_params(model)
    layer = _full(dense, ds)
    x_layer = _full([(s[0] // ep, *s[1:]) for s in expert], efsdp)
    if ep == 1:
        # no expert parallelism: distributed/fsdp.py gives the experts no mesh of their own; they are
        # the block's params like the rest (one FSDP group over fsdp)
        layer, x_layer = layer + x_layer, 0
    emb = _full([(model.vocab, model.hidden)], ds)
    norm, lm = _full([(model.hidden,)], ds), _full([(model.vocab, model.hidden)], ds)
    head = norm + lm
    reshard = fw.reshard_after_forward in ("default", "always")
    acc = CommBuilder()
    # comm.step_comm's FSDP order, the block's dense group over fsdp
    acc.add_several("dp", "all_gather", "bf16", ds, fsdp_gathers(emb, layer, head, L, fw, steady))
    acc.add_several("dp", "reduce_scatter", "fp32", ds,
                    ((lm * F32, 1, "lm_head grad (last chunk)"), (norm * F32, 1, "norm grad"),
                     (layer * F32, L, "layer grads"), (emb * F32, 1, "tok_embeddings grad")))
    # the block's expert group over efsdp (its own FSDP param group)
    if x_layer:
        acc.add_several(edp_dim, "all_gather", "bf16", efsdp, ((x_layer * BF16, L, "experts unshard", True),
                                                              (x_layer * BF16, L * reshard, "experts unshard", False)))
        acc.add(edp_dim, "reduce_scatter", x_layer * F32, efsdp, "fp32", L, "expert grads")
    # grad clipping with EP (distributed/utils.py _clip_grad_norm_with_ep): the stacked per-param norms
    # of each kind reduced once, the dense ones over fsdp, the experts' over their whole (efsdp, ep)
    # mesh: the same ranks (dp_shard), the default group here (measured: one call each)
    n_dense, n_expert = 3 + L * len(dense), L * len(expert)
    if ep == 1:  # clip_grad_norm_ without EP: every param's norm stacked, one reduce
        acc.add("dp", "all_reduce", (n_dense + n_expert) * F32, ds, "fp32", 1, "grad-norm (stacked per-param norms)")
    else:
        acc.add("dp", "all_reduce", n_dense * F32, ds, "fp32", 1, "grad-norm (non-EP params)")
        acc.add("dp", "all_reduce", n_expert * F32, ds, "fp32", 1, "grad-norm (EP params, over efsdp x ep)")
    # trainer.py: valid tokens, ntokens_seen (int64), loss sum and max (fp32) on the batch / loss mesh
    acc.add("dp", "all_reduce", 8, ds, "int64", 2, "valid tokens, ntokens_seen")
    acc.add("dp", "all_reduce", 4, ds, "fp32", 2, "loss sum, loss max")
    # the load-balancing hook: [moe layers, E] fp32 token counts over the loss mesh
    acc.add("dp", "all_reduce", L * model.num_experts * F32, ds, "fp32", 1,
            "tokens per expert (register_moe_load_balancing_hook)")
    # the token dispatcher, every MoE layer's forward and backward; with full activation checkpointing
    # (distributed/activation_checkpoint.py FullAC: checkpoint_wrapper, early_stop False) each block's
    # recompute runs its forward's all-to-alls again (measured: 3 more a layer at ep2); SelectiveAC's save
    # list has all_to_all_single: none again (measured)
    T, k, E, h = lay.micro_batch_size * model.seq_len, model.moe_router_topk, model.num_experts, model.hidden
    full = fw.activation_checkpoint == "full"
    acc.add(ep_dim, "all_to_all", E * 8, ep, "int64", L * (1 + full), "tokens per expert (token_dispatcher.py)")
    acc.add_token_all_to_all(ep_dim, "bf16", ep, "tokens / expert outputs (token_dispatcher.py AllToAllTokenDispatcher)",
                             T * k, ep * T * min(k, E // ep), h * BF16, (2 + full) * L)
    return acc.build()


def _dense_peak(model: ModelShape, lay: Layout, fw, st: RankState, rules):
    """Without expert parallelism the experts are a block's params like the rest (one FSDP group over
    fsdp): the dense model's moments (peak.py) over the qwen3 block's saves (moe_activations.py)."""
    def peak():
        emb, block, head = unit_params(model, 1)
        resident = st.params_bytes + st.grads_bytes + st.optim_bytes + st.other_bytes
        return titan_peak.peak(model, lay, fw, sharded(model, 1, lay.dp_shard), resident,
                               *[sum([prod(p.shape) for p in u]) for u in (block, emb, head)], rules=rules,
                               first=titan_peak.FirstStep(st.optim_bytes, st.grads_bytes))
    return peak


def place(model: ModelShape, lay: Layout, fw, target: str | None = None) -> Placement:
    check(model, lay, fw)
    model = as_built(model, fw)
    ds, ep = lay.dp_shard, lay.ep
    memo: dict[bool, list] = {}

    def comm(steady: bool):
        if steady not in memo:
            memo[steady] = _comm(model, lay, fw, steady)
        return memo[steady]

    first = (lambda: comm(False)) if ds > 1 and lm_head_regathers(fw, True) != lm_head_regathers(fw, False) \
        else None
    grid: Grid = lay.grid
    cache: dict[tuple[int, int], RankState] = {}

    rules = rules_of(target)

    def state(r: int) -> RankState:
        k = grid.coords(r)["dp"]
        key = (k, k // ep)  # the fsdp shard rank, the efsdp one (ep innermost on the sparse mesh)
        if key not in cache:
            st = cache[key] = rank_state(model, lay, *key, lambda: comm(True), first)
            st.peak = _dense_peak(model, lay, fw, st, rules) if ep == 1 else \
                (lambda st=st: moe_peak.ep_peak(model, lay, fw, st, rules))
        return cache[key]

    pl = Placement(framework="titan", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                   world=lay.world, rank_state=state, representatives=[0])
    pl.notes.append(f"titan MoE (moe.py): torchtitan's qwen3 MoE, ep={ep} over dp_shard={ds} (efsdp {ds // ep}); "
                    "the all-to-all bytes on the experts' side follow the router: predicted balanced, bounded by "
                    "buffer_range, exact over an EP group")
    pl.notes.append("titan MoE peak: the qwen3 block's saves (moe_activations.py) in the dense moments"
                    + (" (ep 1: the experts are the blocks' params)" if ep == 1 else
                       ", with EP's own (moe_peak.py: grads set to None each step, two FSDP groups a block, the "
                       "combine's backward); the rows this rank's experts compute follow the router: predicted "
                       "balanced, bounded from the fewest to the most (Peak.bound); measured on the CPU exact at "
                       "the rows the run routed but for 288 B of the step's setup tensors (s = 512)"))
    pl.notes.extend(titan_peak.notes(lay, fw, rules))
    pl.target = target or CPU_GLOO
    return pl
