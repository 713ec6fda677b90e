"""model.hf_config: a HuggingFace config.json (written here, from the models' published configs) as the
model's shape; the parameter counts are the ones the models' cards publish."""
import json

import pytest

from conf import hf
from ledger.errors import ConfigError
from ledger.model import ModelShape

LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
              "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
              "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
LLAMA32_1B = {**LLAMA31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "head_dim": 64, "tie_word_embeddings": True}
MISTRAL_7B_V03 = {"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
                  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32768}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
                "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
                "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                 "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
                 "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
                 "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
                 "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
                 "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
                 "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
            "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": False, "vocab_size": 151936}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
             "intermediate_size": 18944, "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
             "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "vocab_size": 152064}


@pytest.mark.parametrize("config,params", [
    (LLAMA31_8B, 8_030_261_248), (LLAMA32_1B, 1_235_814_400), (MISTRAL_7B_V03, 7_248_023_552),
    (MIXTRAL_8X7B, 46_702_792_704), (QWEN3_30B_A3B, 30_532_122_624), (QWEN25_7B, 7_615_616_512)])
def test_published_configs_map_to_their_parameter_counts(config, params):
    m = ModelShape.from_config({"name": "x", "seq_len": 128, "moe_router_topk": 2, "moe_router_dtype": None,
                                **hf.model_fields(config)})
    assert m.num_params() == params


@pytest.mark.parametrize("config", [LLAMA31_8B, LLAMA32_1B, MISTRAL_7B_V03, QWEN25_7B, QWEN3_8B, MIXTRAL_8X7B,
                                    QWEN3_30B_A3B], ids=lambda c: c["model_type"] + "-" + str(c["hidden_size"]))
def test_the_parameter_count_is_what_transformers_builds(config, tmp_path):
    """The same config.json (written here) built by transformers' own model class on the meta device
    (AutoModelForCausalLM.from_config: no weights, no download) has the parameters the mapped shape
    counts, one family after another (tied embeddings counted once by both)."""
    import torch
    import transformers  # a test dependency (pyproject.toml)

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    ours = ModelShape.from_config({"name": "x", "seq_len": 128, "moe_router_topk": 2, "moe_router_dtype": None,
                                   **hf.model_fields(hf.load(str(path)))}).num_params()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(path)))
    assert sum(p.numel() for p in model.parameters()) == ours


@pytest.mark.parametrize("preset,config", [("qwen3_30b_a3b", QWEN3_30B_A3B), ("mixtral_8x7b", MIXTRAL_8X7B),
                                           ("llama3_8b", LLAMA31_8B)])
def test_a_preset_and_its_config_json_are_one_shape(preset, config):
    """Each preset of conf/model with a published config.json is the shape that config maps to, and the
    same rope and norm eps (seq_len is the run's; llama3_1b is Llama-3.2-1B untied on purpose, as the
    design article's runs)."""
    import dataclasses

    from tests.conftest import compose_config

    want = compose_config(f"model={preset}").model
    got = {**want, **hf.model_fields(config)}
    assert dataclasses.replace(ModelShape.from_config(got), name="-") == \
        dataclasses.replace(ModelShape.from_config(want), name="-")
    assert (got["rope_theta"], got["norm_eps"]) == (want["rope_theta"], want["norm_eps"])


@pytest.mark.parametrize("change,field", [
    ({"model_type": "deepseek_v3"}, "model_type='deepseek_v3'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),
    ({"kv_lora_rank": 512}, "kv_lora_rank=512"),
])
def test_what_the_ledgers_do_not_model_is_refused_naming_the_field(change, field, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA31_8B, **change}))
    with pytest.raises(ConfigError, match=f"model.hf_config: {field}"):
        hf.model_fields(hf.load(str(path)))


def test_predict_from_a_config_json(tmp_path):
    """`launch.py mode=predict model.hf_config=PATH`: the file's shape, named by its stem, the ignored
    fields listed; Qwen2.5 (q/k/v biases) predicted by Megatron, refused by torchtitan naming the field."""
    from tests.conftest import launch

    path = tmp_path / "llama31_8b.json"
    path.write_text(json.dumps(LLAMA31_8B))
    p = launch("mode=predict", f"model.hf_config={path}", "framework=megatron", "layout.tp=4",
               f"hydra.run.dir={tmp_path / 'job'}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    pred = json.load(open(tmp_path / "job" / "prediction.json"))
    assert pred["model"]["num_params"] == 8_030_261_248 and pred["model"]["name"] == "llama31_8b"
    assert "ignored: " in p.stdout and "rope_scaling" in p.stdout
    q = tmp_path / "qwen25_7b.json"
    q.write_text(json.dumps(QWEN25_7B))
    p = launch("mode=predict", f"model.hf_config={q}", "framework=megatron", "layout.tp=4",
               f"hydra.run.dir={tmp_path / 'q'}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.load(open(tmp_path / "q" / "prediction.json"))["model"]["num_params"] == 7_615_616_512
    p = launch("mode=predict", f"model.hf_config={q}", "framework=titan", f"hydra.run.dir={tmp_path / 't'}", timeout=300)
    assert p.returncode == 2 and "model.qkv_bias=true" in p.stderr, p.stderr[-2000:]


@pytest.mark.real
def test_qkv_biases_reconcile_on_megatron_and_deepspeed(tmp_path):
    """model.qkv_bias (Qwen2's q/k/v biases) on real CPU runs: Megatron's add_qkv_bias under TP with SP and
    the distributed optimizer, DeepSpeed's Llama under ZeRO-1: every state and collective row exact, the
    peaks within 1% (the matrices' rule)."""
    from tests.conftest import assert_every_row_reconciles, run_sweeps

    sweep = run_sweeps(tmp_path, (
        ("megatron", ("framework=megatron", "framework.transformer_impl=local", "framework.use_distributed_optimizer=true",
                      "layout={tp:2,sequence_parallel:true}", "model.hidden=208")),
        ("deepspeed", ("framework=deepspeed", "framework.zero_stage=1", "layout.dp=2"))),
        ("model.qkv_bias=true", "model.seq_len=32", "train.steps=2"))
    assert len(sweep["ok"]) == 2 == len(sweep["records"]), [(r["job_dir"], r.get("error")) for r in sweep["records"]]
    for r in sweep["ok"]:  # the runs had the biases: the prediction counts them, one per q/k/v output
        m = r["prediction"]["model"]
        plain = ModelShape.from_config({**r["config"]["model"], "qkv_bias": False}).num_params()
        assert m["qkv_bias"] and m["num_params"] - plain == m["layers"] * (m["heads"] + 2 * m["kv_heads"]) * \
            (m["hidden"] // m["heads"])
    assert_every_row_reconciles(sweep["table"], sweep["ok"])



@pytest.mark.parametrize("name,config,params", [("mixtral", MIXTRAL_8X7B, 46_702_792_704),
                                                ("qwen3_moe", QWEN3_30B_A3B, 30_532_122_624)])
def test_moe_config_json_at_tp4_is_predicted(name, config, params, tmp_path):
    """An MoE config.json with layout.tp=4 alone: Megatron predicts it (the layout Megatron trains: SP
    with TP, experts split over etp = tp at ep = 1, each said in a note) with the published count."""
    from tests.conftest import launch

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    p = launch("mode=predict", f"model.hf_config={path}", "framework=megatron", "layout.tp=4",
               f"hydra.run.dir={tmp_path / 'job'}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    pred = json.load(open(tmp_path / "job" / "prediction.json"))
    assert pred["model"]["num_params"] == params and f"N={params:,}" in p.stdout
    out = " ".join(p.stdout.split())
    assert "predicted with sequence_parallel=true" in out and "predicted with etp=4" in out
