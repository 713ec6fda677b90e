"""DeepSpeed 0.19.8 ZeRO-3, faithful (runtime/zero/stage3.py, partition_parameters.py): a rank's states,
its peak's inputs (peak.py) and its collectives per optimizer step: step 0 (the trace recorded, then
completed), a warm-up step 1 with one micro-batch, the steady step. The parameter fetches are the
coordinator replay's (coordinator.py: all-gathers as numel tuples, dp-independent), padded to dp here;
the gradients reduce-scattered per IPG bucket (backward.py z3_flushes); the persistent params
gathered again by _post_step.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import NamedTuple

from ledger.dtypes import FP32, FP64, INT64
from ledger.faithful.deepspeed import backward as deepspeed_backward
from ledger.faithful.deepspeed import peak as deepspeed_peak
from ledger.faithful.deepspeed.common import (DTYPES, Calls, Memory, backward_order, buffer_calls, counted_calls,
                                              fresh, size_parts)
from ledger.faithful.deepspeed.coordinator import z3_fetches, z3_steady
from ledger.faithful.deepspeed.gathered import z3_backward_moments, z3_first_moments, z3_moments, z3_recompute_moments
from ledger.faithful.deepspeed.peak import Offload, PeakInputs
from ledger.faithful.deepspeed.rules import offloads, offloads_params
from ledger.faithful.deepspeed.target import RULES, Rules
from ledger.target import CPU_GLOO
from ledger.faithful.deepspeed.trace import backward_module, z3_trace
from ledger.layout import Layout
from ledger.model import ModelShape, numel
from ledger.placement import Comm, CommBuilder, RankState
from ledger.units import round_up
from ledger.optim import add_adamw


class _Z3Shape(NamedTuple):
    """What ZeRO-3 derives from the model for one dp and persistence threshold (elements)."""
    part: int  # ds_tensor elements per rank (sum of padded sizes / dp)
    total: int  # sum of padded sizes
    # persistent params as kept gathered: each param.data a view of its own all-gather's buffer
    # (partition_parameters.py _all_gather_sequential: ceil(n/dp)*dp elements), so padded to dp
    persist_gathered: int
    persist: Calls  # _post_step: one all-gather per persistent param (model dtype)
    ipg: Calls  # one backward's IPG reduce-scatters


@lru_cache(maxsize=256)
def _z3_shape(model: ModelShape, dp: int, threshold: int, bucket: int, w: int, w_reduce: int | None = None) -> _Z3Shape:
    """w: bytes per element of the model dtype (params gathered, gradients reduce-scattered in it);
    w_reduce: the reduce-scatters' where another (the engine's communication_data_type: Ulysses')."""
    # partition_parameters.py _aligned_size: each param padded to a multiple of dp; ds_persist when
    # ds_numel <= param_persistence_threshold (Init._convert_to_deepspeed_param; the model-wide
    # stage3_model_persistence_threshold is left at its default, sys.maxsize)
    head, blk, tail = size_parts(model, True)  # every Parameter once: few distinct sizes
    counts = Counter(head + tail)
    for n, k in Counter(blk).items():
        counts[n] += k * model.layers
    pad = {n: round_up(n, dp) for n in counts}.__getitem__
    persist = [(n, k) for n, k in counts.items() if n <= threshold]
    total = sum(pad(n) * k for n, k in counts.items())
    return _Z3Shape(
        part=total // dp, total=total, persist_gathered=sum(pad(n) * k for n, k in persist),
        persist=counted_calls("all_gather", ((w * pad(n), k) for n, k in persist), dp),
        # stage3.py __avg_scatter_grads -> reduce_scatter_coalesced: one reduce-scatter per IPG bucket
        # (each gradient padded to dp; the bucket fills by ds_numel, unpadded). A parameter above
        # reduce_bucket_size is not copied into the IPG buffer (__add_grad_to_ipg_bucket) but is
        # bucketed alike: alone, one reduce-scatter of it (deepspeed_backward.z3_flushes)
        ipg=counted_calls("reduce_scatter", (((w_reduce or w) * b, k) for b, k in Counter(
            f.flat for f in deepspeed_backward.z3_flushes(dp, bucket, backward_order(model))).items()), dp),
    )


def rank_state(model: ModelShape, lay: Layout, fw, target_rules: Rules = RULES[CPU_GLOO],
               reduce_precision: str | None = None, sp: int = 1) -> RankState:
    """Every rank's state (the same on each): the states, the collectives on first read, the peak
    (target_rules: its target's, target.py). reduce_precision: the dtype of the IPG bucket and its
    reduce-scatters where not the model's (the engine's communication_data_type: DeepSpeed-Ulysses'
    seq_parallel_communication_data_type, ulysses.py: the peak's reduce-scatters in it); sp: Ulysses' degree
    (the peak's activations: peak.PeakInputs.sp)."""
    dp, m, prec = lay.dp, lay.num_microbatches, fw.precision
    red = reduce_precision if reduce_precision not in (None, prec) else None
    ac = bool(fw.get("activation_checkpointing", False))  # the checkpoint's recompute fetches again (trace.py)
    off = offloads(fw)
    s = _zero3_memory(model, dp, fw.stage3_param_persistence_threshold, fw.reduce_bucket_size, prec, red, off).state()
    key = (model, dp, m, fw.stage3_param_persistence_threshold, fw.reduce_bucket_size,
           int(fw.stage3_prefetch_bucket_size), int(fw.stage3_max_live_parameters), int(fw.stage3_max_reuse_distance),
           prec, ac, red, off)
    # steady and first-step collectives on first read; a warm-up step (step 1) only with one micro-batch
    s.comm_fn = lambda: fresh(_zero3_steady(*key))
    s.comm_first = lambda: fresh(_zero3_comm(*key)[1])
    s.comm_warmup = (lambda: [fresh(_zero3_warmup(*key))]) if m == 1 else None  # built on first read
    w = DTYPES[prec]
    z = _z3_shape(model, dp, fw.stage3_param_persistence_threshold, fw.reduce_bucket_size, w)
    budgets = (model, m, fw.stage3_param_persistence_threshold, int(fw.stage3_prefetch_bucket_size),
               int(fw.stage3_max_live_parameters), int(fw.stage3_max_reuse_distance), dp, w)
    offload, par = None, offloads_params(fw)
    if off or par:
        # the host fp32 gradient partition is the peak's offload line (grads_resident the device's);
        # norm_for_param_grads: one fp64 norm per param with real data in this rank's partition (rank 0's: every
        # param). offload_param (stage3.py _create_param_groups_fp16_flat_cpu_memory): the model-dtype partitions
        # in host memory, each gather copying the partitions it gathers to the device first
        # (partition_parameters.py all_gather_coalesced: `p.ds_tensor.to(device)`; on the CPU harness the same
        # memory, no copy): bounded by the largest fetch's
        host_grads, host_params = FP32 * z.part if off else 0, w * z.part if par else 0
        copies = FP64 * max(round_up(numel(sh), dp) // dp for _, sh in model.params()) if off else 0
        if par and not target_rules.host_is_device:
            calls = z3_steady(model, m, fw.stage3_param_persistence_threshold, int(fw.stage3_prefetch_bucket_size),
                              int(fw.stage3_max_live_parameters), int(fw.stage3_max_reuse_distance), ac=ac)
            copies += w * max((sum(round_up(n, dp) for n in key) // dp for key in calls), default=0)
        offload = Offload(host_grads, 0, 0, len(model.params()) if off else 0, copies, host_params, optimizer=off)
        s.host_bytes = (s.optim_bytes if off else 0) + host_grads + host_params
    s.peak = lambda: deepspeed_peak.peak(PeakInputs(
        model, lay.micro_batch_size, m, 3, w, ac, part=z.part, params_resident=s.params_bytes,
        optim=s.optim_bytes, grads_resident=s.grads_bytes - (offload.host_grads if offload else 0),
        persist=w * z.persist_gathered, offload=offload,
        n=model.num_params(), bucket=int(fw.reduce_bucket_size),
        z3_moments=z3_moments(*budgets, ac=ac), z3_first=z3_first_moments(*budgets, ac=ac),
        z3_flushes=_z3_flush_moments(model, budgets, int(fw.reduce_bucket_size), ac),
        z3_swiglu=_z3_swiglu_moments(model, budgets) if ac else ((), ()), dp=dp, rules=target_rules, sp=sp,
        reduce_w=DTYPES[red] if red else 0))
    return s


def _z3_swiglu_moments(model: ModelShape, budgets: tuple) -> tuple[tuple, tuple]:
    """With checkpointing: the coordinator's gathered params at each block's recompute end and right after
    its w2 released its params in the backward (its SwiGLU backward follows), per micro-batch of a steady
    step and of step 0 (gathered.z3_recompute_moments)."""
    mods = tuple(backward_module(model, budgets[2], f"layers.{j}.feed_forward.w2.weight", True)
                 for j in range(model.layers))
    return z3_recompute_moments(*budgets, False, mods), z3_recompute_moments(*budgets, True, mods)


def _z3_flush_moments(model: ModelShape, budgets: tuple, bucket: int, ac: bool = False) -> tuple:
    """ZeRO-3's IPG reductions in a backward, with the coordinator's gathered params at each (at its hook's
    module; the epilogue's, "", at the embedding's fetch, the backward's last), per micro-batch of a steady
    step and of step 0."""
    threshold, dp = budgets[2], budgets[6]
    flushes = deepspeed_backward.z3_flushes(dp, bucket, backward_order(model))
    mods = tuple(backward_module(model, threshold, f.name or "tok_embeddings.weight", ac) for f in flushes)
    return flushes, z3_backward_moments(*budgets, False, mods, ac), z3_backward_moments(*budgets, True, mods, ac)


@lru_cache(maxsize=256)
def _zero3_memory(model: ModelShape, dp: int, threshold: int, bucket: int, precision: str,
                  reduce: str | None = None, offload: bool = False) -> "Memory":
    w = DTYPES[precision]
    z = _z3_shape(model, dp, threshold, bucket, w)
    s = Memory()  # pipeline stage 0
    # stage3.py _create_fp16_partitions_with_defragmentation: the ds_tensors of one sub-group live in
    # fp16_partitioned_groups_flat, in the model dtype (sub_group_size 1e9 >> tiny models: one group)
    s.add("params_bytes", f"{precision} partitions (ds_tensor, fp16_partitioned_groups_flat)", w * z.part)
    # ds_persist params stay gathered after _post_step (full tensors); whatever else the coordinator
    # gathered was released by step()'s _partition_all_parameters (release_and_reset_all)
    s.add("params_bytes", "persistent params (full, each in its dp-padded all-gather buffer)", w * z.persist_gathered)
    # grad_partitions_flat_buffer (gradient_accumulation_dtype = model dtype) and the IPG bucket of
    # reduce_bucket_size elements, allocated at init and kept (IPGBucketZ3), also when a parameter is
    # larger than the bucket; micro-batches accumulate into the same partitions (partition_grads:
    # copy_ at micro_step_id 0, add_ after)
    s.add("grads_bytes", "grad partitions (grad_partitions_flat_buffer)", w * z.part)
    # (IPGBucketZ3 in the engine's communication_data_type: `reduce` where not the model dtype)
    s.add("grads_bytes", "IPG bucket (reduce_bucket_size)", DTYPES[reduce or precision] * bucket)
    # _create_fp32_partitions: an fp32 copy (.to(self.device, fp32).clone()), fp32 models too: its
    # no-copy branch needs `fp16_partitioned_groups_flat[i].device == self.device`, a torch.device
    # against the accelerator's device name (a str: 'cpu', 'cuda:0'), which is never equal
    s.add("optim_bytes", "fp32 partition (fp32_partitioned_groups_flat)", FP32 * z.part)
    add_adamw(s, z.part, 1)  # one flat fp32 partition: one `step`
    if offload:
        # ZeRO-Offload (offload_optimizer.device=cpu): the fp32 partition and AdamW's state on the host
        # (self.device), and the partition's fp32 gradient, made once in _create_fp32_partitions
        # (subgroup_gradient_buffer, kept for the run: _release_sub_group keeps it); the grad norm
        # complete_grad_norm_calculation_for_cpu_offload's fp32 tensor
        s.add("grads_bytes", "fp32 gradient partition on the host (fp32_partitioned_groups_flat.grad)", FP32 * z.part)
        s.add("other_bytes", "_global_grad_norm (fp32 scalar: the offload path's norm)", FP32)
    else:
        s.add("other_bytes", "_global_grad_norm (fp64 scalar)", FP64)
    s.add("other_bytes", "inf_or_nan_tracker (bool)", 1)
    return s


def _gathers(calls: Counter, dp: int, w: int) -> Calls:
    """all_gather_coalesced: one all-gather per call of the params' padded partitions (w bytes/element)."""
    return counted_calls("all_gather", ((w * sum([round_up(n, dp) for n in key]), k) for key, k in calls.items()), dp)


_COMPLETING_WHAT = "trace checks (reset_step completing the trace)"


def _steady_fetches(model: ModelShape, dp: int, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
                    precision: str, ac: bool = False) -> CommBuilder:
    """A new builder holding the coordinator's all-gathers of a steady step (coordinator.z3_steady), which step 1
    (one micro-batch) makes too."""
    calls = z3_steady(model, m, threshold, prefetch, max_live, reuse, ac=ac)
    return CommBuilder().add_calls("dp", "all_gather", precision, *_gathers(calls, dp, DTYPES[precision]),
                                   "coordinator fetch + prefetch (fetch_sub_module), every micro-batch")


def _zero3_common(out: CommBuilder, model: ModelShape, dp: int, m: int, threshold: int, bucket: int,
                  precision: str, reduce: str | None = None, offload: bool = False) -> CommBuilder:
    """What every optimizer step adds besides the parameter fetches (reduce, offload: rank_state's)."""
    ipg, norm, persist = _zero3_fixed(model, dp, threshold, bucket, precision, reduce, offload)
    # stage3.py reduce_partition_and_remove_grads -> __reduce_and_partition_ipg_grads in every
    # backward's hooks, the rest flushed by independent_gradient_partition_epilogue: every
    # micro-batch reduce-scatters all gradients (__avg_scatter_grads), partitions accumulate
    out.add_calls("dp", "reduce_scatter", reduce or precision, *ipg.times(m), "IPG bucket (__avg_scatter_grads)")
    out.add_calls("dp", "all_reduce", "fp32" if offload else "fp64", *norm, "grad norm")
    out.add_calls("dp", "all_gather", precision, *persist, "persistent params (_post_step)")
    return out


@lru_cache(maxsize=256)
def _zero3_fixed(model: ModelShape, dp: int, threshold: int, bucket: int,
                 precision: str, reduce: str | None = None, offload: bool = False) -> tuple[Calls, Calls, Calls]:
    """_zero3_common's calls whatever the micro-batches: one backward's IPG reduce-scatters; at the
    boundary get_grad_norm_direct's fp64 norm all-reduce (offload: complete_grad_norm_calculation_for_cpu_offload's
    fp32 one; only fp16 has an overflow all-reduce at stage 3) and _post_step's
    persistent_parameters[0].all_gather(persistent_parameters)."""
    z = _z3_shape(model, dp, threshold, bucket, DTYPES[precision], DTYPES[reduce] if reduce else None)
    return z.ipg, buffer_calls("all_reduce", [FP32 if offload else FP64], dp), z.persist


@lru_cache(maxsize=1024)
def _zero3_steady(model: ModelShape, dp: int, m: int, threshold: int, bucket: int, prefetch: int, max_live: int,
                  reuse: int, precision: str, ac: bool = False, reduce: str | None = None,
                  offload: bool = False) -> tuple[Comm, ...]:
    """_zero3_comm's steady step alone (a search reads no other)."""
    if dp == 1:
        return ()
    out = _steady_fetches(model, dp, m, threshold, prefetch, max_live, reuse, precision, ac)
    return tuple(_zero3_common(out, model, dp, m, threshold, bucket, precision, reduce, offload).build())


@lru_cache(maxsize=1024)
def _zero3_comm(model: ModelShape, dp: int, m: int, threshold: int, bucket: int, prefetch: int, max_live: int,
                reuse: int, precision: str, ac: bool = False, reduce: str | None = None, offload: bool = False):
    """(steady, step 0, step 1 or None) collectives of one rank.

    The coordinator's trace (partitioned_param_coordinator.py): reset_step runs at the start of every
    forward (parameter_offload.py _start_of_forward_hook), i.e. every micro-batch. The first one finds
    the trace INVALID: assert_ints_same_as_other_ranks on the empty module list (a length broadcast and
    an empty list broadcast), then RECORD. The recording forward + backward fetch each module's params
    (fetch_sub_module, no prefetch) and release all of them after its forward and after its backward
    (release_sub_module, trace not complete: persistent params too). The next reset_step checks the
    recorded module list, the parameter list and their step ids (three length + list broadcasts) and
    marks the trace COMPLETE; from then on _Z3Sim replays the coordinator (fetch, prefetch, release)
    for the prefetch bucket, live-parameter and reuse-distance budgets. step() releases everything
    (_partition_all_parameters) and _post_step gathers the persistent params again."""
    if dp == 1:
        return (), (), (None if m > 1 else ())
    w = DTYPES[precision]
    t = precision  # the dtype of the param all-gathers and gradient reduce-scatters
    record, rest0, _ = z3_fetches(model, m, threshold, prefetch, max_live, reuse, ac=ac)

    def common(out: CommBuilder) -> CommBuilder:
        return _zero3_common(out, model, dp, m, threshold, bucket, precision, reduce, offload)

    steady = _zero3_steady(model, dp, m, threshold, bucket, prefetch, max_live, reuse, precision, ac, reduce, offload)

    # step 0, micro-batch 0: the empty-trace check, then the recording pass (forward + backward)
    first = CommBuilder().add_calls("dp", "all_gather", t, *_gathers(record, dp, w), "untraced per-module fetch, forward + backward")
    first.add_calls("dp", "broadcast", "int64", *buffer_calls("broadcast", [INT64, 0], dp), "trace checks (empty trace, INVALID -> RECORD)")
    if m == 1:
        return steady, tuple(common(first).build()), _zero3_warmup(model, dp, m, threshold, bucket, prefetch, max_live,
                                                                   reuse, precision, ac, reduce, offload)
    # micro-batch 1 completes the trace and starts with nothing gathered; later ones follow on
    first.add_calls("dp", "broadcast", "int64", *_trace_checks(model, threshold, dp, ac), _COMPLETING_WHAT)
    first.add_calls("dp", "all_gather", t, *_gathers(rest0, dp, w), "coordinator fetch + prefetch, first complete passes")
    return steady, tuple(common(first).build()), None


@lru_cache(maxsize=1024)
def _zero3_warmup(model: ModelShape, dp: int, m: int, threshold: int, bucket: int, prefetch: int, max_live: int,
                  reuse: int, precision: str, ac: bool = False, reduce: str | None = None,
                  offload: bool = False) -> tuple[Comm, ...]:
    """_zero3_comm's step 1 (one micro-batch; built apart: a RankState holds it from the start): it
    starts with the trace completion, then runs as steady state."""
    if dp == 1:
        return ()
    warmup = _steady_fetches(model, dp, m, threshold, prefetch, max_live, reuse, precision, ac)
    warmup.add_calls("dp", "broadcast", "int64", *_trace_checks(model, threshold, dp, ac), _COMPLETING_WHAT)
    return tuple(_zero3_common(warmup, model, dp, m, threshold, bucket, precision, reduce, offload).build())


def _trace_checks(model: ModelShape, threshold: int, dp: int, ac: bool = False) -> Calls:
    """reset_step completing the trace: assert_ints_same_as_other_ranks (zero/utils.py: a length
    broadcast, then the list broadcast) on the module ids (every fetch, forward and backward), the
    param ids (record_parameters: each fetched module's params) and their step ids."""
    tr = z3_trace(model, threshold, ac)
    n_mod, n_par = tr.steps, len(tr.qp)
    return buffer_calls("broadcast", [INT64, INT64 * n_mod, INT64, INT64 * n_par, INT64, INT64 * n_par], dp)
