"""Memory probe: exact model-state accounting by distinct storage, plus CUDA allocator stats.

State accounting works on CPU and CUDA alike: each framework's launcher hands the tensors it
keeps (parameters, gradient buffers, fp32 masters, optimizer state, flat partitions, buckets)
grouped as params / grads / optim / other; every distinct storage is counted once, whole (a
parameter that is a view into a flat buffer counts the buffer), in the first group that names it.
"""
from __future__ import annotations

from typing import Iterable

import torch

GROUPS = ("params", "grads", "optim", "other")
CUDA_KEYS = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
             "reserved_bytes.all.peak", "active_bytes.all.peak", "num_alloc_retries", "num_ooms")


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    return getattr(t, "_local_tensor", t)


def storage_key_bytes(t: torch.Tensor) -> tuple[tuple, int] | None:
    t = local(t)
    if t is None or t.device.type == "meta":
        return None
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    if _is_fake(t):
        # cluster=fake: a FakeTensor's storage has no data pointer (data_ptr() is 0 for all of them);
        # its StorageImpl is shared by its views as a real one is, so its address keys it, and
        # nbytes() is what the real storage would hold
        return ("fake", st._cdata), st.nbytes()
    return (t.device.type, t.device.index, st.data_ptr()), st.nbytes()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def account(groups: dict[str, Iterable[torch.Tensor]]) -> dict:
    """Bytes per group of the distinct storages behind the tensors; also the storage list."""
    seen: dict[tuple, str] = {}
    out = {f"{g}_bytes": 0 for g in GROUPS}
    storages = []
    for g in GROUPS:
        for t in groups.get(g, ()):
            if not isinstance(t, torch.Tensor):
                continue
            kb = storage_key_bytes(t)
            if kb is None or kb[0] in seen:
                continue
            seen[kb[0]] = g
            out[f"{g}_bytes"] += kb[1]
            storages.append({"group": g, "bytes": kb[1], "dtype": str(local(t).dtype).replace("torch.", ""),
                             "shape": list(local(t).shape)})
    out["resident_bytes"] = sum(out[f"{g}_bytes"] for g in GROUPS)
    if "host" in groups:
        # the part of them a framework placed in host memory (a launcher names it: DeepSpeed's ZeRO-Offload)
        host = {kb[0]: kb[1] for t in groups["host"] if isinstance(t, torch.Tensor)
                for kb in (storage_key_bytes(t),) if kb is not None and kb[0] in seen}
        out["host_bytes"] = sum(host.values())
    out["storages"] = storages
    return out


def optimizer_tensors(opt) -> list[torch.Tensor]:
    out = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def cuda_stats(reset_peak: bool = True) -> dict | None:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    out = {k: s.get(k, -1) for k in CUDA_KEYS}
    # the device's memory in use by every process and the driver (the CUDA context, NCCL's buffers, what
    # the caching allocator reserved): what ledger/cuda.py's lines beside the tensors are checked against
    free, total = torch.cuda.mem_get_info()
    out["device_used_bytes"] = total - free
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()
    return out
