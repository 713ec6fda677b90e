"""Peak probe: every tensor storage live during a step, its bytes over time, and where the peak is.

What it sees, and how:
- every storage an operator returns or takes (a TorchDispatchMode, as the comm probe; it defers to
  DTensor so DTensor's inner local ops come back to it), so an allocation no launcher names is
  counted; FakeTensor storages too (cluster=fake), which have sizes and no memory;
- every storage live when the step starts, found by a scan of the interpreter's objects (tensors and
  storages, `gc.get_objects()`), independent of the containers the launchers name;
- frees as they happen: a weak reference on each storage (torch keeps one Python object per
  storage, so the callback runs when the storage itself dies);
- storage resizes, which are not dispatched operators (FSDP2 allocates and frees its unsharded
  parameters with `untyped_storage().resize_()`, torch/distributed/utils.py _alloc_storage /
  _free_storage): `torch.UntypedStorage.resize_` is wrapped while a tracker lives.

Not seen: memory an operator's kernel allocates and frees inside itself (scratch); the test
tests/test_peak.py checks this tracker against torch.profiler's allocator events for that reason.

Thread timing. A storage an asynchronous collective holds dies when its last reference drops, and
that may be a c10d worker thread's: gloo's worker (ProcessGroupGloo runLoop) marks the work complete,
which wakes the main thread's wait(), and only then releases the work and the tensors it holds. The
main thread may by then have gone on and allocated, so such a storage can be live at a moment the
framework no longer needs it, by as many operators as the scheduler lets pass: the measured peak
depends on thread timing by those bytes (CI's loaded machines showed 1.5% and 3.6%). The probe knows
each free's thread, so it says how much: `prompt_peak_bytes` is the step's peak recomputed with every
storage a worker thread freed freed instead right after the main thread's last use of it (the least
any timing can give), and `worker_freed_bytes` what worker threads freed. The reconcile judges a peak
against that range (analysis/compare.py off); it is not a tolerance: where no worker freed a storage
live at the peak, the range is the one measured value.

Each change is an event (storage, +/- bytes, phase, micro-batch, module). Categories are given when
the step ends: the launcher's named groups (params / grads / optim / other, from the state probe at
this boundary and the previous one), `activations` (saved for backward: a saved_tensors_hooks pack
hook sees every tensor autograd saves outside a non-reentrant checkpoint's own hooks),
`gathered` (a buffer a collective wrote or read that is not a named state: ZeRO-3 / FSDP2 gathered
parameters, buckets), `unnamed` (live at the start, named by no launcher: the previous batch, caches)
and `temporary` (everything else).
"""
from __future__ import annotations

import gc
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ledger.cuda_allocator import CachingAllocator
from probes import peak_analysis
from probes.comm import is_collective, observed
from probes.comm_time import PENDING

# CUDA's caching allocator hands out blocks in multiples of 512 bytes, at least 512
# (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, round_size): what allocated_bytes counts
CUDA_BLOCK = 512


_WRAPPER: dict[type, bool] = {}  # tensor type -> whether it is a traceable wrapper subclass


def _storage(t):
    t = _unwrap(t)
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor with no storage (sparse, nested)
        return None


def _unwrap(t):
    """The tensor holding a wrapper subclass's memory. A traceable wrapper subclass (DTensor: its local
    shard; _functional_collectives.AsyncCollectiveTensor: the collective's output, `elem`) is made by
    _make_wrapper_subclass: its own storage has the wrapped size and no data (its data pointer is
    invalid), and each view or detach of it is a new wrapper with a new such storage, so counting it
    counted memory that is not there (measured: torchtitan's SP all-gather with a micro-batch of one,
    whose AsyncCollectiveTensor the colwise linears view and detach, showed five phantom [T, h] copies a
    layer). FakeTensor (cluster=fake) is no wrapper: its storage is the one counted."""
    tp = type(t)
    if tp is torch.Tensor:
        return t
    w = _WRAPPER.get(tp)
    if w is None:
        w = _WRAPPER[tp] = hasattr(tp, "__tensor_flatten__")
    while w:
        # (DTensor flattens to its local tensor and its device mesh, which is no tensor)
        inner = [x for x in (getattr(t, a) for a in t.__tensor_flatten__()[0]) if isinstance(x, torch.Tensor)]
        if len(inner) != 1:  # several inner tensors: none is the one; the walk of the op sees them
            return None
        t = inner[0]
        tp = type(t)
        w = tp is not torch.Tensor and _WRAPPER.setdefault(tp, hasattr(tp, "__tensor_flatten__"))
    return t


def _tensors(x, out: list) -> list:
    """The tensors among an operator's arguments or results: themselves, or in a list / tuple / dict
    one level down (out= lists, foreach ops, c10d's tensor lists); a hand-written walk, as pytree's
    costs more than the rest of the probe per operator."""
    for a in x:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    out.append(b)
                elif isinstance(b, (list, tuple)):
                    out += [c for c in b if isinstance(c, torch.Tensor)]
        elif isinstance(a, dict):
            _tensors(a.values(), out)
    return out


class _ReferenceMode(TorchDispatchMode):
    """The readable per-operator path: every tensor an operator takes or returns goes through
    PeakTracker.see (_see_tensors). _Mode below is the one recording() uses; tests/test_peak.py checks
    that the two record the same events."""

    def __init__(self, tracker: "PeakTracker", on_collective=None):
        super().__init__()
        self.tracker = tracker
        # the comm probe's CommProbe.observe when it records the same step (probes/session.py): one
        # Python mode per operator instead of two
        self.on_collective = on_collective
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor

    @staticmethod
    def _see_tensors(tr: "PeakTracker", tensors: list) -> None:
        for t in tensors:  # a storage made outside the dispatcher, or resized since, shows here first
            tr.see(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dt = self._dtensor
        for t in types:
            if issubclass(t, dt):
                return NotImplemented
        if PENDING:
            PENDING.clear()  # the Works issued before are the caller's now (comm_time.PENDING)
        tr = self.tracker
        tr.op = func
        ins = _tensors(args, [])
        if kwargs:
            _tensors(kwargs.values(), ins)
        else:
            kwargs = {}
        self._see_tensors(tr, ins)
        coll = is_collective(func)
        after = (self.on_collective(func, args, kwargs)
                 if self.on_collective is not None and (coll or observed(func, types)) else None)
        out = func(*args, **kwargs)
        if after is not None:
            after(out)
        outs = _tensors((out,), [])
        self._see_tensors(tr, outs)
        if coll:
            for t in ins + outs:
                tr.mark(t, tr.comm)
        return out


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _see_all(tr: "PeakTracker", tensors: list) -> None:
    """tr.see(t) for each t, the known-storage case inlined (_Mode's)."""
    live = tr._live
    events = tr.events
    for t in tensors:
        if type(t) in _PLAIN:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue  # no storage (sparse, nested): see() would find none
            e = live.get(st._cdata)
            if e is not None and e[0] == st.nbytes():
                e[4] = tr._base + len(events)
                continue
        tr.see(t)


class _Mode(_ReferenceMode):
    """_ReferenceMode with the common case inlined (_see_all): a plain tensor (or Parameter) whose
    storage the tracker knows at the same size only updates that storage's last use, which is what
    see() does for it; everything else takes see(). The probe's cost is mostly this loop (two to four
    tensors an operator, thousands of operators a step)."""

    _see_tensors = staticmethod(_see_all)


_TRACKERS: list["PeakTracker"] = []
_SCAN_TYPES: dict[type, int] = {}  # type -> 1 tensor, 2 storage, 0 neither (gc scans see ~500k objects)
# weak references to the tensors and storages among the objects freeze_imports() moved out of the
# collector's generations (gc.freeze: gc.get_objects() no longer lists them), so that scan() still sees them
_FROZEN: list = []


def freeze_imports() -> int:
    """For a fork server, after it imported the framework and before it forks a rank: move every
    object alive now (~450k: the imported modules) into the collector's permanent generation
    (gc.freeze(), as the gc module's documentation advises before fork() without exec()), so a
    rank's cyclic collections no longer walk them and a scan() walks only what the job made. The
    tensors and storages among them (measured: none for DeepSpeed, one 4-byte tensor for Megatron
    and torchtitan) stay visible to scan() through _FROZEN, so a forked rank's scan sees what a
    spawned rank's sees (tests/test_forkserver.py). Returns how many it keeps."""
    gc.collect()
    for o in gc.get_objects():
        if isinstance(o, (torch.Tensor, torch.UntypedStorage)):
            _FROZEN.append(weakref.ref(o))
    gc.freeze()
    return len(_FROZEN)
_ORIG_RESIZE = None
# DTensor's sharding propagation (torch/distributed/tensor/_sharding_prop.py
# _propagate_tensor_meta_non_cached) runs each new op signature once on global-shape fake tensors to
# learn its output's metadata, in the active FakeTensorMode: on the fake world (cluster=fake) the
# world's own mode, so its fakes looked like the world's tensors (measured: torchtitan FSDP4 x TP2's
# first optimizer step, 735 full-size fp32 copies of its parameters, 24 GB, where the steady steps'
# cached propagation makes none). While it runs, meta storages are not memory.
_PROPAGATING = [0]
_ORIG_PROPAGATE = None


def _install_propagation_hook() -> None:
    global _ORIG_PROPAGATE
    if _ORIG_PROPAGATE is not None:
        return
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    _ORIG_PROPAGATE = ShardingPropagator._propagate_tensor_meta_non_cached

    def _propagate_tensor_meta_non_cached(self, *args, **kwargs):
        _PROPAGATING[0] += 1
        try:
            return _ORIG_PROPAGATE(self, *args, **kwargs)
        finally:
            _PROPAGATING[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = _propagate_tensor_meta_non_cached


def _install_resize_hook() -> None:
    global _ORIG_RESIZE
    if _ORIG_RESIZE is not None:
        return
    _ORIG_RESIZE = torch.UntypedStorage.resize_

    def resize_(self, size):
        out = _ORIG_RESIZE(self, size)
        for tr in _TRACKERS:
            tr.see_storage(self)
        return out

    torch.UntypedStorage.resize_ = resize_


class PeakTracker:
    """Live storage bytes of one rank, exact at every dispatched operator, kept across steps."""

    def __init__(self, fake_world: bool = False):
        # fake_world (cluster=fake): the run's tensors are FakeTensors, whose (meta) storages have sizes
        # and no data; they are what is counted. Elsewhere a FakeTensor holds no memory and is not
        # counted: DTensor's sharding propagation runs each op on fake tensors inside the op, which this
        # mode sees (measured: 2-6 KB of phantoms alive inside every TP linear of a small test module)
        self.fake_world = fake_world
        # StorageImpl address -> [nbytes, weakref, serial, on cuda, the main thread's last use (an event
        # number counted over all steps)]
        self._live: dict[int, list] = {}
        self._main = threading.main_thread().ident
        # c10d worker threads free storages (weakref callbacks, _freed) while the main thread counts: the
        # live set, the running bytes and the step's start change under this lock (re-entrant: a free can
        # run on the main thread inside a count, through the cyclic collector)
        self._lock = threading.RLock()
        self._base = 0  # events of the steps before this one
        self.worker_frees: dict[int, tuple[int, int]] = {}  # serial -> (the main thread's last use, bytes)
        # the CUDA allocator's view: CUDA storages counted in 512-byte blocks (CPU ones as they are)
        self.cur_blocks = 0
        self.peak_blocks = 0
        self.cuda_seen = False
        self._serial = 0
        self.cur = 0
        self.active = False
        self.events: list[tuple] = []
        self.saved: set[int] = set()
        self.comm: set[int] = set()
        self.op = None
        self._stack: list = []
        self._roots: dict[int, int] = {}
        self.module_names: dict[int, str] = {}
        self._forwards: list[int] = []
        self._root = None
        self._in_gc = False
        self.gc_freed = 0  # bytes freed by the cyclic garbage collector during the step
        self.gc_runs = 0
        # the CUDA caching allocator simulated over the storages' sizes as they come and go, kept across
        # steps as a process's allocator is (allocator_replay)
        self.allocator = CachingAllocator()
        self._allocator_sizes: dict[int, int] = {}  # serial -> bytes, as the simulation has it
        _install_resize_hook()
        if fake_world:
            _install_propagation_hook()
        _TRACKERS.append(self)
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        self._in_gc = phase == "start"
        if self.active and phase == "start":
            self.gc_runs += 1

    # ---- what the launcher tells it
    def watch(self, roots) -> None:
        """The root modules (model chunks): a root's forward starts a micro-batch; their submodules
        are named by their qualified names."""
        for i, r in enumerate(roots):
            self._roots[id(r)] = i
            for name, m in r.named_modules():
                self.module_names.setdefault(id(m), name or type(r).__name__)
        self._forwards = [0] * len(self._roots)

    # ---- storages
    def see(self, t) -> None:
        st = _storage(t)
        if st is not None:
            self.see_storage(st)

    def see_storage(self, st) -> None:
        k = st._cdata
        nb = st.nbytes()
        if type(nb) is not int:  # a symbolic size (a FakeTensor under a ShapeEnv, left by a trace): no bytes
            return
        e = self._live.get(k)
        if e is None:
            dev = st.device.type
            if dev == "meta" and (not self.fake_world or _PROPAGATING[0]):
                return  # a FakeTensor's: no memory (fake_world above; DTensor's propagation: _PROPAGATING)
            self._serial += 1
            s = self._serial
            cuda = dev == "cuda"
            self.cuda_seen |= cuda
            e = self._live[k] = [nb, weakref.ref(st, lambda _r, k=k, s=s: self._freed(k, s)), s, cuda, 0]
            self._change(s, nb, _blocks(nb) if cuda else nb)
        elif e[0] != nb:  # resized since last seen
            d = nb - e[0]
            db = _blocks(nb) - _blocks(e[0]) if e[3] else d
            e[0] = nb
            self._change(e[2], d, db)
        e[4] = self._base + len(self.events)

    def _freed(self, k: int, s: int) -> None:
        with self._lock:
            e = self._live.get(k)
            if e is None or e[2] != s:
                return
            del self._live[k]
            self._change(s, -e[0], -_blocks(e[0]) if e[3] else -e[0])
            if self.active and e[0] and threading.get_ident() != self._main:
                # a c10d worker thread dropped the last reference (module docstring: thread timing)
                self.worker_frees[s] = (max(0, e[4] - self._base), e[0])

    def _change(self, serial: int, delta: int, blocks: int) -> None:
        if delta == 0:
            return
        with self._lock:
            self.cur += delta
            self.cur_blocks += blocks
            if self.active and self.cur_blocks > self.peak_blocks:
                self.peak_blocks = self.cur_blocks
            if self.active:
                if self._in_gc and delta < 0:
                    self.gc_freed -= delta
                self.events.append((serial, delta, self._phase(), self._micro_batch(), self._module(), self.op))
                if self.cur > self.peak:
                    self.peak = self.cur
                    self.peak_index = len(self.events) - 1

    def mark(self, t, into: set) -> None:
        st = _storage(t)
        if st is None:
            return
        self.see_storage(st)
        e = self._live.get(st._cdata)
        if e is not None:  # None: a symbolic size, not counted
            into.add(e[2])

    def serials(self, tensors) -> set[int]:
        out = set()
        for t in tensors:
            st = _storage(t) if isinstance(t, torch.Tensor) else None
            if st is not None:
                e = self._live.get(st._cdata)
                if e is not None:
                    out.add(e[2])
        return out

    def scan(self) -> int:
        """Register every storage reachable from a Python object (tensors and storages among
        `gc.get_objects()`, whatever holds them); the bytes of those that were not known before and
        are still live when the scan ends. Counted from the scan's own registrations, not as a
        difference of `cur`: a c10d worker thread may free a known storage meanwhile (module
        docstring: thread timing), which is no part of what the scan found."""
        first_new_serial = self._serial + 1
        kinds = _SCAN_TYPES
        frozen = [o for o in (r() for r in _FROZEN) if o is not None]
        for o in gc.get_objects() + frozen:
            tp = type(o)
            kind = kinds.get(tp)
            if kind is None:
                kind = kinds[tp] = (1 if issubclass(tp, torch.Tensor) else
                                    2 if issubclass(tp, torch.UntypedStorage) else 0)
            if not kind:
                continue
            try:
                if kind == 1:
                    self.see(o)
                elif o.device.type != "meta":
                    self.see_storage(o)
            except Exception:  # an object half torn down; it holds no memory we can read
                continue
        return sum(e[0] for e in list(self._live.values()) if e[2] >= first_new_serial)

    # ---- where we are
    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if self._stack else "other"

    def _micro_batch(self):
        return None if self._root is None else self._forwards[self._root] - 1

    def _module(self):
        return id(self._stack[-1]) if self._stack else None

    def _pre(self, module, args):
        i = self._roots.get(id(module))
        if i is not None:
            self._forwards[i] += 1
            self._root = i
        self._stack.append(module)

    def _post(self, module, args, out):
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    # ---- a step
    def begin(self, scan: bool) -> None:
        """scan: look for live storages the tracker has not seen (the first step: everything made
        before it); later steps know every storage an operator made or touched since."""
        self._base += len(self.events)
        self.events = []
        self.worker_frees = {}
        self.gc_freed = self.gc_runs = 0
        self.saved, self.comm = set(), set()
        self._stack = []
        self._forwards = [0] * len(self._roots)
        self._root = None
        if scan:
            self.scan()
        # the start's bytes, its storages and the step's first event agree: a worker thread's free waits
        # for the lock until the step has begun (then it is the step's event), and none runs on this
        # thread meanwhile (no cyclic collection; nothing here drops a tensor)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with self._lock:
                self.start_bytes = self.cur
                self.peak_blocks = self.cur_blocks
                self.start_serials = {e[2]: e[0] for e in list(self._live.values())}
                self.peak, self.peak_index = self.start_bytes, -1
                self.active = True
        finally:
            if collecting:
                gc.enable()

    def end(self) -> None:
        with self._lock:
            self.active = False
            self.end_bytes = self.cur

    def recording(self, on_collective=None, reference: bool = False):
        """The step's context: dispatch mode, saved-tensor hook, module hooks. on_collective(func, args,
        kwargs) is called before each collective operator runs (the comm probe's observe, when it
        records the same step), and what it returns, if anything, with the operator's output;
        reference: the readable per-operator path (_ReferenceMode)."""
        import contextlib

        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        tr = self

        def pack(t):
            tr.mark(t, tr.saved)
            # autograd keeps what pack returns. A tensor some op made (one with a grad_fn), returned as it
            # is, keeps that grad_fn, which may be the very node saving it (an op's own output: tanh's,
            # SDPA's): a cycle through C++ no collector sees, so a graph no backward frees (torch
            # pipelining's forward metadata inference on the first stage, whose inputs need no grad:
            # its backward inference runs no autograd) stays alive for good: the probe held one
            # micro-batch of activations (measured: 572,172 B on torchtitan pp2's stage 0, every later
            # step). Without hooks autograd saves an output without its grad_fn too (SavedVariable), so
            # such a tensor is saved detached (the same storage). A leaf is saved as it is: ZeRO-3
            # frees a gathered weight mm saved by swapping the Parameter's .data, which must reach the
            # saved tensor as it does without hooks
            return t if t.grad_fn is None else t.detach()

        @contextlib.contextmanager
        def ctx():
            h1 = register_module_forward_pre_hook(self._pre)
            h2 = register_module_forward_hook(self._post, always_call=True)
            try:
                mode = (_ReferenceMode if reference else _Mode)(self, on_collective)
                with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    yield
            finally:
                h1.remove()
                h2.remove()

        return ctx()

    def allocator_replay(self) -> dict:
        """The recorded step through the CUDA caching allocator's policy (ledger/cuda_allocator.py):
        first the simulation's live set made the step's start's (storages freed or made between steps,
        unseen, freed or allocated there, in serial order), then every event of the step in order.
        Returns its stats, the peaks this step's."""
        sim, sizes = self.allocator, self._allocator_sizes
        for s in [s for s in sizes if s not in self.start_serials]:
            sim.free(s)
            del sizes[s]
        for s in sorted(self.start_serials):
            nb = self.start_serials[s]
            if sizes.get(s) != nb:
                sim.resize(s, nb)
                sizes[s] = nb
        sim.reset_peaks()
        for s, d, *_ in self.events:
            nb = sizes.get(s, 0) + d
            sim.resize(s, nb)
            if nb > 0:
                sizes[s] = nb
            else:
                sizes.pop(s, None)
        return sim.stats()

    # ---- the step's record
    def result(self, named: dict[str, set[int]] | None, timeline: bool) -> dict:
        """peak_bytes, where it was, bytes by category at the peak; the timeline when asked
        (probes/peak_analysis.py reads the recorded step)."""
        return peak_analysis.result(self, named, timeline)

    def census(self, category, phases: list[str], n: int = peak_analysis.CENSUS_GROUPS) -> list[dict]:
        return peak_analysis.census(self, category, phases, n)


def _blocks(nbytes: int) -> int:
    return 0 if nbytes == 0 else max(CUDA_BLOCK, -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK)
