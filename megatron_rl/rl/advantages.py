"""The step's shaping phase after the rewards: group (or GAE) advantages per response token, the KL penalty
in the reward (algorithm.kl_in_reward), and which samples train (the zero-variance and overlong filters,
lost episodes). Estimators and filters themselves are pure tensor code in megatron_rl/algorithms/."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_rl.rl.update import old_and_reference_logprobs
from megatron_rl.rollout.collect import Rollout, is_scored, model_tokens


def token_advantages(algo, rewards: torch.Tensor, rollouts: list[Rollout],
                     penalties: Optional[list[torch.Tensor]] = None, values: Optional[list[torch.Tensor]] = None
                     ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
    """Per response token advantages [len(output_ids)] of each rollout, from rewards [N] of the SCORED
    rollouts given (lost ones must be left out by the caller). Group estimators broadcast one value per
    sample (reinforce_pp whitens over the batch's model tokens: each sample weighs its number of model
    tokens); gae puts each reward on the sample's last model token and runs the recursion over the model
    tokens with algorithm.gae_gamma / gae_lambda and the critic's `values` (per rollout [len(output_ids)];
    None: no critic, values 0), whitened over the batch.
    penalties (algorithm.kl_in_reward): per rollout, what each response token's reward loses [len(output_ids)];
    a group estimator sees the reward minus the sample's summed penalty, gae the per-token rewards.
    Returns (advantages, GAE's returns R_t = A_t + V_t before whitening: the critic's targets, when `values`
    are given; else None)."""
    from megatron_rl.algorithms.advantages import gae, place_sequence_rewards
    from megatron_rl.algorithms.registry import ADVANTAGE_ESTIMATORS

    if not rollouts:  # every sample lost: nothing to estimate
        return [], None if values is None else []
    if algo.advantage_estimator != "gae":
        if penalties is not None:
            rewards = rewards - torch.stack([p.sum() for p in penalties]).to(rewards.dtype)
        group_ids = torch.tensor([r.prompt_index for r in rollouts], dtype=torch.long)
        options: dict[str, torch.Tensor] = {}
        if algo.advantage_estimator == "reinforce_pp":  # whitened over the model's tokens, as verl and OpenRLHF do
            options["token_counts"] = torch.tensor([float(sum(model_tokens(r))) for r in rollouts])
        per_sample = ADVANTAGE_ESTIMATORS.get(algo.advantage_estimator)(rewards, group_ids, **options)
        return [torch.full((len(r.output_ids),), float(a)) for r, a in zip(rollouts, per_sample)], None
    width = max((len(r.output_ids) for r in rollouts), default=0)
    mask = torch.zeros(len(rollouts), width)
    for i, r in enumerate(rollouts):
        mask[i, :len(r.output_ids)] = torch.tensor(model_tokens(r), dtype=torch.float)
    token_rewards = place_sequence_rewards(rewards, mask)
    if penalties is not None:
        for i, p in enumerate(penalties):
            token_rewards[i, :len(p)] -= p.to(token_rewards.dtype)
    value_grid = None
    if values is not None:
        value_grid = torch.zeros_like(mask)
        for i, v in enumerate(values):
            value_grid[i, :len(v)] = v.to(value_grid.dtype)
    grid, returns = gae(token_rewards, mask, value_grid, algo.gae_gamma, algo.gae_lambda)
    per_rollout = [grid[i, :len(r.output_ids)].clone() for i, r in enumerate(rollouts)]
    if values is None:
        return per_rollout, None
    return per_rollout, [returns[i, :len(r.output_ids)].clone() for i, r in enumerate(rollouts)]


def step_advantages(cfg, rollouts: list[Rollout], rewards: torch.Tensor, joint: Any = None,
                    penalties: Optional[list[Optional[torch.Tensor]]] = None,
                    values: Optional[list[Optional[torch.Tensor]]] = None
                    ) -> tuple[list[Optional[torch.Tensor]], Optional[list[Optional[torch.Tensor]]]]:
    """Per response token advantages of each rollout (None for a lost one) from the shaped rewards [N]
    and, with algorithm.kl_in_reward, each scored rollout's per-token KL penalties (`reward_kl`); with a
    critic, its per-token `values` (`critic_values`) and then also the returns (its targets; else None).
    Lost episodes take no part in group baselines or in a joint run's per-domain calibration (a joint run's
    `advantage_rewards` sees the scored rewards only; the KL penalty applies after the calibration)."""
    scored = [r for r in rollouts if is_scored(r)]
    scored_rewards = rewards[torch.tensor([is_scored(r) for r in rollouts], dtype=torch.bool)]
    if joint is not None:
        scored_rewards = joint.advantage_rewards(scored_rewards, scored)

    def of_scored(per_rollout: Optional[list]) -> Optional[list]:
        return None if per_rollout is None else [x for r, x in zip(rollouts, per_rollout) if is_scored(r)]

    advantages, returns = token_advantages(cfg.algorithm, scored_rewards, scored, of_scored(penalties),
                                           of_scored(values))

    def spread(per_scored: Optional[list]) -> Optional[list]:
        if per_scored is None:
            return None
        found = iter(per_scored)
        return [next(found) if is_scored(r) else None for r in rollouts]
    return spread(advantages), spread(returns)  # type: ignore[return-value]


def reward_kl(cfg, run: Any, rollouts: list[Rollout]) -> tuple[list[Optional[dict]], dict[str, float]]:
    """algorithm.kl_in_reward: for each scored rollout (None for a lost one) its log-probs before the update
    and the reference's ("old_logprobs", "ref_logprobs": the update reuses them) and its "penalty", kl_coef
    times the KL estimate on each response token (0 on tool output). Then the KL controller
    (`run.kl_ctl`) adapts kl_coef to this step's KL: the mean over samples of each sample's mean KL
    per model token."""
    from megatron_rl.algorithms.kl import kl_estimate

    ctl, scored = run.kl_ctl, [r for r in rollouts if is_scored(r)]
    samples = [r.sample({"rollout_logprobs": r.response_extra(r.logprobs)}) for r in scored]
    old_and_reference_logprobs(cfg, run, samples)
    coef, found, kls = ctl.coef, {}, []
    for r, s in zip(scored, samples):
        model = torch.tensor(model_tokens(r), dtype=torch.float)
        # where, not a product: the log-probs are the loss mask's (the model's tokens) only, NaN on tool output
        kl = torch.where(model > 0, kl_estimate(r.response_part(s.extras["old_logprobs"]),
                                                r.response_part(s.extras["ref_logprobs"]), cfg.algorithm.kl_estimator,
                                                clamp=cfg.algorithm.kl_clamp), 0.0)
        kls.append(float(kl.sum() / model.sum().clamp(min=1)))
        found[id(r)] = {"old_logprobs": s.extras["old_logprobs"], "ref_logprobs": s.extras["ref_logprobs"],
                        "penalty": coef * kl}
    if not kls:
        return [None] * len(rollouts), {}
    step_kl = sum(kls) / len(kls)
    ctl.update(step_kl, len(kls))
    return [found.get(id(r)) for r in rollouts], {"kl_reward/coef": coef, "kl_reward/kl": step_kl}


def select_samples(cfg, rollouts: list[Rollout], rewards: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Keep mask [N] after the zero-variance and overlong filters, and what each dropped. Lost episodes
    (`is_scored` False) are dropped, and the zero-variance filter judges a group by its scored samples."""
    from megatron_rl.algorithms.filters import overlong, zero_variance_groups

    keep = torch.tensor([is_scored(r) for r in rollouts], dtype=torch.bool)
    stats = {"filter/dropped_episodes": float((~keep).sum())} if not keep.all() else {}
    if cfg.algorithm.filter_zero_variance:
        informative = torch.zeros_like(keep)
        informative[keep] = zero_variance_groups(rewards[keep], torch.tensor([r.prompt_index for r in rollouts])[keep])
        stats["filter/zero_variance_dropped"] = float((keep & ~informative).sum())
        keep &= informative
    if cfg.algorithm.overlong == "filter":
        # dtypes given: a step whose dynamic sampling kept no group has no rollouts, and torch.tensor([]) is float
        single = torch.tensor([not hasattr(r, "model_mask") for r in rollouts], dtype=torch.bool)  # see shaped_rewards
        lengths = torch.tensor([float(len(r.output_ids)) for r in rollouts], dtype=torch.float32)
        truncated = torch.tensor([r.finish_reason == "length" for r in rollouts], dtype=torch.bool)
        fits, _ = overlong(lengths, cfg.rollout.max_new_tokens, "filter", truncated=truncated)
        fits |= ~single
        stats["filter/overlong_dropped"] = float((keep & ~fits).sum())
        keep &= fits
    stats["filter/kept_samples"] = float(keep.sum())
    return keep, stats
