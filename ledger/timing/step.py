"""A step's time per rank, composed from what the ledgers already predict — not a second model of the
step:

  compute     each stage's forward and backward of one micro-batch, op by op (ledger/timing/ops.py),
              the recompute's extra forward work where the framework recomputes (full: the layers'
              forward again; selective: the ops its policy names, TimePolicy.recompute_ops)
  TP / CP / EP  the collectives of those dims on a rank of the stage (the comm ledger's rows, per step,
              divided over its micro-batches), timed by ledger/timing/collectives.py on their link
              class and left exposed (no tp_comm_overlap / async TP modelled): a third in forward, two
              thirds in backward, as the calls split
  pipeline    the stages' forwards and backwards simulated in the framework's schedule
              (ledger/timing/pipeline.py) with one p2p transfer [s/tp if SP, b, h] per hop: the bubble
              comes out of the simulation; a zero-bubble order runs each backward as its input-grad
              half and its weight-grad GEMMs apart (TimePolicy.split_backward), the W with the recomputes of its
              blocks its framework names (TimePolicy.weight_recomputes: torch's W, one autograd.grad a param group)
  DP          the data-parallel dims' collectives (grad reduction, param gathers), hidden as the
              framework hides them (its TimePolicy, each rule citing its source): exposed in full,
              behind the last micro-batch's backward, or behind the compute of their own pass (FSDP2 /
              ZeRO-3 prefetch: a forward's gathers behind the forwards, a backward's gathers and
              reductions behind the backwards), but for the gathers that open a micro-batch's forward
              and the reductions that close its backward where the framework has such edges
              (TimePolicy.dp_edge_units: FSDP2's first and last units), exposed; while hidden, each
              holds the SMs NCCL runs it on
              (collectives.sms_taken) and the compute beside it runs on the rest: its seconds x those
              SMs' share of the device
  copies      what the framework runs on the compute stream around those collectives
              (TimePolicy.dp_copy_bytes: FSDP2's copy-in / copy-out, ZeRO's IPG bucket), memory-bound
              work in the passes: an all-gather's in the pass of its calls where the ledger says it
              (gather_forward_share: Comm.forward_buffer_bytes), else half in each (a layer gathers before
              its forward and, resharded, again before its backward), the rest in the backward; and
              where the weight-grad GEMMs do not accumulate in place, each micro-batch's backward adding
              its grads into the accumulated ones (TimePolicy.grad_accumulate_bytes)
  optimizer   the step's Adam over the rank's owned elements, memory-bound: a fused Adam reads fp32
              param, grad, exp_avg, exp_avg_sq and writes the three back and a bf16 param copy, 30 bytes
              an element (the policy's bytes: torchtitan's torch AdamW keeps no master copy)

The waterfall splits the step of the critical stage (the stage with the most work) into: the model
FLOPs of its ops at the peak, the GEMM / attention kernels' efficiency below it, the memory-bound ops,
the recompute, the copies around the DP collectives, the grads' accumulation, each dim's exposed
collectives, the SMs the hidden ones hold, the pipeline bubble and the optimizer step; the terms
add up to the step. MFU counts the model FLOPs as Megatron and torchtitan report them (6 per weight per
token through the matmuls + 12 layers seq hidden per token for attention, no causal saving; recompute
not counted) over world x peak x step."""
from __future__ import annotations

from dataclasses import dataclass, field

from ledger.dtypes import nbytes
from ledger.grid import group_size
from ledger.layout import Layout
from ledger.model import ModelShape, numel
from ledger.timing import collectives, ops
from ledger.timing.hardware import Profile
from ledger.timing.pipeline import W as WEIGHT_HALF, simulate, step_seconds, virtual_stage

# the data-parallel family of dims (the grad reductions and the param gathers of DDP, the distributed
# optimizer, FSDP2, ZeRO); ledger/plan.py's as well
DP_DIMS = frozenset(("dp", "dp_replicate", "cp-dp", "cp-dp-dp_replicate", "dp-dp_replicate", "edp", "tp-dp",
                     "tp-dp-pp", "tp-cp-dp", "tp-cp-dp-pp", "tp-dp-dp_replicate-pp"))
GRAD_KINDS = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class TimePolicy:
    """How a framework runs a step, as its time module reads it from its knobs (each field's source
    is in that module)."""
    # none | pipeline.ORDERS (the pipeline's order; pipeline.order) | v (torch's V schedules, two chunks a stage
    # placed as a V: pipeline.virtual_stage; their own order in pipeline_order)
    schedule: str = "1f1b"
    # the framework's own order where it differs from the named one's: (pp, vp, stage, m) -> [(kind,
    # micro-batch, chunk)] (torch's Interleaved1F1B where the micro-batches are no multiple of pp; a
    # zero-bubble order's I and W halves: pipeline.py)
    pipeline_order: object = None
    # the order splits each backward into its input-grad half and its weight-grad half (pipeline.py's I and W):
    # W the backward's weight-grad GEMMs (ops.backward_of's .wgrad), I the rest
    split_backward: bool = False
    # of a split backward's W, how many times it re-runs each recomputing layer's forward beyond its I's recompute
    # (torch pipelining's W runs one autograd.grad a param group, a checkpointed block recomputing in each: the
    # framework's time module)
    weight_recomputes: int = 0
    recompute: str = "none"  # none | selective | full
    causal_kernel: bool = True  # attention skips the masked blocks (flash / cuDNN / TE fused)
    attention_kernel: str = "flash2"  # the kernel that runs attention (hardware.ATTENTION_KERNELS)
    # what selective recompute re-runs in backward: the names of a layer's forward ops (ops.layer_forward)
    recompute_ops: tuple = ("attention",)
    # the layers that recompute: every one (1), or every N-th of the model's layers counted from 1 (layer
    # index i + 1 divisible by N: torchtitan's per-layer selective checkpointing, its steptime.py)
    recompute_every: int = 1
    split_projections: bool = False  # wq wk wv, w1 w3 as separate linears (ops.Shard)
    fused_qkv: bool = False  # of those, q k v as one wqkv linear split into copies (ops.Shard)
    repeat_kv: bool = False  # the model repeats GQA's K / V to the query heads (ops.Shard)
    kernel_bytes: tuple = ()  # memory-bound op -> (forward, backward) bytes per element (ops.Shard)
    expert_capacity_factor: float = 1.0  # a capacity-padded MoE dispatch (ops.Shard); 1: balanced, drop-less
    expert_min_capacity: int = 0
    dp_grad: str = "exposed"  # exposed | last_backward | every_pass
    dp_param: str = "exposed"  # exposed | first_forward | every_pass
    optimizer_state_bytes: int = 12  # the optimizer's state bytes per element it updates
    optimizer_traffic_bytes: int = 30  # bytes its step reads and writes per element
    # the CP ring's K/V exchanges (cp send_recv) run behind the attention kernels (TE's p2p: each
    # step's next exchange is issued before its attention runs): exposed only where longer
    cp_ring_behind_attention: bool = False
    # the copies the framework runs on the compute stream around its data-parallel collectives:
    # (kind, bytes moved per byte of the collective's buffer, Comm.buffer_bytes), each at the memory's
    # bandwidth (FSDP2's copy-out after every all-gather, copy-in before every reduce-scatter: its
    # steptime.py); empty where the collectives run on the parameters' and gradients' own buffers
    dp_copy_bytes: tuple = ()
    # FSDP-style sharding's edges: the units whose gathers open each micro-batch's forward before any compute
    # runs, and those whose reductions close its backward after the last (the framework's time module names
    # them, in the order they run: "embedding" the token embedding, "head" the final norm and an untied output
    # projection, "layer" the first decoder layer): exposed, whatever the passes' compute could hide
    # (dp_edge_seconds); (gathered first, reduced last), empty where the framework has no such edges modelled
    dp_edge_units: tuple = ((), ())
    # each micro-batch's backward adds its weight grads into the accumulated ones where the weight-grad
    # GEMM does not accumulate in place: bytes moved per byte of the rank's parameters (RankState.
    # params_bytes), at the memory's bandwidth; grad_accumulate_first: the first micro-batch adds too
    # (into a zeroed buffer) rather than assigning
    grad_accumulate_bytes: float = 0.0
    grad_accumulate_first: bool = True
    # the optimizer step runs on the host (DeepSpeed's ZeRO-Offload), at its memory's rate
    # (Profile.host_memory_gbps), and the step moves offload_link_bytes per element it updates over the host
    # link (Profile.host_link_gbps) on the compute stream, exposed
    host_optimizer: bool = False
    offload_link_bytes: float = 0.0
    # parameters offloaded to the host (ZeRO-3's offload_param): bytes over the host link per byte of the
    # data-parallel all-gathers' buffers (each gather copies its partitions to the device first), exposed
    param_gather_host_bytes: float = 0.0
    sources: tuple = ()


def host_rates(hw: Profile) -> tuple[float, float]:
    """(host memory GB/s, host link GB/s each way) an offloading rank's optimizer and copies run at: the profile's;
    on a CPU profile the host is the device (its memory; a copy "over the link" reads and writes it: half its
    rate)."""
    if hw.device == "cpu":
        return hw.hbm_gbps, hw.hbm_gbps * hw.memory_efficiency / 2
    if not (hw.host_link_gbps > 0 and hw.host_memory_gbps > 0):
        from ledger.layout import ConfigError
        raise ConfigError(f"hardware={hw.name}: ZeRO-Offload's time needs the host's rates "
                          "(hardware.host_link_gbps, hardware.host_memory_gbps)")
    return hw.host_memory_gbps, hw.host_link_gbps


@dataclass
class StepTime:
    target: str
    step_s: float
    forward_s: float  # the critical stage's forwards (compute and exposed TP), per step
    backward_s: float
    optimizer_s: float
    bubble_s: float
    exposed_s: dict  # dim -> exposed seconds per step
    comm_s: dict  # dim -> total seconds per step (exposed or not)
    tokens_per_s_per_gpu: float
    mfu: float
    waterfall: list  # [(term, seconds)], adding up to step_s
    notes: list = field(default_factory=list)
    simulation: object = None

    def to_dict(self) -> dict:
        return {"target": self.target, "step_s": self.step_s, "forward_s": self.forward_s,
                "backward_s": self.backward_s, "optimizer_s": self.optimizer_s, "bubble_s": self.bubble_s,
                "exposed_s": self.exposed_s, "comm_s": self.comm_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "waterfall": [[k, v] for k, v in self.waterfall], "notes": list(self.notes)}


def model_flops(model: ModelShape, lay: Layout) -> float:
    """Model FLOPs of one optimizer step (the module docstring's count)."""
    tokens = lay.global_batch_size * model.seq_len
    matmul_params = model.active_params() - model.vocab * model.hidden * (0 if model.tied_embeddings else 1)
    return tokens * (6 * matmul_params + 12 * model.layers * model.seq_len * model.hidden)


def shard_of(model: ModelShape, lay: Layout, policy: TimePolicy, w: int = 2) -> ops.Shard:
    return ops.Shard(hidden=model.hidden, ffn=model.ffn_hidden, heads=model.heads, kv_heads=model.kv_heads,
                     head_dim=model.head_dim, vocab=model.vocab, seq=model.seq_len // lay.cp,
                     micro_batch=lay.micro_batch_size, tp=lay.tp, sp=bool(lay.sequence_parallel) and lay.tp > 1,
                     causal_kernel=policy.causal_kernel, w=w, swiglu=model.swiglu, cp=lay.cp,
                     attention_kernel=policy.attention_kernel, split_projections=policy.split_projections,
                     fused_qkv=policy.fused_qkv,
                     repeat_kv=policy.repeat_kv, kernel_bytes=policy.kernel_bytes,
                     num_experts=model.num_experts, topk=model.moe_router_topk if model.is_moe else 0,
                     expert_ffn=model.expert_ffn, shared_ffn=model.moe_shared_expert_hidden, ep=lay.ep, etp=lay.etp,
                     capacity_factor=policy.expert_capacity_factor, min_capacity=policy.expert_min_capacity)


def gather_forward_share(c) -> float:
    """The share of an all-gather row's bytes (Comm) its forward passes run: as the ledger says where it says
    which pass each call runs in (Comm.forward_buffer_bytes: torchtitan's FSDP2, whose units without
    resharding after forward gather once, in the forward), else half: FSDP2 resharding after forward and
    ZeRO-3 gather each unit again for its backward."""
    if c.forward_buffer_bytes is None or not c.buffer_bytes:
        return 0.5
    return c.forward_buffer_bytes / c.buffer_bytes


def dp_copy_seconds(rows, policy: TimePolicy, hw: Profile) -> tuple[float, float]:
    """(forward, backward) seconds per step of the copies around a rank's data-parallel collectives
    (rows: its (Comm, seconds)), at the memory's bandwidth, a kernel's fixed cost per call (module
    docstring: an all-gather's copies in the pass of its calls, gather_forward_share; the rest in the
    backward)."""
    per_byte = dict(policy.dp_copy_bytes)
    fwd = bwd = 0.0
    for c, _sec in rows:
        if c.dim in DP_DIMS and c.kind in per_byte:
            t = (per_byte[c.kind] * c.buffer_bytes / (hw.hbm_gbps * 1e9 * hw.memory_efficiency)
                 + c.count * hw.kernel_overhead_s)
            if c.kind == "all_gather":
                share = gather_forward_share(c)
                fwd, bwd = fwd + t * share, bwd + t * (1.0 - share)
            else:
                bwd += t
    return fwd, bwd


def edge_unit_params(model: ModelShape, unit: str) -> int:
    """The parameters of one edge unit (TimePolicy.dp_edge_units), as the model lists them."""
    if unit == "embedding":
        return model.vocab * model.hidden
    if unit == "head":
        return (sum(numel(shape) for _, shape in model.norm_params("norm"))
                + (0 if model.tied_embeddings else model.vocab * model.hidden))
    if unit == "layer":
        return model.layer_num_params(0)
    raise ValueError(f"dp edge unit {unit!r}: known embedding, head, layer")


def dp_edge_seconds(rows, model: ModelShape, policy: TimePolicy, m: int, groups: dict) -> tuple[float, float]:
    """(reduction, gather) seconds per step of the data-parallel collectives at the passes' edges
    (TimePolicy.dp_edge_units): on each data-parallel all-gather row the first units' bytes in its dtype, on
    each reduce-scatter row the last units', one call a unit a micro-batch on the row's group and link
    (collectives.seconds), at most the row's own seconds."""
    gathered, reduced = policy.dp_edge_units
    grad = param = 0.0
    for c, sec in rows:
        units = {"all_gather": gathered, "reduce_scatter": reduced}.get(c.kind, ()) if c.dim in DP_DIMS else ()
        if not units or sec <= 0:
            continue
        n, link = groups[c.dim, c.kind]
        edge_bytes = m * sum(edge_unit_params(model, u) for u in units) * nbytes(c.dtype)
        t = min(sec, collectives.seconds(c.kind, edge_bytes, n, link, calls=m * len(units)))
        if c.kind == "all_gather":
            param += t
        else:
            grad += t
    return grad, param


def _stage_of_rank(lay: Layout, stage: int) -> int:
    """A rank of pipeline stage `stage` (pp is the outermost grid dim)."""
    return stage * (lay.world // lay.pp)


def step_time(model: ModelShape, lay: Layout, placement, policy: TimePolicy, hw: Profile,
              trace: bool = False) -> StepTime:
    """The step (module docstring). placement: the ledger's prediction of this layout (its ranks' comm
    rows and states). trace: keep the simulated schedule's tasks (StepTime.simulation, the Chrome
    trace's lanes); without it the pipeline's step comes from pipeline.step_seconds (the planner's)."""
    m = lay.num_microbatches
    vp = lay.vp if policy.schedule in ("interleaved", "looped_bfs", "v") else 1  # the orders of several chunks a stage
    style = "v" if policy.schedule == "v" else "loop"  # how the chunks place as virtual stages
    sh = shard_of(model, lay, policy)
    head_f = ops.head_forward(sh)
    head_b = ops.backward_of(head_f)
    # a layer's ops by its kind: dense, and MoE where the model has experts (ModelShape.is_moe_layer)
    fwd_of = {"dense": ops.layer_forward(sh)}
    if model.is_moe:
        fwd_of["moe"] = ops.moe_layer_forward(sh)
    bwd_of = {k: ops.backward_of(v) for k, v in fwd_of.items()}
    rc_of = {k: {"full": v, "selective": [o for o in v if o.name in policy.recompute_ops]}.get(policy.recompute, [])
             for k, v in fwd_of.items()}
    per_chunk = model.layers // (lay.pp * vp)
    extra = model.layers - per_chunk * lay.pp * vp  # the remainder on the last virtual stage

    last_v = lay.pp * vp - 1

    def chunk_layers(stage: int, chunk: int) -> int:
        return per_chunk + (extra if has_head(stage, chunk) else 0)

    def chunk_kinds(stage: int, chunk: int, every: int = 1) -> dict:
        """The chunk's layers by kind: its virtual stage (pipeline.virtual_stage) holds the per_chunk layers
        from its index on (the last one the remainder too). every: of them only those whose index + 1 it
        divides (the layers that recompute, TimePolicy.recompute_every)."""
        first = virtual_stage(lay.pp, stage, chunk, style) * per_chunk
        layers = [i for i in range(first, first + chunk_layers(stage, chunk)) if (i + 1) % every == 0]
        moe = sum(model.is_moe_layer(i) for i in layers) if model.is_moe else 0
        return {"dense": len(layers) - moe, "moe": moe}

    def has_head(stage, chunk):
        return virtual_stage(lay.pp, stage, chunk, style) == last_v

    f_layer = {k: ops.seconds(v, hw) for k, v in fwd_of.items()}
    b_layer = {k: ops.seconds(bwd_of[k], hw) for k in fwd_of}
    r_layer = {k: ops.seconds(rc_of[k], hw) for k in fwd_of}
    kinds = {(st, c): chunk_kinds(st, c) for st in range(lay.pp) for c in range(vp)}
    recomputed = {(st, c): chunk_kinds(st, c, policy.recompute_every) for st in range(lay.pp) for c in range(vp)}
    f_head, b_head = ops.seconds(head_f, hw), ops.seconds(head_b, hw)

    # each stage's collectives (a rank of it), timed: (comm, seconds) rows, the pipeline's p2p aside; a
    # group's size and link worked out once per (dim, kind), which the stages' rows repeat
    groups: dict = {}

    def timed(c) -> float:
        g = groups.get((c.dim, c.kind))
        if g is None:
            g = groups[c.dim, c.kind] = (group_size(lay, c.dim), collectives.group_link(hw, lay, c.dim, c.kind))
        return collectives.comm_seconds(c, *g)

    stage_rows = [[(c, timed(c)) for c in placement.rank_state(_stage_of_rank(lay, s)).comm if c.dim != "pp"]
                  for s in range(lay.pp)]
    # TP / CP / EP: per micro-batch, exposed inside the stage's forwards and backwards (over its chunks);
    # the CP ring beyond its stage's attention kernels where the policy hides it behind them
    def cp_hidden(stage: int, rows, attn_layer: dict) -> float:
        """The stage's CP ring seconds per step that its attention kernels (a layer's, by kind) hide."""
        ring = sum(t for c, t in rows if c.dim == "cp" and c.kind == "send_recv")
        attn = m * sum(n * attn_layer[k] for c in range(vp) for k, n in kinds[stage, c].items() if n)
        return min(ring, attn)

    if policy.cp_ring_behind_attention:
        attn_layer = {k: ops.seconds([o for o in v + bwd_of[k] if o.kind == "attention"], hw) for k, v in fwd_of.items()}
        hidden_cp = [cp_hidden(s, rows, attn_layer) for s, rows in enumerate(stage_rows)]
    else:
        hidden_cp = [0.0] * lay.pp
    per_mb_tp = [(sum(t for c, t in rows if c.dim not in DP_DIMS) - hidden_cp[s]) / m
                 for s, rows in enumerate(stage_rows)]
    copies = [dp_copy_seconds(rows, policy, hw) for rows in stage_rows]  # (forward, backward) per step
    # the weight grads' accumulation per micro-batch on each stage (TimePolicy.grad_accumulate_bytes), per
    # step: the stage's rank's params, m additions (m - 1 where the first assigns)
    adds = (m if policy.grad_accumulate_first else m - 1) if policy.grad_accumulate_bytes else 0
    accumulate = [adds * policy.grad_accumulate_bytes * placement.rank_state(_stage_of_rank(lay, s)).params_bytes
                  / (hw.hbm_gbps * 1e9 * hw.memory_efficiency) for s in range(lay.pp)]

    def fwd_s(stage, chunk):
        return (sum(n * f_layer[k] for k, n in kinds[stage, chunk].items() if n) + (f_head if has_head(stage, chunk) else 0.0)
                + per_mb_tp[stage] / 3 / vp + copies[stage][0] / m / vp)

    def bwd_s(stage, chunk):
        return (sum(n * b_layer[k] for k, n in kinds[stage, chunk].items() if n)
                + sum(n * r_layer[k] for k, n in recomputed[stage, chunk].items() if n)
                + (b_head if has_head(stage, chunk) else 0.0) + 2 * per_mb_tp[stage] / 3 / vp
                + (copies[stage][1] + accumulate[stage]) / m / vp)

    wgt_s = w_extra = None
    if policy.split_backward and policy.weight_recomputes:
        def w_extra(stage, chunk):  # a W's recomputes beyond its half of the backward (TimePolicy.weight_recomputes)
            return policy.weight_recomputes * sum(n * r_layer[k] for k, n in recomputed[stage, chunk].items() if n)
    if policy.split_backward:  # a zero-bubble order's W: the chunk's weight-grad GEMMs (TimePolicy.split_backward)
        w_layer = {k: ops.seconds([o for o in v if o.name.endswith(".wgrad")], hw) for k, v in bwd_of.items()}
        w_head = ops.seconds([o for o in head_b if o.name.endswith(".wgrad")], hw)

        def wgt_s(stage, chunk):
            return (sum(n * w_layer[k] for k, n in kinds[stage, chunk].items() if n)
                    + (w_head if has_head(stage, chunk) else 0.0))

    e_p = sh.w * sh.micro_batch * sh.seq * model.hidden // (lay.tp if sh.sp else 1)
    p2p = 0.0
    if lay.pp > 1:
        lk = collectives.group_link(hw, lay, "pp", "send_recv")
        p2p = collectives.seconds("send_recv", e_p, 2, lk)
    order = policy.pipeline_order or policy.schedule
    sim = simulate(lay.pp, vp, m, fwd_s, bwd_s, p2p, order, wgt_s, style, w_extra) if trace else None
    pipe_s = sim.step_s if trace else step_seconds(lay.pp, vp, m, fwd_s, bwd_s, p2p, order, wgt_s, style, w_extra)

    def per_mb(s):  # (forward, backward) of one micro-batch on stage s, its chunks together
        return sum(fwd_s(s, c) for c in range(vp)), sum(bwd_s(s, c) for c in range(vp))
    crit = max(range(lay.pp), key=lambda s: sum(per_mb(s)))  # the critical stage: the most work

    # DP on the critical stage, hidden as the framework hides it: behind the first micro-batch's
    # forward, the last one's backward, or every pass
    dp_exposed = {}
    first_f, last_b = per_mb(crit)
    # a W's recomputes beyond the backward (w_extra), on the critical stage: each chunk's W tasks in the order (virtual
    # stage 0's are whole backwards: pipeline._durations)
    w_more = 0.0
    if w_extra is not None:
        ws = [c for kind, _mb, c in order(lay.pp, vp, crit, m) if kind == WEIGHT_HALF]
        w_more = sum(w_extra(crit, c) for c in ws if virtual_stage(lay.pp, crit, c, style))
    busy_f, busy_b = m * first_f, m * last_b + w_more
    grad_t, param_t = {}, {}
    p_fwd = 0.0  # of the gathers' seconds, the forwards' (gather_forward_share)
    comm_s: dict[str, float] = {}
    for c, sec in stage_rows[crit]:
        comm_s[c.dim] = comm_s.get(c.dim, 0.0) + sec
        if c.dim in DP_DIMS:
            into = grad_t if c.kind in GRAD_KINDS else param_t
            into[c.dim] = into.get(c.dim, 0.0) + sec
            if c.kind not in GRAD_KINDS:
                p_fwd += sec * gather_forward_share(c)
    g_all, p_all = sum(grad_t.values()), sum(param_t.values())
    if policy.dp_grad == policy.dp_param == "every_pass":
        # FSDP2 / ZeRO-3: each pass's collectives behind that pass's compute, a forward's gathers behind the
        # forwards, a backward's gathers and reductions behind the backwards (the prefetch runs one unit ahead
        # inside its pass: nothing of one pass hides behind the other's), each gather in the pass of its calls
        # (gather_forward_share, as its copies: dp_copy_seconds); those at the passes' edges
        # (TimePolicy.dp_edge_units: the forward's first gathers, the backward's last reductions) beside no compute
        edge_g, edge_p = dp_edge_seconds(stage_rows[crit], model, policy, m, groups)
        rest_g, rest_pf, rest_pb = g_all - edge_g, max(0.0, p_fwd - edge_p), p_all - p_fwd
        over_f = max(0.0, rest_pf - busy_f)
        over_b = max(0.0, rest_pb + rest_g - busy_b)
        share_g = rest_g / (rest_g + rest_pb) if over_b else 0.0
        g_exp, p_exp = edge_g + over_b * share_g, edge_p + over_f + over_b * (1.0 - share_g)
    else:
        hidden_g = {"exposed": 0.0, "last_backward": last_b, "every_pass": busy_b}[policy.dp_grad]
        hidden_p = {"exposed": 0.0, "first_forward": first_f, "every_pass": busy_f}[policy.dp_param]
        g_exp = max(0.0, g_all - hidden_g)
        p_exp = max(0.0, p_all - hidden_p)
    for part, total, exp in ((grad_t, g_all, g_exp), (param_t, p_all, p_exp)):  # each dim its share
        for d, t in part.items():
            dp_exposed[d] = dp_exposed.get(d, 0.0) + (exp * t / total if total else 0.0)
    # the compute a hidden collective slows: its SMs are NCCL's while it runs (collectives.sms_taken), so
    # the kernels beside it run on the others' share
    hidden_share = {part: (1.0 - exp / total if total else 0.0)
                    for part, total, exp in (("grad", g_all, g_exp), ("param", p_all, p_exp))}
    sm_s = sum(sec * hidden_share["grad" if c.kind in GRAD_KINDS else "param"]
               * collectives.sms_taken(groups[c.dim, c.kind][1], hw) / hw.sms
               for c, sec in stage_rows[crit] if c.dim in DP_DIMS and sec > 0) if hw.sms else 0.0

    st = placement.rank_state(_stage_of_rank(lay, crit))
    elements = st.optim_bytes / policy.optimizer_state_bytes
    offloaded = policy.host_optimizer or policy.param_gather_host_bytes > 0
    host_gbps, link_gbps = host_rates(hw) if offloaded else (0.0, 0.0)
    memory_gbps = host_gbps if policy.host_optimizer else hw.hbm_gbps
    opt_s = elements * policy.optimizer_traffic_bytes / (memory_gbps * 1e9 * hw.memory_efficiency) + hw.kernel_overhead_s
    link_bytes = elements * policy.offload_link_bytes + policy.param_gather_host_bytes * sum(
        c.buffer_bytes for c, _ in stage_rows[crit] if c.dim in DP_DIMS and c.kind == "all_gather")
    host_s = link_bytes / (link_gbps * 1e9) if offloaded else 0.0
    step = pipe_s + g_exp + p_exp + opt_s + sm_s + host_s

    # the waterfall of the critical stage: its layers' and head's ops by kind (one layer's, times its
    # layers), the recompute's
    n_kind = {k: sum(kinds[crit, c][k] for c in range(vp)) for k in fwd_of}
    n_recomputed = {k: sum(recomputed[crit, c][k] for c in range(vp)) for k in fwd_of}
    head = any(has_head(crit, c) for c in range(vp))
    head_split = ops.split(head_f + head_b, hw)
    split = {k: v if head else 0.0 for k, v in head_split.items()}
    rc = {k: 0.0 for k in head_split}
    for kind, n in n_kind.items():
        for k, v in ops.split(fwd_of[kind] + bwd_of[kind], hw).items():
            split[k] += n * v
        for k, v in ops.split(rc_of[kind], hw).items():
            rc[k] += n_recomputed[kind] * v
    ideal = split["ideal"] * m
    tp_exposed = per_mb_tp[crit] * m
    # every TP / CP / EP call is exposed (per_mb_tp is their sum), the CP ring beyond its attention where
    # hidden behind it; the p2p transfers sit inside the simulated schedule (the bubble)
    exposed = {d: t for d, t in comm_s.items() if d not in DP_DIMS}
    if hidden_cp[crit]:
        exposed["cp"] -= hidden_cp[crit]
    assert abs(sum(exposed.values()) - tp_exposed) <= 1e-9 * max(1.0, tp_exposed)
    exposed.update(dp_exposed)
    bubble = pipe_s - busy_f - busy_b
    waterfall = [("model FLOPs at peak", ideal),
                 ("GEMM / attention efficiency", (split["gemm"] + split["attention"]) * m - ideal),
                 ("memory-bound ops", split["memory"] * m),
                 ("recompute", (rc["gemm"] + rc["attention"] + rc["memory"]) * m + w_more),
                 ("DP collectives' copies", sum(copies[crit])),
                 ("grad accumulation", accumulate[crit])]
    waterfall += [(f"exposed {d}", t) for d, t in sorted(exposed.items()) if t > 0]
    waterfall += [("SMs held by hidden collectives", sm_s), ("pipeline bubble", bubble), ("optimizer step", opt_s)]
    if offloaded:
        waterfall.append(("host link transfers (offload)", host_s))
    total = sum(t for _, t in waterfall)
    if abs(total - step) > 1e-9 * step:  # the terms are the step's parts by construction
        raise AssertionError(f"step time's waterfall sums to {total}, not its step {step}")
    tokens = lay.global_batch_size * model.seq_len
    mfu = model_flops(model, lay) / (lay.world * hw.peak("bf16") * step)
    return StepTime(target=hw.target, step_s=step, forward_s=busy_f, backward_s=busy_b, optimizer_s=opt_s,
                    bubble_s=bubble, exposed_s={d: t for d, t in exposed.items() if t > 0}, comm_s=comm_s,
                    tokens_per_s_per_gpu=tokens / step / lay.world, mfu=mfu, waterfall=waterfall,
                    notes=list(policy.sources), simulation=sim)


def render(st: StepTime) -> str:
    """The step's lines for the predict table."""
    lines = [f"step time for {st.target}: {st.step_s:.4g} s, {st.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
             f"MFU {100 * st.mfu:.1f}% (model FLOPs: 6N + 12 L s h per token, recompute not counted)"]
    parts = ", ".join(f"{k} {100 * v / st.step_s:.1f}%" for k, v in st.waterfall if abs(v) > 1e-9)
    lines.append(f"where the step goes (critical stage): {parts}")
    return "\n".join(lines)
