"""Metrics that each rank counts on its own, combined over all ranks before rank 0 logs them.

Most of an RL step's metrics are the same on every rank: they are computed from the rollouts, which
every rank holds after the gather (rewards, lengths, filters, episode counts, evaluation), or the
trainer reduced them (its loss terms are contributions to global sums). Times are each rank's own
clock, and rank 0's are logged (the collectives that end each phase make every rank wait for the
slowest). What a rank counts on its own share of the prompts is not: its reward collector's unscored
samples and late or failed batches, its verifier's calls and errors, its sandbox client's calls. Each
of those names matches one of `RULES`, which says how the ranks' values combine: counts add up, a mean
is weighted by the count it is a mean over, a maximum is the largest. A rank that scores nothing (not
the first of its model-parallel group) adds zeros, so the sums over all ranks are the sums over the
data-parallel replicas, and every rank ends with the same numbers (a checkpoint's `keep_best` may rank
by any of them).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    how: str  # "sum", "max" or "mean"
    weight: str = ""  # "mean": the name of the count that weighs it (`pattern`'s groups substituted)


RULES = (
    Rule(re.compile(r"reward/(timeouts|failed_batches|unscored|verifier_calls|verifier_errors)"), "sum"),
    # rule verifiers' answers, those that stated none in the asked format, those read by the last number
    Rule(re.compile(r"reward/(answers|unformatted_answers|last_number_answers)"), "sum"),
    # the sandbox client's own calls (sandbox/client.py, `stats`), per priority class; its servers'
    # queues and back-pressure (`server_queued`, `backpressure`, `servers_up`...) are the same for every client
    Rule(re.compile(r"sandbox/([^/]+)/(calls|timeouts|refused|recent_calls|recent_server_waits)"), "sum"),
    # a client's means are over its last 1024 calls (`recent_calls`), not over all it made (`calls`)
    Rule(re.compile(r"sandbox/([^/]+)/(latency|wait)_mean_s"), "mean", r"sandbox/\1/recent_calls"),
    Rule(re.compile(r"sandbox/([^/]+)/server_wait_mean_s"), "mean", r"sandbox/\1/recent_server_waits"),
    Rule(re.compile(r"sandbox/([^/]+)/(latency|wait|server_wait)_max_s"), "max"),
    Rule(re.compile(r"sandbox/([^/]+)/wait_p95_s"), "max"),  # the largest rank's 95th percentile: a bound
)


def rule_of(name: str) -> Optional[Rule]:
    """The rule a rank-local metric combines by; None for a metric every rank holds alike."""
    return next((rule for rule in RULES if rule.pattern.fullmatch(name)), None)


def combine(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Every rank's rank-local metrics (keys without a rule are left out) combined by their rules. A rank
    may lack a key (a rank that made no sandbox call has no sandbox stats): it adds nothing to it."""
    out: dict[str, float] = {}
    for name in sorted({k for metrics in per_rank for k in metrics}):
        rule = rule_of(name)
        if rule is None:
            continue
        have = [metrics for metrics in per_rank if name in metrics]
        values = [float(metrics[name]) for metrics in have]
        if rule.how == "sum":
            out[name] = sum(values)
        elif rule.how == "max":
            out[name] = max(values)
        else:
            weight = rule.pattern.fullmatch(name).expand(rule.weight)
            weights = [float(metrics.get(weight, 0.0)) for metrics in have]
            total = sum(weights)
            out[name] = sum(v * w for v, w in zip(values, weights)) / total if total else 0.0
    return out


def reduce_over_ranks(metrics: Mapping[str, float], group: Any = None) -> dict[str, float]:
    """`metrics` with its rank-local ones (`rule_of`) combined over the ranks of `group` (default: all),
    the others as they are. A collective: every rank calls it at the same point. One all_gather of each
    rank's rank-local metrics, as objects, since their names may differ between ranks."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(metrics)
    local = {name: float(value) for name, value in metrics.items() if rule_of(name) is not None}
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, local, group=group)
    return {**metrics, **combine(every)}
