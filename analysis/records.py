"""Finding and reading job records (record.json) under a sweep or job directory."""
from __future__ import annotations

import glob
import json
import os


def find(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isfile(os.path.join(path, "record.json")):
        return [os.path.join(path, "record.json")]
    return sorted(glob.glob(os.path.join(path, "**", "record.json"), recursive=True), key=_job_order)


def _job_order(p: str):
    name = os.path.basename(os.path.dirname(p))
    head = name.split("_", 1)[0]
    return (os.path.dirname(os.path.dirname(p)), int(head) if head.isdigit() else 1 << 30, name)


def load(path: str) -> list[dict]:
    out = []
    for p in find(path):
        with open(p) as f:
            out.append(json.load(f))
    return out


def job_name(rec: dict) -> str:
    return os.path.basename(rec.get("job_dir", "")) or "job"


def layout_name(rec: dict) -> str:
    lay = (rec.get("prediction") or {}).get("layout") or (rec.get("config") or {}).get("layout") or {}
    parts = [f"{k}{lay[k]}" for k in ("tp", "pp", "vp", "cp", "dp") if lay.get(k, 1) not in (1, -1)]
    if lay.get("dp_replicate", 1) > 1:
        parts.append(f"rep{lay['dp_replicate']}")
    if lay.get("sequence_parallel"):
        parts.append("sp")
    return "·".join(parts) or "single"


def framework_variant(rec: dict) -> str:
    fw = (rec.get("config") or {}).get("framework") or {"name": "?"}
    name = fw["name"]
    if name == "deepspeed":
        return f"deepspeed-z{fw['zero_stage']}"
    return name


def load_from(path: str | None, from_wandb: str | None = None) -> list[dict]:
    """Records from W&B (an offline sweep dir or entity/project[/group]) when from_wandb is given,
    else from the record.json files under path."""
    if from_wandb:
        from analysis.wandb_io import read_records

        return read_records(from_wandb)
    return load(path)
