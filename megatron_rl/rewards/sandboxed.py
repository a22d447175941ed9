"""Sandbox verifiers: the reward comes from really executing model output in the sandbox
service, through the client (deadline per call, never a hung step). A verification that no
server answered in time (all down, draining or saturated), whose verifier script failed, or
that ran no test (a task without tests) is no verdict on the model: its items score
`NO_VERDICT`, which the rollout collector turns into unscored samples (left out of baselines
and the loss), and it is counted in `reward/verifier_errors`. Scoring them 0 would train the
policy away from answers that were never checked. What the candidate's own code does (fails
tests, hits a limit) is a verdict.

- `CountdownVerifier`: the expressions of a whole batch run in ONE sandbox execution (a
  small script parses each, evaluates it and checks the numbers used, by the reference checker's rules:
  `countdown.judge`), so a step costs one round trip.
  Expressions are screened first (characters of the task only, no `**`), so evaluation is
  bounded; the sandbox's limits bound it anyway.
- `TestsVerifier`: a task's tests run against each candidate (`Verify`: passed / total). The candidate
  file is the response's code (`response_code`): an instruct model answers in prose around a fenced
  block, and the prose written to `solution.py` would fail every test as a syntax error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Sequence

from megatron_rl.data.countdown import MIN_NUMBERS_USED
from megatron_rl.rewards.custom import NO_VERDICT

logger = logging.getLogger(__name__)

_SCREEN = re.compile(r"[0-9+\-*() ]{1,64}")
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[ \t]*\n(.*?)```", re.DOTALL)
_THINKING = re.compile(r"^.*</think>", re.DOTALL)


def response_code(completion: str) -> str:
    """The code a response submits: after a reasoning model's thinking (everything up to its last
    `</think>`), the last fenced block (```python ... ```, or one of no language) if there is one, else the
    whole text (a model that answers with bare code)."""
    answer = _THINKING.sub("", completion)
    blocks = _FENCE.findall(answer)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3", "")]
    return python[-1] if python else answer

# The rules of `megatron_rl.data.countdown.judge` (the reference checker), for a sandbox that has python3 alone:
# binary + - * over integer literals only, at least MIN_NUMBERS_USED of them, a sub-multiset of the numbers, equal
# to the target. An earlier script eval'd the expression, which took unary signs ("-8+9", "+3*5+7") that the
# reference refuses: the sandbox rewarded answers the task does not allow (found by benchmarks/learning.py, whose
# two reward paths parted at one sample of step 18).
COUNTDOWN_SCRIPT = r'''
import ast, json
from collections import Counter
OPERATIONS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
def value(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATIONS:
        return OPERATIONS[type(node.op)](value(node.left), value(node.right))
    raise ValueError(type(node).__name__)
out = []
for item in json.load(open("candidates.json")):
    try:
        tree = ast.parse(item["expr"], mode="eval").body
        used = Counter(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant))
        ok = (value(tree) == item["target"] and sum(used.values()) >= %(min_used)d
              and not (used - Counter(item["numbers"])))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        ok = False
    out.append(1.0 if ok else 0.0)
print(json.dumps(out))
''' % {"min_used": MIN_NUMBERS_USED}


def screen_countdown(expr: str) -> bool:
    expr = expr.strip()
    return bool(_SCREEN.fullmatch(expr)) and "**" not in expr


class CountdownVerifier:
    def __init__(self, client: Any, deadline_s: float = 60.0, limits: dict | None = None) -> None:
        self.client = client
        self.deadline_s = deadline_s
        self.limits = limits or {"wall_time_s": 20, "cpu_time_s": 20, "memory_bytes": 256 * 2**20}
        self.errors = 0
        self.calls = 0

    async def score(self, items: Sequence[tuple[dict, str]]) -> list[float]:
        """items: (problem {"numbers", "target"}, completion text) -> rewards."""
        exprs = [c.strip().split("\n", 1)[0].strip() for _, c in items]
        todo = [i for i, e in enumerate(exprs) if screen_countdown(e)]
        rewards = [0.0] * len(items)
        if not todo:
            return rewards
        self.calls += 1
        payload = [{"expr": exprs[i], "numbers": list(items[i][0]["numbers"]), "target": items[i][0]["target"]}
                   for i in todo]
        files = {"verify.py": COUNTDOWN_SCRIPT, "candidates.json": json.dumps(payload)}
        result = await self.client.execute(["python3", "verify.py"], files,
                                           limits=self.limits, deadline_s=self.deadline_s)
        try:
            scores = json.loads(result.stdout)
            assert len(scores) == len(todo)
        except (ValueError, AssertionError):  # no server answered, or the script failed: not the candidates'
            self.errors += 1
            logger.warning("countdown verification failed (%s); %d sample(s) left unscored",
                           result.message or result.stderr[-200:], len(todo))
            for i in todo:
                rewards[i] = NO_VERDICT
            return rewards
        for i, s in zip(todo, scores):
            rewards[i] = float(s)
        return rewards


class TestsVerifier:
    def __init__(self, client: Any, deadline_s: float = 120.0, limits: dict | None = None,
                 max_concurrency: int = 32) -> None:
        self.client = client
        self.deadline_s = deadline_s
        self.limits = limits or {}
        self.semaphore = asyncio.Semaphore(max_concurrency)
        self.errors = 0

    async def score(self, items: Sequence[tuple[dict, str]]) -> list[float]:
        """items: (task {"files": {path: text}, "tests": [TestCase dicts], "solution_path"}, completion)."""
        async def one(task: dict, completion: str) -> float:
            files = dict(task.get("files", {}))
            files[task.get("solution_path", "solution.py")] = response_code(completion)
            import grpc

            async with self.semaphore:
                try:
                    result = await self.client.verify(files, task["tests"], limits=self.limits,
                                                      deadline_s=self.deadline_s)
                except grpc.aio.AioRpcError as exc:  # refused for good: e.g. more tests than a server can admit
                    self.errors += 1
                    logger.error("verification refused (%s: %s): the sample is left unscored", exc.code().name,
                                 exc.details())
                    return NO_VERDICT
            if not result.server or result.total == 0:  # no server answered in time, or the task has no tests
                self.errors += 1
                return NO_VERDICT
            return float(result.reward)
        return list(await asyncio.gather(*(one(t, c) for t, c in items)))
