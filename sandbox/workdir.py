"""A sandbox server's work directory: claimed for the server's life, and reaped after a server that died
without cleaning up.

A server that stops removes what it made (server.py). One killed with SIGKILL (Slurm's after KillWait, the
OOM killer) cannot: its temporary directory stays, and as root its prewarmed workspaces stay mounted as tmpfs
on the host, one mount per workspace, for as long as the node runs. So every server holds an exclusive
flock(2) on `<work_dir>/.owner` for its whole life. The kernel drops the lock when the process ends, however
it ends, so "nobody holds the lock" means "its server is dead" without trusting a pid (pids are reused).

- `claim(work_dir, temporary)` takes the lock. A temporary directory (made by the server with mkdtemp) gets
  its `.owner` written under another name and renamed into place only once locked, so no other server ever
  sees it unlocked while its owner lives. An explicit `--work-dir` that another live server holds is
  refused; one a dead server left is cleaned (its mounts detached, its workspaces and snapshots removed)
  before the new server uses it.
- `reap_dead_servers(parent)` removes the temporary directories of dead servers in `parent` (the server's
  TMPDIR): only directories named as the server names them, owned by this uid (so a root server removes only
  what root made), with an `.owner` that says temporary and that nobody holds. A directory without `.owner`
  (a server still starting, or older code) is left alone. Every mount below a reaped directory is detached
  (MNT_DETACH, no symlink followed) before anything is removed, deepest first.

Written by hand: no library finds and detaches what a dead process mounted, and the liveness test is one
flock call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
import uuid
from pathlib import Path

from megatron_rl_sandbox.workspace import _remove_tree

logger = logging.getLogger(__name__)

PREFIX = "megatron-rl-sandbox-"  # tempfile.mkdtemp's prefix for a server's own work directory
OWNER = ".owner"

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8


class WorkDirInUse(RuntimeError):
    """The work directory belongs to a sandbox server that is still running."""


class WorkDirClaim:
    """The lock on a work directory, held until `release()` (or the process's end)."""

    def __init__(self, work_dir: Path, fd: int, temporary: bool) -> None:
        self.work_dir, self.fd, self.temporary = work_dir, fd, temporary

    def release(self, remove_owner: bool) -> None:
        """Drop the lock; `remove_owner`: delete `.owner` first (everything else of the directory is gone, or
        it is an explicit work directory the next server re-claims anyway)."""
        if self.fd < 0:
            return
        if remove_owner:
            try:
                os.unlink(self.work_dir / OWNER)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = -1


def _owner_record(temporary: bool) -> bytes:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                       "temporary": temporary}).encode()


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_owner(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def claim(work_dir: Path, temporary: bool) -> WorkDirClaim:
    """Lock `work_dir` for this server. `temporary`: the server just made it (empty, named PREFIX...), and
    removes it at its exit; otherwise it is the user's `--work-dir`: refused with WorkDirInUse while another
    server holds it, and cleaned of what a dead one left."""
    work_dir = Path(work_dir)
    if temporary:
        staging = work_dir / f"{OWNER}.{uuid.uuid4().hex[:8]}"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: nobody else can hold it
        os.write(fd, _owner_record(True))
        os.rename(staging, work_dir / OWNER)  # visible to reapers only once locked
        return WorkDirClaim(work_dir, fd, True)
    fd = os.open(work_dir / OWNER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if not _lock(fd):
        holder = _read_owner(fd)
        os.close(fd)
        raise WorkDirInUse(f"--work-dir {work_dir} is in use by another sandbox server (pid {holder.get('pid')} "
                           f"on {holder.get('host')}): give each server its own work directory")
    stale = _read_owner(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, _owner_record(False), 0)
    left = [work_dir / name for name in ("workspaces", "snapshots") if (work_dir / name).exists()]
    if left:
        mounts = _clear(left)
        logger.warning("--work-dir %s: removed what a sandbox server that did not stop cleanly left (pid %s on %s; "
                       "%d tmpfs workspaces detached)", work_dir, stale.get("pid"), stale.get("host"), mounts)
    return WorkDirClaim(work_dir, fd, False)


def reap_dead_servers(parent: Path) -> list[Path]:
    """Remove the temporary work directories that dead servers left in `parent`; returns those removed."""
    reaped = []
    try:
        entries = list(os.scandir(parent))
    except OSError as exc:
        logger.warning("could not look for dead sandbox servers' work directories in %s: %s", parent, exc)
        return reaped
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        path = Path(entry.path)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue  # a symlink, a file, or another user's: never ours to remove
            fd = os.open(path / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no .owner (a server still starting, older code) or gone meanwhile
            continue
        try:
            if not _lock(fd):
                continue  # its server is running
            owner = _read_owner(fd)
            if owner.get("temporary") is not True:
                continue  # an explicit --work-dir: its next server cleans it
            mounts = _clear([path])
            if os.path.lexists(path):
                logger.error("could not remove the work directory %s of a dead sandbox server", path)
                continue
            reaped.append(path)
            logger.warning("removed the work directory %s of a sandbox server that did not stop cleanly (pid %s on "
                           "%s; %d tmpfs workspaces detached)", path, owner.get("pid"), owner.get("host"), mounts)
        finally:
            os.close(fd)
    return reaped


def mounts_below(path: Path) -> list[str]:
    """Mount points at or below `path` in this process's mount namespace, deepest first."""
    root = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point == root or point.startswith(root + "/"):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def _unescape(field: bytes) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040...)."""
    out, i = bytearray(), 0
    while i < len(field):
        if field[i:i + 1] == b"\\" and len(field) >= i + 4 and field[i + 1:i + 4].isdigit():
            out.append(int(field[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return os.fsdecode(bytes(out))


def _clear(paths: list[Path]) -> int:
    """Detach every mount below `paths`, then remove them; returns how many mounts were detached."""
    detached = 0
    for path in paths:
        for point in mounts_below(path):
            if _libc.umount2(os.fsencode(point), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
                detached += 1
            else:
                err = ctypes.get_errno()
                if err != errno.EINVAL:  # EINVAL: no longer a mount point
                    logger.error("could not detach %s: %s", point, os.strerror(err))
        if mounts_below(path):
            logger.error("%s still has mounts below it: not removed", path)
            continue
        if not _remove_tree(path):
            logger.error("could not remove %s", path)
    return detached

