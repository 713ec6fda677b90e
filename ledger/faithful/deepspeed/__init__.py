"""DeepSpeed 0.19.8 ZeRO-1/2/3, faithful: the placement (zero), ZeRO-1/2's buckets and collectives
(zero12), ZeRO-3's states and collectives (zero3), what both derive from the model (common), ZeRO-3's
module hook trace (trace), the parameter coordinator's replay (coordinator, its fast path skip), the
gathered parameter memory at a moment (gathered), the gradient hooks in a backward (backward), the peak
within a step (peak, its activations activations), DeepSpeed-MoE (moe), how its step runs for the
step-time model (steptime), what its peak takes from the run it is for (target), what it accepts (rules), its
textbook formulas (textbook). Registered once as the framework "deepspeed"."""
from ledger.faithful.deepspeed import moe, rules, steptime, target, textbook, zero
from ledger.frameworks import FrameworkLedger, register

LEDGER = register(FrameworkLedger(
    time_policy=steptime.time_policy,
    name="deepspeed", launcher="launchers.deepspeed", place=zero.place, place_moe=moe.place,
    grad_dtype=rules.grad_dtype, validate_knobs=rules.validate_knobs, validate_layout=rules.validate_layout,
    textbook=textbook, recompute_knobs=rules.recompute_knobs, recompute_mode=rules.recompute_mode,
    overlaps=rules.overlaps, plan_data_parallel_only=True, plan_knob_sets=rules.plan_knob_sets,
    plan_chooses={"zero_stage": None},  # (every row sets its stage and offload: plan_knob_sets)
    own_defaults=rules.OWN_DEFAULTS, peak_basis=target.peak_basis))
