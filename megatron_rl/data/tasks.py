"""Tasks: prompts with what their reward needs, a reference answer for the warm start, and
the verifier that scores completions.

- `countdown`: generated puzzles; the expression is executed in the sandbox service.
- `math`: generated word problems (`Ann has 3 pens and gets 4 more.`); the final answer
  (`\\boxed{7}`) is checked by rule.
- `jsonl`: a file of `{"prompt": ..., "answer": ...}` rows (optional `"response"` for the warm
  start), checked by rule.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Callable

from megatron_rl.data import countdown
from megatron_rl.data.countdown import generate_problems


@dataclasses.dataclass
class Prompt:
    text: str
    tokens: list[int]
    meta: dict[str, Any]  # what the verifier needs
    reference: str  # a correct response (warm start)


class RuleVerifier:
    """Math answers by rule (no sandbox needed)."""

    errors = 0

    async def score(self, items) -> list[float]:
        from megatron_rl.rewards.rule import math_reward

        return [math_reward(completion, meta["answer"]) for meta, completion in items]


_NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay")
_THINGS = ("pens", "cups", "eggs", "hats", "keys")


def _math_problem(rng: random.Random) -> tuple[str, str]:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < 0.5 or a <= b:
        return f"{name} has {a} {thing} and gets {b} more.", str(a + b)
    return f"{name} has {a} {thing} and loses {b}.", str(a - b)


class Task:
    def __init__(self, task_cfg: Any, tokenizer: Any) -> None:
        self.cfg = task_cfg
        self.tokenizer = tokenizer

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompts(self, split: str) -> list[Prompt]:
        num = self.cfg.num_train if split == "train" else self.cfg.num_eval
        if num == 0:
            return []
        kind = self.cfg.type
        if kind == "countdown":
            problems = generate_problems(num, seed=self.cfg.seed, split=split)
            return [Prompt(countdown.format_prompt(p), self._encode(countdown.format_prompt(p)),
                           {"numbers": list(p.numbers), "target": p.target}, countdown.format_answer(p))
                    for p in problems]
        if kind == "math":
            rng = random.Random(self.cfg.seed * 2 + (split == "eval"))
            out = []
            for _ in range(num):
                question, answer = _math_problem(rng)
                text = question + "\n"
                out.append(Prompt(text, self._encode(text), {"answer": answer}, f"\\boxed{{{answer}}}"))
            return out
        rows = [json.loads(line) for line in Path(self.cfg.path).read_text().splitlines() if line.strip()]
        rows = rows[: self.cfg.num_eval] if split == "eval" else rows[self.cfg.num_eval:][:num]
        return [Prompt(r["prompt"], self._encode(r["prompt"]), {"answer": str(r["answer"])},
                       r.get("response", f"\\boxed{{{r['answer']}}}")) for r in rows]

    @property
    def needs_sandbox(self) -> bool:
        return self.cfg.type == "countdown"

    def verifier_factory(self, sandbox_addresses: list[str]) -> Callable[[], Any]:
        if not self.needs_sandbox:
            return RuleVerifier

        def build():
            from megatron_rl.rewards.sandboxed import CountdownVerifier
            from megatron_rl_sandbox.client import SandboxClient

            return CountdownVerifier(SandboxClient(sandbox_addresses, deadline_s=60))
        return build
