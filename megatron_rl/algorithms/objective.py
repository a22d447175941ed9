"""The RL objective of one micro-batch: policy loss (+ truncated IS) + KL loss - entropy bonus,
normalised by global-batch denominators, as a `LossFn` for `Trainer.train_step`; and the
critic's clipped value loss (`make_value_loss_fn`).

Normalisation (see `megatron_rl.trainer.core`): a loss function returns its micro-batch's
*contribution* to the global loss, so every term here is divided by a denominator of the
whole global batch (`num_tokens` or `num_samples`), never by a micro-batch count; summed
over micro-batches and data-parallel ranks the contributions give exactly the batch
objective, whatever the parallel layout. Metrics are contributions in the same sense.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_rl.algorithms.distill import DISTILL_MASK, TEACHER_LOGPROBS, topk_reverse_kl
from megatron_rl.algorithms.kl import kl_estimate
from megatron_rl.algorithms.losses import ROLLOUT_IS_LEVELS, ROLLOUT_MASK_LEVELS, rollout_correction
from megatron_rl.algorithms.registry import KL_ESTIMATORS, POLICY_LOSSES

if TYPE_CHECKING:  # the algorithms stay importable without the trainer's dependencies
    from megatron_rl.trainer.core import LossFn, LossInputs

Tensor = torch.Tensor

AGG_MODES: tuple[str, ...] = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregate(per_token: Tensor, mask: Tensor, sample_num_tokens: Tensor, num_tokens: int, num_samples: int,
              mode: str = "token_mean", norm_len: Optional[float] = None) -> Tensor:
    """This micro-batch's contribution to the global aggregate of a per-token quantity.

    per_token, mask, sample_num_tokens: [T] (sample_num_tokens[t] = loss tokens of token t's
    sample); num_tokens, num_samples: loss tokens and samples of the GLOBAL batch. With l the
    per-token values and m the mask, the modes return (a scalar):

        token_mean               sum(l m) / num_tokens              every token weighs the same
        seq_mean_token_mean      sum(l m / sample_num_tokens) / num_samples
                                                                     mean over samples of each sample's token mean
        seq_mean_token_sum       sum(l m) / num_samples             mean over samples of each sample's token sum
        seq_mean_token_sum_norm  sum(l m) / (num_samples * norm_len)
                                                                     Dr. GRPO: token sums over a constant length
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss aggregation mode {mode!r} is invalid: allowed values are {', '.join(AGG_MODES)}")
    masked = per_token * mask.to(per_token.dtype)
    if mode == "token_mean":
        return masked.sum() / max(num_tokens, 1)
    if mode == "seq_mean_token_mean":
        return (masked / sample_num_tokens.to(per_token.dtype).clamp(min=1)).sum() / max(num_samples, 1)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(num_samples, 1)
    if norm_len is None or norm_len <= 0:
        raise ValueError(f"loss aggregation mode seq_mean_token_sum_norm needs norm_len > 0 (a constant such "
                         f"as the maximum response length), got {norm_len}")
    return masked.sum() / (max(num_samples, 1) * norm_len)


def make_policy_loss_fn(cfg: Any) -> LossFn:
    """Build the RL loss from an object with `AlgorithmConfig`'s fields (`policy_loss`,
    `eps_clip`, `eps_clip_high`, `kl_coef`, `kl_estimator`, `entropy_coef`, `loss_agg_mode`),
    plus optional attributes read with getattr: `kl_in_reward` (default False; True: no KL loss term, the
    KL is in the rewards), `kl_clamp` (default 10.0: each token's KL estimate is clamped to
    [-kl_clamp, kl_clamp], as verl's low_var_kl; None: unbounded), `eps_clip_c` (dual-clip bound,
    default None: off),
    the rollout correction's `tis_cap` (default 2.0), `old_logprobs` (default "recompute"; "current": the old
    log-probs are this forward's own),
    `rollout_is` ("token"), `rollout_mask` ("none"), `rollout_mask_low` / `rollout_mask_high`
    (0.5 / 2.0), and `loss_norm_len` (norm_len of `seq_mean_token_sum_norm`, default None).

    The returned function reads from `LossInputs.extras` (all [T], per target):
        "advantages"        required
        "old_logprobs"      the trainer's log-probs of the policy that sampled; required unless
                            `old_logprobs` is "current" (then this forward's own, detached: the
                            weights the update starts from)
        "ref_logprobs"      reference model's log-probs; required when kl_coef > 0
        "rollout_logprobs"  the rollout engine's log-probs; when present the policy loss is
                            weighted per token by `losses.rollout_correction`'s weights and keep mask
    and `LossInputs.entropy` (required when entropy_coef > 0). With `distill.estimator` "topk" (algorithm.distill)
    it also reads `LossInputs.support_logprobs` (the policy's log-probs of the teacher's top-k tokens) and extras
    TEACHER_LOGPROBS and DISTILL_MASK (algorithms/distill.py), and adds distill.coef * agg(d_t) with d_t the top-k
    reverse KL on the student's tokens (`topk_reverse_kl`; metric "distill_topk_kl", its token mean).

        loss = agg(pg_loss_t * tis_t) + kl_coef * agg(kl_t) - entropy_coef * agg(entropy_t) [+ coef * agg(d_t)]

    with agg = `aggregate(..., mode=loss_agg_mode)` and kl_t the clamped estimate: a token whose estimate
    is beyond the bound contributes the bound and no gradient (otherwise one token the reference finds
    e^20 times likelier than the policy adds k3 = 5e8 to the sum). Dual clip (Ye et al. 2020,
    `eps_clip_c` = c): where A < 0, pg_loss_t = min(pg_loss_t, -A c), so that a token whose ratio ran far above 1 cannot
    push the loss (and its gradient) without bound; "dual_clip_frac" counts those tokens. ppo_clip clips the ratio to
    [1 - eps_clip, 1 + eps_clip]; clip_higher, gspo and cispo use [1 - eps_clip, 1 + eps_clip_high].
    Metrics (contributions to global sums): "loss" and "pg_loss" in the aggregation mode;
    "clip_frac", "ratio", "ppo_kl" (approx KL(old || current)), "kl" (policy vs reference, clamped,
    when ref_logprobs are given), "kl_clamp_frac" (share of tokens at the clamp, then too), "entropy"
    (when given), "tis_weight" and "tis_clip_frac"
    (when rollout_logprobs are given: the mean weight, the share of tokens the cap changed),
    "rollout_kept" (share of tokens the rollout mask kept), "mismatch_k1" / "mismatch_k3" (estimates
    of KL(engine || trainer) from the sampled tokens), all token means over the global batch's
    loss tokens; and "max/mismatch", max |old - rollout| over the loss tokens (a maximum: the trainer
    reduces "max/" metrics with max).
    """
    policy_loss = POLICY_LOSSES.get(cfg.policy_loss)
    KL_ESTIMATORS.get(cfg.kl_estimator)  # fail at build time, not in the first micro-batch
    mode = cfg.loss_agg_mode
    if mode not in AGG_MODES:
        raise ValueError(f"algorithm.loss_agg_mode={mode} is invalid: allowed values are {', '.join(AGG_MODES)}")
    eps_low = float(cfg.eps_clip)
    eps_high = eps_low if cfg.policy_loss == "ppo_clip" else float(cfg.eps_clip_high)
    # With kl_in_reward the KL penalises the rewards before the advantages (megatron_rl/rl/advantages.py); the loss
    # only reports it.
    kl_coef = 0.0 if getattr(cfg, "kl_in_reward", False) else float(cfg.kl_coef)
    kl_estimator = cfg.kl_estimator
    kl_clamp = getattr(cfg, "kl_clamp", 10.0)
    if kl_clamp is not None and kl_clamp <= 0:
        raise ValueError(f"algorithm.kl_clamp={kl_clamp} is invalid: must be > 0 (verl's bound is 10), or null for "
                         "an unbounded KL estimate")
    entropy_coef = float(cfg.entropy_coef)
    clip_c = getattr(cfg, "eps_clip_c", None)
    if clip_c is not None:
        clip_c = float(clip_c)
        if clip_c <= 1 or cfg.policy_loss not in ("ppo_clip", "clip_higher"):
            raise ValueError(f"algorithm.eps_clip_c={clip_c} is invalid: dual clip needs a bound > 1 and "
                             f"policy_loss ppo_clip or clip_higher (got {cfg.policy_loss})")
    tis_cap = float(getattr(cfg, "tis_cap", 2.0))
    is_level, mask_level = getattr(cfg, "rollout_is", "token"), getattr(cfg, "rollout_mask", "none")
    mask_low, mask_high = float(getattr(cfg, "rollout_mask_low", 0.5)), float(getattr(cfg, "rollout_mask_high", 2.0))
    if is_level not in ROLLOUT_IS_LEVELS or mask_level not in ROLLOUT_MASK_LEVELS:
        raise ValueError(f"algorithm.rollout_is={is_level} / rollout_mask={mask_level} is invalid: allowed values are "
                         f"{', '.join(ROLLOUT_IS_LEVELS)} / {', '.join(ROLLOUT_MASK_LEVELS)}")
    norm_len = getattr(cfg, "loss_norm_len", None)
    if mode == "seq_mean_token_sum_norm" and (norm_len is None or norm_len <= 0):
        raise ValueError("loss_agg_mode=seq_mean_token_sum_norm needs loss_norm_len > 0 "
                         f"(e.g. the maximum response length), got {norm_len}")

    old_is_current = getattr(cfg, "old_logprobs", "recompute") == "current"
    distill = getattr(cfg, "distill", None)
    topk_distill = distill is not None and distill.teacher and getattr(distill, "estimator", "sampled") == "topk"
    distill_coef = float(distill.coef) if topk_distill else None

    def loss_fn(inp: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        needed = ("advantages",) if old_is_current else ("advantages", "old_logprobs")
        missing = [k for k in needed if k not in inp.extras]
        if missing:
            raise ValueError(f"the policy loss needs extras {missing}; samples carry {sorted(inp.extras)}")
        mask = inp.loss_mask.to(inp.logprobs.dtype)

        def agg(values: Tensor, how: str = mode) -> Tensor:
            return aggregate(values, mask, inp.sample_num_tokens, inp.num_tokens, inp.num_samples, how, norm_len)

        def token_mean(values: Tensor) -> Tensor:
            return agg(values.detach().to(mask.dtype), "token_mean")

        advantages = inp.extras["advantages"]
        old = inp.extras["old_logprobs"] if "old_logprobs" in inp.extras else inp.logprobs.detach()
        per_token, token_metrics = policy_loss(inp.logprobs, old, advantages, eps_low=eps_low,
                                               eps_high=eps_high, loss_mask=mask, sample_ids=inp.sample_ids)
        metrics = {"clip_frac": token_mean(token_metrics["clipped"]), "ratio": token_mean(token_metrics["ratio"]),
                   "ppo_kl": token_mean(token_metrics["approx_kl"])}
        if clip_c is not None:  # dual clip: a negative advantage's loss is bounded by -A * clip_c
            bound = -advantages * clip_c
            bounded = (advantages < 0) & (per_token > bound)
            per_token = torch.where(bounded, bound, per_token)
            metrics["dual_clip_frac"] = token_mean(bounded)
        if "rollout_logprobs" in inp.extras:
            rollout = inp.extras["rollout_logprobs"]
            weights, keep, capped = rollout_correction(old, rollout, mask, inp.sample_ids, level=is_level, cap=tis_cap,
                                                       mask_level=mask_level, low=mask_low, high=mask_high)
            per_token = per_token * weights * keep
            log_ratio = (old - rollout).detach()  # log of the trainer's over the engine's probability
            metrics.update(tis_weight=token_mean(weights), tis_clip_frac=token_mean(capped),
                           rollout_kept=token_mean(keep), mismatch_k1=token_mean(-log_ratio),
                           mismatch_k3=token_mean(torch.exp(log_ratio.clamp(max=20.0)) - 1 - log_ratio))
            metrics["max/mismatch"] = (log_ratio.abs() * mask).max() if mask.numel() else log_ratio.new_zeros(())
        pg_loss = agg(per_token)
        loss = pg_loss
        if "ref_logprobs" in inp.extras:
            kl = kl_estimate(inp.logprobs, inp.extras["ref_logprobs"], kl_estimator, clamp=kl_clamp)
            metrics["kl"] = token_mean(kl)
            if kl_clamp is not None:
                metrics["kl_clamp_frac"] = token_mean(kl.abs() >= kl_clamp)
            if kl_coef > 0:
                loss = loss + kl_coef * agg(kl)
        elif kl_coef > 0:
            raise ValueError(f"kl_coef={kl_coef} needs extras['ref_logprobs'] (the reference model's log-probs); "
                             "compute them or set algorithm.kl_coef=0")
        if inp.entropy is not None:
            metrics["entropy"] = token_mean(inp.entropy)
            if entropy_coef > 0:
                loss = loss - entropy_coef * agg(inp.entropy)
        elif entropy_coef > 0:
            raise ValueError(f"entropy_coef={entropy_coef} needs LossInputs.entropy: call "
                             "train_step(..., with_entropy=True) or set algorithm.entropy_coef=0")
        if inp.support_logprobs is not None:  # top-k distillation: KL(student || teacher) over the teacher's top k
            if distill_coef is None:
                raise ValueError("the samples carry a teacher's top-k tokens, but algorithm.distill.estimator is not "
                                 "topk: the loss has no coefficient for them")
            missing = [k for k in (TEACHER_LOGPROBS, DISTILL_MASK) if k not in inp.extras]
            if missing:
                raise ValueError(f"the top-k distillation term needs extras {missing}; samples carry "
                                 f"{sorted(inp.extras)}")
            distill_kl = topk_reverse_kl(inp.support_logprobs, inp.extras[TEACHER_LOGPROBS]) * inp.extras[DISTILL_MASK]
            loss = loss + distill_coef * agg(distill_kl)
            metrics["distill_topk_kl"] = token_mean(distill_kl)
        elif distill_coef is not None:
            raise ValueError("algorithm.distill.estimator=topk needs the teacher's top-k tokens in the samples "
                             "(extras['support_ids']); the samples carry none")
        metrics["pg_loss"] = pg_loss.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics

    return loss_fn


def make_value_loss_fn(value_clip: Optional[float]) -> LossFn:
    """The critic's loss (`Trainer(head="value")`: `LossInputs.logprobs` holds its values V_t), PPO's
    clipped squared error averaged over the global batch's loss tokens:

        V_clip_t = old_t + clip(V_t - old_t, -value_clip, value_clip)
        loss     = token_mean(0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2))

    from `LossInputs.extras` "returns" (R_t, GAE's value targets) and "old_values" (the critic's values
    before this update); value_clip None: 0.5 * (V_t - R_t)^2. Metrics (token means, global-sum
    contributions): "value_loss", "value_clip_frac" (tokens whose clipped error was the larger),
    "values" and "returns"."""
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip={value_clip} is invalid: must be > 0, or None for no clipping")

    def loss_fn(inp: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        missing = [k for k in ("returns", "old_values") if k not in inp.extras]
        if missing:
            raise ValueError(f"the value loss needs extras {missing}; samples carry {sorted(inp.extras)}")
        mask = inp.loss_mask.to(inp.logprobs.dtype)
        values, returns, old = inp.logprobs, inp.extras["returns"], inp.extras["old_values"]
        error = (values - returns) ** 2
        clipped = torch.zeros_like(error, dtype=torch.bool)
        if value_clip is not None:
            clipped_error = (old + (values - old).clamp(-value_clip, value_clip) - returns) ** 2
            clipped = clipped_error > error
            error = torch.maximum(error, clipped_error)

        def token_mean(x: Tensor) -> Tensor:
            return aggregate(x, mask, inp.sample_num_tokens, inp.num_tokens, inp.num_samples, "token_mean")

        loss = token_mean(0.5 * error)
        metrics = {"value_loss": loss.detach(), "value_clip_frac": token_mean(clipped.to(mask.dtype)),
                   "values": token_mean(values.detach()), "returns": token_mean(returns.to(mask.dtype))}
        return loss, metrics

    return loss_fn
