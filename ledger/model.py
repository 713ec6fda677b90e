"""Model shapes: exact parameter counts and per-module parameter lists of a Llama-style decoder."""
from __future__ import annotations

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
        return self.hidden // self.heads

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

    def linear(self, name: str, out_f: int, in_f: int) -> list[tuple[str, tuple[int, ...]]]:
        out = [(f"{name}.weight", (out_f, in_f))]
        if self.bias:
            out.append((f"{name}.bias", (out_f,)))
        return out

    def layer_params(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        """One decoder block, in module order (torchtitan / plain-PyTorch Llama names)."""
        p, h, hd = f"layers.{i}", self.hidden, self.head_dim
        out = self.norm_params(f"{p}.attention_norm")
        out += self.linear(f"{p}.attention.wq", self.heads * hd, h)
        out += self.linear(f"{p}.attention.wk", self.kv_heads * hd, h)
        out += self.linear(f"{p}.attention.wv", self.kv_heads * hd, h)
        out += self.linear(f"{p}.attention.wo", h, self.heads * hd)
        out += self.norm_params(f"{p}.ffn_norm")
        out += self.linear(f"{p}.feed_forward.w1", self.ffn_hidden, h)
        out += self.linear(f"{p}.feed_forward.w2", h, self.ffn_hidden)
        if self.swiglu:
            out += self.linear(f"{p}.feed_forward.w3", self.ffn_hidden, h)
        return out

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

    def layer_num_params(self) -> int:
        return sum(numel(s) for _, s in self.layer_params(0))


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
    return emb * (1 if model.tied_embeddings else 2) + rest + model.layers * model.layer_num_params()


def _embedding(model: ModelShape) -> tuple[str, tuple[int, int]]:
    """The token embedding (and, untied, the output projection's shape)."""
    return "tok_embeddings.weight", (model.vocab, model.hidden)


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


PRESETS = {
    "tiny": dict(layers=4, hidden=256, ffn_hidden=768, heads=8, kv_heads=2, vocab=1024, seq_len=128),
    # Llama-3.2-1B shape, untied as in the design article's runs
    "llama3_1b": dict(layers=16, hidden=2048, ffn_hidden=8192, heads=32, kv_heads=8, vocab=128256, seq_len=8192),
    "llama3_8b": dict(layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=128256, seq_len=8192),
    "llama3_70b": dict(layers=80, hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8, vocab=128256, seq_len=8192),
    "llama3_405b": dict(layers=126, hidden=16384, ffn_hidden=53248, heads=128, kv_heads=8, vocab=128256, seq_len=8192),
}


def preset(name: str, **overrides) -> ModelShape:
    if name not in PRESETS:
        raise KeyError(f"model preset {name!r} unknown; known: {sorted(PRESETS)}")
    return ModelShape(name=name, **{**PRESETS[name], **overrides})


@lru_cache(maxsize=64)
def _model_dict(model: ModelShape) -> tuple:
    # the fields (all scalars: asdict()'s deep copy is not needed) and the parameter count
    return tuple((f, getattr(model, f)) for f in _SHAPE_FIELDS) + (("num_params", model.num_params()),)


def model_dict(model: ModelShape) -> dict:
    """The shape and its parameter count, as records carry it."""
    return dict(_model_dict(model))
