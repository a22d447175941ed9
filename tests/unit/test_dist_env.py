"""Rank/world/rendezvous discovery from torchrun and Slurm variables, and node-list expansion."""

import socket

import pytest

from megatron_rl.parallel import dist
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
    assert env.master_port == 20000 + 4242
    assert env.source == "slurm"


def test_the_slurm_port_is_outside_the_ephemeral_range_for_every_job_id():
    """The port was 30500 + id % 20000, inside Linux's default ephemeral range (32768-60999) for ~89% of job
    ids: an outgoing connection of any process on rank 0's node could hold it when the store binds it (the
    EADDRINUSE that `free_port` avoids). Ranks compute it alone, so it must not depend on the node either."""
    lo = 32768  # Linux default: net.ipv4.ip_local_port_range = 32768 60999
    ports = {dist._slurm_port({"SLURM_JOB_ID": str(job_id)}) for job_id in range(0, 200000, 7)}
    assert all(10000 <= port < lo and not 30000 <= port < 31000 for port in ports), (min(ports), max(ports))
    assert len(ports) > 9000  # jobs sharing a node still get different ports
    assert dist._slurm_port({"SLURM_JOB_ID": "7", "MASTER_PORT": "40000"}) == 40000


def test_torchrun_variables_win_over_slurm():
    env = dist_env_from({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert env.source == "torchrun" and env.rank == 0


def test_single_process_without_variables():
    env = dist_env_from({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")
    assert env.master_port > 0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_free_port_avoids_the_ephemeral_range(tmp_path, monkeypatch):
    """Outgoing connections take local ports from the ephemeral range, so a rendezvous port drawn
    there can be lost before the store binds it; free_port draws outside it."""
    lo, hi = 20000, 60000
    (tmp_path / "range").write_text(f"{lo}\t{hi}\n")
    monkeypatch.setattr(dist, "_EPHEMERAL_RANGE_FILE", str(tmp_path / "range"))
    ports = {dist.free_port() for _ in range(50)}
    assert all(not lo <= p <= hi and 10000 <= p <= 65535 for p in ports)
    assert len(ports) > 40  # drawn at random, not one fixed port
    assert all(_bindable(p) for p in ports)


def test_free_port_never_returns_a_taken_port(tmp_path, monkeypatch):
    (tmp_path / "range").write_text("10000 15000\n")  # ports 15001-65535 are drawn from
    monkeypatch.setattr(dist, "_EPHEMERAL_RANGE_FILE", str(tmp_path / "range"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = []
        monkeypatch.setattr(dist.random.SystemRandom, "randint", lambda self, a, b: draws.append(a) or taken)
        port = dist.free_port()  # every draw hits the taken port: the kernel's pick is used
        assert port != taken and _bindable(port) and len(draws) == 64


def test_free_port_falls_back_to_the_kernel_when_everything_is_ephemeral(tmp_path, monkeypatch):
    (tmp_path / "range").write_text("10500 65535\n")  # leaves 10000-10499: too few to draw from
    monkeypatch.setattr(dist, "_EPHEMERAL_RANGE_FILE", str(tmp_path / "range"))
    monkeypatch.setattr(dist.random.SystemRandom, "randint", lambda self, a, b: pytest.fail("drew a port"))
    assert _bindable(dist.free_port())


def test_generators_take_the_gpus_after_the_trainer_ranks_and_never_share_one():
    """Generator i's engine spans rollout.tp GPUs from num_local_trainer_ranks + i * tp; a node without
    enough GPUs is refused (a generator on a trainer rank's GPU breaks the NCCL weight group)."""
    from megatron_rl.parallel.dist import generator_gpu

    assert [generator_gpu(i, 4, 1, 8) for i in range(4)] == [4, 5, 6, 7]
    assert [generator_gpu(i, 4, 2, 8) for i in range(2)] == [4, 6]
    with pytest.raises(RuntimeError, match=r"generator 2 needs GPUs 8..9 .*this node has 8.*generator_nodes"):
        generator_gpu(2, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"generator 0 needs GPUs 1..1"):
        generator_gpu(0, 1, 1, 1)  # one GPU, held by the trainer


def test_the_launcher_path_never_loads_torch(tmp_path):
    """A bad config, and everything the local and Slurm launchers do before starting ranks (compose and
    validate configs of several kinds, read the rank variables, pick a port), run without importing torch
    (~2 s of CPU a process)."""
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import sys\n"
             "from megatron_rl import runtime, slurm_job, train\n"
             "from megatron_rl.parallel.dist import dist_env_from, free_port\n"
             "for overrides in (['cluster.nproc=2', 'parallel.tp=2'], ['mode=sft'],\n"
             "                  ['+experiment=demo_agent_countdown'], ['rollout.mode=disaggregated', 'task=arithmetic'],\n"
             "                  ['model=tiny_qwen3_moe', 'algorithm.routing_replay=rollout']):\n"
             "    runtime.load_validated(overrides, runtime._world_size_for)\n"
             "assert dist_env_from({}).source == 'single' and free_port() > 0\n"
             "try:\n"
             "    train.main(['optimizer.lr=-1'])\n"
             "except SystemExit as exc:\n"
             "    assert exc.code == 2, exc.code\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "config error: optimizer.lr=-1" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
