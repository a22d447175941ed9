"""The sandbox gRPC server (asyncio).

- Bounded concurrency: at most `capacity` executions run at once; up to `max_queue` more
  wait; beyond that a call is refused at once with RESOURCE_EXHAUSTED (back-pressure the
  client turns into waiting or failover), never queued without bound.
- Scheduling: every execution has a priority class (training, evaluation, quality, build);
  free slots go by weighted fair queueing across classes, with per-class quotas and queue
  bounds (`scheduler.py`). Health reports queue depth, waits and back-pressure per class.
- Idempotency: the result of every mutating call is remembered under (method, key); a retry
  with the same key, even while the first is still running, gets the same result and the
  command never runs twice (except after a stop signal, below). The most recent results are
  kept, up to `--remember-bytes` of replies (outputs included) and 10,000 calls.
- Sessions keep a workspace between calls for multi-turn agents; snapshots are tar files that
  live as long as the session that took them.
- File I/O on workspaces runs in worker threads, never on the event loop: a workspace is
  written by untrusted code, and one slow or blocking file must not stall every other call.
- SIGTERM (and SIGINT) drains: new calls are refused with UNAVAILABLE, running ones finish (up
  to `drain_s`), then the server exits and removes its discovery file. With `--ignore-sigterm`
  only SIGINT does: for a server that a training job stops itself (Slurm sends SIGTERM to every
  process at a job's end, while the trainer may still need rewards for the step it finishes).
- Slurm's signals reach the commands the server runs too (every process of the step). A
  one-shot execution (Execute, Verify) that fails while a stop signal (SIGTERM, SIGINT, SIGUSR1)
  reaches the server is no result: refused with UNAVAILABLE and not remembered, so the client's
  retry (same key) runs it again, here or on another server, instead of scoring the signal as
  the code's failure. A session's command is not run again (what it did to the workspace before
  the signal stays): refused with ABORTED and not remembered; the client raises SessionInterrupted
  and the environment rebuilds its workspace (restore a snapshot, replay its calls) before it
  runs the command again.
- With `--run-dir`, the address is written to `<run-dir>/sandbox/<name>.json` so that the
  job's ranks find the servers of their allocation.

    python -m megatron_rl_sandbox.server --address 0.0.0.0:50051 --runtime bwrap --run-dir runs/job
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import faulthandler
import json
import logging
import math
import os
import signal
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import grpc

from megatron_rl_sandbox.executor import SETUP_ERROR, Outcome, run_confined
from megatron_rl_sandbox.limits import Limiter, Limits, detect_limiter
from megatron_rl_sandbox.proto import load as load_proto
from megatron_rl_sandbox.runtimes import Runtime, RuntimeError_, make_runtime
from megatron_rl_sandbox.scheduler import (CLASSES, DEFAULT_CLASS, DEFAULT_WEIGHTS, ClassPolicy, FairScheduler,
                                           Refused, SlotGate)
from megatron_rl_sandbox.workspace import Workspace, WorkspaceError, WorkspacePool, WorkspaceStateError

pb2, pb2_grpc = load_proto()
logger = logging.getLogger(__name__)

MAXIMUM = Limits(wall_time_s=600, cpu_time_s=600, memory_bytes=16 * 2**30, max_processes=4096,
                 output_bytes=64 * 2**20, disk_bytes=8 * 2**30, network=False)
_TERMINATION = {name: pb2.Termination.Value(name) for name in pb2.Termination.keys()}


def limits_from_proto(msg) -> Limits:
    return Limits(wall_time_s=msg.wall_time_s, cpu_time_s=msg.cpu_time_s, memory_bytes=msg.memory_bytes,
                  max_processes=msg.max_processes, output_bytes=msg.output_bytes, disk_bytes=msg.disk_bytes,
                  network=msg.network)


@dataclasses.dataclass
class Session:
    id: str
    workspace: Workspace
    image: str
    limits: Limits
    priority_class: str = DEFAULT_CLASS
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    snapshots: list[Path] = dataclasses.field(default_factory=list)  # deleted with the session

    @contextlib.asynccontextmanager
    async def use(self):
        """Hold the session for one call; it counts as used when the call ends too (a long call
        does not make it look idle)."""
        async with self.lock:
            try:
                yield
            finally:
                self.last_used = time.monotonic()


class _Busy(Exception):
    pass


class _Interrupted(Exception):
    """A one-shot execution that failed while a stop signal reached the server: Slurm signals every process of a
    step (this server's commands too), so its outcome may be the signal's, not the code's."""


class _SessionInterrupted(Exception):
    """`_Interrupted` in a session: the workspace holds what the command did before the signal."""


def priority_class(value: int, default: str = DEFAULT_CLASS) -> str:
    """The scheduler's class name for a request's PriorityClass (unset -> `default`)."""
    if value == pb2.PRIORITY_CLASS_UNSPECIFIED:
        return default
    if value not in pb2.PriorityClass.values():
        raise WorkspaceError(f"unknown priority class {value}; allowed: {', '.join(CLASSES)}")
    return pb2.PriorityClass.Name(value).lower()


class SandboxService(pb2_grpc.SandboxServicer):
    def __init__(self, runtime: Runtime, limiter: Limiter, pool: WorkspacePool, defaults: Limits,
                 maximum: Limits, capacity: int, max_queue: int, max_sessions: int, name: str,
                 snapshot_dir: Path, remembered: int = 10000, remembered_bytes: int = 256 * 2**20,
                 classes: Optional[dict[str, ClassPolicy]] = None, session_idle_timeout_s: float = 0.0) -> None:
        self.runtime, self.limiter, self.pool = runtime, limiter, pool
        self.defaults, self.maximum = defaults, maximum
        self.capacity, self.max_queue, self.max_sessions = capacity, max_queue, max_sessions
        self.name = name
        self.snapshot_dir = snapshot_dir
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        self.scheduler = FairScheduler(capacity, max_queue, classes)
        self._gate = SlotGate(self.scheduler)
        self.started = 0
        self.finished = 0
        self.draining = False
        self.address = ""
        self._results: collections.OrderedDict[tuple[str, str], asyncio.Future] = collections.OrderedDict()
        self._result_bytes: dict[tuple[str, str], int] = {}  # of the finished results in _results
        self._result_bytes_total = 0
        self._remembered, self._remembered_bytes = remembered, remembered_bytes
        self.sessions: dict[str, Session] = {}
        self.session_idle_timeout_s = session_idle_timeout_s
        self.sessions_reaped = 0
        self.stop_signal_at = -math.inf  # time.monotonic() of the last SIGTERM / SIGINT / SIGUSR1

    def note_stop_signal(self) -> None:
        self.stop_signal_at = time.monotonic()

    # -- admission and idempotency -----------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _slot(self, cls: str):
        """Wait for a slot of class `cls`; yields the ticket (its wait_s is the queue wait)."""
        async with contextlib.AsyncExitStack() as stack:
            try:
                ticket = await stack.enter_async_context(self._gate.slot(cls))
            except Refused as exc:
                raise _Busy(f"{self.name}: {exc}") from None
            self.started += 1
            try:
                yield ticket
            finally:
                self.finished += 1

    async def _once(self, method: str, key: str, context, work: Callable[[], Awaitable[Any]]):
        """Run `work` once per (method, key); duplicates (also concurrent ones) share its result.
        Refusals and errors are not remembered: a retry may succeed."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is draining")
        slot = (method, key)
        if key and slot in self._results:
            self._results.move_to_end(slot)
            return await self._mapped(asyncio.shield(self._results[slot]), context)
        future: Optional[asyncio.Future] = None
        if key:
            future = asyncio.get_running_loop().create_future()
            self._results[slot] = future
        try:
            result = await work()
        except BaseException as exc:
            if future is not None:
                if self._results.get(slot) is future:
                    del self._results[slot]
                future.set_exception(exc)
                future.exception()  # marks it retrieved
            return await self._mapped(_raise(exc), context)
        if future is not None:
            future.set_result(result)
            if self._results.get(slot) is future:
                self._result_bytes[slot] = result.ByteSize()
                self._result_bytes_total += self._result_bytes[slot]
                self._forget_oldest()
        return result

    def _forget_oldest(self) -> None:
        """Drop the oldest remembered results while more than `remembered` calls or
        `remembered_bytes` of replies are kept. The newest result always stays (a retry of the
        call that just finished must find it), and so do calls still running (their duplicates
        wait on them)."""
        while len(self._results) > self._remembered or self._result_bytes_total > self._remembered_bytes:
            oldest = next((slot for slot in self._results if slot in self._result_bytes), None)
            if oldest is None or len(self._result_bytes) == 1:
                return
            del self._results[oldest]
            self._result_bytes_total -= self._result_bytes.pop(oldest)

    @staticmethod
    async def _mapped(awaitable, context):
        """Await, turning the service's own errors into gRPC status codes."""
        try:
            return await awaitable
        except _Busy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except _Interrupted as exc:  # not remembered: the client's retry runs it again
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except _SessionInterrupted as exc:  # not remembered, not retried as is: the caller rebuilds the workspace
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except WorkspaceStateError as exc:  # not retried: the same call fails the same way again
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:  # a bad request: a path, limits (WorkspaceError is one too)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc).strip("'\""))

    # -- executions --------------------------------------------------------------------------
    def _result(self, outcome: Outcome):
        return pb2.ExecResult(
            exit_code=outcome.exit_code, signal=outcome.signal, termination=_TERMINATION[outcome.termination],
            stdout=outcome.stdout, stderr=outcome.stderr, stdout_truncated=outcome.stdout_truncated,
            stderr_truncated=outcome.stderr_truncated, message=outcome.message, server=self.name,
            usage=pb2.ResourceUsage(wall_time_s=outcome.wall_time_s, cpu_time_s=outcome.cpu_time_s,
                                    max_rss_bytes=outcome.max_rss_bytes), queue_wait_s=outcome.queue_wait_s)

    async def _run_in(self, workspace: Workspace, image: str, argv, stdin: bytes, env, limits: Limits,
                      cls: str) -> Outcome:
        try:
            command = self.runtime.command(image, list(argv), workspace.path, limits, dict(env))
        except RuntimeError_ as exc:
            return Outcome(exit_code=-1, termination=SETUP_ERROR, message=str(exc))
        async with self._slot(cls) as ticket:
            outcome = await run_confined(command, limits, self.limiter, stdin)
        return dataclasses.replace(outcome, queue_wait_s=ticket.wait_s)

    async def _one_shot(self, image: str, files, argv, stdin: bytes, env, limits: Limits, cls: str) -> Outcome:
        try:
            workspace = await asyncio.to_thread(self.pool.acquire, limits.disk_bytes, files)
        except WorkspaceError as exc:
            return Outcome(exit_code=-1, termination=SETUP_ERROR, message=str(exc))
        start = time.monotonic()
        try:
            outcome = await self._run_in(workspace, image, argv, stdin, env, limits, cls)
        finally:
            # run_confined has killed the run's processes by now; shielded so that a cancelled
            # call (its client went away) still empties or destroys its workspace
            await asyncio.shield(asyncio.to_thread(self.pool.release, workspace))
        if await self._signalled(outcome, start):
            raise _Interrupted(f"{self.name}: a stop signal came while the command ran ({_what(outcome)}); retry")
        return outcome

    async def _signalled(self, outcome: Outcome, start: float) -> bool:
        """Whether a command that started at `start` (time.monotonic()) failed while a stop signal reached the
        server: its failure may be the signal's."""
        if outcome.termination == "EXITED" and outcome.exit_code == 0:
            return False
        await asyncio.sleep(0.01)  # a stop signal that killed the command reaches this loop's handler now
        if self.stop_signal_at < start:
            return False
        logger.info("a stop signal came while a command ran (%s): refused", _what(outcome))
        return True

    def _limits(self, msg, base: Optional[Limits] = None) -> Limits:
        return (base or self.defaults).merged(limits_from_proto(msg), self.maximum)

    async def Execute(self, request, context):
        async def work():
            limits, cls = self._limits(request.limits), priority_class(request.priority_class)
            return self._result(await self._one_shot(request.image, request.files, request.argv, request.stdin,
                                                     request.env, limits, cls))
        return await self._once("Execute", request.idempotency_key, context, work)

    async def Verify(self, request, context):
        async def work():
            limits, cls = self._limits(request.limits), priority_class(request.priority_class)

            async def one(test):
                outcome = await self._one_shot(request.image, request.files, test.argv, b"", {}, limits, cls)
                passed = outcome.termination == "EXITED" and outcome.exit_code == test.expected_exit_code
                if passed and test.check_stdout:
                    passed = outcome.stdout.rstrip() == test.expected_stdout.rstrip()
                return pb2.TestOutcome(name=test.name, passed=passed, result=self._result(outcome))

            outcomes = await asyncio.gather(*(one(t) for t in request.tests))
            passed = sum(o.passed for o in outcomes)
            total = len(outcomes)
            return pb2.VerifyResult(reward=passed / total if total else 0.0, passed=passed, total=total,
                                    tests=outcomes, server=self.name)
        return await self._once("Verify", request.idempotency_key, context, work)

    # -- sessions ----------------------------------------------------------------------------
    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise KeyError(f"session {session_id!r} is not open on {self.name}")
        session.last_used = time.monotonic()
        return session

    async def Open(self, request, context):
        async def work():
            if len(self.sessions) >= self.max_sessions:
                raise _Busy(f"{self.name}: {len(self.sessions)} sessions open (max {self.max_sessions})")
            limits, cls = self._limits(request.limits), priority_class(request.priority_class)
            image = request.image or self.runtime.default_image()
            if image not in self.runtime.images():
                raise WorkspaceError(f"image {image!r} is not available; available: "
                                     f"{', '.join(self.runtime.images())}")
            workspace = await asyncio.to_thread(self.pool.acquire, limits.disk_bytes, request.files)
            session = Session(uuid.uuid4().hex, workspace, image, limits, cls)
            self.sessions[session.id] = session
            return pb2.SessionInfo(session_id=session.id, server=self.name)
        return await self._once("Open", request.idempotency_key, context, work)

    async def Exec(self, request, context):
        async def work():
            session = self._session(request.session_id)
            limits = self._limits(request.limits, session.limits)
            cls = priority_class(request.priority_class, session.priority_class)
            start = time.monotonic()
            async with session.use():
                outcome = await self._run_in(session.workspace, session.image, request.argv, request.stdin,
                                             request.env, limits, cls)
            if await self._signalled(outcome, start):
                raise _SessionInterrupted(f"{self.name}: a stop signal came while the command ran in session "
                                          f"{session.id} ({_what(outcome)}); the workspace holds what it did")
            return self._result(outcome)
        return await self._once("Exec", request.idempotency_key, context, work)

    async def ReadFile(self, request, context):
        async def work():
            session = self._session(request.session_id)
            limit = min(request.max_bytes or self.defaults.output_bytes, self.maximum.output_bytes)
            async with session.use():
                data, truncated, exists = await asyncio.to_thread(session.workspace.read, request.path, limit)
            return pb2.FileContent(content=data, truncated=truncated, exists=exists)
        return await self._once("ReadFile", "", context, work)

    async def WriteFile(self, request, context):
        async def work():
            session = self._session(request.session_id)
            async with session.use():
                n = await asyncio.to_thread(session.workspace.write, request.file.path, request.file.content,
                                            request.file.executable)
            return pb2.WriteFileResult(bytes_written=n)
        return await self._once("WriteFile", request.idempotency_key, context, work)

    async def Snapshot(self, request, context):
        async def work():
            session = self._session(request.session_id)
            async with session.use():
                data = await asyncio.to_thread(session.workspace.snapshot)
                snapshot_id = uuid.uuid4().hex
                path = self.snapshot_dir / f"{snapshot_id}.tar"
                await asyncio.to_thread(path.write_bytes, data)
                session.snapshots.append(path)
            return pb2.SnapshotInfo(snapshot_id=snapshot_id, size_bytes=len(data))
        return await self._once("Snapshot", request.idempotency_key, context, work)

    async def Restore(self, request, context):
        async def work():
            session = self._session(request.session_id)
            path = self.snapshot_dir / f"{Path(request.snapshot_id).name}.tar"
            async with session.use():
                try:
                    data = await asyncio.to_thread(path.read_bytes)
                except FileNotFoundError:
                    raise KeyError(f"snapshot {request.snapshot_id!r} does not exist on {self.name} (a snapshot "
                                   f"is deleted when the session that took it closes)") from None
                await asyncio.to_thread(session.workspace.restore, data)
            return pb2.SessionInfo(session_id=session.id, server=self.name)
        return await self._once("Restore", request.idempotency_key, context, work)

    async def Close(self, request, context):
        async def work():
            session = self.sessions.pop(request.session_id, None)
            if session is not None:
                async with session.lock:
                    await asyncio.to_thread(self._discard, session)
            return pb2.CloseResult()
        return await self._once("Close", request.idempotency_key, context, work)

    async def Health(self, request, context):
        classes = [pb2.ClassStats(name=name, **stats) for name, stats in self.scheduler.stats().items()]
        return pb2.HealthReply(serving=not self.draining, runtime=self.runtime.name, limiter=self.limiter.name,
                               capacity=self.capacity, running=self.scheduler.running, queued=self.scheduler.queued,
                               max_queue=self.max_queue, executions_started=self.started,
                               executions_finished=self.finished, sessions=len(self.sessions),
                               address=self.address, backpressure=self.scheduler.backpressure(), classes=classes,
                               sessions_reaped=self.sessions_reaped)

    async def reap_idle_sessions(self) -> int:
        """Close the sessions no call has used for session_idle_timeout_s: their client died or
        never closed them (a killed trainer or generator), and they would hold workspaces and
        count against --max-sessions for the server's lifetime. A session with a call in
        progress is never closed (it holds the session's lock). Returns how many were closed."""
        if self.session_idle_timeout_s <= 0:
            return 0
        now = time.monotonic()
        idle = [s for s in self.sessions.values()
                if now - s.last_used > self.session_idle_timeout_s and not s.lock.locked()]
        for session in idle:  # out of the table before the first await: no call can find it after this
            del self.sessions[session.id]
        for session in idle:
            logger.warning("closing session %s on %s: unused for %.0fs (--session-idle-timeout-s %g)", session.id,
                           self.name, now - session.last_used, self.session_idle_timeout_s)
            try:
                async with session.lock:
                    await asyncio.to_thread(self._discard, session)
            except Exception:  # one workspace that fails to go must not keep the others
                logger.exception("destroying the workspace of session %s failed", session.id)
        self.sessions_reaped += len(idle)
        return len(idle)

    async def close_all_sessions(self) -> None:
        for session_id in list(self.sessions):
            session = self.sessions.pop(session_id)
            await asyncio.to_thread(self._discard, session)

    def _discard(self, session: Session) -> None:
        """Destroy a closed session's workspace and delete its snapshots (restores are only
        ever into a session of this server; recovery elsewhere starts from the task's files)."""
        for path in session.snapshots:
            path.unlink(missing_ok=True)
        self.pool.destroy(session.workspace)


async def _reap_every(service: SandboxService, seconds: float) -> None:
    """Look for idle sessions four times per timeout (at most once a minute); nothing when it is 0."""
    if seconds <= 0:
        return
    while True:
        await asyncio.sleep(min(seconds, 60.0))
        try:
            await service.reap_idle_sessions()
        except Exception:  # whatever failed, later rounds still reap
            logger.exception("reaping idle sessions failed")


def _what(outcome: Outcome) -> str:
    return outcome.termination + (f", {outcome.message}" if outcome.message else "")


async def _raise(exc: BaseException):
    raise exc


def _parse_images(values: list[str]) -> dict[str, str]:
    images = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--image expects name=/path, got {value!r}")
        images[name] = path
    return images


def parse_class_values(text: str, cast: type, option: str) -> dict:
    """`training=4,build=1` -> {"training": 4.0, "build": 1.0}; names must be priority classes."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in CLASSES:
            raise SystemExit(f"{option} expects class=value pairs with classes from {', '.join(CLASSES)}, "
                             f"got {item!r}")
        try:
            out[name] = cast(value)
        except ValueError:
            raise SystemExit(f"{option}: {name}={value!r} is not a {cast.__name__}") from None
    return out


def class_policies(weights: str, quotas: str, max_queues: str) -> dict[str, ClassPolicy]:
    """Per-class scheduling policy from the --class-* options (unset: default weight, no own limits)."""
    w = {**DEFAULT_WEIGHTS, **parse_class_values(weights, float, "--class-weights")}
    q = parse_class_values(quotas, int, "--class-quota")
    m = parse_class_values(max_queues, int, "--class-max-queue")
    try:
        return {c: ClassPolicy(weight=w[c], quota=q.get(c, 0), max_queue=m.get(c, 0)) for c in CLASSES}
    except ValueError as exc:
        raise SystemExit(f"sandbox server: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_rl_sandbox.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:0", help="host:port or unix:/path (port 0 picks one)")
    p.add_argument("--advertise", default=None, help="address written to the discovery file (default: host:port)")
    p.add_argument("--runtime", default="bwrap", choices=["bwrap", "apptainer", "process"])
    p.add_argument("--image", action="append", default=[], help="name=/path (rootfs dir, SIF or sandbox dir)")
    p.add_argument("--apptainer-cmd", default="apptainer")
    p.add_argument("--allow-unisolated", action="store_true", help="required for --runtime process")
    p.add_argument("--allow-network", action="store_true", help="let requests turn the network on")
    p.add_argument("--limiter", default="auto", choices=["auto", "cgroup-v1", "cgroup-v2", "rlimit"])
    p.add_argument("--capacity", type=int, default=os.cpu_count() or 1, help="concurrent executions")
    p.add_argument("--max-queue", type=int, default=256, help="waiting executions before refusing")
    p.add_argument("--class-weights", default=",".join(f"{c}={w:g}" for c, w in DEFAULT_WEIGHTS.items()),
                   help="weighted fair queueing weights per priority class (unset classes keep their default)")
    p.add_argument("--class-quota", default="", help="most running executions per class, e.g. build=1,quality=1")
    p.add_argument("--class-max-queue", default="",
                   help="most waiting executions per class before refusing (default: --max-queue), e.g. build=64")
    p.add_argument("--max-sessions", type=int, default=512)
    p.add_argument("--session-idle-timeout-s", type=float, default=1800.0,
                   help="close sessions no call has used this long (a client that died never closes its "
                        "own); 0 keeps them until closed")
    p.add_argument("--prewarm", type=int, default=8, help="ready workspaces kept mounted")
    p.add_argument("--remember-bytes", type=int, default=256 * 2**20,
                   help="most bytes of replies kept for idempotent retries (the oldest are forgotten first)")
    p.add_argument("--work-dir", default=None, help="where workspaces live (default: a fresh temp dir)")
    p.add_argument("--run-dir", default=None, help="write the discovery file into <run-dir>/sandbox/")
    p.add_argument("--name", default=None, help="server name in results and the discovery file")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="grace period for running calls when draining (SIGTERM or SIGINT)")
    p.add_argument("--ignore-sigterm", action="store_true",
                   help="log SIGTERM and serve on; only SIGINT drains (a server the training job stops itself)")
    for field in dataclasses.fields(Limits):
        if field.name != "network":
            p.add_argument(f"--default-{field.name.replace('_', '-')}", type=type(field.default),
                           default=field.default)
    return p


async def serve(args: argparse.Namespace, ready: Optional[asyncio.Event] = None) -> None:
    classes = class_policies(args.class_weights, args.class_quota, args.class_max_queue)
    if args.session_idle_timeout_s < 0:
        raise SystemExit(f"--session-idle-timeout-s {args.session_idle_timeout_s:g} must be >= 0 (0: never)")
    if args.runtime == "process":
        runtime = make_runtime("process", allow_unisolated=args.allow_unisolated)
    elif args.runtime == "apptainer":
        runtime = make_runtime("apptainer", images=_parse_images(args.image), apptainer_cmd=args.apptainer_cmd)
    else:
        runtime = make_runtime("bwrap", images=_parse_images(args.image))
    try:
        defaults = Limits(**{f.name: getattr(args, f"default_{f.name}") for f in dataclasses.fields(Limits)
                             if f.name != "network"})
    except ValueError as exc:
        raise SystemExit(f"sandbox server: --default-*: {exc}") from None
    limiter = Limiter() if args.limiter == "rlimit" else detect_limiter(args.limiter)
    if limiter.name == "rlimit":
        logger.warning("limiter rlimit (no writable cgroup): memory is bounded as virtual memory (RLIMIT_AS) and "
                       "processes per user (RLIMIT_NPROC); setsid / double-forked daemons are NOT killed when a run "
                       "ends (outside a PID namespace: runtime process), and CPU time and peak memory are not "
                       "measured")
    maximum = dataclasses.replace(MAXIMUM, network=args.allow_network)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="megatron-rl-sandbox-"))
    pool = WorkspacePool(work_dir / "workspaces", defaults.disk_bytes, prewarm=args.prewarm)
    if not pool.use_tmpfs:
        logger.warning("workspaces are plain directories (not root: no tmpfs mount): the disk limit is NOT enforced "
                       "per workspace, only per file (RLIMIT_FSIZE)")
    name = args.name or f"{socket.gethostname()}-{os.getpid()}"
    service = SandboxService(runtime, limiter, pool, defaults, maximum, args.capacity, args.max_queue,
                             args.max_sessions, name, work_dir / "snapshots", remembered_bytes=args.remember_bytes,
                             classes=classes,
                             session_idle_timeout_s=args.session_idle_timeout_s)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 * 2**20),
                                      ("grpc.max_send_message_length", 256 * 2**20)])
    pb2_grpc.add_SandboxServicer_to_server(service, server)
    port = server.add_insecure_port(args.address)
    if args.address.startswith("unix:"):
        address = args.address
    else:
        host = args.address.rsplit(":", 1)[0]
        address = f"{socket.gethostname() if host in ('0.0.0.0', '[::]') else host}:{port}"
    service.address = args.advertise or address
    await server.start()
    discovery = _write_discovery(args.run_dir, name, service.address, runtime.name) if args.run_dir else None
    logger.info("sandbox server %s serving on %s (runtime %s, limiter %s, workspace quota %s, capacity %d, "
                "classes %s)", name, service.address, runtime.name, limiter.name, pool.quota, args.capacity,
                {c: dataclasses.asdict(p) for c, p in classes.items()})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        service.note_stop_signal()  # the commands running now may have got it too
        if signum == signal.SIGTERM and args.ignore_sigterm:
            logger.warning("got SIGTERM: serving on (--ignore-sigterm: the job that started this server stops it); "
                           "SIGINT drains")
        elif signum != signal.SIGUSR1:
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        loop.add_signal_handler(sig, on_signal, sig)
    faulthandler.register(signal.SIGUSR1, chain=True)  # `kill -USR1 <pid>` dumps every thread's stack to stderr
    print(json.dumps({"address": service.address, "name": name}), flush=True)  # ready: signals handled too
    reaper = asyncio.ensure_future(_reap_every(service, args.session_idle_timeout_s / 4))
    if ready is not None:
        ready.set()
    await stop.wait()
    reaper.cancel()
    logger.info("draining: refusing new calls, waiting up to %.0fs for running ones", args.drain_s)
    service.draining = True
    if discovery is not None:
        discovery.unlink(missing_ok=True)
    await server.stop(grace=args.drain_s)
    await service.close_all_sessions()
    pool.close()
    logger.info("sandbox server %s stopped", name)


def _write_discovery(run_dir: str, name: str, address: str, runtime: str) -> Path:
    directory = Path(run_dir) / "sandbox"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"name": name, "address": address, "runtime": runtime, "pid": os.getpid(),
                               "started": time.time()}))
    os.replace(tmp, path)
    return path


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox %(levelname)s %(message)s")
    try:
        asyncio.run(serve(args))
    except RuntimeError as exc:
        raise SystemExit(f"sandbox server: {exc}") from None


if __name__ == "__main__":
    main()
