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

from typing import NamedTuple

from ledger.dtypes import FP32, INT64
from ledger.model import ModelShape


class Dispatch(NamedTuple):
    """What a DeepSpeed-MoE layer's saves depend on beyond the model: the expert-parallel size and the
    capacity C (rows per expert a micro-batch dispatches: moe.py capacity)."""
    ep: int
    capacity: int

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


def batch_bytes(model: ModelShape, mbs: int, sp: int = 1) -> int:
    """launchers/data.py batch: a randint of (mbs, seq + 1) int64, tokens = t[:, :-1].contiguous() and
    labels = t[:, 1:].contiguous(): views of it at one sample (already contiguous), two copies of
    (mbs, seq) and the randint freed above (the embedding saves the tokens, nll_loss the labels).
    DeepSpeed-Ulysses (sp > 1, model.seq_len the rank's slice): the batch is the whole sequence's, each
    rank's slice tokens[:, piece].contiguous() (launchers/deepspeed.py): a view at one sample, else
    two more copies of (mbs, seq) beside the whole ones the loop holds."""
    whole = model.seq_len * sp
    if mbs == 1:
        return INT64 * (whole + 1)
    return 2 * INT64 * mbs * whole + (2 * INT64 * mbs * model.seq_len if sp > 1 else 0)


def layer_activations(model: ModelShape, mbs: int, w: int, layer: int | None = None,
                      dispatch: Dispatch | None = None, sp: int = 1) -> dict[str, int]:
    """Bytes one Block's forward saves for backward (launchers/llama.py Block), w: model dtype bytes;
    an MoE layer (`layer` one of model.is_moe_layer's) its DeepSpeed-MoE layer's (moe_saves).
    DeepSpeed-Ulysses (sp > 1, model.seq_len the rank's slice): DistributedAttention's output
    all-to-all makes wo's input, a tensor of its own (single_all_to_all's empty_like) beside the one
    SDPA saves: one more [b, s, heads, d] (measured: the probe's census)."""
    if layer is not None and model.is_moe_layer(layer):
        if dispatch is None:
            raise ValueError(f"layer {layer} is an MoE layer: its saves need the dispatch (ep, capacity)")
        dense = layer_activations(model, mbs, w)
        # the ffn_norm's output is saved by no op of the MoE layer (the gate casts it, the encode
        # concatenates it: neither saves it), unlike a FeedForward's Linears
        return {"attention_norm": dense["attention_norm"], "attention": dense["attention"],
                "ffn_norm": dense["ffn_norm"] - w * mbs * model.seq_len * model.hidden,
                **moe_saves(model, mbs, w, dispatch)}
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
        "attention": 4 * FP32 * s * (d // 2) + 4 * w * b * s * H * d + FP32 * b * H * s
        + (w * b * s * H * d if sp > 1 else 0),
        "ffn_norm": norm,
        # FeedForward: w1(x) saved by silu, silu's output and w3(x) by the mul, the product by w2
        "feed_forward": 4 * w * b * s * f,
    }


def moe_saves(model: ModelShape, mbs: int, w: int, d: Dispatch) -> dict[str, int]:
    """What one DeepSpeed-MoE layer (deepspeed/moe/sharded_moe.py MOELayer around moe/experts.py Experts
    of launchers/llama.py FeedForward) saves for backward, by part, measured with saved_tensors_hooks
    on a layer and in the probe's census. S = mbs x seq tokens, E experts, C capacity, k the top-k."""
    S, E, C, h, k = mbs * model.seq_len, model.num_experts, d.capacity, model.hidden, model.moe_router_topk
    f, local = model.expert_ffn, model.num_experts // d.ep
    # TopKGate.forward: linear(input.float(), wg.weight.float()) saves both fp32 operands; softmax
    # its output (gates [S, E]); l_aux's me * ce saves ce ([E] fp32)
    gate = FP32 * E * h + FP32 * S * h + FP32 * S * E + FP32 * E
    if k == 1:
        # top1gating: (gates * mask1).sum(1) saves mask1 (int64 one-hot [S, E])
        gate += INT64 * S * E
    else:
        # top2gating: the einsums "se,se->s" save mask1 and mask2 as fp32 [S, E]; clamp saves the
        # denominator, the in-place divisions the clamped one and clones of the two gate values ([S]
        # fp32 each); the gates' stack ([k, S] fp32) is the combine's. (masked_fill's bool mask dies with
        # logits_except1, whose only use is an argmax: no backward reaches it)
        gate += 2 * FP32 * S * E + 4 * FP32 * S
    # _sparse_encode: index_select saves its index, the source token of every slot (int64 [E*C + 1])
    encode = INT64 * (E * C + 1)
    # Experts: each local expert's chunk [ep, 1, C, h] of the all-to-all's output. With one local
    # expert or ep 1 the chunk is contiguous: w1 and w3 save a view of the one dispatched buffer
    # (E x C rows); else each Linear's matmul reshapes it into its own copy (ep x C rows), w1's and
    # w3's. Then silu saves w1's output, the mul silu's and w3's, w2 the product ([ep*C, f] each)
    copies = 1 if d.ep == 1 or local == 1 else 2
    experts = copies * w * E * C * h + 4 * w * E * C * f
    # _sparse_decode: index_select saves the slots (int64 [k*S]); routed * gates saves the routed
    # rows ([k, S, h], the model dtype) and the gates ([k, S, 1] fp32)
    combine = INT64 * k * S + w * k * S * h + FP32 * k * S
    return {"moe gate": gate, "moe dispatch (encode)": encode, "moe experts": experts, "moe combine": combine}


def recomputed_aux(model: ModelShape, mbs: int, w: int) -> tuple[int, int]:
    """What one checkpointed MoE layer's recompute leaves behind (deepspeed.checkpointing.checkpoint:
    CheckpointFunction.backward reruns the layer with grad), (activations, temporaries):
    launchers/llama.py Block keeps the recomputed l_aux (self.aux_loss), whose graph no backward runs
    (the loss holds the forward's, made without grad); its saved ce ([E] fp32), and once the layer's
    backward ran, the AccumulateGrad at its root: the layer's detached input with the gradient the
    backward accumulated into it ([b, s, h] each), live until the layer's next forward replaces
    aux_loss (measured: the probe's census at the epilogue and in the backward)."""
    return FP32 * model.num_experts, 2 * w * mbs * model.seq_len * model.hidden


def ffn_saves(per: dict[str, int]) -> int:
    """A block's FFN saves in layer_activations' dict: the FeedForward's or the MoE layer's parts."""
    return per.get("feed_forward", 0) + sum(v for k, v in per.items() if k.startswith("moe "))


def head_activations(model: ModelShape, mbs: int, w: int, sp: int = 1) -> dict[str, int]:
    """The final norm, the output Linear's input, the cross-entropy in fp32 and the batch."""
    b, s = mbs, model.seq_len
    bsh = b * s * model.hidden
    return {
        "norm": FP32 * bsh + FP32 * b * s + 2 * w * bsh,
        # F.cross_entropy(logits.float()): log_softmax saves its fp32 output; nll_loss saves it, the
        # labels and total_weight (an fp32 scalar)
        "log_softmax (fp32)": FP32 * b * s * model.vocab,
        "nll_loss total_weight": FP32,
        "batch (tokens, labels)": batch_bytes(model, mbs, sp),
    }


def saved_activations(model: ModelShape, mbs: int, w: int, checkpointing: bool,
                      dispatch: Dispatch | None = None, sp: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(activations, temporaries held for backward) at the end of one micro-batch's forward, named.
    ZeRO-3's gathered weights that mm saves are not among them: mm saves the Parameter itself (a
    leaf), so the saved tensor holds the gathered storage only while the coordinator has not released
    the parameter (partition_parameters.py free_param swaps param.data for an empty tensor, which frees
    the storage under the saved leaf too); which ones are live is the coordinator replay's
    (gathered.z3_moments, Z3Live.saved)."""
    acts: dict[str, int] = {}
    held: dict[str, int] = {}
    if checkpointing:
        # CheckpointFunction.forward: no grad inside; ctx keeps the layer input (the residual stream,
        # w) and two CPU RNG states
        for i in range(model.layers):
            held[f"layer {i} input (ctx.deepspeed_saved_tensors)"] = w * mbs * model.seq_len * model.hidden
            held[f"layer {i} rng states"] = 2 * CPU_RNG_STATE
    else:
        for i in range(model.layers):
            for k, v in layer_activations(model, mbs, w, i, dispatch, sp).items():
                acts[f"layer {i} {k}"] = v
    acts.update(head_activations(model, mbs, w, sp))
    return acts, held


def most_live_activations(model: ModelShape, mbs: int, w: int, checkpointing: bool,
                          dispatch: Dispatch | None = None, sp: int = 1) -> int:
    """The most activation bytes (autograd-saved tensors, as the probe names them) live at once in a
    micro-batch: without checkpointing, everything the forward saved, at its end; with it, the larger
    of the forward's end (the head's saves only: the checkpointed layers save nothing) and the
    recompute of one layer in backward (CheckpointFunction.backward reruns the layer with grad: its
    saves, the batch; the head's saves were freed by its backward before)."""
    acts, _ = saved_activations(model, mbs, w, checkpointing, dispatch, sp)
    if not checkpointing:
        return sum(acts.values())
    layer = max(sum(layer_activations(model, mbs, w, i, dispatch, sp).values()) for i in range(model.layers))
    return max(sum(acts.values()), layer + batch_bytes(model, mbs, sp))


def per_kind(acts: dict[str, int]) -> dict[str, int]:
    """saved_activations' names with the layers folded by kind: "layers x4 attention" etc. (an MoE
    model's MoE parts under the number of MoE layers)."""
    out: dict[str, int] = {}
    count: dict[str, int] = {}
    for k, v in acts.items():
        if k.startswith("layer "):
            k = k.split(" ", 2)[2]
            count[k] = count.get(k, 0) + 1
            k = f"layer {k}"
        out[k] = out.get(k, 0) + v
    return {f"layers x{count[k[6:]]} {k[6:]}" if k.startswith("layer ") else k: v for k, v in out.items()}
