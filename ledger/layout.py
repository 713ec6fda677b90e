"""A parallel layout resolved to integers, and the validation every job passes before dispatch."""
from __future__ import annotations

from dataclasses import dataclass

from ledger.faithful.megatron.buffers import split_error
from ledger.frozen import direct_init
from ledger.grid import Grid
from ledger.model import ModelShape


class ConfigError(ValueError):
    """Bad input: the message names the field and the rule it breaks."""


@direct_init  # ledger/frozen.py: fields stored straight into __dict__ (speed)
@dataclass(frozen=True, init=False)
class Layout:
    tp: int
    pp: int
    dp: int  # total data parallel (replicas x shards)
    dp_replicate: int
    cp: int
    ep: int
    vp: int
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int
    etp: int = 1  # expert tensor parallel (MoE)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def edp(self) -> int:
        """The expert data parallel degree: the ranks holding the same experts (Megatron's expert grid
        "tp-ep-dp-pp" with tp = etp: world / (etp * ep * pp))."""
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def grid(self) -> Grid:
        return Grid(tp=self.tp, cp=self.cp, dp=self.dp_shard, dp_replicate=self.dp_replicate, pp=self.pp)

    def to_dict(self) -> dict:
        # spelled out: asdict() deep-copies and a loop over fields() costs µs per layout of a search
        # (test_layout_to_dict_has_every_field keeps it complete)
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "dp_replicate": self.dp_replicate, "cp": self.cp,
                "ep": self.ep, "etp": self.etp, "edp": self.edp, "vp": self.vp, "sequence_parallel": self.sequence_parallel,
                "micro_batch_size": self.micro_batch_size, "global_batch_size": self.global_batch_size,
                "world": self.world, "dp_shard": self.dp_shard, "num_microbatches": self.num_microbatches}


def resolve(layout_cfg, world: int | None = None) -> Layout:
    """Fill dp = -1 from the cluster's world size and global_batch_size = -1 as micro*dp*pp."""
    lc = layout_cfg
    # each field read once (a DictConfig read costs µs; a search resolves thousands of layouts)
    tp, pp, cp, ep, vp, dpr, mbs = (lc["tp"], lc["pp"], lc["cp"], lc["ep"], lc["vp"], lc["dp_replicate"],
                                     lc["micro_batch_size"])
    etp = lc.get("etp", 1)  # (a record from before MoE has none)
    if tp < 1 or pp < 1 or cp < 1 or ep < 1 or vp < 1 or dpr < 1 or mbs < 1 or etp < 1:  # (min() of a tuple is slower)
        for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp), ("vp", vp),
                        ("dp_replicate", dpr), ("micro_batch_size", mbs)):
            if v < 1:
                raise ConfigError(f"layout.{name}={v} must be >= 1")
    dp = lc["dp"]
    if dp == -1:
        if world is None:
            raise ConfigError("layout.dp=-1 (auto) needs a cluster world size; set layout.dp")
        mp = tp * pp * cp
        if world % mp:
            raise ConfigError(f"layout.dp=-1: world={world} is not divisible by tp*pp*cp={mp}")
        dp = world // mp
    elif dp < 1:
        raise ConfigError(f"layout.dp={dp} must be >= 1 or -1 (auto)")
    gbs = lc["global_batch_size"]
    if gbs == -1:
        gbs = mbs * dp * pp
    elif gbs < 1:
        raise ConfigError(f"layout.global_batch_size={gbs} must be >= 1 or -1 (auto: micro_batch_size*dp*pp)")
    return Layout(tp, pp, dp, dpr, cp, ep, vp, bool(lc["sequence_parallel"]), mbs, gbs, etp)


def validate(model: ModelShape, lay: Layout, framework: str, fw_cfg=None, world: int | None = None) -> None:
    """Raise ConfigError naming the field and the rule; checked before anything is dispatched."""
    # each rule: `if not (rule): raise` (a search validates thousands of layouts; the message is
    # formatted only on failure)
    if not (model.hidden % model.heads == 0):
        raise ConfigError(f"model.heads={model.heads} does not divide model.hidden={model.hidden}")
    if not (model.heads % model.kv_heads == 0):
        raise ConfigError(f"model.kv_heads={model.kv_heads} does not divide model.heads={model.heads}")
    if not (model.heads % lay.tp == 0):
        raise ConfigError(f"tp={lay.tp} does not divide num_heads={model.heads}")
    if not (model.kv_heads % lay.tp == 0):
        raise ConfigError(f"tp={lay.tp} does not divide num_kv_heads={model.kv_heads}")
    if not (model.ffn_hidden % lay.tp == 0):
        raise ConfigError(f"tp={lay.tp} does not divide ffn_hidden={model.ffn_hidden}")
    # Megatron pads the vocab to a multiple of tp itself (ledger/faithful/megatron/buffers.py padded_vocab);
    # torchtitan shards it as torch.chunk (DTensor Shard(0)) and its loss refuses an empty shard:
    # components/loss.py _LossParallelCrossEntropy.forward (the last TP rank's rows: vocab - (tp-1)*ceil(vocab/tp))
    if not (model.vocab % lay.tp == 0 or framework == "megatron"
            or (framework == "titan" and model.vocab > (lay.tp - 1) * -(-model.vocab // lay.tp))):
        if framework == "titan":
            raise ConfigError(f"titan: tp={lay.tp} vocab={model.vocab}: torch.chunk leaves the last TP rank no vocab "
                              "rows; torchtitan components/loss.py: \"_LossParallelCrossEntropy does not support "
                              "empty vocab shards.\"")
        raise ConfigError(f"tp={lay.tp} does not divide vocab={model.vocab}")
    if not (model.layers % (lay.pp * lay.vp) == 0 or framework == "megatron"):
        raise ConfigError(f"pp*vp={lay.pp}*{lay.vp} does not divide layers={model.layers}")
    if not (lay.vp == 1 or lay.pp > 1):
        raise ConfigError(f"vp={lay.vp} needs pp > 1 (interleaving is across pipeline stages)")
    if not (lay.dp % lay.dp_replicate == 0):
        raise ConfigError(f"dp_replicate={lay.dp_replicate} does not divide dp={lay.dp}")
    if not (lay.global_batch_size % (lay.micro_batch_size * lay.dp) == 0):
        raise ConfigError(f"global_batch_size={lay.global_batch_size} is not divisible by micro_batch_size*dp="
                          f"{lay.micro_batch_size}*{lay.dp}")
    if not (model.seq_len % (lay.tp if lay.sequence_parallel else 1) == 0):
        raise ConfigError(f"sequence_parallel: tp={lay.tp} does not divide seq_len={model.seq_len}")
    if not (model.seq_len % (2 * lay.cp) == 0 or lay.cp == 1):
        raise ConfigError(f"cp={lay.cp}: seq_len={model.seq_len} must be divisible by 2*cp (load-balanced CP chunks)")
    if not (lay.ep == 1 and lay.etp == 1) or model.num_experts:
        _validate_experts(model, lay, framework)
    if not (model.kv_channels in (0, model.hidden // model.heads) and not model.qk_layernorm
            or framework == "megatron" or (framework == "titan" and model.is_moe)):
        which = "kv_channels" if model.kv_channels else "qk_layernorm"
        raise ConfigError(f"{framework}: model.{which}={getattr(model, which)}: heads of another width than "
                          "hidden/heads and q/k norms are modelled for Megatron only (the plain Llama and "
                          "torchtitan's Llama have neither)")
    if not (not lay.sequence_parallel or lay.tp > 1):
        raise ConfigError("sequence_parallel=true needs tp > 1")
    if world is not None:
        if not (lay.world == world):
            raise ConfigError(f"world size: tp*pp*dp*cp={lay.tp}*{lay.pp}*{lay.dp}*{lay.cp}={lay.world} "
                              f"!= cluster size {world} (cluster.nodes x cluster.ranks, on Slurm nodes x "
                              "tasks_per_node)")
    # framework limits
    if framework == "deepspeed":
        if fw_cfg is not None:
            _check_knobs(fw_cfg, _DEEPSPEED_KNOBS)
        if not (lay.tp == 1 and lay.pp == 1 and lay.cp == 1):
            raise ConfigError(f"deepspeed: tp={lay.tp} pp={lay.pp} cp={lay.cp}: train-ledger drives DeepSpeed "
                              "ZeRO as pure data "
                              "parallelism (tp, pp and cp come from Megatron-DeepSpeed, which it does not drive)")
        if not (lay.dp_replicate == 1):
            raise ConfigError("deepspeed: dp_replicate (HSDP) is a torchtitan layout; use zero_stage instead")
    elif framework == "megatron":
        if fw_cfg is not None:
            _check_knobs(fw_cfg, _MEGATRON_KNOBS)
        if not (lay.dp_replicate == 1):
            raise ConfigError("megatron: dp_replicate (HSDP) is a torchtitan layout")
        # the pipeline split: Megatron's own rules and reasons (megatron_buffers.split_error)
        split = tuple(_knob(fw_cfg, name) for name in _MEGATRON_SPLIT)
        if not (split == (None, None, None, None) or split == (None, None, False, False)) \
                or model.layers % (lay.pp * lay.vp):
            why = split_error(model.layers, lay.pp, lay.vp, (*split[:2], bool(split[2]), bool(split[3])))
            if why is not None:
                raise ConfigError(f"megatron: layers={model.layers} pp={lay.pp} vp={lay.vp}"
                                  + "".join(f" {n}={v}" for n, v in zip(_MEGATRON_SPLIT, split) if v)
                                  + f": {why} (megatron-core 0.18.0 transformer_config.py / transformer_block.py)")
        impl = _knob(fw_cfg, "transformer_impl")
        if not (impl in (None, "local", "transformer_engine")):
            raise ConfigError(f"framework.transformer_impl={impl!r} must be local or transformer_engine "
                              "(null: transformer_engine to predict, local to run)")
    elif framework == "titan":
        # PP (distributed/pipeline_parallel.py pipeline_llm): the ledger models torchtitan's default
        # schedule 1F1B, one stage per rank, over FSDP (dp_shard) alone
        if not (lay.pp == 1 or lay.vp == 1):
            raise ConfigError(f"titan: vp={lay.vp}: looped pipeline schedules (Interleaved1F1B, several stages "
                              "per rank) "
                              "are not modelled; the ledger models torchtitan's default 1F1B (vp=1)")
        if not (lay.pp == 1 or (lay.tp == 1 and lay.cp == 1 and lay.dp_replicate == 1)):
            raise ConfigError(f"titan: pp={lay.pp} with tp={lay.tp} cp={lay.cp} "
                              f"dp_replicate={lay.dp_replicate}: pipeline "
                              "parallelism is modelled over FSDP (dp_shard) only; tp, cp and dp_replicate with "
                              "pp are not modelled")
        # torch _context_parallel/_attention.py _create_cp_block_mask (FlexAttention CP) raises
        # NotImplementedError unless seq_len % (cp * 128) == 0 (the BlockMask is sharded in blocks)
        if not (lay.cp == 1 or model.seq_len % (128 * lay.cp) == 0):
            raise ConfigError(f"titan: cp={lay.cp}: seq_len={model.seq_len} must be divisible by cp*128 "
                              "(FlexAttention's "
                              "CP BlockMask is sharded in whole 128-token blocks)")
        # without PP one local batch per step (no gradient accumulation); with PP the local batch
        # (global / dp) is split into num_microbatches pipeline micro-batches of micro_batch_size
        # (parallelism.pipeline_parallel_microbatch_size; trainer.py num_pipeline_parallel_microbatches)
        if not (lay.pp > 1 or lay.num_microbatches == 1):
            raise ConfigError(f"titan: global_batch_size={lay.global_batch_size} gives {lay.num_microbatches} "
                              "micro-batches; "
                              "torchtitan runs one local batch per step here (global = micro_batch_size*dp)")
        # torch pipelining/schedules.py Schedule1F1B.__init__: ValueError unless n_microbatches >= stages
        if not (lay.pp == 1 or lay.num_microbatches >= lay.pp):
            raise ConfigError(f"titan: pp={lay.pp}: global_batch_size={lay.global_batch_size} gives "
                              f"{lay.num_microbatches} "
                              f"pipeline micro-batches per rank; 1F1B needs at least pp={lay.pp} (global >= "
                              "micro_batch_size*dp*pp)")
        if fw_cfg is not None:
            if not (fw_cfg.reshard_after_forward in ("default", "always", "never")):
                raise ConfigError(f"framework.reshard_after_forward={fw_cfg.reshard_after_forward!r} must be "
                                  "default|always|never")
            if not (lay.pp == 1 or fw_cfg.reshard_after_forward != "always"):
                raise ConfigError(f"titan: pp={lay.pp} with framework.reshard_after_forward='always' is not "
                                  "modelled (per "
                                  "micro-batch re-gathers under 1F1B); use default or never (False with PP)")
    else:
        raise ConfigError(f"framework.name={framework!r} must be megatron, deepspeed or titan")


def _validate_experts(model: ModelShape, lay: Layout, framework: str) -> None:
    """The MoE rules every framework shares, and which frameworks model MoE at all."""
    if not model.num_experts:
        which = "ep" if lay.ep > 1 else "etp"
        raise ConfigError(f"layout.{which}={getattr(lay, which)}: expert parallelism needs an MoE model "
                          "(model.num_experts > 0; e.g. model=tiny_moe)")
    if framework == "titan":
        _validate_titan_experts(model, lay)
    # transformer/moe/moe_layer.py BaseMoELayer: num_moe_experts % expert_model_parallel_size == 0
    if not (model.num_experts % lay.ep == 0):
        raise ConfigError(f"ep={lay.ep} does not divide model.num_experts={model.num_experts} (each EP rank holds "
                          "num_experts / ep experts)")
    if not (model.expert_ffn % lay.etp == 0):
        raise ConfigError(f"etp={lay.etp} does not divide the expert FFN width {model.expert_ffn} "
                          "(model.moe_ffn_hidden, else ffn_hidden)")
    if not (model.moe_shared_expert_hidden % lay.tp == 0):
        raise ConfigError(f"tp={lay.tp} does not divide model.moe_shared_expert_hidden={model.moe_shared_expert_hidden}")
    # parallel_state.initialize_model_parallel: the expert grid (etp, ep, edp, pp) tiles the world
    if not (lay.world % (lay.etp * lay.ep * lay.pp) == 0):
        raise ConfigError(f"etp*ep*pp={lay.etp}*{lay.ep}*{lay.pp} does not divide the world tp*pp*dp*cp={lay.world} "
                          "(Megatron's expert grid: expert data parallel = world / (etp*ep*pp))")


def _validate_titan_experts(model: ModelShape, lay: Layout) -> None:
    """torchtitan's MoE model here is its own qwen3 (models/qwen3; its q/k norms as model.qk_layernorm,
    every layer MoE, no shared experts, no biases) under FSDP2 with expert parallelism over dp_shard (ledger/faithful/titan/moe.py)."""
    def no(what: str) -> None:
        raise ConfigError(f"titan: model.num_experts={model.num_experts}: {what}")

    if model.moe_layer_freq != 1 or model.moe_shared_expert_hidden or model.bias or not model.swiglu \
            or model.norm != "rmsnorm" or model.tied_embeddings:
        no("torchtitan's qwen3 MoE has every layer MoE, no shared experts, SwiGLU, RMSNorm, no biases, untied "
           "embeddings (model.moe_layer_freq=1, moe_shared_expert_hidden=0, swiglu, rmsnorm, bias=false, "
           "tied_embeddings=false)")
    if not (lay.tp == lay.pp == lay.cp == lay.dp_replicate == lay.vp == 1):
        no(f"tp={lay.tp} pp={lay.pp} cp={lay.cp} dp_replicate={lay.dp_replicate}: MoE is modelled over FSDP "
           "(dp_shard) with expert parallelism alone")
    # distributed/parallel_dims.py: EP borrows from dp_shard x cp x tp (efsdp = dp_shard / ep here)
    if not (lay.dp_shard % lay.ep == 0):
        no(f"ep={lay.ep} does not divide dp_shard={lay.dp_shard} (torchtitan's EP borrows the FSDP ranks: "
           "efsdp = dp_shard / ep)")


# Megatron's pipeline-split knobs (MegatronConfig; megatron_buffers.EVEN_SPLIT order)
_MEGATRON_SPLIT = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                   "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


# sizes and budgets a framework takes in elements: (field, least value, what it is). A bucket of 0
# elements would put every parameter in a bucket of its own in one framework and loop in another
# (the bucket walk never advances); a negative budget means nothing. None: the framework's default.
_MEGATRON_KNOBS = (("bucket_size", 1, "elements per DDP bucket; null: Megatron's default max(40M, 1M*dp)"),
                   ("make_vocab_size_divisible_by", 1, "the vocab is padded to a multiple of this times tp"))
_DEEPSPEED_KNOBS = (("reduce_bucket_size", 1, "elements per gradient bucket"),
                    ("allgather_bucket_size", 1, "elements per ZeRO-1/2 all-gather bucket"),
                    ("stage3_prefetch_bucket_size", 0, "elements prefetched ahead; 0: no prefetch"),
                    ("stage3_max_live_parameters", 0, "elements gathered at once"),
                    ("stage3_max_reuse_distance", 0, "elements of reuse window; 0: release after use"),
                    ("stage3_param_persistence_threshold", 0, "params of at most this many elements stay gathered"))


def _knob(fw_cfg, name: str):
    """A framework knob's value; None for a config without it (textbook mode needs none)."""
    try:
        return getattr(fw_cfg, name)
    except (AttributeError, KeyError):
        return None


def _check_knobs(fw_cfg, rules) -> None:
    for name, least, what in rules:
        v = _knob(fw_cfg, name)
        if v is not None and v < least:
            raise ConfigError(f"framework.{name}={v} must be >= {least} ({what})")
