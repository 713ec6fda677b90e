"""A readable per-rank table of a Placement (rich), with human units."""
from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from typing import TYPE_CHECKING

from ledger.target import CPU_GLOO, CUDA_NCCL
from ledger.units import STATES, fmt

if TYPE_CHECKING:  # render() reads a Placement; ledger.placement imports this module to print one
    from ledger.placement import Placement, RankState

COLS = (*STATES, "resident_bytes")


def _span(lo: int, hi: int) -> str:
    """A state's range over a stage's ranks, as far as human units tell them apart."""
    a, b = fmt(lo), fmt(hi)
    return b if a == b else f"{a} – {b}"


def expert_split(s) -> dict[str, tuple[int, int]]:
    """State -> (dense bytes, routed experts' bytes) of an MoE rank (its detail names the experts' parts
    "expert ...": ledger/faithful/megatron/moe.py); empty for a dense one."""
    out = {}
    for k in STATES:
        prefix = k[:-len("_bytes")] + "/"
        e = sum(v for n, v in s.detail.items() if n.startswith(prefix + "expert "))
        out[k] = (getattr(s, k) - e, e)
    return out if any(e for _, e in out.values()) else {}


def render(pl: "Placement", max_rows: int = 16, away_from_defaults: list[str] | None = None) -> str:
    """One row per pipeline stage (its ranks are one contiguous block of the grid): each state's
    range over the stage's ranks; then the most-loaded rank in exact bytes. away_from_defaults: the
    job's knobs whose values are not the framework's own defaults, listed in the title."""
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
    spec += f", for {pl.target}" if pl.target else ""
    spec += ", from sources" if pl.basis else ""
    t = Table(title=f"{pl.framework} ({pl.mode}{spec}) {pl.model.get('name', '')} "
                    f"N={pl.model['num_params']:,} world={pl.world}: state bytes per rank at a step boundary"
                    + (f"\nknobs away from {pl.framework}'s own defaults: {', '.join(away_from_defaults)}"
                       if away_from_defaults else ""))
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
    if g.host_bytes:
        con.print(f"  of which on the host (ZeRO-Offload) {g.host_bytes:,} B, on the device "
                  f"{g.resident_bytes - g.host_bytes:,} B", markup=False)
    split = expert_split(g)
    if split:
        con.print("  of which dense / routed experts: " + ", ".join(
            f"{k.replace('_bytes', '')} {d:,} / {e:,}" for k, (d, e) in split.items()), markup=False)
    _peaks(con, pl, sorted(stages.items()), max_rows)
    c = Table(title="collectives per rank per optimizer step (most-loaded rank)")
    for col in ("dim", "kind", "dtype", "count", "buffer", "wire", "what"):
        c.add_column(col)
    for x in pl.comm:
        c.add_row(x.dim, x.kind, x.dtype, str(x.count), fmt(x.buffer_bytes), fmt(x.wire_bytes), x.what)
    con.print(c)
    if pl.outside_allocator:
        con.print(f"beside the tensors, per rank ({pl.target}, ledger/cuda.py): "
                  f"{fmt(sum(pl.outside_allocator.values()))}", markup=False)
        for what, b in pl.outside_allocator.items():
            con.print(f"  {fmt(b):>10}  {what}", markup=False)
    for n in pl.notes:
        con.print(f"note: {n}", markup=False)
    return buf.getvalue()


def fit_verdict(pl: "Placement", gpu_memory_gb: float, memory_fraction: float) -> str:
    """Whether the heaviest rank fits the cluster's GPUs: its predicted peak within a step (its resident
    state where the ledger predicts no peak, said so) against memory_fraction x gpu_memory_gb, the
    planner's rule (ledger/plan.py), with the device memory outside PyTorch's allocator a cuda-nccl
    prediction names (Placement.outside_allocator); a verdict on a peak of the CPU harness's rules
    (target cpu-gloo) says that a GPU run's differs."""
    from ledger.units import peak_or_resident

    best_rank, best = heaviest_rank(pl)
    fixed = sum(pl.outside_allocator.values())
    need, budget = peak_or_resident(best) + fixed, memory_fraction * gpu_memory_gb * 1e9
    what = "predicted peak" if best.peak is not None else "resident state (no peak predicted for this layout)"
    if fixed:
        what += f" + {fmt(fixed)} beside the tensors (CUDA context, NCCL, cuBLAS)"
    verdict = "fits" if need <= budget else "does NOT fit"
    line = (f"fit: {verdict} cluster.gpu_memory_gb={gpu_memory_gb:g} GB x plan.memory_fraction={memory_fraction:g} "
            f"= {fmt(budget)}: rank {best_rank} (stage {best.stage}) {what} {fmt(need)} "
            f"({need / (gpu_memory_gb * 1e9):.0%} of the GPU)")
    if pl.target == CUDA_NCCL:
        line += (f"\n  headroom {fmt(budget - need)} below the budget, {fmt(gpu_memory_gb * 1e9 - need)} below the GPU's "
                 "memory; the CUDA allocator's rounding and fragmentation are not predicted (the budget's "
                 f"{1 - memory_fraction:.0%} is kept for them); from sources, no GPU run has confirmed this target")
    if pl.target == CPU_GLOO and best.peak is not None:
        line += ("\n  this peak follows cpu-gloo rules (the CPU harness): a GPU run's differs; predict it for a GPU "
                 "cluster (cluster=local_gpu or cluster.target=cuda-nccl)")
    return line


def heaviest_rank(pl: "Placement") -> tuple[int, "RankState"]:
    """The rank with the largest predicted peak (resident state where no peak is predicted), and its
    state; each stage is asked through the ranks that stand for it (stage_peak_ranks)."""
    from ledger.units import peak_or_resident

    stages: dict[int, list[int]] = {}
    for r in range(pl.world):
        lo_hi = stages.setdefault(pl.rank_state(r).stage, [r, r])
        lo_hi[1] = r
    best, best_rank = None, None
    for stage, (lo, hi) in sorted(stages.items()):
        for r in stage_peak_ranks(pl, stage, (lo, hi)):
            s = pl.rank_state(r)
            if best is None or peak_or_resident(s) > peak_or_resident(best):
                best, best_rank = s, r
    return best_rank, best


def stage_peak_ranks(pl: "Placement", stage: int, ranks: tuple[int, int]) -> list[int]:
    """The ranks whose peaks stand for a stage: the ledger's stage representatives where it names
    them (its heaviest rank per stage), else every rank of the stage's block with a distinct state."""
    if pl.stage_representatives is not None:
        return list(pl.stage_representatives(stage))
    seen, out = set(), []
    for r in range(ranks[0], ranks[1] + 1):
        s = pl.rank_state(r)
        if id(s) not in seen:
            seen.add(id(s))
            out.append(r)
    return out


def _peaks(con, pl: "Placement", stages, max_rows: int) -> None:
    """Per stage the peak within a step (RankState.peak) of its heaviest rank and its parts
    (placement.PEAK_PARTS), where the ledger predicts one; any framework's Peak prints the same way."""
    from ledger.units import PEAK_PARTS

    rows = []
    for i, (stage, st) in enumerate(stages):
        if i == max_rows:
            rows.append(None)
            break
        best = None
        for r in stage_peak_ranks(pl, stage, tuple(st["ranks"])):
            pk = pl.rank_state(r).peak
            if pk is not None and (best is None or pk.bytes > best[1].bytes):
                best = (r, pk)
        if best is not None:
            rows.append((stage, *best))
    if not [x for x in rows if x]:
        return
    t = Table(title="peak within a step per stage (its heaviest rank): resident state + what the step adds")
    for col in ("stage", "rank", "peak", *PEAK_PARTS, "phase", "at"):
        t.add_column(col, justify="left" if col in ("phase", "at") else "right")
    for x in rows:
        if x is None:
            t.add_row("…", *[""] * (len(PEAK_PARTS) + 4))
            continue
        stage, r, pk = x
        t.add_row(str(stage), str(r), fmt(pk.bytes), *(fmt(pk.parts.get(p, 0)) for p in PEAK_PARTS), pk.phase, pk.what)
    con.print(t)
    for x in rows:
        if x is not None and x[2].first is not None:
            f = x[2].first
            con.print(f"stage {x[0]} first step: peak {fmt(f.bytes)} ({f.phase}: {f.what})", markup=False)
