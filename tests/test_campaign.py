"""Campaigns that resume: a sweep rerun into its hydra.sweep.dir skips what it finished, reruns what
failed or was interrupted, and refuses to overwrite jobs of another config; unreadable records are
named and skipped by every reader; analysis.status tells where a campaign stands."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import records
from analysis import status
from tests.conftest import REPO, REPO_PATH, launch


def _predict_sweep(d, *extra):
    return launch("-m", "mode=predict", "framework=megatron,deepspeed", f"hydra.sweep.dir={d}", *extra, timeout=300)


def test_finished_jobs_are_skipped_changed_config_refused(tmp_path):
    p = _predict_sweep(tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    first = {r["job_dir"]: (r["config_hash"], os.path.getmtime(os.path.join(r["job_dir"], "record.json")))
             for r in records.load(str(tmp_path))}
    assert len(first) == 2 and all(h for h, _ in first.values())
    p = _predict_sweep(tmp_path)  # same sweep again: nothing reruns
    assert p.returncode == 0 and p.stdout.count("skipped: its record is ok for the same config") == 2, p.stdout
    for r in records.load(str(tmp_path)):
        assert os.path.getmtime(os.path.join(r["job_dir"], "record.json")) == first[r["job_dir"]][1]
    p = _predict_sweep(tmp_path, "layout.tp=2")  # another config at the same job numbers: refused, untouched
    assert p.returncode == 2 and "already holds a record of another config (layout.tp: 1 -> 2)" in p.stderr
    assert "job #0" in p.stderr and "job #1" in p.stderr
    for r in records.load(str(tmp_path)):
        assert r["config"]["layout"]["tp"] == 1
    p = _predict_sweep(tmp_path, "campaign.rerun=all")  # rerun=all runs both again
    assert p.returncode == 0 and p.stdout.count("runs again (was ok; campaign.rerun=all)") == 2, p.stdout
    # a changed timeout or W&B mode is not another job
    p = _predict_sweep(tmp_path, "cluster.timeout_s=5", "wandb.mode=disabled")
    assert p.returncode == 0 and p.stdout.count("skipped: its record is ok") == 2, p.stderr[-2000:]


def test_unreadable_record_is_named_and_the_rest_go_on(tmp_path):
    p = launch("-m", "mode=predict", "framework=megatron,deepspeed,titan", "wandb.mode=disabled",
               f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    bad = tmp_path / "1_deepspeed" / "record.json"
    bad.write_text(bad.read_text()[:200])  # cut short
    env = dict(os.environ, PYTHONPATH=REPO_PATH)
    for mod in ("analysis.reconcile", "analysis.report", "analysis.status"):
        r = subprocess.run([sys.executable, "-m", mod, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, (mod, r.stderr[-2000:])
        assert f"warning: {bad}: unreadable record (JSONDecodeError" in r.stderr, (mod, r.stderr)
        assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "analysis.reconcile", str(tmp_path)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert "| 1_deepspeed | ?" in r.stdout and "unreadable" in r.stdout and "| 2_titan" in r.stdout
    # a rerun of the sweep runs the unreadable job again and leaves the others
    p = launch("-m", "mode=predict", "framework=megatron,deepspeed,titan", "wandb.mode=disabled",
               f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert p.returncode == 0 and "#1 runs again" in p.stdout and p.stdout.count("skipped: its record") == 2, p.stdout
    assert json.loads(bad.read_text())["status"] == "ok"


def _wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _status_of(job_dir) -> str | None:
    try:
        return records.read_if_any(str(job_dir))["status"]
    except (TypeError, records.UnreadableRecord):
        return None


def _offline_runs(job_dir) -> list[str]:
    return glob.glob(os.path.join(job_dir, "wandb", "offline-run-*"))


@pytest.mark.real
def test_sigterm_mid_sweep_then_resume(tmp_path):
    """SIGTERM to launch.py while job #1 runs: job #1 is recorded as interrupted, its ranks are gone;
    the rerun skips job #0 (its record and its one W&B run untouched) and completes job #1."""
    args = ["-m", "framework=deepspeed", "framework.zero_stage=1,2", "train.steps=2", f"hydra.sweep.dir={tmp_path}"]
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=REPO_PATH)
    proc = subprocess.Popen([sys.executable, "launch.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    j0, j1 = tmp_path / "0_deepspeed", tmp_path / "1_deepspeed"
    try:
        _wait_for(lambda: _status_of(j0) == "ok" and _status_of(j1) == "running", 600, "job #0 ok, job #1 running")
        rank_pids = _rank_pids(j1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    rec1 = records.read_if_any(str(j1))
    assert rec1["status"] == "failed" and rec1["error"] == "interrupted by SIGTERM while running"
    _wait_for(lambda: not any(_alive(p) for p in rank_pids), 30, "the interrupted job's ranks to exit")
    st = status.table(str(tmp_path))
    assert list(st.status) == ["ok", "failed"]
    mtime0, runs0 = os.path.getmtime(j0 / "record.json"), _offline_runs(j0)
    assert len(runs0) == 1

    p = launch(*args, timeout=600, wandb=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "#0 skipped: its record is ok for the same config" in p.stdout
    assert "#1 runs again (was failed; campaign.rerun=failed)" in p.stdout
    assert os.path.getmtime(j0 / "record.json") == mtime0 and _offline_runs(j0) == runs0
    assert _status_of(j1) == "ok"
    st = status.table(str(tmp_path))
    assert list(st.status) == ["ok", "ok"]
    assert status.counts(st).startswith("ok 2 · failed 0 · invalid 0 · timeout 0 · running 0 · pending 0")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _rank_pids(job_dir) -> list[int]:
    """The pids of the job's rank processes (launchers.worker JOB_DIR), from /proc."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"launchers.worker" in cmd and str(job_dir).encode() in cmd:
                out.append(int(d))
    return out


def test_a_sigterm_while_the_store_takes_its_socket_is_raised_after_the_handover(monkeypatch):
    """SIGTERM arriving while the rendezvous store takes over its listening socket (launchers.local
    local_store) is deferred until the store owns it, then raised as the interruption: raised in between,
    the socket's second close ("Bad file descriptor") was recorded as the job's failure in place of the
    interruption (seen on a loaded machine)."""
    import time

    import torch.distributed as td

    from launchers import local, signals

    real, seen = td.TCPStore, {}

    def store_then_sigterm(*a, **kw):
        store = real(*a, **kw)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while signals.pending() is None and time.monotonic() < deadline:  # the handler runs between bytecodes
            time.sleep(0.01)
        seen["deferred"] = signals.pending() == signal.SIGTERM
        return store

    monkeypatch.setattr(td, "TCPStore", store_then_sigterm)
    before = signal.signal(signal.SIGTERM, signals.interrupt)
    try:
        with pytest.raises(signals.Interrupted):
            with local.local_store(30):
                pytest.fail("the body ran: the signal was lost")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen["deferred"] and signals.pending() is None


def test_interrupted_record_reads_as_interrupted(tmp_path):
    """A job whose process died without a word (SIGKILL) leaves its `running` record: status says
    interrupted, and the campaign runs it again."""
    job = tmp_path / "0_deepspeed"
    job.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket

    records.write_json(str(job / "record.json"), {"status": "running", "job_dir": str(job), "pid": dead.pid,
                                                 "host": socket.gethostname(), "started_at": time.time() - 5,
                                                 "config": {"framework": {"name": "deepspeed", "zero_stage": 1}}})
    st = status.table(str(tmp_path))
    assert list(st.status) == ["interrupted"] and "is gone" in st.error[0]


def test_a_job_running_now_is_not_started_twice(tmp_path):
    import socket

    p = _predict_sweep(tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    path = tmp_path / "0_megatron" / "record.json"
    rec = records.read(str(path))
    records.write_json(str(path), {**rec, "status": "running", "pid": os.getpid(), "host": socket.gethostname()})
    p = _predict_sweep(tmp_path)
    assert p.returncode == 2 and f"job #0 ({tmp_path / '0_megatron'}) is running now (pid {os.getpid()})" in p.stderr
    assert records.read(str(path))["status"] == "running"  # untouched


def test_a_second_sweep_into_a_busy_sweep_dir_is_refused_before_anything(tmp_path):
    """Two sweeps into one hydra.sweep.dir at once: the second exits 2 naming the holder and writes no
    job; once the first ends (its lock released with it), the dir is free."""
    from launchers.campaign import sweep_lock

    sweep = tmp_path / "s"
    with sweep_lock(str(sweep)):
        p = launch("-m", "mode=predict", "model.layers=2,3", "wandb.mode=disabled", f"hydra.sweep.dir={sweep}")
        assert p.returncode == 2 and f"{sweep} is in use by another sweep (pid {os.getpid()}" in p.stderr, p.stderr
        assert not list(sweep.glob("*/record.json"))
    p = launch("-m", "mode=predict", "model.layers=2,3", "wandb.mode=disabled", f"hydra.sweep.dir={sweep}")
    assert p.returncode == 0 and len(list(sweep.glob("*/record.json"))) == 2, p.stderr[-2000:]


@pytest.mark.parametrize("text,why", [("{}", "no 'status'"), ('{"status": "ok", "job_dir": "x", "config": 5}',
                                                             "'config' is a int"),
                                      ('{"status": "ok", "job_dir": 5, "config": {}}', "'job_dir' is a int")])
def test_a_record_of_the_wrong_shape_is_unreadable_and_the_rest_is_read(tmp_path, text, why):
    """A record.json that parses but is not a record ({} or mistyped keys) is `unreadable`, named; the
    analysis reads the rest and exits 0 (records/__init__.py _shape_error)."""
    p = launch("-m", "mode=predict", "framework=megatron,titan", "wandb.mode=disabled",
               f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    bad = tmp_path / "0_megatron" / "record.json"
    bad.write_text(text)
    env = dict(os.environ, PYTHONPATH=REPO_PATH)
    for mod in ("analysis.reconcile", "analysis.report", "analysis.status"):
        r = subprocess.run([sys.executable, "-m", mod, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (mod, r.stderr[-2000:])
        assert f"warning: {bad}: unreadable record ({why})" in r.stderr, (mod, r.stderr)


def test_a_folder_of_sweeps_keeps_their_jobs_apart(tmp_path):
    """reconcile over a folder holding two sweeps whose jobs share subdir names: each job its own row,
    named by its folder under the one given."""
    import records as R

    for name, layers in (("a", 2), ("b", 3)):
        p = launch("-m", "mode=predict", "framework=megatron,titan", f"model.layers={layers}", "wandb.mode=disabled",
                   f"hydra.sweep.dir={tmp_path / name}", timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    recs = R.load(str(tmp_path))
    assert sorted(R.job_name(r) for r in recs) == ["a/0_megatron", "a/1_titan", "b/0_megatron", "b/1_titan"]
    assert {R.job_name(r): r["config"]["model"]["layers"] for r in recs}["b/1_titan"] == 3
    assert [R.job_name(r) for r in R.load(str(tmp_path / "a"))] == ["0_megatron", "1_titan"]


def test_the_manifest_reads_back_what_was_written(tmp_path):
    """campaign.json is not a record: read back whole (a resume and the Slurm job ids rely on it)."""
    from launchers.campaign import update_manifest

    update_manifest(str(tmp_path), {"0": {"job_dir": "x", "slurm_job_id": "17"}})
    update_manifest(str(tmp_path), {"1": {"job_dir": "y"}})
    assert records.read_manifest(str(tmp_path))["jobs"] == {"0": {"job_dir": "x", "slurm_job_id": "17"},
                                                            "1": {"job_dir": "y"}}


def test_a_single_run_into_a_job_dir_in_use_exits_2(tmp_path):
    """`launch.py hydra.run.dir=D` while D's record says running by a live process on this host: exit 2
    naming it, the record untouched; a dead process's leaves the dir free."""
    import socket
    import subprocess
    import sys

    from tests.conftest import launch

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = {"status": "running", "job_dir": str(tmp_path), "pid": holder.pid, "host": socket.gethostname()}
        records.write_json(str(tmp_path / "record.json"), running)
        p = launch("mode=predict", f"hydra.run.dir={tmp_path}", timeout=120)
        assert p.returncode == 2 and f"is running now (pid {holder.pid})" in p.stderr, p.stderr[-2000:]
        assert records.read(str(tmp_path / "record.json")) == running
    finally:
        holder.kill()
        holder.wait()
    p = launch("mode=predict", f"hydra.run.dir={tmp_path}", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
