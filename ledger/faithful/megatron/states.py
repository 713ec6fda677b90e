"""Faithful ledger for Megatron Core 0.18.0: what DDP + the (distributed) optimizer keep per rank and
which collectives one optimizer step calls. Each rule names the megatron source it follows
(paths under megatron/core/ unless said otherwise).

Resident state at a step boundary:
  params  DDP param buffer (param_data, bf16, padded) with the distributed optimizer, else the
          module's own parameters
  grads   DDP grad buffer (grad_data, fp32 with grad_reduce_in_fp32, padded)
  optim   fp32 master shards (bf16 params) + Adam exp_avg / exp_avg_sq per byte range + one
          4-byte `step` per parameter that has a non-empty range on this rank
  other   the optimizer's unity loss scale `_scale_one` (bf16 without a grad scaler), RoPE's
          inv_freq and cached emb, utils.py GlobalMemoryBuffer scratch (attention scores, SP
          all-gathers)

The peak within a step (RankState.peak: activations, pipeline buffers, temporaries, the optimizer
step's transients, recompute) is ledger.faithful.megatron.peak's, built lazily per rank in rank_state.

Tied embeddings (pp=1: one weight; pp>1: the last stage's copy, `shared_embedding` buckets, the
embedding-group all-reduce) and overlap_param_gather (the param all-gathers in the next step's
forward, none in the first step: `comm_first`) are modelled where Megatron does them: _head,
shared_embedding, build_buffer (ledger.faithful.megatron.buffers: a stage's parameters, its DDP
buffers and the DP ranks' shards), _fixed_comm (through _comm_plan), rank_state.

Speed: a layout search predicts thousands of layouts. What no micro-batch setting changes is
computed once per structure (model, tp, pp, dp, vp, knobs) and cached: the most-loaded rank
(_heaviest_rank), its fixed state (_fixed_state) and its step's collectives (_comm_plan: the DP /
embedding / grad-norm calls, and the TP / PP calls per micro-batch, which _comm counts per layout).
Stages are searched best first (_most_loaded): every stage but the last is bounded before its
summary (_chunk_bound, no bucket walk), then from its chunks' summaries (_chunk_summary), and a
stage's DP ranks are searched only when its bound can beat the best rank found (_stage_best,
_one_bucket_best; megatron_buffers says how its parts are fast).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ledger.faithful.megatron.buffers import (
    Buffer, _best_rank, _buffer, _buffer_bytes, _chunk_bound, _chunk_buckets, _chunk_contiguous, _chunk_summary,
    EVEN_SPLIT, _bucket_shares, _class_bound, _most_loaded, _pattern, _pattern_cum, _pieces, _ranks_of_shares,
    _stage_shape, _stage_totals, _tiled_ranks, argmax_rank, effective_bucket_size, owned_sizes, padded_shape)
from ledger.faithful.megatron.peak import PEAK_NOTES, check_recompute, recompute_of, stage_peak
from ledger.faithful.megatron.rules import default_transformer_impl
from ledger.dtypes import nbytes
from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict
from ledger.placement import Comm, CommBuilder, Placement, RankState, wire_bytes

ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps `step` as a float32 scalar tensor per parameter


class Knobs(NamedTuple):
    """The framework fields this ledger reads, read once per layout (a DictConfig read costs
    microseconds) and hashable: per-structure results are cached on them."""
    precision: str
    grad_reduce_in_fp32: bool
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    bucket_size: int | None
    clip_grad: float
    make_vocab_size_divisible_by: int
    transformer_impl: str  # local | transformer_engine (default_transformer_impl fills None)
    pp_split: tuple = EVEN_SPLIT  # (first, last, embedding, loss) of the pipeline split (megatron_buffers.split_error)
    # (granularity, method, num_layers, modules) of activation recompute (megatron_peak.Recompute)
    recompute: tuple = (None, None, None, ("core_attn",))
    # MoE (megatron_moe.py): (token dispatcher, load balancing, aux-loss coeff, capacity factor, pad to
    # capacity, grouped GEMM), MOE_KNOBS order
    moe: tuple = ("allgather", "aux_loss", 0.0, None, False, False)

    def __getattr__(self, name):  # the MoE knobs by the framework config's names
        try:
            return self.moe[MOE_KNOBS.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    # megatron_peak reads these by the framework config's names
    @property
    def recompute_granularity(self):
        return self.recompute[0]

    @property
    def recompute_method(self):
        return self.recompute[1]

    @property
    def recompute_num_layers(self):
        return self.recompute[2]

    @property
    def recompute_modules(self):
        return self.recompute[3]


MOE_KNOBS = ("moe_token_dispatcher_type", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
             "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_grouped_gemm")
def knobs(fw) -> Knobs:
    if isinstance(fw, Knobs):
        return fw
    return Knobs(fw.precision, bool(fw.grad_reduce_in_fp32), bool(fw.use_distributed_optimizer),
                 bool(fw.overlap_grad_reduce), bool(fw.overlap_param_gather), fw.bucket_size, fw.clip_grad,
                 fw.make_vocab_size_divisible_by, fw.transformer_impl or default_transformer_impl(), pp_split(fw),
                 tuple(recompute_of(fw)), tuple(getattr(fw, n, d) for n, d in zip(MOE_KNOBS, Knobs._field_defaults["moe"])))


def pp_split(fw) -> tuple:
    """The framework's pipeline split (megatron_buffers.EVEN_SPLIT order); a config without the fields
    (textbook mode, older records) splits evenly."""
    g = lambda name, d: getattr(fw, name, d)  # noqa: E731
    return (g("decoder_first_pipeline_num_layers", None), g("decoder_last_pipeline_num_layers", None),
            bool(g("account_for_embedding_in_pipeline_split", False)),
            bool(g("account_for_loss_in_pipeline_split", False)))


# -- one rank ------------------------------------------------------------------------------------


def stage_buffers(model: ModelShape, lay: Layout, fw, stage: int) -> list[Buffer]:
    """One DDP (so one buffer per (param, grad) dtype) per model chunk: vp of them with interleaving,
    chunk 0 first."""
    return list(_stage_buffers(model, lay.tp, lay.pp, lay.dp, lay.vp, knobs(fw), stage))


@lru_cache(maxsize=4096)
def _stage_buffers(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int) -> tuple[Buffer, ...]:
    return tuple(_buffer(model, tp, *_stage_shape(model, pp, stage, vp, ch, k.pp_split),
                         effective_bucket_size(k, dp, stage, ch), dp, k.use_distributed_optimizer) for ch in range(vp))


def _stage_class(pp: int, stage: int) -> int:
    """The lowest stage with the same buffers: stages between the first and the last hold equal
    layers (_stage_shape), and only stage 0 is bucketed (effective_bucket_size)."""
    return stage if stage == 0 or stage == pp - 1 else 1


@lru_cache(maxsize=1024)
def _heaviest_rank(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs) -> tuple[int, int, int, int]:
    """(stage, DP rank, its owned elements, its owned pieces) of the most-loaded rank: TP ranks of a
    stage hold equal shapes, stages between the first and the last hold equal buffers (the lowest
    such stage stands for them). Layouts of a search that differ only by micro-batch or SP share it."""
    _, _, pb, gb = _dtypes(k)
    dist_opt = k.use_distributed_optimizer
    w = _optim_weights(k)

    def exact(st):  # _class_bound of a stage from its chunks' summaries (exact fixed bytes)
        return _class_bound(_stage_totals(_stage_summaries(model, tp, pp, dp, vp, k, st)), dist_opt, pb, gb, *w)

    def best(st):
        if dist_opt:
            return _stage_best(model, tp, pp, dp, vp, k, st)
        # every DP rank owns every param (_owned_by): rank 0 stands for all (bounds count them exactly)
        return (0, *_stage_totals(_stage_summaries(model, tp, pp, dp, vp, k, st))[1:3])

    classes = []
    for st in sorted({0, min(1, pp - 1), pp - 1}):
        # every stage but the last bounded before its summary (the first's is a bucket walk); the
        # last, which adds the output layer, is the usual heaviest and its summary read then anyway
        if st < pp - 1:
            bounds = [_chunk_bound(model, tp, *_stage_shape(model, pp, st, vp, ch, k.pp_split),
                                   effective_bucket_size(k, dp, st, ch), dp, dist_opt) for ch in range(vp)]
            classes.append((st, _class_bound(_stage_totals(bounds), dist_opt, pb, gb, *w)[1], None))
        else:
            fixed, ub = exact(st)
            classes.append((st, ub, fixed))
    return _most_loaded(classes, exact, best, *w)


@lru_cache(maxsize=4096)
def _stage_summaries(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, st: int) -> tuple[tuple, ...]:
    """_chunk_summary of each of a stage's chunks."""
    return tuple(_chunk_summary(model, tp, *_stage_shape(model, pp, st, vp, ch, k.pp_split),
                                effective_bucket_size(k, dp, st, ch), dp, k.use_distributed_optimizer)
                 for ch in range(vp))


def _stage_best(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, st: int) -> tuple[int, int, int]:
    """(heaviest DP rank, its owned elements, its owned pieces) of a stage (dist-opt): a contiguous
    stage from its chunks' patterns (_one_bucket_best where every chunk is one bucket, else their
    param offsets and bucket walks: _tiled_best, _tiled_ranks), without building the buffers;
    otherwise from the buffers (_best_rank)."""
    w = _optim_weights(k)
    shapes = [_stage_shape(model, pp, st, vp, ch, k.pp_split) for ch in range(vp)]
    if not all(_chunk_contiguous(model, tp, first, last) for _, first, last in shapes):
        return _best_rank(_stage_buffers(model, tp, pp, dp, vp, k, st), dp, *w)
    parts = [_pattern(model, tp, first, last, True) for _, first, last in shapes]
    sums = _stage_summaries(model, tp, pp, dp, vp, k, st)
    if all(x[4] == 1 for x in sums) and len({n for n, _, _ in shapes}) == 1:  # (account_for_*: one layer fewer)
        chunks = [(head, tail, x[0]) for (head, _, tail), x in zip(parts, sums)]
        return _one_bucket_best(parts[0][1], shapes[0][0], chunks, dp, *w)
    if vp == 1:
        (layers, first, last), = shapes
        return _tiled_best(_pattern_cum(parts[0], layers), *_chunk_buckets(
            model, tp, layers, first, last, effective_bucket_size(k, dp, st, 0), dp, True), dp, *w)
    e = p = 0
    for ch, ((layers, first, last), part) in enumerate(zip(shapes, parts)):  # one buffer per chunk
        ce, cp = _tiled_ranks(_pattern_cum(part, layers), *_chunk_buckets(
            model, tp, layers, first, last, effective_bucket_size(k, dp, st, ch), dp, True), dp)
        e, p = e + ce, p + cp
    return argmax_rank(e, p, *w)


def _one_bucket_best(layer: tuple, layers: int, chunks, dp: int, w_elem: int, w_piece: int) -> tuple[int, int, int]:
    """_tiled_ranks' heaviest DP rank, its elements and pieces summed over a contiguous stage's
    chunks ((head run, tail run, numel) each, all holding `layers` copies of the run `layer`: a
    stage's chunks do, _stage_shape, _pattern) when every chunk is one bucket, without the per-rank
    arrays of each: in a chunk of S = numel / dp elements per rank, the ranks below real // S own S
    elements, the next the remainder, the ones after nothing; a rank owning some holds one piece plus
    one per param start strictly inside its range. So between consecutive chunk limits (real // S
    and the rank after) every rank owns the same elements and pieces but its starts inside, and the
    lowest with the most starts inside wins there. The layers' starts of every chunk as one array
    (_layer_ranks), the head's and tail's few one by one."""
    lc = layer[1]
    shares = []  # (S, real // S, real % S) of each chunk
    cuts = {0, dp}
    bases, layer_shares = [], []  # each chunk's first layer start and [S]
    few = []  # the ranks with a head or tail param start strictly inside
    for (_, hc, _), (_, tc, _), numel in chunks:
        lbase = hc[-1]
        tbase = lbase + layers * lc[-1]
        s = numel // dp
        full, rem = divmod(tbase + tc[-1], s)
        shares.append((s, full, rem))
        cuts.update((min(full, dp), min(full + 1, dp)))
        bases.append(lbase)
        layer_shares.append([s])
        for start in [*hc[:-1], *[tbase + x for x in tc[:-1]]]:
            r, a = divmod(start, s)
            if a:
                few.append(r)
    inner = _layer_ranks(layers, lc, bases, layer_shares, dp)  # param starts strictly inside each rank's range
    for r in few:
        inner[r] += 1
    cuts = sorted(cuts)
    best = None  # (bytes, rank, elements, pieces)
    for lo, hi in zip(cuts, cuts[1:]):
        n = owners = 0
        for s, full, rem in shares:
            x = s if lo < full else rem if lo == full else 0
            n, owners = n + x, owners + (x > 0)
        if best is not None and not owners:
            break  # no rank from here on owns an element (nor a param start)
        d = lo if hi - lo == 1 else lo + int(inner[lo:hi].argmax())
        pieces = owners + int(inner[d])
        if best is None or w_elem * n + w_piece * pieces > best[0]:
            best = (w_elem * n + w_piece * pieces, d, n, pieces)
    return best[1:]


def _layer_ranks(layers: int, lc, bases: list[int], shares: list[list[int]], dp: int) -> np.ndarray:
    """Per DP rank, the layer param starts strictly inside its range over chunks that each hold
    `layers` copies of one layer (lc: its params' aligned offsets, one longer) from bases[i], in DP
    ranges of shares[i][0] elements: one (chunks, starts) array, so one pass whatever the chunks."""
    width = lc[-1]
    offsets = np.add.outer(np.arange(0, layers * width, width, dtype=np.int64), lc[:-1]).ravel()
    rank, at = np.divmod(np.add.outer(bases, offsets), shares)
    return np.bincount(rank[at != 0], minlength=dp)


def _tiled_best(cum: np.ndarray, first: np.ndarray, bstart: np.ndarray, bend: np.ndarray, dp: int, w_elem: int,
                w_piece: int) -> tuple[int, int, int]:
    """The argmax over _tiled_ranks' ranks (rank, elements, pieces) for one buffer, without the
    per-rank arrays where every rank but the last owns a full DP range of every bucket (the ranks
    below each bucket's real // S): those own the same elements and differ only by their pieces (one
    per bucket plus the param starts strictly inside their ranges), so the lowest with the most
    starts inside wins among them; the last rank's share is evaluated on its own. Otherwise from
    _tiled_ranks' arrays."""
    nb = len(first)
    if not nb:
        return argmax_rank(*_tiled_ranks(cum, first, bstart, bend, dp), w_elem, w_piece)
    size, real, inner = _bucket_shares(cum, first, bstart, bend, dp)
    if int((real // size).min()) < dp - 1:
        return argmax_rank(*_ranks_of_shares(size, real, inner, dp), w_elem, w_piece)
    best = None  # (bytes, rank, elements, pieces)
    if dp > 1:
        d, n = int(inner[:dp - 1].argmax()), int(size.sum())
        best = (w_elem * n + w_piece * (nb + int(inner[d])), d, n, nb + int(inner[d]))
    left = real - (dp - 1) * size  # the last rank's elements of each bucket (0 to its range)
    n, pieces = int(left.sum()), int((left > 0).sum()) + int(inner[dp - 1])
    if best is None or w_elem * n + w_piece * pieces > best[0]:
        best = (0, dp - 1, n, pieces)
    return best[1:]


def _optim_weights(fw) -> tuple[int, int]:
    """Optimizer bytes per owned element (fp32 master for bf16 params + Adam's two moments) and per
    owned param piece (Adam's `step`)."""
    return (4 if fw.precision == "bf16" else 0) + 8, ADAM_STEP_BYTES


@lru_cache(maxsize=64)
def _dtypes(fw: Knobs) -> tuple[str, str, int, int]:
    """(param dtype, grad dtype, their bytes): bf16 params with fp32 grads under grad_reduce_in_fp32."""
    bf16 = fw.precision == "bf16"
    pdt = "bf16" if bf16 else "fp32"
    gdt = "fp32" if (fw.grad_reduce_in_fp32 or not bf16) else "bf16"
    return pdt, gdt, nbytes(pdt), nbytes(gdt)


def _owned_by(buffers, dist_opt: bool, dp: int, dp_rank: int) -> tuple[int, int]:
    """(elements, param pieces) whose master params and Adam state a DP rank keeps:
    distrib_optimizer.py _build_model_and_main_param_groups shards them per DP byte range of each
    bucket of each chunk's buffer (_build_gbuf_range_map per buffer); without the distributed
    optimizer every rank keeps every parameter."""
    if dist_opt:
        return owned_sizes(buffers, dp, dp_rank)
    return sum(int(b.prefix[-1]) for b in buffers), sum(len(b.starts) for b in buffers)


def rank_state(model: ModelShape, lay: Layout, k: Knobs, stage: int, dp_rank: int) -> RankState:
    """The state of the ranks of one (pipeline stage, DP rank): their TP ranks hold equal shapes."""
    base = _fixed_state(model, lay.tp, lay.pp, lay.dp, lay.vp, k, _stage_class(lay.pp, stage), dp_rank)
    s = RankState(stage=stage, params_bytes=base.params_bytes, grads_bytes=base.grads_bytes,
                  optim_bytes=base.optim_bytes, other_bytes=base.other_bytes, detail=dict(base.detail))
    act = 2 if k.precision == "bf16" else 4
    mpu = _mpu_numel(model, lay, k.transformer_impl, stage)
    if mpu:
        s.add("other_bytes", "global memory buffer (mpu)", act * mpu)
    s.comm_fn = lambda: _comm(model, lay, k, stage)
    # the peak within a step (megatron_peak.stage_peak), built on first read; Adam's state (exp_avg,
    # exp_avg_sq, step) is what the first step does not hold before its optimizer step
    adam = sum(v for n, v in s.detail.items() if n.startswith("optim/adam"))
    s.peak = lambda: stage_peak(model, lay, k, stage, dp_rank, s.resident_bytes, adam)
    if k.overlap_param_gather and lay.dp > 1:
        # the first step gathers no params (training.py train(): forward pre-hooks disabled for the
        # first iteration, see _fixed_comm): steady state less its DP all-gathers (the param gathers,
        # the only DP all-gathers); both built on first read
        s.comm_first = lambda: [c for c in s.comm if (c.dim, c.kind) != ("dp", "all_gather")]
    return s


def _mpu_numel(model: ModelShape, lay: Layout, impl: str, stage: int) -> int:
    """Elements of utils.py GlobalMemoryBuffer's "mpu" tensor (activation dtype) a rank keeps: grown to
    the largest request. The local spec (gpt_layer_specs.py get_gpt_layer_local_spec): every stage's
    transformer/dot_product_attention.py DotProductAttention (scores [b*heads/tp, s, s]) and, with SP,
    the all-gathers of tensor_parallel/layers.py ColumnParallelLinear ([s, b, h]). The TransformerEngine
    spec: TEDotProductAttention and TE's linears keep nothing there; only the output layer, a
    ColumnParallelLinear in either spec (models/gpt/gpt_model.py), all-gathers [s, b, h] into it with SP,
    on the stage that holds it (the last)."""
    b, sq = lay.micro_batch_size, model.seq_len
    sp_gather = sq * b * model.hidden if lay.sequence_parallel else 0
    if impl == "transformer_engine":
        return sp_gather if stage == lay.pp - 1 else 0
    return max(b * model.heads // lay.tp * sq * sq, sp_gather)


@lru_cache(maxsize=4096)
def _fixed_state(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int,
                 dp_rank: int) -> RankState:
    """What a rank keeps that no micro-batch setting changes (rank_state copies it; cached: layouts of a
    search that differ only by micro-batch or SP share it)."""
    bf16 = k.precision == "bf16"
    pdt, gdt, pb, gb = _dtypes(k)
    dist_opt = k.use_distributed_optimizer
    # from the buffers' summaries: no buffer built for the most-loaded rank
    numel, real = _stage_totals(_stage_summaries(model, tp, pp, dp, vp, k, stage))[:2]
    p_bytes, g_bytes = _buffer_bytes(numel, real, dist_opt, pb, gb)
    h = _heaviest_rank(model, tp, pp, dp, vp, k)
    if (h[0], h[1]) == (stage, dp_rank):  # found with the most-loaded rank
        owned_numel, owned_pieces = h[2], h[3]
    else:
        owned_numel, owned_pieces = _owned_by(_stage_buffers(model, tp, pp, dp, vp, k, stage), dist_opt, dp, dp_rank)

    s = RankState(stage=stage)
    s.add("params_bytes", f"{pdt} param buffer (param_data)" if dist_opt else f"{pdt} module parameters", p_bytes)
    s.add("grads_bytes", f"{gdt} grad buffer (grad_data)", g_bytes)
    # optim: fp32 master shard per param range for bf16 params (fp32 params are optimized in
    # place through views; optimizer.py Float16OptimizerWithFloat16Params keeps full fp32 masters
    # without the distributed optimizer), Adam's two moments, one `step` per param piece
    if bf16:
        s.add("optim_bytes", "fp32 master params", 4 * owned_numel)
    s.add("optim_bytes", "adam exp_avg + exp_avg_sq", 8 * owned_numel)
    s.add("optim_bytes", "adam step", ADAM_STEP_BYTES * owned_pieces)
    # optimizer.py MixedPrecisionOptimizer.__init__: bf16 without a grad scaler keeps _scale_one
    if bf16:
        s.add("other_bytes", "unity loss scale (_scale_one)", 4)
    # models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding: inv_freq (fp32,
    # ceil(kv_channels/2)) and the emb tensor [s, 1, 1, 2*ceil(kv_channels/2)] fp32 that the
    # @lru_cache on forward keeps alive (keyed by self: one per model chunk); every stage
    # computes it (gpt_model.py _preprocess)
    half = -(-model.head_dim // 2)
    s.add("other_bytes", "rope inv_freq", 4 * half * vp)
    s.add("other_bytes", "rope emb (lru_cache)", 4 * model.seq_len * 2 * half * vp)
    return s


def _norm_numel(model: ModelShape, tp: int, pp: int, vp: int, stage: int, split: tuple, sp: bool = True) -> int:
    """Elements of a stage's norm weights (the `sequence_parallel` params with SP); without SP its q/k
    norms only (qk_layernorm)."""
    per_layer, head = _norms(model, tp) if sp else (2 * model.head_dim * (2 if model.norm == "layernorm" else 1), 0)
    out = 0
    for ch in range(vp):
        n, _, last = _stage_shape(model, pp, stage, vp, ch, split)
        out += n * per_layer + (head if last else 0)
    return out


@lru_cache(maxsize=256)
def _norms(model: ModelShape, tp: int) -> tuple[int, int]:
    """Elements of the norm weights of one decoder layer and of the head (_pieces)."""
    _, layer, head = _pieces(model, tp)
    return tuple(sum(k for name, k in part if "layernorm" in name) for part in (layer, head))


def _fixed_comm(calls, model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int, sp: bool) -> None:
    """The collectives of one steady-state step that no micro-batch setting changes (DP buckets,
    tied-embedding grads, grad norm, SP norm grads), each given to calls(dim, kind, dtype, what,
    group size, [buffer bytes of each call])."""
    grid = Grid(tp=tp, dp=dp, pp=pp)  # Layout.grid of a Megatron layout (cp = dp_replicate = 1: place)
    pdt, gdt, pb, gb = _dtypes(k)
    first, last = stage == 0, stage == pp - 1
    # DP: distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup.start_grad_sync, one
    # bucket per group (partition_buckets without fp8): reduce-scatter of the whole padded
    # bucket grad_data (distributed optimizer) or all-reduce; start_param_sync: all-gather of the
    # bucket's param_data, once per bucket group and step. Without overlap_param_gather it runs
    # after optimizer.step (distrib_optimizer.py step_with_ready_grads). With it, step_with_ready_grads
    # gathers nothing; the next step's forward gathers each bucket group, asynchronously
    # (distributed_data_parallel.py _make_forward_pre_hook -> finish_param_sync: start_param_sync
    # of an undispatched group, then the next group's; or, with the interleaved schedule's
    # align_param_gather, config.param_sync_func from schedules.py), and finish_grad_sync resets
    # param_gather_dispatched for the step after. training.py train() disables the pre-hooks
    # (disable_forward_pre_hook(param_sync=False)) and param_sync_func for the first iteration:
    # step 0 gathers nothing, every later step gathers the previous step's update.
    # Bucket groups: partition_buckets gives each bucket its own group, except for a DDP built
    # with disable_bucketing (training.py get_model: model chunks after the first) whose buckets
    # form one group, issued as one coalesced call (_coalescing_manager) over all of them; such a
    # chunk has several buckets only around a tied model's shared embedding (build_buffer)
    numels = _bucket_numels(model, tp, pp, dp, vp, k, stage)
    if k.use_distributed_optimizer:
        calls("dp", "reduce_scatter", gdt, "grad bucket (start_grad_sync)", dp, [gb * n for n in numels])
        what = ("param bucket (next step's forward: pre-hook finish_param_sync / param_sync_func)"
                if k.overlap_param_gather else "param bucket (start_param_sync)")
        calls("dp", "all_gather", pdt, what, dp, [pb * n for n in numels])
    else:
        calls("dp", "all_reduce", gdt, "grad bucket (start_grad_sync)", dp, [gb * n for n in numels])
    if model.tied_embeddings and pp > 1 and (first or last):  # a chunk with a shared_embedding param
        # distributed/finalize_model_grads.py _allreduce_word_embedding_grads: the first stage's
        # word-embedding main_grad and the last stage's copy (fp32 grad_data views with
        # grad_reduce_in_fp32), all-reduced over the embedding group (parallel_state.py
        # default_embedding_ranks: the first and last PP rank, a pp group of 2) after finish_grad_sync
        calls(grid.label_of(("pp",)), "all_reduce", gdt, "tied word-embedding grads (finalize_model_grads)", 2,
              [gb * (model.vocab // tp) * model.hidden])
    # grad norm: optimizer/clip_grads.py get_grad_norm_fp32, one fp32 all-reduce over
    # grad_stats_parallel_group: the whole world with the distributed optimizer
    # (optimizer/__init__.py: intra_dist_opt_group), else the model-parallel group
    dims = ("tp", "cp", "dp", "dp_replicate", "pp") if k.use_distributed_optimizer else ("tp", "pp")
    size = grid.size_of(dims)
    if k.clip_grad > 0 and size > 1:
        calls(grid.label_of(dims), "all_reduce", "fp32", "grad norm (clip_grads.py)", size, [4])
    if sp or model.qk_layernorm:
        # distributed/finalize_model_grads.py _allreduce_non_tensor_model_parallel_grads: one
        # coalesced all-reduce of the main grads of the `sequence_parallel` (norm) params, and of the
        # q/k norms (qk_layernorm) with or without SP
        calls("tp", "all_reduce", gdt, "SP norm grads (finalize_model_grads)", tp,
              [gb * _norm_numel(model, tp, pp, vp, stage, k.pp_split, sp)])


def _bucket_numels(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int) -> list[int]:
    """Elements of each DP bucket group of a stage, no buffer built: chunk 0's buckets (one, its
    summary's numel, or those of its bucket walk), then each later chunk's buffer as one group."""
    sums = _stage_summaries(model, tp, pp, dp, vp, k, stage)
    if sums[0][4] == 1:
        first = [sums[0][0]]
    else:
        _, bstart, bend = _chunk_buckets(model, tp, *_stage_shape(model, pp, stage, vp, 0, k.pp_split),
                                         effective_bucket_size(k, dp, stage, 0), dp, k.use_distributed_optimizer)
        first = (bend - bstart).tolist()
    return first + [x[0] for x in sums[1:]]


def _comm(model: ModelShape, lay: Layout, k: Knobs, stage: int) -> list[Comm]:
    """Collectives of one steady-state optimizer step of this stage: its plan (_comm_plan, cached per
    structure) with the per-micro-batch calls counted for this micro-batch size and count."""
    rows = _comm_plan(model, lay.tp, lay.pp, lay.dp, lay.vp, k, _stage_class(lay.pp, stage), lay.sequence_parallel)
    m, b = lay.num_microbatches, lay.micro_batch_size  # m >= 1 (resolve, validate)
    out = []
    for row in rows:
        if type(row) is Comm:
            out.append(row)  # shared across layouts: Comm records are read, never changed
            continue
        dim, kind, dtype, what, count, buf, wire, per_mb = row
        for calls, wires, unit, div, group in per_mb:
            x = b * unit // div
            count += calls * m
            buf += calls * m * x
            wire += wires * m * wire_bytes(kind, x, group)
        out.append(Comm(dim, kind, count, buf, wire, dtype, what))
    return out


@lru_cache(maxsize=4096)
def _comm_plan(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int, sp: bool) -> tuple:
    """Every collective record of one stage class's step (CommBuilder.build of every call, the fixed
    ones counted, the per-micro-batch ones named): a Comm where no call repeats per micro-batch (the
    calls no micro-batch setting changes, _fixed_comm), else its fields (dim, kind, dtype, what,
    count, buffer bytes, wire bytes: the fixed calls') and its calls per micro-batch
    (_micro_batch_comm), each (calls per micro-batch, the calls among them that send, bytes per
    sequence, divisor, group size): micro_batch_size * bytes per sequence // divisor bytes per call,
    wire_bytes over the group for each sending one (a send_recv pair: two calls, one sending)."""
    cb = CommBuilder()
    per_mb: dict[tuple, tuple] = {}

    def fixed(dim, kind, dtype, what, group, buffers):
        cb.add_each(dim, kind, buffers, group, dtype, what)

    def per_micro_batch(dim, kind, dtype, what, calls, unit, div, group, wires):
        if calls > 0 and group > 1:
            key = (dim, kind, dtype)
            cb.add_sums(key, 0, 0, 0, [what])  # counted per layout (_comm)
            per_mb[key] = per_mb.get(key, ()) + ((calls, wires, unit, div, group),)

    _fixed_comm(fixed, model, tp, pp, dp, vp, k, stage, sp)
    _micro_batch_comm(per_micro_batch, model, tp, pp, vp, k, stage, sp)
    rows = []
    for c in cb.build():
        calls = per_mb.get((c.dim, c.kind, c.dtype))
        rows.append(c if calls is None else
                    (c.dim, c.kind, c.dtype, c.what, c.count, c.buffer_bytes, c.wire_bytes, calls))
    return tuple(rows)


def _micro_batch_comm(calls, model: ModelShape, tp: int, pp: int, vp: int, k: Knobs, stage: int, sp: bool) -> None:
    """The collectives one stage makes every micro-batch (TP, cross-entropy, PP), each given to
    calls(dim, kind, dtype, what, calls per micro-batch, bytes per sequence, divisor, group size,
    calls that send): each call hands micro_batch_size * bytes per sequence // divisor bytes."""
    pdt = _dtypes(k)[0]
    first, last = stage == 0, stage == pp - 1
    layers = sum(_stage_shape(model, pp, stage, vp, ch, k.pp_split)[0] for ch in range(vp))  # this stage's
    sbh = model.seq_len * model.hidden * (2 if k.precision == "bf16" else 4)  # one sequence's [s, h] activations
    # TP per layer per micro-batch: tensor_parallel/layers.py + mappings.py. Without SP:
    # linear_qkv / linear_fc1 copy_to_tensor_model_parallel_region (all-reduce in backward),
    # linear_proj / linear_fc2 reduce_from_tensor_model_parallel_region (all-reduce in forward).
    # With SP: column-parallel all-gather forward + all-gather again in backward (wgrad input,
    # LinearWithGradAccumulationAndAsyncCommunication.backward) + reduce-scatter of the input grad;
    # row-parallel reduce-scatter forward + all-gather backward. Buffers: the full s*b*h.
    if sp:
        ag, rs = 6 * layers, 4 * layers
        if first:  # embedding: reduce_scatter_to_sequence_parallel_region (all-gather in backward)
            ag, rs = ag + 1, rs + 1
        if last:  # output_layer (column-parallel): all-gather fwd + bwd, reduce-scatter of dgrad
            ag, rs = ag + 2, rs + 1
        calls("tp", "all_gather", pdt, "SP all-gather (layers.py/mappings.py)", ag, sbh, 1, tp, ag)
        calls("tp", "reduce_scatter", pdt, "SP reduce-scatter (layers.py/mappings.py)", rs, sbh, 1, tp, rs)
    else:
        ar = 4 * layers + first + last  # embedding forward, output_layer input grad
        calls("tp", "all_reduce", pdt, "TP all-reduce (mappings.py)", ar, sbh, 1, tp, ar)
    if last:
        # tensor_parallel/cross_entropy.py VocabParallelCrossEntropy.forward: logits max,
        # predicted logits, sum of exp, each fp32 [s, b]
        calls("tp", "all_reduce", "fp32", "vocab-parallel cross-entropy", 3, model.seq_len * 4, 1, tp, 3)
    # PP: pipeline_parallel/schedules.py + p2p_communication.py: per micro-batch activations forward,
    # their grads backward, each sent by one stage and received by its neighbour (a send_recv pair:
    # the sent tensor on the wire); with SP the sequence-sharded tensor [s/tp, b, h]
    if vp > 1:
        # forward_backward_pipelining_with_interleaving (overlap_p2p_comm and
        # overlap_p2p_comm_warmup_flush off, the launcher's config): every virtual micro-batch sends its
        # activations to the next stage except out of the last stage's last chunk, and its grads to the
        # previous stage except from the first stage's first chunk; each is received by that
        # neighbour. test_megatron.py replays the schedule's control flow (get_schedule_table,
        # recv_tensor_from_previous_stage, ...) and checks these counts against it
        pairs = 2 * vp - first - last
        what = "activations / activation grads, interleaved (schedules.py, p2p_communication.py)"
    else:
        # forward_backward_pipelining_without_interleaving: per micro-batch and neighbour one tensor
        # sent and one received: send_forward + recv_backward with the next stage, recv_forward +
        # send_backward with the previous
        pairs = (not last) + (not first)
        what = "activations / activation grads (p2p_communication.py)"
    calls("pp", "send_recv", pdt, what, 2 * pairs, sbh, tp if sp else 1, pp, pairs)


# -- the interleaved schedule (vp > 1) -----------------------------------------------------------
def check_interleaving(lay: Layout) -> None:
    """pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving: with
    microbatch_group_size_per_vp_stage = pp (model_parallel_config.py default) it needs
    pp <= num_microbatches and no final group smaller than pp, i.e. num_microbatches % pp == 0."""
    m = lay.num_microbatches
    if lay.vp > 1 and (m < lay.pp or m % lay.pp):
        raise ConfigError(f"megatron: vp={lay.vp}: layout.global_batch_size={lay.global_batch_size} gives "
                          f"num_microbatches={m} (global_batch_size / (micro_batch_size*dp)), which must be a "
                          f"multiple of pp={lay.pp} for the interleaved schedule")


def check_framework(fw) -> None:
    """training/arguments.py validate_args: --overlap-param-gather needs the distributed optimizer
    (the plain optimizer's buffers have no layer-wise gather lists) and --overlap-grad-reduce."""
    if fw.overlap_param_gather and not fw.use_distributed_optimizer:
        raise ConfigError("megatron: framework.overlap_param_gather=true needs "
                          "framework.use_distributed_optimizer=true (training/arguments.py validate_args)")
    if fw.overlap_param_gather and not fw.overlap_grad_reduce:
        raise ConfigError("megatron: framework.overlap_param_gather=true needs framework.overlap_grad_reduce=true "
                          "(training/arguments.py validate_args)")


def place(model: ModelShape, lay: Layout, fw) -> Placement:
    # what this ledger does not model is refused, naming the field (textbook mode still predicts it)
    if lay.cp > 1:
        # transformer/dot_product_attention.py DotProductAttention asserts context_parallel_size == 1
        # ("only supported by TEDotProductAttention"): CP needs TransformerEngine, which no CPU run
        # here has, so no run could confirm a rule; textbook mode predicts it
        raise ConfigError(f"megatron: cp={lay.cp}: the faithful ledger models cp=1 only (Megatron's CP needs "
                          "TransformerEngine attention, which no CPU run can confirm; use ledger.mode=textbook)")
    if lay.dp_replicate > 1:
        raise ConfigError("megatron: dp_replicate (HSDP) is a torchtitan layout")
    k = knobs(fw)
    check_framework(k)
    check_interleaving(lay)
    check_recompute(recompute_of(k))
    tp, dp = lay.tp, lay.dp
    notes = list(_NOTES[k.transformer_impl]) + list(PEAK_NOTES[k.transformer_impl])
    # every rule below sees the shape Megatron trains: the embedding, the output layer and the tied
    # word-embedding grads hold the padded vocab (the record keeps the configured shape)
    trained = padded_shape(model, tp, k.make_vocab_size_divisible_by)
    if trained.vocab != model.vocab:  # (an equal shape from the cache may be another object)
        notes.append(f"vocab {model.vocab} padded to {trained.vocab} rows (a multiple of "
                     f"make_vocab_size_divisible_by={k.make_vocab_size_divisible_by} x tp={tp}: Megatron's "
                     "tokenizers/utils/build_tokenizer.py vocab_size_with_padding)")
    cache: dict[tuple, RankState] = {}

    def state(rank: int) -> RankState:
        # Layout.grid order tp, cp, dp, dp_replicate, pp with cp = dp_replicate = 1 (refused above)
        key = (rank // (tp * dp), rank // tp % dp)  # (stage, DP rank)
        s = cache.get(key)
        if s is None:
            s = cache[key] = rank_state(trained, lay, k, *key)
        return s

    st, d, _, _ = _heaviest_rank(trained, tp, lay.pp, dp, lay.vp, k)
    reps = [(st * dp + d) * tp]
    last = lay.pp - 1
    impl = k.transformer_impl
    if st != last and _mpu_numel(trained, lay, impl, last) > _mpu_numel(trained, lay, impl, st):
        # the TE spec's "mpu" buffer is on the last stage alone (_mpu_numel): its heaviest DP rank (the
        # buffer is the same on each) may outweigh the heaviest rank of the fixed state
        dl = _stage_best(trained, tp, lay.pp, dp, lay.vp, k, last)[0] if k.use_distributed_optimizer else 0
        reps = sorted(reps + [(last * dp + dl) * tp])  # per_gpu: the first on ties, as over every rank
    best_dp: dict[int, int] = {}

    def stage_reps(stage: int) -> list[int]:
        # a stage's TP ranks hold equal shapes and its DP ranks equal buffers and other bytes: they
        # differ by their optimizer shard alone, whose heaviest DP rank _stage_best finds; stages between
        # the first and the last share it (_stage_class)
        c = _stage_class(lay.pp, stage)
        if c not in best_dp:
            best_dp[c] = _stage_best(trained, tp, lay.pp, dp, lay.vp, k, c)[0] if k.use_distributed_optimizer else 0
        return [(stage * dp + best_dp[c]) * tp]

    return Placement(framework="megatron", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                     world=lay.world, rank_state=state, representatives=reps, notes=notes,
                     stage_representatives=stage_reps, spec=k.transformer_impl)


_BUFFERS_NOTE = ("megatron-core 0.18.0: DDP buffers padded as distrib_optimizer.py _compute_per_buffer_param_layout; "
                 "master/Adam per DP byte range")
_NOTES = {
    "local": (_BUFFERS_NOTE, "transformer_impl=local: the local spec's DotProductAttention keeps a "
              "[b*heads/tp, s, s] score buffer in GlobalMemoryBuffer (other); TransformerEngine's fused attention "
              "does not"),
    "transformer_engine": (_BUFFERS_NOTE, "transformer_impl=transformer_engine: no attention-score buffer in other "
                           "(TEDotProductAttention), only the output layer's SP all-gather on the last stage; "
                           "parameters in the local spec's order (TE's fused layer_norm_weight of linear_qkv / "
                           "linear_fc1 order, its workspaces and fp8 state are not modelled; no run here confirms TE)"),
}
