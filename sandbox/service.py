"""The sandbox gRPC service (asyncio): what every call does; server.py runs it as a process.

- Bounded concurrency: at most `capacity` executions run at once; up to `max_queue` more
  wait; beyond that a call is refused at once with RESOURCE_EXHAUSTED (back-pressure the
  client turns into waiting or failover), never queued without bound.
- Scheduling: every execution has a priority class (training, evaluation, quality, build);
  free slots go by weighted fair queueing across classes, with per-class quotas and queue
  bounds (`scheduler.py`). Health reports queue depth, waits and back-pressure per class.
- Idempotency: the result of every mutating call is remembered under (method, key); a retry
  with the same key, even while the first is still running, gets the same result (or the same
  error) and the command never runs twice (except after a stop signal, below). Only what
  provably did not start is forgotten: a refusal at admission (RESOURCE_EXHAUSTED) or while
  draining. The most recent results are kept, up to `--remember-bytes` of replies (outputs
  included) and 10,000 calls.
- Root: a server running as root runs every command as an unprivileged user (`--sandbox-uid`,
  `--sandbox-gid`, default 65534, nobody) that owns the workspaces; sandboxed code never runs
  under host uid 0 (executor.py).
- Messages: requests and replies are bounded by `--max-message-bytes` (the client uses the same
  default); a reply's outputs are cut to fit it (`*_truncated`, with the sizes the run wrote),
  and an oversized request is refused by gRPC with RESOURCE_EXHAUSTED naming the limit.
  Malformed fields get INVALID_ARGUMENT (validate.py).
- Sessions keep a workspace between calls for multi-turn agents; snapshots are tar files that
  live as long as the session that took them.
- File I/O on workspaces runs in worker threads, never on the event loop: a workspace is
  written by untrusted code, and one slow or blocking file must not stall every other call.
- Slurm's signals reach the commands the server runs too (every process of the step). A
  one-shot execution (Execute, Verify) that fails while a stop signal (SIGTERM, SIGINT, SIGUSR1)
  reaches the server is no result: refused with UNAVAILABLE and not remembered, so the client's
  retry (same key) runs it again, here or on another server, instead of scoring the signal as
  the code's failure. A session's command is not run again (what it did to the workspace before
  the signal stays): refused with ABORTED and not remembered; the client raises SessionInterrupted
  and the environment rebuilds its workspace (restore a snapshot, replay its calls) before it
  runs the command again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import grpc

from megatron_rl_sandbox import validate
from megatron_rl_sandbox.executor import SETUP_ERROR, Outcome, RunAs, run_confined
from megatron_rl_sandbox.limits import Limiter, Limits
from megatron_rl_sandbox.proto import DEFAULT_MESSAGE_BYTES
from megatron_rl_sandbox.proto import load as load_proto
from megatron_rl_sandbox.runtimes import Runtime, RuntimeError_
from megatron_rl_sandbox.scheduler import CLASSES, DEFAULT_CLASS, ClassPolicy, FairScheduler, Refused, SlotGate, Ticket
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
                 classes: Optional[dict[str, ClassPolicy]] = None, session_idle_timeout_s: float = 0.0,
                 run_as: Optional[RunAs] = None, max_message_bytes: int = DEFAULT_MESSAGE_BYTES) -> None:
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
        self.run_as = run_as
        # what a reply may take: the message limit less room for its framing
        self.reply_output_bytes = max(2**16, max_message_bytes - 2**16)

    def note_stop_signal(self) -> None:
        self.stop_signal_at = time.monotonic()

    # -- admission and idempotency -----------------------------------------------------------
    def _admit(self, cls: str, count: int = 1) -> list[Ticket]:
        """Admit `count` executions of class `cls` together, or none (_Busy; ValueError when they never fit)."""
        try:
            return self._gate.admit(cls, count)
        except Refused as exc:
            raise _Busy(f"{self.name}: {exc}") from None

    @contextlib.asynccontextmanager
    async def _held(self, ticket: Ticket):
        """Wait for `ticket`'s slot and hold it (its wait_s is the queue wait)."""
        async with self._gate.hold(ticket):
            self.started += 1
            try:
                yield ticket
            finally:
                self.finished += 1

    def _drop(self, tickets: list[Ticket]) -> None:
        """Give back the admitted tickets that never ran (a test that could not start, a cancelled call)."""
        for ticket in tickets:
            if not ticket.held:
                self._gate.drop(ticket)

    async def _once(self, method: str, key: str, context, work: Callable[[], Awaitable[Any]]):
        """Run `work` once per (method, key); duplicates (also concurrent ones) share its result, or its
        error: a call that failed after its command may have started is never run again under its key.
        Forgotten, so that a retry runs it: a refusal before anything started (_Busy), a stop signal's
        interruption (see the module doc) and a cancellation (the client went away; its run was killed)."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is draining")
        try:
            validate.check_key(key)
        except ValueError as exc:
            return await self._mapped(_raise(exc), context)
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
                forget = isinstance(exc, (_Busy, _Interrupted, _SessionInterrupted, asyncio.CancelledError))
                if forget and self._results.get(slot) is future:
                    del self._results[slot]
                elif self._results.get(slot) is future:  # remembered: a retry gets this error, never a rerun
                    self._result_bytes[slot] = 1024
                    self._result_bytes_total += 1024
                    self._forget_oldest()
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
        except Exception as exc:  # the server's own fault: final (it may have run), never the request echoed
            logger.exception("internal error in a call")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error on the sandbox server: "
                                                          f"{type(exc).__name__}")

    # -- executions --------------------------------------------------------------------------
    def _result(self, outcome: Outcome):
        return pb2.ExecResult(
            exit_code=outcome.exit_code, signal=outcome.signal, termination=_TERMINATION[outcome.termination],
            stdout=outcome.stdout, stderr=outcome.stderr, stdout_truncated=outcome.stdout_truncated,
            stderr_truncated=outcome.stderr_truncated, stdout_size=outcome.stdout_size,
            stderr_size=outcome.stderr_size, message=_capped(outcome.message), server=self.name,
            usage=pb2.ResourceUsage(wall_time_s=outcome.wall_time_s, cpu_time_s=outcome.cpu_time_s,
                                    max_rss_bytes=outcome.max_rss_bytes), queue_wait_s=outcome.queue_wait_s)

    def _fit(self, results: list) -> None:
        """Cut the outputs of `results` (ExecResults of one reply) so that the reply fits
        `reply_output_bytes`: the largest streams are cut first, each to the same length (water-filling);
        a cut stream is flagged `*_truncated` and keeps its size in `*_size`."""
        streams = [(r, name) for r in results for name in ("stdout", "stderr")]
        sizes = sorted(len(getattr(r, name)) for r, name in streams)
        # everything else in the reply (messages, usage, names, framing), with room for the per-field overhead
        other = sum(r.ByteSize() for r in results) - sum(sizes) + 64 * len(results)
        if sum(sizes) + other <= self.reply_output_bytes:
            return
        budget, cap = max(0, self.reply_output_bytes - other), 0
        for i, size in enumerate(sizes):  # the largest cap at which the streams still fit
            share = budget // (len(sizes) - i)
            if size > share:
                cap = share
                break
            budget -= size
        for r, name in streams:
            if len(getattr(r, name)) > cap:
                setattr(r, name, getattr(r, name)[:cap])
                setattr(r, f"{name}_truncated", True)

    async def _run_in(self, workspace: Workspace, image: str, argv, stdin: bytes, env, limits: Limits,
                      cls: str, ticket: Optional[Ticket] = None) -> Outcome:
        """Run argv in `workspace` in a slot of class `cls` (or of the admitted `ticket`)."""
        try:
            command = self.runtime.command(image, list(argv), workspace.path, limits, dict(env))
        except RuntimeError_ as exc:
            return Outcome(exit_code=-1, termination=SETUP_ERROR, message=str(exc))
        if ticket is None:
            ticket = self._admit(cls)[0]
        async with self._held(ticket):
            outcome = await run_confined(command, limits, self.limiter, stdin, self.run_as, workspace.full)
        return dataclasses.replace(outcome, queue_wait_s=ticket.wait_s)

    async def _acquire(self, disk_bytes: int, files) -> Workspace:
        """A new workspace with `files`; one made for a call that was cancelled meanwhile is released."""
        making = asyncio.ensure_future(asyncio.to_thread(self.pool.acquire, disk_bytes, files))
        try:
            return await asyncio.shield(making)
        except asyncio.CancelledError:
            def release(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    asyncio.ensure_future(asyncio.to_thread(self.pool.release, done.result()))
            making.add_done_callback(release)
            raise

    async def _one_shot(self, image: str, files, argv, stdin: bytes, env, limits: Limits, cls: str,
                        ticket: Optional[Ticket] = None) -> Outcome:
        try:
            workspace = await self._acquire(limits.disk_bytes, files)
        except (WorkspaceError, OSError) as exc:
            return Outcome(exit_code=-1, termination=SETUP_ERROR, message=str(exc))
        start = time.monotonic()
        try:
            outcome = await self._run_in(workspace, image, argv, stdin, env, limits, cls, ticket)
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
            validate.check_image(request.image)
            validate.check_files(request.files)
            validate.check_command(request.argv, request.env)
            result = self._result(await self._one_shot(request.image, request.files, request.argv, request.stdin,
                                                       request.env, limits, cls))
            self._fit([result])
            return result
        return await self._once("Execute", request.idempotency_key, context, work)

    async def Verify(self, request, context):
        """The tests are admitted as a whole (all run or wait, or the call is refused before any ran)
        and each runs once."""
        async def work():
            limits, cls = self._limits(request.limits), priority_class(request.priority_class)
            validate.check_image(request.image)
            validate.check_files(request.files)
            for test in request.tests:
                validate.check_command(test.argv, {})
            tickets = self._admit(cls, len(request.tests)) if request.tests else []

            async def one(test, ticket):
                try:
                    outcome = await self._one_shot(request.image, request.files, test.argv, b"", {}, limits, cls,
                                                   ticket)
                finally:  # a test that ended without taking its slot (it could not start) gives it back now
                    if not ticket.held:
                        ticket.held = True
                        self._gate.drop(ticket)
                passed = outcome.termination == "EXITED" and outcome.exit_code == test.expected_exit_code
                if passed and test.check_stdout:
                    passed = outcome.stdout.rstrip() == test.expected_stdout.rstrip()
                return pb2.TestOutcome(name=test.name, passed=passed, result=self._result(outcome))

            try:  # every test ends before the call does: no test is left running (or waiting) behind it
                outcomes = await asyncio.gather(*(one(t, k) for t, k in zip(request.tests, tickets)),
                                                return_exceptions=True)
            finally:
                self._drop(tickets)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise failed[0]
            self._fit([o.result for o in outcomes])
            passed = sum(o.passed for o in outcomes)
            total = len(outcomes)
            return pb2.VerifyResult(reward=passed / total if total else 0.0, passed=passed, total=total,
                                    tests=outcomes, server=self.name)
        return await self._once("Verify", request.idempotency_key, context, work)

    # -- sessions ----------------------------------------------------------------------------
    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(validate.check_id(session_id, "session_id"))
        if session is None:
            raise KeyError(f"session {session_id!r} is not open on {self.name}")
        session.last_used = time.monotonic()
        return session

    async def Open(self, request, context):
        async def work():
            if len(self.sessions) >= self.max_sessions:
                raise _Busy(f"{self.name}: {len(self.sessions)} sessions open (max {self.max_sessions})")
            limits, cls = self._limits(request.limits), priority_class(request.priority_class)
            validate.check_image(request.image)
            validate.check_files(request.files)
            image = request.image or self.runtime.default_image()
            if image not in self.runtime.images():
                raise WorkspaceError(f"image {image!r} is not available; available: "
                                     f"{', '.join(self.runtime.images())}")
            workspace = await self._acquire(limits.disk_bytes, request.files)
            session = Session(uuid.uuid4().hex, workspace, image, limits, cls)
            self.sessions[session.id] = session
            return pb2.SessionInfo(session_id=session.id, server=self.name)
        return await self._once("Open", request.idempotency_key, context, work)

    async def Exec(self, request, context):
        async def work():
            session = self._session(request.session_id)
            limits = self._limits(request.limits, session.limits)
            cls = priority_class(request.priority_class, session.priority_class)
            validate.check_command(request.argv, request.env)
            start = time.monotonic()
            async with session.use():
                outcome = await self._run_in(session.workspace, session.image, request.argv, request.stdin,
                                             request.env, limits, cls)
            if await self._signalled(outcome, start):
                raise _SessionInterrupted(f"{self.name}: a stop signal came while the command ran in session "
                                          f"{session.id} ({_what(outcome)}); the workspace holds what it did")
            result = self._result(outcome)
            self._fit([result])
            return result
        return await self._once("Exec", request.idempotency_key, context, work)

    async def ReadFile(self, request, context):
        async def work():
            session = self._session(request.session_id)
            if request.max_bytes < 0:
                raise ValueError(f"max_bytes {request.max_bytes} must be >= 0 (0: the server's default)")
            limit = min(request.max_bytes or self.defaults.output_bytes, self.maximum.output_bytes,
                        self.reply_output_bytes)
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
                snapshot_id = uuid.uuid4().hex
                path = self.snapshot_dir / f"{snapshot_id}.tar"
                size = await asyncio.to_thread(session.workspace.snapshot, path)
                session.snapshots.append(path)
            return pb2.SnapshotInfo(snapshot_id=snapshot_id, size_bytes=size)
        return await self._once("Snapshot", request.idempotency_key, context, work)

    async def Restore(self, request, context):
        async def work():
            session = self._session(request.session_id)
            path = self.snapshot_dir / f"{validate.check_id(request.snapshot_id, 'snapshot_id')}.tar"
            async with session.use():
                if not path.exists():
                    raise KeyError(f"snapshot {request.snapshot_id!r} does not exist on {self.name} (a snapshot "
                                   f"is deleted when the session that took it closes)")
                await asyncio.to_thread(session.workspace.restore, path)
            return pb2.SessionInfo(session_id=session.id, server=self.name)
        return await self._once("Restore", request.idempotency_key, context, work)

    async def Close(self, request, context):
        async def work():
            session = self.sessions.pop(validate.check_id(request.session_id, "session_id"), None)
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


def _capped(message: str, limit: int = 4096) -> str:
    """A result's message at most `limit` characters (a setup error's message is the runtime's stderr)."""
    return message if len(message) <= limit else message[:limit] + f"... ({len(message)} characters)"


def _what(outcome: Outcome) -> str:
    return outcome.termination + (f", {outcome.message}" if outcome.message else "")


async def _raise(exc: BaseException):
    raise exc
