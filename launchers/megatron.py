"""Megatron Core 0.18.0 driven as megatron/training/training.py drives it, one rank per process.

parallel_state.initialize_model_parallel -> GPTModel (local, non-TransformerEngine layer spec) ->
Float16Module (bf16) -> DistributedDataParallel -> get_megatron_optimizer -> per step:
zero_grad_buffer + zero_grad, get_forward_backward_func() over m micro-batches, optimizer.step().
On CPU (cluster.device == "cpu") launchers.megatron_cpu redirects Megatron's CUDA assumptions.
On GPU (cluster.device=cuda, backend=nccl) nothing is redirected: stock Megatron runs, and
sequence parallel with the local spec then needs apex (its FusedLayerNorm; torch's norm refuses SP).

`dry` writes run.sh: the Megatron-LM pretrain_gpt.py command line of the same job for a GPU
cluster (the design article's chapter 7 run.sh).
"""
from __future__ import annotations

import os
import shlex
import types
from typing import Iterator

import torch

from launchers import shell_comment, write_script
from ledger.layout import Layout


# -- the model -----------------------------------------------------------------------------------
def transformer_config(cfg, lay: Layout):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, fw = cfg.model, cfg.framework
    bf16 = fw.precision == "bf16"
    return TransformerConfig(
        num_layers=m.layers, hidden_size=m.hidden, ffn_hidden_size=m.ffn_hidden,
        num_attention_heads=m.heads, num_query_groups=m.kv_heads,
        normalization="RMSNorm" if m.norm == "rmsnorm" else "LayerNorm", layernorm_epsilon=m.norm_eps,
        gated_linear_unit=m.swiglu, activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.bias, add_qkv_bias=m.get("qkv_bias", False), hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        # interleaved schedule (vp > 1): microbatch_group_size_per_vp_stage defaults to pp
        # (model_parallel_config.py __post_init__); batch_p2p_comm on, overlap_p2p_comm off
        virtual_pipeline_model_parallel_size=lay.vp if lay.vp > 1 else None,
        # the pipeline split (argument_utils.py: --decoder-first/last-pipeline-num-layers become
        # num_layers_in_first/last_pipeline_stage); TransformerBlock builds get_num_layers_to_build's share
        num_layers_in_first_pipeline_stage=fw.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=fw.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=fw.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=fw.account_for_loss_in_pipeline_split,
        sequence_parallel=lay.sequence_parallel,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # CPU tensors: initialise on the CPU (also valid on GPU); p2p without a CUDA sync
        use_cpu_initialization=cfg.cluster.device != "cuda", batch_p2p_sync=False,
        # the local spec computes attention with Megatron's own DotProductAttention
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        # activation recompute, by TransformerConfig's own names (ledger/faithful/megatron/activations.py);
        # recompute_modules None is TransformerConfig's default ["core_attn"]
        recompute_granularity=fw.recompute_granularity, recompute_method=fw.recompute_method,
        recompute_num_layers=fw.recompute_num_layers,
        recompute_modules=list(fw.recompute_modules) if fw.recompute_modules is not None else None,
        kv_channels=m.kv_channels or None, qk_layernorm=m.qk_layernorm,
        **moe_config(cfg, lay),
    )


def moe_config(cfg, lay: Layout) -> dict:
    """TransformerConfig's MoE fields (none for a dense model): the model's experts, the layout's
    expert grid, the framework's dispatcher / router / capacity knobs. moe_permute_fusion and the
    grouped GEMM stay off (TransformerEngine / grouped_gemm kernels, CUDA only)."""
    m, fw = cfg.model, cfg.framework
    if not m.num_experts:
        return {}
    return dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                moe_ffn_hidden_size=m.moe_ffn_hidden or m.ffn_hidden,
                moe_shared_expert_intermediate_size=m.moe_shared_expert_hidden or None,
                moe_layer_freq=m.moe_layer_freq, moe_router_dtype=m.moe_router_dtype,
                expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp,
                moe_token_dispatcher_type=fw.moe_token_dispatcher_type,
                moe_router_load_balancing_type=fw.moe_router_load_balancing_type,
                moe_aux_loss_coeff=fw.moe_aux_loss_coeff,
                moe_expert_capacity_factor=fw.moe_expert_capacity_factor,
                moe_pad_expert_input_to_capacity=fw.moe_pad_expert_input_to_capacity,
                moe_grouped_gemm=fw.moe_grouped_gemm)


def padded_vocab_size(cfg, lay: Layout) -> int:
    """pretrain_gpt.py's args.padded_vocab_size: global_vars.py _build_tokenizer -> megatron-core's
    tokenizers/utils/build_tokenizer.py build_tokenizer -> _set_padded_vocab_size (pad_vocab_size
    defaults True) -> vocab_size_with_padding of the tokenizer's vocab_size (NullTokenizer: --vocab-size).
    Megatron's own function, called with the arguments it reads there."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    args = types.SimpleNamespace(make_vocab_size_divisible_by=cfg.framework.make_vocab_size_divisible_by,
                                 tensor_model_parallel_size=lay.tp, rank=int(os.environ.get("RANK", 0)))
    return vocab_size_with_padding(cfg.model.vocab, args, logging_enabled=False)


def build_model(cfg, lay: Layout, tcfg, vp_stage: int | None = None):
    """One model chunk. With vp > 1, training.py get_model builds vp chunks per stage: chunk i has
    vp_stage=i (GPTModel -> TransformerBlock takes its layer offset from it), pre_process only on
    the first chunk of the first stage, post_process only on the last chunk of the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module

    m = cfg.model
    # gpt_builders.py _get_transformer_layer_spec: --transformer-impl picks the layer spec (job.check
    # refuses transformer_engine on the CPU)
    te = cfg.framework.transformer_impl == "transformer_engine"
    stage, pp = ps.get_pipeline_model_parallel_rank(), lay.pp
    if m.num_experts:
        # gpt_builders.py: an MoE model takes the decoder block spec (dense and MoE layers by moe_layer_freq)
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(tcfg, use_transformer_engine=te,
                                                          normalization=tcfg.normalization, vp_stage=vp_stage,
                                                          pp_rank=stage)
    elif te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=m.qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=m.qk_layernorm, normalization=tcfg.normalization)
    pre = stage == 0 and vp_stage in (None, 0)
    post = stage == pp - 1 and vp_stage in (None, lay.vp - 1)
    # gpt_builders.py: GPTModel(vocab_size=args.padded_vocab_size); the data's tokens stay below m.vocab (batches)
    model = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=padded_vocab_size(cfg, lay),
                     max_sequence_length=m.seq_len,
                     pre_process=pre, post_process=post,
                     share_embeddings_and_output_weights=m.tied_embeddings, position_embedding_type="rope",
                     rotary_base=int(m.rope_theta), vp_stage=vp_stage)
    if cfg.cluster.device == "cuda":
        model.cuda(torch.cuda.current_device())
    if tcfg.bf16:  # training.py get_model: Float16Module casts to bf16 (else RMSNorm stays fp32)
        model = Float16Module(tcfg, model)
    return model


def ddp_config(fw, lay: Layout):
    """As training.py builds it from the arguments: align_param_gather (--no-align-param-gather
    unset: True) is forced False by arguments.py validate_args without the interleaved schedule."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=fw.grad_reduce_in_fp32, overlap_grad_reduce=fw.overlap_grad_reduce,
        overlap_param_gather=fw.overlap_param_gather, align_param_gather=lay.vp > 1,
        use_distributed_optimizer=fw.use_distributed_optimizer,
        bucket_size=fw.bucket_size, average_in_collective=fw.average_in_collective)


def optimizer_config(cfg):
    from megatron.core.optimizer import OptimizerConfig

    fw = cfg.framework
    bf16 = fw.precision == "bf16"
    return OptimizerConfig(optimizer="adam", lr=cfg.train.lr, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                           bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                           use_distributed_optimizer=fw.use_distributed_optimizer, clip_grad=fw.clip_grad)


# -- data ----------------------------------------------------------------------------------------
def batches(cfg, lay: Layout, device, seed: int) -> Iterator[dict]:
    """Synthetic tokens, the same on every rank of a DP replica (a seed per DP rank), each below the
    configured vocab (the padded rows are never a token, as with Megatron-LM's tokenizers)."""
    g = torch.Generator().manual_seed(seed)
    s, b, v = cfg.model.seq_len, lay.micro_batch_size, cfg.model.vocab
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    while True:
        tok = torch.randint(0, v, (b, s + 1), generator=g)
        yield {"tokens": tok[:, :-1].to(device), "labels": tok[:, 1:].to(device), "position_ids": pos.to(device)}


def forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, partial(_loss, batch)


def _loss(batch, output_tensor):
    # output_tensor: per-token loss [b, s] from GPTModel (vocab-parallel cross-entropy)
    loss = output_tensor.float().mean()
    # a copy: schedules.py forward_step_calc_loss divides the returned loss in place by m
    return loss, {"lm loss": loss.detach().clone()}


# -- one rank ------------------------------------------------------------------------------------
def preload(device: str) -> None:
    """For launchers.forkserver: the Megatron Core modules run_rank imports (the redirects are
    installed by each rank, in run_rank)."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    import megatron.core.tokenizers.utils.build_tokenizer  # noqa: F401
    from launchers import megatron_cpu  # noqa: F401


def init_distributed(cfg) -> torch.device:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.cluster.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        from launchers import megatron_cpu

        megatron_cpu.install()
        device = torch.device("cpu")
    if cfg.cluster.device == "fake":
        from launchers import fake, megatron_cpu

        megatron_cpu.install_fake()
        fake.init_process_group(rank, world)
        return device
    torch.distributed.init_process_group(backend=cfg.cluster.backend, rank=rank, world_size=world)
    return device


def rope_tensors(model, seq_len: int) -> list[torch.Tensor]:
    """RotaryEmbedding keeps inv_freq (a plain attribute) and, through @lru_cache on forward,
    the emb tensor of the last call (models/common/embeddings/rotary_pos_embedding.py). The
    cached one is fetched by repeating GPTModel._preprocess's call: a cache hit, checked."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    out = []
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding):
            out.append(mod.inv_freq)
            before = type(mod).forward.cache_info()
            emb = mod(seq_len, packed_seq=False, cp_group=None)
            after = type(mod).forward.cache_info()
            if after.currsize != before.currsize or after.hits != before.hits + 1:
                raise RuntimeError(f"rope cache probe missed: {before} -> {after}")
            out.append(emb)
    return out


def state_groups(chunks, optimizer, seq_len: int) -> dict:
    """The containers Megatron keeps between steps, classified (see ledger/faithful/megatron/states.py).
    `chunks`: the DDP-wrapped model chunks of this rank (vp of them with interleaving)."""
    params, grads, other = [], [], []
    for model in chunks:
        for buf in model.buffers + model.expert_parallel_buffers:
            # param_data is None without the distributed optimizer: then params are the module's own
            params.append(buf.param_data) if buf.param_data is not None else None
            grads.append(buf.grad_data)
        params += list(model.parameters())  # views into param_data (counted once) or own storages
    optim = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) + getattr(opt, "fp32_from_float16_groups", []):
            optim += list(group)
        for group in getattr(opt, "shard_fp32_groups", []):
            optim += list(group)
        for st in opt.optimizer.state.values():
            optim += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for name in ("found_inf", "_dummy_overflow_buf", "_scale_one"):
            t = getattr(opt, name, None)
            if isinstance(t, torch.Tensor):
                other.append(t)
    # module buffers (RoPE inv_freq) and utils.py GlobalMemoryBuffer: the scratch tensors that
    # dot_product_attention.py (attention scores) and the SP all-gathers keep between steps
    for model in chunks:
        other += list(model.module.buffers()) + rope_tensors(model, seq_len)
    from megatron.core import parallel_state as ps

    other += list(ps.get_global_memory_buffer().buffer.values())
    # an MoE model: the aux-loss scale schedules.py forward_step sets for every micro-batch, kept by
    # transformer/moe/moe_utils.py MoEAuxLossAutoScaler as a class attribute (the first one's tensor)
    if any(getattr(c.module, "config", None) is not None and c.module.config.num_moe_experts for c in chunks):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        if MoEAuxLossAutoScaler.main_loss_backward_scale is not None:
            other.append(MoEAuxLossAutoScaler.main_loss_backward_scale)
    return {"params": params, "grads": grads, "optim": optim, "other": other}


def run_rank(cfg, lay: Layout, session) -> dict:
    from ledger.faithful.megatron.states import check_framework, check_interleaving
    from ledger.faithful.megatron.activations import check_recompute, recompute_of

    # ConfigErrors naming the field, before Megatron's own checks (arguments.py, the schedule)
    check_framework(cfg.framework)
    check_interleaving(lay)
    check_recompute(recompute_of(cfg.framework))
    device = init_distributed(cfg)
    from megatron.core import parallel_state as ps

    vp = lay.vp if lay.vp > 1 else None
    ps.initialize_model_parallel(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                                 virtual_pipeline_model_parallel_size=vp, context_parallel_size=lay.cp,
                                 expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp)
    session.name_groups(expert_group_labels(cfg))
    if cfg.cluster.device != "fake":
        return _train(cfg, lay, session, device)
    from launchers import fake, megatron_cpu

    # cluster=fake: the process groups above are real objects (ranks as Python lists); from the
    # model on, every tensor is a FakeTensor (use_cpu_initialization allocates under the mode), and
    # data-dependent reads are answered at megatron_cpu.FAKE_SCALAR_SITES
    with fake.tensor_mode(), fake.scalar_reads(megatron_cpu.FAKE_SCALAR_SITES):
        extra = _train(cfg, lay, session, device)
    extra.update(fake_shims=megatron_cpu.fake_hits(), fake_scalar_reads=fake.scalar_read_hits())
    return extra


def expert_group_labels(cfg) -> dict:
    """An MoE model's expert groups (parallel_state's expert grid "tp-ep-dp-pp" with tp = etp), each by
    the label the ledger gives its collectives (ledger/faithful/megatron/moe.py EXPERT_DIMS): the dense
    grid cannot name them (with ep = dp the EP group holds the DP group's ranks)."""
    if not cfg.model.num_experts:
        return {}
    from megatron.core import parallel_state as ps

    from ledger.faithful.megatron.moe import EXPERT_DIMS

    getters = {"ep": ps.get_expert_model_parallel_group, "etp": ps.get_expert_tensor_parallel_group,
               "etp-ep": ps.get_expert_tensor_and_model_parallel_group,
               "etp-ep-pp": ps.get_expert_tensor_model_pipeline_parallel_group, "edp": ps.get_expert_data_parallel_group}
    return {getters[label](): label for label in EXPERT_DIMS}


def _train(cfg, lay: Layout, session, device) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    fake_world = cfg.cluster.device == "fake"
    vp = lay.vp if lay.vp > 1 else None
    torch.manual_seed(cfg.train.seed)
    # the inference tracker keeps CPU-compatible RNG states (no torch.cuda.get_rng_state)
    model_parallel_cuda_manual_seed(cfg.train.seed, inference_rng_tracker=device.type == "cpu")
    tcfg = transformer_config(cfg, lay)
    # training.py get_model: vp chunks (one without interleaving), each in its own DDP;
    # bucketing disabled for chunks after the first (DDP also disables it on stages > 0)
    vp_stages = list(range(lay.vp)) if vp else [None]
    chunks = [DDP(tcfg, ddp_config(cfg.framework, lay), build_model(cfg, lay, tcfg, v), disable_bucketing=i > 0)
              for i, v in enumerate(vp_stages)]
    optimizer = get_megatron_optimizer(optimizer_config(cfg), chunks)
    fw = cfg.framework
    # training.py train(): the schedule talks to DDP through these config hooks (a list per
    # chunk, unwrapped when there is one chunk)
    one = len(chunks) == 1
    if fw.overlap_grad_reduce:
        tcfg.no_sync_func = chunks[0].no_sync if one else [c.no_sync for c in chunks]
        tcfg.grad_sync_func = chunks[0].start_grad_sync if one else [c.start_grad_sync for c in chunks]
    # training.py setup: param_sync_func only with align_param_gather (the interleaved schedule)
    param_sync_func = None
    if fw.overlap_param_gather and chunks[0].ddp_config.align_param_gather:
        param_sync_func = chunks[0].start_param_sync if one else [c.start_param_sync for c in chunks]
    tcfg.param_sync_func = param_sync_func
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.grad_scale_func = optimizer.scale_loss

    # one iterator per chunk (the interleaved schedule asks for a list), all the same stream:
    # chunk 0 of the first stage reads tokens, the last chunk of the last stage the labels
    seed = cfg.train.seed + ps.get_data_parallel_rank()
    data = [batches(cfg, lay, device, seed) for _ in chunks]
    fb = get_forward_backward_func()
    m = lay.num_microbatches
    # training.py train() with overlap_param_gather (should_disable_forward_pre_hook): the first
    # iteration runs without the forward pre-hooks and param_sync_func (no param all-gather), both
    # are enabled after it; disable_forward_pre_hook() at the end gathers the last update
    opg = fw.use_distributed_optimizer and fw.overlap_param_gather
    if opg:
        for c in chunks:
            c.disable_forward_pre_hook(param_sync=False)
        tcfg.param_sync_func = None
    session.watch(chunks)
    for step in range(cfg.train.steps):
        if opg and step == 1:
            for c in chunks:
                c.enable_forward_pre_hook()
            tcfg.param_sync_func = param_sync_func
        with session.step(step):
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            losses = fb(forward_step_func=forward_step, data_iterator=data[0] if one else data, model=chunks,
                        num_microbatches=m, seq_length=cfg.model.seq_len, micro_batch_size=lay.micro_batch_size,
                        forward_only=False)
            ok, grad_norm, _ = optimizer.step()
        # fake: no value to read (numerics are meaningless there)
        loss = sum(float(x["lm loss"]) for x in losses) / m if losses and not fake_world else None
        session.loss(loss)
        session.state(lambda: state_groups(chunks, optimizer, cfg.model.seq_len))
    if opg and cfg.train.steps > 1:
        for c in chunks:
            c.disable_forward_pre_hook()
    extra = {"grad_norm": float(grad_norm) if grad_norm is not None and not fake_world else None,
             "stage": ps.get_pipeline_model_parallel_rank()}
    if device.type == "cpu":  # also on cluster=fake
        from launchers import megatron_cpu

        extra["cpu_redirects"] = megatron_cpu.hits()
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return extra


# -- dry: Megatron-LM's pretrain_gpt.py command line ----------------------------------------------
def pretrain_gpt_args(cfg, lay: Layout) -> list[str]:
    """The flags of Megatron-LM pretrain_gpt.py for this job (names as megatron/training/arguments.py)."""
    m, fw, t = cfg.model, cfg.framework, cfg.train
    a = ["--use-mcore-models", "--transformer-impl", fw.transformer_impl,
         "--num-layers", m.layers, "--hidden-size", m.hidden, "--ffn-hidden-size", m.ffn_hidden,
         "--num-attention-heads", m.heads]
    if m.kv_heads != m.heads:
        a += ["--group-query-attention", "--num-query-groups", m.kv_heads]
    a += ["--seq-length", m.seq_len, "--max-position-embeddings", m.seq_len,
          "--position-embedding-type", "rope", "--rotary-base", int(m.rope_theta),
          "--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm", "--norm-epsilon", m.norm_eps]
    if m.kv_channels:
        a += ["--kv-channels", m.kv_channels]
    if m.qk_layernorm:
        a.append("--qk-layernorm")
    a += moe_args(cfg, lay)
    if m.swiglu:
        a.append("--swiglu")
    if not m.bias:
        a.append("--disable-bias-linear")
    if m.get("qkv_bias", False):
        a.append("--add-qkv-bias")
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    a += ["--attention-dropout", 0.0, "--hidden-dropout", 0.0,
          "--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp]
    if lay.cp > 1:
        a += ["--context-parallel-size", lay.cp, "--cp-comm-type", fw.cp_comm_type]
        if fw.hierarchical_context_parallel_sizes:
            a += ["--hierarchical-context-parallel-sizes", *fw.hierarchical_context_parallel_sizes]
    split = (fw.decoder_first_pipeline_num_layers, fw.decoder_last_pipeline_num_layers)
    if lay.vp > 1 and split == (None, None) and not (fw.account_for_embedding_in_pipeline_split
                                                     or fw.account_for_loss_in_pipeline_split):
        a += ["--num-layers-per-virtual-pipeline-stage", m.layers // (lay.pp * lay.vp)]
    elif lay.vp > 1:
        # arguments.py validate_args: uneven PP takes the virtual degree itself
        # (--num-virtual-stages-per-pipeline-rank), as does a split counting the embedding / loss
        a += ["--num-virtual-stages-per-pipeline-rank", lay.vp]
    for flag, v in zip(("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"), split):
        if v is not None:
            a += [flag, v]
    if fw.account_for_embedding_in_pipeline_split:
        a.append("--account-for-embedding-in-pipeline-split")
    if fw.account_for_loss_in_pipeline_split:
        a.append("--account-for-loss-in-pipeline-split")
    if lay.sequence_parallel:
        a.append("--sequence-parallel")
    if fw.use_distributed_optimizer:
        a.append("--use-distributed-optimizer")
    if fw.overlap_grad_reduce:
        a.append("--overlap-grad-reduce")
    if fw.overlap_param_gather:
        a.append("--overlap-param-gather")
    if fw.bucket_size is not None:
        a += ["--ddp-bucket-size", fw.bucket_size]
    if fw.average_in_collective:
        a.append("--ddp-average-in-collective")
    if not fw.grad_reduce_in_fp32:
        a.append("--grad-reduce-in-bf16")
    if fw.recompute_granularity is not None:  # arguments.py --recompute-*
        a += ["--recompute-granularity", fw.recompute_granularity]
        if fw.recompute_method is not None:
            a += ["--recompute-method", fw.recompute_method]
        if fw.recompute_num_layers is not None:
            a += ["--recompute-num-layers", fw.recompute_num_layers]
        if fw.recompute_modules is not None:
            a += ["--recompute-modules", *fw.recompute_modules]
    a += ["--micro-batch-size", lay.micro_batch_size, "--global-batch-size", lay.global_batch_size]
    if fw.precision == "bf16":
        a.append("--bf16")
    a += ["--lr", t.lr, "--train-iters", t.steps, "--clip-grad", fw.clip_grad, "--weight-decay", 0.1,
          "--adam-beta1", 0.9, "--adam-beta2", 0.95, "--seed", t.seed,
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", m.vocab,
          # Megatron-LM pads the vocab itself (build_tokenizer.py vocab_size_with_padding): explicit, as predicted
          "--make-vocab-size-divisible-by", fw.make_vocab_size_divisible_by, "--split", "99,1,0",
          "--log-interval", 1, "--log-memory-to-tensorboard", "--tensorboard-dir", "$HERE/tb",
          "--eval-iters", 0, "--save-interval", 1000000, "--distributed-timeout-minutes", 30]
    return [str(x) for x in a]


def moe_args(cfg, lay: Layout) -> list:
    """Megatron-LM's MoE flags (training/arguments.py _add_moe_args and the TransformerConfig fields it
    generates flags from), each set explicitly: Megatron-LM's --expert-tensor-parallel-size defaults to
    the TP size, train-ledger's layout.etp to 1."""
    m, fw = cfg.model, cfg.framework
    if not m.num_experts:
        return []
    a = ["--num-experts", m.num_experts, "--moe-router-topk", m.moe_router_topk,
         "--moe-ffn-hidden-size", m.moe_ffn_hidden or m.ffn_hidden, "--moe-layer-freq", m.moe_layer_freq,
         "--expert-model-parallel-size", lay.ep, "--expert-tensor-parallel-size", lay.etp,
         "--moe-token-dispatcher-type", fw.moe_token_dispatcher_type,
         "--moe-router-load-balancing-type", fw.moe_router_load_balancing_type,
         "--moe-aux-loss-coeff", fw.moe_aux_loss_coeff]
    if m.moe_shared_expert_hidden:
        a += ["--moe-shared-expert-intermediate-size", m.moe_shared_expert_hidden]
    if m.moe_router_dtype is not None:
        a += ["--moe-router-dtype", m.moe_router_dtype]
    if fw.moe_expert_capacity_factor is not None:
        a += ["--moe-expert-capacity-factor", fw.moe_expert_capacity_factor]
    if fw.moe_pad_expert_input_to_capacity:
        a.append("--moe-pad-expert-input-to-capacity")
    if fw.moe_grouped_gemm:
        a.append("--moe-grouped-gemm")
    return a


def dry(cfg, lay: Layout, out_dir: str) -> list[str]:
    """run.sh: torchrun of Megatron-LM's pretrain_gpt.py on every node (launchers/gpu_scripts.py
    sizes the nodes to the layout's world); sbatch.sh beside it on a Slurm cluster."""
    from launchers import gpu_scripts

    topo = gpu_scripts.topology(cfg.cluster, lay.world)
    args = pretrain_gpt_args(cfg, lay)
    lines = ["#!/bin/bash",
             shell_comment(f"train-ledger: Megatron-LM pretrain_gpt.py, model {cfg.model.name}: "
                           f"TP{lay.tp} x PP{lay.pp} x CP{lay.cp} x DP{lay.dp}, {topo.describe()}"),
             "# the same line on every node; MEGATRON_LM = a Megatron-LM checkout (default: the working directory),",
             "# MASTER_ADDR = the first node (sbatch.sh sets it under Slurm)",
             gpu_scripts.HERE_LINE,
             f'{gpu_scripts.torchrun_line(topo)} "${{MEGATRON_LM:-.}}/pretrain_gpt.py" \\']
    pairs, i = [], 0
    while i < len(args):  # one flag (with its values) per line
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        pairs.append(" ".join(_q(x) for x in args[i:j]))
        i = j
    lines += [f"  {p} \\" for p in pairs[:-1]] + [f"  {pairs[-1]}", ""]
    paths = [write_script(os.path.join(out_dir, "run.sh"), "\n".join(lines))]
    return paths + gpu_scripts.sbatch_file(cfg.cluster, topo, out_dir, [gpu_scripts.SRUN_EACH_NODE.format(script="run.sh")],
                                           "Megatron-LM pretrain_gpt.py")


def _q(x: str) -> str:
    return f'"{x}"' if x.startswith("$HERE/") else shlex.quote(x)  # expanded by the shell on the node

