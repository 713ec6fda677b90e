"""Device memory a cuda-nccl rank holds beside what its tensors hold (ledger/target.py): one home for the
rules every framework shares on a GPU. None of these figures is confirmed by a GPU run; each line
says what it follows.

- outside PyTorch's caching allocator: the CUDA context (driver, loaded kernels) and NCCL's
  communicator buffers;
- inside the allocator but unseen by the probe (it sees tensors, not workspaces): cuBLAS's and
  cuBLASLt's workspaces, and what a framework's kernels keep (Placement.workspaces: TransformerEngine's
  cuBLAS workspace for Megatron's TE spec).
The caching allocator's rounding of each tensor (512-byte blocks, 2 MiB segments for small blocks,
20 MiB or 2 MiB-rounded segments for large ones: c10/cuda/CUDACachingAllocator.cpp round_size,
get_allocation_size) and its fragmentation are not modelled: the fit verdict keeps
plan.memory_fraction's headroom for them and says so.
"""
from __future__ import annotations

from ledger.units import fmt

MiB = 1 << 20

# the CUDA context with lazy module loading (CUDA_MODULE_LOADING=LAZY, CUDA 12's default) and torch's
# kernels loaded as a training step uses them: no source states it; an assumption the GPU check
# (scripts/gpu_check.sh: torch.cuda.mem_get_info minus memory_reserved) measures
CUDA_CONTEXT = 512 * MiB

# NCCL src/init.cc: DEFAULT_BUFFSIZE (1 << 22, the Simple protocol, NCCL_BUFFSIZE), DEFAULT_LL128_BUFFSIZE
# (120 x 640 x NCCL_STEPS 8 x 8 B), DEFAULT_LL_BUFFSIZE (8 lines x 512 threads x 8 steps x 16 B): per
# channel and per peer connection
NCCL_BUFFERS_PER_CONNECTION = (1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
# the channels NCCL opens per communicator: picked from the topology (src/graph/connect.cc
# ncclMaxNchannels caps it at MAXCHANNELS 64 / NCCL_MAX_NCHANNELS); an assumption for NVLink / IB rings
NCCL_CHANNELS = 16

# aten/src/ATen/cuda/CublasHandlePool.cpp: cuBLAS's default workspace ":4096:8" on sm90 (32 MiB),
# cuBLASLt's CUBLASLT_WORKSPACE_SIZE 1024 KiB; both from the caching allocator, one per (handle, stream)
CUBLAS_WORKSPACE = 32 * MiB
CUBLASLT_WORKSPACE = 1 * MiB


def communicators(pl) -> dict[str, int]:
    """The NCCL communicators a rank of the heaviest kind opens: one per parallel dimension whose group
    runs a collective (its comm rows), two for the pipeline's neighbours (torch's ProcessGroupNCCL opens
    a communicator per pair of ranks for send / recv)."""
    out: dict[str, int] = {}
    for c in pl.per_gpu.comm:
        n = 2 if c.kind in ("send", "recv", "send_recv", "p2p") or c.dim == "pp" else 1
        out[c.dim] = max(out.get(c.dim, 0), n)
    return out


def outside_allocator(pl) -> dict[str, int]:
    """Named device bytes per rank that the tensors' peak does not count (the fit verdict adds them)."""
    comms = communicators(pl)
    n = sum(comms.values())
    out = {"CUDA context and loaded kernels (assumed, not from a source)": CUDA_CONTEXT,
           "cuBLAS + cuBLASLt workspaces (CublasHandlePool.cpp defaults, sm90; in the allocator)":
               CUBLAS_WORKSPACE + CUBLASLT_WORKSPACE, **pl.workspaces}
    if n:
        dims = ", ".join(f"{d}" + (f" x{k}" if k > 1 else "") for d, k in comms.items())
        out[f"NCCL buffers: {n} communicator{"s" if n > 1 else ""} ({dims}) x {NCCL_CHANNELS} channels (assumed) x "
            f"{fmt(NCCL_BUFFERS_PER_CONNECTION)} (NCCL's default Simple + LL128 + LL buffers)"] = \
            n * NCCL_CHANNELS * NCCL_BUFFERS_PER_CONNECTION
    return out
