"""python -m importers: a Megatron-LM pretrain_gpt.py command line back to train-ledger's config. The
round trip: every layout and knob the CPU matrices run, written by `mode=dry` (pretrain_gpt_args) and
imported, is the same model shape, resolved layout and Megatron knobs the ledger predicts from."""
import dataclasses
import json

import pytest

from ledger.errors import ConfigError
from tests.conftest import compose_config, launch

ROUND_TRIP = [
    ["model=tiny", "layout.dp=2"],
    ["model=tiny", "layout.tp=2", "layout.sequence_parallel=true", "framework.overlap_grad_reduce=true",
     "framework.bucket_size=100000", "framework.use_distributed_optimizer=true"],
    ["model=tiny", "layout.pp=2", "layout.vp=2", "layout.dp=2", "layout.global_batch_size=8",
     "framework.overlap_grad_reduce=true", "framework.overlap_param_gather=true", "framework.use_distributed_optimizer=true"],
    ["model=tiny", "model.tied_embeddings=true", "layout.pp=2", "framework.precision=fp32"],
    ["model=tiny", "model.vocab=1001", "layout.tp=2", "framework.grad_reduce_in_fp32=false"],
    ["model=tiny", "model.layers=3", "layout.pp=2", "framework.decoder_first_pipeline_num_layers=1"],
    ["model=tiny", "model.layers=3", "layout.pp=2", "framework.account_for_embedding_in_pipeline_split=true"],
    ["model=tiny", "layout.pp=2", "layout.global_batch_size=4", "framework.recompute_granularity=selective"],
    ["model=tiny", "layout.tp=2", "framework.recompute_granularity=full", "framework.recompute_method=block",
     "framework.recompute_num_layers=1", "framework.transformer_impl=local"],
    ["model=llama3_8b", "layout.tp=8", "layout.pp=4", "layout.dp=16", "layout.sequence_parallel=true"],
    ["model=tiny_moe", "layout.tp=2", "layout.ep=2", "layout.dp=2", "layout.sequence_parallel=true",
     "framework.use_distributed_optimizer=true", "framework.moe_token_dispatcher_type=alltoall"],
    ["model=qwen3_30b_a3b", "layout.ep=8", "layout.dp=8", "framework.use_distributed_optimizer=true"],
    ["model=llama3_1b", "layout.cp=4", "layout.dp=2", "framework.cp_comm_type=a2a+p2p",
     "framework.hierarchical_context_parallel_sizes=[2,2]"],
    ["model=llama3_1b", "layout.cp=2", "layout.dp=2", "framework.cp_comm_type=all_gather"],
]


def _resolved(cfg):
    from launchers.job import check
    from ledger.faithful.megatron.knobs import knobs
    from ledger.model import ModelShape

    model, lay, _ = check(cfg)
    fw = cfg.framework
    # the context-parallel attention (read by ledger/faithful/megatron/cp.py, not a Knobs field)
    cp = (fw.cp_comm_type, list(fw.hierarchical_context_parallel_sizes or []))
    return dataclasses.replace(ModelShape.from_config(cfg.model), name="-"), lay, knobs(fw), cp


@pytest.mark.parametrize("overrides", ROUND_TRIP, ids=lambda o: " ".join(o))
def test_dry_command_lines_import_back_to_the_same_config(overrides):
    from importers.megatron import overrides as imported
    from launchers.job import check
    from launchers.megatron import pretrain_gpt_args

    cfg = compose_config("mode=dry", "framework=megatron", *overrides)
    _, lay, _ = check(cfg)
    back, _ = imported(pretrain_gpt_args(cfg, lay), lay.world)
    assert _resolved(compose_config("mode=dry", *back)) == _resolved(compose_config("mode=dry", "framework=megatron",
                                                                                     *overrides))


def test_a_flag_the_ledger_does_not_model_is_refused_by_name():
    from importers.megatron import overrides as imported
    from launchers.job import check
    from launchers.megatron import pretrain_gpt_args

    cfg = compose_config("mode=dry", "framework=megatron", "model=tiny")
    _, lay, _ = check(cfg)
    args = pretrain_gpt_args(cfg, lay)
    for extra, flag in ((["--fp8-format", "hybrid"], "--fp8-format"), (["--fp16"], "--fp16"),
                        (["--position-embedding-type", "learned_absolute"], "--position-embedding-type")):
        with pytest.raises(ConfigError, match=flag):
            imported(args + extra, lay.world)


def test_import_a_run_sh_prints_the_prediction_and_writes_a_sweep_file(tmp_path):
    """`python -m importers megatron RUN_SH` on what `mode=dry` wrote: the same prediction, a sweep file
    sweeps.plan runs; a refused flag exits 2 naming it."""
    import subprocess
    import sys

    import yaml

    from tests.conftest import REPO

    job = tmp_path / "dry"
    p = launch("mode=dry", "framework=megatron", "model=llama3_1b", "layout.tp=2", "layout.pp=2", "layout.dp=2",
               "layout.sequence_parallel=true", f"hydra.run.dir={job}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "imported.yaml"
    p = subprocess.run([sys.executable, "-m", "importers", "megatron", str(job / "run.sh"), "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    pred = json.load(open(job / "prediction.json"))
    most = pred["per_gpu"]["resident_bytes"]
    assert f"resident {most:,} B" in p.stdout and "--mock-data" in p.stdout  # the same most-loaded rank; ignored
    sweep = yaml.safe_load(out.read_text())
    assert sweep["runs"][0]["framework"] == "megatron" and "layout.dp=2" in sweep["runs"][0]["overrides"]
    bad = subprocess.run([sys.executable, "-m", "importers", "megatron", "--world", "2", "--",
                          *open(job / "run.sh").read().split("pretrain_gpt.py\" \\\n", 1)[1].replace("\\\n", " ").split(),
                          "--fp8-format", "hybrid"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--fp8-format" in bad.stderr, bad.stderr[-2000:]


DS_ROUND_TRIP = [
    ["framework.zero_stage=1", "layout.dp=2"],
    ["framework.zero_stage=2", "layout.dp=4", "framework.reduce_bucket_size=200000", "framework.overlap_comm=true",
     "layout.micro_batch_size=2", "layout.global_batch_size=16"],
    ["framework.zero_stage=3", "layout.dp=4", "framework.stage3_prefetch_bucket_size=1000",
     "framework.stage3_max_reuse_distance=0", "framework.stage3_param_persistence_threshold=10"],
    ["framework.zero_stage=3", "layout.dp=2", "framework.overlap_comm=false", "framework.precision=fp32",
     "framework.gradient_clipping=0.5"],
    ["framework.zero_stage=2", "layout.dp=2", "framework.activation_checkpointing=true", "framework.allgather_bucket_size=300000"],
    ["framework.zero_stage=2", "layout.dp=2", "framework.offload_optimizer=cpu", "framework.offload_optimizer_pin_memory=true"],
    ["framework.zero_stage=3", "layout.dp=2", "framework.offload_optimizer=cpu", "framework.offload_param=cpu"],
]


@pytest.mark.parametrize("overrides", DS_ROUND_TRIP, ids=lambda o: " ".join(o))
def test_ds_configs_import_back_to_the_same_config(overrides):
    """ds_config (what mode=dry writes) -> importers.deepspeed -> the same resolved layout and every knob the
    DeepSpeed ledger reads (overlap_comm as DeepSpeed resolves it)."""
    import types

    from importers.deepspeed import ZERO, overrides as imported
    from launchers.deepspeed import ds_config
    from launchers.job import check
    from ledger.faithful.deepspeed.rules import overlap_comm

    def resolved(cfg):
        _, lay, _ = check(cfg)
        fw = cfg.framework
        keys = [*ZERO.values(), "precision", "gradient_clipping", "activation_checkpointing", "offload_optimizer",
                "offload_optimizer_pin_memory", "offload_param", "offload_param_pin_memory"]
        return lay, {k: overlap_comm(fw) if k == "overlap_comm" else fw[k] for k in keys}

    cfg = compose_config("mode=dry", "framework=deepspeed", "model=tiny", *overrides)
    _, lay, _ = check(cfg)
    back, _ = imported(json.loads(json.dumps(ds_config(cfg, lay))), lay.world)
    assert resolved(compose_config("mode=dry", "model=tiny", *back)) == resolved(cfg)


@pytest.mark.parametrize("change,name", [
    ({"fp16": {"enabled": True}}, "fp16.enabled"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 8}}},
     "zero_optimization.offload_param.buffer_count=8"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 8}}},
     "zero_optimization.offload_optimizer.buffer_count=8"),
    ({"pipeline": {"stages": 2}}, "'pipeline'"),
    ({"train_batch_size": 7}, "train_batch_size=7"),
])
def test_a_ds_setting_the_ledger_does_not_model_is_refused_by_name(change, name):
    from importers.deepspeed import overrides as imported

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2}, **change}
    with pytest.raises(ConfigError, match=name.replace("(", r"\(").replace(".", r"\.")):
        imported(ds, 2)


TITAN_ROUND_TRIP = [
    ["layout.dp=4"],
    ["layout.tp=2", "layout.dp=2", "framework.activation_checkpoint=full"],
    ["layout.tp=2", "layout.dp=2", "layout.sequence_parallel=false", "framework.activation_checkpoint=none"],
    ["layout.pp=2", "layout.dp=1", "layout.micro_batch_size=1", "layout.global_batch_size=4"],
    # a looped schedule: vp 2 (torchtitan's default) and vp 3 (pipeline_parallel_layers_per_stage written)
    ["layout.pp=2", "layout.vp=2", "layout.dp=1", "layout.global_batch_size=4",
     "framework.pipeline_parallel_schedule=Interleaved1F1B"],
    ["model.layers=10", "layout.pp=2", "layout.vp=3", "layout.dp=1", "layout.global_batch_size=4",
     "framework.pipeline_parallel_schedule=LoopedBFS"],
    ["layout.cp=2", "layout.dp=2", "model.seq_len=256"],
    ["layout.dp=4", "layout.dp_replicate=2", "framework.reshard_after_forward=never"],
    ["model=llama3_8b", "layout.tp=8", "layout.dp=16", "model.seq_len=8192"],
]


@pytest.mark.parametrize("overrides", TITAN_ROUND_TRIP, ids=lambda o: " ".join(o))
def test_titan_config_modules_import_back_to_the_same_config(overrides, tmp_path):
    """The Trainer.Config module mode=dry writes (render_module) -> importers.titan -> the same model
    shape, resolved layout and torchtitan knobs."""
    from importers import titan
    from launchers.job import check
    from launchers.titan import render_module
    from ledger.model import ModelShape

    def resolved(cfg):
        _, lay, _ = check(cfg)
        fw = {k: cfg.framework[k] for k in ("reshard_after_forward", "spmd_backend", "dtype", "mixed_precision_param",
                                            "mixed_precision_reduce", "activation_checkpoint",
                                            "pipeline_parallel_schedule")}
        return dataclasses.replace(ModelShape.from_config(cfg.model), name="-"), lay, fw

    cfg = compose_config("mode=dry", "framework=titan", "model=tiny", *overrides)
    _, lay, _ = check(cfg)
    path = tmp_path / "ledger_titan.py"
    path.write_text(render_module(cfg, lay, str(tmp_path / "tok"), str(tmp_path / "data"), str(tmp_path / "dump"),
                                  relative=True))
    back, _ = titan.overrides(titan.load(str(path)))
    assert resolved(compose_config("mode=dry", *back)) == resolved(cfg)


# Megatron-LM's examples/llama/train_llama3_8b_h200_bf16.sh, its mock-data branch, one node of 8 GPUs
# (the shell variables substituted; paths shortened)
MEGATRON_EXAMPLE = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
--lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path /tmp/cache --tiktoken-pattern v2
--split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --save-interval 1000 --log-throughput --profile --profile-step-start 4 --profile-step-end 6
--ckpt-format torch_dist --distributed-timeout-minutes 60 --save /tmp/ckpt --load /tmp/ckpt
--tensorboard-dir /tmp/tb --wandb-project megatron-lm-training --wandb-exp-name llama3x-8b-bf16-tp1
--wandb-save-dir /tmp/ckpt/wandb --log-params-norm --log-num-zeros-in-grad --log-timers-to-tensorboard
""".split()


def test_megatron_lms_own_llama3_example_imports(capsys):
    """A hand-written line from Megatron-LM's examples: its fused cross-entropy (which the ledger does not
    model) refused by name; without it, the llama3_8b shape on 8 GPUs with the distributed optimizer."""
    from importers.megatron import overrides as imported

    with pytest.raises(ConfigError, match="--cross-entropy-loss-fusion"):
        imported(MEGATRON_EXAMPLE, 8)
    line = [a for a in MEGATRON_EXAMPLE if a != "--cross-entropy-loss-fusion"]
    back, ignored = imported(line, 8)
    cfg = compose_config("mode=predict", *back)
    from launchers.job import check
    from ledger.model import ModelShape

    _, lay, pl = check(cfg)
    # Llama 3 8B's 8,030,261,248 and a bias on each of its 65 norms: the example leaves --normalization at
    # Megatron-LM's default, LayerNorm
    assert cfg.model.norm == "layernorm" and ModelShape.from_config(cfg.model).num_params() == 8_030_261_248 + 65 * 4096
    assert (lay.tp, lay.dp, lay.global_batch_size, cfg.framework.use_distributed_optimizer) == (1, 8, 128, True)
    assert cfg.framework.transformer_impl == "transformer_engine" and "--apply-layernorm-1p" in ignored


def test_torchtitans_own_llama3_8b_config_imports():
    """torchtitan 0.3.0's own config_registry.llama3_8b (FSDP over the world: data_parallel_shard_degree
    -1) on 8 GPUs: without a world refused naming the degree; its spmd_backend (torchtitan's default
    spmd_types, which fails inside torch 2.13's FSDP2) refused by the ledger naming the knob; with the
    backend the ledger models, Llama 3.1 8B at seq 8192, local batch 1, selective AC."""
    from importers import titan
    from launchers.job import check
    from ledger.model import ModelShape
    from torchtitan.models.llama3.config_registry import llama3_8b

    with pytest.raises(ConfigError, match="data_parallel_shard_degree=-1"):
        titan.overrides(llama3_8b())
    back, _ = titan.overrides(llama3_8b(), world=8)
    with pytest.raises(ConfigError, match="spmd_backend='spmd_types'"):
        check(compose_config("mode=predict", *back))
    c = llama3_8b()
    c.parallelism.spmd_backend = "partial_dtensor"
    back, _ = titan.overrides(c, world=8)
    cfg = compose_config("mode=predict", *back)
    _, lay, _ = check(cfg)
    assert ModelShape.from_config(cfg.model).num_params() == 8_030_261_248
    assert (lay.dp, lay.tp, cfg.model.seq_len, cfg.framework.activation_checkpoint) == (8, 1, 8192, "selective")


# DeepSpeedExamples' claude_tutorials/model_configs/llama/llama_7b_single_node.json (one node of 8 GPUs:
# 128 = 4 per GPU x 4 accumulation steps x 8)
DS_EXAMPLE = {"train_batch_size": 128, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
              "gradient_clipping": 1.0, "steps_per_print": 100, "wall_clock_breakdown": False,
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                    "reduce_scatter": True, "reduce_bucket_size": 500000000,
                                    "allgather_bucket_size": 500000000},
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5,
                                                                "warmup_num_steps": 2000, "total_num_steps": 100000}}}


def test_deepspeed_examples_ds_config_imports():
    """A ds_config from DeepSpeedExamples with the model named: ZeRO-2 over 8 GPUs, 4 sequences per GPU, 4
    accumulation steps, bf16, overlap_comm; its scheduler and logging ignored."""
    from importers.deepspeed import overrides as imported
    from launchers.job import check

    back, ignored = imported(DS_EXAMPLE, 8)
    cfg = compose_config("mode=predict", *back, "model=llama3_8b")
    _, lay, _ = check(cfg)
    assert (lay.dp, lay.micro_batch_size, lay.global_batch_size, lay.num_microbatches) == (8, 4, 128, 4)
    assert (cfg.framework.zero_stage, cfg.framework.overlap_comm, cfg.framework.precision) == (2, True, "bf16")
    assert ignored == ["scheduler", "steps_per_print", "wall_clock_breakdown"]
