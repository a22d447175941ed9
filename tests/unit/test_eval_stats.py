"""Evaluation statistics against independently computed values: pass@k against the closed form
with exact binomial coefficients, t intervals against a textbook value and scipy, bootstrap
intervals against a numpy re-implementation, scipy's bootstrap and their coverage, the paired
sign-flip test against scipy's permutation test and the exact McNemar (binomial) test."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats as sps

from megatron_rl.evaluation.records import (compare, eval_metrics, pass_at_k_prompts, per_prompt_scores,
                                            records_from_rollouts, summarize)
from megatron_rl.evaluation.stats import (
    bootstrap_interval,
    mean_pass_at_k,
    paired_comparison,
    pass_at_k,
    sign_flip_p_value,
    t_interval,
)


def closed_form(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize("n", range(1, 13))
def test_pass_at_k_matches_closed_form_on_every_small_case(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases_and_large_n():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0  # c = 0: never passes
    assert pass_at_k(10, 8, 3) == 1.0  # n - c < k: every k-subset holds a correct sample
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25  # pass@1 is the fraction correct
    assert pass_at_k(4, 1, 4) == 1.0  # k = n: "any sample correct"
    # Where C(n, k) would overflow a float, the product form still agrees with exact arithmetic.
    assert pass_at_k(2000, 3, 100) == pytest.approx(closed_form(2000, 3, 100), rel=1e-9)
    assert mean_pass_at_k([4, 4], [0, 2], 2) == pytest.approx((0 + closed_form(4, 2, 2)) / 2)
    for bad in [(4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_has_one_implementation():
    from megatron_rl.rollout import collect

    assert not hasattr(collect, "pass_at_k")  # moved here from rollout/collect.py


def test_t_interval_textbook_value_and_scipy():
    x = np.arange(1, 11, dtype=float)  # mean 5.5, sd sqrt(110/12) = 3.0277, t_{0.975, 9} = 2.262
    ci = t_interval(x)
    half = 2.2622 * math.sqrt(sum((v - 5.5) ** 2 for v in x) / 9) / math.sqrt(10)
    assert ci.mean == 5.5 and ci.n == 10
    assert ci.low == pytest.approx(5.5 - half, abs=1e-3) and ci.high == pytest.approx(5.5 + half, abs=1e-3)
    assert ci.high - 5.5 == pytest.approx(2.166, abs=1e-3)
    rng = np.random.default_rng(3)
    for size, conf in [(2, 0.95), (5, 0.9), (30, 0.99)]:
        y = rng.normal(0.4, 0.2, size=size)
        low, high = sps.t.interval(conf, size - 1, loc=y.mean(), scale=sps.sem(y))
        got = t_interval(y, conf)
        assert (got.low, got.high) == pytest.approx((low, high), abs=1e-12)


def test_t_interval_degenerate_cases():
    one = t_interval([0.7])
    assert one.mean == 0.7 and math.isnan(one.low) and one.to_dict()["low"] is None
    same = t_interval([0.5, 0.5, 0.5])
    assert same.low == same.high == 0.5
    with pytest.raises(ValueError):
        t_interval([])
    with pytest.raises(ValueError):
        t_interval([1.0, 2.0], confidence=1.5)


def test_bootstrap_matches_numpy_reimplementation_and_scipy():
    x = np.random.default_rng(0).binomial(1, 0.3, size=80).astype(float)
    got = bootstrap_interval(x, num_resamples=4000, seed=7)
    # The same procedure written out: one (B, P) index matrix from default_rng(seed).
    idx = np.random.default_rng(7).integers(0, len(x), size=(4000, len(x)))
    means = x[idx].mean(axis=1)
    assert (got.low, got.high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])), abs=1e-12)
    assert got.mean == x.mean() and got.contains(x.mean())
    # scipy draws other resamples: agreement to Monte Carlo precision.
    ref = sps.bootstrap((x,), np.mean, n_resamples=20000, method="percentile", random_state=1).confidence_interval
    assert got.low == pytest.approx(ref.low, abs=0.02) and got.high == pytest.approx(ref.high, abs=0.02)
    assert bootstrap_interval(x, seed=7) == bootstrap_interval(x, seed=7)  # fixed seed: reproducible


def test_bootstrap_and_t_intervals_cover_the_true_mean():
    rng = np.random.default_rng(11)
    trials, true_p = 300, 0.3
    boot = sum(bootstrap_interval(rng.binomial(1, true_p, 200).astype(float), num_resamples=1000,
                                  seed=s).contains(true_p) for s in range(trials))
    t = sum(t_interval(rng.normal(true_p, 0.1, 8)).contains(true_p) for _ in range(trials))
    assert 0.90 <= boot / trials <= 0.99, boot / trials  # nominal 0.95
    assert 0.91 <= t / trials <= 0.99, t / trials


def test_sign_flip_exact_matches_scipy_permutation_test():
    rng = np.random.default_rng(5)
    for size in (6, 11):
        a, b = rng.uniform(size=size), rng.uniform(size=size) + 0.2
        ref = sps.permutation_test((b, a), lambda x, y: np.mean(x - y), permutation_type="samples",
                                   alternative="two-sided", n_resamples=np.inf).pvalue
        p, method = sign_flip_p_value(b - a)
        assert method == "sign-flip exact" and p == pytest.approx(ref, abs=1e-12)


def test_sign_flip_on_binary_scores_is_exact_mcnemar():
    base = np.array([0] * 6 + [1] * 6 + [0] * 3 + [1] * 1, dtype=float)
    cand = np.array([0] * 6 + [1] * 6 + [1] * 3 + [0] * 1, dtype=float)  # 3 prompts gained, 1 lost
    ref = sps.binomtest(3, 4, 0.5).pvalue  # exact McNemar: discordant pairs ~ Binomial(4, 1/2)
    assert sign_flip_p_value(cand - base)[0] == pytest.approx(ref, abs=1e-12)


def test_paired_comparison_on_planted_data():
    rng = np.random.default_rng(2)
    base = rng.binomial(1, 0.4, 300).astype(float)
    same = paired_comparison(base, base.copy())
    assert same.difference == 0 and same.p_value == 1.0 and not same.significant
    noise = paired_comparison(base, rng.permutation(base))  # same quality, other draws: usually not significant
    assert noise.p_value > 0.01 and noise.low <= 0 <= noise.high
    better = np.maximum(base, rng.binomial(1, 0.5, 300).astype(float))  # solves everything base did, and more
    up = paired_comparison(base, better, num_resamples=5000)
    assert up.significant and up.p_value <= 1 / 5001 * 2 and 0 < up.low <= up.difference <= up.high
    assert up.difference == pytest.approx(better.mean() - base.mean())
    down = paired_comparison(better, base, num_resamples=5000)
    assert down.difference < 0 and down.high < 0 and down.significant
    with pytest.raises(ValueError):
        paired_comparison([1.0, 0.0], [1.0])


class _R:
    def __init__(self, prompt_index, reward, status="", finish_reason="stop"):
        self.prompt_index, self.reward, self.status, self.finish_reason = prompt_index, reward, status, finish_reason


class _P:
    def __init__(self, domain=""):
        self.meta = {"answer": "1", **({"domain": domain} if domain else {})}


def _records(rewards_per_prompt, seed=0, domains=None):
    prompts = [_P(domains[i] if domains else "") for i in range(len(rewards_per_prompt))]
    rollouts = [_R(p, r) for p, rewards in enumerate(rewards_per_prompt) for r in rewards]
    return [dict(rec, seed=seed) for rec in records_from_rollouts(prompts, rollouts, lambda meta: 1.0)]


def test_records_and_metrics_by_hand():
    recs = _records([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]])
    assert [r["sample"] for r in recs[:5]] == [0, 1, 2, 3, 0]
    assert recs[0] == {"prompt": 0, "sample": 0, "domain": "", "reward": 1.0, "correct": True, "lost": False,
                       "truncated": False, "seed": 0}
    m = eval_metrics(recs, [1, 2, 4])
    assert m["accuracy"] == pytest.approx(4 / 12)
    assert m["pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert m["pass@2"] == pytest.approx((closed_form(4, 1, 2) + 0 + closed_form(4, 3, 2)) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["truncated"] == 0.0
    cut = records_from_rollouts([_P()], [_R(0, 0.0, finish_reason="length"), _R(0, 1.0), _R(0, 0.0, "unscored",
                                                                                             "length")], lambda m: 1.0)
    assert [r["truncated"] for r in cut] == [True, False, True]
    assert eval_metrics(cut, [1])["truncated"] == pytest.approx(2 / 3)  # of every sample, lost ones too
    scaled = records_from_rollouts([_P()], [_R(0, 5.0), _R(0, 10.0)], lambda meta: 10.0)
    assert [r["reward"] for r in scaled] == [0.5, 1.0] and [r["correct"] for r in scaled] == [False, True]


def test_lost_samples_count_in_no_metric():
    """Prompt 0: samples 1, lost, 0, 1 (three scored); prompt 1: 0, 0, lost, lost (two scored). Accuracy
    is each prompt's mean over its scored samples, averaged over the prompts (2/3 and 0: a prompt that lost
    samples weighs as much, and on 0/1 rewards accuracy is pass@1); pass@2 over both prompts; pass@3 over
    prompt 0 only (one prompt has 3), which `pass_at_k_prompts` says."""
    prompts = [_P(), _P()]
    rollouts = [_R(0, 1.0), _R(0, 0.0, "unscored"), _R(0, 0.0), _R(0, 1.0),
                _R(1, 0.0), _R(1, 0.0), _R(1, 0.0, "dropped"), _R(1, 0.0, "deadline")]
    recs = records_from_rollouts(prompts, rollouts, lambda meta: 1.0)
    assert [r["lost"] for r in recs] == [False, True, False, False, False, False, True, True]
    m = eval_metrics(recs, [1, 2, 3])
    assert m["accuracy"] == pytest.approx((2 / 3 + 0) / 2) == pytest.approx(m["pass@1"])
    assert m["pass@2"] == pytest.approx((closed_form(3, 2, 2) + 0.0) / 2)
    assert m["pass@3"] == pytest.approx(closed_form(3, 2, 3))
    out = summarize([dict(r, seed=0) for r in recs], [2, 3], num_resamples=100)
    assert (out["num_samples"], out["num_lost"], out["num_prompts"]) == (5, 3, 2)
    assert out["pass_at_k_prompts"] == {"pass@2": [2], "pass@3": [1]} and pass_at_k_prompts(recs, 3) == (1, 2)
    assert out["metrics"]["accuracy"]["seeds"]["mean"] == pytest.approx(out["metrics"]["accuracy"]["prompts"]["mean"])
    assert math.isnan(eval_metrics([dict(recs[1])], [1])["accuracy"])
    # a domain whose every sample was lost (its sandbox down): reported empty, the report still written
    down = records_from_rollouts([_P("code"), _P("math")], [_R(0, 0.0, "dropped"), _R(0, 0.0, "dropped"),
                                                            _R(1, 1.0), _R(1, 0.0)], lambda meta: 1.0)
    out = summarize([dict(r, seed=0) for r in down], [1], num_resamples=100)
    code = out["domains"]["code"]
    assert code["num_samples"] == 0 and code["num_lost"] == 2 and code["metrics"]["accuracy"]["prompts"]["n"] == 0
    assert out["domains"]["math"]["metrics"]["accuracy"]["seeds"]["mean"] == 0.5
    assert compare(down[:2], down[:2], [1], num_resamples=100) == {}  # nothing scored on either side


def test_summarize_and_compare_records():
    s0 = _records([[1, 0], [0, 0], [1, 1], [0, 1]], seed=0, domains=["a", "a", "b", "b"])
    s1 = _records([[1, 1], [0, 0], [1, 0], [0, 0]], seed=1, domains=["a", "a", "b", "b"])
    out = summarize(s0 + s1, [1, 2], num_resamples=500)
    acc = out["metrics"]["accuracy"]
    assert acc["per_seed"] == {"0": 0.5, "1": 0.375}
    assert acc["seeds"]["mean"] == pytest.approx(0.4375) and acc["seeds"]["n"] == 2
    assert acc["prompts"]["mean"] == pytest.approx(7 / 16) and acc["prompts"]["n"] == 4
    pooled = per_prompt_scores(s0 + s1, "pass@2")  # 4 samples per prompt over both seeds
    assert pooled == {0: closed_form(4, 3, 2), 1: 0.0, 2: closed_form(4, 3, 2), 3: closed_form(4, 1, 2)}
    assert set(out["domains"]) == {"a", "b"}
    assert out["domains"]["a"]["metrics"]["accuracy"]["per_seed"] == {"0": 0.25, "1": 0.5}
    diff = compare(s0, s1, [2], num_resamples=500)
    assert diff["accuracy"]["difference"] == pytest.approx(0.375 - 0.5)
    assert diff["accuracy"]["method"] == "sign-flip exact" and 0 <= diff["accuracy"]["p_value"] <= 1
    with pytest.raises(ValueError, match="different prompts"):
        compare(s0, s0[:2], [1])


def test_the_lenient_accuracy_averages_prompts_as_the_strict_one():
    """eval/accuracy_last_number and eval/unformatted beside eval/accuracy: prompt 0 answered 7 twice in no asked
    format (right when read by its last number), prompt 1 a wrong \\boxed{3} once and a lost sample. Each prompt
    weighs alike, as in the strict accuracy: 0.5 and 0.5 (over the samples they would be 2/3 and 2/3)."""
    import types

    from megatron_rl.rl.evaluate import lenient_accuracy

    texts = {1: "so the answer is 7", 2: "\\boxed{3}"}
    task = types.SimpleNamespace(reward_kind="math", cfg=types.SimpleNamespace(answer_extraction="strict",
                                                                              reward_tolerance=1e-6))
    run = types.SimpleNamespace(task=task, generation=types.SimpleNamespace(decode=lambda ids: texts[ids[0]]),
                                eval=[_P(), _P()])
    run.eval[0].meta, run.eval[1].meta = {"answer": "7"}, {"answer": "4"}
    rollouts = [_R(0, 0.0), _R(0, 0.0), _R(1, 0.0), _R(1, 0.0, "unscored")]
    for r, first in zip(rollouts, (1, 1, 2, 2)):
        r.output_ids = [first]
    assert lenient_accuracy(run, rollouts) == {"eval/accuracy_last_number": 0.5, "eval/unformatted": 0.5}
