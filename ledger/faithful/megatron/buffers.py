"""A Megatron Core 0.18.0 pipeline stage's parameters and its DDP buffers (ledger.faithful.megatron.states's
first half): which parameters a stage (model chunk) holds in GPTModel order, how
distributed/param_and_grad_buffer.py lays them out in padded buckets, which byte ranges each DP rank
owns under the distributed optimizer, and which DP rank owns the most. Each rule names the megatron
source it follows (paths under megatron/core/ unless said otherwise).

Speed (a layout search predicts thousands of layouts): a chunk's summary (_chunk_summary) is the
bucket walk over one layer's parameter pattern, no per-param arrays (a chunk of one bucket: its
pattern's totals, _pattern_totals); bucket runs repeat across identical layers (_walk_buckets copies
them); a stage is bounded without its bucket walk (_chunk_bound); summaries and bounds are cached per
chunk shape (the stages of a structure share them); a buffer without alignment padding gives every
DP rank's ownership in closed form (_contiguous_ranks, _tiled_ranks), else _best_rank evaluates them.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ledger.model import ModelShape


# -- the parameters of one pipeline stage -----------------------------------------------------------
def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """The rows of the embedding and output layer that Megatron-LM builds for a vocab of `vocab`
    tokens: pretrain_gpt.py (gpt_builders.py) builds GPTModel with args.padded_vocab_size, which
    megatron/core/tokenizers/utils/build_tokenizer.py _set_padded_vocab_size sets (pad_vocab_size
    defaults True) to vocab_size_with_padding: the vocab rounded up to a multiple of
    make_vocab_size_divisible_by * tensor_model_parallel_size (NullTokenizer's vocab_size is
    --vocab-size itself). The padded rows are real parameters: every vocab-sized state counts them."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


@lru_cache(maxsize=256)
def padded_shape(model: ModelShape, tp: int, divisible_by: int) -> ModelShape:
    """The shape Megatron trains: `model` with its vocab padded (padded_vocab); `model` itself when the
    vocab needs no padding. Cached: a search's layouts of one tp share one shape (and its cached hash)."""
    vocab = padded_vocab(model.vocab, tp, divisible_by)
    return model if vocab == model.vocab else dataclasses.replace(model, vocab=vocab)


@lru_cache(maxsize=256)
def _pieces(model: ModelShape, tp: int) -> tuple[tuple, tuple, tuple]:
    """(embedding, one decoder layer, final norm + output) as (name, local numel) in
    GPTModel.named_parameters() order; layer names are suffixes of decoder.layers.<i>.

    models/gpt/gpt_model.py GPTModel.__init__: embedding (pre_process), decoder, output_layer
    (post_process, untied); transformer/transformer_layer.py registers input_layernorm,
    self_attention, pre_mlp_layernorm, mlp; transformer/attention.py: Attention.__init__ builds
    linear_proj before SelfAttention.__init__ builds linear_qkv; transformer/mlp.py: linear_fc1
    (2*ffn when gated) then linear_fc2. Column-parallel weights split dim 0, row-parallel dim 1;
    a row-parallel bias is not split (tensor_parallel/layers.py RowParallelLinear)."""
    h, hd = model.hidden, model.head_dim

    def norm(name):  # a LayerNorm is two tensors (weight, bias) of h each
        return [(f"{name}.weight", h), (f"{name}.bias", h)] if model.norm == "layernorm" else [(f"{name}.weight", h)]

    def hnorm(name):  # a per-head norm: head_dim elements per tensor
        return [(f"{name}.weight", hd), (f"{name}.bias", hd)] if model.norm == "layernorm" else [(f"{name}.weight", hd)]

    def lin(name, out_f, in_f, bias_len):
        return [(f"{name}.weight", out_f * in_f)] + ([(f"{name}.bias", bias_len)] if model.bias else [])

    qkv = (model.heads + 2 * model.kv_heads) * hd // tp
    fc1 = (2 if model.swiglu else 1) * model.ffn_hidden // tp
    # transformer/attention.py SelfAttention.__init__: q_layernorm and k_layernorm (over head_dim, not
    # split by tp) after linear_qkv (qk_layernorm)
    qk = (hnorm("self_attention.q_layernorm") + hnorm("self_attention.k_layernorm")) if model.qk_layernorm else []
    layer = (norm("input_layernorm") + lin("self_attention.linear_proj", h, model.heads * hd // tp, h)
             + lin("self_attention.linear_qkv", qkv, h, qkv) + qk + norm("pre_mlp_layernorm")
             + lin("mlp.linear_fc1", fc1, h, fc1) + lin("mlp.linear_fc2", h, model.ffn_hidden // tp, h))
    emb = [("embedding.word_embeddings.weight", model.vocab // tp * h)]
    head = norm("decoder.final_layernorm") + [("output_layer.weight", model.vocab // tp * h)]
    return tuple(emb), tuple(layer), tuple(head)


# the pipeline split: (num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage,
# account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split) of TransformerConfig
# (Megatron-LM --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers,
# --account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split); None, None = even
EVEN_SPLIT = (None, None, False, False)


def split_error(layers: int, pp: int, vp: int, split: tuple = EVEN_SPLIT) -> str | None:
    """Megatron's own reason for refusing this split of `layers` over pp stages of vp chunks, None
    where it builds it: transformer/transformer_config.py TransformerConfig.__post_init__ (uneven PP,
    account_for_*), else transformer/transformer_block.py get_num_layers_to_build's asserts (an even
    split; Megatron-LM's training/arguments.py validate_args asserts the same divisibility)."""
    first, last, emb, loss = split
    v = vp if vp > 1 else None  # virtual_pipeline_model_parallel_size (None without interleaving)
    if (first is not None or last is not None) and (emb or loss):
        return ("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be set at the "
                "same time with account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split")
    if first is not None or last is not None:
        n, stages = layers, pp
        for x, where in ((first, "first"), (last, "last")):
            if x is None:
                continue
            if x <= 0:
                return f"num_layers_in_{where}_pipeline_stage must be larger than 0"
            if v is not None and x % v:
                return (f"number of layers at {where} stage: {x} must be divisible by virtual pipeline parallel "
                        f"degree {v}")
            n, stages = n - x, stages - 1
        if bool(n) != bool(stages):
            return f"Mismatch: {n} middle layers remaining but {stages} middle PP stages available."
        if stages and n % stages:
            return (f"number of layers at middle stage: {n} must be divisible by the middle pipeline model "
                    f"parallel size {stages}")
        if stages and v is not None and (n // stages) % v:
            return (f"number of layers on each middle pipeline rank: {n // stages} must be divisible by virtual "
                    f"pipeline parallel degree {v}")
        return None
    n = layers + emb + loss
    if (emb or loss) and v is None and n % pp:
        return f"number of middle layers: {n} must be divisible by middle pipeline_model_parallel_size {pp}"
    if (emb or loss) and n % pp:
        return (f"num_layers: {n} after enable account_for_embedding_in_pipeline_split or "
                f"account_for_loss_in_pipeline_split must be divisible by pipeline_model_parallel_size {pp}")
    if (emb or loss) and v is not None and (n // pp) % v:
        return (f"number of layers on each pipeline rank: {n // pp} (after enable "
                "account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split) must be divisible "
                f"by virtual_pipeline_model_parallel_size {v}")
    if n % pp:
        return f"num_layers={n} should be divisible by config.pipeline_model_parallel_size={pp}"
    if v is not None and pp > 1 and (n // pp) % v:
        return f"num_layers_per_pipeline_rank {n // pp} should be divisible by vp_size {v}"
    return None  # (its "Not enough layers" asserts cannot fire then: each chunk's share is >= 1)


def stage_layers(layers: int, pp: int, vp: int, stage: int, chunk: int, split: tuple = EVEN_SPLIT) -> int:
    """Decoder layers model chunk `chunk` of stage `stage` builds: transformer/transformer_block.py
    get_num_layers_to_build (a valid split, split_error). Uneven PP: the first (last) stage builds
    num_layers_in_first (last)_pipeline_stage, the middle stages share the rest evenly; else the layers
    plus one for each of the embedding / the loss counted in the split (account_for_*) shared evenly,
    and the stage holding it builds one fewer. With vp > 1 each chunk a stage's layers / vp."""
    first, last, emb, loss = split
    if first is not None or last is not None:
        mid = layers - (first or 0) - (last or 0)
        stages = pp - (first is not None) - (last is not None)
        n = mid // stages if stages > 0 else 0
        if stage == 0 and first is not None:
            n = first
        if stage == pp - 1 and last is not None:
            n = last
    else:
        n = (layers + emb + loss) // pp
    if vp > 1 and pp > 1:
        n //= vp
    if emb and stage == 0 and chunk == 0:
        n -= 1
    if loss and stage == pp - 1 and chunk == vp - 1:
        n -= 1
    return n


def _stage_shape(model: ModelShape, pp: int, stage: int, vp: int, chunk: int,
                 split: tuple = EVEN_SPLIT) -> tuple[int, bool, bool]:
    """(layers, holds the embedding, holds the output) of one model chunk of one stage.

    training/training.py get_model: with vp > 1 each stage builds vp GPTModels, each of its share of
    the layers (stage_layers); pre_process (embedding) only on chunk 0 of stage 0, post_process
    (final norm, output layer) only on chunk vp-1 of the last stage (pipeline_parallel/utils.py
    is_vp_first_stage / is_vp_last_stage)."""
    return (stage_layers(model.layers, pp, vp, stage, chunk, split), stage == 0 and chunk == 0,
            stage == pp - 1 and chunk == vp - 1)


def _head(model: ModelShape, tp: int, first: bool) -> tuple:
    """The final norm and output layer of the chunk holding post_process.

    Tied embeddings (share_embeddings_and_output_weights): models/gpt/gpt_model.py builds
    output_layer with skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
    so the chunk that also holds the embedding (pp=1) has no output_layer.weight (the output
    projection uses embedding.word_embeddings.weight); a last stage without the embedding
    (pp > 1) allocates its own copy (models/common/language_module/language_module.py
    setup_embeddings_and_output_layer: zeroed, then all-reduced with the first stage at init)."""
    head = _pieces(model, tp)[2]
    return head[:-1] if model.tied_embeddings and first else head


def shared_embedding(model: ModelShape, pp: int, stage: int, vp: int, chunk: int) -> tuple[bool, bool]:
    """(the embedding weight, the output weight) of this chunk marked `shared_embedding`:
    language_module.py setup_embeddings_and_output_layer, tied embeddings with pp > 1 only (the
    first stage's word embeddings, the last stage's duplicated output weight)."""
    if not model.tied_embeddings or pp == 1:
        return False, False
    _, first, last = _stage_shape(model, pp, stage, vp, chunk)
    return first, last


def stage_params(model: ModelShape, tp: int, pp: int, stage: int, vp: int = 1, chunk: int = 0,
                 split: tuple = EVEN_SPLIT) -> list[tuple[str, int]]:
    """(name, local numel) in GPTModel.named_parameters() order for one PP stage (model chunk `chunk`
    of vp with interleaving) and TP rank."""
    n, first, last = _stage_shape(model, pp, stage, vp, chunk, split)
    emb, layer, _ = _pieces(model, tp)
    out = list(emb) if first else []
    out += [(f"decoder.layers.{i}.{name}", k) for i in range(n) for name, k in layer]
    return out + (list(_head(model, tp, first)) if last else [])


@lru_cache(maxsize=1024)
def _sizes(model: ModelShape, tp: int, layers: int, first: bool, last: bool) -> np.ndarray:
    """stage_params' numels as an array (read-only; one per distinct stage shape)."""
    emb, layer, head = _piece_sizes(model, tp, first)
    a = np.concatenate(([emb] if first else []) + [np.tile(layer, layers)] + ([head] if last else []))
    a.flags.writeable = False
    return a


@lru_cache(maxsize=256)
def _piece_sizes(model: ModelShape, tp: int, first: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_pieces' numels as arrays (embedding, one layer, the head of a chunk that holds the embedding
    or not): shared by the stage shapes of one tp."""
    emb, layer, _ = _pieces(model, tp)
    return tuple(np.array([k for _, k in part], np.int64) for part in (emb, layer, _head(model, tp, first)))


# -- DDP buffer layout ---------------------------------------------------------------------------
# optimizer/param_layout.py, the distributed optimizer's padding: pad_param_start aligns every param
# start to 64 elements, pad_bucket_end pads every bucket end to lcm(dp, 128) elements
# (pad_buckets_for_high_nccl_busbw off)
PARAM_ALIGN = 64


def _aligned(n):
    """n elements (an int or an array) rounded up to the next param start (PARAM_ALIGN)."""
    return -(-n // PARAM_ALIGN) * PARAM_ALIGN


def _bucket_unit(dp: int) -> int:
    """The multiple every bucket end is padded to (pad_bucket_end)."""
    return math.lcm(dp, 128)


@dataclass(frozen=True, eq=False)
class Buffer:
    """One DDP buffer: params in reverse (backprop) order at [starts, ends) of the (padded) buffer,
    bucket b spanning [bstart[b], bend[b])."""
    starts: np.ndarray
    ends: np.ndarray
    bstart: np.ndarray
    bend: np.ndarray
    first: np.ndarray  # index (in buffer order) of each bucket's first param
    prefix: np.ndarray  # prefix[i] = elements of params before i (buffer order)
    n: np.ndarray  # each param's elements (ends - starts)
    contiguous: bool = False  # each bucket's params tile it from its start (no alignment padding between)

    @property
    def numel(self) -> int:
        return int(self.bend[-1]) if len(self.bend) else 0


@lru_cache(maxsize=1024)
def _buffer(model: ModelShape, tp: int, layers: int, first: bool, last: bool, bucket_size, dp: int,
            dist_opt: bool) -> Buffer:
    shared = _shared(model, first, last, dist_opt)
    # in backprop order the head's params come first, then `layers` reversed copies of one layer
    period = (len(_head(model, tp, first)) if last else 0, len(_pieces(model, tp)[1]), layers)
    return build_buffer(_sizes(model, tp, layers, first, last), bucket_size, dp, dist_opt,
                        shared_first=shared and first, shared_last=shared and last, period=period)


def _shared(model: ModelShape, first: bool, last: bool, dist_opt: bool) -> bool:
    """Whether a chunk's buffer holds a `shared_embedding` param in a bucket of its own (build_buffer):
    a chunk holding the embedding or the output layer (never both with pp > 1) of a tied model with
    pp > 1 (shared_embedding()); pp = 1 holds both, marks none."""
    return dist_opt and model.tied_embeddings and first != last


def build_buffer(sizes: np.ndarray, bucket_size: int | None, dp: int, dist_opt: bool,
                 shared_first: bool = False, shared_last: bool = False,
                 period: tuple[int, int, int] | None = None) -> Buffer:
    """Params in reverse (backprop) order into buckets.

    Distributed optimizer: optimizer/distrib_optimizer.py _compute_per_buffer_param_layout with
    optimizer/param_layout.py pad_param_start and pad_bucket_end (PARAM_ALIGN, _bucket_unit,
    _pad_bucket_end); a bucket closes at the first param whose end reaches bucket_size elements past
    the bucket start. Otherwise distributed/param_and_grad_buffer.py
    _compute_default_per_buffer_param_layout: no padding.
    Every param start is 64-aligned and so is every bucket start (lcm(dp, 128)), hence a param
    starts at its bucket's start plus the aligned sizes of the params before it in the bucket.
    shared_first / shared_last: the first / last param of `sizes` (stage order) is a
    `shared_embedding` param, which _compute_per_buffer_param_layout (_does_param_require_new_bucket)
    puts in a bucket of its own, even without bucketing (bucket_size None): the bucket before it
    closes (padded) and it closes its own.
    period (start, k, repeats): params [start, start + k*repeats) of backprop order repeat one
    k-param pattern (identical layers). Where a bucket starts at the same place in the pattern as an
    earlier one, the buckets between repeat (a bucket's end depends only on the sizes from its start,
    and every bucket start is a multiple of the padding unit), so whole periods are copied instead of
    searched (the same buckets as without `period`; tested)."""
    n = np.ascontiguousarray(sizes[::-1], dtype=np.int64)
    a = _aligned(n) if dist_opt else n  # each start aligned: the aligned sizes
    div = _bucket_unit(dp)
    P = len(n)
    prefix = np.zeros(P + 1, np.int64)
    np.cumsum(n, out=prefix[1:])
    cum = np.zeros(P + 1, np.int64)
    np.cumsum(a, out=cum[1:])
    reach = cum[:-1] + n
    first, bstart, bend = _walk_buckets(P, lambda j: int(cum[j]), lambda i: int(reach[i]),
                                        lambda x: int(np.searchsorted(reach, x)), bucket_size, div, dist_opt,
                                        shared_first, shared_last, period)
    counts = np.diff(np.append(first, P))
    starts = np.repeat(bstart - cum[first], counts) + cum[:-1]
    return Buffer(starts=starts, ends=starts + n, bstart=bstart, bend=bend, first=first,
                  prefix=prefix, n=n, contiguous=not dist_opt or bool((a == n).all()))


def _walk_buckets(P: int, cum, reach, first_reaching, bucket_size: int | None, div: int, dist_opt: bool,
                  shared_first: bool, shared_last: bool, period):
    """build_buffer's bucket rule over params 0..P-1 of backprop order: (first param, start, padded
    end) of each bucket. cum(j): aligned elements before param j; reach(i): cum(i) plus param i's
    elements; first_reaching(x): the lowest i with reach(i) >= x (P if none). Given as functions so
    that a chunk's buckets can be walked without its per-param arrays (_chunk_buckets)."""
    if P and bucket_size is None and not (shared_first or shared_last):
        # one bucket (every stage but the first, or no overlap_grad_reduce): the loop's single step
        # (j = 0, i = P - 1) without its bookkeeping
        end = _pad_bucket_end(reach(P - 1) - cum(0), div, dist_opt)
        return _ZERO, _ZERO, np.array([end], np.int64)
    firsts, bstarts, bends = [], [], []
    j, b0 = 0, 0
    seen = {} if period is not None and bucket_size is not None else None  # place in the pattern -> bucket
    blocks = []  # (first, bstart, bend) rows of the buckets before the lists, in order
    while j < P:
        if seen is not None and period[0] <= j < period[0] + period[1] * period[2]:
            at = (j - period[0]) % period[1]
            if at not in seen:
                seen[at] = (len(firsts), j, b0)
            else:  # buckets [b, now) cover params [pj, j): copy them while whole periods fit
                b, pj, pb0 = seen[at]
                dj, dpos = j - pj, b0 - pb0
                q = (period[0] + period[1] * period[2] - j) // dj
                block = np.array((firsts[b:], bstarts[b:], bends[b:]), np.int64)
                shift = np.array((dj, dpos, dpos), np.int64)[:, None, None] * np.arange(1, q + 1)[None, :, None]
                blocks += [np.array((firsts, bstarts, bends), np.int64).reshape(3, -1),
                           (block[:, None, :] + shift).reshape(3, -1)]
                firsts, bstarts, bends = [], [], []
                j, b0 = j + q * dj, b0 + q * dpos
                seen = None
                continue
        if shared_last and j == 0:  # the output weight, first in backprop order
            i = 0
        elif bucket_size is None:
            i = P - 1
        else:
            i = min(first_reaching(cum(j) + bucket_size), P - 1)
        if shared_first and i == P - 1 and j < P - 1:  # the embedding, last in backprop order
            i = P - 2
        pend = b0 + reach(i) - cum(j)
        end = _pad_bucket_end(pend, div, dist_opt)
        firsts.append(j)
        bstarts.append(b0)
        bends.append(end)
        j, b0 = i + 1, end
    tail = np.array((firsts, bstarts, bends), np.int64).reshape(3, -1)
    return np.concatenate(blocks + [tail], axis=1) if blocks else tail


def _pad_bucket_end(end: int, div: int, dist_opt: bool) -> int:
    """A bucket's end (its params' last element) padded to a multiple of div = _bucket_unit(dp):
    pad_bucket_end (distributed optimizer; none otherwise)."""
    return -(-end // div) * div if dist_opt else end


_ZERO = np.zeros(1, np.int64)
_ZERO.flags.writeable = False


@dataclass
class Bucket:
    start: int
    end: int  # padded end
    params: list[tuple[str, int, int]]  # (name, start, end) in buffer coordinates

    @property
    def numel(self) -> int:
        return self.end - self.start


def buffer_layout(params: list[tuple[str, int]], bucket_size: int | None, dp: int, dist_opt: bool,
                  shared_first: bool = False, shared_last: bool = False) -> list[Bucket]:
    """build_buffer with names: the buckets and (name, start, end) of their params."""
    buf = build_buffer(np.array([k for _, k in params], np.int64), bucket_size, dp, dist_opt, shared_first,
                       shared_last)
    names = [name for name, _ in reversed(params)]
    st, en = buf.starts.tolist(), buf.ends.tolist()
    lims = buf.first.tolist() + [len(names)]
    return [Bucket(int(buf.bstart[b]), int(buf.bend[b]),
                   [(names[i], st[i], en[i]) for i in range(lims[b], lims[b + 1])]) for b in range(len(lims) - 1)]


def effective_bucket_size(fw, dp: int, stage: int, chunk: int = 0) -> int | None:
    """distributed/distributed_data_parallel.py DistributedDataParallel.__init__: default
    max(40M, 1M*dp); None (one bucket) without overlap_grad_reduce or on PP stages after the first;
    training/training.py get_model: disable_bucketing for model chunks after the first (vp > 1)."""
    if not fw.overlap_grad_reduce or stage > 0 or chunk > 0:
        return None
    return fw.bucket_size if fw.bucket_size is not None else max(40_000_000, 1_000_000 * dp)


def shard_ranges(buckets: list[Bucket], dp: int, dp_rank: int) -> list[tuple[str, int]]:
    """(param name, elements) this DP rank owns: optimizer/distrib_optimizer.py
    _build_model_gbuf_range splits each (padded) bucket into dp equal ranges;
    _build_model_gbuf_param_range_map keeps each param's non-empty intersection."""
    out = []
    for b in buckets:
        size = b.numel // dp
        lo, hi = b.start + dp_rank * size, b.start + (dp_rank + 1) * size
        for name, s, e in b.params:
            k = min(e, hi) - max(s, lo)
            if k > 0:
                out.append((name, k))
    return out


def _covered(buf: Buffer, x: np.ndarray) -> np.ndarray:
    """Param elements of the buffer below position x (x an array)."""
    k = np.searchsorted(buf.starts, x, "right") - 1
    kk = np.maximum(k, 0)
    return np.where(k >= 0, buf.prefix[kk] + np.minimum(x - buf.starts[kk], buf.n[kk]), 0)


def _owned(buf: Buffer, bucket: np.ndarray, rank: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """(elements, param pieces) DP rank rank[j] owns of bucket bucket[j] (shard_ranges, counted)."""
    size = (buf.bend[bucket] - buf.bstart[bucket]) // dp
    lo = buf.bstart[bucket] + rank * size
    hi = lo + size
    numel = _covered(buf, hi) - _covered(buf, lo)
    pieces = np.searchsorted(buf.starts, hi, "left") - np.searchsorted(buf.ends, lo, "right")
    return numel, pieces


def owned_sizes(buffers, dp: int, dp_rank: int) -> tuple[int, int]:
    """(elements, param pieces) of shard_ranges over every bucket of `buffers` for one DP rank."""
    return _owned_sizes(tuple(buffers), dp, dp_rank)


@lru_cache(maxsize=4096)
def _owned_sizes(buffers: tuple[Buffer, ...], dp: int, dp_rank: int) -> tuple[int, int]:
    numel = pieces = 0
    for buf in buffers:
        nb = len(buf.bstart)
        e, p = _owned(buf, np.arange(nb), np.full(nb, dp_rank, np.int64), dp)
        numel += int(e.sum())
        pieces += int(p.sum())
    return numel, pieces


def _most_loaded(classes: list, exact, stage_best, w_elem: int, w_piece: int) -> tuple[int, int, int, int]:
    """(stage, DP rank, its owned elements, its owned pieces) of the most-loaded rank among stage
    classes ((stage, upper bound, fixed bytes or None) each; exact(stage): (fixed bytes, upper bound)
    from its summaries; stage_best(stage): its heaviest DP rank's (rank, elements, pieces)), the lowest
    stage and DP rank on ties, comparing only what differs between them (_buffer_bytes, _owned_by;
    optimizer bytes are w_elem per owned element and w_piece per owned piece).

    Best first: the class of the highest bound comes next; a bound without fixed bytes (_chunk_bound,
    no bucket walk) is replaced by its summaries' (_class_bound) before its DP ranks are searched. A
    class whose bound is below a value already found cannot hold the most-loaded rank: its DP ranks
    are not searched and, where its bound came from _chunk_bound, its buckets not walked."""
    heap = [(-ub, st, fixed) for st, ub, fixed in classes]
    heapq.heapify(heap)
    best = None  # (value, stage, dp rank, owned elements, owned pieces)
    while heap and (best is None or -heap[0][0] >= best[0]):
        _, st, fixed = heapq.heappop(heap)
        if fixed is None:
            fixed, ub = exact(st)
            heapq.heappush(heap, (-ub, st, fixed))
            continue
        d, n_owned, n_pieces = stage_best(st)
        val = fixed + w_elem * n_owned + w_piece * n_pieces
        if best is None or val > best[0] or (val == best[0] and st < best[1]):
            best = (val, st, d, n_owned, n_pieces)
    return best[1:]


def _class_bound(totals: tuple[int, ...], dist_opt: bool, pb: int, gb: int, w_elem: int,
                 w_piece: int) -> tuple[int, int]:
    """(fixed bytes, upper bound) of a stage from its chunks' (numel, param elements, params, DP range
    elements) summed (_stage_totals): _buffer_bytes, plus optimizer bytes with every DP range full of
    parameter elements and every parameter a piece (exact without the distributed optimizer: every
    rank owns all)."""
    numel, real, params, full = totals[:4]
    fixed = sum(_buffer_bytes(numel, real, dist_opt, pb, gb))
    return fixed, fixed + w_elem * (full if dist_opt else real) + w_piece * params


def _stage_totals(chunks) -> tuple[int, ...]:
    """A stage's chunk summaries (_chunk_summary) or bounds (_chunk_bound) summed field by field."""
    if len(chunks) == 1:
        return chunks[0]
    return tuple(map(sum, zip(*chunks)))


@lru_cache(maxsize=4096)
def _chunk_summary(model: ModelShape, tp: int, layers: int, first: bool, last: bool, bucket_size, dp: int,
                   dist_opt: bool) -> tuple[int, int, int, int, int]:
    """(numel, param elements, params, DP range elements summed over buckets, buckets) of _buffer(...)
    without its per-param arrays: a chunk of one bucket from its pattern's totals, else its buckets
    (_chunk_buckets, which a bucketed chunk's DP calls and heaviest rank read too)."""
    (hreal, hn, ha, hpad), (lreal, ln, la, lpad), (treal, tn, ta, tpad), _ = _pattern_totals(model, tp, first, last)
    params = hn + layers * ln + tn
    if params and bucket_size is None and not _shared(model, first, last, dist_opt):
        # one bucket (_walk_buckets' first branch): from the first param's start (0) to the last one's
        # end, the last param in backprop order the tail's, else the last layer's, else the head's
        real = hreal + layers * lreal + treal
        span = ha + layers * la + ta - (tpad if tn else lpad if layers and ln else hpad) if dist_opt else real
        numel = _pad_bucket_end(span, _bucket_unit(dp), dist_opt)
        return numel, real, params, numel // dp, 1
    _, bstart, bend = _chunk_buckets(model, tp, layers, first, last, bucket_size, dp, dist_opt)
    numel, full, buckets = int(bend[-1]) if len(bend) else 0, int(((bend - bstart) // dp).sum()), len(bend)
    return numel, hreal + layers * lreal + treal, params, full, buckets


@lru_cache(maxsize=4096)
def _chunk_bound(model: ModelShape, tp: int, layers: int, first: bool, last: bool, bucket_size, dp: int,
                 dist_opt: bool) -> tuple[int, int, int, int]:
    """_chunk_summary's first four without the bucket walk, numel and DP range elements as upper
    bounds. build_buffer pads a bucket's end to a multiple of div = lcm(dp, 128) from a start that
    is one, past params spanning whole aligned sizes and the last one's elements: a multiple of g, the
    gcd of the chunk's sizes and aligned sizes, so by at most div - gcd(div, g) (none where g is a
    multiple of div). Every bucket spans at least bucket_size aligned elements but the last and those
    a shared_embedding param closes: at most aligned // bucket_size + 1 buckets plus one per
    shared_embedding param (at most one per param). Exact without the distributed optimizer (no
    padding)."""
    (hreal, hn, ha, _), (lreal, ln, la, _), (treal, tn, ta, _), g = _pattern_totals(model, tp, first, last)
    real, params = hreal + layers * lreal + treal, hn + layers * ln + tn
    if not dist_opt:
        return real, real, params, real // dp
    aligned = ha + layers * la + ta
    buckets = 1 if bucket_size is None else min(params, aligned // bucket_size + 1)
    if _shared(model, first, last, dist_opt):
        buckets += first + last
    div = _bucket_unit(dp)
    numel = aligned + buckets * (div - math.gcd(div, g))
    return numel, real, params, numel // dp


@lru_cache(maxsize=1024)
def _pattern_totals(model: ModelShape, tp: int, first: bool, last: bool) -> tuple:
    """(elements, params, aligned elements, alignment padding after its last param) of each run of
    _pattern (distributed optimizer's alignment), then the gcd of all its sizes and aligned sizes."""
    out, sizes = [], []  # each run's totals; every size and aligned size
    for n, c, _ in _pattern(model, tp, first, last, True):
        out.append((sum(n), len(n), c[-1], c[-1] - c[-2] - n[-1] if n else 0))
        sizes += n
        sizes += [b - a for a, b in zip(c, c[1:])]
    return (*out, math.gcd(*sizes))


@lru_cache(maxsize=4096)
def _chunk_buckets(model: ModelShape, tp: int, layers: int, first: bool, last: bool, bucket_size, dp: int,
                   dist_opt: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, bstart, bend) of _buffer(...)'s buckets without its per-param arrays: _walk_buckets over
    the chunk's pattern (head, `layers` copies of one layer, embedding; _pattern), whose positions are
    sums of per-piece sums."""
    shared = _shared(model, first, last, dist_opt)
    (hn, hc, hr), (ln, lc, lr), (tn, tc, tr) = _pattern(model, tp, first, last, dist_opt)
    h, k, t = len(hn), len(ln), len(tn)
    A, lbase = lc[k], hc[h]
    tbase = lbase + layers * A
    P = h + layers * k + t

    def accessor(head, layer, tail):  # param g's value, from the head's, one layer's or the tail's
        def at(g):
            if g < h:
                return head[g]
            if g < h + layers * k:
                q, m = divmod(g - h, k)
                return lbase + q * A + layer[m]
            return tbase + tail[g - h - layers * k]
        return at

    cum, reach = accessor(hc, lc, tc), accessor(hr, lr, tr)

    def first_reaching(x):  # reach is non-decreasing: the head, then the layers, then the tail
        i = bisect_left(hr, x)
        if i < h:
            return i
        if layers:
            q = max(0, -(-(x - lbase - lr[-1]) // A))  # the first layer whose last param reaches x
            if q < layers:
                return h + q * k + bisect_left(lr, x - lbase - q * A)
        return h + layers * k + bisect_left(tr, x - tbase)

    return _walk_buckets(P, cum, reach, first_reaching, bucket_size, _bucket_unit(dp), dist_opt,
                         shared and first, shared and last, (h, k, layers))


@lru_cache(maxsize=1024)
def _pattern(model: ModelShape, tp: int, first: bool, last: bool, dist_opt: bool) -> tuple:
    """A chunk's params in backprop order as three runs, the head (final norm, output layer: last
    chunk), one layer (repeated), the tail (embedding: first chunk), each (elements, aligned elements
    before each (cumulative, one longer), aligned elements before each plus its own): _run each."""
    return tuple(_run(model, tp, part, part == _HEAD and first, dist_opt) if held else _NO_RUN
                 for part, held in ((_HEAD, last), (_LAYER, True), (_EMB, first)))


_HEAD, _LAYER, _EMB = range(3)  # _run's parts
_NO_RUN = ((), (0,), ())  # a run a chunk does not hold


@lru_cache(maxsize=1024)
def _run(model: ModelShape, tp: int, part: int, first: bool, dist_opt: bool) -> tuple:
    """One run of _pattern (first: the head of a chunk that also holds the embedding, _head; False for
    the other parts): stage_params' numels (_pieces) reversed, their cumulative aligned elements and
    each one's reach; shared by the chunk shapes of one tp."""
    emb, layer, _ = _pieces(model, tp)
    n = tuple(k for _, k in reversed(_head(model, tp, first) if part == _HEAD else layer if part == _LAYER else emb))
    c = [0]
    for x in n:
        c.append(c[-1] + (_aligned(x) if dist_opt else x))
    return n, c, [c[i] + x for i, x in enumerate(n)]


@lru_cache(maxsize=1024)
def _chunk_contiguous(model: ModelShape, tp: int, first: bool, last: bool) -> bool:
    """Buffer.contiguous of a chunk's distributed-optimizer buffer (no alignment padding between its
    params) from its pattern's totals (_pattern_totals): each run's aligned elements are its elements."""
    return all(x[0] == x[2] for x in _pattern_totals(model, tp, first, last)[:3])


def _pattern_cum(parts, layers: int) -> np.ndarray:
    """Aligned elements before each param of a chunk from its _pattern, one longer (Buffer.prefix of
    a contiguous chunk): the head's, `layers` layers', the tail's."""
    (hn, hc, _), (ln, lc, _), (tn, tc, _) = parts
    lbase, width = hc[-1], lc[-1]
    rows = np.add.outer(np.arange(lbase, lbase + layers * width, width, dtype=np.int64), lc[:-1])
    return np.concatenate((np.array(hc[:-1], np.int64), rows.ravel(), np.add(tc, lbase + layers * width)))


def heaviest_dp_rank(buffers, dp: int, per_elem: int, per_piece: int) -> int:
    """The DP rank (lowest on ties) maximising per_elem * elements + per_piece * pieces owned over
    every bucket of `buffers` (cached: layouts of a search that differ only by micro-batch share it)."""
    return _best_rank(tuple(buffers), dp, per_elem, per_piece)[0]


_DIRECT_PAIRS = 2048  # up to this many (bucket, rank) pairs, evaluating them all costs fewer numpy calls


@lru_cache(maxsize=4096)
def _best_rank(buffers: tuple[Buffer, ...], dp: int, per_elem: int, per_piece: int) -> tuple[int, int, int]:
    """(heaviest DP rank, its owned elements, its owned pieces): every rank evaluated in closed form
    for contiguous buffers (_contiguous_ranks), or every (bucket, rank) pair when there are few
    (_all_ranks), else the sparse search (_heaviest)."""
    if all(b.contiguous for b in buffers):
        ranks = _contiguous_ranks
    elif dp > 1 and sum(len(b.bstart) for b in buffers) * dp <= _DIRECT_PAIRS:
        ranks = _all_ranks
    else:
        d = _heaviest(buffers, dp, per_elem, per_piece)
        return (d, *_owned_sizes(buffers, dp, d))
    e = p = 0
    for buf in buffers:
        be, bp = ranks(buf, dp)
        e, p = e + be, p + bp
    return argmax_rank(e, p, per_elem, per_piece)


def argmax_rank(e: np.ndarray, p: np.ndarray, per_elem: int, per_piece: int) -> tuple[int, int, int]:
    """(rank, elements, pieces) of the rank (lowest on ties) maximising per_elem * e + per_piece * p over
    per-rank arrays of owned elements and pieces."""
    d = int(np.argmax(per_elem * e + per_piece * p))
    return d, int(e[d]), int(p[d])


def _contiguous_ranks(buf: Buffer, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """_all_ranks for a contiguous buffer: _tiled_ranks (a contiguous buffer's params tile each
    bucket from its start, so the param-element prefix gives every offset in a bucket)."""
    return _tiled_ranks(buf.prefix, buf.first, buf.bstart, buf.bend, dp)


def _tiled_ranks(cum: np.ndarray, first: np.ndarray, bstart: np.ndarray, bend: np.ndarray,
                 dp: int) -> tuple[np.ndarray, np.ndarray]:
    """(elements, param pieces) each DP rank owns, in O(params + buckets + dp), for buckets whose
    params tile them from their start (cum: elements before each param, one longer; first: each
    bucket's first param): bucket b's params tile [bstart, bstart + real) and its DP ranges have
    S = numel / dp elements, so rank r owns S elements while (r + 1) * S <= real, the remainder at
    r = real // S, none after; a range holding params has one piece starting at or holding its first
    element plus one per param starting strictly inside it."""
    nb = len(first)
    if nb == 1:  # the common case, in scalars where possible
        real, s = int(cum[-1]), int(bend[0] - bstart[0]) // dp
        full, rem = divmod(real, s)
        e = np.zeros(dp, np.int64)
        e[:full] = s
        if full < dp:
            e[full] = rem
        rank, at = np.divmod(cum[:-1], s)
        p = np.bincount(rank[at != 0], minlength=dp)
        p[:-(-real // s)] += 1
        return e, p
    return _ranks_of_shares(*_bucket_shares(cum, first, bstart, bend, dp), dp)


def _bucket_shares(cum: np.ndarray, first: np.ndarray, bstart: np.ndarray, bend: np.ndarray,
                   dp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_tiled_ranks' buckets (at least one) as (DP range elements S, param elements) per bucket and,
    per DP rank, the param starts strictly inside its ranges."""
    size = (bend - bstart) // dp
    lims = np.append(first, len(cum) - 1)
    real = cum[lims[1:]] - cum[lims[:-1]]
    bid = np.repeat(np.arange(len(first)), np.diff(lims))
    rank, at = np.divmod(cum[:-1] - cum[first][bid], size[bid])
    return size, real, np.bincount(rank[at != 0], minlength=dp)


def _ranks_of_shares(size: np.ndarray, real: np.ndarray, inner: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """_tiled_ranks' (elements, pieces) per DP rank from _bucket_shares."""
    full, rem = np.divmod(real, size)
    # weights make float64 bincounts: exact, the sums stay far below 2**53
    e = np.bincount(full, weights=size, minlength=dp + 1)[::-1].cumsum()[::-1][1:] + \
        np.bincount(full, weights=rem, minlength=dp + 1)[:dp]
    p = inner + (len(size) - np.cumsum(np.bincount(-(-real // size), minlength=dp + 1))[:dp])  # buckets reaching r
    return e.astype(np.int64), p


def _all_ranks(buf: Buffer, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """(elements, param pieces) each DP rank owns of the buffer, summed over its buckets: the DP
    ranges of every bucket as one (buckets, dp + 1) array of bounds (shard_ranges, counted)."""
    x = buf.bstart[:, None] + np.arange(dp + 1) * ((buf.bend - buf.bstart) // dp)[:, None]
    k = np.searchsorted(buf.starts, x, "right") - 1  # >= 0: the buffer's first param starts at 0
    covered = buf.prefix[k] + np.minimum(x - buf.starts[k], buf.n[k])
    lo, hi = x[:, :-1], x[:, 1:]
    pieces = np.searchsorted(buf.starts, hi, "left") - np.searchsorted(buf.ends, lo, "right")
    return np.diff(covered, axis=1).sum(0), pieces.sum(0)


@lru_cache(maxsize=4096)
def _heaviest(buffers: tuple[Buffer, ...], dp: int, per_elem: int, per_piece: int) -> int:
    """heaviest_dp_rank without evaluating every (bucket, rank) pair: a rank whose range
    lies inside one param owns the whole range as one piece; only the ranks around param bounds
    and padding (at most a few per param) differ, so only those are evaluated."""
    if dp == 1:
        return 0
    delta = np.zeros(dp, np.float64)  # exact: integers far below 2**53
    for buf in buffers:
        nb = len(buf.bstart)
        if nb == 0:
            continue
        counts = np.diff(np.append(buf.first, len(buf.starts)))
        bid = np.repeat(np.arange(nb), counts)
        b0 = buf.bstart[bid]
        size = ((buf.bend - buf.bstart) // dp)[bid]
        inner_lo = -((b0 - buf.starts) // size)  # first rank whose range starts inside param i
        inner_end = np.maximum(inner_lo, (buf.ends - b0) // size)  # past the last one ending inside it
        # ranks not inside any param: before each param's inner ranks (after the previous one's), and
        # after the bucket's last param
        prev = np.concatenate(([0], inner_end[:-1]))
        prev[buf.first] = 0
        last = np.append(buf.first[1:], len(buf.starts)) - 1
        lo_r = np.concatenate((prev, inner_end[last]))
        hi_r = np.concatenate((inner_lo, np.full(nb, dp, np.int64)))
        gb = np.concatenate((bid, np.arange(nb)))
        lens = np.maximum(hi_r - lo_r, 0)
        total = int(lens.sum())
        if total == 0:
            continue
        ranks = np.repeat(lo_r - np.cumsum(lens) + lens, lens) + np.arange(total)
        bks = np.repeat(gb, lens)
        e, p = _owned(buf, bks, ranks, dp)
        full = (buf.bend - buf.bstart)[bks] // dp
        delta += np.bincount(ranks, weights=(per_elem * (e - full) + per_piece * (p - 1)).astype(np.float64),
                             minlength=dp)
    return int(np.argmax(delta))


def _buffer_bytes(numel: int, real: int, dist_opt: bool, pb: int, gb: int) -> tuple[int, int]:
    """(params bytes, grads bytes) of a stage's DDP buffers from their summaries summed (_stage_totals:
    numel, padded, and param elements): distributed/param_and_grad_buffer.py
    _ParamAndGradBuffer.__init__ allocates param_data (numel, padded) only with the distributed
    optimizer (else the module keeps its own parameters: their elements); grad_data always."""
    return pb * (numel if dist_opt else real), gb * numel
