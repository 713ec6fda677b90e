"""How a DeepSpeed 0.19.8 ZeRO step runs, for the step-time model (ledger/timing/step.py); paths under
deepspeed/runtime/.

  schedule   no pipelining (the ZeRO engine; every GPU a data-parallel rank)
  recompute  activation_checkpointing: every layer's forward again in backward (the launcher's
             checkpointed Llama layers)
  attention  the Llama's SDPA: flash on CUDA (causal blocks skipped), the math kernel on the CPU
  DP         zero/stage_1_and_2.py: with overlap_comm the IPG buckets reduce on a side stream while the
             backward goes on (stage 2 every micro-batch, stage 1 at the accumulation boundary: the
             last backward), else after it; the updated partitions are all-gathered after the step
             (all_gather_dp_groups), exposed. zero/stage3.py: the coordinator prefetches parameters
             under the compute and overlap_comm reduces behind it: both hidden by the passes' compute
  optimizer  FusedAdam over the fp32 partition (12 bytes of state an element), 30 bytes of traffic
"""
from __future__ import annotations

from ledger.faithful.deepspeed.rules import overlap_comm
from ledger.timing.step import TimePolicy


def time_policy(fw, lay, device: str) -> TimePolicy:
    ov = overlap_comm(fw)
    z = fw.zero_stage
    grad = ("every_pass" if z >= 2 else "last_backward") if ov else "exposed"
    param = "every_pass" if z == 3 else "exposed"
    return TimePolicy(schedule="none", recompute="full" if fw.activation_checkpointing else "none",
                      causal_kernel=device == "cuda", dp_grad=grad, dp_param=param,
                      sources=(f"deepspeed time policy: ZeRO-{z}, grad reduction {grad.replace('_', ' ')}, "
                               f"param gathers {param.replace('_', ' ')} (ledger/faithful/deepspeed/steptime.py)",))
