"""Can the fake world carry CUDA-device FakeTensors on a machine without CUDA? (docs/fake-world.md)

    .venv/bin/python scripts/fake_cuda_probe.py

Each step prints ok or the error it hits: creating cuda FakeTensors, a matmul, SDPA's forward (and which
autograd node it leaves: the kernel torch chose), nn.RMSNorm's forward (the fused CUDA kernel or the
composite), and a backward through the autograd engine.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def step(what: str, fn) -> None:
    try:
        print(f"{what}: ok {fn()}")
    except Exception as e:  # noqa: BLE001 - what fails is the finding
        print(f"{what}: FAILS {type(e).__name__}: {str(e)[:160]}")


def main() -> None:
    print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, 8, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(8, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        step("cuda FakeTensor", lambda: x.device)
        step("matmul", lambda: (x @ w).device)
        q = torch.empty(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = {}
        step("SDPA forward (its autograd node)",
             lambda: type(out.setdefault("o", torch.nn.functional.scaled_dot_product_attention(
                 q, q, q, is_causal=True)).grad_fn).__name__)
        norm = torch.nn.RMSNorm(64, device="cuda", dtype=torch.bfloat16)
        step("RMSNorm forward (its autograd node)",
             lambda: type(norm(torch.empty(2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)).grad_fn).__name__)
        step("backward", lambda: out["o"].sum().backward())


if __name__ == "__main__":
    main()
