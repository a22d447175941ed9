"""Policy losses and truncated importance sampling against hand-computed values and gradients."""

import math

import pytest
import torch

from megatron_rl.algorithms import POLICY_LOSSES, Registry
from megatron_rl.algorithms.losses import cispo, clip_higher, gspo, ppo_clip, rollout_correction

OLD = torch.full((5,), -1.0, dtype=torch.float64)


def _logprobs(ratios):
    """Current log-probs giving these ratios against OLD, as a leaf with grad."""
    return (OLD[: len(ratios)] + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(True)


def test_ppo_clip_values_gradients_and_metrics():
    ratios = [1.5, 0.5, 1.1, 1.5, 0.7]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -2.0], dtype=torch.float64)
    logp = _logprobs(ratios)
    loss, metrics = ppo_clip(logp, OLD, adv, eps_low=0.2)
    # max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5 A=1: max(-1.5, -1.2) = -1.2 (clipped)   r=0.5 A=1: max(-0.5, -0.8) = -0.5
    #   r=1.1 A=-1: 1.1                               r=1.5 A=-1: max(1.5, 1.2) = 1.5 (pessimistic, not clipped)
    #   r=0.7 A=-2: max(1.4, 1.6) = 1.6 (clipped)
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, 1.1, 1.5, 1.6], dtype=torch.float64))
    loss.sum().backward()
    # d(-A r)/dlogp = -A r where unclipped, 0 where the clipped branch is active.
    assert torch.allclose(logp.grad, torch.tensor([0.0, -0.5, 1.1, 1.5, 0.0], dtype=torch.float64))
    assert torch.equal(metrics["clipped"], torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64))
    assert torch.allclose(metrics["ratio"], torch.tensor(ratios, dtype=torch.float64))
    expected_kl = [r - 1 - math.log(r) for r in ratios]
    assert torch.allclose(metrics["approx_kl"], torch.tensor(expected_kl, dtype=torch.float64))
    assert not any(m.requires_grad for m in metrics.values())


def test_clip_higher_widens_only_the_upper_bound():
    ratios = [1.25, 1.4, 0.7]
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    logp = _logprobs(ratios)
    loss, metrics = clip_higher(logp, OLD[:3], adv, eps_low=0.2, eps_high=0.28)
    # 1.25 < 1.28: unclipped (PPO-clip at 0.2 would clip it);  1.4 -> 1.28;  0.7 -> max(0.7, 0.8) = 0.8
    assert torch.allclose(loss, torch.tensor([-1.25, -1.28, 0.8], dtype=torch.float64))
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.25, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(metrics["clipped"], torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))
    symmetric, _ = ppo_clip(logp, OLD[:3], adv, eps_low=0.2)
    assert math.isclose(float(symmetric[0].detach()), -1.2)


def test_gspo_uses_one_ratio_per_sequence_over_its_loss_tokens():
    old = torch.zeros(5, dtype=torch.float64)
    # sequence 4: token log-ratios 0.1, 0.3 and a masked 5.0 -> mean 0.2; sequence 9: -0.1, 0.0 -> mean -0.05
    logp = torch.tensor([0.1, 0.3, 5.0, -0.1, 0.0], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    ids = torch.tensor([4, 4, 4, 9, 9])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    loss, metrics = gspo(logp, old, adv, eps_low=0.1, eps_high=0.1, loss_mask=mask, sample_ids=ids)
    s4, s9 = math.exp(0.2), math.exp(-0.05)
    assert torch.allclose(metrics["ratio"], torch.tensor([s4, s4, s4, s9, s9], dtype=torch.float64))
    # s4 = 1.221 > 1.1 with A = 1: clipped, loss -1.1;  s9 = 0.951 in range with A = -1: loss s9.
    assert torch.allclose(loss, torch.tensor([-1.1, -1.1, -1.1, s9, s9], dtype=torch.float64))
    assert torch.equal(metrics["clipped"], torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    (loss * mask).sum().backward()
    # each token of an unclipped sequence gets -A * s_i: the sequence-level GSPO gradient
    # (-A s_i / |y_i| per token of the mean) summed over the sequence's |y_i| token losses.
    assert torch.allclose(logp.grad, torch.tensor([0.0, 0.0, 0.0, s9, s9], dtype=torch.float64))


def test_gspo_gradient_matches_differentiable_sequence_ratio():
    old = torch.tensor([-1.0, -2.0, -0.5, -1.0, -3.0], dtype=torch.float64)
    logp = torch.tensor([-0.9, -2.2, -0.4, -1.1, -2.8], dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 0, 0, 1, 1])
    adv = torch.tensor([0.5, 0.5, 0.5, -2.0, -2.0], dtype=torch.float64)
    loss, _ = gspo(logp, old, adv, eps_low=1.0, eps_high=1.0, loss_mask=torch.ones(5), sample_ids=ids)
    loss.sum().backward()
    # Independent reference: sequence-level objective sum_i |y_i| * (-A_i) * exp(mean(logp - old)).
    ref_logp = logp.detach().clone().requires_grad_(True)
    diff = ref_logp - old
    s0, s1 = diff[:3].mean().exp(), diff[3:].mean().exp()
    (3 * -0.5 * s0 + 2 * 2.0 * s1).backward()
    assert torch.allclose(logp.grad, ref_logp.grad)


def test_gspo_needs_sample_ids():
    with pytest.raises(ValueError, match="sample_ids"):
        gspo(OLD, OLD, OLD)


def test_cispo_clips_a_detached_weight_and_keeps_every_gradient():
    ratios = [1.5, 0.5, 1.0]
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    logp = _logprobs(ratios)
    loss, metrics = cispo(logp, OLD[:3], adv, eps_low=0.2, eps_high=0.28)
    weights = [1.28, 0.8, 1.0]  # clip(r, 0.8, 1.28)
    expected = [-w * a * (-1.0 + math.log(r)) for w, a, r in zip(weights, [1.0, -1.0, 2.0], ratios)]
    assert torch.allclose(loss, torch.tensor(expected, dtype=torch.float64))
    loss.sum().backward()
    # only through logp (the weight is detached): -w * A, non-zero even for clipped tokens
    assert torch.allclose(logp.grad, torch.tensor([-1.28, 0.8, -2.0], dtype=torch.float64))
    assert torch.equal(metrics["clipped"], torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))


def test_extreme_log_ratios_stay_finite():
    logp = torch.tensor([0.0, -200.0], requires_grad=True)
    old = torch.tensor([-200.0, 0.0])
    for name in POLICY_LOSSES.names():
        loss, _ = POLICY_LOSSES.get(name)(logp, old, torch.tensor([1.0, -1.0]), eps_low=0.2, eps_high=0.28,
                                          loss_mask=torch.ones(2), sample_ids=torch.tensor([0, 1]))
        assert torch.isfinite(loss).all(), name


def _correct(train, rollout, mask=None, ids=None, **kwargs):
    mask = torch.ones_like(rollout) if mask is None else torch.tensor(mask, dtype=rollout.dtype)
    return rollout_correction(train, rollout, mask, None if ids is None else torch.tensor(ids), **kwargs)


def test_token_tis_weights_truncate_and_detach():
    train = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([-1.5, -0.5, -1.0 - math.log(3.0)], dtype=torch.float64)
    w, keep, capped = _correct(train, rollout, cap=2.0)
    assert not w.requires_grad
    assert torch.allclose(w, torch.tensor([math.exp(0.5), math.exp(-0.5), 2.0], dtype=torch.float64))
    assert keep.tolist() == [1.0, 1.0, 1.0] and capped.tolist() == [0.0, 0.0, 1.0]
    w, _, _ = _correct(torch.tensor([0.0]), torch.tensor([-500.0]), cap=2.0)
    assert torch.isfinite(w).all()
    with pytest.raises(ValueError, match="cap"):
        _correct(train, rollout, cap=0.0)
    with pytest.raises(ValueError, match="low < 1 < high"):
        _correct(train, rollout, mask_level="token", low=1.0)


# Two sequences: tokens 0-2 (sample 0; token 2 is a prompt/tool token, mask 0) and 3-4 (sample 1),
# log r = old - rollout per token, written out: sample 0: 0.5, -0.2, (9.0); sample 1: -1.0, -0.5.
LOG_R = [0.5, -0.2, 9.0, -1.0, -0.5]
IDS, MASK = [0, 0, 0, 1, 1], [1, 1, 0, 1, 1]


def _sequence_case(**kwargs):
    rollout = torch.zeros(5, dtype=torch.float64)
    return _correct(torch.tensor(LOG_R, dtype=torch.float64), rollout, MASK, IDS, **kwargs)


def test_sequence_weights_multiply_the_loss_tokens_ratios():
    w, keep, capped = _sequence_case(level="sequence", cap=2.0)
    # sample 0: exp(0.5 - 0.2) = 1.35 (the masked 9.0 does not count); sample 1: exp(-1.5)
    assert torch.allclose(w, torch.tensor([math.exp(0.3)] * 3 + [math.exp(-1.5)] * 2, dtype=torch.float64))
    assert capped.sum() == 0 and keep.sum() == 5
    w, _, capped = _sequence_case(level="sequence", cap=1.2)
    assert torch.allclose(w[:3], torch.tensor(1.2, dtype=torch.float64)) and capped.tolist() == [1, 1, 1, 0, 0]
    w, _, _ = _sequence_case(level="none")
    assert w.tolist() == [1.0] * 5


@pytest.mark.parametrize("mask_level, low, high, kept", [
    ("token", 0.5, 1.5, [0, 1, 1, 0, 1]),       # r: e^0.5 = 1.65 > 1.5 out; e^-1 = 0.37 < 0.5 out; masked 9.0: kept
    ("sequence", 0.5, 1.5, [1, 1, 1, 0, 0]),    # e^0.3 = 1.35 in; e^-1.5 = 0.22 out
    ("geometric", 0.5, 1.5, [1, 1, 1, 0, 0]),   # means: e^0.15 = 1.16 in; e^-0.75 = 0.47 < 0.5 out
    ("geometric", 0.45, 1.1, [0, 0, 0, 1, 1]),  # 1.16 > 1.1 out; 0.47 in
    ("none", 0.5, 1.5, [1, 1, 1, 1, 1]),
])
def test_rollout_masks_drop_tokens_or_sequences_outside_the_range(mask_level, low, high, kept):
    _, keep, _ = _sequence_case(mask_level=mask_level, low=low, high=high)
    assert keep.tolist() == kept


def test_registry_refuses_duplicates_and_lists_valid_names():
    registry = Registry("policy loss")

    @registry.register("a")
    def first():
        return 1

    with pytest.raises(ValueError, match="'a' is already registered"):
        registry.register("a")(lambda: 2)
    assert registry.get("a") is first
    with pytest.raises(ValueError, match="unknown policy loss 'b': valid names are a"):
        registry.get("b")
    with pytest.raises(ValueError, match="valid names are cispo, clip_higher, gspo, ppo_clip"):
        POLICY_LOSSES.get("ppo")


def test_registry_holds_every_configured_loss():
    from megatron_rl.config.schema import AlgorithmConfig

    assert set(AlgorithmConfig.POLICY_LOSSES) == set(POLICY_LOSSES.names())
