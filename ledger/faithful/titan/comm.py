"""The collectives of one torchtitan 0.3.0 training step without pipeline parallelism (torch 2.13 FSDP2,
the partial_dtensor backend), per rank: FSDP2's all-gathers and fp32 reduce-scatters per unit
(_fsdp_collectives.py foreach_all_gather / foreach_reduce, in distributed/fsdp.py's unit order), HSDP's
all-reduces over dp_replicate, the grad-norm and loss / token all-reduces (distributed/utils.py
clip_grad_norm_, trainer.py train_step), CP's K/V all-gathers (distributed/context_parallel/api.py, torch
_cp_custom_ops.py), TP / SP's redistributions (models/common/decoder_sharding.py as DTensor runs it; the
mm backward's from dtensor.py) and a checkpointed block's recompute of its forward ones. Step 0 differs
only by the loss wrapper's lm_head unshard (first_step). The meshes are those of
distributed/parallel_dims.py build_mesh (mesh_labels); the pipeline's collectives are pp.py's.
"""
from __future__ import annotations

from functools import lru_cache

from ledger.dtypes import BF16, FP32 as F32
from ledger.faithful.titan.dtensor import layer_backward_comm
from ledger.faithful.titan.fsdp import Sharded
from ledger.grid import Grid
from ledger.layout import Layout
from ledger.model import ModelShape
from ledger.placement import Comm, CommBuilder, wire_bytes


def lm_head_regathers(fw, steady: bool) -> bool:
    """components/loss.py ChunkedLossWrapper: lm_head.unshard() before the chunks; after step 0 the
    group reshards after forward (the wrapper leaves set_reshard_after_forward(True) behind), and
    "always" reshards from the start, so the unshard gathers again."""
    return steady or fw.reshard_after_forward == "always"


REGATHER = "ChunkedLossWrapper lm_head.unshard"


def first_step(steady: list[Comm], sh: Sharded, ds: int, fsdp_dim: str) -> list[Comm]:
    """Step 0's collectives where they differ: steady state less the [norm, lm_head] gather that
    lm_head_regathers leaves out of the first step (test: equal to step_comm(steady=False))."""
    buf = (sh.norm_full + sh.lm_full) * BF16
    out = []
    for c in steady:
        if (c.dim, c.kind, c.dtype) == (fsdp_dim, "all_gather", "bf16"):
            c = Comm(c.dim, c.kind, c.count - 1, c.buffer_bytes - buf, c.wire_bytes - wire_bytes(c.kind, buf, ds),
                     c.dtype, "; ".join(w for w in c.what.split("; ") if w != REGATHER),
                     forward_buffer_bytes=None if c.forward_buffer_bytes is None else c.forward_buffer_bytes - buf)
        out.append(c)
    return out


@lru_cache(maxsize=8)
def _labels_of(cp: bool, dp: bool, dp_replicate: bool) -> tuple[str, str, str]:
    g = Grid(cp=1 + cp, dp=1 + dp, dp_replicate=1 + dp_replicate)
    return g.label_of(("cp", "dp")), g.label_of(("dp", "dp_replicate")), g.label_of(("cp", "dp", "dp_replicate"))


def mesh_labels(grid: Grid) -> tuple[str, str, str]:
    """Grid.label_of of the fsdp (cp, dp), batch (dp, dp_replicate) and loss (cp, dp, dp_replicate)
    meshes. A label names the dims of size > 1: one Grid per which of cp, dp, dp_replicate are
    makes them (cached; test: equal to grid.label_of)."""
    return _labels_of(grid.cp > 1, grid.dp > 1, grid.dp_replicate > 1)


def fsdp_gathers(emb: int, layer: int, head: int, L: int, fw, steady: bool) -> tuple:
    """A step's FSDP all-gathers without PP (CommBuilder.add_several's calls: bytes, times, what, whether a
    forward makes them), of units of emb, layer and [norm, lm_head] (head) elements.
    _fsdp_collectives.py foreach_all_gather: one bf16 buffer per unit. Forward: every unit gathers once
    ([norm, lm_head] again where the loss wrapper unshards it, before any backward: lm_head_regathers), and
    ends with lm_head.reshard(): the norm's backward gathers the group again, and, resharded after forward
    (distributed/fsdp.py get_fsdp_reshard_after_forward_policy: "default" without PP = True), each block and
    tok_embeddings too."""
    reshard = fw.reshard_after_forward in ("default", "always")
    return ((emb * BF16, 1, "forward unshard", True), (layer * BF16, L, "forward unshard", True),
            (head * BF16, 1, "forward unshard (norm)", True),
            (head * BF16, lm_head_regathers(fw, steady), REGATHER, True),
            (head * BF16, 1, "backward unshard (norm)", False),
            (layer * BF16, L * reshard, "backward unshard", False), (emb * BF16, reshard, "backward unshard", False))


def step_comm(model: ModelShape, lay: Layout, fw, sh: Sharded, steady: bool, grid: Grid | None = None,
              cpu_mesh: bool = True) -> list[Comm]:
    """A rank's collectives of one step (steady or the first); cpu_mesh: the target's device mesh is cpu
    (target.py: DTensor's Shard -> Shard redistributions run as all-gathers there)."""
    cp, rep, tp = lay.cp, lay.dp_replicate, lay.tp
    ds = lay.dp_shard * cp
    fsdp, batch_dim, loss_dim = mesh_labels(grid or lay.grid)  # the "fsdp" mesh: dp_shard x cp
    L = model.layers
    emb, layer, head = sh.emb_full, sh.layer_full, sh.norm_full + sh.lm_full
    acc = CommBuilder()
    acc.add_several(fsdp, "all_gather", "bf16", ds, fsdp_gathers(emb, layer, head, L, fw, steady))
    # foreach_reduce: one fp32 reduce-scatter per call: lm_head at the last chunk (gradient sync off
    # before), norm after its backward, then the blocks and tok_embeddings; with HSDP each reduced
    # shard is all-reduced over dp_replicate
    scatters = ((sh.lm_full, 1, "lm_head grad (last chunk)"), (sh.norm_full, 1, "norm grad"),
                (layer, L, "layer grads"), (emb, 1, "tok_embeddings grad"))
    acc.add_several(fsdp, "reduce_scatter", "fp32", ds, [(f * F32, c, w) for f, c, w in scatters])
    if rep > 1:
        acc.add_several("dp_replicate", "all_reduce", "fp32", rep,
                   [(f * F32 // ds, c, f"HSDP {w}") for f, c, w in scatters])
    if cp > 1:
        # distributed/context_parallel/api.py apply_cp_to_forward (FlexAttention): every inner
        # attention all-gathers its K and V over cp (torch _cp_custom_ops.py flex_cp_allgather:
        # two all_gather_single on the sequence dim); its backward reduce-scatters both grads
        # (flex_cp_allgather_backward). Local K/V: kv_heads/tp heads (inside TP's local_map)
        kv = lay.micro_batch_size * model.seq_len * model.kv_heads // tp * model.head_dim * BF16
        acc.add("cp", "all_gather", kv, cp, "bf16", 2 * L, "CP K/V all-gather")
        acc.add("cp", "reduce_scatter", kv, cp, "bf16", 2 * L, "CP K/V grads")
        # a checkpointed block's recompute gathers K and V again (not in SAC's save list)
        acc.add("cp", "all_gather", kv, cp, "bf16", 2 * L * recomputed(fw, "all_gather"), "CP K/V all-gather, recompute")
    if tp > 1:
        _tp_comm(acc, model, lay, fw, cpu_mesh)
    # trainer.py train_step: gradient accumulation runs forward_backward_step once per micro-batch with
    # gradient sync on (FSDP2 reduce-scatters each backward and adds into the sharded grads): every
    # collective above once per micro-batch, the step's own below once
    acc = _times(acc, lay.num_microbatches)

    # distributed/utils.py clip_grad_norm_: get_total_norm stacks the per-param _NormPartial norms;
    # DTensor reduces the stacked vector once per mesh dim where the grads are sharded
    acc.add(fsdp, "all_reduce", sh.n_params * F32, ds, "fp32", 1, "grad-norm (stacked per-param norms)")
    acc.add("tp", "all_reduce", sh.n_params * F32, tp, "fp32", 1, "grad-norm (stacked per-param norms)")
    # trainer.py train_step: global_valid_tokens (int64) on the batch mesh (dp_replicate x
    # dp_shard: cp ranks count the same unsharded labels), then the logged global avg loss (sum),
    # max loss, ntokens_seen (int64) on the loss mesh (batch x cp)
    bsize = lay.dp_shard * rep
    acc.add(batch_dim, "all_reduce", 8, bsize, "int64", 1, "valid tokens")
    acc.add(loss_dim, "all_reduce", 8, bsize * cp, "int64", 1, "ntokens_seen")
    acc.add(loss_dim, "all_reduce", 4, bsize * cp, "fp32", 2, "loss sum, loss max")
    return acc.build()


def _times(acc: CommBuilder, n: int) -> CommBuilder:
    """acc's collectives n times over (a builder to add the step's own to)."""
    if n == 1:
        return acc
    out = CommBuilder()
    for c in acc.build():
        out.add_sums((c.dim, c.kind, c.dtype), c.count * n, c.buffer_bytes * n, c.wire_bytes * n,
                     c.what.split("; ") if c.what else [],
                     None if c.forward_buffer_bytes is None else c.forward_buffer_bytes * n)
    return out


def recomputed(fw, kind: str) -> bool:
    """Whether a checkpointed block's recompute in its backward runs its forward collectives of this
    kind again (distributed/activation_checkpoint.py): full AC saves nothing inside the block, so
    every one; selective AC's save list has _c10d_functional.reduce_scatter_tensor (and all_to_all)
    but not all_gather / all_reduce, so all but the reduce-scatters. Measured on the CPU (tp2, cp2 at
    world 2, both modes: two more all-reduces / K-V all-gathers a block) and on the fake world (the
    article's FSDP4-TP2-SP run: two more all-gathers a block, and two more reduce-scatters under full)."""
    ac = getattr(fw, "activation_checkpoint", "none")
    return ac == "full" or (ac == "selective" and kind != "reduce_scatter")


def _tp_comm(acc: CommBuilder, model: ModelShape, lay: Layout, fw, cpu_mesh: bool = True) -> None:
    """TP collectives of models/common/decoder_sharding.py's plan (models/llama3/sharding.py) as
    DTensor runs it, with or without sequence parallelism (parallelism.enable_sequence_parallel), and
    a checkpointed block's forward ones again in its recompute (recomputed)."""
    tp, L, h = lay.tp, model.layers, model.hidden
    T = lay.micro_batch_size * model.seq_len // lay.cp  # the rank's tokens: CP splits the sequence
    act = T * h * BF16
    sp = bool(lay.sequence_parallel)
    blocks = 2 * L + 1  # every block's two sub-layers and one more (embedding or root norm)
    if sp:
        # SP: the residual stream is sequence-sharded, Shard(1) (dense_sequence_parallel_placement).
        # forward: tok_embeddings' output (set_decoder_sharding_config: out_src Partial, out_dst SP) and
        # rowwise wo, w2 (rowwise_config(output_sp=True)) go Partial -> Shard(1): reduce-scatter;
        # attention's x_BLD and feed_forward's x (set_gqa_attention_sharding / set_dense_ffn_sharding
        # in_dst Replicate) and the root norm's output (pre_lm_head_norm_config out_dst Replicate)
        # go Shard(1) -> Replicate: all-gather.
        # backward: _redistribute.py _redistribute_backward runs each of these in reverse. A
        # Partial -> Shard(1) becomes Shard(1) -> Replicate ("for backward shard -> partial, we just
        # do shard -> replicate"): all-gather. A Shard(1) -> Replicate gets the Partial grad (the
        # colwise input grads, derivation in dtensor.py; the loss wrapper's hidden grad) and takes it
        # back to Shard(1): reduce-scatter
        acc.add_several("tp", "reduce_scatter", "bf16", tp,
                   ((act, blocks, "SP: embedding + rowwise outputs Partial -> Shard(1)"),
                    (act, blocks, "SP backward: Partial grads of the gathered inputs scattered"),
                    (act, 2 * L * recomputed(fw, "reduce_scatter"), "SP: rowwise outputs, recompute")))
        acc.add_several("tp", "all_gather", "bf16", tp,
                   ((act, blocks, "SP: attention/ffn inputs + root norm output Shard(1) -> Replicate"),
                    (act, blocks, "SP backward: grads of the Partial -> Shard(1) outputs gathered"),
                    (act, 2 * L * recomputed(fw, "all_gather"), "SP: attention/ffn inputs, recompute")))
    else:
        # forward: tok_embeddings (vocab-parallel, Partial -> Replicate) and rowwise wo, w2 outputs;
        # backward: ChunkedLossWrapper hands the hidden grad back Partial (loss.py
        # GradAccumulator.result); it stays Partial down the residual stream (derivation in dtensor.py)
        # and is reduced once, at tok_embeddings' local_map output (Partial -> Replicate)
        acc.add_several("tp", "all_reduce", "bf16", tp, ((act, blocks, "embedding + rowwise outputs"),
                                                          (act, 1, "residual-stream grad at tok_embeddings"),
                                                          (act, 2 * L * recomputed(fw, "all_reduce"),
                                                           "rowwise outputs, recompute")))
    # backward: every norm's weight grad is Partial on tp (with SP: a Replicate weight times a
    # Shard(1) input) and FSDP's post-backward (_fsdp_param.py _get_grad_inner_tensor) redistributes
    # it to the param's Replicate: all-reduce (norm_config: "pending BWD AR handled by FSDP")
    acc.add("tp", "all_reduce", h * BF16, tp, "bf16", blocks, "norm weight grads")
    # components/loss.py ChunkedLossWrapper -> loss-parallel cross-entropy on vocab-sharded logits:
    # max, sum-exp and target-logit all-reduces per chunk (num_chunks = 8)
    chunks = 8
    acc.add("tp", "all_reduce", T // chunks * F32, tp, "fp32", 3 * chunks, "loss-parallel CE")
    # backward, per layer: what DTensor's sharding propagation makes of each linear's MmBackward0
    # (derivation in dtensor.py); every layer is alike
    for kind, full in layer_backward_comm(model, T, tp, sp, cpu_mesh)[0]:
        acc.add("tp", kind, full * BF16, tp, "bf16", L, _MM_BACKWARD)


_MM_BACKWARD = "DTensor mm backward redistribution"
