"""train-ledger's Hydra entry: predict -> run -> measure -> reconcile, one job per combination.

    python launch.py mode=predict model=llama3_1b framework=megatron layout.tp=2 layout.pp=2 layout.dp=2
    python launch.py -m framework=megatron,deepspeed,titan          # real runs on the local CPU cluster
"""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from conf.schema import register

register()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> dict:
    from launchers.job import run_job
    from launchers.signals import exit_on_signals
    from launchers.slurm import slurm_ranks_runner, task_env

    exit_on_signals()  # SIGTERM records the running job as interrupted and stops its ranks
    hc = HydraConfig.get()
    te = task_env()
    if te is not None:  # a task of a Slurm job: this task runs one rank; rank 0 writes the record
        rank, world, master, port, job_id = te
        record = run_job(cfg, hc.runtime.output_dir, ranks_runner=slurm_ranks_runner(rank, world, master, port),
                         writes_record=rank == 0,
                         extra={"slurm": {"JobId": job_id, "NodeList": os.environ.get("SLURM_JOB_NODELIST"),
                                          "ntasks": world}})
        if rank != 0:
            return {"status": record["status"], "job_dir": hc.runtime.output_dir, "rank": rank}
    else:
        if hc.mode != RunMode.MULTIRUN:  # a sweep's launcher holds its dir and checks each job (campaign)
            refuse_a_job_dir_in_use(hc.runtime.output_dir)
        record = run_job(cfg, hc.runtime.output_dir)
    status = record["status"]
    if status != "ok":
        name = f"job #{hc.job.num} ({os.path.basename(record['job_dir'])})" if hc.mode == RunMode.MULTIRUN else "job"
        print(f"{name} {status}: {record['error']}", file=sys.stderr)
        if hc.mode != RunMode.MULTIRUN:  # a single run fails loudly; a sweep goes on
            sys.exit(2 if status == "invalid" else 1)
    return {"status": status, "job_dir": record["job_dir"]}


def refuse_a_job_dir_in_use(job_dir: str) -> None:
    """A single run into a job dir another live job on this host is running in exits 2, touching nothing."""
    import records
    from launchers.campaign import in_use

    try:
        why = in_use(records.read_if_any(job_dir))
    except records.UnreadableRecord:
        return
    if why:
        print(f"train-ledger: {job_dir} {why}: wait for it, or give this run another hydra.run.dir", file=sys.stderr)
        sys.exit(2)


def check_override_syntax(argv: list[str]) -> None:
    """A key=value that Hydra's override grammar cannot parse (a quote, `;` or `$(` in a value) exits 2
    naming the key, before Hydra composes anything: bad input, not a crash."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as e:
            key = arg.split("=", 1)[0].lstrip("+~")
            why = next((ln.strip() for ln in str(e).splitlines()[1:] if ln.strip() and not ln.startswith("See ")),
                       "unparsable")
            print(f"invalid: {key}: {arg!r} is not a valid override ({why}); "
                  f"quote a value with spaces or special characters for Hydra, e.g. {key}='...'", file=sys.stderr)
            sys.exit(2)


def check_override_types(argv: list[str]) -> None:
    """A value of the wrong type for its field (`model.layers=2.5`) exits 2 naming the field, as every
    other bad value does, before Hydra composes (conf/validate.py wrong_type)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from conf.validate import wrong_type

    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        ov = parser.parse_override(arg)
        if ov.is_delete():
            continue
        value = ov.value()
        values = list(getattr(value, "list", None) or []) if ov.is_sweep_override() else [value]
        why = wrong_type(ov.key_or_group, values)
        if why:
            print(f"invalid: {why}", file=sys.stderr)
            sys.exit(2)


def check_override_keys(argv: list[str]) -> None:
    """A group.field override (with or without Hydra's + / ++ / ~) whose field the typed schema does not
    have exits 2 naming it, before Hydra composes anything: `+layout.tpp=2` would otherwise add a key
    nothing reads and predict at tp=1 (conf/validate.py unknown_key)."""
    from conf.validate import unknown_key

    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        why = unknown_key(arg.split("=", 1)[0].lstrip("+~"))
        if why:
            print(f"invalid: {why}", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    check_override_syntax(sys.argv[1:])
    check_override_keys(sys.argv[1:])
    check_override_types(sys.argv[1:])
    main()
