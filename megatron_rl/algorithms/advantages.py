"""Advantage estimators: rewards -> advantages, pure tensor code.

Group estimators (grpo, dr_grpo, rloo, reinforce_pp) take one scalar reward per sample,
`rewards: [N]`, and `group_ids: [N]` (any integers; the samples drawn for one prompt share
an id, groups may differ in size) and return one advantage per sample, `[N]`, to be
broadcast onto the sample's response tokens (the RL step's `token_advantages`). `gae` works on padded token grids `[N, T]`.

A group of one sample has nothing to be compared with: the group estimators give it
advantage 0 (it contributes no gradient), rather than treating its raw reward as the
advantage.

A group whose rewards are all equal (max == min, compared in the input dtype) gets advantage
exactly 0 from every group estimator, in any dtype. The group statistics are computed in
float64 as well: in float32 the mean of eight rewards of 0.7 is one ulp off, and GRPO divided
that ulp by std + eps = 1e-6 into an advantage of +0.056 (bf16: +0.93) for a group that carries
no signal. `masked_whiten` (gae) likewise gives exactly 0 when all its values are equal.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algorithms.filters import zero_variance_groups
from megatron_rl.algorithms.registry import ADVANTAGE_ESTIMATORS

Tensor = torch.Tensor
_STATS = torch.float64  # dtype of all group and batch statistics


def _check_group_inputs(rewards: Tensor, group_ids: Tensor) -> Tensor:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both have shape [N], got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


class _Groups:
    """Group membership of N samples: `inverse[i]` is sample i's group in 0..num_groups-1."""

    def __init__(self, group_ids: Tensor) -> None:
        _, self.inverse = torch.unique(group_ids, return_inverse=True)
        self.num_groups = int(self.inverse.max()) + 1 if self.inverse.numel() else 0

    def sum(self, x: Tensor) -> Tensor:
        """Each sample's sum of x over its group: [N] -> [N]."""
        sums = torch.zeros(self.num_groups, dtype=x.dtype, device=x.device).index_add_(0, self.inverse, x)
        return sums[self.inverse]


def group_mean_count(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Each sample's group mean reward and group size, both [N], in float64."""
    rewards = _check_group_inputs(rewards, group_ids).to(_STATS)
    groups = _Groups(group_ids)
    count = groups.sum(torch.ones_like(rewards))
    return groups.sum(rewards) / count, count


def _zero_constant_groups(advantages: Tensor, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """advantages [N] with every sample of an all-equal group (singletons included) set to exactly 0,
    cast back to the rewards' dtype."""
    informative = zero_variance_groups(rewards, group_ids)
    return torch.where(informative, advantages, torch.zeros_like(advantages)).to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO (DeepSeekMath): A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g without
    std normalisation.

    std_g is the unbiased (Bessel-corrected, divide by n_g - 1) standard deviation of the
    group's rewards, as `torch.std` in verl and OpenRLHF; a singleton group has std 0 and
    advantage 0. rewards, group_ids: [N] -> [N].
    """
    rewards = _check_group_inputs(rewards, group_ids)
    mean, count = group_mean_count(rewards, group_ids)
    centred = rewards.to(_STATS) - mean
    if normalize_std:
        std = torch.sqrt(_Groups(group_ids).sum(centred * centred) / (count - 1).clamp(min=1))
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))  # no 0/0 at eps = 0
    return _zero_constant_groups(centred, rewards, group_ids)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean_g.

    Dropping the std division removes GRPO's question-difficulty bias; the paper also drops
    the per-response 1/|o_i| length normaliser. Pair it with the `seq_mean_token_sum_norm`
    aggregation (sum of token losses / (num_samples * norm_len), norm_len a constant such
    as the maximum response length: the paper's objective exactly) or `seq_mean_token_sum`
    (the same up to the constant factor 1/norm_len). rewards, group_ids: [N] -> [N].
    """
    return grpo(rewards, group_ids, normalize_std=False)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other samples of the group,
    i.e. n_g / (n_g - 1) * (r_i - mean_g). Singletons get 0. rewards, group_ids: [N] -> [N]."""
    rewards = _check_group_inputs(rewards, group_ids)
    mean, count = group_mean_count(rewards, group_ids)
    r = rewards.to(_STATS)
    return _zero_constant_groups(r - (mean * count - r) / (count - 1).clamp(min=1), rewards, group_ids)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6,
                 token_counts: Optional[Tensor] = None) -> Tensor:
    """REINFORCE++ with baseline (Hu et al. 2025, "REINFORCE++-Baseline"; OpenRLHF's
    `reinforce_baseline`, verl's `reinforce_plus_plus_baseline`): subtract the group mean, then
    normalise globally over the batch:

        a_i = r_i - mean_g;   A_i = (a_i - mean_B(a)) / (std_B(a) + eps)

    std_B is the population (biased) standard deviation over the batch, as OpenRLHF's (verl's
    is Bessel-corrected over the tokens; docs/rl.md, "Conventions"). Both peers take the batch
    statistics over response tokens, each sample weighted by its length: pass `token_counts: [N]`
    (response tokens per sample; the RL loop does, `rl.advantages.token_advantages`); without it every
    sample weighs 1. With unequal weights mean_B(a) is not 0, and the peers give an all-equal
    group -mean_B / std_B; here it gets 0, like every group estimator (the module docstring).
    rewards, group_ids: [N] -> [N].
    """
    rewards = _check_group_inputs(rewards, group_ids)
    mean, _ = group_mean_count(rewards, group_ids)
    centred = rewards.to(_STATS) - mean
    weights = torch.ones_like(centred) if token_counts is None else token_counts.to(_STATS)
    if weights.shape != centred.shape:
        raise ValueError(f"token_counts must have shape [N]={tuple(centred.shape)}, got {tuple(weights.shape)}")
    total = weights.sum().clamp(min=1e-12)
    batch_mean = (weights * centred).sum() / total
    batch_std = torch.sqrt((weights * (centred - batch_mean) ** 2).sum() / total)
    normalised = (centred - batch_mean) / (batch_std + eps)
    normalised = torch.where(batch_std > 0, normalised, torch.zeros_like(normalised))
    return _zero_constant_groups(normalised, rewards, group_ids)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the tokens where mask is 1 (population variance),
    zero elsewhere, computed in float64; values that are all equal on the mask whiten to
    exactly 0. values, mask: [N, T] (any equal shapes) -> values' dtype."""
    if values.numel() == 0:
        return torch.zeros_like(values)
    weights, x = mask.to(_STATS), values.to(_STATS)
    count = weights.sum().clamp(min=1)
    mean = (x * weights).sum() / count
    var = (((x - mean) * weights) ** 2).sum() / count
    whitened = (x - mean) * torch.rsqrt(var + eps) * weights
    on = mask > 0
    constant = (torch.where(on, x, -torch.inf).amax() == torch.where(on, x, torch.inf).amin())
    return torch.where(constant, torch.zeros_like(whitened), whitened).to(values.dtype)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(token_rewards: Tensor, mask: Tensor, values: Optional[Tensor] = None, gamma: float = 1.0,
        lam: float = 1.0, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) on padded response grids.

    token_rewards, mask, values: [N, T] (T response positions; mask 1 on the policy's own
    tokens). values=None means no critic (all values 0): with gamma = lam = 1 the advantage
    is then the reward-to-go. Positions with mask 0 (padding, or tool output inside a
    multi-turn response) are skipped: the recursion carries the next policy token's value
    and advantage across them, as in verl.

        delta_t = r_t + gamma * V_{t'} - V_t          (t' = next policy token, V = 0 past the end)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                            (value targets for a critic)

    whiten: normalise advantages over all masked tokens of the batch (`masked_whiten`);
    returns are computed before whitening. Returns (advantages [N, T], returns [N, T]),
    both zero where mask is 0.
    """
    if token_rewards.dim() != 2 or mask.shape != token_rewards.shape:
        raise ValueError(f"token_rewards and mask must both have shape [N, T], got "
                         f"{tuple(token_rewards.shape)} and {tuple(mask.shape)}")
    if values is not None and values.shape != token_rewards.shape:
        raise ValueError(f"values must have shape {tuple(token_rewards.shape)}, got {tuple(values.shape)}")
    rewards = token_rewards if token_rewards.is_floating_point() else token_rewards.to(torch.get_default_dtype())
    mask = mask.to(rewards.dtype)
    values = torch.zeros_like(rewards) if values is None else values.to(rewards.dtype)
    num_rows, num_steps = rewards.shape
    next_value = torch.zeros(num_rows, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    reversed_adv = []
    for t in reversed(range(num_steps)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = m * adv_t + (1 - m) * next_adv
        reversed_adv.append(next_adv)
    advantages = torch.stack(reversed_adv[::-1], dim=1) * mask
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def place_sequence_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Put each sample's scalar reward on its last policy token: rewards [N], mask [N, T] ->
    token rewards [N, T] (the input `gae` expects). A row without policy tokens gets none."""
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"expected rewards [N] and mask [N, T], got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    rewards = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    valid = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows]
    return out

