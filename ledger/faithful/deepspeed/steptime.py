"""How a DeepSpeed 0.19.8 ZeRO step runs, for the step-time model (ledger/timing/step.py); paths under
deepspeed/runtime/.

  schedule   no pipelining (the ZeRO engine; every GPU a data-parallel rank)
  recompute  activation_checkpointing: every layer's forward again in backward (the launcher's
             checkpointed Llama layers)
  attention  the Llama's SDPA (launchers/llama.py): flash on CUDA (FlashAttention-2's kernel, causal blocks
             skipped), the math kernel on the CPU
  kernels    the Llama's eager ops (launchers/llama.py): wq wk wv and w1 w3 separate linears; GQA's K and
             V repeated to the query heads (repeat_interleave); RMSNorm in fp32 (x.float(), pow, mean,
             rsqrt, the product, type_as, the weight: 36 bytes an element forward); RoPE by cos / sin in
             fp32 (x.float(), four products and two sums over the halves, stack, type_as: 44 bytes an
             element); SwiGLU as F.silu(w1(x)) * w3(x) (as torchtitan's: 10 and 16 bytes); backward
             twice the forward's bytes where not counted
  DP         zero/stage_1_and_2.py: with overlap_comm the IPG buckets reduce on a side stream while the
             backward goes on (stage 2 every micro-batch, stage 1 at the accumulation boundary: the
             last backward), else after it; the updated partitions are all-gathered after the step
             (all_gather_dp_groups), exposed. zero/stage3.py: the coordinator prefetches parameters
             under the compute and overlap_comm reduces behind it: each pass's hidden by that pass's
             compute (the forward's fetches behind the forward, the backward's fetches and reductions
             behind the backward: ledger/timing/step.py)
  grads      zero/stage_1_and_2.py with contiguous_gradients (its default): each grad reduction first
             copies the grads into the IPG bucket on the compute stream
             (reduce_independent_p_g_buckets_and_remove_grads: bucket.buffer narrow().copy_(grad), 2
             bytes moved per byte of the bf16 bucket: the all_reduce rows' buffers; stage 2 every
             micro-batch, stage 1 at the boundary); stage 1 leaves the micro-batches before the boundary
             to autograd, which adds each one's bf16 grads into param.grad after the first (3 bytes per
             byte of the params); stage 2's backward epilogue adds each later micro-batch's reduced
             partition into micro-batch 0's (independent_gradient_partition_epilogue:
             accumulated_grad.add_(new_avg_grad), 3 bytes per byte of the params overlapping the partition:
             a 1 / dp share of the params, the straddling params' rest not counted). zero/stage3.py copies into its bucket on reduce_and_partition_stream, beside
             the compute (not counted)
  optimizer  FusedAdam over the fp32 partition (12 bytes of state an element), 30 bytes of traffic
  offload    zero/stage_1_and_2.py under offload_optimizer.device=cpu: the step on the host (DeepSpeedCPUAdam:
             fp32 param, grad, exp_avg, exp_avg_sq read, three written, 28 bytes, then the partition copied
             into its model-dtype staging buffer, 6: 34 bytes an element at the host's memory rate); over
             the host link, on the compute stream (copy_grad_stream is disabled there), per element of the
             partition: each gradient's fp32 copy into the host partition at the boundary (4 bytes,
             async_inplace_copy_grad_to_fp32_buffer_from_gpu) and the updated params back (2); ZeRO-2 with
             several micro-batches also moves each gradient out and back through accumulated_grads_in_cpu
             (async_accumulate_grad_in_cpu_via_gpu: 2 bytes out every micro-batch, 2 back from the second);
             ZeRO-3's offload_param: each gather copies the partitions it gathers to the device first
             (partition_parameters.py all_gather_coalesced: `p.ds_tensor.to(device)`): 1 / dp of every
             all-gather's buffer over the host link, on the fetch's path, counted exposed
"""
from __future__ import annotations

from ledger.faithful.deepspeed.rules import offloads, offloads_params, overlap_comm
from ledger.timing.ops import EAGER_FP32_RMSNORM_BYTES
from ledger.timing.step import TimePolicy

# the Llama's eager kernels' bytes per element (forward, backward), module docstring
KERNEL_BYTES = (("norm", EAGER_FP32_RMSNORM_BYTES), ("rope", (44, 88)), ("swiglu", (10, 16)))


def offload_link_bytes(zero: int, m: int) -> float:
    """Bytes over the host link per partition element per step under ZeRO-Offload (module docstring)."""
    if zero == 2 and m > 1:
        return 4 + 2 * m + 2 * (m - 1) + 2  # fp32 grads out, each micro-batch's out and back, the params back
    return 4 + 2


def time_policy(fw, lay, device: str) -> TimePolicy:
    ov = overlap_comm(fw)
    z = fw.zero_stage
    grad = ("every_pass" if z >= 2 else "last_backward") if ov else "exposed"
    param = "every_pass" if z == 3 else "exposed"
    return TimePolicy(schedule="none", recompute="full" if fw.activation_checkpointing else "none",
                      causal_kernel=device == "cuda", attention_kernel="flash2" if device == "cuda" else "math",
                      split_projections=True, repeat_kv=True, kernel_bytes=KERNEL_BYTES,
                      # the MoE gate's capacity (moe/sharded_moe.py _capacity): every expert computes C rows
                      expert_capacity_factor=getattr(fw, "capacity_factor", 1.0) or 1.0,
                      expert_min_capacity=getattr(fw, "min_capacity", 0) or 0,
                      dp_grad=grad, dp_param=param,
                      # the IPG bucket's copy-in and stage 1's autograd accumulation (module docstring)
                      dp_copy_bytes=(("all_reduce", 2.0),) if z < 3 and getattr(fw, "contiguous_gradients", True) else (),
                      grad_accumulate_bytes=3.0 if z == 1 else 3.0 / lay.dp if z == 2 else 0.0,
                      grad_accumulate_first=False,
                      host_optimizer=offloads(fw), optimizer_traffic_bytes=34 if offloads(fw) else 30,
                      offload_link_bytes=offload_link_bytes(z, lay.num_microbatches) if offloads(fw) else 0.0,
                      param_gather_host_bytes=1.0 / lay.dp if offloads_params(fw) else 0.0,
                      sources=(f"deepspeed time policy: ZeRO-{z}, grad reduction {grad.replace('_', ' ')}, "
                               f"param gathers {param.replace('_', ' ')} (ledger/faithful/deepspeed/steptime.py)",))
