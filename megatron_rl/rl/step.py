"""One RL step, as its phases:

    generate + score   the rollout source's groups, rewards computed as chunks finish (colocated: the
                       weight sync of the last update comes first, inside the same colocation round; a judge's
                       verdicts in the same round), then a reward model's scores (rl/model_rewards.py)
    shape              overlong shaping, the KL penalty in the reward, critic values, advantages (with a
                       distillation teacher, its per-token reverse-KL term)
    select             lost episodes, zero-variance groups and overlong responses left out
    old/ref log-probs  and the policy update(s); the critic's update(s)
    metrics            assembled in one place (rl/metrics.py), reduced over the ranks
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megatron_rl.rewards.shaping import shaped_rewards
from megatron_rl.rl.advantages import reward_kl, select_samples, step_advantages
from megatron_rl.rl.distill import distill_shaping
from megatron_rl.rl.metrics import VerifierCounts, maintain, step_metrics
from megatron_rl.rl.model_rewards import rule_disagreements, score_with_reward_models
from megatron_rl.rl.update import critic_values, update_critic, update_policy
from megatron_rl.rollout.collect import Rollout, uncovered_routing

logger = logging.getLogger(__name__)


def rl_step(rt, run: Any, step: int) -> dict[str, float]:
    """One RL step after `step` others (its sampling seeds and schedules count from 0); the step's number in
    the log, in metrics.jsonl and in the files it writes is step + 1, the updates done once it ends
    (docs/rl.md, "Metrics"). Returns its metrics, those each rank counts on its own summed over the ranks."""
    from megatron_rl.observability.timeline import Timeline

    cfg, timeline = rt.cfg, Timeline()  # this step's phases, generation batches, environment waits
    counts = VerifierCounts.of(run.rewards.verifier)
    rollouts, from_source = run.source.rollouts(step, timeline)
    with timeline.span("reward_model", "phases"):
        from_source = {**from_source, **score_with_reward_models(run, rollouts)}
    from_source.update(rule_disagreements(rollouts))
    uncovered_routing(rollouts)
    if cfg.logging.dump_rollouts and rt.is_main:
        from megatron_rl.rollout.dump import write_rollouts

        write_rollouts(rt.run_dir / "rollouts", step + 1, rollouts, lambda ids: run.tokenizer.decode(ids))
    rewards = shaped_rewards(cfg, rollouts)
    advantages, extras, kl, critic_time = _shape(cfg, run, rollouts, rewards)
    keep, filters = select_samples(cfg, rollouts, rewards)
    samples = [r.sample({"advantages": r.response_extra(a), "rollout_logprobs": r.response_extra(r.logprobs), **x})
               for r, a, x, k in zip(rollouts, advantages, extras, keep) if k]
    update, train_time, warming = _train(cfg, run, step, samples, timeline, critic_time)
    found = {"update": update, "source": from_source, "filters": filters, "kl": kl,
             "maintain": maintain(rt, run, step, rollouts)}
    return step_metrics(rt, run, step, rollouts, rewards, advantages, samples, found, train_time, warming, counts,
                        timeline)


def _shape(cfg, run: Any, rollouts: list[Rollout], rewards: torch.Tensor) -> tuple[list, list[dict], dict, float]:
    """Per rollout: its token advantages (None for a lost one) and the sample extras the update needs besides
    them (reward_kl's old and reference log-probs; the critic's returns and old values); the KL penalty's
    and the distillation's metrics; the time the critic's forward took."""
    penalised, kl = reward_kl(cfg, run, rollouts) if cfg.algorithm.kl_in_reward else ([None] * len(rollouts), {})
    start = time.perf_counter()
    values = critic_values(run, rollouts) if run.critic is not None else None
    critic_time = time.perf_counter() - start
    advantages, returns = step_advantages(cfg, rollouts, rewards, run.domains,  # a joint run calibrates per domain
                                          [p and p["penalty"] for p in penalised]
                                          if cfg.algorithm.kl_in_reward else None, values)
    extras = [{k: v for k, v in (p or {}).items() if k != "penalty"} for p in penalised]
    if run.teacher is not None:  # on-policy distillation: the teacher's per-token term joins (or replaces) them
        advantages, distill_extras, distilled = distill_shaping(cfg, run, rollouts, advantages)
        kl = {**kl, **distilled}
        for x, found in zip(extras, distill_extras):
            x.update(found)
    if values is not None:
        for i, (r, x) in enumerate(zip(rollouts, extras)):
            if advantages[i] is not None:
                x.update(returns=r.response_extra(returns[i]), old_values=r.response_extra(values[i]))
    return advantages, extras, kl, critic_time


def _train(cfg, run: Any, step: int, samples: list, timeline: Any,
           critic_time: float) -> tuple[dict[str, float], float, bool]:
    """Old (and reference) log-probs and the policy update(s), then the critic's; their metrics, the policy's
    training time, and whether the critic is still warming up (algorithm.critic_warmup_steps, counted in
    the critic's own updates: a critic started on resume warms up too)."""
    critic, metrics = run.critic, {}
    warming = critic is not None and critic.step < cfg.algorithm.critic_warmup_steps * cfg.algorithm.num_inner_updates
    start = time.perf_counter()
    if samples and not warming:
        with timeline.span("train", "phases"):
            metrics = update_policy(cfg, run, samples)
    elif not samples:
        logger.warning("step %d: every sample was filtered out; no update this step", step + 1)
    train_time = time.perf_counter() - start
    if samples and critic is not None:
        start = time.perf_counter()
        with timeline.span("critic", "phases"):
            metrics.update(update_critic(cfg, run, samples))
        metrics["time/critic"] = critic_time + time.perf_counter() - start  # its forward and its update
    return metrics, train_time, warming
