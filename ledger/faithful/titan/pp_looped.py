"""Peak live bytes of a torchtitan 0.3.0 PP rank that holds several stages, CPU/gloo: the runtime schedules
(torch 2.13 torch/distributed/pipelining/schedules.py _PipelineScheduleRuntime) Interleaved1F1B and LoopedBFS,
over FSDP2 / HSDP, with CP and TP as pp_peak.py derives them for one stage a rank, and the split backward's
InterleavedZeroBubble, ZBVZeroBubble and DualPipeV (their I and W actions) without activation checkpointing.

Where pp_peak.py's moments follow from 1F1B's and GPipe's fixed shapes, these walk the rank's own action
list as torch lowers it (rank_compute_order, then schedules.py _add_unshard_reshard and _add_reduce_grad)
and, at each action, price the acting stage's moments (pp_peak.py's _Stage: the same byte counts) beside
what every other stage of the rank holds at that point (_Held). What the runtime does differently
(_PipelineScheduleRuntime._step_microbatches):
- every SEND_F / SEND_B work is kept in `send_ops` until the step's end, so every activation sent on and
  every input grad sent back stays referenced (as GPipe's lists: pp_peak._Stage.gpipe);
- REDUCE_GRAD runs a stage's perform_reduce_grad right after its last backward, mid-step: that stage's
  units are resharded and its grads reduce-scattered while the rank's other stages still compute;
- UNSHARD: with no more stages a rank than MAX_ACTIVE_STAGES every stage is unsharded at the step's start
  and stays so until its REDUCE_GRAD (a test holds torch's own lowering to it); with more, torch's UNSHARD /
  RESHARD actions gather and free a stage's units mid-step, its fp32 accumulators kept;
- the last stage's loss runs inside its forward (_maybe_compute_loss): ChunkedLossWrapper reduce-scatters
  [norm, lm_head]'s grad at its last chunk (the norm's with it once a backward gave the norm one) and
  reshards that group; _DecoderOutputGradientBackProp keeps the micro-batch's [B, S, h] grad until its
  backward, whose final norm unshards the group again;
- a split backward's I keeps the micro-batch's saves and the grads it captures for W, W frees them and sets bf16
  .grads that the next I's post_backward (or REDUCE_GRAD) accumulates (_at_input_backward, _at_weight_backward);
  the first stage's I computes nothing and its W runs the whole backward (rank_actions);
- the V placement's middle pair passes on the rank, the passed tensor the receiver's receive buffer
  (_Stage.local_next).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property, lru_cache
from operator import attrgetter

from ledger.dtypes import BF16, FP32 as F32
from ledger.faithful.titan.peak import chunk_copies, first_step_peak, rs_temporary
from ledger.faithful.titan.pp_peak import _STATE, BlockMoment, _Stage, _stage, block_peaks, reduce_grad_moments
from ledger.faithful.titan.schedules import MAX_ACTIVE_STAGES, SPLIT_BACKWARD, compute_actions
from ledger.placement import Peak

LOOPED = ("Interleaved1F1B", "LoopedBFS", *SPLIT_BACKWARD)


def looped_unmodelled(sched: str, ac: str = "none") -> str | None:
    """Why looped_peak does not derive a multi-stage schedule's peak, or None where it does."""
    if sched not in LOOPED:
        return f"{sched}'s peak is not derived"
    if sched in SPLIT_BACKWARD and ac != "none":
        # (selective: torch refuses it, rules.py) full: W runs one autograd.grad a param group, each a new graph task
        # that re-runs the block's checkpointed forward, and the recomputes stay referenced until the stage's W ends
        # (measured: InterleavedZeroBubble pp2·vp2 at seq 1024, hidden 128, stage 1's W: seven recomputes of each of
        # its two blocks live at rank 1's peak, 106,201,960 B against 99,629,408 B without checkpointing)
        return (f"{sched}'s split backward under activation checkpointing is not derived (its W re-runs a "
                "checkpointed block's forward once a param group and holds every recompute to its end)")
    return None


class _Actions(tuple):
    """rank_actions' actions, with the walk's structure over them made once per stages' kinds (_trace_of)."""
    traces: dict


@lru_cache(maxsize=1024)
def rank_actions(sched: str, pp: int, vp: int, n: int, rank: int) -> tuple:
    """The rank's compute actions with torch's REDUCE_GRAD after each stage's last backward, as
    _PipelineScheduleRuntime lowers a compute-only schedule (_prepare_schedule_with_comms). Its UNSHARD / RESHARD
    (_add_unshard_reshard) are left out where they change nothing: with no more stages a rank than
    MAX_ACTIVE_STAGES they unshard every stage before the first action and reshard each after its REDUCE_GRAD
    (schedules.unshards; torch's pass rescans the rest of the schedule at every action, quadratic in the
    micro-batches). The sends and receives are not needed here: a forward sends on, a backward sends back,
    wherever the neighbour stage is on another rank."""
    from torch.distributed.pipelining.schedules import _Action, _add_reduce_grad, _add_unshard_reshard
    from torch.distributed.pipelining.schedules import _ComputationType as C

    compute = list(compute_actions(sched, pp, vp, n, rank))
    if vp > MAX_ACTIVE_STAGES:  # (more stages than stay unsharded: torch's own UNSHARD / RESHARD, mid-step)
        compute = _add_unshard_reshard(compute)
    # the first stage's split backward as torch's stage runs it (stage.py): its I computes nothing (its input needs
    # no grad), its W the whole backward (stage_backward)
    out = _Actions([_Action(0, C.FULL_BACKWARD, a.microbatch_index) if (a.stage_index, a.computation_type) ==
                    (0, C.BACKWARD_WEIGHT) else a for a in _add_reduce_grad(compute, n)
                    if (a.stage_index, a.computation_type) != (0, C.BACKWARD_INPUT)])
    out.traces = {}
    return out


# an action's kind as the walk's arrays code it (torch's _ComputationType by name)
_KIND_CODES = {"REDUCE_GRAD": 0, "FORWARD": 1, "FULL_BACKWARD": 2, "BACKWARD_INPUT": 3, "BACKWARD_WEIGHT": 4}
_KIND_FULL = 2


def _kind(a) -> int:
    """-1: an UNSHARD or RESHARD (the walk applies it, no moment)."""
    return _KIND_CODES.get(a.computation_type.name, -1)


# what [norm, lm_head]'s last reduce-scatter input held is: none, lm_head's grad alone, or the norm's with it
_NO_RS, _LM_RS, _HEAD_RS = 0, 1, 2


@dataclass
class _Held:
    """What one local stage holds between actions, as the walk moves through the rank's actions: the walk's
    structure (counts and flags, the same whatever the stage's sizes: _trace) and its stage `c` to price it
    (counts() x bytes_per(), one home for what each line holds)."""
    c: _Stage
    j: int  # its local index
    flight: list = field(default_factory=list)  # micro-batches forwarded, not yet backpropagated
    backs: int = 0  # backwards done
    # a split backward's micro-batches whose I ran and whose W has not: their saves and captured grads
    # (_Stage.captured_grads) held until W
    captured: list = field(default_factory=list)
    wgrads: bool = False  # bf16 weight grads a W set, not yet accumulated (the next I's post_backward, REDUCE_GRAD)
    acc_made: bool = False  # its units' fp32 accumulators made (a full backward's post_backward or an I's)
    passed_in: int = 0  # activations and grads a neighbour on this rank passed it this step (_Stage.local_next)
    reduced: bool = False  # its REDUCE_GRAD ran
    fwd_sent: int = 0  # activations sent on (all kept in send_ops)
    bwd_sent: int = 0  # input grads sent back
    resharded: bool = False  # its units resharded by the runtime's RESHARD, until its next UNSHARD
    head_unsharded: bool = True  # [norm, lm_head] unsharded (the loss reshards it, the final norm's backward unshards)
    norm_acc: bool = False  # the final norm's fp32 accumulated grad (a backward made it, the next loss reduces it)
    # [norm, lm_head]'s reduce-scatter outputs alive (a grad views them): of lm_head's alone, of both, of the norm's
    lm_views: int = 0
    head_views: int = 0
    norm_views: int = 0
    lm_has_grad: bool = False
    norm_has_grad: bool = False
    rs_kind: int = _NO_RS  # the stage's last reduce-scatter input, held until its next one
    # HSDP: the last loss's all-reduced reduce-scatter output where it was added into [norm, lm_head]'s grads (no grad
    # views it), which FSDPParamGroup keeps as _all_reduce_state.all_reduce_input until the group's next reduce
    # (post_backward's _wait_for_post_backward): none, lm_head's, [norm, lm_head]'s
    ar_kind: int = _NO_RS
    at: int = -1  # the walk's action index
    last_pass: int = -1  # the rank's last forward or backward (_steps)

    def counts(self) -> tuple:
        """counts_reference's tuple built in _ENTRIES' order directly (a walk asks it at every action of every
        stage: most of a plan's walk time), tested equal to it."""
        live = not (self.reduced or self.resharded)
        head = self.c.has_head
        caps = len(self.captured)
        return (int(live and (self.head_unsharded or not head)), int(live and not self.head_unsharded and head),
                int(self.reduced), self.lm_views, self.head_views, self.norm_views,
                int(self.acc_made and not self.reduced), int(self.norm_acc), len(self.flight), caps, caps, caps,
                int(self.wgrads), 1, self.c.n * (self.c.local_next + self.c.local_prev) - self.passed_in,
                self.passed_in, int(self.ar_kind == _LM_RS), int(self.ar_kind == _HEAD_RS),
                self.fwd_sent + self.bwd_sent, int(self.rs_kind == _LM_RS), int(self.rs_kind == _HEAD_RS), 1)

    def counts_reference(self) -> tuple:
        """The walk's structure of this stage: how many of each of _ENTRIES it holds (bytes_per: the bytes of one)."""
        live = not (self.reduced or self.resharded)
        head = self.c.has_head
        got = {"unsharded": live and (self.head_unsharded or not head), "unsharded_but_head": live
               and not self.head_unsharded and head, "shard": self.reduced, "lm_view": self.lm_views,
               "head_view": self.head_views, "norm_view": self.norm_views, "acc": self.acc_made and not self.reduced,
               "norm_acc": self.norm_acc, "flight": len(self.flight), "cap_saves": len(self.captured),
               "cap_grads": len(self.captured), "cap_gathered": len(self.captured), "wgrads": self.wgrads, "recv": 1, "send": self.fwd_sent + self.bwd_sent,
               "local_old": self.c.n * (self.c.local_next + self.c.local_prev) - self.passed_in,
               "local_new": self.passed_in,
               "rs_lm": self.rs_kind == _LM_RS, "rs_head": self.rs_kind == _HEAD_RS,
               "ar_lm": self.ar_kind == _LM_RS, "ar_head": self.ar_kind == _HEAD_RS, "sac": 1}
        return tuple([int(got[name]) for name, _ in _ENTRIES])

    def line(self, name: str, counts: tuple | None = None) -> int:
        """The bytes of one of the lines (_ENTRIES' second column) that this stage holds (counts: its counts())."""
        counts = counts or self.counts()
        return sum([k * b for (_, ln), k, b in zip(_ENTRIES, counts, self.bytes_each) if ln == name])

    def lines(self) -> dict[str, int]:
        """Peak.plus lines of what this stage holds while another of the rank's stages acts."""
        c, j, counts = self.c, self.j, self.counts()
        flight, captured = len(self.flight) + len(self.captured), len(self.captured)
        out = {f"{part}/stage {j}: {name.format(flight=flight, captured=captured)}": self.line(key, counts)
               for key, (part, name) in _LINE_NAMES.items()}
        if c.sac_held:
            out.update({f"unnamed/stage {j}: {k.split('/', 1)[1]}": v for k, v in c.held_lines().items()})
        return out

    def unsharded(self) -> int:
        return self.line("unsharded params")

    @cached_property
    def bytes_each(self) -> tuple:
        return bytes_per(self.c)  # (its stage's sizes do not change along the walk)

    def _one(self, entry: str) -> int:
        return self.bytes_each[_AT[entry]]

    @property
    def per(self) -> int:
        """What a micro-batch in flight holds (bytes_per)."""
        return self._one("flight")

    @property
    def head_grads(self) -> int:
        """[norm, lm_head]'s reduce-scatter outputs alive."""
        return (self.lm_views * self._one("lm_view") + self.head_views * self._one("head_view")
                + self.norm_views * self._one("norm_view"))

    @property
    def rs_held(self) -> int:
        return (self.rs_kind == _LM_RS) * self._one("rs_lm") + (self.rs_kind == _HEAD_RS) * self._one("rs_head")

    def saves(self) -> int:
        """Its micro-batches in flight (per: what each holds)."""
        return len(self.flight) * self.per

    def kept_for_w(self, wgrads: bool = True) -> dict[str, int]:
        """Peak.plus lines of what a split backward holds for its W's while this stage acts: the micro-batches
        whose I ran, their saves and captured grads, and (wgrads) the bf16 weight grads a W set."""
        j, n = self.j, len(self.captured)
        if not (n or self.wgrads):
            return {}
        return {f"activations/stage {j}: {n} micro-batches' saves (I run, W not)": n * self._one("cap_saves"),
                f"temporary/stage {j}: {n} micro-batches' grads captured for W": n * self._one("cap_grads"),
                f"gathered/stage {j}: {n} micro-batches' all-gathered grads captured for W (SP)": n * self._one("cap_gathered"),
                f"temporary/stage {j}: bf16 weight grads from W, not yet accumulated": self.wgrads * self._one("wgrads")
                if wgrads else 0}

    def sends(self) -> int:
        return (self.fwd_sent + self.bwd_sent) * self._one("send")

    def ar_held(self) -> int:
        """HSDP's last loss's all-reduce input held (ar_kind)."""
        return (self.ar_kind == _LM_RS) * self._one("ar_lm") + (self.ar_kind == _HEAD_RS) * self._one("ar_head")

    def ar_lines(self) -> dict[str, int]:
        return {f"temporary/stage {self.j}: HSDP's last loss's all-reduce input held": self.ar_held()}

    def p2p(self) -> int:
        """Its receive buffers from other ranks and its held sends."""
        return self._one("recv") + self.sends()

    def local_passes(self) -> dict[str, int]:
        """Peak.plus lines of its receive buffers from a neighbour on this rank (_Stage.local_next): the tensors the
        step before passed until this step's pass of the same micro-batch replaces them, then this step's."""
        if not (self.c.local_next or self.c.local_prev):
            return {}
        counts = self.counts()
        return {f"{part}/stage {self.j}: {name}": self.line(key, counts) for key, (part, name) in _LOCAL_LINE_NAMES.items()}


# what a stage holds between actions, entry by entry: its name and the Peak.plus line it adds to (_Held.lines);
# _Held.counts says how many of each, bytes_per the bytes of one
_ENTRIES = (("unsharded", "unsharded params"), ("unsharded_but_head", "unsharded params"),
            ("shard", "sharded grads"), ("lm_view", "sharded grads"), ("head_view", "sharded grads"),
            ("norm_view", "sharded grads"), ("acc", "fp32 accumulated grads"), ("norm_acc", "fp32 accumulated grads"),
            ("flight", "micro-batches in flight"), ("cap_saves", "micro-batches in flight"),
            ("cap_grads", "captured grads"), ("cap_gathered", "captured grads, all-gathered"), ("wgrads", "bf16 weight grads"), ("recv", "p2p receive buffers and held sends"),
            ("local_old", "local passes before"), ("local_new", "local passes"),
            ("ar_lm", "HSDP all-reduce input held"), ("ar_head", "HSDP all-reduce input held"),
            ("send", "p2p receive buffers and held sends"), ("rs_lm", "its last reduce-scatter input held"),
            ("rs_head", "its last reduce-scatter input held"), ("sac", "unnamed"))
_AT = {name: i for i, (name, _) in enumerate(_ENTRIES)}
_LINE_NAMES = {"unsharded params": ("resident", "unsharded params"), "sharded grads": ("resident", "sharded grads"),
               "fp32 accumulated grads": ("temporary", "fp32 accumulated grads"),
               "micro-batches in flight": ("activations", "{flight} micro-batches in flight"),
               "captured grads": ("temporary", "{captured} micro-batches' grads captured for W (I run, W not)"),
               "captured grads, all-gathered": ("gathered", "{captured} micro-batches' all-gathered grads captured for W "
                                                "(SP; I run, W not)"),
               "bf16 weight grads": ("temporary", "bf16 weight grads from W, not yet accumulated"),
               "p2p receive buffers and held sends": ("gathered", "p2p receive buffers and held sends"),
               "its last reduce-scatter input held": ("gathered", "its last reduce-scatter input held"),
               "HSDP all-reduce input held": ("temporary", "HSDP's last loss's all-reduce input held")}
# (the acting stage's too, alike at each of its moments: _action_moments)
_LOCAL_LINE_NAMES = {"local passes before": ("unnamed", "the step before's activations and grads passed on the rank"),
                     "local passes": ("temporary", "this step's activations and grads passed on the rank")}
_LINE_NAMES.update(_LOCAL_LINE_NAMES)


def bytes_per(c: _Stage) -> tuple:
    """The bytes of one of each of _ENTRIES for stage c, in their order."""
    sh, ds = c.sh, c.ds
    one = {"unsharded": c.unsharded,  # every unit unsharded
           "unsharded_but_head": c.unsharded - c.head_full * BF16,  # [norm, lm_head] resharded by the loss
           "shard": sum([f // ds * F32 for _, f, _, _ in c.order]),  # its units' grads once reduce-scattered
           # a reduce-scatter output a grad views: lm_head's grad's, [norm, lm_head]'s, the final norm's alone
           "lm_view": c.loss_output_shard(with_norm=False), "head_view": c.loss_output_shard(with_norm=True), "norm_view": sh.norm_full // ds * F32,
           "acc": c.acc_all, "norm_acc": c.h * F32,  # its units' fp32 accumulators, the final norm's
           # a micro-batch in flight: its blocks' saves; on the last stage, its loss having run, also the final
           # norm's saves and output and its accumulated output grad
           "flight": c.chunk_saves() + (c.final_norm_saves() + c.T * c.h * BF16 if c.has_head else 0),
           # a micro-batch whose I ran: its blocks' saves (I's retain_graph keeps them; the loss's detach_ frees the
           # final norm's and the output grad, which no param group's node reaches) and its captured grads
           "cap_saves": c.chunk_saves(), "cap_grads": c.captured_grads() - c.captured_gathered(),
           "cap_gathered": c.captured_gathered(),  # (SP: the all-gathered ones, _Stage.captured_block)
           "wgrads": c.Ls * c.block_grad_numel * BF16,  # a W's bf16 .grad of each block's params
           "recv": c.recv - c.recv_local, "send": c.act,  # the receive buffers from other ranks; a held send
           "local_old": c.act, "local_new": c.act,  # a receive buffer a local pass set (_Held.local_passes)
           # the last loss's reduce-scatter input held: lm_head's grad's, [norm, lm_head]'s
           "rs_lm": sh.lm_full * F32, "rs_head": c.head_full * F32,
           # HSDP's held all-reduce input: the loss's reduce-scatter output (lm_head's, [norm, lm_head]'s)
           "ar_lm": c.loss_output_shard(with_norm=False), "ar_head": c.loss_output_shard(with_norm=True),
           "sac": c.sac_held}  # what the step before's recomputes left
    return tuple([one[name] for name, _ in _ENTRIES])


# the entries an action's walk state adds alike to each of its moments beside its template (_offset), by its
# _kind: a forward's in-flight saves, held sends, [norm, lm_head] grads, what a split backward keeps for W and the
# local passes' buffers (_HELD_ALIKE, _action_moments); a backward's, and the held reduce-scatter input (less the
# micro-batch in backward, in flight); a split backward's I's, every micro-batch in flight (but the bf16 grads a W
# set, which its blocks' post_backward accumulate one by one); its W's, those bf16 grads too
_HELD_ALIKE = ("cap_saves", "cap_grads", "cap_gathered", "local_old", "local_new")
_FORWARD_OFFSET = tuple([int(name in ("lm_view", "head_view", "norm_view", "flight", "send", *_HELD_ALIKE, "wgrads"))
                         for name, _ in _ENTRIES])
_BACKWARD_OFFSET = tuple([int(name in ("lm_view", "head_view", "norm_view", "flight", "send", "rs_lm", "rs_head",
                                       *_HELD_ALIKE, "wgrads", "ar_lm", "ar_head")) for name, _ in _ENTRIES])
_INPUT_OFFSET = tuple([int(name in ("lm_view", "head_view", "norm_view", "flight", "send", "rs_lm", "rs_head",
                                    *_HELD_ALIKE, "ar_lm", "ar_head")) for name, _ in _ENTRIES])
_OFFSETS = ((0,) * len(_ENTRIES), _FORWARD_OFFSET, _BACKWARD_OFFSET, _INPUT_OFFSET, _BACKWARD_OFFSET)


def looped_moments(stages: list[_Stage], actions: list) -> list[Peak]:
    """The live bytes at each candidate moment of the rank's step: walk `actions` (rank_actions) over its
    local stages (`stages`, local index = stage index // pp). The readable reference that looped_peak's fast
    path (_most) agrees with."""
    return [p.plus(others) for i, a, me, held in _steps(stages, actions, stages[0].lay.pp)
            for p, others in _action_moments(a, me, held)]


def _most(stages: list[_Stage], actions: list) -> Peak:
    """The first of looped_moments' most. Within one action every moment of the acting stage moves by the same
    bytes with the state the walk carries (its other micro-batches' saves, its sends, its [norm, lm_head] grads,
    its held reduce-scatter input: _offset), and the other stages' lines move all of them alike: so each kind of
    action (_template_key) is priced once, every action scored as its template, its offset and the other stages'
    totals over the walk's structure (_trace: counts, the same for every stage size) times each stage's
    bytes_per, and only the action with the most is priced moment by moment."""
    import numpy as np

    tr = _trace_of(stages, actions)
    if not tr.index:
        raise ValueError("no moment")
    per = np.array([bytes_per(c) for c in stages], dtype=np.int64)  # [stage, entry]
    totals = np.einsum("sae,se->sa", tr.counts, per)  # each stage's total before each action
    cols = np.arange(len(tr.index))
    mine = tr.counts[tr.acting, cols]  # [action, entry]: the acting stage's counts
    mask = np.array(_OFFSETS, dtype=np.int64)[tr.kind]
    offset = (mine * per[tr.acting] * mask).sum(1) - (tr.kind == 2) * per[tr.acting, _AT["flight"]]
    score = totals.sum(0) - totals[tr.acting, cols] + offset + per[tr.acting, _AT["sac"]]
    templates = {}
    sizes = _SHARED.sizes(stages)
    for at, key in enumerate(tr.keys):
        if key not in templates:
            templates[key] = _SHARED.template(stages, actions, tr, at, sizes[tr.acting[at]])
    priced = np.array([templates[key] is not None for key in tr.keys])
    if not priced.any():
        raise ValueError("no moment")
    score += np.array([templates[key] or 0 for key in tr.keys], dtype=np.int64)
    best_at = int(np.argmax(np.where(priced, score, score.min() - 1)))  # (the first on ties)
    a = actions[tr.index[best_at]]
    held = [_Held(c, j, **_fields(tr.states[best_at][j])) for j, c in enumerate(stages)]
    me = held[tr.acting[best_at]]
    return max([p.plus(others) for p, others in _action_moments(a, me, held)], key=lambda m: m.bytes)


def _template(stages: list[_Stage], actions: list, tr: "_Trace", at: int) -> int | None:
    """The most of the acting stage's moments of the trace's action `at`, less its _offset (None: it has none)."""
    a = actions[tr.index[at]]
    j = tr.acting[at]
    me = _Held(stages[j], j, **_fields(tr.states[at][j]))
    most = max([p.bytes for p, _ in _action_moments(a, me, (me,), most_only=True)], default=None)
    return None if most is None else most - _offset(a, me)


class _SharedTemplates:
    """_template's values shared by the walks of every rank and layout (a plan walks thousands): an action's template
    is read from its acting stage's sizes and its _template_key, the stage's index aside (a key's first item), and
    the middle stages of a pipeline are alike in size on every rank. A stage's sizes are all its fields but its
    index, and of that whether it is the first (_Stage.own); each distinct one is numbered here. Both tables are
    emptied together once they hold `limit` entries (the numbers restart)."""

    def __init__(self, limit: int = 200_000):
        self.limit = limit
        self.numbers: dict = {}
        self.values: dict = {}

    def sizes(self, stages: list[_Stage]) -> list[int]:
        """The numbers of a walk's stages' sizes (the tables emptied first where full, never amid a walk)."""
        if len(self.numbers) >= self.limit or len(self.values) >= self.limit:
            self.numbers.clear()
            self.values.clear()
        return [self.numbers.setdefault(tuple([getattr(c, f) for f in _SIZE_FIELDS]) + (c.s == 0,), len(self.numbers))
                for c in stages]

    def template(self, stages: list[_Stage], actions: list, tr: "_Trace", at: int, sizes: int) -> int | None:
        key = (sizes, tr.keys[at][1:])
        if key not in self.values:
            self.values[key] = _template(stages, actions, tr, at)
        return self.values[key]


_SIZE_FIELDS = tuple([f.name for f in fields(_Stage) if f.name != "s"])
_SHARED = _SharedTemplates()


def _template_key(a, me: "_Held") -> tuple:
    """What shapes an action's moments beside _offset: its stage and kind, whether the stage's accumulators are
    made and a W's bf16 grads wait for them, on the last stage whether the loss reduces the norm's grad too and the
    reduce-scatter input it holds (a loss's cross-entropy moment holds it, its reduce-scatter moment does not)."""
    return (a.stage_index, a.computation_type, me.acc_made, me.wgrads, me.norm_acc,
            (me.rs_kind, me.ar_kind) if me.c.has_head else 0, me.reduced)


def _offset(a, me: "_Held") -> int:
    """The bytes the acting stage's walk state adds alike to each moment of the action (its template aside)."""
    kind = _kind(a)
    if not kind:
        return 0  # (REDUCE_GRAD: once a stage, priced as it comes)
    less = me.per if kind == _KIND_FULL else 0
    return sum([k * b * m for k, b, m in zip(me.counts(), me.bytes_each, _OFFSETS[kind])]) - less


@dataclass
class _Trace:
    """The walk's structure over a rank's actions (_steps with every stage's kinds, not its sizes): per action
    the walk stops at, its index in the actions, the acting local stage, its _kind, its _template_key, and every
    stage's _Held fields (states) and counts() before it."""
    index: list
    acting: object  # numpy int array
    kind: object
    keys: list
    states: list
    counts: object  # numpy [stage, action, entry]


@dataclass(frozen=True)
class _Kinds:
    """What the walk's structure reads of a stage: its place in the pipeline, not its sizes."""
    first: bool
    last: bool
    has_head: bool
    local_next: bool
    local_prev: bool
    n: int  # the micro-batches (a stage's local passes in a step)
    hsdp: bool


def _trace_of(stages: list[_Stage], actions) -> _Trace:
    """The walk's structure over `actions` for stages of these kinds: made once per rank_actions' actions."""
    kinds = tuple([_Kinds(c.first, c.last, c.has_head, c.local_next, c.local_prev, c.n, c.hsdp) for c in stages])
    key = (kinds, stages[0].lay.pp)
    traces = getattr(actions, "traces", None)
    if traces is None:
        return _trace(*key, actions)
    if key not in traces:
        traces[key] = _trace(*key, actions)
    return traces[key]


# a _Held's walk state: its fields but its stage and local index, read at once (_snapshot)
_STATE_FIELDS = tuple([f.name for f in fields(_Held) if f.name not in ("c", "j")])
_READ_STATE = attrgetter(*_STATE_FIELDS)
_LISTS = tuple([i for i, f in enumerate(_STATE_FIELDS) if f in ("flight", "captured")])  # (copied: the walk mutates them)


def _snapshot(h: "_Held") -> list:
    """h's walk state as its values in _STATE_FIELDS' order (_fields makes them keywords again)."""
    values = list(_READ_STATE(h))
    for i in _LISTS:
        values[i] = list(values[i])
    return values


def _fields(values: list) -> dict:
    return dict(zip(_STATE_FIELDS, values))


def _trace(kinds: tuple, pp: int, actions) -> _Trace:
    """_steps over stages of these kinds (`pp`: to find a stage's local index), recorded action by action."""
    import numpy as np

    index, acting, kind, keys, states, counts = [], [], [], [], [], []
    for i, a, me, held in _steps(list(kinds), actions, pp):
        index.append(i)
        acting.append(me.j)
        kind.append(_kind(a))
        keys.append(_template_key(a, me))
        states.append([_snapshot(h) for h in held])
        counts.append([h.counts() for h in held])
    arr = np.array(counts, dtype=np.int64).reshape(len(index), len(kinds), len(_ENTRIES)).transpose(1, 0, 2)
    return _Trace(index, np.array(acting, dtype=np.int64), np.array(kind, dtype=np.int64), keys, states,
                  np.ascontiguousarray(arr))


def _steps(stages: list, actions: list, pp: int):
    """The walk: (index, action, the acting stage's _Held, every stage's) before each action, the action's effect
    applied when the caller moves on. stages: _Stage (to price what each holds) or _Kinds (the structure alone);
    pp: a stage's rank is its index mod pp, its local index the index // pp."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    # (more stages a rank than stay unsharded: each starts sharded, torch's UNSHARD / RESHARD actions gather and
    # free its units mid-step, its fp32 accumulators kept)
    lowered = len(stages) > MAX_ACTIVE_STAGES
    held = [_Held(c, j, resharded=lowered) for j, c in enumerate(stages)]
    # the probe's phase of what runs between passes: `schedule` before the rank's last forward or backward,
    # `optimizer` after it (probes/peak_analysis.py phases_of)
    last_pass = max([i for i, a in enumerate(actions) if _kind(a) > 0])
    for h in held:
        h.last_pass = last_pass
    for i, a in enumerate(actions):
        me = held[a.stage_index // pp]
        kind, mb = a.computation_type, a.microbatch_index
        if kind in (C.UNSHARD, C.RESHARD):
            me.resharded = kind == C.RESHARD
            continue
        me.at = i
        yield i, a, me, held
        if kind == C.FORWARD:
            _after_forward(me, mb)
        elif kind == C.FULL_BACKWARD:
            _after_backward(me, mb)
        elif kind == C.BACKWARD_INPUT:
            _after_input_backward(me, mb)
        elif kind == C.BACKWARD_WEIGHT:
            _after_weight_backward(me, mb)
        elif kind == C.REDUCE_GRAD:
            _after_reduce_grad(me)
        else:
            raise ValueError(f"{a}: not an action of the looped schedules")
        # a pass to a neighbour stage on this rank (stage.py set_local_fwd_input, set_local_bwd_input)
        if kind == C.FORWARD and me.c.local_next:
            held[(a.stage_index + 1) // pp].passed_in += 1
        elif kind in (C.FULL_BACKWARD, C.BACKWARD_INPUT) and me.c.local_prev:
            held[(a.stage_index - 1) // pp].passed_in += 1


def _action_moments(a, me: "_Held", held, most_only: bool = False) -> list:
    """The acting stage's moments of action `a`, each with the lines of what the rank's other stages hold then
    (_Held.lines) and what this one holds from the step before; most_only: a full backward's most block moment
    alone (_at_backward: its most is the same, first on ties)."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    others: dict[str, int] = me.c.held_lines() if me.c.sac_held else {}
    for o in held:
        if o is not me:
            others.update(o.lines())
    kind, mb = a.computation_type, a.microbatch_index
    if kind == C.REDUCE_GRAD:  # (after the stage's last W: nothing is kept for one)
        phase = "schedule" if me.at < me.last_pass else "optimizer"
        local = me.local_passes()
        return [(replace(p, phase=phase).plus(local) if local else replace(p, phase=phase), others)
                for p in _at_reduce_grad(me)]
    # (I accumulates the W's grads block by block; a loss's own moments say whether HSDP's all-reduce input is held)
    kept = {**me.kept_for_w(wgrads=kind != C.BACKWARD_INPUT), **me.local_passes(),
            **(me.ar_lines() if kind != C.FORWARD and me.ar_kind else {})}
    if kind == C.FORWARD:
        moments = _at_loss(me, mb) if me.c.has_head else _at_forward(me, mb)
    elif kind == C.FULL_BACKWARD:
        moments = _at_backward(me, mb, most_only)
    elif kind == C.BACKWARD_INPUT:
        moments = _at_input_backward(me, mb)
    else:
        moments = _at_weight_backward(me, mb)
    return [(p.plus(kept) if kept else p, others) for p in moments]


def _after_forward(me: _Held, mb: int) -> None:
    c = me.c
    me.flight.append(mb)
    if not (c.last or c.local_next):
        me.fwd_sent += 1
    if c.has_head:
        # the loss's reduce-scatter of [norm, lm_head] (the norm's grad with it once a backward made one):
        # a param with a sharded grad adds the output into it, one without takes a view of the output, which
        # then stays alive (_fsdp_collectives.py foreach_reduce_scatter_copy_out)
        with_norm = me.norm_acc
        viewed = (not me.lm_has_grad) or (with_norm and not me.norm_has_grad)
        if viewed:
            if with_norm:
                me.head_views += 1
            else:
                me.lm_views += 1
        me.lm_has_grad = True
        me.norm_has_grad = me.norm_has_grad or with_norm
        me.rs_kind, me.norm_acc, me.head_unsharded = (_HEAD_RS if with_norm else _LM_RS), False, False
        # HSDP all-reduces the output (ChunkedLossWrapper turns gradient sync on at the last chunk) and FSDP holds it
        # until the group's next reduce: its own buffer where it was added into the grads, not viewed by one
        # (measured: pp2·vp2·rep2 at seq 512 under LoopedBFS and InterleavedZeroBubble, the last stage's rank)
        me.ar_kind = _NO_RS if (viewed or not c.hsdp) else me.rs_kind


def _after_reduce_grad(me: _Held) -> None:
    """perform_reduce_grad reduce-scatters every unit with an unsharded grad: on the last stage the final
    norm's too where a backward came after the last loss (alone: lm_head's the losses reduced), its output
    the norm's grad where it had none (a view) or added into it."""
    if me.norm_acc and not me.norm_has_grad:
        me.norm_views += 1
    me.reduced, me.rs_kind, me.norm_acc, me.wgrads, me.ar_kind = True, _NO_RS, False, False, _NO_RS


def _after_backward(me: _Held, mb: int) -> None:
    c = me.c
    me.flight.remove(mb)
    me.backs += 1
    # its post_backward accumulates each block's grad (a W's before it with it) into the fp32 accumulators
    me.acc_made, me.wgrads = True, False
    if not (c.first or c.local_prev):
        me.bwd_sent += 1
    if c.has_head:
        me.norm_acc, me.head_unsharded = True, True


def _after_input_backward(me: _Held, mb: int) -> None:
    """A split backward's I (a stage after the first: rank_actions runs the first's as its W's full backward):
    the micro-batch's saves and captured grads kept for its W, its input grad sent back, the bf16 grads of the W's
    before accumulated by each block's post_backward; on the last stage the final norm's backward unshards
    [norm, lm_head] again (its pre-backward), as a full backward's, but gives the norm no grad
    (schedules.ZERO_BUBBLE)."""
    me.flight.remove(mb)
    me.captured.append(mb)
    me.bwd_sent += not me.c.local_prev
    if me.wgrads:
        me.acc_made, me.wgrads = True, False
    if me.c.has_head:
        me.head_unsharded = True


def _after_weight_backward(me: _Held, mb: int) -> None:
    """A split backward's W: stage_backward_weight frees the micro-batch's saves and captured grads group by
    group and sets (or adds to) each weight's bf16 .grad, which FSDP accumulates at the next I or REDUCE_GRAD."""
    me.captured.remove(mb)
    me.backs += 1
    me.wgrads = True


def _state(c: _Stage) -> dict[str, int]:
    return {_STATE: c.kept}


def _at_forward(me: _Held, mb: int) -> list[Peak]:
    """With SP, a stage before the last: the forward at its last block's w2 reduce-scatter (pp_peak's
    _at_last_warmup_forward) with this stage's micro-batches in flight."""
    c = me.c
    if not c.lay.sequence_parallel or c.lay.tp == 1 or not c.Ls:
        return []
    flight = len(me.flight) + 1
    act, full = c.act, c.T * c.h * BF16
    p2p = me.p2p()
    work = 4 * act + full + (full if c.rules.rs_input_copy else 0)
    acc = c.acc_all if me.acc_made else 0
    d = {**_state(c), "resident/unsharded params (the stage's units)": me.unsharded(),
         f"activations/{flight} micro-batches x {c.Ls} blocks": flight * c.chunk_saves(),
         "temporary/fp32 accumulated grads": acc,
         "temporary/block input, attention residual, ffn_norm output, w2's output and its reduce-scatter's input "
         "and output": work, "gathered/p2p buffers and held sends": p2p}
    parts = {"resident": c.kept + me.unsharded(), "activations": flight * c.chunk_saves(), "gathered": p2p,
             "temporary": acc + work}
    return [Peak.of(parts, phase="forward", what=f"micro-batch {mb}'s forward at block {c.Ls - 1}'s w2 "
                    f"reduce-scatter (SP), stage {c.s}", detail=d)]


def _at_backward(me: _Held, mb: int, most_only: bool = False) -> list[Peak]:
    """A backward at each of its blocks' moments (_Stage.block_moments); on the last stage first its final
    norm's (pp_peak's _at_final_norm_backward, _at_blocks_after_final_norm); most_only: of the block moments the
    first most alone (pp_peak.block_peaks)."""
    c = me.c
    others_saves = me.saves() - me.per  # (the micro-batch in backward is in flight)
    p2p = me.p2p()
    out: list[Peak] = []
    g = me.head_grads
    gathered = p2p + me.rs_held
    if c.has_head:
        out_b = c.T * c.h * BF16  # the stage's output (the final norm's, with SP all-gathered)
        acc = c.acc_all if me.acc_made else 0
        work = c.at_final_norm_working()
        saved = c.chunk_saves() + c.norm_saved() + out_b + others_saves
        d = {**_state(c), "resident/grads ([norm, lm_head]'s outputs)": g,
             "resident/unsharded params (every unit)": c.unsharded, "temporary/fp32 accumulated grads (blocks)": acc,
             f"activations/micro-batch {mb}'s blocks, the final norm's input and output; the others'": saved,
             "temporary/RMSNorm backward fp32 [T, h] x 5, the norm's bf16 weight grad": work,
             "gathered/the last loss's reduce-scatter input held, p2p buffers and held sends": gathered}
        out.append(Peak.of({"resident": c.kept + g + c.unsharded, "activations": saved, "gathered": gathered,
                            "temporary": acc + work}, phase="backward",
                           what=f"micro-batch {mb}'s final norm backward, stage {c.s}", detail=d))
    moments = []
    what = f"micro-batch {mb} backward at block {{k}}'s {{name}}, stage {c.s}"
    saved_label = f"blocks 0..{{k}}; {len(me.flight) - 1} other micro-batches"
    for k in range(c.Ls - 1, -1, -1):
        acc = (c.acc_all if me.acc_made else (c.Ls - 1 - k) * c.block_grad_numel * F32) + (c.h * F32 if c.has_head else 0)
        # the grad into the stage's last block is the P2P receive buffer (the last stage: the final norm's own)
        incoming = c.act if (k < c.Ls - 1 or c.has_head) else 0
        extra = c.T * c.h * BF16 if c.has_head else 0
        for name, saved_k, work_k in c.block_moments(k, incoming):
            moments.append(BlockMoment(what, saved_label, k, name, g, acc, gathered, saved_k + extra + others_saves,
                                       work_k))
    return out + block_peaks(c, moments, most_only)


def _at_input_backward(me: _Held, mb: int) -> list[Peak]:
    """A split backward's I on a stage after the first (stage.py backward_one_chunk(full_backward=False):
    pipelining/_backward.py stage_backward_input), from the top block down: autograd.grad of the stage's input with
    retain_graph, so none of the micro-batch's saves is freed and no weight grad is made; each weight's incoming
    grad is captured for W (_Stage.captured_grads, growing block by block). FSDP's post_backward still runs as each
    block's input grad is made: it accumulates the bf16 grads a W set (wgrads) into the fp32 accumulators, making
    them at the first (_fsdp_param.py to_accumulated_grad_if_needed, accumulate_unsharded_grad_if_needed). A
    block's moment is its attention_norm's backward, where every grad of the block is captured, beside the RMSNorm
    composite's five fp32 [T, h] (the residual grad the block's input grad adds to is wo's captured one; measured:
    InterleavedZeroBubble pp2·vp2 at seq 1024, hidden 128: stage 1's second I at block 0 is rank 1's peak, the
    probe's census by op equal to these lines but the step's setup tensors). On the last stage its final norm's
    backward first (the norm weight, resharded by the loss, gets no grad: schedules.ZERO_BUBBLE)."""
    c = me.c
    saved = me.saves()  # every micro-batch in flight, this one's too
    gathered = me.p2p() + me.rs_held
    g = me.head_grads
    blk16, blk32 = c.block_grad_numel * BF16, c.block_grad_numel * F32
    norm_work = 5 * c.Tn * c.h * F32

    def moment(what: str, folded: int, caps: int, caps_gathered: int, work: dict, residual: int = 0) -> Peak:
        # `folded` blocks (those above) ran their post_backward: a W's grads accumulated (into accumulators made
        # there, the first time), the others' still bf16
        acc = c.acc_all if me.acc_made else (folded * blk32 if me.wgrads else 0)
        pending = (c.Ls - folded) * blk16 if me.wgrads else 0
        d = {_STATE: c.kept, "resident/unsharded params (every unit)": c.unsharded,
             "resident/grads ([norm, lm_head]'s outputs)": g, f"activations/micro-batch {mb} and the others in flight": saved,
             f"temporary/micro-batch {mb}'s grads captured for W so far": caps - caps_gathered,
             f"gathered/micro-batch {mb}'s all-gathered grads captured for W so far (SP)": caps_gathered,
             "gathered/the block's residual grad beside wo's all-gathered copy (SP)": residual,
             "temporary/fp32 accumulated grads": acc, "temporary/bf16 weight grads from W, not yet accumulated": pending,
             "gathered/p2p buffers and held sends (the last loss's reduce-scatter input held)": gathered, **work}
        return Peak.of({"resident": c.kept + c.unsharded + g, "activations": saved,
                        "gathered": gathered + caps_gathered + residual,
                        "temporary": caps - caps_gathered + acc + pending + sum(work.values())}, phase="backward",
                       what=f"micro-batch {mb}'s I at {what}, stage {c.s}", detail={n: v for n, v in d.items() if v})

    out = []
    if c.has_head:
        out.append(moment("its final norm's backward", 0, 0, 0,
                          {"temporary/RMSNorm backward fp32 [T, h] x 5": norm_work}))
    # with SP the residual grad the block's input grad adds to is a Shard(1) tensor of its own, all-gathered for wo
    # (without, it is wo's captured grad itself)
    residual = c.act if c.sp else 0
    for k in range(c.Ls - 1, -1, -1):
        out.append(moment(f"block {k}'s attention_norm backward", c.Ls - 1 - k, c.captured_grads(k),
                          c.captured_gathered(k), {"temporary/RMSNorm backward fp32 [T, h] x 5": norm_work}, residual))
    return out


def _at_weight_backward(me: _Held, mb: int) -> list[Peak]:
    """A split backward's W on a stage after the first (pipelining/_backward.py stage_backward_weight): param
    group by group, in the stage's parameter order (a block's q / k / v projection(s), wo, w1, w2, w3, its norms),
    autograd.grad of the group's weights from its captured grads (retain_graph off: the group's nodes free what
    they saved), its captured grads then deleted, each weight's bf16 .grad set to the result or added into. The
    loop's `dweights` keeps the group before's result alive while the next group's is made. Its moments: its
    start (everything the I kept, the first weight grad), and block 0's second feed-forward weight grad (w2's, w1's
    beside it): the attention groups' captured grads and saved inputs freed by then, the grads set so far (or,
    where a W before left its .grads, w1's result held by the loop) (measured: InterleavedZeroBubble pp2·vp2 at seq
    32, stage 1's last W after the one before it: 10 bf16 .grads and two [ffn, h] results, the peak). A stage of
    no blocks (the head alone) has no param group: its W computes nothing."""
    c = me.c
    if not c.Ls:
        return []
    T, h = c.T, c.h
    p2p = me.p2p() + me.rs_held
    g = me.head_grads
    acc = c.acc_all if me.acc_made else 0
    qkv_first = (c.qkv if c.fused_qkv else c.q) * h * BF16  # wqkv's, or wq's
    ffn_dw = c.ffn * h * BF16
    attn_dw = (c.qkv + c.q) * h * BF16  # the q / k / v projections' and wo's
    # by w2's: the attention groups' captured grads (the q / k / v projections' and wo's), w1's, and their mms'
    # saved inputs (attention_norm's output, the attention's output) gone; the attention's other saves go with its
    # graph once wo's group drops it, counted here as still held (an upper bound by them, where W is the peak only
    # at few tokens a micro-batch)
    freed_saves = T * h * BF16 + T * c.q * BF16
    # (wo's captured grad: with SP its all-gathered copy, _Stage.captured_block)
    freed_caps = T * c.qkv * BF16 + T * c.ffn * BF16 + (0 if c.sp else c.act)
    freed_gathered = c.gathered_grad if c.sp else 0
    base = {_STATE: c.kept, "resident/unsharded params (every unit)": c.unsharded,
            "resident/grads ([norm, lm_head]'s outputs)": g, "activations/the other micro-batches in flight": me.saves(),
            "temporary/fp32 accumulated grads": acc,
            "gathered/p2p buffers and held sends (the last loss's reduce-scatter input held)": p2p}
    start = {"temporary/block 0's first weight grad (bf16)": qkv_first}
    made = ({"temporary/w1's weight grad, held by the loop, and w2's (bf16)": 2 * ffn_dw} if me.wgrads else
            {"temporary/block 0's weight grads set: the attention's and w1's, and w2's (bf16)": attn_dw + 2 * ffn_dw})
    out = []
    for what, work, saves_less, caps_less, gathered_less in (
            ("its first weight grad", start, 0, 0, 0),
            ("block 0's w2 weight grad", made, freed_saves, freed_caps, freed_gathered)):
        d = {**base, **work, "activations/less: block 0's attention saved inputs (freed)": -saves_less,
             "temporary/less: block 0's attention captured grads and w1's (freed)": -caps_less,
             "gathered/less: block 0's wo captured grad, all-gathered (SP; freed)": -gathered_less}
        out.append(Peak.of({"resident": c.kept + c.unsharded + g, "activations": me.saves() - saves_less,
                            "gathered": p2p - gathered_less,
                            "temporary": acc + sum(work.values()) - caps_less}, phase="backward",
                           what=f"micro-batch {mb}'s W at {what}, stage {c.s}", detail={k: v for k, v in d.items() if v}))
    return out


def _at_loss(me: _Held, mb: int) -> list[Peak]:
    """The last stage's forward runs its loss: lm_head's reduce-scatter at the loss's last chunk and a chunk's
    cross-entropy backward before it (pp_peak's _at_lm_head_reduce_scatter, _at_loss_chunk_backward), the
    stage's other micro-batches in flight."""
    c = me.c
    T, h = c.T, c.h
    copies = chunk_copies(c.lay, T, h)
    saved = me.saves() + c.chunk_saves() + c.final_norm_saves() + copies[0]
    acc = (c.acc_all if me.acc_made else 0)
    p2p = me.p2p()
    with_norm = me.norm_acc
    rs = (c.head_full if with_norm else c.sh.lm_full) * F32
    g_out = me.head_grads + c.loss_output_shard(with_norm)  # the output beside the grads alive
    unsharded = c.unsharded
    wrapper = c.at_lm_head_rs_working(copies)
    copy = rs_temporary(c.rules, c.ds, rs)
    t = acc + c.held(c.lm_numel()) + wrapper + copy
    d = {**_state(c), "resident/grads ([norm, lm_head]'s outputs, this one's)": g_out,
         "resident/unsharded params (every unit)": unsharded,
         "temporary/fp32 accumulated grads (blocks; lm_head's held)": acc + c.held(c.lm_numel()),
         "activations/the micro-batches in flight, this one's blocks and final norm": saved,
         "temporary/grad accumulator, last chunk's logits and input grad": wrapper,
         "gathered/reduce-scatter input (fp32)": rs, "temporary/gloo copy or divided input (fp32)": copy,
         "gathered/p2p buffers and held sends": p2p}
    out = [Peak.of({"resident": c.kept + g_out + unsharded, "activations": saved, "gathered": rs + p2p,
                    "temporary": t}, phase="backward",
                   what=f"lm_head reduce-scatter at micro-batch {mb}'s last loss chunk", detail=d)]
    wrap = c.at_loss_chunk_working(copies)
    norm_acc = c.h * F32 if with_norm else 0
    d = {**_state(c), "resident/grads ([norm, lm_head]'s outputs)": me.head_grads,
         "resident/unsharded params (every unit)": unsharded,
         "temporary/fp32 accumulated grads (blocks, the norm's)": acc + norm_acc,
         "activations/the micro-batches in flight, this one's blocks and final norm": saved,
         "temporary/grad accumulator, lm_head's fp32 grad, chunk logits, cross-entropy backward": wrap,
         "gathered/the loss before's reduce-scatter input (held)": me.rs_held, "gathered/p2p buffers and held sends": p2p}
    # (HSDP's all-reduce input of the loss before, held until this loss's own reduce at its last chunk)
    out.append(Peak.of({"resident": c.kept + me.head_grads + unsharded, "activations": saved,
                        "gathered": me.rs_held + p2p, "temporary": acc + norm_acc + wrap}, phase="backward",
                       what=f"micro-batch {mb}'s loss chunk cross-entropy backward", detail=d).plus(me.ar_lines()))
    return out


def _at_reduce_grad(me: _Held) -> list[Peak]:
    """REDUCE_GRAD: perform_reduce_grad unit by unit (pp_peak's reduce_grad_moments), this stage's every send
    held."""
    c = me.c
    # (HSDP's all-reduce input held until [norm, lm_head]'s own reduce, the last unit's)
    return [p.plus(me.ar_lines()) if me.ar_kind else p
            for p in reduce_grad_moments(c, me.head_grads, me.norm_acc, me.p2p(), f", stage {c.s}",
                                         acc_made=me.acc_made, bf16_grads=me.wgrads)]


def looped_stages(model, lay, local: list, kept: int, emb_numel: int, block_numel: int, head_numel: int, ac: str,
                  rules) -> list[_Stage]:
    """The _Stage of each of a rank's stages `local` ((index, pp_stages entry, Sharded) each), with which of its
    neighbours are on the rank (the V schedules' middle pair: _Stage.local_next)."""
    S = lay.pp * lay.vp
    mine = {s for s, _, _ in local}
    return [replace(_stage(model, lay, stage, s, sh, kept, 0, emb_numel, block_numel, head_numel, ac, rules, stages=S),
                    local_next=s + 1 in mine, local_prev=s - 1 in mine) for s, stage, sh in local]


def looped_peak(model, lay, rank: int, local: list, kept: int, grads: int, emb_numel: int, block_numel: int,
                head_numel: int, ac: str, rules, optim: int | None, sched: str) -> Peak:
    """The steady-step peak of PP rank `rank` holding the stages `local` ((index, pp_stages entry, Sharded)
    each) under a looped schedule: the most of looped_moments (the first on ties); optim: the rank's
    optimizer-state bytes, for the first step's peak (pp_peak's)."""
    cs = looped_stages(model, lay, local, kept, emb_numel, block_numel, head_numel, ac, rules)
    best = _most(cs, rank_actions(sched, lay.pp, lay.vp, lay.num_microbatches, rank))
    if optim is not None:
        # (every moment lacks the same optimizer state in step 0, so the steady step's most is step 0's)
        first = first_step_peak([(best, optim)], kept + grads, _STATE,
                                ("gathered/p2p receive buffers", sum([c.recv for c in cs])))
        if first.bytes != best.bytes:
            best.first = first
    return best


def looped_end_grads(stages: list[_Stage], actions: list) -> int:
    """The rank's grad bytes once its step's actions have run (every stage reduced, the head's reduce-scatter
    outputs that a grad views): the walk's account, which the state's grads (pp.py) must equal."""
    held: list = []
    for _i, _a, _me, held in _steps(stages, actions, stages[0].lay.pp):  # (it applies each action moving on)
        pass
    return sum([h.line("sharded grads") for h in held])
