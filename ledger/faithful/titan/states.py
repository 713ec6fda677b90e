"""Faithful torchtitan 0.3.0 ledger (torch 2.13 FSDP2, partial_dtensor backend), per rank per step: what
it checks of a dense model and layout (check) and its placement (place; with pipeline parallelism
pp.py's place_pp).

Every rule names the source it follows. Shapes are the ModelShape's, built as launchers/titan.py
builds them (llama3 layers, untied lm_head, wq/wk/wv or one wqkv (fsdp.as_built), rope cache sized to seq_len).

Meshes (distributed/parallel_dims.py build_mesh, legacy spmd backend): FSDP shards over "fsdp" =
dp_shard x cp; the batch mesh is dp_replicate x dp_shard, the loss mesh batch x cp. The grid
(ledger/grid.py: tp, cp, dp, dp_replicate, pp) is torchtitan's mesh order, so a rank's FSDP shard
index is dp * cp + cp and a group over cp and dp_shard is dim "cp-dp".

The package: the params and their FSDP2 shards (fsdp.py), a step's collectives (comm.py) with DTensor's
mm backward (dtensor.py), a rank's resident state and the Placement over ranks (ranks.py), pipeline
parallelism (pp.py), the peak within a step (peak.py, pp_peak.py), MoE (moe.py).
"""
from __future__ import annotations

from functools import lru_cache
from math import prod
from operator import attrgetter

from ledger.faithful.titan import peak as titan_peak
from ledger.faithful.titan.comm import first_step, lm_head_regathers, mesh_labels, step_comm
from ledger.faithful.titan.dtensor import layer_backward_comm
from ledger.faithful.titan.fsdp import as_built, sharded, unit_params, vocab_split_note
from ledger.faithful.titan.pp import place_pp
from ledger.faithful.titan.ranks import build_state, placement, state_parts
from ledger.faithful.titan.rules import CP_BLOCK
from ledger.faithful.titan.target import Rules, rules_of
from ledger.grid import Grid
from ledger.layout import ConfigError, Layout
from ledger.model import ModelShape
from ledger.placement import Placement, RankState
from ledger.target import CPU_GLOO


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
    if model.qkv_bias:
        raise ConfigError("titan: model.qkv_bias=true: torchtitan 0.3.0's llama3 and qwen3 attention have no q/k/v "
                          "biases (Qwen2's); Megatron (--add-qkv-bias) and DeepSpeed's Llama model them")
    if model.tied_embeddings:
        raise ConfigError("titan: tied_embeddings=true is not modelled (separate FSDP grouping)")


# the framework settings the faithful ledger models (the field, its one modelled value): read in
# place() as one tuple
_MODELLED = ("dtype", "mixed_precision_param", "mixed_precision_reduce", "spmd_backend")
_MODELLED_VALUES = ("float32", "bfloat16", "float32", "partial_dtensor")
_modelled_of = attrgetter(*_MODELLED)


def place(model: ModelShape, lay: Layout, fw, target: str | None = None) -> Placement:
    """The Placement of a dense model; target: the run its peak is for (ledger/target.py; None: cpu-gloo)."""
    check(model, lay)
    model = as_built(model, fw)
    target = target or CPU_GLOO
    rules = rules_of(target)
    if _modelled_of(fw) != _MODELLED_VALUES:
        for field, want in zip(_MODELLED, _MODELLED_VALUES):
            if getattr(fw, field) != want:
                raise ConfigError(f"titan: framework.{field}={getattr(fw, field)!r}: the faithful ledger models "
                                  f"{want!r}")
    if lay.pp > 1:
        pl = place_pp(model, lay, fw, rules)
        pl.target = target
        if target != CPU_GLOO:
            pl.notes.extend(titan_peak.notes(lay, fw, rules))
        return pl
    grid: Grid = lay.grid
    ds = lay.dp_shard * lay.cp  # the FSDP shard degree: parallel_dims.py "fsdp" = dp_shard x cp
    if model.vocab % lay.tp:
        pl = _place_uneven_vocab(model, lay, fw, grid, ds, rules)
    else:
        pl = _place_tp_rank(model, lay, fw, grid, ds, 0, rules)
    pl.target = target
    return pl


def _place_uneven_vocab(model: ModelShape, lay: Layout, fw, grid: Grid, ds: int, rules: Rules) -> Placement:
    """A vocab tp does not divide: DTensor's Shard(0) gives TP rank t its torch.chunk rows of
    tok_embeddings and lm_head (_shard_tp), so each TP rank's FSDP shards, state and FSDP
    collectives are its own (_place_tp_rank of each); the TP collectives move [tokens, hidden] and
    per-token values, no vocab rows. TP rank 0 holds the most rows: its representative is the most
    loaded."""
    pls = [_place_tp_rank(model, lay, fw, grid, ds, t, rules) for t in range(lay.tp)]
    pl = pls[0]
    states = [p.rank_state for p in pls]
    pl.rank_state = lambda r: states[grid.coords(r)["tp"]](r)
    pl.notes.append(vocab_split_note(model.vocab, lay.tp))
    return pl


def _place_tp_rank(model: ModelShape, lay: Layout, fw, grid: Grid, ds: int, t: int, rules: Rules) -> Placement:
    """place() for the ranks of TP rank t (every rank where tp divides the vocab)."""
    cp = lay.cp
    sh = sharded(model, lay.tp, ds, t)
    # the collectives are the same on every rank (padded full buffers): computed once, on first use
    memo: dict[bool, list] = {}

    def steady_comm():
        if True not in memo:
            memo[True] = step_comm(model, lay, fw, sh, steady=True, grid=grid, cpu_mesh=rules.cpu_mesh)
        return memo[True]

    # the first step differs from steady state only where the loss wrapper's lm_head unshard does
    # (lm_head_regathers): derived from the steady list on first read (first_step: the same list
    # as step_comm(steady=False), for a fraction of the work); a search never reads it
    def first_comm():  # shared by the states of every rank, like the steady list
        if False not in memo:
            memo[False] = first_step(steady_comm(), sh, ds, mesh_labels(grid)[0])
        return memo[False]

    first = first_comm if ds > 1 and lm_head_regathers(fw, True) != lm_head_regathers(fw, False) else None

    def state(s: int, k: int) -> RankState:
        st = build_state(state_parts(model, sh, k, ds), steady_comm, first)
        resident = st.params_bytes + st.grads_bytes + st.optim_bytes + st.other_bytes

        def peak():  # ledger/faithful/titan/peak.py
            emb, block, head = unit_params(model, lay.tp, t)
            return titan_peak.peak(model, lay, fw, sh, resident, *[sum([prod(p.shape) for p in u])
                                                                   for u in (block, emb, head)], rules=rules,
                                   first=titan_peak.FirstStep(st.optim_bytes, st.grads_bytes))

        st.peak = peak
        return st

    pl = placement(model, lay, grid, lambda s: sh, 0, state)
    pl.notes.extend(titan_peak.notes(lay, fw, rules))
    if lay.tp > 1:
        T = lay.micro_batch_size * model.seq_len // cp
        _, gaps, priced = layer_backward_comm(model, T, lay.tp, bool(lay.sequence_parallel), rules.cpu_mesh)
        if priced:
            pl.notes.append("titan tp: mm-backward strategies are priced with DTensor's cost model for one device "
                            "per host (cpu); on cuda with tp <= GPUs per host its intra-host numbers apply and a "
                            "choice may differ (DEVICES_PER_HOST)")
        for gap in gaps:
            pl.notes.append(f"titan tp: {gap}; collectives past that point are not predicted")
        if not lay.sequence_parallel:
            pl.notes.append("titan peak, TP without SP: a block's own backward moments are the peak's candidates, "
                            "SwiGLU's (where DTensor leaves w2's input grad Partial, its two reduce-scatters hold "
                            "both full-size Partial grads: peak.swiglu_backward) and ffn_norm's (w2's weight grad, "
                            "Partial where DTensor leaves it so, beside the norm's fp32 temporaries); measured at "
                            "tp4, hidden 640, ffn 1792, T 640 within 5,128 B and tp4·cp2, hidden 1024, ffn 2816, T 512 "
                            "a rank within 15,864 B, where the buffers of DTensor's Shard -> Shard moves inside w2's "
                            "mm backward stay under them")
    return pl
