"""Token-wise policy-gradient losses and truncated importance sampling, pure tensor code.

Every loss in POLICY_LOSSES has the signature of `PolicyLoss`: flat per-target tensors of
one micro-batch, `[T]`, in; a per-token loss `[T]` (to be masked and normalised by
`objective.aggregate`) and per-token metric values `[T]` out:

    "ratio"      the importance ratio the loss uses (the sequence ratio for gspo)
    "clipped"    1.0 where clipping changed the token's gradient, else 0.0
    "approx_kl"  k3 estimate of KL(old || current) on the token: r - 1 - log r, r = pi / pi_old

Metrics are detached; reduce them over loss tokens (token mean) to report clip fraction,
mean ratio and approximate KL. Log-ratios are clamped to [-20, 20] before exp: a token
whose probability collapsed must not turn into inf (inf * 0 under the mask is nan).
"""

from __future__ import annotations

import math
from typing import Optional, Protocol

import torch

from megatron_rl.algorithms.registry import POLICY_LOSSES

Tensor = torch.Tensor
_MAX_LOG_RATIO = 20.0


class PolicyLoss(Protocol):
    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float,
                 eps_high: Optional[float], loss_mask: Optional[Tensor],
                 sample_ids: Optional[Tensor]) -> tuple[Tensor, dict[str, Tensor]]: ...


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    if logprobs.shape != old_logprobs.shape:
        raise ValueError(f"logprobs and old_logprobs must have the same shape [T], got "
                         f"{tuple(logprobs.shape)} and {tuple(old_logprobs.shape)}")
    return (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _approx_kl(token_log_ratio: Tensor) -> Tensor:
    lr = token_log_ratio.detach()
    return torch.exp(lr) - 1 - lr


def _clipped_surrogate(ratio: Tensor, token_log_ratio: Tensor, advantages: Tensor, eps_low: float,
                       eps_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's pessimistic surrogate: max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    # Strictly greater: the clipped branch is active and its gradient is zero.
    metrics = {"ratio": ratio.detach(), "clipped": (clipped > unclipped).to(ratio.dtype).detach(),
               "approx_kl": _approx_kl(token_log_ratio)}
    return loss, metrics


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
             eps_high: Optional[float] = None, loss_mask: Optional[Tensor] = None,
             sample_ids: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip (Schulman et al. 2017): loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps)),
    r_t = exp(logp_t - old_logp_t). Symmetric: eps_high defaults to eps_low.
    logprobs (with grad), old_logprobs, advantages: [T] -> loss [T], metrics [T]."""
    log_ratio = _log_ratio(logprobs, old_logprobs)
    return _clipped_surrogate(torch.exp(log_ratio), log_ratio, advantages, eps_low,
                              eps_low if eps_high is None else eps_high)


@POLICY_LOSSES.register("clip_higher")
def clip_higher(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
                eps_high: Optional[float] = 0.28, loss_mask: Optional[Tensor] = None,
                sample_ids: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO's clip-higher (Yu et al. 2025): PPO-clip with a wider upper bound, r clipped to
    [1 - eps_low, 1 + eps_high], eps_high > eps_low, so that unlikely tokens with positive
    advantage can still gain probability (against entropy collapse). Shapes as `ppo_clip`."""
    return ppo_clip(logprobs, old_logprobs, advantages, eps_low=eps_low,
                    eps_high=eps_low if eps_high is None else eps_high)


@POLICY_LOSSES.register("gspo")
def gspo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 3e-4,
         eps_high: Optional[float] = 4e-4, loss_mask: Optional[Tensor] = None,
         sample_ids: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence,

        s_i = exp(mean over the loss tokens of sequence i of (logp_t - old_logp_t)),

    clipped to [1 - eps_low, 1 + eps_high] in PPO's pessimistic surrogate and applied to
    every token of the sequence. Written as GSPO-token: each token's ratio is
    sg(s_i) * exp(logp_t - sg(logp_t)), equal to s_i in value, so the summed gradient over
    the sequence's tokens equals sequence-level GSPO's (the paper's objective is the
    `seq_mean_token_mean` aggregation of these per-token losses). The paper's clip range
    is tiny (3e-4 / 4e-4) because sequence ratios stay close to 1.

    sample_ids: [T] sequence of each token (required; all tokens of a sequence must be in
    this call, which packing guarantees); loss_mask: [T] (default all ones). Other inputs
    and outputs as `ppo_clip`.
    """
    if sample_ids is None:
        raise ValueError("gspo needs sample_ids [T] to group tokens into sequences")
    token_log_ratio = _log_ratio(logprobs, old_logprobs)
    mask = torch.ones_like(token_log_ratio) if loss_mask is None else loss_mask.to(token_log_ratio.dtype)
    seq_sum, seq_len = sequence_sums(token_log_ratio.detach(), mask, sample_ids)
    seq_log_ratio = seq_sum / seq_len.clamp(min=1)
    ratio = torch.exp(seq_log_ratio + logprobs - logprobs.detach())
    eps_high = eps_low if eps_high is None else eps_high
    return _clipped_surrogate(ratio, token_log_ratio, advantages, eps_low, eps_high)


@POLICY_LOSSES.register("cispo")
def cispo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
          eps_high: Optional[float] = 0.28, loss_mask: Optional[Tensor] = None,
          sample_ids: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t.

    The clipped ratio is a detached weight, so every token keeps a gradient (PPO-clip
    zeroes it outside the range); the gradient flows through logp_t only. MiniMax set no
    lower bound in practice: pass a large eps_low (>= 1) for that. "clipped" marks tokens
    whose weight was clipped. The loss value is -w A logp (not a surrogate near -A); only
    its gradient is meaningful. Shapes as `ppo_clip`.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio).detach()
    eps_high = eps_low if eps_high is None else eps_high
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -weight * advantages * logprobs
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).to(ratio.dtype)
    return loss, {"ratio": ratio, "clipped": clipped, "approx_kl": _approx_kl(log_ratio)}


def sequence_sums(values: Tensor, mask: Tensor, sample_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per token, the masked sum of `values` over its sequence and its sequence's mask count:
    values, mask, sample_ids [T] -> ([T], [T]). All tokens of a sequence must be in the call."""
    _, seq = torch.unique(sample_ids, return_inverse=True)
    num_seqs = int(seq.max()) + 1 if seq.numel() else 0
    zeros = torch.zeros(num_seqs, dtype=values.dtype, device=values.device)
    mask = mask.to(values.dtype)
    return zeros.index_add(0, seq, values * mask)[seq], zeros.index_add(0, seq, mask)[seq]


ROLLOUT_IS_LEVELS = ("token", "sequence", "none")
ROLLOUT_MASK_LEVELS = ("none", "token", "sequence", "geometric")


def rollout_correction(old_logprobs_train: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                       sample_ids: Optional[Tensor], *, level: str = "token", cap: float = 2.0,
                       mask_level: str = "none", low: float = 0.5, high: float = 2.0) -> tuple[Tensor, Tensor, Tensor]:
    """Weights and a keep mask that correct the policy loss for sampling from the rollout engine,
    whose log-probs differ from the trainer's for the same weights. With log r_t = old_t - rollout_t
    (the trainer's over the engine's probability of token t) on the loss tokens:

        level    "token"     w_t = min(r_t, cap)                 truncated IS (Yao et al. 2025)
                 "sequence"  w_t = min(prod_s r_s, cap)           over the tokens s of t's sequence
                 "none"      w_t = 1
        mask     "token"     keep_t = low <= r_t <= high          IcePop-style token rejection
                 "sequence"  keep_t = low <= prod_s r_s <= high   the whole sequence kept or dropped
                 "geometric" keep_t = low <= (prod_s r_s)^(1/n) <= high   (n loss tokens of the sequence)
                 "none"      keep_t = 1

    A dropped token contributes nothing to the loss (the batch's denominators stay as they are).
    Sequence levels need `sample_ids` and all of a sequence's tokens in the call (no context
    parallelism). Inputs [T]; returns (weights, keep, capped) [T], detached; `capped` marks tokens
    whose weight the cap changed.
    """
    if cap <= 0 or not 0 < low < 1 < high:
        raise ValueError(f"rollout correction needs cap > 0 and 0 < low < 1 < high, got cap={cap}, low={low}, "
                         f"high={high}")
    if old_logprobs_train.shape != rollout_logprobs.shape:
        raise ValueError(f"old_logprobs_train and rollout_logprobs must have the same shape [T], got "
                         f"{tuple(old_logprobs_train.shape)} and {tuple(rollout_logprobs.shape)}")
    if level not in ROLLOUT_IS_LEVELS or mask_level not in ROLLOUT_MASK_LEVELS:
        raise ValueError(f"rollout correction level={level!r} / mask_level={mask_level!r}: allowed "
                         f"{ROLLOUT_IS_LEVELS} / {ROLLOUT_MASK_LEVELS}")
    mask = mask.to(old_logprobs_train.dtype)
    log_ratio = (old_logprobs_train - rollout_logprobs).detach() * mask
    needs_sequences = level == "sequence" or mask_level in ("sequence", "geometric")
    if needs_sequences and sample_ids is None:
        raise ValueError("sequence-level rollout correction needs sample_ids [T]")
    seq_sum, seq_len = sequence_sums(log_ratio, mask, sample_ids) if needs_sequences else (None, None)
    # the log-ratio the weight and the keep test use; clamped so that exp never overflows
    weighed = {"token": log_ratio, "sequence": seq_sum, "none": torch.zeros_like(log_ratio)}[level]
    weights = torch.exp(weighed.clamp(min=-_MAX_LOG_RATIO, max=math.log(cap)))
    capped = (weighed > math.log(cap)).to(log_ratio.dtype)
    if mask_level == "none":
        keep = torch.ones_like(log_ratio)
    else:
        tested = {"token": log_ratio, "sequence": seq_sum,
                  "geometric": seq_sum / seq_len.clamp(min=1) if seq_len is not None else None}[mask_level]
        keep = ((tested >= math.log(low)) & (tested <= math.log(high))).to(log_ratio.dtype)
    return weights, keep, capped
