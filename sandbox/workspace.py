"""Workspaces: the per-execution (or per-session) directory mounted at /workspace.

Each workspace starts empty and is filled with the request's files, so every task starts
from the same state. As root the directory is its own tmpfs of `disk_bytes`: a hard quota
the sandboxed code cannot exceed (writes fail with ENOSPC). Without root it is a plain
directory and the disk limit is enforced per file (RLIMIT_FSIZE) plus a size check after
each run. A pool of ready workspaces of the default size is kept warm so that a request
does not wait for a mount.

Paths in requests are confined to the workspace: absolute paths, `..` and writes through
symlinks are refused.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import tarfile
import threading
import uuid
from pathlib import Path
from typing import Iterable, Optional

logger = logging.getLogger(__name__)


class WorkspaceError(ValueError):
    pass


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
        target.parent.mkdir(parents=True, exist_ok=True)
        if self.tmpfs and self.usage() + len(content) > self.disk_bytes:
            raise WorkspaceError(f"writing {rel!r} ({len(content)} bytes) exceeds the disk limit")
        target.write_bytes(content)
        target.chmod(0o755 if executable else 0o644)
        return len(content)

    def read(self, rel: str, max_bytes: int) -> tuple[bytes, bool, bool]:
        target = self.resolve(rel)
        if not target.is_file():
            return b"", False, False
        with open(target, "rb") as f:
            data = f.read(max_bytes + 1)
        return data[:max_bytes], len(data) > max_bytes, True

    def clear(self) -> None:
        for entry in self.path.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def snapshot(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(str(self.path), arcname=".")
        return buf.getvalue()

    def restore(self, snapshot: bytes) -> None:
        self.clear()
        with tarfile.open(fileobj=io.BytesIO(snapshot), mode="r") as tar:
            tar.extractall(self.path, filter="data")


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
                    except OSError:
                        pass
        self.destroy(ws)

    def destroy(self, ws: Workspace) -> None:
        if ws.tmpfs:
            subprocess.run(["umount", "-l", str(ws.path)], capture_output=True)
        shutil.rmtree(ws.path, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for ws in ready:
            self.destroy(ws)
