"""What a DeepSpeed 0.19.8 rank's peak takes from the run it is predicted for (ledger/target.py): the one
home of the rules that differ between the CPU harness (cpu-gloo) and a GPU run (cuda-nccl). The peak's
moments (peak.py) read these flags; every other rule is shared by both.

cpu-gloo, confirmed by the CPU matrices:
- ZeRO-3's reduce_scatter_coalesced (runtime/comm/coalesced_collectives.py) hands a flat input to
  torch's reduce_scatter_tensor; gloo reduces a clone of the whole input (ProcessGroupGloo.cpp:
  `buffers.push_back(inputTensors[i].clone())`), a second buffer of the input's size while it runs;
- the optimizer is torch.optim.AdamW (the launcher's config names torch_adam: engine.py
  _configure_basic_optimizer) with foreach left unset, which torch resolves to the single-tensor loop
  for CPU tensors (torch/optim/optimizer.py _default_to_fused_or_foreach: foreach only on CUDA-like
  devices): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds two fp32 temporaries
  of the flat partition's size.

cuda-nccl, from sources (no GPU run has confirmed them):
- NCCL reduces from the flat input into the rank's chunk of it in place (the output is a view of the
  input): no copy;
- the same AdamW resolves to _multi_tensor_adam on CUDA tensors: `exp_avg_sq_sqrt =
  torch._foreach_sqrt(device_exp_avg_sqs)`, then divided and added to in place: one fp32 temporary of
  the partition's size.
The attention (launchers/llama.py: F.scaled_dot_product_attention, is_causal) saves q, k, v, its output
and logsumexp on both (CPU's flash kernel; CUDA's flash kernel adds the RNG seed and offset, bytes).
"""
from __future__ import annotations

from typing import NamedTuple

from ledger.target import CPU_GLOO, CUDA_NCCL


class Rules(NamedTuple):
    target: str
    collectives: str  # the backend the moments name
    rs_input_copy: bool  # the reduce-scatter reduces a copy of its whole input
    adam_partition_temporaries: int  # fp32 temporaries of the partition's size in AdamW's update
    adam_temporaries: str  # what they are (the peak's detail line)
    adam_update: str  # the update that makes them (the moment's name)
    # the host is the device's memory (the CPU harness): ZeRO-Offload's host buffers and its optimizer step
    # count in the peak; on a GPU they are the host's (zero12.py host_bytes), not the device's
    host_is_device: bool


RULES = {CPU_GLOO: Rules(CPU_GLOO, "gloo", True, 2, "exp_avg_sq.sqrt() and its / bias_correction2_sqrt",
                         "exp_avg_sq.sqrt() / bias_correction2_sqrt", True),
         CUDA_NCCL: Rules(CUDA_NCCL, "NCCL", False, 1, "_foreach_sqrt(exp_avg_sq)",
                          "_foreach_sqrt(exp_avg_sq), divided in place", False)}


def rules_of(target: str | None) -> Rules:
    return RULES[target or CPU_GLOO]


def peak_basis(fw, target: str) -> str:
    if target == CUDA_NCCL:
        return ("from sources, not confirmed by a GPU run: NCCL's reduce-scatter in place (no gloo copy), torch "
                "AdamW's foreach update on CUDA; the activations and ZeRO's buffers as the CPU runs confirm them; "
                "the CUDA allocator's rounding is not modelled")
    return "the CPU harness's rules (gloo's staging copies, CPU AdamW temporaries), confirmed by CPU runs"
