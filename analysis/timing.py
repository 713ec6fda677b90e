"""Step time, predicted against measured: one row per job and steady step, the prediction's step_s
(prediction.json step_time, for the target it names) beside the slowest rank's measured step
(probes/session.py time_s: the step's wall clock on each rank), with rel_err. Reported, not judged:
a CPU's step time is noisy and the probes' own work inflates it on the steps they record (measure with
probe.peak=false and probe.comm_steps=[0], as benchmarks/time_cpu.py does)."""
from __future__ import annotations

import statistics

import records as R


def rows(rec: dict, skip_steps: int = 1) -> list[dict]:
    st = ((rec.get("prediction") or {}).get("step_time") or {})
    pred = st.get("step_s")
    ranks = ((rec.get("measurement") or {}).get("ranks")) or []
    if pred is None or not ranks:
        return []
    by_step: dict[int, float] = {}
    for r in ranks:
        for s in r.get("steps") or []:
            if s.get("time_s") is not None and s.get("step", 0) >= skip_steps:
                by_step[s["step"]] = max(by_step.get(s["step"], 0.0), s["time_s"])
    return [{"job": R.job_name(rec), "layout": R.layout_name(rec), "framework": R.framework_variant(rec), "step": k,
             "quantity": "time/step_s", "predicted": pred, "measured": v, "rel_err": (pred - v) / v,
             "target": st.get("target")} for k, v in sorted(by_step.items())]


def job_summary(rec: dict, skip_steps: int = 1) -> dict | None:
    """The job's median measured step over its steady steps against the prediction."""
    rs = rows(rec, skip_steps)
    if not rs:
        return None
    meas = statistics.median(r["measured"] for r in rs)
    pred = rs[0]["predicted"]
    return {"job": rs[0]["job"], "framework": rs[0]["framework"], "layout": rs[0]["layout"], "predicted_s": pred,
            "measured_s": meas, "rel_err": (pred - meas) / meas, "steps": len(rs)}
