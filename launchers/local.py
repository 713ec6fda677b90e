"""Start a job's ranks as processes on this machine (gloo on CPU, or NCCL with one GPU each)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

from launchers import open_new, signals

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def bound_socket() -> socket.socket:
    """A socket bound to 127.0.0.1 on a free port for the rendezvous store, drawn at random below the
    kernel's ephemeral range.

    A port the kernel hands out (bind to 0) is handed out again, to the outgoing and listening sockets
    gloo opens for other jobs' ranks; seen as "DistNetworkError: The server socket has failed to
    listen" when several sweeps run at once. Ports below the ephemeral range are only ever taken by
    someone who asks for them by number."""
    import random

    lo, _hi = _ephemeral_range()
    first = max(1024, lo - 12000)
    for port in random.Random().sample(range(first, lo), 64):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        return s
    s = socket.socket()  # all taken: whatever the kernel gives
    s.bind(("127.0.0.1", 0))
    return s


def free_port() -> int:
    """A port free now (bound_socket's, released)."""
    with bound_socket() as s:
        return s.getsockname()[1]


# torch/distributed/rendezvous.py _create_c10d_store: with this set every rank connects to the store as
# a client (torchrun's agent store) instead of rank 0 hosting it
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


@contextlib.contextmanager
def local_store(timeout_s: int):
    """The job's rendezvous store, hosted by the launcher for its ranks as torchrun's agent hosts
    one, listening on 127.0.0.1 alone (rank 0's own TCPStore would listen on every interface of the
    machine: torch's TCPStore binds no host). Yields its port; ranks started with
    rank_env(..., agent_store=True) use it."""
    import datetime

    from torch.distributed import TCPStore

    sock = bound_socket()
    port = sock.getsockname()[1]
    # an interruption deferred while the fd changes hands: raised between the store's construction and the
    # detach it would close the fd twice (the store's server and sock.close: "OSError: [Errno 9] Bad file
    # descriptor" recorded in place of the interruption); deferred, it is raised right after
    with signals.deferred():
        try:
            sock.listen()
            store = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store's server owns the listening fd now and closes it when it goes
    try:
        yield port
    finally:
        del store


def rank_env(rank: int, world: int, master: str, port: int, local_rank: int, device: str,
             agent_store: bool = False) -> dict:
    """A rank's environment: torchrun-style variables; on CPU one thread and no GPU visible.
    agent_store: the store at master:port is the launcher's (local_store), every rank its client."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
               MASTER_ADDR=master, MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(AGENT_STORE_ENV, None)
    if agent_store:
        env[AGENT_STORE_ENV] = "True"
    if device in ("cpu", "fake"):  # fake: FakeTensors on a fake CPU device
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def spawn_rank(job_dir: str, rank: int, world: int, master: str, port: int, local_rank: int,
               device: str, agent_store: bool = False) -> subprocess.Popen:
    """One rank as `python -m launchers.worker JOB_DIR` (what torchrun starts), output to
    JOB_DIR/rank{R}.log."""
    env = rank_env(rank, world, master, port, local_rank, device, agent_store)
    env["TRAIN_LEDGER_PARENT_PID"] = str(os.getpid())  # launchers/worker.py die_with_parent
    with open_new(os.path.join(job_dir, f"rank{rank}.log")) as log:  # the child keeps its own handle
        return subprocess.Popen([sys.executable, "-m", "launchers.worker", job_dir], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


def log_tail(job_dir: str, rank: int, chars: int = 3000) -> str:
    with open(os.path.join(job_dir, f"rank{rank}.log"), errors="replace") as f:
        return f.read()[-chars:]


def clear_results(job_dir: str, ranks) -> None:
    """Stale results of an earlier attempt (a rerun, a requeue) must not be read back."""
    for r in ranks:
        p = os.path.join(job_dir, f"rank{r}.json")
        if os.path.exists(p):
            os.remove(p)


def fork_from(cluster, framework: str) -> str | None:
    """The framework whose fork server starts a job's ranks, or None to spawn each one:
    cluster.fork_ranks on a CPU job (launchers.forkserver says why)."""
    return framework if cluster.fork_ranks and cluster.device == "cpu" else None


# a local run starts every rank on this machine: beyond this many ranks per CPU core (and at least
# LOCAL_RANKS_MIN) it is a mistake (a cluster's world on the default local cluster), not a run
LOCAL_RANKS_PER_CPU = 4
LOCAL_RANKS_MIN = 16


def available_memory_bytes() -> int | None:
    """/proc/meminfo's MemAvailable (what the kernel can give without swapping); None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_world_error(world: int, heaviest_rank_bytes: int, device: str) -> str | None:
    """Why this machine cannot run `world` local ranks, each holding up to heaviest_rank_bytes (the
    ledger's predicted peak of the heaviest rank), or None. CPU ranks share the machine's memory;
    the rank count is bounded by its cores."""
    from ledger.units import fmt

    cpus = os.cpu_count() or 1
    bound = max(LOCAL_RANKS_MIN, LOCAL_RANKS_PER_CPU * cpus)
    if world > bound:
        return (f"cluster.ranks x cluster.nodes: a local run of {world} ranks on this machine of {cpus} CPUs "
                f"(at most {bound}: {LOCAL_RANKS_PER_CPU} per CPU, or {LOCAL_RANKS_MIN}); run it on a cluster "
                "(cluster=slurm_gpu_example or yours), or mode=predict / dry / cluster=fake")
    avail = available_memory_bytes()
    need = heaviest_rank_bytes * world
    if device == "cpu" and avail is not None and need > avail:
        return (f"cluster.ranks x cluster.nodes: {world} local CPU ranks need about {fmt(need)} "
                f"({world} x the heaviest rank's predicted peak {fmt(heaviest_rank_bytes)}), this machine has "
                f"{fmt(avail)} available; a smaller model or world, or cluster=fake (shapes, no memory)")
    return None


def start_rank(job_dir: str, rank: int, world: int, port: int, device: str, framework: str | None):
    """One rank of a local job, a client of the launcher's store at 127.0.0.1:port (local_store)."""
    if framework is None:
        return spawn_rank(job_dir, rank, world, "127.0.0.1", port, rank, device, agent_store=True)
    from launchers import forkserver

    return forkserver.fork_rank(framework, device, rank_env(rank, world, "127.0.0.1", port, rank, device, True),
                                job_dir, os.path.join(job_dir, f"rank{rank}.log"))


def run_local(job_dir: str, world: int, timeout_s: int, device: str = "cpu",
              framework: str | None = None) -> list[dict]:
    """Run `world` ranks of launchers.worker; return per-rank {rank, returncode, log_tail, timed_out}.
    framework: fork them from that framework's fork server (fork_from), else spawn each.

    When one rank fails the others are given a few seconds, then killed: they would otherwise
    wait in a collective until the timeout. Ranks still running at timeout_s are killed and marked
    timed_out. Whatever ends this function early (an Interrupted from SIGTERM) kills the ranks too:
    none outlives its job."""
    clear_results(job_dir, range(world))
    with local_store(timeout_s) as port:
        return _run_ranks(job_dir, world, timeout_s, device, framework, port)


def _wait_a_while(proc, seconds: float) -> None:
    """Up to `seconds` for proc to end (a Popen or a forkserver.ForkedRank): the loop looks again as soon
    as a rank ends instead of a fixed sleep later (a job's last rank ends, on average, half a sleep sooner)."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def _run_ranks(job_dir: str, world: int, timeout_s: int, device: str, framework: str | None,
               port: int) -> list[dict]:
    procs = []
    try:
        for r in range(world):
            procs.append(start_rank(job_dir, r, world, port, device, framework))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    deadline = time.monotonic() + timeout_s
    failed_at, timed_out = None, set()
    try:
        while True:
            rcs = [p.poll() for p in procs]
            if all(rc is not None for rc in rcs):
                break
            if failed_at is None and any(rc not in (None, 0) for rc in rcs):
                failed_at = time.monotonic()
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now - failed_at > 10):
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        p.kill()
                        if now > deadline:
                            timed_out.add(r)
            _wait_a_while(next(p for p, rc in zip(procs, rcs) if rc is None), 0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [{"rank": r, "returncode": p.returncode, "log_tail": log_tail(job_dir, r), "timed_out": r in timed_out}
            for r, p in enumerate(procs)]
