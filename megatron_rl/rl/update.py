"""The step's log-prob and update phases: the old (and reference) log-probs of the samples, the policy
update(s), and with algorithm.critic the critic's values and update(s)."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from megatron_rl.rollout.collect import Rollout, is_scored


def old_and_reference_logprobs(cfg, run: Any, samples: list, record_routing: bool = False) -> None:
    """Fill in the samples' "old_logprobs" (the trainer's forward, or the engine's with
    algorithm.old_logprobs=rollout; none with current, whose first update takes its own forward's and keeps them
    for the later ones) and, with
    kl_coef > 0, "ref_logprobs", where not given already
    (`reward_kl` computed them before the advantages). Every rank holds the same samples. Both are computed at the
    targets of each sample's loss mask only, and NaN at the others (the losses read nothing else).
    record_routing: the old forward runs over all of `samples` (the same weights give the log-probs
    `reward_kl` found) and leaves its MoE routing in the trainer's `last_routing`. With
    algorithm.routing_replay=rollout the old forward routes as the engine did (the reference's routes freely)."""
    from megatron_rl.trainer.routing_replay import ENGINE

    trainer = run.trainer
    missing = [s for s in samples if record_routing or "old_logprobs" not in s.extras]
    if cfg.algorithm.old_logprobs == "current":
        pass  # the update's own forward gives them (algorithms/objective.py): no forward here
    elif missing and cfg.algorithm.old_logprobs == "recompute":
        old, _ = trainer.forward_logprobs(missing, record_routing=record_routing,
                                          routing=ENGINE if cfg.algorithm.routing_replay == "rollout" else None,
                                          loss_targets_only=True)
        for s, lp in zip(missing, old):
            s.extras["old_logprobs"] = lp
    elif missing:
        for s in missing:
            s.extras["old_logprobs"] = s.extras["rollout_logprobs"]
    missing = [s for s in samples if "ref_logprobs" not in s.extras]
    if cfg.algorithm.kl_coef > 0 and missing:  # the reference policy lives in host memory except for this forward
        current = trainer.swap_weights(run.reference)
        ref, _ = trainer.forward_logprobs(missing, loss_targets_only=True)
        trainer.swap_weights(current)
        for s, lp in zip(missing, ref):
            s.extras["ref_logprobs"] = lp


# The policy loss's KL terms (algorithms/objective.py) by what they compare, as metrics.jsonl names them
KL_METRICS = {"ppo_kl": "kl/policy_old_new", "kl": "kl/ref", "distill_topk_kl": "distill/topk_kl"}


def update_policy(cfg, run: Any, samples: list) -> dict[str, float]:
    """Old (and reference) log-probs, then the policy update(s) on `samples`; the last update's metrics,
    with `kl/policy_old_new` (the approximate KL(old || updated policy) of the last update's tokens),
    `kl/policy_old_new_first_update` (the first's: 0 when the old log-probs are the trainer's own) and,
    with reference log-probs, `kl/ref` (the policy's KL to the reference, algorithm.kl_estimator). With
    algorithm.routing_replay every update routes as the old forward (old) or the engine (rollout) did
    (routing/drift: the share of expert choices the last update's routers would have made differently)."""
    from megatron_rl.trainer.routing_replay import ENGINE

    trainer, replay = run.trainer, cfg.algorithm.routing_replay
    start = time.perf_counter()
    old_and_reference_logprobs(cfg, run, samples, record_routing=replay == "old")
    logprobs_time = time.perf_counter() - start
    routing = {"none": None, "old": trainer.last_routing, "rollout": ENGINE}[replay]
    trainer.last_routing = None
    num_updates = cfg.algorithm.num_inner_updates
    for update in range(num_updates):
        # old_logprobs=current: the first update's forward ran on the weights that sampled; later updates
        # take its log-probs as their old ones (what a forward of their own before the first would give)
        keep = cfg.algorithm.old_logprobs == "current" and update == 0 and num_updates > 1
        found = trainer.train_step(samples, run.loss_fn, with_entropy=True, routing=routing, keep_logprobs=keep)
        if keep:
            for s, lp in zip(samples, trainer.last_logprobs):
                s.extras["old_logprobs"] = lp
            trainer.last_logprobs = None
        metrics = {KL_METRICS.get(name, name): value for name, value in found.items()}
        if update == 0:  # nothing changed yet: the importance ratio must be 1, old log-probs are the update's
            first_kl = metrics.get("kl/policy_old_new", 0.0)
            mismatch = max(0.0, metrics.get("max/mismatch", 0.0))  # max |old - engine| over the loss tokens
        metrics.pop("max/mismatch", None)
    metrics.update({"rollout/logprob_mismatch": mismatch, "kl/policy_old_new_first_update": first_kl,
                    "time/logprobs": logprobs_time})
    if routing is not None:
        metrics["routing/drift"] = metrics.pop("routing_drift")
    return metrics


def critic_values(run: Any, rollouts: list[Rollout]) -> list[Optional[torch.Tensor]]:
    """The critic's values of each scored rollout's response positions, [len(output_ids)] (None for a lost
    one): entry t is V of the state before response token t."""
    scored = [r for r in rollouts if is_scored(r)]
    if not scored:
        return [None] * len(rollouts)
    values, _ = run.critic.forward_logprobs([r.sample({}) for r in scored])
    found = {id(r): r.response_part(v) for r, v in zip(scored, values)}
    return [found.get(id(r)) for r in rollouts]


def update_critic(cfg, run: Any, samples: list) -> dict[str, float]:
    """The critic's update(s) on `samples` (extras "returns" and "old_values"), as many as the policy's;
    metrics under critic/, with the explained variance of the returns by the pre-update values,
    1 - Var(R - V) / Var(R) over the batch's loss tokens (1: perfect, 0: no better than their mean)."""
    mask = torch.cat([s.loss_mask for s in samples]).bool()
    returns = torch.cat([s.extras["returns"] for s in samples])[mask]
    old = torch.cat([s.extras["old_values"] for s in samples])[mask]
    spread = float(returns.var(unbiased=False)) if returns.numel() else 0.0
    # returns that are all equal (rounding aside: R = A + V of rewards all 0) explain nothing: nan
    explained = 1.0 - float((returns - old).var(unbiased=False)) / spread if spread > 1e-12 else float("nan")
    for _ in range(cfg.algorithm.num_inner_updates):
        found = run.critic.train_step(samples, run.value_loss_fn)
    metrics = {f"critic/{k}": v for k, v in found.items() if k != "num_tokens"}
    metrics["critic/explained_variance"] = explained
    return metrics
