"""scripts/gpu_kit.sh's kit and scripts/gpu_check.sh's way of running on a GPU machine that has a Python
with torch and nothing of ours: built here, it fits what a run may carry, and a titan job of the check
runs ok through gpu_check.sh on the CPU with a stand-in for that machine's Python (a venv holding torch
and its own dependencies alone, no numpy: gpu_kit.sh --device-python) in a copy of the repository's
tree as the machine gets it (tracked and untracked files git does not ignore: no .venv, no outputs/)."""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

VENV_PY = os.path.join(REPO, ".venv", "bin", "python")
MIB = 1 << 20
KIT_LIMIT = 50 * MIB    # the kit
CARRY_LIMIT = 64 * MIB  # what a device run may carry: the kit and the repository's tree

needs_venv = pytest.mark.skipif(not os.path.exists(VENV_PY), reason="gpu_kit.sh copies from .venv")


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if not os.path.islink(os.path.join(d, f)))


def _bare_env(**kw) -> dict:
    """The GPU machine's environment as far as it matters: none of this session's Python settings."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **kw}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """(repo copy with its kit at gpu_kit/, the stand-in device Python, the kit's build output)."""
    root = tmp_path_factory.mktemp("gpu_kit")
    repo = root / "repo"
    repo.mkdir()
    copied = subprocess.run(f"git ls-files -co --exclude-standard -z | tar cf - --ignore-failed-read --null -T - | tar xf - -C '{repo}'",
                            shell=True, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert copied.returncode == 0 and os.path.exists(repo / "launch.py"), copied.stderr
    built = subprocess.run(["bash", "scripts/gpu_kit.sh", str(repo / "gpu_kit")], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    py = subprocess.run(["bash", "scripts/gpu_kit.sh", "--device-python", str(root / "devpy")], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert py.returncode == 0, py.stderr[-3000:]
    return repo, str(root / "devpy" / "bin" / "python"), built.stdout


@needs_venv
def test_kit_fits_what_a_run_carries(device):
    repo, _, out = device
    kit = repo / "gpu_kit"
    assert sorted(os.listdir(kit)) == ["MANIFEST", "kit.env", "site.tar.gz", "site_stubs"], out
    assert _size(kit) < KIT_LIMIT, (_size(kit) / MIB, out)
    assert _size(repo) < CARRY_LIMIT, _size(repo) / MIB  # the tree and the kit together
    env = dict(line.split("=", 1) for line in (kit / "kit.env").read_text().split())
    assert env["KIT_PYTHON"] == "%d.%d" % sys.version_info[:2] and env["KIT_NEEDS_PYTHON"] == env["KIT_PYTHON"]
    manifest = (kit / "MANIFEST").read_text()
    for dist in ("megatron-core 0.18.0", "deepspeed 0.19.8", "torchtitan 0.3.0", "numpy "):
        assert f"\n{dist}" in manifest, dist
    assert "\nstub pandas\n" in manifest and "\nstub datasets\n" in manifest


@needs_venv
def test_the_stand_in_device_has_torch_alone(device):
    _, py, _ = device
    p = subprocess.run([py, "-c", "import torch, importlib.util as u; "
                        "print([m for m in ('numpy', 'hydra', 'megatron', 'pandas') if u.find_spec(m)])"],
                       env=_bare_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr[-2000:]


@needs_venv
@pytest.mark.real
def test_a_titan_job_runs_through_gpu_check_with_the_kit(device, tmp_path):
    repo, py, _ = device
    out = tmp_path / "gpu_check"
    p = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=repo, capture_output=True, text=True,
                       timeout=600, env=_bare_env(PYTHON=py, GPU_CHECK_DEVICE="cpu", GPU_CHECK_JOBS="titan"))
    log = p.stdout + p.stderr[-3000:]
    assert p.returncode == 0, log
    assert "kit: " in p.stdout and "titan: exit 0" in p.stdout, log
    assert "megatron:" not in p.stdout, log  # GPU_CHECK_JOBS: that job alone
    with open(out / "titan" / "record.json") as f:
        rec = json.load(f)
    assert rec["status"] == "ok", (rec.get("error"), glob.glob(str(out / "titan" / "*")))
    (rank,) = rec["measurement"]["ranks"]
    assert len(rank["steps"]) == 3 and all(math.isfinite(s["loss"]) for s in rank["steps"]), rank["steps"]
    # the frameworks came from the kit (the stand-in Python has torch alone; wandb: not carried)
    assert rec["versions"]["torchtitan"] == "0.3.0" and rec["versions"]["wandb"] is None, rec["versions"]


def test_another_python_is_refused_before_any_job(tmp_path):
    kit = tmp_path / "kit"
    (kit / "site_stubs").mkdir(parents=True)
    (kit / "site.tar.gz").write_bytes(b"")
    (kit / "kit.env").write_text("KIT_PYTHON=3.99\nKIT_MACHINE=x86_64\nKIT_NEEDS_PYTHON=3.99\n")
    p = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env=_bare_env(PYTHON=sys.executable, KIT=str(kit)))
    assert p.returncode == 3, p.stdout + p.stderr
    assert "refused" in p.stderr and "3.99" in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "out" / "megatron.log")


def _shim():
    spec = importlib.util.spec_from_file_location("gpu_stub_datasets",
                                                  os.path.join(REPO, "scripts", "gpu_stubs", "datasets", "__init__.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(REPO, "scripts", "gpu_stubs"))  # its _gpu_stub
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(os.path.join(REPO, "scripts", "gpu_stubs"))
    return mod


def test_the_datasets_stand_in_reads_what_datasets_reads(tmp_path):
    """The kit's datasets (scripts/gpu_stubs/datasets) gives torchtitan's text loader the rows in the
    order the real package does: as loaded, skipped, re-shuffled on a re-loop, split by node."""
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    from launchers import titan_assets

    data = tmp_path / "text"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in titan_assets.generated_text(60)))
    shim = _shim()
    real, mine = datasets.load_dataset(str(data), split="train"), shim.load_dataset(str(data), split="train")

    def rows(d):
        return [r["text"] for r in d]

    assert rows(real) == rows(mine) and len(mine) == 60
    assert rows(real.skip(17)) == rows(mine.skip(17))
    for seed in (43, 44):  # torchtitan: shuffle(seed=42 + epoch) on a re-loop
        assert rows(real.shuffle(seed=seed)) == rows(mine.shuffle(seed=seed))
    for world in (1, 4, 7):
        for rank in range(world):
            assert rows(split_dataset_by_node(real, rank, world)) == rows(mine.shard(world, rank))
    with pytest.raises(ImportError, match="stand-in"):
        shim.load_dataset("allenai/c4", name="en", split="train", streaming=True)


def test_a_stub_raises_naming_itself_when_used():
    sys.path.insert(0, os.path.join(REPO, "scripts", "gpu_stubs"))
    try:
        import _gpu_stub

        spec = importlib.util.spec_from_file_location("pandas_stub_under_test",
                                                      os.path.join(REPO, "scripts", "gpu_stubs", "pandas", "__init__.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(os.path.join(REPO, "scripts", "gpu_stubs"))
        sys.modules.pop("pandas_stub_under_test", None)
    DataFrame = mod.DataFrame  # a from-import at import time succeeds
    assert _gpu_stub.ACCESSES["pandas_stub_under_test.DataFrame"] == 1
    with pytest.raises(ImportError, match="pandas_stub_under_test is a stub"):
        DataFrame({"a": [1]})
    with pytest.raises(ImportError, match="read_csv.columns"):
        mod.read_csv.columns
    assert _gpu_stub.USES["pandas_stub_under_test.DataFrame()"] == 1
