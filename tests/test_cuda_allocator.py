"""The CUDA caching allocator's simulation (ledger/cuda_allocator.py) against its policy worked by hand
(c10/cuda/CUDACachingAllocator.cpp's constants and rules), and the peak probe's replay of a recorded
step through it."""
from ledger.cuda_allocator import CachingAllocator, allocation_size, round_size

MiB = 1 << 20


def test_requests_round_to_512_byte_blocks_and_segments_by_size():
    assert [round_size(n) for n in (0, 1, 511, 512, 513, 5000)] == [512, 512, 512, 512, 1024, 5120]
    # a small request's segment is 2 MiB, a large one's 20 MiB below 10 MiB, else rounded to 2 MiB
    assert [allocation_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB + 512)] == \
        [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]


def test_small_requests_share_a_2_mib_segment():
    a = CachingAllocator()
    a.malloc("a", 100)
    a.malloc("b", 1000)
    assert (a.allocated, a.reserved, a.segments) == (512 + 1024, 2 * MiB, 1)
    a.malloc("c", 0)  # a zero-byte storage takes no block
    assert a.allocated == 1536


def test_a_large_block_splits_only_where_more_than_1_mib_is_left():
    a = CachingAllocator()
    a.malloc("a", 5 * MiB)  # a 20 MiB segment, 15 MiB left cached
    a.malloc("b", 12 * MiB)  # best fit: the 15 MiB block, 3 MiB left
    assert (a.reserved, a.allocated, a.segments) == (20 * MiB, 17 * MiB, 1)
    a.malloc("c", 11 * MiB + 512)  # no cached block serves it: a 12 MiB segment
    # the 1 MiB - 512 left of it is not split off (not more than 1 MiB): the whole block is allocated
    assert (a.reserved, a.allocated) == (32 * MiB, 29 * MiB)


def test_fragmentation_costs_a_new_segment_and_merging_gives_it_back():
    a = CachingAllocator()
    for k in "xyz":
        a.malloc(k, 4 * MiB)  # one 20 MiB segment: x y z and 8 MiB cached
    a.free("x")
    a.free("z")  # z merges with the 8 MiB tail: 12 MiB free, x's 4 MiB apart
    assert (a.allocated, a.reserved) == (4 * MiB, 20 * MiB)
    a.malloc("w", 14 * MiB)  # 16 MiB free in all, no block of 14: a new 14 MiB segment
    assert (a.reserved, a.peak_reserved, a.segments) == (34 * MiB, 34 * MiB, 2)
    a.free("w")
    a.free("y")  # x, y, z and the tail merge back into the first segment's one 20 MiB block
    a.malloc("v", 18 * MiB)
    assert (a.allocated, a.reserved, a.segments) == (18 * MiB, 34 * MiB, 2)
    a.reset_peaks()
    assert (a.peak_allocated, a.peak_reserved) == (18 * MiB, 34 * MiB)


def test_a_resize_frees_the_block_and_allocates_the_new_size():
    """FSDP2's unsharded parameters: resize_ to 0 after use, back to the full size for the next gather."""
    a = CachingAllocator()
    a.malloc("p", 30 * MiB)
    a.resize("p", 0)
    assert (a.allocated, a.reserved) == (0, 30 * MiB)
    a.resize("p", 30 * MiB)  # the cached block serves it again
    assert (a.allocated, a.reserved, a.segments) == (30 * MiB, 30 * MiB, 1)


def test_the_peak_probe_replays_each_step_through_the_allocator():
    """A recorded step of tensors made and dropped, replayed after what was live when it began (in this
    process: whatever earlier tests left, found by the probe's scan): its allocated peak is those
    storages' blocks plus the step's largest moment in 512-byte blocks; reserved is the simulation's
    from the same start; an identical second step, served from the cached segments, reserves nothing
    more."""
    import torch

    from probes.peak import PeakTracker

    tr = PeakTracker()
    keep = torch.ones(1000)  # live before the step: the replay starts with it
    sims = []
    for step in range(2):
        tr.begin(scan=True)
        with tr.recording():
            a = torch.ones(3 * MiB // 4)  # a large block (3 MiB)
            b = torch.ones(100)  # a small one
            del a
            c = torch.ones(MiB // 4 + 1)  # fits the cached 3 MiB block
            del b, c
        tr.end()
        sims.append(tr.result(None, timeline=False)["cuda_allocator_sim"])
        if step == 0:
            ref = CachingAllocator()
            for s in sorted(tr.start_serials):
                ref.malloc(s, tr.start_serials[s])
            ref.reset_peaks()
            start_blocks = ref.allocated
            for key, size in (("a", 3 * MiB), ("b", 400)):
                ref.malloc(key, size)
            ref.free("a")
            ref.malloc("c", MiB + 4)
            assert sims[0]["peak_allocated_bytes"] == start_blocks + round_size(3 * MiB) + round_size(400)
            assert sims[0]["peak_reserved_bytes"] == ref.peak_reserved
    assert sims[1]["peak_allocated_bytes"] == sims[0]["peak_allocated_bytes"]
    assert sims[1]["reserved_bytes"] == sims[0]["reserved_bytes"] and sims[1]["segments"] == sims[0]["segments"]
    del keep
