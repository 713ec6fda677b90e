"""DeepSpeed 0.19.8's gradient hooks in a backward: where ZeRO-1/2 make a rank's
grads_in_partition, and ZeRO-3's IPG reductions (z3_flushes).

With contiguous_gradients (the default), stage_1_and_2.py reduces a backward's gradients through the
IPG bucket as their hooks fire (reduce_independent_p_g_buckets_and_remove_grads): a hook whose
gradient would overflow reduce_bucket_size first reduces what the bucket holds (reduce_ipg_grads), and
for each reduced parameter of this rank's partition copy_grads_in_partition copies its gradient into
`grads_in_partition`, which the first such copy of a backward allocates (torch.empty of the numel of
every parameter overlapping the partition: a straddling parameter whole). _release_ipg_buffers drops
the attribute at the backward's epilogue; with several micro-batches, the epilogue's all_grad_tensors
(views into it) keep micro-batch 0's buffer until the boundary, so a later micro-batch holds two.

Which hook's reduction first copies into a rank's partition depends on the rank: the last rank's
partition holds the output layer, reduced at the second hook, the first rank's the embedding, reduced
by the epilogue. The ledger's backward moments (deepspeed_peak) ask, per rank, whether the buffer is
there yet: `partition_flushes`.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ledger.dtypes import FP64
from ledger.model import ModelShape, numel
from ledger.units import round_up


class PartitionFlush(NamedTuple):
    overlap: int  # elements of grads_in_partition: every parameter overlapping the partition, whole
    first_hook: int  # `order` index of the hook whose reduction first copies into it (len: the epilogue's)
    copied: int  # elements of the gradients copied into the IPG buffer before then (their own storage freed)


@lru_cache(maxsize=64)
def _flat(model: ModelShape, dp: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """The flat group (stage_1_and_2.py: one param group, the params in registration order, padded to a
    multiple of 2 * dp): (partition elements, name -> (offset, numel))."""
    regs = model.params()
    part = round_up(sum(numel(sh) for _, sh in regs), 2 * dp) // dp
    at, off = {}, 0
    for name, sh in regs:
        at[name] = (off, numel(sh))
        off += numel(sh)
    return part, at


def _ranks_holding(off: int, k: int, part: int) -> range:
    """The ranks whose partitions (part elements each) hold some of a parameter's k elements at flat offset off
    (is_param_in_current_partition)."""
    return range(off // part, (off + k - 1) // part + 1)


@lru_cache(maxsize=64)
def partition_params(model: ModelShape, dp: int) -> tuple[tuple[int, int], ...]:
    """Per rank of a dp group: (the parameters overlapping its partition, their elements, each whole), as
    stage_1_and_2.py's is_param_in_current_partition marks them (a straddling parameter in both ranks')."""
    part, at = _flat(model, dp)
    count, elems = [0] * dp, [0] * dp
    for off, k in at.values():
        for r in _ranks_holding(off, k, part):
            count[r] += 1
            elems[r] += k
    return tuple(zip(count, elems))


@lru_cache(maxsize=64)
def offload_copies(model: ModelShape, dp: int, bucket: int, w: int) -> tuple[int, ...]:
    """Per rank of a dp group under ZeRO-Offload: the most bytes one reduced gradient's copy into the host
    partition holds at once (stage_1_and_2.py copy_grads_in_partition at the boundary): its slice's fp64
    norm (set_norm_for_param_grad_in_gpu: `.to(get_norm_dtype())`, freed before the fp32 copy of
    async_inplace_copy_grad_to_fp32_buffer_from_gpu, half its size), beside an extra-large gradient's clone
    (reduce_independent_p_g_buckets_and_remove_grads under _offload_gradient_safety_enabled: the clone replaces
    its grad, reduced in place, so the whole gradient is counted once more)."""
    part, at = _flat(model, dp)
    out = [0] * dp
    for off, k in at.values():
        for r in _ranks_holding(off, k, part):
            mine = min(off + k, (r + 1) * part) - max(off, r * part)
            out[r] = max(out[r], FP64 * mine + (w * k if k > bucket else 0))
    return tuple(out)


def _reduced_in_place(k: int, off: int, part: int, bucket: int) -> bool:
    """An extra-large gradient of k elements at `off` that a collective reduces itself (a call of one
    slice of it, allreduce_calls), not only through a flattened copy."""
    return k > bucket and any(slices == 1 for _, slices in allreduce_calls(k, off, part, bucket))


@lru_cache(maxsize=64)
def partition_flushes(model: ModelShape, dp: int, bucket: int,
                      order: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[PartitionFlush, ...]:
    """Per rank of a dp group: its grads_in_partition's elements and the hook that allocates it.
    order: the parameters in the order their gradients reach reduce_independent_p_g_buckets_and_remove_grads
    (ZeRO-2: the hooks', deepspeed.backward_order; ZeRO-1: reduce_gradients' walk of bit16_groups at
    the boundary, the registration order).

    The partitions are flat / dp elements of the flat group (_flat); is_param_in_current_partition: the
    param overlaps the partition. The bucket: a hook whose numel would take the bucket's elements past
    reduce_bucket_size reduces the bucket first (an extra-large gradient alone counts its own numel,
    so the next hook always reduces it)."""
    part, at = _flat(model, dp)
    span: dict[str, tuple[int, int]] = {}  # name -> (first rank, last rank) its elements lie in
    overlap = [0] * dp
    for name, (off, k) in at.items():
        ranks = _ranks_holding(off, k, part)
        span[name] = (ranks[0], ranks[-1])
        for r in ranks:
            overlap[r] += k
    first = [len(order)] * dp
    copied_at = [0] * dp
    left = dp
    content: list[str] = []
    elements = copied = 0

    def reduce(at: int) -> int:
        done = 0
        for name in content:
            lo, hi = span[name]
            for r in range(lo, hi + 1):
                if first[r] == len(order):
                    first[r], copied_at[r] = at, copied
                    done += 1
        return done

    for i, (name, sh) in enumerate(order):
        k = numel(sh)
        if elements + k > bucket:
            left -= reduce(i)
            content, elements = [], 0
            if not left:
                break
        content.append(name)
        elements += k
        if k <= bucket:  # copied into the IPG buffer at its hook; an extra-large one stays its own
            copied += k
    for r in range(dp):
        if first[r] == len(order):  # the epilogue's reduction, after every hook
            copied_at[r] = copied
    return tuple(PartitionFlush(overlap[r], first[r], copied_at[r]) for r in range(dp))


class Hooks(NamedTuple):
    """backward_order indexes of the hooks the backward moments are placed by."""
    norm: int  # the final norm's weight (0 when tied: the output's weight is the embedding's, last)
    w2: tuple[int, ...]  # per layer, its feed_forward.w2 weight's: the block's first gradient
    ffn_norm: tuple[int, ...]  # per layer, its ffn_norm weight's
    count: int = 0  # the hooks in a backward (the epilogue's index)


@lru_cache(maxsize=64)
def hooks(order: tuple[tuple[str, tuple[int, ...]], ...], layers: int) -> Hooks:
    at = {name: i for i, (name, _) in enumerate(order)}
    return Hooks(at["norm.weight"], tuple(at[f"layers.{j}.feed_forward.w2.weight"] for j in range(layers)),
                 tuple(at[f"layers.{j}.ffn_norm.weight"] for j in range(layers)), len(order))


def allreduce_calls(n: int, offset: int, part: int, bucket: int) -> list[tuple[int, int]]:
    """(elements, slices) per all-reduce for an extra-large gradient of n elements at `offset` in the flat group.

    average_tensor(reduce_scatter=True) cuts the bucket into one slice per partition it touches
    (param_to_partition_ids / grad_start_offset, partitions of `part` elements); with
    use_multi_rank_bucket_allreduce all slices go to allreduce_and_scatter(numel_per_bucket=
    reduce_bucket_size), which adds slices until their sum exceeds reduce_bucket_size, all-reduces
    those (allreduce_and_copy_with_multiple_ranks -> allreduce_bucket: one flattened all_reduce) and
    starts again; the rest goes in a last call. A bucket of copied gradients never exceeds
    reduce_bucket_size: one call. A call of one slice all-reduces a view of the gradient (flatten of one
    tensor); of several, a flattened copy, copied back."""
    out, acc, k, pos, end = [], 0, 0, offset, offset + n
    while pos < end:
        nxt = min(end, (pos // part + 1) * part)
        acc += nxt - pos
        k += 1
        pos = nxt
        if acc > bucket:
            out.append((acc, k))
            acc = k = 0
    if acc:
        out.append((acc, k))
    return out


@lru_cache(maxsize=64)
def ipg_touched(model: ModelShape, dp: int, bucket: int, order: tuple[tuple[str, tuple[int, ...]], ...]) -> bool:
    """Whether a collective reduces the IPG buffer itself in a step: average_tensor merges a bucket's
    consecutive pieces of one partition into one slice, and a bucket (at most reduce_bucket_size) is
    one call (allreduce_calls): a view of the buffer when its gradients lie in one partition, else a
    flattened copy. (The probe files the buffer under `gathered` only when touched.)"""
    part, at = _flat(model, dp)
    content: list[str] = []
    elements = 0

    def one_partition() -> bool:
        ids = set()
        for name in content:
            off, k = at[name]
            ids.update(range(off // part, (off + k - 1) // part + 1))
        return len(ids) == 1

    for name, sh in order + (("", (bucket + 1,)),):  # a sentinel: the epilogue's reduction
        k = numel(sh)
        if elements + k > bucket:
            if content and elements <= bucket and one_partition():
                return True
            content, elements = [], 0
        content.append(name)
        elements += k
    return False


@lru_cache(maxsize=64)
def hooked(model: ModelShape, dp: int, bucket: int,
           order: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per hook index i of `order` (every parameter once), the elements of the gradients made through
    it (i inclusive) and of those among them a collective reduces in place (_reduced_in_place; the
    last entry: every such gradient)."""
    part, at = _flat(model, dp)
    cum, cum_touched, a, t = [], [], 0, 0
    for name, sh in order:
        k = numel(sh)
        a += k
        if _reduced_in_place(k, at[name][0], part, bucket):
            t += k
        cum.append(a)
        cum_touched.append(t)
    return tuple(cum), tuple(cum_touched)



class Z3Flush(NamedTuple):
    """One ZeRO-3 IPG reduction in a backward (stage3.py __reduce_and_partition_ipg_grads), made at a hook."""
    hook: int  # `order` index of the hook whose gradient would overflow the bucket (len: the epilogue's)
    name: str  # that hook's parameter ("" for the epilogue)
    flat: int  # elements of reduce_scatter_coalesced's input: each gradient padded to a multiple of dp
    cat: bool  # whether that input is a torch.cat copy (several gradients, or one not a multiple of dp)
    own: int  # elements of the bucket's gradients kept in their own storage (an extra-large one, alone)


@lru_cache(maxsize=64)
def z3_flushes(dp: int, bucket: int, order: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[Z3Flush, ...]:
    """ZeRO-3's IPG reductions in one backward, in order (stage3.py, DeepSpeed 0.19.8):
    reduce_independent_p_g_buckets_and_remove_grads reduces the bucket first when `bucket.elements +
    param.ds_numel > reduce_bucket_size and bucket.elements > 0`; __add_grad_to_ipg_bucket copies the
    gradient into the IPG buffer when it fits (contiguous_gradients), else it stays its own tensor (an
    extra-large one: alone in its bucket, reduced at the next hook); the epilogue reduces the rest.
    __avg_scatter_grads -> reduce_scatter_coalesced: one tensor whose numel is a multiple of dp is
    reduce-scattered as it is (a view), otherwise the padded parts are torch.cat into a flat buffer.
    order: the parameters in the order their gradients become ready (deepspeed.backward_order)."""
    out: list[Z3Flush] = []
    sizes: list[int] = []  # the open bucket's gradients (numel)
    elements = own = 0

    def flush(i: int, name: str) -> None:
        flat = sum(round_up(k, dp) for k in sizes)
        out.append(Z3Flush(i, name, flat, len(sizes) > 1 or sizes[0] % dp != 0, own))

    for i, (name, sh) in enumerate(order):
        k = numel(sh)
        if elements + k > bucket and elements > 0:
            flush(i, name)
            sizes, elements, own = [], 0, 0
        if elements + k > bucket:
            own += k
        sizes.append(k)
        elements += k
    if sizes:
        flush(len(order), "")
    return tuple(out)


# -- several param groups (DeepSpeed-MoE), or one: a gradient as a piece of its group's flat buffer ------
class Piece(NamedTuple):
    """One parameter's gradient as the IPG bucket sees it: its param group, its offset in the group's flat
    buffer (elements) and its numel."""
    group: int
    offset: int
    numel: int


@lru_cache(maxsize=64)
def flushes(pieces: tuple[Piece, ...], bucket: int) -> tuple[tuple[int, tuple[Piece, ...]], ...]:
    """(index of the hook that reduces it, its content) of every IPG bucket reduction, the epilogue's
    (index len(pieces)) last: a hook whose numel would take the bucket past reduce_bucket_size reduces
    the bucket first (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads); an extra-large
    gradient counts its own numel, so the next hook reduces it alone."""
    out, content, elements = [], [], 0
    for i, p in enumerate(pieces):
        if elements + p.numel > bucket and content:
            out.append((i, tuple(content)))
            content, elements = [], 0
        content.append(p)
        elements += p.numel
    if content:
        out.append((len(pieces), tuple(content)))
    return tuple(out)


def reduction_calls(content: tuple[Piece, ...], parts: tuple[int, ...], pgs: tuple[int, ...],
                    bucket: int) -> list[tuple[int, int, int]]:
    """(process group, elements, slices) of each all-reduce average_tensor makes of one bucket: a
    gradient's slice per partition of its group it lies in (parts: each group's partition elements;
    pgs: each group's process group), merged with the previous slice when both go to the same
    partition of the same process group; with use_multi_rank_bucket_allreduce each process group's
    slices go to allreduce_and_scatter, one call each time their sum passes reduce_bucket_size and one
    for the rest (allreduce_bucket: a torch.cat of several slices, a view of one)."""
    slices: list[list[int]] = []  # [process group, partition, elements]
    for p in content:
        part, pg = parts[p.group], pgs[p.group]
        end = p.offset + p.numel
        for q in range(p.offset // part, (end - 1) // part + 1):
            n = min(end, (q + 1) * part) - max(p.offset, q * part)
            if slices and slices[-1][0] == pg and slices[-1][1] == q:
                slices[-1][2] += n
            else:
                slices.append([pg, q, n])
    calls = []
    for pg in dict.fromkeys(sl[0] for sl in slices):
        acc = cnt = 0
        for _, _, n in (sl for sl in slices if sl[0] == pg):
            acc, cnt = acc + n, cnt + 1
            if acc > bucket:
                calls.append((pg, acc, cnt))
                acc = cnt = 0
        if cnt:
            calls.append((pg, acc, cnt))
    return calls


def piece_flush(pieces: tuple[Piece, ...], parts: tuple[int, ...], mine: tuple[int, ...],
                bucket: int) -> PartitionFlush:
    """partition_flushes for one rank over pieces: mine, the rank's partition in each group."""
    def in_mine(p: Piece) -> bool:
        q = mine[p.group]
        return p.offset < (q + 1) * parts[p.group] and p.offset + p.numel > q * parts[p.group]

    overlap = sum(p.numel for p in pieces if in_mine(p))
    copied = 0  # the gradients copied into the IPG buffer up to the reduction (an extra-large one is not)
    for at, content in flushes(pieces, bucket):
        copied += sum(p.numel for p in content if p.numel <= bucket)
        if any(in_mine(p) for p in content):
            return PartitionFlush(overlap, at, copied)
    return PartitionFlush(overlap, len(pieces), copied)


def piece_hooked(pieces: tuple[Piece, ...], parts: tuple[int, ...], pgs: tuple[int, ...],
                 bucket: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """hooked over pieces: per hook, the elements made and of those an all-reduce reduces in place (an
    extra-large gradient a call takes as one slice of its own storage)."""
    cum, cum_touched, a, t = [], [], 0, 0
    for p in pieces:
        a += p.numel
        if p.numel > bucket and any(n == 1 for _, _, n in reduction_calls((p,), parts, pgs, bucket)):
            t += p.numel
        cum.append(a)
        cum_touched.append(t)
    return tuple(cum), tuple(cum_touched)


def piece_ipg_touched(pieces: tuple[Piece, ...], parts: tuple[int, ...], pgs: tuple[int, ...], bucket: int) -> bool:
    """ipg_touched over pieces: a bucket of copied gradients one of whose all-reduces is of one slice (a
    view of the IPG buffer)."""
    return any(all(p.numel <= bucket for p in content)
               and any(n == 1 for _, _, n in reduction_calls(content, parts, pgs, bucket))
               for _, content in flushes(pieces, bucket))


def epilogue_copies(pieces: tuple[Piece, ...], parts: tuple[int, ...], pgs: tuple[int, ...], bucket: int,
                    names: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """The epilogue's reduction (the last bucket): (what, elements) of each flattened copy its
    all-reduces make (a call of several slices), in order; names: each process group's."""
    at, content = flushes(pieces, bucket)[-1]
    if at != len(pieces):
        return ()
    return tuple((f"{names[pg]} slices", n) for pg, n, k in reduction_calls(content, parts, pgs, bucket) if k > 1)


@lru_cache(maxsize=64)
def dense_last_reduction(model: ModelShape, dp: int, bucket: int,
                         order: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[int, tuple[tuple[str, int, int], ...]]:
    """The one flat group's gradients in `order` reduced through the IPG buffer: (how many reductions,
    each all-reduce of the last one as (what, elements, slices): a call of several slices reduces a
    flattened copy, one of one slice a view of the buffer)."""
    part, at = _flat(model, dp)
    fl = flushes(tuple(Piece(0, *at[name]) for name, _ in order), bucket)
    _at, content = fl[-1]
    calls = reduction_calls(content, (part,), (0,), bucket)
    return len(fl), tuple((f"dp slice{'s' * (k > 1)}", n, k) for _pg, n, k in calls)


@lru_cache(maxsize=64)
def dense_epilogue(model: ModelShape, dp: int, bucket: int,
                   order: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[tuple[str, int], ...]:
    """epilogue_copies of the one flat group (_flat) over dp, its gradients in `order`."""
    part, at = _flat(model, dp)
    return epilogue_copies(tuple(Piece(0, *at[name]) for name, _ in order), (part,), (0,), bucket, ("dp",))
