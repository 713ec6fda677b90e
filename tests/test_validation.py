"""Bad layouts are rejected before anything runs, naming the field and the rule."""
import json
import os

import pytest

from ledger.layout import ConfigError, resolve, validate
from ledger.model import preset
from tests.conftest import launch


class L(dict):
    __getattr__ = dict.__getitem__


def lay(**kw):
    base = dict(tp=1, pp=1, dp=-1, dp_replicate=1, cp=1, ep=1, vp=1, sequence_parallel=False,
                micro_batch_size=1, global_batch_size=-1)
    return L({**base, **kw})


@pytest.mark.parametrize("model,kw,fw,needle", [
    ("llama3_8b", dict(tp=3, dp=1), "megatron", "tp=3 does not divide num_heads=32"),
    # Megatron's own reason (transformer_block.py get_num_layers_to_build); an uneven split is a framework knob
    ("tiny", dict(pp=3, dp=1), "megatron", "num_layers=4 should be divisible by config.pipeline_model_parallel_size=3"),
    ("tiny", dict(pp=7, dp=1), "titan", "titan: pp=7: more stages than effective layers 6"),
    ("tiny", dict(dp=2, global_batch_size=3), "megatron", "global_batch_size=3"),
    ("tiny", dict(tp=2, dp=1), "deepspeed", "deepspeed: tp=2"),
    ("tiny", dict(pp=2, dp=1, tp=2, vp=2), "titan", "titan: pp=2: framework.pipeline_parallel_schedule='1F1B'"),
    ("tiny", dict(dp=4, dp_replicate=3), "titan", "dp_replicate=3 does not divide dp=4"),
    ("tiny", dict(ep=2, dp=1), "megatron", "ep=2"),
    ("tiny", dict(dp=1, sequence_parallel=True), "megatron", "sequence_parallel=true needs tp > 1"),
])
def test_rejections_name_field_and_rule(model, kw, fw, needle):
    with pytest.raises(ConfigError) as e:
        validate(preset(model), resolve(lay(**kw), world=8), fw)
    assert needle in str(e.value)


@pytest.mark.parametrize("framework,knob,value", [
    ("megatron", "bucket_size", 0), ("megatron", "bucket_size", -1),
    ("deepspeed", "reduce_bucket_size", 0), ("deepspeed", "allgather_bucket_size", 0),
    ("deepspeed", "stage3_prefetch_bucket_size", -5), ("deepspeed", "stage3_max_live_parameters", -1),
    ("deepspeed", "stage3_max_reuse_distance", -1), ("deepspeed", "stage3_param_persistence_threshold", -1),
])
def test_framework_sizes_are_checked(framework, knob, value):
    """Bucket sizes and ZeRO-3 budgets out of range are refused naming the knob (a Megatron bucket of 0
    elements used to hang the ledger's bucket walk); the schema's defaults and the edge values pass."""
    from omegaconf import OmegaConf

    from conf.schema import FRAMEWORK_SCHEMAS

    fw = OmegaConf.structured(FRAMEWORK_SCHEMAS[framework])
    validate(preset("tiny"), resolve(lay(dp=2)), framework, fw)
    fw[knob] = value
    with pytest.raises(ConfigError, match=f"framework.{knob}={value} must be >= "):
        validate(preset("tiny"), resolve(lay(dp=2)), framework, fw)
    fw[knob] = 1 if knob in ("bucket_size", "reduce_bucket_size", "allgather_bucket_size") else 0  # the least allowed
    validate(preset("tiny"), resolve(lay(dp=2)), framework, fw)


@pytest.mark.parametrize("gbs", [0, -2])
def test_global_batch_size_must_be_positive_or_auto(gbs):
    with pytest.raises(ConfigError, match=f"layout.global_batch_size={gbs} must be >= 1 or -1"):
        resolve(lay(dp=2, global_batch_size=gbs))


def test_world_must_match_cluster():
    with pytest.raises(ConfigError, match="world size"):
        validate(preset("tiny"), resolve(lay(dp=2, tp=2)), "megatron", world=2)


def test_dp_auto_fills_from_world():
    l = resolve(lay(tp=2), world=8)
    assert (l.dp, l.world, l.num_microbatches) == (4, 8, 1)


def test_cli_single_run_exits_nonzero_naming_tp_and_heads(run_launch, tmp_path):
    p = run_launch("mode=predict", "model=llama3_8b", "framework=megatron", "layout.tp=3", "layout.dp=1",
                   f"hydra.run.dir={tmp_path}")
    assert p.returncode != 0
    assert "tp=3 does not divide num_heads=32" in p.stderr


def test_layout_to_dict_has_every_field():
    """Layout.to_dict is spelled out for speed: it must still carry every field (and the derived
    counts), with the layout's values."""
    from dataclasses import fields

    from ledger.layout import Layout

    lay = Layout(tp=2, pp=3, dp=4, dp_replicate=2, cp=5, ep=1, vp=2, sequence_parallel=True, micro_batch_size=3,
                 global_batch_size=48)
    d = lay.to_dict()
    assert {f.name: getattr(lay, f.name) for f in fields(Layout)} == {k: d[k] for k in (f.name for f in fields(Layout))}
    assert (d["world"], d["dp_shard"], d["num_microbatches"], d["edp"]) == (lay.world, lay.dp_shard,
                                                                          lay.num_microbatches, lay.edp)
    assert len(d) == len(fields(Layout)) + 4


@pytest.mark.parametrize("cls", ["Layout", "Grid"])
def test_direct_init_sets_every_field(cls):
    """Layout's and Grid's __init__ (ledger/frozen.py direct_init, for speed) sets each field from its own
    argument, by keyword and by position (Grid: defaults 1), and the object stays frozen and hashable
    as the dataclass's."""
    import dataclasses
    from dataclasses import fields

    from ledger.grid import Grid
    from ledger.layout import Layout

    C = {"Layout": Layout, "Grid": Grid}[cls]
    names = [f.name for f in fields(C)]
    values = list(range(2, 2 + len(names)))
    assert [getattr(C(**dict(zip(names, values))), n) for n in names] == values
    assert [getattr(C(*values), n) for n in names] == values
    if C is Grid:
        assert [getattr(Grid(), n) for n in names] == [f.default for f in fields(Grid)] == [1] * len(names)
        assert hash(Grid(*values)) != hash(Grid())
    assert C(*values) == C(*values) and hash(C(*values)) == hash(C(*values))
    with pytest.raises(dataclasses.FrozenInstanceError):
        C(*values).tp = 1
    with pytest.raises(TypeError):
        C(*values, 1)  # one argument too many


def test_placement_records_may_be_lazy():
    """Placement.model / .layout given as callables are built on first read, once; given as dicts they
    are kept as they are (a search builds neither)."""
    from ledger.placement import Placement

    calls = []

    def model():
        calls.append(1)
        return {"name": "x"}

    pl = Placement(framework="f", mode="m", model=model, layout={"tp": 1}, world=1, rank_state=None)
    assert calls == []
    assert pl.model == {"name": "x"} and pl.model is pl.model and calls == [1]
    assert pl.layout == {"tp": 1}


@pytest.mark.parametrize("overrides,message", [
    (("framework=deepspeed", "probe.fsdp_mem_tracker=true"),
     "probe.fsdp_mem_tracker=true needs framework=titan"),
    (("framework=titan", "cluster=fake", "probe.fsdp_mem_tracker=true"),
     "probe.fsdp_mem_tracker=true needs real tensors"),
])
def test_fsdp_mem_tracker_only_on_real_titan_runs(overrides, message):
    from hydra import compose, initialize_config_dir

    from conf.schema import register
    from conf.validate import validate_config

    register()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with initialize_config_dir(config_dir=f"{repo}/conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_a_local_world_this_machine_cannot_hold_is_refused_before_anything_starts(tmp_path):
    """A plan's world on the local CPU cluster: too many ranks for the cores, or more memory than the
    machine has for the heaviest rank's predicted peak x ranks; invalid with the numbers, nothing run."""
    from launchers.local import LOCAL_RANKS_MIN, available_memory_bytes, local_world_error

    cores = os.cpu_count() or 1
    too_many = max(LOCAL_RANKS_MIN, 4 * cores) + 1
    assert f"a local run of {too_many} ranks" in local_world_error(too_many, 1, "cpu")
    avail = available_memory_bytes()
    assert "available" in local_world_error(2, avail, "cpu")  # 2 x all of it
    assert local_world_error(2, 1 << 20, "cpu") is None
    p = launch("mode=run", "framework=megatron", "model=llama3_70b", "layout.tp=8", "cluster.ranks=8",
               "cluster.nodes=128", f"hydra.run.dir={tmp_path}")
    rec = json.load(open(tmp_path / "record.json"))
    assert rec["status"] == "invalid" and "1024 ranks" in rec["error"] and rec["measurement"] is None
    assert not list(tmp_path.glob("rank*.log")), p.stdout
