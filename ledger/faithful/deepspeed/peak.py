"""DeepSpeed 0.19.8 ZeRO-1/2/3, faithful: the most live bytes of a rank within one optimizer step.

What the probe (probes/peak.py) sees on the plain Llama (launchers/llama.py), one candidate per moment:

- the optimizer step (engine.step() at the accumulation boundary), where the tiny and small shapes peak:
  torch AdamW's single-tensor update on the flat fp32 partition (torch/optim/adam.py
  _single_tensor_adam, foreach off on CPU tensors: `denom = (exp_avg_sq.sqrt() /
  bias_correction2_sqrt).add_(eps)`: two fp32 partitions alive at the division) on top of the fp32
  gradient partition the step builds (stage_1_and_2.py step: `flat_grad_partition.to(fp32)`;
  stage3.py _prepare_fp32_grad_for_sub_group: `flatten(averaged_gradients).to(fp32)`), the resident
  state as it is then (ZeRO-3 released every gathered parameter, the persistent ones too, in step()'s
  _partition_all_parameters; its grad partitions and IPG bucket stay), the new and the previous
  `_global_grad_norm`, the norm scalars step() still holds, the last micro-batch's loss and batch;
- the last micro-batch's backward, its first nodes: resident state + the activations its forward
  saved (saved_activations) + the cross-entropy's gradients in fp32 (nll_loss_backward,
  _log_softmax_backward_data: b·s·V fp32 each), or a moment later the output Linear's weight and
  input gradients beside the logits' (fp32 makes that one larger), + what ZeRO-1 holds across
  micro-batches (param.grad, the IPG buffer). Measured exact: ZeRO-1/2 bf16 at one micro-batch (4
  samples: the matrix's ac job), fp32 ZeRO-1 at 4 ranks and 2 micro-batches (the held gradients a
  boundary collective reduces in place `gathered`, as the probe files them). ZeRO-3 (steady step): the
  gathered parameters at this moment from the coordinator replay (gathered.z3_moments);
- ZeRO-3 only, each micro-batch's forward at the final norm (its last op): every layer's saves live,
  and what the coordinator gathered: with the default budgets one prefetch at the root gathers every
  non-persistent param in one all_gather_coalesced, whose flat buffer stays beside the params' torch.cat
  copies until the output's fetch pops its last param. Step 0 (several micro-batches): the ones after
  the recording one, whose first complete pass also gathers the persistent params (_post_step gathers
  them only at step 0's end), from z3_first_moments. Where the 4-rank ZeRO-3 jobs peak, exact.
- ZeRO-1 (no overlap_comm), reduce_gradients at the boundary (reduce_gradients_at_boundary): every gradient backward
  made is still live (param.grad) but those already copied into the IPG buffer in registration order,
  when the first reduction into the rank's partition allocates grads_in_partition. Exact at 4 ranks,
  fp32, one micro-batch; with one micro-batch ZeRO-1's backward moments are deep_in_backward's too, its hooks
  keeping every gradient they see (DeepSpeed's default config peaks in a block's ffn_norm backward).
- ZeRO-2 (and ZeRO-1 with one micro-batch), deeper in the last micro-batch's backward (deep_in_backward): the
  first hook (setup_buckets allocates the IPG buffer: where ZeRO-2 with DeepSpeed's default bucket
  peaks, exact), the final norm's backward, each block's SwiGLU backward and its ffn_norm's backward
  (PowBackward: where ZeRO-1 with the default bucket peaks, exact), with the IPG buffer, the
  extra-large gradient waiting for the next hook and the rank's grads_in_partition buffers as its
  hooks have made them (deepspeed_backward: micro-batch 0's kept by all_grad_tensors, this
  backward's from the first reduction into the partition; per rank, as its partition lies). Where
  fp32 ZeRO-2 at 4 ranks and 2 micro-batches peaks, exact on every rank.
- ZeRO-3, each micro-batch's backward at an IPG bucket's reduce-scatter (ipg_reduce_scatter;
  deepspeed_backward.z3_flushes): the padded gradients' torch.cat and gloo's copy of it, the hook's own
  gradient and what autograd holds there, the coordinator's gathered params at that module
  (gathered.z3_backward_moments), at every hook (z3_hook_moment) and at the backward's
  epilogue: with DeepSpeed's default bucket every gradient waits for the epilogue, where ZeRO-3 at 4
  ranks and short sequences peaks. Each hook's moment is where a matrix job peaks, exact; so are
  ZeRO-3 at 4 ranks with a partial reuse distance and tied with nothing kept (were 1.5% and 0.63%
  under).
With activation checkpointing (ZeRO-1/2) the deep backward moments are a block's after its recompute:
its recomputed saves, the blocks below holding their inputs, its recompute's output (_Step.ac; where
tiny at s = 512 peaks, exact). An estimate elsewhere: ZeRO-1's reductions in the hooks with
overlap_comm.
tests/test_deepspeed.py PEAK_FINDINGS names the matrix jobs that are not exact.
One function per moment: optimizer_step, backward_start, forward_at_final_norm, deep_in_backward,
reduce_gradients_at_boundary, ipg_reduce_scatter (z3_hook_moment: what autograd holds at a ZeRO-3
hook); peak takes the largest of a step's, the steady step's and step 0's, from PeakInputs. The
activations they count are activations.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ledger.dtypes import FP32, FP64
from ledger.faithful.deepspeed.activations import (Dispatch, batch_bytes, ffn_saves, head_activations,
                                                   layer_activations, modelled, most_live_activations, per_kind,
                                                   recomputed_aux, saved_activations)
from ledger.faithful.deepspeed.backward import Hooks, PartitionFlush, Z3Flush
from ledger.faithful.deepspeed.gathered import Z3Live
from ledger.faithful.deepspeed.target import RULES, Rules
from ledger.target import CPU_GLOO
from ledger.model import ModelShape
from ledger.placement import Peak


def _loss_scalars() -> int:
    # the loss (nll_loss's fp32 scalar), engine.backward's scaled copy and its product
    # (_scale_loss_by_gas, the loss scaler's mul) and the gradient seed (ones_like): four scalars
    return 4 * FP32


class Offload(NamedTuple):
    """ZeRO-Offload's buffers (zero12.offload_buffers), resident from the engine's construction (the
    accumulated gradients from micro-batch 0's backward): bytes on the host by state, bytes on the device,
    and the params of the rank's partition (each leaves one fp64 norm until step() ends)."""
    host_grads: int
    host_other: int
    device_other: int
    params_in_partition: int
    # the most one reduction's copy into the host partition holds at once (backward.offload_copies), and on a
    # GPU ZeRO-3's offloaded partitions copied to the device for a gather: the moments of those copies are not
    # placed, the peak is bounded by them (Peak.bound)
    copies: int = 0
    host_params: int = 0  # ZeRO-3's offload_param: its model-dtype partitions on the host
    optimizer: bool = True  # the optimizer offloaded (offload_optimizer); False: ZeRO-3's parameters alone


def optimizer_offloaded(i: "PeakInputs") -> bool:
    return i.offload is not None and i.offload.optimizer


@dataclass(frozen=True)
class PeakInputs:
    """What one rank's peak is computed from (zero.py's ZeRO-1/2 and zero3.py's ZeRO-3 build it).

    mbs: micro-batch size; m: micro-batches per step; zero: the ZeRO stage; w: model dtype bytes;
    checkpointing: framework.activation_checkpointing. part: fp32 partition elements;
    params_resident: the params at the boundary (bytes); optim: the optimizer state (bytes);
    grads_resident: ZeRO-3's grad partitions + IPG bucket (bytes; 0 for ZeRO-1/2, freed in step());
    persist: ZeRO-3's persistent params (full, bytes); n: model elements; bucket: reduce_bucket_size
    (elements); z3_moments (ZeRO-3, required): the gathered parameters per micro-batch of a steady step
    at the final norm's forward, the backward's start and the output's backward
    (gathered.z3_moments); z3_first: the same for step 0's replayed passes
    (gathered.z3_first_moments); flush (ZeRO-2, required): this rank's grads_in_partition
    size and the hook that allocates it (deepspeed_backward.partition_flushes); hooks (ZeRO-2, required):
    where the final norm's and each block's first hook are in the backward (deepspeed_backward.hooks);
    ipg_touched: whether a collective reduces the IPG buffer itself (deepspeed_backward.ipg_touched);
    grads_hooked (ZeRO-1): the elements of the gradients made through each hook, and of those reduced in
    place (deepspeed_backward.hooked); z3_flushes (ZeRO-3): a backward's IPG reductions
    (deepspeed_backward.z3_flushes) and, per micro-batch of a steady step and of step 0, the gathered
    params at each (gathered.z3_backward_moments); z3_swiglu (ZeRO-3 with checkpointing): per micro-batch of
    a steady step and of step 0, the gathered params at each block's recompute end and right after its w2
    released its params (gathered.z3_recompute_moments), for the block's SwiGLU backward after its recompute.

    Several param groups (DeepSpeed-MoE: moe.py): dispatch, the MoE layers' expert-parallel size and
    capacity (their saves: activations.moe_saves); group_parts, each group's fp32 partition elements
    in step()'s order (empty: one group, `part`); other_extra, resident `other` bytes beside the grad
    norm (the MoE layers' l_aux and exp_counts); samplers, module-level tensors made in step 0's
    forward and kept (DeepSpeed-MoE's cached random samplers: step 0 `temporary`, then `unnamed`);
    epilogue, ZeRO-2's last reduction of a backward, (what, elements) of each flattened copy its
    all-reduces make (a process group's slices of the bucket, several: torch.cat) in order. With
    dispatch and checkpointing, what a checkpointed MoE layer's recompute leaves behind
    (activations.recomputed_aux) is live at every moment past the backward and in the later blocks'."""
    model: ModelShape
    mbs: int
    m: int
    zero: int
    w: int
    checkpointing: bool
    part: int
    params_resident: int
    optim: int
    grads_resident: int
    persist: int
    n: int
    bucket: int
    z3_moments: tuple = ()
    z3_first: tuple = ()
    flush: PartitionFlush | None = None
    hooks: Hooks | None = None
    ipg_touched: bool = True
    grads_hooked: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    z3_flushes: tuple[tuple[Z3Flush, ...], tuple, tuple] = ((), (), ())
    z3_swiglu: tuple[tuple, tuple] = ((), ())  # ZeRO-3 checkpointed: the gathered params in each block's recompute
    dp: int = 1  # the data-parallel degree (ZeRO-3 with checkpointing: whether a gradient reduces as it is)
    rules: Rules = RULES[CPU_GLOO]  # the target's (target.py)
    dispatch: Dispatch | None = None
    group_parts: tuple[int, ...] = ()
    other_extra: int = 0
    samplers: int = 0
    epilogue: tuple[tuple[str, int], ...] = ()
    sp: int = 1  # DeepSpeed-Ulysses' degree (ulysses.py): model is then the rank's slice of the sequence
    # the gradient reductions' dtype bytes where not the model's (DeepSpeed-Ulysses: ZeRO-3's reduce-scatters
    # in the engine's communication_data_type, fp32 by default; ZeRO-1/2's allreduce_bucket in fp32); 0: the
    # model's (zero12.py and zero3.py set it only where the dtypes differ)
    reduce_w: int = 0
    # ZeRO-1/2 with reduce_w: (the reductions of a step's last backward or boundary, each all-reduce of the
    # last one as (what, elements, slices)): backward.dense_last_reduction
    last_reduction: tuple = ()
    # ZeRO-1/2 with offload_optimizer (zero12.py): its buffers; the optimizer state and step on the host,
    # grads_in_partition never made (flush.overlap 0)
    offload: Offload | None = None


class _Step:
    """What every moment of one rank's step reads besides PeakInputs, derived once: the activations a
    micro-batch's forward saved, what is held across micro-batches, where the backward stands."""

    def __init__(self, i: PeakInputs):
        model, mbs, w, zero, m = i.model, i.mbs, i.w, i.zero, i.m
        self.i = i
        self.acts, self.held = saved_activations(model, mbs, w, i.checkpointing, i.dispatch, i.sp)
        self.act = sum(self.acts.values())
        self.batch = batch_bytes(model, mbs, i.sp)
        # stage3.py get_grad_norm_direct works in fp64; under offload its complete_grad_norm_calculation_for_cpu_offload
        # in fp32, as ZeRO-1/2's do
        self.norm_dtype = FP64 if zero == 3 and not optimizer_offloaded(i) else FP32
        b, s, V = mbs, model.seq_len, model.vocab
        self.b, self.s, self.V, self.h = b, s, V, model.hidden
        held_grads = held_touched = 0
        if m > 1 and zero == 1:
            # param.grad of every parameter, accumulated until the boundary's reduce_gradients, and the
            # IPG buffer setup_buckets allocated in micro-batch 0's backward (reduce_bucket_size
            # elements), released only by the boundary reduction's _release_ipg_buffers. Those a boundary
            # collective reduces in place (the extra-large gradients, the IPG buffer where touched) are
            # `gathered` for the probe, whose categories hold for the whole step
            held_grads = w * i.n + w * i.bucket
            # (ZeRO-Offload: an extra-large gradient is cloned at its hook before it is reduced,
            # reduce_independent_p_g_buckets_and_remove_grads under _offload_gradient_safety_enabled: the
            # storage held here is never a collective's)
            held_touched = ((w * i.grads_hooked[1][-1] if not optimizer_offloaded(i) else 0)
                            + (w * i.bucket if i.ipg_touched else 0))
        elif m > 1 and zero == 2:
            # micro-batch 0's grads_in_partition (contiguous_gradients), kept to the boundary by
            # all_grad_tensors; sized as the whole params overlapping the partition
            # (deepspeed_backward: per rank)
            held_grads = w * i.flush.overlap
        self.held_grads, self.held_touched = held_grads, held_touched
        # the IPG buffer: the output Linear's weight gradient is the first a hook sees, whose
        # setup_buckets allocates it (reduce_bucket_size elements), after the MmBackward's outputs and the
        # release of the logits' gradient: in deep_in_backward (ZeRO-2) and reduce_gradients_at_boundary
        # (ZeRO-1), not in backward_start
        self.act_named = per_kind(self.acts)
        most = most_live_activations(model, mbs, w, i.checkpointing, i.dispatch, i.sp)
        if zero == 3 and i.checkpointing:
            # the forward's end (the head's saves, the weights its mm saved) or a block's recompute end
            # (its saves, the batch, every weight its mm saved and the coordinator still holds)
            layer = max(sum(layer_activations(model, mbs, w, j, i.dispatch, i.sp).values()) for j in range(model.layers))
            head = sum(saved_activations(model, mbs, w, True, i.dispatch, i.sp)[0].values())
            most = max(head + max(z[1].saved for z in i.z3_moments),
                       layer + self.batch + max(r.saved for mb in i.z3_swiglu[0] for r, _ in mb))
        elif zero == 3:
            # the forward's end: every save, and the mm-saved weights the coordinator still holds (the
            # backward's start adds only storages gathered for the backward, which no op saves)
            most += max(z[1].saved for z in i.z3_moments)
        self.most = most
        # the loss scalars in a backward: DeepSpeed-Ulysses' launcher passes loss / sp (each slice's loss
        # counts 1 / sp: launchers/deepspeed.py), one more scalar engine.backward's caller holds
        self.loss_scalars = _loss_scalars() + (FP32 if i.sp > 1 else 0)
        self.base_temp = sum(self.held.values()) + self.loss_scalars + held_grads - held_touched
        # past the loss's backward: nll_loss's total_weight and log_softmax's output released
        self.past_head = self.act - FP32 - FP32 * b * s * V
        self.per = layer_activations(model, mbs, w, sp=i.sp)  # a dense block's
        self.per_layer = sum(self.per.values())
        # each block's saves (an MoE layer's differ), and the saves of the blocks after block j
        self.layer_per = tuple(layer_activations(model, mbs, w, j, i.dispatch, i.sp) for j in range(model.layers))
        after, acc = [0] * model.layers, 0
        for j in reversed(range(model.layers)):
            after[j] = acc
            acc += sum(self.layer_per[j].values())
        self.saves_after = tuple(after)
        moe = [j for j in range(model.layers) if i.dispatch is not None and model.is_moe_layer(j)]
        self.first_moe = min(moe) if moe else None
        # a checkpointed MoE layer's recompute: (activations, temporaries) it leaves, per MoE layer
        self.aux_left = recomputed_aux(model, mbs, w) if moe and i.checkpointing else None

    def aux(self, j: int) -> dict[str, int]:
        """The MoE layers' aux losses' gradient (launchers/llama.py: loss + coeff * sum(l_aux)): the loss's
        backward makes it first (its nodes are the newest) and it waits in each MoE layer's l_aux node
        until the last of them runs, in the gate of the first MoE layer: live while an MoE layer at or
        below block j has not run its gate's backward."""
        if self.first_moe is None or self.first_moe > j or self.i.checkpointing:
            # (checkpointed: the forward's l_aux are made without grad, the loss has no aux branch)
            return {}
        return {"the aux losses' gradient (waiting in the MoE layers' l_aux nodes)": FP32}

    def block_saves(self, j: int) -> int:
        # in block j's backward, before it released anything: its saves and the blocks' below, the
        # batch; the final norm's and the later blocks' released. Checkpointed: its recompute's saves
        # and the batch (the blocks below hold their inputs only: ac())
        i = self.i
        if i.checkpointing:
            return self.batch + sum(self.layer_per[j].values())
        return self.past_head - head_activations(i.model, i.mbs, i.w, i.sp)["norm"] - self.saves_after[j]

    def ac(self, j: int | None) -> tuple[dict[str, int], int]:
        """Activation checkpointing (deepspeed.checkpointing.checkpoint): (temporaries, activations) it
        adds in block j's backward (j None: the head's, before any recompute), measured with the probe's
        census. Each block j' <= j holds its input (ctx.deepspeed_saved_tensors, freed by its
        CheckpointFunction.backward); block j's recompute its output, until its backward ends. An MoE
        block past its recompute (recomputed_aux): its ce (activations) from the recompute, and once
        its backward ran its input and the input's grad, which for block j + 1 is the residual stream's
        gradient block j's backward receives (counted as such)."""
        i = self.i
        if not i.checkpointing:
            return {}, 0
        model, bsh = i.model, i.w * self.b * self.s * self.h
        temp = {"checkpointed blocks' inputs (ctx.deepspeed_saved_tensors)": (model.layers if j is None else j + 1) * bsh}
        if j is None:
            return temp, 0
        temp["the recomputed block's output"] = bsh
        acts = 0
        if self.aux_left:
            ce, held = self.aux_left
            acts = sum(ce for x in range(j, model.layers) if model.is_moe_layer(x))
            done = sum(held for x in range(j + 1, model.layers) if model.is_moe_layer(x))
            done -= bsh if j + 1 < model.layers and model.is_moe_layer(j + 1) else 0
            temp["the recomputed MoE blocks' l_aux graphs: inputs and their grads"] = done
        return temp, acts

    def resident_in_step(self, first: bool) -> int:
        # within a step's passes: the params (ZeRO-3: partitions and persistent params), ZeRO-3's grad
        # partitions and IPG bucket, the optimizer state, _global_grad_norm and ZeRO-3's
        # inf_or_nan_tracker (bool). Step 0: AdamW's exp_avg, exp_avg_sq and step are made in its first
        # update (torch/optim/adam.py _init_group), no _global_grad_norm yet, ZeRO-3's persistent params
        # not resident (_post_step gathers them at its end: the pass gathers them)
        return sum(self.resident_lines(first).values())

    def resident_lines(self, first: bool) -> dict[str, int]:
        """resident_in_step by state, as a peak's detail names them."""
        i = self.i
        optim = i.optim - (sum(2 * FP32 * p + FP32 for p in i.group_parts or (i.part,)) if first else 0)
        grads, other = host_lines(i)
        return {"resident/params": i.params_resident - (i.persist if first else 0) - host_params(i),
                "resident/grads": i.grads_resident + grads,
                "resident/optim": optim if not optimizer_offloaded(i) or i.rules.host_is_device else 0,
                "resident/other": (0 if first else self.norm_dtype) + (1 if i.zero == 3 else 0) + i.other_extra
                + other}


def host_params(i: PeakInputs) -> int:
    """ZeRO-3's offloaded parameter partitions where the target's host is not its device (else 0)."""
    return i.offload.host_params if i.offload and not i.rules.host_is_device else 0


def host_lines(i: PeakInputs) -> tuple[int, int]:
    """ZeRO-Offload's buffers in the peak's memory (grads, other): the host's only where the target's host is
    its device (the CPU harness: one memory)."""
    if not i.offload:
        return 0, 0
    o, host = i.offload, i.rules.host_is_device
    return (o.host_grads if host else 0), o.device_other + (o.host_other if host else 0)


def optimizer_step(st: _Step, first: bool) -> Peak:
    """torch AdamW's update on each group's fp32 partition (engine.step() at the accumulation
    boundary), the largest (the first of equals)."""
    parts = st.i.group_parts or (st.i.part,)
    return max((_group_step(st, first, g, parts) for g in range(len(parts))), key=lambda p: p.bytes)


def _group_step(st: _Step, first: bool, g: int, parts: tuple[int, ...]) -> Peak:
    i, zero, batch = st.i, st.i.zero, st.batch
    # the previous step's _global_grad_norm is replaced only after the new one is computed
    other = st.norm_dtype * (1 if first else 2) + (1 if zero == 3 else 0) + i.other_extra  # + inf_or_nan_tracker
    params = i.params_resident - (i.persist if zero == 3 else 0) - host_params(i)  # _partition_all_parameters
    # step 0: a later group's exp_avg, exp_avg_sq and step are made at its own update (_init_group)
    later = sum(2 * FP32 * p + FP32 for p in parts[g + 1:]) if first else 0
    optim = i.optim - later
    off_grads, off_other = host_lines(i)
    on_host = optimizer_offloaded(i) and not i.rules.host_is_device  # the update runs in another memory
    optim, other = (0 if on_host else optim), other + off_other
    resident = params + i.grads_resident + off_grads + optim + other
    part = parts[g]
    if optimizer_offloaded(i):
        # stage_1_and_2.py step() under cpu_offload: the fp32 gradient partition is the host buffer the
        # reductions copied into (resident); each param of the partition left its fp64 norm
        # (set_norm_for_param_grad_in_gpu, norm_for_param_grads: cleared by reset_cpu_buffers after the step)
        temp = {"norm_for_param_grads (an fp64 norm per param of the partition)": FP64 * i.offload.params_in_partition}
        if not on_host:
            temp[f"AdamW {i.rules.adam_temporaries}"] = i.rules.adam_partition_temporaries * FP32 * part
        temp["loss (last micro-batch)"] = FP32
    else:
        temp = {"fp32 gradient partition (step(): .to(fp32))": FP32 * part,
                f"AdamW {i.rules.adam_temporaries}": i.rules.adam_partition_temporaries * FP32 * part,
                "loss (last micro-batch)": FP32}
    if g < len(parts) - 1 and i.flush is not None:
        # stage_1_and_2.py step(): a group's averaged_gradients are views of the one
        # grads_in_partition buffer, released group by group: alive until the last group's step
        temp["grads_in_partition (the later groups' gradients)"] = i.w * i.flush.overlap
    if zero == 3:
        # stage3.py get_grad_norm_direct's torch.where result (norm_groups) and
        # utils.combine_grad_norm_groups' where result (scaled_global_grad_norm), fp64
        temp["grad norms (norm_groups, scaled_global_grad_norm)"] = 2 * st.norm_dtype
    else:
        temp["scaled_global_grad_norm (combine_grad_norm_groups)"] = FP32
    moment = {"resident": resident, "activations": batch, "gathered": 0, "temporary": sum(temp.values()),
              "unnamed": 0}
    detail = {"resident/params": params, "resident/grads": i.grads_resident + off_grads, "resident/optim": optim,
              "resident/other": other, "activations/batch (tokens, labels)": batch}
    detail.update({f"temporary/{k}": v for k, v in temp.items()})
    what = "" if len(parts) == 1 else f" of param group {g}"
    return _past_backward(Peak.of(moment, phase="optimizer",
                                  what=f"torch AdamW update on the fp32 partition{what} ({i.rules.adam_update})",
                                  detail=detail), st)


def backward_start(st: _Step, first: bool) -> Peak:
    """The last micro-batch's backward, its first nodes: the cross-entropy's, then the output Linear's."""
    i, w, act, held, held_touched = st.i, st.i.w, st.act, st.held, st.held_touched
    b, s, V, h = st.b, st.s, st.V, st.h
    res = st.resident_in_step(first)
    # NllLossBackward has run first and released total_weight. (a) at _log_softmax_backward_data:
    # its input gradient and its output, b*s*V fp32 each. (b) then LogSoftmaxBackward releases the
    # log_softmax output; ToCopyBackward (logits.float()) casts the gradient to the model dtype
    # (bf16: the fp32 one is freed; fp32: it is that one); the output Linear's MmBackward makes
    # the weight's gradient (V*h) and the input's (b*s*h), both in the model dtype, with the
    # logits' gradient still alive
    # ZeRO-3: the gathered params from the coordinator replay at each moment, the backward's
    # start (the root's pre-backward hook fired before the loss's nodes) and the output's
    # pre-backward hook; the mm-saved weights are those of the forward still gathered
    nothing = Z3Live(0, 0, 0)
    za = zb = nothing
    if i.zero == 3:
        _, za, zb = (i.z3_first if first else i.z3_moments)[-1]  # step 0: they hold the persistent params
    a = (act - FP32 + za.saved, 2 * FP32 * b * s * V, za)
    bb = (act - FP32 - FP32 * b * s * V + zb.saved, w * b * s * V + w * V * h + w * b * s * h, zb)

    def total(c):
        return c[0] + c[1] + c[2].gathered + c[2].temporary

    bb_won = total(a) < total(bb)
    (acts_now, grads_now, z), at = (bb, "the output Linear's mm backward") if bb_won else \
        (a, "_log_softmax_backward_data")
    aux = st.aux(i.model.layers)
    parts = {"resident": res, "activations": acts_now, "gathered": z.gathered + held_touched,
             "temporary": grads_now + st.base_temp + z.temporary + sum(aux.values()), "unnamed": 0}
    detail = {f"activations/{k}": v for k, v in st.act_named.items() if k != "nll_loss total_weight"}
    if i.zero == 3:
        detail["activations/gathered Linear weights saved by mm (ZeRO-3)"] = z.saved
        detail["gathered/flat buffers and single-param buffers (ZeRO-3)"] = z.gathered
        if z.temporary:
            detail["temporary/gathered params' torch.cat copies (ZeRO-3)"] = z.temporary
    detail["temporary/cross-entropy and output gradients at " + at] = grads_now
    detail["temporary/loss scalars"] = st.loss_scalars
    detail.update({f"temporary/{k}": v for k, v in aux.items()})
    if held:
        detail["temporary/checkpointed layer inputs and rng states (ctx)"] = sum(held.values())
    if st.held_grads - held_touched:
        detail["temporary/gradients held across micro-batches"] = st.held_grads - held_touched
    if held_touched:
        detail["gathered/gradients held across micro-batches that a boundary collective reduces"] = held_touched
    what = f"the last micro-batch's backward at {at}"
    return Peak.of(parts, phase="backward", what=what, detail=detail)


def forward_at_final_norm(st: _Step, mb: int, z, first: bool = False) -> Peak:
    """ZeRO-3: micro-batch mb's forward at the final norm, z the coordinator's gathered params there."""
    i, model, mbs, w, batch = st.i, st.i.model, st.i.mbs, st.i.w, st.batch
    # micro-batch mb's forward at the final norm (`norm`: its last op, the mul by the weight), where
    # every layer's saves are live and ZeRO-3 still holds what the coordinator gathered (z, from
    # the replay: the output's coalesced all-gather not yet waited keeps its flat buffer beside
    # the params' cat copies). The resident state as at the boundary (_global_grad_norm and the
    # inf tracker in `other`); the previous loss still bound by the training loop: the last
    # step's (live at the step's start: unnamed) or the last micro-batch's
    res = st.resident_in_step(first)  # step 0: the pass gathers the persistent params (z)
    # checkpointed: the blocks saved nothing (no grad inside CheckpointFunction.forward), their ctx holds
    # each block's input and RNG states
    layers = 0 if i.checkpointing else model.layers * sum(layer_activations(model, mbs, w, sp=i.sp).values())
    acts = {f"layers x{model.layers} saved": layers,
            "norm": head_activations(model, mbs, w, i.sp)["norm"], "batch (tokens, labels)": batch,
            "gathered Linear weights saved by mm (ZeRO-3)": z.saved}
    bsh = mbs * model.seq_len * model.hidden
    # RMSNorm in bf16: xf * rsqrt (fp32, saved by no op: .type_as copies it) and the last block's
    # output x (.float() copies it); in fp32 both are the tensors the norm saves
    temp = {"norm's xf * rsqrt and its input": 0 if w == FP32 else FP32 * bsh + w * bsh,
            "gathered params' torch.cat copies (ZeRO-3)": z.temporary,
            "checkpointed layer inputs and rng states (ctx)": sum(st.held.values())}
    if mb:
        temp["loss (the last micro-batch's)"] = FP32
    last_loss = 0 if mb or first else FP32  # step 0 follows no step
    parts = {"resident": res, "activations": sum(acts.values()), "gathered": z.gathered,
             "temporary": sum(temp.values()), "unnamed": last_loss}
    detail = st.resident_lines(first)
    detail.update({f"activations/{k}": v for k, v in acts.items() if v})
    detail.update({f"temporary/{k}": v for k, v in temp.items() if v})
    detail["gathered/flat buffers and single-param buffers (ZeRO-3)"] = z.gathered
    if last_loss:
        detail["unnamed/the last step's loss"] = FP32
    return Peak.of(parts, phase="forward",
                what=f"micro-batch {mb}'s forward at the final norm (ZeRO-3's gathered params: the coordinator "
                     "replay)", detail=detail)


def _past_backward(p: Peak, st: _Step) -> Peak:
    """p with what outlives the backward and is not resident state: every checkpointed MoE layer's
    recompute's leavings (activations.recomputed_aux)."""
    if not st.aux_left:
        return p
    n = st.i.model.moe_layers()
    ce, held = st.aux_left
    return p.plus({"activations/the recomputed l_aux graphs' ce (checkpointed MoE layers)": n * ce,
                   "temporary/the recomputed l_aux graphs' layer inputs and their gradients": n * held})


def _named_moment(res: int, acts: tuple[str, int], temp: dict[str, int], gathered: dict[str, int],
                  phase: str, what: str) -> Peak:
    # a moment of deep_in_backward, reduce_gradients_at_boundary or ipg_reduce_scatter: its named
    # temporaries and gathered buffers, summed into the parts
    parts = {"resident": res, "activations": acts[1], "gathered": sum(gathered.values()),
             "temporary": sum(temp.values()), "unnamed": 0}
    detail = {f"activations/{acts[0]}": acts[1]}
    detail.update({f"temporary/{k}": v for k, v in temp.items() if v})
    detail.update({f"gathered/{k}": v for k, v in gathered.items() if v})
    return Peak.of(parts, phase=phase, what=what, detail=detail)


def _deep_moment(st: _Step, res: int, fired: int, acts_now: int, temp: dict[str, int], large: int,
                 what: str) -> Peak:
    """One moment of deep_in_backward. fired: the backward_order index of the last hook that has run
    (-1: none)."""
    i, w, V, h = st.i, st.i.w, st.V, st.h
    ipg = w * i.bucket if fired >= 0 else 0
    # the output Linear's weight gradient: tied, it waits in the embedding's AccumulateGrad
    # input until the embedding's backward; untied, extra-large, it waits for the next hook
    tied = i.model.tied_embeddings
    tied_grad = w * V * h if tied else 0
    out_grad = w * V * h if not tied and fired == i.hooks.norm - 1 and V * h > i.bucket else 0
    gathered = {}
    if i.zero == 2:
        bufs = (1 if i.m > 1 else 0) + (1 if i.flush.first_hook <= fired else 0)
        temp = {**temp, "grads_in_partition (micro-batch 0's, this backward's)": bufs * w * i.flush.overlap}
        gathered["extra-large gradients waiting for the next hook"] = large + out_grad
    else:
        # ZeRO-1, one micro-batch: the hooks only set up the bucket; every gradient made stays
        # (param.grad) until reduce_gradients at the boundary
        made, made_touched = (i.grads_hooked[0][fired], i.grads_hooked[1][fired]) if fired >= 0 else (0, 0)
        temp = {**temp, "gradients made (param.grad)": w * (made - made_touched)}
        gathered["extra-large gradients made (reduced in place at the boundary)"] = w * made_touched
    temp["loss scalars"] = st.loss_scalars
    temp["the tied weight's output gradient (AccumulateGrad's input)"] = tied_grad
    (gathered if i.ipg_touched else temp)["IPG buffer (reduce_bucket_size elements)"] = ipg
    return _named_moment(res, ("saved (what backward has not released)", acts_now), temp, gathered,
                         "backward", f"the last micro-batch's backward at {what}")


def moe_combine_gradients(model: ModelShape, mbs: int, w: int) -> dict[str, int]:
    """An MoE layer's backward, its first node past the residual add: sharded_moe.py _sparse_decode's
    `(routed * gates.unsqueeze(-1)).sum(0).to(dtype)` backwards. The cast's gradient in fp32 [S, h];
    the mul's two gradients in fp32 (routed's and gates', [k, S, h] each, before their casts and sums)
    and routed's cast to the model dtype, all live at its end (measured: the probe's census)."""
    S, h, k = mbs * model.seq_len, model.hidden, model.moe_router_topk
    return {"the combine's cast gradient (fp32 [S, h])": FP32 * S * h,
            "the combine's mul gradients (fp32 [k, S, h], routed's and the gates')": 2 * FP32 * k * S * h,
            "routed's gradient in the model dtype": w * k * S * h}


def deep_in_backward(st: _Step, first: bool) -> Peak:
    """ZeRO-2 (and ZeRO-1 with one micro-batch): the last micro-batch's backward past the output Linear."""
    i, model, w, past_head = st.i, st.i.model, st.i.w, st.past_head
    b, s, V, h = st.b, st.s, st.V, st.h
    # ZeRO-2 (and ZeRO-1 with one micro-batch: its hooks reduce nothing, every gradient made is
    # kept), the last micro-batch's backward past the output Linear (deepspeed_backward): the
    # first hook allocated the IPG buffer (setup_buckets: reduce_bucket_size elements; `gathered`
    # where a collective reduces it in place, deepspeed_backward.ipg_touched); an extra-large
    # gradient (above reduce_bucket_size) stays its own tensor, all-reduced in place, until the
    # next hook reduces it; the rest are copied into the IPG buffer by their hook (their own
    # storage freed). grads_in_partition: micro-batch 0's (several micro-batches) and this
    # backward's once a reduction copied into it. The moments:
    # (1) the final norm's backward at its weight gradient's sum: the output Linear's input
    # gradient, the mul's two (b, s, h) gradients, the sum (h), in the model dtype, every block's
    # saves; (2) a block's SwiGLU backward at its mul: the residual stream's gradient, w2's input
    # gradient and the mul's two (b, s, ffn) gradients, w2's weight gradient if extra-large, the
    # saves of the blocks below and of this one but w2's input; (3) its ffn_norm's backward; and
    # (0) the first hook. The probe keeps the first maximum: the moments in backward order
    res = st.resident_in_step(first)
    bsh, bsf = b * s * h, b * s * model.ffn_hidden
    tied = model.tied_embeddings

    def moment(fired: int, acts_now: int, temp: dict[str, int], large: int, what: str) -> Peak:
        return _deep_moment(st, res, fired, acts_now, temp, large, what)

    # (0) the backward's first hook, where setup_buckets allocates the IPG buffer: its gradient is
    # still its own tensor (copied into the buffer after). Untied, the output Linear's: its
    # MmBackward released its saved input (the final norm's output), its input gradient beside the
    # weight's; tied, the final norm's (the output's gradient waits for the embedding): the norm's
    # input gradient and weight gradient, the norm's output and saved y.type_as(x) released. A
    # gradient the moment already counts (ZeRO-1: every one made; ZeRO-2: an extra-large output
    # gradient waiting) is not added again
    if tied:
        acts0, temp0, hooked0 = past_head - 2 * w * bsh, {"the norm's input gradient": w * bsh}, w * h
    else:
        acts0, temp0, hooked0 = past_head - w * bsh, {"the output Linear's input gradient": w * bsh}, w * V * h
    if i.zero == 2 and (tied or V * h <= i.bucket):
        temp0["the first hook's gradient (copied into the IPG buffer next)"] = hooked0
    head_aux = {**st.aux(model.layers), **st.ac(None)[0]}
    cands = [moment(0, acts0, {**temp0, **head_aux}, 0, "the first hook (setup_buckets allocates the IPG buffer)")]
    cands.append(moment(i.hooks.norm - 1, past_head - w * bsh,
                        {"output Linear's input gradient, the norm's mul gradients and their sum":
                         3 * w * bsh + w * h, **head_aux}, 0, "the final norm's weight gradient (sum)"))
    large_w2 = w * model.ffn_hidden * h if model.ffn_hidden * h > i.bucket else 0
    for j in reversed(range(model.layers)):
        ac_temp, ac_acts = st.ac(j)
        per, below = st.layer_per[j], {**st.aux(j - 1), **ac_temp}
        if model.is_moe_layer(j):
            cands.append(moment(i.hooks.w2[j] - 1, st.block_saves(j) + ac_acts,
                                {"residual stream gradient": w * bsh, **moe_combine_gradients(model, b, w),
                                 **st.aux(j), **ac_temp}, 0, f"block {j}'s MoE combine (routed * gates) backward"))
        else:
            acts_now = st.block_saves(j) - w * bsf + ac_acts
            cands.append(moment(i.hooks.w2[j], acts_now, {"residual stream gradient": w * bsh,
                                                           "w2 input gradient and the mul's two": 3 * w * bsf,
                                                           **below},
                                large_w2, f"block {j}'s SwiGLU mul"))
        # (3) its ffn_norm's backward at PowBackward's last mul (RMSNorm in fp32: x.float().pow(2)):
        # the FFN's saves, the norm's output (where an FFN Linear saved it) and y.type_as(x)
        # released, and rsqrt's (its and mean's backward ran): its xf is left; the residual stream's
        # gradient, the mul-by-rsqrt's gradient for xf, the mean's backward (expanded / h) and pow's
        # backward's three, each (b, s, h) fp32
        acts_n = st.block_saves(j) - ffn_saves(per) - (per["ffn_norm"] - FP32 * bsh) + ac_acts
        cands.append(moment(i.hooks.ffn_norm[j], acts_n, {"residual stream gradient": w * bsh,
                                                          "the norm's fp32 gradients (xf's, mean's, pow's three)":
                                                          5 * FP32 * bsh, **below}, 0,
                            f"block {j}'s ffn_norm backward (pow)"))
    return max(cands, key=lambda p: p.bytes)


def epilogue(st: _Step, first: bool) -> list[Peak]:
    """ZeRO-2: the last micro-batch's backward epilogue (independent_gradient_partition_epilogue), its
    IPG reduction: each flattened copy its all-reduces make, and grads_in_partition's allocation where
    this reduction is the first into the rank's partition."""
    i, w = st.i, st.i.w
    # every saved tensor released but the batch; the loss, its scaled copy and product (the seed
    # freed). The IPG buffer, micro-batch 0's grads_in_partition (several micro-batches: kept by
    # all_grad_tensors) and this backward's where an earlier hook's reduction made it. average_tensor
    # all-reduces each process group's slices (allreduce_bucket: a torch.cat of several, reduced in
    # place: `gathered`; backward.reduction_calls), one after another, each copy freed before the next;
    # then copy_grads_in_partition allocates grads_in_partition on its first copy
    res = st.resident_in_step(first)
    made = i.flush.first_hook < i.hooks.count
    base = {"loss scalars (the loss, its scaled copy and product)": st.loss_scalars - FP32,
            "grads_in_partition (micro-batch 0's)": w * i.flush.overlap if i.m > 1 else 0,
            "grads_in_partition (this backward's)": w * i.flush.overlap if made else 0}
    ipg = {"IPG buffer (reduce_bucket_size elements)": w * i.bucket}

    def at(temp: dict[str, int], gathered: dict[str, int], what: str) -> Peak:
        (gathered if i.ipg_touched else temp).update(ipg)
        return _past_backward(_named_moment(res, ("batch (tokens, labels)", st.batch), temp, gathered, "optimizer",
                                            f"the last micro-batch's backward epilogue: {what}"), st)

    if i.reduce_w:
        out = [at({**base, **temp}, gathered, f"the IPG all-reduce of {what}")
               for what, n, k in i.last_reduction[1] for temp, gathered in (cast_copies(st, n, k),)]
    else:
        out = [at(dict(base), {f"the all-reduce's flattened copy ({what})": w * n}, f"the IPG all-reduce of {what}")
               for what, n in i.epilogue]
    if not made:
        out.append(at({**base, "grads_in_partition (this backward's)": w * i.flush.overlap}, {},
                      "grads_in_partition's allocation"))
    return out


def reduce_gradients_at_boundary(st: _Step, first: bool) -> Peak:
    """ZeRO-1 (no overlap_comm): reduce_gradients at the boundary, at the first copy into
    grads_in_partition."""
    i, w = st.i, st.i.w
    # ZeRO-1 (no overlap_comm): backward keeps every param.grad; at the boundary reduce_gradients
    # walks bit16_groups in registration order through the IPG bucket (setup_buckets allocated it
    # at backward's first hook): a gradient copied into it frees its own storage, an extra-large
    # one stays; the first reduction into this rank's partition allocates grads_in_partition
    # (deepspeed_backward, registration order) with the rest of the gradients still live. The
    # activations are released; the batch and the loss scalars stay
    touched = i.grads_hooked[1][-1]  # every extra-large gradient a collective reduces in place
    temp = {"gradients not yet copied into the IPG buffer": w * (i.n - i.flush.copied - touched),
            "grads_in_partition (copy_grads_in_partition)": w * i.flush.overlap,
            # the loss, its scaled copy and product: backward has released the gradient seed
            "loss scalars": st.loss_scalars - FP32}
    gathered = {"extra-large gradients a collective reduces in place": w * touched}
    (gathered if i.ipg_touched else temp)["IPG buffer (reduce_bucket_size elements)"] = w * i.bucket
    return _past_backward(_named_moment(st.resident_in_step(first), ("batch (tokens, labels)", st.batch), temp,
                                        gathered, "optimizer",
                                        "reduce_gradients at the boundary: the first copy into grads_in_partition"), st)


def cast_copies(st: _Step, n: int, k: int) -> tuple[dict[str, int], dict[str, int]]:
    """(temporary, gathered) of one all-reduce of ZeRO-1/2's allreduce_bucket in a dtype not the model's
    (stage_1_and_2.py: the slices flattened, a torch.cat of several, then tensor.to(communication_data_type),
    the copy reduced in place and copied back): the flattened copy where several slices, and the cast."""
    i = st.i
    return ({"the all-reduce's flattened copy (model dtype)": i.w * n} if k > 1 else {},
            {"the all-reduce's cast to the reduce dtype (allreduce_bucket)": i.reduce_w * n})


def boundary_reduction_casts(st: _Step, first: bool) -> list[Peak]:
    """ZeRO-1 (no overlap_comm) reducing in a dtype not the model's: reduce_gradients at the boundary, at each
    all-reduce of its last reduction (before copy_grads_in_partition, which the first reduction allocates:
    with one reduction not yet there): the IPG buffer, the cast copies (cast_copies), every gradient copied
    into the buffer."""
    i, w = st.i, st.i.w
    count, calls = i.last_reduction
    touched = i.grads_hooked[1][-1]
    out = []
    for what, n, k in calls:
        copies, cast = cast_copies(st, n, k)
        temp = {"grads_in_partition (copy_grads_in_partition)": w * i.flush.overlap if count > 1 else 0,
                "loss scalars": st.loss_scalars - FP32, **copies}
        gathered = {"extra-large gradients a collective reduces in place": w * touched, **cast}
        (gathered if i.ipg_touched else temp)["IPG buffer (reduce_bucket_size elements)"] = w * i.bucket
        out.append(_past_backward(_named_moment(st.resident_in_step(first), ("batch (tokens, labels)", st.batch),
                                                temp, gathered, "optimizer",
                                                f"reduce_gradients at the boundary: the all-reduce of {what}"), st))
    return out


def ipg_reduce_scatter(st: _Step, first: bool) -> list[Peak]:
    """ZeRO-3: each micro-batch's backward at each IPG reduce-scatter, its epilogue's included."""
    i, model, w, batch = st.i, st.i.model, st.i.w, st.batch
    V, h = st.V, st.h
    # ZeRO-3, each micro-batch's backward: an IPG reduction at a hook (deepspeed_backward.z3_flushes,
    # stage3.py __reduce_and_partition_ipg_grads), at reduce_scatter_coalesced's collective: its
    # flat input (a torch.cat of the padded gradients, `gathered`; or one gradient as it is: the IPG
    # buffer's view, resident, or an extra-large gradient's own storage) and gloo's copy of the
    # whole input (ProcessGroupGloo's reduce-scatter of a tensor). The hook's gradient is still its
    # own tensor (copied into the IPG buffer after the reduction); what autograd holds at the hook
    # (AccumulateGrad runs as soon as the node making the gradient has run, before the module's
    # post-backward release): z3_hook_moment. The gathered params: the coordinator at the hook's
    # module's pre-backward fetch (gathered.z3_backward_moments)
    flushes, steady_z, first_z = i.z3_flushes
    res = st.resident_in_step(first)
    # the reduce-scatter's dtype (__avg_scatter_grads: every gradient .to(communication_data_type) where it
    # is not the model's: the IPG bucket is kept in it already, an extra-large gradient's own storage is
    # copied), its flat input and gloo's copy of it in that dtype
    wr = i.reduce_w or w
    out = []
    for k, per in enumerate(first_z if first else steady_z):
        for f, z in zip(flushes, per):
            mb = k + (1 if first and i.m > 1 else 0)  # step 0: the passes after the recording one
            if f.name:
                acts_now, temp, at = z3_hook_moment(st, f.name)
                temp.update(_z3_checkpointed(st, f.name))
                temp["loss scalars"] = st.loss_scalars
                # the tied weight's output gradient waits in the embedding's AccumulateGrad input
                temp["the tied weight's output gradient (AccumulateGrad's input)"] = \
                    w * V * h if model.tied_embeddings and f.name != "tok_embeddings.weight" else 0
                phase, what = "backward", f"micro-batch {mb}'s backward: the IPG reduce-scatter at {at}"
            else:
                # the epilogue (independent_gradient_partition_epilogue, queued on the autograd engine:
                # after backward): every saved tensor released but the batch, the gradient seed
                # freed; the coordinator as after the embedding's fetch (its post-backward never
                # fires: release_backward_leftovers runs after the epilogue)
                acts_now = batch
                temp = {"loss scalars (the loss, its scaled copy and product)": st.loss_scalars - FP32}
                phase, what = "optimizer", f"micro-batch {mb}'s backward epilogue: the last IPG reduce-scatter"
            temp.update({"gloo's copy of the reduce-scatter input": wr * f.flat if i.rules.rs_input_copy else 0,
                         "an extra-large gradient in the bucket (its own storage)": w * f.own if f.cat else 0,
                         "an extra-large gradient's copy in the reduce dtype": wr * f.own if wr != w else 0,
                         "gathered params' torch.cat copies (ZeRO-3)": z.temporary})
            flat_input = "(torch.cat)" if f.cat else "(an extra-large gradient)"
            if not f.cat and wr != w:  # the gradient reduced is its copy; its own storage still live
                temp["an extra-large gradient (its own storage)"] = w * f.own
            gathered = {f"reduce_scatter_coalesced's input {flat_input}": wr * f.flat if f.cat else wr * f.own,
                        "flat buffers and single-param buffers (ZeRO-3)": z.gathered}
            p = _named_moment(res, ("saved (what backward has not released)", acts_now + z.saved), temp, gathered,
                              phase, what)
            # the detail's lines apart: what backward holds, and the gathered weights mm saved
            p.detail["activations/saved (what backward has not released)"] = acts_now
            p.detail["activations/gathered Linear weights saved by mm (ZeRO-3)"] = z.saved
            out.append(p)
    return out


def _z3_checkpointed(st: _Step, name: str) -> dict[str, int]:
    """With checkpointing, what a ZeRO-3 gradient hook's moment holds beside z3_hook_moment's (_Step.ac): a
    block's hook runs after its recompute (the ctx inputs of the blocks up to it, its recomputed output);
    the final norm's before any recompute (every block's input); the embedding's after every block's."""
    if not st.i.checkpointing or name == "tok_embeddings.weight":
        return {}
    return st.ac(int(name.split(".")[1]) if name.startswith("layers.") else None)[0]


def z3_swiglu_backward(st: _Step, first: bool) -> list[Peak]:
    """ZeRO-3 with checkpointing: each micro-batch's backward in each block's SwiGLU backward at its mul,
    after the block's recompute (CheckpointFunction.backward ran its forward again with grad, then
    w2's backward: its input's gradient made, its post-backward released its params). What
    deep_in_backward's SwiGLU moment holds (the recomputed saves but w2's input, the residual stream's
    gradient, w2's input gradient and the mul's two, the ctx inputs of the blocks below and the recomputed
    output), with ZeRO-3's gathered params there (gathered.z3_release_moments) and its resident IPG
    bucket; the hooks' gradients are copied into the bucket (their reductions are ipg_reduce_scatter's)
    but an extra-large w2's (above reduce_bucket_size), its own storage until the next hook reduces it
    (backward.z3_flushes): `gathered` where the reduce-scatter takes it as it is (a multiple of dp), else
    `temporary` (it is cat'ed into a padded copy then)."""
    i, model, w = st.i, st.i.model, st.i.w
    b, s, V, h = st.b, st.s, st.V, st.h
    bsh, bsf = b * s * h, b * s * model.ffn_hidden
    res = st.resident_in_step(first)
    fh, dp = model.ffn_hidden * h, st.i.dp
    large = {("gathered" if fh % dp == 0 else "temporary"): w * fh} if fh > i.bucket else {}
    out = []
    for k, per_block in enumerate(i.z3_swiglu[1] if first else i.z3_swiglu[0]):
        mb = k + (1 if first and i.m > 1 else 0)  # step 0: the passes after the recording one
        for j, (_, z) in enumerate(per_block):
            ac_temp, ac_acts = st.ac(j)
            temp = {"residual stream gradient": w * bsh, "w2 input gradient and the mul's two": 3 * w * bsf,
                    **ac_temp, "loss scalars": st.loss_scalars,
                    "the tied weight's output gradient (AccumulateGrad's input)": w * V * h if model.tied_embeddings
                    else 0, "gathered params' torch.cat copies (ZeRO-3)": z.temporary,
                    "w2's weight gradient (extra-large: its own storage)": large.get("temporary", 0)}
            p = _named_moment(res, ("saved (what backward has not released)",
                                    st.block_saves(j) - w * bsf + ac_acts + z.saved), temp,
                              {"flat buffers and single-param buffers (ZeRO-3)": z.gathered,
                               "w2's weight gradient (extra-large: its own storage)": large.get("gathered", 0)},
                              "backward",
                              f"micro-batch {mb}'s backward: block {j}'s SwiGLU mul after its recompute")
            p.detail["activations/gathered Linear weights saved by mm (ZeRO-3)"] = z.saved
            out.append(p)
    return out


def z3_hook_moment(st: _Step, name: str) -> tuple[int, dict[str, int], str]:
    """(activations, autograd's temporaries, where) at the ZeRO-3 gradient hook of param `name`."""
    model, w, per = st.i.model, st.i.w, st.per
    b, s, V, h = st.b, st.s, st.V, st.h
    # (activations, autograd's temporaries, where) at a ZeRO-3 gradient hook (launchers/llama.py):
    # - the final norm's weight: the output Linear's MmBackward released its saved input and the
    #   logits' gradient; the norm's `* weight` MulBackward its saved y.type_as(x): its input
    #   gradient (b, s, h) and the weight's (h) live
    # - a block's w2: its MmBackward released its saved input (the SwiGLU product): the block's
    #   output gradient (the residual stream's), w2's input gradient (b, s, ffn) and weight gradient
    # - w3 (autograd runs the later-made branch first): the MulBackward released w2's input
    #   gradient and its saves (silu's output, w3's): its gradient for silu (b, s, ffn), w3's input
    #   gradient and weight gradient beside the residual stream's
    # - w1: SiluBackward released w1's output and silu's gradient, both Linears their input (the
    #   ffn_norm's output); w1's input gradient beside w3's, not summed yet: each Linear's input
    #   passes through its own PostBackwardFunctionModule node (parameter_offload.py), and w1's
    #   runs after the hook (AccumulateGrad first)
    bsh, bsf, fh = b * s * h, b * s * model.ffn_hidden, model.ffn_hidden * h
    if name == "tok_embeddings.weight":
        # the backward's last node ran: every save released but the batch (the tokens the embedding
        # saved, the labels); its weight gradient (tied: both uses' gradients summed into one)
        return st.batch, {"the embedding's weight gradient": w * V * h}, "the embedding's weight hook"
    if name == "norm.weight":
        return st.past_head - 2 * w * bsh, {"the norm's input gradient and weight gradient": w * bsh + w * h}, \
            "the final norm's weight hook"
    j, mod = int(name.split(".")[1]), name.split(".", 2)[2].rsplit(".", 1)[0]
    lin = mod.rsplit(".", 1)[-1]
    base = st.block_saves(j)
    # the attention's pieces (layer_activations): rope's cos and sin for q and for k (s, d/2) fp32
    # each; SDPA's saves (q, the expanded k and v, its output: b*s*heads*d each) and logsumexp
    d, H, KV = model.head_dim, model.heads, model.kv_heads
    bsq, bskv = b * s * H * d, b * s * KV * d
    cos_sin = 2 * FP32 * s * (d // 2)  # one rope's
    sdpa = 4 * w * bsq + FP32 * b * H * s
    past_ffn = base - per["feed_forward"] - per["ffn_norm"]  # the block's FFN and ffn_norm backpropagated
    acts_now, temp = {
        "w2": (base - w * bsf, {"w2's input gradient": w * bsf, "w2's weight gradient": w * fh}),
        "w3": (base - 3 * w * bsf, {"the mul's gradient for silu": w * bsf, "w3's input gradient": w * bsh,
                                    "w3's weight gradient": w * fh}),
        "w1": (base - 4 * w * bsf - w * bsh, {"w3's and w1's input gradients": 2 * w * bsh,
                                              "w1's weight gradient": w * fh}),
        # the norms' `* weight` MulBackward released the normalised value it saved; the Linears
        # after it their input, the norm's output: the norm's input gradient and weight gradient
        "ffn_norm": (base - per["feed_forward"] - 2 * w * bsh,
                     {"the norm's input gradient and weight gradient": w * bsh + w * h}),
        "attention_norm": (base - st.per_layer + FP32 * b * s * h + FP32 * b * s,
                           {"the norm's input gradient and weight gradient": w * bsh + w * h}),
        # wo: its input (SDPA's output) still saved by SDPA
        "wo": (past_ffn, {"wo's input gradient": w * bsq, "wo's weight gradient": w * h * H * d}),
        # SDPA's backward released its saves; autograd runs the later-made nodes first: v's
        # repeat_interleave backward (its sum over the repeats), k's, then wv's MmBackward, while
        # q's gradient waits for rope(q)'s backward and k's (summed) for rope(k)'s
        "wv": (past_ffn - sdpa, {"q's gradient (SDPA's)": w * bsq, "k's gradient (summed over the repeats)": w * bskv,
                                 "wv's input gradient": w * bsh, "wv's weight gradient": w * h * KV * d}),
        # rope(k)'s backward released its cos and sin; wv's input gradient waits in its own
        # PostBackwardFunctionModule node (parameter_offload.py), as w3's does
        "wk": (past_ffn - sdpa - cos_sin, {"q's gradient (SDPA's)": w * bsq,
                                           "wv's and wk's input gradients": 2 * w * bsh,
                                           "wk's weight gradient": w * h * KV * d}),
        # every attention save released, and the attention_norm's output the three Linears saved;
        # wv's and wk's input gradients summed (out of place) into the norm output's
        "wq": (past_ffn - per["attention"] - w * bsh, {"wv's + wk's input gradients": w * bsh,
                                                      "wq's input gradient": w * bsh,
                                                      "wq's weight gradient": w * h * H * d}),
    }[lin]
    return acts_now, {"residual stream gradient": w * bsh, **temp}, f"block {j}'s {lin} weight hook"


def _pick(st: _Step, first: bool) -> Peak:
    """The step's peak: the largest of its moments (the first of equals), the others as candidates."""
    i, zero, m, flush = st.i, st.i.zero, st.i.m, st.i.flush
    o, k = optimizer_step(st, first), backward_start(st, first)
    cands = [o, k]
    names = {id(o): "optimizer step", id(k): "backward start"}
    if zero == 2 or zero == 1 and m == 1 and flush is not None:
        cands.append(deep_in_backward(st, first))
    if zero == 1 and flush is not None:
        cands.append(reduce_gradients_at_boundary(st, first))
    casts = bool(i.reduce_w) and zero in (1, 2) and flush is not None
    if casts and zero == 1:
        cands += boundary_reduction_casts(st, first)
    names.update({id(c): "deeper in backward" for c in cands[2:] if c.phase == "backward"})
    names.update({id(c): "reduce_gradients" for c in cands[2:] if c.phase == "optimizer"})
    if zero == 2:
        ends = epilogue(st, first)
        cands += ends
        names.update({id(c): "backward epilogue" for c in ends})
    if zero == 3:
        flushes = ipg_reduce_scatter(st, first)
        cands += flushes
        names.update({id(c): "IPG reduce-scatter" for c in flushes})
        swiglu = z3_swiglu_backward(st, first) if i.checkpointing else []
        cands += swiglu
        names.update({id(c): "SwiGLU backward after the recompute" for c in swiglu})
    if zero == 3 and not first:
        # the first micro-batch reaching the most (the probe keeps the first maximum)
        f = max((forward_at_final_norm(st, mb, z[0]) for mb, z in enumerate(i.z3_moments)), key=lambda p: p.bytes)
        cands.append(f)
    if zero == 3 and first:
        # step 0's replayed passes (with several micro-batches, those after the recording one)
        off = 0 if m == 1 else 1
        f = max((forward_at_final_norm(st, mb + off, z[0], True) for mb, z in enumerate(i.z3_first)),
                key=lambda p: p.bytes)
        cands.append(f)
    best = max(cands, key=lambda p: p.bytes)  # the first of equals: optimizer, backward, forward
    if i.checkpointing and flush is None and zero != 3 and "an estimate" not in best.what:
        best.what += "; an estimate (a checkpointed layer's recompute is not a candidate)"
    if zero == 1 and flush is None:
        best.what += "; an estimate (overlap_comm: stage 1's reductions in the hooks at the boundary are not a " \
                     "candidate)"
    if i.offload and i.offload.copies:
        # ZeRO-Offload: each reduced gradient of the partition is copied into the host partition through its
        # fp64 norm and an fp32 copy (an extra-large one cloned first); those moments are not placed in the
        # backward (and, on a GPU, ZeRO-3's offloaded partitions copied to the device for a gather): the peak lies
        # between the placed moments' and theirs plus the largest copy
        best.bound = (best.bytes, best.bytes + i.offload.copies)
        best.what += (f"; up to {best.bytes + i.offload.copies:,} B with ZeRO-Offload's copies between host and "
                      "device (not placed: bounded)")
    if casts and (i.last_reduction[0] > 1 if zero == 1 else flush.first_hook < i.hooks.count):
        best.what += ("; an estimate (reducing in another dtype: the casts of the reductions before the last are "
                      "not candidates)")
    for c in cands:
        if c is not best:
            best.detail[f"candidate/{c.phase} ({names.get(id(c), 'final norm, coordinator replay')})"] = c.bytes
    best.detail["candidate/activations most live"] = st.most
    if not any(key.startswith("resident/") for key in best.detail):
        lines = st.resident_lines(first)
        assert sum(lines.values()) == best.parts["resident"], (lines, best.parts)
        best.detail = {**{key: v for key, v in lines.items() if v}, **best.detail}
    # at every moment alike: made in step 0's first forward (its `temporary`), kept after
    part = "temporary" if first else "unnamed"
    return best.plus({f"{part}/DeepSpeed-MoE's cached random samplers (sharded_moe.py)": i.samplers})


def peak(i: PeakInputs) -> Peak | None:
    """The steady step's peak and step 0's (`first`: no previous _global_grad_norm yet); None where the
    activations are not derived for the model (activations.modelled)."""
    if modelled(i.model) is not None:
        return None
    if i.zero == 3 and not (i.z3_moments and i.z3_first):
        raise ValueError("ZeRO-3's peak needs the coordinator replay's moments (z3_moments, z3_first)")
    if i.zero == 2 and (i.flush is None or i.hooks is None):
        raise ValueError("ZeRO-2's peak needs the rank's grads_in_partition (deepspeed_backward.partition_flushes)")
    st = _Step(i)
    steady, first = _pick(st, False), _pick(st, True)
    steady.first = first if first.bytes != steady.bytes or first.parts != steady.parts else None
    return steady
