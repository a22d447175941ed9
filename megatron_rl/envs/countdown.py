"""`countdown`: Countdown with feedback, a multi-turn environment without a sandbox.

The task is the Countdown problem of the single-turn demo (reach the target with + - * over
the given numbers, each used at most once; `data/countdown.py`), but a wrong answer is not the
end: the environment answers what the expression is worth, or what is wrong with it, and the
model tries again, until it is right or the episode's turn limit is reached.

    user:      3 5 7 -> 22
    assistant: 3*7+5
    tool:      26, too high
    assistant: 3*5+7                  -> solved, reward 1

Each turn is one expression (its first line); the observation of a wrong one is its value and
"too low" / "too high", or "invalid: " and the reason (not an expression of + - * over the
numbers, fewer than two numbers, "5 is not given", "4 used too often"). The reward is 1
when a turn solved the task, else 0; `info` records the number of attempts and whether the
first one was right (how much the feedback helped).

Answers are checked in-process by `data.countdown`'s allow-list evaluator (an `ast` walk with a
64-character cap, never `eval`), so nothing the model writes is executed: no sandbox is needed.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.data import countdown

SYSTEM_PROMPT = "Reach the target with + - * over the numbers, each used at most once. One expression per turn."


def check(numbers: list[int], target: int, answer: str) -> tuple[bool, str]:
    """(solved, observation) for one answer to the problem `numbers -> target`."""
    value, wrong = countdown.judge(countdown.CountdownProblem(tuple(numbers), int(target), ""), answer)
    if value is None:
        return False, f"invalid: {wrong}"
    if value == int(target):
        return True, "correct"
    return False, f"{value}, too {'low' if value < int(target) else 'high'}"


class CountdownEnvironment:
    system_prompt = SYSTEM_PROMPT
    needs_sandbox = False

    def __init__(self, client: Any = None, **_: Any) -> None:
        self.model_errors, self.info = 0, {}

    @staticmethod
    def reference_turns(task: dict[str, Any]) -> list[str]:
        """The model turns that play the task's reference solution: the expression."""
        return [str(task["reference"])] if task.get("reference") else []

    @staticmethod
    def known_bad_turns(task: dict[str, Any]) -> list[str]:
        """A well-formed answer of another value (the verifier must reject it)."""
        a, b = (int(n) for n in task["numbers"][:2])
        candidates = ((f"{a}+{b}", a + b), (f"{a}*{b}", a * b), (f"{a}-{b}", a - b), (f"{b}-{a}", b - a))
        return [next(text for text, value in candidates if value != int(task["target"]))]

    async def reset(self, task: dict[str, Any]) -> str:
        missing = [k for k in ("numbers", "target", "instruction") if k not in task]
        if missing:
            raise ValueError(f"countdown task {task.get('id', '?')} lacks {', '.join(missing)}")
        self.task, self.attempts, self.solved_at = task, 0, 0
        return task["instruction"]

    async def step(self, action: str) -> tuple[str, bool]:
        self.attempts += 1
        solved, observation = check(self.task["numbers"], self.task["target"], action)
        if solved:
            self.solved_at = self.attempts
        elif observation.startswith("invalid"):
            self.model_errors += 1
        return observation, solved

    async def evaluate(self) -> float:
        self.info = {"attempts": self.attempts, "solved": bool(self.solved_at),
                     "solved_first": self.solved_at == 1}
        return float(bool(self.solved_at))

    async def close(self) -> None:
        pass
