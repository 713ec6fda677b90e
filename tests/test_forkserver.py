"""The fast path of launchers.forkserver against the reference it replaces: the same jobs with each
rank spawned as `python -m launchers.worker` (cluster.fork_ranks=false) and forked from a server
that imported the framework once must measure the same thing, rank by rank (states, storages,
collectives, losses, CPU redirects reached)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

import records
from launchers import forkserver
from tests.conftest import launch

# what differs between two runs of one job whatever starts its ranks: clocks, and the peak probe's
# moment-by-moment record (probes/peak.py), which depends on when gloo's worker threads finish an
# asynchronous collective (its Work holds the buffers until then) and when the cyclic garbage
# collector runs (`gc_runs`): seen as 8-byte and ~0.7 MB differences between two runs of one
# torchtitan job; the matrices compare the peak with the ledger. The live total at the last boundary
# (`live_bytes`, and `unnamed_bytes` = live - resident) is read while a gloo worker thread may still
# hold a finished collective's small buffers (a 4-byte free seen landing on either side of it)
CLOCKS = {"time_s", "phases", "comm_time", "peak", "timeline", "live_bytes", "unnamed_bytes"}


def _measured(rank: dict):
    if isinstance(rank, dict):
        return {k: _measured(v) for k, v in rank.items() if k not in CLOCKS}
    if isinstance(rank, list):
        return [_measured(v) for v in rank]
    return rank


@pytest.mark.real
def test_forked_ranks_measure_what_spawned_ranks_measure(tmp_path):
    p = launch("-m", "framework=megatron,deepspeed,titan", "cluster.fork_ranks=false,true", "layout.tp=1",
               "train.steps=2",  # the first step and a steady one
               "model.seq_len=32",  # what is compared is the ranks' start, not the step's compute
               f"hydra.sweep.dir={tmp_path}", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records.load(str(tmp_path))
    assert len(recs) == 6 and all(r["status"] == "ok" for r in recs), [(r["job_dir"], r.get("error")) for r in recs]
    by = {(r["config"]["framework"]["name"], r["config"]["cluster"]["fork_ranks"]): r for r in recs}
    for fw in ("megatron", "deepspeed", "titan"):
        spawned, forked = by[(fw, False)], by[(fw, True)]
        for rank in range(spawned["measurement"]["world"]):
            with open(os.path.join(spawned["job_dir"], f"rank{rank}.json")) as f:
                a = json.load(f)
            with open(os.path.join(forked["job_dir"], f"rank{rank}.json")) as f:
                b = json.load(f)
            assert a["steps"] and a["steps"][0]["comm"], (fw, rank)  # something was measured
            assert _measured(a) == _measured(b), (fw, rank)


def _job_a_worker_reads(tmp_path):
    """A DeepSpeed job dir with the job.json launchers.worker reads (a dry job's config)."""
    job = tmp_path / "job"
    job.mkdir()
    p = launch("mode=dry", "framework=deepspeed", f"hydra.run.dir={job}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(job / "job.json", "w") as f:
        json.dump(records.read(str(job / "record.json"))["config"], f)
    return job


@pytest.mark.real
def test_a_forked_rank_reports_its_kill_and_dies_with_its_client(tmp_path):
    """ForkedRank keeps Popen's meaning: kill() -> returncode -SIGKILL; a client that goes away
    takes its rank with it (the monitor kills it), so no rank outlives its job."""
    job = _job_a_worker_reads(tmp_path)  # the rank blocks in init (no peer), so it is still running
    from launchers.local import free_port, rank_env

    env = rank_env(0, 2, "127.0.0.1", free_port(), 0, "cpu")  # world 2, rank 1 never comes: rank 0 waits
    r = forkserver.fork_rank("deepspeed", "cpu", env, str(job), str(job / "rank0.log"))
    assert r.poll() is None
    r.kill()
    assert r.wait(timeout=30) == -signal.SIGKILL
    r2 = forkserver.fork_rank("deepspeed", "cpu", env, str(job), str(job / "rank0.log"))
    pid = r2.pid
    r2.close()  # the client is gone
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"rank {pid} outlived its client")


@pytest.mark.real
def test_a_spawned_rank_dies_with_its_launcher_even_by_sigkill(tmp_path):
    """cluster.fork_ranks=false (every CUDA job's path): a launcher killed with SIGKILL takes its
    `python -m launchers.worker` ranks with it (launchers/worker.py die_with_parent)."""
    import subprocess
    import sys

    job = _job_a_worker_reads(tmp_path)
    # a launcher that spawns rank 0 of a world of 2 (it waits in init for rank 1) and prints its pid
    code = ("import sys, time\nfrom launchers.local import free_port, spawn_rank\n"
            "p = spawn_rank(sys.argv[1], 0, 2, '127.0.0.1', free_port(), 0, 'cpu')\n"
            "print(p.pid, flush=True)\ntime.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code, str(job)], cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), stdout=subprocess.PIPE, text=True)
    rank_pid = int(launcher.stdout.readline())
    time.sleep(2)
    os.kill(rank_pid, 0)  # running
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(rank_pid, 0)
        except ProcessLookupError:
            break
        try:  # a zombie of an already dead rank counts as gone
            with open(f"/proc/{rank_pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"rank {rank_pid} outlived its launcher")
