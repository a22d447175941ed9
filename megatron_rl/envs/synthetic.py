"""`synthetic`: an environment without a sandbox whose tool calls take a random time, for
measuring and testing rollout scheduling (benchmarks/scheduling.py). Each step sleeps
U(min_latency_s, max_latency_s) (seeded by the task and the turn, so reruns wait the same),
or exactly the task's own `latency_s` when it has one (a planted straggler),
the episode ends after `turns` steps, and the reward is 1 when the model's last turn
contains the task's `answer` string (else 0)."""

from __future__ import annotations

import asyncio
import random
from typing import Any


class SyntheticEnvironment:
    needs_sandbox = False

    def __init__(self, client: Any = None, min_latency_s: float = 0.1, max_latency_s: float = 2.0, turns: int = 3,
                 **_: Any) -> None:
        self.min_latency_s, self.max_latency_s, self.turns = min_latency_s, max_latency_s, turns
        self.model_errors, self.infra_errors, self.info = 0, 0, {}

    async def reset(self, task: dict[str, Any]) -> str:
        self.task, self.turn, self.last = task, 0, ""
        self.rng = random.Random(f"{task.get('id', task['instruction'])}")
        return task["instruction"]

    async def step(self, action: str) -> tuple[str, bool]:
        self.turn += 1
        self.last = action
        fixed = self.task.get("latency_s")
        await asyncio.sleep(fixed if fixed is not None else self.rng.uniform(self.min_latency_s, self.max_latency_s))
        return f"tool result {self.turn}", self.turn >= self.turns

    async def evaluate(self) -> float:
        self.info = {"turns": self.turn}
        return float(str(self.task.get("answer", "\0")) in self.last)

    async def close(self) -> None:
        pass
