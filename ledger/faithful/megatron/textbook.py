"""Megatron in the textbook ledger (ledger/textbook.py): the design article's formulas for DDP with the
distributed optimizer, and Korthikanti et al.'s activations for its peak."""
from __future__ import annotations

from ledger.placement import Peak

# CP splits the sequence, not the parameters: gradients are reduced, and the distributed optimizer
# sharded, over the dp x cp ranks (parallel_state's "dp-cp" group)
DP_OVER_CP = True

NOTES = ("textbook peak: resident + Korthikanti et al.'s per-layer activations (34sbh + 5as^2b, "
         "tp / SP / selective / full variants) x layers x micro-batches the first stage holds; no "
         "temporaries, no logits, the same for every stage",)


def state(s, cb, st, lay, fw, n_dense: int, n_expert: int, nd: int, dp_dim: str) -> None:
    """DDP + distributed optimizer: full bf16 params and grads, 12/N_d optimizer."""
    n_local = n_dense + n_expert
    s.add("params_bytes", "bf16 params", 2 * n_local)
    s.add("grads_bytes", "grads", st.grad * n_local)
    # the experts' gradients reduce, and their optimizer state shards, over the expert data
    # parallel ranks (edp = world / (etp*ep*pp)); the dense part over dp (x cp)
    dist = fw.use_distributed_optimizer
    s.add("optim_bytes", "fp32 master + adam", (st.master + st.optim) * n_dense // (nd if dist else 1))
    if n_expert:
        s.add("optim_bytes", "experts: fp32 master + adam",
              (st.master + st.optim) * n_expert // (lay.edp if dist else 1))
    for dim, n, group in ((dp_dim, n_dense, nd), ("edp", n_expert, lay.edp)):
        if not n:
            continue
        if dist:
            cb.add(dim, "reduce_scatter", st.grad * n, group, what="grads")
            cb.add(dim, "all_gather", 2 * n, group, what="bf16 params")
        else:
            cb.add(dim, "all_reduce", st.grad * n, group, what="grads")


def peak(model, lay, fw, resident: int) -> Peak:
    """resident + Korthikanti et al.'s activations, with Megatron's recompute knobs."""
    from ledger.faithful.megatron.activations import recompute_of
    from ledger.textbook import activation_bytes

    rc = recompute_of(fw).granularity
    act = activation_bytes(model, lay, rc)
    return Peak.of({"resident": resident, "activations": act}, "backward",
                   "Korthikanti et al. 2022: first stage, min(p, m) micro-batches in flight"
                   + (f", {rc} recompute" if rc else ""),
                   detail={"resident/the textbook state (params, grads, optimizer)": resident,
                           "activations/min(p, m) micro-batches' saved activations (Korthikanti et al.)": act})
