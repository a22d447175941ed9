"""Execution limits and the mechanism that enforces memory / process / CPU-accounting limits.

Limits travel in every request (`Limits` in the proto); zero fields take the server's
defaults, and a request can never raise a limit above the server's maximum. A negative or
non-finite limit is refused (ValueError): cgroup v1 reads a memory limit of -1 as "none".

Enforcement, per execution:
- wall time: the server's own timer, then the whole process tree is killed;
- CPU time: the run's total (all of its processes), read by `Group.cpu_time_s` and enforced by the
  executor; RLIMIT_CPU per process as a backstop. File size: RLIMIT_FSIZE. Both set by `prlimit`;
- memory, number of processes, CPU accounting and "kill every descendant": a fresh cgroup
  (v2 if a writable delegated subtree exists, else v1 memory+pids+cpuacct controllers);
  without writable cgroups, RLIMIT_AS and RLIMIT_NPROC instead (weaker: NPROC counts all of
  the user's processes and AS counts virtual memory). Health reports which one is active.
This is hand-written because no maintained Python library manages cgroup v1/v2 leaves for
short-lived processes; the logic is small and tested adversarially.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclasses.dataclass(frozen=True)
class Limits:
    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_bytes: int = 512 * 2**20
    max_processes: int = 64
    output_bytes: int = 1 * 2**20
    disk_bytes: int = 64 * 2**20
    network: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "network" and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"limit {field.name}={value!r} must be a finite number >= 0 (0: the server's "
                                 f"default)")

    def merged(self, request: Optional["Limits"], maximum: "Limits") -> "Limits":
        """`request`'s non-zero fields over these defaults, capped at `maximum`."""
        values = dataclasses.asdict(self)
        if request is not None:
            for key, value in dataclasses.asdict(request).items():
                if key == "network":
                    values[key] = bool(value) and maximum.network
                elif value:
                    values[key] = min(value, getattr(maximum, key))
        return Limits(**values)


@dataclasses.dataclass
class Accounting:
    cpu_time_s: float = 0.0
    max_rss_bytes: int = 0
    oom_killed: bool = False


def _own_cgroup_v1(controller: str) -> Optional[Path]:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return CGROUP_ROOT / controller / path.lstrip("/")
    return None


def _writable(path: Optional[Path]) -> bool:
    return path is not None and path.is_dir() and os.access(path, os.W_OK)


class Limiter:
    """Creates one control group per execution (or none, for the rlimit fallback)."""

    name = "rlimit"

    def create(self, limits: Limits) -> "Group":
        return Group(self, None, limits)

    def prlimit_args(self, limits: Limits, pid_1: bool = False, uid: Optional[int] = None) -> list[str]:
        """`pid_1`: the command is PID 1 of its PID namespace, for which the kernel drops SIGXCPU at
        the soft limit; the hard limit (SIGKILL) is then the limit itself, not one second past it, and no
        process of the run gets SIGXCPU (a handler of it for a clean shutdown is never called).
        RLIMIT_CPU bounds each process; the run's total is bounded by `Group.cpu_time_s` (executor).
        `uid`: the user the run's processes run as (RLIMIT_NPROC counts that user's processes)."""
        cpu = max(1, int(limits.cpu_time_s + 0.999))
        args = [f"--cpu={cpu}:{cpu if pid_1 else cpu + 1}", f"--fsize={limits.disk_bytes}", "--core=0"]
        if self.name == "rlimit":
            args += [f"--as={limits.memory_bytes}",
                     f"--nproc={limits.max_processes + _user_processes(os.getuid() if uid is None else uid)}"]
        return args


def _user_processes(uid: int) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                continue
    return count


class CgroupV1Limiter(Limiter):
    name = "cgroup-v1"
    CONTROLLERS = ("memory", "pids", "cpuacct", "freezer")

    def __init__(self, parents: dict[str, Path]) -> None:
        self.parents = parents

    def create(self, limits: Limits) -> "Group":
        name = f"sbx-{uuid.uuid4().hex[:12]}"
        paths = {c: self.parents[c] / name for c in self.CONTROLLERS}
        group = Group(self, {}, limits)
        try:
            for controller, path in paths.items():
                path.mkdir()
                group.paths[controller] = path
            (paths["memory"] / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            memsw = paths["memory"] / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # no escape into swap
                try:
                    memsw.write_text(str(limits.memory_bytes))
                except OSError:
                    pass
            (paths["pids"] / "pids.max").write_text(str(limits.max_processes))
        except BaseException:
            group.remove()  # no half-made group left behind
            raise
        return group


class CgroupV2Limiter(Limiter):
    name = "cgroup-v2"

    def __init__(self, parent: Path) -> None:
        self.parent = parent

    def create(self, limits: Limits) -> "Group":
        path = self.parent / f"sbx-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        group = Group(self, {"unified": path}, limits)
        try:
            (path / "memory.max").write_text(str(limits.memory_bytes))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
            (path / "pids.max").write_text(str(limits.max_processes))
        except BaseException:
            group.remove()  # no half-made group left behind
            raise
        return group


class Group:
    """One execution's control group: join it from a shell, account, kill all, remove."""

    def __init__(self, limiter: Limiter, paths: Optional[dict[str, Path]], limits: Limits) -> None:
        self.limiter = limiter
        self.paths = paths
        self.limits = limits

    def join_command(self) -> str:
        """Shell words that move the shell itself (`$$`) into the group before it execs."""
        if not self.paths:
            return ""
        return " && ".join(f"echo $$ > {p / 'cgroup.procs'}" for p in self.paths.values()) + " && "

    def pids(self) -> list[int]:
        if not self.paths:
            return []
        path = next(iter(self.paths.values()))
        try:
            return [int(x) for x in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process in the group, including ones that left the process group.

        The group is frozen first (v1 freezer) or killed atomically (v2 `cgroup.kill`), so a
        fork bomb cannot outrun the kill loop."""
        if not self.paths or not self.pids():
            return
        unified = self.paths.get("unified")
        freezer = self.paths.get("freezer")
        if unified is not None and (unified / "cgroup.kill").exists():
            (unified / "cgroup.kill").write_text("1")
        elif freezer is not None:
            _write(freezer / "freezer.state", "FROZEN")
            deadline = time.monotonic() + 2.0
            while _read(freezer / "freezer.state") == "FREEZING" and time.monotonic() < deadline:
                time.sleep(0.001)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if freezer is not None:
                _write(freezer / "freezer.state", "THAWED")  # frozen tasks die only once thawed
            time.sleep(0.002)
        else:
            logger.error("processes of %s survived SIGKILL for %.0fs", self.paths, timeout_s)

    def cpu_time_s(self, root_pid: int) -> float:
        """CPU time used so far by the whole run, all of its processes together (cgroup usage; without
        cgroups, the sum over `root_pid` and its descendants of their own and their reaped children's
        time, from /proc)."""
        if self.paths:
            try:
                if "unified" in self.paths:
                    for line in (self.paths["unified"] / "cpu.stat").read_text().splitlines():
                        if line.startswith("usage_usec "):
                            return int(line.split()[1]) / 1e6
                    return 0.0
                return int((self.paths["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
            except (OSError, ValueError):
                return 0.0
        return _tree_cpu_time_s(root_pid)

    def accounting(self) -> Accounting:
        acc = Accounting()
        if not self.paths:
            return acc
        try:
            if "unified" in self.paths:
                path = self.paths["unified"]
                stat = dict(line.split() for line in (path / "cpu.stat").read_text().splitlines())
                acc.cpu_time_s = int(stat.get("usage_usec", 0)) / 1e6
                peak = path / "memory.peak"
                acc.max_rss_bytes = int(peak.read_text()) if peak.exists() else 0
                events = dict(line.split() for line in (path / "memory.events").read_text().splitlines())
                acc.oom_killed = int(events.get("oom_kill", 0)) > 0
            else:
                acc.cpu_time_s = int((self.paths["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
                acc.max_rss_bytes = int((self.paths["memory"] / "memory.max_usage_in_bytes").read_text())
                oom = dict(line.split() for line in (self.paths["memory"] / "memory.oom_control").read_text()
                           .splitlines())
                failcnt = int((self.paths["memory"] / "memory.failcnt").read_text())
                acc.oom_killed = int(oom.get("oom_kill", 0)) > 0 or (
                    failcnt > 0 and acc.max_rss_bytes >= self.limits.memory_bytes * 0.9)
        except (OSError, ValueError) as exc:
            logger.debug("cgroup accounting unavailable: %s", exc)
        return acc

    def remove(self) -> None:
        if not self.paths:
            return
        self.kill_all()
        for path in self.paths.values():
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy for a moment after the last process died
                    if time.monotonic() > deadline:
                        logger.error("could not remove cgroup %s", path)
                        break
                    time.sleep(0.01)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _tree_cpu_time_s(pid: int) -> float:
    """utime + stime + cutime + cstime of `pid` and every descendant (/proc/<pid>/stat fields 14-17):
    a process's reaped children are in its c-times, the living ones are visited."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += sum(int(x) for x in fields[11:15])
            for task in Path(f"/proc/{current}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):  # it ended meanwhile
            continue
    return total / _CLOCK_TICKS


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def detect_limiter(prefer: str = "auto") -> Limiter:
    """The strongest limiter this process can use (`prefer`: auto, cgroup-v1, cgroup-v2, rlimit)."""
    if prefer in ("auto", "cgroup-v2"):
        unified = CGROUP_ROOT / "cgroup.controllers"
        if unified.exists():
            own = Path("/proc/self/cgroup").read_text().split("::", 1)[-1].strip()
            parent = CGROUP_ROOT / own.lstrip("/")
            controllers = unified.read_text().split()
            if _writable(parent) and {"memory", "pids"} <= set(controllers):
                probe = parent / f"sbx-probe-{os.getpid()}"
                try:
                    probe.mkdir()
                    probe.rmdir()
                    return CgroupV2Limiter(parent)
                except OSError:
                    pass
        if prefer == "cgroup-v2":
            raise RuntimeError("cgroup v2 limiter requested but no writable delegated cgroup v2 subtree")
    if prefer in ("auto", "cgroup-v1"):
        parents = {c: _own_cgroup_v1(c) for c in CgroupV1Limiter.CONTROLLERS}
        if all(_writable(p) for p in parents.values()):
            base = {c: p / "megatron-rl-sandbox" for c, p in parents.items()}
            try:
                for p in base.values():
                    p.mkdir(exist_ok=True)
                return CgroupV1Limiter(base)
            except OSError:
                pass
        if prefer == "cgroup-v1":
            raise RuntimeError("cgroup v1 limiter requested but memory/pids/cpuacct cgroups are not writable")
    if shutil.which("prlimit") is None:
        raise RuntimeError("the sandbox needs `prlimit` (util-linux) to set resource limits")
    return Limiter()
