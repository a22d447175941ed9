"""On-policy distillation's per-token signal: the sampled-token estimate of the reverse KL from the student to
the teacher, and the advantage it becomes. Pure tensor code, no collectives.

With y_t sampled from the student pi_s (the rollout engine, at rollout.temperature) and both models' log-probs of
that token, at the same temperature:

    kl_t = log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t)

is an unbiased estimate of KL(pi_s(. | y_<t) || pi_t(. | y_<t)) (Schulman's k1; it can be negative on a token).
As an advantage A_t = -coef * kl_t with a policy-gradient loss, -A_t * grad log pi_s(y_t) has the expectation

    E_{y ~ pi_s}[(log pi_s(y) - log pi_t(y)) grad log pi_s(y)] = grad KL(pi_s || pi_t)   (per position)

(the term E[grad log pi_s] = 0 drops): the gradient of the per-position reverse KL, each position's own term
only (discount 0: a token is not credited with the KL of the positions after it), as the on-policy distillation
write-ups (Agarwal et al. 2024's GKD with beta = 1 on student samples; Thinking Machines 2025) use it.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def distill_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, model_mask: Tensor,
                       coef: float) -> tuple[Tensor, Tensor]:
    """One response's distillation advantages and per-token reverse-KL estimates.

    student_logprobs, teacher_logprobs: [T] log-probs of the sampled response tokens (the student's as it
    sampled them); model_mask: [T] 1 on the model's tokens, 0 on tool or environment output (not sampled by the
    student: no KL, no advantage). Returns (advantages [T] = -coef * kl_t, kl [T] = (student - teacher) * mask)."""
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.shape != model_mask.shape:
        raise ValueError(f"distill_advantages needs equal shapes, got student {tuple(student_logprobs.shape)}, "
                         f"teacher {tuple(teacher_logprobs.shape)}, mask {tuple(model_mask.shape)}")
    if coef <= 0:
        raise ValueError(f"coef={coef} is invalid: the distillation weight must be > 0")
    mask = model_mask.to(torch.float32)
    kl = (student_logprobs.to(torch.float32) - teacher_logprobs.to(torch.float32)) * mask
    return -coef * kl, kl
