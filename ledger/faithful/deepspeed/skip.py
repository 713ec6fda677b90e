"""DeepSpeed 0.19.8 ZeRO-3's parameter coordinator's replay, its fast path: whole decoder blocks
skipped once the replay repeats itself (BlockSkip._skip, which says why that is exact), and the
release cache of the blocks skipped kept as rules (a skipped block's entries are an earlier block's,
shifted: BlockSkip._cached). coordinator._Z3Sim runs it; the event-by-event replay (periodic=False)
is the reference it is tested against.
"""
from __future__ import annotations

INF = float("inf")  # exact against ints


class BlockSkip:
    """The fast path of coordinator._Z3Sim (a base class of it), which sets what these read: tr (the
    trace), pf, ml, rd (the prefetch bucket, max live and reuse distance budgets), release_cache and
    unmarked (__params_to_release's cache and the unmarked params it was computed from), rules (the
    blocks the first pass skipped) and _now_first (whether the pass is still a fresh coordinator's
    first pass)."""

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

    def _skip(self, b, c, calls, skipped, fill: bool, record: bool) -> int:
        """How many blocks the replay may skip at block start c (state tuples as _Z3Sim._next_block
        makes them), b being the previous block start of the same run; 0: none. When it skips k, it
        adds k times the calls of block b, fills the release cache of the skipped blocks (fill) and
        leaves in self._avail the avail list after them.

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
        if drift > 0 and full_hi > -INF:
            k = min(k, (self.ml - self.pf - full_hi) // drift)
        if drift < 0 and none_lo < INF:
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
