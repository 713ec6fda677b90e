"""DeepSpeed 0.19.8 ZeRO-3's module hook trace: the order in which parameter_offload.py's hooks fetch and
release the modules of launchers.llama.Llama in one forward + backward (as dumped from the parameter
coordinator, runtime/zero/partitioned_param_coordinator.py fetch_sub_module / release_sub_module, on a
real run), with the parameter trace the coordinator records from it (__submodule_order, __param_order:
construct_parameter_trace_from_module_trace / record_parameters). Built once per model and persistence
threshold; the coordinator replay (coordinator.py) and the gathered-memory walk (gathered.py) read it.
"""
from __future__ import annotations

from array import array
from functools import lru_cache
from itertools import accumulate, chain
from typing import NamedTuple

import numpy as np

from ledger.model import ModelShape, numel


def _module(param_name: str) -> str:
    """The module a parameter belongs to: its name less the last component."""
    return param_name.rsplit(".", 1)[0]


@lru_cache(maxsize=64)
def block_params(model: ModelShape) -> tuple[tuple[str, int], ...]:
    """One block's params as (module within the block, numel), registration order; every block is the
    same, so per-block sums times `layers` replace walks over all parameters."""
    return tuple((_module(n).split(".", 2)[2], numel(sh)) for n, sh in model.layer_params(0))



class _Period(NamedTuple):
    """One direction's run of identical decoder blocks in the event sequence (forward: layers 0..L-1,
    backward: L-1..0). The r-th block of the run starts at event e0 + r*E, step step0 + r*S and
    __param_queue position q0 + r*Q; its modules are block 0's plus r*dM, its params (nb of them,
    contiguous in ds_id order) start at p_lo + r*dP."""
    e0: int
    E: int
    step0: int
    S: int
    q0: int
    Q: int
    dM: int
    dP: int
    p_lo: int
    releases: tuple[tuple[int, int], ...]  # block 0's release_sub_module calls of modules with params: (module, step)


class Z3Trace(NamedTuple):
    """The module tree as the coordinator sees it (static; built per model)."""
    numel: list[int]  # per Parameter, ds_id order (= registration: Init numbers params as created)
    persist: list[bool]  # ds_persist (ds_numel <= param_persistence_threshold)
    persistent: frozenset  # the ds_persist params
    mod_params: list  # per module: iter_params(module, recurse=False), sorted by ds_id
    kinds: str  # one forward + backward, per event: F/f forward fetch/release, B/b backward, L leftovers
    mods: array  # int64 (as qp, qs, prefix; _tile), per event: its module (-1 for L)
    steps: int  # fetches (F and B events) per pass: the length of __submodule_order
    qp: array  # __param_order: the params (qs: step_id_last_used_at of each)
    qs: array
    prefix: array  # prefix sums of the fetched modules' numel along `order` (reuse-distance walk)
    qstart: array  # per step (and two past the last): where its params start in __param_order
    layers: int
    nb: int  # params per block
    periods: tuple[_Period, _Period]  # forward and backward runs of blocks
    block_modules: tuple[str, ...]  # a block's modules by local number ("" the block itself, "attention.wq")

    @property
    def order(self) -> list[int]:
        """__submodule_order: the module of every fetch."""
        return [mo for k, mo in zip(self.kinds, self.mods) if k == "F" or k == "B"]

    @property
    def events(self) -> list[tuple[str, int]]:
        return list(zip(self.kinds, self.mods))

    @property
    def param_order(self) -> list[tuple[int, int]]:
        return list(zip(self.qp, self.qs))


def _tile(tmpl, n: int, stride: int, first: int, base: int = 0) -> array:
    """tmpl repeated for blocks first, first+1.. (n of them; stride < 0: first, first-1..), each copy
    plus base + block * stride. An int64 array: copied from numpy's buffer (a list would cost a Python
    int per element, most of the trace's build time)."""
    if not tmpl or not n:
        return array("q")
    start = base + first * abs(stride)
    rows = np.arange(start, start + n * stride, stride, dtype=np.int64) if stride else np.full(n, start, np.int64)
    return array("q", np.add.outer(rows, np.array(tmpl, np.int64)).tobytes())


def _block_hooks(model: ModelShape) -> tuple[dict[str, int], list[tuple[str, int]], list[tuple[str, int]]]:
    """One decoder block's hook events (z3_trace) by the block's own module numbers: (those numbers by
    module name, the forward's events, the backward's). F / f: a module's pre-forward fetch and its
    forward hook's release; B / b: its pre-backward fetch and its post-backward release."""
    # one block's modules, numbered as first fetched ("" is the block itself)
    local: dict[str, int] = {}

    def m(name: str) -> int:
        return local.setdefault(name, len(local))

    ffn_fwd = ("w1", "w3", "w2") if model.swiglu else ("w1", "w2")
    fwd: list[tuple[str, int]] = []

    def leaf(name: str):  # a module without children: its pre-forward (F) and forward (f) hooks
        fwd.append(("F", m(name)))
        fwd.append(("f", m(name)))

    fwd.append(("F", m("")))
    leaf("attention_norm")
    fwd.append(("F", m("attention")))
    for w in ("wq", "wk", "wv", "wo"):
        leaf(f"attention.{w}")
    fwd.append(("f", m("attention")))
    leaf("ffn_norm")
    fwd.append(("F", m("feed_forward")))
    for w in ffn_fwd:
        leaf(f"feed_forward.{w}")
    fwd.append(("f", m("feed_forward")))
    fwd.append(("f", m("")))
    # backward hooks fire in the reverse order of the forward ones: each module's pre-backward (B)
    # where its forward ended (f), its post-backward (b) where its forward began (F)
    bwd = [({"F": "b", "f": "B"}[kind], mod) for kind, mod in reversed(fwd)]
    return local, fwd, bwd


@lru_cache(maxsize=64)
def z3_trace(model: ModelShape, threshold: int, ac: bool = False) -> Z3Trace:
    """The hook order of launchers.llama.Llama under parameter_offload.py's hooks, as dumped from the
    coordinator (fetch_sub_module / release_sub_module) on a real run:

    forward: _pre_forward_module_hook fetches each module before its forward (pre-order), the
    forward hook releases it after (post-order): root, embedding, per block (block, attention_norm,
    attention, wq, wk, wv, wo, ffn_norm, feed_forward, w1, w3, w2), final norm, output.
    backward: PreBackwardFunctionForModule on a module's outputs fetches it when the output's
    gradient arrives, PostBackwardFunctionModule on its inputs releases it once the inputs' gradients
    are computed: root, output, norm, then each block last to first (block, feed_forward, w2, w3, w1
    [each fetched and released in turn], feed_forward released, ffn_norm, attention, wo, wv, wk, wq,
    attention released, attention_norm, block released), embedding. The root's and the embedding's
    inputs (tokens) need no gradient: their post-backward never fires; stage3.py backward_epilogue ->
    release_backward_leftovers releases them (non-persistent params only).

    Modules are numbered as first fetched, params in registration order (embedding, blocks, final
    norm, output); every block is the same, so one block's events are built by name (_block_hooks) and the others
    are the same events offset by the block's module and param numbers.

    ac (activation checkpointing, deepspeed.checkpointing.checkpoint around each block: a reentrant
    CheckpointFunction): the block's forward runs under no_grad, its module hooks fetch and release as
    without it (its outputs need no gradient: no backward hook fires for that forward); the backward of
    the block's checkpoint runs its forward again with grad (the same pre-forward fetches and forward
    releases, now inside the backward) and then its backward: each backward block is the forward's
    events followed by the backward's."""
    L, e = model.layers, model.vocab * model.hidden
    blk = block_params(model)
    blk_mod = [mo for mo, _ in blk]
    blk_numel = [n for _, n in blk]
    nb = len(blk)
    norms = [numel(sh) for _, sh in model.norm_params("norm")]
    numels = [e] + blk_numel * L + norms + ([] if model.tied_embeddings else [e])
    p_norm = 1 + L * nb
    local, fwd, bwd = _block_hooks(model)
    M = len(local)
    local_params = [tuple(j for j, mo in enumerate(blk_mod) if mo == name) for name in local]
    # modules: ROOT 0, tok_embeddings 1, block i's 2 + i*M + j, final norm, output
    ROOT, EMB, NORM, OUT = 0, 1, 2 + L * M, 3 + L * M
    mod_params: list = [()] * (4 + L * M)
    mod_params[EMB] = (0,)
    for j, ps in enumerate(local_params):
        if ps:
            mod_params[2 + j:NORM:M] = list(zip(*(range(1 + q, 1 + q + L * nb, nb) for q in ps)))
    mod_params[NORM] = tuple(range(p_norm, p_norm + len(norms)))
    mod_params[OUT] = (0,) if model.tied_embeddings else (p_norm + len(norms),)  # tied: one Parameter in two modules
    mod_numel = {ROOT: 0, EMB: e, NORM: sum(norms), OUT: e}  # the modules outside the blocks
    # the events in five parts: head, L forward blocks, the middle, L backward blocks (last first), tail
    head = [("F", ROOT), ("F", EMB), ("f", EMB)]
    mid = [("F", NORM), ("f", NORM), ("F", OUT), ("f", OUT), ("f", ROOT), ("B", ROOT), ("B", OUT), ("b", OUT),
           ("B", NORM), ("b", NORM)]
    tail = [("B", EMB), ("L", -1)]

    blk_mod_numel = [sum(blk_numel[q] for q in ps) for ps in local_params]
    kinds: list[str] = []
    mods, qp, qs, prefix, qstart = array("q"), array("q"), array("q"), array("q", [0]), array("q")
    periods: list[_Period] = []
    at = [0, 0]  # steps and numel fetched so far

    def plain(evs):  # a part of the events that does not repeat
        for k, mo in evs:
            kinds.append(k)
            mods.append(mo)
            if k == "F" or k == "B":
                # construct_parameter_trace_from_module_trace / record_parameters: each fetched
                # module's params (sorted by ds_id) with the step it was fetched at
                qstart.append(len(qp))
                qp.extend(mod_params[mo])
                qs.extend([at[0]] * len(mod_params[mo]))
                at[0] += 1
                at[1] += mod_numel[mo]
                prefix.append(at[1])

    def blocks(tmpl, first: int, sign: int):  # L blocks, from `first` on (sign -1: downwards)
        fo = [j for k, j in tmpl if k == "F" or k == "B"]
        tq = [(q, s) for s, j in enumerate(fo) for q in local_params[j]]
        cum = list(accumulate(blk_mod_numel[j] for j in fo))
        rel, s = [], at[0]
        for k, j in tmpl:  # block `first`'s releases of modules with params
            if k == "F" or k == "B":
                s += 1
            elif local_params[j]:
                rel.append((2 + first * M + j, s))
        periods.append(_Period(len(mods), len(tmpl), at[0], len(fo), len(qp), len(tq), sign * M, sign * nb,
                               1 + first * nb, tuple(rel)))
        kinds.append("".join(k for k, _ in tmpl) * L)
        mods.extend(_tile([j for _, j in tmpl], L, sign * M, first, 2))
        qp.extend(_tile([q for q, _ in tq], L, sign * nb, first, 1))
        qs.extend(_tile([s for _, s in tq], L, len(fo), 0, at[0]))
        prefix.extend(_tile(cum, L, cum[-1], 0, at[1]))
        qstart.extend(_tile(list(accumulate((len(local_params[j]) for j in fo[:-1]), initial=0)), L, len(tq), 0,
                            len(qp) - L * len(tq)))
        at[0] += L * len(fo)
        at[1] += L * cum[-1]

    plain(head)
    blocks(fwd, 0, 1)
    plain(mid)
    blocks(fwd + bwd if ac else bwd, L - 1, -1)
    plain(tail)
    qstart.extend([len(qp), len(qp)])  # a reuse-distance walk may end past the last step
    kinds = "".join(kinds)
    blk_persist = [n <= threshold for n in blk_numel]
    persist = [e <= threshold] + blk_persist * L + [n <= threshold for n in numels[p_norm:]]
    persistent = frozenset(chain([0] if persist[0] else [],
                                 _tile([j for j, k in enumerate(blk_persist) if k], L, nb, 0, 1),
                                 [p for p in range(p_norm, len(numels)) if persist[p]]))
    return Z3Trace(numels, persist, persistent, mod_params, kinds, mods, at[0], qp, qs, prefix, qstart, L, nb,
                    tuple(periods), tuple(local))


def backward_module(model: ModelShape, threshold: int, param: str, ac: bool = False) -> int:
    """The module (as z3_trace numbers them) whose pre-backward hook fetches `param` in the backward."""
    tr = z3_trace(model, threshold, ac)
    M = modules_per_block(tr)
    if param.startswith("layers."):
        _, j, rest = param.split(".", 2)
        return 2 + int(j) * M + tr.block_modules.index(_module(rest))
    return {"tok_embeddings": 1, "norm": 2 + tr.layers * M, "output": 3 + tr.layers * M}[_module(param)]


def modules_per_block(tr: Z3Trace) -> int:
    """Modules per block (M of z3_trace): the final norm is module 2 + layers * M."""
    return abs(tr.periods[0].dM)
