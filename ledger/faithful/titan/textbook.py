"""torchtitan FSDP2 in the textbook ledger (ledger/textbook.py): fp32 shards that are also the master
copy, sharded over dp_shard and all-reduced across HSDP replicas (the design article's formulas)."""
from __future__ import annotations

DP_OVER_CP = False
NOTES = ()
peak = None  # the textbook has no torchtitan peak: its faithful ledger predicts one


def state(s, cb, st, lay, fw, n_dense: int, n_expert: int, nd: int, dp_dim: str) -> None:
    n_local = n_dense + n_expert
    # HSDP (dp_replicate > 1) shards over dp_shard = dp / dp_replicate only; each shard is
    # replicated dp_replicate times (torchtitan distributed/fsdp.py: fully_shard over the
    # (dp_replicate, dp_shard) mesh, FSDP2's HSDP), its grad shard all-reduced across the replicas
    ns = lay.dp_shard
    # fp32 shard is both the model parameter and the master copy
    s.add("params_bytes", "fp32 shards", 4 * n_local // ns)
    s.add("grads_bytes", "fp32 grads", 4 * n_local // ns)
    s.add("optim_bytes", "adam", st.optim * n_local // ns)
    gathers = 1 if fw.reshard_after_forward == "never" else 2
    cb.add("dp", "all_gather", 2 * n_local, ns, count=gathers, what="bf16 unshard")
    cb.add("dp", "reduce_scatter", 4 * n_local, ns, what="fp32 grads")
    cb.add("dp_replicate", "all_reduce", 4 * n_local // ns, lay.dp_replicate, what="fp32 grad shard (HSDP)")
