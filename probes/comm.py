"""Comm probe: every collective a rank calls, by process group dimension, kind, dtype and bytes.

A TorchDispatchMode sees the dispatcher ops that torch.distributed lowers every call to in torch
2.13 (`c10d::allreduce_`, `c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`, send/recv, and
the functional `_c10d_functional.*` used by DTensor/FSDP2), whatever name the framework called
(`all_gather_into_tensor`, `all_gather_single`, deepspeed.comm, Megatron's bound functions), so no
per-framework patching is needed. It is active only during the steps being recorded.

Buffer bytes follow the ledger's contract (ledger/placement.py): all_gather and reduce_scatter
count the full (gathered / pre-scatter) tensor; send_recv counts each tensor sent or received;
all_to_all the tensor sent (its input).
Groups of one rank are ignored (nothing leaves the rank), as the ledger does.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from probes.comm_time import CommClock, PENDING

log = logging.getLogger(__name__)

# op name -> (kind, how to find the buffer bytes)
#   "out0": the first tensor (list) argument is the (full) buffer
#   "ag_out": all_gather: output list/tensor (full)
#   "rs_in": reduce_scatter: input list/tensor (full)
_C10D = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "send": "send_recv",
    "recv_": "send_recv",
    "recv_any_source_": "send_recv",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "barrier": "barrier",
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}

_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "uint8",
          torch.int64: "int64", torch.int32: "int32", torch.bool: "bool", torch.float64: "fp64"}


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        out = []
        for y in x:
            out += _tensors(y)
        return out
    return []


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class _Mode(TorchDispatchMode):
    def __init__(self, probe: "CommProbe"):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A mode is switched off while its own handler runs, so collectives DTensor issues
        # inside its dispatch (e.g. the grad-norm all-reduce of _NormPartial, loss-parallel
        # reductions) would go unseen; deferring to DTensor lets its inner ops come back here.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if PENDING:
            PENDING.clear()  # the Works issued before are the caller's now (comm_time.PENDING)
        after = self.probe.observe(func, args, kwargs) if observed(func, types) else None
        out = func(*args, **kwargs)
        if after is not None:
            after(out)
        return out


_COLLECTIVE: dict = {}  # operator -> whether it is a collective (OpOverload.namespace is a slow property)

try:  # a functional collective's output before its wait (torch.distributed._functional_collectives)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor as _ACT
except ImportError:
    _ACT = None


def observed(func, types) -> bool:
    """Whether the comm probe's observe wants an operator: a collective, or an operator on an
    AsyncCollectiveTensor (whose own dispatch waits for its collective where the mode cannot see it)."""
    return is_collective(func) or (_ACT is not None and _ACT in types)


def is_collective(func) -> bool:
    """Whether a dispatched operator is a collective (a c10d or functional-collectives op)."""
    c = _COLLECTIVE.get(func)
    if c is None:
        c = _COLLECTIVE[func] = getattr(func, "namespace", "") in ("c10d", "_c10d_functional")
    return c


class CommProbe:
    """Records collectives while `recording()` is active; `take()` returns and clears them."""

    def __init__(self, label_of_ranks=None):
        # label_of_ranks: ranks -> dim label (ledger.grid.Grid.label); default: "world"/"group"
        self.label_of_ranks = label_of_ranks
        self._acc: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        self._group_cache: dict[str, tuple[str, int]] = {}
        self.errors: list[str] = []
        self.ignored_single = 0
        # group name -> label for groups that a rank set cannot name: a framework's expert groups
        # (Megatron's EP group holds the same ranks as a DP group when ep = dp), given by the launcher
        self.group_labels: dict[str, str] = {}
        # each collective's time, issue to completion, and the time waited for it (probes/comm_time.py),
        # while the session records the step's collectives (start_clock / take_time)
        self.clock = CommClock()
        self._clocked = False

    def start_clock(self) -> None:
        self.clock.start()
        self._clocked = True

    def take_time(self) -> dict:
        self.clock.stop()
        self._clocked = False
        self.errors += self.clock.errors
        self.clock.errors = []
        return self.clock.take()

    def recording(self):
        """This probe's own dispatch mode. Where the peak probe records the same step, the session
        hands `observe` to the peak probe's mode instead (one Python mode per operator, not two)."""
        return _Mode(self)

    def observe(self, func, args, kwargs):
        """Record one collective operator (is_collective(func)), called before it runs; returns what to
        call with its output once it has run (the clock's), or None."""
        if not is_collective(func):  # an operator on an AsyncCollectiveTensor (observed)
            if not self._clocked:
                return None
            pending = [a for a in _tensors(list(args) + list(kwargs.values()))
                       if isinstance(a, _ACT) and not a.completed]
            if not pending:
                return None
            t0 = time.perf_counter()
            return lambda _out: [self.clock.waited(a.elem, t0) for a in pending]
        try:
            dim = self._record(func.namespace, func._opname, args, kwargs)
        except Exception as e:  # a probe never breaks training
            self.errors.append(f"comm probe: {func}: {type(e).__name__}: {e}")
            return None
        if not self._clocked:
            return None
        t0 = time.perf_counter()
        if func._opname == "wait_tensor":
            return lambda _out: self.clock.waited(args[0], t0)
        if dim is None:
            return None
        return lambda out: self.clock.issued(dim, out, t0)

    def _group_info(self, pg) -> tuple[str, int]:
        key = pg.group_name
        if key not in self._group_cache:
            ranks = dist.get_process_group_ranks(pg)
            label = self.group_labels.get(key) or (
                self.label_of_ranks(ranks) if self.label_of_ranks else f"group{len(ranks)}")
            self._group_cache[key] = (label, len(ranks))
        return self._group_cache[key]

    def _record(self, ns: str, op: str, args, kwargs) -> str | None:
        """Count the collective; its dimension's label, or None where it is not counted."""
        if ns == "c10d":
            kind = _C10D.get(op)
            if kind is None:
                return None
            # the dispatcher boxes the ProcessGroup as a ScriptObject; it is the first one
            # in every c10d op's schema (the ReduceOp, when present, comes after it)
            boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
            if boxed is None:
                raise RuntimeError(f"no process group argument in c10d.{op}")
            pg = dist.ProcessGroup.unbox(boxed)
            tensor_args = [a for a in args if isinstance(a, (torch.Tensor, list, tuple))]
            if kind == "all_gather":
                # (output, input, ...): the gathered output is the full buffer
                ts = _tensors(tensor_args[0])
            elif kind in ("reduce_scatter", "all_to_all"):
                # (output, input, ...): the input is the full buffer; an all-to-all's, what it sends
                ts = _tensors(tensor_args[1])
            else:
                ts = _tensors(tensor_args[0])
        else:
            kind = _FUNCTIONAL.get(op)
            if kind is None:
                return None
            name = next(a for a in reversed(args) if isinstance(a, str))
            pg = dist.distributed_c10d._resolve_process_group(name)
            ts = _tensors(args[0])
            if kind == "all_gather":
                # functional all-gather takes the local shard: the full buffer is shard * group size
                label, n = self._group_info(pg)
                return self._add(label, n, kind, ts, scale=n)
        label, n = self._group_info(pg)
        return self._add(label, n, kind, ts)

    def _add(self, label: str, n: int, kind: str, ts, scale: int = 1) -> str | None:
        if n <= 1:
            self.ignored_single += 1
            return None
        if kind == "barrier":
            return None
        dtype = _DTYPE.get(ts[0].dtype, str(ts[0].dtype)) if ts else ""
        a = self._acc[(label, kind, dtype)]
        a[0] += 1
        a[1] += _nbytes(ts) * scale
        return label

    def take(self) -> list[dict]:
        out = [{"dim": d, "kind": k, "dtype": t, "count": c, "buffer_bytes": b}
               for (d, k, t), (c, b) in sorted(self._acc.items())]
        self._acc.clear()
        return out
