"""A step's metrics, assembled in one place (`step_metrics`), and what a step does besides learning:
the environment pool's statistics and refresh, the reward audit (`maintain`). Every rank counts its
own share; `reduce_over_ranks` sums the counts and averages the rest before rank 0 logs them."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megatron_rl.rewards.counts import VerifierCounts
from megatron_rl.rollout.collect import Rollout, is_scored

logger = logging.getLogger(__name__)


def step_metrics(rt, run: Any, step: int, rollouts: list[Rollout], rewards: torch.Tensor, advantages: list,
                 samples: list, found: dict[str, dict[str, float]], train_time: float, warming: bool,
                 counts: VerifierCounts, timeline: Any) -> dict[str, float]:
    """The step's metrics over every rank. `found`: what each phase reported ("update": the policy's and the
    critic's, "source": the rollout source's timings and sync stats, "filters", "kl", "maintain")."""
    from megatron_rl.algorithms.filters import zero_variance_groups
    from megatron_rl.observability.reduce import reduce_over_ranks

    cfg = rt.cfg
    metrics = {**found["update"], **found["source"], **found["filters"], **found["kl"]}
    scored = [is_scored(r) for r in rollouts]
    raw = torch.tensor([r.reward for r, s in zip(rollouts, scored) if s])
    scored_values = rewards[torch.tensor(scored, dtype=torch.bool)]
    lengths = torch.tensor([float(len(r.output_ids)) for r in rollouts])
    group_ids = torch.tensor([r.prompt_index for r, s in zip(rollouts, scored) if s], dtype=torch.long)
    tokens = sum(s.tokens.numel() for s in samples)
    metrics.update({"reward/mean": raw.mean().item(), "response_length/mean": lengths.mean().item(),
                    "reward/shaped_mean": scored_values.mean().item(),
                    "reward/zero_variance_groups":
                        (~zero_variance_groups(scored_values, group_ids)).float().mean().item(),
                    "time/train": train_time, "tokens_per_s": tokens / max(train_time, 1e-9),
                    "weight_version": float(rollouts[0].weight_version) if rollouts else float(run.source.version)})
    for key, value in counts.since(run.rewards.verifier).items():  # added to the generators' (disaggregated mode)
        metrics[key] = metrics.get(key, 0.0) + value
    if run.domains:
        kept = [(r, a) for r, a in zip(rollouts, advantages) if a is not None]
        metrics.update(run.domains.step_metrics(step, [r for r, _ in kept],
                                                torch.tensor([a.mean().item() if a.numel() else 0.0 for _, a in kept])))
    if metrics.get("time/generate_only"):  # single-turn rollouts: the job's tokens over rank 0's generation time
        metrics["rollout/tokens_per_s"] = metrics.get("rollout/generated_tokens", 0.0) / metrics["time/generate_only"]
    if warming:  # the critic's warm-up: the policy trained on nothing, no throughput to report
        metrics.pop("tokens_per_s")
    metrics.update(found["maintain"])
    if any(e["track"] == "engine" for e in timeline.events):  # the step's engine time, training included
        metrics["sched/step_engine_busy"] = timeline.busy("engine") / max(time.perf_counter() - timeline.origin, 1e-9)
    metrics.update(sandbox_metrics(run))
    if cfg.logging.trace_every and step % cfg.logging.trace_every == 0 and rt.is_main:
        timeline.to_chrome_trace(rt.run_dir / "traces" / f"step_{step + 1:08d}.json")
    metrics = reduce_over_ranks(metrics)
    if metrics.get("reward/answers"):  # shares over every rank's answers
        for kind in ("unformatted", "last_number"):
            if f"reward/{kind}_answers" in metrics:
                metrics[f"reward/{kind}_share"] = metrics[f"reward/{kind}_answers"] / metrics["reward/answers"]
    return metrics


def sandbox_client(run: Any) -> Any:
    return getattr(run.rewards.verifier, "client", None)


def sandbox_metrics(run: Any) -> dict[str, float]:
    """Queue depth, waits and back-pressure per priority class, from the sandbox client."""
    import asyncio

    client = sandbox_client(run)
    if client is None or not hasattr(client, "metrics"):
        return {}
    try:
        return asyncio.run_coroutine_threadsafe(client.metrics(), run.rewards.loop).result(10)
    except Exception as err:  # metrics must never stop training
        logger.debug("sandbox metrics unavailable: %s", err)
        return {}


def maintain(rt, run: Any, step: int, rollouts: list[Rollout]) -> dict[str, float]:
    """Environment-pool statistics and refresh (task.pool_refresh_every), the reward audit
    (logging.audit_every)."""
    cfg, out = rt.cfg, {}
    pool = run.env_pool
    if pool is not None:
        for r in rollouts:
            if is_scored(r):  # a lost episode's 0 is no verdict (it made good tasks look flaky)
                pool.observe(r.source_index, r.reward, str(hash(tuple(r.output_ids))))
        if (step + 1) % cfg.task.pool_refresh_every == 0:
            pool.gc_and_refresh(step + 1)
        out.update(pool.metrics())
    if cfg.logging.audit_every and step % cfg.logging.audit_every == 0 and rt.is_main:
        from megatron_rl.rewards.audit import audit

        out.update(audit(step + 1, rollouts, run.generation.decode, rt.run_dir / "audit", cfg.logging.audit_samples))
    return out
