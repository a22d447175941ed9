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
    """The local server dies with the process that started it (SIGKILLed: no cleanup ran) and removes
    its discovery file; a file naming a server that no longer answers is pruned before discovery, so a
    run started again in the same directory starts its own server instead of scoring everything 0."""
    import json
    import os
    import subprocess
    import sys
    import time

    from megatron_rl_sandbox.client import discover, prune_unreachable

    (tmp_path / "logs").mkdir()
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    server_pid = int(starter.stdout.readline())
    live = discover(tmp_path)
    assert len(live) == 1 and prune_unreachable(tmp_path, timeout_s=30) == []  # a live server's file stays
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
