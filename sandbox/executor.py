"""Run one confined command under hard limits and say exactly how it ended.

The host command (built by a runtime) starts as `sh -c '<join cgroup> exec prlimit ... --
<command>'` in a new session: the shell moves itself into the execution's cgroup before
anything else runs, so no descendant can escape the group's memory / process limits. Output
is read up to the limit per stream; past it the run is stopped and flagged. On a timeout,
an output overflow, or simply when the main process exits, every process left in the group
(double-forked daemons included) is killed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time

from megatron_rl_sandbox.limits import Group, Limiter, Limits
from megatron_rl_sandbox.runtimes.base import Command

logger = logging.getLogger(__name__)

EXITED, TIMEOUT, CPU_LIMIT, MEMORY_LIMIT, OUTPUT_LIMIT, DISK_LIMIT, SIGNALED, SETUP_ERROR = (
    "EXITED", "TIMEOUT", "CPU_LIMIT", "MEMORY_LIMIT", "OUTPUT_LIMIT", "DISK_LIMIT", "SIGNALED", "SETUP_ERROR")


@dataclasses.dataclass
class Outcome:
    exit_code: int = 0
    signal: int = 0
    termination: str = EXITED
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
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

    async def run(self) -> None:
        while True:
            chunk = await self.stream.read(65536)
            if not chunk:
                return
            room = self.limit - len(self.data)
            if len(chunk) > room:
                self.data += chunk[:max(room, 0)]
                if not self.truncated:
                    self.truncated = True
                    self.overflow.set()
                continue
            self.data += chunk


async def run_confined(command: Command, limits: Limits, limiter: Limiter, stdin: bytes = b"") -> Outcome:
    """Run `command` (already wrapped by a runtime) under `limits`. However the call ends,
    cancelled by a client that went away included, the run's process tree is dead and its
    cgroup removed when this returns or raises: the caller may then reuse the workspace."""
    group: Group = limiter.create(limits)
    try:
        return await _run_in_group(command, limits, limiter, group, stdin)
    finally:
        group.remove()  # kills whatever is left in the group first


async def _run_in_group(command: Command, limits: Limits, limiter: Limiter, group: Group, stdin: bytes) -> Outcome:
    script = group.join_command() + 'exec "$@"'
    argv = ["/bin/sh", "-c", script, "sh", "prlimit", *limiter.prlimit_args(limits, command.pid_1), "--",
            *command.argv]
    env = command.env or {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=command.cwd, start_new_session=True)
    except OSError as exc:
        return Outcome(exit_code=-1, termination=SETUP_ERROR, message=f"could not start: {exc}")
    overflow = asyncio.Event()
    out = _Capped(proc.stdout, limits.output_bytes, overflow)
    err = _Capped(proc.stderr, limits.output_bytes, overflow)
    readers = [asyncio.create_task(out.run()), asyncio.create_task(err.run())]
    feeder = asyncio.create_task(_feed(proc, stdin))
    waiter = asyncio.create_task(proc.wait())
    overflowed = asyncio.create_task(overflow.wait())
    exited = _exit_future(proc.pid)  # the main process alone, whatever holds its pipes
    try:
        done, _ = await asyncio.wait({exited, overflowed}, timeout=limits.wall_time_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        for task in (*readers, waiter):
            task.cancel()
        raise
    finally:
        # Whatever ended the wait (the call's cancellation included), nothing of the run may
        # outlive it: daemons and setsid children included (they may also hold the output pipes open).
        exited.cancel()
        _kill_tree(proc, group)
        overflowed.cancel()
        feeder.cancel()
    timed_out = not done
    await asyncio.wait(readers, timeout=5)
    for task in readers:
        task.cancel()
    # Process.wait() also waits for the pipes; the exit status itself is already known.
    await asyncio.wait({waiter}, timeout=5)
    waiter.cancel()
    wall = time.monotonic() - start
    acc = group.accounting()
    outcome = Outcome(stdout=bytes(out.data), stderr=bytes(err.data), stdout_truncated=out.truncated,
                      stderr_truncated=err.truncated, wall_time_s=wall, cpu_time_s=acc.cpu_time_s,
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
    outcome.termination, outcome.message = _classify(
        timed_out, overflow.is_set(), acc.oom_killed, sig, code, acc.cpu_time_s, outcome.stderr, limits,
        limiter.name, command.pid_1)
    return outcome


def _classify(timed_out: bool, overflowed: bool, oom: bool, sig: int, code: int, cpu_s: float,
              stderr: bytes, limits: Limits, limiter: str, pid_1: bool = False) -> tuple[str, str]:
    """Without cgroups (`rlimit`) CPU time is not measured. A command that is PID 1 of its namespace cannot
    be SIGKILLed from inside it, so a SIGKILL the executor did not send is most likely the kernel's at the
    hard CPU limit; but an exit status of 137 reads the same through the runtime (and the host's OOM
    killer is not seen), so the message says the cause is inferred."""
    if timed_out:
        return TIMEOUT, f"killed at the wall-time limit of {limits.wall_time_s:g}s"
    if overflowed:
        return OUTPUT_LIMIT, f"killed after {limits.output_bytes} bytes on one output stream"
    if oom:
        return MEMORY_LIMIT, f"killed at the memory limit of {limits.memory_bytes} bytes"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= 0.95 * limits.cpu_time_s):
        return CPU_LIMIT, f"killed at the CPU-time limit of {limits.cpu_time_s:g}s"
    if sig == signal.SIGKILL and limiter == "rlimit" and pid_1:
        return CPU_LIMIT, (f"killed by SIGKILL, presumably at the CPU-time limit of {limits.cpu_time_s:g}s "
                           "(inferred: CPU time is not measured without cgroups)")
    if sig == signal.SIGXFSZ:
        return DISK_LIMIT, f"a file exceeded the disk limit of {limits.disk_bytes} bytes"
    if code != 0 and (b"No space left on device" in stderr or b"File too large" in stderr):
        # ENOSPC from the workspace quota, EFBIG from RLIMIT_FSIZE (Python ignores SIGXFSZ)
        return DISK_LIMIT, f"a write hit the disk limit of {limits.disk_bytes} bytes"
    if code != 0 and limiter == "rlimit" and (b"MemoryError" in stderr or b"Cannot allocate memory" in stderr):
        return MEMORY_LIMIT, f"allocation failed at the address-space limit of {limits.memory_bytes} bytes"
    if sig:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        return SIGNALED, f"killed by signal {name}"
    return EXITED, ""


def _exit_future(pid: int) -> asyncio.Future:
    """A future that completes when process `pid` exits (pidfd; Linux >= 5.3)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    fd = os.pidfd_open(pid)

    def on_exit() -> None:
        if not future.done():
            future.set_result(None)

    def cleanup(_: asyncio.Future) -> None:
        loop.remove_reader(fd)
        os.close(fd)

    loop.add_reader(fd, on_exit)
    future.add_done_callback(cleanup)
    return future


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
