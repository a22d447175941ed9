"""Per-domain reward calibration for multi-domain runs: each domain's rewards are turned into
z-scores with that domain's own running mean and std before the advantage estimator, so a
domain whose rewards come on a larger scale (points 0..10 next to pass/fail 0/1) does not
dominate the advantages, the loss and the gradient. Pure tensor code, no collectives: every
rank holds the whole batch and computes the same statistics.

Running statistics, per domain d, updated once per step with the step's rewards of d:

    alpha_t = max(momentum, 1 / t)            (t = number of updates of d so far, this one included)
    mean_d  <- (1 - alpha_t) * mean_d  + alpha_t * mean(r)
    sq_d    <- (1 - alpha_t) * sq_d    + alpha_t * mean(r ** 2)
    std_d   =  sqrt(max(sq_d - mean_d ** 2, 0))      (population std of the pooled rewards)

i.e. an exact running average of the per-step statistics during the first 1 / momentum
updates (Welford-like warm-up: the first step uses its own statistics, no bias towards an
arbitrary initial value) and an exponential moving average afterwards, which follows the
reward distribution as the policy improves (a plain all-time average would lag further and
further behind it). `normalize` uses the statistics after the step's own update, so the
first step of a domain is already calibrated.

What it changes: estimators that keep the reward scale (dr_grpo's r - mean_g, rloo,
reinforce_pp's batch whitening across domains) see (r - mean_d) / std_d instead of r;
grpo divides by each group's std anyway, so calibration leaves its advantages as they are
(up to its eps).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch


class DomainCalibrator:
    """Running reward mean / std per domain; `normalize(rewards [N], domains [N])` -> [N]."""

    def __init__(self, momentum: float = 0.1, eps: float = 1e-6) -> None:
        if not 0 < momentum <= 1:
            raise ValueError(f"momentum={momentum} is invalid: must lie in (0, 1]")
        self.momentum = momentum
        self.eps = eps
        self.stats: dict[str, dict[str, float]] = {}  # domain -> {"updates", "mean", "sq"}

    @staticmethod
    def _indices(domains: Sequence[str], n: int) -> dict[str, torch.Tensor]:
        if len(domains) != n:
            raise ValueError(f"{n} rewards but {len(domains)} domain names")
        by_name: dict[str, list[int]] = {}
        for i, name in enumerate(domains):
            by_name.setdefault(name, []).append(i)
        return {name: torch.tensor(index) for name, index in by_name.items()}

    def update(self, rewards: torch.Tensor, domains: Sequence[str]) -> None:
        """Fold this step's rewards [N] into the statistics of the domains they belong to."""
        for name, index in self._indices(domains, rewards.numel()).items():
            r = rewards[index].double()
            s = self.stats.setdefault(name, {"updates": 0, "mean": 0.0, "sq": 0.0})
            s["updates"] += 1
            alpha = max(self.momentum, 1.0 / s["updates"])
            s["mean"] = (1 - alpha) * s["mean"] + alpha * r.mean().item()
            s["sq"] = (1 - alpha) * s["sq"] + alpha * (r * r).mean().item()

    def mean_std(self, name: str) -> tuple[float, float]:
        """The running mean and (population) std of one domain's rewards."""
        if name not in self.stats:
            raise KeyError(f"domain {name!r} has no reward statistics yet (update before normalize)")
        s = self.stats[name]
        return s["mean"], math.sqrt(max(s["sq"] - s["mean"] ** 2, 0.0))

    def normalize(self, rewards: torch.Tensor, domains: Sequence[str]) -> torch.Tensor:
        """(r - mean_d) / max(std_d, eps) per sample: [N] -> [N], in the dtype of `rewards`."""
        out = torch.empty_like(rewards, dtype=rewards.dtype if rewards.is_floating_point() else torch.float)
        for name, index in self._indices(domains, rewards.numel()).items():
            mean, std = self.mean_std(name)
            out[index] = ((rewards[index].double() - mean) / max(std, self.eps)).to(out.dtype)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "eps": self.eps, "stats": {n: dict(s) for n, s in self.stats.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The statistics; momentum and eps stay as configured for this run."""
        self.stats = {n: dict(s) for n, s in state["stats"].items()}
