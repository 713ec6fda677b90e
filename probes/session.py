"""One rank's probe session: the launchers' single interface to the probes.

    session = ProbeSession(job, rank)
    for step in range(job.train.steps):
        with session.step(step):
            loss = train_one_step()
        session.loss(loss)
        session.state(framework_state_groups())   # at the step boundary
    session.dump()

Probes never break training: a probe error is appended to `errors` and written to the record.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import traceback

import torch

from ledger.grid import Grid
from probes.comm import CommProbe
from probes.memory import account, cuda_stats


class ProbeSession:
    def __init__(self, grid: Grid, rank: int, out_path: str, comm_steps=(), memory: bool = True,
                 comm: bool = True, cuda_profile_steps=()):
        self.grid = grid
        self.rank = rank
        self.out_path = out_path
        self.comm_steps = set(comm_steps)
        self.cuda_profile_steps = set(cuda_profile_steps)
        self.memory_enabled = memory
        self.comm = CommProbe(grid.label) if comm else None
        self.steps: list[dict] = []
        self.errors: list[str] = []
        self.info: dict = {"rank": rank, "coords": grid.coords(rank)}
        self._cur: dict | None = None

    def _guard(self, what: str, fn, *a, **k):
        try:
            return fn(*a, **k)
        except Exception as e:
            self.errors.append(f"{what}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
            return None

    def _records_comm(self, step: int) -> bool:
        return self.comm is not None and (not self.comm_steps or step in self.comm_steps)

    @contextlib.contextmanager
    def step(self, step: int):
        rec = {"step": step}
        self._cur = rec
        self._guard("cuda stats", cuda_stats)  # resets the peak for this step
        if self.comm is not None:
            self.comm.take()  # drop anything recorded outside the step
        mode = self.comm.recording() if self._records_comm(step) else contextlib.nullcontext()
        prof = self._profiler() if step in self.cuda_profile_steps else contextlib.nullcontext()
        t0 = time.perf_counter()
        with prof as p, mode:
            yield rec
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        rec["time_s"] = time.perf_counter() - t0
        if self._records_comm(step):
            rec["comm"] = self.comm.take()
        if p is not None:
            rec["nccl_kernels"] = self._guard("profiler", _nccl_kernels, p)
        cs = self._guard("cuda stats", cuda_stats)
        if cs is not None:
            rec["cuda"] = cs
        self.steps.append(rec)

    def loss(self, value) -> None:
        if self.steps:
            self.steps[-1]["loss"] = float(value) if value is not None else None

    def state(self, groups_fn) -> None:
        """groups_fn() -> {"params": [...], "grads": [...], "optim": [...], "other": [...]}."""
        if not self.memory_enabled or not self.steps:
            return
        acc = self._guard("memory probe", lambda: account(groups_fn()))
        if acc is not None:
            storages = acc.pop("storages")
            self.steps[-1]["state"] = acc
            self.steps[-1]["storages"] = storages if len(self.steps) == 1 else None

    def _profiler(self):
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def dump(self, extra: dict | None = None) -> None:
        if self.comm is not None:
            self.errors += self.comm.errors
        out = {**self.info, **(extra or {}), "steps": self.steps, "errors": self.errors}
        tmp = f"{self.out_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, self.out_path)


def _nccl_kernels(prof) -> dict:
    """NCCL device kernels and record_param_comms events seen in a profiler window (CUDA only)."""
    import re

    pat = re.compile(r"nccl(?:Dev)?Kernel_(AllGather|ReduceScatter|AllReduce|SendRecv|Broadcast|AllToAll)", re.I)
    out: dict[str, dict] = {}
    for evt in prof.key_averages():
        m = pat.search(evt.key)
        if m and evt.device_time_total > 0:
            d = out.setdefault(m.group(1).lower(), {"count": 0, "device_us": 0.0})
            d["count"] += evt.count
            d["device_us"] += float(evt.device_time_total)
        elif evt.key == "record_param_comms":
            d = out.setdefault("record_param_comms", {"count": 0, "device_us": 0.0})
            d["count"] += evt.count
    return out
