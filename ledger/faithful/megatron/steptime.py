"""How a Megatron Core 0.18.0 step runs, for the step-time model (ledger/timing/step.py); paths under
megatron/core/.

  schedule   pipeline_parallel/schedules.py get_forward_backward_func: no pipelining at pp = 1, 1F1B
             (forward_backward_pipelining_without_interleaving), the interleaved schedule with vp > 1
  recompute  recompute_granularity: full re-runs the checkpointed layers' forward in backward
             (transformer_block.py _checkpointed_forward); selective re-runs core attention
             (transformer/attention.py _checkpointed_attention_forward)
  attention  transformer_engine: TEDotProductAttention (TE's fused attention, cuDNN on sm80 / sm90: the
             causal mask's blocks skipped); the local spec's DotProductAttention computes the whole
             [s, s] scores (baddbmm, then the mask: batched matmuls at the GEMMs' rate)
  kernels    linear_qkv and linear_fc1 (gate and up) one GEMM each; the memory-bound ops fused (TE's
             RoPE, bias_swiglu, the norms): ops.fused_bytes
  DP         distributed/distributed_data_parallel.py: with overlap_grad_reduce the buckets' grad
             reductions start as they fill in the backward of the last micro-batch (no_sync for the
             others: training.py / schedules.py), else after the backward (finish_grad_sync); with
             overlap_param_gather the distributed optimizer's param all-gathers run in the next step's
             forward pre-hooks (distrib_optimizer.py), else in the optimizer step
  optimizer  TE's / apex's FusedAdam over the rank's fp32 master shard (12 bytes of state an element)
  CP         TE's p2p attention (cp_comm_type p2p, a2a+p2p's ring; TransformerEngine
             dot_product_attention/context_parallel.py AttnFuncWithCPAndKVP2P): each ring step waits for
             the previous exchange, issues the next one, then runs its attention chunk, so the ring runs
             behind the attention kernels and is exposed only where longer; all_gather's gathers ("KV
             all-gather between CP ranks is exposed", its docstring) and a2a's all-to-alls stand before /
             after the attention, exposed
"""
from __future__ import annotations

from ledger.timing.step import TimePolicy


def time_policy(fw, lay, device: str) -> TimePolicy:
    impl = fw.transformer_impl or ("transformer_engine" if device == "cuda" else "local")
    schedule = "none" if lay.pp == 1 else "interleaved" if lay.vp > 1 else "1f1b"
    return TimePolicy(schedule=schedule, recompute=fw.recompute_granularity or "none",
                      causal_kernel=impl == "transformer_engine",
                      attention_kernel="te_fused" if impl == "transformer_engine" else "unfused",
                      # drop-less routing unless padded to a capacity (moe/token_dispatcher.py, moe_utils.py
                      # get_capacity with moe_pad_expert_input_to_capacity)
                      expert_capacity_factor=(getattr(fw, "moe_expert_capacity_factor", None) or 1.0)
                      if getattr(fw, "moe_pad_expert_input_to_capacity", False) else 1.0,
                      dp_grad="last_backward" if fw.overlap_grad_reduce else "exposed",
                      dp_param="first_forward" if fw.overlap_param_gather else "exposed",
                      cp_ring_behind_attention=impl == "transformer_engine" and lay.cp > 1
                      and (getattr(fw, "cp_comm_type", None) or "p2p") in ("p2p", "a2a+p2p"),
                      sources=(f"megatron time policy: {schedule} schedule, attention {impl} "
                               f"({'causal blocks skipped' if impl == 'transformer_engine' else 'whole s x s scores'}), "
                               f"grad reduce {'behind the last backward' if fw.overlap_grad_reduce else 'exposed'}, "
                               f"param gather {'behind the first forward' if fw.overlap_param_gather else 'exposed'} "
                               "(ledger/faithful/megatron/steptime.py)",))
