"""Emulates a CPU without a bf16 GEMM path (an AMD EPYC without AVX-512 BF16, where torch's bf16 matmul
takes its generic kernel at ~1 GFLOP/s): with TRAIN_LEDGER_NO_ONEDNN=1 and this folder on PYTHONPATH,
every Python process of the suite (launch.py, its fork servers and ranks) turns oneDNN off through
torch.backends.mkldnn before it runs anything. docs/development.md says how to time the suite with it:

    TRAIN_LEDGER_NO_ONEDNN=1 PYTHONPATH=$PWD/scripts/slow_cpu make test
    TRAIN_LEDGER_NO_ONEDNN=1 PYTHONPATH=$PWD/scripts/slow_cpu .venv/bin/python scripts/slow_cpu/check.py
"""
import os

if os.environ.get("TRAIN_LEDGER_NO_ONEDNN") == "1":
    try:
        import torch
    except ImportError:  # a Python without torch (the system one running make): nothing to turn off
        pass
    else:
        torch.backends.mkldnn.enabled = False
