"""What one micro-batch of a Megatron Core 0.18.0 model chunk saves for backward, and the moments of
its backward (ledger.faithful.megatron.peak walks them over a step's schedule). Each rule names the
megatron (or torch) source it follows, paths under megatron/core/ unless said otherwise.

  Shape / shape_of   one micro-batch of one rank, in elements
  layer_groups       the bytes one decoder layer saves (transformer/transformer_layer.py, the local
                     spec of models/gpt/gpt_layer_specs.py), by sub-block; per model chunk head_groups
                     (the final norm, the cross-entropy's fp32 logits) and embedding_groups (the tokens)
  chunk_units        a chunk's units in backward order (the head, the layers last first, the
                     embedding), each with what it holds saved and its moments: the local spec's
                     backward (_layer_moments: fc2, fc1, the attention-score grads, proj, qkv, each
                     norm), full recompute's checkpoints recomputed in backward
  softmax_forward    a forward's last-layer softmax cast (softmax_cast: the s^2 tensors of a forward,
                     where long sequences peak)

The variant that runs: transformer_impl=local (CPU runs, mode=run) keeps the attention probabilities
(fp32 softmax + bf16 copy, [b, heads/tp, s, s]); transformer_impl=transformer_engine (Megatron-LM's
default, what mode=predict describes) runs TEDotProductAttention's fused kernel, which saves no s^2
tensor (its softmax statistics [b, heads/tp, s] fp32 and the output instead): `layer_groups` follows
the spec. Recompute (framework.recompute_*: Recompute, recompute_of, check_recompute): selective
core_attn (attention.py _checkpointed_attention_forward) and full uniform / block (recompute.py
checkpointed_forward), both through tensor_parallel/random.py CheckpointFunction
(ctx.save_for_backward of its tensor inputs).
"""
from __future__ import annotations

from typing import NamedTuple

from ledger.faithful.megatron.moe_activations import (expert_moments, experts_cat, forward_locals, mlp_saved, moe_groups,
                                                      moe_shape, MoEShape)
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape


# -- the recompute knobs ---------------------------------------------------------------------------
MODELLED_MODULES = ("core_attn",)  # what check_recompute accepts of selective recompute
# the moment name of a fully recomputed layer's softmax cast (chunk_units)
RECOMPUTED_CAST = "softmax cast (recompute)"


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


def recomputed_layers(rc: Recompute, layers: int) -> int:
    """The layers of a model chunk of `layers` whose forward full recompute runs again in backward
    (transformer_block.py _checkpointed_forward): uniform checkpoints every layer (in groups of
    recompute_num_layers), block the first recompute_num_layers of the chunk; selective none (its
    core attention holds no collective)."""
    if rc.granularity != "full":
        return 0
    return layers if rc.method == "uniform" else min(rc.num_layers, layers)


def check_recompute(rc: Recompute) -> None:
    """What the faithful ledger does not model is refused, naming the field (conf/validate.py checks
    Megatron's own rules first)."""
    if rc.granularity == "selective":
        other = [m for m in rc.modules if m not in MODELLED_MODULES]
        if other:
            raise ConfigError(f"megatron: framework.recompute_modules={list(rc.modules)}: the faithful ledger models "
                              "core_attn only (layernorm and mlp, transformer_layer.py's recompute_input_layernorm / "
                              "recompute_mlp, are not modelled yet); use ledger.mode=textbook")


# -- one micro-batch's shape -----------------------------------------------------------------------
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
    # an MoE model's layer (moe_activations.MoEShape; None: dense) and which of this chunk's layers
    # are MoE layers, in order (empty: none; chunk_shape sets it per chunk)
    moe: "MoEShape | None" = None
    kinds: tuple = ()

    def is_moe(self, i: int) -> bool:
        return bool(self.kinds) and self.kinds[i]

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h

    @property
    def sbh_n(self) -> int:
        """[s, b, h] elements of a norm's input: the sequence shard with SP."""
        return self.sbh // (self.tp if self.sp else 1)


def shape_of(model: ModelShape, lay: Layout, k, rows: str = "balanced") -> Shape:
    """rows: an MoE model's routed rows per rank, "balanced", "low" or "high" (moe_activations.rows_range)."""
    tp = lay.tp
    e = 2 if k.precision == "bf16" else 4
    mo = moe_shape(model, lay, k, rows) if model.is_moe else None
    return Shape(model.seq_len, lay.micro_batch_size, model.hidden, model.heads // tp * model.head_dim,
                 model.kv_heads // tp * model.head_dim, model.ffn_hidden // tp, model.heads // tp,
                 model.vocab // tp, model.head_dim, tp, lay.sequence_parallel, e,
                 k.transformer_impl == "transformer_engine", mo)


def chunk_shape(sh: Shape, model: ModelShape, first_layer: int, layers: int) -> Shape:
    """sh for one model chunk: which of its layers (global first_layer on) are MoE layers."""
    if sh.moe is None:
        return sh
    return sh._replace(kinds=tuple(model.is_moe_layer(first_layer + i) for i in range(layers)))


# -- what autograd saves -------------------------------------------------------------------------
def norm_bytes(sh: Shape) -> int:
    """transformer/torch_norm.py WrappedTorchNorm -> torch.nn.RMSNorm (torch's composite rms_norm):
    x.float() (fp32 [s, b, h]), rsqrt of the mean square (fp32 [s, b, 1]), x * rsqrt (fp32) and the
    normalised value cast back (activation dtype), each saved for backward; with SP the norm sees the
    sequence shard [s/tp, b, h]."""
    n = sh.sbh_n
    if sh.te:
        return te_norm_bytes(sh)
    return 4 * n + 4 * (n // sh.h) + 4 * n + sh.e * n


def te_norm_bytes(sh: Shape) -> int:
    """The TransformerEngine spec's norms (from sources; no CPU run can confirm them): input_layernorm
    and pre_mlp_layernorm are fused into linear_qkv / linear_fc1 (TELayerNormColumnParallelLinear,
    TE module/layernorm_linear.py _LayerNormLinear.forward), which saves the norm's input (inputmat,
    the activation-dtype residual stream: its backward's rmsnorm_bwd reads it), the normalised output
    ln_out (the GEMM's input; with SP the sequence shard, all-gathered again for the weight grad) and
    rsigma (fp32, one per token); the final norm (TENorm, module/rmsnorm.py) saves its input and rsigma,
    and the output layer its output. RMSNorm: LayerNorm's mu (4 bytes a token more) is not counted."""
    n = sh.sbh_n
    return 2 * sh.e * n + 4 * (n // sh.h)


def layer_groups(sh: Shape, rc: Recompute, moe_layer: bool = False) -> dict[str, int]:
    """Bytes one decoder layer saves for backward per micro-batch, by sub-block in forward order
    (transformer/transformer_layer.py TransformerLayer.forward, local spec gpt_layer_specs.py
    get_gpt_layer_local_spec):
      norm1 / norm2  norm_bytes (input_layernorm, pre_mlp_layernorm; TE spec: te_norm_bytes)
      rope           models/common/embeddings/rope_utils.py _apply_rotary_pos_emb_bshd: cos and sin cast
                     to the activation dtype ([s, 1, 1, head_dim]) for q and for k, saved by the
                     multiplies; the rotated q ([s, b, heads/tp, head_dim], torch.cat) saved by the
                     score matmul
      core           transformer/dot_product_attention.py DotProductAttention.forward: the GQA-expanded
                     key and value ([s, b, heads/tp, head_dim] each), the bool causal mask [s, s],
                     the fp32 softmax ([b, heads/tp, s, s], fusions/fused_softmax.py
                     FusedScaleMaskSoftmax.forward_torch_softmax: softmax in fp32) and its cast back,
                     and the context ([s, b, heads/tp * head_dim]) saved by linear_proj.
                     TransformerEngine's TEDotProductAttention (fused / flash; from sources, no CPU
                     run can confirm it): FusedAttnFunc saves q, k, v as it is handed them, the
                     output and the fp32 softmax statistics [b, heads/tp, s], no s^2 tensor; GQA
                     runs natively (k and v at kv heads/tp, no repeat). q (rope's, counted there)
                     and the rotated k are contiguous; v, a view of linear_qkv's output, has strides
                     no qkv layout matches, so get_qkv_layout (attention/dot_product_attention/
                     utils.py: "not_supported" -> x.contiguous()) saves a contiguous copy of it
                     (FlashAttention's backend copies the same way): k and v [s, b, kv/tp, head_dim]
                     each, and linear_qkv's output storage is not kept.
                     Selective core_attn (attention.py _checkpointed_attention_forward):
                     CheckpointFunction saves its tensor inputs: q (the rotated q, already counted),
                     the rotated k ([s, b, kv/tp, head_dim]), value (a view of linear_qkv's output,
                     whose storage [s, b, (heads + 2 kv)/tp * head_dim] it keeps), the mask-type int,
                     and linear_proj saves the checkpoint's output (the context)
      mlp            transformer/mlp.py MLP.forward (gated, swiglu): linear_fc1's output
                     [s, b, 2 ffn/tp], silu of its first half, the second half (a copy: the glu's
                     chunk + add), their product (linear_fc2's input), each activation dtype;
                     an MoE layer's (moe_layer) instead: moe_activations.moe_groups
    """
    e, s, b = sh.e, sh.s, sh.b
    sb = s * b
    n = norm_bytes(sh)
    rope = 4 * e * s * sh.hd + e * sb * sh.hq
    if sh.te:
        core = e * sb * (2 * sh.hkv) + e * sb * sh.hq + 4 * b * sh.a * s  # k, v at kv heads, context, softmax stats
    else:
        core = 3 * e * sb * sh.hq + s * s + (4 + e) * b * sh.a * s * s
    if rc.core_attn:
        core = e * sb * sh.hkv + e * sb * (sh.hq + 2 * sh.hkv) + 4 + e * sb * sh.hq
    mlp = sum(moe_groups(sh.moe).values()) if moe_layer else mlp_saved(e, sb, sh.f)
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
def _layer_moments(sh: Shape, rc: Recompute, moe_layer: bool = False):
    """(name, saved bytes of the layer still live, temporaries, gathered) at each moment of one
    layer's backward, last sub-block first (tensor_parallel/layers.py
    LinearWithGradAccumulationAndAsyncCommunication.backward: the input grad, then the weight grad
    grad_output^T @ input in the activation dtype, before the DDP hook adds it to main_grad). The
    incoming [s, b, h] grad is live throughout. SP: the column-parallel input is all-gathered again
    for the weight grad and the row-parallel output grad gathered (gathered [s, b, h])."""
    g = layer_groups(sh, rc, moe_layer)
    e, sb, h = sh.e, sh.s * sh.b, sh.h
    total = sum(g.values())
    gin = e * sh.sbh_n  # the incoming grad (the residual stream: the sequence shard with SP)
    sp_g = e * sh.sbh if sh.sp else 0
    # a norm's backward: torch's composite rms_norm backward runs in fp32 (16 bytes an element of
    # intermediates); TE's fused rmsnorm_bwd writes the input grad alone
    norm_tmp = 0 if sh.te else 16 * sh.sbh_n
    after_mlp = total - g["mlp"]
    after_norm2 = after_mlp - g["norm2"]
    if moe_layer:
        out = [(name, total, tmp, 0) for name, tmp in expert_moments(sh.moe, gin)]
    else:
        out = [("fc2", total, gin + e * sb * sh.f + e * h * sh.f, sp_g),
               ("fc1", after_mlp, gin + e * sb * 2 * sh.f + e * sh.sbh + e * 2 * sh.f * h, sp_g)]
    out += [("pre_mlp_layernorm", total - g["mlp"], 2 * gin + norm_tmp, 0),
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
            ("input_layernorm", g["norm1"], 2 * gin + norm_tmp, 0)]
    return total, out


def checkpoint_groups(rc: Recompute, layers: int) -> list[tuple[int, int, bool]]:
    """Full recompute's checkpoints over a chunk of `layers` (transformer_block.py _checkpointed_forward):
    (first layer, end, checkpointed) in forward order; uniform: groups of recompute_num_layers, block:
    the first recompute_num_layers one by one, checkpointed, the rest one by one, not."""
    n = rc.num_layers
    if rc.method == "uniform":
        return [(i, min(i + n, layers), True) for i in range(0, layers, n)]
    return [(i, i + 1, i < n) for i in range(layers)]


def recompute_holding(sh: Shape, rc: Recompute, layers: int, from_layer: int = 0) -> int:
    """Full recompute with MoE layers: a checkpoint's recompute builds its MoE layers' routing again and
    the token dispatcher keeps the recomputed probs as an attribute until the layer's next forward;
    their graph reaches the checkpoint's detached input, an autograd leaf that holds its storage and
    the grad backward accumulated into it ([s, b, h] each, the sequence shard with SP: measured, the
    probe's census after the step's backward). The bytes of the checkpoints holding so whose MoE layers
    at or after from_layer have not dispatched again."""
    if rc.granularity != "full" or not any(sh.kinds):
        return 0
    return sum(2 * sh.e * sh.sbh_n for lo, hi, c in checkpoint_groups(rc, layers)
               if c and any(sh.is_moe(x) for x in range(max(lo, from_layer), hi)))


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
            ("final_layernorm", hg["final norm"], 2 * e * sh.sbh + (0 if sh.te else 16 * sh.sbh_n), 0))))
    kinds = {}  # dense / MoE -> (total, moments)

    def of(i: int):  # layer i's (saved total, moments)
        m = sh.is_moe(i)
        if m not in kinds:
            kinds[m] = _layer_moments(sh, rc, m)
        return kinds[m]

    if rc.granularity == "full":
        ck = sh.e * sh.sbh_n
        left = 0  # what the checkpoints already recomputed in this backward hold (recompute_holding)
        next_holds = False  # whether the checkpoint after this one holds
        for lo, hi, c in reversed(checkpoint_groups(rc, layers)):
            # the next checkpoint's held input grad is the grad this one's backward receives (its out_h)
            held = left - (ck if next_holds else 0)
            k = hi - lo
            if not c:
                units += [Unit(f"layer {i}", of(i)[0], tuple((name, live, t + held, g) for name, live, t, g in of(i)[1]))
                          for i in reversed(range(lo, hi))]
                next_holds = False
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
                ms += [(f"layer {i} {RECOMPUTED_CAST}", own + sum(of(x)[0] for x in range(lo, i)) + cast_own,
                        cast_tmp + out_h + (out_h if i > lo else 0) + held, 0) for i in range(lo, hi)]
            for j in range(k):  # the layer j from the end of the group
                rest = sum(of(x)[0] for x in range(lo, hi - 1 - j))
                ms += [(f"layer {hi - 1 - j} {name}", own + rest + live, t + out_h + held, g)
                       for name, live, t, g in of(hi - 1 - j)[1]]
            units.append(Unit(f"layers {lo}-{hi - 1} (checkpointed)", own, tuple(ms)))
            next_holds = any(sh.is_moe(x) for x in range(lo, hi))
            left += 2 * ck if next_holds else 0
    else:
        for i in reversed(range(layers)):
            units.append(Unit(f"layer {i}", of(i)[0], tuple(of(i)[1])))
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
    own += n * ck + sum(sum(layer_groups(sh, rc, sh.is_moe(i)).values()) for i in range(n, layers - 1))
    if first:
        own += sum(embedding_groups(sh).values())
    # the last layer's residual (the previous layer's output) and, on the first chunk without a
    # checkpoint around layer 0 (which saves it), GPTModel.forward's decoder_input
    return own, tmp + ck * ((layers > 1) + (first and not n))


def moe_forward(sh: Shape, rc: Recompute, layers: int, first: bool) -> tuple[int, int, int] | None:
    """(this micro-batch's saved bytes in the chunk, temporaries, the layer) at the chunk's last MoE
    layer's experts' torch.cat in the forward (moe_activations.experts_cat): the layers before it
    and the embedding hold all their saves, the layer all its own; temporaries the experts' outputs
    and their cat, the MLP's residual (TransformerLayer.forward: the attention's output added to the
    layer's input), the layer's input itself (TransformerBlock.forward's hidden_states, the previous
    layer's output; on a later stage layer 0's is the received p2p buffer), on the first chunk
    GPTModel.forward's decoder_input (layer 0's input), each [s, b, h] (the sequence shard with SP),
    and MoELayer.forward's locals (moe_activations.forward_locals). None without an MoE layer, or
    with recompute (refused with MoE). Measured on the CPU (tp2·ep2·etp2, s = 512, the ranks whose
    experts got the most rows peak here) within 0.01% at the rows the run routed."""
    last = max((i for i in range(layers) if sh.is_moe(i)), default=None)
    if last is None or rc.granularity is not None:
        return None
    own = sum(sum(layer_groups(sh, rc, sh.is_moe(i)).values()) for i in range(last + 1))
    if first:
        own += sum(embedding_groups(sh).values())
    x = sh.e * sh.sbh_n
    residuals = x * (1 + (last > 0) + first)
    return own, experts_cat(sh.moe) + residuals + forward_locals(sh.moe), last


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
