"""Run a plan's ready sweep (sweep.yaml in the plan's job dir, written by `launch.py mode=plan`): each of its
runs is one `launch.py -m` into <out>/<i>_<framework>; then the reconcile table of each.

    python -m sweeps.plan PLAN_JOB_DIR/sweep.yaml [--out DIR] [--print] [OVERRIDE ...]

Extra overrides go to every run, replacing the file's of the same key: e.g. `cluster=my_slurm` for your
cluster (the file names plan.cluster's), `hydra/launcher=basic cluster=local_cpu` on this machine, or
`train.steps=5`. --print shows the commands and runs nothing.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def commands(sweep: dict, out: str, extra: list[str]) -> list[list[str]]:
    """One `launch.py -m` argv per run of the sweep file, each into its own sweep dir under out. An
    extra override replaces the file's of the same key (`cluster=my_slurm` the file's cluster, Hydra
    refusing a group given twice)."""
    replaced = {_key(o) for o in extra}
    return [[sys.executable, "launch.py", "-m", *(o for o in run["overrides"] if _key(o) not in replaced), *extra,
             f"hydra.sweep.dir={os.path.join(out, f'{i}_{run['framework']}')}"]
            for i, run in enumerate(sweep["runs"])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.plan", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_file")
    ap.add_argument("--out", default=None, help="default: multirun/plans/<name>-<time>")
    ap.add_argument("--print", action="store_true", help="print the commands, run nothing")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    with open(a.sweep_file) as f:
        sweep = yaml.safe_load(f)
    out = a.out or os.path.join("multirun", "plans", f"{sweep['name']}-{time.strftime('%Y%m%d-%H%M%S')}")
    rc = 0
    for cmd in commands(sweep, out, a.overrides):
        print(" ".join(shlex.quote(c) for c in cmd), flush=True)
        if not a.print:
            rc = max(rc, subprocess.call(cmd, cwd=REPO))
    if not a.print:
        print(f"reconcile: python -m analysis.reconcile {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
