"""How a torchtitan 0.3.0 step runs, for the step-time model (ledger/timing/step.py).

  schedule   no pipelining at pp = 1; with PP the schedule 1F1B (parallelisms/pipeline: the
             pipelining schedules of torch.distributed.pipelining; the ledger's PP is 1F1B)
  recompute  activation_checkpoint: full re-runs every block's forward in backward, selective (op)
             re-runs what its save list does not keep (the attention core: SDPA is not saved on CPU)
  attention  on CUDA torch's SDPA picks flash / cuDNN for bf16 (the causal mask's blocks skipped);
             on the CPU the math kernel computes the whole [s, s] scores
  DP         FSDP2 (_fsdp_param_group.py): each unit's all-gather is prefetched under the previous
             unit's compute, each unit's reduce-scatter runs behind the next unit's backward: both
             hidden by the passes' compute as far as it lasts
  optimizer  torch AdamW over the fp32 shards (exp_avg and exp_avg_sq: 8 bytes of state an element;
             foreach on CUDA): reads param, grad, exp_avg, exp_avg_sq and writes three, 28 bytes
"""
from __future__ import annotations

from ledger.timing.step import TimePolicy


def time_policy(fw, lay, device: str) -> TimePolicy:
    ac = getattr(fw, "activation_checkpoint", "none") or "none"
    return TimePolicy(schedule="none" if lay.pp == 1 else "1f1b", recompute=ac, causal_kernel=device == "cuda",
                      dp_grad="every_pass", dp_param="every_pass", optimizer_state_bytes=8,
                      optimizer_traffic_bytes=28,
                      sources=(f"titan time policy: FSDP2 prefetch and reduce-scatter behind the passes' compute, "
                               f"activation_checkpoint={ac}, attention {'flash (CUDA)' if device == 'cuda' else 'math (CPU)'} "
                               "(ledger/faithful/titan/steptime.py)",))
