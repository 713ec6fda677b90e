"""A job that crashes or is killed is a `failed` record with the why; the sweep goes on."""
import pytest

import records
from tests.conftest import launch

pytestmark = pytest.mark.real


def test_killed_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    # job 0: its ranks are killed after 1 s (cluster.timeout_s), long before DeepSpeed has started: each rank
    # a process of its own that imports it (cluster.fork_ranks=false; a warm fork server's ranks can finish
    # a tiny job within the second)
    p = launch("-m", "framework=deepspeed", "cluster.fork_ranks=false", "cluster.timeout_s=1,600",
               f"hydra.sweep.dir={tmp_path}", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    killed, ok = records.load(str(tmp_path))
    assert killed["status"] == "timeout"
    assert killed["error"] == "timeout after 1 s (cluster.timeout_s)"
    assert all(r["status"] == "timeout" and r["log_tail"] is not None for r in killed["measurement"]["ranks"])
    assert killed["prediction"] is not None  # predicted before it ran
    assert ok["status"] == "ok" and ok["error"] is None


def test_single_timed_out_run_exits_nonzero(tmp_path):
    p = launch("framework=deepspeed", "cluster.fork_ranks=false", "cluster.timeout_s=1", f"hydra.run.dir={tmp_path}",
               timeout=300)
    assert p.returncode == 1
    assert "job timeout: timeout after 1 s" in p.stderr and records.load(str(tmp_path))[0]["status"] == "timeout"
