"""Model shapes: exact parameter counts and per-module parameter lists of a Llama-style decoder."""
from __future__ import annotations

import os

from dataclasses import dataclass, fields
from functools import lru_cache


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int = 128
    tied_embeddings: bool = False
    norm: str = "rmsnorm"
    swiglu: bool = True
    bias: bool = False
    name: str = "custom"
    # Mixture-of-Experts, by Megatron's TransformerConfig names (0 experts: a dense model).
    # moe_ffn_hidden 0: ffn_hidden (--moe-ffn-hidden-size defaults to --ffn-hidden-size);
    # moe_shared_expert_hidden 0: no shared expert (--moe-shared-expert-intermediate-size);
    # moe_layer_freq k: decoder layer i is an MoE layer when i % k == 0 (--moe-layer-freq as an int,
    # TransformerConfig moe_layer_freq; 1: every layer); moe_router_dtype None: the router runs in the
    # parameters' dtype, "fp32" / "fp64" as --moe-router-dtype (the weight's dtype is unchanged)
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden: int = 0
    moe_shared_expert_hidden: int = 0
    moe_layer_freq: int = 1
    moe_router_dtype: str | None = None
    # attention heads of kv_channels dimensions (0: hidden / heads; Qwen3: 128 at hidden 2048 and 32
    # heads), and per-head RMSNorms of q and k (Megatron --qk-layernorm; Qwen3's q_norm / k_norm)
    kv_channels: int = 0
    qk_layernorm: bool = False
    # biases on the q, k and v projections alone (Qwen2 / 2.5's Qwen2Attention; Megatron --add-qkv-bias)
    qkv_bias: bool = False
    # the q, k and v projections held as one [(heads + 2 kv_heads) head_dim, hidden] parameter, as a
    # framework builds them (torchtitan's fuse_qkv: models/common/attention.py FusedQKVLinear's wqkv):
    # the same elements, one tensor instead of three (what FSDP2 shards, pads and counts). Set by the
    # ledger of a framework that builds them so (ledger/faithful/titan/states.py), not by a model config
    fused_qkv: bool = False

    def __hash__(self) -> int:
        # computed once per object: a layout search hashes the shape in every cache lookup. Kept out
        # of pickles (__getstate__): str hashes differ between processes
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(self.__dict__[f] for f in _SHAPE_FIELDS))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    # -- experts ------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        """One routed expert's FFN width (moe_ffn_hidden, else ffn_hidden)."""
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, i: int) -> bool:
        """Megatron's moe_layer_freq as an int (transformer/moe/moe_utils.py get_moe_layer_wise_logging...,
        models/gpt/gpt_layer_specs.py get_gpt_decoder_block_spec: [1 if i % freq == 0 else 0])."""
        return self.num_experts > 0 and i % self.moe_layer_freq == 0

    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        names = {f.name for f in fields(cls)}
        return cls(**{k: cfg[k] for k in names if k in cfg})

    # -- parameters ---------------------------------------------------------------------------
    def norm_params(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        out = [(f"{prefix}.weight", (self.hidden,))]
        if self.norm == "layernorm":
            out.append((f"{prefix}.bias", (self.hidden,)))
        return out

    def linear(self, name: str, out_f: int, in_f: int, bias: bool | None = None) -> list[tuple[str, tuple[int, ...]]]:
        out = [(f"{name}.weight", (out_f, in_f))]
        if self.bias if bias is None else bias:
            out.append((f"{name}.bias", (out_f,)))
        return out

    def layer_params(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        """One decoder block, in module order (torchtitan / plain-PyTorch Llama names)."""
        p, h, hd = f"layers.{i}", self.hidden, self.head_dim
        out = self.norm_params(f"{p}.attention_norm")
        qkv_bias = self.bias or self.qkv_bias
        if self.fused_qkv:
            out += self.linear(f"{p}.attention.wqkv", (self.heads + 2 * self.kv_heads) * hd, h, qkv_bias)
        else:
            out += self.linear(f"{p}.attention.wq", self.heads * hd, h, qkv_bias)
            out += self.linear(f"{p}.attention.wk", self.kv_heads * hd, h, qkv_bias)
            out += self.linear(f"{p}.attention.wv", self.kv_heads * hd, h, qkv_bias)
        out += self.linear(f"{p}.attention.wo", h, self.heads * hd)
        if self.qk_layernorm:  # torchtitan qwen3 Attention: q_norm / k_norm over head_dim
            out += [(f"{p}.attention.q_norm.weight", (hd,)), (f"{p}.attention.k_norm.weight", (hd,))]
        out += self.norm_params(f"{p}.ffn_norm")
        if not self.is_moe_layer(i):
            return out + self._ffn(f"{p}.feed_forward", self.ffn_hidden)
        # torchtitan models/common/moe.py MoE: router.gate [E, h], GroupedExperts w1/w2/w3 as
        # [E, ffn, h] / [E, h, ffn] / [E, ffn, h], then the shared experts (a FeedForward)
        e, f = self.num_experts, self.expert_ffn
        out.append((f"{p}.moe.router.gate.weight", (e, h)))
        out.append((f"{p}.moe.experts.w1", (e, f, h)))
        out.append((f"{p}.moe.experts.w2", (e, h, f)))
        if self.swiglu:
            out.append((f"{p}.moe.experts.w3", (e, f, h)))
        if self.moe_shared_expert_hidden:
            out += self._ffn(f"{p}.moe.shared_experts", self.moe_shared_expert_hidden)
        return out

    def _ffn(self, p: str, ffn: int) -> list[tuple[str, tuple[int, ...]]]:
        h = self.hidden
        out = self.linear(f"{p}.w1", ffn, h) + self.linear(f"{p}.w2", h, ffn)
        return out + (self.linear(f"{p}.w3", ffn, h) if self.swiglu else [])

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        """All parameters in module (registration) order."""
        return list(_params(self))

    def _params(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        out = [_embedding(self)]
        for i in range(self.layers):
            out += self.layer_params(i)
        out += self.norm_params("norm")
        if not self.tied_embeddings:
            out.append(("output.weight", (self.vocab, self.hidden)))
        return tuple(out)

    def num_params(self) -> int:
        return _num_params(self)

    def layer_num_params(self, i: int = 0) -> int:
        return sum(numel(s) for _, s in self.layer_params(i))

    def expert_num_params(self) -> int:
        """Parameters of one routed expert (its fc1 / fc2 / gate projections)."""
        return (3 if self.swiglu else 2) * self.hidden * self.expert_ffn

    def routed_expert_params(self) -> int:
        """Parameters of every routed expert of every MoE layer."""
        return self.moe_layers() * self.num_experts * self.expert_num_params()

    def active_params(self) -> int:
        """Parameters one token passes through: all but the routed experts it is not sent to
        (moe_router_topk of num_experts in each MoE layer)."""
        return self.num_params() - self.routed_expert_params() + self.moe_layers() * self.moe_router_topk * \
            self.expert_num_params()


_SHAPE_FIELDS = tuple(f.name for f in fields(ModelShape))


# shapes are frozen (hashable): a sweep over thousands of layouts lists a model's parameters once
@lru_cache(maxsize=64)
def _params(model: ModelShape):
    return model._params()


@lru_cache(maxsize=64)
def _num_params(model: ModelShape) -> int:
    # _params' sum without listing every layer (identical layers; a 126-layer list costs a search ms)
    emb = numel(_embedding(model)[1])
    rest = sum(numel(s) for _, s in model.norm_params("norm"))
    # two kinds of layer at most: MoE ones (layer 0 is one, when any is) and dense ones (layer 1 is
    # one, when any is: moe_layer_freq > 1)
    moe = model.moe_layers()
    layers = moe * model.layer_num_params(0) + (model.layers - moe) * model.layer_num_params(1 if moe else 0)
    return emb * (1 if model.tied_embeddings else 2) + rest + layers


def _embedding(model: ModelShape) -> tuple[str, tuple[int, int]]:
    """The token embedding (and, untied, the output projection's shape)."""
    return "tok_embeddings.weight", (model.vocab, model.hidden)


def routed_rows(tokens: int, topk: int, experts: int, local: int) -> tuple[int, int, int]:
    """(balanced, fewest, most) rows a rank's `local` experts of `experts` compute in one MoE layer when
    `tokens` tokens (the dispatching group's) are each routed to `topk` distinct experts: balanced every expert
    tokens x topk / experts; at most each token once per local expert; at least its topk choices less those the
    other experts can take (with every expert local: every row)."""
    return (tokens * topk * local // experts, tokens * topk - tokens * min(topk, experts - local),
            tokens * min(topk, local))


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _load_presets() -> dict[str, dict]:
    """The model presets, one yaml file each in conf/model/ (the config group `model=` reads the same
    files): every field but Hydra's `defaults` and the name."""
    from omegaconf import OmegaConf  # Hydra's reader of these files (PyYAML reads 1e-6 as a string)

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "model")
    out = {}
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".yaml"):
            d = OmegaConf.to_container(OmegaConf.load(os.path.join(folder, fname)))
            name = d.pop("name")
            out[name] = {k: v for k, v in d.items() if k != "defaults"}
    return out


PRESETS = _load_presets()


def preset(name: str, **overrides) -> ModelShape:
    if name not in PRESETS:
        raise KeyError(f"model preset {name!r} unknown; known: {sorted(PRESETS)}")
    fields_ = set(_SHAPE_FIELDS)  # a preset also sets ModelConfig-only fields (rope_theta, norm_eps)
    return ModelShape(name=name, **{k: v for k, v in {**PRESETS[name], **overrides}.items() if k in fields_})


_SET_ONLY = ("qkv_bias", "fused_qkv")


@lru_cache(maxsize=64)
def _model_dict(model: ModelShape) -> tuple:
    # the fields (all scalars: asdict()'s deep copy is not needed) and the parameter count
    # (qkv_bias and fused_qkv only where set: the records of the models without them stay as they were)
    return tuple((f, getattr(model, f)) for f in _SHAPE_FIELDS if f not in _SET_ONLY or getattr(model, f)) \
        + (("num_params", model.num_params()),)


def model_dict(model: ModelShape) -> dict:
    """The shape and its parameter count, as records carry it."""
    return dict(_model_dict(model))
