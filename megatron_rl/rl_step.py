"""The phases of one RL step, the warm start and evaluation, called from `train.py`.

rl_step: sample prompts -> colocated rollout (sync + generate, rewards computed as chunks
finish) -> group advantages -> old log-probs (recomputed or the engine's) -> policy update(s).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.collect import Rollout, collect, pass_at_k

logger = logging.getLogger(__name__)


def _decode(tokenizer):
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)
    return decode


def _sampling(cfg, n: int, seed: int) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          n=n, seed=seed)


def warm_start(rt, parts: dict) -> None:
    """Supervised steps on the task's reference answers (`task.sft_warmup_steps`)."""
    from megatron_rl.config.schema import OptimizerConfig
    from megatron_rl.sft import prompt_response_sample

    cfg = rt.cfg
    if cfg.task.sft_warmup_steps == 0:
        return
    trainer, tok = parts["trainer"], parts["tokenizer"]
    samples = [prompt_response_sample(tok, p.text, p.reference) for p in parts["train"]]
    trainer.reset_optimizer(OptimizerConfig(lr=cfg.task.sft_warmup_lr), cfg.task.sft_warmup_steps)
    generator = torch.Generator().manual_seed(cfg.seed)
    start = time.perf_counter()
    for step in range(cfg.task.sft_warmup_steps):
        index = torch.randint(len(samples), (cfg.global_batch_size,), generator=generator).tolist()
        metrics = trainer.train_step([samples[i] for i in index])
        if step % 50 == 0 or step == cfg.task.sft_warmup_steps - 1:
            logger.info("warm start %d/%d: loss %.3f", step + 1, cfg.task.sft_warmup_steps, metrics["loss"])
    logger.info("warm start: %d supervised steps in %.0fs", cfg.task.sft_warmup_steps, time.perf_counter() - start)


def _advantages(rollouts: list[Rollout], estimator: str) -> torch.Tensor:
    from megatron_rl.algorithms.registry import ADVANTAGE_ESTIMATORS

    rewards = torch.tensor([r.reward for r in rollouts])
    group_ids = torch.tensor([r.prompt_index for r in rollouts])
    return ADVANTAGE_ESTIMATORS.get(estimator)(rewards, group_ids)


def rl_step(rt, parts: dict, step: int) -> dict[str, float]:
    cfg = rt.cfg
    trainer, controller = parts["trainer"], parts["controller"]
    n = cfg.rollout.n_samples_per_prompt
    prompts = [parts["train"][i] for i in parts["sampler"].next_batch(cfg.global_batch_size // n)]
    params = _sampling(cfg, n, seed=cfg.seed * 100_003 + step)
    rollouts, timing = controller.rollout(lambda: collect(
        parts["engine"], prompts, params, parts["rewards"], rt.groups, _decode(parts["tokenizer"])))
    advantages = _advantages(rollouts, cfg.algorithm.advantage_estimator)
    samples = [r.sample({"advantages": r.response_extra([float(a)] * len(r.output_ids)),
                         "rollout_logprobs": r.response_extra(r.logprobs)}) for r, a in zip(rollouts, advantages)]
    start = time.perf_counter()
    if cfg.algorithm.old_logprobs == "recompute":
        old, _ = trainer.forward_logprobs(samples)
        for s, lp in zip(samples, old):
            s.extras["old_logprobs"] = lp
    else:
        for s in samples:
            s.extras["old_logprobs"] = s.extras["rollout_logprobs"]
    if cfg.algorithm.kl_coef > 0:  # the reference policy lives in host memory except for this forward
        current = trainer.swap_weights(parts["reference"])
        ref, _ = trainer.forward_logprobs(samples)
        trainer.swap_weights(current)
        for s, lp in zip(samples, ref):
            s.extras["ref_logprobs"] = lp
    mismatch = max(float((s.extras["old_logprobs"] - s.extras["rollout_logprobs"])[s.loss_mask.bool()].abs().max())
                   for s in samples)
    for update in range(cfg.algorithm.num_inner_updates):
        metrics = trainer.train_step(samples, parts["loss_fn"], with_entropy=True)
        if update == 0:  # nothing changed yet: the importance ratio must be 1
            first_kl = metrics.get("ppo_kl", 0.0)
    train_time = time.perf_counter() - start
    rewards = torch.tensor([r.reward for r in rollouts])
    lengths = torch.tensor([float(len(r.output_ids)) for r in rollouts])
    group_std = torch.stack([rewards[i * n:(i + 1) * n].std() for i in range(len(prompts))])
    tokens = sum(s.tokens.numel() for s in samples)
    metrics.update(controller.metrics(), **timing)
    metrics.update({"reward/mean": rewards.mean().item(), "response_length/mean": lengths.mean().item(),
                    "reward/zero_variance_groups": (group_std == 0).float().mean().item(),
                    "time/train": train_time, "tokens_per_s": tokens / max(train_time, 1e-9),
                    "weight_version": float(rollouts[0].weight_version),
                    "rollout/logprob_mismatch": mismatch, "ppo_kl_first_update": first_kl,
                    "reward/verifier_calls": float(getattr(parts["rewards"].verifier, "calls", 0)),
                    "reward/verifier_errors": float(getattr(parts["rewards"].verifier, "errors", 0))})
    return metrics


def evaluate(rt, parts: dict, step: int) -> dict[str, float]:
    """Mean reward (accuracy) and pass@k on the held-out prompts, with the current weights."""
    cfg = rt.cfg
    prompts = parts["eval"]
    if not prompts:
        return {}
    k = cfg.task.eval_samples
    params = _sampling(cfg, k, seed=cfg.seed * 7 + 1)  # the same draws at every evaluation
    rollouts, _ = parts["controller"].rollout(lambda: collect(
        parts["engine"], prompts, params, parts["rewards"], rt.groups, _decode(parts["tokenizer"])))
    correct = [0] * len(prompts)
    for r in rollouts:
        correct[r.prompt_index] += int(r.reward >= 1.0)
    accuracy = sum(r.reward for r in rollouts) / len(rollouts)
    pass_k = sum(pass_at_k(k, c, k) for c in correct) / len(prompts)
    logger.info("eval at step %d: accuracy %.3f, pass@%d %.3f (%d prompts)", step, accuracy, k, pass_k, len(prompts))
    return {"eval/accuracy": accuracy, "eval/pass@k": pass_k}
