"""DeepSpeed 0.19.8 ZeRO-3's parameter coordinator (runtime/zero/partitioned_param_coordinator.py),
replayed: which all-gathers one forward + backward makes for any stage3_prefetch_bucket_size /
stage3_max_live_parameters / stage3_max_reuse_distance, over the module hook order of
launchers.llama.Llama (as dumped from the coordinator on a real run). Used by
ledger.faithful.deepspeed for ZeRO-3's collectives; each rule names the DeepSpeed function it follows.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from functools import lru_cache
from typing import NamedTuple

from ledger.model import ModelShape, numel


def _module(param_name: str) -> str:
    """The module a parameter belongs to: its name less the last component."""
    return param_name.rsplit(".", 1)[0]

_ROOT = "ROOT"


class _Z3Trace(NamedTuple):
    """The module tree as the coordinator sees it (static; built per model)."""
    numel: tuple[int, ...]  # per Parameter, ds_id order (= registration: Init numbers params as created)
    persist: tuple[bool, ...]  # ds_persist (ds_numel <= param_persistence_threshold)
    mod_params: tuple[tuple[int, ...], ...]  # per module: iter_params(module, recurse=False), sorted by ds_id
    mod_numel: tuple[int, ...]
    events: tuple[tuple[str, int], ...]  # one forward + backward: F/f forward fetch/release, B/b backward, L leftovers
    order: tuple[int, ...]  # __submodule_order: the module of every fetch (F and B events)
    param_order: tuple[tuple[int, int], ...]  # __param_order: (param, step_id_last_used_at)
    prefix: tuple[int, ...]  # prefix sums of mod_numel along `order` (reuse-distance walk)
    occurs: tuple[tuple[int, ...], ...]  # per param: the steps of `order` whose module lists it


@lru_cache(maxsize=64)
def _z3_trace(model: ModelShape, threshold: int) -> _Z3Trace:
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
    release_backward_leftovers releases them (non-persistent params only)."""
    names = [n for n, _ in model.params()]
    numels = [numel(sh) for _, sh in model.params()]
    index: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        index.setdefault(_module(n), []).append(i)
    if model.tied_embeddings:  # one Parameter in two modules
        index["output"] = index["tok_embeddings"]
    mods: list[str] = []
    at: dict[str, int] = {}

    def m(name: str) -> int:
        if name not in at:
            at[name] = len(mods)
            mods.append(name)
        return at[name]

    ffn_fwd = ("w1", "w3", "w2") if model.swiglu else ("w1", "w2")
    ev: list[tuple[str, int]] = []

    def leaf(kind: str, name: str):
        ev.append((kind, m(name)))
        ev.append((kind.lower(), m(name)))

    ev.append(("F", m(_ROOT)))
    leaf("F", "tok_embeddings")
    for i in range(model.layers):
        b = f"layers.{i}"
        ev.append(("F", m(b)))
        leaf("F", f"{b}.attention_norm")
        ev.append(("F", m(f"{b}.attention")))
        for w in ("wq", "wk", "wv", "wo"):
            leaf("F", f"{b}.attention.{w}")
        ev.append(("f", m(f"{b}.attention")))
        leaf("F", f"{b}.ffn_norm")
        ev.append(("F", m(f"{b}.feed_forward")))
        for w in ffn_fwd:
            leaf("F", f"{b}.feed_forward.{w}")
        ev.append(("f", m(f"{b}.feed_forward")))
        ev.append(("f", m(b)))
    leaf("F", "norm")
    leaf("F", "output")
    ev.append(("f", m(_ROOT)))
    ev.append(("B", m(_ROOT)))
    leaf("B", "output")
    leaf("B", "norm")
    for i in reversed(range(model.layers)):
        b = f"layers.{i}"
        ev.append(("B", m(b)))
        ev.append(("B", m(f"{b}.feed_forward")))
        for w in reversed(ffn_fwd):
            leaf("B", f"{b}.feed_forward.{w}")
        ev.append(("b", m(f"{b}.feed_forward")))
        leaf("B", f"{b}.ffn_norm")
        ev.append(("B", m(f"{b}.attention")))
        for w in ("wo", "wv", "wk", "wq"):
            leaf("B", f"{b}.attention.{w}")
        ev.append(("b", m(f"{b}.attention")))
        leaf("B", f"{b}.attention_norm")
        ev.append(("b", m(b)))
    ev.append(("B", m("tok_embeddings")))
    ev.append(("L", -1))
    mod_params = tuple(tuple(index.get(n, ())) for n in mods)
    mod_numel = tuple(sum(numels[p] for p in ps) for ps in mod_params)
    order = tuple(mo for k, mo in ev if k in "FB")
    # construct_parameter_trace_from_module_trace / record_parameters: each fetched module's params
    # (sorted by ds_id) with the step it was fetched at
    param_order = tuple((p, s) for s, mo in enumerate(order) for p in mod_params[mo])
    prefix = [0]
    for mo in order:
        prefix.append(prefix[-1] + mod_numel[mo])
    occurs: list[list[int]] = [[] for _ in numels]
    for s, mo in enumerate(order):
        for p in mod_params[mo]:
            occurs[p].append(s)
    return _Z3Trace(tuple(numels), tuple(n <= threshold for n in numels), mod_params, mod_numel, tuple(ev), order,
                    param_order, tuple(prefix), tuple(tuple(o) for o in occurs))


class _Z3Sim:
    """partitioned_param_coordinator.py PartitionedParameterCoordinator, replayed over _z3_trace's
    events. A pass is one forward + backward (reset_step at its start); it returns the all-gather
    calls it makes (one all_gather_coalesced per fetch or prefetch with params to gather, keyed by the
    sorted numel of those params) and the params still gathered after it (release_backward_leftovers
    done). Passes after the first complete one are memoized per starting state."""

    def __init__(self, tr: _Z3Trace, prefetch: int, max_live: int, reuse: int):
        self.tr, self.pf, self.ml, self.rd = tr, prefetch, max_live, reuse
        self.release_cache: dict[tuple[int, int], frozenset] = {}  # __params_to_release's lru_cache
        self.memo: dict[frozenset, tuple] = {}

    def _to_release(self, mo: int, step: int, recent) -> frozenset:
        """__params_to_release (lru_cache per (module, step_id): the first complete pass decides): the
        module's non-persistent params, less those the prefetcher marked as used later
        (__most_recent_step_id_param_fetched_for > step_id), less those used again by a module within
        the reuse distance: modules of __submodule_order from step_id on, adding each module's params'
        numel until the sum reaches max_reuse_distance_in_numel."""
        key = (mo, step)
        got = self.release_cache.get(key)
        if got is not None:
            return got
        tr = self.tr
        out = {p for p in tr.mod_params[mo] if not tr.persist[p] and recent[p] <= step}
        if self.rd > 0 and out:
            end = bisect_left(tr.prefix, tr.prefix[step] + self.rd, lo=step)  # modules step..end-1 examined
            for p in list(out):
                occ = tr.occurs[p]
                k = bisect_left(occ, step)
                if k < len(occ) and occ[k] < end:
                    out.discard(p)
        got = self.release_cache[key] = frozenset(out)
        return got

    def run(self, start: frozenset, record: bool = False) -> tuple[Counter, frozenset]:
        """One pass from `start` (params gathered when it begins): its all-gather calls as a Counter of
        sorted numel tuples, and the params gathered after it."""
        if not record and start in self.memo and self.release_cache:
            return self.memo[start]
        tr = self.tr
        numel_, persist, pf, ml = tr.numel, tr.persist, self.pf, self.ml
        never = -10 ** 10
        avail = [False] * len(numel_)
        for p in start:
            avail[p] = True
        # ds_active_sub_modules as a count: a module is fetched once before each release of it
        active = [0] * len(numel_)
        bwd_active: dict[int, None] = {}  # __active_backward_submodules (insertion order)
        calls: Counter = Counter()
        queue = deque(tr.param_order)  # reset_step: __param_queue
        popleft = queue.popleft
        recent = [never] * len(numel_)  # __most_recent_step_id_param_fetched_for
        n_avail = 0  # __n_available_params (reset_step zeroes it, whatever is still gathered)
        step = 0
        to_release = self._to_release
        for kind, mo in tr.events:
            own = tr.mod_params[mo] if mo >= 0 else ()
            if kind == "F" or kind == "B":
                if kind == "B":
                    bwd_active[mo] = None
                todo = []
                for p in own:
                    # _fetch_sub_module_impl: one all_gather_coalesced of the module's unavailable params
                    active[p] += 1
                    if recent[p] < step:
                        todo.append(p)
                need = [p for p in own if not avail[p]]
                if need:
                    calls[tuple(sorted(numel_[p] for p in need))] += 1
                    for p in need:
                        avail[p] = True
                        n_avail += numel_[p]
                if not record:
                    # pop the module's own params off the fetch queue (unless a prefetch already did)
                    if todo:
                        seen = set()
                        while queue and len(seen) < len(todo):
                            p, st = popleft()
                            recent[p] = st
                            seen.add(p)
                        if seen != set(todo):
                            raise RuntimeError("ZeRO-3 trace replay diverged")  # the coordinator raises too
                    if pf > 0:
                        # prefetch: pop the queue until the numel to gather reaches
                        # min(max_live - n_available, prefetch_bucket); available params are skipped
                        cap = min(ml - n_avail, pf)
                        pre: list[int] = []
                        got = 0
                        while queue and got < cap:
                            p, st = popleft()
                            if not avail[p]:
                                avail[p] = True  # in flight: not fetched again, nor twice in this call
                                pre.append(p)
                                got += numel_[p]
                            if st > recent[p]:
                                recent[p] = st
                        if got:
                            calls[tuple(sorted(numel_[p] for p in pre))] += 1
                            n_avail += got
                step += 1
            elif kind == "f" or kind == "b":
                if kind == "b":
                    bwd_active.pop(mo, None)
                if not own:
                    continue
                # release_sub_module: every own param outside a complete trace (recording: persistent too)
                rel = own if record else to_release(mo, step, recent)
                for p in own:
                    active[p] -= 1
                    if not active[p] and avail[p] and p in rel:  # __release_param
                        avail[p] = False
                        n_avail -= numel_[p]
            else:  # release_backward_leftovers: drain the backward stack, non-persistent params only
                while bwd_active:
                    mo, _ = bwd_active.popitem()
                    for p in tr.mod_params[mo]:
                        active[p] -= 1
                        if not active[p] and not persist[p] and avail[p]:
                            avail[p] = False
                            n_avail -= numel_[p]
        out = (calls, frozenset(p for p, a in enumerate(avail) if a))
        if not record:
            self.memo[start] = out
        return out


@lru_cache(maxsize=64)
def _z3_record(model: ModelShape, threshold: int) -> tuple[Counter, frozenset]:
    """Step 0's recording pass (trace RECORD: no prefetch, every own param released), which starts
    with nothing gathered (persistent params are first gathered by step 0's _post_step)."""
    tr = _z3_trace(model, threshold)
    return _Z3Sim(tr, 0, 0, 0).run(frozenset(), record=True)


@lru_cache(maxsize=128)
def _z3_sim(model: ModelShape, threshold: int, prefetch: int, max_live: int, reuse: int, accumulate: bool) -> _Z3Sim:
    """A coordinator whose __params_to_release cache is filled by the first complete pass, as in a real
    run: with gradient accumulation that pass is step 0's micro-batch 1, which starts with nothing
    gathered (the recording pass released every param, persistent ones too); with one micro-batch it is
    step 1's, which starts with the persistent params gathered by step 0's _post_step."""
    tr = _z3_trace(model, threshold)
    sim = _Z3Sim(tr, prefetch, max_live, reuse)
    sim.run(_z3_record(model, threshold)[1] if accumulate else _z3_persistent(tr))
    return sim


def _z3_persistent(tr: _Z3Trace) -> frozenset:
    return frozenset(p for p, k in enumerate(tr.persist) if k)


def _z3_passes(sim: _Z3Sim, start: frozenset, k: int) -> Counter:
    """All-gather calls (as sorted numel tuples) of k consecutive passes inside one optimizer step,
    the first from `start`: between micro-batches nothing is released besides what the coordinator
    released (step() is not at the boundary), so each pass starts from what the last one left."""
    out: Counter = Counter()
    for i in range(k):
        calls, end = sim.run(start)
        left = k - i if end == start else 1  # a fixed point: the remaining passes repeat this one
        for c, n in calls.items():
            out[c] += n * left
        if left > 1:
            break
        start = end
    return out


@lru_cache(maxsize=256)
def _z3_fetches(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int):
    """The coordinator's all-gather calls per optimizer step, dp-independent (numel tuples):
    (recording pass, the rest of step 0 [m > 1], steady step, step 1 [m == 1])."""
    tr = _z3_trace(model, threshold)
    record, after_record = _z3_record(model, threshold)
    sim = _z3_sim(model, threshold, prefetch, max_live, reuse, m > 1)
    steady = _z3_passes(sim, _z3_persistent(tr), m)
    if m == 1:
        return record, Counter(), steady
    return record, _z3_passes(sim, after_record, m - 1), steady
