"""The `process` runtime: the command runs as a plain child process with rlimits and, where
writable cgroups exist, memory/process limits and whole-tree kills. It does NOT isolate
anything: the command sees the host filesystem and network as the server's user does. It
exists for trusted code and for machines without bubblewrap or Apptainer, and refuses to
start unless explicitly allowed. Under a root server the command runs as the server's unprivileged
--sandbox-uid (executor.py), with the server's PATH less the directories that user cannot reach."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from megatron_rl_sandbox.limits import Limits
from megatron_rl_sandbox.runtimes.base import BASE_ENV, Command, Runtime

logger = logging.getLogger(__name__)


def _searchable_by_others(directory: Path) -> bool:
    try:
        return all(p.stat().st_mode & stat.S_IXOTH for p in [directory, *directory.parents])
    except OSError:
        return False


class ProcessRuntime(Runtime):
    name = "process"
    isolates = False

    def __init__(self, allow_unisolated: bool = False) -> None:
        if not allow_unisolated:
            raise RuntimeError("the process runtime isolates nothing (no filesystem or network isolation); "
                               "start it only with allow_unisolated (--allow-unisolated) and trusted code")
        logger.warning("sandbox runtime 'process' isolates NOTHING: commands see the host as this user")

    def images(self) -> list[str]:
        return ["host"]

    def command(self, image: str, argv: list[str], workspace: Path, limits: Limits,
                env: dict[str, str]) -> Command:
        self._check_argv(argv)
        self._check_image(image)
        merged = {**BASE_ENV, "HOME": str(workspace), **env}
        path = os.environ.get("PATH", merged["PATH"])
        if os.geteuid() == 0:  # the command runs as the unprivileged --sandbox-uid: root's own entries are closed to it
            path = ":".join(d for d in path.split(":") if d and _searchable_by_others(Path(d)))
        merged["PATH"] = path
        return Command(argv=list(argv), env=merged, cwd=str(workspace), signal_from_exit_code=False)
