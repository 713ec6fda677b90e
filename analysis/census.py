"""What is live at each rank's measured peak, beside the ledger's predicted parts.

    python -m analysis.census DIR [--job SUBSTRING] [--rank R]

For the step the peak probe kept a timeline of (the last one by default, `probe`'s timeline step),
per job and rank: the measured peak and where it was, the probe's census (the storages live at the
peak grouped by category and by the phase, micro-batch, module and operator that allocated them,
largest first; probes/peak.py PeakTracker.census) and the ledger's predicted peak with its detail
rows. The census is how a peak finding is read: which storages the prediction lacks or has too many of.
"""
from __future__ import annotations

import argparse
import sys

import records as R


def _fmt(n) -> str:
    return f"{n:,}" if isinstance(n, int) else str(n)


def origin(g: dict) -> str:
    """Where a census group's storages were allocated, in words."""
    if g["phase"] == "start":
        return "live at the step's start"
    return " · ".join(str(x) for x in (g["phase"], f"mb {g['micro_batch']}", g["module"], g["op"]) if x is not None)


def lines(rec: dict, rank: int | None = None) -> list[str]:
    """The census of one record's ranks as text lines."""
    out = [f"== {R.job_name(rec)}"]
    pred = R.predicted_ranks(rec.get("prediction"))
    for m in (rec.get("measurement") or {}).get("ranks", []):
        if rank is not None and m["rank"] != rank:
            continue
        st = next((s for s in m.get("steps", []) if (s.get("peak") or {}).get("census")), None)
        if st is None:
            out.append(f"rank {m['rank']}: no census (no timeline step with the peak probe on)")
            continue
        pk = st["peak"]
        w = pk["where"]
        out.append(f"rank {m['rank']} step {st['step']}: measured peak {_fmt(pk['peak_bytes'])} B at {w['phase']} "
                   f"mb {w['micro_batch']} {w['module']} {w['op']}")
        for g in pk["census"]:
            out.append(f"  {g['category']:<11} {_fmt(g['bytes']):>16} {g['storages']:>5} x (largest "
                       f"{_fmt(g['largest'])})  {origin(g)}")
        lp = pred(m["rank"]).get("peak")
        if lp:
            out.append(f"  predicted {_fmt(lp['bytes'])} B ({lp.get('what')}):")
            for k, v in (lp.get("detail") or {}).items():
                out.append(f"    {k}: {_fmt(v)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="a job or sweep directory")
    ap.add_argument("--job", default=None, help="only jobs whose name contains this")
    ap.add_argument("--rank", type=int, default=None)
    a = ap.parse_args(argv)
    recs = [r for r in R.load(a.dir) if a.job is None or a.job in R.job_name(r)]
    if not recs:
        print(f"no records under {a.dir}", file=sys.stderr)
        return 1
    for rec in recs:
        print("\n".join(lines(rec, a.rank)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
