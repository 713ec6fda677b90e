"""DeepSpeed ZeRO-1/2/3 on the plain-PyTorch Llama: engine(batch) / engine.backward(loss) / engine.step().

One probe "step" is one optimizer step: gradient_accumulation_steps micro-batches, each
forward + backward + engine.step() (DeepSpeed steps the optimizer at the accumulation boundary).

CPU (cluster.device=cpu): DS_ACCELERATOR=cpu and gloo, set before deepspeed is imported; torch's
AdamW ("torch_adam") instead of DeepSpeed's JIT-built CPU Adam; the shm all-reduce op, which
DeepSpeed JIT-compiles at init_distributed, is disabled. GPU (cluster.device=cuda): the CUDA
accelerator and NCCL, one GPU per rank (LOCAL_RANK). cluster=fake: the CPU accelerator on torch's
fake process group, under FakeTensorMode, with the shims of install_fake() (below).
"""
from __future__ import annotations

import json
import os
import shlex
import sys

from launchers import shell_comment, write_file, write_script
from ledger.faithful.deepspeed.rules import offloads, offloads_params, overlap_comm
from ledger.layout import Layout


def ds_config(cfg, lay: Layout) -> dict:
    """The ds_config dict a user would pass to deepspeed.initialize (also written by mode=dry)."""
    fw = cfg.framework
    zero: dict = {
        "stage": int(fw.zero_stage),
        "reduce_bucket_size": int(fw.reduce_bucket_size),
        "allgather_bucket_size": int(fw.allgather_bucket_size),
        "overlap_comm": overlap_comm(fw),  # explicit: DeepSpeed's own rule when unset
        "contiguous_gradients": bool(fw.contiguous_gradients),
    }
    if fw.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(fw.stage3_prefetch_bucket_size),
                    stage3_max_reuse_distance=int(fw.stage3_max_reuse_distance),
                    stage3_max_live_parameters=int(fw.stage3_max_live_parameters),
                    stage3_param_persistence_threshold=int(fw.stage3_param_persistence_threshold))
    out = {
        "train_batch_size": lay.global_batch_size,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": lay.num_microbatches,
        "gradient_clipping": float(fw.gradient_clipping),
        "bf16": {"enabled": fw.precision == "bf16"},
        "optimizer": {"type": "AdamW",
                      # torch_adam: torch.optim.AdamW (no JIT-built fused / CPU Adam)
                      "params": {"lr": float(cfg.train.lr), "betas": [0.9, 0.95], "weight_decay": 0.1,
                                 "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if offloads(fw):
        # ZeRO-Offload (runtime/zero/offload_config.py DeepSpeedZeroOffloadOptimizerConfig). On a GPU the
        # optimizer is DeepSpeed's default under offload, DeepSpeedCPUAdam (built on first use); the CPU
        # harness keeps torch's AdamW (torch_adam: engine.py takes it under offload too)
        zero["offload_optimizer"] = {"device": fw.offload_optimizer, "pin_memory": bool(fw.offload_optimizer_pin_memory)}
        if cfg.cluster.device == "cuda":
            del out["optimizer"]["params"]["torch_adam"]
    if offloads_params(fw):  # ZeRO-3's (offload_config.py DeepSpeedZeroOffloadParamConfig)
        zero["offload_param"] = {"device": fw.offload_param, "pin_memory": bool(fw.offload_param_pin_memory)}
    if lay.cp > 1:
        # DeepSpeed-Ulysses (layout.cp: the sequence parallel degree): the engine reads the size from the mpu
        # (runtime/sequence_parallel/parallel_state_sp.py); its gradient reductions run in
        # seq_parallel_communication_data_type (runtime/constants.py: fp32 by default; engine.py sets
        # communication_data_type from it when sequence_parallel_size > 1)
        out["sequence_parallel_size"] = lay.cp
        out["seq_parallel_communication_data_type"] = fw.seq_parallel_communication_data_type
    if fw.get("activation_checkpointing", False):
        # read by deepspeed.checkpointing.configure(mpu_, deepspeed_config=...) (runtime/
        # activation_checkpointing/config.py): plain reentrant checkpoints, inputs kept on the device
        out["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False, "synchronize_checkpoint_boundary": False,
                                           "profile": False}
    return out


def _setup_env(cfg) -> None:
    """Before `import deepspeed`: it picks its accelerator at import time."""
    if cfg.cluster.device in ("cpu", "fake"):  # fake: FakeTensors on the CPU device
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        os.environ["DS_ACCELERATOR"] = "cuda"
    os.environ.setdefault("DS_BUILD_OPS", "0")


def _no_shm_op() -> None:
    # deepspeed.comm.torch.build_shm_op JIT-compiles a C++ op (minutes) on the CPU accelerator.
    # The attribute path deepspeed.comm.torch resolves to the torch package, hence sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


# -- cluster=fake (launchers/fake.py): DeepSpeed on torch's fake process group, its model, flat
#    partitions and optimizer state under FakeTensorMode. The fake-only shims, each counted in
#    FAKE_HITS; installed by install_fake() only when cluster.device == "fake".
FAKE_HITS: dict[str, int] = {}
FAKE_SHIMS = ("module_to_skipped_on_cpu", "rank0_list_is_local", "reduce_scatter_coalesced_flat",
              "allgather_coalesced_wait_whole", "allgather_dtype_own_partition")

# data-dependent reads of FakeTensors answered 0 / False (launchers/fake.py scalar_reads)
FAKE_SCALAR_SITES: set[tuple[str, str]] = {
    # runtime/utils.py is_invalid_grad_norm: `bool((~torch.isfinite(norm) | (norm < 0)).any())`
    # (stage3.py step / stage_1_and_2.py step, after the norm's all-reduce): False, a valid norm
    ("deepspeed.runtime.utils", "is_invalid_grad_norm"),
    # runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.has_overflow: `overflow_gpu[0].item()`
    # after the overflow all-reduce (ZeRO-1/2 with gradient clipping): 0, no overflow, the step runs
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.has_overflow"),
    # ZeRO-Offload: update_offload_overflow_tracker's `self._has_inf_or_nan(grad.data)` on each reduced gradient
    # (False: no overflow) and complete_grad_norm_calculation_for_cpu_offload's `param_norm.item()` and
    # `total_dev_norm[0].item()` (0: a finite norm, the step runs)
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.update_offload_overflow_tracker"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.complete_grad_norm_calculation_for_cpu_offload"),
    # ZeRO-3's (stage3.py): `float(total_norm)` of the per-param norms summed
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.complete_grad_norm_calculation_for_cpu_offload"),
}


def _fake_hit(name: str) -> None:
    FAKE_HITS[name] = FAKE_HITS.get(name, 0) + 1


def _module_to_skipped_on_cpu() -> None:
    # runtime/engine.py DeepSpeedEngine._configure_distributed_model: `self.module.to(self.device)`
    # (ZeRO-0/1/2) -> nn.Module._apply swaps each FakeTensor parameter (tensor subclasses are
    # swapped, torch/nn/modules/module.py _apply), which a weakref blocks ("_apply(): Couldn't swap
    # Embedding.weight"). The parameters are already on the CPU device: the move is a no-op there
    import sys

    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensor

    orig = nn.Module.to

    def to(self, *a, **k):
        caller = sys._getframe(1)
        if caller.f_globals.get("__name__") == "deepspeed.runtime.engine" and \
                caller.f_code.co_name == "_configure_distributed_model":
            ps = list(self.parameters())
            target = a[0] if a else k.get("device")
            if ps and all(isinstance(p, FakeTensor) and p.device.type == "cpu" for p in ps) and \
                    str(target).split(":")[0] == "cpu":
                _fake_hit("module_to_skipped_on_cpu")
                return self
        return orig(self, *a, **k)

    nn.Module.to = to


def _rank0_list_is_local() -> None:
    # runtime/zero/utils.py get_lst_from_rank0 (assert_ints_same_as_other_ranks: ZeRO-3's trace and
    # partition checks): broadcasts rank 0's list of ints and reads it back element by element. On
    # the fake world the broadcast moves nothing (the read would be 0s, and the check then fails on
    # "a disagreement on list contents"); every rank runs the same program, so rank 0's list is
    # this rank's. The broadcast is issued as the original issues it (the ledger counts it,
    # ledger/faithful/deepspeed/zero3.py _trace_checks); the list returned is the local one
    import torch

    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import utils

    def get_lst_from_rank0(lst):
        _fake_hit("rank0_list_is_local")
        t = torch.tensor(lst if dist.get_rank() == 0 else [-1] * len(lst), dtype=int,
                         device=torch.device(get_accelerator().device_name(os.environ["LOCAL_RANK"])),
                         requires_grad=False)
        dist.broadcast(t, src=0, async_op=False)
        return list(lst)

    utils.get_lst_from_rank0 = get_lst_from_rank0


def _reduce_scatter_coalesced_flat() -> None:
    # runtime/comm/coalesced_collectives.py reduce_scatter_coalesced (ZeRO-3's grad reduction,
    # stage3.py __avg_scatter_grads): views every tensor's chunk for every rank and, unless one tensor
    # divides evenly, interleaves them with their paddings into one flat buffer by torch.cat: O(world x
    # tensors) operators per call, each a FakeTensor dispatch in the fake world (at DP 1,024 the run
    # did not finish in 25 minutes). Here the flat buffer (world x the padded partitions, the same
    # size and dtype) is one allocation, pre-divided, reduce-scattered by the same call, and each
    # tensor's output is the same narrow view of this rank's chunk: the same collective, bytes and
    # outputs; what differs is the copies' values (a fake world has none) and the small padding
    # tensors the cat's list held until it returned
    import math

    import torch

    from deepspeed import comm as dist
    from deepspeed.runtime.comm import coalesced_collectives as cc
    from deepspeed.runtime.zero import stage3

    @torch.no_grad()
    def reduce_scatter_coalesced(tensors, group=None):
        _fake_hit("reduce_scatter_coalesced_flat")
        this_rank = dist.get_rank(group)
        world_sz = dist.get_world_size(group)
        padded = tuple(math.ceil(t.numel() / world_sz) for t in tensors)
        if len(tensors) == 1 and tensors[0].numel() % world_sz == 0:
            flat = tensors[0].view(-1)
        else:
            flat = torch.empty(world_sz * sum(padded), dtype=tensors[0].dtype, device=tensors[0].device)
        flat.div_(world_sz)
        # this rank's chunk of torch.chunk(flat, world_sz) (flat divides evenly), without the world's views
        chunk = flat.narrow(0, this_rank * sum(padded), sum(padded))
        cc._torch_reduce_scatter_fn(flat, chunk, group=group)
        out, offset = [], 0
        for t, pad in zip(tensors, padded):
            mine = max(0, min(pad, t.numel() - this_rank * pad))  # flattened[r*c : r*c+c]'s length
            out.append(chunk.narrow(0, offset, mine))
            offset += pad
        return out

    cc.reduce_scatter_coalesced = reduce_scatter_coalesced
    stage3.reduce_scatter_coalesced = reduce_scatter_coalesced


def _allgather_coalesced_wait_whole() -> None:
    # runtime/zero/partition_parameters.py AllGatherCoalescedHandle.wait (ZeRO-3's parameter fetch):
    # for every parameter of the bucket, a narrow of every rank's partition, then torch.cat of them
    # into the parameter's new data: O(world x params) operators per fetch, each a FakeTensor dispatch
    # in the fake world (at DP 256 12 of a rank's 34 s; growing with the DP degree). Here each
    # parameter's data is the same allocation (ds_numel elements in the partitions' dtype, viewed as
    # its shape and cast to its dtype) in one operator: the same storages, sizes and order; what
    # differs is their values (a fake world has none). The quantized and secondary-tensor paths, which
    # this project does not configure, keep the original
    import torch

    from deepspeed.runtime.zero import partition_parameters as pp

    orig = pp.AllGatherCoalescedHandle.wait

    def wait(self, handle_dependency=True) -> None:
        if self.complete or self.quantization or self.use_secondary_tensor:
            return orig(self, handle_dependency)
        _fake_hit("allgather_coalesced_wait_whole")
        self.allgather_handle.wait()
        dtype, device = self.partitions[0].dtype, self.partitions[0].device
        for param in self.params:
            assert param.ds_status == pp.ZeroParamStatus.INFLIGHT, f"expected param {param.ds_summary()} to be inflight"
            whole = torch.empty(param.ds_numel, dtype=dtype, device=device)
            param.data = whole.view(param.ds_shape).to(param.ds_tensor.dtype)
            param.ds_status = pp.ZeroParamStatus.AVAILABLE
        self.complete = True

    pp.AllGatherCoalescedHandle.wait = wait


def _allgather_dtype_own_partition() -> None:
    # runtime/zero/partition_parameters.py Init._convert_to_deepspeed_param's _all_gather_dtype (every
    # coalesced fetch of ZeRO-3): the flat all-gather buffer, then a narrow of it for every rank's
    # partition, of which it fills and sends its own: O(world) operators per fetch in the fake world (at
    # DP 16,384 a rank's fetches took most of its time). Here only the rank's own partition is viewed:
    # the same buffer, copy and collective; the handle's partitions list holds that one view (the
    # buffer stays alive with it as with all of them), which _allgather_coalesced_wait_whole reads.
    # The closure is per parameter: its cell is set after each conversion
    import torch

    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters as pp

    def own_partition(orig):
        def _all_gather_dtype(params, world_size, rank_in_group, ds_process_group, allgather_dtype):
            if params[0].ds_secondary_tensor is not None:
                return orig(params, world_size, rank_in_group, ds_process_group, allgather_dtype)
            _fake_hit("allgather_dtype_own_partition")
            assert all(pp.get_allgather_dtype(p, p.ds_tensor) == allgather_dtype for p in params)
            partition_sz = sum(p.ds_tensor.ds_numel for p in params)
            flat = torch.empty(partition_sz * world_size, dtype=allgather_dtype,
                               device=get_accelerator().current_device_name(), requires_grad=False)
            mine = flat.narrow(0, partition_sz * rank_in_group, partition_sz)
            torch.cat([p.ds_tensor.to(get_accelerator().current_device_name()).to(allgather_dtype) for p in params],
                      out=mine)
            handle = pp._dist_allgather_fn(mine, flat, ds_process_group)
            return pp.AllGatherCoalescedHandle(allgather_handle=handle, params=params, partitions=[mine],
                                               world_size=world_size, use_secondary_tensor=False)
        return _all_gather_dtype

    def cell(fn, name):
        # through DeepSpeed's instrument_w_nvtx wrapper (utils/nvtx.py: wrapped_fn calls `func`)
        while name not in fn.__code__.co_freevars:
            fn = getattr(fn, "__wrapped__", None) or fn.__closure__[fn.__code__.co_freevars.index("func")].cell_contents
        return fn.__closure__[fn.__code__.co_freevars.index(name)]

    orig = pp.Init._convert_to_deepspeed_param

    def convert(self, param):
        orig(self, param)
        inner = cell(param.all_gather_coalesced, "_all_gather_coalesced").cell_contents
        c = cell(inner, "_all_gather_dtype")
        c.cell_contents = own_partition(c.cell_contents)

    pp.Init._convert_to_deepspeed_param = convert


def install_fake() -> None:
    _module_to_skipped_on_cpu()
    _rank0_list_is_local()
    _reduce_scatter_coalesced_flat()
    _allgather_coalesced_wait_whole()
    _allgather_dtype_own_partition()


def preload(device: str) -> None:
    """For launchers.forkserver: `import deepspeed` with the accelerator run_rank picks (it is
    chosen at import, _setup_env); each rank sets its own environment again in run_rank."""
    os.environ["DS_ACCELERATOR"] = "cpu" if device == "cpu" else "cuda"
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    # what a forked rank still imported during deepspeed.initialize and its steps (its sys.modules
    # after the run less before it): torch._dynamo (deepspeed/runtime/compiler.py imports it on
    # first use), torch._inductor and functorch.compile (its compile paths, original_muon.py's
    # @compiler.compile): 4.7 s of CPU in every rank, once here instead
    import functorch.compile  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    from launchers import llama  # noqa: F401


def run_rank(cfg, lay: Layout, session) -> dict:
    _setup_env(cfg)
    import torch

    import deepspeed

    cpu = cfg.cluster.device in ("cpu", "fake")
    if cpu:
        _no_shm_op()
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if cfg.cluster.device != "fake":
        deepspeed.init_distributed(dist_backend=cfg.cluster.backend)
        return _train(cfg, lay, session)
    from launchers import fake

    # the fake world first; deepspeed.init_distributed (comm/comm.py) then wraps the initialised
    # torch.distributed instead of starting its own. The model (zero.Init's partitions included),
    # the engine's flat buffers, the optimizer and the steps under FakeTensorMode
    fake.init_process_group()
    install_fake()
    deepspeed.init_distributed(dist_backend="fake")
    with fake.tensor_mode(), fake.scalar_reads(FAKE_SCALAR_SITES):
        extra = _train(cfg, lay, session)
    extra.update(fake_shims=dict(FAKE_HITS), fake_scalar_reads=fake.scalar_read_hits())
    return extra


def _train(cfg, lay: Layout, session) -> dict:
    import torch

    import deepspeed

    from launchers.data import batch
    from launchers.llama import Llama
    from ledger.model import ModelShape

    fake_world = cfg.cluster.device == "fake"
    rank = torch.distributed.get_rank()

    conf = ds_config(cfg, lay)
    shape = ModelShape.from_config(cfg.model)
    torch.manual_seed(cfg.train.seed)
    mpu, piece, sequence_parallel = ulysses(lay.cp, shape)
    ckpt = None
    if "activation_checkpointing" in conf:
        # as a DeepSpeed user does it (Megatron-DeepSpeed's pattern): configure from the ds_config,
        # then wrap each layer in deepspeed.checkpointing.checkpoint
        deepspeed.checkpointing.configure(None, deepspeed_config=conf)
        ckpt = deepspeed.checkpointing.checkpoint
    if cfg.framework.zero_stage == 3:
        # no dtype: zero.Init(dtype=float32) yields bf16 params on CPUs without fp16 (Init._set_dtype)
        with deepspeed.zero.Init(config_dict_or_path=conf, mpu=mpu):
            model = Llama(shape, cfg.model.rope_theta, cfg.model.norm_eps, checkpoint=ckpt,
                          sequence_parallel=sequence_parallel)
    else:
        model = Llama(shape, cfg.model.rope_theta, cfg.model.norm_eps, checkpoint=ckpt,
                      sequence_parallel=sequence_parallel, **moe_layers(cfg, lay))
    params = model.parameters()
    if shape.is_moe:
        # as a DeepSpeed-MoE user writes it (moe/utils.py): the experts in param groups of their own,
        # which ZeRO partitions over the expert data parallel group
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer({"params": list(params), "name": "parameters"})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=conf, mpu=mpu)
    session.watch([engine.module])
    if shape.is_moe:
        session.name_groups(expert_group_labels(lay))

    # the DP rank: the global rank, or with Ulysses the sequence group's index (its ranks are consecutive)
    dp_rank, dp, sp = rank // lay.cp, lay.dp, lay.cp
    for step in range(cfg.train.steps):
        losses = []
        with session.step(step):
            for micro in range(lay.num_microbatches):
                tokens, labels = batch(shape.vocab, shape.seq_len, lay.micro_batch_size, cfg.train.seed, step,
                                       micro, dp_rank, dp, engine.device)
                loss = engine(tokens[:, piece].contiguous(), labels[:, piece].contiguous())
                # a sequence's loss is the mean over its sp slices: ZeRO sums the sp ranks' gradients
                # (its reductions divide by dp x sp / sp), so each rank's slice mean counts 1 / sp
                engine.backward(loss if sp == 1 else loss / sp)
                engine.step()
                if not fake_world:  # fake: no value to read (numerics are meaningless there)
                    losses.append(loss.detach().float().item())
        session.loss(sum(losses) / len(losses) if losses else None)
        session.state(lambda: state_groups(engine))
    return {"ds_config": conf, "global_steps": engine.global_steps}


def ulysses(cp: int, shape) -> tuple:
    """DeepSpeed-Ulysses for layout.cp > 1, as a user of a custom model sets it up (train_ds.py too): the sequence groups
    (runtime/sequence_parallel/parallel_state_sp.py initialize_sequence_parallel: consecutive ranks,
    the sequence-data-parallel group all of them), passed to deepspeed.initialize as its mpu, and each
    layer's attention wrapped in deepspeed.sequence.layer.DistributedAttention (the all-to-alls that
    gather the sequence and scatter the heads, scatter_idx 2 / gather_idx 1 on (batch, seq, heads,
    head_dim)). (mpu, this rank's slice of every sequence, Llama's sequence_parallel)."""
    if cp == 1:
        return None, slice(0, shape.seq_len), None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.sequence.layer import DistributedAttention

    mpu.initialize_sequence_parallel(cp)
    first = mpu.get_sequence_parallel_rank() * (shape.seq_len // cp)
    attend = DistributedAttention(_local_attention_module(), mpu.get_sequence_parallel_group(), scatter_idx=2, gather_idx=1)
    return mpu, slice(first, first + shape.seq_len // cp), (attend, first)


def _local_attention_module():
    """launchers.llama.local_attention as the module DistributedAttention wraps."""
    import torch

    from launchers.llama import local_attention

    class LocalAttention(torch.nn.Module):
        def forward(self, q, k, v):
            return local_attention(q, k, v)

    return LocalAttention()


def moe_layers(cfg, lay: Layout) -> dict:
    """Llama's MoE arguments for an MoE model: deepspeed.moe.layer.MoE around each MoE layer's expert
    (num_experts, ep_size, k, capacity_factor, min_capacity, drop_tokens by DeepSpeed's names), its
    l_aux added to the loss times framework.moe_loss_coeff (Megatron-DeepSpeed's --moe-loss-coeff)."""
    m, fw = cfg.model, cfg.framework
    if not m.num_experts:
        return {}
    from deepspeed.moe.layer import MoE

    def moe(expert):
        return MoE(m.hidden, expert=expert, num_experts=m.num_experts, ep_size=lay.ep, k=m.moe_router_topk,
                   capacity_factor=fw.capacity_factor, min_capacity=fw.min_capacity, drop_tokens=fw.drop_tokens)
    return {"moe": moe, "aux_loss_coeff": fw.moe_loss_coeff}


def expert_group_labels(lay: Layout) -> dict:
    """DeepSpeed's expert groups (utils/groups.py, made in deepspeed.initialize), each by the label the
    ledger gives its collectives: with ep = world the EP group holds the DP group's ranks."""
    from deepspeed.utils import groups

    name = f"ep_size_{lay.ep}"
    return {groups._get_expert_parallel_group(name): "ep", groups._get_expert_data_parallel_group(name): "edp"}


def _tensors(x) -> list:
    import torch
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def state_groups(engine) -> dict:
    """The engine's real containers at the step boundary, as params / grads / optim / other.

    A tensor that is a view into a flat buffer counts the whole buffer once (probes.memory)."""
    from probes.memory import optimizer_tensors

    opt = engine.optimizer
    mparams = list(engine.module.parameters())
    buckets = [t for b in getattr(opt, "ipg_buckets", {}).values() for t in _tensors(getattr(b, "buffer", None))]
    if hasattr(opt, "fp16_partitioned_groups_flat"):  # ZeRO-3 (stage3.py)
        params = _tensors(opt.fp16_partitioned_groups_flat) + [p.ds_tensor for p in mparams]
        params += [p for p in mparams if p.numel() > 0]  # gathered (persistent) params: full data
        grads = _tensors(getattr(opt, "grad_partitions_flat_buffer", None)) + buckets
        grads += _tensors(getattr(opt, "averaged_gradients", None))
        optim = _tensors(opt.fp32_partitioned_groups_flat)
    else:  # ZeRO-1/2 (stage_1_and_2.py)
        params = _tensors(opt.bit16_groups_flat) + mparams
        grads = _tensors(getattr(opt, "averaged_gradients", None)) + buckets
        grads += _tensors(getattr(opt, "grads_in_partition", None))
        optim = _tensors(opt.single_partition_of_fp32_groups)
    grads += [p.grad for p in mparams if p.grad is not None]
    optim += optimizer_tensors(opt.optimizer)
    other = _tensors(getattr(opt, "_global_grad_norm", None)) + _tensors(getattr(opt, "inf_or_nan_tracker", None))
    host = []
    if getattr(opt, "offload_optimizer", False) is True:  # ZeRO-3 (stage3.py): every sub-group on the host
        off_grads = [g.grad for g in opt.fp32_partitioned_groups_flat if g.grad is not None]
        grads += off_grads
        host = optim + off_grads
    if getattr(opt, "offload_param", False) is True:  # ZeRO-3's partitions in host memory (the ds_tensors views)
        host += _tensors(opt.fp16_partitioned_groups_flat)
    if getattr(opt, "cpu_offload", False):
        # ZeRO-Offload (stage_1_and_2.py): what DeepSpeed places on self.device, 'cpu' under offload (on the CPU
        # accelerator host and device are one memory, so the placement is read from the containers): the fp32
        # partition and its gradient, the optimizer state, the staging buffers; temp_grad_buffer_for_gpu_offload
        # is the device's
        off_grads = [g.grad for g in opt.single_partition_of_fp32_groups if g.grad is not None]
        off_grads += _tensors(getattr(opt, "accumulated_grads_in_cpu", None))
        off_other = _tensors(opt.param_buffer_of_bit16_for_cpu_offload_groups)
        off_other += _tensors(getattr(opt, "temp_grad_buffer_for_cpu_offload", None))
        grads += off_grads
        other += off_other + _tensors(getattr(opt, "temp_grad_buffer_for_gpu_offload", None))
        host = optim + off_grads + off_other
    # DeepSpeed-MoE: each MOELayer keeps its last forward's l_aux and exp_counts (moe/sharded_moe.py
    # MOELayer.forward: self.l_aux, self.exp_counts) until the next
    for mod in engine.module.modules():
        if type(mod).__name__ == "MOELayer":
            other += _tensors(getattr(mod, "l_aux", None)) + _tensors(getattr(mod, "exp_counts", None))
    return {"params": params, "grads": grads, "optim": optim, "other": other, **({"host": host} if host else {})}


# DeepSpeed's own launcher (deepspeed/launcher/runner.py): one node runs it; with a hostfile it
# starts the ranks of every listed node itself (pdsh / ssh), --num_nodes x --num_gpus of them
RUN_LINE = ('deepspeed{hostfile} --num_nodes {nodes} --num_gpus {gpus} "$HERE/train_ds.py" '
            '--deepspeed_config "$HERE/ds_config.json" --model {model} --steps {steps}')
HOSTFILE_ARG = ' --hostfile "${HOSTFILE:-$HERE/hostfile}" --master_addr "${MASTER_ADDR:-$(head -n 1 "${HOSTFILE:-$HERE/hostfile}" | cut -d" " -f1)}"'
# under Slurm the hostfile is the job's nodes (sbatch.sh), each with the GPUs per node as its slots
SLURM_HOSTFILE = ('scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/ slots={gpus}/" > "$HERE/hostfile.slurm"\n'
                  'HOSTFILE="$HERE/hostfile.slurm" bash "$HERE/run.sh"')


TRAIN_DS = """\"\"\"train-ledger: ZeRO on the plain-PyTorch Llama (launchers/llama.py), as run_rank does it.\"\"\"
import argparse, json, os
import deepspeed, torch
from launchers.deepspeed import ulysses
from launchers.llama import Llama
from launchers.data import batch
from ledger.model import ModelShape

ap = argparse.ArgumentParser()
ap.add_argument("--deepspeed_config"); ap.add_argument("--model"); ap.add_argument("--steps", type=int)
ap.add_argument("--local_rank", type=int, default=0)
# DeepSpeed-MoE (an MoE shape): ep_size, capacity_factor, min_capacity, drop_tokens and the l_aux weight
ap.add_argument("--moe", default="{}")
a = ap.parse_args()
deepspeed.init_distributed()
conf = json.load(open(a.deepspeed_config))
shape = ModelShape(**json.loads(a.model))
ckpt = None
if "activation_checkpointing" in conf:   # every decoder layer checkpointed
    deepspeed.checkpointing.configure(None, deepspeed_config=conf)
    ckpt = deepspeed.checkpointing.checkpoint
kw, moe = {}, json.loads(a.moe)
if shape.num_experts:   # deepspeed.moe.layer.MoE around each MoE layer's expert
    from deepspeed.moe.layer import MoE
    coeff = moe.pop("moe_loss_coeff")
    kw = {"moe": lambda expert: MoE(shape.hidden, expert=expert, num_experts=shape.num_experts,
                                    k=shape.moe_router_topk, **moe), "aux_loss_coeff": coeff}
# DeepSpeed-Ulysses: the sequence groups as deepspeed.initialize's mpu, DistributedAttention in every layer
sp = conf.get("sequence_parallel_size", 1)
mpu, piece, seq_parallel = ulysses(sp, shape)   # piece: this rank's slice of every sequence
if conf["zero_optimization"]["stage"] == 3:
    with deepspeed.zero.Init(config_dict_or_path=conf, mpu=mpu):   # no dtype: the config decides
        model = Llama(shape, checkpoint=ckpt, sequence_parallel=seq_parallel)
else:
    model = Llama(shape, checkpoint=ckpt, sequence_parallel=seq_parallel, **kw)
params = model.parameters()
if shape.num_experts:   # the experts in param groups of their own
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(params), "name": "parameters"})
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=conf, mpu=mpu)
for step in range(a.steps):
    for micro in range(engine.gradient_accumulation_steps()):
        x, y = batch(shape.vocab, shape.seq_len, engine.train_micro_batch_size_per_gpu(), 1234, step, micro,
                     engine.global_rank // sp, torch.distributed.get_world_size() // sp, engine.device)
        loss = engine(x[:, piece].contiguous(), y[:, piece].contiguous())
        engine.backward(loss / sp)   # ZeRO sums a sequence group's gradients: each slice's mean counts 1 / sp
        engine.step()
"""


def dry(cfg, lay: Layout, out_dir: str) -> list[str]:
    """ds_config.json, train_ds.py and run.sh for a GPU cluster (DeepSpeed's own launcher)."""
    from dataclasses import asdict

    from launchers import gpu_scripts
    from ledger.model import ModelShape

    conf = ds_config(cfg, lay)
    paths = []
    paths.append(write_file(os.path.join(out_dir, "ds_config.json"), json.dumps(conf, indent=2)))
    paths.append(write_file(os.path.join(out_dir, "train_ds.py"), TRAIN_DS))
    topo = gpu_scripts.topology(cfg.cluster, lay.world)
    multi_node = topo.nodes > 1
    if multi_node:  # one line per node, `name slots=N` (DeepSpeed's hostfile); the names are the user's
        paths.append(write_file(os.path.join(out_dir, "hostfile"),
                                "".join(f"node{i} slots={topo.gpus_per_node}\n" for i in range(topo.nodes))))
    # every value on the command line is shlex-quoted: the model's JSON (its name included) is data
    line = RUN_LINE.format(hostfile=HOSTFILE_ARG if multi_node else "", gpus=topo.gpus_per_node, nodes=topo.nodes,
                           steps=int(cfg.train.steps),
                           model=shlex.quote(json.dumps(asdict(ModelShape.from_config(cfg.model)))))
    if cfg.model.num_experts:
        fw = cfg.framework
        line += " --moe " + shlex.quote(json.dumps(
            {"ep_size": int(lay.ep), "capacity_factor": float(fw.capacity_factor), "min_capacity": int(fw.min_capacity),
             "drop_tokens": bool(fw.drop_tokens), "moe_loss_coeff": float(fw.moe_loss_coeff)}))
    where = ("# multi-node: the hostfile's nodes (edit its names, or set HOSTFILE); run on the first of them\n"
             if multi_node else "")
    paths.append(write_script(os.path.join(out_dir, "run.sh"),
                              "#!/bin/bash\n%s\n# TRAIN_LEDGER = the train-ledger checkout (train_ds.py imports its Llama; "
                              "default: the working directory)\n%s"
                              '%s\nPYTHONPATH="${TRAIN_LEDGER:-$PWD}" %s\n' % (
                                  shell_comment(f"train-ledger: DeepSpeed ZeRO-{int(cfg.framework.zero_stage)}, "
                                                f"{topo.describe()}"), where, gpu_scripts.HERE_LINE, line)))
    return paths + gpu_scripts.sbatch_file(
        cfg.cluster, topo, out_dir,
        [SLURM_HOSTFILE.format(gpus=topo.gpus_per_node) if multi_node else 'bash "$HERE/run.sh"'],
        f"DeepSpeed ZeRO-{int(cfg.framework.zero_stage)}", submit="TRAIN_LEDGER=<checkout> sbatch sbatch.sh")
