"""Megatron's activations and peak per rank, textbook (Korthikanti et al. 2022) beside faithful
(ledger/faithful/megatron/peak.py, both specs), for the design article's Llama-3 1B layout at s=8192 and
its recompute variants. Predict-only (no ranks run).

    python -m benchmarks.peak_textbook_vs_faithful [--model llama3_1b] [--seq 8192]
"""
from __future__ import annotations

import argparse
import types

from rich.console import Console
from rich.table import Table

from ledger.layout import resolve
from ledger.model import preset
from ledger.parallel import predict
from ledger.units import fmt

RECOMPUTE = {"none": {}, "selective": dict(recompute_granularity="selective"),
             "full uniform 1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}


def _fw(**kw):
    d = dict(name="megatron", precision="bf16", use_distributed_optimizer=True, grad_reduce_in_fp32=True,
             overlap_grad_reduce=False, overlap_param_gather=False, bucket_size=None, average_in_collective=False,
             clip_grad=1.0, make_vocab_size_divisible_by=128, transformer_impl="transformer_engine")
    d.update(kw)
    return types.SimpleNamespace(**d)


class _Cfg(dict):
    __getattr__ = dict.__getitem__


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3_1b")
    ap.add_argument("--seq", type=int, default=8192)
    a = ap.parse_args(argv)
    m = preset(a.model, seq_len=a.seq)
    lay = resolve(_Cfg(tp=2, pp=2, dp=2, dp_replicate=1, cp=1, ep=1, vp=1, sequence_parallel=True,
                       micro_batch_size=1, global_batch_size=16))
    t = Table(title=f"{a.model} s={a.seq} tp2·pp2·dp2·SP, 8 micro-batches: stage 0's rank 0 "
                    "(activations at the peak, and the peak)")
    for c in ("recompute", "textbook act", "textbook peak", "faithful TE act", "faithful TE peak", "at (TE)",
              "faithful local act", "faithful local peak"):
        t.add_column(c, justify="left" if c in ("recompute", "at (TE)") else "right")
    for name, kw in RECOMPUTE.items():
        tb = predict(m, lay, _fw(**kw), "textbook").rank_state(0).peak
        te = predict(m, lay, _fw(**kw)).rank_state(0).peak
        lo = predict(m, lay, _fw(**kw, transformer_impl="local")).rank_state(0).peak
        t.add_row(name, fmt(tb.parts["activations"]), fmt(tb.bytes), fmt(te.parts["activations"]), fmt(te.bytes),
                  f"{te.phase}: {te.what}", fmt(lo.parts["activations"]), fmt(lo.bytes))
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
