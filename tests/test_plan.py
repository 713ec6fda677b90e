"""mode=plan: the search agrees with the per-layout prediction, its refusals are the ledger's
own, the numbers per row, the acceptance questions (the article's 70B on 1,024 GPUs, the Llama 3 405B
production layout), and the top-3 of a tiny plan run for real and reconciled."""
import json
import os

import pytest
import yaml

import records

from conf.schema import register
from conf.validate import validate_config
from ledger.layout import ConfigError, Layout, validate
from ledger.model import preset
from ledger.parallel import predict
from ledger.faithful.megatron.rules import pipeline_splits
from ledger.plan import (OVER_BUDGET, OVER_BUDGET_STAGE, PEAK_INCLUDES, REFUSED_ROWS, RESIDENT_ONLY, peak_of, Hardware, FrameworkView, Space, bubble, candidates, estimate, link_of,
                         per_stage, per_stage_walk, reason_key, search, step_flops)
from tests.conftest import REPO, compose_config, launch

register()

ROW_KEYS = {"framework", "layout", "knobs", "fits", "peak_bytes", "resident_bytes", "wire_bytes", "bubble",
            "est_step_s", "reason", "links", "peak_includes"}
LAYOUT_KEYS = {"tp", "pp", "vp", "cp", "dp", "dp_replicate", "ep", "micro_batch_size", "sequence_parallel"}


_compose = compose_config


def _bases(*names):
    from omegaconf import OmegaConf

    from conf.schema import FRAMEWORK_SCHEMAS

    return {n: OmegaConf.to_container(OmegaConf.structured(FRAMEWORK_SCHEMAS[n])) for n in names}


def _plan_job(tmp_path, *overrides):
    from launchers.job import run_job

    cfg = _compose("mode=plan", "wandb.mode=disabled", f"plan.sweep_dir={tmp_path / 'sweeps'}", *overrides)
    rec = run_job(cfg, str(tmp_path / "job"))
    assert rec["status"] == "ok", rec.get("error")
    with open(tmp_path / "job" / "plan.json") as f:
        return rec, json.load(f)


HW8 = Hardware(8, 4, int(80e9), 0.9, 989.0, 0.4, 3600.0, 400.0)


def test_search_is_the_ledger_per_layout():
    """Every row of a plan is what validate + predict say of that layout alone: the same resident
    bytes and most-loaded stage, or the same ConfigError (the planner's one rule of its own, TP inside a
    node, aside); refusals are counted by that reason with its numbers replaced."""
    # (a shape where DTensor redistributes activation-sized tensors in a block's backward under TP without SP)
    m = preset("tiny", layers=6, hidden=640, ffn_hidden=1792, heads=16, kv_heads=4, vocab=512, seq_len=640)
    sp = Space(8, (1, 2), (1, 2), 2, (1, 2, 3), (False, True), True)
    plan = search(m, HW8, sp, _bases("megatron", "deepspeed", "titan"))
    assert sum(c["layouts"] for c in plan.counts.values()) == len(plan.rows)
    by_reason = {}
    for r in plan.rows:
        lay = Layout(*(r.layout[k] for k in ("tp", "pp", "dp", "dp_replicate", "cp", "ep", "vp", "sequence_parallel",
                                             "micro_batch_size", "global_batch_size")))
        fw = FrameworkView(_bases(r.framework)[r.framework], **r.knobs)
        if r.reason and r.reason.startswith("plan: tp="):
            assert lay.tp > HW8.gpus_per_node
        else:
            try:
                validate(m, lay, r.framework, fw)
                pl = predict(m, lay, fw)
                g = pl.per_gpu
                assert r.status != "refused" and r.resident_bytes == g.resident_bytes
                # the peak: the largest of every stage's heaviest rank's predicted peak (its resident
                # state where the ledger predicts none), never below the resident state
                assert r.peak_bytes == max(s["peak_bytes"] for s in r.per_stage) >= r.resident_bytes
                assert r.fits == (r.peak_bytes <= HW8.budget_bytes)
                assert r.stage == g.stage
                assert sum(r.wire_bytes.values()) == sum(c.wire_bytes for c in g.comm)
            except ConfigError as e:
                assert r.status == "refused" and r.reason == str(e)
        if r.status == "refused":
            by_reason.setdefault((r.framework, reason_key(r.reason)), 0)
            by_reason[(r.framework, reason_key(r.reason))] += 1
    assert {k: v for k, v in by_reason.items()} == {(fw, k): v["count"] for fw, d in plan.refused.items()
                                                    for k, v in d.items()}
    assert all(c["fits"] for c in plan.counts.values())  # every framework has a fitting layout of tiny on 8
    order = [r for r in plan.rows if r.status != "refused"]
    assert [r.fits for r in order] == sorted((r.fits for r in order), reverse=True)
    fitting = [r.est_step_s for r in order if r.fits]
    assert fitting == sorted(fitting)


def test_rows_judged_on_their_peak_rank_before_those_on_their_resident_state():
    """The fitting rows judged on their peak first, then those that fit on their resident state only (no peak
    predicted: DeepSpeed-MoE with top-3 routing), each by step time."""
    plan = search(preset("tiny_moe", moe_router_topk=3), HW8, Space(8, (1, 2), (1, 2), 2, (1, 2, 3), (False, True), True),
                  _bases("megatron", "deepspeed"))
    order = [r for r in plan.rows if r.fits]
    judged = [r.peak_includes != RESIDENT_ONLY for r in order]
    assert judged == sorted(judged, reverse=True) and any(judged) and not all(judged)
    for j in (True, False):
        fitting = [r.est_step_s for r in order if (r.peak_includes != RESIDENT_ONLY) == j]
        assert fitting == sorted(fitting)


def test_listed_pipeline_schedules_are_tried_each_with_its_stages():
    """plan.pipeline_schedules: torchtitan's pipelines run each listed schedule with the stages a rank it takes (the V
    ones 2, InterleavedZeroBubble 2 to 3, 1F1B one); a split backward's rows carry their peak without recompute, are
    refused with torch's reason under selective recompute and fit on their resident state alone under full."""
    listed = ("1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    plan = search(preset("tiny", layers=6), HW8, Space(16, (1,), (1, 2), 1, (1,), (False,), False,
                                                       ("none", "selective", "full"), pipeline_schedules=listed),
                  _bases("titan"))
    pipelined = [r for r in plan.rows if r.layout["pp"] > 1]
    tried = {(r.knobs["pipeline_parallel_schedule"], r.layout["vp"]) for r in pipelined}
    assert tried == {("1F1B", 1), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)}
    for r in pipelined:
        split = r.knobs["pipeline_parallel_schedule"] != "1F1B"
        ac = r.knobs["activation_checkpoint"]
        if r.layout["tp"] > 2:  # (refused: tp must divide tiny's two KV heads)
            assert r.status == "refused" and "does not divide num_kv_heads" in r.reason
        elif split and ac == "selective":
            assert r.status == "refused" and "only allowed to backward once" in r.reason, r.reason
        elif r.status != "refused":
            assert (r.peak_includes == RESIDENT_ONLY) == (split and ac == "full"), (r.knobs, r.peak_includes)
    assert any(r.status != "refused" and r.knobs["pipeline_parallel_schedule"] == "ZBVZeroBubble"
               and r.peak_includes == PEAK_INCLUDES for r in pipelined)
    assert any(r.status != "refused" and r.knobs["pipeline_parallel_schedule"] == "InterleavedZeroBubble"
               and r.layout["tp"] > 1 and r.peak_includes == PEAK_INCLUDES for r in pipelined)  # (3D, its peak too)


@pytest.mark.parametrize("model,gpus", [(preset("tiny", layers=6), 8), (preset("llama3_1b", seq_len=1024), 64)])
def test_per_stage_from_the_ledgers_representatives_is_the_walk_over_every_rank(model, gpus):
    """The fast path (Placement.stage_representatives: Megatron's heaviest DP rank per stage class,
    torchtitan's shard rank 0) gives every stage's peak the walk over each rank does, for every
    predicted layout: uneven splits, vp, dist-opt shards of different sizes, torchtitan PP."""
    hw = Hardware(gpus, 8, int(80e9), 0.9, 989.0, 0.4, 3600.0, 400.0)
    plan = search(model, hw, Space(2 * gpus, (1, 2), (1, 2), 2, (1,), (False, True), False),
                  _bases("megatron", "titan"))
    rows = [r for r in plan.rows if r.placement is not None]
    assert any(r.layout["pp"] > 1 and r.framework == "titan" for r in rows)
    assert any(r.knobs.get("decoder_first_pipeline_num_layers") for r in rows) or model.layers % 4 == 0
    for r in rows:
        walk, every = per_stage_walk(r), per_stage(r)
        assert [s["peak_bytes"] for s in every] == [s["peak_bytes"] for s in walk]
        assert max(s["peak_bytes"] for s in r.per_stage) == r.peak_bytes
        for s in every:
            assert peak_of(r.placement.rank_state(s["rank"])) == s["peak_bytes"]


def test_a_search_over_worker_processes_gives_the_rows_of_one_process():
    """plan.workers: the candidates spread over forked processes a chunk at a time come back as the rows,
    counts and refusals one process gives, in the same order (their Placements left in the workers)."""
    from ledger import plan as P

    model, hw = preset("llama3_1b", seq_len=1024), Hardware(64, 8, int(80e9), 0.9, 989.0, 0.4, 3600.0, 400.0)
    space = Space(128, (1, 2), (1, 2), 2, (1,), (False, True), False)
    bases = _bases("megatron", "titan", "deepspeed")
    one = search(model, hw, space, bases)
    many = search(model, hw, space, bases, workers=2)
    assert len(one.rows) > 3 * P.WORKER_CHUNK  # (more chunks than workers)
    assert [r.to_dict() for r in many.rows] == [r.to_dict() for r in one.rows]
    assert (many.counts, many.refused, many.refused_unlisted) == (one.counts, one.refused, one.refused_unlisted)
    assert all(r.placement is None for r in many.rows) and P._FORKED is None


def test_a_too_big_row_prices_its_stages_until_one_is_over_the_budget():
    """A row whose resident state fits and one stage's peak does not is settled once that stage is priced
    (first and last stage first, then the others in order): its per_stage holds the stages priced, each the
    row every stage's pricing gives, one of them over the budget, and says so; a watched row has every stage."""
    model = preset("tiny", layers=6)
    space = Space(16, (1, 2), (1, 2, 4), 2, (1,), (False, True), False)
    free = search(model, HW8, space, _bases("titan"))
    # a budget amid the pipelined rows' stage peaks (the tiny rows' resident state is under all of them)
    peaks = sorted(s["peak_bytes"] for r in free.rows if r.layout["pp"] == 4 and r.per_stage for s in r.per_stage)
    hw = Hardware(8, 4, peaks[len(peaks) // 2], 1.0, 989.0, 0.4, 3600.0, 400.0)
    watch = {"framework": "titan", "pp": 4, "micro_batch_size": 2}
    plan = search(model, hw, space, _bases("titan"), watch=(watch,))
    cut = [r for r in plan.rows if r.peak_includes == OVER_BUDGET_STAGE]
    assert any(r.layout["pp"] == 4 for r in cut)
    for r in cut:
        every = per_stage(r)
        assert r.status == "too_big" and "other stages not priced" in r.reason and r.outside_allocator_bytes == 0
        assert 1 <= len(r.per_stage) < r.layout["pp"] and r.per_stage == [every[s["stage"]] for s in r.per_stage]
        assert [s["peak_bytes"] > hw.budget_bytes for s in r.per_stage].count(True) == 1
        priced = [s["stage"] for s in r.per_stage]
        last = r.layout["pp"] - 1
        # first, last, then the rest in order: the one over the budget is the last priced
        order = [st for st in (0, last, *range(1, last)) if st in priced]
        assert order == [0, last, *range(1, last)][:len(priced)]
        assert every[order[-1]]["peak_bytes"] > hw.budget_bytes
    watched = [r for r in plan.rows if r.matches(watch) and r.status == "too_big"]
    assert watched and all(len(r.per_stage) == 4 and r.peak_includes == PEAK_INCLUDES for r in watched)
    fits = [r for r in plan.rows if r.fits]
    assert fits and all(len(r.per_stage) == r.layout["pp"] for r in fits)


@pytest.mark.parametrize("sort", ["peak", "wire"])
def test_sort_orders_the_fitting_rows(sort):
    plan = search(preset("tiny"), HW8, Space(8, (1, 2)), _bases("megatron", "titan"), sort=sort)
    fits = [r for r in plan.rows if r.fits]
    key = (lambda r: r.peak_bytes) if sort == "peak" else (lambda r: r.wire_total)
    # those judged on a predicted peak first, those that fit on their resident state only after
    grouped = [(r.peak_includes == RESIDENT_ONLY, key(r)) for r in fits]
    assert len(fits) > 3 and grouped == sorted(grouped)


def test_enumerator_covers_the_space():
    """tp x pp x cp x dp = gpus, tp inside a node, pp up to the layers, cp up to max_cp; vp only with pp;
    SP only with tp; zero stages for DeepSpeed, dp_replicate for torchtitan."""
    m = preset("tiny")
    sp = Space(8, (1, 2), (1, 2), 2, (1, 3), (False, True), True)
    cs = list(candidates(m, HW8, sp, "megatron", _bases("megatron")["megatron"]))
    assert all(c.lay.world == 8 for c in cs)
    assert {c.lay.tp for c in cs if c.fw is not None} == {1, 2, 4}
    assert {c.lay.tp for c in cs if c.fw is None} == {8}
    assert max(c.lay.pp for c in cs) == 4 and max(c.lay.cp for c in cs) == 2
    assert all(c.lay.pp > 1 for c in cs if c.lay.vp > 1) and all(c.lay.tp > 1 for c in cs if c.lay.sequence_parallel)
    ds = list(candidates(m, HW8, sp, "deepspeed", _bases("deepspeed")["deepspeed"]))
    assert sorted({(c.knobs["zero_stage"], c.lay.micro_batch_size) for c in ds}) == [(1, 1), (1, 2), (3, 1), (3, 2)]
    ti = list(candidates(m, HW8, sp, "titan", _bases("titan")["titan"]))
    assert {c.lay.dp_replicate for c in ti if c.lay.dp == 8} == {1, 2, 4, 8}
    hw = Hardware(8, 4, int(80e9), 0.9, 989.0, 0.4, 3600.0, 400.0, tp_across_nodes=True)
    assert all(c.fw is not None for c in candidates(m, hw, sp, "megatron", _bases("megatron")["megatron"]))


def test_megatron_uneven_first_and_last_stages():
    """126 layers over 16 stages (Llama 3 405B): first = last = 7 and 14 x 8 in the middle, as Megatron
    builds it; an even split alone where pp divides the layers; Megatron's own reason where nothing
    splits."""
    assert (7, 7, False, False) in pipeline_splits(126, 16, 1)
    assert pipeline_splits(80, 16, 1) == [(None, None, False, False)]
    assert pipeline_splits(80, 1, 1) == [(None, None, False, False)]
    assert (None, None, True, True) in pipeline_splits(126, 16, 2)  # 7 is odd: no 7/7 with vp=2
    from ledger.faithful.megatron.pipeline import split_error

    for s in pipeline_splits(126, 16, 1) + pipeline_splits(126, 16, 2):
        assert split_error(126, 16, 2 if s[2] else 1, s) is None


def test_links_and_bubble():
    lay = Layout(8, 16, 128, 1, 1, 1, 1, True, 1, 2048)
    assert link_of(lay, "tp", "all_gather", 8) == "intra"
    assert link_of(lay, "dp", "reduce_scatter", 8) == "inter"
    assert link_of(lay, "pp", "send_recv", 8) == "inter"
    small = Layout(2, 2, 2, 1, 1, 1, 1, False, 1, 8)  # ranks: tp stride 1, dp stride 2, pp stride 4
    assert link_of(small, "dp", "all_reduce", 8) == "intra" and link_of(small, "pp", "send_recv", 4) == "inter"
    assert link_of(small, "pp", "send_recv", 8) == "intra" and link_of(small, "tp-dp-pp", "all_reduce", 4) == "inter"
    assert bubble(Layout(1, 4, 2, 1, 1, 1, 2, False, 1, 16)) == 3 / (2 * 8)
    assert bubble(Layout(2, 1, 4, 1, 1, 1, 1, False, 1, 16)) == 0


def test_estimate_is_the_documented_roofline():
    m = preset("llama3_8b")
    lay = Layout(1, 1, 8, 1, 1, 1, 1, False, 1, 8)
    hw = Hardware(8, 8, int(80e9), 0.9, 1000.0, 0.5, 8000.0, 800.0)
    flops = 8 * 8192 * (6 * (m.num_params() - m.vocab * m.hidden) + 12 * m.layers * 8192 * m.hidden)
    assert step_flops(m, lay) == flops
    e = estimate(m, lay, hw, "megatron", FrameworkView(overlap_grad_reduce=False), {"dp": 10 ** 9, "tp": 0}, {"dp": "intra",
                                                                                                       "tp": "intra"})
    assert e["compute_s"] == pytest.approx(flops / (8 * 1000e12 * 0.5))
    assert e["est_step_s"] == pytest.approx(e["compute_s"] + 1e9 * 8 / 8000e9)  # not overlapped: all exposed
    e = estimate(m, lay, hw, "megatron", FrameworkView(overlap_grad_reduce=True), {"dp": 10 ** 9}, {"dp": "intra"})
    assert e["est_step_s"] == e["compute_s"]  # hidden behind compute


@pytest.mark.parametrize("override,message", [
    ("plan.gpus=null", "plan.gpus is required for mode=plan"),
    ("plan.gpus=0", "plan.gpus=0 must be >= 1"),
    ("plan.gpus=12", "plan.gpus=12 must be a multiple of plan.gpus_per_node=8"),
    ("plan.memory_fraction=1.5", "plan.memory_fraction=1.5 must be <= 1"),
    ("plan.gpu_memory_gb=0", "plan.gpu_memory_gb=0.0 must be > 0"),
    ("plan.global_batch_tokens=1000", "plan.global_batch_tokens=1000 must be a multiple of model.seq_len=128"),
    ("plan.sort=fast", "plan.sort='fast' must be one of time, peak, wire"),
    ("plan.micro_batch_sizes=[0]", "plan.micro_batch_sizes has 0: each must be an integer >= 1"),
    ("plan.zero_stages=[4]", "plan.zero_stages has 4: each must be one of 1, 2, 3"),
    ("plan.vps=[]", "plan.vps=[] must list at least one value"),
    ("plan.name=a/b", "plan.name='a/b' must match"),
    ("plan.watch=[{tpp:8}]", "plan.watch[0] has tpp: its keys must be among"),
    ("plan.offload_optimizer=[nvme]", "plan.offload_optimizer has 'nvme': each must be one of none, cpu"),
    ("plan.host_memory_gb=0", "plan.host_memory_gb=0.0 must be > 0"),
    ("plan.workers=0", "plan.workers=0 must be >= 1"),
    ("plan.pipeline_schedules=[ZB1P]", "plan.pipeline_schedules has 'ZB1P': each must be one of 1F1B, GPipe"),
])
def test_bad_plan_input_names_the_field(override, message):
    cfg = _compose("mode=plan", "plan.gpus=16", "plan.global_batch_tokens=1024", override)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert message in str(e.value)


def test_framework_all_needs_mode_plan(tmp_path):
    from launchers.job import run_job

    rec = run_job(_compose("framework=all", "mode=predict", "wandb.mode=disabled"), str(tmp_path))
    assert rec["status"] == "invalid" and "framework=all plans over the three frameworks: it needs mode=plan" in rec["error"]
    rec = run_job(_compose("mode=plan", "plan.gpus=8", "wandb.mode=disabled"), str(tmp_path / "b"))
    assert rec["status"] == "invalid" and "plan.global_batch_tokens" in rec["error"]


def test_plan_settings_are_not_part_of_other_jobs_identity():
    import records

    cfg = {"mode": "run", "model": {"name": "tiny"}, "plan": {"gpus": 8}}
    assert records.config_hash(cfg) == records.config_hash({k: v for k, v in cfg.items() if k != "plan"})
    assert records.config_hash({**cfg, "mode": "plan"}) != records.config_hash({"mode": "plan", "model": {"name": "tiny"}})


def test_article_question_70b_on_1024_gpus(tmp_path):
    """The article's question: 70B, 1,024 H100s, seq 8192, 4M tokens per step, every framework. Megatron
    and torchtitan have fitting layouts; DeepSpeed (pure DP here) has none at 512 sequences on 1,024
    GPUs, and says why. plan.json holds every predicted layout and the first refused ones (the rest
    counted by reason) with the fields a user reads, plus the plot and sweep."""
    rec, rows = _plan_job(tmp_path, "model=llama3_70b", "model.seq_len=8192", "plan.gpus=1024", "plan.gpus_per_node=8",
                          "plan.gpu_memory_gb=80", "plan.global_batch_tokens=4194304", "framework=all",
                          "plan.max_cp=1", "plan.micro_batch_sizes=[1,2]")  # (Megatron's CP rows, from sources:
    # tests/test_megatron_cp.py; micro-batch 4 left to the article's own question, tests/test_timing.py)
    p = rec["plan"]
    assert p["counts"]["megatron"]["fits"] > 0 and p["counts"]["titan"]["fits"] > 0
    assert p["counts"]["deepspeed"]["fits"] == 0 and p["counts"]["deepspeed"]["refused"] == p["counts"]["deepspeed"]["layouts"]
    assert any("is not divisible by micro_batch_size*dp" in v["example"] for v in p["refused"]["deepspeed"].values())
    assert len(rows) + p["refused_unlisted"] == sum(c["layouts"] for c in p["counts"].values())
    assert sum(r["status"] == "refused" for r in rows) == min(REFUSED_ROWS, sum(c["refused"] for c in p["counts"].values()))
    for r in rows:
        assert ROW_KEYS <= set(r) and LAYOUT_KEYS <= set(r["layout"])
        assert r["peak_includes"] in ((PEAK_INCLUDES, RESIDENT_ONLY, OVER_BUDGET, OVER_BUDGET_STAGE)
                                      if r["status"] != "refused" else ("",))
        if r["peak_includes"] == OVER_BUDGET:  # its state alone over the budget: too big, no peak computed
            assert r["status"] == "too_big" and r["per_stage"] is None and r["peak_bytes"] == r["resident_bytes"]
            assert r["resident_bytes"] + r["outside_allocator_bytes"] > 0.9 * 80e9
        assert (r["reason"] is None) == r["fits"]
        assert set(r["links"]) == set(r["wire_bytes"]) and set(r["links"].values()) <= {"intra", "inter"}
    fits = [r for r in rows if r["fits"]]
    assert all(r["peak_bytes"] <= 0.9 * 80e9 for r in fits)
    grouped = [(r["peak_includes"] == RESIDENT_ONLY, r["est_step_s"]) for r in fits]
    assert grouped == sorted(grouped)
    assert any(n.startswith(f"peak = {PEAK_INCLUDES}") for n in p["notes"])
    assert (tmp_path / "job" / "plan.png").stat().st_size > 0 and (tmp_path / "job" / "plan.csv").exists()
    sweep = yaml.safe_load((tmp_path / "sweeps" / "llama3_70b_1024gpus_all.yaml").read_text())
    assert sum(len(r["rows"]) for r in sweep["runs"]) == 3 and all(r["overrides"][0] == "model=llama3_70b"
                                                                     for r in sweep["runs"])


def _column(out: str, name: str, framework: str) -> list[str]:
    """The cells of the printed tables' column `name` in the rows of `framework` (each table's header says
    where the column is: a host column comes and goes with ZeRO-Offload rows)."""
    cells, at = [], None
    for ln in out.splitlines():
        if "┃" in ln:
            heads = [c.strip() for c in ln.split("┃")]
            at = heads.index(name) if name in heads else at
        elif at is not None and ln.count("│") > 8 and framework in ln:
            cells.append(ln.split("│")[at].strip())
    return cells


def test_rows_without_a_peak_say_they_fit_on_their_resident_state_only(tmp_path, capsys):
    """A layout whose ledger predicts no peak (DeepSpeed-MoE with top-3 routing: topkgating's saves are not
    derived): a Mixtral row within the budget fits on its resident state alone, which the table's fits
    column ("state only", never "yes") and the framework's count line say; with top-2 routing every
    DeepSpeed row is judged on its peak; a dense model's fitting rows, Ulysses' among them, say "yes"."""
    rec, rows = _plan_job(tmp_path / "moe2", "model=mixtral_8x7b", "plan.gpus=64", "plan.global_batch_tokens=1048576",
                          "framework=deepspeed")
    out = capsys.readouterr().out
    judged = [r for r in rows if r["status"] in ("fits", "too_big") and r["peak_includes"] != OVER_BUDGET]
    assert judged and all(r["peak_includes"] == PEAK_INCLUDES for r in judged)
    assert "on their resident state only" not in out
    rec, rows = _plan_job(tmp_path / "moe", "model=mixtral_8x7b", "model.moe_router_topk=3", "plan.gpus=64",
                          "plan.global_batch_tokens=1048576", "framework=deepspeed")
    out = capsys.readouterr().out
    fits = [r for r in rows if r["fits"]]
    assert fits and all(r["peak_includes"] == RESIDENT_ONLY for r in fits)
    cells = _column(out, "fits", "deepspeed")
    assert cells and set(cells) <= {"state only", "no"} and "state only" in cells
    assert f"{len(fits):,} fit ({len(fits):,} on their resident state only: no peak predicted)" in out
    # a dense model: every fitting row is judged on its peak, its Ulysses rows (cp > 1: ledger/faithful/deepspeed/
    # ulysses.py) too, and says "yes"
    rec, rows = _plan_job(tmp_path / "dense", "model=llama3_8b", "plan.gpus=8", "plan.global_batch_tokens=65536",
                          "framework=deepspeed")
    out = capsys.readouterr().out
    cells = _column(out, "fits", "deepspeed")
    assert "yes" in cells and set(cells) <= {"yes", "no"}
    fits = [r for r in rows if r["fits"]]
    assert fits and all(r["peak_includes"] == PEAK_INCLUDES for r in fits)
    assert any(r["layout"]["cp"] > 1 for r in fits)


def test_megatron_moe_rows_are_judged_on_their_peak_and_carry_its_routed_bound(tmp_path, capsys):
    """Megatron's MoE peak (moe_activations): Mixtral's rows fit or not on the predicted peak with routing
    balanced, each stage's range over the routing in plan.json (peak_bound), and the note says so."""
    from ledger.plan import BOUND_NOTE

    rec, rows = _plan_job(tmp_path, "model=mixtral_8x7b", "plan.gpus=32", "plan.global_batch_tokens=1048576",
                          "framework=megatron")
    out = capsys.readouterr().out
    judged = [r for r in rows if r["status"] in ("fits", "too_big") and r["peak_includes"] != OVER_BUDGET]
    assert judged and any(r["fits"] for r in judged)
    assert any(r["layout"].get("ep", 1) > 1 for r in judged) and any(r["layout"].get("ep", 1) == 1 for r in judged)
    assert all(r["peak_includes"] == PEAK_INCLUDES for r in judged)
    for r in judged:
        for st in r["per_stage"]:
            low, high = st["peak_bound"]
            # with ep = 1 every routed row is local: no range
            assert low <= st["peak_bytes"] <= high and (low < high) == (r["layout"].get("ep", 1) > 1), (r["layout"], st)
    assert "on their resident state only" not in out and " ".join(BOUND_NOTE.split()[:6]) in " ".join(out.split())


def test_llama3_405b_production_layout(tmp_path):
    """TP8 · CP1 · PP16 · DP128 on 16,384 GPUs, seq 8192 (16M tokens per step): in plan.json with its peak
    per stage (126 layers as 7 + 14 x 8 + 7), for each recompute setting: the activations of the 16
    micro-batches stage 0 holds in flight do not fit in 80 GB without full recompute, and full recompute
    fits, with SP and without. Selective core_attn recompute holds more than none under the TE spec: TE's
    attention saves no s^2 probabilities and k and v at kv heads, while the checkpoint around it saves its
    inputs, v a view that keeps linear_qkv's whole output (activations.layer_groups)."""
    rec, rows = _plan_job(tmp_path, "model=llama3_405b", "plan.gpus=16384", "plan.global_batch_tokens=16777216",
                          "framework=megatron", "plan.distributed_optimizer=[true]", "plan.top=1", "plan.max_cp=1",
                          "plan.watch=[{tp:8,pp:16,cp:1,dp:128,vp:1,micro_batch_size:1}]")
    prod = [r for r in rows if r["layout"]["tp"] == 8 and r["layout"]["pp"] == 16 and r["layout"]["dp"] == 128
            and r["layout"]["vp"] == 1 and r["layout"]["micro_batch_size"] == 1
            and r["knobs"].get("decoder_first_pipeline_num_layers") == 7]
    assert len(prod) == 6  # SP on and off x recompute none / selective / full
    by = {(r["layout"]["sequence_parallel"], r["knobs"]["recompute_granularity"]): r for r in prod}
    for (sp, rc), r in by.items():
        assert r["per_stage"] is not None and len(r["per_stage"]) == 16
        assert max(s["peak_bytes"] for s in r["per_stage"]) == r["peak_bytes"] > r["resident_bytes"]
        assert r["fits"] == (rc == "full") == (r["peak_bytes"] <= 0.9 * 80e9)
        assert r["links"]["tp"] == "intra" and r["links"]["dp"] == "inter"
        assert r["bubble"] == 15 / 16  # 2048 / (1 x 128) = 16 micro-batches
    for sp in (False, True):  # recompute only ever lowers the peak; SP divides the activations by tp
        assert by[(sp, "full")]["peak_bytes"] < by[(sp, None)]["peak_bytes"] < by[(sp, "selective")]["peak_bytes"]
    assert by[(True, None)]["peak_bytes"] < by[(False, None)]["peak_bytes"]
    assert any(n.startswith("recompute: enumerated") for n in rec["plan"]["notes"])
    assert all(isinstance(x, int) for x in rec["plan"]["watch"][0]["rows"])


@pytest.mark.real
def test_top3_of_a_tiny_plan_run_and_reconcile(tmp_path):
    """plan -> run the top layouts as one sweep (the sweep file's overrides, launch.py -m on the local
    CPU cluster) -> reconcile: every job ok, every steady row agrees (states and collectives exact, peaks
    within 1%), and each job's resident state is the plan's."""
    import records
    from analysis import reconcile

    rec, rows = _plan_job(tmp_path, "model=tiny", "plan.gpus=2", "plan.gpus_per_node=2", "plan.global_batch_tokens=512",
                          "framework=megatron", "framework.transformer_impl=local", "plan.micro_batch_sizes=[1,2]",
                          "plan.recompute=[none]", "plan.distributed_optimizer=[true]")  # one knob set: one sweep
    sweep = yaml.safe_load((tmp_path / "job" / "sweep.yaml").read_text())
    assert len(sweep["runs"]) == 1 and sweep["runs"][0]["rows"] == [1, 2, 3]
    out = tmp_path / "run"
    # two steps: step 1 is the steady one the reconcile compares (the sweep file leaves train.steps alone)
    # on this machine: the file's GPU cluster and its Slurm launcher replaced, as sweeps.plan replaces them
    from sweeps.plan import commands

    argv = commands(sweep, str(out), ["hydra/launcher=basic", "cluster=local_cpu", "train.steps=2"])[0]
    assert "cluster=slurm_gpu_example" not in argv and "hydra/launcher=submitit_slurm" not in argv
    p = launch(*argv[argv.index("-m"):-1], f"hydra.sweep.dir={out}", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = sorted(records.load(str(out)), key=lambda r: r["job_dir"])
    assert [r["status"] for r in recs] == ["ok"] * 3
    df = reconcile.table(recs)
    steady = df[df.phase == "steady"]
    # states and collectives to the byte, peaks within 1%
    assert len(steady) and not reconcile.off(steady).any(), steady[reconcile.off(steady)].to_string()
    assert (steady.quantity == "peak_bytes").any()
    by_rank = {r["rank"]: r for r in rows if r["rank"]}
    for i, r in enumerate(recs):
        planned = by_rank[i + 1]
        assert {k: r["prediction"]["layout"][k] for k in planned["layout"]} == planned["layout"]
        assert max(x["resident_bytes"] for x in records.rank_classes(r["prediction"])) == planned["resident_bytes"]


def test_sweep_runner_commands(tmp_path):
    """sweeps.plan runs each run of the file as one launch.py -m, extra overrides after the file's."""
    from sweeps.plan import commands, main

    sweep = {"name": "x", "runs": [{"framework": "megatron", "overrides": ["model=tiny", "layout={tp:2},{pp:2}"]},
                                   {"framework": "titan", "overrides": ["model=tiny", "framework=titan"]}]}
    cmds = commands(sweep, str(tmp_path), ["train.steps=2"])
    assert [c[2:] for c in cmds] == [
        ["-m", "model=tiny", "layout={tp:2},{pp:2}", "train.steps=2", f"hydra.sweep.dir={tmp_path / '0_megatron'}"],
        ["-m", "model=tiny", "framework=titan", "train.steps=2", f"hydra.sweep.dir={tmp_path / '1_titan'}"]]
    # an extra override replaces the file's of the same key (Hydra refuses a group given twice)
    assert commands(sweep, str(tmp_path), ["model=llama3_8b"])[1][2:5] == ["-m", "framework=titan", "model=llama3_8b"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(sweep))
    assert main([str(tmp_path / "s.yaml"), "--print", "--out", str(tmp_path)]) == 0


def test_sweep_carries_the_users_knobs_and_the_rows_own(tmp_path):
    """A knob the user set reaches every run of the sweep; one the plan chooses per row (zero_stage) is
    the row's, once."""
    rec, rows = _plan_job(tmp_path, "model=tiny", "plan.gpus=2", "plan.global_batch_tokens=512", "framework=deepspeed",
                          "framework.zero_stage=3", "framework.overlap_comm=true", "plan.sweep_top=4")
    runs = rec["plan"]["sweep"]["runs"]
    assert sorted(r["rows"][0] for r in runs) == sorted({r["rows"][0] for r in runs})
    for run in runs:
        ov = run["overrides"]
        assert ov.count("framework.overlap_comm=true") == 1
        assert [o for o in ov if o.startswith("framework.zero_stage=")] == [
            f"framework.zero_stage={next(r for r in rows if r['rank'] == run['rows'][0])['knobs']['zero_stage']}"]
        assert "cluster.ranks=2" in ov and "cluster.nodes=1" in ov and "cluster.gpus_per_node=2" in ov
        assert "cluster=slurm_gpu_example" in ov and "hydra/launcher=submitit_slurm" in ov


def test_fuzz_search_never_crashes():
    """Any small shape on any GPU count: every candidate is predicted or refused with a reason, never an
    exception of another kind."""
    from hypothesis import given, settings, strategies as st

    bases = _bases("megatron", "deepspeed", "titan")

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(layers=st.integers(1, 7), heads=st.sampled_from([2, 4, 6, 8]), kvdiv=st.sampled_from([1, 2]),
           vocab=st.integers(60, 300), gpus=st.sampled_from([1, 2, 4, 6, 8, 16]), gpn=st.sampled_from([2, 4, 8]),
           seqs=st.integers(1, 40), mbs=st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True))
    def run(layers, heads, kvdiv, vocab, gpus, gpn, seqs, mbs):
        from ledger.model import ModelShape

        m = ModelShape(layers=layers, hidden=heads * 16, ffn_hidden=heads * 48, heads=heads, kv_heads=heads // kvdiv,
                       vocab=vocab, seq_len=256)
        hw = Hardware(gpus, gpn, int(1e9), 0.9, 100.0, 0.5, 100.0, 10.0)
        plan = search(m, hw, Space(seqs, tuple(mbs), (1, 2), 4), bases)
        assert sum(c["layouts"] for c in plan.counts.values()) == len(plan.rows)
        for r in plan.rows:
            assert (r.status == "refused") == (r.peak_bytes is None) and (r.reason is None) == r.fits
            if r.per_stage:
                assert max(s["peak_bytes"] for s in r.per_stage) == r.peak_bytes

    run()


def test_launch_plan_without_gpus_exits_2_naming_the_field(tmp_path):
    p = launch("mode=plan", "plan.global_batch_tokens=512", f"hydra.run.dir={tmp_path}", f"plan.sweep_dir={tmp_path}/s")
    assert p.returncode == 2 and "plan.gpus is required for mode=plan" in p.stderr
    assert not (tmp_path / "plan.json").exists() and not (tmp_path / "s").exists()
    assert json.loads((tmp_path / "record.json").read_text())["status"] == "invalid"


def test_plan_writes_into_its_job_dir_only_and_says_where(tmp_path):
    """mode=plan writes its files into the run's dir (nothing into the repository unless plan.sweep_dir
    names a place) and prints their paths."""
    def sweeps_files():  # where the ready sweep went before: the repository's sweeps/
        return sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(REPO, "sweeps")) for f in fs
                      if "__pycache__" not in d)

    before = sweeps_files()
    p = launch("mode=plan", "plan.gpus=8", "plan.global_batch_tokens=4096", "framework=all",
               f"hydra.run.dir={tmp_path}", "wandb.mode=disabled", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    files = next(ln for ln in p.stdout.splitlines() if ln.startswith("files: ")).split()[1:]
    assert {os.path.basename(f) for f in files} >= {"plan.json", "plan.csv", "sweep.yaml"}
    assert all(os.path.dirname(f) == str(tmp_path) and os.path.exists(f) for f in files)
    assert sweeps_files() == before


@pytest.mark.parametrize("name,why", [("local_cpu", "needs a GPU cluster config"), ("nosuch", "no conf/cluster/nosuch.yaml"),
                                      ("../x", "must name a file of conf/cluster")])
def test_plan_cluster_must_be_a_gpu_cluster_config(name, why):
    from conf.validate import plan_cluster

    with pytest.raises(ConfigError, match=why):
        plan_cluster(name)
    assert plan_cluster("local_gpu") == {"kind": "local", "device": "cuda"}


def test_refused_rows_past_the_cap_are_counted_not_listed():
    """A plan keeps its first refused_rows refused layouts as rows and every watched one; the others are
    counted under their reasons (the counts the same as with every row kept), the predicted rows all kept."""
    m = preset("tiny")
    sp = Space(8, (1, 2), (1, 2), 2, (1, 2, 3), (False, True), True)
    full = search(m, HW8, sp, _bases("megatron", "titan"))
    refused = [r for r in full.rows if r.status == "refused"]
    assert len(refused) > 3
    watched = refused[-1]
    want = {"framework": watched.framework, **watched.layout, **watched.knobs}
    capped = search(m, HW8, sp, _bases("megatron", "titan"), watch=[want], refused_rows=2)
    assert (capped.counts, capped.refused) == (full.counts, full.refused)
    kept = [r for r in capped.rows if r.status == "refused"]
    assert len(kept) == 2 + 1 and kept[-1].matches(want) and capped.refused_unlisted == len(refused) - 3
    assert [r.to_dict() for r in capped.rows if r.status != "refused"] == \
        [r.to_dict() for r in full.rows if r.status != "refused"]


def test_fitting_rows_are_timed_by_the_step_time_model(tmp_path):
    """mode=plan ranks fitting layouts by the step-time model on hardware.* (ledger/timing), each with its
    MFU, tokens/s/GPU and waterfall; the printed plan shows each framework's best step."""
    rec, plan = _plan_job(tmp_path, "model=llama3_8b", "framework=all", "plan.gpus=16",
                          "plan.global_batch_tokens=262144", "hardware.name=a100")
    fits = [r for r in plan if r["fits"]]
    assert fits and all(r["est"]["model"] == "step time (ledger/timing)" and r["est"]["target"].startswith("a100")
                        for r in fits)
    for r in fits:
        assert sum(v for _, v in r["est"]["waterfall"]) == pytest.approx(r["est_step_s"], rel=1e-9)
        assert 0 < r["est"]["mfu"] < 1
    for judged in (True, False):  # plan.sort=time, the rows judged on their peak first (search)
        times = [r["est_step_s"] for r in fits if (r["peak_includes"] != RESIDENT_ONLY) == judged]
        assert times == sorted(times)


def test_megatron_cp_layouts_are_tried_with_each_listed_attention(tmp_path, capsys):
    """plan.cp_comm_types: each Megatron layout with cp > 1 once per context-parallel attention (the knob
    in its row and the sweep), cp = 1 once; a2a where the heads divide by cp, refused with TE's reason
    where they do not; unlisted, the configured framework.cp_comm_type alone."""
    from ledger.faithful.megatron.cp import basis

    rec, rows = _plan_job(tmp_path / "types", "model=llama3_1b", "model.seq_len=4096", "plan.gpus=16",
                          "plan.global_batch_tokens=262144", "framework=megatron", "plan.max_cp=4",
                          "plan.cp_comm_types=[p2p,all_gather,a2a]", "plan.recompute=[none]")
    cp_rows = [r for r in rows if r["layout"]["cp"] > 1]
    types = {r["knobs"].get("cp_comm_type") for r in cp_rows}
    assert types == {"p2p", "all_gather", "a2a"}
    assert all("cp_comm_type" not in r["knobs"] for r in rows if r["layout"]["cp"] == 1)
    for r in cp_rows:
        if r["status"] != "refused":
            assert r["basis"] == basis(r["knobs"]["cp_comm_type"])
    # llama3_1b's 8 K/V heads over tp 2 leave 4: a2a at cp 4 fits them, at tp 4 they do not divide
    bad = [r for r in cp_rows if r["knobs"]["cp_comm_type"] == "a2a" and (8 // r["layout"]["tp"]) % r["layout"]["cp"]]
    assert bad and all(r["status"] == "refused" and "must be divisible by the a2a size" in r["reason"] for r in bad)
    _, plain = _plan_job(tmp_path / "plain", "model=llama3_1b", "model.seq_len=4096", "plan.gpus=16",
                         "plan.global_batch_tokens=262144", "framework=megatron", "plan.max_cp=4", "plan.recompute=[none]")
    assert len(plain) < len(rows) and all("cp_comm_type" not in r["knobs"] for r in plain)
    assert {r["basis"] for r in plain if r["layout"]["cp"] > 1 and r["status"] != "refused"} == {basis("p2p")}


def test_offload_rows_fit_the_device_and_the_host_apart(tmp_path, capsys):
    """DeepSpeed's ZeRO-Offload rows (plan.offload_optimizer): judged on the device's peak (the resident state
    less host_bytes), their host_bytes against plan.host_memory_gb (a row over it is too big, the reason says
    so), timed with the optimizer step on the host and the host link's transfers; a printed table with such a
    row has a host column."""
    rec, plan = _plan_job(tmp_path, "model=llama3_8b", "framework=deepspeed", "plan.gpus=8",
                          "plan.global_batch_tokens=262144", "plan.recompute=[full]", "plan.host_memory_gb=20",
                          "plan.watch=[{offload_optimizer:cpu,zero_stage:3}]")
    out = capsys.readouterr().out
    watched = out[out.index("watch {"):]
    header = next(ln for ln in watched.splitlines() if "peak GB*" in ln)
    cols = [c.strip() for c in header.split("┃")[1:-1]]
    assert cols[3:5] == ["peak GB*", "host GB"]
    assert "host GB: what ZeRO-Offload keeps in host memory per GPU" in " ".join(out.split())
    cells = list(zip(_column(watched, "#", "deepspeed"), _column(watched, "host GB", "deepspeed")))
    by_rank = {r["rank"]: r for r in plan if r.get("rank")}
    assert cells and all(float(host) == round(by_rank[int(rank)]["host_bytes"] / 1e9, 2) > 0
                         for rank, host in cells if rank != "-")
    off = [r for r in plan if r["knobs"]["offload_optimizer"] == "cpu"]
    assert off and {r["knobs"]["zero_stage"] for r in off} == {1, 2, 3}
    for r in off:
        assert r["host_bytes"] > r["state_bytes"]["optim"]
        if r["host_bytes"] > 20e9:
            assert r["status"] == "too_big" and "host memory" in r["reason"], r
        elif r["fits"]:
            assert dict(r["est"]["waterfall"])["host link transfers (offload)"] > 0
    plain = {(r["layout"]["micro_batch_size"], r["knobs"]["zero_stage"]): r for r in plan
             if r["knobs"]["offload_optimizer"] == "none" and r["layout"]["cp"] == 1}
    for r in off:  # the device holds less than without offload, the optimizer step takes longer
        p = plain[r["layout"]["micro_batch_size"], r["knobs"]["zero_stage"]]
        assert r["peak_bytes"] < p["peak_bytes"]
        if r["fits"] and p["fits"]:
            assert r["est_step_s"] > p["est_step_s"]
    assert any(r["status"] == "too_big" and "host memory" in r["reason"] for r in off)
