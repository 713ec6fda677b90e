"""The run a prediction is for: its target.

- "cpu-gloo": the CPU harness this machine runs (gloo's collectives, CPU kernels, torch's CPU
  allocator). Every rule of this target is confirmed by the CPU matrices.
- "cuda-nccl": the user's GPU cluster (NCCL, CUDA kernels, the CUDA caching allocator). The rules
  both targets share are confirmed on the CPU; the rules only a GPU run has follow the sources each
  framework's cuda-nccl rules name (ledger/faithful/<name>/target.py) and are labelled "from sources"
  until a GPU run confirms them.

The cluster decides (cluster.target): conf/cluster/local_cpu.yaml, fake.yaml and local_slurm.yaml say
cpu-gloo, the GPU clusters cuda-nccl; the default cluster (conf/cluster/default.yaml) leaves it unset,
which means: mode=run measures this machine's CPU (cpu-gloo, the target its measurement can confirm),
while predict, plan and dry describe a GPU run (cuda-nccl).
"""
from __future__ import annotations

from ledger.errors import ConfigError

CPU_GLOO, CUDA_NCCL = "cpu-gloo", "cuda-nccl"
TARGETS = (CPU_GLOO, CUDA_NCCL)


def of(mode: str, cluster) -> str:
    """The target of a job of this mode on this cluster (cluster.target when it names one)."""
    named = cluster.get("target")
    if named is not None:
        return named
    if mode == "run":
        return CUDA_NCCL if cluster.device == "cuda" else CPU_GLOO
    return CUDA_NCCL


def validate(mode: str, cluster) -> None:
    """cluster.target's value, and that a run measures the target it predicts."""
    named = cluster.get("target")
    if named is not None and named not in TARGETS:
        raise ConfigError(f"cluster.target={named!r} must be {' or '.join(TARGETS)} (or unset: by the mode)")
    if mode == "run" and named is not None:
        runs = CUDA_NCCL if cluster.device == "cuda" else CPU_GLOO
        if named != runs:
            raise ConfigError(f"cluster.target={named!r}: mode=run on cluster.device={cluster.device!r} measures "
                              f"{runs}, the only target its measurement can confirm; predict {named} with "
                              "mode=predict")
