"""Apptainer runtime (rootless; no daemon): `apptainer exec --containall --no-init --home
<workspace>:/workspace --net --network none --bind <workspace>:/workspace --pwd /workspace <image>
argv`.

A root server runs apptainer itself as its unprivileged `--sandbox-uid` (executor.py), so the
container's user namespace maps that uid alone: nothing inside holds host uid 0, and the kernel
knobs under /proc/sys are not writable by it (binding them read-only, as the bwrap runtime does,
makes Apptainer's own /proc mount fail in a user namespace).

`--no-init`: the command is PID 1 of the container's PID namespace, not Apptainer's shim init
(`appinit`), a process of the same user that code run by the command could write into through
`/proc/1/mem` and `/proc/1/fd/` to fake the command's outcome (the bwrap runtime's `--as-pid-1`
does the same; see there).

Images are SIF files or sandbox directories registered by name (`name=/path/image.sif`).
`apptainer_cmd` is the command that runs apptainer: plain `apptainer` on a cluster, or a
wrapper (the tests run Apptainer from a Debian sid root filesystem entered with bubblewrap,
see tests/integration/apptainer/). As root, `--userns` keeps Apptainer in user-namespace
mode. Network off uses Apptainer's `none` network (loopback only).
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from megatron_rl_sandbox.limits import Limits
from megatron_rl_sandbox.runtimes.base import BASE_ENV, WORKSPACE, Command, Runtime


class ApptainerRuntime(Runtime):
    name = "apptainer"
    isolates = True

    def __init__(self, images: dict[str, str] | None = None, apptainer_cmd: str = "apptainer") -> None:
        self.cmd = shlex.split(apptainer_cmd)
        if shutil.which(self.cmd[0]) is None:
            raise RuntimeError(f"the apptainer runtime needs {self.cmd[0]!r} on PATH (Apptainer >= 1.2)")
        if not images:
            raise RuntimeError("the apptainer runtime needs at least one image: --image name=/path/image.sif")
        self._images = {}
        for name, path in images.items():
            if not Path(path).exists():
                raise RuntimeError(f"apptainer image {name}={path} does not exist")
            self._images[name] = path

    def images(self) -> list[str]:
        return list(self._images)

    def command(self, image: str, argv: list[str], workspace: Path, limits: Limits,
                env: dict[str, str]) -> Command:
        self._check_argv(argv)
        image = self._check_image(image)
        if Path(self._images[image]).is_dir():
            self._check_command_in_root(argv[0], Path(self._images[image]), image)
        # HOME through --home, the workspace itself: `--env HOME=...` made Apptainer print a warning into
        # every run's stderr, which is what the model and the verifier read.
        args = [*self.cmd, "exec", "--containall", "--no-init", "--home", f"{workspace}:{WORKSPACE}", "--cleanenv",
                "--no-privs", "--bind", f"{workspace}:{WORKSPACE}", "--pwd", WORKSPACE]
        if not limits.network:
            args += ["--net", "--network", "none"]
        if os.geteuid() == 0:
            args.append("--userns")
        for key, value in {**BASE_ENV, **env}.items():
            if key != "HOME":
                args += ["--env", f"{key}={value}"]
        return Command(argv=[*args, self._images[image], *argv], env={"PATH": os.environ.get("PATH", "")},
                       cwd="/", signal_from_exit_code=True, setup_failure=(255, b"FATAL:"),
                       pid_1=True)
