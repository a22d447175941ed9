"""Zero-variance group filter, overlong filter / soft penalty and dynamic sampling."""

import pytest
import torch

from megatron_rl.algorithms.filters import DynamicSampler, overlong, zero_variance_groups


def test_zero_variance_groups_drop_constant_and_singleton_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 5.0, 0.5])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 1])
    keep = zero_variance_groups(rewards, ids)
    assert torch.equal(keep, torch.tensor([False, False, True, True, False, False, False, True]))


def test_overlong_filter_drops_truncated_responses():
    lengths = torch.tensor([10, 19, 20, 25])
    keep, adjustment = overlong(lengths, max_len=20, mode="filter")
    assert torch.equal(keep, torch.tensor([True, True, False, False]))
    assert torch.equal(adjustment, torch.zeros(4))
    # the engine's finish reason wins over the length rule
    keep, _ = overlong(lengths, max_len=20, truncated=torch.tensor([False, True, False, True]))
    assert torch.equal(keep, torch.tensor([True, False, True, False]))


def test_overlong_soft_penalty_is_linear_in_the_window():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    keep, adjustment = overlong(lengths, max_len=20, mode="penalty", penalty_window=4)
    assert keep.all()
    # window starts at 20 - 4 = 16: (16 - L) / 4 for 16 < L <= 20, -1 beyond.
    assert torch.allclose(adjustment, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    _, half = overlong(lengths, max_len=20, mode="penalty", penalty_window=4, penalty=0.5)
    assert torch.allclose(half, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))


def test_overlong_rejects_bad_arguments():
    with pytest.raises(ValueError, match="allowed values are filter, penalty"):
        overlong(torch.tensor([1]), 4, mode="clip")
    for window in (0, 5):
        with pytest.raises(ValueError, match="penalty_window"):
            overlong(torch.tensor([1]), 4, mode="penalty", penalty_window=window)


def test_dynamic_sampler_collects_groups_with_reward_variance():
    sampler = DynamicSampler(target_groups=3, max_rounds=5)
    t = torch.tensor
    assert sampler.add_round(["a", "b", "c"], [t([1.0, 1.0]), t([0.0, 1.0]), t([0.0, 0.0])]) == 1
    assert not sampler.done
    assert sampler.add_round(["d", "e"], [t([1.0, 0.0]), t([1.0, 1.0])]) == 1
    assert not sampler.is_full
    assert sampler.add_round(["f", "g", "h"], [t([0.0, 1.0]), t([1.0, 0.0]), t([0.0, 1.0])]) == 3
    assert sampler.is_full and sampler.done and not sampler.exhausted
    assert sampler.batch() == ["b", "d", "f"]  # arrival order; the surplus g, h is dropped
    assert sampler.stats() == {"rounds": 3.0, "groups_seen": 8.0, "groups_kept": 5.0, "keep_rate": 5 / 8}
    with pytest.raises(RuntimeError, match="done"):
        sampler.add_round(["i"], [t([0.0, 1.0])])


def test_dynamic_sampler_stops_after_max_rounds():
    sampler = DynamicSampler(target_groups=2, max_rounds=2)
    for _ in range(2):
        sampler.add_round(["x"], [torch.tensor([1.0, 1.0])])
    assert sampler.exhausted and sampler.done and sampler.batch() == []


def test_dynamic_sampler_custom_filter_and_validation():
    sampler = DynamicSampler(target_groups=1, max_rounds=1, keep_group=lambda r: bool(r.mean() > 0.5))
    sampler.add_round(["low", "high"], [torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])])
    assert sampler.batch() == ["high"]
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSampler(target_groups=0, max_rounds=1)
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSampler(target_groups=1, max_rounds=0)
    with pytest.raises(ValueError, match="2 groups but 1"):
        DynamicSampler(target_groups=1, max_rounds=1).add_round(["a", "b"], [torch.tensor([1.0])])
