"""torch.optim.AdamW's state as every framework here builds it (torch/optim/adam.py _init_group,
capturable=False, fused=False): exp_avg and exp_avg_sq, fp32, one element each per element of the
parameter (or shard) it updates, and `step`, a float32 scalar tensor per parameter. One home for its
bytes and for the names its parts carry in a rank's detail ("optim/adam exp_avg + exp_avg_sq")."""
from __future__ import annotations

from ledger.dtypes import FP32

MOMENTS = "adam exp_avg + exp_avg_sq"
STEP = "adam step"
MOMENT_BYTES = 2 * FP32  # per element: exp_avg and exp_avg_sq
STEP_BYTES = FP32  # per parameter tensor: `step`


def adamw_parts(elements: int, params: int, what: str = "") -> list[tuple[str, str, int]]:
    """(state, name, bytes) of AdamW's state over `elements` elements in `params` parameter tensors;
    `what` prefixes the names (e.g. "experts: ")."""
    return [("optim_bytes", what + MOMENTS, MOMENT_BYTES * elements),
            ("optim_bytes", what + STEP, STEP_BYTES * params)]


def add_adamw(s, elements: int, params: int, what: str = "") -> None:
    """Add AdamW's state to a RankState."""
    for state, name, nbytes in adamw_parts(elements, params, what):
        s.add(state, name, nbytes)


def adamw_bytes(detail: dict[str, int]) -> int:
    """AdamW's bytes among a rank's detail (every prefix's moments and steps)."""
    return sum(v for n, v in detail.items() if n.endswith("/" + MOMENTS) or n.endswith(" " + MOMENTS)
               or n.endswith("/" + STEP) or n.endswith(" " + STEP))
