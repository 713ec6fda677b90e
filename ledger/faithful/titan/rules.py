"""What torchtitan 0.3.0 accepts as this ledger models it: its knobs' values, its layout limits beside
the shared rules (ledger/layout.py), its MoE limits, and the planner's view of its activation
checkpointing. ledger/faithful/titan/__init__.py registers them."""
from __future__ import annotations

from ledger.checks import one_of
from ledger.faithful.titan.pp import pp_stages
from ledger.faithful.titan.schedules import (SCHEDULES, SPLIT_BACKWARD, microbatch_error, schedule_of, stages_error,
                                             stages_split_error)
from ledger.layout import ConfigError

# torch _context_parallel/_attention.py _create_cp_block_mask: FlexAttention's CP BlockMask is sharded in
# blocks of torch/nn/attention/flex_attention.py _DEFAULT_SPARSE_BLOCK_SIZE = 128 tokens
CP_BLOCK = 128


# torchtitan 0.3.0's own defaults where train-ledger's differ: ParallelismConfig.spmd_backend is
# "spmd_types" (config/configs.py), which fails inside torch 2.13's FSDP2, so jobs use "partial_dtensor"
OWN_DEFAULTS = {"spmd_backend": "spmd_types"}


def grad_dtype(fw) -> str:
    """FSDP2 keeps fp32 sharded gradients (MixedPrecisionPolicy reduce_dtype float32)."""
    return "fp32"


def validate_knobs(fw) -> None:
    one_of("framework", fw, "reshard_after_forward", ("default", "always", "never"))
    for n in ("mixed_precision_param", "mixed_precision_reduce", "dtype"):
        one_of("framework", fw, n, ("float32", "bfloat16"))
    one_of("framework", fw, "spmd_backend", ("partial_dtensor", "spmd_types"))
    one_of("framework", fw, "activation_checkpoint", ("none", "selective", "full"))
    one_of("framework", fw, "pipeline_parallel_schedule", tuple(SCHEDULES))
    # torchtitan 0.3.0 SelectiveAC.Config has no selective_ac_option: the per-op policy is the only
    # selective variant (distributed/activation_checkpoint.py SelectiveAC._wrap_block)
    if str(fw.selective_ac_option) != "op":
        raise ConfigError(f"framework.selective_ac_option={fw.selective_ac_option!r} must be 'op': torchtitan "
                          "0.3.0's SelectiveAC is per-op only (the every-n-layers integer option is gone)")


def vocab_error(model, lay) -> str | None:
    """torchtitan shards the vocab as torch.chunk (DTensor Shard(0)) and its loss refuses an empty
    shard: components/loss.py _LossParallelCrossEntropy.forward (the last TP rank's rows:
    vocab - (tp-1)*ceil(vocab/tp))."""
    if model.vocab > (lay.tp - 1) * -(-model.vocab // lay.tp):
        return None
    return (f"titan: tp={lay.tp} vocab={model.vocab}: torch.chunk leaves the last TP rank no vocab "
            "rows; torchtitan components/loss.py: \"_LossParallelCrossEntropy does not support "
            "empty vocab shards.\"")


# the tokenizer a run or a dry job writes (launchers/titan_assets.py) has the 256 byte-level tokens and
# BOS / EOS at least, and every id must be a row of the model's vocab
TOKENIZER_MIN_VOCAB = 258


def dispatch_error(model, lay) -> str | None:
    """What a run or a dry job refuses before building anything: a vocab smaller than the tokenizer."""
    if model.vocab < TOKENIZER_MIN_VOCAB:
        return (f"titan: model.vocab={model.vocab} must be >= {TOKENIZER_MIN_VOCAB} for a run or dry job: the "
                "tokenizer written for it holds the 256 byte-level tokens and BOS / EOS, each a row of the vocab")
    return None


def head_width_modelled(model) -> bool:
    """torchtitan's qwen3 MoE model has q/k norms and its own head width; its Llama has neither."""
    return model.is_moe


def validate_layout(model, lay, fw_cfg) -> None:
    # PP (distributed/pipeline_parallel.py pipeline_llm): framework.pipeline_parallel_schedule's stages a
    # rank (schedules.py: one, layout.vp looped, two in a V), with tp, cp and dp_replicate (pp.py)
    sched = schedule_of(fw_cfg)
    if lay.pp > 1 and sched in SCHEDULES:  # (validate_knobs names an unknown one)
        why = stages_error(sched, lay.pp, lay.vp) or stages_split_error(model.layers, lay.pp, lay.vp, sched)
        if why:
            raise ConfigError(f"titan: pp={lay.pp}: {why}")
        if sched in SPLIT_BACKWARD and lay.cp > 1:
            # measured on the CPU (pp2 vp2 cp2 at world 4): torchtitan fails on the last stage (IndexError)
            raise ConfigError(f"titan: pp={lay.pp}: framework.pipeline_parallel_schedule={sched!r} with cp={lay.cp}: "
                              "torchtitan fails on the last stage (IndexError, measured on the CPU at pp2 vp2 cp2)")
        if sched in SPLIT_BACKWARD and getattr(fw_cfg, "activation_checkpoint", None) == "selective":
            # torch/utils/checkpoint.py's selective checkpoint refuses a second backward over a region it computed,
            # and the split backward runs two (I with retain_graph, then W): measured on the CPU at pp2 vp2 under each
            # of the three (the job fails on the last stage's rank with torch's message)
            raise ConfigError(f"titan: pp={lay.pp}: framework.pipeline_parallel_schedule={sched!r} with "
                              "framework.activation_checkpoint='selective': torch refuses it (\"Trying to backward an "
                              "extra time. You are only allowed to backward once on any region computed under "
                              "selective activation checkpoint.\": the split backward's I and W are two); use none or "
                              "full")
        pp_stages(model.layers, lay.pp * lay.vp)  # torchtitan's own refusals of the split
    # torch _context_parallel/_attention.py _create_cp_block_mask (FlexAttention CP) raises
    # NotImplementedError unless seq_len % (cp * 128) == 0 (the BlockMask is sharded in blocks)
    if not (lay.cp == 1 or model.seq_len % (CP_BLOCK * lay.cp) == 0):
        raise ConfigError(f"titan: cp={lay.cp}: seq_len={model.seq_len} must be divisible by cp*128 "
                          "(FlexAttention's "
                          "CP BlockMask is sharded in whole 128-token blocks)")
    # without PP the local batch (global / dp) runs as num_microbatches gradient-accumulation steps of
    # micro_batch_size (trainer.py gradient_accumulation_steps, comm.step_comm); with PP it is split into
    # num_microbatches pipeline micro-batches (parallelism.pipeline_parallel_microbatch_size)
    # torch pipelining/schedules.py: each schedule's __init__ refuses some micro-batch counts
    why = microbatch_error(sched, lay.num_microbatches, lay.pp, lay.vp) if lay.pp > 1 and sched in SCHEDULES else None
    if why:
        raise ConfigError(f"titan: pp={lay.pp}: global_batch_size={lay.global_batch_size} gives "
                          f"{lay.num_microbatches} pipeline micro-batches per rank (global / (micro_batch_size*dp)); "
                          f"{why}")
    if fw_cfg is not None:
        if not (fw_cfg.reshard_after_forward in ("default", "always", "never")):
            raise ConfigError(f"framework.reshard_after_forward={fw_cfg.reshard_after_forward!r} must be "
                              "default|always|never")
        if not (lay.pp == 1 or fw_cfg.reshard_after_forward != "always"):
            raise ConfigError(f"titan: pp={lay.pp} with framework.reshard_after_forward='always' is not "
                              "modelled (per "
                              "micro-batch re-gathers under 1F1B); use default or never (False with PP)")


def fake_error(lay) -> str | None:
    """What torchtitan cannot run on cluster=fake (none left: PP's metadata exchange and P2P vote are
    shimmed in launchers/titan_cpu.py, _fake_pp_recv_meta and FAKE_SCALAR_SITES)."""
    return None


def recompute_knobs(mode: str) -> dict:
    """activation_checkpoint.mode: none, selective (per op) or full."""
    return {"activation_checkpoint": mode}


def recompute_mode(knobs) -> str:
    return knobs.get("activation_checkpoint") or "none"


def overlaps(fw) -> bool:
    """FSDP2 always overlaps: it prefetches unshards and reduce-scatters in the backward."""
    return True


def validate_experts(model, lay) -> None:
    """torchtitan's MoE model here is its own qwen3 (models/qwen3; its q/k norms as model.qk_layernorm,
    every layer MoE, no shared experts, no biases) under FSDP2 with expert parallelism over dp_shard
    (ledger/faithful/titan/moe.py)."""
    def no(what: str) -> None:
        raise ConfigError(f"titan: model.num_experts={model.num_experts}: {what}")

    if model.moe_layer_freq != 1 or model.moe_shared_expert_hidden or model.bias or model.qkv_bias or not model.swiglu \
            or model.norm != "rmsnorm" or model.tied_embeddings:
        no("torchtitan's qwen3 MoE has every layer MoE, no shared experts, SwiGLU, RMSNorm, no biases, untied "
           "embeddings (model.moe_layer_freq=1, moe_shared_expert_hidden=0, swiglu, rmsnorm, bias=false, "
           "tied_embeddings=false)")
    if not (lay.tp == lay.pp == lay.cp == lay.dp_replicate == lay.vp == 1):
        no(f"tp={lay.tp} pp={lay.pp} cp={lay.cp} dp_replicate={lay.dp_replicate}: MoE is modelled over FSDP "
           "(dp_shard) with expert parallelism alone")
    if lay.num_microbatches > 1:
        no(f"global_batch_size={lay.global_batch_size} gives {lay.num_microbatches} gradient-accumulation "
           "micro-batches: the MoE ledger models one local batch a step (global = micro_batch_size*dp)")
    # distributed/parallel_dims.py: EP borrows from dp_shard x cp x tp (efsdp = dp_shard / ep here)
    if not (lay.dp_shard % lay.ep == 0):
        no(f"ep={lay.ep} does not divide dp_shard={lay.dp_shard} (torchtitan's EP borrows the FSDP ranks: "
           "efsdp = dp_shard / ep)")


# the schedules the planner tries where plan.pipeline_schedules lists none: torchtitan's default 1F1B, its looped
# 1F1B and the split-backward schedules it ships; GPipe and LoopedBFS when listed (each keeps every micro-batch in
# flight for a bubble no smaller than 1F1B's or Interleaved1F1B's)
PLAN_SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def plan_splits(layers: int, pp: int, vp: int, space=None) -> list[dict]:
    """The schedules the planner gives a pipeline: those of plan.pipeline_schedules (space), or PLAN_SCHEDULES where
    it lists none, that run vp stages a rank (schedules.stages_error: none where none does)."""
    if pp == 1:
        return [{}]
    listed = getattr(space, "pipeline_schedules", ()) or PLAN_SCHEDULES
    return [{"pipeline_parallel_schedule": n} for n in listed if stages_error(n, pp, vp) is None]
