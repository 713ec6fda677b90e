"""DeepSpeed ZeRO in the textbook ledger (ledger/textbook.py): stage z divides the last 12/14/16 bytes
per parameter by N_d (the design article's formulas)."""
from __future__ import annotations

DP_OVER_CP = False
NOTES = ()
peak = None  # the textbook has no DeepSpeed peak: its faithful ledger predicts one


def state(s, cb, st, lay, fw, n_dense: int, n_expert: int, nd: int, dp_dim: str) -> None:
    n_local = n_dense + n_expert
    z = fw.zero_stage
    s.add("params_bytes", "bf16 params", 2 * n_local // (nd if z >= 3 else 1))
    s.add("grads_bytes", "grads", st.grad * n_local // (nd if z >= 2 else 1))
    s.add("optim_bytes", "fp32 master + adam", (st.master + st.optim) * n_local // (nd if z >= 1 else 1))
    if z >= 3:
        cb.add("dp", "all_gather", 2 * n_local, nd, count=2, what="forward + backward gather")
        cb.add("dp", "reduce_scatter", st.grad * n_local, nd, what="grads")
    elif z >= 1:
        cb.add("dp", "reduce_scatter", st.grad * n_local, nd, what="grads")
        cb.add("dp", "all_gather", 2 * n_local, nd, what="bf16 params")
    else:
        cb.add("dp", "all_reduce", st.grad * n_local, nd, what="grads")
