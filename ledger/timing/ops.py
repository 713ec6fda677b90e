"""The work of one micro-batch through a Llama-style decoder, op by op, and each op's time on a profile.

Per decoder layer on a rank (T tokens of the micro-batch on it: micro_batch x seq / cp; Ts = T / tp
where sequence parallelism shards the norms and residual adds), forward:
  GEMMs      qkv [T, h] x [h, (heads + 2 kv_heads) d / tp], proj [T, heads d / tp] x [.., h],
             fc1 [T, h] x [h, 2 f / tp] (SwiGLU's gate and up), fc2 [T, f / tp] x [.., h]
  attention  Q K^T and P V over heads / tp heads: 4 b s^2 (heads d) / tp FLOPs, halved by a causal
             kernel that skips the masked blocks (flash / cuDNN / TE fused on CUDA), whole with the
             CPU's SDPA math kernel (dense masks, s x s scores) - the kernel is the policy's
  memory     two RMSNorms and two residual adds over Ts x h, RoPE over q and k, SwiGLU's product over
             T x f / tp, (CPU math attention: the s x s scores' softmax) - bytes read and written
Backward: every GEMM twice (the input's grad and the weight's), attention 2.5 x its forward (flash:
five matmuls to the forward's two), the memory-bound ops twice their forward bytes. The head: the final
norm, the output GEMM [T, h] x [h, V / tp] and the cross-entropy over T x V / tp in fp32.

A GEMM's time on a profile (from sources until calibrated): its FLOPs at gemm_efficiency x peak,
divided by the wave quantization's utilisation (ceil(M / tm) ceil(N / tn) tiles over the SMs in whole
waves), or its bytes at memory_efficiency x HBM when that is longer, plus a kernel's fixed cost. A
calibrated profile's measured table (the shape's own, or the nearest by FLOPs of the dtype) replaces
the model."""
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


def gemm(name: str, m: int, n: int, k: int, w: int, dtype: str = "bf16") -> Op:
    return Op(name, "gemm", 2.0 * m * n * k, float(w * (m * k + k * n + m * n)), (m, n, k), dtype)


def op_seconds(op: Op, p: Profile) -> float:
    """One op's time on profile p (module docstring)."""
    mem = op.bytes / (p.hbm_gbps * 1e9 * p.memory_efficiency)
    if op.kind == "memory":
        return mem + p.kernel_overhead_s
    rate = _table_rate(op, p) if p.gemm_table and op.kind == "gemm" else None
    if rate is None:
        rate = p.peak(op.dtype) * p.gemm_efficiency * _wave_utilisation(op, p)
    return max(op.flops / rate, mem) + p.kernel_overhead_s


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


def layer_forward(s: Shard) -> list[Op]:
    T = s.micro_batch * s.seq
    Ts = T // s.tp if s.sp else T
    h, d, tp, w = s.hidden, s.head_dim, s.tp, s.w
    q, kv = s.heads * d // tp, s.kv_heads * d // tp
    f = s.ffn // tp
    # the rank's queries against every key: with CP the load-balanced chunks give each rank 1/cp of the
    # whole sequence's attention
    attn_flops = 4.0 * s.micro_batch * s.seq * (s.seq * s.cp) * (s.heads * d // tp) * (0.5 if s.causal_kernel else 1.0)
    ops = [Op("attention_norm", "memory", bytes=2.0 * Ts * h * w),
           gemm("qkv", T, q + 2 * kv, h, w),
           Op("rope", "memory", bytes=2.0 * T * (q + kv) * w),
           Op("attention", "attention", attn_flops,
              float(w * T * (2 * q + 2 * kv))
              + (0.0 if s.causal_kernel else 3.0 * 4 * s.micro_batch * (s.heads // tp) * s.seq * s.seq * s.cp)),
           gemm("proj", T, h, q, w),
           Op("residual_add", "memory", bytes=3.0 * Ts * h * w),
           Op("ffn_norm", "memory", bytes=2.0 * Ts * h * w),
           gemm("fc1", T, (2 if s.swiglu else 1) * f, h, w),
           Op("swiglu" if s.swiglu else "gelu", "memory", bytes=(3.0 if s.swiglu else 2.0) * T * f * w),
           gemm("fc2", T, h, f, w),
           Op("residual_add", "memory", bytes=3.0 * Ts * h * w)]
    return ops


def backward_of(ops: list[Op]) -> list[Op]:
    """The backward's ops: a GEMM's two (input grad, weight grad), attention 2.5 x, memory-bound 2 x."""
    out = []
    for op in reversed(ops):
        if op.kind == "gemm":
            m, n, k = op.mnk
            w = op.bytes / (m * k + k * n + m * n)
            out += [Op(op.name + ".dgrad", "gemm", op.flops, w * (m * n + n * k + m * k), (m, k, n), op.dtype),
                    Op(op.name + ".wgrad", "gemm", op.flops, w * (m * k + m * n + k * n), (k, n, m), op.dtype)]
        elif op.kind == "attention":
            out.append(Op(op.name + ".backward", "attention", 2.5 * op.flops, 2.0 * op.bytes))
        else:
            out.append(Op(op.name + ".backward", "memory", bytes=2.0 * op.bytes))
    return out


def head_forward(s: Shard) -> list[Op]:
    T = s.micro_batch * s.seq
    Ts = T // s.tp if s.sp else T
    v = s.vocab // s.tp
    return [Op("final_norm", "memory", bytes=2.0 * Ts * s.hidden * s.w),
            gemm("output", T, v, s.hidden, s.w),
            # the logits cast to fp32, their softmax and the loss: read bf16, write fp32, read it twice
            Op("cross_entropy", "memory", bytes=float(T * v * (s.w + 3 * 4)))]


def seconds(ops: list[Op], p: Profile) -> float:
    return sum(op_seconds(op, p) for op in ops)


def split(ops: list[Op], p: Profile) -> dict[str, float]:
    """Time by kind (gemm, attention, memory) and the same work at the peak (ideal: FLOPs / peak)."""
    out = {"gemm": 0.0, "attention": 0.0, "memory": 0.0, "ideal": 0.0}
    for op in ops:
        out[op.kind] += op_seconds(op, p)
        out["ideal"] += op.flops / p.peak(op.dtype)
    return out
