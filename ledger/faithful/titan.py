"""Faithful torchtitan 0.3.0 ledger (torch 2.13 FSDP2, partial_dtensor backend), per rank per step.

Every rule names the source it follows. Shapes are the ModelShape's, built as launchers/titan.py
builds them (llama3 layers, untied lm_head, separate wq/wk/wv, rope cache sized to seq_len).
"""
from __future__ import annotations

from dataclasses import dataclass

from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, numel
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

    from ledger.textbook import _model_dict

    pl = Placement(framework="titan", mode="faithful", model=_model_dict(model), layout=lay.to_dict(),
                   world=lay.world, rank_state=rank_state,
                   # a state depends on the shard rank alone: one rank per shard rank covers them all
                   representatives=[grid.rank({"dp": k}) for k in range(ds)])
    if lay.tp > 1:
        pl.notes.append("titan tp: the redistributions DTensor inserts inside mm/attention backward "
                        "(partial_dtensor backend) follow a per-layer pattern fitted from traced calls "
                        "at two shapes, not derived from source; see _tp_comm")
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
    # backward: the hidden-state grad handed back by ChunkedLossWrapper (Partial -> Replicate)
    cb.add("tp", "all_reduce", act, tp, "bf16", what="ChunkedLossWrapper hidden grad")
    # backward, per layer: redistributions DTensor's sharding propagation inserts inside the
    # mm / attention backward ops (torch/distributed/tensor/_dispatch.py redistribute_local_args,
    # _api.py backward). Not spelled out in torchtitan; shapes fitted from traced calls at two
    # model shapes (tp=2) and written in the model's terms: q = heads*head_dim/tp, f = ffn/tp.
    q, f = model.heads * model.head_dim // tp, model.ffn_hidden // tp
    per = [("all_gather", h * q), ("all_gather", T * f), ("all_gather", T * q),
           ("reduce_scatter", T * q), ("reduce_scatter", h * f), ("reduce_scatter", h * q)]
    for kind, local in per:
        cb.add("tp", kind, tp * local * BF16, tp, "bf16", count=L, what="DTensor backward redistribution")
    cb.add("tp", "all_reduce", act, tp, "bf16", count=L, what="DTensor backward redistribution")
