"""DeepSpeed 0.19.8 ZeRO-1/2/3, faithful: the activations one micro-batch of the plain Llama
(launchers/llama.py) keeps for its backward, by name, as the peak ledger (peak.py) counts them.

Activations are derived op by op from launchers/llama.py and the tensors autograd saves for each op
(torch's derivatives.yaml), as the probe's saved_tensors_hooks sees them (saved_activations). With
framework.activation_checkpointing, every decoder layer runs under deepspeed.checkpointing.checkpoint
(runtime/activation_checkpointing/checkpointing.py CheckpointFunction.forward: the layer under
torch.no_grad, its inputs kept on ctx.deepspeed_saved_tensors, not through save_for_backward, so the
probe sees them as temporaries; plus ctx.fwd_cpu_rng_state and ctx.fwd_cuda_rng_state, both
torch.get_rng_state() on the CPU accelerator).
"""
from __future__ import annotations

from ledger.dtypes import FP32, INT64
from ledger.model import ModelShape

# torch.get_rng_state(): the CPU generator's state, a uint8 tensor of 5056 bytes (mt19937 + extras)
CPU_RNG_STATE = 5056


def modelled(model: ModelShape) -> str | None:
    """None where saved_activations follows the model's code; else why not."""
    if model.norm != "rmsnorm":
        return f"model.norm={model.norm!r}: the peak ledger derives RMSNorm's saved tensors only"
    if not model.swiglu:
        return "model.swiglu=false: the peak ledger derives SwiGLU's saved tensors only"
    if model.kv_heads == model.heads:
        return "kv_heads == heads: repeat_interleave(1) copies or not, not derived"
    return None


def batch_bytes(model: ModelShape, mbs: int) -> int:
    """launchers/data.py batch: a randint of (mbs, seq + 1) int64, tokens = t[:, :-1].contiguous() and
    labels = t[:, 1:].contiguous(): views of it at one sample (already contiguous), two copies of
    (mbs, seq) and the randint freed above (the embedding saves the tokens, nll_loss the labels)."""
    if mbs == 1:
        return INT64 * (model.seq_len + 1)
    return 2 * INT64 * mbs * model.seq_len


def layer_activations(model: ModelShape, mbs: int, w: int) -> dict[str, int]:
    """Bytes one Block's forward saves for backward (launchers/llama.py Block), w: model dtype bytes."""
    b, s, h, f = mbs, model.seq_len, model.hidden, model.ffn_hidden
    H, d = model.heads, model.head_dim
    bsh = b * s * h
    # RMSNorm.forward: xf = x.float() (a copy in bf16; x itself in fp32) saved by pow and by the mul
    # with rsqrt; rsqrt (b, s, 1) fp32 saved by that mul; y.type_as(x) (w) saved by the mul with the
    # weight; the norm's output (w) saved by the next Linear (mm saves its input)
    norm = FP32 * bsh + FP32 * b * s + 2 * w * bsh
    return {
        "attention_norm": norm,
        # rope(): cos and sin (s, d/2) fp32 saved by the muls with x0 / x1 (which require grad, the
        # angles do not), for q and for k; q = rope(...).type_as(x) saved by SDPA; k and v
        # repeat_interleave copies (b, s, heads, d) saved by SDPA; SDPA (CPU flash kernel,
        # _scaled_dot_product_flash_attention_for_cpu) saves its output (also wo's input) and the
        # logsumexp (b, heads, s) fp32
        "attention": 4 * FP32 * s * (d // 2) + 4 * w * b * s * H * d + FP32 * b * H * s,
        "ffn_norm": norm,
        # FeedForward: w1(x) saved by silu, silu's output and w3(x) by the mul, the product by w2
        "feed_forward": 4 * w * b * s * f,
    }


def head_activations(model: ModelShape, mbs: int, w: int) -> dict[str, int]:
    """The final norm, the output Linear's input, the cross-entropy in fp32 and the batch."""
    b, s = mbs, model.seq_len
    bsh = b * s * model.hidden
    return {
        "norm": FP32 * bsh + FP32 * b * s + 2 * w * bsh,
        # F.cross_entropy(logits.float()): log_softmax saves its fp32 output; nll_loss saves it, the
        # labels and total_weight (an fp32 scalar)
        "log_softmax (fp32)": FP32 * b * s * model.vocab,
        "nll_loss total_weight": FP32,
        "batch (tokens, labels)": batch_bytes(model, mbs),
    }


def saved_activations(model: ModelShape, mbs: int, w: int,
                      checkpointing: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(activations, temporaries held for backward) at the end of one micro-batch's forward, named.
    ZeRO-3's gathered weights that mm saves are not among them: mm saves the Parameter itself (a
    leaf), so the saved tensor holds the gathered storage only while the coordinator has not released
    the parameter (partition_parameters.py free_param swaps param.data for an empty tensor, which frees
    the storage under the saved leaf too); which ones are live is the coordinator replay's
    (gathered.z3_moments, Z3Live.saved)."""
    acts: dict[str, int] = {}
    held: dict[str, int] = {}
    per = layer_activations(model, mbs, w)
    if checkpointing:
        # CheckpointFunction.forward: no grad inside; ctx keeps the layer input (the residual stream,
        # w) and two CPU RNG states
        for i in range(model.layers):
            held[f"layer {i} input (ctx.deepspeed_saved_tensors)"] = w * mbs * model.seq_len * model.hidden
            held[f"layer {i} rng states"] = 2 * CPU_RNG_STATE
    else:
        for i in range(model.layers):
            for k, v in per.items():
                acts[f"layer {i} {k}"] = v
    acts.update(head_activations(model, mbs, w))
    return acts, held


def most_live_activations(model: ModelShape, mbs: int, w: int, checkpointing: bool) -> int:
    """The most activation bytes (autograd-saved tensors, as the probe names them) live at once in a
    micro-batch: without checkpointing, everything the forward saved, at its end; with it, the larger
    of the forward's end (the head's saves only: the checkpointed layers save nothing) and the
    recompute of one layer in backward (CheckpointFunction.backward reruns the layer with grad: its
    saves, the batch; the head's saves were freed by its backward before)."""
    acts, _ = saved_activations(model, mbs, w, checkpointing)
    if not checkpointing:
        return sum(acts.values())
    layer = sum(layer_activations(model, mbs, w).values())
    return max(sum(acts.values()), layer + batch_bytes(model, mbs))


def per_kind(acts: dict[str, int], layers: int) -> dict[str, int]:
    """saved_activations' names with the identical layers folded: "layers x4 attention" etc."""
    out: dict[str, int] = {}
    for k, v in acts.items():
        if k.startswith("layer "):
            k = f"layers x{layers} " + k.split(" ", 2)[2]
        out[k] = out.get(k, 0) + v
    return out
