"""Start and stop real sandbox servers for tests (each a separate process on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
APPTAINER_ROOT = Path(os.environ.get("MEGATRON_RL_APPTAINER_ROOT", "/var/cache/megatron-rl/apptainer"))


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, address: str, name: str) -> None:
        self.proc, self.address, self.name = proc, address, name

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def runtime_args(runtime: str) -> Optional[list[str]]:
    """Server arguments for a runtime, or None when this machine cannot run it."""
    if runtime == "bwrap":
        return ["--runtime", "bwrap"] if shutil.which("bwrap") else None
    if runtime == "process":
        return ["--runtime", "process", "--allow-unisolated"]
    if runtime == "apptainer":
        wrapper = APPTAINER_ROOT / "apptainer"
        image = APPTAINER_ROOT / "image"
        if not (wrapper.exists() and image.is_dir()):
            return None
        return ["--runtime", "apptainer", "--apptainer-cmd", str(wrapper), "--image", f"python={image}"]
    raise ValueError(runtime)


def start_server(runtime: str, *extra: str, run_dir: Optional[Path] = None, timeout: float = 60) -> ServerProcess:
    args = runtime_args(runtime)
    assert args is not None, f"runtime {runtime} is not available"
    cmd = [sys.executable, "-m", "megatron_rl_sandbox.server", "--address", "127.0.0.1:0", *args, *extra]
    if run_dir is not None:
        cmd += ["--run-dir", str(run_dir)]
    # The log goes to a file: an undrained pipe would block the server once it fills up.
    log = tempfile.NamedTemporaryFile(prefix="sandbox-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    while not line.startswith("{"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sandbox server did not start: {Path(log.name).read_text()[-2000:]}")
        line = proc.stdout.readline()
    info = json.loads(line)
    server = ServerProcess(proc, info["address"], info["name"])
    server.log = Path(log.name)
    return server
