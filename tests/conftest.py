import os
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a subprocess of the suite runs with on its path: the repository, then the caller's PYTHONPATH
# (scripts/slow_cpu's sitecustomize, where the suite is timed as a CPU without a bf16 GEMM path)
REPO_PATH = os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
sys.path.insert(0, REPO)

import records  # noqa: E402
from launchers import forkserver  # noqa: E402

# One fork server per framework for the whole session: each real job's ranks are forked from a
# process that imported the framework once (launchers.forkserver), not imported again per rank.
# launch() passes os.environ on, so every launch.py of the session shares them.
os.environ.setdefault(forkserver.SHARED_DIR_ENV, tempfile.mkdtemp(prefix="train-ledger-forkservers-"))


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the servers outlive it
        return
    forkserver.stop_shared(os.environ[forkserver.SHARED_DIR_ENV])


# make test runs the files on two pytest-xdist workers, a file to a worker (--dist loadfile, so one
# module fixture = one real run), handed out in collection order (--no-loadscope-reorder): the files
# that take longest go first, so that no long file starts last while the other worker idles.
# Measured per file on a fresh clone (--durations); a file not named keeps its place after these.
# test_slurm.py second: much of its time is waiting on Slurm (a time limit, scancel), which the
# DeepSpeed matrix's compute on the other worker fills.
LONGEST_FIRST = ("test_deepspeed.py", "test_slurm.py", "test_titan.py", "test_megatron.py", "test_megatron_moe.py", "test_deepspeed_moe.py",
                 "test_titan_moe.py",
                 # (the article's question is one process of pure-Python planning, ~90 s: begun last it is the tail)
                 "test_timing.py", "test_forkserver.py", "test_golden.py",
                 "test_fake.py", "test_report.py", "test_wandb.py", "test_plan.py", "test_failures.py",
                 "test_campaign.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(os.path.basename(str(it.path)), len(rank)))  # stable: in-file order kept


def launch(*args: str, timeout: int = 1800, check: bool = False, nice: int = 0,
           wandb: bool = False) -> subprocess.CompletedProcess:
    """Run launch.py as a user would; returns the completed process (stdout+stderr captured). nice: the
    process's nice value (what it runs, and on the local Slurm what it submits, inherit it). W&B's
    offline logging (the default, ~1.2 s of a job's CPU here) is off unless `wandb` or the args set
    wandb.mode: logging and reading it back are test_wandb's, test_report's and the campaign's tests'."""
    cmd, kw = _launch_command(args, nice, wandb)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"launch.py {' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def launch_in_background(*args: str, log: str, nice: int = 0, wandb: bool = False) -> subprocess.Popen:
    """launch() started and not waited for, its stdout and stderr into the file `log` (a pipe nobody reads
    while the test does other work could fill and stall it)."""
    cmd, kw = _launch_command(args, nice, wandb)
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)


def _launch_command(args: tuple, nice: int, wandb: bool) -> tuple[list, dict]:
    """launch()'s command line and its Popen keywords (cwd, env, nice)."""
    if not wandb and not any(a.startswith("wandb.mode=") for a in args):
        args = (*args, "wandb.mode=disabled")
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=REPO_PATH)
    return [sys.executable, "launch.py", *args], dict(cwd=REPO, env=env,
                                                      preexec_fn=(lambda: os.nice(nice)) if nice else None)


def megatron_fw(**kw):
    """A Megatron framework config with its schema's defaults (the local spec), for predict-only checks."""
    import types

    d = dict(name="megatron", precision="bf16", use_distributed_optimizer=True, grad_reduce_in_fp32=True,
             overlap_grad_reduce=False, overlap_param_gather=False, bucket_size=None, average_in_collective=False,
             clip_grad=1.0, make_vocab_size_divisible_by=128, transformer_impl="local")
    d.update(kw)
    return types.SimpleNamespace(**d)


def megatron_layout(**kw):
    """A resolved layout, dp 2 unless given."""
    from ledger.layout import resolve

    d = dict(tp=1, pp=1, dp=2, dp_replicate=1, cp=1, ep=1, vp=1, sequence_parallel=False, micro_batch_size=1,
             global_batch_size=-1)
    d.update(kw)
    return resolve(AttrDict(d))


class AttrDict(dict):
    """A dict read by item and by attribute, as resolve() and place() read a config."""
    __getattr__ = dict.__getitem__


def titan_fw(**kw):
    """A torchtitan framework config with its schema's defaults, for predict-only checks."""
    import types

    # fuse_qkv=False: the unit tests' hand counts are of wq / wk / wv (the matrices run torchtitan's fused default)
    d = dict(name="titan", reshard_after_forward="default", dtype="float32", mixed_precision_param="bfloat16",
             mixed_precision_reduce="float32", spmd_backend="partial_dtensor", precision="bf16", fuse_qkv=False)
    d.update(kw)
    return types.SimpleNamespace(**d)


def titan_layout(world: int = 4, **kw):
    """A layout resolved over `world` ranks (dp fills the rest)."""
    from omegaconf import OmegaConf

    from ledger.layout import resolve

    d = dict(tp=1, pp=1, dp=-1, dp_replicate=1, cp=1, ep=1, vp=1, sequence_parallel=False, micro_batch_size=1,
             global_batch_size=-1)
    d.update(kw)
    return resolve(OmegaConf.create(d), world=world)


def run_sh_flags(path: str) -> list[str]:
    """pretrain_gpt.py's arguments in a dry run.sh (its torchrun line, continuation lines joined)."""
    from importers.megatron import run_sh_args

    return run_sh_args(path)[0]


def compose_config(*overrides):
    """The job config launch.py composes from these overrides (Hydra, the typed schema registered)."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register

    register()
    with initialize_config_dir(config_dir=f"{REPO}/conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def run_launch():
    return launch


def launch_many(argvs: list[list[str]], timeout: int = 1800) -> None:
    """Several launch.py multiruns, each argv as a user gives launch.py, in one process
    (tests/run_many.py: one start-up instead of one per multirun); fails naming the one that did."""
    import json

    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=REPO_PATH)
    p = subprocess.run([sys.executable, "-m", "tests.run_many", json.dumps(argvs)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]


def run_sweeps(root, sweeps, common=()) -> dict:
    """Run named multiruns into root/<name> once; return their records, the ok ones and their reconcile table."""
    import records
    from analysis import reconcile

    # wandb.mode=disabled: these matrices check ledger against probes; W&B logging and read-back
    # are test_wandb's and the report tests' (offline logging costs ~2 s a job)
    launch_many([["-m", *common, *overrides, "wandb.mode=disabled", f"hydra.sweep.dir={root / name}",
                  f"hydra.sweep.subdir={name}_${{hydra.job.num}}"] for name, overrides in sweeps],
                timeout=900 * len(sweeps))
    recs = records.load(str(root))
    ok = [r for r in recs if r["status"] == "ok"]
    return {"records": recs, "ok": ok, "table": reconcile.table(ok)}


def peak_evidence(recs, bad) -> str:
    """The failing peak rows, each with what the probe saw at its peak (where, bytes by category,
    what worker threads and the cyclic GC freed): a CI failure says what moved without a rerun."""
    import records

    lines = [bad.to_string()]
    for row in bad.itertuples():
        rec = next(r for r in recs if records.job_name(r) == row.job)
        m = next(m for m in rec["measurement"]["ranks"] if m["rank"] == row.rank)
        st = next(s for s in m["steps"] if s["step"] == row.step)
        p = records.predicted_ranks(rec["prediction"])(row.rank)["peak"]
        mk = {k: v for k, v in st["peak"].items() if k != "timeline"}
        lines.append(f"{row.job} rank {row.rank} step {row.step}: measured {mk}; "
                     f"predicted {p['bytes']} {p['phase']} {p['what']!r} {p['parts']}")
    return "\n".join(lines)


# -- the MoE matrices' shared checks (tests/test_megatron_moe.py, test_deepspeed_moe.py, test_titan_moe.py)
def assert_jobs(sweep, job_of, expected) -> None:
    """Every job ran ok, and the sweep's jobs (job_of(record)) are `expected`, each once."""
    import records

    bad = [(records.job_name(r), r["status"], r["error"]) for r in sweep["records"] if r["status"] != "ok"]
    assert not bad, bad
    jobs = [job_of(r) for r in sweep["ok"]]
    assert len(jobs) == len(set(jobs)) and set(jobs) == set(expected), sorted(set(jobs) ^ set(expected))


def assert_states_on_every_rank(sweep, steps: int = 2) -> None:
    """Each job has every state row on every rank at every step."""
    import records
    from analysis import reconcile

    df = sweep["table"]
    for rec in sweep["ok"]:
        d = df[df.job == records.job_name(rec)]
        assert set(d["rank"]) == set(range(rec["measurement"]["world"])), records.job_name(rec)
        for q in reconcile.STATE_Q:
            assert len(d[d.quantity == q]) == steps * rec["measurement"]["world"], (records.job_name(rec), q)


def assert_every_row_reconciles(table, records_ok, routed=()) -> None:
    """The contract every framework's matrix meets: every job has its state rows on every rank in its
    steady step, and every state and collective row, first and steady steps, is exact, except the
    quantities in `routed` (all-to-all bytes that follow the router), held inside their predicted range
    instead. Peak rows are judged apart (within 1%, each framework's test_*peak*)."""
    import records
    from analysis import reconcile

    assert len(table) > 0 and records_ok
    rows = table[~table.quantity.str.startswith("peak")]
    steady = rows[rows.phase == "steady"]
    for rec in records_ok:
        job, world = records.job_name(rec), rec["measurement"]["world"]
        d = steady[steady.job == job]
        assert set(d["rank"]) == set(range(world)), f"{job}: ranks without rows"
        for q in reconcile.STATE_Q:
            assert set(d[d.quantity == q]["rank"]) == set(range(world)), f"{job}: {q} not measured on every rank"
        if world > 1:  # a job whose peak is judged has its collectives judged too: rows on every rank
            comm = d[d.quantity.str.startswith("comm/")]
            assert set(comm["rank"]) == set(range(world)), f"{job}: collective rows missing on some rank"
    bounded = rows["bound_low"].notna() if "bound_low" in rows else rows.quantity.isna()
    assert set(rows[bounded].quantity) <= set(routed), sorted(set(rows[bounded].quantity))
    off = rows[bounded & reconcile.off(rows)]
    assert off.empty, off.to_string()
    bad = rows[~bounded & (rows.abs_err != 0)]
    assert bad.empty, bad.to_string()


def routed_rows_by_ep_group(sweep):
    """(job, step, rows) of the routed all-to-all rows (bound_low set) of each EP group: the expert grid
    puts ep innermost (etp 1), so a group is the ranks of one rank // ep."""
    from collections import defaultdict

    import records

    df = sweep["table"]
    rt = df[df["bound_low"].notna() & ~df.quantity.str.startswith("peak")]
    for rec in sweep["ok"]:
        lay = rec["prediction"]["layout"]
        d = rt[rt.job == records.job_name(rec)]
        if d.empty:
            continue
        assert lay.get("etp", 1) == 1
        for step in sorted(set(d.step)):
            groups = defaultdict(list)
            for row in d[d.step == step].itertuples():
                groups[row.rank // lay["ep"]].append(row)
            for members in groups.values():
                assert len(members) == lay["ep"], (records.job_name(rec), step, members)
                yield records.job_name(rec), step, members


def assert_losses_finite(sweep) -> None:
    import records

    for rec in sweep["ok"]:
        for r in rec["measurement"]["ranks"]:
            if r.get("stage", 0) == rec["prediction"]["layout"]["pp"] - 1:
                assert all(s["loss"] is not None and s["loss"] == s["loss"] for s in r["steps"]), records.job_name(rec)


def layout_of(world: int, **kw):
    """A resolved layout from the schema's defaults and `kw` (dp fills the world)."""
    from ledger.layout import resolve

    base = dict(tp=1, pp=1, dp=-1, dp_replicate=1, cp=1, ep=1, etp=1, vp=1, sequence_parallel=False,
                micro_batch_size=1, global_batch_size=-1)
    return resolve({**base, **kw}, world)


def assert_megatron_redirects(sweep, scope: str, may_reach: tuple[str, ...]) -> None:
    """The CPU redirects of launchers/megatron_cpu.py a matrix reached: every one declared with this
    scope (dense: tests/test_megatron.py, moe: test_megatron_moe.py) is reached, and nothing reached is
    outside the scopes it may reach (a dense matrix reaches no MoE site; an MoE one reaches dense ones)."""
    from launchers import megatron_cpu

    reached = set()
    for rec in sweep["ok"]:
        for r in rec["measurement"]["ranks"]:
            reached |= {(h["module"], h["function"], h["what"]) for h in r["cpu_redirects"] if h["count"] > 0}
    declared = {(d["module"], d["function"], d["what"]): d["scope"] for d in megatron_cpu.declared()}
    mine = {k for k, s in declared.items() if s == scope}
    assert mine - reached == set(), f"{scope} redirects no longer reached (remove them): {mine - reached}"
    allowed = {k for k, s in declared.items() if s in may_reach}
    assert reached - allowed == set(), f"undeclared CUDA sites reached (declare them): {reached - allowed}"
