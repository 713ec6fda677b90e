"""DeepSpeed ZeRO-1/2/3: real runs on local gloo ranks reconciled to the byte, the model/ledger name
agreement, the faithful ledger's rules, and the dry artifacts checked by DeepSpeed's own parser.

The real matrix (one fixture, two Hydra multiruns, ~3 min on 2 cores):

    python launch.py -m framework=deepspeed framework.zero_stage=1,2,3 cluster.ranks=2,4 \\
        framework.reduce_bucket_size=500000 train.steps=4
    python launch.py -m framework=deepspeed framework.zero_stage=3 cluster.ranks=4 \\
        framework.reduce_bucket_size=500000 framework.stage3_prefetch_bucket_size=0 \\
        framework.stage3_max_reuse_distance=0 train.steps=4
    python launch.py -m framework=deepspeed framework.zero_stage=2 cluster.ranks=2 \\
        framework.reduce_bucket_size=500000 layout.global_batch_size=4 train.steps=4   # 2 micro-batches

reduce_bucket_size=500000 elements splits the tiny model's gradients into several IPG buckets (and
keeps ZeRO-3's always-allocated IPG bucket at 1 MB instead of the default's 1 GB).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, numel, preset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_BUCKET = 500_000
MATRIX = ["framework=deepspeed", "framework.zero_stage=1,2,3", "cluster.ranks=2,4",
          f"framework.reduce_bucket_size={SMALL_BUCKET}", "train.steps=4"]
GAS2 = ["framework=deepspeed", "framework.zero_stage=2", "cluster.ranks=2", f"framework.reduce_bucket_size={SMALL_BUCKET}",
        "layout.global_batch_size=4", "train.steps=4"]
KNOBS0 = ["framework=deepspeed", "framework.zero_stage=3", "cluster.ranks=4",
          f"framework.reduce_bucket_size={SMALL_BUCKET}", "framework.stage3_prefetch_bucket_size=0",
          "framework.stage3_max_reuse_distance=0", "train.steps=4"]


def _fw(**kw):
    from omegaconf import OmegaConf

    from conf.schema import DeepSpeedConfig

    c = OmegaConf.structured(DeepSpeedConfig)
    for k, v in kw.items():
        c[k] = v
    return c


def _lay(dp: int, mbs: int = 1, gbs: int | None = None) -> Layout:
    return Layout(tp=1, pp=1, dp=dp, dp_replicate=1, cp=1, ep=1, vp=1, sequence_parallel=False,
                  micro_batch_size=mbs, global_batch_size=gbs or mbs * dp)


# -- model and ledger agree ----------------------------------------------------------------------

@pytest.mark.parametrize("over", [{}, {"bias": True, "norm": "layernorm"}, {"swiglu": False}, {"tied_embeddings": True}])
def test_llama_parameters_are_the_ledgers(over):
    from launchers.llama import Llama

    shape = preset("tiny", **over)
    model = Llama(shape)
    got = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert got == shape.params()
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()


def test_llama_trains_a_step():
    import torch

    from launchers.data import batch
    from launchers.llama import Llama

    shape = preset("tiny", layers=1)
    torch.manual_seed(0)
    model = Llama(shape)
    x, y = batch(shape.vocab, shape.seq_len, 2, 0, 0, 0, 0, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the next tokens
    loss = model(x, y)
    assert abs(loss.item() - math.log(shape.vocab)) < 0.5  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_batches_are_seeded():
    import torch

    from launchers.data import batch

    a = batch(1024, 16, 2, 7, 3, 1, 0, 2)
    assert torch.equal(a[0], batch(1024, 16, 2, 7, 3, 1, 0, 2)[0])
    assert not torch.equal(a[0], batch(1024, 16, 2, 7, 3, 1, 1, 2)[0])  # other DP rank, other tokens


# -- faithful ledger rules -----------------------------------------------------------------------

def test_ipg_bucket_rule():
    from ledger.faithful.deepspeed import ipg_buckets

    assert ipg_buckets([3, 3, 3], 6) == [6, 3]  # fits exactly: no flush
    assert ipg_buckets([4, 3, 1], 6) == [4, 4]  # would overflow: flush first
    assert ipg_buckets([5], 6) == [5]


def test_backward_order_covers_every_parameter_once():
    from ledger.faithful.deepspeed import backward_order

    for over in ({}, {"bias": True, "norm": "layernorm"}, {"swiglu": False}):
        shape = preset("tiny", **over)
        order = backward_order(shape)
        assert sorted(order) == sorted(shape.params())
        assert order[0][0] == "output.weight" and order[-1][0] == "tok_embeddings.weight"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_is_sharded_as_zero_says(stage):
    """Resident bytes follow the stage: optimizer state / N_d always, params / N_d at stage 3."""
    from ledger.faithful.deepspeed import place

    shape = preset("tiny")
    n = shape.num_params()
    s2, s4 = (place(shape, _lay(d), _fw(zero_stage=stage, reduce_bucket_size=SMALL_BUCKET)).rank_state(0)
              for d in (2, 4))
    assert s2.optim_bytes - 4 == 12 * n // 2 and s4.optim_bytes - 4 == 12 * n // 4
    if stage == 3:
        assert s2.detail["params/bf16 partitions (ds_tensor, fp16_partitioned_groups_flat)"] == 2 * n // 2
        assert s2.detail["grads/IPG bucket (reduce_bucket_size)"] == 2 * SMALL_BUCKET
    else:
        assert s2.params_bytes == s4.params_bytes == 2 * n and s2.grads_bytes == 0
        assert not any(c.kind == "reduce_scatter" for c in s2.comm)


def test_ledger_refuses_what_it_does_not_model():
    from ledger.faithful.deepspeed import place

    shape = preset("tiny")
    with pytest.raises(ConfigError, match="precision"):
        place(shape, _lay(2), _fw(precision="fp32"))
    with pytest.raises(ConfigError, match="reduce_bucket_size"):
        place(shape, _lay(2), _fw(reduce_bucket_size=1000))
    with pytest.raises(ConfigError, match="micro-batches"):
        place(shape, _lay(2, gbs=4), _fw(zero_stage=3))
    with pytest.raises(ConfigError, match="stage3_prefetch_bucket_size"):
        place(shape, _lay(2), _fw(zero_stage=3, stage3_prefetch_bucket_size=1000))


def test_zero3_3n_versus_2n_prediction():
    from ledger.faithful.deepspeed import place

    shape = preset("tiny")
    n = shape.num_params()
    persist = sum(numel(s) for _, s in shape.params() if numel(s) <= 100_000)

    def ag(**kw):
        s = place(shape, _lay(2), _fw(zero_stage=3, reduce_bucket_size=SMALL_BUCKET, **kw)).rank_state(0)
        return sum(c.buffer_bytes for c in s.comm if c.kind == "all_gather")

    assert ag() == 2 * n  # every param gathered once per step (2N pattern)
    # knobs 0: non-persistent params gathered again for backward (3N pattern)
    assert ag(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0) == 2 * n + 2 * (n - persist)


# -- dry: DeepSpeed's own parser -----------------------------------------------------------------

_PARSE = r"""
import json, os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
import deepspeed
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no JIT build
deepspeed.init_distributed("gloo")  # the parser asks deepspeed.comm for the rank
from deepspeed.runtime.config import DeepSpeedConfig
class Mpu:  # the job's DP size (the parser reads it from an mpu when one is given)
    def get_data_parallel_world_size(self): return int(sys.argv[2])
c = DeepSpeedConfig(json.load(open(sys.argv[1])), mpu=Mpu())
print(json.dumps({"stage": c.zero_optimization_stage, "train_batch_size": c.train_batch_size,
                  "micro": c.train_micro_batch_size_per_gpu, "gas": c.gradient_accumulation_steps,
                  "bf16": c.bfloat16_config.enabled, "optimizer": c.optimizer_name,
                  "reduce_bucket_size": c.zero_config.reduce_bucket_size,
                  "prefetch": c.zero_config.prefetch_bucket_size, "clip": c.gradient_clipping}))
"""


def test_dry_writes_a_config_deepspeed_accepts(tmp_path):
    from launchers.local import free_port

    job = tmp_path / "dry"
    r = subprocess.run([sys.executable, "launch.py", "mode=dry", "framework=deepspeed", "framework.zero_stage=3",
                        "cluster=local_gpu", "layout.micro_batch_size=2", "framework.stage3_prefetch_bucket_size=0",
                        "framework.stage3_max_reuse_distance=0", f"hydra.run.dir={job}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.load(open(job / "record.json"))
    assert rec["status"] == "ok"
    assert {os.path.basename(p) for p in rec["artifacts"]} == {"ds_config.json", "train_ds.py", "run.sh"}
    assert "deepspeed --num_gpus 8" in (job / "run.sh").read_text()
    p = subprocess.run([sys.executable, "-c", _PARSE, str(job / "ds_config.json"), "8", str(free_port())],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    c = json.loads(p.stdout.strip().splitlines()[-1])
    assert c == {"stage": 3, "train_batch_size": 16, "micro": 2, "gas": 1, "bf16": True, "optimizer": "adamw",
                 "reduce_bucket_size": 500_000_000, "prefetch": 0, "clip": 1.0}


# -- the real matrix -----------------------------------------------------------------------------

def _sweep(args, out) -> None:
    r = subprocess.run([sys.executable, "launch.py", "-m", *args, f"hydra.sweep.dir={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=900, env={**os.environ, "WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from analysis import records as R
    from analysis.reconcile import table

    root = tmp_path_factory.mktemp("ds")
    _sweep(MATRIX, root / "matrix")
    _sweep(KNOBS0, root / "knobs0")
    _sweep(GAS2, root / "gas2")
    recs = {k: R.load(str(root / k)) for k in ("matrix", "knobs0", "gas2")}
    return recs, {k: table(v) for k, v in recs.items()}


def _key(rec):
    c = rec["config"]
    return c["framework"]["zero_stage"], c["cluster"]["ranks"]


def _steady_comm(rank_rec, step):
    out = {}
    for c in next(s for s in rank_rec["steps"] if s["step"] == step)["comm"]:
        out[(c["kind"], c["dtype"])] = (c["count"], c["buffer_bytes"])
    return out


@pytest.mark.real
def test_matrix_ran_every_rank(runs):
    recs, _ = runs
    assert sorted(_key(r) for r in recs["matrix"]) == [(1, 2), (1, 4), (2, 2), (2, 4), (3, 2), (3, 4)]
    assert [_key(r) for r in recs["knobs0"]] == [(3, 4)] and [_key(r) for r in recs["gas2"]] == [(2, 2)]
    for rec in recs["matrix"] + recs["knobs0"] + recs["gas2"]:
        assert rec["status"] == "ok", rec["error"]
        ranks = rec["measurement"]["ranks"]
        assert [r["rank"] for r in ranks] == list(range(_key(rec)[1]))
        for r in ranks:
            assert r["status"] == "ok" and r["errors"] == [], r.get("errors")
            assert [s["step"] for s in r["steps"]] == [0, 1, 2, 3]
            assert all(math.isfinite(s["loss"]) for s in r["steps"])


@pytest.mark.real
def test_every_row_reconciles_to_the_byte(runs):
    _, tables = runs
    for name, df in tables.items():
        assert len(df), name
        bad = df[df.abs_err != 0]
        assert bad.empty, f"{name}:\n{bad.to_string()}"
        steady = df[df.phase == "steady"]
        # every rank of every job has steady state and comm rows
        for (job, rank), g in steady.groupby(["job", "rank"]):
            qs = set(g.quantity)
            assert {"params_bytes", "grads_bytes", "optim_bytes", "resident_bytes"} <= qs, (job, rank)
            assert any(q.startswith("comm/dp/") for q in qs), (job, rank)


@pytest.mark.real
def test_first_step_is_reported_separately(runs):
    _, tables = runs
    df = tables["matrix"]
    first = df[df.phase == "first"]
    assert set(first.step) == {0, 1}  # ZeRO-3 completes its trace in the second forward
    z3 = first[first.framework == "deepspeed-z3"]
    assert set(z3.step) == {0, 1} and set(first[first.framework != "deepspeed-z3"].step) == {0}
    assert (z3[z3.quantity == "comm/dp/broadcast/count"].measured > 0).all()
    steady = df[df.phase == "steady"]
    assert not (steady.quantity.str.contains("broadcast")).any()


@pytest.mark.real
def test_zero12_all_reduce_buckets_no_reduce_scatter(runs):
    recs, _ = runs
    n = ModelShape.from_config(recs["matrix"][0]["config"]["model"]).num_params()
    for rec in recs["matrix"]:
        stage, world = _key(rec)
        if stage == 3:
            continue
        for r in rec["measurement"]["ranks"]:
            c = _steady_comm(r, 3)
            assert not any(k == "reduce_scatter" for k, _ in c)
            count, nbytes = c[("all_reduce", "bf16")]
            assert count > 1 and nbytes == 2 * n  # several buckets covering every gradient once
            assert c[("all_gather", "bf16")] == (1, 2 * n)


@pytest.mark.real
def test_zero3_2n_default_and_3n_with_knobs_zero(runs):
    recs, _ = runs
    shape = ModelShape.from_config(recs["matrix"][0]["config"]["model"])
    n = shape.num_params()
    persist = [numel(s) for _, s in shape.params() if numel(s) <= 100_000]
    big_modules = {name.rsplit(".", 1)[0] for name, s in shape.params() if numel(s) > 100_000}
    default = next(r for r in recs["matrix"] if _key(r) == (3, 4))
    knobs = recs["knobs0"][0]
    for r_d, r_k in zip(default["measurement"]["ranks"], knobs["measurement"]["ranks"]):
        d, k = _steady_comm(r_d, 3), _steady_comm(r_k, 3)
        # 2N: one coalesced gather of all non-persistent params + the persistent ones after step
        assert d[("all_gather", "bf16")] == (1 + len(persist), 2 * n)
        # 3N: per-module gathers in forward and again in backward
        assert k[("all_gather", "bf16")] == (2 * len(big_modules) + len(persist), 2 * n + 2 * (n - sum(persist)))
        assert d[("reduce_scatter", "bf16")][1] == k[("reduce_scatter", "bf16")][1] == 2 * n
        assert d[("reduce_scatter", "bf16")][0] > 1


@pytest.mark.real
def test_zero2_reduces_every_micro_batch(runs):
    """Stage 2 reduces gradients in the backward hooks of every micro-batch, not once per step."""
    recs, _ = runs
    one = next(r for r in recs["matrix"] if _key(r) == (2, 2))
    two = recs["gas2"][0]
    assert two["prediction"]["layout"]["num_microbatches"] == 2
    for r1, r2 in zip(one["measurement"]["ranks"], two["measurement"]["ranks"]):
        c1, c2 = _steady_comm(r1, 3), _steady_comm(r2, 3)
        assert c2[("all_reduce", "bf16")] == tuple(2 * x for x in c1[("all_reduce", "bf16")])
        assert c2[("all_gather", "bf16")] == c1[("all_gather", "bf16")]
