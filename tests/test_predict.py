"""`launch.py mode=predict` writes the prediction.json contract and prints a readable table."""
import json

import pytest

import records

from ledger.placement import KINDS


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    from tests.conftest import launch

    d = tmp_path_factory.mktemp("predict")
    p = launch("mode=predict", "model=llama3_1b", "framework=megatron", "layout.tp=2", "layout.pp=2", "layout.dp=2",
               f"hydra.run.dir={d}", check=True, timeout=300)
    return json.load(open(d / "prediction.json")), p.stdout, json.load(open(d / "record.json"))


def test_contract(predicted):
    pred, _, _ = predicted
    assert {"framework", "mode", "model", "layout", "per_gpu", "rank_classes", "comm"} <= set(pred)
    assert pred["framework"] == "megatron" and pred["mode"] == "faithful"
    assert pred["model"]["num_params"] == 1_498_482_688
    assert (pred["layout"]["tp"], pred["layout"]["pp"], pred["layout"]["dp"]) == (2, 2, 2)
    ranks = pred["rank_classes"]
    # the classes' runs cover the world once, in order
    assert sorted(r for c in ranks for lo, hi in c["ranks"] for r in range(lo, hi + 1)) == list(range(8))
    for r in ranks:
        assert r["resident_bytes"] == r["params_bytes"] + r["grads_bytes"] + r["optim_bytes"] + r["other_bytes"]
        assert r["stage"] in (0, 1)
    most = max(ranks, key=lambda r: r["resident_bytes"])
    assert pred["per_gpu"] == {k: most[k] for k in ("params_bytes", "grads_bytes", "optim_bytes", "resident_bytes")}
    for c in pred["comm"]:
        assert c["kind"] in KINDS and c["count"] > 0 and 0 <= c["wire_bytes"] <= 2 * c["buffer_bytes"]
    assert {c["dim"] for c in pred["comm"]} >= {"dp", "tp", "pp"}


def test_stages_differ_and_tp_ranks_agree(predicted):
    pred, _, _ = predicted
    by = {r: records.predicted_ranks(pred)(r) for r in range(8)}
    assert by[0]["params_bytes"] == by[1]["params_bytes"]  # tp peers (tp is the innermost grid dim)
    assert by[0]["params_bytes"] != by[4]["params_bytes"]  # stage 0 holds the embedding, stage 1 the output


def test_table_in_human_units_and_record(predicted):
    _, out, rec = predicted
    assert "GB" in out and "resident" in out and "rank" in out
    # one row per stage with its rank block, and the most-loaded rank in exact bytes
    assert "0–3 (4)" in out and "4–7 (4)" in out
    pred, _, _ = predicted
    most = max(pred["rank_classes"], key=lambda r: r["resident_bytes"])
    assert f"most-loaded: rank {most['ranks'][0][0]} (stage {most['stage']}): resident {most['resident_bytes']:,} B" in out
    assert rec["status"] == "ok" and rec["measurement"] is None and rec["mode"] == "predict"


def test_comm_builder_builds_records_sorted_whatever_the_insertion_order():
    """CommBuilder.build's cached key order (_sorted_keys) gives what sorting the records gives, for every
    insertion order of the same keys, each record's sums and names kept with its key."""
    import itertools
    import pickle

    from ledger.placement import Comm, CommBuilder

    keys = [("tp", "all_reduce", "bf16"), ("dp", "reduce_scatter", "fp32"), ("dp", "all_gather", "bf16"),
            ("pp", "send_recv", "bf16")]
    for order in itertools.permutations(keys):
        cb = CommBuilder()
        for i, (dim, kind, dtype) in enumerate(order):
            cb.add_calls(dim, kind, dtype, i + 1, 100 * (i + 1), 10 * (i + 1), f"{dim}-{kind}")
            cb.add_calls(dim, kind, dtype, 1, 1, 1, "again")
        got = cb.build()
        assert [(c.dim, c.kind, c.dtype) for c in got] == sorted(keys)
        for c in got:
            i = order.index((c.dim, c.kind, c.dtype))
            assert (c.count, c.buffer_bytes, c.wire_bytes, c.what) == \
                (i + 2, 100 * (i + 1) + 1, 10 * (i + 1) + 1, "; ".join(sorted({f"{c.dim}-{c.kind}", "again"})))
    c = Comm("dp", "all_gather", 1, 2, 3, "bf16", "x")
    assert pickle.loads(pickle.dumps(c)) == c  # slotted records still travel (submitit pickles results)


def test_add_several_is_add_of_each_call():
    """CommBuilder.add_several (a call site's calls summed before they meet the record) gives the list
    the same calls added one by one give: merged keys, calls made 0 times, groups of one, repeated and
    empty names, floors per call (FSDP's padded buffers among them)."""
    import random

    from ledger.placement import CommBuilder

    rng = random.Random(0)
    for _ in range(300):
        cb, acc = CommBuilder(), CommBuilder()
        for _ in range(rng.randint(1, 8)):
            dim, kind = rng.choice(["dp", "tp", "cp-dp"]), rng.choice(["all_gather", "all_reduce", "reduce_scatter"])
            dtype, n = rng.choice(["bf16", "fp32"]), rng.choice([1, 2, 3, 7, 8])
            calls = [(rng.randint(1, 10 ** 6), rng.choice([0, 1, 2, 80]), rng.choice(["a", "b", "c d", ""]))
                     for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.5:  # FSDP's padded buffers: multiples of the group
                calls = [(b * n, c, what) for b, c, what in calls]
            for b, c, what in calls:
                if c:
                    cb.add(dim, kind, b, n, dtype, count=c, what=what)
            if rng.random() < 0.5:
                acc.add_several(dim, kind, dtype, n, calls)
            else:
                for b, c, what in calls:
                    acc.add(dim, kind, b, n, dtype, count=c, what=what)
        assert acc.build() == cb.build()


def test_wire_sum_floors_each_call():
    """placement.wire_sum (DDP buckets' calls, CommBuilder.add_each): wire_bytes of each call summed,
    few calls or many (numpy)."""
    from ledger.placement import wire_bytes, wire_sum

    for n in (1, 5, 33, 100):
        buffers = [7 * i + 3 for i in range(n)]
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            for group in (2, 3, 7):
                assert wire_sum(kind, buffers, group) == sum(wire_bytes(kind, b, group) for b in buffers)


def test_prints_where_it_wrote(predicted):
    """The job's files are named on stdout, so a user finds them wherever Hydra put the run."""
    pred, out, rec = predicted
    line = next(ln for ln in out.splitlines() if ln.startswith("prediction: "))
    path = line.split()[1]
    assert path.endswith("/prediction.json") and json.load(open(path)) == pred
    assert line.split()[3] == rec["job_dir"] + "/record.json"


@pytest.mark.parametrize("overrides,fits", [(("model=llama3_8b", "framework=megatron", "layout.tp=2", "layout.pp=2",
                                              "layout.dp=2", "layout.global_batch_size=16",
                                              "framework.use_distributed_optimizer=true"), True),
                                            (("model=llama3_70b", "framework=deepspeed", "layout.dp=8"), False)])
def test_predict_prints_the_fit_verdict_for_the_clusters_gpus(tmp_path, overrides, fits):
    """cluster.gpu_memory_gb (80 on the shipped GPU clusters): the heaviest rank's predicted peak against
    plan.memory_fraction of it, as the planner judges a layout; the same peak prediction.json holds."""
    from tests.conftest import launch

    p = launch("mode=predict", *overrides, "cluster=local_gpu", f"hydra.run.dir={tmp_path}", check=True, timeout=300)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("fit: "))
    assert line.startswith("fit: fits" if fits else "fit: does NOT fit"), line
    pred = json.load(open(tmp_path / "prediction.json"))
    peak = max((r["peak"] or {}).get("bytes", r["resident_bytes"]) for r in pred["rank_classes"])
    assert (peak <= 0.9 * 80e9) == fits


def test_a_knob_swept_over_frameworks_applies_where_the_framework_has_it(tmp_path):
    """`+knobs.NAME=V` in a sweep over frameworks: set on the jobs whose framework has the knob, recorded
    and printed as ignored on the others; the sweep runs every job."""
    import records
    from tests.conftest import launch

    p = launch("-m", "mode=predict", "framework=megatron,deepspeed,titan", "+knobs.zero_stage=3",
               "+knobs.overlap_grad_reduce=true", "wandb.mode=disabled", f"hydra.sweep.dir={tmp_path}", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = {r["config"]["framework"]["name"]: r for r in records.load(str(tmp_path))}
    assert {n: r["status"] for n, r in recs.items()} == {"megatron": "ok", "deepspeed": "ok", "titan": "ok"}
    assert recs["deepspeed"]["config"]["framework"]["zero_stage"] == 3
    assert "ZeRO-3" in " ".join(recs["deepspeed"]["prediction"]["notes"])
    assert recs["megatron"]["config"]["framework"]["overlap_grad_reduce"] is True
    assert recs["megatron"]["knobs_ignored"] == ["zero_stage"]
    assert recs["deepspeed"]["knobs_ignored"] == ["overlap_grad_reduce"]
    assert recs["titan"]["knobs_ignored"] == ["zero_stage", "overlap_grad_reduce"]
    assert "knobs not of titan, ignored: zero_stage, overlap_grad_reduce" in p.stdout


def test_the_sweep_lists_the_knobs_away_from_each_frameworks_own_defaults(tmp_path):
    """The same predict sweep's records: what the user set, and train-ledger's own departures from the
    framework's defaults (FrameworkLedger.own_defaults), each with the framework's value; in the title."""
    import records
    from tests.conftest import launch

    p = launch("-m", "mode=predict", "framework=megatron,deepspeed,titan", "+knobs.overlap_grad_reduce=true",
               "wandb.mode=disabled", f"hydra.sweep.dir={tmp_path}", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    away = {r["config"]["framework"]["name"]: r["knobs_away_from_defaults"] for r in records.load(str(tmp_path))}
    assert away == {"megatron": ["precision=bf16 (fp32)", "overlap_grad_reduce=true (false)"],
                    "deepspeed": ["precision=bf16 (fp32)", "zero_stage=1 (0)"],
                    "titan": ["spmd_backend=partial_dtensor (spmd_types)"]}
    assert "knobs away from titan's own defaults: spmd_backend=partial_dtensor (spmd_types)" in p.stdout


def test_unset_overlap_comm_is_deepspeeds_own_rule():
    """DeepSpeedZeroConfig.overlap_comm_valid: None -> on at stage 3 only; the ds_config says it."""
    from launchers.deepspeed import ds_config
    from ledger.faithful.deepspeed.rules import overlap_comm
    from ledger.layout import resolve
    from tests.conftest import compose_config

    for stage, want in ((1, False), (2, False), (3, True)):
        cfg = compose_config("framework=deepspeed", f"framework.zero_stage={stage}")
        assert cfg.framework.overlap_comm is None and overlap_comm(cfg.framework) is want
        assert ds_config(cfg, resolve(cfg.layout, 2))["zero_optimization"]["overlap_comm"] is want
    assert overlap_comm(compose_config("framework=deepspeed", "framework.zero_stage=3",
                                       "framework.overlap_comm=false").framework) is False


def test_a_knob_no_framework_has_is_refused(tmp_path):
    from tests.conftest import launch

    p = launch("mode=predict", "+knobs.zero_stag=3", f"hydra.run.dir={tmp_path}", timeout=120)
    assert p.returncode == 2 and "knobs.zero_stag: no framework has a knob 'zero_stag'" in p.stderr


def test_rank_classes_cover_the_world_once_and_read_back_per_rank():
    """A world of 65,536 alike ranks is a few classes whose runs cover every rank once; records reads a
    rank's class back, and reads a prediction written with one entry per rank the same way."""
    from ledger.model import preset
    from ledger.parallel import predict
    from tests.conftest import megatron_fw, megatron_layout

    pl = predict(preset("llama3_8b"), megatron_layout(tp=8, pp=4, dp=2048), megatron_fw(use_distributed_optimizer=False))
    pred = pl.to_dict()
    classes = pred["rank_classes"]
    assert len(classes) <= 2 * 4  # each stage's ranks alike (their TP shapes equal, plain DDP)
    covered = sorted((lo, hi) for c in classes for lo, hi in c["ranks"])
    assert covered[0][0] == 0 and covered[-1][1] == 65_535
    assert all(b[0] == a[1] + 1 for a, b in zip(covered, covered[1:]))  # no gap, no overlap
    of = records.predicted_ranks(pred)
    for r in (0, 7, 16_384, 65_535):
        assert of(r)["resident_bytes"] == pl.rank_state(r).resident_bytes and of(r)["stage"] == pl.rank_state(r).stage
    assert of(65_536) == {}
    old = {"per_rank": [{"rank": r, "stage": 0, "resident_bytes": r} for r in range(3)]}
    assert records.predicted_ranks(old)(2)["resident_bytes"] == 2
    assert [c["ranks"] for c in records.rank_classes(old)] == [[[0, 0]], [[1, 1]], [[2, 2]]]


@pytest.mark.parametrize("overrides,target", [
    (["framework=megatron"], "cuda-nccl"),  # the TransformerEngine spec, a GPU cluster's default: from sources
    (["framework=megatron", "framework.transformer_impl=local"], "cuda-nccl"),
    (["framework=titan"], "cuda-nccl"), (["framework=deepspeed", "framework.zero_stage=1"], "cuda-nccl"),
    (["framework=titan", "cluster.target=cpu-gloo"], "cpu-gloo"),
    (["framework=megatron", "cluster.target=cpu-gloo"], "cpu-gloo")])
def test_a_prediction_names_the_run_it_is_for(overrides, target, tmp_path):
    """prediction.json, the table's title and the printout say which run the prediction is for and what its
    peak rests on; a cuda-nccl prediction names what a rank holds beside its tensors and the fit verdict
    adds it; a fit verdict on the CPU harness's peak says that a GPU run's differs."""
    from tests.conftest import launch

    p = launch("mode=predict", "model=tiny", "layout.dp=2", "cluster=local_gpu", *overrides,
               f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    pred = json.load(open(tmp_path / "prediction.json"))
    assert pred["target"] == target and f"peak for {target}:" in p.stdout and f", for {target})" in p.stdout
    assert ("a GPU run's differs" in p.stdout) == (target == "cpu-gloo")
    assert bool(pred.get("outside_allocator")) == (target == "cuda-nccl")
    assert ("beside the tensors (CUDA context, NCCL, cuBLAS)" in p.stdout) == (target == "cuda-nccl")
