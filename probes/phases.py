"""Phase timer: the wall time one rank spends in a step's forward, backward and optimizer step.

  forward    the watched roots' (model chunks') forward calls, outermost, outside any backward;
  backward   the autograd engine's runs, outermost: torch.autograd.backward / grad (autograd/graph.py
             _engine_run_backward) and Megatron's custom_backward (pipeline_parallel/schedules.py) both
             call Variable._execution_engine.run_backward, so one wrapper of that method sees every
             framework's backward (a reentrant checkpoint's backward inside it is not counted twice);
  optimizer  torch optimizers' steps, outermost, through torch's global optimizer step hooks
             (optim/optimizer.py register_optimizer_step_pre_hook / _post_hook): the inner torch
             optimizer every framework's optimizer wraps (Megatron's and ZeRO's own work around it —
             unscaling, norms, the partitions' all-gather — is `other`).

Everything else of the step (the launchers' data, the pipeline's waits outside a chunk, the frameworks'
bookkeeping) is `other_s` = the step's time - the three. No dispatch mode is involved: the timer costs
a few Python calls per forward, backward and optimizer step.
"""
from __future__ import annotations

import time

import torch
from torch.autograd.variable import Variable

_ACTIVE: "PhaseTimer | None" = None  # the timer the process-wide hooks report to
_INSTALLED = False


class _TimedEngine:
    """Variable._execution_engine with run_backward timed for the active PhaseTimer."""

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        timer = _ACTIVE
        if timer is None:
            return self._engine.run_backward(*args, **kwargs)
        with timer.phase("backward"):
            return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _install() -> None:
    """Once per process: the engine wrapper and the global optimizer hooks."""
    global _INSTALLED
    if _INSTALLED:
        return
    Variable._execution_engine = _TimedEngine(Variable._execution_engine)
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda opt, args, kwargs: _ACTIVE and _ACTIVE.enter("optimizer"))
    register_optimizer_step_post_hook(lambda opt, args, kwargs: _ACTIVE and _ACTIVE.exit("optimizer"))
    _INSTALLED = True


class PhaseTimer:
    PHASES = ("forward", "backward", "optimizer")

    def __init__(self):
        _install()
        self._depth = {p: 0 for p in self.PHASES}
        self._t0 = {p: 0.0 for p in self.PHASES}
        self.seconds = {p: 0.0 for p in self.PHASES}
        self._skipped = 0
        self._handles = []

    def watch(self, roots) -> None:
        for r in roots:
            self._handles.append(r.register_forward_pre_hook(lambda m, a: self.enter("forward")))
            self._handles.append(r.register_forward_hook(lambda m, a, o: self.exit("forward"), always_call=True))

    def enter(self, phase: str) -> None:
        # a root's forward run by a recompute inside backward is backward's time
        if phase == "forward" and self._depth["backward"]:
            self._skipped += 1
            return
        if self._depth[phase] == 0:
            self._t0[phase] = time.perf_counter()
        self._depth[phase] += 1

    def exit(self, phase: str) -> None:
        if phase == "forward" and self._skipped:
            self._skipped -= 1
            return
        if self._depth[phase] == 0:  # an exit whose enter came before the step began
            return
        self._depth[phase] -= 1
        if self._depth[phase] == 0:
            self.seconds[phase] += time.perf_counter() - self._t0[phase]

    def phase(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                timer.enter(name)

            def __exit__(self, *exc):
                timer.exit(name)
                return False
        return _Ctx()

    def start(self) -> None:
        """A step begins: its phases count from zero, reported to this timer."""
        global _ACTIVE
        self.seconds = {p: 0.0 for p in self.PHASES}
        self._depth = {p: 0 for p in self.PHASES}
        self._skipped = 0
        _ACTIVE = self

    def stop(self, step_s: float) -> dict:
        """The step's phases (seconds), other_s the rest of step_s."""
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        out = {f"{p}_s": self.seconds[p] for p in self.PHASES}
        out["other_s"] = max(0.0, step_s - sum(self.seconds.values()))
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
