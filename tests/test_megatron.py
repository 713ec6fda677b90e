"""Megatron Core 0.18.0: the faithful ledger against real CPU/gloo runs, the CPU redirects, dry run.sh.

One shared sweep (a few small multiruns, 32 jobs) covers dp2, tp2, pp2 (world 2) and tp2·dp2,
pp2·dp2, tp2·pp2 (world 4), sequence parallel on and off, overlap_grad_reduce on and off (with
small buckets, so several padded buckets per buffer), the interleaved schedule (pp2·vp2 world 2,
pp2·vp2·dp2 world 4: one DDP buffer per model chunk), tied embeddings (dp2: no output weight; pp2,
pp2·dp2, pp2·vp2·dp2: the last stage's copy, shared-embedding buckets, the embedding-group
all-reduce) and overlap_param_gather (dp2, pp2·dp2, pp2·vp2·dp2: no all-gather in the first step,
the previous step's in the forward pre-hooks after) and a vocab tp does not divide (1001 at dp2,
tp2·sp, tp2·dp2: trained padded to 1024 rows) and uneven pipeline stages (3 layers over pp2: first
1 / last 2 and the reverse, by num_layers_in_first/last_pipeline_stage and by
account_for_embedding/loss_in_pipeline_split), and the peak under recompute (pp2, 4 micro-batches,
s=128: none, selective core_attn, full uniform and block; s=512, where a softmax cast is the peak:
none, full uniform and block). Every state and collective row (first and
steady steps) on every rank must reconcile with abs_err 0, and every steady peak_bytes row within 1%
(ledger/faithful/megatron/peak.py; `python -m analysis.reconcile DIR` shows them).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types

import numpy as np
import pytest
import torch

import records
from analysis import reconcile
from analysis.compare import measured_peak_where
from ledger.faithful.megatron import states as L
from ledger.faithful.megatron import buffers as B
from ledger.faithful.megatron import comm as C
from ledger.faithful.megatron import heaviest as H
from ledger.faithful.megatron import knobs as K
from ledger.faithful.megatron import pipeline as PL
from ledger.layout import ConfigError
from ledger.model import ModelShape, preset
from tests.conftest import (AttrDict, assert_every_row_reconciles, assert_megatron_redirects, launch, megatron_fw, megatron_layout,
                            peak_evidence, run_sh_flags, run_sweeps)

# the distributed optimizer unless a sweep says (w2ddp: plain DDP, Megatron-LM's default)
COMMON = ("framework=megatron", "model.hidden=208", "model.seq_len=32", "train.steps=2", "framework.bucket_size=100000",
          "framework.use_distributed_optimizer=true")
# the long-sequence jobs' narrow Llama (COMMON's hidden 208 overridden): at s=512 its moments are those of
# hidden 208, at a fraction of the bf16 FLOPs
LONG = ("model.seq_len=512", "model.hidden=64", "model.ffn_hidden=192")
# four multiruns; each sweeps layout dicts (merged into the layout node), so the 10 jobs cover the
# matrix without its full cartesian product
SWEEPS = (
    ("w2off", ("cluster.ranks=2", "framework.overlap_grad_reduce=false", "layout={},{tp:2}")),
    ("w2on", ("cluster.ranks=2", "framework.overlap_grad_reduce=true", "layout={},{tp:2,sequence_parallel:true},{pp:2}")),
    ("w4off", ("cluster.ranks=4", "framework.overlap_grad_reduce=false", "layout={tp:2},{tp:2,pp:2,sequence_parallel:true}")),
    ("w4on", ("cluster.ranks=4", "framework.overlap_grad_reduce=true",
              "layout={tp:2,sequence_parallel:true},{pp:2},{tp:2,pp:2}")),
    # the plain DDP path (no distributed optimizer): fp32 masters in full, all-reduce per bucket
    ("w2ddp", ("cluster.ranks=2", "framework.overlap_grad_reduce=true", "framework.use_distributed_optimizer=false",
               "layout={}")),
    # interleaved pipeline (vp=2): 4 layers as 2 stages x 2 chunks; global batch 4 gives 4 (dp1) / 2 (dp2)
    # micro-batches, multiples of pp as the interleaved schedule needs
    ("w2vp", ("cluster.ranks=2", "layout={pp:2,vp:2,global_batch_size:4}")),
    ("w4vp", ("cluster.ranks=4", "framework.overlap_grad_reduce=true", "layout={pp:2,vp:2,global_batch_size:4}")),
    # tied embeddings: pp1 (one weight, no output_layer.weight) and pp2 (the last stage's copy in a
    # bucket of its own, the embedding-group all-reduce)
    ("w2tied", ("cluster.ranks=2", "model.tied_embeddings=true", "framework.overlap_grad_reduce=true",
                "layout={},{pp:2}")),
    # overlap_param_gather: the param all-gathers move into the next step's forward pre-hooks
    ("w2opg", ("cluster.ranks=2", "framework.overlap_grad_reduce=true", "framework.overlap_param_gather=true",
               "layout={}")),
    # both, with the interleaved schedule's aligned param gather (param_sync_func) in the vp job
    ("w4tiedopg", ("cluster.ranks=4", "model.tied_embeddings=true", "framework.overlap_grad_reduce=true",
                   "framework.overlap_param_gather=true", "layout={pp:2},{pp:2,vp:2,global_batch_size:4}")),
    # a vocab that tp does not divide: Megatron trains it padded to 1024 rows (megatron_buffers.padded_vocab)
    ("w2v1001", ("cluster.ranks=2", "model.vocab=1001", "layout={},{tp:2,sequence_parallel:true}")),
    ("w4v1001", ("cluster.ranks=4", "model.vocab=1001", "layout={tp:2}")),
    # uneven pipeline stages, 3 layers over pp2: first 1 / last 2 (pp2·dp2: sharded, bucketed) and the
    # reverse, by either knob pair
    ("w4first1", ("cluster.ranks=4", "model.layers=3", "framework.overlap_grad_reduce=true",
                  "framework.decoder_first_pipeline_num_layers=1", "layout={pp:2}")),
    ("w2last1", ("cluster.ranks=2", "model.layers=3", "framework.decoder_last_pipeline_num_layers=1", "layout={pp:2}")),
    ("w2accemb", ("cluster.ranks=2", "model.layers=3", "framework.account_for_embedding_in_pipeline_split=true",
                  "layout={pp:2}")),
    ("w2accloss", ("cluster.ranks=2", "model.layers=3", "framework.overlap_grad_reduce=true",
                   "framework.account_for_loss_in_pipeline_split=true", "layout={pp:2}")),
    # the peak under recompute: s=128 so that the backward, not the optimizer step, holds the
    # peak of stage 0; 4 micro-batches over pp2 (a second count: 1F1B holds 2 in flight on stage 0)
    ("w2rcsel", ("cluster.ranks=2", "model.seq_len=128", "framework.overlap_grad_reduce=true",
                 "framework.recompute_granularity=null,selective", "layout={pp:2,global_batch_size:4}")),
    ("w2rcfull", ("cluster.ranks=2", "model.seq_len=128", "framework.overlap_grad_reduce=true",
                  "framework.recompute_granularity=full", "framework.recompute_method=uniform,block",
                  "framework.recompute_num_layers=1", "layout={pp:2,global_batch_size:4}")),
    # s=512: the s^2 attention tensors outweigh the backward's moments, so both stages peak in a forward,
    # at the last layer's softmax cast (megatron_peak.softmax_forward): stage 0 with one micro-batch in
    # flight and the previous iteration's p2p locals, the last stage with its own only
    ("w2fwd", ("cluster.ranks=2", *LONG, "layout={pp:2,global_batch_size:4}")),
    # the same with full recompute of one layer: uniform (both layers of a stage checkpointed) peaks at
    # the last layer's softmax cast in its recompute in backward; block (layer 0 checkpointed, layer 1
    # not) at that recompute on stage 0 and at layer 1's forward cast on the last stage
    ("w2fwdrc", ("cluster.ranks=2", *LONG, "framework.recompute_granularity=full",
                 "framework.recompute_method=uniform,block", "framework.recompute_num_layers=1",
                 "layout={pp:2,global_batch_size:4}")),
    # full recompute with TP: a recomputed layer's forward TP collectives run again in its backward
    # (megatron comm.micro_batch_comm): every layer (uniform) with SP's all-gathers / reduce-scatters,
    # the first (block) with the all-reduces
    ("w2rctpsp", ("cluster.ranks=2", "framework.recompute_granularity=full", "framework.recompute_method=uniform",
                  "framework.recompute_num_layers=1", "layout={tp:2,sequence_parallel:true}")),
    ("w2rctp", ("cluster.ranks=2", "framework.recompute_granularity=full", "framework.recompute_method=block",
                "framework.recompute_num_layers=1", "layout={tp:2}")),
)
# (layout, overlap_grad_reduce, use_distributed_optimizer, vp, tied_embeddings, overlap_param_gather, vocab,
# (layers, first, last, embedding, loss) of the pipeline split) of every job
EVEN = (4, None, None, False, False)
EXPECTED = {(*job, 1024, EVEN) for job in {("dp2", False, True, 1, False, False), ("tp2", False, True, 1, False, False),
            ("dp2", True, True, 1, False, False), ("tp2·sp", True, True, 1, False, False),
            ("pp2", True, True, 1, False, False), ("tp2·dp2", False, True, 1, False, False),
            ("tp2·pp2·sp", False, True, 1, False, False), ("tp2·dp2·sp", True, True, 1, False, False),
            ("pp2·dp2", True, True, 1, False, False), ("tp2·pp2", True, True, 1, False, False),
            ("dp2", True, False, 1, False, False), ("pp2·vp2", False, True, 2, False, False),
            ("pp2·vp2·dp2", True, True, 2, False, False),
            ("dp2", True, True, 1, True, False), ("pp2", True, True, 1, True, False),
            ("dp2", True, True, 1, False, True),
            ("pp2·dp2", True, True, 1, True, True), ("pp2·vp2·dp2", True, True, 2, True, True)}} | {
    ("dp2", False, True, 1, False, False, 1001, EVEN), ("tp2·sp", False, True, 1, False, False, 1001, EVEN),
    ("tp2·dp2", False, True, 1, False, False, 1001, EVEN)} | {
    ("pp2·dp2", True, True, 1, False, False, 1024, (3, 1, None, False, False)),
    ("pp2", False, True, 1, False, False, 1024, (3, None, 1, False, False)),
    ("pp2", False, True, 1, False, False, 1024, (3, None, None, True, False)),
    ("pp2", True, True, 1, False, False, 1024, (3, None, None, False, True))}
# (seq_len, recompute granularity, method) of every job: the matrix's at s=32 without recompute, and the
# recompute jobs (w2rcsel, w2rcfull)
NO_RC = (32, None, None)
RC_JOBS = {("pp2", True, True, 1, False, False, 1024, EVEN, rc) for rc in
           ((128, None, None), (128, "selective", None), (128, "full", "uniform"), (128, "full", "block"))}
FWD_JOBS = {("pp2", False, True, 1, False, False, 1024, EVEN, rc) for rc in
            ((512, None, None), (512, "full", "uniform"), (512, "full", "block"))}
TP_RC_JOBS = {("tp2·sp", False, True, 1, False, False, 1024, EVEN, (32, "full", "uniform")),
              ("tp2", False, True, 1, False, False, 1024, EVEN, (32, "full", "block"))}
EXPECTED = {(*job, NO_RC) for job in EXPECTED} | RC_JOBS | FWD_JOBS | TP_RC_JOBS


def _split(rec) -> tuple:
    fw = rec["config"]["framework"]
    return (rec["config"]["model"]["layers"], fw["decoder_first_pipeline_num_layers"],
            fw["decoder_last_pipeline_num_layers"], fw["account_for_embedding_in_pipeline_split"],
            fw["account_for_loss_in_pipeline_split"])


def _rc(rec) -> tuple:
    fw = rec["config"]["framework"]
    return rec["config"]["model"]["seq_len"], fw["recompute_granularity"], fw["recompute_method"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return run_sweeps(tmp_path_factory.mktemp("megatron_sweep"), SWEEPS, COMMON)


def _overlap(rec) -> bool:
    return rec["config"]["framework"]["overlap_grad_reduce"]


# -- real runs -----------------------------------------------------------------------------------
@pytest.mark.real
def test_matrix_ran(sweep):
    bad = [(records.job_name(r), r["status"], r["error"]) for r in sweep["records"] if r["status"] != "ok"]
    assert not bad, bad
    jobs = [(records.layout_name(r), _overlap(r), r["config"]["framework"]["use_distributed_optimizer"],
             r["prediction"]["layout"]["vp"], r["config"]["model"]["tied_embeddings"],
             r["config"]["framework"]["overlap_param_gather"], r["config"]["model"]["vocab"], _split(r), _rc(r))
            for r in sweep["ok"]]
    assert len(jobs) == len(set(jobs)) and set(jobs) == EXPECTED, jobs
    # a run's default spec (default_transformer_impl), the one the launcher builds and the ledger predicted
    assert {(r["config"]["framework"]["transformer_impl"], r["prediction"]["spec"]) for r in sweep["ok"]} == {
        ("local", "local")}


@pytest.mark.real
def test_every_steady_row_on_every_rank_reconciles(sweep):
    # resident state and collectives to the byte, first step included; the peak within 1% on
    # every steady step (its parts and the first step's peak are reported, not held to it)
    assert_every_row_reconciles(sweep["table"], sweep["ok"])
    df = sweep["table"]
    steady = df[df.phase == "steady"]
    pk = steady[steady.quantity == "peak_bytes"]
    for rec in sweep["ok"]:
        d = pk[pk.job == records.job_name(rec)]
        assert set(d["rank"]) == set(range(rec["measurement"]["world"])), f"{records.job_name(rec)}: peak not on every rank"
    off = pk[reconcile.off(pk)]  # within 1% of the probe's range (compare.peak_gap)
    assert off.empty, peak_evidence(sweep["ok"], off)


@pytest.mark.real
def test_recompute_jobs_hold_less_in_backward(sweep):
    """The recompute jobs (same shape, pp2, 4 micro-batches): stage 0 peaks in backward, and its saved
    activations at the peak shrink from none to selective to full, measured as predicted."""
    at = {}
    for rec in sweep["ok"]:
        if _rc(rec)[0] != 128:
            continue
        m = next(r for r in rec["measurement"]["ranks"] if r["rank"] == 0)
        pk = m["steps"][-1]["peak"]
        pred = records.predicted_ranks(rec["prediction"])(0)["peak"]
        assert measured_peak_where(pk)["phase"] == pred["phase"] == "backward", (_rc(rec), pk["where"], pred["what"])
        assert pk["at_peak"]["activations"] == pred["parts"]["activations"], (_rc(rec), pk["at_peak"], pred["parts"])
        at[_rc(rec)[1:]] = pk["at_peak"]["activations"]
    assert at[(None, None)] > at[("selective", None)] > at[("full", "uniform")], at


@pytest.mark.real
def test_long_sequence_peaks_at_the_forward_softmax_cast(sweep):
    """s=512, pp2, 4 micro-batches: every rank peaks where the ledger says, at the last layer's softmax
    cast to bf16 in a forward (megatron_peak.softmax_forward), its saved activations and p2p buffers
    to the byte; the temporaries and what was live at the step's start (`unnamed`) off only by the
    launcher's batches (launchers/megatron.py batches: 8·b·(s + 1) B, at most one in each) and a few
    4-byte scalars, which the ledger does not model."""
    _at_softmax_casts(sweep, (512, None, None), {0: ("forward", 1), 1: ("forward", 1)})


def _at_softmax_casts(sweep, rc, where) -> None:
    """Each rank of the job with recompute `rc` peaks at a softmax cast where[rank] = (phase, layer),
    predicted there, its saved activations and p2p buffers to the byte; the temporaries and what was
    live at the step's start (`unnamed`) off only by the launcher's batches (launchers/megatron.py
    batches: 8·b·(s + 1) B, at most one in each) and a few 4-byte scalars, which the ledger does not
    model."""
    rec = next(r for r in sweep["ok"] if _rc(r) == rc)
    pred_of = records.predicted_ranks(rec["prediction"])
    batch = 8 * 1 * (rc[0] + 1)
    for m in rec["measurement"]["ranks"]:
        pk, p = m["steps"][-1]["peak"], pred_of(m["rank"])["peak"]
        phase, layer = where[m["rank"]]
        w = measured_peak_where(pk)
        assert (w["phase"], w["op"]) == (phase, "aten._to_copy.default") and w["module"].endswith(
            f"layers.{layer}.self_attention.core_attention.scale_mask_softmax"), (rc, m["rank"], w)
        assert p["phase"] == phase and f"layer {layer}" in p["what"] and "softmax cast" in p["what"], (rc, p["what"])
        at = pk["at_peak"]
        assert at["activations"] == p["parts"]["activations"] and at.get("gathered", 0) == p["parts"]["gathered"], (
            rc, m["rank"], at, p["parts"])
        assert 0 <= at["temporary"] - p["parts"]["temporary"] <= batch + 64, (rc, m["rank"], at, p["parts"])
        assert at.get("unnamed", 0) <= batch + 64, (rc, m["rank"], at)


@pytest.mark.real
def test_full_recompute_peaks_at_a_recomputed_softmax_cast(sweep):
    """s=512, pp2, full recompute of one layer (megatron_peak.chunk_units): uniform checkpoints both
    layers of a stage, and each stage peaks in backward at the last layer's softmax cast in its
    recompute (the earlier layers' checkpoint inputs, the layer's own saves so far, the checkpoint's
    output grad); block checkpoints layer 0 only: stage 0 peaks at layer 0's recompute (its saves
    beside micro-batches in flight), the last stage at layer 1's cast in a forward (softmax_forward)."""
    _at_softmax_casts(sweep, (512, "full", "uniform"), {0: ("backward", 1), 1: ("backward", 1)})
    _at_softmax_casts(sweep, (512, "full", "block"), {0: ("backward", 0), 1: ("forward", 1)})


@pytest.mark.real
def test_sweep_exercises_padding_buckets_and_every_collective(sweep):
    df = sweep["table"]
    comm = df[df.quantity.str.startswith("comm/")]
    q = set(comm.quantity)
    for dim_kind in ("dp/reduce_scatter", "dp/all_gather", "tp/all_reduce", "tp/all_gather", "tp/reduce_scatter",
                     "pp/send_recv"):
        assert f"comm/{dim_kind}/count" in q, dim_kind
    # several buckets per step with overlap_grad_reduce (bucket_size 100k elements)
    rs = comm[(comm.quantity == "comm/dp/reduce_scatter/count") & (comm.phase == "steady")]
    assert rs.measured.max() > 1
    # padding: some buffer is larger than its parameters, and DP ranks of one job hold
    # different master/Adam bytes (the larger shard of a padded bucket)
    padded = uneven = False
    for rec in sweep["ok"]:
        pr = records.rank_classes(rec["prediction"])
        lay = rec["prediction"]["layout"]
        shape = ModelShape.from_config(rec["config"]["model"])
        n_local = {s: sum(n for ch in range(lay["vp"]) for _, n in PL.stage_params(shape, lay["tp"], lay["pp"], s,
                                                                                   lay["vp"], ch))
                   for s in {p["stage"] for p in pr}}
        padded |= any(p["grads_bytes"] > 4 * n_local[p["stage"]] for p in pr)
        by_stage = {}
        for p in pr:
            by_stage.setdefault(p["stage"], set()).add(p["optim_bytes"])
        uneven |= any(len(v) > 1 for v in by_stage.values())
    assert padded and uneven


@pytest.mark.real
def test_tied_embeddings_and_overlap_param_gather_are_exercised(sweep):
    """The rows that confirm the two features are there: the embedding-group all-reduce on both PP
    ends of every tied pp2 job (reconciled to the byte by the test above), and with overlap_param_gather no param all-gather in step 0 but
    all-gathers in the steady step, on every rank."""
    df = sweep["table"]
    for rec in sweep["ok"]:
        job, world = records.job_name(rec), rec["measurement"]["world"]
        d = df[df.job == job]
        if rec["config"]["model"]["tied_embeddings"] and rec["prediction"]["layout"]["pp"] > 1:
            # the fp32 word-embedding grad (vocab/tp x h); with dp = tp = 1 the grad-norm all-reduce
            # (4 bytes) is a pp group too
            m, tp = rec["config"]["model"], rec["prediction"]["layout"]["tp"]
            ar = d[(d.quantity == "comm/pp/all_reduce/buffer_bytes") & (d.phase == "steady")]
            emb = 4 * (PL.padded_vocab(m["vocab"], tp, 128) // tp) * m["hidden"]
            assert len(ar) == world and ar.measured.isin([emb, emb + 4]).all(), (job, ar.to_string())
        if rec["config"]["framework"]["overlap_param_gather"]:
            ag = d[d.quantity == "comm/dp/all_gather/count"]
            assert ag[ag.phase == "first"].measured.sum() == 0, job
            steady = ag[ag.phase == "steady"]
            assert len(steady) == world and (steady.measured > 0).all(), (job, steady.to_string())


@pytest.mark.real
def test_vocab_1001_jobs_train_the_padded_vocab(sweep):
    """The vocab-1001 jobs (reconciled to the byte above) predicted 1024 rows: the padding is what the
    real GPTModel held, in the embedding and the output layer of every rank, first step and steady."""
    jobs = [r for r in sweep["ok"] if r["config"]["model"]["vocab"] == 1001]
    assert len(jobs) == 3
    for rec in jobs:
        notes = rec["prediction"]["notes"]
        assert any("vocab 1001 padded to 1024 rows" in n for n in notes), (records.job_name(rec), notes)


@pytest.mark.real
def test_uneven_pipeline_jobs_built_their_stage_layers(sweep):
    """The 3-layer pp2 jobs (reconciled to the byte above): each stage's measured param bytes are its own
    layers' (stage_layers: 1 and 2, or 2 and 1), not an even split's, on every rank, first step and steady."""
    df = sweep["table"]
    jobs = [r for r in sweep["ok"] if r["config"]["model"]["layers"] == 3]
    assert len(jobs) == 4
    for rec in jobs:
        job, shape = records.job_name(rec), ModelShape.from_config(rec["config"]["model"])
        split = K.pp_split(types.SimpleNamespace(**rec["config"]["framework"]))
        want = {st: 2 * sum(n for _, n in PL.stage_params(shape, 1, 2, st, split=split)) for st in (0, 1)}
        assert sorted(PL.stage_layers(3, 2, 1, st, 0, split) for st in (0, 1)) == [1, 2], job
        d = df[(df.job == job) & (df.quantity == "params_bytes")]
        world = rec["measurement"]["world"]
        assert len(d) == 2 * world, (job, d.to_string())  # every rank x (first, steady)
        for _, row in d.iterrows():  # at least its own params, and on the side of them the other stage is
            st = row["rank"] * 2 // world  # (tp = 1: rank // dp)
            own, other = want[st], want[1 - st]
            assert own <= row["measured"] and (row["measured"] < other) == (own < other), (job, row.to_dict())


@pytest.mark.real
def test_cpu_redirects_are_all_reached_and_declared(sweep):
    assert_megatron_redirects(sweep, "dense", ("dense",))


@pytest.mark.real
def test_losses_are_finite_on_the_last_stage(sweep):
    for rec in sweep["ok"]:
        for r in rec["measurement"]["ranks"]:
            losses = [s.get("loss") for s in r["steps"]]
            if r["stage"] == rec["prediction"]["layout"]["pp"] - 1:
                assert all(x is not None and x == x and 0 < x < 20 for x in losses), (records.job_name(rec), losses)


# -- the ledger's buffer layout against Megatron's own -------------------------------------------
def _megatron_layout(params, shared, bucket, dp):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    fake = [torch.nn.Parameter(torch.empty(n, device="meta")) for _, n in params]
    # language_module.py setup_embeddings_and_output_layer marks these (tied embeddings, pp > 1)
    if shared[0]:
        fake[0].shared_embedding = True
    if shared[1]:
        fake[-1].shared_embedding = True
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True)
    return fake, DistributedOptimizer._compute_per_buffer_param_layout(fake, bucket, dp, cfg)


@pytest.mark.parametrize("dp,bucket", [(1, None), (2, None), (2, 100_000), (4, 70_000), (3, 50_000)])
def test_buffer_layout_matches_megatron(dp, bucket):
    model = preset("tiny")
    params = PL.stage_params(model, tp=2, pp=1, stage=0)
    fake, ref = _megatron_layout(params, (False, False), bucket, dp)
    ours = B.buffer_layout(params, bucket, dp, dist_opt=True)
    assert [(b.start, b.end) for b in ours] == ref.bucket_indices
    got = {name: (s, e) for b in ours for name, s, e in b.params}
    for (name, _), p in zip(params, fake):
        assert got[name] == ref.param_index_map[p][:2], name
    # the DP shards cover every parameter element exactly once
    total = sum(n for r in range(dp) for _, n in B.shard_ranges(ours, dp, r))
    assert total == sum(n for _, n in params)


@pytest.mark.parametrize("dp,bucket", [(1, None), (2, None), (2, 100_000), (4, 30_000), (3, 5_000)])
@pytest.mark.parametrize("pp,vp", [(2, 1), (2, 2), (3, 1)])
def test_tied_shared_embedding_buckets_match_megatron(dp, bucket, pp, vp):
    """Tied embeddings with pp > 1: the first stage's word embeddings and the last stage's output
    weight copy are `shared_embedding` params, each in a bucket of its own
    (distrib_optimizer.py _does_param_require_new_bucket), with and without bucketing; the cached
    stage buffer the ledger predicts from is the same layout."""
    shape = ModelShape(layers=6, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=32,
                       tied_embeddings=True)
    for stage in range(pp):
        for ch in range(vp):
            params = PL.stage_params(shape, 2, pp, stage, vp, ch)
            shared = PL.shared_embedding(shape, pp, stage, vp, ch)
            _, n_first, n_last = PL.stage_shape(shape, pp, stage, vp, ch)
            assert shared == (n_first, n_last)
            fake, ref = _megatron_layout(params, shared, bucket, dp)
            ours = B.buffer_layout(params, bucket, dp, True, *shared)
            assert [(b.start, b.end) for b in ours] == ref.bucket_indices, (stage, ch)
            got = {name: (s, e) for b in ours for name, s, e in b.params}
            for (name, _), p in zip(params, fake):
                assert got[name] == ref.param_index_map[p][:2], name
            buf = B.buffer(shape, 2, *PL.stage_shape(shape, pp, stage, vp, ch), bucket, dp, True)
            assert [(int(a), int(b)) for a, b in zip(buf.bstart, buf.bend)] == ref.bucket_indices
            if any(shared):  # the shared param alone in its bucket
                name = params[0][0] if shared[0] else params[-1][0]
                assert [b.params for b in ours if any(n == name for n, _, _ in b.params)][0][0][0] == name
                assert sum(len(b.params) == 1 and b.params[0][0] == name for b in ours) == 1


def test_tied_embeddings_params_and_collectives():
    """pp=1: no output_layer.weight (gpt_model.py skip_weight_param_allocation), no shared bucket, no
    embedding-group all-reduce. pp=2: the last stage holds its own copy; both ends all-reduce the
    word-embedding grad (fp32 main_grad, vocab/tp x h) over the embedding group once per step."""
    model = dataclasses.replace(preset("tiny"), tied_embeddings=True)
    untied = preset("tiny")
    names = [n for n, _ in PL.stage_params(model, 2, 1, 0)]
    assert "output_layer.weight" not in names and "embedding.word_embeddings.weight" in names
    assert len(names) == len(PL.stage_params(untied, 2, 1, 0)) - 1
    assert PL.shared_embedding(model, 1, 0, 1, 0) == (False, False)
    pl = L.place(model, _lay(tp=2, dp=2), _fw())
    s = pl.rank_state(0)
    assert not any(c.dim == "pp" for c in s.comm)
    assert s.grads_bytes == 4 * B.build_buffer(PL.sizes(model, 2, 4, True, True), None, 2, True).numel
    assert PL.stage_params(model, 2, 2, 1) == PL.stage_params(untied, 2, 2, 1)  # the last stage's copy
    lay = _lay(tp=2, pp=2, dp=1)
    pl = L.place(model, lay, _fw())
    emb = 4 * (model.vocab // 2) * model.hidden
    for st in range(2):
        ar = [c for c in pl.rank_state(lay.grid.rank({"pp": st})).comm if c.dim == "pp" and c.kind == "all_reduce"]
        assert [(c.count, c.buffer_bytes, c.dtype) for c in ar] == [(1, emb, "fp32")]
        # the shared param's own bucket: one bucket more than the untied stage (bucket_size None)
        assert len(L.stage_buffers(model, lay, _fw(), st)[0].bstart) == 2
        assert len(L.stage_buffers(untied, lay, _fw(), st)[0].bstart) == 1
    # without the distributed optimizer (param_and_grad_buffer.py _compute_default_per_buffer_param_layout)
    # shared_embedding does not split buckets
    assert len(L.stage_buffers(model, lay, _fw(use_distributed_optimizer=False), 0)[0].bstart) == 1


def test_overlap_param_gather_moves_the_all_gathers_out_of_the_first_step():
    """Steady state: the same per-bucket all-gathers as without overlap_param_gather (now in the
    forward pre-hooks); the first step (training.py: pre-hooks disabled) has none; memory unchanged."""
    model = preset("tiny")
    lay = _lay(pp=2, dp=2)
    base = L.place(model, lay, _fw(overlap_grad_reduce=True, bucket_size=100_000))
    opg = L.place(model, lay, _fw(overlap_grad_reduce=True, bucket_size=100_000, overlap_param_gather=True))

    def totals(comm):
        return {(c.dim, c.kind, c.dtype): (c.count, c.buffer_bytes) for c in comm}

    for r in range(lay.world):
        a, b = base.rank_state(r), opg.rank_state(r)
        assert [getattr(a, k) for k in ("params_bytes", "grads_bytes", "optim_bytes", "other_bytes")] == \
            [getattr(b, k) for k in ("params_bytes", "grads_bytes", "optim_bytes", "other_bytes")]
        assert totals(a.comm) == totals(b.comm) and a.comm_first is None
        first = totals(b.comm_first)
        assert ("dp", "all_gather", "bf16") not in first
        assert first == {k: v for k, v in totals(b.comm).items() if k != ("dp", "all_gather", "bf16")}
    # dp = 1: nothing to gather, no separate first step
    assert L.place(model, _lay(pp=2, dp=1), _fw(overlap_grad_reduce=True, overlap_param_gather=True)
                   ).rank_state(0).comm_first is None


_fw, _lay, _Cfg = megatron_fw, megatron_layout, AttrDict


def test_ledger_18_bytes_per_param_and_zero1_division():
    model = preset("llama3_1b")
    pl = L.place(model, _lay(tp=2, pp=2, dp=2, sequence_parallel=True), _fw())
    for r in range(pl.world):
        s = pl.rank_state(r)
        n = s.params_bytes // 2
        assert s.grads_bytes == 4 * n
        assert abs(s.optim_bytes - 12 * n / 2) < 12 * 2 * 128 + 4 * 200  # padding + step tensors only


def test_faithful_ledger_refuses_what_it_does_not_model():
    model = preset("tiny")
    # training/arguments.py validate_args: overlap_param_gather needs both
    with pytest.raises(ConfigError, match="overlap_param_gather=true needs framework.overlap_grad_reduce=true"):
        L.place(model, _lay(), _fw(overlap_param_gather=True))
    with pytest.raises(ConfigError, match="overlap_param_gather=true needs framework.use_distributed_optimizer"):
        L.place(model, _lay(), _fw(overlap_param_gather=True, overlap_grad_reduce=True,
                                   use_distributed_optimizer=False))
    L.place(model, _lay(), _fw(overlap_param_gather=True, overlap_grad_reduce=True))
    L.place(dataclasses.replace(model, tied_embeddings=True), _lay(pp=2), _fw())
    with pytest.raises(ConfigError, match="cp=2"):
        L.place(model, _lay(cp=2, dp=1), _fw())
    # the interleaved schedule needs num_microbatches (global_batch_size / (micro_batch_size*dp)) % pp == 0
    with pytest.raises(ConfigError, match="global_batch_size=3 gives num_microbatches=3"):
        L.place(model, _lay(pp=2, vp=2, dp=1, global_batch_size=3), _fw())
    with pytest.raises(ConfigError, match="global_batch_size=2 gives num_microbatches=1"):
        L.place(model, _lay(pp=2, vp=2, dp=2, global_batch_size=2), _fw())
    L.place(model, _lay(pp=2, vp=2, dp=1, global_batch_size=4), _fw())
    L.place(model, _lay(tp=2, pp=2, dp=1, sequence_parallel=True), _fw())


@pytest.mark.parametrize("pp", [2, 3, 4, 8, 16])
def test_interleaved_p2p_pairs_every_send_with_a_receive(pp):
    """Replaying the interleaved schedule (interleaved_p2p below, schedules.py's control flow): each of
    the pp*vp-1 virtual-stage boundaries carries one activation forward and one grad backward per
    micro-batch, each a send on one stage and a receive on its neighbour; the first stage receives no
    activation for chunk 0, the last sends none from its last chunk. These are the counts the ledger
    uses (_comm), checked on the pp stages' collectives of a predicted layout too."""
    for vp in (2, 3, 4):
        for m in range(pp, 8 * pp + 1, pp):  # check_interleaving: m a multiple of pp
            per_stage = [interleaved_p2p(pp, s, vp, m) for s in range(pp)]
            crossings = 2 * (pp * vp - 1) * m
            assert sum(x for x, _ in per_stage) == crossings
            assert sum(y for _, y in per_stage) == crossings
            # inner stages send and receive vp boundaries each way; the ends one fewer
            for s, (sent, received) in enumerate(per_stage):
                ends = (s == 0) + (s == pp - 1)
                assert sent == received == 2 * m * vp - ends * m, (s, sent, received)
    model = ModelShape(layers=4 * pp, hidden=64, ffn_hidden=128, heads=4, kv_heads=2, vocab=128, seq_len=16)
    lay = _lay(pp=pp, vp=2, dp=1, global_batch_size=2 * pp)
    pl = L.place(model, lay, _fw())
    for s in range(pp):
        (c,) = [c for c in pl.rank_state(lay.grid.rank({"pp": s})).comm if c.dim == "pp" and c.kind == "send_recv"]
        assert c.count == sum(interleaved_p2p(pp, s, 2, 2 * pp))


def _schedule_table(m: int, vp: int, group: int) -> list[tuple[int, int]]:
    """schedules.py get_schedule_table: (microbatch id, model chunk id) per virtual micro-batch."""
    out = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        out += [(mb, ch) for ch in range(vp) for mb in range(lo, hi)]
    return out


def interleaved_p2p(pp: int, stage: int, vp: int, m: int) -> tuple[int, int]:
    """(tensors sent, tensors received) by one stage in one forward_backward_pipelining_with_interleaving
    call, replaying its control flow with overlap_p2p_comm and overlap_p2p_comm_warmup_flush off
    (the launcher's config): get_pp_rank_microbatches (warm-up length), recv_tensor_from_previous_stage
    (the leading stage receives nothing for its first pp-1 virtual micro-batches and nothing for the
    last chunk's), the first stage's first chunk sends no input grad, the last stage's last chunk no
    output; p2p_communication.py _communicate posts one isend / irecv per non-None tensor / recv flag."""
    group = pp  # microbatch_group_size_per_vp_stage
    total = m * vp
    table = _schedule_table(m, vp, group)
    first, last = stage == 0, stage == pp - 1
    warm = (pp - stage - 1) * 2 + (vp - 1) * group
    all_warm = warm >= total
    warm = min(warm, total)
    remaining = total - warm

    def chunk(k: int, forward: bool) -> int:
        c = table[k % total][1]
        return c if forward else vp - 1 - c

    def recv_from_prev(k: int, forward: bool) -> bool:
        leading = first if forward else last
        if not leading:
            return True
        end_chunk = vp - 1 if forward else 0
        nxt = chunk(k + 1, forward) if k < pp - 1 else chunk(k - (pp - 1), forward)
        return k >= pp - 1 and nxt != end_chunk

    sent = received = 0
    received += not first  # recv_forward for chunk 0 (none on the first stage)
    for k in range(warm):
        recv_prev = recv_from_prev(k, True) and k != total - 1
        out = not (chunk(k, True) == vp - 1 and last)
        sent += out
        received += recv_prev
        if k == warm - 1 and not all_warm:  # send_forward_backward_recv_forward_backward
            received += not last
    for k in range(remaining):
        fk = k + warm
        out = not (chunk(fk, True) == vp - 1 and last)
        grad = not (chunk(k, False) == 0 and first)
        recv_prev = recv_from_prev(fk, True) and k != remaining - 1
        recv_next = recv_from_prev(k, False)
        sent += out + grad
        received += recv_prev + recv_next
    if all_warm:
        received += not last  # recv_backward for the last chunk
    for k in range(remaining, total):
        grad = not (chunk(k, False) == 0 and first)
        recv_next = recv_from_prev(k, False) and k != total - 1
        sent += grad
        received += recv_next
    return sent, received





def test_interleaved_buffers_one_per_chunk():
    """vp chunks per stage: each chunk its own (padded) DDP buffer, only chunk 0 of stage 0 bucketed
    (training.py get_model disable_bucketing, distributed_data_parallel.py pp_rank > 0)."""
    model = preset("tiny")
    fw = _fw(overlap_grad_reduce=True, bucket_size=100_000)
    lay = _lay(pp=2, vp=2, dp=2, global_batch_size=4)
    assert [B.effective_bucket_size(fw, 2, st, ch) for st in range(2) for ch in range(2)] == [100_000, None, None, None]
    pl = L.place(model, lay, fw)
    for st in range(2):
        layouts = [B.buffer_layout(PL.stage_params(model, 1, 2, st, 2, ch), B.effective_bucket_size(fw, 2, st, ch), 2,
                                   True) for ch in range(2)]
        numel = sum(b.numel for bs in layouts for b in bs)
        s = pl.rank_state(lay.grid.rank({"pp": st, "dp": 0}))
        assert s.grads_bytes == 4 * numel and s.params_bytes == 2 * numel
    # the embedding sits in stage 0 chunk 0, the output layer in stage 1 chunk 1 only
    names = {(st, ch): {n for n, _ in PL.stage_params(model, 1, 2, st, 2, ch)} for st in range(2) for ch in range(2)}
    assert [("embedding.word_embeddings.weight" in names[k], "output_layer.weight" in names[k])
            for k in sorted(names)] == [(True, False), (False, False), (False, False), (False, True)]


# -- dry: run.sh ---------------------------------------------------------------------------------
_run_sh_flags = run_sh_flags


@pytest.mark.real  # runs the framework's own code (its argument parser, or torch.distributed in a process)
def test_dry_writes_pretrain_gpt_command_accepted_by_megatron_parser(tmp_path):
    p = launch("mode=dry", "framework=megatron", "model=llama3_1b", "layout.tp=2", "layout.pp=2", "layout.dp=2",
               "layout.sequence_parallel=true", "layout.global_batch_size=16", "framework.overlap_grad_reduce=true",
               "framework.use_distributed_optimizer=true", "cluster=local_gpu", f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    flags = _run_sh_flags(str(tmp_path / "run.sh"))
    assert os.access(tmp_path / "run.sh", os.X_OK)
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:  # fallback: every flag is defined in the installed arguments.py source
        import importlib.util

        src = open(importlib.util.find_spec("megatron.training").submodule_search_locations[0] + "/arguments.py").read()
        missing = [f for f in flags if f.startswith("--") and f"'{f}'" not in src and f'"{f}"' not in src]
        assert not missing, missing
        return
    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(flags)
    m = preset("llama3_1b")
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (m.layers, m.hidden, m.ffn_hidden)
    assert (args.num_attention_heads, args.num_query_groups, args.group_query_attention) == (m.heads, m.kv_heads, True)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.sequence_parallel and args.use_distributed_optimizer and args.overlap_grad_reduce
    assert not args.overlap_param_gather
    assert (args.micro_batch_size, args.global_batch_size, args.seq_length) == (1, 16, m.seq_len)
    assert args.bf16 and args.swiglu and args.untie_embeddings_and_output_weights
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
    assert args.rotary_base == 500000 and args.clip_grad == 1.0
    # the vocab as configured, padded by Megatron-LM itself to the multiple the ledger pads to
    assert (args.vocab_size, args.make_vocab_size_divisible_by) == (m.vocab, 128)
    assert args.transformer_impl == "transformer_engine"  # mode=dry's default, what the ledger predicted


@pytest.mark.parametrize("dp,bucket", [(2, None), (3, 100_000), (4, 40_000), (16, 1_000_000)])
def test_owned_sizes_by_bisection_equal_the_range_walk(dp, bucket):
    shape = preset("llama3_1b") if dp == 16 else ModelShape(layers=2, hidden=208, ffn_hidden=624, heads=8,
                                                              kv_heads=2, vocab=1030, seq_len=32)
    for stage in range(2):
        params = PL.stage_params(shape, 2, 2, stage)
        buckets = B.buffer_layout(params, bucket, dp, True)
        buf = B.build_buffer(np.array([n for _, n in params]), bucket, dp, True)
        assert [(int(a), int(b)) for a, b in zip(buf.bstart, buf.bend)] == [(b.start, b.end) for b in buckets]
        for r in range(dp):
            walk = B.shard_ranges(buckets, dp, r)
            assert B.owned_sizes([buf], dp, r) == (sum(n for _, n in walk), len(walk))


@pytest.mark.parametrize("dp,bucket,tp", [(2, None, 1), (3, 1_000, 2), (4, 40_000, 1), (16, 3_000, 2), (64, 20_000, 1),
                                          (128, None, 2), (1000, 50_000, 1), (96, 100, 1)])
def test_heaviest_dp_rank_is_the_max_over_every_rank(dp, bucket, tp):
    """The sparse search (ranks around param bounds and padding only) finds the rank a walk over
    every DP rank finds, including tiny buckets whose DP ranges fall wholly into padding."""
    for tied in (False, True):
        shape = ModelShape(layers=3, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=32,
                           tied_embeddings=tied)
        for stage, vp in ((0, 1), (1, 1), (0, 2)):
            pp = 2 if vp == 1 else 1
            # tied: the shared-embedding buckets of pp = 2 (none with pp = 1)
            bufs = [B.build_buffer(np.array([n for _, n in PL.stage_params(shape, tp, pp, stage, vp, ch)]),
                                   bucket if ch == 0 else None, dp, True, *PL.shared_embedding(shape, pp, stage, vp, ch))
                    for ch in range(vp)]
            for w in ((12, 4), (8, 4), (0, 1)):
                scores = [w[0] * e + w[1] * k for e, k in (B.owned_sizes(bufs, dp, r) for r in range(dp))]
                assert B.heaviest_dp_rank(bufs, dp, *w) == scores.index(max(scores)), (tied, stage, vp, w)


@pytest.mark.parametrize("kw", [dict(pp=1, dp=8), dict(pp=2, dp=4), dict(pp=4, dp=2, global_batch_size=8),
                                dict(pp=2, vp=2, dp=3, global_batch_size=6), dict(tp=2, pp=3, dp=5),
                                dict(tp=2, pp=3, dp=5, sequence_parallel=True),
                                dict(tp=2, pp=2, vp=2, dp=2, sequence_parallel=True, global_batch_size=4)])
def test_per_gpu_is_the_most_loaded_of_every_rank(kw):
    """Also with the TransformerEngine spec, whose "mpu" buffer (SP) only the last stage keeps."""
    te = "transformer_engine"
    for tied in (False, True):
        shape = ModelShape(layers=12, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=32,
                           tied_embeddings=tied)
        for fw in (_fw(overlap_grad_reduce=True, bucket_size=30_000), _fw(), _fw(use_distributed_optimizer=False),
                   _fw(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=30_000),
                   _fw(overlap_grad_reduce=True, bucket_size=30_000, transformer_impl=te),
                   _fw(use_distributed_optimizer=False, transformer_impl=te)):
            lay = _lay(**kw)
            pl = L.place(shape, lay, fw)
            every = [pl.rank_state(r) for r in range(lay.world)]
            best = max(s.resident_bytes for s in every)
            assert pl.per_gpu.resident_bytes == best
            assert pl.per_gpu is next(s for s in every if s.resident_bytes == best)  # the first on ties


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_70b"])
def test_build_buffer_period_copies_the_searched_buckets(name):
    """build_buffer with `period` (bucket runs copied across identical layers) gives the buffer the
    plain bucket search gives, for bucket sizes from one param per bucket to buckets spanning layers."""
    import dataclasses

    for tied in (False, True):
        model = dataclasses.replace(preset(name), tied_embeddings=tied)
        per_layer = sum(n for _, n in PL.pieces(model, 1)[1])
        for tp, pp, dp in ((1, 1, 8), (2, 2, 3), (1, 4, 64), (2, 1, 1000)):
            if model.layers % pp:
                continue
            for bucket in (1, per_layer // 7, per_layer // 2 + 1, per_layer, 3 * per_layer + 5, None):
                for stage in sorted({0, pp - 1}):
                    n, first, last = PL.stage_shape(model, pp, stage, 1, 0)
                    shared = model.tied_embeddings and not (first and last)
                    args = (PL.sizes(model, tp, n, first, last), bucket, dp, True, shared and first, shared and last)
                    plain = B.build_buffer(*args)
                    fast = B.buffer(model, tp, n, first, last, bucket, dp, True)
                    for f in ("starts", "ends", "bstart", "bend", "first", "prefix", "n"):
                        assert np.array_equal(getattr(plain, f), getattr(fast, f)), (tied, tp, pp, dp, bucket, stage, f)


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_70b"])
def test_contiguous_ranks_equal_owned_sizes_of_every_rank(name):
    """The closed form for buffers without alignment padding (_contiguous_ranks) gives every DP rank
    the elements and pieces the bisection over its ranges (owned_sizes) gives, for one bucket and
    many, DP ranges inside one param or spanning many, and buckets that leave ranks empty."""
    import dataclasses

    for tied in (False, True):
        model = dataclasses.replace(preset(name), tied_embeddings=tied)
        per_layer = sum(n for _, n in PL.pieces(model, 1)[1])
        for tp, pp, dp in ((1, 1, 8), (2, 2, 3), (1, 4, 96), (2, 1, 1000), (1, 2, 1)):
            if model.layers % pp:
                continue
            for bucket in (1, per_layer // 7, per_layer + 5, None):
                for stage in sorted({0, pp - 1}):
                    n, first, last = PL.stage_shape(model, pp, stage, 1, 0)
                    buf = B.buffer(model, tp, n, first, last, bucket, dp, True)
                    assert buf.contiguous
                    e, p = B._contiguous_ranks(buf, dp)
                    want = [B._owned_sizes.__wrapped__((buf,), dp, r) for r in range(dp)]
                    assert list(zip(e.tolist(), p.tolist())) == want, (tied, tp, pp, dp, bucket, stage)


def test_alignment_padding_makes_a_buffer_non_contiguous():
    shape = ModelShape(layers=2, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=32)
    assert not B.buffer(shape, 1, 2, True, True, None, 4, True).contiguous
    assert B.buffer(shape, 1, 2, True, True, None, 4, False).contiguous  # no padding without the dist-opt


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_70b"])
def test_chunk_summary_walks_the_buckets_the_buffer_has(name):
    """_chunk_summary (the bucket walk over a chunk's pattern, no per-param arrays) gives the numel,
    elements, params, DP-range elements and buckets of the buffer build_buffer makes: tied or not, bucketed
    or one bucket, with or without the distributed optimizer's padding, odd shapes included."""
    import dataclasses

    odd = ModelShape(layers=6, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=32)
    for model in (preset(name), dataclasses.replace(preset(name), tied_embeddings=True), odd):
        per_layer = sum(n for _, n in PL.pieces(model, 1)[1])
        for tp, dp in ((1, 8), (2, 3), (1, 1000)):
            for layers, first, last in ((2, True, True), (2, True, False), (2, False, True), (1, False, False),
                                        (0, True, False), (0, False, True)):
                for bucket in (1, per_layer // 7, per_layer + 5, 10 * per_layer, None):
                    for dist_opt in (True, False):
                        buf = B.buffer(model, tp, layers, first, last, bucket, dp, dist_opt)
                        got = H._chunk_summary(model, tp, layers, first, last, bucket, dp, dist_opt)
                        want = (buf.numel, int(buf.prefix[-1]), len(buf.starts), int(((buf.bend - buf.bstart) // dp).sum()),
                                len(buf.bstart))
                        assert got == want, (model.name, tp, dp, layers, first, last, bucket)


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_70b"])
def test_stage_best_from_the_pattern_is_the_buffers_best(name):
    """_stage_best (contiguous stages from their pattern's offsets and bucket walk, no buffer built)
    finds the DP rank, elements and pieces _best_rank finds on the built buffers: bucketed or not,
    tied (shared-embedding buckets) or not."""
    import dataclasses

    for tied in (False, True):
        model = dataclasses.replace(preset(name), tied_embeddings=tied)
        for tp, pp, dp, vp in ((1, 2, 8, 1), (2, 4, 3, 1), (1, 2, 96, 1), (1, 4, 1000, 1), (1, 2, 4, 2)):
            if model.layers % (pp * vp):
                continue
            for fw in (_fw(), _fw(overlap_grad_reduce=True, bucket_size=50_000)):
                k = K.knobs(fw)
                for st in range(pp):
                    want = B.best_rank(L._stage_buffers(model, tp, pp, dp, vp, k, st), dp, *K.optim_weights(k))
                    assert L._stage_best(model, tp, pp, dp, vp, k, st) == want, (tied, tp, pp, dp, vp, st)


def _comm_by_builder(model, lay, k, stage):
    """The collectives of a stage's step as _comm computed them before its plan: every call added to a
    CommBuilder per layout (CommBuilder.add_each / add / add_p2p), the reference _comm_plan is checked
    against."""
    from ledger.placement import CommBuilder

    tp, pp, m, vp = lay.tp, lay.pp, lay.num_microbatches, lay.vp
    cb = CommBuilder()
    layers, sp = model.layers // pp, lay.sequence_parallel
    C._fixed_comm(lambda dim, kind, dtype, what, group, buffers: cb.add_each(dim, kind, buffers, group, dtype, what),
                  model, tp, pp, lay.dp, vp, k, H.stage_class(pp, stage), sp)
    pdt = K.dtypes(k)[0]
    first, last = stage == 0, stage == pp - 1
    sbh = model.seq_len * lay.micro_batch_size * model.hidden * (2 if k.precision == "bf16" else 4)
    if sp:
        ag, rs = 6 * layers + first + 2 * last, 4 * layers + first + last
        cb.add("tp", "all_gather", sbh, tp, pdt, count=ag * m, what="SP all-gather (layers.py/mappings.py)")
        cb.add("tp", "reduce_scatter", sbh, tp, pdt, count=rs * m, what="SP reduce-scatter (layers.py/mappings.py)")
    else:
        cb.add("tp", "all_reduce", sbh, tp, pdt, count=(4 * layers + first + last) * m, what="TP all-reduce (mappings.py)")
    if last:
        cb.add("tp", "all_reduce", model.seq_len * lay.micro_batch_size * 4, tp, "fp32", count=3 * m,
               what="vocab-parallel cross-entropy")
    shard = sbh // (tp if sp else 1)
    if pp > 1 and vp > 1:
        n = 2 * m * vp - m * first - m * last
        what = "activations / activation grads, interleaved (schedules.py, p2p_communication.py)"
        cb.add_p2p("pp", sent_bytes=shard, received_bytes=0, dtype=pdt, what=what, times=n)
        cb.add_p2p("pp", sent_bytes=0, received_bytes=shard, dtype=pdt, what=what, times=n)
    elif pp > 1:
        cb.add_p2p("pp", sent_bytes=shard, received_bytes=shard, dtype=pdt,
                   what="activations / activation grads (p2p_communication.py)", times=((not last) + (not first)) * m)
    return cb.build()


def test_comm_plan_counts_what_a_builder_per_layout_counts():
    """_comm (the stage's cached plan, its per-micro-batch calls counted per layout) equals every call
    added to a CommBuilder per layout: records merged by (dim, kind, dtype) with their names, bytes
    floored per call (SP shards, odd shapes), one micro-batch or many."""
    odd = ModelShape(layers=8, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=24, name="odd")
    for model in (preset("tiny"), dataclasses.replace(preset("tiny"), tied_embeddings=True), odd):
        for fw in (_fw(), _fw(precision="fp32"), _fw(grad_reduce_in_fp32=False, use_distributed_optimizer=False),
                   _fw(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=1000), _fw(clip_grad=0.0)):
            k = K.knobs(fw)
            for tp, pp, dp, vp in ((1, 1, 1, 1), (2, 1, 3, 1), (1, 2, 1, 1), (2, 4, 2, 1), (2, 2, 1, 2), (1, 4, 3, 2)):
                for sp, mbs, gbs in ((False, 1, -1), (tp > 1, 3, 12 * dp * pp), (tp > 1, 2, 2 * dp)):
                    lay = _lay(tp=tp, pp=pp, dp=dp, vp=vp, sequence_parallel=sp, micro_batch_size=mbs,
                               global_batch_size=gbs)
                    for stage in range(pp):
                        got = [c.to_dict() for c in C.comm(model, lay, k, stage)]
                        want = [c.to_dict() for c in _comm_by_builder(model, lay, k, stage)]
                        assert got == want, (model.name, fw, lay, stage)


def _runs(*sizes):
    """A _pattern of runs (head, layer, tail) of these contiguous param sizes."""
    out = []
    for n in sizes:
        c = np.concatenate(([0], np.cumsum(n, dtype=np.int64))).tolist()
        out.append((tuple(n), c, [c[i] + x for i, x in enumerate(n)]))
    return tuple(out)


def test_one_bucket_best_is_the_argmax_over_every_rank():
    """_one_bucket_best (a stage of one-bucket chunks: its heaviest DP rank from their patterns, no
    per-rank arrays) picks the rank, elements and pieces the argmax over _tiled_ranks' arrays summed
    over the chunks picks: params smaller and larger than a DP range, ranges starting on param starts,
    head and tail params, a remainder rank heavier or lighter than the full ones, ties (the lowest
    rank), no params, no layers; two and three chunks (repeating one layer, as a stage's chunks do)
    whose remainders fall on different ranks (one chunk padded past several DP ranges)."""
    rng = np.random.default_rng(0)
    cases = [(_runs((), (64,), ()), 1), (_runs((128,), (3968,), ()), 1), (_runs((), (64, 64, 64, 64), (3840,)), 1),
             (_runs((), (128, 2, 10), (114,)), 1),  # a tie at dp 2 (weights 1, 1)
             (_runs((), (64,), ()), 0)]
    for layers in (1, 3, 17):
        for _ in range(4):
            head, layer, tail = (tuple(int(x) for x in rng.integers(1, 40, n) * 64) for n in (2, 6, 1))
            cases += [(_runs(head, layer, tail), layers), (_runs((), layer, tail), layers), (_runs(head, layer, ()), layers)]
    model = preset("llama3_70b")
    cases += [(H.pattern(model, tp, first, last, True), layers) for tp in (1, 8) for first, last in ((True, False), (False, True))
              for layers in (5, 40)]
    # a stage's chunks repeat one layer: the other chunks take the first's layer run and count
    stages = [[c] for c in cases] + [[cases[i], cases[j]] for i, j in rng.integers(0, len(cases), (20, 2))] + \
             [[cases[i], cases[j], cases[k]] for i, j, k in rng.integers(0, len(cases), (10, 3))]
    stages = [[((h, stage[0][0][1], t), stage[0][1]) for (h, _, t), _ in stage] for stage in stages]
    for stage in stages:
        cums = [H.pattern_cum(parts, layers) for parts, layers in stage]
        layer, layers = stage[0][0][1], stage[0][1]
        for dp in (1, 2, 3, 8, 64, 1000):
            div = np.lcm(dp, 128)
            for extra in ((0,), (1,), (5,), (0, 3), (2, 0, 1)):
                numels = [int(-(-max(int(cum[-1]), 1) // div) * div) + x * div for cum, x in zip(cums, extra * 3)]
                for w in ((12, 4), (8, 4), (1, 1000), (1, 1)):
                    e = p = 0
                    for cum, numel in zip(cums, numels):
                        ce, cp = B.tiled_ranks(cum, np.array([0]), np.array([0]), np.array([numel]), dp)
                        e, p = e + ce, p + cp
                    d = int(np.argmax(w[0] * e + w[1] * p))
                    chunks = [(head, tail, numel) for ((head, _, tail), _), numel in zip(stage, numels)]
                    got = L._one_bucket_best(layer, layers, chunks, dp, *w)
                    assert got == (d, int(e[d]), int(p[d])), (stage, dp, numels, w)


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_70b"])
def test_chunk_bound_bounds_the_summary(name):
    """_chunk_bound (no bucket walk) is an upper bound of _chunk_summary's numel and DP range elements,
    with its elements and params exact (numel too without the distributed optimizer): tied or not,
    bucketed or one bucket, padding, sizes whose gcd does not divide the 64-element alignment, buckets
    smaller than a param; a bound below the summary breaks the most-loaded search (_most_loaded would
    skip a stage that can hold the heaviest rank)."""
    odd = ModelShape(layers=6, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=32)
    # sizes all multiples of 3, whose gcd does not divide the 64-element alignment
    threes = ModelShape(layers=6, hidden=96, ffn_hidden=288, heads=3, kv_heads=1, vocab=999, seq_len=24)
    for model in (preset(name), dataclasses.replace(preset(name), tied_embeddings=True), odd, threes):
        per_layer = sum(n for _, n in PL.pieces(model, 1)[1])
        for tp, dp in ((1, 8), (2, 3), (1, 1000)):
            for layers, first, last in ((2, True, True), (2, True, False), (2, False, True), (1, False, False)):
                for bucket in (1, per_layer // 7, per_layer + 5, 10 * per_layer, None):
                    for dist_opt in (True, False):
                        numel, real, params, full, _ = H._chunk_summary(model, tp, layers, first, last, bucket, dp,
                                                                        dist_opt)
                        b = H.chunk_bound(model, tp, layers, first, last, bucket, dp, dist_opt)
                        assert b[0] >= numel and b[1:3] == (real, params) and b[3] >= full, (model.name, tp, dp, bucket)
                        if not dist_opt:
                            assert b[0] == numel


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_70b"])
def test_tiled_best_is_the_argmax_over_every_rank(name):
    """_tiled_best (a bucketed buffer's heaviest DP rank without per-rank arrays where every rank but
    the last owns full ranges) picks the rank, elements and pieces the argmax over _tiled_ranks'
    arrays picks: many buckets or few, ranges past the params (the arrays' way), dp 1, tied buckets."""
    checked = 0
    for tied in (False, True):
        model = dataclasses.replace(preset(name), tied_embeddings=tied)
        per_layer = sum(n for _, n in PL.pieces(model, 1)[1])
        for tp, layers, first, last in ((1, 2, True, True), (1, 2, True, False), (2, 2, False, True), (1, 1, False, False)):
            if not H.chunk_contiguous(model, tp, first, last):
                continue
            cum = H.pattern_cum(H.pattern(model, tp, first, last, True), layers)
            for bucket in (per_layer // 7, per_layer // 2, per_layer + 5, None):
                for dp in (1, 2, 3, 8, 64, 1000):
                    buckets = H.chunk_buckets(model, tp, layers, first, last, bucket, dp, True)
                    for w in ((12, 4), (1, 1000), (1, 1)):
                        e, p = B.tiled_ranks(cum, *buckets, dp)
                        d = int(np.argmax(w[0] * e + w[1] * p))
                        assert L._tiled_best(cum, *buckets, dp, *w) == (d, int(e[d]), int(p[d])), (tied, tp, bucket, dp, w)
                        checked += 1
    assert checked


def test_chunk_contiguous_is_the_buffers_contiguity():
    """_chunk_contiguous (from the pattern's totals) says what the built distributed-optimizer buffer's
    contiguous says (build_buffer: no param's aligned size exceeds its size): shapes with and without
    alignment padding, every chunk kind."""
    odd = ModelShape(layers=6, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=32)
    seen = set()
    tied = dataclasses.replace(preset("llama3_70b"), tied_embeddings=True)
    for model in (preset("tiny"), preset("llama3_70b"), tied, odd):
        for tp in (1, 2, 8):
            for first, last in ((True, True), (True, False), (False, True), (False, False)):
                want = B.buffer(model, tp, 1, first, last, None, 8, True).contiguous
                assert H.chunk_contiguous(model, tp, first, last) == want, (model.name, tp, first, last)
                seen.add(want)
    assert seen == {True, False}


# -- the vocab padding -----------------------------------------------------------------------------
@pytest.mark.parametrize("divisible_by", [1, 64, 128])
def test_padded_vocab_is_megatrons_vocab_size_with_padding(divisible_by):
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    for vocab in (1, 999, 1001, 1024, 1030, 128256):
        for tp in (1, 2, 3, 4, 8):
            args = types.SimpleNamespace(make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp,
                                         rank=1)
            assert PL.padded_vocab(vocab, tp, divisible_by) == vocab_size_with_padding(vocab, args), (vocab, tp)


def test_llama3_8b_tp8_predicts_the_padded_embedding(tmp_path):
    """mode=predict model=llama3_8b framework=megatron layout.tp=8: Megatron-LM trains 129,024 vocab rows
    (128,256 padded to a multiple of 128 x 8), so each rank holds 129024 x 4096 / 8 elements of the
    embedding and of the output layer: the prediction is the one of a vocab of 129,024 and exceeds an
    unpadded one (make_vocab_size_divisible_by=1) by exactly those rows, in params and in grads."""
    import json

    p = launch("mode=predict", "model=llama3_8b", "framework=megatron", "layout.tp=8",  # dp=-1: one replica
               "framework.use_distributed_optimizer=true", f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    pred = json.load(open(tmp_path / "prediction.json"))
    m, lay = preset("llama3_8b"), _lay(tp=8, dp=1)
    assert PL.padded_vocab(m.vocab, 8, 128) == 129024
    te = "transformer_engine"  # mode=predict's default (default_transformer_impl)
    padded = L.place(dataclasses.replace(m, vocab=129024), lay, _fw(transformer_impl=te)).to_dict()
    unpadded = L.place(m, lay, _fw(make_vocab_size_divisible_by=1, transformer_impl=te)).to_dict()
    assert pred["spec"] == te and pred["rank_classes"] == padded["rank_classes"]
    assert "transformer_engine" in p.stdout  # the printed table says which spec it predicts
    assert pred["layout"]["dp"] == 1
    rows = 129024 * 4096 // 8 - 128256 * 4096 // 8  # per rank, embedding and output layer each
    r, u = pred["rank_classes"][0], unpadded["rank_classes"][0]  # TP ranks hold equal shapes
    assert (r["params_bytes"] - u["params_bytes"], r["grads_bytes"] - u["grads_bytes"]) == (2 * 2 * rows, 2 * 4 * rows)
    assert any("vocab 128256 padded to 129024 rows" in n for n in pred["notes"])
    emb = [n for name, n in PL.stage_params(dataclasses.replace(m, vocab=129024), 8, 1, 0) if "word_embeddings" in name]
    assert emb == [129024 * 4096 // 8]


def test_vocab_not_divisible_by_tp_is_padded_for_megatron_only():
    """Megatron pads vocab 1001 at tp=2 to 1024 rows (and trains it); torchtitan shards the vocab as it
    is (torch.chunk rows, tests/test_titan.py); textbook mode predicts Megatron unpadded."""
    from ledger.layout import validate
    from ledger.parallel import place

    odd = dataclasses.replace(preset("tiny"), vocab=1001)
    lay = _lay(tp=2, dp=1)
    validate(odd, lay, "megatron", _fw())
    assert L.place(odd, lay, _fw()).to_dict()["rank_classes"] == L.place(preset("tiny"), lay, _fw()).to_dict()["rank_classes"]
    validate(odd, lay, "titan")  # 501 and 500 rows per TP rank
    textbook = place(odd, None, _Cfg(framework=_fw(), layout=lay, ledger=_Cfg(mode="textbook")))
    assert textbook.per_gpu.params_bytes == 2 * (odd.num_params() // 2)


# -- transformer_impl ------------------------------------------------------------------------------
def test_transformer_engine_spec_keeps_no_attention_scores():
    """The local spec's DotProductAttention keeps [b*heads/tp, s, s] in GlobalMemoryBuffer; with the TE
    spec nothing is there without SP, and with SP only the output layer's [s, b, h] all-gather, on the
    last stage. Every other state and every collective is the same."""
    m = preset("tiny")
    te = "transformer_engine"
    for kw in (dict(tp=2, dp=1), dict(dp=2, micro_batch_size=2)):
        lay = _lay(**kw)
        local, eng = L.place(m, lay, _fw()).rank_state(0), L.place(m, lay, _fw(transformer_impl=te)).rank_state(0)
        scores = 2 * lay.micro_batch_size * m.heads // lay.tp * m.seq_len ** 2
        assert local.other_bytes - eng.other_bytes == scores == local.detail["other/global memory buffer (mpu)"]
        assert "other/global memory buffer (mpu)" not in eng.detail
        assert (local.params_bytes, local.grads_bytes, local.optim_bytes, local.comm) == (
            eng.params_bytes, eng.grads_bytes, eng.optim_bytes, eng.comm)
    lay = _lay(tp=2, pp=2, dp=1, sequence_parallel=True)
    pl = L.place(m, lay, _fw(transformer_impl=te))
    first, last = pl.rank_state(0), pl.rank_state(2)
    assert "other/global memory buffer (mpu)" not in first.detail
    assert last.detail["other/global memory buffer (mpu)"] == 2 * m.seq_len * m.hidden
    assert pl.spec == te and any("transformer_impl=transformer_engine" in n for n in pl.notes)


def test_transformer_impl_defaults_by_mode_and_is_recorded(tmp_path):
    """null: the spec the prediction's target builds (ledger/faithful/megatron/target.py): transformer_engine
    to predict or dry-run for a GPU cluster (run.sh's), local to run on this machine or to predict the CPU
    harness; the record and the printed table say which; a CPU run of the TE spec is refused, naming the
    knob, and so is a cpu-gloo prediction of it."""
    import json

    from omegaconf import OmegaConf

    from conf.schema import ClusterConfig, JobConfig, MegatronConfig
    from launchers.job import fill_mode_defaults

    for mode, target, impl in (("predict", None, "transformer_engine"), ("dry", None, "transformer_engine"),
                               ("run", None, "local"), ("predict", "cpu-gloo", "local"),
                               ("dry", "cuda-nccl", "transformer_engine")):
        cfg = OmegaConf.structured(JobConfig(mode=mode, framework=MegatronConfig(),
                                             cluster=ClusterConfig(name="x", target=target)))
        fill_mode_defaults(cfg)
        assert cfg.framework.transformer_impl == impl, (mode, target)
    p = launch("mode=predict", "framework=megatron", "model=tiny", "layout.dp=1", f"hydra.run.dir={tmp_path}",
               timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "megatron (faithful, transformer_engine, for cuda-nccl) tiny" in p.stdout
    rec = json.load(open(tmp_path / "record.json"))
    assert rec["config"]["framework"]["transformer_impl"] == "transformer_engine"
    assert rec["prediction"]["spec"] == "transformer_engine"
    p = launch("framework=megatron", "framework.transformer_impl=transformer_engine", f"hydra.run.dir={tmp_path}/r",
               timeout=300)
    assert p.returncode == 2 and "transformer_impl=transformer_engine needs CUDA" in p.stderr, p.stderr[-2000:]
    p = launch("mode=predict", "framework=megatron", "framework.transformer_impl=transformer_engine", "cluster=local_cpu",
               f"hydra.run.dir={tmp_path}/c", timeout=300)
    assert p.returncode == 2 and "the prediction's target is cpu-gloo" in p.stderr, p.stderr[-2000:]
    p = launch("mode=predict", "framework=megatron", "framework.transformer_impl=fused", f"hydra.run.dir={tmp_path}/f",
               timeout=300)
    assert p.returncode == 2 and "framework.transformer_impl='fused' must be local or transformer_engine" in p.stderr


# -- the pipeline split ----------------------------------------------------------------------------
def _splits():
    for first in (None, 1, 2, 3):
        for last in (None, 1, 2):
            yield first, last, False, False
    yield from ((None, None, True, False), (None, None, False, True), (None, None, True, True), (1, None, True, False))


def test_pipeline_split_is_megatrons_own():
    """split_error refuses exactly the splits megatron-core 0.18.0 refuses, with its reason (TransformerConfig
    __post_init__, else get_num_layers_to_build's asserts), and stage_layers builds what
    get_num_layers_to_build builds on every stage and model chunk, over layers, pp, vp and every split."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    def squash(x):
        return "".join(str(x).split())

    built = refused = 0
    for layers in (1, 3, 4, 5, 6, 8):
        for pp in (1, 2, 3, 4):
            for vp in ((1, 2) if pp > 1 else (1,)):
                for split in _splits():
                    why = PL.split_error(layers, pp, vp, split)
                    try:
                        cfg = TransformerConfig(
                            num_layers=layers, hidden_size=64, num_attention_heads=4, activation_func=F.gelu,
                            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                            virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                            num_layers_in_first_pipeline_stage=split[0], num_layers_in_last_pipeline_stage=split[1],
                            account_for_embedding_in_pipeline_split=split[2],
                            account_for_loss_in_pipeline_split=split[3])
                        got = {(st, ch): get_num_layers_to_build(cfg, vp_stage=ch if vp > 1 else None, pp_rank=st)
                               for st in range(pp) for ch in range(vp)}
                    except (ValueError, AssertionError) as e:
                        assert why is not None and squash(why) == squash(e), (layers, pp, vp, split, why, e)
                        refused += 1
                        continue
                    assert why is None, (layers, pp, vp, split, why)
                    assert got == {(st, ch): PL.stage_layers(layers, pp, vp, st, ch, split)
                                   for st in range(pp) for ch in range(vp)}, (layers, pp, vp, split)
                    built += 1
    assert built > 50 and refused > 50, (built, refused)


def test_uneven_pipeline_is_validated_with_megatrons_reason():
    from ledger.layout import validate

    model = dataclasses.replace(preset("tiny"), layers=3)
    validate(model, _lay(pp=2, dp=1), "megatron", _fw(decoder_first_pipeline_num_layers=1))
    with pytest.raises(ConfigError, match="num_layers=3 should be divisible by config.pipeline_model_parallel_size=2"):
        validate(model, _lay(pp=2, dp=1), "megatron", _fw())
    with pytest.raises(ConfigError, match="Mismatch: 1 middle layers remaining but 0 middle PP stages"):
        validate(model, _lay(pp=2, dp=1), "megatron", _fw(decoder_first_pipeline_num_layers=1,
                                                          decoder_last_pipeline_num_layers=1))
    with pytest.raises(ConfigError, match="cannot be set at the same time"):
        validate(model, _lay(pp=2, dp=1), "megatron", _fw(decoder_first_pipeline_num_layers=1,
                                                          account_for_loss_in_pipeline_split=True))
    # torchtitan splits layers + 2 its own way (3 layers over pp2: the embedding + 1, 2 + the head)
    validate(model, _lay(pp=2, dp=1), "titan")


@pytest.mark.parametrize("split,layers", [(dict(decoder_first_pipeline_num_layers=1), (1, 2)),
                                          (dict(decoder_last_pipeline_num_layers=1), (2, 1)),
                                          (dict(account_for_embedding_in_pipeline_split=True), (1, 2)),
                                          (dict(account_for_loss_in_pipeline_split=True), (2, 1))])
def test_uneven_stages_hold_their_layers(split, layers):
    """3 layers over pp2: each stage's params, its grad buffer and its SP/TP calls follow its own layers
    (the first stage's embedding, the last's head on top of them)."""
    model = dataclasses.replace(preset("tiny"), layers=3)
    lay = _lay(pp=2, tp=2, dp=1, sequence_parallel=True)
    pl = L.place(model, lay, _fw(**split))
    sp = K.pp_split(_fw(**split))
    for stage, n in enumerate(layers):
        params = PL.stage_params(model, 2, 2, stage, split=sp)
        assert sum(name.endswith("self_attention.linear_qkv.weight") for name, _ in params) == n
        s = pl.rank_state(stage * 2)
        assert s.grads_bytes == 4 * sum(k for _, k in params)  # one bucket, 2*... aligned: dp=1 pads nothing
        ag = next(c for c in s.comm if (c.dim, c.kind) == ("tp", "all_gather"))
        assert ag.count == lay.num_microbatches * (6 * n + (1 if stage == 0 else 2))


@pytest.mark.real  # runs the framework's own code (its argument parser, or torch.distributed in a process)
@pytest.mark.parametrize("over,want", [
    (("framework.decoder_first_pipeline_num_layers=1",), (1, None, False, None)),
    (("framework.account_for_embedding_in_pipeline_split=true", "layout.vp=2", "layout.global_batch_size=2"),
     (None, None, True, 2))])
def test_dry_passes_the_pipeline_split_to_megatron_lm(tmp_path, over, want):
    p = launch("mode=dry", "framework=megatron", "model.layers=3", "layout.pp=2", "layout.dp=1", *over,
               "cluster=local_gpu", "cluster.ranks=2", f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    flags = _run_sh_flags(str(tmp_path / "run.sh"))
    from megatron.training.arguments import add_megatron_arguments

    args = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(flags)
    assert (args.num_layers, args.pipeline_model_parallel_size) == (3, 2)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
            args.account_for_embedding_in_pipeline_split, args.num_virtual_stages_per_pipeline_rank) == want


@pytest.mark.parametrize("dp,bucket", [(2, None), (3, 1000), (8, 40_000), (16, 7_777)])
def test_owned_per_rank_is_each_ranks_owned_sizes(dp, bucket):
    """The distributed optimizer's shard of every DP rank at once (owned_per_rank, which keys the
    prediction's classes of alike DP ranks) is each rank's own (owned_sizes, the per-rank reference)."""
    fw = megatron_fw(use_distributed_optimizer=True, overlap_grad_reduce=bucket is not None, bucket_size=bucket)
    for stage in (0, 1):
        bufs = tuple(L.stage_buffers(preset("tiny"), megatron_layout(pp=2, dp=dp), fw, stage))
        e, p = B.owned_per_rank(bufs, dp)
        assert [(int(a), int(b)) for a, b in zip(e, p)] == [B.owned_sizes(bufs, dp, d) for d in range(dp)]


def test_alike_dp_ranks_share_a_class_at_any_world():
    """llama3_8b tp8·pp8 over 16,384 DP ranks (a million GPUs): plain DDP's DP ranks are alike (one class
    per stage); the distributed optimizer's TransformerEngine-spec ranks alike where their shards own
    as much (a handful of classes per stage); each class's state is each of its ranks' own."""
    m = preset("llama3_8b")
    lay = megatron_layout(tp=8, pp=8, dp=16_384)
    ddp = L.place(m, lay, megatron_fw(use_distributed_optimizer=False, transformer_impl="transformer_engine"))
    assert len(ddp.to_dict()["rank_classes"]) == 8
    dist = L.place(m, lay, megatron_fw(use_distributed_optimizer=True, transformer_impl="transformer_engine"))
    classes = dist.rank_classes()
    assert len(classes) <= 8 * 8, len(classes)
    # the shared states against each rank's own (rank_state per (stage, DP rank), no sharing)
    te = megatron_fw(use_distributed_optimizer=True, transformer_impl="transformer_engine")
    lay = megatron_layout(tp=8, pp=8, dp=64)
    shared = L.place(m, lay, te)
    trained = L.padded_shape(m, 8, 128)
    for r in range(0, lay.world, 8):
        want = L.rank_state(trained, lay, L.knobs(te), r // (8 * 64), r // 8 % 64)
        got = shared.rank_state(r)
        assert (got.resident_bytes, got.detail, got.peak.to_dict()) == (want.resident_bytes, want.detail, want.peak.to_dict()), r
