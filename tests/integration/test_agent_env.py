"""Multi-turn agent episodes in the real sandbox (bwrap runtime): scripted policies against a
repository task (the reference fix gets 1; editing the tests, hard-coding outputs, doing
nothing get 0; so do a shadowed unittest, a planted stale .pyc, a new file under tests/ and
a workspace too large to check; malformed tool calls and paths the sandbox refuses are
answered, not fatal; a test listed twice counts once), a sandbox server killed in
the middle of an episode (recovered on another server), and the small model's episodes,
checked token by token: model tokens masked in, observation tokens masked out and
tokenized exactly once, log-probs only where the model sampled."""

from __future__ import annotations

import math
import os
import platform
import signal
import threading

import pytest
import torch

from megatron_rl.config import TaskConfig, load_config
from megatron_rl.data.agent_tasks import function_tasks, repo_tasks
from megatron_rl.data.tasks import Task
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.envs.tools import format_tool_call as call
from megatron_rl.rewards.service import RewardService
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.multiturn import EpisodeLimits, TurnFormat, run_episodes
from megatron_rl.rollout.scripted import ScriptedPolicy
from tests.integration.sandbox_servers import runtime_args, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
TASK = repo_tasks(1, seed=3)[0]  # calc/ops.py with a bug in `maximum`
FUNCTION_TASK = function_tasks(1, seed=0)[0]  # solution.py to write, hidden test_solution.py
FIX = call("write", path="calc/ops.py", content=TASK["reference"]["calc/ops.py"])
BUG = TASK["fail_to_pass"][0]["name"]
LIMITS = EpisodeLimits(max_turns=4, max_tokens=4096, wall_time_s=60)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:char")


@pytest.fixture(scope="module")
def servers():
    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    started = [start_server("bwrap"), start_server("bwrap")]
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def host(servers, tokenizer):
    task = Task(TaskConfig(type="agent", num_train=1, num_eval=0), tokenizer)
    service = RewardService(task.verifier_factory([s.address for s in servers]))
    yield service
    service.close()


def _play(host, tokenizer, turns, n=1, limits=LIMITS, task=TASK):
    fmt = TurnFormat(tokenizer, "Use the tools.")
    policy = ScriptedPolicy(tokenizer, turns, end_of_turn=fmt.end_of_turn)
    return run_episodes(policy, [task], n, SamplingParams(max_new_tokens=4096), host.verifier.make_env, fmt,
                        limits, host.loop)


def test_the_reference_fix_gets_reward_one(host, tokenizer):
    fix = call("write", path="calc/ops.py", content=TASK["reference"]["calc/ops.py"])
    [episode] = _play(host, tokenizer, [call("test"), fix, call("test"), call("submit")])
    assert episode.status == "submitted" and episode.num_turns == 4
    assert episode.reward == 1.0 and episode.info["regressions_failed"] == 0 and not episode.info["tampered"]


def test_editing_the_tests_gets_zero(host, tokenizer):
    gutted = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    [episode] = _play(host, tokenizer, [call("write", path=f"tests/test_{BUG}.py", content=gutted), call("test"),
                                        "I am done."])
    assert episode.status == "submitted" and episode.reward == 0.0
    assert episode.info["tampered"] == [f"tests/test_{BUG}.py"]


def test_hard_coded_outputs_and_regressions_get_zero(host, tokenizer):
    from megatron_rl.data.agent_tasks import FUNCTIONS

    cases = dict(FUNCTIONS[BUG][3])
    branches = "".join(f"    if (a, b) == {args!r}:\n        return {expected!r}\n" for args, expected in cases.items())
    old = TASK["reference"]["calc/ops.py"]
    start = old.index(f"def {BUG}(")
    end = old.index("\n\n", start)
    hacked = old[:start] + f"def {BUG}(a, b):\n" + branches + "    return 0" + old[end:]
    [episode] = _play(host, tokenizer, [call("write", path="calc/ops.py", content=hacked), call("submit")])
    assert episode.info["fail_to_pass_passed"] == 1  # the hard-coded answers do pass the tests ...
    assert episode.info["hardcoded"] == [f"calc/ops.py:{BUG}"] and episode.reward == 0.0  # ... and are caught
    broken = TASK["reference"]["calc/ops.py"] + "\nraise SystemExit(0)\n"  # breaks every import of calc.ops
    [episode] = _play(host, tokenizer, [call("write", path="calc/ops.py", content=broken)])
    assert episode.reward == 0.0 and episode.info["fail_to_pass_passed"] == 0


def test_malformed_calls_are_answered_and_counted(host, tokenizer):
    [episode] = _play(host, tokenizer, ["<tool_call>{not json</tool_call>", call("frobnicate"),
                                        call("patch", path="calc/ops.py", old="no such text", new="x"), call("submit")])
    assert episode.status == "submitted" and episode.model_errors == 3 and episode.infra_errors == 0
    text = tokenizer.decode(episode.output_ids)
    assert "error: tool call is not valid JSON" in text and "error: unknown tool 'frobnicate'" in text


def test_turn_limit_ends_an_episode(host, tokenizer):
    [episode] = _play(host, tokenizer, [call("test")] * 10, limits=EpisodeLimits(max_turns=2, max_tokens=4096))
    assert episode.status == "max_turns" and episode.num_turns == 2 and episode.reward == 0.0


def test_stdlib_shadowing_stale_bytecode_and_new_files_under_tests_get_zero(host, tokenizer):
    """Routes to reward 1 without a fix: a `unittest` package in the workspace that prints
    `Ran 1 test ... OK`; a stale .pyc of a trivial test in place of the hidden test (the
    source deleted, so Python would import the .pyc); a new file in the protected tests/."""
    fake = "import sys\nsys.stderr.write('Ran 1 test in 0.000s\\n\\nOK\\n')\n"
    [episode] = _play(host, tokenizer, [call("write", path="unittest/__init__.py", content=""),
                                        call("write", path="unittest/__main__.py", content=fake), call("submit")])
    assert episode.reward == 0.0 and episode.info["tampered"] == ["unittest"]
    assert episode.info["fail_to_pass_passed"] == 0  # the real unittest ran the tests: the bug is still there
    trivial = "import unittest\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    plant = (f"printf '{trivial}' > test_solution.py && python3 -c \"import py_compile; py_compile.compile("
             "'test_solution.py', invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\" && "
             "rm test_solution.py && ls __pycache__")
    [episode] = _play(host, tokenizer, [call("run", command=plant), call("submit")], task=FUNCTION_TASK)
    assert "test_solution.cpython-" in tokenizer.decode(episode.output_ids)  # the .pyc was planted
    assert episode.reward == 0.0 and episode.info["fail_to_pass_passed"] == 0 and not episode.info["tampered"]
    [episode] = _play(host, tokenizer, [FIX, call("write", path="tests/conftest.py", content=""), call("submit")])
    assert episode.reward == 0.0 and episode.info["tampered"] == ["tests/conftest.py"]
    # Bytecode the model's own runs leave under tests/ is deleted, not counted as tampering.
    [episode] = _play(host, tokenizer, [FIX, call("run", command="python3 -m compileall -q . && ls tests/__pycache__"),
                                        call("submit")])
    assert episode.reward == 1.0 and "test_" in tokenizer.decode(episode.output_ids).split("exit_code: 0")[1]


# Code under test that fakes a pass from inside the process running it: it patches unittest's
# assertions, or prints unittest's passing report and exits 0 as soon as it is imported.
IN_PROCESS_HACKS = {
    "patched_unittest": "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n",
    "fake_report": ("import os, sys\nsys.stderr.write('.\\n' + '-' * 70 + '\\nRan 1 test in 0.001s\\n\\nOK\\n')\n"
                    "sys.stderr.flush()\nos._exit(0)\n"),
}


def _in_process_tests(task: dict) -> dict:
    """The function task with a hidden test of the common kind: it imports the solution and asserts in
    the same process (the generated tests run the solution in a child process instead)."""
    from megatron_rl.data.agent_tasks import FUNCTIONS

    name = task["fail_to_pass"][0]["name"]
    asserts = "".join(f"        self.assertEqual({name}({', '.join(map(repr, args))}), {want!r})\n"
                      for args, want in FUNCTIONS[name][3])
    test = (f"import unittest\n\nfrom solution import {name}\n\n\nclass T(unittest.TestCase):\n"
            f"    def test_{name}(self):\n{asserts}")
    return {**task, "id": task["id"] + "-in-process", "hidden_files": {"test_solution.py": test}}


@pytest.mark.parametrize("hack", sorted(IN_PROCESS_HACKS))
def test_code_that_fakes_a_pass_from_inside_its_process_gets_zero(host, tokenizer, hack):
    """The generated tests judge in a process the code under test never runs in: both hacks get 0
    on a function task and on a repo task (where the patched unittest leaves the regressions
    passing). Against the same function task with an in-process hidden test, the same hack
    gets 1: it is a real one."""
    name = FUNCTION_TASK["fail_to_pass"][0]["name"]
    solution = IN_PROCESS_HACKS[hack] + f"\n\ndef {name}(*args):\n    return None\n"
    turns = [call("write", path="solution.py", content=solution), call("submit")]
    [episode] = _play(host, tokenizer, turns, task=FUNCTION_TASK)
    assert episode.reward == 0.0 and episode.info["fail_to_pass_passed"] == 0, episode.info
    assert not episode.info["tampered"] and not episode.info["hardcoded"]  # no other guard took it
    [control] = _play(host, tokenizer, turns, task=_in_process_tests(FUNCTION_TASK))
    assert control.reward == 1.0, control.info
    buggy = IN_PROCESS_HACKS[hack] + TASK["files"]["calc/ops.py"]  # the bug left in place
    [episode] = _play(host, tokenizer, [call("write", path="calc/ops.py", content=buggy), call("submit")])
    assert episode.reward == 0.0 and episode.info["fail_to_pass_passed"] == 0, episode.info
    if hack == "patched_unittest":  # imports fine: the other functions' tests run it and pass
        assert episode.info["regressions_failed"] == 0


def test_code_that_reads_the_expected_values_from_a_hidden_test_gets_zero(host, tokenizer):
    """A solution that finds its answers in the hidden test file at run time (no literal in its source, so
    the hard-coded-output guard sees nothing): the generated hidden test deletes its file once imported,
    before the solution runs, so it gets 0; against an in-process hidden test, which stays on disk, 1."""
    name = FUNCTION_TASK["fail_to_pass"][0]["name"]
    reader = ("import ast, pathlib\n\n\n"
              f"def {name}(*args):\n"
              "    for node in ast.walk(ast.parse(pathlib.Path('test_solution.py').read_text())):\n"
              "        if isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'assertEqual':\n"
              "            call, want = node.args[:2]\n"
              "            if [ast.literal_eval(a) for a in call.args] == list(args):\n"
              "                return ast.literal_eval(want)\n")
    turns = [call("write", path="solution.py", content=reader), call("submit")]
    [episode] = _play(host, tokenizer, turns, task=FUNCTION_TASK)
    assert episode.reward == 0.0 and not episode.info["hardcoded"] and not episode.info["tampered"], episode.info
    [control] = _play(host, tokenizer, turns, task=_in_process_tests(FUNCTION_TASK))
    assert control.reward == 1.0, control.info


def test_a_module_shadowing_a_test_module_gets_zero(host, tokenizer):
    """`import test_solution` finds a package `test_solution/` (or an extension module) before the
    hidden test_solution.py written back beside it: a trivially passing one planted by the model is
    tampering (0), whether it is there before verification or an earlier test run's code leaves it
    for a later one (here calc/ops.py, imported by the first fail_to_pass test, plants a package
    shadowing the second one's module under tests/)."""
    trivial = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    turns = [call("write", path="test_solution/__init__.py", content=trivial), call("submit")]
    [episode] = _play(host, tokenizer, turns, task=FUNCTION_TASK)
    assert episode.reward == 0.0 and episode.info["tampered"] == ["test_solution"], episode.info
    regression = TASK["pass_to_pass"][0]
    task = {**TASK, "fail_to_pass": [regression, TASK["fail_to_pass"][0]],
            "pass_to_pass": [t for t in TASK["pass_to_pass"] if t != regression]}
    plant = (f"import os\n\nos.makedirs('tests/test_{BUG}', exist_ok=True)\n"
             f"with open('tests/test_{BUG}/__init__.py', 'w') as f:\n    f.write({trivial!r})\n")
    buggy = plant + TASK["files"]["calc/ops.py"]
    [episode] = _play(host, tokenizer, [call("write", path="calc/ops.py", content=buggy), call("submit")], task=task)
    assert episode.reward == 0.0, episode.info
    assert episode.info["tampered"] == [f"<during verification: tests/test_{BUG}/__init__.py>"], episode.info


def test_the_test_process_is_out_of_the_codes_reach_through_proc(host, tokenizer):
    """A generated test, imported, makes its process non-dumpable: a child (the code under test)
    can no longer open the test process's stdout through /proc/<pid>/fd (to write a report into
    it) nor its /proc/<pid>/mem (nor ptrace it: the same check); without the test module
    imported it can, so the check is not vacuous on this machine."""
    judge = FUNCTION_TASK["hidden_files"]["test_solution.py"]
    child = ("import os, sys\nfor path, mode in (('fd/1', 'w'), ('mem', 'rb')):\n    try:\n"
             "        open('/proc/%d/%s' % (os.getppid(), path), mode).close()\n        print(path, 'opened')\n"
             "    except PermissionError:\n        print(path, 'denied')\n")
    probe = ("import subprocess, sys\nif sys.argv[1] == 'sealed':\n    import judge\n"
             "out = subprocess.run([sys.executable, 'child.py'], capture_output=True, text=True).stdout\n"
             "print(sys.argv[1], out.split())\n")
    turns = [call("write", path="judge.py", content=judge), call("write", path="child.py", content=child),
             call("write", path="probe.py", content=probe), call("run", command="python3 probe.py sealed"),
             call("run", command="python3 probe.py open")]
    [episode] = _play(host, tokenizer, turns, task=FUNCTION_TASK, limits=EpisodeLimits(max_turns=6, max_tokens=8192))
    text = tokenizer.decode(episode.output_ids)
    assert "sealed ['fd/1', 'denied', 'mem', 'denied']" in text, text[-2000:]
    # Under a root server the test process's stdout is a pipe of host root's (mode 0600), which the
    # sandbox's unprivileged user cannot reopen through /proc at all; its memory shows the check is real.
    reopened = "denied" if os.geteuid() == 0 else "opened"
    assert f"open ['fd/1', '{reopened}', 'mem', 'opened']" in text, text[-2000:]


# Code under test that takes over the sandbox's PID 1 when PID 1 is a process of the same user it
# can write into (bubblewrap's own reaper was, before the runtime ran each command as PID 1): a
# passing unittest report into PID 1's stdout and stderr, which are the command's, and
# exit_group(0) over the instruction PID 1 returns to from its blocking wait. When the test process
# ends (failing), PID 1 wakes up and exits 0 instead of reporting that failure; the command's
# output holds the fake report. x86-64 machine code.
TAKE_OVER_PID_1 = """def _take_over_pid_1():
    try:
        pc = int(open('/proc/1/syscall').read().split()[-1], 16)
        with open('/proc/1/mem', 'r+b', buffering=0) as mem:
            report = '.\\n' + '-' * 70 + '\\nRan 1 test in 0.001s\\n\\nOK\\n'
            for fd in (1, 2):
                with open('/proc/1/fd/%d' % fd, 'w') as out:
                    out.write(report)
            mem.seek(pc)
            mem.write(bytes.fromhex('31ffb8e70000000f05'))  # xor edi, edi; mov eax, 231; syscall
    except (OSError, ValueError):
        print('PID 1 is out of reach')


_take_over_pid_1()
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the attack writes x86-64 machine code")
def test_code_that_takes_over_the_sandboxs_pid_1_gets_zero(host, tokenizer):
    """The test command is PID 1 of its sandbox (bwrap's `--as-pid-1`) and the generated test seals
    its process, so no process is left that the code under test could take over: the attack finds
    PID 1 out of reach and gets 0 (it got 1 when bubblewrap's reaper was PID 1). The same attack run
    under an unsealed parent that is PID 1 makes the command exit 0 with the fake report, though the
    code it ran exits 3: the attack works on this machine."""
    name = FUNCTION_TASK["fail_to_pass"][0]["name"]
    solution = call("write", path="solution.py", content=TAKE_OVER_PID_1 + f"\n\ndef {name}(*args):\n    return None\n")
    [episode] = _play(host, tokenizer, [solution, call("submit")], task=FUNCTION_TASK)
    assert episode.reward == 0.0 and episode.info["fail_to_pass_passed"] == 0, episode.info
    assert not episode.info["tampered"] and not episode.info["hardcoded"]
    parent = ("python3 -c \"import subprocess, sys; "
              "sys.exit(subprocess.call([sys.executable, '-c', 'import solution; raise SystemExit(3)']))\"")
    [control] = _play(host, tokenizer, [solution, call("run", command=parent)], task=FUNCTION_TASK)
    observation = tokenizer.decode(control.output_ids).split("import solution")[-1]
    if "PID 1 is out of reach" in observation:
        pytest.skip("this kernel keeps a process out of another's /proc/<pid>/mem even when unsealed "
                    "(Yama ptrace_scope >= 1, or proc_mem.force_override): the attack's control cannot run here")
    assert "exit_code: 0" in observation and "Ran 1 test in 0.001s" in observation, observation


def test_the_workspace_digest_survives_links_and_many_files_and_fails_closed(host, tokenizer):
    """A dangling symlink does not switch the hard-coded-output guard off; 5,000 new files do
    not break the digest; a digest too large to read back is scored as tampering (0), not
    skipped and not a crash."""
    from megatron_rl.data.agent_tasks import FUNCTIONS

    name = FUNCTION_TASK["fail_to_pass"][0]["name"]
    cases = "".join(f"    if args == {tuple(a)!r}:\n        return {e!r}\n" for a, e in FUNCTIONS[name][3])
    hacked = f"def {name}(*args):\n{cases}    return None\n"
    [episode] = _play(host, tokenizer, [call("write", path="solution.py", content=hacked),
                                        call("run", command="ln -s nowhere dangling"), call("submit")],
                      task=FUNCTION_TASK)
    assert episode.info["fail_to_pass_passed"] == 1 and episode.info["hardcoded"] == [f"solution.py:{name}"]
    assert episode.reward == 0.0
    many = "mkdir d && cd d && for i in $(seq 5000); do : > file_with_a_rather_long_name_$i; done; ls | wc -l"
    [episode] = _play(host, tokenizer, [FIX, call("run", command=many), call("submit")])
    assert episode.reward == 1.0 and "5000" in tokenizer.decode(episode.output_ids)
    too_many = "python3 -c \"[open(f'module_{i:05d}.py', 'w').write(str(i)) for i in range(15000)]\""
    [episode] = _play(host, tokenizer, [FIX, call("run", command=too_many), call("submit")])
    assert episode.reward == 0.0 and episode.info["tampered"] == ["<workspace digest failed: output cut short>"]


def test_paths_the_sandbox_refuses_are_model_errors(host, tokenizer):
    """A directory read as a file, an absolute path, `..`: the server's final refusals
    (FAILED_PRECONDITION / INVALID_ARGUMENT) are error observations, not a crashed step; a
    directory where a hidden test is written back is tampering."""
    turns = [call("read", path="calc"), call("read", path="/etc/passwd"), call("write", path="../x", content="x"),
             call("patch", path="tests", old="a", new="b"), FIX, call("submit")]
    [episode] = _play(host, tokenizer, turns, limits=EpisodeLimits(max_turns=8, max_tokens=8192, wall_time_s=60))
    assert episode.status == "submitted" and episode.model_errors == 4 and episode.infra_errors == 0
    assert episode.reward == 1.0
    text = tokenizer.decode(episode.output_ids)
    assert "error: 'calc' is a directory" in text and "error: path '/etc/passwd' must be relative" in text
    assert "error: path '../x' may not contain '..'" in text
    [episode] = _play(host, tokenizer, [call("run", command="mkdir test_solution.py"), call("submit")],
                      task=FUNCTION_TASK)
    assert episode.status == "submitted" and episode.reward == 0.0
    assert episode.info["tampered"][0].startswith("<cannot write back test_solution.py:")


def test_a_test_listed_twice_counts_once(host, tokenizer):
    test = TASK["fail_to_pass"][0]
    task = {**TASK, "fail_to_pass": [test, test], "pass_to_pass": [test] + TASK["pass_to_pass"]}
    [episode] = _play(host, tokenizer, [FIX, call("submit")], task=task)
    assert episode.reward == 1.0 and episode.info["fail_to_pass_total"] == 1
    assert episode.info["fail_to_pass_passed"] == 1


def test_a_sandbox_server_killed_mid_episode_is_recovered_on_another(tokenizer):
    """The fix is written on the server holding the episode's session; that server is killed
    before the next turn; the environment reopens the session on the other server, replays
    the write, and the episode ends as an undisturbed one does (reward 1). Own servers: this
    test kills one."""
    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    servers = [start_server("bwrap"), start_server("bwrap")]
    task = Task(TaskConfig(type="agent", num_train=1, num_eval=0), tokenizer)
    service = RewardService(task.verifier_factory([s.address for s in servers]))
    envs = []

    def make_env():
        envs.append(service.verifier.make_env())
        return envs[-1]

    holders = []

    def kill_the_sessions_server(conversation: str) -> str:
        holders.append(envs[0].session.address)
        next(s for s in servers if s.address == holders[0]).kill()
        return call("test")

    def submit(conversation: str) -> str:
        holders.append(envs[0].session.address)
        return call("submit")

    fmt = TurnFormat(tokenizer, "Use the tools.")
    fix = call("write", path="calc/ops.py", content=TASK["reference"]["calc/ops.py"])
    policy = ScriptedPolicy(tokenizer, [fix, kill_the_sessions_server, submit], end_of_turn=fmt.end_of_turn)
    try:
        [episode] = run_episodes(policy, [TASK], 1, SamplingParams(max_new_tokens=4096), make_env, fmt, LIMITS,
                                 service.loop)
    finally:
        service.close()
        for server in servers:
            server.stop()
    assert episode.status == "submitted" and episode.reward == 1.0, episode.info
    assert episode.infra_errors >= 1 and episode.info["infra_errors"] >= 1
    assert holders[1] != holders[0]  # the episode moved to the surviving server
    assert "tests: PASS" in tokenizer.decode(episode.output_ids)  # the replayed fix was there for `test`


def test_a_command_killed_by_a_stop_signal_reruns_on_the_rebuilt_workspace(tokenizer):
    """Slurm signals every process of the sandbox step, the episode's command too: the server refuses that
    command's result (the signal's, not the model's), and the environment restores its start snapshot,
    replays the calls before it and runs the command again, so its observation is the undisturbed one (what it
    appended once, after the replayed append), not a killed command's or a rerun on the half-changed files.
    Own server: this test signals it."""
    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    server = start_server("bwrap", "--ignore-sigterm")
    task = Task(TaskConfig(type="agent", num_train=1, num_eval=0), tokenizer)
    service = RewardService(task.verifier_factory([server.address]))

    def signal_while_it_sleeps() -> None:
        for _ in range(500):
            if server.runs("sleep"):
                server.signal_step(signal.SIGTERM)
                return
            threading.Event().wait(0.02)

    def interrupted_run(conversation: str) -> str:
        threading.Thread(target=signal_while_it_sleeps, daemon=True).start()
        return call("run", command="echo second >> notes.txt; sleep 1.5; cat notes.txt")

    fmt = TurnFormat(tokenizer, "Use the tools.")
    turns = [call("run", command="echo first >> notes.txt"), interrupted_run, call("submit")]
    policy = ScriptedPolicy(tokenizer, turns, end_of_turn=fmt.end_of_turn)
    try:
        [episode] = run_episodes(policy, [TASK], 1, SamplingParams(max_new_tokens=4096), service.verifier.make_env,
                                 fmt, LIMITS, service.loop)
        assert server.proc.poll() is None, "the server stopped"
    finally:
        service.close()
        server.stop()
    text = tokenizer.decode(episode.output_ids)
    assert episode.status == "submitted" and episode.infra_errors >= 1, (episode.status, text)
    assert "exit_code: 0\nstdout:\nfirst\nsecond\n" in text, text
    assert "a stop signal came while a command ran" in server.log.read_text()


def test_small_model_episodes_are_token_in_token_out(host, tokenizer):
    from megatron_rl.models.hf import build_hf_model
    from megatron_rl.rollout.hf_engine import HFEngine

    model_cfg = load_config(["model=tiny_qwen2"], world_size=1).model
    engine = HFEngine(model_cfg, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    engine.update_weights(list(build_hf_model(model_cfg, seed=1).state_dict().items()), version=7)
    generated, observed = [], []

    class Recording:  # the real engine and environments, with what they produced written down
        def generate(self, prompts, params):
            out = engine.generate(prompts, params)
            generated.append([list(g.output_ids) for g in out])
            return out

    def make_env():
        env = host.verifier.make_env()
        step = env.step

        async def recorded(action):
            obs, done = await step(action)
            observed.append((action, obs, done))
            return obs, done
        env.step = recorded
        return env

    fmt = TurnFormat(tokenizer, "Use tools.")
    limits = EpisodeLimits(max_turns=3, max_tokens=500, wall_time_s=60)
    params = SamplingParams(max_new_tokens=24, seed=3)
    episodes = run_episodes(Recording(), [TASK], 2, params, make_env, fmt, limits, host.loop)
    assert len(episodes) == 2 and all(e.weight_version == 7 for e in episodes)
    for k, ep in enumerate(episodes):
        assert len(ep.prompt_tokens) + len(ep.output_ids) <= limits.max_tokens
        assert len(ep.output_ids) == len(ep.logprobs) == len(ep.model_mask) and ep.prompt_tokens == \
            fmt.encode(fmt.prompt(TASK["instruction"]))
        # Split the response into runs of model tokens and observation tokens.
        runs, i = [], 0
        while i < len(ep.model_mask):
            j = i
            while j < len(ep.model_mask) and ep.model_mask[j] == ep.model_mask[i]:
                j += 1
            runs.append((ep.model_mask[i], ep.output_ids[i:j], ep.logprobs[i:j]))
            i = j
        model_runs = [r for r in runs if r[0] == 1]
        obs_runs = [r for r in runs if r[0] == 0]
        assert len(model_runs) == ep.num_turns
        for turn, (_, ids, logprobs) in enumerate(model_runs):
            assert ids == generated[turn][k][:len(ids)]  # exactly the engine's tokens
            assert all(lp < 0 for lp in logprobs)  # sampled tokens carry their log-probs
        for _, ids, logprobs in obs_runs:
            assert all(lp == 0.0 for lp in logprobs)
            # exactly the wrapped text of one of the environment's answers, tokenized once
            assert any(ids == fmt.encode(fmt.observation(obs, closed)) for _, obs, _ in observed
                       for closed in (True, False)), tokenizer.decode(ids)
        sample = ep.sample({})
        targets = torch.tensor(ep.model_mask, dtype=torch.float)
        assert torch.equal(sample.loss_mask[len(ep.prompt_tokens) - 1:], targets)
        assert sample.loss_mask[:len(ep.prompt_tokens) - 1].sum() == 0


def _main_job(run_dir, *args: str, experiment: str = "demo_countdown"):
    """`python -m megatron_rl.train +experiment=<experiment> <args>` (demo_countdown: with a local
    sandbox server, bwrap); must exit 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if experiment == "demo_countdown" and runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "megatron_rl.train", f"+experiment={experiment}", "logging.progress=false",
           f"run_dir={run_dir}", *args]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo)),
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _ended(row: dict, prefix: str = "agent/") -> float:
    """The step's episodes, counted by how they ended (each ends one way)."""
    return sum(row[f"{prefix}{s}"] for s in ("submitted", "max_turns", "max_tokens", "wall_time", "dropped",
                                             "aborted", "deadline", "partial"))


def _agent_job(run_dir, *extra: str):
    """The main job on 8 generated agent tasks; `extra` overrides."""
    return _main_job(run_dir, "task.type=agent", "task.num_train=8", "task.num_eval=2", "task.eval_samples=1",
                     "task.eval_every=0", "task.max_episode_tokens=500", "task.max_observation_chars=60",
                     "task.system_prompt=Use tools.", "global_batch_size=8", "rollout.n_samples_per_prompt=4",
                     *extra)


def test_rl_loop_on_agent_tasks(tmp_path):
    """`python -m megatron_rl.train task.type=agent`: episodes in a sandbox server started by
    the job, rewards from the environment, masked samples through the update, checkpoint; the
    lockstep driver's scheduler metrics (its engine idles while the sandbox runs the turns)."""
    import json

    run_dir = tmp_path / "run"
    _agent_job(run_dir, "task.sft_warmup_steps=0", "task.max_turns=3", "num_steps=2", "rollout.max_new_tokens=24")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # 0: the evaluation before any update
    rows = rows[1:]
    for r in rows:
        assert _ended(r) == 8 and r["reward/verifier_calls"] == 8 and r["agent/dropped"] == 0
        assert 1 <= r["agent/turns_mean"] <= 3 and r["num_tokens"] > 0
        assert 0 < r["sched/engine_busy"] < 1 and 0 < r["sched/wall_s"] and r["sched/aborted"] == 0
        assert 0 < r["sched/step_engine_busy"] < 1  # the engine calls are on the step's timeline
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_sandboxed_episodes_from_a_disaggregated_generator(tmp_path):
    """rollout.mode=disaggregated with the async scheduler on sandboxed agent tasks: the generator
    process plays the episodes in the sandbox server the job started (it gets the server's
    address), its environments verify in the sandbox (their fail-to-pass tests ran: one per task),
    and the trainer trains on and logs the episodes it took from the buffer."""
    import json

    run_dir = tmp_path / "run"
    _agent_job(run_dir, "task.sft_warmup_steps=0", "task.max_turns=3", "num_steps=2", "rollout.max_new_tokens=24",
               "rollout.mode=disaggregated", "rollout.agent_scheduler=async")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # 0: the evaluation before any update
    rows = rows[1:]
    for r in rows:
        assert _ended(r) == 8 and r["agent/dropped"] == 0 and r["agent/infra_errors"] == 0
        assert r["agent/env/fail_to_pass_total"] == 1 and 1 <= r["agent/turns_mean"] <= 3
        assert r["async/staleness_max"] <= 1
    assert (run_dir / "logs" / "sandbox-server.log").exists() and (run_dir / "logs" / "generator0.log").exists()


def test_agent_warm_start_on_verified_reference_episodes(tmp_path):
    """`task.sft_warmup_steps` on agent tasks: each training task's reference solution is played
    through its environment (write, submit) and verified before the supervised steps train on
    those episodes (model turns only); the warm-start loss falls."""
    import re

    proc = _agent_job(tmp_path / "run", "task.sft_warmup_steps=20", "task.max_turns=4", "num_steps=1",
                      "rollout.max_new_tokens=300")
    assert "warm start: 8 of 8 reference episodes verified (episode ends: submitted 8" in proc.stderr
    losses = [float(x) for x in re.findall(r"warm start \d+/20: loss ([\d.]+)", proc.stderr)]
    assert len(losses) == 2 and losses[1] < 0.8 * losses[0], losses


def test_countdown_with_feedback_runs_without_a_sandbox_over_several_turns(tmp_path):
    """`+experiment=demo_agent_countdown`, shortened: the warm start verifies every task's one-turn
    reference episode; RL episodes of a barely warm model take several turns (each answered by
    the environment, no sandbox server started), and the environment's own counts reach the
    metrics (agent/env/...): one attempt per turn, solved exactly when rewarded. With a mixture of
    experts and rollout routing replay: the trainer routes every episode's tokens as the engine's last
    turn did, and its log-probs equal the engine's (routing that missed by a position would not). With the KL
    in the reward: the old and reference log-probs exist at the model's tokens only (NaN on the environment's
    answers), and the penalty reads those alone (a finite KL)."""
    import json

    run_dir = tmp_path / "run"
    proc = _main_job(run_dir, "num_steps=2", "task.sft_warmup_steps=5", "task.num_train=16", "task.num_eval=4",
                     "task.eval_samples=1", "task.eval_every=0", "global_batch_size=16",
                     "rollout.n_samples_per_prompt=4", "model=tiny_qwen3_moe", "algorithm.routing_replay=rollout",
                     "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", experiment="demo_agent_countdown")
    assert "warm start: 16 of 16 reference episodes verified (episode ends: submitted 16" in proc.stderr
    assert "local sandbox server" not in proc.stderr and not (run_dir / "logs" / "sandbox-server.log").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # 0: the evaluation before any update
    rows = rows[1:]
    for r in rows:
        assert _ended(r) == 16 and r["agent/dropped"] == 0
        assert 1 < r["agent/turns_mean"] <= 3 and r["agent/max_turns"] > 0
        assert r["agent/env/attempts"] == pytest.approx(r["agent/turns_mean"])
        assert r["agent/env/solved"] == pytest.approx(r["reward/mean"])
        assert r["agent/env/solved_first"] <= r["agent/env/solved"]
        assert r["rollout/logprob_mismatch"] < 1e-4 and 0 <= r["routing/drift"] < 0.5
        assert math.isfinite(r["kl_reward/kl"]) and math.isfinite(r["loss"]) and r["kl_reward/coef"] == 0.05


def test_an_agent_domain_trains_beside_a_single_turn_domain(tmp_path):
    """A joint run with an agent domain (generated function tasks, episodes in the sandbox,
    task.reward_scale=2) beside a rule-verified math domain, mixed 1:1: the warm start plays and
    verifies the agent domain's reference episodes (a full reward is 2 there: the scale reaches
    the environments' rewards) next to math's reference answers; each RL step holds both domains'
    groups, the agent domain's as episodes (turns, statuses under domain/code/), and evaluation
    reports both on the 0..1 scale."""
    import json
    import re

    run_dir = tmp_path / "run"
    domains = ("+domains={math:{task:{type:arithmetic,num_train:32,num_eval:2}},"
               "code:{task:{type:agent,generator:function,num_train:8,num_eval:2,reward_scale:2,max_turns:4,"
               "max_episode_tokens:500,max_observation_chars:60,system_prompt:'Use tools.'}}}")
    proc = _main_job(run_dir, domains, "task.eval_samples=1", "task.eval_every=2", "task.sft_warmup_steps=10",
                     "num_steps=2", "global_batch_size=16", "rollout.n_samples_per_prompt=4",
                     "rollout.max_new_tokens=300", "checkpoint.save_every=0")
    found = re.search(r"warm start: (\d+) of 8 reference episodes verified in domain code", proc.stderr)
    assert found and int(found.group(1)) >= 6, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # 0: the evaluation before any update
    rows = rows[1:]
    for r in rows:
        assert r["domain/math/count"] == r["domain/code/count"] == 8  # 2 groups of 4 each
        assert _ended(r, "domain/code/agent/") == 8 and r["domain/code/agent/dropped"] == 0
        assert 1 <= r["domain/code/agent/turns_mean"] <= 4
        assert 0 <= r["domain/code/reward_mean"] <= 2 and 0 <= r["domain/math/reward_mean"] <= 1
        assert not any(k.startswith("agent/") for k in r)  # episode metrics are the agent domain's
    final = rows[-1]
    assert 0 <= final["eval/code/accuracy"] <= 1 and 0 <= final["eval/math/accuracy"] <= 1
    assert final["eval/accuracy"] == pytest.approx((final["eval/code/accuracy"] + final["eval/math/accuracy"]) / 2)


def test_oversampling_in_a_joint_run_keeps_each_domains_share(tmp_path):
    """rollout.oversample=0.5 in a joint run of an agent domain (Countdown with feedback, async
    episodes) and a single-turn math domain, mixed 1:1: 6 prompts drawn for a batch of 4 groups,
    3 per domain; each domain keeps 2 groups (the agent domain cuts its third, the math domain
    generates only its two), so the batch holds both domains as the mixture weighs them.
    Evaluation is never cut: all 8 held-out prompts x 4 samples, twice the batch's 4 groups."""
    import json

    run_dir = tmp_path / "run"
    domains = ("+domains={math:{task:{type:arithmetic,num_train:16,num_eval:4}},"
               "count:{task:{type:agent,generator:countdown,environment:countdown,system_prompt:Countdown,"
               "max_turns:3,max_episode_tokens:256,num_train:16,num_eval:4}}}")
    proc = _main_job(run_dir, domains, "rollout.oversample=0.5", "rollout.agent_scheduler=async", "num_steps=2",
                     "task.sft_warmup_steps=5", "task.eval_every=2", "task.eval_samples=4", "global_batch_size=16",
                     "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=16", "checkpoint.save_every=0",
                     experiment="demo_agent_countdown")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2], proc.stderr[-3000:]  # 0: the evaluation before any update
    rows = rows[1:]
    for r in rows:
        assert r["domain/math/count"] == r["domain/count/count"] == 8  # 2 groups of 4 each
        assert r["sched/groups_cut"] == 1  # the agent domain's third group; math's third was never generated
    assert rows[-1]["eval/samples"] == 8 * 4


@pytest.mark.parametrize("layout", [["parallel.tp=1"], ["parallel.tp=2"]], ids=["dp2", "tp2"])
def test_agent_episodes_on_an_engine_shared_by_two_ranks(tmp_path, layout):
    """rollout.tp=2 on two ranks: one engine for the block, driven by its leader, which plays the
    episodes of both data-parallel shares (dp2: both ranks are first model-parallel ranks; tp2:
    one data-parallel group); every prompt is played exactly once and both ranks train on the
    same episodes (the step's metrics are complete, the run ends)."""
    import json

    run_dir = tmp_path / "run"
    _agent_job(run_dir, "cluster.nproc=2", "rollout.tp=2", *layout, "task.sft_warmup_steps=0", "task.max_turns=2",
               "num_steps=2", "rollout.max_new_tokens=24", "checkpoint.save_every=0", "checkpoint.save_at_end=false")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # 0: the evaluation before any update
    rows = rows[1:]
    for r in rows:
        assert _ended(r) == 8 and r["reward/verifier_calls"] == 8 and r["agent/dropped"] == 0
        assert r["num_tokens"] > 0 and 0 < r["sched/engine_busy"] < 1  # the leader's engine, the block's only one
    rank1 = (run_dir / "logs" / "rank1.log").read_text()
    assert "step 1" in (run_dir / "logs" / "rank0.log").read_text() and "Traceback" not in rank1
