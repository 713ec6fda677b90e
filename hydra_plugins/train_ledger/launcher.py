"""train-ledger's launchers: Hydra's basic (local) one and submitit's Slurm one, each resuming a
campaign (launchers/campaign.py) before it dispatches anything; the Slurm one also validates every
job before sbatch and records jobs Slurm kills.

Hydra instantiates launchers only from the hydra_plugins namespace, hence this module; the
callback that selects them and the Slurm helpers are in launchers/slurm.py.
"""
import contextlib
import logging
import os

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

from launchers.slurm import _annotate, _record_killed, final_state, log


def _composed(launcher, job_overrides, initial_job_idx):
    """[(num, job cfg without hydra, job_dir, overrides, sweep config with hydra)], each job's config
    composed once: the job cfg as its task function will see it, the sweep config for run_job."""
    loader = launcher.hydra_context.config_loader
    out = []
    for i, ov in enumerate(job_overrides):
        idx = initial_job_idx + i
        sweep_cfg = loader.load_sweep_config(launcher.config, list(ov))
        with open_dict(sweep_cfg.hydra.job):
            sweep_cfg.hydra.job.num = idx
            sweep_cfg.hydra.job.id = idx
        job_dir = os.path.join(str(sweep_cfg.hydra.sweep.dir), str(sweep_cfg.hydra.sweep.subdir))
        cfg = sweep_cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
        out.append((idx, cfg, job_dir, list(ov), sweep_cfg))
    return out


class _ComposedOnce:
    """A launcher whose config loader hands each job's composition from Hydra's validation to
    _composed. Hydra's sweeper composes every job of a batch to validate it (plugins/sweeper.py
    validate_batch_is_legal: load_sweep_config, whose result it drops) and then hands the batch to the
    launcher, whose _composed makes the same call again: ~0.6 s of Hydra and OmegaConf a job, twice
    (a profile of a six-job sweep). The loader keeps each composition until the next call for the same
    master config and overrides takes it, so each job is composed once; a call nothing made before
    composes as always."""

    def setup(self, *, hydra_context, task_function, config) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        loader = hydra_context.config_loader
        if getattr(loader, "_train_ledger_kept", None) is not None:
            return
        compose = loader.load_sweep_config
        kept: dict = {}

        def load_sweep_config(master_config, sweep_overrides):
            key = (id(master_config), tuple(sweep_overrides))
            if key in kept:
                return kept.pop(key)
            cfg = kept[key] = compose(master_config, list(sweep_overrides))
            return cfg

        loader._train_ledger_kept = kept
        loader.load_sweep_config = load_sweep_config


def _plan(launcher, jobs):
    """The campaign's decisions, or SystemExit(2) naming the jobs of another config (nothing ran)."""
    from launchers.campaign import CampaignError, plan

    try:
        decisions = plan(str(launcher.config.hydra.sweep.dir), jobs)
    except CampaignError as e:
        import sys

        print(f"train-ledger: not resuming {launcher.config.hydra.sweep.dir}:\n{e}", file=sys.stderr)
        raise SystemExit(2) from None  # bad input, as an invalid config: nothing was dispatched
    for d in decisions:
        if not d.run or d.prior_status is not None:
            logging.getLogger(__name__).info(f"#{d.num} {d.why}")
    return decisions


@contextlib.contextmanager
def _holding(launcher):
    """The sweep dir held for the launch (launchers/campaign.py sweep_lock), or SystemExit(2) naming
    the sweep that holds it (nothing ran)."""
    import sys

    from launchers.campaign import SweepBusy, sweep_lock

    try:
        with sweep_lock(str(launcher.config.hydra.sweep.dir)):
            yield
    except SweepBusy as e:
        print(f"train-ledger: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _skipped(decision, overrides):
    return _done(overrides, {"status": decision.prior_status, "job_dir": decision.job_dir, "skipped": True})


class CampaignBasicLauncher(_ComposedOnce, BasicLauncher):
    """Hydra's basic launcher (jobs one after another in this process), skipping the jobs a campaign
    has already finished."""

    def launch(self, job_overrides, initial_job_idx):
        with _holding(self):
            return self._launch(job_overrides, initial_job_idx)

    def _launch(self, job_overrides, initial_job_idx):
        from hydra.core.utils import configure_log, run_job, setup_globals

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        os.makedirs(str(self.config.hydra.sweep.dir), exist_ok=True)
        jobs = _composed(self, job_overrides, initial_job_idx)
        runs = []
        for d, (_, _, _, ov, sweep_config) in zip(_plan(self, jobs), jobs):
            if not d.run:
                runs.append(_skipped(d, ov))
                continue
            runs.append(run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                                config=sweep_config, job_dir_key="hydra.sweep.dir",
                                job_subdir_key="hydra.sweep.subdir"))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs


class ValidatingSlurmLauncher(_ComposedOnce, SlurmLauncher):
    def launch(self, job_overrides, initial_job_idx):
        with _holding(self):
            return self._launch(job_overrides, initial_job_idx)

    def _launch(self, job_overrides, initial_job_idx):
        from launchers.job import check, invalid_record
        from ledger.layout import ConfigError

        valid, returns = [], {}
        jobs = _composed(self, job_overrides, initial_job_idx)
        for i, (d, (idx, cfg, job_dir, ov, _)) in enumerate(zip(_plan(self, jobs), jobs)):
            if not d.run:
                returns[i] = _skipped(d, ov)
                continue
            try:
                # in run mode this includes world == cluster.nodes x cluster.ranks, which SlurmSetup
                # made the launcher's nodes x tasks_per_node
                check(cfg)
            except ConfigError as e:
                invalid_record(cfg, job_dir, str(e))
                log.error(f"#{idx} invalid, not submitted: {e}")
                returns[i] = _done(ov, {"status": "invalid", "job_dir": job_dir})
                continue
            valid.append((i, ov, job_dir))
        if valid:
            for (i, _, _), r in zip(valid, self._submit(valid, initial_job_idx)):
                returns[i] = r
        return [returns[i] for i in range(len(job_overrides))]

    def _submit(self, valid, initial_job_idx):
        """submitit's launch() for the valid jobs [(position, overrides, job_dir)] of the sweep; a job
        Slurm kills becomes a record."""
        import logging

        import submitit
        from hydra.core.singleton import Singleton

        # without slurmdbd every state poll warns that sacct failed; _wait() asks scontrol instead
        logging.getLogger("submitit").setLevel(logging.ERROR)

        params = dict(self.params)
        executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                         slurm_max_num_timeout=params.pop("max_num_timeout", 0))
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
        args = [(list(ov), "hydra.sweep.dir", initial_job_idx + pos, f"job_id_for_{initial_job_idx + pos}",
                 Singleton.get_state()) for pos, ov, _ in valid]
        jobs = executor.map_array(self, *zip(*args))
        from launchers.campaign import update_manifest

        update_manifest(str(self.config.hydra.sweep.dir),
                        {initial_job_idx + pos: {"slurm_job_id": str(job.job_id),
                                                 # the clients' config, for analysis.status
                                                 "slurm_conf": os.environ.get("SLURM_CONF")}
                         for (pos, _, _), job in zip(valid, jobs)})
        out = []
        for job, (_, ov, job_dir) in zip(jobs, valid):
            try:
                if not _wait(job):
                    raise RuntimeError("no result from the job's first task")
                res = job.results()[0]
                _annotate(job_dir, job.job_id)
                out.append(res)
            except Exception as e:  # killed by Slurm, or the task itself died
                state = final_state(job.job_id)
                _record_killed(job_dir, job.job_id, state, e)
                out.append(_done(ov, {"status": "failed", "job_dir": job_dir, "slurm_state": state.get("JobState")}))
        return out


def _done(overrides, value):
    from hydra.core.utils import JobReturn, JobStatus

    r = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
    r.return_value = value
    return r


def _wait(job, poll_s: float = 2.0) -> bool:
    """Until every task left its result (True), or Slurm says the job ended (False, when task 0 has
    no result: submitit's results() would then wait forever). submitit asks sacct, which needs
    slurmdbd; without it a job killed before task 0 wrote its result would be waited on forever."""
    import time

    from launchers.slurm import ACTIVE_STATES, slurm_state

    tasks = [job.task(i) for i in range(job.num_tasks)] if job.num_tasks > 1 else [job]
    ended_at = None
    while not all(t.paths.result_pickle.exists() for t in tasks):
        if slurm_state(job.job_id).get("JobState", "UNKNOWN") not in ACTIVE_STATES:
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 10:  # results of a finished job reach the shared folder late
                return tasks[0].paths.result_pickle.exists()
        time.sleep(poll_s)
    return True
