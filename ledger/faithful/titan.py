"""Faithful torchtitan 0.3.0 ledger (torch 2.13 FSDP2, partial_dtensor backend), per rank per step.

Every rule names the source it follows. Shapes are the ModelShape's, built as launchers/titan.py
builds them (llama3 layers, untied lm_head, separate wq/wk/wv, rope cache sized to seq_len).
"""
from __future__ import annotations

from dataclasses import dataclass

from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict, numel
from ledger.placement import CommBuilder, Placement, RankState

F32, BF16 = 4, 2


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]  # the TP-local shape FSDP shards (dim 0)


def _tp_local(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """TP placement of models/common/decoder_sharding.py: colwise (wq wk wv w1 w3), the
    vocab-sharded tok_embeddings and lm_head are Shard(0); rowwise (wo w2) Shard(1); norms replicate."""
    leaf = name.rsplit(".", 2)[-2]
    if tp == 1 or len(shape) == 1:
        return shape
    if leaf in ("wo", "w2"):
        return (shape[0], shape[1] // tp)
    return (shape[0] // tp, *shape[1:])


def units(model: ModelShape, tp: int) -> list[tuple[str, list[Param]]]:
    """FSDP units of distributed/fsdp.py apply_fsdp_to_decoder (untied): tok_embeddings, one per
    TransformerBlock, [norm, lm_head] together; the root fully_shard(model) is left with none."""
    def ps(items):
        return [Param(n, _tp_local(n, s, tp)) for n, s in items]

    out = [("tok_embeddings", ps([("tok_embeddings.weight", (model.vocab, model.hidden))]))]
    for i in range(model.layers):
        out.append((f"layers.{i}", ps(model.layer_params(i))))
    out.append(("norm+lm_head", ps([("norm.weight", (model.hidden,)), ("lm_head.weight", (model.vocab, model.hidden))])))
    return out


def _rest(p: Param) -> int:
    return numel(p.shape[1:])


def _chunk_rows(p: Param, ds: int) -> int:
    """Rows of FSDP2's padded dim-0 shard (_fsdp_param.py _init_sharded_param: torch.chunk size)."""
    return -(-p.shape[0] // ds)


def _rows(p: Param, ds: int, k: int) -> int:
    """Rows shard rank k really holds (_chunk_with_empty: the last chunks may be short or empty)."""
    c = _chunk_rows(p, ds)
    return max(0, min(p.shape[0] - k * c, c))


def _padded_full(p: Param, ds: int) -> int:
    return _chunk_rows(p, ds) * ds * _rest(p)


def check(model: ModelShape, lay: Layout) -> None:
    for ok, msg in ((model.norm == "rmsnorm", f"titan: model.norm={model.norm!r}: torchtitan llama3 uses rmsnorm"),
                    (model.swiglu, "titan: model.swiglu=false: torchtitan llama3 feed-forward is SwiGLU"),
                    (not model.bias, "titan: model.bias=true: torchtitan llama3 linears have no bias"),
                    (not model.tied_embeddings, "titan: tied_embeddings=true is not modelled (separate FSDP grouping)"),
                    (not lay.sequence_parallel, "titan: sequence_parallel=true is not modelled yet"),
                    (model.seq_len % 8 == 0, f"titan: seq_len={model.seq_len} must be divisible by "
                                             "ChunkedLossWrapper.num_chunks=8")):
        if not ok:
            raise ConfigError(msg)


def place(model: ModelShape, lay: Layout, fw) -> Placement:
    check(model, lay)
    for field, want in (("dtype", "float32"), ("mixed_precision_param", "bfloat16"),
                        ("mixed_precision_reduce", "float32"), ("spmd_backend", "partial_dtensor")):
        if getattr(fw, field) != want:
            raise ConfigError(f"titan: framework.{field}={getattr(fw, field)!r}: the faithful ledger models {want!r}")
    grid: Grid = lay.grid
    cache: dict = {}

    ds = lay.dp_shard
    # ranks differ only by the rows their dim-0 shards hold, and only params whose dim 0 does not
    # split evenly give different ranks different rows: they alone key the shared states
    uneven = [p for _, u in units(model, lay.tp) for p in u if p.shape[0] % ds]
    by_k: dict[int, RankState] = {}

    def rank_state(r: int) -> RankState:
        k = grid.coords(r)["dp"]
        if k not in by_k:
            key = tuple(_rows(p, ds, k) for p in uneven)
            if key not in cache:
                cache[key] = _state(model, lay, fw, k)
            by_k[k] = cache[key]
        return by_k[k]

    pl = Placement(framework="titan", mode="faithful", model=model_dict(model), layout=lay.to_dict(),
                   world=lay.world, rank_state=rank_state,
                   # a state depends on the shard rank alone: one rank per shard rank covers them all
                   representatives=[grid.rank({"dp": k}) for k in range(ds)])
    if lay.tp > 1:
        T = lay.micro_batch_size * model.seq_len
        pl.notes.append("titan tp: mm-backward strategies are priced with DTensor's cost model for one device "
                        "per host (cpu); on cuda with tp <= GPUs per host its intra-host numbers apply and a "
                        "choice may differ (DEVICES_PER_HOST)")
        for gap in _layer_backward_comm(model, T, lay.tp)[1]:
            pl.notes.append(f"titan tp: {gap}; collectives past that point are not predicted")
    return pl


def _state(model: ModelShape, lay: Layout, fw, k: int) -> RankState:
    ds, tp = lay.dp_shard, lay.tp
    s = RankState()
    us = units(model, tp)
    params = [p for _, u in us for p in u]
    for p in params:
        # _fsdp_param.py: the sharded param is a view of a padded (ceil(d0/ds) rows) fp32 storage
        s.add("params_bytes", "fp32 shards (dim-0 padded)", _chunk_rows(p, ds) * _rest(p) * F32)
        # _fsdp_collectives.py foreach_reduce: .grad views the padded reduce-scatter output; trainer
        # zero_grad(set_to_none=False) keeps those step-0 buffers and accumulates into them
        s.add("grads_bytes", "fp32 grad shards (dim-0 padded)", _chunk_rows(p, ds) * _rest(p) * F32)
        # torch.optim.AdamW: exp_avg / exp_avg_sq like the unpadded local shard, 4-byte fp32 step
        s.add("optim_bytes", "adam exp_avg+exp_avg_sq", 2 * _rows(p, ds, k) * _rest(p) * F32)
        s.add("optim_bytes", "adam step", F32)
    # models/common/rope.py: every attention keeps a complex64 rope cache (seq_len x head_dim/2)
    s.add("other_bytes", "rope cache buffers", model.layers * model.seq_len * (model.head_dim // 2) * 8)
    s.comm = _comm(model, lay, fw, us, steady=True)
    first = _comm(model, lay, fw, us, steady=False)
    if [c.to_dict() for c in first] != [c.to_dict() for c in s.comm]:
        s.comm_first = first
    return s


def _comm(model: ModelShape, lay: Layout, fw, us, steady: bool):
    cb = CommBuilder()
    ds, rep, tp = lay.dp_shard, lay.dp_replicate, lay.tp
    by = dict(us)
    emb, head = by["tok_embeddings"], by["norm+lm_head"]
    layers = [u for n, u in us if n.startswith("layers.")]
    norm_p, lm_p = head

    def ag(unit, what):  # _fsdp_collectives.py foreach_all_gather: one bf16 buffer per unit
        cb.add("dp", "all_gather", sum(_padded_full(p, ds) for p in unit) * BF16, ds, "bf16", what=what)

    def rs(unit, what):  # foreach_reduce: one fp32 reduce-scatter per call, + HSDP all-reduce
        full = sum(_padded_full(p, ds) for p in unit) * F32
        cb.add("dp", "reduce_scatter", full, ds, "fp32", what=what)
        cb.add("dp_replicate", "all_reduce", full // ds, rep, "fp32", what=f"HSDP {what}")

    # distributed/fsdp.py get_fsdp_reshard_after_forward_policy: "default" (no PP) = True
    reshard = fw.reshard_after_forward in ("default", "always")
    # forward: every unit gathers once
    ag(emb, "forward unshard")
    for u in layers:
        ag(u, "forward unshard")
    ag(head, "forward unshard (norm)")
    # components/loss.py ChunkedLossWrapper: lm_head.unshard() before the chunks; after step 0 the
    # group reshards after forward (the wrapper leaves set_reshard_after_forward(True) behind), and
    # "always" reshards from the start, so the unshard gathers again
    if steady or fw.reshard_after_forward == "always":
        ag(head, "ChunkedLossWrapper lm_head.unshard")
    # ... and ends with lm_head.reshard(): the norm's backward gathers the group again
    ag(head, "backward unshard (norm)")
    if reshard:
        for u in layers:
            ag(u, "backward unshard")
        ag(emb, "backward unshard")
    # reduce-scatters: lm_head at the last chunk (gradient sync off before), norm after its backward
    rs([lm_p], "lm_head grad (last chunk)")
    rs([norm_p], "norm grad")
    for u in layers:
        rs(u, "layer grads")
    rs(emb, "tok_embeddings grad")

    n_params = sum(len(u) for _, u in us)
    # distributed/utils.py clip_grad_norm_: get_total_norm stacks the per-param _NormPartial norms;
    # DTensor reduces the stacked vector once per mesh dim where the grads are sharded
    cb.add("dp", "all_reduce", n_params * F32, ds, "fp32", what="grad-norm (stacked per-param norms)")
    cb.add("tp", "all_reduce", n_params * F32, tp, "fp32", what="grad-norm (stacked per-param norms)")
    # trainer.py train_step: global_valid_tokens (int64) on the batch mesh, then the logged
    # global avg loss (sum), max loss, ntokens_seen (int64) on the loss mesh (= batch mesh here)
    bdim = "-".join(d for d, n in (("dp", ds), ("dp_replicate", rep)) if n > 1)
    bsize = ds * rep
    cb.add(bdim, "all_reduce", 8, bsize, "int64", count=2, what="valid tokens, ntokens_seen")
    cb.add(bdim, "all_reduce", 4, bsize, "fp32", count=2, what="loss sum, loss max")
    if tp > 1:
        _tp_comm(cb, model, lay)
    return cb.build()


def _tp_comm(cb: CommBuilder, model: ModelShape, lay: Layout) -> None:
    """TP (no SP) collectives of models/common/decoder_sharding.py's plan as DTensor runs it."""
    tp, L, h = lay.tp, model.layers, model.hidden
    T = lay.micro_batch_size * model.seq_len
    act = T * h * BF16
    # forward: tok_embeddings (vocab-parallel, Partial -> Replicate) and rowwise wo, w2 outputs
    cb.add("tp", "all_reduce", act, tp, "bf16", count=2 * L + 1, what="embedding + rowwise outputs")
    # backward: replicated norm weights' grads (Partial -> Replicate), every norm
    cb.add("tp", "all_reduce", h * BF16, tp, "bf16", count=2 * L + 1, what="norm weight grads")
    # components/loss.py ChunkedLossWrapper -> loss-parallel cross-entropy on vocab-sharded logits:
    # max, sum-exp and target-logit all-reduces per chunk (num_chunks = 8)
    chunks = 8
    cb.add("tp", "all_reduce", T // chunks * F32, tp, "fp32", count=3 * chunks, what="loss-parallel CE")
    # backward: ChunkedLossWrapper hands the hidden grad back Partial (loss.py GradAccumulator.result);
    # it stays Partial down the residual stream (derivation above _MM) and is reduced once, at
    # tok_embeddings' local_map output (Partial -> Replicate)
    cb.add("tp", "all_reduce", act, tp, "bf16", what="residual-stream grad at tok_embeddings")
    # backward, per layer: what DTensor's sharding propagation makes of each linear's MmBackward0
    # (derivation above _MM); every layer is alike
    bwd, _ = _layer_backward_comm(model, T, tp)
    for kind, full in bwd:
        cb.add("tp", kind, full * BF16, tp, "bf16", count=L, what="DTensor mm backward redistribution")


# -- DTensor backward of the TP linears (torch 2.13, partial_dtensor: activations stay DTensors on
# the 1-D tp mesh inside every block, so each aten op of the backward goes through sharding
# propagation, torch/distributed/tensor/_dispatch.py OpDispatcher -> _sharding_prop.py) ------------
#
# Placements entering the backward (models/common/decoder_sharding.py, protocols/module.py):
#   colwise wq wk wv w1 w3: W Shard(0) [out, in], input x Replicate, output Shard(-1);
#   rowwise wo w2: W Shard(1), input Shard(-1), output Partial -> Replicate (forward all-reduce).
#   The gradient reaching a rowwise output is Partial: components/loss.py GradAccumulator.result
#   hands the hidden grad back Partial(sum), the norms' and colwise inputs' grads are Partial and
#   add(P, P) stays P, so the residual stream's grad is Partial down to tok_embeddings.
#   Colwise outputs get a Shard grad: q/k/v from inner attention's local_map in_grad_placements
#   Shard(2) (set_gqa_inner_attention_local_map), w1/w3 from SwiGLU's elementwise backward.
# nn.Linear on a 3-D input runs t + view + aten.mm; MmBackward0 (derivatives.yaml, FunctionsManual
# mm_mat1_backward / mm_mat2_backward) computes grad_x2d = mm(g, W) and, W.t() being column-major,
# grad_Wt = mm(g.t(), x2d).t(). Each mm picks a strategy of _ops/_matrix_ops.py
# gen_single_dim_einsum_strategies("mk,kn->mn") (all-Replicate inserted first,
# single_dim_strategy.py) by _sharding_prop.py _select_min_cost_strategy, priced by
# _collective_utils.py redistribute_cost; the chosen input redistributions are the collectives.
# The weight grad then meets FSDP's _fsdp_param.py _get_grad_inner_tensor, which redistributes it
# to the param's TP placement (Partial -> Shard = reduce-scatter).

# mk,kn->mn strategies over one mesh dim, (out, mat1, mat2), in the order the propagator sees them
_MM = (("R", "R", "R"), ("P", "S1", "S0"), ("S0", "S0", "R"), ("S1", "R", "S1"),
       ("P", "P", "R"), ("P", "R", "P"), ("Pavg", "Pavg", "R"), ("Pavg", "R", "Pavg"))
# _collective_utils.py MeshTopoInfo.build_from_mesh: 87.7 GB/s and 0.6 us per hop within a host; a
# mesh dim with more devices than num_devices_per_host (torch.<device>.device_count(): 1 for cpu)
# gets 0.22x the bandwidth and 2.7 us. The ledger is checked against CPU/gloo runs: one per host.
DEVICES_PER_HOST = 1


def _coll_cost(kind: str, nbytes: float, n: int) -> float:
    """_collective_utils.py allgather_cost / allreduce_cost / reduce_scatter_cost, in us."""
    bw, lat = (87.7, 0.6) if n <= DEVICES_PER_HOST else (87.7 * 0.22, 2.7)
    hops = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return 6.6 + hops * lat + (nbytes / 1024 ** 3 * hops / n) / bw * 1e6


def _move(cur: str, tgt: str, numel_full: int, n: int) -> tuple[float, str | None]:
    """_collective_utils.py redistribute_cost / _compute_placement_transition_cost on one mesh dim
    (bf16 tensors): cost and the collective redistribute_local_tensor then runs."""
    full = numel_full * BF16
    if cur == tgt or cur == "R":  # Replicate -> Shard / Partial: a local chunk or view
        return 0.0, None
    if cur[0] == "S" and tgt == "R":
        return _coll_cost("all_gather", full, n), "all_gather"
    if cur[0] == "S" and tgt[0] == "S":  # all-to-all priced as a local all-gather + 1.0 penalty
        return _coll_cost("all_gather", full / n, n) + 1.0, "all_to_all"
    if cur == "P" and tgt == "R":
        return _coll_cost("all_reduce", full, n), "all_reduce"
    if cur == "P" and tgt[0] == "S":
        return _coll_cost("reduce_scatter", full, n), "reduce_scatter"
    return float("inf"), None  # Shard -> Partial, Partial -> another Partial: banned


def _mm(a: tuple[str, int], b: tuple[str, int], n: int) -> tuple[str, list[tuple[str, int]]]:
    """aten.mm on DTensors (placement, full numel) a @ b: the output placement and the collectives.
    _sharding_prop.py _select_min_cost_strategy: a strategy needing no redistribution first, then
    the first zero-cost one, else the first of minimal summed cost."""
    best = None
    for out, pa, pb in _MM:
        (ca, ka), (cb_, kb) = _move(a[0], pa, a[1], n), _move(b[0], pb, b[1], n)
        cost = ca + cb_
        if (pa, pb) == (a[0], b[0]):
            cost = -1.0  # no redistribution at all: taken before any other
        moves = [(k, numel) for k, numel in ((ka, a[1]), (kb, b[1])) if k]
        if best is None or cost < best[0]:
            best = (cost, out, moves)
    return best[1], best[2]


def _layer_backward_comm(model: ModelShape, T: int, tp: int) -> tuple[list[tuple[str, int]], list[str]]:
    """Collectives (kind, full numel) one TransformerBlock's TP linears cause in backward, and the
    paths this derivation does not cover (named in the Placement's notes)."""
    h, f = model.hidden, model.ffn_hidden
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    out: list[tuple[str, int]] = []
    undone: list[str] = []
    for name, k in (("wo", q), ("w2", f)):  # rowwise: g [T,h] P, x2d [T,k] S1, W [h,k] S1
        o, m = _mm(("P", h * T), ("S1", T * k), tp)  # grad W: mm(g.t(), x2d), [h,k]
        out += m
        if o == "P":  # FSDP _get_grad_inner_tensor: Partial -> Shard(1)
            out.append(("reduce_scatter", h * k))
        elif o not in ("S1", "R"):
            undone.append(f"{name} weight grad leaves mm as {o}")
        o, m = _mm(("P", T * h), ("S1", h * k), tp)  # grad x2d: mm(g, W), [T,k]
        out += m
        if name == "wo" and o == "P":  # -> inner attention's local_map in_grad Shard(2) (heads)
            out.append(("reduce_scatter", T * k))
        elif o not in ("S1", "R"):
            undone.append(f"{name} input grad leaves mm as {o} (the {'SwiGLU' if name == 'w2' else 'attention'} "
                          "backward that follows is not derived)")
    for name, k in (("wq", q), ("wk", kv), ("wv", kv), ("w1", f), ("w3", f)):  # colwise: g [T,k] S1
        o, m = _mm(("S0", k * T), ("R", T * h), tp)  # grad W: mm(g.t(), x2d), [k,h] vs W's Shard(0)
        out += m
        if o == "P":
            out.append(("reduce_scatter", k * h))
        elif o not in ("S0", "R"):
            undone.append(f"{name} weight grad leaves mm as {o}")
        o, m = _mm(("S1", T * k), ("S0", k * h), tp)  # grad x2d: mm(g, W) -> Partial residual grad
        out += m
        if o != "P":
            undone.append(f"{name} input grad leaves mm as {o}")
    return out, undone
