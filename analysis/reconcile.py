"""Prediction versus measurement, one row per (job, rank, step, quantity).

    python -m analysis.reconcile SWEEP_OR_JOB_DIR [--format markdown|csv|json] [--all-steps]

Quantities: params_bytes grads_bytes optim_bytes resident_bytes (at the step boundary),
comm/<dim>/<kind>/count, comm/<dim>/<kind>/buffer_bytes (per optimizer step), and where the
ledger predicts one, peak_bytes and peak/<part>_bytes (the most live bytes within the step, probes/peak.py).
A steady mismatch is any byte off for states and collectives, more than 1% for peaks. Step 0 is the
first (tracing / warm-up) step: it is compared with the ledger's first-step prediction and
reported as phase "first", as are further warm-up steps the prediction lists (comm_warmup);
later steps are phase "steady".
"""
from __future__ import annotations

import argparse
import sys

import pandas as pd

import records as R
from analysis import wandb_io
from analysis.compare import COLUMNS, STATE_Q, off, rows, table  # noqa: F401  (analysis.reconcile.table, as before)

def judged(df: pd.DataFrame) -> pd.Series:
    """The rows held to a rule (and counted by summary()): steady steps, every quantity but a peak's
    parts (reported beside their total, compare.off). A first step's rows are shown, not judged."""
    return (df.phase == "steady") & ~df.quantity.str.startswith("peak/")


def mismatches(df: pd.DataFrame) -> pd.DataFrame:
    """The judged rows that break their rule: what --mismatches lists and summary() counts."""
    return df[judged(df) & off(df)]


def summary(recs: list[dict], df: pd.DataFrame | None = None) -> pd.DataFrame:
    """One line per job: status, rows compared, steady-state mismatches, worst relative error."""
    df = table(recs) if df is None else df
    out = []
    for rec in recs:
        job = R.job_name(rec)
        d = df[df.job == job]
        steady = d[d.phase == "steady"]
        bad = mismatches(d)
        peak = steady[steady.quantity == "peak_bytes"]
        held = steady[~steady.quantity.str.startswith("peak/")]
        pg = (rec.get("prediction") or {}).get("per_gpu") or {}
        out.append({"job": job, "framework": R.framework_variant(rec), "layout": R.layout_name(rec),
                    "device": rec.get("device") or ((rec.get("config") or {}).get("cluster") or {}).get("device"),
                    "status": rec["status"], "rows": len(d), "steady_mismatches": len(bad),
                    # over the judged rows: the peak's parts are reported, not judged (compare.off)
                    "max_abs_rel_err": float(held.rel_err.abs().max()) if len(held) else None,
                    "peak_max_abs_rel_err": float(peak.rel_err.abs().max()) if len(peak) else None,
                    "predicted_resident": pg.get("resident_bytes"),
                    "error": (rec.get("error") or "")[:120]})
    df = pd.DataFrame(out)
    if len(df):  # an unreadable or rejected job has none: keep the column integral
        df["predicted_resident"] = df["predicted_resident"].astype("Int64")
    return df


def fake_notes(recs: list[dict]) -> list[str]:
    """One line per cluster=fake job: which ranks of the world were measured, and the fake-world
    shims and data-dependent read sites its ranks reached (launchers/fake.py; the README says what
    each changes), so a table of fake jobs never reads as a real run's."""
    out = []
    for rec in recs:
        fk = rec.get("fake")
        if not fk:
            continue
        shims, reads = set(), set()
        for r in (rec.get("measurement") or {}).get("ranks", []):
            shims |= set(r.get("fake_shims") or {})
            shims |= {k for k in (r.get("cpu_redirects") or {}) if isinstance(k, str) and k.startswith("fake_")}
            reads |= {f"{x['module']}.{x['function']}" for x in r.get("fake_scalar_reads") or []}
        world = (rec.get("measurement") or {}).get("world")
        out.append(f"{R.job_name(rec)}: device fake, ranks {fk.get('measured_ranks')} of {world} measured; "
                   f"{fk.get('note')}; shims reached: {', '.join(sorted(shims)) or 'none'}; reads answered 0 at: "
                   f"{', '.join(sorted(reads)) or 'none'}")
    return out


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
    ap.add_argument("--mismatches", action="store_true",
                    help="only the judged rows that break their rule (the summary's steady_mismatches)")
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
    df = df.assign(judged=judged(df)) if len(df) else df.assign(judged=pd.Series(dtype=bool))
    if a.mismatches:
        df = mismatches(df)
    print(render(df, a.format))
    if a.format == "markdown":
        print()
        print(render(summary(recs), "markdown"))
        for line in fake_notes(recs):
            print(f"\n{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
