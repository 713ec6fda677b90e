"""A Megatron-LM pretrain_gpt.py command line as train-ledger overrides, parsed by Megatron-LM's own
argument parser (megatron/training/arguments.py add_megatron_arguments, the one `mode=dry`'s run.sh is
tested against).

Every flag whose parsed value is not Megatron-LM's default is either mapped onto a train-ledger field
(MODEL, LAYOUT, FRAMEWORK below: what changes bytes, collectives or FLOPs), listed as ignored (IGNORED:
optimizer hyper-parameters, data, logging, checkpointing; they change no prediction), or refused naming
the flag: a flag the ledgers do not model may change what the run holds.
"""
from __future__ import annotations

import argparse
from functools import lru_cache

from ledger.errors import ConfigError

# flag -> train-ledger field (a value mapped as parsed, booleans included)
MODEL = {"--num-layers": "model.layers", "--hidden-size": "model.hidden", "--ffn-hidden-size": "model.ffn_hidden",
         "--num-attention-heads": "model.heads", "--seq-length": "model.seq_len", "--norm-epsilon": "model.norm_eps",
         "--kv-channels": "model.kv_channels", "--qk-layernorm": "model.qk_layernorm", "--swiglu": "model.swiglu",
         "--vocab-size": "model.vocab", "--num-experts": "model.num_experts", "--moe-router-topk": "model.moe_router_topk",
         "--moe-ffn-hidden-size": "model.moe_ffn_hidden", "--moe-layer-freq": "model.moe_layer_freq",
         "--moe-shared-expert-intermediate-size": "model.moe_shared_expert_hidden",
         "--moe-router-dtype": "model.moe_router_dtype", "--add-qkv-bias": "model.qkv_bias"}
LAYOUT = {"--tensor-model-parallel-size": "layout.tp", "--pipeline-model-parallel-size": "layout.pp",
          "--context-parallel-size": "layout.cp", "--sequence-parallel": "layout.sequence_parallel",
          "--micro-batch-size": "layout.micro_batch_size", "--global-batch-size": "layout.global_batch_size",
          "--expert-model-parallel-size": "layout.ep", "--expert-tensor-parallel-size": "layout.etp",
          "--num-virtual-stages-per-pipeline-rank": "layout.vp"}
FRAMEWORK = {"--transformer-impl": "framework.transformer_impl",
             "--use-distributed-optimizer": "framework.use_distributed_optimizer",
             "--overlap-grad-reduce": "framework.overlap_grad_reduce",
             "--overlap-param-gather": "framework.overlap_param_gather",
             "--ddp-bucket-size": "framework.bucket_size",
             "--ddp-average-in-collective": "framework.average_in_collective",
             "--clip-grad": "framework.clip_grad",
             "--make-vocab-size-divisible-by": "framework.make_vocab_size_divisible_by",
             "--recompute-granularity": "framework.recompute_granularity",
             "--recompute-method": "framework.recompute_method",
             "--recompute-num-layers": "framework.recompute_num_layers",
             "--recompute-modules": "framework.recompute_modules",
             "--decoder-first-pipeline-num-layers": "framework.decoder_first_pipeline_num_layers",
             "--decoder-last-pipeline-num-layers": "framework.decoder_last_pipeline_num_layers",
             "--account-for-embedding-in-pipeline-split": "framework.account_for_embedding_in_pipeline_split",
             "--account-for-loss-in-pipeline-split": "framework.account_for_loss_in_pipeline_split",
             "--moe-token-dispatcher-type": "framework.moe_token_dispatcher_type",
             "--moe-router-load-balancing-type": "framework.moe_router_load_balancing_type",
             "--moe-aux-loss-coeff": "framework.moe_aux_loss_coeff",
             "--moe-expert-capacity-factor": "framework.moe_expert_capacity_factor",
             "--moe-pad-expert-input-to-capacity": "framework.moe_pad_expert_input_to_capacity",
             "--moe-grouped-gemm": "framework.moe_grouped_gemm",
             "--cp-comm-type": "framework.cp_comm_type",
             "--hierarchical-context-parallel-sizes": "framework.hierarchical_context_parallel_sizes"}
# read by a rule below (not one field each)
SPECIAL = ("--group-query-attention", "--num-query-groups", "--normalization", "--rotary-base",
           "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16", "--fp16",
           "--grad-reduce-in-bf16", "--position-embedding-type", "--max-position-embeddings",
           "--num-layers-per-virtual-pipeline-stage", "--lr", "--train-iters", "--seed")
# flags that change no prediction: optimizer hyper-parameters, data, tokenizer, logging, checkpoints
IGNORED = ("--use-mcore-models", "--attention-dropout", "--hidden-dropout", "--weight-decay", "--adam-beta1",
           "--adam-beta2", "--adam-eps", "--mock-data", "--tokenizer-type", "--split", "--log-interval",
           "--log-memory-to-tensorboard", "--tensorboard-dir", "--eval-iters", "--eval-interval",
           "--save-interval", "--save", "--load", "--distributed-timeout-minutes", "--data-path",
           "--vocab-file", "--merge-file", "--tokenizer-model", "--lr-decay-style", "--lr-warmup-iters",
           "--lr-warmup-fraction", "--min-lr", "--lr-decay-iters", "--init-method-std", "--wandb-project",
           "--wandb-exp-name", "--log-throughput", "--log-timers-to-tensorboard", "--timing-log-level",
           "--no-load-optim", "--no-load-rng", "--exit-duration-in-mins", "--use-flash-attn",
           "--attention-softmax-in-fp32", "--no-masked-softmax-fusion", "--use-rotary-position-embeddings",
           "--data-cache-path", "--num-workers", "--apply-layernorm-1p", "--train-samples", "--lr-decay-samples",
           "--lr-warmup-samples", "--decoupled-lr", "--decoupled-min-lr", "--calculate-per-token-loss",
           "--manual-gc", "--empty-unused-memory-level", "--tiktoken-pattern",
           "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--profile", "--profile-step-start",
           "--profile-step-end", "--ckpt-format", "--wandb-save-dir", "--log-params-norm",
           "--log-num-zeros-in-grad", "--attention-backend")
# --attention-backend: the TE spec's prediction is of its fused / flash attention (no s x s probabilities);
# the unfused and local backends save them
ATTENTION_BACKENDS = ("auto", "fused", "flash")


@lru_cache(maxsize=1)
def parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _dest_of() -> dict[str, str]:
    """flag -> its parsed attribute (the parser's own dest)."""
    return {opt: a.dest for a in parser()._actions for opt in a.option_strings if opt.startswith("--")}


def _set_flags(ns: argparse.Namespace) -> list[str]:
    """The flags whose parsed values differ from Megatron-LM's defaults (one per dest, its first name)."""
    out, seen = [], set()
    for a in parser()._actions:
        if not a.option_strings or a.dest in seen or a.dest == "help":
            continue
        seen.add(a.dest)
        if getattr(ns, a.dest, None) != a.default:
            out.append(next(o for o in a.option_strings if o.startswith("--")))
    return out


def _val(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_val(x) for x in v) + "]"
    return "null" if v is None else str(v)


def overrides(args: list[str], world: int) -> tuple[list[str], list[str]]:
    """(train-ledger overrides, ignored flags) of a pretrain_gpt.py command line run on `world` GPUs;
    ConfigError naming a flag that is not modelled."""
    try:
        ns = parser().parse_args(args)
    except SystemExit:
        raise ConfigError(f"megatron import: Megatron-LM's parser rejects the command line: {' '.join(args)[:300]}") \
            from None
    dest = _dest_of()
    get = lambda flag: getattr(ns, dest[flag])  # noqa: E731
    set_flags = _set_flags(ns)
    known = set(MODEL) | set(LAYOUT) | set(FRAMEWORK) | set(SPECIAL) | set(IGNORED)
    for flag in set_flags:
        if flag not in known:
            raise ConfigError(f"megatron import: {flag}={get(flag)!r} is not modelled by the ledger "
                              "(it may change what the run holds or sends); remove it to predict without it")
    backend = get("--attention-backend")
    if "--attention-backend" in set_flags and getattr(backend, "name", str(backend)).split(".")[-1] not in ATTENTION_BACKENDS:
        raise ConfigError(f"megatron import: --attention-backend={backend}: the prediction is of the fused / flash "
                          "attention (the unfused and local backends save the s x s probabilities)")
    if get("--fp16"):
        raise ConfigError("megatron import: --fp16: the Megatron ledger models bf16 and fp32")
    if get("--position-embedding-type") != "rope":
        raise ConfigError(f"megatron import: --position-embedding-type={get('--position-embedding-type')}: "
                          "the ledgers model rotary embeddings (rope)")
    if get("--vocab-size") is None:
        raise ConfigError("megatron import: --vocab-size is needed (the vocab of a tokenizer's files is not read)")
    out = ["framework=megatron"]
    # every mapped field at the value the run has (Megatron-LM's default where the line leaves it unset:
    # train-ledger's own defaults differ for some, e.g. swiglu and etp)
    for table in (MODEL, LAYOUT, FRAMEWORK):
        for flag, field in table.items():
            v = get(flag)
            if flag in ("--moe-router-load-balancing-type", "--moe-aux-loss-coeff") and isinstance(v, list):
                # nargs="+" in Megatron-LM (one per router kind)
                if len(set(v)) > 1:
                    raise ConfigError(f"megatron import: {flag}={v}: one load-balancing type is modelled")
                v = v[0]
            if flag == "--cp-comm-type" and isinstance(v, list):
                # nargs="+": one type for every layer, or one per layer (TransformerConfig cp_comm_type)
                if len(set(v)) > 1:
                    raise ConfigError(f"megatron import: {flag}={v}: one comm type for every layer is modelled")
                v = v[0]
            if v is not None:
                out.append(f"{field}={_val(v)}")
    if get("--tensor-model-parallel-size") == 1 and get("--sequence-parallel"):
        # arguments.py validate_args: "Disable sequence parallelism when tp=1" (the run does it too)
        out = [o if o != "layout.sequence_parallel=true" else "layout.sequence_parallel=false" for o in out]
    if get("--expert-tensor-parallel-size") is None and get("--num-experts"):
        out.append(f"layout.etp={get('--tensor-model-parallel-size')}")  # arguments.py: etp defaults to tp
    heads = get("--num-attention-heads")
    out.append(f"model.kv_heads={get('--num-query-groups') if get('--group-query-attention') else heads}")
    out.append(f"model.norm={'rmsnorm' if get('--normalization') == 'RMSNorm' else 'layernorm'}")
    out.append(f"model.rope_theta={float(get('--rotary-base'))}")
    out.append(f"model.bias={_val(bool(get('--disable-bias-linear')))}")  # (its dest: add_bias_linear)
    out.append(f"model.tied_embeddings={_val(not get('--untie-embeddings-and-output-weights'))}")
    out.append(f"framework.precision={'bf16' if get('--bf16') else 'fp32'}")
    out.append(f"framework.grad_reduce_in_fp32={_val(not get('--grad-reduce-in-bf16'))}")
    per_chunk = get("--num-layers-per-virtual-pipeline-stage")
    if per_chunk:
        out.append(f"layout.vp={get('--num-layers') // (per_chunk * get('--pipeline-model-parallel-size'))}")
    mp = get("--tensor-model-parallel-size") * get("--pipeline-model-parallel-size") * get("--context-parallel-size")
    if world % mp:
        raise ConfigError(f"megatron import: world {world} is not a multiple of tp*pp*cp={mp}")
    out.append(f"layout.dp={world // mp}")
    if get("--global-batch-size") is None:  # arguments.py: micro_batch_size x data-parallel size
        out.append(f"layout.global_batch_size={get('--micro-batch-size') * (world // mp)}")
    if get("--train-iters"):
        out.append(f"train.steps={get('--train-iters')}")
    if "--lr" in set_flags:
        out.append(f"train.lr={get('--lr')}")
    if "--seed" in set_flags:
        out.append(f"train.seed={get('--seed')}")
    ignored = [f for f in set_flags if f in IGNORED]
    return out, ignored


def run_sh_args(path: str) -> tuple[list[str], int]:
    """pretrain_gpt.py's arguments in a run.sh (its torchrun line, continuation lines joined; `$HERE/`
    paths kept as text) and the world its torchrun starts (--nnodes x --nproc_per_node)."""
    import shlex

    text = open(path).read().replace("\\\n", " ")
    cmd = next(line for line in text.splitlines() if line.lstrip().startswith("torchrun"))
    words = shlex.split(cmd, posix=True)
    script = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py"))
    opts = {}
    for i, w in enumerate(words[:script]):
        if w.startswith("--") and "=" in w:
            k, v = w.split("=", 1)
            opts[k] = v
        elif w.startswith("--") and i + 1 < script:
            opts[w] = words[i + 1]
    world = int(opts.get("--nnodes", 1)) * int(opts.get("--nproc_per_node", opts.get("--nproc-per-node", 1)))
    return words[script + 1:], world
