"""The sandbox gRPC server process: serves `SandboxService` (service.py, which says what every call does)
on an asyncio gRPC server with its reaper, signals and discovery file.

- SIGTERM (and SIGINT) drains: new calls are refused with UNAVAILABLE, running ones finish (up
  to `drain_s`), then the server exits and removes its discovery file. With `--ignore-sigterm`
  only SIGINT does: for a server that a training job stops itself (Slurm sends SIGTERM to every
  process at a job's end, while the trainer may still need rewards for the step it finishes).
- Every command inherits the server's session keyring, and keys are not confined by namespaces: under
  a login's keyring (pam_keyinit, systemd's per-service one) sandboxed code could read the keys held
  there (Kerberos tickets, say) and leave keys for later runs. The server first swaps it for an empty
  one that nobody, its holders included, may use (`_seal_session_keyring`); a run that wants a
  keyring makes its own.
- With `--run-dir`, the address is written to `<run-dir>/sandbox/<name>.json` so that the
  job's ranks find the servers of their allocation.

    python -m megatron_rl_sandbox.server --address 0.0.0.0:50051 --runtime bwrap --run-dir runs/job
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ctypes
import errno
import faulthandler
import json
import logging
import os
import platform
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

import grpc

from megatron_rl_sandbox.executor import RunAs
from megatron_rl_sandbox.limits import Limiter, Limits, detect_limiter
from megatron_rl_sandbox.options import build_parser, class_policies, parse_images
from megatron_rl_sandbox.runtimes import make_runtime
from megatron_rl_sandbox.service import MAXIMUM, SandboxService, pb2_grpc
from megatron_rl_sandbox.workdir import PREFIX, WorkDirClaim, WorkDirInUse, WorkDirUnsafe, claim, reap_dead_servers
from megatron_rl_sandbox.workspace import WorkspacePool

logger = logging.getLogger(__name__)


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


async def serve(args: argparse.Namespace, ready: Optional[asyncio.Event] = None) -> None:
    classes = class_policies(args.class_weights, args.class_quota, args.class_max_queue)
    if args.session_idle_timeout_s < 0:
        raise SystemExit(f"--session-idle-timeout-s {args.session_idle_timeout_s:g} must be >= 0 (0: never)")
    if args.runtime == "process":
        runtime = make_runtime("process", allow_unisolated=args.allow_unisolated)
    elif args.runtime == "apptainer":
        runtime = make_runtime("apptainer", images=parse_images(args.image), apptainer_cmd=args.apptainer_cmd)
    else:
        runtime = make_runtime("bwrap", images=parse_images(args.image))
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
    if args.max_message_bytes < 2**20:
        raise SystemExit(f"sandbox server: --max-message-bytes {args.max_message_bytes} must be at least 1 MiB")
    run_as = None
    if os.geteuid() == 0:  # never run sandboxed code as host root (see executor.py)
        try:
            run_as = RunAs(args.sandbox_uid, args.sandbox_gid)
        except ValueError as exc:
            raise SystemExit(f"sandbox server: --sandbox-uid/--sandbox-gid: {exc}") from None
        if shutil.which("setpriv") is None:
            raise SystemExit("sandbox server: running as root needs `setpriv` (util-linux) to drop commands to "
                             "--sandbox-uid")
    reap_dead_servers(Path(tempfile.gettempdir()))  # what servers killed without a chance to clean up left
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix=PREFIX))
    if run_as is not None and not args.work_dir:
        os.chmod(work_dir, 0o711)  # mkdtemp's 0700 would keep the sandbox's user from its workspaces
    try:
        if args.work_dir:
            work_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        owned = claim(work_dir, temporary=not args.work_dir)
    except (WorkDirInUse, WorkDirUnsafe) as exc:
        raise SystemExit(f"sandbox server: {exc}") from None
    except OSError as exc:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)  # just made, still empty
        raise SystemExit(f"sandbox server: work directory {work_dir}: {exc}") from None
    try:
        await _serve_in(args, work_dir, runtime, limiter, defaults, maximum, classes, run_as, ready)
    finally:
        if args.work_dir:
            owned.release(remove_owner=False)  # marked stopped: the next server there has nothing to clean
        else:  # the directory this server made for itself: gone with it, unless it kept something
            _remove_own_work_dir(owned)


def _remove_own_work_dir(owned: WorkDirClaim) -> None:
    """Remove the server's own temporary directory at its exit. Only empty directories are removed: every
    workspace and snapshot was destroyed when its session closed or the pool closed, so whatever is left (a
    workspace whose command outlived the drain, a tmpfs that would not unmount) is reported, not deleted here;
    the directory keeps its `.owner`, so the next server started with the same TMPDIR reaps it (workdir.py)."""
    work_dir = owned.work_dir
    for path in (work_dir / "workspaces", work_dir / "snapshots"):
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            try:
                left = sorted(p.name for p in path.iterdir())[:10]
            except OSError:
                left = []
            logger.warning("sandbox work directory %s not removed (%s): %s left in it; the next sandbox server "
                           "started with the same TMPDIR removes it", path, exc.strerror, left)
            owned.release(remove_owner=False)
            return
    owned.release(remove_owner=True)
    try:
        work_dir.rmdir()
    except OSError as exc:
        logger.warning("sandbox work directory %s not removed: %s", work_dir, exc.strerror)


async def _serve_in(args: argparse.Namespace, work_dir: Path, runtime, limiter, defaults: Limits, maximum: Limits,
                    classes: dict, run_as: Optional[RunAs], ready: Optional[asyncio.Event]) -> None:
    try:
        pool = WorkspacePool(work_dir / "workspaces", defaults.disk_bytes, prewarm=args.prewarm,
                             owner=(run_as.uid, run_as.gid) if run_as is not None else None)
    except RuntimeError as exc:
        raise SystemExit(f"sandbox server: {exc}") from None
    if not pool.use_tmpfs:
        logger.warning("workspaces are plain directories (not root: no tmpfs mount): the disk limit is NOT enforced "
                       "per workspace, only per file (RLIMIT_FSIZE)")
    name = args.name or f"{socket.gethostname()}-{os.getpid()}"
    service = SandboxService(runtime, limiter, pool, defaults, maximum, args.capacity, args.max_queue,
                             args.max_sessions, name, work_dir / "snapshots", remembered_bytes=args.remember_bytes,
                             classes=classes, session_idle_timeout_s=args.session_idle_timeout_s, run_as=run_as,
                             max_message_bytes=args.max_message_bytes)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", args.max_message_bytes),
                                      ("grpc.max_send_message_length", args.max_message_bytes)])
    pb2_grpc.add_SandboxServicer_to_server(service, server)
    port = server.add_insecure_port(args.address)
    if args.address.startswith("unix:"):
        address = args.address
    else:
        host = args.address.rsplit(":", 1)[0]
        address = f"{socket.gethostname() if host in ('0.0.0.0', '[::]') else host}:{port}"
    service.address = args.advertise or address
    # Signals are handled before the server is announced (its discovery file, its ready line): a job's SIGTERM
    # that comes as soon as a client can find the server must meet --ignore-sigterm, not the default action
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
    await server.start()
    discovery = _write_discovery(args.run_dir, name, service.address, runtime.name) if args.run_dir else None
    logger.info("sandbox server %s serving on %s (runtime %s, limiter %s, workspace quota %s, capacity %d, "
                "commands run as %s, classes %s)", name, service.address, runtime.name, limiter.name, pool.quota,
                args.capacity, f"uid {run_as.uid}" if run_as else f"this server's uid {os.geteuid()}",
                {c: dataclasses.asdict(p) for c, p in classes.items()})
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


_KEYCTL = {"x86_64": 250, "aarch64": 219}  # the keyctl(2) syscall number
_KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_SETPERM = 1, 5


def _seal_session_keyring() -> None:
    """Give this process (and so every command it starts) a new, empty session keyring with no
    permission for anyone: possession grants a key's possessor rights, and each command possesses
    its parent's session keyring. Must run before any other thread starts: the keyring is per thread."""
    number = _KEYCTL.get(platform.machine())
    if number is None:
        logger.warning("cannot seal the session keyring on %s: sandboxed code can use this server's session "
                       "keyring (the keys of the login that started it)", platform.machine())
        return
    libc = ctypes.CDLL(None, use_errno=True)
    keyring = libc.syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None)
    if keyring < 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        # keyctl is filtered here (a seccomp profile: Docker's default refuses it), and the filter holds for every
        # command this server starts as well: there is no keyring for them to reach
        logger.info("keyctl is unavailable to this server (%s), and so to the code it runs: no keyring to seal",
                    os.strerror(ctypes.get_errno()))
        return
    if keyring < 0 or libc.syscall(number, _KEYCTL_SETPERM, keyring, 0) != 0:
        err = ctypes.get_errno()
        raise SystemExit(f"sandbox server: cannot seal the session keyring: {os.strerror(err)}")


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox %(levelname)s %(message)s")
    _seal_session_keyring()
    try:
        asyncio.run(serve(args))
    except RuntimeError as exc:
        raise SystemExit(f"sandbox server: {exc}") from None


if __name__ == "__main__":
    main()
