"""torchtitan 0.3.0 MoE: its qwen3 MoE through its own Trainer with expert parallelism over
dp_shard, against the faithful ledger (ledger/faithful/titan/moe.py), real CPU/gloo runs.

One shared sweep (13 jobs, two steps): at s=128 ep1 at world 2 (no expert parallelism: the experts in
the blocks' FSDP groups), ep2 at world 2 (efsdp 1: the experts unsharded by FSDP,
the EP group is the whole world, torchtitan's default group; no q/k norms), and with Qwen3's q/k norms
ep2 at world 4 (efsdp 2: the experts'
own FSDP all-gathers and reduce-scatters), ep4 at world 4, and ep2 at world 4 with
reshard_after_forward=never and micro-batch 2; at s=512 ep1 and ep2 at world 2 (also with full and with selective activation checkpointing) and ep2 at world 4 (also with selective).
Every state row and every collective count and fixed
byte row (first and steady steps) reconciles with abs_err 0; the routed all-to-all bytes lie in the
predicted range and sum over each EP group to the balanced prediction. The peaks (ledger/faithful/titan/
moe_activations.py, moe_peak.py): ep1's exact; EP's inside their routed bound and, re-predicted at the rows
each block's experts computed in the run (read from the probe's census), exact; the last block's forward
moment at those rows, the step's forward maximum. q / k / v fused, as torchtitan builds them.
"""
from __future__ import annotations

import pytest

import records
from analysis import reconcile
from ledger.layout import ConfigError, validate
from ledger.model import preset
from tests.conftest import assert_every_row_reconciles, assert_jobs, assert_states_on_every_rank, layout_of, routed_rows_by_ep_group, run_sweeps

# activation checkpointing off but in the w2ac (full) and w2sac / w4sac (selective: torchtitan's default) jobs;
# q / k / v fused (torchtitan's default)
COMMON = ("framework=titan", "model=tiny_moe", "train.steps=2")
NO_AC = "framework.activation_checkpoint=none"
# the world-4 jobs with Qwen3's per-head q/k norms (model.qk_layernorm: torchtitan's qwen3 builds them),
# the world-2 one without (its attention's qk_norm off)
SWEEPS = (
    # ep1: the experts are the blocks' params like the rest (one FSDP group, one grad-norm reduce)
    ("w2", ("cluster.ranks=2", "layout={ep:2},{}", NO_AC)),
    ("w4", ("cluster.ranks=4", "model.qk_layernorm=true", "layout={ep:2},{ep:4}", NO_AC)),
    ("w4never", ("cluster.ranks=4", "model.qk_layernorm=true", "layout={ep:2,micro_batch_size:2}",
                 "framework.reshard_after_forward=never", NO_AC)),
    # s = 512: the EP peaks move to an MoE layer's combine backward (efsdp 1 and 2), ep1's to lm_head's
    # reduce-scatter with the MoE saves of four blocks
    ("w2s512", ("cluster.ranks=2", "model.seq_len=512", "layout={ep:2},{}", NO_AC)),
    ("w4s512", ("cluster.ranks=4", "model.seq_len=512", "model.qk_layernorm=true", "layout={ep:2}", NO_AC)),
    # full activation checkpointing: the recompute's all-to-alls; the peak in block 0's recompute (its
    # combine forward, or its combine backward after it); selective: what its policy keeps (at world 4
    # the peak in block 1's recompute, block 0's kept outputs below it)
    ("w2ac", ("cluster.ranks=2", "model.seq_len=512", "layout={ep:2},{}", "framework.activation_checkpoint=full")),
    ("w2sac", ("cluster.ranks=2", "model.seq_len=512", "layout={ep:2},{}", "framework.activation_checkpoint=selective")),
    ("w4sac", ("cluster.ranks=4", "model.seq_len=512", "model.qk_layernorm=true", "layout={ep:2}",
               "framework.activation_checkpoint=selective")),
)
EXPECTED = {("dp2", "default", 1, 128, "none"), ("ep2·dp2", "default", 1, 128, "none"),
            ("ep2·dp4", "default", 1, 128, "none"), ("ep4·dp4", "default", 1, 128, "none"),
            ("ep2·dp4", "never", 2, 128, "none"), ("dp2", "default", 1, 512, "none"), ("ep2·dp2", "default", 1, 512, "none"),
            ("ep2·dp4", "default", 1, 512, "none"), ("dp2", "default", 1, 512, "full"), ("ep2·dp2", "default", 1, 512, "full"),
            ("dp2", "default", 1, 512, "selective"), ("ep2·dp2", "default", 1, 512, "selective"),
            ("ep2·dp4", "default", 1, 512, "selective")}


def _job(rec) -> tuple:
    return (records.layout_name(rec), rec["config"]["framework"]["reshard_after_forward"],
            rec["config"]["layout"]["micro_batch_size"], rec["config"]["model"]["seq_len"],
            rec["config"]["framework"]["activation_checkpoint"])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return run_sweeps(tmp_path_factory.mktemp("titan_moe_sweep"), SWEEPS, COMMON)


@pytest.mark.real
def test_matrix_ran(sweep):
    assert_jobs(sweep, _job, EXPECTED)


@pytest.mark.real
def test_every_state_and_collective_row_reconciles(sweep):
    assert_states_on_every_rank(sweep)
    assert_every_row_reconciles(sweep["table"], sweep["ok"],
                                routed={"comm/ep/all_to_all/buffer_bytes", "comm/dp/all_to_all/buffer_bytes"})
    df = sweep["table"]
    assert df[reconcile.off(df)].empty, df[reconcile.off(df)].to_string()  # its peaks too
    assert df["bound_low"].notna().any()


@pytest.mark.real
def test_routed_all_to_all_sums_to_the_balanced_prediction_over_each_ep_group(sweep):
    """The sparse mesh (.., efsdp, ep) puts ep innermost: an EP group is the ranks of one rank // ep."""
    groups = list(routed_rows_by_ep_group(sweep))
    assert groups
    for job, step, members in groups:
        assert sum(r.measured for r in members) == sum(r.predicted for r in members), (job, step, members)


@pytest.mark.real
def test_experts_are_sharded_over_ep_then_efsdp(sweep):
    """Each rank's expert fp32 shards: 4 layers x 3 x 8 x 512 x 256 elements over ep x efsdp = world."""
    for rec in sweep["ok"]:
        p = records.predicted_ranks(rec["prediction"])(0)
        world = rec["measurement"]["world"]
        assert p["detail"]["params/expert fp32 shards (ep, then efsdp dim-0 padded)"] == 4 * 4 * 3 * 8 * 512 * 256 // world
        assert rec["measurement"]["ranks"][0]["steps"][-1]["state"]["params_bytes"] == p["params_bytes"]


@pytest.mark.parametrize("over,msg", [(dict(moe_layer_freq=2), "every layer MoE"),
                                      (dict(moe_shared_expert_hidden=256), "no shared experts")])
def test_refuses_a_shape_its_qwen3_is_not(over, msg):
    with pytest.raises(ConfigError, match=msg):
        validate(preset("tiny_moe", **over), layout_of(2, ep=2), "titan")


def test_ep_must_divide_dp_shard_and_tp_is_refused():
    m = preset("tiny_moe")
    with pytest.raises(ConfigError, match="tp=2"):
        validate(m, layout_of(4, tp=2, ep=2), "titan")
    with pytest.raises(ConfigError, match="ep=4 does not divide dp_shard=2"):
        validate(m, layout_of(2, ep=4), "titan")


@pytest.mark.real
def test_ep1_peaks_are_exact(sweep):
    """Without EP the rows are fixed (T*k): every steady peak row to the byte, inside the probe's
    thread-timing range (compare.peak_gap: a gloo worker thread may free a storage after the main thread
    went on), every first-step row within 1%."""
    from analysis.compare import peak_gap

    df = sweep["table"]
    pk = df[(df.quantity == "peak_bytes") & ~df.job.isin(
        [records.job_name(r) for r in sweep["ok"] if r["config"]["layout"].get("ep", 1) > 1])]
    steady, first = pk[pk.phase == "steady"], pk[pk.phase == "first"]
    assert len(steady) and (peak_gap(steady) == 0).all(), steady.to_string()
    # (a steady row is judged by its gap alone: a late free by gloo's worker thread can lift the
    # measurement by its race_bytes, 1.8% once at s = 512)
    assert len(first) and (first.rel_err.abs() < 0.01).all(), first.to_string()


def _routed_rows(step, model) -> tuple[int | None, ...]:
    """Each block's rows its experts computed in a step, from the census: w1's and w3's grouped_mm outputs
    (bf16 [R, F] each) are one census group per block."""
    import re

    rows = [None] * model.layers  # a block whose saves the peak no longer holds: unknown
    for c in step["peak"]["census"]:
        m = re.search(r"layers\.(\d+)\.moe\.routed_experts\.inner_experts$", c["module"] or "")
        if m and c["op"] == "aten._grouped_mm.default" and c["phase"] == "forward" and c["category"] == "activations":
            rows[int(m.group(1))] = c["bytes"] // (2 * model.expert_ffn * 2)
    return tuple(rows)


def _ep_ranks_without_checkpointing(sweep):
    """Each rank of the EP jobs without activation checkpointing, its last step and the rows each block
    routed there: (record, config, model, layout, placement, rank's measurement, step, rows). (The
    checkpointed jobs' recompute moments are judged with the rest inside their bound: at the rows they
    routed 2,080 B to 4,096 B of the recompute's small routing tensors are not named.)"""
    from conf.schema import load
    from launchers.job import check

    for rec in sweep["ok"]:
        if rec["config"]["layout"].get("ep", 1) == 1 or rec["config"]["framework"]["activation_checkpoint"] != "none":
            continue
        cfg = load(rec["config"])
        model, lay, pl = check(cfg)
        for m in rec["measurement"]["ranks"]:
            step = m["steps"][-1]
            yield rec, cfg, model, lay, pl, m, step, _routed_rows(step, model)


@pytest.mark.real
def test_ep_peaks_are_exact_at_the_rows_the_run_routed(sweep):
    """EP's steady peak re-predicted at each block's routed rows (moe_peak.ep_peak rows=) equals the
    measured one on every rank: the moments' buffers, grads and saves are exact, the bound covers routing.
    The rows of blocks whose saves the peak no longer holds are unknown: the moments holding them are left
    out (the run's peak is above them)."""
    from ledger.faithful.titan import moe_peak
    from ledger.faithful.titan.target import rules_of

    checked, exact = set(), 0
    for rec, cfg, model, lay, pl, m, step, rows in _ep_ranks_without_checkpointing(sweep):
        pk = moe_peak.ep_peak(model, lay, cfg.framework, pl.rank_state(m["rank"]), rules_of(None), rows)
        # the peak in the framework's own order (gloo's worker thread frees the all-to-alls' buffers when
        # it gets to it: the probe's prompt replay puts each free right after the last use), and the
        # probe's "unnamed" (storages live from the previous step no launcher names: 12 B at world 2,
        # 20 B at world 4, as in the dense matrix) aside: every part to the byte
        prompt = step["peak"].get("prompt_at_peak") or step["peak"]["at_peak"]
        got, want = pk.bytes - pk.parts["unnamed"], step["peak"]["prompt_peak_bytes"] - prompt.get("unnamed", 0)
        if got != want and None in rows:
            # the census is of the measured peak, which a late free by gloo's worker thread can move to a
            # moment lower in the model than the prompt one, whose blocks' rows it then lacks: never above
            assert got < want, (records.job_name(rec), m["rank"], pk.what, pk.parts, prompt)
            continue
        assert got == want, (records.job_name(rec), m["rank"], pk.what, pk.parts, prompt)
        checked.add(pk.what.split(" ", 1)[1].lstrip(": "))
        exact += 1
    # the moments the matrix reaches: the experts' reduce-scatter (s = 128) and the combine (s = 512), and most
    # ranks checked exactly
    assert {"experts' post-backward reduce-scatter (gloo)", "the MoE combine's backward (token_dispatcher.py)"} \
        <= checked, checked
    assert exact >= 12, exact


@pytest.mark.real
def test_ep_forward_combine_is_the_forward_maximum_at_the_rows_the_run_routed(sweep):
    """The last block's forward at its combine's cast back to bf16 (moe_peak._at_forward_combine: its saves
    complete, the combine's buffers, the next unit's prefetched and its own deferred all-gathers), at each
    block's routed rows, against the most the step's timeline holds in its forward: equal, or above it by
    no more than what gloo's worker thread freed late (the all-to-all's input, when the thread frees it
    after the main thread went on). Where a run's peak is elsewhere this moment is the runner-up routing
    decides: at ep2 world 4, s = 512, within 30 KB of the combine backward."""
    from ledger.faithful.titan import moe_peak
    from ledger.faithful.titan.target import rules_of

    judged, exact = 0, 0
    for rec, cfg, model, lay, pl, m, step, rows in _ep_ranks_without_checkpointing(sweep):
        if None in rows:  # the peak's census lacks a block's rows: not judged here
            continue
        rules = rules_of(None)
        c = moe_peak._common(model, lay, cfg.framework, pl.rank_state(m["rank"]), rules, rows)
        L = model.layers
        pk = moe_peak._at_forward_combine(model, lay, cfg.framework, moe_peak.ep_units(model, lay), c, L - 1,
                                          rows[L - 1], rules)
        live = [sum(v for k, v in p.items() if k not in ("event", "phase", "unnamed"))
                for p in step["timeline"] if p["phase"] == "forward"]
        got, most = pk.bytes - pk.parts["unnamed"], max(live)
        late = step["peak"]["worker_freed_bytes"]
        assert got <= most <= got + late, (records.job_name(rec), m["rank"], rows, got, most, late, pk.detail)
        judged += 1
        exact += got == most
    assert judged >= 2 and exact >= 1, (judged, exact)


def test_qwen3_block_saves_by_hand():
    """moe_activations.block_saves at tiny_moe, s = 512, B = 1, the CPU's rules, against the probe's census of
    one block (the s = 512 ep1 run): attention_norm and ffn_norm 786,432 + 524,288 + 2,048 each, the mask
    524,288, rope's q and k 327,680 and cache rows 131,072, SDPA's 278,528, v 65,536; the MoE layer's
    grouped_mm outputs 2,097,152, silu's and the product 1,048,576 each, the fp32 expert outputs 1,048,576,
    the routed input and sorted scores 526,336, softmax / topk / argsort / token indices 8,192 each, gather
    2,048, route_norm's sum 1,024, the offsets 32; with q/k norms (ep2 at world 4) 1,331,200 more, and EP
    the permuted indices (int64 per row) and the offsets of E/ep experts."""
    from ledger.faithful.titan import moe_activations
    from ledger.faithful.titan.target import RULES
    from ledger.target import CPU_GLOO

    m = preset("tiny_moe", seq_len=512)
    attention = 2 * (786_432 + 524_288 + 2_048) + 524_288 + 327_680 + 131_072 + 278_528 + 65_536
    moe = 2_097_152 + 2 * 1_048_576 + 1_048_576 + 526_336 + 4 * 8_192 + 2_048 + 1_024 + 32
    rules = RULES[CPU_GLOO]
    assert sum(moe_activations.block_saves(m, 1, 512, rules).values()) == attention + moe
    qk = preset("tiny_moe", seq_len=512, qk_layernorm=True)
    assert sum(moe_activations.block_saves(qk, 1, 512, rules).values()) == attention + moe + 1_331_200
    ep = sum(moe_activations.block_saves(qk, 1, 512, rules, ep=2, rows=992).values())
    per_row = 256 * 2 + 4 * 512 * 2 + 8  # routed input, the four [R, F] saves, the permuted index
    assert ep == attention + moe + 1_331_200 - (1024 - 992) * (per_row - 8) + 992 * 8 - 16


@pytest.mark.parametrize("ac", ["selective", "full", "none"])
def test_checkpointing_modes(ac):
    """Activation checkpointing with MoE: full's recompute runs the all-to-alls again (three more a layer at
    ep 2, measured), SelectiveAC keeps their outputs (none again, measured)."""
    from omegaconf import OmegaConf

    from conf.schema import TitanConfig
    from ledger.faithful.titan import moe

    fw = OmegaConf.structured(TitanConfig)
    fw.activation_checkpoint = ac
    a2a = {c.dtype: c.count for c in moe.place(preset("tiny_moe"), layout_of(2, ep=2), fw).rank_state(0).comm
           if c.kind == "all_to_all"}
    # per layer: the token counts once (twice with the recompute), the tokens four times (six)
    assert a2a == ({"int64": 8, "bf16": 24} if ac == "full" else {"int64": 4, "bf16": 16}), a2a
