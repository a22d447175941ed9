"""Sample and group filters applied between rollout and training: zero-variance groups,
overlong responses (filtered out or softly penalised), and DAPO's dynamic sampling.

Pure tensor / Python code: no generation happens here. `DynamicSampler` only decides
which groups to keep and when enough have been collected; the caller runs the rounds.
"""

from __future__ import annotations

from typing import Callable, Generic, Optional, Sequence, TypeVar

import torch

Tensor = torch.Tensor
G = TypeVar("G")

OVERLONG_MODES: tuple[str, ...] = ("filter", "penalty")


def zero_variance_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Keep mask [N] (bool): False for every sample of a group whose rewards are all equal.

    Such a group has zero advantage under any group baseline: it costs compute and, under
    token-mean aggregation, dilutes the gradient of the informative groups. A group of one
    sample counts as zero-variance. rewards, group_ids: [N].
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both have shape [N], got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)
    high = torch.full((num_groups,), -torch.inf, dtype=r.dtype).scatter_reduce(0, inverse, r, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=r.dtype).scatter_reduce(0, inverse, r, "amin")
    return (high > low)[inverse]


def overlong(response_lengths: Tensor, max_len: int, mode: str = "filter", penalty_window: int = 0,
             penalty: float = 1.0, truncated: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Handle responses that hit the length limit. response_lengths: [N] tokens generated;
    returns (keep [N] bool, reward_adjustment [N] float, added to the reward).

    mode="filter" (DAPO's overlong filtering): drop truncated responses from the loss, their
    reward says nothing about their quality. A response is truncated when `truncated[i]`
    (pass the engine's finish reason when known) or else when its length reaches max_len.
    The adjustment is 0.

    mode="penalty" (DAPO's soft overlong punishment, Yu et al. 2025, eq. 13): keep every
    response; with L = length, W = penalty_window (0 < W <= max_len):

        0                                  L <= max_len - W
        penalty * (max_len - W - L) / W    max_len - W < L <= max_len   (linear, 0 -> -penalty)
        -penalty                           L > max_len
    """
    if mode not in OVERLONG_MODES:
        raise ValueError(f"overlong mode {mode!r} is invalid: allowed values are {', '.join(OVERLONG_MODES)}")
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must have shape [N], got {tuple(response_lengths.shape)}")
    lengths = response_lengths.to(torch.get_default_dtype())
    if mode == "filter":
        is_truncated = lengths >= max_len if truncated is None else truncated.bool()
        return ~is_truncated, torch.zeros_like(lengths)
    if not 0 < penalty_window <= max_len:
        raise ValueError(f"overlong penalty_window={penalty_window} is invalid: must lie in (0, max_len={max_len}]")
    start = max_len - penalty_window
    ramp = (start - lengths) / penalty_window * penalty
    adjustment = torch.where(lengths <= start, torch.zeros_like(lengths),
                             torch.where(lengths <= max_len, ramp, torch.full_like(lengths, -penalty)))
    return torch.ones_like(lengths, dtype=torch.bool), adjustment


def has_reward_variance(rewards: Tensor) -> bool:
    """True when a group's rewards [n] are not all equal (the default dynamic-sampling filter)."""
    return rewards.numel() > 1 and bool(rewards.max() > rewards.min())


class DynamicSampler(Generic[G]):
    """DAPO's dynamic sampling: over-sample prompts until `target_groups` groups pass the filter.

    Each generation round hands its groups (whatever the caller uses: sample lists, ids)
    with their rewards to `add_round`; groups for which `keep_group(rewards)` is False are
    discarded. `is_full` says when enough are collected; `batch()` returns the first
    `target_groups` kept ones (the surplus of the last round is dropped). After
    `max_rounds` rounds without filling up, `exhausted` is True and `batch()` returns the
    short batch: the caller decides between training on it and failing (a task whose
    prompts are all solved or all failed never fills up).
    """

    def __init__(self, target_groups: int, max_rounds: int,
                 keep_group: Callable[[Tensor], bool] = has_reward_variance) -> None:
        if target_groups < 1:
            raise ValueError(f"target_groups={target_groups} is invalid: must be >= 1")
        if max_rounds < 1:
            raise ValueError(f"max_rounds={max_rounds} is invalid: must be >= 1")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.keep_group = keep_group
        self._kept: list[G] = []
        self.num_rounds = 0
        self.num_groups_seen = 0

    def add_round(self, groups: Sequence[G], rewards: Sequence[Tensor]) -> int:
        """Add one round's groups and their rewards (rewards[k]: [n_k]); returns how many were kept."""
        if len(groups) != len(rewards):
            raise ValueError(f"got {len(groups)} groups but {len(rewards)} reward tensors")
        if self.done:
            raise RuntimeError(f"add_round after the sampler is done ({len(self._kept)}/{self.target_groups} "
                               f"groups kept in {self.num_rounds}/{self.max_rounds} rounds)")
        kept = [g for g, r in zip(groups, rewards) if self.keep_group(r)]
        self._kept.extend(kept)
        self.num_rounds += 1
        self.num_groups_seen += len(groups)
        return len(kept)

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    @property
    def is_full(self) -> bool:
        return len(self._kept) >= self.target_groups

    @property
    def exhausted(self) -> bool:
        """max_rounds rounds ran and the batch is still short."""
        return not self.is_full and self.num_rounds >= self.max_rounds

    @property
    def done(self) -> bool:
        return self.is_full or self.num_rounds >= self.max_rounds

    def batch(self) -> list[G]:
        """The first target_groups kept groups, in arrival order (fewer when exhausted)."""
        return self._kept[: self.target_groups]

    def stats(self) -> dict[str, float]:
        """Counts for logging: rounds run, groups generated, groups kept, fraction kept."""
        return {"rounds": float(self.num_rounds), "groups_seen": float(self.num_groups_seen),
                "groups_kept": float(len(self._kept)),
                "keep_rate": len(self._kept) / max(self.num_groups_seen, 1)}
