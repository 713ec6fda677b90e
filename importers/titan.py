"""A torchtitan 0.3.0 config as train-ledger overrides: a Python module whose function returns a
`Trainer.Config` (torchtitan's own config objects; `mode=dry` writes one, ledger_titan.py's
ledger_config), read from the objects themselves: the model spec's Llama3 config (dim, vocab, its
layers' attention, feed-forward and norms, the rope), `training` (batch, sequence, dtypes),
`parallelism` (the degrees, sequence parallelism, FSDP's reshard policy, the PP schedule) and
`activation_checkpoint`.

What the ledger does not model is refused naming it: MoE layers, layers that differ from each other,
tied weights, a PP schedule other than 1F1B or an uneven PP split, float8 / compile settings away from
their defaults.
"""
from __future__ import annotations

import os
import sys

from ledger.errors import ConfigError
from ledger.faithful.titan.schedules import SCHEDULES


def load(path: str, function: str = "ledger_config"):
    """`function()` of the module at path (executed: a torchtitan config module is Python)."""
    from launchers.titan import load_module

    if not os.path.isfile(path):
        raise ConfigError(f"titan import: {path}: no such file")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # a user's module may import its neighbours
    try:
        mod = load_module(path)
    finally:
        sys.path.pop(0)
    fn = getattr(mod, function, None)
    if fn is None:
        raise ConfigError(f"titan import: {path} has no {function}() (--function names the one returning "
                          "the Trainer.Config)")
    return fn()


def _refuse(what: str, why: str) -> ConfigError:
    return ConfigError(f"titan import: {what}: {why}")


def _layer_shape(layer) -> tuple:
    att, ff = layer.attention, layer.feed_forward
    if getattr(layer, "moe", None) is not None:
        raise _refuse("layers[*].moe", "MoE configs are not imported yet (model=... with its MoE fields)")
    if ff is None:
        raise _refuse("layers[*].feed_forward", "a layer without a feed-forward is not modelled")
    for name, lin in (("w1", ff.w1), ("w2", ff.w2), ("w3", ff.w3)):
        if lin.bias:
            raise _refuse(f"feed_forward.{name}.bias", "linear biases are not modelled for torchtitan")
    qkv = att.qkv_linear
    return (att.n_heads, att.n_kv_heads or att.n_heads, qkv.head_dim, att.qk_norm is not None, ff.w1.out_features,
            layer.attention_norm.eps, att.rope.theta)


def overrides(cfg, world: int | None = None) -> tuple[list[str], list[str]]:
    """(train-ledger overrides, ignored settings) of a torchtitan Trainer.Config run on `world` GPUs
    (needed where data_parallel_shard_degree is -1, torchtitan's "the rest of the world", as its own
    configs leave it); ConfigError naming what the ledger does not model."""
    mc = cfg.model_spec.model
    if getattr(mc, "enable_weight_tying", False):
        raise _refuse("model.enable_weight_tying=True", "tied weights are not modelled for torchtitan")
    shapes = {_layer_shape(layer) for layer in mc.layers}
    if len(shapes) != 1:
        raise _refuse("model.layers", f"{len(shapes)} different layer shapes: the ledger models identical layers")
    heads, kv_heads, head_dim, qk_norm, ffn, eps, theta = shapes.pop()
    p, t = cfg.parallelism, cfg.training
    vp = 1
    if p.pipeline_parallel_degree > 1:
        if p.pipeline_parallel_schedule not in SCHEDULES:
            raise _refuse(f"parallelism.pipeline_parallel_schedule={p.pipeline_parallel_schedule!r}",
                          f"the ledger models {', '.join(SCHEDULES)}")
        if p.module_fqns_per_model_part is not None:
            raise _refuse("parallelism.module_fqns_per_model_part", "torchtitan's own split is modelled")
        # pipeline_parallel.py _get_pipeline_metadata: ceil((layers + 2) / layers_per_stage) stages, else one a
        # rank (single-stage schedules) or two (looped)
        looped = SCHEDULES[p.pipeline_parallel_schedule].style != "single"
        stages = -(-(len(mc.layers) + 2) // p.pipeline_parallel_layers_per_stage) \
            if p.pipeline_parallel_layers_per_stage else p.pipeline_parallel_degree * (2 if looped else 1)
        if stages % p.pipeline_parallel_degree:
            raise _refuse("parallelism.pipeline_parallel_layers_per_stage",
                          f"{stages} stages over pipeline_parallel_degree={p.pipeline_parallel_degree} (torchtitan "
                          "refuses it too)")
        vp = stages // p.pipeline_parallel_degree
    ac = type(cfg.activation_checkpoint).__qualname__ if cfg.activation_checkpoint is not None else "None"
    ac_mode = {"SelectiveAC": "selective", "FullAC": "full", "NoneType": "none", "None": "none"}.get(
        ac.split(".")[0], None)
    if ac_mode is None:
        raise _refuse(f"activation_checkpoint={ac}", "the ledger models none, selective and full")
    dp_shard = p.data_parallel_shard_degree
    if dp_shard < 1:
        # config/job_config.py ParallelismConfig: -1 is what the world leaves (parallel_dims.py _validate)
        rest = p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree \
            * p.data_parallel_replicate_degree
        if not world or world % rest:
            raise _refuse(f"parallelism.data_parallel_shard_degree={dp_shard}",
                          f"-1 is the world's rest: give --world N (a multiple of tp*pp*cp*replicate={rest})")
        dp_shard = world // rest
    dp = dp_shard * p.data_parallel_replicate_degree
    pp = p.pipeline_parallel_degree
    mbs = p.pipeline_parallel_microbatch_size if pp > 1 else t.local_batch_size
    gbs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
    out = ["framework=titan", f"model.layers={len(mc.layers)}", f"model.hidden={mc.dim}", f"model.ffn_hidden={ffn}",
           f"model.heads={heads}", f"model.kv_heads={kv_heads}", f"model.vocab={mc.vocab_size}",
           f"model.seq_len={t.seq_len}", "model.tied_embeddings=false", "model.norm=rmsnorm", "model.swiglu=true",
           "model.bias=false", f"model.rope_theta={float(theta)}", f"model.norm_eps={eps}",
           f"model.qk_layernorm={'true' if qk_norm else 'false'}",
           f"model.kv_channels={head_dim if head_dim and head_dim != mc.dim // heads else 0}",
           f"layout.tp={p.tensor_parallel_degree}", f"layout.pp={pp}", f"layout.vp={vp}",
           f"layout.cp={p.context_parallel_degree}",
           f"layout.dp={dp}", f"layout.dp_replicate={p.data_parallel_replicate_degree}",
           f"layout.ep={p.expert_parallel_degree}",
           # parallelize.py applies SP with TP alone (enable_sequence_parallel defaults on)
           f"layout.sequence_parallel={'true' if p.enable_sequence_parallel and p.tensor_parallel_degree > 1 else 'false'}",
           f"layout.micro_batch_size={mbs}", f"layout.global_batch_size={gbs}",
           f"framework.reshard_after_forward={p.fsdp_reshard_after_forward}",
           f"framework.spmd_backend={p.spmd_backend}", f"framework.dtype={t.dtype}",
           f"framework.mixed_precision_param={t.mixed_precision_param}",
           f"framework.mixed_precision_reduce={t.mixed_precision_reduce}",
           f"framework.activation_checkpoint={ac_mode}", f"train.steps={t.steps}",
           f"framework.pipeline_parallel_schedule={p.pipeline_parallel_schedule}"]
    ignored = ["optimizer", "lr_scheduler", "dataloader", "metrics", "debug", "hf_assets_path", "dump_folder"]
    return out, ignored
