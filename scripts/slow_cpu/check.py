"""Prints the bf16 and fp32 GEMM rate of this process: under the slow-CPU emulation (sitecustomize.py
beside this file) bf16 should be near 1 GFLOP/s, fp32 unchanged."""
import time

import torch


def rate(dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    t = time.perf_counter()
    a @ b
    return 2 * n ** 3 / (time.perf_counter() - t) / 1e9


if __name__ == "__main__":
    print(f"oneDNN enabled: {torch.backends.mkldnn.enabled}; bf16 {rate(torch.bfloat16):.2f} GFLOP/s, "
          f"fp32 {rate(torch.float32):.1f} GFLOP/s (1024^3 matmul)")
