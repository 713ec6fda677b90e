"""How long a rank's collectives take, per process-group dimension: each collective's time from its
issue to its completion (`total_s`) and the part of it the rank's main thread spent blocked waiting
for it (`exposed_s`: the rest overlapped the rank's own work). The comm probe (probes/comm.py) hands
each collective it records to `issued` with the operator's output; the clock is on while that probe
records a step (start / stop).

Completion:
- a c10d operator returns its Work (the dispatcher's ScriptObject; unboxed it is the very Work object
  torch.distributed hands the caller, pybind11 keeping one Python object per C++ Work): its future's
  done callback, run on the backend's thread when the collective completes, stamps the end, or, for
  a Work without a future (gloo's coalesced works, FSDP2's: "Work::getFuture not implemented"), the
  return of its wait (an upper bound), whichever comes first;
- a functional collective (`_c10d_functional.*`, DTensor's) returns a tensor whose Work torch keeps in
  C++; its end is taken where `_c10d_functional.wait_tensor` returns on it, or where an operator on
  its AsyncCollectiveTensor returns (that wrapper waits inside its own dispatch, where the probe's mode
  is off: the probe times the operator that triggered it, probes/comm.py observed): an upper bound
  (the collective may have completed earlier). A wait the probe sees neither way (torchtitan's scalar
  all-reduces of the loss's token count and the grad norm) leaves its collective untimed: `count` is
  the timed ones, and analysis/timing.py's rows say how many of the dimension's were (`timed`).
Blocked: Work.wait (patched on the class while the clock runs: torch.distributed's synchronous calls
wait through it, as the frameworks' asynchronous ones do) and wait_tensor, each timed on the calling
thread and booked to the dimension of the collective it waits for.
On CUDA this is host time: a NCCL collective's Work completes when its kernel has been enqueued, not
run; the profiler's device times are the session's `nccl_kernels`.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch

try:
    from torch._C._distributed_c10d import Work
except ImportError:  # a torch without distributed
    Work = None

# The Works just issued, held until the next operator is dispatched (the probes' modes clear it, before
# that operator runs) or a Work is waited: long enough for pybind11 to hand the caller the same Python
# object (it reuses a live one), whose id the wait is booked by; no longer, so that a Work the caller
# drops frees its tensors before anything else is allocated, as without the probe
PENDING: list = []


class CommClock:
    def __init__(self):
        self._lock = threading.Lock()  # done callbacks run on the backends' threads
        self._total: dict[str, float] = defaultdict(float)
        self._exposed: dict[str, float] = defaultdict(float)
        self._count: dict[str, int] = defaultdict(int)
        # id(Work) -> [dim, issue time, done], id(output tensor) -> (dim, issue time). Neither object is
        # referenced past PENDING: a Work holds its collective's tensors, and the peak probe measures when
        # they die. An id is reused only once its object died; every collective the probe sees registers
        # its own at issue, over a stale entry of the same id
        self._works: dict[int, list] = {}
        self._tensors: dict[int, tuple] = {}
        self._orig_wait = None
        self.errors: list[str] = []

    # -- the step ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.take()
        if Work is not None and self._orig_wait is None:
            self._orig_wait = orig = Work.wait
            clock = self

            def wait(work, *args, **kwargs):
                PENDING.clear()  # the caller holds this Work now
                t0 = time.perf_counter()
                try:
                    return orig(work, *args, **kwargs)
                finally:
                    entry = clock._works.get(id(work))
                    clock._blocked(entry, t0)
                    clock._finish(entry)

            Work.wait = wait

    def stop(self) -> None:
        PENDING.clear()
        if self._orig_wait is not None:
            Work.wait = self._orig_wait
            self._orig_wait = None

    def take(self) -> dict[str, dict]:
        """{dim: {"count", "total_s", "exposed_s"}} since the last take, and clear."""
        with self._lock:
            out = {d: {"count": self._count[d], "total_s": self._total[d], "exposed_s": self._exposed[d]}
                   for d in sorted(self._count)}
            self._total.clear()
            self._exposed.clear()
            self._count.clear()
            self._works.clear()
            self._tensors.clear()
        return out

    # -- what the comm probe hands over ----------------------------------------------------------
    def issued(self, dim: str, out, t_issue: float) -> None:
        """A collective of `dim` issued at t_issue returned `out` (its operator's output)."""
        try:
            works = [o for o in _flat(out) if isinstance(o, torch.ScriptObject)]
            if works and Work is not None:
                for boxed in works:
                    w = Work.unbox(boxed)
                    PENDING.append(w)
                    entry = self._works[id(w)] = [dim, t_issue, False]
                    try:
                        fut = w.get_future()
                    except RuntimeError:  # no future: its wait stamps the end
                        continue
                    fut.add_done_callback(lambda _f, e=entry: self._finish(e))
                return
            for t in _flat(out):
                if isinstance(t, torch.Tensor):
                    self._tensors[id(t)] = (dim, t_issue)
        except Exception as e:  # a probe never breaks training
            self.errors.append(f"comm clock: {type(e).__name__}: {e}")

    def waited(self, tensor, t0: float) -> None:
        """_c10d_functional.wait_tensor(tensor) ran from t0 to now: blocked time, and the functional
        collective's end."""
        entry = self._tensors.pop(id(tensor), None)
        self._blocked(entry, t0)
        if entry is not None:
            self._done(entry[0], entry[1])

    def _blocked(self, entry, t0: float) -> None:
        if entry is not None:
            dt = time.perf_counter() - t0
            with self._lock:
                self._exposed[entry[0]] += dt

    def _finish(self, entry) -> None:
        """A Work's end: its future's callback or its wait's return, the first of the two."""
        if entry is None:
            return
        with self._lock:
            if entry[2]:
                return
            entry[2] = True
        self._done(entry[0], entry[1])

    def _done(self, dim: str, t_issue: float) -> None:
        dt = time.perf_counter() - t_issue
        with self._lock:
            self._total[dim] += dt
            self._count[dim] += 1


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    return [x]
