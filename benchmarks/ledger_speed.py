"""How fast the ledger predicts: layouts per second, and a whole 16,384-GPU layout search.

    .venv/bin/python benchmarks/ledger_speed.py [--seconds 3]

Prints, per framework and ledger mode, layouts predicted per second (place() + the most-loaded
rank) for the llama3_70b shape on 1,024 GPUs, with the ratio to the 20,000/s target; then the time
to predict every valid (tp, pp, dp, micro_batch) layout of llama3_405b on 16,384 GPUs (Megatron,
global batch 2,048 sequences).
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


def rate(model, fw, lay_cfg, mode: str, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        lay = resolve(lay_cfg)
        place(model, None, C(framework=fw, layout=lay, ledger=C(mode=mode))).per_gpu
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    m70 = preset("llama3_70b")
    cases = [
        ("megatron", framework("megatron", overlap_grad_reduce=True),
         layout(tp=8, pp=8, dp=16, sequence_parallel=True, global_batch_size=1024)),
        ("deepspeed", framework("deepspeed", zero_stage=3), layout(dp=1024, global_batch_size=1024)),
        ("titan", framework("titan"), layout(tp=8, dp=128, global_batch_size=128)),
    ]
    print(f"llama3_70b, 1,024 GPUs: layouts predicted per second (target {TARGET:,}/s on one core)")
    for name, fw, lay in cases:
        for mode in ("textbook", "faithful"):
            try:
                r = rate(m70, fw, lay, mode, a.seconds)
                print(f"  {name:9s} {mode:9s} {r:12,.1f}/s   ratio to target {r / TARGET:8.4f}")
            except ConfigError as e:
                print(f"  {name:9s} {mode:9s} not predicted: {e}")
    m405 = preset("llama3_405b")
    fw = framework("megatron", overlap_grad_reduce=True)
    for mode in ("textbook", "faithful"):
        t0, valid, invalid = time.perf_counter(), 0, 0
        for tp in (1, 2, 4, 8, 16):
            for pp in (1, 2, 3, 6, 7, 9, 14, 18, 21, 42, 63, 126):
                if 16384 % (tp * pp):
                    continue
                for mb in (1, 2, 4, 8):
                    dp = 16384 // (tp * pp)
                    lay = layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mb, global_batch_size=2048,
                                 sequence_parallel=tp > 1)
                    try:
                        place(m405, None, C(framework=fw, layout=resolve(lay), ledger=C(mode=mode))).per_gpu
                        valid += 1
                    except ConfigError:
                        invalid += 1
        dt = time.perf_counter() - t0
        print(f"llama3_405b on 16,384 GPUs, megatron {mode}: {valid} valid layouts predicted "
              f"({invalid} rejected) in {dt:.2f} s")


if __name__ == "__main__":
    main()
