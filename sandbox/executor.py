"""Run one confined command under hard limits and say exactly how it ended.

The host command (built by a runtime) starts as `sh -c '<join cgroup> exec prlimit ... --
[setpriv --reuid U ...] <command>'` in a new session: the shell moves itself into the
execution's cgroup before anything else runs, so no descendant can escape the group's memory /
process limits. A server running as root drops every run to an unprivileged uid (`RunAs`,
default 65534) before the runtime starts: with the server's uid 0 mapped into the sandbox's user
namespace, code inside could write root-owned kernel knobs such as
/proc/sys/kernel/core_pattern. Output is read up to the limit per stream; past it the run is
stopped and flagged. The CPU-time limit bounds the run's total (all of its processes,
polled from the cgroup or /proc), not each process: RLIMIT_CPU alone let eight forked
processes use eight times the limit. On a timeout, an output overflow, the CPU limit, or simply
when the main process exits, every process left in the group (double-forked daemons included)
is killed.

The main process's exit is taken from asyncio's own child watcher (the protocol's
`process_exited`), never from a handle opened after the start: a command that exits before the
server opened a pidfd was reported as a server error (ProcessLookupError) and run again by the
client's retry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import time
from typing import Callable, Optional

from megatron_rl_sandbox.limits import Group, Limiter, Limits
from megatron_rl_sandbox.runtimes.base import Command

logger = logging.getLogger(__name__)

EXITED, TIMEOUT, CPU_LIMIT, MEMORY_LIMIT, OUTPUT_LIMIT, DISK_LIMIT, SIGNALED, SETUP_ERROR = (
    "EXITED", "TIMEOUT", "CPU_LIMIT", "MEMORY_LIMIT", "OUTPUT_LIMIT", "DISK_LIMIT", "SIGNALED", "SETUP_ERROR")


@dataclasses.dataclass(frozen=True)
class RunAs:
    """The unprivileged host user and group a root server runs sandboxed code as."""

    uid: int = 65534
    gid: int = 65534

    def __post_init__(self) -> None:
        if self.uid <= 0 or self.gid <= 0:
            raise ValueError(f"sandboxed code must not run as uid/gid 0 (got uid={self.uid}, gid={self.gid}): "
                             "use an unprivileged id such as 65534 (nobody)")

    def argv(self) -> list[str]:
        """`setpriv` words that switch to this user, with no supplementary groups, no capability
        left in any set, and no way back up through a setuid file (no_new_privs)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "--"]


ROOT_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # where a root server's chain finds prlimit, setpriv and env
CPU_POLL_S = 0.05  # how often a run's total CPU time is read: the limit is overshot by at most this per core


@dataclasses.dataclass
class Outcome:
    exit_code: int = 0
    signal: int = 0
    termination: str = EXITED
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_size: int = 0  # bytes the run wrote to the stream (stdout holds at most the output limit of them)
    stderr_size: int = 0
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0
    max_rss_bytes: int = 0
    message: str = ""
    queue_wait_s: float = 0.0  # time waited for a slot before it ran (set by the server)


class _Capped:
    """Reads one stream to its end, keeping at most `limit` bytes; `overflow` is set when more
    came. Reading continues (discarding) after the limit: asyncio's `Process.wait()` only
    returns once every pipe has reached EOF, so a stream left unread would hang the call."""

    def __init__(self, stream: asyncio.StreamReader, limit: int, overflow: asyncio.Event) -> None:
        self.stream, self.limit, self.overflow = stream, limit, overflow
        self.data = bytearray()
        self.truncated = False
        self.size = 0

    async def run(self) -> None:
        while True:
            chunk = await self.stream.read(65536)
            if not chunk:
                return
            self.size += len(chunk)
            room = self.limit - len(self.data)
            if len(chunk) > room:
                self.data += chunk[:max(room, 0)]
                if not self.truncated:
                    self.truncated = True
                    self.overflow.set()
                continue
            self.data += chunk


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol for `create_subprocess_exec`, plus `exited`: done when the main process
    has exited (reported by the event loop's child watcher), whoever still holds its pipes."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


async def _start(argv: list[str], env: dict[str, str], cwd: str) -> tuple[asyncio.subprocess.Process, asyncio.Future]:
    """`asyncio.create_subprocess_exec` with pipes on all three streams, in a new session; also returns
    the future of the main process's exit."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(
        lambda: _Protocol(2**16, loop), *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
    return asyncio.subprocess.Process(transport, protocol, loop), protocol.exited


async def run_confined(command: Command, limits: Limits, limiter: Limiter, stdin: bytes = b"",
                       run_as: Optional[RunAs] = None, disk_full: Optional[Callable[[], bool]] = None) -> Outcome:
    """Run `command` (already wrapped by a runtime) under `limits`, as `run_as` when given (the
    server is root). `disk_full` says, after the run, whether it filled its workspace (measured, in a
    worker thread): a failed run that did is DISK_LIMIT. However the call ends, cancelled by a
    client that went away included, the run's process tree is dead and its cgroup removed when this
    returns or raises: the caller may then reuse the workspace."""
    group: Group = limiter.create(limits)
    try:
        return await _run_in_group(command, limits, limiter, group, stdin, run_as, disk_full)
    finally:
        group.remove()  # kills whatever is left in the group first


async def _cpu_watch(group: Group, pid: int, limit_s: float) -> float:
    """Returns once the run's processes have used `limit_s` of CPU time together."""
    while True:
        used = await asyncio.to_thread(group.cpu_time_s, pid) if not group.paths else group.cpu_time_s(pid)
        if used >= limit_s:
            return used
        await asyncio.sleep(CPU_POLL_S)


async def _run_in_group(command: Command, limits: Limits, limiter: Limiter, group: Group, stdin: bytes,
                        run_as: Optional[RunAs], disk_full: Optional[Callable[[], bool]]) -> Outcome:
    script = group.join_command() + 'exec "$@"'
    if run_as is None:
        env = command.env or {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        argv = ["/bin/sh", "-c", script, "sh", "prlimit", *limiter.prlimit_args(limits, command.pid_1), "--",
                *command.argv]
    else:
        # The part that runs as root (sh, prlimit, setpriv) gets a fixed environment: the request's (LD_PRELOAD
        # of a file it sent, say) applies only after the drop, through env -i.
        env = {"PATH": ROOT_PATH}
        user_env = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in command.env.items())] if command.env else []
        argv = ["/bin/sh", "-c", script, "sh", "prlimit", *limiter.prlimit_args(limits, command.pid_1, run_as.uid),
                "--", *run_as.argv(), *user_env, *command.argv]
    start = time.monotonic()
    try:
        proc, exited = await _start(argv, env, command.cwd)
    except OSError as exc:
        return Outcome(exit_code=-1, termination=SETUP_ERROR, message=f"could not start: {exc}")
    overflow = asyncio.Event()
    out = _Capped(proc.stdout, limits.output_bytes, overflow)
    err = _Capped(proc.stderr, limits.output_bytes, overflow)
    readers = [asyncio.create_task(out.run()), asyncio.create_task(err.run())]
    feeder = asyncio.create_task(_feed(proc, stdin))
    waiter = asyncio.create_task(proc.wait())
    overflowed = asyncio.create_task(overflow.wait())
    cpu = asyncio.create_task(_cpu_watch(group, proc.pid, limits.cpu_time_s))
    try:
        done, _ = await asyncio.wait({exited, overflowed, cpu}, timeout=limits.wall_time_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        for task in (*readers, waiter):
            task.cancel()
        raise
    finally:
        # Whatever ended the wait (the call's cancellation included), nothing of the run may
        # outlive it: daemons and setsid children included (they may also hold the output pipes open).
        _kill_tree(proc, group)
        for task in (overflowed, feeder, cpu):
            task.cancel()
    timed_out = not done
    cpu_exceeded = cpu in done and exited not in done
    await asyncio.wait(readers, timeout=5)
    for task in readers:
        task.cancel()
    # Process.wait() also waits for the pipes; the exit status itself is already known.
    await asyncio.wait({waiter}, timeout=5)
    waiter.cancel()
    wall = time.monotonic() - start
    acc = group.accounting()
    outcome = Outcome(stdout=bytes(out.data), stderr=bytes(err.data), stdout_truncated=out.truncated,
                      stderr_truncated=err.truncated, stdout_size=out.size, stderr_size=err.size, wall_time_s=wall,
                      cpu_time_s=acc.cpu_time_s or (cpu.result() if cpu_exceeded else 0.0),
                      max_rss_bytes=acc.max_rss_bytes)
    code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    sig = -code if code < 0 else 0
    if command.signal_from_exit_code and code > 128 and code - 128 < 65:
        sig = code - 128
    outcome.exit_code, outcome.signal = code, sig
    failure = command.setup_failure
    if failure is not None and code == failure[0] and outcome.stderr.lstrip().startswith(failure[1]):
        outcome.termination, outcome.message = SETUP_ERROR, outcome.stderr.decode(errors="replace").strip()
        return outcome
    # Also a run whose processes died of their own RLIMIT_CPU (SIGXCPU) before a late poll saw the total pass
    # the limit: what counts is the total it measured.
    cpu_exceeded = cpu_exceeded or (not timed_out and not overflow.is_set() and acc.cpu_time_s >= limits.cpu_time_s)
    if cpu_exceeded:
        outcome.termination = CPU_LIMIT
        outcome.message = (f"killed at the CPU-time limit of {limits.cpu_time_s:g}s (all of the run's processes "
                           f"together: {outcome.cpu_time_s:.2f}s)")
        return outcome
    full = code != 0 and disk_full is not None and await asyncio.to_thread(disk_full)
    outcome.termination, outcome.message = _classify(
        timed_out, overflow.is_set(), acc.oom_killed, sig, code, acc.cpu_time_s, limits, limiter.name,
        command.pid_1, full)
    return outcome


def _classify(timed_out: bool, overflowed: bool, oom: bool, sig: int, code: int, cpu_s: float,
              limits: Limits, limiter: str, pid_1: bool = False, disk_full: bool = False) -> tuple[str, str]:
    """From what was measured, never from what the run printed: a program that prints "No space left
    on device" or "MemoryError" has not hit a limit for saying so.

    Without cgroups (`rlimit`) CPU time is not measured. A command that is PID 1 of its namespace cannot
    be SIGKILLed from inside it, so a SIGKILL the executor did not send is most likely the kernel's at the
    hard CPU limit; but an exit status of 137 reads the same through the runtime (and the host's OOM
    killer is not seen), so the message says the cause is inferred."""
    if timed_out:
        return TIMEOUT, f"killed at the wall-time limit of {limits.wall_time_s:g}s"
    if overflowed:
        return OUTPUT_LIMIT, f"killed after {limits.output_bytes} bytes on one output stream"
    if oom:
        return MEMORY_LIMIT, f"killed at the memory limit of {limits.memory_bytes} bytes"
    # A runtime reports a signal as exit status 128 + N, which the code can also exit with (153 read as SIGXFSZ,
    # 152 as SIGXCPU): a signal is a limit's only where the measurement agrees (the CPU time used, a full
    # workspace: `disk_full` sees a file at RLIMIT_FSIZE), or, without cgroups, where nothing was measured.
    if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu_s >= 0.95 * limits.cpu_time_s:
        return CPU_LIMIT, f"killed at the CPU-time limit of {limits.cpu_time_s:g}s"
    if sig == signal.SIGXCPU and limiter == "rlimit" and not pid_1:
        return CPU_LIMIT, f"killed at the CPU-time limit of {limits.cpu_time_s:g}s"
    if sig == signal.SIGKILL and limiter == "rlimit" and pid_1:
        return CPU_LIMIT, (f"killed by SIGKILL, presumably at the CPU-time limit of {limits.cpu_time_s:g}s "
                           "(inferred: CPU time is not measured without cgroups)")
    if disk_full:  # ENOSPC from the workspace quota, or a file at RLIMIT_FSIZE (EFBIG: Python ignores SIGXFSZ)
        return DISK_LIMIT, f"the run filled its workspace (disk limit {limits.disk_bytes} bytes)"
    if sig:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        return SIGNALED, f"killed by signal {name}"
    return EXITED, ""


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    try:
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


def _kill_tree(proc: asyncio.subprocess.Process, group: Group) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    group.kill_all()
