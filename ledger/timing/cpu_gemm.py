"""bf16 GEMMs of a CPU rank at its fp32 GEMM's speed, on a CPU without a bf16 GEMM path.

Why: torch runs a CPU bf16 matmul through oneDNN's AVX-512-BF16 / AMX kernels where the CPU has them;
elsewhere (an AMD EPYC without AVX-512 BF16, or oneDNN off) at::native's generic gemm runs it at ~1
GFLOP/s, 50-100x under the same machine's fp32 BLAS, and the harness's jobs (the three frameworks in
bf16 on a tiny Llama) spend most of their time in it. That is a property of the test machine, not of
the runs the ledger predicts (their GPUs run bf16 GEMMs natively).

What: CPU kernels for aten mm, addmm, bmm, baddbmm (what linear, matmul and the frameworks' own GEMMs
dispatch to) and _grouped_mm (torchtitan's MoE experts) that compute a bf16 product in
fp32 - the inputs cast up, the fp32 BLAS, the result rounded to bf16 once, as oneDNN's bf16 GEMM
accumulates in fp32 and rounds once - and hand every other dtype to the op's own out= kernel. They run
below autograd and below the probes' dispatch mode: a probe sees one mm with its bf16 output, as
without them (the fp32 copies live and die inside the kernel, as oneDNN's own buffers do), so every
byte the probes measure is the same.

When: `install()` in a CPU rank (launchers.worker) and in the calibration that times this machine's
GEMMs (calibrate.py: the profile measures the GEMMs the ranks run), where `needed()`: TRAIN_LEDGER_CPU_GEMM=upcast forces it, =native
refuses it, unset it is measured - the machine's bf16 GEMM more than SLOWER times slower than its fp32
one. On a machine with a bf16 path nothing changes. HITS counts the products it computed; a rank
records them (cpu_gemm_hits) so a run says it ran. tests/test_cpu_gemm.py checks it against torch's
own bf16 kernels (the reference it replaces) and that a dispatch mode sees what it saw without it.
"""
from __future__ import annotations

import os
import time

ENV = "TRAIN_LEDGER_CPU_GEMM"
SLOWER = 10.0  # bf16 / fp32 time of a 128^3 GEMM above which bf16 has no fast path here
HITS = {"mm": 0, "addmm": 0, "bmm": 0, "baddbmm": 0, "grouped_mm": 0}
_LIB = None  # the torch.library registration (kept alive: dropping it would drop the kernels)


def _rate_ratio(n: int = 128, reps: int = 3) -> float:
    """How many times slower this process's bf16 n^3 matmul is than its fp32 one (best of reps)."""
    import torch

    def best(dtype) -> float:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up
        out = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            out = min(out, time.perf_counter() - t)
        return out

    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


def needed() -> bool:
    """Whether bf16 GEMMs take the slow path here (the module docstring's rule)."""
    mode = os.environ.get(ENV, "auto")
    if mode not in ("auto", "upcast", "native"):
        raise ValueError(f"{ENV}={mode!r}: one of auto, upcast, native")
    if mode != "auto":
        return mode == "upcast"
    return _rate_ratio() > SLOWER


def _product(name: str):
    """The CPU kernel of aten `name` (mm, addmm, bmm, baddbmm: tensors positional, beta / alpha keywords,
    the product's [.., M, N] from its last two tensors): with every tensor bf16, the op's out= kernel over
    fp32 copies, rounded to bf16 once; otherwise the op's out= kernel on the tensors as they are."""
    import torch

    out_kernel = getattr(torch.ops.aten, name).out

    def kernel(*tensors, **scalars):
        a, b = tensors[-2], tensors[-1]
        shape = (*a.shape[:-1], b.shape[-1])
        if all(t.dtype == torch.bfloat16 for t in tensors):
            HITS[name] += 1
            up = [t.float() for t in tensors]
            return out_kernel(*up, **scalars, out=torch.empty(shape, dtype=torch.float32, device=a.device)
                              ).to(torch.bfloat16)
        return out_kernel(*tensors, **scalars, out=torch.empty(shape, dtype=a.dtype, device=a.device))

    return kernel


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm as its CPU kernel computes it, group by group through mm's out= kernel (fp32
    for bf16 inputs): 2D x 3D (offs split a's rows: the MoE's forward and input grad), 2D x 2D (offs
    split the shared dim: its weight grad, one [K, N] per group), 3D x 2D (offs split b's columns),
    3D x 3D (no offs: a batched product). Rows or columns past the last offset are zeros."""
    import torch

    if bias is not None:
        raise NotImplementedError("cpu_gemm: torch._grouped_mm with a bias (no caller here passes one)")
    HITS["grouped_mm"] += 1
    up = a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16
    work = torch.float32 if up else a.dtype
    a_, b_ = (a.float(), b.float()) if up else (a, b)
    bounds = [] if offs is None else [0, *offs.tolist()]

    def mm(x, y):
        return torch.ops.aten.mm.out(x, y, out=torch.empty((x.shape[0], y.shape[1]), dtype=work, device=x.device))

    if a.dim() == 2 and b.dim() == 3:
        out = torch.zeros((a.shape[0], b.shape[2]), dtype=work, device=a.device)
        for g in range(b.shape[0]):
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                out[lo:hi] = mm(a_[lo:hi], b_[g])
    elif a.dim() == 2 and b.dim() == 2:
        out = torch.zeros((len(bounds) - 1, a.shape[0], b.shape[1]), dtype=work, device=a.device)
        for g in range(len(bounds) - 1):
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                out[g] = mm(a_[:, lo:hi], b_[lo:hi])
    elif a.dim() == 3 and b.dim() == 2:
        out = torch.zeros((a.shape[1], b.shape[1]), dtype=work, device=a.device)
        for g in range(a.shape[0]):
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                out[:, lo:hi] = mm(a_[g], b_[:, lo:hi])
    else:
        out = torch.stack([mm(a_[g], b_[g]) for g in range(a.shape[0])])
    return out.to(out_dtype or a.dtype)


def install(force: bool = False) -> bool:
    """Register the kernels for this process where needed() (or force); True when they are in."""
    global _LIB
    if _LIB is not None:
        return True
    if not (force or needed()):
        return False
    import warnings

    import torch

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the point
        for name in ("mm", "addmm", "bmm", "baddbmm"):
            lib.impl(name, _product(name), "CPU")
        lib.impl("_grouped_mm", _grouped_mm, "CPU")
    _LIB = lib
    return True


def hits() -> dict:
    """The products computed in fp32 so far (empty when not installed)."""
    return dict(HITS) if _LIB is not None else {}
