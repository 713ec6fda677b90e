"""A DeepSpeed ds_config.json as train-ledger overrides: its zero_optimization section read by DeepSpeed's
own config class (runtime/zero/config.py DeepSpeedZeroConfig: its defaults and its rules, e.g.
overlap_comm on at stage 3), the batch, precision, clipping, optimizer and activation checkpointing read
as runtime/config.py reads them. The model is not in a ds_config: the caller names it (model=... or
model.hf_config=...).

Each setting is mapped (ZERO, the batch, bf16, gradient_clipping, activation_checkpointing), ignored
(IGNORED: logging, schedulers, the optimizer's hyper-parameters; offload_optimizer's and offload_param's device
and pin_memory as framework.offload_optimizer / offload_param) or refused naming it: fp16,
another optimizer, a ZeRO setting away from its default the ledger does not model, a section it does
not know.
"""
from __future__ import annotations

import json

from ledger.errors import ConfigError

# DeepSpeedZeroConfig field -> framework.<knob>
ZERO = {"stage": "zero_stage", "reduce_bucket_size": "reduce_bucket_size",
        "allgather_bucket_size": "allgather_bucket_size", "overlap_comm": "overlap_comm",
        "contiguous_gradients": "contiguous_gradients", "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "max_reuse_distance": "stage3_max_reuse_distance", "max_live_parameters": "stage3_max_live_parameters",
        "param_persistence_threshold": "stage3_param_persistence_threshold"}
# zero settings that change no prediction at their values here, or nothing the ledger predicts
ZERO_IGNORED = ("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                "ignore_unused_parameters", "elastic_checkpoint", "load_from_fp32_weights", "log_trace_cache_warnings",
                "enable_sanity_checks", "sub_group_size", "model_persistence_threshold", "leaf_module",
                "pipeline_loading_checkpoint", "save_muon_momentum_buffer_in_memory")
TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
       "bf16", "fp16", "optimizer", "zero_optimization", "activation_checkpointing")
IGNORED = ("steps_per_print", "wall_clock_breakdown", "scheduler", "tensorboard", "wandb", "csv_monitor",
           "comet", "prescale_gradients", "zero_allow_untested_optimizer", "dump_state", "memory_breakdown",
           "flops_profiler", "checkpoint", "comms_logger")
OPTIMIZERS = ("adam", "adamw")  # torch's / DeepSpeed's Adam(W): two fp32 moments and a step per param


def load(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"deepspeed import: {path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"deepspeed import: {path}: not a JSON object")
    return d


def _zero(section: dict) -> dict:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        z = DeepSpeedZeroConfig(**section)
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError: DeepSpeed's own rule, its message
        raise ConfigError(f"deepspeed import: zero_optimization: {e}") from None
    default = DeepSpeedZeroConfig(stage=z.stage).model_dump()
    got = z.model_dump()
    out = {knob: got[field] for field, knob in ZERO.items()}
    for key, v in got.items():
        if key in ZERO or key in ZERO_IGNORED or v == default.get(key):
            continue
        if key in ("offload_optimizer", "offload_param"):
            out.update(_offload(key, v))
            continue
        raise ConfigError(f"deepspeed import: zero_optimization.{key}={v!r} is not modelled by the ledger "
                          "(quantized or hierarchical partitions, ...)")
    return out


def _offload(section: str, v: dict) -> dict:
    """zero_optimization.offload_optimizer / offload_param (offload_config.py) as framework.<section> and its
    pin_memory; a setting of it away from DeepSpeed's default refused naming it (the ledger's own refusals follow
    when the job is validated)."""
    from deepspeed.runtime.zero import offload_config

    cls = (offload_config.DeepSpeedZeroOffloadOptimizerConfig if section == "offload_optimizer"
           else offload_config.DeepSpeedZeroOffloadParamConfig)
    default = cls().model_dump()
    for key, x in v.items():
        if key not in ("device", "pin_memory") and x != default.get(key):
            raise ConfigError(f"deepspeed import: zero_optimization.{section}.{key}={x!r} is not modelled by the ledger")
    device = getattr(v["device"], "value", v["device"])
    return {section: str(device), f"{section}_pin_memory": bool(v["pin_memory"])}


def overrides(ds: dict, world: int) -> tuple[list[str], list[str]]:
    """(train-ledger overrides but the model's, ignored settings) of a ds_config run on `world` GPUs
    (pure data parallelism: every GPU a DP rank); ConfigError naming a setting that is not modelled."""
    for key in ds:
        if key not in TOP and key not in IGNORED:
            raise ConfigError(f"deepspeed import: {key!r} is not modelled by the ledger (it may change what the "
                              "run holds or sends)")
    if (ds.get("fp16") or {}).get("enabled"):
        raise ConfigError("deepspeed import: fp16.enabled: the DeepSpeed ledger models bf16 and fp32")
    opt = ds.get("optimizer") or {"type": "AdamW"}
    if str(opt.get("type", "")).lower() not in OPTIMIZERS:
        raise ConfigError(f"deepspeed import: optimizer.type={opt.get('type')!r}: the ledger models Adam / AdamW")
    zero = _zero(ds.get("zero_optimization") or {})
    # runtime/config.py _configure_train_batch_size: two of the three given, the third follows
    mbs, gas, tbs = (ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps"),
                     ds.get("train_batch_size"))
    if mbs is None:
        if tbs is None:
            raise ConfigError("deepspeed import: train_micro_batch_size_per_gpu or train_batch_size is needed")
        mbs = tbs // ((gas or 1) * world)
    if tbs is None:
        tbs = mbs * (gas or 1) * world
    if tbs != mbs * (tbs // (mbs * world)) * world or (gas is not None and tbs != mbs * gas * world):
        raise ConfigError(f"deepspeed import: train_batch_size={tbs} is not micro_batch {mbs} x "
                          f"gradient_accumulation_steps {gas} x world {world} (DeepSpeed's own rule)")
    out = ["framework=deepspeed", f"layout.dp={world}", f"layout.micro_batch_size={mbs}",
           f"layout.global_batch_size={tbs}",
           f"framework.precision={'bf16' if (ds.get('bf16') or {}).get('enabled') else 'fp32'}",
           f"framework.gradient_clipping={float(ds.get('gradient_clipping', 0.0))}",
           f"framework.activation_checkpointing={'true' if 'activation_checkpointing' in ds else 'false'}"]
    out += [f"framework.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in zero.items()]
    if "lr" in (opt.get("params") or {}):
        out.append(f"train.lr={opt['params']['lr']}")
    return out, sorted(k for k in ds if k in IGNORED)
