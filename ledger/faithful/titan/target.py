"""What a torchtitan 0.3.0 rank's peak takes from the run it is predicted for (ledger/target.py): the
one home of the rules that differ between the CPU harness (cpu-gloo, launchers/titan_cpu.py) and a
GPU run (cuda-nccl). The peak's moments (peak.py) read these flags; every other rule is shared.

cpu-gloo, confirmed by the CPU matrices:
- a DTensor redistribution Shard(i) -> Shard(j) on the cpu device mesh runs as an all-gather of the
  whole tensor and a local chunk (torch/distributed/tensor/_collective_utils.py shard_dim_alltoall:
  gloo has no all-to-all); NCCL's mesh runs all_to_all (dtensor._executed);
- gloo's reduce-scatter reduces a copy of its whole input (ProcessGroupGloo.cpp reduce_scatter_tensor:
  `buffers.push_back(inputTensors[i].clone())`, all-reduce, then the rank's chunk copied out): a
  second fp32 buffer the size of FSDP2's reduce_scatter_input while it runs; and its worker thread
  drops that copy after marking the work complete (peak.RACE);
- attention is titan_cpu.math_flex_attention: the BlockMask made dense and CPU SDPA's kernel, which
  saves a bf16 additive mask [B, S, S] beside q, k, v, its output and logsumexp; CPU SDPA is not in
  SelectiveAC's save list (recomputed).

cuda-nccl, from sources (no GPU run has confirmed them):
- NCCL's reduce-scatter writes its output from the input in place on the device: no copy
  (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce: reduce_scatter_input on
  the compute stream, the output a new shard-sized tensor, ReduceOp.AVG: no division buffer); with a
  shard group of one both targets hold foreach_reduce's `reduce_scatter_input / gradient_divide_factor`
  (no collective runs: peak.rs_temporary);
- attention is FlexAttention's compiled kernel (llama3's default attn_backend "flex",
  models/llama3/__init__.py model_registry; models/common/attention.py: torch.compile(flex_attention)):
  its autograd function saves q, k, v, its output, logsumexp and max_scores (fp32 [B, heads, S] each)
  and the BlockMask's block tables (KB), no dense mask (torch/_higher_order_ops/flex_attention.py
  FlexAttentionAutogradOp.forward); SelectiveAC's save list keeps flex_attention's outputs
  (distributed/activation_checkpoint.py _get_default_save_ops: torch._higher_order_ops.flex_attention):
  the output, logsumexp and max_scores;
- nn.RMSNorm of a bf16 input with a bf16 weight (FSDP2's param_dtype) is aten._fused_rms_norm's CUDA
  kernel (aten/src/ATen/native/layer_norm.cpp rms_norm_symint; derivatives.yaml saves input, weight and
  rstd): the bf16 input and an fp32 rstd per token, where the CPU's rms_norm_composite saves the fp32
  upcast input, rsqrt and x * rsqrt. The norm's backward temporaries are the CPU's (not modelled for the
  CUDA kernel);
- the MoE router's torch.autocast(dtype=float32) runs on CUDA (torch/amp/autocast_mode.py checks the
  dtype only for other devices), while CPU autocast refuses float32 and is disabled: the router's saves
  are fp32 there, bf16 here (moe_activations.py).
"""
from __future__ import annotations

from typing import NamedTuple

from ledger.target import CPU_GLOO, CUDA_NCCL


class Rules(NamedTuple):
    target: str
    collectives: str  # the backend the moments name ("gloo", "NCCL")
    rs_input_copy: bool  # the reduce-scatter reduces a copy of its whole input
    dense_mask: bool  # the attention saves a dense bf16 [B, S, S] additive mask
    sac_keeps_attention: bool  # SelectiveAC keeps the attention's output, logsumexp and max_scores
    attention_stats: int  # fp32 values per query position and head the attention saves (lse; flex: max too)
    fused_rms_norm: bool  # the norms save their bf16 input and rstd (not the fp32 upcasts)
    cpu_mesh: bool  # the device mesh is cpu: DTensor runs Shard -> Shard as an all-gather (dtensor._executed)
    router_fp32: bool  # the MoE router's autocast(float32) runs (CUDA), not disabled (CPU): moe_activations.py
    # the data loader's host tensors share the device's memory (the CPU harness); on CUDA they stay on the host
    # (trainer.py moves only the batch): peak.pp_batch_lines
    loader_on_device: bool = True


RULES = {CPU_GLOO: Rules(CPU_GLOO, "gloo", True, True, False, 1, False, True, False),
         CUDA_NCCL: Rules(CUDA_NCCL, "NCCL", False, False, True, 2, True, False, True, False)}


def rules_of(target: str | None) -> Rules:
    return RULES[target or CPU_GLOO]


def peak_basis(fw, target: str) -> str:
    if target == CUDA_NCCL:
        return ("from sources, not confirmed by a GPU run: NCCL's reduce-scatter in place (no gloo copy), "
                "FlexAttention's CUDA kernel (no dense mask; SelectiveAC keeps its outputs), the fused RMSNorm's saves; "
                "SwiGLU, the loss and the norms' backward as the CPU runs confirm them; the CUDA allocator's "
                "rounding is not modelled")
    return "the CPU harness's rules (gloo's staging copies, CPU attention), confirmed by CPU runs"
