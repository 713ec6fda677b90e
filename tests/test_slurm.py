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
from tests.conftest import REPO, launch

pytestmark = [pytest.mark.slurm, pytest.mark.real]


@pytest.fixture(scope="module")
def slurm():
    up = subprocess.run(["bash", "scripts/slurm.sh", "up"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr
    yield
    subprocess.run(["bash", "scripts/slurm.sh", "down"], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def sweep(slurm, tmp_path_factory):
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
    bad = steady[steady.abs_err != 0]
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


def test_too_short_time_limit_is_recorded_with_slurms_state(slurm, tmp_path):
    # Slurm's --time accepts minutes:seconds; 0:10 is far less than the job needs
    p = launch("-m", "framework=deepspeed", "train.steps=5000", "hydra/launcher=submitit_slurm", "cluster=local_slurm",
               "+cluster.additional_parameters.time=0:10", f"hydra.sweep.dir={tmp_path}", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.load(open(tmp_path / "0_deepspeed" / "record.json"))
    assert rec["slurm"]["JobState"] == "TIMEOUT"
    assert rec["status"] == "timeout"
    assert "TIMEOUT" in rec["error"]
