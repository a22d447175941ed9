"""Executed checks of a task set, in the sandbox: each task's reference solution and a
known-bad candidate are verified `reruns` times (solvability, verifier stability), and a
policy's pass rate is measured (difficulty).

Three kinds of task, told apart by their fields:

- agent (`instruction` + `files` / `fail_to_pass` for the `repo` environment, `instruction`
  for any other `--environment`): the reference is played by `ScriptedPolicy` through the same
  multi-turn rollout and environment as training (the environment class's `reference_turns`;
  repo: write each reference file, submit); so is its known-bad candidate (`known_bad_turns`;
  repo: submit the untouched workspace, which must fail: that is what fail_to_pass means).
- tests (`prompt` + `tests`): the reference (`reference` or `response`) and an empty
  solution go through the sandbox `Verify` call, as the `tests` verifier does in training.
- answer (`prompt` + `answer`): `\\boxed{answer}` and a wrong answer through the rule
  verifier (deterministic, so never flaky; checked for completeness).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional, Sequence

from megatron_rl.envs import known_bad_turns, reference_turns, system_prompt
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.multiturn import EpisodeLimits, TurnFormat, run_episodes
from megatron_rl.rollout.scripted import ScriptedPolicy

logger = logging.getLogger(__name__)
LIMITS = EpisodeLimits(max_turns=16, max_tokens=1 << 20, wall_time_s=300)


def task_kind(task: dict[str, Any], environment: str = "repo") -> str:
    if "instruction" in task and ("files" in task or "fail_to_pass" in task or environment != "repo"):
        return "agent"
    if "tests" in task:
        return "tests"
    if "answer" in task:
        return "answer"
    raise ValueError(f"task {task.get('id', '?')}: cannot tell its kind (agent tasks have instruction + files / "
                     "fail_to_pass, code tasks prompt + tests, rule tasks prompt + answer)")


class Runner:
    """Runs verifications on a background event loop (the reward service's), against the
    sandbox servers at `addresses`."""

    def __init__(self, addresses: Sequence[str], tokenizer: Any, environment: str = "repo") -> None:
        from megatron_rl.config import TaskConfig
        from megatron_rl.data.tasks import Task
        from megatron_rl.rewards.service import RewardService

        self.tokenizer, self.environment = tokenizer, environment
        self.fmt = TurnFormat(tokenizer, system_prompt(environment))
        generator = "countdown" if environment == "countdown" else "repo"  # a valid pair (unused: tasks come here)
        host = Task(TaskConfig(type="agent", environment=environment, generator=generator, num_train=1, num_eval=0),
                    tokenizer)
        self.service = RewardService(host.verifier_factory(list(addresses)))
        if self.service.verifier.client is not None:  # None: an environment without a sandbox
            self.service.verifier.client.priority_class = "quality"  # below training and evaluation at the sandbox

    def close(self) -> None:
        self.service.close()

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.service.loop).result(3600)

    # -- reference and known-bad candidates ------------------------------------------------------
    def verdicts(self, task: dict[str, Any], reruns: int) -> tuple[list[float], list[float], dict[str, Any]]:
        """(reference rewards, known-bad rewards, details of the first reference run)."""
        kind = task_kind(task, self.environment)
        if kind == "agent":
            bad_turns = known_bad_turns(self.environment, task)  # an environment without one fails before any episode
            good = self._episodes(task, reference_turns(self.environment, task), reruns)
            bad = self._episodes(task, bad_turns, reruns)
            return [e.reward for e in good], [e.reward for e in bad], good[0].info if good else {}
        if kind == "tests":
            reference = task.get("reference") or task.get("response") or ""
            if isinstance(reference, dict):
                reference = next(iter(reference.values()), "")
            return (self._verify(task, reference, reruns), self._verify(task, "", reruns), {})
        from megatron_rl.rewards.rule import math_reward

        answer = str(task["answer"])
        wrong = answer + "1" if answer else "1"
        return ([math_reward(f"\\boxed{{{answer}}}", answer)] * reruns,
                [math_reward(f"\\boxed{{{wrong}}}", answer)] * reruns, {})

    def _episodes(self, task: dict[str, Any], turns: list[str], n: int) -> list:
        policy = ScriptedPolicy(self.tokenizer, turns, end_of_turn=self.fmt.end_of_turn)
        return run_episodes(policy, [task], n, SamplingParams(max_new_tokens=1 << 20),
                            self.service.verifier.make_env, self.fmt, LIMITS, self.service.loop)

    def _verify(self, task: dict[str, Any], solution: str, n: int) -> list[float]:
        from megatron_rl.rewards.sandboxed import TestsVerifier

        meta = {"tests": task["tests"], "files": task.get("files") or {},
                "solution_path": task.get("solution_path") or "solution.py"}

        async def run() -> list[float]:
            verifier = TestsVerifier(self.service.verifier.client)
            return await verifier.score([(meta, solution)] * n)
        return self._on_loop(run())

    # -- difficulty under a policy -----------------------------------------------------------------
    def pass_rate(self, task: dict[str, Any], engine: Any, samples: int, max_new_tokens: int, seed: int,
                  limits: Optional[EpisodeLimits] = None) -> float:
        params = SamplingParams(max_new_tokens=max_new_tokens, seed=seed)
        kind = task_kind(task, self.environment)
        if kind == "agent":
            episodes = run_episodes(engine, [task], samples, params, self.service.verifier.make_env, self.fmt,
                                    limits or EpisodeLimits(), self.service.loop)
            return sum(e.reward >= 1.0 for e in episodes) / len(episodes)
        prompt = task["prompt"] if isinstance(task["prompt"], str) else self.fmt.render(task["prompt"], True)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        texts = [self.tokenizer.decode(g.output_ids, skip_special_tokens=True)
                 for g in engine.generate([ids], SamplingParams(max_new_tokens=max_new_tokens, n=samples, seed=seed))]
        if kind == "tests":
            rewards = [self._verify(task, t, 1)[0] for t in texts]
        else:
            from megatron_rl.rewards.rule import math_reward

            rewards = [math_reward(t, str(task["answer"])) for t in texts]
        return sum(r >= 1.0 for r in rewards) / len(rewards)


def policy_engine(path: str, tokenizer: Any) -> Any:
    """An hf rollout engine holding the weights of an HF checkpoint directory (e.g. one the
    training run exported with checkpoint.hf_export_*). The tensors are read from its safetensors
    files as weight sync sends them (hub names), so a checkpoint whose config.json names a remote-code
    model_type of a supported architecture (Kimi-K2's kimi_k2) loads without running its code."""
    import dataclasses

    from megatron_rl.checkpoint.hf import arch_from_hf_config, read_tensors
    from megatron_rl.config import ModelConfig
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = dataclasses.replace(ModelConfig(), **arch_from_hf_config(path))
    engine = HFEngine(cfg, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tokenizer=tokenizer)
    engine.update_weights(read_tensors(path).items(), version=1)
    return engine
