"""Step time, predicted against measured: per job and steady step, the prediction's step_s
(prediction.json step_time, for the target it names) beside the slowest rank's measured step
(probes/session.py time_s: the step's wall clock on each rank), and the same rank's forward, backward
and optimizer times (probes/phases.py) beside the prediction's (the critical stage's forwards and
backwards with their exposed TP / CP collectives, the optimizer's update), and per dimension its
collectives' time and the part waited for (probes/comm_time.py) beside comm_s / exposed_s, with rel_err. Reported, not judged:
a CPU's step time is noisy and the probes' own work inflates it on the steps they record (measure with
probe.peak=false and probe.comm_steps=[0], as benchmarks/time_cpu.py does)."""
from __future__ import annotations

import statistics

import records as R


PHASES = ("forward_s", "backward_s", "optimizer_s")


def rows(rec: dict, skip_steps: int = 1) -> list[dict]:
    st = ((rec.get("prediction") or {}).get("step_time") or {})
    pred = st.get("step_s")
    ranks = ((rec.get("measurement") or {}).get("ranks")) or []
    if pred is None or not ranks:
        return []
    slowest: dict[int, dict] = {}  # step -> the slowest rank's step record
    for r in ranks:
        for s in r.get("steps") or []:
            if s.get("time_s") is not None and s.get("step", 0) >= skip_steps:
                if s["time_s"] > slowest.get(s["step"], {}).get("time_s", -1.0):
                    slowest[s["step"]] = s
    base = {"job": R.job_name(rec), "layout": R.layout_name(rec), "framework": R.framework_variant(rec),
            "target": st.get("target")}
    out = []
    for k, s in sorted(slowest.items()):
        measured = [("time/step_s", pred, s["time_s"])]
        measured += [(f"time/{q}", st.get(q), (s.get("phases") or {}).get(q)) for q in PHASES]
        out += [{**base, "step": k, "quantity": q, "predicted": p, "measured": m,
                 "rel_err": (p - m) / m if m else None}
                for q, p, m in measured if p is not None and m is not None]
        out += _comm_rows(st, s, {**base, "step": k})
    return out


def _comm_rows(st: dict, s: dict, base: dict) -> list[dict]:
    """Per dimension, the step's collectives' time (issue to completion, summed: time/comm/<dim>_s) and
    the part the rank waited for (time/exposed/<dim>_s), measured (probes/comm_time.py) beside the
    prediction's comm_s / exposed_s; `timed` says how many of the dimension's collectives the probe
    timed (an AsyncCollectiveTensor waited where the probe cannot see is not)."""
    issued: dict[str, int] = {}
    for c in s.get("comm") or []:
        issued[c["dim"]] = issued.get(c["dim"], 0) + c["count"]
    out = []
    for dim, t in sorted((s.get("comm_time") or {}).items()):
        for q, pk, mk in (("comm", "comm_s", "total_s"), ("exposed", "exposed_s", "exposed_s")):
            p, m = (st.get(pk) or {}).get(dim), t[mk]
            if p is None:
                continue
            out.append({**base, "quantity": f"time/{q}/{dim}_s", "predicted": p, "measured": m,
                        "rel_err": (p - m) / m if m else None, "timed": f"{t['count']}/{issued.get(dim, 0)}"})
    return out


def job_summary(rec: dict, skip_steps: int = 1, comm_steps: tuple = ()) -> dict | None:
    """The job's median measured step over its steady steps against the prediction, and the median of
    each phase (measured_forward_s, ...) where the probes recorded them. comm_steps: the steps the comm
    probe recorded (its dispatch mode slows them: left out of the step and its phases); per dimension
    the median of its collectives' time and exposed part over the steps that timed them (`comm`:
    dim -> predicted / measured comm_s and exposed_s)."""
    allrows = rows(rec, skip_steps)
    steady = [r for r in allrows if r["step"] not in comm_steps]
    rs = [r for r in steady if r["quantity"] == "time/step_s"]
    if not rs:
        return None
    meas = statistics.median(r["measured"] for r in rs)
    pred = rs[0]["predicted"]
    out = {"job": rs[0]["job"], "framework": rs[0]["framework"], "layout": rs[0]["layout"], "predicted_s": pred,
           "measured_s": meas, "rel_err": (pred - meas) / meas, "steps": len(rs)}
    for q in PHASES:
        ph = [r for r in steady if r["quantity"] == f"time/{q}"]
        if ph:
            out[f"predicted_{q}"] = ph[0]["predicted"]
            out[f"measured_{q}"] = statistics.median(r["measured"] for r in ph)
    comm: dict[str, dict] = {}
    for q in ("comm", "exposed"):
        by_dim: dict[str, list] = {}
        for r in allrows:
            if r["quantity"].startswith(f"time/{q}/"):
                by_dim.setdefault(r["quantity"][len(f"time/{q}/"):-2], []).append(r)
        for dim, rr in by_dim.items():
            comm.setdefault(dim, {})[f"predicted_{q}_s"] = rr[0]["predicted"]
            comm[dim][f"measured_{q}_s"] = statistics.median(r["measured"] for r in rr)
    if comm:
        out["comm"] = comm
    return out
