"""Core attention for the local (CPU) layer spec where Megatron-core's local one does not serve:
context parallelism, and multi-latent attention.

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

Multi-latent attention (DeepSeek-V3) gives keys and values of different widths (`k_channels`,
`v_channels`), which Megatron-core's local `DotProductAttention` does not take (only TE's does):
`MaskedAttention` is its plain [s, b, heads, d] counterpart under the trainer's dense mask, and
`AllGatherContextAttention` takes both widths too. gpt-oss's attention sinks (softmax_type "learnable")
and sliding windows are `MaskedAttention`'s as well: Megatron-core's local attention allocates its sinks
on the CUDA device (dot_product_attention.py:126-136), and its sliding-window mask replaces the trainer's
packing mask instead of joining it (fused_softmax.py:321-323).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

Tensor = torch.Tensor


class _CoreAttention(MegatronModule):
    """What both take from Megatron's core-attention constructor (the arguments the attention layers
    build it with): no dropout, and the softmax scale (MLA's own, or 1/sqrt of the key width)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Optional[ProcessGroupCollection] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None):
        super().__init__(config=config)
        if config.attention_dropout and attention_dropout != 0.0:
            raise ValueError(f"{type(self).__name__} has no attention dropout (RL training runs without it)")
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.pg_collection = pg_collection


class AllGatherContextAttention(_CoreAttention):
    """Drop-in `core_attention` of Megatron's local spec for context-parallel training."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("context-parallel attention has no attention sinks or sliding windows")
        pg_collection = self.pg_collection
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        tp_size = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp_size)
        self.groups = divide(config.num_query_groups, tp_size)

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


class MaskedAttention(_CoreAttention):
    """Drop-in `core_attention` of Megatron's local spec for multi-latent attention and gpt-oss's attention
    without context parallelism: softmax(q k^T x scale, masked) v per head, with key and value widths of their
    own; optionally a learned sink logit per head in each softmax (`softmax_offset`, Megatron's name: its
    share of the probability mass goes nowhere) and a sliding window (query i sees keys i - left .. i, on top
    of the trainer's mask, in this layer when `config.window_attn_skip_freq` marks it).

    Inputs [s, b, heads, d] (query and key d = k_channels, value v_channels) and the trainer's dense
    mask [b or 1, 1, s, s] (True = masked out; None: causal); output [s, b, heads * v_channels].
    """

    def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any):
        super().__init__(config, layer_number, *args, **kwargs)
        if config.context_parallel_size != 1:
            raise ValueError("MaskedAttention does not split sequences: context parallelism uses "
                             "AllGatherContextAttention")
        self.window: Optional[int] = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"window_size={config.window_size}: causal attention sees no later keys (right = 0)")
            self.window = left
        self.softmax_offset: Optional[torch.nn.Parameter] = None
        if config.softmax_type == "learnable":
            tp = (self.pg_collection or ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])).tp
            heads = divide(config.num_attention_heads, tp.size())
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: MaskedAttention has vanilla and learnable")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The sinks split over TP ranks along the heads in distributed checkpoints, as Megatron-core's
        attentions save theirs (dot_product_attention.py:sharded_state_dict)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if self.softmax_offset is None:
            return {}
        tp = (self.pg_collection or ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])).tp
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=tp, dp_cp_group=metadata["dp_cp_group"])

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Tensor:
        if query.dim() != 4:
            raise ValueError("MaskedAttention takes [s, b, heads, d] inputs and a dense mask (THD layouts come "
                             "with context parallelism or Transformer Engine)")
        if key.shape[2] != query.shape[2]:  # grouped-query attention
            key = key.repeat_interleave(query.shape[2] // key.shape[2], dim=2)
            value = value.repeat_interleave(query.shape[2] // value.shape[2], dim=2)
        scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), key.float()) * self.scale
        sq, sk = scores.shape[-2:]
        if attention_mask is None:
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
        if self.window is not None:  # the last queries are the last positions
            positions = torch.arange(sk, device=scores.device)
            distance = positions[sk - sq:, None] - positions  # query i is key position i + sk - sq
            attention_mask = attention_mask | (distance > self.window)
        scores = scores.masked_fill(attention_mask, float("-inf"))
        if self.softmax_offset is None:
            probs = torch.softmax(scores, dim=-1).to(value.dtype)
        else:
            sinks = self.softmax_offset.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1].to(value.dtype)
        out = torch.einsum("bhqk,kbhd->qbhd", probs, value)
        return out.reshape(out.shape[0], out.shape[1], -1)


class PackedAttention(_CoreAttention):
    """Drop-in `core_attention` of Megatron's local spec for packed rows on the CPU path: causal attention
    within each packed sample only, one `scaled_dot_product_attention` call per sample, from the row's
    `cu_seqlens` (THD inputs, as TE's attention takes them on GPU).

    Megatron-core's local `DotProductAttention` takes a dense [S, S] mask instead, so it computes (and
    differentiates) all S^2 scores of a row of S tokens and masks those between samples away; RL rows
    pack many short samples, and those scores were most of a CPU training step (a row of 512 tokens
    holding ~17 samples of 30: 262k scores where the samples need 15k). Here a row costs the sum of
    its samples' squared lengths (the padding at its end is one more segment; its outputs feed nothing).

    Inputs: query [t, heads, d], key and value [t, groups, d] and `packed_seq_params.cu_seqlens_q`;
    output [t, heads * d].
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Tensor:
        if query.dim() != 3 or packed_seq_params is None:
            raise ValueError("PackedAttention takes THD inputs [t, heads, d] and the row's PackedSeqParams")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        gqa = query.shape[1] != key.shape[1]
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:  # [1, heads, L, d] per sample
                q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                outputs.append(torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa).squeeze(0).transpose(0, 1))
        out = torch.cat(outputs) if outputs else query.new_zeros(0, query.shape[1], value.shape[-1])
        return out.reshape(out.shape[0], -1)
