"""The peak probe (probes/peak.py) against torch.profiler's allocator events, and its bookkeeping."""
from __future__ import annotations

import gc
import json
from collections import Counter

import pytest
import torch

from ledger.grid import Grid
from probes.peak import PeakTracker
from probes.peak_analysis import thin as _thin
from probes.session import ProbeSession


def _mlp():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    return m, torch.optim.AdamW(m.parameters()), torch.randn(32, 64)


def _step(m, opt, x, micro_batches=1):
    opt.zero_grad(set_to_none=True)
    for _ in range(micro_batches):
        m(x).pow(2).sum().backward()
    opt.step()


def _profiled_allocations(fn) -> list[tuple[int, int, int]]:
    """(time, bytes, address) of every CPU allocator event while fn runs (negative bytes: a free)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        fn()
    out = []

    def walk(nodes):
        for e in nodes:
            f = e.extra_fields
            if type(f).__name__ == "_ExtraFields_Allocation":
                out.append((e.start_time_ns, f.alloc_size, f.ptr))
            walk(e.children)

    walk(p.profiler.kineto_results.experimental_event_tree())
    return sorted(out)


def test_tracker_sees_every_allocation_the_allocator_reports():
    m, opt, x = _mlp()
    _step(m, opt, x)  # the optimizer's state exists: steps 1.. allocate the same
    tr = PeakTracker()
    tr.begin(scan=True)
    with tr.recording():
        _step(m, opt, x)
    tr.end()
    allocs = _profiled_allocations(lambda: _step(m, opt, x))
    prof = Counter(b for _, b, _ in allocs if b > 0)
    mine = Counter(d for _s, d, *_ in tr.events if d > 0)
    # what the dispatcher cannot see: the scalars kernels wrap (4 / 8-byte wrapped numbers)
    missed = prof - mine
    assert mine - prof == Counter(), "the tracker counted an allocation the allocator did not make"
    assert missed and max(missed) <= 8, f"allocations the tracker missed: {missed}"
    # the peak over the step's own allocations: the allocator's running sum (frees of storages made
    # before profiling are unknown to it) against the tracker's, same step, same order
    cur = peak = 0
    known = set()
    for _t, b, ptr in allocs:
        if b > 0:
            known.add(ptr)
        if b > 0 or ptr in known:
            cur += b
            peak = max(peak, cur)
    cur = own = 0
    for s, d, *_ in tr.events:
        if s not in tr.start_serials:
            cur += d
            own = max(own, cur)
    assert 0 <= peak - own <= sum(b * n for b, n in missed.items())


def test_frees_of_earlier_storages_and_the_peak_moment():
    m, opt, x = _mlp()
    _step(m, opt, x)
    tr = PeakTracker()
    tr.watch([m])
    tr.begin(scan=True)
    start = tr.cur
    with tr.recording():
        _step(m, opt, x, micro_batches=2)
    tr.end()
    grads = sum(p.numel() * 4 for p in m.parameters())
    assert tr.start_bytes == start and tr.end_bytes == start  # zero_grad freed the grads; backward remade them
    assert any(d == -p.numel() * 4 for p in m.parameters() for _s, d, *_ in tr.events)
    named = {"params": tr.serials(m.parameters()), "grads": tr.serials(p.grad for p in m.parameters()),
             "optim": tr.serials(v for st in opt.state.values() for v in st.values())}
    r = tr.result(named, timeline=True)
    phases = {p["phase"] for p in r["timeline"]}
    assert {"forward", "backward", "optimizer", "setup"} <= phases
    assert r["peak_bytes"] == max(sum(v for k, v in p.items() if k not in ("event", "phase")) for p in r["timeline"])
    assert r["peak_bytes"] == sum(r["at_peak"].values())
    # the second micro-batch is counted; the saved activations of a forward are named
    assert max(e[3] for e in tr.events if e[3] is not None) == 1
    assert r["where"]["phase"] in ("forward", "backward", "optimizer", "schedule")
    if r["where"]["phase"] == "optimizer":  # by then backward has made every gradient again
        assert r["at_peak"]["grads"] == grads


def test_a_free_on_another_thread_and_the_prompt_peak():
    """A storage whose last reference another thread drops (as gloo's worker does with a collective's
    tensors): the measured peak holds it as long as that thread keeps it; prompt_peak_bytes is the peak
    had it been freed right after the main thread's last use. Without such a free the two are one."""
    import threading

    tr = PeakTracker()
    tr.begin(scan=True)
    base = tr.cur
    held, go, done = [], threading.Event(), threading.Event()

    def worker():
        go.wait()
        held.clear()  # the last reference: the storage dies on this thread
        done.set()

    th = threading.Thread(target=worker)
    th.start()
    with tr.recording():
        a = torch.ones(1000)  # 4000 bytes, last used by the main thread here
        a.add_(1)
        held.append(a)
        del a
        b = torch.ones(500)  # 2000 bytes while the worker still holds a: the measured peak
        b.mul_(2)
        go.set()
        done.wait()
        th.join()
        c = torch.ones(100)
        c.mul_(2)
    tr.end()
    r = tr.result({}, timeline=True)
    assert r["worker_freed_bytes"] == 4000
    assert r["peak_bytes"] == base + 6000
    # freed right after a.add_: b and a never live together
    assert r["prompt_peak_bytes"] == base + 4000
    # per category (a, b, c are the step's temporaries): the timeline's most, and the prompt one
    most = max(p.get("temporary", 0) for p in r["timeline"])
    assert most == 6000 and r["prompt_most"]["temporary"] == 4000
    # the prompt peak's parts are its own moment's (a alone), not the measured peak's (a and b)
    assert r["at_peak"]["temporary"] == 6000 and r["prompt_at_peak"]["temporary"] == 4000
    assert sum(r["prompt_at_peak"].values()) == r["prompt_peak_bytes"]
    # and its moment a's allocation (aten.ones' fill: the first event), the measured one b's
    assert r["prompt_where"]["event"] == 1 and r["prompt_where"]["op"] == r["where"]["op"] == "aten.ones.default"
    assert r["where"]["event"] > r["prompt_where"]["event"]
    tr.begin(scan=False)
    with tr.recording():
        d = torch.ones(100)
        del d
    tr.end()
    r = tr.result({}, timeline=False)
    assert r["worker_freed_bytes"] == 0 and r["prompt_peak_bytes"] == r["peak_bytes"]
    assert "prompt_at_peak" not in r and "prompt_where" not in r  # one moment: the reconcile reads at_peak


def test_census_names_what_is_live_at_the_peak():
    """The peak census: every storage live at the peak once, by category and where it was made; its
    groups sum to the peak and to at_peak per category; the groups past CENSUS_GROUPS are one summed
    row (a storage resized away and back: test_a_storage_resize_is_counted)."""
    m, opt, x = _mlp()
    _step(m, opt, x)
    tr = PeakTracker()
    tr.watch([m])
    tr.begin(scan=True)
    with tr.recording():
        _step(m, opt, x, micro_batches=2)
    tr.end()
    named = {"params": tr.serials(m.parameters()), "grads": tr.serials(p.grad for p in m.parameters())}
    r = tr.result(named, timeline=True)
    rows = r["census"]
    assert sum(g["bytes"] for g in rows) == r["peak_bytes"]
    by_cat: dict[str, int] = {}
    for g in rows:
        by_cat[g["category"]] = by_cat.get(g["category"], 0) + g["bytes"]
        assert g["largest"] <= g["bytes"] and g["storages"] >= 1
    assert by_cat == r["at_peak"]
    assert [g["bytes"] for g in rows] == sorted((g["bytes"] for g in rows), reverse=True)
    assert any(g["phase"] == "start" for g in rows) and any(g["phase"] == "forward" for g in rows)
    assert "census" not in tr.result(named, timeline=False)
    small = tr.census(lambda s: "temporary", [e[2] for e in tr.events], n=1)
    assert len(small) == 2 and small[1]["category"] == "rest" and sum(g["bytes"] for g in small) == r["peak_bytes"]


def test_a_wrapper_subclass_is_its_inner_tensor():
    """torch's functional collectives hand back an AsyncCollectiveTensor, a wrapper subclass: its own
    storage has the wrapped size and no data, and every view or detach of it is a new wrapper. The probe
    counts the inner tensor once and the wrappers not at all (it once counted each: five phantom [T, h]
    copies a layer of torchtitan's SP all-gather with one sequence per micro-batch)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    elem = torch.ones(1000)
    tr = PeakTracker()
    tr.begin(scan=True)
    start = tr.cur
    with tr.recording():
        a = AsyncCollectiveTensor(elem)
        tr.see(a)
        v = a.view(10, 100)
        d = v.detach()
        w = a * 2  # a real result: 4,000 bytes
    tr.end()
    assert type(v) is AsyncCollectiveTensor and type(d) is AsyncCollectiveTensor and type(w) is torch.Tensor
    assert tr.cur - start == w.untyped_storage().nbytes() == 4000
    assert tr.serials([a, v, d]) == tr.serials([elem]) and len(tr.serials([elem])) == 1


def test_fake_tensors_count_only_in_a_fake_world():
    """cluster=fake counts its FakeTensors (shapes, no data: the full-shape runs); elsewhere a FakeTensor
    is no memory (DTensor's sharding propagation makes some inside each op the probe sees)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode().from_tensor(torch.ones(1000))
    for world, counted in ((False, 0), (True, 4000)):
        tr = PeakTracker(fake_world=world)
        tr.begin(scan=False)
        before = tr.cur
        tr.see(fake)
        tr.end()
        assert tr.cur - before == counted


def test_a_storage_resize_is_counted():
    # FSDP2 allocates and frees unsharded parameters by resizing their storage (not an operator)
    t = torch.empty(1000)
    tr = PeakTracker()
    tr.begin(scan=True)
    with tr.recording():
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(4000 * 4)
        t.untyped_storage().resize_(0)
    tr.end()
    assert [d for s, d, *_ in tr.events] == [-4000, 16000, -16000]
    assert tr.peak == tr.start_bytes + 12000
    # the census at that peak counts the storage from its new allocation, not from the start
    rows = tr.result({}, timeline=True)["census"]
    assert {(g["phase"], g["bytes"]) for g in rows if g["largest"] == 16000} == {("setup", 16000)}


def test_activations_named_by_the_saved_tensor_hook():
    m, opt, x = _mlp()
    tr = PeakTracker()
    tr.begin(scan=True)
    with tr.recording():
        y = m(x)
        r_fwd = tr.result({"params": tr.serials(m.parameters())}, timeline=False)
        y.sum().backward()
    tr.end()
    # Linear saves its input, GELU its input; the second Linear the GELU output: x, h, gelu(h)
    assert r_fwd["at_peak"]["activations"] == (32 * 64 + 32 * 256 + 32 * 256) * 4


def test_a_forward_no_backward_frees_is_freed_with_its_output():
    """A graph no backward runs through (torch pipelining's forward metadata inference on the first
    stage) goes when its output goes, under the saved-tensor hook as without it: its activations
    (an op's own output among them: GELU's, saved by the next Linear, and a tanh that saves its own
    result) are freed. Had the hook returned the output as it is, its grad_fn would point back at
    the node saving it: a cycle no collector sees (measured 572,172 B kept on torchtitan pp2's stage 0)."""
    import weakref

    m, _, x = _mlp()
    tr = PeakTracker()
    tr.begin(scan=True)
    with tr.recording():
        y = torch.tanh(m(x))
        ref = weakref.ref(y.untyped_storage())
        live = tr.cur
        del y
        gc.collect()
        assert ref() is None
        assert tr.cur < live - 32 * 256 * 4  # the activations went with it
    tr.end()


def test_a_saved_leaf_follows_its_data_swap():
    """A Parameter mm saved is kept as it is: swapping its .data (ZeRO-3's free_param) frees the
    gathered storage under the saved leaf, as without the hook (the DeepSpeed peak ledger's premise)."""
    import weakref

    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    tr = PeakTracker()
    tr.begin(scan=True)
    with tr.recording():
        y = x @ w
        ref = weakref.ref(w.untyped_storage())
        w.data = torch.empty(0)
        gc.collect()
        assert ref() is None
        del y
    tr.end()


def test_thin_keeps_the_peak_and_the_ends():
    pts = [(i, {"temporary": (i * 7919) % 1000}, "forward") for i in range(5000)]
    pts[3333] = (3333, {"temporary": 10**6}, "backward")
    out = _thin(pts, 3333, n=100)
    assert len(out) <= 203 and out[0]["event"] == 0 and out[-1]["event"] == 4999
    assert max(p.get("temporary", 0) for p in out) == 10**6


def test_session_records_peak_timeline_and_boundary_scan(tmp_path):
    m, opt, x = _mlp()
    path = str(tmp_path / "rank0.json")
    s = ProbeSession(Grid(dp=1), 0, path, comm=False, steps=2)
    s.watch([m])
    stray = torch.zeros(1000)  # live, named by nobody
    for i in range(2):
        with s.step(i):
            _step(m, opt, x)
        s.state(lambda: {"params": list(m.parameters()), "grads": [p.grad for p in m.parameters()],
                         "optim": [v for st in opt.state.values() for v in st.values()]})
    s.dump({"status": "ok"})
    rec = json.load(open(path))
    assert not rec["errors"]
    s0, s1 = rec["steps"]
    assert "timeline" in s1 and "timeline" not in s0
    assert s1["peak"]["peak_bytes"] >= s1["state"]["resident_bytes"]
    assert s1["peak"]["at_peak"]["params"] == sum(p.numel() * 4 for p in m.parameters())
    assert s1["state"]["unnamed_bytes"] >= stray.numel() * 4 and s1["state"]["unseen_bytes"] == 0
    del stray


@pytest.mark.parametrize("peak", [True, False])
def test_peak_probe_can_be_switched_off(tmp_path, peak):
    m, opt, x = _mlp()
    s = ProbeSession(Grid(dp=1), 0, str(tmp_path / "r.json"), comm=False, peak=peak, steps=1)
    with s.step(0):
        _step(m, opt, x)
    s.dump({"status": "ok"})
    assert ("peak" in json.load(open(tmp_path / "r.json"))["steps"][0]) == peak


def test_cuda_blocks_as_the_caching_allocator_rounds():
    from probes.peak import _blocks

    assert [_blocks(n) for n in (0, 1, 512, 513, 4096, 1_000_001)] == [0, 512, 512, 1024, 4096, 1_000_448]


def _gpu_check_jobs() -> list[list[str]]:
    """scripts/gpu_check.sh's jobs as it lists them (GPU_CHECK_LIST=1): each job's launch.py overrides."""
    import os
    import subprocess

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "gpu_check.sh")
    out = subprocess.run(["bash", path], env={**os.environ, "GPU_CHECK_LIST": "1"}, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [line.split()[1:] for line in out.splitlines() if line.strip()]


def test_gpu_check_jobs_are_valid_configs():
    """scripts/gpu_check.sh cannot run here (no GPU): each of its jobs passes the checks a run makes
    before dispatch (compose, validate, predict), so a GPU machine's minutes are not lost to a typo."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register
    from launchers.job import check
    from tests.conftest import REPO

    register()
    jobs = _gpu_check_jobs()
    # the tiny Llama on each framework, llama3_1b at seq 1024, and at seq 8192 and 4096 with each AC
    assert len(jobs) == 10 and all("cluster.device=cuda" in j for j in jobs)
    for overrides in jobs:
        with initialize_config_dir(config_dir=f"{REPO}/conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        check(cfg)


def test_gpu_check_table_reads_cuda_and_probe_peaks():
    from analysis.gpu_check import table

    step = {"step": 1, "peak": {"peak_bytes": 1000, "peak_allocated_bytes": 1536,
                                "where": {"phase": "backward", "micro_batch": 0}},
            "cuda": {"allocated_bytes.all.peak": 2048, "reserved_bytes.all.peak": 4096, "device_used_bytes": 6000}}
    rec = {"status": "ok", "job_dir": "/x/0_titan", "config": {"framework": {"name": "titan"}},
           "prediction": {"per_rank": [{"rank": 0, "peak": {"bytes": 990, "parts": {"temporary": 990}}}],
                          "outside_allocator": {"CUDA context": 4000, "NCCL": 10}},
           "measurement": {"ranks": [{"rank": 0, "status": "ok", "steps": [step]}]}}
    row = table([rec]).iloc[0]
    assert (row.ledger_peak, row.probe_peak, row.probe_peak_blocks, row.cuda_max_allocated,
            row.allocated_minus_probe, row["where"]) == (990, 1000, 1536, 2048, 512, "backward mb 0")
    # against the prediction: allocated (2048 - 990) / 990; the device's use against peak + beside the tensors
    assert (row.cuda_max_reserved, row.device_used, row.ledger_need) == (4096, 6000, 5000)
    assert abs(row.allocated_err - 1058 / 990) < 1e-12 and abs(row.device_err - 0.2) < 1e-12


def test_a_tensor_of_symbolic_size_is_not_counted():
    """A FakeTensor with a symbolic size (a trace's ShapeEnv, left alive by an earlier test in the
    same process) has no bytes to count: the scan and the operators skip it, the record stays JSON."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
    sym = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False).from_tensor(torch.ones(8, 4), symbolic_context=ctx)
    assert type(sym.untyped_storage().nbytes()) is not int
    tr = PeakTracker()
    tr.begin(scan=True)
    with tr.recording():
        torch.ones(10).mul_(2)
    tr.see(sym)
    tr.end()
    json.dumps(tr.result({}, timeline=True))
    assert all(type(e[0]) is int for e in tr._live.values())


def _normalized(tr: PeakTracker) -> tuple[list, list]:
    """A step's events with its new storages numbered by first appearance (serials count on across
    steps), and the main thread's last use within the step of each storage live at its start."""
    names: dict[int, tuple] = {}
    evs = []
    for s, d, ph, mb, mod, op in tr.events:
        names.setdefault(s, ("start" if s in tr.start_serials else "new", len(names)))
        evs.append((names[s], d, ph, mb, mod, str(op)))
    # the uses within this step (a storage the step did not touch keeps an earlier step's number)
    last = sorted((names.get(e[2], ()), e[4] - tr._base) for e in list(tr._live.values())
                  if e[2] in tr.start_serials and e[4] >= tr._base)
    return evs, last


def test_the_fast_dispatch_path_records_what_the_reference_records():
    """probes/peak.py _Mode (the inlined known-storage case) against _ReferenceMode, the same steady
    step: the same events (bytes, phase, micro-batch, module, operator) in the same order, the same
    last uses, the same peak and saved / collective storages."""
    m, opt, x = _mlp()
    _step(m, opt, x, micro_batches=2)
    tr = PeakTracker()
    tr.watch([m])
    runs = []
    # no cyclic collection inside the steps: one would free an earlier test's garbage at a moment
    # that differs from step to step (seen in the suite, not alone)
    gc.collect()
    gc.disable()
    try:
        for reference in (True, False, True):
            tr.begin(scan=not runs)
            with tr.recording(reference=reference):
                _step(m, opt, x, micro_batches=2)
            tr.end()
            runs.append((_normalized(tr), tr.peak - tr.start_bytes, len(tr.saved), len(tr.comm)))
    finally:
        gc.enable()
    assert runs[0][0][0], "no events recorded"
    fast, ref = runs[1][0][0], runs[2][0][0]
    first = next((i for i, (a, b) in enumerate(zip(fast, ref)) if a != b), None)
    assert first is None and len(fast) == len(ref), (first, fast[first:first + 3], ref[first:first + 3])
    assert runs[1] == runs[2]  # steady steps after the first, one per path


def test_one_dispatch_mode_records_both_probes(tmp_path, monkeypatch):
    """With the peak probe on, the comm probe records through the peak probe's mode (session.step):
    its collectives are still seen (a world of one ignores them: counted in ignored_single), and the
    comm probe's own mode is not entered."""
    import torch.distributed as dist

    from probes import comm as comm_mod

    entered = []
    monkeypatch.setattr(comm_mod._Mode, "__enter__", lambda self: entered.append(1) or self)
    # an in-process store: no port for the suite's other worker to collide with
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m, opt, x = _mlp()
        s = ProbeSession(Grid(dp=1), 0, str(tmp_path / "r.json"), steps=1)
        with s.step(0):
            _step(m, opt, x)
            dist.all_reduce(torch.ones(3))
        s.dump({"status": "ok"})
    finally:
        dist.destroy_process_group()
    assert not entered and s.comm.ignored_single == 1
    rec = json.load(open(tmp_path / "r.json"))
    assert not rec["errors"] and rec["steps"][0]["comm"] == [] and "peak" in rec["steps"][0]


_FREEZE = r"""
import gc, json, torch
from probes.peak import PeakTracker, freeze_imports
kept = torch.zeros(1000)           # made before the freeze, as an import-time tensor
storage = torch.UntypedStorage(24)  # a bare storage too
kept_n = freeze_imports()
listed = any(o is kept for o in gc.get_objects())
later = torch.zeros(10)            # made after it, as a job's tensor
tr = PeakTracker()
print(json.dumps({"kept": kept_n, "listed": listed, "scanned": tr.scan(), "frozen": gc.get_freeze_count() > 0}))
"""


def test_a_frozen_servers_tensors_are_still_scanned():
    """launchers.forkserver freezes what it imported (gc.freeze: gc.get_objects() no longer lists it);
    the peak probe's scan still finds the tensors and storages among it (probes.peak.freeze_imports),
    beside what was made after. In a subprocess: a freeze is for the whole process."""
    import subprocess
    import sys

    from tests.conftest import REPO

    p = subprocess.run([sys.executable, "-c", _FREEZE], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["frozen"] and not got["listed"] and got["kept"] >= 2
    assert got["scanned"] == 4000 + 24 + 40, got  # both frozen ones and the later tensor, each once


def test_a_step_that_begins_while_another_thread_frees_counts_each_storage_once():
    """A c10d worker thread may drop a storage's last reference while a step begins (probes/peak.py module
    docstring: thread timing): the step's starting bytes, its starting storages by category and the
    peak's parts then agree whatever the interleaving (a free between begin()'s snapshots once left 512 B
    counted at the start and never freed)."""
    import sys
    import threading

    from probes.peak_analysis import result

    tr = PeakTracker()
    keep = [torch.empty(128) for _ in range(20_000)]  # 512 B each
    for t in keep:
        tr.see(t)
    stop = threading.Event()

    def drop():
        while keep and not stop.is_set():
            keep.pop()  # the last reference: the storage dies on this thread

    bad = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    th = threading.Thread(target=drop)
    th.start()
    try:
        while keep and len(bad) < 3:
            tr.begin(scan=False)
            tr.end()
            r = result(tr, None, False)
            if sum(tr.start_serials.values()) != tr.start_bytes or sum(r["at_peak"].values()) != r["peak_bytes"]:
                bad.append((sum(tr.start_serials.values()), tr.start_bytes, r["at_peak"], r["peak_bytes"]))
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    assert not bad, bad
