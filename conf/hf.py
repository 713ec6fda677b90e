"""A HuggingFace config.json as the model's shape: `model.hf_config=PATH` (a local file; nothing is
downloaded).

The architectures the three frameworks train as Llama-style decoders map onto conf/schema.py
ModelConfig: Llama 2 / 3 / 3.1 / 3.2 and Mistral (`LlamaConfig` / `MistralConfig`), Qwen2 / 2.5 (q/k/v
biases: model.qkv_bias, modelled by Megatron and DeepSpeed's Llama, refused by torchtitan), Qwen3 (q/k
norms, its own head_dim), Mixtral and Qwen3-MoE. Every field that changes bytes or FLOPs is mapped; what the
ledgers do not model is refused naming the config.json field (exit 2), and fields that change neither
(rope scaling, dropout, the router's loss coefficient, ...) are ignored and listed. The file's values
replace the model group's for the fields they map; seq_len (the run's, not the checkpoint's
max_position_embeddings) stays the config's.
"""
from __future__ import annotations

import json
import os

from ledger.errors import ConfigError

# model_type -> what its transformers model has that the mapping depends on
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen3_moe")
# fields read by no rule of the ledgers: they change neither a tensor's shape nor a FLOP
IGNORED = ("_name_or_path", "tokenizer_class", "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_dropout",
           "initializer_range", "max_position_embeddings", "max_window_layers", "model_type", "pretraining_tp",
           "rope_scaling", "torch_dtype", "dtype", "transformers_version", "use_cache", "router_aux_loss_coef",
           "output_router_logits", "norm_topk_prob", "router_jitter_noise", "rope_parameters")
# fields model_fields reads (mapped, or checked for what is not modelled)
MAPPED = ("model_type", "use_sliding_window", "sliding_window", "tie_word_embeddings", "head_dim", "attention_bias",
          "mlp_bias", "hidden_act", "rms_norm_eps", "rope_theta", "decoder_sparse_step", "mlp_only_layers",
          "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size",
          "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "layer_types")


def _refuse(field: str, value, why: str) -> ConfigError:
    return ConfigError(f"model.hf_config: {field}={value!r}: {why}")


def model_fields(hf: dict) -> dict:
    """conf/schema.py ModelConfig fields of a parsed config.json; ConfigError naming the field the
    ledgers do not model."""
    kind = hf.get("model_type")
    if kind not in DENSE + MOE:
        raise _refuse("model_type", kind, f"the mapped architectures are {', '.join(DENSE + MOE)} (Llama-style "
                      "decoders the three frameworks train); deepseek's multi-latent attention is not modelled")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "the ledgers model SwiGLU MLPs (silu-gated)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise _refuse(flag, hf[flag], "linear biases in the attention or MLP are not modelled")
    if hf.get("sliding_window") is not None and (kind == "mistral" or hf.get("use_sliding_window")):
        raise _refuse("sliding_window", hf["sliding_window"], "sliding-window attention is not modelled "
                      "(its activations and FLOPs differ from full causal attention's)")
    if hf.get("mlp_only_layers"):
        raise _refuse("mlp_only_layers", hf["mlp_only_layers"], "dense layers among MoE layers at chosen indices "
                      "are not modelled (model.moe_layer_freq places MoE layers every k-th)")
    layer_types = hf.get("layer_types")
    if layer_types and set(layer_types) != {"full_attention"}:
        raise _refuse("layer_types", sorted(set(layer_types)), "only full attention layers are modelled")
    heads = hf["num_attention_heads"]
    out = {"layers": hf["num_hidden_layers"], "hidden": hf["hidden_size"], "ffn_hidden": hf["intermediate_size"],
           "heads": heads, "kv_heads": hf.get("num_key_value_heads") or heads, "vocab": hf["vocab_size"],
           "tied_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm": "rmsnorm", "swiglu": True,
           "bias": False, "rope_theta": float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
           "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "num_experts": 0, "moe_ffn_hidden": 0,
           "moe_shared_expert_hidden": 0, "moe_layer_freq": 1, "kv_channels": 0,
           "qk_layernorm": kind in ("qwen3", "qwen3_moe"),  # Qwen3Attention: q_norm / k_norm always
           "qkv_bias": kind == "qwen2"}  # Qwen2Attention: q_proj / k_proj / v_proj with bias=True, o_proj without
    head_dim = hf.get("head_dim")
    if head_dim and head_dim != hf["hidden_size"] // heads:
        out["kv_channels"] = head_dim
    if kind == "mixtral":
        # every layer MoE, each expert intermediate_size wide: moe_ffn_hidden 0 (= ffn_hidden)
        out.update(num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"], moe_ffn_hidden=0)
    elif kind == "qwen3_moe":
        out.update(num_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
                   moe_ffn_hidden=hf["moe_intermediate_size"], moe_layer_freq=hf.get("decoder_sparse_step", 1))
    return out


def ignored_fields(hf: dict) -> list[str]:
    """The config.json fields that change nothing the ledgers predict (IGNORED), as present."""
    return sorted(k for k in hf if k in IGNORED)


def unknown_fields(hf: dict) -> list[str]:
    """Fields no rule here reads: refused, since one may change the shape (a new architecture's)."""
    return sorted(k for k in hf if k not in IGNORED and k not in MAPPED)


def load(path: str) -> dict:
    """The parsed config.json at path; ConfigError naming model.hf_config when it cannot be read."""
    try:
        with open(os.path.expanduser(path)) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_config={path!r}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.hf_config={path!r}: a JSON {type(hf).__name__}, not a config object")
    extra = unknown_fields(hf)
    if extra:
        raise _refuse(extra[0], hf[extra[0]], "a field the mapping does not know (it may change the shape); "
                      f"known: the fields of {', '.join(DENSE + MOE)} configs")
    return hf


def apply(model_cfg) -> list[str]:
    """model.hf_config's fields into model_cfg (an OmegaConf node) in place; returns the ignored fields.
    Nothing happens without model.hf_config."""
    path = model_cfg.get("hf_config")
    if not path:
        return []
    hf = load(path)
    for k, v in model_fields(hf).items():
        model_cfg[k] = v
    # the model's name is the file's stem (tables, W&B tags and dry artifacts name it)
    model_cfg["name"] = "".join(c if c.isalnum() or c in "._-" else "_" for c in
                                os.path.splitext(os.path.basename(path))[0]) or "hf_model"
    return ignored_fields(hf)
