"""torchtitan 0.3.0 MoE: its qwen3 MoE through its own Trainer with expert parallelism over
dp_shard, against the faithful ledger (ledger/faithful/titan/moe.py), real CPU/gloo runs.

One shared sweep (5 jobs, s=128, two steps): ep1 at world 2 (no expert parallelism: the experts in
the blocks' FSDP groups), ep2 at world 2 (efsdp 1: the experts unsharded by FSDP,
the EP group is the whole world, torchtitan's default group; no q/k norms), and with Qwen3's q/k norms
ep2 at world 4 (efsdp 2: the experts'
own FSDP all-gathers and reduce-scatters), ep4 at world 4, and ep2 at world 4 with
reshard_after_forward=never and micro-batch 2. Every state row and every collective count and fixed
byte row (first and steady steps) reconciles with abs_err 0; the routed all-to-all bytes lie in the
predicted range and sum over each EP group to the balanced prediction.
"""
from __future__ import annotations

import pytest

import records
from analysis import reconcile
from ledger.layout import ConfigError, validate
from ledger.model import preset
from tests.conftest import assert_every_row_reconciles, assert_jobs, assert_states_on_every_rank, layout_of, routed_rows_by_ep_group, run_sweeps

# activation checkpointing off: torchtitan's default (selective) is not modelled for MoE (refused)
COMMON = ("framework=titan", "model=tiny_moe", "train.steps=2", "framework.activation_checkpoint=none")
# the world-4 jobs with Qwen3's per-head q/k norms (model.qk_layernorm: torchtitan's qwen3 builds them),
# the world-2 one without (its attention's qk_norm off)
SWEEPS = (
    # ep1: the experts are the blocks' params like the rest (one FSDP group, one grad-norm reduce)
    ("w2", ("cluster.ranks=2", "layout={ep:2},{}")),
    ("w4", ("cluster.ranks=4", "model.qk_layernorm=true", "layout={ep:2},{ep:4}")),
    ("w4never", ("cluster.ranks=4", "model.qk_layernorm=true", "layout={ep:2,micro_batch_size:2}",
                 "framework.reshard_after_forward=never")),
)
EXPECTED = {("dp2", "default", 1), ("ep2·dp2", "default", 1), ("ep2·dp4", "default", 1), ("ep4·dp4", "default", 1), ("ep2·dp4", "never", 2)}


def _job(rec) -> tuple:
    return (records.layout_name(rec), rec["config"]["framework"]["reshard_after_forward"],
            rec["config"]["layout"]["micro_batch_size"])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return run_sweeps(tmp_path_factory.mktemp("titan_moe_sweep"), SWEEPS, COMMON)


@pytest.mark.real
def test_matrix_ran(sweep):
    assert_jobs(sweep, _job, EXPECTED)


@pytest.mark.real
def test_every_state_and_collective_row_reconciles(sweep):
    assert_states_on_every_rank(sweep)
    assert_every_row_reconciles(sweep["table"], sweep["ok"],
                                routed={"comm/ep/all_to_all/buffer_bytes", "comm/dp/all_to_all/buffer_bytes"})
    df = sweep["table"]
    assert df[reconcile.off(df)].empty, df[reconcile.off(df)].to_string()  # its peaks too
    assert df["bound_low"].notna().any()


@pytest.mark.real
def test_routed_all_to_all_sums_to_the_balanced_prediction_over_each_ep_group(sweep):
    """The sparse mesh (.., efsdp, ep) puts ep innermost: an EP group is the ranks of one rank // ep."""
    groups = list(routed_rows_by_ep_group(sweep))
    assert groups
    for job, step, members in groups:
        assert sum(r.measured for r in members) == sum(r.predicted for r in members), (job, step, members)


@pytest.mark.real
def test_experts_are_sharded_over_ep_then_efsdp(sweep):
    """Each rank's expert fp32 shards: 4 layers x 3 x 8 x 512 x 256 elements over ep x efsdp = world."""
    for rec in sweep["ok"]:
        p = records.predicted_ranks(rec["prediction"])(0)
        world = rec["measurement"]["world"]
        assert p["detail"]["params/expert fp32 shards (ep, then efsdp dim-0 padded)"] == 4 * 4 * 3 * 8 * 512 * 256 // world
        assert rec["measurement"]["ranks"][0]["steps"][-1]["state"]["params_bytes"] == p["params_bytes"]


@pytest.mark.parametrize("over,msg", [(dict(moe_layer_freq=2), "every layer MoE"),
                                      (dict(moe_shared_expert_hidden=256), "no shared experts")])
def test_refuses_a_shape_its_qwen3_is_not(over, msg):
    with pytest.raises(ConfigError, match=msg):
        validate(preset("tiny_moe", **over), layout_of(2, ep=2), "titan")


def test_ep_must_divide_dp_shard_and_tp_is_refused():
    m = preset("tiny_moe")
    with pytest.raises(ConfigError, match="tp=2"):
        validate(m, layout_of(4, tp=2, ep=2), "titan")
    with pytest.raises(ConfigError, match="ep=4 does not divide dp_shard=2"):
        validate(m, layout_of(2, ep=4), "titan")
