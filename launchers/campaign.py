"""Campaigns: a sweep rerun into the same hydra.sweep.dir resumes instead of redoing its jobs.

Before anything is dispatched, every job of the sweep is compared with the record its job dir
already holds (records.config_hash of the resolved config, stored in the record):
  - no record: the job runs;
  - a record for a different config: the whole sweep stops with an error naming the job and the
    keys that changed (never a silent overwrite of a finished job);
  - a record for the same config: `campaign.rerun` decides. failed (the default) runs again the
    jobs whose record is not ok or invalid (failed, timeout, cancelled, interrupted, unreadable);
    all runs every job; none runs only the jobs with no record.
A skipped job keeps its record and its W&B run (no second run is logged).

The sweep dir's campaign.json lists every job the launchers were given (number, job dir, overrides,
config hash, the Slurm job id once submitted): analysis.status reads it to tell pending jobs from
jobs that never existed.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass

from omegaconf import OmegaConf

import records

# a record in one of these states is final for rerun=failed
KEPT_BY_FAILED = ("ok", "invalid")


class CampaignError(RuntimeError):
    """A sweep that would overwrite finished jobs of another config."""


LOCK = ".sweep.lock"


class SweepBusy(RuntimeError):
    """Another sweep holds the sweep dir."""


@contextlib.contextmanager
def sweep_lock(sweep_dir: str):
    """Hold the sweep dir for this sweep's life: an exclusive flock on <sweep_dir>/.sweep.lock, which
    the kernel releases when the holder exits however it ends (kill -9 included). A second sweep into
    the same dir meanwhile raises SweepBusy naming the holder, before it decides or writes anything:
    two sweeps never number jobs into the same job dirs."""
    import fcntl

    os.makedirs(sweep_dir, exist_ok=True)
    path = os.path.join(sweep_dir, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise SweepBusy(f"{sweep_dir} is in use by another sweep ({holder}): wait for it to end, or "
                            "give this sweep another hydra.sweep.dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  .encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def in_use(prior: dict | None) -> str | None:
    """Why a job dir whose record is `prior` is in use by a live job on this host ("is running now (pid
    N)"), or None: a record of status running whose process is alive (not this one)."""
    if not prior or prior.get("status") != "running" or prior.get("host") != socket.gethostname():
        return None
    pid = prior.get("pid")
    if pid == os.getpid() or not records.process_alive(pid):
        return None
    return f"is running now (pid {pid})"


@dataclass
class Decision:
    num: int
    job_dir: str
    config_hash: str
    run: bool
    prior_status: str | None  # the record's status before this sweep, None without one
    why: str


def decide(num: int, cfg, job_dir: str) -> Decision:
    """Whether job `num` (its composed config, hydra removed) runs, from the record in job_dir."""
    from launchers.job import fill_mode_defaults

    cfg = cfg.copy()
    fill_mode_defaults(cfg)  # as run_job does before its record copies the config
    config = OmegaConf.to_container(cfg, resolve=True)
    h = records.config_hash(config)
    rerun = cfg.campaign.rerun if "campaign" in cfg else "failed"
    try:
        prior = records.read_if_any(job_dir)
    except records.UnreadableRecord as e:
        if rerun == "none":
            return Decision(num, job_dir, h, False, records.UNREADABLE, f"kept ({e}; campaign.rerun=none)")
        return Decision(num, job_dir, h, True, records.UNREADABLE, f"runs again: {e}")
    if prior is None:
        return Decision(num, job_dir, h, True, None, "new")
    st = prior.get("status")
    if not prior.get("config_hash") and not prior.get("config"):
        # a job Slurm ended before it wrote anything (launchers/slurm.py _record_killed): no result
        # to keep and no config to compare
        if rerun == "none":
            return Decision(num, job_dir, h, False, st, f"kept (was {st}; campaign.rerun=none)")
        return Decision(num, job_dir, h, True, st, f"runs again (was {st}, ended before it started; "
                                                   f"campaign.rerun={rerun})")
    old = prior.get("config_hash") or records.config_hash(prior.get("config") or {})
    if old != h:
        changed = records.config_diff(records.job_identity(prior.get("config") or {}), records.job_identity(config))
        raise CampaignError(f"job #{num} ({job_dir}) already holds a record of another config "
                            f"({'; '.join(changed[:6]) or 'config hash ' + old + ' -> ' + h}): "
                            "use a new hydra.sweep.dir, or remove that job dir to run it again")
    why = in_use(prior)
    if why:
        raise CampaignError(f"job #{num} ({job_dir}) {why}: wait for it, or stop that sweep first")
    if rerun == "all":
        return Decision(num, job_dir, h, True, st, f"runs again (was {st}; campaign.rerun=all)")
    if rerun == "none" or st in KEPT_BY_FAILED:
        return Decision(num, job_dir, h, False, st, f"skipped: its record is {st} for the same config "
                                                    f"(campaign.rerun={rerun})")
    return Decision(num, job_dir, h, True, st, f"runs again (was {st}; campaign.rerun=failed)")


def plan(sweep_dir: str, jobs) -> list[Decision]:
    """Decisions for [(num, cfg, job_dir, overrides, ...)], all checked before any job runs; writes the
    sweep's manifest. Raises CampaignError naming every job whose record is of another config."""
    out, errors = [], []
    for num, cfg, job_dir, *_ in jobs:
        try:
            out.append(decide(num, cfg, job_dir))
        except CampaignError as e:
            errors.append(str(e))
    if errors:
        raise CampaignError("\n".join(errors))
    if jobs:
        update_manifest(sweep_dir, {d.num: {"job_dir": os.path.abspath(d.job_dir), "overrides": list(ov),
                                            "config_hash": d.config_hash, "decision": "run" if d.run else "skip",
                                            "planned_at": time.time()}
                                    for d, (_, _, _, ov, *_) in zip(out, jobs)})
    return out


def update_manifest(sweep_dir: str, jobs: dict) -> None:
    """Merge {num: fields} into the sweep's campaign.json (a later sweep may extend it)."""
    os.makedirs(sweep_dir, exist_ok=True)
    m = records.read_manifest(sweep_dir)
    for num, fields in jobs.items():
        m["jobs"][str(num)] = {**m["jobs"].get(str(num), {}), **fields}
    records.write_json(os.path.join(sweep_dir, records.MANIFEST), m)
