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

from ledger import frameworks
from ledger.layout import Layout
from ledger.memory import StateBytes
from ledger.model import ModelShape, model_dict
from ledger.placement import CommBuilder, Placement, RankState


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
    rules = frameworks.get(name).textbook  # the framework's own formulas: ledger/faithful/<name>/textbook.py
    # MoE: the routed experts split over ep (each expert's FFN over etp), the rest over tp as for a
    # dense model; both over the pipeline stages
    n_expert = model.routed_expert_params() // (lay.ep * lay.etp * lay.pp)
    n_dense = (st.num_params - model.routed_expert_params()) // (lay.tp * lay.pp)
    nd = lay.dp * (lay.cp if rules.DP_OVER_CP else 1)
    dp_dim = "cp-dp" if rules.DP_OVER_CP and lay.cp > 1 else "dp"
    s = RankState()
    cb = CommBuilder()
    act = 2  # bf16 activations
    rules.state(s, cb, st, lay, fw, n_dense, n_expert, nd, dp_dim)
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
    if rules.peak is not None:
        s.peak = rules.peak(model, lay, fw, s.resident_bytes)
    pl = Placement(framework=name, mode="textbook", model=lambda: model_dict(model), layout=lay.to_dict,
                   world=lay.world, rank_state=lambda r: s, representatives=[0])
    pl.notes.append("textbook: the design article's formulas; N_local = N/(tp*pp) split evenly")
    pl.notes.extend(rules.NOTES)
    if lay.cp > 1:
        pl.notes.append("textbook: CP attention as a plain K/V ring (3*(cp-1) hops per layer per micro-batch); "
                        "load balancing, causal-mask skips and all-gather variants are not in these formulas")
    return pl

