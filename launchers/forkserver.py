"""CPU ranks forked from a process that has imported the framework once (a fork server).

Why: importing megatron.core, deepspeed or torchtitan costs 5-12 s of CPU in every rank process
(torch.jit scripting, DTensor op tables), more than a tiny job's steps. On a 2-core machine a
4-rank job spends most of its wall time importing. A fork server imports the framework once (the
launcher module's `preload(device)`, which runs the same imports and import-time settings as its
`run_rank`), then forks one child per rank; each child sets the rank's environment, sends its
output to rankR.log and runs launchers.worker.run(JOB_DIR) — the same code as
`python -m launchers.worker JOB_DIR`, which stays the reference path (cluster.fork_ranks=false, and
always on CUDA and Slurm: a process must not fork after CUDA is initialised, and torchrun/srun
start the ranks there). tests/test_forkserver.py checks that both paths measure the same job alike.

Protocol (one Unix-socket connection per rank): the client sends one JSON line {env, cwd, log,
job_dir}; the server forks a monitor, which forks the rank, replies {"pid": P}, waits for it and
replies {"returncode": RC} (negative: killed by that signal, as subprocess reports it). The
monitor kills the rank when the client goes away, so no rank outlives its job.

Lifetime: by default a server belongs to the launch.py process that started it (it stops at that
process's exit, or when its parent is gone). With TRAIN_LEDGER_FORKSERVERS=DIR set, servers live
in DIR and are shared by every launch.py that sees the same DIR (the test session's real-run jobs);
such a server stops after `IDLE_S` without a request or when DIR/<framework>.pid is removed.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DIR_ENV = "TRAIN_LEDGER_FORKSERVERS"
IDLE_S = 600
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
START_TIMEOUT_S = 300


# -- the server (python -m launchers.forkserver FRAMEWORK SOCKET DEVICE [--shared]) -------------
def _rank(req: dict) -> None:
    """In the forked rank: the worker's environment, output and entry point. Never returns."""
    rc = 1
    try:
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        if os.path.lexists(req["log"]):  # a new file, never through a symlink at the path (launchers.open_new)
            os.unlink(req["log"])
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # PYTHONUNBUFFERED, as the spawned worker has
        sys.argv = [os.path.join(REPO, "launchers", "worker.py"), req["job_dir"]]
        from launchers import worker

        rc = worker.run(req["job_dir"])
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc)  # as launchers.worker._exit: no interpreter teardown after the result


def _monitor(conn: socket.socket) -> None:
    """In a child of the server: fork the rank, report its pid and exit status. Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it; this process waits
    try:
        req = json.loads(conn.makefile("r").readline())
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(req)
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn.sendall((json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())
                break
            readable, _, _ = select.select([conn], [], [], 0.2)
            if readable and not conn.recv(1):  # the client is gone: its rank must not outlive it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        os._exit(0)


def serve(framework: str, sock_path: str, device: str, shared: bool) -> None:
    from ledger import frameworks

    importlib.import_module(frameworks.get(framework).launcher).preload(device)
    # what launchers.worker.run imports on its first line (inside the function): conf.schema brings
    # hydra, omegaconf and antlr4, 1.9 s of CPU a rank spent after every fork
    import conf.schema  # noqa: F401
    import launchers.worker  # noqa: F401
    import ledger.layout  # noqa: F401
    import probes.session  # noqa: F401
    from probes.peak import freeze_imports

    # the server's ~450k objects out of every rank's cyclic collections and peak-probe scans (0.4 s of
    # CPU a scan, two a rank); the last thing before the first fork
    freeze_imports()

    parent = os.getppid()
    pid_file = os.path.join(os.path.dirname(sock_path), f"{framework}.pid")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(64)
    srv.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    last = time.monotonic()
    while True:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            if shared and (time.monotonic() - last > IDLE_S or not os.path.exists(pid_file)):
                break
            if not shared and os.getppid() != parent:
                break
            continue
        last = time.monotonic()
        if os.fork() == 0:
            srv.close()
            _monitor(conn)
        conn.close()
    srv.close()
    with contextlib.suppress(FileNotFoundError):
        os.remove(sock_path)


# -- the client ---------------------------------------------------------------------------------
class ForkedRank:
    """A rank forked by a server, with the part of subprocess.Popen's interface run_local uses."""

    def __init__(self, sock_path: str, req: dict):
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(sock_path)
        self.conn.sendall((json.dumps(req) + "\n").encode())
        self._lines = self.conn.makefile("r")
        self.pid = json.loads(self._lines.readline())["pid"]
        self.returncode: int | None = None

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        readable, _, _ = select.select([self.conn], [], [], timeout)
        if readable:
            line = self._lines.readline()
            # a monitor that went away without a status: report it as a failed rank
            self.returncode = json.loads(line)["returncode"] if line else -signal.SIGKILL
            self.close()

    def close(self) -> None:
        """Drop the connection (both the file and the socket hold it); a running rank is then killed."""
        self._lines.close()
        self.conn.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("forked rank", timeout)
            self._read(left)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


_OWNED: dict[tuple[str, str], tuple[str, subprocess.Popen]] = {}


def _alive(sock_path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(sock_path)  # accepted, then closed: the server's monitor sees an empty request
        return True
    except OSError:
        return False


def _start(framework: str, directory: str, device: str, env: dict, shared: bool) -> tuple[str, subprocess.Popen]:
    sock_path = os.path.join(directory, f"{framework}.sock")
    log_path = os.path.join(directory, f"{framework}.log")
    with contextlib.suppress(FileNotFoundError):
        os.remove(sock_path)
    env = {k: v for k, v in env.items() if k not in RANK_VARS}  # each request brings its rank's
    with open(log_path, "w") as log:  # never the caller's stdout: a caller waiting on its pipe would hang
        proc = subprocess.Popen([sys.executable, "-m", "launchers.forkserver", framework, sock_path, device]
                                + (["--shared"] if shared else []), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=shared)
    if shared:
        with open(os.path.join(directory, f"{framework}.pid"), "w") as f:
            f.write(str(proc.pid))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not os.path.exists(sock_path) or not _alive(sock_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"the {framework} fork server did not start (cluster.fork_ranks=false spawns "
                               f"each rank instead):\n{tail}")
        time.sleep(0.1)
    return sock_path, proc


def server(framework: str, device: str, env: dict) -> str:
    """The socket of a ready fork server for `framework` (started if there is none)."""
    shared_dir = os.environ.get(SHARED_DIR_ENV)
    if shared_dir:
        os.makedirs(shared_dir, exist_ok=True)
        sock_path = os.path.join(shared_dir, f"{framework}.sock")
        with open(os.path.join(shared_dir, f"{framework}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one starter per framework among concurrent launch.py
            if not _alive(sock_path):
                _start(framework, shared_dir, device, env, shared=True)
        return sock_path
    key = (framework, device)
    if key in _OWNED and _OWNED[key][1].poll() is None:
        return _OWNED[key][0]
    remove_orphaned_dirs()
    directory = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{framework}-")
    with open(os.path.join(directory, OWNER), "w") as f:
        f.write(str(os.getpid()))
    _OWNED[key] = _start(framework, directory, device, env, shared=False)
    atexit.register(_stop, _OWNED[key][1], directory)
    return _OWNED[key][0]


PRIVATE_PREFIX = "forkserver-"  # a launcher's own server's folder in TMPDIR: forkserver-<framework>-XXXX
OWNER = "owner.pid"  # in it: the launcher's pid (its server exits with it: serve)


def remove_orphaned_dirs(root: str | None = None) -> list[str]:
    """Remove the private servers' folders whose launcher is gone (killed with -9: atexit never ran
    _stop; the server itself exits with its parent). Returns them. A folder without an owner file is
    not touched (another version's, or one being made)."""
    from records import process_alive

    removed = []
    for d in glob.glob(os.path.join(root or tempfile.gettempdir(), f"{PRIVATE_PREFIX}*-*")):
        try:
            with open(os.path.join(d, OWNER)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not process_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _stop(proc: subprocess.Popen, directory: str) -> None:
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    shutil.rmtree(directory, ignore_errors=True)


def stop_shared(directory: str) -> None:
    """Stop the shared servers in `directory` (the test session's teardown)."""
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.endswith(".pid"):
            path = os.path.join(directory, name)
            with open(path) as f:
                pid = int(f.read().strip() or 0)
            os.remove(path)
            with contextlib.suppress(ProcessLookupError):
                if pid:
                    os.kill(pid, signal.SIGTERM)


def fork_rank(framework: str, device: str, env: dict, job_dir: str, log: str) -> ForkedRank:
    return ForkedRank(server(framework, device, env), {"env": env, "cwd": REPO, "log": log, "job_dir": job_dir})


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3], shared="--shared" in sys.argv[4:])
