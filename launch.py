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

    from launchers.slurm import slurm_ranks_runner, task_env

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
        record = run_job(cfg, hc.runtime.output_dir)
    status = record["status"]
    if status != "ok":
        print(f"job {hc.job.num if hc.mode == RunMode.MULTIRUN else ''} {status}: {record['error']}",
              file=sys.stderr)
        if hc.mode != RunMode.MULTIRUN:  # a single run fails loudly; a sweep goes on
            sys.exit(2 if status == "invalid" else 1)
    return {"status": status, "job_dir": record["job_dir"]}


if __name__ == "__main__":
    main()
