"""The peak within a step of a Megatron Core 0.18.0 rank (issue 18): resident state + activations saved
for backward + pipeline buffers + the largest temporary at the peak moment, and the optimizer step's
own transients. ledger.faithful.megatron.states's RankState.peak is built here (stage_peak); each rule names
the megatron (or torch) source it follows, paths under megatron/core/ unless said otherwise.

What a rank holds at a moment is modelled as
  resident       params + grads + optim + other of the rank (megatron.rank_state: the peak probe's
                 named groups)
  activations    the tensors autograd saved (saved_tensors_hooks see every one): per decoder layer
                 `layer_groups`, per model chunk `head_groups` / `embedding_groups`, times the micro-
                 batches the schedule holds in flight (`_in_flight`)
  gathered       pipeline buffers a collective touched: received stage inputs, sent outputs, the
                 received output grad (p2p_communication.py)
  temporary      the largest transient at the moment: weight / input grads of the linear being
                 backpropagated, the fp32 attention-score grads, the logits' grads, the gloo
                 reduce-scatter copy of a grad bucket, the single-tensor Adam's denominators
and the peak is the largest moment over the step's phases (`stage_peak`). The moments are the ones
the local spec's backward goes through (`_layer_moments`: fc2, fc1, the attention-score grads, proj,
qkv, each norm), the cross-entropy forward and, with the local spec, each forward's last-layer softmax
cast (`softmax_forward`: the s^2 tensors of a forward, where long sequences peak); other forward
transients are not modelled (the backward of the same layer holds more). Checked against the peak
probe on the CPU matrix (tests/test_megatron.py).

The variant that runs: transformer_impl=local (CPU runs, mode=run) keeps the attention probabilities
(fp32 softmax + bf16 copy, [b, heads/tp, s, s]); transformer_impl=transformer_engine (Megatron-LM's
default, what mode=predict describes) runs TEDotProductAttention's fused kernel, which saves no s^2
tensor (its softmax statistics [b, heads/tp, s] fp32 and the output instead): `layer_groups` follows
the spec. Recompute (framework.recompute_*): selective core_attn (attention.py
_checkpointed_attention_forward) and full uniform / block (recompute.py checkpointed_forward), both
through tensor_parallel/random.py CheckpointFunction (ctx.save_for_backward of its tensor inputs).
The forward softmax moment is modelled for the 1F1B and no-pipelining schedules (vp = 1), without
recompute or with full block recompute whose last layer is not checkpointed; the interleaved schedule's
and selective recompute's forward are not (their backward moments stand). At full shape (the article's
TP2·PP2·DP2·SP run on cluster=fake, s=8192) both stages peak there (stage 0 in its third micro-batch's
forward, the last stage in any after its first), 63 MB (0.05%) above the backward moment that was the
prediction before. Under full recompute the same cast in a checkpointed layer's recompute (in its
backward, chunk_units) is the peak of the article's run with uniform recompute of one layer: measured
exact but the launcher's batches on both stages (it was 12.7 MB / 29.5 MB above the attention-score
backward moment predicted before).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ledger.faithful.megatron.buffers import (_stage_shape, buffer_layout, effective_bucket_size, shard_ranges,
                                              stage_params)
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape
from ledger.placement import Peak


_PEAK_COMMON = ("peak (megatron_peak.py): resident + saved activations of the micro-batches in flight + p2p "
                "buffers + the largest temporary of the moment, over every backward moment, the cross-entropy "
                "forward, the local spec's forward softmax (1F1B / no pipelining; not selective recompute) and a "
                "fully recomputed layer's softmax cast in its backward, the grad sync and "
                "Adam's step; no allocator rounding (CUDA: 512-byte blocks); other forward transients, the launcher's "
                "batch and a few 4-byte step leftovers are not modelled")
PEAK_NOTES = {
    "local": (_PEAK_COMMON, "peak, transformer_impl=local (the CPU gloo runs): gloo's copy of each grad bucket in "
              "its reduce-scatter and torch's single-tensor AdamW denominators (param by param) are modelled; "
              "a GPU run with NCCL and FusedAdam holds neither"),
    "transformer_engine": (_PEAK_COMMON, "peak, transformer_impl=transformer_engine: TEDotProductAttention (fused / flash) "
                           "saves no [b, heads/tp, s, s] probabilities (softmax statistics [b, heads/tp, s] fp32 instead) "
                           "and has no score-grad moment; NCCL reduce-scatters in place and FusedAdam adds no per-param "
                           "temporaries (no gloo copy, no Adam denominators); TE's fused norm+linear saves, gradient-accumulation fusion "
                           "(weight grads straight into main_grad) and workspaces are not modelled: the local spec's "
                           "moments stand for them (no CPU run confirms TE)"),
}
MODELLED_MODULES = ("core_attn",)
RECOMPUTED_CAST = "softmax cast (recompute)"
# the moments (by their name's end) of a chunk's first backward unit whose incoming grad is the received
# output grad itself (gathered), not a new tensor: the last layer's fc2 and fc1, and under full recompute
# its recomputed forward before them
INCOMING_IS_RECEIVED = ("fc2", "fc1", RECOMPUTED_CAST)


class Recompute(NamedTuple):
    """framework.recompute_* as TransformerConfig reads them (transformer_config.py: recompute_modules
    None becomes ["core_attn"])."""
    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple = ("core_attn",)

    @property
    def core_attn(self) -> bool:
        return self.granularity == "selective" and "core_attn" in self.modules


def recompute_of(fw) -> Recompute:
    def g(n):  # textbook mode, older records, plain dicts: no recompute fields
        try:
            return getattr(fw, n)
        except (AttributeError, KeyError):
            return None

    mods = g("recompute_modules")
    return Recompute(g("recompute_granularity"), g("recompute_method"), g("recompute_num_layers"),
                     tuple(mods) if mods is not None else ("core_attn",))


def check_recompute(rc: Recompute) -> None:
    """What the faithful ledger does not model is refused, naming the field (conf/validate.py checks
    Megatron's own rules first)."""
    if rc.granularity == "selective":
        other = [m for m in rc.modules if m not in MODELLED_MODULES]
        if other:
            raise ConfigError(f"megatron: framework.recompute_modules={list(rc.modules)}: the faithful ledger models "
                              "core_attn only (layernorm and mlp, transformer_layer.py's recompute_input_layernorm / "
                              "recompute_mlp, are not modelled yet); use ledger.mode=textbook")


class Shape(NamedTuple):
    """One micro-batch of one rank, in elements: s, b, hidden, heads/tp x head_dim (q), kv heads/tp x
    head_dim, ffn/tp, heads/tp, the padded vocab / tp, tp, sequence parallel, activation bytes,
    the spec."""
    s: int
    b: int
    h: int
    hq: int
    hkv: int
    f: int
    a: int
    v: int
    hd: int
    tp: int
    sp: bool
    e: int
    te: bool

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h

    @property
    def sbh_n(self) -> int:
        """[s, b, h] elements of a norm's input: the sequence shard with SP."""
        return self.sbh // (self.tp if self.sp else 1)


def shape_of(model: ModelShape, lay: Layout, k) -> Shape:
    tp = lay.tp
    return Shape(model.seq_len, lay.micro_batch_size, model.hidden, model.heads // tp * model.head_dim,
                 model.kv_heads // tp * model.head_dim, model.ffn_hidden // tp, model.heads // tp,
                 model.vocab // tp, model.head_dim, tp, lay.sequence_parallel,
                 2 if k.precision == "bf16" else 4, k.transformer_impl == "transformer_engine")


# -- what autograd saves -------------------------------------------------------------------------
def norm_bytes(sh: Shape) -> int:
    """transformer/torch_norm.py WrappedTorchNorm -> torch.nn.RMSNorm (torch's composite rms_norm):
    x.float() (fp32 [s, b, h]), rsqrt of the mean square (fp32 [s, b, 1]), x * rsqrt (fp32) and the
    normalised value cast back (activation dtype), each saved for backward; with SP the norm sees the
    sequence shard [s/tp, b, h]."""
    n = sh.sbh_n
    return 4 * n + 4 * (n // sh.h) + 4 * n + sh.e * n


def layer_groups(sh: Shape, rc: Recompute) -> dict[str, int]:
    """Bytes one decoder layer saves for backward per micro-batch, by sub-block in forward order
    (transformer/transformer_layer.py TransformerLayer.forward, local spec gpt_layer_specs.py
    get_gpt_layer_local_spec):
      norm1 / norm2  norm_bytes (input_layernorm, pre_mlp_layernorm)
      rope           models/common/embeddings/rope_utils.py _apply_rotary_pos_emb_bshd: cos and sin cast
                     to the activation dtype ([s, 1, 1, head_dim]) for q and for k, saved by the
                     multiplies; the rotated q ([s, b, heads/tp, head_dim], torch.cat) saved by the
                     score matmul
      core           transformer/dot_product_attention.py DotProductAttention.forward: the GQA-expanded
                     key and value ([s, b, heads/tp, head_dim] each), the bool causal mask [s, s],
                     the fp32 softmax ([b, heads/tp, s, s], fusions/fused_softmax.py
                     FusedScaleMaskSoftmax.forward_torch_softmax: softmax in fp32) and its cast back,
                     and the context ([s, b, heads/tp * head_dim]) saved by linear_proj.
                     TransformerEngine's TEDotProductAttention (fused / flash): q, k, v, the output
                     and fp32 softmax statistics [b, heads/tp, s], no s^2 tensor.
                     Selective core_attn (attention.py _checkpointed_attention_forward):
                     CheckpointFunction saves its tensor inputs: q (the rotated q, already counted),
                     the rotated k ([s, b, kv/tp, head_dim]), value (a view of linear_qkv's output,
                     whose storage [s, b, (heads + 2 kv)/tp * head_dim] it keeps), the mask-type int,
                     and linear_proj saves the checkpoint's output (the context)
      mlp            transformer/mlp.py MLP.forward (gated, swiglu): linear_fc1's output
                     [s, b, 2 ffn/tp], silu of its first half, the second half (a copy: the glu's
                     chunk + add), their product (linear_fc2's input), each activation dtype
    """
    e, s, b = sh.e, sh.s, sh.b
    sb = s * b
    n = norm_bytes(sh)
    rope = 4 * e * s * sh.hd + e * sb * sh.hq
    if sh.te:
        core = e * sb * (2 * sh.hq) + e * sb * sh.hq + 4 * b * sh.a * s  # k, v expanded, context, softmax stats
    else:
        core = 3 * e * sb * sh.hq + s * s + (4 + e) * b * sh.a * s * s
    if rc.core_attn:
        core = e * sb * sh.hkv + e * sb * (sh.hq + 2 * sh.hkv) + 4 + e * sb * sh.hq
    mlp = e * sb * 2 * sh.f + 3 * e * sb * sh.f
    return {"norm1": n, "rope": rope, "core": core, "norm2": n, "mlp": mlp}


def core_full(sh: Shape) -> int:
    """The core-attention bytes a selective recompute rebuilds in that layer's backward."""
    return layer_groups(sh, Recompute())["core"]


def head_groups(sh: Shape) -> dict[str, int]:
    """The chunk holding post_process: the final norm (decoder.final_layernorm), the fp32 logits
    and the target mask / masked target that tensor_parallel/cross_entropy.py
    VocabParallelCrossEntropy.forward saves (exp_logits normalised in place: the fp32 copy of the
    logits [s, b, vocab/tp]; target_mask bool and masked_target int64 [s, b])."""
    sb = sh.s * sh.b
    return {"final norm": norm_bytes(sh), "logits fp32 (cross-entropy)": 4 * sb * sh.v,
            "target mask + masked target": sb + 8 * sb}


def embedding_groups(sh: Shape) -> dict[str, int]:
    """The chunk holding pre_process: tensor_parallel/layers.py VocabParallelEmbedding.forward saves
    the token indices for the embedding's backward: with tp > 1 its input_mask (bool [b, s]) and the
    masked input (int64 [b, s]); with tp = 1 the tokens themselves, a view of the launcher's
    [b, s + 1] int64 batch (launchers/megatron.py batches), whose storage it keeps."""
    sb = sh.s * sh.b
    return {"token indices": sb + 8 * sb if sh.tp > 1 else 8 * sh.b * (sh.s + 1)}


# -- moments of the backward -----------------------------------------------------------------------
def _layer_moments(sh: Shape, rc: Recompute):
    """(name, saved bytes of the layer still live, temporaries, gathered) at each moment of one
    layer's backward, last sub-block first (tensor_parallel/layers.py
    LinearWithGradAccumulationAndAsyncCommunication.backward: the input grad, then the weight grad
    grad_output^T @ input in the activation dtype, before the DDP hook adds it to main_grad). The
    incoming [s, b, h] grad is live throughout. SP: the column-parallel input is all-gathered again
    for the weight grad and the row-parallel output grad gathered (gathered [s, b, h])."""
    g = layer_groups(sh, rc)
    e, sb, h = sh.e, sh.s * sh.b, sh.h
    total = sum(g.values())
    gin = e * sh.sbh_n  # the incoming grad (the residual stream: the sequence shard with SP)
    sp_g = e * sh.sbh if sh.sp else 0
    after_mlp = total - g["mlp"]
    after_norm2 = after_mlp - g["norm2"]
    out = [("fc2", total, gin + e * sb * sh.f + e * h * sh.f, sp_g),
           ("fc1", after_mlp, gin + e * sb * 2 * sh.f + e * sh.sbh + e * 2 * sh.f * h, sp_g),
           ("pre_mlp_layernorm", total - g["mlp"], 2 * gin + 16 * sh.sbh_n, 0),
           ("proj", after_norm2, 2 * gin + e * h * sh.hq, sp_g)]
    if not sh.te:
        # the score grads: bmm grad of the bf16 probabilities, its fp32 cast, _softmax_backward_data's
        # fp32 output (fused_softmax.py torch path); the context, the bf16 probabilities and the
        # expanded value already freed. Selective core_attn first recomputes the core (core_full)
        s2 = sh.b * sh.a * sh.s * sh.s
        live = after_norm2 - e * sb * sh.hq - e * s2 - e * sb * sh.hq
        tmp = gin + e * sb * sh.hq + 8 * s2
        if rc.core_attn:
            # CheckpointFunction.backward recomputes the core (core_full) while its saved inputs (the
            # rotated k, linear_qkv's output storage, the mask type) stay; the recomputed output and
            # the grad handed to torch.autograd.backward for it are two more [s, b, heads/tp, hd]
            live += core_full(sh) - g["core"] + e * sb * sh.hkv + e * sb * (sh.hq + 2 * sh.hkv) + 4
            tmp += 2 * e * sb * sh.hq
        out.append(("attention scores", live, tmp, 0))
    out += [("qkv", g["norm1"], gin + e * sb * (sh.hq + 2 * sh.hkv) + e * sh.sbh + e * (sh.hq + 2 * sh.hkv) * h, sp_g),
            ("input_layernorm", g["norm1"], 2 * gin + 16 * sh.sbh_n, 0)]
    return total, out


class Unit(NamedTuple):
    """A piece of one micro-batch's chunk in backward order: what it holds saved while not yet
    backpropagated, and its moments (name, its own live bytes then, temporaries, gathered)."""
    name: str
    saved: int
    moments: tuple


def chunk_units(sh: Shape, rc: Recompute, layers: int, first: bool, last: bool, model: ModelShape) -> list[Unit]:
    """The units of one model chunk in backward order: the head, the layers (last first), the
    embedding. Full recompute (recompute.py checkpointed_forward): uniform checkpoints chunks of
    recompute_num_layers layers, block the first recompute_num_layers layers one by one; each
    checkpoint saves only its hidden_states input ([s, b, h], the sequence shard with SP; the
    rotary table it also gets is RoPE's cached emb, resident), and its backward recomputes its
    layers (their full saved bytes) before walking them."""
    units = []
    if last:
        hg = head_groups(sh)
        saved = sum(hg.values())
        sb, e = sh.s * sh.b, sh.e
        gather = e * sh.sbh if sh.sp else 0
        units.append(Unit("output layer", saved, (
            ("cross-entropy backward", saved, e * sb * sh.v, 0),
            # logits grad, the output layer's input grad and its weight grad (activation dtype)
            ("output layer weight grad", hg["final norm"], e * sb * sh.v + e * sh.sbh + e * sh.v * sh.h,
             gather + (e * sh.sbh // sh.tp if sh.sp else 0)),
            ("final_layernorm", hg["final norm"], 2 * e * sh.sbh + 16 * sh.sbh_n, 0))))
    total, moments = _layer_moments(sh, rc)
    if rc.granularity == "full":
        n = rc.num_layers
        ck = sh.e * sh.sbh_n
        if rc.method == "uniform":
            groups = [(i, min(i + n, layers)) for i in range(0, layers, n)]
            ckpt = [True] * len(groups)
        else:
            groups = [(i, i + 1) for i in range(layers)]
            ckpt = [i < n for i in range(layers)]
        for (lo, hi), c in reversed(list(zip(groups, ckpt))):
            k = hi - lo
            if not c:
                units += [Unit(f"layer {i}", total, tuple(moments)) for i in reversed(range(lo, hi))]
                continue
            # the group's saved input; the first group's, on a stage that receives it, is the p2p buffer
            # itself, counted here and not as p2p (received_in_p2p)
            own = ck
            # backward of the checkpoint: recompute every layer of it, then walk them
            ms = []
            # (CheckpointFunction.backward: torch.autograd.backward of the recomputed output, [s, b, h])
            out_h = sh.e * sh.sbh_n
            if not sh.te:
                # each recomputed layer's softmax cast (softmax_cast), in forward order: the layers of the
                # group recomputed before it hold all their saves, the one before its output (this
                # layer's residual; the group's first layer's is the checkpoint's input), and the
                # checkpoint's output grad is live. Measured where it is the peak: the article's
                # TP2-PP2-DP2-SP run with full uniform recompute (cluster=fake, s=8192), both stages
                cast_own, cast_tmp = softmax_cast(sh, rc)
                ms += [(f"layer {i} {RECOMPUTED_CAST}", own + (i - lo) * total + cast_own,
                        cast_tmp + out_h + (out_h if i > lo else 0), 0) for i in range(lo, hi)]
            for j in range(k):  # the layer j from the end of the group
                rest = (k - 1 - j) * total
                ms += [(f"layer {hi - 1 - j} {name}", own + rest + live, t + out_h, g) for name, live, t, g in moments]
            units.append(Unit(f"layers {lo}-{hi - 1} (checkpointed)", own, tuple(ms)))
    else:
        units += [Unit(f"layer {i}", total, tuple(moments)) for i in reversed(range(layers))]
    if last and first and model.tied_embeddings:
        # one weight for the embedding and the output layer (pp = 1, share_embeddings_and_output_weights):
        # autograd sums both uses' grads before the param's AccumulateGrad (and the DDP hook,
        # distributed_data_parallel.py _make_backward_post_hook, that adds it to main_grad) runs,
        # so the output layer's weight grad is held until the embedding's backward
        held = sh.e * sh.v * sh.h
        units = units[:1] + [Unit(u.name, u.saved, tuple((n, a, t + held, g) for n, a, t, g in u.moments))
                             for u in units[1:]]
    if first:
        eg = embedding_groups(sh)
        saved = sum(eg.values())
        held = sh.e * sh.v * sh.h if last and model.tied_embeddings else 0
        units.append(Unit("embedding", saved, (
            ("embedding weight grad", saved, sh.e * sh.sbh + sh.e * sh.v * sh.h + held, sh.e * sh.sbh if sh.sp else 0),)))
    return units


def chunk_saved(units: list[Unit]) -> int:
    return sum(u.saved for u in units)


def softmax_forward(sh: Shape, rc: Recompute, layers: int, first: bool) -> tuple[int, int] | None:
    """(this micro-batch's saved bytes in the chunk, temporaries) when its last layer's softmax is cast
    back to the activation dtype in the forward: the local spec's largest forward moment (None where
    it is not modelled: TransformerEngine's attention has no s^2 tensor; selective recompute; full
    recompute whose last layer is checkpointed, whose recompute in backward holds more: chunk_units).

    fusions/fused_softmax.py FusedScaleMaskSoftmax.forward_torch_softmax: `input.float()` (fp32
    [b, heads/tp, s, s]), the fp32 softmax (saved), then `probs.bfloat16()` (saved by the context
    bmm): at that cast the layer holds its norm, rope and core saves but the context (linear_proj's
    input, not made yet), and the earlier layers (and the embedding on the first chunk) all of theirs.
    Temporaries then: DotProductAttention's baddbmm scores [b·heads/tp, s, s] (activation dtype) and
    their fp32 copy; Attention.forward's `qkv_output` tuple (attention.py: it keeps what
    get_query_key_value_tensors returned, the query's reshape of its split [s, b, heads/tp,
    head_dim], a copy where the split cannot be viewed as that shape, and key / value views of
    linear_qkv's output [s, b, (heads + 2 kv)/tp · head_dim]); the rotated key (rope_utils.py
    _apply_rotary_pos_emb_bshd's torch.cat, [s, b, kv/tp, head_dim], expanded by repeat_interleave,
    which saves nothing); TransformerLayer.forward's residual (the
    layer's input [s, b, h], the sequence shard with SP: the previous layer's output) and on the first
    chunk GPTModel.forward's decoder_input (the embedding's output, the same tensor for layer 0).
    Measured exact at the article's shape (cluster=fake, TP2·PP2·DP2·SP, s=8192: stage 0's third
    micro-batch, the last stage's eighth), up to the launcher's batch (8·b·(s + 1) B, not modelled)."""
    if sh.te or rc.granularity == "selective" or layers < 1:
        return None
    # full recompute (recompute.py checkpointed_forward): the checkpointed layers save their input only;
    # where the last layer is checkpointed too (uniform; block over every layer) its forward runs under
    # no_grad and holds less than its recompute in backward (chunk_units), so no forward moment
    n = rc.num_layers if rc.granularity == "full" else 0
    if n and (rc.method != "block" or layers <= n):
        return None
    ck = sh.e * sh.sbh_n  # a checkpoint's input; on a stage that receives it, layer 0's is the p2p buffer
    own, tmp = softmax_cast(sh, rc)
    own += n * ck + (layers - 1 - n) * sum(layer_groups(sh, rc).values())
    if first:
        own += sum(embedding_groups(sh).values())
    # the last layer's residual (the previous layer's output) and, on the first chunk without a
    # checkpoint around layer 0 (which saves it), GPTModel.forward's decoder_input
    return own, tmp + ck * ((layers > 1) + (first and not n))


def softmax_cast(sh: Shape, rc: Recompute) -> tuple[int, int]:
    """(the layer's own saved bytes, temporaries) at its softmax cast (softmax_forward says which),
    without its input (the residual) and what earlier layers hold: shared by a forward's last layer
    and a fully recomputed layer's forward in its backward (chunk_units)."""
    g = layer_groups(sh, rc)
    e, sb = sh.e, sh.s * sh.b
    s2 = sh.b * sh.a * sh.s * sh.s
    own = g["norm1"] + g["rope"] + g["core"] - e * sb * sh.hq
    # the query split from [s, b, groups, (heads/groups + 2) head_dim] reshapes to [s, b, heads/tp,
    # head_dim] as a view where one group (kv heads / tp = 1) or one head a group; else a copy
    groups = sh.hkv // sh.hd
    q_copy = e * sb * sh.hq if groups > 1 and sh.a // groups > 1 else 0
    return own, (4 + e) * s2 + q_copy + e * sb * (sh.hq + 2 * sh.hkv) + e * sb * sh.hkv


def received_in_p2p(first: bool, rc: Recompute) -> bool:
    """Whether a chunk's received input (schedules.py input_tensor) counts as a p2p buffer (gathered):
    not on the first stage, which receives none, nor under full recompute, whose checkpoint around
    layer 0 (recompute.py: uniform and block both start at layer 0) saves that buffer itself
    (CheckpointFunction's save_for_backward, which the peak probe sees as saved: activations, and
    chunk_units / softmax_forward count it so)."""
    return not first and rc.granularity != "full"


def _forward_gathered(k: int, w: int, first: bool, last: bool, e_p: int, per_live: int,
                      in_p2p: bool) -> tuple[int, int]:
    """p2p tensors a 1F1B stage holds during forward k (pipeline_parallel/schedules.py
    forward_backward_pipelining_without_interleaving): each earlier micro-batch not yet backpropagated
    keeps its received input and sent output (per_live: p2p() of one), this one its received input;
    from the steady loop's second iteration the previous iteration's locals are still bound while
    forward_step runs: output_tensor and the output_tensor_grad received for it (not on the last
    stage), input_tensor_grad, and through output_tensor's autograd graph (the input's AccumulateGrad
    node) that micro-batch's input (not on the first). Returns (gathered, saved): a received input
    goes in saved where a checkpoint saved it (in_p2p false: received_in_p2p), the stale one too (the
    probe names a tensor by what it was)."""
    done = max(0, k - w)  # backwards before forward k: the steady loop runs forward w + i, then backward i
    recv = 0 if first else e_p  # a received input (this forward's, where saved, is softmax_forward's)
    g = (k - done) * per_live + (recv if in_p2p else 0)
    stale_saved = 0
    if done:
        # output_tensor and its grad, input_tensor_grad, and the stale input
        g += (0 if last else 2 * e_p) + recv + (recv if in_p2p else 0)
        stale_saved = 0 if in_p2p else recv
    return g, stale_saved


def _softmax_moments(sh: Shape, rc: Recompute, stage_shape: tuple, forwards, w: int, saved: int, per_live: int,
                     e_p: int) -> list[tuple]:
    """The moments (bytes over resident, parts, phase, what) of the given forwards' softmax casts on a
    vp = 1 stage (stage_shape: its chunk's layers, first, last; saved: one micro-batch's saved bytes;
    per_live: p2p() of one in flight): the micro-batches not yet backpropagated keep theirs, the
    forward's own (softmax_forward) and the p2p tensors of that moment (_forward_gathered)."""
    n, first, last = stage_shape
    sf = softmax_forward(sh, rc, n, first)
    if sf is None:
        return []
    out = []
    for kk in forwards:
        gat, stale = _forward_gathered(kk, w, first, last, e_p, per_live, received_in_p2p(first, rc))
        act = (kk - max(0, kk - w)) * saved + sf[0] + stale
        out.append((act + sf[1] + gat, {"activations": act, "temporary": sf[1], "gathered": gat}, "forward",
                    f"layer {n - 1}: softmax cast (micro-batch {kk})"))
    return out


# -- the schedule ----------------------------------------------------------------------------------
def schedule(pp: int, vp: int, stage: int, m: int) -> tuple[int, list[int], list[int]]:
    """(warm-up forwards, the chunk of each forward, of each backward) of one stage's step.
    pipeline_parallel/schedules.py: forward_backward_no_pipelining (pp = 1: F, B per micro-batch),
    forward_backward_pipelining_without_interleaving (pp - stage - 1 warm-up forwards, then one
    forward and one backward each), forward_backward_pipelining_with_interleaving (get_pp_rank_
    microbatches: (pp - stage - 1) * 2 + (vp - 1) * microbatch_group_size_per_vp_stage warm-up forwards,
    the group size pp by default (model_parallel_config.py); get_model_chunk_id: forward k runs
    chunk (k // pp) % vp, backward k chunk vp - 1 - (k // pp) % vp)."""
    total = m * vp
    if pp == 1:
        w = 0
    elif vp == 1:
        w = pp - stage - 1
    else:
        w = (pp - stage - 1) * 2 + (vp - 1) * pp
    w = min(w, total)
    fwd = [(k // pp) % vp if vp > 1 else 0 for k in range(total)]
    bwd = [vp - 1 - (k // pp) % vp if vp > 1 else 0 for k in range(total)]
    return w, fwd, bwd


# -- the optimizer step ----------------------------------------------------------------------------
def _chunk_params(model: ModelShape, lay: Layout, k, stage: int, ch: int):
    from ledger.faithful.megatron.buffers import _shared

    params = stage_params(model, lay.tp, lay.pp, stage, lay.vp, ch, k.pp_split)
    _, first, last = _stage_shape(model, lay.pp, stage, lay.vp, ch, k.pp_split)
    shared = _shared(model, first, last, k.use_distributed_optimizer)
    return params, buffer_layout(params, effective_bucket_size(k, lay.dp, stage, ch), lay.dp,
                                 k.use_distributed_optimizer, shared and first, shared and last)


def _no_wd(name: str) -> bool:
    """optimizer/__init__.py _get_param_groups: no weight decay for biases and 1-D params (the norms);
    those groups sort after the default one (key (override is not None, override))."""
    return "layernorm" in name or name.endswith(".bias")


@lru_cache(maxsize=1024)
def optimizer_moments(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int) -> tuple[tuple, tuple]:
    """((bytes, what) of the largest grad-sync transient, (bytes, what) of the largest Adam transient).

    The local spec stands for the CPU gloo runs (launchers/megatron.py), transformer_engine for a GPU
    NCCL run (TE's FusedAdam, NCCL in place: no such transients).
    Grad sync: distributed/param_and_grad_buffer.py start_grad_sync reduce-scatters each bucket's
    grad_data (the distributed optimizer); gloo's reduce_scatter_tensor works on a copy of the whole
    input, which the peak probe sees when the collective completes (finish_grad_sync: split + copy
    into the rank's shard), one bucket group at a time; a chunk built with disable_bucketing (vp
    chunks after the first) is one group of all its buckets. The all-reduce without the distributed
    optimizer works in place.
    Adam: torch.optim.AdamW on CPU tensors is the single-tensor loop (torch/optim/adamw.py, adam.py
    _single_tensor_adam: foreach only for CUDA tensors): per param `denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)`, two fp32 temporaries of the param's size, and the previous
    param's denom lives on until it is rebound, so param i holds d[i-1] + 2 d[i] within one param
    group. The params are the fp32 master shards (distrib_optimizer.py
    _build_optimizer_group_ranges: per param group, the chunks' buckets in buffer order, each
    param's range on this DP rank; optimizer.py Float16OptimizerWithFloat16Params: whole fp32
    masters in named_parameters order); groups: weight decay first, then the norms."""
    if k.transformer_impl == "transformer_engine":
        # the GPU run the TE spec stands for: NCCL's reduce-scatter writes the shard in place, and
        # Megatron's Adam is TE's / apex's FusedAdam (multi-tensor kernels, in place): neither holds a
        # transient the size of a bucket or a param (no run here confirms it)
        return (0, ""), (0, "")
    dist = k.use_distributed_optimizer
    gb = 4 if (k.grad_reduce_in_fp32 or k.precision != "bf16") else 2
    sync, groups = (0, ""), {False: [], True: []}
    for ch in range(lay.vp):
        params, buckets = _chunk_params(model, lay, k, stage, ch)
        if dist and lay.dp >= 1:
            if ch > 0:
                sync = max(sync, (gb * sum(b.numel for b in buckets), f"grad buckets of chunk {ch} (coalesced)"))
            else:
                sync = max(sync, max((gb * b.numel, "grad bucket reduce-scatter (gloo copy)") for b in buckets))
            for b in buckets:
                for name, kk in shard_ranges([b], lay.dp, dp_rank):
                    groups[_no_wd(name)].append(4 * kk)
        else:
            for name, kk in params:
                groups[_no_wd(name)].append(4 * kk)
    best = (0, "")
    for g in (False, True):
        d = groups[g]
        for i, x in enumerate(d):
            best = max(best, ((d[i - 1] if i else 0) + 2 * x, "Adam denominators (fp32 sqrt / div)"))
    if not dist:
        sync = (0, "")
    return sync, best


# -- the peak --------------------------------------------------------------------------------------
def stage_moments(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int) -> list[tuple]:
    """Every moment of a steady step the peak is looked for at, each (bytes over the resident state,
    parts, phase, what): the backward moments of every micro-batch of the schedule (each unit's
    moments with the other in-flight micro-batches' saved bytes), the cross-entropy forward, then
    the grad sync and Adam's step (optimizer_moments), these two last."""
    moments = list(_step_moments_fast(model, lay, k, stage))
    e_p = moments.pop()
    (sync_b, sync_w), (adam_b, adam_w) = optimizer_moments(model, lay, k, stage, dp_rank)
    # finalize_model_grads runs after the last backward, inside the schedule function: the probe's
    # phase "optimizer"; the schedule still holds the last micro-batch's p2p tensors (its received
    # input or output grad, and the one it sent)
    g = 2 * e_p if lay.pp > 1 else 0
    moments.append((sync_b + g, {"activations": 0, "temporary": sync_b, "gathered": g}, "optimizer", sync_w))
    moments.append((adam_b, {"activations": 0, "temporary": adam_b, "gathered": 0}, "optimizer", adam_w))
    return moments


@lru_cache(maxsize=1024)
def _step_moments(model: ModelShape, lay: Layout, k, stage: int) -> tuple:
    """stage_moments' forward and backward moments (the same on every DP rank of a stage: cached), and
    last the bytes of one p2p tensor."""
    rc = recompute_of(k)
    sh = shape_of(model, lay, k)
    e_p = sh.e * (sh.sbh // (sh.tp if sh.sp else 1))  # one p2p tensor ([s/tp, b, h] with SP)
    chunks, shapes = [], []
    for ch in range(lay.vp):
        shapes.append(_stage_shape(model, lay.pp, stage, lay.vp, ch, k.pp_split))
        n, first, last = shapes[-1]
        chunks.append((chunk_units(sh, rc, n, first, last, model), first, last))
    saved = [chunk_saved(u) for u, _, _ in chunks]
    w, fwd, bwd = schedule(lay.pp, lay.vp, stage, lay.num_microbatches)
    moments = []  # (extra bytes over resident, parts without resident, phase, what)

    def add(act, tmp, gat, phase, what):
        moments.append((act + tmp + gat, {"activations": act, "temporary": tmp, "gathered": gat}, phase, what))

    def p2p(live_chunks):
        # pipeline_parallel/schedules.py keeps each in-flight micro-batch's received input (its
        # chunk's input_tensor) and sent output (output_tensor, deallocate_pipeline_outputs off)
        g = 0
        for ch in live_chunks:
            _, first, last = chunks[ch]
            g += (e_p if received_in_p2p(first, rc) else 0) + (0 if last else e_p)
        return g

    for j in range(len(fwd)):
        # before backward j: forwards 0..min(w + j, total - 1) done (the 1F1B forward precedes its
        # backward), backwards 0..j-1 done
        nf = min(w + j, len(fwd) - 1) + 1
        live = list(fwd[:nf])
        for c in bwd[:j]:
            live.remove(c)
        ch = bwd[j]
        live.remove(ch)
        others = sum(saved[c] for c in live)
        units, first, last = chunks[ch]
        # + the received output grad (recv_backward) and the input grad sent by the previous backward
        g_base = p2p(live + [ch]) + (0 if last else e_p) + (e_p if j > 0 and not first else 0)
        if last:
            # the cross-entropy forward (tensor_parallel/cross_entropy.py): the logits in the activation
            # dtype beside their fp32 copy (counted saved; the final norm's output too), and on a stage
            # that receives its input the previous backward's input grad (schedules.py 1F1B loop:
            # input_tensor_grad, sent by send_backward_recv_forward) is still referenced
            add(others + saved[ch], sh.e * sh.s * sh.b * sh.v,
                p2p(live + [ch]) + (e_p if j > 0 and not first else 0), "forward",
                f"cross-entropy forward (micro-batch {j})")
        rest = saved[ch]
        for i, u in enumerate(units):
            rest -= u.saved
            # a chunk without the head backpropagates first the grad it received (recv_backward, held by
            # the schedule through the micro-batch's backward: gathered); its last layer's fc2 and fc1
            # see that buffer itself as their incoming grad, later moments a new one (the residual add)
            recv = e_p if i == 0 and not last else 0
            for name, own, tmp, gat in u.moments:
                t = tmp - recv if name.endswith(INCOMING_IS_RECEIVED) else tmp
                add(others + rest + own, t, g_base + gat, "backward", f"{u.name}: {name} (micro-batch {j})")
    if lay.vp == 1:  # each forward's softmax moment (softmax_forward), after the backward moments
        moments += _softmax_moments(sh, rc, shapes[0], range(len(fwd)), w, saved[0], p2p([0]), e_p)
    return (*moments, e_p)


@lru_cache(maxsize=1024)
def _step_moments_fast(model: ModelShape, lay: Layout, k, stage: int) -> tuple:
    """_step_moments (the readable reference, kept beside it) reduced to what a peak needs: per
    backward j, its cross-entropy forward and only the first of its backward moments with the most
    bytes, in the reference's order, so max() of either list is the same moment. Each backward's
    moments are the chunk's own (computed once per chunk) over what the schedule holds then, which
    prefix sums over the forward and backward orders give: O(micro-batches + layers) instead of the
    reference's O(micro-batches x (micro-batches + layers)) (a planner row of llama3_70b on 1,024 GPUs
    took 25 ms). tests/test_megatron_peak.py checks the two agree."""
    rc = recompute_of(k)
    sh = shape_of(model, lay, k)
    e_p = sh.e * (sh.sbh // (sh.tp if sh.sp else 1))
    chunks, shapes = [], []
    for ch in range(lay.vp):
        shapes.append(_stage_shape(model, lay.pp, stage, lay.vp, ch, k.pp_split))
        n, first, last = shapes[-1]
        chunks.append((chunk_units(sh, rc, n, first, last, model), first, last))
    saved = [chunk_saved(u) for u, _, _ in chunks]
    pw = [(e_p if received_in_p2p(first, rc) else 0) + (0 if last else e_p)
          for _u, first, last in chunks]  # p2p() per chunk
    best = []  # per chunk: (inner bytes, activations part, temporary, gathered, what) of its top moment
    for ch, (units, first, last) in enumerate(chunks):
        top = None
        rest = saved[ch]
        for i, u in enumerate(units):
            rest -= u.saved
            recv = e_p if i == 0 and not last else 0
            for name, own, tmp, gat in u.moments:
                t = tmp - recv if name.endswith(INCOMING_IS_RECEIVED) else tmp
                v = rest + own + t + gat
                if top is None or v > top[0]:
                    top = (v, rest + own, t, gat, f"{u.name}: {name}")
        best.append(top)
    w, fwd, bwd = schedule(lay.pp, lay.vp, stage, lay.num_microbatches)
    sf, pf = [0], [0]
    for c in fwd:
        sf.append(sf[-1] + saved[c])
        pf.append(pf[-1] + pw[c])
    sb, pb = [0], [0]
    for c in bwd:
        sb.append(sb[-1] + saved[c])
        pb.append(pb[-1] + pw[c])
    moments = []
    for j in range(len(fwd)):
        nf = min(w + j, len(fwd) - 1) + 1
        ch = bwd[j]
        _units, first, last = chunks[ch]
        others = sf[nf] - sb[j] - saved[ch]
        held = pf[nf] - pb[j]  # p2p(live + [ch])
        g_base = held + (0 if last else e_p) + (e_p if j > 0 and not first else 0)
        if last:
            act, tmp, gat = others + saved[ch], sh.e * sh.s * sh.b * sh.v, held + (e_p if j > 0 and not first else 0)
            moments.append((act + tmp + gat, {"activations": act, "temporary": tmp, "gathered": gat}, "forward",
                            f"cross-entropy forward (micro-batch {j})"))
        top = best[ch]
        if top is not None:
            act, tmp, gat = others + top[1], top[2], g_base + top[3]
            moments.append((act + tmp + gat, {"activations": act, "temporary": tmp, "gathered": gat}, "backward",
                            f"{top[4]} (micro-batch {j})"))
    if lay.vp == 1:
        # the reference's forward softmax moments grow with the micro-batches in flight up to forward w
        # and stay level from forward w + 1 (w in flight, the previous iteration's p2p locals): the
        # first of each, in its order
        total = len(fwd)
        ks = sorted({min(w, total - 1), *([w + 1] if w + 1 < total else [])})
        moments += _softmax_moments(sh, rc, shapes[0], ks, w, saved[0], pw[0], e_p)
    return (*moments, e_p)


def stage_peak(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int, resident: int,
               adam_state: int) -> Peak:
    """The rank's peak in a steady step: its largest moment (stage_moments). `first`: the first
    step's, where Adam's exp_avg / exp_avg_sq / step (adam_state bytes) do not exist before its
    optimizer step (torch/optim/adam.py _init_group makes them param by param: bounded by the steady
    Adam moment)."""
    moments = stage_moments(model, lay, k, stage, dp_rank)
    adam_b, adam_w = moments[-1][0], moments[-1][3]
    x, parts, phase, what = max(moments, key=lambda m: m[0])
    steady = Peak(resident + x, {"resident": resident, **parts, "unnamed": 0}, phase, what)
    # the first step: without Adam's state until the optimizer step
    fb = max(moments[:-1], key=lambda m: m[0])
    r0 = resident - adam_state
    if r0 + fb[0] >= resident + adam_b:
        first = Peak(r0 + fb[0], {"resident": r0, **fb[1], "unnamed": 0}, fb[2], fb[3])
    else:
        first = Peak(resident + adam_b, {"resident": resident, "activations": 0, "temporary": adam_b,
                                         "gathered": 0, "unnamed": 0}, "optimizer",
                     f"{adam_w}, first step (bound)" if adam_b else "the state made by the first optimizer step")
    return Peak(steady.bytes, steady.parts, steady.phase, steady.what,
                first=None if first.bytes == steady.bytes else first)
