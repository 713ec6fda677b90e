"""mode=dry's artifacts start the layout's world on the cluster the config names (launchers/gpu_scripts.py):
nodes x GPUs per node = tp*pp*cp*dp in every launcher line, a hostfile for DeepSpeed across nodes, an
sbatch script on a Slurm cluster; no absolute path of the machine that wrote them. The scripts are run
with stub launchers (torchrun, deepspeed, srun, scontrol print what they were handed) from another
folder, as a user on the cluster would."""
from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from omegaconf import open_dict

from launchers import gpu_scripts
from launchers.job import check
from launchers.local import REPO
from ledger.layout import ConfigError
from tests.conftest import compose_config

# framework -> its launcher module and the script that starts the ranks
SCRIPT = {"megatron": "run.sh", "deepspeed": "run.sh", "titan": "run_train.sh"}
# (name, overrides, nodes, GPUs per node): one node of a GPU box, whole nodes of a Slurm cluster, a
# CPU cluster's dry (8 GPUs per node when it names none), a world smaller than one node
CASES = [
    ("one_node", ["cluster=local_gpu", "layout.dp=8"], 1, 8),
    ("slurm_4x8", ["cluster=slurm_gpu_example", "layout.dp=32"], 4, 8),
    ("cpu_cluster_2x8", ["layout.dp=16"], 2, 8),
    ("part_of_a_node", ["cluster=slurm_gpu_example", "layout.dp=4"], 1, 4),
]
# the model-parallel split each framework drives (DeepSpeed: data parallel only): dp over the same world
MODEL_PARALLEL = {"megatron": ["layout.tp=2"], "titan": ["layout.tp=2"], "deepspeed": ["framework.zero_stage=3"]}


def _dry(framework: str, overrides: list[str], job_dir: str) -> tuple[list[str], object]:
    over = [f"framework={framework}", "mode=dry", "model=llama3_8b", *overrides]
    if framework != "deepspeed":  # the same world, split tp2 x dp/2
        dp = next(o for o in overrides if o.startswith("layout.dp="))
        over = [o for o in over if o != dp] + [f"layout.dp={int(dp.split('=')[1]) // 2}"]
    over += MODEL_PARALLEL[framework]
    cfg = compose_config(*over)
    _, lay, _ = check(cfg)
    os.makedirs(job_dir, exist_ok=True)
    mod = __import__(f"launchers.{framework}", fromlist=["dry"])
    return mod.dry(cfg, lay, job_dir), lay


STUB = {  # each prints its argv (NUL-separated), and what it ran with, into $STUB_OUT (the folder _run ran from)
    "torchrun": 'printf "%s\\0" "$@" > "$STUB_OUT/torchrun.argv"; echo "$PWD" > "$STUB_OUT/torchrun.cwd"; '
                'echo "$PYTHONPATH" > "$STUB_OUT/torchrun.pythonpath"',
    "deepspeed": 'printf "%s\\0" "$@" > "$STUB_OUT/deepspeed.argv"; echo "$PYTHONPATH" > "$STUB_OUT/deepspeed.pythonpath"',
    # srun: drop its options, run the rest (the batch step's command on one node)
    "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; "$@"',
    "scontrol": 'printf "gpu-a01\\ngpu-a02\\ngpu-a03\\ngpu-a04\\n"',
}


def _run(script: str, cwd, env_extra: dict | None = None) -> None:
    stubs = cwd / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, body in STUB.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(cwd), "STUB_OUT": str(cwd), **(env_extra or {})}
    p = subprocess.run(["bash", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def _argv(path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "titan"])
def test_the_launcher_starts_the_layouts_world(framework, case, tmp_path):
    _, overrides, nodes, per_node = case
    job = tmp_path / "job"
    paths, lay = _dry(framework, overrides, str(job))
    assert lay.world == nodes * per_node == lay.tp * lay.pp * lay.cp * lay.dp
    elsewhere = tmp_path / "elsewhere"  # run as written, from another folder
    elsewhere.mkdir()
    _run(str(job / SCRIPT[framework]), elsewhere, {"TRAIN_LEDGER": "/opt/train-ledger"})
    if framework == "deepspeed":
        argv = _argv(elsewhere / "deepspeed.argv")
        assert (int(_flag(argv, "--num_nodes")), int(_flag(argv, "--num_gpus"))) == (nodes, per_node)
        assert _flag(argv, "--deepspeed_config") == str(job / "ds_config.json")  # found beside the script
        assert (elsewhere / "deepspeed.pythonpath").read_text().strip() == "/opt/train-ledger"
        if nodes > 1:  # DeepSpeed's hostfile: one line per node, the GPUs per node as its slots
            hostfile = _flag(argv, "--hostfile")
            assert hostfile == str(job / "hostfile")
            lines = open(hostfile).read().split("\n")[:-1]
            assert [ln.split()[1] for ln in lines] == [f"slots={per_node}"] * nodes
            assert _flag(argv, "--master_addr") == lines[0].split()[0]
        else:
            assert "--hostfile" not in argv
    else:
        argv = _argv(elsewhere / "torchrun.argv")
        assert (int(_flag(argv, "--nnodes")), int(_flag(argv, "--nproc_per_node"))) == (nodes, per_node)
        assert _flag(argv, "--rdzv_backend") == "c10d"
        if framework == "megatron":
            assert int(_flag(argv, "--tensor-model-parallel-size")) * lay.dp * lay.pp * lay.cp == lay.world
            assert _flag(argv, "--tensorboard-dir") == str(job / "tb")
        else:
            assert argv[argv.index("-m") + 1:argv.index("-m") + 6] == [
                "torchtitan.train", "--module", "ledger_titan", "--config", "ledger_config"]
    # an sbatch script exactly where the cluster is Slurm's
    assert (job / "sbatch.sh").exists() == ("slurm_gpu_example" in " ".join(overrides))


@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "titan"])
def test_sbatch_asks_for_the_nodes_and_starts_every_one(framework, tmp_path):
    job = tmp_path / "job"
    _dry(framework, ["cluster=slurm_gpu_example", "layout.dp=32"], str(job))
    text = (job / "sbatch.sh").read_text()
    directives = dict(ln[len("#SBATCH --"):].partition("=")[::2] for ln in text.splitlines() if ln.startswith("#SBATCH"))
    assert (directives["nodes"], directives["gpus-per-node"], directives["ntasks-per-node"]) == ("4", "8", "1")
    assert directives["cpus-per-task"] == str(12 * 8)  # the example's 12 CPUs per rank, 8 ranks per task
    assert directives["mem"] == "0" and directives["partition"] == "gpu" and "exclusive" in directives
    # sbatch runs a copy of the script: it finds the job's files from the submit folder
    _run(str(job / "sbatch.sh"), job, {"SLURM_SUBMIT_DIR": str(job), "SLURM_JOB_NODELIST": "gpu-a[01-04]",
                                        "SLURM_JOB_ID": "77", "TRAIN_LEDGER": "/opt/train-ledger"})
    if framework == "deepspeed":  # the job's nodes became the hostfile, 8 slots each
        argv = _argv(job / "deepspeed.argv")
        assert _flag(argv, "--hostfile") == str(job / "hostfile.slurm")
        assert (job / "hostfile.slurm").read_text() == "".join(f"gpu-a0{i} slots=8\n" for i in range(1, 5))
        assert _flag(argv, "--master_addr") == "gpu-a01"
    else:
        argv = _argv(job / "torchrun.argv")
        assert (_flag(argv, "--nnodes"), _flag(argv, "--rdzv_id")) == ("4", "77")
        assert _flag(argv, "--rdzv_endpoint") == "gpu-a01:29500"


@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "titan"])
def test_no_artifact_holds_a_path_of_the_machine_that_wrote_it(framework, tmp_path):
    job = tmp_path / "job"
    paths, _ = _dry(framework, ["cluster=slurm_gpu_example", "layout.dp=32"], str(job))
    for p in paths:
        text = open(p).read()
        for local in (str(tmp_path), REPO, os.path.expanduser("~")):
            assert local not in text, (p, local)


def test_a_world_that_does_not_fill_whole_nodes_is_refused_naming_the_fields():
    cfg = compose_config("framework=titan", "mode=dry", "cluster=slurm_gpu_example", "layout.tp=2", "layout.dp=6")
    with pytest.raises(ConfigError, match=r"layout world 12 .*cluster\.gpus_per_node.*multiple of 8"):
        check(cfg)


@pytest.mark.parametrize("field,value", [("partition", "gpu\nrm -rf x"), ("account", "a b"), ("constraint", "h100;id")])
def test_an_sbatch_value_that_would_break_its_line_is_refused(field, value):
    cfg = compose_config("framework=megatron", "mode=dry", "cluster=slurm_gpu_example", "layout.dp=8")
    with open_dict(cfg):
        cfg.cluster[field] = value
    with pytest.raises(ConfigError, match=rf"cluster\.{field}="):
        check(cfg)


def test_topology_rule():
    """One node holds a world up to its GPUs; beyond, whole nodes."""
    cluster = {"gpus_per_node": 8, "device": "cuda", "ranks": 8}
    assert gpu_scripts.topology(cluster, 1) == gpu_scripts.Topology(1, 1)
    assert gpu_scripts.topology(cluster, 8) == gpu_scripts.Topology(1, 8)
    assert gpu_scripts.topology(cluster, 1024) == gpu_scripts.Topology(128, 8)
    assert gpu_scripts.topology({"device": "cuda", "ranks": 4}, 16) == gpu_scripts.Topology(4, 4)
    assert gpu_scripts.topology({"device": "cpu", "ranks": 2}, 16) == gpu_scripts.Topology(2, 8)
    with pytest.raises(ConfigError):
        gpu_scripts.topology(cluster, 12)
    assert shlex.split(gpu_scripts.torchrun_line(gpu_scripts.Topology(2, 8)))[:5] == [
        "torchrun", "--nnodes", "2", "--nproc_per_node", "8"]


def test_titan_runs_from_its_folder_whatever_its_name(tmp_path):
    """torchtitan's module is found from its own folder ("." on PYTHONPATH after cd), so a folder name
    with ':' (PYTHONPATH's separator) or a space still works."""
    job = tmp_path / "a:b c"
    _dry("titan", ["cluster=local_gpu", "layout.dp=8"], str(job))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run(str(job / "run_train.sh"), elsewhere)
    assert (elsewhere / "torchrun.cwd").read_text().strip() == str(job)
    assert (elsewhere / "torchrun.pythonpath").read_text().strip() == "."

