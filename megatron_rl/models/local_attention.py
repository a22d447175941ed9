"""Core attention for context parallelism on the local (CPU) layer spec.

Megatron-core supports context parallelism only in `TEDotProductAttention` (its local
`DotProductAttention` asserts `context_parallel_size == 1`), and Transformer Engine needs
CUDA. This module takes the local attention's place when `parallel.cp > 1` without TE, so
that context parallelism runs, and is tested against the single-rank model, on the CPU
path. It is the all-gather variant of context parallelism: each rank's keys and values are
all-gathered over the context-parallel group (Megatron's sequence-parallel all-gather, whose
backward reduce-scatters the key/value gradients to their owners), and each local query
attends over the gathered keys under the mask that `trainer.context_parallel.shard` built
for this rank's positions. Memory per rank is O(S/cp x S) for the scores, which is what
the CPU path needs; the GPU path uses TE's ring attention instead.

Inputs come in THD layout (the trainer passes `PackedSeqParams(qkv_format="thd")` under
context parallelism, and Megatron's attention squeezes the batch dimension):
query [t, heads, d], key and value [t, groups, d]; the output is [t, heads * d].
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

Tensor = torch.Tensor


class AllGatherContextAttention(MegatronModule):
    """Drop-in `core_attention` of Megatron's local spec for context-parallel training."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        if config.attention_dropout and attention_dropout != 0.0:
            raise ValueError("AllGatherContextAttention has no attention dropout (RL training runs without it)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        tp_size = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp_size)
        self.groups = divide(config.num_query_groups, tp_size)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Tensor:
        if query.dim() != 3 or attention_mask is None:
            raise ValueError("context-parallel attention takes THD inputs [t, heads, d] and the mask "
                             "of trainer.context_parallel.shard(with_mask=True)")
        key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=self.cp_group)
        if self.heads != self.groups:  # grouped-query attention: each key/value head serves heads/groups queries
            key = key.repeat_interleave(self.heads // self.groups, dim=1)
            value = value.repeat_interleave(self.heads // self.groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * self.scale
        scores = scores.masked_fill(attention_mask.view(1, *attention_mask.shape[-2:]), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        out = torch.einsum("hqk,khd->qhd", probs, value)
        return out.reshape(out.shape[0], -1)
