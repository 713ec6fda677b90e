"""A parallel layout resolved to integers, and the validation every job passes before dispatch."""
from __future__ import annotations

from dataclasses import dataclass

from ledger import frameworks
from ledger.errors import ConfigError  # noqa: F401  (its home for every caller: ledger.layout.ConfigError)
from ledger.frozen import direct_init
from ledger.grid import Grid
from ledger.limits import MAX_MICRO_BATCHES, MAX_WORLD
from ledger.model import ModelShape


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


def resolve(layout_cfg, world: int | None = None, framework: str | None = None) -> Layout:
    """Fill dp = -1 from the cluster's world size, global_batch_size = -1 as micro*dp*pp, and an unset
    sequence_parallel with the framework's own default where tp > 1 (off without a framework)."""
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
    sp = lc["sequence_parallel"]
    if sp is None:
        sp = tp > 1 and framework is not None and frameworks.get(framework).default_sequence_parallel
    return Layout(tp, pp, dp, dpr, cp, ep, vp, bool(sp), mbs, gbs, etp)


def validate(model: ModelShape, lay: Layout, framework: str, fw_cfg=None, world: int | None = None) -> None:
    """Raise ConfigError naming the field and the rule; checked before anything is dispatched."""
    # each rule: `if not (rule): raise` (a search validates thousands of layouts; the message is
    # formatted only on failure)
    spec = frameworks.get(framework)  # a ConfigError for a framework no ledger registered
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
    # a framework that pads the vocab itself (Megatron: buffers.padded_vocab) or has its own rule for
    # it (torchtitan: rules.vocab_error) says so through its ledger
    if not (model.vocab % lay.tp == 0):
        why = spec.vocab_error(model, lay)
        if why is not None:
            raise ConfigError(why)
    if not (model.layers % (lay.pp * lay.vp) == 0 or spec.uneven_layers):
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
            or spec.other_head_width(model)):
        which = "kv_channels" if model.kv_channels else "qk_layernorm"
        raise ConfigError(f"{framework}: model.{which}={getattr(model, which)}: heads of another width than "
                          "hidden/heads and q/k norms are modelled for Megatron only (the plain Llama and "
                          "torchtitan's Llama have neither)")
    if not (not lay.sequence_parallel or lay.tp > 1):
        raise ConfigError("sequence_parallel=true needs tp > 1")
    if not (lay.world <= MAX_WORLD and lay.global_batch_size // (lay.micro_batch_size * lay.dp) <= MAX_MICRO_BATCHES):
        _too_large(lay)
    if world is not None:
        if not (lay.world == world):
            raise ConfigError(f"world size: tp*pp*dp*cp={lay.tp}*{lay.pp}*{lay.dp}*{lay.cp}={lay.world} "
                              f"!= cluster size {world} (cluster.nodes x cluster.ranks, on Slurm nodes x "
                              "tasks_per_node)")
    # the framework's own limits (ledger/faithful/<name>/rules.py validate_layout)
    spec.validate_layout(model, lay, fw_cfg)


def _too_large(lay: Layout) -> None:
    """The ledger/limits.py bound a layout is past, named with its numbers."""
    from ledger.limits import too_large

    why = (too_large(f"the layout's world tp*pp*dp*cp={lay.tp}*{lay.pp}*{lay.dp}*{lay.cp}", lay.world, MAX_WORLD, "GPUs")
           or too_large(f"micro-batches per step: layout.global_batch_size/(micro_batch_size*dp)={lay.global_batch_size}/"
                        f"({lay.micro_batch_size}*{lay.dp})", lay.global_batch_size // (lay.micro_batch_size * lay.dp),
                        MAX_MICRO_BATCHES))
    raise ConfigError(why)


def _validate_experts(model: ModelShape, lay: Layout, framework: str) -> None:
    """The MoE rules every framework shares, and which frameworks model MoE at all."""
    if not model.num_experts:
        which = "ep" if lay.ep > 1 else "etp"
        raise ConfigError(f"layout.{which}={getattr(lay, which)}: expert parallelism needs an MoE model "
                          "(model.num_experts > 0; e.g. model=tiny_moe)")
    frameworks.get(framework).validate_experts(model, lay)
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
