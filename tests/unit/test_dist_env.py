"""Rank/world/rendezvous discovery from torchrun and Slurm variables, and node-list expansion."""

import pytest

from megatron_rl.parallel.dist import dist_env_from, expand_nodelist


@pytest.mark.parametrize("nodelist, expected", [
    ("node1", ["node1"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("gpu[08-10],cpu1", ["gpu08", "gpu09", "gpu10", "cpu1"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("c[9-11]", ["c9", "c10", "c11"]),
])
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


def test_expand_nodelist_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse"):
        expand_nodelist("gpu[01-02")


def test_torchrun_variables():
    env = dist_env_from({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                         "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("10.0.0.5", 1234, "torchrun")


def test_slurm_variables_use_first_node_of_the_step():
    env = dist_env_from({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                         "SLURM_STEP_NODELIST": "gpu[03-06]", "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
                         "SLURM_JOB_ID": "4242"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 2)
    assert env.master_addr == "gpu03"
    assert env.master_port == 29500 + 1000 + 4242
    assert env.source == "slurm"


def test_torchrun_variables_win_over_slurm():
    env = dist_env_from({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert env.source == "torchrun" and env.rank == 0


def test_single_process_without_variables():
    env = dist_env_from({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")
    assert env.master_port > 0
