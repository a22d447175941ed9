"""bubblewrap runtime: new user, PID, network, IPC, UTS and mount namespaces; the image
read-only at /, the workspace read-write at /workspace, a private /tmp of at most the disk
limit, no capabilities, an unprivileged uid inside (and outside: a root server starts bwrap
as --sandbox-uid, executor.py), no further user namespaces (`--disable-userns`), the kernel knobs
under /proc (`PROC_KNOBS`) read-only, and the whole namespace killed with its parent.

A user namespace of its own would give the code every capability again inside it (CAP_NET_ADMIN,
CAP_SYS_ADMIN over namespaces it makes): nf_tables, mounts of its own and the rest of the kernel
surface that unprivileged local-root exploits go through. `--disable-userns` (bubblewrap >= 0.8)
closes it; an older bubblewrap runs without it and the server logs a WARNING.

The command is PID 1 of its PID namespace (`--as-pid-1`): bubblewrap's own reaper would
otherwise be PID 1 there, a process of the same user, dumpable, that holds the command's
stdout and stderr and decides its exit status, so code run by the command could write a
report into `/proc/1/fd/1` and machine code into `/proc/1/mem` and fake the outcome of a
process that judges it (see docs/agents.md, "Tests that judge outside the code's process").
As PID 1 the command also receives no signal from inside the sandbox it has no handler for
(nor SIGXCPU at the soft CPU limit: it is stopped at the hard one, see `Command.pid_1`);
orphans it leaves are reaped only when it exits, and the executor kills what is left then.

Images: `host` exposes only the host's /usr tree (Debian's merged /usr: /bin, /lib are
symlinks into it) and nothing else of the host (no /etc, /home, /root, /work, /tmp);
further images are root filesystem directories registered by name (`name=/path/to/rootfs`).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

from megatron_rl_sandbox.limits import Limits
from megatron_rl_sandbox.runtimes.base import BASE_ENV, WORKSPACE, Command, Runtime

# Kernel knobs under /proc, bound read-only over the sandbox's procfs. bubblewrap covers these itself only
# when the sandbox's user could write them (it tests access(W_OK) as that user), so a server whose uid maps
# to host root with no capability left got them writable: /proc/sys/kernel/core_pattern is run as root.
PROC_KNOBS = ("sys", "sysrq-trigger", "irq", "bus", "fs")

logger = logging.getLogger(__name__)

_HOST_LINKS = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}


class BwrapRuntime(Runtime):
    name = "bwrap"
    isolates = True

    def __init__(self, images: dict[str, str] | None = None, bwrap: str = "bwrap", uid: int = 1000) -> None:
        path = shutil.which(bwrap)
        if path is None:
            raise RuntimeError(f"the bwrap runtime needs bubblewrap ({bwrap!r} not on PATH): "
                               "apt-get install bubblewrap")
        self.bwrap = path
        self.uid = uid
        self.disable_userns = _supports(path, "--disable-userns")
        if not self.disable_userns:
            logger.warning("%s has no --disable-userns (bubblewrap < 0.8): sandboxed code can make user namespaces "
                           "of its own and regain capabilities inside them (kernel attack surface)", path)
        self._images: dict[str, Path | None] = {"host": None}
        for name, root in (images or {}).items():
            if not Path(root).is_dir():
                raise RuntimeError(f"bwrap image {name}={root} is not a directory")
            self._images[name] = Path(root)

    def images(self) -> list[str]:
        return list(self._images)

    def _root_args(self, image: str) -> tuple[list[str], Path]:
        root = self._images[image]
        if root is None:
            args = ["--ro-bind", "/usr", "/usr"]
            for link, target in _HOST_LINKS.items():
                args += ["--symlink", target, f"/{link}"]
            return args, Path("/")
        return ["--ro-bind", str(root), "/"], root

    def command(self, image: str, argv: list[str], workspace: Path, limits: Limits,
                env: dict[str, str]) -> Command:
        self._check_argv(argv)
        image = self._check_image(image)
        root_args, root = self._root_args(image)
        self._check_command_in_root(argv[0], root, image)
        args = [self.bwrap, "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session",
                "--unshare-user", "--uid", str(self.uid), "--gid", str(self.uid), "--cap-drop", "ALL"]
        if self.disable_userns:
            args.append("--disable-userns")
        if limits.network:
            args.append("--share-net")
        args += root_args
        args += ["--proc", "/proc"]
        for knob in PROC_KNOBS:  # read-only whatever the uid: bwrap covers them only where it could write them
            args += ["--ro-bind-try", f"/proc/{knob}", f"/proc/{knob}"]
        args += ["--dev", "/dev", "--size", str(limits.disk_bytes), "--tmpfs", "/tmp",
                 "--bind", str(workspace), WORKSPACE, "--remount-ro", "/", "--chdir", WORKSPACE, "--clearenv"]
        for key, value in {**BASE_ENV, **env}.items():
            args += ["--setenv", key, value]
        return Command(argv=[*args, "--", *argv], env={}, cwd="/", signal_from_exit_code=True, pid_1=True)


def _supports(bwrap: str, option: str) -> bool:
    """Whether this bubblewrap knows `option` (its --help lists it)."""
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in done.stdout + done.stderr
