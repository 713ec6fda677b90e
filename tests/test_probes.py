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


def test_phase_timer_splits_a_step_into_forward_backward_optimizer():
    """probes/phases.py on a step of known sleeps: the root's forward (20 ms), its backward (30 ms, a
    custom Function's) under a reentrant checkpoint whose recompute runs the forward again inside the
    backward (counted as backward, once: the checkpoint's nested run_backward is not counted twice),
    and a torch optimizer's step (10 ms)."""
    import time

    import torch
    from torch.utils.checkpoint import checkpoint

    from probes.phases import PhaseTimer

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(0.02)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.03)
            return g * 2

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return checkpoint(lambda y: Slow.apply(y * self.w), x, use_reentrant=True)

    root = Root()
    opt = torch.optim.SGD(root.parameters(), lr=0.1)
    h = opt.register_step_pre_hook(lambda o, a, k: time.sleep(0.01))
    timer = PhaseTimer()
    timer.watch([root])
    timer.start()
    t0 = time.perf_counter()
    root(torch.ones(4, requires_grad=True)).sum().backward()
    opt.step()
    ph = timer.stop(time.perf_counter() - t0)
    h.remove()
    timer.close()
    assert 0.02 <= ph["forward_s"] < 0.04
    assert 0.05 <= ph["backward_s"] < 0.08
    assert 0.01 <= ph["optimizer_s"] < 0.03 and ph["other_s"] >= 0.0
