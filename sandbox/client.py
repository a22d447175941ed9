"""Async client for one or more sandbox servers: connection reuse, a deadline per call,
retries with the same idempotency key, failover across servers and load-aware routing.

Rule for callers in the training loop: never wait on a sandbox inside a collective. A call
always returns within its deadline; when no server could answer in time the result says
so (termination TIMEOUT, or reward 0 with a message), so a late reward becomes a timeout
reward, not a hung job.

Guarantee: a retry reuses the idempotency key, so a server never runs one request twice;
after a server dies mid-call the request runs on another server, and the caller gets
exactly one result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import grpc

from megatron_rl_sandbox.proto import load as load_proto

pb2, pb2_grpc = load_proto()
logger = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class SandboxUnavailable(Exception):
    """No server could serve a call that has no in-band way to report failure (sessions)."""


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


def make_files(files: Mapping[str, bytes | str] | Iterable[Any]) -> list:
    if isinstance(files, Mapping):
        return [pb2.File(path=p, content=c.encode() if isinstance(c, str) else c) for p, c in files.items()]
    return list(files)


def make_limits(limits: Optional[Mapping[str, Any]]):
    return pb2.Limits(**(limits or {}))


class _Server:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb2_grpc.SandboxStub(self.channel)
        self.healthy = True
        self.load = 0.0
        self.checked = 0.0
        self.down_until = 0.0


class SandboxClient:
    # A session lives on one server; when that server refuses connections this many times in a
    # row (~1.5 s with the backoff below), its calls fail at once instead of at their deadline.
    PINNED_UNREACHABLE_ATTEMPTS = 5

    def __init__(self, addresses: Sequence[str], deadline_s: float = 120.0, attempt_timeout_s: Optional[float] = None,
                 health_interval_s: float = 2.0) -> None:
        if not addresses:
            raise ValueError("SandboxClient needs at least one server address")
        self.servers = [_Server(a) for a in addresses]
        self.deadline_s = deadline_s
        self.attempt_timeout_s = attempt_timeout_s
        self.health_interval_s = health_interval_s

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, **kwargs: Any) -> "SandboxClient":
        addresses = discover(run_dir)
        if not addresses:
            raise ValueError(f"no sandbox server registered under {Path(run_dir) / 'sandbox'}")
        return cls(addresses, **kwargs)

    async def close(self) -> None:
        for server in self.servers:
            await server.channel.close()

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
            reply = await server.stub.Health(pb2.HealthRequest(), timeout=2.0)
            server.healthy = reply.serving
            server.load = (reply.running + reply.queued) / max(1, reply.capacity)
        except grpc.aio.AioRpcError:
            server.healthy = False

    async def _ranked(self) -> list[_Server]:
        await asyncio.gather(*(self._refresh(s) for s in self.servers))
        now = time.monotonic()
        usable = [s for s in self.servers if s.healthy and s.down_until <= now]
        others = [s for s in self.servers if s not in usable]
        random.shuffle(usable)
        usable.sort(key=lambda s: s.load)
        return usable + others

    async def _call(self, method: str, request, deadline_s: Optional[float], pinned: Optional[_Server] = None):
        """Try servers in order of health and load until one answers or the deadline passes."""
        deadline = time.monotonic() + (deadline_s or self.deadline_s)
        last_error: Optional[BaseException] = None
        attempt = unreachable = 0
        while time.monotonic() < deadline:
            if unreachable >= self.PINNED_UNREACHABLE_ATTEMPTS:  # the session's server is gone: fail fast
                raise asyncio.TimeoutError(f"{method}: the session's server {pinned.address} is unreachable")
            candidates = [pinned] if pinned is not None else await self._ranked()
            for server in candidates:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                timeout = min(remaining, self.attempt_timeout_s or remaining)
                try:
                    result = await getattr(server.stub, method)(request, timeout=timeout)
                    server.healthy = True
                    return result, server
                except grpc.aio.AioRpcError as exc:
                    last_error = exc
                    code = exc.code()
                    if code not in _RETRYABLE:
                        raise
                    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                                grpc.StatusCode.CANCELLED):
                        server.healthy = False
                        server.down_until = time.monotonic() + 1.0
                        server.checked = 0.0
                        if pinned is not None and code == grpc.StatusCode.UNAVAILABLE:
                            unreachable += 1
                    logger.debug("%s on %s failed (%s); trying the next server", method, server.address, code)
            attempt += 1
            await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0, max(0.0, deadline - time.monotonic())))
        raise asyncio.TimeoutError(f"{method}: no sandbox server answered within the deadline"
                                   f" ({last_error.code().name if isinstance(last_error, grpc.aio.AioRpcError) else 'no reply'})")

    # -- one-shot calls ----------------------------------------------------------------------
    async def execute(self, argv: Sequence[str], files: Mapping[str, bytes | str] | Iterable[Any] = (),
                      *, image: str = "", stdin: bytes = b"", env: Optional[Mapping[str, str]] = None,
                      limits: Optional[Mapping[str, Any]] = None, key: Optional[str] = None,
                      deadline_s: Optional[float] = None):
        """Run `argv` in a fresh workspace; always returns an ExecResult (TIMEOUT if nobody answered)."""
        request = pb2.ExecuteRequest(idempotency_key=key or uuid.uuid4().hex, image=image, files=make_files(files),
                                     argv=list(argv), stdin=stdin, env=dict(env or {}), limits=make_limits(limits))
        try:
            return (await self._call("Execute", request, deadline_s))[0]
        except asyncio.TimeoutError as exc:
            return pb2.ExecResult(exit_code=-1, termination=pb2.TIMEOUT, message=str(exc))

    async def verify(self, files: Mapping[str, bytes | str] | Iterable[Any], tests: Sequence[Any], *,
                     image: str = "", limits: Optional[Mapping[str, Any]] = None, key: Optional[str] = None,
                     deadline_s: Optional[float] = None):
        """Run tests against a candidate; reward = passed / total (0 with a message on timeout)."""
        request = pb2.VerifyRequest(idempotency_key=key or uuid.uuid4().hex, image=image, files=make_files(files),
                                    tests=[t if isinstance(t, pb2.TestCase) else pb2.TestCase(**t) for t in tests],
                                    limits=make_limits(limits))
        try:
            return (await self._call("Verify", request, deadline_s))[0]
        except asyncio.TimeoutError:
            return pb2.VerifyResult(reward=0.0, passed=0, total=len(tests))

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
                           limits: Optional[Mapping[str, Any]] = None, deadline_s: Optional[float] = None
                           ) -> "Session":
        request = pb2.OpenRequest(idempotency_key=uuid.uuid4().hex, image=image, files=make_files(files),
                                  limits=make_limits(limits))
        try:
            info, server = await self._call("Open", request, deadline_s)
        except asyncio.TimeoutError as exc:
            raise SandboxUnavailable(str(exc)) from None
        return Session(self, server, info.session_id)


class Session:
    """A workspace kept on one server between calls; every call goes to that server.
    Calls raise SandboxUnavailable when the server does not answer within the deadline."""

    def __init__(self, client: SandboxClient, server: _Server, session_id: str) -> None:
        self.client, self.server, self.id = client, server, session_id

    @property
    def address(self) -> str:
        return self.server.address

    async def _call(self, method: str, request, deadline_s: Optional[float]):
        try:
            return (await self.client._call(method, request, deadline_s, pinned=self.server))[0]
        except asyncio.TimeoutError as exc:
            raise SandboxUnavailable(f"session {self.id} on {self.server.address}: {exc}") from None

    async def exec(self, argv: Sequence[str], *, stdin: bytes = b"", env: Optional[Mapping[str, str]] = None,
                   limits: Optional[Mapping[str, Any]] = None, key: Optional[str] = None,
                   deadline_s: Optional[float] = None):
        return await self._call("Exec", pb2.SessionExecRequest(
            idempotency_key=key or uuid.uuid4().hex, session_id=self.id, argv=list(argv), stdin=stdin,
            env=dict(env or {}), limits=make_limits(limits)), deadline_s)

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
