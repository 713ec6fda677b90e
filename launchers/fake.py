"""cluster=fake: the layout's whole world as torch's fake process group, a few ranks materialised.

Each chosen rank runs as its own `python -m launchers.worker` process on this machine, one after
another (launchers.job run_ranks -> run_fake). In the rank, `init_process_group` joins a world of
the layout's size through torch's FakeStore and backend "fake"
(torch/testing/_internal/distributed/fake_pg.py): every collective is issued -- the comm probe's
TorchDispatchMode sees it with its real buffer sizes -- and moves no data. The framework's tensors
are FakeTensors where it tolerates them (`tensor_mode`): shapes and storages' nbytes without
memory, so a rank of a 70B layout costs no RAM. What this cannot measure: timings, numerics (the
values are meaningless), NCCL or the CUDA caching allocator.

Data-dependent reads of a fake tensor (`.item()`, `bool()`, `float()`: aten._local_scalar_dense)
have no value. `scalar_reads(sites)` answers them with 0 (False) -- the path a healthy step takes:
no overflow, a finite grad norm, a loss to log -- at the call sites a framework's compat module
declares, counts each site, and refuses an undeclared one (so a framework upgrade that adds a read
is seen, not silently answered). LEDGER_FAKE_DISCOVER=1 in a rank's environment lists the sites a
run reaches instead (answering every one): a development aid for declaring them, never a default.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter

NOTE = ("cluster=fake: fake process group (collectives issued, no data moved) and FakeTensorMode tensors; "
        "state bytes and collectives are measured, timings and numerics (loss, grad norm) are not")


# -- which ranks (the launcher side) ---------------------------------------------------------------
def select_ranks(placement) -> list[int]:
    """One rank per distinct state the ledger predicts: rank 0 and, for each pipeline stage, its
    most-loaded rank (largest predicted resident bytes, the first on ties). Ranks of one stage
    differ only where the ledger says so (uneven vocab shards, the TP rank holding more rows), and
    the most-loaded one is the one a user's question is about."""
    best: dict[int, tuple[int, int]] = {}
    for r in range(placement.world):
        s = placement.rank_state(r)
        cur = best.get(s.stage)
        if cur is None or s.resident_bytes > cur[1]:
            best[s.stage] = (r, s.resident_bytes)
    return sorted({0, *(r for r, _ in best.values())})


def ranks_of(cfg, placement) -> list[int]:
    return sorted(cfg.cluster.fake_ranks) if len(cfg.cluster.fake_ranks) else select_ranks(placement)


def run_fake(job_dir: str, world: int, ranks: list[int], timeout_s: int) -> list[dict]:
    """Run the chosen ranks one after another (each alone on the machine: its peak RSS is its own);
    the same per-rank dicts as launchers.local.run_local. cluster.timeout_s bounds the whole job."""
    from launchers.local import clear_results, log_tail, spawn_rank

    clear_results(job_dir, ranks)
    deadline = time.monotonic() + timeout_s
    out = []
    for r in ranks:
        # the fake store needs no rendezvous: MASTER_ADDR / MASTER_PORT are unused
        t0 = time.monotonic()
        p = spawn_rank(job_dir, r, world, "127.0.0.1", 0, 0, "fake")
        timed_out, rusage = False, None
        try:
            while True:  # wait4: the rank's own peak RSS (ru_maxrss, kB on Linux) with its exit status
                pid, status, rusage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    p.returncode = os.waitstatus_to_exitcode(status)
                    break
                if time.monotonic() > deadline:
                    p.kill()
                    _, status, rusage = os.wait4(p.pid, 0)
                    p.returncode = os.waitstatus_to_exitcode(status)
                    timed_out = True
                    break
                time.sleep(0.1)
        finally:
            if p.returncode is None:
                p.kill()
                p.wait()
        out.append({"rank": r, "returncode": p.returncode, "log_tail": log_tail(job_dir, r), "timed_out": timed_out,
                    "process": {"wall_s": round(time.monotonic() - t0, 2),
                                "max_rss_bytes": rusage.ru_maxrss * 1024 if rusage else None}})
        if timed_out:  # the rest would have no time either
            out += [{"rank": q, "returncode": None, "log_tail": "", "timed_out": True} for q in ranks[len(out):]]
            break
    return out


# -- inside a rank -----------------------------------------------------------------------------------
def init_process_group(rank: int | None = None, world: int | None = None) -> None:
    """Join the fake world: FakeStore + backend "fake" (registered by importing fake_pg)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = int(os.environ["RANK"]) if rank is None else rank
    world = int(os.environ["WORLD_SIZE"]) if world is None else world
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


_MODE = None


def tensor_mode():
    """The rank's one FakeTensorMode (FakeTensors of two modes do not mix). Entered where a framework
    allocates its model state; the rest of the run needs no mode: an op on a FakeTensor runs under
    the tensor's own mode, and real tensors met there (tokens, a constant) are converted
    (allow_non_fake_inputs). What a framework computes from real tensors only (a DeviceMesh's rank
    tensor, AdamW's `step` scalars) stays real, and is measured as such."""
    global _MODE
    if _MODE is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        _MODE = FakeTensorMode(allow_non_fake_inputs=True)
    return _MODE


SCALAR_READS: Counter = Counter()


# torch's own dispatch machinery between a read and the code that asked for it
_DISPATCH = ("torch._subclasses", "torch._ops", "torch.utils._stats", "torch.utils._python_dispatch",
             "torch._compile", "torch._dynamo", "torch._tensor", "torch.overrides", "probes.comm", "probes.peak",
             __name__)


def _caller(skip_prefixes=_DISPATCH) -> tuple[str, str]:
    """The innermost frame outside torch's dispatch machinery: the code that read the value."""
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "?")
        if not any(mod == p or mod.startswith(p + ".") for p in skip_prefixes):
            return mod, f.f_code.co_qualname
        f = f.f_back
    return "?", "?"


@contextlib.contextmanager
def scalar_reads(sites: set[tuple[str, str]]):
    """While active, `.item()` of a FakeTensor (torch/_subclasses/fake_impls.py local_scalar_dense,
    which raises DataDependentOutputException without a ShapeEnv) returns 0 / 0.0 / False when the
    read comes from one of `sites` ((module, function) of the framework's caller); counted in
    SCALAR_READS. Any other site raises, naming itself."""
    import torch
    from torch._subclasses import fake_impls

    ops = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
    table = fake_impls.op_implementations_dict
    orig = {op: table[op] for op in ops}

    def zero(fake_mode, func, arg):
        if arg.item_memo is not None:
            return arg.item_memo
        site = _caller()
        if os.environ.get("LEDGER_FAKE_DISCOVER"):  # development only: list the sites a run reaches
            print("FAKE_SCALAR_SITE", site, file=sys.stderr)
        elif site not in sites:
            raise RuntimeError(f"cluster=fake: undeclared data-dependent read of a fake tensor at {site[0]} "
                               f"{site[1]} (declare it in the framework's compat module with the reason)")
        SCALAR_READS[site] += 1
        if arg.dtype == torch.bool:
            return False
        return 0.0 if arg.dtype.is_floating_point else 0

    for op in ops:
        table[op] = zero
    try:
        yield
    finally:
        table.update(orig)


def scalar_read_hits() -> list[dict]:
    return [{"module": m, "function": f, "count": c} for (m, f), c in sorted(SCALAR_READS.items())]

