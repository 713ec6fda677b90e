"""torchtitan 0.3.0's parameters as FSDP2 shards them (torch 2.13 _fully_shard), per TP rank.

The params are the ModelShape's as launchers/titan.py builds them (as_built: llama3 or qwen3 layers, untied
lm_head, wq/wk/wv or one wqkv as framework.fuse_qkv says); their TP-local shapes follow models/common/decoder_sharding.py's plan as DTensor splits it
(torch.chunk rows, placement_types.py Shard._split_tensor); FSDP2 shards each on dim 0, padded to
ceil(d0/ds) rows per rank (_fsdp_param.py _init_sharded_param), in the units of distributed/fsdp.py
apply_fsdp_to_decoder. Sharded is what a model part's state and FSDP collectives need, summed per unit
group (_groups) and cached per (model, tp, shard degree).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from math import prod
from typing import NamedTuple

from ledger.model import ModelShape
from ledger.units import ceil_div


def fuses_qkv(fw) -> bool:
    """framework.fuse_qkv; unset, torchtitan's default (conf/schema.py TitanConfig: fused)."""
    return bool(getattr(fw, "fuse_qkv", True))


def as_built(model: ModelShape, fw) -> ModelShape:
    """The model as launchers/titan.py builds it: its q / k / v projections one wqkv parameter where
    framework.fuse_qkv is set (models/common/config_utils.py make_gqa_config: FusedQKVLinear), three
    otherwise (ModelShape.fused_qkv: what FSDP2 shards and pads, the optimizer's per-param state)."""
    fused = fuses_qkv(fw)
    return model if model.fused_qkv == fused else dataclasses.replace(model, fused_qkv=fused)


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
    return (*shape[:dim], rows_of(shape[dim], tp, t), *shape[dim + 1:])


def _tp_local(name: str, shape: tuple[int, ...], tp: int, t: int = 0) -> tuple[int, ...]:
    return _shard_tp(shape, _tp_dim(name, shape), tp, t)


def _ps(items, tp: int, t: int = 0) -> tuple[Param, ...]:
    return tuple(Param(n, _tp_local(n, s, tp, t)) for n, s in items)


def units(model: ModelShape, tp: int, t: int = 0) -> list[tuple[str, tuple[Param, ...]]]:
    """FSDP units of distributed/fsdp.py apply_fsdp_to_decoder (untied): tok_embeddings, one per
    TransformerBlock, [norm, lm_head] together; the root fully_shard(model) is left with none (TP rank t's)."""
    emb, block, head = unit_params(model, tp, t)
    return [("tok_embeddings", emb),
            *((f"layers.{i}", block if i == 0 else _ps(model.layer_params(i), tp)) for i in range(model.layers)),
            ("norm+lm_head", head)]


@lru_cache(maxsize=64)
def _unit_items(model: ModelShape) -> tuple[tuple, tuple, tuple]:
    """The unsharded (name, shape) of units()' tok_embeddings, one TransformerBlock, [norm,
    lm_head]: a model's, whatever its tp (a search asks for many tp)."""
    return ((("tok_embeddings.weight", (model.vocab, model.hidden)),), tuple(model.layer_params(0)),
            (("norm.weight", (model.hidden,)), ("lm_head.weight", (model.vocab, model.hidden))))


def unit_params(model: ModelShape, tp: int, t: int = 0) -> tuple[tuple[Param, ...], tuple[Param, ...],
                                                                 tuple[Param, ...]]:
    """units()' TP-local params of tok_embeddings, one TransformerBlock (ModelShape's blocks are
    alike: layer_params(i) differs from layer 0 by names only), [norm, lm_head]: the per-param
    listing the ledger's group sums (_groups, sharded_part) are tested against."""
    emb, block, head = _unit_items(model)
    return _ps(emb, tp, t), _ps(block, tp, t), _ps(head, tp, t)


def chunk_rows(d0: int, ds: int) -> int:
    """Rows of FSDP2's padded dim-0 shard of a dim 0 of d0 rows (_fsdp_param.py
    _init_sharded_param: torch.chunk size)."""
    return ceil_div(d0, ds)


def rows_of(d0: int, ds: int, k: int) -> int:
    """Rows shard rank k really holds of a dim 0 of d0 rows (_chunk_with_empty: the last chunks may
    be short or empty)."""
    c = chunk_rows(d0, ds)
    return max(0, min(d0 - k * c, c))


def vocab_split_note(vocab: int, tp: int) -> str:
    """The Placement's note where tp does not divide the vocab (each TP rank's rows: _shard_tp)."""
    return (f"titan tp: vocab {vocab} split as torch.chunk over tp={tp} (DTensor Shard(0)): "
            + ", ".join(str(rows_of(vocab, tp, t)) for t in range(tp)) + " rows")


class Sharded(NamedTuple):
    """What the state and the FSDP collectives of one (model, tp, dp_shard) need, in elements."""
    n_params: int
    padded: int  # sum of padded local shards (chunk rows x rest): params and grads
    even: int  # the same over params whose dim 0 splits evenly (every rank holds all its rows)
    uneven: tuple[tuple[int, int], ...]  # (dim 0, summed rest) of the others: rows differ by rank
    emb_full: int  # padded full (all-gather / reduce-scatter) numel per FSDP unit
    norm_full: int
    lm_full: int
    layer_full: int  # the same for one TransformerBlock (every block alike)


def sharded(model: ModelShape, tp: int, ds: int, t: int = 0) -> Sharded:
    return sharded_part(model, tp, ds, True, model.layers, True, t)


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
    at one (tp, shard degree), in elements: what Sharded adds up, per group."""
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
            f = chunk_rows(d0, ds) * ds * rest
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
def sharded_part(model: ModelShape, tp: int, ds: int, has_emb: bool, L: int, has_head: bool,
                 t: int = 0) -> Sharded:
    """Sharded of a model part: tok_embeddings (or not), L TransformerBlocks, [norm, lm_head] (or
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
    return Sharded(n_params, padded, even, tuple(sorted(uneven.items())), emb.full, head.fulls[0], head.fulls[1],
                    block.full)


def block_params(model: ModelShape) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(dense, expert) global shapes of one MoE block (ModelShape.layer_params: the same tensors): the experts
    are an FSDP group of their own under EP (moe.py)."""
    dense, expert = [], []
    for name, shape in model.layer_params(0):
        (expert if ".moe.experts." in name else dense).append(shape)
    return dense, expert
