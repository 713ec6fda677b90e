"""The one place where Megatron Core 0.18.0 is made to train on CPU tensors (gloo ranks).

Megatron assumes CUDA on its training path. Each redirect below is declared in REDIRECTS with the
megatron file and function it serves; it is installed only when cluster.device is "cpu" or "fake"
(`install()`; cluster=fake adds its own shims, `install_fake()` at the end), and it counts every time it is reached, keyed by (megatron module, function), so
`hits()` tells which redirects a run still needs. tests/test_megatron.py fails when a declared
redirect is no longer reached (an upgrade made it unnecessary: delete it) or when an undeclared
site is reached (an upgrade added one: declare it).

Mechanism (scoped, not a global monkey-patch of torch): each listed megatron module gets a proxy
in place of its module-global `torch`; the proxy forwards everything to torch except
`torch.cuda.current_device()` / `synchronize()` and `device="cuda"` in tensor factories, which it
redirects to the CPU. `Tensor.type()` string checks are answered as on CUDA and `Tensor.cuda()`
returns the CPU tensor, only for callers in the listed modules.
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Redirect:
    module: str  # the megatron module (file) whose module-global torch is proxied
    function: str  # the function that reaches it (co_qualname)
    what: str  # the CUDA assumption redirected
    # which real-run matrix reaches it: "dense" (tests/test_megatron.py) or "moe" (an MoE model's
    # modules only: tests/test_megatron_moe.py)
    scope: str = "dense"


_PAGB = "megatron.core.distributed.param_and_grad_buffer"
_DOPT = "megatron.core.optimizer.distrib_optimizer"
_OPT = "megatron.core.optimizer.optimizer"
_CLIP = "megatron.core.optimizer.clip_grads"
_SCHED = "megatron.core.pipeline_parallel.schedules"
_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_UTILS = "megatron.core.utils"
_ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding"
_TUTILS = "megatron.core.transformer.utils"
_NORM = "megatron.core.transformer.torch_norm"
_MAP = "megatron.core.tensor_parallel.mappings"
_LAYERS = "megatron.core.tensor_parallel.layers"
_LM = "megatron.core.models.common.language_module.language_module"
_RANDOM = "megatron.core.tensor_parallel.random"
_TD = "megatron.core.transformer.moe.token_dispatcher"
_ROUTER = "megatron.core.transformer.moe.router"

REDIRECTS: tuple[Redirect, ...] = (
    # distributed/param_and_grad_buffer.py _ParamAndGradBuffer.__init__: param_data / grad_data
    # are allocated on torch.cuda.current_device()
    Redirect(_PAGB, "_ParamAndGradBuffer.__init__", "torch.cuda.current_device"),
    # optimizer/distrib_optimizer.py DistributedOptimizer._build_model_and_main_param_groups:
    # `model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']` picks the
    # fp32-master path for bf16 params
    Redirect(_DOPT, "DistributedOptimizer._build_model_and_main_param_groups", "Tensor.type"),
    # optimizer/distrib_optimizer.py DistributedOptimizer.__init__: the same check marks bf16
    # params main_param_sharded (their fp32 copy lives in the shard)
    Redirect(_DOPT, "DistributedOptimizer.__init__", "Tensor.type"),
    # optimizer/optimizer.py Float16OptimizerWithFloat16Params.__init__ (no distributed
    # optimizer): `param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']` picks
    # the fp32-master path, anything else raises "Wrapped parameters must be one of ..."
    Redirect(_OPT, "Float16OptimizerWithFloat16Params.__init__", "Tensor.type"),
    # optimizer/optimizer.py MixedPrecisionOptimizer.__init__: found_inf / _dummy_overflow_buf /
    # _scale_one created with device='cuda'
    Redirect(_OPT, "MixedPrecisionOptimizer.__init__", "device='cuda'"),
    # optimizer/clip_grads.py get_grad_norm_fp32: dummy_overflow_buf with device='cuda'
    Redirect(_CLIP, "get_grad_norm_fp32", "device='cuda'"),
    # optimizer/clip_grads.py clip_grad_by_total_norm_fp32: dummy_overflow_buf with device='cuda'
    Redirect(_CLIP, "clip_grad_by_total_norm_fp32", "device='cuda'"),
    # optimizer/clip_grads.py clip_grad_by_total_norm_fp32:
    # `assert param.grad.type() == 'torch.cuda.FloatTensor'` on the fp32 master grads
    Redirect(_CLIP, "clip_grad_by_total_norm_fp32", "Tensor.type"),
    # utils.py local_multi_tensor_l2_norm (the no-apex/no-TE fallback): result on device="cuda"
    Redirect(_UTILS, "local_multi_tensor_l2_norm", "device='cuda'"),
    # pipeline_parallel/schedules.py forward_backward_no_pipelining: total_num_tokens on "cuda"
    Redirect(_SCHED, "forward_backward_no_pipelining", "device='cuda'"),
    # pipeline_parallel/schedules.py forward_backward_pipelining_without_interleaving: ditto
    Redirect(_SCHED, "forward_backward_pipelining_without_interleaving", "device='cuda'"),
    # pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving (vp > 1): ditto
    Redirect(_SCHED, "forward_backward_pipelining_with_interleaving", "device='cuda'"),
    # pipeline_parallel/p2p_communication.py P2PCommunicator._communicate: receive buffers on
    # torch.cuda.current_device()
    Redirect(_P2P, "P2PCommunicator._communicate.<locals>.create_tensor_recv_prev", "torch.cuda.current_device"),
    Redirect(_P2P, "P2PCommunicator._communicate.<locals>.create_tensor_recv_next", "torch.cuda.current_device"),
    # utils.py GlobalMemoryBuffer.get_tensor: the sequence-parallel all-gather scratch buffer
    # (tensor_parallel/layers.py, mappings.py) lives on torch.cuda.current_device()
    Redirect(_UTILS, "GlobalMemoryBuffer.get_tensor", "torch.cuda.current_device"),
    # models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding.get_emb: inv_freq moved to
    # torch.cuda.current_device() on first use
    Redirect(_ROPE, "RotaryEmbedding.get_emb", "torch.cuda.current_device"),
    # transformer/utils.py get_default_causal_mask (fusions/fused_softmax.py's torch softmax path,
    # used by the local spec's DotProductAttention): the causal mask on device="cuda"
    Redirect(_TUTILS, "get_default_causal_mask", "device='cuda'"),
    # transformer/torch_norm.py WrappedTorchNorm.__new__: without apex (whose FusedLayerNorm has
    # CUDA kernels only) the local spec's norm is torch's, which refuses sequence_parallel. The
    # redirect builds torch's RMSNorm and marks its weight `sequence_parallel` exactly as
    # fusions/fused_layer_norm.py FusedLayerNorm.__init__ does, so finalize_model_grads.py
    # _allreduce_non_tensor_model_parallel_grads all-reduces its grad over TP as on GPU.
    Redirect(_NORM, "WrappedTorchNorm.__new__", "sequence_parallel norm"),
    # tensor_parallel/mappings.py _reduce_scatter_along_first_dim (sequence parallel): output
    # on torch.cuda.current_device()
    Redirect(_MAP, "_reduce_scatter_along_first_dim", "torch.cuda.current_device"),
    # tensor_parallel/mappings.py _gather_along_first_dim (sequence parallel, backward of the
    # reduce-scatter regions): output on torch.cuda.current_device()
    Redirect(_MAP, "_gather_along_first_dim", "torch.cuda.current_device"),
    # tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward
    # (sequence parallel): the reduce-scattered input grad on torch.cuda.current_device()
    Redirect(_LAYERS, "LinearWithGradAccumulationAndAsyncCommunication.backward", "torch.cuda.current_device"),
    # models/common/language_module/language_module.py LanguageModule.setup_embeddings_and_output_layer
    # (tied embeddings, pp > 1): `weight.data = weight.data.cuda()` before the init-time all-reduce
    # of the word embeddings over the embedding group; on CPU the tensor stays where it is
    Redirect(_LM, "LanguageModule.setup_embeddings_and_output_layer", "Tensor.cuda"),
    # tensor_parallel/random.py _get_cuda_rng_state (CheckpointFunction.forward / backward's
    # _get_all_rng_states and _fork_rng: activation recompute, framework.recompute_granularity):
    # torch.cuda.random.get_rng_state initialises CUDA; the CPU generator's state stands in (its
    # _set_cuda_rng_state is torch.cuda._lazy_call, queued and never run without CUDA; the runs
    # here have no dropout, so the recomputed forward draws nothing)
    Redirect(_RANDOM, "_get_cuda_rng_state", "torch.cuda.random.get_rng_state"),
    # transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher.__init__: a CUDA side stream
    # for the device-to-host copies of the split sizes (drop-less routing)
    Redirect(_TD, "MoEAlltoAllTokenDispatcher.__init__", "torch.cuda.Stream", "moe"),
    # tensor_parallel/mappings.py _AllToAll.forward (the alltoall dispatcher, drop-less: uneven splits):
    # the output allocated on torch.cuda.current_device()
    Redirect(_MAP, "_AllToAll.forward", "torch.cuda.current_device", "moe"),
    # transformer/moe/router.py Router.gating: the router weight moved to torch.cuda.current_device()
    # on its first forward (`.to` the CPU it is on: the same tensor, still the DDP buffer's view)
    Redirect(_ROUTER, "Router.gating", "torch.cuda.current_device", "moe"),
    # MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: those copies on the side stream
    # (CPU tensors: maybe_move_tensor_to_cpu leaves them as they are) and an event to wait for
    Redirect(_TD, "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "torch.cuda.current_stream", "moe"),
    Redirect(_TD, "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "torch.cuda.stream", "moe"),
    # ... and moe_utils.py maybe_move_tensor_to_cpu(as_numpy=True) there: the all-to-all split sizes
    # become numpy arrays only for a CUDA tensor (`tensor.is_cuda`); a CPU tensor stays a tensor, which
    # all_to_all_single's binding refuses as split sizes. The CPU tensor's numpy array, as on GPU
    Redirect(_TD, "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "maybe_move_tensor_to_cpu", "moe"),
)

_MODULES = sorted({r.module for r in REDIRECTS})
_TYPE_MODULES = {r.module for r in REDIRECTS if r.what == "Tensor.type"}
_CUDA_MODULES = {r.module for r in REDIRECTS if r.what == "Tensor.cuda"}

_hits: Counter = Counter()
_installed = False


def _site(depth: int = 2) -> tuple[str, str]:
    f = sys._getframe(depth)
    return f.f_globals.get("__name__", "?"), f.f_code.co_qualname


def _cpu(device):
    """'cuda', 'cuda:0', torch.device('cuda'), an int device index -> 'cpu'; else unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _CudaShim:
    """Stands in for `torch.cuda` inside one proxied megatron module."""

    def current_device(self):
        _hits[(*_site(), "torch.cuda.current_device")] += 1
        return torch.device("cpu")

    def synchronize(self, *a, **k):
        _hits[(*_site(), "torch.cuda.synchronize")] += 1

    def Stream(self, *a, **k):  # noqa: N802 (torch.cuda's name)
        _hits[(*_site(), "torch.cuda.Stream")] += 1
        return _CpuStream()

    def current_stream(self, *a, **k):
        _hits[(*_site(), "torch.cuda.current_stream")] += 1
        return _CPU_STREAM

    def stream(self, s):
        import contextlib

        _hits[(*_site(), "torch.cuda.stream")] += 1
        return contextlib.nullcontext(s)

    @property
    def random(self):
        return _CudaRandomShim()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuStream:
    """A CUDA stream on the CPU: one stream of work, so waiting and events are immediate."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, *a, **k) -> "_CpuEvent":
        return _CpuEvent()


class _CpuEvent:
    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()  # the current stream


class _CudaRandomShim:
    """Stands in for `torch.cuda.random` inside a proxied megatron module: the CPU generator's state."""

    def get_rng_state(self, device="cuda"):
        _hits[(*_site(), "torch.cuda.random.get_rng_state")] += 1
        return torch.get_rng_state()

    def __getattr__(self, name):
        return getattr(torch.cuda.random, name)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like")


def _factory(name: str):
    fn = getattr(torch, name)

    def redirected(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and _cpu(dev) != dev:
            kwargs["device"] = "cpu"
            _hits[(*_site(), "device='cuda'")] += 1
        return fn(*args, **kwargs)

    redirected.__name__ = name
    return redirected


class _TorchProxy:
    """Stands in for the module-global `torch` of one megatron module."""

    def __init__(self):
        self.__dict__["cuda"] = _CudaShim()
        for n in _FACTORIES:
            self.__dict__[n] = _factory(n)

    def __getattr__(self, name):
        return getattr(torch, name)


_orig_type = torch.Tensor.type


def _type(self, *args, **kwargs):
    # Tensor.type() string checks (distrib_optimizer.py) expect 'torch.cuda.<X>Tensor'
    if not args and not kwargs and self.device.type == "cpu":
        mod, fn = _site()
        if mod in _TYPE_MODULES:
            _hits[(mod, fn, "Tensor.type")] += 1
            return _orig_type(self).replace("torch.", "torch.cuda.", 1)
    return _orig_type(self, *args, **kwargs)


_orig_cuda = torch.Tensor.cuda


def _tensor_cuda(self, *args, **kwargs):
    # Tensor.cuda() (language_module.py): the CPU tensor itself, only for callers in the listed modules
    if self.device.type == "cpu":
        mod, fn = _site()
        if mod in _CUDA_MODULES:
            _hits[(mod, fn, "Tensor.cuda")] += 1
            return self
    return _orig_cuda(self, *args, **kwargs)


def _patch_norm() -> None:
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    orig = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return orig(cls, config, hidden_size, eps, **kwargs)
        _hits[(_NORM, "WrappedTorchNorm.__new__", "sequence_parallel norm")] += 1
        plain = copy.copy(config)  # shallow: no __post_init__ re-validation
        plain.sequence_parallel = False
        norm = orig(cls, plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)


def _patch_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    orig = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            _hits[(*_site(), "maybe_move_tensor_to_cpu")] += 1
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def install() -> None:
    """Import the listed megatron modules and put the proxies in place (idempotent)."""
    global _installed
    if _installed:
        return
    import importlib

    proxy = _TorchProxy()
    for name in _MODULES:
        mod = importlib.import_module(name)
        assert getattr(mod, "torch", None) is torch, f"{name}: no module-global torch to redirect"
        mod.torch = proxy
    torch.Tensor.type = _type
    torch.Tensor.cuda = _tensor_cuda
    _patch_norm()
    _patch_split_sizes()
    _installed = True


def hits() -> list[dict]:
    """Redirects reached so far: [{module, function, what, count}]."""
    return [{"module": m, "function": f, "what": w, "count": c} for (m, f, w), c in sorted(_hits.items())]


def declared() -> list[dict]:
    return [{"module": r.module, "function": r.function, "what": r.what, "scope": r.scope} for r in REDIRECTS]


# -- cluster=fake (launchers/fake.py): the shims a run on torch's fake process group with the model
#    state under FakeTensorMode needs, besides the CPU redirects above. Installed only by
#    install_fake() (launchers.megatron, cluster.device == "fake"); each counts in FAKE_HITS.
FAKE_HITS: Counter = Counter()
FAKE_SHIMS = ("gloo_groups_on_default_backend", "bfloat16_cast_in_place", "all_gather_object_local",
              "collectives_uncoalesced", "l2_norm_without_torch_tensor")

# data-dependent reads of FakeTensors answered 0 / False (launchers/fake.py scalar_reads)
FAKE_SCALAR_SITES: set[tuple[str, str]] = {
    # optimizer/clip_grads.py get_grad_norm_fp32: `total_norm = total_norm.item() ** (1.0 / norm_type)`
    # after the model-parallel all-reduce of the squared norm (which runs); 0.0 is a finite norm,
    # so clip_grad_by_total_norm_fp32 sees clip_coeff > 1 and scales nothing, and the step runs
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32"),
}
_fake_installed = False


def _gloo_groups_on_default_backend() -> None:
    # parallel_state.py initialize_model_parallel -> create_group(..., backend="gloo") for every
    # *_GLOO group: ProcessGroupGloo cannot join a FakeStore world ("Not implemented"), and without
    # them (create_gloo_process_groups=False) optimizer/__init__.py get_megatron_optimizer fails
    # ("Intra partial data parallel group is not initialized"). The same ranks on the default
    # (fake) backend; Megatron's training step issues nothing on them (checkpointing does)
    from megatron.core import parallel_state as ps

    orig = ps.create_group

    def create_group(*a, backend=None, **k):
        if backend == "gloo":
            FAKE_HITS["gloo_groups_on_default_backend"] += 1
            backend = None
        return orig(*a, backend=backend, **k)

    ps.create_group = create_group


def _bfloat16_cast_in_place() -> None:
    # transformer/module.py Float16Module.__init__: `module.bfloat16()` -> nn.Module._apply swaps
    # each FakeTensor parameter (torch/nn/modules/module.py _apply, swap_tensors for tensor
    # subclasses), which a weakref to the parameter blocks ("_apply(): Couldn't swap"). The same
    # cast by assigning each floating-point parameter's and buffer's .data (what _apply does for
    # plain tensors): same dtypes, same parameter objects
    from torch import nn

    orig = nn.Module.bfloat16

    def bfloat16(self):
        from torch._subclasses.fake_tensor import FakeTensor

        if _site()[1] != "Float16Module.__init__" or not any(isinstance(p, FakeTensor) for p in self.parameters()):
            return orig(self)
        FAKE_HITS["bfloat16_cast_in_place"] += 1
        for t in [*self.parameters(), *self.buffers()]:
            if t.is_floating_point():
                t.data = t.data.bfloat16()
        return self

    nn.Module.bfloat16 = bfloat16


def _all_gather_object_local() -> None:
    # optimizer/__init__.py _get_param_groups: torch.distributed.all_gather_object(gathered_params_key,
    # params_key) pickles through tensors and reads their sizes (.item() of a FakeTensor: no value).
    # Every rank of one layout builds the same parameter-group keys (the ranks are one program), so
    # each slot gets this rank's keys. Init only: no step's collective is lost
    import torch.distributed as dist

    orig = dist.all_gather_object

    def all_gather_object(object_list, obj, group=None):
        if not _site()[0].startswith("megatron.core.optimizer"):
            return orig(object_list, obj, group=group)
        FAKE_HITS["all_gather_object_local"] += 1
        for i in range(len(object_list)):
            object_list[i] = obj

    dist.all_gather_object = all_gather_object


class _Uncoalesced:
    """What `with _coalescing_manager(...) as cm` yields, for collectives already issued singly."""

    def __init__(self):
        self.works = []

    def wait(self):
        for w in self.works:
            if w is not None:
                w.wait()


def _collectives_uncoalesced() -> None:
    # distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup start_grad_sync /
    # start_param_sync: `with _coalescing_manager(group, async_ops=...) as cm:` around one
    # reduce-scatter (all-gather, all-reduce) per bucket. FakeTensorMode has no kernel for the
    # coalesced op torch issues at the end (c10d.reduce_scatter_tensor_coalesced_), so the calls are
    # issued one by one and the comm probe sees each bucket's collective on its own. The ledger
    # counts what a real run issues: param_and_grad_buffer.py partition_buckets gives each bucket a
    # group of its own (no fp8 buffers here) unless force_single_bucket_group (disable_bucketing:
    # stages > 0, vp chunks > 0), where the chunk's one buffer is one bucket: one bucket per
    # coalesced call either way, so a coalesced call is one collective of that bucket and the counts
    # and bytes the probe sees singly are the ones a real run issues (the fake reconcile confirms it)
    import contextlib

    from megatron.core.distributed import param_and_grad_buffer as pagb

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        FAKE_HITS["collectives_uncoalesced"] += 1
        yield _Uncoalesced()

    pagb._coalescing_manager = coalescing_manager


def _l2_norm_without_torch_tensor() -> None:
    # utils.py local_multi_tensor_l2_norm (clip_grads.py's no-apex fallback): `torch.tensor(l2)` of
    # a list of 0-d norm tensors and `float(l2_reduced)` need values. The same norm as a tensor op
    # (stack -> norm), shaped [1] fp32 as the original returns; clip_grads.py then all-reduces it
    # over the model-parallel group as on a real run
    from megatron.core.optimizer import clip_grads

    def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        FAKE_HITS["l2_norm_without_torch_tensor"] += 1
        norms = [torch.norm(t) for tl in tensor_lists for t in tl]
        total = torch.stack(norms).norm() if norms else torch.zeros(())
        return total.float().reshape(1), None

    clip_grads.l2_norm_impl = local_multi_tensor_l2_norm


def install_fake() -> None:
    """The fake-world shims (cluster=fake only), after install()."""
    global _fake_installed
    if _fake_installed:
        return
    _gloo_groups_on_default_backend()
    _bfloat16_cast_in_place()
    _all_gather_object_local()
    _collectives_uncoalesced()
    _l2_norm_without_torch_tensor()
    _fake_installed = True


def fake_hits() -> dict[str, int]:
    return dict(FAKE_HITS)
