"""Start a job's ranks as processes on this machine (gloo on CPU, or NCCL with one GPU each)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(job_dir: str, world: int, timeout_s: int, device: str = "cpu") -> list[dict]:
    """Run `world` ranks of launchers.worker; return per-rank {rank, returncode, log_tail}.

    When one rank fails the others are given a few seconds, then killed: they would otherwise
    wait in a collective until the timeout."""
    from launchers.job import clear_results

    clear_results(job_dir, range(world))
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = open(os.path.join(job_dir, f"rank{r}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "launchers.worker", job_dir], cwd=REPO, env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while True:
        rcs = [p.poll() for p, _ in procs]
        if all(rc is not None for rc in rcs):
            break
        if failed_at is None and any(rc not in (None, 0) for rc in rcs):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now - failed_at > 10):
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    out = []
    for r, (p, log) in enumerate(procs):
        log.close()
        with open(log.name, errors="replace") as f:
            tail = f.read()[-3000:]
        out.append({"rank": r, "returncode": p.returncode, "log_tail": tail})
    return out
