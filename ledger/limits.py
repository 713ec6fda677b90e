"""Sizes past which a config is refused, with the numbers, before anything runs (conf/validate.py for
the model, the cluster and the plan; ledger/layout.py for a resolved layout).

Each bound is far beyond any published run and below it the ledger answers in seconds and under a GiB
(`python -m benchmarks.size_goals` times the corners: a prediction up to MAX_WORLD GPUs, a plan up to
MAX_PLAN_GPUS). Past it a prediction's time or memory grows with the size (a pipeline schedule or a
ZeRO-3 replay per micro-batch, a search over the GPU count's divisors) or numpy's int64 would overflow.
"""
from __future__ import annotations

MAX_WORLD = 1 << 20  # GPUs of one layout: 1,048,576
MAX_MICRO_BATCHES = 1 << 13  # micro-batches per optimizer step on a DP rank: 8,192
MAX_PLAN_GPUS = 1 << 17  # plan.gpus: 131,072
# the model's shape (Llama 3.1 405B: 126 layers, hidden 16,384, ffn 53,248; vocabularies up to 256k;
# DeepSeek-V3: 256 routed experts)
MODEL = {"layers": 1 << 10, "hidden": 1 << 18, "ffn_hidden": 1 << 20, "moe_ffn_hidden": 1 << 20,
         "moe_shared_expert_hidden": 1 << 20, "heads": 1 << 14, "kv_heads": 1 << 14, "vocab": 1 << 24,
         "seq_len": 1 << 22, "num_experts": 1 << 12, "kv_channels": 1 << 14}


def too_large(field: str, value: int, bound: int, what: str = "") -> str | None:
    """The refusal of value past bound, naming the field and the bound, or None."""
    if value <= bound:
        return None
    return (f"{field}={value:,} is past train-ledger's bound of {bound:,}{' ' + what if what else ''} (far beyond any "
            "published run; ledger/limits.py)")
