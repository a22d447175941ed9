"""Per-token KL estimators between the policy and a reference model (Schulman, "Approximating
KL Divergence", 2020), and the KL penalty folded into token rewards.

With tokens sampled from the policy pi and x = log pi_ref(y) - log pi(y) on each of them,
every estimator below targets KL(pi || pi_ref) (the reverse KL, from the policy to the
reference):

    k1 = -x = logp - ref_logp              unbiased, high variance, can be negative
    k2 = x^2 / 2                           biased (exact to second order), low variance, >= 0
    k3 = exp(x) - x - 1                    unbiased, low variance, >= 0

Their gradients differ from the gradient of the KL when used as a loss (k1's expected
gradient is zero on-policy; k2's equals the reverse KL's), which is why the choice matters
for a KL *loss* and much less for a KL *penalty* in the reward.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.algorithms.registry import KL_ESTIMATORS

Tensor = torch.Tensor


@KL_ESTIMATORS.register("k1")
def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """logp - ref_logp. logprobs, ref_logprobs: [T] -> [T]."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """0.5 * (logp - ref_logp)^2. logprobs, ref_logprobs: [T] -> [T]."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1. logprobs, ref_logprobs: [T] -> [T].

    The log-ratio is clamped to [-20, 20] before exp so that a token the reference finds
    far likelier than the policy does cannot overflow to inf (and inf * 0 = nan under a mask).
    """
    x = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(x) - x - 1


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3",
                clamp: Optional[float] = None) -> Tensor:
    """The named estimator (k1, k2, k3), optionally clamped to [-clamp, clamp] (verl clamps
    k3 at 10 to bound the loss of a few wild tokens). logprobs, ref_logprobs: [T] -> [T]."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs and ref_logprobs must have the same shape, got "
                         f"{tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}")
    kl = KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl


class KLController:
    """The coefficient beta of the KL penalty in the reward (`algorithm.kl_in_reward`): fixed, or adaptive
    with a target (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", sec. 2.2):
    after each step that measured a KL of `kl` on `num_samples` samples,

        error = clip(kl / target - 1, -0.2, 0.2);    beta <- beta * (1 + error * num_samples / horizon)

    so beta grows while the policy drifts further than the target from the reference and shrinks
    while it stays closer. Its state travels in checkpoints (`state_dict`)."""

    def __init__(self, coef: float, target: Optional[float] = None, horizon: int = 10000) -> None:
        if coef <= 0 or (target is not None and target <= 0) or horizon < 1:
            raise ValueError(f"a KL controller needs coef > 0, target > 0 (or None) and horizon >= 1, got "
                             f"coef={coef}, target={target}, horizon={horizon}")
        self.coef, self.target, self.horizon = float(coef), target, horizon

    def update(self, kl: float, num_samples: int) -> None:
        if self.target is None:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * num_samples / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])
