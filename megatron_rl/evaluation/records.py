"""Per-sample evaluation records and the metrics computed from them, the same in training-time
evaluation (`rl.evaluate.evaluate`) and offline evaluation (`python -m megatron_rl.eval`).

A record is one sampled completion of one held-out prompt, as plain JSON data:

    {"prompt": 3, "sample": 1, "domain": "math", "reward": 1.0, "correct": true, "lost": false,
     "truncated": false}

`reward` is the verifier's reward divided by the task's `reward_scale` (so it lies in [0, 1]
for 0/1 verifiers and partial-credit ones alike) and `correct` is `reward >= 1`. `lost`: no
verdict came (a sandbox failure, a verifier that was late or raised: `rollout.collect.is_scored`); such
a record counts in no metric (accuracy over the scored samples, pass@k over the prompts with at
least k scored samples) and is reported as `num_lost`. Offline evaluation adds `set`,
`checkpoint`, `step` and `seed`. `truncated`: the response was cut at the length limit (its
finish_reason is "length"); `truncated` among the metrics is their share of all records.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from megatron_rl.evaluation.stats import (
    DEFAULT_RESAMPLES,
    Interval,
    bootstrap_interval,
    group_by,
    mean_pass_at_k,
    paired_comparison,
    pass_at_k,
    t_interval,
)


def records_from_rollouts(prompts: Sequence[Any], rollouts: Sequence[Any],
                          reward_scale_of: Callable[[Mapping[str, Any]], float]) -> list[dict[str, Any]]:
    """One record per rollout (objects with `.prompt_index` and `.reward`), in rollout order;
    `sample` counts the rollouts of each prompt from 0."""
    from megatron_rl.rollout.collect import is_scored

    seen: dict[int, int] = {}
    out = []
    for r in rollouts:
        meta = prompts[r.prompt_index].meta
        reward = float(r.reward) / reward_scale_of(meta)
        sample = seen.get(r.prompt_index, 0)
        seen[r.prompt_index] = sample + 1
        out.append({"prompt": int(r.prompt_index), "sample": sample, "domain": str(meta.get("domain", "")),
                    "reward": reward, "correct": reward >= 1.0, "lost": not is_scored(r),
                    "truncated": getattr(r, "finish_reason", "") == "length"})
    return out


def scored(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records that carry a verdict (not `lost`)."""
    return [r for r in records if not r.get("lost")]


def counts_per_prompt(records: Sequence[Mapping[str, Any]]) -> dict[int, tuple[int, int, float]]:
    """prompt -> (scored samples, correct samples, summed reward), prompts in first-seen order (a
    prompt whose samples were all lost is left out)."""
    out: dict[int, tuple[int, int, float]] = {}
    for r in scored(records):
        n, c, total = out.get(r["prompt"], (0, 0, 0.0))
        out[r["prompt"]] = (n + 1, c + int(bool(r["correct"])), total + float(r["reward"]))
    return out


def eval_metrics(records: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, float]:
    """One evaluation's metrics: `accuracy` (each prompt's mean reward over its scored samples, averaged over
    the prompts: a prompt that lost samples to the sandbox weighs as much as the others, and on 0/1 rewards it
    equals pass@1) and `pass@<k>` for each k (unbiased pass@k per prompt, averaged over the prompts with at
    least k scored samples: `pass_at_k_prompts` counts them); nan where nothing qualifies (every sample lost).
    `truncated`: the share of all samples cut at the length limit (records written before it was recorded count
    as not cut)."""
    if not records:
        raise ValueError("no evaluation records: the evaluation set is empty")
    counts = list(counts_per_prompt(records).values())
    out = {"accuracy": sum(total / n for n, _, total in counts) / len(counts) if counts else float("nan")}
    for k in ks:
        full = [(n, c) for n, c, _ in counts if n >= k]
        out[f"pass@{k}"] = mean_pass_at_k([n for n, _ in full], [c for _, c in full], k) if full else float("nan")
    out["truncated"] = sum(bool(r.get("truncated")) for r in records) / len(records)
    return out


def pass_at_k_prompts(records: Sequence[Mapping[str, Any]], k: int) -> tuple[int, int]:
    """(prompts pass@k is over: those with >= k scored samples, prompts with any verdict). Lost samples
    cluster on hard prompts (sandbox timeouts), so fewer of the first than the second inflates pass@k."""
    counts = counts_per_prompt(records)
    return sum(n >= k for n, _, _ in counts.values()), len(counts)


def per_prompt_scores(records: Sequence[Mapping[str, Any]], metric: str) -> dict[int, float]:
    """prompt -> its score under `metric` with all of its records pooled (every seed): the mean
    reward for `accuracy`, the unbiased pass@k over all its samples for `pass@<k>`."""
    counts = counts_per_prompt(records)
    if metric == "accuracy":
        return {p: total / n for p, (n, _, total) in counts.items()}
    k = _k_of(metric)
    return {p: pass_at_k(n, c, k) for p, (n, c, _) in counts.items() if n >= k}


def _k_of(metric: str) -> int:
    if not metric.startswith("pass@") or not metric[5:].isdigit():
        raise ValueError(f"metric={metric!r} is invalid: allowed are accuracy and pass@<k> (e.g. pass@4)")
    return int(metric[5:])


def summarize(records: Sequence[Mapping[str, Any]], ks: Sequence[int], confidence: float = 0.95,
              num_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """One checkpoint on one evaluation set, records of every seed: per metric the mean over
    seeds with a t interval (sampling noise) and the pooled per-prompt mean with a bootstrap
    interval over prompts (prompt noise), plus the per-seed values; the same per domain when
    the records carry more than one domain."""
    out = _summary(records, ks, confidence, num_resamples, seed)
    domains = group_by(records, lambda r: r.get("domain", ""))
    if len(domains) > 1:
        out["domains"] = {d: _summary(rows, ks, confidence, num_resamples, seed) for d, rows in domains.items()}
    return out


def _summary(records, ks, confidence, num_resamples, seed) -> dict[str, Any]:
    by_seed = group_by(records, lambda r: r.get("seed", 0))
    per_seed = {s: eval_metrics(rows, ks) for s, rows in sorted(by_seed.items())}
    metrics = {}
    for name in ["accuracy", *(f"pass@{k}" for k in ks)]:
        values = [m[name] for m in per_seed.values() if not math.isnan(m[name])]
        scores = list(per_prompt_scores(records, name).values())
        nothing = Interval(float("nan"), float("nan"), float("nan"), 0, "none")  # every sample lost
        metrics[name] = {"seeds": (t_interval(values, confidence) if values else nothing).to_dict(),
                         "prompts": (bootstrap_interval(scores, confidence, num_resamples, seed) if scores
                                     else nothing).to_dict(),
                         "per_seed": {str(s): None if math.isnan(m[name]) else m[name]  # strict JSON: no NaN
                                      for s, m in per_seed.items()}}
    counts = counts_per_prompt(records)
    counted = len(scored(records))
    out = {"num_prompts": len(counts), "num_samples": counted, "num_lost": len(records) - counted,
           "num_seeds": len(per_seed), "metrics": metrics,
           # per seed, the prompts each pass@k is over (fewer than num_prompts: prompts that lost samples left out)
           "pass_at_k_prompts": {f"pass@{k}": [pass_at_k_prompts(rows, k)[0] for _, rows in sorted(by_seed.items())]
                                 for k in ks}}
    episodes = [r for r in records if "turns" in r]
    if episodes:
        out["episodes"] = episode_summary(episodes)
    return out


def episode_summary(episodes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Agent episodes' records (they carry `turns` and `ended`): model turns per episode (mean,
    and per number of turns how many episodes took it), the share of each ending, and the
    model turns of the episodes that got the full reward."""
    turns = [int(r["turns"]) for r in episodes]
    solved = [int(r["turns"]) for r in episodes if r.get("correct")]
    ended = collections.Counter(str(r["ended"]) for r in episodes)
    return {"num_episodes": len(episodes), "turns_mean": float(np.mean(turns)),
            "turns": {str(k): v for k, v in sorted(collections.Counter(turns).items())},
            "ended": {k: v / len(episodes) for k, v in sorted(ended.items())},
            "turns_mean_solved": float(np.mean(solved)) if solved else None}


def compare(baseline: Sequence[Mapping[str, Any]], candidate: Sequence[Mapping[str, Any]], ks: Sequence[int],
            confidence: float = 0.95, num_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """`candidate - baseline` per metric, paired by prompt (both evaluated on the same prompts)."""
    out = {}
    for name in ["accuracy", *(f"pass@{k}" for k in ks)]:
        prompts_a, prompts_b = {r["prompt"] for r in baseline}, {r["prompt"] for r in candidate}
        if prompts_a != prompts_b:
            raise ValueError(f"the two checkpoints were evaluated on different prompts ({len(prompts_a)} vs "
                             f"{len(prompts_b)}, {len(prompts_a ^ prompts_b)} not shared): compare evaluations of "
                             "the same set")
        a, b = per_prompt_scores(baseline, name), per_prompt_scores(candidate, name)
        order = sorted(set(a) & set(b))  # a prompt lost verdicts left out of one side is left out of both
        if not order:  # no prompt scored on both sides: nothing to compare
            continue
        out[name] = paired_comparison(np.array([a[p] for p in order]), np.array([b[p] for p in order]),
                                      confidence, num_resamples, seed).to_dict()
    return out
