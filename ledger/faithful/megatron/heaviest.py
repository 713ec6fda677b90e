"""The most-loaded rank of a Megatron Core 0.18.0 structure, fast: what a model chunk's DDP buffer
(ledger.faithful.megatron.buffers: distributed/param_and_grad_buffer.py with the padding of
optimizer/param_layout.py, paths under megatron/core/) holds, computed without building it, and the
best-first search over stage classes (most_loaded) that ledger.faithful.megatron.states runs with them.

A chunk's params in backprop order are three runs, the head, one layer repeated, the tail (pattern,
_run). A chunk's summary (_chunk_summary) is the bucket walk over that pattern (chunk_buckets), no
per-param arrays (a chunk of one bucket: its pattern's totals, _pattern_totals); a stage is bounded
without its bucket walk (chunk_bound, class_bound); summaries and bounds are cached per chunk shape
(the stages of a structure share them: stage_summaries per stage class, stage_class). A contiguous
chunk's param offsets (pattern_cum, chunk_contiguous) give its DP ranks' ownership in closed form
(buffers.tiled_ranks).
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from functools import lru_cache

import numpy as np

from ledger.faithful.megatron.buffers import (aligned, bucket_unit, buffer_bytes, effective_bucket_size, pad_bucket_end,
                                              shared, walk_buckets)
from ledger.faithful.megatron.knobs import Knobs
from ledger.faithful.megatron.pipeline import head, pieces, stage_shape
from ledger.model import ModelShape


def most_loaded(classes: list, exact, stage_best, w_elem: int, w_piece: int) -> tuple[int, int, int, int]:
    """(stage, DP rank, its owned elements, its owned pieces) of the most-loaded rank among stage
    classes ((stage, upper bound, fixed bytes or None) each; exact(stage): (fixed bytes, upper bound)
    from its summaries; stage_best(stage): its heaviest DP rank's (rank, elements, pieces)), the lowest
    stage and DP rank on ties, comparing only what differs between them (buffer_bytes, states._owned_by;
    optimizer bytes are w_elem per owned element and w_piece per owned piece).

    Best first: the class of the highest bound comes next; a bound without fixed bytes (chunk_bound,
    no bucket walk) is replaced by its summaries' (class_bound) before its DP ranks are searched. A
    class whose bound is below a value already found cannot hold the most-loaded rank: its DP ranks
    are not searched and, where its bound came from chunk_bound, its buckets not walked."""
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


def class_bound(totals: tuple[int, ...], dist_opt: bool, pb: int, gb: int, w_elem: int,
                w_piece: int) -> tuple[int, int]:
    """(fixed bytes, upper bound) of a stage from its chunks' (numel, param elements, params, DP range
    elements) summed (stage_totals): buffer_bytes, plus optimizer bytes with every DP range full of
    parameter elements and every parameter a piece (exact without the distributed optimizer: every
    rank owns all)."""
    numel, real, params, full = totals[:4]
    fixed = sum(buffer_bytes(numel, real, dist_opt, pb, gb))
    return fixed, fixed + w_elem * (full if dist_opt else real) + w_piece * params


def stage_totals(chunks) -> tuple[int, ...]:
    """A stage's chunk summaries (_chunk_summary) or bounds (chunk_bound) summed field by field."""
    if len(chunks) == 1:
        return chunks[0]
    return tuple(map(sum, zip(*chunks)))


@lru_cache(maxsize=4096)
def _chunk_summary(model: ModelShape, tp: int, layers: int, first: bool, last: bool, bucket_size, dp: int,
                   dist_opt: bool) -> tuple[int, int, int, int, int]:
    """(numel, param elements, params, DP range elements summed over buckets, buckets) of buffers.buffer(...)
    without its per-param arrays: a chunk of one bucket from its pattern's totals, else its buckets
    (chunk_buckets, which a bucketed chunk's DP calls and heaviest rank read too)."""
    (hreal, hn, ha, hpad), (lreal, ln, la, lpad), (treal, tn, ta, tpad), _ = _pattern_totals(model, tp, first, last)
    params = hn + layers * ln + tn
    if params and bucket_size is None and not shared(model, first, last, dist_opt):
        # one bucket (walk_buckets' first branch): from the first param's start (0) to the last one's
        # end, the last param in backprop order the tail's, else the last layer's, else the head's
        real = hreal + layers * lreal + treal
        span = ha + layers * la + ta - (tpad if tn else lpad if layers and ln else hpad) if dist_opt else real
        numel = pad_bucket_end(span, bucket_unit(dp), dist_opt)
        return numel, real, params, numel // dp, 1
    _, bstart, bend = chunk_buckets(model, tp, layers, first, last, bucket_size, dp, dist_opt)
    numel, full, buckets = int(bend[-1]) if len(bend) else 0, int(((bend - bstart) // dp).sum()), len(bend)
    return numel, hreal + layers * lreal + treal, params, full, buckets


@lru_cache(maxsize=4096)
def chunk_bound(model: ModelShape, tp: int, layers: int, first: bool, last: bool, bucket_size, dp: int,
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
    if shared(model, first, last, dist_opt):
        buckets += first + last
    div = bucket_unit(dp)
    numel = aligned + buckets * (div - math.gcd(div, g))
    return numel, real, params, numel // dp


@lru_cache(maxsize=1024)
def _pattern_totals(model: ModelShape, tp: int, first: bool, last: bool) -> tuple:
    """(elements, params, aligned elements, alignment padding after its last param) of each run of
    pattern (distributed optimizer's alignment), then the gcd of all its sizes and aligned sizes."""
    out, sizes = [], []  # each run's totals; every size and aligned size
    for n, c, _ in pattern(model, tp, first, last, True):
        out.append((sum(n), len(n), c[-1], c[-1] - c[-2] - n[-1] if n else 0))
        sizes += n
        sizes += [b - a for a, b in zip(c, c[1:])]
    return (*out, math.gcd(*sizes))


@lru_cache(maxsize=4096)
def chunk_buckets(model: ModelShape, tp: int, layers: int, first: bool, last: bool, bucket_size, dp: int,
                  dist_opt: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, bstart, bend) of buffers.buffer(...)'s buckets without its per-param arrays: walk_buckets over
    the chunk's pattern (head, `layers` copies of one layer, embedding; pattern), whose positions are
    sums of per-piece sums."""
    is_shared = shared(model, first, last, dist_opt)
    (hn, hc, hr), (ln, lc, lr), (tn, tc, tr) = pattern(model, tp, first, last, dist_opt)
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

    return walk_buckets(P, cum, reach, first_reaching, bucket_size, bucket_unit(dp), dist_opt,
                        is_shared and first, is_shared and last, (h, k, layers))


@lru_cache(maxsize=1024)
def pattern(model: ModelShape, tp: int, first: bool, last: bool, dist_opt: bool) -> tuple:
    """A chunk's params in backprop order as three runs, the head (final norm, output layer: last
    chunk), one layer (repeated), the tail (embedding: first chunk), each (elements, aligned elements
    before each (cumulative, one longer), aligned elements before each plus its own): _run each."""
    return tuple(_run(model, tp, part, part == _HEAD and first, dist_opt) if held else _NO_RUN
                 for part, held in ((_HEAD, last), (_LAYER, True), (_EMB, first)))


_HEAD, _LAYER, _EMB = range(3)  # _run's parts
_NO_RUN = ((), (0,), ())  # a run a chunk does not hold


@lru_cache(maxsize=1024)
def _run(model: ModelShape, tp: int, part: int, first: bool, dist_opt: bool) -> tuple:
    """One run of pattern (first: the head of a chunk that also holds the embedding, head; False for
    the other parts): stage_params' numels (pieces) reversed, their cumulative aligned elements and
    each one's reach; shared by the chunk shapes of one tp."""
    emb, layer, _ = pieces(model, tp)
    n = tuple(k for _, k in reversed(head(model, tp, first) if part == _HEAD else layer if part == _LAYER else emb))
    c = [0]
    for x in n:
        c.append(c[-1] + (aligned(x) if dist_opt else x))
    return n, c, [c[i] + x for i, x in enumerate(n)]


@lru_cache(maxsize=1024)
def chunk_contiguous(model: ModelShape, tp: int, first: bool, last: bool) -> bool:
    """Buffer.contiguous of a chunk's distributed-optimizer buffer (no alignment padding between its
    params) from its pattern's totals (_pattern_totals): each run's aligned elements are its elements."""
    return all(x[0] == x[2] for x in _pattern_totals(model, tp, first, last)[:3])


def pattern_cum(parts, layers: int) -> np.ndarray:
    """Aligned elements before each param of a chunk from its pattern, one longer (Buffer.prefix of
    a contiguous chunk): the head's, `layers` layers', the tail's."""
    (hn, hc, _), (ln, lc, _), (tn, tc, _) = parts
    lbase, width = hc[-1], lc[-1]
    rows = np.add.outer(np.arange(lbase, lbase + layers * width, width, dtype=np.int64), lc[:-1])
    return np.concatenate((np.array(hc[:-1], np.int64), rows.ravel(), np.add(tc, lbase + layers * width)))


@lru_cache(maxsize=4096)
def stage_summaries(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, st: int) -> tuple[tuple, ...]:
    """_chunk_summary of each of a stage's chunks."""
    return tuple(_chunk_summary(model, tp, *stage_shape(model, pp, st, vp, ch, k.pp_split),
                                effective_bucket_size(k, dp, st, ch), dp, k.use_distributed_optimizer)
                 for ch in range(vp))


def stage_class(pp: int, stage: int) -> int:
    """The lowest stage with the same buffers: stages between the first and the last hold equal
    layers (stage_shape), and only stage 0 is bucketed (effective_bucket_size)."""
    return stage if stage == 0 or stage == pp - 1 else 1
