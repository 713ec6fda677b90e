"""DeepSpeed 0.19.8 ZeRO-3's parameter coordinator (runtime/zero/partitioned_param_coordinator.py),
replayed: which all-gathers one forward + backward makes for any stage3_prefetch_bucket_size /
stage3_max_live_parameters / stage3_max_reuse_distance, over the module hook order of
launchers.llama.Llama (as dumped from the coordinator on a real run). Used by
ledger.faithful.deepspeed.zero for ZeRO-3's collectives; each rule names the DeepSpeed function it follows.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import Counter, deque
from functools import lru_cache
from itertools import accumulate, chain, compress
from typing import NamedTuple

import numpy as np

from ledger.model import ModelShape, numel


def _module(param_name: str) -> str:
    """The module a parameter belongs to: its name less the last component."""
    return param_name.rsplit(".", 1)[0]


@lru_cache(maxsize=64)
def _block(model: ModelShape) -> tuple[tuple[str, int], ...]:
    """One block's params as (module within the block, numel), registration order; every block is the
    same, so per-block sums times `layers` replace walks over all parameters."""
    return tuple((_module(n).split(".", 2)[2], numel(sh)) for n, sh in model.layer_params(0))


_INF = float("inf")  # exact against ints


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


class _Z3Trace(NamedTuple):
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
    release_backward_leftovers releases them (non-persistent params only).

    Modules are numbered as first fetched, params in registration order (embedding, blocks, final
    norm, output); every block is the same, so one block's events are built by name and the others
    are the same events offset by the block's module and param numbers."""
    L, e = model.layers, model.vocab * model.hidden
    blk = _block(model)
    blk_mod = [mo for mo, _ in blk]
    blk_numel = [n for _, n in blk]
    nb = len(blk)
    norms = [numel(sh) for _, sh in model.norm_params("norm")]
    numels = [e] + blk_numel * L + norms + ([] if model.tied_embeddings else [e])
    p_norm = 1 + L * nb
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
    blocks(bwd, L - 1, -1)
    plain(tail)
    qstart.extend([len(qp), len(qp)])  # a reuse-distance walk may end past the last step
    kinds = "".join(kinds)
    blk_persist = [n <= threshold for n in blk_numel]
    persist = [e <= threshold] + blk_persist * L + [n <= threshold for n in numels[p_norm:]]
    persistent = frozenset(chain([0] if persist[0] else [],
                                 _tile([j for j, k in enumerate(blk_persist) if k], L, nb, 0, 1),
                                 [p for p in range(p_norm, len(numels)) if persist[p]]))
    return _Z3Trace(numels, persist, persistent, mod_params, kinds, mods, at[0], qp, qs, prefix, qstart, L, nb,
                    tuple(periods), tuple(local))


def _unmarked(own: tuple[int, ...], persist: list[bool], recent: list[int], step: int) -> tuple[int, ...]:
    """The params of a module __params_to_release starts from at step_id `step`: its non-persistent
    ones the prefetcher has not marked as used later (__most_recent_step_id_param_fetched_for > step_id),
    in ds_id order (own itself when that is all of them: one param, most modules)."""
    if len(own) == 1:
        return own if not persist[own[0]] and recent[own[0]] <= step else ()
    return tuple([p for p in own if not persist[p] and recent[p] <= step])


class _Caps:
    """The caps of a stretch of prefetches, min(max_live - n_avail, prefetch_bucket): the most n_avail of
    those capped at the prefetch bucket, the least of those capped at nothing (max_live reached),
    whether one was capped in between (its cap then moves with n_avail)."""

    def __init__(self):
        self.full_hi, self.none_lo, self.mid = -_INF, _INF, False

    def add(self, full_hi, none_lo, mid: bool, drift: int = 0, k: int = 1):
        """A block's (full_hi, none_lo, mid), repeated k times with n_avail moved by drift, 2*drift ..
        k*drift (k = 1, drift = 0: the block itself)."""
        lo, hi = sorted((drift, k * drift))
        self.full_hi = max(self.full_hi, full_hi + hi)
        self.none_lo = min(self.none_lo, none_lo + lo)
        self.mid = self.mid or mid

    def same(self, drift: int, prefetch: int, max_live: int) -> bool:
        """Whether every cap stays what it was with n_avail moved by drift."""
        return not drift or not self.mid and self.full_hi + drift <= max_live - prefetch and \
            self.none_lo + drift >= max_live


class _Z3Sim:
    """partitioned_param_coordinator.py PartitionedParameterCoordinator, replayed over _z3_trace's
    events. A pass is one forward + backward (reset_step at its start); it returns the all-gather
    calls it makes (one all_gather_coalesced per fetch or prefetch with params to gather, keyed by the
    sorted numel of those params) and the params still gathered after it (release_backward_leftovers
    done). Passes after the first complete one are memoized per starting state.

    periodic: skip whole blocks once the replay repeats itself (_skip), and take a later pass's
    backward from the first complete pass's where their states agree (run); False replays every event
    (the reference the fast path is tested against)."""

    def __init__(self, tr: _Z3Trace, prefetch: int, max_live: int, reuse: int, periodic: bool = True):
        self.tr, self.pf, self.ml, self.rd = tr, prefetch, max_live, reuse
        self.periodic = periodic
        # __params_to_release's lru_cache; its sets as tuples in ds_id order (a module's params, filtered or
        # shifted: the order is kept, so tuples are equal when the sets are; cheaper to build than sets)
        self.release_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        # per release_cache key: the module's params the prefetcher had not marked as used later, the
        # one input of the cached value a pass's state decides (the reuse window is the key's own)
        self.unmarked: dict[tuple[int, int], tuple[int, ...]] = {}
        # per memo key: whether that pass is the pass a fresh coordinator's first complete pass from the
        # same start would make (every cache entry it read is what that pass would compute: run, _skip)
        self.as_first: dict[frozenset, bool] = {}
        # the cache of blocks the first pass skipped, kept as a rule: (run, r0, r1): blocks r0+1..r1's
        # entries are block r0's shifted (_cached)
        self.rules: list[tuple[int, int, int]] = []
        self.memo: dict[frozenset, tuple] = {}
        # the first complete pass's backward, by its state where the backward run starts (q, avail: run):
        # its all-gather calls from there on, the params gathered at its end, n_avail there and its
        # prefetches' caps from there on (_Caps)
        self.backward: dict[tuple, tuple[Counter, frozenset, int, _Caps]] = {}
        self.end_hi = 0  # the furthest step a reuse-distance walk examined (the fast path's horizon)

    def _to_release(self, mo: int, step: int, recent, skipped: bool = True) -> tuple[int, ...]:
        """__params_to_release (lru_cache per (module, step_id): the first complete pass decides): the
        module's non-persistent params, less those the prefetcher marked as used later
        (__most_recent_step_id_param_fetched_for > step_id), less those used again by a module within
        the reuse distance: modules of __submodule_order from step_id on, adding each module's params'
        numel until the sum reaches max_reuse_distance_in_numel. skipped: whether the key may be a
        block the first pass skipped (its rules then hold it); the first pass itself never asks for
        one (the blocks it skips it does not walk again)."""
        key = (mo, step)
        got = self.release_cache.get(key)
        if got is not None or skipped and self.rules and (got := self._cached(key)) is not None:
            return got
        tr = self.tr
        got = self.unmarked[key] = out = _unmarked(tr.mod_params[mo], tr.persist, recent, step)
        if out and self.rd > 0:
            prefix = tr.prefix
            end = bisect_left(prefix, prefix[step] + self.rd, lo=step)  # modules step..end-1 examined
            if end > self.end_hi:
                self.end_hi = end
            # the params of modules step..end-1: a run of __param_order (its steps ascend)
            used = tr.qp[tr.qstart[step]:tr.qstart[end]]
            kept = [p for p in out if p not in used]
            if len(kept) < len(out):
                got = tuple(kept)
        self.release_cache[key] = got
        return got

    @staticmethod
    def _shift(ps, by: int) -> tuple[int, ...] | None:
        return None if ps is None else tuple([p + by for p in ps])

    def _cached(self, key: tuple[int, int], table: dict | None = None) -> tuple[int, ...] | None:
        """release_cache[key] (or table[key], table: unmarked), or by a rule: block r1's entry is block
        r0's shifted (the skipped blocks replayed block r0 shifted: so did their unmarked params)."""
        if table is None:
            table = self.release_cache
        got = table.get(key)
        if got is not None:
            return got
        mo, step = key
        for d, r0, r1 in self.rules:
            pr = self.tr.periods[d]
            if not pr.step0 + (r0 + 1) * pr.S < step <= pr.step0 + (r1 + 1) * pr.S:  # block r's releases come
                continue  # at steps step0 + r*S + 1 .. step0 + (r+1)*S
            rr = (step - pr.step0) // pr.S
            for r in (rr, rr - 1):  # a block's last release may come at the next block's first step
                if r0 < r <= r1 and (mo - r * pr.dM, step - r * pr.S) in pr.releases:
                    got = self._shift(table.get((mo - (r - r0) * pr.dM, step - (r - r0) * pr.S)), (r - r0) * pr.dP)
                    if got is not None:
                        table[key] = got
                    return got
        return None

    def run(self, start: frozenset, record: bool = False, watch: list | None = None) -> tuple[Counter, frozenset]:
        """One pass from `start` (params gathered when it begins): its all-gather calls as a Counter of
        sorted numel tuples, and the params gathered after it.

        watch: a list that gets every event of the pass, for the memory walk (z3_forward_live): (kind,
        module, own fetch's params, prefetched params) for a fetch, (kind, module, released params) for
        a release or the leftovers' drain. Only on the event-by-event replay (periodic=False)."""
        if watch is not None and self.periodic:
            raise ValueError("watch needs the event-by-event replay (periodic=False)")
        if not record and watch is None and start in self.memo and self.release_cache:
            return self.memo[start]
        fill = not record and not self.release_cache  # this pass decides __params_to_release
        tr = self.tr
        numel_, persist, pf, ml = tr.numel, tr.persist, self.pf, self.ml
        mod_params, kinds, mods, qp, qs = tr.mod_params, tr.kinds, tr.mods, tr.qp, tr.qs
        nq = len(qp)
        never = -10 ** 10
        avail = [False] * len(numel_)
        for p in start:
            avail[p] = True
        # ds_active_sub_modules as a count: a module is fetched once before each release of it
        active = [0] * len(numel_)
        bwd_active: dict[int, None] = {}  # __active_backward_submodules (insertion order)
        calls: list[tuple[int, ...]] = []  # one entry per all_gather_coalesced
        skipped: Counter = Counter()  # calls of skipped blocks
        q = 0  # reset_step: __param_queue is param_order[q:]
        recent = [never] * len(numel_)  # __most_recent_step_id_param_fetched_for
        n_avail = 0  # __n_available_params (reset_step zeroes it, whatever is still gathered)
        step = 0
        to_release, cache = self._to_release, self.release_cache
        # a pass reading the cache is the first complete pass from its start while every entry it reads
        # is what that pass would compute: cached entries are unmarked params less the key's reuse
        # window, so while the unmarked params it finds are the entry's (here, and in _skip's blocks)
        self._now_first = not fill and not record
        unmarked = self.unmarked
        # the fast path: the next block start is block r of run d, at event nxt (-1: none left, or not
        # periodic); snap: the state at the last block start (_skip)
        periods = tr.periods
        d = r = 0
        nxt = periods[0].e0 if self.periodic else -1
        snap = None
        # this block's prefetches by their cap: the most n_avail of those capped at the prefetch bucket, the
        # least of those capped at nothing (max_live reached), whether one was capped in between
        full_hi, none_lo, mid = -_INF, _INF, False
        e, n_ev = 0, len(kinds)
        # the first complete pass where the backward run starts: (its state, n_avail, calls and skipped
        # calls so far); caps: its prefetches' caps from there on
        half, caps = None, _Caps()
        while e < n_ev:
            if e == nxt:
                if half is not None:
                    caps.add(full_hi, none_lo, mid)
                if d == 1 and r == 0 and not record:
                    # the backward run starts: the state is (q, avail, n_avail), as active, bwd_active and
                    # step follow from the event and recent from q as far as the backward reads it (every
                    # pop sets the popped param's recent to its step, popped in step order; the backward
                    # tells a forward step from `never` nowhere), and n_avail only sets the prefetches' caps. A pass
                    # reading the cache from the first complete pass's state here, or with n_avail moved
                    # by a drift that leaves every cap what it was, makes the rest of that pass: it reads
                    # the entries that pass computed from the same state (so they are also what a first
                    # pass would compute)
                    at = (q, bytes(avail))
                    if fill:
                        half = (at, n_avail, len(calls), skipped.copy())
                    elif (rest := self.backward.get(at)) is not None and \
                            rest[3].same(n_avail - rest[2], self.pf, self.ml):
                        out_calls = Counter(calls)
                        out_calls.update(skipped)
                        out_calls.update(rest[0])
                        out = self.memo[start] = (out_calls, rest[1])
                        self.as_first[start] = self._now_first
                        return out
                if r + 1 < tr.layers:
                    nxt += periods[d].E
                else:
                    nxt = periods[1].e0 if d == 0 else -1
                cur = (d, r, step, q, n_avail, len(calls), avail[:], active[:], tuple(bwd_active), self.end_hi,
                       full_hi, none_lo, mid)
                full_hi, none_lo, mid = -_INF, _INF, False
                jump = self._skip(snap, cur, calls, skipped, fill, record) if snap is not None and snap[0] == d else 0
                if jump:
                    pr = tr.periods[d]
                    if half is not None:  # the skipped blocks' caps: block b's, n_avail moved by 1..jump drifts
                        drift = n_avail - snap[4]
                        caps.add(cur[10], cur[11], cur[12], drift, jump)
                    avail[:] = self._avail
                    n_avail += jump * (n_avail - snap[4])
                    if not record:
                        # the skipped pops, in order (recent: the last one's step), of the blocks after the
                        # skipped ones (the prefetch ran ahead into them): a skipped block's params are not
                        # read again in this run, and the backward (or the next pass) compares their recent
                        # only with its later steps, where a forward step reads as `never`
                        lo, hi = max(q, pr.q0 + (r + jump) * pr.Q), q + jump * pr.Q
                        if lo < hi:
                            deque(map(recent.__setitem__, qp[lo:hi], qs[lo:hi]), maxlen=0)
                        q = hi
                    step += jump * pr.S
                    e += jump * pr.E
                    nxt = periods[1].e0 if d == 0 else -1  # no more skips in this run
                    d, r = d + 1, 0
                    snap = None
                    continue
                snap = cur
                d, r = (d, r + 1) if r + 1 < tr.layers else (d + 1, 0)
            kind, mo = kinds[e], mods[e]
            e += 1
            if kind == "F" or kind == "B":
                own = mod_params[mo]
                if kind == "B":
                    bwd_active[mo] = None
                todo = ()
                need = ()
                if len(own) == 1:  # the loop below, for one param (most modules)
                    p = own[0]
                    active[p] += 1
                    if recent[p] < step:
                        todo = own
                    if not avail[p]:
                        calls.append((numel_[p],))
                        avail[p] = True
                        n_avail += numel_[p]
                        need = own
                elif own:
                    todo = []
                    for p in own:
                        # _fetch_sub_module_impl: one all_gather_coalesced of the module's unavailable params
                        active[p] += 1
                        if recent[p] < step:
                            todo.append(p)
                    need = [p for p in own if not avail[p]]
                    if need:
                        calls.append(tuple(sorted([numel_[p] for p in need])) if len(need) > 1 else (numel_[need[0]],))
                        for p in need:
                            avail[p] = True
                            n_avail += numel_[p]
                if not record:
                    # pop the module's own params off the fetch queue (unless a prefetch already did)
                    if len(todo) == 1:  # the loop below, for one param
                        if q >= nq or qp[q] != todo[0]:
                            raise RuntimeError("ZeRO-3 trace replay diverged")
                        recent[todo[0]] = qs[q]
                        q += 1
                    elif todo:
                        seen = set()
                        while q < nq and len(seen) < len(todo):
                            p = qp[q]
                            recent[p] = qs[q]
                            q += 1
                            seen.add(p)
                        if seen != set(todo):
                            raise RuntimeError("ZeRO-3 trace replay diverged")  # the coordinator raises too
                    if pf > 0:
                        # prefetch: pop the queue until the numel to gather reaches
                        # min(max_live - n_available, prefetch_bucket); available params are skipped
                        cap = ml - n_avail
                        if cap >= pf:
                            cap = pf
                            if n_avail > full_hi:
                                full_hi = n_avail
                        elif cap <= 0:
                            if n_avail < none_lo:
                                none_lo = n_avail
                        else:
                            mid = True
                        pre: list[int] = []
                        got = 0
                        while q < nq and got < cap:
                            p, st = qp[q], qs[q]
                            q += 1
                            if not avail[p]:
                                avail[p] = True  # in flight: not fetched again, nor twice in this call
                                pre.append(p)
                                got += numel_[p]
                            if st > recent[p]:
                                recent[p] = st
                        if got:
                            calls.append(tuple(sorted([numel_[p] for p in pre])) if len(pre) > 1 else (got,))
                            n_avail += got
                        if watch is not None:
                            watch.append((kind, mo, tuple(need), tuple(pre)))
                    elif watch is not None:
                        watch.append((kind, mo, tuple(need), ()))
                elif watch is not None:
                    watch.append((kind, mo, tuple(need), ()))
                step += 1
            elif kind == "f" or kind == "b":
                if kind == "b":
                    bwd_active.pop(mo, None)
                own = mod_params[mo]
                if not own:
                    continue
                # release_sub_module: every own param outside a complete trace (recording: persistent too)
                if record:
                    rel = own
                else:
                    key = (mo, step)
                    rel = cache.get(key)
                    if rel is None:
                        rel = to_release(mo, step, recent, not fill)
                    if self._now_first:
                        got = unmarked.get(key)
                        if got is None:
                            got = self._cached(key, unmarked)
                        if got != _unmarked(own, persist, recent, step):
                            self._now_first = False
                freed = []
                for p in own:
                    active[p] -= 1
                    if not active[p] and avail[p] and p in rel:  # __release_param
                        avail[p] = False
                        n_avail -= numel_[p]
                        freed.append(p)
                if watch is not None:
                    watch.append((kind, mo, tuple(freed)))
            else:  # release_backward_leftovers: drain the backward stack, non-persistent params only
                freed = []
                while bwd_active:
                    mo, _ = bwd_active.popitem()
                    for p in mod_params[mo]:
                        active[p] -= 1
                        if not active[p] and not persist[p] and avail[p]:
                            avail[p] = False
                            n_avail -= numel_[p]
                            freed.append(p)
                if watch is not None:
                    watch.append((kind, -1, tuple(freed)))
        out_calls = Counter(calls)
        out_calls.update(skipped)
        out = (out_calls, frozenset(compress(range(len(avail)), avail)))
        if half is not None:
            caps.add(full_hi, none_lo, mid)
            rest = Counter(calls[half[2]:])
            rest.update(skipped - half[3])
            self.backward[half[0]] = (rest, out[1], half[1], caps)
        if not record:
            self.memo[start] = out
            self.as_first[start] = fill or self._now_first
        return out

    def _skip(self, b, c, calls, skipped, fill: bool, record: bool) -> int:
        """How many blocks the replay may skip at block start c (state tuples as run() takes them), b
        being the previous block start of the same run; 0: none. When it skips k, it adds k times the
        calls of block b, fills the release cache of the skipped blocks (fill) and leaves in self._avail
        the avail list after them.

        Why this is exact. Block r's replay (from its start to the next block's) reads and writes: the
        scalars n_avail, q (recent is a function of q: every pop sets the popped param's recent to its
        step, popped in step order), avail and active of block r's own params and of the params it pops
        off the queue (blocks r..r+h), and the release cache at block r's (module, step) keys; the
        static trace it reads (events, numels, the queue entries popped, the reuse-distance window) is
        the same block for block inside the run. So when block b's and block c = b+1's starts agree on
        the scalars (q relative to the block), on bwd_active and on avail/active of blocks b..b+h
        (c..c+h, h from block b's pops), block c replays block b, shifted by one block; so does
        every next block c+j as long as the untouched block c+h+j still looks like block c+h did, the
        pops and the reuse window stay inside the run and (a pass reading the cache) the cache at
        block c+j's keys is block b's shifted. After k such blocks: blocks c..c+k-1 are left as block
        b was at c (block c-1 at c), blocks c+k..c+k+h-1 as blocks c..c+h-1 at c, the rest as at c."""
        tr = self.tr
        d, rb, step_b, q_b, na_b, nc_b, avail_b, active_b, bwd_b, end_b = b[:10]
        _, rc, step_c, q_c, na_c, nc_c, avail_c, active_c, bwd_c, end_c, full_hi, none_lo, mid = c
        pr = tr.periods[d]
        L, nb, dP = tr.layers, tr.nb, pr.dP
        if bwd_b != bwd_c:
            return 0
        # n_avail only sets the prefetch's cap, min(max_live - n_avail, prefetch_bucket): a block may
        # end with n_avail moved by `drift` (persistent params gathered for good) as long as every cap
        # stays what it was (the prefetch bucket, or nothing) in the blocks skipped
        drift = na_c - na_b
        if drift and mid:
            return 0
        if record:
            h = 0
        else:
            qr_b, qr_c = q_b - (pr.q0 + rb * pr.Q), q_c - (pr.q0 + rc * pr.Q)
            if qr_b != qr_c or qr_b < 0 or q_c > pr.q0 + L * pr.Q:
                return 0
            h = (q_c - 1 - pr.q0) // pr.Q - rb if q_c > q_b else 0
        if rc + h > L - 1:
            return 0

        def blocks(lst, r0, r1):  # params of the run's blocks r0..r1 (inclusive), registration order
            lo, hi = sorted((pr.p_lo + r0 * dP, pr.p_lo + r1 * dP))
            return lst[lo:hi + nb]

        def busy(lst, r0, r1):  # any(blocks(...)) of a list of ints, at C speed
            got = blocks(lst, r0, r1)
            return got.count(0) != len(got)

        if blocks(avail_b, rb, rb + h) != blocks(avail_c, rc, rc + h) or \
                busy(active_b, rb, rb + h) or busy(active_c, rc, rc + h):
            return 0
        # blocks c+h+1.. like block c+h (untouched so far, so as at the pass's start); k-1 of them needed
        far = blocks(avail_c, rc + h, rc + h)
        n = L - 1 - rc - h  # blocks after c+h
        if n and not (blocks(avail_c, rc + h + 1, L - 1) == far * n and not busy(active_c, rc + h + 1, L - 1)):
            n = 0
            while rc + h + n + 1 <= L - 1 and blocks(avail_c, rc + h + n + 1, rc + h + n + 1) == far and \
                    not busy(active_c, rc + h + n + 1, rc + h + n + 1):
                n += 1
        k = n + 1  # also keeps block c+k-1's pops inside the run
        if drift > 0 and full_hi > -_INF:
            k = min(k, (self.ml - self.pf - full_hi) // drift)
        if drift < 0 and none_lo < _INF:
            k = min(k, (none_lo - self.ml) // -drift)
        if fill and self.rd > 0:  # block c+k-1's reuse-distance walks end inside the run
            k = min(k, (pr.step0 + L * pr.S - end_c) // pr.S)
        elif not record and not fill:
            # blocks the first pass skipped from the same block on are block b's shifted by construction
            ok = max([r1 - rb for dd, r0, r1 in self.rules if dd == d and r0 <= rb <= r1] + [0])
            while ok < k and all(self._cached((mo + (rc + ok) * pr.dM, s + (rc + ok) * pr.S)) ==
                                 self._shift(self._cached((mo + rb * pr.dM, s + rb * pr.S)), (ok + 1) * dP)
                                 for mo, s in pr.releases):
                # block rc+ok finds block b's unmarked params shifted (it replays block b): its entries
                # are a first pass's when theirs are too
                if self._now_first and not all(
                        self._cached((mo + (rc + ok) * pr.dM, s + (rc + ok) * pr.S), self.unmarked) ==
                        self._shift(self._cached((mo + rb * pr.dM, s + rb * pr.S), self.unmarked), (ok + 1) * dP)
                        for mo, s in pr.releases):
                    self._now_first = False
                ok += 1
            k = min(k, ok)
        if k < 1:
            return 0
        if fill:
            self.rules.append((d, rb, rb + k))
        for key in calls[nc_b:nc_c]:
            skipped[key] += k
        # avail after the skip: blocks c..c+k-1 as block c-1 at c, c+k..c+k+h-1 as c..c+h-1 at c
        new = avail_c[:]
        lo = pr.p_lo + min(rc * dP, (rc + k - 1) * dP)
        new[lo:lo + k * nb] = blocks(avail_c, rc - 1, rc - 1) * k
        for j in range(h):
            lo = pr.p_lo + (rc + k + j) * dP
            new[lo:lo + nb] = blocks(avail_c, rc + j, rc + j)
        self._avail = new
        return k


@lru_cache(maxsize=64)
def _z3_record(model: ModelShape, threshold: int, periodic: bool = True) -> tuple[Counter, frozenset]:
    """Step 0's recording pass (trace RECORD: no prefetch, every own param released), which starts
    with nothing gathered (persistent params are first gathered by step 0's _post_step)."""
    tr = _z3_trace(model, threshold)
    return _Z3Sim(tr, 0, 0, 0, periodic).run(frozenset(), record=True)


@lru_cache(maxsize=128)
def _z3_sims(model: ModelShape, threshold: int, prefetch: int, max_live: int, reuse: int, periodic: bool) -> dict:
    """The coordinators of one budget setting by `accumulate` (_z3_sim), built on first use."""
    return {}


def _z3_sim(model: ModelShape, threshold: int, prefetch: int, max_live: int, reuse: int, accumulate: bool,
            periodic: bool = True) -> _Z3Sim:
    """A coordinator whose __params_to_release cache is filled by the first complete pass, as in a real
    run: with gradient accumulation that pass is step 0's micro-batch 1, which starts with nothing
    gathered (the recording pass released every param, persistent ones too); with one micro-batch it is
    step 1's, which starts with the persistent params gathered by step 0's _post_step."""
    sims = _z3_sims(model, threshold, prefetch, max_live, reuse, periodic)
    sim = sims.get(accumulate)
    if sim is None:
        tr = _z3_trace(model, threshold)
        sim = sims[accumulate] = _Z3Sim(tr, prefetch, max_live, reuse, periodic)
        if not accumulate:
            sim.run(_z3_persistent(tr))
        else:  # the reference takes the recording pass's end from its replay
            sim.run(_z3_after_record(tr) if periodic else _z3_record(model, threshold, periodic)[1])
    return sim


def _z3_after_record(tr: _Z3Trace) -> frozenset:
    """The params the recording pass leaves gathered (_z3_record's end), without replaying it: it
    releases every fetched param, persistent ones too, when the module's forward or backward ends,
    except the root's and the embedding's backward fetches, left to release_backward_leftovers, which
    keeps persistent params; the root has none: the embedding's (module 1), when persistent."""
    return frozenset(p for p in tr.mod_params[1] if tr.persist[p])


def _z3_persistent(tr: _Z3Trace) -> frozenset:
    return tr.persistent


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


@lru_cache(maxsize=64)
def _z3_fetch_on_use(model: ModelShape, threshold: int) -> Counter:
    """A complete pass's all-gathers without prefetch or reuse distance (stage3_prefetch_bucket_size = 0,
    stage3_max_reuse_distance = 0, any stage3_max_live_parameters: it only caps prefetches), from the
    persistent params, where every steady pass starts. Each module with params is fetched once in the
    forward and once in the backward (_z3_trace's hook order); nothing prefetched marks its params as
    used later (__most_recent_step_id_param_fetched_for is its own fetch's step) and no reuse window
    keeps them, so __params_to_release is all its non-persistent params, released when its forward or
    backward ends (the root's and the embedding's backward by release_backward_leftovers), while the
    persistent ones stay gathered. So every fetch all-gathers the module's non-persistent params
    (fetch_sub_module: one all_gather_coalesced), and the pass ends where it started. Tested against
    the event replay."""
    block: dict[str, list[int]] = {}
    for mo, n in _block(model):
        block.setdefault(mo, []).append(n)
    e = model.vocab * model.hidden
    # the blocks' modules; the embedding, the final norm and the output (tied: the embedding's Parameter)
    mods = [(ns, model.layers) for ns in block.values()]
    mods += [([e], 1), ([numel(sh) for _, sh in model.norm_params("norm")], 1), ([e], 1)]
    out: dict[tuple[int, ...], int] = {}
    for ns, k in mods:
        key = tuple(sorted([n for n in ns if n > threshold]))  # ds_persist: ds_numel <= threshold
        if key:
            out[key] = out.get(key, 0) + 2 * k
    return Counter(out)


@lru_cache(maxsize=256)
def _z3_steady(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
               periodic: bool = True) -> Counter:
    """The coordinator's all-gather calls of a steady optimizer step (numel tuples, dp-independent): m
    passes from the persistent params _post_step gathered. periodic=False: the event-by-event replay
    (the reference)."""
    if periodic and prefetch == 0 and reuse == 0:  # every pass the same, known without a replay
        return Counter({key: k * m for key, k in _z3_fetch_on_use(model, threshold).items()})
    tr = _z3_trace(model, threshold)
    if m == 1 and periodic:
        # step 1's pass is a fresh coordinator's first complete pass from the persistent params: the
        # coordinator of gradient accumulation, if built, makes that very pass when it reads only
        # entries that pass would compute (_Z3Sim.as_first)
        acc = _z3_sims(model, threshold, prefetch, max_live, reuse, periodic).get(True)
        if acc is not None:
            calls, _ = acc.run(_z3_persistent(tr))
            if acc.as_first[_z3_persistent(tr)]:
                return Counter(calls)
    sim = _z3_sim(model, threshold, prefetch, max_live, reuse, m > 1, periodic)
    return _z3_passes(sim, _z3_persistent(tr), m)


@lru_cache(maxsize=256)
def _z3_fetches(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
                periodic: bool = True):
    """The coordinator's all-gather calls per optimizer step, dp-independent (numel tuples):
    (recording pass, the rest of step 0 [m > 1], steady step [_z3_steady]). periodic=False: the
    event-by-event replay (the reference)."""
    record, after_record = _z3_record(model, threshold, periodic)
    steady = _z3_steady(model, m, threshold, prefetch, max_live, reuse, periodic)
    if m == 1:
        return record, Counter(), steady
    sim = _z3_sim(model, threshold, prefetch, max_live, reuse, True, periodic)
    return record, _z3_passes(sim, after_record, m - 1), steady


class Z3Live(NamedTuple):
    """ZeRO-3's gathered parameter memory at one moment of a pass, by the probe's category of each
    storage (probes/peak.py: a storage's category holds for the whole step): bytes of the params' own
    storages that a forward mm saves (`saved`: the Linear weights), of the collective's outputs no op
    saves (`gathered`: coalesced calls' flat buffers, single-param buffers) and of the torch.cat copies
    no op saves (`temporary`)."""
    saved: int
    gathered: int
    temporary: int

    @property
    def total(self) -> int:
        return self.saved + self.gathered + self.temporary


def _z3_walk(model: ModelShape, tr: _Z3Trace, log: list, dp: int, w: int, ats: tuple[int, ...]) -> tuple[Z3Live, ...]:
    """Live gathered memory after each fetch event of `ats` (indices into a watched pass's events,
    _Z3Sim.run(watch=)), from partition_parameters.py's all-gather handles:

    - one param (_all_gather_sequential): param.data is a view of its buffer of ceil(n/dp)*dp elements,
      live from the call to the param's release (free_param);
    - several (_all_gather_dtype): one flat buffer of sum(ceil(n/dp))*dp elements; the first wait() on
      the handle (AllGatherCoalescedHandle.wait; fetch_sub_module pops a module's own params off
      __inflight_param_registry and waits, before it issues the prefetch) makes every param of the call
      its own storage, torch.cat of its parts (n elements, freed at its release); the flat buffer lives
      while the registry holds the handle: until the last of its params is popped.

    A param's storage is `saved` when a forward op saves it: a Linear's weight (mm; every 2-D param but
    the embedding's own lookup, F.embedding saving the indices) and an RMSNorm's weight (the mul by it),
    looking past a forward moment up to the forward's end; a storage gathered in the backward is never
    saved. (The norms' weights are persistent under the default threshold, gathered here only in step
    0's passes.)"""
    two_d = [len(sh) == 2 or n.endswith("norm.weight") for n, sh in model.params()]
    emb = 1  # module 1: tok_embeddings (_z3_trace)
    handle_of: dict[int, int] = {}  # in flight in a coalesced call: param -> handle id
    handles: dict[int, list] = {}  # id -> [flat bytes, its params, params not popped yet]
    storage: dict[int, tuple[int, int, str]] = {}  # param -> (serial, bytes, "gathered" | "temporary")
    saved: set[int] = set()  # serials a forward mm saves
    serial = 0
    snaps: dict[int, tuple[dict, int]] = {}
    forward = True
    for i, ev in enumerate(log):
        kind, mo = ev[0], ev[1]
        if kind == "B":
            forward = False
            if len(snaps) == len(ats):
                break
        if kind == "F" or kind == "B":
            for k, ps in enumerate((ev[2], ev[3])):  # the own fetch, then (after the wait loop) the prefetch
                if len(ps) == 1:
                    serial += 1
                    storage[ps[0]] = (serial, w * _ceil(tr.numel[ps[0]], dp) * dp, "gathered")
                elif ps:
                    serial += 1
                    handles[serial] = [w * sum(_ceil(tr.numel[p], dp) for p in ps) * dp, ps, set(ps)]
                    for p in ps:
                        handle_of[p] = serial
                if k == 1:
                    break
                for p in tr.mod_params[mo]:  # the wait loop
                    h = handle_of.pop(p, None)
                    if h is None:
                        continue
                    hd = handles[h]
                    if len(hd[2]) == len(hd[1]):  # the handle's first wait: every param cat'ed
                        for q in hd[1]:
                            serial += 1
                            storage[q] = (serial, w * tr.numel[q], "temporary")
                    hd[2].discard(p)
                    if not hd[2]:
                        del handles[h]
            if forward and mo != emb:
                saved.update(storage[p][0] for p in tr.mod_params[mo] if two_d[p] and p in storage)
            if i in ats:
                snaps[i] = (dict(storage), sum(hd[0] for hd in handles.values()))
        else:
            for p in ev[2]:
                storage.pop(p, None)
    out = []
    for at in ats:
        if at not in snaps:
            raise ValueError(f"event {at} is not a fetch of the pass")
        snap, flat = snaps[at]
        got = {"saved": 0, "gathered": flat, "temporary": 0}
        for sr, nb, cat in snap.values():
            got["saved" if sr in saved else cat] += nb
        out.append(Z3Live(**got))
    return tuple(out)


def _ceil(n: int, k: int) -> int:
    return -(-n // k)


def _pass_logs(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
               first: bool) -> list[list]:
    """The watched event logs (_Z3Sim.run(watch=)) of a step's passes: a steady step's m (the passes of
    _z3_steady); step 0's (first) recording pass alone with one micro-batch, else the m - 1 after it,
    the first of which is the coordinator's first complete pass from what the recording pass left
    gathered (nothing persistent gathered yet: _post_step gathers the persistent params at step 0's
    end), so its prefetch gathers the persistent params too (_z3_sim's fill pass)."""
    tr = _z3_trace(model, threshold)
    if first and m == 1:
        log: list = []
        _Z3Sim(tr, 0, 0, 0, periodic=False).run(frozenset(), record=True, watch=log)
        return [log]
    sim = _z3_sim(model, threshold, prefetch, max_live, reuse, True if first else m > 1, periodic=False)
    start = _z3_record(model, threshold, periodic=False)[1] if first else _z3_persistent(tr)
    logs = []
    for _ in range(m - 1 if first else m):
        log = []
        _, end = sim.run(start, watch=log)
        logs.append(log)
        start = end
    return logs


def _fetch_at(log: list, kind: str, mod: int) -> int:
    return next(i for i, ev in enumerate(log) if ev[0] == kind and ev[1] == mod)


@lru_cache(maxsize=64)
def z3_moments(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int, dp: int,
               w: int, first: bool = False) -> tuple[tuple[Z3Live, Z3Live, Z3Live], ...]:
    """Per micro-batch of a steady step (the passes of _z3_steady, on the event-by-event replay), the
    gathered parameter memory at three moments (after the fetch and its prefetch):
    - the final norm's forward: every layer's activations live, the output's all-gather not waited yet;
    - the backward's start (the root's pre-backward hook on the loss, before the loss's own backward
      nodes): what the forward left gathered and the root's prefetch;
    - the output Linear's backward (its pre-backward hook on the logits' gradient).
    first: the same for step 0's passes (_pass_logs: its recording pass with one micro-batch, no
    prefetch, every fetched param released after its module, persistent ones too)."""
    tr = _z3_trace(model, threshold)
    norm, out_mod = 2 + tr.layers * _block_modules(tr), 3 + tr.layers * _block_modules(tr)
    return tuple(_z3_walk(model, tr, log, dp, w, (_fetch_at(log, "F", norm), _fetch_at(log, "B", 0),
                                                  _fetch_at(log, "B", out_mod)))
                 for log in _pass_logs(model, m, threshold, prefetch, max_live, reuse, first))


def z3_first_moments(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int, dp: int,
                     w: int) -> tuple[tuple[Z3Live, Z3Live, Z3Live], ...]:
    """z3_moments for step 0's passes."""
    return z3_moments(model, m, threshold, prefetch, max_live, reuse, dp, w, True)


def backward_module(model: ModelShape, threshold: int, param: str) -> int:
    """The module (as _z3_trace numbers them) whose pre-backward hook fetches `param` in the backward."""
    tr = _z3_trace(model, threshold)
    M = _block_modules(tr)
    if param.startswith("layers."):
        _, j, rest = param.split(".", 2)
        return 2 + int(j) * M + tr.block_modules.index(_module(rest))
    return {"tok_embeddings": 1, "norm": 2 + tr.layers * M, "output": 3 + tr.layers * M}[_module(param)]


@lru_cache(maxsize=64)
def z3_backward_moments(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
                        dp: int, w: int, first: bool, mods: tuple[int, ...]) -> tuple[tuple[Z3Live, ...], ...]:
    """Per micro-batch (z3_moments' passes), the gathered parameter memory at each module of `mods`'s
    pre-backward fetch (and its prefetch): what the coordinator holds while that module's backward
    runs, its parameters' gradient hooks included (their post-backward release comes after)."""
    tr = _z3_trace(model, threshold)
    return tuple(_z3_walk(model, tr, log, dp, w, tuple(_fetch_at(log, "B", mo) for mo in mods))
                 for log in _pass_logs(model, m, threshold, prefetch, max_live, reuse, first))


def _block_modules(tr: _Z3Trace) -> int:
    """Modules per block (M of _z3_trace): the final norm is module 2 + layers * M."""
    return abs(tr.periods[0].dM)
