"""The step's distillation phase (algorithm.distill.teacher): the teacher scores the step's scored rollouts. With
estimator=sampled each response token's advantage gains the distillation term (mixed) or becomes it (pure); with
estimator=topk the samples carry the teacher's top-k tokens and log-probs for the loss's KL term
(algorithms/objective.py), and the advantages stay the RL ones (mixed) or become 0 (pure). The per-token math is
megatron_rl/algorithms/distill.py."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from megatron_rl.algorithms.distill import DISTILL_MASK, TEACHER_LOGPROBS
from megatron_rl.rollout.collect import Rollout, is_scored, model_tokens
from megatron_rl.trainer.core import SUPPORT_IDS


def distill_shaping(cfg, run: Any, rollouts: list[Rollout], advantages: list[Optional[torch.Tensor]]
                    ) -> tuple[list[Optional[torch.Tensor]], list[dict[str, torch.Tensor]], dict[str, float]]:
    """Each scored rollout's advantages [len(output_ids)] and the sample extras the update needs (a lost rollout
    keeps None and no extras). estimator=sampled: the distillation advantage added (mixed) or in their place (pure);
    no extras. estimator=topk: the RL advantages (mixed) or zeros (pure), and extras SUPPORT_IDS [L-1, k] (the
    teacher's top-k tokens below the student's vocabulary size at each of the model's response tokens; 0 on the
    prompt and on tool output), TEACHER_LOGPROBS [L-1, k] (NaN there: not computed) and DISTILL_MASK [L-1]. The
    student's log-probs here are the engine's of the tokens it sampled (`Rollout.logprobs`, at
    rollout.temperature), the teacher's its forward at the same temperature.

    Metrics: distill/reverse_kl, the mean over the step's scored model tokens of log pi_s(y_t) - log pi_t(y_t)
    (the sampled-token estimate of the per-position KL(student || teacher), whatever the estimator trains on);
    distill/teacher_logprob, the mean teacher log-prob of those tokens; with topk distill/teacher_topk_mass, the
    mean probability the teacher's top k hold; time/teacher, the teacher's forward (its onload and offload
    included)."""
    scored = [r for r in rollouts if is_scored(r)]
    none: list[dict[str, torch.Tensor]] = [{} for _ in rollouts]
    if not scored:
        return advantages, none, {}
    spec = cfg.algorithm.distill
    start = time.perf_counter()
    samples = [r.sample({}) for r in scored]
    if spec.estimator == "topk":
        found = run.teacher.score_topk(samples, spec.topk, vocab_limit=cfg.model.vocab_size)
        teacher = [lp for lp, _, _ in found]
    else:
        teacher = run.teacher.score(samples)
    elapsed = time.perf_counter() - start
    out, metrics = combine(spec, rollouts, advantages, dict(zip(map(id, scored), teacher)))
    metrics["time/teacher"] = elapsed
    if spec.estimator != "topk":
        return out, none, metrics
    by_rollout = dict(zip(map(id, scored), found))
    extras, mass, num_tokens = [], 0.0, 0.0
    for i, (r, a) in enumerate(zip(rollouts, advantages)):
        if id(r) not in by_rollout or a is None:
            extras.append({})
            continue
        _, ids, lps = by_rollout[id(r)]
        mask = r.response_extra(model_tokens(r))
        out[i] = torch.zeros_like(out[i]) if spec.mode == "pure" else a.to(torch.float32)
        extras.append({SUPPORT_IDS: ids, TEACHER_LOGPROBS: lps, DISTILL_MASK: mask})
        mass += float(lps[mask.bool()].exp().sum())  # the teacher computed the response's positions only
        num_tokens += float(mask.sum())
    metrics["distill/teacher_topk_mass"] = mass / max(num_tokens, 1.0)
    return out, extras, metrics


def combine(spec: Any, rollouts: list[Rollout], advantages: list[Optional[torch.Tensor]],
            teacher: dict[int, torch.Tensor]) -> tuple[list[Optional[torch.Tensor]], dict[str, float]]:
    """`distill_shaping` after the teacher's forward: `teacher` maps id(rollout) of each scored rollout to the
    teacher's log-probs of its targets [L-1]; `spec` has algorithm.distill's coef and mode."""
    from megatron_rl.algorithms.distill import distill_advantages

    scored = [r for r in rollouts if id(r) in teacher]
    found, kl_sum, teacher_sum, num_tokens = {}, 0.0, 0.0, 0.0
    for r in scored:
        per_target = teacher[id(r)]
        mask = torch.tensor(model_tokens(r), dtype=torch.float32)
        teacher_lp = r.response_part(per_target).to(torch.float32)
        gain, kl = distill_advantages(torch.tensor(r.logprobs, dtype=torch.float32), teacher_lp, mask, spec.coef)
        found[id(r)] = gain
        kl_sum += float(kl.sum())
        teacher_sum += float(teacher_lp[mask > 0].sum())  # NaN on tool output: the teacher computed the model's only
        num_tokens += float(mask.sum())
    out: list[Optional[torch.Tensor]] = []
    for r, a in zip(rollouts, advantages):
        gain = found.get(id(r))
        if gain is None or a is None:  # lost: no advantage at all
            out.append(None)
        else:
            out.append(gain if spec.mode == "pure" else a.to(gain.dtype) + gain)
    denominator = max(num_tokens, 1.0)
    return out, {"distill/reverse_kl": kl_sum / denominator, "distill/teacher_logprob": teacher_sum / denominator}
