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

A verification the sandbox lost (an episode "dropped", a `Verify` call that failed or timed out:
`rollout.collect.is_scored`'s sense) is no verdict on the task: it is left out of the results and
replayed, at most `attempts` rounds in all; what stays lost is counted (`lost`) so the report can
tell an infrastructure failure from a flaky or unsolvable task.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, NamedTuple, Optional, Sequence

from megatron_rl.envs import known_bad_turns, reference_turns, system_prompt
from megatron_rl.quality import checks
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.multiturn import EpisodeLimits, TurnFormat, run_episodes
from megatron_rl.rollout.scripted import ScriptedPolicy
from megatron_rl.rollout.collect import is_scored

logger = logging.getLogger(__name__)
LIMITS = EpisodeLimits(max_turns=16, max_tokens=1 << 20, wall_time_s=300)


class Verdicts(NamedTuple):
    """A task's scored verifications (lost ones left out) and how many stayed lost after replays."""
    reference: list[float]
    bad: list[float]
    info: dict[str, Any]  # details of the first scored reference run (agent tasks)
    lost: dict[str, int]  # {"reference": n, "known_bad": n}: verifications the sandbox lost, replays included


def until_scored(play: Callable[[int, int], list[Any]], n: int, attempts: int,
                 lost: Callable[[Any], bool]) -> tuple[list[Any], int]:
    """Up to `n` scored results of `play(count, attempt)` (which runs `count` verifications), lost
    ones replayed for at most `attempts` rounds in all. Returns (scored results, number lost)."""
    scored: list[Any] = []
    num_lost = 0
    for attempt in range(attempts):
        if len(scored) >= n:
            break
        results = play(n - len(scored), attempt)
        kept = [r for r in results if not lost(r)]
        num_lost += len(results) - len(kept)
        scored += kept
    return scored, num_lost


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
    sandbox servers at `addresses`; a verification the sandbox lost is replayed, `attempts`
    rounds at most."""

    def __init__(self, addresses: Sequence[str], tokenizer: Any, environment: str = "repo",
                 attempts: int = 3) -> None:
        from megatron_rl.config import TaskConfig
        from megatron_rl.data.tasks import Task
        from megatron_rl.rewards.service import RewardService

        if attempts < 1:
            raise ValueError(f"attempts={attempts}: at least 1 round of verifications is needed")
        self.tokenizer, self.environment, self.attempts = tokenizer, environment, attempts
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
    def verdicts(self, task: dict[str, Any], reruns: int) -> Verdicts:
        """`reruns` scored verdicts per candidate where the sandbox allows (lost ones replayed)."""
        kind = task_kind(task, self.environment)
        if kind == "agent":
            bad_turns = known_bad_turns(self.environment, task)  # an environment without one fails before any episode
            good, lost_good = self._episodes_scored(task, reference_turns(self.environment, task), reruns)
            bad, lost_bad = self._episodes_scored(task, bad_turns, reruns)
            return Verdicts([e.reward for e in good], [e.reward for e in bad], good[0].info if good else {},
                            {"reference": lost_good, "known_bad": lost_bad})
        if kind == "tests":
            reference = task.get("reference") or task.get("response") or ""
            if isinstance(reference, dict):
                reference = next(iter(reference.values()), "")
            good, lost_good = self._verify_scored(task, reference, reruns)
            bad, lost_bad = self._verify_scored(task, "", reruns)
            return Verdicts(good, bad, {}, {"reference": lost_good, "known_bad": lost_bad})
        from megatron_rl.rewards.rule import math_reward

        answer = str(task["answer"])
        wrong = answer + "1" if answer else "1"
        return Verdicts([math_reward(f"\\boxed{{{answer}}}", answer)] * reruns,
                        [math_reward(f"\\boxed{{{wrong}}}", answer)] * reruns, {}, {"reference": 0, "known_bad": 0})

    def _episodes(self, task: dict[str, Any], turns: list[str], n: int) -> list:
        policy = ScriptedPolicy(self.tokenizer, turns, end_of_turn=self.fmt.end_of_turn)
        return run_episodes(policy, [task], n, SamplingParams(max_new_tokens=1 << 20),
                            self.service.verifier.make_env, self.fmt, LIMITS, self.service.loop)

    def _episodes_scored(self, task: dict[str, Any], turns: list[str], n: int) -> tuple[list, int]:
        return until_scored(lambda count, _: self._episodes(task, turns, count), n, self.attempts,
                            lambda e: not is_scored(e))

    def _verify(self, task: dict[str, Any], solution: str, n: int) -> list[Optional[float]]:
        """`n` verifications of `solution` by the tests verifier; None for one the sandbox lost."""
        from megatron_rl.rewards.sandboxed import TestsVerifier

        meta = {"tests": task["tests"], "files": task.get("files") or {},
                "solution_path": task.get("solution_path") or "solution.py"}

        async def one() -> Optional[float]:
            verifier = TestsVerifier(self.service.verifier.client)  # one per call: its `errors` say if it was lost
            [reward] = await verifier.score([(meta, solution)])
            return None if verifier.errors else reward

        async def run() -> list[Optional[float]]:
            return list(await asyncio.gather(*(one() for _ in range(n))))
        return self._on_loop(run())

    def _verify_scored(self, task: dict[str, Any], solution: str, n: int) -> tuple[list[float], int]:
        return until_scored(lambda count, _: self._verify(task, solution, count), n, self.attempts,
                            lambda r: r is None)

    # -- difficulty under a policy -----------------------------------------------------------------
    def pass_rate(self, task: dict[str, Any], engine: Any, samples: int, max_new_tokens: int, seed: int,
                  limits: Optional[EpisodeLimits] = None) -> Optional[float]:
        """The share of the policy's scored samples that pass; None when the sandbox lost them all."""
        return checks.pass_rate(self.policy_rewards(task, engine, samples, max_new_tokens, seed, limits)[0])

    def policy_rewards(self, task: dict[str, Any], engine: Any, samples: int, max_new_tokens: int, seed: int,
                       limits: Optional[EpisodeLimits] = None) -> tuple[list[float], int]:
        """(the rewards of up to `samples` scored policy samples, the number of samples the sandbox lost).
        A lost episode is replayed with a new sample (another seed); a lost verification of a
        generated text is replayed on the same text."""
        kind = task_kind(task, self.environment)
        if kind == "agent":
            def play(count: int, attempt: int) -> list:
                params = SamplingParams(max_new_tokens=max_new_tokens, seed=seed if attempt == 0 else
                                        seed * 7919 + attempt)
                return run_episodes(engine, [task], count, params, self.service.verifier.make_env, self.fmt,
                                    limits or EpisodeLimits(), self.service.loop)
            episodes, num_lost = until_scored(play, samples, self.attempts, lambda e: not is_scored(e))
            return [e.reward for e in episodes], num_lost
        prompt = task["prompt"] if isinstance(task["prompt"], str) else self.fmt.render(task["prompt"], True)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        texts = [self.tokenizer.decode(g.output_ids, skip_special_tokens=True)
                 for g in engine.generate([ids], SamplingParams(max_new_tokens=max_new_tokens, n=samples, seed=seed))]
        if kind == "tests":
            rewards, num_lost = [], 0
            for text in texts:
                scored, lost = self._verify_scored(task, text, 1)
                rewards += scored
                num_lost += lost
            return rewards, num_lost
        from megatron_rl.rewards.rule import math_reward

        return [math_reward(t, str(task["answer"])) for t in texts], 0


def policy_engine(path: str, tokenizer: Any) -> Any:
    """An hf rollout engine holding the weights of an HF checkpoint directory (e.g. one the
    training run exported with checkpoint.hf_export_*). The tensors are read from its safetensors
    files as weight sync sends them (hub names), so a checkpoint whose config.json names a remote-code
    model_type of a supported architecture (Kimi-K2's kimi_k2) loads without running its code."""
    import dataclasses

    from megatron_rl.checkpoint.hf import arch_from_hf_config, check_tensor_names, read_tensors
    from megatron_rl.config import ModelConfig
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.families import get_converter

    cfg = dataclasses.replace(ModelConfig(), **arch_from_hf_config(path))
    check_tensor_names(path, cfg)  # every tensor read or ignored by name (e.g. a rotary cache, not sent)
    engine = HFEngine(cfg, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tokenizer=tokenizer)
    names = get_converter(cfg.family).hf_names(cfg, range(cfg.num_layers), True, True)
    engine.update_weights(read_tensors(path, names).items(), version=1)
    return engine
