"""mode=plan: the job around ledger/plan.py's search. It reads plan.*, runs the search, and writes into
the job dir

  plan.json    every layout (fitting, too big; the first ledger/plan.py REFUSED_ROWS refused ones and the
               watched ones, the rest counted by reason in record.json), one row each: framework, layout, knobs, fits,
               peak_bytes (the predicted peak within a step, `peak_includes` says what it holds), resident_bytes,
               wire_bytes per dim, links (intra / inter node), bubble, est_step_s (a roofline
               estimate), reason; per_stage (each stage's most-loaded rank) for every predicted row
  plan.csv     the same rows flattened
  plan.png     peak per rank vs estimated step time, fitting rows marked, their Pareto front
  sweep.yaml   the top plan.sweep_top fitting rows as `launch.py -m` overrides (also written as
               <plan.sweep_dir>/<name>.yaml), to run them and reconcile

and prints the top plan.top rows, the refusals counted by reason, and what the numbers include.
No ranks run.
"""
from __future__ import annotations

import csv
import os
import shlex
import time

from omegaconf import OmegaConf

import records
from ledger import frameworks
from ledger.model import PRESETS, ModelShape
from ledger.units import fmt
from ledger.plan import (BOUND_NOTE, FRAMEWORK_NAMES, PEAK_INCLUDES, RECOMPUTE_NOTE, REFUSED_ROWS, RESIDENT_ONLY,
                         recompute_mode, Hardware, Plan, Row, Space, search)

EST_NOTE = ("est_step_s of a fitting row is the step-time model's (ledger/timing: the ops on the hardware.* profile, "
            "its collectives, the simulated schedule; docs/steptime.md), never a measurement (MoE layers with routing balanced); rows that do "
            "not fit keep the roofline (FLOPs / (gpus x the profile's peak x its GEMM efficiency) x (1 + bubble) + "
            "communication not hidden: ledger/plan.py estimate)")
TE_NOTE = ("megatron: predicted with framework.transformer_impl=transformer_engine (Megatron-LM's default) unless "
           "set; a CPU run of the sweep builds the local spec")


def hardware(p, hw_cfg, target: str = "") -> Hardware:
    """The plan's machine: plan.gpus of plan.gpus_per_node a node, and the job's hardware.* profile, on
    which the fitting rows' step time is predicted and the roofline of the others runs (its bf16 peak
    at its GEMM efficiency, its links' bus bandwidth)."""
    from ledger.timing import hardware as profiles, profile_of

    prof = profiles.with_overrides(profile_of(hw_cfg), gpus_per_node=min(p.gpus_per_node, p.gpus))
    return Hardware(p.gpus, min(p.gpus_per_node, p.gpus), int(p.gpu_memory_gb * 1e9), p.memory_fraction,
                    prof.peak("bf16") / 1e12, prof.gemm_efficiency, 8 * prof.intra.busbw_gbps,
                    8 * prof.inter.busbw_gbps, p.tp_across_nodes, prof, target,
                    int(p.get("host_memory_gb", 0) * 1e9))


def space(cfg) -> Space:
    p = cfg.plan
    if p.global_batch_tokens is not None:
        gbs = p.global_batch_tokens // cfg.model.seq_len
    else:  # conf/validate.py validate_plan: one of the two is set
        gbs = cfg.layout.global_batch_size
    return Space(gbs, tuple(p.micro_batch_sizes), tuple(p.vps), p.max_cp, tuple(p.zero_stages),
                 tuple(bool(x) for x in p.sequence_parallel), bool(p.hsdp), tuple(p.recompute),
                 tuple(bool(x) for x in p.distributed_optimizer), tuple(p.get("cp_comm_types") or ()),
                 tuple(p.get("offload_optimizer") or ("none",)), tuple(p.get("offload_param") or ("none",)),
                 tuple(p.get("pipeline_schedules") or ()))


def framework_bases(cfg) -> dict[str, dict]:
    """name -> the framework config the search starts from (plain dicts): framework=all, each
    framework's schema defaults; else the job's framework config as overridden."""
    from conf.schema import FRAMEWORK_SCHEMAS

    if cfg.framework.name == "all":
        return {n: OmegaConf.to_container(OmegaConf.structured(FRAMEWORK_SCHEMAS[n])) for n in FRAMEWORK_NAMES}
    return {cfg.framework.name: OmegaConf.to_container(cfg.framework, resolve=True)}


def run_plan(cfg, job_dir: str) -> dict:
    """Plan into job_dir; returns the record's "plan" part (counts, refusals, top rows, files)."""
    model = ModelShape.from_config(cfg.model)
    from ledger import target

    hw, sp = hardware(cfg.plan, cfg.hardware, target.of(cfg.mode, cfg.cluster)), space(cfg)
    bases = framework_bases(cfg)
    plan = search(model, hw, sp, bases, cfg.ledger.mode, cfg.plan.sort, watch=[dict(w) for w in cfg.plan.watch],
                  workers=cfg.plan.workers)
    t0 = time.perf_counter()
    fitting = [r for r in plan.rows if r.fits]
    top = fitting[:cfg.plan.top]
    watched = [[r for r in plan.rows if r.matches(dict(w))] for w in cfg.plan.watch]
    # each framework's first fitting row: the answer per framework when one dominates the top table
    best = {fw: next((r for r in fitting if r.framework == fw), None) for fw in bases}
    rank_of = {id(r): i + 1 for i, r in enumerate(plan.rows) if r.status != "refused"}
    rows = [r.to_dict() for r in plan.rows]
    for r, d in zip(plan.rows, rows):
        d["rank"] = rank_of.get(id(r))
    records.write_rows(os.path.join(job_dir, "plan.json"), rows)
    write_csv(os.path.join(job_dir, "plan.csv"), rows)
    name = cfg.plan.name or f"{cfg.model.name}_{hw.gpus}gpus_{cfg.framework.name}"
    sweep = sweep_of(cfg, bases, fitting[:cfg.plan.sweep_top], rank_of, name, job_dir)
    files = {"plan_json": "plan.json", "plan_csv": "plan.csv"}
    if sweep is not None:
        text = sweep_yaml(sweep)
        with open(os.path.join(job_dir, "sweep.yaml"), "w") as f:
            f.write(text)
        files["sweep"] = "sweep.yaml"
        if cfg.plan.sweep_dir:
            os.makedirs(cfg.plan.sweep_dir, exist_ok=True)
            path = os.path.join(cfg.plan.sweep_dir, f"{name}.yaml")
            with open(path, "w") as f:
                f.write(text)
            files["sweep_file"] = os.path.abspath(path)
    try:
        from analysis.plan import plot

        plot(rows, os.path.join(job_dir, "plan.png"), hw.budget_bytes)
        files["plot"] = "plan.png"
    except Exception as e:  # noqa: BLE001 - a plot that cannot be drawn (no matplotlib backend) loses no row
        files["plot_error"] = f"{type(e).__name__}: {e}"
    notes = [f"peak = {PEAK_INCLUDES} (a row whose ledger predicts no peak says `{RESIDENT_ONLY}`; a row whose "
             "resident state alone exceeds the budget is too big, its peak not computed; a row with one stage over "
             "the budget is too big, its other stages not priced unless plan.watch names it)",
             RECOMPUTE_NOTE, EST_NOTE]
    if any(st.get("peak_bound") for r in rows for st in (r.get("per_stage") or [])):
        notes.append(BOUND_NOTE)
    if any(r.host_bytes for r in plan.rows if r.status != "refused"):
        notes.append("host GB: what ZeRO-Offload keeps in host memory per GPU (host_bytes, not in the peak), a fit of "
                     f"its own against plan.host_memory_gb = {cfg.plan.host_memory_gb:g} GB")
    if plan.refused_unlisted:
        notes.append(f"plan.json / plan.csv list the first {REFUSED_ROWS:,} refused layouts (and the watched ones); "
                     f"{plan.refused_unlisted:,} more are counted under their reasons above, not listed")
    if "megatron" in bases and not bases["megatron"].get("transformer_impl"):
        notes.append(TE_NOTE)
    summary = {"model": cfg.model.name, "num_params": model.num_params(), "ledger": cfg.ledger.mode, "target": hw.target,
               "hardware": hw.__dict__,
               "global_batch_size": sp.global_batch_size, "tokens_per_step": sp.global_batch_size * model.seq_len,
               "sort": cfg.plan.sort, "counts": plan.counts, "refused": plan.refused, "search_s": plan.seconds,
               "workers": cfg.plan.workers,
               "refused_unlisted": plan.refused_unlisted,
               "write_s": time.perf_counter() - t0, "notes": notes, "files": files,
               "top": [rows[plan.rows.index(r)] for r in top[:cfg.plan.sweep_top]],
               "best": {fw: rows[plan.rows.index(r)] if r else None for fw, r in best.items()},
               "watch": [{"want": dict(w), "rows": [rank_of.get(id(r)) or "refused" for r in ws]}
                         for w, ws in zip(cfg.plan.watch, watched)],
               "sweep": sweep}
    print(render(plan, top, watched, cfg, hw, notes, sweep, sp.global_batch_size, best))
    written = [os.path.join(job_dir, f) for k, f in files.items() if k in ("plan_json", "plan_csv", "sweep", "plot")]
    print("files: " + " ".join(written + ([files["sweep_file"]] if "sweep_file" in files else [])))
    return summary


# -- files ------------------------------------------------------------------------------------------

CSV_LAYOUT = ("tp", "pp", "vp", "cp", "dp", "dp_replicate", "ep", "etp", "micro_batch_size", "sequence_parallel",
              "global_batch_size")


def write_csv(path: str, rows: list[dict]) -> None:
    dims = sorted({d for r in rows for d in r["wire_bytes"]})
    cols = ["rank", "framework", *CSV_LAYOUT, "knobs", "status", "fits", "peak_bytes", "peak_includes",
            "resident_bytes", "host_bytes", "stage", *(f"wire_{d}" for d in dims), *(f"link_{d}" for d in dims), "bubble",
            "est_step_s", "reason"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            lay = r["layout"]
            w.writerow([r["rank"], r["framework"], *(lay[k] for k in CSV_LAYOUT),
                        " ".join(f"{k}={v}" for k, v in r["knobs"].items()), r["status"], r["fits"], r["peak_bytes"],
                        r["peak_includes"], r["resident_bytes"], r.get("host_bytes", 0), r["stage"],
                        *(r["wire_bytes"].get(d, "") for d in dims), *(r["links"].get(d, "") for d in dims),
                        r["bubble"], r["est_step_s"], r["reason"]])


def model_overrides(m) -> list[str]:
    """The overrides that give the planned model shape: its preset and the fields changed from it."""
    d = OmegaConf.to_container(m, resolve=True)
    if d["name"] in PRESETS:
        ref = {**_model_defaults(), **PRESETS[d["name"]]}
        return [f"model={d['name']}", *(f"model.{k}={_val(v)}" for k, v in d.items()
                                        if k != "name" and ref.get(k) != v)]
    return ["model=tiny", *(f"model.{k}={_val(v)}" for k, v in d.items())]


def _model_defaults() -> dict:
    from dataclasses import MISSING, fields

    from conf.schema import ModelConfig

    return {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}


def _val(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return str(v)


def _framework_overrides(name: str, base: dict, chosen) -> list[str]:
    """The job's framework knobs that differ from the schema's defaults (what the user set), but those
    the plan chooses per row (`chosen`: FrameworkLedger.plan_chooses, and the row's knobs)."""
    from conf.schema import FRAMEWORK_SCHEMAS

    ref = OmegaConf.to_container(OmegaConf.structured(FRAMEWORK_SCHEMAS[name]))
    return [f"framework.{k}={_val(v)}" for k, v in base.items()
            if k != "name" and k not in chosen and ref.get(k) != v]


def layout_override(lay: dict) -> str:
    return "{" + ",".join(f"{k}:{_val(lay[k])}" for k in CSV_LAYOUT) + "}"


def sweep_of(cfg, bases: dict, rows: list[Row], rank_of: dict, name: str, job_dir: str) -> dict | None:
    """The rows as `launch.py -m` runs: one per (framework, knobs), its layouts one swept `layout=`
    override (Hydra sweeps a list of dicts), the cluster sized to the plan's GPUs."""
    if not rows:
        return None
    from conf.validate import plan_cluster

    ranks = min(cfg.plan.gpus_per_node, cfg.plan.gpus)
    kind = plan_cluster(cfg.plan.cluster)["kind"]
    cluster = [*(["hydra/launcher=submitit_slurm"] if kind == "slurm" else []), f"cluster={cfg.plan.cluster}",
               f"cluster.gpus_per_node={ranks}", f"cluster.ranks={ranks}", f"cluster.nodes={cfg.plan.gpus // ranks}"]
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r.framework, tuple(r.knobs.items()))
        g = groups.setdefault(key, {"framework": r.framework, "rows": [], "layouts": [], "knobs": dict(r.knobs)})
        g["rows"].append(rank_of[id(r)])
        g["layouts"].append(layout_override(r.layout))
    runs = []
    for (fw, _), g in groups.items():
        ov = [*model_overrides(cfg.model), f"framework={fw}", *_framework_overrides(fw, bases[fw], (*g["knobs"], *frameworks.get(fw).plan_chooses)),
              *(f"framework.{k}={_val(v)}" for k, v in g["knobs"].items()), *cluster, "layout=" + ",".join(g["layouts"])]
        runs.append({"framework": fw, "rows": g["rows"], "overrides": ov,
                     "command": " ".join(shlex.quote(a) for a in ["python", "launch.py", "-m", *ov])})
    return {"name": name, "plan": os.path.join(os.path.abspath(job_dir), "plan.json"),
            "sort": cfg.plan.sort, "runs": runs}


def sweep_yaml(sweep: dict) -> str:
    head = ("# train-ledger plan: the top layouts as ready sweeps (launchers/plan.py). Run each `command`\n"
            "# on the cluster config plan.cluster names (cluster=..., sized to the plan), then\n"
            "# python -m analysis.reconcile <its hydra.sweep.dir>; or python -m sweeps.plan <this file>.\n")
    return head + OmegaConf.to_yaml(OmegaConf.create(sweep))


# -- the printed table ------------------------------------------------------------------------------

_LINK = {"intra": "node", "inter": "net"}


def _gb(n) -> str:
    return "" if n is None else f"{n / 1e9:.2f}"


def _lay(r: Row) -> str:
    lay = r.layout
    s = " ".join(f"{k}{lay[k]}" for k in ("tp", "pp", "vp", "cp", "ep", "etp", "dp") if lay[k] > 1 or k == "dp")
    if lay["dp_replicate"] > 1:
        s += f" rep{lay['dp_replicate']}"
    if lay["sequence_parallel"]:
        s += " sp"
    s += f" mb{lay['micro_batch_size']}"
    kn = r.knobs
    if "zero_stage" in kn:
        s += f" z{kn['zero_stage']}"
    if kn.get("offload_optimizer", "none") != "none":
        s += f" off:{kn['offload_optimizer']}"
    if kn.get("offload_param", "none") != "none":
        s += f" offp:{kn['offload_param']}"
    if kn.get("use_distributed_optimizer"):
        s += " dopt"
    if "cp_comm_type" in kn:
        s += f" cp:{kn['cp_comm_type']}"
    if kn.get("pipeline_parallel_schedule") not in (None, "1F1B", "Interleaved1F1B"):  # (torchtitan's defaults unnamed)
        s += f" {kn['pipeline_parallel_schedule']}"
    if "decoder_first_pipeline_num_layers" in kn or "decoder_last_pipeline_num_layers" in kn:
        s += f" split {kn.get('decoder_first_pipeline_num_layers', '-')}/{kn.get('decoder_last_pipeline_num_layers', '-')}"
    if kn.get("account_for_embedding_in_pipeline_split"):
        s += " +emb"
    if kn.get("account_for_loss_in_pipeline_split"):
        s += " +loss"
    rc = recompute_mode(r.framework, kn)
    if rc != "none":
        s += f" rc:{rc}"
    return s


def _fits_cell(r: Row) -> str:
    """The table's fits column: "yes" within the budget at the predicted peak; "state only" within it
    at the resident state alone (the layout's ledger predicts no peak: activations not counted)."""
    if r.status == "fits":
        return "state only" if r.peak_includes == RESIDENT_ONLY else "yes"
    return {"too_big": "no"}.get(r.status, "refused")


def render(plan: Plan, top: list[Row], watched: list[list[Row]], cfg, hw: Hardware, notes: list[str],
           sweep: dict | None, gbs: int, best: dict) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    con = Console(file=buf, width=160, force_terminal=False)
    rank = {id(r): i + 1 for i, r in enumerate(plan.rows)}

    def table(title: str, rows: list[Row]) -> Table:
        t = Table(title=title)
        # ZeRO-Offload's host buffers: a fit of their own against plan.host_memory_gb, a column where a row has them
        host = any(r.host_bytes for r in rows)
        for c in ("#", "framework", "layout", "peak GB*", *(("host GB",) if host else ()), "stage", "fits",
                  "wire per step per dim (link)", "bubble", "est step s**", "MFU**"):
            t.add_column(c, justify="left" if c in ("framework", "layout", "wire per step per dim (link)") else "right")
        for r in rows:
            # the dims that carry at least 1% of the row's bytes, largest first (a grad-norm all-reduce
            # of a few bytes says nothing about the layout)
            wire = " ".join(f"{d} {fmt(b)} ({_LINK[r.links[d]]})" for d, b in sorted(r.wire_bytes.items(),
                                                                                  key=lambda kv: -kv[1])
                            if b >= 0.01 * r.wire_total)
            t.add_row(str(rank[id(r)]) if r.status != "refused" else "-", r.framework, _lay(r), _gb(r.peak_bytes),
                      *((_gb(r.host_bytes) if r.host_bytes else "",) if host else ()),
                      "" if r.stage is None else str(r.stage), _fits_cell(r),
                      wire if r.status != "refused" else (r.reason or "")[:70],
                      "" if r.bubble is None else f"{r.bubble:.3f}",
                      "" if r.est_step_s is None else f"{r.est_step_s:.3g}",
                      f"{100 * r.est['mfu']:.1f}%" if "mfu" in r.est else "")
        return t

    n_all = sum(c["layouts"] for c in plan.counts.values())
    con.print(table(f"plan: {cfg.model.name} on {hw.gpus:,} GPUs ({hw.gpus_per_node}/node, {hw.gpu_memory_bytes / 1e9:g} GB, "
                    f"fits at <= {hw.budget_bytes / 1e9:.1f} GB), global batch {gbs:,} "
                    f"sequences: top {len(top)} of {sum(c['fits'] for c in plan.counts.values())} fitting "
                    f"({n_all:,} layouts, sorted by {cfg.plan.sort})"
                    + (f"; peaks for {hw.target}" + (" + what a rank holds beside its tensors (ledger/cuda.py)"
                                                     if hw.target == "cuda-nccl" else "") if hw.target else ""), top))
    if len(best) > 1:
        con.print(table("the best fitting layout of each framework", [r for r in best.values() if r]))
    for fw, r in best.items():  # where each framework's best step goes (ledger/timing/step.py waterfall)
        if r is not None and "waterfall" in r.est:
            con.print(f"{fw} #{rank[id(r)]} {_lay(r)}: {r.est['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU "
                      f"{100 * r.est['mfu']:.1f}% on {r.est['target']}; the step: "
                      + ", ".join(f"{k} {100 * v / r.est_step_s:.1f}%" for k, v in r.est["waterfall"] if v > 1e-12),
                      markup=False)
    for w, ws in zip(cfg.plan.watch, watched):
        con.print(table(f"watch {dict(w)}: {len(ws)} rows", ws[:24]))
        for r in ws[:4]:
            if r.per_stage:
                con.print(f"  #{rank[id(r)]} {_lay(r)}: peak per stage (GB) "
                          + " ".join(_gb(s["peak_bytes"]) for s in r.per_stage), markup=False)
    for fw, c in plan.counts.items():
        # an MoE ledger predicts no peak: such a row "fits" on its resident state alone, said so
        on_state = sum(1 for r in plan.rows if r.framework == fw and r.fits and r.peak_includes == RESIDENT_ONLY)
        con.print(f"{fw}: {c['layouts']:,} layouts: {c['fits']:,} fit"
                  + (f" ({on_state:,} on their resident state only: no peak predicted)" if on_state else "")
                  + f", {c['too_big']:,} too big, {c['refused']:,} refused" + ("" if c["fits"] else ": none fits"),
                  markup=False)
        for k, v in sorted(plan.refused[fw].items(), key=lambda kv: -kv[1]["count"]):
            con.print(f"  {v['count']:6,} refused: {v['example']}", markup=False)
    for n in notes:
        con.print(f"* {n}" if n.startswith("peak") else f"note: {n}", markup=False)
    con.print("** estimate, not a measurement; (node): the dim's groups lie inside a node, (net): across nodes "
              f"(the {hw.profile.target} profile's links)", markup=False)
    con.print(f"searched in {plan.seconds:.2f} s"
              + (f" over {cfg.plan.workers} processes" if cfg.plan.workers > 1 else
                 f" (plan.workers=N spreads it over N processes; this machine has {os.cpu_count()} CPUs)"
                 if (os.cpu_count() or 1) > 1 else ""), markup=False)
    if sweep:
        for run in sweep["runs"]:
            con.print(f"sweep (rows {', '.join(map(str, run['rows']))}): {run['command']}", markup=False, soft_wrap=True)
    return buf.getvalue()
