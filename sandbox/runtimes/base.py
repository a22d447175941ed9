"""The runtime interface: turn (image, argv, workspace, limits) into the command that runs
argv confined in that image with the workspace mounted at /workspace."""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path

from megatron_rl_sandbox.limits import Limits

WORKSPACE = "/workspace"
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}


class RuntimeError_(Exception):
    """A request this runtime cannot run (unknown image, command not in the image); the
    message is shown to the caller as a SETUP_ERROR."""


@dataclasses.dataclass
class Command:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    signal_from_exit_code: bool  # the wrapper reports "killed by signal N" as exit 128 + N
    # (exit code, stderr prefix) by which the wrapper reports that it could not start the command
    setup_failure: tuple[int, bytes] | None = None
    # The command is PID 1 of its own PID namespace: a signal it has no handler for does not reach it from
    # inside the sandbox (SIGKILL included), and the kernel drops such a SIGXCPU / SIGXFSZ too (it stops at
    # the hard CPU limit instead).
    pid_1: bool = False


class Runtime(abc.ABC):
    name: str = ""
    isolates: bool = True

    @abc.abstractmethod
    def images(self) -> list[str]:
        """Names of the images this runtime can start."""

    @abc.abstractmethod
    def command(self, image: str, argv: list[str], workspace: Path, limits: Limits,
                env: dict[str, str]) -> Command:
        """The host command for one execution; raises RuntimeError_ for an invalid request."""

    def default_image(self) -> str:
        return self.images()[0]

    def _check_image(self, image: str) -> str:
        image = image or self.default_image()
        if image not in self.images():
            raise RuntimeError_(f"image {image!r} is not available on this server; "
                                f"available: {', '.join(self.images())}")
        return image

    @staticmethod
    def _check_argv(argv: list[str]) -> None:
        if not argv or not argv[0]:
            raise RuntimeError_("empty command: argv must name a program")

    @staticmethod
    def _check_command_in_root(argv0: str, root: Path, image: str) -> None:
        """Refuse a command that does not exist in a root-filesystem image (a clear error
        instead of an exit code 127 from inside)."""
        if "/" in argv0:
            if argv0.startswith(WORKSPACE + "/") or not argv0.startswith("/"):
                return  # a program in the workspace: checked when it runs
            if not (root / argv0.lstrip("/")).exists():
                raise RuntimeError_(f"command {argv0!r} does not exist in image {image!r}")
            return
        for d in BASE_ENV["PATH"].split(":"):
            if (root / d.lstrip("/") / argv0).exists():
                return
        raise RuntimeError_(f"command {argv0!r} is not found on PATH in image {image!r}")
