"""The sandbox server's parts without a server process: limits validation, cgroup set-up that
fails halfway, the bound on remembered idempotent results, and workspace files that the
sandboxed code replaced by something other than a regular file."""

from __future__ import annotations

import asyncio
import math
import os
import threading

import pytest

from megatron_rl_sandbox.limits import CgroupV1Limiter, Limits
from megatron_rl_sandbox.workspace import Workspace, WorkspaceError, WorkspaceStateError


@pytest.mark.parametrize("field,value", [("memory_bytes", -1), ("disk_bytes", -1), ("max_processes", -5),
                                         ("cpu_time_s", math.nan), ("wall_time_s", math.inf)])
def test_negative_or_non_finite_limits_are_refused(field, value):
    # cgroup v1 reads memory.limit_in_bytes = -1 as "no limit"
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})


def test_zero_limits_still_mean_the_servers_default():
    defaults = Limits()
    merged = defaults.merged(Limits(wall_time_s=0, memory_bytes=0), Limits(memory_bytes=2**40, wall_time_s=1e6))
    assert merged == defaults


def test_a_cgroup_that_cannot_be_set_up_leaves_no_directory_behind(tmp_path):
    parents = {c: tmp_path / c for c in CgroupV1Limiter.CONTROLLERS}
    for controller in ("memory", "pids"):  # cpuacct's parent is missing: its mkdir fails
        parents[controller].mkdir()
    with pytest.raises(FileNotFoundError):
        CgroupV1Limiter(parents).create(Limits())
    assert list(parents["memory"].iterdir()) == [] and list(parents["pids"].iterdir()) == []


def _service(tmp_path, remembered_bytes):
    from megatron_rl_sandbox.service import MAXIMUM, SandboxService

    return SandboxService(None, None, None, Limits(), MAXIMUM, capacity=1, max_queue=1, max_sessions=1, name="t",
                          snapshot_dir=tmp_path, remembered_bytes=remembered_bytes)


def test_remembered_results_are_bounded_by_bytes_and_recent_keys_stay(tmp_path):
    from megatron_rl_sandbox.service import pb2

    service = _service(tmp_path, remembered_bytes=10_000)
    runs = []

    def call(key):
        async def work():
            runs.append(key)
            return pb2.ExecResult(stdout=b"x" * 3000)
        return service._once("Execute", key, None, work)

    async def go():
        for i in range(10):
            await call(f"k{i}")
        await call("k9")  # a retry of the newest: remembered, not run again
        await call("k0")  # the oldest was forgotten: runs again
    asyncio.run(go())
    assert runs == [f"k{i}" for i in range(10)] + ["k0"]
    assert service._result_bytes_total <= 10_000 and len(service._results) == 3  # 3 x ~3 KB fit


def test_one_result_larger_than_the_budget_is_still_remembered(tmp_path):
    from megatron_rl_sandbox.service import pb2

    service = _service(tmp_path, remembered_bytes=100)
    runs = []

    async def work():
        runs.append(1)
        return pb2.ExecResult(stdout=b"x" * 1000)

    async def go():
        await service._once("Execute", "big", None, work)
        await service._once("Execute", "big", None, work)
    asyncio.run(go())
    assert runs == [1]


def _in_thread(fn, timeout_s=5.0):
    """Run fn in a thread; (finished, exception). A blocked open() cannot be interrupted, so the
    thread is a daemon."""
    box = {}

    def target():
        try:
            fn()
        except BaseException as exc:  # noqa: B902 -- reported to the test
            box["exc"] = exc
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), box.get("exc")


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(tmp_path, op):
    workspace = Workspace(tmp_path, disk_bytes=2**20, tmpfs=False)
    os.mkfifo(tmp_path / "t.py")  # what the sandboxed code did: rm t.py && mkfifo t.py
    call = (lambda: workspace.write("t.py", b"print(1)")) if op == "write" else (lambda: workspace.read("t.py", 10))
    finished, exc = _in_thread(call)
    if not finished:  # unblock the stuck open() so that the test process can exit
        os.close(os.open(tmp_path / "t.py", os.O_RDWR | os.O_NONBLOCK))
    assert finished, f"{op} of a FIFO blocked"
    assert isinstance(exc, WorkspaceStateError) and "FIFO" in str(exc)


def test_writing_onto_a_directory_is_a_workspace_state_error(tmp_path):
    workspace = Workspace(tmp_path, disk_bytes=2**20, tmpfs=False)
    (tmp_path / "d").mkdir()
    with pytest.raises(WorkspaceStateError, match="directory"):
        workspace.write("d", b"x")
    (tmp_path / "f").write_text("x")
    with pytest.raises(WorkspaceStateError):
        workspace.write("f/g", b"x")  # a file where the path needs a directory


def test_a_snapshot_with_an_absolute_symlink_restores_and_a_broken_one_changes_nothing(tmp_path):
    workspace = Workspace(tmp_path / "ws", disk_bytes=2**20, tmpfs=False)
    workspace.path.mkdir()
    workspace.write("keep.txt", b"keep")
    os.symlink("/usr/bin/python3", workspace.path / "py")  # as `python -m venv` makes
    os.mkfifo(workspace.path / "pipe")
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    snapshot = snapshots / "a.tar"
    workspace.snapshot(snapshot)
    workspace.write("later.txt", b"later")
    workspace.restore(snapshot)
    assert sorted(os.listdir(workspace.path)) == ["keep.txt", "py"]  # the FIFO is not restored
    assert os.readlink(workspace.path / "py") == "/usr/bin/python3"
    workspace.write("later.txt", b"later")
    broken = snapshots / "broken.tar"
    broken.write_bytes(snapshot.read_bytes()[:700] + b"\xff" * 600)  # a corrupt archive
    with pytest.raises(WorkspaceStateError, match="cannot restore"):
        workspace.restore(broken)
    assert sorted(os.listdir(workspace.path)) == ["keep.txt", "later.txt", "py"]
    assert sorted(os.listdir(tmp_path)) == ["snapshots", "ws"]  # no staging directory left


def test_a_sparse_file_is_snapshotted_by_its_allocated_size_and_restored_sparse(tmp_path):
    """A 1 GiB file with 4 KiB of data: the snapshot on disk holds the data, not 1 GiB of zeros (it was
    built in server memory at its apparent size), and the restored file is sparse again and equal."""
    workspace = Workspace(tmp_path / "ws", disk_bytes=2**20, tmpfs=False)
    workspace.path.mkdir()
    with open(workspace.path / "sparse", "wb") as f:
        f.seek(2**30)
        f.write(b"x" * 4096)
    snapshot = tmp_path / "s.tar"
    size = workspace.snapshot(snapshot)
    assert size == snapshot.stat().st_size < 2**20
    (workspace.path / "sparse").unlink()
    workspace.restore(snapshot)
    restored = workspace.path / "sparse"
    assert restored.stat().st_size == 2**30 + 4096
    assert restored.stat().st_blocks * 512 < 2**20  # holes kept
    with open(restored, "rb") as f:
        f.seek(2**30 - 1)
        assert f.read() == b"\0" + b"x" * 4096


def test_the_disk_limit_is_read_from_the_workspace_not_from_what_the_run_printed(tmp_path):
    workspace = Workspace(tmp_path / "ws", disk_bytes=2**16, tmpfs=False)
    workspace.path.mkdir()
    workspace.write("small", b"x" * 100)
    assert not workspace.full()
    workspace.write("big", b"x" * 2**16)  # a file at the per-file limit (RLIMIT_FSIZE = the disk limit)
    assert workspace.full()


@pytest.mark.parametrize("path,why", [
    ("a" * 256, "component longer"), ("a/" * 2100, "longer than 4096"), ("a\nb", "control character"),
    ("/etc/passwd", "relative"), ("../x", "'..'"), ("", "relative")])
def test_malformed_paths_are_refused_by_name_without_echoing_them(tmp_path, path, why):
    workspace = Workspace(tmp_path, disk_bytes=2**20, tmpfs=False)
    with pytest.raises(WorkspaceError, match=why) as info:
        workspace.write(path, b"x")
    assert len(str(info.value)) < 200


def test_a_pid_1_command_gets_the_cpu_limit_as_its_hard_limit():
    """The kernel drops SIGXCPU for a namespace's init that has no handler: for a command that is PID 1 the
    hard CPU limit (SIGKILL) is the limit itself; other commands get SIGXCPU at it and SIGKILL a second on."""
    from megatron_rl_sandbox.limits import Limiter

    limits = Limits(cpu_time_s=2.5)
    assert "--cpu=3:3" in Limiter().prlimit_args(limits, pid_1=True)
    assert "--cpu=3:4" in Limiter().prlimit_args(limits, pid_1=False)


def test_without_cgroups_a_sigkill_is_read_as_the_cpu_limit_only_for_a_pid_1_command():
    """Nothing inside a PID namespace can SIGKILL its PID 1, so without CPU accounting such a kill is
    presumably the CPU limit's (and says it is inferred); a command that is not PID 1 may have been killed by
    anything; with cgroups the measured CPU time decides."""
    import signal

    from megatron_rl_sandbox.executor import CPU_LIMIT, SIGNALED, _classify

    limits = Limits(cpu_time_s=2)

    def classify(cpu_s, limiter, pid_1):
        return _classify(False, False, False, signal.SIGKILL, 137, cpu_s, limits, limiter, pid_1)

    termination, message = classify(0.0, "rlimit", True)
    assert termination == CPU_LIMIT and "inferred" in message
    assert classify(0.0, "rlimit", False)[0] == SIGNALED
    assert classify(0.3, "cgroup-v1", True)[0] == SIGNALED
    assert classify(2.0, "cgroup-v1", True) == (CPU_LIMIT, "killed at the CPU-time limit of 2s")


def test_an_exit_status_that_reads_as_a_limits_signal_is_not_that_limit():
    """bwrap reports a signal as exit status 128 + N, and the code can exit with it: `os._exit(153)` was
    DISK_LIMIT ("a file exceeded the disk limit") and `os._exit(152)` CPU_LIMIT after 0.02 s of CPU. The
    measurement decides: the CPU time used, a full workspace (`disk_full`)."""
    import signal

    from megatron_rl_sandbox.executor import CPU_LIMIT, DISK_LIMIT, SIGNALED, _classify

    limits = Limits(cpu_time_s=2)

    def classify(sig, cpu_s=0.02, limiter="cgroup-v1", pid_1=True, disk_full=False):
        return _classify(False, False, False, sig, 128 + sig, cpu_s, limits, limiter, pid_1, disk_full)[0]

    assert classify(signal.SIGXFSZ) == SIGNALED
    assert classify(signal.SIGXCPU) == SIGNALED
    assert classify(signal.SIGXCPU, limiter="rlimit") == SIGNALED  # PID 1: the kernel drops a real one
    assert classify(signal.SIGXFSZ, disk_full=True) == DISK_LIMIT
    assert classify(signal.SIGXCPU, cpu_s=2.0) == CPU_LIMIT
    assert classify(signal.SIGXCPU, limiter="rlimit", pid_1=False) == CPU_LIMIT  # nothing measured: trusted
