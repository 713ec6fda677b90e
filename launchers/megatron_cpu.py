"""The one place where Megatron Core 0.18.0 is made to train on CPU tensors (gloo ranks).

Megatron assumes CUDA on its training path. Each redirect below is declared in REDIRECTS with the
megatron file and function it serves; it is installed only when cluster.device == "cpu"
(`install()`), and it counts every time it is reached, keyed by (megatron module, function), so
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

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


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
    _installed = True


def hits() -> list[dict]:
    """Redirects reached so far: [{module, function, what, count}]."""
    return [{"module": m, "function": f, "what": w, "count": c} for (m, f, w), c in sorted(_hits.items())]


def declared() -> list[dict]:
    return [{"module": r.module, "function": r.function, "what": r.what} for r in REDIRECTS]
