"""The structured config: composition, typos and types rejected, presets in one place."""
import re

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from conf.schema import register
from ledger.errors import ConfigError
from tests.conftest import REPO, compose_config

register()


_compose = compose_config


def test_default_composition():
    cfg = _compose()
    assert cfg.model.name == "tiny" and cfg.cluster.name == "default" and cfg.mode == "run"
    assert cfg.framework.name == "deepspeed" and cfg.ledger.mode == "faithful"


@pytest.mark.parametrize("overrides,target", [
    ([], "cpu-gloo"),  # mode=run on the default cluster measures this machine's CPU
    (["mode=predict"], "cuda-nccl"), (["mode=plan", "plan.gpus=8", "layout.global_batch_size=16"], "cuda-nccl"), (["mode=dry"], "cuda-nccl"),
    (["mode=predict", "cluster=local_cpu"], "cpu-gloo"), (["mode=predict", "cluster=local_gpu"], "cuda-nccl"),
    (["cluster=fake"], "cpu-gloo"), (["mode=predict", "cluster.target=cpu-gloo"], "cpu-gloo"),
    (["cluster=local_slurm"], "cpu-gloo"), (["mode=dry", "cluster=slurm_gpu_example"], "cuda-nccl")])
def test_the_cluster_decides_the_target(overrides, target):
    from conf.validate import validate_config
    from launchers.job import target_of

    cfg = _compose(*overrides)
    validate_config(cfg)
    assert target_of(cfg) == target


@pytest.mark.parametrize("overrides,why", [
    (["cluster.target=cuda-nccl"], "mode=run on cluster.device='cpu' measures cpu-gloo"),
    (["mode=predict", "cluster.target=tpu"], "cluster.target='tpu' must be cpu-gloo or cuda-nccl")])
def test_a_target_no_run_can_confirm_is_refused(overrides, why):
    from conf.validate import validate_config

    with pytest.raises(ConfigError, match=re.escape(why)):
        validate_config(_compose(*overrides))


@pytest.mark.parametrize("fw,knob", [("megatron", "use_distributed_optimizer"), ("deepspeed", "zero_stage"),
                                     ("titan", "reshard_after_forward")])
def test_framework_groups_have_their_knobs(fw, knob):
    assert knob in _compose(f"framework={fw}").framework


def test_typo_is_an_error():
    with pytest.raises(ConfigCompositionException):
        _compose("layout.tpp=2")


def test_wrong_type_is_an_error():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose("layout.tp=two")


def test_knob_of_another_framework_is_an_error():
    with pytest.raises(ConfigCompositionException):
        _compose("framework=titan", "framework.zero_stage=3")


def test_model_presets_come_from_the_ledger():
    from ledger.model import preset

    cfg = _compose("model=llama3_1b", "model.seq_len=4096")
    assert cfg.model.seq_len == 4096
    assert cfg.model.hidden == preset("llama3_1b").hidden


def test_model_group_mirrors_its_folder():
    """Every preset is a file of conf/model/, and ledger.model.PRESETS holds what the files hold."""
    import os

    from ledger.model import PRESETS

    files = {f[:-5] for f in os.listdir(f"{REPO}/conf/model") if f.endswith(".yaml")}
    assert files == set(PRESETS)
    for name in files:
        cfg = _compose(f"model={name}", "mode=predict")
        assert {k: cfg.model[k] for k in PRESETS[name]} == PRESETS[name], name


# the published shapes (each model's config.json: hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, vocab_size; MoE: num_local_experts / num_experts,
# num_experts_per_tok, moe_intermediate_size, head_dim)
PUBLISHED = {
    "llama3_1b": dict(hidden=2048, ffn_hidden=8192, layers=16, heads=32, kv_heads=8, vocab=128256),
    "llama3_8b": dict(hidden=4096, ffn_hidden=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    "llama3_70b": dict(hidden=8192, ffn_hidden=28672, layers=80, heads=64, kv_heads=8, vocab=128256),
    "llama3_405b": dict(hidden=16384, ffn_hidden=53248, layers=126, heads=128, kv_heads=8, vocab=128256),
    "mixtral_8x7b": dict(hidden=4096, ffn_hidden=14336, layers=32, heads=32, kv_heads=8, vocab=32000,
                         num_experts=8, moe_router_topk=2),
    "qwen3_30b_a3b": dict(hidden=2048, layers=48, heads=32, kv_heads=4, vocab=151936, num_experts=128,
                          moe_router_topk=8, moe_ffn_hidden=768, kv_channels=128),
}


def test_presets_are_the_published_shapes():
    from ledger.model import PRESETS

    for name, want in PUBLISHED.items():
        assert {k: PRESETS[name][k] for k in want} == want, name


def test_a_users_model_folder_on_hydras_search_path(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_llama.yaml").write_text(
        "defaults:\n  - model_schema\n\nname: my_llama\nlayers: 24\nhidden: 3072\nffn_hidden: 8192\nheads: 24\n"
        "kv_heads: 8\nvocab: 128256\nseq_len: 8192\n")
    cfg = _compose(f"hydra.searchpath=[file://{tmp_path}]", "model=my_llama", "mode=predict")
    assert (cfg.model.name, cfg.model.layers, cfg.model.hidden, cfg.model.norm) == ("my_llama", 24, 3072, "rmsnorm")


@pytest.mark.parametrize("group,option,schema", [("framework", "megatron", "MegatronConfig"),
                                                 ("framework", "deepspeed", "DeepSpeedConfig"),
                                                 ("framework", "titan", "TitanConfig"),
                                                 ("layout", "default", "LayoutConfig")])
def test_group_yaml_lists_every_field_at_its_schema_default(group, option, schema):
    """conf/framework/*.yaml and conf/layout/default.yaml are what a user reads: every field of the
    schema, at the schema's default (one value, written twice: this test holds them equal)."""
    import yaml
    from omegaconf import OmegaConf

    import conf.schema as S

    written = yaml.safe_load(open(f"{REPO}/conf/{group}/{option}.yaml"))
    written.pop("defaults")
    want = OmegaConf.to_container(OmegaConf.structured(getattr(S, schema)))
    want.pop("name", None)
    assert set(written) == set(want), sorted(set(written) ^ set(want))
    got = _compose(f"{group}={option}", "mode=predict")[group]
    for k, v in want.items():
        assert got[k] == v and written[k] == v, (k, got[k], written[k], v)


def test_every_shipped_cluster_validates():
    """Each conf/cluster/*.yaml as shipped passes validation (slurm_gpu_example's mem_gb: 0 = all the
    node's memory, as sbatch --mem=0)."""
    import os

    from conf.validate import validate_config

    for f in sorted(os.listdir(f"{REPO}/conf/cluster")):
        if f.endswith(".yaml") and f != "cluster_schema.yaml":
            validate_config(_compose(f"cluster={f[:-5]}", "mode=predict"))


def test_a_sweep_composes_each_job_once(tmp_path):
    """Hydra's sweeper composes every job to validate the batch, then the launcher composes it for the run
    (hydra_plugins/train_ledger/launcher.py _ComposedOnce hands the first over): a three-job sweep composes its
    own config twice (Hydra's get_mode, then its multirun) and each job once, and each job's record holds its
    own overrides."""
    import subprocess
    import sys

    import records

    code = ("import sys, tests.run_many as R\n"
            "from hydra._internal.config_loader_impl import ConfigLoaderImpl as C\n"
            "n = [0]\ncompose = C.load_configuration\n"
            "def counted(self, *a, **k):\n    n[0] += 1\n    return compose(self, *a, **k)\n"
            "C.load_configuration = counted\n"
            f"rc = R.main([['-m', 'mode=predict', 'model.layers=2,3,4', 'wandb.mode=disabled', "
            f"'hydra.sweep.dir={tmp_path}']])\n"
            "print('compositions', n[0])\nsys.exit(rc)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "compositions 5", p.stdout[-2000:]
    layers = sorted(r["config"]["model"]["layers"] for r in records.load(str(tmp_path)))
    assert layers == [2, 3, 4]
