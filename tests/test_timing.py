"""Step time (ledger/timing): the collective cost model against hand arithmetic, the pipeline
simulation's bubble against the textbook, a GEMM's time by hand, the waterfall adding up to the step,
the Chrome trace, and a prediction of each framework."""
import json
from types import SimpleNamespace
import math

import pytest

from ledger.timing import collectives, hardware, ops, pipeline
from ledger.timing.hardware import Link

NVLINK, NET = Link(busbw_gbps=100.0, latency_us=5.0), Link(busbw_gbps=20.0, latency_us=10.0)


@pytest.mark.parametrize("link", [NVLINK, NET], ids=["nvlink", "network"])
def test_collective_times_by_hand(link):
    """nccl-tests' busbw factors, ring and tree latency steps, on two link classes."""
    bw, lat, size, n = link.busbw_gbps * 1e9, link.latency_us * 1e-6, 1e9, 8
    assert collectives.seconds("all_reduce", size, n, link) == pytest.approx(2 * 7 * lat + size * 2 * 7 / 8 / bw)
    assert collectives.seconds("all_reduce", size, n, link, "tree") == pytest.approx(2 * 3 * lat + 2 * size / bw)
    assert collectives.seconds("all_gather", size, n, link) == pytest.approx(7 * lat + size * 7 / 8 / bw)
    assert collectives.seconds("reduce_scatter", size, n, link, calls=4) == pytest.approx(4 * 7 * lat + size * 7 / 8 / bw)
    assert collectives.seconds("send_recv", size, 2, link) == pytest.approx(lat + size / bw)
    assert collectives.seconds("all_gather", size, 1, link) == 0.0


def test_an_all_reduce_takes_the_faster_of_ring_and_tree():
    """NCCL's tuner picks the algorithm of the least time: tree for a small tensor on many ranks (the
    grad norm's 4 bytes over 1,024), ring for a large one."""
    from ledger.placement import Comm, wire_bytes

    small = Comm("dp", "all_reduce", 1, 4, wire_bytes("all_reduce", 4, 1024))
    assert collectives.comm_seconds(small, 1024, NET) == pytest.approx(2 * 10 * 10e-6 + 8 / 20e9)
    big = Comm("dp", "all_reduce", 1, 10 ** 9, wire_bytes("all_reduce", 10 ** 9, 8))
    assert collectives.comm_seconds(big, 8, NET) == pytest.approx(collectives.seconds("all_reduce", 1e9, 8, NET))


def test_a_group_across_nodes_runs_at_the_network_s_rate():
    from ledger.grid import group_size, link_of
    from tests.conftest import layout_of

    lay = layout_of(32, tp=8)  # dp 4 over 4 nodes of 8
    assert link_of(lay, "tp", "all_gather", 8) == "intra" and link_of(lay, "dp", "reduce_scatter", 8) == "inter"
    assert group_size(lay, "dp") == 4 and group_size(lay, "tp") == 8 and group_size(lay, "tp-dp") == 32


def test_a_group_drives_a_nic_per_rank_it_has_on_a_node():
    """Across nodes a ring leaves each node through a NIC per group rank there (nccl-tests' inter-node
    busbw is the node's NICs together): FSDP over 64 ranks at 8 a node runs at 8 NICs' busbw, a dp
    group of one rank a node (tp 8 inside) at one NIC's, tp 2 leaves 4 dp ranks a node; an all_to_all
    or a pipeline hop sends each rank's bytes through its own NIC; never above NVLink's busbw."""
    from tests.conftest import layout_of

    hw = hardware.profile("a100")
    nic = hw.inter.busbw_gbps
    assert collectives.group_link(hw, layout_of(64), "dp", "reduce_scatter").busbw_gbps == pytest.approx(8 * nic)
    assert collectives.group_link(hw, layout_of(64, tp=8), "dp", "all_reduce").busbw_gbps == pytest.approx(nic)
    assert collectives.group_link(hw, layout_of(64, tp=2), "dp", "all_gather").busbw_gbps == pytest.approx(4 * nic)
    assert collectives.group_link(hw, layout_of(64), "dp", "all_to_all").busbw_gbps == pytest.approx(nic)
    assert collectives.group_link(hw, layout_of(64, tp=8), "tp", "all_gather") == hw.intra
    fast_net = hardware.profile("a100", inter_busbw_gbps=100.0)
    assert collectives.group_link(fast_net, layout_of(64), "dp", "all_gather").busbw_gbps == fast_net.intra.busbw_gbps
    # the time follows: 1 GB reduce-scattered over 64 ranks, 8 a node, against one NIC's rate
    from ledger.placement import Comm, wire_bytes
    rs = Comm("dp", "reduce_scatter", 1, 10 ** 9, wire_bytes("reduce_scatter", 10 ** 9, 64))
    t = collectives.comm_seconds(rs, 64, collectives.group_link(hw, layout_of(64), "dp", "reduce_scatter"))
    assert t == pytest.approx(63 * 10e-6 + 10 ** 9 * 63 / 64 / (8 * nic * 1e9))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16), (4, 4)])
def test_uniform_stages_bubble_is_the_textbook(pp, m):
    """1F1B with equal stages and no p2p time: the step is (m + p - 1)(F + B) and every stage idles
    (p - 1) / (m + p - 1) of it."""
    sim = pipeline.simulate(pp, 1, m, lambda s, c: 1.0, lambda s, c: 2.0)
    assert sim.step_s == pytest.approx((m + pp - 1) * 3.0)
    for s in range(pp):
        assert sim.bubble_fraction(s) == pytest.approx((pp - 1) / (m + pp - 1))


def test_interleaving_divides_the_bubble_by_vp():
    """Megatron's interleaved schedule, equal chunks: the idle time is (p - 1) / (v m) of the busy
    time (Narayanan et al. 2021, 2.2.2)."""
    pp, vp, m = 4, 2, 8
    sim = pipeline.simulate(pp, vp, m, lambda s, c: 0.5, lambda s, c: 1.0)
    for s in range(pp):
        assert sim.bubble_s(s) / sim.busy_s(s) == pytest.approx((pp - 1) / (vp * m))


@pytest.mark.parametrize("pp,vp,m", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (4, 3, 4), (8, 2, 16)])
def test_gpipe_and_looped_bfs_bubbles_are_the_textbook(pp, vp, m):
    """torch's GPipe (every forward, then every backward) and LoopedBFS (stage by stage, breadth first),
    equal chunks, no p2p: GPipe idles (p - 1) / (m + p - 1) of the step, as 1F1B (GPipe's paper);
    LoopedBFS's fill and drain are one chunk a stage, (p - 1) / (v m + p - 1) with m >= p, as the
    interleaved schedule's."""
    f, b = (lambda s, c: 1.0 / vp), (lambda s, c: 2.0 / vp)
    if vp == 1:
        sim = pipeline.simulate(pp, 1, m, f, b, 0.0, "gpipe")
        assert sim.step_s == pytest.approx((m + pp - 1) * 3.0)
        assert all(sim.bubble_fraction(s) == pytest.approx((pp - 1) / (m + pp - 1)) for s in range(pp))
        # every forward of a stage before its first backward
        kinds = [t.kind for t, _, _ in sim.lanes[0]]
        assert kinds == ["F"] * m + ["B"] * m
    bfs = pipeline.simulate(pp, vp, m, f, b, 0.0, "looped_bfs")
    assert all(bfs.bubble_fraction(s) == pytest.approx((pp - 1) / (vp * m + pp - 1)) for s in range(pp))
    assert [t.chunk for t, _, _ in bfs.lanes[0]][:m * vp] == [c for c in range(vp) for _ in range(m)]


@pytest.mark.parametrize("pp,vp", [(2, 2), (3, 2), (4, 3), (8, 2)])
def test_torch_s_looped_orders_are_the_simulated_ones(pp, vp):
    """torch's own ScheduleInterleaved1F1B and ScheduleLoopedBFS orders (_calculate_single_rank_operations,
    read through the torchtitan ledger's schedules.interleaved_order) against the simulation's named
    orders: Interleaved1F1B is Megatron's interleaved order where the micro-batches are a multiple of pp,
    its flexible rounds otherwise (which the titan time policy then simulates as torch's own)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleLoopedBFS, _ComputationType

    from ledger.faithful.titan.schedules import interleaved_order, microbatch_error

    for n in range(pp, 4 * pp + 1):
        for r in range(pp):
            bfs = [(a.computation_type != _ComputationType.FORWARD, a.microbatch_index, a.stage_index // pp)
                   for a in ScheduleLoopedBFS._calculate_single_rank_operations(
                       SimpleNamespace(_stages=[None] * vp, pp_group_size=pp, _n_microbatches=n), r) if a is not None]
            assert bfs == pipeline._order(pp, vp, r, n, "looped_bfs")
            if n % pp == 0:
                assert list(interleaved_order(pp, vp, r, n)) == pipeline._order(pp, vp, r, n, "interleaved")
        if n % pp and microbatch_error("Interleaved1F1B", n, pp, vp) is None:
            # torch's own order (n a multiple of its rounds) runs to its end: each micro-batch once a chunk
            sim = pipeline.simulate(pp, vp, n, lambda s, c: 1.0, lambda s, c: 2.0, 0.0, interleaved_order)
            assert sorted(t.micro_batch for t, _, _ in sim.lanes[0] if t.kind == "B") == sorted(list(range(n)) * vp)


def test_titan_s_interleaved_schedule_is_timed_by_its_order():
    """torchtitan's Interleaved1F1B at vp = 2 leaves a smaller bubble than 1F1B on the same layout, LoopedBFS
    the same as Interleaved1F1B's where stages are equal and GPipe 1F1B's; with micro-batches no multiple
    of pp torch's own order runs (no deadlock), the planner's path equal to the full simulation."""
    layout = dict(dp=4, pp=4, global_batch_size=32)
    runs = {}
    for sched, vp in (("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2)):
        _, lay, st = _predict("titan", {**layout, "vp": vp}, f"framework.pipeline_parallel_schedule={sched}",
                              "framework.activation_checkpoint=none", "model.layers=30")
        runs[sched] = st
    assert runs["Interleaved1F1B"].bubble_s < runs["1F1B"].bubble_s
    assert runs["GPipe"].step_s == pytest.approx(runs["1F1B"].step_s, rel=1e-3)
    _, lay, flat = _predict("titan", {**layout, "vp": 2, "global_batch_size": 24},
                            "framework.pipeline_parallel_schedule=Interleaved1F1B", "framework.activation_checkpoint=none",
                            "model.layers=30")
    _, _, traced = _predict("titan", {**layout, "vp": 2, "global_batch_size": 24},
                            "framework.pipeline_parallel_schedule=Interleaved1F1B", "framework.activation_checkpoint=none",
                            "model.layers=30", trace=True)
    assert lay.num_microbatches % lay.pp and flat.step_s == pytest.approx(traced.step_s, rel=1e-12)


def test_uneven_stages_leave_the_others_idle():
    """A last stage twice as slow (the head): the step follows it, and the other stages idle more than
    the textbook's bubble."""
    pp, m = 4, 8
    sim = pipeline.simulate(pp, 1, m, lambda s, c: 2.0 if s == pp - 1 else 1.0, lambda s, c: 4.0 if s == pp - 1 else 2.0)
    assert sim.step_s > (m + pp - 1) * 3.0
    assert sim.bubble_fraction(pp - 1) < (pp - 1) / (m + pp - 1) < sim.bubble_fraction(0)


def test_p2p_transfers_lengthen_the_pipeline():
    """One micro-batch crosses 3 hops forward and 3 back: p (F + B) + 2 (p - 1) p2p. With more, 1F1B
    holds p micro-batches in flight on stage 0, so the round trip's transfers slow the steady state
    too: at least the fill and drain's."""
    one = pipeline.simulate(4, 1, 1, lambda s, c: 1.0, lambda s, c: 2.0, p2p_s=0.1)
    assert one.step_s == pytest.approx(4 * 3.0 + 2 * 3 * 0.1)
    base = pipeline.simulate(4, 1, 8, lambda s, c: 1.0, lambda s, c: 2.0)
    slow = pipeline.simulate(4, 1, 8, lambda s, c: 1.0, lambda s, c: 2.0, p2p_s=0.1)
    assert slow.step_s > base.step_s + 2 * 3 * 0.1


@pytest.mark.parametrize("pp,vp,m", [(4, 1, 61), (8, 1, 200), (4, 2, 96), (3, 3, 150), (16, 2, 512)])
@pytest.mark.parametrize("p2p", [0.0, 0.3])
def test_the_fast_pipeline_step_is_the_simulation_s(pp, vp, m, p2p):
    """pipeline.step_seconds (the planner's path: the periodic regime extrapolated) against the full
    simulation, with stages of different times (the head's last stage slower, the first lighter)."""
    import random

    rnd = random.Random(pp * 1000 + vp * 100 + m)
    f = [[rnd.uniform(0.5, 2.0) for _ in range(vp)] for _ in range(pp)]
    b = [[rnd.uniform(1.0, 4.0) for _ in range(vp)] for _ in range(pp)]
    full = pipeline.simulate(pp, vp, m, lambda s, c: f[s][c], lambda s, c: b[s][c], p2p).step_s
    assert pipeline.step_seconds(pp, vp, m, lambda s, c: f[s][c], lambda s, c: b[s][c], p2p) == pytest.approx(full, rel=1e-9)


@pytest.mark.parametrize("pp,vp", [(2, 1), (4, 1), (3, 2), (4, 3), (8, 5)])
def test_the_flat_pipeline_run_is_the_reference_run(pp, vp):
    """pipeline._run_fast (flat arrays, the planner's) against _run (the readable reference): the same
    step end to the bit, at micro-batch counts around the warm-up and with and without p2p."""
    import random

    rnd = random.Random(pp * 10 + vp)
    f = [[rnd.uniform(0.5, 2.0) for _ in range(vp)] for _ in range(pp)]
    b = [[rnd.uniform(1.0, 4.0) for _ in range(vp)] for _ in range(pp)]
    # the interleaved schedule takes micro-batches in groups of pp
    for m in sorted({pp, 2 * pp, 5 * pp} | ({1, pp + 1, 3 * pp + 1, 40} if vp == 1 else set())):
        for p2p in (0.0, 0.25):
            args = (pp, vp, m, lambda s, c: f[s][c], lambda s, c: b[s][c], p2p)
            assert pipeline._run_fast(*args) == pipeline._run(*args, None), (m, p2p)


@pytest.mark.parametrize("pp,vp,n", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (2, 3, 6)])
def test_zero_bubble_order_splits_every_backward_and_fills_the_bubble(pp, vp, n):
    """torch's InterleavedZeroBubble order (schedules.RUNTIME_ORDERS, its _calculate_single_rank_operations):
    every micro-batch runs a forward, an input-grad half I and a weight-grad half W on each of a rank's
    chunks, W after its I. Simulated with W the weight-grad part of each backward, the busy time is
    Interleaved1F1B's with whole backwards and the step is shorter: the Ws fill the bubble. _run_fast (the
    planner's) equals _run (the reference) to the bit, with and without p2p, on uneven chunks."""
    import random
    from collections import Counter

    from ledger.faithful.titan.schedules import RUNTIME_ORDERS, interleaved_order

    zero_bubble_order = RUNTIME_ORDERS["InterleavedZeroBubble"]

    for r in range(pp):
        order = zero_bubble_order(pp, vp, r, n)
        assert Counter(order) == Counter((k, mb, c) for k in (pipeline.F, pipeline.I, pipeline.W)
                                         for mb in range(n) for c in range(vp))
        assert all(order.index((pipeline.I, mb, c)) < order.index((pipeline.W, mb, c))
                   for mb in range(n) for c in range(vp))
    f, b, w = (lambda s, c: 1.0), (lambda s, c: 2.0), (lambda s, c: 1.0)
    zb = pipeline.simulate(pp, vp, n, f, b, 0.0, zero_bubble_order, w)
    il = pipeline.simulate(pp, vp, n, f, b, 0.0, interleaved_order)
    assert all(zb.busy_s(s) == pytest.approx(il.busy_s(s)) for s in range(pp))
    assert zb.step_s < il.step_s
    rnd = random.Random(pp * 10 + vp)
    fs = [[rnd.uniform(0.5, 2.0) for _ in range(vp)] for _ in range(pp)]
    bs = [[rnd.uniform(1.0, 4.0) for _ in range(vp)] for _ in range(pp)]
    ws = [[rnd.uniform(0.2, 0.8) * bs[s][c] for c in range(vp)] for s in range(pp)]
    for p2p in (0.0, 0.25):
        args = (pp, vp, n, lambda s, c: fs[s][c], lambda s, c: bs[s][c], p2p)
        assert pipeline._run_fast(*args, zero_bubble_order, lambda s, c: ws[s][c]) == \
            pipeline._run(*args, None, zero_bubble_order, lambda s, c: ws[s][c]), p2p


def test_v_placement_is_torch_s_stage_mapping():
    """pipeline.virtual_stage / stage_of: a loop places chunk c of stage s at c pp + s, a V at s and 2 pp - 1 - s
    (torch's generate_stage_to_rank_mapping, style "v"), each the other's inverse."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for pp in (2, 3, 4, 8):
        ranks = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        for s in range(pp):
            for c in range(2):
                v = pipeline.virtual_stage(pp, s, c, "v")
                assert ranks[v] == s == pipeline.stage_of(pp, v, "v")
                assert pipeline.stage_of(pp, pipeline.virtual_stage(pp, s, c), "loop") == s


@pytest.mark.parametrize("name,pp,n", [("ZBVZeroBubble", 2, 4), ("ZBVZeroBubble", 4, 8), ("ZBVZeroBubble", 4, 16),
                                       ("DualPipeV", 2, 4), ("DualPipeV", 4, 8), ("DualPipeV", 4, 16)])
def test_v_schedules_run_their_order_over_the_v(name, pp, n):
    """torch's V schedules (schedules.RUNTIME_ORDERS: ZBVZeroBubble's and DualPipeV's _calculate_single_rank_operations,
    an overlapped forward-backward's two actions one after the other): every micro-batch runs a forward and a whole
    backward, or its I then its W, on each of a rank's two chunks. Simulated over the V (pipeline.virtual_stage: a
    task waits for its neighbour virtual stage's, plus p2p only where that one is on another stage), each task
    starts after its inputs; with W the weight-grad part of each backward the busy time is a whole-backward order's
    and the step shorter than Interleaved1F1B's; _run_fast equals _run to the bit, with and without p2p."""
    import random
    from collections import Counter

    from ledger.faithful.titan.schedules import RUNTIME_ORDERS, interleaved_order

    order = RUNTIME_ORDERS[name]

    for r in range(pp):
        tasks = order(pp, 2, r, n)
        for mb in range(n):
            for c in range(2):
                got = Counter(k for k, m_, c_ in tasks if (m_, c_) == (mb, c))
                assert got in (Counter({pipeline.F: 1, pipeline.B: 1}),
                               Counter({pipeline.F: 1, pipeline.I: 1, pipeline.W: 1})), (r, mb, c, got)
    f, b, w = (lambda s, c: 1.0), (lambda s, c: 2.0), (lambda s, c: 1.0)
    p2p = 0.25
    v = pipeline.simulate(pp, 2, n, f, b, p2p, order, w, "v")
    il = pipeline.simulate(pp, 2, n, f, b, 0.0, interleaved_order)
    assert all(v.busy_s(s) == pytest.approx(il.busy_s(s)) for s in range(pp))
    assert pipeline.simulate(pp, 2, n, f, b, 0.0, order, w, "v").step_s < il.step_s
    end = {}
    for s, lane in enumerate(v.lanes):
        for t, start, stop in lane:
            end[t.kind, t.micro_batch, pipeline.virtual_stage(pp, s, t.chunk, "v")] = (start, stop)
    last = 2 * pp - 1
    for (kind, mb, vs), (start, _) in end.items():
        hop = lambda u: p2p if pipeline.stage_of(pp, u, "v") != pipeline.stage_of(pp, vs, "v") else 0.0
        if kind == "F" and vs:
            assert start >= end["F", mb, vs - 1][1] + hop(vs - 1) - 1e-12
        if kind in ("B", "I") and vs < last:
            nxt = end.get(("B", mb, vs + 1)) or end[("I", mb, vs + 1)]
            assert start >= nxt[1] + hop(vs + 1) - 1e-12
    rnd = random.Random(pp * 10 + n)
    fs = [[rnd.uniform(0.5, 2.0) for _ in range(2)] for _ in range(pp)]
    bs = [[rnd.uniform(1.0, 4.0) for _ in range(2)] for _ in range(pp)]
    ws = [[rnd.uniform(0.2, 0.8) * bs[s][c] for c in range(2)] for s in range(pp)]
    for p2p in (0.0, 0.25):
        args = (pp, 2, n, lambda s, c: fs[s][c], lambda s, c: bs[s][c], p2p)
        assert pipeline._run_fast(*args, order, lambda s, c: ws[s][c], "v") == \
            pipeline._run(*args, None, order, lambda s, c: ws[s][c], "v"), p2p


def test_titan_s_zero_bubble_schedule_is_timed_with_split_backwards():
    """torchtitan's InterleavedZeroBubble on the same layout as Interleaved1F1B (pp4, vp2): the same forward
    and backward time (but the copies of the final norm's grad, which its split backward leaves without one:
    schedules.final_norm_gets_grad), a smaller bubble (its Ws fill it), so a shorter step; the sources line
    says so; and ZBVZeroBubble's and DualPipeV's over their V."""
    layout = dict(dp=4, pp=4, vp=2, global_batch_size=32)
    runs = {sched: _predict("titan", layout, f"framework.pipeline_parallel_schedule={sched}",
                            "framework.activation_checkpoint=none", "model.layers=32")[2]
            for sched in ("Interleaved1F1B", "InterleavedZeroBubble")}
    il, zb = runs["Interleaved1F1B"], runs["InterleavedZeroBubble"]
    assert zb.forward_s == pytest.approx(il.forward_s) and zb.backward_s == pytest.approx(il.backward_s, rel=1e-4)
    assert 0 < zb.bubble_s < il.bubble_s and zb.step_s < il.step_s
    assert any("InterleavedZeroBubble's order simulated" in n for n in zb.notes)
    # the V schedules (two chunks a rank, placed as a V: rank 0 holds the head too): a bubble their orders shrink
    for sched in ("ZBVZeroBubble", "DualPipeV"):
        v = _predict("titan", layout, f"framework.pipeline_parallel_schedule={sched}",
                     "framework.activation_checkpoint=none", "model.layers=32")[2]
        assert 0 < v.bubble_s < il.bubble_s and v.step_s < il.step_s
        assert any(f"{sched}'s order simulated over its V" in n for n in v.notes), v.notes


def test_a_split_backward_under_full_ac_recomputes_each_block_once_a_param_group_in_its_w():
    """torch's stage_backward_weight runs one autograd.grad a param group and torch.utils.checkpoint recomputes a
    block once a graph task (the TP collectives of those recomputes measured: tests/test_titan.py's w4ppzbac): under
    full AC a zero-bubble W re-runs each of its blocks' forward 7 times (the fused wqkv, wo, w1, w2, w3 and the two
    norms' weights; 9 with wq / wk / wv). On the critical stage (pp rank 1: virtual stages 1 and 3, the head's; both
    off virtual stage 0, whose W is its whole backward) the recompute term grows by exactly those forwards, one set a
    micro-batch per chunk, and the step by about as much."""
    from dataclasses import replace

    from ledger import frameworks
    from ledger.faithful.titan.schedules import block_param_groups
    from ledger.parallel import predict
    from ledger.timing import ops
    from ledger.timing.step import shard_of, step_time
    from tests.conftest import compose_config

    hw = hardware.profile("h100")
    layout = dict(dp=2, pp=2, vp=2, global_batch_size=16)
    for fused in (True, False):
        over = ("framework.pipeline_parallel_schedule=InterleavedZeroBubble", "framework.activation_checkpoint=full",
                f"framework.fuse_qkv={str(fused).lower()}", "model.layers=8")
        m, lay, st = _predict("titan", layout, *over)
        cfg = compose_config("framework=titan", "model=llama3_8b", *over)
        policy = frameworks.get("titan").time_policy(cfg.framework, lay, "cuda")
        assert policy.weight_recomputes == block_param_groups(fused) == (7 if fused else 9)
        base = step_time(m, lay, predict(m, lay, cfg.framework), replace(policy, weight_recomputes=0), hw)
        per_layer = ops.seconds(ops.layer_forward(shard_of(m, lay, policy)), hw)
        extra = dict(st.waterfall)["recompute"] - dict(base.waterfall)["recompute"]
        # 2 chunks x 2 blocks each (8 layers over 4 virtual stages), every micro-batch
        assert extra == pytest.approx(policy.weight_recomputes * per_layer * 2 * 2 * lay.num_microbatches)
        assert st.step_s - base.step_s == pytest.approx(extra, rel=0.25)


def test_a_gemm_s_time_by_hand():
    """8192^3 bf16 on the H100 preset: 32 x 32 tiles of 128 x 256 over 132 SMs in 8 waves."""
    p = hardware.profile("h100")
    op = ops.gemm("x", 8192, 8192, 8192, 2)
    tiles = math.ceil(8192 / 128) * math.ceil(8192 / 256)
    util = tiles / (math.ceil(tiles / 132) * 132)
    assert ops.op_seconds(op, p) == pytest.approx(2 * 8192 ** 3 / (989e12 * 0.75 * util) + 5e-6)
    # a calibrated table replaces the model
    q = hardware.with_overrides(p, gemm_table=(((8192, 8192, 8192, "bf16"), 500.0),))
    assert ops.op_seconds(op, q) == pytest.approx(2 * 8192 ** 3 / 500e12 + 5e-6)


def test_hardware_overrides_name_the_field():
    from ledger.errors import ConfigError

    with pytest.raises(ConfigError, match="hardware.name='h800'"):
        hardware.profile("h800")
    with pytest.raises(ConfigError, match="hardware.gemm_efficiency=0"):
        hardware.profile("h100", gemm_efficiency=0)
    with pytest.raises(ConfigError, match="hardware.inter_busbw_gbps=-1"):
        hardware.profile("h100", inter_busbw_gbps=-1)
    assert hardware.profile("a100", inter_busbw_gbps=40).inter.busbw_gbps == 40


def _predict(framework, layout, *over, model="llama3_8b", trace=False):
    from omegaconf import OmegaConf

    from ledger import frameworks
    from ledger.layout import resolve
    from ledger.model import ModelShape
    from ledger.parallel import predict
    from ledger.timing.step import step_time
    from tests.conftest import compose_config

    cfg = compose_config(f"framework={framework}", f"model={model}", *over)
    m = ModelShape.from_config(OmegaConf.to_container(cfg.model, resolve=True))
    lay = resolve({**OmegaConf.to_container(cfg.layout), **layout}, framework=framework)
    pl = predict(m, lay, cfg.framework)
    return m, lay, step_time(m, lay, pl, frameworks.get(framework).time_policy(cfg.framework, lay, "cuda"),
                             hardware.profile("h100"), trace=trace)


@pytest.mark.parametrize("framework,layout,over", [
    ("megatron", dict(tp=2, pp=2, dp=4, sequence_parallel=True, global_batch_size=64),
     ("framework.use_distributed_optimizer=true",)),
    ("megatron", dict(tp=2, pp=2, vp=2, dp=4, sequence_parallel=True, global_batch_size=64),
     ("framework.overlap_grad_reduce=true", "framework.recompute_granularity=full",
      "framework.recompute_method=uniform", "framework.recompute_num_layers=1")),
    ("titan", dict(dp=16, global_batch_size=32), ("framework.activation_checkpoint=selective",)),
    ("deepspeed", dict(dp=16, global_batch_size=32), ("framework.zero_stage=3",)),
    ("deepspeed", dict(dp=16, global_batch_size=32), ("framework.zero_stage=1",)),
    ("megatron", dict(tp=4, pp=2, ep=2, etp=1, dp=8, sequence_parallel=True, global_batch_size=64),
     ("model=mixtral_8x7b", "framework.use_distributed_optimizer=true")),
    ("titan", dict(ep=8, dp=8, global_batch_size=8), ("model=qwen3_30b_a3b", "framework.activation_checkpoint=none")),
    ("deepspeed", dict(ep=2, dp=2, global_batch_size=2), ("model=tiny_moe", "framework.zero_stage=1")),
])
def test_the_waterfall_adds_up_to_the_step_and_mfu_follows(framework, layout, over):
    from ledger.timing.step import model_flops

    model = next((o.split("=")[1] for o in over if o.startswith("model=")), "llama3_8b")
    m, lay, st = _predict(framework, layout, *[o for o in over if not o.startswith("model=")], model=model)
    assert sum(t for _, t in st.waterfall) == pytest.approx(st.step_s, rel=1e-9)
    assert all(t >= -1e-12 for _, t in st.waterfall), st.waterfall
    assert st.mfu == pytest.approx(model_flops(m, lay) / (lay.world * 989e12 * st.step_s))
    assert st.tokens_per_s_per_gpu == pytest.approx(lay.global_batch_size * m.seq_len / st.step_s / lay.world)
    assert 0 < st.mfu < 0.75  # below the kernels' own efficiency


def test_fsdp2_copies_around_its_collectives_by_hand():
    """torchtitan's FSDP2 copies out every all-gather (split_with_sizes_copy: the gathered buffer read and
    each parameter written, 2 bytes per byte) and copies in every reduce-scatter (chunk_cat: the bf16
    grads read, the fp32 buffer written: 1.5 bytes per byte) on the compute stream: a waterfall term of their
    bytes at the memory's bandwidth, by hand from the comm ledger's rows; Megatron's and DeepSpeed's
    collectives run on their own buffers (no term)."""
    from ledger.parallel import predict
    from ledger.timing.step import DP_DIMS

    from tests.conftest import compose_config

    over = ("framework.activation_checkpoint=none",)
    m, lay, st = _predict("titan", dict(dp=16, global_batch_size=32), *over)
    cfg = compose_config("framework=titan", "model=llama3_8b", *over)
    rows = [c for c in predict(m, lay, cfg.framework).rank_state(0).comm if c.dim in DP_DIMS]
    gathered = sum(c.buffer_bytes for c in rows if c.kind == "all_gather")
    reduced = sum(c.buffer_bytes for c in rows if c.kind == "reduce_scatter")
    calls = sum(c.count for c in rows if c.kind in ("all_gather", "reduce_scatter"))
    assert gathered > 0 and reduced > 0
    hw = hardware.profile("h100")
    by_hand = ((2 * gathered + 1.5 * reduced) / (hw.hbm_gbps * 1e9 * hw.memory_efficiency)
               + calls * hw.kernel_overhead_s)
    assert dict(st.waterfall)["DP collectives' copies"] == pytest.approx(by_hand, rel=1e-12)
    for framework, over in (("megatron", ("framework.use_distributed_optimizer=true",)),
                            ("deepspeed", ("framework.zero_stage=3",))):
        assert dict(_predict(framework, dict(dp=16, global_batch_size=32), *over)[2].waterfall)["DP collectives' copies"] == 0


@pytest.mark.parametrize("reshard", ["always", "never"])
def test_fsdp2_s_gathers_are_timed_in_the_pass_of_their_calls(reshard):
    """torchtitan's comm rows say which pass each all-gather runs in (Comm.forward_buffer_bytes): every
    micro-batch's forward gathers tok_embeddings, each block and [norm, lm_head] (again for the loss wrapper);
    its backward gathers [norm, lm_head] (resharded by the loss) and, resharded after forward, each block and
    tok_embeddings again; not resharded, nothing more. By hand from the model's units; the copies' time
    (dp_copy_seconds) split alike, every reduce-scatter's in the backward; ZeRO-3's rows say nothing (half)."""
    from ledger.faithful.titan.steptime import time_policy
    from ledger.parallel import predict
    from ledger.timing.step import DP_DIMS, dp_copy_seconds, gather_forward_share
    from tests.conftest import compose_config

    over = ("framework.activation_checkpoint=none", f"framework.reshard_after_forward={reshard}")
    m, lay, st = _predict("titan", dict(dp=16, global_batch_size=32), *over)
    cfg = compose_config("framework=titan", "model=llama3_8b", *over)
    pl = predict(m, lay, cfg.framework)
    rows = [c for c in pl.rank_state(0).comm if c.dim in DP_DIMS]
    (ag,) = [c for c in rows if c.kind == "all_gather"]
    M, emb, layer, head = lay.num_microbatches, m.vocab * m.hidden, m.layer_num_params(0), m.hidden + m.vocab * m.hidden
    assert M == 2
    forward = M * 2 * (emb + m.layers * layer + 2 * head)
    backward = M * 2 * (head + (m.layers * layer + emb if reshard == "always" else 0))
    assert (ag.forward_buffer_bytes, ag.buffer_bytes) == (forward, forward + backward)
    h100 = hardware.profile("h100")
    policy = time_policy(cfg.framework, lay, "cuda")
    per_byte = dict(policy.dp_copy_bytes)

    def copy(c):
        return per_byte[c.kind] * c.buffer_bytes / (h100.hbm_gbps * 1e9 * h100.memory_efficiency) + c.count * h100.kernel_overhead_s

    fwd, bwd = dp_copy_seconds([(c, 0.0) for c in rows], policy, h100)
    share = forward / (forward + backward)
    assert gather_forward_share(ag) == share and (share > 0.9) == (reshard == "never")
    assert fwd == pytest.approx(copy(ag) * share, rel=1e-12)
    assert bwd == pytest.approx(copy(ag) * (1 - share) + sum(copy(c) for c in rows if c.kind == "reduce_scatter"),
                                rel=1e-12)
    z3 = _predict("deepspeed", dict(dp=16, global_batch_size=32), "framework.zero_stage=3")[:2]
    zrows = predict(*z3, compose_config("framework=deepspeed", "model=llama3_8b", "framework.zero_stage=3").framework)
    assert all(gather_forward_share(c) == 0.5 for c in zrows.rank_state(0).comm if c.kind == "all_gather")


def test_fsdp2_without_resharding_hides_its_gathers_behind_the_forwards():
    """Not resharded after forward, torchtitan's units gather in the forward only (but [norm, lm_head]'s
    backward regather): the forwards hide the gathers' forward share less the edge, the backwards the rest with
    the reductions; at seq 2048 under full AC the forward falls short where the half rule hid it. By hand
    from the comm ledger's rows, the edges as the step gives them (dp_edge_seconds)."""
    from ledger.faithful.titan.steptime import time_policy
    from ledger.grid import group_size
    from ledger.parallel import predict
    from ledger.timing.step import DP_DIMS, GRAD_KINDS, dp_edge_seconds, gather_forward_share
    from tests.conftest import compose_config

    over = ("framework.activation_checkpoint=full", "framework.reshard_after_forward=never", "model.seq_len=2048")
    m, lay, st = _predict("titan", dict(dp=256, global_batch_size=256), *over)
    cfg = compose_config("framework=titan", "model=llama3_8b", *over)
    h100 = hardware.profile("h100")
    groups = {(c.dim, c.kind): (group_size(lay, c.dim), collectives.group_link(h100, lay, c.dim, c.kind))
              for c in predict(m, lay, cfg.framework).rank_state(0).comm}
    rows = [(c, collectives.comm_seconds(c, *groups[c.dim, c.kind]))
            for c in predict(m, lay, cfg.framework).rank_state(0).comm if c.dim in DP_DIMS]
    gathers_f = sum(t * gather_forward_share(c) for c, t in rows if c.kind not in GRAD_KINDS)
    gathers_b = sum(t * (1 - gather_forward_share(c)) for c, t in rows if c.kind not in GRAD_KINDS)
    reductions = sum(t for c, t in rows if c.kind in GRAD_KINDS)
    edge_g, edge_p = dp_edge_seconds(rows, m, time_policy(cfg.framework, lay, "cuda"), lay.num_microbatches, groups)
    fwd_over = gathers_f - edge_p - st.forward_s
    assert gathers_b < 0.1 * gathers_f  # ([norm, lm_head]'s backward regather alone)
    assert fwd_over > 0 and gathers_b + reductions - edge_g < st.backward_s  # the forward short of room, the backward not
    assert (gathers_f + gathers_b) / 2 - edge_p / 2 < st.forward_s  # the half rule: no forward excess
    assert st.exposed_s["dp"] == pytest.approx(edge_g + edge_p + fwd_over, rel=1e-9)


def test_fsdp2_s_first_gathers_and_last_reductions_are_exposed_by_hand():
    """torchtitan's FSDP2 opens each micro-batch's forward with tok_embeddings' all-gather and block 0's (only
    the embedding's lookup between) and closes its backward with block 0's reduce-scatter and then
    tok_embeddings', the compute stream waiting for the last: exposed, whatever the passes could hide. By
    hand, with the rest of FSDP's collectives hidden: per micro-batch a bf16 all-gather and an fp32
    reduce-scatter of (vocab x hidden + a block's parameters), one call a unit, at the ring's bytes over the
    group's link plus its steps' latency. Under PP none is modelled; the torchtitan of 2024's root unit
    holds the final norm and output too."""
    import dataclasses

    from ledger.faithful.titan.steptime import time_policy_2024
    from ledger.parallel import predict
    from ledger.timing.step import step_time
    from tests.conftest import compose_config

    over = ("framework.activation_checkpoint=none",)
    m, lay, st = _predict("titan", dict(dp=16, global_batch_size=32), *over)
    mb, n = lay.num_microbatches, 16
    assert mb == 2
    h100 = hardware.profile("h100")
    link = collectives.group_link(h100, lay, "dp", "all_gather")

    def ring(size_bytes, calls):
        return size_bytes * (n - 1) / n / (link.busbw_gbps * 1e9) + calls * (n - 1) * link.latency_us * 1e-6

    edge = m.vocab * m.hidden + m.layer_num_params(0)
    assert st.exposed_s["dp"] == pytest.approx(ring(mb * edge * 2, 2 * mb) + ring(mb * edge * 4, 2 * mb), rel=1e-12)
    cfg = compose_config("framework=titan", "model=llama3_8b", *over)
    pl = predict(m, lay, cfg.framework)
    head = m.hidden + m.vocab * m.hidden
    old = step_time(m, lay, pl, time_policy_2024(cfg.framework, lay, "cuda", "rmsnorm"), h100)
    assert old.exposed_s["dp"] == pytest.approx(ring(mb * (edge + head) * 2, 3 * mb) + ring(mb * (edge + head) * 4, 3 * mb),
                                                rel=1e-12)
    _, _, piped = _predict("titan", dict(dp=8, pp=2, global_batch_size=32), *over)
    assert "dp" not in piped.exposed_s


def test_each_pass_hides_only_its_own_gathers_and_reductions():
    """ZeRO-3's prefetch (as FSDP2's) runs a unit ahead inside its pass: a forward's gathers hide behind the
    forwards only, a backward's gathers and reductions behind the backwards only, a gather's half in each pass.
    With activation checkpointing the backward has room to spare where the forward has none: the forward's
    excess is exposed, by hand from the comm ledger's rows, where one pool for both passes hid it all."""
    from ledger.grid import group_size
    from ledger.parallel import predict
    from ledger.timing.step import DP_DIMS, GRAD_KINDS
    from tests.conftest import compose_config

    over = ("framework.zero_stage=3", "framework.activation_checkpointing=true", "model.seq_len=3072")
    m, lay, st = _predict("deepspeed", dict(dp=64, global_batch_size=64), *over)
    cfg = compose_config("framework=deepspeed", "model=llama3_8b", *over)
    h100 = hardware.profile("h100")
    rows = [(c, collectives.comm_seconds(c, group_size(lay, c.dim), collectives.group_link(h100, lay, c.dim, c.kind)))
            for c in predict(m, lay, cfg.framework).rank_state(0).comm if c.dim in DP_DIMS]
    gathers = sum(t for c, t in rows if c.kind not in GRAD_KINDS)
    reductions = sum(t for c, t in rows if c.kind in GRAD_KINDS)
    fwd_over = gathers / 2 - st.forward_s
    assert fwd_over > 0 and gathers / 2 + reductions < st.backward_s  # the forward short of room, the backward not
    assert gathers + reductions < st.forward_s + st.backward_s  # one pool for both would hide them all
    assert sum(t for d, t in st.exposed_s.items() if d in DP_DIMS) == pytest.approx(fwd_over, rel=1e-9)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_s_bucket_copies_and_accumulation_by_hand(zero):
    """DeepSpeed ZeRO-1/2 copies the grads into its IPG bucket on the compute stream before each grad
    all-reduce (2 bytes per byte of the bf16 bucket: the comm ledger's rows, stage 2 every micro-batch),
    and under ZeRO-1 autograd adds each micro-batch's bf16 grads into param.grad after the first (3 bytes
    per byte of the params); ZeRO-2's epilogue adds each later micro-batch's reduced partition into the first's
    (3 bytes per byte of a 1 / dp share of the params)."""
    from ledger.parallel import predict
    from ledger.timing.step import DP_DIMS
    from tests.conftest import compose_config

    over = (f"framework.zero_stage={zero}",)
    m, lay, st = _predict("deepspeed", dict(dp=16, global_batch_size=64), *over)
    cfg = compose_config("framework=deepspeed", "model=llama3_8b", *over)
    rank = predict(m, lay, cfg.framework).rank_state(0)
    reduces = [c for c in rank.comm if c.dim in DP_DIMS and c.kind == "all_reduce"]
    hw = hardware.profile("h100")
    bw = hw.hbm_gbps * 1e9 * hw.memory_efficiency
    copies = 2 * sum(c.buffer_bytes for c in reduces) / bw + sum(c.count for c in reduces) * hw.kernel_overhead_s
    assert lay.num_microbatches == 4 and dict(st.waterfall)["DP collectives' copies"] == pytest.approx(copies, rel=1e-12)
    accumulate = (lay.num_microbatches - 1) * 3 * rank.params_bytes / (1 if zero == 1 else lay.dp) / bw
    assert dict(st.waterfall)["grad accumulation"] == pytest.approx(accumulate, rel=1e-12)


def test_a_hidden_collective_holds_the_sms_nccl_runs_it_on():
    """NCCL runs a collective on the fewest SMs that reach its link's busbw (a DGX A100's 8 NICs: 16 SMs,
    its maintainer's figure), at most 32 channels, none on a CPU; while FSDP's collectives hide behind the
    compute, the compute loses those SMs' share: a waterfall term of each hidden collective's seconds x
    its SMs / the device's, by hand for a layout whose collectives are all hidden."""
    from ledger.grid import group_size
    from ledger.parallel import predict
    from ledger.timing.step import DP_DIMS
    from tests.conftest import compose_config, layout_of

    a100 = hardware.profile("a100")
    assert collectives.sms_taken(collectives.group_link(a100, layout_of(64), "dp", "all_gather"), a100) == 16
    assert collectives.sms_taken(a100.intra, a100) == math.ceil(a100.intra.busbw_gbps / (190 / 16))
    assert collectives.sms_taken(Link(busbw_gbps=2000.0, latency_us=1.0), a100) == 32
    import dataclasses
    assert collectives.sms_taken(a100.intra, dataclasses.replace(a100, sms=0)) == 0  # a CPU profile's
    over = ("framework.activation_checkpoint=none",)
    m, lay, _ = _predict("titan", dict(dp=16, global_batch_size=32), *over)
    cfg = compose_config("framework=titan", "model=llama3_8b", *over)
    h100 = hardware.profile("h100")
    # without the passes' edges (FSDP2's first gathers and last reductions, exposed: the test below)
    from ledger import frameworks
    from ledger.timing.step import step_time
    policy = dataclasses.replace(frameworks.get("titan").time_policy(cfg.framework, lay, "cuda"), dp_edge_units=((), ()))
    st = step_time(m, lay, predict(m, lay, cfg.framework), policy, h100)
    assert not any(d in DP_DIMS for d in st.exposed_s)  # every FSDP collective hidden
    by_hand = sum(collectives.comm_seconds(c, group_size(lay, c.dim), collectives.group_link(h100, lay, c.dim, c.kind))
                  * collectives.sms_taken(collectives.group_link(h100, lay, c.dim, c.kind), h100) / h100.sms
                  for c in predict(m, lay, cfg.framework).rank_state(0).comm if c.dim in DP_DIMS)
    assert by_hand > 0 and dict(st.waterfall)["SMs held by hidden collectives"] == pytest.approx(by_hand, rel=1e-12)


def test_megatron_s_grad_accumulation_adds_by_hand():
    """Without gradient-accumulation fusion (the CPU harness) Megatron's DDP hook adds every micro-batch's
    bf16 grads into the fp32 main_grad (10 bytes an element: 5 per byte of the bf16 params); on CUDA the
    weight-grad GEMM accumulates in place (no term); the Megatron-LM of 2021's fp16 autograd accumulation
    (3 per byte) skips the first micro-batch, which assigns."""
    from omegaconf import OmegaConf

    from ledger import frameworks
    from ledger.faithful.megatron.steptime import time_policy_2021
    from ledger.layout import resolve
    from ledger.model import ModelShape
    from ledger.parallel import predict
    from ledger.timing.step import step_time
    from tests.conftest import compose_config

    cfg = compose_config("framework=megatron", "model=llama3_8b")
    model = ModelShape.from_config(OmegaConf.to_container(cfg.model, resolve=True))
    lay = resolve({**OmegaConf.to_container(cfg.layout), **dict(tp=2, pp=2, dp=2, sequence_parallel=True,
                                                                  global_batch_size=16)}, framework="megatron")
    pl, hw, m = predict(model, lay, cfg.framework), hardware.profile("h100"), lay.num_microbatches
    bw = hw.hbm_gbps * 1e9 * hw.memory_efficiency
    policy = frameworks.get("megatron").time_policy

    def term(p):
        st = step_time(model, lay, pl, p, hw)
        assert sum(t for _, t in st.waterfall) == pytest.approx(st.step_s, rel=1e-9)
        return dict(st.waterfall)["grad accumulation"]

    stage_params = [pl.rank_state(s * lay.world // lay.pp).params_bytes for s in range(lay.pp)]
    cpu, cuda, old = (term(policy(cfg.framework, lay, "cpu")), term(policy(cfg.framework, lay, "cuda")),
                      term(time_policy_2021(cfg.framework, lay, "cuda")))
    assert m == 8 and cuda == 0
    assert cpu in [pytest.approx(m * 5 * b / bw, rel=1e-12) for b in stage_params]  # the critical stage's
    assert old == pytest.approx(cpu * (m - 1) / m * 3 / 5, rel=1e-12)


def test_overlap_and_recompute_move_the_step_the_way_the_framework_does():
    """Megatron: overlap_grad_reduce hides grad reductions behind the last backward (never slower);
    full recompute adds the layers' forward again (slower, its own waterfall term)."""
    base = dict(tp=2, dp=16, sequence_parallel=True, global_batch_size=64)
    _, _, plain = _predict("megatron", base)
    _, _, ov = _predict("megatron", base, "framework.overlap_grad_reduce=true")
    _, _, rc = _predict("megatron", base, "framework.recompute_granularity=full", "framework.recompute_method=uniform",
                        "framework.recompute_num_layers=1")
    assert ov.step_s < plain.step_s and ov.exposed_s.get("dp", 0) < plain.exposed_s["dp"]
    assert rc.step_s > plain.step_s and dict(rc.waterfall)["recompute"] > 0 == dict(plain.waterfall)["recompute"]


@pytest.mark.parametrize("pp", [1, 2])
def test_per_layer_selective_checkpointing_recomputes_every_nth_block(pp):
    """torchtitan's per-layer selective option of 2024 (selective_ac_option N, the published runs'): every
    N-th block counted from 1 recomputes its whole forward, the others nothing. At N = 2 over 32 layers:
    half of full checkpointing's recompute (pp = 1) or, with two stages of 16, half on each: the backward
    lies halfway between no checkpointing's and full's."""
    from omegaconf import OmegaConf

    from conf.schema import TitanConfig
    from ledger import frameworks

    layout = dict(dp=8, pp=pp, global_batch_size=32)
    _, lay, layer = _predict("titan", layout, "framework.activation_checkpoint=selective",
                             "framework.selective_ac_option=2")
    _, _, full = _predict("titan", layout, "framework.activation_checkpoint=full")
    _, _, none = _predict("titan", layout, "framework.activation_checkpoint=none")
    assert dict(layer.waterfall)["recompute"] == pytest.approx(dict(full.waterfall)["recompute"] / 2, rel=1e-12)
    assert layer.backward_s - none.backward_s == pytest.approx((full.backward_s - none.backward_s) / 2, rel=1e-12)

    def policy(option):
        fw = OmegaConf.structured(TitanConfig(activation_checkpoint="selective", selective_ac_option=option))
        return frameworks.get("titan").time_policy(fw, lay, "cuda")

    assert (policy("2").recompute, policy("2").recompute_every) == ("full", 2)
    assert policy("op").recompute_every == 1  # the per-op policy recomputes in every block


def test_the_chrome_trace_has_one_track_per_lane(tmp_path):
    from ledger.timing import trace

    _, lay, st = _predict("megatron", dict(tp=2, pp=4, dp=2, sequence_parallel=True, global_batch_size=32), trace=True)
    path = tmp_path / "step_trace.json"
    trace.write(st, str(path))
    doc = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert len(names) == lay.pp + 1 and names[0] == "stage 0 compute"
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == set(names)
    per_stage = [sum(e["name"].startswith("forward") for e in spans if e["tid"] == s) for s in range(lay.pp)]
    assert per_stage == [lay.num_microbatches] * lay.pp


def test_predict_prints_the_step_time(tmp_path):
    """`mode=predict` prints the step time, tokens/s/GPU, MFU and the waterfall, names its target, and
    writes them (and the trace) beside the prediction."""
    from tests.conftest import launch

    p = launch("mode=predict", "model=llama3_8b", "framework=titan", "layout.dp=8", "hardware.name=a100",
               f"hydra.run.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = " ".join(p.stdout.split())
    assert "step time for a100 (from sources" in out and "MFU" in out and "where the step goes" in out
    st = json.load(open(tmp_path / "prediction.json"))["step_time"]
    assert st["step_s"] > 0 and st["target"].startswith("a100") and (tmp_path / "step_trace.json").exists()
    # W&B's summary scalars carry them (analysis/wandb_io.py headline)
    import pandas as pd

    from analysis.wandb_io import headline

    h = headline(json.load(open(tmp_path / "record.json")), pd.DataFrame())
    assert (h["predicted_step_s"], h["predicted_mfu"]) == (st["step_s"], st["mfu"])
    bad = launch("mode=predict", "model=llama3_8b", "framework=titan", "hardware.gemm_efficiency=2",
                 f"hydra.run.dir={tmp_path / 'bad'}", timeout=300)
    assert bad.returncode == 2 and "hardware: gemm_efficiency=2" in bad.stdout + bad.stderr


@pytest.mark.real
def test_calibrate_then_a_cpu_run_has_time_rows(tmp_path):
    """calibrate --quick measures this machine into a profile yaml; a CPU run given it predicts its step
    for the calibrated target, and analysis/timing.py sets the measured steady steps beside it."""
    import subprocess
    import sys

    import records
    from analysis import timing
    from tests.conftest import REPO, launch

    prof = tmp_path / "cpu.yaml"
    c = subprocess.run([sys.executable, "-m", "ledger.timing.calibrate", "--quick", "--out", str(prof)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert c.returncode == 0, c.stderr[-2000:]
    d = tmp_path / "job"
    p = launch("framework=titan", "model=tiny", "model.seq_len=32", "train.steps=3", "cluster.ranks=2",
               "probe.peak=false", "probe.comm_steps=[0]", f"hardware.file={prof}", f"hydra.run.dir={d}", timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = records.read_object(str(d / "record.json"))
    assert rec["status"] == "ok" and "(calibrated)" in rec["prediction"]["step_time"]["target"]
    rows = timing.rows(rec)
    steps = [r for r in rows if r["quantity"] == "time/step_s"]
    assert [r["step"] for r in steps] == [1, 2] and all(r["measured"] > 0 and r["predicted"] > 0 for r in rows)
    # the phases of the slowest rank (probes/phases.py) beside the prediction's: each phase timed, and
    # together no longer than the step
    for st in steps:
        ph = {r["quantity"]: r["measured"] for r in rows if r["step"] == st["step"] and r["quantity"] != "time/step_s"}
        assert set(ph) == {"time/forward_s", "time/backward_s", "time/optimizer_s"}
        assert all(v > 0 for v in ph.values()) and sum(ph.values()) <= st["measured"]
    # each dimension's collectives timed (probes/comm_time.py): Megatron's TP all-reduces, synchronous,
    # every one timed and waited for, beside the prediction's comm_s / exposed_s. How much of a few-us gloo
    # all-reduce the wait covers depends on the machine's load (a rank descheduled between the issue and
    # its wait, or the collective done before the wait starts): 49% of the issue-to-completion time on a
    # loaded 2-core run, most of it on an idle one, so only the bounds are held
    d2 = tmp_path / "tp"
    p = launch("framework=megatron", "model=tiny", "model.seq_len=32", "train.steps=2", "cluster.ranks=2", "layout.tp=2",
               "probe.peak=false", f"hardware.file={prof}", f"hydra.run.dir={d2}", timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    tp = records.read_object(str(d2 / "record.json"))
    comm = {r["quantity"]: r for r in timing.rows(tp) if r["quantity"].startswith(("time/comm/", "time/exposed/"))}
    assert set(comm) == {"time/comm/tp_s", "time/exposed/tp_s"}, sorted(comm)
    total, exposed = comm["time/comm/tp_s"], comm["time/exposed/tp_s"]
    n = sum(c["count"] for c in tp["measurement"]["ranks"][0]["steps"][1]["comm"] if c["dim"] == "tp")
    assert total["timed"] == exposed["timed"] == f"{n}/{n}" and n > 0
    assert 0 < exposed["measured"] <= 1.05 * total["measured"] and total["predicted"] > 0
    assert all(not r["errors"] for r in tp["measurement"]["ranks"])
    # the benchmark's summary (benchmarks/time_cpu.py): the comm probe's steps left out of the step, the
    # collectives' time per dimension the median over the steps that timed them
    import statistics

    s = timing.job_summary(tp, skip_steps=0, comm_steps=(1,))
    every = [r for r in timing.rows(tp, skip_steps=0) if r["quantity"] == "time/comm/tp_s"]
    assert s["steps"] == 1 and len(every) == 2
    assert s["comm"]["tp"]["predicted_comm_s"] == total["predicted"]
    assert s["comm"]["tp"]["measured_comm_s"] == statistics.median(r["measured"] for r in every)
    # the report's step-time section: the table and the predicted step above the measured one
    from analysis import report

    page = open(report.write([rec], str(tmp_path / "report"), str(d))).read()
    assert "<h2>Step time</h2>" in page and (tmp_path / "report" / "gantt.png").exists()


def test_the_article_s_question_is_answered():
    """`python -m sweeps.article --question`: the best fitting layout of each framework with its MFU,
    the best step's terms, and for a run measured at 32% the terms that would have to grow."""
    import subprocess
    import sys

    from tests.conftest import REPO

    p = subprocess.run([sys.executable, "-m", "sweeps.article", "--question"], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    assert "Llama-3-70B, 1,024 x h100" in out and "global batch 512" in out
    assert "best: " in out and "predicted MFU" in out and "model FLOPs at peak" in out
    assert "measured at 32% MFU" in out and "GEMM / attention efficiency" in out.split("measured at 32% MFU")[1]


def test_selective_ac_recomputes_the_ops_the_titan_time_policy_names():
    """torchtitan's SelectiveAC policy on a real block run on the CPU (the plain Llama's: wq wk wv, SDPA,
    wo, w1 w3 w2 in torchtitan's op order): the forward mms its backward runs again are exactly the
    GEMMs the torchtitan time policy recomputes (wk, wo, w3: every second mm), and on the CPU the SDPA
    math kernel runs again as the policy's CPU recompute says."""
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from launchers.llama import Block
    from ledger.faithful.titan.steptime import time_policy
    from ledger.model import ModelShape

    # a forward linear's mm multiplies by the weight's transpose (a strided view), a backward's by the
    # weight or an activation: the operands' shapes and strides tell the recomputed forward mms apart
    shape = ModelShape(layers=1, hidden=64, ffn_hidden=96, heads=4, kv_heads=2, vocab=128, seq_len=10)
    block = SelectiveAC(SelectiveAC.Config())._wrap_block(Block(shape, 10000.0, 1e-5))
    mm = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in mm:
                self.calls.append((tuple(args[0].shape), tuple(args[1].shape), tuple(args[1].stride())))
            elif "scaled_dot_product" in str(func) and "backward" not in str(func):
                self.calls.append("sdpa")
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 10, 64, requires_grad=True)
    with Record() as fwd:
        out = block(x)
    with Record() as bwd:
        out.sum().backward()
    forward_sig = dict(zip(("q", "k", "v", "proj", "w1", "w3", "fc2"), [c for c in fwd.calls if c != "sdpa"]))
    assert len(forward_sig) == 7 and fwd.calls.count("sdpa") == 1
    recomputed = Counter(c for c in bwd.calls if c == "sdpa" or c in forward_sig.values())

    for device, attention_again in (("cuda", 0), ("cpu", 1)):
        names = time_policy(SimpleNamespace(activation_checkpoint="selective", fuse_qkv=False), SimpleNamespace(pp=1),
                            device).recompute_ops
        predicted = Counter(sig for name, sig in forward_sig.items() if name in names)
        assert {n for n in forward_sig if n in names} == {"k", "proj", "w3"}
        assert recomputed - Counter({"sdpa": 1}) == predicted
        assert ("attention" in names) == bool(attention_again)
    assert recomputed["sdpa"] == 1  # this CPU run: the math kernel is not in the save list


def test_fused_qkv_is_one_gemm_and_the_split_s_copies():
    """torchtitan's fuse_qkv (models/common/attention.py FusedQKVLinear): q, k and v are one GEMM of their
    FLOPs together, then its output is copied into contiguous q, k, v (a read and a write of each element,
    the grads' cat in backward); SelectiveAC's mm count then runs wqkv 1, wo 2, w1 3, w3 4, w2 5, so its
    backward re-runs wo's and w3's GEMMs and the split's copies, not a k GEMM."""
    import dataclasses

    from ledger.faithful.titan.steptime import time_policy
    from ledger.timing import ops

    sh = ops.Shard(hidden=256, ffn=768, heads=8, kv_heads=2, head_dim=32, vocab=1024, seq=128, micro_batch=2,
                   tp=1, sp=False, causal_kernel=True, split_projections=True)
    sep, fus = ops.layer_forward(sh), ops.layer_forward(dataclasses.replace(sh, fused_qkv=True))
    by = {o.name: o for o in fus}
    assert by["qkv"].flops == sum(o.flops for o in sep if o.name in ("q", "k", "v")) and "k" not in by
    T, qkv = 2 * 128, (8 + 2 * 2) * 32
    assert by["qkv_split"].kind == "memory" and by["qkv_split"].bytes == by["qkv_split"].bwd_bytes == 2 * 2 * T * qkv
    names = [o.name for o in fus]
    assert names.index("qkv") < names.index("qkv_split") < names.index("rope")
    pol = time_policy(SimpleNamespace(activation_checkpoint="selective", fuse_qkv=True), SimpleNamespace(pp=1), "cuda")
    assert pol.fused_qkv and {o.name for o in fus if o.kind == "gemm" and o.name in pol.recompute_ops} == {"proj", "w3"}
    assert "qkv_split" in pol.recompute_ops


def test_attention_runs_at_its_kernel_s_efficiency():
    """An attention op's time on a preset: its FLOPs at the profile's fraction for the kernel that runs
    (FlexAttention 0.90 / 0.85 of FlashAttention-2's 35% on Hopper; TE's fused attention FlashAttention-3's),
    the GEMMs' efficiency for batched matmuls and where a profile names no figure (B200)."""
    h100, b200 = hardware.profile("h100"), hardware.profile("b200")
    flops, over = 1e12, h100.kernel_overhead_s
    cases = [(h100, "flex", False, 0.35 * 0.90), (h100, "flex", True, 0.35 * 0.85), (h100, "flash2", True, 0.35),
             (h100, "te_fused", False, 0.75), (h100, "unfused", False, h100.gemm_efficiency),
             (b200, "flex", False, b200.gemm_efficiency)]
    for p, kernel, backward, eff in cases:
        op = ops.Op("attention", "attention", flops, 1.0, kernel=kernel, backward=backward)
        assert ops.op_seconds(op, p) == pytest.approx(flops / (p.peak() * eff) + over)
    # a calibrated yaml keeps the figures; a kernel it does not know is refused naming the field
    assert hardware.from_dict(hardware.to_dict(h100)) == h100
    bad = hardware.to_dict(h100) | {"attention_efficiency": {"fa9": [0.5, 0.5]}}
    with pytest.raises(Exception, match="attention_efficiency"):
        hardware.from_dict(bad)


@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (1, 2, 1), (1, 8, 1), (2, 2, 2), (4, 1, 4), (2, 4, 1)])
def test_an_moe_layer_s_experts_do_the_rank_s_balanced_share(tp, ep, etp):
    """With routing balanced every rank of a stage computes T x topk / tp routed copies through one
    expert's SwiGLU (6 h ffn FLOPs each, forward), whatever the expert layout (ep, etp); a capacity
    factor pads every expert to its capacity, at least min_capacity rows."""
    T, h, f, E, k = 4096, 1024, 2816, 8, 2
    base = dict(hidden=h, ffn=4 * h, heads=8, kv_heads=8, head_dim=128, vocab=1000, seq=T, micro_batch=1, tp=tp,
                sp=tp > 1, causal_kernel=True, num_experts=E, topk=k, expert_ffn=f, ep=ep, etp=etp)
    experts = [op for op in ops.moe_layer_forward(ops.Shard(**base)) if op.name.startswith("expert_w")]
    assert sum(op.flops for op in experts) == pytest.approx(6 * (T * k // tp) * h * f)
    padded = [op for op in ops.moe_layer_forward(ops.Shard(**base, capacity_factor=1.25)) if op.name == "expert_w1"][0]
    assert padded.mnk[0] == (E // ep) * math.ceil(T * k // tp * etp * ep / E * 1.25)
    floor = [op for op in ops.moe_layer_forward(ops.Shard(**base, min_capacity=10 ** 6)) if op.name == "expert_w1"][0]
    assert floor.mnk[0] == (E // ep) * 10 ** 6
    # the router reads the rank's tokens (its SP shard) and scores every expert
    router = next(op for op in ops.moe_layer_forward(ops.Shard(**base)) if op.name == "router")
    assert router.mnk == (T // tp if tp > 1 else T, E, h)


def test_te_p2p_ring_runs_behind_the_attention_and_the_gathers_do_not():
    """Megatron with TE's p2p CP: the K/V ring's time is exposed only beyond the stage's attention kernels
    (AttnFuncWithCPAndKVP2P issues each next exchange before its attention chunk); all_gather's
    gathers stay exposed. At llama3_1b seq 8192 cp 2 on H100 the ring hides entirely."""
    import dataclasses

    from ledger import frameworks
    from ledger.faithful.megatron import states as L
    from ledger.model import preset
    from ledger.timing.step import step_time
    from tests.conftest import megatron_fw, megatron_layout

    m = preset("llama3_1b")
    lay = megatron_layout(dp=4, cp=2, global_batch_size=8)
    hw = hardware.profile("h100")
    spec = frameworks.get("megatron")
    times = {}
    for t in ("p2p", "all_gather"):
        fw = megatron_fw(transformer_impl="transformer_engine", cp_comm_type=t, recompute_granularity=None,
                         recompute_method=None, recompute_num_layers=None, recompute_modules=None)
        pol = spec.time_policy(fw, lay, "cuda")
        st = step_time(m, lay, L.place(m, lay, fw, "cuda-nccl"), pol, hw)
        exposed = step_time(m, lay, L.place(m, lay, fw, "cuda-nccl"),
                            dataclasses.replace(pol, cp_ring_behind_attention=False), hw)
        times[t] = (pol.cp_ring_behind_attention, st, exposed)
    hides, st, exposed = times["p2p"]
    assert hides and st.comm_s["cp"] > 0 and "cp" not in st.exposed_s
    assert exposed.exposed_s["cp"] == pytest.approx(st.comm_s["cp"])
    assert st.step_s == pytest.approx(exposed.step_s - exposed.exposed_s["cp"])
    hides, st, _ = times["all_gather"]
    assert not hides and st.exposed_s["cp"] == pytest.approx(st.comm_s["cp"])
