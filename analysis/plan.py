"""The plan's picture: peak per rank vs estimated step time, one point per predicted layout.

    python -m analysis.plan JOB_DIR       # (re)draws JOB_DIR/plan.png from JOB_DIR/plan.json

Fitting layouts are filled, the too-big ones hollow; the line is the Pareto front of the fitting
ones (no other fitting layout is both smaller and faster). Peak is the predicted peak within a step
(resident state where a framework's ledger predicts none for the layout); the time is the planner's roofline estimate, not a measurement.
"""
from __future__ import annotations

import json
import os
import sys

COLORS = {"megatron": "tab:green", "deepspeed": "tab:blue", "titan": "tab:orange"}


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (time, peak) points no other point beats on both, by increasing time."""
    front, best = [], float("inf")
    for t, p in sorted(points):
        if p < best:
            front.append((t, p))
            best = p
    return front


def plot(rows: list[dict], path: str, budget_bytes: float | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False  # a model name is text, never math text
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for fw, color in COLORS.items():
        for fits, face in ((True, color), (False, "none")):
            pts = [(r["est_step_s"], r["peak_bytes"] / 1e9) for r in rows
                   if r["framework"] == fw and r["status"] != "refused" and r["fits"] == fits]
            if pts:
                ax.scatter(*zip(*pts), s=14, facecolors=face, edgecolors=color, linewidths=0.8,
                           label=f"{fw} ({'fits' if fits else 'too big'})")
    front = pareto([(r["est_step_s"], r["peak_bytes"] / 1e9) for r in rows if r["fits"]])
    if front:
        ax.step(*zip(*front), where="post", color="black", linewidth=1, label="Pareto front (fitting)")
    if budget_bytes:
        ax.axhline(budget_bytes / 1e9, color="red", linestyle="--", linewidth=0.8, label="memory budget")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    # plain tick labels: log axes' default 10^x labels go through mathtext, whose parser takes seconds to build
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("estimated step time, s (roofline estimate, not measured)")
    ax.set_ylabel("predicted peak per rank, GB")
    ax.legend(fontsize=7, loc="best")
    ax.set_title("plan: every predicted layout")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    job = argv[0]
    with open(os.path.join(job, "plan.json")) as f:
        rows = json.load(f)
    budget = None
    try:
        with open(os.path.join(job, "record.json")) as f:
            budget = json.load(f)["plan"]["hardware"]
        budget = budget["memory_fraction"] * budget["gpu_memory_bytes"]
    except (OSError, KeyError, TypeError, ValueError):
        pass
    print(plot(rows, os.path.join(job, "plan.png"), budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
