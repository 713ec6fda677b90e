"""Bytes per parameter of each training state (the design article's 16 / 18 bytes)."""
from __future__ import annotations

from dataclasses import dataclass

from ledger.model import ModelShape


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter: model param, gradient, fp32 master, optimizer moments."""
    num_params: int
    param: int
    grad: int
    master: int
    optim: int
    precision: str
    optimizer: str

    @property
    def per_param(self) -> int:
        return self.param + self.grad + self.master + self.optim

    @property
    def total(self) -> int:
        return self.per_param * self.num_params


def state_bytes(model: ModelShape, precision: str = "bf16", optimizer: str = "adam",
                grad_dtype: str | None = None) -> StateBytes:
    """Mixed precision + Adam: 2 (bf16 param) + 2 (grad; 4 if accumulated in fp32) + 4 (fp32 master)
    + 8 (Adam exp_avg, exp_avg_sq). fp32 training has no separate master."""
    if optimizer not in ("adam", "adamw", "sgd"):
        raise ValueError(f"optimizer={optimizer!r} must be adam, adamw or sgd")
    moments = 8 if optimizer in ("adam", "adamw") else 0
    if precision == "bf16":
        g = 4 if grad_dtype in ("fp32", "float32") else 2
        return StateBytes(model.num_params(), 2, g, 4, moments, precision, optimizer)
    if precision == "fp32":
        return StateBytes(model.num_params(), 4, 4, 0, moments, precision, optimizer)
    raise ValueError(f"precision={precision!r} must be bf16 or fp32")
