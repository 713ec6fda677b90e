"""torchtitan peak, predict-only: activation-checkpointing knobs, the peak model's parts.

The real-run checks (every steady peak_bytes row within 1%) are tests/test_titan.py's, on the
shared matrix sweep."""
from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from conf.schema import FRAMEWORK_SCHEMAS
from conf.validate import validate_framework
from ledger.faithful.titan import fsdp as F
from ledger.faithful.titan import pp as PP
from ledger.faithful.titan import pp_peak as PK
from ledger.faithful.titan import states as L
from ledger.faithful.titan import peak as P
from ledger.layout import ConfigError
from ledger.model import ModelShape, preset
from ledger.placement import PEAK_PARTS
from tests.conftest import titan_fw as _fw, titan_layout as _lay


def _schema(**kw):
    fw = OmegaConf.structured(FRAMEWORK_SCHEMAS["titan"])
    for k, v in kw.items():
        fw[k] = v
    return fw


def test_ac_knobs_default_as_torchtitan_and_are_validated_naming_the_field():
    """Unset, torchtitan 0.3.0 checkpoints selectively (Trainer.Config.activation_checkpoint's
    default_factory, read from the installed trainer here)."""
    import dataclasses

    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.trainer import Trainer

    ac = next(f for f in dataclasses.fields(Trainer.Config) if f.name == "activation_checkpoint")
    assert ac.default_factory is SelectiveAC.Config
    fw = _schema()
    assert (fw.activation_checkpoint, fw.selective_ac_option) == ("selective", "op")
    for mode in ("none", "selective", "full"):
        validate_framework(_schema(activation_checkpoint=mode))
    with pytest.raises(ConfigError, match="framework.activation_checkpoint='memory_budget'"):
        validate_framework(_schema(activation_checkpoint="memory_budget"))
    # torchtitan 0.3.0 SelectiveAC has the per-op policy only: the every-n-layers integer is refused
    with pytest.raises(ConfigError, match=r"framework.selective_ac_option='2' must be 'op'"):
        validate_framework(_schema(selective_ac_option=2))


@pytest.mark.parametrize("mode,expr", [("none", "activation_checkpoint=None,"),
                                       ("full", "activation_checkpoint=FullAC.Config(),"),
                                       ("selective", "activation_checkpoint=SelectiveAC.Config(),")])
def test_ac_mode_reaches_the_trainer_config(mode, expr):
    from launchers.titan import render_module

    from tests.conftest import compose_config as _compose

    cfg = _compose("framework=titan", f"framework.activation_checkpoint={mode}")
    src = render_module(cfg, _lay(world=2), "/tok", "/data", "/job/titan_dump")
    assert expr in src
    # the names it uses are torchtitan 0.3.0's
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: F401
    from torchtitan.trainer import Trainer
    assert "activation_checkpoint" in Trainer.Config.__dataclass_fields__


def test_saved_per_layer_is_the_measured_block():
    """tiny at seq 128, one sequence: the probe's saved tensors of one block (tests/test_titan's dp2
    jobs; 1,659,904 bytes without AC), the checkpoint input alone (full), the input plus wq, wv, w1,
    w2 outputs (selective)."""
    m = preset("tiny")
    assert P.saved_per_layer(m, 1, 128, "none")[:2] == (1_659_904, 0)
    assert P.saved_per_layer(m, 1, 128, "full")[:2] == (65_536, 0)
    assert P.saved_per_layer(m, 1, 128, "selective")[:2] == (65_536, 65_536 + 16_384 + 196_608 + 65_536)


@pytest.mark.parametrize("raf", ["default", "never"])
def test_peak_parts_and_ac_order(raf):
    m = preset("tiny")
    peaks = {}
    for ac in ("none", "selective", "full"):
        st = L.place(m, _lay(world=2), _fw(reshard_after_forward=raf, activation_checkpoint=ac)).rank_state(0)
        pk = st.peak
        assert set(pk.parts) == set(PEAK_PARTS) and sum(pk.parts.values()) == pk.bytes and pk.phase == "backward"
        assert pk.parts["resident"] >= st.params_bytes + st.grads_bytes + st.optim_bytes + st.other_bytes
        peaks[ac] = pk
    assert peaks["none"].bytes > peaks["selective"].bytes > peaks["full"].bytes
    assert peaks["none"].parts["activations"] > peaks["full"].parts["activations"]


def test_never_holds_the_unsharded_blocks_and_gathers_nothing_in_backward():
    """At the last block's reduce-scatter: "never" keeps every block before and tok_embeddings
    unsharded and prefetches no all-gather; at lm_head's (the loss's last chunk) [norm, lm_head] is
    unsharded whatever the setting, and every block with "never"."""
    m = preset("tiny")
    sh = F.sharded(m, 1, 2)
    emb, block, head = (sum(math.prod(p.shape) for p in u) for u in F.unit_params(m, 1, 0))
    args = (m, _lay(world=2))
    res = 28_395_676  # tiny dp2's resident state (the state rows reconcile it to the byte)

    def at(raf, k=None):
        fw = _fw(reshard_after_forward=raf)
        if k is None:
            return P.at_lm_head(*args, fw, sh, res, block, emb, head)
        return P._at_block(*args, fw, sh, res, block, emb, k)

    d, n = at("default", m.layers - 1), at("never", m.layers - 1)
    assert n.parts["resident"] - d.parts["resident"] == ((m.layers - 1) * block + emb) * 2
    assert d.parts["gathered"] - n.parts["gathered"] == sh.layer_full * 2  # the backward prefetch
    assert at("default").parts["resident"] - res == head * 2
    assert at("never").parts["resident"] - res == (head + m.layers * block + emb) * 2
    # the peak is the most of them
    for raf in ("default", "never"):
        pk = L.place(m, _lay(world=2), _fw(reshard_after_forward=raf)).rank_state(0).peak
        assert pk.bytes == max([at(raf).bytes] + [at(raf, k).bytes for k in range(m.layers)])


def test_every_layout_has_a_peak_and_its_note():
    m = ModelShape(layers=4, hidden=256, ffn_hidden=768, heads=8, kv_heads=2, vocab=1024, seq_len=256)
    for kw, fw in ((dict(dp_replicate=2), _fw()), (dict(tp=2), _fw()), (dict(tp=2, sequence_parallel=True), _fw()),
                   (dict(cp=2), _fw()), (dict(tp=2, cp=2, sequence_parallel=True), _fw()),
                   (dict(pp=2), _fw(activation_checkpoint="none")), (dict(pp=2), _fw(activation_checkpoint="full"))):
        pl = L.place(m, _lay(world=4, **kw), fw)
        assert pl.rank_state(0).peak is not None and any("on CUDA" in n for n in pl.notes), kw


def _walk_of(m, lay, peak):
    """A PP rank's peak less the step's batch lines beside every moment (peak.pp_batch_lines, measured by the real
    matrix): (bytes, what, detail) as the moments' walk gives them."""
    keys = set(P.pp_batch_lines(m, lay, True, True))
    lines = {k: v for k, v in peak.detail.items() if k in keys}
    assert lines  # every PP peak carries them
    return peak.bytes - sum(lines.values()), peak.what, {k: v for k, v in peak.detail.items() if k not in keys}


def _pp_moments(m, lay, rank):
    from math import prod

    st = L.place(m, lay, _fw(activation_checkpoint="none")).rank_state(rank)
    s, ds = st.stage, lay.dp_shard
    emb, block, head = [sum([prod(p.shape) for p in u]) for u in F.unit_params(m, 1)]
    return st, PK.pp_moments(m, lay, PP.pp_stages(m.layers, lay.pp)[s], s, PP._stage_sharded(m, 1, ds, lay.pp, s),
                            st.params_bytes + st.optim_bytes + st.other_bytes, st.grads_bytes, emb, block, head)


@pytest.mark.parametrize("seq,ac,gpipe,tp", [(32, "none", False, 1), (1024, "none", False, 1), (1024, "full", False, 1),
                                              (1024, "none", True, 1), (512, "selective", False, 2), (512, "none", True, 2)])
def test_pp_peak_fast_path_is_the_first_most_of_the_moments(seq, ac, gpipe, tp):
    """pp_peak prices each backward's block moments as bytes and builds the first most alone (pp_peak.block_peaks):
    on every stage, with and without checkpointing, GPipe, TP with SP, it is the first most of every moment built."""
    from math import prod

    m = ModelShape(layers=6, hidden=128, ffn_hidden=384, heads=4, kv_heads=2, vocab=512, seq_len=seq)
    lay = _lay(world=2 * tp, pp=2, tp=tp, sequence_parallel=tp > 1, global_batch_size=3)
    emb, block, head = [sum([prod(p.shape) for p in u]) for u in F.unit_params(m, tp)]
    for s in range(lay.pp):
        c = PK._stage(m, lay, PP.pp_stages(m.layers, lay.pp)[s], s, PP._stage_sharded(m, tp, lay.dp_shard, lay.pp, s),
                      10**6, 10**5, emb, block, head, ac, gpipe=gpipe)
        every, fast = PK._moments(c), PK._moments(c, most_only=True)
        assert len(fast) < len(every) or c.last  # (the last stage's backward: pp_peak's own last-micro-batch moments)
        assert max(fast, key=lambda x: x.bytes) == max(every, key=lambda x: x.bytes)


def test_pp_moments_follow_pipelining():
    """pp_peak's moments (tests/test_titan.py's real PP jobs measure them): the peak is the most; stage
    by stage the kinds each stage has; perform_reduce_grad from unit to unit trades the next unit's
    bf16 params and fp32 accumulators for this one's sharded grad (gloo's held last grad aside); a
    micro-batch's backward after the first holds every unit's accumulators; the gloo-held grad is
    there only with a shard group of more than one."""
    m = ModelShape(layers=8, hidden=256, ffn_hidden=768, heads=8, kv_heads=2, vocab=1030, seq_len=32)
    block = sum([math.prod(s) for _, s in m.layer_params(0)])
    for ds in (1, 2):
        lay = _lay(world=4 * ds // 2 if ds == 2 else 2, pp=2, global_batch_size=4)
        for rank in range(lay.world):
            st, ms = _pp_moments(m, lay, rank)
            assert _walk_of(m, lay, st.peak)[:2] == (max(x.bytes for x in ms), max(ms, key=lambda x: x.bytes).what)
            last = st.stage == lay.pp - 1
            assert any(x.what.startswith("lm_head") for x in ms) == last
            # every stage backpropagates blocks: micro-batches 0 and 1 before the last stage, its last one there
            blocks = {x.what.split(" backward")[0] for x in ms if "backward at block" in x.what}
            want = {f"micro-batch {lay.num_microbatches - 1}"} if last else {"micro-batch 0", "micro-batch 1"}
            assert blocks == want
            red = [x for x in ms if x.what.startswith("perform_reduce_grad: block")]
            sh = PP._stage_sharded(m, 1, ds, lay.pp, st.stage)
            for a, b in zip(red, red[1:]):
                assert a.bytes - b.bytes == block * 2 + block * 4 - sh.layer_full // ds * 4
            bwd = {x.what: x for x in ms if "backward at block" in x.what}
            if not last:
                k = PP.pp_stages(m.layers, lay.pp)[st.stage][2] - 1
                first, later = bwd[f"micro-batch 0 backward at block {k}'s attention_norm"], \
                    bwd[f"micro-batch 1 backward at block {k}'s attention_norm"]
                # micro-batch 1: every unit's accumulators (tok_embeddings' too on stage 0); 1F1B keeps
                # min(P - s, n - i) micro-batches in flight, one fewer at this job's stage 0 ... the same
                assert later.parts["temporary"] - first.parts["temporary"] == \
                    (m.vocab * m.hidden * (st.stage == 0) + (k + 1) * block) * 4
            if last:
                loss = next(x for x in ms if x.what.startswith("lm_head"))
                held = loss.detail["temporary/fp32 accumulated grads (blocks; lm_head's held)"] - \
                    PP.pp_stages(m.layers, lay.pp)[st.stage][2] * block * 4
                assert held == (m.vocab * m.hidden * 4 if ds > 1 else 0)


def test_tp_blocks_save_their_heads_and_ffn_columns():
    """tp2 without SP at seq 32 (the probe's tp2·dp2 job): norms whole, q/k/v, SDPA and SwiGLU over tp."""
    m = ModelShape(layers=4, hidden=256, ffn_hidden=768, heads=8, kv_heads=2, vocab=1030, seq_len=32)
    T = 32
    norms = 2 * (2 * T * 256 * 4 + T * 4 + T * 256 * 2)
    attn = T * 32 * 2 + T * 16 * 8 + T * 128 * 2 + T * 32 * 2 + 32 * 32 * 2 + T * 128 * 2 + 4 * 32 * 4
    assert P.saved_per_layer(m, 1, 32, "none", tp=2)[0] == norms + attn + 4 * T * 384 * 2


def test_gloo_copy_race_names_the_other_outcome():
    """dp4 reshard always (vocab 1030, seq 32): one loaded run measured rank 1 at 24,493,672 bytes,
    gloo's reduce-scatter copy still alive at the next block's copy-out; the ledger names that
    outcome (titan_peak.RACE) beside its peak; a shard group of one (no gloo copy) has none."""
    m = ModelShape(layers=4, hidden=256, ffn_hidden=768, heads=8, kv_heads=2, vocab=1030, seq_len=32)
    pk = L.place(m, _lay(world=4), _fw(reshard_after_forward="always")).rank_state(1).peak
    assert pk.bytes == 23_740_000 and pk.detail[P.RACE] == 24_493_664
    assert P.RACE not in L.place(m, _lay(world=2, tp=2), _fw()).rank_state(0).peak.detail


def test_first_step_peak_is_the_moment_without_what_step_0_has_not_made():
    """peak.FirstStep: at the loss's moments no unit has been reduced, so step 0 holds neither AdamW's
    state nor any sharded grad; at block k's reduce-scatter the grads of lm_head, the norm and the
    blocks after k exist; where every moment falls under it, the state the first optimizer step makes.
    PP (pp_peak): its moments hold the grads of any step already, less AdamW's state."""
    m = preset("tiny", seq_len=512)
    st = L.place(m, _lay(2), _fw()).rank_state(0)
    pk = st.peak
    assert pk.first is not None and "first step" in pk.first.what
    if pk.what.startswith(("lm_head", "a loss chunk")):
        assert pk.first.bytes == pk.bytes - st.optim_bytes - st.grads_bytes
    # the blocks' moments: a unit's grads count once it is reduced
    sh = F.sharded(m, 1, 2)
    fs = P.FirstStep(st.optim_bytes, st.grads_bytes)
    assert fs.grads_done(0, m.layers, sh) == 0
    total = sh.emb_full + sh.norm_full + sh.lm_full + m.layers * sh.layer_full
    # every unit but tok_embeddings, reduced last
    assert fs.grads_done(2 + m.layers, m.layers, sh) == st.grads_bytes * (total - sh.emb_full) // total
    # a short sequence: every backward moment less the state is under the state itself
    short = L.place(preset("tiny", seq_len=32), _lay(2), _fw()).rank_state(0)
    assert short.peak.first.phase == "optimizer" and short.peak.first.bytes == short.resident_bytes
    # PP: the same moment less AdamW's state, or the state
    pp = L.place(preset("tiny", seq_len=1024), _lay(2, pp=2), _fw()).rank_state(0)
    assert pp.peak.first.bytes in (pp.peak.bytes - pp.optim_bytes, pp.resident_bytes)


def _looped(m, lay, fw, rank):
    """pp_looped's stages and actions of PP rank `rank` (its first shard rank), as pp.py builds them."""
    from math import prod

    from ledger.faithful.titan import pp_looped as LP
    from ledger.faithful.titan.schedules import local_stages

    S, ds = lay.pp * lay.vp, lay.dp_shard * lay.cp
    st = L.place(m, lay, fw).rank_state(rank)
    m = F.as_built(m, fw)  # (the model as torchtitan builds it: its wqkv fused where framework.fuse_qkv)
    emb, block, head = [sum([prod(p.shape) for p in u]) for u in F.unit_params(m, lay.tp)]
    kept = st.params_bytes + st.optim_bytes + st.other_bytes
    local = [(s, PP.pp_stages(m.layers, S)[s], PP._stage_sharded(m, lay.tp, ds, S, s))
             for s in local_stages(st.stage, lay.pp, lay.vp, fw.pipeline_parallel_schedule)]
    cs = LP.looped_stages(m, lay, local, kept, emb, block, head, fw.activation_checkpoint, PK.RULES[PK.CPU_GLOO])
    return st, cs, LP.rank_actions(fw.pipeline_parallel_schedule, lay.pp, lay.vp, lay.num_microbatches, st.stage)


_LOOPED_CASES = [(dict(), "none"), (dict(dp_replicate=2), "none"), (dict(tp=2, sequence_parallel=True), "full"),
                 (dict(cp=2), "none"), (dict(vp=3, global_batch_size=6), "full"),
                 (dict(tp=2, sequence_parallel=True, global_batch_size=8), "selective")]


@pytest.mark.parametrize("sched,kw,ac", [(s, kw, ac) for s in ("Interleaved1F1B", "LoopedBFS") for kw, ac in _LOOPED_CASES]
                         + [(s, dict(vp=4, global_batch_size=8), "none") for s in ("Interleaved1F1B", "LoopedBFS")]
                         # (8 blocks over 8 stages, 16 micro-batches: torch's mid-step UNSHARD / RESHARD move another
                         # stage's params than the acting one's, which a fast path must follow)
                         + [(s, dict(vp=4, global_batch_size=16, layers=8), "none") for s in ("Interleaved1F1B", "LoopedBFS")]
                         # the split backwards (I and W): looped, over HSDP, three stages a rank, the V placements
                         + [("InterleavedZeroBubble", kw, "none") for kw in (dict(), dict(dp_replicate=2),
                                                                            dict(vp=3, global_batch_size=6),
                                                                            dict(tp=2, sequence_parallel=True))]
                         + [("ZBVZeroBubble", dict(tp=2, global_batch_size=16), "none")]
                         # (DualPipeV: at least as many micro-batches as stages)
                         + [(s, kw, "none") for s in ("ZBVZeroBubble", "DualPipeV")
                            for kw in (dict(global_batch_size=16), dict(global_batch_size=32, layers=8))])
def test_looped_peak_is_the_walks_most_and_its_grads_the_states(sched, kw, ac):
    """pp_looped.py: the rank's peak (the fast path, _most) is the first most of looped_moments (the readable
    reference), each stage's counts at every action its counts_reference, step 0's differs from it by the optimizer state alone, and the walk's grads at the step's end
    (every stage reduce-scattered, the [norm, lm_head] outputs a grad views) are the state's grads (pp.py's
    rule of the norm's view); each stage has its kinds of moment, on the last stage every loss's."""
    from ledger.faithful.titan import pp_looped as LP

    kw = dict(kw)
    m = ModelShape(layers=kw.pop("layers", 6), hidden=128, ffn_hidden=384, heads=4, kv_heads=2, vocab=1030, seq_len=256)
    lay = _lay(world=8, pp=2, **{"vp": 2, "global_batch_size": 4, **kw})
    # (torchtitan's fused wqkv under SP and selective AC: what its recomputes leave alive into the next step)
    fw = _fw(pipeline_parallel_schedule=sched, activation_checkpoint=ac, fuse_qkv=ac == "selective")
    for rank in range(lay.world):
        st, cs, actions = _looped(m, lay, fw, rank)
        ms = LP.looped_moments(cs, actions)
        best = max(ms, key=lambda x: x.bytes)
        assert _walk_of(m, lay, st.peak) == (best.bytes, best.what, best.detail)
        if st.peak.first:
            assert st.peak.bytes - st.peak.first.bytes == st.optim_bytes
        assert LP.looped_end_grads(cs, actions) == st.grads_bytes
        # the walk's structure at every action, its fast tuple as the readable one
        for _, _, _, held in LP._steps(cs, actions, lay.pp):
            assert all(h.counts() == h.counts_reference() for h in held)
        # (a last stage of no blocks reduces its final norm alone; a first of none its tok_embeddings)
        assert {int(x.what.rsplit("stage ", 1)[1]) for x in ms if "perform_reduce_grad" in x.what} == \
            {c.s for c in cs if c.order}
        assert {int(x.what.rsplit("stage ", 1)[1]) for x in ms if "backward at block" in x.what
                or "'s I at block" in x.what} == {c.s for c in cs if c.Ls}
        losses = {x.what for x in ms if x.what.startswith("lm_head reduce-scatter")}
        assert len(losses) == (lay.num_microbatches if any(c.has_head for c in cs) else 0)


def test_looped_schedules_refuse_what_the_walk_does_not_derive():
    """looped_unmodelled: a split backward under activation checkpointing is refused, with the reason in the
    prediction's notes and no peak row; without, and Interleaved1F1B's and LoopedBFS's four stages a rank (torch's
    UNSHARD / RESHARD mid-step), are walked."""
    from ledger.faithful.titan import pp_looped as LP

    for sched in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert "split backward" in LP.looped_unmodelled(sched, "full") and LP.looped_unmodelled(sched) is None
    assert LP.looped_unmodelled("LoopedBFS") is None and LP.looped_unmodelled("Interleaved1F1B") is None
    m = ModelShape(layers=6, hidden=128, ffn_hidden=384, heads=4, kv_heads=2, vocab=1030, seq_len=32)
    zb_lay = _lay(world=4, pp=2, vp=2, global_batch_size=8)
    zb = L.place(m, zb_lay, _fw(pipeline_parallel_schedule="InterleavedZeroBubble", activation_checkpoint="selective"))
    assert zb.rank_state(0).peak is None and any("split backward" in n and "no peak row" in n for n in zb.notes)
    assert L.place(m, zb_lay, _fw(pipeline_parallel_schedule="InterleavedZeroBubble")).rank_state(0).peak is not None
    lay = _lay(world=4, pp=2, vp=4, global_batch_size=8)
    for sched in ("Interleaved1F1B", "LoopedBFS"):
        assert L.place(m, lay, _fw(pipeline_parallel_schedule=sched)).rank_state(0).peak is not None


@pytest.mark.parametrize("sched,pp,vp,n", [("Interleaved1F1B", 2, 2, 4), ("Interleaved1F1B", 4, 3, 8),
                                           ("LoopedBFS", 2, 3, 6), ("Interleaved1F1B", 4, 2, 6)])
def test_looped_actions_are_torchs_lowering(sched, pp, vp, n):
    """pp_looped.rank_actions leaves out torch's UNSHARD / RESHARD: with no more than 3 stages a rank torch's own
    lowering (_add_unshard_reshard, then _add_reduce_grad) unshards every stage before the first compute action
    and reshards none before its REDUCE_GRAD, and its compute and REDUCE_GRAD actions are rank_actions'."""
    from torch.distributed.pipelining.schedules import _ComputationType as C
    from torch.distributed.pipelining.schedules import _add_reduce_grad, _add_unshard_reshard

    from ledger.faithful.titan import pp_looped as LP
    from ledger.faithful.titan.schedules import rank_compute_order

    for rank in range(pp):
        compute = [a for a in rank_compute_order(sched, pp, vp, n, rank) if a is not None]
        torch_order = _add_reduce_grad(_add_unshard_reshard(compute), n)
        kinds = [a.computation_type for a in torch_order]
        assert kinds[:vp] == [C.UNSHARD] * vp and kinds.count(C.UNSHARD) == vp
        for i, a in enumerate(torch_order):
            if a.computation_type == C.RESHARD:
                assert _done_before(torch_order, i, a.stage_index, C.REDUCE_GRAD)
        assert [a for a in torch_order if a.computation_type not in (C.UNSHARD, C.RESHARD)] == list(
            LP.rank_actions(sched, pp, vp, n, rank))


def _done_before(order, i, stage, kind) -> bool:
    return any(a.stage_index == stage and a.computation_type == kind for a in order[:i])
