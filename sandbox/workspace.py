"""Workspaces: the per-execution (or per-session) directory mounted at /workspace.

Each workspace starts empty and is filled with the request's files, so every task starts
from the same state. As root the directory is its own tmpfs of `disk_bytes`: a hard quota
the sandboxed code cannot exceed (writes fail with ENOSPC). Without root it is a plain
directory and the disk limit is enforced per file (RLIMIT_FSIZE) plus a size check after
each run. A pool of ready workspaces of the default size is kept warm so that a request
does not wait for a mount.

Paths in requests are confined to the workspace: absolute paths, `..` and writes through
symlinks are refused. The sandboxed code owns the workspace's content, so the server opens
its files without following symlinks or blocking and refuses anything but a regular file (a
FIFO would block the open); clearing first makes read-only directories writable, and a
workspace that still is not empty is destroyed instead of reused.
"""

from __future__ import annotations

import io
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


def _mountable() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None and shutil.which("umount") is not None


class Workspace:
    def __init__(self, path: Path, disk_bytes: int, tmpfs: bool) -> None:
        self.path = path
        self.disk_bytes = disk_bytes
        self.tmpfs = tmpfs

    def usage(self) -> int:
        if self.tmpfs:
            st = os.statvfs(self.path)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        total = 0
        for root, _, files in os.walk(self.path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    pass
        return total

    def resolve(self, rel: str) -> Path:
        """`rel` inside the workspace; refuses escapes (absolute, .., symlinks on the way)."""
        if not rel or rel.startswith("/") or "\x00" in rel:
            raise WorkspaceError(f"path {rel!r} must be relative to the workspace")
        parts = Path(rel).parts
        if ".." in parts:
            raise WorkspaceError(f"path {rel!r} may not contain '..'")
        current = self.path
        for part in parts[:-1]:
            current = current / part
            if current.is_symlink():
                raise WorkspaceError(f"path {rel!r} goes through a symlink")
        target = self.path.joinpath(*parts)
        if target.is_symlink():
            raise WorkspaceError(f"path {rel!r} is a symlink")
        return target

    def write(self, rel: str, content: bytes, executable: bool = False) -> int:
        target = self.resolve(rel)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if self.tmpfs and self.usage() + len(content) > self.disk_bytes:
                raise WorkspaceError(f"writing {rel!r} ({len(content)} bytes) exceeds the disk limit")
            fd = _open_regular(target, rel, os.O_WRONLY | os.O_CREAT)
            try:
                os.ftruncate(fd, 0)
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, 0o755 if executable else 0o644)
            finally:
                os.close(fd)
        except OSError as exc:  # e.g. a directory or a file where the path needs a directory
            raise WorkspaceStateError(f"cannot write {rel!r}: {exc.strerror or exc}") from None
        return len(content)

    def read(self, rel: str, max_bytes: int) -> tuple[bytes, bool, bool]:
        target = self.resolve(rel)
        try:
            fd = _open_regular(target, rel, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return b"", False, False
        except OSError as exc:
            raise WorkspaceStateError(f"cannot read {rel!r}: {exc.strerror or exc}") from None
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

    def snapshot(self) -> bytes:
        buf = io.BytesIO()
        try:
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(str(self.path), arcname=".")
        except OSError as exc:  # e.g. a file the run made unreadable
            raise WorkspaceStateError(f"cannot snapshot the workspace: {exc}") from None
        return buf.getvalue()

    def restore(self, snapshot: bytes) -> None:
        """Replace the workspace's content by `snapshot`'s. The snapshot is unpacked next to the
        workspace first, so a snapshot that cannot be unpacked leaves the workspace as it was."""
        staging = Path(tempfile.mkdtemp(prefix=f"{self.path.name}.restore-", dir=self.path.parent))
        try:
            try:
                with tarfile.open(fileobj=io.BytesIO(snapshot), mode="r") as tar:
                    tar.extractall(staging, filter=_snapshot_filter)
            except (tarfile.TarError, OSError) as exc:
                raise WorkspaceStateError(f"cannot restore the snapshot: {exc}") from None
            size = _tree_bytes(staging)
            if size > self.disk_bytes:
                raise WorkspaceStateError(f"the snapshot holds {size} bytes, more than this workspace's disk "
                                          f"limit of {self.disk_bytes}")
            try:
                self.clear()
                for entry in os.scandir(staging):
                    shutil.move(entry.path, self.path / entry.name)  # a rename, or a copy into a tmpfs
            except OSError as exc:
                raise WorkspaceStateError(f"restoring the snapshot failed halfway: {exc}") from None
        finally:
            _remove_tree(staging)


def _open_regular(target: Path, rel: str, flags: int) -> int:
    """Open `target` without following a symlink and without blocking; refuses anything but a
    regular file. The sandboxed code may have replaced the file by a FIFO, whose plain open()
    would block the server until something opened the other end."""
    try:
        kind = _KINDS.get(stat.S_IFMT(os.lstat(target).st_mode))
    except FileNotFoundError:
        kind = None  # created below (O_CREAT) or reported missing
    if kind is not None:
        raise WorkspaceStateError(f"{rel!r} is {kind}, not a regular file")
    fd = os.open(target, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
        os.close(fd)
        raise WorkspaceStateError(f"{rel!r} is not a regular file")
    os.set_blocking(fd, True)
    return fd


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
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, name)).st_size for name in files)
    return total


def _make_removable(path: Path) -> None:
    """Give the owner rwx on `path` and every directory below it (no symlink is followed): a
    run can make its directories read-only, and without root their content could then not be
    removed."""
    stack = [str(path)]
    while stack:
        directory = stack.pop()
        try:
            mode = os.lstat(directory).st_mode
            if stat.S_ISDIR(mode) and stat.S_IMODE(mode) & stat.S_IRWXU != stat.S_IRWXU:
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
    """Creates, recycles and destroys workspaces under `root`."""

    def __init__(self, root: Path, default_disk_bytes: int, prewarm: int = 4, use_tmpfs: Optional[bool] = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.default_disk_bytes = default_disk_bytes
        self.use_tmpfs = _mountable() if use_tmpfs is None else use_tmpfs
        self.prewarm = prewarm
        self._ready: list[Workspace] = []
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
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={disk_bytes},mode=0755", "tmpfs", str(path)],
                           check=True, capture_output=True)
        return Workspace(path, disk_bytes, self.use_tmpfs)

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
        """Return a default-size workspace to the pool (emptied) or destroy it."""
        if ws.disk_bytes == self.default_disk_bytes:
            with self._lock:
                if len(self._ready) < self.prewarm:
                    try:
                        ws.clear()
                        self._ready.append(ws)
                        return
                    except OSError as exc:  # never hand a workspace with leftovers to the next run
                        logger.warning("destroying workspace %s instead of reusing it: %s", ws.path, exc)
        self.destroy(ws)

    def destroy(self, ws: Workspace) -> None:
        if ws.tmpfs:
            subprocess.run(["umount", "-l", str(ws.path)], capture_output=True)
        if not _remove_tree(ws.path):
            logger.error("could not remove workspace %s", ws.path)

    def close(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for ws in ready:
            self.destroy(ws)
