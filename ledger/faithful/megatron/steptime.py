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
  grads      each micro-batch's weight grads into DDP's main_grad: on CUDA the weight-grad GEMM
             accumulates in place (Megatron-LM's default --gradient-accumulation-fusion: TE's
             fuse_wgrad_accumulation, apex's fused_weight_gradient_mlp_cuda for the local spec); without it
             (the CPU harness: launchers/megatron.py gradient_accumulation_fusion=False) the backward hook
             adds param.grad into main_grad (distributed/distributed_data_parallel.py
             _make_backward_post_hook: main_grad.add_(grad)), every micro-batch: the bf16 grad read, the
             main grad read and written in its dtype (fp32 under grad_reduce_in_fp32): 10 bytes an
             element, 5 per byte of the bf16 params
  optimizer  TE's / apex's FusedAdam over the rank's fp32 master shard (12 bytes of state an element)
  CP         TE's p2p attention (cp_comm_type p2p, a2a+p2p's ring; TransformerEngine
             dot_product_attention/context_parallel.py AttnFuncWithCPAndKVP2P): each ring step waits for
             the previous exchange, issues the next one, then runs its attention chunk, so the ring runs
             behind the attention kernels and is exposed only where longer; all_gather's gathers ("KV
             all-gather between CP ranks is exposed", its docstring) and a2a's all-to-alls stand before /
             after the attention, exposed
"""
from __future__ import annotations

from dataclasses import replace

from ledger.dtypes import nbytes
from ledger.faithful.megatron.rules import grad_dtype
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
                      grad_accumulate_bytes=0.0 if device == "cuda" else _hook_add_bytes(fw),
                      cp_ring_behind_attention=impl == "transformer_engine" and lay.cp > 1
                      and (getattr(fw, "cp_comm_type", None) or "p2p") in ("p2p", "a2a+p2p"),
                      sources=(f"megatron time policy: {schedule} schedule, attention {impl} "
                               f"({'causal blocks skipped' if impl == 'transformer_engine' else 'whole s x s scores'}), "
                               f"grad reduce {'behind the last backward' if fw.overlap_grad_reduce else 'exposed'}, "
                               f"param gather {'behind the first forward' if fw.overlap_param_gather else 'exposed'} "
                               "(ledger/faithful/megatron/steptime.py)",))


def _hook_add_bytes(fw) -> float:
    """The DDP hook's main_grad.add_(grad) per byte of the params (module docstring): the grad read in the
    params' dtype, the main grad read and written in its own."""
    w = nbytes(fw.precision)
    return (w + 2 * nbytes(grad_dtype(fw))) / w


def time_policy_2021(fw, lay, device: str) -> TimePolicy:
    """The step of the Megatron-LM of April 2021 that Narayanan et al.'s runs ran (commit 44bfcb3243:
    megatron/model/distributed.py, megatron/arguments.py), where it differs from 0.18.0's: no
    gradient-accumulation fusion yet, and in fp16 without --accumulate-allreduce-grads-in-fp32 no
    contiguous grad buffer, so autograd accumulates each micro-batch's fp16 weight grads into param.grad
    after the first (which it assigns): a read of both and a write, 3 bytes per byte of the params."""
    return replace(time_policy(fw, lay, device), grad_accumulate_bytes=3.0, grad_accumulate_first=False)
