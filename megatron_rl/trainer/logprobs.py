"""Per-token log-probabilities and entropy from vocab-parallel logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary ([..., V/tp]); the
full-vocabulary logits are never gathered. Log-probs use Megatron's
`vocab_parallel_cross_entropy` (max / sum-exp all-reduced over TP, with its backward).
Entropy has no upstream vocab-parallel version, so it is written here:
H = logZ - E_p[l], with gradient dH/dl_i = -p_i (l_i - E_p[l]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per position. logits: [..., V/tp] (this rank's slice), targets: [...]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float(), targets)


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, group) -> Tensor:
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        global_max = local_max.clone()
        if group is not None:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
        if group is not None:
            dist.all_reduce(sums, group=group)
        sum_exp, sum_exp_l = sums[0], sums[1]
        mean_shifted = sum_exp_l / sum_exp  # E_p[l] - max
        entropy = sum_exp.log() - mean_shifted
        probs = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(probs, shifted, mean_shifted)
        return entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        probs, shifted, mean_shifted = ctx.saved_tensors
        grad = -probs * (shifted - mean_shifted.unsqueeze(-1)) * grad_out.unsqueeze(-1)
        return grad, None


def vocab_parallel_entropy(logits: Tensor, group=None) -> Tensor:
    """Entropy of the full-vocabulary softmax per position, from this rank's logits slice.

    `group` is the tensor-parallel group (None when tp == 1).
    """
    return _VocabParallelEntropy.apply(logits, group)
