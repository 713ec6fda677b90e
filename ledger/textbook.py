"""Textbook mode: the design article's formulas, not what a framework allocates.

Memory: 16 (or 18 with fp32 grads) bytes/param over N_local = N/(tp*pp); ZeRO-1/2/3 divide the
last 12/14/16 bytes by N_d; FSDP (torchtitan) keeps fp32 shards = master, sharded over dp_shard
(HSDP: dp / dp_replicate) and all-reduced across the replicas. Traffic: DP-family
RS + AG (2N) or AG + AG + RS (3N, 2N without reshard after forward); TP with SP 4 AG + 4 RS of
s*b*h per layer per micro-batch (4 AR without SP); PP activations s/t*b*h per micro-batch each
way (the article counts both directions); CP as a K/V ring, 3*(cp-1) hops per layer per micro-batch.
MoE: routed experts over ep*etp, the rest over tp; expert states shard over edp; per MoE layer per
micro-batch 2 x topk x tokens x hidden all-to-all each way.
"""
from __future__ import annotations

from ledger.layout import Layout
from ledger.memory import StateBytes
from ledger.model import ModelShape, model_dict
from ledger.placement import CommBuilder, Peak, Placement, RankState


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           recompute: str | None = None) -> int:
    """Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models), bytes
    one transformer layer keeps for backward per micro-batch, 16-bit activations, dropout masks
    included: sbh(34 + 5as/h) without parallelism; tensor parallel sbh(10 + 24/t + 5as/(ht));
    with sequence parallelism sbh/t (34 + 5as/h); selective recompute drops the 5as/h attention
    term (sbh(10 + 24/t), SP: 34 sbh/t); full recompute keeps the layer input, 2sbh (2sbh/t with SP)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh // (t if sp else 1)
    attn = 0 if recompute == "selective" else 5 * a * s * s * b  # 5as/h * sbh
    if sp:
        return (34 * sbh + attn) // t
    if t == 1:
        return 34 * sbh + attn
    return 10 * sbh + (24 * sbh + attn) // t


def activation_bytes(model: ModelShape, lay: Layout, recompute: str | None = None) -> int:
    """The first pipeline stage's activations in 1F1B (the paper's section 4.2.3): L/p layers times
    the min(p, m) micro-batches it holds, which the paper writes as L layers; interleaving with v
    chunks multiplies by 1 + (p - 1)/(p v). Embedding and output layer not included (the paper's
    small correction terms)."""
    per = layer_activation_bytes(model.seq_len // lay.cp, lay.micro_batch_size, model.hidden, model.heads, lay.tp,
                                 lay.sequence_parallel and lay.tp > 1, recompute)
    p, v, m = lay.pp, lay.vp, lay.num_microbatches
    layers = model.layers // p
    x = per * layers * min(p, m)
    if v > 1:
        x = x * (p * v + p - 1) // (p * v)
    return x


def place(model: ModelShape, st: StateBytes, lay: Layout, fw) -> Placement:
    name = fw.name
    # MoE: the routed experts split over ep (each expert's FFN over etp), the rest over tp as for a
    # dense model; both over the pipeline stages
    n_expert = model.routed_expert_params() // (lay.ep * lay.etp * lay.pp)
    n_dense = (st.num_params - model.routed_expert_params()) // (lay.tp * lay.pp)
    n_local = n_dense + n_expert
    # CP splits the sequence, not the parameters: gradients are reduced, and Megatron's distributed
    # optimizer sharded, over the dp x cp ranks (parallel_state's "dp-cp" group)
    nd = lay.dp * (lay.cp if name == "megatron" else 1)
    dp_dim = "cp-dp" if name == "megatron" and lay.cp > 1 else "dp"
    s = RankState()
    cb = CommBuilder()
    act = 2  # bf16 activations
    if name == "megatron":
        # DDP + distributed optimizer: full bf16 params and grads, 12/N_d optimizer
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
    elif name == "deepspeed":
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
    elif name == "titan":
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
    # TP: per layer per micro-batch 4 AG + 4 RS (SP) or 4 AR of s*b*h
    m = lay.num_microbatches
    sbh = model.seq_len // lay.cp * lay.micro_batch_size * model.hidden * act  # each CP rank: s/cp
    layers_local = model.layers // lay.pp
    calls = 4 * layers_local * m
    if lay.tp > 1:
        if lay.sequence_parallel:
            cb.add("tp", "all_gather", sbh, lay.tp, count=calls, what="SP")
            cb.add("tp", "reduce_scatter", sbh, lay.tp, count=calls, what="SP")
        else:
            cb.add("tp", "all_reduce", sbh, lay.tp, count=calls, what="TP")
    if model.is_moe and lay.ep > 1:
        # each MoE layer sends every token to its top-k experts and back (dispatch, combine), in forward
        # and again in backward: 2 x topk x tokens x hidden each way per layer per micro-batch
        moe_local = model.moe_layers() // lay.pp
        cb.add("ep", "all_to_all", model.moe_router_topk * sbh // (lay.tp if lay.sequence_parallel else 1), lay.ep,
               count=4 * moe_local * m, what="token dispatch + combine, forward and backward")
    if lay.pp > 1:
        shard = sbh // (lay.tp if lay.sequence_parallel else 1)
        # the article's convention: activations forward and gradients backward, both counted; the
        # interleaved schedule crosses stages vp times per micro-batch
        cb.add_p2p("pp", 2 * m * lay.vp * shard, 0, what="activations each way")
    if lay.cp > 1:
        # CP as ring attention: each CP rank passes its K and V chunk (s/cp tokens, its TP share of
        # the kv heads) around the ring, cp-1 hops per attention in forward; backward passes K/V
        # again and their grads (dK, dV): 3*(cp-1) hops per layer per micro-batch, each way
        kv = 2 * (model.seq_len // lay.cp) * lay.micro_batch_size * model.kv_heads * model.head_dim * act // lay.tp
        cb.add_p2p("cp", kv, kv, what="ring attention K/V (+ dK/dV in backward)",
                   times=3 * (lay.cp - 1) * layers_local * m)
    s.comm = cb.build()
    if name == "megatron":
        # the peak: resident + Korthikanti et al.'s activations, with Megatron's recompute knobs (the
        # other frameworks' textbook peaks are their ledgers' issue-18 work)
        from ledger.faithful.megatron.peak import recompute_of

        rc = recompute_of(fw).granularity
        act = activation_bytes(model, lay, rc)
        s.peak = Peak(s.resident_bytes + act, {"resident": s.resident_bytes, "activations": act}, "backward",
                      "Korthikanti et al. 2022: first stage, min(p, m) micro-batches in flight"
                      + (f", {rc} recompute" if rc else ""))
    pl = Placement(framework=name, mode="textbook", model=lambda: model_dict(model), layout=lay.to_dict,
                   world=lay.world, rank_state=lambda r: s, representatives=[0])
    pl.notes.append("textbook: the design article's formulas; N_local = N/(tp*pp) split evenly")
    if name == "megatron":
        pl.notes.append("textbook peak: resident + Korthikanti et al.'s per-layer activations (34sbh + 5as^2b, "
                        "tp / SP / selective / full variants) x layers x micro-batches the first stage holds; no "
                        "temporaries, no logits, the same for every stage")
    if lay.cp > 1:
        pl.notes.append("textbook: CP attention as a plain K/V ring (3*(cp-1) hops per layer per micro-batch); "
                        "load balancing, causal-mask skips and all-gather variants are not in these formulas")
    return pl

