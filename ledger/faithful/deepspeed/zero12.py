"""DeepSpeed 0.19.8 ZeRO-1/2, faithful (runtime/zero/stage_1_and_2.py): a rank's states, its peak's
inputs (peak.py) and its collectives per optimizer step. One flat group in the model dtype, padded to
a multiple of 2 x dp; the gradients reduced through the IPG bucket, all-reduced (no reduce-scatter at
stage 1 or 2), by the grad hooks in gradient-ready order or, at stage 1 without overlap_comm, by
reduce_gradients' walk of the params at the boundary; an extra-large gradient all-reduced in slices of
its own (backward.py allreduce_calls). IPG buckets are counted a block at a time until the bucket open
at a block start repeats (_by_blocks), tested against the walk over every gradient (_buckets12).
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from functools import lru_cache

from ledger.dtypes import FP32
from ledger.faithful.deepspeed import backward as deepspeed_backward
from ledger.faithful.deepspeed import peak as deepspeed_peak
from ledger.faithful.deepspeed import rules
from ledger.faithful.deepspeed.common import (DTYPES, Calls, Memory, backward_order, block_perm, buffer_calls,
                                              counted_calls, fresh, grad_sizes, registration_sizes, size_parts)
from ledger.faithful.deepspeed.backward import PartitionFlush
from ledger.faithful.deepspeed.peak import Offload, PeakInputs
from ledger.faithful.deepspeed.target import RULES, Rules
from ledger.target import CPU_GLOO
from ledger.faithful.deepspeed.trace import block_params
from ledger.layout import Layout
from ledger.model import ModelShape, numel
from ledger.placement import Comm, CommBuilder, RankState
from ledger.units import round_up
from ledger.optim import add_adamw


def rank_states(model: ModelShape, lay: Layout, fw, target_rules: Rules = RULES[CPU_GLOO],
                ipg_reduce_dtype: str | None = None, sp: int = 1) -> Callable[[int], RankState]:
    """rank -> its state: the states and collectives are every rank's, ZeRO-2's peak its partition's;
    target_rules: the peak's target (target.py); ipg_reduce_dtype: the dtype the IPG buckets are
    all-reduced in (None: the model's; DeepSpeed-Ulysses: fp32, ulysses.py); sp: Ulysses' degree (the peak's
    activations: peak.PeakInputs.sp)."""
    s = _zero12_memory(model, lay.dp, fw.zero_stage, fw.precision).state()
    # stage 1 without overlap_comm: reduce_gradients() once, at the accumulation boundary; stage 1 with
    # overlap_comm: the hooks, also only at the boundary; stage 2 reduces every micro-batch
    # (reduce_ready_partitions_and_remove_grads: partition_gradients)
    rounds = lay.num_microbatches if fw.zero_stage == 2 else 1
    key = (model, lay.dp, fw.zero_stage, rules.overlap_comm(fw), fw.reduce_bucket_size, rounds, fw.precision,
           ipg_reduce_dtype)
    s.comm_fn = lambda: fresh(_zero12_comm(*key))
    w, part = DTYPES[fw.precision], round_up(model.num_params(), 2 * lay.dp) // lay.dp
    bucket = int(fw.reduce_bucket_size)
    # the IPG all-reduces' dtype where not the model's (the peak's cast copies: peak.cast_copies)
    reduce_w = DTYPES[ipg_reduce_dtype] if ipg_reduce_dtype not in (None, fw.precision) else 0

    def peak(flush=None, hooks=None, order=None, offload=None):
        return deepspeed_peak.peak(PeakInputs(
            model, lay.micro_batch_size, lay.num_microbatches, fw.zero_stage, w,
            bool(fw.get("activation_checkpointing", False)), part=part, params_resident=s.params_bytes,
            optim=s.optim_bytes, grads_resident=0, persist=0, n=model.num_params(), bucket=bucket,
            flush=flush, hooks=hooks,
            ipg_touched=deepspeed_backward.ipg_touched(model, lay.dp, bucket, order) if order else True,
            grads_hooked=deepspeed_backward.hooked(model, lay.dp, bucket, backward_order(model)),
            rules=target_rules,
            epilogue=deepspeed_backward.dense_epilogue(model, lay.dp, bucket, order) if order and fw.zero_stage == 2
            else (), sp=sp, reduce_w=reduce_w,
            last_reduction=deepspeed_backward.dense_last_reduction(model, lay.dp, bucket, order)
            if order and reduce_w else (), offload=offload))

    # a rank's peak depends on its partition (where its grads_in_partition is made, its size): one
    # state per distinct flush, sharing the rest. ZeRO-2 reduces in the hooks' order, ZeRO-1 (no
    # overlap_comm) in reduce_gradients' walk of the params at the boundary
    if fw.zero_stage == 1 and rules.overlap_comm(fw):
        # stage 1 then reduces in the hooks at the boundary (double IPG buffers): not a candidate
        s.peak = peak
        return lambda r: s
    order = backward_order(model) if fw.zero_stage == 2 else tuple(model.params())
    hk = deepspeed_backward.hooks(backward_order(model), model.layers)
    flushes = deepspeed_backward.partition_flushes(model, lay.dp, bucket, order)
    if rules.offloads(fw):
        return _offloaded(s, model, lay, w, part, fw.zero_stage, bucket, flushes, lambda f, o: peak(f, hk, order, o))
    by_flush: dict = {}
    for f in flushes:
        if f not in by_flush:
            st = by_flush[f] = copy.copy(s) if by_flush else s
            st.peak = (lambda f=f: peak(f, hk, order))
    return lambda r: by_flush[flushes[r % lay.dp]]


def _offloaded(s: RankState, model: ModelShape, lay: Layout, w: int, part: int, zero: int, bucket: int, flushes,
               peak) -> Callable[[int], RankState]:
    """ZeRO-1/2 under offload_optimizer.device=cpu (stage_1_and_2.py cpu_offload): each rank's state with
    ZeRO-Offload's buffers (offload_buffers), host_bytes its part on the host; its peak with no
    grads_in_partition (copy_grads_in_partition copies each reduced gradient of the partition into the host
    fp32 gradient instead)."""
    in_part = deepspeed_backward.partition_params(model, lay.dp)
    copies = deepspeed_backward.offload_copies(model, lay.dp, bucket, w)
    keys = [(flushes[r], in_part[r], copies[r]) for r in range(lay.dp)]
    by_key: dict = {}
    for r, key in enumerate(keys):
        if key not in by_key:
            st = copy.copy(s)
            st.detail = dict(s.detail)
            off = offload_buffers(st, model, lay, w, part, zero, in_part[r], copies[r])
            f = flushes[r]
            st.peak = (lambda f=f, off=off: peak(PartitionFlush(0, f.first_hook, f.copied), off))
            by_key[key] = st
    return lambda r: by_key[keys[r % lay.dp]]


def offload_buffers(s: RankState, model: ModelShape, lay: Layout, w: int, part: int, zero: int,
                    in_part: tuple[int, int], copies: int) -> Offload:
    """ZeRO-Offload's buffers added to a rank's state (stage_1_and_2.py __init__ and
    initialize_optimizer_states under cpu_offload, each on self.device = 'cpu' unless named the device's),
    s.host_bytes set; returns them as the peak reads them. The optimizer state (the fp32 partition, AdamW's
    moments) is the host's too: DeepSpeed builds the partition on self.device. part: the fp32 partition's
    elements (rank_states')."""
    largest = max(numel(sh) for _, sh in model.params())
    grads = {"fp32 gradient partition on the host (single_partition_of_fp32_groups.grad)": FP32 * part}
    if zero == 2 and lay.num_microbatches > 1:
        # copy_grads_in_partition -> async_accumulate_grad_in_cpu_via_gpu wherever micro_step_id > 0 or not the
        # boundary: ZeRO-2 from micro-batch 0's backward (setup_buckets counts every backward there), one buffer
        # per param of the partition, its whole numel in the model dtype (buffer_to_accumulate_to_in_cpu), kept
        # in accumulated_grads_in_cpu for the run. ZeRO-1 reduces only at the boundary, where micro_step_id is
        # still 0 (its ready_for_gradients is reset by the boundary's epilogue alone): none
        grads["gradients accumulated on the host (accumulated_grads_in_cpu)"] = w * in_part[1]
    host_other = {"model-dtype partition staging buffer (param_buffer_of_bit16_for_cpu_offload_groups)": w * part,
                  "temp_grad_buffer_for_cpu_offload (largest param)": w * largest}
    device_other = {"temp_grad_buffer_for_gpu_offload (largest param, on the device)": w * largest}
    for name, v in grads.items():
        s.add("grads_bytes", name, v)
    for name, v in {**host_other, **device_other}.items():
        s.add("other_bytes", name, v)
    s.host_bytes = s.optim_bytes + sum(grads.values()) + sum(host_other.values())
    return Offload(sum(grads.values()), sum(host_other.values()), sum(device_other.values()), in_part[0], copies)


@lru_cache(maxsize=256)
def _zero12_memory(model: ModelShape, dp: int, stage: int, precision: str) -> "Memory":
    n = model.num_params()
    w = DTYPES[precision]
    s = Memory()  # stage: the pipeline stage (0; DeepSpeed runs as pure DP here), not the ZeRO stage
    # stage_1_and_2.py __init__: one param group -> one flat buffer in the model dtype, padded to a
    # multiple of dp * nccl_start_alignment_factor (2) (flatten_dense_tensors_aligned; parameter_alignment
    # off: no per-param padding); params are views into it
    flat = round_up(n, 2 * dp)
    part = flat // dp
    s.add("params_bytes", f"{precision} flat group (bit16_groups_flat)", w * flat)
    # single_partition_of_fp32_groups: `partition.detach().clone().to(fp32)`, a copy of this rank's
    # slice even when the model is fp32; AdamW state on it
    s.add("optim_bytes", "fp32 partition (single_partition_of_fp32_groups)", FP32 * part)
    add_adamw(s, part, 1)  # one flat fp32 partition: one `step`
    # the gradient partition (averaged_gradients) and IPG buffers are freed in step()
    # (free_grad_in_param_list / zero_grad): nothing of the gradients survives the boundary
    s.add("other_bytes", "_global_grad_norm (fp32 scalar)", FP32)
    return s


@lru_cache(maxsize=64)
def _block_offsets(model: ModelShape) -> tuple[int, tuple[int, ...]]:
    """A block's numel and its params' offsets within it (registration order)."""
    blk = block_params(model)
    return sum(n for _, n in blk), tuple(sum(n for _, n in blk[:j]) for j in range(len(blk)))


def _flat_offset(model: ModelShape, registration: bool, i: int) -> int:
    """Offset in the flat group of the i-th parameter of registration_sizes (registration) or
    grad_sizes (gradient-ready order); the flat group is registration order without per-param padding
    (parameter_alignment off). Arithmetic on the block structure: only extra-large params ask."""
    e = model.vocab * model.hidden
    size, rel = _block_offsets(model)
    nb, layers = len(rel), model.layers
    norms = [numel(sh) for _, sh in model.norm_params("norm")]
    norm_at = e + layers * size
    out_at = norm_at + sum(norms)  # untied output, after the final norm
    if registration:  # embedding, blocks, final norm, output
        if i == 0:
            return 0
        j = i - 1
        if j < layers * nb:
            return e + (j // nb) * size + rel[j % nb]
        j -= layers * nb
        return norm_at + sum(norms[:j]) if j < len(norms) else out_at
    head = 0 if model.tied_embeddings else 1  # output, final norm, blocks last to first, embedding
    if i < head:
        return out_at
    if i < head + len(norms):
        return norm_at + sum(norms[:i - head])
    j = i - head - len(norms)
    if j >= layers * nb:
        return 0
    return e + (layers - 1 - j // nb) * size + rel[block_perm(model)[j % nb]]


@lru_cache(maxsize=256)
def _buckets12(model: ModelShape, bucket: int, registration: bool) -> tuple[tuple[int, int], ...]:
    """IPG buckets as (elements, offset): offset -1 for a bucket of gradients copied into the IPG
    buffer, the flat offset of the parameter for an extra-large one (_fill12)."""
    out: list[tuple[int, int]] = []
    cur = _fill12(model, registration_sizes(model) if registration else grad_sizes(model), 0, bucket, registration,
                  0, out)
    if cur:
        out.append((cur, -1))
    return tuple(out)


def _fill12(model: ModelShape, sizes, first: int, bucket: int, registration: bool, cur: int, out: list) -> int:
    """IPG buckets of the gradients `sizes` (the first is the first-th of the order) from a bucket
    holding `cur` elements: closed buckets appended to out as _buckets12 has them; returns the open
    bucket's elements.

    stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads: a gradient that would overflow
    the bucket flushes it first (reduce_ipg_grads; an empty bucket makes no call); a parameter with more
    than reduce_bucket_size elements is not copied into the IPG buffer but kept as
    extra_large_param_to_reduce, alone in its bucket: the next gradient (or the epilogue) flushes it.
    Stage 1 without overlap walks bit16_groups (reduce_gradients: registration order); otherwise the grad
    hooks (process_gradients) bucket in gradient-ready order."""
    for i, n in enumerate(sizes, first):
        if cur + n > bucket and cur > 0:
            out.append((cur, -1))
            cur = 0
        if n > bucket:
            out.append((n, _flat_offset(model, registration, i)))
        else:
            cur += n
    return cur


@lru_cache(maxsize=256)
def _split12(model: ModelShape, bucket: int, registration: bool):
    """_buckets12 as (copied-gradient buckets as (elements, how many), extra-large (elements, offset)):
    the first part is the same for every dp. Blocks without an extra-large parameter are counted by
    _by_blocks (an extra-large one has another offset in every block: then _buckets12 whole)."""
    head, blk, tail = size_parts(model, registration)
    if max(blk, default=0) > bucket:
        bk = _buckets12(model, bucket, registration)
        return tuple(Counter(b for b, off in bk if off < 0).items()), tuple(x for x in bk if x[1] >= 0)
    out: list[tuple[int, int]] = []
    cur = _fill12(model, head, 0, bucket, registration, 0, out)
    counts = Counter(b for b, off in out if off < 0)

    def fill(c):
        closed: list[tuple[int, int]] = []
        c = _fill12(model, blk, 0, bucket, registration, c, closed)  # no extra-large: no offsets asked
        return c, [b for b, _ in closed]

    cur = _by_blocks(fill, cur, model.layers, counts)
    large = [x for x in out if x[1] >= 0]
    out = []
    cur = _fill12(model, tail, len(head) + len(blk) * model.layers, bucket, registration, cur, out)
    counts.update(b for b, off in out if off < 0)
    if cur:
        counts[cur] += 1
    return tuple(counts.items()), tuple(large + [x for x in out if x[1] >= 0])


def allreduce_chunks(n: int, offset: int, part: int, bucket: int) -> list[int]:
    """Elements per all-reduce for an extra-large gradient of n elements at `offset` in the flat group
    (deepspeed_backward.allreduce_calls)."""
    return [e for e, _ in deepspeed_backward.allreduce_calls(n, offset, part, bucket)]


@lru_cache(maxsize=256)
def _zero12_ipg(model: ModelShape, dp: int, bucket: int, registration: bool, precision: str) -> Calls:
    """One round of IPG all-reduces (every gradient once): average_tensor(reduce_scatter=True,
    use_multi_rank_bucket_allreduce) -> allreduce_and_scatter: all-reduces (no reduce-scatter at stage
    1 or 2), in `precision` (the model dtype; fp32 under Ulysses: _zero12_comm's caller)."""
    w = DTYPES[precision]
    flat = round_up(model.num_params(), 2 * dp)
    normal, large = _split12(model, bucket, registration)
    ipg = counted_calls("all_reduce", ((w * b, k) for b, k in normal), dp)
    if large:
        chunks = [c for b, off in large for c in allreduce_chunks(b, off, flat // dp, bucket)]
        ipg = ipg.plus(buffer_calls("all_reduce", (w * c for c in chunks), dp))
    return ipg


@lru_cache(maxsize=1024)
def _zero12_comm(model: ModelShape, dp: int, stage: int, overlap: bool, bucket: int, rounds: int,
                 precision: str, ipg_reduce_dtype: str | None = None) -> tuple[Comm, ...]:
    """rounds: IPG reductions per optimizer step (rank_states); ipg_reduce_dtype: rank_states'."""
    if dp == 1:
        return ()
    n = model.num_params()
    w = DTYPES[precision]
    flat = round_up(n, 2 * dp)
    # stage 1 without overlap_comm walks bit16_groups (registration order), else the grad hooks
    registration = stage == 1 and not overlap
    reduce_dtype = ipg_reduce_dtype or precision
    ipg = _zero12_ipg(model, dp, bucket, registration, reduce_dtype).times(rounds)
    out = CommBuilder().add_calls("dp", "all_reduce", reduce_dtype, *ipg, "IPG bucket (average_tensor)")
    # step(): bf16 checks overflow (has_overflow -> all_reduce uint8 MAX; engine
    # _configure_zero_optimizer: check_grad_overflow from the bf16 section, False for fp32); grad norm
    # (fp32 SUM)
    if precision == "bf16":
        out.add_calls("dp", "all_reduce", "uint8", *buffer_calls("all_reduce", [1], dp), "overflow check")
    out.add_calls("dp", "all_reduce", "fp32", *buffer_calls("all_reduce", [FP32], dp), "grad norm")
    # utils.all_gather_dp_groups -> all_gather_into_tensor_dp_groups: one call per param group
    out.add_calls("dp", "all_gather", precision, *buffer_calls("all_gather", [w * flat], dp), f"updated {precision} partitions")
    return tuple(out.build())


def _by_blocks(fill, cur: int, layers: int, out: Counter) -> int:
    """`fill` (the bucket open when a block starts -> the bucket it leaves open, the buckets it
    closes) over `layers` identical blocks, counting the closed buckets into `out`; returns the bucket
    left open. What a block closes and leaves open depends only on the bucket open at its start: once
    that repeats, the blocks in between repeat, and the rest are counted whole periods at a time."""
    seen: dict | None = {}  # the bucket open at a block start -> that block
    walked: list = []  # each walked block's closed buckets
    i = 0
    while i < layers:
        if seen is not None:
            if cur in seen:
                j = seen[cur]
                reps = (layers - i) // (i - j)
                for closed in walked[j:i]:
                    for b in closed:
                        out[b] += reps
                i += reps * (i - j)
                seen = None
                continue
            if i < 16:
                seen[cur] = i
            else:  # no repeat soon (a bucket above a block): walk on
                seen = None
        cur, closed = fill(cur)
        out.update(closed)
        if seen is not None:
            walked.append(closed)
        i += 1
    return cur
