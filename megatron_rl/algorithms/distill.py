"""On-policy distillation's per-token signal (algorithm.distill.estimator): the sampled-token estimate of the
reverse KL from the student to the teacher and the advantage it becomes (`sampled`), or the reverse KL over the
teacher's top-k tokens as a loss term (`topk`). Pure tensor code, no collectives.

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

# Sample extras of estimator=topk (besides the trainer's SUPPORT_IDS, the teacher's top-k token ids [L-1, k]):
TEACHER_LOGPROBS = "teacher_support_logprobs"  # [L-1, k] the teacher's log-probs of those tokens
DISTILL_MASK = "distill_mask"  # [L-1] 1 on the response tokens the student wrote: the KL term's tokens


def distill_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, model_mask: Tensor,
                       coef: float) -> tuple[Tensor, Tensor]:
    """One response's distillation advantages and per-token reverse-KL estimates.

    student_logprobs, teacher_logprobs: [T] log-probs of the sampled response tokens (the student's as it
    sampled them); model_mask: [T] 1 on the model's tokens, 0 on tool or environment output (not sampled by the
    student: no KL, no advantage, and whatever the log-probs hold there, NaN included, is not read). Returns
    (advantages [T] = -coef * kl_t, kl [T] = student - teacher on the model's tokens, 0 elsewhere)."""
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.shape != model_mask.shape:
        raise ValueError(f"distill_advantages needs equal shapes, got student {tuple(student_logprobs.shape)}, "
                         f"teacher {tuple(teacher_logprobs.shape)}, mask {tuple(model_mask.shape)}")
    if coef <= 0:
        raise ValueError(f"coef={coef} is invalid: the distillation weight must be > 0")
    # where, not a product: the teacher computes the model's tokens only (NaN on tool output, Trainer.forward_logprobs)
    kl = torch.where(model_mask > 0, student_logprobs.to(torch.float32) - teacher_logprobs.to(torch.float32), 0.0)
    return -coef * kl, kl


TAIL_FLOOR = 1e-6
"""Probability below which the mass outside the top k counts as this floor in `topk_reverse_kl` (float32 rounding of
1 - sum of k probabilities is about k * 6e-8, so smaller tails are noise)."""


def topk_reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, whole_vocabulary: bool = False) -> Tensor:
    """Per-position KL(student || teacher) over the teacher's top-k tokens and one bucket for the rest [T].

    student_logprobs [T, k]: the student's log-probs of the teacher's top-k tokens at each position (with grad, under
    the student's softmax over the whole vocabulary); teacher_logprobs [T, k]: the teacher's of the same tokens. With
    p, q the two distributions lumped into the k tokens and "the rest" (p_rest = 1 - sum_k p, likewise q_rest):

        KL_t = sum_k p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest)

    the KL of the coarsened distributions, which is at most the full KL(p || q) (coarsening cannot increase a KL)
    and equals it when the top k hold the whole vocabulary (whole_vocabulary=True: the rest term is left out, as
    both tails are empty). Each tail below TAIL_FLOOR counts as the floor in the logarithm (no gradient through it),
    so two negligible tails give 0 and a teacher with no mass left outside its top k still bounds the penalty on the
    student's. The gradient is the exact gradient of this KL in the student's logits (it goes through log p_k and
    the student's normaliser, the teacher is constant): the analytic per-position reverse KL of on-policy
    distillation with the teacher's distribution at each position (Agarwal et al. 2024's GKD at beta = 1 on
    student samples, with the teacher's top-k logits as NeMo-RL and TRL keep them), each position its own term."""
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.dim() != 2:
        raise ValueError(f"topk_reverse_kl needs equal [T, k] shapes, got student {tuple(student_logprobs.shape)}, "
                         f"teacher {tuple(teacher_logprobs.shape)}")
    log_p, log_q = student_logprobs.float(), teacher_logprobs.float()
    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum(dim=-1)
    if whole_vocabulary:
        return kl
    p_rest = (1.0 - p.sum(dim=-1)).clamp(min=0.0)
    q_rest = (1.0 - log_q.exp().sum(dim=-1)).clamp(min=0.0)
    return kl + p_rest * (p_rest.clamp(min=TAIL_FLOOR).log() - q_rest.clamp(min=TAIL_FLOOR).log())
