"""DeepSpeed 0.19.8 ZeRO-1/2/3, faithful: what the engine keeps per rank and calls per optimizer step.

Pure data parallelism (train-ledger drives DeepSpeed without Megatron-DeepSpeed): every rank is a DP
rank, all ranks hold the same byte counts. bf16 mixed precision (a `bf16` section) or plain fp32 (none),
with torch's AdamW (`torch_adam`); paths quoted are under deepspeed/runtime/. Each rule names the
function it follows.

One optimizer step is `num_microbatches` forward + backward passes (engine.step() at each, the
optimizer only at the accumulation boundary). ZeRO-3's parameter trace
(zero/partitioned_param_coordinator.py) is recorded in the first forward + backward and completed
at the start of the second one, wherever that falls: inside step 0 with two or more micro-batches,
at the start of step 1 with one.

ZeRO-3's parameter fetches are a replay of the coordinator (deepspeed_coordinator.py) over the module hook order of
launchers.llama.Llama: any stage3_prefetch_bucket_size / stage3_max_live_parameters /
stage3_max_reuse_distance, DeepSpeed's defaults included.

The peak within a step (RankState.peak, issue 18) is ledger/faithful/deepspeed/peak.py's: the
optimizer step's temporaries or the backward's first nodes over the resident state, activations derived
from launchers/llama.py; framework.activation_checkpointing (deepspeed.checkpointing.checkpoint around
every layer) at ZeRO-1/2.

Known limits (raise ConfigError rather than guess): contiguous_gradients=false (another reduction
path, buffered_reduce_fallback, and no IPG buffer at stage 3).

Speed: a layout search calls place() ~20,000 times/s. Everything derived from the model (gradient
order, per-parameter padding, module maps, IPG buckets, collective sums) is cached per (model, dp,
knobs); a RankState's steady collectives are computed on first use (comm_fn). The coordinator replay
is per (model, persistence threshold, budgets, micro-batches), in elements, and shared by every dp.
Every decoder block is the same: IPG buckets are counted a block at a time until the bucket open at a
block start repeats (_by_blocks), and the replay skips whole blocks once its state repeats
(deepspeed_coordinator._Z3Sim._skip); both are tested against the walk over every parameter / event.
Passes are shared where provably the same: a pass's backward is the first complete pass's when their
states agree where it starts, and with one micro-batch step 1's pass is the gradient-accumulation
coordinator's pass from the same start when every cached release it read is what a fresh coordinator
would compute (_Z3Sim.as_first); both are tested against the event replay too. A search reads the
steady step only (_z3_steady): no recording pass is replayed, its end (where step 0's micro-batch 1
starts) is known in closed form (deepspeed_coordinator._z3_after_record, tested against the replay).
Without prefetch and reuse distance no coordinator is replayed at all: every fetch gathers the
module's non-persistent params (_z3_fetch_on_use, tested against the replay).
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

from ledger.dtypes import BF16, FP32, FP64, INT64
from ledger.faithful.deepspeed import backward as deepspeed_backward
from ledger.faithful.deepspeed import peak as deepspeed_peak
from ledger.faithful.deepspeed.backward import _ceil_to
from ledger.faithful.deepspeed.coordinator import (_block, _z3_fetches, _z3_steady, _z3_trace, backward_module,
                                                   z3_backward_moments, z3_first_moments, z3_moments)
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict, numel
from ledger.placement import Comm, CommBuilder, Placement, RankState, wire_bytes

# engine.get_data_types(): the model dtype is bf16 with a `bf16` section, fp32 without one; ZeRO keeps
# its flat params / partitions, gradients and IPG buckets and communicates in it (grad_accum_dtype and
# communication_data_type default to the model dtype)
_DTYPES = {"bf16": BF16, "fp32": FP32}


# a block's modules in the order their gradients become ready (autograd on launchers.llama.Block)
_BLOCK_BACKWARD = ("feed_forward.w2", "feed_forward.w3", "feed_forward.w1", "ffn_norm", "attention.wo", "attention.wv",
                   "attention.wk", "attention.wq", "attention_norm")


@lru_cache(maxsize=64)
def _block_perm(model: ModelShape) -> tuple[int, ...]:
    """Indexes into a block's params (layer_params order) in gradient-ready order."""
    mods = [mo for mo, _ in _block(model)]
    return tuple(j for mo in _BLOCK_BACKWARD for j, m in enumerate(mods) if m == mo)


@lru_cache(maxsize=64)
def backward_order(model: ModelShape) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Parameters in the order their gradients become ready (autograd on launchers.llama.Llama):
    output, final norm, then each block last to first: w2, w3, w1, ffn_norm, wo, wv, wk, wq,
    attention_norm; the embedding last (tied: its one AccumulateGrad runs once both uses have
    contributed, after the embedding's backward). Measured through the IPG bucket boundaries."""
    emb = (model.vocab, model.hidden)
    out = [] if model.tied_embeddings else [("output.weight", emb)]
    out += model.norm_params("norm")
    perm = _block_perm(model)
    for i in reversed(range(model.layers)):
        lp = model.layer_params(i)
        out += [lp[j] for j in perm]
    out.append(("tok_embeddings.weight", emb))
    return tuple(out)


@lru_cache(maxsize=64)
def _size_parts(model: ModelShape, registration: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """numel of _registration_sizes (registration) or _grad_sizes as (before the blocks, one block,
    after the blocks): every block is the same."""
    e = model.vocab * model.hidden
    norms = [numel(sh) for _, sh in model.norm_params("norm")]
    out = [] if model.tied_embeddings else [e]
    blk = _block(model)
    if registration:  # embedding, blocks, final norm, output
        return (e,), tuple(n for _, n in blk), tuple(norms + out)
    # output, final norm, blocks last to first (backward_order), embedding
    return tuple(out + norms), tuple(blk[j][1] for j in _block_perm(model)), (e,)


@lru_cache(maxsize=64)
def _grad_sizes(model: ModelShape) -> tuple[int, ...]:
    """numel of backward_order(model), built per block."""
    head, blk, tail = _size_parts(model, False)
    return head + blk * model.layers + tail


@lru_cache(maxsize=64)
def _registration_sizes(model: ModelShape) -> tuple[int, ...]:
    """numel of model.params() (registration order), built per block."""
    head, blk, tail = _size_parts(model, True)
    return head + blk * model.layers + tail


def _by_blocks(fill, cur: int, layers: int, out: Counter) -> int:
    """`fill` (the bucket open when a block starts -> the bucket it leaves open, the buckets it
    closes) over `layers` identical blocks, counting the closed buckets into `out`; returns the bucket
    left open. What a block closes and leaves open depends only on the bucket open at its start: once
    that repeats, the blocks in between repeat, and the rest are counted whole periods at a time."""
    seen: dict | None = {}  # the bucket open at a block start -> that block
    walked: list = []  # each walked block's closed buckets
    i = 0
    while i < layers:
        if seen is not None:
            if cur in seen:
                j = seen[cur]
                reps = (layers - i) // (i - j)
                for closed in walked[j:i]:
                    for b in closed:
                        out[b] += reps
                i += reps * (i - j)
                seen = None
                continue
            if i < 16:
                seen[cur] = i
            else:  # no repeat soon (a bucket above a block): walk on
                seen = None
        cur, closed = fill(cur)
        out.update(closed)
        if seen is not None:
            walked.append(closed)
        i += 1
    return cur


def ipg_buckets(sizes, bucket: int) -> list[int]:
    """Elements per IPG bucket: a gradient that would overflow the bucket flushes it first
    (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads; stage3.py
    __reduce_and_partition_ipg_grads via reduce_partition_and_remove_grads: the same rule)."""
    out: list[int] = []
    cur = _ipg_fill(sizes, bucket, 0, out)
    if cur:
        out.append(cur)
    return out


def _ipg_fill(sizes, bucket: int, cur: int, out: list) -> int:
    """ipg_buckets' rule from a bucket holding `cur` elements: closed buckets appended to out; returns
    the open bucket's elements."""
    for n in sizes:
        if cur + n > bucket and cur > 0:
            out.append(cur)
            cur = 0
        cur += n
    return cur


# -- collective sums -------------------------------------------------------------------------------

class _Calls(NamedTuple):
    """`count` calls of one kind: bytes handed to them and wire bytes, each call floored on its own
    (placement.wire_bytes), so a sum of calls reconciles with the probe's per-call records."""
    count: int
    nbytes: int
    wire: int

    def times(self, k: int) -> "_Calls":
        return _Calls(self.count * k, self.nbytes * k, self.wire * k)

    def plus(self, o: "_Calls") -> "_Calls":
        return _Calls(self.count + o.count, self.nbytes + o.nbytes, self.wire + o.wire)


def _calls(kind: str, buffers, group: int, times: int = 1) -> _Calls:
    """`times` rounds of one call per buffer (bytes)."""
    return _counted(kind, ((b, 1) for b in buffers), group, times)


def _counted(kind: str, counts, group: int, times: int = 1) -> _Calls:
    """_calls over (buffer bytes, how many calls) pairs."""
    count = nbytes = wire = 0
    for b, k in counts:
        count += k
        nbytes += b * k
        wire += wire_bytes(kind, b, group) * k
    return _Calls(count * times, nbytes * times, wire * times)


_NONE = _Calls(0, 0, 0)


class _Memory(RankState):
    """A RankState's four states and detail, computed once per (model, dp, knobs); state() copies it
    (cheaper than repeating the named adds for every layout)."""

    def state(self) -> RankState:
        return RankState(stage=self.stage, params_bytes=self.params_bytes, grads_bytes=self.grads_bytes,
                         optim_bytes=self.optim_bytes, other_bytes=self.other_bytes, detail=dict(self.detail))


def _fresh(comms) -> list[Comm]:
    """A list of its own per RankState (the cached Comm objects themselves are only read)."""
    return list(comms)


# -- place -----------------------------------------------------------------------------------------

def place(model: ModelShape, lay: Layout, fw) -> Placement:
    if fw.precision not in _DTYPES:
        raise ConfigError(f"framework.precision={fw.precision!r}: the faithful DeepSpeed ledger models bf16 and fp32")
    if not fw.contiguous_gradients:
        raise ConfigError("framework.contiguous_gradients=false: DeepSpeed then reduces through "
                          "buffered_reduce_fallback (stage 1/2) and keeps no IPG buffer (stage 3), not modelled")
    z = fw.zero_stage
    if z == 3 and fw.get("activation_checkpointing", False):
        raise ConfigError("framework.activation_checkpointing=true with framework.zero_stage=3: the checkpointed "
                          "layers' recompute in backward fetches their parameters again (ZeRO-3's module hooks), "
                          "a fetch order the coordinator replay does not model; ZeRO-1/2 are modelled")
    if z == 3:
        s = _zero3(model, lay, fw)
        state = lambda r: s  # noqa: E731 (every rank's the same)
    elif z in (1, 2):
        state = _zero12(model, lay, fw)
    else:
        raise ConfigError(f"framework.zero_stage={z}: the faithful DeepSpeed ledger models stages 1, 2 and 3 "
                          "(stage 0, DeepSpeed as plain data parallelism, only with ledger.mode=textbook)")
    pl = Placement(framework="deepspeed", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                   world=lay.world, rank_state=state, representatives=[0])
    pl.notes.append(f"DeepSpeed 0.19.8 ZeRO-{z}, {fw.precision}, torch AdamW; pure DP over {lay.dp} ranks")
    return pl


# -- ZeRO-1/2 ----------------------------------------------------------------------------------

def _zero12(model: ModelShape, lay: Layout, fw) -> Callable[[int], RankState]:
    """rank -> its state: the states and collectives are every rank's, ZeRO-2's peak its partition's."""
    s = _zero12_memory(model, lay.dp, fw.zero_stage, fw.precision).state()
    # stage 1 without overlap_comm: reduce_gradients() once, at the accumulation boundary; stage 1 with
    # overlap_comm: the hooks, also only at the boundary; stage 2 reduces every micro-batch
    # (reduce_ready_partitions_and_remove_grads: partition_gradients)
    rounds = lay.num_microbatches if fw.zero_stage == 2 else 1
    key = (model, lay.dp, fw.zero_stage, bool(fw.overlap_comm), fw.reduce_bucket_size, rounds, fw.precision)
    s.comm_fn = lambda: _fresh(_zero12_comm(*key))
    w, part = _DTYPES[fw.precision], _ceil_to(model.num_params(), 2 * lay.dp) // lay.dp
    bucket = int(fw.reduce_bucket_size)

    def peak(flush=None, hooks=None, order=None):
        return deepspeed_peak.peak(
            model, lay.micro_batch_size, lay.num_microbatches, fw.zero_stage, w,
            bool(fw.get("activation_checkpointing", False)), part=part, params_resident=s.params_bytes,
            optim=s.optim_bytes, grads_resident=0, persist=0, n=model.num_params(), bucket=bucket,
            flush=flush, hooks=hooks,
            ipg_touched=deepspeed_backward.ipg_touched(model, lay.dp, bucket, order) if order else True,
            grads_hooked=deepspeed_backward.hooked(model, lay.dp, bucket, backward_order(model)))

    # a rank's peak depends on its partition (where its grads_in_partition is made, its size): one
    # state per distinct flush, sharing the rest. ZeRO-2 reduces in the hooks' order, ZeRO-1 (no
    # overlap_comm) in reduce_gradients' walk of the params at the boundary
    if fw.zero_stage == 1 and fw.overlap_comm:
        # stage 1 then reduces in the hooks at the boundary (double IPG buffers): not a candidate
        s.peak = peak
        return lambda r: s
    order = backward_order(model) if fw.zero_stage == 2 else tuple(model.params())
    hk = deepspeed_backward.hooks(backward_order(model), model.layers)
    flushes = deepspeed_backward.partition_flushes(model, lay.dp, bucket, order)
    by_flush: dict = {}
    for f in flushes:
        if f not in by_flush:
            st = by_flush[f] = copy.copy(s) if by_flush else s
            st.peak = (lambda f=f: peak(f, hk, order))
    return lambda r: by_flush[flushes[r % lay.dp]]


@lru_cache(maxsize=256)
def _zero12_memory(model: ModelShape, dp: int, stage: int, precision: str) -> "_Memory":
    n = model.num_params()
    w = _DTYPES[precision]
    s = _Memory()  # stage: the pipeline stage (0; DeepSpeed runs as pure DP here), not the ZeRO stage
    # stage_1_and_2.py __init__: one param group -> one flat buffer in the model dtype, padded to a
    # multiple of dp * nccl_start_alignment_factor (2) (flatten_dense_tensors_aligned; parameter_alignment
    # off: no per-param padding); params are views into it
    flat = _ceil_to(n, 2 * dp)
    part = flat // dp
    s.add("params_bytes", f"{precision} flat group (bit16_groups_flat)", w * flat)
    # single_partition_of_fp32_groups: `partition.detach().clone().to(fp32)`, a copy of this rank's
    # slice even when the model is fp32; AdamW state on it
    s.add("optim_bytes", "fp32 partition (single_partition_of_fp32_groups)", FP32 * part)
    s.add("optim_bytes", "adam exp_avg + exp_avg_sq", 2 * FP32 * part)
    s.add("optim_bytes", "adam step", FP32)
    # the gradient partition (averaged_gradients) and IPG buffers are freed in step()
    # (free_grad_in_param_list / zero_grad): nothing of the gradients survives the boundary
    s.add("other_bytes", "_global_grad_norm (fp32 scalar)", FP32)
    return s


@lru_cache(maxsize=64)
def _block_offsets(model: ModelShape) -> tuple[int, tuple[int, ...]]:
    """A block's numel and its params' offsets within it (registration order)."""
    blk = _block(model)
    return sum(n for _, n in blk), tuple(sum(n for _, n in blk[:j]) for j in range(len(blk)))


def _flat_offset(model: ModelShape, registration: bool, i: int) -> int:
    """Offset in the flat group of the i-th parameter of _registration_sizes (registration) or
    _grad_sizes (gradient-ready order); the flat group is registration order without per-param padding
    (parameter_alignment off). Arithmetic on the block structure: only extra-large params ask."""
    e = model.vocab * model.hidden
    size, rel = _block_offsets(model)
    nb, layers = len(rel), model.layers
    norms = [numel(sh) for _, sh in model.norm_params("norm")]
    norm_at = e + layers * size
    out_at = norm_at + sum(norms)  # untied output, after the final norm
    if registration:  # embedding, blocks, final norm, output
        if i == 0:
            return 0
        j = i - 1
        if j < layers * nb:
            return e + (j // nb) * size + rel[j % nb]
        j -= layers * nb
        return norm_at + sum(norms[:j]) if j < len(norms) else out_at
    head = 0 if model.tied_embeddings else 1  # output, final norm, blocks last to first, embedding
    if i < head:
        return out_at
    if i < head + len(norms):
        return norm_at + sum(norms[:i - head])
    j = i - head - len(norms)
    if j >= layers * nb:
        return 0
    return e + (layers - 1 - j // nb) * size + rel[_block_perm(model)[j % nb]]


@lru_cache(maxsize=256)
def _buckets12(model: ModelShape, bucket: int, registration: bool) -> tuple[tuple[int, int], ...]:
    """IPG buckets as (elements, offset): offset -1 for a bucket of gradients copied into the IPG
    buffer, the flat offset of the parameter for an extra-large one (_fill12)."""
    out: list[tuple[int, int]] = []
    cur = _fill12(model, _registration_sizes(model) if registration else _grad_sizes(model), 0, bucket, registration,
                  0, out)
    if cur:
        out.append((cur, -1))
    return tuple(out)


def _fill12(model: ModelShape, sizes, first: int, bucket: int, registration: bool, cur: int, out: list) -> int:
    """IPG buckets of the gradients `sizes` (the first is the first-th of the order) from a bucket
    holding `cur` elements: closed buckets appended to out as _buckets12 has them; returns the open
    bucket's elements.

    stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads: a gradient that would overflow
    the bucket flushes it first (reduce_ipg_grads; an empty bucket makes no call); a parameter with more
    than reduce_bucket_size elements is not copied into the IPG buffer but kept as
    extra_large_param_to_reduce, alone in its bucket: the next gradient (or the epilogue) flushes it.
    Stage 1 without overlap walks bit16_groups (reduce_gradients: registration order); otherwise the grad
    hooks (process_gradients) bucket in gradient-ready order."""
    for i, n in enumerate(sizes, first):
        if cur + n > bucket and cur > 0:
            out.append((cur, -1))
            cur = 0
        if n > bucket:
            out.append((n, _flat_offset(model, registration, i)))
        else:
            cur += n
    return cur


@lru_cache(maxsize=256)
def _split12(model: ModelShape, bucket: int, registration: bool):
    """_buckets12 as (copied-gradient buckets as (elements, how many), extra-large (elements, offset)):
    the first part is the same for every dp. Blocks without an extra-large parameter are counted by
    _by_blocks (an extra-large one has another offset in every block: then _buckets12 whole)."""
    head, blk, tail = _size_parts(model, registration)
    if max(blk, default=0) > bucket:
        bk = _buckets12(model, bucket, registration)
        return tuple(Counter(b for b, off in bk if off < 0).items()), tuple(x for x in bk if x[1] >= 0)
    out: list[tuple[int, int]] = []
    cur = _fill12(model, head, 0, bucket, registration, 0, out)
    counts = Counter(b for b, off in out if off < 0)

    def fill(c):
        closed: list[tuple[int, int]] = []
        c = _fill12(model, blk, 0, bucket, registration, c, closed)  # no extra-large: no offsets asked
        return c, [b for b, _ in closed]

    cur = _by_blocks(fill, cur, model.layers, counts)
    large = [x for x in out if x[1] >= 0]
    out = []
    cur = _fill12(model, tail, len(head) + len(blk) * model.layers, bucket, registration, cur, out)
    counts.update(b for b, off in out if off < 0)
    if cur:
        counts[cur] += 1
    return tuple(counts.items()), tuple(large + [x for x in out if x[1] >= 0])


def allreduce_chunks(n: int, offset: int, part: int, bucket: int) -> list[int]:
    """Elements per all-reduce for an extra-large gradient of n elements at `offset` in the flat group
    (deepspeed_backward.allreduce_calls)."""
    return [e for e, _ in deepspeed_backward.allreduce_calls(n, offset, part, bucket)]


@lru_cache(maxsize=256)
def _zero12_ipg(model: ModelShape, dp: int, bucket: int, registration: bool, precision: str) -> _Calls:
    """One round of IPG all-reduces (every gradient once): average_tensor(reduce_scatter=True,
    use_multi_rank_bucket_allreduce) -> allreduce_and_scatter: all-reduces (no reduce-scatter at stage
    1 or 2), in the model dtype."""
    w = _DTYPES[precision]
    flat = _ceil_to(model.num_params(), 2 * dp)
    normal, large = _split12(model, bucket, registration)
    ipg = _counted("all_reduce", ((w * b, k) for b, k in normal), dp)
    if large:
        chunks = [c for b, off in large for c in allreduce_chunks(b, off, flat // dp, bucket)]
        ipg = ipg.plus(_calls("all_reduce", (w * c for c in chunks), dp))
    return ipg


@lru_cache(maxsize=1024)
def _zero12_comm(model: ModelShape, dp: int, stage: int, overlap: bool, bucket: int, rounds: int,
                 precision: str) -> tuple[Comm, ...]:
    """rounds: IPG reductions per optimizer step (_zero12)."""
    if dp == 1:
        return ()
    n = model.num_params()
    w = _DTYPES[precision]
    flat = _ceil_to(n, 2 * dp)
    # stage 1 without overlap_comm walks bit16_groups (registration order), else the grad hooks
    registration = stage == 1 and not overlap
    ipg = _zero12_ipg(model, dp, bucket, registration, precision).times(rounds)
    out = CommBuilder().add_calls("dp", "all_reduce", precision, *ipg, "IPG bucket (average_tensor)")
    # step(): bf16 checks overflow (has_overflow -> all_reduce uint8 MAX; engine
    # _configure_zero_optimizer: check_grad_overflow from the bf16 section, False for fp32); grad norm
    # (fp32 SUM)
    if precision == "bf16":
        out.add_calls("dp", "all_reduce", "uint8", *_calls("all_reduce", [1], dp), "overflow check")
    out.add_calls("dp", "all_reduce", "fp32", *_calls("all_reduce", [FP32], dp), "grad norm")
    # utils.all_gather_dp_groups -> all_gather_into_tensor_dp_groups: one call per param group
    out.add_calls("dp", "all_gather", precision, *_calls("all_gather", [w * flat], dp), f"updated {precision} partitions")
    return tuple(out.build())


# -- ZeRO-3 --------------------------------------------------------------------------------------

class _Z3Shape(NamedTuple):
    """What ZeRO-3 derives from the model for one dp and persistence threshold (elements)."""
    part: int  # ds_tensor elements per rank (sum of padded sizes / dp)
    total: int  # sum of padded sizes
    # persistent params as kept gathered: each param.data a view of its own all-gather's buffer
    # (partition_parameters.py _all_gather_sequential: ceil(n/dp)*dp elements), so padded to dp
    persist_gathered: int
    persist: _Calls  # _post_step: one all-gather per persistent param (model dtype)
    ipg: _Calls  # one backward's IPG reduce-scatters


@lru_cache(maxsize=256)
def _z3_shape(model: ModelShape, dp: int, threshold: int, bucket: int, w: int) -> _Z3Shape:
    """w: bytes per element of the model dtype (params gathered, gradients reduce-scattered in it)."""
    # partition_parameters.py _aligned_size: each param padded to a multiple of dp; ds_persist when
    # ds_numel <= param_persistence_threshold (Init._convert_to_deepspeed_param; the model-wide
    # stage3_model_persistence_threshold is left at its default, sys.maxsize)
    head, blk, tail = _size_parts(model, True)  # every Parameter once: few distinct sizes
    counts = Counter(head + tail)
    for n, k in Counter(blk).items():
        counts[n] += k * model.layers
    pad = {n: _ceil_to(n, dp) for n in counts}.__getitem__
    persist = [(n, k) for n, k in counts.items() if n <= threshold]
    total = sum(pad(n) * k for n, k in counts.items())
    return _Z3Shape(
        part=total // dp, total=total, persist_gathered=sum(pad(n) * k for n, k in persist),
        persist=_counted("all_gather", ((w * pad(n), k) for n, k in persist), dp),
        # stage3.py __avg_scatter_grads -> reduce_scatter_coalesced: one reduce-scatter per IPG bucket
        # (each gradient padded to dp; the bucket fills by ds_numel, unpadded). A parameter above
        # reduce_bucket_size is not copied into the IPG buffer (__add_grad_to_ipg_bucket) but is
        # bucketed alike: alone, one reduce-scatter of it (deepspeed_backward.z3_flushes)
        ipg=_counted("reduce_scatter", ((w * b, k) for b, k in Counter(
            f.flat for f in deepspeed_backward.z3_flushes(dp, bucket, backward_order(model))).items()), dp),
    )


def _zero3(model: ModelShape, lay: Layout, fw) -> RankState:
    dp, m, prec = lay.dp, lay.num_microbatches, fw.precision
    s = _zero3_memory(model, dp, fw.stage3_param_persistence_threshold, fw.reduce_bucket_size, prec).state()
    key = (model, dp, m, fw.stage3_param_persistence_threshold, fw.reduce_bucket_size,
           int(fw.stage3_prefetch_bucket_size), int(fw.stage3_max_live_parameters), int(fw.stage3_max_reuse_distance),
           prec)
    # steady and first-step collectives on first read; a warm-up step (step 1) only with one micro-batch
    s.comm_fn = lambda: _fresh(_zero3_steady(*key))
    s.comm_first = lambda: _fresh(_zero3_comm(*key)[1])
    s.comm_warmup = (lambda: [_fresh(_zero3_warmup(*key))]) if m == 1 else None  # built on first read
    w = _DTYPES[prec]
    z = _z3_shape(model, dp, fw.stage3_param_persistence_threshold, fw.reduce_bucket_size, w)
    budgets = (model, m, fw.stage3_param_persistence_threshold, int(fw.stage3_prefetch_bucket_size),
               int(fw.stage3_max_live_parameters), int(fw.stage3_max_reuse_distance), dp, w)
    s.peak = lambda: deepspeed_peak.peak(
        model, lay.micro_batch_size, m, 3, w, False, part=z.part, params_resident=s.params_bytes,
        optim=s.optim_bytes, grads_resident=s.grads_bytes, persist=w * z.persist_gathered,
        n=model.num_params(), bucket=int(fw.reduce_bucket_size),
        z3_moments=z3_moments(*budgets), z3_first=z3_first_moments(*budgets),
        z3_flushes=_z3_flush_moments(model, budgets, int(fw.reduce_bucket_size)))
    return s


def _z3_flush_moments(model: ModelShape, budgets: tuple, bucket: int) -> tuple:
    """ZeRO-3's IPG reductions in a backward, with the coordinator's gathered params at each (at its hook's
    module; the epilogue's, "", at the embedding's fetch, the backward's last), per micro-batch of a steady
    step and of step 0."""
    threshold, dp = budgets[2], budgets[6]
    flushes = deepspeed_backward.z3_flushes(dp, bucket, backward_order(model))
    mods = tuple(backward_module(model, threshold, f.name or "tok_embeddings.weight") for f in flushes)
    return flushes, z3_backward_moments(*budgets, False, mods), z3_backward_moments(*budgets, True, mods)


@lru_cache(maxsize=256)
def _zero3_memory(model: ModelShape, dp: int, threshold: int, bucket: int, precision: str) -> "_Memory":
    w = _DTYPES[precision]
    z = _z3_shape(model, dp, threshold, bucket, w)
    s = _Memory()  # pipeline stage 0
    # stage3.py _create_fp16_partitions_with_defragmentation: the ds_tensors of one sub-group live in
    # fp16_partitioned_groups_flat, in the model dtype (sub_group_size 1e9 >> tiny models: one group)
    s.add("params_bytes", f"{precision} partitions (ds_tensor, fp16_partitioned_groups_flat)", w * z.part)
    # ds_persist params stay gathered after _post_step (full tensors); whatever else the coordinator
    # gathered was released by step()'s _partition_all_parameters (release_and_reset_all)
    s.add("params_bytes", "persistent params (full, each in its dp-padded all-gather buffer)", w * z.persist_gathered)
    # grad_partitions_flat_buffer (gradient_accumulation_dtype = model dtype) and the IPG bucket of
    # reduce_bucket_size elements, allocated at init and kept (IPGBucketZ3), also when a parameter is
    # larger than the bucket; micro-batches accumulate into the same partitions (partition_grads:
    # copy_ at micro_step_id 0, add_ after)
    s.add("grads_bytes", "grad partitions (grad_partitions_flat_buffer)", w * z.part)
    s.add("grads_bytes", "IPG bucket (reduce_bucket_size)", w * bucket)
    # _create_fp32_partitions: an fp32 copy (.to(self.device, fp32).clone()), fp32 models too: its
    # no-copy branch needs `fp16_partitioned_groups_flat[i].device == self.device`, a torch.device
    # against the accelerator's device name (a str: 'cpu', 'cuda:0'), which is never equal
    s.add("optim_bytes", "fp32 partition (fp32_partitioned_groups_flat)", FP32 * z.part)
    s.add("optim_bytes", "adam exp_avg + exp_avg_sq", 2 * FP32 * z.part)
    s.add("optim_bytes", "adam step", FP32)
    s.add("other_bytes", "_global_grad_norm (fp64 scalar)", FP64)
    s.add("other_bytes", "inf_or_nan_tracker (bool)", 1)
    return s


def _gathers(calls: Counter, dp: int, w: int) -> _Calls:
    """all_gather_coalesced: one all-gather per call of the params' padded partitions (w bytes/element)."""
    return _counted("all_gather", ((w * sum([_ceil_to(n, dp) for n in key]), k) for key, k in calls.items()), dp)


_COMPLETING_WHAT = "trace checks (reset_step completing the trace)"


def _steady_fetches(model: ModelShape, dp: int, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
                    precision: str) -> CommBuilder:
    """A new builder holding the coordinator's all-gathers of a steady step (_z3_steady), which step 1
    (one micro-batch) makes too."""
    calls = _z3_steady(model, m, threshold, prefetch, max_live, reuse)
    return CommBuilder().add_calls("dp", "all_gather", precision, *_gathers(calls, dp, _DTYPES[precision]),
                                   "coordinator fetch + prefetch (fetch_sub_module), every micro-batch")


def _zero3_common(out: CommBuilder, model: ModelShape, dp: int, m: int, threshold: int, bucket: int,
                  precision: str) -> CommBuilder:
    """What every optimizer step adds besides the parameter fetches."""
    ipg, norm, persist = _zero3_fixed(model, dp, threshold, bucket, precision)
    # stage3.py reduce_partition_and_remove_grads -> __reduce_and_partition_ipg_grads in every
    # backward's hooks, the rest flushed by independent_gradient_partition_epilogue: every
    # micro-batch reduce-scatters all gradients (__avg_scatter_grads), partitions accumulate
    out.add_calls("dp", "reduce_scatter", precision, *ipg.times(m), "IPG bucket (__avg_scatter_grads)")
    out.add_calls("dp", "all_reduce", "fp64", *norm, "grad norm")
    out.add_calls("dp", "all_gather", precision, *persist, "persistent params (_post_step)")
    return out


@lru_cache(maxsize=256)
def _zero3_fixed(model: ModelShape, dp: int, threshold: int, bucket: int,
                 precision: str) -> tuple[_Calls, _Calls, _Calls]:
    """_zero3_common's calls whatever the micro-batches: one backward's IPG reduce-scatters; at the
    boundary get_grad_norm_direct's fp64 norm all-reduce (only fp16 has an overflow all-reduce at stage
    3) and _post_step's persistent_parameters[0].all_gather(persistent_parameters)."""
    z = _z3_shape(model, dp, threshold, bucket, _DTYPES[precision])
    return z.ipg, _calls("all_reduce", [FP64], dp), z.persist


@lru_cache(maxsize=1024)
def _zero3_steady(model: ModelShape, dp: int, m: int, threshold: int, bucket: int, prefetch: int, max_live: int,
                  reuse: int, precision: str) -> tuple[Comm, ...]:
    """_zero3_comm's steady step alone (a search reads no other)."""
    if dp == 1:
        return ()
    out = _steady_fetches(model, dp, m, threshold, prefetch, max_live, reuse, precision)
    return tuple(_zero3_common(out, model, dp, m, threshold, bucket, precision).build())


@lru_cache(maxsize=1024)
def _zero3_comm(model: ModelShape, dp: int, m: int, threshold: int, bucket: int, prefetch: int, max_live: int,
                reuse: int, precision: str):
    """(steady, step 0, step 1 or None) collectives of one rank.

    The coordinator's trace (partitioned_param_coordinator.py): reset_step runs at the start of every
    forward (parameter_offload.py _start_of_forward_hook), i.e. every micro-batch. The first one finds
    the trace INVALID: assert_ints_same_as_other_ranks on the empty module list (a length broadcast and
    an empty list broadcast), then RECORD. The recording forward + backward fetch each module's params
    (fetch_sub_module, no prefetch) and release all of them after its forward and after its backward
    (release_sub_module, trace not complete: persistent params too). The next reset_step checks the
    recorded module list, the parameter list and their step ids (three length + list broadcasts) and
    marks the trace COMPLETE; from then on _Z3Sim replays the coordinator (fetch, prefetch, release)
    for the prefetch bucket, live-parameter and reuse-distance budgets. step() releases everything
    (_partition_all_parameters) and _post_step gathers the persistent params again."""
    if dp == 1:
        return (), (), (None if m > 1 else ())
    w = _DTYPES[precision]
    t = precision  # the dtype of the param all-gathers and gradient reduce-scatters
    record, rest0, _ = _z3_fetches(model, m, threshold, prefetch, max_live, reuse)

    def common(out: CommBuilder) -> CommBuilder:
        return _zero3_common(out, model, dp, m, threshold, bucket, precision)

    steady = _zero3_steady(model, dp, m, threshold, bucket, prefetch, max_live, reuse, precision)

    # step 0, micro-batch 0: the empty-trace check, then the recording pass (forward + backward)
    first = CommBuilder().add_calls("dp", "all_gather", t, *_gathers(record, dp, w), "untraced per-module fetch, forward + backward")
    first.add_calls("dp", "broadcast", "int64", *_calls("broadcast", [INT64, 0], dp), "trace checks (empty trace, INVALID -> RECORD)")
    if m == 1:
        return steady, tuple(common(first).build()), _zero3_warmup(model, dp, m, threshold, bucket, prefetch, max_live,
                                                                   reuse, precision)
    # micro-batch 1 completes the trace and starts with nothing gathered; later ones follow on
    first.add_calls("dp", "broadcast", "int64", *_trace_checks(model, threshold, dp), _COMPLETING_WHAT)
    first.add_calls("dp", "all_gather", t, *_gathers(rest0, dp, w), "coordinator fetch + prefetch, first complete passes")
    return steady, tuple(common(first).build()), None


@lru_cache(maxsize=1024)
def _zero3_warmup(model: ModelShape, dp: int, m: int, threshold: int, bucket: int, prefetch: int, max_live: int,
                  reuse: int, precision: str) -> tuple[Comm, ...]:
    """_zero3_comm's step 1 (one micro-batch; built apart: a RankState holds it from the start): it
    starts with the trace completion, then runs as steady state."""
    if dp == 1:
        return ()
    warmup = _steady_fetches(model, dp, m, threshold, prefetch, max_live, reuse, precision)
    warmup.add_calls("dp", "broadcast", "int64", *_trace_checks(model, threshold, dp), _COMPLETING_WHAT)
    return tuple(_zero3_common(warmup, model, dp, m, threshold, bucket, precision).build())


def _trace_checks(model: ModelShape, threshold: int, dp: int) -> _Calls:
    """reset_step completing the trace: assert_ints_same_as_other_ranks (zero/utils.py: a length
    broadcast, then the list broadcast) on the module ids (every fetch, forward and backward), the
    param ids (record_parameters: each fetched module's params) and their step ids."""
    tr = _z3_trace(model, threshold)
    n_mod, n_par = tr.steps, len(tr.qp)
    return _calls("broadcast", [INT64, INT64 * n_mod, INT64, INT64 * n_par, INT64, INT64 * n_par], dp)
