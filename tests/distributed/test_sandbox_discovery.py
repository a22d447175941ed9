"""Every rank of a job finds the sandbox server rank 0 starts, whatever the order they look in.

The case that hung a CI run: rank 1 looked only after rank 0's server had registered, so it
skipped the barrier rank 0 was waiting in and went on to the next collective (a different one):
both ranks then waited until gloo's timeout. Here rank 1 looks only after registration on
purpose, and the next collective must complete. The server is a real one (process runtime:
only discovery matters here, nothing is executed).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace

from tests.distributed.launcher import run_spawned


def _worker(rank: int, world_size: int, run_dir: str) -> None:
    import time

    import torch.distributed as dist

    from megatron_rl import runtime
    from megatron_rl.config.schema import SandboxConfig
    from megatron_rl.rewards.service import stop_local_sandbox
    from megatron_rl_sandbox.client import discover

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    rt = SimpleNamespace(cfg=SimpleNamespace(sandbox=SandboxConfig(runtime="process", allow_unisolated=True)),
                         run_dir=Path(run_dir), is_main=rank == 0, sandbox_proc=None)
    if rank == 1:
        deadline = time.monotonic() + 60
        while not discover(rt.run_dir):  # rank 0's server is registered before this rank looks
            assert time.monotonic() < deadline, "rank 0 never registered a sandbox server"
            time.sleep(0.1)
    try:
        addresses = runtime.sandbox_addresses(rt)
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, addresses)  # the next collective: must not meet a barrier
        assert everyone == [addresses] * world_size and len(addresses) == 1, everyone
        assert (rt.sandbox_proc is not None) == (rank == 0)
        dist.barrier()
    finally:
        stop_local_sandbox(rt.sandbox_proc)
        dist.destroy_process_group()


def test_a_rank_that_looks_after_registration_still_meets_the_others(tmp_path):
    (tmp_path / "run" / "logs").mkdir(parents=True)  # the run directory as runtime.start leaves it
    run_spawned(_worker, 2, str(tmp_path / "run"), timeout_s=120)


_STARTER = """
import sys, time
from pathlib import Path
from megatron_rl.rewards.service import start_local_sandbox
proc, address = start_local_sandbox(Path(sys.argv[1]), "process", True)
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_a_run_killed_leaves_no_server_and_a_dead_servers_file_is_pruned(tmp_path):
    """The local server serves on through SIGTERM, dies with the process that started it (SIGKILLed: no
    cleanup ran) and removes its discovery file; a file naming a server that no longer answers is pruned
    before discovery, so a run started again in the same directory starts its own server instead of
    leaving every sample unscored."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from megatron_rl_sandbox.client import discover, prune_unreachable

    (tmp_path / "logs").mkdir()
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    server_pid = int(starter.stdout.readline())
    os.kill(server_pid, signal.SIGTERM)  # Slurm's end-of-job signal: the server serves on, its job stops it
    time.sleep(0.5)
    live = discover(tmp_path)
    assert len(live) == 1 and prune_unreachable(tmp_path, timeout_s=30) == []  # a live server's file stays
    assert _ran(live, "echo", "still serving") == "still serving\n"
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 60
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(server_pid) and discover(tmp_path) == []
    stale = tmp_path / "sandbox" / "gone-1.json"  # as a SIGKILLed server leaves it
    stale.write_text(json.dumps({"name": "gone-1", "address": live[0], "pid": server_pid}))
    assert prune_unreachable(tmp_path, timeout_s=1.0) == live and not stale.exists()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (its parent, killed, no longer reaps it)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _ran(addresses: list[str], *argv: str) -> str:
    """The stdout of `argv` run by the sandbox servers at `addresses`."""
    import asyncio

    from megatron_rl_sandbox.client import SandboxClient

    async def go():
        async with SandboxClient(addresses, deadline_s=30) as client:
            return (await client.execute(list(argv))).stdout.decode()
    return asyncio.run(go())


def test_the_slurm_sandbox_step_serves_through_sigterm_until_training_ends(tmp_path):
    """`python -m megatron_rl.slurm_job sandbox` (one per node of the job's sandbox step): Slurm's SIGTERM at
    the job's end reaches it and its server while the ranks finish their last step, whose rewards still need
    them; both serve on, and the batch step's STOP file (written when training ended) drains and stops them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from megatron_rl.slurm_job import STOP_FILE
    from megatron_rl_sandbox.client import discover

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.slurm_job", "sandbox", "--run-dir", str(run_dir),
                             "--runtime", "process", "--allow-unisolated", "--capacity", "1", "--poll-s", "0.2"],
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (found := discover(run_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, "the sandbox step registered no server"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # as slurmstepd signals every process of the step
        time.sleep(1.0)
        assert proc.poll() is None
        assert _ran(found, "echo", "rewards for the last step") == "rewards for the last step\n"
        (run_dir / "sandbox" / STOP_FILE).touch()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert discover(run_dir) == []  # drained: the server removed its discovery file
    logs = {path.name: path.read_text() for path in (run_dir / "logs").glob("sandbox-*.log")}
    step_log = next(text for name, text in logs.items() if not name.startswith("sandbox-server-"))
    server_log = next(text for name, text in logs.items() if name.startswith("sandbox-server-"))
    assert "got SIGTERM: serving on until training ends" in step_log
    assert "got SIGTERM: serving on (--ignore-sigterm" in server_log
