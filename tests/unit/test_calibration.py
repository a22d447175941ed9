"""Per-domain reward calibration against hand-computed running statistics."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.calibration import DomainCalibrator


def test_first_step_uses_its_own_statistics():
    cal = DomainCalibrator(momentum=0.5)
    rewards = torch.tensor([0.0, 1.0, 0.0, 10.0, 10.0, 0.0])
    domains = ["a", "a", "b", "b", "b", "b"]
    cal.update(rewards, domains)
    # a: mean 0.5, E[r^2] 0.5, std sqrt(0.5 - 0.25) = 0.5; b: mean 5, E[r^2] 50, std sqrt(50 - 25) = 5
    assert cal.mean_std("a") == (0.5, 0.5) and cal.mean_std("b") == (5.0, 5.0)
    assert cal.normalize(rewards, domains).tolist() == [-1.0, 1.0, -1.0, 1.0, 1.0, -1.0]


def test_second_step_blends_with_the_momentum():
    cal = DomainCalibrator(momentum=0.5)
    cal.update(torch.tensor([0.0, 1.0]), ["a", "a"])
    cal.update(torch.tensor([1.0, 1.0]), ["a", "a"])
    # alpha = max(0.5, 1/2) = 0.5: mean 0.5*0.5 + 0.5*1 = 0.75, E[r^2] 0.5*0.5 + 0.5*1 = 0.75,
    # var 0.75 - 0.5625 = 0.1875
    mean, std = cal.mean_std("a")
    assert mean == 0.75 and std == pytest.approx(math.sqrt(0.1875), abs=1e-15)
    z = cal.normalize(torch.tensor([1.0, 0.0]), ["a", "a"])
    assert z.tolist() == pytest.approx([0.25 / math.sqrt(0.1875), -0.75 / math.sqrt(0.1875)], abs=1e-6)


def test_warm_up_is_an_exact_average_then_exponential():
    cal = DomainCalibrator(momentum=0.25)
    for value in (1.0, 2.0, 3.0, 6.0):  # updates 1..4: alpha 1, 1/2, 1/3, 1/4 -> the plain average
        cal.update(torch.tensor([value]), ["a"])
    assert cal.mean_std("a")[0] == pytest.approx(3.0, abs=1e-12)
    cal.update(torch.tensor([7.0]), ["a"])  # update 5: alpha = max(0.25, 1/5) = 0.25
    assert cal.mean_std("a")[0] == pytest.approx(0.75 * 3.0 + 0.25 * 7.0, abs=1e-12)


def test_domains_do_not_share_statistics_and_absent_domains_keep_theirs():
    cal = DomainCalibrator(momentum=0.1)
    cal.update(torch.tensor([0.0, 2.0]), ["a", "a"])
    cal.update(torch.tensor([100.0, 300.0]), ["b", "b"])  # a is absent from this step: unchanged
    assert cal.mean_std("a") == (1.0, 1.0) and cal.mean_std("b") == (200.0, 100.0)
    assert cal.stats["a"]["updates"] == 1


def test_constant_rewards_normalise_to_zero_not_nan():
    cal = DomainCalibrator()
    cal.update(torch.tensor([1.0, 1.0, 1.0]), ["a"] * 3)
    assert cal.normalize(torch.tensor([1.0, 1.0, 1.0]), ["a"] * 3).tolist() == [0.0, 0.0, 0.0]


def test_scale_invariance_two_domains_on_different_scales_come_out_alike():
    torch.manual_seed(0)
    outcomes = (torch.rand(64) < 0.3).float()
    cal = DomainCalibrator()
    rewards = torch.cat([outcomes, 10.0 * outcomes])
    domains = ["pass_fail"] * 64 + ["points"] * 64
    cal.update(rewards, domains)
    z = cal.normalize(rewards, domains)
    assert torch.allclose(z[:64], z[64:], atol=1e-6)
    assert z[:64].mean().abs() < 1e-6 and z[:64].std(unbiased=False) == pytest.approx(1.0, abs=1e-6)


def test_state_round_trip_is_exact():
    a = DomainCalibrator(momentum=0.3)
    for step in range(7):
        a.update(torch.tensor([step * 0.1, 1.0, step * 3.0]), ["x", "x", "y"])
    b = DomainCalibrator(momentum=0.3)
    b.load_state_dict(a.state_dict())
    nxt = torch.tensor([0.7, 0.2, 5.0])
    a.update(nxt, ["x", "x", "y"])
    b.update(nxt, ["x", "x", "y"])
    assert a.stats == b.stats
    assert torch.equal(a.normalize(nxt, ["x", "x", "y"]), b.normalize(nxt, ["x", "x", "y"]))


def test_errors():
    cal = DomainCalibrator()
    with pytest.raises(KeyError, match="'z' has no reward statistics"):
        cal.normalize(torch.tensor([1.0]), ["z"])
    with pytest.raises(ValueError, match="2 rewards but 1 domain names"):
        cal.update(torch.tensor([1.0, 2.0]), ["a"])
    with pytest.raises(ValueError, match="momentum=0 is invalid"):
        DomainCalibrator(momentum=0)
