"""Reward shaping before the advantages: the verifier's reward plus the overlong penalty
(algorithm.overlong=penalty), per sample; and a group's verifier rewards over its scored samples,
which is what dynamic sampling (colocated and disaggregated) judges a group by."""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_rl.rollout.collect import Rollout, is_scored


def shaped_rewards(cfg, rollouts: list[Rollout]) -> torch.Tensor:
    """Verifier rewards plus the overlong penalty (algorithm.overlong=penalty), per sample. The overlong
    shaping and filter judge single-turn responses against rollout.max_new_tokens; an agent episode
    (tool output among its tokens, max_new_tokens a per-turn limit) is bounded by task.max_episode_tokens
    instead and left as it is."""
    from megatron_rl.algorithms.filters import overlong

    rewards = torch.tensor([r.reward for r in rollouts])
    if cfg.algorithm.overlong != "penalty":
        return rewards
    lengths = torch.tensor([float(len(r.output_ids)) for r in rollouts])
    _, adjustment = overlong(lengths, cfg.rollout.max_new_tokens, "penalty", cfg.algorithm.overlong_penalty_window,
                             cfg.algorithm.overlong_penalty)
    single = torch.tensor([not hasattr(r, "model_mask") for r in rollouts], dtype=adjustment.dtype)
    return rewards + adjustment * single


def group_verdicts(group: Sequence[Rollout]) -> torch.Tensor:
    """The verifier rewards of a group's scored samples: what dynamic sampling (colocated and disaggregated)
    judges a group by, as DAPO does (0 < correct < n, its eq. 11). Not the shaped rewards: a group whose answers
    are all right but of different lengths differs only by the overlong penalty, and DAPO drops it."""
    return torch.tensor([float(r.reward) for r in group if is_scored(r)])
