"""One rank's probe session: the launchers' single interface to the probes.

    session = ProbeSession(job, rank)
    for step in range(job.train.steps):
        with session.step(step):
            loss = train_one_step()
        session.loss(loss)
        session.state(framework_state_groups())   # at the step boundary
    session.dump()

Every step records its wall time (`time_s`) and its phases (`phases`: forward, backward, optimizer and
the rest; probes/phases.py); a step whose collectives are recorded, their time per dimension
(`comm_time`: issue to completion and the time the rank waited for them; probes/comm_time.py). The peak probe (probes/peak.py) runs inside every step: `peak` per step (the most live bytes, where,
and by category at that moment) and, for one step, the `timeline`. `session.watch(model_chunks)`
names modules and counts micro-batches.

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
from probes.memory import GROUPS, account, cuda_stats
from probes.peak import PeakTracker
from probes.phases import PhaseTimer


class ProbeSession:
    def __init__(self, grid: Grid, rank: int, out_path: str, comm_steps=(), memory: bool = True,
                 comm: bool = True, cuda_profile_steps=(), peak: bool = True, steps: int | None = None,
                 timeline_step: int = -1, fake_world: bool = False):
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
        self.tracker = self._guard("peak probe", PeakTracker, fake_world) if peak else None
        self.phases = self._guard("phase timer", PhaseTimer)
        self.last_step = None if steps is None else steps - 1
        # -1: the last step (steady; step 0 also allocates the optimizer's state)
        self.timeline_step = (self.last_step if timeline_step < 0 else timeline_step) if steps else timeline_step
        self._prev_named: dict[str, set] = {}
        self._peak_open = False

    def name_groups(self, labels: dict) -> None:
        """Process group -> the dim label its collectives are recorded under, for groups a rank set
        cannot name (ledger.grid labels a group by the dense grid's dims that vary in it)."""
        if self.comm is not None:
            self.comm.group_labels.update({pg.group_name: label for pg, label in labels.items()})

    def watch(self, roots) -> None:
        """The model chunks: their forward calls count micro-batches; their modules are named."""
        if self.tracker is not None:
            self._guard("peak probe", self.tracker.watch, list(roots))
        if self.phases is not None:
            self._guard("phase timer", self.phases.watch, list(roots))

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
        records_comm = self._records_comm(step)
        prof = self._profiler() if step in self.cuda_profile_steps else contextlib.nullcontext()
        tr = self.tracker
        if tr is not None:
            self._finish_peak(None)
            self._guard("peak probe", tr.begin, scan=not self.steps)
            # one Python dispatch mode for both probes: the peak probe's calls the comm probe's observe
            # before each collective (a second mode costs every operator of the step its dispatch again)
            peak_ctx = tr.recording(on_collective=self.comm.observe if records_comm else None)
            mode = contextlib.nullcontext()
        else:
            peak_ctx = contextlib.nullcontext()
            mode = self.comm.recording() if records_comm else contextlib.nullcontext()
        if self.phases is not None:
            self.phases.start()
        if records_comm:
            self.comm.start_clock()
        t0 = time.perf_counter()
        try:
            with prof as p, mode, peak_ctx:
                yield rec
        except BaseException:
            if records_comm:
                self.comm.clock.stop()  # Work.wait as torch has it
            raise
        if tr is not None:
            tr.end()
            self._peak_open = True
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        rec["time_s"] = time.perf_counter() - t0
        if self.phases is not None:
            # on CUDA the phases are host time (kernels still queued count where they are waited on)
            rec["phases"] = self.phases.stop(rec["time_s"])
        if self._records_comm(step):
            rec["comm"] = self.comm.take()
            # each dimension's collectives: issue to completion, and the time waited for them (comm_time.py)
            rec["comm_time"] = self.comm.take_time()
        if p is not None:
            rec["nccl_kernels"] = self._guard("profiler", _nccl_kernels, p)
        cs = self._guard("cuda stats", cuda_stats)
        if cs is not None:
            rec["cuda"] = cs
        self.steps.append(rec)

    def note(self, key: str, fn) -> None:
        """The last step's record gets key = fn() (a launcher's extra measurement; a failure is recorded
        in errors, as every probe's)."""
        if self.steps:
            self.steps[-1][key] = self._guard(key, fn)

    def loss(self, value) -> None:
        if self.steps:
            self.steps[-1]["loss"] = float(value) if value is not None else None

    def state(self, groups_fn) -> None:
        """groups_fn() -> {"params": [...], "grads": [...], "optim": [...], "other": [...]}."""
        if not self.memory_enabled or not self.steps:
            return
        groups = self._guard("memory probe", groups_fn)
        acc = self._guard("memory probe", account, groups) if groups is not None else None
        if acc is not None:
            storages = acc.pop("storages")
            self.steps[-1]["state"] = acc
            self.steps[-1]["storages"] = storages if len(self.steps) == 1 else None
            if self.tracker is not None:
                self._guard("peak probe", self._boundary, groups, acc)

    def _boundary(self, groups: dict, acc: dict) -> None:
        """Name the step's storages, close its peak record; at the last boundary, scan every live
        tensor independently of the launcher's containers: what no launcher names shows up."""
        tr = self.tracker
        named, seen = {}, set()
        for g in GROUPS:
            s = tr.serials(t for t in groups.get(g, ()) if isinstance(t, torch.Tensor)) - seen
            named[g] = s
            seen |= s
        both = {g: named[g] | self._prev_named.get(g, set()) for g in GROUPS}
        self._prev_named = named
        self._finish_peak(both)
        st = self.steps[-1]
        if st["step"] == self.last_step:
            unseen = tr.scan()
            acc["live_bytes"] = tr.cur
            acc["unseen_bytes"] = unseen  # live storages no operator of the steps touched
            acc["unnamed_bytes"] = tr.cur - acc["resident_bytes"]

    def _finish_peak(self, named) -> None:
        if not self._peak_open or not self.steps:
            return
        self._peak_open = False
        st = self.steps[-1]
        res = self._guard("peak probe", self.tracker.result, named, timeline=st["step"] == self.timeline_step)
        if res is not None:
            tl = res.pop("timeline", None)
            st["peak"] = res
            if tl is not None:
                st["timeline"] = tl

    def _profiler(self):
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def dump(self, extra: dict | None = None) -> None:
        if self.tracker is not None:
            self._finish_peak(None)
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
