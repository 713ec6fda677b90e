"""DeepSpeed 0.19.8 with DeepSpeed-MoE: the faithful ledger (ledger/faithful/deepspeed/moe.py)
against real CPU/gloo runs of the tiny MoE Llama, deepspeed.moe.layer.MoE in every MoE layer.

One shared sweep (15 jobs, s=128 but the large vocabulary's at 64 and 32, two steps): ep2 at world 2 (the EP group is the DP ranks, edp 1: no
expert reduction on the wire) and at world 4 (edp 2: the expert partitions over it), ep4, ZeRO-1 and
ZeRO-2; small IPG buckets (200,000 elements: buckets mixing dense and expert gradients, the output
weight an extra-large parameter) with and without overlap_comm at two micro-batches; top-1 routing
with another capacity factor; every second layer MoE; a large vocabulary (the dense param group the
larger: its update, the first, holds grads_in_partition); activation checkpointing at ZeRO-1 and 2 (a
checkpointed MoE layer's recompute dispatches again: 6 all-to-alls a layer). Every state row and every collective row
(first and steady steps) on every rank reconciles with abs_err 0: DeepSpeed's capacity makes every
all-to-all the same size whatever the router decides; so does every peak row (peak.py's moments over
the param groups, the MoE layers' saves: activations.moe_saves), inside the probe's thread-timing range.
"""
from __future__ import annotations

import json
import shlex
import types

import pytest

import records
from ledger.faithful.deepspeed.rules import overlap_comm
from ledger.layout import ConfigError
from ledger.model import preset
from tests.conftest import (assert_every_row_reconciles, assert_jobs, assert_losses_finite, assert_states_on_every_rank, launch, layout_of,
                            run_sweeps)

COMMON = ("framework=deepspeed", "model=tiny_moe", "train.steps=2")
SWEEPS = (
    ("w2", ("cluster.ranks=2", "layout={ep:2}", "framework.zero_stage=1,2")),
    ("w4", ("cluster.ranks=4", "layout={ep:2},{ep:4}", "framework.zero_stage=2")),
    ("w4z1", ("cluster.ranks=4", "layout={ep:2}", "framework.zero_stage=1")),
    ("w4bucket", ("cluster.ranks=4", "layout={ep:2,global_batch_size:8}", "framework.zero_stage=1,2",
                  "framework.overlap_comm=false,true", "framework.reduce_bucket_size=200000")),
    # top-1 routing, capacity ceil(128 / 8 x 1.25) = 20 rows per expert
    ("w2top1", ("cluster.ranks=2", "layout={ep:2}", "framework.zero_stage=2", "model.moe_router_topk=1",
                "framework.capacity_factor=1.25")),
    ("w2freq", ("cluster.ranks=2", "layout={ep:2}", "framework.zero_stage=2", "model.moe_layer_freq=2")),
    # (short sequences: the output layer at this vocabulary is the matrix's costliest matmul on a slow bf16
    # path; ZeRO-1 at s = 64 peaks in the last micro-batch's log-softmax backward, in its first step in the dense
    # group's AdamW update, the larger group's, stepped first; ZeRO-2 at s = 32 there in both)
    ("w4vocab", ("cluster.ranks=4", "layout={ep:2,global_batch_size:8}", "framework.zero_stage=1",
                 "model.vocab=32768", "model.seq_len=64", "framework.reduce_bucket_size=200000")),
    ("w4vocab2", ("cluster.ranks=4", "layout={ep:2,global_batch_size:8}", "framework.zero_stage=2",
                  "model.vocab=32768", "model.seq_len=32", "framework.reduce_bucket_size=200000")),
    ("w2ac", ("cluster.ranks=2", "layout={ep:2}", "framework.zero_stage=1,2", "framework.activation_checkpointing=true")),
)


def _job(rec) -> tuple:
    c = rec["config"]
    fw, m = c["framework"], c["model"]
    # overlap_comm unset is DeepSpeed's own default (off below stage 3): the job is the same
    return (records.layout_name(rec), fw["zero_stage"], overlap_comm(types.SimpleNamespace(**fw)), fw["reduce_bucket_size"],
            m["moe_router_topk"], m["moe_layer_freq"], m["vocab"], bool(fw["activation_checkpointing"]))


BIG = 500_000_000
V = 1024
NO, AC = (V, False), (V, True)
EXPECTED = {("ep2·dp2", 1, False, BIG, 2, 1, *NO), ("ep2·dp2", 2, False, BIG, 2, 1, *NO),
            ("ep2·dp4", 2, False, BIG, 2, 1, *NO), ("ep4·dp4", 2, False, BIG, 2, 1, *NO),
            ("ep2·dp4", 1, False, BIG, 2, 1, *NO),
            *(("ep2·dp4", z, o, 200_000, 2, 1, *NO) for z in (1, 2) for o in (False, True)),
            ("ep2·dp2", 2, False, BIG, 1, 1, *NO), ("ep2·dp2", 2, False, BIG, 2, 2, *NO),
            *(("ep2·dp4", z, False, 200_000, 2, 1, 32768, False) for z in (1, 2)),
            *(("ep2·dp2", z, False, BIG, 2, 1, *AC) for z in (1, 2))}
# jobs whose peak is at a moment the ledger does not model: checked to stay what they are (a fix shows
# up here), never covered by a wider tolerance. None now: ZeRO-1 with activation checkpointing, which
# peaks in block 0's ffn_norm backward after its recompute, every gradient held, is modelled (peak.py
# _Step.ac)
PEAK_FINDINGS: dict = {}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return run_sweeps(tmp_path_factory.mktemp("deepspeed_moe_sweep"), SWEEPS, COMMON)


@pytest.mark.real
def test_matrix_ran(sweep):
    assert_jobs(sweep, _job, EXPECTED)


@pytest.mark.real
def test_every_state_and_collective_row_reconciles(sweep):
    assert_states_on_every_rank(sweep)
    assert_every_row_reconciles(sweep["table"], sweep["ok"])  # capacity: nothing follows the router
    df = sweep["table"]
    df = df[~df.quantity.str.startswith("peak")]  # test_every_peak_row_is_exact
    assert df[df.abs_err != 0].empty, df[df.abs_err != 0].to_string()


# where the matrix's ranks peak, by the predicted moment's `what` (each a moment of peak.py this
# matrix confirms): the epilogue's all-reduce copy and grads_in_partition's allocation, the first
# hook, an MoE layer's combine backward, ZeRO-1's ffn_norm backward with every gradient held, the
# last group's update and the first's (grads_in_partition alive), the backward's start
MOMENTS = ("epilogue: the IPG all-reduce of edp slices", "epilogue: grads_in_partition's allocation",
           "the first hook", "MoE combine", "block 0's ffn_norm backward", "param group 1", "param group 0",
           "_log_softmax_backward_data")


@pytest.mark.real
def test_every_peak_row_is_exact(sweep):
    """Every rank's peak rows, first and steady steps, to the byte: a total inside the probe's
    thread-timing range (compare.peak_gap; a gloo worker thread freeing the epilogue's copy late), each
    part off by at most those bytes, but the named findings (within 1%, not exact); and the matrix
    peaks at each of MOMENTS."""
    from analysis.compare import peak_gap

    df = sweep["table"]
    pk = df[df.quantity.str.startswith("peak")]
    steps = sum(len(r["steps"]) for rec in sweep["ok"] for r in rec["measurement"]["ranks"])
    assert (pk.quantity == "peak_bytes").sum() == steps
    found = {records.job_name(r) for r in sweep["ok"] if _job(r) in PEAK_FINDINGS}
    assert len(found) == len(PEAK_FINDINGS)
    if found:
        named = pk[pk.job.isin(found) & (pk.quantity == "peak_bytes")]
        assert (peak_gap(named).abs() <= 0.01).all() and (peak_gap(named) != 0).any(), named.to_string()
        pk = pk[~pk.job.isin(found)]
    tot = pk[pk.quantity == "peak_bytes"]
    assert (peak_gap(tot) == 0).all(), tot[peak_gap(tot) != 0].to_string()
    race = {(r.job, r.rank, r.step): r.race_bytes for r in tot.itertuples()}
    parts = pk[pk.quantity != "peak_bytes"]
    off = [r for r in parts.itertuples() if abs(r.abs_err) > race[(r.job, r.rank, r.step)]]
    assert not off, off
    seen = set()
    for rec in sweep["ok"]:
        ranks = records.predicted_ranks(rec["prediction"])
        for r in range(rec["measurement"]["world"]):
            p = ranks(r)["peak"]
            seen |= {m for m in MOMENTS for q in (p, p.get("first") or p) if m in q["what"]}
    assert seen == set(MOMENTS), set(MOMENTS) - seen


@pytest.mark.real
def test_expert_groups_are_named_and_buckets_mix_groups(sweep):
    """The EP all-to-alls, the experts' IPG all-reduces, grad-norm average and partition gathers over
    edp are measured under their own dims; with small buckets a bucket holds both groups' gradients
    (more all-reduce calls over dp and edp than with one bucket)."""
    df = sweep["table"]
    q = set(df[df.measured > 0].quantity)
    for dim_kind in ("ep/all_to_all", "edp/all_reduce", "edp/all_gather", "dp/all_reduce", "dp/all_gather"):
        assert f"comm/{dim_kind}/count" in q, dim_kind
    steady = df[(df.phase == "steady") & (df.quantity == "comm/edp/all_reduce/count")]
    by_bucket = {_job(r)[1:4]: int(steady[steady.job == records.job_name(r)].measured.iloc[0])
                 for r in sweep["ok"] if _job(r)[0] == "ep2·dp4" and _job(r)[4:] == (2, 1, *NO)}
    assert by_bucket[(2, False, 200_000)] > by_bucket[(2, False, BIG)], by_bucket


@pytest.mark.real
def test_expert_state_is_sharded_over_the_expert_data_parallel_group(sweep):
    def optim(layout):
        rec = next(r for r in sweep["ok"] if _job(r) == (layout, 2, False, BIG, 2, 1, *NO))
        p = records.predicted_ranks(rec["prediction"])(0)
        assert rec["measurement"]["ranks"][0]["steps"][-1]["state"]["optim_bytes"] == p["optim_bytes"]
        return p["detail"]["optim/expert group 1: fp32 partition (single_partition_of_fp32_groups)"]
    # 4 layers x 4 local experts x 3 x 256 x 512, over edp 1 and 2
    assert optim("ep2·dp2") == 4 * 4 * 4 * 3 * 256 * 512 == 2 * optim("ep2·dp4")


@pytest.mark.real
def test_losses_are_finite(sweep):
    assert_losses_finite(sweep)


# -- without runs --------------------------------------------------------------------------------------
def _lay(**kw):
    return layout_of(4, **kw)


def test_peak_by_hand():
    """One MoE layer's saves (activations.moe_saves) by hand, tiny_moe at s=128, top-2, ep2: C = 32 rows
    an expert; the gate's fp32 input and weight, softmax, ce, the two fp32 masks, four [S] scalars;
    the encode's index; w1's and w3's copies of each local expert's rows (ep x C) and its four
    [ep*C, f] saves; the combine's slots, routed rows and gates."""
    from ledger.faithful.deepspeed.activations import Dispatch, moe_saves

    m = preset("tiny_moe")
    S, E, C, h, f = 128, 8, 32, 256, 512
    got = moe_saves(m, 1, 2, Dispatch(2, C))
    assert got == {"moe gate": 4 * E * h + 4 * S * h + 4 * S * E + 4 * E + 2 * 4 * S * E + 4 * 4 * S,
                   "moe dispatch (encode)": 8 * (E * C + 1),
                   "moe experts": 2 * 2 * E * C * h + 4 * 2 * E * C * f,
                   "moe combine": 8 * 2 * S + 2 * 2 * S * h + 4 * 2 * S}
    # ep 1: the experts read views of the one dispatched buffer
    assert moe_saves(m, 1, 2, Dispatch(1, C))["moe experts"] == 2 * E * C * h + 4 * 2 * E * C * f


@pytest.mark.parametrize("fw,msg", [({"zero_stage": 3}, "Native DeepSpeed MoE is not supported with ZeRO Stage 3"),
                                    ({"drop_tokens": False}, "drop_tokens=false")])
def test_faithful_ledger_refuses_what_it_does_not_model(fw, msg):
    from omegaconf import OmegaConf

    from conf.schema import DeepSpeedConfig
    from ledger.faithful.deepspeed import moe as deepspeed_moe

    with pytest.raises(ConfigError, match=msg):
        deepspeed_moe.place(preset("tiny_moe"), _lay(ep=2), OmegaConf.structured(DeepSpeedConfig(**fw)))


def test_param_groups_are_split_as_deepspeed_splits_them():
    """split_params_into_different_moe_groups_for_optimizer: the dense group first (the gates in it), the
    experts after, cut greedily at 178,956,971 elements (Mixtral at ep 8: one expert's 176,160,768)."""
    from ledger.faithful.deepspeed import moe as D

    m = preset("tiny_moe")
    g = D.groups(m, 2)
    assert len(g) == 2 and sum(n for _, n in g[0]) == m.num_params() - 4 * 8 * 3 * 256 * 512 == 1_190_144
    assert sum(n for _, n in g[1]) == 4 * 4 * 3 * 256 * 512 and all("deepspeed_experts" in n for n, _ in g[1])
    big = D.groups(preset("mixtral_8x7b"), 8)
    assert len(big) == 1 + 32 and all(sum(n for _, n in grp) == 3 * 4096 * 14336 for grp in big[1:])
    # every parameter once in either order
    for reg in (True, False):
        assert sorted(D.order(m, 2, reg)) == sorted((gi, off, n) for gi, grp in enumerate(g)
                                                    for off, n in zip(_offsets(grp), (n for _, n in grp)))


def _offsets(grp):
    out, o = [], 0
    for _, n in grp:
        out.append(o)
        o += n
    return out


@pytest.mark.parametrize("k,cf,mc,want", [(2, 1.0, 4, 32), (1, 1.25, 4, 20), (2, 0.01, 4, 4), (2, 1.1, 0, 36)])
def test_capacity_is_deepspeeds(k, cf, mc, want):
    """moe/sharded_moe.py _capacity with top1gating's / top2gating's factor (x k) and min_capacity."""
    import torch

    from deepspeed.moe.sharded_moe import _capacity
    from ledger.faithful.deepspeed.moe import capacity

    m = preset("tiny_moe", moe_router_topk=k)
    lay = _lay(ep=2)
    got = capacity(m, lay, cf, mc)
    ds = int(_capacity(torch.zeros(128, 8), torch.tensor(cf * k), torch.tensor(mc)))
    assert got == ds == want


def test_dry_hands_train_ds_the_moe_arguments(tmp_path):
    p = launch("mode=dry", "framework=deepspeed", "framework.zero_stage=2", "model=tiny_moe", "layout.ep=2",
               "framework.capacity_factor=1.5", "cluster=local_gpu", f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    argv = shlex.split((tmp_path / "run.sh").read_text().splitlines()[-1])
    moe = json.loads(argv[argv.index("--moe") + 1])
    assert moe == {"ep_size": 2, "capacity_factor": 1.5, "min_capacity": 4, "drop_tokens": True, "moe_loss_coeff": 0.01}
    src = (tmp_path / "train_ds.py").read_text()
    assert "split_params_into_different_moe_groups_for_optimizer" in src and "deepspeed.moe.layer import MoE" in src
