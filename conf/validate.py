"""One validation function per config group, run on every job before anything is dispatched.

The schema (conf/schema.py) checks keys and types; these check values: sizes >= 1, names from
their set, strings that reach generated scripts. Each raises ConfigError naming the field and the
rule (`model.hidden=-8 must be >= 1`). The layout's own rules (divisibility, framework limits) are
ledger.layout.resolve / validate, which run after these: they can then divide by any size.
"""
from __future__ import annotations

import os

import re

from ledger import frameworks
from ledger import limits
from ledger import target as targets
from ledger.checks import at_least as _at_least, at_most as _at_most, one_of as _one_of, positive as _positive
from ledger.layout import ConfigError

# a name that reaches file names, shell lines and Python source of generated scripts: data only
NAME_RE = re.compile(r"[A-Za-z0-9._-]+")

MODES = ("predict", "run", "dry", "plan")


def validate_name(field: str, v) -> None:
    if not isinstance(v, str) or not NAME_RE.fullmatch(v):
        raise ConfigError(f"{field}={v!r} must match {NAME_RE.pattern} (letters, digits, '.', '_', '-'): "
                          "it names files and appears in generated scripts")


def validate_model(m) -> None:
    validate_name("model.name", m.name)
    _at_least("model", m, ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len"), 1)
    _one_of("model", m, "norm", ("rmsnorm", "layernorm"))
    _positive("model", m, ("rope_theta", "norm_eps"))
    _at_least("model", m, ("num_experts", "moe_ffn_hidden", "moe_shared_expert_hidden", "kv_channels"), 0)
    _at_least("model", m, ("moe_layer_freq",), 1)
    _at_most("model", m, limits.MODEL)
    _one_of("model", m, "moe_router_dtype", (None, "fp32", "fp64"))
    if m.num_experts:
        if not 1 <= m.moe_router_topk <= m.num_experts:
            raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} must be between 1 and "
                              f"model.num_experts={m.num_experts}")
    elif m.moe_shared_expert_hidden or m.moe_ffn_hidden:
        which = "moe_shared_expert_hidden" if m.moe_shared_expert_hidden else "moe_ffn_hidden"
        raise ConfigError(f"model.{which}={m[which]} needs model.num_experts > 0 (a dense model has no experts)")


def validate_train(t) -> None:
    _at_least("train", t, ("steps",), 1)
    _at_least("train", t, ("lr",), 0)


def validate_cluster(c) -> None:
    _at_least("cluster", c, ("ranks", "nodes", "timeout_s", "time_min", "cpus_per_task"), 1)
    why = limits.too_large("cluster.ranks x cluster.nodes", c.ranks * c.nodes, limits.MAX_WORLD, "GPUs")
    if why:
        raise ConfigError(why)
    _at_least("cluster", c, ("signal_delay_s", "max_num_timeout"), 0)
    validate_name("cluster.name", c.name)
    _one_of("cluster", c, "kind", ("local", "slurm", "fake"))
    _one_of("cluster", c, "backend", ("gloo", "nccl", "fake"))
    _one_of("cluster", c, "device", ("cpu", "cuda", "fake"))
    validate_fake(c)
    if c.gpus_per_node is not None:
        _at_least("cluster", c, ("gpus_per_node",), 0)
    if c.gpu_memory_gb is not None:
        _positive("cluster", c, ("gpu_memory_gb",))
    if c.mem_gb is not None:  # sbatch --mem=0: all the memory of each node
        _at_least("cluster", c, ("mem_gb",), 0)
    if c.backend == "nccl" and c.device != "cuda":
        raise ConfigError(f"cluster.backend=nccl needs cluster.device=cuda (got {c.device!r})")
    validate_sbatch_values(c)


# what a value written into an `#SBATCH --opt=value` line (or handed to submitit, which writes one) may
# hold: Slurm's partition / account / qos names and constraint expressions (& | [ ] * for the latter);
# a newline, a quote, a space, `$` or `#` would end the directive or start another line
SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:+=@/%&|*\[\]-]+")
SBATCH_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
SBATCH_FIELDS = ("partition", "account", "qos", "constraint")


def validate_sbatch_values(c) -> None:
    """Every cluster value that reaches an #SBATCH line: the named fields, and additional_parameters
    (its keys become option names, its values option values); checked whatever the mode."""
    for n in SBATCH_FIELDS:
        v = c.get(n)
        if v is not None and not SBATCH_VALUE.fullmatch(str(v)):
            raise ConfigError(f"cluster.{n}={v!r}: a Slurm value may hold only letters, digits and "
                              "_ . , : + = @ / % & | * [ ] - (it is written into an #SBATCH line)")
    for k, v in (c.get("additional_parameters") or {}).items():
        if not SBATCH_NAME.fullmatch(str(k)):
            raise ConfigError(f"cluster.additional_parameters.{k}: an sbatch option name is letters, digits, _ and -")
        if not isinstance(v, bool) and v is not None and not SBATCH_VALUE.fullmatch(str(v)):
            raise ConfigError(f"cluster.additional_parameters.{k}={v!r}: a Slurm value may hold only letters, digits "
                              "and _ . , : + = @ / % & | * [ ] - (it is written into an #SBATCH line)")


def validate_fake(c) -> None:
    """cluster=fake is one thing (a fake process group, FakeTensorMode tensors): the three fields go
    together. The ranks' range is the layout's world, checked with it (fake_ranks_in_world)."""
    fake = [n for n in ("kind", "backend", "device") if c[n] == "fake"]
    if fake and len(fake) != 3:
        rest = ", ".join(f"cluster.{n}={c[n]!r}" for n in ("kind", "backend", "device") if c[n] != "fake")
        raise ConfigError(f"cluster.{fake[0]}='fake' needs cluster.kind, cluster.backend and cluster.device all "
                          f"'fake' (got {rest}): use cluster=fake")
    ranks = list(c.fake_ranks)
    if ranks and c.kind != "fake":
        raise ConfigError(f"cluster.fake_ranks={ranks} is for cluster.kind=fake only (got {c.kind!r})")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"cluster.fake_ranks has {r!r}: ranks are integers >= 0")
    dup = sorted({r for r in ranks if ranks.count(r) > 1})
    if dup:
        raise ConfigError(f"cluster.fake_ranks={ranks} lists rank {dup[0]} twice: each rank is materialised once")


def fake_ranks_in_world(c, world: int) -> None:
    """cluster.fake_ranks against the layout's world (after the layout is resolved)."""
    bad = [r for r in c.fake_ranks if r >= world]
    if bad:
        raise ConfigError(f"cluster.fake_ranks has {bad[0]}: the layout's world is {world} ranks (0..{world - 1})")


def fake_layout_supported(framework: str, lay, model=None) -> None:
    """What a framework cannot run on the fake world, refused before any rank starts (found by
    trying; the README lists what was run)."""
    if model is not None and model.num_experts:
        # every framework's token dispatch reads the router's token counts (Megatron's split sizes and
        # tokens_per_expert .cpu(), DeepSpeed's capacity, torchtitan's .tolist()): FakeTensors have no values
        raise ConfigError(f"model.num_experts={model.num_experts}: MoE does not run on cluster=fake (the token "
                          "dispatch reads the router's token counts, which FakeTensors do not have); predict it with "
                          "mode=predict, or run it on cluster=local_cpu")
    why = frameworks.get(framework).fake_error(lay)
    if why is not None:
        raise ConfigError(why)


def validate_framework(fw, mode: str = "run") -> None:
    if fw.name == "all" and mode != "plan":
        raise ConfigError(f"framework=all plans over the three frameworks: it needs mode=plan (got mode={mode!r})")
    _one_of("framework", fw, "name", (*frameworks.names(), "all"))
    _one_of("framework", fw, "precision", ("bf16", "fp32"))
    if fw.name != "all":
        frameworks.get(fw.name).validate_knobs(fw)  # ledger/faithful/<name>/rules.py


def validate_ledger(lc) -> None:
    _one_of("ledger", lc, "mode", ("faithful", "textbook"))


def validate_wandb(w) -> None:
    _one_of("wandb", w, "mode", ("offline", "online", "disabled"))
    for n in ("project", "entity", "group"):
        if w[n] is not None:
            validate_name(f"wandb.{n}", w[n])


def validate_probe(p) -> None:
    for n in ("comm_steps", "cuda_profile_steps"):
        for s in p[n]:
            if s < 0:
                raise ConfigError(f"probe.{n} has {s}: steps are numbered from 0")


def validate_plan(p, model, layout=None) -> None:
    """plan.* for mode=plan (ledger/plan.py reads them); model is validated first (seq_len >= 1)."""
    if p.gpus is None:
        raise ConfigError("plan.gpus is required for mode=plan (the GPUs to plan for, e.g. plan.gpus=1024)")
    if p.global_batch_tokens is None and (layout is None or layout.global_batch_size < 1):
        raise ConfigError("mode=plan needs the batch: set plan.global_batch_tokens (tokens per step) or "
                          "layout.global_batch_size (sequences per step)")
    _at_least("plan", p, ("gpus", "gpus_per_node", "top", "max_cp", "workers"), 1)
    why = limits.too_large("plan.gpus", p.gpus, limits.MAX_PLAN_GPUS)
    if why:
        raise ConfigError(why)
    _at_least("plan", p, ("sweep_top",), 0)
    _positive("plan", p, ("gpu_memory_gb", "memory_fraction"))
    if p.memory_fraction > 1:
        raise ConfigError(f"plan.memory_fraction={p.memory_fraction} must be <= 1 (a fraction)")
    if p.gpus_per_node < p.gpus and p.gpus % p.gpus_per_node:
        raise ConfigError(f"plan.gpus={p.gpus} must be a multiple of plan.gpus_per_node={p.gpus_per_node} "
                          "(whole nodes)")
    if p.global_batch_tokens is not None:
        _at_least("plan", p, ("global_batch_tokens",), 1)
        if p.global_batch_tokens % model.seq_len:
            raise ConfigError(f"plan.global_batch_tokens={p.global_batch_tokens} must be a multiple of "
                              f"model.seq_len={model.seq_len} (whole sequences per step)")
    for t in p.get("cp_comm_types") or []:
        if t not in ("p2p", "all_gather", "a2a"):
            raise ConfigError(f"plan.cp_comm_types has {t!r}: each must be one of p2p, all_gather, a2a (a2a+p2p "
                              "needs framework.hierarchical_context_parallel_sizes: set framework.cp_comm_type)")
    from ledger.faithful.titan.schedules import SCHEDULES

    for name in p.get("pipeline_schedules") or []:
        if name not in SCHEDULES:
            raise ConfigError(f"plan.pipeline_schedules has {name!r}: each must be one of {', '.join(SCHEDULES)} "
                              "(torchtitan's framework.pipeline_parallel_schedule)")
    for n, allowed in (("micro_batch_sizes", None), ("vps", None), ("zero_stages", (1, 2, 3)),
                       ("sequence_parallel", (False, True)), ("distributed_optimizer", (False, True)),
                       ("recompute", ("none", "selective", "full")), ("offload_optimizer", ("none", "cpu")),
                       ("offload_param", ("none", "cpu"))):
        vals = list(p[n])
        if not vals:
            raise ConfigError(f"plan.{n}=[] must list at least one value")
        for v in vals:
            if allowed is None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"plan.{n} has {v!r}: each must be an integer >= 1")
            if allowed is not None and v not in allowed:
                raise ConfigError(f"plan.{n} has {v!r}: each must be one of {', '.join(map(str, allowed))}")
    if not p.host_memory_gb > 0:
        raise ConfigError(f"plan.host_memory_gb={p.host_memory_gb} must be > 0 (host memory per GPU, decimal GB)")
    from ledger.plan import SORTS, WATCH_KEYS

    _one_of("plan", p, "sort", SORTS)
    plan_cluster(p.cluster)
    if p.name is not None:
        validate_name("plan.name", p.name)
    for i, w in enumerate(p.watch):
        bad = sorted(set(w) - set(WATCH_KEYS))
        if bad:
            raise ConfigError(f"plan.watch[{i}] has {', '.join(bad)}: its keys must be among {', '.join(WATCH_KEYS)}")


def plan_cluster(name: str) -> dict:
    """plan.cluster: the conf/cluster config a plan's ready sweep names; it must exist and run CUDA
    ranks (a plan is for GPUs: its sweep on a CPU cluster would start the plan's world on one
    machine). Returns its kind and device."""
    from omegaconf import OmegaConf

    if not re.fullmatch(r"[A-Za-z0-9_-]+", str(name)):
        raise ConfigError(f"plan.cluster={name!r} must name a file of conf/cluster (letters, digits, _ and -)")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster", f"{name}.yaml")
    if not os.path.exists(path):
        have = sorted(f[:-5] for f in os.listdir(os.path.dirname(path)) if f.endswith(".yaml"))
        raise ConfigError(f"plan.cluster={name!r}: no conf/cluster/{name}.yaml (there are {', '.join(have)})")
    c = OmegaConf.load(path)
    if c.get("device") != "cuda":
        raise ConfigError(f"plan.cluster={name!r} runs {c.get('device')!r} ranks: the ready sweep of a plan "
                          "needs a GPU cluster config (device: cuda), e.g. slurm_gpu_example or local_gpu")
    return {"kind": c.get("kind", "local"), "device": c.get("device")}


def validate_campaign(c) -> None:
    _one_of("campaign", c, "rerun", ("all", "failed", "none"))


def validate_config(cfg) -> None:
    """Every group's values; the first broken rule raises ConfigError naming its field."""
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode!r} must be one of {', '.join(MODES)}")
    validate_model(cfg.model)
    validate_framework(cfg.framework, cfg.mode)
    if cfg.mode == "plan":
        validate_plan(cfg.plan, cfg.model, cfg.layout)
    validate_cluster(cfg.cluster)
    targets.validate(cfg.mode, cfg.cluster)
    validate_train(cfg.train)
    validate_ledger(cfg.ledger)
    validate_wandb(cfg.wandb)
    validate_probe(cfg.probe)
    if cfg.probe.fsdp_mem_tracker and cfg.framework.name != "titan":
        raise ConfigError(f"probe.fsdp_mem_tracker=true needs framework=titan (torch's FSDPMemTracker tracks "
                          f"FSDP2 modules), not framework={cfg.framework.name}")
    if cfg.probe.fsdp_mem_tracker and cfg.cluster.kind == "fake":
        raise ConfigError("probe.fsdp_mem_tracker=true needs real tensors: not with cluster=fake")
    if "campaign" in cfg:
        validate_campaign(cfg.campaign)
    if "hardware" in cfg:
        validate_hardware(cfg.hardware)


def validate_hardware(hw) -> None:
    """hardware.*: the profile it names (or its file) with its overrides builds (ledger/timing)."""
    from ledger.timing import profile_of

    profile_of(hw)


def unknown_key(key: str) -> str | None:
    """Why a dotted override key names no field of the typed schema (None when it does, or when it is
    Hydra's own, or a group choice such as model=tiny). A framework knob is checked against every
    framework's knobs (the framework is chosen by another override; Hydra refuses a knob the chosen
    one lacks). A dict-valued field (cluster.additional_parameters) takes any key under it."""
    import dataclasses
    import typing

    from conf.schema import FRAMEWORK_SCHEMAS, JobConfig

    parts = key.split(".")
    if len(parts) < 2 or parts[0] == "hydra":
        return None
    groups = typing.get_type_hints(JobConfig)
    group = parts[0]
    if group not in groups:
        return f"{key}: {group!r} is not a config group (groups: {', '.join(sorted(groups))})"
    if group == "knobs":  # any framework's knob (launchers/job.py apply_knobs)
        knobs = {n for sc in FRAMEWORK_SCHEMAS.values() for n in typing.get_type_hints(sc)} - {"name"}
        if len(parts) != 2 or parts[1] not in knobs:
            return f"{key}: no framework has a knob {'.'.join(parts[1:])!r} (the knobs: {', '.join(sorted(knobs))})"
        return None
    schemas = FRAMEWORK_SCHEMAS.values() if group == "framework" else [groups[group]]
    if not all(dataclasses.is_dataclass(sc) for sc in schemas):
        return f"{key}: {group} is a value, with no fields"
    fields = {name: t for sc in schemas for name, t in typing.get_type_hints(sc).items()}
    name = parts[1]
    if name not in fields:
        return f"{key}: {group} has no field {name!r} (its fields: {', '.join(sorted(fields))})"
    if len(parts) > 2 and "dict" not in str(fields[name]).lower():
        return f"{key}: {group}.{name} has no fields of its own"
    return None


def wrong_type(key: str, values: list) -> str | None:
    """Why an override's value(s) (as Hydra's grammar parsed them) do not fit the typed field it names:
    an int field given 2.5 or "x", a float field given "x", a bool field given 1. None where they fit,
    or where the key is not a plain field (unknown_key speaks of those)."""
    import typing

    from conf.schema import FRAMEWORK_SCHEMAS, JobConfig

    parts = key.split(".")
    groups = typing.get_type_hints(JobConfig)
    if len(parts) != 2 or parts[0] not in groups or parts[0] == "knobs":
        return None
    schemas = FRAMEWORK_SCHEMAS.values() if parts[0] == "framework" else [groups[parts[0]]]
    hints = [typing.get_type_hints(sc).get(parts[1]) for sc in schemas if isinstance(sc, type)]
    hints = [h for h in hints if h is not None]
    if not hints:
        return None
    hint = hints[0]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args and optional else hint
    want = {int: "an integer", float: "a number", bool: "true or false"}.get(base)
    if want is None:
        return None
    for v in values:
        if v is None and optional:
            continue
        ok = (isinstance(v, bool) if base is bool else
              isinstance(v, int) and not isinstance(v, bool) if base is int else
              isinstance(v, (int, float)) and not isinstance(v, bool))
        if not ok:
            return f"{key}={v!r} must be {want}"
    return None

