"""The probes on plain torch.distributed (4 gloo ranks): kinds, dims, bytes, counts, storages."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, REPO_PATH


@pytest.fixture(scope="module")
def probe_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    env = dict(os.environ, PYTHONPATH=REPO_PATH, OMP_NUM_THREADS="1")
    from launchers.local import free_port

    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_port", str(free_port()), "tests/probe_worker.py", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.load(open(out / f"rank{r}.json")) for r in range(4)]


def _comm(step):
    return {(c["dim"], c["kind"], c["dtype"]): (c["count"], c["buffer_bytes"]) for c in step["comm"]}


def test_collectives_by_dim_kind_bytes(probe_out):
    for rank in probe_out:
        assert rank["errors"] == []
        for step in rank["steps"]:
            assert _comm(step) == {
                ("tp", "all_reduce", "bf16"): (1, 20),
                ("dp", "all_gather", "fp32"): (2, 32 + 40),  # c10d + functional, full buffers
                ("dp", "reduce_scatter", "fp32"): (1, 32),
                ("tp", "send_recv", "fp32"): (2, 48),
                ("tp-dp", "all_reduce", "fp32"): (1, 8),
            }


def test_state_counts_each_storage_once(probe_out):
    st = probe_out[0]["steps"][-1]["state"]
    assert st["params_bytes"] == 2000  # one flat bf16 buffer of 1000, though two views and a re-listing
    assert st["grads_bytes"] == 60
    assert st["optim_bytes"] == 28
    assert st["resident_bytes"] == 2088


def test_steps_timed_and_ordered(probe_out):
    assert [s["step"] for s in probe_out[3]["steps"]] == [0, 1]
    assert all(s["time_s"] > 0 for s in probe_out[3]["steps"])
