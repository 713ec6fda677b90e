"""cluster=fake: the layout's world as torch's fake process group, a few ranks materialised.

Unit tests: which ranks are materialised (rank 0 and each pipeline stage's most-loaded rank, from
the ledger's per-rank prediction, or cluster.fake_ranks), the validation of the cluster fields, the
fake world size. Real tests (marked `real`): one small fake job per framework at a world of 8, one
launch each (module-scoped fixtures): every row of every measured rank reconciles with abs_err 0,
first and steady steps; the record says device fake and which ranks ran; every fake shim and
every declared data-dependent read site is reached, and nothing else.
"""
from __future__ import annotations

import json
import os

import pytest

import records
from analysis.compare import is_peak
from analysis.reconcile import table
from conf.schema import register
from launchers.fake import select_ranks
from launchers.job import check, world_of
from ledger.layout import ConfigError
from tests.conftest import launch, compose_config

register()


_compose = compose_config


def _placement(*overrides):
    cfg = _compose("cluster=fake", *overrides)
    return cfg, check(cfg)[2]


# -- which ranks ---------------------------------------------------------------------------------
def test_select_ranks_one_per_stage_and_rank0():
    """Megatron TP2·PP2·DP2: rank 0 and stage 1's most-loaded rank (the last stage holds the output
    layer); the rank chosen in each stage holds the stage's largest predicted resident bytes."""
    cfg, pl = _placement("framework=megatron", "layout.tp=2", "layout.pp=2", "layout.dp=2")
    ranks = select_ranks(pl)
    assert 0 in ranks and len(ranks) == 2
    by_stage = {}
    for r in range(pl.world):
        by_stage.setdefault(pl.rank_state(r).stage, []).append(pl.rank_state(r).resident_bytes)
    for r in ranks:
        s = pl.rank_state(r)
        assert s.resident_bytes == max(by_stage[s.stage])
    assert {pl.rank_state(r).stage for r in ranks} == {0, 1}


def test_select_ranks_pure_dp_is_rank0():
    """Every DP rank of a ZeRO-3 layout holds the same state: one rank (0) stands for all eight."""
    _, pl = _placement("framework=deepspeed", "framework.zero_stage=3", "layout.dp=8")
    assert select_ranks(pl) == [0]


def test_select_ranks_uneven_vocab_picks_the_heavier_tp_rank():
    """torchtitan at a vocab tp does not divide: TP rank 0 holds the extra row (torch.chunk), so it
    is the stage's most-loaded and, with rank 0, the only one materialised."""
    _, pl = _placement("framework=titan", "model.vocab=1001", "layout.tp=2", "layout.dp=4")
    assert select_ranks(pl) == [0]
    assert pl.rank_state(0).resident_bytes > pl.rank_state(1).resident_bytes


def test_fake_ranks_given_are_the_ranks_run():
    from launchers.fake import ranks_of

    cfg, pl = _placement("framework=titan", "layout.tp=2", "layout.dp=4", "cluster.fake_ranks=[7,3]")
    assert ranks_of(cfg, pl) == [3, 7]


def test_fake_world_is_the_layouts():
    """The whole layout exists in the fake world: 64 ranks with no cluster.ranks given; the
    cluster's ranks only fill layout.dp=-1."""
    assert world_of(_compose("cluster=fake", "layout.tp=4", "layout.pp=2", "layout.dp=8")) == 64
    assert world_of(_compose("cluster=fake", "layout.tp=2")) == 8  # dp=-1: cluster.ranks (8) / tp
    cfg = _compose("cluster=fake", "framework=megatron", "model=llama3_8b", "layout.tp=4", "layout.pp=2",
                   "layout.dp=8")
    assert check(cfg)[1].world == 64


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,needle", [
    (("cluster.fake_ranks=[8]",), "cluster.fake_ranks has 8: the layout's world is 8 ranks (0..7)"),
    (("cluster.fake_ranks=[-1]",), "cluster.fake_ranks has -1: ranks are integers >= 0"),
    (("cluster.fake_ranks=[1,1]",), "cluster.fake_ranks=[1, 1] lists rank 1 twice"),
    (("cluster.backend=gloo",), "cluster.kind='fake' needs cluster.kind, cluster.backend and cluster.device "
                                "all 'fake' (got cluster.backend='gloo')"),
])
def test_fake_cluster_rejections_name_the_field(overrides, needle):
    cfg = _compose("cluster=fake", "framework=titan", "layout.dp=8", *overrides)
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert needle in str(e.value)


def test_pp_is_accepted_on_the_fake_world():
    """torchtitan's PP runs on FakeTensors (its P2P vote and metadata exchange shimmed: titan_pp_job),
    Megatron's PP and VP too."""
    check(_compose("cluster=fake", "framework=titan", "layout.pp=2", "layout.dp=4", "layout.global_batch_size=8"))
    check(_compose("cluster=fake", "framework=megatron", "layout.pp=2", "layout.vp=2", "layout.dp=4"))


def test_fake_ranks_only_on_a_fake_cluster():
    with pytest.raises(ConfigError, match=r"cluster.fake_ranks=\[0\] is for cluster.kind=fake only"):
        check(_compose("cluster.fake_ranks=[0]"))
    with pytest.raises(ConfigError, match="cluster.device='fake' needs cluster.kind"):
        check(_compose("cluster.device=fake"))


def test_fake_ranks_out_of_range_is_an_invalid_record(tmp_path):
    p = launch("cluster=fake", "framework=titan", "layout.dp=4", "cluster.fake_ranks=[4]", "wandb.mode=disabled",
               f"hydra.run.dir={tmp_path}")
    assert p.returncode == 2
    rec = json.load(open(tmp_path / "record.json"))
    assert rec["status"] == "invalid" and "cluster.fake_ranks has 4" in rec["error"]


# -- one fake job per framework (real frameworks, world 8, small model) ------------------------------
JOBS = {
    "titan": ("framework=titan", "layout.tp=2", "layout.dp=4", "layout.sequence_parallel=true",
              "model.vocab=1001", "cluster.fake_ranks=[1]"),
    # PP over FSDP x TP with SP (torchtitan's 3D layout, its default selective AC), 2 micro-batches: a rank
    # of each stage
    "titan_pp": ("framework=titan", "layout.pp=2", "layout.tp=2", "layout.dp=2", "layout.sequence_parallel=true",
                 "layout.global_batch_size=4", "cluster.fake_ranks=[0,5]"),
    "megatron": ("framework=megatron", "layout.tp=2", "layout.pp=2", "layout.dp=2", "layout.sequence_parallel=true",
                 "framework.overlap_grad_reduce=true", "layout.global_batch_size=4"),
    # ZeRO-1 and ZeRO-3 in one launch (a two-job sweep): their fake shims and read sites differ
    "deepspeed": ("framework=deepspeed", "framework.zero_stage=1,3", "layout.dp=8", "layout.global_batch_size=16"),
}


def _job_ranks(rec):
    d = rec["job_dir"]
    return {r: json.load(open(os.path.join(d, f"rank{r}.json"))) for r in rec["fake"]["measured_ranks"]}


def _fake_job(tmp_path_factory, name):
    d = tmp_path_factory.mktemp(f"fake_{name}")
    launch("cluster=fake", "train.steps=2", "model.seq_len=64", *JOBS[name], f"hydra.run.dir={d}",
           timeout=600, check=True)
    rec = records.load(str(d))[0]
    return rec, _job_ranks(rec)


@pytest.fixture(scope="module")
def titan_job(tmp_path_factory):
    return _fake_job(tmp_path_factory, "titan")


@pytest.fixture(scope="module")
def titan_pp_job(tmp_path_factory):
    return _fake_job(tmp_path_factory, "titan_pp")


@pytest.fixture(scope="module")
def megatron_job(tmp_path_factory):
    return _fake_job(tmp_path_factory, "megatron")


@pytest.fixture(scope="module")
def deepspeed_jobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake_deepspeed")
    launch("-m", "cluster=fake", "train.steps=2", "model.seq_len=64", *JOBS["deepspeed"], f"hydra.sweep.dir={d}",
           timeout=600, check=True)
    return {rec["config"]["framework"]["zero_stage"]: (rec, _job_ranks(rec)) for rec in records.load(str(d))}


def _reconciles(rec, expected_ranks, peaks: str = "reported"):
    """peaks: "exact" (the peak rows too, every step) or "reported" (not asserted)."""
    assert rec["status"] == "ok", rec.get("error")
    assert rec["device"] == "fake" and rec["measurement"]["device"] == "fake"
    assert rec["fake"]["measured_ranks"] == expected_ranks == rec["measurement"]["measured_ranks"]
    df = table([rec])
    assert sorted(df["rank"].unique()) == expected_ranks
    assert set(df.phase) == {"first", "steady"}
    assert set(df.quantity) >= {"params_bytes", "grads_bytes", "optim_bytes", "resident_bytes"}
    assert any(q.startswith("comm/") for q in df.quantity)
    if peaks != "exact":
        # states and collectives to the byte, the first step too; peak rows otherwise reported: Megatron's
        # and torchtitan's peaks model gloo's copies, which a fake world's collectives do not make
        df = df[~df.quantity.map(is_peak)]
    bad = df[df.abs_err != 0]
    assert bad.empty, bad.to_string()


def _declared_reads_reached(ranks, declared):
    for d in ranks.values():
        reached = {(x["module"], x["function"]) for x in d["fake_scalar_reads"]}
        assert reached == declared
        assert all(s.get("loss") is None for s in d["steps"])  # numerics are not measured


@pytest.mark.real
def test_titan_fake_job(titan_job):
    """FSDP4·TP2·SP at vocab 1001 (TP rank 0 holds 501 rows, rank 1 500), cluster.fake_ranks=[1]: the
    lighter TP rank, which the default selection (rank 0, the heavier) does not measure."""
    from launchers import titan_cpu

    rec, ranks = titan_job
    _reconciles(rec, [1])
    for d in ranks.values():
        reached = {k for k in d["cpu_redirects"] if k.startswith("fake_")}
        assert reached == {"fake_to_empty", "fake_cpu_device"}
    _declared_reads_reached(ranks, titan_cpu.fake_scalar_sites(1))


@pytest.mark.real
def test_titan_pp_fake_job(titan_pp_job):
    """PP2 over FSDP2·TP2 with SP (1F1B, 2 micro-batches, selective AC), a rank of each stage: every state
    and collective row exact, step 0's P2P vote and metadata exchange included (the stage boundary a
    Shard(1) DTensor); the vote's read answered (DYNAMIC, as a CPU run votes) and each stage's received
    metadata made by the counted shim, the same receives issued."""
    from launchers import titan_cpu

    rec, ranks = titan_pp_job
    _reconciles(rec, [0, 5])
    for d in ranks.values():
        reached = {k for k in d["cpu_redirects"] if k.startswith("fake_")}
        assert reached == {"fake_to_empty", "fake_cpu_device", "fake_cpu_device_pp_stage", "fake_pp_recv_meta"}
    _declared_reads_reached(ranks, titan_cpu.fake_scalar_sites(2))
    assert titan_cpu.fake_scalar_sites(2) > titan_cpu.fake_scalar_sites(1)


@pytest.fixture(scope="module")
def titan_article_job(tmp_path_factory):
    """The design article's torchtitan run at its full shape (python -m sweeps.article --mode fake)."""
    from sweeps.article import COMMON, RUNS

    d = tmp_path_factory.mktemp("fake_titan_article")
    launch("cluster=fake", "train.steps=2", *COMMON, *RUNS["titan"], f"hydra.run.dir={d}", timeout=600, check=True)
    return records.load(str(d))[0]


@pytest.mark.real
def test_titan_article_run_peaks_at_a_loss_chunk(titan_article_job):
    """Llama-3.2-1B at s=8192, FSDP4·TP2·SP, local batch 2 on the fake world: the steady peak is a loss
    chunk's vocab-parallel cross-entropy backward (titan_peak.at_loss_chunk: four fp32 [2048, 64128]
    buffers beside the lm_head's fp32 grad, the wrapper's chunk copies), which no reduce-scatter joins,
    so the fake world's collectives (no gloo copy) do not move it: within 1% (measured 57,312 B under
    of 27.3 GB: the chunk's index and mask vectors), states and collectives exact. Before this moment
    was modelled the prediction was 3.6% under (the lm_head reduce-scatter moment)."""
    rec = titan_article_job
    _reconciles(rec, [0])
    df = table([rec])
    pk = df[(df.quantity == "peak_bytes") & (df.phase == "steady")]
    assert len(pk) == 1 and abs(pk.rel_err.iloc[0]) <= 0.01, pk.to_string()
    predicted = records.predicted_ranks(rec["prediction"])(0)["peak"]
    where = rec["measurement"]["ranks"][0]["steps"][-1]["peak"]["where"]
    assert "cross-entropy" in predicted["what"] and (where["phase"], where["op"]) == ("backward", "aten.add.Tensor")


@pytest.mark.real
def test_article_fake_prints_the_gpu_run_beside_the_measured(titan_article_job):
    """python -m sweeps.article --mode fake's last table: per measured rank the fake world's steady peak
    (the CPU harness's code) with the caching allocator's simulated reserved peak for its allocations
    (at least the peak: reserved holds every allocated block), the cpu-gloo prediction and the cuda-nccl
    one, with the parts that differ."""
    from ledger.units import fmt
    from sweeps.article import gpu_side_by_side

    rec = titan_article_job
    text = gpu_side_by_side(rec["job_dir"])
    line = next(x for x in text.splitlines() if " rank 0: " in x)
    df = table([rec])
    pk = df[(df.quantity == "peak_bytes") & (df.phase == "steady")]
    measured, predicted = fmt(int(pk.measured.max())), fmt(records.predicted_ranks(rec["prediction"])(0)["peak"]["bytes"])
    head = line.split(" rank 0: ")[1]
    assert head.startswith(f"{measured} [") and f"] | {predicted} | " in head
    sim = max(st["peak"]["cuda_allocator_sim"]["peak_reserved_bytes"]
              for st in rec["measurement"]["ranks"][0]["steps"][1:])
    assert sim >= int(pk.measured.max()) and f"[{fmt(sim)}]" in head
    assert "cuda-nccl - cpu-gloo: " in line and "none" not in line.split("cuda-nccl - cpu-gloo: ")[1]


@pytest.fixture(scope="module")
def titan_article_sac_job(tmp_path_factory):
    """The article's torchtitan run with selective activation checkpointing (torchtitan's per-op SAC)."""
    from sweeps.article import COMMON, RUNS

    d = tmp_path_factory.mktemp("fake_titan_article_sac")
    launch("cluster=fake", "train.steps=2", *COMMON, *RUNS["titan"], "framework.activation_checkpoint=selective",
           f"hydra.run.dir={d}", timeout=600, check=True)
    return records.load(str(d))[0]


@pytest.mark.real
def test_titan_article_run_with_selective_ac_keeps_the_reduce_scatter_outputs(titan_article_sac_job):
    """FSDP4·TP2·SP at s=8192 with selective AC: SAC's save list keeps the outputs of the SP reduce-scatters
    after wo and w2 ([T/tp, h] bf16 each, titan_peak.saved_per_layer) in every block: the steady peak within
    1% (measured 57,312 B over, the loss chunk's index and mask vectors as without AC); without those two
    tensors the prediction is 8.9% under."""
    from ledger.faithful.titan.peak import BF16
    from ledger.model import ModelShape

    rec = titan_article_sac_job
    _reconciles(rec, [0])
    df = table([rec])
    pk = df[(df.quantity == "peak_bytes") & (df.phase == "steady")]
    assert len(pk) == 1 and abs(pk.rel_err.iloc[0]) <= 0.01, pk.to_string()
    m = ModelShape.from_config(rec["config"]["model"])
    lay = rec["config"]["layout"]
    rs_outs = m.layers * 2 * (lay["micro_batch_size"] * m.seq_len // lay["tp"]) * m.hidden * BF16
    assert pk.measured.iloc[0] - (pk.predicted.iloc[0] - rs_outs) > 0.01 * pk.measured.iloc[0]


@pytest.mark.real
def test_megatron_fake_job(megatron_job):
    """TP2·PP2·DP2·SP, distributed optimizer, overlap_grad_reduce, 2 micro-batches: rank 0 and the
    last stage's most-loaded rank; every fake shim reached on both."""
    from launchers import megatron_cpu

    rec, ranks = megatron_job
    assert len(rec["fake"]["measured_ranks"]) == 2
    _reconciles(rec, rec["fake"]["measured_ranks"])
    assert {d["stage"] for d in ranks.values()} == {0, 1}
    for d in ranks.values():
        assert set(d["fake_shims"]) == set(megatron_cpu.FAKE_SHIMS)
    _declared_reads_reached(ranks, megatron_cpu.FAKE_SCALAR_SITES)


@pytest.mark.real
@pytest.mark.parametrize("stage,shims,reads", [
    # ZeRO-3: zero.Init places the params (no engine .to); the trace checks' broadcasts are issued;
    # the grad reduction's flat buffer is one allocation (O(tensors), not O(world x tensors)); a fetch
    # views its own partition and each param's data is one allocation (O(params), not O(world x params))
    (3, {"rank0_list_is_local", "reduce_scatter_coalesced_flat", "allgather_coalesced_wait_whole",
         "allgather_dtype_own_partition"}, {("deepspeed.runtime.utils", "is_invalid_grad_norm")}),
    # ZeRO-1: the engine's module.to(device) and the overflow check's read
    (1, {"module_to_skipped_on_cpu"}, {("deepspeed.runtime.utils", "is_invalid_grad_norm"),
                                        ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.has_overflow")}),
])
def test_deepspeed_fake_job(deepspeed_jobs, stage, shims, reads):
    """DP8, 2 accumulation steps: rank 0 stands for all; the stage's own shims and read sites."""
    from launchers import deepspeed as ds

    rec, ranks = deepspeed_jobs[stage]
    # ZeRO-3 at DP8: every peak is a final norm's forward with the parameters the coordinator replay
    # gathers (step 0: its second micro-batch, the first complete pass), exact
    _reconciles(rec, [0], peaks="exact")
    assert set(ranks[0]["fake_shims"]) == shims
    reached = {(x["module"], x["function"]) for x in ranks[0]["fake_scalar_reads"]}
    assert reached == reads and reached <= ds.FAKE_SCALAR_SITES


@pytest.mark.real
def test_deepspeed_fake_shims_all_reached(deepspeed_jobs):
    from launchers import deepspeed as ds

    reached = set().union(*(set(ranks[0]["fake_shims"]) for _, ranks in deepspeed_jobs.values()))
    assert reached == set(ds.FAKE_SHIMS)


def test_article_judge_holds_the_matrices_contract():
    """sweeps.article --mode fake's verdict: states and collectives exact, every peak row (first and
    steady) within 1%, a peak's parts reported only."""
    import pandas as pd

    from sweeps.article import judge

    def rows(peak_measured, state_measured=100, part_measured=1):
        r = [("j", "megatron", "dp2", 0, 0, "first", "params_bytes", 100, state_measured),
             ("j", "megatron", "dp2", 0, 1, "steady", "peak_bytes", 1000, peak_measured),
             ("j", "megatron", "dp2", 0, 1, "steady", "peak/temporary_bytes", 10, part_measured)]
        df = pd.DataFrame(r, columns=["job", "framework", "layout", "rank", "step", "phase", "quantity", "predicted",
                                      "measured"])
        df["abs_err"] = df.measured - df.predicted
        df["rel_err"] = df.abs_err / df.predicted
        return df

    text, bad = judge(rows(1009, part_measured=20))
    assert bad == 0 and "1 state and collective rows exact, 1 peak rows" in text, text
    for df in (rows(1011), rows(989), rows(1000, state_measured=101)):
        text, bad = judge(df)
        assert bad == 1 and "rows off" in text, text
