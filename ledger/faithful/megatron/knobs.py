"""The Megatron Core 0.18.0 framework fields the faithful ledger reads (Knobs, read once per layout by
knobs: DistributedDataParallelConfig, OptimizerConfig and TransformerConfig fields by Megatron-LM's
argument names), and what follows from them alone: the param and grad dtypes (dtypes: Float16Module's
bf16 params, distributed/param_and_grad_buffer.py's grad_data in fp32 under grad_reduce_in_fp32) and
the optimizer's bytes per owned element and param piece (optim_weights: optimizer/distrib_optimizer.py's
fp32 master shards, torch.optim.AdamW's two moments and `step`). Paths under megatron/core/.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ledger.faithful.megatron.activations import recompute_of
from ledger.faithful.megatron.pipeline import EVEN_SPLIT
from ledger.faithful.megatron.rules import grad_dtype
from ledger.faithful.megatron.target import TE
from ledger.dtypes import nbytes
from ledger.optim import MOMENT_BYTES, STEP_BYTES




class Knobs(NamedTuple):
    """The framework fields this ledger reads, read once per layout (a DictConfig read costs
    microseconds) and hashable: per-structure results are cached on them."""
    precision: str
    grad_reduce_in_fp32: bool
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    bucket_size: int | None
    clip_grad: float
    make_vocab_size_divisible_by: int
    transformer_impl: str  # local | transformer_engine (None: Megatron-LM's default, TE; a target's: target.py)
    pp_split: tuple = EVEN_SPLIT  # (first, last, embedding, loss) of the pipeline split (pipeline.split_error)
    # (granularity, method, num_layers, modules) of activation recompute (activations.Recompute)
    recompute: tuple = (None, None, None, ("core_attn",))
    # MoE (moe.py): (token dispatcher, load balancing, aux-loss coeff, capacity factor, pad to
    # capacity, grouped GEMM), MOE_KNOBS order
    moe: tuple = ("allgather", "aux_loss", 0.0, None, False, False)
    # the run the peak is for (ledger/target.py); "" = the spec's (target.of)
    target: str = ""

    def __getattr__(self, name):  # the MoE knobs by the framework config's names
        try:
            return self.moe[MOE_KNOBS.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    # activations.recompute_of and moe.check_moe read these by the framework config's names
    @property
    def recompute_granularity(self):
        return self.recompute[0]

    @property
    def recompute_method(self):
        return self.recompute[1]

    @property
    def recompute_num_layers(self):
        return self.recompute[2]

    @property
    def recompute_modules(self):
        return self.recompute[3]


MOE_KNOBS = ("moe_token_dispatcher_type", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
             "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_grouped_gemm")


def knobs(fw) -> Knobs:
    if isinstance(fw, Knobs):
        return fw
    return Knobs(fw.precision, bool(fw.grad_reduce_in_fp32), bool(fw.use_distributed_optimizer),
                 bool(fw.overlap_grad_reduce), bool(fw.overlap_param_gather), fw.bucket_size, fw.clip_grad,
                 fw.make_vocab_size_divisible_by, fw.transformer_impl or TE, pp_split(fw),
                 tuple(recompute_of(fw)), tuple(getattr(fw, n, d) for n, d in zip(MOE_KNOBS, Knobs._field_defaults["moe"])))


def pp_split(fw) -> tuple:
    """The framework's pipeline split (pipeline.EVEN_SPLIT order); a config without the fields
    (textbook mode, older records) splits evenly."""
    g = lambda name, d: getattr(fw, name, d)  # noqa: E731
    return (g("decoder_first_pipeline_num_layers", None), g("decoder_last_pipeline_num_layers", None),
            bool(g("account_for_embedding_in_pipeline_split", False)),
            bool(g("account_for_loss_in_pipeline_split", False)))


def optim_weights(fw) -> tuple[int, int]:
    """Optimizer bytes per owned element (fp32 master for bf16 params + Adam's two moments) and per
    owned param piece (Adam's `step`)."""
    return (4 if fw.precision == "bf16" else 0) + MOMENT_BYTES, STEP_BYTES


@lru_cache(maxsize=64)
def dtypes(fw: Knobs) -> tuple[str, str, int, int]:
    """(param dtype, grad dtype, their bytes): bf16 params with fp32 grads under grad_reduce_in_fp32."""
    pdt = "bf16" if fw.precision == "bf16" else "fp32"
    gdt = grad_dtype(fw)
    return pdt, gdt, nbytes(pdt), nbytes(gdt)
