"""Emulates a CPU without a bf16 GEMM path (an AMD EPYC without AVX-512 BF16, where torch's bf16 matmul
takes its generic kernel at ~1 GFLOP/s): with TRAIN_LEDGER_NO_ONEDNN=1 and this folder on PYTHONPATH,
every Python process of the suite (launch.py, its fork servers and ranks) turns oneDNN off through
torch.backends.mkldnn as torch is imported. docs/development.md says how to time the suite with it:

    TRAIN_LEDGER_NO_ONEDNN=1 PYTHONPATH=$PWD/scripts/slow_cpu make test
    TRAIN_LEDGER_NO_ONEDNN=1 PYTHONPATH=$PWD/scripts/slow_cpu .venv/bin/python scripts/slow_cpu/check.py

The switch is set when torch's own import finishes (a finder on sys.meta_path), so a process that
never imports torch (pip, make's helpers) pays nothing for it.
"""
import importlib.abc
import importlib.util
import os
import sys


class _OneDnnOffAtImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # find torch's own spec below without coming back here
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.backends.mkldnn.enabled = False

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TRAIN_LEDGER_NO_ONEDNN") == "1":
    sys.meta_path.insert(0, _OneDnnOffAtImport())
