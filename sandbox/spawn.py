"""Start a sandbox server as a child process and wait until it serves (used by the RL job
for a local server and by the tests). The server prints one JSON line with its address
once it is listening; its log goes to a file (an undrained pipe would block it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


def spawn_server(args: list[str], log_path: Path, timeout_s: float = 60.0,
                 env: Optional[dict] = None) -> tuple[subprocess.Popen, dict]:
    """`python -m megatron_rl_sandbox.server *args`; returns the process and its {"address", "name"}."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl_sandbox.server", *args], stdout=subprocess.PIPE,
                            stderr=log, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    line = proc.stdout.readline()
    while not line.startswith("{"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the sandbox server did not start: {Path(log_path).read_text()[-2000:]}")
        line = proc.stdout.readline()
    return proc, json.loads(line)
