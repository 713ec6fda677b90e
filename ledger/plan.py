"""The planner's search: every layout of a model on N GPUs that a framework can run, each predicted by
that framework's own ledger (ledger.parallel.predict), summarised as one row.

A search layer over the per-layout prediction, not a second ledger: a layout is refused exactly when
ledger.layout.validate or the faithful ledger raises its ConfigError, and refusals are counted by that
reason (numbers replaced by N) rather than dropped. The planner adds only what no ledger knows:

  * which group of each collective stays inside a node (`links`, from gpus_per_node and the rank
    grid's order tp, cp, dp, dp_replicate, pp; ledger/grid.py),
  * the pipeline bubble of the schedule, (pp - 1) / (vp * m) (Narayanan et al. 2021, 1F1B and
    interleaved; m = micro-batches per step),
  * a roofline step-time *estimate* (est_step_s; never a measurement), documented in estimate().

Peak memory: `peak_bytes` is the largest predicted peak within a step of any stage's
heaviest rank (RankState.peak: resident state + activations in flight + transient buffers + the
largest temporary), and a layout fits when it is within plan.memory_fraction x plan.gpu_memory_gb.
Where a framework's ledger predicts no peak for a layout, the resident state stands in and the row
says so (`peak_includes`). Recompute is enumerated (Space.recompute: none / selective / full, by each
framework's own knob: recompute_knobs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator, Optional

from ledger import frameworks
from ledger.units import peak_or_resident
from ledger.grid import DIMS, link_of, node_ranks
from ledger.layout import ConfigError, Layout, validate
from ledger.model import ModelShape, numel
from ledger.parallel import predict
from ledger.timing.collectives import network_lanes, network_rate

PEAK_INCLUDES = "predicted peak within a step: resident + activations in flight + transient buffers + temporaries"
RESIDENT_ONLY = "resident state only: this framework's ledger predicts no peak for this layout"
OVER_BUDGET = "resident state only: it alone exceeds the budget (the peak, at least as large, is not computed)"
OVER_BUDGET_STAGE = ("predicted peak of the stages computed: one stage's alone exceeds the budget (the other stages' "
                     "peaks, which cannot make the row fit, are not computed)")
RECOMPUTE_NOTE = ("recompute: enumerated as each framework names it (Megatron recompute_granularity selective / "
                  "full uniform 1 layer, torchtitan activation_checkpoint, DeepSpeed activation_checkpointing); "
                  "it lowers the peak's activations, and the step-time estimate charges its forward FLOPs again "
                  "(recompute_flops)")
RECOMPUTE = ("none", "selective", "full")
BOUND_NOTE = ("MoE rows: the peak with routing balanced (every expert T*topk/E rows); per_stage's peak_bound in "
              "plan.json is its range from the fewest to the most rows routed to one rank's experts")


def recompute_mode(framework: str, knobs) -> str:
    """The RECOMPUTE setting a framework's knobs (a row's knobs, or its whole config) name: the
    inverse of recompute_knobs (ledger/faithful/<name>/rules.py)."""
    return frameworks.get(framework).recompute_mode(knobs)


def recompute_knobs(framework: str, mode: str) -> dict | None:
    """The framework knobs of a recompute setting (None: the framework has no such setting), as the
    framework's rules name them (ledger/faithful/<name>/rules.py recompute_knobs)."""
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute {mode!r} must be one of {', '.join(RECOMPUTE)}")
    return frameworks.get(framework).recompute_knobs(mode)


FRAMEWORK_NAMES = frameworks.names()  # the registered ledgers, in their tables' order
# what a plan.watch entry may name: the framework, a layout field or a knob a row sets
WATCH_KEYS = ("framework", "tp", "pp", "vp", "cp", "dp", "dp_replicate", "ep", "micro_batch_size", "sequence_parallel",
              "global_batch_size", "zero_stage", "offload_optimizer", "offload_param", "decoder_first_pipeline_num_layers",
              "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
              "account_for_loss_in_pipeline_split")
SORTS = ("time", "peak", "wire")
# grid dims whose collectives a framework can overlap with compute (gradient reduction, FSDP/ZeRO
# gathers); TP, CP and PP traffic sits on the critical path of each layer / micro-batch
# the expert data parallel dim (MoE: the expert buckets' reduce-scatter / all-gather) is one of them:
# Megatron overlaps it as it does dp's
_DP_FAMILY = frozenset(("dp", "dp_replicate", "cp-dp", "cp-dp-dp_replicate", "dp-dp_replicate", "edp"))


class FrameworkView(dict):
    """A framework config as the ledgers read it (attribute access), built once per knob setting: an
    OmegaConf read costs microseconds and a search reads knobs for every layout."""

    __getattr__ = dict.__getitem__


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpus_per_node: int
    gpu_memory_bytes: int
    memory_fraction: float
    peak_tflops: float
    efficiency: float  # the fraction of peak_tflops the roofline's FLOPs run at (the profile's GEMM efficiency)
    nvlink_gbps: float  # Gb/s per GPU, one direction, inside a node
    network_gbps: float  # Gb/s per GPU, one direction, between nodes
    tp_across_nodes: bool = False
    # ledger/timing/hardware.py Profile: a fitting row's step time (step_time); None: the roofline only
    profile: object = None
    # the run the rows are predicted for (ledger/target.py); "": each framework's default (the CPU
    # harness's rules; Megatron's spec's). A cuda-nccl row's fit adds what a rank holds beside its
    # tensors (ledger/cuda.py)
    target: str = ""
    # host memory per GPU a row's host_bytes (ZeRO-Offload) must fit in (plan.host_memory_gb); 0: not checked
    host_memory_bytes: int = 0

    @property
    def budget_bytes(self) -> float:
        return self.memory_fraction * self.gpu_memory_bytes


@dataclass(frozen=True)
class Space:
    """What the enumerator varies besides the factorisation of the GPUs into tp x pp x cp x dp."""
    global_batch_size: int  # sequences per optimizer step (plan.global_batch_tokens / seq_len)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    vps: tuple[int, ...] = (1, 2)
    max_cp: int = 8
    zero_stages: tuple[int, ...] = (1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (False, True)
    hsdp: bool = True  # torchtitan: every dp_replicate that divides dp
    recompute: tuple[str, ...] = ("none",)  # RECOMPUTE settings tried (recompute_knobs)
    distributed_optimizer: tuple[bool, ...] = (False, True)  # Megatron's use_distributed_optimizer tried
    cp_comm_types: tuple[str, ...] = ()  # Megatron's cp_comm_type tried where cp > 1; () = as configured
    offload_optimizer: tuple[str, ...] = ("none",)  # DeepSpeed's ZeRO-Offload tried (where it models it)
    offload_param: tuple[str, ...] = ("none",)  # and ZeRO-3's parameter offload
    pipeline_schedules: tuple[str, ...] = ()  # torchtitan's schedules tried where pp > 1; () = rules.PLAN_SCHEDULES


@dataclass(slots=True)
class Candidate:
    framework: str
    lay: Layout
    knobs: dict  # the framework knobs this row sets (zero_stage, Megatron's split), for the sweep
    fw: Optional[FrameworkView]  # the whole framework config the ledger sees; None: refused by the planner itself
    refusal: Optional[str] = None  # the planner's own rule (tp across nodes), as a ConfigError message


@dataclass(slots=True)
class Row:
    framework: str
    layout: dict
    knobs: dict
    status: str  # fits | too_big | refused
    reason: Optional[str] = None
    peak_bytes: Optional[int] = None
    peak_includes: str = ""
    # cuda-nccl: the CUDA context, NCCL's and cuBLAS's buffers per rank (ledger/cuda.py), added to the peak
    # for the fit
    outside_allocator_bytes: int = 0
    target: str = ""  # the run the row is predicted for (ledger/target.py)
    basis: str = ""  # "from sources: ..." where no run here can confirm the row's prediction (Placement.basis)
    resident_bytes: Optional[int] = None
    host_bytes: int = 0  # of resident_bytes, what the framework keeps in host memory (ZeRO-Offload)
    state_bytes: dict = field(default_factory=dict)  # params / grads / optim / other of the most-loaded rank
    stage: Optional[int] = None  # pipeline stage of the most-loaded rank
    wire_bytes: dict = field(default_factory=dict)  # dim -> bytes one rank sends per optimizer step
    links: dict = field(default_factory=dict)  # dim -> intra | inter (node)
    bubble: Optional[float] = None
    est_step_s: Optional[float] = None
    est: dict = field(default_factory=dict)
    per_stage: Optional[list] = None  # the most-loaded rank of each stage (every predicted row)
    placement: object = None  # the ledger's Placement (not written out)

    @property
    def fits(self) -> bool:
        return self.status == "fits"

    def matches(self, want: dict) -> bool:
        """Whether this row has every key of `want` (a plan.watch entry) at its value."""
        for k, v in want.items():
            have = self.framework if k == "framework" else self.layout[k] if k in self.layout else self.knobs.get(k)
            if have != v:
                return False
        return True

    @property
    def wire_total(self) -> int:
        return sum(self.wire_bytes.values())

    def to_dict(self) -> dict:
        return {"framework": self.framework, "layout": self.layout, "knobs": self.knobs, "fits": self.fits,
                "status": self.status, "peak_bytes": self.peak_bytes, "peak_includes": self.peak_includes,
                "outside_allocator_bytes": self.outside_allocator_bytes, "target": self.target,
                **({"basis": self.basis} if self.basis else {}),
                "resident_bytes": self.resident_bytes, **({"host_bytes": self.host_bytes} if self.host_bytes else {}),
                "state_bytes": self.state_bytes, "stage": self.stage,
                "wire_bytes": self.wire_bytes, "links": self.links, "bubble": self.bubble,
                "est_step_s": self.est_step_s, "est": self.est, "reason": self.reason,
                "per_stage": self.per_stage}


# -- enumeration ------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def expert_degrees(model: ModelShape, framework: str, ranks_per_stage: int) -> list[int]:
    """The ep tried for a layout: every divisor of the experts that divides a stage's ranks (Megatron's
    expert grid: world / (etp * ep * pp) expert data parallel ranks, etp 1; DeepSpeed's expert groups
    over the DP ranks; torchtitan's EP over dp_shard, whose other rules its refusals name); 1 for a dense
    model."""
    if not model.num_experts:
        return [1]
    return [e for e in divisors(model.num_experts) if ranks_per_stage % e == 0]


def candidates(model: ModelShape, hw: Hardware, space: Space, framework: str, base: dict) -> Iterator[Candidate]:
    """Every layout of `framework` for the model on hw.gpus GPUs: tp x pp x cp x dp = gpus (tp inside a
    node unless hw.tp_across_nodes, pp up to the layers, cp up to space.max_cp), with vp, the
    Megatron splits, dp_replicate (torchtitan), zero_stage (DeepSpeed), micro-batch size and
    sequence parallelism. `base` is the framework's config (a plain dict) the varied knobs override."""
    G, N, gbs = hw.gpus_per_node, hw.gpus, space.global_batch_size
    rcs = [kn for kn in (recompute_knobs(framework, r) for r in space.recompute) if kn is not None]
    spec = frameworks.get(framework)
    if spec.plan_data_parallel_only:  # DeepSpeed ZeRO: every GPU a data-parallel rank or, with cp (Ulysses),
        # cp of them share each sequence; over its stages
        for cp in divisors(N):
            if cp > space.max_cp:
                break
            for kn0 in spec.plan_knob_sets(space, model, N // cp, cp):
                for rc in rcs:
                    kn = {**kn0, **rc}
                    fw = FrameworkView(base, **kn)
                    for mbs in space.micro_batch_sizes:
                        for ep in expert_degrees(model, framework, N):
                            yield Candidate(framework, Layout(1, 1, N // cp, 1, cp, ep, 1, False, mbs, gbs), kn, fw)
        return
    base = {**base, **spec.plan_chooses}
    fw_of: dict[tuple, FrameworkView] = {}
    for tp in divisors(N):
        across = tp > G or G % tp
        for pp in divisors(N // tp):
            if pp > model.layers:
                break
            for cp in divisors(N // (tp * pp)):
                if cp > space.max_cp:
                    break
                dp = N // (tp * pp * cp)
                dprs = divisors(dp) if spec.plan_hsdp and space.hsdp else [1]
                for vp in space.vps:
                    if vp > 1 and pp == 1:
                        continue  # interleaving is across stages: pp = 1 has no vp to choose
                    splits = spec.plan_splits(model.layers, pp, vp, space)
                    for kn0, split, rc in ((k0, s, r) for k0 in spec.plan_knob_sets(space, model, dp, cp) for s in splits for r in rcs):
                        kn = {**kn0, **split, **rc}
                        key = tuple(kn.items())
                        fw = fw_of.get(key)
                        if fw is None:
                            fw = fw_of[key] = FrameworkView(base, **kn)
                        for dpr, ep in ((d, e) for d in dprs for e in expert_degrees(model, framework, N // pp)):
                            for sp in (space.sequence_parallel if tp > 1 else (False,)):
                                for mbs in space.micro_batch_sizes:
                                    etp = spec.plan_expert_tp(tp, ep) if model.is_moe else 1
                                    lay = Layout(tp, pp, dp, dpr, cp, ep, vp, sp, mbs, gbs, etp)
                                    if across and not hw.tp_across_nodes:
                                        yield Candidate(framework, lay, kn, None,
                                                        f"plan: tp={tp} does not fit in one node of "
                                                        f"plan.gpus_per_node={G} GPUs (TP inside a node; "
                                                        "plan.tp_across_nodes=true allows it)")
                                    else:
                                        yield Candidate(framework, lay, kn, fw)


# -- one row ----------------------------------------------------------------------------------------

_NUM = re.compile(r"\d+")


def reason_key(message: str) -> str:
    """A refusal's reason without its numbers: the layouts one rule refuses count together."""
    return _NUM.sub("N", message)


def layout_dict(lay: Layout) -> dict:
    return {"tp": lay.tp, "pp": lay.pp, "vp": lay.vp, "cp": lay.cp, "dp": lay.dp, "dp_replicate": lay.dp_replicate,
            "ep": lay.ep, "etp": lay.etp, "micro_batch_size": lay.micro_batch_size,
            "sequence_parallel": lay.sequence_parallel, "global_batch_size": lay.global_batch_size}


def bubble(lay: Layout) -> float:
    """Pipeline bubble time over ideal compute time: (pp - 1) / (vp * m) for 1F1B and Megatron's
    interleaved schedule (Narayanan et al. 2021, eq. 1 and section 2.2.2); 0 without PP."""
    if lay.pp == 1:
        return 0.0
    return (lay.pp - 1) / (lay.vp * lay.num_microbatches)


def step_flops(model: ModelShape, lay: Layout) -> float:
    """Model FLOPs of one optimizer step: 6 per weight per token through the matmuls (forward 2,
    backward 4; the input embedding is a lookup, not counted) plus attention's scores and
    score x V, 12 * layers * seq * hidden per token (forward 4, backward 8; no causal saving)."""
    tokens = lay.global_batch_size * model.seq_len
    # an MoE token passes through its top-k experts only (ModelShape.active_params)
    matmul_params = model.active_params() - model.vocab * model.hidden * (0 if model.tied_embeddings else 1)
    return tokens * (6 * matmul_params + 12 * model.layers * model.seq_len * model.hidden)


def recompute_flops(model: ModelShape, lay: Layout, framework: str, fw) -> float:
    """The FLOPs recompute adds to a step (step_flops' terms, run again in backward): full recompute of
    every decoder layer (Megatron full, torchtitan FullAC, DeepSpeed's checkpointed layers) runs each
    layer's forward again, 2 per layer weight per token + attention's forward 4 * seq * hidden;
    selective recomputes attention's core only (Megatron core_attn; torchtitan's SelectiveAC op
    policy, whose CPU SDPA is not in its save list), its forward 4 * seq * hidden per layer per token.
    The output layer and the loss are not recomputed."""
    tokens = lay.global_batch_size * model.seq_len
    attn = 4 * model.layers * model.seq_len * model.hidden
    mode = recompute_mode(framework, fw)
    if mode == "full":
        # every decoder layer's weights a token passes through (the active ones of an MoE layer)
        layer_params = model.active_params() - sum(numel(s) for n, s in model.params()
                                                   if not n.startswith("layers."))
        return tokens * (2 * layer_params + attn)
    if mode == "selective":
        return tokens * attn
    return 0.0


def overlaps(framework: str, fw) -> bool:
    """Whether the framework overlaps its data-parallel collectives with compute as configured
    (ledger/faithful/<name>/rules.py overlaps: Megatron overlap_grad_reduce, DeepSpeed overlap_comm,
    torchtitan's FSDP2 always)."""
    return frameworks.get(framework).overlaps(fw)


def estimate(model: ModelShape, lay: Layout, hw: Hardware, framework: str, fw, wire: dict, links: dict,
             lanes: dict | None = None) -> dict:
    """A roofline step-time estimate, not a measurement:

        compute_s = (FLOPs per step + recompute's, recompute_flops) / (gpus x peak_tflops x efficiency) x (1 + bubble)
        comm_s[d] = wire bytes of dim d x 8 / (nvlink_gbps if its groups are inside a node else
                    network_gbps x the NICs its groups drive, lanes[d], at most nvlink_gbps) x 1e-9
                    (ledger/timing/collectives.py network_lanes and network_rate, the step-time model's rule)
        exposed   = TP, CP, PP and any other dim in full; the data-parallel dims (dp, dp_replicate,
                    cp-dp) beyond the compute time where the framework overlaps them (overlaps()),
                    in full where it does not
        est_step_s = compute_s + exposed

    wire bytes are the most-loaded rank's (ring algorithm, what one rank sends)."""
    flops = step_flops(model, lay) + recompute_flops(model, lay, framework, fw)
    compute = flops / (hw.gpus * hw.peak_tflops * 1e12 * hw.efficiency) * (1 + bubble(lay))
    ov = overlaps(framework, fw)
    dp_s = other_s = 0.0
    for d, b in wire.items():
        rate = hw.nvlink_gbps if links[d] == "intra" else network_rate(hw.network_gbps, (lanes or {}).get(d, 1),
                                                                       hw.nvlink_gbps)
        t = b * 8 / (rate * 1e9)
        if d in _DP_FAMILY:
            dp_s += t
        else:
            other_s += t
    exposed = other_s + (max(0.0, dp_s - compute) if ov else dp_s)
    return {"compute_s": compute, "dp_comm_s": dp_s, "other_comm_s": other_s, "exposed_comm_s": exposed,
            "overlap_dp": ov, "est_step_s": compute + exposed}


def evaluate(model: ModelShape, c: Candidate, hw: Hardware, mode: str = "faithful", watch=()) -> Row:
    """One candidate through validate + the ledger: a refused row with the ledger's reason, or the
    row of its prediction. A too-big row's stages are priced until one is over the budget, but where a
    `watch` entry matches it (every stage's peak: the plan prints them)."""
    lay = c.lay
    row = Row(c.framework, layout_dict(lay), c.knobs, "refused")
    if c.fw is None:
        row.reason = c.refusal
        return row
    try:
        validate(model, lay, c.framework, c.fw)
        why = frameworks.get(c.framework).dispatch_error(model, lay)
        if why is not None:
            # what the framework refuses to start (Megatron: MoE with tp > 1 and no SP) is refused here
            # as by launchers/job.py; the layout that it accepts is its own candidate
            raise ConfigError(why)
        pl = predict(model, lay, c.fw, mode, target=hw.target or None)
        g = pl.per_gpu
        comm = g.comm
    except ConfigError as e:
        row.reason = str(e)
        return row
    wire: dict[str, int] = {}
    kinds: dict[str, str] = {}
    for x in comm:
        if x.wire_bytes:
            wire[x.dim] = wire.get(x.dim, 0) + x.wire_bytes
            kinds.setdefault(x.dim, x.kind)
    links = {d: link_of(lay, d, kinds[d], hw.gpus_per_node) for d in wire}
    lanes = {d: network_lanes(kinds[d], node_ranks(lay, d, hw.gpus_per_node)) for d in wire}
    row.resident_bytes, row.host_bytes = g.resident_bytes, g.host_bytes
    res = g.resident_bytes - g.host_bytes  # the device's (ZeRO-Offload keeps host_bytes beside it)
    row.placement = pl
    row.target, row.basis = pl.target, pl.basis
    row.outside_allocator_bytes = sum(pl.outside_allocator.values())  # (cuda-nccl: ledger.parallel.predict)
    if res + row.outside_allocator_bytes > hw.budget_bytes:
        # the peak holds the resident state and more: a row whose state alone is over the budget is too
        # big whatever its peak, which is not computed (a search meets thousands; per_stage is most of a
        # predicted row's cost)
        return _over_budget(row, res, g, wire, links, lanes, lay, hw, model, c)
    # a stage over the budget settles the verdict: the other stages' peaks (most of a too-big row's cost in a
    # search) are priced only for a watched row
    room = None if any(row.matches(w) for w in watch) else hw.budget_bytes - row.outside_allocator_bytes
    try:
        row.per_stage = per_stage(row, room)
    except ConfigError as e:  # the peak model refuses what it does not model (e.g. a recompute setting)
        row.reason, row.placement = str(e), None
        return row
    row.peak_bytes = max(s["peak_bytes"] for s in row.per_stage)
    row.peak_includes = (OVER_BUDGET_STAGE if len(row.per_stage) < lay.pp else
                         PEAK_INCLUDES if all(s["peak_modelled"] for s in row.per_stage) else RESIDENT_ONLY)
    _state_and_estimate(row, g, wire, links, lanes, lay, hw, model, c)
    if hw.host_memory_bytes and row.host_bytes > hw.host_memory_bytes:
        row.status = "too_big"
        row.reason = (f"host memory {row.host_bytes / 1e9:.2f} GB (ZeRO-Offload) > plan.host_memory_gb = "
                      f"{hw.host_memory_bytes / 1e9:.2f} GB")
    elif row.peak_bytes + row.outside_allocator_bytes <= hw.budget_bytes:
        row.status = "fits"
        if hw.profile is not None and mode == "faithful":
            _step_time(model, lay, c, hw, row)
    else:
        row.status = "too_big"
        what = {PEAK_INCLUDES: "predicted peak", RESIDENT_ONLY: "resident state only"}.get(
            row.peak_includes, f"stage {max(row.per_stage, key=lambda s: s['peak_bytes'])['stage']}'s predicted peak; "
                               "the other stages not priced")
        beside = (f" + {row.outside_allocator_bytes / 1e9:.2f} GB beside the tensors"
                  if row.outside_allocator_bytes else "")
        row.reason = (f"peak {row.peak_bytes / 1e9:.2f} GB ({what}){beside} > plan.memory_fraction x "
                      f"plan.gpu_memory_gb = {hw.budget_bytes / 1e9:.2f} GB")
    return row


def _state_and_estimate(row: Row, g, wire: dict, links: dict, lanes: dict, lay: Layout, hw: Hardware,
                        model: ModelShape, c: Candidate) -> None:
    """A predicted row's most-loaded rank's state, its wire and links, and the roofline estimate."""
    row.state_bytes = {"params": g.params_bytes, "grads": g.grads_bytes, "optim": g.optim_bytes,
                       "other": g.other_bytes}
    row.stage = g.stage
    row.wire_bytes, row.links = wire, links
    row.bubble = bubble(lay)
    row.est = estimate(model, lay, hw, c.framework, c.fw, wire, links, lanes)
    row.est_step_s = row.est["est_step_s"]


def _over_budget(row: Row, res: int, g, wire: dict, links: dict, lanes: dict, lay: Layout, hw: Hardware,
                 model: ModelShape, c: Candidate) -> Row:
    """evaluate's row for a layout whose resident state (and what lies beside the tensors) alone exceeds
    the budget: too big, its peak (at least the state) not computed; peak_bytes the state, said so."""
    row.peak_bytes = res
    row.peak_includes = OVER_BUDGET
    _state_and_estimate(row, g, wire, links, lanes, lay, hw, model, c)
    row.status = "too_big"
    beside = f" + {row.outside_allocator_bytes / 1e9:.2f} GB beside the tensors" if row.outside_allocator_bytes else ""
    row.reason = (f"resident state {res / 1e9:.2f} GB{beside} > plan.memory_fraction x plan.gpu_memory_gb = "
                  f"{hw.budget_bytes / 1e9:.2f} GB (the peak, larger, not computed)")
    return row


def _step_time(model: ModelShape, lay: Layout, c: Candidate, hw: Hardware, row: Row) -> None:
    """A fitting row's time from the step-time model (ledger/timing/step.py) on hw.profile: its step,
    MFU, tokens/s/GPU and waterfall replace the roofline's estimate; where the model does not cover the
    layout (MoE) the roofline stays, said in est["model"]."""
    from ledger.timing.step import step_time

    spec = frameworks.get(c.framework)
    if spec.time_policy is None:
        row.est["model"] = f"roofline (the profile's peak x its GEMM efficiency): {c.framework} has no time policy"
        return
    st = step_time(model, lay, row.placement, spec.time_policy(c.fw, lay, hw.profile.device), hw.profile)
    row.est = {"model": "step time (ledger/timing)", "target": st.target, "est_step_s": st.step_s, "mfu": st.mfu,
               "tokens_per_s_per_gpu": st.tokens_per_s_per_gpu, "bubble_s": st.bubble_s,
               "exposed_s": st.exposed_s, "waterfall": [[k, v] for k, v in st.waterfall]}
    row.est_step_s = st.step_s


peak_of = peak_or_resident  # (ledger/units.py)


def per_stage(row: Row, room: int | None = None) -> list[dict]:
    """The rank of each pipeline stage with the highest predicted peak (peak_of), among the ranks the
    ledger names for the stage (Placement.stage_representatives: a handful per stage, the heaviest in
    resident state, which hold the largest buffers); per_stage_walk is the reference over every rank
    (test_plan: they agree). With `room` (the bytes the budget leaves the tensors), the stages are priced
    first and last stage first (the embedding, the most micro-batches in flight; the head) and no further
    once one's peak is over it: the rows of those priced, in stage order."""
    pl = row.placement
    pp = pl.layout["pp"]
    if pp == 1:  # one stage: the most-loaded rank is the layout's
        return [_stage_row(0, _rank_of(pl, pl.per_gpu), pl.per_gpu)]
    if pl.stage_representatives is None:
        return per_stage_walk(row)
    out = []
    for st in (0, pp - 1, *range(1, pp - 1)):
        best, best_rank = None, None
        for r in pl.stage_representatives(st):
            s = pl.rank_state(r)
            if best is None or peak_of(s) > peak_of(best):
                best, best_rank = s, r
        out.append(_stage_row(st, best_rank, best))
        if room is not None and out[-1]["peak_bytes"] > room:
            break
    return sorted(out, key=lambda s: s["stage"])


def _rank_of(pl, state) -> int:
    reps = pl.representatives if pl.representatives is not None else range(pl.world)
    return next(r for r in reps if pl.rank_state(r) is state)


def _stage_row(st: int, rank: int, s) -> dict:
    pk = s.peak
    return {"stage": st, "rank": rank, "peak_bytes": peak_of(s), "peak_modelled": pk is not None,
            # an MoE peak's range over the routing (Peak.bound), peak_bytes being the balanced case
            "peak_bound": list(pk.bound) if pk is not None and pk.bound is not None else None,
            "peak_parts": dict(pk.parts) if pk is not None else None, "peak_phase": pk.phase if pk is not None else None,
            "resident_bytes": s.resident_bytes,
            "params": s.params_bytes, "grads": s.grads_bytes, "optim": s.optim_bytes, "other": s.other_bytes}


def per_stage_walk(row: Row) -> list[dict]:
    """per_stage over every rank's state, each distinct one once (ranks of a stage are one contiguous
    block of the grid): the readable reference."""
    pl, lay = row.placement, row.placement.layout
    world, pp = pl.world, lay["pp"]
    per = world // pp
    out = []
    for st in range(pp):
        seen, best, best_rank = set(), None, None
        for r in range(st * per, (st + 1) * per):
            s = pl.rank_state(r)
            if id(s) in seen:
                continue
            seen.add(id(s))
            if best is None or peak_of(s) > peak_of(best):
                best, best_rank = s, r
        out.append(_stage_row(st, best_rank, best))
    return out


# -- the whole search -------------------------------------------------------------------------------

# refused layouts kept as rows (plan.json / plan.csv) beyond the watched ones: a GPU count with many
# divisors has millions of layouts, nearly all refused, each counted under its reason (Plan.refused)
REFUSED_ROWS = 10_000


@dataclass
class Plan:
    rows: list[Row]
    refused: dict  # framework -> reason key -> {"count": n, "example": message}
    counts: dict  # framework -> {"layouts", "fits", "too_big", "refused"}
    seconds: float = 0.0
    refused_unlisted: int = 0  # refused layouts counted but not kept as rows (REFUSED_ROWS)


def sort_key(sort: str):
    # ties broken by peak, then the layout itself, so the order is the same on every run
    if sort == "time":
        return lambda r: (r.est_step_s, r.peak_bytes, _tie(r))
    if sort == "peak":
        return lambda r: (r.peak_bytes, r.est_step_s, _tie(r))
    if sort == "wire":
        return lambda r: (r.wire_total, r.est_step_s, _tie(r))
    raise ValueError(f"plan.sort={sort!r} must be one of {', '.join(SORTS)}")


def _tie(r: Row) -> tuple:
    # knob values compared as text: recompute_granularity is None or a name
    return (r.framework, tuple(r.layout.values()), tuple(sorted((k, repr(v)) for k, v in r.knobs.items())))


# candidates a search's worker process evaluates at a time (plan.workers > 1)
WORKER_CHUNK = 64


def evaluated(model: ModelShape, hw: Hardware, space: Space, name: str, base: dict, mode: str, watch,
              workers: int = 1) -> Iterator[Row]:
    """evaluate over every candidate of one framework, in candidates' order: in this process, or (workers > 1)
    spread over that many forked processes a chunk of candidates at a time, each row coming back without
    its Placement (not written out; this process keeps none of theirs)."""
    if workers <= 1:
        for c in candidates(model, hw, space, name, base):
            yield evaluate(model, c, hw, mode, watch)
        return
    import multiprocessing

    global _FORKED
    # the candidates reach the forked processes as this module's state at the fork, not pickled
    _FORKED = (model, hw, mode, watch, list(candidates(model, hw, space, name, base)))
    chunks = [(i, min(i + WORKER_CHUNK, len(_FORKED[4]))) for i in range(0, len(_FORKED[4]), WORKER_CHUNK)]
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for rows in pool.imap(_evaluate_chunk, chunks):
                yield from rows
    finally:
        _FORKED = None


_FORKED = None  # (model, hw, mode, watch, candidates) while a search's worker processes run (evaluated)


def _evaluate_chunk(span: tuple[int, int]) -> list[Row]:
    model, hw, mode, watch, cands = _FORKED
    rows = [evaluate(model, c, hw, mode, watch) for c in cands[span[0]:span[1]]]
    for r in rows:
        r.placement = None
    return rows


def search(model: ModelShape, hw: Hardware, space: Space, frameworks: dict[str, dict], mode: str = "faithful",
           sort: str = "time", watch=(), refused_rows: int = REFUSED_ROWS, workers: int = 1) -> Plan:
    """Every candidate of every framework (frameworks: name -> its base config as a plain dict),
    evaluated (workers: in that many processes, `evaluated`), with its peak per stage; rows that the ledger
    predicts first in `sort` order (fitting ones ahead), then the refused ones: the first refused_rows of
    them and every one a `watch` entry matches (the others counted under their reasons alone)."""
    import time

    t0 = time.perf_counter()
    rows: list[Row] = []
    refused: dict = {}
    counts: dict = {}
    kept_refused = unlisted = 0
    for name, base in frameworks.items():
        n = {"layouts": 0, "fits": 0, "too_big": 0, "refused": 0}
        why = refused.setdefault(name, {})
        for r in evaluated(model, hw, space, name, base, mode, watch, workers):
            n["layouts"] += 1
            n[r.status] += 1
            if r.status == "refused":
                k = reason_key(r.reason)
                e = why.get(k)
                if e is None:
                    why[k] = {"count": 1, "example": r.reason}
                else:
                    e["count"] += 1
                if kept_refused >= refused_rows and not any(r.matches(w) for w in watch):
                    unlisted += 1
                    continue
                kept_refused += 1
            rows.append(r)
        counts[name] = n
    key = sort_key(sort)
    # fitting rows first, those judged on a predicted peak before those that fit on their resident state
    # only (no peak predicted: an unconfirmed fit), then by the sort key
    predicted = sorted((r for r in rows if r.status != "refused"),
                       key=lambda r: (not r.fits, r.peak_includes == RESIDENT_ONLY, key(r)))
    rest = [r for r in rows if r.status == "refused"]
    return Plan(predicted + rest, refused, counts, time.perf_counter() - t0, unlisted)
