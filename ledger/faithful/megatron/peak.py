"""The peak within a step of a Megatron Core 0.18.0 rank: resident state + activations saved for
backward + pipeline buffers + the largest temporary at the peak moment, and the optimizer step's own
transients. ledger.faithful.megatron.states's RankState.peak is built here (stage_peak); each rule
names the megatron (or torch) source it follows, paths under megatron/core/ unless said otherwise.

What a rank holds at a moment is modelled as
  resident       params + grads + optim + other of the rank (states.rank_state: the peak probe's
                 named groups)
  activations    the tensors autograd saved (saved_tensors_hooks see every one): per decoder layer
                 `layer_groups`, per model chunk `head_groups` / `embedding_groups`
                 (ledger.faithful.megatron.activations), times the micro-batches the schedule holds
                 in flight (`schedule`)
  gathered       pipeline buffers a collective touched: received stage inputs, sent outputs, the
                 received output grad (p2p_communication.py)
  temporary      the largest transient at the moment: weight / input grads of the linear being
                 backpropagated, the fp32 attention-score grads, the logits' grads, the gloo
                 reduce-scatter copy of a grad bucket, the single-tensor Adam's denominators
and the peak is the largest moment over the step's phases (`stage_peak`). The moments are the ones
the local spec's backward goes through (activations.chunk_units: fc2, fc1, the attention-score grads,
proj, qkv, each norm), the cross-entropy forward and, with the local spec, each forward's last-layer
softmax cast (activations.softmax_forward: the s^2 tensors of a forward, where long sequences peak);
other forward transients are not modelled (the backward of the same layer holds more). Checked
against the peak probe on the CPU matrix (tests/test_megatron.py).

The forward softmax moment is modelled for the 1F1B and no-pipelining schedules (vp = 1), without
recompute or with full block recompute whose last layer is not checkpointed; the interleaved schedule's
and selective recompute's forward are not (their backward moments stand). At full shape (the article's
TP2·PP2·DP2·SP run on cluster=fake, s=8192) both stages peak there (stage 0 in its third micro-batch's
forward, the last stage in any after its first), 63 MB (0.05%) above the backward moment that was the
prediction before. Under full recompute the same cast in a checkpointed layer's recompute (in its
backward, chunk_units) is the peak of the article's run with uniform recompute of one layer: measured
exact but the launcher's batches on both stages (it was 12.7 MB / 29.5 MB above the attention-score
backward moment predicted before).
"""
from __future__ import annotations

from functools import lru_cache

from ledger.faithful.megatron.activations import (chunk_saved, chunk_shape, chunk_units, moe_forward, received_in_p2p,
                                                  Recompute, recompute_holding, recompute_of, RECOMPUTED_CAST, Shape,
                                                  shape_of, softmax_forward)
from ledger.faithful.megatron.buffers import buffer_layout, effective_bucket_size, shard_ranges, shared
from ledger.faithful.megatron.pipeline import layer_range, stage_params, stage_shape
from ledger.faithful.megatron.target import fused_optimizer_in_place
from ledger.layout import Layout
from ledger.model import ModelShape
from ledger.placement import Peak


_PEAK_COMMON = ("peak (megatron_peak.py): resident + saved activations of the micro-batches in flight + p2p "
                "buffers + the largest temporary of the moment, over every backward moment, the cross-entropy "
                "forward, the local spec's forward softmax (1F1B, interleaved, no pipelining; not selective recompute; "
                "interleaved: the 1F1B loop's p2p locals, one [s/tp, b, h] tensor over the CPU run's at pp2 vp2 "
                "stage 0's second chunk) and a "
                "fully recomputed layer's softmax cast in its backward, the grad sync and "
                "Adam's step; no allocator rounding (CUDA: 512-byte blocks); other forward transients, the launcher's "
                "batch and a few 4-byte step leftovers are not modelled")
PEAK_NOTES = {
    "local": (_PEAK_COMMON, "peak, transformer_impl=local (the CPU gloo runs): gloo's copy of each grad bucket in "
              "its reduce-scatter and torch's single-tensor AdamW denominators (param by param) are modelled; "
              "a GPU run with NCCL and FusedAdam holds neither"),
    "transformer_engine": (_PEAK_COMMON, "peak, transformer_impl=transformer_engine: TEDotProductAttention (fused / flash) "
                           "saves no [b, heads/tp, s, s] probabilities (softmax statistics [b, heads/tp, s] fp32 instead) "
                           "and has no score-grad moment; NCCL reduce-scatters in place and FusedAdam adds no per-param "
                           "temporaries (no gloo copy, no Adam denominators); TE's LayerNormLinear saves the norm's input, its "
                           "output and rsigma (activations.te_norm_bytes) and its fused rmsnorm_bwd no fp32 temporaries; "
                           "gradient-accumulation fusion (weight grads straight into main_grad) and workspaces are not "
                           "modelled: the local spec's other moments stand for them (no CPU run confirms TE); TE's "
                           "attention saves k and v at kv heads (v a contiguous copy), so selective core_attn "
                           "recompute, whose checkpoint keeps linear_qkv's whole output through v's view, holds more "
                           "than no recompute"),
}

# the detail line of what an MoE model's token dispatchers keep between forwards (counted as temporary)
HELD = "temporary/MoE token dispatchers' routing, kept until each layer's next forward"

# the moments (by their name's end) of a chunk's first backward unit whose incoming grad is the received
# output grad itself (gathered), not a new tensor: the last layer's fc2 and fc1, and under full recompute
# its recomputed forward before them
INCOMING_IS_RECEIVED = ("fc2", "fc1", RECOMPUTED_CAST)


def moment(in_flight: int, own: int, tmp: int, gat: int, phase: str, what: str) -> tuple:
    """One moment: (bytes over the resident state, parts, phase, what, (in flight, own)). The
    activations are the other micro-batches' saved tensors (in flight) and this micro-batch's (what its
    layers not yet backpropagated saved, and the moment's own); moment_detail names them (built for
    the chosen moment only: a planner row looks at thousands)."""
    return (in_flight + own + tmp + gat, {"activations": in_flight + own, "temporary": tmp, "gathered": gat}, phase,
            what, (in_flight, own))


def moment_plus(m: tuple, extra: int) -> tuple:
    """m with `extra` temporary bytes: full recompute's holding checkpoints (activations.recompute_holding)."""
    return (m[0] + extra, {**m[1], "temporary": m[1]["temporary"] + extra}, m[2],
            f"{m[3]}, with full recompute's MoE checkpoints' inputs and grads", m[4])


def moment_detail(m: tuple) -> dict:
    """A moment's detail lines, each part's pieces summing to it."""
    _x, parts, _phase, what, (in_flight, own) = m
    detail = {"activations/other micro-batches in flight (saved for backward)": in_flight,
              "activations/this micro-batch (saved, not yet released)": own,
              f"temporary/{what}": parts["temporary"],
              "gathered/pipeline p2p tensors (received inputs, sent outputs, grads)": parts["gathered"]}
    return {k: v for k, v in detail.items() if v}


# -- the forward's softmax moments (vp = 1) -------------------------------------------------------
def _forward_gathered(k: int, w: int, first: bool, last: bool, e_p: int, per_live: int,
                      in_p2p: bool) -> tuple[int, int]:
    """p2p tensors a 1F1B stage holds during forward k (pipeline_parallel/schedules.py
    forward_backward_pipelining_without_interleaving): each earlier micro-batch not yet backpropagated
    keeps its received input and sent output (per_live: p2p() of one), this one its received input;
    from the steady loop's second iteration the previous iteration's locals are still bound while
    forward_step runs: output_tensor and the output_tensor_grad received for it (not on the last
    stage), input_tensor_grad, and through output_tensor's autograd graph (the input's AccumulateGrad
    node) that micro-batch's input (not on the first). Returns (gathered, saved): a received input
    goes in saved where a checkpoint saved it (in_p2p false: received_in_p2p), the stale one too (the
    probe names a tensor by what it was)."""
    done = max(0, k - w)  # backwards before forward k: the steady loop runs forward w + i, then backward i
    recv = 0 if first else e_p  # a received input (this forward's, where saved, is softmax_forward's)
    g = (k - done) * per_live + (recv if in_p2p else 0)
    stale_saved = 0
    if done:
        # output_tensor and its grad, input_tensor_grad, and the stale input
        g += (0 if last else 2 * e_p) + recv + (recv if in_p2p else 0)
        stale_saved = 0 if in_p2p else recv
    return g, stale_saved


def _softmax_moments(sh: Shape, rc: Recompute, stage_shape: tuple, forwards, w: int, saved: int, per_live: int,
                     e_p: int) -> list[tuple]:
    """The moments (moment()) of the given forwards' softmax casts on a
    vp = 1 stage (stage_shape: its chunk's layers, first, last; saved: one micro-batch's saved bytes;
    per_live: p2p() of one in flight): the micro-batches not yet backpropagated keep theirs, the
    forward's own (softmax_forward) and the p2p tensors of that moment (_forward_gathered)."""
    n, first, last = stage_shape
    sf = softmax_forward(sh, rc, n, first)
    mf = moe_forward(sh, rc, n, first)
    # full recompute: the checkpoints whose MoE layers have not dispatched again since their last
    # recompute still hold (recompute_holding; every one at the step's first forward: an upper bound there)
    sf_hold = recompute_holding(sh, rc, n, n - 1)
    mf_hold = recompute_holding(sh, rc, n, mf[2] + 1) if mf is not None else 0
    out = []
    for kk in forwards:
        gat, stale = _forward_gathered(kk, w, first, last, e_p, per_live, received_in_p2p(first, rc))
        if sf is not None:
            out.append(moment((kk - max(0, kk - w)) * saved, sf[0] + stale, sf[1] + sf_hold, gat, "forward",
                              f"layer {n - 1}: softmax cast (micro-batch {kk})"))
        if mf is not None:
            out.append(moment((kk - max(0, kk - w)) * saved, mf[0] + stale, mf[1] + mf_hold, gat, "forward",
                              f"layer {mf[2]}: the experts' outputs cat (micro-batch {kk})"))
    return out


def _interleaved_softmax_moments(sh: Shape, rc: Recompute, shapes: list, fwd: list, bwd: list, w: int,
                                 saved: list, pw: list, e_p: int, pp: int) -> list[tuple]:
    """The interleaved schedule's (vp > 1) forward softmax casts (pipeline_parallel/schedules.py
    forward_backward_pipelining_with_interleaving: w warm-up forwards, then forward k and backward
    k - w): before forward k the chunks of forwards 0..k-1 not yet backpropagated keep their saves
    and p2p tensors (pw: a chunk's received input and sent output), and forward k's chunk holds its
    softmax_forward moment with its received input; from the steady loop on, the previous
    iteration's locals as _forward_gathered counts them for 1F1B, the input grad only where the
    previous backward's chunk sent one (a first virtual stage's backward returns none). Measured on
    the CPU (pp2 · vp2, s = 512, the local spec): both stages' forward peaks to the p2p byte. shapes:
    each chunk's (layers, first, last)."""
    sf_of = [softmax_forward(sh, rc, n, first) for n, first, _last in shapes]
    if not any(sf_of):
        return []
    out = []
    sf_sum = pf_sum = 0
    sb, pb = [0], [0]
    for c in bwd:
        sb.append(sb[-1] + saved[c])
        pb.append(pb[-1] + pw[c])
    for k, ch in enumerate(fwd):
        done = max(0, k - w)
        sf = sf_of[ch]
        if sf is not None:
            n, first, last = shapes[ch]
            in_p2p = received_in_p2p(first, rc)
            recv = 0 if first else e_p
            g = pf_sum - pb[done] + (recv if in_p2p else 0)
            stale = 0
            if done:
                sent_grad = 0 if shapes[bwd[done - 1]][1] else e_p  # the previous backward's input grad
                g += (0 if last else 2 * e_p) + sent_grad + (recv if in_p2p else 0)
                stale = 0 if in_p2p else recv
            mb = (k // (pp * len(shapes))) * pp + k % pp
            out.append(moment(sf_sum - sb[done], sf[0] + stale, sf[1], g, "forward",
                              f"layer {n - 1} of chunk {ch}: softmax cast (micro-batch {mb})"))
        sf_sum += saved[ch]
        pf_sum += pw[ch]
    return out


# -- the schedule ----------------------------------------------------------------------------------
def schedule(pp: int, vp: int, stage: int, m: int) -> tuple[int, list[int], list[int]]:
    """(warm-up forwards, the chunk of each forward, of each backward) of one stage's step.
    pipeline_parallel/schedules.py: forward_backward_no_pipelining (pp = 1: F, B per micro-batch),
    forward_backward_pipelining_without_interleaving (pp - stage - 1 warm-up forwards, then one
    forward and one backward each), forward_backward_pipelining_with_interleaving (get_pp_rank_
    microbatches: (pp - stage - 1) * 2 + (vp - 1) * microbatch_group_size_per_vp_stage warm-up forwards,
    the group size pp by default (model_parallel_config.py); get_model_chunk_id: forward k runs
    chunk (k // pp) % vp, backward k chunk vp - 1 - (k // pp) % vp)."""
    total = m * vp
    if pp == 1:
        w = 0
    elif vp == 1:
        w = pp - stage - 1
    else:
        w = (pp - stage - 1) * 2 + (vp - 1) * pp
    w = min(w, total)
    fwd = [(k // pp) % vp if vp > 1 else 0 for k in range(total)]
    bwd = [vp - 1 - (k // pp) % vp if vp > 1 else 0 for k in range(total)]
    return w, fwd, bwd


# -- the optimizer step ----------------------------------------------------------------------------
def _chunk_params(model: ModelShape, lay: Layout, k, stage: int, ch: int):
    params = stage_params(model, lay.tp, lay.pp, stage, lay.vp, ch, k.pp_split)
    _, first, last = stage_shape(model, lay.pp, stage, lay.vp, ch, k.pp_split)
    is_shared = shared(model, first, last, k.use_distributed_optimizer)
    return params, buffer_layout(params, effective_bucket_size(k, lay.dp, stage, ch), lay.dp,
                                 k.use_distributed_optimizer, is_shared and first, is_shared and last)


def _no_wd(name: str) -> bool:
    """optimizer/__init__.py _get_param_groups: no weight decay for biases and 1-D params (the norms);
    those groups sort after the default one (key (override is not None, override))."""
    return "layernorm" in name or name.endswith(".bias")


@lru_cache(maxsize=1024)
def optimizer_moments(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int) -> tuple[tuple, tuple]:
    """((bytes, what) of the largest grad-sync transient, (bytes, what) of the largest Adam transient).

    The local spec stands for the CPU gloo runs (launchers/megatron.py), transformer_engine for a GPU
    NCCL run (TE's FusedAdam, NCCL in place: no such transients).
    Grad sync: distributed/param_and_grad_buffer.py start_grad_sync reduce-scatters each bucket's
    grad_data (the distributed optimizer); gloo's reduce_scatter_tensor works on a copy of the whole
    input, which the peak probe sees when the collective completes (finish_grad_sync: split + copy
    into the rank's shard), one bucket group at a time; a chunk built with disable_bucketing (vp
    chunks after the first) is one group of all its buckets. The all-reduce without the distributed
    optimizer works in place.
    Adam: torch.optim.AdamW on CPU tensors is the single-tensor loop (torch/optim/adamw.py, adam.py
    _single_tensor_adam: foreach only for CUDA tensors): per param `denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)`, two fp32 temporaries of the param's size, and the previous
    param's denom lives on until it is rebound, so param i holds d[i-1] + 2 d[i] within one param
    group. The params are the fp32 master shards (distrib_optimizer.py
    _build_optimizer_group_ranges: per param group, the chunks' buckets in buffer order, each
    param's range on this DP rank; optimizer.py Float16OptimizerWithFloat16Params: whole fp32
    masters in named_parameters order); groups: weight decay first, then the norms."""
    if fused_optimizer_in_place(k):
        # a GPU run (target.py): NCCL's reduce-scatter writes the shard in place, and Megatron's Adam is
        # TE's / apex's FusedAdam (multi-tensor kernels, in place): neither holds a transient the size of a
        # bucket or a param (no run here confirms it)
        return (0, ""), (0, "")
    dist = k.use_distributed_optimizer
    gb = 4 if (k.grad_reduce_in_fp32 or k.precision != "bf16") else 2
    sync, shards = (0, ""), []
    for ch in range(lay.vp):
        params, buckets = _chunk_params(model, lay, k, stage, ch)
        if dist and lay.dp >= 1:
            if ch > 0:
                sync = max(sync, (gb * sum(b.numel for b in buckets), f"grad buckets of chunk {ch} (coalesced)"))
            else:
                sync = max(sync, bucket_copy(buckets, gb))
            for b in buckets:
                shards += shard_ranges([b], lay.dp, dp_rank)
        else:
            shards += params
    if not dist:
        sync = (0, "")
    return sync, adam_denominators(shards)


def bucket_copy(buckets, gb: int) -> tuple[int, str]:
    """The grad sync's largest transient over one buffer's buckets, reduced one at a time: gloo's copy of
    a bucket's grads (gb bytes an element) in its reduce-scatter (optimizer_moments)."""
    return max((gb * b.numel, "grad bucket reduce-scatter (gloo copy)") for b in buckets)


def adam_denominators(shards: list[tuple[str, int]]) -> tuple[int, str]:
    """The largest single-tensor AdamW transient over one optimizer's fp32 params (name, elements) in its
    order (optimizer_moments): per param group (weight decay first, then the norms: _no_wd) param i
    holds the previous one's denominator and two of its own."""
    groups = {False: [], True: []}
    for name, kk in shards:
        groups[_no_wd(name)].append(4 * kk)
    best = (0, "")
    for g in (False, True):
        d = groups[g]
        for i, x in enumerate(d):
            best = max(best, ((d[i - 1] if i else 0) + 2 * x, "Adam denominators (fp32 sqrt / div)"))
    return best


# -- the peak --------------------------------------------------------------------------------------
def stage_moments(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int, rows: str = "balanced",
                  optimizer: tuple | None = None) -> list[tuple]:
    """Every moment of a steady step the peak is looked for at, each (bytes over the resident state,
    parts, phase, what): the backward moments of every micro-batch of the schedule (each unit's
    moments with the other in-flight micro-batches' saved bytes), the cross-entropy forward, then
    the grad sync and Adam's step (optimizer_moments, or `optimizer`: an MoE model's, moe.py), these
    two last. rows: an MoE model's routed rows (shape_of)."""
    moments = list(_step_moments_fast(model, lay, k, stage, rows))
    e_p = moments.pop()
    (sync_b, sync_w), (adam_b, adam_w) = optimizer or optimizer_moments(model, lay, k, stage, dp_rank)
    # finalize_model_grads runs after the last backward, inside the schedule function: the probe's
    # phase "optimizer"; the schedule still holds the last micro-batch's p2p tensors (its received
    # input or output grad, and the one it sent)
    g = 2 * e_p if lay.pp > 1 else 0
    moments.append(moment(0, 0, sync_b, g, "optimizer", sync_w))
    moments.append(moment(0, 0, adam_b, 0, "optimizer", adam_w))
    return moments


def _chunk_sh(sh: Shape, model: ModelShape, lay: Layout, k, stage: int, layers: int) -> Shape:
    """sh with the chunk's MoE layers marked (an MoE model has one chunk a stage: vp > 1 is refused)."""
    if sh.moe is None:
        return sh
    return chunk_shape(sh, model, layer_range(model, lay.pp, stage, k.pp_split).start, layers)


@lru_cache(maxsize=1024)
def _step_moments(model: ModelShape, lay: Layout, k, stage: int, rows: str = "balanced") -> tuple:
    """stage_moments' forward and backward moments (the same on every DP rank of a stage: cached), and
    last the bytes of one p2p tensor. rows: an MoE model's routed rows (shape_of)."""
    rc = recompute_of(k)
    sh = shape_of(model, lay, k, rows)
    e_p = sh.e * (sh.sbh // (sh.tp if sh.sp else 1))  # one p2p tensor ([s/tp, b, h] with SP)
    chunks, shapes = [], []
    for ch in range(lay.vp):
        shapes.append(stage_shape(model, lay.pp, stage, lay.vp, ch, k.pp_split))
        n, first, last = shapes[-1]
        chunks.append((chunk_units(_chunk_sh(sh, model, lay, k, stage, n), rc, n, first, last, model), first, last))
    saved = [chunk_saved(u) for u, _, _ in chunks]
    w, fwd, bwd = schedule(lay.pp, lay.vp, stage, lay.num_microbatches)
    moments = []  # moment(): (extra bytes over resident, parts without resident, phase, what, detail)

    def add(in_flight, own, tmp, gat, phase, what):
        moments.append(moment(in_flight, own, tmp, gat, phase, what))

    def p2p(live_chunks):
        # pipeline_parallel/schedules.py keeps each in-flight micro-batch's received input (its
        # chunk's input_tensor) and sent output (output_tensor, deallocate_pipeline_outputs off)
        g = 0
        for ch in live_chunks:
            _, first, last = chunks[ch]
            g += (e_p if received_in_p2p(first, rc) else 0) + (0 if last else e_p)
        return g

    for j in range(len(fwd)):
        # before backward j: forwards 0..min(w + j, total - 1) done (the 1F1B forward precedes its
        # backward), backwards 0..j-1 done
        nf = min(w + j, len(fwd) - 1) + 1
        live = list(fwd[:nf])
        for c in bwd[:j]:
            live.remove(c)
        ch = bwd[j]
        live.remove(ch)
        others = sum(saved[c] for c in live)
        units, first, last = chunks[ch]
        # + the received output grad (recv_backward) and the input grad sent by the previous backward
        g_base = p2p(live + [ch]) + (0 if last else e_p) + (e_p if j > 0 and not first else 0)
        if last:
            # the cross-entropy forward (tensor_parallel/cross_entropy.py): the logits in the activation
            # dtype beside their fp32 copy (counted saved; the final norm's output too), and on a stage
            # that receives its input the previous backward's input grad (schedules.py 1F1B loop:
            # input_tensor_grad, sent by send_backward_recv_forward) is still referenced
            add(others, saved[ch], sh.e * sh.s * sh.b * sh.v,
                p2p(live + [ch]) + (e_p if j > 0 and not first else 0), "forward",
                f"cross-entropy forward (micro-batch {j})")
        rest = saved[ch]
        for i, u in enumerate(units):
            rest -= u.saved
            # a chunk without the head backpropagates first the grad it received (recv_backward, held by
            # the schedule through the micro-batch's backward: gathered); its last layer's fc2 and fc1
            # see that buffer itself as their incoming grad, later moments a new one (the residual add)
            recv = e_p if i == 0 and not last else 0
            for name, own, tmp, gat in u.moments:
                t = tmp - recv if name.endswith(INCOMING_IS_RECEIVED) else tmp
                add(others, rest + own, t, g_base + gat, "backward", f"{u.name}: {name} (micro-batch {j})")
    if lay.vp == 1:  # each forward's softmax moment (softmax_forward), after the backward moments
        moments += _softmax_moments(_chunk_sh(sh, model, lay, k, stage, shapes[0][0]), rc, shapes[0], range(len(fwd)),
                                    w, saved[0], p2p([0]), e_p)
    else:
        moments += _interleaved_softmax_moments(sh, rc, shapes, fwd, bwd, w, saved, [p2p([c]) for c in range(lay.vp)],
                                                e_p, lay.pp)
    return (*moments, e_p)


@lru_cache(maxsize=4096)
def _chunk_top(sh, rc, layers: int, first: bool, last: bool, model: ModelShape, e_p: int) -> tuple:
    """One micro-batch's chunk of `layers` layers: its saved bytes and the first of its backward moments
    with the most bytes, (inner bytes, this micro-batch's saved, temporary, gathered, what) - the same
    for every stage and row whose chunk has this shape (cached)."""
    units = chunk_units(sh, rc, layers, first, last, model)
    saved = chunk_saved(units)
    top, rest = None, saved
    for i, u in enumerate(units):
        rest -= u.saved
        recv = e_p if i == 0 and not last else 0
        for name, own, tmp, gat in u.moments:
            t = tmp - recv if name.endswith(INCOMING_IS_RECEIVED) else tmp
            v = rest + own + t + gat
            if top is None or v > top[0]:
                top = (v, rest + own, t, gat, f"{u.name}: {name}")
    return saved, top


@lru_cache(maxsize=1024)
def _step_moments_fast(model: ModelShape, lay: Layout, k, stage: int, rows: str = "balanced") -> tuple:
    """_step_moments (the readable reference, kept beside it) reduced to what a peak needs: the
    reference's first forward moment with the most bytes and its first backward moment with the most
    bytes, in the reference's order, so max() of either list is the same moment (and so is the
    largest of each phase). Each backward's moments are the chunk's own (its top computed once per
    chunk shape, _chunk_top) over what the schedule holds then, which prefix sums over the forward and
    backward orders give, compared as numbers and built as moments only for the two kept:
    O(micro-batches + layers) instead of the reference's O(micro-batches x (micro-batches + layers)).
    tests/test_megatron_peak.py checks the two agree."""
    rc = recompute_of(k)
    sh = shape_of(model, lay, k, rows)
    e_p = sh.e * (sh.sbh // (sh.tp if sh.sp else 1))
    chunks, shapes, saved, best = [], [], [], []
    for ch in range(lay.vp):
        shapes.append(stage_shape(model, lay.pp, stage, lay.vp, ch, k.pp_split))
        n, first, last = shapes[-1]
        chunks.append((first, last))
        sv, top = _chunk_top(_chunk_sh(sh, model, lay, k, stage, n), rc, n, first, last, model, e_p)
        saved.append(sv)
        best.append(top)
    pw = [(e_p if received_in_p2p(first, rc) else 0) + (0 if last else e_p)
          for first, last in chunks]  # p2p() per chunk
    w, fwd, bwd = schedule(lay.pp, lay.vp, stage, lay.num_microbatches)
    sf, pf = [0], [0]
    for c in fwd:
        sf.append(sf[-1] + saved[c])
        pf.append(pf[-1] + pw[c])
    sb, pb = [0], [0]
    for c in bwd:
        sb.append(sb[-1] + saved[c])
        pb.append(pb[-1] + pw[c])
    logits = sh.e * sh.s * sh.b * sh.v
    best_f = best_b = None  # (bytes, position in the reference's order, j, others, held or g_base, ch)
    pos = 0
    for j in range(len(fwd)):
        nf = min(w + j, len(fwd) - 1) + 1
        ch = bwd[j]
        first, last = chunks[ch]
        others = sf[nf] - sb[j] - saved[ch]
        held = pf[nf] - pb[j]  # p2p(live + [ch])
        prev = e_p if j > 0 and not first else 0
        if last:  # the cross-entropy forward
            v = others + saved[ch] + logits + held + prev
            if best_f is None or v > best_f[0]:
                best_f = (v, pos, j, others, held + prev, ch)
            pos += 1
        top = best[ch]
        if top is not None:
            g_base = held + (0 if last else e_p) + prev
            v = others + top[1] + top[2] + g_base + top[3]
            if best_b is None or v > best_b[0]:
                best_b = (v, pos, j, others, g_base, ch)
            pos += 1
    kept = []
    if best_f is not None:
        v, p, j, others, gat, ch = best_f
        act = others + saved[ch]
        kept.append((p, (v, {"activations": act, "temporary": logits, "gathered": gat}, "forward",
                         f"cross-entropy forward (micro-batch {j})", (others, saved[ch]))))
    if best_b is not None:
        v, p, j, others, g_base, ch = best_b
        top = best[ch]
        act, gat = others + top[1], g_base + top[3]
        kept.append((p, (v, {"activations": act, "temporary": top[2], "gathered": gat}, "backward",
                         f"{top[4]} (micro-batch {j})", (others, top[1]))))
    moments = [m for _p, m in sorted(kept, key=lambda pm: pm[0])]
    if lay.vp == 1:
        # the reference's forward softmax moments (after its backward moments) grow with the
        # micro-batches in flight up to forward w and stay level from forward w + 1 (w in flight, the
        # previous iteration's p2p locals): the first of each, in its order
        total = len(fwd)
        ks = sorted({min(w, total - 1), *([w + 1] if w + 1 < total else [])})
        softmax = _softmax_moments(_chunk_sh(sh, model, lay, k, stage, shapes[0][0]), rc, shapes[0], ks, w, saved[0],
                                   pw[0], e_p)
    else:
        softmax = _interleaved_softmax_moments(sh, rc, shapes, fwd, bwd, w, saved, pw, e_p, lay.pp)
    # a softmax moment is kept where it is larger than the forward moment kept so far
    top_f = best_f[0] if best_f is not None else None
    for m in softmax:
        if top_f is None or m[0] > top_f:
            moments = [x for x in moments if x[2] != "forward"] + [m]
            top_f = m[0]
    return (*moments, e_p)


def stage_peak(model: ModelShape, lay: Layout, k, stage: int, dp_rank: int, resident: dict,
               adam_state: int, rows: str = "balanced", optimizer: tuple | None = None,
               held: int = 0) -> Peak:
    """The rank's peak in a steady step: its largest moment (stage_moments). `first`: the first
    step's, where Adam's exp_avg / exp_avg_sq / step (adam_state bytes) do not exist before its
    optimizer step (torch/optim/adam.py _init_group makes them param by param: bounded by the steady
    Adam moment). resident: the rank's states by name (RankState.totals), the detail's resident lines.
    An MoE model's (moe.py moe_stage_peak): rows, its optimizer moments, and held: what its token
    dispatchers keep from one forward to the next, live at every moment (moe_activations.held). With
    full recompute an MoE stage's checkpoints also hold past the last backward (activations.
    recompute_holding, every one): added to the optimizer moments."""
    moments = stage_moments(model, lay, k, stage, dp_rank, rows, optimizer)
    after = _held_past_backward(model, lay, k, stage, rows)
    if after:
        moments = [moment_plus(m, after) if m[2] == "optimizer" else m for m in moments]
    adam_b, adam_w = moments[-1][0], moments[-1][3]
    res = sum(resident.values())
    res_detail = {f"resident/{name}": b for name, b in resident.items() if b}
    top = max(moments, key=lambda m: m[0])  # held is live at every moment: it moves none
    _x, parts, phase, what, _ = top
    steady = _with_held(Peak.of({"resident": res, **parts, "unnamed": 0}, phase, what,
                                detail={**res_detail, **moment_detail(top)}), held)
    # the first step: without Adam's state until the optimizer step
    fb = max(moments[:-1], key=lambda m: m[0])
    if res - adam_state + fb[0] >= res + adam_b:
        before = {**res_detail, "resident/optim": resident["optim"] - adam_state}
        first = Peak.of({"resident": res - adam_state, **fb[1], "unnamed": 0}, fb[2], fb[3],
                        detail={k: v for k, v in {**before, **moment_detail(fb)}.items() if v})
    else:
        first = Peak.of({"resident": res, "activations": 0, "temporary": adam_b, "gathered": 0, "unnamed": 0},
                        "optimizer",
                        f"{adam_w}, first step (bound)" if adam_b else "the state made by the first optimizer step",
                        detail={**res_detail, **({f"temporary/{adam_w}": adam_b} if adam_b else {})})
    first = _with_held(first, held)
    return Peak.of(steady.parts, steady.phase, steady.what, detail=steady.detail,
                   first=None if first.bytes == steady.bytes else first)


def _with_held(pk: Peak, held: int) -> Peak:
    """pk with an MoE model's dispatcher-held bytes (stage_peak's held) in its temporary part."""
    return pk.plus({HELD: held})


def _held_past_backward(model: ModelShape, lay: Layout, k, stage: int, rows: str) -> int:
    """What a stage's full-recompute checkpoints hold past its last backward (recompute_holding: every
    checkpoint with an MoE layer; 0 without MoE layers, vp 1 with them)."""
    if not model.is_moe:
        return 0
    n = stage_shape(model, lay.pp, stage, 1, 0, k.pp_split)[0]
    return recompute_holding(_chunk_sh(shape_of(model, lay, k, rows), model, lay, k, stage, n), recompute_of(k), n)
