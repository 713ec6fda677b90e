"""What one TransformerBlock of torchtitan 0.3.0's MoE model (qwen3: models/qwen3, models/common/moe.py,
models/common/token_dispatcher.py) saves for backward, without activation checkpointing (the MoE ledger
refuses it), TP, CP or PP. The dense peak's moments (peak.py) hold these in place of the llama3 block's
(peak.saved_per_layer asks here for an MoE shape). Paths under torchtitan/ unless said.

Measured with the peak probe's census (tests/test_titan_moe.py, s = 512): every line below, per layer.

The attention (models/common/attention.py with qwen3's CosSinRoPE):
- the two RMSNorms as the llama3 block's (peak.saved_per_layer);
- q_norm / k_norm (model.qk_layernorm: RMSNorm over head_dim of q [T, heads, head_dim] and k): on the
  CPU the composite's fp32 upcast and x * rsqrt (T*q*4 each) and rsqrt (T*heads*4), k's alike; with the
  fused kernel (CUDA) the bf16 input and rstd;
- CosSinRoPE (models/common/rope.py) saves the cache rows it indexed, [T, 2*head_dim] fp32 (cos and
  sin: twice llama3's complex rows), and casts q and k back to bf16 (saved by the attention);
- v, the attention's mask, output and logsumexp as the llama3 block's.

The MoE layer (moe.py MoE.forward), T tokens, top-k, N = T*k routed rows, R the rows this rank's experts
compute (N without EP; with EP what the dispatch all-to-all brings, balanced N):
- TokenChoiceTopKRouter: the gate runs under torch.autocast(dtype=float32). CPU autocast refuses float32
  (torch/amp/autocast_mode.py: "CPU Autocast only supports dtypes of torch.bfloat16, torch.float16",
  disabled), so on the CPU the router is bf16: the gate saves ffn_norm's bf16 output (counted with the
  norm) and the scores are bf16. CUDA autocast accepts it: the gate saves an fp32 copy of its input
  [T, hidden] and of its weight [E, hidden], and the scores are fp32 (from sources). Then softmax's
  output [T, E], topk's indices (int64 [T, k]), gather's output [T, k], and route_norm's denominator
  [T, 1] (qwen3: score_func softmax, route_norm True; the division saves both);
- the dispatcher's _local_reorder: argsort's indices and their `// top_k` (int64 [N] each), the sorted
  scores [N] (router dtype); the routed input x[token indices] is saved only without EP (with EP the
  all-to-all's output, permuted by `routed_input_RD[permuted_indices]`, is, with permuted_indices,
  int64 [R]);
- GroupedExperts: torch._grouped_mm's outputs of w1 and w3, silu's, the product (bf16 [R, F] each), the
  routed input (bf16 [R, hidden]), the int32 offsets [E/ep];
- combine: the expert outputs made fp32 [N, hidden] (multiplied by the scores: the mul saves it); the
  scatter_add saves only its index.
"""
from __future__ import annotations

from ledger.dtypes import BF16, FP32 as F32, INT64 as I64
from ledger.faithful.titan.target import Rules

INT32 = 4


def rms_norm_saves(rows: int, width: int, rules: Rules) -> int:
    """An nn.RMSNorm over `width` of `rows` bf16 vectors, without its output: the CPU composite's fp32 upcast,
    rsqrt and x * rsqrt, or the fused kernel's bf16 input and fp32 rstd."""
    if rules.fused_rms_norm:
        return rows * width * BF16 + rows * F32
    return 2 * rows * width * F32 + rows * F32


def attention_saves(model, B: int, S: int, rules: Rules) -> dict[str, int]:
    """qwen3's attention half of a block (its two RMSNorms with their bf16 outputs), named."""
    T, h, hd = B * S, model.hidden, model.head_dim
    q, kv = model.heads * hd, model.kv_heads * hd
    parts = {"2 rmsnorms": 2 * (rms_norm_saves(T, h, rules) + T * h * BF16)}
    if model.qk_layernorm:
        parts["q_norm, k_norm"] = rms_norm_saves(T * model.heads, hd, rules) + \
            rms_norm_saves(T * model.kv_heads, hd, rules)
    parts.update({"CosSinRoPE cache rows (fp32 cos, sin)": T * 2 * hd * F32, "q after rope": T * q * BF16,
                  "v": T * kv * BF16, "k after rope": T * kv * BF16,
                  "sdpa mask (bf16)": B * S * S * BF16 if rules.dense_mask else 0,
                  "sdpa out + logsumexp": T * q * BF16 + rules.attention_stats * B * model.heads * S * F32})
    return parts


def router_bytes(rules: Rules) -> int:
    """The router's element size (the module docstring: fp32 where autocast(float32) runs)."""
    return F32 if rules.router_fp32 else BF16


def moe_saves(model, T: int, ep: int, rows: int, rules: Rules) -> dict[str, int]:
    """One MoE layer's saves, named, for T tokens, `rows` routed rows on this rank's E/ep experts."""
    h, E, k, F = model.hidden, model.num_experts, model.moe_router_topk, model.expert_ffn
    N, r = T * k, router_bytes(rules)
    parts: dict[str, int] = {}
    if rules.router_fp32:
        # the gate's fp32 copies of its input and weight (ffn_norm's bf16 output is then saved by none:
        # the routed input is an index of it, which keeps only the indices)
        parts["gate's fp32 input and weight (autocast)"] = T * h * F32 + E * h * F32 - T * h * BF16
    parts["router: softmax, topk indices, gathered scores, route_norm's sum"] = \
        T * E * r + T * k * I64 + T * k * r + T * r
    parts["dispatch: argsort, token indices, sorted scores"] = 2 * N * I64 + N * r
    if ep > 1:
        parts["dispatch: permuted indices (int64 [R])"] = rows * I64
    parts["experts: routed input, w1 / w3 outputs, silu, product, offsets"] = \
        rows * h * BF16 + 4 * rows * F * BF16 + E // ep * INT32
    parts["combine: expert outputs in fp32"] = N * h * F32
    return parts


def sac_kept(model, B: int, S: int, rules: Rules, ep: int = 1, rows: int | None = None) -> dict[str, int]:
    """What torchtitan's SelectiveAC keeps of one checkpointed qwen3 MoE block until its backward
    (distributed/activation_checkpoint.py: the outputs of its save ops, in the checkpoint's cache), named
    by the probe's category: every second mm of the block (wq's and wv's, or fused wqkv's; measured: the
    router's gate mm is not kept), topk's values and indices (the router), and with EP every all_to_all_single's output
    (the token counts' int64 [E], the dispatch's [R, hidden] and the combine's [T*k, hidden], bf16: a
    collective's output, `gathered`). Measured (s = 512; ep2 at world 4: block 0's, with block 1 in its
    recompute)."""
    T, h, hd, k, E = B * S, model.hidden, model.head_dim, model.moe_router_topk, model.num_experts
    rows = T * k if rows is None else rows
    # fused (ModelShape.fused_qkv), the count's first mm is wqkv: its whole output is kept
    qkv = ({"temporary/SelectiveAC: wqkv's output": T * (model.heads + 2 * model.kv_heads) * hd * BF16}
           if model.fused_qkv else
           {"temporary/SelectiveAC: wq's and wv's outputs": T * (model.heads + model.kv_heads) * hd * BF16})
    kept = {**qkv,
            # topk runs on the scores plus the fp32 expert_bias_E (moe.py: load balancing): fp32 values
            "temporary/SelectiveAC: the router's topk values (fp32) and indices": T * k * F32 + T * k * I64}
    if ep > 1:
        kept["gathered/SelectiveAC: the all-to-alls' outputs (token counts, dispatch, combine)"] = \
            E * I64 + rows * h * BF16 + T * k * h * BF16
    return kept


def block_saves(model, B: int, S: int, rules: Rules, ep: int = 1, rows: int | None = None) -> dict[str, int]:
    """One block's saves, named: attention_saves and moe_saves (rows: balanced, T*k, unless given)."""
    T = B * S
    rows = T * model.moe_router_topk if rows is None else rows
    return {**attention_saves(model, B, S, rules), **moe_saves(model, T, ep, rows, rules)}
