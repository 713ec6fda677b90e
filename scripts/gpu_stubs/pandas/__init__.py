"""Stub of pandas for the GPU check's kit (scripts/gpu_stubs/_gpu_stub.py says what a stub does).

Pulled in by analysis/wandb_io.py:40 (`import pandas as pd`), which launchers/job.py:307 imports after
every job to call log_job(); with wandb.mode=disabled (every job of scripts/gpu_check.sh) log_job
returns before any use of pd (its annotations are strings: `from __future__ import annotations`).
The tables (python -m analysis.gpu_check / analysis.reconcile) do need pandas: gpu_check.sh runs them
only where the real pandas is importable, else they are run on the job folders afterwards with .venv.
Real pandas (+ numpy it needs anyway) is ~80 MiB: too big to carry.
"""
from _gpu_stub import install

install(__name__)
