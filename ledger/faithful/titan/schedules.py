"""torchtitan 0.3.0's pipeline schedules as it runs them (distributed/pipeline_parallel.py on torch 2.13
torch/distributed/pipelining/schedules.py): which stages a PP rank holds, what each schedule refuses, and
how torchtitan is told how many stages a rank holds. pp.py places the stages; rules.py refuses by these.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import NamedTuple

from ledger.checks import knob
from ledger.units import ceil_div


class Schedule(NamedTuple):
    style: str  # "single": one stage a rank; "loop": stage r + i*pp; "v": stages r and 2*pp-1-r
    # a _PipelineScheduleRuntime: FSDP's unshard / reshard are the schedule's own actions
    # (_add_unshard_reshard), REDUCE_GRAD after a stage's last backward
    runtime: bool


# schedules.py get_schedule_class's concrete schedules
SCHEDULES = {
    "1F1B": Schedule("single", False), "GPipe": Schedule("single", False),
    "Interleaved1F1B": Schedule("loop", True), "LoopedBFS": Schedule("loop", True),
    "InterleavedZeroBubble": Schedule("loop", True),
    "ZBVZeroBubble": Schedule("v", True), "DualPipeV": Schedule("v", True),
}
# schedules.py _add_unshard_reshard(max_active_stages=3): a runtime schedule keeps at most 3 of a rank's
# stages unsharded, resharding one to prefetch another; with more stages a rank re-gathers mid-step
MAX_ACTIVE_STAGES = 3


def schedule_of(fw) -> str:
    """framework.pipeline_parallel_schedule (1F1B, torchtitan's default, where a config has none)."""
    return knob(fw, "pipeline_parallel_schedule") or "1F1B"


def local_stages(pp_rank: int, pp: int, vp: int, name: str) -> tuple[int, ...]:
    """pipeline_parallel.py _get_pp_rank_to_stage_indices_mapping: the stage indices a PP rank builds."""
    if SCHEDULES[name].style == "v":
        return pp_rank, 2 * pp - 1 - pp_rank
    return tuple(pp_rank + i * pp for i in range(vp))


# The zero-bubble schedules leave the last stage's final norm weight without a gradient (measured on the CPU,
# pp2 over dp_shard 2, 4 layers, vocab 1030: AdamW keeps no state for it and no reduce-scatter carries it, where
# 1F1B's stage reduces it). The cause, read in the sources and on no device of its own: ChunkedLossWrapper
# (components/loss.py __call__) ends each loss by resharding lm_head's FSDP group, which torchtitan's fsdp.py
# builds as [norm, lm_head]; to_sharded (_fsdp_param.py) sets the sharded DTensor back on the module, so when
# the schedule's I action runs right after (the last stage runs F, I, F, I, ...), stage.py hands
# stage_backward_input (pipelining/_backward.py) self.submod.parameters() with norm.weight the sharded DTensor,
# whose AccumulateGrad node is not in the loss's graph: get_param_groups puts it in no group, so the W action
# computes no gradient for it (lm_head's comes from the loss chunks' own backward; the blocks stay unsharded
# under PP). 1F1B's full backward accumulates into the graph's own leaf.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")
# the schedules that split backwards into I and W: the zero-bubble ones, every backward; DualPipeV some (its others
# full backwards, with the overlapped forward-backward actions run one after the other: the runtime's default)
SPLIT_BACKWARD = ZERO_BUBBLE + ("DualPipeV",)


@lru_cache(maxsize=1024)
def split_backwards(name: str, pp: int, vp: int, n: int, stage: int) -> int:
    """How many of stage `stage`'s backwards a step runs split into I and W (its BACKWARD_WEIGHT actions in torch's
    order on the rank that holds it, compute_actions): every one under the zero-bubble schedules, some under
    DualPipeV (its others whole), none on the first stage (stage.py: its I computes nothing, its W the whole
    backward) nor under the other schedules."""
    if name not in SPLIT_BACKWARD or stage == 0:
        return 0
    from torch.distributed.pipelining.schedules import _ComputationType as C

    rank = next(r for r in range(pp) if stage in local_stages(r, pp, vp, name))
    return sum(a.computation_type == C.BACKWARD_WEIGHT and a.stage_index == stage
               for a in compute_actions(name, pp, vp, n, rank))


def block_param_groups(fused_qkv: bool) -> int:
    """The param groups of one block that a split backward's W runs one autograd.grad each (pipelining/_backward.py
    get_param_groups: the params sharing an intermediate node; each of a block's weights has its own consumer, so
    one group a weight): wqkv (or wq, wk, wv), wo, w1, w2, w3 and the two norms' weights."""
    return (1 if fused_qkv else 3) + 4 + 2


def final_norm_gets_grad(name: str) -> bool:
    """Whether the last stage's final norm weight gets a gradient under schedule `name` (ZERO_BUBBLE's comment)."""
    return name not in ZERO_BUBBLE


def stages_error(name: str, pp: int, vp: int) -> str | None:
    """What torchtitan (pipeline_parallel.py _get_pipeline_metadata) and torch's schedules refuse of vp
    stages a rank, and what the ledger does not model of them."""
    style = SCHEDULES[name].style
    if style == "single" and vp != 1:
        return (f"framework.pipeline_parallel_schedule={name!r} runs one stage a rank (torchtitan: \"Single stage "
                f"schedule requires exactly 1 stage per rank\"); layout.vp={vp} needs a looped schedule "
                "(Interleaved1F1B or LoopedBFS)")
    if style != "single" and vp < 2:
        return (f"framework.pipeline_parallel_schedule={name!r} runs several stages a rank (torchtitan: "
                "\"Multi-stage schedule requires at least 2 stages per rank\"): set layout.vp >= 2")
    if name == "InterleavedZeroBubble" and vp > MAX_ACTIVE_STAGES:
        return (f"framework.pipeline_parallel_schedule={name!r}: its unshards beyond {MAX_ACTIVE_STAGES} stages a rank "
                f"(its I / W order) are not modelled; layout.vp <= {MAX_ACTIVE_STAGES}")
    if style == "v" and vp != 2:
        return f"framework.pipeline_parallel_schedule={name!r} runs exactly 2 stages a rank (schedules.py), not layout.vp={vp}"
    return None


def microbatch_error(name: str, n: int, pp: int, vp: int) -> str | None:
    """The schedules' own refusals of n micro-batches (their __init__'s ValueErrors)."""
    if name == "1F1B" and n < pp:
        return f"1F1B needs at least pp={pp} micro-batches, not {n} (schedules.py Schedule1F1B)"
    if name == "DualPipeV" and n < pp * vp:
        return f"DualPipeV needs at least as many micro-batches as stages ({pp * vp}), not {n} (schedules.py)"
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            return (f"{name} needs the micro-batches ({n}) to be a multiple of its rounds max(1, n // pp) = "
                    f"{rounds} (schedules.py)")
    return None


def layers_per_stage(layers: int, pp: int, vp: int) -> int | None:
    """The pipeline_parallel_layers_per_stage torchtitan needs to build pp * vp stages
    (_get_pipeline_metadata: ceil((layers + 2) / layers_per_stage) stages, the embedding and the head counted
    as a layer each); None where its default gives them (vp = 2 for a looped schedule, 1 otherwise) or no
    integer does (stages_split_error says so)."""
    eff = layers + 2
    for lps in range(1, eff + 1):
        if ceil_div(eff, lps) == pp * vp:
            return lps
    return None


def stages_split_error(layers: int, pp: int, vp: int, name: str) -> str | None:
    """Where no pipeline_parallel_layers_per_stage gives pp * vp stages beyond torchtitan's default."""
    default_vp = 1 if SCHEDULES[name].style == "single" else 2
    if vp == default_vp or layers_per_stage(layers, pp, vp) is not None:
        return None
    return (f"layout.vp={vp}: torchtitan builds ceil((layers + 2) / pipeline_parallel_layers_per_stage) stages and no "
            f"integer gives pp*vp={pp * vp} of them at layers={layers}")


def _interleaved(pp: int, vp: int, n: int):
    """What ScheduleInterleaved1F1B._calculate_single_rank_operations reads of its schedule object."""
    from types import SimpleNamespace

    rounds = max(1, n // pp)
    return SimpleNamespace(n_local_stages=vp, pp_group_size=pp, _n_microbatches=n, number_of_rounds=rounds,
                           microbatches_per_round=n // rounds)


@lru_cache(maxsize=1024)
def interleaved_order(pp: int, vp: int, rank: int, n: int) -> tuple:
    """The (is backward, micro-batch, local chunk) a PP rank runs under Interleaved1F1B, in torch's own
    order (ScheduleInterleaved1F1B._calculate_single_rank_operations; its flexible rounds where n is no
    multiple of pp): the step-time model's pipeline order (steptime.py)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    return tuple((a.computation_type != _ComputationType.FORWARD, a.microbatch_index, a.stage_index // pp)
                 for a in rank_compute_order("Interleaved1F1B", pp, vp, n, rank) if a is not None)


def compute_actions(name: str, pp: int, vp: int, n: int, rank: int):
    """rank_compute_order's actions but the idle slots, an overlapped forward-backward (DualPipeV's OVERLAP_F_B)
    as its sub-actions in their order (the runtime's default runs them one after the other)."""
    for a in rank_compute_order(name, pp, vp, n, rank):
        if a is not None:
            yield from a.sub_actions or (a,)


@lru_cache(maxsize=1024)
def runtime_order(name: str, pp: int, vp: int, rank: int, n: int) -> tuple:
    """The (kind, micro-batch, local chunk) a PP rank runs under runtime schedule `name`, kind F, B, I or W
    (ledger/timing/pipeline.py's), in torch's own order (compute_actions: InterleavedZeroBubble's
    _get_1f1b_rank_ops with enable_zero_bubble, each backward split into its input-grad half and a weight-grad
    half that fills the bubble; the V schedules' orders), the chunk its index among the rank's stages
    (local_stages): the step-time model's order."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    from ledger.timing.pipeline import B, F, I, W

    kind = {C.FORWARD: F, C.FULL_BACKWARD: B, C.BACKWARD_INPUT: I, C.BACKWARD_WEIGHT: W}
    mine = local_stages(rank, pp, vp, name)
    return tuple((kind[a.computation_type], a.microbatch_index, mine.index(a.stage_index))
                 for a in compute_actions(name, pp, vp, n, rank))


# the step-time model's order function (pp, vp, stage, m) of each schedule that splits backwards: torch's own
RUNTIME_ORDERS = {name: partial(runtime_order, name) for name in SPLIT_BACKWARD}


def rank_compute_order(name: str, pp: int, vp: int, n: int, rank: int) -> list:
    """The compute actions a PP rank runs under a looped runtime schedule, in torch's own order
    (_calculate_single_rank_operations; None where the rank idles)."""
    from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                        ScheduleLoopedBFS)

    if name == "Interleaved1F1B":
        return ScheduleInterleaved1F1B._calculate_single_rank_operations(_interleaved(pp, vp, n), rank)
    if name == "InterleavedZeroBubble":  # (its runtime's bubbles, _add_bubbles_to_actions, are the simulation's waits)
        return ScheduleInterleavedZeroBubble._calculate_single_rank_operations(_interleaved(pp, vp, n), rank)
    if name == "LoopedBFS":
        from types import SimpleNamespace

        return ScheduleLoopedBFS._calculate_single_rank_operations(
            SimpleNamespace(_stages=[None] * vp, pp_group_size=pp, _n_microbatches=n), rank)
    if name in ("ZBVZeroBubble", "DualPipeV"):  # (what its __init__ reads: the group's size, the stages, the micro-batches)
        from types import SimpleNamespace

        from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

        cls = ScheduleZBVZeroBubble if name == "ZBVZeroBubble" else ScheduleDualPipeV
        return cls._calculate_single_rank_operations(
            SimpleNamespace(pp_group_size=pp, num_stages=pp * vp, _n_microbatches=n), rank)
    raise ValueError(f"{name}: its unshards are not modelled")


def unshard_counts(stage_order, max_active: int = MAX_ACTIVE_STAGES) -> dict[int, int]:
    """How many UNSHARDs torch's _add_unshard_reshard gives each stage of this order of compute actions
    (their stage indices), counted in one pass each way. Before each action torch holds unsharded exactly
    the next `max_active` distinct stages the rank computes from there (it reshards the others and unshards
    those missing), so a stage is unsharded each time it enters that window. torch rescans the rest of the
    schedule at every action, quadratic in the micro-batches (seconds a rank at hundreds of them, where the
    planner asks for thousands of layouts); test_titan's reference test counts torch's own output against this."""
    windows, window = [], ()
    for stage in reversed(stage_order):
        window = (stage, *[s for s in window if s != stage][:max_active - 1])
        windows.append(window)
    counts: dict[int, int] = {}
    held: tuple = ()
    for window in reversed(windows):
        for stage in window:
            if stage not in held:
                counts[stage] = counts.get(stage, 0) + 1
        held = window
    return counts


@lru_cache(maxsize=256)
def _rank_unshards(name: str, pp: int, vp: int, n: int, rank: int) -> dict[int, int]:
    return unshard_counts([a.stage_index for a in rank_compute_order(name, pp, vp, n, rank) if a is not None])


def unshards(name: str, pp: int, vp: int, n: int, stage: int) -> int:
    """How many times a runtime schedule unshards stage `stage` in a step (torch's _add_unshard_reshard over
    the rank's compute actions: at most MAX_ACTIVE_STAGES of its stages unsharded at once, the others
    resharded and gathered again when next used; each UNSHARD gathers every FSDP module of the stage,
    _PipelineScheduleRuntime._perform_action); 1 for the single-stage schedules (their first forward) and
    wherever a rank holds no more stages than fit unsharded at once (none is ever resharded before its last use)."""
    if SCHEDULES[name].style == "single" or vp <= MAX_ACTIVE_STAGES:
        return 1
    return _rank_unshards(name, pp, vp, n, stage % pp).get(stage, 0)


def _last_stage_actions(name: str, pp: int, vp: int, n: int) -> list:
    """The last stage's compute actions in its rank's order (torch's _calculate_single_rank_operations; an
    overlapped forward-backward's sub-actions in their order)."""
    last = pp * vp - 1
    rank = next(r for r in range(pp) if last in local_stages(r, pp, vp, name))
    return [a for a in compute_actions(name, pp, vp, n, rank) if a.stage_index == last]


@lru_cache(maxsize=1024)
def losses_after_a_backward(name: str, pp: int, vp: int, n: int) -> int:
    """How many of the last stage's n micro-batch losses run after one of its full backwards since the loss
    before: components/loss.py ChunkedLossWrapper reduces [norm, lm_head] at each loss's last chunk, with the
    norm's grad the backwards since accumulated (pp.py); an input-only backward (a zero-bubble I) gives the norm
    none (final_norm_gets_grad's comment). 1F1B runs F0 B0 F1 B1 ... (n - 1); GPipe and LoopedBFS run every
    forward before any backward (0); the runtime schedules' order is torch's own (_last_stage_actions)."""
    if name == "1F1B":
        return n - 1
    if name in ("GPipe", "LoopedBFS"):
        return 0
    from torch.distributed.pipelining.schedules import _ComputationType

    fresh, count = False, 0
    for a in _last_stage_actions(name, pp, vp, n):
        if a.computation_type == _ComputationType.FORWARD:
            count += fresh
            fresh = False
        elif a.computation_type == _ComputationType.FULL_BACKWARD:
            fresh = True
    return count
