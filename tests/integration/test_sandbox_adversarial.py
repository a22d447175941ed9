"""Adversarial sandbox suite: one property per test, against every runtime this machine has,
through the real gRPC server; after each attack the server must still answer.

The `process` runtime isolates nothing by design (it says so and refuses to start unless
allowed): it runs the limit tests, and the isolation tests are skipped for it with that reason.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from pathlib import Path

import pytest

from tests.integration.sandbox_servers import runtime_args, start_server

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(300)]

RUNTIMES = ["bwrap", "apptainer", "process"]
ISOLATING = {"bwrap", "apptainer"}


@pytest.fixture(scope="module", params=RUNTIMES)
def server(request):
    if runtime_args(request.param) is None:
        pytest.skip(f"runtime {request.param} is not available here "
                    f"(apptainer: run tests/integration/apptainer/setup.sh; bwrap: apt-get install bubblewrap)")
    srv = start_server(request.param, "--capacity", "4")
    srv.runtime = request.param
    yield srv
    srv.stop()


def _image(server):
    return "python" if server.runtime == "apptainer" else ""


def _exec(server, code, **limits):
    from megatron_rl_sandbox.client import SandboxClient

    async def go():
        async with SandboxClient([server.address], deadline_s=120) as client:
            result = await client.execute(["python3", "-c", code], image=_image(server), limits=limits)
            health = await client.execute(["python3", "-c", "print(6*7)"], image=_image(server))
            return result, health
    result, health = asyncio.run(go())
    assert health.stdout.strip() == b"42", f"the server stopped answering: {health}"
    return result


def _isolating(server):
    if server.runtime not in ISOLATING:
        pytest.skip("the process runtime isolates nothing by design")


def test_infinite_loop_is_killed_at_the_wall_limit(server):
    from megatron_rl_sandbox.client import pb2

    r = _exec(server, "import time\nwhile True: time.sleep(0.01)", wall_time_s=1.5)
    assert r.termination == pb2.TIMEOUT
    assert 1.4 <= r.usage.wall_time_s < 5


def test_cpu_burn_is_killed_at_the_cpu_limit(server):
    from megatron_rl_sandbox.client import pb2

    r = _exec(server, "while True: pass", cpu_time_s=1, wall_time_s=20)
    assert r.termination == pb2.CPU_LIMIT, r


def test_cpu_burn_is_stopped_at_the_limit_not_a_second_later(server):
    """As PID 1 of its namespace the command ignores the soft limit's SIGXCPU, so the hard limit must be
    the limit itself. Measured CPU time of a 1 s-limited burn, less that of a run doing nothing (the
    runtime's own start-up is counted too): ~1 s, ~2 s when the hard limit is a second later."""
    burn = _exec(server, "while True: pass", cpu_time_s=1, wall_time_s=20)
    if burn.usage.cpu_time_s == 0:
        pytest.skip("this server measures no CPU time (no cgroups: the rlimit limiter)")
    idle = _exec(server, "pass")
    assert burn.usage.cpu_time_s - idle.usage.cpu_time_s < 1.5, (burn, idle)


def test_memory_hog_is_killed_and_reported_as_memory(server):
    from megatron_rl_sandbox.client import pb2

    r = _exec(server, "blocks = []\nwhile True: blocks.append(bytearray(16 * 2**20))",
              memory_bytes=128 * 2**20, wall_time_s=20)
    assert r.termination == pb2.MEMORY_LIMIT, r


def test_fork_bomb_is_contained_by_the_process_limit(server):
    from megatron_rl_sandbox.client import pb2

    r = _exec(server, "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
              max_processes=32, wall_time_s=3)
    assert r.termination in (pb2.TIMEOUT, pb2.EXITED, pb2.SIGNALED)
    assert r.usage.wall_time_s < 10


def test_gigabyte_of_stdout_is_truncated_and_flagged(server):
    from megatron_rl_sandbox.client import pb2

    r = _exec(server, "import sys\nchunk = 'x' * 2**20\nfor _ in range(1024): sys.stdout.write(chunk)",
              output_bytes=256 * 1024, wall_time_s=60)
    assert r.termination == pb2.OUTPUT_LIMIT
    assert r.stdout_truncated and len(r.stdout) == 256 * 1024


def test_disk_fill_of_the_workspace_hits_the_limit(server):
    from megatron_rl_sandbox.client import pb2

    r = _exec(server, "f = open('fill', 'wb')\nwhile True: f.write(b'x' * 2**20)",
              disk_bytes=16 * 2**20, wall_time_s=20)
    assert r.termination == pb2.DISK_LIMIT, r


def test_connecting_to_a_host_loopback_port_fails(server):
    _isolating(server)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    r = _exec(server, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    thread.join()
    listener.close()
    assert b"connected" not in r.stdout and r.exit_code != 0
    assert not accepted, "the sandbox reached a port on the host's loopback"


def test_reading_a_host_file_outside_the_image_fails(server):
    _isolating(server)
    name = f"megatron-rl-secret-{uuid.uuid4().hex}"
    secrets = [Path("/tmp") / name, Path("/root") / name, Path(__file__).parent / name]
    for path in secrets:
        path.write_text("TOP-SECRET")
    try:
        for path in secrets:
            r = _exec(server, f"print(open({str(path)!r}).read())")
            assert b"TOP-SECRET" not in r.stdout and r.exit_code != 0, path
    finally:
        for path in secrets:
            path.unlink()


def test_writing_outside_the_workspace_fails(server):
    _isolating(server)
    name = f"megatron-rl-escape-{uuid.uuid4().hex}"
    for path in (Path("/usr") / name, Path("/") / name, Path("/bin") / name):
        r = _exec(server, f"open({str(path)!r}, 'w').write('x')")
        assert r.exit_code != 0, path
        assert not path.exists(), f"the sandbox wrote {path} on the host"


def test_the_private_tmp_does_not_reach_the_host(server):
    _isolating(server)
    path = Path("/tmp") / f"megatron-rl-escape-{uuid.uuid4().hex}"
    _exec(server, f"open({str(path)!r}, 'w').write('x')")
    assert not path.exists(), "the sandbox's /tmp is the host's /tmp"


def test_the_command_is_alone_in_its_pid_namespace(server):
    """No process of the runtime's own (an init or reaper of the same user) shares the sandbox
    with the command: code run by the command could write into such a process's memory and
    stdout and so decide the command's reported outcome (docs/agents.md)."""
    _isolating(server)
    code = "import os\nprint(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    assert _exec(server, code).stdout.split(b"\n")[0] == b"1 [1]"


def test_double_forked_child_outliving_its_parent_is_killed(server):
    marker = f"megatron-rl-orphan-{uuid.uuid4().hex}"
    code = ("import os, subprocess\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execvp('python3', ['python3', '-c', 'import time; time.sleep(120)', '{marker}'])\n"
            "    os._exit(0)\n"
            "os.wait()\nprint('parent done')")
    r = _exec(server, code, wall_time_s=10)
    assert b"parent done" in r.stdout
    import time

    time.sleep(0.3)
    survivors = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, marker)]
    assert not survivors, f"orphaned sandbox processes survived: {[p.name for p in survivors]}"


def _cmdline_has(proc_dir: Path, marker: str) -> bool:
    try:
        return marker.encode() in (proc_dir / "cmdline").read_bytes()
    except OSError:
        return False


def test_invalid_image_or_command_is_a_clear_setup_error(server):
    from megatron_rl_sandbox.client import SandboxClient, pb2

    async def go():
        async with SandboxClient([server.address]) as client:
            return (await client.execute(["python3", "-c", "pass"], image="no-such-image"),
                    await client.execute(["no-such-command-xyz"], image=_image(server)),
                    await client.execute([], image=_image(server)))
    bad_image, bad_command, empty = asyncio.run(go())
    assert bad_image.termination == pb2.SETUP_ERROR and "no-such-image" in bad_image.message
    assert "available" in bad_image.message
    if server.runtime != "process":
        assert bad_command.termination == pb2.SETUP_ERROR and "no-such-command-xyz" in bad_command.message
    else:
        assert bad_command.termination == pb2.SETUP_ERROR or bad_command.exit_code != 0
    assert empty.termination == pb2.SETUP_ERROR and "empty command" in empty.message


def _processes_with(marker: str) -> list[str]:
    return [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, marker)]


def test_a_fifo_in_place_of_a_file_does_not_wedge_the_server(server):
    """The code replaces a file by a FIFO; the server's next WriteFile / ReadFile of it must be
    refused at once (a plain open() of a FIFO blocks until the other end opens: the event loop,
    and every other call with it, would hang)."""
    import grpc

    from megatron_rl_sandbox.client import SandboxClient, pb2

    async def go():
        async with SandboxClient([server.address], deadline_s=10) as client:
            session = await client.open_session({"t.py": "x = 1\n"}, image=_image(server))
            made = await session.exec(["sh", "-c", "rm t.py && mkfifo t.py"])
            errors = []
            for call in (session.write_file("t.py", "x = 2\n"), session.read_file("t.py")):
                try:
                    await call
                except grpc.aio.AioRpcError as exc:
                    errors.append((exc.code(), exc.details()))
            await session.snapshot()  # the FIFO is archived as a FIFO, never opened
            health = (await client.health())[server.address]
            await session.close()
            return made, errors, health
    made, errors, health = asyncio.run(go())
    assert made.exit_code == 0, made
    assert [code for code, _ in errors] == [grpc.StatusCode.FAILED_PRECONDITION] * 2, errors
    assert all("FIFO" in details for _, details in errors), errors
    assert isinstance(health, pb2.HealthReply) and health.serving


@pytest.mark.timeout(60)
def test_a_run_whose_caller_gave_up_is_killed_at_once(server):
    """The client's deadline passes long before the run's wall limit: the server's call is
    cancelled, and the run (with its workspace) must go with it, not run on unlimited."""
    from megatron_rl_sandbox.client import SandboxClient, pb2

    marker = f"megatron-rl-cancelled-{uuid.uuid4().hex}"
    code = f"import time, sys; time.sleep(45)  # {marker}"

    async def go():
        async with SandboxClient([server.address]) as client:
            result = await client.execute(["python3", "-c", code], image=_image(server),
                                          limits={"wall_time_s": 50, "cpu_time_s": 50}, deadline_s=2.0)
            for _ in range(50):  # the cancellation reaches the server right after the deadline
                if not _processes_with(marker):
                    break
                await asyncio.sleep(0.1)
            health = (await client.health())[server.address]
            return result, health
    result, health = asyncio.run(go())
    assert result.termination == pb2.TIMEOUT and "deadline" in result.message
    assert not _processes_with(marker), "the run outlived its cancelled call"
    assert health.running == 0 and health.executions_started == health.executions_finished


def test_read_only_directories_do_not_carry_files_into_the_next_run(tmp_path):
    """Without root a workspace is a plain directory reused by the next run. A run that plants a
    package and makes its directory read-only (`chmod 555`) must not leave it to the next run,
    which would import it (a fake `unittest` that reports success). The server runs as
    `nobody` when the tests run as root."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from megatron_rl_sandbox.client import SandboxClient

    from tests.integration.sandbox_servers import REPO

    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    work_dir = Path(tempfile.mkdtemp(prefix="megatron-rl-sandbox-nonroot-"))
    command = [sys.executable, "-m", "megatron_rl_sandbox.server", "--address", "127.0.0.1:0", "--runtime", "bwrap",
               "--work-dir", str(work_dir), "--prewarm", "1", "--capacity", "1"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv (util-linux) is missing to drop to an unprivileged user")
        os.chown(work_dir, 65534, 65534)
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        probe = subprocess.run([*command[:4], sys.executable, "-c", "import megatron_rl_sandbox.server"],
                               env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
        if probe.returncode != 0:  # e.g. a checkout under a 0700 directory (mktemp -d)
            pytest.skip(f"user nobody cannot run this checkout's Python ({probe.stderr.strip()[-200:]}): clone it "
                        "where other users can read it to run this test")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        line = proc.stdout.readline()
        assert line.startswith("{"), (tmp_path / "server.log").read_text()[-2000:]
        address = json.loads(line)["address"]
        plant = ("mkdir unittest && printf 'print(\"planted\")\\n' > unittest/__init__.py && chmod 555 unittest "
                 "&& chmod 555 .")

        async def go():
            async with SandboxClient([address], deadline_s=30) as client:
                planted = await client.execute(["sh", "-c", plant])
                after = await client.execute(["sh", "-c", "ls -A; touch fresh && echo writable"])
                health = (await client.health())[address]
                return planted, after, health
        planted, after, health = asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(work_dir, ignore_errors=True)
    assert planted.exit_code == 0, planted
    assert after.stdout == b"writable\n", after
    assert health.executions_finished == 2
