"""ledger/timing/cpu_gemm.py: the bf16 GEMM kernels a CPU rank runs where the CPU has no bf16 GEMM path,
against torch's own kernels (the reference they replace), in a process of their own (they replace
aten's CPU kernels for the whole process)."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, REPO_PATH

CHECK = r'''
import json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from ledger.timing import cpu_gemm

torch.manual_seed(0)
bf = torch.bfloat16
a, b, bias = torch.randn(96, 64).to(bf), torch.randn(64, 80).to(bf), torch.randn(80).to(bf)
A, B = torch.randn(3, 32, 16).to(bf), torch.randn(3, 16, 24).to(bf)
C = torch.randn(3, 32, 24).to(bf)
w, offs = torch.randn(4, 64, 40).to(bf), torch.tensor([10, 40, 40, 96], dtype=torch.int32)
g, aT = torch.randn(96, 40).to(bf), torch.randn(64, 96).to(bf)
cases = {
    "mm": lambda: a @ b, "addmm": lambda: torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
    "bmm": lambda: torch.bmm(A, B), "baddbmm": lambda: torch.baddbmm(C, A, B, beta=0.5, alpha=2.0),
    "linear": lambda: torch.nn.functional.linear(a, b.t(), bias),
    "grouped 2Dx3D": lambda: torch._grouped_mm(a, w, offs=offs),
    "grouped 2Dx2D": lambda: torch._grouped_mm(aT, g, offs=offs),
    "fp32 mm": lambda: a.float() @ b.float(), "fp32 addmm": lambda: torch.addmm(bias.float(), a.float(), b.float()),
}
ref = {k: f() for k, f in cases.items()}
assert cpu_gemm.install(force=True)
out = {}
for k, f in cases.items():
    r, r0 = f(), ref[k]
    # bf16: the one rounding of an fp32 sum, torch's kernel sums in another order: at most one bf16 step
    # of the result apart (2^-7 of its magnitude), nearly always equal; fp32: torch's own kernel, equal
    step = (r0.float().abs() * 2.0 ** -7).clamp_min(2.0 ** -7)
    out[k] = {"shape": r.shape == r0.shape, "dtype": str(r.dtype), "strides": r.stride() == r0.stride(),
              "within_one_step": bool(((r.float() - r0.float()).abs() <= step).all()),
              "equal": float((r == r0).float().mean())}

seen = []
class Seen(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        seen.append([str(func), str(getattr(res, "dtype", ""))])
        return res
x = torch.randn(16, 64, dtype=bf, requires_grad=True)
lin = torch.nn.Linear(64, 32).to(bf)
with Seen():
    lin(x).sum().backward()
print(json.dumps({"cases": out, "seen": seen, "hits": cpu_gemm.hits()}))
'''


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO_PATH, **env))


def test_the_fp32_kernels_agree_with_torchs_bf16_ones_and_a_dispatch_mode_sees_what_it_saw():
    p = _run(CHECK)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for k, c in got["cases"].items():
        assert c["shape"] and c["strides"] and c["within_one_step"], (k, c)
        assert c["dtype"] == ("torch.float32" if k.startswith("fp32") else "torch.bfloat16"), (k, c)
        assert c["equal"] >= (1.0 if k.startswith("fp32") else 0.99), (k, c)
    # what the probes' dispatch mode sees: the GEMMs with their bf16 outputs, no fp32 copy of the kernels'
    ops = [f for f, _ in got["seen"]]
    assert "aten.addmm.default" in ops and ops.count("aten.mm.default") == 2, ops
    assert all(dt in ("torch.bfloat16", "") for _, dt in got["seen"]), got["seen"]
    assert not any("_to_copy" in f for f in ops), ops
    assert got["hits"]["mm"] >= 3 and got["hits"]["addmm"] >= 3 and got["hits"]["grouped_mm"] == 2, got["hits"]


@pytest.mark.parametrize("mode,want", [("upcast", True), ("native", False)])
def test_the_switch_forces_or_refuses_it(mode, want):
    p = _run("from ledger.timing import cpu_gemm; print(cpu_gemm.needed())", TRAIN_LEDGER_CPU_GEMM=mode)
    assert p.returncode == 0 and p.stdout.strip() == str(want), p.stderr[-2000:]


def test_a_bad_switch_names_the_variable_and_its_values():
    p = _run("from ledger.timing import cpu_gemm; cpu_gemm.needed()", TRAIN_LEDGER_CPU_GEMM="fast")
    assert p.returncode != 0 and "TRAIN_LEDGER_CPU_GEMM='fast': one of auto, upcast, native" in p.stderr
