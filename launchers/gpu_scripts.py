"""The shell around a framework's command in mode=dry: which nodes and GPUs run the layout's world,
the launcher line that starts them, and an sbatch script for a Slurm cluster.

One home for what every framework's dry artifacts share, so that a script a user carries to the
cluster starts exactly the world the ledger predicted: nodes x GPUs per node = tp*pp*cp*dp. A
launcher that starts fewer ranks than the layout has would not fail: Megatron-LM divides the world
it finds by TP*PP and trains a smaller DP than predicted, silently.

Nothing here writes an absolute path of the machine that wrote it: a script finds its own folder
at run time ("$HERE") and every file of the job beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ledger.errors import ConfigError

# GPUs per node when the cluster config names none (a CPU cluster such as local_cpu asked for GPU
# artifacts): the common 8-GPU node (DGX / HGX H100, H200, B200; p5 / a3 instances)
DEFAULT_GPUS_PER_NODE = 8

# the line every generated script starts with: its own folder, whatever the working directory
HERE_LINE = 'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"'

# rendezvous port when MASTER_PORT is not set (torchtitan's multinode_trainer.slurm uses 29500)
DEFAULT_PORT = 29500

@dataclass(frozen=True)
class Topology:
    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node} GPUs = world {self.world}"


def gpus_per_node(cluster) -> int:
    """cluster.gpus_per_node; else a GPU cluster's ranks per node; else DEFAULT_GPUS_PER_NODE."""
    if cluster.get("gpus_per_node"):
        return int(cluster.get("gpus_per_node"))
    if cluster.get("device") == "cuda":
        return int(cluster.get("ranks"))
    return DEFAULT_GPUS_PER_NODE


def topology(cluster, world: int) -> Topology:
    """The nodes that run `world` ranks on this cluster: one node when the world fits in one
    (a smaller world uses that many GPUs of it), else whole nodes. Raises ConfigError naming the
    fields when the world does not fill whole nodes (torchrun and the deepspeed launcher start the
    same number of ranks on every node)."""
    per_node = gpus_per_node(cluster)
    if world <= per_node:
        return Topology(1, world)
    if world % per_node:
        raise ConfigError(
            f"layout world {world} (tp*pp*cp*dp) is not a multiple of the GPUs per node {per_node} "
            f"(cluster.gpus_per_node, or cluster.ranks on a GPU cluster): every node runs the same number of "
            f"ranks; choose a layout whose world is a multiple of {per_node}, or at most {per_node}")
    return Topology(world // per_node, per_node)


def check(cluster, world: int) -> Topology:
    """What mode=dry refuses beyond the cluster's values (conf/validate.py validate_sbatch_values checks
    every value an #SBATCH line gets, in every mode), before anything is predicted or written."""
    return topology(cluster, world)


def torchrun_line(topo: Topology) -> str:
    """torchrun for every node of the topology, as torchtitan's multinode_trainer.slurm and
    Megatron-LM's examples start it: the same line on each node, c10d rendezvous at MASTER_ADDR
    (localhost on one node; the sbatch script exports the first node's name)."""
    return (f"torchrun --nnodes {topo.nodes} --nproc_per_node {topo.gpus_per_node} "
            '--rdzv_id "${RDZV_ID:-train-ledger}" --rdzv_backend c10d '
            f'--rdzv_endpoint "${{MASTER_ADDR:-localhost}}:${{MASTER_PORT:-{DEFAULT_PORT}}}"')


def sbatch_options(cluster, topo: Topology) -> dict:
    mem_gb = cluster.get("mem_gb")
    # cluster.cpus_per_task is per rank (mode=run starts one Slurm task per GPU); here one task per
    # node starts the node's ranks, so it asks for theirs together
    cpus = cluster.get("cpus_per_task")
    opts = {"job-name": "train-ledger", "nodes": topo.nodes, "gpus-per-node": topo.gpus_per_node,
            "cpus-per-task": None if cpus is None else int(cpus) * topo.gpus_per_node,
            "time": cluster.get("time_min"),  # minutes
            "mem": None if mem_gb is None else f"{int(mem_gb)}G" if mem_gb else "0",  # 0: all the node's memory
            "partition": cluster.get("partition"), "account": cluster.get("account"), "qos": cluster.get("qos"),
            "constraint": cluster.get("constraint")}
    for key, value in (cluster.get("additional_parameters") or {}).items():
        opts[str(key).replace("_", "-")] = "" if value is True else value
    return opts


def sbatch_script(cluster, topo: Topology, commands: list[str], title: str) -> str:
    """An sbatch script (one task per node) whose batch step, on the first node, runs `commands`
    (lines whose values the caller quoted): `srun` of a torchrun script on every node, or a
    launcher that reaches every node itself (deepspeed's, over a hostfile). The first node is
    MASTER_ADDR. cluster.setup lines are not copied: they are the site's shell, kept in the config."""
    lines = ["#!/bin/bash", title]
    for name, value in sbatch_options(cluster, topo).items():
        if value is None or value is False:
            continue
        lines.append(f"#SBATCH --{name}" if value == "" else f"#SBATCH --{name}={value}")
    lines.append("#SBATCH --ntasks-per-node=1")
    lines += ["# your site's environment (modules, the venv) goes here, before the launch",
              'HERE="${SLURM_SUBMIT_DIR:-$(pwd)}"  # sbatch runs a copy of this script: submit it from its folder',
              'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
              f'export MASTER_PORT="${{MASTER_PORT:-{DEFAULT_PORT}}}"',
              'export RDZV_ID="${SLURM_JOB_ID:-train-ledger}"',
              *commands, ""]
    return "\n".join(lines)


def sbatch_file(cluster, topo: Topology, out_dir: str, commands: list[str], what: str,
                submit: str = "sbatch sbatch.sh") -> list[str]:
    """[out_dir/sbatch.sh] (sbatch_script of `commands`, titled with `what` and how to submit it) on a
    Slurm cluster, else []."""
    if cluster.kind != "slurm":
        return []
    import os

    from launchers import shell_comment, write_script

    title = shell_comment(f"train-ledger: {what} on {topo.describe()}; submit from this folder: {submit}")
    return [write_script(os.path.join(out_dir, "sbatch.sh"), sbatch_script(cluster, topo, commands, title))]


SRUN_EACH_NODE = 'srun --ntasks-per-node=1 bash "$HERE/{script}"'
