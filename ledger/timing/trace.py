"""The predicted step as a Chrome trace (the JSON Perfetto and chrome://tracing open): one track per
lane, each pipeline stage's forwards and backwards (the simulation's), then on one more lane the
critical stage's exposed data-parallel collectives and the optimizer step after the schedule."""
from __future__ import annotations

import json

from ledger.timing.step import DP_DIMS, StepTime


# a simulated task's kind (pipeline.Task) as the trace names it: a zero-bubble order's backward halves apart
_TASK_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}


def events(st: StepTime) -> list[dict]:
    sim = st.simulation
    if sim is None:
        raise ValueError("the step was predicted without its schedule's tasks (step_time(..., trace=True))")
    out = []
    for s, lane in enumerate(sim.lanes):
        out.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": s, "args": {"name": f"stage {s} compute"}})
        for task, start, end in lane:
            name = f"{_TASK_NAMES[task.kind]} mb{task.micro_batch}" + (
                f" chunk{task.chunk}" if sim.vp > 1 else "")
            out.append({"ph": "X", "name": name, "pid": 0, "tid": s, "ts": start * 1e6, "dur": (end - start) * 1e6,
                        "cat": "compute"})
    tid = len(sim.lanes)
    out.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                "args": {"name": "exposed comm, optimizer"}})
    t = sim.step_s
    for dim, sec in sorted(st.exposed_s.items()):
        if dim not in DP_DIMS or sec <= 0:
            continue  # TP / CP / EP sit inside the stage's forwards and backwards
        out.append({"ph": "X", "name": f"exposed {dim}", "pid": 0, "tid": tid, "ts": t * 1e6, "dur": sec * 1e6,
                    "cat": "communication"})
        t += sec
    out.append({"ph": "X", "name": "optimizer step", "pid": 0, "tid": tid, "ts": t * 1e6, "dur": st.optimizer_s * 1e6,
                "cat": "compute"})
    return out


def write(st: StepTime, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": events(st), "displayTimeUnit": "ms",
                   "otherData": {"target": st.target, "step_s": st.step_s}}, f)
