"""Faithful torchtitan 0.3.0 ledger (torch 2.13 FSDP2, partial_dtensor backend), per rank per step.

Every rule names the source it follows. Shapes are the ModelShape's, built as launchers/titan.py
builds them (llama3 layers, untied lm_head, separate wq/wk/wv, rope cache sized to seq_len).

Meshes (distributed/parallel_dims.py build_mesh, legacy spmd backend): FSDP shards over "fsdp" =
dp_shard x cp; the batch mesh is dp_replicate x dp_shard, the loss mesh batch x cp. The grid
(ledger/grid.py: tp, cp, dp, dp_replicate, pp) is torchtitan's mesh order, so a rank's FSDP shard
index is dp * cp + cp and a group over cp and dp_shard is dim "cp-dp".

Pipeline parallelism (pp > 1, _place_pp): torchtitan's default 1F1B, one stage per rank, over FSDP
on dp_shard; each stage holds the modules pipeline_parallel.py gives it, and its collectives are
the schedule's P2P per micro-batch, FSDP once per step (the last stage's [norm, lm_head] per
micro-batch), the grad-norm over pp, and in step 0 the schedule's vote and metadata inference.
"""
from __future__ import annotations

from functools import lru_cache
from math import prod
from operator import attrgetter
from typing import Callable, NamedTuple

from ledger.dtypes import BF16, FP32 as F32
from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape, model_dict
from ledger.faithful.titan import peak as titan_peak
from ledger.placement import Comm, CommBuilder, Placement, RankState, wire_bytes



class Param(NamedTuple):
    name: str
    shape: tuple[int, ...]  # the TP-local shape FSDP shards (dim 0)


def _tp_dim(name: str, shape: tuple[int, ...]) -> int | None:
    """TP placement of models/common/decoder_sharding.py: colwise (wq wk wv w1 w3), the
    vocab-sharded tok_embeddings and lm_head are Shard(0); rowwise (wo w2) Shard(1); norms replicate
    (None)."""
    if len(shape) == 1:
        return None
    return 1 if name.rsplit(".", 2)[-2] in ("wo", "w2") else 0


def _shard_tp(shape: tuple[int, ...], dim: int | None, tp: int, t: int = 0) -> tuple[int, ...]:
    """TP rank t's local shape: DTensor's Shard(dim) splits as torch.chunk (placement_types.py
    Shard._split_tensor): ceil(d/tp) rows on the first ranks, the last short (validate refuses what
    tp does not divide but the vocab; components/loss.py _LossParallelCrossEntropy takes the same
    chunk bounds)."""
    if tp == 1 or dim is None:
        return shape
    return (*shape[:dim], _rows_of(shape[dim], tp, t), *shape[dim + 1:])


def _tp_local(name: str, shape: tuple[int, ...], tp: int, t: int = 0) -> tuple[int, ...]:
    return _shard_tp(shape, _tp_dim(name, shape), tp, t)


def _ps(items, tp: int, t: int = 0) -> tuple[Param, ...]:
    return tuple(Param(n, _tp_local(n, s, tp, t)) for n, s in items)


def units(model: ModelShape, tp: int, t: int = 0) -> list[tuple[str, tuple[Param, ...]]]:
    """FSDP units of distributed/fsdp.py apply_fsdp_to_decoder (untied): tok_embeddings, one per
    TransformerBlock, [norm, lm_head] together; the root fully_shard(model) is left with none (TP rank t's)."""
    emb, block, head = _unit_params(model, tp, t)
    return [("tok_embeddings", emb),
            *((f"layers.{i}", block if i == 0 else _ps(model.layer_params(i), tp)) for i in range(model.layers)),
            ("norm+lm_head", head)]


@lru_cache(maxsize=64)
def _unit_items(model: ModelShape) -> tuple[tuple, tuple, tuple]:
    """The unsharded (name, shape) of units()' tok_embeddings, one TransformerBlock, [norm,
    lm_head]: a model's, whatever its tp (a search asks for many tp)."""
    return ((("tok_embeddings.weight", (model.vocab, model.hidden)),), tuple(model.layer_params(0)),
            (("norm.weight", (model.hidden,)), ("lm_head.weight", (model.vocab, model.hidden))))


def _unit_params(model: ModelShape, tp: int, t: int = 0) -> tuple[tuple[Param, ...], tuple[Param, ...],
                                                                  tuple[Param, ...]]:
    """units()' TP-local params of tok_embeddings, one TransformerBlock (ModelShape's blocks are
    alike: layer_params(i) differs from layer 0 by names only), [norm, lm_head]: the per-param
    listing the ledger's group sums (_groups, _sharded_part) are tested against."""
    emb, block, head = _unit_items(model)
    return _ps(emb, tp, t), _ps(block, tp, t), _ps(head, tp, t)


def _chunk_rows(d0: int, ds: int) -> int:
    """Rows of FSDP2's padded dim-0 shard of a dim 0 of d0 rows (_fsdp_param.py
    _init_sharded_param: torch.chunk size)."""
    return -(-d0 // ds)


def _rows_of(d0: int, ds: int, k: int) -> int:
    """Rows shard rank k really holds of a dim 0 of d0 rows (_chunk_with_empty: the last chunks may
    be short or empty)."""
    c = _chunk_rows(d0, ds)
    return max(0, min(d0 - k * c, c))


class _Sharded(NamedTuple):
    """What the state and the FSDP collectives of one (model, tp, dp_shard) need, in elements."""
    n_params: int
    padded: int  # sum of padded local shards (chunk rows x rest): params and grads
    even: int  # the same over params whose dim 0 splits evenly (every rank holds all its rows)
    uneven: tuple[tuple[int, int], ...]  # (dim 0, summed rest) of the others: rows differ by rank
    emb_full: int  # padded full (all-gather / reduce-scatter) numel per FSDP unit
    norm_full: int
    lm_full: int
    layer_full: int  # the same for one TransformerBlock (every block alike)


def _sharded(model: ModelShape, tp: int, ds: int, t: int = 0) -> _Sharded:
    return _sharded_part(model, tp, ds, True, model.layers, True, t)


@lru_cache(maxsize=64)
def _unit_dims(model: ModelShape) -> tuple[tuple[tuple[int, int, int | None, int], ...], ...]:
    """_unit_items' three groups as (dim 0, rest, the dim TP divides, how many params): what _groups
    needs, per model (names parsed once). A group's params of one shape and TP dim are one entry (a
    block's two norms, wk and wv, w1 and w3); ModelShape's params have at most two dims, so a TP
    dim 1 divides the rest."""
    out = []
    for g in _unit_items(model):
        kinds: dict[tuple[int, int, int | None], int] = {}
        for n, s in g:
            key = (s[0], prod(s[1:]), _tp_dim(n, s))
            kinds[key] = kinds.get(key, 0) + 1
        out.append(tuple([(*key, count) for key, count in kinds.items()]))
    return tuple(out)


class _Group(NamedTuple):
    """Sums over one of _unit_dims' groups (tok_embeddings, one TransformerBlock, [norm, lm_head])
    at one (tp, shard degree), in elements: what _Sharded adds up, per group."""
    n_params: int
    padded: int
    even: int
    uneven: tuple[tuple[int, int], ...]  # (dim 0, summed rest) of the params it splits unevenly
    full: int  # padded full numel of the group's params (a TransformerBlock's all-gather)
    fulls: tuple[int, ...]  # the same per _unit_dims entry ([norm, lm_head]: one each)


@lru_cache(maxsize=256)
def _groups(model: ModelShape, tp: int, ds: int, t: int = 0) -> tuple[_Group, ...]:
    out = []
    for g in _unit_dims(model):
        n_params = full = even = 0
        fulls = []
        uneven: dict[int, int] = {}
        for d0, rest, dim, count in g:
            d0, rest = _shard_tp((d0, rest), dim, tp, t)  # TP rank t's local shape (_tp_local)
            # the padded full tensor, what its unit's all-gather and reduce-scatter move: a
            # multiple of ds, its local shard (chunk rows x rest) is f // ds
            f = _chunk_rows(d0, ds) * ds * rest
            fulls.append(f)
            n_params += count
            full += count * f
            if d0 % ds:
                uneven[d0] = uneven.get(d0, 0) + count * rest
            else:  # even: all its chunk rows are real ones
                even += count * f
        out.append(_Group(n_params, full // ds, even // ds, tuple(uneven.items()), full, tuple(fulls)))
    return tuple(out)


@lru_cache(maxsize=1024)
def _sharded_part(model: ModelShape, tp: int, ds: int, has_emb: bool, L: int, has_head: bool,
                  t: int = 0) -> _Sharded:
    """_Sharded of a model part: tok_embeddings (or not), L TransformerBlocks, [norm, lm_head] (or
    not); the whole model without PP, a pipeline stage's modules with it. Sums of _groups, the
    block's times L (blocks are alike; test: equal to the sums over units()' every param)."""
    emb, block, head = _groups(model, tp, ds, t)
    # the blocks count even at L = 0: their uneven dims still key the states
    n_params, padded, even = block.n_params * L, block.padded * L, block.even * L
    uneven = {d0: L * rest for d0, rest in block.uneven}
    for g, on in ((emb, has_emb), (head, has_head)):
        if on:
            n_params += g.n_params
            padded += g.padded
            even += g.even
            for d0, rest in g.uneven:
                uneven[d0] = uneven.get(d0, 0) + rest
    return _Sharded(n_params, padded, even, tuple(sorted(uneven.items())), emb.full, head.fulls[0], head.fulls[1],
                    block.full)


# torch/nn/attention/flex_attention.py _DEFAULT_SPARSE_BLOCK_SIZE: the CP BlockMask's Q block
CP_BLOCK = 128


def check(model: ModelShape, lay: Layout) -> None:
    _check_model(model)
    # trainer.py Trainer.__init__: "validate dense activation sequence length evenness"
    sp, cp = lay.sequence_parallel, lay.cp
    if model.seq_len % ((lay.tp if sp else 1) * (2 * cp if cp > 1 else 1)):
        raise ConfigError(f"titan: seq_len={model.seq_len} must be divisible by "
                          + " x ".join([f"tp={lay.tp} (sequence_parallel)"] * bool(sp)
                                       + [f"2*cp={2 * cp} (context parallel)"] * (cp > 1)))
    # torch _context_parallel/_attention.py _create_cp_block_mask: NotImplementedError unless
    # Q_LEN % (cp * BLOCK_SIZE) == 0
    if cp > 1 and model.seq_len % (cp * CP_BLOCK):
        raise ConfigError(f"titan: cp={cp}: seq_len={model.seq_len} must be divisible by cp*{CP_BLOCK} "
                          "(torch's _create_cp_block_mask shards the BlockMask in whole blocks)")
    if model.seq_len % 8:
        raise ConfigError(f"titan: seq_len={model.seq_len} must be divisible by ChunkedLossWrapper.num_chunks=8")


@lru_cache(maxsize=64)
def _check_model(model: ModelShape) -> None:
    """check's rules on the model alone, checked once per model (a refusal is raised again: errors
    are not cached)."""
    if model.norm != "rmsnorm":
        raise ConfigError(f"titan: model.norm={model.norm!r}: torchtitan llama3 uses rmsnorm")
    if not model.swiglu:
        raise ConfigError("titan: model.swiglu=false: torchtitan llama3 feed-forward is SwiGLU")
    if model.bias:
        raise ConfigError("titan: model.bias=true: torchtitan llama3 linears have no bias")
    if model.tied_embeddings:
        raise ConfigError("titan: tied_embeddings=true is not modelled (separate FSDP grouping)")


# the framework settings the faithful ledger models (the field, its one modelled value): read in
# place() as one tuple
_MODELLED = ("dtype", "mixed_precision_param", "mixed_precision_reduce", "spmd_backend")
_MODELLED_VALUES = ("float32", "bfloat16", "float32", "partial_dtensor")
_modelled_of = attrgetter(*_MODELLED)


def place(model: ModelShape, lay: Layout, fw) -> Placement:
    check(model, lay)
    if _modelled_of(fw) != _MODELLED_VALUES:
        for field, want in zip(_MODELLED, _MODELLED_VALUES):
            if getattr(fw, field) != want:
                raise ConfigError(f"titan: framework.{field}={getattr(fw, field)!r}: the faithful ledger models "
                                  f"{want!r}")
    if lay.pp > 1:
        return _place_pp(model, lay, fw)
    grid: Grid = lay.grid
    ds = lay.dp_shard * lay.cp  # the FSDP shard degree: parallel_dims.py "fsdp" = dp_shard x cp
    if model.vocab % lay.tp:
        return _place_uneven_vocab(model, lay, fw, grid, ds)
    return _place_tp_rank(model, lay, fw, grid, ds, 0)


def _place_uneven_vocab(model: ModelShape, lay: Layout, fw, grid: Grid, ds: int) -> Placement:
    """A vocab tp does not divide: DTensor's Shard(0) gives TP rank t its torch.chunk rows of
    tok_embeddings and lm_head (_shard_tp), so each TP rank's FSDP shards, state and FSDP
    collectives are its own (_place_tp_rank of each); the TP collectives move [tokens, hidden] and
    per-token values, no vocab rows. TP rank 0 holds the most rows: its representative is the most
    loaded."""
    pls = [_place_tp_rank(model, lay, fw, grid, ds, t) for t in range(lay.tp)]
    pl = pls[0]
    states = [p.rank_state for p in pls]
    pl.rank_state = lambda r: states[grid.coords(r)["tp"]](r)
    pl.notes.append(f"titan tp: vocab {model.vocab} split as torch.chunk over tp={lay.tp} (DTensor Shard(0)): "
                    + ", ".join(str(_rows_of(model.vocab, lay.tp, t)) for t in range(lay.tp)) + " rows")
    return pl


def _place_tp_rank(model: ModelShape, lay: Layout, fw, grid: Grid, ds: int, t: int) -> Placement:
    """place() for the ranks of TP rank t (every rank where tp divides the vocab)."""
    cp = lay.cp
    sh = _sharded(model, lay.tp, ds, t)
    # the collectives are the same on every rank (padded full buffers): computed once, on first use
    memo: dict[bool, list] = {}

    def steady_comm():
        if True not in memo:
            memo[True] = _comm(model, lay, fw, sh, steady=True, grid=grid)
        return memo[True]

    # the first step differs from steady state only where the loss wrapper's lm_head unshard does
    # (_lm_head_regathers): derived from the steady list on first read (_first_step: the same list
    # as _comm(steady=False), for a fraction of the work); a search never reads it
    def first_comm():  # shared by the states of every rank, like the steady list
        if False not in memo:
            memo[False] = _first_step(steady_comm(), sh, ds, _mesh_labels(grid)[0])
        return memo[False]

    first = first_comm if ds > 1 and _lm_head_regathers(fw, True) != _lm_head_regathers(fw, False) else None

    def state(s: int, k: int) -> RankState:
        st = _state(_state_parts(model, sh, k, ds), steady_comm, first)
        resident = st.params_bytes + st.grads_bytes + st.optim_bytes + st.other_bytes

        def peak():  # ledger/faithful/titan/peak.py
            emb, block, head = _unit_params(model, lay.tp, t)
            return titan_peak.peak(model, lay, fw, sh, resident, *[sum([prod(p.shape) for p in u])
                                                                   for u in (block, emb, head)])

        st.peak = peak
        return st

    pl = _placement(model, lay, grid, lambda s: sh, 0, state)
    pl.notes.extend(titan_peak.notes(lay, fw))
    if lay.tp > 1:
        T = lay.micro_batch_size * model.seq_len // cp
        _, gaps, priced = _layer_backward_comm(model, T, lay.tp, bool(lay.sequence_parallel))
        if priced:
            pl.notes.append("titan tp: mm-backward strategies are priced with DTensor's cost model for one device "
                            "per host (cpu); on cuda with tp <= GPUs per host its intra-host numbers apply and a "
                            "choice may differ (DEVICES_PER_HOST)")
        for gap in gaps:
            pl.notes.append(f"titan tp: {gap}; collectives past that point are not predicted")
    return pl


def _placement(model: ModelShape, lay: Layout, grid: Grid, sh_of: Callable[[int], _Sharded], heaviest: int,
               state: Callable[[int, int], RankState]) -> Placement:
    """The Placement of place and _place_pp: a rank's state depends on its pipeline stage s (0
    without PP; sh_of(s) its modules' _Sharded) and its FSDP shard rank k alone (state(s, k) makes
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
            key = (s, *[_rows_of(d0, ds, k) for d0, _ in sh_of(s).uneven])
            if key not in cache:
                cache[key] = state(s, k)
            by_sk[sk] = cache[key]
        return by_sk[sk]

    return Placement(framework="titan", mode="faithful", model=lambda: model_dict(model), layout=lay.to_dict,
                     world=lay.world, rank_state=rank_state,
                     # shard rank 0 holds a full chunk (_rows_of: ceil(d0/ds) rows) of every dim 0, as
                     # many as any shard rank, and its stage's other bytes are its stage's: the
                     # heaviest stage's shard rank 0 (its first rank) is as loaded as any rank and
                     # comes first (test: per_gpu is the walk over every rank's)
                     representatives=[grid.rank({"dp": 0, "cp": 0, "pp": heaviest})],
                     # the same within one stage: its shard rank 0 is as loaded as any of its ranks
                     stage_representatives=lambda s: [grid.rank({"dp": 0, "cp": 0, "pp": s})])


def _state_parts(model: ModelShape, sh: _Sharded, k: int, ds: int, layers: int | None = None
                 ) -> list[tuple[str, str, int]]:
    """(state, name, bytes) of shard rank k's resident state, in _state's order: a stage's load is
    their sum, without a RankState."""
    # torch.optim.AdamW: exp_avg / exp_avg_sq like the unpadded local shard, 4-byte fp32 step
    held = sh.even + sum([_rows_of(d0, ds, k) * rest for d0, rest in sh.uneven])
    # _fsdp_param.py: the sharded param is a view of a padded (ceil(d0/ds) rows) fp32 storage;
    # _fsdp_collectives.py foreach_reduce: .grad views the padded reduce-scatter output, trainer
    # zero_grad(set_to_none=False) keeps those step-0 buffers and accumulates into them
    return [("params_bytes", "fp32 shards (dim-0 padded)", sh.padded * F32),
            ("grads_bytes", "fp32 grad shards (dim-0 padded)", sh.padded * F32),
            ("optim_bytes", "adam exp_avg+exp_avg_sq", 2 * held * F32),
            ("optim_bytes", "adam step", sh.n_params * F32),
            # models/common/rope.py: every attention keeps a complex64 rope cache (seq_len x
            # head_dim/2); CP shards the positions that index it (prepare_context_parallel_input),
            # not the cache
            ("other_bytes", "rope cache buffers",
             (model.layers if layers is None else layers) * model.seq_len * (model.head_dim // 2) * 8)]


def _state(parts: list[tuple[str, str, int]], comm_fn, comm_first) -> RankState:
    s = RankState(comm_fn=comm_fn, comm_first=comm_first)
    for state, name, nbytes in parts:
        s.add(state, name, nbytes)
    return s


def _lm_head_regathers(fw, steady: bool) -> bool:
    """components/loss.py ChunkedLossWrapper: lm_head.unshard() before the chunks; after step 0 the
    group reshards after forward (the wrapper leaves set_reshard_after_forward(True) behind), and
    "always" reshards from the start, so the unshard gathers again."""
    return steady or fw.reshard_after_forward == "always"


_REGATHER = "ChunkedLossWrapper lm_head.unshard"


def _first_step(steady: list[Comm], sh: _Sharded, ds: int, fsdp_dim: str) -> list[Comm]:
    """Step 0's collectives where they differ: steady state less the [norm, lm_head] gather that
    _lm_head_regathers leaves out of the first step (test: equal to _comm(steady=False))."""
    buf = (sh.norm_full + sh.lm_full) * BF16
    out = []
    for c in steady:
        if (c.dim, c.kind, c.dtype) == (fsdp_dim, "all_gather", "bf16"):
            c = Comm(c.dim, c.kind, c.count - 1, c.buffer_bytes - buf, c.wire_bytes - wire_bytes(c.kind, buf, ds),
                     c.dtype, "; ".join(w for w in c.what.split("; ") if w != _REGATHER))
        out.append(c)
    return out


@lru_cache(maxsize=8)
def _labels_of(cp: bool, dp: bool, dp_replicate: bool) -> tuple[str, str, str]:
    g = Grid(cp=1 + cp, dp=1 + dp, dp_replicate=1 + dp_replicate)
    return g.label_of(("cp", "dp")), g.label_of(("dp", "dp_replicate")), g.label_of(("cp", "dp", "dp_replicate"))


def _mesh_labels(grid: Grid) -> tuple[str, str, str]:
    """Grid.label_of of the fsdp (cp, dp), batch (dp, dp_replicate) and loss (cp, dp, dp_replicate)
    meshes. A label names the dims of size > 1: one Grid per which of cp, dp, dp_replicate are
    makes them (cached; test: equal to grid.label_of)."""
    return _labels_of(grid.cp > 1, grid.dp > 1, grid.dp_replicate > 1)


def _comm(model: ModelShape, lay: Layout, fw, sh: _Sharded, steady: bool, grid: Grid | None = None) -> list[Comm]:
    cp, rep, tp = lay.cp, lay.dp_replicate, lay.tp
    ds = lay.dp_shard * cp
    fsdp, batch_dim, loss_dim = _mesh_labels(grid or lay.grid)  # the "fsdp" mesh: dp_shard x cp
    L = model.layers
    emb, layer, head = sh.emb_full, sh.layer_full, sh.norm_full + sh.lm_full
    # distributed/fsdp.py get_fsdp_reshard_after_forward_policy: "default" (no PP) = True
    reshard = fw.reshard_after_forward in ("default", "always")
    acc = CommBuilder()
    # _fsdp_collectives.py foreach_all_gather: one bf16 buffer per unit. Forward: every unit gathers
    # once ([norm, lm_head] again where the loss wrapper unshards it: _lm_head_regathers), and ends
    # with lm_head.reshard(): the norm's backward gathers the group again
    acc.add_several(fsdp, "all_gather", "bf16", ds,
               ((emb * BF16, 1, "forward unshard"), (layer * BF16, L, "forward unshard"),
                (head * BF16, 1, "forward unshard (norm)"), (head * BF16, _lm_head_regathers(fw, steady), _REGATHER),
                (head * BF16, 1, "backward unshard (norm)"), (layer * BF16, L * reshard, "backward unshard"),
                (emb * BF16, reshard, "backward unshard")))
    # foreach_reduce: one fp32 reduce-scatter per call: lm_head at the last chunk (gradient sync off
    # before), norm after its backward, then the blocks and tok_embeddings; with HSDP each reduced
    # shard is all-reduced over dp_replicate
    scatters = ((sh.lm_full, 1, "lm_head grad (last chunk)"), (sh.norm_full, 1, "norm grad"),
                (layer, L, "layer grads"), (emb, 1, "tok_embeddings grad"))
    acc.add_several(fsdp, "reduce_scatter", "fp32", ds, [(f * F32, c, w) for f, c, w in scatters])
    if rep > 1:
        acc.add_several("dp_replicate", "all_reduce", "fp32", rep,
                   [(f * F32 // ds, c, f"HSDP {w}") for f, c, w in scatters])

    # distributed/utils.py clip_grad_norm_: get_total_norm stacks the per-param _NormPartial norms;
    # DTensor reduces the stacked vector once per mesh dim where the grads are sharded
    acc.add(fsdp, "all_reduce", sh.n_params * F32, ds, "fp32", 1, "grad-norm (stacked per-param norms)")
    acc.add("tp", "all_reduce", sh.n_params * F32, tp, "fp32", 1, "grad-norm (stacked per-param norms)")
    # trainer.py train_step: global_valid_tokens (int64) on the batch mesh (dp_replicate x
    # dp_shard: cp ranks count the same unsharded labels), then the logged global avg loss (sum),
    # max loss, ntokens_seen (int64) on the loss mesh (batch x cp)
    bsize = lay.dp_shard * rep
    acc.add(batch_dim, "all_reduce", 8, bsize, "int64", 1, "valid tokens")
    acc.add(loss_dim, "all_reduce", 8, bsize * cp, "int64", 1, "ntokens_seen")
    acc.add(loss_dim, "all_reduce", 4, bsize * cp, "fp32", 2, "loss sum, loss max")
    if cp > 1:
        # distributed/context_parallel/api.py apply_cp_to_forward (FlexAttention): every inner
        # attention all-gathers its K and V over cp (torch _cp_custom_ops.py flex_cp_allgather:
        # two all_gather_single on the sequence dim); its backward reduce-scatters both grads
        # (flex_cp_allgather_backward). Local K/V: kv_heads/tp heads (inside TP's local_map)
        kv = lay.micro_batch_size * model.seq_len * model.kv_heads // tp * model.head_dim * BF16
        acc.add("cp", "all_gather", kv, cp, "bf16", 2 * L, "CP K/V all-gather")
        acc.add("cp", "reduce_scatter", kv, cp, "bf16", 2 * L, "CP K/V grads")
        # a checkpointed block's recompute gathers K and V again (not in SAC's save list)
        acc.add("cp", "all_gather", kv, cp, "bf16", 2 * L * _recomputed(fw, "all_gather"), "CP K/V all-gather, recompute")
    if tp > 1:
        _tp_comm(acc, model, lay, fw)
    return acc.build()


def _recomputed(fw, kind: str) -> bool:
    """Whether a checkpointed block's recompute in its backward runs its forward collectives of this
    kind again (distributed/activation_checkpoint.py): full AC saves nothing inside the block, so
    every one; selective AC's save list has _c10d_functional.reduce_scatter_tensor (and all_to_all)
    but not all_gather / all_reduce, so all but the reduce-scatters. Measured on the CPU (tp2, cp2 at
    world 2, both modes: two more all-reduces / K-V all-gathers a block) and on the fake world (the
    article's FSDP4-TP2-SP run: two more all-gathers a block, and two more reduce-scatters under full)."""
    ac = getattr(fw, "activation_checkpoint", "none")
    return ac == "full" or (ac == "selective" and kind != "reduce_scatter")


def _tp_comm(acc: CommBuilder, model: ModelShape, lay: Layout, fw) -> None:
    """TP collectives of models/common/decoder_sharding.py's plan (models/llama3/sharding.py) as
    DTensor runs it, with or without sequence parallelism (parallelism.enable_sequence_parallel), and
    a checkpointed block's forward ones again in its recompute (_recomputed)."""
    tp, L, h = lay.tp, model.layers, model.hidden
    T = lay.micro_batch_size * model.seq_len // lay.cp  # the rank's tokens: CP splits the sequence
    act = T * h * BF16
    sp = bool(lay.sequence_parallel)
    blocks = 2 * L + 1  # every block's two sub-layers and one more (embedding or root norm)
    if sp:
        # SP: the residual stream is sequence-sharded, Shard(1) (dense_sequence_parallel_placement).
        # forward: tok_embeddings' output (set_decoder_sharding_config: out_src Partial, out_dst SP) and
        # rowwise wo, w2 (rowwise_config(output_sp=True)) go Partial -> Shard(1): reduce-scatter;
        # attention's x_BLD and feed_forward's x (set_gqa_attention_sharding / set_dense_ffn_sharding
        # in_dst Replicate) and the root norm's output (pre_lm_head_norm_config out_dst Replicate)
        # go Shard(1) -> Replicate: all-gather.
        # backward: _redistribute.py _redistribute_backward runs each of these in reverse. A
        # Partial -> Shard(1) becomes Shard(1) -> Replicate ("for backward shard -> partial, we just
        # do shard -> replicate"): all-gather. A Shard(1) -> Replicate gets the Partial grad (the
        # colwise input grads, derivation above _MM; the loss wrapper's hidden grad) and takes it
        # back to Shard(1): reduce-scatter
        acc.add_several("tp", "reduce_scatter", "bf16", tp,
                   ((act, blocks, "SP: embedding + rowwise outputs Partial -> Shard(1)"),
                    (act, blocks, "SP backward: Partial grads of the gathered inputs scattered"),
                    (act, 2 * L * _recomputed(fw, "reduce_scatter"), "SP: rowwise outputs, recompute")))
        acc.add_several("tp", "all_gather", "bf16", tp,
                   ((act, blocks, "SP: attention/ffn inputs + root norm output Shard(1) -> Replicate"),
                    (act, blocks, "SP backward: grads of the Partial -> Shard(1) outputs gathered"),
                    (act, 2 * L * _recomputed(fw, "all_gather"), "SP: attention/ffn inputs, recompute")))
    else:
        # forward: tok_embeddings (vocab-parallel, Partial -> Replicate) and rowwise wo, w2 outputs;
        # backward: ChunkedLossWrapper hands the hidden grad back Partial (loss.py
        # GradAccumulator.result); it stays Partial down the residual stream (derivation above _MM)
        # and is reduced once, at tok_embeddings' local_map output (Partial -> Replicate)
        acc.add_several("tp", "all_reduce", "bf16", tp, ((act, blocks, "embedding + rowwise outputs"),
                                                          (act, 1, "residual-stream grad at tok_embeddings"),
                                                          (act, 2 * L * _recomputed(fw, "all_reduce"),
                                                           "rowwise outputs, recompute")))
    # backward: every norm's weight grad is Partial on tp (with SP: a Replicate weight times a
    # Shard(1) input) and FSDP's post-backward (_fsdp_param.py _get_grad_inner_tensor) redistributes
    # it to the param's Replicate: all-reduce (norm_config: "pending BWD AR handled by FSDP")
    acc.add("tp", "all_reduce", h * BF16, tp, "bf16", blocks, "norm weight grads")
    # components/loss.py ChunkedLossWrapper -> loss-parallel cross-entropy on vocab-sharded logits:
    # max, sum-exp and target-logit all-reduces per chunk (num_chunks = 8)
    chunks = 8
    acc.add("tp", "all_reduce", T // chunks * F32, tp, "fp32", 3 * chunks, "loss-parallel CE")
    # backward, per layer: what DTensor's sharding propagation makes of each linear's MmBackward0
    # (derivation above _MM); every layer is alike
    for kind, full in _layer_backward_comm(model, T, tp, sp)[0]:
        acc.add("tp", kind, full * BF16, tp, "bf16", L, _MM_BACKWARD)


_MM_BACKWARD = "DTensor mm backward redistribution"


# -- DTensor backward of the TP linears (torch 2.13, partial_dtensor: activations stay DTensors on
# the 1-D tp mesh inside every block, so each aten op of the backward goes through sharding
# propagation, torch/distributed/tensor/_dispatch.py OpDispatcher -> _sharding_prop.py) ------------
#
# Placements entering the backward (models/common/decoder_sharding.py, protocols/module.py):
#   colwise wq wk wv w1 w3: W Shard(0) [out, in], input x Replicate, output Shard(-1);
#   rowwise wo w2: W Shard(1), input Shard(-1), output Partial -> Replicate (forward all-reduce),
#   with SP Partial -> Shard(1) (forward reduce-scatter).
#   No SP: the gradient reaching a rowwise output is Partial: components/loss.py
#   GradAccumulator.result hands the hidden grad back Partial(sum), the norms' and colwise inputs'
#   grads are Partial and add(P, P) stays P, so the residual stream's grad is Partial down to
#   tok_embeddings.
#   SP: the rowwise output's Partial -> Shard(1) runs backward as Shard(1) -> Replicate
#   (_redistribute.py _redistribute_backward), so the gradient reaching a rowwise output is
#   Replicate; the colwise inputs' Partial grads meet the block input's Shard(1) -> Replicate
#   backward (a reduce-scatter, counted in _tp_comm).
#   Colwise outputs get a Shard grad: q/k/v from inner attention's local_map in_grad_placements
#   Shard(2) (set_gqa_inner_attention_local_map), w1/w3 from SwiGLU's elementwise backward.
# nn.Linear on a 3-D input runs t + view + aten.mm; MmBackward0 (derivatives.yaml, FunctionsManual
# mm_mat1_backward / mm_mat2_backward) computes grad_x2d = mm(g, W) and, W.t() being column-major,
# grad_Wt = mm(g.t(), x2d).t(). Each mm picks a strategy of _ops/_matrix_ops.py
# gen_single_dim_einsum_strategies("mk,kn->mn") (all-Replicate inserted first,
# single_dim_strategy.py) by _sharding_prop.py _select_min_cost_strategy, priced by
# _collective_utils.py redistribute_cost; the chosen input redistributions are the collectives.
# The weight grad then meets FSDP's _fsdp_param.py _get_grad_inner_tensor, which redistributes it
# to the param's TP placement (Partial -> Shard = reduce-scatter).

# mk,kn->mn strategies over one mesh dim, (out, mat1, mat2), in the order the propagator sees them
_MM = (("R", "R", "R"), ("P", "S1", "S0"), ("S0", "S0", "R"), ("S1", "R", "S1"),
       ("P", "P", "R"), ("P", "R", "P"), ("Pavg", "Pavg", "R"), ("Pavg", "R", "Pavg"))
_MM_MAT1, _MM_MAT2 = (tuple(dict.fromkeys(st[i] for st in _MM)) for i in (1, 2))
# _collective_utils.py MeshTopoInfo.build_from_mesh: 87.7 GB/s and 0.6 us per hop within a host; a
# mesh dim with more devices than num_devices_per_host (torch.<device>.device_count(): 1 for cpu)
# gets 0.22x the bandwidth and 2.7 us. The ledger is checked against CPU/gloo runs: one per host.
DEVICES_PER_HOST = 1


def _coll_cost(kind: str, nbytes: float, n: int) -> float:
    """_collective_utils.py allgather_cost / allreduce_cost / reduce_scatter_cost, in us."""
    bw, lat = (87.7, 0.6) if n <= DEVICES_PER_HOST else (87.7 * 0.22, 2.7)
    hops = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return 6.6 + hops * lat + (nbytes / 1024 ** 3 * hops / n) / bw * 1e6


def _transition(cur: str, tgt: str) -> tuple[str | None, bool, str | None] | None:
    """_collective_utils.py _compute_placement_transition_cost on one mesh dim, by placements alone:
    (the collective it is priced as, priced on the 1/n local shard plus a 1.0 penalty, the
    collective redistribute_local_tensor then runs); (None, False, None) free, None banned."""
    if cur == tgt or cur == "R":  # Replicate -> Shard / Partial: a local chunk or view
        return None, False, None
    if cur[0] == "S" and tgt == "R":
        return "all_gather", False, "all_gather"
    if cur[0] == "S" and tgt[0] == "S":  # all-to-all priced as a local all-gather + 1.0 penalty
        return "all_gather", True, "all_to_all"
    if cur == "P" and tgt == "R":
        return "all_reduce", False, "all_reduce"
    if cur == "P" and tgt[0] == "S":
        return "reduce_scatter", False, "reduce_scatter"
    return None  # Shard -> Partial, Partial -> another Partial: banned


@lru_cache(maxsize=1024)
def _transition_costs(transitions: tuple, numel_full: int, n: int) -> tuple[float, ...]:
    """_collective_utils.py redistribute_cost of each allowed _transition of one bf16 tensor (cached:
    a layer's backward hands several mm's the same gradient)."""
    full = numel_full * BF16
    return tuple([0.0 if priced is None else _coll_cost(priced, full / n, n) + 1.0 if local
                  else _coll_cost(priced, full, n) for priced, local, _ in transitions])


def _move(cur: str, tgt: str, numel_full: int, n: int) -> tuple[float, str | None]:
    """redistribute_cost on one mesh dim (bf16 tensors): cost and the collective
    redistribute_local_tensor then runs (inf where the transition is banned)."""
    t = _transition(cur, tgt)
    if t is None:
        return float("inf"), None
    return _transition_costs((t,), numel_full, n)[0], t[2]


def _mm(a: tuple[str, int], b: tuple[str, int], n: int) -> tuple[str, list[tuple[str, int]], bool]:
    """aten.mm on DTensors (placement, full numel) a @ b: the output placement, the collectives, and
    whether the choice was priced (no strategy took the inputs as they are).
    _sharding_prop.py _select_min_cost_strategy: a strategy needing no redistribution first, then
    the first zero-cost one, else the first of minimal summed cost."""
    move_a = {t: _move(a[0], t, a[1], n) for t in _MM_MAT1}  # each input to what the strategies ask
    move_b = {t: _move(b[0], t, b[1], n) for t in _MM_MAT2}
    best = None
    for out, pa, pb in _MM:
        (ca, ka), (cb_, kb) = move_a[pa], move_b[pb]
        cost = ca + cb_
        if (pa, pb) == (a[0], b[0]):
            cost = -1.0  # no redistribution at all: taken before any other
        if best is None or cost < best[0]:
            best = (cost, out, ka, kb)
    cost, out, ka, kb = best
    return out, [(k, numel) for k, numel in ((ka, a[1]), (kb, b[1])) if k], cost >= 0


# (mat1, mat2) placements of each _MM strategy -> its output (the pairs are distinct)
_MM_AS_IS = {(pa, pb): out for out, pa, pb in _MM}


@lru_cache(maxsize=64)
def _mm_plan(pa: str, pb: str) -> tuple[tuple, tuple, tuple[tuple[int, int, int], ...]]:
    """Pricing an mm whose inputs are placed (pa, pb), by placements alone: each input's distinct
    transitions (_transition) to what the strategies ask of it, and the strategies with no banned
    move (the others cost inf) in _MM's order, as (strategy, mat1 transition, mat2 transition)
    indices."""
    ta: list = []
    tb: list = []
    allowed = []
    for s, (_, a, b) in enumerate(_MM):
        t_a, t_b = _transition(pa, a), _transition(pb, b)
        if t_a is not None and t_b is not None:
            for ts, t in ((ta, t_a), (tb, t_b)):
                if t not in ts:
                    ts.append(t)
            allowed.append((s, ta.index(t_a), tb.index(t_b)))
    return tuple(ta), tuple(tb), tuple(allowed)


def _mm_fast(a: tuple[str, int], b: tuple[str, int], n: int) -> tuple[str, list[tuple[str, int]], bool]:
    """_mm without its loop: where a strategy takes the inputs as they are, its cost -1.0 is below
    every priced one (>= 0), so _mm keeps it (no collective, not priced); else _mm keeps the first
    strategy of minimal summed cost, which min and index find among those with no banned move
    (_mm_plan: an inf total is never the minimum unless all are, and then _mm's own loop decides).
    Test: equal to _mm."""
    out = _MM_AS_IS.get((a[0], b[0]))
    if out is not None:
        return out, [], False
    ta, tb, allowed = _mm_plan(a[0], b[0])
    if not allowed:
        return _mm(a, b, n)
    ca, cb = _transition_costs(ta, a[1], n), _transition_costs(tb, b[1], n)
    total = [ca[i] + cb[j] for _, i, j in allowed]
    s, i, j = allowed[total.index(min(total))]
    return _MM[s][0], [(k, numel) for k, numel in ((ta[i][2], a[1]), (tb[j][2], b[1])) if k], True


@lru_cache(maxsize=1024)
def _layer_backward_comm(model: ModelShape, T: int, tp: int, sp: bool = False
                         ) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...], bool]:
    """Collectives (kind, full numel) one TransformerBlock's TP linears cause in backward, the
    paths this derivation does not cover (named in the Placement's notes), and whether any mm's
    strategy was chosen by DTensor's cost model (else every mm took its inputs as they came)."""
    h, f = model.hidden, model.ffn_hidden
    q = model.heads * model.head_dim
    out: list[tuple[str, int]] = []
    undone: list[str] = []
    priced = False
    g_row = "R" if sp else "P"  # the grad reaching a rowwise output (placements above _MM)
    for name, k in (("wo", q), ("w2", f)):  # rowwise: g [T,h], x2d [T,k] S1, W [h,k] S1
        o, m, pr = _mm_fast((g_row, h * T), ("S1", T * k), tp)  # grad W: mm(g.t(), x2d), [h,k]
        out += m
        priced |= pr
        if o == "P":  # FSDP _get_grad_inner_tensor: Partial -> Shard(1)
            out.append(("reduce_scatter", h * k))
        elif o not in ("S1", "R"):
            undone.append(f"{name} weight grad leaves mm as {o}")
        o, m, pr = _mm_fast((g_row, T * h), ("S1", h * k), tp)  # grad x2d: mm(g, W), [T,k]
        out += m
        priced |= pr
        if name == "wo" and o == "P":  # -> inner attention's local_map in_grad Shard(2) (heads)
            out.append(("reduce_scatter", T * k))
        elif o not in ("S1", "R"):
            undone.append(f"{name} input grad leaves mm as {o} (the {'SwiGLU' if name == 'w2' else 'attention'} "
                          "backward that follows is not derived)")
    # colwise wq wk wv w1 w3 (g [T,k] Shard(1)): grad W = mm(g.t(), x2d) meets (S0, R) and grad x2d =
    # mm(g, W) meets (S1, S0), each a strategy's own inputs (_MM_AS_IS; test), so every shape takes them
    # as they come: W's Shard(0) grad and the Partial residual grad, no collective, nothing priced
    return tuple(out), tuple(undone), priced


# -- pipeline parallelism: distributed/pipeline_parallel.py pipeline_llm, torch 2.13 pipelining --------
#
# What the ledger models: torchtitan's default schedule 1F1B (one stage per rank, vp=1) over FSDP on
# dp_shard (layout.validate refuses tp, cp, dp_replicate and reshard_after_forward="always" with PP).
# The rank's local batch (global_batch_size / dp) is split into num_microbatches pipeline
# micro-batches of micro_batch_size (parallelism.pipeline_parallel_microbatch_size).


@lru_cache(maxsize=256)
def pp_stages(layers: int, pp: int, input_weight: int = 1, output_weight: int = 1
              ) -> tuple[tuple[bool, int, int, bool], ...]:
    """pipeline_parallel.py _generate_llm_fqn_per_model_part(pp, layers, 1, 1) (the default
    pipeline_parallel_first/last_stage_less_layers = 1): per stage (has tok_embeddings, first
    layer, number of layers, has [norm, lm_head]). The same ValueErrors, as ConfigErrors."""
    eff = layers + input_weight + output_weight
    if pp > eff:
        raise ConfigError(f"titan: pp={pp}: more stages than effective layers {eff} (layers + 2; "
                          "pipeline_parallel.py _generate_llm_fqn_per_model_part)")
    per, extra = divmod(eff, pp)
    if per == 0 or input_weight > per or output_weight > per:
        raise ConfigError(f"titan: pp={pp}: layers={layers} give {per} effective layers per stage; "
                          "tok_embeddings and [norm, lm_head] count as one each and need at least one per stage")
    out, cur = [], 0
    for i in range(pp):
        n = per + (i < extra)
        if i == 0:
            n -= input_weight
        elif i == pp - 1:
            n -= output_weight
        n = max(0, min(n, layers - cur))
        out.append((i == 0, cur, n, i == pp - 1))
        cur += n
    return tuple(out)


def _pp_meta_bytes(mbs: int, seq: int, hidden: int) -> tuple[int, int]:
    """Bytes of the pickled metadata a stage sends in the first step (pipelining/stage.py
    _send_meta -> dist.send_object_list, pickled by distributed_c10d._object_to_tensor):
    _StageForwardMeta of the stage output and _StageBackwardMeta of the input grad, both one
    [mbs, seq, hidden] bf16 tensor. Pickled from torch's own classes (imported only here, on the
    first read of a first-step list, cached)."""
    return _pp_meta_bytes_cached(mbs, seq, hidden)


@lru_cache(maxsize=64)
def _pp_meta_bytes_cached(mbs: int, seq: int, hidden: int) -> tuple[int, int]:
    import io

    import torch
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas

    out = torch.empty(mbs, seq, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
    grad = torch.empty(mbs, seq, hidden, dtype=torch.bfloat16, device="meta")
    sizes = []
    for obj in (_StageForwardMeta(forward_metas=extract_tensor_metas((out,))),
                _StageBackwardMeta(backward_metas=extract_tensor_metas((grad,)))):
        f = io.BytesIO()
        c10d._pickler(f).dump(obj)
        sizes.append(len(f.getvalue()))
    return sizes[0], sizes[1]


@lru_cache(maxsize=256)
def _stage_kinds(layers: int, pp: int) -> tuple[tuple[tuple[bool, int, bool], ...], tuple[int, ...], tuple[int, ...]]:
    """pp_stages' stages by the modules they hold, (has tok_embeddings, layers, has [norm,
    lm_head]): stages of one kind (most middle stages) hold the same bytes. The kinds in stage
    order, the first stage of each (it stands for them), each stage's kind (an index)."""
    index: dict = {}
    firsts = []
    kind_of = []
    for s, (e, _, n, h) in enumerate(pp_stages(layers, pp)):
        if (e, n, h) not in index:
            index[e, n, h] = len(firsts)
            firsts.append(s)
        kind_of.append(index[e, n, h])
    return tuple(index), tuple(firsts), tuple(kind_of)


def _place_pp(model: ModelShape, lay: Layout, fw) -> Placement:
    if fw.reshard_after_forward == "always" or lay.tp > 1 or lay.cp > 1 or lay.dp_replicate > 1 or lay.vp > 1:
        raise ConfigError(f"titan: pp={lay.pp} is modelled with 1F1B over FSDP (dp_shard) only, "
                          "reshard_after_forward default/never (see ledger.layout.validate)")
    grid: Grid = lay.grid
    ds, P = lay.dp_shard, lay.pp
    stages = pp_stages(model.layers, P)
    views = lay.num_microbatches >= 2
    memo: dict = {}

    def comm_of(s: int, first: bool):
        if (s, first) not in memo:
            memo[s, first] = _pp_comm(model, lay, _stage_sharded(model, ds, P, s), stages[s], s, first, grid)
        return memo[s, first]

    def state(s: int, k: int) -> RankState:
        st = _state(_pp_parts(model, ds, P, s, k, views), lambda: comm_of(s, False), lambda: comm_of(s, True))
        st.stage = s
        kept = st.params_bytes + st.optim_bytes + st.other_bytes
        grads = st.grads_bytes

        def peak():  # ledger/faithful/titan/peak.py pp_peak
            emb, block, head = [sum([prod(p.shape) for p in u]) for u in _unit_params(model, 1)]
            return titan_peak.pp_peak(model, lay, stages[s], s, _stage_sharded(model, ds, P, s), kept, grads,
                                      emb, block, head, getattr(fw, "activation_checkpoint", "none"))

        st.peak = peak
        return st

    pl = _placement(model, lay, grid, lambda s: _stage_sharded(model, ds, P, s), _heaviest_stage(model, ds, P, views),
                    state)
    pl.notes.extend(titan_peak.notes(lay, fw))
    return pl


def _stage_sharded(model: ModelShape, ds: int, P: int, s: int) -> _Sharded:
    """_Sharded of stage s's modules (_sharded_part of its kind: cached, once per kind)."""
    kinds, _, kind_of = _stage_kinds(model.layers, P)
    return _sharded_part(model, 1, ds, *kinds[kind_of[s]])


def _pp_parts(model: ModelShape, ds: int, P: int, s: int, k: int, views_norm_rs: bool) -> list[tuple[str, str, int]]:
    """_state_parts of stage s's shard rank k; views_norm_rs: num_microbatches >= 2."""
    stage = pp_stages(model.layers, P)[s]
    sh = _stage_sharded(model, ds, P, s)
    out = _state_parts(model, sh, k, ds, layers=stage[2])
    if stage[3] and views_norm_rs:
        # trainer.py zero_grad(set_to_none=True) (disable_cuda_graphs, which PP needs): the
        # step's first reduce-scatter of a param makes its .grad a view of that output
        # (_fsdp_collectives.py foreach_reduce, storage_offset into the flat output), later
        # ones accumulate. The norm's first is micro-batch 1's [norm, lm_head] reduce-scatter
        # (_pp_comm), so its grad keeps that whole output alive: lm_head's padded shard twice
        out.append(("grads_bytes", "norm grad views micro-batch 1's [norm, lm_head] reduce-scatter output",
                    sh.lm_full // ds * F32))
    return out


@lru_cache(maxsize=256)
def _heaviest_stage(model: ModelShape, ds: int, P: int, views_norm_rs: bool) -> int:
    """The first stage of the most-loaded kind, summed from its shard rank 0's parts (max: the first
    stage on ties). Cached: the layouts of one (dp_shard, pp) share it, whatever their micro-batches."""
    load = {s: sum([b for _, _, b in _pp_parts(model, ds, P, s, 0, views_norm_rs)])
            for s in _stage_kinds(model.layers, P)[1]}
    return max(load, key=load.get)


def _pp_comm(model: ModelShape, lay: Layout, sh: _Sharded, stage: tuple[bool, int, int, bool], s: int,
             first: bool, grid: Grid | None = None) -> list[Comm]:
    """One optimizer step of pipeline stage s under 1F1B (torch pipelining/schedules.py
    Schedule1F1B, stage.py), FSDP over dp_shard; first: step 0 (the schedule's one-time set-up)."""
    has_emb, _, L, has_head = stage
    ds, P, n = lay.dp_shard, lay.pp, lay.num_microbatches
    fsdp = _mesh_labels(grid or lay.grid)[0]
    emb, layer, head = sh.emb_full, sh.layer_full, sh.norm_full + sh.lm_full
    acc = CommBuilder()
    # fsdp.py get_fsdp_reshard_after_forward_policy: with PP "default" (and "never") is False for
    # tok_embeddings and the blocks; [norm, lm_head] gets reshard_after_forward == "always" = False.
    # stage.py backward_maybe_with_nosync sets reshard_after_backward(False) and
    # requires_gradient_sync(False) on every micro-batch's backward; perform_reduce_grad (after the
    # last one) runs post_backward on every group: one reduce-scatter per unit, reshard. So each
    # unit gathers once per step, in its first forward. (full numel, calls, what)
    gathers = [(emb, has_emb, "forward unshard (once per step)"), (layer, L, "forward unshard (once per step)")]
    scatters = [(layer, L, "layer grads (perform_reduce_grad)"),
                (emb, has_emb, "tok_embeddings grad (perform_reduce_grad)")]
    if has_head:
        # the last stage runs F0 B0 F1 B1 ...; components/loss.py ChunkedLossWrapper (the stage's
        # loss_fn) leaves [norm, lm_head] with reshard_after_forward(True) and reshards it after
        # its chunks: F0's norm gathers it; every micro-batch's loss unshards it again (wrapper)
        # and its backward through the norm gathers it once more (left unsharded for the next
        # forward by reshard_after_backward(False))
        gathers += [(head, 1, "[norm, lm_head]: F0 norm forward"),
                    (head, n, "[norm, lm_head]: ChunkedLossWrapper unshard, per micro-batch"),
                    (head, n, "[norm, lm_head]: norm backward, per micro-batch")]
        # the wrapper's last chunk syncs lm_head (set_requires_gradient_sync(True, recurse=False)):
        # micro-batch 0 reduces lm_head's grad alone, later ones lm_head + the norm grad the previous
        # backward accumulated; perform_reduce_grad reduces the last norm grad
        scatters += [(sh.lm_full, 1, "lm_head grad (micro-batch 0, last chunk)"),
                     (head, n - 1, "lm_head + accumulated norm grad (later micro-batches, last chunk)"),
                     (sh.norm_full, 1, "norm grad (perform_reduce_grad)")]
    # P2P (stage.py get_fwd_send_ops / get_bwd_send_ops, dist.isend/irecv on the pp group): one
    # activation forward and one grad backward per micro-batch, each a [mbs, seq, hidden] bf16 tensor
    act = lay.micro_batch_size * model.seq_len * model.hidden * BF16
    after, before = s < P - 1, s > 0  # a next stage, a previous one
    acc.add_p2p("pp", act, act, "bf16", "activation send / grad recv, per micro-batch", n * after)
    acc.add_p2p("pp", act, act, "bf16", "activation recv / grad send, per micro-batch", n * before)
    if first:
        # schedules.py _initialize_pp_stages, step 0 only: _warmup_p2p's vote (stage.py
        # _warmup_forward_vote / _warmup_backward_result: one int32 forward, one back, per neighbour)
        acc.add_p2p("pp", 4, 4, "int32", "P2P warm-up vote", after + before)
        # ... metadata inference: _StageForwardMeta sent forward, _StageBackwardMeta back
        # (send_object_list: an int64 size, then the pickle as uint8)
        fwd, bwd = _pp_meta_bytes(lay.micro_batch_size, model.seq_len, model.hidden)
        acc.add_p2p("pp", 8, 8, "int64", "metadata sizes", after + before)
        acc.add_p2p("pp", fwd, bwd, "uint8", "forward / backward metadata", after)
        acc.add_p2p("pp", bwd, fwd, "uint8", "forward / backward metadata", before)
        # the inference runs the stage forward on real tensors: every unit gathers (then
        # _post_metadata_inference_cleanup reshards); the last stage's backward inference calls the
        # loss (the wrapper: lm_head's grad reduced at its last chunk, the group resharded) and
        # autograd.grad through the norm (gathers [norm, lm_head] again)
        gathers += [(emb, has_emb, "metadata inference forward"), (layer, L, "metadata inference forward")]
        if has_head:
            gathers += [(head, 1, "metadata inference forward"), (head, 1, "metadata inference: norm backward")]
            scatters.append((sh.lm_full, 1, "metadata inference: ChunkedLossWrapper lm_head grad"))
    acc.add_several(fsdp, "all_gather", "bf16", ds, [(f * BF16, c, w) for f, c, w in gathers])
    acc.add_several(fsdp, "reduce_scatter", "fp32", ds, [(f * F32, c, w) for f, c, w in scatters])
    # distributed/utils.py clip_grad_norm_: the stage's stacked per-param norms over fsdp, then the
    # total norm (** norm_type) all-reduced over pp
    acc.add(fsdp, "all_reduce", sh.n_params * F32, ds, "fp32", 1, "grad-norm (stacked per-param norms)")
    acc.add("pp", "all_reduce", F32, P, "fp32", 1, "grad-norm total over pp")
    # trainer.py train_step: valid tokens on the batch mesh, loss sum / max and ntokens_seen on
    # the loss mesh (both dp_shard here; pp is in neither)
    acc.add(fsdp, "all_reduce", 8, ds, "int64", 2, "valid tokens, ntokens_seen")
    acc.add(fsdp, "all_reduce", 4, ds, "fp32", 2, "loss sum, loss max")
    return acc.build()
