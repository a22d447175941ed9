"""Generators of small agent task sets, standard library only so that they run in any sandbox.
For the `repo` environment (its task format: `megatron_rl/envs/repo.py`):

- `function_tasks`: function-level code tasks: write one function in `solution.py`;
  hidden unittest tests; a reference solution.
- `repo_tasks`: repository tasks: a tiny package `calc/` with one planted bug, its
  unittest suite in `tests/` (the failing test is fail_to_pass, the others are
  pass_to_pass regressions), a reference fix.

For the `countdown` environment (`megatron_rl/envs/countdown.py`):

- `countdown_tasks`: the Countdown problems of the single-turn task, train and held-out
  splits kept apart the same way (`data/countdown.py`), one reference expression each.

    python -m megatron_rl.data.agent_tasks repo 50 out.jsonl   (or function, countdown)

Both are learnable-size tasks for the CPU demo and fixtures for the tests; real task sets
come as JSONL rows of the same format. Their tests never import the code under test (see
`_JUDGED_TEST`): it cannot change how it is judged from inside.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from megatron_rl.envs.repo import UNITTEST_OK

# name: (signature, correct body, buggy body, [(args, expected)])
FUNCTIONS: dict[str, tuple[str, str, str, list[tuple[tuple, Any]]]] = {
    "add": ("a, b", "return a + b", "return a - b", [((2, 3), 5), ((-1, 1), 0), ((10, 7), 17)]),
    "sub": ("a, b", "return a - b", "return b - a", [((5, 3), 2), ((0, 4), -4), ((9, 9), 0)]),
    "mul": ("a, b", "return a * b", "return a + b", [((3, 4), 12), ((0, 5), 0), ((-2, 6), -12)]),
    "square": ("x", "return x * x", "return x + x", [((3,), 9), ((-4,), 16), ((5,), 25)]),
    "is_even": ("n", "return n % 2 == 0", "return n % 2 == 1", [((4,), True), ((7,), False), ((0,), True)]),
    "clamp": ("x, lo, hi", "return max(lo, min(x, hi))", "return min(lo, max(x, hi))",
              [((5, 0, 3), 3), ((-2, 0, 3), 0), ((2, 0, 3), 2)]),
    "maximum": ("a, b", "return a if a > b else b", "return a if a < b else b",
                [((2, 9), 9), ((7, 1), 7), ((4, 4), 4)]),
    "negate": ("x", "return -x", "return x", [((3,), -3), ((-8,), 8), ((0,), 0)]),
}


def _module(names: list[str], bug: str | None) -> str:
    out = []
    for name in names:
        signature, good, bad, _ = FUNCTIONS[name]
        out.append(f"def {name}({signature}):\n    {bad if name == bug else good}\n")
    return "\n\n".join(out)


# The generated tests judge outside the process that runs the code under test: each call of the
# function runs in a child Python process that prints its result as JSON, and the test process,
# which never imports that code, compares. Code in the solution that patches `unittest`, prints a
# passing report or exits early on import therefore changes nothing the test process decides,
# and the test process is made non-dumpable, so the child cannot ptrace it or reach its memory or
# file descriptors through /proc (its exit status and report stay its own). The assertions keep
# the `assertEqual(f(args), expected)` form the hard-coded-output guard reads. The child runs
# without site-packages (`-S`, ~45 ms less per call): the generated functions need the standard
# library only.
_JUDGED_TEST = """import json
@IMPORT_OS@import subprocess
import sys
import unittest

CHILD = ("import json, sys; sys.path.append('.'); from @MODULE@ import @NAME@; "
         "result = @NAME@(*json.loads(sys.argv[1])); print(); print(json.dumps(result))")


def _seal():
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    except Exception:  # no ctypes or no prctl: the tests still run, unsealed
        pass


_seal()
@FORGET@


def @NAME@(*args):
    \"\"\"@MODULE@.@NAME@(*args), run in a process of its own (the code under test never runs in this one).\"\"\"
    proc = subprocess.run([sys.executable, "-I", "-B", "-S", "-c", CHILD, json.dumps(args)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError("@NAME@%r failed (exit %d): %s" % (args, proc.returncode, proc.stderr[-2000:]))
    return json.loads(lines[-1])


class Test@CLASS@(unittest.TestCase):
    def test_@NAME@(self):
@CASES@


if __name__ == '__main__':
    unittest.main()
"""


# A hidden test deletes its own file once imported (it is written back before every test run), so
# the code under test, which runs only after that, cannot read the expected values from it.
_FORGET = "os.unlink(__file__)  # hidden: the code under test cannot read the expected values\n"


def _test_class(module: str, name: str, hidden: bool = False) -> str:
    cases = "\n".join(f"        self.assertEqual({name}({', '.join(map(repr, args))}), {expected!r})"
                      for args, expected in FUNCTIONS[name][3])
    return (_JUDGED_TEST.replace("@MODULE@", module).replace("@NAME@", name)
            .replace("@CLASS@", name.title().replace("_", "")).replace("@CASES@", cases)
            .replace("@IMPORT_OS@", "import os\n" if hidden else "").replace("@FORGET@\n", _FORGET if hidden else ""))


def _unittest(module: str, name: str) -> dict[str, Any]:
    return {"name": name, "argv": ["python3", "-m", "unittest", "-q", module],
            "success_pattern": UNITTEST_OK}


def function_tasks(num: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    tasks = []
    for i in range(num):
        name = rng.choice(sorted(FUNCTIONS))
        signature, body, _, cases = FUNCTIONS[name]
        example = f"{name}({', '.join(map(repr, cases[0][0]))}) == {cases[0][1]!r}"
        tasks.append({
            "id": f"function-{i}-{name}",
            "instruction": f"Write a Python function `{name}({signature})` in solution.py, e.g. {example}.",
            "files": {},
            "hidden_files": {"test_solution.py": _test_class("solution", name, hidden=True)},
            "fail_to_pass": [_unittest("test_solution", name)],
            "pass_to_pass": [],
            "reference": {"solution.py": f"def {name}({signature}):\n    {body}\n"},
        })
    return tasks


def repo_tasks(num: int, seed: int = 0, functions_per_repo: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    tasks = []
    for i in range(num):
        names = sorted(rng.sample(sorted(FUNCTIONS), functions_per_repo))
        bug = rng.choice(names)
        files = {"calc/__init__.py": "", "calc/ops.py": _module(names, bug), "tests/__init__.py": ""}
        files.update({f"tests/test_{n}.py": _test_class("calc.ops", n) for n in names})
        tasks.append({
            "id": f"repo-{i}-{bug}",
            "instruction": "A test in tests/ fails. Fix the bug in calc/ops.py without changing the tests.",
            "files": files,
            "hidden_files": {},
            "fail_to_pass": [_unittest(f"tests.test_{bug}", bug)],
            "pass_to_pass": [_unittest(f"tests.test_{n}", n) for n in names if n != bug],
            "test_command": ["python3", "-m", "unittest", "-q"],
            "reference": {"calc/ops.py": _module(names, None)},
        })
    return tasks


def countdown_tasks(num: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    from megatron_rl.data import countdown

    return [{"id": f"countdown-{split}-{i}", "instruction": countdown.format_prompt(p).strip(),
             "numbers": list(p.numbers), "target": p.target, "reference": p.solution}
            for i, p in enumerate(countdown.generate_problems(num, seed=seed, split=split))]


GENERATORS = {"function": function_tasks, "repo": repo_tasks, "countdown": countdown_tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(GENERATORS))
    parser.add_argument("num", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tasks = GENERATORS[args.kind](args.num, args.seed)
    args.out.write_text("".join(json.dumps(t) + "\n" for t in tasks))


if __name__ == "__main__":
    main()
