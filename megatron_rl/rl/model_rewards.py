"""The step's reward-model phase (task.reward=reward_model): after generation, each scored rollout of a task
scored by a reward model gets that model's score of its prompt + response (times the task's reward_scale),
replacing the placeholder its verifier gave. A joint run mixes such domains with rule- and judge-scored ones;
each domain keeps its own calibration downstream (rewards are per domain as before).

The reward models (`rl/reward_model.py`, one per distinct checkpoint) are built with the run and stay off
the accelerator except during this phase; every rank runs it with the same rollouts (a collective forward).
With task.rule_check the rule verifier's reward is kept in the rollout's `checks` for the hacking guard
(`rule_disagreements`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from megatron_rl.rollout.collect import Rollout
from megatron_rl.rollout.judging import task_of

logger = logging.getLogger(__name__)


def model_tasks(task: Any) -> list[Any]:
    """The run's tasks (a joint run's domains) whose rewards a reward model gives."""
    tasks = list(task.tasks.values()) if hasattr(task, "tasks") else [task]
    return [t for t in tasks if t.reward_kind == "reward_model"]


def build_reward_models(cfg: Any, task: Any, groups: Any, options: Any) -> dict[str, Any]:
    """checkpoint path -> RewardModel, for every reward model the run's tasks name (each built once)."""
    from megatron_rl.rl.reward_model import RewardModel

    models: dict[str, Any] = {}
    for t in model_tasks(task):
        path = t.cfg.reward_model.path
        if path not in models:
            models[path] = RewardModel(path, cfg.model, cfg.optimizer, groups, options)
    return models


def score_with_reward_models(run: Any, rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Give every scored rollout of a reward-model task its model's reward (see the module docstring); returns
    reward/model_scored and time/reward_model."""
    models: dict = getattr(run, "reward_models", None) or {}
    if not models and not model_tasks(run.task):
        return {}
    start = time.perf_counter()
    by_path: dict[str, list[tuple[Rollout, Any]]] = {}
    for r in rollouts:
        own = task_of(run.task, {"domain": r.domain})
        if r.scored and own.reward_kind == "reward_model":
            by_path.setdefault(own.cfg.reward_model.path, []).append((r, own))
    scored = 0
    for path, members in by_path.items():
        if path not in models:  # e.g. a regression set whose task names another reward model than the run's
            raise ValueError(f"task.reward_model.path={path} was not loaded with the run (its reward models: "
                             f"{', '.join(models)}): evaluate with the run's reward model")
        scores = models[path].score([r.prompt_tokens + r.output_ids for r, _ in members])
        for (r, own), score in zip(members, scores):
            if own.cfg.rule_check is not None:
                r.checks["rule_reward"] = r.reward
            r.checks["model_score"] = score
            r.checks["model_passes"] = score > own.cfg.rule_check_threshold
            r.reward = score * own.cfg.reward_scale
        scored += len(members)
    return {"reward/model_scored": float(scored), "time/reward_model": time.perf_counter() - start}


def rule_disagreements(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """reward/model_rule_disagree: scored rollouts where a model (reward model or judge) and the task's rule check
    disagree (the model passes the response and the rule gives 0, or the other way round); reward/model_rule_checked:
    those both judged. Nothing when no task has a rule check."""
    both = [r for r in rollouts if r.scored and "rule_reward" in r.checks and "model_passes" in r.checks]
    if not both:
        return {}
    disagree = sum(r.checks["model_passes"] != (r.checks["rule_reward"] > 0) for r in both)
    return {"reward/model_rule_checked": float(len(both)), "reward/model_rule_disagree": float(disagree)}
