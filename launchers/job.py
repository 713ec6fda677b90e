"""One job of a sweep: validate -> predict -> (run | dry) -> record.json; mode=plan: validate -> plan
(launchers/plan.py: every layout on plan.gpus GPUs, predicted and ranked) -> record.json.

Every job leaves a record: status ok | failed | invalid | timeout, with the error text. A job that
runs ranks first writes a record of status `running` (with its pid and host), replaced by the
final one; a job interrupted by SIGTERM / SIGINT records `failed` (interrupted) before it exits.
Records are written atomically (records.write_json), so a reader never sees half a record.
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import signal
import socket
import time
import traceback
from importlib import metadata

from omegaconf import OmegaConf

import records
from conf import hf
from conf.validate import validate_config
from launchers import signals
from ledger import frameworks, target as targets
from ledger.layout import ConfigError, resolve, validate
from ledger.model import ModelShape
from ledger.parallel import predict

PACKAGES = ("torch", "deepspeed", "megatron-core", "torchtitan", "hydra-core", "omegaconf", "submitit", "wandb")


def versions() -> dict:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


write_json = records.write_json


def world_of(cfg) -> int:
    """The job's world size: the cluster's processes; on cluster=fake the layout's own world (every
    rank exists in the fake process group), the cluster's `ranks` only filling layout.dp=-1."""
    c, lc = cfg.cluster, cfg.layout
    if c.kind == "fake" and lc.dp != -1:
        return lc.tp * lc.pp * lc.cp * lc.dp
    return c.ranks * c.nodes


def apply_knobs(cfg) -> list[str]:
    """cfg.knobs into cfg.framework where the framework has each knob (a sweep over frameworks sets
    each framework's own knobs at once); the names of the others, which this job ignores."""
    ignored = []
    for name, value in (cfg.get("knobs") or {}).items():
        if name in cfg.framework and name != "name":
            cfg.framework[name] = value
        else:
            ignored.append(name)
    return ignored


def fill_mode_defaults(cfg) -> None:
    """Knobs whose default depends on the job's mode and target, set before the record copies the config
    (so the record says what was predicted and run): the framework's ledger fills them (Megatron's
    transformer_impl: ledger/faithful/megatron/rules.py fill_mode_defaults)."""
    if cfg.framework.name in frameworks.names():
        frameworks.get(cfg.framework.name).fill_mode_defaults(cfg.framework, cfg.mode, target_of(cfg))


def target_of(cfg) -> str:
    """The run the job's prediction is for (ledger/target.py): the cluster's, or by the mode."""
    return targets.of(cfg.mode, cfg.cluster)


def away_from_framework_defaults(fw) -> list[str]:
    """The job's framework knobs whose value is not what the framework does when they are left unset:
    those the user set, and train-ledger's own departures (FrameworkLedger.own_defaults). None is the
    framework's own default wherever a knob takes it."""
    from conf.schema import FRAMEWORK_SCHEMAS

    spec = frameworks.get(fw.name)
    ours = OmegaConf.to_container(OmegaConf.structured(FRAMEWORK_SCHEMAS[fw.name]))
    out = []
    for knob, value in OmegaConf.to_container(fw).items():
        if knob == "name" or value is None:
            continue
        own = spec.own_defaults.get(knob, ours.get(knob))
        if value != own:
            out.append(f"{knob}={_override_text(value)} ({'unset' if own is None else _override_text(own)})")
    return out


def _override_text(value) -> str:
    """A value as a Hydra override writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check(cfg):
    """Resolve, validate and predict; raises ConfigError naming the field and the rule. The
    prediction is part of the check: a faithful ledger rejects what it does not model. mode=plan:
    the config's values only (None)."""
    hf.apply(cfg.model)  # model.hf_config's shape, before any rule reads the model
    validate_config(cfg)  # every group's values first: the layout rules below then divide safely
    if cfg.mode == "plan":
        return None  # a plan predicts many layouts, not cfg.layout: its checks are validate_config's (plan.*)
    fill_mode_defaults(cfg)
    spec = frameworks.get(cfg.framework.name)
    if cfg.mode == "run":
        why = spec.run_error(cfg.framework, cfg.cluster)
        if why is not None:
            raise ConfigError(why)
    model = ModelShape.from_config(cfg.model)
    world = world_of(cfg)
    # predict and dry describe the layout as given; only dp=-1 borrows the cluster's world size, and
    # a cluster smaller than one model-parallel group (the default 2 ranks, layout.tp=8) is one
    # replica of it there: `mode=predict model=llama3_8b layout.tp=8` predicts tp8 x dp1
    lc = cfg.layout
    mp = lc.tp * lc.pp * lc.cp
    lay = resolve(lc, world if cfg.mode == "run" or world >= mp else mp, cfg.framework.name)
    validate(model, lay, cfg.framework.name, cfg.framework, world=world if cfg.mode == "run" else None)
    if cfg.mode in ("run", "dry"):  # what the framework itself refuses to start (Megatron: MoE with TP, no SP)
        why = spec.dispatch_error(model, lay) or spec.model_config_error(cfg.model)
        if why is not None:
            raise ConfigError(why)
    if cfg.mode == "dry":  # the nodes x GPUs that start the layout's world, the sbatch values
        from launchers import gpu_scripts

        gpu_scripts.check(cfg.cluster, lay.world)
    if cfg.cluster.kind == "fake":
        from conf.validate import fake_layout_supported, fake_ranks_in_world

        fake_ranks_in_world(cfg.cluster, lay.world)
        if cfg.mode == "run":
            fake_layout_supported(cfg.framework.name, lay, model)
    pl = predict(model, lay, cfg.framework, cfg.ledger.mode, target=target_of(cfg))
    if cfg.mode == "run" and cfg.cluster.kind == "local":  # every rank on this machine: can it hold them?
        from launchers.local import local_world_error
        from ledger.report import heaviest_rank
        from ledger.units import peak_or_resident

        why = local_world_error(lay.world, peak_or_resident(heaviest_rank(pl)[1]), cfg.cluster.device)
        if why is not None:
            raise ConfigError(why)
    return model, lay, pl


def new_record(cfg, job_dir: str) -> dict:
    config = OmegaConf.to_container(cfg, resolve=True)
    return {"status": None, "error": None, "mode": cfg.mode, "job_dir": os.path.abspath(job_dir),
            "config": config, "config_hash": records.config_hash(config), "versions": versions(),
            "timings": {}, "prediction": None, "measurement": None}


def invalid_record(cfg, job_dir: str, error: str) -> dict:
    """The record of a job rejected before anything ran."""
    os.makedirs(job_dir, exist_ok=True)
    record = {**new_record(cfg, job_dir), "status": "invalid", "error": error}
    write_json(os.path.join(job_dir, "record.json"), record)
    from analysis.wandb_io import log_job

    log_job(cfg, record)  # a rejected job is a line of the sweep in W&B too; never raises
    return record


def _step_time(cfg, model, lay, pl):
    """The step's time for the job's target (ledger/timing): the hardware profile for predict / dry /
    plan, a calibrated CPU profile for a CPU run (or why there is none)."""
    from ledger import timing

    cpu_run = cfg.mode == "run" and cfg.cluster.device == "cpu"
    return timing.predict(cfg.framework, model, lay, pl, cfg.hardware, cfg.ledger.mode, cpu_run)


def run_job(cfg, job_dir: str, ranks_runner=None, writes_record: bool = True, extra: dict | None = None) -> dict:
    """Run one job into job_dir and return its record. ranks_runner(job_dir, world, timeout, device)
    starts the ranks (default: processes on this machine). In a Slurm job every task calls this with
    its own runner; only rank 0 writes the record (writes_record)."""
    os.makedirs(job_dir, exist_ok=True)
    t0 = time.time()
    ignored = apply_knobs(cfg)
    fill_mode_defaults(cfg)
    try:
        hf_ignored = hf.apply(cfg.model)
    except ConfigError as e:
        return invalid_record(cfg, job_dir, str(e)) if writes_record else {"status": "invalid", "error": str(e)}
    record = {**new_record(cfg, job_dir), **(extra or {})}
    if hf_ignored:
        record["hf_config_ignored"] = hf_ignored
        if writes_record:
            print(f"model.hf_config {cfg.model.hf_config}: fields that change no prediction, ignored: "
                  f"{', '.join(hf_ignored)}")
    if ignored:
        record["knobs_ignored"] = ignored
        if writes_record:
            print(f"knobs not of {cfg.framework.name}, ignored: {', '.join(ignored)}")
    rec_path = os.path.join(job_dir, "record.json")
    try:
        if cfg.mode == "plan":
            return _plan_job(cfg, job_dir, record, t0, writes_record)
        try:
            model, lay, pl = check(cfg)
        except ConfigError as e:
            return invalid_record(cfg, job_dir, str(e)) if writes_record else {"status": "invalid", "error": str(e)}
        pred = pl.to_dict()
        # the run the prediction is for (cpu-gloo: the CPU harness's rules; cuda-nccl: a GPU run's, from
        # sources) and what its peak rests on
        basis = frameworks.get(cfg.framework.name).peak_basis(cfg.framework, pl.target) if pl.target else None
        if basis:
            pred["peak_basis"] = basis
        try:
            st = _step_time(cfg, model, lay, pl)
        except ConfigError as e:
            return invalid_record(cfg, job_dir, str(e)) if writes_record else {"status": "invalid", "error": str(e)}
        pred["step_time"] = st.to_dict() if not isinstance(st, str) else {"none": st}
        record["prediction"] = pred
        record["knobs_away_from_defaults"] = away_from_framework_defaults(cfg.framework)
        if writes_record:
            write_json(os.path.join(job_dir, "prediction.json"), pred)
            if not isinstance(st, str) and st.simulation is not None:  # the predicted step, for Perfetto
                from ledger.timing import trace

                trace.write(st, os.path.join(job_dir, "step_trace.json"))
        record["timings"]["predict_s"] = time.time() - t0
        if writes_record:
            print(pl.report(away_from_defaults=record["knobs_away_from_defaults"]))
            if basis:
                print(f"peak for {pl.target}: {basis}")
            from ledger.timing.step import render

            print(st if isinstance(st, str) else render(st))
            if cfg.cluster.get("gpu_memory_gb"):
                from ledger.report import fit_verdict

                print(fit_verdict(pl, cfg.cluster.gpu_memory_gb, cfg.plan.memory_fraction))
        if cfg.mode == "dry":
            mod = importlib.import_module(frameworks.get(cfg.framework.name).launcher)
            record["artifacts"] = mod.dry(cfg, lay, job_dir)
            if writes_record:
                print("artifacts: " + " ".join(record["artifacts"]))
        elif cfg.mode == "run":
            t1 = time.time()
            if writes_record:  # what a reader (analysis.status) sees while the ranks run
                write_json(rec_path, {**record, "status": "running", "pid": os.getpid(),
                                      "host": socket.gethostname(), "started_at": t1})
            if cfg.cluster.kind == "fake":
                from launchers.fake import NOTE, ranks_of

                ranks = ranks_of(cfg, pl)
                record["device"] = "fake"
                record["fake"] = {"measured_ranks": ranks, "note": NOTE}
                if ranks_runner is None:
                    ranks_runner = _fake_runner(ranks)
            record["measurement"] = run_ranks(cfg, lay, job_dir, ranks_runner)
            record["timings"]["run_s"] = time.time() - t1
            meas = record["measurement"]
            bad = [r for r in meas["ranks"] if r.get("status") != "ok"]
            if meas.get("timed_out"):
                record["status"] = "timeout"
                record["error"] = f"timeout after {cfg.cluster.timeout_s} s (cluster.timeout_s)"
            elif bad:
                record["status"] = "failed"
                record["error"] = "; ".join(f"rank {r['rank']}: {r.get('error')}" for r in bad)[:4000]
        record["status"] = record["status"] or "ok"
    except signals.Interrupted as e:
        record.update(status="failed", error=f"interrupted by {signal.Signals(e.signum).name} while running")
        record["timings"]["total_s"] = time.time() - t0
        if writes_record:
            write_json(rec_path, record)  # no W&B: the rerun logs the job once
        raise
    except Exception as e:
        record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    record["timings"]["total_s"] = time.time() - t0
    if writes_record:
        write_json(rec_path, record)
        if cfg.mode in ("predict", "dry") and record["prediction"] is not None:  # where a user finds what it wrote
            print(f"prediction: {os.path.join(job_dir, 'prediction.json')}  record: {rec_path}")
        from analysis.wandb_io import log_job

        log_job(cfg, record)  # never raises: a W&B failure lands in record["wandb"]["error"]
    return record


def _fake_runner(ranks: list[int]):
    from launchers.fake import run_fake

    def runner(job_dir, world, timeout_s, device):
        return run_fake(job_dir, world, ranks, timeout_s)

    return runner


def _plan_job(cfg, job_dir: str, record: dict, t0: float, writes_record: bool) -> dict:
    """mode=plan: the plan's files in job_dir and its summary in record["plan"]; no ranks. Its W&B run
    (job_type plan) holds the rows as a table and the best row's figures."""
    from launchers.plan import run_plan

    try:
        check(cfg)
        record["plan"] = run_plan(cfg, job_dir)
        record["status"] = "ok"
    except ConfigError as e:
        record.update(status="invalid", error=str(e))
    except Exception as e:
        record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    record["timings"]["plan_s"] = record["timings"]["total_s"] = time.time() - t0
    if writes_record:
        write_json(os.path.join(job_dir, "record.json"), record)
        from analysis.wandb_io import log_job

        log_job(cfg, record)  # never raises
    return record


def run_ranks(cfg, lay, job_dir: str, ranks_runner=None) -> dict:
    from launchers.local import fork_from, run_local

    world, timeout_s = lay.world, cfg.cluster.timeout_s
    write_json(os.path.join(job_dir, "job.json"), OmegaConf.to_container(cfg, resolve=True))
    runner = ranks_runner or functools.partial(run_local, framework=fork_from(cfg.cluster, cfg.framework.name))
    procs = runner(job_dir, world, timeout_s, cfg.cluster.device)
    timed_out = any(pr.get("timed_out") for pr in procs)
    ranks = []
    for pr in procs:
        p = os.path.join(job_dir, f"rank{pr['rank']}.json")
        if os.path.exists(p):
            with open(p) as f:
                d = json.load(f)
        elif pr.get("timed_out"):
            d = {"rank": pr["rank"], "status": "timeout",
                 "error": f"killed at cluster.timeout_s={timeout_s} s without a result"}
        else:
            d = {"rank": pr["rank"], "status": "failed",
                 "error": f"rank exited with code {pr['returncode']} without a result"}
        if pr["returncode"] not in (0, None) and d.get("status") == "ok":
            d["status"] = "failed"
            d["error"] = f"exit code {pr['returncode']} after writing its result"
        if d.get("status") != "ok":
            d["log_tail"] = pr.get("log_tail")
        if "process" in pr:  # cluster=fake: the rank ran alone, its wall time and peak RSS are its own
            d["process"] = pr["process"]
        ranks.append(d)
    out = {"world": world, "ranks": ranks, "timed_out": timed_out}
    if cfg.cluster.kind == "fake":  # a subset of the world: analysis reads the ranks that are there
        out.update(device="fake", measured_ranks=[d["rank"] for d in ranks])
    return out
