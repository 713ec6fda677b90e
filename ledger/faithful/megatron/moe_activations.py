"""What one micro-batch of a Megatron Core 0.18.0 MoE layer saves for backward and what its token
dispatcher keeps between steps (model.num_experts > 0): the MoE layer's part of the peak
(ledger.faithful.megatron.activations takes it for a layer whose MLP is an MoELayer). Paths under
megatron/core/transformer/moe/ unless said otherwise; measured with the peak probe's census on CPU
runs of the tiny MoE Llama (tests/test_megatron_moe.py, s = 512).

The rows a rank's local experts get follow the router (drop-less dispatch): the ledger predicts the
balanced case (every expert T_g * topk / E rows, T_g the tokens over the dispatcher's group) and
the bound from the fewest rows (every token's other choices elsewhere) to the most
(T_g * min(topk, local experts)) (`rows_range`); a peak's bound is the stage's peak at both ends (the
bytes only grow with the rows).

Per MoE layer and micro-batch, T the tokens entering the layer on this rank ([s/tp, b] with SP),
N = etp * ep the dispatcher's group, E the experts, E_l = E / ep the local ones, k = topk,
R the rows routed to the local experts, f the expert FFN / etp, p the probs' bytes (the activation
dtype: moe_router_dtype unset):
  router      router.py TopKRouter.routing -> moe_utils.py topk_routing_with_score_function: the top-k
              indices (int64 [T, k], saved by the scatter into the dense probs) and the fp32 softmax
              of the top-k logits ([T, k], saved by its backward); the router's linear saves its input,
              pre_mlp_layernorm's output (counted with the norm). With an aux loss
              (moe_aux_loss_coeff > 0): the fp32 softmax over every expert ([T, E]), the tokens per
              expert (int64 [E]) and the loss scale (fp32 [1]) (compute_routing_scores_for_aux_loss,
              switch_load_balancing_loss_func)
  dispatch    allgather (token_dispatcher.py MoEAllGatherTokenDispatcher.dispatch_postprocess): the
              local map's and local probs' transposed copies ([E_l, T*N], bool and p; masked_select
              saves both), the permuted tokens ([R, h], moe_utils.py permute: index_select, which
              saves its int64 [R] indices, the dispatcher's reversed mapping); the masked probs ([R], p)
              alltoall (MoEAlltoAllTokenDispatcher): permute's argsort of the transposed routing map
              (int64 [E*T]: the probs' gather keeps its storage through the first T*k entries), its
              sorted token indices (int64 [T*k], the reversed mapping), and after the all-to-all (and
              sort_chunks_by_idxs' cat) the tokens [R, h] and their probs [R]
  experts     experts.py SequentialMLP: each local expert an MLP (transformer/mlp.py) with the probs
              applied to its SwiGLU output: linear_fc1's output [R_i, 2f], silu of its first half, the
              second half's copy, their product, the product times the probs (linear_fc2's input):
              6 f elements a row (the dense MLP's 5 and the probs multiply)
  shared      shared_experts.py SharedExpertMLP (moe_shared_expert_hidden): a dense MLP of the
              shared FFN / tp over the layer's [s, b] tokens (the MLP group's rule)
What the dispatcher keeps as attributes until the layer's next forward (alive at every moment of a
step, `held`): allgather the local map ([T*N, E_l] bool), the masked probs and the reversed mapping;
alltoall the dense probs ([T, E], p) and routing map ([T, E] bool), the reversed mapping. A few
int64 [E] / [ep] counts per layer (under 200 B) are not modelled.
Not modelled: the capacity-padded alltoall (moe_pad_expert_input_to_capacity), the router in fp32
(moe_router_dtype), the experts' own backward moments beyond the MLP's fc2 / fc1 analogue
(`expert_moments`, no CPU job peaks there: from sources).
"""
from __future__ import annotations

from typing import NamedTuple

from ledger.dtypes import INT64 as I64, FP32 as F32
from ledger.layout import Layout
from ledger.model import ModelShape, routed_rows


class MoEShape(NamedTuple):
    """One rank's MoE layer, in elements (module docstring's names)."""
    E: int
    E_l: int
    k: int
    N: int
    ep: int
    f: int
    T: int
    h: int
    e: int  # the activation dtype's bytes (the probs' too: moe_router_dtype unset)
    allgather: bool
    aux: bool
    shared_f: int  # the shared expert's FFN / tp (0: none)
    sb: int  # the layer's [s, b] tokens (the shared expert's)
    rows: int  # R: the rows this rank's local experts get

    def with_rows(self, rows: int) -> "MoEShape":
        return self._replace(rows=rows)


def tokens(model: ModelShape, lay: Layout) -> int:
    """T: the tokens of one micro-batch on one rank (sequence-parallel shards with SP)."""
    return model.seq_len * lay.micro_batch_size // (lay.tp if lay.sequence_parallel else 1)


def moe_shape(model: ModelShape, lay: Layout, k, rows: str = "balanced") -> MoEShape:
    """The rank's MoE layer, its rows "balanced", "low" or "high" (rows_range)."""
    mo = MoEShape(model.num_experts, model.num_experts // lay.ep, model.moe_router_topk, lay.etp * lay.ep, lay.ep,
                  model.expert_ffn // lay.etp, tokens(model, lay), model.hidden, 2 if k.precision == "bf16" else 4,
                  k.moe_token_dispatcher_type == "allgather", k.moe_aux_loss_coeff > 0,
                  model.moe_shared_expert_hidden // lay.tp, model.seq_len * lay.micro_batch_size, 0)
    return mo.with_rows(dict(zip(("balanced", "low", "high"), rows_range(mo)))[rows])


def mlp_saved(e: int, rows: int, f: int, probs: bool = False) -> int:
    """What a gated (SwiGLU) MLP of width f saves over `rows` tokens (transformer/mlp.py MLP.forward:
    linear_fc1's output, 2 f, silu of its first half, the second half's copy, their product, each the
    activation dtype), and with an expert's probs (per_token_scale) the product times them, f more."""
    return (5 + probs) * e * rows * f


def rows_range(mo: MoEShape) -> tuple[int, int, int]:
    """(balanced, low, high) rows of the rank's local experts: T_g = T * N tokens over the dispatcher's
    group, each routed to k distinct experts; balanced every expert T_g * k / E (the local ones E_l of
    them); at most each token once per local expert, at least its k choices less those the other
    E - E_l experts can take (with ep = 1 every row: T * k)."""
    return routed_rows(mo.T * mo.N, mo.k, mo.E, mo.E_l)


def router_saved(mo: MoEShape) -> int:
    aux = (F32 * mo.T * mo.E + I64 * mo.E + F32) if mo.aux else 0
    return I64 * mo.T * mo.k + F32 * mo.T * mo.k + aux


def dispatch_saved(mo: MoEShape) -> int:
    """The dispatcher's saves freed by the layer's backward (the reversed mapping and the masked probs
    of the allgather dispatcher stay with it: `held`)."""
    R, e = mo.rows, mo.e
    if mo.allgather:
        return (1 + e) * mo.E_l * mo.T * mo.N + e * R * mo.h
    return I64 * mo.E * mo.T + e * R * mo.h + e * R


def held(mo: MoEShape) -> int:
    """What the dispatcher keeps as attributes until its next forward (module docstring)."""
    R, e = mo.rows, mo.e
    if mo.allgather:
        return mo.T * mo.N * mo.E_l + e * R + I64 * R
    return e * mo.T * mo.E + mo.T * mo.E + I64 * mo.T * mo.k


def experts_saved(mo: MoEShape) -> int:
    return mlp_saved(mo.e, mo.rows, mo.f, probs=True)


def shared_saved(mo: MoEShape) -> int:
    return mlp_saved(mo.e, mo.sb, mo.shared_f)


def moe_groups(mo: MoEShape) -> dict[str, int]:
    """The MoE layer's saves by part, in forward order (held excluded)."""
    g = {"router": router_saved(mo), "dispatch": dispatch_saved(mo), "experts": experts_saved(mo)}
    if mo.shared_f:
        g["shared expert"] = shared_saved(mo)
    return g


def experts_cat(mo: MoEShape) -> int:
    """SequentialMLP.forward's temporaries at its torch.cat: the local experts' outputs ([R_i, h] each)
    and the cat's [R, h]."""
    return 2 * mo.e * mo.rows * mo.h


def forward_locals(mo: MoEShape) -> int:
    """What moe_layer.py MoELayer.forward's custom_forward holds while the experts run: the router's
    routing map ([T, E] bool; alltoall: the dispatcher's own, in held) and, allgather, the probs
    all-gathered over the group ([T*N, E], p)."""
    if mo.allgather:
        return mo.T * mo.E + mo.e * mo.T * mo.N * mo.E
    return 0


def expert_moments(mo: MoEShape, gin: int) -> list[tuple[str, int]]:
    """(name, temporaries) of the MoE layer's backward at its last local expert's linear_fc2 and
    linear_fc1 (the MLP's rule, tensor_parallel/layers.py backward: the input grad, then the weight
    grad in the activation dtype), its rows the balanced share R / E_l; the combine's backward grads
    live beside them: the output grad un-permuted to the rows ([R, h]) and, allgather, the all-gathered
    output grad ([T*N, h]). From sources: no CPU job peaks here."""
    e, f, h = mo.e, mo.f, mo.h
    ri = mo.rows // mo.E_l if mo.E_l else 0
    comb = e * mo.rows * h + (e * mo.T * mo.N * h if mo.allgather else 0)
    return [("experts fc2", gin + comb + e * ri * f + e * h * f),
            ("experts fc1", gin + comb + e * ri * 2 * f + e * ri * h + e * 2 * f * h)]
