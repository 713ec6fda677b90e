"""How fast the ledger predicts: layouts per second, and a whole 16,384-GPU layout search.

    .venv/bin/python benchmarks/ledger_speed.py

Prints, per framework and ledger mode, layouts predicted per second (place() + the most-loaded
rank) over every (tp, pp, dp, micro_batch) layout of the llama3_70b shape on 1,024 GPUs (global
batch 1,024 sequences), with the ratio to the 20,000/s target; then the time to predict every valid
layout of llama3_405b on 16,384 GPUs (Megatron, global batch 2,048 sequences).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402

from conf.schema import FRAMEWORK_SCHEMAS  # noqa: E402
from ledger.layout import ConfigError, resolve  # noqa: E402
from ledger.model import preset  # noqa: E402
from ledger.parallel import place  # noqa: E402

TARGET = 20_000


class C(dict):
    __getattr__ = dict.__getitem__


def layout(**kw) -> C:
    base = dict(tp=1, pp=1, dp=1, dp_replicate=1, cp=1, ep=1, vp=1, sequence_parallel=False,
                micro_batch_size=1, global_batch_size=-1)
    return C({**base, **kw})


def framework(name: str, **kw):
    fw = OmegaConf.structured(FRAMEWORK_SCHEMAS[name])
    for k, v in kw.items():
        fw[k] = v
    return C(OmegaConf.to_container(fw))


def search(model, fw, world: int, mode: str, gbs: int, tps, pps, mbs) -> tuple[int, int, float]:
    """Predict every (tp, pp, dp, micro_batch) layout of `world` GPUs once; (valid, rejected, seconds)."""
    valid = rejected = 0
    t0 = time.perf_counter()
    for tp in tps:
        for pp in pps:
            if world % (tp * pp):
                continue
            for mb in mbs:
                lay = layout(tp=tp, pp=pp, dp=world // (tp * pp), micro_batch_size=mb, global_batch_size=gbs,
                             sequence_parallel=tp > 1 and fw["name"] == "megatron")
                try:
                    place(model, None, C(framework=fw, layout=resolve(lay), ledger=C(mode=mode))).per_gpu
                    valid += 1
                except ConfigError:
                    rejected += 1
    return valid, rejected, time.perf_counter() - t0


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    m70 = preset("llama3_70b")
    # every layout is predicted once (no repeats of one layout): caches help only where layouts share
    # structure, as in a real search
    frameworks = [("megatron", framework("megatron", overlap_grad_reduce=True), (1, 2, 4, 8), (1, 2, 4, 8, 16)),
                  ("deepspeed", framework("deepspeed", zero_stage=3, reduce_bucket_size=2_000_000_000,
                                             stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0), (1,), (1,)),
                  ("titan", framework("titan"), (1, 2, 4, 8), (1,))]
    print(f"llama3_70b on 1,024 GPUs, every (tp, pp, dp, micro_batch) layout: predicted per second "
          f"(target {TARGET:,}/s on one core)")
    for name, fw, tps, pps in frameworks:
        for mode in ("textbook", "faithful"):
            valid, rejected, dt = search(m70, fw, 1024, mode, 1024, tps, pps, (1, 2, 4, 8))
            r = valid / dt if valid else 0.0
            print(f"  {name:9s} {mode:9s} {valid:3d} layouts ({rejected} rejected) in {dt:7.3f} s: "
                  f"{r:10,.1f}/s   ratio to target {r / TARGET:8.4f}")
    m405 = preset("llama3_405b")
    fw = framework("megatron", overlap_grad_reduce=True)
    for mode in ("textbook", "faithful"):
        valid, rejected, dt = search(m405, fw, 16384, mode, 2048, (1, 2, 4, 8, 16),
                                     (1, 2, 3, 6, 7, 9, 14, 18, 21, 42, 63, 126), (1, 2, 4, 8))
        print(f"llama3_405b on 16,384 GPUs, megatron {mode}: {valid} valid layouts predicted "
              f"({rejected} rejected) in {dt:.2f} s")


if __name__ == "__main__":
    main()
