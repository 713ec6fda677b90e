"""The peak probe's offline analysis of one recorded step (probes/peak.py PeakTracker records it): the
peak's parts by category, where it happened, the census of what is live at it, the timeline, and the
replay with worker-thread frees made prompt (the thread-timing range). Reads the tracker; changes
nothing."""
from __future__ import annotations

RESIDENT = ("params", "grads", "optim", "other")
CATEGORIES = RESIDENT + ("activations", "gathered", "temporary", "unnamed")
TIMELINE_POINTS = 400  # points kept per timeline (the peak and the extremes between kept points)
CENSUS_GROUPS = 40  # groups kept in a peak census (the largest; the rest summed in one row)


def result(tr, named: dict[str, set[int]] | None, timeline: bool) -> dict:
    """peak_bytes, where it was, bytes by category at the peak; the timeline when asked.
    named: category -> serials of the launcher's named storages (this boundary and the last)."""
    named = named or {}
    cat: dict[int, str] = {}
    for s in tr.start_serials:
        cat[s] = "unnamed"
    for s in tr.comm:
        cat[s] = "gathered"
    for s in tr.saved:
        cat[s] = "activations"
    for g in reversed(RESIDENT):  # the first group that names a storage wins, as in probes.memory
        for s in named.get(g, ()):
            cat[s] = g
    phases = phases_of(tr.events)

    def category(s: int) -> str:
        return cat.get(s, "temporary")

    start = {c: 0 for c in CATEGORIES}  # live bytes per category when the step began
    for s, nb in tr.start_serials.items():
        start[category(s)] += nb
    live = dict(start)
    points = [(0, dict(live), "setup")]
    at_peak = dict(live)
    for i, (s, d, _ph, _mb, _mod, _op) in enumerate(tr.events):
        live[category(s)] += d
        if i == tr.peak_index:
            at_peak = dict(live)
        if timeline:
            points.append((i + 1, dict(live), phases[i]))
    out = {"peak_bytes": tr.peak, "start_bytes": tr.start_bytes, "end_bytes": tr.cur if tr.active else tr.end_bytes,
           "events": len(tr.events), "gc_runs": tr.gc_runs, "gc_freed_bytes": tr.gc_freed,
           "at_peak": {c: b for c, b in at_peak.items() if b}}

    def where(i: int) -> dict:
        if i < 0:
            return {"phase": "setup", "micro_batch": None, "module": None, "op": None, "event": 0}
        _s, _d, _ph, mb, mod, op = tr.events[i]
        return {"phase": phases[i], "micro_batch": mb, "module": tr.module_names.get(mod, None) if mod is not None
                else None, "op": str(op) if op is not None else None, "event": i + 1}

    out["where"] = where(tr.peak_index)
    out["worker_freed_bytes"] = sum(w[1] for w in tr.worker_frees.values())
    if tr.worker_frees:
        # the peak and its parts in the framework's own order, without the worker threads' timing:
        # a late free can move the measured peak to another moment, whose parts are that moment's
        # (the reconcile compares the ledger's parts with these, analysis/compare.py)
        best, most, at_best, best_at = prompt_replay(tr, category, start)
        out["prompt_peak_bytes"] = best
        out["prompt_at_peak"] = {c: b for c, b in at_best.items() if b}
        out["prompt_where"] = where(best_at)  # where the peak is in the framework's own order
    else:
        most = None
        out["prompt_peak_bytes"] = tr.peak
    if tr.cuda_seen:  # to compare with torch.cuda.max_memory_allocated() after its per-step reset
        out["peak_allocated_bytes"] = tr.peak_blocks
    # what CUDA's caching allocator would hold for this step's sequence (ledger/cuda_allocator.py): its
    # allocated and reserved peaks; on a GPU, beside torch.cuda's own (analysis/gpu_check.py)
    out["cuda_allocator_sim"] = tr.allocator_replay()
    if timeline:
        out["timeline"] = thin(points, tr.peak_index + 1)
        # the timeline's most live bytes per category had the worker threads freed promptly (its
        # thread-timing range: [prompt_most, the timeline's most])
        if most is None:
            most = prompt_replay(tr, category, start)[1]
        out["prompt_most"] = {c: b for c, b in most.items() if b}
        out["census"] = census(tr, category, phases)
    return out

def census(tr, category, phases: list[str], n: int = CENSUS_GROUPS) -> list[dict]:
    """What is live at the peak, by where it was made: the storages live at the peak event grouped
    by (category, the phase, micro-batch, module and operator of the event that last allocated
    them: a storage resized to nothing and back counts from its new allocation; `start` for what
    was live when the step began), each group's bytes, storages and largest storage; the n
    largest groups, the rest summed in one row. Sums to peak_bytes."""
    live: dict[int, list] = {s: [nb, -1] for s, nb in tr.start_serials.items()}
    for i in range(tr.peak_index + 1):
        s, d = tr.events[i][0], tr.events[i][1]
        e = live.get(s)
        if e is None:
            live[s] = [d, i]
        else:
            e[0] += d
            if e[0] == 0:
                del live[s]
    groups: dict[tuple, list[int]] = {}
    for s, (nb, i) in live.items():
        if i < 0:
            key = (category(s), "start", None, None, None)
        else:
            _s, _d, _ph, mb, mod, op = tr.events[i]
            key = (category(s), phases[i], mb, tr.module_names.get(mod) if mod is not None else None,
                   str(op) if op is not None else None)
        g = groups.setdefault(key, [0, 0, 0])
        g[0] += nb
        g[1] += 1
        g[2] = max(g[2], nb)
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    out = [{"category": c, "phase": ph, "micro_batch": mb, "module": mod, "op": op, "bytes": b,
            "storages": k, "largest": big} for (c, ph, mb, mod, op), (b, k, big) in rows[:n]]
    if len(rows) > n:
        rest = rows[n:]
        out.append({"category": "rest", "phase": None, "micro_batch": None, "module": None, "op": None,
                    "bytes": sum([v[0] for _, v in rest]), "storages": sum([v[1] for _, v in rest]),
                    "largest": max([v[2] for _, v in rest])})
    return out

def prompt_replay(tr, category, start: dict[str, int]) -> tuple[int, dict[str, int], dict[str, int], int]:
    """The step's events replayed with every storage a worker thread freed freed right after the main
    thread's last use of it: (the most live bytes in all, the most live bytes of each category
    (category(serial) names a storage's), each category's live bytes at that most in all, the
    index of the event reaching it, -1 for none). A free
    is its storage's last event (read from the events, not noted by the worker thread: the main
    thread may append between the worker's append and any index it took)."""
    frees = dict(tr.worker_frees)
    events = tr.events[:]
    last = {ev[0]: i for i, ev in enumerate(events) if ev[0] in frees}
    moved: dict[int, list[tuple[int, int]]] = {}  # event index -> (serial, bytes) freed just before it
    skip = set()
    for s, (use, nb) in frees.items():
        f = last.get(s)
        if f is not None and use <= f:
            moved.setdefault(use, []).append((s, nb))
            skip.add(f)
    live = dict(start)
    cur = best = sum(start.values())
    most = dict(live)
    at_best = dict(live)
    best_at = -1
    for i, ev in enumerate(events):
        for s, nb in moved.get(i, ()):
            live[category(s)] -= nb
            cur -= nb
        if i not in skip:
            c = category(ev[0])
            live[c] += ev[1]
            cur += ev[1]
            if live[c] > most[c]:
                most[c] = live[c]
        if cur > best:  # the first moment at the most, as the measured peak's (peak_index)
            best = cur
            at_best = dict(live)
            best_at = i
    return best, most, at_best, best_at


def phases_of(events) -> list[str]:
    """forward / backward from where the event happened; an event outside both is `setup` before the
    first forward, `optimizer` after the last forward or backward, `schedule` in between (the loss,
    pipeline sends, gradient syncs the schedule runs between micro-batches)."""
    marks = [i for i, e in enumerate(events) if e[2] != "other"]
    first, last = (marks[0], marks[-1]) if marks else (len(events), -1)
    out = []
    for i, e in enumerate(events):
        if e[2] != "other":
            out.append(e[2])
        elif i < first:
            out.append("setup")
        elif i > last:
            out.append("optimizer")
        else:
            out.append("schedule")
    return out


def thin(points: list, peak_event: int, n: int = TIMELINE_POINTS) -> list[dict]:
    """At most ~n points: the first, the last, the peak, and per bucket its highest point, so no
    extreme is lost when a long step is drawn."""
    def total(p):
        return sum(p[1].values())

    if len(points) > n:
        size = -(-len(points) // n)
        keep = {0, len(points) - 1, peak_event}
        for b in range(0, len(points), size):
            bucket = points[b:b + size]
            keep.add(b + max(range(len(bucket)), key=lambda j: total(bucket[j])))
        points = [points[i] for i in sorted(keep)]
    return [{"event": e, "phase": ph, **{c: b for c, b in live.items() if b}} for e, live, ph in points]
