"""The sandbox service's contract: verification rewards, sessions with snapshots, idempotency,
back-pressure, failover when a server dies mid-call, graceful drain and discovery."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import pytest

from tests.integration.sandbox_servers import runtime_args, start_server

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(300)]

if runtime_args("bwrap") is None:
    pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)", allow_module_level=True)


@pytest.fixture(scope="module", params=["bwrap", "apptainer"])
def server(request):
    if runtime_args(request.param) is None:
        pytest.skip(f"runtime {request.param} is not available here (run tests/integration/apptainer/setup.sh)")
    srv = start_server(request.param, "--capacity", "4")
    srv.image = "python" if request.param == "apptainer" else ""
    yield srv
    srv.stop()


def _client(*addresses, **kwargs):
    from megatron_rl_sandbox.client import SandboxClient

    return SandboxClient(list(addresses), **kwargs)


def test_verify_rewards_passed_over_total(server):
    candidate = "def add(a, b):\n    return a + b if a < 10 else 0\n"
    tests = [
        {"name": "small", "argv": ["python3", "-c", "from sol import add; assert add(1, 2) == 3"]},
        {"name": "zero", "argv": ["python3", "-c", "from sol import add; assert add(0, 0) == 0"]},
        {"name": "large", "argv": ["python3", "-c", "from sol import add; assert add(20, 1) == 21"]},
        {"name": "stdout", "argv": ["python3", "-c", "from sol import add; print(add(2, 2))"],
         "check_stdout": True, "expected_stdout": b"4\n"},
    ]

    async def go():
        async with _client(server.address) as client:
            return await client.verify({"sol.py": candidate}, tests, image=server.image)
    result = asyncio.run(go())
    assert (result.passed, result.total) == (3, 4)
    assert result.reward == pytest.approx(0.75)
    assert {t.name: t.passed for t in result.tests} == {"small": True, "zero": True, "large": False, "stdout": True}


def test_session_state_snapshot_and_restore(server):
    async def go():
        async with _client(server.address) as client:
            session = await client.open_session({"notes.txt": "v1\n"}, image=server.image)
            r = await session.exec(["sh", "-c", "echo v2 >> notes.txt && cat notes.txt"])
            assert r.stdout == b"v1\nv2\n"
            snap = await session.snapshot()
            await session.write_file("notes.txt", "overwritten\n")
            await session.exec(["sh", "-c", "mkdir -p d && echo x > d/new"])
            assert (await session.read_file("notes.txt")).content == b"overwritten\n"
            await session.restore(snap)
            restored = await session.read_file("notes.txt")
            gone = await session.read_file("d/new")
            await session.close()
            return restored, gone
    restored, gone = asyncio.run(go())
    assert restored.content == b"v1\nv2\n"
    assert not gone.exists


def test_session_paths_cannot_escape_the_workspace(server):
    async def go():
        async with _client(server.address) as client:
            session = await client.open_session(image=server.image)
            errors = []
            for path in ("../escape", "/etc/passwd", "a/../../b"):
                try:
                    await session.write_file(path, "x")
                except grpc.aio.AioRpcError as exc:
                    errors.append(exc.code())
            await session.exec(["ln", "-s", "/etc", "link"])
            try:
                await session.read_file("link/hostname")
            except grpc.aio.AioRpcError as exc:
                errors.append(exc.code())
            await session.close()
            return errors
    assert asyncio.run(go()) == [grpc.StatusCode.INVALID_ARGUMENT] * 4


def test_same_key_never_runs_twice(server):
    from megatron_rl_sandbox.client import pb2, pb2_grpc

    async def go():
        channel = grpc.aio.insecure_channel(server.address)
        stub = pb2_grpc.SandboxStub(channel)
        before = (await stub.Health(pb2.HealthRequest())).executions_started
        key = uuid.uuid4().hex
        request = pb2.ExecuteRequest(idempotency_key=key, image=server.image, argv=["python3", "-c",
                                                                 "import time, random; time.sleep(0.5); print(random.random())"])
        concurrent = await asyncio.gather(stub.Execute(request), stub.Execute(request))
        later = await stub.Execute(request)
        after = (await stub.Health(pb2.HealthRequest())).executions_started
        await channel.close()
        return before, after, concurrent, later
    before, after, concurrent, later = asyncio.run(go())
    assert after - before == 1, "a request with a known key ran again"
    assert concurrent[0].stdout == concurrent[1].stdout == later.stdout


def test_a_full_queue_refuses_instead_of_queueing_without_bound():
    from megatron_rl_sandbox.client import pb2, pb2_grpc

    srv = start_server("bwrap", "--capacity", "1", "--max-queue", "1")
    try:
        async def go():
            channel = grpc.aio.insecure_channel(srv.address)
            stub = pb2_grpc.SandboxStub(channel)
            request = lambda: pb2.ExecuteRequest(idempotency_key=uuid.uuid4().hex,  # noqa: E731
                                                 argv=["sleep", "1"])
            results = await asyncio.gather(*(stub.Execute(request()) for _ in range(5)), return_exceptions=True)
            await channel.close()
            return results
        results = asyncio.run(go())
    finally:
        srv.stop()
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(served) == 2 and len(refused) == 3
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)


def test_server_killed_mid_call_fails_over_with_exactly_one_result():
    a, b = start_server("bwrap", "--name", "server-a"), start_server("bwrap", "--name", "server-b")
    try:
        async def go():
            from megatron_rl_sandbox.client import pb2

            client = _client(a.address, b.address, deadline_s=60)
            # make server-a the obvious choice: server-b looks busy
            client.servers[1].load, client.servers[1].checked = 10.0, time.monotonic()
            client.servers[0].checked = time.monotonic()
            task = asyncio.create_task(client.execute(["sh", "-c", "sleep 1.5; echo finished"]))
            for _ in range(100):
                health = await client.health()
                if isinstance(health[a.address], pb2.HealthReply) and health[a.address].running == 1:
                    break
                await asyncio.sleep(0.05)
            a.kill(signal.SIGKILL)
            result = await task
            await client.close()
            return result
        result = asyncio.run(go())
    finally:
        a.stop()
        b.stop()
    assert result.server == "server-b"
    assert result.stdout == b"finished\n"


def test_sigterm_drains_running_calls_and_removes_discovery(tmp_path, monkeypatch):
    from megatron_rl_sandbox.client import discover, pb2

    # the server's TMPDIR, where its own work directory goes: outside pytest's 0700 tree, which a root server's
    # sandbox user could not traverse
    scratch = Path(tempfile.mkdtemp(prefix="sandbox-tmpdir-"))
    os.chmod(scratch, 0o711)
    monkeypatch.setenv("TMPDIR", str(scratch))
    srv = start_server("bwrap", run_dir=tmp_path)
    made = [p for p in scratch.iterdir() if p.name.startswith("megatron-rl-sandbox-")]
    assert len(made) == 1 and (made[0] / "workspaces").is_dir(), list(scratch.iterdir())
    assert discover(tmp_path) == [srv.address]

    async def go():
        async with _client(srv.address, deadline_s=10) as client:
            task = asyncio.create_task(client.execute(["sh", "-c", "sleep 1; echo drained"]))
            await asyncio.sleep(0.5)
            srv.kill(signal.SIGTERM)
            result = await task
            late = await client.execute(["true"], deadline_s=2)
            return result, late
    result, late = asyncio.run(go())
    srv.proc.wait(timeout=30)
    assert result.stdout == b"drained\n"
    assert late.termination == pb2.TIMEOUT and late.server == "", "a draining server accepted new work"
    assert srv.proc.returncode == 0
    assert discover(tmp_path) == []
    assert not made[0].exists(), f"the server left its work directory behind: {list(made[0].rglob('*'))}"
    scratch.rmdir()


def test_the_next_server_removes_what_a_sigkilled_one_left_and_two_never_share_a_work_dir(tmp_path, monkeypatch):
    """SIGKILL (Slurm's after KillWait, the OOM killer) gives a server no chance to clean up: its work directory
    stays, its prewarmed workspaces mounted (as root). The next server with the same TMPDIR removes it, mounts
    first; a server that lives is never touched, and an explicit --work-dir another server holds is refused."""
    from megatron_rl_sandbox.workdir import mounts_below

    scratch = Path(tempfile.mkdtemp(prefix="sandbox-tmpdir-"))
    os.chmod(scratch, 0o711)
    monkeypatch.setenv("TMPDIR", str(scratch))
    killed = start_server("bwrap", "--prewarm", "3")
    live = start_server("bwrap", "--prewarm", "3")
    try:
        owners = {json.loads((d / ".owner").read_text())["pid"]: d for d in scratch.iterdir()}
        dirs = [owners[killed.proc.pid], owners[live.proc.pid]]
        assert len(owners) == 2 and all((d / "workspaces").is_dir() for d in dirs), owners
        expected_mounts = 3 if os.geteuid() == 0 else 0
        assert [len(mounts_below(d)) for d in dirs] == [expected_mounts] * 2
        killed.kill(signal.SIGKILL)
        killed.proc.wait(timeout=30)
        assert dirs[0].exists() and len(mounts_below(dirs[0])) == expected_mounts  # what SIGKILL leaves

        third = start_server("bwrap", "--prewarm", "1")
        third.stop()
        assert not dirs[0].exists() and mounts_below(dirs[0]) == []
        assert f"removed the work directory {dirs[0]} of a sandbox server that did not stop cleanly" in \
            third.log.read_text()
        assert (dirs[1] / "workspaces").is_dir() and len(mounts_below(dirs[1])) == expected_mounts  # alive
        assert sorted(scratch.iterdir()) == [dirs[1]]  # the third removed its own at its exit

        work_dir = scratch / "explicit"
        holder = start_server("bwrap", "--work-dir", str(work_dir), "--prewarm", "1")
        try:
            with pytest.raises(RuntimeError, match=f"--work-dir {work_dir} is in use by another sandbox server "
                                                   f"\\(pid {holder.proc.pid} on "):
                start_server("bwrap", "--work-dir", str(work_dir), log=tmp_path / "refused.log")
        finally:
            holder.stop()
    finally:
        live.stop()
        killed.kill()
    assert sorted(p.name for p in scratch.iterdir()) == ["explicit"] and mounts_below(scratch) == []
    shutil.rmtree(scratch)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_command_killed_by_a_stop_signal_the_server_got_too_runs_again(sig):
    """Slurm signals every process of a step, the commands a sandbox server runs too (SIGTERM at the job's end,
    srun's forward of USR1 in the training step, where rank 0's server runs): the killed execution is no result
    (its failure is the signal's, not the code's), and the client's retry with the same key runs it again."""
    from megatron_rl_sandbox.client import pb2

    srv = start_server("bwrap", "--ignore-sigterm")
    try:
        async def go():
            async with _client(srv.address, deadline_s=60) as client:
                task = asyncio.create_task(client.execute(["sh", "-c", "sleep 1.5; echo finished"]))
                for _ in range(100):
                    health = (await client.health())[srv.address]
                    if isinstance(health, pb2.HealthReply) and health.running == 1:
                        break
                    await asyncio.sleep(0.05)
                srv.signal_step(sig)
                return await task
        result = asyncio.run(go())
        assert srv.proc.poll() is None, "the server stopped"
    finally:
        srv.stop()
    assert result.termination == pb2.EXITED and result.stdout == b"finished\n", result
    assert "a stop signal came while a command ran" in srv.log.read_text()


def test_a_session_command_killed_by_a_stop_signal_is_refused_with_the_workspace_as_it_left_it():
    """In a session the killed command is not run again (it may have changed the workspace before the signal):
    SessionInterrupted, nothing remembered; the workspace holds what the command did; restoring a snapshot
    and running the command again gives the undisturbed result (what the repository environment does)."""
    from megatron_rl_sandbox.client import SessionInterrupted, pb2

    srv = start_server("bwrap", "--ignore-sigterm")
    command = ["sh", "-c", "echo ran >> log.txt; sleep 1.5; cat log.txt"]
    try:
        async def go():
            async with _client(srv.address, deadline_s=60) as client:
                session = await client.open_session({"log.txt": ""})
                snapshot = await session.snapshot()
                task = asyncio.create_task(session.exec(command, key="the-command"))
                for _ in range(200):  # until the command sleeps (after its echo)
                    if srv.runs("sleep"):
                        break
                    await asyncio.sleep(0.02)
                srv.signal_step(signal.SIGTERM)
                with pytest.raises(SessionInterrupted, match="a stop signal came while the command ran"):
                    await task
                left = (await session.read_file("log.txt")).content
                await session.restore(snapshot)
                again = await session.exec(command, key="the-command")  # not remembered: it runs
                await session.close()
                return left, again
        left, again = asyncio.run(go())
        assert srv.proc.poll() is None, "the server stopped"
    finally:
        srv.stop()
    assert left == b"ran\n"
    assert again.termination == pb2.EXITED and again.stdout == b"ran\n", again


def test_late_reward_is_a_timeout_result_not_a_hang(server):
    from megatron_rl_sandbox.client import pb2

    async def go():
        async with _client(server.address) as client:
            start = time.monotonic()
            result = await client.execute(["sleep", "30"], image=server.image, limits={"wall_time_s": 60},
                                          deadline_s=1.0)
            return result, time.monotonic() - start
    result, elapsed = asyncio.run(go())
    assert result.termination == pb2.TIMEOUT and elapsed < 5
    assert "deadline" in result.message


def test_discovery_file_names_the_address(tmp_path):
    srv = start_server("bwrap", run_dir=tmp_path)
    try:
        (entry,) = (tmp_path / "sandbox").glob("*.json")
        info = json.loads(entry.read_text())
        assert info["address"] == srv.address and info["runtime"] == "bwrap"
    finally:
        srv.stop()


def test_sessions_left_open_are_closed_after_the_idle_timeout():
    """A client that dies never closes its sessions: the server closes those no call has used for
    --session-idle-timeout-s (1 s here), which frees their workspaces and their place under
    --max-sessions (2 here). A session whose call runs longer than the timeout is not idle: it
    stays open and is used right after the call."""
    from megatron_rl_sandbox.client import SandboxUnavailable

    srv = start_server("bwrap", "--session-idle-timeout-s", "1", "--max-sessions", "2")

    async def go():
        async with _client(srv.address) as client:
            abandoned = await client.open_session({"a.txt": "a"})
            busy = await client.open_session()
            long_call = await busy.exec(["sh", "-c", "sleep 2.5; echo done"], limits={"wall_time_s": 10})
            await asyncio.sleep(0.6)  # idle 0.6 s since the call ended, 3.1 s since it began
            again = await busy.exec(["echo", "still open"])
            fresh = await client.open_session(deadline_s=5)  # room: the abandoned session was closed
            health = (await client.health())[srv.address]
            try:
                await abandoned.read_file("a.txt", deadline_s=5)
                lost = None
            except (grpc.aio.AioRpcError, SandboxUnavailable) as exc:
                lost = exc
            await fresh.close()
            return long_call, again, health, lost
    try:
        long_call, again, health, lost = asyncio.run(go())
    finally:
        srv.stop()
    assert long_call.stdout == b"done\n" and again.stdout == b"still open\n"
    assert (health.sessions, health.sessions_reaped) == (2, 1)
    assert lost is not None and "is not open" in str(lost), lost
    assert "unused for" in srv.log.read_text()


def test_workspace_errors_are_final_answers_not_a_dead_server(server):
    """Writing onto a directory, or restoring a snapshot too large for the session's disk limit,
    fails at once with FAILED_PRECONDITION (not UNKNOWN, which the client retries until its
    deadline and then takes for a dead server); the failed restore leaves the workspace as it was.
    A snapshot holding an absolute symlink (as `python -m venv` makes) restores."""
    async def go():
        async with _client(server.address, deadline_s=20) as client:
            big = await client.open_session(image=server.image)
            made = await big.exec(["sh", "-c", "head -c 3000000 /dev/zero > big && mkdir d && ln -s /usr/bin/python3 py"])
            assert made.exit_code == 0, made  # else what follows tests nothing (a file d, a small snapshot)
            start = time.monotonic()
            codes = []
            try:
                await big.write_file("d", "x")
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
            big_snapshot = await big.snapshot()
            await big.restore(big_snapshot)
            link = await big.exec(["readlink", "py"])
            small = await client.open_session({"mine.txt": "mine"}, image=server.image, limits={"disk_bytes": 2**20})
            try:
                await small.restore(big_snapshot)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
            elapsed = time.monotonic() - start
            kept = await small.read_file("mine.txt")
            healthy = client.servers[0].healthy
            await big.close()
            await small.close()
            return codes, elapsed, link, kept, healthy
    codes, elapsed, link, kept, healthy = asyncio.run(go())
    assert codes == [grpc.StatusCode.FAILED_PRECONDITION] * 2
    assert elapsed < 10 and healthy
    assert link.stdout == b"/usr/bin/python3\n"
    assert kept.content == b"mine"


def test_negative_or_nan_limits_are_invalid_arguments(server):
    """cgroup v1 reads a memory limit of -1 as "none"; NaN reached the cgroup writes."""
    from megatron_rl_sandbox.client import pb2, pb2_grpc

    async def go():
        codes = []
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb2_grpc.SandboxStub(channel)
            for limits in (pb2.Limits(memory_bytes=-1), pb2.Limits(disk_bytes=-1),
                           pb2.Limits(cpu_time_s=float("nan")), pb2.Limits(max_processes=-1)):
                try:
                    await stub.Execute(pb2.ExecuteRequest(idempotency_key=uuid.uuid4().hex, image=server.image,
                                                          argv=["true"], limits=limits), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            health = await stub.Health(pb2.HealthRequest(), timeout=10)
        return codes, health
    codes, health = asyncio.run(go())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert health.running == 0


def test_snapshots_go_with_their_session(tmp_path):
    """A snapshot lives as long as the session that took it: deleted at Close and when an
    abandoned session is closed after the idle timeout (restores are into a session of the same
    server; recovery on another server starts from the task's files)."""
    from megatron_rl_sandbox.client import SandboxUnavailable

    # a work dir that a root server's sandbox user (nobody) can reach: pytest's tmp_path is under a 0700 directory
    base = Path(tempfile.mkdtemp(prefix="megatron-rl-sandbox-", dir="/var/tmp"))
    os.chmod(base, 0o711)
    work_dir = base / "work"
    srv = start_server("bwrap", "--work-dir", str(work_dir), "--session-idle-timeout-s", "1")
    snapshots = work_dir / "snapshots"

    async def go():
        async with _client(srv.address, deadline_s=20) as client:
            closed = await client.open_session({"a.txt": "a"})
            abandoned = await client.open_session({"b.txt": "b"})
            snap = await closed.snapshot()
            await abandoned.snapshot()
            taken = len(list(snapshots.glob("*.tar")))
            await closed.close()
            after_close = len(list(snapshots.glob("*.tar")))
            other = await client.open_session()
            try:
                await other.restore(snap, deadline_s=5)
                restored = True
            except (grpc.aio.AioRpcError, SandboxUnavailable):
                restored = False
            await asyncio.sleep(2.0)  # the abandoned session is reaped (other was used 2 s ago too)
            return taken, after_close, restored, len(list(snapshots.glob("*.tar")))
    try:
        taken, after_close, restored, after_reap = asyncio.run(go())
    finally:
        srv.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert (taken, after_close, restored, after_reap) == (2, 1, False, 0)


def test_a_server_without_cgroups_says_what_it_does_not_enforce():
    """... and still reports a CPU burn as stopped at the CPU limit, though it measures no CPU time: the
    command, PID 1 of its namespace, cannot be SIGKILLed from inside it, so the kernel's kill at the hard
    limit is inferred (the message says so; an exit status of 137 would read the same)."""
    from megatron_rl_sandbox.client import SandboxClient, pb2, pb2_grpc

    srv = start_server("bwrap", "--limiter", "rlimit")

    async def go():
        async with grpc.aio.insecure_channel(srv.address) as channel:
            health = await pb2_grpc.SandboxStub(channel).Health(pb2.HealthRequest(), timeout=10)
        async with SandboxClient([srv.address], deadline_s=60) as client:
            burn = await client.execute(["python3", "-c", "while True: pass"],
                                        limits={"cpu_time_s": 1, "wall_time_s": 20})
        return health, burn
    try:
        health, burn = asyncio.run(go())
    finally:
        srv.stop()
    assert burn.termination == pb2.CPU_LIMIT, burn
    assert health.limiter == "rlimit"
    warnings = [line for line in srv.log.read_text().splitlines() if " WARNING " in line]
    assert any("NOT killed" in line and "RLIMIT_AS" in line for line in warnings), warnings
