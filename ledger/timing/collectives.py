"""A collective's time: latency + the bytes one rank moves / the link's bus bandwidth.

nccl-tests' convention (its doc/PERFORMANCE.md): algbw = size / time, busbw = algbw x factor, with
factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for
broadcast, reduce and send/recv; size is the full tensor (all_gather's output, reduce_scatter's
input). So the bandwidth term is size x factor / busbw, which is exactly the ring's per-rank bytes
(ledger/placement.py wire_bytes) over busbw. The latency term is per ring step: (n-1) steps for
all_gather / reduce_scatter / all_to_all, 2(n-1) for a ring all_reduce, 2 log2(n) for a tree
all_reduce (NCCL's double binary tree, whose bandwidth term is the whole tensor twice: reduced up,
broadcast down), one for send/recv; an all_reduce takes the faster of ring and tree, as NCCL's tuner
picks the algorithm of the least predicted time (src/graph/tuning.cc). A group spanning nodes runs at the
network's latency and at its busbw times the NICs the group drives (network_lanes); one inside a node
at NVLink's (ledger/grid.py link_of decides which)."""
from __future__ import annotations

import math

from ledger.grid import link_of, node_ranks
from ledger.placement import wire_bytes
from ledger.timing.hardware import Link, Profile

# busbw factor per kind (nccl-tests), as a function of the group size
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
           "broadcast": lambda n: 1.0, "send_recv": lambda n: 1.0}


def network_lanes(kind: str, ranks_on_node: int) -> int:
    """How many NICs of a node one group's collective drives across nodes, each GPU with its own NIC
    (the presets' DGX / HGX nodes). NCCL's rings and trees leave a node through a channel per NIC its
    ranks there are close to, so a group with g ranks on each node moves its ring traffic over g NICs at
    once: nccl-tests' inter-node busbw is the node's NICs together, not one NIC (NVIDIA/nccl-tests'
    thread "Evaluation of NCCL test result": 8 A100 and 4 HDR NICs a node, busbw 85-96 GB/s against
    "200G x 4 / 8" = 100 GB/s; its thread "Single-node and multi-node performance of H100 nodes", NCCL's
    maintainer: "for NDR @ 400Gbps you should see 46-48GB/s per NIC"). Groups of the
    same dim run their collectives at once on their own ranks' NICs, so the share never exceeds g. An
    all_to_all or a send / recv pair sends each rank's own bytes off the node through that rank's NIC:
    one lane."""
    if kind in ("all_to_all", "send_recv"):
        return 1
    return max(1, ranks_on_node)


def network_rate(per_nic: float, lanes: int, nvlink: float) -> float:
    """A group's rate across nodes: one NIC's times the lanes it drives (network_lanes), never above
    NVLink's (the ring's hops inside each node), in the unit the two are given in."""
    return min(per_nic * lanes, max(nvlink, per_nic))


def group_link(hw: Profile, lay, dim: str, kind: str) -> Link:
    """The link a collective over `dim` runs on: NVLink's inside a node; across nodes the network's
    latency at network_rate."""
    if link_of(lay, dim, kind, hw.gpus_per_node) == "intra":
        return hw.intra
    lanes = network_lanes(kind, node_ranks(lay, dim, hw.gpus_per_node))
    return Link(network_rate(hw.inter.busbw_gbps, lanes, hw.intra.busbw_gbps), hw.inter.latency_us)


# NCCL runs a collective on the fewest channels that reach its link's bandwidth, each channel one CTA
# on an SM of its own that no compute kernel shares while it runs (NVIDIA/nccl issue "Does NCCL
# Allreduce kernels slowdown the computation kernels of GPU?", NCCL's maintainer: "If you are on DGX
# with 8 NICs and a top speed of 190 GB/s, then it would use 16 SMs", "NCCL CTAs won't share an SM
# with compute kernels", "We're limited by the bandwidth one SM can achieve"): an SM's share of that
# figure, and at most MAXCHANNELS channels (src/include/device.h)
SM_BUSBW_GBPS = 190.0 / 16
MAX_CHANNELS = 32


def sms_taken(link: Link, hw: Profile) -> int:
    """The SMs a collective on `link` holds while it runs (SM_BUSBW_GBPS); 0 on a device without SMs."""
    if not hw.sms:
        return 0
    return min(MAX_CHANNELS, hw.sms, math.ceil(link.busbw_gbps / SM_BUSBW_GBPS))


def steps(kind: str, n: int, algorithm: str = "ring") -> int:
    """Latency steps of one call on n ranks."""
    if n <= 1:
        return 0
    if kind == "send_recv":
        return 1
    if kind == "all_reduce":
        return 2 * math.ceil(math.log2(n)) if algorithm == "tree" else 2 * (n - 1)
    return n - 1


def seconds(kind: str, size_bytes: float, n: int, link: Link, algorithm: str = "ring", calls: int = 1) -> float:
    """Time of `calls` calls of one kind moving size_bytes in all (nccl-tests' size, summed over the
    calls) over groups of n ranks on one link class, by one algorithm (ring, or tree for all_reduce)."""
    if n <= 1 and kind != "send_recv" or size_bytes <= 0:
        return 0.0
    factor = 2.0 if (kind == "all_reduce" and algorithm == "tree") else FACTORS[kind](n)
    return calls * steps(kind, n, algorithm) * link.latency_us * 1e-6 + size_bytes * factor / (link.busbw_gbps * 1e9)


def comm_seconds(comm, n: int, link: Link) -> float:
    """ledger/placement.py Comm (a dim's calls of one kind per step) on its link: the bandwidth term
    from its wire bytes (the ring's per-rank bytes, = size x factor), the latency per call; an
    all_reduce call by call the faster of ring and tree."""
    bw = link.busbw_gbps * 1e9
    lat = link.latency_us * 1e-6
    if comm.kind == "send_recv":
        return comm.count * lat + comm.buffer_bytes / bw
    if n <= 1:
        return 0.0
    wire = comm.wire_bytes if comm.wire_bytes else wire_bytes(comm.kind, comm.buffer_bytes, n)
    ring = comm.count * steps(comm.kind, n) * lat + wire / bw
    if comm.kind != "all_reduce":
        return ring
    per_call = comm.buffer_bytes / max(comm.count, 1)
    tree = comm.count * (steps("all_reduce", n, "tree") * lat + 2 * per_call / bw)
    return min(ring, tree)
