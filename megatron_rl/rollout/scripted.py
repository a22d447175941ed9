"""`ScriptedPolicy`: a rollout engine that plays given turns instead of sampling a model.

It implements the `RolloutEngine` protocol so that an environment can be driven exactly
as training drives it (same multi-turn rollout, same tokenization, same verification) by a
known policy: a reference solution (is the task solvable?), a known-bad or reward-hacking
candidate (does the verifier reject it?). Turns are chosen by how many model turns the
conversation already holds (occurrences of the chat template's generation prompt), so one
script serves every episode; a turn may be a function of the decoded conversation, e.g. to
play each task's own reference solution.

Log-probs are reported as 0 (probability 1: the script is deterministic).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence, Union

import torch

from megatron_rl.rollout.base import ALL_TAGS, Generation, SamplingParams

Turn = Union[str, Callable[[str], str]]


class ScriptedPolicy:
    weight_version = 0

    def __init__(self, tokenizer: Any, turns: Sequence[Turn], end_of_turn: str = "") -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.end_of_turn = end_of_turn
        user = [{"role": "user", "content": "u"}]
        closed = tokenizer.apply_chat_template(user, tokenize=False)
        generation_prompt = tokenizer.apply_chat_template(user, tokenize=False,
                                                          add_generation_prompt=True)[len(closed):]
        self.marker = tokenizer(generation_prompt, add_special_tokens=False)["input_ids"]
        if not self.marker:
            raise ValueError("the chat template has no generation prompt to count turns by")

    def _turn_index(self, prompt: Sequence[int]) -> int:
        m, count = self.marker, 0
        for i in range(len(prompt) - len(m) + 1):
            count += list(prompt[i:i + len(m)]) == m
        return count - 1

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for index, prompt in enumerate(prompts):
            k = self._turn_index(prompt)
            turn = self.turns[k] if 0 <= k < len(self.turns) else ""
            text = turn(self.tokenizer.decode(list(prompt))) if callable(turn) else turn
            ids = self.tokenizer(text + self.end_of_turn, add_special_tokens=False)["input_ids"]
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[:params.max_new_tokens], "length"
            for _ in range(params.n):
                out.append(Generation(index, list(ids), [0.0] * len(ids), finish, self.weight_version))
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush: bool = True) -> None:
        self.weight_version = version

    def release_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        """Nothing to release: the script holds no weights."""

    def resume_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        """Nothing to resume."""

    def pause(self) -> None:
        """Generation is synchronous: nothing to pause."""

    def resume(self) -> None:
        """See pause()."""

    def abort(self) -> None:
        """Nothing is ever in flight."""

    def health(self) -> dict:
        return {"backend": "scripted", "turns": len(self.turns), "weight_version": self.weight_version}
