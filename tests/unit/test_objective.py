"""Loss aggregation modes and the full RL objective against hand-computed values."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algorithms import POLICY_LOSSES, aggregate, make_policy_loss_fn
from megatron_rl.trainer.core import LossInputs

D = torch.float64


def _cfg(**overrides):
    fields = dict(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.28, kl_coef=0.0, kl_estimator="k1",
                  entropy_coef=0.0, loss_agg_mode="token_mean")
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _inputs(logprobs, mask, sample_ids, num_tokens, num_samples, entropy=None, **extras):
    mask = torch.tensor(mask, dtype=D)
    ids = torch.tensor(sample_ids)
    counts = {int(i): float(mask[ids == i].sum()) for i in ids.unique()}
    return LossInputs(logprobs=logprobs, entropy=entropy, loss_mask=mask, sample_ids=ids,
                      sample_num_tokens=torch.tensor([counts[int(i)] for i in ids], dtype=D),
                      extras={k: torch.tensor(v, dtype=D) for k, v in extras.items()},
                      num_tokens=num_tokens, num_samples=num_samples)


# One micro-batch of a larger global batch (10 loss tokens, 4 samples): sample 0 has loss
# values 1, 2 (and a masked 3), sample 1 has 4, 5, 6.
PER_TOKEN = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=D)
MASK = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], dtype=D)
SAMPLE_TOKENS = torch.tensor([2.0, 2.0, 2.0, 3.0, 3.0, 3.0], dtype=D)


@pytest.mark.parametrize("mode, expected", [
    ("token_mean", 18 / 10),                        # (1 + 2 + 4 + 5 + 6) / num_tokens
    ("seq_mean_token_sum", 18 / 4),                 # token sums 3 and 15, / num_samples
    ("seq_mean_token_mean", (3 / 2 + 15 / 3) / 4),  # sample means 1.5 and 5, / num_samples
    ("seq_mean_token_sum_norm", 18 / (4 * 6)),      # Dr. GRPO: / (num_samples * norm_len)
])
def test_aggregation_modes(mode, expected):
    got = aggregate(PER_TOKEN, MASK, SAMPLE_TOKENS, num_tokens=10, num_samples=4, mode=mode, norm_len=6)
    assert math.isclose(float(got), expected, rel_tol=1e-12)


@pytest.mark.parametrize("mode, expected", [
    ("token_mean", 21 / 6), ("seq_mean_token_sum", 21 / 3), ("seq_mean_token_mean", (1.5 + 4.0 + 6.0) / 3)])
def test_micro_batch_contributions_sum_to_the_global_aggregate(mode, expected):
    # global batch: A = [1, 2], B = [3, 4, 5], C = [6]; micro-batches [A] and [B, C].
    parts = [(torch.tensor([1.0, 2.0], dtype=D), torch.tensor([2.0, 2.0], dtype=D)),
             (torch.tensor([3.0, 4.0, 5.0, 6.0], dtype=D), torch.tensor([3.0, 3.0, 3.0, 1.0], dtype=D))]
    total = sum(float(aggregate(values, torch.ones_like(values), counts, 6, 3, mode)) for values, counts in parts)
    assert math.isclose(total, expected, rel_tol=1e-12)


def test_aggregate_rejects_unknown_mode_and_missing_norm_len():
    with pytest.raises(ValueError, match="allowed values are token_mean"):
        aggregate(PER_TOKEN, MASK, SAMPLE_TOKENS, 10, 4, mode="mean")
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(PER_TOKEN, MASK, SAMPLE_TOKENS, 10, 4, mode="seq_mean_token_sum_norm")


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "clip_higher", "gspo", "cispo"])
def test_on_policy_loss_is_minus_mean_advantage(policy_loss):
    values = [-1.0, -2.0, -0.5, -1.5, -0.7]
    adv = [1.0, 2.0, 3.0, -1.0, 0.5]
    logp = torch.tensor(values, dtype=D, requires_grad=True)
    inp = _inputs(logp, [1, 1, 0, 1, 1], [0, 0, 0, 1, 1], num_tokens=4, num_samples=2,
                  advantages=adv, old_logprobs=values)
    loss, metrics = make_policy_loss_fn(_cfg(policy_loss=policy_loss))(inp)
    if policy_loss != "cispo":  # CISPO's value is -w A logp; its gradient is the same
        assert math.isclose(float(metrics["pg_loss"]), -(1.0 + 2.0 - 1.0 + 0.5) / 4, rel_tol=1e-12)
    assert float(metrics["clip_frac"]) == 0.0
    assert math.isclose(float(metrics["ratio"]), 1.0, rel_tol=1e-12)  # 4 tokens of ratio 1, / 4
    assert abs(float(metrics["ppo_kl"])) < 1e-15
    loss.backward()
    expected_grad = torch.tensor([-1.0, -2.0, 0.0, 1.0, -0.5], dtype=D) / 4  # -A m / num_tokens
    assert torch.allclose(logp.grad, expected_grad)


# Ratio 1 everywhere; token 3 is masked. TIS weights 0.5, 1, 3 -> capped at 2; k1 = logp - ref.
LOGP = [-1.0, -2.0, -0.5, -1.5]
FULL = dict(advantages=[1.0, -1.0, 2.0, 0.5], old_logprobs=LOGP, ref_logprobs=[-1.5, -2.0, -1.0, -1.5],
            rollout_logprobs=[-1.0 - math.log(0.5), -2.0, -0.5 - math.log(3.0), -1.5])
ENTROPY = [0.2, 0.4, 0.6, 9.0]


def _full_inputs(logp):
    return _inputs(logp, [1, 1, 1, 0], [0, 0, 1, 1], num_tokens=3, num_samples=2,
                   entropy=torch.tensor(ENTROPY, dtype=D), **FULL)


def test_full_objective_token_mean():
    logp = torch.tensor(LOGP, dtype=D, requires_grad=True)
    loss_fn = make_policy_loss_fn(_cfg(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01))
    loss, metrics = loss_fn(_full_inputs(logp))
    pg = (-1.0 * 0.5 + 1.0 * 1.0 - 2.0 * 2.0) / 3  # -A * w over 3 loss tokens
    kl = (0.5 + 0.0 + 0.5) / 3
    entropy = (0.2 + 0.4 + 0.6) / 3
    assert math.isclose(float(metrics["pg_loss"]), pg, rel_tol=1e-12)
    assert math.isclose(float(loss.detach()), pg + 0.1 * kl - 0.01 * entropy, rel_tol=1e-12)
    assert math.isclose(float(metrics["loss"]), float(loss.detach()), rel_tol=1e-12)
    assert math.isclose(float(metrics["kl"]), kl, rel_tol=1e-12)
    assert math.isclose(float(metrics["entropy"]), entropy, rel_tol=1e-12)
    assert math.isclose(float(metrics["tis_weight"]), (0.5 + 1.0 + 2.0) / 3, rel_tol=1e-12)
    assert math.isclose(float(metrics["tis_clip_frac"]), 1 / 3, rel_tol=1e-12)
    loss.backward()
    # pg: -A w per token; k1 adds kl_coef per loss token; the entropy tensor is an input here.
    expected = torch.tensor([-0.5 + 0.1, 1.0 + 0.1, -4.0 + 0.1, 0.0], dtype=D) / 3
    assert torch.allclose(logp.grad, expected)


def test_with_kl_in_the_reward_the_loss_only_reports_the_kl():
    logp = torch.tensor(LOGP, dtype=D, requires_grad=True)
    loss, metrics = make_policy_loss_fn(_cfg(kl_coef=0.1, kl_in_reward=True))(_full_inputs(logp))
    pg = (-1.0 * 0.5 + 1.0 * 1.0 - 2.0 * 2.0) / 3
    assert math.isclose(float(loss.detach()), pg, rel_tol=1e-12)
    assert math.isclose(float(metrics["kl"]), (0.5 + 0.0 + 0.5) / 3, rel_tol=1e-12)


def test_full_objective_seq_mean_token_mean():
    logp = torch.tensor(LOGP, dtype=D, requires_grad=True)
    loss_fn = make_policy_loss_fn(_cfg(kl_coef=0.1, entropy_coef=0.01, loss_agg_mode="seq_mean_token_mean"))
    loss, metrics = loss_fn(_full_inputs(logp))
    pg = ((-0.5 + 1.0) / 2 + (-4.0) / 1) / 2   # sample means, / num_samples
    kl = ((0.5 + 0.0) / 2 + 0.5 / 1) / 2
    entropy = ((0.2 + 0.4) / 2 + 0.6 / 1) / 2
    assert math.isclose(float(metrics["pg_loss"]), pg, rel_tol=1e-12)
    assert math.isclose(float(loss.detach()), pg + 0.1 * kl - 0.01 * entropy, rel_tol=1e-12)
    assert math.isclose(float(metrics["kl"]), 1 / 3, rel_tol=1e-12)  # diagnostics stay token means


def test_ppo_clip_uses_eps_clip_on_both_sides_and_the_others_eps_clip_high():
    old = [0.0]
    logp = [math.log(1.25)]  # inside clip_higher's 1.28, outside ppo_clip's 1.2
    for policy_loss, clip_frac in (("ppo_clip", 1.0), ("clip_higher", 0.0), ("cispo", 0.0)):
        inp = _inputs(torch.tensor(logp, dtype=D), [1], [0], 1, 1, advantages=[1.0], old_logprobs=old)
        _, metrics = make_policy_loss_fn(_cfg(policy_loss=policy_loss))(inp)
        assert float(metrics["clip_frac"]) == clip_frac, policy_loss


def test_objective_errors_name_the_missing_input():
    logp = torch.tensor(LOGP, dtype=D)
    base = _inputs(logp, [1, 1, 1, 0], [0, 0, 1, 1], 3, 2, advantages=FULL["advantages"], old_logprobs=LOGP)
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_policy_loss_fn(_cfg(kl_coef=0.1))(base)
    with pytest.raises(ValueError, match="with_entropy=True"):
        make_policy_loss_fn(_cfg(entropy_coef=0.1))(base)
    with pytest.raises(ValueError, match="old_logprobs"):
        make_policy_loss_fn(_cfg())(_inputs(logp, [1, 1, 1, 0], [0, 0, 1, 1], 3, 2, advantages=LOGP))
    with pytest.raises(ValueError, match="valid names are"):
        make_policy_loss_fn(_cfg(policy_loss="ppo"))
    with pytest.raises(ValueError, match="valid names are k1, k2, k3"):
        make_policy_loss_fn(_cfg(kl_estimator="k5"))
    with pytest.raises(ValueError, match="loss_norm_len"):
        make_policy_loss_fn(_cfg(loss_agg_mode="seq_mean_token_sum_norm"))


def test_dr_grpo_norm_len_and_tis_cap_are_read_from_the_config():
    logp = torch.tensor(LOGP, dtype=D)
    inp = _full_inputs(logp)
    cfg = _cfg(loss_agg_mode="seq_mean_token_sum_norm", loss_norm_len=8, tis_cap=10.0)
    _, metrics = make_policy_loss_fn(cfg)(inp)
    # weights 0.5, 1, 3 (uncapped at 10): (-0.5 + 1 - 6) / (2 samples * 8)
    assert math.isclose(float(metrics["pg_loss"]), -5.5 / 16, rel_tol=1e-12)


def test_accepts_the_algorithm_config_dataclass():
    from megatron_rl.config.schema import AlgorithmConfig

    for name in POLICY_LOSSES.names():
        cfg = AlgorithmConfig(policy_loss=name, kl_coef=0.05, entropy_coef=0.001)
        loss, metrics = make_policy_loss_fn(cfg)(_full_inputs(torch.tensor(LOGP, dtype=D)))
        assert torch.isfinite(loss) and {"loss", "pg_loss", "kl", "entropy", "clip_frac"} <= set(metrics)


def test_rollout_correction_options_and_mismatch_metrics():
    """FULL's log r = old - rollout on the loss tokens: log 0.5, 0, log 3 (token 3 is masked).
    Sequence level: sample 0 gets min(0.5 * 1, cap), sample 1 min(3, cap); the token mask at
    [0.6, 2.5] drops tokens 0 and 2; none turns the correction off."""
    logp = torch.tensor(LOGP, dtype=D)
    adv = FULL["advantages"]

    def run(**options):
        return make_policy_loss_fn(_cfg(**options))(_full_inputs(logp))[1]

    m = run(rollout_is="sequence", tis_cap=2.0)
    assert math.isclose(float(m["pg_loss"]), (-adv[0] * 0.5 - adv[1] * 0.5 - adv[2] * 2.0) / 3, rel_tol=1e-12)
    assert math.isclose(float(m["tis_clip_frac"]), 1 / 3, rel_tol=1e-12)
    m = run(rollout_is="none", rollout_mask="token", rollout_mask_low=0.6, rollout_mask_high=2.5)
    assert math.isclose(float(m["pg_loss"]), -adv[1] / 3, rel_tol=1e-12)  # only token 1 (r = 1) kept
    assert math.isclose(float(m["rollout_kept"]), 1 / 3, rel_tol=1e-12)
    m = run(rollout_is="none")
    assert math.isclose(float(m["pg_loss"]), -sum(adv[:3]) / 3, rel_tol=1e-12)
    # KL(engine || trainer) from the engine's samples: k1 = mean(-log r), k3 = mean(r - 1 - log r)
    logs = [math.log(0.5), 0.0, math.log(3.0)]
    assert math.isclose(float(m["mismatch_k1"]), -sum(logs) / 3, rel_tol=1e-12)
    assert math.isclose(float(m["mismatch_k3"]), sum(math.exp(x) - 1 - x for x in logs) / 3, rel_tol=1e-12)
    with pytest.raises(ValueError, match="rollout_is=seq"):
        make_policy_loss_fn(_cfg(rollout_is="seq"))


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    """ratio r = e^2 = 7.39 on every token. A = -1: PPO-clip's loss max(-A r, -A clip(r)) = 7.39 (gradient
    -A r); dual clip c = 3 bounds it at -A c = 3, without gradient. A = -0.1: 0.739 bounded at 0.3.
    A = +1: max(-7.39, -1.2) = -1.2, clipped (no gradient) with or without dual clip."""
    old = [0.0, 0.0, 0.0]
    logp = torch.tensor([2.0, 2.0, 2.0], dtype=D, requires_grad=True)
    inp = _inputs(logp, [1, 1, 1], [0, 1, 2], 3, 3, advantages=[-1.0, -0.1, 1.0], old_logprobs=old)
    loss, metrics = make_policy_loss_fn(_cfg(eps_clip_c=3.0))(inp)
    assert math.isclose(float(loss), (3.0 + 0.3 - 1.2) / 3, rel_tol=1e-12)
    assert math.isclose(float(metrics["dual_clip_frac"]), 2 / 3, rel_tol=1e-12)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(3, dtype=D))
    with pytest.raises(ValueError, match="dual clip"):
        make_policy_loss_fn(_cfg(eps_clip_c=3.0, policy_loss="cispo"))


def test_value_loss_clips_against_the_old_values():
    """make_value_loss_fn(0.5) by hand, one micro-batch of a 5-token global batch (a masked 4th token):
        V     = ( 1.0, 0.2, -0.4, 9.0 )   old = ( 0.0, 0.0, 0.0, 0.0 )   R = ( 2.0, 1.0, 0.0, 0.0 )
        plain (V - R)^2        = ( 1.0,  0.64, 0.16 )
        V_clip = old + clip(V - old, +-0.5) = ( 0.5, 0.2, -0.4 ): (V_clip - R)^2 = ( 2.25, 0.64, 0.16 )
    max: (2.25, 0.64, 0.16); loss = 0.5 * 3.05 / 5; only token 0's clipped error was the larger."""
    from megatron_rl.algorithms.objective import make_value_loss_fn

    values = torch.tensor([1.0, 0.2, -0.4, 9.0], dtype=D, requires_grad=True)
    inp = _inputs(values, [1, 1, 1, 0], [0, 0, 1, 1], num_tokens=5, num_samples=3,
                  returns=[2.0, 1.0, 0.0, 0.0], old_values=[0.0, 0.0, 0.0, 0.0])
    loss, metrics = make_value_loss_fn(0.5)(inp)
    assert math.isclose(float(loss), 0.5 * 3.05 / 5, rel_tol=1e-12)
    assert math.isclose(float(metrics["value_clip_frac"]), 1 / 5, rel_tol=1e-12)
    assert math.isclose(float(metrics["values"]), 0.8 / 5, rel_tol=1e-12)
    assert math.isclose(float(metrics["returns"]), 3.0 / 5, rel_tol=1e-12)
    loss.backward()  # the clipped token passes no gradient; the others 0.5 * 2 (V - R) / 5
    assert torch.allclose(values.grad, torch.tensor([0.0, (0.2 - 1.0) / 5, -0.4 / 5, 0.0], dtype=D))
    unclipped, _ = make_value_loss_fn(None)(inp)
    assert math.isclose(float(unclipped), 0.5 * 1.8 / 5, rel_tol=1e-12)
    with pytest.raises(ValueError, match="value loss needs extras"):
        make_value_loss_fn(None)(_inputs(values, [1, 1, 1, 0], [0, 0, 1, 1], num_tokens=5, num_samples=3))


def test_the_kl_loss_is_bounded_by_default():
    """One wild token (the reference finds it e^30 times likelier than the policy) among two ordinary ones:
    k3 = e^20 - 21 = 4.85e8 before (the log-ratio was clamped at 20 only); the default algorithm.kl_clamp=10
    bounds it at 10 and takes its gradient away, as verl's low_var_kl does."""
    from megatron_rl.config.schema import AlgorithmConfig

    old = [-1.0, -1.0, -31.0]
    ref = [-1.0, -1.5, -1.0]
    inp_args = dict(advantages=[0.0, 0.0, 0.0], old_logprobs=old, ref_logprobs=ref)
    x = -0.5  # token 1: ref - logp
    ordinary = math.exp(x) - x - 1
    logp = torch.tensor(old, dtype=D, requires_grad=True)
    cfg = AlgorithmConfig(kl_coef=0.1)
    assert cfg.kl_clamp == 10.0 and cfg.kl_estimator == "k3"
    loss, metrics = make_policy_loss_fn(cfg)(_inputs(logp, [1, 1, 1], [0, 0, 1], 3, 2, **inp_args))
    assert math.isclose(float(metrics["kl"]), (0.0 + ordinary + 10.0) / 3, rel_tol=1e-12)
    assert math.isclose(float(loss.detach()), 0.1 * (ordinary + 10.0) / 3, rel_tol=1e-12)
    assert math.isclose(float(metrics["kl_clamp_frac"]), 1 / 3, rel_tol=1e-12)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): token 1 keeps its gradient, the clamped token 2 has none.
    assert torch.allclose(logp.grad, torch.tensor([0.0, 0.1 * (1 - math.exp(x)) / 3, 0.0], dtype=D))

    unbounded = make_policy_loss_fn(AlgorithmConfig(kl_coef=0.1, kl_clamp=None))
    _, metrics = unbounded(_inputs(torch.tensor(old, dtype=D), [1, 1, 1], [0, 0, 1], 3, 2, **inp_args))
    assert math.isclose(float(metrics["kl"]), (ordinary + math.exp(20) - 21) / 3, rel_tol=1e-9)
    assert "kl_clamp_frac" not in metrics


def test_kl_clamp_must_be_positive_or_null():
    from megatron_rl.config.schema import AlgorithmConfig

    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="algorithm.kl_clamp"):
            AlgorithmConfig(kl_clamp=bad)
        with pytest.raises(ValueError, match="algorithm.kl_clamp"):
            make_policy_loss_fn(_cfg(kl_clamp=bad))


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "clip_higher", "gspo", "cispo"])
def test_current_old_logprobs_are_the_forwards_own(policy_loss):
    """old_logprobs=current: without "old_logprobs" the loss takes this forward's log-probs, detached. Loss,
    gradient and metrics equal those with the same numbers given as old log-probs (a forward of their own at the
    same weights); max/mismatch is max |old - engine| over the loss tokens (the masked 0.9 does not count)."""
    rollout = [-1.2, -0.45, -2.0, -1.0]
    mask = [1, 1, 1, 0]

    def run(cfg, **given):
        logp = torch.tensor([-1.0, -0.5, -2.5, -0.1], dtype=D, requires_grad=True)
        inp = _inputs(logp, mask, [0, 0, 1, 1], 3, 2, advantages=[1.0, 1.0, -0.5, -0.5], rollout_logprobs=rollout,
                      **{k: (v if v is not None else logp.detach().tolist()) for k, v in given.items()})
        loss, metrics = make_policy_loss_fn(cfg)(inp)
        loss.backward()
        return float(loss), logp.grad.clone(), metrics

    loss, grad, metrics = run(_cfg(policy_loss=policy_loss, old_logprobs="current"))
    want_loss, want_grad, want = run(_cfg(policy_loss=policy_loss), old_logprobs=None)
    assert math.isclose(loss, want_loss, rel_tol=1e-12) and torch.allclose(grad, want_grad, rtol=1e-12, atol=0)
    assert float(grad.abs().sum()) > 0
    assert set(metrics) == set(want) and all(math.isclose(float(metrics[k]), float(want[k]), abs_tol=1e-12)
                                             for k in metrics)
    assert math.isclose(float(metrics["max/mismatch"]), 0.5, rel_tol=1e-12)  # |-2.5 - (-2.0)|
    with pytest.raises(ValueError, match="old_logprobs"):  # recompute (the default) never falls back silently
        make_policy_loss_fn(_cfg(policy_loss=policy_loss))(
            _inputs(torch.tensor([-1.0], dtype=D), [1], [0], 1, 1, advantages=[1.0]))
