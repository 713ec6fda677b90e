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
(get_microbatch_id_in_model_chunk).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Task:
    stage: int
    kind: str  # F | B
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


def order(pp: int, vp: int, stage: int, m: int) -> list[Task]:
    """The stage's tasks in the order its schedule runs them (module docstring)."""
    total = m * vp
    if pp == 1:
        out = []
        for mb in range(m):
            for c in range(vp):
                out.append(Task(stage, "F", mb, c))
            for c in reversed(range(vp)):
                out.append(Task(stage, "B", mb, c))
        return out
    if vp == 1:
        w = pp - stage - 1
    else:
        w = (pp - stage - 1) * 2 + (vp - 1) * pp
    w = min(w, total)

    def fwd(k):
        return Task(stage, "F", (k // (pp * vp)) * pp + k % pp, (k // pp) % vp if vp > 1 else 0)

    def bwd(k):
        return Task(stage, "B", (k // (pp * vp)) * pp + k % pp, vp - 1 - (k // pp) % vp if vp > 1 else 0)

    out = [fwd(k) for k in range(w)]
    for j in range(total - w):
        out += [fwd(w + j), bwd(j)]
    out += [bwd(j) for j in range(total - w, total)]
    return out


def simulate(pp: int, vp: int, m: int, forward_s, backward_s, p2p_s: float = 0.0) -> Simulation:
    """forward_s(stage, chunk) / backward_s(stage, chunk): one micro-batch's time on that virtual stage;
    p2p_s: one transfer between stages (none inside a stage)."""
    orders = [order(pp, vp, s, m) for s in range(pp)]
    done: dict[Task, float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    sim = Simulation(pp, vp, m, [[] for _ in range(pp)])
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                t = orders[s][pos[s]]
                ready = _ready(t, pp, vp, done, p2p_s)
                if ready is None:
                    break
                start = max(free[s], ready)
                end = start + (forward_s(s, t.chunk) if t.kind == "F" else backward_s(s, t.chunk))
                done[t] = end
                free[s] = end
                sim.lanes[s].append((t, start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (an order whose inputs never arrive)")
    return sim


def _ready(t: Task, pp: int, vp: int, done: dict, p2p_s: float):
    """When t's input is there: None while its producer has not run."""
    # virtual stage index: chunk c on stage s is v = c * pp + s
    v = t.chunk * pp + t.stage
    last_v = pp * vp - 1
    if t.kind == "F":
        if v == 0:
            return 0.0
        prev = Task((v - 1) % pp, "F", t.micro_batch, (v - 1) // pp)
        end = done.get(prev)
        return None if end is None else end + (p2p_s if prev.stage != t.stage else 0.0)
    own_f = done.get(Task(t.stage, "F", t.micro_batch, t.chunk))
    if own_f is None:
        return None
    if v == last_v:
        return own_f
    nxt = Task((v + 1) % pp, "B", t.micro_batch, (v + 1) // pp)
    end = done.get(nxt)
    return None if end is None else max(own_f, end + (p2p_s if nxt.stage != t.stage else 0.0))
