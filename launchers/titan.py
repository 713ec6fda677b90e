"""torchtitan 0.3.0: its own Trainer, configured the 0.3.0 way (a function returning Trainer.Config).

One renderer writes that function as a Python module from the Hydra config (`render_module`);
a real run imports the very module it wrote into the job dir and builds the Trainer from it
(`config.build()`), and `mode=dry` writes the same module plus the `run_train.sh` line a user
runs on a GPU cluster. The model is a `model_registry`-style ModelSpec for the configured
ModelShape, built from torchtitan's own llama3 pieces (models/llama3/__init__.py).

The probe wraps `Trainer.train_step` on the instance: one probe step = one optimizer step,
state read at the step boundary (after optimizers.step()).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import textwrap

from launchers import shell_comment, write_file, write_script
from launchers.local import REPO
from ledger.faithful.titan.schedules import layers_per_stage, schedule_of

MODULE_NAME = "ledger_titan"
CONFIG_FN = "ledger_config"
ASSETS_CACHE = os.path.join(REPO, "outputs", "titan_assets")  # outputs/ is git-ignored


def _py(v) -> str:
    return repr(v)


def _moe_spec(m, fuse_qkv: bool) -> str:
    """An MoE shape's spec: torchtitan's qwen3 MoE (models/qwen3: GQA, its q/k norms as the shape's
    qk_layernorm (models/common/attention.py qk_norm None: none), every layer MoE,
    models/common/moe.py GroupedExperts w1/w2/w3 [E, F, D] / [E, D, F], the router's gate [E, D],
    aux-loss-free balancing by expert bias and its optimizer hook), the standard all-to-all token
    dispatcher (moe_comm_backend "standard": the others need CUDA); it replaces ledger_model_spec."""
    hd = m.kv_channels or m.hidden // m.heads
    return textwrap.indent(textwrap.dedent(f'''\
        def ledger_model_spec() -> ModelSpec:  # noqa: F811 (the MoE shape's)
            from torchtitan.components.optimizer import register_moe_load_balancing_hook
            from torchtitan.models.common import CosSinRoPE
            from torchtitan.models.qwen3 import (_EMBEDDING_INIT as _E, _LINEAR_INIT, _build_qwen3_moe_layers,
                                                 _qwen3_norm, parallelize_qwen3)
            from torchtitan.models.qwen3.model import Qwen3Model
            from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

            dim, vocab = {m.hidden}, {m.vocab}
            layers = _build_qwen3_moe_layers(
                fuse_qkv={bool(fuse_qkv)!r}, n_layers={m.layers}, dim=dim, n_heads={m.heads}, n_kv_heads={m.kv_heads},
                head_dim={hd}, moe_hidden_dim={m.moe_ffn_hidden or m.ffn_hidden}, num_experts={m.num_experts},
                top_k={m.moe_router_topk}, attn_backend="flex",
                rope=CosSinRoPE.Config(dim={hd}, max_seq_len={m.seq_len}, theta={m.rope_theta}),
                moe_comm_backend="standard")
            if not {bool(m.qk_layernorm)}:  # the shape has no q/k norms: the attention's qk_norm off
                import dataclasses

                layers = [dataclasses.replace(b, attention=dataclasses.replace(b.attention, qk_norm=None))
                          for b in layers]
            config = Qwen3Model.Config(
                vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
                tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_E),
                lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
                layers=layers,
            )
            return ModelSpec(name="qwen3", flavor={m.name!r}, model=config, parallelize_fn=parallelize_qwen3,
                             pipelining_fn=pipeline_llm, post_optimizer_build_fn=register_moe_load_balancing_hook,
                             state_dict_adapter=Qwen3StateDictAdapter)
        '''), "        ").lstrip()


def render_module(cfg, lay, tok_dir: str, data_dir: str, dump_folder: str, relative: bool = False) -> str:
    """The torchtitan config module for this job (a function returning Trainer.Config). relative:
    the paths are written relative to the module's own folder (mode=dry: the module travels to the
    cluster with its assets beside it), else as they are (a run on this machine)."""
    m, fw, tr = cfg.model, cfg.framework, cfg.train
    job_dir = os.path.dirname(dump_folder)

    def path(p: str) -> str:
        return f"os.path.join(JOB_DIR, {_py(os.path.relpath(p, job_dir))})" if relative else _py(p)
    head_dim = m.hidden // m.heads
    # PP: the rank's local batch (global / dp) is split into pipeline micro-batches of the
    # layout's micro_batch_size (trainer.py num_pipeline_parallel_microbatches); torchtitan's
    # default schedule 1F1B (one stage per rank). CUDA graphs refuse PP (trainer.py
    # _validate_cuda_graphs), so they are disabled, as torchtitan's own PP configs do.
    pp = getattr(lay, "pp", 1)
    local_batch = lay.micro_batch_size * (lay.num_microbatches if pp > 1 else 1)
    ep = getattr(lay, "ep", 1)
    # trainer.py _validate_cuda_graphs refuses PP, and EP's token dispatcher (its CPU sync), with CUDA graphs
    pp_training = "\n                    disable_cuda_graphs=True,  # trainer.py: CUDA graphs do not support PP / EP" \
        if pp > 1 or ep > 1 else ""
    # framework.pipeline_parallel_schedule; layout.vp stages a rank where torchtitan's default (one, or two
    # for a looped schedule) is not it: pipeline_parallel_layers_per_stage (ledger/faithful/titan/schedules.py)
    sched = schedule_of(fw)
    lps = layers_per_stage(m.layers, pp, lay.vp) if pp > 1 and lay.vp not in (1, 2) else None
    pp_parallel = (f"\n                    pipeline_parallel_degree={pp},"
                   f"\n                    pipeline_parallel_microbatch_size={lay.micro_batch_size},"
                   f"\n                    pipeline_parallel_schedule={_py(str(sched))},"
                   + (f"\n                    pipeline_parallel_layers_per_stage={int(lps)}," if lps else "")) \
        if pp > 1 else ""
    # framework.activation_checkpoint -> Trainer.Config.activation_checkpoint (None | FullAC.Config() |
    # SelectiveAC.Config(): distributed/activation_checkpoint.py); torchtitan's own default is SelectiveAC
    ac = {"none": "None", "full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}[
        getattr(fw, "activation_checkpoint", "none")]
    # config values reach this source only as repr() literals or ints, never inside a docstring or
    # a comment: a name or a path is data (tests/test_hostile.py parses the module and lists its calls)
    return textwrap.dedent(f'''\
        """torchtitan 0.3.0 config written by train-ledger (see LEDGER_JOB below).

        On a GPU cluster: run_train.sh beside this module starts it (paths are relative to JOB_DIR,
        the module's folder, in mode=dry).
        """
        import os

        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.components.metrics import MetricsProcessor
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
        from torchtitan.distributed.pipeline_parallel import pipeline_llm
        from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.common.config_utils import decoder_vocab_size
        from torchtitan.models.llama3 import (
            _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init, parallelize_llama)
        from torchtitan.models.llama3.model import Llama3Model
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
        from torchtitan.protocols.model_spec import ModelSpec
        from torchtitan.trainer import Trainer

        LEDGER_JOB = {_py(dict(model=m.name, pp=pp, tp=lay.tp, cp=lay.cp, dp_shard=lay.dp_shard,
                               dp_replicate=lay.dp_replicate, world=lay.world))}
        JOB_DIR = {"os.path.dirname(os.path.abspath(__file__))" if relative else _py(job_dir)}


        def ledger_model_spec() -> ModelSpec:
            """model_registry()-style spec for the ledger's shape LEDGER_JOB["model"] (untied; wq/wk/wv fused as
            framework.fuse_qkv says)."""
            dim, vocab = {m.hidden}, {m.vocab}
            config = Llama3Model.Config(
                dim=dim,
                vocab_size=vocab,
                tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
                norm=RMSNorm.Config(normalized_shape=dim, eps={m.norm_eps}, param_init=_NORM_INIT),
                lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
                layers=_build_llama3_layers(
                    fuse_qkv={bool(cfg.framework.fuse_qkv)!r},
                    n_layers={m.layers},
                    dim=dim,
                    n_heads={m.heads},
                    n_kv_heads={m.kv_heads},
                    hidden_dim={m.ffn_hidden},
                    # the rope cache is sized to the training sequence (a buffer on every layer)
                    rope=ComplexRoPE.Config(dim={head_dim}, max_seq_len={m.seq_len}, theta={m.rope_theta}),
                    attn_backend="flex",
                ),
            )
            return ModelSpec(name="llama3", flavor={m.name!r}, model=config, parallelize_fn=parallelize_llama,
                             pipelining_fn=pipeline_llm, post_optimizer_build_fn=None,
                             state_dict_adapter=Llama3StateDictAdapter)


        {_moe_spec(m, fw.fuse_qkv) if m.num_experts else ""}
        def {CONFIG_FN}() -> Trainer.Config:
            model_spec = ledger_model_spec()
            return Trainer.Config(
                model_spec=model_spec,
                loss=ChunkedLossWrapper.Config(
                    loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))),
                hf_assets_path={path(tok_dir)},
                dump_folder={path(dump_folder)},
                optimizer=default_adamw(lr={tr.lr}),
                lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
                training=TrainingConfig(
                    local_batch_size={local_batch},
                    global_batch_size={lay.global_batch_size},
                    seq_len={m.seq_len},
                    steps={tr.steps},
                    dtype={fw.dtype!r},                                    # fp32 shards = master weights
                    mixed_precision_param={fw.mixed_precision_param!r},    # all-gather / compute dtype
                    mixed_precision_reduce={fw.mixed_precision_reduce!r},  # reduce-scatter dtype{pp_training}
                ),
                parallelism=ParallelismConfig({pp_parallel}
                    data_parallel_shard_degree={lay.dp_shard},
                    data_parallel_replicate_degree={lay.dp_replicate},
                    tensor_parallel_degree={lay.tp},
                    context_parallel_degree={lay.cp},  # FlexAttention: K/V all-gathered over cp
                    enable_sequence_parallel={bool(lay.sequence_parallel)},
                    fsdp_reshard_after_forward={fw.reshard_after_forward!r},
                    spmd_backend={fw.spmd_backend!r},
                    expert_parallel_degree={ep},
                ),
                dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path={path(data_dir)}),
                metrics=MetricsProcessor.Config(log_freq=1),
                activation_checkpoint={ac},
                debug=DebugConfig(seed={tr.seed}),
            )
        ''')


def write_module(cfg, lay, out_dir: str) -> str:
    from launchers import titan_assets

    tok_dir, data_dir = titan_assets.build(os.path.join(out_dir, "titan_assets"), cfg.model.vocab) \
        if cfg.mode == "dry" else titan_assets.build(ASSETS_CACHE, cfg.model.vocab)
    src = render_module(cfg, lay, tok_dir, data_dir, os.path.join(out_dir, "titan_dump"), relative=cfg.mode == "dry")
    path = os.path.join(out_dir, f"{MODULE_NAME}.py")
    write_file(path, src)
    return path


def load_module(path: str):
    """Import a torchtitan config module by path, registered under its file's stem (the written
    module's: MODULE_NAME), as torchtitan's config manager imports it by name."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_config(path: str):
    """Import the written module by path and call its config function -> Trainer.Config."""
    return getattr(load_module(path), CONFIG_FN)()


# torchtitan's run_train.sh, per node: torchrun of `-m torchtitan.train --module M --config F`
# (config/manager.py imports M from PYTHONPATH and calls F), with the allocator setting it exports
# (from the module's folder, on PYTHONPATH as "."; the folder's own name may hold a ':')
TRAIN_LINE = ('cd "$HERE" && PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True" PYTHONPATH=".${{PYTHONPATH:+:$PYTHONPATH}}" '
              '{torchrun} -m torchtitan.train --module {module} --config {config}')


def dry(cfg, lay, out_dir: str) -> list[str]:
    """The config module (paths relative to itself), run_train.sh (torchrun on every node, sized to
    the layout's world by launchers/gpu_scripts.py) and, on a Slurm cluster, sbatch.sh."""
    from launchers import gpu_scripts

    topo = gpu_scripts.topology(cfg.cluster, lay.world)
    path = write_module(cfg, lay, out_dir)
    title = shell_comment(f"train-ledger: torchtitan 0.3.0, model {cfg.model.name}, {topo.describe()}")
    sh = write_script(os.path.join(out_dir, "run_train.sh"), "\n".join([
        "#!/bin/bash", title,
        "# the same line on every node; MASTER_ADDR = the first node (sbatch.sh sets it under Slurm).",
        "# torch 2.13 lacks torch.distributed.set_timeout, which set_pg_timeouts() calls after step 1.",
        gpu_scripts.HERE_LINE,
        TRAIN_LINE.format(torchrun=gpu_scripts.torchrun_line(topo), module=MODULE_NAME, config=CONFIG_FN), ""]))
    return [path, sh] + gpu_scripts.sbatch_file(
        cfg.cluster, topo, out_dir, [gpu_scripts.SRUN_EACH_NODE.format(script="run_train.sh")], "torchtitan 0.3.0")


def _fsdp_resident(model) -> list:
    """Tensors FSDP2 itself holds on its param groups / params at the step boundary."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    out = []

    def collect(v, depth=0):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)) and depth < 3:
            for x in v:
                collect(x, depth + 1)
        elif hasattr(v, "__dataclass_fields__") and depth < 3:
            for k in v.__dataclass_fields__:
                collect(getattr(v, k, None), depth + 1)

    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        # an MoE block under a per-param mesh (distributed/fsdp.py shard_placement_fn: the experts over
        # efsdp, the rest over fsdp) has one param group per mesh
        for pg in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:
            if pg is None:
                continue
            for obj in [pg, *pg.fsdp_params]:
                for v in vars(obj).values():
                    collect(v)
    return out


def state_groups(trainer) -> dict:
    from probes.memory import optimizer_tensors

    params, grads, other = [], [], []
    for m in trainer.model_parts:
        for p in m.parameters():
            params.append(p)
            if p.grad is not None:
                grads.append(p.grad)
        other += list(m.buffers())
        other += _fsdp_resident(m)
    optim = []
    for o in trainer.optimizers.optimizers:
        optim += optimizer_tensors(o)
    return {"params": params, "grads": grads, "optim": optim, "other": other}


def _offline_datasets_env() -> None:
    """Before `datasets` is imported (it reads these at import): no hub, the project's own cache."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(ASSETS_CACHE, "hf_datasets_cache"))


def preload(device: str) -> None:
    """For launchers.forkserver: what run_rank installs and imports before it builds the Trainer
    (install() must precede any torchtitan import; install is idempotent, so a forked rank's own
    call finds it done, with the same redirect counts a spawned rank has at that point)."""
    from launchers import titan_cpu

    if device == "cpu":
        titan_cpu.install()
    _offline_datasets_env()
    import torchtitan.components.loss  # noqa: F401
    import torchtitan.components.metrics  # noqa: F401
    import torchtitan.components.optimizer  # noqa: F401
    import torchtitan.distributed.pipeline_parallel  # noqa: F401
    import torchtitan.hf_datasets.text_datasets  # noqa: F401
    import torchtitan.models.llama3.model  # noqa: F401
    import torchtitan.trainer  # noqa: F401


def run_rank(cfg, lay, session) -> dict:
    from launchers import titan_cpu

    fake_world = cfg.cluster.device == "fake"
    if cfg.cluster.device in ("cpu", "fake"):  # fake: FakeTensors on the CPU device
        titan_cpu.install()
    else:
        titan_cpu.set_timeout_shim()
        titan_cpu.pipeline_step_microbatches()
        titan_cpu.eager_cp_block_mask()
        titan_cpu.visible_cp_allgather()
        titan_cpu.skip_end_sleep()
    import torch

    job_dir = os.path.dirname(session.out_path)
    _offline_datasets_env()
    path = write_module(cfg, lay, job_dir)
    config = load_config(path)
    run_ctx = contextlib.ExitStack()
    if fake_world:
        from launchers import fake
        from ledger.faithful.titan.pp import boundary

        # the fake world first: Trainer.init_distributed (distributed/utils.py init_distributed) skips
        # its own init_process_group when one exists
        fake.init_process_group()
        # the model's storages become FakeTensors (trainer.py to_empty); with PP the stage boundary's
        # activation (the rank's [micro-batch, S, hidden] slice) in the compute dtype, for the metadata exchange
        act = (boundary(cfg.model, lay), titan_cpu.compute_dtype(cfg)) if lay.pp > 1 else None
        titan_cpu.install_fake(act)
        # data-dependent reads of them answered at titan_cpu.FAKE_SCALAR_SITES
        run_ctx.enter_context(fake.scalar_reads(titan_cpu.fake_scalar_sites(lay.pp)))
    with run_ctx:
        return _train(trainer_config=config, session=session, fake_world=fake_world,
                      fsdp_mem_tracker=cfg.probe.fsdp_mem_tracker)


def expert_group_labels(trainer) -> dict:
    """With expert parallelism, the sparse mesh's ep and efsdp groups (distributed/parallel_dims.py:
    ("pp", "dp_replicate", "efsdp", "ep")) by the ledger's labels (ledger/faithful/titan/moe.py): their
    ranks can be those of the dense fsdp group, which the rank grid would name."""
    dims = trainer.parallel_dims
    if getattr(dims, "ep", 1) <= 1:
        return {}
    import torch.distributed as dist

    # a mesh dim spanning the world is the default group (torch device_mesh.py _init_one_process_group),
    # shared with the dense fsdp dim: its collectives keep the grid's label (ledger: titan_moe.expert_dims)
    world = dist.group.WORLD
    out = {}
    for name, label in (("ep", "ep"), ("efsdp", "edp")):
        g = dims.get_mesh(name).get_group()
        if g is not world and g.group_name != world.group_name:
            out[g] = label
    return out


def _fsdp_mem_tracker(trainer):
    """torch's FSDPMemTracker over the (one) model part and its optimizer, new each step so that its
    peak is the step's. Entered outside the probes' modes: they see each operator first."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    if len(trainer.model_parts) != 1:
        raise ValueError("probe.fsdp_mem_tracker tracks one model part (pp=1)")
    return FSDPMemTracker(trainer.model_parts[0], trainer.optimizers.optimizers[0])


def _fsdp_mem_tracker_peak(fmt) -> dict:
    """Its peak snapshot summed over devices: {"peak_bytes": Total, "<category>_bytes": ...}."""
    out: dict[str, int] = {}
    for per_dev in fmt.get_tracker_snapshot("peak").values():
        for k, v in per_dev.items():
            key = "peak_bytes" if str(k) == "Total" else f"{getattr(k, 'value', k)}_bytes"
            out[key] = out.get(key, 0) + int(v)
    return out


def _train(trainer_config, session, fake_world: bool, fsdp_mem_tracker: bool = False) -> dict:
    import torch

    from launchers import titan_cpu

    trainer = trainer_config.build()
    if fake_world:
        from launchers.fake import tensor_mode as fake_step

        titan_cpu.fake_cpu_device(trainer)
    losses: dict[int, float] = {}
    orig_log = trainer.metrics_processor.log

    def log(step, global_avg_loss, *a, **k):
        losses[step] = float(global_avg_loss)
        return orig_log(step, global_avg_loss, *a, **k)

    trainer.metrics_processor.log = log
    orig_step = trainer.train_step

    def train_step(data_iterator):
        i = trainer.step - 1  # Trainer.train() counts from 1; the ledger's step 0 is the first
        # cluster=fake: the step under the rank's FakeTensorMode too, or FSDP2's all-gather outputs
        # (torch.empty in _fsdp_collectives.py, no fake input) would be real memory and real matmuls;
        # entered before the probe's mode, so the comm probe still sees every collective first
        fmt = _fsdp_mem_tracker(trainer) if fsdp_mem_tracker else contextlib.nullcontext()
        with (fake_step() if fake_world else contextlib.nullcontext()), fmt, session.step(i):
            orig_step(data_iterator)
        session.loss(None if fake_world else losses.get(trainer.step))  # fake: numerics are meaningless
        if fsdp_mem_tracker:
            session.note("fsdp_mem_tracker", lambda: _fsdp_mem_tracker_peak(fmt))
        session.state(lambda: state_groups(trainer))

    trainer.train_step = train_step
    session.watch(trainer.model_parts)
    session.name_groups(expert_group_labels(trainer))
    try:
        trainer.train()
        if torch.distributed.is_initialized() and not fake_world:
            # in place of train()'s closing sleep on rank 0 (titan_cpu.skip_end_sleep): no rank leaves
            # (rank 0 holds the store) before every rank is done
            torch.distributed.barrier()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    out = {"cpu_redirects": titan_cpu.reached()}
    if fake_world:
        from launchers import fake
        from ledger.faithful.titan.pp import boundary

        out["fake_scalar_reads"] = fake.scalar_read_hits()
    return out
