"""A real single-host Slurm cluster for this package's tests, started once per session.

`setup.sh` (slurmctld + two slurmd as nodes c1/c2 with 2 fake GPUs each, partitions gpu/cpu/debug)
runs as root and installs Debian's Slurm when missing; `teardown.sh` stops it at the end. Without
root, apt or a working cluster the tests are skipped with the reason; MEGATRON_RL_SKIP_SLURM=1
skips them on purpose.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """Environment for sbatch/squeue/scontrol against the test cluster (SLURM_CONF set)."""
    if os.environ.get("MEGATRON_RL_SKIP_SLURM") == "1":
        pytest.skip("MEGATRON_RL_SKIP_SLURM=1")
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root (slurmctld/slurmd run as root here)")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and apt-get is missing (apt-get install slurmctld slurmd slurm-client)")
    # one cluster per test run (its own state directory and free ports: setup.sh), so that two runs on one
    # machine, or a developer's own test cluster, do not collide
    lab = Path(os.environ.get("MEGATRON_RL_SLURM_LAB", f"/tmp/megatron-rl-slurm-{os.getpid()}"))
    env = dict(os.environ, MEGATRON_RL_SLURM_LAB=str(lab))
    proc = subprocess.run(["bash", str(HERE / "setup.sh")], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        subprocess.run(["bash", str(HERE / "teardown.sh")], env=env, timeout=60)
        pytest.skip(f"could not start the Slurm test cluster: {(proc.stderr or proc.stdout)[-1500:]}")
    env["SLURM_CONF"] = str(lab / "etc" / "slurm.conf")
    yield env
    subprocess.run(["bash", str(HERE / "teardown.sh")], env=env, timeout=60)
