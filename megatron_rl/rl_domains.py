"""What a multi-domain run (`domains` in the config) adds to the RL step and to evaluation:
per-domain reward calibration before the advantages, per-domain metrics, and pausing a
domain whose rewards look hacked; and the state of both for checkpoints. The RL step calls
it when the run's `domains` is set (see docs/rl.md, "Multi-domain joint training").

Metrics per domain d, each step: `domain/<d>/reward_mean` (the verifier's reward, on the
domain's own scale), `adv_mean` / `adv_std` (population std) / `count` over the step's
samples of d, `share` (its current mixture share) and `paused` (1 when paused);
`calib_mean` / `calib_std` (running statistics) with `algorithm.domain_calibration=running`.
At evaluation: `eval/<d>/accuracy` (rewards divided by the domain's `task.reward_scale`).
Everything is computed from data every rank holds, so every rank decides the same.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_rl.algorithms.calibration import DomainCalibrator
from megatron_rl.data.domains import MixtureSampler, MultiTask
from megatron_rl.rewards.hacking import DomainMonitor

logger = logging.getLogger(__name__)


class JointDomains:
    def __init__(self, algo: Any, task: MultiTask, sampler: MixtureSampler) -> None:
        self.task, self.sampler = task, sampler
        self.calibrator = (DomainCalibrator(algo.domain_calibration_momentum)
                           if algo.domain_calibration == "running" else None)
        self.monitor = (DomainMonitor(algo.domain_pause_window, algo.domain_pause_min_reward_gain,
                                      algo.domain_pause_max_eval_gain) if algo.domain_pause_window else None)

    def domains_of(self, rollouts: Sequence[Any]) -> list[str]:
        names = [getattr(r, "domain", "") for r in rollouts]
        unknown = sorted({n for n in names if n not in self.task.tasks})
        if unknown:
            raise RuntimeError(f"rollouts of unknown domains {unknown}: the rollout path must copy each prompt's "
                               "meta['domain'] into Rollout.domain (rollout/collect.py does)")
        return names

    def advantage_rewards(self, rewards: torch.Tensor, rollouts: Sequence[Any]) -> torch.Tensor:
        """The rewards [N] the advantage estimator sees: calibrated per domain, or as they are."""
        if self.calibrator is None:
            return rewards
        names = self.domains_of(rollouts)
        self.calibrator.update(rewards, names)
        return self.calibrator.normalize(rewards, names)

    def step_metrics(self, step: int, rollouts: Sequence[Any], advantages: torch.Tensor) -> dict[str, float]:
        """Per-domain metrics of RL step `step` (0-based); feeds the hacking monitor."""
        names = self.domains_of(rollouts)
        raw = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        metrics: dict[str, float] = {}
        unscaled: dict[str, float] = {}
        share = self.sampler.mixture()
        for d in self.task.names:
            index = torch.tensor([i for i, n in enumerate(names) if n == d], dtype=torch.long)
            prefix = f"domain/{d}/"
            metrics.update({prefix + "count": float(index.numel()), prefix + "share": share[d],
                            prefix + "paused": float(d in self.sampler.paused)})
            if index.numel():
                adv = advantages[index].double()
                metrics.update({prefix + "reward_mean": raw[index].mean().item(),
                                prefix + "adv_mean": adv.mean().item(),
                                prefix + "adv_std": adv.std(unbiased=False).item()})
                unscaled[d] = raw[index].mean().item() / self.task.tasks[d].cfg.reward_scale
            if self.calibrator is not None and d in self.calibrator.stats:
                mean, std = self.calibrator.mean_std(d)
                metrics.update({prefix + "calib_mean": mean, prefix + "calib_std": std})
        if self.monitor is not None:
            self.monitor.record_train(step + 1, unscaled)
        return metrics

    def eval_metrics(self, step: int, records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Held-out accuracy per domain after `step` steps, from the evaluation's records
        (`evaluation.records.records_from_rollouts`: rewards on the 0-1 scale, lost samples marked) by the
        evaluation's own definition; pauses the domains the monitor flags."""
        from megatron_rl.evaluation.records import eval_metrics, scored
        from megatron_rl.evaluation.stats import group_by

        # a domain with no verdict at all (its sandbox down) is no evidence about it: left out
        accuracy = {d: eval_metrics(rows, [])["accuracy"]
                    for d, rows in group_by(records, lambda r: r["domain"]).items() if scored(rows)}
        for d in self.monitor.record_eval(step, accuracy) if self.monitor is not None else []:
            self._pause(d, self.monitor.flagged[d])
        return {f"eval/{d}/accuracy": a for d, a in accuracy.items()}

    def _pause(self, name: str, evidence: Mapping[str, float]) -> None:
        why = (f"its training reward rose by {evidence['reward_gain']:.3f} between steps {evidence['since_step']:.0f} "
               f"and {evidence['step']:.0f} while its held-out accuracy changed by {evidence['eval_gain']:+.3f}")
        if self.sampler.active == [name]:
            logger.error("domain %s looks reward-hacked (%s) but it is the last active domain: NOT paused", name, why)
            return
        self.sampler.pause(name)
        logger.warning("DOMAIN PAUSED: %s looks reward-hacked: %s; no more prompts are drawn from it "
                       "(remaining domains: %s). Inspect its samples and its verifier.", name, why,
                       ", ".join(self.sampler.active))

    def state_dict(self) -> dict[str, Any]:
        """Calibration statistics and monitor history (the sampler, pauses included, travels on its own)."""
        return {"calibrator": self.calibrator.state_dict() if self.calibrator else None,
                "monitor": self.monitor.state_dict() if self.monitor else None}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no multi-domain state: it was written by a single-task run; "
                             "resume it with domains={} or start a new run directory")
        if self.calibrator is not None and state["calibrator"] is not None:
            self.calibrator.load_state_dict(state["calibrator"])
        if self.monitor is not None and state["monitor"] is not None:
            self.monitor.load_state_dict(state["monitor"])


def make_joint(cfg: Any, task: Any, sampler: Any) -> Optional[JointDomains]:
    """The multi-domain part of the step for a `MultiTask` run; None for a single task."""
    return JointDomains(cfg.algorithm, task, sampler) if isinstance(task, MultiTask) else None
