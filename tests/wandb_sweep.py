"""One small real sweep shared by tests/test_wandb.py and tests/test_report.py (run once per pytest process).

    python launch.py -m framework=deepspeed,titan train.steps=2 hydra.sweep.dir=SWEEP   # 2 jobs, 2 ranks each

W&B logging is at its default (on, offline), so every job dir also holds its offline W&B run.
"""
from __future__ import annotations

from tests.conftest import launch

ARGS = ["-m", "framework=deepspeed,titan", "train.steps=2"]
_cache: dict = {}


def real_sweep(tmp_path_factory) -> str:
    if "dir" not in _cache:
        d = str(tmp_path_factory.mktemp("wandb_sweep"))
        _cache["proc"] = launch(*ARGS, f"hydra.sweep.dir={d}", timeout=900, check=True, wandb=True)
        _cache["dir"] = d
    return _cache["dir"]
