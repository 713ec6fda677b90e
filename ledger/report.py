"""A readable per-rank table of a Placement (rich), with human units."""
from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from ledger.placement import STATES, Placement, fmt


def render(pl: Placement, max_rows: int = 16) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=140, force_terminal=False)
    t = Table(title=f"{pl.framework} ({pl.mode}) {pl.model.get('name', '')} "
                    f"N={pl.model['num_params']:,} world={pl.world}")
    t.add_column("rank", justify="right")
    t.add_column("stage", justify="right")
    for k in (*STATES, "resident_bytes"):
        t.add_column(k.replace("_bytes", ""), justify="right")
    shown, seen = 0, {}
    for r in range(pl.world):
        s = pl.rank_state(r)
        if id(s) in seen:
            seen[id(s)].append(r)
            continue
        seen[id(s)] = [r]
        if shown < max_rows:
            t.add_row(str(r), str(s.stage), *(fmt(getattr(s, k)) for k in (*STATES, "resident_bytes")))
            shown += 1
    con.print(t)
    if len(seen) > shown or any(len(v) > 1 for v in seen.values()):
        con.print(f"{len(seen)} distinct rank states over {pl.world} ranks (ranks with identical state shown once)")
    c = Table(title="collectives per rank per optimizer step (most-loaded rank)")
    for col in ("dim", "kind", "dtype", "count", "buffer", "wire", "what"):
        c.add_column(col)
    for x in pl.comm:
        c.add_row(x.dim, x.kind, x.dtype, str(x.count), fmt(x.buffer_bytes), fmt(x.wire_bytes), x.what)
    con.print(c)
    for n in pl.notes:
        con.print(f"note: {n}", markup=False)
    return buf.getvalue()
