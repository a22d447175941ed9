"""The sandbox against a real deployment's failure modes, through the real gRPC server: a server
running as root (the demo's, CI's and many clusters'), exactly-once execution under load, large
and malformed messages, limits per run rather than per process, fresh workspaces, whole-request
admission and clean output. Each test failed before its fix (docs/sandbox.md, "Threat model").
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from tests.integration.sandbox_servers import runtime_args, start_server

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(300)]

if runtime_args("bwrap") is None:
    pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)", allow_module_level=True)

ISOLATING = ["bwrap", "apptainer"]


def _client(*addresses, **kwargs):
    from megatron_rl_sandbox.client import SandboxClient

    return SandboxClient(list(addresses), **kwargs)


@pytest.fixture(scope="module", params=ISOLATING)
def server(request):
    if runtime_args(request.param) is None:
        pytest.skip(f"runtime {request.param} is not available here (run tests/integration/apptainer/setup.sh)")
    srv = start_server(request.param, "--capacity", "2")
    srv.runtime = request.param
    srv.image = "python" if request.param == "apptainer" else ""
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bwrap_server():
    srv = start_server("bwrap", "--capacity", "2")
    yield srv
    srv.stop()


def _run(server, argv, **kwargs):
    async def go():
        async with _client(server.address, deadline_s=120) as client:
            return await client.execute(argv, image=getattr(server, "image", ""), **kwargs)
    return asyncio.run(go())


def _python(server, code, **limits):
    return _run(server, ["python3", "-c", code], limits=limits)


# -- 1. a root server ------------------------------------------------------------------------
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs a server running as root (CI runs as root)")

CORE_PATTERN = """
import errno
current = open('/proc/sys/kernel/core_pattern').read()
try:
    with open('/proc/sys/kernel/core_pattern', 'w') as f:
        f.write(current)  # the value it already has: harmless if this test ever fails
    print('WROTE')
except OSError as exc:
    print('refused', errno.errorcode[exc.errno])
"""


@root_only
def test_kernel_knobs_cannot_be_written_from_a_root_servers_sandbox(server):
    r = _python(server, CORE_PATTERN)
    assert r.exit_code == 0, r
    assert r.stdout.startswith(b"refused"), r.stdout


@root_only
def test_a_sandboxed_process_is_not_host_root(server):
    """The uid the host sees for the running command (and every process of its run) is not 0."""
    marker = uuid.uuid4().hex

    async def go():
        async with _client(server.address, deadline_s=60) as client:
            task = asyncio.create_task(client.execute(
                ["python3", "-c", f"import time; time.sleep(3)  # {marker}"], image=server.image))
            uids = {}
            deadline = time.monotonic() + 10
            while not uids and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                for pid in server.descendants():
                    try:
                        if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                            status = Path(f"/proc/{pid}/status").read_text()
                            uids[pid] = [int(x) for x in status.split("Uid:")[1].split("\n")[0].split()]
                    except OSError:
                        continue
            return uids, await task
    uids, result = asyncio.run(go())
    assert uids, "the sandboxed process was not found under the server"
    assert all(uid != 0 for row in uids.values() for uid in row), uids
    assert result.exit_code == 0, result


@root_only
def test_a_server_refuses_to_run_code_as_root(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megatron_rl_sandbox.server", "--sandbox-uid", "0",
                           "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "must not run as uid/gid 0" in done.stderr, done.stderr


# -- 2. exactly once ---------------------------------------------------------------------------
def test_every_call_runs_exactly_once_under_load(bwrap_server):
    """Fast commands under CPU stress: the server answered UNKNOWN (ProcessLookupError) when a command
    exited before it opened a pidfd, and the client's retry ran it again (300 calls: 1,451 runs)."""
    calls, appends = 150, 60
    stress = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]

    async def go():
        async with _client(bwrap_server.address, deadline_s=240) as client:
            before = (await client.health())[bwrap_server.address].executions_started
            results = await asyncio.gather(*(client.execute(["true"]) for _ in range(calls)))
            after = (await client.health())[bwrap_server.address].executions_started
            session = await client.open_session()
            await asyncio.gather(*(session.exec(["sh", "-c", "echo x >> log"]) for _ in range(appends)))
            log = await session.read_file("log")
            await session.close()
            return results, after - before, log.content
    try:
        results, runs, log = asyncio.run(go())
    finally:
        for p in stress:
            p.kill()
    from megatron_rl_sandbox.client import pb2

    assert [(r.termination, r.exit_code) for r in results] == [(pb2.EXITED, 0)] * calls
    assert runs == calls
    assert log.count(b"x\n") == appends


def test_a_retried_request_id_returns_the_first_result(bwrap_server):
    async def go():
        async with _client(bwrap_server.address) as client:
            first = await client.execute(["python3", "-c", "import uuid; print(uuid.uuid4())"], key="same-id")
            again = await client.execute(["python3", "-c", "import uuid; print(uuid.uuid4())"], key="same-id")
            return first, again
    first, again = asyncio.run(go())
    assert first.stdout == again.stdout and len(first.stdout) == 37


# -- 3. large replies and requests -------------------------------------------------------------
def test_a_reply_over_grpcs_default_4_mib_arrives_whole(bwrap_server):
    r = _python(bwrap_server, "import sys; sys.stdout.write('x' * (6 * 2**20))", output_bytes=8 * 2**20)
    assert r.server and len(r.stdout) == 6 * 2**20 and not r.stdout_truncated
    assert r.stdout_size == 6 * 2**20


def test_a_reply_over_the_message_limit_is_cut_and_flagged():
    srv = start_server("bwrap", "--max-message-bytes", str(2 * 2**20))
    try:
        async def go():
            async with _client(srv.address, max_message_bytes=2 * 2**20) as client:
                one = await client.execute(["python3", "-c", "import sys; sys.stdout.write('y' * (3 * 2**20))"],
                                           limits={"output_bytes": 4 * 2**20})
                tests = [{"name": str(i), "argv": ["python3", "-c", "print('z' * 2**20)"]} for i in range(3)]
                many = await client.verify({}, tests, limits={"output_bytes": 4 * 2**20})
                return one, many
        one, many = asyncio.run(go())
    finally:
        srv.stop()
    from megatron_rl_sandbox.client import pb2

    assert one.termination == pb2.EXITED and one.stdout_truncated and one.stdout_size == 3 * 2**20
    assert 2**20 < len(one.stdout) < 2 * 2**20 and set(one.stdout) == {ord("z") - 1}
    assert one.ByteSize() <= 2 * 2**20
    assert (many.passed, many.total) == (3, 3)
    assert all(t.result.stdout_truncated and t.result.stdout_size == 2**20 + 1 for t in many.tests)
    assert len({len(t.result.stdout) for t in many.tests}) == 1  # cut to one length, the largest first
    assert many.ByteSize() <= 2 * 2**20


def test_an_oversized_request_is_refused_at_once_naming_the_limit():
    srv = start_server("bwrap", "--max-message-bytes", str(2**20))
    try:
        async def go():
            codes = []
            for limit in (2**20, 8 * 2**20):  # refused by this client, and by the server's gRPC
                async with _client(srv.address, deadline_s=60, max_message_bytes=limit) as client:
                    start = time.monotonic()
                    try:
                        await client.execute(["true"], {"big.bin": b"\0" * (3 * 2**20)})
                    except grpc.aio.AioRpcError as exc:
                        codes.append((exc.code(), exc.details(), time.monotonic() - start))
            return codes
        codes = asyncio.run(go())
    finally:
        srv.stop()
    assert len(codes) == 2
    for code, details, elapsed in codes:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and elapsed < 10
    assert all(str(2**20) in details for _, details, _ in codes), codes


# -- 4. bad arguments ----------------------------------------------------------------------------
def test_malformed_arguments_are_final_invalid_argument_without_echo(bwrap_server):
    """Over-long paths, ids and keys came back as UNKNOWN or as oversized error metadata (the details
    echoed the input), which the client retried until its deadline."""
    from megatron_rl_sandbox.client import Session

    async def go():
        async with _client(bwrap_server.address, deadline_s=60) as client:
            session = await client.open_session()
            attempts = {
                "long path": lambda: client.execute(["true"], {"a/" * 50_000 + "x": b""}),
                "long name": lambda: client.execute(["true"], {"n" * 300: b""}),
                "long key": lambda: client.execute(["true"], key="k" * 100_000),
                "env name": lambda: client.execute(["true"], env={"A=B": "1"}),
                "long session id": lambda: Session(client, session.server, "s" * 100_000).exec(["true"]),
                "negative max_bytes": lambda: session.read_file("log", max_bytes=-2),
                "long read path": lambda: session.read_file("p" * 10_000),
            }
            out = {}
            for what, call in attempts.items():
                start = time.monotonic()
                try:
                    await call()
                    out[what] = None
                except grpc.aio.AioRpcError as exc:
                    out[what] = (exc.code(), len(exc.details() or ""), time.monotonic() - start)
            health = (await client.health())[bwrap_server.address]
            await session.close()
            return out, health
    out, health = asyncio.run(go())
    for what, got in out.items():
        assert got is not None, f"{what} was accepted"
        code, size, elapsed = got
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code)
        assert size < 300 and elapsed < 5, (what, size, elapsed)
    assert health.serving


# -- 5. resources per run ------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", ["bwrap", "apptainer", "process"])
def test_the_cpu_limit_bounds_the_runs_total_not_each_process(runtime):
    """Eight forked burners, 1 s of CPU for the run: each had 1 s of its own (8 s in all) before."""
    if runtime_args(runtime) is None:
        pytest.skip(f"runtime {runtime} is not available here")
    srv = start_server(runtime)
    srv.image = "python" if runtime == "apptainer" else ""
    code = "import os\nfor _ in range(8):\n    if os.fork() == 0:\n        while True: pass\nos.wait()"
    try:
        r = _python(srv, code, cpu_time_s=1, wall_time_s=30)
    finally:
        srv.stop()
    from megatron_rl_sandbox.client import pb2

    assert r.termination == pb2.CPU_LIMIT, r
    assert r.usage.cpu_time_s < 3.0 and r.usage.wall_time_s < 20, r.usage  # eight processes of 1 s each: 8 s


def _hwm_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def test_a_sparse_file_is_snapshotted_without_inflating_in_server_memory(bwrap_server):
    """A 900 MiB sparse file holding one byte: the snapshot was built in server memory at the file's
    apparent size (756 MiB measured for a smaller one)."""
    async def go():
        async with _client(bwrap_server.address, deadline_s=120) as client:
            session = await client.open_session(limits={"disk_bytes": 2**30})
            made = await session.exec(["python3", "-c", "f = open('s', 'wb'); f.truncate(900 * 2**20); f.write(b'x')"])
            before = _hwm_bytes(bwrap_server.proc.pid)
            snapshot = await session.snapshot()
            await session.exec(["rm", "s"])
            await session.restore(snapshot)
            size = await session.exec(["python3", "-c", "import os; print(os.stat('s').st_size)"])
            after = _hwm_bytes(bwrap_server.proc.pid)
            await session.close()
            return made, before, after, size
    made, before, after, size = asyncio.run(go())
    assert made.exit_code == 0, made
    assert size.stdout == b"%d\n" % (900 * 2**20), size
    assert after - before < 64 * 2**20, (before, after)


def test_printing_no_space_left_is_not_the_disk_limit(server):
    from megatron_rl_sandbox.client import pb2

    r = _python(server, "import sys; sys.stderr.write('OSError: [Errno 28] No space left on device\\n'); "
                        "sys.exit(1)")
    assert (r.termination, r.exit_code) == (pb2.EXITED, 1), r
    full = _python(server, "f = open('fill', 'wb')\nwhile True: f.write(b'x' * 2**20)", disk_bytes=8 * 2**20)
    assert full.termination == pb2.DISK_LIMIT, full


# -- 6. a fresh workspace for every run ------------------------------------------------------------
def test_nothing_a_run_sets_on_its_workspace_reaches_the_next(server):
    """Extended attributes, times and the mode of /workspace itself survived into the next run of a
    reused workspace."""
    setter = ("import os\nos.utime('/workspace', (1, 1))\nos.chmod('/workspace', 0o700)\n"
              "try:\n    os.setxattr('/workspace', 'user.mark', b'1')\nexcept OSError as e:\n    print('noxattr', e)")
    reader = ("import os\nst = os.stat('/workspace')\n"
              "print(int(st.st_mtime), oct(st.st_mode & 0o777), os.listxattr('/workspace'))")
    results = []
    for _ in range(3):  # more runs than the pool's ready workspaces (2 in flight at most)
        assert _python(server, setter).exit_code == 0
        results.append(_python(server, reader))
    for r in results:
        mtime, mode, xattrs = r.stdout.decode().split(maxsplit=2)
        assert int(mtime) > 1 and mode == "0o755" and xattrs.strip() == "[]", r.stdout


# -- 7. Verify is admitted as a whole -----------------------------------------------------------------
def test_a_verify_is_admitted_whole_and_runs_each_test_once():
    """Capacity 1, room for 2 waiting, one long run holding the slot: a Verify of 3 tests cannot all wait,
    so it is refused whole until the slot frees, then runs each test once (it ran tests 3-5 times before:
    some were admitted and ran, the rest were refused, and the retry ran them all again). A Verify that
    could never fit is refused at once."""
    srv = start_server("bwrap", "--capacity", "1", "--max-queue", "2", "--prewarm", "1")
    try:
        async def go():
            async with _client(srv.address, deadline_s=60) as client:
                before = (await client.health())[srv.address].executions_started
                blocker = asyncio.create_task(client.execute(["sleep", "1.5"]))
                await asyncio.sleep(0.5)
                tests = [{"name": str(i), "argv": ["true"]} for i in range(3)]
                verdict = await client.verify({}, tests)
                await blocker
                after = (await client.health())[srv.address].executions_started
                try:
                    await client.verify({}, [{"name": str(i), "argv": ["true"]} for i in range(4)])
                    never = None
                except grpc.aio.AioRpcError as exc:
                    never = exc.code()
                return verdict, after - before, never
        verdict, runs, never = asyncio.run(go())
    finally:
        srv.stop()
    assert (verdict.passed, verdict.total) == (3, 3)
    assert runs == 1 + 3
    assert never == grpc.StatusCode.INVALID_ARGUMENT


# -- 8. clean output ---------------------------------------------------------------------------------
def test_a_silent_program_has_an_empty_stderr(server):
    r = _python(server, "pass")
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"", b""), r


@root_only
@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler to build the preloaded library")
def test_the_requests_environment_never_reaches_the_root_part_of_a_start(tmp_path):
    """LD_PRELOAD of a library the request sent: before, the request's environment was that of the
    root-side chain (sh, prlimit, setpriv) too, which loaded it as uid 0 (the process runtime passes the
    request's environment on). The library appends the uid of every process that loads it to ./uids."""
    source = tmp_path / "spy.c"
    source.write_text('#include <stdio.h>\n#include <unistd.h>\n__attribute__((constructor)) static void spy(void) '
                      '{ FILE *f = fopen("uids", "a"); if (f) { fprintf(f, "%d\\n", (int)getuid()); fclose(f); } }\n')
    library = tmp_path / "spy.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    srv = start_server("process")
    try:
        async def go():
            async with _client(srv.address) as client:
                return await client.execute(["sh", "-c", "cat uids"], {"spy.so": library.read_bytes()},
                                            env={"LD_PRELOAD": "./spy.so"})
        r = asyncio.run(go())
    finally:
        srv.stop()
    uids = [int(x) for x in r.stdout.split()]
    assert uids and 0 not in uids, (uids, r.stderr)


# -- 8. kernel state that namespaces do not confine -------------------------------------------------
KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYRING = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
def key(description):  # KEYCTL_SEARCH the session keyring, then KEYCTL_READ
    found = libc.syscall(NR[1], 10, -3, b"user", description, 0)
    buf = ctypes.create_string_buffer(64)
    size = libc.syscall(NR[1], 11, found, buf, 64) if found > 0 else 0
    return buf.raw[:max(size, 0)]
libc.syscall(NR[0], b"user", b"planted", b"from-an-earlier-run", 19, -3)  # add_key to @s
print(key(b"login-secret"), key(b"planted"))
"""
SERVER_UNDER_A_LOGIN_KEYRING = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
assert libc.syscall(keyctl, 1, b"login-session") > 0  # KEYCTL_JOIN_SESSION_KEYRING, as pam_keyinit does
assert libc.syscall(add_key, b"user", b"login-secret", b"hunter2", 7, -3) > 0
os.execv(sys.executable, [sys.executable, "-m", "megatron_rl_sandbox.server", *sys.argv[1:]])
"""


@pytest.mark.skipif(os.uname().machine not in KEYCTL, reason=f"keyctl numbers known for {sorted(KEYCTL)} only")
def test_a_run_cannot_use_the_session_keyring_of_the_login_that_started_the_server(tmp_path):
    """Keys are not confined by namespaces: every command possessed the server's session keyring (a login's,
    from pam_keyinit; a systemd service's own), so it read the keys held there ("hunter2") and left keys
    that later runs read ("from-an-earlier-run")."""
    from megatron_rl_sandbox.spawn import stop_server

    proc = subprocess.Popen([sys.executable, "-c", SERVER_UNDER_A_LOGIN_KEYRING, "--address", "127.0.0.1:0",
                             *runtime_args("bwrap"), "--capacity", "1", "--prewarm", "1"], stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "server.log", "w"), text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    try:
        line = proc.stdout.readline()
        assert line.startswith("{"), (tmp_path / "server.log").read_text()
        srv = type("Server", (), {"address": __import__("json").loads(line)["address"]})()
        first, second = _python(srv, KEYRING), _python(srv, KEYRING)
    finally:
        stop_server(proc, timeout_s=30)
    assert first.exit_code == 0 and second.exit_code == 0, (first, second)
    assert second.stdout == b"b'' b''\n", second.stdout


def test_a_run_cannot_make_a_user_namespace_of_its_own(bwrap_server):
    """Inside a user namespace of its own, code has every capability again (CAP_NET_ADMIN for nf_tables,
    CAP_SYS_ADMIN for mounts): the surface that unprivileged local-root exploits go through."""
    r = _python(bwrap_server, "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                              "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))")  # CLONE_NEWUSER
    assert r.exit_code == 0, r
    assert r.stdout.split()[0] == b"-1", r.stdout


@root_only
def test_empty_files_count_against_the_workspace(bwrap_server):
    """A tmpfs counts no blocks for an empty file: a session with a disk limit of 1 MiB held 150,000 of them
    (about 1 KiB of unswappable kernel memory each, kept between its calls), up to 3 million per workspace
    on this 24 GiB machine. Their number is now bounded by the quota, and filling it is DISK_LIMIT."""
    from megatron_rl_sandbox.client import pb2
    from megatron_rl_sandbox.workspace import inodes_for

    r = _python(bwrap_server, "import os\ntry:\n    for i in range(20000):\n        open(f'f{i}', 'w').close()\n"
                              "finally:\n    print(len(os.listdir('.')))", disk_bytes=2**20)
    assert int(r.stdout) <= inodes_for(2**20) < 20000, r
    assert r.termination == pb2.DISK_LIMIT, r
