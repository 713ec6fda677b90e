"""Job records (record.json) and the files beside them: the one home of record I/O.

Writers (launchers.job, launchers.slurm, analysis.wandb_io) and readers (analysis.*) both use this
module, which imports nothing of the project: the layers read top-down
(launch -> launchers -> ledger / probes; analysis reads records).

A record is written atomically (temp file + rename), so a reader never sees half of one; a record
that is unreadable all the same (a disk filled up, a copy cut short, a hand edit) is reported by
name and stands in the listings as status `unreadable`, never as a traceback.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

RECORD = "record.json"
# a record's status besides ok / failed / invalid / timeout: "running" is the record a job writes when
# it starts, replaced by its final one (a job whose process died leaves it behind: analysis.status tells
# them apart); UNREADABLE marks a record file that does not parse
UNREADABLE = "unreadable"


def json_text(obj) -> str:
    """A record's JSON text as write_json writes it (tests/golden.py compares predictions by it)."""
    return json.dumps(obj, indent=1, default=str)


def remove_stale_tmp(path: str) -> None:
    """Remove what writers killed mid-write left beside path: `path.tmp.PID` files whose PID is no
    longer a process (write_json's and launchers.write_file's temporaries)."""
    for tmp in glob.glob(glob.escape(path) + ".tmp.*"):
        pid = tmp.rsplit(".", 1)[-1]
        if pid.isdigit() and not process_alive(pid):
            try:
                os.unlink(tmp)
            except OSError:
                pass


def write_json(path: str, obj) -> None:
    remove_stale_tmp(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json_text(obj))
    os.replace(tmp, path)


def write_rows(path: str, rows: list) -> None:
    """A JSON list of objects, one a line, written atomically like write_json. Each line goes through
    json's C encoder (json.dump with an indent is its pure-Python one: seconds for a plan's 30,000 rows)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(r, default=str) for r in rows) + "\n]\n")
    os.replace(tmp, path)


class UnreadableRecord(ValueError):
    """A record.json that is not a JSON object; the message names the file."""


def read(path: str) -> dict:
    """One record.json; raises UnreadableRecord naming the file when it cannot be parsed or lacks
    what every reader of a record relies on (_shape_error)."""
    rec = read_object(path)
    why = _shape_error(rec)
    if why:
        raise UnreadableRecord(f"{path}: unreadable record ({why})")
    return rec


def read_object(path: str) -> dict:
    """One JSON object written by write_json (a record, the campaign manifest); raises
    UnreadableRecord naming the file when it cannot be parsed or is not an object."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnreadableRecord(f"{path}: unreadable record ({type(e).__name__}: {e})") from e
    if not isinstance(rec, dict):
        raise UnreadableRecord(f"{path}: unreadable record (a JSON {type(rec).__name__}, not an object)")
    return rec


# what every reader of a record relies on: key -> the types its value may have
_SHAPE = {"status": (str, type(None)), "job_dir": (str,), "config": (dict, type(None)),
          "prediction": (dict, type(None)), "measurement": (dict, type(None))}
# (a job Slurm killed before it wrote job.json has a record with no config: _record_killed)
_OPTIONAL = ("config", "prediction", "measurement")


def _shape_error(rec: dict) -> str | None:
    """Why a parsed record is not one the analysis can read (a missing or mistyped key), else None."""
    for key, types in _SHAPE.items():
        if key not in rec:
            if key in _OPTIONAL:
                continue
            return f"no {key!r}"
        if not isinstance(rec[key], types):
            return f"{key!r} is a {type(rec[key]).__name__}"
    return None


def read_if_any(job_dir: str) -> dict | None:
    """The job dir's record, None when there is none (an unreadable one raises UnreadableRecord)."""
    path = os.path.join(job_dir, RECORD)
    return read(path) if os.path.exists(path) else None


def find(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isfile(os.path.join(path, RECORD)):
        return [os.path.join(path, RECORD)]
    return sorted(glob.glob(os.path.join(path, "**", RECORD), recursive=True), key=_job_order)


def _job_order(p: str):
    name = os.path.basename(os.path.dirname(p))
    head = name.split("_", 1)[0]
    return (os.path.dirname(os.path.dirname(p)), int(head) if head.isdigit() else 1 << 30, name)


def unreadable_record(path: str, error: str) -> dict:
    """What stands in the listings for a record that cannot be read."""
    return {"status": UNREADABLE, "error": error, "job_dir": os.path.dirname(os.path.abspath(path)),
            "config": None, "prediction": None, "measurement": None}


def load(path: str, warn=None) -> list[dict]:
    """Every record under path. One that cannot be read is warned about, naming the file (on stderr,
    or through warn(message)), and comes back as an `unreadable` record: the others still count."""
    out, files = [], find(path)
    for p in files:
        try:
            out.append(read(p))
        except UnreadableRecord as e:
            (warn or _warn)(f"warning: {e}")
            out.append(unreadable_record(p, str(e)))
    # a folder of several sweeps (a day's multirun/) holds jobs of one subdir name in each: name every
    # job by its folder under `path` then, so no two are merged into one row of a table
    names = [job_name(r) for r in out]
    if len(set(names)) < len(names) and os.path.isdir(path):
        for r, p in zip(out, files):
            r[NAME_KEY] = os.path.relpath(os.path.dirname(p), path)
    return out


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr)


def process_alive(pid) -> bool:
    """Whether the pid of a `running` record (on this host) is still a process."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# -- the campaign manifest ----------------------------------------------------------------------

MANIFEST = "campaign.json"  # in the sweep dir, written by launchers/campaign.py


def read_manifest(sweep_dir: str) -> dict:
    """{"jobs": {num: {job_dir, overrides, config_hash, decision, slurm_job_id?}}}; empty when the
    sweep dir has none (a sweep of an older train-ledger) or it cannot be read."""
    path = os.path.join(sweep_dir, MANIFEST)
    if not os.path.exists(path):
        return {"jobs": {}}
    try:
        m = read_object(path)
    except UnreadableRecord as e:
        _warn(f"warning: {e}")
        return {"jobs": {}}
    m.setdefault("jobs", {})
    return m


# -- what a job is ------------------------------------------------------------------------------

# config keys that say how a job is run or logged, not what it runs: a changed one does not make the
# finished job a different job (a resubmitted campaign may raise a timeout or send W&B elsewhere)
# (knobs: what they set is in the framework's config the record copies, launchers/job.py apply_knobs)
_NOT_THE_JOB = {"campaign": None, "wandb": None, "hydra": None, "defaults": None, "knobs": None,
                "cluster": ("timeout_s", "time_min", "signal_delay_s", "max_num_timeout", "setup",
                            "slurm_conf", "partition", "account", "qos", "constraint", "exclusive",
                            "additional_parameters", "mem_gb", "cpus_per_task")}


def job_identity(config: dict) -> dict:
    """The part of a resolved config that decides what a job computes."""
    out = {}
    for k, v in (config or {}).items():
        if k in _NOT_THE_JOB and _NOT_THE_JOB[k] is None:
            continue
        if k == "plan" and config.get("mode") != "plan":
            # the planner's settings change nothing a predict / run / dry job computes (and records
            # written before mode=plan existed keep their hash)
            continue
        if k in _NOT_THE_JOB and isinstance(v, dict):
            v = {kk: vv for kk, vv in v.items() if kk not in _NOT_THE_JOB[k]}
        out[k] = v
    return out


def config_hash(config: dict) -> str:
    """sha256 of the job's identity (sorted JSON): equal exactly when the job computes the same thing."""
    blob = json.dumps(job_identity(config), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two identities (for the changed-config error)."""
    out = []
    for k in sorted(set(old or {}) | set(new or {})):
        a, b = (old or {}).get(k), (new or {}).get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


# -- a prediction's ranks -------------------------------------------------------------------------

def rank_classes(pred: dict | None) -> list[dict]:
    """A prediction's classes of alike ranks (ledger.placement Placement.to_dict), each a dict of the
    predicted state with "ranks": [[first, last], ...]. A prediction written with one entry per rank
    ("per_rank", each with its "rank") reads as classes of one rank each."""
    pred = pred or {}
    if "rank_classes" in pred:
        return pred["rank_classes"]
    return [{**p, "ranks": [[p["rank"], p["rank"]]]} for p in pred.get("per_rank") or []]


def predicted_ranks(pred: dict | None):
    """rank -> the predicted class holding it ({} for a rank the prediction does not hold): a lookup
    over the classes' runs, whatever the world."""
    import bisect

    cls = rank_classes(pred)
    runs = sorted((lo, hi, i) for i, c in enumerate(cls) for lo, hi in c["ranks"])
    starts = [lo for lo, _, _ in runs]

    def of(rank: int) -> dict:
        j = bisect.bisect_right(starts, rank) - 1
        if j >= 0 and runs[j][0] <= rank <= runs[j][1]:
            return cls[runs[j][2]]
        return {}
    return of


# -- names for tables ---------------------------------------------------------------------------

# set by load() on the records of a folder of several sweeps: the job's folder relative to it
NAME_KEY = "_loaded_as"


def job_name(rec: dict) -> str:
    return rec.get(NAME_KEY) or os.path.basename(rec.get("job_dir", "")) or "job"


def layout_name(rec: dict) -> str:
    lay = (rec.get("prediction") or {}).get("layout") or (rec.get("config") or {}).get("layout") or {}
    parts = [f"{k}{lay[k]}" for k in ("tp", "pp", "vp", "cp", "ep", "etp", "dp") if lay.get(k, 1) not in (1, -1)]
    if lay.get("dp_replicate", 1) > 1:
        parts.append(f"rep{lay['dp_replicate']}")
    if lay.get("sequence_parallel"):
        parts.append("sp")
    return "·".join(parts) or "single"


def framework_variant(rec: dict) -> str:
    fw = (rec.get("config") or {}).get("framework") or {"name": "?"}
    name = fw.get("name", "?")
    if name == "deepspeed":
        return f"deepspeed-z{fw.get('zero_stage')}"
    return name
