"""What a Megatron Core 0.18.0 rank's peak takes from the run it is predicted for (ledger/target.py): the
one home of the rules that differ between the CPU harness (cpu-gloo) and a GPU run (cuda-nccl).

The target also picks the spec a job builds when framework.transformer_impl is unset
(fill_mode_defaults): cuda-nccl builds Megatron-LM's default, the TransformerEngine spec
(arguments.py --transformer-impl transformer_engine); cpu-gloo the local spec, the one a CPU runs
(TransformerEngine needs CUDA: the TE spec with a cpu-gloo target is refused).

cpu-gloo, confirmed by the CPU matrices (peak.optimizer_moments):
- the distributed optimizer's grad reduce-scatter (distributed/param_and_grad_buffer.py start_grad_sync:
  reduce_scatter_tensor(local_data_view, bucket.grad_data)) runs on gloo, which reduces a clone of the
  whole bucket (ProcessGroupGloo.cpp);
- Adam is torch.optim.AdamW (no TransformerEngine or apex here: optimizer/__init__.py falls back), the
  single-tensor loop on CPU tensors, with two fp32 temporaries per master param.

cuda-nccl, from sources (no GPU run has confirmed them):
- NCCL reduce-scatters in place into the bucket's shard view: no copy;
- Adam is TransformerEngine's FusedAdam (optimizer/__init__.py imports
  transformer_engine.pytorch.optimizers.FusedAdam first; apex's next): multi-tensor kernels updating in
  place, no temporary the size of a param.
Attention and its saves follow the spec (activations.py: the local spec's [b, heads, s, s] scores and
probabilities on both targets, TEDotProductAttention's fused kernel without them).
"""
from __future__ import annotations

from ledger.errors import ConfigError
from ledger.target import CPU_GLOO, CUDA_NCCL

TE = "transformer_engine"


def of(k) -> str:
    """The target a Knobs' peak follows: the one it was placed for, or else its spec's (the TE spec runs
    on CUDA only; the local spec stands for the CPU runs)."""
    if k.target:
        return k.target
    return CUDA_NCCL if k.transformer_impl == TE else CPU_GLOO


def fused_optimizer_in_place(k) -> bool:
    """NCCL in place and FusedAdam: the grad sync and Adam's step hold no bucket- or param-sized transient."""
    return of(k) == CUDA_NCCL


def with_target(k, fw, target: str | None):
    """Knobs placed for a target: an unset transformer_impl becomes the target's spec (a plan's rows
    leave it unset)."""
    if not target:
        return k
    if getattr(fw, "transformer_impl", None) is None:
        k = k._replace(transformer_impl=default_transformer_impl(target))
    return k._replace(target=target)


def check(k) -> None:
    if k.target == CPU_GLOO and k.transformer_impl == TE:
        raise ConfigError("megatron: framework.transformer_impl=transformer_engine needs CUDA (TransformerEngine) but "
                          "the prediction's target is cpu-gloo (cluster.target, or a CPU cluster): set "
                          "framework.transformer_impl=local or predict for a GPU cluster (cluster=local_gpu)")


def default_transformer_impl(target: str) -> str:
    return TE if target == CUDA_NCCL else "local"


# TransformerEngine v2.8 module/base.py get_workspace: one cuBLAS workspace for TE's GEMMs, allocated with
# torch.empty on the first one and kept (a global), get_cublas_workspace_size_bytes: "32 MiB if using
# hopper" (+1 KiB "for alignment and misc scales"; sm90 assumed, as ledger/cuda.py's cuBLAS line),
# 4 MiB before; TE's grouped GEMM (moe_grouped_gemm) keeps one per cuBLAS stream besides
TE_CUBLAS_WORKSPACE = 32 * 1024 * 1024 + 1024


def workspaces(k) -> dict[str, int]:
    """Device buffers the spec's kernels keep beside the tensors the ledger counts, for a cuda-nccl
    prediction (ledger/cuda.py adds them to what a rank holds beside its tensors)."""
    if of(k) != CUDA_NCCL or k.transformer_impl != TE:
        return {}
    return {"TransformerEngine's cuBLAS workspace (module/base.py get_workspace, sm90; in the allocator)":
            TE_CUBLAS_WORKSPACE}


def peak_basis(fw, target: str) -> str:
    if target == CUDA_NCCL:
        spec = "TE's fused attention" if getattr(fw, "transformer_impl", None) == TE else "the local spec's attention"
        return (f"from sources, not confirmed by a GPU run: NCCL in place, FusedAdam, {spec}, TE's LayerNormLinear "
                "saves; TE's cuBLAS workspace beside the tensors; the CUDA allocator's rounding not modelled")
    return "the local spec the CPU runs confirm (gloo's staging copies, CPU attention and AdamW temporaries)"
