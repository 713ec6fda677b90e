"""A pipeline schedule simulated stage by stage: each stage runs its forwards and backwards in the
order its schedule gives them, each as soon as the stage is free and its input has arrived (the
previous virtual stage's output plus the p2p transfer; a backward's, the next virtual stage's input
grad). The bubble is what the simulation leaves idle, not a formula: for uniform stages, no p2p time
and one chunk per stage it comes out as the textbook (p - 1) / (m + p - 1) of the step, and it grows
where the stages are uneven.

Orders (pipeline_parallel/schedules.py of megatron-core 0.18.0, which torchtitan's 1F1B and
Interleaved1F1B follow too): no pipelining runs F, B per micro-batch; 1F1B runs pp - stage - 1 warm-up
forwards, then one forward and one backward each, then the cool-down backwards; the interleaved
schedule runs (pp - stage - 1) * 2 + (vp - 1) * pp warm-up forwards, forward k on chunk (k // pp) % vp
and backward k on chunk vp - 1 - (k // pp) % vp, micro-batch (k // (pp vp)) pp + k % pp
(get_microbatch_id_in_model_chunk); torch's ScheduleInterleaved1F1B runs the same order where m is a
multiple of pp. torch's other schedules (torch/distributed/pipelining/schedules.py): GPipe runs every
forward, then every backward, both in micro-batch order (ScheduleGPipe._step_microbatches); LoopedBFS
runs its stages' forwards stage by stage, every micro-batch of one before the next, then their
backwards from the last stage back, micro-batches in reverse (ScheduleLoopedBFS.
_calculate_single_rank_operations). A zero-bubble order (torch's ScheduleInterleavedZeroBubble, a
framework's own order function) splits a backward into its input-grad half I, which the previous virtual
stage waits for, and its weight-grad half W, which waits for its own I only and fills the bubble: given a
weight_s, an order's tasks may be I and W where others are whole backwards B. On the first virtual stage
torch's I computes nothing (no input needs a grad: stage.py backward_one_chunk) and its W the whole backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache


def virtual_stage(pp: int, s: int, c: int, style: str = "loop") -> int:
    """The virtual stage that chunk c of stage s runs: c pp + s in a loop (Megatron's and torch's interleaved and
    looped schedules); in a V (torch's ZBVZeroBubble and DualPipeV, two chunks a stage:
    generate_stage_to_rank_mapping style "v") s, then 2 pp - 1 - s."""
    if style == "v":
        return s if c == 0 else 2 * pp - 1 - s
    return c * pp + s


def stage_of(pp: int, v: int, style: str = "loop") -> int:
    """The stage that runs virtual stage v (virtual_stage's inverse)."""
    if style == "v":
        return v if v < pp else 2 * pp - 1 - v
    return v % pp


# a task's kind in an order: a forward, a whole backward, a backward's input-grad and weight-grad halves
# (False and True: the orders without a split are (is backward, micro-batch, chunk))
F, B, I, W = False, True, 2, 3
KIND_NAMES = {F: "F", B: "B", I: "I", W: "W"}


@dataclass(frozen=True)
class Task:
    stage: int
    kind: str  # F | B | I | W
    micro_batch: int
    chunk: int


@dataclass
class Simulation:
    pp: int
    vp: int
    micro_batches: int
    # (task, start, end) per stage, in the order the stage ran them
    lanes: list[list[tuple[Task, float, float]]] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return max(end for lane in self.lanes for _, _, end in lane)

    def busy_s(self, stage: int) -> float:
        return sum(end - start for _, start, end in self.lanes[stage])

    def bubble_s(self, stage: int) -> float:
        """The stage's idle time within the step."""
        return self.step_s - self.busy_s(stage)

    def bubble_fraction(self, stage: int) -> float:
        return self.bubble_s(stage) / self.step_s


# the orders simulated: 1f1b and interleaved (Megatron's, torch's 1F1B and Interleaved1F1B), gpipe,
# looped_bfs (module docstring)
ORDERS = ("1f1b", "interleaved", "gpipe", "looped_bfs")


def order(pp: int, vp: int, stage: int, m: int, schedule: str = "1f1b") -> list[Task]:
    """The stage's tasks in the order its schedule runs them (module docstring)."""
    return [Task(stage, KIND_NAMES[kind], mb, c) for kind, mb, c in _order(pp, vp, stage, m, schedule)]


def _order(pp: int, vp: int, stage: int, m: int, schedule="1f1b") -> list[tuple]:
    """order() as (kind, micro-batch, chunk) tuples, kind F / B (is backward) or, in a zero-bubble order,
    I / W. schedule: a name of ORDERS, or a framework's own order function (pp, vp, stage, m) -> those
    tuples (TimePolicy.pipeline_order)."""
    if callable(schedule):
        return list(schedule(pp, vp, stage, m))
    total = m * vp
    if schedule == "gpipe" and pp > 1:
        return [(False, mb, c) for mb in range(m) for c in range(vp)] + [(True, mb, c) for mb in range(m) for c in range(vp)]
    if schedule == "looped_bfs" and pp > 1:
        return ([(False, mb, c) for c in range(vp) for mb in range(m)]
                + [(True, mb, c) for c in reversed(range(vp)) for mb in reversed(range(m))])
    if pp == 1:
        out = []
        for mb in range(m):
            out += [(False, mb, c) for c in range(vp)]
            out += [(True, mb, c) for c in reversed(range(vp))]
        return out
    w = min(pp - stage - 1 if vp == 1 else (pp - stage - 1) * 2 + (vp - 1) * pp, total)
    group = pp * vp
    fwd = [(False, (k // group) * pp + k % pp, (k // pp) % vp) for k in range(total)]
    bwd = [(True, (k // group) * pp + k % pp, vp - 1 - (k // pp) % vp) for k in range(total)]
    out = fwd[:w]
    for j in range(total - w):
        out.append(fwd[w + j])
        out.append(bwd[j])
    return out + bwd[total - w:]


def simulate(pp: int, vp: int, m: int, forward_s, backward_s, p2p_s: float = 0.0, schedule: str = "1f1b",
             weight_s=None, style: str = "loop", weight_extra_s=None) -> Simulation:
    """forward_s(stage, chunk) / backward_s(stage, chunk): one micro-batch's time on that virtual stage;
    p2p_s: one transfer between stages (none inside a stage). Each stage takes its next task when its
    input is there: a forward the previous virtual stage's output (v - 1; chunk c on stage s is virtual
    stage virtual_stage(pp, s, c, style)) plus the hop, a backward (or its input-grad half I) its own forward and the next
    virtual stage's input grad plus the hop, a weight-grad half W its own I. schedule: one of ORDERS or
    an order function; weight_s(stage, chunk): the W half of backward_s, where the order splits them;
    weight_extra_s(stage, chunk): what a W runs beyond that half (a checkpointed block's recomputes, one a param
    group: the framework's time policy); style: how the chunks place as virtual stages (virtual_stage)."""
    sim = Simulation(pp, vp, m, [[] for _ in range(pp)])
    _run(pp, vp, m, forward_s, backward_s, p2p_s, sim.lanes, schedule, weight_s, style, weight_extra_s)
    return sim


def _durations(pp: int, vp: int, forward_s, backward_s, weight_s, style: str = "loop", weight_extra_s=None) -> dict:
    """Each task kind's time on each virtual stage, (kind, v) -> seconds: I and W split a backward where
    weight_s is given (module docstring: on virtual stage 0 I is nothing and W the whole backward), a W with
    weight_extra_s's work beyond its half (virtual stage 0's whole backward without)."""
    dur = {}
    for s in range(pp):
        for c in range(vp):
            v = virtual_stage(pp, s, c, style)
            dur[(F, v)] = forward_s(s, c)
            dur[(B, v)] = b = backward_s(s, c)
            if weight_s is not None:
                w = weight_s(s, c) if v else b
                dur[(I, v)], dur[(W, v)] = b - w, w + (weight_extra_s(s, c) if weight_extra_s is not None and v else 0.0)
    return dur


def _run(pp: int, vp: int, m: int, forward_s, backward_s, p2p_s: float, lanes, schedule: str = "1f1b",
         weight_s=None, style: str = "loop", weight_extra_s=None) -> float:
    """The simulation's loop: the step's end; each task (Task, start, end) appended to lanes[stage]
    where lanes is given. A task's end is keyed by (kind, micro-batch, virtual stage), an I's as a B's
    (the input grad the previous virtual stage waits for)."""
    orders = [[(kind, mb, virtual_stage(pp, s, c, style), c) for kind, mb, c in _order(pp, vp, s, m, schedule)]
              for s in range(pp)]
    dur = _durations(pp, vp, forward_s, backward_s, weight_s, style, weight_extra_s)
    done: dict[tuple, float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(o) for o in orders)
    last_v = pp * vp - 1
    end = 0.0
    while remaining:
        progressed = False
        for s in range(pp):
            o = orders[s]
            n = len(o)
            while pos[s] < n:
                kind, mb, v, chunk = o[pos[s]]
                if not kind:
                    if v == 0:
                        ready = 0.0
                    else:
                        ready = done.get((F, mb, v - 1))
                        if ready is None:
                            break
                        if stage_of(pp, v - 1, style) != s:
                            ready += p2p_s
                elif kind == W:
                    ready = done.get((B, mb, v))  # its own I
                    if ready is None:
                        break
                else:
                    ready = done.get((F, mb, v))
                    if ready is None:
                        break
                    if v != last_v:
                        nxt = done.get((B, mb, v + 1))
                        if nxt is None:
                            break
                        nxt += p2p_s if stage_of(pp, v + 1, style) != s else 0.0
                        if nxt > ready:
                            ready = nxt
                start = free[s] if free[s] > ready else ready
                end = start + dur[(kind, v)]
                done[(B if kind == I else kind, mb, v)] = end
                free[s] = end
                if lanes is not None:
                    lanes[s].append((Task(s, KIND_NAMES[kind], mb, chunk), start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (an order whose inputs never arrive)")
    return max(free)


@lru_cache(maxsize=256)
def _flat_orders(pp: int, vp: int, m: int, schedule: str = "1f1b", style: str = "loop"
                 ) -> tuple[tuple[tuple[bool, int, int], ...], ...]:
    """Each stage's _order as (kind, slot, virtual stage) with slot = v m + micro-batch: an index
    into _run_fast's end-time arrays (a planner meets the same pp, vp, m in many layouts)."""
    vs = [[virtual_stage(pp, s, c, style) for c in range(vp)] for s in range(pp)]
    return tuple(tuple((kind, vs[s][c] * m + mb, vs[s][c]) for kind, mb, c in _order(pp, vp, s, m, schedule))
                 for s in range(pp))


def _run_fast(pp: int, vp: int, m: int, forward_s, backward_s, p2p_s: float, schedule: str = "1f1b",
              weight_s=None, style: str = "loop", weight_extra_s=None) -> float:
    """_run's step end (the readable reference, which simulate() keeps) over flat arrays: a task's end
    time in fwd_end / bwd_end[slot] (-1.0 until it ran; an I's in bwd_end, a W's nowhere: nothing waits
    for it), the hops per virtual stage worked out once, the stages' orders cached (_flat_orders). The
    same loop and the same float operations in the same order, so the same result to the bit
    (tests/test_timing.py)."""
    nv = pp * vp
    dur = _durations(pp, vp, forward_s, backward_s, weight_s, style, weight_extra_s)
    f_dur = [dur[(F, v)] for v in range(nv)]
    b_dur = [dur[(B, v)] for v in range(nv)]
    i_dur = [dur[(I, v)] for v in range(nv)] if weight_s is not None else b_dur
    w_dur = [dur[(W, v)] for v in range(nv)] if weight_s is not None else b_dur
    # the hop into a virtual stage's forward (from v - 1) and into its backward (from v + 1): p2p where
    # the neighbour sits on another stage
    at = [stage_of(pp, v, style) for v in range(nv)]
    f_hop = [p2p_s if v and at[v - 1] != at[v] else 0.0 for v in range(nv)]
    b_hop = [p2p_s if v < nv - 1 and at[v + 1] != at[v] else 0.0 for v in range(nv)]
    orders = _flat_orders(pp, vp, m, schedule, style)
    fwd_end = [-1.0] * (nv * m)
    bwd_end = [-1.0] * (nv * m)
    free = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(o) for o in orders)
    last_v = nv - 1
    while remaining:
        progressed = False
        for s in range(pp):
            o = orders[s]
            n = len(o)
            i = start_i = pos[s]
            t = free[s]
            while i < n:
                kind, slot, v = o[i]
                if not kind:
                    if v == 0:
                        ready = 0.0
                    else:
                        ready = fwd_end[slot - m]
                        if ready < 0.0:
                            break
                        ready += f_hop[v]
                    t = (t if t > ready else ready) + f_dur[v]
                    fwd_end[slot] = t
                elif kind == W:
                    ready = bwd_end[slot]  # its own I
                    if ready < 0.0:
                        break
                    t = (t if t > ready else ready) + w_dur[v]
                else:
                    ready = fwd_end[slot]
                    if ready < 0.0:
                        break
                    if v != last_v:
                        nxt = bwd_end[slot + m]
                        if nxt < 0.0:
                            break
                        nxt += b_hop[v]
                        if nxt > ready:
                            ready = nxt
                    t = (t if t > ready else ready) + (i_dur[v] if kind == I else b_dur[v])
                    bwd_end[slot] = t
                i += 1
            if i != start_i:
                remaining -= i - start_i
                pos[s] = i
                free[s] = t
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (an order whose inputs never arrive)")
    return max(free)


def step_seconds(pp: int, vp: int, m: int, forward_s, backward_s, p2p_s: float = 0.0, schedule: str = "1f1b",
                 weight_s=None, style: str = "loop", weight_extra_s=None) -> float:
    """simulate(...).step_s (the readable reference, kept beside it) without simulating every
    micro-batch. Past its warm-up a schedule of fixed task times is eventually periodic (a max-plus
    system): adding pp micro-batches adds the same time, or a cycle of c such increments (c = 2 or 3
    where stages differ and p2p is slow). So the steps of the pipeline at base + r + k pp micro-batches
    (r = (m - base) mod pp, k = 0..PROBE) show the cycle, and the rest is extrapolated; without a
    cycle in the probes it simulates all of m. tests/test_timing.py checks the two agree. GPipe's and
    LoopedBFS's orders (all forwards before the backwards) have no such steady state, and a framework's
    own order function is not known to have one: simulated whole (weight_s: its split backwards'; style: a V's
    placement, virtual_stage)."""
    if pp == 1:  # no pipelining: every micro-batch's forward and backward back to back
        return m * sum(forward_s(0, c) + backward_s(0, c) for c in range(vp))
    if schedule in ("gpipe", "looped_bfs") or callable(schedule) or style != "loop":
        return _run_fast(pp, vp, m, forward_s, backward_s, p2p_s, schedule, weight_s, style, weight_extra_s)
    base = pp * (2 * vp + 2)  # past the warm-up ((pp - 1) * 2 + (vp - 1) * pp forwards) and a group more
    if m <= base + (PROBE + 1) * pp:
        return _run_fast(pp, vp, m, forward_s, backward_s, p2p_s)
    r = (m - base) % pp
    ts = [_run_fast(pp, vp, base + r + k * pp, forward_s, backward_s, p2p_s) for k in range(PROBE + 1)]
    d = [ts[k + 1] - ts[k] for k in range(PROBE)]
    groups = (m - base - r) // pp
    for c in range(1, 4):
        tail = d[-2 * c:]
        if all(abs(tail[i] - tail[i + c]) <= 1e-9 * abs(ts[-1]) for i in range(c)):
            # the last c increments repeat: from probe PROBE on, whole cycles, then part of one
            left = groups - PROBE
            cycle = d[-c:]
            return ts[-1] + (left // c) * sum(cycle) + sum(cycle[:left % c])
    return _run_fast(pp, vp, m, forward_s, backward_s, p2p_s)


PROBE = 6  # pipelines of base + r + k pp micro-batches simulated to find the cycle
