"""Structured (typed) Hydra configs: the one schema every config group is checked against.

A typo'd key or a wrong type fails at composition time (OmegaConf struct mode), before any
job is dispatched. Framework knobs carry the names the frameworks themselves use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    name: str = MISSING
    layers: int = MISSING
    hidden: int = MISSING
    ffn_hidden: int = MISSING
    heads: int = MISSING
    kv_heads: int = MISSING
    vocab: int = MISSING
    seq_len: int = 128
    tied_embeddings: bool = False
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    swiglu: bool = True
    bias: bool = False
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    # Mixture-of-Experts and Qwen3's attention (ledger/model.py ModelShape says what each means):
    # 0 experts is a dense model
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden: int = 0  # 0: ffn_hidden
    moe_shared_expert_hidden: int = 0  # 0: no shared expert
    moe_layer_freq: int = 1  # layer i is MoE when i % moe_layer_freq == 0
    moe_router_dtype: Optional[str] = None  # None | fp32 | fp64 (Megatron --moe-router-dtype)
    kv_channels: int = 0  # 0: hidden / heads
    qk_layernorm: bool = False
    qkv_bias: bool = False  # biases on q / k / v alone (Qwen2 / 2.5; Megatron --add-qkv-bias)
    # a HuggingFace config.json whose fields replace the ones above it maps (conf/hf.py), name included
    hf_config: Optional[str] = None


@dataclass
class LayoutConfig:
    tp: int = 1
    pp: int = 1
    # total data-parallel degree (replicas x shards); -1 = world / (tp*pp*cp) of the cluster
    dp: int = -1
    # HSDP replicate degree (torchtitan); dp_shard = dp / dp_replicate
    dp_replicate: int = 1
    cp: int = 1
    # expert parallel (MoE: the routed experts split over ep ranks) and expert tensor parallel (each
    # expert's fc1 / fc2 split over etp ranks; Megatron's expert_tensor_parallel_size, default 1 here as
    # in Megatron-LM's --expert-tensor-parallel-size). The expert data parallel degree follows:
    # world / (etp * ep * pp) (parallel_state.initialize_model_parallel's expert grid "tp-ep-dp-pp")
    ep: int = 1
    etp: int = 1
    vp: int = 1  # virtual pipeline (interleaved) chunks per stage
    # null: the framework's own default where tp > 1 (Megatron-LM: off, --sequence-parallel; torchtitan
    # 0.3.0: on, ParallelismConfig.enable_sequence_parallel=True; ledger/faithful/<name>/__init__.py)
    sequence_parallel: Optional[bool] = None
    micro_batch_size: int = 1
    # -1 = micro_batch_size * dp * pp (m = pp micro-batches per step)
    global_batch_size: int = -1


@dataclass
class FrameworkConfig:
    name: str = MISSING
    precision: str = "bf16"  # bf16 | fp32


@dataclass
class MegatronConfig(FrameworkConfig):
    name: str = "megatron"
    use_distributed_optimizer: bool = False  # Megatron-LM --use-distributed-optimizer (store_true)
    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # elements per bucket; None = Megatron's default max(40_000_000, 1_000_000 * dp)
    bucket_size: Optional[int] = None
    average_in_collective: bool = False
    clip_grad: float = 1.0
    # Megatron-LM --make-vocab-size-divisible-by: the embedding and output layer hold the vocab padded
    # to a multiple of this times tp (ledger/faithful/megatron/pipeline.py padded_vocab)
    make_vocab_size_divisible_by: int = 128
    # Megatron-LM --transformer-impl: local | transformer_engine (the layer spec GPTModel is built with);
    # None = transformer_engine for mode=predict|dry (run.sh's), local for mode=run (launchers/job.py)
    transformer_impl: Optional[str] = None
    # the pipeline split (Megatron-LM --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers:
    # TransformerConfig num_layers_in_first/last_pipeline_stage; None = the even split), or the embedding /
    # the loss counted as one layer each in an even split (--account-for-embedding-in-pipeline-split,
    # --account-for-loss-in-pipeline-split); ledger/faithful/megatron/pipeline.py stage_layers, split_error
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # activation recompute, as Megatron-LM --recompute-granularity / --recompute-method /
    # --recompute-num-layers / --recompute-modules (TransformerConfig's fields of the same names):
    # granularity None | selective | full; method uniform | block (full only); num_layers: layers per
    # uniform chunk, or layers per stage recomputed by block (full only); modules: what selective
    # recomputes (megatron-core 0.18: core_attn, layernorm, mlp for a dense model; None = [core_attn]).
    # ledger/faithful/megatron/activations.py models each (conf/validate.py checks Megatron's rules)
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[list[str]] = None
    # MoE (model.num_experts > 0), by TransformerConfig's names and Megatron-LM's defaults
    # (--moe-token-dispatcher-type allgather | alltoall; --moe-router-load-balancing-type aux_loss |
    # seq_aux_loss | none; --moe-aux-loss-coeff; --moe-expert-capacity-factor, None: drop-less;
    # --moe-pad-expert-input-to-capacity). moe_grouped_gemm needs TransformerEngine (TEGroupedMLP) or
    # the grouped_gemm package: the local spec's experts are a SequentialMLP (ledger/faithful/megatron/moe.py)
    moe_token_dispatcher_type: str = "allgather"
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = False
    # context parallelism's attention (cp > 1; TransformerEngine only), Megatron-LM --cp-comm-type and
    # --hierarchical-context-parallel-sizes (TransformerConfig cp_comm_type, ModelParallelConfig
    # hierarchical_context_parallel_sizes): p2p (the K/V ring), all_gather (K/V gathered), a2a (Ulysses:
    # heads scattered, sequence gathered), a2a+p2p (a2a inside groups of the first size, the ring over
    # the second); ledger/faithful/megatron/cp.py
    cp_comm_type: str = "p2p"
    hierarchical_context_parallel_sizes: Optional[list[int]] = None


@dataclass
class DeepSpeedConfig(FrameworkConfig):
    name: str = "deepspeed"
    zero_stage: int = 1
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    # None: DeepSpeed's own default, on at stage 3 and off below (ledger/faithful/deepspeed/rules.py)
    overlap_comm: Optional[bool] = None
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    gradient_clipping: float = 1.0
    # the plain Llama's decoder layers under deepspeed.checkpointing.checkpoint (its reentrant
    # CheckpointFunction), configured through the ds_config "activation_checkpointing" section
    activation_checkpointing: bool = False
    # DeepSpeed-Ulysses (layout.cp > 1): the dtype its gradient reductions run in (ds_config
    # seq_parallel_communication_data_type; DeepSpeed's default fp32, runtime/constants.py)
    seq_parallel_communication_data_type: str = "fp32"
    # ZeRO-Offload (ds_config zero_optimization.offload_optimizer): "none" | "cpu", the fp32 master
    # partition, its gradient and AdamW's moments on the host, the optimizer step run there; pin_memory:
    # those host buffers page-locked (DeepSpeed's default false)
    offload_optimizer: str = "none"
    offload_optimizer_pin_memory: bool = False
    # ZeRO-3's parameter offload (zero_optimization.offload_param): "none" | "cpu", the model-dtype partitions on
    # the host, copied to the device for each gather
    offload_param: str = "none"
    offload_param_pin_memory: bool = False
    # DeepSpeed-MoE (model.num_experts > 0): deepspeed.moe.layer.MoE's arguments by its names, and the
    # load-balancing loss's weight in the loss (Megatron-DeepSpeed --moe-loss-coeff)
    capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    moe_loss_coeff: float = 0.01


@dataclass
class TitanConfig(FrameworkConfig):
    name: str = "titan"
    # "default" | "always" | "never", as torchtitan's fsdp_reshard_after_forward
    reshard_after_forward: str = "default"
    mixed_precision_param: str = "bfloat16"
    mixed_precision_reduce: str = "float32"
    dtype: str = "float32"
    # ParallelismConfig.spmd_backend; the default "spmd_types" fails inside torch 2.13's FSDP2
    spmd_backend: str = "partial_dtensor"
    # Trainer.Config.activation_checkpoint (distributed/activation_checkpoint.py): "none" (None),
    # "full" (FullAC: every TransformerBlock recomputed in backward), "selective" (SelectiveAC:
    # per-op, the outputs of compute-intensive / comm ops saved, every second mm recomputed).
    # Unset, torchtitan 0.3.0 checkpoints selectively (trainer.py Trainer.Config.activation_checkpoint:
    # default_factory=SelectiveAC.Config), so the default here is "selective": a prediction with the
    # defaults is of the run torchtitan does with its own.
    activation_checkpoint: str = "selective"
    # the selective variant: 0.3.0 has the per-op policy only ("op"); the older every-n-layers
    # integer option (activation_checkpoint.selective_ac_option) is gone from SelectiveAC.Config
    selective_ac_option: str = "op"
    # ParallelismConfig.pipeline_parallel_schedule (torch pipelining's names): 1F1B | GPipe (one stage a
    # rank, layout.vp=1) | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble (layout.vp stages a rank) |
    # ZBVZeroBubble | DualPipeV (two stages a rank in a V, layout.vp=2)
    pipeline_parallel_schedule: str = "1F1B"
    # models/llama3 _build_llama3_layers(fuse_qkv=...) and models/qwen3's: the attention's q / k / v
    # projections as one wqkv linear (models/common/attention.py FusedQKVLinear: one mm, its output split
    # into contiguous q, k, v) or three (QKVLinear: wq, wk, wv). torchtitan 0.3.0's llama3 and qwen3
    # flavors fuse them (model_registry: fuse_qkv=True), so the default here is true
    fuse_qkv: bool = True


@dataclass
class ClusterConfig:
    name: str = MISSING
    kind: str = "local"  # local | slurm | fake
    backend: str = "gloo"  # gloo | nccl | fake (torch's fake process group: collectives move no data)
    device: str = "cpu"  # cpu | cuda | fake (FakeTensorMode: tensors have shapes and no data)
    # the run predictions are for (ledger/target.py): cpu-gloo | cuda-nccl; None: by the mode (run measures
    # this machine: cpu-gloo on a CPU; predict / plan / dry describe a GPU run: cuda-nccl)
    target: Optional[str] = None
    ranks: int = 2  # ranks per node (local: processes on this machine)
    nodes: int = 1
    timeout_s: int = 900
    # kind=fake only: the ranks of the layout's world to materialise, one process each, one after
    # another; empty = one per distinct state the ledger predicts (launchers/fake.py select_ranks)
    fake_ranks: list[int] = field(default_factory=list)
    # CPU ranks forked from one process that imported the framework once (launchers.forkserver);
    # false: each rank its own `python -m launchers.worker`, as torchrun starts it (CUDA always is)
    fork_ranks: bool = True
    # slurm-only fields (ignored locally)
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: int = 30
    # seconds before the time limit that Slurm signals the job (submitit's USR2 checkpoint/requeue)
    signal_delay_s: int = 120
    # times submitit requeues a job that hit its time limit or was preempted (0 = record it and stop)
    max_num_timeout: int = 0
    gpus_per_node: Optional[int] = None
    # each GPU's memory in decimal GB (an "80 GB" H100: 80); mode=predict / dry / run print whether the
    # heaviest rank's predicted peak fits memory_fraction of it (plan.memory_fraction). None: no verdict
    gpu_memory_gb: Optional[float] = None
    cpus_per_task: int = 1
    mem_gb: Optional[int] = None
    constraint: Optional[str] = None
    setup: list[str] = field(default_factory=list)
    # extra sbatch options, e.g. {exclusive: true}; comes through to submitit unchanged
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    # the slurm.conf the clients use (SLURM_CONF); None = the system's
    slurm_conf: Optional[str] = None


@dataclass
class TrainConfig:
    steps: int = 3  # optimizer steps; step 0 is the first (tracing/warm-up) step
    lr: float = 1e-3
    seed: int = 1234


@dataclass
class LedgerConfig:
    mode: str = "faithful"  # faithful | textbook


@dataclass
class WandbConfig:
    # on by default: offline mode needs no network; run files go under the job dir (analysis/wandb_io.py)
    enabled: bool = True
    mode: str = "offline"  # offline | online | disabled (this setting wins over WANDB_MODE)
    project: str = "train-ledger"
    entity: Optional[str] = None
    # None = the Hydra sweep dir's name, so the runs of one sweep share a group
    group: Optional[str] = None


@dataclass
class ProbeConfig:
    memory: bool = True
    comm: bool = True
    # steps whose collectives are recorded (TorchDispatchMode is active only then); empty = all
    comm_steps: list[int] = field(default_factory=list)
    cuda_profile_steps: list[int] = field(default_factory=list)
    # the peak probe (probes/peak.py): live tensor bytes at every operator of every step
    peak: bool = True
    # the step whose memory timeline is recorded (live bytes by category per event); -1: the last
    timeline_step: int = -1
    # framework=titan only: every step also under torch's FSDPMemTracker
    # (torch/distributed/_tools/fsdp2_mem_tracker.py), the tracker torchtitan's memory estimation
    # uses; its peak per step goes in the rank record (`fsdp_mem_tracker`) for
    # benchmarks/peak_vs_estimators.py to set beside the peak probe's. torchtitan 0.3.0's Llama step
    # is one it cannot track (its ChunkedLossWrapper: the benchmark's docstring), so such a job
    # fails with FSDPMemTracker's NotImplementedError in its record
    fsdp_mem_tracker: bool = False


@dataclass
class CampaignConfig:
    # a sweep rerun into the same hydra.sweep.dir: which of its finished jobs run again. failed: those
    # whose record is not ok (failed, timeout, interrupted, unreadable) and those with no record;
    # all: every job; none: only jobs with no record. A job whose recorded config differs is an error.
    rerun: str = "failed"  # all | failed | none


@dataclass
class PlanConfig:
    """mode=plan (launchers/plan.py, ledger/plan.py): every layout of the model on `gpus` GPUs, each
    predicted by the framework's ledger, ranked, and the best written as a ready sweep."""
    # the machine planned for (not the cluster this job runs on: a plan runs no ranks)
    gpus: Optional[int] = None  # required for mode=plan
    gpus_per_node: int = 8
    # decimal GB (1e9 bytes), as the ledger prints them: an "80 GB" H100 holds 80 GiB = 85.9e9 bytes, so
    # the decimal reading leaves a little more headroom than memory_fraction alone
    gpu_memory_gb: float = 80.0
    # a layout fits when its predicted peak per rank <= memory_fraction x gpu_memory_gb (resident state
    # where a framework's ledger predicts no peak for the layout)
    memory_fraction: float = 0.9
    # tokens per optimizer step; the global batch is global_batch_tokens / model.seq_len sequences.
    # None: layout.global_batch_size (which must then be set)
    global_batch_tokens: Optional[int] = None
    tp_across_nodes: bool = False
    micro_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    vps: list[int] = field(default_factory=lambda: [1, 2])  # virtual pipeline chunks tried (pp > 1)
    max_cp: int = 8
    # torchtitan's pipeline schedules tried where pp > 1 (framework.pipeline_parallel_schedule's names), each with the
    # stages a rank it runs (layout.vp); [] = 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble and
    # DualPipeV (ledger/faithful/titan/rules.py PLAN_SCHEDULES; GPipe and LoopedBFS when listed)
    pipeline_schedules: list[str] = field(default_factory=list)
    # Megatron's context-parallel attentions tried where cp > 1 (p2p | all_gather | a2a; a2a+p2p needs its
    # hierarchical sizes: set framework.cp_comm_type for it); [] = framework.cp_comm_type as configured
    cp_comm_types: list[str] = field(default_factory=list)
    zero_stages: list[int] = field(default_factory=lambda: [1, 2, 3])  # DeepSpeed
    # DeepSpeed's ZeRO-Offload tried (framework.offload_optimizer values; cpu where the ledger models it: a dense
    # model without Ulysses), and the host memory per GPU its host buffers must fit in: a DGX H100's
    # 2 TB over its 8 GPUs (NVIDIA DGX H100 datasheet: system memory 2 TB)
    offload_optimizer: list[str] = field(default_factory=lambda: ["none", "cpu"])
    offload_param: list[str] = field(default_factory=lambda: ["none", "cpu"])  # ZeRO-3's, tried at stage 3
    host_memory_gb: float = 256.0
    # Megatron: use_distributed_optimizer tried (Megatron-LM's default is off; most large runs turn it on)
    distributed_optimizer: list[bool] = field(default_factory=lambda: [False, True])
    sequence_parallel: list[bool] = field(default_factory=lambda: [False, True])  # tried where tp > 1
    hsdp: bool = True  # torchtitan: try every dp_replicate that divides dp
    # recompute settings tried, each by the framework's own knob (ledger/plan.py recompute_knobs):
    # none | selective | full (DeepSpeed has no selective: skipped there)
    recompute: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    # the machine's peak, efficiency and links are the hardware.* profile's (ledger/timing/hardware.py):
    # the step-time model times fitting rows on it, the roofline (ledger/plan.py estimate) the rest
    sort: str = "time"  # time | peak | wire
    top: int = 20  # rows of the printed table, detailed per stage in plan.json
    sweep_top: int = 3  # rows written as the ready sweep
    # the cluster config (conf/cluster/<name>.yaml, a CUDA one) the ready sweep runs on, sized to the
    # plan's nodes and GPUs per node; a Slurm one adds hydra/launcher=submitit_slurm
    cluster: str = "slurm_gpu_example"
    # the sweep file's name (<sweep_dir>/<name>.yaml); None: <model>_<gpus>gpus_<framework>
    name: Optional[str] = None
    # where a copy of the ready sweep goes besides the plan's own job dir (sweep.yaml); None: nowhere else
    sweep_dir: Optional[str] = None
    # layouts to find and detail whatever their rank, each matched on the keys it gives, e.g.
    # [{framework: megatron, tp: 8, pp: 16, dp: 128, cp: 1}] (the Llama 3 405B production layout)
    watch: list[dict[str, Any]] = field(default_factory=list)
    # processes the search spreads its layouts over (forked from this one; the rows the same whatever the number)
    workers: int = 1


@dataclass
class HardwareConfig:
    """The device a step-time prediction is for (ledger/timing/hardware.py): a preset by name (a100, h100,
    h100-96gb, h200, b200: datasheet peaks and bandwidths, assumed efficiencies, labelled "from sources"), or a
    profile yaml `python -m ledger.timing.calibrate` measured (file). The fields below replace the
    profile's; a CPU mode=run job predicts its step time only with a calibrated CPU profile (file)."""
    name: str = "h100"
    file: Optional[str] = None
    gemm_efficiency: Optional[float] = None
    memory_efficiency: Optional[float] = None
    intra_busbw_gbps: Optional[float] = None  # GB/s per GPU inside a node (nccl-tests busbw)
    inter_busbw_gbps: Optional[float] = None  # across nodes
    gpus_per_node: Optional[int] = None


@dataclass
class JobConfig:
    mode: str = "run"  # predict | run | dry | plan
    model: ModelConfig = MISSING
    framework: FrameworkConfig = MISSING
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    cluster: ClusterConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    campaign: CampaignConfig = field(default_factory=CampaignConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    # framework knobs for a sweep over frameworks: each applies where the job's framework has it and is
    # ignored, and recorded as ignored, where it has not (`-m framework=megatron,deepspeed,titan
    # +knobs.zero_stage=3`); a key no framework has is refused (conf/validate.py unknown_key)
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass
class AllFrameworksConfig(FrameworkConfig):
    """framework=all: mode=plan over the three frameworks, each at its schema's defaults."""
    name: str = "all"


FRAMEWORK_SCHEMAS = {"megatron": MegatronConfig, "deepspeed": DeepSpeedConfig, "titan": TitanConfig,
                     "all": AllFrameworksConfig}


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    # the model presets are conf/model/*.yaml (ledger.model.PRESETS reads the same files)
    cs.store(group="layout", name="layout_schema", node=LayoutConfig)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    for name, node in FRAMEWORK_SCHEMAS.items():
        cs.store(group="framework", name=f"{name}_schema", node=node)


def load(cfg_dict: dict) -> Any:
    """Rebuild a typed JobConfig from a resolved dict (e.g. read back from a job dir)."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(JobConfig)
    base.framework = OmegaConf.structured(FRAMEWORK_SCHEMAS[cfg_dict["framework"]["name"]])
    base.model = OmegaConf.structured(ModelConfig)
    base.cluster = OmegaConf.structured(ClusterConfig)
    d = {k: v for k, v in cfg_dict.items() if k not in ("defaults", "hydra")}
    return OmegaConf.merge(base, d)
