"""Peak live bytes of a torchtitan 0.3.0 rank within a steady training step, CPU/gloo, without
pipeline parallelism (pp_peak.py has the pipeline's).

What runs (launchers/titan.py, launchers/titan_cpu.py): FSDP2 (torch/distributed/fsdp/_fully_shard)
with bf16 compute and fp32 reduce-scatters, torchtitan's llama3 TransformerBlock, attention through
the CPU redirect of FlexAttention (titan_cpu.math_flex_attention: the BlockMask's mask_mod made dense
by create_mask, then F.scaled_dot_product_attention, i.e. aten._scaled_dot_product_flash_attention_
for_cpu), ChunkedLossWrapper (components/loss.py: lm_head and the loss per sequence chunk, backward
per chunk, then the decoder's backward from the accumulated hidden grad).

Where the peak is (the probe's event lists, probes/peak.py, of the matrix jobs): at one of the
blocks' post-backward reduce-scatters (_fsdp_param_group.py post_backward -> _fsdp_collectives.py
foreach_reduce), while gloo reduces it; the first one (the last block's) unless HSDP's held
all-reduce inputs outgrow the activations the later ones have freed (peak() takes the most of
every block's). While block k's is reduced a rank holds
- its resident state (params, grads, optimizer state, rope caches: the state ledger's bytes), plus
  the unsharded parameters FSDP still holds: with reshard_after_forward "never" every block before
  k and tok_embeddings stay unsharded from the forward (k and the later ones were resharded by
  their post_backward, reshard_after_backward True);
- the activations saved for backward by the blocks before k (k's own and the later ones' were
  freed by their backward), per activation-checkpointing mode (saved_per_layer);
- gathered buffers: the prefetched all-gather output of the unit before (FSDP2 backward prefetch,
  _fsdp_param_group.py _backward_prefetch, reshard_after_forward True only: with "never" there is
  nothing to gather), the reduce-scatter input (foreach_reduce's reduce_scatter_input: every padded
  unsharded grad in fp32, chunk_cat) and its output (one shard); the previous reduce-scatter's input
  is held until the next foreach_reduce starts (its reduce_scatter_state) and freed before it; with
  HSDP every group's last reduce-scatter output, the all-reduce input it holds (the norm's, the
  later blocks');
- temporaries: gloo's copy of the whole reduce-scatter input (ProcessGroupGloo's reduce-scatter of a
  flat tensor reduces a copy of the input and copies this rank's chunk out: the probe sees a
  storage of the input's size appear at aten.split and go at aten.copy_), the residual-stream grad
  flowing to the block before (bf16 [B, S, hidden]), and the batch's small tensors.

The first step (FirstStep): the same moments without what it has not made yet, AdamW's state and the
sharded grads of the units backward has not reduced, or the state its optimizer step completes;
measured on the matrix's jobs (tests/test_titan.py), PP's too.

PP layouts: pp_peak.py (its docstring: what pipelining does to FSDP2; a function per moment).
Every layout has a peak. (SP with CP, once 8% off, was the probe counting AsyncCollectiveTensor
wrappers: probes/peak.py _unwrap; the SP and CP rules together are within 0.03% since.)
GPU runs differ (notes in place()): NCCL reduce-scatters in place (no gloo copy), flash/cuDNN SDPA
saves no dense mask and FlexAttention's own kernel runs there (SelectiveAC saves its output).
"""
from __future__ import annotations

from typing import NamedTuple

from ledger.dtypes import BF16, FP32 as F32, INT64 as I64
from ledger.faithful.titan import moe_activations
from ledger.faithful.titan.dtensor import w2_grad_placements
from ledger.faithful.titan.target import RULES, Rules
from ledger.target import CPU_GLOO
from ledger.placement import Peak
from ledger.units import round_up

LOSS_CHUNKS = 8  # components/loss.py ChunkedLossWrapper.Config.num_chunks (torchtitan's default)
FLEX_BLOCK = 128  # torch/nn/attention/flex_attention.py _DEFAULT_SPARSE_BLOCK_SIZE (create_block_mask's)


def saved_per_layer(model, B: int, S: int, ac: str, tp: int = 1, sp: bool = False, cp: int = 1,
                    rules: Rules = RULES[CPU_GLOO]) -> tuple[int, int, dict[str, int]]:
    """Bytes one TransformerBlock keeps for backward: (saved outside a checkpoint: the probe's
    "activations", kept by a checkpoint's own storage: its "temporary", named pieces).

    ac="none" (models/common/decoder.py TransformerBlock, B micro-batch, S local sequence, T = B*S):
    - each of the two RMSNorms (torch nn.RMSNorm -> aten rms_norm composite, computed in fp32 for a
      bf16 input): the fp32 upcast x (T*h*4), rsqrt (T*4), x*rsqrt (T*h*4, for the weight grad),
      and the bf16 output the next linears save as their input (T*h*2);
    - attention: v = wv(x) (T*kv*2) saved by SDPA; rope (models/common/rope.py) saves the indexed
      complex64 cache rows (one per token: T*head_dim/2*8) and returns q, k cast back to bf16 (T*q*2, T*kv*2)
      saved by SDPA; the redirect's dense mask, turned by CPU SDPA into a bf16 additive mask
      (aten.where: B*S*S*2); SDPA's output (T*q*2, also wo's input) and logsumexp (B*heads*S*4);
    - feed-forward (SwiGLU w2(silu(w1 x) * w3 x)): w1's output, silu's, w3's and their product
      (wo's input), T*ffn*2 each.
    ac="selective" (distributed/activation_checkpoint.py SelectiveAC: checkpoint_wrapper with a
    per-op policy): the block's input (T*h*2, saved by the checkpoint outside it), and inside it
    the outputs of the save ops; aten.mm is one but every second mm is recomputed, so of wq wk wv
    wo w1 w3 w2 (their call order) wq, wv, w1, w2 are kept (T*q*2, T*kv*2, T*ffn*2, T*h*2) - of the
    fused wqkv wo w1 w3 w2 (framework.fuse_qkv) wqkv, w1, w2 (T*(q+2kv)*2 for the first) -, and with
    sequence parallelism the reduce-scatter outputs of wo and w2 (T/tp*h*2 each: the save list's comm
    ops). CPU SDPA (_scaled_dot_product_flash_attention_for_cpu) is not in the save list: recomputed.
    ac="full" (FullAC: checkpoint_wrapper of the whole block): the block's input only.
    tp > 1 without sequence parallelism (models/common/decoder_sharding.py): the norms and their
    outputs are replicated (whole T*h), the colwise outputs (q, k, v, w1, w3) and what follows them
    up to the rowwise wo / w2 hold their heads / ffn columns over tp (DTensor local shards).
    rules (target.py): on cuda-nccl FlexAttention's kernel saves no dense mask, and SelectiveAC keeps
    its output and logsumexp.
    An MoE shape's block (torchtitan's qwen3) is moe_activations.block_saves's, at balanced routing.
    """
    h, f, hd = model.hidden, model.ffn_hidden // tp, model.head_dim
    q, kv = model.heads // tp * hd, model.kv_heads // tp * hd
    heads = model.heads // tp
    Sl = S // cp  # the rank's query positions (CP shards the sequence)
    T = B * Sl
    Tn = T // tp if sp else T  # the tokens a norm sees (SP: Shard(1))
    if ac == "full":
        return Tn * h * BF16, 0, {"block input": Tn * h * BF16}
    if model.num_experts:
        # torchtitan's MoE model is qwen3's (moe.py): its block without TP or CP (refused there); with
        # SelectiveAC its input and the outputs its policy keeps (moe_activations.sac_kept)
        if ac == "selective":
            kept = moe_activations.sac_kept(model, B, Sl, rules)
            return Tn * h * BF16, sum(kept.values()), {"block input": Tn * h * BF16, **kept}
        parts = moe_activations.block_saves(model, B, Sl, rules)
        return sum(parts.values()), 0, parts
    if ac == "selective":
        # the block's mms in call order; the policy's count restarts per block and recomputes the even ones:
        # wq wk wv wo w1 w3 w2 keep wq, wv, w1, w2; fused (ModelShape.fused_qkv) wqkv wo w1 w3 w2 keep wqkv
        # (q, k and v in one output), w1, w2
        qkv_kept = ({"wqkv out": T * (q + 2 * kv) * BF16} if model.fused_qkv
                    else {"wq out": T * q * BF16, "wv out": T * kv * BF16})
        kept = {**qkv_kept, "w1 out": T * f * BF16, "w2 out": T * h * BF16}
        if rules.sac_keeps_attention:
            kept["flex_attention out, logsumexp, max_scores"] = T * q * BF16 + rules.attention_stats * B * heads * Sl * F32
        if sp:
            # the save list's comm ops include _c10d_functional.reduce_scatter_tensor: with sequence
            # parallelism the rowwise wo and w2 reduce-scatter their outputs to Shard(1), and both
            # [T/tp, h] results are kept (measured: the article's FSDP4-TP2-SP run with selective AC,
            # cluster=fake s=8192, 1.07 GB under without them)
            kept["wo, w2 reduce-scatter outs (SP)"] = 2 * Tn * h * BF16
        return Tn * h * BF16, sum(kept.values()), {"block input": Tn * h * BF16, **kept}
    # sequence parallelism: the norms run on the rank's T/tp tokens (Shard(1)); their bf16 output is
    # all-gathered (Shard(1) -> Replicate) and the colwise linears save the gathered T*h input
    norm = (Tn * h * BF16 if rules.fused_rms_norm else 2 * Tn * h * F32) + Tn * F32 + T * h * BF16
    if cp == 1:
        # v = wv(x) and k after rope go to SDPA as they are
        kv_saved = {"v": T * kv * BF16, "k after rope": T * kv * BF16}
    else:
        # CP (titan_cpu.visible_cp_allgather = torch _cp_custom_ops.py flex_cp_allgather): SDPA gets
        # K and V all-gathered over cp (every position) and saves those; the local ones are freed
        kv_saved = {"k, v all-gathered over cp": 2 * B * S * kv * BF16}
    parts = {"2 rmsnorms": 2 * norm, "rope cache rows": T * (hd // 2) * 8, "q after rope": T * q * BF16,
             **kv_saved, "sdpa mask (bf16)": B * Sl * S * BF16 if rules.dense_mask else 0,
             "sdpa out + logsumexp": T * q * BF16 + rules.attention_stats * B * heads * Sl * F32,
             "swiglu": 4 * T * f * BF16}
    return sum(parts.values()), 0, parts




def batch_saved_bytes(B: int, S: int, ac: str, tp: int = 1) -> int:
    """Of the step's small tensors, those of the three moved to the device (trainer.py
    post_dataloading_process: input ids, labels, positions, T int64 each) that autograd packs for
    backward, which the probe counts as activations (its category: saved for backward), as the ledger
    does: the ids (the embedding's, but with TP, whose vocab-parallel embedding saves its local ids instead:
    vocab_parallel_saves) and the labels (the loss's), the positions too where activation checkpointing wraps
    the blocks (the checkpoint saves the block's inputs). Measured: 2 x T int64 without checkpointing, 3 x T
    with selective or full (the torchtitan matrix, seq 32-2048); one fewer with TP (tp2·SP at seq 512)."""
    return ((2 if ac == "none" else 3) - (tp > 1)) * B * S * I64


def vocab_parallel_saves(lay, B: int, S: int) -> int:
    """What tok_embeddings saves for its backward beyond the batch's ids (batch_saved_bytes) where it runs
    vocab-parallel: with a TP group torchtitan's Embedding.forward (models/common/embedding.py) embeds the clamped
    local ids (int64, which F.embedding saves) and multiplies the rows by the bf16 mask of those this rank holds
    (which the mul saves): T x (8 + 2) B, T the rank's tokens, until tok_embeddings' backward, the step's last
    (measured: pp2·tp2·SP at seq 1024, stage 0, each micro-batch in flight a clamp's 8,192 B and a _to_copy's
    2,048 B)."""
    return B * S // lay.cp * (I64 + BF16) if lay.tp > 1 else 0


_EMB_TP = "activations/the vocab-parallel embedding's local ids and row mask"


def _with_embedding_saves(detail: dict, lay, B: int, S: int) -> int:
    """vocab_parallel_saves, named in `detail` where there are any."""
    emb = vocab_parallel_saves(lay, B, S)
    if emb:
        detail[_EMB_TP] = emb
    return emb


def loader_sample_bytes(S: int) -> int:
    """The data loader's last sample (input, labels, positions: 3 x S int64) and the loader's int64."""
    return 3 * S * I64 + I64


def document_mask_bytes(b: int, M: int, S: int) -> int:
    """M batches' document masks of b sequences each (models/common/attention.py
    get_efficient_causal_mask_mod_for_packed_document: document_id int32 [b, S]; with b == 1 the offsets
    table, int32 round_up(S + 1, 128)) and their BlockMasks' eight int32 block tables
    (torch/nn/attention/flex_attention.py BlockMask: kv_num_blocks, full_kv_num_blocks, q_num_blocks,
    full_q_num_blocks [b, 1, nb] and the four indices [b, 1, nb, nb], nb = S / 128 blocks, its
    _DEFAULT_SPARSE_BLOCK_SIZE)."""
    nb = -(-S // FLEX_BLOCK)
    return M * (b * S * 4 + (round_up(S + 1, 128) * 4 if b == 1 else 0) + 4 * b * (nb + nb * nb) * 4)


def batch_bytes(model, B: int, S: int, loader_on_device: bool = True) -> int:
    """The step's small tensors live at the peak, as the probe's event list shows them (T = B*S):
    the data loader's last sample and int64 (loader_sample_bytes) and the collated batch (2 x T int64),
    the three moved to the device (3 x T int64; those saved for backward are activations:
    batch_saved_bytes), the batch's document mask and BlockMask tables (document_mask_bytes), a norm
    weight's bf16 grad ([hidden]) and two fp32 scalars. The loader's sample, collated batch and int64
    where they share the device's memory only (loader_on_device: the CPU harness; on CUDA they stay on the
    host: target.py)."""
    loader = loader_sample_bytes(S) + 2 * B * S * I64
    return ((loader if loader_on_device else 0) + 3 * B * S * I64 + document_mask_bytes(B, 1, S)
            + model.hidden * BF16 + 2 * F32)


# pp_batch_lines' masks: inside the step's forward and backward only
PP_MASKS = "temporary/the micro-batches' document masks and BlockMask tables"


def pp_batch_lines(model, lay, has_embedding: bool, has_head: bool, loader_on_device: bool = True) -> dict[str, int]:
    """With PP, the step's small tensors on a stage's rank, live through its whole step (every rank loads the
    batch: trainer.py), as the probe's census by op shows them (T = B S, B = micro_batch_size x micro-batches,
    M micro-batches): the data loader's last sample and int64 (loader_sample_bytes), B + 1 [S] int64 storages
    stack makes (collate; what keeps them is not traced: a measured rule), the batch's device copies (input,
    labels, positions: 3 x T int64; the embedding saves the ids on the first stage where no TP runs it
    vocab-parallel, the loss the labels and the global valid-token count, an int64, on the last: activations),
    each micro-batch's document mask and BlockMask tables (document_mask_bytes) and the previous step's scalars;
    the loader's tensors where they share the device's memory (loader_on_device: the CPU harness; target.py).
    Measured on the CPU (pp2, hidden 128: 1F1B at seq 256 and 512 with 2 and 4 micro-batches, to the byte;
    InterleavedZeroBubble pp2·vp2 at seq 1024 with 4, to the byte; pp2·tp2·SP at seq 1024 with 3, 8 and 24 B
    under). The masks live inside the step's forward and backward only (trainer.py forward_backward_step makes
    them): the first step's peak at its optimizer step holds the rest (PP_MASKS; measured, pp2 and pp4 at seq 32).
    With CP the embedding and the loss save the batch's sequence shards (context_parallel's), not its copies, and
    the shards and more stand beside these lines, not modelled (7,112 to 7,608 B at pp2·cp2, seq 256, 2
    micro-batches)."""
    b, M, S = lay.micro_batch_size, lay.num_microbatches, model.seq_len
    B = b * M
    ids = B * S * I64 if has_embedding and lay.tp == 1 and lay.cp == 1 else 0
    labels = (B * S * I64 if lay.cp == 1 else 0) + I64 if has_head else 0
    return {"activations/the micro-batches' ids the embedding saves": ids,
            "activations/the labels and the global valid-token count the loss saves": labels,
            "temporary/the batch's other device copies (input, labels, positions)": 3 * B * S * I64 + I64 - ids - labels,
            "temporary/the data loader's last sample and collated rows":
                loader_sample_bytes(S) + (B + 1) * S * I64 if loader_on_device else 0,
            PP_MASKS: document_mask_bytes(b, M, S),
            "unnamed/scalars live from the previous step": UNNAMED}


def peak(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, head_numel: int,
         rules: Rules = RULES[CPU_GLOO], first: "FirstStep | None" = None) -> Peak:
    """The steady-step peak of a rank without PP: FSDP2 over dp_shard x cp (HSDP: replicated over
    dp_replicate), TP with or without SP, CP. sh: the rank's fsdp.Sharded;
    resident: its resident state bytes (params + grads + optim + other); block_numel, emb_numel,
    head_numel: the unpadded TP-local numel of one TransformerBlock, tok_embeddings and [norm,
    lm_head] (FSDP2's unsharded parameters). The most live bytes over lm_head's reduce-scatter at
    the loss's last chunk (at_lm_head), a loss chunk's cross-entropy backward (at_loss_chunk), the
    final norm's backward (at_final_norm), the blocks' post-backward reduce-scatters (_at_block) and,
    with activation checkpointing, each block's SwiGLU backward in its recompute (_at_recompute): the
    most of them, the earliest on ties. At long sequences and large vocabularies the second and third
    win (the article's FSDP4·TP2·SP run at s=8192: the loss chunk), with a small vocabulary and
    checkpointing the recompute (dp2 at seq 2048). rules: the target's (target.py)."""
    best = at_lm_head(model, lay, fw, sh, resident, block_numel, emb_numel, head_numel, rules)
    # (moment, the grads its step 0 already holds: FirstStep.grads_done's unit count)
    seen = [(best, 0)]
    for pk, done in ((at_loss_chunk(best, model, lay, head_numel), 0),
                     (at_final_norm(model, lay, fw, sh, resident, block_numel, emb_numel, head_numel, rules), 1)):
        seen.append((pk, done))
        if pk.bytes > best.bytes:
            best = pk
    late = 0
    ac = getattr(fw, "activation_checkpoint", "none") != "none"
    for k in range(model.layers - 1, -1, -1):  # backward order: the last block's reduce-scatter first
        # (with activation checkpointing, the block's recompute comes first in its backward)
        if ac:
            # with TP and SP the block's recompute forward ends at w2's reduce-scatter (its moment
            # first), then the recompute's SwiGLU backward
            at_recompute = _at_recompute_moe if model.num_experts else _at_recompute
            for rc in ((_at_recompute_rs(model, lay, fw, sh, resident, block_numel, emb_numel, k, rules),)
                       if lay.tp > 1 and lay.sequence_parallel else ()) + \
                    (at_recompute(model, lay, fw, sh, resident, block_numel, emb_numel, k, rules),):
                seen.append((rc, model.layers + 1 - k))
                if rc.bytes > best.bytes:
                    best = rc
        if not ac and lay.tp > 1 and not lay.sequence_parallel and not model.num_experts:
            # TP without SP: the block's own moments in its backward (SwiGLU's, then ffn_norm's)
            for at in (_at_swiglu, _at_ffn_norm):
                pk = at(model, lay, fw, sh, resident, block_numel, emb_numel, k, rules)
                seen.append((pk, model.layers + 1 - k))
                if pk.bytes > best.bytes:
                    best = pk
        pk = _at_block(model, lay, fw, sh, resident, block_numel, emb_numel, k, rules)
        seen.append((pk, model.layers + 1 - k))
        if pk.bytes > best.bytes:
            best = pk
        if k and lay.dp_shard * lay.cp > 1 and fw.reshard_after_forward in ("default", "always") \
                and rules.rs_input_copy:
            # RACE (a finding, not a tolerance): gloo's worker thread drops its copy of the input after
            # marking the reduce-scatter complete, so the copy may still be alive when the main thread
            # copies block k-1's prefetched all-gather out into its unsharded parameters (its
            # pre-backward): then the reduce-scatter output has been added to the grad and the block's
            # unsharded bf16 parameters are live instead. Measured on one rank of a loaded dp4 run.
            late = max(late, pk.bytes - sh.layer_full * F32 // ds_of(lay) + block_numel * BF16 - model.hidden * BF16)
    if late > best.bytes:
        best.detail[RACE] = late
    if first is not None:
        step0 = first.peak(seen, model.layers, sh, resident)
        if step0.bytes != best.bytes:
            best.first = step0
    return best


class FirstStep(NamedTuple):
    """What the first step's backward does not hold yet: torch's AdamW makes its state in the first
    optimizer step (torch/optim/adamw.py _init_group: exp_avg, exp_avg_sq, step, param by param), and
    FSDP2 assigns a sharded grad when its unit's reduce-scatter lands (_fsdp_param_group.py
    post_backward -> foreach_reduce_scatter_copy_out: `sharded_param.grad = new_sharded_grad` while
    .grad is None; torchtitan's zero_grad keeps them from then on: trainer.py
    zero_grad(set_to_none=training.disable_cuda_graphs), False unless set)."""
    optim: int  # the rank's optimizer-state bytes
    grads: int  # its sharded grads' bytes

    def grads_done(self, units: int, layers: int, sh) -> int:
        """The grads of the first `units` units backward has reduced, in backward order: lm_head
        (its reduce-scatter at the loss's last chunk), the final norm, then the blocks last first;
        each unit's share of the rank's grads is its padded full numel's."""
        fulls = [sh.lm_full, sh.norm_full] + [sh.layer_full] * layers
        total = sum(fulls) + sh.emb_full
        return self.grads * sum(fulls[:units]) // total

    def peak(self, seen: list, layers: int, sh, resident: int) -> Peak:
        """Step 0's peak over the backward moments seen ((moment, units reduced before it)); resident:
        the rank's state bytes."""
        return first_step_peak([(pk, self.optim + self.grads - self.grads_done(done, layers, sh)) for pk, done in seen],
                               resident, "resident/state")


def first_step_peak(seen: list, state: int, state_key: str, beside: tuple[str, int] | None = None) -> Peak:
    """Step 0's peak: each moment less what it holds in a steady step that step 0 has not made yet
    (seen: (moment, those bytes); FirstStep), or, where all of them are below it, the state the first
    optimizer step completes (its temporaries not modelled: a lower bound). state: the rank's state
    bytes once that step is done; state_key: the moments' detail line the absent bytes come off;
    beside: (detail line, bytes) of buffers that outlive the step's passes beside that state (a pipeline
    stage's P2P receive buffers: pp_peak)."""
    pk, absent = max(seen, key=lambda m: m[0].bytes - m[1])  # the first on ties
    key, extra = beside or ("", 0)
    if pk.bytes - absent < state + extra:
        detail = {state_key: state, **({key: extra} if extra else {})}
        return Peak.of({"resident": state, "activations": 0, "gathered": extra, "temporary": 0, "unnamed": 0},
                       "optimizer", "the state made by the first optimizer step (its temporaries not modelled)",
                       detail=detail)
    d = dict(pk.detail)
    d[state_key] -= absent
    return Peak.of({**pk.parts, "resident": pk.parts["resident"] - absent}, pk.phase, f"{pk.what}, first step",
                   detail=d)


def rs_temporary(rules: Rules, ds: int, rs_in: int) -> int:
    """The second buffer of a reduce-scatter input's size while FSDP2 reduces it: gloo's copy of the
    input (target.py), or, with a shard group of one on any backend, foreach_reduce's
    `reduce_scatter_input / gradient_divide_factor` (torch _fsdp_collectives.py: no collective then)."""
    return rs_in if rules.rs_input_copy or ds == 1 else 0


# scalars live from the previous step (the probe's "unnamed" at every world-2 peak)
UNNAMED = 12


def _scalars(detail: dict) -> dict:
    """The two small lines every no-PP moment holds, named: the global valid-token count the loss
    divides by (trainer.py: an int64 all-reduced, saved) and the previous step's scalars."""
    detail["activations/the global valid-token count (int64, trainer.py)"] = I64
    detail["unnamed/scalars live from the previous step"] = UNNAMED
    return detail


# Peak.detail key of the other outcome of a race the ledger names (the probe may measure either)
RACE = "race/gloo frees its reduce-scatter copy after the next block's unshard copy-out"


def ds_of(lay) -> int:
    return lay.dp_shard * lay.cp


def at_lm_head(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, head_numel: int,
                rules: Rules = RULES[CPU_GLOO]) -> Peak:
    """Live bytes while the backend reduce-scatters lm_head's grad at the loss's last chunk
    (components/loss.py ChunkedLossWrapper: set_requires_gradient_sync(True) before the last chunk,
    whose backward runs lm_head's post-backward; the decoder's backward has not started)."""
    B, L, tp = lay.micro_batch_size, model.layers, lay.tp
    sp = bool(lay.sequence_parallel) and tp > 1
    ds = lay.dp_shard * lay.cp
    T = B * model.seq_len // lay.cp
    Tn = T // tp if sp else T
    h, V = model.hidden, head_numel // model.hidden  # lm_head's TP-local rows (head_numel = V*h + h)
    ac = getattr(fw, "activation_checkpoint", "none")
    reshard = fw.reshard_after_forward in ("default", "always")
    act1, kept1, _ = saved_per_layer(model, B, model.seq_len, ac, tp, sp, lay.cp, rules)
    detail: dict[str, int] = {"resident/state": resident}
    # the wrapper's lm_head.unshard(): [norm, lm_head] unsharded (bf16); with "never" every block and
    # tok_embeddings too
    unsharded = head_numel * BF16 + (0 if reshard else (L * block_numel + emb_numel) * BF16)
    detail["resident/unsharded params"] = unsharded
    # every block's saved tensors, the root norm's (fp32 x, rsqrt, x*rsqrt) and its bf16 output (the
    # hidden states the wrapper backpropagates from), the valid-token count
    root = (Tn * h * BF16 if rules.fused_rms_norm else Tn * h * F32 * 2) + Tn * F32 + T * h * BF16
    copies = chunk_copies(lay, T, h)  # the wrapper's chunk lists (micro-batch > 1)
    batch = batch_saved_bytes(B, model.seq_len, ac, lay.tp)
    acts = L * act1 + root + I64 + copies[0] + batch + _with_embedding_saves(detail, lay, B, model.seq_len)
    detail[f"activations/{L} blocks saved ({ac})"] = L * act1
    detail["activations/the batch on the device (ids, labels, positions)"] = batch
    detail["activations/root norm and hidden states"] = root
    if copies[0]:
        detail["activations/the wrapper's hidden and label chunk copies"] = copies[0]
        detail["temporary/the wrapper's loss-input chunk copies"] = copies[1]
    # lm_head's grad reduce-scatter: fp32 input (padded full), output (shard), gloo's copy
    rs_in, rs_out = sh.lm_full * F32, sh.lm_full * F32 // ds
    gathered = rs_in + rs_out
    detail[_LM_RS] = gathered
    rs_copy = rs_temporary(rules, ds, rs_in)
    if rs_copy:
        detail[_LM_RS_COPY] = rs_copy
    # GradAccumulator's fp32 [B, S, h] buffer, lm_head's unsharded fp32 grad accumulated over the
    # chunks (gradient sync off until the last), the last chunk's bf16 logits and bf16 input grad
    chunk = T // LOSS_CHUNKS
    temp = (T * h * F32 + V * h * F32 + chunk * V * BF16 + chunk * h * BF16 + rs_copy + L * kept1
            + batch_bytes(model, B, model.seq_len, rules.loader_on_device) - batch - h * BF16 + copies[1])
    detail["temporary/grad accumulator, lm_head unsharded grad, last chunk"] = T * h * F32 + V * h * F32 + \
        chunk * V * BF16 + chunk * h * BF16
    if kept1:
        detail["temporary/selective AC kept mm outputs"] = L * kept1
    detail["temporary/batch, document mask, scalars"] = (batch_bytes(model, B, model.seq_len, rules.loader_on_device)
                                                         - batch - h * BF16)
    parts = {"resident": resident + unsharded, "activations": acts, "gathered": gathered, "temporary": temp,
             "unnamed": UNNAMED}
    return Peak.of(parts, phase="backward",
                what=f"lm_head reduce-scatter at ChunkedLossWrapper's last chunk ({rules.collectives})",
                detail=_scalars(detail))


def chunk_copies(lay, T: int, h: int) -> tuple[int, int]:
    """ChunkedLossWrapper splits the hidden states and the labels along the sequence (dim 1) and makes
    each chunk contiguous (components/loss.py _chunk_local: c.contiguous()): with a micro-batch of more
    than one sequence the chunks are copies, with one they are views. Held by the wrapper's chunk lists
    to its end: (the hidden states' bf16 [B, S, h] and the labels' int64 [B, S], which lm_head and the
    loss save; one more int64 [B, S] loss input's)."""
    return (T * h * BF16 + T * I64, T * I64) if lay.micro_batch_size > 1 else (0, 0)


# at_lm_head's detail keys of lm_head's reduce-scatter buffers, which at_loss_chunk takes out
_LM_RS = "gathered/lm_head's reduce-scatter input and output (fp32)"
_LM_RS_COPY = "temporary/gloo copy or divided input (fp32)"


def at_loss_chunk(lm_moment: Peak, model, lay, head_numel: int) -> Peak:
    """Live bytes at a loss chunk's cross-entropy backward, any chunk after the first (the first has
    no fp32 lm_head grad yet): what at_lm_head holds but the reduce-scatter's buffers and the last
    chunk's input grad, with the cross-entropy's fp32 [chunk, V] buffers instead. Plain cross-entropy
    (tp 1: aten log_softmax + nll_loss): the saved log-softmax, nll_loss_backward's output and
    _log_softmax_backward_data's, three; loss parallel (torchtitan's default with TP: DTensor's
    vocab-parallel log-softmax, decomposed: sub of the all-reduced max, exp, sum, log) at its
    backward's add: the saved log-probabilities, the zeros_like grad, exp and the add, four, each over
    the TP rank's vocab rows. Measured: the tp 1 run at seq 2048 and vocab 32768 and the article's
    FSDP4·TP2·SP at s=8192 (both peak here)."""
    h, tp = model.hidden, lay.tp
    T = lay.micro_batch_size * model.seq_len // lay.cp
    chunk = T // LOSS_CHUNKS
    V = head_numel // h  # lm_head's TP-local rows
    d = dict(lm_moment.detail)
    rs, rs_copy = d.pop(_LM_RS), d.pop(_LM_RS_COPY, 0)
    n_ce = 3 if tp == 1 else 4
    ce = n_ce * chunk * V * F32
    d["temporary/grad accumulator, lm_head unsharded grad, last chunk"] -= chunk * h * BF16
    d[f"temporary/cross-entropy backward, fp32 [chunk, V] x {n_ce}"] = ce
    parts = dict(lm_moment.parts)
    parts["gathered"] -= rs
    parts["temporary"] += ce - rs_copy - chunk * h * BF16
    return Peak.of(parts, phase="backward",
                what="a loss chunk's cross-entropy backward (ChunkedLossWrapper, after the first chunk)", detail=d)


def at_final_norm(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, head_numel: int,
                   rules: Rules = RULES[CPU_GLOO]) -> Peak:
    """Live bytes in the final norm's backward (the decoder's backward starting from the wrapper's
    accumulated hidden grad), at the RMSNorm composite's last mul: every block's saved tensors, the
    norm's saved fp32 input, the five fp32 [T, h] temporaries of its backward (as pp_peak.py's
    attention_norm moment), its bf16 weight grad; [norm, lm_head] unsharded again for it; the last block's
    all-gather prefetched (reshard after forward, a shard group of more than one); lm_head's
    reduce-scatter input of the last chunk held until the next foreach_reduce (HSDP: its all-reduce
    input too). Measured: the dp2 run at seq 2048 peaks here."""
    B, S, L, h, tp = lay.micro_batch_size, model.seq_len, model.layers, model.hidden, lay.tp
    sp = bool(lay.sequence_parallel) and tp > 1
    ds = lay.dp_shard * lay.cp
    T = B * S // lay.cp
    Tn = T // tp if sp else T
    ac = getattr(fw, "activation_checkpoint", "none")
    reshard = fw.reshard_after_forward in ("default", "always")
    act1, kept1, _ = saved_per_layer(model, B, S, ac, tp, sp, lay.cp, rules)
    unsharded = head_numel * BF16 + (0 if reshard else (L * block_numel + emb_numel) * BF16)
    batch = batch_saved_bytes(B, S, ac, lay.tp)
    norm_saved = Tn * h * BF16 + Tn * F32 if rules.fused_rms_norm else Tn * h * F32
    acts = L * act1 + norm_saved + I64 + batch
    work = 5 * Tn * h * F32 + h * BF16
    ag = sh.layer_full * BF16 if reshard and ds > 1 else 0
    held = sh.lm_full * F32 + (sh.lm_full * F32 // ds if lay.dp_replicate > 1 else 0)
    # (the wrapper has returned: its chunk copies and GradAccumulator are gone, the accumulated grad it
    # hands the decoder, bf16, is freed by the norm's backward before this moment)
    small = batch_bytes(model, B, S, rules.loader_on_device) - batch - h * BF16 + L * kept1
    detail = {"resident/state": resident, "resident/unsharded params": unsharded,
              f"activations/{L} blocks saved ({ac})": L * act1, ("activations/the final norm's bf16 input and rstd" if rules.fused_rms_norm
               else "activations/the final norm's fp32 input"): norm_saved,
              "activations/the batch on the device (ids, labels, positions)": batch,
              "temporary/RMSNorm backward fp32 [T, h] x 5, the norm's bf16 weight grad": work,
              "gathered/lm_head's reduce-scatter input held (HSDP: its all-reduce input)": held,
              "temporary/batch, selective AC's kept outputs": small}
    if ag:
        detail["gathered/the last block's all-gather (backward prefetch)"] = ag
    acts += _with_embedding_saves(detail, lay, B, S)
    parts = {"resident": resident + unsharded, "activations": acts, "gathered": ag + held, "temporary": work + small,
             "unnamed": UNNAMED}
    return Peak.of(parts, phase="backward", what="the final norm's backward",
                detail=_scalars(detail))


def _fsdp_backward_held(sh, lay, fw, layers: int, k: int) -> tuple[int, int]:
    """(the prefetched all-gather, HSDP's held all-reduce inputs) while block k is backpropagated, no PP:
    the backward prefetch's all-gather output of the unit before (the block before, bf16 padded full;
    before block 0, tok_embeddings), where it reshards after forward (a shard group of one gathers
    nothing: _fsdp_param_group.py unshard returns the sharded data as its all-gather result and
    wait_for_unshard copies it into the unsharded storages); with HSDP each group keeps its last
    all-reduce input (its reduce-scatter output, _fsdp_param_group.py post_backward:
    self._all_reduce_state) until its own next post_backward or finalize_backward: the norm's (the
    [norm, lm_head] group's last) and every block's after k."""
    ds = lay.dp_shard * lay.cp
    reshard = fw.reshard_after_forward in ("default", "always")
    ag = (sh.layer_full if k else sh.emb_full) * BF16 if reshard and ds > 1 else 0
    held = (sh.norm_full * F32 // ds + (layers - 1 - k) * (sh.layer_full * F32 // ds)) if lay.dp_replicate > 1 else 0
    return ag, held


def _in_backward_held(sh, lay, fw, layers: int, k: int, block_numel: int, emb_numel: int) -> tuple[int, int, int, int]:
    """(unsharded, prefetched all-gather, HSDP's held all-reduce inputs, reduce-scatter input held) while block k
    is backpropagated, no PP: its unsharded parameters (with reshard_after_forward "never" the blocks before and
    the embedding too), _fsdp_backward_held's two, and the reduce-scatter input of the unit after (fp32, padded
    full: _fsdp_param_group.py keeps it until the next post_backward; after the last block, the final norm's)."""
    reshard = fw.reshard_after_forward in ("default", "always")
    unsharded = block_numel * BF16 + (0 if reshard else k * block_numel * BF16 + emb_numel * BF16)
    ag, held = _fsdp_backward_held(sh, lay, fw, layers, k)
    rs_held = (sh.layer_full if k < layers - 1 else sh.norm_full) * F32
    return unsharded, ag, held, rs_held


def _at_block(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int,
              rules: Rules = RULES[CPU_GLOO]) -> Peak:
    """Live bytes while the backend reduce-scatters block k's grads (its post-backward, after its reshard)."""
    B, S, L = lay.micro_batch_size, model.seq_len, model.layers
    T = B * S
    ds = lay.dp_shard * lay.cp
    ac = getattr(fw, "activation_checkpoint", "none")
    reshard = fw.reshard_after_forward in ("default", "always")  # distributed/fsdp.py: default = True without PP
    sp = bool(lay.sequence_parallel) and lay.tp > 1
    act1, kept1, _ = saved_per_layer(model, B, S, ac, lay.tp, sp, lay.cp, rules)
    T = B * S // lay.cp  # the rank's tokens
    resid = (T // lay.tp if sp else T) * model.hidden * BF16  # the residual-stream grad (SP: its tokens)
    before = k  # blocks whose saved tensors are still held (k's own were freed by its backward)
    detail: dict[str, int] = {}
    # resident: the state, and the unsharded params (storages FSDP2 resizes, _fsdp_param.py
    # alloc_storage; the state probe names them: they count as resident) held with "never"
    unsharded = 0 if reshard else before * block_numel * BF16 + emb_numel * BF16
    detail["resident/state"] = resident
    if unsharded:
        detail["resident/unsharded params (reshard_after_forward never)"] = unsharded
    # activations: the blocks before, and the global valid-token count the loss divides by
    # (trainer.py: loss / global_valid_tokens, an int64 all-reduced)
    batch = batch_saved_bytes(B, S, ac, lay.tp)
    detail[f"activations/{before} blocks saved ({ac})"] = before * act1
    detail["activations/the batch on the device (ids, labels, positions)"] = batch
    acts = before * act1 + I64 + batch + _with_embedding_saves(detail, lay, B, S)
    # gathered: the prefetched all-gather output of the unit before and HSDP's held all-reduce inputs
    # (_fsdp_backward_held), the reduce-scatter input (fp32, padded full) and output (its shard)
    ag, held = _fsdp_backward_held(sh, lay, fw, L, k)
    rs_in, rs_out = sh.layer_full * F32, sh.layer_full * F32 // ds
    gathered = ag + rs_in + rs_out + held
    if held:
        detail["gathered/HSDP: all-reduce inputs held (norm, later blocks)"] = held
    if ag:
        detail["gathered/backward prefetch all-gather (the unit before)"] = ag
    detail["gathered/reduce-scatter input (fp32)"] = rs_in
    detail["gathered/reduce-scatter output (fp32 shard)"] = rs_out
    # temporaries: gloo's copy of the reduce-scatter input (a shard group of one: foreach_reduce's
    # reduce_scatter_input / gradient_divide_factor, the same size), the residual grad (bf16), a selective
    # checkpoint's kept outputs, the batch and mask bookkeeping (batch_bytes)
    small = batch_bytes(model, B, S, rules.loader_on_device) - batch
    rs_copy = rs_temporary(rules, ds, rs_in)
    temp = rs_copy + resid + before * kept1 + small
    if rs_copy:
        detail["temporary/gloo reduce-scatter copy of the input" if rules.rs_input_copy
               else "temporary/foreach_reduce's divided input (a shard group of one)"] = rs_copy
    detail["temporary/residual-stream grad (bf16)"] = resid
    if kept1:
        detail["temporary/selective AC kept mm outputs"] = before * kept1
    detail["temporary/batch, document mask, scalars"] = small
    parts = {"resident": resident + unsharded, "activations": acts, "gathered": gathered, "temporary": temp,
             "unnamed": UNNAMED}
    return Peak.of(parts, phase="backward",
                what=f"layers.{k} post-backward reduce-scatter ({rules.collectives})", detail=_scalars(detail))


class SwigluBackward(NamedTuple):
    """A block's SwiGLU backward at its largest moment (swiglu_backward)."""
    at: str  # the moment
    lines: dict  # "part/line" -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.lines.values())

    def __hash__(self) -> int:  # (its lines a dict: a stage carrying one is a key of pp_looped's template cache)
        return hash((self.at, tuple(self.lines.items())))


def swiglu_backward(model, T: int, tp: int, sp: bool = False) -> SwigluBackward:
    """A block's SwiGLU backward (silu(w1 x) * w3 x, the product into w2) at its largest moment, the second
    factor's grad, beside w2's weight grad and the block's output grad; T the rank's tokens. Each factor's
    grad is a mul of w2's input grad by the other factor. Where DTensor leaves w2's input grad Partial (TP
    without SP at the shapes dtensor.w2_grad_placements names: a full [T, ffn] on every TP rank), the
    propagator reduce-scatters it to the factor's Shard for each mul (aten.mul.Tensor P -> S(2),
    dtensor.layer_backward_comm), so at the second mul's reduce-scatter the Partial grad, the first mul's
    result (the rank's [T, ffn / tp]) and the reduce-scatter's cat'ed input and its output are live (measured:
    tp4 at hidden 640, ffn 1792, T 640 (w4tp4gqa), tp2 at hidden 256, ffn 768, T 512 under full AC, with and
    without PP, and pp2·tp4 by hand: the peak there). Else w2's input grad and both factors' grads, the rank's
    [T, ffn / tp] each."""
    f = model.ffn_hidden
    fl = f // tp
    if tp > 1 and w2_grad_placements(model, T, tp, sp)[1] == "P":
        return SwigluBackward("SwiGLU's second reduce-scatter of w2's Partial input grad", {
            "temporary/w2's input grad (Partial, full [T, ffn])": T * f * BF16,
            "temporary/the first mul's result (the rank's [T, ffn / tp])": T * fl * BF16,
            "gathered/the second reduce-scatter's input (cat) and output": T * f * BF16 + T * fl * BF16})
    return SwigluBackward("SwiGLU", {"temporary/the grads of silu's and w3's outputs and their product": 3 * T * fl * BF16})


def _in_block_backward(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int, rules: Rules,
                       saved_label: str, saved: int, work: dict[str, int], what: str) -> Peak:
    """A moment inside block k's backward (no PP, no activation checkpointing): `saved` of the blocks' saves
    (blocks 0..k-1's and what block k still holds), `work` the backward's own buffers ("part/line" -> bytes),
    beside the block's unsharded parameters, the residual stream's grad, the batch, and FSDP's buffers: the
    reduce-scatter input of the unit after held (until the next post-backward), the prefetched all-gather of
    the unit before, HSDP's held all-reduce inputs."""
    B, S, h = lay.micro_batch_size, model.seq_len, model.hidden
    T = B * S // lay.cp  # the rank's tokens
    batch = batch_saved_bytes(B, S, "none", lay.tp)
    unsharded, ag, held, rs_held = _in_backward_held(sh, lay, fw, model.layers, k, block_numel, emb_numel)
    # a shard group of one runs no collective: its held input is not a collective's buffer
    held_part = "gathered" if ds_of(lay) > 1 else "temporary"
    lines = {**work,
             "temporary/residual-stream grad (bf16)": T * h * BF16,
             f"{held_part}/reduce-scatter input held (the unit after)": rs_held,
             "gathered/backward prefetch all-gather (the unit before)": ag,
             "gathered/HSDP: all-reduce inputs held (norm, later blocks)": held,
             "temporary/batch, document mask, scalars": batch_bytes(model, B, S, rules.loader_on_device) - batch}
    detail = {"resident/state": resident, "resident/unsharded params (this block; the earlier ones with never)": unsharded,
              f"activations/{saved_label}": saved,
              "activations/the batch on the device (ids, labels, positions)": batch}
    acts = saved + I64 + batch + _with_embedding_saves(detail, lay, B, S)
    detail.update({key: v for key, v in lines.items() if v})
    parts = {"resident": resident + unsharded, "activations": acts, "gathered": 0, "temporary": 0, "unnamed": UNNAMED}
    for key, v in lines.items():
        parts[key.split("/", 1)[0]] += v
    return Peak.of(parts, phase="backward", what=f"layers.{k}: {what}", detail=_scalars(detail))


def _w2_grad_line(model, T: int, tp: int, sp: bool = False) -> tuple[str, int]:
    """w2's weight grad as its mm leaves it: Partial, a full [hidden, ffn] on every TP rank where DTensor's
    choice makes it so (dtensor.w2_grad_placements), until FSDP's post-backward reduces it; else its shard."""
    h, f = model.hidden, model.ffn_hidden
    if tp > 1 and w2_grad_placements(model, T, tp, sp)[0] == "P":
        return "temporary/w2's weight grad (Partial, full [hidden, ffn])", h * f * BF16
    return "temporary/w2's weight grad", h * (f // tp) * BF16


def _at_swiglu(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int,
               rules: Rules = RULES[CPU_GLOO]) -> Peak:
    """TP without SP, no activation checkpointing: block k's SwiGLU backward at its largest moment
    (swiglu_backward: where DTensor leaves w2's input grad Partial, the second of its two reduce-scatters):
    w2's weight grad (_w2_grad_line), SwiGLU's grads, blocks 0..k's saves but w2's input (freed by its mm
    backward). Measured on the CPU: tp4 at hidden 640, ffn 1792, T 640 (tests/test_titan.py w4tp4gqa, w2's
    input grad Partial): the steady peak on every rank."""
    T, tp = lay.micro_batch_size * model.seq_len // lay.cp, lay.tp
    act1, _, _ = saved_per_layer(model, lay.micro_batch_size, model.seq_len, "none", tp, False, lay.cp, rules)
    sw = swiglu_backward(model, T, tp)
    w2 = _w2_grad_line(model, T, tp)
    what = "SwiGLU backward" + (", its second reduce-scatter of w2's Partial input grad" if sw.at != "SwiGLU" else "")
    return _in_block_backward(model, lay, fw, sh, resident, block_numel, emb_numel, k, rules,
                              f"{k + 1} blocks saved (w2's input freed)",
                              (k + 1) * act1 - T * (model.ffn_hidden // tp) * BF16, {w2[0]: w2[1], **sw.lines}, what)


def _at_ffn_norm(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int,
                 rules: Rules = RULES[CPU_GLOO]) -> Peak:
    """TP without SP, no activation checkpointing: block k's ffn_norm backward (pp_peak's ffn_norm moment): the
    feed-forward's three weight grads (w2's as its mm leaves it, _w2_grad_line), the RMSNorm composite's five fp32
    [T, h] temporaries, the attention half's saves and the norm's fp32 input, the feed-forward's own saves freed.
    Where the tokens are few for the weights (CP) this is the block's largest: measured tp4·cp2 at hidden 1024,
    ffn 2816, T 512 a rank (w2's weight grad Partial, DTensor's Shard -> Shard moves in w2's mm backward before
    it), by hand: the steady peak on every rank."""
    B, S, tp, h = lay.micro_batch_size, model.seq_len, lay.tp, model.hidden
    T = B * S // lay.cp
    act1, _, saves = saved_per_layer(model, B, S, "none", tp, False, lay.cp, rules)
    attn = act1 - saves["swiglu"] - saves["2 rmsnorms"] // 2
    norm_in = T * h * BF16 + T * F32 if rules.fused_rms_norm else T * h * F32  # (pp_peak._Stage.norm_saved)
    w2 = _w2_grad_line(model, T, tp)
    work = {w2[0]: w2[1], "temporary/w1's and w3's weight grads": 2 * h * (model.ffn_hidden // tp) * BF16,
            "temporary/the norm composite's five fp32 [T, h]": 5 * T * h * F32}
    return _in_block_backward(model, lay, fw, sh, resident, block_numel, emb_numel, k, rules,
                              f"{k} blocks saved, this block's attention half and ffn_norm's input",
                              k * act1 + attn + norm_in, work, "ffn_norm backward")


class _RecomputeState(NamedTuple):
    """What a checkpointed block k's recompute moments share (_recompute_state)."""
    detail: dict
    T: int
    full1: int  # one block's saves without checkpointing (what its recompute rebuilds)
    kept1: int  # one block's selective-AC kept outputs
    unsharded: int
    acts: int
    gathered: int  # FSDP's: the prefetch all-gather, the reduce-scatter input held, HSDP's
    small: int


def _recompute_state(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int, sp: bool,
                     rules: Rules) -> _RecomputeState:
    """The parts every recompute moment of block k holds (no PP): block k's unsharded parameters (with
    "never" the earlier ones too), blocks 0..k-1's checkpoint saves and block k's input, the batch, and
    FSDP2's backward buffers (the unit before's prefetched all-gather, the reduce-scatter input of the
    unit after still held: _fsdp_param_group.py keeps it until the next post_backward, HSDP's)."""
    B, S = lay.micro_batch_size, model.seq_len
    ac = getattr(fw, "activation_checkpoint", "none")
    full1 = saved_per_layer(model, B, S, "none", lay.tp, sp, lay.cp, rules)[0]
    ck1, kept1, _ = saved_per_layer(model, B, S, ac, lay.tp, sp, lay.cp, rules)
    detail: dict[str, int] = {"resident/state": resident}
    unsharded, ag, held, rs_held = _in_backward_held(sh, lay, fw, model.layers, k, block_numel, emb_numel)
    detail["resident/unsharded params (this block; the earlier ones with never)"] = unsharded
    batch = batch_saved_bytes(B, S, ac, lay.tp)
    detail[f"activations/{k} blocks' checkpoint saves and this block's input ({ac})"] = (k + 1) * ck1
    detail["activations/the batch on the device (ids, labels, positions)"] = batch
    acts = (k + 1) * ck1 + I64 + batch + _with_embedding_saves(detail, lay, B, S)
    if ag:
        detail["gathered/backward prefetch all-gather (the unit before)"] = ag
    detail["gathered/reduce-scatter input held (the unit after)"] = rs_held
    if held:
        detail["gathered/HSDP: all-reduce inputs held (norm, later blocks)"] = held
    return _RecomputeState(detail, B * S // lay.cp, full1, kept1, unsharded, acts, ag + rs_held + held,
                           batch_bytes(model, B, S, rules.loader_on_device) - batch)


def _at_recompute(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int,
                  rules: Rules = RULES[CPU_GLOO]) -> Peak:
    """Live bytes at a checkpointed block k's SwiGLU backward in its recompute (activation checkpointing,
    no PP): pp_peak.py's SwiGLU moment with FSDP2's steady-step state. The block's recompute holds its
    saves as without checkpointing (saved_per_layer "none"; w2's input freed by w2's mm backward),
    beside w2's bf16 weight grad, the grads of silu's and w3's outputs and their product (bf16 [T, ffn]
    each) and the incoming residual grad; blocks 0..k-1 hold their checkpoint's saves, block k its input;
    its parameters are unsharded, the block before's all-gather prefetched, and the reduce-scatter input
    of the block after still held (_fsdp_param_group.py: the reduce-scatter state is kept until the next
    post_backward)."""
    sp = bool(lay.sequence_parallel) and lay.tp > 1
    st = _recompute_state(model, lay, fw, sh, resident, block_numel, emb_numel, k, sp, rules)
    detail, T, full1, kept1 = st.detail, st.T, st.full1, st.kept1
    f = model.ffn_hidden // lay.tp
    resid = (T // lay.tp if sp else T) * model.hidden * BF16
    unsharded, acts, gathered, small = st.unsharded, st.acts, st.gathered, st.small
    # w2's weight grad as its mm leaves it (TP-full where DTensor leaves it Partial)
    w2_grad = _w2_grad_line(model, T, lay.tp, sp)[1]
    work = full1 - T * f * BF16 + w2_grad + swiglu_backward(model, T, lay.tp, sp).bytes + resid
    temp = work + k * kept1 + small
    detail["temporary/the recompute's saves (w2's input freed), w2's weight grad, SwiGLU grads, residual grad"] = work
    if kept1:
        detail["temporary/selective AC kept outputs (earlier blocks)"] = k * kept1
    detail["temporary/batch, document mask, scalars"] = small
    parts = {"resident": resident + unsharded, "activations": acts, "gathered": gathered, "temporary": temp,
             "unnamed": UNNAMED}
    return Peak.of(parts, phase="backward",
                what=f"layers.{k}: SwiGLU backward in its recompute", detail=_scalars(detail))


def _at_recompute_moe(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int,
                      rules: Rules = RULES[CPU_GLOO]) -> Peak:
    """Live bytes at a checkpointed MoE block k's combine backward in its recompute (full activation
    checkpointing, no EP: the experts are the block's params): the recompute's saves (the qwen3 block's,
    moe_activations.py), the residual stream's gradient and the combine backward's fp32 buffers (the
    grad cast to fp32, the score multiplication's two products, their row sums: moe_peak.py's EP moment),
    beside what every recompute moment holds (_recompute_state)."""
    st = _recompute_state(model, lay, fw, sh, resident, block_numel, emb_numel, k, False, rules)
    T, h = st.T, model.hidden
    N = T * model.moe_router_topk
    work = st.full1 + T * h * BF16 + 3 * N * h * F32 + N * F32
    st.detail["temporary/the recompute's saves, the residual grad, the combine backward's fp32 buffers"] = work
    if st.kept1:
        st.detail["temporary/selective AC kept outputs (earlier blocks)"] = k * st.kept1
    st.detail["temporary/batch, document mask, scalars"] = st.small
    parts = {"resident": resident + st.unsharded, "activations": st.acts, "gathered": st.gathered,
             "temporary": work + k * st.kept1 + st.small, "unnamed": UNNAMED}
    return Peak.of(parts, phase="backward", what=f"layers.{k}: the MoE combine's backward in its recompute",
                   detail=_scalars(st.detail))


def _at_recompute_rs(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int,
                     rules: Rules = RULES[CPU_GLOO]) -> Peak:
    """Live bytes at w2's reduce-scatter in a checkpointed block k's recompute forward (full or selective
    AC, TP with SP, no PP): the block's output grad has already been all-gathered for w2's backward (the
    reduce-scatter's backward, the first node of the block's backward, before w2's mm backward unpacks
    the saved input that starts the recompute: torch/utils/checkpoint.py non-reentrant), and the
    recompute runs the block's forward again to its last collective: every save of the block
    (saved_per_layer "none"), the attention's residual sum h (live until the block's last add),
    ffn_norm's bf16 output (the feed-forward's argument while it runs), w2's Partial [T, h] output, the
    reduce-scatter's output and, on gloo, its copy of the input. Measured on the CPU (tp2 SP, seq 2048,
    full and selective AC; tests/test_titan.py w2tpspac): the steady peak at this moment, 24,288 B over
    the prediction (the step's small setup tensors)."""
    st = _recompute_state(model, lay, fw, sh, resident, block_numel, emb_numel, k, True, rules)
    detail, T, full1, kept1 = st.detail, st.T, st.full1, st.kept1
    h, Ts = model.hidden, st.T // lay.tp
    rs_in = T * h * BF16
    # the output grad all-gathered (rs_in's size), gloo's copy of the reduce-scatter's input, its output
    # and ffn_norm's output (the sequence shard each)
    sp_buffers = rs_in + (rs_in if rules.rs_input_copy else 0) + Ts * h * BF16 + Ts * h * BF16
    detail["gathered/the output grad all-gathered, w2's reduce-scatter copy and output, ffn_norm's output"] = sp_buffers
    if model.fused_qkv and getattr(fw, "activation_checkpoint", "none") == "selective":
        # with wqkv (FusedQKVLinear, a local_map over the SP all-gather of its input) under SelectiveAC the
        # recompute's attention_norm output shard is still live here, where wq / wk / wv's is freed and full
        # AC's too: measured at tp2 SP, seq 512, hidden 64 (the probe's census: a bf16 [T/tp, h] from
        # attention_norm's _to_copy, touched by the all-gather; full AC: not live), the mechanism not traced
        detail["gathered/attention_norm's output shard (fused wqkv's input, measured)"] = Ts * h * BF16
        sp_buffers += Ts * h * BF16
    unsharded, acts, gathered, small = st.unsharded, st.acts, st.gathered + sp_buffers, st.small
    work = full1 + Ts * h * BF16 + rs_in + Ts * h * BF16
    temp = work + k * kept1 + small
    detail["temporary/the recompute's saves, the residual sum h, w2's output, the incoming residual grad"] = work
    detail["temporary/batch, document mask, scalars"] = small
    parts = {"resident": resident + unsharded, "activations": acts, "gathered": gathered, "temporary": temp,
             "unnamed": UNNAMED}
    return Peak.of(parts, phase="backward",
                   what=f"layers.{k}: w2's reduce-scatter in its recompute forward", detail=_scalars(detail))


def notes(lay, fw, rules: Rules = RULES[CPU_GLOO]) -> list[str]:
    """The Placement's notes on what the peak model covers, and where a GPU run differs."""
    if rules.target != CPU_GLOO:
        return [f"titan peak{' (PP)' if lay.pp > 1 else ''}: predicted for {rules.target} from sources "
                "(ledger/faithful/titan/target.py), not confirmed by a GPU run"]
    gpu = ("on CUDA the reduce-scatter runs in place (no gloo copy of its input), SDPA's flash/cuDNN kernels save "
           "no dense mask, FlexAttention's own kernel runs (SelectiveAC saves its output) and the allocator rounds "
           "to 512-byte blocks")
    if lay.pp > 1:
        return ["titan peak (PP): predicted for CPU/gloo as pp_peak derives it: torch pipelining keeps every unit "
                "unsharded (bf16) with fp32 accumulated grads through the step and reduces each unit after the last "
                "backward (perform_reduce_grad); the peak is there, in a micro-batch's backward with 1F1B's "
                "micro-batches in flight (a checkpointed block recomputed first; with TP, where DTensor gathers wo's "
                "weight for its input grad, that moment, and where it leaves w2's input grad Partial, SwiGLU's second "
                "reduce-scatter of it), or at the last stage's loss; with TP the rowwise weights "
                "whose grads leave their mm Partial hold them TP-full until perform_reduce_grad; the step's batch, "
                "its device copies and document masks beside every moment (pp_batch_lines); " + gpu]
    out = ["titan peak: predicted for CPU/gloo (the configured variant); " + gpu]
    return out
