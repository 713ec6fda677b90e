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

ZeRO-3's parameter fetches are a replay of the coordinator (coordinator.py) over the module hook order of
launchers.llama.Llama (trace.py): any stage3_prefetch_bucket_size / stage3_max_live_parameters /
stage3_max_reuse_distance, DeepSpeed's defaults included.

The peak within a step (RankState.peak) is ledger/faithful/deepspeed/peak.py's: the
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
block start repeats (zero12._by_blocks), and the replay skips whole blocks once its state repeats
(skip.py BlockSkip._skip); both are tested against the walk over every parameter / event.
Passes are shared where provably the same: a pass's backward is the first complete pass's when their
states agree where it starts, and with one micro-batch step 1's pass is the gradient-accumulation
coordinator's pass from the same start when every cached release it read is what a fresh coordinator
would compute (coordinator._Z3Sim.as_first); both are tested against the event replay too. A search
reads the steady step only (coordinator.z3_steady): no recording pass is replayed, its end (where step
0's micro-batch 1 starts) is known in closed form (coordinator._z3_after_record, tested against the
replay). Without prefetch and reuse distance no coordinator is replayed at all: every fetch gathers
the module's non-persistent params (coordinator._z3_fetch_on_use, tested against the replay).

The modules: place() is here; ZeRO-1/2's states, buckets and collectives are zero12.py's, ZeRO-3's
zero3.py's, what both derive from the model common.py's; the gradient hooks in a backward
backward.py's; ZeRO-3's hook trace trace.py's, the coordinator replay coordinator.py's (its fast path
skip.py's), the gathered parameter memory at a moment gathered.py's; the peak peak.py's (the
activations activations.py's).
"""
from __future__ import annotations

from ledger.faithful.deepspeed import zero3, zero12
from ledger.faithful.deepspeed.common import DTYPES
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict
from ledger.placement import Placement
from ledger.faithful.deepspeed.target import rules_of


def place(model: ModelShape, lay: Layout, fw, target: str | None = None, ipg_reduce_dtype: str | None = None,
          reduce_precision: str | None = None, sp: int = 1) -> Placement:
    """The Placement of a dense model; target: the run its peak is for (ledger/target.py; None: cpu-gloo);
    where not the model's: ZeRO-1/2's IPG all-reduce dtype (ipg_reduce_dtype), ZeRO-3's IPG bucket and
    reduce-scatter dtype (reduce_precision); sp: DeepSpeed-Ulysses' degree, model the rank's slice of the
    sequence (ulysses.py)."""
    if lay.cp > 1:  # DeepSpeed-Ulysses: the flat layout's ZeRO at dp x cp on s / cp tokens (ulysses.py)
        from ledger.faithful.deepspeed import ulysses

        return ulysses.place(model, lay, fw, target, place)
    rules = rules_of(target)
    if fw.precision not in DTYPES:
        raise ConfigError(f"framework.precision={fw.precision!r}: the faithful DeepSpeed ledger models bf16 and fp32")
    if not fw.contiguous_gradients:
        raise ConfigError("framework.contiguous_gradients=false: DeepSpeed then reduces through "
                          "buffered_reduce_fallback (stage 1/2) and keeps no IPG buffer (stage 3), not modelled")
    z = fw.zero_stage
    if z == 3:
        s = zero3.rank_state(model, lay, fw, rules, reduce_precision, sp)
        state = lambda r: s  # noqa: E731 (every rank's the same)
    elif z in (1, 2):
        state = zero12.rank_states(model, lay, fw, rules, ipg_reduce_dtype, sp)
    else:
        raise ConfigError(f"framework.zero_stage={z}: the faithful DeepSpeed ledger models stages 1, 2 and 3 "
                          "(stage 0, DeepSpeed as plain data parallelism, only with ledger.mode=textbook)")
    pl = Placement(framework="deepspeed", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                   world=lay.world, rank_state=state, representatives=[0], target=rules.target)
    pl.notes.append(f"DeepSpeed 0.19.8 ZeRO-{z}, {fw.precision}, torch AdamW; pure DP over {lay.dp} ranks")
    return pl
