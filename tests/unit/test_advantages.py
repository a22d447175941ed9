"""Advantage estimators against hand-computed values (groups interleaved and of unequal size)."""

import math

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS
from megatron_rl.algorithms.advantages import (dr_grpo, gae, grpo, place_sequence_rewards,
                                               reinforce_pp, rloo)

# Group 7: rewards 1, 0, 1, 0 (mean 0.5); group 3: 2, 4, 6 (mean 4); group 9: a singleton.
REWARDS = torch.tensor([1.0, 2.0, 0.0, 4.0, 5.0, 1.0, 6.0, 0.0], dtype=torch.float64)
GROUP_IDS = torch.tensor([7, 3, 7, 3, 9, 7, 3, 7])


def test_grpo_divides_by_unbiased_group_std():
    # group 7: unbiased std = sqrt(4 * 0.25 / 3) = 1/sqrt(3): +-0.5 * sqrt(3); group 3: std = sqrt(8 / 2) = 2.
    h = 0.5 * math.sqrt(3)
    expected = torch.tensor([h, -1.0, -h, 0.0, 0.0, h, 1.0, -h], dtype=torch.float64)
    assert torch.allclose(grpo(REWARDS, GROUP_IDS, eps=0.0), expected)


def test_grpo_eps_keeps_constant_groups_finite():
    adv = grpo(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert torch.isfinite(adv).all()
    assert torch.allclose(adv[:2], torch.zeros(2))
    # group 1: mean 0.5, unbiased std 1/sqrt(2): -+0.5 * sqrt(2) / (1 + sqrt(2) * 1e-6)
    assert torch.allclose(adv[2:], torch.tensor([-1.0, 1.0]) * 0.5 / (1 / math.sqrt(2) + 1e-6))


def test_grpo_without_std_and_dr_grpo_subtract_the_group_mean():
    expected = torch.tensor([0.5, -2.0, -0.5, 0.0, 0.0, 0.5, 2.0, -0.5], dtype=torch.float64)
    assert torch.allclose(grpo(REWARDS, GROUP_IDS, normalize_std=False), expected)
    assert torch.allclose(dr_grpo(REWARDS, GROUP_IDS), expected)


def test_rloo_subtracts_the_mean_of_the_others():
    # group 7: 1 - 1/3, 0 - 2/3; group 3: 2 - 5, 4 - 4, 6 - 3; singleton: 0.
    expected = torch.tensor([2 / 3, -3.0, -2 / 3, 0.0, 0.0, 2 / 3, 3.0, -2 / 3], dtype=torch.float64)
    assert torch.allclose(rloo(REWARDS, GROUP_IDS), expected)


def test_integer_rewards_are_accepted():
    adv = rloo(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.is_floating_point() and torch.allclose(adv, torch.tensor([1.0, -1.0]))


def test_reinforce_pp_group_baseline_then_batch_normalisation():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0, 0.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1, 1])
    # centred: [0.5, -0.5, 1, 1, -2]; batch mean 0; population variance 6.5 / 5 = 1.3.
    centred = torch.tensor([0.5, -0.5, 1.0, 1.0, -2.0], dtype=torch.float64)
    assert torch.allclose(reinforce_pp(rewards, ids, eps=0.0), centred / math.sqrt(1.3))
    # token-weighted (OpenRLHF): weights 1, 1, 2, 2, 4 -> mean -4 / 10 = -0.4,
    # variance (0.81 + 0.01 + 2 * 1.96 + 2 * 1.96 + 4 * 2.56) / 10 = 1.89.
    weighted = reinforce_pp(rewards, ids, eps=0.0, token_counts=torch.tensor([1, 1, 2, 2, 4]))
    assert torch.allclose(weighted, (centred + 0.4) / math.sqrt(1.89))


def test_gae_without_critic_is_reward_to_go():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, mask, whiten=False)
    expected = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    assert torch.allclose(adv, expected) and torch.allclose(ret, expected)


def test_gae_with_values_gamma_and_lambda():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25, 0.5]], dtype=torch.float64)
    adv, ret = gae(rewards, torch.ones(1, 3), values, gamma=0.5, lam=0.5, whiten=False)
    # delta2 = 1 - 0.5 = 0.5;  delta1 = 0.5 * 0.5 - 0.25 = 0;  delta0 = 0.5 * 0.25 - 0.5 = -0.375
    # A2 = 0.5;  A1 = 0 + 0.25 * 0.5 = 0.125;  A0 = -0.375 + 0.25 * 0.125 = -0.34375
    assert torch.allclose(adv, torch.tensor([[-0.34375, 0.125, 0.5]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[0.15625, 0.375, 1.0]], dtype=torch.float64))


def test_gae_skips_masked_positions_inside_a_response():
    # the middle token is tool output (mask 0): its reward and value must not leak in.
    rewards = torch.tensor([[0.0, 9.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 7.0, 0.5]], dtype=torch.float64)
    adv, ret = gae(rewards, torch.tensor([[1.0, 0.0, 1.0]]), values, gamma=0.5, lam=0.5, whiten=False)
    # A2 = 1 - 0.5 = 0.5;  delta0 = 0.5 * 0.5 - 0.5 = -0.25;  A0 = -0.25 + 0.25 * 0.5 = -0.125
    assert torch.allclose(adv, torch.tensor([[-0.125, 0.0, 0.5]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[0.375, 0.0, 1.0]], dtype=torch.float64))


def test_gae_whitening_over_masked_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = gae(rewards, mask)
    # raw advantages 1, 1, 1, 2, 2: mean 1.4, population variance 0.24.
    expected = (torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 1.4]], dtype=torch.float64) - 1.4) / math.sqrt(0.24)
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], dtype=torch.float64))


def test_place_sequence_rewards_on_last_policy_token():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    out = place_sequence_rewards(torch.tensor([3.0, 5.0, 7.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 0.0]]))


def test_bad_shapes_and_float_group_ids_are_rejected():
    with pytest.raises(ValueError, match="shape"):
        grpo(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integers"):
        rloo(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        gae(torch.zeros(3), torch.ones(3))


def test_registry_holds_every_configured_estimator():
    from megatron_rl.config.schema import AlgorithmConfig

    assert set(AlgorithmConfig.ADVANTAGE_ESTIMATORS) == set(ADVANTAGE_ESTIMATORS.names())
    assert ADVANTAGE_ESTIMATORS.get("rloo") is rloo


# Property: a group whose rewards are all equal gets exactly 0 from every group estimator, in every dtype.
# A seeded loop over random batches stands in for hypothesis (not installed): group sizes 1-16, any
# integer ids, interleaved; constant groups (values that are not exact in binary, such as 0.7) mixed
# with varied ones; float64, float32, float16 and bfloat16.
def _group_estimators(token_counts):
    return {"grpo": grpo, "grpo_no_std": lambda r, g: grpo(r, g, normalize_std=False), "dr_grpo": dr_grpo,
            "rloo": rloo, "reinforce_pp": reinforce_pp,
            "reinforce_pp_tokens": lambda r, g: reinforce_pp(r, g, token_counts=token_counts)}


def _random_groups(rng):
    rewards, ids = [], []
    for group in rng.choice(1000, size=int(rng.integers(1, 7)), replace=False):
        size = int(rng.integers(1, 17))
        if rng.random() < 0.5:
            value = rng.choice([0.7, 0.1, 1 / 3, 0.0, 1.0, -2.5, float(rng.normal() * 10), float(rng.random() * 1e4)])
            rewards += [value] * size
        else:
            rewards += list(rng.choice([0.0, 1.0], size) if rng.random() < 0.5 else rng.normal(size=size))
        ids += [int(group)] * size
    order = rng.permutation(len(ids))
    return [rewards[i] for i in order], torch.tensor([ids[i] for i in order])


def _constant_in(rewards, ids):
    """Samples whose group's rewards are all equal in the dtype at hand (a varied group can round to one value)."""
    return torch.stack([rewards[ids == g].max() == rewards[ids == g].min() for g in ids])


def test_every_registered_group_estimator_is_checked():
    assert set(ADVANTAGE_ESTIMATORS.names()) - {"gae"} <= set(_group_estimators(None))


def test_all_equal_groups_get_exactly_zero_advantage_in_every_dtype():
    rng = np.random.default_rng(38)
    for _ in range(150):
        values, ids = _random_groups(rng)
        estimators = _group_estimators(torch.tensor(rng.integers(1, 50, len(values))))
        for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            rewards = torch.tensor(values, dtype=dtype)
            constant = _constant_in(rewards, ids)
            for name, estimator in estimators.items():
                adv = estimator(rewards, ids)
                assert adv.dtype == dtype and torch.isfinite(adv).all(), (name, dtype, values)
                assert (adv[constant] == 0).all(), (name, dtype, values, adv[constant])


def test_grpo_of_eight_equal_float32_rewards_is_zero():
    """The case that was measured: eight rewards of 0.7 gave +0.056 in float32 and +0.93 in bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        rewards = torch.tensor([0.7] * 8 + [0.0, 1.0, 0.0, 1.0], dtype=dtype)
        ids = torch.tensor([0] * 8 + [1] * 4)
        assert torch.equal(grpo(rewards, ids)[:8], torch.zeros(8, dtype=dtype))
        assert torch.allclose(grpo(rewards, ids)[8:].float(), torch.tensor([-1.0, 1.0, -1.0, 1.0]) * math.sqrt(3) / 2,
                              rtol=1e-2)


def test_gae_whitening_of_equal_advantages_is_zero():
    """Every model token's advantage 0.7 (equal rewards, no critic, gamma = lambda = 1): whitened to exactly 0."""
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        adv, _ = gae(place_sequence_rewards(torch.full((3,), 0.7, dtype=dtype), mask), mask)
        assert torch.equal(adv, torch.zeros_like(adv)), dtype
