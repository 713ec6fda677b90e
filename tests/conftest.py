import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def launch(*args: str, timeout: int = 1800, check: bool = False) -> subprocess.CompletedProcess:
    """Run launch.py as a user would; returns the completed process (stdout+stderr captured)."""
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"launch.py {' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


@pytest.fixture
def run_launch():
    return launch
