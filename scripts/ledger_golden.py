"""Refactor guard for ledger speed work: dump the faithful predictions of a broad layout matrix, then
check that a changed ledger predicts exactly the same.

    git worktree add /tmp/base HEAD                                  # the ledger before the change
    .venv/bin/python /tmp/base/scripts/ledger_golden.py dump /tmp/base.jsonl [framework]
    .venv/bin/python scripts/ledger_golden.py dump /tmp/new.jsonl [framework]
    .venv/bin/python scripts/ledger_golden.py compare /tmp/base.jsonl /tmp/new.jsonl   # exit 1 on any difference

A dump line is one (framework, model, knobs, layout): every rank's state and collectives for worlds up
to 16 (the most-loaded rank's beyond), comm_first, comm_warmup, by_kind, or the ConfigError's text.
Models: tiny (plain, tied, layernorm+bias), an odd shape whose params need alignment padding
(hidden 208), llama3_1b, llama3_70b; knobs: each framework's precision, bucketing, ZeRO stage and
ZeRO-3 budgets, torchtitan resharding; layouts: every (tp, pp) over the world's divisors with
micro-batches 1, 2, 4, vp 1/2, SP on/off (dp_replicate and cp for torchtitan). This session's
Megatron dump (without the odd shape) was 202,080 predictions in ~20 s.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

from ledger_speed import C, divisors, framework, layouts  # noqa: E402

from ledger.layout import ConfigError, resolve  # noqa: E402
from ledger.model import ModelShape, preset  # noqa: E402
from ledger.parallel import place  # noqa: E402


def models():
    tiny = preset("tiny")
    yield "tiny", tiny
    yield "tiny_tied", dataclasses.replace(tiny, tied_embeddings=True)
    yield "tiny_ln", dataclasses.replace(tiny, norm="layernorm", bias=True)
    yield "odd", ModelShape(layers=4, hidden=208, ffn_hidden=624, heads=8, kv_heads=2, vocab=1030, seq_len=32,
                            name="odd")
    yield "llama3_1b", preset("llama3_1b")
    yield "llama3_70b", preset("llama3_70b")


def knobs(name: str):
    if name == "megatron":
        for dopt, ogr, opg, prec, gf32, bs in itertools.product([True, False], [True, False], [False, True],
                                                             ["bf16", "fp32"], [True, False], [None, 1000, 3_000_000]):
            if opg and not (dopt and ogr):
                continue
            yield dict(use_distributed_optimizer=dopt, overlap_grad_reduce=ogr, overlap_param_gather=opg,
                       precision=prec, grad_reduce_in_fp32=gf32, bucket_size=bs)
    elif name == "deepspeed":
        for z, prec, rbs in itertools.product([1, 2, 3], ["bf16", "fp32"], [500_000_000, 1000, 200_000]):
            yield dict(zero_stage=z, precision=prec, reduce_bucket_size=rbs)
            if z == 3:
                for pf, md, ml, pt in [(0, 0, 1_000_000_000, 100_000), (1000, 0, 1_000_000_000, 0),
                                       (50_000, 10_000_000, 20_000, 100), (5e7, 1e9, 1e9, 1000)]:
                    yield dict(zero_stage=z, precision=prec, reduce_bucket_size=rbs,
                               stage3_prefetch_bucket_size=int(pf), stage3_max_reuse_distance=int(md),
                               stage3_max_live_parameters=int(ml), stage3_param_persistence_threshold=pt)
    else:
        for r, prec in itertools.product(["default", "always", "never"], ["bf16", "fp32"]):
            yield dict(reshard_after_forward=r, mixed_precision_param="bfloat16" if prec == "bf16" else "float32")


def layout_matrix(name: str, world: int):
    d = divisors(world)
    out = []
    for vp, sp in itertools.product([1, 2], [False, True]):
        for dpr in ([1, 2] if name == "titan" else [1]):
            for cp in ([1, 2] if name == "titan" else [1]):
                for gmul in (1, 4):
                    out += layouts(world, world * gmul, d, d, (1, 2, 4), cp=cp, vp=vp, dp_replicate=dpr,
                                   sequence_parallel=sp)
                if name == "titan":  # one local batch without PP; 2*pp micro-batches with PP
                    out += layouts(world, 0, d, d, (1, 2, 4), cp=cp, vp=vp, dp_replicate=dpr, sequence_parallel=sp,
                                   global_batch_size=lambda x: x["micro_batch_size"] * x["dp"]
                                   * (2 * x["pp"] if x["pp"] > 1 else 1))
    return out


def dump(path: str, only: str | None = None) -> None:
    n = 0
    with open(path, "w") as f:
        for fwname in ("megatron", "deepspeed", "titan"):
            if only and fwname != only:
                continue
            for (mname, m), kw in itertools.product(list(models()), list(knobs(fwname))):
                worlds = (4, 8, 16) if mname in ("tiny", "tiny_tied", "tiny_ln", "odd") else (8, 64)
                if mname == "llama3_70b":
                    worlds = (64,)
                    if fwname == "deepspeed" and kw.get("zero_stage") == 3 and kw.get("reduce_bucket_size") == 1000:
                        continue  # minutes of ZeRO-3 replay for one shape
                for world in worlds:
                    fw = framework(fwname, **kw)
                    for lay in layout_matrix(fwname, world):
                        if mname == "llama3_70b" and lay.micro_batch_size > 1:
                            continue
                        key = json.dumps([fwname, mname, kw, dict(lay)], sort_keys=True, default=str)
                        try:
                            pl = place(m, None, C(framework=fw, layout=resolve(lay), ledger=C(mode="faithful")))
                            d = pl.to_dict(all_ranks=world <= 16)
                            s = pl.per_gpu
                            d["first"] = [c.to_dict() for c in s.comm_first] if s.comm_first is not None else None
                            d["warm"] = [[c.to_dict() for c in cs] for cs in s.comm_warmup] if s.comm_warmup else None
                            d["stage"] = s.stage
                            d["by_kind"] = pl.by_kind()
                        except ConfigError as e:
                            d = {"error": str(e)}
                        f.write(key + "\t" + json.dumps(d, sort_keys=True, default=str) + "\n")
                        n += 1
    print(n, "predictions")


def compare(a: str, b: str) -> None:
    base = dict(line.rstrip("\n").split("\t", 1) for line in open(a))
    new = dict(line.rstrip("\n").split("\t", 1) for line in open(b))
    bad = [k for k in base if base[k] != new.get(k)]
    print(len(base), "baseline,", len(new), "new,", len(bad), "differ;", len(set(new) - set(base)), "new keys")
    for k in bad[:5]:
        print("DIFF", k, "\n  base", base[k][:600], "\n  new ", new.get(k, "MISSING")[:600])
    sys.exit(1 if bad or len(base) != len(new) else 0)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("dump", "compare"):
        sys.exit(__doc__)
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        compare(sys.argv[2], sys.argv[3])
