"""A readable per-rank table of a Placement (rich), with human units."""
from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from typing import TYPE_CHECKING

from ledger.units import STATES, fmt

if TYPE_CHECKING:  # render() reads a Placement; ledger.placement imports this module to print one
    from ledger.placement import Placement

COLS = (*STATES, "resident_bytes")


def _span(lo: int, hi: int) -> str:
    """A state's range over a stage's ranks, as far as human units tell them apart."""
    a, b = fmt(lo), fmt(hi)
    return b if a == b else f"{a} – {b}"


def render(pl: "Placement", max_rows: int = 16) -> str:
    """One row per pipeline stage (its ranks are one contiguous block of the grid): each state's
    range over the stage's ranks; then the most-loaded rank in exact bytes."""
    buf = io.StringIO()
    con = Console(file=buf, width=140, force_terminal=False)
    stages: dict[int, dict] = {}
    seen: dict[int, None] = {}
    for r in range(pl.world):
        s = pl.rank_state(r)
        st = stages.setdefault(s.stage, {"ranks": [r, r], "n": 0, "distinct": set(),
                                         **{k: [getattr(s, k), getattr(s, k)] for k in COLS}})
        st["ranks"][1] = r
        st["n"] += 1
        if id(s) not in seen:
            seen[id(s)] = None
            st["distinct"].add(tuple(getattr(s, k) for k in COLS))
            for k in COLS:
                v = getattr(s, k)
                st[k] = [min(st[k][0], v), max(st[k][1], v)]
    spec = f", {pl.spec}" if pl.spec else ""
    t = Table(title=f"{pl.framework} ({pl.mode}{spec}) {pl.model.get('name', '')} "
                    f"N={pl.model['num_params']:,} world={pl.world}: state bytes per rank at a step boundary")
    for col in ("stage", "ranks", *(k.replace("_bytes", "") for k in COLS), "distinct"):
        t.add_column(col, justify="left" if col == "ranks" else "right")
    for i, (stage, st) in enumerate(sorted(stages.items())):
        if i == max_rows:
            t.add_row("…", f"{len(stages) - max_rows} more stages", *[""] * (len(COLS) + 1))
            break
        lo, hi = st["ranks"]
        t.add_row(str(stage), f"{lo}–{hi} ({st['n']})" if hi > lo else str(lo),
                  *(_span(*st[k]) for k in COLS), str(len(st["distinct"])))
    con.print(t)
    g = pl.per_gpu
    rank = next(r for r in range(pl.world) if pl.rank_state(r) is g)
    con.print(f"most-loaded: rank {rank} (stage {g.stage}): resident {g.resident_bytes:,} B = "
              + " + ".join(f"{k.replace('_bytes', '')} {getattr(g, k):,}" for k in STATES), markup=False)
    c = Table(title="collectives per rank per optimizer step (most-loaded rank)")
    for col in ("dim", "kind", "dtype", "count", "buffer", "wire", "what"):
        c.add_column(col)
    for x in pl.comm:
        c.add_row(x.dim, x.kind, x.dtype, str(x.count), fmt(x.buffer_bytes), fmt(x.wire_bytes), x.what)
    con.print(c)
    for n in pl.notes:
        con.print(f"note: {n}", markup=False)
    return buf.getvalue()
