"""The state names of a rank's ledger and the human units they are printed in (shared by
ledger.placement and ledger.report, which must not import each other)."""
from __future__ import annotations

STATES = ("params_bytes", "grads_bytes", "optim_bytes", "other_bytes")


def fmt(nbytes: float) -> str:
    """Human units, decimal (GB = 1e9 B) as the design article writes them."""
    n = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


# the parts of a peak (ledger.placement.Peak), named as the peak probe's categories (probes/peak.py) so
# each is reconciled: resident = params + grads + optim + other at that moment
PEAK_PARTS = ("resident", "activations", "gathered", "temporary", "unnamed")


def ceil_div(n: int, k: int) -> int:
    """ceil(n / k) for integers (no float on the way: exact for any size)."""
    return -(-n // k)


def round_up(n: int, k: int) -> int:
    """n rounded up to a multiple of k: the padding every framework applies to its buffers."""
    return -(-n // k) * k


def peak_or_resident(s) -> int:
    """A rank's (RankState's) predicted peak within a step; its resident state where its ledger predicts
    none (the planner's and the fit verdict's measure of a rank)."""
    pk = s.peak
    return s.resident_bytes - s.host_bytes if pk is None else pk.bytes
