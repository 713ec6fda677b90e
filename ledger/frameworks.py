"""The framework registry: each framework's package (ledger/faithful/<name>/) registers one
FrameworkLedger, the pattern of torchtitan's TrainSpec registry (torchtitan/protocols/train_spec.py
register_train_spec / get_train_spec). Generic code (the layout rules, the planner, the textbook
ledger, config validation, the job) asks the framework through it instead of branching on its name.

A FrameworkLedger holds functions, not state: every rule it points at lives in its package's modules,
with the comment naming the framework source it follows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ledger.errors import ConfigError


def _nothing(*args, **kwargs) -> None:
    return None


@dataclass(frozen=True)
class FrameworkLedger:
    name: str
    launcher: str  # the module that runs and dry-runs it (launchers/<name>.py: run_rank, dry)
    # the faithful ledger: place(model, lay, fw) -> Placement, dense and MoE
    place: Callable
    place_moe: Callable
    # the dtype its gradients accumulate in (what the textbook state bytes need): grad_dtype(fw) -> str
    grad_dtype: Callable[[Any], str]
    # config values of its knobs (conf/validate.py): validate_knobs(fw), raises ConfigError
    validate_knobs: Callable[[Any], None]
    # its layout limits, after the shared rules (ledger/layout.py validate): validate_layout(model, lay, fw)
    validate_layout: Callable[[Any, Any, Any], None]
    # layout.sequence_parallel when the user leaves it unset and tp > 1 (the framework's own default)
    default_sequence_parallel: bool = False
    # what it allows that the shared layout rules would refuse
    # where tp does not divide the vocab: the refusal, or None where it pads the vocab itself
    vocab_error: Callable[[Any, Any], Optional[str]] = (
        lambda model, lay: f"tp={lay.tp} does not divide vocab={model.vocab}")
    uneven_layers: bool = False  # splits layers over pp*vp stages unevenly (its own rules then apply)
    other_head_width: Callable[[Any], bool] = lambda model: False  # models kv_channels / q-k norms for this model
    validate_experts: Callable[[Any, Any], None] = _nothing  # its MoE limits beside the shared ones
    # refusals before ranks start: dispatch_error(model, lay) for run and dry; run_error(fw, cluster) for run
    dispatch_error: Callable[[Any, Any], Optional[str]] = _nothing
    # the model config's fields the shape does not carry, as the framework's own launcher takes them
    # (run and dry): model_config_error(model_cfg)
    model_config_error: Callable[[Any], Optional[str]] = lambda model_cfg: None
    run_error: Callable[[Any, Any], Optional[str]] = _nothing
    fake_error: Callable[[Any], Optional[str]] = _nothing  # what it cannot run on cluster=fake (the layout)
    # knobs whose default depends on the mode (predict / run / dry / plan) and the prediction's target
    # (ledger/target.py): fill_mode_defaults(fw, mode, target)
    fill_mode_defaults: Callable[[Any, str, str], None] = _nothing
    # its rules in the textbook ledger (ledger/textbook.py): a module with state(...), peak (or None),
    # DP_OVER_CP (whether CP ranks share its data-parallel reduction) and NOTES
    textbook: Any = None
    # the planner (ledger/plan.py): recompute as knobs and back, overlap of data-parallel collectives
    recompute_knobs: Callable[[str], Optional[dict]] = _nothing
    recompute_mode: Callable[[Any], str] = lambda knobs: "none"
    overlaps: Callable[[Any], bool] = lambda fw: True
    # its search's own axes: data parallelism over knob sets (DeepSpeed's ZeRO stages; cp as its Ulysses), the base
    # config's knobs the search sets itself, the pipeline splits it tries (as knobs), HSDP replicas
    plan_data_parallel_only: bool = False
    # (space, model, dp, cp) -> the knob sets a layout of that DP and CP degree is tried with
    plan_knob_sets: Callable[..., list] = lambda space, model=None, dp=None, cp=1: [{}]
    # the knobs the search sets per row (a value the base config gives them is not carried into a row,
    # nor into the ready sweep's overrides), each with the value a row starts from
    plan_chooses: dict = field(default_factory=dict)
    plan_splits: Callable[[int, int, int, object], list] = lambda layers, pp, vp, space: [{}]
    plan_hsdp: bool = False
    # (fw, lay, device) -> ledger/timing/step.py TimePolicy: how its step runs (schedule, recompute,
    # attention kernel, what hides its data-parallel collectives); None: no step-time model
    time_policy: Optional[Callable[[Any, Any, str], Any]] = None
    # (tp, ep) -> the expert tensor parallel degree an MoE layout is tried with (Megatron: tp at ep = 1)
    plan_expert_tp: Callable[[int, int], int] = lambda tp, ep: 1
    # knob -> what the framework itself does when the knob is left unset, where train-ledger's default
    # (conf/schema.py) is not that: a job's table lists every knob away from the framework's own
    own_defaults: dict = field(default_factory=dict)
    # what the peak of a prediction for a target (ledger/target.py) rests on: peak_basis(fw, target) -> str,
    # from the framework's target rules (ledger/faithful/<name>/target.py)
    peak_basis: Callable[[Any, str], str] = lambda fw, target: ""


_REGISTRY: dict[str, FrameworkLedger] = {}


def register(spec: FrameworkLedger) -> FrameworkLedger:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"framework {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def _load() -> None:
    # the packages register themselves on import (ledger/faithful/__init__.py imports the three)
    if not _REGISTRY:
        import ledger.faithful  # noqa: F401


def names() -> tuple[str, ...]:
    _load()
    return tuple(_REGISTRY)


def get(name: str) -> FrameworkLedger:
    """The framework's ledger; a ConfigError naming the known ones for any other name."""
    _load()
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"framework.name={name!r} must be {', '.join(_REGISTRY)}")
    return spec
