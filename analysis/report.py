"""The prediction-versus-measurement report of a sweep, as a page a person opens in a browser.

    python -m analysis.report SWEEP_DIR                        # -> SWEEP_DIR/report/index.html
    python -m analysis.report SWEEP_DIR --from-wandb SRC       # the same, from W&B (offline dir or ENTITY/PROJECT[/GROUP])
    python -m analysis.report SWEEP_DIR --wandb-report ENTITY/PROJECT   # + the W&B report (spec always; saved with a key)

Three figures (matplotlib, PNG), frameworks side by side:
  scatter.png  predicted vs measured per quantity family, with the identity line (steady steps)
  memory.png   per-rank resident state stacked by params / grads / optim / other, predicted beside measured
  comm.png     collective buffer bytes per optimizer step by dimension and kind, predicted beside measured
  timeline.png one row per job: live bytes by category through one step of its most-loaded rank
               (probes/peak.py), and on the same MB scale the peak's parts, predicted beside measured
and the per-job summary, what is live at each job's measured peak (the probe's census beside the
predicted peak), the mismatching rows and the whole table (reconcile.csv).
"""
from __future__ import annotations

import argparse
import json
import html
import os
import sys
import time

import matplotlib

matplotlib.use("Agg")  # files only; no display on compute nodes or in CI
# labels come from user data (job dirs, model names): `$...$` in them is text, never math text to parse
matplotlib.rcParams["text.parse_math"] = False
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

import records as R  # noqa: E402
from analysis import census, reconcile, wandb_io  # noqa: E402
from analysis.compare import PEAK_REL_TOL  # noqa: E402

FAMILIES = ("megatron", "deepspeed", "titan")  # column order: the three frameworks side by side
FAMILY_COLOR = {"megatron": "#76b900", "deepspeed": "#0078d4", "titan": "#ee4c2c"}
VARIANT_MARKER = {"megatron": "o", "deepspeed-z1": "s", "deepspeed-z2": "D", "deepspeed-z3": "^", "titan": "P"}
STATES = ("params", "grads", "optim", "other")
STATE_COLOR = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868", "other": "#8c8c8c"}
PANELS = [("params_bytes", "params"), ("grads_bytes", "grads"), ("optim_bytes", "optim (master + Adam)"),
          ("resident_bytes", "resident (all state)"), ("comm_bytes", "collective buffer bytes / step"),
          ("comm_count", "collective calls / step"), ("peak_bytes", "peak within the step"),
          ("peak_parts", "peak: its parts")]
CATEGORY_COLOR = {**STATE_COLOR, "activations": "#c44e52", "gathered": "#8172b3", "temporary": "#ccb974",
                  "unnamed": "#64b5cd", "resident": "#2f3e46"}  # resident: the states together, none of theirs
PHASE_COLOR = {"forward": "#e8f1fb", "backward": "#fbeee8", "optimizer": "#eaf6ea", "schedule": "#f6f6f6",
               "setup": "#ffffff"}


def family(variant: str) -> str:
    return variant.split("-", 1)[0]


def human(n: float, _pos=None) -> str:
    """Decimal units as the ledger prints them (ledger.placement.fmt), short enough for tick labels."""
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.0f} TB"


def last_steady(df: pd.DataFrame) -> pd.DataFrame:
    """Steady rows of the last step of each (job, rank): what the summary calls the steady state."""
    s = df[df.phase == "steady"]
    if not len(s):
        return s
    return s[s.step == s.groupby(["job", "rank"]).step.transform("max")]


def _panel_of(q: str) -> str:
    if q.startswith("comm/"):
        return "comm_bytes" if q.endswith("/buffer_bytes") else "comm_count"
    if q.startswith("peak/"):
        return "peak_parts"
    return q


# -- figures ----------------------------------------------------------------------------------

def fig_scatter(df: pd.DataFrame, path: str) -> None:
    d = last_steady(df).copy()
    d["panel"] = d.quantity.map(_panel_of)
    fig, axes = plt.subplots(2, 4, figsize=(20, 9.5))
    for ax, (panel, title) in zip(axes.flat, PANELS):
        p = d[d.panel == panel]
        # symlog, linear below 1: a predicted and measured 0 is a point too
        ax.set_xscale("symlog", linthresh=1)
        ax.set_yscale("symlog", linthresh=1)
        hi = max(float(p[["predicted", "measured"]].max().max()) if len(p) else 1.0, 1.0) * 3
        ax.plot([0, hi], [0, hi], color="black", lw=0.8, ls="--", zorder=1, label="measured = predicted")
        for variant, g in p.groupby("framework"):
            # hollow markers: points of several frameworks at one spot stay visible
            ax.scatter(g.predicted, g.measured, s=48, marker=VARIANT_MARKER.get(variant, "o"), facecolor="none",
                       edgecolor=FAMILY_COLOR.get(family(variant), "gray"), lw=1.4, label=variant, zorder=2)
        off = int(reconcile.off(p).sum())
        ax.set_title(f"{title}\n{len(p)} points, {off} off the line", fontsize=10,
                     color="black" if off == 0 else "#b00020")
        ax.set_xlim(-0.5, hi)
        ax.set_ylim(-0.5, hi)
        fmt = FuncFormatter(human) if panel != "comm_count" else FuncFormatter(lambda v, _p: f"{v:g}")
        ax.xaxis.set_major_formatter(fmt)
        ax.yaxis.set_major_formatter(fmt)
        ax.set_xlabel("predicted")
        ax.set_ylabel("measured")
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle("Predicted vs measured, per rank, last steady step (each point: one job x rank x quantity)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _grid(recs: list[dict]):
    """Jobs arranged in one column per framework family, in sweep order within a column."""
    cols = [f for f in FAMILIES if any(family(R.framework_variant(r)) == f for r in recs)]
    cols += sorted({family(R.framework_variant(r)) for r in recs} - set(cols))
    per = {c: [r for r in recs if family(R.framework_variant(r)) == c] for c in cols}
    return cols, per, max(len(v) for v in per.values())


def _columns(recs: list[dict], col_w: float, row_h: float, title: str):
    """A figure with one sub-figure per framework family (headed by its name) and one axes per job;
    yields (axes, record) and leaves unused axes off."""
    cols, per, rows = _grid(recs)
    fig = plt.figure(figsize=(col_w * len(cols), row_h * rows + 1.3), layout="constrained")
    fig.suptitle(title)
    subs = fig.subfigures(1, len(cols), squeeze=False)[0]
    cells = []
    for sf, c in zip(subs, cols):
        sf.suptitle(c, color=FAMILY_COLOR.get(c, "black"), fontsize=13, weight="bold")
        axs = sf.subplots(rows, 1, squeeze=False)[:, 0]
        for ri, ax in enumerate(axs):
            if ri < len(per[c]):
                cells.append((ax, per[c][ri], c))
            else:
                ax.axis("off")
    return fig, cells


def _title(rec: dict) -> str:
    return f"{R.framework_variant(rec)} · {R.layout_name(rec)}\n{R.job_name(rec)}"


def _no_data(ax, rec: dict, what: str) -> None:
    """An empty cell says why: the job's status and the first words of its error."""
    import textwrap

    err = (rec.get("error") or "").strip().splitlines()
    msg = f"{what}\n[{rec.get('status')}]" + ("\n" + textwrap.fill(err[0][:160], 48) if err else "")
    ax.text(0.5, 0.5, msg, transform=ax.transAxes, ha="center", va="center", fontsize=8, color="#b00020")
    ax.set_xticks([])
    ax.set_yticks([])


def _measured_state(rec: dict) -> dict[int, dict]:
    """rank -> state dict of its last step."""
    out = {}
    for m in (rec.get("measurement") or {}).get("ranks", []):
        steps = [s for s in m.get("steps", []) if "state" in s]
        if m.get("status") == "ok" and steps:
            out[m["rank"]] = steps[-1]["state"]
    return out


def fig_memory(recs: list[dict], path: str) -> None:
    fig, cells = _columns(recs, 5.4, 3.2, "Resident state per rank at the step boundary (MB, 1 MB = 1e6 B)")
    for ax, rec, _ in cells:
        pred_of = R.predicted_ranks(rec.get("prediction"))
        meas = _measured_state(rec)
        # the measured ranks; a prediction alone draws the first rank of each class of alike ranks
        ranks = sorted(meas) or [c["ranks"][0][0] for c in R.rank_classes(rec.get("prediction"))][:16]
        pred = {r: pred_of(r) for r in ranks}
        x = np.arange(len(ranks))
        w = 0.38
        for off, src, style in ((-w / 2, pred, dict(alpha=0.45, hatch="//")), (w / 2, meas, dict())):
            bottom = np.zeros(len(ranks))
            for s in STATES:
                v = np.array([src.get(r, {}).get(f"{s}_bytes", 0) or 0 for r in ranks], dtype=float) / 1e6
                ax.bar(x + off, v, w, bottom=bottom, color=STATE_COLOR[s], edgecolor="white", lw=0.5, **style)
                bottom += v
        ax.set_xticks(x, [f"rank {r}" for r in ranks], fontsize=8)
        ax.set_ylabel("MB")
        status = rec.get("status")
        ax.set_title(_title(rec) + ("" if status == "ok" else f"  [{status}]"), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if not meas:
            _no_data(ax, rec, "no measurement")
    legend = [Patch(color=STATE_COLOR[s], label=s) for s in STATES]
    legend += [Patch(facecolor="white", edgecolor="gray", hatch="//", label="left bar: predicted"),
               Patch(facecolor="gray", label="right bar: measured")]
    fig.legend(handles=legend, loc="outside lower center", ncol=len(legend), frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline_rank(rec: dict):
    """(rank, step record) of the rank with the highest measured peak in its timeline step."""
    best = None
    for m in (rec.get("measurement") or {}).get("ranks", []):
        for st in m.get("steps", []):
            if st.get("timeline") and (best is None or st["peak"]["peak_bytes"] > best[1]["peak"]["peak_bytes"]):
                best = (m["rank"], st)
    return best


def census_table(recs: list[dict], top: int = 8) -> pd.DataFrame:
    """What is live at each job's highest measured peak (the timeline step's census, probes/peak.py):
    its `top` largest groups by category and where they were allocated, beside the ledger's predicted
    peak and the moment it names (python -m analysis.census prints every group and the predicted detail)."""
    rows = []
    for rec in recs:
        got = _timeline_rank(rec)
        if got is None or not got[1]["peak"].get("census"):
            continue
        rank, st = got
        pk = st["peak"]
        pred = R.predicted_ranks(rec.get("prediction"))(rank).get("peak") or {}
        w = pk["where"]
        head = {"job": R.job_name(rec), "rank": rank, "measured peak": pk["peak_bytes"],
                "measured at": f"{w['phase']} · {w['op'] or '-'}", "predicted peak": pred.get("bytes"),
                "predicted at": pred.get("what", "")}
        for i, g in enumerate(pk["census"][:top]):
            rows.append({**(head if i == 0 else {k: "" for k in head}), "category": g["category"], "bytes": g["bytes"],
                         "storages": g["storages"], "allocated at": census.origin(g)})
    cols = ["job", "rank", "measured peak", "measured at", "predicted peak", "predicted at", "category", "bytes",
            "storages", "allocated at"]
    return pd.DataFrame(rows, columns=cols)


def _stack(ax, points: list[dict], cats: list[str], phases: bool) -> None:
    """Live bytes by category against the fraction of the step (a step plot: each point holds until the next)."""
    n = max(len(points) - 1, 1)
    x = np.array([i / n for i in range(len(points))])
    if phases:
        start = 0
        for i in range(1, len(points) + 1):
            if i == len(points) or points[i]["phase"] != points[start]["phase"]:
                ax.axvspan(x[start], x[min(i, len(points) - 1)], color=PHASE_COLOR.get(points[start]["phase"], "white"),
                           lw=0, zorder=0)
                start = i
    ys = [np.array([p.get(c, 0) for p in points], dtype=float) / 1e6 for c in cats]
    ax.stackplot(x, *ys, colors=[CATEGORY_COLOR.get(c, "gray") for c in cats], step="post", lw=0, zorder=2)
    ax.set_xlim(0, 1)
    ax.set_ylabel("MB", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(axis="y", alpha=0.3)


# the peak's parts as the ledger names them (Peak.parts) and as the probe's at_peak adds up to them:
# resident = the four states together (a colour of its own: not one of the states')
PEAK_PARTS = ("resident", "unnamed", "gathered", "activations", "temporary")
TIMELINE_CATS = ("params", "grads", "optim", "other", "unnamed", "gathered", "activations", "temporary")


def _measured_parts(at_peak: dict) -> dict:
    """The probe's bytes by category at its peak, in the ledger's parts (resident = the states)."""
    out = {"resident": sum(at_peak.get(k, 0) for k in STATES)}
    out.update({k: at_peak.get(k, 0) for k in PEAK_PARTS[1:]})
    return out


def fig_timeline(recs: list[dict], path: str) -> None:
    """One row per job: the most-loaded rank's live bytes by category through its timeline step (left,
    x = the fraction of the step's allocator events, phases shaded), and on the same MB scale the peak
    split into parts, predicted beside measured (right); the predicted peak dashed across both."""
    fig = plt.figure(figsize=(13, 2.7 * len(recs) + 1.2), layout="constrained")
    fig.suptitle("Live tensor bytes through one step, each job's most-loaded rank (MB, 1 MB = 1e6 B)")
    grid = fig.add_gridspec(len(recs), 2, width_ratios=(5, 1.3))
    for i, rec in enumerate(recs):
        line, bars = fig.add_subplot(grid[i, 0]), fig.add_subplot(grid[i, 1])
        got = _timeline_rank(rec)
        if got is None:
            line.set_title(_title(rec).replace("\n", "  "), fontsize=9, loc="left")
            _no_data(line, rec, "no timeline measured")
            bars.axis("off")
            continue
        rank, st = got
        pred = R.predicted_ranks(rec.get("prediction"))(rank)
        pk = pred.get("peak") or {}
        cats = [c for c in TIMELINE_CATS if any(p.get(c) for p in st["timeline"])]
        _stack(line, st["timeline"], cats, phases=True)
        line.axhline(st["peak"]["peak_bytes"] / 1e6, color="black", lw=0.8)
        if pk:
            line.axhline(pk["bytes"] / 1e6, color="#b00020", lw=1.0, ls="--")
        w = st["peak"]["where"]
        line.set_title(f"{R.framework_variant(rec)} · {R.layout_name(rec)} ({R.job_name(rec)}), rank {rank} step "
                       f"{st['step']}: measured peak {human(st['peak']['peak_bytes'])} ({w.get('phase')}, mb "
                       f"{w.get('micro_batch')})" + (f"; predicted {human(pk['bytes'])} ({pk.get('phase')})"
                                                     if pk else "; no peak predicted"), fontsize=9, loc="left")
        line.set_xlabel("fraction of the step's allocator events", fontsize=8)
        columns = [("measured", _measured_parts(st["peak"]["at_peak"]))]
        if pk:
            columns.insert(0, ("predicted", {k: pk["parts"].get(k, 0) for k in PEAK_PARTS}))
        for x, (_, parts) in enumerate(columns):
            base = 0.0
            for k in PEAK_PARTS:
                v = parts.get(k, 0) / 1e6
                bars.bar(x, v, 0.6, bottom=base, color=CATEGORY_COLOR[k], edgecolor="white", lw=0.5)
                base += v
        if pk:
            bars.axhline(pk["bytes"] / 1e6, color="#b00020", lw=1.0, ls="--")
        bars.set_xticks(range(len(columns)), [c for c, _ in columns], fontsize=8)
        bars.set_title("the peak's parts", fontsize=8)
        top = max(line.get_ylim()[1], bars.get_ylim()[1])
        for ax in (line, bars):
            ax.set_ylim(0, top)
            ax.tick_params(labelsize=7)
            ax.grid(axis="y", alpha=0.3)
        bars.set_ylabel("MB", fontsize=8)
    legend = [Patch(color=CATEGORY_COLOR[c], label=c) for c in (*STATES, "resident", *PEAK_PARTS[1:])]
    legend += [Patch(color=PHASE_COLOR[p], label=f"phase: {p}") for p in ("forward", "backward", "schedule", "optimizer")]
    legend += [Line2D([], [], color="black", lw=0.8, label="measured peak"),
               Line2D([], [], color="#b00020", lw=1.0, ls="--", label="predicted peak")]
    fig.legend(handles=legend, loc="outside lower center", ncol=8, frameon=False, fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def comm_by_dim_kind(rec: dict, df: pd.DataFrame) -> pd.DataFrame:
    """(dim/kind) -> predicted and measured buffer bytes per optimizer step, mean over ranks (last steady step)."""
    d = last_steady(df[df.job == R.job_name(rec)])
    d = d[d.quantity.str.startswith("comm/") & d.quantity.str.endswith("/buffer_bytes")]
    if not len(d):
        return pd.DataFrame(columns=["predicted", "measured"])
    d = d.assign(dk=d.quantity.str.slice(5, -len("/buffer_bytes")))
    nranks = d["rank"].nunique()
    return d.groupby("dk")[["predicted", "measured"]].sum() / nranks


def fig_comm(recs: list[dict], df: pd.DataFrame, path: str) -> None:
    fig, cells = _columns(recs, 5.4, 2.8, "Collective buffer bytes per optimizer step by grid dimension / kind "
                                          "(mean over ranks, last steady step)")
    for ax, rec, c in cells:
        t = comm_by_dim_kind(rec, df)
        ax.set_title(_title(rec), fontsize=9)
        if not len(t):
            _no_data(ax, rec, "no collectives measured")
            continue
        y = np.arange(len(t))
        h = 0.38
        color = FAMILY_COLOR.get(c, "gray")
        ax.barh(y - h / 2, t.predicted, h, color=color, alpha=0.4, hatch="//", edgecolor="white")
        ax.barh(y + h / 2, t.measured, h, color=color)
        for yi, (p, m) in enumerate(zip(t.predicted, t.measured)):
            ax.text(max(p, m), yi, f" {human(m)}" + ("" if p == m else f" (predicted {human(p)})"), va="center",
                    fontsize=7, color="black" if p == m else "#b00020")
        ax.set_yticks(y, t.index, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(human))
        ax.tick_params(axis="x", labelsize=7)
        pos = t[t > 0].min().min() if (t > 0).any().any() else 1.0
        ax.set_xlim(max(min(pos, 1.0), 0.1) / 2, max(t.max().max(), 1) * 30)  # room for the value labels
        ax.grid(axis="x", alpha=0.3)
    legend = [Patch(facecolor="gray", alpha=0.4, hatch="//", label="predicted (upper bar)"),
              Patch(color="gray", label="measured (lower bar)")]
    fig.legend(handles=legend, loc="outside lower center", ncol=2, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the page ---------------------------------------------------------------------------------

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1700px;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,td:nth-child(2),td:nth-child(3){text-align:left}
.ok{color:#1a7f37;font-weight:600}.bad{color:#b00020;font-weight:600}img{max-width:100%;border:1px solid #eee}
.muted{color:#666;font-size:13px}"""


def time_table(recs: list[dict]) -> pd.DataFrame:
    """Predicted step time (the job's target) beside the measured steady steps (analysis/timing.py)."""
    from analysis import timing

    rows = []
    for rec in recs:
        s = timing.job_summary(rec)
        st = (rec.get("prediction") or {}).get("step_time") or {}
        if s:
            row = {"job": s["job"], "framework": s["framework"], "layout": s["layout"],
                   "predicted s": round(s["predicted_s"], 5), "measured s (median, slowest rank)": round(s["measured_s"], 5),
                   "rel_err": round(s["rel_err"], 3)}
            for q in timing.PHASES:  # the phases, predicted / measured (probes/phases.py)
                if f"measured_{q}" in s:
                    row[f"{q[:-2]} s p / m"] = f"{s[f'predicted_{q}']:.4g} / {s[f'measured_{q}']:.4g}"
            rows.append({**row, "target": st.get("target")})
    return pd.DataFrame(rows)


def fig_gantt(recs: list[dict], path: str) -> bool:
    """Each job's predicted step (step_trace.json: one lane per stage, the exposed collectives and the
    optimizer) above its measured step (the slowest rank's median steady step) as one bar."""

    from analysis import timing

    jobs = []
    for rec in recs:
        tp = os.path.join(rec.get("job_dir", ""), "step_trace.json")
        if os.path.exists(tp):
            with open(tp) as f:
                jobs.append((rec, json.load(f)["traceEvents"], timing.job_summary(rec)))
    if not jobs:
        return False
    fig, axes = plt.subplots(len(jobs), 1, figsize=(11, 1.2 + 0.5 * max(
        len({e["tid"] for e in ev if e["ph"] == "M"}) + 1 for _, ev, _ in jobs) * len(jobs)), squeeze=False)
    for ax, (rec, ev, summ) in zip(axes[:, 0], jobs):
        names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M"}
        lanes = sorted(names)
        for e in ev:
            if e["ph"] != "X":
                continue
            y = lanes.index(e["tid"])
            color = "#4c72b0" if e["name"].startswith("forward") else "#dd8452" if e["name"].startswith("backward") \
                else "#c44e52" if e.get("cat") == "communication" else "#55a868"
            ax.broken_barh([(e["ts"] / 1e6, e["dur"] / 1e6)], (y - 0.4, 0.8), color=color)
        labels = [names[t] for t in lanes]
        if summ:
            # the measured step split by phase (probes/phases.py: summed times, not a schedule): forward,
            # backward, optimizer, then the rest of the step
            t, y = 0.0, len(lanes)
            for q, color in (("forward_s", "#4c72b0"), ("backward_s", "#dd8452"), ("optimizer_s", "#55a868")):
                d = summ.get(f"measured_{q}", 0.0)
                ax.broken_barh([(t, d)], (y - 0.4, 0.8), color=color)
                t += d
            ax.broken_barh([(t, max(0.0, summ["measured_s"] - t))], (y - 0.4, 0.8), color="#8c8c8c")
            labels.append("measured step (phases, then the rest)")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("seconds")
        ax.set_title(_title(rec), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _html_table(df: pd.DataFrame, byte_cols=("predicted", "measured", "abs_err", "predicted_resident")) -> str:
    return df.to_html(index=False, border=0, na_rep="", escape=True,
                      formatters={c: (lambda v: f"{v:,}" if isinstance(v, (int, np.integer)) else v)
                                  for c in df.columns if c in byte_cols})


def write(recs: list[dict], out_dir: str, source: str) -> str:
    """Write out_dir/index.html, its PNGs and reconcile.csv; return the page's path."""
    os.makedirs(out_dir, exist_ok=True)
    df = reconcile.table(recs)
    summ = reconcile.summary(recs, df)
    df.to_csv(os.path.join(out_dir, "reconcile.csv"), index=False)
    figs = []
    if len(df):
        fig_scatter(df, os.path.join(out_dir, "scatter.png"))
        fig_memory(recs, os.path.join(out_dir, "memory.png"))
        fig_comm(recs, df, os.path.join(out_dir, "comm.png"))
        fig_timeline(recs, os.path.join(out_dir, "timeline.png"))
        figs = [("Predicted vs measured", "scatter.png",
                 "Every point is one (job, rank, quantity) of the last steady step; on the dashed line the ledger "
                 "predicted the measured value exactly."),
                ("Per-rank memory by state", "memory.png",
                 "For each job (columns: framework), left bars are the prediction, right bars the measurement."),
                ("Communication by dimension and kind", "comm.png",
                 "Buffer bytes handed to collectives in one optimizer step; red labels mark a disagreement."),
                ("Memory through one step", "timeline.png",
                 "Live tensor bytes by category at every operator of one step (the peak probe), for each job's "
                 "most-loaded rank; the ledger's prediction above it, its predicted peak dashed red on the "
                 "measured plot.")]
    steady = df[df.phase == "steady"]
    bad = steady[reconcile.off(steady)]
    totals = steady[steady.quantity == "peak_bytes"] if len(steady) else steady
    npeak = len(totals)
    # rows whose measured peak a collective's worker thread held up (compare.peak_gap's range)
    nrace = int((totals.race_bytes > 0).sum()) if npeak else 0
    verdict = (f'<span class="ok">all {len(steady)} steady rows agree: states and collectives to the byte'
               + (f', {npeak} peaks within {PEAK_REL_TOL:.0%}' if npeak else '')
               + (f' ({nrace} of the range a worker thread\'s late free spans)' if nrace else '') + '</span>'
               if len(steady) and not len(bad)
               else f'<span class="bad">{len(bad)} of {len(steady)} steady rows differ</span>')
    fams = ", ".join(sorted({R.framework_variant(r) for r in recs}))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>train-ledger report</title>"
             f"<style>{CSS}</style></head><body>",
             "<h1>train-ledger: prediction vs measurement</h1>",
             f"<p class='muted'>source: {html.escape(source)} · {len(recs)} jobs ({html.escape(fams)}) · "
             f"written {time.strftime('%Y-%m-%d %H:%M:%S')}</p>",
             f"<p>{verdict}</p>", "<h2>Jobs</h2>", _html_table(summ)]
    for title, png, caption in figs:
        parts += [f"<h2>{title}</h2>", f"<p class='muted'>{caption}</p>", f"<img src='{png}' alt='{title}'>"]
    tt = time_table(recs)
    if len(tt):
        parts += ["<h2>Step time</h2>",
                  "<p class='muted'>The step-time model's prediction for its target (ledger/timing; a CPU run predicts "
                  "only with a calibrated profile, hardware.file) beside the measured steady steps; reported, not "
                  "judged (docs/steptime.md).</p>", _html_table(tt, ())]
    if fig_gantt(recs, os.path.join(out_dir, "gantt.png")):
        parts += ["<p class='muted'>The predicted step (forward blue, backward orange, exposed collectives red, "
                  "optimizer green) above the measured step.</p>", "<img src='gantt.png' alt='step gantt'>"]
    live = census_table(recs)
    if len(live):
        parts += ["<h2>What is live at the peak</h2>",
                  "<p class='muted'>Each job's most-loaded rank at its measured peak: the largest groups of live "
                  "storages by category and by where they were allocated (the peak probe's census), beside the "
                  "ledger's predicted peak and the moment it names. <code>python -m analysis.census DIR</code> "
                  "prints every group and the prediction's detail.</p>",
                  _html_table(live, ("measured peak", "predicted peak", "bytes"))]
    parts += ["<h2>Mismatching rows</h2>",
              _html_table(bad) if len(bad) else "<p class='ok'>none</p>",
              "<p class='muted'>every row, every step: <a href='reconcile.csv'>reconcile.csv</a></p></body></html>"]
    path = os.path.join(out_dir, "index.html")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


FIGURES = ("scatter", "memory", "comm", "timeline")


def build_wandb_report(entity: str, project: str, group: str, world: int, title: str):
    """The W&B report object (wandb-workspaces): the report's own three figures, logged as images by
    a "report" run of the sweep's group, then live panels over the jobs' runs (predicted vs measured
    from their reconcile tables, per-rank memory, mismatches, loss, the tables themselves).

    Building it needs no server; saving it does (publish_wandb_report) and is UNTESTED HERE: this
    machine reaches no W&B server."""
    import wandb_workspaces.reports.v2 as wr

    jobs = wr.Runset(entity=entity, project=project, name="jobs",
                     filters=f"Metric('Group') == '{group}' and Metric('JobType') != 'report'")
    mine = wr.Runset(entity=entity, project=project, name="report",
                     filters=f"Metric('Group') == '{group}' and Metric('JobType') == 'report'")
    ranks = range(max(world, 1))
    figures = [wr.MediaBrowser(title=t, media_keys=[f"report/{k}"], num_columns=1)
               for k, t in zip(FIGURES, ("predicted vs measured", "per-rank memory by state",
                                         "communication by dimension and kind", "memory through one step"))]
    live = [wr.CustomChart(query={"summaryTable": {"tableKey": "reconcile"}}, chart_name="wandb/scatter/v0",
                           chart_fields={"x": "predicted", "y": "measured", "groupKeys": "framework"}),
            wr.BarPlot(title="measured resident bytes per rank", metrics=[f"rank{r}/resident_bytes" for r in ranks]),
            wr.BarPlot(title="rank 0 state by kind (bytes)",
                       metrics=[f"rank0/{k}_bytes" for k in ("params", "grads", "optim", "other")]),
            wr.BarPlot(title="steady rows that differ", metrics=["steady_mismatches"]),
            wr.LinePlot(title="loss", x="Step", y=["loss"]),
            wr.WeavePanelSummaryTable(table_name="reconcile")]
    return wr.Report(entity=entity, project=project, title=title,
                     description="train-ledger: what the ledger predicted per rank against what the frameworks did",
                     blocks=[wr.H1(text=title),
                             wr.H2(text="The sweep report's figures"), wr.PanelGrid(runsets=[mine], panels=figures),
                             wr.H2(text="Live panels over the jobs' runs"), wr.PanelGrid(runsets=[jobs], panels=live)])


def report_spec(obj):
    """A wandb-workspaces report object as plain data: each block, panel and run set as {"type": its
    class, its fields...}. (wandb-workspaces' own conversion to the stored view spec asks the server
    for the project, so the spec is read from the objects themselves.)"""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"type": type(obj).__name__, **{f.name: report_spec(getattr(obj, f.name))
                                               for f in dataclasses.fields(obj) if not f.name.startswith("_")}}
    if isinstance(obj, (list, tuple)):
        return [report_spec(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): report_spec(v) for k, v in obj.items()}
    return obj if obj is None or isinstance(obj, (str, int, float, bool)) else str(obj)


def write_wandb_report_spec(report, out_dir: str) -> str:
    """The report's spec (report_spec) as JSON in the report dir: its blocks, panels, run sets and
    filters, what a save would lay out, readable without a server."""
    path = os.path.join(out_dir, "wandb_report.json")
    with open(path, "w") as f:
        json.dump(report_spec(report), f, indent=2)
    return path


def wandb_api_key_configured() -> bool:
    """A W&B API key wandb would use without prompting: WANDB_API_KEY, or a netrc entry for the
    configured base URL's host (what `wandb login` writes)."""
    import netrc
    from urllib.parse import urlparse

    import wandb

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def publish_wandb_report(report, group: str, out_dir: str) -> str:
    """Log the figures as a "report" run of the sweep's group and save the W&B report; returns its
    URL. Online only, UNTESTED HERE (no W&B server reachable from this machine)."""
    import wandb

    entity, project = report.entity, report.project
    run = wandb.init(entity=entity, project=project, group=group, job_type="report", name=f"report {group}",
                     settings=wandb.Settings(mode="online", x_disable_stats=True, save_code=False, console="off"))
    try:
        run.log({f"report/{k}": wandb.Image(os.path.join(out_dir, f"{k}.png")) for k in FIGURES})
    finally:
        run.finish()
    report.save()
    return report.url


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", help="the sweep (or job) dir; the report goes to SWEEP_DIR/report/")
    ap.add_argument("--from-wandb", metavar="SRC", help="read the records back from W&B instead of record.json")
    ap.add_argument("--out", help="report dir (default SWEEP_DIR/report)")
    ap.add_argument("--wandb-report", metavar="ENTITY/PROJECT",
                    help="also build the W&B report (its spec: report/wandb_report.json) and save it where a W&B API "
                         "key is configured (online; saving is untested here)")
    a = ap.parse_args(argv)
    recs = wandb_io.load_from(a.sweep_dir, a.from_wandb)
    if not recs:
        print(f"no records under {a.from_wandb or a.sweep_dir}", file=sys.stderr)
        return 1
    path = write(recs, a.out or os.path.join(a.sweep_dir, "report"), a.from_wandb or os.path.abspath(a.sweep_dir))
    print(f"report: {os.path.abspath(path)}")
    if a.wandb_report:
        return _wandb_report(a.wandb_report, recs, a.sweep_dir, os.path.dirname(path))
    return 0


def _wandb_report(entity_project: str, recs: list[dict], sweep_dir: str, out_dir: str) -> int:
    """Build the W&B report and write its spec; save it only where an API key is configured. Exit 1,
    saying so, when nothing was saved (the local report stands)."""
    parts = entity_project.strip("/").split("/")
    if len(parts) != 2 or not all(parts):
        print(f"--wandb-report {entity_project!r}: give ENTITY/PROJECT", file=sys.stderr)
        return 2
    group = (recs[0].get("wandb") or {}).get("group") or os.path.basename(os.path.abspath(sweep_dir))
    world = max(((r.get("measurement") or {}).get("world") or 0) for r in recs)
    report = build_wandb_report(parts[0], parts[1], group, world, f"train-ledger: {group}")
    spec = write_wandb_report_spec(report, out_dir)
    print(f"W&B report spec: {os.path.abspath(spec)}")
    if not wandb_api_key_configured():
        print("W&B report NOT saved: no W&B API key is configured (`wandb login`, or WANDB_API_KEY); "
              "nothing was sent. The spec above is what a save would send.", file=sys.stderr)
        return 1
    try:
        print(f"W&B report: {publish_wandb_report(report, group, out_dir)}")
    except Exception as e:  # the local report and the spec stand without it
        print(f"W&B report NOT saved: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
