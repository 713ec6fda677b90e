"""DeepSpeed 0.19.8 ZeRO-2: where a rank's grads_in_partition is made in a backward (issue 18).

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

from ledger.model import ModelShape, numel


class PartitionFlush(NamedTuple):
    overlap: int  # elements of grads_in_partition: every parameter overlapping the partition, whole
    first_hook: int  # backward_order index of the hook whose reduction first copies into it (len: the epilogue's)


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


@lru_cache(maxsize=64)
def partition_flushes(model: ModelShape, dp: int, bucket: int,
                      order: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[PartitionFlush, ...]:
    """Per rank of a dp group: its grads_in_partition's elements and the hook that allocates it.
    order: the parameters in the order their hooks fire (deepspeed.backward_order).

    The flat group is the params in registration order (stage_1_and_2.py: one param group, padded to
    a multiple of 2 * dp; partitions of flat / dp elements; is_param_in_current_partition: the param
    overlaps the partition). The bucket: a hook whose numel would take the bucket's elements past
    reduce_bucket_size reduces the bucket first (an extra-large gradient alone counts its own numel,
    so the next hook always reduces it)."""
    regs = model.params()
    n = sum(numel(sh) for _, sh in regs)
    part = _ceil_to(n, 2 * dp) // dp
    span: dict[str, tuple[int, int]] = {}  # name -> (first rank, last rank) its elements lie in
    overlap = [0] * dp
    off = 0
    for name, sh in regs:
        k = numel(sh)
        lo, hi = off // part, (off + k - 1) // part
        span[name] = (lo, hi)
        for r in range(lo, hi + 1):
            overlap[r] += k
        off += k
    first = [len(order)] * dp
    left = dp
    content: list[str] = []
    elements = 0

    def reduce(at: int) -> int:
        done = 0
        for name in content:
            lo, hi = span[name]
            for r in range(lo, hi + 1):
                if first[r] == len(order) and at < len(order):
                    first[r] = at
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
    return tuple(PartitionFlush(overlap[r], first[r]) for r in range(dp))


class Hooks(NamedTuple):
    """backward_order indexes of the hooks the backward moments are placed by."""
    norm: int  # the final norm's weight (0 when tied: the output's weight is the embedding's, last)
    w2: tuple[int, ...]  # per layer, its feed_forward.w2 weight's: the block's first gradient


@lru_cache(maxsize=64)
def hooks(order: tuple[tuple[str, tuple[int, ...]], ...], layers: int) -> Hooks:
    at = {name: i for i, (name, _) in enumerate(order)}
    return Hooks(at["norm.weight"], tuple(at[f"layers.{j}.feed_forward.w2.weight"] for j in range(layers)))
