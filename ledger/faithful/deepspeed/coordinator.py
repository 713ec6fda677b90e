"""DeepSpeed 0.19.8 ZeRO-3's parameter coordinator (runtime/zero/partitioned_param_coordinator.py),
replayed: which all-gathers one forward + backward makes for any stage3_prefetch_bucket_size /
stage3_max_live_parameters / stage3_max_reuse_distance, over the module hook order of
launchers.llama.Llama (trace.py, as dumped from the coordinator on a real run), and which passes an
optimizer step replays from which start (step 0's recording pass, its first complete pass, the steady
passes). Used by zero3.py for ZeRO-3's collectives and by gathered.py for the memory the coordinator
holds; the replay's fast path (whole blocks skipped) is skip.py's. Each rule names the DeepSpeed
function it follows.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from functools import lru_cache
from itertools import compress

from ledger.faithful.deepspeed.skip import INF, BlockSkip
from ledger.faithful.deepspeed.trace import Z3Trace, block_params, z3_trace
from ledger.model import ModelShape, numel


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
        self.full_hi, self.none_lo, self.mid = -INF, INF, False

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


_NEVER = -10 ** 10  # `never`: __most_recent_step_id_param_fetched_for of a param no fetch has marked yet


class _Pass:
    """One pass's replay state (_Z3Sim.run): the coordinator's as reset_step leaves it at the pass's
    start, then as each event changes it, and the fast path's bookkeeping."""
    __slots__ = ("start", "record", "fill", "watch", "avail", "active", "bwd_active", "calls", "skipped", "q",
                 "recent", "n_avail", "step", "d", "r", "nxt", "snap", "full_hi", "none_lo", "mid", "half", "caps")

    def __init__(self, tr: Z3Trace, start: frozenset, record: bool, fill: bool, watch: list | None, periodic: bool):
        self.start, self.record, self.fill, self.watch = start, record, fill, watch
        self.avail = [False] * len(tr.numel)
        for p in start:
            self.avail[p] = True
        # ds_active_sub_modules as a count: a module is fetched once before each release of it
        self.active = [0] * len(tr.numel)
        self.bwd_active: dict[int, None] = {}  # __active_backward_submodules (insertion order)
        self.calls: list[tuple[int, ...]] = []  # one entry per all_gather_coalesced
        self.skipped: Counter = Counter()  # calls of skipped blocks
        self.q = 0  # reset_step: __param_queue is param_order[q:]
        self.recent = [_NEVER] * len(tr.numel)  # __most_recent_step_id_param_fetched_for
        self.n_avail = 0  # __n_available_params (reset_step zeroes it, whatever is still gathered)
        self.step = 0
        # the fast path: the next block start is block r of run d, at event nxt (-1: none left, or not
        # periodic); snap: the state at the last block start (_skip)
        self.d = self.r = 0
        self.nxt = tr.periods[0].e0 if periodic else -1
        self.snap = None
        # this block's prefetches by their cap: the most n_avail of those capped at the prefetch bucket, the
        # least of those capped at nothing (max_live reached), whether one was capped in between
        self.full_hi, self.none_lo, self.mid = -INF, INF, False
        # the first complete pass where the backward run starts: (its state, n_avail, calls and skipped
        # calls so far); caps: its prefetches' caps from there on
        self.half, self.caps = None, _Caps()


class _Z3Sim(BlockSkip):
    """partitioned_param_coordinator.py PartitionedParameterCoordinator, replayed over z3_trace's
    events. A pass is one forward + backward (reset_step at its start); it returns the all-gather
    calls it makes (one all_gather_coalesced per fetch or prefetch with params to gather, keyed by the
    sorted numel of those params) and the params still gathered after it (release_backward_leftovers
    done). Passes after the first complete one are memoized per starting state.

    periodic: skip whole blocks once the replay repeats itself (_skip, skip.py), and take a later
    pass's backward from the first complete pass's where their states agree (_share_backward); False
    replays every event (the reference the fast path is tested against).

    run replays a pass event by event: a module's fetch (_fetch: its own params gathered,
    _gather_own; popped off the param queue, _pop_own; the prefetch, _prefetch), its release
    (_release), the backward's leftovers (_release_leftovers); at each block start the fast path
    (_share_backward, _next_block, _skip_blocks); at the pass's end what it memoizes (_end)."""

    def __init__(self, tr: Z3Trace, prefetch: int, max_live: int, reuse: int, periodic: bool = True):
        self.tr, self.pf, self.ml, self.rd = tr, prefetch, max_live, reuse
        self.periodic = periodic
        # __params_to_release's lru_cache; its sets as tuples in ds_id order (a module's params, filtered or
        # shifted: the order is kept, so tuples are equal when the sets are; cheaper to build than sets)
        self.release_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        # per release_cache key: the module's params the prefetcher had not marked as used later, the
        # one input of the cached value a pass's state decides (the reuse window is the key's own)
        self.unmarked: dict[tuple[int, int], tuple[int, ...]] = {}
        # per memo key: whether that pass is the pass a fresh coordinator's first complete pass from the
        # same start would make (every cache entry it read is what that pass would compute: _release, _skip)
        self.as_first: dict[frozenset, bool] = {}
        # the cache of blocks the first pass skipped, kept as a rule: (run, r0, r1): blocks r0+1..r1's
        # entries are block r0's shifted (_cached)
        self.rules: list[tuple[int, int, int]] = []
        self.memo: dict[frozenset, tuple] = {}
        # the first complete pass's backward, by its state where the backward run starts (q, avail:
        # _share_backward): its all-gather calls from there on, the params gathered at its end, n_avail
        # there and its prefetches' caps from there on (_Caps)
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

    def run(self, start: frozenset, record: bool = False, watch: list | None = None) -> tuple[Counter, frozenset]:
        """One pass from `start` (params gathered when it begins): its all-gather calls as a Counter of
        sorted numel tuples, and the params gathered after it.

        watch: a list that gets every event of the pass, for the memory walk (gathered.py): (kind,
        module, own fetch's params, prefetched params) for a fetch, (kind, module, released params) for
        a release or the leftovers' drain. Only on the event-by-event replay (periodic=False)."""
        if watch is not None and self.periodic:
            raise ValueError("watch needs the event-by-event replay (periodic=False)")
        if not record and watch is None and start in self.memo and self.release_cache:
            return self.memo[start]
        fill = not record and not self.release_cache  # this pass decides __params_to_release
        ps = _Pass(self.tr, start, record, fill, watch, self.periodic)
        # a pass reading the cache is the first complete pass from its start while every entry it reads
        # is what that pass would compute: cached entries are unmarked params less the key's reuse
        # window, so while the unmarked params it finds are the entry's (here, and in _skip's blocks)
        self._now_first = not fill and not record
        kinds, mods = self.tr.kinds, self.tr.mods
        fetch, release = self._fetch, self._release
        e, n_ev = 0, len(kinds)
        while e < n_ev:
            if e == ps.nxt:
                if ps.half is not None:
                    ps.caps.add(ps.full_hi, ps.none_lo, ps.mid)
                if ps.d == 1 and ps.r == 0 and not record:
                    out = self._share_backward(ps)
                    if out is not None:
                        return out
                after = self._next_block(ps, e)
                if after != e:  # blocks skipped: go on past them
                    e = after
                    continue
            kind, mo = kinds[e], mods[e]
            e += 1
            if kind == "F" or kind == "B":
                fetch(ps, kind, mo)
            elif kind == "f" or kind == "b":
                release(ps, kind, mo)
            else:
                self._release_leftovers(ps, kind)
        return self._end(ps)

    def _share_backward(self, ps: _Pass) -> tuple[Counter, frozenset] | None:
        """Where the backward run starts: the first complete pass notes its state; a later pass whose
        state there is that pass's (n_avail within what leaves every cap as it was) makes the rest of
        that pass: its result (memoized), else None."""
        # the backward run starts: the state is (q, avail, n_avail), as active, bwd_active and
        # step follow from the event and recent from q as far as the backward reads it (every
        # pop sets the popped param's recent to its step, popped in step order; the backward
        # tells a forward step from `never` nowhere), and n_avail only sets the prefetches' caps. A pass
        # reading the cache from the first complete pass's state here, or with n_avail moved
        # by a drift that leaves every cap what it was, makes the rest of that pass: it reads
        # the entries that pass computed from the same state (so they are also what a first
        # pass would compute)
        at = (ps.q, bytes(ps.avail))
        if ps.fill:
            ps.half = (at, ps.n_avail, len(ps.calls), ps.skipped.copy())
        elif (rest := self.backward.get(at)) is not None and \
                rest[3].same(ps.n_avail - rest[2], self.pf, self.ml):
            out_calls = Counter(ps.calls)
            out_calls.update(ps.skipped)
            out_calls.update(rest[0])
            out = self.memo[ps.start] = (out_calls, rest[1])
            self.as_first[ps.start] = self._now_first
            return out
        return None

    def _next_block(self, ps: _Pass, e: int) -> int:
        """A block start (event e) on the fast path: the state _skip compares with the last block
        start's, and the blocks it allows skipped (_skip_blocks). The event the replay goes on from."""
        tr, periods = self.tr, self.tr.periods
        d, r = ps.d, ps.r
        if r + 1 < tr.layers:
            ps.nxt += periods[d].E
        else:
            ps.nxt = periods[1].e0 if d == 0 else -1
        cur = (d, r, ps.step, ps.q, ps.n_avail, len(ps.calls), ps.avail[:], ps.active[:], tuple(ps.bwd_active),
               self.end_hi, ps.full_hi, ps.none_lo, ps.mid)
        ps.full_hi, ps.none_lo, ps.mid = -INF, INF, False
        snap = ps.snap
        jump = self._skip(snap, cur, ps.calls, ps.skipped, ps.fill, ps.record) if snap is not None and snap[0] == d \
            else 0
        if jump:
            return self._skip_blocks(ps, e, snap, cur, jump)
        ps.snap = cur
        ps.d, ps.r = (d, r + 1) if r + 1 < tr.layers else (d + 1, 0)
        return e

    def _skip_blocks(self, ps: _Pass, e: int, snap: tuple, cur: tuple, jump: int) -> int:
        """The state after the `jump` blocks _skip allows from block start cur (snap: the block start
        before it), and the event after them; no more skips in this run of blocks."""
        tr, d, r = self.tr, cur[0], cur[1]
        pr = tr.periods[d]
        if ps.half is not None:  # the skipped blocks' caps: block b's, n_avail moved by 1..jump drifts
            drift = ps.n_avail - snap[4]
            ps.caps.add(cur[10], cur[11], cur[12], drift, jump)
        ps.avail[:] = self._avail
        ps.n_avail += jump * (ps.n_avail - snap[4])
        if not ps.record:
            # the skipped pops, in order (recent: the last one's step), of the blocks after the
            # skipped ones (the prefetch ran ahead into them): a skipped block's params are not
            # read again in this run, and the backward (or the next pass) compares their recent
            # only with its later steps, where a forward step reads as `never`
            q = ps.q
            lo, hi = max(q, pr.q0 + (r + jump) * pr.Q), q + jump * pr.Q
            if lo < hi:
                deque(map(ps.recent.__setitem__, tr.qp[lo:hi], tr.qs[lo:hi]), maxlen=0)
            ps.q = hi
        ps.step += jump * pr.S
        ps.nxt = tr.periods[1].e0 if d == 0 else -1  # no more skips in this run
        ps.d, ps.r = d + 1, 0
        ps.snap = None
        return e + jump * pr.E

    def _fetch(self, ps: _Pass, kind: str, mo: int) -> None:
        """fetch_sub_module of module mo (F: its pre-forward hook, B: its pre-backward hook) at step_id
        ps.step: its own params gathered, popped off the fetch queue, then the prefetch."""
        own = self.tr.mod_params[mo]
        if kind == "B":
            ps.bwd_active[mo] = None
        todo, need = self._gather_own(ps, own)
        pre = ()
        if not ps.record:
            self._pop_own(ps, todo)
            if self.pf > 0:
                pre = self._prefetch(ps)
        if ps.watch is not None:
            ps.watch.append((kind, mo, tuple(need), tuple(pre)))
        ps.step += 1

    def _gather_own(self, ps: _Pass, own) -> tuple:
        """The module's own params marked active and gathered where not available: (todo, the ones no
        fetch has popped off the queue for this step yet; need, the ones this fetch gathers)."""
        numel_, active, avail, recent, step = self.tr.numel, ps.active, ps.avail, ps.recent, ps.step
        todo = ()
        need = ()
        if len(own) == 1:  # the loop below, for one param (most modules)
            p = own[0]
            active[p] += 1
            if recent[p] < step:
                todo = own
            if not avail[p]:
                ps.calls.append((numel_[p],))
                avail[p] = True
                ps.n_avail += numel_[p]
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
                ps.calls.append(tuple(sorted([numel_[p] for p in need])) if len(need) > 1 else (numel_[need[0]],))
                for p in need:
                    avail[p] = True
                    ps.n_avail += numel_[p]
        return todo, need

    def _pop_own(self, ps: _Pass, todo) -> None:
        """Pop the module's own params off the fetch queue (unless a prefetch already did)."""
        qp, qs, recent, q = self.tr.qp, self.tr.qs, ps.recent, ps.q
        nq = len(qp)
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
        ps.q = q

    def _prefetch(self, ps: _Pass) -> list[int]:
        """The prefetch after a fetch: pop the queue until the numel to gather reaches
        min(max_live - n_available, prefetch_bucket); available params are skipped. The params it
        gathers (one all_gather_coalesced)."""
        numel_, avail, recent, n_avail = self.tr.numel, ps.avail, ps.recent, ps.n_avail
        qp, qs, q = self.tr.qp, self.tr.qs, ps.q
        nq = len(qp)
        cap = self.ml - n_avail
        if cap >= self.pf:
            cap = self.pf
            if n_avail > ps.full_hi:
                ps.full_hi = n_avail
        elif cap <= 0:
            if n_avail < ps.none_lo:
                ps.none_lo = n_avail
        else:
            ps.mid = True
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
            ps.calls.append(tuple(sorted([numel_[p] for p in pre])) if len(pre) > 1 else (got,))
            ps.n_avail = n_avail + got
        ps.q = q
        return pre

    def _release(self, ps: _Pass, kind: str, mo: int) -> None:
        """release_sub_module of module mo (f: its forward hook, b: its post-backward hook)."""
        if kind == "b":
            ps.bwd_active.pop(mo, None)
        own = self.tr.mod_params[mo]
        if not own:
            return
        # release_sub_module: every own param outside a complete trace (recording: persistent too)
        step, recent = ps.step, ps.recent
        if ps.record:
            rel = own
        else:
            key = (mo, step)
            rel = self.release_cache.get(key)
            if rel is None:
                rel = self._to_release(mo, step, recent, not ps.fill)
            if self._now_first:
                got = self.unmarked.get(key)
                if got is None:
                    got = self._cached(key, self.unmarked)
                if got != _unmarked(own, self.tr.persist, recent, step):
                    self._now_first = False
        numel_, active, avail, n_avail = self.tr.numel, ps.active, ps.avail, ps.n_avail
        freed = []
        for p in own:
            active[p] -= 1
            if not active[p] and avail[p] and p in rel:  # __release_param
                avail[p] = False
                n_avail -= numel_[p]
                freed.append(p)
        ps.n_avail = n_avail
        if ps.watch is not None:
            ps.watch.append((kind, mo, tuple(freed)))

    def _release_leftovers(self, ps: _Pass, kind: str) -> None:
        """release_backward_leftovers: drain the backward stack, non-persistent params only."""
        tr, active, avail = self.tr, ps.active, ps.avail
        freed = []
        while ps.bwd_active:
            mo, _ = ps.bwd_active.popitem()
            for p in tr.mod_params[mo]:
                active[p] -= 1
                if not active[p] and not tr.persist[p] and avail[p]:
                    avail[p] = False
                    ps.n_avail -= tr.numel[p]
                    freed.append(p)
        if ps.watch is not None:
            ps.watch.append((kind, -1, tuple(freed)))

    def _end(self, ps: _Pass) -> tuple[Counter, frozenset]:
        """The pass's all-gather calls and the params gathered after it; the first complete pass's
        backward kept for the passes after it (_share_backward); the pass memoized."""
        out_calls = Counter(ps.calls)
        out_calls.update(ps.skipped)
        out = (out_calls, frozenset(compress(range(len(ps.avail)), ps.avail)))
        if ps.half is not None:
            ps.caps.add(ps.full_hi, ps.none_lo, ps.mid)
            rest = Counter(ps.calls[ps.half[2]:])
            rest.update(ps.skipped - ps.half[3])
            self.backward[ps.half[0]] = (rest, out[1], ps.half[1], ps.caps)
        if not ps.record:
            self.memo[ps.start] = out
            self.as_first[ps.start] = ps.fill or self._now_first
        return out


@lru_cache(maxsize=64)
def _z3_record(model: ModelShape, threshold: int, periodic: bool = True, ac: bool = False) -> tuple[Counter, frozenset]:
    """Step 0's recording pass (trace RECORD: no prefetch, every own param released), which starts
    with nothing gathered (persistent params are first gathered by step 0's _post_step)."""
    tr = z3_trace(model, threshold, ac)
    return _Z3Sim(tr, 0, 0, 0, periodic).run(frozenset(), record=True)


@lru_cache(maxsize=128)
def _z3_sims(model: ModelShape, threshold: int, prefetch: int, max_live: int, reuse: int, periodic: bool,
             ac: bool = False) -> dict:
    """The coordinators of one budget setting by `accumulate` (_z3_sim), built on first use."""
    return {}


def _z3_sim(model: ModelShape, threshold: int, prefetch: int, max_live: int, reuse: int, accumulate: bool,
            periodic: bool = True, ac: bool = False) -> _Z3Sim:
    """A coordinator whose __params_to_release cache is filled by the first complete pass, as in a real
    run: with gradient accumulation that pass is step 0's micro-batch 1, which starts with nothing
    gathered (the recording pass released every param, persistent ones too); with one micro-batch it is
    step 1's, which starts with the persistent params gathered by step 0's _post_step."""
    sims = _z3_sims(model, threshold, prefetch, max_live, reuse, periodic, ac)
    sim = sims.get(accumulate)
    if sim is None:
        tr = z3_trace(model, threshold, ac)
        sim = sims[accumulate] = _Z3Sim(tr, prefetch, max_live, reuse, periodic)
        if not accumulate:
            sim.run(_z3_persistent(tr))
        else:  # the reference takes the recording pass's end from its replay
            sim.run(_z3_after_record(tr) if periodic else _z3_record(model, threshold, periodic, ac)[1])
    return sim


def _z3_after_record(tr: Z3Trace) -> frozenset:
    """The params the recording pass leaves gathered (_z3_record's end), without replaying it: it
    releases every fetched param, persistent ones too, when the module's forward or backward ends,
    except the root's and the embedding's backward fetches, left to release_backward_leftovers, which
    keeps persistent params; the root has none: the embedding's (module 1), when persistent."""
    return frozenset(p for p in tr.mod_params[1] if tr.persist[p])


def _z3_persistent(tr: Z3Trace) -> frozenset:
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
def _z3_fetch_on_use(model: ModelShape, threshold: int, ac: bool = False) -> Counter:
    """A complete pass's all-gathers without prefetch or reuse distance (stage3_prefetch_bucket_size = 0,
    stage3_max_reuse_distance = 0, any stage3_max_live_parameters: it only caps prefetches), from the
    persistent params, where every steady pass starts. Each module with params is fetched once in the
    forward and once in the backward (z3_trace's hook order); nothing prefetched marks its params as
    used later (__most_recent_step_id_param_fetched_for is its own fetch's step) and no reuse window
    keeps them, so __params_to_release is all its non-persistent params, released when its forward or
    backward ends (the root's and the embedding's backward by release_backward_leftovers), while the
    persistent ones stay gathered. So every fetch all-gathers the module's non-persistent params
    (fetch_sub_module: one all_gather_coalesced), and the pass ends where it started. Tested against
    the event replay. ac: a block's modules are fetched a third time, by the checkpoint's recompute."""
    block: dict[str, list[int]] = {}
    for mo, n in block_params(model):
        block.setdefault(mo, []).append(n)
    e = model.vocab * model.hidden
    # the blocks' modules; the embedding, the final norm and the output (tied: the embedding's Parameter)
    mods = [(ns, model.layers * (3 if ac else 2)) for ns in block.values()]
    mods += [([e], 2), ([numel(sh) for _, sh in model.norm_params("norm")], 2), ([e], 2)]
    out: dict[tuple[int, ...], int] = {}
    for ns, k in mods:
        key = tuple(sorted([n for n in ns if n > threshold]))  # ds_persist: ds_numel <= threshold
        if key:
            out[key] = out.get(key, 0) + k
    return Counter(out)


@lru_cache(maxsize=256)
def z3_steady(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
              periodic: bool = True, ac: bool = False) -> Counter:
    """The coordinator's all-gather calls of a steady optimizer step (numel tuples, dp-independent): m
    passes from the persistent params _post_step gathered. periodic=False: the event-by-event replay
    (the reference)."""
    if periodic and prefetch == 0 and reuse == 0:  # every pass the same, known without a replay
        return Counter({key: k * m for key, k in _z3_fetch_on_use(model, threshold, ac).items()})
    tr = z3_trace(model, threshold, ac)
    if m == 1 and periodic:
        # step 1's pass is a fresh coordinator's first complete pass from the persistent params: the
        # coordinator of gradient accumulation, if built, makes that very pass when it reads only
        # entries that pass would compute (_Z3Sim.as_first)
        acc = _z3_sims(model, threshold, prefetch, max_live, reuse, periodic, ac).get(True)
        if acc is not None:
            calls, _ = acc.run(_z3_persistent(tr))
            if acc.as_first[_z3_persistent(tr)]:
                return Counter(calls)
    sim = _z3_sim(model, threshold, prefetch, max_live, reuse, m > 1, periodic, ac)
    return _z3_passes(sim, _z3_persistent(tr), m)


@lru_cache(maxsize=256)
def z3_fetches(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
               periodic: bool = True, ac: bool = False):
    """The coordinator's all-gather calls per optimizer step, dp-independent (numel tuples):
    (recording pass, the rest of step 0 [m > 1], steady step [z3_steady]). periodic=False: the
    event-by-event replay (the reference)."""
    record, after_record = _z3_record(model, threshold, periodic, ac)
    steady = z3_steady(model, m, threshold, prefetch, max_live, reuse, periodic, ac)
    if m == 1:
        return record, Counter(), steady
    sim = _z3_sim(model, threshold, prefetch, max_live, reuse, True, periodic, ac)
    return record, _z3_passes(sim, after_record, m - 1), steady


def pass_logs(model: ModelShape, m: int, threshold: int, prefetch: int, max_live: int, reuse: int,
              first: bool, ac: bool = False) -> list[list]:
    """The watched event logs (_Z3Sim.run(watch=)) of a step's passes: a steady step's m (the passes of
    z3_steady); step 0's (first) recording pass alone with one micro-batch, else the m - 1 after it,
    the first of which is the coordinator's first complete pass from what the recording pass left
    gathered (nothing persistent gathered yet: _post_step gathers the persistent params at step 0's
    end), so its prefetch gathers the persistent params too (_z3_sim's fill pass)."""
    tr = z3_trace(model, threshold, ac)
    if first and m == 1:
        log: list = []
        _Z3Sim(tr, 0, 0, 0, periodic=False).run(frozenset(), record=True, watch=log)
        return [log]
    sim = _z3_sim(model, threshold, prefetch, max_live, reuse, True if first else m > 1, periodic=False, ac=ac)
    start = _z3_record(model, threshold, periodic=False, ac=ac)[1] if first else _z3_persistent(tr)
    logs, passes = [], m - 1 if first else m
    while len(logs) < passes:
        log = []
        _, end = sim.run(start, watch=log)
        # a fixed point (the pass ends where it started): the remaining passes repeat it, event for
        # event (_Z3Sim.run is a function of its start), as _z3_passes counts them; one log object
        # stands for them all, so a step of thousands of micro-batches replays a few
        logs.extend([log] * (passes - len(logs) if end == start else 1))
        start = end
    return logs
