"""The one place where torchtitan 0.3.0 is redirected to run on CPU gloo ranks.

Each redirect names the torchtitan file it serves and counts in REACHED every time it does its
work, so a test can tell a redirect that stopped being reached (no longer needed, or no longer
working) from one that still carries the run. `install()` is called by launchers.titan only
when cluster.device is "cpu" or "fake" (cluster=fake adds `install_fake()`, its keys `fake_`),
before torchtitan is imported; nothing here touches a GPU run,
except `set_timeout` (see there), which torch 2.13 lacks on every device, `pipeline_step_microbatches`
(see there), torchtitan's call that torch 2.13's pipeline schedules do not take,
`eager_cp_block_mask` and `visible_cp_allgather` (see there), which the comm probe needs on
every device, and `skip_end_sleep` (see there), the harness's own end of a run.
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

REACHED: Counter = Counter()
_installed = False


# -- tools/utils.py: get_device_info() falls back to "cuda" when no accelerator is found, at import
def _device_type_cpu():
    import torch._utils as tu

    orig = tu._get_available_device_type

    def available_or_cpu():
        found = orig()
        if found is None:
            REACHED["device_type"] += 1
            return "cpu"
        return found

    return tu, orig, available_or_cpu


@contextlib.contextmanager
def _scoped_device_type():
    """Only torchtitan's module-level device_type/device_module see "cpu"; torch is left alone."""
    tu, orig, repl = _device_type_cpu()
    tu._get_available_device_type = repl
    try:
        yield
    finally:
        tu._get_available_device_type = orig


# -- components/metrics.py: DeviceMemoryMonitor calls get_device_name / memory_stats / empty_cache,
#    which torch.cpu does not have. The CPU monitor reports no device statistics (zeros).
def _memory_monitor_cpu():
    from torchtitan.components import metrics

    def __init__(self, device: str = "cpu"):
        REACHED["memory_monitor"] += 1
        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_index = 0
        self.device_capacity = 1
        self.device_capacity_gib = self._to_gib(1)

    def get_peak_stats(self):
        REACHED["memory_monitor"] += 1
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        REACHED["memory_monitor"] += 1

    m = metrics.DeviceMemoryMonitor
    m.__init__, m.get_peak_stats, m.reset_peak_stats = __init__, get_peak_stats, reset_peak_stats


# -- models/common/attention.py: FlexAttention is the only language-model attention backend, and
#    flex_attention (compiled or eager) refuses backward on CPU. The same attention is computed
#    with scaled_dot_product_attention under the BlockMask's own mask_mod, evaluated densely
#    (create_mask), so document-causal masking is kept exactly.
def math_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                        return_aux=None, kernel_options=None):
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    REACHED["flex_attention"] += 1
    if score_mod is not None:
        raise NotImplementedError("titan_cpu: score_mod is not supported by the CPU attention redirect")
    B, _, Lq, _ = q.shape
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, B, 1, Lq, k.shape[2], device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    lse = None
    if return_aux is not None and return_aux.lse:
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1) if enable_gqa else k
        s = (q.float() @ kk.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
    return out, AuxOutput(lse=lse)


def _flex_math():
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = staticmethod(math_flex_attention)


# -- distributed/fsdp.py: disable_fsdp_gradient_division() sets gradient_divide_factor=1.0,
#    which FSDP2 turns into ReduceOp.PREMUL_SUM(1.0) for the reduce-scatter; gloo has no
#    PREMUL_SUM. force_sum_reduction_for_comms gives SUM with no division (factor 1): the same
#    numbers and the same collectives.
def _force_sum():
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    orig = fsdp.disable_fsdp_gradient_division

    def disable_division_sum_only(model):
        orig(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                REACHED["force_sum_reduction"] += 1
                m.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division_sum_only


# -- distributed/utils.py set_pg_timeouts(): barrier(device_ids=[device_module.current_device()])
#    passes "cpu" as a device id, which barrier rejects; a plain barrier synchronises the same ranks.
def _barrier_without_device_ids():
    orig = dist.barrier

    def barrier(group=None, async_op=False, device_ids=None):
        if device_ids is not None and any(not isinstance(d, int) for d in device_ids):
            REACHED["barrier_device_ids"] += 1
            device_ids = None
        return orig(group=group, async_op=async_op, device_ids=device_ids)

    dist.barrier = barrier


# -- distributed/utils.py set_pg_timeouts(): torch.distributed.set_timeout does not exist in
#    torch 2.13 (on any device); _set_pg_timeout is the same operation under its private name.
def set_timeout_shim() -> None:
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group=None):
        REACHED["set_timeout"] += 1
        dist.distributed_c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


# -- trainer.py pp_forward_backward_step calls pp_schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=,
#    losses=, loss_kwargs=, return_outputs=) with the micro-batches already split; torch 2.13's
#    PipelineScheduleSingle.step / PipelineScheduleMulti.step (pipelining/schedules.py) take whole-batch
#    *args/**kwargs, treat arg_mbs & co as model kwargs, split them again and fail in _check_inputs
#    ("Expecting 2 arg_mbs but got 1"), on every device. The lists go where torchtitan means them:
#    the same per-step set-up step() does (has_backward, clear_runtime_states), then the schedule's
#    own _step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs).
def pipeline_step_microbatches() -> None:
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if getattr(cls.step, "_ledger_microbatches", False):
            continue
        orig = cls.step

        def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None, arg_mbs=None,
                 kwarg_mbs=None, target_mbs=None, _orig=orig, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _orig(self, *args, target=target, losses=losses, return_outputs=return_outputs,
                             loss_kwargs=loss_kwargs, **kwargs)
            if args or kwargs or target is not None:
                raise TypeError("pipeline step: whole-batch inputs and split micro-batches given together")
            REACHED["pp_step_microbatches"] += 1
            stages = getattr(self, "_stages", None) or [self._stage]
            for stage in stages:  # schedules.py step(): "Set the same has_backward flag", "Clean per iteration"
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
            if return_outputs:
                for stage in stages:
                    if stage.is_last:
                        return self._merge_outputs(stage.output_chunks)
            return None

        step._ledger_microbatches = True
        cls.step = step


# -- distributed/context_parallel/api.py cp_shard -> torch's _context_parallel/_attention.py
#    _create_cp_block_mask builds the CP BlockMask with torch.compile(create_block_mask,
#    fullgraph=True). Under the comm probe's TorchDispatchMode dynamo skips every frame
#    (_dynamo/convert_frame.py: "non-infra torch dispatch mode present"), and fullgraph turns
#    the skip into "torch.compile with fullgraph=True found no compiled frames". The eager
#    create_block_mask builds the same BlockMask (tests/test_titan.py compares them) and runs
#    no collective. A probe effect, not a CPU one: applied on every device.
def eager_cp_block_mask() -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask

    def create_block_mask_eager(*a, **k):
        REACHED["eager_cp_block_mask"] += 1
        return create_block_mask(*a, **k)

    _attention._compiled_create_block_mask = create_block_mask_eager  # read when None: compiled then


# -- distributed/context_parallel/api.py apply_cp_to_forward: FlexAttention's K/V all-gather is
#    torch's custom op cplib::flex_cp_allgather (_context_parallel/_cp_custom_ops.py), backward
#    cplib::flex_cp_allgather_backward. The comm probe's TorchDispatchMode sees the custom op as
#    one opaque op and runs its body with the mode off, so the funcol all_gather_single /
#    reduce_scatter_single inside go unrecorded. The same two bodies (the ops' own functions,
#    `_init_fn`) run here under an autograd.Function instead: the same collectives, seen. A probe
#    effect, not a CPU one: applied on every device.
def visible_cp_allgather() -> None:
    from torch.distributed.tensor.experimental._context_parallel import _cp_custom_ops as ops
    from torchtitan.distributed.context_parallel import api

    gather, scatter = ops.flex_cp_allgather._init_fn, ops.flex_cp_allgather_backward._init_fn

    class AllGatherKV(torch.autograd.Function):  # _cp_custom_ops.py register_autograd, unwrapped
        @staticmethod
        def forward(ctx, k, v, seq_dim, pg_name):
            ctx.seq_dim, ctx.pg_name = seq_dim, pg_name
            return gather(k, v, seq_dim, pg_name)

        @staticmethod
        def backward(ctx, grad_k, grad_v):
            REACHED["visible_cp_allgather"] += 1
            return (*scatter(grad_k, grad_v, ctx.seq_dim, ctx.pg_name), None, None)

    def flex_cp_allgather(k, v, seq_dim, pg_name):
        REACHED["visible_cp_allgather"] += 1
        return AllGatherKV.apply(k, v, seq_dim, pg_name)

    api.flex_cp_allgather = flex_cp_allgather  # cp_forward looks the name up at call time


# -- trainer.py Trainer.train(): rank 0 ends with `time.sleep(2)` "for other ranks to complete".
#    launchers/titan.py has every rank meet at a barrier after train() instead: the same wait
#    without two idle seconds a job (a warm 4-rank tiny job took 8.9 s, 2 of them this sleep).
#    Nothing is measured after the last step. Counted on rank 0 only (the others never sleep).
def skip_end_sleep() -> None:
    import time

    from torchtitan import trainer

    class _Time:
        """trainer.py's `time`: perf_counter and the rest as they are, sleep skipped."""

        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds):
            REACHED["end_sleep"] += 1

    trainer.time = _Time()


def install() -> None:
    """Apply every CPU redirect; must run before any torchtitan import."""
    global _installed
    if _installed:
        return
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError("titan_cpu.install() must run before torchtitan is imported "
                           "(tools/utils.py fixes device_type at import)")
    with _scoped_device_type():
        import torchtitan.tools.utils  # noqa: F401  (device_type, device_module = cpu, torch.cpu)
    _memory_monitor_cpu()
    _flex_math()
    _force_sum()
    _barrier_without_device_ids()
    set_timeout_shim()
    pipeline_step_microbatches()
    eager_cp_block_mask()
    visible_cp_allgather()
    skip_end_sleep()
    _installed = True


# -- cluster=fake (launchers/fake.py): data-dependent reads of FakeTensors, answered 0 / False at
#    these torchtitan call sites only (module, function)
FAKE_SCALAR_SITES: set[tuple[str, str]] = {
    # models/llama3 param_init -> torch/nn/init.py _no_grad_trunc_normal_ (Trainer.__init__'s
    # init_weights on the FakeTensor params): `lo = tensor.new_tensor(a).item()` and the rejection
    # loop's `if not mask.any(): break`; answered 0 / False the loop ends at once (values meaningless)
    ("torch.nn.init", "_no_grad_trunc_normal_"),
    # trainer.py Trainer.train_step: `int(local_valid_tokens)` (structured-log scalar) and
    # `float(accumulated_loss.item())` / `float(grad_norm.item())` for the metrics log
    ("torchtitan.trainer", "Trainer.train_step"),
    # distributed/utils.py _dist_reduce: `float(_dist_reduce_tensor(...).item())` after the loss
    # all-reduces (global_avg_loss, global_max_loss, ntokens_seen; the collectives themselves run);
    # 0.0 passes trainer.py's `math.isfinite(global_avg_loss)` check
    ("torchtitan.distributed.utils", "_dist_reduce"),
    # torch/utils/data/dataloader.py _BaseDataLoaderIter.__init__: the base seed drawn as
    # `torch.empty((), dtype=torch.int64).random_().item()` (the tokens' order only)
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter.__init__"),
}
# with PP besides: torch/distributed/pipelining/schedules.py _PipelineSchedule._warmup_p2p, the stages'
# P2P vote `result.item() == 1` (STATIC inference mode: metadata inference skipped); answered 0, DYNAMIC,
# as the CPU runs vote (their first step infers the metadata: ledger/faithful/titan/pp.py _pp_comm)
FAKE_PP_SCALAR_SITES: set[tuple[str, str]] = {("torch.distributed.pipelining.schedules", "_PipelineSchedule._warmup_p2p")}


def fake_scalar_sites(pp: int) -> set[tuple[str, str]]:
    """The data-dependent reads a fake-world run of this pipeline degree answers."""
    return FAKE_SCALAR_SITES | (FAKE_PP_SCALAR_SITES if pp > 1 else set())


# -- trainer.py Trainer.__init__: `model.to_empty(device=init_device)` (and `m.to_empty` per PP
#    stage) allocates the parallelized model's storages: the one call that makes model state. Run
#    under the rank's FakeTensorMode, every parameter and buffer is a FakeTensor (its storage's
#    nbytes as on a real run, no memory); init_weights, forward, backward and the optimizer then
#    run on FakeTensors outside any mode, so DeviceMesh's rank tensors and the data stay real.
def _fake_to_empty():
    from torch import nn
    from torchtitan import trainer

    from launchers import fake

    orig = nn.Module.to_empty

    def to_empty(self, *, device, recurse=True):
        frame = sys._getframe(1)
        if frame.f_globals.get("__name__") != trainer.__name__:
            return orig(self, device=device, recurse=recurse)
        REACHED["fake_to_empty"] += 1
        with fake.tensor_mode():
            return orig(self, device=device, recurse=recurse)

    nn.Module.to_empty = to_empty


# -- trainer.py Trainer.train_step: `value.to(self.device)` / `local_valid_tokens.to(self.device)`,
#    self.device = tools/utils.py get_local_device() = cpu:0 on this machine. A real CPU tensor
#    ignores the index; a FakeTensor keeps it and then refuses to meet the parameters' "cpu"
#    (FakeTensorDeviceMismatchError). The same device without the index.
def fake_cpu_device(trainer) -> None:
    if trainer.device.type == "cpu" and trainer.device.index is not None:
        REACHED["fake_cpu_device"] += 1
        trainer.device = torch.device("cpu")
    # the pipeline's stages took the trainer's device when built (pipelining/stage.py: their vote and
    # metadata buffers are made on stage.device)
    sched = getattr(trainer, "pp_schedule", None)
    stages = (getattr(sched, "_stages", None) or [sched._stage]) if sched is not None else []
    for stage in stages:
        if stage.device.type == "cpu" and stage.device.index is not None:
            REACHED["fake_cpu_device_pp_stage"] += 1
            stage.device = torch.device("cpu")


def compute_dtype(cfg):
    """The dtype FSDP2 computes in: framework.mixed_precision_param (torchtitan's
    parallelism.mixed_precision_param, bfloat16 by default)."""
    return getattr(torch, cfg.framework.mixed_precision_param)


def install_fake(pp_activation: tuple | None = None) -> None:
    """The shims a fake-world run (cluster=fake) needs besides the CPU ones; never on a real run.
    Each counts in REACHED under a `fake_` key. pp_activation: (pp.Boundary, dtype) of the tensor a
    pipeline stage sends its neighbour, with PP."""
    _fake_to_empty()
    if pp_activation is not None:
        _fake_pp_recv_meta(*pp_activation)


# -- pipelining/stage.py PipelineStage._recv_meta (step 0's metadata inference, DYNAMIC mode): a stage
#    receives its neighbour's pickled _StageForwardMeta / _StageBackwardMeta through recv_object_list,
#    whose buffer size is the received size tensor's value and whose object is unpickled from the received
#    bytes: on the fake world the neighbour runs in another process or not at all, so neither has a value.
#    What a real neighbour sends is known: the stage boundary's activation (forward) or its gradient
#    (backward), each one tensor of pp_activation's boundary and dtype (ledger/faithful/titan/pp.py
#    stage_metas, whose pickles the ledger counts). The shim issues the same two receives (the int64
#    size, then that many uint8 bytes) so the collectives are the run's, and returns the object.
def _fake_pp_recv_meta(b, dtype) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import stage as pp_stage

    from ledger.faithful.titan.pp import pickled_bytes, stage_metas

    if getattr(pp_stage.PipelineStage._recv_meta, "_ledger_fake", False):
        return
    fwd, bwd = stage_metas(b, dtype)

    def recv_meta(self, src_stage: int):
        REACHED["fake_pp_recv_meta"] += 1
        # the previous stage's output, or the next stage's gradient of this stage's output
        obj = fwd if src_stage < self.stage_index else bwd
        peer = self._resolve_peer_global_rank(src_stage)
        for buf in (torch.empty(1, dtype=torch.long, device=self.device),
                    torch.empty(pickled_bytes(obj), dtype=torch.uint8, device=self.device)):
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, peer, self.group)]).pop().wait()
        return obj

    recv_meta._ledger_fake = True
    pp_stage.PipelineStage._recv_meta = recv_meta


def reached() -> dict[str, int]:
    return dict(REACHED)
