"""A sandbox server's work directory (sandbox/workdir.py): the lock that says its server lives, and the reaping of
what a server killed without a chance to clean up left. A dead server is a claim whose lock was dropped without
removing `.owner` (what the kernel does to a killed process's flock); the test with a real SIGKILLed server is
tests/integration/test_sandbox_service.py. Mounts need root: those cases are skipped without it."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import tempfile
from pathlib import Path

import pytest

from megatron_rl_sandbox.workdir import OWNER, PREFIX, WorkDirInUse, claim, mounts_below, reap_dead_servers

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


@pytest.fixture(autouse=True)
def _no_mount_left(tmp_path):
    """A failing test still detaches what it mounted."""
    yield
    for point in mounts_below(tmp_path):
        _libc.umount2(os.fsencode(point), 2)  # MNT_DETACH


def _mount_tmpfs(path: Path) -> None:
    path.mkdir(parents=True)
    assert _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, b"size=1m") == 0, os.strerror(ctypes.get_errno())
    (path / "left.txt").write_text("x")


def _in_mountinfo(path: Path) -> bool:
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_bytes().splitlines()]
    return os.fsencode(str(path)).replace(b" ", b"\\040") in points


def _dead_server_dir(parent: Path, mounts: int = 0) -> Path:
    """A server's temporary work directory as SIGKILL leaves it: workspaces (tmpfs as root), a snapshot,
    `.owner` in place, nobody holding its lock."""
    work_dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    owned = claim(work_dir, temporary=True)
    (work_dir / "snapshots").mkdir()
    (work_dir / "snapshots" / "s.tar").write_bytes(b"tar")
    (work_dir / "workspaces").mkdir()
    for i in range(mounts):
        _mount_tmpfs(work_dir / "workspaces" / f"ws-{i}")
    owned.release(remove_owner=False)
    return work_dir


def test_a_dead_servers_directory_is_removed_and_a_live_ones_is_not(tmp_path):
    dead = _dead_server_dir(tmp_path)
    live_dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=tmp_path))
    live = claim(live_dir, temporary=True)
    (live_dir / "workspaces").mkdir()
    assert json.loads((live_dir / OWNER).read_text())["pid"] == os.getpid()

    assert reap_dead_servers(tmp_path) == [dead]
    assert not dead.exists()
    assert (live_dir / "workspaces").is_dir() and (live_dir / OWNER).exists()
    live.release(remove_owner=False)  # now it died too
    assert reap_dead_servers(tmp_path) == [live_dir]
    assert list(tmp_path.iterdir()) == []


@root_only
def test_a_dead_servers_tmpfs_workspaces_are_detached_before_removal(tmp_path):
    parent = tmp_path / "tmp dir"  # mountinfo escapes the space: it must still be found
    parent.mkdir()
    dead = _dead_server_dir(parent, mounts=3)
    assert len(mounts_below(dead)) == 3 and all(_in_mountinfo(Path(p)) for p in mounts_below(dead))
    assert reap_dead_servers(parent) == [dead]
    assert not dead.exists()
    assert not any(_in_mountinfo(dead / "workspaces" / f"ws-{i}") for i in range(3))


def test_what_is_not_a_dead_servers_temporary_directory_is_left_alone(tmp_path):
    legacy = tmp_path / f"{PREFIX}legacy"  # no .owner: a server still starting, or older code
    (legacy / "workspaces").mkdir(parents=True)
    explicit = tmp_path / f"{PREFIX}explicit"  # a user's --work-dir: its next server cleans it
    explicit.mkdir()
    claim(explicit, temporary=False).release(remove_owner=False)
    other = tmp_path / "elsewhere"  # not named as a server names its directory
    other.mkdir()
    claim(other, temporary=True).release(remove_owner=False)
    (tmp_path / "hidden").mkdir()
    target = _dead_server_dir(tmp_path / "hidden")
    link = tmp_path / f"{PREFIX}link"  # a symlink to a dead server's directory is not followed
    link.symlink_to(target)
    fake_owner = tmp_path / f"{PREFIX}owner-link"  # .owner as a symlink is not opened
    fake_owner.mkdir()
    (fake_owner / OWNER).symlink_to(target / OWNER)

    assert reap_dead_servers(tmp_path) == []
    for path in (legacy / "workspaces", explicit / OWNER, other / OWNER, target / "snapshots", link, fake_owner):
        assert os.path.lexists(path), path


@root_only
def test_another_users_directory_is_not_removed(tmp_path):
    dead = _dead_server_dir(tmp_path)
    os.chown(dead, 65534, 65534)
    assert reap_dead_servers(tmp_path) == []
    assert (dead / "snapshots" / "s.tar").exists()


def test_an_explicit_work_dir_is_refused_while_its_server_lives_and_cleaned_after_it_died(tmp_path):
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    first = claim(work_dir, temporary=False)
    (work_dir / "workspaces" / "ws-a").mkdir(parents=True)
    (work_dir / "snapshots").mkdir()
    (work_dir / "snapshots" / "s.tar").write_bytes(b"tar")
    (work_dir / "keep.txt").write_text("the user's")
    with pytest.raises(WorkDirInUse, match=f"in use by another sandbox server \\(pid {os.getpid()} on "):
        claim(work_dir, temporary=False)
    assert (work_dir / "workspaces" / "ws-a").is_dir()

    first.release(remove_owner=False)  # killed
    second = claim(work_dir, temporary=False)
    assert not (work_dir / "workspaces").exists() and not (work_dir / "snapshots").exists()
    assert (work_dir / "keep.txt").read_text() == "the user's"  # only what a server makes is removed
    second.release(remove_owner=True)
    assert sorted(p.name for p in work_dir.iterdir()) == ["keep.txt"]


@root_only
def test_an_explicit_work_dirs_stale_tmpfs_workspaces_are_detached(tmp_path):
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    claim(work_dir, temporary=False).release(remove_owner=False)
    _mount_tmpfs(work_dir / "workspaces" / "ws-a")
    claim(work_dir, temporary=False).release(remove_owner=True)
    assert not _in_mountinfo(work_dir / "workspaces" / "ws-a") and not (work_dir / "workspaces").exists()
