"""Prediction versus measurement, one row per (job, rank, step, quantity).

    python -m analysis.reconcile SWEEP_OR_JOB_DIR [--format markdown|csv|json] [--all-steps]

Quantities: params_bytes grads_bytes optim_bytes resident_bytes (at the step boundary) and
comm/<dim>/<kind>/count, comm/<dim>/<kind>/buffer_bytes (per optimizer step). Step 0 is the
first (tracing / warm-up) step: it is compared with the ledger's first-step prediction and
reported as phase "first", as are further warm-up steps the prediction lists (comm_warmup);
later steps are phase "steady".
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import pandas as pd

import records as R
from analysis import wandb_io

STATE_Q = ("params_bytes", "grads_bytes", "optim_bytes", "resident_bytes")
COLUMNS = ["job", "framework", "layout", "rank", "step", "phase", "quantity", "predicted", "measured",
           "abs_err", "rel_err"]


def _comm_totals(comm: list[dict]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for c in comm or []:
        out[f"comm/{c['dim']}/{c['kind']}/count"] += c["count"]
        out[f"comm/{c['dim']}/{c['kind']}/buffer_bytes"] += c["buffer_bytes"]
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


def rows(rec: dict) -> list[dict]:
    """Reconcile rows of one record (empty when it has no measurement)."""
    pred, meas = rec.get("prediction"), rec.get("measurement")
    if not pred or not meas:
        return []
    base = {"job": R.job_name(rec), "framework": R.framework_variant(rec), "layout": R.layout_name(rec)}
    by_rank = {p["rank"]: p for p in pred["per_rank"]}
    out = []
    for m in meas["ranks"]:
        p = by_rank.get(m["rank"])
        if p is None or m.get("status") != "ok":
            continue
        warmup = p.get("comm_warmup") or []
        for st in m.get("steps", []):
            # step 0 and any further warm-up steps the prediction names are "first", not steady
            phase = "first" if st["step"] <= len(warmup) else "steady"
            r0 = {**base, "rank": m["rank"], "step": st["step"], "phase": phase}
            if "state" in st:
                for q in STATE_Q:
                    out.append({**r0, "quantity": q, "predicted": p[q], "measured": st["state"][q]})
            if "comm" in st:
                pc = _comm_totals(_predicted_comm(p, st["step"]))
                mc = _comm_totals(st["comm"])
                for q in sorted(set(pc) | set(mc)):
                    out.append({**r0, "quantity": q, "predicted": pc.get(q, 0), "measured": mc.get(q, 0)})
    for r in out:
        r["abs_err"] = r["measured"] - r["predicted"]
        r["rel_err"] = r["abs_err"] / r["predicted"] if r["predicted"] else (0.0 if r["abs_err"] == 0 else float("inf"))
    return out


def table(path_or_records) -> pd.DataFrame:
    recs = R.load(path_or_records) if isinstance(path_or_records, str) else path_or_records
    data = [r for rec in recs for r in rows(rec)]
    return pd.DataFrame(data, columns=COLUMNS)


def summary(recs: list[dict], df: pd.DataFrame | None = None) -> pd.DataFrame:
    """One line per job: status, rows compared, steady-state mismatches, worst relative error."""
    df = table(recs) if df is None else df
    out = []
    for rec in recs:
        job = R.job_name(rec)
        d = df[df.job == job]
        steady = d[d.phase == "steady"]
        bad = steady[steady.abs_err != 0]
        pg = (rec.get("prediction") or {}).get("per_gpu") or {}
        out.append({"job": job, "framework": R.framework_variant(rec), "layout": R.layout_name(rec),
                    "status": rec["status"], "rows": len(d), "steady_mismatches": len(bad),
                    "max_abs_rel_err": float(steady.rel_err.abs().max()) if len(steady) else None,
                    "predicted_resident": pg.get("resident_bytes"),
                    "error": (rec.get("error") or "")[:120]})
    df = pd.DataFrame(out)
    if len(df):  # an unreadable or rejected job has none: keep the column integral
        df["predicted_resident"] = df["predicted_resident"].astype("Int64")
    return df


def compact(recs: list[dict], df: pd.DataFrame | None = None) -> pd.DataFrame:
    """One line per (job, rank) at its last step: predicted and measured resident bytes, and the
    collectives (kinds and counts, with how many comm rows differ): what `make demo` prints. The
    full per-quantity table stays `python -m analysis.reconcile DIR`."""
    df = table(recs) if df is None else df
    out = []
    for (job, rank), d in df.groupby(["job", "rank"], sort=False):
        last = d[d.step == d.step.max()]
        res = last[last.quantity == "resident_bytes"]
        comm = last[last.quantity.str.startswith("comm/")]
        counts = comm[comm.quantity.str.endswith("/count")]
        kinds = ", ".join(f"{q.split('/')[1]} {q.split('/')[2]}×{int(m)}" for q, m in zip(counts.quantity, counts.measured))
        out.append({"job": job, "rank": rank, "step": int(last.step.iloc[0]), "phase": last.phase.iloc[0],
                    "resident_predicted": int(res.predicted.iloc[0]) if len(res) else None,
                    "resident_measured": int(res.measured.iloc[0]) if len(res) else None,
                    "resident_abs_err": int(res.abs_err.iloc[0]) if len(res) else None,
                    "collectives (measured)": kinds or "none",
                    "comm_mismatches": int((comm.abs_err != 0).sum())})
    return pd.DataFrame(out)


def render(df: pd.DataFrame, fmt: str) -> str:
    if fmt == "csv":
        return df.to_csv(index=False)
    if fmt == "json":
        return df.to_json(orient="records", indent=1)
    return df.to_markdown(index=False) if _has_tabulate() else df.to_string(index=False)


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
        return True
    except ImportError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.reconcile", description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", help="a sweep dir, a job dir or a record.json")
    ap.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown")
    ap.add_argument("--all-steps", action="store_true", help="every step (default: the last step per rank)")
    ap.add_argument("--mismatches", action="store_true", help="only rows whose abs_err is not 0")
    ap.add_argument("--from-wandb", metavar="SRC", help="rebuild from W&B: an offline sweep dir or entity/project[/group]")
    a = ap.parse_args(argv)
    if not (a.path or a.from_wandb):
        ap.error("give a PATH or --from-wandb SRC")
    recs = wandb_io.load_from(a.path, a.from_wandb)
    if not recs:
        print(f"no record.json under {a.path or a.from_wandb}", file=sys.stderr)
        return 1
    df = table(recs)
    if not a.all_steps and len(df):
        last = df.groupby(["job", "rank"]).step.transform("max")
        df = df[(df.step == last) | (df.phase == "first")]
    if a.mismatches:
        df = df[df.abs_err != 0]
    print(render(df, a.format))
    if a.format == "markdown":
        print()
        print(render(summary(recs), "markdown"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
