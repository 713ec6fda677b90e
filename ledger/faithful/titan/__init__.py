"""torchtitan 0.3.0 (torch 2.13 FSDP2), faithful: the dense model's checks and placement (states), its
params and FSDP2 shards (fsdp), a step's FSDP / TP / CP collectives (comm), DTensor's mm strategies and
their cost model (dtensor), a rank's resident state and the Placement over ranks (ranks), the pipeline
(pp; its schedules: schedules), the peak within a step (peak; with PP pp_peak), MoE (moe), how its step runs for the step-time
model (steptime), what its peak takes from the run it is for (target), what it accepts (rules), its textbook formulas (textbook). Registered once as the
framework "titan"."""
from ledger.faithful.titan import moe, rules, states, steptime, target, textbook
from ledger.frameworks import FrameworkLedger, register

LEDGER = register(FrameworkLedger(
    time_policy=steptime.time_policy,
    name="titan", launcher="launchers.titan", place=states.place, place_moe=moe.place,
    grad_dtype=rules.grad_dtype, validate_knobs=rules.validate_knobs, validate_layout=rules.validate_layout,
    vocab_error=rules.vocab_error, other_head_width=rules.head_width_modelled,
    validate_experts=rules.validate_experts, fake_error=rules.fake_error, dispatch_error=rules.dispatch_error,
    textbook=textbook, recompute_knobs=rules.recompute_knobs, recompute_mode=rules.recompute_mode,
    overlaps=rules.overlaps, plan_hsdp=True, plan_splits=rules.plan_splits,
    # pipeline_parallel.py splits layers + 2 (the embedding and the head counted) over the stages, even or
    # not, with its own refusals (pp.pp_stages)
    uneven_layers=True,
    # torchtitan 0.3.0 config/configs.py ParallelismConfig.enable_sequence_parallel: bool = True
    default_sequence_parallel=True,
    own_defaults=rules.OWN_DEFAULTS, peak_basis=target.peak_basis))
