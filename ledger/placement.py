"""What a prediction is: per-rank resident state bytes and per-step collectives (the contract).

`Placement.per_rank` may be large (a million ranks); ranks that are provably identical share one
`RankState` (same object), so predicting a big layout costs one computation per distinct rank, and its
record lists each distinct state once with the ranks that hold it (Placement.rank_classes).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional

import numpy as np

from ledger.units import PEAK_PARTS, STATES, fmt  # noqa: F401  (ledger.placement.fmt / .STATES / .PEAK_PARTS, as before)

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv", "all_to_all", "broadcast")
_DETAIL_PREFIX = {s: s[:-len("_bytes")] + "/" for s in STATES}  # RankState.detail keys: "optim/adam step"


def wire_bytes(kind: str, buffer_bytes: int, group_size: int) -> int:
    """Bytes one rank sends under the ring algorithm for a buffer handed to a collective.

    all_gather / reduce_scatter buffers are the full (unsharded) tensor; send_recv buffers
    count what is sent (see Comm.buffer_bytes)."""
    n = group_size
    if n <= 1:
        return 0
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        return buffer_bytes * (n - 1) // n
    if kind == "all_reduce":
        return 2 * buffer_bytes * (n - 1) // n
    if kind == "send_recv":
        return buffer_bytes
    raise ValueError(f"collective kind {kind!r} unknown; known: {KINDS}")


@dataclass(slots=True)  # slots: a search builds ~10 per layout, and slotted ones build faster
class Comm:
    """Collectives of one (dim, kind, dtype) per rank per optimizer step.

    buffer_bytes: bytes of the tensors handed to the collectives, summed over `count` calls
    (all_gather/reduce_scatter: the full gathered tensor; send_recv: sent and received tensors).
    """
    dim: str
    kind: str
    count: int
    buffer_bytes: int
    wire_bytes: int
    dtype: str = ""
    what: str = ""  # which framework call, for people
    # (low, high) of buffer_bytes where the sizes follow data (an MoE router's choices): buffer_bytes is
    # then the balanced case; None: exact
    buffer_range: Optional[tuple[int, int]] = None
    # of buffer_bytes, the calls a forward pass makes, where the ledger says which pass each call runs in
    # (the step-time model hides each pass's collectives behind that pass); None: not said
    forward_buffer_bytes: Optional[int] = None

    def to_dict(self) -> dict:
        d = {"dim": self.dim, "kind": self.kind, "count": self.count, "buffer_bytes": self.buffer_bytes,
             "wire_bytes": self.wire_bytes, "dtype": self.dtype, "what": self.what}
        if self.buffer_range is not None:
            d["buffer_range"] = list(self.buffer_range)
        if self.forward_buffer_bytes is not None:
            d["forward_buffer_bytes"] = self.forward_buffer_bytes
        return d


class _Lazy:
    """A field that may be given a zero-argument callable instead of its value: called on first read
    (a search reads the most-loaded rank's memory only; its collectives may never be asked for)."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass default
        v = obj.__dict__.get(self.slot)
        if callable(v):
            v = obj.__dict__[self.slot] = v()
        return v

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = value


_KNOWN_PARTS = frozenset(PEAK_PARTS)


@dataclass
class Peak:
    """A rank's most live bytes within one optimizer step, and its parts at that moment.

    parts: PEAK_PARTS -> bytes, summing to `bytes`; detail: finer named pieces for people
    ("activations/layer 0 mlp", "temporary/logits fp32"); phase: forward | backward | schedule |
    optimizer, as the probe names where it happened; first: step 0's peak where it differs (the
    optimizer's state is allocated in the first step)."""
    bytes: int
    parts: dict[str, int]
    phase: str = ""
    what: str = ""
    detail: dict[str, int] = field(default_factory=dict)
    first: Optional["Peak"] = None
    # the step as the ledger sees it, in order: [{"label": "mb 0 forward", "phase": "forward",
    # <part>: bytes, ...}, ...] (optional; the report draws it above the measured timeline)
    timeline: list[dict] = field(default_factory=list)
    # (low, high): the peak's range where its bytes follow data (an MoE router's drop-less dispatch:
    # no rows and the most rows to this rank's experts), `bytes` being the balanced case; None: exact
    bound: Optional[tuple[int, int]] = None

    def __post_init__(self):
        if not _KNOWN_PARTS.issuperset(self.parts):
            unknown = set(self.parts) - _KNOWN_PARTS
            raise ValueError(f"peak parts {sorted(unknown)} unknown; known: {PEAK_PARTS}")
        if sum(self.parts.values()) != self.bytes:
            raise ValueError(f"peak parts sum to {sum(self.parts.values())}, not its bytes {self.bytes}")

    @classmethod
    def of(cls, parts: dict[str, int], phase: str = "", what: str = "", **rest) -> "Peak":
        """A peak whose bytes are its parts' sum (the one way the ledgers build one)."""
        return cls(sum(parts.values()), parts, phase, what, **rest)

    def plus(self, lines: dict[str, int]) -> "Peak":
        """This peak with more named bytes, live at its moment: lines "part/name" -> bytes, each added to
        its part and named in the detail (lines of 0 bytes left out)."""
        parts, detail = dict(self.parts), dict(self.detail)
        for key, v in lines.items():
            if v:
                part = key.split("/", 1)[0]
                parts[part] = parts.get(part, 0) + v
                detail[key] = v
        # (built directly: dataclasses.replace's generic path is most of this method's cost in a plan's walks)
        return Peak(sum(parts.values()), parts, self.phase, self.what, detail, self.first, self.timeline, self.bound)

    def to_dict(self) -> dict:
        d = {"bytes": self.bytes, "parts": dict(self.parts), "phase": self.phase, "what": self.what,
             "detail": dict(self.detail)}
        if self.first is not None:
            d["first"] = self.first.to_dict()
        if self.timeline:
            d["timeline"] = [dict(p) for p in self.timeline]
        if self.bound is not None:
            d["bound"] = list(self.bound)
        return d


@dataclass
class RankState:
    stage: int = 0
    params_bytes: int = 0
    grads_bytes: int = 0
    optim_bytes: int = 0
    other_bytes: int = 0
    # the part of the four states kept in host memory (DeepSpeed's ZeRO-Offload); the rest is the device's
    host_bytes: int = 0
    _comm: Optional[list[Comm]] = field(default=None, repr=False)
    # computes `comm` on first use: finding the most-loaded rank of a big layout needs memory only
    comm_fn: Optional[Callable[[], list[Comm]]] = field(default=None, repr=False, compare=False)
    # the first (tracing / warm-up) step where it differs from steady state; None = same (may be
    # given as a callable returning either)
    comm_first: Optional[list[Comm]] = _Lazy()
    # steps 1..k when a framework's warm-up spans more than one optimizer step (DeepSpeed ZeRO-3
    # completes its trace in the second forward); these steps are reported as phase "first" too
    # (may be given as a callable, like comm_first)
    comm_warmup: Optional[list[list[Comm]]] = _Lazy()
    detail: dict[str, int] = field(default_factory=dict)  # named parts of the four states
    # the peak within a step (None where the framework's ledger does not model it yet); may be
    # given as a callable, like comm_first: a search that asks resident state only never builds it
    peak: Optional[Peak] = _Lazy()

    @property
    def comm(self) -> list[Comm]:
        """Collectives per optimizer step, steady state."""
        if self._comm is None:
            self._comm = self.comm_fn() if self.comm_fn is not None else []
        return self._comm

    @comm.setter
    def comm(self, value: list[Comm]) -> None:
        self._comm = value

    @property
    def resident_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optim_bytes + self.other_bytes

    def totals(self) -> dict[str, int]:
        """The four states by their short names (params, grads, optim, other): a peak's resident lines."""
        return {"params": self.params_bytes, "grads": self.grads_bytes, "optim": self.optim_bytes,
                "other": self.other_bytes}

    def add(self, state: str, name: str, nbytes: int) -> None:
        self.__dict__[state] += nbytes  # one of STATES (a plain field: no setattr machinery needed)
        key = _DETAIL_PREFIX[state] + name
        self.detail[key] = self.detail.get(key, 0) + nbytes


def wire_sum(kind: str, buffers, group_size: int) -> int:
    """wire_bytes of one call per buffer, summed (each call floored on its own); many buffers (DDP
    buckets) through numpy's integer arithmetic."""
    if len(buffers) > 32:
        return int(wire_bytes(kind, np.asarray(buffers, np.int64), group_size).sum())
    return sum(wire_bytes(kind, int(b), group_size) for b in buffers)


class CommBuilder:
    """Accumulates collectives by (dim, kind, dtype): the one merge rule of the ledgers' records
    (counts, buffer bytes and wire bytes summed; `what` the calls' distinct names, what_of)."""

    def __init__(self):
        self._acc: dict[tuple, list] = {}
        self._range: dict[tuple, tuple[int, int]] = {}  # add_routed's (low, high) offsets per key

    def add_calls(self, dim: str, kind: str, dtype: str, count: int, buffer_bytes: int, wire: int,
                  what: str = "") -> "CommBuilder":
        """`count` calls already summed: their buffer bytes and wire bytes (each call's wire floored
        on its own, placement.wire_bytes). Every other add goes through here or add_sums."""
        if count == 0:
            return self
        return self.add_sums((dim, kind, dtype), count, buffer_bytes, wire, [what] if what else [])

    def add_sums(self, key: tuple[str, str, str], count: int, buffer_bytes: int, wire: int,
                 whats: list[str], forward_bytes: Optional[int] = None) -> "CommBuilder":
        """Several call sites' sums at once, into the record of key = (dim, kind, dtype); whats: their
        names (repeats allowed), a list the builder keeps and extends; forward_bytes: of buffer_bytes, those
        of calls a forward pass makes (None: not said, and then not said for the record)."""
        a = self._acc.get(key)
        if a is None:
            self._acc[key] = [count, buffer_bytes, wire, whats, forward_bytes]
        else:
            a[0] += count
            a[1] += buffer_bytes
            a[2] += wire
            a[3] += whats
            a[4] = None if a[4] is None or forward_bytes is None else a[4] + forward_bytes
        return self

    def add(self, dim: str, kind: str, buffer_bytes: int, group_size: int, dtype: str = "",
            count: int = 1, what: str = "") -> "CommBuilder":
        if group_size <= 1 or count == 0:
            return self  # a group of one sends nothing; the probe ignores such calls too
        return self.add_sums((dim, kind, dtype), count, buffer_bytes * count,
                             wire_bytes(kind, buffer_bytes, group_size) * count, [what] if what else [])

    def add_several(self, dim: str, kind: str, dtype: str, group_size: int, calls) -> "CommBuilder":
        """Several call sites' calls of one (dim, kind, dtype), each (buffer bytes, how many times,
        what) or (..., whether a forward pass makes them; None: not said): the same as add() of each, summed
        before they meet the record (one merge); the forward ones' bytes kept where every call says its pass."""
        if group_size <= 1:
            return self
        count = buf = wire = 0
        forward: Optional[int] = 0
        whats = []
        for call in calls:
            b, c, what = call[:3]
            if c:
                count += c
                buf += b * c
                wire += wire_bytes(kind, b, group_size) * c
                if what:
                    whats.append(what)
                forward = (None if forward is None or len(call) < 4 or call[3] is None
                           else forward + (b * c if call[3] else 0))
        if count:
            self.add_sums((dim, kind, dtype), count, buf, wire, whats, forward)
        return self

    def add_routed(self, dim: str, kind: str, dtype: str, group_size: int, what: str, calls) -> "CommBuilder":
        """Calls whose buffers follow data, each (predicted buffer bytes, how many times, lowest and
        highest bytes above the prediction per call): the record's buffer_range spans them."""
        if group_size <= 1:
            return self
        low = high = 0
        for b, c, lo, hi in calls:
            self.add(dim, kind, b, group_size, dtype, count=c, what=what)
            low, high = low + lo * c, high + hi * c
        self._range[(dim, kind, dtype)] = tuple(x + y for x, y in zip(self._range.get((dim, kind, dtype), (0, 0)),
                                                                      (low, high)))
        return self

    def add_token_all_to_all(self, dim: str, dtype: str, group_size: int, what: str, own_rows: int,
                             most_rows: int, row_bytes: int, calls_each_side: int) -> "CommBuilder":
        """An MoE token dispatcher's all-to-alls, bytes sent by a rank: calls_each_side on the side of its
        own tokens (own_rows, fixed: the dispatch, the combine's backward) and as many on its experts'
        side, where the router decides the rows (0 to most_rows; predicted own_rows, the balanced case:
        the combine, the dispatch's backward)."""
        own = own_rows * row_bytes
        return self.add_routed(dim, "all_to_all", dtype, group_size, what,
                               [(own, calls_each_side, 0, 0),
                                (own, calls_each_side, -own, (most_rows - own_rows) * row_bytes)])

    def add_each(self, dim: str, kind: str, buffers: list[int], group_size: int, dtype: str = "",
                 what: str = "") -> "CommBuilder":
        """One call per buffer (e.g. one per DDP bucket); the same as add() for each."""
        if group_size <= 1:
            return self
        return self.add_calls(dim, kind, dtype, len(buffers), int(sum(buffers)), wire_sum(kind, buffers, group_size),
                              what)

    def add_p2p(self, dim: str, sent_bytes: int, received_bytes: int, dtype: str = "", what: str = "",
                times: int = 1) -> "CommBuilder":
        """`times` exchanges, each sending sent_bytes and receiving received_bytes (0: that side absent)."""
        if times <= 0:
            return self
        return self.add_calls(dim, "send_recv", dtype, ((sent_bytes > 0) + (received_bytes > 0)) * times,
                              (sent_bytes + received_bytes) * times, sent_bytes * times, what)

    def build(self) -> list[Comm]:
        """The records, sorted by (dim, kind, dtype)."""
        acc, out = self._acc, []
        for key in _sorted_keys(tuple(acc)):
            c, b, w, s, fwd = acc[key]
            out.append(Comm(key[0], key[1], c, b, w, key[2], s[0] if len(s) == 1 else what_of(s),
                            forward_buffer_bytes=fwd))
            if key in self._range:
                lo, hi = self._range[key]
                out[-1].buffer_range = (b + lo, b + hi)
        return out


@lru_cache(maxsize=1024)
def _sorted_keys(keys: tuple[tuple[str, str, str], ...]) -> tuple:
    # cached: the layouts of one structure add the same records in the same order
    return tuple(sorted(keys))


def what_of(names) -> str:
    """A record's `what`: the distinct names of its calls, sorted and joined ("" for none)."""
    return _what_of(tuple(names))


@lru_cache(maxsize=1024)
def _what_of(names: tuple[str, ...]) -> str:
    # cached: the layouts of one structure name the same calls
    return "; ".join(sorted(set(names)))


@dataclass(kw_only=True)
class Placement:
    framework: str
    mode: str
    # the shape's and the layout's records (model_dict, Layout.to_dict), each may be given as a
    # zero-argument callable: a search reads neither, and building both costs ~1 µs per layout
    model: dict = _Lazy()
    layout: dict = _Lazy()
    world: int
    rank_state: Callable[[int], RankState]  # rank -> its (possibly shared) state
    notes: list[str] = field(default_factory=list)
    # ranks among which per_gpu finds the most-loaded one (the first of them on ties; None = all
    # ranks): a ledger that knows which ranks can be heaviest names a handful instead of 16,384
    representatives: Optional[list[int]] = None
    # stage -> the ranks among which that pipeline stage's most-loaded rank is found (None: each of
    # the stage's ranks); the planner's per-stage peak of a 16,384-rank layout reads a handful
    stage_representatives: Optional[Callable[[int], list[int]]] = None
    # the framework's variant the prediction follows where it has several (Megatron's transformer_impl)
    spec: str = ""
    # the run the prediction is for (ledger/target.py: cpu-gloo or cuda-nccl; "" for the textbook ledger)
    target: str = ""
    # cuda-nccl: device memory outside PyTorch's allocator per rank, named (ledger/cuda.py fixed_costs)
    outside_allocator: dict[str, int] = field(default_factory=dict)
    # cuda-nccl: buffers the framework's kernels keep beside the tensors its ledger counts, named (e.g.
    # TransformerEngine's cuBLAS workspace); ledger/cuda.py adds them to outside_allocator
    workspaces: dict[str, int] = field(default_factory=dict)
    # what a prediction no run here can confirm rests on ("from sources: ..."; "" where runs confirm it)
    basis: str = ""
    _per_gpu: Optional[RankState] = None

    @property
    def per_rank(self) -> list[RankState]:
        return [self.rank_state(r) for r in range(self.world)]

    @property
    def per_gpu(self) -> RankState:
        """The most-loaded rank (largest resident bytes)."""
        if self._per_gpu is None:
            seen, best = set(), None
            for r in self.representatives if self.representatives is not None else range(self.world):
                s = self.rank_state(r)
                if id(s) in seen:
                    continue
                seen.add(id(s))
                if best is None or s.resident_bytes > best.resident_bytes:
                    best = s
            self._per_gpu = best
        return self._per_gpu

    @property
    def comm(self) -> list[Comm]:
        return self.per_gpu.comm

    def by_kind(self) -> dict[str, int]:
        """Wire bytes per collective kind of the most-loaded rank, per optimizer step."""
        out: dict[str, int] = defaultdict(int)
        for c in self.comm:
            out[c.kind] += c.wire_bytes
        return dict(out)

    def by_dim(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for c in self.comm:
            out[c.dim] += c.wire_bytes
        return dict(out)

    def rank_classes(self) -> list[tuple[RankState, list[list[int]]]]:
        """The ranks grouped by the state they share (one object: the ledgers share a state between
        ranks that are provably alike), each class with its runs of consecutive ranks [first, last],
        in the order of their first ranks. A world of a million ranks is a handful of classes."""
        classes: dict[int, tuple[RankState, list[list[int]]]] = {}
        prev, run = None, None
        for r in range(self.world):
            s = self.rank_state(r)
            if s is prev:
                run[1] = r
                continue
            cls = classes.get(id(s))
            if cls is None:
                cls = classes[id(s)] = (s, [])
            run = [r, r]
            cls[1].append(run)
            prev = s
        return list(classes.values())

    def to_dict(self, all_ranks: bool = True) -> dict:
        """The prediction (prediction.json): its size grows with the distinct ranks, not the world:
        "rank_classes" lists each class of alike ranks once with its rank runs (records.rank_classes
        reads them). all_ranks=False: the class of rank 0 alone."""
        g = self.per_gpu
        classes = self.rank_classes() if all_ranks else [(self.rank_state(0), [[0, 0]])]
        out = {
            "framework": self.framework,
            "mode": self.mode,
            "model": self.model,
            "layout": self.layout,
            "world": self.world,
            "per_gpu": {k: getattr(g, k) for k in ("params_bytes", "grads_bytes", "optim_bytes", "resident_bytes")},
            "rank_classes": [_class_dict(runs, s) for s, runs in classes],
            "comm": [c.to_dict() for c in g.comm],
            "notes": self.notes,
        }
        if self.spec:  # only where a framework has variants: the other records stay as they were
            out["spec"] = self.spec
        if self.target:
            out["target"] = self.target
        if self.outside_allocator:
            out["outside_allocator"] = dict(self.outside_allocator)
        if self.basis:
            out["basis"] = self.basis
        return out

    def report(self, max_rows: int = 16, away_from_defaults: list[str] | None = None) -> str:
        from ledger.report import render

        return render(self, max_rows, away_from_defaults)


def _class_dict(runs: list[list[int]], s: RankState) -> dict:
    d = {"ranks": runs, "stage": s.stage}
    for k in (*STATES, "resident_bytes"):
        d[k] = getattr(s, k)
    if s.host_bytes:
        d["host_bytes"] = s.host_bytes
    d["detail"] = dict(s.detail)
    d["comm"] = [c.to_dict() for c in s.comm]
    if s.comm_first is not None:
        d["comm_first"] = [c.to_dict() for c in s.comm_first]
    if s.comm_warmup:
        d["comm_warmup"] = [[c.to_dict() for c in cs] for cs in s.comm_warmup]
    if s.peak is not None:
        d["peak"] = s.peak.to_dict()
    return d


