"""`place(model, state, cfg)`: the one entry point that predicts a job (textbook or faithful)."""
from __future__ import annotations

import importlib
from functools import lru_cache

from ledger.layout import Layout, resolve, validate
from ledger.memory import StateBytes, state_bytes
from ledger.model import ModelShape
from ledger.placement import Comm, Placement, RankState, fmt  # noqa: F401  (the article's API: ledger.parallel.fmt, ...)

FAITHFUL = {"megatron": "ledger.faithful.megatron.states", "deepspeed": "ledger.faithful.deepspeed.zero",
            "titan": "ledger.faithful.titan.states", "megatron_moe": "ledger.faithful.megatron.moe",
            "deepspeed_moe": "ledger.faithful.deepspeed.moe", "titan_moe": "ledger.faithful.titan.moe"}


def grad_dtype(fw) -> str:
    """The gradient dtype a framework accumulates in (what state_bytes needs)."""
    if fw.name == "megatron":
        return "fp32" if fw.grad_reduce_in_fp32 or fw.precision == "fp32" else "bf16"
    if fw.name == "titan":
        return "fp32"
    return "bf16" if fw.precision == "bf16" else "fp32"


def place(model: ModelShape, state: StateBytes | None, cfg, world: int | None = None) -> Placement:
    """Predict per-rank resident state and per-step collectives.

    cfg: a JobConfig (or anything with .framework, .layout, .ledger.mode). world fills layout.dp=-1.
    """
    fw, lay = cfg.framework, cfg.layout  # each read once: a config read costs µs in a search
    if not isinstance(lay, Layout):
        lay = resolve(lay, world)
    validate(model, lay, fw.name, fw)
    return predict(model, lay, fw, cfg.ledger.mode if "ledger" in cfg else "faithful", state)


def predict(model: ModelShape, lay: Layout, fw, mode: str = "faithful", state: StateBytes | None = None) -> Placement:
    """place() for a resolved and validated layout (the framework's faithful ledger may still refuse
    what it does not model, with a ConfigError)."""
    if mode == "textbook":
        from ledger import textbook

        return textbook.place(model, state or state_bytes(model, fw.precision, "adam", grad_dtype(fw)), lay, fw)
    if mode != "faithful":
        raise ValueError(f"ledger.mode={mode!r} must be faithful or textbook")
    if model.is_moe:  # each framework's MoE ledger beside its dense one
        return _faithful(f"{fw.name}_moe").place(model, lay, fw)
    return _faithful(fw.name).place(model, lay, fw)


@lru_cache(maxsize=None)
def _faithful(name: str):
    return importlib.import_module(FAITHFUL[name])


def report(model: ModelShape, cfg, world: int | None = None) -> str:
    return place(model, None, cfg, world).report()
