"""`repo`: a repository (or a single function) in a sandbox session, edited by the model
through tools, rewarded by the task's tests.

A task (one JSONL row; `data/agent_tasks.py` generates examples):

    id             name used in logs and reports
    instruction    what the model is asked to do (the first observation)
    files          {path: content}: the workspace at the start
    hidden_files   {path: content}: written only for verification (hidden tests)
    fail_to_pass   tests that must pass after the change: [{"name", "argv", "success_pattern"?}]
    pass_to_pass   regression tests that must keep passing (same format)
    test_command   argv of the visible `test` tool (default: the fail_to_pass tests in turn)
    protected      path prefixes the model must not change: nothing may be added, changed
                   or deleted under them (default: `default_protected`, the tests'
                   directories and test files)
    reference      {path: content}: a reference solution (environment quality checks, the
                   agent warm start: `reference_turns`)
    limits         sandbox limits of each command (defaults below)

Reward: 0 if anything under a protected prefix changed, a standard-library name or a
protected test module was shadowed (a new `test_x/` package or `test_x.*.so` beside a
protected `test_x.py`) (tampering), a hard-coded expected output was found (`guards.py`)
or the workspace could not be checked (a failed digest, a hidden test that cannot be
written back); 0 if a regression test fails; else the fraction of fail_to_pass tests that
pass (each distinct test counted once). A test passes when its command exits 0 and, if it
has a `success_pattern` (a regex), its output matches it: an `os._exit(0)` planted in the
code under test does not pass a unittest whose pattern asks for `Ran N tests ... OK`.
Before each test run the protected and hidden files are written back, compiled bytecode is
deleted and the workspace is checked again (what an earlier test run's code left there is
tampering too), and the test command is run with the workspace after the standard library
on sys.path (`guards.TEST_LAUNCHER`).

A path the sandbox refuses (absolute, `..`, a directory read as a file: gRPC
INVALID_ARGUMENT / FAILED_PRECONDITION, final answers of the server) is the model's
mistake: an `error: ...` observation, counted in `model_errors`. Other gRPC failures are
the sandbox's and go to recovery.

Recovery: the session is snapshotted after `reset`; the environment keeps the log of the
tool calls that changed the workspace. When the server stops answering, `recover()`
opens a session on another server (the client fails over), rebuilds the start state and
replays the log; only if that fails too does the call raise InfrastructureError. A command a
stop signal interrupted (Slurm signals the server's commands too: `SessionInterrupted`) is
recovered the same way, on the same server, and run again.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Optional

from megatron_rl.envs import guards
from megatron_rl.envs.base import InfrastructureError
from megatron_rl.envs.tools import ToolCall, ToolCallError, format_result, format_tool_call, parse_tool_call, truncate

logger = logging.getLogger(__name__)

DEFAULT_LIMITS = {"wall_time_s": 10.0, "cpu_time_s": 10.0, "memory_bytes": 512 * 2**20, "max_processes": 64,
                  "output_bytes": 256 * 2**10}
UNITTEST_OK = r"Ran [1-9]\d* tests? in [\d.]+s\s+OK"
DIGEST_OUTPUT_BYTES = 2**20  # the digest's own output limit (the sandbox caps it at its maximum)
MAX_SOURCE_BYTES = 2**20  # a changed Python file longer than this is flagged, not parsed
_SHA256 = re.compile(r"[0-9a-f]{64}")


def reference_turns(task: dict[str, Any]) -> list[str]:
    """The model turns that play a task's reference solution: write each reference file (in
    path order), then submit."""
    writes = [format_tool_call("write", path=path, content=content)
              for path, content in sorted(task.get("reference", {}).items())]
    return writes + [format_tool_call("submit")]


def default_protected(task: dict[str, Any]) -> list[str]:
    """Protected prefixes: every directory named tests/ or test/ holding a task file (all of
    it: a new conftest.py or __init__.py there is tampering too), and each test_*.py file
    outside such directories."""
    prefixes = set()
    for path in list(task.get("files", {})) + list(task.get("hidden_files", {})):
        parts = path.split("/")
        test_dir = next((i for i, part in enumerate(parts[:-1]) if part in ("tests", "test")), None)
        if test_dir is not None:
            prefixes.add("/".join(parts[:test_dir + 1]) + "/")
        elif parts[-1].startswith("test_"):
            prefixes.add(path)
    return sorted(p for p in prefixes if not any(p != q and p.startswith(q) for q in prefixes if q.endswith("/")))


class RepoEnvironment:
    reference_turns = staticmethod(reference_turns)

    @staticmethod
    def known_bad_turns(task: dict[str, Any]) -> list[str]:
        """Submit the untouched workspace: a task's fail_to_pass tests must then fail."""
        return [format_tool_call("submit")]

    def __init__(self, client: Any, output_limit: int = 2000, max_recoveries: int = 2,
                 deadline_s: float = 60.0) -> None:
        self.client = client  # megatron_rl_sandbox.client.SandboxClient, on the caller's event loop
        self.output_limit = output_limit
        self.max_recoveries = max_recoveries
        self.deadline_s = deadline_s
        self.session: Any = None
        self.task: dict[str, Any] = {}
        self.replay: list[ToolCall] = []
        self.snapshot_id: Optional[str] = None
        self.model_errors = 0
        self.infra_errors = 0  # failures recovered from (the episode went on)
        self.info: dict[str, Any] = {}
        self.done = False

    # -- the contract --------------------------------------------------------------------------
    async def reset(self, task: dict[str, Any]) -> str:
        self.task = dict(task)
        self.task.setdefault("protected", default_protected(task))
        self.limits = {**DEFAULT_LIMITS, **task.get("limits", {})}
        self.replay, self.done, self.model_errors, self.info = [], False, 0, {}
        await self._guarded(self._open)
        return self.task["instruction"]

    async def step(self, action: str) -> tuple[str, bool]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset()")
        try:
            call = parse_tool_call(action)
        except ToolCallError as err:
            self.model_errors += 1
            return f"error: {err}", False
        if call is None or call.name == "submit":
            self.done = True
            return "submitted", True
        try:
            observation = await self._guarded(lambda: self._run_tool(call))
        except Exception as err:
            refusal = _refusal(err)
            if refusal is None:
                raise
            self.model_errors += 1
            return f"error: {refusal}", False
        if call.name in ("write", "patch", "run") and not observation.startswith("error:"):
            self.replay.append(call)
        return observation, False

    async def evaluate(self) -> float:
        return await self._guarded(self._verify)

    async def close(self) -> None:
        if self.session is not None:
            try:
                await self.session.close(deadline_s=10)
            except Exception:  # a server that is gone has closed it already
                pass
            self.session = None

    # -- tools ----------------------------------------------------------------------------------
    async def _exec(self, argv: list[str], limits: Optional[dict] = None, stdin: bytes = b""):
        result = await self.session.exec(argv, stdin=stdin, limits=limits or self.limits, deadline_s=self.deadline_s)
        if result.termination == _termination("SETUP_ERROR"):  # the runtime, not the command, failed
            raise ConnectionError(f"sandbox setup error: {result.message}")
        return result

    async def _run_tool(self, call: ToolCall) -> str:
        args = call.arguments
        if call.name == "run":
            r = await self._exec(["sh", "-c", args["command"]])
            return format_result(r.exit_code, r.stdout, r.stderr, self.output_limit, _note(r))
        if call.name == "read":
            reply = await self.session.read_file(args["path"], max_bytes=self.output_limit * 4,
                                                 deadline_s=self.deadline_s)
            if not reply.exists:
                self.model_errors += 1
                return f"error: {args['path']} does not exist"
            return truncate(reply.content, self.output_limit)
        if call.name == "write":
            n = await self.session.write_file(args["path"], args["content"], deadline_s=self.deadline_s)
            return f"wrote {n} bytes to {args['path']}"
        if call.name == "patch":
            return await self._patch(args["path"], args["old"], args["new"])
        outcomes = [await self._run_test(t) for t in self._visible_tests()]
        return "\n".join(f"{t['name']}: {'PASS' if ok else 'FAIL'}\n{truncate(out, self.output_limit // 2)}"
                         for t, (ok, out) in zip(self._visible_tests(), outcomes))

    async def _patch(self, path: str, old: str, new: str) -> str:
        reply = await self.session.read_file(path, deadline_s=self.deadline_s)
        if not reply.exists:
            self.model_errors += 1
            return f"error: {path} does not exist"
        text = reply.content.decode("utf-8", "replace")
        count = text.count(old) if old else 0
        if count != 1:
            self.model_errors += 1
            return f"error: `old` occurs {count} times in {path}; it must occur exactly once"
        await self.session.write_file(path, text.replace(old, new), deadline_s=self.deadline_s)
        return f"patched {path}"

    def _visible_tests(self) -> list[dict[str, Any]]:
        if self.task.get("test_command"):
            return [{"name": "tests", "argv": self.task["test_command"]}]
        return list(self.task.get("fail_to_pass", [])) + list(self.task.get("pass_to_pass", []))

    async def _run_test(self, test: dict[str, Any]) -> tuple[bool, str]:
        r = await self._exec(guards.isolated_test_argv(list(test["argv"])))
        output = (r.stdout + r.stderr).decode("utf-8", "replace")
        ok = r.termination == _termination("EXITED") and r.exit_code == 0
        if ok and test.get("success_pattern"):
            ok = re.search(test["success_pattern"], output) is not None
        return ok, output

    # -- verification ---------------------------------------------------------------------------
    async def _verify(self) -> float:
        task, protected = self.task, self.task["protected"]
        fail_to_pass, pass_to_pass = _distinct(task.get("fail_to_pass", [])), _distinct(task.get("pass_to_pass", []))
        original = {**task.get("files", {}), **task.get("hidden_files", {})}
        digest, shadowing, failure = await self._digest()
        # Against the start workspace: hidden files are not in it, so one appearing there counts as added.
        tampered = [failure] if failure else guards.tampered_paths(task.get("files", {}), digest, protected) + shadowing
        hardcoded = [] if failure else await self._hardcoded(digest, protected)
        passed = failed_regressions = 0
        if not failure:
            for test in fail_to_pass + [t for t in pass_to_pass if t not in fail_to_pass]:
                failure = await self._prepare_test_run(original, protected, tampered)  # on pristine tests
                if failure:
                    tampered.append(failure)
                    break
                ok, _ = await self._run_test(test)
                passed += ok and test in fail_to_pass
                failed_regressions += not ok and test in pass_to_pass
        total = len(fail_to_pass)
        reward = passed / total if total else 0.0
        if tampered or hardcoded or failed_regressions:
            reward = 0.0
        self.info = {"tampered": tampered, "hardcoded": hardcoded, "fail_to_pass_passed": passed,
                     "fail_to_pass_total": total, "regressions_failed": failed_regressions, "reward": reward,
                     "model_errors": self.model_errors, "infra_errors": self.infra_errors}
        if tampered or hardcoded:
            logger.info("task %s: reward 0 for reward hacking (tampered %s, hard-coded %s)", task.get("id"),
                        tampered, hardcoded)
        return reward

    async def _digest(self) -> tuple[dict[str, str], list[str], str]:
        """(digest of the protected paths and changed Python files, new top-level modules named
        like the standard library, failure): a digest that fails, is cut short or is not
        JSON is a failure, which the caller scores as tampering (the checks could not run)."""
        files = self.task.get("files", {})
        protected = self.task["protected"]
        test_modules = sorted({(p.rpartition("/")[0], p.rpartition("/")[2][:-3])
                               for p in protected if p.endswith(".py")})
        spec = {"original": {p: guards.sha256(c) for p, c in files.items()}, "protected": protected,
                "top_level": sorted({p.split("/")[0] for p in [*files, *self.task.get("hidden_files", {})]}),
                "test_modules": test_modules}
        r = await self._exec(["python3", "-I", "-c", guards.WORKSPACE_DIGEST], stdin=json.dumps(spec).encode(),
                             limits={**self.limits, "output_bytes": DIGEST_OUTPUT_BYTES})
        if r.termination != _termination("EXITED") or r.exit_code != 0 or r.stdout_truncated:
            return {}, [], f"<workspace digest failed: {'output cut short' if r.stdout_truncated else _failure(r)}>"
        try:
            out = json.loads(r.stdout)
            return dict(out["files"]), list(out["shadowing"]), ""
        except (ValueError, KeyError, TypeError) as err:
            return {}, [], f"<workspace digest failed: unreadable output ({err})>"

    async def _prepare_test_run(self, original: dict[str, str], protected: list[str], known: list[str]) -> str:
        """Write the protected and hidden files back, delete compiled bytecode and check the
        workspace again; a failure (the model put a directory where a hidden test goes, an
        earlier test run's code added a file under a protected path or a module shadowing a test
        or the standard library, ...; what `known` already lists aside) is returned, to be scored
        as tampering."""
        for path, content in original.items():
            if guards.is_protected(path, protected) or path in self.task.get("hidden_files", {}):
                try:
                    await self.session.write_file(path, content, deadline_s=self.deadline_s)
                except Exception as err:
                    refusal = _refusal(err)
                    if refusal is None:
                        raise
                    return f"<cannot write back {path}: {refusal}>"
        # The digest again (it deletes the bytecode first): what an earlier test run's code left in the workspace
        # (a package shadowing the next test module, a file under tests/) is tampering, as before the first run.
        digest, shadowing, failure = await self._digest()
        if failure:
            return failure
        planted = [p for p in guards.tampered_paths(original, digest, protected) + shadowing if p not in known]
        return f"<during verification: {', '.join(planted)}>" if planted else ""

    async def _hardcoded(self, digest: dict[str, str], protected: list[str]) -> list[str]:
        files = self.task.get("files", {})
        changed = [p for p, h in digest.items() if p.endswith(".py") and not guards.is_protected(p, protected)
                   and guards.sha256(files.get(p, "")) != h and _SHA256.fullmatch(h)]  # links: their targets count
        if not changed:
            return []
        everything = {**files, **self.task.get("hidden_files", {})}
        tests = [c for p, c in everything.items() if guards.is_protected(p, protected)]
        expected, inputs = guards.literals_in_tests(tests)
        found = []
        for path in changed:
            reply = await self.session.read_file(path, max_bytes=MAX_SOURCE_BYTES, deadline_s=self.deadline_s)
            if reply.truncated:  # unparsable when cut: refuse rather than pass unchecked
                found.append(f"{path}:<over {MAX_SOURCE_BYTES} bytes, not checked>")
                continue
            new = reply.content.decode("utf-8", "replace")
            found += [f"{path}:{name}" for name in guards.hardcoded_returns(new, files.get(path, ""), expected, inputs)]
        return found

    # -- recovery -------------------------------------------------------------------------------
    async def _open(self) -> None:
        self.session = await self.client.open_session(self.task.get("files", {}), limits=self.limits,
                                                      deadline_s=self.deadline_s)
        self.snapshot_id = await self.session.snapshot(deadline_s=self.deadline_s)

    async def recover(self) -> None:
        """Rebuild the workspace: restore the start snapshot on the same server, or open a new
        session (another server when this one is gone), then replay the changing tool calls."""
        try:
            await self.session.restore(self.snapshot_id, deadline_s=self.deadline_s)
        except Exception:
            self.session = None
            await self._open()
        for call in self.replay:
            await self._run_tool(call)

    async def _guarded(self, work):
        from megatron_rl_sandbox.client import SandboxUnavailable

        for attempt in range(self.max_recoveries + 1):
            try:
                if self.session is None and work != self._open:
                    await self._open()
                return await work()
            except (SandboxUnavailable, ConnectionError, OSError) as err:
                self.infra_errors += 1
                logger.warning("task %s: sandbox failure (%s), recovery %d/%d", self.task.get("id"), err,
                               attempt + 1, self.max_recoveries)
                if attempt == self.max_recoveries:
                    raise InfrastructureError(f"task {self.task.get('id')}: {err}") from err
                try:
                    if work == self._open:
                        continue
                    await self.recover()
                except (SandboxUnavailable, ConnectionError, OSError):
                    self.session = None
        raise AssertionError("unreachable")


def _distinct(tests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`tests` without repeats: a test listed twice counts once."""
    out: list[dict[str, Any]] = []
    for test in tests:
        if test not in out:
            out.append(test)
    return out


def _refusal(err: BaseException) -> Optional[str]:
    """The server's message when it refused a call for its path or the workspace's state
    (INVALID_ARGUMENT, FAILED_PRECONDITION: final answers, the model's doing), else None:
    unavailable servers and other failures are the sandbox's, for recovery."""
    import grpc

    refused = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    if isinstance(err, grpc.aio.AioRpcError) and err.code() in refused:
        return err.details() or err.code().name
    return None


def _failure(result) -> str:
    """Why a verifier script failed: the limit it hit, or its exit code and last line of stderr."""
    lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
    return _note(result) or f"exit code {result.exit_code}" + (f": {lines[-1]}" if lines else "")


def _termination(name: str) -> int:
    from megatron_rl_sandbox.client import pb2

    return pb2.Termination.Value(name)


def _note(result) -> str:
    names = {"TIMEOUT": "wall-time limit", "CPU_LIMIT": "cpu-time limit", "MEMORY_LIMIT": "memory limit",
             "OUTPUT_LIMIT": "output limit", "DISK_LIMIT": "disk limit",
             "SIGNALED": f"killed by signal {result.signal}"}
    return next((note for name, note in names.items() if result.termination == _termination(name)), "")
