"""Slurm dispatch through submitit: one Slurm task per rank, rank 0 writes the record.

`hydra/launcher=submitit_slurm` selects submitit's launcher; the `SlurmSetup` callback (conf/config.yaml)
then, before anything is submitted:
  - sizes the launcher from the cluster config (nodes, tasks_per_node = ranks per node, gpus, cpus,
    partition, account, qos, constraint, time, setup lines, extra sbatch options),
  - points the Slurm clients at cluster.slurm_conf (SLURM_CONF) when set,
  - swaps in `ValidatingSlurmLauncher` (hydra_plugins/train_ledger/launcher.py), which composes and validates every job first: an invalid one
    (including a world size that is not nodes x tasks_per_node) becomes an `invalid` record and is
    never sbatch'ed; and a job Slurm kills (time limit, preemption, node failure) becomes a record
    with Slurm's state instead of an exception that ends the sweep.
Inside the job every task runs launchers.worker for its own rank (rank and world from submitit's
JobEnvironment); rank 0 waits for the others' results and writes record.json.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)
SUBMITIT_SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
HYDRA_BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# submitit launcher parameter <- cluster config field
_SIZING = {"nodes": "nodes", "tasks_per_node": "ranks", "gpus_per_node": "gpus_per_node",
           "cpus_per_task": "cpus_per_task", "mem_gb": "mem_gb", "partition": "partition", "account": "account",
           "qos": "qos", "constraint": "constraint", "timeout_min": "time_min", "signal_delay_s": "signal_delay_s",
           "max_num_timeout": "max_num_timeout"}


class SlurmSetup(Callback):
    def on_multirun_start(self, config, **kwargs) -> None:
        # Hydra turns a callback's exception into a warning; a sweep sized wrongly must not be sent
        try:
            self._setup(config)
        except Exception as e:
            raise SystemExit(f"train-ledger: cannot set up Slurm dispatch: {type(e).__name__}: {e}") from e

    def _setup(self, config) -> None:
        hl = config.hydra.launcher
        if hl.get("_target_") == HYDRA_BASIC:  # local sweeps resume campaigns too (launchers/campaign.py)
            with read_write(hl):
                hl._target_ = "hydra_plugins.train_ledger.launcher.CampaignBasicLauncher"
            return
        if hl.get("_target_") != SUBMITIT_SLURM:
            return
        c = config.cluster
        if c.slurm_conf:
            os.environ["SLURM_CONF"] = os.path.join(REPO, c.slurm_conf)
        with read_write(hl), open_dict(hl):
            hl._target_ = "hydra_plugins.train_ledger.launcher.ValidatingSlurmLauncher"
            for launcher_key, cluster_key in _SIZING.items():
                hl[launcher_key] = c[cluster_key]
            hl.setup = list(c.setup) or None
            hl.additional_parameters = OmegaConf.to_container(c.additional_parameters)
            # one submitit folder per sweep: Slurm job ids restart after a state wipe
            hl.submitit_folder = "${hydra.sweep.dir}/.submitit/%j"


# Slurm job states in which the job has not ended yet
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


def slurm_state(job_id: str) -> dict:
    """JobState, RunTime, NodeList, ... of a job: scontrol while Slurm remembers it, else the jobcomp log."""
    try:
        p = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=20)
        if p.returncode == 0 and "JobState=" in p.stdout:
            return _kv(p.stdout)
    except (OSError, subprocess.TimeoutExpired):
        pass
    conf = os.environ.get("SLURM_CONF")
    if conf:
        comp = os.path.join(os.path.dirname(os.path.dirname(conf)), "log", "jobcomp.txt")
        if os.path.exists(comp):
            for line in reversed(open(comp).read().splitlines()):
                if line.startswith(f"JobId={job_id} "):
                    return _kv(line)
    return {"JobId": str(job_id), "JobState": "UNKNOWN"}


def _kv(line: str) -> dict:
    out = {}
    for tok in line.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
    return out


def _slurm_fields(state: dict) -> dict:
    keys = ("JobId", "JobState", "Reason", "RunTime", "TimeLimit", "NodeList", "ExitCode", "StartTime", "EndTime")
    return {k: state.get(k) for k in keys if k in state}


def final_state(job_id: str, wait_s: float = 15) -> dict:
    """Slurm's state once the job has left RUNNING / COMPLETING (or after wait_s)."""
    deadline = time.monotonic() + wait_s
    while True:
        st = slurm_state(job_id)
        if st.get("JobState") not in ACTIVE_STATES or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def _annotate(job_dir: str, job_id: str) -> None:
    """Add Slurm's view of a finished job to its record."""
    from records import write_json

    path = os.path.join(job_dir, "record.json")
    if os.path.exists(path):
        with open(path) as f:
            rec = json.load(f)
        rec["slurm"] = {**rec.get("slurm", {}), **_slurm_fields(final_state(job_id))}
        write_json(path, rec)


def _record_killed(job_dir: str, job_id: str, state: dict, err: Exception) -> None:
    from records import write_json

    os.makedirs(job_dir, exist_ok=True)
    path = os.path.join(job_dir, "record.json")
    rec = {}
    if os.path.exists(path):
        with open(path) as f:
            rec = json.load(f)
    s = state.get("JobState", "UNKNOWN")
    rec.update(status="failed" if s in ("COMPLETED", "UNKNOWN") else s.lower(), job_dir=os.path.abspath(job_dir),
               error=f"Slurm job {job_id} ended {s}: {type(err).__name__}: {str(err)[-1500:]}",
               slurm={**rec.get("slurm", {}), **_slurm_fields(state)})
    # what the job wrote before it was killed: its resolved config and its prediction
    for key, name in (("config", "job.json"), ("prediction", "prediction.json")):
        if rec.get(key) is None and os.path.exists(os.path.join(job_dir, name)):
            with open(os.path.join(job_dir, name)) as f:
                rec[key] = json.load(f)
        rec.setdefault(key, None)
    rec.setdefault("measurement", None)
    write_json(path, rec)


# -- inside a Slurm job ---------------------------------------------------------------------------

def task_env():
    """(rank, world, master_addr, port, job_id) when running as a task of a Slurm job, else None."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":  # set by submitit's sbatch script
        return None
    try:
        import submitit

        env = submitit.JobEnvironment()
        rank, world, job_id = env.global_rank, env.num_tasks, env.job_id
        host = env.hostnames[0]
    except Exception:
        return None
    base_id = str(job_id).split("_")[0]
    port = 20000 + int("".join(ch for ch in str(job_id) if ch.isdigit()) or 0) % 20000
    return rank, world, host, port, base_id


def slurm_ranks_runner(rank: int, world: int, master: str, port: int):
    """A launchers.job ranks_runner for one task of a Slurm job: runs this task's rank; rank 0 then
    waits for every rank's result file (shared filesystem)."""

    def run(job_dir: str, world_: int, timeout_s: int, device: str) -> list[dict]:
        from launchers.local import clear_results, log_tail, spawn_rank

        clear_results(job_dir, [rank])
        p = spawn_rank(job_dir, rank, world, master, port, int(os.environ.get("SLURM_LOCALID", "0")), device)
        timed_out = False
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also when the task is interrupted (scancel's SIGTERM): the rank does not outlive it
            if p.poll() is None:
                p.kill()
                p.wait()
        mine = {"rank": rank, "returncode": p.returncode, "log_tail": log_tail(job_dir, rank), "timed_out": timed_out}
        if rank != 0:
            return [mine]
        out = [mine]
        deadline = time.monotonic() + 120
        for r in range(1, world):
            path = os.path.join(job_dir, f"rank{r}.json")
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.5)
            out.append({"rank": r, "returncode": 0 if os.path.exists(path) else None, "log_tail": None})
        return out

    return run
