"""What Megatron Core 0.18.0 (with Megatron-LM's arguments) accepts: its knobs' values, its layout
limits beside the shared rules (ledger/layout.py), the knobs whose default depends on the mode, and the
planner's view of its recompute and overlap knobs. ledger/faithful/megatron/__init__.py registers them."""
from __future__ import annotations

from ledger.faithful.megatron.cp import CP_COMM_TYPES
from ledger.faithful.megatron.target import default_transformer_impl
from ledger.checks import at_least, check_sizes, knob, one_of, positive
from ledger.faithful.megatron.pipeline import split_error, stage_layers
from ledger.layout import ConfigError

# sizes a knob takes in elements: (field, least value, what it is). A bucket of 0 elements would never
# advance the bucket walk; None: Megatron's default
SIZES = (("bucket_size", 1, "elements per DDP bucket; null: Megatron's default max(40M, 1M*dp)"),
         ("make_vocab_size_divisible_by", 1, "the vocab is padded to a multiple of this times tp"))

# the pipeline-split knobs (MegatronConfig; pipeline.EVEN_SPLIT order)
SPLIT = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
         "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")

TRANSFORMER_IMPLS = ("local", "transformer_engine")

# megatron-core 0.18.0 transformer_config.py TransformerConfig.__post_init__: the recompute_modules it
# allows; the MoE / MLA ones need a model this project does not build (no experts, no MLA)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
RECOMPUTE_MODULES_NOT_DENSE = ("moe_act", "mla_up_proj", "moe", "shared_experts")


def grad_dtype(fw) -> str:
    """DDP's main_grad dtype: fp32 under grad_reduce_in_fp32 (or an fp32 run), else the params' bf16."""
    return "fp32" if fw.grad_reduce_in_fp32 or fw.precision == "fp32" else "bf16"


def fill_mode_defaults(fw, mode: str, target: str) -> None:
    # the spec the target's run builds (target.py default_transformer_impl); mode=plan keeps an unset
    # transformer_impl unset: the ledger predicts Megatron-LM's default and the plan's sweep leaves the
    # choice to the run (local on a CPU)
    if fw.get("transformer_impl") is None and mode != "plan":
        fw.transformer_impl = default_transformer_impl(target)


def model_config_error(model_cfg) -> str | None:
    """Megatron-LM parses --rotary-base as an int (arguments.py: type=int) and TransformerConfig's
    rotary_base is an int: a fractional rope_theta would be truncated, so it is refused."""
    theta = model_cfg.get("rope_theta")
    if theta is not None and float(theta) != int(theta):
        return (f"megatron: model.rope_theta={theta} must be an integer: Megatron-LM's --rotary-base is an int "
                "(it would train with a truncated base)")
    return None


def run_error(fw, cluster) -> str | None:
    if fw.transformer_impl == "transformer_engine" and cluster.device != "cuda":
        return ("megatron: framework.transformer_impl=transformer_engine needs CUDA (TransformerEngine); "
                "a CPU run builds the local spec: set framework.transformer_impl=local")
    return None


def validate_knobs(fw) -> None:
    at_least("framework", fw, ("clip_grad",), 0)
    validate_recompute(fw)
    validate_moe(fw)
    validate_cp(fw)


def validate_cp(fw) -> None:
    """The context-parallel attention's knobs (ledger/faithful/megatron/cp.py checks them with the
    layout): TransformerConfig's four cp_comm_type values; hierarchical sizes, if set, are positive."""
    one_of("framework", fw, "cp_comm_type", CP_COMM_TYPES)
    sizes = fw.get("hierarchical_context_parallel_sizes")
    if sizes is not None and (not list(sizes) or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                                                     for x in sizes)):
        raise ConfigError(f"framework.hierarchical_context_parallel_sizes={list(sizes)!r} must list integers >= 1")


def validate_moe(fw) -> None:
    """Megatron's MoE knobs (TransformerConfig's names and sets; ledger/faithful/megatron/moe.py refuses
    what it does not model, with the layout)."""
    # flex needs DeepEP / HybridEP (CUDA kernels): transformer/moe/token_dispatcher.py MoEFlexTokenDispatcher
    one_of("framework", fw, "moe_token_dispatcher_type", ("allgather", "alltoall"))
    # sinkhorn and global_aux_loss are Megatron's too; the faithful ledger models these three
    one_of("framework", fw, "moe_router_load_balancing_type", ("aux_loss", "seq_aux_loss", "none"))
    at_least("framework", fw, ("moe_aux_loss_coeff",), 0)
    if fw.moe_expert_capacity_factor is not None:
        positive("framework", fw, ("moe_expert_capacity_factor",))


def validate_recompute(fw) -> None:
    """Megatron's recompute knobs, by the rules of megatron-core 0.18.0 transformer_config.py
    TransformerConfig.__post_init__ (the bound on recompute_num_layers by the layers of a stage is
    checked with the layout: ledger/faithful/megatron/activations.py check_recompute)."""
    g, meth, n, mods = (fw.get("recompute_granularity"), fw.get("recompute_method"),
                        fw.get("recompute_num_layers"), fw.get("recompute_modules"))
    if g not in (None, "selective", "full"):
        raise ConfigError(f"framework.recompute_granularity={g!r} must be one of null, selective, full")
    if meth not in (None, "uniform", "block"):
        raise ConfigError(f"framework.recompute_method={meth!r} must be one of null, uniform, block")
    if n is not None and (isinstance(n, bool) or n < 1):
        raise ConfigError(f"framework.recompute_num_layers={n} must be >= 1")
    if g is None:
        for name, v in (("recompute_method", meth), ("recompute_num_layers", n), ("recompute_modules", mods)):
            if v is not None:
                raise ConfigError(f"framework.{name}={v!r} needs framework.recompute_granularity "
                                  "(selective or full): without it Megatron recomputes nothing")
        return
    if g == "full":
        if meth is None:
            raise ConfigError("framework.recompute_granularity=full needs framework.recompute_method "
                              "(uniform or block; transformer_config.py)")
        if n is None:
            raise ConfigError("framework.recompute_granularity=full needs framework.recompute_num_layers "
                              "(between 1 and the layers of a pipeline stage; transformer_config.py)")
        if mods is not None:
            raise ConfigError(f"framework.recompute_modules={list(mods)} is for recompute_granularity=selective "
                              "(full recomputes whole layers)")
    else:
        # a recompute_method with selective is accepted and unused, as TransformerConfig does
        if n is not None:
            raise ConfigError(f"framework.recompute_num_layers={n} must be null with recompute_granularity=selective "
                              "(transformer_config.py)")
        for m in list(mods or []):
            if m in RECOMPUTE_MODULES_NOT_DENSE:
                raise ConfigError(f"framework.recompute_modules has {m!r}: it recomputes a MoE / MLA part, and the "
                                  f"models here are dense; use {', '.join(RECOMPUTE_MODULES)}")
            if m not in RECOMPUTE_MODULES:
                raise ConfigError(f"framework.recompute_modules has {m!r}: each must be one of "
                                  f"{', '.join(RECOMPUTE_MODULES)} (megatron-core 0.18.0 transformer_config.py)")


def validate_layout(model, lay, fw_cfg) -> None:
    """Megatron's layout limits beside the shared rules (ledger/layout.py validate)."""
    if fw_cfg is not None:
        check_sizes(fw_cfg, SIZES)
    if not (lay.dp_replicate == 1):
        raise ConfigError("megatron: dp_replicate (HSDP) is a torchtitan layout")
    # the pipeline split: Megatron's own rules and reasons (pipeline.split_error)
    split = tuple(knob(fw_cfg, name) for name in SPLIT)
    if not (split == (None, None, None, None) or split == (None, None, False, False)) \
            or model.layers % (lay.pp * lay.vp):
        why = split_error(model.layers, lay.pp, lay.vp, (*split[:2], bool(split[2]), bool(split[3])))
        if why is not None:
            raise ConfigError(f"megatron: layers={model.layers} pp={lay.pp} vp={lay.vp}"
                              + "".join(f" {n}={v}" for n, v in zip(SPLIT, split) if v)
                              + f": {why} (megatron-core 0.18.0 transformer_config.py / transformer_block.py)")
    impl = knob(fw_cfg, "transformer_impl")
    if not (impl is None or impl in TRANSFORMER_IMPLS):
        raise ConfigError(f"framework.transformer_impl={impl!r} must be local or transformer_engine "
                          "(null: transformer_engine to predict, local to run)")


def vocab_error(model, lay) -> None:
    """Megatron pads the vocab to a multiple of make_vocab_size_divisible_by x tp itself
    (pipeline.padded_vocab): any vocab is accepted."""
    return None


def head_width_modelled(model) -> bool:
    """kv_channels other than hidden/heads and q/k norms: Megatron's TransformerConfig has both."""
    return True


def recompute_knobs(mode: str) -> dict:
    """TransformerConfig recompute_granularity (full: method uniform, one layer per chunk, as
    Megatron-LM's examples set it)."""
    if mode == "none":
        return {"recompute_granularity": None}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def recompute_mode(knobs) -> str:
    return knobs.get("recompute_granularity") or "none"


def overlaps(fw) -> bool:
    """DDP overlaps its grad reduce-scatters with the backward under overlap_grad_reduce only."""
    return bool(fw.overlap_grad_reduce)


# Megatron-LM's own defaults (megatron/training/arguments.py) where train-ledger's differ: without
# --bf16 / --fp16 the model trains in fp32; --transformer-impl defaults to transformer_engine (a CPU
# run builds the local spec: fill_mode_defaults). The distributed optimizer is off unless
# --use-distributed-optimizer (store_true), as train-ledger's default.
OWN_DEFAULTS = {"precision": "fp32", "transformer_impl": "transformer_engine"}


# -- the planner's axes (ledger/plan.py candidates) ---------------------------------------------------

# the planner chooses the pipeline split per layout: a split set in the base config is not carried into
# layouts it was not written for; a row starts from the even split (SPLIT's knobs unset)
PLAN_CHOOSES = {**dict.fromkeys(SPLIT[:2]), **dict.fromkeys(SPLIT[2:], False),
                "use_distributed_optimizer": False}  # (every row sets it: plan_knob_sets)


def plan_knob_sets(space, model=None, dp: int | None = None, cp: int = 1) -> list[dict]:
    """The planner tries the distributed optimizer on and off (plan.distributed_optimizer), where it
    shards something: a dense model's layout of one DP rank keeps every param on it either way
    (distrib_optimizer.py splits each bucket into dp ranges), so it is tried off alone, as Megatron-LM
    runs by default (both stay for MoE: the experts' optimizer shards over their own data-parallel group).
    With cp > 1, each context-parallel attention of plan.cp_comm_types (none listed: as configured)."""
    values = list(space.distributed_optimizer)
    if dp == 1 and model is not None and not model.is_moe and False in values:
        values = [False]
    types = [{"cp_comm_type": t} for t in getattr(space, "cp_comm_types", ())] if cp > 1 else []
    return [{"use_distributed_optimizer": v, **t} for v in values for t in (types or [{}])]


def plan_splits(layers: int, pp: int, vp: int, space=None) -> list[dict]:
    """The pipeline splits the planner tries, as knobs (space: the planner's, not read here)."""
    return [split_knobs(s) for s in pipeline_splits(layers, pp, vp)]


def pipeline_splits(layers: int, pp: int, vp: int) -> list[tuple]:
    """The pipeline splits worth trying (pipeline.EVEN_SPLIT order): the even one where pp*vp
    divides the layers; else the uneven ones Megatron builds: the two most balanced first = last = x
    splits, the middle stages sharing the rest (Llama 3 405B: 126 layers over 16 stages as 7 + 14 x 8
    + 7, then 14 + 14 x 7 + 14; pp = 2: the halves), and the embedding and loss each counted as a layer. Splits that give the same layers per stage are tried
    once. Where none is valid the even split stands, so the refusal is Megatron's own reason."""
    even = (None, None, False, False)
    if pp == 1 or split_error(layers, pp, vp, even) is None:
        return [even]
    out, seen = [], set()
    cands = []
    if pp > 2:
        # first = last = x, the middle pp-2 stages sharing the rest evenly; the most balanced x first
        for x in range(1, layers // 2 + 1):
            if (layers - 2 * x) % (pp - 2) == 0:
                mid = (layers - 2 * x) // (pp - 2)
                if mid > 0:
                    cands.append((max(x, mid) - min(x, mid), -x, (x, x, False, False)))
        cands.sort()
        cands = [c[2] for c in cands[:2]]
    else:
        cands = [(x, layers - x, False, False) for x in (layers // 2, layers // 2 + 1) if 0 < x < layers]
    cands.append((None, None, True, True))
    for s in cands:
        if split_error(layers, pp, vp, s) is not None:
            continue
        per_stage = tuple(sum(stage_layers(layers, pp, vp, st, ch, s) for ch in range(vp)) for st in range(pp))
        if per_stage not in seen:
            seen.add(per_stage)
            out.append(s)
    return out or [even]


def split_knobs(split: tuple) -> dict:
    """A pipeline split as the knobs that set it (an even split sets none)."""
    first, last, emb, loss = split
    out = {}
    if first is not None:
        out["decoder_first_pipeline_num_layers"] = first
    if last is not None:
        out["decoder_last_pipeline_num_layers"] = last
    if emb:
        out["account_for_embedding_in_pipeline_split"] = True
    if loss:
        out["account_for_loss_in_pipeline_split"] = True
    return out
