"""W&B: log one job's record (rank 0, right after record.json) and read a sweep back from W&B.

Every job logs one W&B run: the resolved config; tags framework / model / layout; the sweep as its
group (the Hydra sweep dir's name unless wandb.group is set); per-step metrics per rank
(rank<r>/loss, step_time_s, params/grads/optim/other/resident bytes, peak_bytes from the peak probe,
cuda_peak_allocated_bytes on CUDA); the
prediction and the per-rank measurements in the summary; and its reconcile rows as a wandb.Table
("reconcile"). wandb.mode is offline by default: compute nodes need no network, and the run files
live inside the job dir (<job_dir>/wandb/offline-run-*), so a sweep dir holds all of its runs.

Upload a whole sweep afterwards from any machine with network (`--dry-run` lists the runs first;
`-e ENTITY` / `-p PROJECT` override where they go):

    wandb sync SWEEP_DIR/*/wandb/offline-run-*

Cost per job, measured on the 2-core dev machine (record["wandb"] keeps init_s / finish_s / total_s):
about 0.1-0.2 s per job once wandb is imported, up to ~2 s for the first job of a process
(imports and wandb-core start-up); the settings below skip system metrics, code/git capture,
console capture and job artifacts.

Read it back (the same reconcile table as from the record.json files):

    python -m analysis.reconcile --from-wandb SWEEP_DIR                 # offline run files
    python -m analysis.reconcile --from-wandb ENTITY/PROJECT[/GROUP]    # the W&B server (wandb.Api)

wandb 0.31 keeps no public reader of offline runs: read_run() reads the .wandb transaction log
(LevelDB-style 32 KiB blocks of crc32-checked chunks, each a wandb_internal_pb2.Record) with
wandb's own protobuf classes; the Table comes from the run's files/media/table/*.table.json.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import tempfile
import time
import zlib

import pandas as pd

import records as R
from analysis.timing import PHASES

# what one run's summary carries of the record (enough for reconcile.table and .summary)
RECORD_KEYS = ("status", "error", "mode", "job_dir", "timings", "prediction", "measurement")
STATE_KEYS = ("params_bytes", "grads_bytes", "optim_bytes", "other_bytes", "resident_bytes")
TABLE_KEY = "reconcile"


# -- logging ----------------------------------------------------------------------------------

def group_of(cfg, record: dict) -> str:
    """The sweep a job belongs to: wandb.group, else the name of the Hydra sweep dir (the job dir's parent)."""
    g = cfg.wandb.get("group") if "wandb" in cfg else None
    return g or os.path.basename(os.path.dirname(os.path.abspath(record["job_dir"]))) or "train-ledger"


def log_job(cfg, record: dict) -> dict | None:
    """Log a finished job to W&B and note the outcome in its record.json (record["wandb"]).

    Never raises: a W&B failure is recorded as {"error": ...} and the job's status stands."""
    from records import write_json

    wc = cfg.get("wandb") if hasattr(cfg, "get") else None
    if wc is None or not wc.enabled or wc.mode == "disabled":
        return None
    t0 = time.perf_counter()
    try:
        info = _log(cfg, record)
    except BaseException as e:  # noqa: BLE001 - W&B must never fail the job (KeyboardInterrupt aside)
        if isinstance(e, KeyboardInterrupt):
            raise
        info = {"error": f"{type(e).__name__}: {e}"[:2000]}
    info["total_s"] = round(time.perf_counter() - t0, 3)
    record["wandb"] = info
    try:
        write_json(os.path.join(record["job_dir"], "record.json"), record)
    except OSError as e:
        info["error"] = f"record not rewritten: {e}"
    return info


def _settings(mode: str):
    import wandb

    # start-up cost per job: no system-metrics sampler, no machine/git/code capture, no console
    # capture, no job artifact; all of it is either irrelevant here or already in the record
    return wandb.Settings(mode=mode, x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
                          save_code=False, disable_git=True, disable_job_creation=True, console="off",
                          silent=True, init_timeout=120)


PLAN_TABLE_KEY = "plan"
# the plan's first rows logged as its table (plan.csv's order: the ranked rows, then the refused); a
# plan of 100,000 GPUs has hundreds of thousands, which wandb.Table takes minutes to build
PLAN_TABLE_ROWS = 1000


def _log_plan(run, record: dict) -> None:
    """A plan's run: its first PLAN_TABLE_ROWS rows (plan.csv) as a wandb.Table, the best row's figures
    as summary scalars."""
    import wandb

    plan = record.get("plan") or {}
    csv = (plan.get("files") or {}).get("plan_csv")
    csv = csv and os.path.join(record["job_dir"], csv)
    if csv and os.path.exists(csv):
        run.log({PLAN_TABLE_KEY: wandb.Table(dataframe=pd.read_csv(csv, nrows=PLAN_TABLE_ROWS))})
    top = (plan.get("top") or [None])[0] or {}
    run.summary.update({k: v for k, v in {
        "model": plan.get("model"), "gpus": (plan.get("hardware") or {}).get("gpus"), "sort": plan.get("sort"),
        "best_framework": top.get("framework"), "best_est_step_s": top.get("est_step_s"),
        "best_peak_bytes": top.get("peak_bytes"), "search_s": plan.get("search_s")}.items() if v is not None})


def _log(cfg, record: dict) -> dict:
    import wandb

    from analysis import compare

    wc = cfg.wandb
    group = group_of(cfg, record)
    if record.get("mode") == "plan":
        return _log_plan_run(cfg, record, group)
    tags = [R.framework_variant(record), record["config"]["model"]["name"], R.layout_name(record)]
    t0 = time.perf_counter()
    run = wandb.init(dir=record["job_dir"], project=wc.project, entity=wc.entity, group=group,
                     name=R.job_name(record), job_type=record.get("mode") or "run", tags=[t[:64] for t in tags],
                     config=record["config"], settings=_settings(wc.mode), reinit="create_new")
    init_s = time.perf_counter() - t0
    try:
        df = compare.table([record])
        steps = step_metrics(record)
        last = max(steps) if steps else None
        for s in sorted(steps):
            row = dict(steps[s])
            if s == last and len(df):
                row[TABLE_KEY] = wandb.Table(dataframe=df)
            run.log(row, step=s)
        if last is None and len(df):
            run.log({TABLE_KEY: wandb.Table(dataframe=df)})
        for k in RECORD_KEYS:
            run.summary[k] = _for_summary(k, record.get(k))
        run.summary.update(headline(record, df))
        info = {"run_id": run.id, "run_dir": os.path.dirname(run.dir), "mode": wc.mode, "group": group,
                "project": wc.project, "init_s": round(init_s, 3)}
    finally:
        t1 = time.perf_counter()
        run.finish()
    info["finish_s"] = round(time.perf_counter() - t1, 3)
    if wc.mode == "offline":
        _wait_written(info["run_dir"], info)
    return info


def _log_plan_run(cfg, record: dict, group: str) -> dict:
    import wandb

    wc = cfg.wandb
    plan = record.get("plan") or {}
    run = wandb.init(dir=record["job_dir"], project=wc.project, entity=wc.entity, group=group,
                     name=f"plan {plan.get('model', '')} {(plan.get('hardware') or {}).get('gpus', '')} GPUs".strip(),
                     job_type="plan", config=record["config"], settings=_settings(wc.mode), reinit="create_new")
    try:
        for k in ("status", "error", "mode", "job_dir", "timings"):
            run.summary[k] = _for_summary(k, record.get(k))
        _log_plan(run, record)
        info = {"run_id": run.id, "run_dir": os.path.dirname(run.dir), "mode": wc.mode, "group": group,
                "project": wc.project}
    finally:
        run.finish()
    if wc.mode == "offline":
        _wait_written(info["run_dir"], info)
    return info


def _wait_written(run_dir: str, info: dict, timeout_s: float = 60.0) -> None:
    """Wait until the offline run file holds its exit record: run.finish() can return before the
    W&B service has written the file's tail (seen on a loaded 2-core machine: a read right after
    finish found no summary), and a job's W&B record must be readable once log_job returns."""
    t0 = time.perf_counter()
    while True:
        try:
            if read_run(run_dir)["exit_code"] is not None:
                break
        except (FileNotFoundError, ValueError):
            pass
        if time.perf_counter() - t0 > timeout_s:
            info["error"] = f"offline run file {run_dir} has no exit record {timeout_s:.0f} s after finish()"
            break
        time.sleep(0.05)
    info["written_s"] = round(time.perf_counter() - t0, 3)


def _for_summary(key: str, value):
    """Drop what reconcile never reads and that can be large: the first step's storage list, log tails."""
    if key != "measurement" or not value:
        return value
    ranks = []
    for r in value.get("ranks", []):
        r = {k: v for k, v in r.items() if k != "log_tail"}
        r["steps"] = [{k: v for k, v in st.items() if k != "storages"} for st in r.get("steps", [])]
        ranks.append(r)
    return {**value, "ranks": ranks}


def step_metrics(record: dict) -> dict[int, dict]:
    """{step: {"rank<r>/<metric>": value, "loss": mean over ranks that report one, ...}}."""
    out: dict[int, dict] = {}
    for m in (record.get("measurement") or {}).get("ranks", []):
        r = m["rank"]
        for st in m.get("steps", []):
            row = out.setdefault(st["step"], {})
            if st.get("loss") is not None:
                row[f"rank{r}/loss"] = st["loss"]
            if st.get("time_s") is not None:
                row[f"rank{r}/step_time_s"] = st["time_s"]
            for k in STATE_KEYS:
                if k in (st.get("state") or {}):
                    row[f"rank{r}/{k}"] = st["state"][k]
            if (st.get("peak") or {}).get("peak_bytes") is not None:  # the peak probe, every device
                row[f"rank{r}/peak_bytes"] = st["peak"]["peak_bytes"]
            cuda_peak = (st.get("cuda") or {}).get("allocated_bytes.all.peak")
            if cuda_peak is not None:
                row[f"rank{r}/cuda_peak_allocated_bytes"] = cuda_peak
    for row in out.values():  # whole-job lines for the default charts
        losses = [v for k, v in row.items() if k.endswith("/loss")]
        if losses:
            row["loss"] = sum(losses) / len(losses)
        times = [v for k, v in row.items() if k.endswith("/step_time_s")]
        if times:
            row["step_time_s"] = max(times)
        res = [v for k, v in row.items() if k.endswith("/resident_bytes")]
        if res:
            row["max_resident_bytes"] = max(res)
    return out


def headline(record: dict, df: pd.DataFrame) -> dict:
    """Flat summary scalars the W&B runs table can sort on: the heaviest rank's predicted resident
    state and peak within a step, the predicted step time, MFU and tokens/s/GPU, and what the run
    measured of them and of its steady step's time."""
    from analysis import compare

    pred = record.get("prediction") or {}
    pg = pred.get("per_gpu") or {}
    steady = df[df.phase == "steady"] if len(df) else df
    out = {"framework": R.framework_variant(record), "layout": R.layout_name(record),
           "steady_rows": int(len(steady)), "steady_mismatches": int(compare.off(steady).sum()) if len(steady) else 0}
    if pg.get("resident_bytes") is not None:
        out["predicted_resident_bytes"] = pg["resident_bytes"]
    peaks = [(r.get("peak") or {}).get("bytes") for r in R.rank_classes(pred)]
    if peaks and all(p is not None for p in peaks):
        out["predicted_peak_bytes"] = max(peaks)
    st = pred.get("step_time") or {}
    if st.get("step_s") is not None:  # the step-time model's, for the target it names (ledger/timing)
        out.update(predicted_step_s=st["step_s"], predicted_mfu=st["mfu"],
                   predicted_tokens_per_s_per_gpu=st["tokens_per_s_per_gpu"], step_time_target=st["target"],
                   **{f"predicted_{q}": st[q] for q in PHASES if st.get(q) is not None})
    out.update(_measured_headline(record))
    return out


def _measured_headline(record: dict) -> dict:
    """measured_peak_bytes: the largest steady-step peak over the ranks; measured_step_s: the slowest
    rank's median steady-step wall time (the step ends when the last rank's does), and that rank's
    median forward / backward / optimizer times (probes/phases.py); measured_resident_bytes."""
    ranks = [r for r in ((record.get("measurement") or {}).get("ranks") or []) if r.get("status") == "ok"]
    steady = [[s for s in r.get("steps") or [] if s.get("step", 0) > 0] for r in ranks]
    out = {}
    peaks = [(s.get("peak") or {}).get("peak_bytes") for st in steady for s in st]
    if peaks and all(p is not None for p in peaks):
        out["measured_peak_bytes"] = max(peaks)
    times = [sorted(s["time_s"] for s in st if s.get("time_s") is not None) for st in steady]
    if times and all(times):
        out["measured_step_s"] = max(t[len(t) // 2] for t in times)
        slowest = max(range(len(times)), key=lambda i: times[i][len(times[i]) // 2])
        for q in PHASES:
            ph = sorted((s.get("phases") or {}).get(q) for s in steady[slowest] if (s.get("phases") or {}).get(q) is not None)
            if ph:
                out[f"measured_{q}"] = ph[len(ph) // 2]
    res = [(s.get("state") or {}).get("resident_bytes") for st in steady for s in st[-1:]]
    if res and all(v is not None for v in res):
        out["measured_resident_bytes"] = max(res)
    return out


# -- reading offline run files ------------------------------------------------------------------

_BLOCK = 32768
_HEADER = 7  # ":W&B", magic 0xBEE1, version (file header); crc32, length, type (chunk header)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    """The records of a .wandb log: LevelDB log framing, each chunk's crc32 seeded with its type."""
    if data[:4] != b":W&B" or struct.unpack("<H", data[4:6])[0] != 0xBEE1:
        raise ValueError("not a W&B transaction log (bad header)")
    pos, buf = _HEADER, b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # a block's tail too short for a chunk header is zero padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if length == 0 and kind == 0:  # zeroed tail of a block or of a crashed run
            pos += room
            continue
        body = data[pos + _HEADER:pos + _HEADER + length]
        if len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            break  # a torn write at the end of a killed run: keep what came before
        pos += _HEADER + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            buf = body
        elif kind == _MIDDLE:
            buf += body
        elif kind == _LAST:
            yield buf + body
            buf = b""


def _set(d: dict, path: list[str], value) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _path(item) -> list[str]:
    return list(item.nested_key) if len(item.nested_key) else [item.key]


def _history_value(item):
    which = item.WhichOneof("value")
    if which is None or which == "none":
        return json.loads(item.value_json) if item.value_json else None
    if which == "json":
        return json.loads(item.json)
    return getattr(item, which)


def read_run(run_dir: str) -> dict:
    """One offline (or online, from its local files) run: {id, group, tags, name, project, config,
    summary, history: [{_step: s, key: value}], run_dir}."""
    from wandb.proto import wandb_internal_pb2 as pb

    paths = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    if len(paths) != 1:
        raise FileNotFoundError(f"{run_dir}: expected one run-*.wandb file, found {len(paths)}")
    with open(paths[0], "rb") as f:
        data = f.read()
    run: dict = {"run_dir": run_dir, "config": {}, "summary": {}, "history": [], "exit_code": None}
    for body in _chunks(data):
        rec = pb.Record()
        rec.ParseFromString(body)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.update(id=r.run_id, group=r.run_group, tags=list(r.tags), name=r.display_name, project=r.project,
                       entity=r.entity, job_type=r.job_type)
            for it in r.config.update:
                _set(run["config"], _path(it), json.loads(it.value_json))
        elif kind == "config":
            for it in rec.config.update:
                _set(run["config"], _path(it), json.loads(it.value_json))
        elif kind == "summary":
            for it in rec.summary.update:
                _set(run["summary"], _path(it), json.loads(it.value_json))
            for it in rec.summary.remove:
                p = _path(it)
                parent = run["summary"]
                for k in p[:-1]:
                    parent = parent.get(k, {})
                parent.pop(p[-1], None)
        elif kind == "history":
            row = {}
            for it in rec.history.item:
                _set(row, _path(it), _history_value(it))
            run["history"].append(row)
        elif kind == "exit":
            run["exit_code"] = rec.exit.exit_code
    run["config"].pop("_wandb", None)
    return run


def find_runs(sweep_dir: str) -> list[str]:
    """The newest W&B run dir of each job dir under sweep_dir (a rerun job keeps its older runs)."""
    newest: dict[str, str] = {}
    for p in glob.glob(os.path.join(sweep_dir, "**", "wandb", "*run-*", "run-*.wandb"), recursive=True):
        run_dir = os.path.dirname(p)
        job_dir = os.path.dirname(os.path.dirname(run_dir))
        # run dir names are <offline->run-YYYYMMDD_HHMMSS-<id>: the timestamp orders them
        stamp = os.path.basename(run_dir).split("run-", 1)[1]
        if job_dir not in newest or stamp > os.path.basename(newest[job_dir]).split("run-", 1)[1]:
            newest[job_dir] = run_dir
    return [newest[j] for j in sorted(newest, key=lambda j: R._job_order(os.path.join(j, "record.json")))]


def record_of(run: dict) -> dict:
    """A record as reconcile reads it, rebuilt from one run's config and summary."""
    s = run["summary"]
    rec = {k: s.get(k) for k in RECORD_KEYS}
    rec["config"] = run["config"]
    rec["wandb"] = {k: run.get(k) for k in ("id", "group", "tags", "name", "project", "run_dir")}
    if run.get("run_dir"):  # where the files are now (a copied sweep dir), not where the job ran
        rec["job_dir"] = os.path.dirname(os.path.dirname(os.path.abspath(run["run_dir"])))
    return rec


def _table_of(run: dict, fetch) -> pd.DataFrame | None:
    ref = run["summary"].get(TABLE_KEY)
    if not isinstance(ref, dict) or ref.get("_type") != "table-file":
        return None
    with open(fetch(ref["path"])) as f:
        t = json.load(f)
    return pd.DataFrame(t["data"], columns=t["columns"])


# -- reading back: offline dir or the W&B server ------------------------------------------------

def _is_local(src: str) -> bool:
    return os.path.exists(src)


def _online_runs(src: str):
    """entity/project[/group] -> public-API runs, in job order."""
    import wandb

    parts = src.strip("/").split("/")
    if len(parts) not in (2, 3):
        raise ValueError(f"--from-wandb {src!r}: give an offline sweep dir or ENTITY/PROJECT[/GROUP]")
    filters = {"group": parts[2]} if len(parts) == 3 else None
    # the sweep report's own run (analysis.report --wandb-report) is no job
    runs = [r for r in wandb.Api().runs(f"{parts[0]}/{parts[1]}", filters=filters)
            if getattr(r, "job_type", None) != "report"]
    newest: dict[str, object] = {}
    for r in runs:  # newest run per job dir, as offline
        jd = r.summary_metrics.get("job_dir") or r.name
        if jd not in newest or r.created_at > newest[jd].created_at:
            newest[jd] = r
    return [newest[j] for j in sorted(newest, key=lambda j: R._job_order(os.path.join(j, "record.json")))]


def _online_run_dict(r) -> dict:
    return {"id": r.id, "group": r.group, "tags": list(r.tags), "name": r.name, "project": r.project,
            "config": dict(r.config), "summary": dict(r.summary_metrics), "run_dir": None}


def read_records(src: str) -> list[dict]:
    """Records rebuilt from W&B: src is a dir holding offline run files, or ENTITY/PROJECT[/GROUP]."""
    if _is_local(src):
        return [record_of(read_run(d)) for d in find_runs(src)]
    return [record_of(_online_run_dict(r)) for r in _online_runs(src)]


def read_tables(src: str) -> pd.DataFrame:
    """The logged reconcile tables (wandb.Table "reconcile") of every job, concatenated."""
    from analysis.compare import COLUMNS

    frames = []
    if _is_local(src):
        for d in find_runs(src):
            run = read_run(d)
            t = _table_of(run, lambda p, d=d: os.path.join(d, "files", p))
            if t is not None:
                frames.append(t)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for r in _online_runs(src):
                t = _table_of(_online_run_dict(r), lambda p, r=r: r.file(p).download(root=tmp, replace=True).name)
                if t is not None:
                    frames.append(t)
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.concat(frames, ignore_index=True)
    if "race_bytes" not in df:  # a table logged before the peak's race range (0: one measured value)
        df["race_bytes"] = 0
    for c in ("bound_low", "bound_high"):  # a table logged before routed ranges (none: exact rows)
        if c not in df:
            df[c] = float("nan")
    return df[COLUMNS]


def load_from(path: str | None, from_wandb: str | None = None) -> list[dict]:
    """Records from W&B (an offline sweep dir or entity/project[/group]) when from_wandb is given,
    else from the record.json files under path."""
    if from_wandb:
        return read_records(from_wandb)
    return R.load(path)
