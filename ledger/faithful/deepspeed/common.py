"""DeepSpeed 0.19.8 ZeRO-1/2/3, faithful: what ZeRO-1/2 (zero12.py) and ZeRO-3 (zero3.py) both derive
from the model and both build their states and collectives with: the model dtype
(runtime/engine.py get_data_types), the order gradients become ready in (autograd on
launchers.llama.Llama) and each parameter's numel in it or in registration order, the IPG bucket rule
(runtime/zero/stage_1_and_2.py and stage3.py), calls summed as the probe records them, and a
RankState's states computed once per (model, dp, knobs).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ledger.dtypes import BF16, FP32
from ledger.faithful.deepspeed.trace import block_params
from ledger.model import ModelShape, numel
from ledger.placement import Comm, RankState, wire_bytes

# engine.get_data_types(): the model dtype is bf16 with a `bf16` section, fp32 without one; ZeRO keeps
# its flat params / partitions, gradients and IPG buckets and communicates in it (grad_accum_dtype and
# communication_data_type default to the model dtype)
DTYPES = {"bf16": BF16, "fp32": FP32}


# a block's modules in the order their gradients become ready (autograd on launchers.llama.Block)
_BLOCK_BACKWARD = ("feed_forward.w2", "feed_forward.w3", "feed_forward.w1", "ffn_norm", "attention.wo", "attention.wv",
                   "attention.wk", "attention.wq", "attention_norm")


@lru_cache(maxsize=64)
def block_perm(model: ModelShape) -> tuple[int, ...]:
    """Indexes into a block's params (layer_params order) in gradient-ready order."""
    mods = [mo for mo, _ in block_params(model)]
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
    perm = block_perm(model)
    for i in reversed(range(model.layers)):
        lp = model.layer_params(i)
        out += [lp[j] for j in perm]
    out.append(("tok_embeddings.weight", emb))
    return tuple(out)


@lru_cache(maxsize=64)
def size_parts(model: ModelShape, registration: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """numel of registration_sizes (registration) or grad_sizes as (before the blocks, one block,
    after the blocks): every block is the same."""
    e = model.vocab * model.hidden
    norms = [numel(sh) for _, sh in model.norm_params("norm")]
    out = [] if model.tied_embeddings else [e]
    blk = block_params(model)
    if registration:  # embedding, blocks, final norm, output
        return (e,), tuple(n for _, n in blk), tuple(norms + out)
    # output, final norm, blocks last to first (backward_order), embedding
    return tuple(out + norms), tuple(blk[j][1] for j in block_perm(model)), (e,)


@lru_cache(maxsize=64)
def grad_sizes(model: ModelShape) -> tuple[int, ...]:
    """numel of backward_order(model), built per block."""
    head, blk, tail = size_parts(model, False)
    return head + blk * model.layers + tail


@lru_cache(maxsize=64)
def registration_sizes(model: ModelShape) -> tuple[int, ...]:
    """numel of model.params() (registration order), built per block."""
    head, blk, tail = size_parts(model, True)
    return head + blk * model.layers + tail


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

class Calls(NamedTuple):
    """`count` calls of one kind: bytes handed to them and wire bytes, each call floored on its own
    (placement.wire_bytes), so a sum of calls reconciles with the probe's per-call records."""
    count: int
    nbytes: int
    wire: int

    def times(self, k: int) -> "Calls":
        return Calls(self.count * k, self.nbytes * k, self.wire * k)

    def plus(self, o: "Calls") -> "Calls":
        return Calls(self.count + o.count, self.nbytes + o.nbytes, self.wire + o.wire)


def buffer_calls(kind: str, buffers, group: int, times: int = 1) -> Calls:
    """`times` rounds of one call per buffer (bytes)."""
    return counted_calls(kind, ((b, 1) for b in buffers), group, times)


def counted_calls(kind: str, counts, group: int, times: int = 1) -> Calls:
    """buffer_calls over (buffer bytes, how many calls) pairs."""
    count = nbytes = wire = 0
    for b, k in counts:
        count += k
        nbytes += b * k
        wire += wire_bytes(kind, b, group) * k
    return Calls(count * times, nbytes * times, wire * times)



class Memory(RankState):
    """A RankState's four states and detail, computed once per (model, dp, knobs); state() copies it
    (cheaper than repeating the named adds for every layout)."""

    def state(self) -> RankState:
        return RankState(stage=self.stage, params_bytes=self.params_bytes, grads_bytes=self.grads_bytes,
                         optim_bytes=self.optim_bytes, other_bytes=self.other_bytes, host_bytes=self.host_bytes,
                         detail=dict(self.detail))


def fresh(comms) -> list[Comm]:
    """A list of its own per RankState (the cached Comm objects themselves are only read)."""
    return list(comms)
