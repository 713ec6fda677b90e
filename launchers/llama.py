"""A plain-PyTorch Llama of a ModelShape: RMSNorm, RoPE, GQA, SwiGLU, untied output.

Module and parameter names are torchtitan's, the same list and order as ledger.model
ModelShape.params(), so a ledger's parameter list and the real model agree name by name
(tests/test_deepspeed.py checks it). The model holds no buffers: RoPE angles are computed in
forward, so the only model state a framework can keep is the parameters themselves.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ledger.model import ModelShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def _norm(shape: ModelShape, eps: float) -> nn.Module:
    if shape.norm == "layernorm":
        return nn.LayerNorm(shape.hidden, eps=eps)
    return RMSNorm(shape.hidden, eps)


def rope(x: torch.Tensor, theta: float, offset: int = 0) -> torch.Tensor:
    """Rotary embedding on (batch, seq, heads, head_dim), pairs (2i, 2i+1) as torchtitan's; offset: the
    position of the first token (a sequence-parallel rank's slice)."""
    b, s, h, d = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(offset, offset + s, device=x.device, dtype=torch.float32), inv)  # (s, d/2)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    xf = x.float().reshape(b, s, h, d // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.reshape(b, s, h, d).type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, theta: float):
        super().__init__()
        hd, bias = shape.head_dim, shape.bias
        self.heads, self.kv_heads, self.head_dim, self.theta = shape.heads, shape.kv_heads, hd, theta
        qkv_bias = bias or shape.qkv_bias  # Qwen2's q / k / v biases (ModelShape.layer_params)
        self.wq = nn.Linear(shape.hidden, shape.heads * hd, bias=qkv_bias)
        self.wk = nn.Linear(shape.hidden, shape.kv_heads * hd, bias=qkv_bias)
        self.wv = nn.Linear(shape.hidden, shape.kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(shape.heads * hd, shape.hidden, bias=bias)

    # sequence parallelism (set by Llama): (attention over the whole sequence, this rank's first
    # position); not a submodule: it holds no parameters, and ZeRO-3's module hooks stay as without it
    sequence_parallel: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        attend, offset = self.sequence_parallel or (local_attention, 0)
        q = rope(self.wq(x).view(b, s, self.heads, self.head_dim), self.theta, offset)
        k = rope(self.wk(x).view(b, s, self.kv_heads, self.head_dim), self.theta, offset)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        o = attend(q, k, v) if self.sequence_parallel is None else attend(q, k, v, 0)
        return self.wo(o.reshape(b, s, -1))


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over (batch, seq, heads, head_dim) tensors, GQA's K / V heads repeated to the
    query heads (each K/V head serves heads / kv_heads of them); (batch, seq, heads, head_dim) out."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, shape: ModelShape, ffn: int | None = None):
        super().__init__()
        ffn = ffn or shape.ffn_hidden  # an MoE layer's expert: shape.expert_ffn
        self.swiglu = shape.swiglu
        self.w1 = nn.Linear(shape.hidden, ffn, bias=shape.bias)
        self.w2 = nn.Linear(ffn, shape.hidden, bias=shape.bias)
        if shape.swiglu:
            self.w3 = nn.Linear(shape.hidden, ffn, bias=shape.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, theta: float, eps: float, moe_layer: nn.Module | None = None):
        super().__init__()
        # registration order = ModelShape.layer_params() order (a dense block)
        self.attention_norm = _norm(shape, eps)
        self.attention = Attention(shape, theta)
        self.ffn_norm = _norm(shape, eps)
        self.feed_forward = FeedForward(shape) if moe_layer is None else moe_layer
        self.aux_loss = None  # an MoE layer's load-balancing loss of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        y = self.feed_forward(self.ffn_norm(x))
        if isinstance(y, tuple):  # an MoE layer: (output, l_aux, exp_counts), as DeepSpeed's MoE returns
            y, self.aux_loss, _ = y
        return x + y


class Llama(nn.Module):
    def __init__(self, shape: ModelShape, rope_theta: float = 500000.0, norm_eps: float = 1e-5, checkpoint=None,
                 moe=None, aux_loss_coeff: float = 0.0, sequence_parallel: tuple | None = None):
        super().__init__()
        self.shape = shape
        # checkpoint(layer, h) -> h: activation checkpointing of every decoder layer, as a user wraps
        # them (DeepSpeed: deepspeed.checkpointing.checkpoint); None: plain autograd
        self.checkpoint = checkpoint
        # moe(expert) -> the MoE layer a framework builds around one expert FeedForward (DeepSpeed:
        # deepspeed.moe.layer.MoE), for the layers shape.is_moe_layer(i); its load-balancing losses are
        # added to the loss times aux_loss_coeff
        self.aux_loss_coeff = aux_loss_coeff
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(
            Block(shape, rope_theta, norm_eps,
                  moe(FeedForward(shape, shape.expert_ffn)) if moe is not None and shape.is_moe_layer(i) else None)
            for i in range(shape.layers))
        # sequence_parallel: (attend(q, k, v, batch_dim) over the whole sequence, e.g. DeepSpeed-Ulysses'
        # DistributedAttention around local_attention, this rank's first position): each rank holds a
        # slice of every sequence
        for block in self.layers:
            block.attention.sequence_parallel = sequence_parallel
        self.norm = _norm(shape, norm_eps)
        self.output = nn.Linear(shape.hidden, shape.vocab, bias=False)
        if shape.tied_embeddings:
            # one Parameter in two modules: named_parameters() lists it once, as tok_embeddings.weight
            self.output.weight = self.tok_embeddings.weight
        self._init(shape)

    def _init(self, shape: ModelShape) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # residual projections scaled by depth, as GPT-2 / torchtitan do
                s = std / math.sqrt(2 * shape.layers) if name.endswith(("wo.weight", "w2.weight")) else std
                nn.init.normal_(p, 0.0, s)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h) if self.checkpoint is None else self.checkpoint(layer, h)
        h = self.norm(h)
        logits = self.output(h)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))
        aux = [b.aux_loss for b in self.layers if b.aux_loss is not None]
        return loss + self.aux_loss_coeff * sum(aux) if aux else loss
