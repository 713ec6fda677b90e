"""Megatron Core 0.18.0 Mixture-of-Experts: the MoE shapes, layout.ep, the faithful ledger
(ledger/faithful/megatron/moe.py) against real CPU/gloo runs of the tiny MoE Llama, run.sh's MoE flags.

One shared sweep (28 jobs, two steps; s=32 but five at s=512, where the MoE layers' saves weigh in the
peak, one of them with selective recompute, one with full uniform recompute; full block recompute under
TP + SP with both dispatchers: a recomputed MoE layer dispatches again): ep2 (world 2: EP = the DP ranks, edp 1), ep2 with dp4
(world 4: edp 2, the expert buffer sharded over it), ep4, pp2·ep2, tp2·ep2 with SP, expert tensor
parallelism (tp2·ep2·etp2; tp2·etp2 at ep 1, the experts dense parameters split over TP); the alltoall
dispatcher (drop-less: all-to-all sizes follow the router) and the allgather one (Megatron's default:
fixed sizes); one capacity-padded alltoall job (every size fixed); the aux loss and the sequence aux
loss; every second layer MoE (dense and MoE layers over pp2); ep1 (the experts are dense parameters);
Qwen3's attention (kv_channels, q/k norms) in an MoE and a dense job; a shared expert. Every state row and every
collective count and exact byte row (first and steady steps) on every rank reconciles with abs_err 0;
the routed all-to-all bytes lie inside the predicted range and sum over each EP group to the balanced
prediction exactly.
"""
from __future__ import annotations

import argparse

import pandas as pd
import pytest

import records
from analysis import compare, reconcile
from ledger.layout import ConfigError, resolve
from ledger.model import preset
from ledger.placement import CommBuilder
from analysis.compare import measured_peak_where
from tests.conftest import (assert_every_row_reconciles, assert_jobs, assert_losses_finite, assert_megatron_redirects, assert_states_on_every_rank,
                            launch, layout_of, peak_evidence, routed_rows_by_ep_group, run_sweeps)

# the distributed optimizer unless a sweep says (w4ddp: plain DDP, Megatron-LM's default)
COMMON = ("framework=megatron", "model=tiny_moe", "model.seq_len=32", "train.steps=2", "framework.use_distributed_optimizer=true")
SWEEPS = (
    ("w2", ("cluster.ranks=2", "layout={ep:2}", "framework.moe_token_dispatcher_type=alltoall,allgather")),
    # capacity 1.0 with padding: every expert gets ceil(32*2/8) = 8 rows from every rank
    # the router in fp32 (moe_router_dtype): the probs travel in fp32
    ("w2fp32", ("cluster.ranks=2", "model.moe_router_dtype=fp32", "layout={ep:2}",
                "framework.moe_token_dispatcher_type=alltoall,allgather")),
    ("w2cap", ("cluster.ranks=2", "layout={ep:2}", "framework.moe_token_dispatcher_type=alltoall",
               "framework.moe_expert_capacity_factor=1.0", "framework.moe_pad_expert_input_to_capacity=true")),
    # ep = 1: the experts are dense parameters (tensor_parallel/layers.py allreduce), no dispatcher traffic
    ("w2ep1", ("cluster.ranks=2", "layout={}")),
    ("w4a2a", ("cluster.ranks=4", "framework.moe_token_dispatcher_type=alltoall",
               "layout={ep:2},{ep:4},{pp:2,ep:2},{tp:2,ep:2,sequence_parallel:true}")),
    # expert tensor parallelism: each expert's fc1 / fc2 split over etp, the allgather dispatcher over etp*ep
    ("w4ag", ("cluster.ranks=4", "layout={ep:2},{tp:2,ep:2,sequence_parallel:true},{tp:2,ep:2,etp:2,sequence_parallel:true}")),
    # ep = 1 under TP: the experts dense parameters split over etp = tp (Megatron-LM's default), with a
    # shared expert (registered after the routed ones: the dense buffer's order)
    ("w2etp", ("cluster.ranks=2", "layout={tp:2,etp:2,sequence_parallel:true}", "model.moe_shared_expert_hidden=256")),
    # the aux losses' all-reduce over TP (int64 tokens per expert; per sequence and expert for seq_aux_loss)
    ("w4aux", ("cluster.ranks=4", "layout={tp:2,ep:2,sequence_parallel:true,micro_batch_size:2}",
               "framework.moe_aux_loss_coeff=0.01", "framework.moe_router_load_balancing_type=seq_aux_loss")),
    # every second layer MoE, over two stages (the pattern is over global layers)
    ("w4freq", ("cluster.ranks=4", "model.moe_layer_freq=2", "framework.moe_token_dispatcher_type=alltoall",
                "layout={pp:2,ep:2}")),
    # Qwen3's attention: heads of kv_channels=64 (not 256/8) and per-head q/k norms, MoE with SP and dense
    # without (the q/k norm grads are all-reduced over TP with or without SP)
    ("w4qk", ("cluster.ranks=4", "model.kv_channels=64", "model.qk_layernorm=true",
              "layout={tp:2,ep:2,sequence_parallel:true}")),
    # a shared expert beside the routed ones (a dense TP-split MLP in each MoE layer)
    ("w4shared", ("cluster.ranks=4", "model.moe_shared_expert_hidden=256", "framework.moe_token_dispatcher_type=alltoall",
                  "layout={tp:2,ep:2,sequence_parallel:true}")),
    ("w2qkdense", ("cluster.ranks=2", "model=tiny", "model.kv_channels=64", "model.qk_layernorm=true", "layout={tp:2}")),
    # plain DDP (Megatron-LM's default): an optimizer per group, each its own grad norm (tp_ep_pp for the experts)
    ("w4ddp", ("cluster.ranks=4", "framework.use_distributed_optimizer=false", "framework.moe_token_dispatcher_type=alltoall",
               "layout={pp:2,ep:2},{tp:2,ep:2,sequence_parallel:true}")),
    # the peak where the activations weigh (s = 512): both dispatchers, and expert TP whose ranks with the
    # most routed rows peak at the experts' outputs' cat
    ("w2long", ("cluster.ranks=2", "model.seq_len=512", "layout={ep:2}",
                "framework.moe_token_dispatcher_type=allgather,alltoall")),
    ("w4long", ("cluster.ranks=4", "model.seq_len=512", "layout={tp:2,ep:2,etp:2,sequence_parallel:true}")),
    # selective recompute (core_attn): the MoE layers' saves as without it, the attention's the dense rule's
    ("w2sel", ("cluster.ranks=2", "model.seq_len=512", "layout={ep:2}", "framework.moe_token_dispatcher_type=alltoall",
               "framework.recompute_granularity=selective")),
    # full recompute: a checkpoint's MoE layers dispatch again in its backward (the forward's collectives
    # once more), and hold its input and the input's grad until their next forward (recompute_holding)
    ("w2full", ("cluster.ranks=2", "model.seq_len=512", "layout={ep:2}", "framework.moe_token_dispatcher_type=alltoall",
                "framework.recompute_granularity=full", "framework.recompute_method=uniform",
                "framework.recompute_num_layers=1")),
    ("w4block", ("cluster.ranks=4", "layout={tp:2,ep:2,sequence_parallel:true}",
                 "framework.moe_token_dispatcher_type=allgather,alltoall", "framework.recompute_granularity=full",
                 "framework.recompute_method=block", "framework.recompute_num_layers=2")),
)


def _job(rec) -> tuple:
    c = rec["config"]
    fw, m = c["framework"], c["model"]
    return (records.layout_name(rec), m["num_experts"], fw["moe_token_dispatcher_type"],
            fw["moe_expert_capacity_factor"], fw["moe_aux_loss_coeff"] > 0, m["moe_layer_freq"],
            m["qk_layernorm"] or ("shared" if m["moe_shared_expert_hidden"] else False), m["moe_router_dtype"],
            fw["use_distributed_optimizer"], m["seq_len"], fw["recompute_granularity"])


EXPECTED_S32 = {("ep2·dp2", 8, "alltoall", None, False, 1, False, None, True), ("ep2·dp2", 8, "allgather", None, False, 1, False, None, True),
            ("ep2·dp2", 8, "alltoall", 1.0, False, 1, False, None, True), ("dp2", 8, "allgather", None, False, 1, False, None, True),
            ("ep2·dp4", 8, "alltoall", None, False, 1, False, None, True), ("ep4·dp4", 8, "alltoall", None, False, 1, False, None, True),
            ("pp2·ep2·dp2", 8, "alltoall", None, False, 1, False, None, True),
            ("tp2·ep2·dp2·sp", 8, "alltoall", None, False, 1, False, None, True),
            ("ep2·dp4", 8, "allgather", None, False, 1, False, None, True), ("tp2·ep2·dp2·sp", 8, "allgather", None, False, 1, False, None, True),
            ("tp2·ep2·etp2·dp2·sp", 8, "allgather", None, False, 1, False, None, True),
            ("tp2·etp2·sp", 8, "allgather", None, False, 1, "shared", None, True),
            ("tp2·ep2·dp2·sp", 8, "allgather", None, True, 1, False, None, True),
            ("pp2·ep2·dp2", 8, "alltoall", None, False, 2, False, None, True),
            ("tp2·ep2·dp2·sp", 8, "allgather", None, False, 1, True, None, True), ("tp2", 0, "allgather", None, False, 1, True, None, True),
            ("tp2·ep2·dp2·sp", 8, "alltoall", None, False, 1, "shared", None, True),
            ("ep2·dp2", 8, "alltoall", None, False, 1, False, "fp32", True), ("ep2·dp2", 8, "allgather", None, False, 1, False, "fp32", True),
            ("pp2·ep2·dp2", 8, "alltoall", None, False, 1, False, None, False),
            ("tp2·ep2·dp2·sp", 8, "alltoall", None, False, 1, False, None, False)}
EXPECTED = {(*j, 32, None) for j in EXPECTED_S32} | {
    ("ep2·dp2", 8, "allgather", None, False, 1, False, None, True, 512, None),
    ("ep2·dp2", 8, "alltoall", None, False, 1, False, None, True, 512, None),
    ("tp2·ep2·etp2·dp2·sp", 8, "allgather", None, False, 1, False, None, True, 512, None),
    ("ep2·dp2", 8, "alltoall", None, False, 1, False, None, True, 512, "selective"),
    ("ep2·dp2", 8, "alltoall", None, False, 1, False, None, True, 512, "full"),
    *(("tp2·ep2·dp2·sp", 8, d, None, False, 1, False, None, True, 32, "full") for d in ("allgather", "alltoall"))}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return run_sweeps(tmp_path_factory.mktemp("megatron_moe_sweep"), SWEEPS, COMMON)


# -- real runs -----------------------------------------------------------------------------------
@pytest.mark.real
def test_matrix_ran(sweep):
    assert_jobs(sweep, _job, EXPECTED)


@pytest.mark.real
def test_every_state_and_collective_row_reconciles(sweep):
    """States, counts and fixed bytes to the byte on every rank, first and steady steps; the routed
    all-to-all bytes inside their predicted range (reconcile.off)."""
    assert_states_on_every_rank(sweep)
    assert_every_row_reconciles(sweep["table"], sweep["ok"], routed={"comm/ep/all_to_all/buffer_bytes"})
    df = sweep["table"]
    rows = df[~df.quantity.str.startswith("peak")]
    routed = rows["bound_low"].notna()
    # the drop-less alltoall jobs have routed rows, nothing else does
    assert set(rows[routed].quantity) == {"comm/ep/all_to_all/buffer_bytes"}
    assert {tuple(x) for x in rows[routed][["job"]].drop_duplicates().values} == {
        (records.job_name(r),) for r in sweep["ok"] if _job(r)[2:4] == ("alltoall", None) and "ep" in _job(r)[0]}


@pytest.mark.real
def test_every_steady_peak_inside_its_routed_bound(sweep):
    """The MoE peak (moe_activations): each steady peak_bytes row inside the range the ledger predicts
    from no rows to the most rows routed to the rank's experts (reconcile.off: each end within 1%), on
    every rank of every job whose layer saves it models; the others (capacity padding, the router in
    fp32, the sequence aux loss) predict no peak and say so. At s = 512 the measured peaks are at the
    forward moments the ledger names."""
    df = sweep["table"]
    pk = df[(df.quantity == "peak_bytes") & (df.phase == "steady")]
    for rec in sweep["ok"]:
        job = _job(rec)
        rows = pk[pk.job == records.job_name(rec)]
        modelled = job[3] is None and job[7] is None and rec["config"]["framework"]["moe_router_load_balancing_type"] != "seq_aux_loss"
        if job[1] == 0:
            continue  # the dense job: tests/test_megatron.py's rules
        assert (len(rows) == rec["measurement"]["world"]) if modelled else rows.empty, (job, len(rows))
        if not modelled:
            assert any("the peak within a step is not modelled" in n for n in rec["prediction"]["notes"]), job
    bad = pk[reconcile.off(pk)]
    assert bad.empty, peak_evidence(sweep["ok"], bad)
    moe = pk[pk.framework == "megatron"]
    moe = moe[~moe.job.str.startswith("w2qkdense")]
    assert moe.bound_low.notna().all() and (moe.bound_low <= moe.predicted).all() and (moe.predicted <= moe.bound_high).all()
    long = [r for r in sweep["ok"] if _job(r)[-2:] == (512, None)]
    assert len(long) == 3
    for rec in long:
        for m in rec["measurement"]["ranks"]:
            where = measured_peak_where(m["steps"][-1]["peak"])
            assert where["phase"] == "forward" and (where["module"] or "").endswith(
                ("scale_mask_softmax", "mlp.experts", "module.module")), where


@pytest.mark.real
def test_routed_all_to_all_sums_to_the_balanced_prediction_over_each_ep_group(sweep):
    """What a rank's experts receive follows the router, but an EP group sends what it receives: the
    measured bytes of each EP group's ranks add up to the predicted (balanced) bytes exactly."""
    groups = list(routed_rows_by_ep_group(sweep))
    assert groups, "no routed all-to-all rows"
    moved = 0
    for job, step, members in groups:
        assert sum(r.measured for r in members) == sum(r.predicted for r in members), (job, step, members)
        moved += sum(r.measured != r.predicted for r in members)
    assert moved, "every routed row was balanced: the router's split never showed"


@pytest.mark.real
def test_expert_groups_are_named_and_every_kind_measured(sweep):
    df = sweep["table"]
    q = set(df[df.measured > 0].quantity)
    for dim_kind in ("ep/all_to_all", "etp-ep/all_gather", "etp-ep/reduce_scatter", "edp/reduce_scatter",
                     "edp/all_gather", "dp/reduce_scatter", "tp/all_reduce", "pp/send_recv"):
        assert f"comm/{dim_kind}/count" in q, dim_kind


@pytest.mark.real
def test_expert_state_is_sharded_over_the_expert_data_parallel_group(sweep):
    """ep2 at world 2 (edp 1) keeps every expert's master and Adam state; ep2 at world 4 (edp 2) half."""
    def master(layout):  # the fp32 master shard of the experts, predicted and measured on rank 0
        rec = next(r for r in sweep["ok"] if _job(r) == (layout, 8, "alltoall", None, False, 1, False, None, True, 32, None))
        p = records.predicted_ranks(rec["prediction"])(0)
        assert rec["measurement"]["ranks"][0]["steps"][-1]["state"]["optim_bytes"] == p["optim_bytes"]
        return p["detail"]["optim/expert fp32 master params"]
    # 4 layers x 4 local experts x 3 x 256 x 512 elements, a multiple of lcm(2, 128): no padding
    assert master("ep2·dp2") == 4 * 4 * 4 * 3 * 256 * 512 == 2 * master("ep2·dp4")


@pytest.mark.real
def test_cpu_redirects_of_moe_are_all_reached_and_declared(sweep):
    assert_megatron_redirects(sweep, "moe", ("dense", "moe"))


@pytest.mark.real
def test_losses_are_finite(sweep):
    assert_losses_finite(sweep)


# -- shapes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,total,active", [
    # Mixtral-8x7B's published 46.7B (the safetensors' 46,702,792,704) and 12.9B active;
    # Qwen3-30B-A3B's 30.5B (30,532,122,624) and 3.3B active
    ("mixtral_8x7b", 46_702_792_704, 12_879_925_248), ("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704)])
def test_moe_presets_have_the_published_parameter_counts(name, total, active):
    m = preset(name)
    assert m.num_params() == total == sum(_numel(s) for _, s in m.params())
    assert m.active_params() == active


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("over", [dict(moe_layer_freq=2), dict(moe_layer_freq=3, moe_shared_expert_hidden=128),
                                  dict(kv_channels=64, qk_layernorm=True), dict(num_experts=0)])
def test_num_params_counts_every_listed_parameter(over):
    m = preset("tiny_moe", **over) if over.get("num_experts", 1) else preset("tiny")
    assert m.num_params() == sum(_numel(s) for _, s in m.params())


def test_megatron_ledger_counts_every_parameter_once():
    """The dense and expert lists of every stage and EP rank add up to the model (tp 1; the experts'
    etp shards, etp 1 and 2)."""
    from ledger.faithful.megatron.moe import stage_params

    m = preset("tiny_moe", moe_layer_freq=2, layers=6)
    for pp, etp in ((1, 1), (2, 1), (3, 1), (1, 2), (2, 2)):
        n = 0
        for st in range(pp):
            dense, expert = stage_params(m, 1, pp, 2, etp, st, (None, None, False, False))
            n += sum(k for _, k in dense) + 2 * etp * sum(k for _, k in expert)  # two EP ranks' experts, etp shards
        assert n == m.num_params(), (pp, etp)


# -- validation ----------------------------------------------------------------------------------
def _lay(**kw):
    return layout_of(4, **kw)


@pytest.mark.parametrize("model,fw,lay,msg", [
    ("tiny", "megatron", dict(ep=2), "layout.ep=2: expert parallelism needs an MoE model"),
    ("tiny_moe", "titan", dict(ep=2, tp=2), "titan: model.num_experts=8: tp=2"),
    ("tiny_moe", "titan", dict(ep=2), None),
    ("tiny_moe", "deepspeed", dict(ep=2), None),
    ("tiny_moe", "megatron", dict(ep=3, dp=3), "ep=3 does not divide model.num_experts=8"),
    ("tiny", "titan", dict(), None)])
def test_layout_refuses_ep_where_no_ledger_models_it(model, fw, lay, msg):
    from ledger.layout import validate

    if msg is None:
        validate(preset(model), _lay(**lay), fw)
        return
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        validate(preset(model), _lay(**lay), fw)


@pytest.mark.parametrize("lay,fw,msg", [
    (dict(ep=2, etp=2), {"moe_token_dispatcher_type": "alltoall"},
     "layout.etp=2 with framework.moe_token_dispatcher_type=alltoall"),
    (dict(ep=2), {"moe_grouped_gemm": True}, "moe_grouped_gemm=true needs TransformerEngine"),
    (dict(ep=2), {"moe_expert_capacity_factor": 1.0}, "without moe_pad_expert_input_to_capacity"),
    (dict(ep=2, pp=2, vp=2, global_batch_size=8), {}, "layout.vp=2: the interleaved schedule")])
def test_faithful_moe_ledger_refuses_what_it_does_not_model(lay, fw, msg):
    from conf.schema import MegatronConfig
    from ledger.faithful.megatron import moe as megatron_moe

    with pytest.raises(ConfigError, match=msg):
        megatron_moe.place(preset("tiny_moe"), _lay(**lay), MegatronConfig(**fw))


def test_ep1_under_tp_is_predicted_with_etp_tp_and_refused_to_run_otherwise():
    """At ep = 1 the experts are dense parameters reduced over DP alone: with etp < tp the TP ranks'
    replicas drift apart. The prediction is Megatron-LM's default layout (etp = tp), said in a note;
    a run or run.sh of the other is refused naming layout.etp (launchers/job.py asks dispatch_error)."""
    from conf.schema import MegatronConfig
    from ledger.faithful.megatron import moe as megatron_moe

    model, fw = preset("tiny_moe"), MegatronConfig()
    asked = megatron_moe.place(model, _lay(tp=2, dp=2, sequence_parallel=True), fw)
    default = megatron_moe.place(model, _lay(tp=2, dp=2, etp=2, sequence_parallel=True), fw)
    assert any("predicted with etp=2" in n for n in asked.notes)
    a, d = asked.rank_state(0), default.rank_state(0)
    assert (a.detail, a.comm) == (d.detail, d.comm)
    assert "needs layout.etp=2 (is 1)" in megatron_moe.dispatch_error(model, _lay(tp=2, dp=2, sequence_parallel=True))
    assert megatron_moe.dispatch_error(model, _lay(tp=2, dp=2, etp=2, sequence_parallel=True)) is None
    # experts split over etp: an expert's fc1 and fc2 halve, the rest of the layer does not
    whole, split = (sum(n for _, n in megatron_moe._moe_layer(model, 2, 1, etp)[1]) for etp in (1, 2))
    assert split * 2 == whole


def test_tp_without_sp_is_predicted_with_sp_and_refused_to_run(tmp_path):
    """Megatron's MoELayer.forward raises in training with tp > 1 and no SP: mode=predict says so and
    predicts the SP layout; mode=dry (and run) exit 2 naming the field, before anything is written."""
    p = launch("mode=predict", "model=mixtral_8x7b", "framework=megatron", "layout.tp=2", "layout.ep=4", "layout.pp=2",
               "layout.dp=8", f"hydra.run.dir={tmp_path / 'p'}", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "of which dense / routed experts: params 803,479,552 / 11,274,289,152" in p.stdout, p.stdout[:3000]
    assert "predicted with sequence_parallel=true" in " ".join(p.stdout.split())  # (rich wraps notes)
    d = launch("mode=dry", "model=mixtral_8x7b", "framework=megatron", "layout.tp=2", "layout.ep=4", "layout.pp=2",
               "layout.dp=8", "cluster=local_gpu", f"hydra.run.dir={tmp_path / 'd'}", timeout=300)
    assert d.returncode == 2 and "needs layout.sequence_parallel=true" in d.stdout + d.stderr
    assert not (tmp_path / "d" / "run.sh").exists()


def test_routed_rows_range_by_hand():
    """ledger.model.routed_rows, the one rule every MoE peak's bound reads: 10 tokens, top-2 of 8 experts."""
    from ledger.model import routed_rows

    assert routed_rows(10, 2, 8, 2) == (5, 0, 20)  # 2 local: 20 x 2 / 8; the other 6 take every choice; each once
    assert routed_rows(10, 2, 8, 7) == (17, 10, 20)  # 7 local: one other expert takes at most one choice a token
    assert routed_rows(10, 2, 8, 8) == (20, 20, 20)  # every expert local (ep 1): every row


def test_mixtral_states_per_rank_by_hand():
    """Mixtral 8x7B, tp2·ep4·pp2·dp8 with SP, the last stage's heaviest rank, from the shapes alone: 16
    layers of 2 local experts each [2*14336, 4096] + [4096, 14336] (bf16 params, fp32 grads), padded to
    lcm(edp 4, 128); the dense part (attention / tp, norms, routers, final norm, output layer / tp)."""
    from conf.schema import MegatronConfig
    from ledger.parallel import predict

    m = preset("mixtral_8x7b")
    lay = resolve(dict(tp=2, pp=2, dp=8, dp_replicate=1, cp=1, ep=4, etp=1, vp=1, sequence_parallel=True,
                       micro_batch_size=1, global_batch_size=-1))
    pl = predict(m, lay, MegatronConfig(use_distributed_optimizer=True))
    expert = 16 * 2 * 3 * 4096 * 14336  # every param 64-aligned already; one bucket, padded to 128
    s = pl.rank_state(16)  # stage 1, dp 0, edp 0
    d = s.detail
    assert d["params/expert bf16 param buffer (param_data)"] == 2 * expert
    assert d["grads/expert fp32 grad buffer (grad_data)"] == 4 * expert
    assert d["optim/expert fp32 master params"] == 4 * expert // 4  # edp = 32 / (ep 4 * pp 2) = 4
    # every dense size a multiple of 64 (no alignment padding) and their sum of lcm(dp 8, 128)
    attn = (4096 * 4096 + 2 * 1024 * 4096 + 4096 * 4096) // 2 + 2 * 4096 + 8 * 4096  # + router, norms
    dense = 16 * attn + 4096 + 32000 * 4096 // 2
    assert d["params/bf16 param buffer (param_data)"] == 2 * dense == 803_479_552


# -- dry: run.sh ---------------------------------------------------------------------------------------
@pytest.mark.real  # runs the framework's own code (its argument parser, or torch.distributed in a process)
def test_dry_writes_megatron_lm_moe_flags_its_parser_accepts(tmp_path):
    p = launch("mode=dry", "framework=megatron", "model=qwen3_30b_a3b", "layout.tp=2", "layout.ep=8", "layout.pp=2",
               "layout.dp=8", "layout.sequence_parallel=true", "framework.moe_token_dispatcher_type=alltoall",
               "framework.moe_aux_loss_coeff=0.001", "cluster=local_gpu", f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    from megatron.training.arguments import add_megatron_arguments

    from tests.conftest import run_sh_flags as _run_sh_flags

    flags = _run_sh_flags(str(tmp_path / "run.sh"))
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(flags)
    m = preset("qwen3_30b_a3b")
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (128, 8, 768)
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (8, 1)
    assert args.moe_token_dispatcher_type == "alltoall" and args.moe_layer_freq == 1
    assert args.moe_router_load_balancing_type == ["aux_loss"] and args.moe_aux_loss_coeff == [0.001]
    assert (args.kv_channels, args.qk_layernorm) == (m.kv_channels, True)
    assert args.sequence_parallel and not args.moe_grouped_gemm


# -- textbook ------------------------------------------------------------------------------------
def test_textbook_splits_experts_by_ep_and_counts_the_all_to_all():
    from conf.schema import MegatronConfig
    from ledger.parallel import predict

    m = preset("tiny_moe")
    lay = resolve(dict(tp=1, pp=1, dp=4, dp_replicate=1, cp=1, ep=4, etp=1, vp=1, sequence_parallel=False,
                       micro_batch_size=1, global_batch_size=-1))
    s = predict(m, lay, MegatronConfig(), mode="textbook").rank_state(0)
    experts = 4 * 8 * 3 * 256 * 512
    assert s.params_bytes == 2 * ((m.num_params() - experts) + experts // 4)
    a2a = next(c for c in s.comm if c.kind == "all_to_all")
    # 2 x topk x tokens x hidden x 2 bytes each way, forward and backward: 4 calls per layer
    assert (a2a.dim, a2a.count, a2a.buffer_bytes) == ("ep", 4 * 4, 4 * 4 * 2 * 128 * 256 * 2)


# -- the reconcile's ranges ------------------------------------------------------------------------
def test_routed_records_carry_their_range_and_the_reconcile_judges_by_it():
    cb = CommBuilder()
    cb.add("ep", "all_to_all", 100, 2, "bf16", count=2)
    cb.add_routed("ep", "all_to_all", "bf16", 2, "x", [(50, 2, -50, 30)])
    c, = cb.build()
    assert (c.count, c.buffer_bytes, c.buffer_range) == (4, 300, (200, 360))
    p = {"ranks": [[0, 0]], "comm": [c.to_dict()], **{q: 0 for q in compare.STATE_Q}}
    rec = {"config": {"framework": {"name": "megatron"}, "layout": {}}, "job_dir": "j",
           "prediction": {"rank_classes": [p], "layout": {}},
           "measurement": {"ranks": [{"rank": 0, "status": "ok", "steps": [
               {"step": s, "comm": [{"dim": "ep", "kind": "all_to_all", "dtype": "bf16", "count": 4,
                                     "buffer_bytes": b}]} for s, b in ((0, 360), (1, 361))]}]}}
    df = pd.DataFrame(compare.rows(rec), columns=compare.COLUMNS)
    byte_rows = df[df.quantity.str.endswith("buffer_bytes")]
    assert list(byte_rows.bound_low) == [200, 200] and list(reconcile.off(byte_rows)) == [False, True]
    assert not reconcile.off(df[df.quantity.str.endswith("count")]).any()


# -- the planner ------------------------------------------------------------------------------------
def test_planner_enumerates_expert_parallelism_for_megatron_moe():
    """Mixtral on 64 GPUs: ep among the divisors of 8 experts that divide a stage's ranks; tp > 1 only
    with SP (the non-SP layouts refused with Megatron's reason); the fitting rows' resident state is the
    ledger's for that layout; the step-time estimate's FLOPs count a token's active parameters."""
    from dataclasses import asdict

    from conf.schema import MegatronConfig
    from ledger.plan import Hardware, Space, expert_degrees, search, step_flops

    m = preset("mixtral_8x7b")
    assert expert_degrees(m, "megatron", 8) == [1, 2, 4, 8] and expert_degrees(m, "megatron", 12) == [1, 2, 4]
    assert expert_degrees(m, "titan", 8) == [1, 2, 4, 8] and expert_degrees(preset("tiny"), "megatron", 8) == [1]
    hw = Hardware(gpus=64, gpus_per_node=8, gpu_memory_bytes=80e9, memory_fraction=0.9, peak_tflops=989.0, efficiency=0.4,
                  nvlink_gbps=3600.0, network_gbps=400.0)
    plan = search(m, hw, Space(global_batch_size=256, micro_batch_sizes=(1,), vps=(1,), max_cp=1),
                  {"megatron": asdict(MegatronConfig())})
    fit = [r for r in plan.rows if r.status != "refused" and r.fits]
    assert fit and {r.layout["ep"] for r in fit} >= {2, 4, 8}
    assert all(r.layout["sequence_parallel"] for r in fit if r.layout["tp"] > 1)
    assert any("needs layout.sequence_parallel=true" in k for k in plan.refused["megatron"])
    best = fit[0]
    lay = resolve({**{k: best.layout[k] for k in ("tp", "pp", "dp", "dp_replicate", "cp", "ep", "vp",
                                                    "sequence_parallel", "micro_batch_size", "global_batch_size")},
                   "etp": 1})
    from ledger.parallel import predict

    assert best.resident_bytes == predict(m, lay, MegatronConfig(**best.knobs)).per_gpu.resident_bytes
    tokens = 256 * m.seq_len
    assert step_flops(m, lay) == tokens * (6 * (m.active_params() - m.vocab * m.hidden)
                                           + 12 * m.layers * m.seq_len * m.hidden)


def test_moe_on_the_fake_world_is_refused_before_any_rank(tmp_path):
    p = launch("framework=megatron", "model=tiny_moe", "layout.ep=2", "cluster=fake", f"hydra.run.dir={tmp_path}",
               timeout=300)
    assert p.returncode == 2 and "MoE does not run on cluster=fake" in p.stdout + p.stderr
    assert not list(tmp_path.glob("rank*.json"))


def test_moe_layer_saves_by_hand():
    """moe_activations at the tiny MoE Llama, s = 512, world 2 (the CPU job w2long): T = 512 tokens,
    the allgather dispatcher over N = ep = 2, k = 2 of E = 8 experts, 4 local, expert FFN 512, h 256, bf16."""
    from ledger.faithful.megatron import moe_activations as MA
    from ledger.faithful.megatron.activations import shape_of
    from ledger.faithful.megatron.knobs import knobs
    from tests.conftest import megatron_fw

    m = preset("tiny_moe", seq_len=512)

    def mo(ep, dispatcher="allgather", rows="balanced"):
        k = knobs(megatron_fw(moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=None,
                              moe_pad_expert_input_to_capacity=False, moe_router_load_balancing_type="aux_loss",
                              moe_grouped_gemm=False))
        return shape_of(m, layout_of(2, ep=ep), k, rows).moe

    a = mo(2)
    # balanced: 1,024 gathered tokens x 2 choices x 4 / 8 experts; the fewest none, the most every token once
    assert MA.rows_range(a) == (1024, 0, 2048) and a.rows == 1024
    assert MA.rows_range(mo(1)) == (1024, 1024, 1024)  # ep 1: every choice is local
    g = MA.moe_groups(a)
    assert g == {"router": 8 * 512 * 2 + 4 * 512 * 2,  # top-k indices, their fp32 softmax
                 "dispatch": (1 + 2) * 4 * 1024 + 2 * 1024 * 256,  # the transposed local map and probs, the rows
                 "experts": 6 * 2 * 512 * 1024}  # fc1 out (2f), silu, the second half, product, x probs
    assert MA.held(a) == 1024 * 4 + 2 * 1024 + 8 * 1024  # the local map, the masked probs, the reversed mapping
    b = mo(2, "alltoall")
    assert MA.moe_groups(b)["dispatch"] == 8 * 8 * 512 + 2 * 1024 * 256 + 2 * 1024  # argsort, rows, probs
    assert MA.held(b) == 2 * 512 * 8 + 512 * 8 + 8 * 512 * 2  # the dense probs, routing map, reversed mapping
    assert MA.experts_saved(mo(2, rows="high")) == 2 * MA.experts_saved(a)


def test_full_recompute_holding_by_hand():
    """activations.recompute_holding at the tiny MoE Llama, s = 512, bf16: every checkpoint with an MoE
    layer holds its input and the input's grad ([s, b, h] each) from its recompute to its MoE layers'
    next dispatch; uniform 1 layer: four checkpoints, from layer 3 on one; block 2: the first two
    layers' checkpoints alone; selective recompute and a dense model hold nothing."""
    from ledger.faithful.megatron.activations import Recompute, chunk_shape, recompute_holding, shape_of
    from ledger.faithful.megatron.knobs import knobs
    from tests.conftest import megatron_fw

    m = preset("tiny_moe", seq_len=512)
    k = knobs(megatron_fw(moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=None,
                          moe_pad_expert_input_to_capacity=False, moe_router_load_balancing_type="aux_loss",
                          moe_grouped_gemm=False))
    sh = chunk_shape(shape_of(m, layout_of(2, ep=2), k), m, 0, 4)
    one = 2 * 2 * 512 * 256
    assert recompute_holding(sh, Recompute("full", "uniform", 1), 4) == 4 * one
    assert recompute_holding(sh, Recompute("full", "uniform", 1), 4, 3) == one
    assert recompute_holding(sh, Recompute("full", "uniform", 2), 4) == 2 * one
    assert recompute_holding(sh, Recompute("full", "block", 2), 4) == 2 * one
    assert recompute_holding(sh, Recompute("selective"), 4) == 0
    dense = preset("tiny", seq_len=512)
    assert recompute_holding(shape_of(dense, layout_of(2), k), Recompute("full", "uniform", 1), 4) == 0
