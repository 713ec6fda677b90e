"""One rank of a real run: `python -m launchers.worker JOB_DIR` with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT in the environment (set by launchers.local or taken from Slurm).

Writes JOB_DIR/rank{R}.json: the probe session (per-step state bytes, collectives, loss, time)
or, when the rank crashed, the traceback.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback


def rank_env() -> tuple[int, int]:
    """Rank and world size from torchrun-style variables, else from Slurm's."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])


def run(job_dir: str) -> int:
    from conf.schema import load
    from ledger import frameworks
    from ledger.layout import resolve
    from probes.session import ProbeSession

    rank, world = rank_env()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", str(rank)))
    out_path = os.path.join(job_dir, f"rank{rank}.json")
    with open(os.path.join(job_dir, "job.json")) as f:
        cfg = load(json.load(f))
    lay = resolve(cfg.layout, world, cfg.framework.name)
    session = ProbeSession(lay.grid, rank, out_path, comm_steps=list(cfg.probe.comm_steps),
                           memory=cfg.probe.memory, comm=cfg.probe.comm,
                           cuda_profile_steps=list(cfg.probe.cuda_profile_steps), peak=cfg.probe.peak,
                           steps=cfg.train.steps, timeline_step=cfg.probe.timeline_step,
                           fake_world=cfg.cluster.device == "fake")
    try:
        if cfg.cluster.device == "cpu":
            from ledger.timing import cpu_gemm

            cpu_gemm.install()  # where this CPU has no bf16 GEMM path (ledger/timing/cpu_gemm.py says why)
        mod = importlib.import_module(frameworks.get(cfg.framework.name).launcher)
        extra = mod.run_rank(cfg, lay, session) or {}
        if cfg.cluster.device == "cpu" and cpu_gemm.hits():
            extra["cpu_gemm_hits"] = cpu_gemm.hits()
        session.dump({"status": "ok", **extra})
        return 0
    except BaseException as e:  # the record must say why, whatever happened
        session.dump({"status": "failed", "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-4000:]})
        traceback.print_exc()
        return 1


def _exit(rc: int) -> None:
    """Leave without interpreter teardown. The result is written; what is left are the destructors of
    the frameworks' threads and process groups, which on gloo sometimes abort ("terminate called
    without an active exception", exit -6) after a rank has finished its work."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


PARENT_ENV = "TRAIN_LEDGER_PARENT_PID"


def die_with_parent() -> None:
    """A rank started by launchers.local (PARENT_ENV: its launcher's pid) dies when its launcher does,
    even by SIGKILL (Linux prctl PR_SET_PDEATHSIG): no rank outlives its job and keeps a job dir in use.
    Checked once more after arming: a launcher already gone before the arming leaves no signal to come."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):
        os._exit(1)


if __name__ == "__main__":
    die_with_parent()
    _exit(run(sys.argv[1]))
