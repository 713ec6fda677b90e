"""A torchtitan 0.3.0 rank's resident state and the Placement over the world's ranks, shared by the
placement without PP (states.py) and the pipeline's (pp.py): the state of FSDP2 shard rank k (torch 2.13
_fsdp_param.py's padded fp32 shards and the grads viewing _fsdp_collectives.py's reduce-scatter output,
torch.optim.AdamW's state, models/common/rope.py's caches), and the ranks' states shared by (stage, the
rows their uneven dim-0 shards hold).
"""
from __future__ import annotations

from typing import Callable

from ledger.dtypes import FP32 as F32
from ledger.faithful.titan.fsdp import Sharded, rows_of
from ledger.grid import Grid
from ledger.layout import Layout
from ledger.model import ModelShape, model_dict
from ledger.placement import Placement, RankState
from ledger.optim import adamw_parts


def placement(model: ModelShape, lay: Layout, grid: Grid, sh_of: Callable[[int], Sharded], heaviest: int,
              state: Callable[[int, int], RankState]) -> Placement:
    """The Placement of place and place_pp: a rank's state depends on its pipeline stage s (0
    without PP; sh_of(s) its modules' Sharded) and its FSDP shard rank k alone (state(s, k) makes
    it); ranks differ only by the rows their dim-0 shards hold, and only params whose dim 0 does
    not split evenly give different shard ranks different rows: (s, those rows) key the shared
    states. heaviest: the first stage of the most-loaded kind (0 without PP)."""
    cp = lay.cp
    ds = lay.dp_shard * cp
    cache: dict = {}
    by_sk: dict[tuple[int, int], RankState] = {}

    def rank_state(r: int) -> RankState:
        c = grid.coords(r)
        sk = c["pp"], c["dp"] * cp + c["cp"]  # the stage, the rank's index on the fsdp mesh (cp inner)
        if sk not in by_sk:
            s, k = sk
            key = (s, *[rows_of(d0, ds, k) for d0, _ in sh_of(s).uneven])
            if key not in cache:
                cache[key] = state(s, k)
            by_sk[sk] = cache[key]
        return by_sk[sk]

    return Placement(framework="titan", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                     world=lay.world, rank_state=rank_state,
                     # shard rank 0 holds a full chunk (rows_of: ceil(d0/ds) rows) of every dim 0, as
                     # many as any shard rank, and its stage's other bytes are its stage's: the
                     # heaviest stage's shard rank 0 (its first rank) is as loaded as any rank and
                     # comes first (test: per_gpu is the walk over every rank's)
                     representatives=[grid.rank({"dp": 0, "cp": 0, "pp": heaviest})],
                     # the same within one stage: its shard rank 0 is as loaded as any of its ranks
                     stage_representatives=lambda s: [grid.rank({"dp": 0, "cp": 0, "pp": s})])


def state_parts(model: ModelShape, sh: Sharded, k: int, ds: int, layers: int | None = None,
                gradless: tuple[int, int, int] | None = None) -> list[tuple[str, str, int]]:
    """(state, name, bytes) of shard rank k's resident state, in build_state's order: a stage's load is
    their sum, without a RankState. gradless: (padded, held elements, params) of params that never get a
    gradient (no grad shard; AdamW makes no state for a param whose grad is None)."""
    no_padded, no_held, no_params = gradless or (0, 0, 0)
    # torch.optim.AdamW: exp_avg / exp_avg_sq like the unpadded local shard, 4-byte fp32 step
    held = sh.even + sum([rows_of(d0, ds, k) * rest for d0, rest in sh.uneven])
    # _fsdp_param.py: the sharded param is a view of a padded (ceil(d0/ds) rows) fp32 storage;
    # _fsdp_collectives.py foreach_reduce: .grad views the padded reduce-scatter output, trainer
    # zero_grad(set_to_none=False) keeps those step-0 buffers and accumulates into them
    return [("params_bytes", "fp32 shards (dim-0 padded)", sh.padded * F32),
            ("grads_bytes", "fp32 grad shards (dim-0 padded)", (sh.padded - no_padded) * F32),
            *adamw_parts(held - no_held, sh.n_params - no_params),
            # models/common/rope.py: every attention keeps a complex64 rope cache (seq_len x
            # head_dim/2); CP shards the positions that index it (prepare_context_parallel_input),
            # not the cache
            ("other_bytes", "rope cache buffers",
             (model.layers if layers is None else layers) * model.seq_len * (model.head_dim // 2) * 8)]


def build_state(parts: list[tuple[str, str, int]], comm_fn, comm_first) -> RankState:
    s = RankState(comm_fn=comm_fn, comm_first=comm_first)
    for state, name, nbytes in parts:
        s.add(state, name, nbytes)
    return s
