"""The collectives one optimizer step of a Megatron Core 0.18.0 rank calls (comm: RankState.comm of
ledger.faithful.megatron.states). Once per step: the DP buckets' reduce-scatters or all-reduces and
param all-gathers (distributed/param_and_grad_buffer.py, distributed/distributed_data_parallel.py),
the tied word-embedding and SP norm grads' all-reduces (distributed/finalize_model_grads.py), the grad
norm's (optimizer/clip_grads.py); per micro-batch the TP calls (tensor_parallel/layers.py, mappings.py,
cross_entropy.py) and the PP sends / receives (pipeline_parallel/schedules.py, p2p_communication.py).
Each rule names the megatron source it follows (paths under megatron/core/ unless said otherwise).

Speed: a stage class's calls are planned once per structure (_comm_plan, cached: the calls no
micro-batch setting changes counted, _fixed_comm; the per-micro-batch ones named, micro_batch_comm),
and comm counts the per-micro-batch ones for a layout's micro-batch size and count. The MoE ledger
(ledger.faithful.megatron.moe) reuses micro_batch_comm for an MoE model's dense calls.
"""
from __future__ import annotations

from functools import lru_cache

from ledger.faithful.megatron.activations import recompute_of, recomputed_layers
from ledger.faithful.megatron.buffers import effective_bucket_size
from ledger.faithful.megatron.heaviest import chunk_buckets, stage_class, stage_summaries
from ledger.faithful.megatron.knobs import dtypes, Knobs
from ledger.faithful.megatron.pipeline import pieces, stage_shape
from ledger.grid import Grid
from ledger.layout import Layout
from ledger.model import ModelShape
from ledger.placement import Comm, CommBuilder, wire_bytes


def comm(model: ModelShape, lay: Layout, k: Knobs, stage: int) -> list[Comm]:
    """Collectives of one steady-state optimizer step of this stage: its plan (_comm_plan, cached per
    structure) with the per-micro-batch calls counted for this micro-batch size and count."""
    rows = _comm_plan(model, lay.tp, lay.pp, lay.dp, lay.vp, k, stage_class(lay.pp, stage), lay.sequence_parallel)
    m, b = lay.num_microbatches, lay.micro_batch_size  # m >= 1 (resolve, validate)
    out = []
    for row in rows:
        if type(row) is Comm:
            out.append(row)  # shared across layouts: Comm records are read, never changed
            continue
        dim, kind, dtype, what, count, buf, wire, per_mb = row
        for calls, wires, unit, div, group in per_mb:
            x = b * unit // div
            count += calls * m
            buf += calls * m * x
            wire += wires * m * wire_bytes(kind, x, group)
        out.append(Comm(dim, kind, count, buf, wire, dtype, what))
    return out


@lru_cache(maxsize=4096)
def _comm_plan(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int, sp: bool) -> tuple:
    """Every collective record of one stage class's step (CommBuilder.build of every call, the fixed
    ones counted, the per-micro-batch ones named): a Comm where no call repeats per micro-batch (the
    calls no micro-batch setting changes, _fixed_comm), else its fields (dim, kind, dtype, what,
    count, buffer bytes, wire bytes: the fixed calls') and its calls per micro-batch
    (micro_batch_comm), each (calls per micro-batch, the calls among them that send, bytes per
    sequence, divisor, group size): micro_batch_size * bytes per sequence // divisor bytes per call,
    wire_bytes over the group for each sending one (a send_recv pair: two calls, one sending)."""
    cb = CommBuilder()
    per_mb: dict[tuple, tuple] = {}

    def fixed(dim, kind, dtype, what, group, buffers):
        cb.add_each(dim, kind, buffers, group, dtype, what)

    def per_micro_batch(dim, kind, dtype, what, calls, unit, div, group, wires):
        if calls > 0 and group > 1:
            key = (dim, kind, dtype)
            cb.add_sums(key, 0, 0, 0, [what])  # counted per layout (comm)
            per_mb[key] = per_mb.get(key, ()) + ((calls, wires, unit, div, group),)

    _fixed_comm(fixed, model, tp, pp, dp, vp, k, stage, sp)
    micro_batch_comm(per_micro_batch, model, tp, pp, vp, k, stage, sp)
    rows = []
    for c in cb.build():
        calls = per_mb.get((c.dim, c.kind, c.dtype))
        rows.append(c if calls is None else
                    (c.dim, c.kind, c.dtype, c.what, c.count, c.buffer_bytes, c.wire_bytes, calls))
    return tuple(rows)


def _fixed_comm(calls, model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int, sp: bool) -> None:
    """The collectives of one steady-state step that no micro-batch setting changes (DP buckets,
    tied-embedding grads, grad norm, SP norm grads), each given to calls(dim, kind, dtype, what,
    group size, [buffer bytes of each call])."""
    grid = Grid(tp=tp, dp=dp, pp=pp)  # Layout.grid of a Megatron layout (cp = dp_replicate = 1: place)
    pdt, gdt, pb, gb = dtypes(k)
    first, last = stage == 0, stage == pp - 1
    # DP: distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup.start_grad_sync, one
    # bucket per group (partition_buckets without fp8): reduce-scatter of the whole padded
    # bucket grad_data (distributed optimizer) or all-reduce; start_param_sync: all-gather of the
    # bucket's param_data, once per bucket group and step. Without overlap_param_gather it runs
    # after optimizer.step (distrib_optimizer.py step_with_ready_grads). With it, step_with_ready_grads
    # gathers nothing; the next step's forward gathers each bucket group, asynchronously
    # (distributed_data_parallel.py _make_forward_pre_hook -> finish_param_sync: start_param_sync
    # of an undispatched group, then the next group's; or, with the interleaved schedule's
    # align_param_gather, config.param_sync_func from schedules.py), and finish_grad_sync resets
    # param_gather_dispatched for the step after. training.py train() disables the pre-hooks
    # (disable_forward_pre_hook(param_sync=False)) and param_sync_func for the first iteration:
    # step 0 gathers nothing, every later step gathers the previous step's update.
    # Bucket groups: partition_buckets gives each bucket its own group, except for a DDP built
    # with disable_bucketing (training.py get_model: model chunks after the first) whose buckets
    # form one group, issued as one coalesced call (_coalescing_manager) over all of them; such a
    # chunk has several buckets only around a tied model's shared embedding (build_buffer)
    numels = _bucket_numels(model, tp, pp, dp, vp, k, stage)
    if k.use_distributed_optimizer:
        calls("dp", "reduce_scatter", gdt, "grad bucket (start_grad_sync)", dp, [gb * n for n in numels])
        what = ("param bucket (next step's forward: pre-hook finish_param_sync / param_sync_func)"
                if k.overlap_param_gather else "param bucket (start_param_sync)")
        calls("dp", "all_gather", pdt, what, dp, [pb * n for n in numels])
    else:
        calls("dp", "all_reduce", gdt, "grad bucket (start_grad_sync)", dp, [gb * n for n in numels])
    if model.tied_embeddings and pp > 1 and (first or last):  # a chunk with a shared_embedding param
        # distributed/finalize_model_grads.py _allreduce_word_embedding_grads: the first stage's
        # word-embedding main_grad and the last stage's copy (fp32 grad_data views with
        # grad_reduce_in_fp32), all-reduced over the embedding group (parallel_state.py
        # default_embedding_ranks: the first and last PP rank, a pp group of 2) after finish_grad_sync
        calls(grid.label_of(("pp",)), "all_reduce", gdt, "tied word-embedding grads (finalize_model_grads)", 2,
              [gb * (model.vocab // tp) * model.hidden])
    # grad norm: optimizer/clip_grads.py get_grad_norm_fp32, one fp32 all-reduce over
    # grad_stats_parallel_group: the whole world with the distributed optimizer
    # (optimizer/__init__.py: intra_dist_opt_group), else the model-parallel group
    dims = ("tp", "cp", "dp", "dp_replicate", "pp") if k.use_distributed_optimizer else ("tp", "pp")
    size = grid.size_of(dims)
    if k.clip_grad > 0 and size > 1:
        calls(grid.label_of(dims), "all_reduce", "fp32", "grad norm (clip_grads.py)", size, [4])
    if sp or model.qk_layernorm:
        # distributed/finalize_model_grads.py _allreduce_non_tensor_model_parallel_grads: one
        # coalesced all-reduce of the main grads of the `sequence_parallel` (norm) params, and of the
        # q/k norms (qk_layernorm) with or without SP
        calls("tp", "all_reduce", gdt, "SP norm grads (finalize_model_grads)", tp,
              [gb * _norm_numel(model, tp, pp, vp, stage, k.pp_split, sp)])


def _bucket_numels(model: ModelShape, tp: int, pp: int, dp: int, vp: int, k: Knobs, stage: int) -> list[int]:
    """Elements of each DP bucket group of a stage, no buffer built: chunk 0's buckets (one, its
    summary's numel, or those of its bucket walk), then each later chunk's buffer as one group."""
    sums = stage_summaries(model, tp, pp, dp, vp, k, stage)
    if sums[0][4] == 1:
        first = [sums[0][0]]
    else:
        _, bstart, bend = chunk_buckets(model, tp, *stage_shape(model, pp, stage, vp, 0, k.pp_split),
                                        effective_bucket_size(k, dp, stage, 0), dp, k.use_distributed_optimizer)
        first = (bend - bstart).tolist()
    return first + [x[0] for x in sums[1:]]


def _norm_numel(model: ModelShape, tp: int, pp: int, vp: int, stage: int, split: tuple, sp: bool = True) -> int:
    """Elements of a stage's norm weights (the `sequence_parallel` params with SP); without SP its q/k
    norms only (qk_layernorm)."""
    per_layer, head = _norms(model, tp) if sp else (2 * model.head_dim * (2 if model.norm == "layernorm" else 1), 0)
    out = 0
    for ch in range(vp):
        n, _, last = stage_shape(model, pp, stage, vp, ch, split)
        out += n * per_layer + (head if last else 0)
    return out


@lru_cache(maxsize=256)
def _norms(model: ModelShape, tp: int) -> tuple[int, int]:
    """Elements of the norm weights of one decoder layer and of the head (pieces)."""
    _, layer, head = pieces(model, tp)
    return tuple(sum(k for name, k in part if "layernorm" in name) for part in (layer, head))


def micro_batch_comm(calls, model: ModelShape, tp: int, pp: int, vp: int, k: Knobs, stage: int, sp: bool) -> None:
    """The collectives one stage makes every micro-batch (TP, cross-entropy, PP), each given to
    calls(dim, kind, dtype, what, calls per micro-batch, bytes per sequence, divisor, group size,
    calls that send): each call hands micro_batch_size * bytes per sequence // divisor bytes."""
    pdt = dtypes(k)[0]
    first, last = stage == 0, stage == pp - 1
    layers = sum(stage_shape(model, pp, stage, vp, ch, k.pp_split)[0] for ch in range(vp))  # this stage's
    sbh = model.seq_len * model.hidden * (2 if k.precision == "bf16" else 4)  # one sequence's [s, h] activations
    # TP per layer per micro-batch: tensor_parallel/layers.py + mappings.py. Without SP:
    # linear_qkv / linear_fc1 copy_to_tensor_model_parallel_region (all-reduce in backward),
    # linear_proj / linear_fc2 reduce_from_tensor_model_parallel_region (all-reduce in forward).
    # With SP: column-parallel all-gather forward + all-gather again in backward (wgrad input,
    # LinearWithGradAccumulationAndAsyncCommunication.backward) + reduce-scatter of the input grad;
    # row-parallel reduce-scatter forward + all-gather backward. Buffers: the full s*b*h.
    # Full recompute: a checkpointed layer's forward runs again in its backward (tensor_parallel/random.py
    # CheckpointFunction.backward calls run_function again), its forward collectives with it: SP's two
    # all-gathers and two reduce-scatters, or the two row-parallel all-reduces.
    again = sum(recomputed_layers(recompute_of(k), stage_shape(model, pp, stage, vp, ch, k.pp_split)[0])
                for ch in range(vp))
    if sp:
        ag, rs = 6 * layers + 2 * again, 4 * layers + 2 * again
        if first:  # embedding: reduce_scatter_to_sequence_parallel_region (all-gather in backward)
            ag, rs = ag + 1, rs + 1
        if last:  # output_layer (column-parallel): all-gather fwd + bwd, reduce-scatter of dgrad
            ag, rs = ag + 2, rs + 1
        calls("tp", "all_gather", pdt, "SP all-gather (layers.py/mappings.py)", ag, sbh, 1, tp, ag)
        calls("tp", "reduce_scatter", pdt, "SP reduce-scatter (layers.py/mappings.py)", rs, sbh, 1, tp, rs)
    else:
        ar = 4 * layers + 2 * again + first + last  # embedding forward, output_layer input grad
        calls("tp", "all_reduce", pdt, "TP all-reduce (mappings.py)", ar, sbh, 1, tp, ar)
    if last:
        # tensor_parallel/cross_entropy.py VocabParallelCrossEntropy.forward: logits max,
        # predicted logits, sum of exp, each fp32 [s, b]
        calls("tp", "all_reduce", "fp32", "vocab-parallel cross-entropy", 3, model.seq_len * 4, 1, tp, 3)
    # PP: pipeline_parallel/schedules.py + p2p_communication.py: per micro-batch activations forward,
    # their grads backward, each sent by one stage and received by its neighbour (a send_recv pair:
    # the sent tensor on the wire); with SP the sequence-sharded tensor [s/tp, b, h]
    if vp > 1:
        # forward_backward_pipelining_with_interleaving (overlap_p2p_comm and
        # overlap_p2p_comm_warmup_flush off, the launcher's config): every virtual micro-batch sends its
        # activations to the next stage except out of the last stage's last chunk, and its grads to the
        # previous stage except from the first stage's first chunk; each is received by that
        # neighbour. test_megatron.py replays the schedule's control flow (get_schedule_table,
        # recv_tensor_from_previous_stage, ...) and checks these counts against it
        pairs = 2 * vp - first - last
        what = "activations / activation grads, interleaved (schedules.py, p2p_communication.py)"
    else:
        # forward_backward_pipelining_without_interleaving: per micro-batch and neighbour one tensor
        # sent and one received: send_forward + recv_backward with the next stage, recv_forward +
        # send_backward with the previous
        pairs = (not last) + (not first)
        what = "activations / activation grads (p2p_communication.py)"
    calls("pp", "send_recv", pdt, what, 2 * pairs, sbh, tp if sp else 1, pp, pairs)
