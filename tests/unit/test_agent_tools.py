"""The agent's tool-call parser and result rendering, and the reward-hacking guards, on
hand-written inputs."""

from __future__ import annotations

import pytest

from megatron_rl.envs import ENVIRONMENTS, environment_factory, environment_names, make_environment, register_environment
from megatron_rl.envs.guards import hardcoded_returns, tampered_paths, literals_in_tests
from megatron_rl.envs.tools import ToolCall, ToolCallError, format_result, format_tool_call, parse_tool_call

TESTS = """
import unittest
from calc.ops import square

class T(unittest.TestCase):
    def test_square(self):
        self.assertEqual(square(3), 9)
        assert square(-4) == 16
"""


def test_parse_well_formed_calls_and_final_answers():
    assert parse_tool_call('I will look. <tool_call>{"name": "read", "arguments": {"path": "a.py"}}</tool_call>') \
        == ToolCall("read", {"path": "a.py"})
    assert parse_tool_call(format_tool_call("test")) == ToolCall("test", {})
    assert parse_tool_call("The answer is 4.") is None
    # one call per turn: the first runs, what follows its closing tag is ignored
    assert parse_tool_call(format_tool_call("test") + format_tool_call("submit")) == ToolCall("test", {})


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{oops}</tool_call>", "not valid JSON"),
    ('<tool_call>["run"]</tool_call>', 'must be a JSON object with a "name"'),
    ('<tool_call>{"name": "rm"}</tool_call>', "unknown tool 'rm'"),
    ('<tool_call>{"name": "run", "arguments": {}}</tool_call>', "needs argument 'command' (str)"),
    ('<tool_call>{"name": "read", "arguments": {"path": 3}}</tool_call>', "needs argument 'path' (str)"),
    ('<tool_call>{"name": "test", "arguments": {"x": 1}}</tool_call>', "unknown arguments ['x']"),
    ('<tool_call>{"name": "submit"}', "no closing </tool_call>"),  # cut by the token limit
    ('<tool_call>{"name": "run", "arguments": {"command": "rm -rf calc"}}', "no closing </tool_call>"),
])
def test_malformed_calls_raise_a_message_for_the_model(text, message):
    with pytest.raises(ToolCallError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_tool_call(text)


def test_results_are_structured_and_bounded():
    assert format_result(0, b"ok\n", b"", 100) == "exit_code: 0\nstdout:\nok\n"
    long = format_result(1, b"x" * 1000, b"err", 100, note="wall-time limit")
    assert long.startswith("exit_code: 1 (wall-time limit)\nstdout:\n" + "x" * 50)
    assert "[900 characters truncated]" in long and long.endswith("stderr:\nerr")


def test_tampering_is_any_change_to_a_protected_path():
    from megatron_rl.envs.guards import sha256

    original = {"calc/ops.py": "a", "tests/test_a.py": "t"}
    clean = {"calc/ops.py": sha256("changed"), "tests/test_a.py": sha256("t")}
    assert tampered_paths(original, clean, ["tests/"]) == []
    assert tampered_paths(original, {**clean, "tests/test_a.py": sha256("u")}, ["tests/"]) == ["tests/test_a.py"]
    assert tampered_paths(original, {"calc/ops.py": sha256("a")}, ["tests/"]) == ["tests/test_a.py"]  # deleted
    assert tampered_paths(original, {**clean, "tests/conftest.py": sha256("")}, ["tests"]) == ["tests/conftest.py"]


def test_default_protection_covers_whole_test_directories():
    """New files under a tests/ directory (conftest.py, __init__.py) are tampering with the
    default protection, not only edits of the listed test files."""
    from megatron_rl.data.agent_tasks import function_tasks, repo_tasks
    from megatron_rl.envs.guards import sha256
    from megatron_rl.envs.repo import default_protected

    task = repo_tasks(1, seed=3)[0]
    protected = default_protected(task)
    assert protected == ["tests/"]
    clean = {p: sha256(c) for p, c in task["files"].items()}
    assert tampered_paths(task["files"], clean, protected) == []
    assert tampered_paths(task["files"], {**clean, "tests/conftest.py": sha256("")}, protected) == ["tests/conftest.py"]
    assert tampered_paths(task["files"], {**clean, "calc/conftest.py": sha256("")}, protected) == []
    assert default_protected(function_tasks(1, seed=0)[0]) == ["test_solution.py"]
    assert default_protected({"files": {"pkg/tests/a.py": "", "pkg/mod.py": "", "test_top.py": ""},
                              "hidden_files": {"pkg/tests/deep/test_b.py": ""}}) == ["pkg/tests/", "test_top.py"]


def test_test_commands_run_with_the_workspace_after_the_standard_library():
    from megatron_rl.envs.guards import TEST_LAUNCHER, isolated_test_argv

    assert isolated_test_argv(["python3", "-m", "unittest", "-q", "tests.test_a"]) == \
        ["python3", "-I", "-B", "-c", TEST_LAUNCHER, "-m", "unittest", "-q", "tests.test_a"]
    assert isolated_test_argv(["/usr/bin/python3.11", "run_tests.py"])[:4] == ["/usr/bin/python3.11", "-I", "-B", "-c"]
    for unchanged in (["sh", "-c", "python3 -m unittest"], ["python3", "-W", "error", "-m", "unittest"], ["python3"]):
        assert isolated_test_argv(unchanged) == unchanged


def test_hard_coded_outputs_are_flagged_and_computed_ones_are_not():
    expected, inputs = literals_in_tests([TESTS])
    assert expected == {"9", "16"} and inputs == {"3", "-4"}
    old = "def square(x):\n    return x + x\n"
    assert hardcoded_returns("def square(x):\n    return x * x\n", old, expected, inputs) == []
    hacked = "def square(x):\n    if x == 3:\n        return 9\n    if x == -4:\n        return 16\n    return 0\n"
    assert hardcoded_returns(hacked, old, expected, inputs) == ["square"]
    lookup = "def square(x):\n    return 9 if x == 3 else x * x\n"
    assert hardcoded_returns(lookup, old, expected, inputs) == ["square"]
    # a literal that the tests expect, returned for an input the tests do not use, is fine
    assert hardcoded_returns("def square(x):\n    if x == 0:\n        return 0\n    return x * x\n", old,
                             expected, inputs) == []


def test_environment_registry_refuses_duplicates_and_names_the_valid_ones():
    from megatron_rl.envs.repo import RepoEnvironment

    assert environment_factory("repo") is RepoEnvironment
    with pytest.raises(ValueError, match="already registered .*built-in"):
        register_environment("repo")(object)
    name = "test-registry-env"
    register_environment(name)(RepoEnvironment)
    try:
        with pytest.raises(ValueError, match="already registered .*RepoEnvironment"):
            register_environment(name)(object)
        assert environment_factory(name) is RepoEnvironment and name in environment_names()
    finally:
        del ENVIRONMENTS[name]
    with pytest.raises(ValueError, match="'nope' is not registered: registered ones are countdown, repo, synthetic"):
        make_environment("nope")


def test_the_environment_registry_imports_no_environment():
    # envs/base.py names the built-ins by path; their modules import it, never the other way round
    import ast
    from pathlib import Path

    import megatron_rl.envs.base as base

    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(ast.parse(Path(base.__file__).read_text()))
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in getattr(n, "names", [])}
    assert not {m for m in imported if m and m.startswith("megatron_rl.envs.") and m != "megatron_rl.envs.tools"}
    for name, path in base.BUILTIN_ENVIRONMENTS.items():
        assert environment_factory(name).__name__ == path.partition(":")[2]


def test_environments_by_dotted_path():
    env = make_environment("megatron_rl.envs.repo:RepoEnvironment", client=None, output_limit=10)
    assert env.output_limit == 10
    with pytest.raises(ValueError, match="cannot be loaded"):
        make_environment("megatron_rl.envs.repo:Nope")
