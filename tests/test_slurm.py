"""Sweeps dispatched through a real Slurm on this machine (scripts/slurm.sh), with submitit.

    make slurm-up
    python launch.py -m framework=megatron,deepspeed,titan hydra/launcher=submitit_slurm cluster=local_slurm
    make slurm-down
"""
import json
import os
import subprocess

import pytest

import records
from analysis import reconcile
from tests.conftest import REPO, REPO_PATH, launch, launch_in_background

pytestmark = [pytest.mark.slurm, pytest.mark.real]


def slurm_conf() -> str:
    """The local Slurm's client config (conf/cluster/local_slurm.yaml's slurm_conf)."""
    import yaml

    return os.path.join(REPO, yaml.safe_load(open(os.path.join(REPO, "conf/cluster/local_slurm.yaml")))["slurm_conf"])


@pytest.fixture(scope="module")
def slurm():
    up = subprocess.run(["bash", "scripts/slurm.sh", "up"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr
    yield
    subprocess.run(["bash", "scripts/slurm.sh", "down"], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def timed_out(slurm, tmp_path_factory):
    """A DeepSpeed job with far too short a time limit, started before the sweep and left running beside it: it
    only has to outlive its limit, which Slurm rounds up to a minute (the `0:10` asked for becomes 00:01:00) and
    enforces within the 30 s slurmctld checks limits at, so it ends 60-90 s later. Submitted at nice 19
    (PropagatePrioProcess, scripts/slurm.sh), on the node's second pair of CPUs: its spinning ranks take what
    the sweep's jobs and the other tests leave. Yields (its sweep dir, the launch.py process; its output in slurm_timeout.log beside the dir)."""
    d = tmp_path_factory.mktemp("slurm_timeout")
    proc = launch_in_background("-m", "framework=deepspeed", "train.steps=5000", "hydra/launcher=submitit_slurm",
                                "cluster=local_slurm", "+cluster.additional_parameters.time=0:10",
                                f"hydra.sweep.dir={d}", log=str(d.parent / "slurm_timeout.log"), nice=19)
    yield d, proc
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def sweep(slurm, timed_out, tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm_sweep")
    p = launch("-m", "framework=megatron,deepspeed,titan", "hydra/launcher=submitit_slurm", "cluster=local_slurm",
               f"hydra.sweep.dir={d}", timeout=1800)
    assert p.returncode == 0, p.stderr[-4000:]
    return d, records.load(str(d)), p


def test_all_records_ok_from_two_task_jobs(sweep):
    _, recs, _ = sweep
    assert sorted(r["config"]["framework"]["name"] for r in recs) == ["deepspeed", "megatron", "titan"]
    for r in recs:
        assert r["status"] == "ok", r["error"]
        assert r["slurm"]["ntasks"] == 2 and r["slurm"]["JobState"] == "COMPLETED"
        assert [m["rank"] for m in r["measurement"]["ranks"]] == [0, 1]
        assert r["slurm"]["JobId"] and r["slurm"]["NodeList"]


def test_reconcile_exact_as_locally(sweep):
    _, recs, _ = sweep
    df = reconcile.table(recs)
    steady = df[df.phase == "steady"]
    assert len(steady) > 0 and set(steady["rank"]) == {0, 1}
    bad = steady[reconcile.off(steady)]  # states and collectives to the byte; peaks as the matrices
    assert bad.empty, bad.to_string()


def test_sbatch_got_one_task_per_rank_and_fake_gpus(sweep):
    d, _, _ = sweep
    scripts = [os.path.join(root, f) for root, _, fs in os.walk(d / ".submitit") for f in fs
               if f.endswith("_submission.sh")]
    assert scripts
    text = open(scripts[0]).read()
    assert "#SBATCH --ntasks-per-node=2" in text and "#SBATCH --gpus-per-node=2" in text
    assert "#SBATCH --partition=gpu" in text


def test_world_mismatch_rejected_before_sbatch(slurm, tmp_path):
    p = launch("-m", "framework=deepspeed", "layout.dp=4", "hydra/launcher=submitit_slurm", "cluster=local_slurm",
               f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = records.load(str(tmp_path))[0]
    assert rec["status"] == "invalid"
    assert "world size" in rec["error"] and "tasks_per_node" in rec["error"]
    assert not (tmp_path / ".submitit").exists() or not any((tmp_path / ".submitit").iterdir())


def test_scancel_one_job_then_resume(slurm, tmp_path):
    """scancel of job #0 while it runs: it is recorded with Slurm's state, the sweep goes on; the
    resubmitted sweep runs #0 again and skips #1 (its record untouched)."""
    import sys
    import time

    from analysis import status

    args = ["-m", "framework=deepspeed", "framework.zero_stage=1,2", "train.steps=2", "hydra/launcher=submitit_slurm",
            "cluster=local_slurm", f"hydra.sweep.dir={tmp_path}"]
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=REPO_PATH)
    proc = subprocess.Popen([sys.executable, "launch.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        job_id = None
        while time.monotonic() < deadline:
            job_id = records.read_manifest(str(tmp_path))["jobs"].get("0", {}).get("slurm_job_id")
            if job_id and status.table(str(tmp_path)).status[0] != "pending":
                break
            time.sleep(0.5)
        assert job_id, "job #0 was not submitted"
        assert status.table(str(tmp_path)).status[0] == "running"
        subprocess.run(["scancel", job_id], check=True, timeout=30, env=dict(os.environ, SLURM_CONF=slurm_conf()))
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    st = status.table(str(tmp_path))
    assert list(st.status) == ["cancelled", "ok"], st.to_string()
    assert st.slurm_state[0] == "CANCELLED" and st.slurm_job_id[0] == job_id
    mtime1 = os.path.getmtime(tmp_path / "1_deepspeed" / "record.json")

    p = launch(*args[:-1], f"hydra.sweep.dir={tmp_path}", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "#0 runs again (was cancelled" in p.stdout
    assert "#1 skipped: its record is ok" in p.stdout
    assert os.path.getmtime(tmp_path / "1_deepspeed" / "record.json") == mtime1
    st = status.table(str(tmp_path))
    assert list(st.status) == ["ok", "ok"] and st.slurm_job_id[0] != job_id


def test_too_short_time_limit_is_recorded_with_slurms_state(timed_out):
    # last in the module: its job has waited for its limit beside every test above
    d, proc = timed_out
    assert proc.wait(timeout=600) == 0, open(d.parent / "slurm_timeout.log").read()[-3000:]
    rec = json.load(open(d / "0_deepspeed" / "record.json"))
    assert rec["slurm"]["JobState"] == "TIMEOUT"
    assert rec["status"] == "timeout"
    assert "TIMEOUT" in rec["error"]
