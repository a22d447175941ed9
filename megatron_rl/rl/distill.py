"""The step's distillation phase (algorithm.distill.teacher): the teacher scores the step's scored rollouts, and
each response token's advantage gains the distillation term (mixed) or becomes it (pure). The estimator itself is
megatron_rl/algorithms/distill.py."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from megatron_rl.rollout.collect import Rollout, is_scored, model_tokens


def distill_shaping(cfg, run: Any, rollouts: list[Rollout], advantages: list[Optional[torch.Tensor]]
                    ) -> tuple[list[Optional[torch.Tensor]], dict[str, float]]:
    """Each scored rollout's advantages [len(output_ids)] with the distillation advantage added (mixed) or in
    their place (pure); a lost rollout keeps None. The student's log-probs are the engine's of the tokens it
    sampled (`Rollout.logprobs`, at rollout.temperature), the teacher's its forward at the same temperature.

    Metrics: distill/reverse_kl, the mean over the step's scored model tokens of log pi_s(y_t) - log pi_t(y_t)
    (the sampled-token estimate of the per-position KL(student || teacher)); distill/teacher_logprob, the mean
    teacher log-prob of those tokens; time/teacher, the teacher's forward (its onload and offload included)."""
    scored = [r for r in rollouts if is_scored(r)]
    if not scored:
        return advantages, {}
    start = time.perf_counter()
    teacher = run.teacher.score([r.sample({}) for r in scored])
    elapsed = time.perf_counter() - start
    out, metrics = combine(cfg.algorithm.distill, rollouts, advantages, dict(zip(map(id, scored), teacher)))
    return out, {**metrics, "time/teacher": elapsed}


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
        teacher_sum += float((teacher_lp * mask).sum())
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
