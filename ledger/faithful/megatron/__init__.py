"""Megatron Core 0.18.0, faithful: the framework fields it reads (knobs), the pipeline split and a
stage's parameters (pipeline), DDP buffers and the DP ranks' shards (buffers), the most-loaded rank
without building buffers (heaviest), a rank's states and the layout's placement (states), a step's
collectives (comm), what a micro-batch saves for backward (activations), the peak within a step
(peak), Mixture-of-Experts (moe), how its step runs for the step-time model (steptime), what its peak
takes from the run it is for (target), what it accepts (rules), its textbook formulas (textbook).
Registered once as the framework "megatron"."""
from ledger.faithful.megatron import moe, rules, states, steptime, target, textbook
from ledger.frameworks import FrameworkLedger, register

LEDGER = register(FrameworkLedger(
    time_policy=steptime.time_policy,
    name="megatron", launcher="launchers.megatron", place=states.place, place_moe=moe.place,
    grad_dtype=rules.grad_dtype, validate_knobs=rules.validate_knobs, validate_layout=rules.validate_layout,
    vocab_error=rules.vocab_error, uneven_layers=True, other_head_width=rules.head_width_modelled,
    dispatch_error=moe.dispatch_error, model_config_error=rules.model_config_error, run_error=rules.run_error, fill_mode_defaults=rules.fill_mode_defaults,
    textbook=textbook, recompute_knobs=rules.recompute_knobs, recompute_mode=rules.recompute_mode,
    overlaps=rules.overlaps, plan_chooses=rules.PLAN_CHOOSES, plan_splits=rules.plan_splits,
    plan_knob_sets=rules.plan_knob_sets, plan_expert_tp=moe.plan_expert_tp, peak_basis=target.peak_basis,
    own_defaults=rules.OWN_DEFAULTS))
