"""Faithful ledger for Megatron Core 0.18.0: what DDP + the (distributed) optimizer keep per rank
(rank_state), which rank keeps the most (_heaviest_rank) and a layout's placement (place, the
framework "megatron"'s). Each rule names the megatron source it follows (paths under megatron/core/
unless said otherwise).

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
step's transients, recompute) is ledger.faithful.megatron.peak's and the step's collectives
(RankState.comm) ledger.faithful.megatron.comm's, both built lazily per rank in rank_state.

Tied embeddings (pp=1: one weight; pp>1: the last stage's copy, `shared_embedding` buckets, the
embedding-group all-reduce) and overlap_param_gather (the param all-gathers in the next step's
forward, none in the first step: `comm_first`) are modelled where Megatron does them: head,
shared_embedding (ledger.faithful.megatron.pipeline: a stage's parameters), build_buffer
(ledger.faithful.megatron.buffers: its DDP buffers and the DP ranks' shards), comm.py's _fixed_comm,
rank_state.

Speed: a layout search predicts thousands of layouts. What no micro-batch setting changes is
computed once per structure (model, tp, pp, dp, vp, knobs) and cached: the most-loaded rank
(_heaviest_rank), its fixed state (_fixed_state) and its step's collectives (comm.py's _comm_plan: the
DP / embedding / grad-norm calls, and the TP / PP calls per micro-batch, which comm counts per layout).
Stages are searched best first (most_loaded): every stage but the last is bounded before its summary
(chunk_bound, no bucket walk), then from its chunks' summaries (stage_summaries), and a stage's DP
ranks are searched only when its bound can beat the best rank found (_stage_best, _one_bucket_best,
_tiled_best; ledger.faithful.megatron.heaviest says how its parts are fast).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ledger.faithful.megatron.activations import check_recompute, recompute_of
from ledger.faithful.megatron.buffers import (argmax_rank, best_rank, bucket_shares, Buffer, buffer, buffer_bytes,
                                              effective_bucket_size, owned_per_rank, owned_sizes, ranks_of_shares,
                                              tiled_ranks)
from ledger.faithful.megatron.comm import comm
from ledger.faithful.megatron.heaviest import (chunk_bound, chunk_buckets, chunk_contiguous, class_bound, most_loaded,
                                               pattern, pattern_cum, stage_class, stage_summaries, stage_totals)
from ledger.faithful.megatron.knobs import dtypes, Knobs, knobs, optim_weights
from ledger.faithful.megatron.peak import PEAK_NOTES, stage_peak
from ledger.faithful.megatron import cp as megatron_cp
from ledger.faithful.megatron import target as megatron_target
from ledger.faithful.megatron.pipeline import padded_shape, stage_layers, stage_shape
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict
from ledger.placement import Placement, RankState
from ledger.optim import add_adamw, adamw_bytes


# -- a stage's buffers and the most-loaded rank --------------------------------------------------
def stage_buffers(model: ModelShape, lay: Layout, fw, stage: int) -> list[Buffer]:
    """One DDP (so one buffer per (param, grad) dtype) per model chunk: vp of them with interleaving,
    chunk 0 first."""
    return list(_stage_buffers(model, lay.tp, lay.pp, lay.dp, lay.vp, knobs(fw), stage))


@lru_cache(maxsize=4096)
def _stage_buffers(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int) -> tuple[Buffer, ...]:
    return tuple(buffer(model, tp, *stage_shape(model, pp, stage, vp, ch, k.pp_split),
                        effective_bucket_size(k, dp, stage, ch), dp, k.use_distributed_optimizer) for ch in range(vp))


@lru_cache(maxsize=1024)
def _heaviest_rank(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs) -> tuple[int, int, int, int]:
    """(stage, DP rank, its owned elements, its owned pieces) of the most-loaded rank: TP ranks of a
    stage hold equal shapes, stages between the first and the last hold equal buffers (the lowest
    such stage stands for them). Layouts of a search that differ only by micro-batch or SP share it."""
    _, _, pb, gb = dtypes(k)
    dist_opt = k.use_distributed_optimizer
    w = optim_weights(k)

    def exact(st):  # class_bound of a stage from its chunks' summaries (exact fixed bytes)
        return class_bound(stage_totals(stage_summaries(model, tp, pp, dp, vp, k, st)), dist_opt, pb, gb, *w)

    def best(st):
        if dist_opt:
            return _stage_best(model, tp, pp, dp, vp, k, st)
        # every DP rank owns every param (_owned_by): rank 0 stands for all (bounds count them exactly)
        return (0, *stage_totals(stage_summaries(model, tp, pp, dp, vp, k, st))[1:3])

    classes = []
    for st in sorted({0, min(1, pp - 1), pp - 1}):
        # every stage but the last bounded before its summary (the first's is a bucket walk); the
        # last, which adds the output layer, is the usual heaviest and its summary read then anyway
        if st < pp - 1:
            bounds = [chunk_bound(model, tp, *stage_shape(model, pp, st, vp, ch, k.pp_split),
                                  effective_bucket_size(k, dp, st, ch), dp, dist_opt) for ch in range(vp)]
            classes.append((st, class_bound(stage_totals(bounds), dist_opt, pb, gb, *w)[1], None))
        else:
            fixed, ub = exact(st)
            classes.append((st, ub, fixed))
    return most_loaded(classes, exact, best, *w)


def _stage_best(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, st: int) -> tuple[int, int, int]:
    """(heaviest DP rank, its owned elements, its owned pieces) of a stage (dist-opt): a contiguous
    stage from its chunks' patterns (_one_bucket_best where every chunk is one bucket, else their
    param offsets and bucket walks: _tiled_best, tiled_ranks), without building the buffers;
    otherwise from the buffers (best_rank)."""
    w = optim_weights(k)
    shapes = [stage_shape(model, pp, st, vp, ch, k.pp_split) for ch in range(vp)]
    if not all(chunk_contiguous(model, tp, first, last) for _, first, last in shapes):
        return best_rank(_stage_buffers(model, tp, pp, dp, vp, k, st), dp, *w)
    parts = [pattern(model, tp, first, last, True) for _, first, last in shapes]
    sums = stage_summaries(model, tp, pp, dp, vp, k, st)
    if all(x[4] == 1 for x in sums) and len({n for n, _, _ in shapes}) == 1:  # (account_for_*: one layer fewer)
        chunks = [(head, tail, x[0]) for (head, _, tail), x in zip(parts, sums)]
        return _one_bucket_best(parts[0][1], shapes[0][0], chunks, dp, *w)
    if vp == 1:
        (layers, first, last), = shapes
        return _tiled_best(pattern_cum(parts[0], layers), *chunk_buckets(
            model, tp, layers, first, last, effective_bucket_size(k, dp, st, 0), dp, True), dp, *w)
    e = p = 0
    for ch, ((layers, first, last), part) in enumerate(zip(shapes, parts)):  # one buffer per chunk
        ce, cp = tiled_ranks(pattern_cum(part, layers), *chunk_buckets(
            model, tp, layers, first, last, effective_bucket_size(k, dp, st, ch), dp, True), dp)
        e, p = e + ce, p + cp
    return argmax_rank(e, p, *w)


def _one_bucket_best(layer: tuple, layers: int, chunks, dp: int, w_elem: int, w_piece: int) -> tuple[int, int, int]:
    """tiled_ranks' heaviest DP rank, its elements and pieces summed over a contiguous stage's
    chunks ((head run, tail run, numel) each, all holding `layers` copies of the run `layer`: a
    stage's chunks do, stage_shape, pattern) when every chunk is one bucket, without the per-rank
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
    """The argmax over tiled_ranks' ranks (rank, elements, pieces) for one buffer, without the
    per-rank arrays where every rank but the last owns a full DP range of every bucket (the ranks
    below each bucket's real // S): those own the same elements and differ only by their pieces (one
    per bucket plus the param starts strictly inside their ranges), so the lowest with the most
    starts inside wins among them; the last rank's share is evaluated on its own. Otherwise from
    tiled_ranks' arrays."""
    nb = len(first)
    if not nb:
        return argmax_rank(*tiled_ranks(cum, first, bstart, bend, dp), w_elem, w_piece)
    size, real, inner = bucket_shares(cum, first, bstart, bend, dp)
    if int((real // size).min()) < dp - 1:
        return argmax_rank(*ranks_of_shares(size, real, inner, dp), w_elem, w_piece)
    best = None  # (bytes, rank, elements, pieces)
    if dp > 1:
        d, n = int(inner[:dp - 1].argmax()), int(size.sum())
        best = (w_elem * n + w_piece * (nb + int(inner[d])), d, n, nb + int(inner[d]))
    left = real - (dp - 1) * size  # the last rank's elements of each bucket (0 to its range)
    n, pieces = int(left.sum()), int((left > 0).sum()) + int(inner[dp - 1])
    if best is None or w_elem * n + w_piece * pieces > best[0]:
        best = (0, dp - 1, n, pieces)
    return best[1:]


# -- one rank ------------------------------------------------------------------------------------
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
    base = _fixed_state(model, lay.tp, lay.pp, lay.dp, lay.vp, k, stage_class(lay.pp, stage), dp_rank)
    s = RankState(stage=stage, params_bytes=base.params_bytes, grads_bytes=base.grads_bytes,
                  optim_bytes=base.optim_bytes, other_bytes=base.other_bytes, detail=dict(base.detail))
    act = 2 if k.precision == "bf16" else 4
    mpu = mpu_numel(model, lay, k.transformer_impl, stage)
    if mpu:
        s.add("other_bytes", "global memory buffer (mpu)", act * mpu)
    s.comm_fn = lambda: comm(model, lay, k, stage)
    # the peak within a step (peak.stage_peak), built on first read; Adam's state (exp_avg,
    # exp_avg_sq, step) is what the first step does not hold before its optimizer step
    adam = adamw_bytes(s.detail)
    s.peak = lambda: stage_peak(model, lay, k, stage, dp_rank, s.totals(), adam)
    if k.overlap_param_gather and lay.dp > 1:
        # the first step gathers no params (training.py train(): forward pre-hooks disabled for the
        # first iteration, see _fixed_comm): steady state less its DP all-gathers (the param gathers,
        # the only DP all-gathers); both built on first read
        s.comm_first = lambda: [c for c in s.comm if (c.dim, c.kind) != ("dp", "all_gather")]
    return s


def mpu_numel(model: ModelShape, lay: Layout, impl: str, stage: int) -> int:
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
    pdt, gdt, pb, gb = dtypes(k)
    dist_opt = k.use_distributed_optimizer
    # from the buffers' summaries: no buffer built for the most-loaded rank
    numel, real = stage_totals(stage_summaries(model, tp, pp, dp, vp, k, stage))[:2]
    p_bytes, g_bytes = buffer_bytes(numel, real, dist_opt, pb, gb)
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
    add_adamw(s, owned_numel, owned_pieces)
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


def _dp_classes(model: ModelShape, lay: Layout, k: Knobs):
    """(stage, DP rank) -> what tells the DP rank's state apart from its stage's others, so that the
    DP ranks of a class share one RankState (a prediction's size follows its classes, not the world):
    without the distributed optimizer nothing (every rank keeps every param: _owned_by); with it, the
    elements and param pieces its shard owns (_fixed_state's only input from the DP rank) under the
    TransformerEngine spec, whose peak no shard changes (peak.optimizer_moments); under the local spec
    the DP rank itself, whose Adam transients follow the params its shard holds."""
    if not k.use_distributed_optimizer:
        return lambda stage, d: 0
    if k.transformer_impl != "transformer_engine":
        return lambda stage, d: d
    owned: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def of(stage: int, d: int):
        c = stage_class(lay.pp, stage)  # stages between the first and the last hold equal buffers
        if c not in owned:
            owned[c] = owned_per_rank(_stage_buffers(model, lay.tp, lay.pp, lay.dp, lay.vp, k, c), lay.dp)
        e, p = owned[c]
        return int(e[d]), int(p[d])
    return of


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


def place(model: ModelShape, lay: Layout, fw, target: str | None = None) -> Placement:
    """The Placement of a dense model; target: the run its peak is for (ledger/target.py; None: the spec's,
    target.of)."""
    # what this ledger does not model is refused, naming the field (textbook mode still predicts it)
    if lay.cp > 1:
        # TransformerEngine's context parallelism, from sources (cp.py): the same ranks without CP on
        # s / cp tokens at dp x cp, with TE's K/V ring
        k = megatron_target.with_target(knobs(fw), fw, target)
        megatron_cp.check(model, lay, k, fw)
        return megatron_cp.place(model, lay, fw, target, place, lambda stage: _stage_layers(model, lay, k, stage))
    if lay.dp_replicate > 1:
        raise ConfigError("megatron: dp_replicate (HSDP) is a torchtitan layout")
    k = megatron_target.with_target(knobs(fw), fw, target)
    megatron_target.check(k)
    check_framework(k)
    check_interleaving(lay)
    check_recompute(recompute_of(k))
    tp, dp = lay.tp, lay.dp
    notes = list(NOTES[k.transformer_impl]) + list(PEAK_NOTES[k.transformer_impl])
    # every rule below sees the shape Megatron trains: the embedding, the output layer and the tied
    # word-embedding grads hold the padded vocab (the record keeps the configured shape)
    trained = padded_shape(model, tp, k.make_vocab_size_divisible_by)
    if trained.vocab != model.vocab:  # (an equal shape from the cache may be another object)
        notes.append(f"vocab {model.vocab} padded to {trained.vocab} rows (a multiple of "
                     f"make_vocab_size_divisible_by={k.make_vocab_size_divisible_by} x tp={tp}: Megatron's "
                     "tokenizers/utils/build_tokenizer.py vocab_size_with_padding)")
    cache: dict[tuple, RankState] = {}
    dp_class = _dp_classes(trained, lay, k)

    def state(rank: int) -> RankState:
        # Layout.grid order tp, cp, dp, dp_replicate, pp with cp = dp_replicate = 1 (refused above)
        stage, d = rank // (tp * dp), rank // tp % dp
        key = (stage, dp_class(stage, d))
        s = cache.get(key)
        if s is None:
            s = cache[key] = rank_state(trained, lay, k, stage, d)
        return s

    st, d, _, _ = _heaviest_rank(trained, tp, lay.pp, dp, lay.vp, k)
    reps = [(st * dp + d) * tp]
    last = lay.pp - 1
    impl = k.transformer_impl
    if st != last and mpu_numel(trained, lay, impl, last) > mpu_numel(trained, lay, impl, st):
        # the TE spec's "mpu" buffer is on the last stage alone (mpu_numel): its heaviest DP rank (the
        # buffer is the same on each) may outweigh the heaviest rank of the fixed state
        dl = _stage_best(trained, tp, lay.pp, dp, lay.vp, k, last)[0] if k.use_distributed_optimizer else 0
        reps = sorted(reps + [(last * dp + dl) * tp])  # per_gpu: the first on ties, as over every rank
    best_dp: dict[int, int] = {}

    def stage_reps(stage: int) -> list[int]:
        # a stage's TP ranks hold equal shapes and its DP ranks equal buffers and other bytes: they
        # differ by their optimizer shard alone, whose heaviest DP rank _stage_best finds; stages between
        # the first and the last share it (stage_class)
        c = stage_class(lay.pp, stage)
        if c not in best_dp:
            best_dp[c] = _stage_best(trained, tp, lay.pp, dp, lay.vp, k, c)[0] if k.use_distributed_optimizer else 0
        return [(stage * dp + best_dp[c]) * tp]

    return Placement(framework="megatron", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                     world=lay.world, rank_state=state, representatives=reps, notes=notes,
                     stage_representatives=stage_reps, spec=k.transformer_impl, target=megatron_target.of(k),
                     workspaces=megatron_target.workspaces(k))


def _stage_layers(model: ModelShape, lay: Layout, k, stage: int) -> int:
    """The decoder layers of a pipeline stage, over its virtual chunks (pipeline.stage_layers)."""
    return sum(stage_layers(model.layers, lay.pp, lay.vp, stage, ch, k.pp_split) for ch in range(lay.vp))


_BUFFERS_NOTE = ("megatron-core 0.18.0: DDP buffers padded as distrib_optimizer.py _compute_per_buffer_param_layout; "
                 "master/Adam per DP byte range")
NOTES = {
    "local": (_BUFFERS_NOTE, "transformer_impl=local: the local spec's DotProductAttention keeps a "
              "[b*heads/tp, s, s] score buffer in GlobalMemoryBuffer (other); TransformerEngine's fused attention "
              "does not"),
    "transformer_engine": (_BUFFERS_NOTE, "transformer_impl=transformer_engine: no attention-score buffer in other "
                           "(TEDotProductAttention), only the output layer's SP all-gather on the last stage; "
                           "parameters in the local spec's order (TE's fused layer_norm_weight of linear_qkv / "
                           "linear_fc1 order, its workspaces and fp8 state are not modelled; no run here confirms TE)"),
}
