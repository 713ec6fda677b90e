"""Where a campaign stands: one line per job of a sweep dir, and the counts.

    python -m analysis.status SWEEP_DIR [--watch [SECONDS]] [--format markdown|csv|json]

A job's status comes from its record (ok, failed, invalid, timeout, unreadable, or the Slurm state
of a job Slurm ended: cancelled, node_fail, ...). A job without a final record is `running` while
its process (local: the pid in its `running` record) or its Slurm job is alive, `pending` while it
waits (in Slurm's queue, or listed in the sweep's campaign.json and not started), and `interrupted`
when the process that ran it is gone: the next run of the sweep runs it again.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import pandas as pd

import records as R

COUNTED = ("ok", "failed", "invalid", "timeout", "running", "pending")
COLUMNS = ["job", "status", "framework", "layout", "slurm_state", "slurm_job_id", "wall_s", "error"]


def _line(num, entry: dict, rec: dict | None, now: float) -> dict:
    job_dir = (entry or {}).get("job_dir") or (rec or {}).get("job_dir") or ""
    row = {"job": os.path.basename(job_dir) or f"#{num}", "status": "pending", "framework": None, "layout": None,
           "slurm_state": None, "slurm_job_id": (entry or {}).get("slurm_job_id") or
           ((rec or {}).get("slurm") or {}).get("JobId"), "wall_s": None, "error": ""}
    if rec is not None:
        known = bool(rec.get("config"))
        row.update(framework=R.framework_variant(rec) if known else None, layout=R.layout_name(rec) if known else None,
                   status=rec.get("status") or "?", error=(rec.get("error") or "")[:100])
        row["wall_s"] = (rec.get("timings") or {}).get("total_s")
        if rec.get("slurm", {}).get("JobState"):
            row["slurm_state"] = rec["slurm"]["JobState"]
    final = rec is not None and row["status"] != "running"
    if row["slurm_job_id"] and not final:
        if entry and entry.get("slurm_conf") and not os.environ.get("SLURM_CONF"):
            os.environ["SLURM_CONF"] = entry["slurm_conf"]  # the Slurm the sweep was sent to
        from launchers.slurm import ACTIVE_STATES, slurm_state  # only for sweeps that went through Slurm

        s = slurm_state(row["slurm_job_id"]).get("JobState", "UNKNOWN")
        row["slurm_state"] = s
        if s == "PENDING":
            row["status"] = "pending"
        elif s in ACTIVE_STATES:
            row["status"] = "running"
        else:  # Slurm ended it and nobody wrote the final record (yet)
            row["status"] = s.lower() if s not in ("COMPLETED", "UNKNOWN") else "interrupted"
    elif rec is not None and row["status"] == "running":
        local = rec.get("host") == socket.gethostname()
        if local and not R.process_alive(rec.get("pid")):
            row["status"] = "interrupted"
            row["error"] = f"pid {rec.get('pid')} is gone; rerun the sweep to run it again"
        if rec.get("started_at"):
            row["wall_s"] = round(now - rec["started_at"], 1)
    if isinstance(row["wall_s"], float):
        row["wall_s"] = round(row["wall_s"], 1)
    return row


def table(sweep_dir: str) -> pd.DataFrame:
    """One line per job: those the campaign manifest lists and those with a record under sweep_dir."""
    now = time.time()
    manifest = R.read_manifest(sweep_dir)["jobs"]
    by_dir = {}
    for rec in R.load(sweep_dir):
        by_dir[os.path.abspath(rec.get("job_dir") or "")] = rec
    rows, done = [], set()
    for num in sorted(manifest, key=int):
        entry = manifest[num]
        d = os.path.abspath(entry.get("job_dir", ""))
        rows.append(_line(num, entry, by_dir.get(d), now))
        done.add(d)
    for d, rec in by_dir.items():  # records of jobs the manifest does not list (an older sweep)
        if d not in done:
            rows.append(_line(None, None, rec, now))
    return pd.DataFrame(rows, columns=COLUMNS)


def counts(df: pd.DataFrame) -> str:
    c = df.status.value_counts().to_dict() if len(df) else {}
    parts = [f"{k} {c.get(k, 0)}" for k in COUNTED]
    parts += [f"{k} {v}" for k, v in sorted(c.items()) if k not in COUNTED]
    return " · ".join(parts) + f" · total {len(df)}"


def active(df: pd.DataFrame) -> bool:
    return bool(len(df)) and df.status.isin(["running", "pending"]).any()


def render(df: pd.DataFrame, fmt: str) -> str:
    from analysis.reconcile import render as render_table

    return render_table(df.astype(object).where(df.notna(), ""), fmt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.status", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir")
    ap.add_argument("--watch", nargs="?", const=10.0, type=float, metavar="SECONDS",
                    help="redraw every SECONDS (default 10) while jobs are running or pending")
    ap.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.sweep_dir):
        print(f"no such sweep dir: {a.sweep_dir}", file=sys.stderr)
        return 1
    while True:
        df = table(a.sweep_dir)
        if a.watch and sys.stdout.isatty():
            print("\033[2J\033[H", end="")
        print(render(df, a.format))
        print(counts(df), flush=True)
        if not a.watch or not active(df):
            return 0
        time.sleep(a.watch)


if __name__ == "__main__":
    sys.exit(main())
