"""Peak live bytes of a torchtitan 0.3.0 rank within a steady training step (issue 18), CPU/gloo.

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

Not modelled here (RankState.peak is None, said in the Placement's notes): PP layouts (what was measured
is in notes()), SP with CP.
GPU runs differ (notes in place()): NCCL reduce-scatters in place (no gloo copy), flash/cuDNN SDPA
saves no dense mask and FlexAttention's own kernel runs there (SelectiveAC saves its output).
"""
from __future__ import annotations

from ledger.placement import Peak

F32, BF16, I64 = 4, 2, 8


def saved_per_layer(model, B: int, S: int, ac: str, tp: int = 1, sp: bool = False, cp: int = 1
                    ) -> tuple[int, int, dict[str, int]]:
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
    wo w1 w3 w2 (their call order) wq, wv, w1, w2 are kept (T*q*2, T*kv*2, T*ffn*2, T*h*2). CPU SDPA
    (_scaled_dot_product_flash_attention_for_cpu) is not in the save list: recomputed.
    ac="full" (FullAC: checkpoint_wrapper of the whole block): the block's input only.
    tp > 1 without sequence parallelism (models/common/decoder_sharding.py): the norms and their
    outputs are replicated (whole T*h), the colwise outputs (q, k, v, w1, w3) and what follows them
    up to the rowwise wo / w2 hold their heads / ffn columns over tp (DTensor local shards).
    """
    h, f, hd = model.hidden, model.ffn_hidden // tp, model.head_dim
    q, kv = model.heads // tp * hd, model.kv_heads // tp * hd
    heads = model.heads // tp
    Sl = S // cp  # the rank's query positions (CP shards the sequence)
    T = B * Sl
    Tn = T // tp if sp else T  # the tokens a norm sees (SP: Shard(1))
    if ac == "full":
        return Tn * h * BF16, 0, {"block input": Tn * h * BF16}
    if ac == "selective":
        kept = {"wq out": T * q * BF16, "wv out": T * kv * BF16, "w1 out": T * f * BF16, "w2 out": T * h * BF16}
        return Tn * h * BF16, sum(kept.values()), {"block input": Tn * h * BF16, **kept}
    # sequence parallelism: the norms run on the rank's T/tp tokens (Shard(1)); their bf16 output is
    # all-gathered (Shard(1) -> Replicate) and the colwise linears save the gathered T*h input
    norm = Tn * h * F32 + Tn * F32 + Tn * h * F32 + T * h * BF16
    if cp == 1:
        # v = wv(x) and k after rope go to SDPA as they are
        kv_saved = {"v": T * kv * BF16, "k after rope": T * kv * BF16}
    else:
        # CP (titan_cpu.visible_cp_allgather = torch _cp_custom_ops.py flex_cp_allgather): SDPA gets
        # K and V all-gathered over cp (every position) and saves those; the local ones are freed
        kv_saved = {"k, v all-gathered over cp": 2 * B * S * kv * BF16}
    parts = {"2 rmsnorms": 2 * norm, "rope cache rows": T * (hd // 2) * 8, "q after rope": T * q * BF16,
             **kv_saved, "sdpa mask (bf16)": B * Sl * S * BF16,
             "sdpa out + logsumexp": T * q * BF16 + B * heads * Sl * F32, "swiglu": 4 * T * f * BF16}
    return sum(parts.values()), 0, parts


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _batch_bytes(model, B: int, S: int) -> int:
    """The step's small tensors live at the peak, as the probe's event list shows them (T = B*S):
    the data loader's last sample (input, labels, positions: 3 x S int64) and the collated batch
    (2 x T int64), the three moved to the device (trainer.py post_dataloading_process: 3 x T int64,
    one saved by the embedding), the document mask of models/common/attention.py
    get_efficient_causal_mask_mod_for_packed_document (document_id int32 [B, S]; with B == 1 the
    offsets table, int32 round_up(S + 1, 128)), per-sequence fp32 scalars (8 x B), a norm weight's
    bf16 grad ([hidden]) and three more scalars (the loader's int64, two fp32)."""
    out = 3 * S * I64 + 2 * B * S * I64 + 3 * B * S * I64 + B * S * 4
    if B == 1:
        out += _round_up(S + 1, 128) * 4
    return out + 8 * B * F32 + model.hidden * BF16 + I64 + 2 * F32




def peak(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, head_numel: int) -> Peak:
    """The steady-step peak of a rank without PP: FSDP2 over dp_shard x cp (HSDP: replicated over
    dp_replicate), TP with or without SP, CP. sh: the rank's ledger.faithful.titan._Sharded;
    resident: its resident state bytes (params + grads + optim + other); block_numel, emb_numel,
    head_numel: the unpadded TP-local numel of one TransformerBlock, tok_embeddings and [norm,
    lm_head] (FSDP2's unsharded parameters). The most live bytes over lm_head's reduce-scatter at
    the loss's last chunk (_at_lm_head) and the blocks' post-backward reduce-scatters (_at_block),
    the earliest on ties."""
    best = _at_lm_head(model, lay, fw, sh, resident, block_numel, emb_numel, head_numel)
    late = 0
    for k in range(model.layers - 1, -1, -1):  # backward order: the last block's reduce-scatter first
        pk = _at_block(model, lay, fw, sh, resident, block_numel, emb_numel, k)
        if pk.bytes > best.bytes:
            best = pk
        if k and lay.dp_shard * lay.cp > 1 and fw.reshard_after_forward in ("default", "always"):
            # RACE (a finding, not a tolerance): gloo's worker thread drops its copy of the input after
            # marking the reduce-scatter complete, so the copy may still be alive when the main thread
            # copies block k-1's prefetched all-gather out into its unsharded parameters (its
            # pre-backward): then the reduce-scatter output has been added to the grad and the block's
            # unsharded bf16 parameters are live instead. Measured on one rank of a loaded dp4 run.
            late = max(late, pk.bytes - sh.layer_full * F32 // ds_of(lay) + block_numel * BF16 - model.hidden * BF16)
    if late > best.bytes:
        best.detail[RACE] = late
    return best


# Peak.detail key of the other outcome of a race the ledger names (the probe may measure either)
RACE = "race/gloo frees its reduce-scatter copy after the next block's unshard copy-out"


def ds_of(lay) -> int:
    return lay.dp_shard * lay.cp


def _at_lm_head(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, head_numel: int) -> Peak:
    """Live bytes while gloo reduce-scatters lm_head's grad at the loss's last chunk
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
    act1, kept1, _ = saved_per_layer(model, B, model.seq_len, ac, tp, sp, lay.cp)
    detail: dict[str, int] = {"resident/state": resident}
    # the wrapper's lm_head.unshard(): [norm, lm_head] unsharded (bf16); with "never" every block and
    # tok_embeddings too
    unsharded = head_numel * BF16 + (0 if reshard else (L * block_numel + emb_numel) * BF16)
    detail["resident/unsharded params"] = unsharded
    # every block's saved tensors, the root norm's (fp32 x, rsqrt, x*rsqrt) and its bf16 output (the
    # hidden states the wrapper backpropagates from), the valid-token count
    root = Tn * h * F32 * 2 + Tn * F32 + T * h * BF16
    acts = L * act1 + root + I64
    detail[f"activations/{L} blocks saved ({ac})"] = L * act1
    detail["activations/root norm and hidden states"] = root
    # lm_head's grad reduce-scatter: fp32 input (padded full), output (shard), gloo's copy
    rs_in, rs_out = sh.lm_full * F32, sh.lm_full * F32 // ds
    gathered = rs_in + rs_out
    # GradAccumulator's fp32 [B, S, h] buffer, lm_head's unsharded fp32 grad accumulated over the
    # chunks (gradient sync off until the last), the last chunk's bf16 logits and bf16 input grad
    chunk = T // 8  # ChunkedLossWrapper.Config.num_chunks = 8
    temp = (T * h * F32 + V * h * F32 + chunk * V * BF16 + chunk * h * BF16 + rs_in + L * kept1
            + _batch_bytes(model, B, model.seq_len) - h * BF16)
    detail["temporary/grad accumulator, lm_head unsharded grad, last chunk"] = T * h * F32 + V * h * F32 + \
        chunk * V * BF16 + chunk * h * BF16
    parts = {"resident": resident + unsharded, "activations": acts, "gathered": gathered, "temporary": temp,
             "unnamed": 12}
    return Peak(bytes=sum(parts.values()), parts=parts, phase="backward",
                what="lm_head reduce-scatter at ChunkedLossWrapper's last chunk (gloo)", detail=detail)


def _at_block(model, lay, fw, sh, resident: int, block_numel: int, emb_numel: int, k: int) -> Peak:
    """Live bytes while gloo reduce-scatters block k's grads (its post-backward, after its reshard)."""
    B, S, L = lay.micro_batch_size, model.seq_len, model.layers
    T = B * S
    ds = lay.dp_shard * lay.cp
    ac = getattr(fw, "activation_checkpoint", "none")
    reshard = fw.reshard_after_forward in ("default", "always")  # distributed/fsdp.py: default = True without PP
    sp = bool(lay.sequence_parallel) and lay.tp > 1
    act1, kept1, _ = saved_per_layer(model, B, S, ac, lay.tp, sp, lay.cp)
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
    acts = before * act1 + I64
    detail[f"activations/{before} blocks saved ({ac})"] = before * act1
    # gathered: the prefetched all-gather output of the unit before (the block before, bf16 padded
    # full; before block 0, tok_embeddings), the reduce-scatter input (fp32, padded full) and output
    # (its shard)
    # (a shard group of one gathers nothing: _fsdp_param_group.py unshard returns the sharded data
    # as its all-gather result and wait_for_unshard copies it into the unsharded storages)
    ag = (sh.layer_full if before else sh.emb_full) * BF16 if reshard and ds > 1 else 0
    rs_in, rs_out = sh.layer_full * F32, sh.layer_full * F32 // ds
    # HSDP: each group keeps its last all-reduce input (its reduce-scatter output,
    # _fsdp_param_group.py post_backward: self._all_reduce_state) until its own next post_backward
    # or finalize_backward: the norm's (the [norm, lm_head] group's last) and every block's after k
    held = (sh.norm_full * F32 // ds + (L - 1 - k) * rs_out) if lay.dp_replicate > 1 else 0
    gathered = ag + rs_in + rs_out + held
    if held:
        detail["gathered/HSDP: all-reduce inputs held (norm, later blocks)"] = held
    if ag:
        detail["gathered/backward prefetch all-gather (the unit before)"] = ag
    detail["gathered/reduce-scatter input (fp32)"] = rs_in
    detail["gathered/reduce-scatter output (fp32 shard)"] = rs_out
    # temporaries: gloo's copy of the reduce-scatter input (a shard group of one: foreach_reduce's
    # reduce_scatter_input / gradient_divide_factor, the same size), the residual grad (bf16), a selective
    # checkpoint's kept outputs, the batch and mask bookkeeping (_batch_bytes)
    small = _batch_bytes(model, B, S)
    temp = rs_in + resid + before * kept1 + small
    detail["temporary/gloo reduce-scatter copy of the input"] = rs_in
    detail["temporary/residual-stream grad (bf16)"] = resid
    if kept1:
        detail["temporary/selective AC kept mm outputs"] = before * kept1
    detail["temporary/batch, document mask, scalars"] = small
    unnamed = 12  # scalars live from the previous step (the probe's "unnamed" at every world-2 peak)
    parts = {"resident": resident + unsharded, "activations": acts, "gathered": gathered, "temporary": temp,
             "unnamed": unnamed}
    return Peak(bytes=sum(parts.values()), parts=parts, phase="backward",
                what=f"layers.{k} post-backward reduce-scatter (gloo)", detail=detail)


def modelled(lay) -> bool:
    """The layouts peak() models: all but PP, and SP with CP (tp2·cp2·sp measured 8% above this
    model: SP's gathered inputs under CP's sharded sequence are not derived yet)."""
    return lay.pp == 1 and not (lay.sequence_parallel and lay.tp > 1 and lay.cp > 1)


def notes(lay, fw) -> list[str]:
    """The Placement's notes on what the peak model covers, and where a GPU run differs."""
    if not modelled(lay):
        if lay.pp > 1:
            # measured on tests/test_titan.py's PP jobs (the peak probe's storages at the peak)
            return ["titan peak: not modelled with PP (no peak_bytes row). torch pipelining turns FSDP2's gradient "
                    "sync and reshard-after-backward off for every micro-batch (stage.py backward_maybe_with_nosync), "
                    "so a stage holds its unsharded bf16 params and its unsharded fp32 accumulated grads through the "
                    "step (whatever dp_shard) and reduces each unit after the last backward (perform_reduce_grad: the "
                    "unit's fp32 reduce-scatter input and its division or gloo copy beside the grads not yet reduced). "
                    "Measured peaks: there (pp2 at world 2, pp4's stages 0, 2, 3) or in the backward with "
                    "1F1B's micro-batches in flight (pp2·dp2's four ranks, pp4's stage 1); not derived yet"]
        return ["titan peak: not modelled with SP and CP together (no peak_bytes row): the tp2·cp2·sp job "
                "measured 8% above the SP and CP rules combined (more saved, gathered and temporary bytes); not "
                "derived yet"]
    return ["titan peak: predicted for CPU/gloo (the configured variant); on CUDA the reduce-scatter runs in "
            "place (no gloo copy of its input), SDPA's flash/cuDNN kernels save no dense mask, FlexAttention's "
            "own kernel runs (SelectiveAC saves its output) and the allocator rounds to 512-byte blocks"]
