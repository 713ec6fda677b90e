"""Measure the machine this runs on and write a hardware profile yaml that predict / plan / run accept
(`hardware.file=PATH`):

    .venv/bin/python -m ledger.timing.calibrate [--out PATH] [--ranks N] [--quick]

On this machine (no GPU) it measures the CPU: GEMM throughput by shape (torch.matmul in bf16 and fp32
over a grid of shapes, each repeated until it has run 50 ms), the memory bandwidth (a large copy),
a kernel's fixed cost (a one-element add), and gloo's all_reduce over N local processes (latency from
a 4-byte call, bus bandwidth from a large one, nccl-tests' factor). On a CUDA device the same
measurements run there (torch.cuda, NCCL). The profile's peak is the best GEMM rate measured, its GEMM
efficiency 1 (the measured table is the curve), and `measured: true`.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

SIZES = (32, 128, 512, 2048)
MAX_FLOPS = 2e9  # per GEMM shape: at ~1 GFLOP/s (a CPU without AVX-512 in bf16) two seconds


def _timed(fn, min_s: float = 0.05, max_reps: int = 200) -> float:
    """Seconds of one call: repeated until min_s has passed (the first call is a warm-up)."""
    fn()
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        el = time.perf_counter() - t0
        if el >= min_s or reps >= max_reps:
            return el / reps


def gemm_table(device: str, dtypes=("bf16", "fp32"), sizes=SIZES, sync=lambda: None) -> list:
    import torch

    if device == "cpu":
        from ledger.timing import cpu_gemm

        cpu_gemm.install()  # as a CPU rank does (launchers.worker): the GEMMs the ranks run

    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    out = []
    for dt in dtypes:
        for m in sizes:
            for n in sizes:
                for k in sizes:
                    if 2.0 * m * n * k > MAX_FLOPS:
                        continue
                    a = torch.randn(m, k, device=device, dtype=tdt[dt])
                    b = torch.randn(k, n, device=device, dtype=tdt[dt])

                    def run():
                        torch.matmul(a, b)
                        sync()
                    s = _timed(run)
                    out.append([[m, n, k, dt], 2.0 * m * n * k / s / 1e12])
    return out


def memory_gbps(device: str, sync=lambda: None) -> float:
    import torch

    n = 32 * 2 ** 20  # 128 MB of fp32
    x = torch.empty(n, device=device)
    y = torch.ones(n, device=device)

    def run():
        x.copy_(y)
        sync()
    return 2 * 4 * n / _timed(run, 0.2) / 1e9  # read and write


def kernel_overhead_s(device: str, sync=lambda: None) -> float:
    import torch

    x = torch.ones(1, device=device)

    def run():
        torch.add(x, x)
        sync()
    return _timed(run, 0.05, 10_000)


def _collective_worker(rank: int, world: int, path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    res = {}
    # a fixed number of calls on every rank (a time-bounded loop would let the ranks disagree on how
    # many all_reduces to make, and one would wait for a call the other never makes)
    for size, reps in ((4, 50), (2 ** 24, 8)):
        t = torch.ones(max(size // 4, 1))
        dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        res[size] = (time.perf_counter() - t0) / reps
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{res[4]} {res[2 ** 24]}")
    dist.destroy_process_group()


def gloo_link(world: int) -> dict:
    """Latency per ring step and bus bandwidth of gloo's all_reduce over `world` local processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res")
        mp.start_processes(_collective_worker, args=(world, os.path.join(d, "store"), out), nprocs=world,
                           start_method="spawn")
        small, big = map(float, open(out).read().split())
    steps = 2 * (world - 1)
    size = 2 ** 24
    return {"latency_us": small / steps * 1e6,
            "busbw_gbps": size * 2 * (world - 1) / world / max(big - small, 1e-9) / 1e9}


def calibrate(ranks: int = 2, quick: bool = False) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = (32, 512) if quick else SIZES
    table = gemm_table(device, sizes=sizes, sync=sync)
    peak = {dt: max(v for k, v in table if k[3] == dt) for dt in ("bf16", "fp32")}
    link = gloo_link(ranks) if not cuda else {"latency_us": 5.0, "busbw_gbps": 100.0}
    name = torch.cuda.get_device_name() if cuda else f"cpu-{os.cpu_count()}core"
    return {"name": name, "peak_tflops": peak, "hbm_gbps": memory_gbps(device, sync),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
            "gpus_per_node": ranks, "intra": link, "inter": link, "gemm_efficiency": 1.0,
            "memory_efficiency": 1.0, "sms": 0, "gemm_tile": [128, 256],
            "kernel_overhead_s": kernel_overhead_s(device, sync), "gemm_table": table,
            "sources": {"measured": f"python -m ledger.timing.calibrate on {name}, torch {torch.__version__}"
                                    + ("" if cuda else f", gloo all_reduce over {ranks} local processes")},
            "measured": True, "device": device}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="hardware_profile.yaml")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="two sizes per GEMM dimension (for tests)")
    a = ap.parse_args(argv)
    import yaml

    from ledger.timing.hardware import from_dict

    prof = calibrate(a.ranks, a.quick)
    from_dict(prof)  # the yaml is a profile predict accepts
    with open(a.out, "w") as f:
        yaml.safe_dump(prof, f, sort_keys=False)
    print(f"{a.out}: {prof['name']}: GEMM peak bf16 {prof['peak_tflops']['bf16'] * 1e3:.1f} GFLOP/s, fp32 "
          f"{prof['peak_tflops']['fp32'] * 1e3:.1f} GFLOP/s ({len(prof['gemm_table'])} shapes), memory "
          f"{prof['hbm_gbps']:.1f} GB/s, kernel {prof['kernel_overhead_s'] * 1e6:.1f} us, all_reduce over "
          f"{a.ranks}: {prof['intra']['busbw_gbps']:.2f} GB/s busbw, {prof['intra']['latency_us']:.0f} us a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
