"""The critic's value head: a GPTModel whose output layer maps each final hidden state to one value.

Written by hand because Megatron-core has no value head: `attach_value_head` swaps the model's
`output_layer` (a vocab-parallel `ColumnParallelLinear`) for `ValueHead`, which GPTModel calls the
same way, so the forward, the pipeline schedule and the sharded checkpoints stay Megatron's.

The head is replicated over tensor-parallel ranks (one output column cannot be split): each rank
computes every position's value from the full hidden states. Under sequence parallelism it gathers
the sequence first, with a backward that only splits the gradient again (no sum: every rank's
gradient is already the whole one), so its weight gradient is the same on every TP rank, as the
replicated parameters of a Megatron model need. Zero-initialised: a new critic predicts 0
everywhere, so its first advantages are exactly the critic-free GAE's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

Tensor = torch.Tensor
# the head's parameters (Megatron's language-model checkpointing expects an output_layer.weight)
HEAD_PARAMETERS = ("output_layer.weight", "output_layer.bias")


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] (the sequence split over TP ranks under sequence parallelism) -> values [s, b, 1]."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel  # GPTModel reads this attribute of its output layer
        self.tp_group = tp_group

    def forward(self, hidden: Tensor, weight: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        # fp32: a bf16 output would round values near 1 to ~4e-3, the baseline GAE subtracts
        values = torch.nn.functional.linear(hidden.float(), self.weight.float(), self.bias.float())
        return values, None


def attach_value_head(module: torch.nn.Module, groups: Any) -> None:
    """Replace the last pipeline stage's output layer of `module` (a GPTModel built without tied
    embeddings) by a zero `ValueHead`; other stages have no output layer and stay as they are."""
    if not getattr(module, "post_process", False):
        return
    if getattr(module, "share_embeddings_and_output_weights", False):
        raise ValueError("a value head needs a model built without tied embeddings (tie_word_embeddings=false)")
    config = module.config
    tp_group = groups.tp_group if groups.tp_size > 1 else None
    device = next(module.parameters()).device
    module.output_layer = ValueHead(config.hidden_size, config.params_dtype, groups.sequence_parallel and
                                    groups.tp_size > 1, tp_group).to(device)


def is_head_parameter(name: str) -> bool:
    """Whether `name` (in a critic's module) is one of the value head's parameters."""
    return name in HEAD_PARAMETERS
