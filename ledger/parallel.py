"""`place(model, state, cfg)`: the one entry point that predicts a job (textbook or faithful)."""
from __future__ import annotations

from ledger import frameworks
from ledger.cuda import outside_allocator
from ledger.layout import Layout, resolve, validate
from ledger.memory import StateBytes, state_bytes
from ledger.model import ModelShape
from ledger.placement import Comm, Placement, RankState, fmt  # noqa: F401  (the article's API: ledger.parallel.fmt, ...)
from ledger.target import CUDA_NCCL


def grad_dtype(fw) -> str:
    """The gradient dtype a framework accumulates in (what state_bytes needs)."""
    return frameworks.get(fw.name).grad_dtype(fw)


def place(model: ModelShape, state: StateBytes | None, cfg, world: int | None = None) -> Placement:
    """Predict per-rank resident state and per-step collectives.

    cfg: a JobConfig (or anything with .framework, .layout, .ledger.mode). world fills layout.dp=-1.
    """
    fw, lay = cfg.framework, cfg.layout  # each read once: a config read costs µs in a search
    if not isinstance(lay, Layout):
        lay = resolve(lay, world, fw.name)
    validate(model, lay, fw.name, fw)
    return predict(model, lay, fw, cfg.ledger.mode if "ledger" in cfg else "faithful", state)


def predict(model: ModelShape, lay: Layout, fw, mode: str = "faithful", state: StateBytes | None = None,
            target: str | None = None) -> Placement:
    """place() for a resolved and validated layout (the framework's faithful ledger may still refuse
    what it does not model, with a ConfigError). target: the run predicted (ledger/target.py); None:
    the framework's variant decides (the CPU harness's, Megatron's TransformerEngine spec a GPU's)."""
    if mode == "textbook":
        from ledger import textbook

        return textbook.place(model, state or state_bytes(model, fw.precision, "adam", grad_dtype(fw)), lay, fw)
    if mode != "faithful":
        raise ValueError(f"ledger.mode={mode!r} must be faithful or textbook")
    spec = frameworks.get(fw.name)
    # each framework's MoE ledger beside its dense one
    pl = (spec.place_moe if model.is_moe else spec.place)(model, lay, fw, target)
    if pl.target == CUDA_NCCL:  # what a GPU rank holds beside its tensors (ledger/cuda.py)
        pl.outside_allocator = outside_allocator(pl)
    return pl


def report(model: ModelShape, cfg, world: int | None = None) -> str:
    return place(model, None, cfg, world).report()
