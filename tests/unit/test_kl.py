"""KL estimators k1, k2, k3 against hand-computed values and exact expectations."""

import math

import pytest
import torch

from megatron_rl.algorithms import KL_ESTIMATORS
from megatron_rl.algorithms.kl import k1, k2, k3, kl_estimate

LOGP = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
REF = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)


def test_tokenwise_values():
    assert torch.allclose(k1(LOGP, REF), torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(k2(LOGP, REF), torch.tensor([0.125, 0.5, 0.0], dtype=torch.float64))
    # x = ref - logp = -0.5, 1, 0:  exp(x) - x - 1
    expected = [math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0]
    assert torch.allclose(k3(LOGP, REF), torch.tensor(expected, dtype=torch.float64))


def test_k1_and_k3_are_unbiased_for_reverse_kl():
    # Enumerate a two-token vocabulary: E_{y~p}[k(y)] against KL(p || q) written out by hand.
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.25, 0.75], dtype=torch.float64)
    reverse_kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    for estimator in (k1, k3):
        assert math.isclose(float((p * estimator(p.log(), q.log())).sum()), reverse_kl, rel_tol=1e-12)
    # k2 is biased: 0.5 * (0.5 * ln(2)^2 + 0.5 * ln(2/3)^2)
    expected_k2 = 0.25 * (math.log(2) ** 2 + math.log(2 / 3) ** 2)
    assert math.isclose(float((p * k2(p.log(), q.log())).sum()), expected_k2, rel_tol=1e-12)


def test_k3_is_non_negative_and_finite_for_extreme_ratios():
    out = k3(torch.tensor([-100.0, 0.0, -3.0]), torch.tensor([0.0, -100.0, -3.0]))
    assert torch.isfinite(out).all() and (out >= 0).all()


def test_clamp_and_estimator_names():
    assert torch.allclose(kl_estimate(LOGP, REF, "k1", clamp=0.6), torch.tensor([0.5, -0.6, 0.0], dtype=torch.float64))
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="valid names are k1, k2, k3"):
        kl_estimate(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(LOGP, REF[:2], "k1")


def test_kl_loss_gradients_flow_through_logprobs():
    logp = LOGP.clone().requires_grad_(True)
    k2(logp, REF).sum().backward()
    assert torch.allclose(logp.grad, LOGP - REF)  # d/dx 0.5 (x - r)^2


def test_the_adaptive_controller_follows_ziegler_et_al():
    """beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon), by hand."""
    from megatron_rl.algorithms.kl import KLController

    ctl = KLController(0.1, target=0.02, horizon=100)
    ctl.update(0.03, 10)  # 50% over the target: the error is clipped to +0.2
    assert math.isclose(ctl.coef, 0.1 * (1 + 0.2 * 10 / 100))
    ctl.update(0.018, 20)  # 10% under: -0.1
    assert math.isclose(ctl.coef, 0.1 * 1.02 * (1 - 0.1 * 20 / 100))
    ctl.update(0.0, 5)  # no drift at all: clipped to -0.2
    assert math.isclose(ctl.coef, 0.1 * 1.02 * 0.98 * (1 - 0.2 * 5 / 100))
    again = KLController(0.1, target=0.02, horizon=100)
    again.load_state_dict(ctl.state_dict())
    assert again.coef == ctl.coef
    fixed = KLController(0.1)
    fixed.update(5.0, 1000)
    assert fixed.coef == 0.1
    for bad in ({"coef": 0.0}, {"coef": 0.1, "target": 0.0}, {"coef": 0.1, "horizon": 0}):
        with pytest.raises(ValueError, match="KL controller needs"):
            KLController(**bad)


def test_k3_of_a_wild_token_is_clamped_to_the_bound():
    """The helper the objective calls: k3 at a log-ratio of 30 is e^20 - 21 = 4.85e8 unclamped (its
    log-ratio is bounded at 20 only), 10 with clamp=10; ordinary tokens are unchanged."""
    logp, ref = torch.tensor([-31.0, -1.0], dtype=torch.float64), torch.tensor([-1.0, -1.5], dtype=torch.float64)
    ordinary = math.exp(-0.5) + 0.5 - 1
    expected = torch.tensor([math.exp(20) - 21, ordinary], dtype=torch.float64)
    assert torch.allclose(kl_estimate(logp, ref, "k3"), expected)
    assert torch.allclose(kl_estimate(logp, ref, "k3", clamp=10.0), torch.tensor([10.0, ordinary], dtype=torch.float64))
