"""Faithful ledger for Megatron Core 0.18.0: what DDP + the (distributed) optimizer keep per rank and
which collectives one optimizer step calls. Each rule names the megatron source it follows
(paths under megatron/core/ unless said otherwise).

Resident state at a step boundary:
  params  DDP param buffer (param_data, bf16, padded) with the distributed optimizer, else the
          module's own parameters
  grads   DDP grad buffer (grad_data, fp32 with grad_reduce_in_fp32, padded)
  optim   fp32 master shards (bf16 params) + Adam exp_avg / exp_avg_sq per byte range + one
          4-byte `step` per parameter that has a non-empty range on this rank
  other   the optimizer's unity loss scale `_scale_one` (bf16 without a grad scaler), RoPE's
          inv_freq and cached emb, utils.py GlobalMemoryBuffer scratch (attention scores, SP
          all-gathers)
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache

from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict
from ledger.placement import CommBuilder, Placement, RankState

ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps `step` as a float32 scalar tensor per parameter


# -- the parameters of one pipeline stage -----------------------------------------------------------
def stage_params(model: ModelShape, tp: int, pp: int, stage: int, vp: int = 1, chunk: int = 0) -> list[tuple[str, int]]:
    """(name, local numel) in GPTModel.named_parameters() order for one PP stage (model chunk `chunk`
    of vp with interleaving) and TP rank.

    training/training.py get_model: with vp > 1 each stage builds vp GPTModels of layers/(pp*vp)
    layers; pre_process (embedding) only on chunk 0 of stage 0, post_process (final norm, output
    layer) only on chunk vp-1 of the last stage (pipeline_parallel/utils.py is_vp_first_stage /
    is_vp_last_stage).

    models/gpt/gpt_model.py GPTModel.__init__: embedding (pre_process), decoder, output_layer
    (post_process, untied); transformer/transformer_layer.py registers input_layernorm,
    self_attention, pre_mlp_layernorm, mlp; transformer/attention.py: Attention.__init__ builds
    linear_proj before SelfAttention.__init__ builds linear_qkv; transformer/mlp.py: linear_fc1
    (2*ffn when gated) then linear_fc2. Column-parallel weights split dim 0, row-parallel dim 1."""
    h, hd = model.hidden, model.head_dim
    per_stage = model.layers // (pp * vp)
    out: list[tuple[str, int]] = []
    first, last = stage == 0 and chunk == 0, stage == pp - 1 and chunk == vp - 1
    norm_n = h * (2 if model.norm == "layernorm" else 1)

    def lin(name, out_f, in_f, bias_len):
        out.append((f"{name}.weight", out_f * in_f))
        if model.bias:
            out.append((f"{name}.bias", bias_len))

    if first:
        out.append(("embedding.word_embeddings.weight", model.vocab // tp * h))
    for i in range(stage * per_stage, (stage + 1) * per_stage):
        p = f"decoder.layers.{i - stage * per_stage}"
        out.append((f"{p}.input_layernorm", norm_n))
        # row-parallel: bias is not split (tensor_parallel/layers.py RowParallelLinear)
        lin(f"{p}.self_attention.linear_proj", h, model.heads * hd // tp, h)
        qkv = (model.heads + 2 * model.kv_heads) * hd // tp
        lin(f"{p}.self_attention.linear_qkv", qkv, h, qkv)
        out.append((f"{p}.pre_mlp_layernorm", norm_n))
        fc1 = (2 if model.swiglu else 1) * model.ffn_hidden // tp
        lin(f"{p}.mlp.linear_fc1", fc1, h, fc1)
        lin(f"{p}.mlp.linear_fc2", h, model.ffn_hidden // tp, h)
    if last:
        out.append(("decoder.final_layernorm", norm_n))
        out.append(("output_layer.weight", model.vocab // tp * h))
    if model.norm == "layernorm":  # a LayerNorm is two tensors (weight, bias) of h each
        out = [x for name, n in out for x in
               ([(f"{name}.weight", h), (f"{name}.bias", h)] if name.endswith("layernorm") else [(name, n)])]
    else:
        out = [(f"{name}.weight", n) if name.endswith("layernorm") else (name, n) for name, n in out]
    return out


# -- DDP buffer layout ---------------------------------------------------------------------------
@dataclass
class Bucket:
    start: int
    end: int  # padded end
    params: list[tuple[str, int, int]]  # (name, start, end) in buffer coordinates

    @property
    def numel(self) -> int:
        return self.end - self.start


def effective_bucket_size(fw, dp: int, stage: int, chunk: int = 0) -> int | None:
    """distributed/distributed_data_parallel.py DistributedDataParallel.__init__: default
    max(40M, 1M*dp); None (one bucket) without overlap_grad_reduce or on PP stages after the first;
    training/training.py get_model: disable_bucketing for model chunks after the first (vp > 1)."""
    if not fw.overlap_grad_reduce or stage > 0 or chunk > 0:
        return None
    return fw.bucket_size if fw.bucket_size is not None else max(40_000_000, 1_000_000 * dp)


def buffer_layout(params: list[tuple[str, int]], bucket_size: int | None, dp: int, dist_opt: bool) -> list[Bucket]:
    """Params in reverse (backprop) order into buckets.

    Distributed optimizer: optimizer/distrib_optimizer.py _compute_per_buffer_param_layout with
    optimizer/param_layout.py pad_param_start (64 elements) and pad_bucket_end (lcm(dp, 128),
    pad_buckets_for_high_nccl_busbw off). Otherwise distributed/param_and_grad_buffer.py
    _compute_default_per_buffer_param_layout: no padding."""
    buckets: list[Bucket] = []
    cur: list[tuple[str, int, int]] = []
    start = bstart = 0
    pend = 0
    div = math.lcm(dp, 128)
    for name, n in reversed(params):
        if dist_opt:
            start = -(-start // 64) * 64
        pend = start + n
        cur.append((name, start, pend))
        if bucket_size is not None and pend - bstart >= bucket_size:
            end = -(-pend // div) * div if dist_opt else pend
            buckets.append(Bucket(bstart, end, cur))
            cur, bstart, start = [], end, end
        else:
            start = pend
    if cur:
        end = -(-pend // div) * div if dist_opt else pend
        buckets.append(Bucket(bstart, end, cur))
    return buckets


def shard_ranges(buckets: list[Bucket], dp: int, dp_rank: int) -> list[tuple[str, int]]:
    """(param name, elements) this DP rank owns: optimizer/distrib_optimizer.py
    _build_model_gbuf_range splits each (padded) bucket into dp equal ranges;
    _build_model_gbuf_param_range_map keeps each param's non-empty intersection."""
    out = []
    for b in buckets:
        size = b.numel // dp
        lo, hi = b.start + dp_rank * size, b.start + (dp_rank + 1) * size
        for name, s, e in b.params:
            k = min(e, hi) - max(s, lo)
            if k > 0:
                out.append((name, k))
    return out


@lru_cache(maxsize=1024)
def _stage(model: ModelShape, tp: int, pp: int, stage: int, bucket_size, dp: int, dist_opt: bool,
           vp: int = 1, chunk: int = 0):
    """A stage's (model chunk's) parameters and buffer layout: shared by its TP and DP ranks, and across
    the layouts of a sweep (read-only)."""
    params = stage_params(model, tp, pp, stage, vp, chunk)
    return params, buffer_layout(params, bucket_size, dp, dist_opt)


def owned_sizes(buckets: list[Bucket], dp: int, dp_rank: int) -> tuple[int, int]:
    """(elements, param pieces) of shard_ranges(buckets, dp, dp_rank), by bisection over each bucket's
    sorted param bounds instead of a pass over every parameter (big layouts have thousands of DP ranks)."""
    numel = pieces = 0
    for b in buckets:
        starts, ends, prefix = _bounds(b)
        size = b.numel // dp
        lo, hi = b.start + dp_rank * size, b.start + (dp_rank + 1) * size
        i0 = bisect_right(ends, lo)  # first param ending after lo
        i1 = bisect_left(starts, hi) - 1  # last param starting before hi
        if i0 > i1:
            continue
        numel += prefix[i1 + 1] - prefix[i0] - max(0, lo - starts[i0]) - max(0, ends[i1] - hi)
        pieces += i1 - i0 + 1
    return numel, pieces


_BOUNDS: dict[int, tuple] = {}


def _bounds(b: Bucket) -> tuple[list[int], list[int], list[int]]:
    """A bucket's param starts, ends and prefix lengths (buckets are cached and never change)."""
    key = id(b)
    hit = _BOUNDS.get(key)
    if hit is None or hit[0] is not b:
        starts = [st for _, st, _ in b.params]
        ends = [e for _, _, e in b.params]
        prefix = [0]
        for st, e in zip(starts, ends):
            prefix.append(prefix[-1] + e - st)
        hit = _BOUNDS[key] = (b, starts, ends, prefix)
    return hit[1], hit[2], hit[3]


# -- one rank ------------------------------------------------------------------------------------
def _dtype_bytes(dtype: str) -> int:
    return {"bf16": 2, "fp32": 4}[dtype]


def rank_state(model: ModelShape, lay: Layout, fw, grid: Grid, rank: int) -> RankState:
    c = grid.coords(rank)
    stage, dp, dp_rank, tp = c["pp"], lay.dp, c["dp"], lay.tp
    bf16 = fw.precision == "bf16"
    pdt = "bf16" if bf16 else "fp32"
    gdt = "fp32" if (fw.grad_reduce_in_fp32 or not bf16) else "bf16"
    pb, gb = _dtype_bytes(pdt), _dtype_bytes(gdt)
    dist_opt = fw.use_distributed_optimizer
    # one DDP (so one buffer per (param, grad) dtype) per model chunk: vp of them with interleaving
    chunks = [_stage(model, tp, lay.pp, stage, effective_bucket_size(fw, dp, stage, ch), dp, dist_opt, lay.vp, ch)
              for ch in range(lay.vp)]
    params = [p for ps_, _ in chunks for p in ps_]
    buckets = [b for _, bs in chunks for b in bs]  # every chunk's buckets, chunk 0 first
    n_local = sum(n for _, n in params)
    buf_numel = sum(b.numel for b in buckets)

    s = RankState(stage=stage)
    # params / grads: distributed/param_and_grad_buffer.py _ParamAndGradBuffer.__init__ allocates
    # param_data only with the distributed optimizer; grad_data always
    if dist_opt:
        s.add("params_bytes", f"{pdt} param buffer (param_data)", pb * buf_numel)
    else:
        s.add("params_bytes", f"{pdt} module parameters", pb * n_local)
    s.add("grads_bytes", f"{gdt} grad buffer (grad_data)", gb * buf_numel)
    # optim: distrib_optimizer.py _build_model_and_main_param_groups (fp32 master shard per
    # param range for bf16 params; fp32 params are optimized in place through views) or
    # optimizer.py Float16OptimizerWithFloat16Params (full fp32 masters) / FP32Optimizer;
    # the DP ranges are per bucket of each chunk's buffer (_build_gbuf_range_map per buffer)
    if dist_opt:
        sizes = [owned_sizes(bs, dp, dp_rank) for _, bs in chunks]
        owned_numel, owned_pieces = sum(n for n, _ in sizes), sum(k for _, k in sizes)
    else:
        owned_numel, owned_pieces = n_local, len(params)
    if bf16:
        s.add("optim_bytes", "fp32 master params", 4 * owned_numel)
    s.add("optim_bytes", "adam exp_avg + exp_avg_sq", 8 * owned_numel)
    s.add("optim_bytes", "adam step", ADAM_STEP_BYTES * owned_pieces)
    # optimizer.py MixedPrecisionOptimizer.__init__: bf16 without a grad scaler keeps _scale_one
    if bf16:
        s.add("other_bytes", "unity loss scale (_scale_one)", 4)
    # models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding: inv_freq (fp32,
    # ceil(kv_channels/2)) and the emb tensor [s, 1, 1, 2*ceil(kv_channels/2)] fp32 that the
    # @lru_cache on forward keeps alive (keyed by self: one per model chunk); every stage
    # computes it (gpt_model.py _preprocess)
    half = -(-model.head_dim // 2)
    s.add("other_bytes", "rope inv_freq", 4 * half * lay.vp)
    s.add("other_bytes", "rope emb (lru_cache)", 4 * model.seq_len * 2 * half * lay.vp)
    # utils.py GlobalMemoryBuffer ("mpu", activation dtype): grown to the largest request of
    # transformer/dot_product_attention.py (scores [b*heads/tp, s, s]) and, with SP, of the
    # all-gathers in tensor_parallel/layers.py / mappings.py ([s, b, h])
    act = 2 if bf16 else 4
    b, sq = lay.micro_batch_size, model.seq_len
    mpu = max(b * model.heads // tp * sq * sq, sq * b * model.hidden if lay.sequence_parallel else 0)
    s.add("other_bytes", "global memory buffer (mpu)", act * mpu)
    s.comm_fn = lambda: _comm(model, lay, fw, grid, rank, params, buckets, pb, gb, gdt, pdt)
    return s


def _comm(model, lay, fw, grid, rank, params, buckets, pb, gb, gdt, pdt):
    cb = CommBuilder()
    c = grid.coords(rank)
    stage, tp, pp, dp, m = c["pp"], lay.tp, lay.pp, lay.dp, lay.num_microbatches
    first, last = stage == 0, stage == pp - 1
    layers = model.layers // pp
    sp = lay.sequence_parallel
    act = 2 if fw.precision == "bf16" else 4
    sbh = model.seq_len * lay.micro_batch_size * model.hidden * act
    # DP: distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup.start_grad_sync, one
    # bucket per group (partition_buckets without fp8): reduce-scatter of the whole padded
    # bucket grad_data (distributed optimizer) or all-reduce; start_param_sync after
    # optimizer.step (step_with_ready_grads): all-gather of the bucket's param_data
    for b in buckets:
        if fw.use_distributed_optimizer:
            cb.add("dp", "reduce_scatter", gb * b.numel, dp, gdt, what="grad bucket (start_grad_sync)")
            cb.add("dp", "all_gather", pb * b.numel, dp, pdt, what="param bucket (start_param_sync)")
        else:
            cb.add("dp", "all_reduce", gb * b.numel, dp, gdt, what="grad bucket (start_grad_sync)")
    # TP per layer per micro-batch: tensor_parallel/layers.py + mappings.py. Without SP:
    # linear_qkv / linear_fc1 copy_to_tensor_model_parallel_region (all-reduce in backward),
    # linear_proj / linear_fc2 reduce_from_tensor_model_parallel_region (all-reduce in forward).
    # With SP: column-parallel all-gather forward + all-gather again in backward (wgrad input,
    # LinearWithGradAccumulationAndAsyncCommunication.backward) + reduce-scatter of the input grad;
    # row-parallel reduce-scatter forward + all-gather backward. Buffers: the full s*b*h.
    if sp:
        ag, rs = 6 * layers, 4 * layers
        if first:  # embedding: reduce_scatter_to_sequence_parallel_region (all-gather in backward)
            ag, rs = ag + 1, rs + 1
        if last:  # output_layer (column-parallel): all-gather fwd + bwd, reduce-scatter of dgrad
            ag, rs = ag + 2, rs + 1
        cb.add("tp", "all_gather", sbh, tp, pdt, count=ag * m, what="SP all-gather (layers.py/mappings.py)")
        cb.add("tp", "reduce_scatter", sbh, tp, pdt, count=rs * m, what="SP reduce-scatter (layers.py/mappings.py)")
    else:
        ar = 4 * layers + first + last  # embedding forward, output_layer input grad
        cb.add("tp", "all_reduce", sbh, tp, pdt, count=ar * m, what="TP all-reduce (mappings.py)")
    if last:
        # tensor_parallel/cross_entropy.py VocabParallelCrossEntropy.forward: logits max,
        # predicted logits, sum of exp, each fp32 [s, b]
        cb.add("tp", "all_reduce", model.seq_len * lay.micro_batch_size * 4, tp, "fp32", count=3 * m,
               what="vocab-parallel cross-entropy")
    if sp:
        # distributed/finalize_model_grads.py _allreduce_non_tensor_model_parallel_grads: one
        # coalesced all-reduce of the main grads of the `sequence_parallel` (norm) params
        sp_numel = sum(n for name, n in params if "layernorm" in name)
        cb.add("tp", "all_reduce", gb * sp_numel, tp, gdt, what="SP norm grads (finalize_model_grads)")
    # PP: pipeline_parallel/schedules.py forward_backward_pipelining_without_interleaving +
    # p2p_communication.py: per micro-batch activations forward, their grads backward; with SP
    # the sequence-sharded tensor [s/tp, b, h]
    if pp > 1 and lay.vp > 1:
        shard = sbh // (tp if sp else 1)
        sent, received = interleaved_p2p(pp, stage, lay.vp, m)
        for _ in range(sent):
            cb.add_p2p("pp", sent_bytes=shard, received_bytes=0, dtype=pdt,
                       what="activations / activation grads, interleaved (schedules.py, p2p_communication.py)")
        for _ in range(received):
            cb.add_p2p("pp", sent_bytes=0, received_bytes=shard, dtype=pdt,
                       what="activations / activation grads, interleaved (schedules.py, p2p_communication.py)")
    elif pp > 1:
        shard = sbh // (tp if sp else 1)
        nxt = 0 if last else 1
        prv = 0 if first else 1
        # per micro-batch and neighbour one tensor sent and one received: send_forward +
        # recv_backward with the next stage, recv_forward + send_backward with the previous
        for _ in range((nxt + prv) * m):
            cb.add_p2p("pp", sent_bytes=shard, received_bytes=shard, dtype=pdt,
                       what="activations / activation grads (p2p_communication.py)")
    # grad norm: optimizer/clip_grads.py get_grad_norm_fp32, one fp32 all-reduce over
    # grad_stats_parallel_group: the whole world with the distributed optimizer
    # (optimizer/__init__.py: intra_dist_opt_group), else the model-parallel group
    world = list(range(grid.world))
    group = world if fw.use_distributed_optimizer else grid.group(rank, ("tp", "pp"))
    if fw.clip_grad > 0 and len(group) > 1:
        cb.add(grid.label(group), "all_reduce", 4, len(group), "fp32", what="grad norm (clip_grads.py)")
    return cb.build()


# -- the interleaved schedule (vp > 1) -----------------------------------------------------------
def check_interleaving(lay: Layout) -> None:
    """pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving: with
    microbatch_group_size_per_vp_stage = pp (model_parallel_config.py default) it needs
    pp <= num_microbatches and no final group smaller than pp, i.e. num_microbatches % pp == 0."""
    m = lay.num_microbatches
    if lay.vp > 1 and (m < lay.pp or m % lay.pp):
        raise ConfigError(f"megatron: vp={lay.vp}: layout.global_batch_size={lay.global_batch_size} gives "
                          f"num_microbatches={m} (global_batch_size / (micro_batch_size*dp)), which must be a "
                          f"multiple of pp={lay.pp} for the interleaved schedule")


def _schedule_table(m: int, vp: int, group: int) -> list[tuple[int, int]]:
    """schedules.py get_schedule_table: (microbatch id, model chunk id) per virtual micro-batch."""
    out = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        out += [(mb, ch) for ch in range(vp) for mb in range(lo, hi)]
    return out


def interleaved_p2p(pp: int, stage: int, vp: int, m: int) -> tuple[int, int]:
    """(tensors sent, tensors received) by one stage in one forward_backward_pipelining_with_interleaving
    call, replaying its control flow with overlap_p2p_comm and overlap_p2p_comm_warmup_flush off
    (the launcher's config): get_pp_rank_microbatches (warm-up length), recv_tensor_from_previous_stage
    (the leading stage receives nothing for its first pp-1 virtual micro-batches and nothing for the
    last chunk's), the first stage's first chunk sends no input grad, the last stage's last chunk no
    output; p2p_communication.py _communicate posts one isend / irecv per non-None tensor / recv flag."""
    group = pp  # microbatch_group_size_per_vp_stage
    total = m * vp
    table = _schedule_table(m, vp, group)
    first, last = stage == 0, stage == pp - 1
    warm = (pp - stage - 1) * 2 + (vp - 1) * group
    all_warm = warm >= total
    warm = min(warm, total)
    remaining = total - warm

    def chunk(k: int, forward: bool) -> int:
        c = table[k % total][1]
        return c if forward else vp - 1 - c

    def recv_from_prev(k: int, forward: bool) -> bool:
        leading = first if forward else last
        if not leading:
            return True
        end_chunk = vp - 1 if forward else 0
        nxt = chunk(k + 1, forward) if k < pp - 1 else chunk(k - (pp - 1), forward)
        return k >= pp - 1 and nxt != end_chunk

    sent = received = 0
    received += not first  # recv_forward for chunk 0 (none on the first stage)
    for k in range(warm):
        recv_prev = recv_from_prev(k, True) and k != total - 1
        out = not (chunk(k, True) == vp - 1 and last)
        sent += out
        received += recv_prev
        if k == warm - 1 and not all_warm:  # send_forward_backward_recv_forward_backward
            received += not last
    for k in range(remaining):
        fk = k + warm
        out = not (chunk(fk, True) == vp - 1 and last)
        grad = not (chunk(k, False) == 0 and first)
        recv_prev = recv_from_prev(fk, True) and k != remaining - 1
        recv_next = recv_from_prev(k, False)
        sent += out + grad
        received += recv_prev + recv_next
    if all_warm:
        received += not last  # recv_backward for the last chunk
    for k in range(remaining, total):
        grad = not (chunk(k, False) == 0 and first)
        recv_next = recv_from_prev(k, False) and k != total - 1
        sent += grad
        received += recv_next
    return sent, received


def place(model: ModelShape, lay: Layout, fw) -> Placement:
    # what this ledger does not model is refused, naming the field (textbook mode still predicts it)
    if model.tied_embeddings:
        raise ConfigError("megatron: model.tied_embeddings=true is not modelled by the faithful ledger yet "
                          "(shared_embedding bucket, embedding-group all-reduce)")
    if getattr(fw, "overlap_param_gather", False):
        raise ConfigError("megatron: framework.overlap_param_gather=true is not modelled by the faithful ledger "
                          "yet (the all-gathers move into the next step's forward pre-hooks)")
    if lay.cp > 1:
        raise ConfigError(f"megatron: cp={lay.cp}: the faithful ledger models cp=1 only")
    check_interleaving(lay)
    grid = lay.grid
    cache: dict[tuple, RankState] = {}

    def state(rank: int) -> RankState:
        c = grid.coords(rank)
        key = (c["pp"], c["dp"])  # TP ranks of a stage hold equal shapes
        if key not in cache:
            cache[key] = rank_state(model, lay, fw, grid, rank)
        return cache[key]

    pl = Placement(framework="megatron", mode="faithful", model=model_dict(model),
                   layout=lay.to_dict(), world=lay.world, rank_state=state,
                   # TP ranks of a stage hold equal shapes: one per (stage, dp rank) covers every state
                   representatives=[grid.rank({"pp": p, "dp": d}) for p in range(lay.pp) for d in range(lay.dp)])
    pl.notes.append("megatron-core 0.18.0: DDP buffers padded as distrib_optimizer.py "
                    "_compute_per_buffer_param_layout; master/Adam per DP byte range")
    pl.notes.append("other: the local (non-TransformerEngine) spec's DotProductAttention keeps a "
                    "[b*heads/tp, s, s] score buffer in GlobalMemoryBuffer; TE's fused attention (run.sh) does not")
    return pl
