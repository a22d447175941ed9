"""Workspaces: the per-execution (or per-session) directory mounted at /workspace.

Each workspace is new for every execution (a session keeps one for its life) and is filled
with the request's files, so every task starts from the same state: nothing a run left on the
directory itself (extended attributes, mode, times, ownership, inode flags) can reach the next
one, because a used workspace is never emptied and reused but unmounted and removed. As root
the directory is its own tmpfs of `disk_bytes`: a hard quota the sandboxed code cannot exceed
(writes fail with ENOSPC), files included: a tmpfs counts no blocks for an empty file, so its number
of inodes is bounded too (`inodes_for`), or a session could keep millions of empty files, about a
KiB of unswappable kernel memory each, under any quota; it and every file the server writes into it belong to the
unprivileged user the server runs code as (`owner`). Without root it is a plain directory and
the disk limit is enforced per file (RLIMIT_FSIZE). A pool of fresh workspaces of the default
size is kept ready so that a request does not wait for a mount.

Snapshots are GNU tar archives written by `tar --sparse` straight to a file: a sparse file
keeps its holes (its allocated size is what counts), and the server holds none of it in memory.

Paths in requests are confined to the workspace: absolute paths, `..` and writes through
symlinks are refused. The sandboxed code owns the workspace's content, so the server opens
its files without following symlinks or blocking and refuses anything but a regular file (a
FIFO would block the open); clearing first makes read-only directories writable, and a
workspace that still is not empty is destroyed instead of reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Iterable, Optional

logger = logging.getLogger(__name__)


class WorkspaceError(ValueError):
    """A request the workspace refuses (a path outside it, over the disk limit)."""


class WorkspaceStateError(WorkspaceError):
    """A request the workspace's current state does not allow (writing onto a directory or a
    FIFO, restoring a snapshot that cannot be unpacked)."""


FULL_BELOW_BYTES = 64 * 2**10  # a tmpfs workspace with less room left than this is full
BYTES_PER_INODE = 2**10  # a tmpfs workspace holds one file or directory per KiB of its quota (at least MIN_INODES)
MIN_INODES = 4096
FULL_BELOW_INODES = 16  # and one with fewer free inodes than this is full


def inodes_for(disk_bytes: int) -> int:
    """The files and directories a tmpfs workspace of `disk_bytes` may hold: their kernel memory (about a KiB
    each) stays of the order of the quota itself."""
    return max(MIN_INODES, disk_bytes // BYTES_PER_INODE)

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MNT_DETACH = 2
_MS_NOSUID, _MS_NODEV = 2, 4


def _mountable() -> bool:
    return os.geteuid() == 0


def _mount_tmpfs(path: Path, options: str) -> None:
    """mount(2) directly: a `mount` process per workspace cost more than the rest of a short run."""
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting a tmpfs on {path}: {os.strerror(err)}")


def _unmount(path: Path) -> None:
    if _libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err != 22:  # EINVAL: not a mount point (already gone)
            logger.error("could not unmount workspace %s: %s", path, os.strerror(err))


class Workspace:
    def __init__(self, path: Path, disk_bytes: int, tmpfs: bool, owner: Optional[tuple[int, int]] = None) -> None:
        self.path = path
        self.disk_bytes = disk_bytes
        self.tmpfs = tmpfs
        self.owner = owner  # (uid, gid) of the sandboxed code, when the server is root

    def usage(self) -> int:
        """Bytes allocated in the workspace (a sparse file counts by its allocated blocks)."""
        if self.tmpfs:
            st = os.statvfs(self.path)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        return _tree_bytes(self.path)

    def full(self) -> bool:
        """Whether a run filled the workspace: less than FULL_BELOW_BYTES left of the quota (or fewer
        than FULL_BELOW_INODES files left), or a file at the per-file limit (RLIMIT_FSIZE = the disk
        limit). Measured, never read from output."""
        if self.tmpfs:
            st = os.statvfs(self.path)
            if st.f_bavail * st.f_frsize < min(FULL_BELOW_BYTES, self.disk_bytes // 16):
                return True
            if st.f_favail < FULL_BELOW_INODES:
                return True
        elif self.usage() >= self.disk_bytes:
            return True
        for root, _, files in os.walk(self.path):
            for name in files:
                try:
                    if os.lstat(os.path.join(root, name)).st_size >= self.disk_bytes:
                        return True
                except OSError:
                    continue
        return False

    def _give(self, path: Path) -> None:
        """Hand `path` (not following a symlink) to the sandboxed code's user."""
        if self.owner is not None:
            os.lchown(path, *self.owner)

    def _makedirs(self, directory: Path) -> None:
        missing = []
        while not directory.exists() and directory != self.path:
            missing.append(directory)
            directory = directory.parent
        for path in reversed(missing):
            path.mkdir()
            self._give(path)

    def resolve(self, rel: str) -> Path:
        """`rel` inside the workspace; refuses escapes (absolute, .., symlinks on the way)."""
        check_path(rel)
        parts = Path(rel).parts
        current = self.path
        for part in parts[:-1]:
            current = current / part
            if current.is_symlink():
                raise WorkspaceError(f"path {shown(rel)} goes through a symlink")
        target = self.path.joinpath(*parts)
        if target.is_symlink():
            raise WorkspaceError(f"path {shown(rel)} is a symlink")
        return target

    def write(self, rel: str, content: bytes, executable: bool = False) -> int:
        target = self.resolve(rel)
        try:
            self._makedirs(target.parent)
            if self.tmpfs and self.usage() + len(content) > self.disk_bytes:
                raise WorkspaceError(f"writing {shown(rel)} ({len(content)} bytes) exceeds the disk limit")
            fd = _open_regular(target, rel, os.O_WRONLY | os.O_CREAT)
            try:
                os.ftruncate(fd, 0)
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, 0o755 if executable else 0o644)
                if self.owner is not None:
                    os.fchown(fd, *self.owner)
            finally:
                os.close(fd)
        except OSError as exc:  # e.g. a directory or a file where the path needs a directory
            raise WorkspaceStateError(f"cannot write {shown(rel)}: {exc.strerror or exc}") from None
        return len(content)

    def read(self, rel: str, max_bytes: int) -> tuple[bytes, bool, bool]:
        target = self.resolve(rel)
        try:
            fd = _open_regular(target, rel, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return b"", False, False
        except OSError as exc:
            raise WorkspaceStateError(f"cannot read {shown(rel)}: {exc.strerror or exc}") from None
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
        return data[:max_bytes], len(data) > max_bytes, True

    def clear(self) -> None:
        """Empty the workspace; raises OSError when something stays (the workspace must then be
        destroyed, never handed to the next execution)."""
        _make_removable(self.path)
        for entry in os.scandir(self.path):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        left = os.listdir(self.path)
        if left:
            raise OSError(f"workspace {self.path} still holds {left[:5]} after clearing")
        os.chmod(self.path, 0o755)  # the run may have changed the mode of /workspace itself

    def snapshot(self, dest: Path) -> int:
        """Write the workspace's content to the tar file `dest` (holes of sparse files kept); returns
        its size in bytes."""
        tmp = dest.with_name(dest.name + ".part")
        done = subprocess.run(["tar", "--sparse", "--format=gnu", "--numeric-owner", "-cf", str(tmp), "-C",
                               str(self.path), "."], capture_output=True)
        if done.returncode != 0:  # e.g. a file the run made unreadable (server not root)
            tmp.unlink(missing_ok=True)
            why = done.stderr.decode(errors="replace").strip().splitlines()
            raise WorkspaceStateError(f"cannot snapshot the workspace: {why[-1] if why else done.returncode}")
        os.replace(tmp, dest)
        return dest.stat().st_size

    def restore(self, snapshot: Path) -> None:
        """Replace the workspace's content by that of the tar file `snapshot`. It is unpacked next to
        the workspace first, so a snapshot that cannot be unpacked leaves the workspace as it was;
        sparse files stay sparse (tarfile seeks over holes, `cp --sparse=always` copies into the tmpfs)."""
        # tarfile stops quietly at a damaged header after the first: GNU tar's listing fails on any
        listing = subprocess.run(["tar", "-tf", str(snapshot)], capture_output=True)
        if listing.returncode != 0:
            why = listing.stderr.decode(errors="replace").strip().splitlines()
            raise WorkspaceStateError(f"cannot restore the snapshot: {why[-1] if why else 'damaged archive'}")
        staging = Path(tempfile.mkdtemp(prefix=f"{self.path.name}.restore-", dir=self.path.parent))
        try:
            try:
                with tarfile.open(snapshot, mode="r") as tar:
                    tar.extractall(staging, filter=_snapshot_filter)
            except (tarfile.TarError, OSError) as exc:
                raise WorkspaceStateError(f"cannot restore the snapshot: {exc}") from None
            size = _tree_bytes(staging)
            if size > self.disk_bytes:
                raise WorkspaceStateError(f"the snapshot holds {size} bytes, more than this workspace's disk "
                                          f"limit of {self.disk_bytes}")
            if self.owner is not None:
                for root, dirs, files in os.walk(staging):
                    for name in dirs + files:
                        os.lchown(os.path.join(root, name), *self.owner)
            try:
                self.clear()
                if os.listdir(staging):
                    done = subprocess.run(["cp", "-a", "--sparse=always", "--", f"{staging}/.", f"{self.path}/"],
                                          capture_output=True)
                    if done.returncode != 0:
                        raise OSError(done.stderr.decode(errors="replace").strip())
                    os.chmod(self.path, 0o755)  # `cp -a` gave it the staging directory's mode and owner
                    self._give(self.path)
            except OSError as exc:
                raise WorkspaceStateError(f"restoring the snapshot failed halfway: {exc}") from None
        finally:
            _remove_tree(staging)


MAX_PATH_BYTES = 4096  # PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX


def check_path(rel: str) -> None:
    """Refuse (WorkspaceError: INVALID_ARGUMENT, final) a request path that cannot name a file in
    the workspace: empty, absolute, with `..`, a NUL or another control character, longer than
    PATH_MAX or with a component longer than NAME_MAX (the file system's own ENAMETOOLONG came back
    as a server error)."""
    if not rel or rel.startswith("/"):
        raise WorkspaceError(f"path {shown(rel)} must be relative to the workspace")
    if any(ord(c) < 32 or ord(c) == 127 for c in rel):
        raise WorkspaceError(f"path {shown(rel)} contains a control character")
    if len(os.fsencode(rel)) > MAX_PATH_BYTES:
        raise WorkspaceError(f"path of {len(os.fsencode(rel))} bytes is longer than {MAX_PATH_BYTES}")
    parts = Path(rel).parts
    if ".." in parts:
        raise WorkspaceError(f"path {shown(rel)} may not contain '..'")
    if any(len(os.fsencode(p)) > MAX_NAME_BYTES for p in parts):
        raise WorkspaceError(f"path {shown(rel)} has a component longer than {MAX_NAME_BYTES} bytes")


def _open_regular(target: Path, rel: str, flags: int) -> int:
    """Open `target` without following a symlink and without blocking; refuses anything but a
    regular file. The sandboxed code may have replaced the file by a FIFO, whose plain open()
    would block the server until something opened the other end."""
    try:
        kind = _KINDS.get(stat.S_IFMT(os.lstat(target).st_mode))
    except FileNotFoundError:
        kind = None  # created below (O_CREAT) or reported missing
    if kind is not None:
        raise WorkspaceStateError(f"{shown(rel)} is {kind}, not a regular file")
    fd = os.open(target, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
        os.close(fd)
        raise WorkspaceStateError(f"{shown(rel)} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _check_traversable(path: Path, owner: tuple[int, int]) -> None:
    """Refuse a workspace root that the sandboxed code's user cannot reach (every directory above it
    must let it search): otherwise every run would fail to mount its workspace."""
    for directory in [path, *path.resolve().parents]:
        st = directory.stat()
        mode = st.st_mode
        if mode & stat.S_IXOTH or (st.st_uid == owner[0] and mode & stat.S_IXUSR) or (
                st.st_gid == owner[1] and mode & stat.S_IXGRP):
            continue
        raise RuntimeError(f"the sandbox's user (uid {owner[0]}) cannot reach workspaces under {path}: "
                           f"{directory} (mode {stat.S_IMODE(mode):o}) does not let it search; choose a --work-dir "
                           f"below directories that others may search (mode o+x), e.g. /var/tmp")


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}


def _snapshot_filter(member: tarfile.TarInfo, dest: str) -> Optional[tarfile.TarInfo]:
    """tarfile's "data" filter, except that symlinks may point anywhere (`python -m venv` makes
    absolute ones; inside the sandbox they resolve in the image) and special files (FIFOs,
    devices) are left out. Writing through a symlink stays impossible: the filter refuses every
    member whose own path resolves outside `dest`."""
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        return None
    if member.issym():
        checked = tarfile.data_filter(member.replace(linkname=".", deep=False), dest)
        return checked.replace(linkname=member.linkname, deep=False)
    return tarfile.data_filter(member, dest)


def _tree_bytes(path: Path) -> int:
    """Bytes allocated to the regular files under `path` (a sparse file counts by its blocks)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def shown(value: str, limit: int = 80) -> str:
    """`value` for an error message: repr'd and cut to `limit` characters (error details travel in
    gRPC metadata, which must stay small; never echo a client's input whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(value)} characters)"


def _make_removable(path: Path) -> None:
    """Give the owner rwx on `path` and every directory below it (no symlink is followed): a
    run can make its directories read-only, and without root their content could then not be
    removed."""
    stack = [str(path)]
    while stack:
        directory = stack.pop()
        try:
            mode = os.lstat(directory).st_mode
            if not stat.S_ISDIR(mode):  # a symlink (in place of `path` itself too) is neither changed nor listed
                continue
            if stat.S_IMODE(mode) & stat.S_IRWXU != stat.S_IRWXU:
                os.chmod(directory, stat.S_IMODE(mode) | stat.S_IRWXU)
            with os.scandir(directory) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            continue


def _remove_tree(path: Path) -> bool:
    """Remove `path` whatever the modes below it; True when it is gone."""
    _make_removable(path)
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


class WorkspacePool:
    """Creates and destroys workspaces under `root`, keeping `prewarm` fresh ones of the default
    size ready. `owner`: the (uid, gid) that sandboxed code runs as (a root server's); workspaces
    belong to it, and `root` is made traversable (mode 711) for it."""

    def __init__(self, root: Path, default_disk_bytes: int, prewarm: int = 4, use_tmpfs: Optional[bool] = None,
                 owner: Optional[tuple[int, int]] = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.owner = owner
        if owner is not None:
            os.chmod(self.root, 0o711)
            _check_traversable(self.root, owner)
        self.default_disk_bytes = default_disk_bytes
        self.use_tmpfs = _mountable() if use_tmpfs is None else use_tmpfs
        self.prewarm = prewarm
        self._ready: list[Workspace] = []
        self._making = 0
        self._lock = threading.Lock()
        for _ in range(prewarm):
            self._ready.append(self._create(default_disk_bytes))

    @property
    def quota(self) -> str:
        return "tmpfs" if self.use_tmpfs else "rlimit-fsize"

    def _create(self, disk_bytes: int) -> Workspace:
        path = self.root / f"ws-{uuid.uuid4().hex[:12]}"
        path.mkdir(mode=0o755)
        if self.use_tmpfs:
            owner = f",uid={self.owner[0]},gid={self.owner[1]}" if self.owner is not None else ""
            try:
                _mount_tmpfs(path, f"size={disk_bytes},nr_inodes={inodes_for(disk_bytes)},mode=0755{owner}")
            except OSError:
                path.rmdir()
                raise
        elif self.owner is not None:
            os.chown(path, *self.owner)
        return Workspace(path, disk_bytes, self.use_tmpfs, self.owner)

    def acquire(self, disk_bytes: int, files: Iterable = ()) -> Workspace:
        ws = None
        if disk_bytes == self.default_disk_bytes:
            with self._lock:
                ws = self._ready.pop() if self._ready else None
        if ws is None:
            ws = self._create(disk_bytes)
        try:
            for f in files:
                ws.write(f.path, f.content, f.executable)
        except Exception:
            self.release(ws)
            raise
        return ws

    def release(self, ws: Workspace) -> None:
        """Destroy a used workspace (never reused: see the module doc) and top the pool of fresh
        ones up again."""
        self.destroy(ws)
        with self._lock:  # counted with those being made, so that concurrent releases do not overfill the pool
            missing = max(0, self.prewarm - len(self._ready) - self._making)
            self._making += missing
        for made in range(missing):
            try:
                fresh = self._create(self.default_disk_bytes)
            except OSError as exc:  # the call that released is done; the next acquire makes its own
                logger.warning("could not prepare a fresh workspace: %s", exc)
                with self._lock:
                    self._making -= missing - made
                return
            with self._lock:
                self._ready.append(fresh)
                self._making -= 1

    def destroy(self, ws: Workspace) -> None:
        if ws.tmpfs:
            _unmount(ws.path)  # the tmpfs and all it held go at once
        if not _remove_tree(ws.path):
            logger.error("could not remove workspace %s", ws.path)

    def close(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for ws in ready:
            self.destroy(ws)
