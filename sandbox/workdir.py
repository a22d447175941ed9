"""A sandbox server's work directory: claimed for the server's life, and reaped after a server that died
without cleaning up.

A server that stops removes what it made (server.py). One killed with SIGKILL (Slurm's after KillWait, the
OOM killer) cannot: its temporary directory stays, and as root its prewarmed workspaces stay mounted as tmpfs
on the host, one mount per workspace, for as long as the node runs. So every server holds an exclusive
flock(2) on `<work_dir>/.owner` for its whole life. The kernel drops the lock when the process ends, however
it ends, so "nobody holds the lock" means "its server is dead" without trusting a pid (pids are reused). A lock
is only believed on the file that `.owner` still names (a stopping server deletes its `.owner` before it
closes it), and only for a server of this host (a shared filesystem's flock may be node-local).

- `claim(work_dir, temporary)` takes the lock. A temporary directory (made by the server with mkdtemp) gets
  its `.owner` written under another name and renamed into place only once locked, so no other server ever
  sees it unlocked while its owner lives. An explicit `--work-dir` must belong to this uid and be writable by
  it alone; one that another live server holds is refused. If the server before did not stop cleanly, what a
  server makes there (`workspaces/ws-*`, their mounts, `snapshots/*.tar`) is removed before use; nothing else
  of the directory is touched. An explicit directory keeps its `.owner`, marked stopped at a clean stop.
- `reap_dead_servers(parent)` removes the temporary directories of dead servers in `parent` (the server's
  TMPDIR) when nobody but this uid or root can rename entries there (owned by either, and not writable by
  others unless sticky, as /tmp): only directories named as the server names them, owned by this uid, with an
  `.owner` that says temporary, of this host, that nobody holds. A directory without `.owner` (a server still
  starting, or older code) is left alone. Every mount below a reaped directory is detached (MNT_DETACH, no
  symlink followed; stacked mounts one layer at a time) before anything is removed, deepest first.

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
from typing import Optional

from megatron_rl_sandbox.workspace import _remove_tree

logger = logging.getLogger(__name__)

PREFIX = "megatron-rl-sandbox-"  # tempfile.mkdtemp's prefix for a server's own work directory
OWNER = ".owner"

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8


class WorkDirInUse(RuntimeError):
    """The work directory belongs to a sandbox server that is (or may be) still running."""


class WorkDirUnsafe(RuntimeError):
    """A --work-dir that others could change under the server (not its uid's, or writable by others)."""


class WorkDirClaim:
    """The lock on a work directory, held until `release()` (or the process's end). `locked` is False on a
    filesystem without flock: the server then runs as it would without this module."""

    def __init__(self, work_dir: Path, fd: int, temporary: bool, locked: bool = True) -> None:
        self.work_dir, self.fd, self.temporary, self.locked = work_dir, fd, temporary, locked

    def release(self, remove_owner: bool) -> None:
        """Drop the lock. `remove_owner` (a temporary directory whose content is gone): delete `.owner`, before
        the lock goes. Otherwise an explicit directory's `.owner` is marked stopped: the next server on it
        cleans nothing and may come from another host."""
        if self.fd < 0:
            return
        if remove_owner:
            try:
                os.unlink(self.work_dir / OWNER)
            except FileNotFoundError:
                pass
        elif not self.temporary and self.locked:
            _write_owner(self.fd, {**_owner_record(False), "stopped": True})
        os.close(self.fd)
        self.fd = -1


def _owner_record(temporary: bool) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "temporary": temporary}


def _write_owner(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _read_owner(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _lock_current(directory: Path, fd: int) -> bool:
    """Lock `fd` without waiting; True only if it is still the file `directory/.owner` names (a stopping server
    deletes `.owner` before it lets go of its lock: a lock on that file proves nothing). Raises OSError where the
    filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        named = os.stat(directory / OWNER, follow_symlinks=False)
    except FileNotFoundError:
        named = None
    held = os.fstat(fd)
    if named is None or (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino):
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def claim(work_dir: Path, temporary: bool) -> WorkDirClaim:
    """Lock `work_dir` for this server. `temporary`: the server just made it (empty, named PREFIX...), and
    removes it at its exit; otherwise it is the user's `--work-dir`: refused with WorkDirUnsafe unless it is this
    uid's and writable by it alone, with WorkDirInUse while another server holds it; what a server that did not
    stop cleanly left there is removed."""
    if temporary:
        work_dir = Path(work_dir)
        staging = work_dir / f"{OWNER}.{uuid.uuid4().hex[:8]}"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
            locked = True
        except OSError as exc:
            logger.warning("%s: no flock on this filesystem (%s): if this server is killed, its work directory is "
                           "not removed by the next one", work_dir, exc.strerror)
            locked = False
        _write_owner(fd, _owner_record(True))
        os.rename(staging, work_dir / OWNER)  # visible to reapers only once locked
        return WorkDirClaim(work_dir, fd, True, locked)
    work_dir = Path(os.path.realpath(work_dir))
    st = os.lstat(work_dir)
    if not _ours(st) or st.st_mode & 0o022:
        raise WorkDirUnsafe(f"--work-dir {work_dir} must be a directory of uid {os.geteuid()} that only it can write "
                            f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): the server removes "
                            f"workspaces there")
    fd = os.open(work_dir / OWNER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        locked = _lock_current(work_dir, fd)
    except OSError as exc:
        logger.warning("--work-dir %s: no flock on this filesystem (%s): a second server on it is not refused, and "
                       "what a killed server left there is not removed", work_dir, exc.strerror)
        return WorkDirClaim(work_dir, fd, False, locked=False)
    before = _read_owner(fd)
    if not locked:
        os.close(fd)
        raise WorkDirInUse(f"--work-dir {work_dir} is in use by another sandbox server (pid {before.get('pid')} "
                           f"on {before.get('host')}): give each server its own work directory")
    crashed = bool(before) and not before.get("stopped")
    if crashed and before.get("host") != socket.gethostname():
        os.close(fd)
        raise WorkDirInUse(f"--work-dir {work_dir} was last used by a sandbox server on {before.get('host')} (pid "
                           f"{before.get('pid')}) that did not stop cleanly, and this host cannot tell whether it "
                           f"still runs: if it does not, remove {work_dir / OWNER}")
    _write_owner(fd, _owner_record(False))
    if crashed:
        removed, mounts = _clear_server_made(work_dir)
        if removed:
            logger.warning("--work-dir %s: removed %d workspaces and snapshots that a sandbox server that did not "
                           "stop cleanly left (pid %s; %d tmpfs mounts detached)", work_dir, removed,
                           before.get("pid"), mounts)
    return WorkDirClaim(work_dir, fd, False)


def _clear_server_made(work_dir: Path) -> tuple[int, int]:
    """Remove what a server makes in an explicit work directory (`workspaces/ws-*`, `snapshots/*.tar[.part]`),
    mounts first; (entries removed, mounts detached)."""
    removed = mounts = 0
    for name, kind in (("workspaces", "ws-"), ("snapshots", None)):
        sub = work_dir / name
        try:
            if not _ours(os.lstat(sub)):
                logger.warning("%s is not a directory of this uid (a symlink?): left alone", sub)
                continue
            entries = list(os.scandir(sub))
        except FileNotFoundError:
            continue
        for entry in entries:
            path = Path(sub / entry.name)
            if kind is not None and entry.name.startswith(kind) and entry.is_dir(follow_symlinks=False):
                mounts += _detach_below(path)
                removed += _remove_tree(path)
            elif kind is None and entry.name.endswith((".tar", ".tar.part")) and entry.is_file(follow_symlinks=False):
                os.unlink(path)
                removed += 1
    return removed, mounts


def _parent_is_safe(parent: Path) -> bool:
    """Nobody but this uid and root can rename the entries of `parent` (so an entry checked stays the entry used)."""
    st = os.stat(parent)
    return st.st_uid in (os.geteuid(), 0) and (not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX))


def reap_dead_servers(parent: Path) -> list[Path]:
    """Remove the temporary work directories that dead servers of this host left in `parent`; returns those
    removed."""
    reaped: list[Path] = []
    try:
        parent = Path(os.path.realpath(parent))
        if not _parent_is_safe(parent):
            logger.info("not looking for dead sandbox servers' work directories in %s: others can rename its "
                        "entries", parent)
            return reaped
        entries = [e for e in os.scandir(parent) if e.name.startswith(PREFIX)]
    except OSError as exc:
        logger.warning("could not look for dead sandbox servers' work directories in %s: %s", parent, exc)
        return reaped
    for entry in entries:
        path = parent / entry.name
        try:
            if not _ours(os.lstat(path)):
                continue  # a symlink, a file, or another user's: never ours to remove
            fd = os.open(path / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no .owner (a server still starting, older code) or gone meanwhile
            continue
        try:
            if not _lock_current(path, fd):
                continue  # its server is running (or just removed it)
            owner = _read_owner(fd)
            if owner.get("temporary") is not True or owner.get("host") != socket.gethostname():
                continue  # an explicit --work-dir (its next server cleans it), or another host's
            mounts = _detach_below(path)
            if not _remove_tree(path):
                logger.error("could not remove the work directory %s of a dead sandbox server", path)
                continue
            reaped.append(path)
            logger.warning("removed the work directory %s of a sandbox server that did not stop cleanly (pid %s; "
                           "%d tmpfs mounts detached)", path, owner.get("pid"), mounts)
        except OSError as exc:  # no flock here, a mount that would not go: the next entry still gets its turn
            logger.warning("could not reap %s: %s", path, exc)
        finally:
            os.close(fd)
    return reaped


def mounts_below(path: Path) -> list[str]:
    """Mount points at or below `path` (taken as given: no symlink resolved) in this process's mount namespace,
    deepest first; a path with mounts stacked on it appears once per mount."""
    root = os.path.normpath(str(path))
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point == root or point.startswith(root + "/"):
                found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


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


def _detach_below(path: Path) -> int:
    """Detach every mount at or below `path`, the top layer of each stack per round, until none is left; returns
    how many were detached. Raises OSError if one will not go (then nothing below it may be removed)."""
    detached = 0
    while True:
        points = mounts_below(path)
        if not points:
            return detached
        for point in points:
            if _libc.umount2(os.fsencode(point), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
                detached += 1
            else:
                err = ctypes.get_errno()
                if err != errno.EINVAL:  # EINVAL: this layer went with a detach above it
                    raise OSError(err, f"detaching {point}: {os.strerror(err)}")
        if mounts_below(path) == points:
            raise OSError(errno.EBUSY, f"mounts below {path} do not go: {points[:5]}")
