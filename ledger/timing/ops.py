"""The work of one micro-batch through a Llama-style decoder, op by op, and each op's time on a profile.

Per decoder layer on a rank (T tokens of the micro-batch on it: micro_batch x seq / cp; Ts = T / tp
where sequence parallelism shards the norms and residual adds), forward:
  GEMMs      qkv [T, h] x [h, (heads + 2 kv_heads) d / tp], proj [T, heads d / tp] x [.., h],
             fc1 [T, h] x [h, 2 f / tp] (SwiGLU's gate and up), fc2 [T, f / tp] x [.., h]; where the
             framework runs the projections as separate linears (torchtitan's and the plain Llama's
             wq wk wv, w1 w3: Shard.split_projections) each is its own GEMM, as the SAC policy counts them
  attention  Q K^T and P V over heads / tp heads: 4 b s^2 (heads d) / tp FLOPs, halved by a causal
             kernel that skips the masked blocks (flash / cuDNN / TE fused / FlexAttention on CUDA),
             whole with the CPU's SDPA math kernel (dense masks, s x s scores) and Megatron's local
             spec - the kernel is the policy's, and its efficiency the profile's (attention_efficiency)
  memory     two RMSNorms and two residual adds over Ts x h, RoPE over q and k, SwiGLU's product over
             T x f / tp, (CPU math attention: the s x s scores' softmax), a GQA K/V repeat where the
             model repeats them - bytes read and written per element as the framework's kernels move
             them (Shard.kernel_bytes, its TimePolicy's; fused_bytes where one fused kernel reads each
             input and writes each output once)
Backward: every GEMM twice (the input's grad and the weight's), attention 2.5 x its forward (flash:
five matmuls to the forward's two), the memory-bound ops their kernel_bytes' backward. The head: the
final norm, the output GEMM [T, h] x [h, V / tp] and the cross-entropy over T x V / tp in fp32.

A GEMM's time on a profile (from sources until calibrated): its FLOPs at gemm_efficiency x peak,
divided by the wave quantization's utilisation (ceil(M / tm) ceil(N / tn) tiles over the SMs in whole
waves), or its bytes at memory_efficiency x HBM when that is longer, plus a kernel's fixed cost. A
calibrated profile's measured table (the shape's own, or the nearest by FLOPs of the dtype) replaces
the model. An attention kernel runs at the profile's attention_efficiency for it (forward and
backward), or at the GEMM's efficiency where the profile names none (the local spec's and the CPU's
batched matmuls)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ledger.timing.hardware import Profile


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # gemm | attention | memory
    flops: float = 0.0
    bytes: float = 0.0
    mnk: tuple = ()  # a GEMM's (M, N, K)
    dtype: str = "bf16"
    kernel: str = ""  # an attention op's kernel (hardware.ATTENTION_KERNELS)
    backward: bool = False
    bwd_bytes: float = -1.0  # a memory-bound op's backward bytes (< 0: twice its forward's)


# bytes per element (forward, backward) of each memory-bound op when one fused kernel reads every input
# and writes every output once, at w bytes an activation: a norm reads x and writes y (its backward
# reads x and the grad, writes the grad: twice), RoPE reads and writes q / k, SwiGLU reads gate and up
# and writes their product (over the ffn elements), a residual add reads two and writes one; the
# cross-entropy reads the bf16 logits and streams three fp32 passes (softmax, loss, grad). Megatron's
# TransformerEngine spec runs such kernels (TE's fused RoPE, bias_swiglu, the norms in LayerNormLinear).
def fused_bytes(w: int) -> dict:
    return {"norm": (2 * w, 4 * w), "rope": (2 * w, 4 * w), "swiglu": (3 * w, 6 * w), "gelu": (2 * w, 4 * w),
            "residual_add": (3 * w, 6 * w), "cross_entropy": (w + 12, 2 * (w + 12))}


# an RMSNorm run as eager fp32 ops (HF's LlamaRMSNorm, the DeepSpeed Llama's, the torchtitan of 2024's
# "rmsnorm"): x.float() reads 2 and writes 4 bytes, pow 4 and 4, mean reads 4, the product with rsqrt 4
# and 4, type_as 4 and 2, the weight's product 2 and 2: 36 bytes an element forward; backward twice that
EAGER_FP32_RMSNORM_BYTES = (36, 72)


def gemm(name: str, m: int, n: int, k: int, w: int, dtype: str = "bf16") -> Op:
    return Op(name, "gemm", 2.0 * m * n * k, float(w * (m * k + k * n + m * n)), (m, n, k), dtype)


def op_seconds(op: Op, p: Profile) -> float:
    """One op's time on profile p (module docstring)."""
    mem = op.bytes / (p.hbm_gbps * 1e9 * p.memory_efficiency)
    if op.kind == "memory":
        return mem + p.kernel_overhead_s
    if op.kind == "attention":
        rate = p.peak(op.dtype) * attention_efficiency(p, op.kernel, op.backward)
    else:
        rate = _table_rate(op, p) if p.gemm_table else None
        if rate is None:
            rate = p.peak(op.dtype) * p.gemm_efficiency * _wave_utilisation(op, p)
    return max(op.flops / rate, mem) + p.kernel_overhead_s


def attention_efficiency(p: Profile, kernel: str, backward: bool) -> float:
    """The fraction of the peak an attention kernel reaches on p (its forward or backward): the
    profile's figure for the kernel (hardware.py, each from its source), else the GEMMs' (batched
    matmuls: the local spec's and the CPU's attention, or a device no source gives a figure for)."""
    eff = p.attention_efficiency.get(kernel)
    return p.gemm_efficiency if eff is None else eff[1 if backward else 0]


def _wave_utilisation(op: Op, p: Profile) -> float:
    if not p.sms or op.kind != "gemm":
        return 1.0
    m, n, _k = op.mnk
    tiles = math.ceil(m / p.gemm_tile[0]) * math.ceil(n / p.gemm_tile[1])
    waves = math.ceil(tiles / p.sms)
    return tiles / (waves * p.sms)


def _table_rate(op: Op, p: Profile) -> float | None:
    """A calibrated profile's FLOP/s for the shape: its own entry, else the nearest by FLOPs (log)."""
    rows = [(k, v) for k, v in p.gemm_table if (len(k) < 4 or k[3] == op.dtype)]
    if not rows:
        return None
    for k, v in rows:
        if tuple(k[:3]) == tuple(op.mnk):
            return v * 1e12
    target = math.log(max(op.flops, 1.0))
    k, v = min(rows, key=lambda kv: abs(math.log(2.0 * kv[0][0] * kv[0][1] * kv[0][2]) - target))
    return v * 1e12


@dataclass(frozen=True)
class Shard:
    """What one rank computes of a micro-batch: the model's shape over tp (and cp), the attention kernel."""
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    seq: int  # the rank's sequence (seq / cp)
    micro_batch: int
    tp: int
    sp: bool
    causal_kernel: bool  # flash-style: masked blocks skipped
    w: int = 2  # activation bytes
    swiglu: bool = True  # SwiGLU's gate and up in fc1; else one fc1 of ffn and a GeLU
    cp: int = 1  # context parallel: the rank's queries (seq) attend to the whole sequence (seq x cp keys)
    attention_kernel: str = "flash2"  # which kernel runs attention (hardware.ATTENTION_KERNELS)
    split_projections: bool = False  # wq wk wv and w1 w3 separate linears (each its own GEMM)
    # of split projections, q k v fused into one wqkv GEMM whose output is split into contiguous q, k, v
    # (torchtitan's fuse_qkv: models/common/attention.py FusedQKVLinear; w1 w3 stay separate)
    fused_qkv: bool = False
    repeat_kv: bool = False  # GQA's K and V repeated to the query heads before attention (a copy)
    # memory-bound op -> (forward, backward) bytes per element, where the framework's kernels move more
    # than one fused kernel (fused_bytes); its TimePolicy's, each entry citing the code it counts
    kernel_bytes: tuple = ()
    # an MoE layer's feed-forward (moe_layer_forward): routed experts, top-k, one expert's width, the
    # shared expert's width (0: none), expert parallel and expert tensor parallel degrees
    num_experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    ep: int = 1
    etp: int = 1
    # a capacity-padded dispatch: each expert computes max(ceil(balanced x factor), min_capacity) rows
    capacity_factor: float = 1.0
    min_capacity: int = 0

    def bytes_per_element(self, op: str) -> tuple:
        return dict(self.kernel_bytes).get(op) or fused_bytes(self.w)[op]


def _memory(s: Shard, name: str, kind: str, elements: float) -> Op:
    """A memory-bound op over `elements`, its bytes as the framework's kernels move them (kind: the
    kernel_bytes entry)."""
    fwd, bwd = s.bytes_per_element(kind)
    return Op(name, "memory", bytes=float(fwd) * elements, bwd_bytes=float(bwd) * elements)


def layer_forward(s: Shard) -> list[Op]:
    T = s.micro_batch * s.seq
    Ts = T // s.tp if s.sp else T
    h, d, tp, w = s.hidden, s.head_dim, s.tp, s.w
    q, kv = s.heads * d // tp, s.kv_heads * d // tp
    f = s.ffn // tp
    # the rank's queries against every key: with CP the load-balanced chunks give each rank 1/cp of the
    # whole sequence's attention
    attn_flops = 4.0 * s.micro_batch * s.seq * (s.seq * s.cp) * (s.heads * d // tp) * (0.5 if s.causal_kernel else 1.0)
    if s.split_projections:
        # fused: one GEMM, then FusedQKVLinear._split's reshape(...).contiguous() copies q, k and v out of its
        # strided output (a read and a write of each element; backward: the grads' cat, the same again)
        qkv = ([gemm("qkv", T, q + 2 * kv, h, w),
                Op("qkv_split", "memory", bytes=float(2 * w * T * (q + 2 * kv)), bwd_bytes=float(2 * w * T * (q + 2 * kv)))]
               if s.fused_qkv else [gemm("q", T, q, h, w), gemm("k", T, kv, h, w), gemm("v", T, kv, h, w)])
        fc1 = [gemm("w1", T, f, h, w), gemm("w3", T, f, h, w)] if s.swiglu else [gemm("w1", T, f, h, w)]
    else:
        qkv, fc1 = [gemm("qkv", T, q + 2 * kv, h, w)], [gemm("fc1", T, (2 if s.swiglu else 1) * f, h, w)]
    # a repeat_interleave of K and V to the query heads reads them and writes query-sized copies (its
    # backward sums the copies back)
    repeat = ([Op("kv_repeat", "memory", bytes=float(w * T * 2 * (kv + q)), bwd_bytes=float(w * T * 2 * (kv + q)))]
              if s.repeat_kv and q != kv else [])
    ops = [_memory(s, "attention_norm", "norm", Ts * h),
           *qkv,
           _memory(s, "rope", "rope", T * (q + kv)),
           *repeat,
           Op("attention", "attention", attn_flops,
              float(w * T * (2 * q + 2 * kv))
              + (0.0 if s.causal_kernel else 3.0 * 4 * s.micro_batch * (s.heads // tp) * s.seq * s.seq * s.cp),
              kernel=s.attention_kernel),
           gemm("proj", T, h, q, w),
           _memory(s, "residual_add", "residual_add", Ts * h),
           _memory(s, "ffn_norm", "norm", Ts * h),
           *fc1,
           _memory(s, "swiglu", "swiglu", T * f) if s.swiglu else _memory(s, "gelu", "gelu", T * f),
           gemm("fc2", T, h, f, w),
           _memory(s, "residual_add", "residual_add", Ts * h)]
    return ops


def moe_layer_forward(s: Shard) -> list[Op]:
    """An MoE decoder layer: attention as layer_forward's, then the router and the routed experts in
    place of the dense feed-forward, with routing balanced (each expert the same tokens; the comm
    ledger's EP rows carry the dispatch's all-to-alls or all-gathers, timed as exposed collectives).

    Per rank: its T tokens' router GEMM [Ts, h] x [h, E] (the MoE layer's input is the SP shard), the
    permutation of the T x topk routed copies into the experts' order and back (a read and a write of
    [.., h] each way), and the E / ep local experts as grouped GEMMs. Every rank of a stage does an
    equal share of the experts' work when routing is balanced (Megatron's expert layout tp x cp x dp =
    etp x ep x edp; torchtitan's ep inside dp x cp): R = T topk / tp routed copies per rank, M = R etp
    ep / E tokens per local expert over ffn / etp columns; stacked as one GEMM of E / ep x M rows (a
    grouped GEMM's tiles over the SMs). A capacity-padded dispatch (DeepSpeed's gate; Megatron's
    pad_expert_input_to_capacity) computes each expert's capacity, max(ceil(M x capacity_factor),
    min_capacity) rows. The shared expert is a dense SwiGLU of shared_ffn / tp."""
    dense = layer_forward(s)
    cut = next(i for i, op in enumerate(dense) if op.name == "ffn_norm") + 1
    T = s.micro_batch * s.seq
    Ts = T // s.tp if s.sp else T
    h, w = s.hidden, s.w
    local = s.num_experts // s.ep
    routed = T * s.topk // s.tp
    per_expert = max(math.ceil(routed * s.etp * s.ep / s.num_experts * s.capacity_factor), s.min_capacity, 1)
    rows = local * per_expert  # E / ep experts x M tokens each
    f = s.expert_ffn // s.etp
    ops = [gemm("router", Ts, s.num_experts, h, w),
           Op("permute", "memory", bytes=float(2 * w * routed * s.etp * h), bwd_bytes=float(2 * w * routed * s.etp * h)),
           gemm("expert_w1", rows, f, h, w), gemm("expert_w3", rows, f, h, w) if s.swiglu else None,
           _memory(s, "expert_swiglu", "swiglu", rows * f) if s.swiglu else _memory(s, "expert_gelu", "gelu", rows * f),
           gemm("expert_w2", rows, h, f, w),
           Op("unpermute", "memory", bytes=float(2 * w * routed * s.etp * h), bwd_bytes=float(2 * w * routed * s.etp * h))]
    if s.shared_ffn:
        fs = s.shared_ffn // s.tp
        ops += [gemm("shared_w1", T, fs, h, w), gemm("shared_w3", T, fs, h, w),
                _memory(s, "shared_swiglu", "swiglu", T * fs), gemm("shared_w2", T, h, fs, w)]
    ops.append(_memory(s, "residual_add", "residual_add", Ts * h))
    return dense[:cut] + [op for op in ops if op is not None]


def backward_of(ops: list[Op]) -> list[Op]:
    """The backward's ops: a GEMM's two (input grad, weight grad), attention 2.5 x, memory-bound ops
    their backward bytes."""
    out = []
    for op in reversed(ops):
        if op.kind == "gemm":
            m, n, k = op.mnk
            w = op.bytes / (m * k + k * n + m * n)
            out += [Op(op.name + ".dgrad", "gemm", op.flops, w * (m * n + n * k + m * k), (m, k, n), op.dtype),
                    Op(op.name + ".wgrad", "gemm", op.flops, w * (m * k + m * n + k * n), (k, n, m), op.dtype)]
        elif op.kind == "attention":
            out.append(Op(op.name + ".backward", "attention", 2.5 * op.flops, 2.0 * op.bytes, kernel=op.kernel,
                          backward=True))
        else:
            out.append(Op(op.name + ".backward", "memory", bytes=op.bwd_bytes if op.bwd_bytes >= 0 else 2.0 * op.bytes))
    return out


def head_forward(s: Shard) -> list[Op]:
    T = s.micro_batch * s.seq
    Ts = T // s.tp if s.sp else T
    v = s.vocab // s.tp
    return [_memory(s, "final_norm", "norm", Ts * s.hidden),
            gemm("output", T, v, s.hidden, s.w),
            # the logits cast to fp32, their softmax and the loss: read bf16, write fp32, read it twice
            _memory(s, "cross_entropy", "cross_entropy", T * v)]


def seconds(ops: list[Op], p: Profile) -> float:
    return sum(op_seconds(op, p) for op in ops)


def split(ops: list[Op], p: Profile) -> dict[str, float]:
    """Time by kind (gemm, attention, memory) and the same work at the peak (ideal: FLOPs / peak)."""
    out = {"gemm": 0.0, "attention": 0.0, "memory": 0.0, "ideal": 0.0}
    for op in ops:
        out[op.kind] += op_seconds(op, p)
        out["ideal"] += op.flops / p.peak(op.dtype)
    return out
