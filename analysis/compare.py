"""Prediction versus measurement: the rows of one record, one per (job, rank, step, quantity).

The core that analysis.reconcile (tables, summaries, its CLI) and analysis.wandb_io (the table
each W&B run carries) share; it reads records and imports neither of them.
"""
from __future__ import annotations

from collections import defaultdict

import pandas as pd

import records as R

STATE_Q = ("params_bytes", "grads_bytes", "optim_bytes", "resident_bytes")
# peak_bytes and peak/<part>_bytes rows come from the peak probe where the ledger predicts a peak.
# held to |rel_err| <= 1% on steady steps (the moment of a peak depends on when
# asynchronous collectives complete and the cyclic GC runs; states and collectives stay exact)
PEAK_REL_TOL = 0.01
# race_bytes (peak_bytes rows): how much of the measured peak only a c10d worker thread's timing held
# (probes/peak.py "thread timing": peak_bytes - prompt_peak_bytes); 0 on every other row. Where a worker
# thread freed late, the peak's parts are measured at the prompt peak's moment (prompt_at_peak): the
# late storage can move the measured peak to another moment (CI, DeepSpeed ZeRO-2 with checkpointing:
# 512 B of it put a moment with a gathered bucket 512 B above the one the ledger predicts), and the
# ledger predicts the framework's order, not the thread's timing


def is_peak(quantity: str) -> bool:
    return quantity == "peak_bytes" or quantity.startswith("peak/")


def off(df: pd.DataFrame) -> pd.Series:
    """Rows that disagree: any byte for states and collectives, more than PEAK_REL_TOL for peak_bytes.
    The peak's parts (peak/<part>_bytes) are reported, not judged: the probe files a storage under one
    category for the whole step (a held gradient a later collective touches is `gathered`), so a part
    can differ by a buffer's category while the total agrees.
    A peak is judged against the range the probe measured (peak_gap): a prediction inside it agrees
    under some thread timing; where no worker thread held a storage at the peak it is one value."""
    peak = df.quantity.map(is_peak) if len(df) else pd.Series([], dtype=bool)
    total = df.quantity == "peak_bytes"
    # a collective whose sizes follow data (an MoE router's all-to-all) carries its predicted range,
    # and so does a peak that follows them (judged inside its range, each end held to PEAK_REL_TOL)
    routed = df["bound_low"].notna() if "bound_low" in df else pd.Series(False, index=df.index)
    slack = total.astype(float) * PEAK_REL_TOL
    outside = routed & ((df.measured < df.get("bound_low", 0) * (1 - slack))
                        | (df.measured > df.get("bound_high", 0) * (1 + slack)))
    return (~peak & ~routed & (df.abs_err != 0)) | outside | (total & ~routed & (peak_gap(df).abs() > PEAK_REL_TOL))


def peak_gap(df: pd.DataFrame) -> pd.Series:
    """(the nearest end of [measured - race_bytes, measured] - predicted) / predicted: 0 inside the
    range, rel_err where race_bytes is 0. The range's low end is the peak had every storage a
    collective's worker thread freed died right after the main thread's last use of it."""
    race = df["race_bytes"].fillna(0) if "race_bytes" in df else 0
    low, high = df.measured - race, df.measured
    near = df.predicted.clip(lower=low, upper=high)
    return ((near - df.predicted) / df.predicted.where(df.predicted != 0)).fillna(df.rel_err)


COLUMNS = ["job", "framework", "layout", "rank", "step", "phase", "quantity", "predicted", "measured",
           "abs_err", "rel_err", "race_bytes", "bound_low", "bound_high"]
# bound_low / bound_high: the predicted range of a collective's buffer bytes whose sizes follow data
# (Comm.buffer_range: an MoE router's all-to-all without capacity padding), or of a peak's bytes that
# follow them (Peak.bound); the row agrees when the measurement is inside it, `predicted` being the
# balanced case. Empty on every other row (exact)


def _comm_totals(comm: list[dict]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for c in comm or []:
        out[f"comm/{c['dim']}/{c['kind']}/count"] += c["count"]
        out[f"comm/{c['dim']}/{c['kind']}/buffer_bytes"] += c["buffer_bytes"]
    return out


def _comm_ranges(comm: list[dict]) -> dict[str, list[int]]:
    """buffer_bytes quantity -> [low, high] where a predicted record has a buffer_range (the exact
    records of the same quantity count at their bytes on both ends)."""
    ranged = {f"comm/{c['dim']}/{c['kind']}/buffer_bytes" for c in comm or [] if c.get("buffer_range")}
    out: dict[str, list[int]] = {q: [0, 0] for q in ranged}
    for c in comm or []:
        q = f"comm/{c['dim']}/{c['kind']}/buffer_bytes"
        if q in out:
            lo, hi = c.get("buffer_range") or (c["buffer_bytes"], c["buffer_bytes"])
            out[q][0] += lo
            out[q][1] += hi
    return out


def _predicted_comm(p: dict, step: int) -> list[dict]:
    """The rank's predicted collectives for a step: comm_first at step 0 (when it differs),
    comm_warmup[step - 1] for the further warm-up steps, comm (steady state) after."""
    warmup = p.get("comm_warmup") or []
    if step == 0:
        return p["comm_first"] if "comm_first" in p else p["comm"]
    if step <= len(warmup):
        return warmup[step - 1]
    return p["comm"]


def measured_peak_parts(peak: dict) -> dict[str, int]:
    """The probe's bytes by category at the peak (probes/peak.py), as the ledger's Peak parts: at the
    prompt peak where a worker thread freed late (race_bytes above), else at the measured one."""
    at = peak.get("prompt_at_peak") or peak.get("at_peak") or {}
    out = {"resident": sum(at.get(g, 0) for g in ("params", "grads", "optim", "other"))}
    for c in ("activations", "gathered", "temporary", "unnamed"):
        out[c] = at.get(c, 0)
    return out


def measured_peak_where(peak: dict) -> dict:
    """Where the probe's peak is (phase, micro_batch, module, op, event), in the framework's own order:
    the prompt peak's moment where a worker thread freed late (its late free can move the measured
    maximum to another moment), else the measured one's."""
    return peak.get("prompt_where") or peak["where"]


def _peak_rows(p: dict, st: dict) -> list[dict]:
    """peak_bytes, and each part the ledger names (peak/<part>_bytes), where both sides have them."""
    pk, mk = p.get("peak"), st.get("peak")
    if not pk or not mk:
        return []
    if st["step"] == 0 and pk.get("first"):
        pk = pk["first"]
    out = [{"quantity": "peak_bytes", "predicted": pk["bytes"], "measured": mk["peak_bytes"],
            "race_bytes": mk["peak_bytes"] - mk.get("prompt_peak_bytes", mk["peak_bytes"])}]
    if pk.get("bound"):  # a peak whose bytes follow the router (Peak.bound)
        out[0]["bound_low"], out[0]["bound_high"] = pk["bound"]
    meas = measured_peak_parts(mk)
    for part in sorted(pk.get("parts") or {}):
        out.append({"quantity": f"peak/{part}_bytes", "predicted": pk["parts"][part], "measured": meas.get(part, 0)})
    return out


def rows(rec: dict) -> list[dict]:
    """Reconcile rows of one record (empty when it has no measurement)."""
    pred, meas = rec.get("prediction"), rec.get("measurement")
    if not pred or not meas:
        return []
    base = {"job": R.job_name(rec), "framework": R.framework_variant(rec), "layout": R.layout_name(rec)}
    by_rank = R.predicted_ranks(pred)
    out = []
    for m in meas["ranks"]:
        p = by_rank(m["rank"])
        if not p or m.get("status") != "ok":
            continue
        warmup = p.get("comm_warmup") or []
        for st in m.get("steps", []):
            # step 0 and any further warm-up steps the prediction names are "first", not steady
            phase = "first" if st["step"] <= len(warmup) else "steady"
            r0 = {**base, "rank": m["rank"], "step": st["step"], "phase": phase}
            if "state" in st:
                for q in STATE_Q:
                    out.append({**r0, "quantity": q, "predicted": p[q], "measured": st["state"][q]})
                if p.get("host_bytes"):  # ZeRO-Offload: the part DeepSpeed places on the host
                    out.append({**r0, "quantity": "host_bytes", "predicted": p["host_bytes"],
                                "measured": st["state"].get("host_bytes", 0)})
            for r in _peak_rows(p, st):
                out.append({**r0, **r})
            if "comm" in st:
                pcomm = _predicted_comm(p, st["step"])
                pc, ranges = _comm_totals(pcomm), _comm_ranges(pcomm)
                mc = _comm_totals(st["comm"])
                for q in sorted(set(pc) | set(mc)):
                    row = {**r0, "quantity": q, "predicted": pc.get(q, 0), "measured": mc.get(q, 0)}
                    if q in ranges:
                        row["bound_low"], row["bound_high"] = ranges[q]
                    out.append(row)
    for r in out:
        r.setdefault("race_bytes", 0)
        r["abs_err"] = r["measured"] - r["predicted"]
        r["rel_err"] = r["abs_err"] / r["predicted"] if r["predicted"] else (0.0 if r["abs_err"] == 0 else float("inf"))
    return out


def table(path_or_records) -> pd.DataFrame:
    recs = R.load(path_or_records) if isinstance(path_or_records, str) else path_or_records
    data = [r for rec in recs for r in rows(rec)]
    return pd.DataFrame(data, columns=COLUMNS)
