"""Start and stop real sandbox servers for tests (each a separate process on 127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
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

    def descendants(self) -> list[int]:
        """Every process under the server (the commands it runs and their sandboxes)."""
        return _descendants(self.proc.pid)

    def runs(self, program: str) -> bool:
        """Whether a process under the server runs `program` (its argv[0])."""
        for pid in self.descendants():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == program.encode():
                    return True
            except OSError:  # it ended
                continue
        return False

    def signal_step(self, sig: int) -> None:
        """`sig` to the server and every process under it, as slurmstepd signals a job step."""
        for pid in [self.proc.pid, *self.descendants()]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        from megatron_rl_sandbox.spawn import stop_server

        stop_server(self.proc, timeout_s=30)
        if getattr(self, "work_dir", None) and not os.path.ismount(self.work_dir):
            shutil.rmtree(self.work_dir, ignore_errors=True)  # the server unmounted its workspaces as it drained


def _descendants(pid: int) -> list[int]:
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += [int(child), *_descendants(int(child))]
    except OSError:  # it ended
        pass
    return found


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


def start_server(runtime: str, *extra: str, run_dir: Optional[Path] = None, timeout: float = 60,
                 log: Optional[Path] = None) -> ServerProcess:
    from megatron_rl_sandbox.spawn import spawn_server

    args = runtime_args(runtime)
    assert args is not None, f"runtime {runtime} is not available"
    args = ["--address", "127.0.0.1:0", *args, *extra]
    work_dir = None
    if runtime == "apptainer":  # workspaces outside /tmp: the wrapper binds host /tmp recursively (apptainer/setup.sh)
        work_dir = tempfile.mkdtemp(prefix="megatron-rl-sandbox-", dir="/var/tmp")
        os.chmod(work_dir, 0o711)  # a root server's commands run as nobody, who must reach the workspaces
        args += ["--work-dir", work_dir]
    if run_dir is not None:
        args += ["--run-dir", str(run_dir)]
    log = log or Path(tempfile.mkstemp(prefix="sandbox-server-", suffix=".log")[1])
    proc, info = spawn_server(args, log, timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))
    server = ServerProcess(proc, info["address"], info["name"])
    server.log, server.work_dir = log, work_dir
    return server
