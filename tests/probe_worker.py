"""Two gloo ranks exercising the probes with plain torch.distributed (run by tests/test_probes.py)."""
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from ledger.grid import Grid
from probes.session import ProbeSession

dist.init_process_group("gloo")
rank = dist.get_rank()
grid = Grid(tp=2, dp=2)  # world 4: tp groups {0,1},{2,3}; dp groups {0,2},{1,3}
tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
tp, dp = tp_groups[rank // 2], dp_groups[rank % 2]
single = [dist.new_group([r]) for r in range(4)][rank]
out = sys.argv[1]
s = ProbeSession(grid, rank, f"{out}/rank{rank}.json")
flat = torch.zeros(1000, dtype=torch.bfloat16)
params = [flat[:600].view(20, 30), flat[600:]]  # views into one flat buffer: counted once
grads = [torch.zeros(10), torch.zeros(5)]
for step in range(2):
    with s.step(step):
        dist.all_reduce(torch.ones(10, dtype=torch.bfloat16), group=tp)            # 20 B
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=dp)        # full 32 B
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8), group=dp)         # full 32 B
        dist.all_reduce(torch.ones(3), group=single)                                 # group of one: ignored
        peer = rank ^ 1
        ops = [dist.P2POp(dist.isend, torch.ones(6), peer, tp), dist.P2POp(dist.irecv, torch.empty(6), peer, tp)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        y = fc.all_gather_tensor(torch.ones(5), 0, dp) + 0                          # functional: full 40 B
        dist.all_reduce(torch.ones(2))                                               # world: tp-dp
    s.state(lambda: {"params": params, "grads": grads + [params[0]], "optim": [torch.zeros(7)]})
s.dump({"status": "ok"})
# every rank done before any tears its gloo pairs down (a rank destroying its group while a peer still
# sends has aborted in gloo's teardown: "terminate called without an active exception")
dist.barrier()
dist.destroy_process_group()
