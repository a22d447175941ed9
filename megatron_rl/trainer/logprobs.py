"""Per-token log-probabilities and entropy from vocab-parallel logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary ([..., V/tp]); the
full-vocabulary logits are never gathered. Log-probs use Megatron's
`vocab_parallel_cross_entropy` (max / sum-exp all-reduced over TP, with its backward).
Entropy has no upstream vocab-parallel version, so it is written here:
H = logZ - E_p[l], with gradient dH/dl_i = -p_i (l_i - E_p[l]).

The fused path (`model.fused_logprobs`, the default) never forms the logits: the model returns
its final hidden states (`hidden_states_instead_of_logits`) and `megatron_rl_kernels.fused_logprobs`
computes log-probs and entropy from them and the output weight shard, chunk by chunk.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

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


@contextlib.contextmanager
def hidden_states_instead_of_logits(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup],
                                    sequence_parallel: bool) -> Iterator[None]:
    """While active, Megatron's `GPTModel` (this rank's last pipeline stage) returns its final
    hidden states [b, s, h] (after the final norm) instead of vocab-parallel logits.

    The output layer's forward is replaced by what `ColumnParallelLinear` does to its input
    before the GEMM (megatron/core/tensor_parallel/layers.py, `linear_with_grad_accumulation_
    and_async_allreduce`): gather over the sequence-parallel region (backward: reduce-scatter),
    or, with plain TP, an identity whose backward all-reduces, so the hidden-state gradient of
    each rank's vocabulary shard is summed over the group exactly as in the naive path.
    """
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer = model.output_layer

    def forward(hidden: Tensor, weight: Optional[Tensor] = None, runtime_gather_output=None):
        if tp_group is not None and sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
        elif tp_group is not None:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
        return hidden, None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def output_weight(model: torch.nn.Module) -> Tensor:
    """The [V/tp, h] weight `GPTModel` hands its output layer (the embedding when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def fused_vocab_parallel_stats(hidden: Tensor, weight: Tensor, targets: Tensor, tp_group, tp_rank: int,
                               temperature: float, with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
    """Log-probs [T] (and entropy [T]) from hidden [T, h] and this rank's weight shard [V/tp, h]."""
    from megatron_rl_kernels import fused_logprobs

    return fused_logprobs(hidden, weight, targets, tp_group=tp_group, vocab_start=tp_rank * weight.shape[0],
                          temperature=temperature, with_entropy=with_entropy)
