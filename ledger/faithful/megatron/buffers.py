"""A Megatron Core 0.18.0 model chunk's DDP buffers: how distributed/param_and_grad_buffer.py lays a
chunk's parameters (ledger.faithful.megatron.pipeline) out in padded buckets (build_buffer,
buffer_layout; the distributed optimizer's padding of optimizer/param_layout.py), which byte ranges
each DP rank owns under the distributed optimizer (optimizer/distrib_optimizer.py: shard_ranges,
owned_sizes), and which DP rank owns the most (heaviest_dp_rank, best_rank). Each rule names the
megatron source it follows (paths under megatron/core/ unless said otherwise).

Speed (a layout search predicts thousands of layouts): bucket runs repeat across identical layers
(walk_buckets copies them); a buffer without alignment padding gives every DP rank's ownership in
closed form (_contiguous_ranks, tiled_ranks), else best_rank evaluates every (bucket, rank) pair
where there are few, or only the ranks around param bounds (_heaviest). A chunk's buffer summarised
without being built is ledger.faithful.megatron.heaviest's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ledger.faithful.megatron.pipeline import head, pieces, sizes
from ledger.model import ModelShape
from ledger.units import round_up


# -- DDP buffer layout ---------------------------------------------------------------------------
# optimizer/param_layout.py, the distributed optimizer's padding: pad_param_start aligns every param
# start to 64 elements, pad_bucket_end pads every bucket end to lcm(dp, 128) elements
# (pad_buckets_for_high_nccl_busbw off)
PARAM_ALIGN = 64


def aligned(n):
    """n elements (an int or an array) rounded up to the next param start (PARAM_ALIGN)."""
    return round_up(n, PARAM_ALIGN)


def bucket_unit(dp: int) -> int:
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
def buffer(model: ModelShape, tp: int, layers: int, first: bool, last: bool, bucket_size, dp: int,
           dist_opt: bool) -> Buffer:
    is_shared = shared(model, first, last, dist_opt)
    # in backprop order the head's params come first, then `layers` reversed copies of one layer
    period = (len(head(model, tp, first)) if last else 0, len(pieces(model, tp)[1]), layers)
    return build_buffer(sizes(model, tp, layers, first, last), bucket_size, dp, dist_opt,
                        shared_first=is_shared and first, shared_last=is_shared and last, period=period)


def shared(model: ModelShape, first: bool, last: bool, dist_opt: bool) -> bool:
    """Whether a chunk's buffer holds a `shared_embedding` param in a bucket of its own (build_buffer):
    a chunk holding the embedding or the output layer (never both with pp > 1) of a tied model with
    pp > 1 (shared_embedding()); pp = 1 holds both, marks none."""
    return dist_opt and model.tied_embeddings and first != last


def build_buffer(sizes: np.ndarray, bucket_size: int | None, dp: int, dist_opt: bool,
                 shared_first: bool = False, shared_last: bool = False,
                 period: tuple[int, int, int] | None = None) -> Buffer:
    """Params in reverse (backprop) order into buckets.

    Distributed optimizer: optimizer/distrib_optimizer.py _compute_per_buffer_param_layout with
    optimizer/param_layout.py pad_param_start and pad_bucket_end (PARAM_ALIGN, bucket_unit,
    pad_bucket_end); a bucket closes at the first param whose end reaches bucket_size elements past
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
    a = aligned(n) if dist_opt else n  # each start aligned: the aligned sizes
    div = bucket_unit(dp)
    P = len(n)
    prefix = np.zeros(P + 1, np.int64)
    np.cumsum(n, out=prefix[1:])
    cum = np.zeros(P + 1, np.int64)
    np.cumsum(a, out=cum[1:])
    reach = cum[:-1] + n
    first, bstart, bend = walk_buckets(P, lambda j: int(cum[j]), lambda i: int(reach[i]),
                                       lambda x: int(np.searchsorted(reach, x)), bucket_size, div, dist_opt,
                                       shared_first, shared_last, period)
    counts = np.diff(np.append(first, P))
    starts = np.repeat(bstart - cum[first], counts) + cum[:-1]
    return Buffer(starts=starts, ends=starts + n, bstart=bstart, bend=bend, first=first,
                  prefix=prefix, n=n, contiguous=not dist_opt or bool((a == n).all()))


def walk_buckets(P: int, cum, reach, first_reaching, bucket_size: int | None, div: int, dist_opt: bool,
                 shared_first: bool, shared_last: bool, period):
    """build_buffer's bucket rule over params 0..P-1 of backprop order: (first param, start, padded
    end) of each bucket. cum(j): aligned elements before param j; reach(i): cum(i) plus param i's
    elements; first_reaching(x): the lowest i with reach(i) >= x (P if none). Given as functions so
    that a chunk's buckets can be walked without its per-param arrays (heaviest.chunk_buckets)."""
    if P and bucket_size is None and not (shared_first or shared_last):
        # one bucket (every stage but the first, or no overlap_grad_reduce): the loop's single step
        # (j = 0, i = P - 1) without its bookkeeping
        end = pad_bucket_end(reach(P - 1) - cum(0), div, dist_opt)
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
        end = pad_bucket_end(pend, div, dist_opt)
        firsts.append(j)
        bstarts.append(b0)
        bends.append(end)
        j, b0 = i + 1, end
    tail = np.array((firsts, bstarts, bends), np.int64).reshape(3, -1)
    return np.concatenate(blocks + [tail], axis=1) if blocks else tail


def pad_bucket_end(end: int, div: int, dist_opt: bool) -> int:
    """A bucket's end (its params' last element) padded to a multiple of div = bucket_unit(dp):
    pad_bucket_end (distributed optimizer; none otherwise)."""
    return round_up(end, div) if dist_opt else end


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


_PAIRS_PER_CALL = 1 << 22  # (bucket, rank) pairs per numpy call of owned_per_rank: ~100 MB of temporaries


def owned_per_rank(buffers: tuple[Buffer, ...], dp: int) -> tuple[np.ndarray, np.ndarray]:
    """(elements, param pieces) every DP rank owns over every bucket of `buffers`: _owned_sizes of
    each rank (the same _owned, for all ranks at once), in slices of ranks so that no array holds more
    than _PAIRS_PER_CALL (bucket, rank) pairs at a world of a million ranks."""
    e, p = np.zeros(dp, np.int64), np.zeros(dp, np.int64)
    for buf in buffers:
        nb = len(buf.bstart)
        step = max(1, _PAIRS_PER_CALL // nb)
        for lo in range(0, dp, step):
            ranks = np.arange(lo, min(dp, lo + step), dtype=np.int64)
            be, bp = _owned(buf, np.repeat(np.arange(nb), len(ranks)), np.tile(ranks, nb), dp)
            e[lo:lo + len(ranks)] += be.reshape(nb, -1).sum(0)
            p[lo:lo + len(ranks)] += bp.reshape(nb, -1).sum(0)
    return e, p


# -- the DP rank that owns the most ---------------------------------------------------------------
def heaviest_dp_rank(buffers, dp: int, per_elem: int, per_piece: int) -> int:
    """The DP rank (lowest on ties) maximising per_elem * elements + per_piece * pieces owned over
    every bucket of `buffers` (cached: layouts of a search that differ only by micro-batch share it)."""
    return best_rank(tuple(buffers), dp, per_elem, per_piece)[0]


_DIRECT_PAIRS = 2048  # up to this many (bucket, rank) pairs, evaluating them all costs fewer numpy calls


@lru_cache(maxsize=4096)
def best_rank(buffers: tuple[Buffer, ...], dp: int, per_elem: int, per_piece: int) -> tuple[int, int, int]:
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
    """_all_ranks for a contiguous buffer: tiled_ranks (a contiguous buffer's params tile each
    bucket from its start, so the param-element prefix gives every offset in a bucket)."""
    return tiled_ranks(buf.prefix, buf.first, buf.bstart, buf.bend, dp)


def tiled_ranks(cum: np.ndarray, first: np.ndarray, bstart: np.ndarray, bend: np.ndarray,
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
    return ranks_of_shares(*bucket_shares(cum, first, bstart, bend, dp), dp)


def bucket_shares(cum: np.ndarray, first: np.ndarray, bstart: np.ndarray, bend: np.ndarray,
                  dp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tiled_ranks' buckets (at least one) as (DP range elements S, param elements) per bucket and,
    per DP rank, the param starts strictly inside its ranges."""
    size = (bend - bstart) // dp
    lims = np.append(first, len(cum) - 1)
    real = cum[lims[1:]] - cum[lims[:-1]]
    bid = np.repeat(np.arange(len(first)), np.diff(lims))
    rank, at = np.divmod(cum[:-1] - cum[first][bid], size[bid])
    return size, real, np.bincount(rank[at != 0], minlength=dp)


def ranks_of_shares(size: np.ndarray, real: np.ndarray, inner: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """tiled_ranks' (elements, pieces) per DP rank from bucket_shares."""
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


def buffer_bytes(numel: int, real: int, dist_opt: bool, pb: int, gb: int) -> tuple[int, int]:
    """(params bytes, grads bytes) of a stage's DDP buffers from their summaries summed (heaviest.stage_totals:
    numel, padded, and param elements): distributed/param_and_grad_buffer.py
    _ParamAndGradBuffer.__init__ allocates param_data (numel, padded) only with the distributed
    optimizer (else the module keeps its own parameters: their elements); grad_data always."""
    return pb * (numel if dist_opt else real), gb * numel
