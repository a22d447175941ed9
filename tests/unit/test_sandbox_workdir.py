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

from megatron_rl_sandbox.workdir import (OWNER, PREFIX, WorkDirInUse, WorkDirUnsafe, _lock_current, claim, mounts_below,
                                         reap_dead_servers)

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


def _killed(owned) -> None:
    """What SIGKILL does to a server's claim: the lock goes, `.owner` stays as it was."""
    os.close(owned.fd)
    owned.fd = -1


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
    _killed(owned)
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
    _killed(live)  # now it died too
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
    _killed(claim(explicit, temporary=False))
    other = tmp_path / "elsewhere"  # not named as a server names its directory
    other.mkdir()
    _killed(claim(other, temporary=True))
    remote = _dead_server_dir(tmp_path)  # another host's (a shared TMPDIR whose flock may be node-local)
    record = json.loads((remote / OWNER).read_text())
    (remote / OWNER).write_text(json.dumps(dict(record, host="another-node")))
    (tmp_path / "hidden").mkdir()
    target = _dead_server_dir(tmp_path / "hidden")
    link = tmp_path / f"{PREFIX}link"  # a symlink to a dead server's directory is not followed
    link.symlink_to(target)
    fake_owner = tmp_path / f"{PREFIX}owner-link"  # .owner as a symlink is not opened
    fake_owner.mkdir()
    (fake_owner / OWNER).symlink_to(target / OWNER)

    assert reap_dead_servers(tmp_path) == []
    for path in (legacy / "workspaces", explicit / OWNER, other / OWNER, target / "snapshots", link, fake_owner,
                 remote / "snapshots"):
        assert os.path.lexists(path), path


@root_only
def test_another_users_directory_is_not_removed(tmp_path):
    dead = _dead_server_dir(tmp_path)
    os.chown(dead, 65534, 65534)
    assert reap_dead_servers(tmp_path) == []
    assert (dead / "snapshots" / "s.tar").exists()


def test_an_explicit_work_dir_is_refused_while_its_server_lives_and_cleaned_after_it_died(tmp_path):
    work_dir = tmp_path / "work"
    work_dir.mkdir(mode=0o711)
    first = claim(work_dir, temporary=False)
    (work_dir / "workspaces" / "ws-a").mkdir(parents=True)
    (work_dir / "workspaces" / "mine").mkdir()  # not named as the server names a workspace
    (work_dir / "snapshots").mkdir()
    (work_dir / "snapshots" / "s.tar").write_bytes(b"tar")
    (work_dir / "snapshots" / "notes.txt").write_text("the user's")
    with pytest.raises(WorkDirInUse, match=f"in use by another sandbox server \\(pid {os.getpid()} on "):
        claim(work_dir, temporary=False)
    assert (work_dir / "workspaces" / "ws-a").is_dir()

    _killed(first)
    second = claim(work_dir, temporary=False)
    assert sorted(p.name for p in (work_dir / "workspaces").iterdir()) == ["mine"]
    assert sorted(p.name for p in (work_dir / "snapshots").iterdir()) == ["notes.txt"]
    (work_dir / "workspaces" / "ws-b").mkdir()
    second.release(remove_owner=False)  # a clean stop: marked stopped, so the next server removes nothing
    assert json.loads((work_dir / OWNER).read_text())["stopped"] is True
    claim(work_dir, temporary=False).release(remove_owner=False)
    assert (work_dir / "workspaces" / "ws-b").is_dir()


def test_a_work_dir_no_server_used_keeps_everything(tmp_path):
    work_dir = tmp_path / "work"
    (work_dir / "workspaces" / "ws-x").mkdir(parents=True)
    (work_dir / "snapshots").mkdir()
    (work_dir / "snapshots" / "kept.tar").write_bytes(b"tar")
    os.chmod(work_dir, 0o711)
    claim(work_dir, temporary=False).release(remove_owner=False)
    assert (work_dir / "workspaces" / "ws-x").is_dir() and (work_dir / "snapshots" / "kept.tar").exists()


def test_an_explicit_work_dir_others_could_change_is_refused(tmp_path):
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    os.chmod(work_dir, 0o775)
    with pytest.raises(WorkDirUnsafe, match="must be a directory of uid .* that only it can write .*mode 775"):
        claim(work_dir, temporary=False)
    os.chmod(work_dir, 0o755)
    (tmp_path / "link").symlink_to(work_dir)  # the directory a symlink names is what is checked and used
    claim(tmp_path / "link", temporary=False).release(remove_owner=False)
    assert (work_dir / OWNER).exists()


def test_a_crashed_server_of_another_host_is_not_taken_for_dead(tmp_path):
    work_dir = tmp_path / "work"
    work_dir.mkdir(mode=0o711)
    _killed(claim(work_dir, temporary=False))
    record = json.loads((work_dir / OWNER).read_text())
    (work_dir / OWNER).write_text(json.dumps(dict(record, host="another-node")))
    (work_dir / "workspaces" / "ws-a").mkdir(parents=True)
    with pytest.raises(WorkDirInUse, match=f"last used by a sandbox server on another-node .* remove {work_dir}/.owner"):
        claim(work_dir, temporary=False)
    assert (work_dir / "workspaces" / "ws-a").is_dir()


def test_a_lock_on_an_owner_file_already_removed_proves_nothing(tmp_path):
    """A stopping server deletes `.owner`, then closes it: a reaper that opened it just before must not take the
    lock it then gets for its owner's death while the directory is still being removed."""
    work_dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=tmp_path))
    owned = claim(work_dir, temporary=True)
    fd = os.open(work_dir / OWNER, os.O_RDONLY)
    try:
        assert not _lock_current(work_dir, fd)  # held
        owned.release(remove_owner=True)
        assert not _lock_current(work_dir, fd)  # free now, but no longer the file .owner names
    finally:
        os.close(fd)


def test_a_tmpdir_others_can_rename_entries_in_is_not_reaped(tmp_path):
    dead = _dead_server_dir(tmp_path)
    os.chmod(tmp_path, 0o777)  # a swap of the checked directory for a symlink would be possible
    try:
        assert reap_dead_servers(tmp_path) == [] and dead.exists()
        os.chmod(tmp_path, 0o1777)  # sticky, as /tmp: only the entry's owner may rename it
        assert reap_dead_servers(tmp_path) == [dead]
    finally:
        os.chmod(tmp_path, 0o700)


@root_only
def test_mounts_are_detached_only_below_the_dead_servers_directory(tmp_path):
    """Stacked mounts all go; a mount a symlink inside the directory points at stays."""
    outside = tmp_path / "outside"
    _mount_tmpfs(outside / "mounted")
    dead = _dead_server_dir(tmp_path, mounts=1)
    assert _libc.mount(b"tmpfs", os.fsencode(dead / "workspaces" / "ws-0"), b"tmpfs", 0, b"size=1m") == 0
    assert len(mounts_below(dead)) == 2  # two layers on one workspace
    (dead / "workspaces" / "escape").symlink_to(outside / "mounted")
    sibling = Path(f"{dead}-2")  # a name that merely starts with the dead directory's
    _mount_tmpfs(sibling)
    assert reap_dead_servers(tmp_path) == [dead]
    assert _in_mountinfo(outside / "mounted") and (outside / "mounted" / "left.txt").exists()
    assert _in_mountinfo(sibling) and (sibling / "left.txt").exists()
    assert mounts_below(dead) == []


@root_only
def test_an_explicit_work_dirs_stale_tmpfs_workspaces_are_detached_and_a_symlinked_one_left_alone(tmp_path):
    work_dir = tmp_path / "work"
    work_dir.mkdir(mode=0o711)
    _killed(claim(work_dir, temporary=False))
    _mount_tmpfs(work_dir / "workspaces" / "ws-a")
    claim(work_dir, temporary=False).release(remove_owner=False)
    assert not _in_mountinfo(work_dir / "workspaces" / "ws-a") and not (work_dir / "workspaces" / "ws-a").exists()

    other = tmp_path / "other"  # workspaces as a symlink to another directory with a mount: nothing there is touched
    _mount_tmpfs(other / "ws-b")
    os.rmdir(work_dir / "workspaces")
    (work_dir / "workspaces").symlink_to(other)
    _killed(claim(work_dir, temporary=False))
    claim(work_dir, temporary=False).release(remove_owner=False)
    assert _in_mountinfo(other / "ws-b") and (other / "ws-b" / "left.txt").exists()
