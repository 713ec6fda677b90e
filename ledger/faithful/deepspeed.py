"""DeepSpeed 0.19.8 ZeRO-1/2/3, faithful: what the engine keeps per rank and calls per optimizer step.

Pure data parallelism (train-ledger drives DeepSpeed without Megatron-DeepSpeed): every rank is a DP
rank, all ranks hold the same byte counts. bf16 mixed precision with torch's AdamW (`torch_adam`);
paths quoted are under deepspeed/runtime/. Each rule names the function it follows.

Known limits (raise ConfigError rather than guess): fp32 precision, ZeRO-3 with gradient
accumulation (the trace then completes inside step 0), ZeRO-3 prefetch settings between the two
regimes modelled (per-module fetch: prefetch 0 and reuse distance 0; one coalesced fetch: prefetch,
live-parameter and reuse budgets covering the whole model), a parameter larger than
reduce_bucket_size (DeepSpeed reduces it on its own, outside the bucket), tied embeddings at stage 3.
"""
from __future__ import annotations

from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict, numel
from ledger.placement import CommBuilder, Placement, RankState

BF16, FP32, FP64, INT64 = 2, 4, 8, 8


def _module(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0]


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def backward_order(model: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters in the order their gradients become ready (autograd on launchers.llama.Llama):
    output, final norm, then each block last to first: w2, w3, w1, ffn_norm, wo, wv, wk, wq,
    attention_norm; the embedding last. Measured through the IPG bucket boundaries."""
    shapes = dict(model.params())
    inner = ["feed_forward.w2", "feed_forward.w3", "feed_forward.w1", "ffn_norm", "attention.wo", "attention.wv",
             "attention.wk", "attention.wq", "attention_norm"]
    out = [(n, shapes[n]) for n in ("output.weight",) if n in shapes]
    out += [(n, s) for n, s in model.norm_params("norm")]
    for i in reversed(range(model.layers)):
        by_mod: dict[str, list] = {}
        for n, s in model.layer_params(i):
            by_mod.setdefault(_module(n).split(".", 2)[2], []).append((n, s))
        for m in inner:
            out += by_mod.get(m, [])
    out.append(("tok_embeddings.weight", shapes["tok_embeddings.weight"]))
    assert sorted(out) == sorted(model.params()), "backward order must list every parameter once"
    return out


def ipg_buckets(sizes: list[int], bucket: int) -> list[int]:
    """Elements per IPG bucket: a gradient that would overflow the bucket flushes it first
    (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads; stage3.py
    __reduce_and_partition_ipg_grads via reduce_partition_and_remove_grads: the same rule)."""
    out, cur = [], 0
    for n in sizes:
        if cur + n > bucket and cur > 0:
            out.append(cur)
            cur = 0
        cur += n
    if cur:
        out.append(cur)
    return out


def invoked_modules(model: ModelShape) -> int:
    """Modules whose forward runs once per forward (ZeRO-3 traces each, forward and backward):
    root, embedding, per block (block, 2 norms, attention + 4 linears, feed_forward + 2-3 linears),
    final norm, output. The ModuleList is never called."""
    per_block = 1 + 2 + 1 + 4 + 1 + (3 if model.swiglu else 2)
    return 1 + 1 + model.layers * per_block + 1 + 1


def place(model: ModelShape, lay: Layout, fw) -> Placement:
    if fw.precision != "bf16":
        raise ConfigError(f"framework.precision={fw.precision!r}: the faithful DeepSpeed ledger models bf16 only")
    biggest = max(numel(s) for _, s in model.params())
    if biggest > fw.reduce_bucket_size:
        raise ConfigError(f"framework.reduce_bucket_size={fw.reduce_bucket_size} < largest parameter ({biggest} "
                          "elements): DeepSpeed then reduces that gradient outside the IPG bucket, not modelled")
    z = fw.zero_stage
    if z == 3:
        s = _zero3(model, lay, fw)
    elif z in (1, 2):
        s = _zero12(model, lay, fw)
    else:
        raise ConfigError(f"framework.zero_stage={z}: the faithful DeepSpeed ledger models stages 1, 2 and 3")
    pl = Placement(framework="deepspeed", mode="faithful", model=model_dict(model), layout=lay.to_dict(),
                   world=lay.world, rank_state=lambda r: s)
    pl.notes.append(f"DeepSpeed 0.19.8 ZeRO-{z}, bf16, torch AdamW; pure DP over {lay.dp} ranks")
    return pl


def _zero12(model: ModelShape, lay: Layout, fw) -> RankState:
    dp, m, n = lay.dp, lay.num_microbatches, model.num_params()
    s = RankState(stage=fw.zero_stage)
    # stage_1_and_2.py __init__: one param group -> one flat bf16 buffer, padded to a multiple of
    # dp * nccl_start_alignment_factor (2) (flatten_dense_tensors_aligned); params are views into it
    flat = _ceil_to(n, 2 * dp)
    part = flat // dp
    s.add("params_bytes", "bf16 flat group (bit16_groups_flat)", BF16 * flat)
    # single_partition_of_fp32_groups: fp32 clone of this rank's slice; AdamW state on it
    s.add("optim_bytes", "fp32 partition (single_partition_of_fp32_groups)", FP32 * part)
    s.add("optim_bytes", "adam exp_avg + exp_avg_sq", 2 * FP32 * part)
    s.add("optim_bytes", "adam step", FP32)
    # the gradient partition (averaged_gradients) and IPG buffers are freed in step()
    # (free_grad_in_param_list / zero_grad): nothing of the gradients survives the boundary
    s.add("other_bytes", "_global_grad_norm (fp32 scalar)", FP32)

    cb = CommBuilder()
    if fw.zero_stage == 1 and not fw.overlap_comm:
        # stage 1 without overlap: reduce_gradients() walks bit16_groups (registration order) once,
        # at the accumulation boundary
        sizes, times = [numel(sh) for _, sh in model.params()], 1
    else:
        # grad hooks (process_gradients) bucket in gradient-ready order; stage 2 reduces every
        # micro-batch (reduce_ready_partitions_and_remove_grads: partition_gradients), stage 1 with
        # overlap_comm only at the boundary
        sizes = [numel(sh) for _, sh in backward_order(model)]
        times = m if fw.zero_stage == 2 else 1
    for b in ipg_buckets(sizes, fw.reduce_bucket_size):
        # average_tensor(reduce_scatter=True, use_multi_rank_bucket_allreduce) -> allreduce_and_scatter:
        # one all-reduce of the whole bucket (no reduce-scatter at stage 1 or 2)
        cb.add("dp", "all_reduce", BF16 * b, dp, "bf16", count=times, what="IPG bucket (average_tensor)")
    # step(): overflow check (has_overflow -> all_reduce uint8 MAX) and grad norm (fp32 SUM)
    cb.add("dp", "all_reduce", 1, dp, "uint8", what="overflow check")
    cb.add("dp", "all_reduce", FP32, dp, "fp32", what="grad norm")
    # utils.all_gather_dp_groups -> all_gather_into_tensor_dp_groups: one call per param group
    cb.add("dp", "all_gather", BF16 * flat, dp, "bf16", what="updated bf16 partitions")
    s.comm = cb.build()
    return s


def _zero3(model: ModelShape, lay: Layout, fw) -> RankState:
    dp, m = lay.dp, lay.num_microbatches
    if m != 1:
        raise ConfigError(f"layout: {m} micro-batches per step: ZeRO-3 tracing then completes inside step 0; "
                          "the faithful ledger models one micro-batch per step")
    if model.tied_embeddings:
        raise ConfigError("model.tied_embeddings=true with zero_stage=3 is not modelled")
    params = model.params()
    pad = {name: _ceil_to(numel(sh), dp) for name, sh in params}  # partition_parameters.py _aligned_size
    part = sum(pad.values()) // dp
    # parameter_offload.py mark_persistent_parameters: ds_numel <= stage3_param_persistence_threshold
    persist = [name for name, sh in params if numel(sh) <= fw.stage3_param_persistence_threshold]
    mods: dict[str, list[str]] = {}
    for name, _ in params:
        mods.setdefault(_module(name), []).append(name)
    np_mods = [mo for mo, ps in mods.items() if any(p not in persist for p in ps)]
    np_elems = sum(pad[p] for p in pad if p not in persist)
    persist_numel = sum(numel(sh) for name, sh in params if name in persist)

    s = RankState(stage=3)
    # stage3.py _create_fp16_partitions_with_defragmentation: the ds_tensors of one sub-group live in
    # fp16_partitioned_groups_flat (sub_group_size 1e9 >> tiny models: one group)
    s.add("params_bytes", "bf16 partitions (ds_tensor, fp16_partitioned_groups_flat)", BF16 * part)
    # ds_persist params stay gathered after _post_step (full bf16 tensors)
    s.add("params_bytes", "persistent params (full)", BF16 * persist_numel)
    # grad_partitions_flat_buffer (gradient_accumulation_dtype bf16) and the IPG bucket of
    # reduce_bucket_size elements, allocated at init and kept (IPGBucketZ3)
    s.add("grads_bytes", "grad partitions (grad_partitions_flat_buffer)", BF16 * part)
    s.add("grads_bytes", "IPG bucket (reduce_bucket_size)", BF16 * fw.reduce_bucket_size)
    s.add("optim_bytes", "fp32 partition (fp32_partitioned_groups_flat)", FP32 * part)
    s.add("optim_bytes", "adam exp_avg + exp_avg_sq", 2 * FP32 * part)
    s.add("optim_bytes", "adam step", FP32)
    s.add("other_bytes", "_global_grad_norm (fp64 scalar)", FP64)
    s.add("other_bytes", "inf_or_nan_tracker (bool)", 1)

    def common(cb: CommBuilder) -> None:
        for b in ipg_buckets([pad[name] for name, _ in backward_order(model)], fw.reduce_bucket_size):
            # __avg_scatter_grads: one reduce-scatter of the bucket (per-param padded to dp)
            cb.add("dp", "reduce_scatter", BF16 * b, dp, "bf16", what="IPG bucket (__avg_scatter_grads)")
        # get_grad_norm_direct: fp64 norm all-reduce (bf16 has no overflow all-reduce at stage 3)
        cb.add("dp", "all_reduce", FP64, dp, "fp64", what="grad norm")
        # _post_step: persistent_parameters[0].all_gather(persistent_parameters): one call per param
        for name in persist:
            cb.add("dp", "all_gather", BF16 * pad[name], dp, "bf16", what="persistent params (_post_step)")

    # steady: the trace is complete (partitioned_param_coordinator.py fetch_sub_module)
    cb = CommBuilder()
    total = sum(pad.values())
    if fw.stage3_prefetch_bucket_size == 0 and fw.stage3_max_reuse_distance == 0:
        # no prefetch, no reuse: each module's non-persistent params gathered before its forward and
        # again before its backward, released after each (the 3N pattern)
        for mo in np_mods:
            b = sum(pad[p] for p in mods[mo] if p not in persist)
            cb.add("dp", "all_gather", BF16 * b, dp, "bf16", count=2, what="per-module fetch, forward + backward")
    elif (fw.stage3_prefetch_bucket_size >= np_elems and fw.stage3_max_live_parameters >= total
          and fw.stage3_max_reuse_distance >= total):
        # the root module (no direct params) is fetched first; its prefetch takes every
        # non-persistent param in one coalesced all-gather; the reuse distance keeps them
        # gathered through backward (the 2N pattern)
        cb.add("dp", "all_gather", BF16 * np_elems, dp, "bf16", what="coalesced prefetch of all params")
    else:
        raise ConfigError("framework.stage3_prefetch_bucket_size / stage3_max_reuse_distance / "
                          "stage3_max_live_parameters: only 0/0 or budgets covering the whole model are modelled")
    common(cb)
    s.comm = cb.build()

    # step 0: trace INVALID -> every module with params fetched and released around its forward and
    # its backward; reset_step broadcasts an empty trace (assert_ints_same_as_other_ranks: len + list)
    first = CommBuilder()
    for mo, ps in mods.items():
        first.add("dp", "all_gather", BF16 * sum(pad[p] for p in ps), dp, "bf16", count=2,
                  what="untraced per-module fetch, forward + backward")
    first.add("dp", "broadcast", INT64, dp, "int64", what="trace length check (empty)")
    first.add("dp", "broadcast", 0, dp, "int64", what="trace list (empty)")
    common(first)
    s.comm_first = first.build()

    # step 1: reset_step completes the recorded trace: three checked lists (modules fwd+bwd, params,
    # their step ids), each a length broadcast and a list broadcast; then steady
    s.comm_warmup = [_steady_plus_trace(model, len(params), dp, s.comm)]
    return s


def _steady_plus_trace(model: ModelShape, n_params: int, dp: int, steady) -> list:
    from ledger.placement import Comm, wire_bytes

    out = [Comm(c.dim, c.kind, c.count, c.buffer_bytes, c.wire_bytes, c.dtype, c.what) for c in steady]
    n_mod = 2 * invoked_modules(model)
    n_par = 2 * n_params  # record_parameters: one entry per param of each fetched module, fwd and bwd
    sizes = [INT64, INT64 * n_mod, INT64, INT64 * n_par, INT64, INT64 * n_par]
    out.append(Comm("dp", "broadcast", len(sizes), sum(sizes), sum(wire_bytes("broadcast", b, dp) for b in sizes),
                    "int64", "trace checks (reset_step completing the trace)"))
    return out
