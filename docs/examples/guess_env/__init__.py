"""An example environment package: guess a number in a few turns, told "higher" or "lower" after each guess.

Use it from a checkout without installing anything:

    PYTHONPATH=docs/examples python -m megatron_rl.train +experiment=demo_agent_countdown \
        task.environment=guess_env:GuessNumberEnvironment task.path=docs/examples/guess_env/tasks.jsonl \
        task.sft_warmup_steps=20

(rows with a `path` are read instead of the experiment's generated countdown tasks.)

The contract (megatron_rl/envs/base.py): `reset(task) -> first observation`, `step(model turn) ->
(observation, done)`, `evaluate() -> reward in [0, 1]`, `close()`, all async; `model_errors` counts turns
that were the model's fault (here: a turn with no number), `info` holds what evaluate found. The static
`reference_turns(task)` gives a solution the warm start can train on and the quality checks can verify.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


class GuessNumberEnvironment:
    needs_sandbox = False  # it runs nothing: no sandbox server is started for it
    system_prompt = "Guess the secret number. Answer each turn with one integer."

    def __init__(self, client: Any = None, max_turns: int = 6, **_: Any) -> None:
        self.max_turns = max_turns
        self.model_errors, self.infra_errors, self.info = 0, 0, {}

    async def reset(self, task: dict[str, Any]) -> str:
        self.secret, self.low, self.high = int(task["answer"]), int(task["low"]), int(task["high"])
        self.turns, self.solved = 0, False
        return task["instruction"]

    async def step(self, action: str) -> tuple[str, bool]:
        self.turns += 1
        numbers = _NUMBER.findall(action)
        if not numbers:
            self.model_errors += 1
            return "Answer with an integer.", self.turns >= self.max_turns
        guess = int(numbers[-1])
        self.solved = guess == self.secret
        if self.solved:
            return "Correct.", True
        return ("Higher." if guess < self.secret else "Lower."), self.turns >= self.max_turns

    async def evaluate(self) -> float:
        self.info = {"turns": self.turns, "solved": self.solved}
        return 1.0 if self.solved else 0.0

    async def close(self) -> None:
        pass

    @staticmethod
    def reference_turns(task: dict[str, Any]) -> list[str]:
        """Binary search: the turns a perfect player takes (ends on the secret)."""
        low, high, secret, turns = int(task["low"]), int(task["high"]), int(task["answer"]), []
        while True:
            guess = (low + high) // 2
            turns.append(str(guess))
            if guess == secret:
                return turns
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)

    @staticmethod
    def known_bad_turns(task: dict[str, Any]) -> list[str]:
        """A candidate the verifier must reject: a guess outside the range."""
        return [str(int(task["high"]) + 1)]
