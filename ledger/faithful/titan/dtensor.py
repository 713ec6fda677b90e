"""DTensor's backward of torchtitan 0.3.0's TP linears (torch 2.13, the partial_dtensor backend): the mm
strategies of torch/distributed/tensor/_ops/_matrix_ops.py, the choice among them of _sharding_prop.py
_select_min_cost_strategy, priced by _collective_utils.py's redistribute cost model, and what one
TransformerBlock's backward then redistributes (layer_backward_comm: comm.py's TP collectives, the
Placement's notes). The derivation of the placements entering the backward is below.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ledger.dtypes import BF16
from ledger.model import ModelShape


# -- DTensor backward of the TP linears (torch 2.13, partial_dtensor: activations stay DTensors on
# the 1-D tp mesh inside every block, so each aten op of the backward goes through sharding
# propagation, torch/distributed/tensor/_dispatch.py OpDispatcher -> _sharding_prop.py) ------------
#
# Placements entering the backward (models/common/decoder_sharding.py, protocols/module.py):
#   colwise wq wk wv w1 w3: W Shard(0) [out, in], input x Replicate, output Shard(-1);
#   rowwise wo w2: W Shard(1), input Shard(-1), output Partial -> Replicate (forward all-reduce),
#   with SP Partial -> Shard(1) (forward reduce-scatter).
#   No SP: the gradient reaching a rowwise output is Partial: components/loss.py
#   GradAccumulator.result hands the hidden grad back Partial(sum), the norms' and colwise inputs'
#   grads are Partial and add(P, P) stays P, so the residual stream's grad is Partial down to
#   tok_embeddings.
#   SP: the rowwise output's Partial -> Shard(1) runs backward as Shard(1) -> Replicate
#   (_redistribute.py _redistribute_backward), so the gradient reaching a rowwise output is
#   Replicate; the colwise inputs' Partial grads meet the block input's Shard(1) -> Replicate
#   backward (a reduce-scatter, counted in comm.py _tp_comm).
#   Colwise outputs get a Shard grad: q/k/v from inner attention's local_map in_grad_placements
#   Shard(2) (set_gqa_inner_attention_local_map), w1/w3 from SwiGLU's elementwise backward.
# nn.Linear on a 3-D input runs t + view + aten.mm; MmBackward0 (derivatives.yaml, FunctionsManual
# mm_mat1_backward / mm_mat2_backward) computes grad_x2d = mm(g, W) and, W.t() being column-major,
# grad_Wt = mm(g.t(), x2d).t(). Each mm picks a strategy of _ops/_matrix_ops.py
# gen_single_dim_einsum_strategies("mk,kn->mn") (all-Replicate inserted first,
# single_dim_strategy.py) by _sharding_prop.py _select_min_cost_strategy, priced by
# _collective_utils.py redistribute_cost; the chosen input redistributions are the collectives.
# The weight grad then meets FSDP's _fsdp_param.py _get_grad_inner_tensor, which redistributes it
# to the param's TP placement (Partial -> Shard = reduce-scatter).

# mk,kn->mn strategies over one mesh dim, (out, mat1, mat2), in the order the propagator sees them
_MM = (("R", "R", "R"), ("P", "S1", "S0"), ("S0", "S0", "R"), ("S1", "R", "S1"),
       ("P", "P", "R"), ("P", "R", "P"), ("Pavg", "Pavg", "R"), ("Pavg", "R", "Pavg"))
_MM_MAT1, _MM_MAT2 = (tuple(dict.fromkeys(st[i] for st in _MM)) for i in (1, 2))
# _collective_utils.py MeshTopoInfo.build_from_mesh: 87.7 GB/s and 0.6 us per hop within a host; a
# mesh dim with more devices than num_devices_per_host (torch.<device>.device_count(): 1 for cpu)
# gets 0.22x the bandwidth and 2.7 us. The ledger is checked against CPU/gloo runs: one per host.
DEVICES_PER_HOST = 1


def _coll_cost(kind: str, nbytes: float, n: int) -> float:
    """_collective_utils.py allgather_cost / allreduce_cost / reduce_scatter_cost, in us."""
    bw, lat = (87.7, 0.6) if n <= DEVICES_PER_HOST else (87.7 * 0.22, 2.7)
    hops = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return 6.6 + hops * lat + (nbytes / 1024 ** 3 * hops / n) / bw * 1e6


def _transition(cur: str, tgt: str) -> tuple[str | None, bool, str | None] | None:
    """_collective_utils.py _compute_placement_transition_cost on one mesh dim, by placements alone:
    (the collective it is priced as, priced on the 1/n local shard plus a 1.0 penalty, the
    collective redistribute_local_tensor then runs on a device mesh that has all-to-all: a cpu mesh
    runs Shard -> Shard otherwise, _executed); (None, False, None) free, None banned."""
    if cur == tgt or cur == "R":  # Replicate -> Shard / Partial: a local chunk or view
        return None, False, None
    if cur[0] == "S" and tgt == "R":
        return "all_gather", False, "all_gather"
    if cur[0] == "S" and tgt[0] == "S":  # all-to-all priced as a local all-gather + 1.0 penalty
        return "all_gather", True, "all_to_all"
    if cur == "P" and tgt == "R":
        return "all_reduce", False, "all_reduce"
    if cur == "P" and tgt[0] == "S":
        return "reduce_scatter", False, "reduce_scatter"
    return None  # Shard -> Partial, Partial -> another Partial: banned


@lru_cache(maxsize=1024)
def _transition_costs(transitions: tuple, numel_full: int, n: int) -> tuple[float, ...]:
    """_collective_utils.py redistribute_cost of each allowed _transition of one bf16 tensor (cached:
    a layer's backward hands several mm's the same gradient)."""
    full = numel_full * BF16
    return tuple([0.0 if priced is None else _coll_cost(priced, full / n, n) + 1.0 if local
                  else _coll_cost(priced, full, n) for priced, local, _ in transitions])


def _move(cur: str, tgt: str, numel_full: int, n: int) -> tuple[float, str | None]:
    """redistribute_cost on one mesh dim (bf16 tensors): cost and the collective
    redistribute_local_tensor then runs (inf where the transition is banned)."""
    t = _transition(cur, tgt)
    if t is None:
        return float("inf"), None
    return _transition_costs((t,), numel_full, n)[0], t[2]


def _mm(a: tuple[str, int], b: tuple[str, int], n: int) -> tuple[str, list[tuple[str, int]], bool]:
    """aten.mm on DTensors (placement, full numel) a @ b: the output placement, the collectives, and
    whether the choice was priced (no strategy took the inputs as they are).
    _sharding_prop.py _select_min_cost_strategy: a strategy needing no redistribution first, then
    the first zero-cost one, else the first of minimal summed cost."""
    move_a = {t: _move(a[0], t, a[1], n) for t in _MM_MAT1}  # each input to what the strategies ask
    move_b = {t: _move(b[0], t, b[1], n) for t in _MM_MAT2}
    best = None
    for out, pa, pb in _MM:
        (ca, ka), (cb_, kb) = move_a[pa], move_b[pb]
        cost = ca + cb_
        if (pa, pb) == (a[0], b[0]):
            cost = -1.0  # no redistribution at all: taken before any other
        if best is None or cost < best[0]:
            best = (cost, out, ka, kb)
    cost, out, ka, kb = best
    return out, [(k, numel) for k, numel in ((ka, a[1]), (kb, b[1])) if k], cost >= 0


# (mat1, mat2) placements of each _MM strategy -> its output (the pairs are distinct)
_MM_AS_IS = {(pa, pb): out for out, pa, pb in _MM}


@lru_cache(maxsize=64)
def _mm_plan(pa: str, pb: str) -> tuple[tuple, tuple, tuple[tuple[int, int, int], ...]]:
    """Pricing an mm whose inputs are placed (pa, pb), by placements alone: each input's distinct
    transitions (_transition) to what the strategies ask of it, and the strategies with no banned
    move (the others cost inf) in _MM's order, as (strategy, mat1 transition, mat2 transition)
    indices."""
    ta: list = []
    tb: list = []
    allowed = []
    for s, (_, a, b) in enumerate(_MM):
        t_a, t_b = _transition(pa, a), _transition(pb, b)
        if t_a is not None and t_b is not None:
            for ts, t in ((ta, t_a), (tb, t_b)):
                if t not in ts:
                    ts.append(t)
            allowed.append((s, ta.index(t_a), tb.index(t_b)))
    return tuple(ta), tuple(tb), tuple(allowed)


def _mm_fast(a: tuple[str, int], b: tuple[str, int], n: int) -> tuple[str, list[tuple[str, int]], bool]:
    """_mm without its loop: where a strategy takes the inputs as they are, its cost -1.0 is below
    every priced one (>= 0), so _mm keeps it (no collective, not priced); else _mm keeps the first
    strategy of minimal summed cost, which min and index find among those with no banned move
    (_mm_plan: an inf total is never the minimum unless all are, and then _mm's own loop decides).
    Test: equal to _mm."""
    out = _MM_AS_IS.get((a[0], b[0]))
    if out is not None:
        return out, [], False
    ta, tb, allowed = _mm_plan(a[0], b[0])
    if not allowed:
        return _mm(a, b, n)
    ca, cb = _transition_costs(ta, a[1], n), _transition_costs(tb, b[1], n)
    total = [ca[i] + cb[j] for _, i, j in allowed]
    s, i, j = allowed[total.index(min(total))]
    return _MM[s][0], [(k, numel) for k, numel in ((ta[i][2], a[1]), (tb[j][2], b[1])) if k], True


def _executed(kind: str, cpu_mesh: bool) -> str:
    """The collective a redistribution runs: on a "cpu" device mesh (gloo, and the fake world's) torch
    has no all-to-all for Shard(i) -> Shard(j): _collective_utils.py shard_dim_alltoall gathers the
    whole tensor (funcol.all_gather_single) and keeps the rank's chunk (Shard._custom_chunk), "Gloo does
    not support alltoall"; a cuda mesh (NCCL) runs all_to_all_single. The cost model prices both alike."""
    return "all_gather" if cpu_mesh and kind == "all_to_all" else kind


@dataclass(frozen=True)
class RowwiseBackward:
    """One rowwise linear's (wo's or w2's) two backward mms as DTensor runs them: the placement each grad
    leaves its mm with ("P": a TP-full Partial tensor on every TP rank) and the redistributions of the mm's
    inputs that its strategy asks for, (kind, full numel)."""
    name: str  # "wo" | "w2"
    k: int  # the input's width: q (heads x head_dim) or ffn_hidden
    weight_grad: str  # grad W = mm(g.t(), x2d), [hidden, k]
    weight_moves: tuple
    input_grad: str  # grad x2d = mm(g, W), [T, k]
    input_moves: tuple
    priced: bool  # either mm's strategy was chosen by DTensor's cost model


@lru_cache(maxsize=1024)
def rowwise_backward(model: ModelShape, T: int, tp: int, sp: bool = False) -> tuple[RowwiseBackward, ...]:
    """The rowwise linears' backward mms (wo, then w2): the one home of DTensor's per-weight choice, which
    layer_backward_moves (the collectives), partial_weight_grads, wo_input_grad_gathers_weight and
    w2_grad_placements (the peaks' buffers) read. Rowwise: g [T, h], x2d [T, k] Shard(1), W [h, k] Shard(1);
    the grad reaching a rowwise output is Partial without SP, Replicate with it (the derivation above)."""
    h = model.hidden
    g_row = "R" if sp else "P"
    out = []
    for name, k in (("wo", model.heads * model.head_dim), ("w2", model.ffn_hidden)):
        o_w, m_w, pr_w = _mm_fast((g_row, h * T), ("S1", T * k), tp)
        o_x, m_x, pr_x = _mm_fast((g_row, T * h), ("S1", h * k), tp)
        out.append(RowwiseBackward(name, k, o_w, tuple(m_w), o_x, tuple(m_x), pr_w or pr_x))
    return tuple(out)


def partial_weight_grads(model: ModelShape, T: int, tp: int, sp: bool = False) -> tuple[str, ...]:
    """The rowwise weights (of wo, w2) whose weight grad leaves its mm Partial (layer_backward_moves' PARAM
    moves): a TP-full [hidden, k] tensor on every TP rank until FSDP's post-backward redistributes it to its
    Shard(1) placement."""
    return tuple(r.name for r in rowwise_backward(model, T, tp, sp) if r.weight_grad == "P")


def wo_input_grad_gathers_weight(model: ModelShape, T: int, tp: int, sp: bool = False) -> bool:
    """Whether DTensor's strategy for wo's input grad (mm(grad, W), W [hidden, q] Shard(1)) all-gathers W
    (layer_backward_moves' INPUT all-gather of hidden x q): Shard(1) -> Replicate, which gathers on dim 0 and
    cats the chunks along dim 1 (placement_types.py _to_replicate_tensor), two [hidden, q] buffers."""
    wo = rowwise_backward(model, T, tp, sp)[0]
    return ("all_gather", model.hidden * wo.k) in wo.input_moves


def w2_grad_placements(model: ModelShape, T: int, tp: int, sp: bool = False) -> tuple[str, str]:
    """The placements w2's weight grad and input grad leave their mms with (layer_backward_comm's choice):
    "P" is a full-size Partial tensor on every TP rank, [hidden, ffn] and [T, ffn]."""
    w2 = rowwise_backward(model, T, tp, sp)[1]
    return w2.weight_grad, w2.input_grad


# the roles of layer_backward_moves' collectives: a weight grad's mm inputs, an input grad's mm inputs
# and the redistributions of the grad that follow it, FSDP's post-backward move of a weight grad to
# its param's placement (with PP once per step, on the accumulated fp32 grad: pp.py)
WEIGHT, INPUT, PARAM = "weight", "input", "param"


@lru_cache(maxsize=1024)
def layer_backward_comm(model: ModelShape, T: int, tp: int, sp: bool = False, cpu_mesh: bool = True
                        ) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...], bool]:
    """Collectives (kind, full numel) one TransformerBlock's TP linears cause in backward, the
    paths this derivation does not cover (named in the Placement's notes), and whether any mm's
    strategy was chosen by DTensor's cost model (else every mm took its inputs as they came).
    cpu_mesh: the TP mesh's device type is cpu (the target's rules: target.py), where a Shard -> Shard
    redistribution runs as an all-gather (_executed)."""
    moves, undone, priced = layer_backward_moves(model, T, tp, sp, cpu_mesh)
    return tuple((k, n) for k, n, _ in moves), undone, priced


@lru_cache(maxsize=1024)
def layer_backward_moves(model: ModelShape, T: int, tp: int, sp: bool = False, cpu_mesh: bool = True
                         ) -> tuple[tuple[tuple[str, int, str], ...], tuple[str, ...], bool]:
    """layer_backward_comm with each collective's role (WEIGHT, INPUT, PARAM): what a pipeline stage
    runs per micro-batch (WEIGHT, INPUT), in its backward metadata inference (INPUT: autograd.grad of
    the stage input alone) and once per step (PARAM)."""
    h = model.hidden
    out: list[tuple[str, int, str]] = []
    undone: list[str] = []
    priced = False
    for r in rowwise_backward(model, T, tp, sp):
        name, k = r.name, r.k
        out += [(kind, n, WEIGHT) for kind, n in r.weight_moves]
        priced |= r.priced
        if r.weight_grad == "P":  # FSDP _get_grad_inner_tensor: Partial -> Shard(1)
            out.append(("reduce_scatter", h * k, PARAM))
        elif r.weight_grad not in ("S1", "R"):
            undone.append(f"{name} weight grad leaves mm as {r.weight_grad}")
        out += [(kind, n, INPUT) for kind, n in r.input_moves]
        o = r.input_grad
        if name == "wo" and o == "P":  # -> inner attention's local_map in_grad Shard(2) (heads)
            out.append(("reduce_scatter", T * k, INPUT))
        elif name == "w2" and o == "P":
            # SwiGLU's backward (silu(w1 x) * w3 x): each factor's grad is mul(grad, the other factor), a
            # Partial times a Shard(2): the propagator reduce-scatters the Partial grad to Shard(2) for
            # each of the two muls (aten.mul.Tensor P -> S(2)); measured: tp4 no SP, hidden 640, ffn
            # 1792, T 640 (tests/test_titan.py), two [T, ffn] reduce-scatters per layer
            out += [("reduce_scatter", T * k, INPUT)] * 2
        elif o not in ("S1", "R"):
            undone.append(f"{name} input grad leaves mm as {o} (the {'SwiGLU' if name == 'w2' else 'attention'} "
                          "backward that follows is not derived)")
    # colwise wq wk wv (or wqkv) w1 w3 (g [T,k] Shard(1)): grad W = mm(g.t(), x2d) meets (S0, R) and grad x2d =
    # mm(g, W) meets (S1, S0), each a strategy's own inputs (_MM_AS_IS; test), so every shape takes them
    # as they come: W's Shard(0) grad and the Partial residual grad, no collective, nothing priced
    return tuple((_executed(k, cpu_mesh), n, role) for k, n, role in out), tuple(undone), priced
