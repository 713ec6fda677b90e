"""The Slurm launcher is sized from the cluster config before anything is submitted (no Slurm needed)."""
import os

from hydra import compose, initialize_config_dir

from conf.schema import register
from launchers.slurm import SlurmSetup
from tests.conftest import REPO

register()


def _launcher(*overrides):
    with initialize_config_dir(config_dir=f"{REPO}/conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=submitit_slurm", *overrides],
                      return_hydra_config=True)
    SlurmSetup().on_multirun_start(cfg)
    return cfg.hydra.launcher


def test_gpu_example_sizes_sbatch_from_cluster():
    hl = _launcher("cluster=slurm_gpu_example")
    assert hl._target_ == "hydra_plugins.train_ledger.launcher.ValidatingSlurmLauncher"
    assert (hl.nodes, hl.tasks_per_node, hl.gpus_per_node, hl.cpus_per_task) == (2, 8, 8, 12)
    assert (hl.partition, hl.account, hl.qos, hl.constraint, hl.timeout_min) == ("gpu", "my-account", "normal",
                                                                                 "h100", 60)
    assert hl.additional_parameters == {"exclusive": True}
    assert hl.setup[0] == "module load cuda/12.8"


def test_cluster_overrides_reach_sbatch():
    hl = _launcher("cluster=local_slurm", "cluster.ranks=4", "cluster.time_min=3")
    assert (hl.tasks_per_node, hl.timeout_min) == (4, 3)
    assert os.environ["SLURM_CONF"] == os.path.join(REPO, ".slurm/etc/slurm.conf")


def test_basic_launcher_becomes_the_campaign_one():
    """Local sweeps keep Hydra's basic launcher, wrapped to resume campaigns (launchers/campaign.py)."""
    with initialize_config_dir(config_dir=f"{REPO}/conf", version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
    assert cfg.hydra.launcher._target_ == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    SlurmSetup().on_multirun_start(cfg)
    assert cfg.hydra.launcher._target_ == "hydra_plugins.train_ledger.launcher.CampaignBasicLauncher"
    assert "nodes" not in cfg.hydra.launcher
