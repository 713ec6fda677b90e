"""Step time and MFU: the device's profile (hardware), a collective's time (collectives), the ops of a
micro-batch (ops), the pipeline schedule simulated (pipeline), the step composed from the ledgers'
collectives and each framework's TimePolicy (step), the predicted step as a Chrome trace (trace).
predict() is what a job asks."""
from __future__ import annotations

from typing import Optional, Union

from ledger import frameworks
from ledger.errors import ConfigError
from ledger.timing import hardware
from ledger.timing.step import StepTime, step_time

OVERRIDES = ("gemm_efficiency", "memory_efficiency", "intra_busbw_gbps", "inter_busbw_gbps", "gpus_per_node")


def profile_of(hw_cfg, cpu_run: bool = False) -> Optional[hardware.Profile]:
    """The profile a job's config names (hardware.*); None for a CPU run without a calibrated file."""
    over = {k: hw_cfg.get(k) for k in OVERRIDES if hw_cfg.get(k) is not None}
    if hw_cfg.get("file"):
        import yaml

        try:
            with open(hw_cfg.file) as f:
                d = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"hardware.file={hw_cfg.file!r}: cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"hardware.file={hw_cfg.file!r}: not a profile mapping")
        return hardware.with_overrides(hardware.from_dict(d), **over)
    if cpu_run:
        return None
    return hardware.profile(hw_cfg.get("name", "h100"), **over)


def predict(fw, model, lay, placement, hw_cfg, mode: str = "faithful", cpu_run: bool = False,
            trace: bool = True) -> Union[StepTime, str]:
    """The step's time for the job's target, or why there is none (a line for the table)."""
    if mode != "faithful":
        return "step time: the textbook ledger has no step-time model"
    spec = frameworks.get(fw.name)
    if spec.time_policy is None:
        return f"step time: {fw.name} has no time policy"
    hw = profile_of(hw_cfg, cpu_run)
    if hw is None:
        return ("step time: a CPU run needs a calibrated CPU profile (python -m ledger.timing.calibrate writes one; "
                "hardware.file=PATH)")
    # the trace's tasks: 2 per micro-batch per chunk per stage; past TRACE_TASKS the step is computed
    # without them (pipeline.step_seconds) and no step_trace.json is written
    trace = trace and 2 * lay.num_microbatches * lay.vp * lay.pp <= TRACE_TASKS
    return step_time(model, lay, placement, spec.time_policy(fw, lay, hw.device), hw, trace=trace)


TRACE_TASKS = 20_000
