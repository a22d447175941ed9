"""Async client for one or more sandbox servers: connection reuse, a deadline per call,
retries with the same idempotency key, failover across servers and load-aware routing.

Rule for callers in the training loop: never wait on a sandbox inside a collective. A call
always returns within its deadline; when no server could answer in time the result says
so (termination TIMEOUT, or reward 0 with a message), so a late reward becomes a timeout
reward, not a hung job.

Guarantee: a retry reuses the idempotency key, so a server never runs one request twice
(except a one-shot command that a stop signal interrupted: service.py); after a server dies
mid-call the request runs on another server, and the caller gets exactly one result. Only a
call that provably did not run is retried: refused at admission (RESOURCE_EXHAUSTED) or not
served (UNAVAILABLE: unreachable, draining, dead, or interrupted by a stop signal). Any other
error is final: INVALID_ARGUMENT and the like raise; a server's own fault (INTERNAL, UNKNOWN), a
timed-out attempt, or a reply over the message limit come back in band as "no verdict" (TIMEOUT
or SETUP_ERROR with no `server`), never as a second run.

Messages: `max_message_bytes` (default the server's, 256 MiB) bounds requests and replies on
this side; a request over it is refused here at once with RESOURCE_EXHAUSTED naming the limit.

Scheduling: every call carries a priority class (the client's default unless given; session
calls inherit the session's). `backpressure()` is the servers' queue fill, for a rollout
scheduler to slow down before calls get refused; `stats()` / `metrics()` give the wait each
class saw, for the trainer's logs.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import grpc

from megatron_rl_sandbox.proto import DEFAULT_MESSAGE_BYTES
from megatron_rl_sandbox.proto import load as load_proto
from megatron_rl_sandbox.scheduler import CLASSES, DEFAULT_CLASS, check_class

pb2, pb2_grpc = load_proto()
logger = logging.getLogger(__name__)

# How long a replaced channel (`_Server.reconnect`) stays open for the calls still on it; it refuses connections,
# so they end at once, unless the server came back under them.
RETIRE_GRACE_S = 120.0
# The codes that prove the call did not run: refused at admission, or not served at all.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Final, and not the request's fault: reported in band (no verdict) by execute / verify.
_NO_VERDICT = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.DATA_LOSS}


def _too_large(exc: grpc.aio.AioRpcError) -> bool:
    """RESOURCE_EXHAUSTED from gRPC's message-size check (a reply or request over a limit): final, unlike
    the server's admission refusals, since the same message is too large again."""
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (exc.details() or "")


def _reply_lost(exc: grpc.aio.AioRpcError) -> bool:
    """A reply over a message limit (the server ran the call: "Sent message larger than max" on the server,
    or this client's receive limit), as opposed to a request the server's gRPC refused ("SERVER: Received
    message larger than max ...": nothing ran)."""
    details = exc.details() or ""
    return _too_large(exc) and ("Sent message" in details or not details.startswith("SERVER"))


class SandboxUnavailable(Exception):
    """No server could serve a call that has no in-band way to report failure (sessions)."""


class SessionInterrupted(SandboxUnavailable):
    """A session's command failed while a stop signal reached its server (Slurm signals every process of a
    step, the commands too): its result may be the signal's, and the workspace holds what the command did
    before it. Not retried as is; rebuild the workspace (restore a snapshot, replay) and run it again."""


def discover(run_dir: str | Path) -> list[str]:
    """Addresses of the servers that registered under `<run_dir>/sandbox/`."""
    directory = Path(run_dir) / "sandbox"
    if not directory.is_dir():
        return []
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            out.append(json.loads(path.read_text())["address"])
        except (OSError, ValueError, KeyError):
            continue
    return out


def prune_unreachable(run_dir: str | Path, timeout_s: float = 3.0) -> list[str]:
    """Remove the discovery files under `<run_dir>/sandbox/` whose server does not accept a
    connection within `timeout_s` (left by a server that was killed: a run started again in the
    same directory would otherwise send every verification to it and score 0); returns the
    addresses removed."""
    removed = []
    for path in sorted((Path(run_dir) / "sandbox").glob("*.json")):
        try:
            address = json.loads(path.read_text())["address"]
        except (OSError, ValueError, KeyError):
            continue
        channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            path.unlink(missing_ok=True)
            removed.append(address)
            logger.warning("removed the discovery file %s: no sandbox server answers at %s", path.name, address)
        finally:
            channel.close()
    return removed


def make_files(files: Mapping[str, bytes | str] | Iterable[Any]) -> list:
    if isinstance(files, Mapping):
        return [pb2.File(path=p, content=c.encode() if isinstance(c, str) else c) for p, c in files.items()]
    return list(files)


def make_limits(limits: Optional[Mapping[str, Any]]):
    return pb2.Limits(**(limits or {}))


def class_value(name: str) -> int:
    """The PriorityClass enum value of a class name ("training", "evaluation", "quality", "build")."""
    return pb2.PriorityClass.Value(check_class(name.lower()).upper())


class _ClassWaits:
    """What one priority class saw from this client, over the last `window` calls."""

    def __init__(self, window: int = 1024) -> None:
        self.calls = self.timeouts = self.refused = 0
        self.latency: collections.deque = collections.deque(maxlen=window)
        self.wait: collections.deque = collections.deque(maxlen=window)
        self.server_wait: collections.deque = collections.deque(maxlen=window)

    def record(self, latency_s: float, run_s: Optional[float], server_wait_s: Optional[float]) -> None:
        """`run_s`: execution time the server reported (None: no reply, the whole call was waiting)."""
        self.calls += 1
        self.latency.append(latency_s)
        self.wait.append(max(0.0, latency_s - (run_s or 0.0)))
        if run_s is None:
            self.timeouts += 1
        if server_wait_s is not None:
            self.server_wait.append(server_wait_s)

    def summary(self) -> dict[str, float]:
        def mean(xs) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        ordered = sorted(self.wait)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else 0.0
        return {"calls": self.calls, "timeouts": self.timeouts, "refused": self.refused,
                # what the means and maxima are over: the last `window` calls (and their server-reported waits)
                "recent_calls": len(self.latency), "recent_server_waits": len(self.server_wait),
                "latency_mean_s": mean(self.latency), "latency_max_s": max(self.latency, default=0.0),
                "wait_mean_s": mean(self.wait), "wait_p95_s": p95, "wait_max_s": max(self.wait, default=0.0),
                "server_wait_mean_s": mean(self.server_wait),
                "server_wait_max_s": max(self.server_wait, default=0.0)}


class _Server:
    def __init__(self, address: str, max_message_bytes: int = DEFAULT_MESSAGE_BYTES) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        self._connect()
        self.healthy = True
        self.load = 0.0
        self.reply = None  # the last HealthReply
        self.checked = 0.0
        self.down_until = 0.0
        self.unreachable_since: Optional[float] = None  # refusing connections since then (None: reachable)

    def _connect(self) -> None:
        self.retiring: set[asyncio.Task] = getattr(self, "retiring", set())  # old channels closing (`reconnect`)
        self.channel = grpc.aio.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            # its own connections: channels to one address share them (and their reconnect backoff) otherwise
            ("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb2_grpc.SandboxStub(self.channel)

    async def reconnect(self) -> None:
        """A fresh channel: a server back on this address (a restarted sandbox step) is used at the next call.
        The old channel, after refused connections, waits out gRPC's reconnect backoff (growing to minutes),
        and every call on it fails at once meanwhile. It is closed in the background once the calls still on it
        have ended (`RETIRE_GRACE_S` at most): closed at once, it cancelled them, and a concurrent call of
        another coroutine raised CancelledError instead of failing over (CI saw a verification batch crash)."""
        old = self.channel
        self._connect()
        task = asyncio.get_running_loop().create_task(old.close(grace=RETIRE_GRACE_S))
        self.retiring.add(task)
        task.add_done_callback(self.retiring.discard)

    def reachable(self, yes: bool) -> None:
        if yes:
            self.unreachable_since = None
        elif self.unreachable_since is None:
            self.unreachable_since = time.monotonic()


class SandboxClient:
    # A session lives on one server; when that server refuses connections this many times in a
    # row (~1.5 s with the backoff below), its calls fail at once instead of at their deadline.
    PINNED_UNREACHABLE_ATTEMPTS = 5
    # When every server has refused connections for this long (they are gone, e.g. a sandbox step that
    # died), calls fail at once rather than at their deadline: no verdict, counted by the caller. The
    # health check, every health_interval_s, notices a server that answers again.
    ALL_UNREACHABLE_S = 10.0

    def __init__(self, addresses: Sequence[str], deadline_s: float = 120.0, attempt_timeout_s: Optional[float] = None,
                 health_interval_s: float = 2.0, priority_class: str = DEFAULT_CLASS,
                 max_message_bytes: int = DEFAULT_MESSAGE_BYTES) -> None:
        if not addresses:
            raise ValueError("SandboxClient needs at least one server address")
        self.max_message_bytes = max_message_bytes
        self.servers = [_Server(a, max_message_bytes) for a in addresses]
        self.deadline_s = deadline_s
        self.attempt_timeout_s = attempt_timeout_s
        self.health_interval_s = health_interval_s
        class_value(priority_class)  # validates the name
        self.priority_class = priority_class.lower()
        self._waits = {c: _ClassWaits() for c in CLASSES}

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, **kwargs: Any) -> "SandboxClient":
        addresses = discover(run_dir)
        if not addresses:
            raise ValueError(f"no sandbox server registered under {Path(run_dir) / 'sandbox'}")
        return cls(addresses, **kwargs)

    async def close(self) -> None:
        for server in self.servers:
            await server.channel.close()
            if server.retiring:  # old channels: their calls have ended with this client's use
                await asyncio.gather(*server.retiring, return_exceptions=True)

    async def __aenter__(self) -> "SandboxClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- routing -----------------------------------------------------------------------------
    async def _refresh(self, server: _Server) -> None:
        now = time.monotonic()
        if now - server.checked < self.health_interval_s:
            return
        server.checked = now
        try:
            if server.unreachable_since is not None:  # a real connection attempt, not the old channel's backoff
                await server.reconnect()
            reply = await server.stub.Health(pb2.HealthRequest(), timeout=2.0)
            server.healthy = reply.serving
            server.load = (reply.running + reply.queued) / max(1, reply.capacity)
            server.reply = reply
            server.reachable(True)
        except grpc.aio.AioRpcError as exc:
            server.healthy = False
            server.reply = None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                server.reachable(False)

    async def _ranked(self) -> list[_Server]:
        await asyncio.gather(*(self._refresh(s) for s in self.servers))
        now = time.monotonic()
        usable = [s for s in self.servers if s.healthy and s.down_until <= now]
        others = [s for s in self.servers if s not in usable]
        random.shuffle(usable)
        usable.sort(key=lambda s: s.load)
        return usable + others

    def _all_unreachable_s(self) -> Optional[float]:
        """How long every server has refused connections, once that is at least ALL_UNREACHABLE_S; else None."""
        since = [s.unreachable_since for s in self.servers]
        if any(t is None for t in since):
            return None
        gone = time.monotonic() - max(since)
        return gone if gone >= self.ALL_UNREACHABLE_S else None

    async def _call(self, method: str, request, deadline_s: Optional[float], pinned: Optional[_Server] = None,
                    cls: str = DEFAULT_CLASS):
        """Try servers in order of health and load until one answers or the deadline passes."""
        size = request.ByteSize()
        if size > self.max_message_bytes:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       f"{method}: the request is {size} bytes, larger than the message limit of "
                                       f"{self.max_message_bytes} bytes (max_message_bytes; the server's "
                                       f"--max-message-bytes)")
        deadline = time.monotonic() + (deadline_s or self.deadline_s)
        last_error: Optional[BaseException] = None
        attempt = unreachable = 0
        while time.monotonic() < deadline:
            if unreachable >= self.PINNED_UNREACHABLE_ATTEMPTS:  # the session's server is gone: fail fast
                raise asyncio.TimeoutError(f"{method}: the session's server {pinned.address} is unreachable")
            candidates = [pinned] if pinned is not None else await self._ranked()
            if pinned is None and (gone := self._all_unreachable_s()) is not None:
                raise asyncio.TimeoutError(f"{method}: no sandbox server has accepted a connection for {gone:.0f}s "
                                           f"({', '.join(s.address for s in self.servers)}); not waiting for the "
                                           "deadline")
            for server in candidates:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                timeout = min(remaining, self.attempt_timeout_s or remaining)
                try:
                    result = await getattr(server.stub, method)(request, timeout=timeout)
                    server.healthy = True
                    server.reachable(True)
                    return result, server
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is None or task.cancelling():
                        raise  # this task is being cancelled: not the call's to swallow
                    # the call was cancelled under it (its channel closed): as a server that did not answer
                    server.healthy = False
                    logger.debug("%s on %s was cancelled locally; trying the next server", method, server.address)
                    continue
                except grpc.aio.AioRpcError as exc:
                    last_error = exc
                    code = exc.code()
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # it may be running still: not tried again
                        raise asyncio.TimeoutError(f"{method} on {server.address}: no reply within the "
                                                   f"deadline") from None
                    if code not in _RETRYABLE or _too_large(exc):
                        raise
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self._waits[cls].refused += 1
                    if code == grpc.StatusCode.UNAVAILABLE:
                        server.healthy = False
                        server.reachable(False)
                        server.down_until = time.monotonic() + 1.0
                        server.checked = 0.0
                        if pinned is not None:
                            unreachable += 1
                    logger.debug("%s on %s failed (%s); trying the next server", method, server.address, code)
            attempt += 1
            await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0, max(0.0, deadline - time.monotonic())))
        why = last_error.code().name if isinstance(last_error, grpc.aio.AioRpcError) else "no reply"
        raise asyncio.TimeoutError(f"{method}: no sandbox server answered within the deadline ({why})")

    # -- one-shot calls ----------------------------------------------------------------------
    def _class(self, priority_class: Optional[str]) -> str:
        return check_class(priority_class.lower()) if priority_class else self.priority_class

    async def _exec_call(self, method: str, request, deadline_s: Optional[float], cls: str,
                         pinned: Optional[_Server] = None):
        """An Execute/Exec call, its wait recorded under `cls`; raises asyncio.TimeoutError."""
        start = time.monotonic()
        try:
            result = (await self._call(method, request, deadline_s, pinned, cls))[0]
        except asyncio.TimeoutError:
            self._waits[cls].record(time.monotonic() - start, None, None)
            raise
        self._waits[cls].record(time.monotonic() - start, result.usage.wall_time_s, result.queue_wait_s)
        return result

    async def execute(self, argv: Sequence[str], files: Mapping[str, bytes | str] | Iterable[Any] = (),
                      *, image: str = "", stdin: bytes = b"", env: Optional[Mapping[str, str]] = None,
                      limits: Optional[Mapping[str, Any]] = None, key: Optional[str] = None,
                      deadline_s: Optional[float] = None, priority_class: Optional[str] = None):
        """Run `argv` in a fresh workspace; always returns an ExecResult (TIMEOUT if nobody answered).
        `priority_class`: training, evaluation, quality or build (default: the client's)."""
        cls = self._class(priority_class)
        request = pb2.ExecuteRequest(idempotency_key=key or uuid.uuid4().hex, image=image, files=make_files(files),
                                     argv=list(argv), stdin=stdin, env=dict(env or {}), limits=make_limits(limits),
                                     priority_class=class_value(cls))
        try:
            return await self._exec_call("Execute", request, deadline_s, cls)
        except asyncio.TimeoutError as exc:
            return pb2.ExecResult(exit_code=-1, termination=pb2.TIMEOUT, message=str(exc))
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _NO_VERDICT and not _reply_lost(exc):
                raise
            logger.warning("Execute failed for good, not retried (it may have run): %s: %s", exc.code().name,
                           exc.details())
            return pb2.ExecResult(exit_code=-1, termination=pb2.SETUP_ERROR,
                                  message=f"no verdict: {exc.code().name}: {exc.details()}")

    async def verify(self, files: Mapping[str, bytes | str] | Iterable[Any], tests: Sequence[Any], *,
                     image: str = "", limits: Optional[Mapping[str, Any]] = None, key: Optional[str] = None,
                     deadline_s: Optional[float] = None, priority_class: Optional[str] = None):
        """Run tests against a candidate; reward = passed / total (0 with a message on timeout).
        The recorded wait is the call's latency minus its longest test (tests run concurrently)."""
        cls = self._class(priority_class)
        request = pb2.VerifyRequest(idempotency_key=key or uuid.uuid4().hex, image=image, files=make_files(files),
                                    tests=[t if isinstance(t, pb2.TestCase) else pb2.TestCase(**t) for t in tests],
                                    limits=make_limits(limits), priority_class=class_value(cls))
        start = time.monotonic()
        try:
            result = (await self._call("Verify", request, deadline_s, cls=cls))[0]
        except asyncio.TimeoutError:
            self._waits[cls].record(time.monotonic() - start, None, None)
            return pb2.VerifyResult(reward=0.0, passed=0, total=len(tests))
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _NO_VERDICT and not _reply_lost(exc):
                raise
            logger.warning("Verify failed for good, not retried (it may have run): %s: %s", exc.code().name,
                           exc.details())
            self._waits[cls].record(time.monotonic() - start, None, None)
            return pb2.VerifyResult(reward=0.0, passed=0, total=len(tests))
        self._waits[cls].record(time.monotonic() - start,
                                max((t.result.usage.wall_time_s for t in result.tests), default=0.0),
                                max((t.result.queue_wait_s for t in result.tests), default=0.0))
        return result

    # -- scheduling signals ------------------------------------------------------------------
    async def backpressure(self, priority_class: Optional[str] = None) -> float:
        """0 (idle) .. 1 (calls are being refused): the servers' queue fill for `priority_class`
        (default: the client's), averaged over servers; a server that is down or draining counts
        as 1. From Health replies at most `health_interval_s` old. A rollout scheduler should
        submit less while it is high (e.g. pause new sandbox work above 0.8)."""
        cls = self._class(priority_class)
        await asyncio.gather(*(self._refresh(s) for s in self.servers))
        levels = []
        for server in self.servers:
            reply = server.reply if server.healthy else None
            if reply is None:
                levels.append(1.0)
                continue
            per_class = {c.name: c.backpressure for c in reply.classes}
            levels.append(per_class.get(cls, reply.backpressure))
        return sum(levels) / len(levels)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per priority class, over this client's recent calls: calls, timeouts, refusals
        (RESOURCE_EXHAUSTED answers, then retried), latency, wait (latency minus the execution
        time the server reported: queueing, transfer, workspace set-up; a call nobody answered
        waited its whole latency) and the server-reported queue wait. Classes never used are left out."""
        return {c: w.summary() for c, w in self._waits.items() if w.calls or w.refused}

    async def metrics(self, prefix: str = "sandbox") -> dict[str, float]:
        """`stats()` plus the servers' queue depth, running executions and back-pressure per class
        (summed / averaged over servers), flattened as `<prefix>/<class>/<name>` for a metrics sink."""
        out = {f"{prefix}/{c}/{k}": float(v) for c, s in self.stats().items() for k, v in s.items()}
        await asyncio.gather(*(self._refresh(s) for s in self.servers))
        replies = [s.reply for s in self.servers if s.healthy and s.reply is not None]
        for cls in CLASSES:
            rows = [c for r in replies for c in r.classes if c.name == cls]
            if rows and any(c.started or c.queued or c.refused for c in rows):
                out[f"{prefix}/{cls}/server_queued"] = float(sum(c.queued for c in rows))
                out[f"{prefix}/{cls}/server_running"] = float(sum(c.running for c in rows))
                out[f"{prefix}/{cls}/server_oldest_wait_s"] = max(c.oldest_wait_s for c in rows)
                out[f"{prefix}/{cls}/backpressure"] = await self.backpressure(cls)
        out[f"{prefix}/servers_up"] = float(len(replies))
        return out

    async def health(self) -> dict[str, Any]:
        out = {}
        for server in self.servers:
            try:
                out[server.address] = await server.stub.Health(pb2.HealthRequest(), timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                out[server.address] = exc.code().name
        return out

    # -- sessions ----------------------------------------------------------------------------
    async def open_session(self, files: Mapping[str, bytes | str] | Iterable[Any] = (), *, image: str = "",
                           limits: Optional[Mapping[str, Any]] = None, deadline_s: Optional[float] = None,
                           priority_class: Optional[str] = None) -> "Session":
        """A session on the least loaded server; its calls all go there (its state lives there) and
        run in `priority_class` (default: the client's) unless a call names another."""
        cls = self._class(priority_class)
        request = pb2.OpenRequest(idempotency_key=uuid.uuid4().hex, image=image, files=make_files(files),
                                  limits=make_limits(limits), priority_class=class_value(cls))
        try:
            info, server = await self._call("Open", request, deadline_s, cls=cls)
        except asyncio.TimeoutError as exc:
            raise SandboxUnavailable(str(exc)) from None
        return Session(self, server, info.session_id, cls)


class Session:
    """A workspace kept on one server between calls; every call goes to that server.
    Calls raise SandboxUnavailable when the server does not answer within the deadline."""

    def __init__(self, client: SandboxClient, server: _Server, session_id: str,
                 priority_class: str = DEFAULT_CLASS) -> None:
        self.client, self.server, self.id = client, server, session_id
        self.priority_class = priority_class

    @property
    def address(self) -> str:
        return self.server.address

    async def _call(self, method: str, request, deadline_s: Optional[float]):
        try:
            return (await self.client._call(method, request, deadline_s, pinned=self.server,
                                            cls=self.priority_class))[0]
        except asyncio.TimeoutError as exc:
            raise SandboxUnavailable(f"session {self.id} on {self.server.address}: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _NO_VERDICT or _reply_lost(exc):  # it may have changed the workspace: rebuild it
                raise SessionInterrupted(f"session {self.id}: {method} failed ({exc.code().name}: "
                                         f"{exc.details()}); the workspace's state is unknown") from None
            raise

    async def exec(self, argv: Sequence[str], *, stdin: bytes = b"", env: Optional[Mapping[str, str]] = None,
                   limits: Optional[Mapping[str, Any]] = None, key: Optional[str] = None,
                   deadline_s: Optional[float] = None, priority_class: Optional[str] = None):
        """Run `argv` in the session's workspace, in the session's class unless `priority_class` is given."""
        cls = check_class(priority_class.lower()) if priority_class else self.priority_class
        request = pb2.SessionExecRequest(
            idempotency_key=key or uuid.uuid4().hex, session_id=self.id, argv=list(argv), stdin=stdin,
            env=dict(env or {}), limits=make_limits(limits),
            priority_class=class_value(priority_class) if priority_class else pb2.PRIORITY_CLASS_UNSPECIFIED)
        try:
            return await self.client._exec_call("Exec", request, deadline_s, cls, pinned=self.server)
        except asyncio.TimeoutError as exc:
            raise SandboxUnavailable(f"session {self.id} on {self.server.address}: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED or exc.code() in _NO_VERDICT or _reply_lost(exc):
                raise SessionInterrupted(f"session {self.id}: {exc.code().name}: {exc.details()}") from None
            raise

    async def read_file(self, path: str, max_bytes: int = 0, deadline_s: Optional[float] = None):
        return await self._call("ReadFile", pb2.ReadFileRequest(session_id=self.id, path=path, max_bytes=max_bytes),
                                deadline_s)

    async def write_file(self, path: str, content: bytes | str, executable: bool = False,
                         deadline_s: Optional[float] = None) -> int:
        data = content.encode() if isinstance(content, str) else content
        reply = await self._call("WriteFile", pb2.WriteFileRequest(
            idempotency_key=uuid.uuid4().hex, session_id=self.id,
            file=pb2.File(path=path, content=data, executable=executable)), deadline_s)
        return reply.bytes_written

    async def snapshot(self, deadline_s: Optional[float] = None) -> str:
        reply = await self._call("Snapshot", pb2.SnapshotRequest(idempotency_key=uuid.uuid4().hex,
                                                                 session_id=self.id), deadline_s)
        return reply.snapshot_id

    async def restore(self, snapshot_id: str, deadline_s: Optional[float] = None) -> None:
        await self._call("Restore", pb2.RestoreRequest(idempotency_key=uuid.uuid4().hex, session_id=self.id,
                                                       snapshot_id=snapshot_id), deadline_s)

    async def close(self, deadline_s: Optional[float] = None) -> None:
        await self._call("Close", pb2.CloseRequest(idempotency_key=uuid.uuid4().hex, session_id=self.id),
                         deadline_s)
