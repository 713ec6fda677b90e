"""What DeepSpeed 0.19.8 accepts as train-ledger drives it (ZeRO as pure data parallelism): its knobs'
values, its layout limits beside the shared rules (ledger/layout.py), and the planner's view of its
recompute and overlap knobs. ledger/faithful/deepspeed/__init__.py registers them."""
from __future__ import annotations

from ledger.checks import at_least, check_sizes, one_of, positive
from ledger.layout import ConfigError

# sizes and budgets it takes in elements: (field, least value, what it is). A bucket of 0 elements
# would loop in the bucket walk; a negative budget means nothing
SIZES = (("reduce_bucket_size", 1, "elements per gradient bucket"),
         ("allgather_bucket_size", 1, "elements per ZeRO-1/2 all-gather bucket"),
         ("stage3_prefetch_bucket_size", 0, "elements prefetched ahead; 0: no prefetch"),
         ("stage3_max_live_parameters", 0, "elements gathered at once"),
         ("stage3_max_reuse_distance", 0, "elements of reuse window; 0: release after use"),
         ("stage3_param_persistence_threshold", 0, "params of at most this many elements stay gathered"))


def grad_dtype(fw) -> str:
    """The engine's gradients are the params' dtype (bf16 or fp32)."""
    return "bf16" if fw.precision == "bf16" else "fp32"


def validate_knobs(fw) -> None:
    # stage 0 (DeepSpeed as plain DDP) is predicted by the textbook ledger; the faithful one
    # refuses it with its own reason (ledger/faithful/deepspeed/zero.py place)
    one_of("framework", fw, "zero_stage", (0, 1, 2, 3))
    at_least("framework", fw, ("gradient_clipping",), 0)
    # DeepSpeed-MoE's layer arguments (moe/layer.py MoE)
    positive("framework", fw, ("capacity_factor",))
    at_least("framework", fw, ("min_capacity", "moe_loss_coeff"), 0)
    if not isinstance(fw.get("activation_checkpointing", False), bool):
        raise ConfigError(f"framework.activation_checkpointing={fw.activation_checkpointing!r} must be true or false "
                          "(every decoder layer under deepspeed.checkpointing.checkpoint, or none)")
    # DeepSpeed-Ulysses' reduction dtype (runtime/config.py get_communication_data_type's values), whatever cp
    if "seq_parallel_communication_data_type" in fw:
        one_of("framework", fw, "seq_parallel_communication_data_type", ("fp32", "bf16", "fp16"))
    # ZeRO-Offload's devices (runtime/zero/offload_config.py OffloadDeviceEnum: none, cpu, nvme)
    for what in ("offload_optimizer", "offload_param"):
        if what in fw:
            one_of("framework", fw, what, ("none", "cpu", "nvme"))
        if not isinstance(fw.get(f"{what}_pin_memory", False), bool):
            raise ConfigError(f"framework.{what}_pin_memory={fw[what + '_pin_memory']!r} must be true or false")


def offloads(fw) -> bool:
    """ZeRO-Offload of the optimizer (zero_optimization.offload_optimizer.device=cpu)."""
    return fw.get("offload_optimizer", "none") != "none"


def offloads_params(fw) -> bool:
    """ZeRO-3's parameter offload (zero_optimization.offload_param.device=cpu)."""
    return fw.get("offload_param", "none") != "none"


def offload_check(model, lay, fw) -> None:
    """What ZeRO-Offload the ledger models: the optimizer offloaded to the host at ZeRO-1/2 (stage_1_and_2.py
    cpu_offload) and ZeRO-3 (stage3.py offload_optimizer, every sub-group on the host), ZeRO-3's parameter
    partitions (offload_param), as the CPU runs confirm them. DeepSpeed itself offloads only under ZeRO (stage 0
    has no partitioned optimizer to move, and only ZeRO-3 partitions the parameters)."""
    if not (offloads(fw) or offloads_params(fw)):
        return
    off, par = fw.get("offload_optimizer", "none"), fw.get("offload_param", "none")
    for what, v in (("offload_optimizer", off), ("offload_param", par)):
        if v == "nvme":
            raise ConfigError(f"framework.{what}='nvme': ZeRO-Infinity's NVMe swapper (its aio buffers and swap files) "
                              "is not modelled; use cpu")
    if par != "none" and fw.zero_stage != 3:
        raise ConfigError(f"framework.offload_param='cpu' needs zero_stage=3, not {fw.zero_stage} (DeepSpeed partitions "
                          "parameters, and so offloads them, at ZeRO-3 only)")
    if fw.zero_stage == 0:
        raise ConfigError("framework.offload_optimizer='cpu' needs ZeRO (zero_stage 1, 2 or 3): stage 0 keeps no "
                          "partitioned optimizer to offload")
    off = "offload_optimizer" if off != "none" else "offload_param"
    reasons = []
    if fw.precision != "bf16":
        reasons.append(f"precision={fw.precision} (measured in bf16 only)")
    if lay.cp > 1:
        reasons.append(f"layout.cp={lay.cp} (DeepSpeed-Ulysses' fp32 reductions into the host partition)")
    if model.is_moe:
        reasons.append("MoE (the expert groups' partitions)")
    if fw.zero_stage == 1 and overlap_comm(fw):
        reasons.append("zero_stage=1 with overlap_comm (the hooks' reductions at the boundary keep micro-step "
                       "bookkeeping of their own)")
    if reasons:
        raise ConfigError(f"framework.{off}='cpu' is modelled in bf16, without Ulysses or MoE, and at stage 1 "
                          "without overlap_comm; not with " + "; ".join(reasons))


def validate_layout(model, lay, fw_cfg) -> None:
    if fw_cfg is not None:
        check_sizes(fw_cfg, SIZES)
    if not (lay.tp == 1 and lay.pp == 1):
        raise ConfigError(f"deepspeed: tp={lay.tp} pp={lay.pp}: train-ledger drives DeepSpeed ZeRO as data "
                          "parallelism, with DeepSpeed-Ulysses as cp (tp and pp come from Megatron-DeepSpeed, "
                          "which it does not drive)")
    if lay.cp > 1:
        ulysses_check(model, lay)
    if not (lay.dp_replicate == 1):
        raise ConfigError("deepspeed: dp_replicate (HSDP) is a torchtitan layout; use zero_stage instead")
    if fw_cfg is not None:
        offload_check(model, lay, fw_cfg)


def ulysses_check(model, lay) -> None:
    """DeepSpeed-Ulysses (layout.cp: sequence_parallel_size) as DeepSpeed runs it: every rank a slice of
    s / cp tokens (the launcher's); DistributedAttention's all-to-alls scatter the heads
    (sequence/layer.py _generate_layout_params: "Number of heads ... must be divisible by the sequence
    parallel size"; a K/V head count that does not divide takes its uneven path, not modelled)."""
    if model.seq_len % lay.cp:
        raise ConfigError(f"deepspeed: cp={lay.cp} (Ulysses): model.seq_len={model.seq_len} must be divisible by cp "
                          "(each rank holds s / cp tokens of every sequence)")
    for what, heads in (("heads", model.heads), ("kv_heads", model.kv_heads)):
        if heads % lay.cp:
            raise ConfigError(f"deepspeed: cp={lay.cp} (Ulysses): model.{what}={heads} must be divisible by cp "
                              "(DistributedAttention scatters the heads; DeepSpeed's uneven K/V head split is "
                              "not modelled)")
    if model.is_moe:
        raise ConfigError(f"deepspeed: cp={lay.cp} (Ulysses) with MoE is not modelled")


def recompute_knobs(mode: str) -> dict | None:
    """The plain Llama's layers under deepspeed.checkpointing: all or none (no selective setting)."""
    if mode == "selective":
        return None
    return {"activation_checkpointing": mode == "full"}


def recompute_mode(knobs) -> str:
    return "full" if knobs.get("activation_checkpointing") else "none"


def overlaps(fw) -> bool:
    """ZeRO overlaps its gradient reduction with the backward under overlap_comm only."""
    return overlap_comm(fw)


# DeepSpeed's own defaults where train-ledger's differ: ZeRO is off (runtime/zero/config.py
# DeepSpeedZeroConfig.stage = 0; train-ledger drives ZeRO, stage 0 only in the textbook ledger) and the
# engine trains in fp32 unless the ds_config enables bf16 / fp16 (runtime/config.py)
OWN_DEFAULTS = {"zero_stage": 0, "precision": "fp32"}


def overlap_comm(fw) -> bool:
    """framework.overlap_comm, None meaning DeepSpeed's own default: on at stage 3, off below
    (runtime/zero/config.py DeepSpeedZeroConfig.overlap_comm_valid: `self.stage == ZeroStageEnum.weights`)."""
    v = getattr(fw, "overlap_comm", None)
    return fw.zero_stage == 3 if v is None else bool(v)


def plan_knob_sets(space, model=None, dp: int | None = None, cp: int = 1) -> list[dict]:
    """The planner tries each ZeRO stage of plan.zero_stages (every GPU a data-parallel rank), with each
    offload_optimizer of plan.offload_optimizer and, at stage 3, offload_param of plan.offload_param, where the
    ledger models them (offload_check: a dense model without Ulysses)."""
    modelled = cp == 1 and not (model is not None and model.is_moe)
    out = []
    for z in space.zero_stages:
        for off in space.offload_optimizer:
            for par in (space.offload_param if z == 3 else ("none",)):
                if (off, par) == ("none", "none") or modelled:
                    out.append({"zero_stage": z, "offload_optimizer": off, "offload_param": par})
    return out
