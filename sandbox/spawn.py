"""Start a sandbox server as a child process and wait until it serves, and stop it (used by the RL
job for a local server, by the Slurm job's sandbox step and by the tests). The server prints one JSON
line with its address once it is listening; its log goes to a file (an undrained pipe would block it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


def spawn_server(args: list[str], log_path: Path, timeout_s: float = 60.0,
                 env: Optional[dict] = None, die_with_parent: bool = False) -> tuple[subprocess.Popen, dict]:
    """`python -m megatron_rl_sandbox.server *args`; returns the process and its {"address", "name"}.
    `die_with_parent`: the server gets SIGINT (it drains, then removes its discovery file, also with
    `--ignore-sigterm`) when the process that started it ends, however it ends (Linux's parent-death
    signal): a job killed before it could stop its server leaves neither a server nor a discovery file
    naming a dead one."""
    log = open(log_path, "a")  # a requeued job's next start adds to the log: the first attempt's stays
    log.write(f"=== sandbox server starting at {time.strftime('%Y-%m-%d %H:%M:%S')}, job restart "
              f"{os.environ.get('SLURM_RESTART_COUNT', '0')}, args {' '.join(args)} ===\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl_sandbox.server", *args], stdout=subprocess.PIPE,
                            stderr=log, text=True, env=env,
                            preexec_fn=_interrupt_with_parent if die_with_parent else None)
    deadline = time.monotonic() + timeout_s
    line = proc.stdout.readline()
    while not line.startswith("{"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the sandbox server did not start: {Path(log_path).read_text()[-2000:]}")
        line = proc.stdout.readline()
    return proc, json.loads(line)


def stop_server(proc: subprocess.Popen, timeout_s: float) -> None:
    """Drain a server started by `spawn_server` (SIGINT: running calls finish, its discovery file goes; also
    with `--ignore-sigterm`), SIGKILL it if it has not ended within `timeout_s`; returns once it has ended."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _interrupt_with_parent() -> None:
    """In the child before exec: SIGINT when the parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGINT), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
