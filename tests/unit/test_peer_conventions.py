"""The conventions table of docs/rl.md ("Conventions against verl, TRL and OpenRLHF"): for each row, the
config that reproduces the peer against the peer's formula, written here from its published definition
(numpy, or torch where a gradient is compared), never with this project's helpers.

Peers as read for the table (main branches; defaults move between releases): verl's
`trainer/ppo/core_algos.py`, `utils/torch_functional.py` and config dataclasses, TRL's GRPOTrainer /
GRPOConfig (2026), OpenRLHF's `ppo_utils/experience_maker.py` and `train_ppo_ray` arguments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.algorithms.objective import make_policy_loss_fn
from megatron_rl.config import load_config
from megatron_rl.config.schema import AlgorithmConfig
from megatron_rl.rl.advantages import token_advantages
from megatron_rl.rollout.collect import Rollout
from megatron_rl.trainer.core import LossInputs

D = torch.float64


# ---- a padded batch [B, T] of response tokens, and the same batch as this project's flat LossInputs ----

def _padded_batch(rng, lengths, log_ratio_scale=0.3):
    num_rows, width = len(lengths), max(lengths)
    mask = np.zeros((num_rows, width))
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    logp = -rng.random((num_rows, width)) * 3 - 0.05
    old = logp - rng.normal(size=(num_rows, width)) * log_ratio_scale
    return mask, logp, old


def _loss_inputs(mask, logp, **extras):
    """Flatten [B, T] (padding positions carry mask 0) into one micro-batch holding the whole global batch."""
    num_rows, width = mask.shape
    sample_ids = torch.arange(num_rows).repeat_interleave(width)
    lengths = torch.tensor(mask.sum(axis=1), dtype=D)
    return LossInputs(logprobs=logp.reshape(-1), entropy=None, loss_mask=torch.tensor(mask.reshape(-1), dtype=D),
                      sample_ids=sample_ids, sample_num_tokens=lengths[sample_ids],
                      extras={k: torch.as_tensor(v, dtype=D).reshape(-1) for k, v in extras.items()},
                      num_tokens=int(mask.sum()), num_samples=num_rows)


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


# ---- row "Dual clip" and row "Rollout correction": verl's vanilla PPO loss -------------------------------

def test_verl_vanilla_ppo_loss_with_dual_clip_and_no_rollout_correction():
    """verl: dual clip always on with clip_ratio_c=3.0, clip_ratio 0.2, token-mean, no rollout correction
    (rollout_is null). Here: algorithm.eps_clip_c=3.0 algorithm.rollout_is=none."""
    rng = np.random.default_rng(1)
    mask, logp, old = _padded_batch(rng, [5, 3, 6, 2], log_ratio_scale=0.5)
    old[1, :2] = logp[1, :2] - math.log(5.0)  # ratio 5 > c = 3 on tokens of negative advantage: dual clip binds
    old[3, 0] = logp[3, 0] - math.log(4.0)
    adv = np.repeat(np.array([[0.6], [-0.9], [0.3], [-0.8]]), mask.shape[1], axis=1)
    rollout = old + rng.normal(size=old.shape) * 0.5  # the engine's log-probs differ: must not matter here

    logp_t = torch.tensor(logp, requires_grad=True)
    log_ratio = torch.clamp(logp_t - torch.tensor(old), -20.0, 20.0)
    ratio, a = torch.exp(log_ratio), torch.tensor(adv)
    pg1, pg2 = -a * ratio, -a * torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
    clip1 = torch.maximum(pg1, pg2)
    pg = torch.where(a < 0, torch.minimum(-a * 3.0, clip1), clip1)
    verl = _masked_mean(pg, torch.tensor(mask))
    verl.backward()
    assert ((-a * 3.0 < clip1) & (a < 0) & torch.tensor(mask > 0)).any()  # the dual clip did bind somewhere

    ours_logp = torch.tensor(logp, requires_grad=True)
    cfg = AlgorithmConfig(eps_clip_c=3.0, rollout_is="none")
    loss, _ = make_policy_loss_fn(cfg)(_loss_inputs(mask, ours_logp, advantages=adv, old_logprobs=old,
                                                    rollout_logprobs=rollout))
    loss.backward()
    assert math.isclose(float(loss.detach()), float(verl.detach()), rel_tol=1e-12)
    assert torch.allclose(ours_logp.grad, logp_t.grad * torch.tensor(mask), rtol=1e-10, atol=1e-15)
    # the defaults differ from verl's: no dual clip, and the truncated IS weights of the rollout correction
    default, _ = make_policy_loss_fn(AlgorithmConfig())(_loss_inputs(mask, torch.tensor(logp), advantages=adv,
                                                                     old_logprobs=old, rollout_logprobs=rollout))
    assert not math.isclose(float(default), float(verl.detach()), rel_tol=1e-6)


# ---- row "KL loss": verl's low_var_kl (default), TRL's k3, verl's k1 -------------------------------------

KL_LOGP = np.array([[-1.0, -2.0, -0.3, -25.0], [-0.7, -1.5, -4.0, -1.0]])
KL_REF = np.array([[-1.2, -1.0, -0.3, -1.0], [-0.2, -9.0, -3.5, -1.0]])
KL_MASK = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])


def _kl_loss(cfg, logp):
    zeros = np.zeros_like(KL_LOGP)  # advantages 0: the loss is the KL term alone
    loss, _ = make_policy_loss_fn(cfg)(_loss_inputs(KL_MASK, torch.tensor(logp), advantages=zeros,
                                                    old_logprobs=logp, ref_logprobs=KL_REF))
    return float(loss)


def test_kl_loss_default_is_verl_low_var_kl():
    """verl use_kl_loss with kl_loss_type low_var_kl (its default): k3 of the log-ratio clamped to +-20,
    then clamped to [-10, 10], token-mean. Here: the defaults (kl_estimator=k3, kl_clamp=10)."""
    x = np.clip(KL_REF - KL_LOGP, -20, 20)
    verl = _masked_mean(np.clip(np.exp(x) - x - 1, -10, 10), KL_MASK)
    assert (np.exp(x) - x - 1 > 10)[KL_MASK > 0].any()  # token (0, 3) is beyond the bound
    assert math.isclose(_kl_loss(AlgorithmConfig(kl_coef=1.0), KL_LOGP), verl, rel_tol=1e-12)


def test_kl_loss_unclamped_is_trl_k3_and_verl_k1():
    """TRL (beta > 0): k3 = exp(ref - logp) - (ref - logp) - 1, no bound: algorithm.kl_clamp=null (the log-ratio
    guard at +-20 stays, so equal up to |log-ratio| = 20; |ref - logp| <= 7.5 here). verl kl_loss_type=kl:
    logp - ref, no bound: kl_estimator=k1 kl_clamp=null."""
    logp = np.minimum(KL_LOGP, -0.1)
    logp[0, 3] = -8.5
    x = KL_REF - logp
    trl = _masked_mean(np.exp(x) - x - 1, KL_MASK)
    assert math.isclose(_kl_loss(AlgorithmConfig(kl_coef=1.0, kl_clamp=None), logp), trl, rel_tol=1e-12)
    verl_k1 = _masked_mean(KL_LOGP - KL_REF, KL_MASK)
    cfg = AlgorithmConfig(kl_coef=1.0, kl_estimator="k1", kl_clamp=None)
    assert math.isclose(_kl_loss(cfg, KL_LOGP), verl_k1, rel_tol=1e-12)


def test_kl_in_the_reward_as_verl_and_openrlhf():
    """verl use_kl_in_reward (kl_penalty default "kl") and OpenRLHF (kl_estimator default k1): each token's reward
    loses kl_coef * (old - ref). Here: kl_in_reward=true kl_estimator=k1 kl_clamp=null; checked on the estimate
    rl.advantages.reward_kl computes from the config (the rest of reward_kl needs a trainer)."""
    from megatron_rl.algorithms.kl import kl_estimate

    cfg = load_config(["algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", "algorithm.kl_estimator=k1",
                       "algorithm.kl_clamp=null"], world_size=1).algorithm
    old, ref = torch.tensor(KL_LOGP[0]), torch.tensor(KL_REF[0])
    penalty = cfg.kl_coef * kl_estimate(old, ref, cfg.kl_estimator, clamp=cfg.kl_clamp)
    assert torch.allclose(penalty, torch.tensor(0.05 * (KL_LOGP[0] - KL_REF[0])), rtol=1e-12)


# ---- rows "GRPO std", "Singleton groups", "Dr. GRPO": the loop's advantages against the peers' ---------------

def _rollouts(rewards, groups, lengths=None):
    lengths = lengths or [3] * len(rewards)
    return [Rollout(g, [1, 2], [5] * n, [0.0] * n, "stop", 1, float(r)) for r, g, n in zip(rewards, groups, lengths)]


def _loop_advantages(estimator, rewards, groups, lengths=None, **overrides):
    """Per-sample advantages as the RL step computes them (rl.advantages.token_advantages), and per-token ones
    (float32: comparisons allow its rounding, rtol 1e-6)."""
    cfg = AlgorithmConfig(advantage_estimator=estimator, **overrides)
    per_token, _ = token_advantages(cfg, torch.tensor(rewards, dtype=D), _rollouts(rewards, groups, lengths))
    return np.array([float(t[0]) for t in per_token]), per_token


def _varied_groups(rng, num_groups=6):
    rewards, groups = [], []
    for g in range(num_groups):
        size = int(rng.integers(2, 9))
        values = rng.normal(size=size) if g % 2 else rng.choice([0.0, 1.0], size)
        values[:2] = [0.0, 1.0] if g % 2 == 0 else values[:2]  # every group varies
        rewards += list(values)
        groups += [g] * size
    return np.array(rewards), np.array(groups)


def test_grpo_is_verl_grpo_and_trl_up_to_its_epsilon():
    """verl: (r - mean_g) / (torch.std_g + 1e-6), torch.std Bessel-corrected; TRL scale_rewards="group":
    the same std + 1e-4; OpenRLHF group_norm: + 1e-9. Here: advantage_estimator=grpo (eps 1e-6, as verl)."""
    rng = np.random.default_rng(2)
    rewards, groups = _varied_groups(rng)
    ours, _ = _loop_advantages("grpo", rewards, groups)
    mean = np.array([rewards[groups == g].mean() for g in groups])
    std = np.array([rewards[groups == g].std(ddof=1) for g in groups])
    assert np.allclose(ours, (rewards - mean) / (std + 1e-6), rtol=1e-6, atol=0)
    trl = (rewards - mean) / (std + 1e-4)
    assert np.all(np.abs(ours - trl) <= np.abs(trl) * (1e-4 / std + 1e-6))
    assert not np.allclose(ours, trl, rtol=1e-6, atol=0)


def test_singleton_groups_get_zero_where_verl_keeps_the_raw_reward():
    """verl's GRPO gives a one-sample group mean 0 and std 1, so its advantage is r / (1 + 1e-6); here 0
    (no config reproduces verl: a lone sample has no baseline)."""
    ours, _ = _loop_advantages("grpo", [0.8, 0.0, 1.0], [0, 1, 1])
    verl_singleton = (0.8 - 0.0) / (1.0 + 1e-6)
    assert ours[0] == 0.0 and verl_singleton > 0.79


def test_dr_grpo_is_trl_unscaled_and_verl_without_std():
    """TRL scale_rewards="none", verl norm_adv_by_std_in_grpo=False, OpenRLHF dr_grpo: r - mean_g.
    Here: advantage_estimator=dr_grpo."""
    rng = np.random.default_rng(3)
    rewards, groups = _varied_groups(rng)
    ours, _ = _loop_advantages("dr_grpo", rewards, groups)
    mean = np.array([rewards[groups == g].mean() for g in groups])
    assert np.allclose(ours, rewards - mean, rtol=1e-6, atol=1e-7)


# ---- rows "Whitening std" and "All-equal groups": REINFORCE++-baseline and GAE over response tokens -----------

def _token_vector(per_sample, lengths):
    return np.concatenate([np.full(n, v) for v, n in zip(per_sample, lengths)])


def test_reinforce_pp_whitening_is_openrlhf_and_verl_up_to_bessel():
    """OpenRLHF reinforce_baseline: a = r - mean_g, then over all response tokens (a - mean) * rsqrt(clamp(var, 1e-8))
    with the population variance; verl reinforce_plus_plus_baseline: masked_whiten, (a - mean) *
    rsqrt(var * T / (T - 1) + 1e-8), Bessel over the T tokens. Here: advantage_estimator=reinforce_pp
    (population, / (std + 1e-6)), the loop passing each sample's token count."""
    rng = np.random.default_rng(4)
    rewards, groups = _varied_groups(rng)
    lengths = [int(n) for n in rng.integers(1, 40, len(rewards))]
    ours, _ = _loop_advantages("reinforce_pp", rewards, groups, lengths)
    centred = rewards - np.array([rewards[groups == g].mean() for g in groups])
    tokens = _token_vector(centred, lengths)
    num_tokens, mean, var = len(tokens), tokens.mean(), tokens.var()
    openrlhf = (centred - mean) / np.sqrt(max(var, 1e-8))
    verl = (centred - mean) / np.sqrt(var * num_tokens / (num_tokens - 1) + 1e-8)
    rtol = 1e-6 / np.sqrt(var) + 1e-6  # our eps 1e-6 on the std, and float32
    assert np.allclose(ours, openrlhf, rtol=rtol, atol=0)
    assert np.allclose(ours, verl * math.sqrt(num_tokens / (num_tokens - 1)), rtol=rtol, atol=0)
    assert not np.allclose(ours, verl, rtol=1e-4, atol=0)


def test_an_all_equal_group_gets_zero_where_the_peers_shift_it():
    """Both peers whiten with the token mean, which is not 0 when lengths differ: an all-equal group gets
    -mean / std there and 0 here (deliberate, no config); the other groups are the peers' values."""
    rewards = np.array([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    groups, lengths = np.array([0, 0, 0, 1, 1, 1]), [2, 9, 4, 3, 3, 7]
    ours, _ = _loop_advantages("reinforce_pp", rewards, groups, lengths)
    centred = rewards - np.array([rewards[groups == g].mean() for g in groups])
    tokens = _token_vector(centred, lengths)
    std = np.sqrt(tokens.var())
    openrlhf = (centred - tokens.mean()) / std
    assert np.allclose(ours[:3], openrlhf[:3], rtol=1e-6 / std + 1e-6) and np.all(ours[3:] == 0.0)
    assert abs(openrlhf[3]) > 0.1


def test_gae_whitening_is_openrlhf_and_verl_up_to_bessel():
    """No critic, gamma = lambda = 1: each token's raw advantage is its sample's reward; OpenRLHF whitens with the
    population variance over tokens, verl's masked_whiten Bessel-corrects. Here: algorithm=ppo (gae)."""
    rewards, lengths = [1.0, 0.0, 0.25, 2.0], [3, 5, 2, 4]
    _, per_token = _loop_advantages("gae", rewards, [0, 1, 2, 3], lengths)
    ours = np.concatenate([t.numpy() for t in per_token])
    tokens = _token_vector(rewards, lengths)
    num_tokens, mean, var = len(tokens), tokens.mean(), tokens.var()
    openrlhf = (tokens - mean) / np.sqrt(max(var, 1e-8))
    verl = (tokens - mean) / np.sqrt(var * num_tokens / (num_tokens - 1) + 1e-8)
    assert np.allclose(ours, openrlhf, rtol=1e-6, atol=1e-7)
    assert np.allclose(ours, verl * math.sqrt(num_tokens / (num_tokens - 1)), rtol=1e-6, atol=1e-7)


# ---- row "Loss aggregation": TRL's loss_type ---------------------------------------------------------------

def _trl_per_token_loss(logp, old, adv, eps=0.2):
    coef_1 = np.exp(logp - old)
    coef_2 = np.clip(coef_1, 1 - eps, 1 + eps)
    return -np.minimum(coef_1 * adv, coef_2 * adv)


@pytest.mark.parametrize("loss_type, overrides", [
    ("dapo", {}),                                                    # TRL's default (2026 main); verl token-mean
    ("grpo", {"loss_agg_mode": "seq_mean_token_mean"}),
    ("dr_grpo", {"loss_agg_mode": "seq_mean_token_sum_norm", "loss_norm_len": 7}),  # max_completion_length = 7
])
def test_trl_loss_types(loss_type, overrides):
    rng = np.random.default_rng(5)
    mask, logp, old = _padded_batch(rng, [5, 3, 7, 1])
    adv = np.repeat(rng.normal(size=(4, 1)), mask.shape[1], axis=1)
    per_token = _trl_per_token_loss(logp, old, adv)
    trl = {"dapo": (per_token * mask).sum() / mask.sum(),
           "grpo": ((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean(),
           "dr_grpo": (per_token * mask).sum() / (mask.shape[0] * 7)}[loss_type]
    cfg = AlgorithmConfig(rollout_is="none", **overrides)
    loss, _ = make_policy_loss_fn(cfg)(_loss_inputs(mask, torch.tensor(logp), advantages=adv, old_logprobs=old))
    assert math.isclose(float(loss), trl, rel_tol=1e-12)


# ---- row "GSPO clamp": verl clamps the sequence log-ratio at 10 -----------------------------------------------

def _verl_gspo(logp_t, old, adv, mask, clamp=True, eps_low=3e-4, eps_high=4e-4):
    mask_t = torch.tensor(mask)
    seq = ((logp_t.detach() - torch.tensor(old)) * mask_t).sum(-1) / mask_t.sum(-1).clamp(min=1)
    log_ratio = logp_t - logp_t.detach() + seq.unsqueeze(-1)
    if clamp:
        log_ratio = torch.clamp(log_ratio, max=10.0)
    ratio, a = torch.exp(log_ratio), torch.tensor(adv)
    pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
    return ((pg * mask_t).sum(-1) / mask_t.sum(-1)).mean()  # seq-mean-token-mean


def _our_gspo(mask, logp, old, adv):
    cfg = AlgorithmConfig(policy_loss="gspo", eps_clip=3e-4, eps_clip_high=4e-4, loss_agg_mode="seq_mean_token_mean",
                          rollout_is="none")  # conf/algorithm/gspo.yaml
    logp_t = torch.tensor(logp, requires_grad=True)
    loss, _ = make_policy_loss_fn(cfg)(_loss_inputs(mask, logp_t, advantages=adv, old_logprobs=old))
    loss.backward()
    return float(loss.detach()), logp_t.grad


def test_gspo_is_verl_gspo_below_its_clamp_and_unclamped_above():
    """verl's GSPO clamps the sequence log-ratio (with its straight-through token term) at 10; here only each
    token's log-ratio is clamped, at +-20. Below 10 the loss and gradient are verl's; a sequence of negative
    advantage at a mean log-ratio of 12 keeps loss and gradient here (verl's formula without its clamp),
    where verl's has loss -A e^10 and no gradient. No config reproduces verl's clamp."""
    rng = np.random.default_rng(6)
    mask, logp, old = _padded_batch(rng, [4, 6, 3], log_ratio_scale=0.01)
    adv = np.repeat(np.array([[1.0], [-0.5], [-2.0]]), mask.shape[1], axis=1)
    for far in (False, True):
        if far:  # sample 2 (negative advantage): mean log-ratio 12, beyond verl's clamp at 10
            old[2] = logp[2] - 12.0
        loss, grad = _our_gspo(mask, logp, old, adv)
        for clamp in (True, False):
            logp_t = torch.tensor(logp, requires_grad=True)
            verl = _verl_gspo(logp_t, old, adv, mask, clamp=clamp)
            verl.backward()
            same = not far or not clamp
            assert math.isclose(loss, float(verl.detach()), rel_tol=1e-10) == same, (far, clamp)
            assert torch.allclose(grad, logp_t.grad * torch.tensor(mask), rtol=1e-8, atol=1e-15) == same, (far, clamp)


# ---- row "Rollout rejection bounds": verl rollout_rs=token, lower bound 1 / threshold --------------------------

def test_token_rejection_is_verl_rollout_rs_with_reciprocal_bounds():
    """verl rollout_rs=token with rollout_rs_threshold=T keeps a token iff 1/T <= pi_train / pi_rollout <= T
    (rollout_rs_threshold_lower defaults to 1/T). Here: rollout_mask=token rollout_mask_high=T
    rollout_mask_low=1/T (set apart; our default pair 0.5 / 2.0 is verl's T = 2). A dropped token stays in
    the token-mean denominator here."""
    rng = np.random.default_rng(7)
    mask, logp, old = _padded_batch(rng, [6, 4, 5])
    adv = np.repeat(rng.normal(size=(3, 1)), mask.shape[1], axis=1)
    rollout = old - rng.normal(size=old.shape) * 1.5
    ratio = np.exp(old - rollout)
    keep = (ratio >= 1 / 3) & (ratio <= 3)
    assert (~keep & (mask > 0)).any() and (keep & (mask > 0)).any()
    cfg = AlgorithmConfig(rollout_is="none", rollout_mask="token", rollout_mask_low=1 / 3, rollout_mask_high=3.0)
    loss, metrics = make_policy_loss_fn(cfg)(_loss_inputs(mask, torch.tensor(logp), advantages=adv, old_logprobs=old,
                                                          rollout_logprobs=rollout))
    assert math.isclose(float(metrics["rollout_kept"]), _masked_mean(keep, mask), rel_tol=1e-12)
    per_token = _trl_per_token_loss(logp, old, adv)  # the plain PPO-clip loss at eps 0.2
    assert math.isclose(float(loss), (per_token * mask * keep).sum() / mask.sum(), rel_tol=1e-12)
