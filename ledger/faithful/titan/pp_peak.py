"""Peak live bytes of a torchtitan 0.3.0 pipeline stage's rank within a steady training step, CPU/gloo:
torchtitan's 1F1B (distributed/pipeline_parallel.py; torch 2.13 torch/distributed/pipelining schedules.py
Schedule1F1B, stage.py) and GPipe (ScheduleGPipe: _Stage.gpipe, _gpipe_last_stage) over FSDP2 on dp_shard,
HSDP's replicas too (pp.py's placement: with PP the grads are set to None each step, so the replicas'
all-reduce runs in place on the reduce-scatter output that becomes the new sharded grad,
_fsdp_collectives.py foreach_reduce, and holds nothing beside it), with CP (the rank's
S / cp positions of each sequence, FSDP over dp_shard x cp, SDPA's saves of K and V all-gathered over cp:
peak.saved_per_layer), with TP (DTensor's placements: dtensor.py) and SP under any activation
checkpointing (pp_peak_unmodelled names the rest). pp_peak is the most of pp_moments,
each moment its own function below over the values they share (_Stage; the last micro-batch's on the
last stage, _LastMicrobatch). peak.py has the peak without PP, whose moments these echo.

What pipelining does to FSDP2 (torch/distributed/pipelining/stage.py backward_maybe_with_nosync:
set_requires_gradient_sync(False) and set_reshard_after_backward(False) for every micro-batch;
distributed/fsdp.py: no reshard after forward with PP): each unit is unsharded (bf16, padded
full) by its first forward and stays so until perform_reduce_grad after the last backward; each
unit's grads are kept unsharded: its first backward's bf16 grads become fp32 accumulators
(_fsdp_param.py to_accumulated_grad_if_needed: a to() copy, unpadded), later backwards add into
them. trainer.py zero_grad(set_to_none=True) (PP) leaves no sharded grad until a unit is reduced,
except [norm, lm_head], which ChunkedLossWrapper syncs at each micro-batch's last chunk.

With activation checkpointing a block holds its checkpoint's saves between its forward and its
backward (saved_per_layer), is recomputed first in its backward (its saves as without, beside the
checkpoint's input), and block 0's input on a stage after the first is the P2P receive buffer.
P2P (stage.py): a persistent [mbs, S, h] bf16 receive buffer per micro-batch and direction the
stage receives (activations from the stage before, grads from the one after); each in-flight
micro-batch's output, sent on, held until its backward; the input grad last sent back held until
the next one.
Not modelled (a few KB in the matrix, 239 KB at seq 2048): the step's batch and micro-batch split
(int64 ids, labels, positions, the document mask), the loss's per-micro-batch scalars, scalars from
the step before.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from ledger.dtypes import BF16, FP32 as F32
from ledger.faithful.titan.dtensor import partial_weight_grads, wo_input_grad_gathers_weight
from ledger.faithful.titan.peak import (LOSS_CHUNKS, chunk_copies, first_step_peak, rs_temporary, saved_per_layer,
                                       SwigluBackward, swiglu_backward, vocab_parallel_saves)
from ledger.faithful.titan.target import RULES, Rules
from ledger.target import CPU_GLOO
from ledger.placement import Peak


# the moments' detail line of the rank's params, optimizer state and other state
_STATE = "resident/state (params, optim, other)"


def pp_peak_unmodelled(lay, sched: str) -> str | None:
    """Why pp_peak does not derive this layout's peak, or None where it does: 1F1B or GPipe, one stage a
    rank, over FSDP / HSDP, with CP, with TP (with and without SP; without, SwiGLU's reduce-scattered Partial
    grads where DTensor leaves w2's input grad Partial: peak.swiglu_backward; DTensor's Shard -> Shard moves
    inside w2's mm backward stay under the block's SwiGLU or ffn_norm moment: measured pp2·tp4 at hidden 640,
    ffn 1792, T 640 and, without PP, tp4·cp2 at hidden 1024, ffn 2816, T 512 a rank)."""
    if lay.vp == 1 and sched not in ("1F1B", "GPipe"):
        return "pp_peak derives 1F1B and GPipe only"
    return None


def pp_peak(model, lay, stage: tuple[bool, int, int, bool], s: int, sh, kept: int, grads: int,
            emb_numel: int, block_numel: int, head_numel: int, ac: str = "none", rules: Rules = RULES[CPU_GLOO],
            optim: int | None = None, sched: str = "1F1B") -> Peak:
    """The steady-step peak of pipeline stage s's rank: the most of pp_moments (the first on ties).
    optim: the rank's optimizer-state bytes, for the first step's peak (`first`): its moments hold no
    AdamW state before the first optimizer step (peak.FirstStep), and their grads as in any step
    (zero_grad(set_to_none=True) with PP: none but the units already reduced)."""
    c = _stage(model, lay, stage, s, sh, kept, grads, emb_numel, block_numel, head_numel, ac, rules,
               sched == "GPipe")
    cands = _moments(c, most_only=True)
    best = max(cands, key=lambda p: p.bytes)
    if optim is not None:
        # the stage's P2P receive buffers (stage.py: made once, kept between steps) beside the state the first
        # optimizer step makes (measured: pp2·tp2 and pp4 step 0, the probe's census at AdamW's zeros_like)
        first = first_step_peak([(m, optim) for m in cands], kept + grads, _STATE,
                                ("gathered/p2p receive buffers", c.recv))
        if first.bytes != best.bytes:
            best.first = first
    return best


def pp_moments(model, lay, stage: tuple[bool, int, int, bool], s: int, sh, kept: int, grads: int,
               emb_numel: int, block_numel: int, head_numel: int, ac: str = "none",
               rules: Rules = RULES[CPU_GLOO], sched: str = "1F1B") -> list[Peak]:
    """The live bytes at each candidate moment of a steady step of pipeline stage s's rank under
    torchtitan's 1F1B over FSDP2 (dp_shard), activation checkpointing `ac`. stage: pp.pp_stages'
    (has tok_embeddings, first layer, layers, has [norm, lm_head]); sh: the stage's fsdp.Sharded (padded
    full numel per unit); kept: the rank's params + optim + other state bytes, grads: its grad state
    bytes; *_numel: a unit's unpadded numel (the shape of its unsharded params and grads).

    The most of these moments (measured on tests/test_titan.py's PP jobs, the probe's census), in this
    order: perform_reduce_grad at each unit (_at_perform_reduce_grad); on stages before the last, a
    micro-batch's backward at each block (_at_microbatch_backward: _Stage.block_moments: its attention_norm,
    ffn_norm and SwiGLU backward, with TP wo's gathered weight, with SP under AC the recompute's w2
    reduce-scatter) and with SP the last warm-up forward (_at_last_warmup_forward); on the last stage, its last
    micro-batch's lm_head reduce-scatter at the last loss chunk (_at_lm_head_reduce_scatter), a loss
    chunk's cross-entropy backward (_at_loss_chunk_backward), the final norm's backward
    (_at_final_norm_backward) and its blocks' backward after it (_at_blocks_after_final_norm).
    rules: the target's (target.py). Under GPipe (sched) every forward runs before any backward
    (_at_microbatch_backward's micro-batches in flight; the last stage's moments: _gpipe_last_stage)."""
    return _moments(_stage(model, lay, stage, s, sh, kept, grads, emb_numel, block_numel, head_numel, ac, rules,
                           sched == "GPipe"))


def _moments(c: _Stage, most_only: bool = False) -> list[Peak]:
    """pp_moments over the stage's shared values; most_only: of a backward's block moments only the first most
    (pp_peak's fast path: the peak is the same, first on ties, as the list's)."""
    before, after = hsdp_loss_outputs_held(c)
    cands = _with_held(_at_perform_reduce_grad(c), after) + _at_microbatch_backward(c, most_only) + \
        _at_last_warmup_forward(c)
    if c.has_head and c.gpipe:
        rs, ce, *backwards = _gpipe_last_stage(c)
        cands += [rs, *_with_held([ce], before), *_with_held(backwards, after)]
    elif c.has_head:
        x = _last_microbatch(c)
        cands += [_at_lm_head_reduce_scatter(c, x), *_with_held([_at_loss_chunk_backward(c, x)], before),
                  *_with_held([_at_final_norm_backward(c, x), *_at_blocks_after_final_norm(c, x)], after)]
    return [p.plus(c.held_lines()) for p in cands] if c.sac_held else cands


def hsdp_loss_outputs_held(c: _Stage) -> tuple[int, int]:
    """HSDP, the last stage: ChunkedLossWrapper turns gradient sync on at a loss's last chunk, so FSDP all-reduces
    the reduce-scatter output and keeps it (FSDPParamGroup._all_reduce_state.all_reduce_input) until the group's
    next reduce (post_backward's _wait_for_post_backward); where the output was added into existing grads, not
    viewed by one, it is a buffer of its own. 1F1B: micro-batch 0's loss reduces lm_head alone, 1's the norm too
    (its first grad: viewed), the later ones add both; GPipe: lm_head alone, every loss after the first adds.
    Returns (held at the last loss's cross-entropy, the loss before's; held after the last loss, through the
    backwards to perform_reduce_grad's [norm, lm_head] unit) (measured: pp2·rep2 at seq 512 under 1F1B, the last
    stage's final norm backward 1.88% under without it)."""
    if not (c.has_head and c.hsdp):
        return 0, 0
    one = c.loss_output_shard(with_norm=not c.gpipe)
    first_added = 1 if c.gpipe else 2  # the first loss whose output is added into existing grads
    return one * (c.n - 2 >= first_added), one * (c.n - 1 >= first_added)


def _with_held(peaks: list[Peak], held: int) -> list[Peak]:
    """peaks with HSDP's held all-reduce input (hsdp_loss_outputs_held) beside them."""
    return [p.plus({"temporary/HSDP's last loss's all-reduce input held": held}) for p in peaks] if held else peaks


@dataclass(frozen=True)
class _Stage:
    """What pp_moments' moments share: the stage (pp_moments' arguments), its tokens and activations,
    its units, and the buffers every moment holds."""
    lay: object
    sh: object
    s: int
    kept: int
    block_grad_numel: int  # a block's unsharded grads' numel, bf16 in its backward and fp32 accumulated (_stage: TP-full where partial_weight_grads)
    head_numel: int
    has_emb: bool
    Ls: int  # the stage's blocks
    has_head: bool
    T: int  # the micro-batch's tokens
    Tn: int  # those a norm sees and the residual stream holds (T / tp with SP)
    h: int
    ffn: int  # the TP-local ffn columns
    w2_grad_numel: int  # w2's weight grad out of its mm (TP-full where it leaves Partial: partial_weight_grads)
    swiglu: SwigluBackward  # a block's SwiGLU backward at its largest moment (peak.swiglu_backward)
    attn_saves: int  # a block's saves of its attention half (its attention_norm's to SDPA's)
    attn_grads_numel: int  # the block's grads but its q / k / v projections' and attention_norm's
    qkv: int  # the q / k / v projections' output columns (TP-local), fused or not
    q: int  # the q projection's (wo's input columns)
    fused_qkv: bool  # one wqkv weight (torchtitan's FusedQKVLinear) or wq, wk, wv
    wo_gather: int  # wo's weight all-gathered and cat'ed for its input grad (0 where DTensor does not)
    recompute_rs: int  # SP under AC: what a block's recompute holds at w2's reduce-scatter (0 otherwise)
    ds: int
    P: int
    n: int  # micro-batches
    first: bool
    last: bool
    act: int  # one [mbs, S, h] bf16 activation or grad
    act1: int  # a block's saves without checkpointing (what its backward, after a recompute, holds)
    blk: int  # what a block holds between its forward and backward under `ac` (saved and kept)
    ck_in: int  # a checkpoint's stored input (the block's input)
    first_in: int  # on a stage after the first, block 0's input is the P2P receive buffer
    order: tuple  # units in reduce order: (name, padded full, unpadded numel, its last param's numel)
    head_full: int
    head_grads: int  # [norm, lm_head]'s synced grads (0 without the head)
    unsharded: int  # every unit unsharded, as in the micro-batches' backward
    acc_all: int  # every unit's fp32 accumulator (no head)
    recv: int  # the P2P receive buffers
    # SP under SelectiveAC with the fused wqkv, a stage after the first: what a step's block recomputes leave alive
    # into the next step (_stage)
    sac_held: int = 0
    # the first stage with TP: what its vocab-parallel tok_embeddings saves per micro-batch until its backward
    # (peak.vocab_parallel_saves)
    emb_saves: int = 0
    rules: Rules = RULES[CPU_GLOO]  # the target's (target.py)
    # GPipe (torch's ScheduleGPipe._step_microbatches): every forward, then every backward; the forward sends'
    # works (fwd_sends_to_wait) and the backward sends' (bwd_sends_to_wait) are kept in lists until the step's
    # end, so every activation sent on and every input grad sent back stays referenced
    gpipe: bool = False
    # a neighbour stage on this rank (the V schedules' middle pair, schedules.local_stages): the runtime passes the
    # activation (its grad) on without P2P, setting it as the receiver's receive buffer (stage.py set_local_fwd_input,
    # set_local_bwd_input), which holds it until the next step's pass replaces it: counted as that receive buffer (recv),
    # no held send
    local_next: bool = False
    local_prev: bool = False

    def held_lines(self) -> dict[str, int]:
        """Peak.plus lines of what a step holds from the step before at every moment (sac_held)."""
        return {"unnamed/each block's recompute all-gather and attention_norm output shard, from the step before":
                self.sac_held}

    @property
    def hsdp(self) -> bool:
        return self.lay.dp_replicate > 1

    @property
    def recv_local(self) -> int:
        """The receive buffers (recv) of its passes from a neighbour on this rank (local_next, local_prev)."""
        return self.n * self.act * (self.local_next + self.local_prev)

    def norm_saved(self) -> int:
        """What an RMSNorm saves of its input: the composite's fp32 upcast, or the fused kernel's bf16
        input and fp32 rstd (target.py)."""
        T, h = self.Tn, self.h
        return T * h * BF16 + T * F32 if self.rules.fused_rms_norm else T * h * F32

    def final_norm_saves(self) -> int:
        """The last stage's final norm's saved tensors (the composite's x and x * rsqrt in fp32 and rsqrt, or
        the fused kernel's input and rstd) and its bf16 output (with SP all-gathered for lm_head)."""
        T, Tn, h = self.T, self.Tn, self.h
        return (Tn * h * BF16 if self.rules.fused_rms_norm else Tn * h * F32 * 2) + Tn * F32 + T * h * BF16

    def lm_numel(self) -> int:
        """lm_head's numel (the [norm, lm_head] unit's but the norm's)."""
        return self.head_numel - self.h

    def at_lm_head_rs_working(self, copies: tuple[int, int]) -> int:
        """At a loss's lm_head reduce-scatter (the last chunk): ChunkedLossWrapper's fp32 [B, S, h]
        GradAccumulator, the last chunk's bf16 logits and input grad, and the labels' chunk copies
        (peak.chunk_copies)."""
        T, h, chunk, V = self.T, self.h, self.T // LOSS_CHUNKS, self.lm_numel() // self.h
        return T * h * F32 + chunk * V * BF16 + chunk * h * BF16 + copies[1]

    def at_loss_chunk_working(self, copies: tuple[int, int]) -> int:
        """At a loss chunk's cross-entropy backward (after the first chunk): the GradAccumulator,
        lm_head's fp32 unsharded grad, the chunk's bf16 logits, plain cross-entropy's three fp32 [chunk, V]
        buffers (loss parallel's four with TP: peak.at_loss_chunk) and the labels' chunk copies."""
        T, h, chunk, Vh = self.T, self.h, self.T // LOSS_CHUNKS, self.lm_numel()
        ce = (3 if self.lay.tp == 1 else 4) * chunk * (Vh // h) * F32
        return T * h * F32 + Vh * F32 + chunk * (Vh // h) * BF16 + ce + copies[1]

    def loss_output_shard(self, with_norm: bool) -> int:
        """A loss's reduce-scatter output on this rank, fp32: lm_head's grad's shard, or (with_norm: where a backward
        gave the final norm a grad since the loss before) [norm, lm_head]'s. HSDP all-reduces it and FSDP holds it
        (hsdp_loss_outputs_held; pp_looped's ar_kind)."""
        return (self.head_full if with_norm else self.sh.lm_full) * F32 // self.ds

    def at_final_norm_working(self) -> int:
        """The final norm's backward: the RMSNorm composite's five fp32 [T, h] temporaries and the norm's
        bf16 weight grad."""
        return 5 * self.Tn * self.h * F32 + self.h * BF16

    def chunk_saves(self) -> int:
        """One micro-batch's saves on this stage between its forward and backward."""
        return self.Ls * self.blk - self.first_in + self.emb_saves

    @property
    def sp(self) -> bool:
        """The residual stream sequence-sharded over tp (SP)."""
        return bool(self.lay.sequence_parallel) and self.lay.tp > 1

    def captured_block(self) -> int:
        """What a zero-bubble I (pipelining/_backward.py stage_backward_input) leaves captured for its W in one
        block: the grad flowing into each weight's node, which get_param_groups' prehooks keep in its param group
        until stage_backward_weight: the two norms' [T, h] (the composite multiplies by the weight in fp32: the
        upcast's grad; the fused kernel's node takes its bf16 output grad, from sources), w1's and w3's [T, ffn]
        (silu_backward's and the mul's), the q / k / v projections' (the fused wqkv's cat), wo's [T, h] (the
        residual grad past the feed-forward). w2's is the block's output grad, held anyway (the block above's
        input grad, the P2P receive buffer, or the final norm's input grad: captured_grads). With SP wo's and w2's
        are the all-gathered [T, h] copies of those Shard(1) grads (their mms' grad_output: the Partial ->
        Shard(1) redistribution's backward), tensors of their own (captured_gathered), and the residual grads
        themselves are not kept. Measured: 3,407,872 B a block at hidden 128, ffn 384, T 1024 (the probe's census
        by op, InterleavedZeroBubble); with tp2 and SP, 2,097,152 B a block, 1,048,576 B of it all-gathered."""
        T, Tn, h = self.T, self.Tn, self.h
        norm = Tn * h * (BF16 if self.rules.fused_rms_norm else F32)
        return 2 * norm + 2 * T * self.ffn * BF16 + T * self.qkv * BF16 + (2 * self.gathered_grad if self.sp else self.act)

    @property
    def gathered_grad(self) -> int:
        """With SP, a rowwise linear's (wo's, w2's) grad_output: its Shard(1) grad all-gathered, [T, h] bf16."""
        return self.T * self.h * BF16

    def captured_gathered(self, k: int = 0) -> int:
        """Of captured_grads(k), the all-gather outputs (SP: wo's and w2's grad_output a block, captured_block)."""
        return 0 if (self.first or not self.sp) else (self.Ls - k) * 2 * self.gathered_grad

    def captured_grads(self, k: int = 0) -> int:
        """What a micro-batch's I has captured on this stage by block k's backward (k = 0: all of it): blocks
        k..Ls-1 (captured_block) and, without SP, the output grad of each below the top (the block above's input
        grad), on the last stage the top one's too (the final norm's input grad; the top block's on a stage before
        the last is the P2P receive buffer). On the first stage I computes nothing (stage.py backward_one_chunk
        skips it: W runs the whole backward)."""
        if self.first:
            return 0
        outputs = 0 if self.sp else (self.Ls - 1 - k + self.has_head) * self.act
        return (self.Ls - k) * self.captured_block() + outputs

    def before(self, k: int) -> int:
        """The saves of blocks 0..k-1 of the micro-batch in backward (and its embedding's, on the first stage)."""
        return k * self.blk - (self.first_in if k else 0) + self.emb_saves

    def own(self, k: int) -> int:
        """Block k's checkpoint input while the block is recomputed and backpropagated."""
        return self.ck_in if (k or self.s == 0) else 0

    @cached_property
    def _block_moments_made(self) -> dict:
        """block_moments already made, by (k, incoming): a stage's backwards ask for the same ones (a cached_property
        lives in the instance, so dataclasses.replace starts a new stage without them)."""
        return {}

    def block_moments(self, k: int, incoming: int) -> tuple:
        made = self._block_moments_made
        if (k, incoming) not in made:
            made[k, incoming] = self._block_moments(k, incoming)
        return made[k, incoming]

    def _block_moments(self, k: int, incoming: int) -> tuple:
        """Block k's moments in its backward: (name, the saves of blocks 0..k and its checkpoint's
        input then, its backward's working set). At its attention_norm: its seven linears' and two
        norms' bf16 weight grads, the residual grad, the RMSNorm composite's five fp32 [T, h]
        temporaries (aten rms_norm decomposed: mul, sum, pow, mul, div), of its own saves only that
        norm's fp32 input. At its SwiGLU backward's second factor's grad (peak.swiglu_backward: with TP
        without SP where w2's input grad leaves its mm Partial, its second reduce-scatter): w2's bf16 weight
        grad, SwiGLU's grads, its saves but w2's input (freed by w2's mm backward), and `incoming`, the grad
        flowing into it where that is a tensor of its own (not the P2P receive buffer). At its ffn_norm, between them: the feed-forward's three
        weight grads, the norm's temporaries and fp32 input, the attention half's saves. At long sequences
        the SwiGLU moment is the larger; where the tokens are few for the weights (CP) the ffn_norm's."""
        T, h, ffn = self.T, self.h, self.ffn
        out = (("attention_norm", self.before(k) + self.own(k) + self.norm_saved(),
                self.block_grad_numel * BF16 + self.act + 5 * self.Tn * h * F32),
               # between them, the ffn_norm's backward: the feed-forward's three bf16 weight grads, the norm
               # composite's five fp32 [T, h] temporaries, the attention half's saves and the norm's fp32
               # input; the feed-forward's own saves freed (measured: pp2·cp2, where CP halves the tokens but
               # not the weight grads: stage 0's peak)
               ("ffn_norm", self.before(k) + self.own(k) + self.attn_saves + self.norm_saved(),
                (2 * ffn * h + self.w2_grad_numel) * BF16 + 5 * self.Tn * h * F32 + incoming),
               (self.swiglu.at, self.before(k) + self.own(k) + self.act1 - T * ffn * BF16,
                self.w2_grad_numel * BF16 + self.swiglu.bytes + incoming))
        if self.recompute_rs:
            # SP under AC (peak._at_recompute_rs without PP): the block's output grad all-gathered for w2's
            # backward, then its recompute forward to w2's reduce-scatter: every save of the block, the
            # attention's residual sum, ffn_norm's output, w2's TP-full output, the reduce-scatter's copy of its
            # input on gloo and its output (measured: pp2·tp2·SP at seq 1024, both stages' peak)
            out += (("w2's reduce-scatter in its recompute", self.before(k) + self.own(k), self.recompute_rs + incoming),)
        if self.wo_gather:
            # TP without SP, where DTensor's strategy for wo's input grad (mm(grad, W), W Shard(1)) gathers W
            # (dtensor.wo_input_grad_gathers_weight): the gathered [h, q] and its dim-1 cat beside the
            # grads the FFN half and wo made, the attention half's saves still held (measured: pp2·tp2, on
            # the first stage without checkpointing and the last under full AC: the peak)
            out += (("wo input grad, its weight all-gathered", self.before(k) + self.own(k) + self.attn_saves,
                     self.attn_grads_numel * BF16 + self.act + self.wo_gather),)
        return out

    def held(self, last_numel: int) -> int:
        """_fsdp_collectives.py foreach_reduce: with a shard group of more than one, the loop over
        (fsdp_param, unsharded_grad) that checks Shard(dim > 0) leaves its variable bound to the
        last param's unsharded grad until foreach_reduce returns (after the reduce-scatter), so
        unsharded_grads.clear() frees all but that one (measured: pp2·dp2's tok_embeddings grad)."""
        return last_numel * F32 if self.ds > 1 else 0

    def in_block_bytes(self, g: int, acc: int, gathered: int, saved: int, work: int) -> int:
        """in_block's bytes, its Peak not built (the fast paths pick a backward's most block moment first)."""
        return self.kept + self.unsharded + g + saved + gathered + acc + work

    def in_block(self, what: str, g: int, acc: int, gathered: int, saved_label: str, saved: int, work_label: str,
                 work: int) -> Peak:
        """A moment inside a block's backward (_at_microbatch_backward, _at_blocks_after_final_norm):
        every unit unsharded, g: [norm, lm_head]'s grads (the last stage), acc: the fp32 accumulators,
        gathered: P2P buffers and held sends (the last stage: lm_head's reduce-scatter input held too)."""
        kept, unsharded = self.kept, self.unsharded
        d = {_STATE: kept, "resident/unsharded params (every unit)": unsharded,
             "temporary/fp32 accumulated grads": acc, f"activations/{saved_label}": saved,
             f"temporary/{work_label}": work, "gathered/p2p buffers and held sends": gathered}
        if g:
            d["resident/grads ([norm, lm_head]'s outputs)"] = g
        parts = {"resident": kept + unsharded + g, "activations": saved, "gathered": gathered,
                 "temporary": acc + work}
        return Peak.of(parts, phase="backward", what=what, detail=d)


def _stage(model, lay, stage: tuple[bool, int, int, bool], s: int, sh, kept: int, grads: int,
           emb_numel: int, block_numel: int, head_numel: int, ac: str, rules: Rules = RULES[CPU_GLOO],
           gpipe: bool = False, stages: int | None = None) -> _Stage:
    """pp_moments' _Stage; stages: the pipeline's stages where a rank holds several (pp_looped.py), lay.pp
    where it holds one."""
    has_emb, _, Ls, has_head = stage
    B, S, h = lay.micro_batch_size, model.seq_len, model.hidden
    # FSDP shards over dp_shard x cp (states.py); CP gives the rank S / cp of each sequence's positions
    ds, P, n = lay.dp_shard * lay.cp, stages or lay.pp, lay.num_microbatches
    T = B * S // lay.cp
    # a block's saves without checkpointing (what its backward, after a checkpoint's recompute, holds),
    # and what it holds between its forward and its backward under the configured checkpointing
    # (saved_per_layer: outside the checkpoint, and a selective checkpoint's kept outputs); while a
    # checkpointed block is backpropagated its checkpoint still holds the block's input
    tp, sp = lay.tp, bool(lay.sequence_parallel)
    act1, _, saves = saved_per_layer(model, B, S, "none", tp, sp, lay.cp, rules)
    ac_saved, ac_kept, _ = saved_per_layer(model, B, S, ac, tp, sp, lay.cp, rules)
    ck_in = ac_saved if ac != "none" else 0
    first, last = s == 0, s == P - 1
    # TP: a rowwise weight whose grad leaves its mm Partial (dtensor.partial_weight_grads: wo and w2 without SP
    # at most shapes) holds it TP-full, in bf16 from the mm, then as FSDP's fp32 accumulator, until
    # perform_reduce_grad redistributes it to its Shard(1) placement (a reduce-scatter over tp) before the
    # unit's chunk_cat (measured: pp2·tp2, the probe's census at perform_reduce_grad)
    f, q = model.ffn_hidden, model.heads * model.head_dim
    full = partial_weight_grads(model, T, tp, sp) if tp > 1 else ()
    grad_numel = block_numel + sum([h * k - h * k // tp for name, k in (("wo", q), ("w2", f)) if name in full])
    qkv_local = (model.heads // tp + 2 * (model.kv_heads // tp)) * model.head_dim
    gathers = tp > 1 and wo_input_grad_gathers_weight(model, T, tp, sp)
    # units in reduce order (FSDP state order): (name, padded full, unpadded numel, the numel of its
    # last param in FSDP's order: models/llama3/model.py registers attention, feed_forward,
    # attention_norm, ffn_norm, so a block's is ffn_norm's)
    order = ([("tok_embeddings", sh.emb_full, emb_numel, emb_numel)] if has_emb else []) + \
        [(f"block {j}", sh.layer_full, grad_numel, h) for j in range(Ls)]
    head_full = sh.norm_full + sh.lm_full
    shard_bytes = sum([f // ds * F32 for _, f, _, _ in order])
    Tn = T // tp if sp else T  # the tokens a norm sees and the residual stream holds (SP: Shard(1))
    act = Tn * h * BF16
    # SP under SelectiveAC with torchtitan's fused wqkv (FusedQKVLinear: a local_map over the SP all-gather of its
    # input): a block's recompute keeps its attention_norm output shard alive at w2's reduce-scatter (peak.py's
    # _at_recompute_rs, the same without PP), and on every stage after the first (whose input comes over P2P and
    # needs a grad) every block's recompute leaves that shard and the [T, h] all-gather it fed alive into the next
    # step, one set a block, replaced a step later (the probe's census, objects live at a step's start by where the
    # step before made them: pp2·tp2·SP at seq 1024, hidden 256, under 1F1B with 2 and 3 micro-batches and under
    # Interleaved1F1B, stages 1 and 2 of 4; none with wq / wk / wv separate, under full AC or on stage 0). What
    # holds them is not traced: a measured rule, as peak.py's
    fused_sac = sp and ac == "selective" and model.fused_qkv
    return _Stage(
        lay=lay, sh=sh, s=s, kept=kept, block_grad_numel=grad_numel, head_numel=head_numel, has_emb=has_emb, Ls=Ls,
        has_head=has_head, T=T, Tn=Tn, h=h, ffn=model.ffn_hidden // tp,
        w2_grad_numel=h * f if "w2" in full else h * f // tp,
        swiglu=swiglu_backward(model, T, tp, sp),
        attn_saves=act1 - saves["swiglu"] - saves["2 rmsnorms"] // 2,
        attn_grads_numel=grad_numel - qkv_local * h - h, qkv=qkv_local, q=q // tp, fused_qkv=model.fused_qkv,
        wo_gather=2 * h * q * BF16 if gathers else 0,
        recompute_rs=(act1 + 3 * act + 2 * T * h * BF16 + (T * h * BF16 if rules.rs_input_copy else 0)
                      + (act if fused_sac else 0) if sp and ac != "none" else 0), ds=ds, P=P, n=n, first=first, last=last, act=act,
        act1=act1, blk=ac_saved + ac_kept, ck_in=ck_in, first_in=0 if s == 0 else ck_in, order=tuple(order),
        head_full=head_full, head_grads=grads - shard_bytes,
        unsharded=sum([f for _, f, _, _ in order]) * BF16 + (head_full * BF16 if has_head else 0),
        acc_all=(emb_numel * has_emb + Ls * grad_numel) * F32, recv=n * ((not first) + (not last)) * act,
        rules=rules, gpipe=gpipe, sac_held=Ls * (T * h * BF16 + act) if fused_sac and s > 0 else 0,
        emb_saves=vocab_parallel_saves(lay, B, S) if has_emb else 0)


def _at_perform_reduce_grad(c: _Stage) -> list[Peak]:
    """perform_reduce_grad after the stage's last backward (reduce_grad_moments): [norm, lm_head]'s grads and the
    final norm's accumulator held, the last activation sent on and input grad sent back; GPipe's every one
    (_Stage.gpipe: its send lists live until _step_microbatches returns, after perform_reduce_grad)."""
    p2p = c.recv + ((not c.last) + (not c.first)) * c.act * (c.n if c.gpipe else 1)
    return reduce_grad_moments(c, c.head_grads, c.has_head, p2p)


def reduce_grad_moments(c: _Stage, head_grads: int, norm_acc: bool, p2p: int, label: str = "", acc_made: bool = True,
                        bf16_grads: bool = False) -> list[Peak]:
    """perform_reduce_grad, unit by unit in the stage's order (tok_embeddings, the blocks, [norm,
    lm_head]): a unit resharded (its bf16 params freed), its fp32 reduce-scatter input (padded full,
    chunk_cat of its accumulators, which are then freed), its output shard (the new sharded grad)
    and a second full-size fp32 buffer (gloo's copy of the input with a shard group of more than
    one; with one, foreach_reduce's reduce_scatter_input / gradient_divide_factor); the units after
    it still unsharded with their accumulators, the units before it with their sharded grads.
    head_grads: [norm, lm_head]'s grads alive (the last stage); norm_acc: whether the final norm's fp32
    accumulated grad is held; p2p: the receive buffers and the sends held; label: after each moment's name
    (pp_looped.py names the stage). After a split backward's W (pp_looped.py) the units' grads are bf16 .grads
    (bf16_grads) that each unit's post_backward accumulates first, into the fp32 accumulators (acc_made) or into new
    ones: the units after it hold them."""
    h, kept, order = c.h, c.kept, c.order
    cands = []
    for u, (name, full, _numel, last_numel) in enumerate(order):
        after = order[u + 1:]
        unsharded_after = sum([f for _, f, _, _ in after]) * BF16 + (c.head_full * BF16 if c.has_head else 0)
        acc = (sum([m for _, _, m, _ in after]) * (F32 * acc_made + BF16 * bf16_grads) + (h * F32 if norm_acc else 0)
               + c.held(last_numel))
        g = head_grads + sum([f // c.ds * F32 for _, f, _, _ in order[:u + 1]])
        # the last micro-batch's final-norm output (the stage's output; with SP all-gathered for lm_head)
        last_out = c.T * h * BF16 if c.has_head else 0
        copy = rs_temporary(c.rules, c.ds, full * F32)
        acc_kind = "a W's bf16 and fp32" if bf16_grads else "fp32"
        d = {_STATE: kept, "resident/grads (units reduced, lm_head synced)": g,
             "resident/unsharded params (units after)": unsharded_after,
             f"temporary/{acc_kind} accumulated grads (units after; the unit's last one held)": acc,
             "gathered/reduce-scatter input (fp32)": full * F32, "temporary/gloo copy or divided input (fp32)": copy,
             "gathered/p2p buffers and held sends": p2p, "activations/last micro-batch's final norm output": last_out}
        parts = {"resident": kept + g + unsharded_after, "activations": last_out, "gathered": full * F32 + p2p,
                 "temporary": acc + copy}
        cands.append(Peak.of(parts, phase="optimizer", what=f"perform_reduce_grad: {name}{label}",
                             detail={k: v for k, v in d.items() if v}))
    return cands


def _at_last_warmup_forward(c: _Stage) -> list[Peak]:
    """With SP, on a stage before the last: the last warm-up forward of 1F1B (min(n, P - s) micro-batches in
    flight, every one's saves complete) at its last block's w2 reduce-scatter (Partial [T, h] -> Shard(1)):
    w2's TP-full bf16 output, the reduce-scatter's output and on gloo its copy of the input beside the block's input, its
    attention residual and its ffn_norm's bf16 output (the tensors the block's forward still references),
    the receive buffers and the earlier micro-batches' sends held (measured: pp2·tp2·SP at seq 1024, stage
    0's peak). Without SP w2's output is all-reduced instead: not derived, never the peak measured."""
    if not c.lay.sequence_parallel or c.lay.tp == 1 or c.last or not c.Ls:
        return []
    flight = min(c.n, c.P - c.s)
    act, full = c.act, c.T * c.h * BF16
    p2p = c.recv + (flight - 1) * c.act
    work = 4 * act + full + (full if c.rules.rs_input_copy else 0)  # gloo's copy of the input: target.py
    d = {_STATE: c.kept, "resident/unsharded params (every unit)": c.unsharded,
         f"activations/{flight} micro-batches x {c.Ls} blocks": flight * c.chunk_saves(),
         "temporary/block input, attention residual, ffn_norm output, w2's output and its reduce-scatter's input "
         "and output": work, "gathered/p2p buffers and held sends": p2p}
    parts = {"resident": c.kept + c.unsharded, "activations": flight * c.chunk_saves(), "gathered": p2p,
             "temporary": work}
    return [Peak.of(parts, phase="forward", what=f"micro-batch {flight - 1}'s forward at block {c.Ls - 1}'s w2 "
                    "reduce-scatter (SP)", detail=d)]


def _at_microbatch_backward(c: _Stage, most_only: bool = False) -> list[Peak]:
    """The backward of a micro-batch i (0, and 1 where there are more) at block k, on stages before the
    last: at block k's attention_norm backward every unit's accumulator (i >= 1; the blocks after k at
    i = 0), the saved tensors of the blocks before k and of the other micro-batches in flight
    (Schedule1F1B: min(n, P - s) forwards of warm-up, so min(P - s, n - i) in flight at backward i),
    the block's own: its seven linears' bf16 grads, its norms' bf16 weight grads, the residual grad
    (bf16 [T, h]), the attention_norm's fp32 input it saved and the five fp32 [T, h] temporaries of
    the RMSNorm composite's backward (aten rms_norm decomposed: mul, sum, pow, mul, div); or, at long
    sequences, earlier in the same block, at its SwiGLU backward (the block's saved tensors but w2's
    input, three bf16 [T, ffn] grads, w2's weight grad): _Stage.block_moments. most_only: the first most of
    them alone (block_peaks)."""
    Ls, n, act = c.Ls, c.n, c.act
    if c.last or not Ls:
        return []
    moments = []
    warm = n if c.gpipe else min(n, c.P - c.s)  # GPipe: every forward before the first backward
    # Schedule1F1B._step_microbatches keeps its warm-up's last `send_work` (the sends of forward warm - 2) until
    # the cool-down reassigns it: through the steady loop's backwards (0 .. n - warm) that output stays held after
    # its own backward, so backward warm - 1 holds one activation more than backward 1 where warm > 2 (measured:
    # pp2·tp2·SP under selective AC with 3 micro-batches, stage 0 at backward 1, forward 0's output in the census)
    for i in sorted({0, min(1, n - 1), *([warm - 1] if not c.gpipe and 1 < warm <= n - warm + 1 else [])}):
        flight = min(warm, n - i)
        send_work = act if not c.gpipe and warm >= 2 and warm - 1 <= i <= n - warm else 0
        # the sends held: 1F1B's in-flight outputs, the warm-up's last send_work and the input grad last sent
        # back; GPipe's every output and every input grad sent so far (_Stage.gpipe)
        p2p = c.recv + (n * act + i * act * (not c.first) if c.gpipe else
                        flight * act + send_work + (act if i >= 1 and not c.first else 0))
        what = f"micro-batch {i} backward at block {{k}}'s {{name}}"
        saved_label = f"{flight - 1} other micro-batches x {Ls} blocks, blocks 0..{{k}}"
        for k in range(Ls - 1, -1, -1):
            acc = c.acc_all if i >= 1 else (Ls - 1 - k) * c.block_grad_numel * F32
            # the grad into the stage's last block is the P2P receive buffer, the residual grad below it
            for name, saved, work in c.block_moments(k, act if k < Ls - 1 else 0):
                moments.append(BlockMoment(what, saved_label, k, name, 0, acc, p2p, (flight - 1) * c.chunk_saves() + saved,
                                           work))
    return block_peaks(c, moments, most_only)


class BlockMoment(NamedTuple):
    """A moment inside block k's backward, as _Stage.in_block reads it, its what and saved label with {k} and
    {name} (the moment's) to fill (block_peaks: only for the Peaks built)."""
    what: str
    saved_label: str
    k: int
    name: str
    g: int
    acc: int
    gathered: int
    saved: int
    work: int


def block_peaks(c: _Stage, moments: list[BlockMoment], most_only: bool) -> list[Peak]:
    """The Peaks of a backward's block moments; most_only: the first most alone (in_block_bytes: a fast path
    builds only the Peak it may keep)."""
    if most_only and moments:
        moments = [max(moments, key=lambda m: c.in_block_bytes(m.g, m.acc, m.gathered, m.saved, m.work))]
    return [c.in_block(m.what.format(k=m.k, name=m.name), m.g, m.acc, m.gathered, m.saved_label.format(k=m.k), m.saved,
                       f"block {m.k}'s backward at its {m.name}", m.work) for m in moments]


class _LastMicrobatch(NamedTuple):
    """What the last stage's moments of its last micro-batch m share (_last_microbatch)."""
    m: int
    Vh: int  # lm_head's numel
    rs: int  # the padded full numel lm_head's reduce-scatter at the last chunk reduces
    g: int  # [norm, lm_head]'s synced grads at its reduce-scatter (its output among them)
    g_after: int  # those grads once the reduce-scatter's copy-out is done (_last_microbatch)
    acc_blocks: int  # the blocks' fp32 accumulators
    copies: tuple[int, int]  # chunk_copies
    saved: int  # the blocks', the final norm's and the chunk copies' saved tensors
    p2p: int  # P2P buffers and held sends


def _last_microbatch(c: _Stage) -> _LastMicrobatch:
    T, h, ds, sh = c.T, c.h, c.ds, c.sh
    m = c.n - 1
    rs = c.head_full if m >= 1 else sh.lm_full  # micro-batch 0 reduces lm_head alone
    g = sh.lm_full // ds * F32 + (c.head_full // ds * F32 if m >= 2 else 0) + rs // ds * F32
    copies = chunk_copies(c.lay, T, h)
    return _LastMicrobatch(
        m=m, Vh=c.lm_numel(), rs=rs,
        g=g,
        # the copy-out (_fsdp_collectives.py foreach_reduce_scatter_copy_out): a param whose sharded grad
        # exists adds the output into it, one without one takes a view of it. From micro-batch 2 on both
        # norm and lm_head have one, so the last output is freed once added (measured: pp2·tp2, three
        # micro-batches, the last stage's blocks after its final norm); micro-batch 1's stays, the norm's
        # grad viewing it
        g_after=g - (rs // ds * F32 if m >= 2 else 0),
        acc_blocks=c.acc_all if m >= 1 else 0, copies=copies, saved=c.chunk_saves() + c.final_norm_saves() + copies[0],
        p2p=c.recv + (c.act if m >= 1 and not c.first else 0))


def _at_lm_head_reduce_scatter(c: _Stage, x: _LastMicrobatch) -> Peak:
    """The last stage's lm_head reduce-scatter at the last micro-batch's last chunk, where the wrapper
    reduce-scatters lm_head's grad (with the norm's accumulated from the micro-batch before): the blocks'
    and the root norm's saved tensors (one micro-batch in flight on the last stage), the accumulators of
    the blocks, [norm, lm_head] unsharded, the wrapper's fp32 grad accumulator, the last chunk's logits
    and input grad, the reduce-scatter input, output and gloo copy (as peak.py's at_lm_head); with a
    shard group of more than one lm_head's unsharded fp32 grad too (_Stage.held)."""
    kept, unsharded = c.kept, c.unsharded
    Vh, rs, g, saved = x.Vh, x.rs, x.g, x.saved
    # (lm_head's unsharded fp32 grad, chunk_cat's input, is freed before the reduce-scatter but where
    # held() keeps it)
    wrapper = c.at_lm_head_rs_working(x.copies)
    acc = x.acc_blocks + c.held(Vh)  # lm_head is [norm, lm_head]'s last param
    copy = rs_temporary(c.rules, c.ds, rs * F32)
    d = {_STATE: kept, "resident/grads ([norm, lm_head]'s outputs)": g,
         "resident/unsharded params (every unit)": unsharded,
         "temporary/fp32 accumulated grads (blocks; lm_head's held)": acc,
         f"activations/{c.Ls} blocks and the final norm": saved,
         "temporary/grad accumulator, last chunk's logits and input grad": wrapper,
         "gathered/reduce-scatter input (fp32)": rs * F32, "temporary/gloo copy or divided input (fp32)": copy,
         "gathered/p2p buffers and held sends": x.p2p}
    if not copy:
        del d["temporary/gloo copy or divided input (fp32)"]
    parts = {"resident": kept + g + unsharded, "activations": saved, "gathered": rs * F32 + x.p2p,
             "temporary": acc + wrapper + copy}
    return Peak.of(parts, phase="backward",
                what=f"lm_head reduce-scatter at micro-batch {x.m}'s last loss chunk", detail=d)


def _at_loss_chunk_backward(c: _Stage, x: _LastMicrobatch) -> Peak:
    """The last micro-batch's loss at a chunk's cross-entropy backward (after the first chunk; as
    peak.py's at_loss_chunk: plain cross-entropy, three fp32 [chunk, V] buffers), before its
    reduce-scatter: the micro-batch before's reduce-scatter input still held (until this
    foreach_reduce), lm_head's fp32 unsharded grad accumulating."""
    kept, unsharded, sh, m = c.kept, c.unsharded, c.sh, x.m
    prev_rs = ((sh.lm_full if m == 1 else c.head_full) * F32) if m >= 1 else 0
    g_before = x.g - x.rs // c.ds * F32
    wrap = c.at_loss_chunk_working(x.copies)
    d = {_STATE: kept, "resident/grads ([norm, lm_head]'s outputs)": g_before,
         "resident/unsharded params (every unit)": unsharded,
         "temporary/fp32 accumulated grads (blocks)": x.acc_blocks,
         f"activations/{c.Ls} blocks, the final norm, chunk copies": x.saved,
         "temporary/grad accumulator, lm_head's fp32 grad, chunk logits, cross-entropy backward": wrap,
         "gathered/the micro-batch before's reduce-scatter input (held)": prev_rs,
         "gathered/p2p buffers and held sends": x.p2p}
    parts = {"resident": kept + g_before + unsharded, "activations": x.saved, "gathered": prev_rs + x.p2p,
             "temporary": x.acc_blocks + wrap}
    return Peak.of(parts, phase="backward",
                what=f"micro-batch {m}'s loss chunk cross-entropy backward", detail=d)


def _at_final_norm_backward(c: _Stage, x: _LastMicrobatch) -> Peak:
    """The last micro-batch's final norm backward (after its loss: as peak.py's _at_final_norm): its
    reduce-scatter input held, the blocks' saved tensors, the norm's fp32 input and backward
    temporaries; every unit already unsharded (no prefetch). The norm's bf16 output, freed here
    without PP, is the stage's output, which pipelining keeps."""
    T, h, kept, unsharded, g, rs = c.T, c.h, c.kept, c.unsharded, x.g_after, x.rs
    work = c.at_final_norm_working()
    d = {_STATE: kept, "resident/grads ([norm, lm_head]'s outputs)": g,
         "resident/unsharded params (every unit)": unsharded,
         "temporary/fp32 accumulated grads (blocks)": x.acc_blocks,
         f"activations/{c.Ls} blocks, the final norm's {'bf16 input, rstd' if c.rules.fused_rms_norm else 'fp32 input'} "
         "and bf16 output": c.chunk_saves() + c.norm_saved() + T * h * BF16,
         "temporary/RMSNorm backward fp32 [T, h] x 5, the norm's bf16 weight grad": work,
         "gathered/lm_head's reduce-scatter input held": rs * F32, "gathered/p2p buffers and held sends": x.p2p}
    parts = {"resident": kept + g + unsharded, "activations": c.chunk_saves() + c.norm_saved() + T * h * BF16,
             "gathered": rs * F32 + x.p2p, "temporary": x.acc_blocks + work}
    return Peak.of(parts, phase="backward",
                what=f"micro-batch {x.m}'s final norm backward", detail=d)


def _at_blocks_after_final_norm(c: _Stage, x: _LastMicrobatch) -> list[Peak]:
    """The last micro-batch's blocks after its final norm (_at_microbatch_backward's moments): what
    _at_final_norm_backward holds but the norm's saves and temporaries, with the norm's fp32
    accumulator, the stage's output (the final norm's, which pipelining keeps) and the grad flowing
    into each block (bf16, its own tensor). With checkpointing the block is recomputed first: there it
    outweighs the loss moments."""
    act, out = c.act, c.T * c.h * BF16  # the stage's output: with SP the final norm's all-gathered
    return [c.in_block(f"micro-batch {x.m} backward at block {k}'s {name}", x.g_after, x.acc_blocks + c.h * F32,
                       x.rs * F32 + x.p2p, f"blocks 0..{k}, the stage's output", saved_k + out,
                       f"block {k}'s backward at its {name}", work_k)
            for k in range(c.Ls - 1, -1, -1) for name, saved_k, work_k in c.block_moments(k, act)]


def _gpipe_last_stage(c: _Stage) -> list[Peak]:
    """The last stage's moments under GPipe (_Stage.gpipe), where every micro-batch's loss runs in the forward
    loop, before any backward: ChunkedLossWrapper (components/loss.py) runs lm_head and its backward chunk by
    chunk inside the loss and reduce-scatters lm_head's grad at each loss's last chunk, with no norm grad yet
    (lm_head alone: the first output becomes its sharded grad, each later one is added into it and freed), and
    its _DecoderOutputGradientBackProp keeps each micro-batch's accumulated [B, S, h] bf16 grad until that
    micro-batch's backward. The moments: the last loss's lm_head reduce-scatter and a chunk's cross-entropy
    backward in it (every micro-batch's saves held, no block accumulator yet), then the first and the last
    micro-batch's backward at the final norm and at each block (the later micro-batches' saves and accumulated
    grads held; the last loss's reduce-scatter input held until perform_reduce_grad)."""
    T, h, ds, sh, n, act = c.T, c.h, c.ds, c.sh, c.n, c.act
    Vh = c.lm_numel()
    g_lm = sh.lm_full // ds * F32  # lm_head's sharded grad once a loss has reduced it
    copies = chunk_copies(c.lay, T, h)
    root = c.final_norm_saves()
    done_mb = c.chunk_saves() + root + T * h * BF16  # a micro-batch whose loss ran: its saves, its grad held
    kept, unsharded = c.kept, c.unsharded
    rs_in = sh.lm_full * F32
    out: list[Peak] = []
    # the last micro-batch's loss: every other one done, its own saves and chunk copies
    saved = (n - 1) * done_mb + c.chunk_saves() + root + copies[0]
    g = g_lm * (2 if n >= 2 else 1)  # the reduce-scatter's output beside lm_head's grad, not yet added
    wrapper = c.at_lm_head_rs_working(copies)
    copy = rs_temporary(c.rules, ds, rs_in)
    d = {_STATE: kept, "resident/grads (lm_head's and the reduce-scatter's output)": g,
         "resident/unsharded params (every unit)": unsharded,
         "temporary/lm_head's fp32 grad held": c.held(Vh),
         f"activations/{n} micro-batches' saves, the earlier ones' accumulated grads": saved,
         "temporary/grad accumulator, last chunk's logits and input grad": wrapper,
         "gathered/reduce-scatter input (fp32)": rs_in, "temporary/gloo copy or divided input (fp32)": copy,
         "gathered/p2p buffers": c.recv}
    out.append(Peak.of({"resident": kept + g + unsharded, "activations": saved, "gathered": rs_in + c.recv,
                        "temporary": c.held(Vh) + wrapper + copy}, phase="backward",
                       what=f"lm_head reduce-scatter at micro-batch {n - 1}'s last loss chunk (GPipe)", detail=d))
    # a chunk's cross-entropy backward in the last loss, the loss before's reduce-scatter input still held
    prev_rs = rs_in if n >= 2 else 0
    g_before = g_lm if n >= 2 else 0
    wrap = c.at_loss_chunk_working(copies)
    d = {_STATE: kept, "resident/grads (lm_head's)": g_before, "resident/unsharded params (every unit)": unsharded,
         f"activations/{n} micro-batches' saves, the earlier ones' accumulated grads": saved,
         "temporary/grad accumulator, lm_head's fp32 grad, chunk logits, cross-entropy backward": wrap,
         "gathered/the loss before's reduce-scatter input (held)": prev_rs, "gathered/p2p buffers": c.recv}
    out.append(Peak.of({"resident": kept + g_before + unsharded, "activations": saved, "gathered": prev_rs + c.recv,
                        "temporary": wrap}, phase="backward",
                       what=f"micro-batch {n - 1}'s loss chunk cross-entropy backward (GPipe)", detail=d))
    # the backwards: micro-batch i with the later ones' saves and accumulated grads held, the input grads sent
    # back so far held (_Stage.gpipe), the last loss's reduce-scatter input held
    for i in sorted({0, n - 1}):
        others = (n - 1 - i) * done_mb
        p2p = c.recv + i * act * (not c.first)
        acc_all = c.acc_all if i >= 1 else 0
        norm_saved = c.chunk_saves() + c.norm_saved() + T * h * BF16
        work = c.at_final_norm_working()
        d = {_STATE: kept, "resident/grads (lm_head's)": g_lm, "resident/unsharded params (every unit)": unsharded,
             "temporary/fp32 accumulated grads (blocks)": acc_all,
             f"activations/micro-batch {i}'s blocks, the final norm's input and output; the later ones'": norm_saved + others,
             "temporary/RMSNorm backward fp32 [T, h] x 5, the norm's bf16 weight grad": work,
             "gathered/the last loss's reduce-scatter input held": rs_in, "gathered/p2p buffers and held sends": p2p}
        out.append(Peak.of({"resident": kept + g_lm + unsharded, "activations": norm_saved + others,
                            "gathered": rs_in + p2p, "temporary": acc_all + work}, phase="backward",
                           what=f"micro-batch {i}'s final norm backward (GPipe)", detail=d))
        for k in range(c.Ls - 1, -1, -1):
            acc = (c.acc_all if i >= 1 else (c.Ls - 1 - k) * c.block_grad_numel * F32) + h * F32
            for name, saved_k, work_k in c.block_moments(k, act):
                out.append(c.in_block(f"micro-batch {i} backward at block {k}'s {name} (GPipe)", g_lm, acc, rs_in + p2p,
                                      f"blocks 0..{k}, the stage's output; {n - 1 - i} later micro-batches",
                                      saved_k + T * h * BF16 + others, f"block {k}'s backward at its {name}", work_k))
    return out
