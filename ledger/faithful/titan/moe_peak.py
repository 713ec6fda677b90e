"""The peak within a steady step of a torchtitan 0.3.0 rank training its MoE model (qwen3) with expert
parallelism (ep > 1; without it the dense moments of peak.py hold, moe.py). Paths under torch/ or
torchtitan/.

What EP changes in the step (measured with the peak probe's event lists, tests/test_titan_moe.py):
- grads are set to None every step: trainer.py zero_grad(set_to_none=training.disable_cuda_graphs), and
  CUDA graphs refuse EP (launchers/titan.py sets it, trainer.py _validate_cuda_graphs): a unit's sharded
  grads exist from its reduce-scatter on, as in a first step (peak.FirstStep);
- a block has two FSDP param groups (distributed/fsdp.py: the experts on the efsdp mesh, the rest on
  fsdp), each all-gathered (backward prefetch: the block before's dense group and, efsdp > 1, its
  experts; efsdp = 1 casts the experts' shards into their unsharded bf16 params at the block's own
  pre-backward, no buffer) and reduced on its own: the experts' group first, then the dense one;
  _fsdp_param_group.py post_backward lets only a state's last group reclaim the shared
  reduce_scatter_states (reduce_scatter_max_input_buffers 1), so the experts' reduce-scatter input
  stays held beside the dense one's until the next block's experts reduce (both the block after's
  while a block's backward runs). With efsdp = 1 the experts' "reduce-scatter" is foreach_reduce's
  `reduce_scatter_input / gradient_divide_factor` copied into a new grad (no collective);
- the MoE layer's backward starts at the combine (token_dispatcher.py combine: scatter_add's backward
  gathers the output grad [N, hidden], the fp32 cast's backward makes it fp32, and the score
  multiplication's backward makes two fp32 [N, hidden] products and their row sums): the moment the
  probe measured as the step's peak on every rank of the EP jobs.

The moments per block j, backward order (the last block first), beside lm_head's reduce-scatter, a loss
chunk's backward and the final norm's (peak.py's, with the grads reduced so far and the block's two
groups): the combine backward (_at_combine), the experts' reduce-scatter (_at_experts_rs), the dense
group's (_at_dense_rs); with activation checkpointing a block keeps its input (SelectiveAC also its
policy's kept outputs, moe_activations.sac_kept), and its recompute's combine forward
(_at_recompute_combine) is a moment too; without checkpointing the block's own forward combine
(_at_forward_combine), the runner-up to its combine backward that routing can put on top. Routed rows
follow the router: the peak is predicted at balanced routing (every
block's experts compute T*k rows) and bounded from the fewest to the most rows (Peak.bound).
"""
from __future__ import annotations

from dataclasses import replace
from math import prod
from typing import NamedTuple

from ledger.dtypes import BF16, FP32 as F32, INT64 as I64
from ledger.faithful.titan import moe_activations
from ledger.faithful.titan import peak as titan_peak
from ledger.faithful.titan.fsdp import block_params, chunk_rows, sharded, unit_params
from ledger.faithful.titan.target import Rules
from ledger.model import routed_rows
from ledger.placement import Peak


class EPUnits(NamedTuple):
    """One rank's FSDP units under EP, in elements: padded full numels (what all-gathers and
    reduce-scatters move) and unsharded numels (the bf16 params FSDP2 allocates)."""
    ds: int  # the dense fsdp degree (dp_shard)
    efsdp: int  # the experts' FSDP degree
    dense_full: int  # one block's dense group over ds
    expert_full: int  # one block's local experts over efsdp
    dense_numel: int
    expert_numel: int
    emb_full: int
    emb_numel: int
    norm_full: int
    lm_full: int
    head_numel: int  # [norm, lm_head] unsharded

    def grad_shards(self, units: list[str]) -> int:
        """fp32 bytes of this rank's sharded grads of the named units (dim-0 padded shards)."""
        per = {"lm_head": self.lm_full // self.ds, "norm": self.norm_full // self.ds,
               "dense": self.dense_full // self.ds, "experts": self.expert_full // self.efsdp,
               "emb": self.emb_full // self.ds}
        return sum(per[u] for u in units) * F32


def ep_units(model, lay) -> EPUnits:
    ds, ep = lay.dp_shard, lay.ep
    efsdp = ds // ep
    dense, expert = block_params(model)
    local = [(s[0] // ep, *s[1:]) for s in expert]

    def full(shapes, n):
        return sum(chunk_rows(s[0], n) * n * prod(s[1:]) for s in shapes)

    sh = sharded(model, 1, ds)
    emb, _, head = unit_params(model, 1)
    return EPUnits(ds, efsdp, full(dense, ds), full(local, efsdp), sum(prod(s) for s in dense),
                   sum(prod(s) for s in local), sh.emb_full, sum(prod(p.shape) for p in emb), sh.norm_full,
                   sh.lm_full, sum(prod(p.shape) for p in head))


class _Common(NamedTuple):
    """What every moment of one rank shares."""
    base: int  # params, optimizer state and buffers (the state less its grads)
    saves: tuple[int | None, ...]  # each block's saves at its rows (None: unknown); checkpointed: its recompute's
    kept: tuple[int | None, ...]  # what each block holds while the backward runs above it (checkpointed: its input)
    ctx: int  # what a checkpointed block holds beside its recompute's saves in its own backward: its input
    cached: tuple[dict | None, ...]  # SelectiveAC: each block's kept outputs by part (moe_activations.sac_kept)
    batch: int  # the batch's saved ids, labels and the valid-token count
    small: int  # the batch's other small tensors (peak.batch_bytes less the saved ones and a norm's grad)
    resid: int  # the residual-stream grad, bf16 [T, hidden]


def _common(model, lay, fw, st, rules: Rules, rows: tuple[int, ...]) -> _Common:
    B, S = lay.micro_batch_size, model.seq_len
    saves = tuple(None if r is None else sum(moe_activations.block_saves(model, B, S, rules, lay.ep, r).values())
                  for r in rows)
    # activation checkpointing (FullAC's and SelectiveAC's checkpoint_wrapper): a block keeps its input (bf16
    # [T, hidden]) through the step, its saves only while its recompute's backward runs; SelectiveAC also
    # the outputs its policy keeps
    checkpointed = fw.activation_checkpoint != "none"
    inp = B * S * model.hidden * BF16 if checkpointed else 0
    kept = (inp,) * len(rows) if checkpointed else saves
    cached = tuple(None if r is None else _by_part(moe_activations.sac_kept(model, B, S, rules, lay.ep, r))
                   for r in rows) if fw.activation_checkpoint == "selective" else ({},) * len(rows)
    batch = titan_peak.batch_saved_bytes(B, S, fw.activation_checkpoint, lay.tp)
    # (batch_bytes counts a norm weight's bf16 grad, live at the dense moments it was measured at; the EP
    # moments name the grads they hold)
    return _Common(st.params_bytes + st.optim_bytes + st.other_bytes, saves, kept, inp, cached, batch + I64,
                   titan_peak.batch_bytes(model, B, S, rules.loader_on_device) - batch - model.hidden * BF16,
                   B * S * model.hidden * BF16)


def _by_part(lines: dict[str, int]) -> dict[str, int]:
    """Named lines ("part/name") summed by part."""
    out: dict[str, int] = {}
    for key, v in lines.items():
        out[key.split("/", 1)[0]] = out.get(key.split("/", 1)[0], 0) + v
    return out


def _block_grads(u: EPUnits, after: int, layers: int) -> list[str]:
    """The units reduced before block `after`'s backward: lm_head, the norm, the blocks after it."""
    return ["lm_head", "norm"] + ["dense", "experts"] * (layers - 1 - after)


def _held_states(u: EPUnits, j: int, layers: int) -> dict[str, int]:
    """The reduce-scatter inputs held while block j's backward runs (the module docstring): the block
    after's two groups' (the experts' a buffer of the probe's "gathered" only where a collective ran),
    or, for the last block, the final norm's."""
    if j == layers - 1:
        return {"gathered/the final norm's reduce-scatter input held": u.norm_full * F32}
    part = "gathered" if u.efsdp > 1 else "temporary"
    return {"gathered/the block after's dense reduce-scatter input held": u.dense_full * F32,
            f"{part}/the block after's experts' reduce-scatter input held": u.expert_full * F32}


def _prefetched(u: EPUnits, j: int, reshard: bool) -> dict[str, int]:
    """The block before's all-gather outputs (bf16) prefetched while block j's backward runs; before
    block 0, tok_embeddings'."""
    if not reshard:
        return {}
    if j == 0:
        return {"gathered/tok_embeddings' all-gather (backward prefetch)": u.emb_full * BF16}
    return {"gathered/the block before's dense all-gather (backward prefetch)": u.dense_full * BF16,
            "gathered/the block before's experts' all-gather (backward prefetch)":
                u.expert_full * BF16 if u.efsdp > 1 else 0}


def _unsharded(u: EPUnits, j: int, reshard: bool, this_block: bool) -> int:
    """bf16 unsharded params live in block j's backward: its own (this_block: before its reshard), and
    with reshard_after_forward "never" the blocks before and tok_embeddings."""
    block = u.dense_numel + u.expert_numel
    return ((block if this_block else 0) + (0 if reshard else j * block + u.emb_numel)) * BF16


def _moment(c: _Common, grads: int, unsharded: int, below: int, lines: dict[str, int], what: str,
            phase: str = "backward") -> Peak:
    """A moment in block `below`'s backward (or, past it, block below - 1's post-backward; phase
    "forward": in its forward): what the blocks under it keep, the named lines."""
    # (the batch's small tensors counted for the backward include the loss's two fp32 scalars its backward
    # makes: not there yet in the forward)
    small = c.small - (2 * F32 if phase == "forward" else 0)
    detail = {"resident/state less its grads": c.base, "resident/the grads reduced so far": grads,
              "resident/unsharded params (bf16)": unsharded,
              f"activations/{below} blocks below (saved, or their inputs where checkpointed)": sum(c.kept[:below]),
              "activations/the batch on the device, the valid-token count": c.batch,
              f"temporary/batch, document mask, scalars{' (before the loss)' if phase == 'forward' else ''}": small,
              "unnamed/scalars live from the previous step": titan_peak.UNNAMED}
    for part in ("temporary", "gathered"):
        detail[f"{part}/{below} blocks below: SelectiveAC's kept outputs"] = sum(x.get(part, 0) for x in c.cached[:below])
    detail.update({k: v for k, v in lines.items() if v})
    parts = {p: 0 for p in ("resident", "activations", "gathered", "temporary", "unnamed")}
    for k, v in detail.items():
        parts[k.split("/", 1)[0]] += v
    return Peak.of(parts, phase=phase, what=what, detail={k: v for k, v in detail.items() if v})


def _at_combine(model, lay, fw, u: EPUnits, c: _Common, j: int) -> Peak:
    """Block j's MoE backward at the combine's score-multiplication backward (its row sums)."""
    L, h = model.layers, model.hidden
    N = lay.micro_batch_size * model.seq_len * model.moe_router_topk
    reshard = fw.reshard_after_forward in ("default", "always")
    # a checkpointed block's recompute keeps what it recomputed in the checkpoint's frame (the probe's
    # `temporary`), its input saved by the checkpoint (`activations`)
    lines = {**_held_states(u, j, L), **_prefetched(u, j, reshard),
             f"{'temporary' if c.ctx else 'activations'}/layers.{j}'s saves{' (its recompute)' if c.ctx else ''}":
                 c.saves[j],
             "activations/its input (the checkpoint's)": c.ctx,
             "temporary/the residual-stream grad (bf16)": c.resid,
             "temporary/combine backward: the grad in fp32, two fp32 products, their row sums":
                 3 * N * h * F32 + N * F32}
    return _moment(c, u.grad_shards(_block_grads(u, j, L)), _unsharded(u, j, reshard, True), j, lines,
                   f"layers.{j}: the MoE combine's backward{' in its recompute' if c.ctx else ''} (token_dispatcher.py)")


def _combine_cast(model, lay, rows: int) -> dict[str, int]:
    """What a block's combine holds at its cast back to bf16, forward or recompute (token_dispatcher.py
    combine: `(routed_output_RD.to(float32) * scores).to(routed_output_RD.dtype)` into out_TD's zeros):
    the product by the scores (fp32 [N, hidden]), the cast (bf16), out_TD, w2's grouped_mm output
    [R, hidden] (the unpermute's source) and the attention's residual sum h (live until the block's last
    add)."""
    h, T = model.hidden, lay.micro_batch_size * model.seq_len
    N = T * model.moe_router_topk
    return {"temporary/its product by the scores (fp32), the cast back (bf16), out_TD's zeros":
                N * h * F32 + N * h * BF16 + T * h * BF16,
            "temporary/w2's grouped_mm output (bf16 [R, hidden]), the residual sum h": rows * h * BF16 + T * h * BF16}


def _at_recompute_combine(model, lay, fw, u: EPUnits, c: _Common, j: int, rows: int) -> Peak:
    """Full activation checkpointing: block j's recompute forward at its combine's cast back to bf16
    (_combine_cast, the all-to-all's output [N, hidden] still held) beside the recompute's saves so far (all but the scatter's: they are in its checkpoint frame), the routing map and the token
    counts' all-to-all output, and what every moment of block j's backward holds. Measured (ep2 at world 2,
    s = 512): the step's peak, at block 0's, 2,080 B of the recompute's small tensors not named."""
    L, h = model.layers, model.hidden
    T = lay.micro_batch_size * model.seq_len
    N = T * model.moe_router_topk
    reshard = fw.reshard_after_forward in ("default", "always")
    lines = {**_held_states(u, j, L), **_prefetched(u, j, reshard),
             f"temporary/layers.{j}'s saves (its recompute)": c.saves[j],
             "activations/its input (the checkpoint's)": c.ctx,
             "temporary/the residual-stream grad (bf16)": c.resid,
             # (SelectiveAC: the combine's output from its cache; the token counts' consumed)
             "gathered/the combine all-to-all's output (bf16 [N, hidden]), the token counts' (int64 [E])":
                 N * h * BF16 + (model.num_experts * I64 if fw.activation_checkpoint == "full" else 0),
             "temporary/the routing map (bool [T, E])": T * model.num_experts,
             **_combine_cast(model, lay, rows)}
    return _moment(c, u.grad_shards(_block_grads(u, j, L)), _unsharded(u, j, reshard, True), j, lines,
                   f"layers.{j}: its recompute's combine (token_dispatcher.py), the cast back to bf16")


def _forward_all_gathers(u: EPUnits, j: int, layers: int) -> dict[str, int]:
    """bf16 all-gather outputs live in block j's forward after its pre-forward. With EP torchtitan sets
    explicit forward prefetch (distributed/fsdp.py: each block set_modules_to_forward_prefetch([the next
    block]), the last [norm, lm_head]): the next block's two groups (the experts' an all-gather only over
    efsdp > 1), or the [norm, lm_head] unit's. And FSDP2's deferred free (_fsdp_param_group.py
    wait_for_unshard: a synchronous forward copy-out over more than one rank keeps its all-gather result in
    comm_ctx.all_gather_state until the next forward copy-out): block j's experts' (efsdp > 1: its last
    group copied out)."""
    if j == layers - 1:
        out = {"gathered/the [norm, lm_head] all-gather (forward prefetch)": (u.norm_full + u.lm_full) * BF16}
    else:
        out = {"gathered/the next block's dense all-gather (forward prefetch)": u.dense_full * BF16,
               "gathered/the next block's experts' all-gather (forward prefetch)":
                   u.expert_full * BF16 if u.efsdp > 1 else 0}
    out["gathered/its experts' all-gather result, its free deferred to the next copy-out"] = \
        u.expert_full * BF16 if u.efsdp > 1 else 0
    return out


def _at_forward_combine(model, lay, fw, u: EPUnits, c: _Common, j: int, rows: int, rules: Rules) -> Peak:
    """No activation checkpointing: block j's forward at its combine's cast back to bf16
    (token_dispatcher.py combine: `(routed_output_RD.to(float32) * scores).to(routed_output_RD.dtype)`),
    block j's saves complete (the fp32 copy its mul saves among them) beside the blocks' below. Live
    besides: _combine_cast's buffers, the combine all-to-all's output [N, hidden] bf16, the block's
    input, MoE.forward's locals (the routing map bool [T, E], the token
    counts int64 [E] the counts' all-to-all sent, the routed scores [T, k] in the router's dtype),
    RoutedExperts.forward's local expert counts (int64 [E/ep]), the all-gathers of _forward_all_gathers.
    Grads are None (set to None every step: the module docstring), the loss's backward scalars not made
    yet. Measured: the last block's is the step's forward maximum at the rows each block routed (ep2 at
    world 4 and 2, s = 512; ep2 at world 4, micro-batch 2, reshard_after_forward never)."""
    L, h, E = model.layers, model.hidden, model.num_experts
    T = lay.micro_batch_size * model.seq_len
    N = T * model.moe_router_topk
    reshard = fw.reshard_after_forward in ("default", "always")
    lines = {f"activations/layers.{j}'s saves": c.saves[j],
             **_forward_all_gathers(u, j, L),
             "gathered/the combine all-to-all's output (bf16 [N, hidden]), the token counts sent (int64 [E])":
                 N * h * BF16 + E * I64,
             **_combine_cast(model, lay, rows),
             "temporary/the block's input (the decoder's loop holds it)": T * h * BF16,
             "temporary/the routing map (bool [T, E]), the routed scores, the local expert counts":
                 T * E + N * moe_activations.router_bytes(rules) + E // lay.ep * I64}
    return _moment(c, 0, _unsharded(u, j, reshard, True), j, lines,
                   f"layers.{j}: its forward's combine (token_dispatcher.py), the cast back to bf16", phase="forward")


def _rs_buffers(full: int, n: int, rules: Rules, name: str) -> dict[str, int]:
    """A group's reduce-scatter buffers while it runs (grads set to None: its output is the new sharded
    grad): the fp32 input, the output, gloo's copy of the input; over a group of one foreach_reduce's
    input, the new grad and the input divided (no collective)."""
    if n == 1:
        return {f"temporary/{name}: foreach_reduce's input": full * F32,
                f"resident/{name}: the new sharded grad": full * F32,
                f"temporary/{name}: the input divided": full * F32}
    return {f"gathered/{name}: reduce-scatter input (fp32)": full * F32,
            f"resident/{name}: the new sharded grad (the reduce-scatter's output)": full * F32 // n,
            f"temporary/{name}: gloo's copy of the input": titan_peak.rs_temporary(rules, n, full * F32)}


def _at_experts_rs(model, lay, fw, u: EPUnits, c: _Common, j: int, rules: Rules) -> Peak:
    """Block j's experts' reduce-scatter, its post-backward's first group: the block after's states
    reclaimed first, block j's saves freed, its experts resharded while the dense group's params and their
    bf16 grads wait for their own post-backward. Measured: with efsdp > 1 one of the three expert
    params' bf16 grads (all of one size) outlives the copy-in (freed at the copy-out), with efsdp = 1 all
    three die in it (its cause not traced: a named rule of the CPU runs)."""
    L = model.layers
    reshard = fw.reshard_after_forward in ("default", "always")
    lines = {**_prefetched(u, j, reshard), **_rs_buffers(u.expert_full, u.efsdp, rules, "experts"),
             "temporary/the dense group's unsharded grads (bf16)": u.dense_numel * BF16,
             "temporary/an expert param's unsharded grad (bf16)": u.expert_numel // 3 * BF16 if u.efsdp > 1 else 0,
             "temporary/the residual-stream grad (bf16)": c.resid}
    unsharded = _unsharded(u, j, reshard, False) + u.dense_numel * BF16
    return _moment(c, u.grad_shards(_block_grads(u, j, L)), unsharded, j, lines,
                   f"layers.{j} experts' post-backward reduce-scatter ({rules.collectives})")


def _at_dense_rs(model, lay, fw, u: EPUnits, c: _Common, j: int, rules: Rules) -> Peak:
    """Block j's dense group's reduce-scatter, the experts' input held."""
    L = model.layers
    reshard = fw.reshard_after_forward in ("default", "always")
    grads = u.grad_shards(_block_grads(u, j, L) + ["experts"])
    held = "gathered" if u.efsdp > 1 else "temporary"
    lines = {**_prefetched(u, j, reshard), **_rs_buffers(u.dense_full, u.ds, rules, "dense"),
             f"{held}/the experts' reduce-scatter input held": u.expert_full * F32,
             "temporary/the residual-stream grad (bf16)": c.resid}
    return _moment(c, grads, _unsharded(u, j, reshard, False), j, lines,
                   f"layers.{j} dense post-backward reduce-scatter ({rules.collectives})")


def _rows(model, lay) -> tuple[int, int, int]:
    """(balanced, fewest, most) rows one rank's E/ep experts compute in one MoE layer: T tokens on each of
    the ep ranks, each routed to k distinct experts (ledger.model.routed_rows)."""
    T, E, ep = lay.micro_batch_size * model.seq_len, model.num_experts, lay.ep
    return routed_rows(T * ep, model.moe_router_topk, E, E // ep)


def _dense_moments(model, lay, fw, u: EPUnits, c: _Common, rules: Rules) -> list[Peak]:
    """peak.py's lm_head, loss-chunk and final-norm moments with EP's units: the grads reduced so far
    (lm_head's from its reduce-scatter on) and the EP block's saves (peak.py's are the balanced ep 1
    block's: the difference added)."""
    sh = sharded(model, 1, u.ds)._replace(layer_full=u.dense_full + (u.expert_full if u.efsdp > 1 else 0))
    block = u.dense_numel + u.expert_numel
    L = model.layers
    ep1, kept1, _ = titan_peak.saved_per_layer(model, lay.micro_batch_size, model.seq_len, fw.activation_checkpoint,
                                              rules=rules)
    extra = {"activations/EP's block saves beside the balanced ep 1 block's": sum(c.kept) - L * ep1,
             "temporary/EP's SelectiveAC kept outputs beside the ep 1 block's": sum(x.get("temporary", 0) for x in c.cached)
             - L * kept1,
             "gathered/SelectiveAC: the all-to-alls' kept outputs": sum(x.get("gathered", 0) for x in c.cached)}
    lm_grad = u.grad_shards(["lm_head"])
    lm = titan_peak.at_lm_head(model, lay, fw, sh, c.base, block, u.emb_numel, u.head_numel, rules)
    chunk = titan_peak.at_loss_chunk(lm, model, lay, u.head_numel)
    norm = titan_peak.at_final_norm(model, lay, fw, sh, c.base, block, u.emb_numel, u.head_numel, rules)
    # lm_head's grad exists from its reduce-scatter on (not yet at a loss chunk's backward)
    return [_split_state(pk, c.base).plus({**extra, "resident/the grads reduced so far": g})
            for pk, g in ((lm, lm_grad), (chunk, 0), (norm, lm_grad))]


def _split_state(pk: Peak, base: int) -> Peak:
    """peak.py's moment with its "resident/state" line (given `base`) named as the EP moments name it."""
    d = dict(pk.detail)
    d["resident/state less its grads"] = d.pop("resident/state")
    assert d["resident/state less its grads"] == base
    return replace(pk, detail=d)


def ep_peak(model, lay, fw, st, rules: Rules, rows: tuple[int | None, ...] | None = None) -> Peak:
    """The steady-step peak of a rank under EP: the most of every moment (the earliest on ties), at
    balanced routing, bounded at the fewest and the most routed rows; step 0's the same without AdamW's
    state (or the state its optimizer step completes). rows: each block's routed rows instead (no bound;
    a block's None: unknown, the moments holding its saves left out)."""
    u = ep_units(model, lay)
    state = st.params_bytes + st.grads_bytes + st.optim_bytes + st.other_bytes
    checkpointed = fw.activation_checkpoint != "none"

    def at(rows: tuple[int, ...]) -> Peak:
        c = _common(model, lay, fw, st, rules, rows)
        # (a block's rows None: unknown; the moments holding its saves are left out)
        seen = _dense_moments(model, lay, fw, u, c, rules) if None not in c.kept + c.cached else []
        for j in range(model.layers - 1, -1, -1):
            if None in c.cached[:j]:
                continue
            if None not in c.kept[:j] and c.saves[j] is not None:
                if checkpointed:
                    seen.append(_at_recompute_combine(model, lay, fw, u, c, j, rows[j]))
                else:
                    seen.append(_at_forward_combine(model, lay, fw, u, c, j, rows[j], rules))
                seen.append(_at_combine(model, lay, fw, u, c, j))
            if None not in c.kept[:j]:
                seen += [_at_experts_rs(model, lay, fw, u, c, j, rules), _at_dense_rs(model, lay, fw, u, c, j, rules)]
        pk = max(seen, key=lambda p: p.bytes)  # the first of the most
        pk.first = titan_peak.first_step_peak([(m, st.optim_bytes) for m in seen], state,
                                              "resident/state less its grads")
        return pk

    if rows is not None:  # the rows a run routed (a test's)
        return at(rows)
    pk, lo, hi = [at((r,) * model.layers) for r in _rows(model, lay)]
    pk.bound = (lo.bytes, hi.bytes)
    pk.first.bound = (lo.first.bytes, hi.first.bytes)
    return pk
