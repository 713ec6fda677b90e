"""The rank grid shared by the ledger and the probes: which ranks form which group.

Order, innermost (fastest-varying) first: tp, cp, dp (shard), dp_replicate, pp. It is Megatron's
default order "tp-cp-ep-dp-pp" (parallel_state.initialize_model_parallel, ep = 1) and torchtitan's
(pp, dp_replicate, dp_shard, cp, tp) mesh (distributed/parallel_dims.py build_mesh), so one grid
names the groups of all three frameworks. A collective's `dim` is the dash-joined list of grid
dims that vary inside its group ("dp", "tp", "tp-pp", ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import product

from ledger.frozen import direct_init

DIMS = ("tp", "cp", "dp", "dp_replicate", "pp")


@direct_init  # ledger/frozen.py: fields stored straight into __dict__ (speed)
@dataclass(frozen=True, init=False)
class Grid:
    tp: int = 1
    cp: int = 1
    dp: int = 1  # the shard part of data parallelism (dp_shard)
    dp_replicate: int = 1
    pp: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.tp, self.cp, self.dp, self.dp_replicate, self.pp)  # DIMS order

    @property
    def world(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def coords(self, rank: int) -> dict[str, int]:
        tp, cp, dp, dpr = self.tp, self.cp, self.dp, self.dp_replicate
        return {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp,
                "dp_replicate": rank // (tp * cp * dp) % dpr, "pp": rank // (tp * cp * dp * dpr) % self.pp}

    def rank(self, coords: dict[str, int]) -> int:
        g = coords.get
        tp, cp, dp, dpr = self.tp, self.cp, self.dp, self.dp_replicate
        return g("tp", 0) + tp * (g("cp", 0) + cp * (g("dp", 0) + dp * (g("dp_replicate", 0) + dpr * g("pp", 0))))

    def group(self, rank: int, dims: tuple[str, ...] | str) -> list[int]:
        """Ranks of `rank`'s group that varies over `dims` (others fixed)."""
        dims = (dims,) if isinstance(dims, str) else dims
        c = self.coords(rank)
        ranges = [range(getattr(self, d)) for d in dims]
        return sorted(self.rank({**c, **dict(zip(dims, v))}) for v in product(*ranges))

    def size_of(self, dims: tuple[str, ...]) -> int:
        """Ranks in a group that varies over `dims`."""
        n = 1
        for d in dims:
            n *= getattr(self, d)
        return n

    def label_of(self, dims: tuple[str, ...]) -> str:
        """label() of a group that varies over `dims`, without listing its ranks."""
        return "-".join(d for d in DIMS if d in dims and getattr(self, d) > 1) or "self"

    def label(self, ranks) -> str:
        """The dims that vary inside a group of ranks, e.g. 'dp' or 'tp-pp'."""
        return _label(self, tuple(ranks))


@lru_cache(maxsize=4096)
def _label(grid: Grid, ranks: tuple[int, ...]) -> str:
    cs = [grid.coords(r) for r in ranks]
    varying = [d for d in DIMS if len({c[d] for c in cs}) > 1]
    return "-".join(varying) if varying else "self"


def dim_strides(lay) -> dict:
    """dim -> (stride, size) over the ranks of a Layout: the dense grid's dims and Megatron's expert
    grid's (etp, ep, edp)."""
    # rank = tp + tp*(cp + cp*(dp + dp*(dp_replicate + dp_replicate*pp))): ledger/grid.py Grid.rank
    s, out = 1, {}
    for d, n in zip(DIMS, (lay.tp, lay.cp, lay.dp_shard, lay.dp_replicate, lay.pp)):
        out[d] = (s, n)
        s *= n
    # Megatron's expert grid (MoE): etp fastest, then ep, then edp, then pp (parallel_state.py, the
    # same order string as the dense grid's)
    out.update(etp=(1, lay.etp), ep=(lay.etp, lay.ep), edp=(lay.etp * lay.ep, lay.edp))
    return out


def link_of(lay, dim: str, kind: str, gpus_per_node: int) -> str:
    """intra when every group of this collective lies inside one node, else inter. Nodes hold
    consecutive ranks (gpus_per_node each); a group varying over `dim` spans a block of consecutive
    ranks up to its outermost dim's stride x size (a send_recv pair: two stages, stride x 2), so it is
    inside a node when that block fits in one and nodes are aligned on such blocks."""
    st = dim_strides(lay)
    dims = [d for d in dim.split("-") if d in st]
    if not dims:
        return "intra"
    stride, size = max((st[d] for d in dims), key=lambda x: x[0])
    block = stride * (2 if kind == "send_recv" else size)
    return "intra" if block <= gpus_per_node and gpus_per_node % block == 0 else "inter"


def node_ranks(lay, dim: str, gpus_per_node: int) -> int:
    """How many ranks of one group of a collective over `dim` share a node: the members of rank 0's
    group (offsets sum k_d x stride_d over the group's dims) below gpus_per_node. Nodes hold
    consecutive ranks and the grid is regular, so every group of the dim has as many on each node."""
    st = dim_strides(lay)
    inner = [st[d] for d in dim.split("-") if d in st and st[d][0] < gpus_per_node and st[d][1] > 1]
    offsets = [0]
    for stride, size in inner:
        offsets = [o + k * stride for o in offsets for k in range(min(size, -(-gpus_per_node // stride)))
                   if o + k * stride < gpus_per_node]
    return len(offsets)


def group_size(lay, dim: str) -> int:
    """Ranks in one group of a collective whose `dim` is a dash-joined list of grid dims."""
    st = dim_strides(lay)
    n = 1
    for d in dim.split("-"):
        n *= st[d][1] if d in st else 1
    return n
