"""Evaluation statistics: unbiased pass@k, means with 95% confidence intervals, and the paired
comparison of two checkpoints on the same prompts. Pure numpy/scipy, no torch, no collectives.

Units of resampling. An evaluation draws `n` samples for each of `P` fixed prompts, once per
seed. Two sources of noise matter and are reported separately:

- sampling noise (which completions the model happened to draw): the spread of a metric over
  seeds, a Student-t interval on the per-seed values (`t_interval`);
- prompt noise (which prompts happened to be in the set): a percentile bootstrap that resamples
  prompts with replacement, each prompt carrying all of its samples and seeds
  (`bootstrap_interval`). Samples of one prompt are not independent, so the prompt is the unit.

Two checkpoints evaluated on the same prompts are compared per prompt (`paired_comparison`):
the difference of the means, a paired bootstrap interval for it, and the p-value of a paired
sign-flip permutation test (exact for up to 16 prompts, Monte Carlo above). On 0/1 scores with
one sample per prompt that test is the exact McNemar test.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Sequence

import numpy as np

DEFAULT_RESAMPLES = 10_000
_EXACT_MAX_PROMPTS = 16  # 2**16 sign patterns: enumerated, no Monte Carlo error


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), in the stable
    product form 1 - prod_{i = n - c + 1}^{n} (1 - k / i), so no binomial coefficient overflows."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"k={k} is invalid for num_samples={num_samples}: pass@k needs 1 <= k <= num_samples "
                         "(draw at least k samples per prompt)")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct={num_correct} is invalid: must be in 0..num_samples={num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    prob_fail = 1.0
    for i in range(num_samples - num_correct + 1, num_samples + 1):
        prob_fail *= 1.0 - k / i
    return 1.0 - prob_fail


def mean_pass_at_k(num_samples: Sequence[int], num_correct: Sequence[int], k: int) -> float:
    """pass@k averaged over prompts (each prompt with its own n and c)."""
    if len(num_samples) != len(num_correct) or not num_samples:
        raise ValueError(f"need one (num_samples, num_correct) pair per prompt, got {len(num_samples)} and "
                         f"{len(num_correct)}")
    return sum(pass_at_k(n, c, k) for n, c in zip(num_samples, num_correct)) / len(num_samples)


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate with a confidence interval; low/high are nan when undefined (one value)."""

    mean: float
    low: float
    high: float
    n: int  # values the interval is over (seeds, or prompts for a bootstrap)
    method: str

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def to_dict(self) -> dict[str, Any]:
        def clean(x: float) -> float | None:  # strict JSON has no NaN
            return None if math.isnan(x) else float(x)

        return {"mean": clean(self.mean), "low": clean(self.low), "high": clean(self.high), "n": self.n,
                "method": self.method}


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean with a Student-t interval: mean ± t_{(1+conf)/2, n-1} * s / sqrt(n), s the sample
    standard deviation (ddof=1). Undefined (nan bounds) for one value; zero width when all agree."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"t_interval needs a non-empty 1-d list of values, got shape {x.shape}")
    _check_confidence(confidence)
    mean = float(x.mean())
    if len(x) < 2:
        return Interval(mean, math.nan, math.nan, 1, "t")
    half = float(stats.t.ppf((1 + confidence) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return Interval(mean, mean - half, mean + half, len(x), "t")


def bootstrap_interval(per_prompt: Sequence[float], confidence: float = 0.95,
                       num_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Interval:
    """Mean over prompts with a percentile bootstrap interval: resample the prompts with
    replacement `num_resamples` times (numpy `default_rng(seed)`: the same numbers every call)
    and take the (1-conf)/2 and (1+conf)/2 quantiles of the resampled means."""
    x = np.asarray(per_prompt, dtype=float)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"bootstrap_interval needs a non-empty 1-d list of per-prompt values, got shape {x.shape}")
    _check_confidence(confidence)
    means = _resampled_means(x, num_resamples, seed)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return Interval(float(x.mean()), float(low), float(high), len(x), "bootstrap")


def _resampled_means(x: np.ndarray, num_resamples: int, seed: int, chunk: int = 1000) -> np.ndarray:
    """Means of `num_resamples` bootstrap resamples of `x`, drawn in chunks to bound memory."""
    if num_resamples < 1:
        raise ValueError(f"num_resamples={num_resamples} is invalid: must be >= 1 (e.g. 10000)")
    rng = np.random.default_rng(seed)
    out = np.empty(num_resamples)
    for start in range(0, num_resamples, chunk):
        size = min(chunk, num_resamples - start)
        out[start:start + size] = x[rng.integers(0, len(x), size=(size, len(x)))].mean(axis=1)
    return out


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} is invalid: must be in (0, 1), e.g. 0.95")


@dataclasses.dataclass(frozen=True)
class Comparison:
    """`candidate - baseline` on the same prompts: the mean difference, its paired bootstrap
    interval, and the two-sided p-value of the paired sign-flip permutation test."""

    difference: float
    low: float
    high: float
    p_value: float
    num_prompts: int
    method: str
    alpha: float

    @property
    def significant(self) -> bool:
        return self.p_value < self.alpha

    def to_dict(self) -> dict[str, Any]:
        return {"difference": self.difference, "low": self.low, "high": self.high, "p_value": self.p_value,
                "significant": self.significant, "alpha": self.alpha, "num_prompts": self.num_prompts,
                "method": self.method}


def paired_comparison(baseline: Sequence[float], candidate: Sequence[float], confidence: float = 0.95,
                      num_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Comparison:
    """Compare two checkpoints on the same prompts; `baseline[i]` and `candidate[i]` are prompt
    i's score (e.g. its mean reward over samples and seeds) under each checkpoint."""
    a, b = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"paired_comparison needs one score per prompt for both checkpoints on the same prompts, "
                         f"got shapes {a.shape} and {b.shape}")
    _check_confidence(confidence)
    diff = b - a
    observed = float(diff.mean())
    means = _resampled_means(diff, num_resamples, seed)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    p_value, method = sign_flip_p_value(diff, num_resamples, seed)
    return Comparison(observed, float(low), float(high), p_value, len(diff), method, 1 - confidence)


def sign_flip_p_value(diff: Sequence[float], num_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
                      ) -> tuple[float, str]:
    """Two-sided p-value of H0 "the per-prompt differences are symmetric around 0" (the two
    checkpoints are exchangeable on every prompt): the share of sign patterns whose mean is at
    least as far from 0 as the observed mean. All 2^P patterns when P <= 16 (exact); otherwise
    `num_resamples` random patterns, with the observed one counted in ((1 + hits) / (1 + B))."""
    d = np.asarray(diff, dtype=float)
    observed = abs(d.mean())
    tol = 1e-12 * max(1.0, observed)  # equal means up to rounding count as "as extreme"
    if len(d) <= _EXACT_MAX_PROMPTS:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
        return float(np.mean(np.abs(signs @ d / len(d)) >= observed - tol)), "sign-flip exact"
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, num_resamples, 1000):
        size = min(1000, num_resamples - start)
        signs = rng.choice((-1.0, 1.0), size=(size, len(d)))
        hits += int(np.sum(np.abs(signs @ d / len(d)) >= observed - tol))
    return (1 + hits) / (1 + num_resamples), f"sign-flip monte carlo ({num_resamples})"


def group_by(rows: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, list[dict[str, Any]]]:
    """Rows grouped by `key(row)`, groups in first-seen order (e.g. per domain, per checkpoint)."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(key(row), []).append(row)
    return out
