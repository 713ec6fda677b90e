"""The golden predictions: a corpus of layouts whose prediction.json (and printed table) must stay
byte-identical while code moves. tests/test_golden.py checks it; a change that alters a prediction
on purpose regenerates the file in the same commit and says which rule and rows changed:

    .venv/bin/python -m tests.golden            # rewrite tests/golden_predictions.jsonl.gz
    .venv/bin/python -m tests.golden --diff     # list the cases that differ, the first difference of each

Each case is a list of launch.py overrides composed with Hydra exactly as `mode=predict` composes them;
its golden line is the job's prediction.json text (records.json_text, as the job writes it) and the
table the job prints, or the refusal's text for a config the ledgers refuse. The corpus spans the
three frameworks' faithful ledgers (dense and MoE, every knob that changes a byte), the textbook
ledger, peaks and states, worlds from 2 to 64.
"""
from __future__ import annotations

import gzip
import itertools
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "tests", "golden_predictions.jsonl.gz")


def _lay(tp=1, pp=1, dp=1, **kw) -> list[str]:
    out = [f"layout.tp={tp}", f"layout.pp={pp}", f"layout.dp={dp}"]
    return out + [f"layout.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items()]


def _fw(name: str, **kw) -> list[str]:
    if name == "megatron":  # of the distributed optimizer (--use-distributed-optimizer) unless a case says
        kw = {"use_distributed_optimizer": True, **kw}

    def val(v):
        if isinstance(v, bool):
            return str(v).lower()
        return "null" if v is None else str(v)
    # the CPU harness's rules for DeepSpeed and torchtitan (cpu-gloo, what the CPU runs confirm); Megatron's
    # cases predict the TransformerEngine spec for a GPU run, predict's default (a GPU cluster's target)
    cluster = [] if name == "megatron" else ["cluster=local_cpu"]
    return [f"framework={name}"] + [f"framework.{k}={val(v)}" for k, v in kw.items()] + cluster


def megatron_cases():
    layouts = [_lay(1, 1, 8), _lay(2, 1, 4), _lay(2, 1, 4, sequence_parallel=True),
               _lay(2, 2, 2, sequence_parallel=True, global_batch_size=16),
               _lay(1, 4, 2, global_batch_size=16), _lay(2, 4, 1, vp=2, global_batch_size=8),
               _lay(4, 2, 2, sequence_parallel=True, micro_batch_size=2, global_batch_size=32),
               _lay(1, 2, 4, micro_batch_size=2, global_batch_size=32)]
    knobs = [_fw("megatron"), _fw("megatron", overlap_grad_reduce=True, overlap_param_gather=True),
             _fw("megatron", use_distributed_optimizer=False),
             _fw("megatron", grad_reduce_in_fp32=False, bucket_size=40000000),
             _fw("megatron", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             _fw("megatron", recompute_granularity="selective")]
    for (i, lay), (j, kw) in itertools.product(enumerate(layouts), enumerate(knobs)):
        if (i + j) % 2 and j:  # every layout with the defaults, every knob on half the layouts
            continue
        yield f"megatron/llama3_1b/l{i}/k{j}", ["model=llama3_1b", *kw, *lay]
    for m in ("tiny", "llama3_8b", "llama3_70b"):
        yield f"megatron/{m}/tp2pp2", [f"model={m}", *_fw("megatron", overlap_grad_reduce=True),
                                       *_lay(2, 2, 2, sequence_parallel=True, global_batch_size=16)]
    yield "megatron/tiny/fp32", ["model=tiny", *_fw("megatron", precision="fp32"), *_lay(1, 2, 2, global_batch_size=8)]
    yield "megatron/tiny/tied", ["model=tiny", "model.tied_embeddings=true", *_fw("megatron"), *_lay(1, 2, 2)]
    yield "megatron/tiny/layernorm-bias", ["model=tiny", "model.norm=layernorm", "model.bias=true",
                                          *_fw("megatron"), *_lay(2, 1, 2)]
    yield "megatron/llama3_70b/uneven", ["model=llama3_70b", *_fw("megatron", decoder_first_pipeline_num_layers=8,
                                                                 decoder_last_pipeline_num_layers=8),
                                         *_lay(8, 10, 1, sequence_parallel=True, global_batch_size=20)]
    yield "megatron/llama3_1b/account", ["model=llama3_1b", *_fw("megatron", account_for_embedding_in_pipeline_split=True,
                                                                  account_for_loss_in_pipeline_split=True),
                                          *_lay(2, 6, 1, sequence_parallel=True, global_batch_size=12)]
    yield "megatron/llama3_8b/recompute-block", ["model=llama3_8b", *_fw("megatron", recompute_granularity="full",
                                                                        recompute_method="block", recompute_num_layers=2),
                                                 *_lay(2, 4, 2, vp=2, global_batch_size=16)]
    yield "megatron/refused/tp-heads", ["model=tiny", *_fw("megatron"), *_lay(16, 1, 1)]
    yield "megatron/llama3_1b/cp2", ["model=llama3_1b", *_fw("megatron"), *_lay(1, 1, 4, cp=2)]
    yield "megatron/llama3_8b/tp2cp2pp2", ["model=llama3_8b", "model.seq_len=8192", *_fw("megatron"),
                                           *_lay(2, 2, 2, cp=2, sequence_parallel=True, global_batch_size=16)]
    yield "megatron/refused/cp-local", ["model=llama3_1b", *_fw("megatron", transformer_impl="local"), *_lay(1, 1, 4, cp=2)]
    yield "megatron/refused/recompute", ["model=tiny", *_fw("megatron", recompute_method="uniform"), *_lay(1, 1, 2)]


def deepspeed_cases():
    knobs = [_fw("deepspeed", zero_stage=1), _fw("deepspeed", zero_stage=2),
             _fw("deepspeed", zero_stage=2, overlap_comm=True, reduce_bucket_size=20000000),
             _fw("deepspeed", zero_stage=3), _fw("deepspeed", zero_stage=3, stage3_prefetch_bucket_size=0,
                                                  stage3_max_reuse_distance=0),
             _fw("deepspeed", zero_stage=3, stage3_param_persistence_threshold=0, stage3_max_live_parameters=100000000),
             _fw("deepspeed", zero_stage=1, precision="fp32"), _fw("deepspeed", zero_stage=2, activation_checkpointing=True)]
    for (m, dp), (j, kw) in itertools.product((("tiny", 2), ("tiny", 4), ("llama3_1b", 8), ("llama3_8b", 16)),
                                              enumerate(knobs)):
        yield f"deepspeed/{m}/dp{dp}/k{j}", [f"model={m}", *kw, *_lay(1, 1, dp)]
    for m in ("llama3_1b", "llama3_8b"):
        yield f"deepspeed/{m}/mbs2-gas2", [f"model={m}", *_fw("deepspeed", zero_stage=3),
                                           *_lay(1, 1, 8, micro_batch_size=2, global_batch_size=32)]
    yield "deepspeed/llama3_70b/z3", ["model=llama3_70b", *_fw("deepspeed", zero_stage=3), *_lay(1, 1, 64)]
    yield "deepspeed/tiny/odd-seq", ["model=tiny", "model.seq_len=96", *_fw("deepspeed", zero_stage=3), *_lay(1, 1, 4)]
    yield "deepspeed/refused/tp", ["model=tiny", *_fw("deepspeed"), *_lay(2, 1, 2)]
    yield "deepspeed/tiny/z3-ac", ["model=tiny", *_fw("deepspeed", zero_stage=3, activation_checkpointing=True),
                                   *_lay(1, 1, 2)]
    # DeepSpeed-Ulysses (layout.cp): its states, all-to-alls and peak (fp32 reductions by default)
    for z in (1, 2, 3):
        yield f"deepspeed/tiny/ulysses-z{z}", ["model=tiny", *_fw("deepspeed", zero_stage=z), *_lay(1, 1, 2, cp=2)]
    yield "deepspeed/llama3_8b/ulysses-z3-ac", ["model=llama3_8b", *_fw("deepspeed", zero_stage=3,
                                                                       activation_checkpointing=True),
                                                *_lay(1, 1, 4, cp=4)]
    # ZeRO-Offload: its host buffers, host_bytes, the peak bounded by the reductions' copies, its refusals
    for z in (1, 2):
        yield f"deepspeed/tiny/offload-z{z}", ["model=tiny", *_fw("deepspeed", zero_stage=z, offload_optimizer="cpu",
                                                                   reduce_bucket_size=200000),
                                              *_lay(1, 1, 4, global_batch_size=8)]
    yield "deepspeed/llama3_8b/offload-z2", ["model=llama3_8b", *_fw("deepspeed", zero_stage=2, offload_optimizer="cpu"),
                                             *_lay(1, 1, 8)]
    yield "deepspeed/tiny/offload-z3", ["model=tiny", *_fw("deepspeed", zero_stage=3, offload_optimizer="cpu"),
                                        *_lay(1, 1, 4, global_batch_size=8)]
    yield "deepspeed/llama3_8b/offload-param-z3", ["model=llama3_8b", *_fw("deepspeed", zero_stage=3, offload_optimizer="cpu",
                                                                          offload_param="cpu"), *_lay(1, 1, 8)]
    yield "deepspeed/refused/offload-fp32", ["model=tiny", *_fw("deepspeed", zero_stage=2, offload_optimizer="cpu",
                                                                precision="fp32"), *_lay(1, 1, 2)]


def titan_cases():
    layouts = [_lay(1, 1, 8), _lay(2, 1, 4), _lay(2, 1, 4, sequence_parallel=True), _lay(1, 1, 8, dp_replicate=2),
               _lay(2, 1, 2, cp=2, sequence_parallel=True), _lay(1, 2, 4, global_batch_size=16),
               _lay(1, 4, 2, global_batch_size=16)]
    knobs = [_fw("titan"), _fw("titan", reshard_after_forward="never"), _fw("titan", reshard_after_forward="always"),
             _fw("titan", activation_checkpoint="selective"), _fw("titan", activation_checkpoint="full"),
             _fw("titan", reshard_after_forward="never", activation_checkpoint="full")]
    for (i, lay), (j, kw) in itertools.product(enumerate(layouts), enumerate(knobs)):
        if (i + j) % 2 and j:
            continue
        yield f"titan/llama3_1b/l{i}/k{j}", ["model=llama3_1b", *kw, *lay]
    for m in ("tiny", "llama3_8b", "llama3_70b"):
        yield f"titan/{m}/fsdp-tp", [f"model={m}", *_fw("titan", activation_checkpoint="selective"),
                                     *_lay(8 if m == "llama3_70b" else 2, 1, 8, sequence_parallel=True)]
    yield "titan/tiny/long-seq", ["model=tiny", "model.seq_len=2048", *_fw("titan", activation_checkpoint="full"),
                                  *_lay(1, 1, 2)]
    yield "titan/llama3_8b/tp4-cp2-nosp", ["model=llama3_8b", *_fw("titan", activation_checkpoint="none"),
                                          *_lay(4, 1, 2, cp=2, sequence_parallel=False)]
    yield "titan/refused/fp32-params", ["model=tiny", *_fw("titan", mixed_precision_param="float32"), *_lay(1, 1, 2)]
    yield "titan/tiny/pp-tp", ["model=tiny", *_fw("titan"), *_lay(2, 2, 2, global_batch_size=8)]
    yield "titan/tiny/pp-cp-hsdp", ["model=tiny", "model.seq_len=256", *_fw("titan", activation_checkpoint="full"),
                                    *_lay(1, 2, 4, cp=2, dp_replicate=2, global_batch_size=8)]
    yield "titan/llama3_8b/pp-hsdp", ["model=llama3_8b", *_fw("titan", activation_checkpoint="selective"),
                                      *_lay(1, 4, 4, dp_replicate=2, global_batch_size=16)]
    yield "titan/llama3_70b/pp-tp-sp", ["model=llama3_70b", *_fw("titan", activation_checkpoint="selective"),
                                        *_lay(8, 4, 4, sequence_parallel=True, global_batch_size=16)]
    # PP with TP without sequence parallelism: its peak (pp_peak: the rowwise weights' TP-full grads, wo's gathered
    # weight in a block's backward)
    yield "titan/tiny/pp-tp-nosp", ["model=tiny", *_fw("titan", activation_checkpoint="full"),
                                    *_lay(2, 2, 1, sequence_parallel=False, global_batch_size=3)]
    yield "titan/tiny/pp-tp-sp", ["model=tiny", "model.seq_len=1024", *_fw("titan", activation_checkpoint="none"),
                                  *_lay(2, 2, 1, sequence_parallel=True, global_batch_size=2)]
    yield "titan/llama3_8b/pp-tp-sp-ac", ["model=llama3_8b", *_fw("titan", activation_checkpoint="full"),
                                          *_lay(8, 4, 2, sequence_parallel=True, global_batch_size=16)]
    yield "titan/llama3_70b/pp-tp", ["model=llama3_70b", "model.seq_len=8192", *_fw("titan", activation_checkpoint="full"),
                                     *_lay(8, 4, 4, sequence_parallel=False, global_batch_size=16)]
    yield "titan/refused/vp", ["model=tiny", *_fw("titan"), *_lay(1, 2, 1, vp=2, global_batch_size=4)]
    yield "titan/tiny/zbv", ["model=tiny", *_fw("titan", pipeline_parallel_schedule="ZBVZeroBubble",
                                                activation_checkpoint="none"), *_lay(1, 2, 1, vp=2, global_batch_size=4)]
    yield "titan/tiny/dualpipev", ["model=tiny", *_fw("titan", pipeline_parallel_schedule="DualPipeV",
                                                      activation_checkpoint="none"),
                                   *_lay(1, 2, 1, vp=2, global_batch_size=4)]
    yield "titan/llama3_8b/zero-bubble", ["model=llama3_8b",
                                          *_fw("titan", pipeline_parallel_schedule="InterleavedZeroBubble",
                                               activation_checkpoint="none"),
                                          *_lay(1, 4, 2, vp=2, global_batch_size=16)]
    yield "titan/refused/zero-bubble-sac", ["model=tiny", *_fw("titan", pipeline_parallel_schedule="ZBVZeroBubble"),
                                            *_lay(1, 2, 1, vp=2, global_batch_size=4)]
    yield "titan/llama3_70b/interleaved", ["model=llama3_70b", *_fw("titan", pipeline_parallel_schedule="Interleaved1F1B"),
                                           *_lay(8, 4, 2, vp=2, sequence_parallel=True, global_batch_size=16)]
    yield "titan/tiny/gpipe", ["model=tiny", *_fw("titan", pipeline_parallel_schedule="GPipe", activation_checkpoint="none"),
                               *_lay(1, 2, 2, global_batch_size=8)]


def moe_cases():
    yield "megatron-moe/tiny_moe/ep2", ["model=tiny_moe", *_fw("megatron"), *_lay(1, 1, 2, ep=2)]
    yield "megatron-moe/tiny_moe/ddp-pp2-ep2", ["model=tiny_moe", *_fw("megatron", use_distributed_optimizer=False),
                                                *_lay(1, 2, 2, ep=2, global_batch_size=8)]
    yield "megatron-moe/tiny_moe/ep4-tp2-sp", ["model=tiny_moe", *_fw("megatron"),
                                               *_lay(2, 1, 4, ep=4, sequence_parallel=True)]
    yield "megatron-moe/tiny_moe/a2a", ["model=tiny_moe", *_fw("megatron", moe_token_dispatcher_type="alltoall"),
                                        *_lay(1, 2, 4, ep=2, global_batch_size=8)]
    yield "megatron-moe/mixtral/ep8", ["model=mixtral_8x7b", *_fw("megatron", overlap_grad_reduce=True),
                                       *_lay(2, 4, 8, ep=8, sequence_parallel=True, global_batch_size=64)]
    yield "megatron-moe/qwen3/ep8-grouped", ["model=qwen3_30b_a3b", *_fw("megatron", moe_token_dispatcher_type="alltoall"),
                                             *_lay(1, 2, 8, ep=8, global_batch_size=32)]
    yield "megatron-moe/mixtral/capacity", ["model=mixtral_8x7b", *_fw("megatron", moe_expert_capacity_factor=1.0,
                                                                      moe_pad_expert_input_to_capacity=True,
                                                                      moe_token_dispatcher_type="alltoall"),
                                            *_lay(1, 4, 8, ep=8, global_batch_size=64)]
    for z in (1, 2, 3):
        yield f"deepspeed-moe/tiny_moe/z{z}", ["model=tiny_moe", *_fw("deepspeed", zero_stage=z), *_lay(1, 1, 4, ep=2)]
    yield "deepspeed-moe/mixtral/z2", ["model=mixtral_8x7b", *_fw("deepspeed", zero_stage=2), *_lay(1, 1, 16, ep=8)]
    yield "titan-moe/tiny_moe/ep2", ["model=tiny_moe", *_fw("titan", activation_checkpoint="none"), *_lay(1, 1, 2, ep=2)]
    yield "titan-moe/tiny/default-ac", ["model=tiny_moe", *_fw("titan"), *_lay(1, 1, 2, ep=2)]
    yield "titan-moe/tiny_moe/ep4", ["model=tiny_moe", *_fw("titan", reshard_after_forward="never", activation_checkpoint="none"),
                                          *_lay(1, 1, 8, ep=4)]
    yield "titan-moe/qwen3/ep8", ["model=qwen3_30b_a3b", *_fw("titan", activation_checkpoint="none"),
                                  *_lay(1, 1, 16, ep=8)]
    yield "titan-moe/mixtral/ep8", ["model=mixtral_8x7b", *_fw("titan", activation_checkpoint="none"),
                                    *_lay(1, 1, 8, ep=8)]
    yield "titan-moe/refused/tp", ["model=tiny_moe", *_fw("titan"), *_lay(2, 1, 4, ep=4, sequence_parallel=True)]
    yield "megatron-moe/refused/grouped", ["model=tiny_moe", *_fw("megatron", moe_grouped_gemm=True), *_lay(1, 1, 2, ep=2)]


def gpu_target_cases():
    """The same layouts for a GPU run (cuda-nccl: ledger/faithful/<name>/target.py) beside the CPU harness's."""
    gpu = ["cluster=local_gpu"]
    yield "cuda/titan/llama3_8b/fsdp8-selective", ["model=llama3_8b", "model.seq_len=8192", "framework=titan",
                                                   "framework.activation_checkpoint=selective", *gpu,
                                                   *_lay(1, 1, 8, micro_batch_size=2)]
    yield "cuda/titan/llama3_1b/tp2-sp-none", ["model=llama3_1b", "framework=titan", "framework.activation_checkpoint=none",
                                               *gpu, *_lay(2, 1, 4, sequence_parallel=True)]
    yield "cuda/titan/llama3_1b/pp2", ["model=llama3_1b", "framework=titan", *gpu, *_lay(1, 2, 4, global_batch_size=16)]
    for z in (1, 2, 3):
        yield f"cuda/deepspeed/llama3_1b/z{z}", ["model=llama3_1b", "framework=deepspeed", f"framework.zero_stage={z}",
                                                 *gpu, *_lay(1, 1, 8)]
    yield "cuda/deepspeed/llama3_1b/offload-z2", ["model=llama3_1b", "framework=deepspeed", "framework.zero_stage=2",
                                                  "framework.offload_optimizer=cpu", *gpu, *_lay(1, 1, 8)]
    yield "cuda/deepspeed/llama3_1b/offload-param-z3", ["model=llama3_1b", "framework=deepspeed", "framework.zero_stage=3",
                                                        "framework.offload_param=cpu", *gpu, *_lay(1, 1, 8)]
    yield "cuda/megatron/llama3_1b/local", ["model=llama3_1b", "framework=megatron", "framework.transformer_impl=local",
                                            "framework.use_distributed_optimizer=true", *gpu, *_lay(2, 2, 2, global_batch_size=16)]
    yield "cpu/megatron/llama3_1b/local-target", ["model=llama3_1b", "framework=megatron", "cluster=local_cpu",
                                                  "framework.use_distributed_optimizer=true", *_lay(2, 2, 2, global_batch_size=16)]


def textbook_cases():
    for fw, lay in (("megatron", _lay(2, 2, 2, sequence_parallel=True, global_batch_size=16)),
                    ("megatron", _lay(1, 1, 8)), ("megatron", _lay(8, 4, 2, global_batch_size=16)),
                    ("deepspeed", _lay(1, 1, 8)), ("titan", _lay(1, 1, 8)), ("titan", _lay(2, 1, 4, dp_replicate=2))):
        for m in ("llama3_1b", "llama3_70b"):
            tag = "-".join(x.split("=")[1] for x in lay[:3])
            yield f"textbook/{fw}/{m}/{tag}", [f"model={m}", "ledger.mode=textbook", *_fw(fw), *lay]
    for z in (1, 2, 3):
        yield f"textbook/deepspeed/llama3_8b/z{z}", ["model=llama3_8b", "ledger.mode=textbook",
                                                    *_fw("deepspeed", zero_stage=z), *_lay(1, 1, 16)]


def cpu_sized_cases():
    """The tiny Llama on 2-4 ranks, the CPU matrices' shapes."""
    for world, (tp, pp) in itertools.product((2, 4), ((1, 1), (2, 1), (1, 2))):
        dp = world // (tp * pp)
        lay = _lay(tp, pp, dp, sequence_parallel=tp > 1, global_batch_size=dp * 2 * pp)
        yield f"cpu/megatron/w{world}-tp{tp}pp{pp}", ["model=tiny", *_fw("megatron", overlap_grad_reduce=True), *lay]
        if pp == 1:
            yield f"cpu/titan/w{world}-tp{tp}", ["model=tiny", *_fw("titan"),
                                                 *_lay(tp, 1, dp, sequence_parallel=tp > 1)]
    for world, z in itertools.product((2, 4), (1, 2, 3)):
        yield f"cpu/deepspeed/w{world}-z{z}", ["model=tiny", *_fw("deepspeed", zero_stage=z, reduce_bucket_size=200000),
                                              *_lay(1, 1, world, micro_batch_size=2, global_batch_size=4 * world)]
    yield "cpu/megatron/vp2", ["model=tiny", *_fw("megatron"), *_lay(1, 2, 1, vp=2, global_batch_size=4)]
    yield "cpu/titan/hsdp", ["model=tiny", *_fw("titan"), *_lay(1, 1, 4, dp_replicate=2)]
    yield "cpu/titan/cp2", ["model=tiny", "model.seq_len=256", *_fw("titan"), *_lay(1, 1, 2, cp=2)]
    yield "textbook/megatron-moe/mixtral", ["model=mixtral_8x7b", "ledger.mode=textbook", *_fw("megatron"),
                                            *_lay(1, 1, 8, ep=8)]


def corpus() -> list[tuple[str, list[str]]]:
    cases = [*megatron_cases(), *deepspeed_cases(), *titan_cases(), *moe_cases(), *textbook_cases(), *cpu_sized_cases(),
             *gpu_target_cases()]
    names = [n for n, _ in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


def predict_case(overrides: list[str]) -> dict:
    """What `launch.py mode=predict <overrides>` writes and prints: prediction.json's text and the table,
    or the refusal (the ConfigError's text)."""
    from hydra import compose

    import records
    from launchers.job import check
    from ledger.layout import ConfigError

    cfg = compose(config_name="config", overrides=["mode=predict", *overrides])
    try:
        _, _, pl = check(cfg)
    except ConfigError as e:
        return {"refused": str(e)}
    return {"prediction": records.json_text(pl.to_dict()), "table": pl.report()}


def predict_all(cases=None) -> dict[str, dict]:
    from hydra import initialize_config_dir

    from conf.schema import register

    register()
    out = {}
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        for name, overrides in cases or corpus():
            out[name] = {"overrides": overrides, **predict_case(overrides)}
    return out


def load() -> dict[str, dict]:
    with gzip.open(GOLDEN, "rt") as f:
        return {d["case"]: d for d in map(json.loads, f)}


def write(results: dict[str, dict]) -> None:
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    text = "".join(json.dumps({"case": k, **v}, sort_keys=True) + "\n" for k, v in results.items())
    # mtime=0: the same predictions give the same file bytes (no churn in git)
    with open(GOLDEN, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(text.encode())


def first_difference(a: str, b: str) -> str:
    """Where two texts first differ, as a line and its neighbourhood."""
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}:\n  golden:  {x.strip()[:300]}\n  now:     {y.strip()[:300]}"
    return f"lengths differ: {len(la)} golden lines, {len(lb)} now"


def diff(golden: dict[str, dict], now: dict[str, dict]) -> list[str]:
    out = []
    for name in sorted(set(golden) | set(now)):
        g, n = golden.get(name), now.get(name)
        if g is None or n is None:
            out.append(f"{name}: {'new case' if g is None else 'case removed'}")
            continue
        for key in ("refused", "prediction", "table", "overrides"):
            if g.get(key) != n.get(key):
                what = first_difference(str(g.get(key, "")), str(n.get(key, "")))
                out.append(f"{name}: {key} differs at {what}")
                break
    return out


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    results = predict_all()
    if "--diff" in sys.argv[1:]:
        problems = diff(load(), results)
        print("\n".join(problems) or "identical")
        sys.exit(1 if problems else 0)
    write(results)
    refused = sum("refused" in v for v in results.values())
    print(f"{len(results)} cases ({refused} refused) written to {os.path.relpath(GOLDEN, REPO)}")
